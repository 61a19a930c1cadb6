//! Hub ids: `org/name`, `org/name:QUANT` or `org/name/FILE.gguf`, each with an optional
//! `@revision`, checked against the hub's naming rules.

use super::gguf::{self, Select};
use super::{DEFAULT_REVISION, HubError, is_safe_repo_path};
use std::fmt;
use std::path::Path;

/// A parsed hub id: `org/name`, a revision (branch, tag or commit; default `main`) and what
/// to take from the repository.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct HubSpec {
    pub repo_id: String,
    pub revision: String,
    pub select: Select,
}

impl HubSpec {
    /// Parses `org/name`, `org/name:QUANT` or `org/name/FILE.gguf`, each with an optional
    /// `@revision` (a quant may also follow the revision: `org/name@v1:Q4_K_M`), checking the
    /// names against the hub's rules (as `huggingface_hub.utils.validate_repo_id`): two parts
    /// of 1 to 96 ASCII letters, digits, `-`, `_` and `.`, each starting and ending with a
    /// letter, digit or `_`, with no `--` or `..`, not ending in `.git`. A quant is letters,
    /// digits and `_`; a file is a safe relative path ending in `.gguf`.
    pub fn parse(spec: &str) -> Result<HubSpec, HubError> {
        let bad = |reason: &str| HubError::InvalidSpec {
            spec: spec.to_string(),
            reason: reason.to_string(),
        };
        let (name, revision) = match spec.split_once('@') {
            Some((r, rev)) => (r, Some(rev)),
            None => (spec, None),
        };
        let (name, quant) = match name.split_once(':') {
            Some((n, q)) => (n, Some(q)),
            None => (name, None),
        };
        let (revision, quant) = match (revision.and_then(|r| r.split_once(':')), quant) {
            (Some(_), Some(_)) => return Err(bad("give the quant once")),
            (Some((rev, q)), None) => (Some(rev), Some(q)),
            (None, q) => (revision, q),
        };
        let (repo, file) = match name.match_indices('/').nth(1) {
            Some((i, _)) => (&name[..i], Some(&name[i + 1..])),
            None => (name, None),
        };
        check_repo_id(repo).map_err(|r| bad(&r))?;
        let select = match (quant, file) {
            (Some(_), Some(_)) => return Err(bad("give a quant or a file, not both")),
            (Some(q), None) => {
                if q.is_empty() || !q.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
                    return Err(bad("a quant is letters, digits and '_' (e.g. Q4_K_M)"));
                }
                Select::Quant(q.to_string())
            }
            (None, Some(f)) => {
                if !is_safe_repo_path(f) || !gguf::is_model_file(f) {
                    return Err(bad(
                        "a file in a repository must be a GGUF model file: a path ending in .gguf, not an mmproj or imatrix file",
                    ));
                }
                Select::File(f.to_string())
            }
            (None, None) => Select::Default,
        };
        let revision = match revision {
            Some(rev) => {
                check_revision(rev).map_err(|r| bad(&r))?;
                rev.to_string()
            }
            None => DEFAULT_REVISION.to_string(),
        };
        Ok(HubSpec {
            repo_id: repo.to_string(),
            revision,
            select,
        })
    }

    /// The same repository and revision, without a quant or file.
    pub fn repo_only(&self) -> HubSpec {
        HubSpec {
            select: Select::Default,
            ..self.clone()
        }
    }

    /// The cache folder name, `models--org--name`.
    pub fn folder_name(&self) -> String {
        format!("models--{}", self.repo_id.replace('/', "--"))
    }

    /// Whether the revision is a full commit hash (which needs no `refs/` entry).
    pub fn is_commit(&self) -> bool {
        is_commit_hash(&self.revision)
    }
}

impl fmt::Display for HubSpec {
    /// `org/name`, `org/name:QUANT` or `org/name/FILE`, with `@revision` unless it is `main`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.repo_id)?;
        match &self.select {
            Select::Default => {}
            Select::Quant(q) => write!(f, ":{q}")?,
            Select::File(file) => write!(f, "/{file}")?,
        }
        if self.revision != DEFAULT_REVISION {
            write!(f, "@{}", self.revision)?;
        }
        Ok(())
    }
}

fn check_repo_id(repo: &str) -> Result<(), String> {
    let parts: Vec<&str> = repo.split('/').collect();
    if parts.len() != 2 {
        return Err("the name must have exactly one '/'".into());
    }
    for p in parts {
        if p.is_empty() || p.len() > 96 {
            return Err("each part must have 1 to 96 characters".into());
        }
        if !p
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        {
            return Err("only letters, digits, '-', '_' and '.' are allowed".into());
        }
        let word = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
        if !word(p.as_bytes()[0]) || !word(p.as_bytes()[p.len() - 1]) {
            return Err("a part cannot start or end with '-' or '.'".into());
        }
    }
    if repo.contains("--") || repo.contains("..") {
        return Err("'--' and '..' are not allowed".into());
    }
    if repo.ends_with(".git") {
        return Err("the name cannot end with '.git'".into());
    }
    Ok(())
}

/// A revision becomes a path under `refs/`, so it must be a plain relative path.
fn check_revision(rev: &str) -> Result<(), String> {
    if rev.is_empty() || rev.len() > 255 {
        return Err("the revision must have 1 to 255 characters".into());
    }
    if rev
        .chars()
        .any(|c| c.is_whitespace() || c.is_control() || matches!(c, '\\' | '@' | ':'))
    {
        return Err("the revision has a character git does not allow".into());
    }
    if rev.split('/').any(|c| c.is_empty() || c == "." || c == "..") {
        return Err("the revision is not a valid git ref".into());
    }
    Ok(())
}

pub(super) fn is_commit_hash(s: &str) -> bool {
    s.len() == 40 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

pub(super) fn is_sha256(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Whether `s` names a hub model (see [`HubSpec::parse`]) rather than a local folder or file:
/// an existing path is never a hub id.
pub fn is_hub_id(s: &str) -> bool {
    !Path::new(s).exists() && HubSpec::parse(s).is_ok()
}
