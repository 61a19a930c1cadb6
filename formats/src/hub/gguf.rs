//! GGUF repositories: which files `org/name:QUANT`, `org/name/FILE.gguf` or a plain
//! `org/name` without safetensors weights mean, picked as llama.cpp's `-hf` picks them.
//!
//! A repository's GGUF *models* are its `.gguf` files other than `mmproj` and `imatrix` ones,
//! the parts of a split model (`name-0000i-of-0000n.gguf`, see [`crate::gguf::split`]) taken
//! together. A model carries a quant when one of the `-`/`.`-separated words of its file name
//! (without `.gguf` and the split suffix) is that quant, compared without case: `Q4_K_M` is
//! the word of `Qwen2.5-0.5B-Instruct-Q4_K_M.gguf` and of `model.q4_k_m-00001-of-00002.gguf`,
//! and never matches `Q4_K_S`, `IQ4_K_M` or `Q4_K_M_L`. Without a quant, `Q4_K_M` is taken if
//! present, else `Q8_0`, else the first model by name, as llama.cpp does.

use super::{HubError, HubSpec};
use crate::gguf::split::{part_name, split_name};
use std::collections::BTreeMap;
use std::path::Path;

/// The quants tried, in order, when a GGUF repository is named without one.
pub const DEFAULT_QUANTS: [&str; 2] = ["Q4_K_M", "Q8_0"];

/// What a hub id asks for beyond the repository.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Select {
    /// `org/name`: the safetensors weights, or the default GGUF model of a GGUF-only repo.
    Default,
    /// `org/name:QUANT`: the GGUF model carrying that quant.
    Quant(String),
    /// `org/name/FILE.gguf`: that GGUF file (a split model's parts come with any one of them).
    File(String),
}

/// One GGUF model of a repository: a single file or the parts of a split model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GgufModel {
    /// Repository path of its only file, or of the first part.
    pub first: String,
    /// Number of files (1 for a single file).
    pub parts: u32,
}

impl GgufModel {
    /// Repository paths of every file, first part first.
    pub fn files(&self) -> Vec<String> {
        if self.parts <= 1 {
            return vec![self.first.clone()];
        }
        let (dir, name) = split_dir(&self.first);
        let (prefix, _, count) = split_name(name).expect("a split model's first part has a split name");
        (1..=count)
            .map(|i| format!("{dir}{}", part_name(prefix, i, count)))
            .collect()
    }

    /// The words of its file name a quant is matched against.
    fn words(&self) -> Vec<&str> {
        let name = split_dir(&self.first).1;
        let stem = match split_name(name) {
            Some((prefix, _, _)) => prefix,
            None => &name[..name.len() - ".gguf".len()],
        };
        stem.split(['-', '.']).collect()
    }

    /// Whether it carries `quant` (see the module documentation).
    pub fn has_quant(&self, quant: &str) -> bool {
        self.words().iter().any(|w| w.eq_ignore_ascii_case(quant))
    }

    /// The quant its name ends with (upper case), as llama.cpp names a model's tag.
    pub fn quant(&self) -> Option<String> {
        let last = *self.words().last()?;
        let quant_like = last.len() >= 2
            && last.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
            && last.bytes().any(|b| b.is_ascii_digit());
        (quant_like && self.words().len() > 1).then(|| last.to_ascii_uppercase())
    }

    /// `name.gguf`, or `name-00001-of-00003.gguf (3 parts)`, for messages.
    pub fn describe(&self) -> String {
        if self.parts > 1 {
            format!("{} ({} parts)", self.first, self.parts)
        } else {
            self.first.clone()
        }
    }
}

/// `dir/` and the file name of a repository path.
fn split_dir(path: &str) -> (&str, &str) {
    match path.rfind('/') {
        Some(i) => (&path[..=i], &path[i + 1..]),
        None => ("", path),
    }
}

/// Whether a repository file is a GGUF model file (not a projector or an importance matrix).
pub fn is_model_file(path: &str) -> bool {
    let name = split_dir(path).1;
    let lower = name.to_ascii_lowercase();
    lower.len() > ".gguf".len() && lower.ends_with(".gguf") && !lower.contains("mmproj") && !lower.contains("imatrix")
}

/// The GGUF models among `files` (repository paths), sorted by name; a split model appears
/// once, by its first part, whether or not every part is listed.
pub fn models<'a>(files: impl IntoIterator<Item = &'a str>) -> Vec<GgufModel> {
    let mut found: BTreeMap<String, u32> = BTreeMap::new();
    for f in files.into_iter().filter(|f| is_model_file(f)) {
        let (dir, name) = split_dir(f);
        let model = match split_name(name) {
            Some((prefix, _, count)) if count > 1 => (format!("{dir}{}", part_name(prefix, 1, count)), count),
            _ => (f.to_string(), 1),
        };
        found.insert(model.0, model.1);
    }
    found
        .into_iter()
        .map(|(first, parts)| GgufModel { first, parts })
        .collect()
}

/// `its GGUF files: a.gguf, b-00001-of-00002.gguf (2 parts)`, or that it has none.
pub fn available(models: &[GgufModel]) -> String {
    if models.is_empty() {
        return "it has no GGUF model files".into();
    }
    let list: Vec<String> = models.iter().map(GgufModel::describe).collect();
    format!("its GGUF files: {}", list.join(", "))
}

/// The model `spec` selects among `models` of its repository. For [`Select::Default`] it is
/// the llama.cpp default; `Ok(None)` when there is no GGUF model.
pub fn pick(select: &Select, models: &[GgufModel], spec: &HubSpec) -> Result<Option<GgufModel>, HubError> {
    let model = spec.repo_only().to_string();
    match select {
        Select::Default => Ok(DEFAULT_QUANTS
            .iter()
            .find_map(|q| models.iter().find(|m| m.has_quant(q)))
            .or(models.first())
            .cloned()),
        Select::Quant(quant) => {
            let matching: Vec<&GgufModel> = models.iter().filter(|m| m.has_quant(quant)).collect();
            match matching[..] {
                [one] => Ok(Some(one.clone())),
                [] => Err(HubError::NoQuant {
                    model,
                    quant: quant.clone(),
                    available: available(models),
                }),
                _ => Err(HubError::AmbiguousQuant {
                    model,
                    repo: spec.repo_id.clone(),
                    quant: quant.clone(),
                    matches: matching.iter().map(|m| m.describe()).collect::<Vec<_>>().join(", "),
                }),
            }
        }
        Select::File(file) => {
            let holds = |m: &&GgufModel, exact: bool| {
                m.files()
                    .iter()
                    .any(|f| if exact { f == file } else { f.eq_ignore_ascii_case(file) })
            };
            models
                .iter()
                .find(|m| holds(m, true))
                .or_else(|| models.iter().find(|m| holds(m, false)))
                .cloned()
                .map(Some)
                .ok_or_else(|| HubError::NoSuchFile {
                    model,
                    file: file.clone(),
                    available: available(models),
                })
        }
    }
}

/// Relative paths of every file under `snapshot` (a snapshot folder of the cache, or any
/// folder), links included whether or not their target is there, `/`-separated, sorted.
pub fn snapshot_files(snapshot: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![(snapshot.to_path_buf(), String::new())];
    while let Some((dir, prefix)) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        for e in entries.flatten() {
            let Some(name) = e.file_name().to_str().map(str::to_string) else {
                continue;
            };
            let rel = format!("{prefix}{name}");
            match e.file_type() {
                Ok(t) if t.is_dir() => stack.push((e.path(), format!("{rel}/"))),
                Ok(_) => out.push(rel),
                Err(_) => {}
            }
        }
    }
    out.sort();
    out
}

/// The first file of `model` that `snapshot` lacks (or whose blob is gone).
pub fn missing_part(snapshot: &Path, model: &GgufModel) -> Option<String> {
    model.files().into_iter().find(|f| !snapshot.join(f).is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILES: [&str; 12] = [
        "README.md",
        "Qwen2.5-0.5B-Instruct-Q4_K_M.gguf",
        "Qwen2.5-0.5B-Instruct-Q4_K_S.gguf",
        "Qwen2.5-0.5B-Instruct-IQ4_XS.gguf",
        "Qwen2.5-0.5B-Instruct.IQ4_0.gguf",
        "qwen2.5-0.5b-instruct-q4_0.gguf",
        "Qwen2.5-0.5B-Instruct-Q8_0.gguf",
        "big/Qwen2.5-0.5B-Instruct-Q6_K-00002-of-00003.gguf",
        "big/Qwen2.5-0.5B-Instruct-Q6_K-00001-of-00003.gguf",
        "big/Qwen2.5-0.5B-Instruct-Q6_K-00003-of-00003.gguf",
        "mmproj-Qwen2.5-F16.gguf",
        "Qwen2.5-0.5B-Instruct-imatrix.gguf",
    ];

    fn pick_in(files: &[&str], select: Select) -> Result<Option<GgufModel>, HubError> {
        pick(
            &select,
            &models(files.iter().copied()),
            &HubSpec::parse("acme/q").unwrap(),
        )
    }

    fn first(files: &[&str], select: Select) -> String {
        pick_in(files, select).unwrap().unwrap().first
    }

    fn quant(q: &str) -> Select {
        Select::Quant(q.into())
    }

    /// Invariant: a quant matches one whole word of the name, in any case, never a longer or
    /// shorter quant that contains it or is contained in it.
    #[test]
    fn a_quant_matches_exactly_one_word_in_any_case() {
        assert_eq!(first(&FILES, quant("q4_k_m")), "Qwen2.5-0.5B-Instruct-Q4_K_M.gguf");
        assert_eq!(first(&FILES, quant("Q4_K_S")), "Qwen2.5-0.5B-Instruct-Q4_K_S.gguf");
        assert_eq!(first(&FILES, quant("Q4_0")), "qwen2.5-0.5b-instruct-q4_0.gguf");
        assert_eq!(first(&FILES, quant("iq4_0")), "Qwen2.5-0.5B-Instruct.IQ4_0.gguf");
        let split = pick_in(&FILES, quant("Q6_K")).unwrap().unwrap();
        assert_eq!(split.parts, 3);
        assert_eq!(
            split.files(),
            (1..=3)
                .map(|i| format!("big/Qwen2.5-0.5B-Instruct-Q6_K-0000{i}-of-00003.gguf"))
                .collect::<Vec<_>>()
        );
        for absent in ["Q4_K", "Q4", "K_M", "Q6_K_L", "F16", "imatrix"] {
            let e = pick_in(&FILES, quant(absent)).unwrap_err();
            assert!(matches!(e, HubError::NoQuant { .. }), "{absent}: {e}");
        }
        let e = pick_in(&FILES, quant("Q5_K_M")).unwrap_err().to_string();
        assert_eq!(
            e,
            "model acme/q has no GGUF file for quant Q5_K_M; its GGUF files: \
             Qwen2.5-0.5B-Instruct-IQ4_XS.gguf, Qwen2.5-0.5B-Instruct-Q4_K_M.gguf, \
             Qwen2.5-0.5B-Instruct-Q4_K_S.gguf, Qwen2.5-0.5B-Instruct-Q8_0.gguf, \
             Qwen2.5-0.5B-Instruct.IQ4_0.gguf, \
             big/Qwen2.5-0.5B-Instruct-Q6_K-00001-of-00003.gguf (3 parts), \
             qwen2.5-0.5b-instruct-q4_0.gguf"
        );
        let e = pick_in(&["README.md"], quant("Q8_0")).unwrap_err().to_string();
        assert_eq!(
            e,
            "model acme/q has no GGUF file for quant Q8_0; it has no GGUF model files"
        );
    }

    #[test]
    fn several_matches_are_listed_not_guessed() {
        let files = ["a-Q8_0.gguf", "sub/a-Q8_0.gguf", "b-Q4_0.gguf"];
        let e = pick_in(&files, quant("Q8_0")).unwrap_err().to_string();
        assert_eq!(
            e,
            "quant Q8_0 matches several GGUF files of model acme/q: a-Q8_0.gguf, sub/a-Q8_0.gguf; \
             name one as acme/q/FILE"
        );
    }

    /// Invariant: without a quant the pick is llama.cpp's: Q4_K_M, else Q8_0, else the first.
    #[test]
    fn the_default_is_llama_cpps() {
        assert_eq!(first(&FILES, Select::Default), "Qwen2.5-0.5B-Instruct-Q4_K_M.gguf");
        let no_q4km: Vec<&str> = FILES.iter().copied().filter(|f| !f.contains("Q4_K_M")).collect();
        assert_eq!(first(&no_q4km, Select::Default), "Qwen2.5-0.5B-Instruct-Q8_0.gguf");
        assert_eq!(
            first(&["z-F16.gguf", "a-Q5_K_S.gguf"], Select::Default),
            "a-Q5_K_S.gguf"
        );
        assert_eq!(pick_in(&["README.md", "mmproj.gguf"], Select::Default).unwrap(), None);
    }

    #[test]
    fn a_file_is_found_by_name_and_brings_its_split_parts() {
        let file = |f: &str| Select::File(f.into());
        assert_eq!(
            first(&FILES, file("Qwen2.5-0.5B-Instruct-Q8_0.gguf")),
            "Qwen2.5-0.5B-Instruct-Q8_0.gguf"
        );
        assert_eq!(
            first(&FILES, file("qwen2.5-0.5b-instruct-q8_0.gguf")),
            "Qwen2.5-0.5B-Instruct-Q8_0.gguf"
        );
        let part2 = "big/Qwen2.5-0.5B-Instruct-Q6_K-00002-of-00003.gguf";
        assert_eq!(pick_in(&FILES, file(part2)).unwrap().unwrap().parts, 3);
        let e = pick_in(&FILES, file("nope.gguf")).unwrap_err().to_string();
        assert!(
            e.starts_with("model acme/q has no GGUF file nope.gguf; its GGUF files: "),
            "{e}"
        );
    }

    #[test]
    fn split_models_are_grouped_even_when_parts_are_missing() {
        let m = models(["x-Q8_0-00002-of-00002.gguf", "y.gguf", "y.txt"]);
        assert_eq!(
            m,
            [
                GgufModel {
                    first: "x-Q8_0-00001-of-00002.gguf".into(),
                    parts: 2
                },
                GgufModel {
                    first: "y.gguf".into(),
                    parts: 1
                }
            ]
        );
        assert_eq!(m[0].quant().as_deref(), Some("Q8_0"));
        assert_eq!(m[1].quant(), None);
        assert_eq!(models(["one-00001-of-00001.gguf"])[0].parts, 1);
    }
}
