//! Test support: the server under test as a child process, its exit counters, and the
//! kernel's kTLS counters around it.
//!
//! Environment:
//! - `TLSPLANE_TEST_DATA_PLANE` = `user` (default) or `kernel` (inside the kTLS VM);
//! - `TLSPLANE_BIN` overrides the server binary (the compiled-in path does not exist in a VM).
#![allow(dead_code)]

pub mod client;
pub mod fixtures;
pub mod tools;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

pub use fixtures::CertKind;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    User,
    Kernel,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::User => "user",
            Mode::Kernel => "kernel",
        }
    }
}

pub fn mode() -> Mode {
    match std::env::var("TLSPLANE_TEST_DATA_PLANE").as_deref() {
        Err(_) | Ok("") | Ok("user") => Mode::User,
        Ok("kernel") => Mode::Kernel,
        Ok(other) => panic!("TLSPLANE_TEST_DATA_PLANE={other:?}: expected `user` or `kernel`"),
    }
}

/// The server binary: `TLSPLANE_BIN`, else the one cargo built, else `tlsplane` next to this
/// test binary or in PATH (for copies of the test binary run elsewhere).
pub fn server_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("TLSPLANE_BIN") {
        return PathBuf::from(p);
    }
    let built = PathBuf::from(env!("CARGO_BIN_EXE_tlsplane"));
    if built.exists() {
        return built;
    }
    if let Some(sibling) = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(|d| d.join("tlsplane")))
    {
        if sibling.exists() {
            return sibling;
        }
    }
    tools::find_in_path("tlsplane").unwrap_or_else(|| {
        panic!(
            "no server binary: set TLSPLANE_BIN ({} does not exist)",
            built.display()
        )
    })
}

/// Skips a kernel-only test outside the VM. Returns true when the test should run.
pub fn kernel_only(what: &str) -> bool {
    if mode() == Mode::Kernel {
        return true;
    }
    eprintln!("SKIPPED: {what} needs the kernel data plane (run with TLSPLANE_TEST_DATA_PLANE=kernel under kTLS)");
    false
}

/// Whether the server said at start-up that this kernel can re-key TLS 1.3 (Linux >= 6.14).
pub fn kernel_rekeys(server: &Server) -> bool {
    server
        .stderr_lines()
        .iter()
        .filter_map(|l| info_message(l))
        .any(|m| m.starts_with("data plane:") && m.contains("TLS 1.3 rekey yes"))
}

/// The server's exit counters (`tlsplane-stats {json}`).
#[derive(Debug, Clone)]
pub struct Stats(pub BTreeMap<String, u64>);

impl Stats {
    pub fn get(&self, name: &str) -> u64 {
        *self
            .0
            .get(name)
            .unwrap_or_else(|| panic!("server stats have no counter {name:?}: {:?}", self.0))
    }
}

impl std::ops::Index<&str> for Stats {
    type Output = u64;
    fn index(&self, name: &str) -> &u64 {
        self.0
            .get(name)
            .unwrap_or_else(|| panic!("server stats have no counter {name:?}: {:?}", self.0))
    }
}

/// `/proc/net/tls_stat` as name -> value.
pub fn tls_stat() -> BTreeMap<String, u64> {
    let text = std::fs::read_to_string("/proc/net/tls_stat").unwrap_or_else(|e| {
        panic!("kernel mode needs /proc/net/tls_stat (tls module loaded): {e}")
    });
    text.lines()
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            Some((it.next()?.to_string(), it.next()?.parse().ok()?))
        })
        .collect()
}

/// The message of one of the server's log lines at info level, as `tracing` writes them
/// (`2025-01-31T12:00:00.000000Z  INFO message`); None for any other line (the raw
/// `tlsplane-stats` line, a line at another level).
pub fn info_message(line: &str) -> Option<&str> {
    let (time, rest) = line.split_once(' ')?;
    let is_time = time.len() > 20
        && time.ends_with('Z')
        && time.as_bytes()[10] == b'T'
        && time[..4].bytes().all(|b| b.is_ascii_digit());
    if !is_time {
        return None;
    }
    rest.trim_start().strip_prefix("INFO ")
}

/// kTLS counters are global to the (guest) machine: in kernel mode servers run one at a time
/// so that the deltas around a server are its own.
fn kernel_serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

pub struct ServerBuilder {
    cert: CertKind,
    args: Vec<String>,
    expect_user_fallbacks: bool,
    expect_decrypt_errors: u64,
    shutdown_grace: u64,
    soft_nofile: Option<u64>,
    hard_nofile: Option<u64>,
    workers: usize,
    config: Option<PathBuf>,
    /// `tlsplane proxy` to these backends instead of `serve`.
    proxy_to: Option<Vec<String>>,
    /// `tlsplane handoff --handoff-socket PATH` instead of `serve`.
    handoff: Option<PathBuf>,
}

impl ServerBuilder {
    /// Runs `tlsplane handoff --handoff-socket PATH ...` instead of `serve`.
    pub fn handoff(mut self, socket: impl Into<PathBuf>) -> Self {
        self.handoff = Some(socket.into());
        self
    }

    /// Runs `tlsplane proxy --to B ...` instead of `serve` (empty: the backends come from the
    /// configuration file).
    pub fn proxy(mut self, to: &[String]) -> Self {
        self.proxy_to = Some(to.to_vec());
        self
    }

    /// Event-loop threads (default 1).
    pub fn workers(mut self, n: usize) -> Self {
        self.workers = n;
        self
    }

    pub fn cert(mut self, kind: CertKind) -> Self {
        self.cert = kind;
        self
    }

    /// Serve the sites of this configuration file instead of the fixture root and certificate
    /// (the command line still sets the listener, data plane, workers and --stats).
    pub fn config_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.config = Some(path.into());
        self
    }

    /// Extra command-line arguments.
    pub fn arg(mut self, a: impl Into<String>) -> Self {
        self.args.push(a.into());
        self
    }

    /// Starts the server with this soft RLIMIT_NOFILE (through `prlimit`, which must exist).
    pub fn soft_nofile(mut self, n: u64) -> Self {
        self.soft_nofile = Some(n);
        self
    }

    /// Starts the server with this RLIMIT_NOFILE, soft and hard (through `prlimit`): the server
    /// cannot raise it.
    pub fn nofile(mut self, n: u64) -> Self {
        self.soft_nofile = Some(n);
        self.hard_nofile = Some(n);
        self
    }

    pub fn shutdown_grace(mut self, secs: u64) -> Self {
        self.shutdown_grace = secs;
        self
    }

    /// In kernel mode, do not require every handshake to land on the kernel plane.
    pub fn expect_user_fallbacks(mut self) -> Self {
        self.expect_user_fallbacks = true;
        self
    }

    /// In kernel mode, the number of records the kernel will fail to decrypt (TlsDecryptError).
    pub fn expect_decrypt_errors(mut self, n: u64) -> Self {
        self.expect_decrypt_errors = n;
        self
    }

    pub fn start(self) -> Server {
        let fx = fixtures::get();
        let leaf = fixtures::pki().leaf(self.cert);
        let kernel_guard = (mode() == Mode::Kernel).then(kernel_serial);
        let bin = server_bin();
        let mut cmd = match self.soft_nofile {
            Some(n) => {
                let mut c = Command::new("prlimit");
                let hard = self.hard_nofile.map(|h| h.to_string()).unwrap_or_default();
                c.arg(format!("--nofile={n}:{hard}")).arg(&bin);
                c
            }
            None => Command::new(&bin),
        };
        match (&self.proxy_to, &self.handoff) {
            (_, Some(socket)) => {
                cmd.arg("handoff").arg("--handoff-socket").arg(socket);
            }
            (Some(to), None) => {
                cmd.arg("proxy");
                for b in to {
                    cmd.arg("--to").arg(b);
                }
            }
            (None, None) => {
                cmd.arg("serve");
            }
        }
        match &self.config {
            Some(file) => cmd.arg("--config").arg(file),
            None if self.proxy_to.is_some() || self.handoff.is_some() => cmd
                .arg("--cert")
                .arg(&leaf.cert_pem)
                .arg("--key")
                .arg(&leaf.key_pem),
            None => cmd
                .arg(&fx.www)
                .arg("--cert")
                .arg(&leaf.cert_pem)
                .arg("--key")
                .arg(&leaf.key_pem),
        };
        cmd.args([
            "--listen",
            "127.0.0.1:0",
            "--data-plane",
            mode().as_str(),
            "--stats",
        ])
        .args(["--workers", &self.workers.to_string()])
        .args(["--shutdown-grace", &self.shutdown_grace.to_string()])
        .args(&self.args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
        let stderr = child.stderr.take().expect("piped stderr");
        let lines = Arc::new(Mutex::new(Vec::<String>::new()));
        let (port_tx, port_rx) = mpsc::channel();
        let reader = {
            let lines = lines.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines() {
                    let Ok(line) = line else { break };
                    eprintln!("[server] {line}");
                    if let Some(p) = info_message(&line)
                        .and_then(|m| m.strip_prefix("listening on https://127.0.0.1:"))
                        .and_then(|p| p.trim().parse::<u16>().ok())
                    {
                        let _ = port_tx.send(p);
                    }
                    lines.lock().unwrap_or_else(|e| e.into_inner()).push(line);
                }
            })
        };
        let port = match port_rx.recv_timeout(Duration::from_secs(20)) {
            Ok(p) => p,
            Err(_) => {
                let _ = child.kill();
                let status = child.wait();
                let _ = reader.join();
                panic!(
                    "server did not print its port within 20 s (exit: {status:?}); stderr:\n{}",
                    lines.lock().unwrap().join("\n")
                );
            }
        };
        // After start-up: the server probes kTLS (a few sockets with TLS_TX/TLS_RX) before it
        // listens, and those must not count against its connections.
        let tls_before = (mode() == Mode::Kernel).then(tls_stat);
        let data_plane = lines
            .lock()
            .unwrap()
            .iter()
            .find_map(|l| info_message(l).filter(|m| m.starts_with("data plane:")))
            .map(str::to_owned);
        assert!(
            data_plane
                .as_deref()
                .is_some_and(|m| m.starts_with(&format!("data plane: {}", mode().as_str()))),
            "server did not report `data plane: {}` before listening: {data_plane:?}",
            mode().as_str()
        );
        Server {
            child: Some(child),
            port,
            cert: self.cert,
            lines,
            reader: Some(reader),
            signaled: false,
            expect_user_fallbacks: self.expect_user_fallbacks,
            expect_decrypt_errors: self.expect_decrypt_errors,
            shutdown_grace: self.shutdown_grace,
            is_proxy: self.proxy_to.is_some(),
            is_handoff: self.handoff.is_some(),
            tls_before,
            _kernel_guard: kernel_guard,
        }
    }
}

pub struct Server {
    child: Option<Child>,
    port: u16,
    cert: CertKind,
    lines: Arc<Mutex<Vec<String>>>,
    reader: Option<std::thread::JoinHandle<()>>,
    signaled: bool,
    expect_user_fallbacks: bool,
    expect_decrypt_errors: u64,
    shutdown_grace: u64,
    is_proxy: bool,
    is_handoff: bool,
    tls_before: Option<BTreeMap<String, u64>>,
    _kernel_guard: Option<MutexGuard<'static, ()>>,
}

impl Server {
    pub fn builder() -> ServerBuilder {
        ServerBuilder {
            cert: CertKind::P256,
            args: Vec::new(),
            expect_user_fallbacks: false,
            expect_decrypt_errors: 0,
            shutdown_grace: 5,
            soft_nofile: None,
            hard_nofile: None,
            workers: 1,
            config: None,
            proxy_to: None,
            handoff: None,
        }
    }

    /// A server with the P-256 certificate and default options.
    pub fn start() -> Server {
        Self::builder().start()
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn cert(&self) -> CertKind {
        self.cert
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("server running").id()
    }

    pub fn stderr_lines(&self) -> Vec<String> {
        self.lines.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Waits until at least `n` lines of its log contain `text` (its log reaches the test
    /// through a reader thread, later than the server acts) and returns the log; panics after
    /// `within`.
    pub fn wait_lines(&self, text: &str, n: usize, within: Duration) -> Vec<String> {
        let deadline = Instant::now() + within;
        loop {
            let lines = self.stderr_lines();
            if lines.iter().filter(|l| l.contains(text)).count() >= n {
                return lines;
            }
            assert!(
                Instant::now() < deadline,
                "fewer than {n} lines {text:?} after {within:?}: {lines:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Panics unless the server process is still running.
    pub fn assert_alive(&mut self) {
        let child = self.child.as_mut().expect("server handle");
        if let Some(status) = child.try_wait().expect("try_wait") {
            panic!(
                "the server exited unexpectedly ({status}); stderr:\n{}",
                self.stderr_lines().join("\n")
            );
        }
    }

    /// Sends SIGTERM (once).
    pub fn terminate(&mut self) {
        if self.signaled {
            return;
        }
        let pid = self.pid().to_string();
        let status = Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .expect("running kill");
        assert!(status.success(), "kill -TERM {pid} failed: {status}");
        self.signaled = true;
    }

    /// Waits up to `timeout` for the process to exit.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let child = self.child.as_mut().expect("server handle");
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = child.try_wait().expect("try_wait") {
                return Some(s);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGTERM, wait for a clean exit, parse the counters and check the data-plane invariants
    /// of the mode (see the module documentation).
    pub fn stop(mut self) -> Stats {
        self.terminate();
        let limit = Duration::from_secs(self.shutdown_grace + 15);
        let status = match self.wait_exit(limit) {
            Some(s) => s,
            None => panic!(
                "server still running {limit:?} after SIGTERM; stderr:\n{}",
                self.stderr_lines().join("\n")
            ),
        };
        self.child = None;
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
        let lines = self.stderr_lines();
        assert!(
            status.success(),
            "server exited with {status} after SIGTERM; stderr:\n{}",
            lines.join("\n")
        );
        // stderr is a pipe here, as under systemd or a log collector: no terminal colours.
        assert!(
            !lines.iter().any(|l| l.contains('\x1b')),
            "ANSI escape codes in a log that is not a terminal; stderr:\n{}",
            lines.join("\n")
        );
        let stats_lines: Vec<&String> = lines
            .iter()
            .filter(|l| l.starts_with("tlsplane-stats "))
            .collect();
        assert_eq!(
            stats_lines.len(),
            1,
            "expected exactly one tlsplane-stats line; stderr:\n{}",
            lines.join("\n")
        );
        let json: serde_json::Value =
            serde_json::from_str(&stats_lines[0]["tlsplane-stats ".len()..])
                .expect("stats line is not JSON");
        let map = json
            .as_object()
            .expect("stats JSON is not an object")
            .iter()
            .map(|(k, v)| {
                (
                    k.clone(),
                    v.as_u64()
                        .unwrap_or_else(|| panic!("counter {k} is not an integer: {v}")),
                )
            })
            .collect();
        let stats = Stats(map);
        for name in [
            "handshakes",
            "handshakes_resumed",
            "handshake_failures",
            "handshake_peer_errors",
            "plane_kernel",
            "plane_user",
            "fallback_policy",
            "fallback_no_ulp",
            "fallback_suite",
            "kernel_setup_failures",
            "kernel_alerts_sent",
            "kernel_alerts_received",
            "close_notify_received",
            "kernel_decrypt_errors",
            "key_updates",
            "key_update_unsupported",
            "aead_limit_rekeys",
            "aead_limit_closes",
            "task_panics",
        ] {
            let _ = stats.get(name);
        }
        let product_counters: &[&str] = if self.is_handoff {
            &[
                "handoff_established",
                "handoff_user_plane",
                "handoff_relayed_bytes",
            ]
        } else if self.is_proxy {
            &[
                "proxy_connections",
                "proxy_forwarded",
                "proxy_client_errors",
                "proxy_backend_errors",
            ]
        } else {
            &[
                "http_connections",
                "http_requests",
                "http_responses_4xx",
                "http_responses_5xx",
                "http_timeouts",
                "http_handshake_errors",
                "http_io_errors",
            ]
        };
        for name in product_counters {
            let _ = stats.get(name);
        }
        eprintln!("server stats: {:?}", stats.0);
        // Nothing a client sends may panic a connection task.
        assert_eq!(
            stats["task_panics"], 0,
            "a connection task panicked: {stats:?}"
        );
        let panics: Vec<&String> = lines.iter().filter(|l| l.contains("panicked")).collect();
        assert!(
            panics.is_empty(),
            "the server's stderr reports a panic: {panics:?}"
        );
        if !self.is_proxy && !self.is_handoff {
            assert_eq!(
                stats["http_responses_5xx"], 0,
                "the server answered 5xx: {stats:?}"
            );
        }
        assert_eq!(
            stats["kernel_setup_failures"], 0,
            "kTLS set-up failed: {stats:?}"
        );
        match mode() {
            Mode::User => {
                assert_eq!(
                    stats["plane_kernel"], 0,
                    "user mode, yet connections on the kernel plane: {stats:?}"
                );
                assert_eq!(
                    stats["plane_user"], stats["handshakes"],
                    "every handshake must give a user-plane connection: {stats:?}"
                );
                assert_eq!(
                    stats["fallback_policy"], stats["handshakes"],
                    "user-plane connections by policy: {stats:?}"
                );
            }
            Mode::Kernel => {
                if !self.expect_user_fallbacks {
                    assert_eq!(
                        stats["plane_user"], 0,
                        "kernel mode, yet connections on the user plane: {stats:?}"
                    );
                    assert_eq!(
                        stats["plane_kernel"], stats["handshakes"],
                        "every handshake must give a kernel-plane connection: {stats:?}"
                    );
                }
                let before = self.tls_before.take().expect("tls_stat at start");
                let after = tls_stat();
                let delta = |k: &str| {
                    after.get(k).copied().unwrap_or(0) - before.get(k).copied().unwrap_or(0)
                };
                eprintln!(
                    "kTLS deltas: TlsTxSw +{} TlsRxSw +{} TlsDecryptError +{}",
                    delta("TlsTxSw"),
                    delta("TlsRxSw"),
                    delta("TlsDecryptError")
                );
                assert_eq!(
                    delta("TlsTxSw"),
                    stats["plane_kernel"],
                    "TlsTxSw must grow by plane_kernel: {stats:?}"
                );
                assert_eq!(
                    delta("TlsRxSw"),
                    stats["plane_kernel"],
                    "TlsRxSw must grow by plane_kernel: {stats:?}"
                );
                assert_eq!(
                    delta("TlsDecryptError"),
                    self.expect_decrypt_errors,
                    "unexpected TlsDecryptError delta: {stats:?}"
                );
                assert_eq!(
                    stats["kernel_decrypt_errors"], self.expect_decrypt_errors,
                    "kernel_decrypt_errors: {stats:?}"
                );
            }
        }
        stats
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
    }
}

/// A request for `path` with `Host: localhost` and optional extra header lines.
pub fn get_request(path: &str, extra: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nHost: localhost\r\n{extra}\r\n").into_bytes()
}

/// A backend that answers every request with `body`, Content-Length, keep-alive.
pub fn keep_alive_backend(body: &'static [u8]) -> std::net::SocketAddr {
    keep_alive_backend_by(move |_| body)
}

/// A keep-alive backend that answers each request with `answer(request line)`, with
/// Content-Length; a thread per connection.
pub fn keep_alive_backend_by(
    answer: impl Fn(&str) -> &'static [u8] + Clone + Send + 'static,
) -> std::net::SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(c) = c else { break };
            let answer = answer.clone();
            std::thread::spawn(move || {
                let mut r = BufReader::new(c.try_clone().expect("clone"));
                let mut w = c;
                loop {
                    let mut request_line = String::new();
                    let mut line = String::new();
                    loop {
                        line.clear();
                        match r.read_line(&mut line) {
                            Ok(0) | Err(_) => return,
                            Ok(_) if line == "\r\n" => break,
                            Ok(_) if request_line.is_empty() => request_line = line.clone(),
                            Ok(_) => {}
                        }
                    }
                    let body = answer(&request_line);
                    let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", body.len());
                    if w.write_all(head.as_bytes())
                        .and_then(|()| w.write_all(body))
                        .is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
    addr
}
