#![allow(dead_code)]

use std::fs;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tlsplane_http::{Body, DocRoot, Method, Request, Response};

/// A directory under the system temp dir, removed on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        let dir = std::env::temp_dir().join(format!(
            "tlsplane-http-{tag}-{}-{n}-{nanos}",
            std::process::id()
        ));
        fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    pub fn write(&self, rel: &str, contents: &[u8]) -> PathBuf {
        let p = self.0.join(rel);
        if let Some(parent) = p.parent() {
            fs::create_dir_all(parent).unwrap();
        }
        fs::write(&p, contents).unwrap();
        p
    }

    pub fn mkdir(&self, rel: &str) -> PathBuf {
        let p = self.0.join(rel);
        fs::create_dir_all(&p).unwrap();
        p
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

pub fn now() -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(1_700_000_000)
}

pub fn req(method: Method, target: &str) -> Request {
    Request {
        method,
        target: target.to_owned(),
        minor_version: 1,
        keep_alive: true,
        if_none_match: None,
        if_modified_since: None,
        range: None,
        if_range: None,
        host: None,
    }
}

pub fn get(target: &str) -> Request {
    req(Method::Get, target)
}

pub fn root(dir: &TempDir) -> DocRoot {
    DocRoot::new(dir.path(), false).unwrap()
}

/// Status line and header fields of a head, checking its framing.
pub struct Head {
    pub status_line: String,
    pub headers: Vec<(String, String)>,
}

impl Head {
    pub fn parse(head: &[u8]) -> Head {
        let text = std::str::from_utf8(head).expect("head is ASCII");
        assert!(
            text.ends_with("\r\n\r\n"),
            "head must end in CRLFCRLF: {text:?}"
        );
        let mut lines = text[..text.len() - 4].split("\r\n");
        let status_line = lines.next().unwrap().to_owned();
        let headers = lines
            .map(|l| {
                let (name, value) = l.split_once(": ").expect("header line");
                (name.to_owned(), value.to_owned())
            })
            .collect();
        Head {
            status_line,
            headers,
        }
    }

    pub fn get(&self, name: &str) -> Option<&str> {
        let mut found = self
            .headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str());
        let first = found.next();
        assert!(found.next().is_none(), "duplicate header {name}");
        first
    }
}

pub fn head(resp: &Response) -> Head {
    let h = Head::parse(&resp.head);
    assert!(
        h.status_line
            .starts_with(&format!("HTTP/1.1 {} ", resp.status)),
        "status line {:?} vs {}",
        h.status_line,
        resp.status
    );
    h
}

/// The bytes the body stands for.
pub fn body_bytes(resp: Response) -> Vec<u8> {
    match resp.body {
        Body::Empty => Vec::new(),
        Body::Bytes(b) => b,
        Body::File {
            mut file,
            offset,
            len,
        } => {
            file.seek(SeekFrom::Start(offset)).unwrap();
            let mut out = vec![0; len as usize];
            file.read_exact(&mut out).unwrap();
            out
        }
    }
}
