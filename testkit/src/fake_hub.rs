//! A tiny HTTP/1.1 server on 127.0.0.1 that answers like the Hugging Face hub: the model
//! info API, `/resolve/` with `X-Repo-Commit` / `ETag` / `Range`, LFS files redirected
//! (302) to a "CDN" path with `X-Linked-Etag` / `X-Linked-Size`, gated repos, and knobs to
//! cut a download short or corrupt it. Every request is logged.
//!
//! The CDN is a second port of the same server, so a different origin, as the hub's CDN is
//! (clients must not send the token there, and do not follow that redirect in `HEAD`);
//! [`FakeHub::cdn_on_hub_origin`] moves it to the hub's own origin.

use sha2::{Digest, Sha256};
use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};

pub fn sha256_hex(data: &[u8]) -> String {
    Sha256::digest(data).iter().map(|b| format!("{b:02x}")).collect()
}

#[derive(Clone, Debug)]
pub struct FakeFile {
    pub name: String,
    pub data: Vec<u8>,
    /// Stored with LFS: its ETag is its sha256 and `/resolve/` redirects to the CDN.
    pub lfs: bool,
}

impl FakeFile {
    pub fn new(name: &str, data: impl Into<Vec<u8>>, lfs: bool) -> FakeFile {
        FakeFile {
            name: name.to_string(),
            data: data.into(),
            lfs,
        }
    }

    /// sha256 for LFS files; a 40-hex stand-in for the git blob sha1 otherwise.
    pub fn etag(&self) -> String {
        if self.lfs {
            sha256_hex(&self.data)
        } else {
            let mut v = format!("blob {}\0", self.data.len()).into_bytes();
            v.extend_from_slice(&self.data);
            sha256_hex(&v)[..40].to_string()
        }
    }
}

#[derive(Clone, Debug, Default)]
pub struct FakeRepo {
    /// Branch and tag names -> commit.
    pub refs: HashMap<String, String>,
    pub commits: HashMap<String, Vec<FakeFile>>,
    /// A gated repo: `/resolve/` needs `Authorization: Bearer <token>`.
    pub token: Option<String>,
}

impl FakeRepo {
    /// Adds a commit that the given branch/tag names point to.
    pub fn commit(mut self, names: &[&str], sha: &str, files: Vec<FakeFile>) -> FakeRepo {
        assert_eq!(sha.len(), 40);
        for n in names {
            self.refs.insert(n.to_string(), sha.to_string());
        }
        self.commits.insert(sha.to_string(), files);
        self
    }

    pub fn gated(mut self, token: &str) -> FakeRepo {
        self.token = Some(token.to_string());
        self
    }
}

#[derive(Clone, Debug)]
pub struct Request {
    pub method: String,
    pub path: String,
    /// Lower-case names.
    pub headers: Vec<(String, String)>,
}

impl Request {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }
}

#[derive(Default)]
struct State {
    repos: HashMap<String, FakeRepo>,
    log: Vec<Request>,
    /// etag -> (bytes sent before the connection is dropped, how many more times).
    cuts: HashMap<String, (usize, usize)>,
    corrupt: HashSet<String>,
    /// Where `/resolve/` redirects LFS files to.
    cdn_url: String,
}

pub struct FakeHub {
    pub url: String,
    state: Arc<Mutex<State>>,
}

struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    cut_after: Option<usize>,
}

impl Reply {
    fn new(status: u16) -> Reply {
        Reply {
            status,
            headers: Vec::new(),
            body: Vec::new(),
            cut_after: None,
        }
    }

    fn header(mut self, k: &str, v: impl Into<String>) -> Reply {
        self.headers.push((k.to_string(), v.into()));
        self
    }

    fn error(status: u16, code: &str, message: &str) -> Reply {
        let mut r = Reply::new(status)
            .header("X-Error-Code", code)
            .header("X-Error-Message", message)
            .header("Content-Type", "application/json");
        r.body = format!("{{\"error\":\"{message}\"}}").into_bytes();
        r
    }
}

impl FakeHub {
    pub fn start() -> FakeHub {
        let hub = TcpListener::bind("127.0.0.1:0").unwrap();
        let cdn = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", hub.local_addr().unwrap());
        let cdn_url = format!("http://{}", cdn.local_addr().unwrap());
        let state = Arc::new(Mutex::new(State {
            cdn_url: cdn_url.clone(),
            ..State::default()
        }));
        for listener in [hub, cdn] {
            let st = state.clone();
            std::thread::spawn(move || {
                for stream in listener.incoming() {
                    let Ok(stream) = stream else { return };
                    let st = st.clone();
                    std::thread::spawn(move || serve_connection(stream, &st));
                }
            });
        }
        FakeHub { url, state }
    }

    /// Redirects LFS files to `/cdn/` on the hub's own origin.
    pub fn cdn_on_hub_origin(&self) {
        self.state.lock().unwrap().cdn_url = self.url.clone();
    }

    pub fn add_repo(&self, id: &str, repo: FakeRepo) {
        self.state.lock().unwrap().repos.insert(id.to_string(), repo);
    }

    pub fn requests(&self) -> Vec<Request> {
        self.state.lock().unwrap().log.clone()
    }

    pub fn request_count(&self) -> usize {
        self.state.lock().unwrap().log.len()
    }

    /// The next `times` downloads of the blob `etag` are cut after `after` bytes.
    pub fn cut(&self, etag: &str, after: usize, times: usize) {
        self.state.lock().unwrap().cuts.insert(etag.to_string(), (after, times));
    }

    /// The blob `etag` is served with its bytes flipped.
    pub fn corrupt(&self, etag: &str) {
        self.state.lock().unwrap().corrupt.insert(etag.to_string());
    }
}

fn serve_connection(stream: TcpStream, state: &Mutex<State>) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut out = stream;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let mut parts = line.split_whitespace();
        let (Some(method), Some(path)) = (parts.next(), parts.next()) else {
            return;
        };
        let mut headers = Vec::new();
        loop {
            let mut h = String::new();
            if reader.read_line(&mut h).unwrap_or(0) == 0 {
                return;
            }
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':') {
                headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
            }
        }
        let req = Request {
            method: method.to_string(),
            path: path.to_string(),
            headers,
        };
        let reply = {
            let mut st = state.lock().unwrap();
            st.log.push(req.clone());
            route(&mut st, &req)
        };
        let mut head = format!("HTTP/1.1 {} X\r\n", reply.status);
        for (k, v) in &reply.headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str(&format!("Content-Length: {}\r\n\r\n", reply.body.len()));
        if out.write_all(head.as_bytes()).is_err() {
            return;
        }
        if req.method == "HEAD" {
            continue;
        }
        if let Some(n) = reply.cut_after {
            let _ = out.write_all(&reply.body[..n.min(reply.body.len())]);
            let _ = out.flush();
            let _ = out.shutdown(Shutdown::Both);
            return;
        }
        if out.write_all(&reply.body).is_err() {
            return;
        }
    }
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && i + 2 < b.len()
            && let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16)
        {
            out.push(v);
            i += 3;
            continue;
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8(out).unwrap()
}

fn route(st: &mut State, req: &Request) -> Reply {
    let path = req.path.split('?').next().unwrap();
    if let Some(rest) = path.strip_prefix("/api/models/") {
        let Some((repo, rev)) = rest.split_once("/revision/") else {
            return Reply::error(404, "", "Not Found");
        };
        let rev = percent_decode(rev);
        let Some(r) = st.repos.get(repo) else {
            return Reply::error(404, "RepoNotFound", "Repository not found");
        };
        let Some((sha, files)) = lookup(r, &rev) else {
            return Reply::error(404, "RevisionNotFound", "Invalid rev id");
        };
        let siblings: Vec<String> = files
            .iter()
            .map(|f| format!("{{\"rfilename\":\"{}\"}}", f.name))
            .collect();
        let mut reply = Reply::new(200).header("Content-Type", "application/json");
        reply.body = format!(
            "{{\"_id\":\"x\",\"id\":\"{repo}\",\"private\":false,\"gated\":{},\"sha\":\"{sha}\",\"siblings\":[{}]}}",
            r.token.is_some(),
            siblings.join(",")
        )
        .into_bytes();
        return reply;
    }
    if let Some(etag) = path.strip_prefix("/cdn/") {
        let file = st
            .repos
            .values()
            .flat_map(|r| r.commits.values().flatten())
            .find(|f| f.etag() == etag)
            .cloned();
        let Some(file) = file else {
            return Reply::error(404, "", "no such blob");
        };
        let mut data = file.data.clone();
        if st.corrupt.contains(etag) {
            data.iter_mut().for_each(|b| *b ^= 0xff);
        }
        let mut reply = serve_bytes(&data, req).header("ETag", format!("\"{etag}\""));
        if req.method == "GET"
            && reply.status / 100 == 2
            && let Some((after, times)) = st.cuts.get_mut(etag)
            && *times > 0
        {
            *times -= 1;
            reply.cut_after = Some(*after);
        }
        return reply;
    }
    // /{org}/{name}/resolve/{rev}/{file...}
    let segs: Vec<&str> = path.trim_start_matches('/').splitn(5, '/').collect();
    if segs.len() == 5 && segs[2] == "resolve" {
        let repo = format!("{}/{}", segs[0], segs[1]);
        let rev = percent_decode(segs[3]);
        let name = percent_decode(segs[4]);
        let Some(r) = st.repos.get(&repo) else {
            return Reply::error(404, "RepoNotFound", "Repository not found");
        };
        if let Some(tok) = &r.token
            && req.header("authorization") != Some(&format!("Bearer {tok}"))
        {
            return Reply::error(
                401,
                "GatedRepo",
                "Access to model is restricted. You must have access to it and be authenticated to access it. Please log in.",
            );
        }
        let Some((sha, files)) = lookup(r, &rev) else {
            return Reply::error(404, "RevisionNotFound", "Invalid rev id");
        };
        let Some(file) = files.iter().find(|f| f.name == name) else {
            return Reply::error(404, "EntryNotFound", "Entry not found");
        };
        let etag = file.etag();
        if file.lfs {
            return Reply::new(302)
                .header("Location", format!("{}/cdn/{etag}?X-Signature=abc", st.cdn_url))
                .header("X-Linked-Etag", format!("\"{etag}\""))
                .header("X-Linked-Size", file.data.len().to_string())
                .header("ETag", "\"0123456789012345678901234567890123456789\"")
                .header("X-Repo-Commit", sha);
        }
        let mut data = file.data.clone();
        if st.corrupt.contains(&etag) {
            data.iter_mut().for_each(|b| *b ^= 0xff);
        }
        return serve_bytes(&data, req)
            .header("ETag", format!("\"{etag}\""))
            .header("X-Repo-Commit", sha);
    }
    Reply::error(404, "", "Not Found")
}

fn lookup<'a>(r: &'a FakeRepo, rev: &str) -> Option<(String, &'a Vec<FakeFile>)> {
    let sha = r.refs.get(rev).cloned().unwrap_or_else(|| rev.to_string());
    r.commits.get(&sha).map(|f| (sha, f))
}

/// 200 with the bytes, or 206 for a `Range: bytes=N-[M]`.
fn serve_bytes(data: &[u8], req: &Request) -> Reply {
    let len = data.len();
    if let Some(range) = req.header("range").and_then(|r| r.strip_prefix("bytes=")) {
        let (a, b) = range.split_once('-').unwrap();
        let start: usize = a.parse().unwrap();
        let end: usize = if b.is_empty() {
            len.saturating_sub(1)
        } else {
            b.parse::<usize>().unwrap().min(len.saturating_sub(1))
        };
        if start >= len {
            return Reply::new(416).header("Content-Range", format!("bytes */{len}"));
        }
        let mut r = Reply::new(206)
            .header("Accept-Ranges", "bytes")
            .header("Content-Range", format!("bytes {start}-{end}/{len}"));
        r.body = data[start..=end].to_vec();
        return r;
    }
    let mut r = Reply::new(200).header("Accept-Ranges", "bytes");
    r.body = data.to_vec();
    r
}
