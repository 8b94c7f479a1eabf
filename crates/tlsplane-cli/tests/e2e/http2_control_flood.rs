//! HTTP/2 control-frame floods (issue 36): SETTINGS, PING, WINDOW_UPDATE and PRIORITY frames
//! are capped per connection (crates/tlsplane-h2/src/flood.rs). h2 answers every SETTINGS and
//! PING and takes every WINDOW_UPDATE and PRIORITY: before the caps a client could send
//! 200,000 PINGs on one connection in a few seconds and have every one answered, until the
//! idle timeout.
//!
//! Against `serve` and against `proxy --mode http` (in front of an HTTP/1.1 backend), one
//! connection per case, written frame by frame in Python (`hyperframe`, `hpack`):
//! - a flood of each kind, after one request: GOAWAY(ENHANCE_YOUR_CALM) naming that request's
//!   stream, within a second, the connection closed; at most a cap's worth of SETTINGS and
//!   PING acknowledgements came back; `h2_flood_<kind>` and `h2_goaway_calm` moved by one;
//! - a client as busy as a legitimate one gets (below every cap, for longer than a bucket
//!   lasts): WINDOW_UPDATEs for the stream and for the connection after every DATA frame,
//!   60 PINGs and 10 SETTINGS a second, five PRIORITY frames, while it downloads a large body
//!   and then idles: no GOAWAY, every PING answered, no flood counted.
//!
//! Without the caps each flood runs until the client stops (no GOAWAY within the second, tens
//! of thousands of acknowledgements): every flood case fails.

use std::collections::BTreeMap;
use std::process::Command;
use std::time::Duration;

use crate::http2_abuse::python_with_h2;
use crate::metrics::{admin_port, http_get};
use crate::support::{fixtures, tools, Server};

const ENHANCE_YOUR_CALM: u64 = 11;
/// The caps (crates/tlsplane-h2/src/settings.rs) the acknowledgements are checked against.
const MAX_SETTINGS_PER_SECOND: f64 = 100.0;
const MAX_PINGS_PER_SECOND: f64 = 100.0;

/// The client: `python3 - MODE PORT SMALL BIG SECONDS`; prints what happened as JSON.
/// MODE is a flood's kind (`settings`, `ping`, `window_update`, `priority`), or `busy`.
const CLIENT: &str = r##"import json, socket, ssl, struct, sys, time
from hpack import Encoder
from hyperframe.frame import (Frame, HeadersFrame, SettingsFrame, PingFrame,
    WindowUpdateFrame, PriorityFrame, GoAwayFrame, DataFrame, RstStreamFrame)

mode, port, small, big, seconds = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], float(sys.argv[5])
ctx = ssl.create_default_context()
ctx.check_hostname = False
ctx.verify_mode = ssl.CERT_NONE
ctx.set_alpn_protocols(["h2"])
s = ctx.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=10), server_hostname="localhost")
assert s.selected_alpn_protocol() == "h2"
enc = Encoder()
out = {"goaway": None, "last_stream": None, "settings_acks": 0, "ping_acks": 0, "pings": 0,
       "closed_after": None, "sent": 0, "data": {}, "ended": [], "rst": 0, "updates": 0}
buf = b""
closed = False
start = time.monotonic()

def send(b):
    s.settimeout(5)
    s.sendall(b)

def on_frame(f):
    if isinstance(f, GoAwayFrame):
        out["goaway"] = f.error_code
        out["last_stream"] = f.last_stream_id
    elif isinstance(f, RstStreamFrame):
        out["rst"] += 1
    elif isinstance(f, PingFrame) and "ACK" in f.flags:
        out["ping_acks"] += 1
    elif isinstance(f, SettingsFrame):
        if "ACK" in f.flags:
            out["settings_acks"] += 1
        else:
            send(SettingsFrame(0, flags=["ACK"]).serialize())
    elif isinstance(f, DataFrame):
        sid = str(f.stream_id)
        out["data"][sid] = out["data"].get(sid, 0) + len(f.data)
        if mode == "busy" and f.flow_controlled_length:
            # Window back for every frame, the stream's and the connection's: the most
            # WINDOW_UPDATEs a receiver sends.
            n = f.flow_controlled_length
            send(WindowUpdateFrame(f.stream_id, window_increment=n).serialize()
                 + WindowUpdateFrame(0, window_increment=n).serialize())
            out["updates"] += 2
        if "END_STREAM" in f.flags:
            out["ended"].append(f.stream_id)
    elif isinstance(f, HeadersFrame) and "END_STREAM" in f.flags:
        out["ended"].append(f.stream_id)

def pump(timeout):
    global buf, closed
    if closed:
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
                on_frame(f)
            s.settimeout(0.0)
    except (socket.timeout, ssl.SSLWantReadError, BlockingIOError):
        return
    except (OSError, ssl.SSLError, ValueError, EOFError):
        out["closed_after"] = round(time.monotonic() - start, 3)
        closed = True

def wait_for(cond, secs):
    end = time.monotonic() + secs
    while not cond() and not closed and time.monotonic() < end:
        pump(0.02)

def request(sid, path):
    hdrs = [(":method", "GET"), (":scheme", "https"), (":path", path), (":authority", "localhost")]
    return HeadersFrame(sid, enc.encode(hdrs), flags=["END_HEADERS", "END_STREAM"]).serialize()

# A browser's opening: a large connection window at once.
send(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + SettingsFrame(0, settings={SettingsFrame.INITIAL_WINDOW_SIZE: 1 << 20}).serialize()
     + WindowUpdateFrame(0, window_increment=15 << 20).serialize())
send(request(1, small))
wait_for(lambda: 1 in out["ended"], 5)
assert 1 in out["ended"], out

makers = {
    "settings": lambda i: SettingsFrame(0, settings={SettingsFrame.HEADER_TABLE_SIZE: 4096}).serialize(),
    "ping": lambda i: PingFrame(0, opaque_data=struct.pack(">Q", i)).serialize(),
    "window_update": lambda i: WindowUpdateFrame(0, window_increment=1).serialize(),
    "priority": lambda i: PriorityFrame(3 + 2 * i, depends_on=0, stream_weight=16).serialize(),
}
try:
    if mode in makers:
        make = makers[mode]
        start = time.monotonic()
        while not closed and time.monotonic() - start < seconds:
            send(b"".join(make(out["sent"] + i) for i in range(100)))
            out["sent"] += 100
            pump(0)
        wait_for(lambda: False, 1.0)
    elif mode == "busy":
        # Firefox's old dependency tree: five PRIORITY frames on idle streams.
        send(b"".join(PriorityFrame(3 + 2 * i, depends_on=0, stream_weight=1 + i).serialize() for i in range(5)))
        send(request(3, big))
        t0 = time.monotonic()
        settings_sent = 0
        while not closed and time.monotonic() < t0 + seconds:
            elapsed = time.monotonic() - t0
            # As many as are due by now at 60 and 10 a second (catching up after a slow read).
            while out["pings"] < int(elapsed * 60):
                send(PingFrame(0, opaque_data=struct.pack(">Q", out["pings"])).serialize())
                out["pings"] += 1
            while settings_sent < int(elapsed * 10):
                send(SettingsFrame(0, settings={SettingsFrame.HEADER_TABLE_SIZE: 4096}).serialize())
                settings_sent += 1
            pump(0.005)
        wait_for(lambda: out["ping_acks"] >= out["pings"], 2)
except OSError:
    pass
print(json.dumps(out))
"##;

#[derive(Clone, Copy, Debug)]
enum Product {
    Serve,
    Proxy,
}

/// One client run; its JSON.
fn client(port: u16, mode: &str, small: &str, big: &str, seconds: f64) -> serde_json::Value {
    let mut cmd = Command::new(python_with_h2());
    cmd.args(["-c", CLIENT, mode, &port.to_string(), small, big])
        .arg(seconds.to_string());
    let out = tools::run(cmd, b"", Duration::from_secs_f64(seconds + 30.0));
    assert!(out.status.success(), "client {mode}: {}", out.describe());
    let v: serde_json::Value = serde_json::from_str(out.stdout_text().trim())
        .unwrap_or_else(|e| panic!("client output ({e}): {}", out.describe()));
    eprintln!("{mode}: {v}");
    v
}

/// Every `tlsplane_*_total` counter on /metrics, by name, the product's prefix (`proxy_`)
/// taken off.
fn counters(admin: u16) -> BTreeMap<String, u64> {
    http_get(admin, "/metrics")
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (name, value) = l.split_once(' ')?;
            let name = name.strip_prefix("tlsplane_")?.strip_suffix("_total")?;
            let name = name.strip_prefix("proxy_").unwrap_or(name);
            Some((name.to_string(), value.trim().parse::<f64>().ok()? as u64))
        })
        .collect()
}

fn moved(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>, name: &str) -> u64 {
    after.get(name).copied().unwrap_or(0) - before.get(name).copied().unwrap_or(0)
}

fn floods_end_with_enhance_your_calm_and_busy_clients_are_served(product: Product) {
    if !tools::require("python3") {
        return; // the kernel-plane guest has no Python
    }
    let builder = match product {
        Product::Serve => Server::builder(),
        Product::Proxy => {
            static BIG: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
            let big: &'static [u8] = BIG.get_or_init(|| vec![b'x'; 16 << 20]);
            let backend = crate::support::keep_alive_backend_by(move |line| {
                if line.starts_with("GET /big ") {
                    big
                } else {
                    b"hello"
                }
            });
            Server::builder()
                .proxy(&[backend.to_string()])
                .arg("--mode")
                .arg("http")
        }
    };
    let server = builder
        .arg("--alpn")
        .arg("h2,http/1.1")
        .arg("--admin")
        .arg("127.0.0.1:0")
        .start();
    let (port, admin) = (server.port(), admin_port(&server));
    let (small, big) = match product {
        Product::Serve => (
            fixtures::get().hello.url.clone(),
            fixtures::get().big().url.clone(),
        ),
        Product::Proxy => ("/small".to_string(), "/big".to_string()),
    };

    for kind in ["settings", "ping", "window_update", "priority"] {
        let before = counters(admin);
        let o = client(port, kind, &small, &big, 5.0);
        let after = counters(admin);
        let what = format!("{product:?} {kind}: {o}");
        assert_eq!(o["goaway"].as_u64(), Some(ENHANCE_YOUR_CALM), "{what}");
        // h2's own GOAWAY: the last stream it took, the request made before the flood.
        assert_eq!(o["last_stream"].as_u64(), Some(1), "{what}");
        let closed = o["closed_after"].as_f64().expect("closed");
        assert!(closed < 1.0, "closed {closed} s into the flood: {what}");
        // Acknowledgements: the opening's, then at most a bucket and its refill.
        let refill = 1.0 + closed;
        let settings_acks = o["settings_acks"].as_f64().unwrap_or(0.0);
        assert!(
            settings_acks <= 2.0 + MAX_SETTINGS_PER_SECOND * refill,
            "{what}"
        );
        let ping_acks = o["ping_acks"].as_f64().unwrap_or(0.0);
        assert!(ping_acks <= MAX_PINGS_PER_SECOND * refill + 1.0, "{what}");
        assert_eq!(
            moved(&before, &after, &format!("h2_flood_{kind}")),
            1,
            "{what}"
        );
        assert_eq!(moved(&before, &after, "h2_goaway_calm"), 1, "{what}");
    }

    let before = counters(admin);
    let o = client(port, "busy", &small, &big, 3.0);
    let after = counters(admin);
    let what = format!("{product:?} busy: {o}");
    assert_eq!(o["goaway"], serde_json::Value::Null, "{what}");
    assert_eq!(o["closed_after"], serde_json::Value::Null, "{what}");
    assert_eq!(o["rst"].as_u64(), Some(0), "{what}");
    let pings = o["pings"].as_u64().unwrap_or(0);
    assert!(pings >= 150, "fewer PINGs than a bucket holds: {what}");
    assert_eq!(o["ping_acks"].as_u64(), Some(pings), "{what}");
    assert!(o["data"]["3"].as_u64().unwrap_or(0) >= 1 << 20, "{what}");
    assert!(o["updates"].as_u64().unwrap_or(0) >= 128, "{what}");
    for kind in ["settings", "ping", "window_update", "priority"] {
        assert_eq!(
            moved(&before, &after, &format!("h2_flood_{kind}")),
            0,
            "{what}"
        );
    }
    server.stop();
}

#[test]
fn serve_floods_end_with_enhance_your_calm_and_busy_clients_are_served() {
    floods_end_with_enhance_your_calm_and_busy_clients_are_served(Product::Serve);
}

#[test]
fn proxy_floods_end_with_enhance_your_calm_and_busy_clients_are_served() {
    floods_end_with_enhance_your_calm_and_busy_clients_are_served(Product::Proxy);
}
