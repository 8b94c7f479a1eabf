//! Established HTTP/2 clients through a handshake and connection flood (issue 22).
//!
//! `serve --alpn h2,http/1.1` with admission limits set (--max-connections,
//! --client-handshake-rate, a 1 s --handshake-timeout) takes a flood of handshakes from six
//! other loopback addresses, each flooder keeping its handshakes stalled after the server's
//! flight (together they fill --max-connections) and starting new ones as fast as it is let
//! (and past its per-address rate).
//! Meanwhile two h2 clients that connected before it, each from its own address (Python's
//! `hyperframe` and `hpack`, raw frames, so that every frame the server sends is seen):
//! - a busy one keeps a stream open all along (a 1 MiB download it reads slowly, giving the
//!   server window in small steps) and asks for small files one after another on the same
//!   connection: it must never be sent GOAWAY, and every response must be byte-exact;
//! - an idle one, after one request, keeps no stream open: it is the connection a flood
//!   handshake may take the place of at --max-connections, and then only by GOAWAY(NO_ERROR)
//!   whose last stream id is the stream it completed (nothing it sent was dropped unanswered),
//!   after which its retry on a new connection is served.
//!
//! The h2 connection loop (src/h2_connection.rs) enters the server's idle list only while no
//! stream is open. Were it to enter it regardless, the busy connection would be the one left
//! to evict once the idle one has gone, and this test fails on its GOAWAY.

use std::io::{BufRead, BufReader, Write};
use std::net::Ipv4Addr;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use crate::http2_abuse::python_with_h2;
use crate::support::client::{tcp_connect_from, ClientOpts, Tls, TlsClient};
use crate::support::fixtures::{self, SIZE_1M7};
use crate::support::tools::require;
use crate::support::Server;

const BUSY: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);
const IDLE: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 3);
/// The flooders' addresses: 127.0.0.4 to 127.0.0.9.
const FLOODERS: std::ops::RangeInclusive<u8> = 4..=9;
/// Handshakes each flooder keeps stalled after the server's flight at most (its rate lets it
/// have 2 at once; the server ends each after --handshake-timeout).
const HELD: usize = 4;
const MAX_CONNECTIONS: usize = 12;
/// How long the flood runs.
const FLOOD: Duration = Duration::from_secs(4);
/// GOAWAY's error code NO_ERROR (RFC 9113 §7).
const NO_ERROR: u64 = 0;

/// `python3 - ROLE PORT CA SOURCE SECONDS URL=PATH...`: one h2 client over raw frames.
/// ROLE busy: a slow download (the first URL) stays open while the other URLs are fetched in
/// turn, one at a time, until a line on stdin; then the download's window is opened and it is
/// read to its end. ROLE idle: one request (the first URL), then no stream until a line on
/// stdin; then a retry of it on a new connection. Prints "ready" once the client is in place
/// (the busy one: its download's response head came), then its report as JSON.
const CLIENT: &str = r##"import json, select, socket, ssl, sys, time
from hpack import Encoder, Decoder
from hyperframe.frame import (Frame, HeadersFrame, DataFrame, SettingsFrame, PingFrame,
    WindowUpdateFrame, GoAwayFrame, RstStreamFrame)

role, port, ca, source = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
deadline = time.monotonic() + float(sys.argv[5])
files = [a.split("=", 1) for a in sys.argv[6:]]
content = {url: open(path, "rb").read() for url, path in files}
ctx = ssl.create_default_context(cafile=ca)
ctx.set_alpn_protocols(["h2"])

class Conn:
    def __init__(self):
        raw = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
        self.s = ctx.wrap_socket(raw, server_hostname="localhost")
        assert self.s.selected_alpn_protocol() == "h2", self.s.selected_alpn_protocol()
        self.s.setblocking(False)
        self.enc, self.dec = Encoder(), Decoder()
        self.buf, self.next_sid, self.streams = b"", 1, {}
        self.goaways, self.closed = [], False
        # The connection's window never limits: each stream's (65,535 at first) does.
        self.send(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + SettingsFrame(0).serialize()
                  + WindowUpdateFrame(0, window_increment=1 << 30).serialize())

    def send(self, b):
        self.s.setblocking(True)
        self.s.settimeout(10)
        self.s.sendall(b)
        self.s.setblocking(False)

    def request(self, url):
        sid = self.next_sid
        self.next_sid += 2
        hdrs = [(":method", "GET"), (":scheme", "https"), (":path", url), (":authority", "localhost")]
        self.streams[sid] = {"url": url, "status": None, "body": bytearray(), "done": False, "rst": None}
        self.send(HeadersFrame(sid, self.enc.encode(hdrs), flags=["END_HEADERS", "END_STREAM"]).serialize())
        return sid

    def pump(self, timeout):
        """Reads what came within `timeout` and answers what needs an answer."""
        if self.closed:
            time.sleep(timeout)
            return
        if not self.s.pending():
            select.select([self.s], [], [], timeout)
        try:
            while True:
                d = self.s.recv(1 << 16)
                if not d:
                    raise EOFError
                self.buf += d
        except (ssl.SSLWantReadError, BlockingIOError):
            pass
        except (OSError, EOFError):
            self.closed = True
        while len(self.buf) >= 9:
            f, n = Frame.parse_frame_header(memoryview(self.buf[:9]))
            if len(self.buf) < 9 + n:
                break
            f.parse_body(memoryview(self.buf[9:9 + n]))
            self.buf = self.buf[9 + n:]
            self.frame(f)

    def frame(self, f):
        st = self.streams.get(f.stream_id)
        if isinstance(f, SettingsFrame) and "ACK" not in f.flags:
            self.send(SettingsFrame(0, flags=["ACK"]).serialize())
        elif isinstance(f, PingFrame) and "ACK" not in f.flags:
            self.send(PingFrame(0, opaque_data=f.opaque_data, flags=["ACK"]).serialize())
        elif isinstance(f, GoAwayFrame):
            self.goaways.append([f.error_code, f.last_stream_id])
        elif isinstance(f, HeadersFrame) and st is not None:
            assert "END_HEADERS" in f.flags, "a response head in CONTINUATION frames"
            st["status"] = dict((k if isinstance(k, str) else k.decode(), v) for k, v in self.dec.decode(f.data)).get(":status")
            st["done"] = "END_STREAM" in f.flags
        elif isinstance(f, DataFrame) and st is not None:
            st["body"] += f.data
            st["done"] = "END_STREAM" in f.flags
        elif isinstance(f, RstStreamFrame) and st is not None:
            st["rst"], st["done"] = f.error_code, True

    def until(self, cond):
        while not cond() and not self.closed and time.monotonic() < deadline:
            self.pump(0.05)

    def exact(self, sid):
        st = self.streams[sid]
        return st["done"] and st["rst"] is None and str(st["status"]) == "200" and bytes(st["body"]) == content[st["url"]]

def stdin_line():
    return bool(select.select([sys.stdin], [], [], 0)[0]) and sys.stdin.readline() is not None

def ready():
    print("ready", flush=True)

out = {}
if role == "busy":
    c = Conn()
    big_url, small = files[0][0], [u for u, _ in files[1:]]
    big = c.request(big_url)
    c.until(lambda: c.streams[big]["status"] is not None)
    ready()
    # 12 KiB more window every 100 ms: ~120 KiB/s, the 1 MiB download outlasts the flood.
    # A small request at most every 5 ms: steady, without taking a core from the server.
    next_grant, next_small, current, fetched = time.monotonic(), 0, None, []
    while not stdin_line() and not c.closed and time.monotonic() < deadline:
        if time.monotonic() >= next_grant:
            c.send(WindowUpdateFrame(big, window_increment=12288).serialize())
            next_grant += 0.1
        if (current is None or c.streams[current]["done"]) and time.monotonic() >= next_small:
            next_small = time.monotonic() + 0.005
            if current is not None:
                fetched.append(current)
            current = c.request(small[len(fetched) % len(small)])
        c.pump(0.02)
    out["big_bytes_at_stop"] = len(c.streams[big]["body"])
    during_flood = len(fetched)
    if not c.closed:
        c.send(WindowUpdateFrame(big, window_increment=1 << 24).serialize())
    c.until(lambda: c.streams[big]["done"] and (current is None or c.streams[current]["done"]))
    if current is not None:
        fetched.append(current)
    out.update({
        "goaways": c.goaways, "closed": c.closed, "big_size": len(content[big_url]),
        "big_exact": c.exact(big), "big": {k: v for k, v in c.streams[big].items() if k != "body"},
        "small": len(fetched), "small_during_flood": during_flood,
        "small_not_exact": [{"sid": s, "url": c.streams[s]["url"], "status": c.streams[s]["status"],
                             "rst": c.streams[s]["rst"], "done": c.streams[s]["done"],
                             "bytes": len(c.streams[s]["body"])} for s in fetched if not c.exact(s)],
    })
    if not c.closed:
        c.send(GoAwayFrame(0, last_stream_id=0, error_code=0).serialize())
elif role == "idle":
    url = files[0][0]
    c = Conn()
    sid = c.request(url)
    c.until(lambda: c.streams[sid]["done"])
    out["first_exact"] = c.exact(sid)
    ready()
    while not stdin_line() and time.monotonic() < deadline:
        c.pump(0.05)
    out.update({"goaways": c.goaways, "closed_before_stop": c.closed})
    # The retry, as a client told by GOAWAY that nothing past its last stream was processed.
    out["retry_exact"] = False
    while not out["retry_exact"] and time.monotonic() < deadline:
        try:
            r = Conn()
            rsid = r.request(url)
            r.until(lambda: r.streams[rsid]["done"])
            out["retry_exact"] = r.exact(rsid)
        except OSError as e:
            out["retry_error"] = str(e)
            time.sleep(0.2)
else:
    raise SystemExit("unknown role " + role)
print(json.dumps(out), flush=True)
"##;

/// One Python h2 client, driven through its stdin and stdout.
struct PyClient {
    role: &'static str,
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
}

impl PyClient {
    fn start(
        role: &'static str,
        port: u16,
        source: Ipv4Addr,
        files: &[&fixtures::DocFile],
    ) -> Self {
        let mut cmd = Command::new(python_with_h2());
        cmd.arg("-c")
            .arg(CLIENT)
            .arg(role)
            .arg(port.to_string())
            .arg(&fixtures::pki().ca_pem)
            .arg(source.to_string())
            .arg("40")
            .args(
                files
                    .iter()
                    .map(|f| format!("{}={}", f.url, f.path.display())),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = cmd.spawn().expect("python3");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        PyClient {
            role,
            stdin: child.stdin.take(),
            child,
            lines,
        }
    }

    fn line(&self, within: Duration) -> String {
        self.lines
            .recv_timeout(within)
            .unwrap_or_else(|e| panic!("the {} client said nothing ({e})", self.role))
    }

    fn ready(&self) {
        assert_eq!(self.line(Duration::from_secs(15)), "ready", "{}", self.role);
    }

    /// Tells the client the flood is over; its report.
    fn finish(mut self) -> serde_json::Value {
        let mut stdin = self.stdin.take().expect("stdin");
        stdin.write_all(b"stop\n").expect("stop");
        drop(stdin);
        let report = self.line(Duration::from_secs(30));
        eprintln!("{} client: {report}", self.role);
        serde_json::from_str(&report).unwrap_or_else(|e| panic!("{} ({e}): {report}", self.role))
    }
}

impl Drop for PyClient {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[derive(Default)]
struct FloodCount {
    /// Handshakes the server answered with its flight.
    flights: AtomicU64,
    /// Connections refused (reset, or closed without a flight).
    refused: AtomicU64,
}

/// One flooder: from `source`, handshakes (ClientHello, read the server's flight, never
/// finish) as fast as they go, the last [`HELD`] kept open, until `stop`.
fn flooder(port: u16, source: Ipv4Addr, stop: Arc<AtomicBool>, count: Arc<FloodCount>) {
    let config = ClientOpts::version(Tls::V13).config();
    let mut held = std::collections::VecDeque::new();
    while !stop.load(Relaxed) {
        let Ok(sock) = tcp_connect_from(source, port) else {
            count.refused.fetch_add(1, Relaxed);
            continue;
        };
        let mut c = TlsClient::over(sock, config.clone());
        match c.flush_tls().and_then(|()| c.read_tls_once()) {
            Ok(n) if n > 0 => {
                count.flights.fetch_add(1, Relaxed);
                held.push_back(c);
                if held.len() > HELD {
                    held.pop_front();
                }
            }
            _ => {
                count.refused.fetch_add(1, Relaxed);
            }
        }
    }
}

#[test]
fn established_h2_clients_are_served_through_a_handshake_flood() {
    if !require("python3") {
        return; // the kernel-plane guest has no Python
    }
    let started = Instant::now();
    let fx = fixtures::get();
    let server = Server::builder()
        .arg("--alpn")
        .arg("h2,http/1.1")
        .arg("--max-connections")
        .arg(MAX_CONNECTIONS.to_string())
        // Six flooders × a burst of 2 stalled handshakes: more than the 10 places the two
        // clients leave. Their stalled handshakes end after a second (--handshake-timeout),
        // and the flooders, back to one token each, rush the freed places: their second
        // handshake there meets the per-address rate.
        .arg("--client-handshake-rate")
        .arg("1")
        .arg("--client-handshake-burst")
        .arg("2")
        .arg("--handshake-timeout")
        .arg("1")
        // Longer than the test: neither client is closed by its idle timeout.
        .arg("--idle-timeout")
        .arg("60")
        .start();
    let port = server.port();
    let small = [&fx.hello, fx.file(16385)];
    let busy = PyClient::start("busy", port, BUSY, &[fx.file(SIZE_1M7), small[0], small[1]]);
    let idle = PyClient::start("idle", port, IDLE, &[&fx.hello]);
    busy.ready();
    idle.ready();

    let stop = Arc::new(AtomicBool::new(false));
    let count = Arc::new(FloodCount::default());
    let flooders: Vec<_> = FLOODERS
        .map(|last| {
            let (stop, count) = (stop.clone(), count.clone());
            std::thread::spawn(move || flooder(port, Ipv4Addr::new(127, 0, 0, last), stop, count))
        })
        .collect();
    std::thread::sleep(FLOOD);
    stop.store(true, Relaxed);
    for f in flooders {
        f.join().expect("flooder");
    }
    let (flights, refused) = (count.flights.load(Relaxed), count.refused.load(Relaxed));
    eprintln!("flood: {flights} flights, {refused} refused");
    // The flood's stalled handshakes are closed: their places are free again before either
    // client does anything that could be evicted.
    std::thread::sleep(Duration::from_millis(300));
    let busy = busy.finish();
    let idle = idle.finish();
    let stats = server.stop();

    // The busy connection: never sent GOAWAY, every response byte-exact, served during the
    // flood, and its download still open when the flood ended (else it proved nothing).
    assert_eq!(busy["goaways"], serde_json::json!([]), "busy: {busy}");
    assert_eq!(busy["closed"], false, "busy: {busy}");
    assert_eq!(busy["big_exact"], true, "busy: {busy}");
    let at_stop = busy["big_bytes_at_stop"]
        .as_u64()
        .expect("big_bytes_at_stop");
    assert!(
        at_stop < SIZE_1M7,
        "the download ended before the flood did: {busy}"
    );
    assert_eq!(
        busy["small_not_exact"],
        serde_json::json!([]),
        "busy: {busy}"
    );
    assert!(
        busy["small_during_flood"]
            .as_u64()
            .expect("small_during_flood")
            >= 1,
        "no small response during the flood: {busy}"
    );

    // The idle connection: if it went, by GOAWAY(NO_ERROR) only, the last one naming stream
    // 1, the one it completed; and its retry was served.
    assert_eq!(idle["first_exact"], true, "idle: {idle}");
    assert_eq!(idle["retry_exact"], true, "idle: {idle}");
    let goaways = idle["goaways"].as_array().expect("goaways");
    assert!(
        goaways.iter().all(|g| g[0].as_u64() == Some(NO_ERROR)),
        "idle: {idle}"
    );
    // With twice --max-connections held by the flood, it did go.
    assert_eq!(
        goaways.last().map(|g| g[1].as_u64()),
        Some(Some(1)),
        "idle: {idle}"
    );
    assert_eq!(idle["closed_before_stop"], true, "idle: {idle}");

    // The counters: exactly one h2 connection evicted (the idle one); the flood met both
    // limits and got handshakes.
    assert!(
        flights >= 1 && refused >= 1,
        "{flights} flights, {refused} refused"
    );
    assert_eq!(stats.get("h2_evictions"), 1, "{stats:?}");
    assert_eq!(stats.get("idle_evicted"), 1, "{stats:?}");
    assert!(stats.get("limit_max_connections") >= 1, "{stats:?}");
    assert!(stats.get("limit_client_handshake_rate") >= 1, "{stats:?}");
    assert_eq!(
        stats.get("h2_connections"),
        3,
        "busy, idle and the idle one's retry: {stats:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "took {:?}",
        started.elapsed()
    );
}
