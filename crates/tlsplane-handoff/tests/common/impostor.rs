//! Another user listening at the hand-off path (tests/impostor.py), for the receivers' trust
//! tests; the C library's and the shim's tests include this file too.

// Each test crate that includes this uses part of it.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

/// The impostor's user: nobody.
pub const IMPOSTOR_UID: u32 = 65534;

pub struct Impostor {
    child: Child,
    dir: PathBuf,
    pub path: PathBuf,
    lines: Receiver<String>,
}

impl Impostor {
    /// Starts it as [`IMPOSTOR_UID`] at a socket in a fresh directory that user owns,
    /// writing `request` on each connection it hands out. None (the caller skips, saying so)
    /// when this process is not root: it cannot act as another user then.
    pub fn start(name: &str, request: &str) -> Option<Impostor> {
        Self::start_in(Self::make_dir(name)?, request)
    }

    /// A fresh directory owned by [`IMPOSTOR_UID`], for [`start_in`](Self::start_in) (None
    /// when not root, as for `start`). Its socket path is `handoff.sock` in it.
    pub fn make_dir(name: &str) -> Option<PathBuf> {
        if tlsplane_sys::effective_uid() != 0 {
            eprintln!("SKIPPED: not root, so no process of another user can be started");
            return None;
        }
        let dir =
            std::env::temp_dir().join(format!("tlsplane-impostor-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::os::unix::fs::chown(&dir, Some(IMPOSTOR_UID), Some(IMPOSTOR_UID)).unwrap();
        Some(dir)
    }

    /// Starts it in `dir` (from [`make_dir`](Self::make_dir)), which it removes when dropped.
    pub fn start_in(dir: PathBuf, request: &str) -> Option<Impostor> {
        let path = dir.join("handoff.sock");
        let script =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../tlsplane-handoff/tests/impostor.py");
        let mut child = Command::new("python3")
            .arg("-B")
            .arg(script)
            .arg(&path)
            .arg(IMPOSTOR_UID.to_string())
            .arg(request)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3");
        let (tx, lines) = channel();
        let out = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let imp = Impostor {
            child,
            dir,
            path,
            lines,
        };
        let first = imp.lines.recv_timeout(Duration::from_secs(10));
        assert_eq!(
            first.as_deref(),
            Ok(format!("listening uid={IMPOSTOR_UID}").as_str())
        );
        Some(imp)
    }

    /// The next `n` connections it handed out, as "conn N reply HEX" lines, waiting `limit`
    /// at most (fewer lines then).
    pub fn conns(&self, n: usize, limit: Duration) -> Vec<String> {
        let deadline = Instant::now() + limit;
        let mut got = Vec::new();
        while got.len() < n {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => got.push(l),
                Err(_) => break,
            }
        }
        got
    }

    /// The directory it listens in (its own).
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for Impostor {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
