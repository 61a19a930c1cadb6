//! Split GGUF models, as llama.cpp's `gguf-split` writes them and the hub serves large models:
//! `name-00001-of-00003.gguf`, `name-00002-of-00003.gguf`, ... Each part is a complete GGUF
//! file with its own header and a subset of the tensors (offsets relative to its own data
//! section). The first part carries all the metadata; every part carries `split.no` (0-based),
//! `split.count` and `split.tensors.count` (the total over all parts). The first part may hold
//! no tensors at all (`--no-tensor-first-split`).
//!
//! Kiln reads the parts in place, each memory-mapped (no joined copy): [`open_model`] opens the
//! first part, finds the others next to it by name, checks that they belong together, and
//! returns one header whose tensors say which part holds them ([`TensorInfo::part`]). A file
//! with `split.count` absent, 0 (what `gguf-split --merge` writes) or 1 is a single file.
//!
//! [`TensorInfo::part`]: super::parse::TensorInfo::part

use super::error::GgufError;
use super::parse::GgufHeader;
use memmap2::Mmap;
use std::fs::File;
use std::path::{Path, PathBuf};

/// Index of this part, from 0.
pub const KEY_NO: &str = "split.no";
/// Number of parts.
pub const KEY_COUNT: &str = "split.count";
/// Number of tensors in all parts together.
pub const KEY_TENSORS: &str = "split.tensors.count";

/// `prefix-00002-of-00003.gguf` (any case of `.gguf`) → `("prefix", 2, 3)`: the name
/// llama.cpp gives part 2 of 3. `None` for any other name.
pub fn split_name(file_name: &str) -> Option<(&str, u32, u32)> {
    let stem = strip_gguf(file_name)?;
    let (rest, count) = stem.rsplit_once("-of-")?;
    let (prefix, index) = rest.rsplit_once('-')?;
    let num = |s: &str| -> Option<u32> {
        (s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit()))
            .then(|| s.parse().ok())
            .flatten()
    };
    let (index, count) = (num(index)?, num(count)?);
    (!prefix.is_empty() && (1..=count).contains(&index)).then_some((prefix, index, count))
}

/// The file name of part `index` (from 1) of `count`: `prefix-0000i-of-0000n.gguf`.
pub fn part_name(prefix: &str, index: u32, count: u32) -> String {
    format!("{prefix}-{index:05}-of-{count:05}.gguf")
}

/// `name` without a final `.gguf` in any case.
fn strip_gguf(name: &str) -> Option<&str> {
    let cut = name.len().checked_sub(5)?;
    (name.is_char_boundary(cut) && name[cut..].eq_ignore_ascii_case(".gguf")).then(|| &name[..cut])
}

/// A GGUF model opened for reading: its files (one, or every part of a split model, first
/// part first), each open and mapped, and one header over all of them.
#[derive(Debug)]
pub struct GgufFiles {
    pub paths: Vec<PathBuf>,
    /// Each part's open file, the one its map was made from.
    pub files: Vec<File>,
    pub maps: Vec<Mmap>,
    pub header: GgufHeader,
}

/// Opens the GGUF model at `path`: a single file, or the first part of a split model, whose
/// other parts must sit next to it under llama.cpp's names. Every part's header is parsed and
/// checked to belong to the same split (`split.no`, `split.count`, the total tensor count).
pub fn open_model(path: &Path) -> Result<GgufFiles, GgufError> {
    let (file, map, header) = super::open_file(path)?;
    let Some((no, count)) = split_keys(&header, path)? else {
        return Ok(GgufFiles {
            paths: vec![path.to_path_buf()],
            files: vec![file],
            maps: vec![map],
            header,
        });
    };
    let err = |message: String| GgufError::Split {
        path: path.to_path_buf(),
        message,
    };
    let file_name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
    let named = split_name(file_name).filter(|&(_, _, c)| c == count);
    if no != 0 {
        let first = match named {
            Some((prefix, _, _)) => format!("; open its first part {}", part_name(prefix, 1, count)),
            None => String::new(),
        };
        return Err(err(format!(
            "this is part {} of {count} of a split model{first}",
            no + 1
        )));
    }
    let Some((prefix, 1, _)) = named else {
        return Err(err(format!(
            "{KEY_COUNT} is {count}, but the file name does not end in -00001-of-{count:05}.gguf, \
             so the other parts cannot be found"
        )));
    };
    let dir = path.parent().unwrap_or(Path::new(""));
    let mut paths = vec![path.to_path_buf()];
    let mut files = vec![file];
    let mut maps = vec![map];
    let mut headers = vec![header];
    for index in 2..=count {
        let part = dir.join(part_name(prefix, index, count));
        if !part.exists() {
            return Err(err(format!(
                "part {index} of {count} is missing (expected {})",
                part.display()
            )));
        }
        let (file, map, header) = super::open_file(&part)?;
        match split_keys(&header, &part)? {
            Some((n, c)) if n + 1 == index && c == count => {}
            found => {
                let found = match found {
                    Some((n, c)) => format!("part {} of {c}", n + 1),
                    None => "not a split part".to_string(),
                };
                return Err(GgufError::Split {
                    path: part,
                    message: format!("expected part {index} of {count} of {}, found {found}", path.display()),
                });
            }
        }
        paths.push(part);
        files.push(file);
        maps.push(map);
        headers.push(header);
    }
    let expected = headers[0].get(KEY_TENSORS).and_then(|v| v.as_u64());
    let refs: Vec<&Path> = paths.iter().map(PathBuf::as_path).collect();
    let header = GgufHeader::join_parts(headers, &refs)?;
    if let Some(expected) = expected
        && expected != header.tensors.len() as u64
    {
        return Err(err(format!(
            "the {count} parts hold {} tensors, but {KEY_TENSORS} is {expected}",
            header.tensors.len()
        )));
    }
    Ok(GgufFiles {
        paths,
        files,
        maps,
        header,
    })
}

/// `(split.no, split.count)` of a part of a split model; `None` for a single file
/// (`split.count` absent, 0 or 1).
fn split_keys(header: &GgufHeader, path: &Path) -> Result<Option<(u32, u32)>, GgufError> {
    let uint = |key: &str| -> Result<Option<u32>, GgufError> {
        match header.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| GgufError::BadKey {
                    path: path.to_path_buf(),
                    key: key.to_string(),
                    problem: format!("is {}, expected a part number", v.describe()),
                }),
        }
    };
    let count = uint(KEY_COUNT)?.unwrap_or(0);
    if count <= 1 {
        return Ok(None);
    }
    let no = uint(KEY_NO)?.unwrap_or(0);
    if no >= count {
        return Err(GgufError::BadKey {
            path: path.to_path_buf(),
            key: KEY_NO.into(),
            problem: format!("is {no}, but {KEY_COUNT} is {count}"),
        });
    }
    Ok(Some((no, count)))
}

#[cfg(test)]
mod tests {
    //! Split models built from the committed fixtures with `kiln_testkit::gguf_split` (which
    //! writes parts as llama.cpp's `gguf-split` does) load exactly as the whole file.

    use super::*;
    use kiln_testkit::gguf_split::{part_names, split_gguf};

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/gguf")
            .join(name)
    }

    /// Writes the parts of `file` split into `per_part` tensors each into `dir` as
    /// `model-0000i-of-0000n.gguf`; returns their paths.
    fn write_split(dir: &Path, file: &str, per_part: usize, empty_first: bool) -> Vec<PathBuf> {
        let parts = split_gguf(&std::fs::read(fixture(file)).unwrap(), per_part, empty_first);
        let names = part_names("model", parts.len());
        names
            .iter()
            .zip(parts)
            .map(|(n, bytes)| {
                std::fs::write(dir.join(n), bytes).unwrap();
                dir.join(n)
            })
            .collect()
    }

    #[test]
    fn split_names_are_llama_cpps() {
        assert_eq!(split_name("a-Q4_K_M-00002-of-00003.gguf"), Some(("a-Q4_K_M", 2, 3)));
        assert_eq!(split_name("x-00001-of-00001.GGUF"), Some(("x", 1, 1)));
        for bad in [
            "a-00004-of-00003.gguf",
            "a-00000-of-00003.gguf",
            "a-0001-of-00003.gguf",
            "-00001-of-00003.gguf",
            "a-00001-of-00003.bin",
            "a.gguf",
            "a-00001-of-0000x.gguf",
        ] {
            assert_eq!(split_name(bad), None, "{bad}");
        }
        assert_eq!(part_name("a-Q8_0", 2, 12), "a-Q8_0-00002-of-00012.gguf");
    }

    /// Invariant: a split model is the same model as the file it was split from: same spec,
    /// every weight's bytes (after the llama q/k reordering) identical, same tokenizer.
    #[test]
    fn a_split_model_loads_as_the_whole_file() {
        let whole = super::super::load(&fixture("llama-q8_0.gguf")).unwrap();
        for empty_first in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            let paths = write_split(dir.path(), "llama-q8_0.gguf", 7, empty_first);
            assert!(paths.len() >= 3, "{} parts", paths.len());
            let split = super::super::load(&paths[0]).unwrap();
            assert_eq!(split.parts, paths);
            assert_eq!(split.path, paths[0]);
            assert_eq!(split.spec, whole.spec);
            for (id, w) in whole.spec.weight_ids() {
                let a = whole.weights.tensor(id).unwrap();
                let b = split.weights.tensor(id).unwrap();
                assert_eq!(a.data, b.data, "{}", w.name);
                assert!((b.ptr() as usize).is_multiple_of(super::super::weights::TENSOR_ALIGN));
            }
            assert!(split.weights.header().tensors.iter().any(|t| t.part == paths.len() - 1));
            let text = "Hello, split world";
            assert_eq!(
                split.tokenizer.encode(text, true).unwrap(),
                whole.tokenizer.encode(text, true).unwrap()
            );
            assert_eq!(split.chat_template, whole.chat_template);
        }
    }

    /// Each way the parts can fail to fit together is one line naming the file and the
    /// problem, never a panic or a half-loaded model.
    #[test]
    fn parts_that_do_not_fit_are_refused_clearly() {
        let dir = tempfile::tempdir().unwrap();
        let (_, header) = super::super::open(&fixture("llama-q8_0.gguf")).unwrap();
        let paths = write_split(dir.path(), "llama-q8_0.gguf", header.tensors.len().div_ceil(3), false);
        assert_eq!(paths.len(), 3);
        let err = |p: &Path| super::super::load(p).unwrap_err().to_string();

        // Opening a later part.
        let e = err(&paths[1]);
        assert_eq!(
            e,
            format!(
                "{}: split model: this is part 2 of 3 of a split model; open its first part \
                 model-00001-of-00003.gguf",
                paths[1].display()
            )
        );
        // A first part renamed: the others cannot be found.
        let renamed = dir.path().join("renamed.gguf");
        std::fs::copy(&paths[0], &renamed).unwrap();
        assert!(
            err(&renamed).contains("does not end in -00001-of-00003.gguf"),
            "{}",
            err(&renamed)
        );
        // A missing part.
        let moved = dir.path().join("moved");
        std::fs::rename(&paths[2], &moved).unwrap();
        let e = err(&paths[0]);
        assert!(
            e.starts_with(&format!("{}: split model: part 3 of 3 is missing", paths[0].display())),
            "{e}"
        );
        // A part of another model in its place.
        std::fs::copy(&paths[1], &paths[2]).unwrap();
        let e = err(&paths[0]);
        assert!(
            e.contains("expected part 3 of 3") && e.contains("found part 2 of 3"),
            "{e}"
        );
        std::fs::rename(&moved, &paths[2]).unwrap();
        super::super::load(&paths[0]).unwrap();

        // split.tensors.count that disagrees with the parts.
        let mut first = std::fs::read(&paths[0]).unwrap();
        let key = b"split.tensors.count";
        let at = first.windows(key.len()).position(|w| w == key).unwrap() + key.len() + 4;
        let n = i32::from_le_bytes(first[at..at + 4].try_into().unwrap());
        first[at..at + 4].copy_from_slice(&(n + 1).to_le_bytes());
        std::fs::write(&paths[0], first).unwrap();
        let e = err(&paths[0]);
        assert!(
            e.ends_with(&format!(
                "the 3 parts hold {n} tensors, but split.tensors.count is {}",
                n + 1
            )),
            "{e}"
        );
    }
}
