//! The access log's duration of an HTTP/2 response ends at its last byte out, as over
//! HTTP/1.1 (issue 36): before, it ended when the body was handed to h2, before a byte of it
//! was written, so that a 1 MiB download the client took a second over was logged at a
//! fraction of a millisecond.
//!
//! The client makes the transfer measurably long: a small receive buffer and a small MSS (so
//! that the server's kernel, whose send buffer grows with the segment size, holds little of
//! the response), and nothing read for a second after the request. Then the logged duration
//! of the 1 MiB + 7 fixture covers that second, over h2 as over HTTP/1.1.

use std::process::Command;
use std::time::Duration;

use crate::http2_abuse::python_with_h2;
use crate::sites::scratch;
use crate::support::fixtures::{self, SIZE_1M7};
use crate::support::{tools, Server};

/// Seconds the client reads nothing after its request.
const STALL: f64 = 1.0;

/// `python3 - PROTOCOL PORT PATH STALL`: one GET over `h2` or `http/1.1`, read after the
/// stall; prints the body bytes received.
const CLIENT: &str = r##"import json, socket, ssl, sys, time
from hpack import Encoder
from hyperframe.frame import Frame, HeadersFrame, SettingsFrame, WindowUpdateFrame, DataFrame

proto, port, path, stall = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
ctx = ssl.create_default_context()
ctx.check_hostname = False
ctx.verify_mode = ssl.CERT_NONE
ctx.set_alpn_protocols([proto])
raw = socket.socket()
raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
raw.settimeout(20)
raw.connect(("127.0.0.1", port))
s = ctx.wrap_socket(raw, server_hostname="localhost")
assert s.selected_alpn_protocol() == proto
got = 0
if proto == "h2":
    # Windows far larger than the body: flow control holds nothing back.
    s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
              + SettingsFrame(0, settings={SettingsFrame.INITIAL_WINDOW_SIZE: 16 << 20}).serialize()
              + WindowUpdateFrame(0, window_increment=16 << 20).serialize())
    hdrs = [(":method", "GET"), (":scheme", "https"), (":path", path), (":authority", "localhost")]
    s.sendall(HeadersFrame(1, Encoder().encode(hdrs), flags=["END_HEADERS", "END_STREAM"]).serialize())
    time.sleep(stall)
    buf, done = b"", False
    while not done:
        d = s.recv(65536)
        if not d:
            break
        buf += d
        while len(buf) >= 9:
            f, length = Frame.parse_frame_header(memoryview(buf[:9]))
            if len(buf) < 9 + length:
                break
            f.parse_body(memoryview(buf[9:9 + length]))
            buf = buf[9 + length:]
            if isinstance(f, SettingsFrame) and "ACK" not in f.flags:
                s.sendall(SettingsFrame(0, flags=["ACK"]).serialize())
            if isinstance(f, DataFrame) and f.stream_id == 1:
                got += len(f.data)
                done = "END_STREAM" in f.flags
else:
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n".encode())
    time.sleep(stall)
    data = b""
    while True:
        d = s.recv(65536)
        if not d:
            break
        data += d
    got = len(data.split(b"\r\n\r\n", 1)[1])
print(json.dumps({"got": got}))
"##;

fn download(port: u16, proto: &str, path: &str) -> u64 {
    let mut cmd = Command::new(python_with_h2());
    cmd.args(["-c", CLIENT, proto, &port.to_string(), path])
        .arg(STALL.to_string());
    let out = tools::run(cmd, b"", Duration::from_secs(30));
    assert!(out.status.success(), "client {proto}: {}", out.describe());
    let v: serde_json::Value = serde_json::from_str(out.stdout_text().trim())
        .unwrap_or_else(|e| panic!("client output ({e}): {}", out.describe()));
    v["got"].as_u64().expect("got")
}

#[test]
fn an_h2_responses_logged_duration_ends_at_its_last_byte_out() {
    if !tools::require("python3") {
        return; // the kernel-plane guest has no Python
    }
    let dir = scratch("h2_access_log");
    let log = dir.join("access.log");
    let server = Server::builder()
        .arg("--alpn")
        .arg("h2,http/1.1")
        .arg("--access-log-file")
        .arg(log.display().to_string())
        .arg("--access-log-format")
        .arg("json")
        .start();
    let file = fixtures::get().file(SIZE_1M7);
    for proto in ["h2", "http/1.1"] {
        assert_eq!(
            download(server.port(), proto, &file.url),
            file.size,
            "{proto}"
        );
    }
    // A line is written once its response is out: both are by now.
    std::thread::sleep(Duration::from_millis(200));
    let text = std::fs::read_to_string(&log).expect("the access log");
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect(l))
        .collect();
    assert_eq!(lines.len(), 2, "{text}");
    for (line, protocol) in lines.iter().zip(["HTTP/2.0", "HTTP/1.1"]) {
        assert_eq!(line["protocol"], protocol, "{text}");
        assert_eq!(line["status"], 200, "{text}");
        assert_eq!(line["bytes"], file.size, "{text}");
        let secs = line["duration"].as_f64().expect("duration");
        assert!(
            secs >= 0.9 * STALL,
            "{protocol}: logged {secs} s for a body the client took {STALL} s to read: {text}"
        );
    }
    server.stop();
}
