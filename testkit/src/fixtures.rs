//! Model fixtures with a chat template added, for tests of the chat front ends (`kiln chat`,
//! `kiln run --chat`, `kiln serve`): the committed fixtures carry none.

use std::path::Path;

/// A copy of the model folder `fixture` in a new temporary folder, with `template` as its
/// `chat_template.jinja`.
pub fn with_chat_template(fixture: &Path, template: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("a temporary folder");
    for entry in std::fs::read_dir(fixture).expect("the fixture folder") {
        let entry = entry.expect("a fixture file");
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).expect("fixture file copied");
    }
    std::fs::write(dir.path().join("chat_template.jinja"), template).expect("template written");
    dir
}
