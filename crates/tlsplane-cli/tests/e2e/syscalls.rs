//! The system-call budget (issue 20): what the server's event loops spend per connection and
//! per request, counted with strace on the real binary. Timing on shared machines drifts from
//! run to run; these counts do not, so they guard the per-connection cost where a benchmark
//! could not. Each client here is sequential and waits for every answer, so each of the
//! server's waits is a real one (no batching of events from several connections) and the
//! counts are the worst case, repeatable to the call.
//!
//! Raising a budget is a deliberate change: say why in the commit and in docs/BENCHMARKS.md
//! ("System calls per connection").

use std::collections::BTreeMap;
use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::client::{ClientOpts, End, Tls, TlsClient};
use crate::support::tools::{require, split_http};
use crate::support::{fixtures, get_request, keep_alive_backend, mode, Mode, Server};

/// Connections (or requests) counted per scenario.
const N: usize = 30;

/// The budgets: system calls per unit, all of the server's event-loop threads together
/// (`handshake-*`, `conn-*`). The key daemon is another process and not counted; its round
/// trip shows here as one send and one receive per full handshake.
const BUDGETS: &[(&str, f64)] = &[
    // Measured on this project's machine (docs/BENCHMARKS.md, "System calls per connection"),
    // plus about one call of room for timing: whether a client's reply arrives before the
    // server waits for it (one `epoll_wait` more or less), the event loops' 1 s timer anchor.
    ("tls13_full", 15.0),
    ("tls12_resumed", 13.5),
    ("tls13_resumed", 12.5),
    ("conn_get", 20.0),
    // A client whose request waits for the server's Finished (10 ms), then the lingering
    // close: whether the client's FIN is in before the server looks for it varies from run to
    // run (+3 calls, measured 25.4-26.4 and 29.6-30.3): hence the room, and the exact check
    // on `epoll_ctl` in the test (the move this scenario guards against: 4 instead of 2).
    ("tls12_full_get", 32.0),
    // The GETs' file calls are checked exactly as well (`file_calls`): they do not vary.
    ("keepalive_get", 8.0),
    ("proxied_get", 12.5),
];

fn budget(name: &str) -> f64 {
    BUDGETS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|&(_, b)| b)
        .expect("a budget for every scenario")
}

/// strace attached to every thread of a running server, writing one line per call.
struct Trace {
    child: Child,
    out: std::path::PathBuf,
    pid: u32,
}

impl Trace {
    fn attach(pid: u32) -> Trace {
        let out = std::env::temp_dir().join(format!(
            "tlsplane-syscalls-{}-{pid}-{:?}.txt",
            std::process::id(),
            Instant::now()
        ));
        let child = Command::new("strace")
            .args(["-f", "-qq", "-o"])
            .arg(&out)
            .args(["-p", &pid.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting strace");
        // Attached once every thread has a tracer.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let all = threads(pid).iter().all(|(tid, _)| {
                std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/status"))
                    .map(|s| {
                        s.lines()
                            .any(|l| l.starts_with("TracerPid:") && l.trim_end() != "TracerPid:\t0")
                    })
                    .unwrap_or(true)
            });
            if all {
                break;
            }
            assert!(Instant::now() < deadline, "strace did not attach to {pid}");
            std::thread::sleep(Duration::from_millis(20));
        }
        // Let the loops settle back into their waits.
        std::thread::sleep(Duration::from_millis(200));
        Trace { child, out, pid }
    }

    /// Detaches and returns the calls of the event-loop threads, by name.
    fn finish(mut self) -> BTreeMap<String, usize> {
        std::thread::sleep(Duration::from_millis(200));
        let loops: Vec<String> = threads(self.pid)
            .into_iter()
            .filter(|(_, name)| name.starts_with("handshake-") || name.starts_with("conn-"))
            .map(|(tid, _)| tid)
            .collect();
        // SIGINT makes strace detach and flush.
        let _ = Command::new("kill")
            .args(["-INT", &self.child.id().to_string()])
            .status();
        let status = self.child.wait().expect("waiting for strace");
        let mut err = String::new();
        if let Some(mut e) = self.child.stderr.take() {
            let _ = e.read_to_string(&mut err);
        }
        let text = std::fs::read_to_string(&self.out).unwrap_or_else(|e| {
            panic!("reading strace's output (exit {status}, stderr {err:?}): {e}")
        });
        let _ = std::fs::remove_file(&self.out);
        let mut calls = BTreeMap::new();
        for line in text.lines() {
            let mut parts = line.splitn(2, ' ');
            let (Some(tid), Some(rest)) = (parts.next(), parts.next()) else {
                continue;
            };
            if !loops.iter().any(|t| t == tid) {
                continue;
            }
            let rest = rest.trim_start();
            // A call interrupted by another thread's line is counted where it starts.
            if rest.starts_with("<...") || rest.starts_with("+++") || rest.starts_with("---") {
                continue;
            }
            if let Some(name) = rest.split('(').next() {
                *calls.entry(name.to_string()).or_insert(0) += 1;
            }
        }
        calls
    }
}

/// (thread id, thread name) of every thread of `pid`.
fn threads(pid: u32) -> Vec<(String, String)> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .expect("listing the server's threads")
        .filter_map(|e| {
            let tid = e.ok()?.file_name().into_string().ok()?;
            let name = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm")).ok()?;
            Some((tid, name.trim().to_string()))
        })
        .collect()
}

/// Attempts at a scenario, of which the lowest count is judged. A slow moment of a shared
/// machine only adds calls (a wait that the client's reply just missed, a connection moved to
/// the connection loop while another's handshake ran): the same build gave 12.4 to 14.6 calls
/// per resumed TLS 1.3 handshake in runs of one day (docs/BENCHMARKS.md), and CI saw 15.1 to
/// 20.7 per full one in three attempts while a build ran beside it (the quiet figure: 14.6).
/// A change in the code adds its calls to every attempt. scripts/test.sh runs these tests
/// alone, one at a time.
const ATTEMPTS: usize = 5;

/// Counts the server's calls while `work` runs `N` units, until they are within the budget
/// and `also` finds nothing wrong with them (at most [`ATTEMPTS`] times), checks the lowest
/// count against the budget, and returns the count per unit, and the calls by name.
fn measure(
    server: &Server,
    name: &str,
    mut work: impl FnMut(),
    also: impl Fn(&BTreeMap<String, usize>) -> Option<String>,
) -> (f64, BTreeMap<String, usize>) {
    let mut best: Option<(f64, BTreeMap<String, usize>, String)> = None;
    for attempt in 1..=ATTEMPTS {
        let trace = Trace::attach(server.pid());
        work();
        let calls = trace.finish();
        let total: usize = calls.values().sum();
        let per_unit = total as f64 / N as f64;
        let table: Vec<String> = calls
            .iter()
            .map(|(k, v)| format!("{k} {:.2}", *v as f64 / N as f64))
            .collect();
        let table = table.join(", ");
        let wrong = also(&calls);
        eprintln!(
            "syscalls {name} (attempt {attempt}): {per_unit:.2} per unit (budget {}): {table}{}",
            budget(name),
            wrong
                .as_deref()
                .map(|w| format!("; {w}"))
                .unwrap_or_default()
        );
        let within = per_unit <= budget(name) && wrong.is_none();
        if within || best.as_ref().is_none_or(|b| per_unit < b.0) {
            best = Some((per_unit, calls, table));
        }
        if within {
            break;
        }
    }
    let (per_unit, calls, table) = best.expect("at least one attempt");
    assert!(
        per_unit <= budget(name),
        "{name}: {per_unit:.2} system calls per unit (the lowest of {ATTEMPTS} attempts), over \
         the budget of {} ({table}); if this is deliberate, raise the budget in \
         tests/e2e/syscalls.rs and say why in BENCHMARKS",
        budget(name),
    );
    if let Some(wrong) = also(&calls) {
        panic!("{name}: {wrong} ({table})");
    }
    (per_unit, calls)
}

/// What the total's room for timing could hide in a GET: the file's own calls, which do not
/// vary. It is opened beneath the root and then stat'ed on its descriptor (`openat2`, one
/// `statx`), as nginx does (open, fstat): no stat of the path before (docs/BENCHMARKS.md).
fn file_calls(calls: &BTreeMap<String, usize>) {
    let per = |name: &str| calls.get(name).copied().unwrap_or(0) as f64 / N as f64;
    assert!(
        per("openat2") <= 1.0 && per("statx") <= 1.0,
        "openat2 {:.2} and statx {:.2} per GET: one of each is the budget",
        per("openat2"),
        per("statx")
    );
}

/// Whether this run can count: strace natively; the kernel-plane guests have none.
fn counting() -> bool {
    if mode() == Mode::Kernel {
        eprintln!("SKIPPED: the system-call budget is checked natively (no strace in the guest)");
        return false;
    }
    require("strace")
}

/// A client whose first words after the handshake (`first`: a request, or nothing and a
/// close_notify) leave with its last handshake flight, in one write, as an efficient client
/// sends them (`tlsplane bench` does too). Sent later, they would race the server's look at
/// whether input is pending (found: served where the handshake ran; not yet: the connection
/// moves to the connection loop, four calls more), and the count would depend on the
/// machine's load.
///
/// `pause`: how long to wait between the end of the handshake and sending them (zero: with
/// the last flight).
fn connect_sending(
    port: u16,
    config: &std::sync::Arc<rustls::ClientConfig>,
    first: Option<&[u8]>,
    pause: Duration,
) -> TlsClient {
    use std::io::Write as _;
    let mut c = TlsClient::new(port, config.clone());
    while c.conn.is_handshaking() {
        c.flush_tls().expect("sending the handshake");
        if c.conn.is_handshaking() {
            assert!(c.read_tls_once().expect("handshake") > 0, "server closed");
        }
    }
    if !pause.is_zero() {
        c.flush_tls().expect("sending the handshake");
        std::thread::sleep(pause);
    }
    match first {
        Some(data) => c.conn.writer().write_all(data).expect("queueing"),
        None => c.conn.send_close_notify(),
    }
    c.flush_tls().expect("sending Finished and what follows");
    c
}

/// Handshake, close_notify with the Finished, then read until the server has closed.
fn handshake_only(port: u16, config: &std::sync::Arc<rustls::ClientConfig>) -> bool {
    let mut c = connect_sending(port, config, None, Duration::ZERO);
    let resumed = c.conn.handshake_kind() == Some(rustls::HandshakeKind::Resumed);
    let (rest, end) = c.read_to_end();
    assert!(
        rest.is_empty(),
        "{} bytes after our close_notify",
        rest.len()
    );
    assert!(matches!(end, End::CloseNotify), "{end:?}");
    resumed
}

fn server() -> Server {
    Server::builder().workers(1).start()
}

#[test]
fn full_tls13_handshake() {
    if !counting() {
        return;
    }
    let mut s = server();
    let config = ClientOpts::version(Tls::V13).config();
    handshake_only(s.port(), &config);
    measure(
        &s,
        "tls13_full",
        || {
            for _ in 0..N {
                // A fresh configuration each time: no session to resume.
                let fresh = ClientOpts::version(Tls::V13).config();
                assert!(!handshake_only(s.port(), &fresh));
            }
        },
        |_| None,
    );
    s.assert_alive();
    s.stop();
}

fn resumed(v: Tls, name: &str) {
    if !counting() {
        return;
    }
    let mut s = server();
    let config = ClientOpts::version(v).config();
    handshake_only(s.port(), &config);
    assert!(handshake_only(s.port(), &config), "{name}: not resumed");
    measure(
        &s,
        name,
        || {
            for _ in 0..N {
                assert!(handshake_only(s.port(), &config), "{name}: not resumed");
            }
        },
        |_| None,
    );
    s.assert_alive();
    s.stop();
}

#[test]
fn resumed_tls12_handshake() {
    resumed(Tls::V12, "tls12_resumed");
}

#[test]
fn resumed_tls13_handshake() {
    resumed(Tls::V13, "tls13_resumed");
}

/// A new connection, one GET of `f` with `Connection: close` sent `pause` after the handshake
/// (see [`connect_sending`]), the whole file and close_notify back; returns the kind of
/// handshake it was.
fn one_get(
    port: u16,
    config: &std::sync::Arc<rustls::ClientConfig>,
    f: &fixtures::DocFile,
    pause: Duration,
) -> Option<rustls::HandshakeKind> {
    let request = get_request(&f.url, "Connection: close\r\n");
    let mut c = connect_sending(port, config, Some(&request), pause);
    let (raw, end) = c.read_to_end();
    assert!(matches!(end, End::CloseNotify), "{end:?}");
    let (status, _, body) = split_http(&raw);
    assert_eq!(status, 200);
    assert_eq!(fixtures::sha256(&body), f.sha256, "the whole file");
    c.conn.handshake_kind()
}

/// One GET with `Connection: close` on a new connection (session resumed: the full
/// handshake is counted above).
#[test]
fn new_connection_with_one_get() {
    if !counting() {
        return;
    }
    let mut s = server();
    let f = fixtures::get().file(16383);
    let config = ClientOpts::version(Tls::V13).config();
    let one = |port| one_get(port, &config, f, Duration::ZERO);
    one(s.port());
    let (_, calls) = measure(
        &s,
        "conn_get",
        || {
            for _ in 0..N {
                one(s.port());
            }
        },
        |_| None,
    );
    file_calls(&calls);
    s.assert_alive();
    s.stop();
}

/// A full TLS 1.2 handshake, then one GET with `Connection: close`, which a TLS 1.2 client
/// can send only once the server's Finished has come: a round trip after the server's
/// handshake ended, with nothing to read in between. The connection waits for it where its
/// handshake ran (that loop has nothing else to do) instead of moving to the connection loop.
#[test]
fn tls12_full_handshake_then_get() {
    if !counting() {
        return;
    }
    let mut s = server();
    let f = fixtures::get().file(16383);
    let one = |port| {
        // A fresh configuration each time: no session to resume. The pause stands for a real
        // network's round trip (and leaves the server, slowed by strace, time to finish its
        // side): the server has found nothing to read and waits.
        let fresh = ClientOpts::version(Tls::V12).config();
        let kind = one_get(port, &fresh, f, Duration::from_millis(10));
        assert_eq!(kind, Some(rustls::HandshakeKind::Full));
    };
    one(s.port());
    // What the total's room for timing could hide: no move to the connection loop (which
    // deregisters from one event loop and registers with the other).
    let no_moves = |calls: &BTreeMap<String, usize>| {
        let epoll_ctl = calls.get("epoll_ctl").copied().unwrap_or(0) as f64 / N as f64;
        (epoll_ctl > 2.1).then(|| {
            format!(
                "epoll_ctl {epoll_ctl:.2} per connection: connections moved to the connection loop"
            )
        })
    };
    measure(
        &s,
        "tls12_full_get",
        || {
            for _ in 0..N {
                one(s.port());
            }
        },
        no_moves,
    );
    s.assert_alive();
    let stats = s.stop();
    assert!(
        stats["first_request_here"] > N as u64,
        "first requests served where the handshake ran: {stats:?}"
    );
}

#[test]
fn keep_alive_get() {
    if !counting() {
        return;
    }
    let mut s = server();
    let f = fixtures::get().file(16383);
    let mut c = TlsClient::connect_version(s.port(), Tls::V13);
    // The first request moves the connection to the connection loop; counted from there.
    assert_eq!(c.get(&f.url).status, 200);
    let (_, calls) = measure(
        &s,
        "keepalive_get",
        || {
            for _ in 0..N {
                let r = c.get(&f.url);
                assert_eq!(r.status, 200);
                assert_eq!(fixtures::sha256(&r.body), f.sha256);
            }
        },
        |_| None,
    );
    file_calls(&calls);
    c.close();
    s.assert_alive();
    s.stop();
}

/// A keep-alive GET through `proxy --mode http` to a keep-alive backend.
#[test]
fn proxied_get() {
    if !counting() {
        return;
    }
    let to = keep_alive_backend(&[b'x'; 1024]);
    let mut s = Server::builder()
        .proxy(&[to.to_string()])
        .arg("--mode")
        .arg("http")
        .workers(1)
        .start();
    let mut c = TlsClient::connect_version(s.port(), Tls::V13);
    assert_eq!(c.get("/").status, 200);
    measure(
        &s,
        "proxied_get",
        || {
            for _ in 0..N {
                let r = c.get("/");
                assert_eq!(r.status, 200);
                assert_eq!(r.body.len(), 1024);
            }
        },
        |_| None,
    );
    c.close();
    s.assert_alive();
    s.stop();
}
