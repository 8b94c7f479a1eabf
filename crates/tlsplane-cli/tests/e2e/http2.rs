//! HTTP/2 on `serve`, opt-in (issue 22, first step): h2 only when the operator names it in
//! `--alpn`; then files byte-exact, conditional and range requests, errors and path safety
//! over h2, with the same planning as HTTP/1.1. The client is curl (`--http2`, built with
//! nghttp2), which checks the framing itself.

use std::time::Duration;

use crate::support::fixtures::{self, sha256};
use crate::support::tools::{self, require};
use crate::support::Server;

/// The opt-in: h2 preferred, HTTP/1.1 for clients without it.
const OPT_IN: &str = "h2,http/1.1";

/// curl over TLS 1.3 offering h2 (and http/1.1), trusting the test CA; `-w` prints the HTTP
/// version of each transfer on stdout.
pub(crate) fn curl_h2(port: u16) -> std::process::Command {
    require("curl");
    let mut c = std::process::Command::new("curl");
    c.args([
        "-sS",
        "--http2",
        "--connect-timeout",
        "10",
        "--max-time",
        "60",
    ])
    .arg("--cacert")
    .arg(&fixtures::pki().ca_pem)
    .args(["--resolve", &format!("localhost:{port}:127.0.0.1")]);
    c
}

pub(crate) fn url(port: u16, path: &str) -> String {
    format!("https://localhost:{port}{path}")
}

fn h2_server() -> Server {
    Server::builder().arg("--alpn").arg(OPT_IN).start()
}

/// One request: (HTTP version as curl names it, status, header fields lowercased, body).
fn exchange(
    port: u16,
    path: &str,
    extra: &[&str],
) -> (String, u16, Vec<(String, String)>, Vec<u8>) {
    let dir = tempdir();
    let headers = dir.join("headers");
    let body = dir.join("body");
    let mut c = curl_h2(port);
    c.args(extra)
        .arg("-D")
        .arg(&headers)
        .arg("-o")
        .arg(&body)
        .args(["-w", "%{http_version} %{http_code}"])
        .arg(url(port, path));
    let out = tools::run(c, b"", Duration::from_secs(60));
    assert!(out.status.success(), "curl {path}: {}", out.describe());
    let text = out.stdout_text();
    let (version, status) = text.split_once(' ').expect("version and status");
    let status: u16 = status.trim().parse().expect("a status");
    let head = std::fs::read_to_string(&headers).unwrap_or_default();
    let fields = head
        .lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let body = std::fs::read(&body).unwrap_or_default();
    let _ = std::fs::remove_dir_all(&dir);
    (version.to_string(), status, fields, body)
}

fn tempdir() -> std::path::PathBuf {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = fixtures::get()
        .base
        .join(format!("h2-{}", N.fetch_add(1, Ordering::Relaxed)));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

fn field<'a>(fields: &'a [(String, String)], name: &str) -> Option<&'a str> {
    tools::header(fields, name)
}

#[test]
fn h2_is_offered_only_when_the_operator_opts_in() {
    let fx = fixtures::get();
    // Default: HTTP/1.1 only, whatever the client prefers.
    let server = Server::start();
    let (version, status, _, body) = exchange(server.port(), &fx.hello.url, &[]);
    assert_eq!((version.as_str(), status), ("1.1", 200));
    assert_eq!(body, fixtures::HELLO);
    server.stop();
    // Opted in: h2 for a client that offers it, HTTP/1.1 still for one that does not.
    let server = Server::builder()
        .arg("--alpn")
        .arg(OPT_IN)
        .arg("--access-log")
        .start();
    let (version, status, _, body) = exchange(server.port(), &fx.hello.url, &[]);
    assert_eq!((version.as_str(), status), ("2", 200));
    assert_eq!(body, fixtures::HELLO);
    let (version, status, _, body) = exchange(server.port(), &fx.hello.url, &["--http1.1"]);
    assert_eq!((version.as_str(), status), ("1.1", 200));
    assert_eq!(body, fixtures::HELLO);
    // The access log names the protocol of each request.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let logged = |proto: &str| {
        server
            .stderr_lines()
            .iter()
            .any(|l| l.contains(proto) && l.contains(&fx.hello.url))
    };
    while !(logged("HTTP/2.0") && logged("HTTP/1.1")) && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        logged("HTTP/2.0") && logged("HTTP/1.1"),
        "{}",
        server.stderr_lines().join("\n")
    );
    let stats = server.stop();
    assert_eq!(stats.get("http_requests"), 2);
}

#[test]
fn files_over_h2_are_byte_exact_one_after_another_and_multiplexed() {
    let fx = fixtures::get();
    let server = h2_server();
    let port = server.port();
    let files: Vec<_> = fx.files.iter().collect();
    for parallel in [false, true] {
        // All files over one connection: in turn, then at once (curl -Z multiplexes them as
        // concurrent streams).
        let dir = tempdir();
        let mut c = curl_h2(port);
        if parallel {
            c.args(["-Z", "--parallel-max", "16"]);
        }
        c.args(["-w", "%{http_version} %{http_code} %{num_connects}\\n"]);
        for (i, f) in files.iter().enumerate() {
            c.arg("-o")
                .arg(dir.join(i.to_string()))
                .arg(url(port, &f.url));
        }
        let out = tools::run(c, b"", Duration::from_secs(120));
        assert!(out.status.success(), "curl: {}", out.describe());
        let lines = out.stdout_text();
        let lines: Vec<&str> = lines.lines().collect();
        assert_eq!(lines.len(), files.len(), "{}", out.describe());
        let connects: u32 = lines
            .iter()
            .map(|l| {
                let mut w = l.split(' ');
                assert_eq!(w.next(), Some("2"), "not over h2: {l}");
                assert_eq!(w.next(), Some("200"), "{l}");
                w.next().and_then(|n| n.parse::<u32>().ok()).unwrap_or(0)
            })
            .sum();
        // One connection carries them all (curl reuses it; -Z waits for it to multiplex).
        assert_eq!(connects, 1, "{}", out.describe());
        for (i, f) in files.iter().enumerate() {
            let got = std::fs::read(dir.join(i.to_string())).expect("downloaded file");
            assert_eq!(got.len() as u64, f.size, "{} (parallel: {parallel})", f.url);
            assert!(
                sha256(&got) == f.sha256,
                "{} differs (parallel: {parallel})",
                f.url
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
    let stats = server.stop();
    assert_eq!(stats.get("http_responses_2xx"), 2 * files.len() as u64);
    assert_eq!(stats.get("h2_streams"), 2 * files.len() as u64);
    // The file bodies went as DATA payloads by sendfile on the kernel plane (the outbox of
    // tlsplane-h2 transport), never through this process; on the user plane rustls encrypts them.
    let file_bytes: u64 = 2 * files.iter().map(|f| f.size).sum::<u64>();
    match crate::support::mode() {
        crate::support::Mode::Kernel => {
            assert_eq!(
                stats.get("sendfile_bytes"),
                file_bytes,
                "file bodies over h2 not by sendfile: {stats:?}"
            );
            assert_eq!(stats.get("file_bytes_copied"), 0, "{stats:?}");
        }
        crate::support::Mode::User => {
            assert_eq!(stats.get("sendfile_bytes"), 0);
            assert_eq!(stats.get("file_bytes_copied"), file_bytes, "{stats:?}");
        }
    }
}

#[test]
fn conditional_range_and_errors_over_h2_are_planned_as_over_http1() {
    let fx = fixtures::get();
    let server = h2_server();
    let port = server.port();
    let hello = &fx.hello.url;

    // HEAD: the fields of a GET, no body.
    let (v, status, head_fields, body) = exchange(port, hello, &["-I"]);
    assert_eq!((v.as_str(), status), ("2", 200));
    // (curl -I writes the head where the body would go.)
    let shown = String::from_utf8_lossy(&body);
    assert!(
        shown.starts_with("HTTP/2 200") && !shown.contains("hello from"),
        "{shown}"
    );
    let etag = field(&head_fields, "etag").expect("ETag").to_string();
    let last_modified = field(&head_fields, "last-modified").expect("Last-Modified");
    assert_eq!(
        field(&head_fields, "content-length"),
        Some(fixtures::HELLO.len().to_string().as_str())
    );
    assert_eq!(
        field(&head_fields, "content-type"),
        Some("text/plain; charset=utf-8")
    );
    assert!(field(&head_fields, "connection").is_none());

    // The same validators as HTTP/1.1 gives.
    let (v, status, h1_fields, _) = exchange(port, hello, &["--http1.1", "-I"]);
    assert_eq!((v.as_str(), status), ("1.1", 200));
    assert_eq!(field(&h1_fields, "etag"), Some(etag.as_str()));
    assert_eq!(field(&h1_fields, "last-modified"), Some(last_modified));

    // 304 by If-None-Match and by If-Modified-Since.
    let inm = format!("If-None-Match: {etag}");
    let (v, status, fields, body) = exchange(port, hello, &["-H", &inm]);
    assert_eq!((v.as_str(), status), ("2", 304));
    assert!(body.is_empty());
    assert_eq!(field(&fields, "etag"), Some(etag.as_str()));
    let ims = format!("If-Modified-Since: {last_modified}");
    let (_, status, _, _) = exchange(port, hello, &["-H", &ims]);
    assert_eq!(status, 304);

    // 206 for one range, with If-Range too; 416 past the end.
    let (v, status, fields, body) = exchange(port, hello, &["-r", "6-9"]);
    assert_eq!((v.as_str(), status), ("2", 206));
    assert_eq!(body, &fixtures::HELLO[6..10]);
    let range = format!("bytes 6-9/{}", fixtures::HELLO.len());
    assert_eq!(field(&fields, "content-range"), Some(range.as_str()));
    let if_range = format!("If-Range: {etag}");
    let (_, status, _, body) = exchange(port, hello, &["-r", "0-4", "-H", &if_range]);
    assert_eq!((status, body.as_slice()), (206, &fixtures::HELLO[..5]));
    let big = fx.file(fixtures::SIZE_1M7);
    let (_, status, _, body) = exchange(port, &big.url, &["-r", "-100"]);
    let whole = std::fs::read(&big.path).expect("fixture");
    assert_eq!(
        (status, body.as_slice()),
        (206, &whole[whole.len() - 100..])
    );
    let past = format!("{}-", fixtures::HELLO.len() + 10);
    let (_, status, fields, _) = exchange(port, hello, &["-r", &past]);
    assert_eq!(status, 416);
    let unsatisfiable = format!("bytes */{}", fixtures::HELLO.len());
    assert_eq!(
        field(&fields, "content-range"),
        Some(unsatisfiable.as_str())
    );

    // 404, 405 with Allow, a directory without its slash → 301, path safety.
    let (v, status, _, body) = exchange(port, "/no-such-file", &[]);
    assert_eq!(
        (v.as_str(), status, body.as_slice()),
        ("2", 404, b"404 Not Found\n".as_slice())
    );
    let (_, status, fields, _) = exchange(port, hello, &["-X", "DELETE"]);
    assert_eq!(status, 405);
    assert_eq!(field(&fields, "allow"), Some("GET, HEAD"));
    let (_, status, fields, _) = exchange(port, "/sub", &[]);
    assert_eq!(status, 301);
    assert_eq!(field(&fields, "location"), Some("/sub/"));
    for target in [
        "/../secret.txt",
        "/%2e%2e/secret.txt",
        "/sub/../../secret.txt",
    ] {
        let (v, status, _, body) = exchange(port, target, &["--path-as-is"]);
        assert_eq!(v, "2");
        assert!((400..500).contains(&status), "{target}: {status}");
        let text = String::from_utf8_lossy(&body);
        assert!(!text.contains(fx.secret_marker), "{target}: leaked");
    }
    let stats = server.stop();
    assert!(stats.get("http_responses_3xx") >= 3, "{:?}", stats.0);
    assert!(stats.get("http_responses_4xx") >= 6, "{:?}", stats.0);
}

#[test]
fn h2load_many_streams_on_few_connections_when_installed() {
    // Not required (Debian's nghttp2-client); curl covers the rest when it is absent.
    if tools::find_in_path("h2load").is_none() {
        eprintln!("SKIPPED: h2load is not installed (Debian nghttp2-client)");
        return;
    }
    let fx = fixtures::get();
    let server = h2_server();
    let mut c = std::process::Command::new("h2load");
    c.args(["-n", "2000", "-c", "4", "-m", "20"]).arg(format!(
        "https://127.0.0.1:{}{}",
        server.port(),
        fx.text.url
    ));
    let out = tools::run(c, b"", Duration::from_secs(120));
    let text = out.stdout_text();
    assert!(out.status.success(), "{}", out.describe());
    assert!(text.contains("Application protocol: h2"), "{text}");
    assert!(
        text.contains("2000 succeeded, 0 failed, 0 errored, 0 timeout"),
        "{text}"
    );
    assert!(text.contains("status codes: 2000 2xx"), "{text}");
    let stats = server.stop();
    assert_eq!(stats.get("http_requests"), 2000);
}

/// Opens h2 connections (preface and SETTINGS, no stream) with Python's ssl: at
/// --max-connections 2 a third client is admitted by sending the oldest idle one GOAWAY, as
/// an idle keep-alive HTTP/1.1 connection would be closed; the newer one stays.
#[test]
fn an_idle_h2_connection_makes_room_under_max_connections() {
    if !tools::require("python3") {
        return; // the kernel-plane guest has no Python
    }
    let server = Server::builder()
        .arg("--alpn")
        .arg(OPT_IN)
        .arg("--max-connections")
        .arg("2")
        .start();
    let script = r#"
import socket, ssl, struct, sys, time
port, ca = int(sys.argv[1]), sys.argv[2]
ctx = ssl.create_default_context(cafile=ca)
ctx.set_alpn_protocols(["h2"])
def frame(t, f, sid, p=b""):
    return struct.pack(">I", len(p))[1:] + bytes([t, f]) + struct.pack(">I", sid) + p
def connect():
    s = ctx.wrap_socket(socket.create_connection(("127.0.0.1", port)), server_hostname="localhost")
    assert s.selected_alpn_protocol() == "h2", s.selected_alpn_protocol()
    s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0))
    return s
def types(s, seconds):
    # Frame types the server sends within `seconds` (or until it closes); answers PINGs.
    s.settimeout(0.2)
    buf, seen, end = b"", [], time.time() + seconds
    while time.time() < end:
        try:
            data = s.recv(65536)
        except socket.timeout:
            continue
        except (ssl.SSLError, OSError):
            break
        if not data:
            break
        buf += data
        while len(buf) >= 9:
            n = int.from_bytes(buf[:3], "big")
            if len(buf) < 9 + n:
                break
            t, f, payload = buf[3], buf[4], buf[9:9 + n]
            buf = buf[9 + n:]
            seen.append(t)
            if t == 4 and not f & 1:
                s.sendall(frame(4, 1, 0))
            if t == 6 and not f & 1:
                s.sendall(frame(6, 1, 0, payload))
    return seen
oldest = connect(); time.sleep(0.3)
newer = connect(); time.sleep(0.3)
third = connect()
print("third", 4 in types(third, 1.0))
print("oldest", 7 in types(oldest, 3.0))
print("newer", 7 in types(newer, 0.5))
"#;
    let mut cmd = std::process::Command::new("python3");
    cmd.arg("-c")
        .arg(script)
        .arg(server.port().to_string())
        .arg(&fixtures::pki().ca_pem);
    let out = tools::run(cmd, b"", Duration::from_secs(30));
    assert!(out.status.success(), "{}", out.describe());
    assert_eq!(
        out.stdout_text().lines().collect::<Vec<_>>(),
        ["third True", "oldest True", "newer False"],
        "the third client admitted, the oldest idle h2 connection sent GOAWAY, the newer kept: {}",
        out.describe()
    );
    let stats = server.stop();
    assert_eq!(stats.get("h2_evictions"), 1);
}

/// A connection that opens h2 (the preface, SETTINGS both ways, acknowledged) and asks for
/// nothing costs no h2 state (docs/HTTP2.md, "The opening"): `h2_started` counts only the
/// connection that sends a request, which is served byte-exact after the wait as from the
/// start. The others get, at the idle timeout, GOAWAY(NO_ERROR) naming stream 0 (nothing was
/// processed: a client may retry anything) and the connection's end. Before, every such
/// connection started h2 (its buffers, ~28 KiB) and its idle timeout was h2's two-step close
/// (GOAWAY naming stream 2^31-1, then a PING the client must answer).
#[test]
fn a_connection_that_asks_nothing_holds_no_h2_state_and_ends_at_the_idle_timeout() {
    if !tools::require("python3") {
        return; // the kernel-plane guest has no Python
    }
    let server = Server::builder()
        .arg("--alpn")
        .arg(OPT_IN)
        .arg("--idle-timeout")
        .arg("2")
        .start();
    let script = r#"
import socket, ssl, struct, sys, time
from hpack import Encoder
port, ca, path, want = int(sys.argv[1]), sys.argv[2], sys.argv[3], open(sys.argv[4], "rb").read()
ctx = ssl.create_default_context(cafile=ca)
ctx.set_alpn_protocols(["h2"])
def frame(t, f, sid, p=b""):
    return struct.pack(">I", len(p))[1:] + bytes([t, f]) + struct.pack(">I", sid) + p
class Conn:
    def __init__(self):
        raw = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.s = ctx.wrap_socket(raw, server_hostname="localhost")
        assert self.s.selected_alpn_protocol() == "h2", self.s.selected_alpn_protocol()
        # curl's opening: its settings, then a larger connection window.
        settings = struct.pack(">HI", 3, 100) + struct.pack(">HI", 4, 1 << 20)
        self.s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0, settings)
                       + frame(8, 0, 0, struct.pack(">I", 1 << 24)))
        self.buf, self.frames, self.closed = b"", [], False
    def read(self, until, seconds):
        end = time.time() + seconds
        self.s.settimeout(0.1)
        while time.time() < end and not until(self) and not self.closed:
            try:
                data = self.s.recv(1 << 16)
            except socket.timeout:
                continue
            except (ssl.SSLError, OSError):
                self.closed = True
                break
            if not data:
                self.closed = True
                break
            self.buf += data
            while len(self.buf) >= 9 and len(self.buf) >= 9 + int.from_bytes(self.buf[:3], "big"):
                n = int.from_bytes(self.buf[:3], "big")
                t, f, sid, p = self.buf[3], self.buf[4], int.from_bytes(self.buf[5:9], "big"), self.buf[9:9 + n]
                self.buf = self.buf[9 + n:]
                self.frames.append((t, f, sid, p))
                if t == 4 and not f & 1:
                    self.s.sendall(frame(4, 1, 0))
                if t == 6 and not f & 1:
                    self.s.sendall(frame(6, 1, 0, p))
    def kinds(self):
        return [(t, f) for t, f, _, _ in self.frames]
opened = time.time()
conns = [Conn() for _ in range(8)]
for c in conns:
    c.read(lambda c: (4, 0) in c.kinds() and (4, 1) in c.kinds(), 5)
    assert (4, 0) in c.kinds() and (4, 1) in c.kinds(), c.frames
time.sleep(1)
# One of them asks, after a second of nothing.
asker = conns[0]
hdrs = [(":method", "GET"), (":scheme", "https"), (":path", path), (":authority", "localhost")]
asker.s.sendall(frame(1, 5, 1, Encoder().encode(hdrs)))
asker.read(lambda c: any(t == 0 and f & 1 for t, f in c.kinds()), 10)
body = b"".join(p for t, f, sid, p in asker.frames if t == 0 and sid == 1)
print("asked", body == want, len(body))
asker.s.close()
# The others, at the idle timeout (2 s after their opening): GOAWAY naming stream 0, then the end.
for c in conns[1:]:
    c.read(lambda c: False, 6)
    goaways = [(int.from_bytes(p[:4], "big"), int.from_bytes(p[4:8], "big")) for t, f, sid, p in c.frames if t == 7]
    print("idle", goaways, c.closed, [t for t, f in c.kinds() if t not in (4, 7)])
print("within", round(time.time() - opened) <= 6)
"#;
    // ~40 KB: more than one DATA frame and one TLS record.
    let file = &fixtures::get().text;
    let mut cmd = std::process::Command::new(crate::http2_abuse::python_with_h2());
    cmd.arg("-c")
        .arg(script)
        .arg(server.port().to_string())
        .arg(&fixtures::pki().ca_pem)
        .arg(&file.url)
        .arg(&file.path);
    let out = tools::run(cmd, b"", Duration::from_secs(60));
    assert!(out.status.success(), "{}", out.describe());
    let lines: Vec<String> = out.stdout_text().lines().map(String::from).collect();
    assert_eq!(
        lines[0],
        format!("asked True {}", file.size),
        "{}",
        out.describe()
    );
    for line in &lines[1..8] {
        assert_eq!(line, "idle [(0, 0)] True []", "{}", out.describe());
    }
    assert_eq!(lines[8], "within True", "{}", out.describe());
    let stats = server.stop();
    assert_eq!(stats.get("h2_connections"), 8, "{stats:?}");
    assert_eq!(stats.get("h2_started"), 1, "{stats:?}");
    assert!(stats.get("http_timeouts") >= 7, "{stats:?}");
}

/// What a raw TLS stream carried: the plaintext length of every record the server sent after
/// the handshake, read from the record headers (5 bytes in the clear before each record).
#[derive(Default)]
struct Records {
    /// Bytes of the current record still to pass, or of the next header already seen.
    left: usize,
    header: Vec<u8>,
    /// Ciphertext lengths of the application-data records (type 23).
    lengths: Vec<usize>,
}

impl Records {
    fn saw(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            if self.left > 0 {
                let n = self.left.min(bytes.len());
                self.left -= n;
                bytes = &bytes[n..];
                continue;
            }
            let n = (5 - self.header.len()).min(bytes.len());
            self.header.extend_from_slice(&bytes[..n]);
            bytes = &bytes[n..];
            if self.header.len() == 5 {
                let len = u16::from_be_bytes([self.header[3], self.header[4]]) as usize;
                if self.header[0] == 23 {
                    self.lengths.push(len);
                }
                self.left = len;
                self.header.clear();
            }
        }
    }
}

/// A TCP stream that shows every byte it reads to [`Records`].
struct Counted {
    tcp: tokio::net::TcpStream,
    records: std::sync::Arc<std::sync::Mutex<Records>>,
}

impl tokio::io::AsyncRead for Counted {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = std::pin::Pin::new(&mut self.tcp).poll_read(cx, buf);
        let new = buf.filled()[before..].to_vec();
        self.records.lock().unwrap().saw(&new);
        polled
    }
}

impl tokio::io::AsyncWrite for Counted {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.tcp).poll_write(cx, buf)
    }
    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.tcp).poll_flush(cx)
    }
    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.tcp).poll_shutdown(cx)
    }
}

/// Downloads `path` over h2 (windows large enough that flow control never cuts a frame short)
/// and returns the body and the record lengths the server sent.
fn h2_download_counting_records(port: u16, path: &str) -> (Vec<u8>, Vec<usize>) {
    use crate::support::client::{ClientOpts, Tls};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut config = (*ClientOpts::version(Tls::V13).config()).clone();
        config.alpn_protocols = vec![b"h2".to_vec()];
        let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        let records = std::sync::Arc::new(std::sync::Mutex::new(Records::default()));
        let counted = Counted {
            tcp,
            records: records.clone(),
        };
        let name = rustls_pki_types::ServerName::try_from("localhost").unwrap();
        let tls = connector.connect(name, counted).await.expect("handshake");
        // Only what the server sends from here on: the handshake's records are not counted.
        records.lock().unwrap().lengths.clear();
        let (mut client, conn) = h2::client::Builder::new()
            .initial_window_size(16 << 20)
            .initial_connection_window_size(16 << 20)
            .handshake::<_, bytes::Bytes>(tls)
            .await
            .expect("h2 handshake");
        let driver = tokio::spawn(conn);
        let req = http::Request::get(format!("https://localhost:{port}{path}"))
            .body(())
            .unwrap();
        let (resp, _) = client.send_request(req, true).expect("request");
        let resp = resp.await.expect("response");
        assert_eq!(resp.status(), 200);
        let mut body = resp.into_body();
        let mut got = Vec::new();
        while let Some(chunk) = body.data().await {
            let chunk = chunk.expect("body");
            let _ = body.flow_control().release_capacity(chunk.len());
            got.extend_from_slice(&chunk);
        }
        drop(client);
        driver.abort();
        let lengths = records.lock().unwrap().lengths.clone();
        (got, lengths)
    })
}

/// A file's DATA frames fill whole TLS records on either plane. On the kernel plane each
/// frame's header goes with MSG_MORE and its payload by sendfile, which ends the record: a
/// 16,384-byte payload left its last 9 bytes in a record of their own (one per frame). Payloads
/// of 16,375 bytes make header and payload exactly one record.
#[test]
fn file_data_frames_fill_whole_tls_records() {
    let f = fixtures::get().file(fixtures::SIZE_1M7);
    let server = h2_server();
    let (body, lengths) = h2_download_counting_records(server.port(), &f.url);
    assert_eq!(body.len() as u64, f.size);
    assert!(sha256(&body) == f.sha256, "{} differs", f.url);
    // A record's ciphertext: plaintext + content type (1) + AEAD tag (16).
    let small = lengths.iter().filter(|&&l| l < 1024).count();
    let frames = f.size.div_ceil(16 * 1024) as usize;
    eprintln!(
        "records: {} in all, {small} under 1 KiB ({frames} frames' worth of file)",
        lengths.len()
    );
    assert!(
        small < 16,
        "{small} of {} records were under 1 KiB for a {}-byte file ({frames} frames): frames \
         leave the rest of a record to a small one; record lengths: {lengths:?}",
        lengths.len(),
        f.size
    );
    let stats = server.stop();
    if crate::support::mode() == crate::support::Mode::Kernel {
        assert_eq!(stats.get("sendfile_bytes"), f.size, "{stats:?}");
        assert_eq!(stats.get("file_bytes_copied"), 0, "{stats:?}");
    }
}
