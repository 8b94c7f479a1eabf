//! `proxy --mode http`: its responses on /metrics as serve's are
//! (`tlsplane_http_responses_total{class}`, `tlsplane_time_to_first_byte_seconds`), for
//! HTTP/1.1 and h2 clients, the backend's responses and the proxy's own; and a CONNECT, from
//! an h2 client or an HTTP/1.1 one, refused (405, counted), never forwarded to a backend
//! (issue 36). Before, the histogram stayed empty and the family was absent in proxy mode, and
//! a CONNECT went to the HTTP/1.1 backend as `CONNECT host:port HTTP/1.1`.

use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::http2_abuse::python_with_h2;
use crate::metrics::{admin_port, python_with_parser, scrape, value};
use crate::support::{tools, Server};

/// `python3 - PORT REQUEST...`: each request on a connection of its own; prints their
/// statuses. A request is `h2|METHOD|AUTHORITY|PATH` (PATH empty: none, as in CONNECT) or
/// `h1|RAW` (the raw request head, `\n` for line ends).
const CLIENT: &str = r##"import json, socket, ssl, sys
from hpack import Encoder, Decoder
from hyperframe.frame import Frame, HeadersFrame, SettingsFrame, RstStreamFrame, GoAwayFrame

port = int(sys.argv[1])

def connect(proto):
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols([proto])
    s = ctx.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=10), server_hostname="localhost")
    assert s.selected_alpn_protocol() == proto
    return s

def h2(method, authority, path):
    s = connect("h2")
    s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + SettingsFrame(0).serialize())
    hdrs = [(":method", method)]
    if path:
        hdrs += [(":scheme", "https"), (":path", path)]
    hdrs += [(":authority", authority)]
    # A CONNECT's stream stays open: the tunnel's bytes would follow.
    flags = ["END_HEADERS"] + ([] if method == "CONNECT" else ["END_STREAM"])
    s.sendall(HeadersFrame(1, Encoder().encode(hdrs), flags=flags).serialize())
    buf, dec = b"", Decoder()
    while True:
        d = s.recv(65536)
        if not d:
            return "closed"
        buf += d
        while len(buf) >= 9:
            f, length = Frame.parse_frame_header(memoryview(buf[:9]))
            if len(buf) < 9 + length:
                break
            f.parse_body(memoryview(buf[9:9 + length]))
            buf = buf[9 + length:]
            if isinstance(f, SettingsFrame) and "ACK" not in f.flags:
                s.sendall(SettingsFrame(0, flags=["ACK"]).serialize())
            elif isinstance(f, HeadersFrame) and f.stream_id == 1:
                return dict(dec.decode(f.data))[":status"]
            elif isinstance(f, (RstStreamFrame, GoAwayFrame)):
                return "reset"

def h1(raw):
    s = connect("http/1.1")
    s.sendall(raw.replace("\\n", "\r\n").encode())
    data = b""
    while b"\r\n" not in data:
        d = s.recv(65536)
        if not d:
            return "closed"
        data += d
    return data.split(b" ", 2)[1].decode()

out = []
for r in sys.argv[2:]:
    kind, rest = r.split("|", 1)
    out.append(h2(*rest.split("|", 2)) if kind == "h2" else h1(rest))
print(json.dumps(out))
"##;

#[test]
fn proxy_counts_responses_times_first_bytes_and_refuses_h2_connect() {
    if !tools::require("python3") {
        return; // the kernel-plane guest has no Python
    }
    let Some(py) = python_with_parser() else {
        panic!("this test needs Python's prometheus_client (apt-get install python3-prometheus-client)");
    };
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let backend = {
        let seen = seen.clone();
        crate::support::keep_alive_backend_by(move |line| {
            seen.lock().unwrap().push(line.trim_end().to_string());
            b"hello"
        })
    };
    let server = Server::builder()
        .proxy(&[backend.to_string()])
        .arg("--mode")
        .arg("http")
        .arg("--alpn")
        .arg("h2,http/1.1")
        .arg("--admin")
        .arg("127.0.0.1:0")
        .start();
    let url = format!("http://127.0.0.1:{}/metrics", admin_port(&server));
    let before = scrape(py, &url);

    let requests = [
        "h2|GET|localhost|/a",
        "h2|GET|localhost|/b",
        "h1|GET /c HTTP/1.1\\nHost: localhost\\nConnection: close\\n\\n",
        // Tunnels asked for: refused, not forwarded.
        "h2|CONNECT|example.com:443|",
        "h1|CONNECT example.com:443 HTTP/1.1\\nHost: example.com:443\\n\\n",
        // Two Hosts: refused by the proxy itself (400).
        "h1|GET /d HTTP/1.1\\nHost: a\\nHost: b\\n\\n",
    ];
    let mut cmd = Command::new(python_with_h2());
    cmd.args(["-c", CLIENT, &server.port().to_string()])
        .args(requests);
    let out = tools::run(cmd, b"", Duration::from_secs(30));
    assert!(out.status.success(), "client: {}", out.describe());
    let statuses: Vec<String> =
        serde_json::from_str(out.stdout_text().trim()).expect("client output");
    assert_eq!(
        statuses,
        ["200", "200", "200", "405", "405", "400"],
        "{}",
        out.describe()
    );
    let seen = seen.lock().unwrap().clone();
    assert!(
        seen.iter().all(|l| !l.starts_with("CONNECT")),
        "the backend got a CONNECT: {seen:?}"
    );
    assert_eq!(seen.len(), 3, "{seen:?}");

    let after = scrape(py, &url);
    let moved = |k: &str| value(&after, k) - value(&before, k);
    assert_eq!(moved("tlsplane_http_responses_total{class=2xx}"), 3.0);
    assert_eq!(moved("tlsplane_http_responses_total{class=4xx}"), 3.0);
    assert_eq!(moved("tlsplane_http_responses_total{class=5xx}"), 0.0);
    assert_eq!(moved("tlsplane_proxy_connect_refused_total{}"), 2.0);
    assert_eq!(moved("tlsplane_proxy_http_refused_total{}"), 3.0);
    // One first response per connection, each after its handshake at least.
    assert_eq!(
        moved("tlsplane_time_to_first_byte_seconds_count{}"),
        requests.len() as f64
    );
    assert!(moved("tlsplane_time_to_first_byte_seconds_sum{}") > 0.0);
    server.stop();
}
