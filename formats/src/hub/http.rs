//! The hub's HTTP API, on `ureq`: the model info call, file metadata (`HEAD`), and resumable,
//! verified downloads into the cache's `blobs/`.

use super::{HubError, HubOptions, HubSpec, Tuning, create_dir, is_safe_repo_path, is_sha256};
use indicatif::{ProgressBar, ProgressStyle};
use sha2::{Digest, Sha256};
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;
use ureq::http::Response;

/// Largest model info document read (the file list of a big repository is a few MB).
const MAX_INFO_BYTES: u64 = 64 << 20;
/// Redirects followed on the hub itself (renamed repositories); one to a CDN ends the chain.
const MAX_REDIRECTS: usize = 10;
const CHUNK: usize = 1 << 20;

/// The model info call's answer: the commit a revision names and the repository's files.
pub(super) struct ModelInfo {
    pub commit: String,
    pub files: Vec<String>,
}

/// What `HEAD /resolve/` tells about one file.
struct FileMeta {
    /// Normalised ETag (quotes and `W/` removed): the blob's name.
    etag: String,
    /// Expected size, when the hub tells it.
    size: Option<u64>,
    /// Where the bytes are: the CDN address of an LFS file, else the resolve URL.
    location: String,
}

/// Why one download attempt failed: worth another try (the connection dropped), or not.
enum Attempt {
    Retry(HubError),
    Fatal(HubError),
}

pub(super) struct Client<'a> {
    agent: ureq::Agent,
    endpoint: String,
    token: Option<String>,
    spec: &'a HubSpec,
    cache: PathBuf,
    quiet: bool,
    tuning: Tuning,
}

impl<'a> Client<'a> {
    pub fn new(opts: &HubOptions, spec: &'a HubSpec, tuning: &Tuning) -> Result<Client<'a>, HubError> {
        let endpoint = opts.endpoint().to_string();
        if !(endpoint.starts_with("https://") || endpoint.starts_with("http://")) {
            return Err(HubError::Network {
                url: endpoint,
                message: "the hub endpoint (HF_ENDPOINT) must start with https:// or http://".into(),
            });
        }
        let mut config = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .max_redirects(0)
            .user_agent(format!("kiln/{}; hf_hub/rust; ureq", env!("CARGO_PKG_VERSION")))
            .timeout_connect(Some(Duration::from_secs(10)))
            .timeout_recv_response(Some(Duration::from_secs(30)))
            .timeout_per_read(Some(Duration::from_secs(60)));
        if is_loopback(&endpoint) {
            config = config.proxy(None);
        }
        Ok(Client {
            agent: config.build().new_agent(),
            endpoint,
            token: opts.token.clone(),
            spec,
            cache: opts.cache_root(),
            quiet: opts.quiet,
            tuning: tuning.clone(),
        })
    }

    /// `{endpoint}/{repo}/resolve/{commit}/{file}`.
    pub fn file_url(&self, commit: &str, file: &str) -> String {
        format!(
            "{}/{}/resolve/{}/{}",
            self.endpoint,
            self.spec.repo_id,
            quote(commit, false),
            quote(file, true)
        )
    }

    /// `GET {endpoint}/api/models/{repo}/revision/{rev}`: the commit and the file list.
    pub fn model_info(&self) -> Result<ModelInfo, HubError> {
        let url = format!(
            "{}/api/models/{}/revision/{}",
            self.endpoint,
            self.spec.repo_id,
            quote(&self.spec.revision, false)
        );
        let (url, resp) = self.follow("GET", &url)?;
        if !resp.status().is_success() {
            return Err(self.status_error(&resp, &url, None));
        }
        let bad = |message: String| HubError::BadResponse {
            url: url.clone(),
            message,
        };
        let body = resp
            .into_body()
            .with_config()
            .limit(MAX_INFO_BYTES)
            .read_to_vec()
            .map_err(|e| HubError::Network {
                url: url.clone(),
                message: e.to_string(),
            })?;
        #[derive(serde::Deserialize)]
        struct Info {
            sha: Option<String>,
            #[serde(default)]
            siblings: Vec<Sibling>,
        }
        #[derive(serde::Deserialize)]
        struct Sibling {
            rfilename: String,
        }
        let info: Info = serde_json::from_slice(&body).map_err(|e| bad(format!("invalid JSON: {e}")))?;
        let commit = match info.sha {
            Some(s) if super::is_commit_hash(&s) => s,
            Some(s) => return Err(bad(format!("'{s}' is not a commit hash"))),
            None => return Err(bad("no commit hash (sha)".into())),
        };
        Ok(ModelInfo {
            commit,
            files: info.siblings.into_iter().map(|s| s.rfilename).collect(),
        })
    }

    /// Makes `snapshots/<commit>/<file>` in `repo_dir`, downloading its blob unless cached.
    pub fn fetch_file(&self, repo_dir: &Path, commit: &str, file: &str) -> Result<PathBuf, HubError> {
        let url = self.file_url(commit, file);
        if !is_safe_repo_path(file) {
            return Err(HubError::BadResponse {
                url,
                message: format!("unsafe file name '{file}'"),
            });
        }
        let pointer = repo_dir.join("snapshots").join(commit).join(file);
        if pointer.is_file() {
            return Ok(pointer);
        }
        let meta = self.metadata(&url)?;
        let blob = repo_dir.join("blobs").join(&meta.etag);
        create_dir(pointer.parent().expect("pointer has a parent"))?;
        let locks = self.cache.join(".locks").join(self.spec.folder_name());
        create_dir(&locks)?;
        let _lock = FileLock::acquire(&locks.join(format!("{}.lock", meta.etag)));
        if !blob.is_file() {
            self.download_blob(&meta, &blob, file)?;
        }
        link_blob(&meta.etag, &blob, &pointer, file)?;
        Ok(pointer)
    }

    /// `HEAD` on the resolve URL, following redirects that stay on the hub, as
    /// `huggingface_hub`'s `get_hf_file_metadata` does.
    fn metadata(&self, url: &str) -> Result<FileMeta, HubError> {
        let (url, resp) = self.follow("HEAD", url)?;
        let status = resp.status();
        if !(status.is_success() || status.is_redirection()) {
            return Err(self.status_error(&resp, &url, Some(&url)));
        }
        let bad = |message: &str| HubError::BadResponse {
            url: url.clone(),
            message: message.into(),
        };
        let etag = header(&resp, "x-linked-etag")
            .or_else(|| header(&resp, "etag"))
            .map(|e| normalize_etag(&e))
            .ok_or_else(|| bad("no ETag: the file cannot be cached"))?;
        if etag.is_empty() || !is_safe_repo_path(&etag) || etag.contains('/') {
            return Err(bad(&format!("unusable ETag '{etag}'")));
        }
        let size = match header(&resp, "x-linked-size") {
            Some(s) => Some(s),
            None if status.is_redirection() => None,
            None => header(&resp, "content-length"),
        };
        let size = match size {
            Some(s) => Some(
                s.trim()
                    .parse::<u64>()
                    .map_err(|_| bad(&format!("invalid size '{s}'")))?,
            ),
            None => None,
        };
        let location = if status.is_redirection() {
            let loc = header(&resp, "location").ok_or_else(|| bad("redirect without Location"))?;
            join_url(&url, &loc)
        } else {
            url.clone()
        };
        Ok(FileMeta { etag, size, location })
    }

    /// Sends `method url`, following redirects on the same host that do not point at a
    /// file's storage (`X-Linked-Etag`); returns the last URL asked and its answer.
    fn follow(&self, method: &str, url: &str) -> Result<(String, Response<ureq::Body>), HubError> {
        let mut url = url.to_string();
        for _ in 0..MAX_REDIRECTS {
            let resp = self.send(method, &url, None)?;
            if !resp.status().is_redirection() || resp.headers().contains_key("x-linked-etag") {
                return Ok((url, resp));
            }
            let Some(loc) = header(&resp, "location") else {
                return Ok((url, resp));
            };
            let target = join_url(&url, &loc);
            if origin(&target) != origin(&url) {
                return Ok((url, resp));
            }
            url = target;
        }
        Err(HubError::BadResponse {
            url,
            message: format!("more than {MAX_REDIRECTS} redirects"),
        })
    }

    fn send(&self, method: &str, url: &str, range_from: Option<u64>) -> Result<Response<ureq::Body>, HubError> {
        let auth = self.token.as_ref().filter(|_| origin(url) == origin(&self.endpoint));
        let result = if method == "HEAD" {
            let mut r = self.agent.head(url).header("Accept-Encoding", "identity");
            if let Some(t) = auth {
                r = r.header("Authorization", format!("Bearer {t}"));
            }
            r.call()
        } else {
            let mut r = self.agent.get(url).header("Accept-Encoding", "identity");
            if let Some(t) = auth {
                r = r.header("Authorization", format!("Bearer {t}"));
            }
            if let Some(from) = range_from {
                r = r.header("Range", format!("bytes={from}-"));
            }
            r.call()
        };
        result.map_err(|e| HubError::Network {
            url: url.to_string(),
            message: e.to_string(),
        })
    }

    /// The error for a refusal from the hub.
    fn status_error(&self, resp: &Response<ureq::Body>, url: &str, file: Option<&str>) -> HubError {
        let status = resp.status().as_u16();
        let code = header(resp, "x-error-code").unwrap_or_default();
        let message = header(resp, "x-error-message").unwrap_or_default();
        let repo = self.spec.repo_id.clone();
        let endpoint = self.endpoint.clone();
        let unauthorized = |hint: String| HubError::Unauthorized {
            model: repo.clone(),
            endpoint: endpoint.clone(),
            status,
            hint,
        };
        let token_hint = if self.token.is_some() {
            format!(
                "the model is gated or private and the token in HF_TOKEN does not give access \
                 to it (request access on {endpoint}/{repo} with the token's account)"
            )
        } else {
            format!(
                "the model is gated or private; set HF_TOKEN to an access token \
                 ({endpoint}/settings/tokens) of an account that has access to it"
            )
        };
        match (code.as_str(), status) {
            ("RevisionNotFound", _) => HubError::RevisionNotFound {
                model: repo,
                revision: self.spec.revision.clone(),
                endpoint,
            },
            ("GatedRepo", _) => unauthorized(token_hint),
            ("RepoNotFound", _) => HubError::NotFound { model: repo, endpoint },
            (_, 404) if file.is_none() => HubError::NotFound { model: repo, endpoint },
            (_, 401) if message == "Invalid credentials in Authorization header" => unauthorized(format!(
                "the token in HF_TOKEN is invalid or expired (see {endpoint}/settings/tokens)"
            )),
            (_, 401 | 403) => unauthorized(token_hint),
            _ => HubError::Http {
                url: url.to_string(),
                status,
                message: if message.is_empty() {
                    String::new()
                } else {
                    format!(": {message}")
                },
            },
        }
    }

    /// Downloads `meta` into `blob` through `blob.incomplete`, resuming what an earlier
    /// run left there, and checks its size (and sha256, when the ETag is one).
    fn download_blob(&self, meta: &FileMeta, blob: &Path, file: &str) -> Result<(), HubError> {
        let mut incomplete = blob.as_os_str().to_owned();
        incomplete.push(".incomplete");
        let incomplete = PathBuf::from(incomplete);
        let bar = self.progress_bar(file, meta.size);
        let mut attempt = 0;
        loop {
            match self.download_attempt(meta, &incomplete, &bar) {
                Ok(()) => break,
                Err(Attempt::Retry(e)) if attempt < self.tuning.retries => {
                    if !self.quiet {
                        bar.suspend(|| eprintln!("warning: {e}; resuming"));
                    }
                    let wait = self.tuning.backoff_ms.saturating_mul(1 << attempt.min(10));
                    std::thread::sleep(Duration::from_millis(wait));
                    attempt += 1;
                }
                Err(Attempt::Retry(e) | Attempt::Fatal(e)) => {
                    bar.abandon();
                    return Err(e);
                }
            }
        }
        bar.finish_and_clear();

        if is_sha256(&meta.etag) {
            let got = sha256_file(&incomplete)?;
            if got != meta.etag {
                let _ = std::fs::remove_file(&incomplete);
                return Err(HubError::Corrupt {
                    file: file.to_string(),
                    message: format!("sha256 is {got}, the hub says {}", meta.etag),
                });
            }
        }
        std::fs::rename(&incomplete, blob).map_err(HubError::io("cannot move a download to", blob))
    }

    /// One `GET` of the rest of the file, appended to `incomplete`.
    fn download_attempt(&self, meta: &FileMeta, incomplete: &Path, bar: &ProgressBar) -> Result<(), Attempt> {
        let io_err = |op| move |e| Attempt::Fatal(HubError::io(op, incomplete)(e));
        let mut f = OpenOptions::new()
            .create(true)
            .append(true)
            .open(incomplete)
            .map_err(io_err("cannot open"))?;
        let mut have = f.metadata().map_err(io_err("cannot read"))?.len();
        if let Some(size) = meta.size {
            if have > size {
                f.set_len(0).map_err(io_err("cannot truncate"))?;
                have = 0;
            }
            if have == size {
                return Ok(());
            }
        }
        let url = &meta.location;
        let resp = self
            .send("GET", url, (have > 0).then_some(have))
            .map_err(Attempt::Retry)?;
        let status = resp.status().as_u16();
        let bad = |message: String| {
            Attempt::Retry(HubError::BadResponse {
                url: url.clone(),
                message,
            })
        };
        match status {
            206 => {
                let start = header(&resp, "content-range")
                    .and_then(|r| content_range_start(&r))
                    .ok_or_else(|| bad("206 without a valid Content-Range".into()))?;
                if start != have {
                    f.set_len(0).map_err(io_err("cannot truncate"))?;
                    return Err(bad(format!("asked for bytes {have}-, got {start}-")));
                }
            }
            200 => {
                if have > 0 {
                    // The server ignored the Range header: start over.
                    f.set_len(0).map_err(io_err("cannot truncate"))?;
                    have = 0;
                }
            }
            416 => {
                f.set_len(0).map_err(io_err("cannot truncate"))?;
                return Err(bad("the partial download does not fit the file".into()));
            }
            _ => {
                let e = self.status_error(&resp, url, Some(url));
                return Err(if status == 429 || status >= 500 {
                    Attempt::Retry(e)
                } else {
                    Attempt::Fatal(e)
                });
            }
        }
        let total = meta
            .size
            .or_else(|| header(&resp, "content-length")?.parse::<u64>().ok().map(|l| l + have));
        if let Some(t) = total {
            bar.set_length(t);
        }
        bar.set_position(have);

        let mut reader = resp.into_body().into_reader();
        let mut buf = vec![0u8; CHUNK];
        let mut got = have;
        loop {
            let n = match reader.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    f.flush().map_err(io_err("cannot write"))?;
                    let of = total.map(|t| format!(" of {t}")).unwrap_or_default();
                    return Err(Attempt::Retry(HubError::Network {
                        url: url.clone(),
                        message: format!("connection lost after {got}{of} bytes ({e})"),
                    }));
                }
            };
            f.write_all(&buf[..n]).map_err(io_err("cannot write"))?;
            got += n as u64;
            bar.set_position(got);
        }
        f.flush().map_err(io_err("cannot write"))?;
        drop(f);
        if let Some(size) = meta.size {
            if got < size {
                return Err(Attempt::Retry(HubError::Network {
                    url: url.clone(),
                    message: format!("connection closed after {got} of {size} bytes"),
                }));
            }
            if got > size {
                let _ = std::fs::remove_file(incomplete);
                return Err(Attempt::Fatal(HubError::Corrupt {
                    file: url.clone(),
                    message: format!("got {got} bytes, the hub says {size}"),
                }));
            }
        }
        Ok(())
    }

    fn progress_bar(&self, file: &str, size: Option<u64>) -> ProgressBar {
        if self.quiet {
            return ProgressBar::hidden();
        }
        let name = if file.len() > 40 {
            let cut = file.len() - 37;
            let cut = (cut..file.len())
                .find(|&i| file.is_char_boundary(i))
                .unwrap_or(file.len());
            format!("...{}", &file[cut..])
        } else {
            file.to_string()
        };
        let style = ProgressStyle::with_template(
            "{msg:40} [{bar:30}] {bytes:>10}/{total_bytes:10} {bytes_per_sec:>12} {eta:>4}",
        )
        .expect("valid template")
        .progress_chars("=> ");
        let bar = ProgressBar::new(size.unwrap_or(0)).with_style(style).with_message(name);
        bar.set_draw_target(indicatif::ProgressDrawTarget::stderr());
        bar
    }
}

fn header(resp: &Response<ureq::Body>, name: &str) -> Option<String> {
    resp.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

/// As `huggingface_hub`'s `_normalize_etag`: `W/"x"` and `"x"` become `x`.
fn normalize_etag(e: &str) -> String {
    let e = e.trim();
    let e = e.strip_prefix("W/").unwrap_or(e);
    e.trim_matches('"').to_string()
}

/// `bytes START-END/TOTAL` -> START.
fn content_range_start(r: &str) -> Option<u64> {
    let r = r.trim().strip_prefix("bytes")?.trim_start();
    r.split('-').next()?.trim().parse().ok()
}

/// `scheme://host[:port]` of a URL.
fn origin(url: &str) -> &str {
    match url.find("://") {
        Some(i) => {
            let rest = &url[i + 3..];
            let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
            &url[..i + 3 + end]
        }
        None => "",
    }
}

/// A `Location` resolved against the URL that sent it.
fn join_url(base: &str, loc: &str) -> String {
    if loc.starts_with("http://") || loc.starts_with("https://") {
        loc.to_string()
    } else if let Some(rest) = loc.strip_prefix("//") {
        let scheme = base.split("://").next().unwrap_or("https");
        format!("{scheme}://{rest}")
    } else if loc.starts_with('/') {
        format!("{}{loc}", origin(base))
    } else {
        let path_end = base.find(['?', '#']).unwrap_or(base.len());
        let dir_end = base[..path_end]
            .rfind('/')
            .filter(|&i| i >= origin(base).len())
            .map(|i| i + 1)
            .unwrap_or(path_end);
        format!("{}{loc}", &base[..dir_end])
    }
}

fn is_loopback(url: &str) -> bool {
    let host = origin(url).split("://").nth(1).unwrap_or("");
    let host = match host.strip_prefix('[') {
        Some(h) => h.split(']').next().unwrap_or(""),
        None => host.split(':').next().unwrap_or(""),
    };
    host == "localhost" || host == "::1" || host.starts_with("127.")
}

/// Percent-encoding as Python's `urllib.parse.quote` (`safe="/"` or `safe=""`).
fn quote(s: &str, keep_slash: bool) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') || (keep_slash && b == b'/') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn sha256_file(path: &Path) -> Result<String, HubError> {
    let mut f = File::open(path).map_err(HubError::io("cannot read", path))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; CHUNK];
    loop {
        let n = f.read(&mut buf).map_err(HubError::io("cannot read", path))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// `snapshots/<commit>/<file>` -> `../../blobs/<etag>` (one more `../` per folder level of
/// `file`), as `huggingface_hub` links them; a copy where symlinks are not available.
fn link_blob(etag: &str, blob: &Path, pointer: &Path, file: &str) -> Result<(), HubError> {
    #[cfg(unix)]
    let _ = blob;
    let _ = std::fs::remove_file(pointer);
    let depth = file.matches('/').count();
    let target = format!("{}../../blobs/{etag}", "../".repeat(depth));
    #[cfg(unix)]
    let made = std::os::unix::fs::symlink(&target, pointer);
    #[cfg(not(unix))]
    let made = std::fs::copy(blob, pointer).map(|_| ());
    match made {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && pointer.is_file() => Ok(()),
        Err(e) => Err(HubError::io("cannot link", pointer)(e)),
    }
}

/// An exclusive lock (`flock` on Unix) on `.locks/models--org--name/<etag>.lock`, the lock
/// file `huggingface_hub` takes for the same blob; best effort (no lock where unsupported).
/// Released when dropped.
struct FileLock(#[allow(dead_code)] Option<File>);

impl FileLock {
    fn acquire(path: &Path) -> FileLock {
        let f = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .ok()
            .filter(|f| f.lock().is_ok());
        FileLock(f)
    }
}
