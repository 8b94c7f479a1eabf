//! External clients (curl, openssl, python3): presence checks and bounded runs.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use super::{mode, Mode};

pub fn find_in_path(tool: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(tool))
        .find(|p| {
            use std::os::unix::fs::PermissionsExt;
            p.metadata()
                .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
                .unwrap_or(false)
        })
}

/// True when `tool` can be used. A missing tool fails the test loudly, except python3 and
/// redis-server in the kernel-mode guest (which has neither): then the test is skipped with a
/// notice.
pub fn require(tool: &str) -> bool {
    if find_in_path(tool).is_some() {
        return true;
    }
    if matches!(tool, "python3" | "redis-server") && mode() == Mode::Kernel {
        eprintln!(
            "SKIPPED: {tool} is not installed (allowed in kernel mode: the guest has no {tool})"
        );
        return false;
    }
    panic!("this test needs `{tool}` in PATH, and it is not there; install it (only python3 and redis-server may be missing, and only in kernel mode)");
}

pub struct Output {
    pub status: ExitStatus,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

impl Output {
    pub fn stderr_text(&self) -> String {
        String::from_utf8_lossy(&self.stderr).into_owned()
    }

    pub fn stdout_text(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }

    pub fn describe(&self) -> String {
        let out = self.stdout_text();
        let out: String = out.chars().take(2000).collect();
        format!(
            "status {:?}\n--- stdout (first 2000 chars) ---\n{out}\n--- stderr ---\n{}",
            self.status,
            self.stderr_text()
        )
    }
}

/// Runs `cmd` with `stdin` as its input, killing it after `timeout` (which fails the test).
pub fn run(mut cmd: Command, stdin: &[u8], timeout: Duration) -> Output {
    let desc = format!("{cmd:?}");
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {desc}: {e}"));
    let mut input = child.stdin.take().expect("stdin");
    let stdin = stdin.to_vec();
    let writer = std::thread::spawn(move || {
        // openssl s_client with -ign_eof reads stdin to its end, then waits for the server.
        let _ = input.write_all(&stdin);
    });
    let mut out = child.stdout.take().expect("stdout");
    let mut err = child.stderr.take().expect("stderr");
    let reader_out = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = out.read_to_end(&mut v);
        v
    });
    let reader_err = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = err.read_to_end(&mut v);
        v
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(s) = child.try_wait().expect("try_wait") {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            let stderr = reader_err.join().unwrap_or_default();
            panic!(
                "{desc} did not finish within {timeout:?}; stderr:\n{}",
                String::from_utf8_lossy(&stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let _ = writer.join();
    Output {
        status,
        stdout: reader_out.join().unwrap_or_default(),
        stderr: reader_err.join().unwrap_or_default(),
    }
}

/// Splits an HTTP/1.1 response (as printed by s_client) into status, headers and body.
pub fn split_http(raw: &[u8]) -> (u16, Vec<(String, String)>, Vec<u8>) {
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| {
            panic!(
                "no end of HTTP head in {} bytes: {:?}",
                raw.len(),
                String::from_utf8_lossy(&raw[..raw.len().min(400)])
            )
        });
    let head = std::str::from_utf8(&raw[..end]).expect("HTTP head is not UTF-8");
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or("");
    let status = status_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {status_line:?}"));
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    (status, headers, raw[end + 4..].to_vec())
}

pub fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

/// The value of the first stderr/stdout line starting with one of `prefixes`.
pub fn line_value(text: &str, prefixes: &[&str]) -> Option<String> {
    text.lines().find_map(|l| {
        prefixes
            .iter()
            .find_map(|p| l.trim_start().strip_prefix(p).map(|v| v.trim().to_string()))
    })
}
