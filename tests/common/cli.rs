//! Running the `kiln` binary the way end-to-end tests do, shared by the test binaries that
//! include it: a cache folder of the test's own, and no environment switch of the developer's
//! shell (profiling, resident weights) changing what runs.

use std::path::Path;
use std::process::{Command, Output};

/// `kiln ARGS` with `KILN_CACHE_DIR=cache`, waited for.
pub fn kiln(cache: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .env("KILN_CACHE_DIR", cache)
        .env_remove("KILN_PROFILE")
        .env_remove("KILN_RESIDENT")
        .output()
        .expect("kiln runs")
}
