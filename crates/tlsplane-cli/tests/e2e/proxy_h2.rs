//! `tlsplane proxy --mode http` with HTTP/2 clients (issue 22): curl `--http2` through the
//! proxy to a Python HTTP/1.1 backend (each stream one HTTP/1.1 request on the backend pool),
//! and gRPC end to end with Python `grpcio` (client over TLS and h2 to the proxy, the proxy
//! over h2c to a grpcio server): unary, bidirectional streaming in lock step, and a non-OK
//! status with trailing metadata relayed.

use std::io::{BufRead, BufReader};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::http2::{curl_h2, url};
use crate::support::client::{End, Tls, TlsClient};
use crate::support::fixtures::{self, sha256};
use crate::support::tools::{self, require};
use crate::support::{get_request, Server};

/// A Python HTTP/1.1 backend (keep-alive, threads). `GET /big/N`: N deterministic bytes;
/// `GET /chunked/N`: the same, chunked in pieces of growing size, with a trailer and
/// connection options; `GET /head`: the request head it received, as its body; `POST /echo`: the body back;
/// `GET /slow`: 300 ms, then `slow`.
const HTTP_BACKEND: &str = r#"
import sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def reply(self, body, ctype="application/octet-stream"):
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Backend", "py")
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        if self.path.startswith("/big/"):
            n = int(self.path[5:])
            self.reply(bytes((i * 7 % 253) for i in range(n)))
        elif self.path.startswith("/chunked/"):
            n = int(self.path[9:])
            body = bytes((i * 7 % 253) for i in range(n))
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("Connection", "keep-alive, X-Hop")
            self.send_header("X-Hop", "1")
            self.end_headers()
            at, k = 0, 1
            while at < n:
                piece = body[at:at + k]
                self.wfile.write(b"%x;ext=1\r\n" % len(piece) + piece + b"\r\n")
                at, k = at + len(piece), k * 3 + 1
            self.wfile.write(b"0\r\nX-Trailer: t\r\n\r\n")
        elif self.path == "/head":
            head = self.requestline + "\r\n" + "".join(f"{k}: {v}\r\n" for k, v in self.headers.items())
            self.reply(head.encode(), "text/plain")
        elif self.path == "/slow":
            time.sleep(0.3)
            self.reply(b"slow", "text/plain")
        else:
            self.send_error(404)
    def do_POST(self):
        n = int(self.headers.get("Content-Length", "0"))
        self.reply(self.rfile.read(n))
s = ThreadingHTTPServer(("127.0.0.1", 0), H)
print(s.server_address[1], flush=True)
s.serve_forever()
"#;

/// A grpcio server on 127.0.0.1 (insecure: h2c), with generic handlers over bytes:
/// `/t.T/Echo` (unary, `echo:` + request), `/t.T/Chat` (bidirectional, `got:` + each
/// message), `/t.T/Fail` (PERMISSION_DENIED, `nope`, trailing metadata `x-why: because`).
const GRPC_BACKEND: &str = r#"
import grpc
from concurrent import futures
def echo(req, ctx):
    return b"echo:" + req
def chat(it, ctx):
    for m in it:
        yield b"got:" + m
def fail(req, ctx):
    ctx.set_trailing_metadata((("x-why", "because"),))
    ctx.set_code(grpc.StatusCode.PERMISSION_DENIED)
    ctx.set_details("nope")
    return b""
handlers = {
    "Echo": grpc.unary_unary_rpc_method_handler(echo),
    "Chat": grpc.stream_stream_rpc_method_handler(chat),
    "Fail": grpc.unary_unary_rpc_method_handler(fail),
}
s = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
s.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", handlers),))
port = s.add_insecure_port("127.0.0.1:0")
s.start()
print(port, flush=True)
s.wait_for_termination()
"#;

/// The grpcio client: over TLS to the proxy (the test CA as root, `localhost` or the third
/// argument as the server name sent and checked). Prints one line per check.
const GRPC_CLIENT: &str = r#"
import grpc, queue, sys, hashlib
port, ca = sys.argv[1], sys.argv[2]
name = sys.argv[3] if len(sys.argv) > 3 else "localhost"
creds = grpc.ssl_channel_credentials(root_certificates=open(ca, "rb").read())
ch = grpc.secure_channel("127.0.0.1:" + port, creds,
                         options=(("grpc.ssl_target_name_override", name),))
echo = ch.unary_unary("/t.T/Echo")
print("unary", echo(b"hi", timeout=20).decode())
big = bytes(i * 7 % 253 for i in range(3 << 20))
r = echo(big, timeout=60)
print("big", len(r), hashlib.sha256(r).hexdigest() == hashlib.sha256(b"echo:" + big).hexdigest())
# Lock step: each message is sent only after the answer to the one before came back, so a
# proxy that waited for the whole request (or held the responses) would never finish.
chat = ch.stream_stream("/t.T/Chat")
q = queue.Queue()
def requests():
    while True:
        m = q.get()
        if m is None:
            return
        yield m
q.put(b"m0")
got = []
for reply in chat(requests(), timeout=30):
    got.append(reply.decode())
    if len(got) == 20:
        q.put(None)
    else:
        q.put(b"m%d" % len(got))
print("chat", ",".join(got))
try:
    ch.unary_unary("/t.T/Fail")(b"x", timeout=20)
    print("fail no error")
except grpc.RpcError as e:
    print("fail", e.code().name, e.details(), dict(e.trailing_metadata() or ()).get("x-why"))
"#;

/// Runs a Python program that prints the port it listens on first; the process (killed when
/// dropped, so that a failed assertion leaves no server behind) and port.
fn python_server(python: &str, program: &str) -> (Killed, u16) {
    let mut child = Command::new(python)
        .args(["-c", program])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("python3");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("port line");
    let port: u16 = line.trim().parse().expect("a port");
    let until = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < until, "nothing listening on {port}");
        std::thread::sleep(Duration::from_millis(50));
    }
    (Killed(child), port)
}

/// A child process killed when dropped.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A Python that imports grpcio (`python3` first, then Debian's own, which python3-grpcio
/// installs into when another `python3` comes first in PATH), or why the test cannot run.
fn grpcio() -> Result<&'static str, String> {
    let mut why = String::from("python3 missing");
    for python in ["python3", "/usr/bin/python3"] {
        match Command::new(python).args(["-c", "import grpc"]).output() {
            Ok(out) if out.status.success() => return Ok(python),
            Ok(out) => {
                why = format!(
                    "python3-grpcio is not importable by {python}: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                )
            }
            Err(e) => why = format!("{python}: {e}"),
        }
    }
    Err(why)
}

/// One request over h2: (HTTP version as curl names it, status, fields lowercased, body).
fn exchange(
    port: u16,
    path: &str,
    extra: &[&str],
) -> (String, u16, Vec<(String, String)>, Vec<u8>) {
    let mut c = curl_h2(port);
    c.args(extra)
        .args(["-D", "/dev/stderr"])
        .args(["-w", "\n%{http_version} %{http_code}"])
        .arg(url(port, path));
    let out = tools::run(c, b"", Duration::from_secs(60));
    assert!(out.status.success(), "curl {path}: {}", out.describe());
    let stdout = out.stdout.clone();
    let at = stdout.iter().rposition(|&b| b == b'\n').expect("-w line");
    let (body, tail) = (
        &stdout[..at],
        String::from_utf8_lossy(&stdout[at + 1..]).to_string(),
    );
    let (version, status) = tail.split_once(' ').expect("version and status");
    let fields = out
        .stderr_text()
        .lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    (
        version.to_string(),
        status.trim().parse().expect("status"),
        fields,
        body.to_vec(),
    )
}

fn h2_proxy(to: &str) -> crate::support::ServerBuilder {
    Server::builder().proxy(&[to.to_string()]).args_h2()
}

trait H2Args {
    fn args_h2(self) -> Self;
}

impl H2Args for crate::support::ServerBuilder {
    /// HTTP mode, h2 offered first.
    fn args_h2(self) -> Self {
        self.arg("--mode")
            .arg("http")
            .arg("--alpn")
            .arg("h2,http/1.1")
    }
}

fn assert_no_panic(server: &Server) {
    let lines = server.stderr_lines();
    assert!(
        !lines.iter().any(|l| l.contains("panicked")),
        "{}",
        lines.join("\n")
    );
}

fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 7 % 253) as u8).collect()
}

#[test]
fn h2_clients_reach_an_http1_backend_one_request_per_stream() {
    if !require("python3") || !require("curl") {
        return;
    }
    let (py, port) = python_server("python3", HTTP_BACKEND);
    let server = h2_proxy(&format!("127.0.0.1:{port}")).start();
    let p = server.port();

    // A large response, byte-exact, over h2.
    let n = (5 << 20) + 17;
    let (version, status, fields, body) = exchange(p, &format!("/big/{n}"), &[]);
    assert_eq!((version.as_str(), status), ("2", 200));
    assert!(
        sha256(&body) == sha256(&pattern(n)),
        "other bytes ({} of {n})",
        body.len()
    );
    assert_eq!(tools::header(&fields, "x-backend"), Some("py"));
    assert_eq!(
        tools::header(&fields, "content-length"),
        Some(n.to_string().as_str())
    );
    // HTTP/1.1's connection fields never reach an h2 client (RFC 9113 §8.2.2).
    assert_eq!(tools::header(&fields, "connection"), None, "{fields:?}");
    assert_eq!(tools::header(&fields, "keep-alive"), None, "{fields:?}");

    // A chunked response: its content, without the chunk framing nor the fields h2 forbids;
    // its trailer as h2 trailers (curl writes them with the fields).
    let n = 200_000;
    let (version, status, fields, body) = exchange(p, &format!("/chunked/{n}"), &[]);
    assert_eq!((version.as_str(), status), ("2", 200));
    assert!(body == pattern(n), "chunked: {} bytes of {n}", body.len());
    for name in ["transfer-encoding", "connection", "x-hop"] {
        assert_eq!(tools::header(&fields, name), None, "{name}: {fields:?}");
    }
    assert_eq!(tools::header(&fields, "x-trailer"), Some("t"), "{fields:?}");

    // A POST body, streamed to the backend and back.
    let data = pattern(300_000);
    let file = std::env::temp_dir().join(format!("tlsplane-proxy-h2-{}", std::process::id()));
    std::fs::write(&file, &data).expect("write");
    let at_file = format!("@{}", file.display());
    let (version, status, _, body) = exchange(p, "/echo", &["--data-binary", &at_file]);
    let _ = std::fs::remove_file(&file);
    assert_eq!((version.as_str(), status), ("2", 200));
    assert!(
        body == data,
        "echo: {} bytes back of {}",
        body.len(),
        data.len()
    );

    // What the backend saw: the HTTP/1.1 path's forwarding rules.
    let (_, status, _, body) = exchange(
        p,
        "/head",
        &[
            "-H",
            "X-Forwarded-For: 6.6.6.6",
            "-H",
            "X-Test: yes",
            "-H",
            "X-Real-IP: 6.6.6.6",
            "-H",
            "Cookie: a=1",
        ],
    );
    assert_eq!(status, 200);
    let head = String::from_utf8_lossy(&body).to_string();
    assert!(head.starts_with("GET /head HTTP/1.1\r\n"), "{head}");
    assert!(head.contains(&format!("host: localhost:{p}\r\n")), "{head}");
    assert!(head.contains("X-Forwarded-For: 127.0.0.1\r\n"), "{head}");
    assert!(head.contains("X-Forwarded-Proto: https\r\n"), "{head}");
    assert!(head.contains("x-test: yes\r\n"), "{head}");
    assert!(head.contains("cookie: a=1\r\n"), "{head}");
    assert!(
        !head.contains("6.6.6.6"),
        "the client's own forwarding fields went: {head}"
    );

    // Many streams on one connection at once: 20 requests of 300 ms each, in parallel.
    let mut c = curl_h2(p);
    c.args([
        "-Z",
        "--parallel-max",
        "50",
        "-w",
        "%{http_version} %{http_code}\n",
    ]);
    for _ in 0..20 {
        c.arg(url(p, "/slow")).args(["-o", "/dev/null"]);
    }
    let started = Instant::now();
    let out = tools::run(c, b"", Duration::from_secs(60));
    let took = started.elapsed();
    assert!(out.status.success(), "curl -Z: {}", out.describe());
    assert_eq!(
        out.stdout_text(),
        "2 200\n".repeat(20),
        "{}",
        out.describe()
    );
    assert!(
        took < Duration::from_secs(4),
        "20 × 300 ms took {took:?}: not concurrent"
    );

    drop(py);
    assert_no_panic(&server);
    let stats = server.stop();
    assert_eq!(stats["proxy_http_requests"], 24, "{stats:?}");
    assert_eq!(stats["proxy_http_502"], 0, "{stats:?}");
    // curl waits to multiplex: one connection for the 20 parallel transfers.
    assert_eq!(stats["proxy_h2_connections"], 5, "{stats:?}");
}

#[test]
fn a_backend_that_is_down_gives_502_on_that_stream() {
    if !require("curl") {
        return;
    }
    let port = TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    let server = h2_proxy(&format!("127.0.0.1:{port}")).start();
    let p = server.port();
    let (version, status, _, body) = exchange(p, "/x", &[]);
    assert_eq!(
        (version.as_str(), status),
        ("2", 502),
        "{}",
        String::from_utf8_lossy(&body)
    );
    // The same connection serves further streams (a 502 ends no connection).
    let mut c = curl_h2(p);
    c.args([
        "-w",
        "%{http_version} %{http_code} %{num_connects}\n",
        "-o",
        "/dev/null",
    ])
    .arg(url(p, "/a"))
    .args(["-o", "/dev/null"])
    .arg(url(p, "/b"));
    let out = tools::run(c, b"", Duration::from_secs(60));
    assert_eq!(
        out.stdout_text(),
        "2 502 1\n2 502 0\n",
        "{}",
        out.describe()
    );
    assert_no_panic(&server);
    let stats = server.stop();
    assert_eq!(stats["proxy_http_502"], 3, "{stats:?}");
    assert_eq!(stats["proxy_no_backend"], 3, "{stats:?}");
}

#[test]
fn grpc_unary_streaming_and_status_end_to_end_over_h2c() {
    let python = match grpcio() {
        Ok(p) => p,
        Err(why) => {
            eprintln!("skipped: {why}");
            return;
        }
    };
    let (backend, port) = python_server(python, GRPC_BACKEND);
    let server = Server::builder()
        .proxy(&[format!("127.0.0.1:{port}")])
        .arg("--mode")
        .arg("http")
        .arg("--backend-protocol")
        .arg("h2c")
        .start();
    let mut c = Command::new(python);
    c.args(["-c", GRPC_CLIENT])
        .arg(server.port().to_string())
        .arg(&fixtures::pki().ca_pem);
    let out = tools::run(c, b"", Duration::from_secs(120));
    drop(backend);
    assert!(out.status.success(), "grpc client: {}", out.describe());
    let want_chat: Vec<String> = (0..20).map(|i| format!("got:m{i}")).collect();
    assert_eq!(
        out.stdout_text(),
        format!(
            "unary echo:hi\nbig {} True\nchat {}\nfail PERMISSION_DENIED nope because\n",
            (3 << 20) + 5,
            want_chat.join(",")
        ),
        "{}",
        out.describe()
    );
    assert_no_panic(&server);
    let stats = server.stop();
    assert_eq!(stats["proxy_http_requests"], 4, "{stats:?}");
    assert_eq!(stats["proxy_http_502"], 0, "{stats:?}");
    // The four calls shared one h2c connection to the backend.
    assert_eq!(stats["proxy_h2c_connections"], 1, "{stats:?}");
}

/// h2spec's 146 cases against the HTTP proxy in front of an HTTP/1.1 backend: the same
/// settings and connection loop as serve, and the proxy's own stream handling (requests with
/// bodies, content-length checks, trailers).
#[test]
fn h2spec_every_case_passes_against_the_proxy() {
    let Some(h2spec) = crate::h2spec::h2spec() else {
        return;
    };
    if !require("python3") {
        return;
    }
    let (_py, port) = python_server("python3", HTTP_BACKEND);
    let server = h2_proxy(&format!("127.0.0.1:{port}")).start();
    crate::h2spec::every_case_passes(&h2spec, server.port(), "proxy");
    assert_no_panic(&server);
    server.stop();
}

/// curl to `https://NAME:port/path` (trusting the test CA, NAME resolved to 127.0.0.1), h2
/// offered; (HTTP version as curl names it, status, body).
fn curl_site(port: u16, name: &str, path: &str) -> (String, u16, String) {
    let mut c = Command::new("curl");
    c.args(["-sS", "--http2", "--max-time", "30", "--cacert"])
        .arg(&fixtures::pki().ca_pem)
        .args(["--resolve", &format!("{name}:{port}:127.0.0.1")])
        .args(["-w", "\n%{http_version} %{http_code}"])
        .arg(format!("https://{name}:{port}{path}"));
    let out = tools::run(c, b"", Duration::from_secs(40));
    assert!(
        out.status.success(),
        "curl {name}{path}: {}",
        out.describe()
    );
    let text = out.stdout_text();
    let (body, tail) = text.rsplit_once('\n').expect("-w line");
    let (version, status) = tail.split_once(' ').expect("version and status");
    (
        version.to_string(),
        status.trim().parse().expect("status"),
        body.to_string(),
    )
}

/// Two sites by server name in one HTTP-mode proxy, each speaking its own protocol to its
/// backends (a site's `backend-protocol`): grpc.test to a grpcio server over h2c, web.test to
/// a Python HTTP/1.1 server; each site's ALPN follows its backends (h2 first for the h2c site,
/// HTTP/1.1 only for the other: neither has an `alpn` key). A reload that changes the key applies
/// to new connections: web.test first names h2c (its HTTP/1.1 backend refuses the h2c
/// preface: 502 over h2), then http1 (200 over HTTP/1.1).
#[test]
fn each_site_speaks_its_own_backend_protocol_and_a_reload_changes_it() {
    let python = match grpcio() {
        Ok(p) => p,
        Err(why) => {
            eprintln!("skipped: {why}");
            return;
        }
    };
    if !require("curl") {
        return;
    }
    use crate::support::fixtures::{pki, CertKind};
    let (_grpc, grpc_port) = python_server(python, GRPC_BACKEND);
    let (_web, web_port) = python_server("python3", HTTP_BACKEND);
    let dir = crate::sites::scratch("proxy-backend-protocols");
    let g = pki().issue_in(&dir, "grpc", &["grpc.test"], CertKind::P256);
    let w = pki().issue_in(&dir, "web", &["web.test"], CertKind::P256);
    let config = dir.join("proxy.toml");
    let write = |web_extra: &str| {
        let toml = format!(
            "[[site]]\nserver-names = [\"grpc.test\"]\nto = [\"127.0.0.1:{grpc_port}\"]\n\
             backend-protocol = \"h2c\"\n\
             [[site.cert]]\nchain = {:?}\nkey = {:?}\n\n\
             [[site]]\nserver-names = [\"web.test\"]\nto = [\"127.0.0.1:{web_port}\"]\n{web_extra}\n\
             [[site.cert]]\nchain = {:?}\nkey = {:?}\n",
            g.cert_pem, g.key_pem, w.cert_pem, w.key_pem,
        );
        std::fs::write(&config, toml).expect("config");
    };
    write("");
    let pid_file = dir.join("proxy.pid");
    let server = Server::builder()
        .proxy(&[])
        .config_file(&config)
        .arg("--mode")
        .arg("http")
        .arg("--pid-file")
        .arg(pid_file.to_str().expect("path"))
        .start();
    let p = server.port();
    let grpc_calls = |expect: &str| {
        let mut c = Command::new(python);
        c.args(["-c", GRPC_CLIENT])
            .arg(p.to_string())
            .arg(&pki().ca_pem)
            .arg("grpc.test");
        let out = tools::run(c, b"", Duration::from_secs(120));
        assert!(out.status.success(), "grpc client: {}", out.describe());
        let first = out
            .stdout_text()
            .lines()
            .next()
            .unwrap_or_default()
            .to_string();
        assert_eq!(first, expect, "{}", out.describe());
        assert!(
            out.stdout_text()
                .ends_with("fail PERMISSION_DENIED nope because\n"),
            "{}",
            out.describe()
        );
    };
    grpc_calls("unary echo:hi");
    let (version, status, body) = curl_site(p, "web.test", "/head");
    assert_eq!((version.as_str(), status), ("1.1", 200), "{body}");
    assert!(body.starts_with("GET /head HTTP/1.1\r\n"), "{body}");

    // web.test names h2c: its HTTP/1.1 backend cannot take it (502), and h2 is offered.
    write("backend-protocol = \"h2c\"");
    let mut reload = Command::new(crate::support::server_bin());
    reload.args(["reload", "--pid-file"]).arg(&pid_file);
    let out = tools::run(reload, b"", Duration::from_secs(40));
    assert!(out.status.success(), "reload: {}", out.describe());
    let (version, status, _) = curl_site(p, "web.test", "/head");
    assert_eq!((version.as_str(), status), ("2", 502));
    grpc_calls("unary echo:hi");

    // And back to HTTP/1.1, stated this time.
    write("backend-protocol = \"http1\"");
    let mut reload = Command::new(crate::support::server_bin());
    reload.args(["reload", "--pid-file"]).arg(&pid_file);
    let out = tools::run(reload, b"", Duration::from_secs(40));
    assert!(out.status.success(), "reload: {}", out.describe());
    let (version, status, body) = curl_site(p, "web.test", "/slow");
    assert_eq!(
        (version.as_str(), status, body.as_str()),
        ("1.1", 200, "slow")
    );

    assert_no_panic(&server);
    let stats = server.stop();
    // Two gRPC runs of four calls, three requests to web.test.
    assert_eq!(stats["proxy_http_requests"], 11, "{stats:?}");
    assert_eq!(stats["proxy_http_502"], 1, "{stats:?}");
}

/// An h2c backend in Rust (h2's server side, prior knowledge), for HTTP/1.1 clients through
/// the proxy: `GET|HEAD /big/N`: N bytes of [`pattern`] with `Content-Length`;
/// `POST /echo`: the body back with `Content-Length`, and `x-got-length` (the request's
/// `content-length` or `none`), `x-got-te` and `x-got-trailers` (the request's trailers,
/// `name: value` joined by `, `, or `none`); `POST /echo-unsized`: the same without a
/// length; `GET /hints`: 103 Early Hints (`link`), 102, then 200 `hinted`; `GET
/// /many-hints`: ten 103s (`x-n: 0` ...), then 200; `POST /hints-first`: a 103 before it
/// reads the body, then the body back; `GET /fields`: the request's pseudo-fields and fields, a line each; `GET
/// /trailers`: `abc` in two DATA frames, then trailers `x-sum: t` and `grpc-status: 0`;
/// `GET /reset/N`: the head of N bytes, N/2 of them, then RST_STREAM(INTERNAL_ERROR);
/// `GET /refuse`: RST_STREAM(REFUSED_STREAM) before any head; `POST /early`: 413 before
/// reading the body; `GET /stall`: no answer for a
/// minute; `GET /stall-body/N`: the head of N bytes, N/2 of them, then nothing for a minute.
/// A request body the proxy broke off (a reset instead of its end) is counted in `resets`.
/// Stopped when dropped.
struct H2cBackend {
    port: u16,
    resets: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for H2cBackend {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn h2c_backend() -> H2cBackend {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.set_nonblocking(true).expect("nonblocking");
    let port = listener.local_addr().expect("addr").port();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let resets = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = resets.clone();
    let thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
            let accepting = async {
                loop {
                    let Ok((sock, _)) = listener.accept().await else {
                        continue;
                    };
                    let counted = counted.clone();
                    tokio::spawn(async move {
                        let Ok(mut conn) = h2::server::handshake(sock).await else {
                            return;
                        };
                        while let Some(Ok((req, respond))) = conn.accept().await {
                            tokio::spawn(h2c_answer(req, respond, counted.clone()));
                        }
                    });
                }
            };
            tokio::select! {
                _ = accepting => {}
                _ = stopped => {}
            }
        });
    });
    H2cBackend {
        port,
        resets,
        stop: Some(stop),
        thread: Some(thread),
    }
}

/// Sends `data` within the stream's window; ends the stream unless trailers follow.
async fn h2c_send(
    stream: &mut h2::SendStream<bytes::Bytes>,
    mut data: bytes::Bytes,
    end: bool,
) -> Result<(), h2::Error> {
    while !data.is_empty() {
        stream.reserve_capacity(data.len());
        let granted = match std::future::poll_fn(|cx| stream.poll_capacity(cx)).await {
            Some(r) => r?,
            None => return Ok(()),
        };
        let piece = data.split_to(granted.min(data.len()));
        stream.send_data(piece, false)?;
    }
    if end {
        stream.send_data(bytes::Bytes::new(), true)?;
    }
    Ok(())
}

async fn h2c_answer(
    req: http::Request<h2::RecvStream>,
    mut respond: h2::server::SendResponse<bytes::Bytes>,
    resets: std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    let (parts, mut body) = req.into_parts();
    let path = parts.uri.path().to_string();
    if path == "/early" {
        // Before the body: the request is refused whole.
        let r = http::Response::builder()
            .status(413)
            .header("content-length", "0")
            .body(())
            .expect("response");
        let _ = respond.send_response(r, true);
        return;
    }
    let hint = |status: u16, field: (&str, String)| {
        http::Response::builder()
            .status(status)
            .header(field.0, field.1)
            .body(())
            .expect("interim")
    };
    if path == "/hints-first" {
        let _ = respond.send_informational(hint(103, ("link", "</first>".into())));
    }
    let mut received = Vec::new();
    let mut broken = false;
    while let Some(d) = body.data().await {
        let Ok(d) = d else {
            broken = true;
            break;
        };
        let _ = body.flow_control().release_capacity(d.len());
        received.extend_from_slice(&d);
    }
    let trailers = match body.trailers().await {
        _ if broken => None,
        Ok(t) => t,
        Err(_) => {
            broken = true;
            None
        }
    };
    if broken {
        resets.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        return;
    }
    let trailers = trailers.map_or("none".to_string(), |t| {
        t.iter()
            .map(|(k, v)| format!("{k}: {}", v.to_str().unwrap_or("?")))
            .collect::<Vec<_>>()
            .join(", ")
    });
    let reply = |length: Option<usize>| {
        let mut b = http::Response::builder()
            .status(200)
            .header("x-backend", "h2c");
        if let Some(n) = length {
            b = b.header("content-length", n);
        }
        b.body(()).expect("response")
    };
    let _ = async {
        if let Some(n) = path.strip_prefix("/big/") {
            let n: usize = n.parse().unwrap_or(0);
            let head_only = parts.method == http::Method::HEAD;
            let mut s = respond.send_response(reply(Some(n)), head_only)?;
            if !head_only {
                h2c_send(&mut s, pattern(n).into(), true).await?;
            }
        } else if path == "/hints" || path == "/many-hints" {
            if path == "/hints" {
                respond.send_informational(hint(103, ("link", "</s.css>; rel=preload".into())))?;
                respond.send_informational(hint(102, ("x-n", "p".into())))?;
            } else {
                for n in 0..10 {
                    respond.send_informational(hint(103, ("x-n", n.to_string())))?;
                }
            }
            let mut s = respond.send_response(reply(Some(6)), false)?;
            h2c_send(&mut s, "hinted".into(), true).await?;
        } else if path == "/echo" || path == "/echo-unsized" || path == "/hints-first" {
            let field = |name| {
                parts
                    .headers
                    .get(name)
                    .map_or("none".to_string(), |v: &http::HeaderValue| {
                        v.to_str().unwrap_or("?").to_string()
                    })
            };
            let mut head = reply((path != "/echo-unsized").then_some(received.len()));
            head.headers_mut().insert(
                "x-got-length",
                field("content-length").parse().expect("value"),
            );
            head.headers_mut()
                .insert("x-got-te", field("te").parse().expect("value"));
            head.headers_mut()
                .insert("x-got-trailers", trailers.parse().expect("value"));
            let mut s = respond.send_response(head, false)?;
            h2c_send(&mut s, received.into(), true).await?;
        } else if path == "/fields" {
            let mut text = format!(
                ":method {}\n:scheme {}\n:authority {}\n:path {}\n",
                parts.method,
                parts.uri.scheme_str().unwrap_or("-"),
                parts.uri.authority().map_or("-", |a| a.as_str()),
                parts.uri.path_and_query().map_or("-", |p| p.as_str()),
            );
            for (k, v) in &parts.headers {
                text.push_str(&format!("{k}: {}\n", v.to_str().unwrap_or("?")));
            }
            let mut s = respond.send_response(reply(Some(text.len())), false)?;
            h2c_send(&mut s, text.into(), true).await?;
        } else if path == "/trailers" {
            let mut s = respond.send_response(reply(None), false)?;
            h2c_send(&mut s, "ab".into(), false).await?;
            h2c_send(&mut s, "c".into(), false).await?;
            let mut t = http::HeaderMap::new();
            t.insert("x-sum", "t".parse().expect("value"));
            t.insert("grpc-status", "0".parse().expect("value"));
            s.send_trailers(t)?;
        } else if let Some(n) = path.strip_prefix("/reset/") {
            let n: usize = n.parse().unwrap_or(0);
            let mut s = respond.send_response(reply(Some(n)), false)?;
            h2c_send(&mut s, pattern(n / 2).into(), false).await?;
            tokio::time::sleep(Duration::from_millis(100)).await;
            s.send_reset(h2::Reason::INTERNAL_ERROR);
        } else if path == "/refuse" {
            respond.send_reset(h2::Reason::REFUSED_STREAM);
        } else if path == "/stall" {
            tokio::time::sleep(Duration::from_secs(60)).await;
        } else if let Some(n) = path.strip_prefix("/stall-body/") {
            let n: usize = n.parse().unwrap_or(0);
            let mut s = respond.send_response(reply(Some(n)), false)?;
            h2c_send(&mut s, pattern(n / 2).into(), false).await?;
            tokio::time::sleep(Duration::from_secs(60)).await;
        } else {
            let mut r = reply(Some(0));
            *r.status_mut() = http::StatusCode::NOT_FOUND;
            respond.send_response(r, true)?;
        }
        Ok::<_, h2::Error>(())
    }
    .await;
}

/// A proxy in HTTP mode in front of `backend` over h2c, with the default ALPN.
fn h2c_proxy(backend: &H2cBackend) -> Server {
    h2c_proxy_builder(backend).start()
}

fn h2c_proxy_builder(backend: &H2cBackend) -> crate::support::ServerBuilder {
    Server::builder()
        .proxy(&[format!("127.0.0.1:{}", backend.port)])
        .arg("--mode")
        .arg("http")
        .arg("--backend-protocol")
        .arg("h2c")
}

/// Sends `bytes` in pieces rustls takes (its buffer is bounded).
fn send(c: &mut TlsClient, bytes: &[u8]) {
    for piece in bytes.chunks(16384) {
        c.write_all(piece).expect("send");
    }
}

/// Reads a chunked body from `c` (after its head): the content and the trailer lines.
fn read_chunked(c: &mut TlsClient) -> (Vec<u8>, Vec<String>) {
    let mut body = Vec::new();
    loop {
        let line = read_line(c);
        let size = line.split(';').next().unwrap_or_default();
        let n = u64::from_str_radix(size.trim(), 16)
            .unwrap_or_else(|_| panic!("chunk size line {line:?}"));
        if n == 0 {
            break;
        }
        c.read_body_with(n, |b| body.extend_from_slice(b))
            .expect("chunk");
        assert_eq!(read_line(c), "", "CRLF after a chunk");
    }
    let mut trailers = Vec::new();
    loop {
        let line = read_line(c);
        if line.is_empty() {
            return (body, trailers);
        }
        trailers.push(line);
    }
}

/// One CRLF-ended line of the response stream.
fn read_line(c: &mut TlsClient) -> String {
    let mut line = Vec::new();
    while !line.ends_with(b"\r\n") {
        c.read_body_with(1, |b| line.extend_from_slice(b))
            .expect("a line");
    }
    line.truncate(line.len() - 2);
    String::from_utf8(line).expect("text")
}

fn header<'a>(fields: &'a [(String, String)], name: &str) -> Option<&'a str> {
    tools::header(fields, name)
}

/// HTTP/1.1 clients on a site with h2c backends: each request goes as a stream of the h2c
/// connection (was 505). All on one client connection (keep-alive) and one h2c connection.
#[test]
fn http1_clients_reach_an_h2c_backend_one_stream_per_request() {
    let backend = h2c_backend();
    let server = h2c_proxy(&backend);
    let p = server.port();
    let mut c = TlsClient::connect_version(p, Tls::V13);

    // A body of known size, byte-exact, with its length.
    let n = (1 << 20) + 3;
    c.write_all(&get_request(&format!("/big/{n}"), ""))
        .expect("send");
    let r = c.read_response(false).expect("big");
    assert_eq!(r.status, 200, "{:?}", r.headers);
    assert_eq!(r.content_length(), Some(n as u64));
    assert_eq!(r.header("x-backend"), Some("h2c"));
    assert!(sha256(&r.body) == sha256(&pattern(n)), "other bytes");
    assert_eq!(r.header("transfer-encoding"), None);
    assert_eq!(r.header("connection"), None);

    // What the backend got: the HTTP/1.1 path's forwarding rules, as h2 fields.
    c.write_all(
        b"GET /fields?q=1 HTTP/1.1\r\nHost: localhost\r\nConnection: keep-alive, X-Hop\r\n\
          X-Hop: 1\r\nKeep-Alive: timeout=5\r\nTE: trailers\r\nX-Forwarded-For: 6.6.6.6\r\n\
          X-Test: yes\r\n\r\n",
    )
    .expect("send");
    let r = c.read_response(false).expect("fields");
    let text = String::from_utf8_lossy(&r.body).to_string();
    for want in [
        ":method GET\n",
        ":authority localhost\n",
        ":path /fields?q=1\n",
        "x-test: yes\n",
        "x-forwarded-for: 127.0.0.1\n",
        "x-forwarded-proto: https\n",
        "te: trailers\n",
    ] {
        assert!(text.contains(want), "{want:?} in {text}");
    }
    for gone in ["6.6.6.6", "x-hop", "keep-alive", "connection", "\nhost:"] {
        assert!(!text.contains(gone), "{gone:?} in {text}");
    }

    // A Content-Length body, echoed byte-exact.
    let data = pattern(300_001);
    let mut req = format!(
        "POST /echo HTTP/1.1\r\nHost: localhost\r\nContent-Length: {}\r\n\r\n",
        data.len()
    )
    .into_bytes();
    req.extend_from_slice(&data);
    send(&mut c, &req);
    let r = c.read_response(false).expect("echo");
    assert_eq!(r.status, 200);
    assert!(
        r.body == data,
        "echo: {} bytes of {}",
        r.body.len(),
        data.len()
    );
    assert_eq!(r.header("x-got-length"), Some("300001"));
    assert_eq!(r.header("x-got-te"), Some("none"));
    assert_eq!(r.header("x-got-trailers"), Some("none"));

    // A chunked body (pieces of growing size, extensions, trailers that go as an h2
    // trailers HEADERS frame).
    let data = pattern(200_000);
    let mut req =
        b"POST /echo HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
    let (mut at, mut k) = (0, 1);
    while at < data.len() {
        let piece = &data[at..(at + k).min(data.len())];
        req.extend_from_slice(format!("{:x};ext=1\r\n", piece.len()).as_bytes());
        req.extend_from_slice(piece);
        req.extend_from_slice(b"\r\n");
        at += piece.len();
        k = k * 3 + 1;
    }
    req.extend_from_slice(b"0\r\nX-Req-Trailer: x\r\nGrpc-Foo:  1 \r\n\r\n");
    send(&mut c, &req);
    let r = c.read_response(false).expect("chunked echo");
    assert_eq!(r.status, 200);
    assert!(
        r.body == data,
        "chunked echo: {} bytes of {}",
        r.body.len(),
        data.len()
    );
    assert_eq!(r.header("x-got-length"), Some("none"));
    assert_eq!(
        r.header("x-got-trailers"),
        Some("x-req-trailer: x, grpc-foo: 1")
    );

    // Expect: 100-continue: the proxy's 100, then the body.
    c.write_all(
        b"POST /echo HTTP/1.1\r\nHost: localhost\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n",
    )
    .expect("send");
    let (status, _) = c.read_head().expect("100");
    assert_eq!(status, 100);
    c.write_all(b"hello").expect("send");
    let r = c.read_response(false).expect("after 100");
    assert_eq!((r.status, r.body.as_slice()), (200, &b"hello"[..]));

    // HEAD: the length of the GET, no body (the next response follows at once).
    c.write_all(b"HEAD /big/4321 HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .expect("send");
    let r = c.read_response(true).expect("head");
    assert_eq!((r.status, r.content_length()), (200, Some(4321)));

    // No length from the backend: chunked to the client.
    let mut req =
        b"POST /echo-unsized HTTP/1.1\r\nHost: localhost\r\nContent-Length: 7\r\n\r\n".to_vec();
    req.extend_from_slice(b"unsized");
    c.write_all(&req).expect("send");
    let (status, fields) = c.read_head().expect("unsized");
    assert_eq!(status, 200);
    assert_eq!(header(&fields, "transfer-encoding"), Some("chunked"));
    assert_eq!(header(&fields, "content-length"), None);
    let (body, trailers) = read_chunked(&mut c);
    assert_eq!((body.as_slice(), trailers.len()), (&b"unsized"[..], 0));

    // h2 trailers: chunked trailers for a client that said TE: trailers ...
    c.write_all(&get_request(
        "/trailers",
        "TE: trailers\r\nConnection: TE\r\n",
    ))
    .expect("send");
    let (status, fields) = c.read_head().expect("trailers");
    assert_eq!(status, 200);
    assert_eq!(header(&fields, "transfer-encoding"), Some("chunked"));
    let (body, trailers) = read_chunked(&mut c);
    assert_eq!(body, b"abc");
    assert_eq!(trailers, ["x-sum: t", "grpc-status: 0"]);
    // ... dropped for one that did not.
    c.write_all(&get_request("/trailers", "")).expect("send");
    let (status, _) = c.read_head().expect("trailers");
    assert_eq!(status, 200);
    let (body, trailers) = read_chunked(&mut c);
    assert_eq!((body.as_slice(), trailers.len()), (&b"abc"[..], 0));

    // Still the same connection, still open.
    let r = c.get("/big/10");
    assert_eq!((r.status, r.body), (200, pattern(10)));
    c.close();
    drop(backend);
    assert_no_panic(&server);
    let stats = server.stop();
    assert_eq!(stats["proxy_http_requests"], 10, "{stats:?}");
    assert_eq!(stats["proxy_http_502"], 0, "{stats:?}");
    assert_eq!(stats["proxy_http_refused"], 0, "{stats:?}");
    assert_eq!(stats["proxy_h2c_connections"], 1, "{stats:?}");
}

/// An h2c backend that resets the stream: before the response head, 502; after it began, the
/// client's connection is reset (a truncated body, never a clean short one).
#[test]
fn an_h2c_reset_is_502_before_the_head_and_a_truncation_after() {
    let backend = h2c_backend();
    let server = h2c_proxy(&backend);
    let p = server.port();

    let mut c = TlsClient::connect_version(p, Tls::V13);
    let r = c.get("/refuse");
    assert_eq!(r.status, 502);

    let n = 1 << 20;
    let mut c = TlsClient::connect_version(p, Tls::V13);
    c.write_all(&get_request(&format!("/reset/{n}"), ""))
        .expect("send");
    let (status, fields) = c.read_head().expect("head");
    assert_eq!(status, 200);
    assert_eq!(
        header(&fields, "content-length"),
        Some(n.to_string().as_str())
    );
    let (body, end) = c.read_to_end();
    assert!(
        body.len() < n && !matches!(end, End::CloseNotify),
        "{} bytes of {n}, then {end:?}",
        body.len()
    );
    assert!(body == pattern(n / 2)[..body.len()], "other bytes");

    // The proxy goes on: the same backend serves the next client.
    let mut c = TlsClient::connect_version(p, Tls::V13);
    let r = c.get("/big/100");
    assert_eq!((r.status, r.body), (200, pattern(100)));
    c.close();
    drop(backend);
    assert_no_panic(&server);
    let stats = server.stop();
    assert_eq!(stats["proxy_http_502"], 1, "{stats:?}");
    assert_eq!(stats["proxy_backend_errors"], 2, "{stats:?}");
}

/// The default ALPN of an h2c site offers h2 and HTTP/1.1: curl gets each as it asks.
#[test]
fn an_h2c_site_offers_h2_and_http1_to_curl() {
    if !require("curl") {
        return;
    }
    let backend = h2c_backend();
    let server = h2c_proxy(&backend);
    let p = server.port();
    let n = (2 << 20) + 5;
    for flag in ["--http1.1", "--http2"] {
        let mut c = curl_h2(p);
        c.arg(flag)
            .args(["-w", "\n%{http_version} %{http_code}"])
            .arg(url(p, &format!("/big/{n}")));
        let out = tools::run(c, b"", Duration::from_secs(60));
        assert!(out.status.success(), "curl {flag}: {}", out.describe());
        let at = out
            .stdout
            .iter()
            .rposition(|&b| b == b'\n')
            .expect("-w line");
        let tail = String::from_utf8_lossy(&out.stdout[at + 1..]).to_string();
        let want = if flag == "--http2" {
            "2 200"
        } else {
            "1.1 200"
        };
        assert_eq!(tail, want, "{flag}");
        assert!(out.stdout[..at] == pattern(n), "{flag}: other bytes");
    }
    drop(backend);
    assert_no_panic(&server);
    server.stop();
}

/// --backend-timeout and --request-timeout for HTTP/1.1 clients on an h2c site, as on the
/// HTTP/1.1 path: 504 before the response head, 408 while the client's body is awaited, a
/// reset once the response has begun; the access log names the protocol and the backend.
#[test]
fn http1_to_h2c_timeouts_and_the_access_log() {
    let backend = h2c_backend();
    let dir = crate::sites::scratch("h1-to-h2c-timeouts");
    let log = dir.join("access.log");
    let to = format!("127.0.0.1:{}", backend.port);
    let server = h2c_proxy_builder(&backend)
        .arg("--backend-timeout")
        .arg("1")
        .arg("--access-log-file")
        .arg(log.to_str().expect("path"))
        .arg("--access-log-format")
        .arg("json")
        .start();
    let p = server.port();
    let mut c = TlsClient::connect_version(p, Tls::V13);
    let r = c.get("/big/5");
    assert_eq!((r.status, r.body), (200, pattern(5)));
    let r = c.get("/stall");
    assert_eq!(r.status, 504);
    // Closed by the proxy after its 504 (lingering until this side goes).
    drop(c);
    let truncated = |p: u16, path: &str| {
        let mut c = TlsClient::connect_version(p, Tls::V13);
        c.write_all(&get_request(path, "")).expect("send");
        let (status, _) = c.read_head().expect("head");
        assert_eq!(status, 200);
        let (body, end) = c.read_to_end();
        assert!(
            body.len() < 10000 && !matches!(end, End::CloseNotify),
            "{path}: {} bytes, then {end:?}",
            body.len()
        );
    };
    truncated(p, "/stall-body/10000");
    assert_no_panic(&server);
    let stats = server.stop();
    assert_eq!(stats["proxy_http_504"], 1, "{stats:?}");
    assert_eq!(stats["proxy_backend_errors"], 1, "{stats:?}");
    let text = std::fs::read_to_string(&log).expect("access log");
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect(l))
        .collect();
    assert_eq!(lines.len(), 2, "{text}");
    for (line, status) in lines.iter().zip([200, 504]) {
        assert_eq!(line["status"], status, "{line}");
        assert_eq!(line["protocol"], "HTTP/1.1", "{line}");
        assert_eq!(line["backend"], to.as_str(), "{line}");
    }

    let server = h2c_proxy_builder(&backend)
        .arg("--request-timeout")
        .arg("1")
        .start();
    let p = server.port();
    let mut c = TlsClient::connect_version(p, Tls::V13);
    let r = c.get("/stall");
    assert_eq!(r.status, 504);
    drop(c);
    let mut c = TlsClient::connect_version(p, Tls::V13);
    c.write_all(b"POST /echo HTTP/1.1\r\nHost: localhost\r\nContent-Length: 10\r\n\r\nhalf.")
        .expect("send");
    let r = c.read_response(false).expect("408");
    assert_eq!(r.status, 408);
    drop(c);
    truncated(p, "/stall-body/10000");
    assert_no_panic(&server);
    let stats = server.stop();
    assert_eq!(stats["proxy_request_timeouts"], 3, "{stats:?}");
    drop(backend);
}

/// A backend that answers before it has the request body (413): the answer is relayed, the
/// rest of the body not sent, and the client's connection closed after it (as on the HTTP/1.1
/// path).
#[test]
fn an_h2c_answer_before_the_whole_body_is_relayed_and_the_connection_closes() {
    let backend = h2c_backend();
    let server = h2c_proxy(&backend);
    let p = server.port();
    let mut c = TlsClient::connect_version(p, Tls::V13);
    let mut req =
        b"POST /early HTTP/1.1\r\nHost: localhost\r\nContent-Length: 5000000\r\n\r\n".to_vec();
    req.extend_from_slice(&pattern(100_000));
    send(&mut c, &req);
    let r = c.read_response(false).expect("413");
    assert_eq!(r.status, 413, "{:?}", r.headers);
    assert_eq!(r.header("connection"), Some("close"));
    drop(c);
    // The backend connection serves the next client.
    let mut c = TlsClient::connect_version(p, Tls::V13);
    let r = c.get("/big/7");
    assert_eq!((r.status, r.body), (200, pattern(7)));
    c.close();
    drop(backend);
    assert_no_panic(&server);
    let stats = server.stop();
    assert_eq!(stats["proxy_early_responses"], 1, "{stats:?}");
    assert_eq!(stats["proxy_http_502"], 0, "{stats:?}");
}

/// An HTTP/1.0 client cannot read chunked: a response without a length goes to the
/// connection's close (clean: close_notify), one with a length keeps it.
#[test]
fn http10_clients_on_an_h2c_site_get_a_length_or_the_close() {
    let backend = h2c_backend();
    let server = h2c_proxy(&backend);
    let p = server.port();
    let mut c = TlsClient::connect_version(p, Tls::V13);
    c.write_all(b"GET /big/9 HTTP/1.0\r\nHost: localhost\r\nConnection: keep-alive\r\n\r\n")
        .expect("send");
    let r = c.read_response(false).expect("big");
    assert_eq!((r.status, &r.body), (200, &pattern(9)));
    assert_eq!(r.header("connection"), Some("keep-alive"));
    c.write_all(b"GET /trailers HTTP/1.0\r\nHost: localhost\r\nConnection: keep-alive\r\nTE: trailers\r\n\r\n")
        .expect("send");
    let (status, fields) = c.read_head().expect("head");
    assert_eq!(status, 200);
    assert_eq!(header(&fields, "transfer-encoding"), None);
    assert_eq!(header(&fields, "content-length"), None);
    assert_eq!(header(&fields, "connection"), Some("close"));
    let (body, end) = c.read_to_end();
    assert_eq!(body, b"abc");
    assert!(matches!(end, End::CloseNotify), "{end:?}");
    drop(c);
    drop(backend);
    assert_no_panic(&server);
    server.stop();
}

/// No h2c backend to reach: 502 to an HTTP/1.1 client, and its connection goes on (nothing of a
/// body is left unread).
#[test]
fn an_h2c_site_whose_backend_is_down_answers_http1_clients_502() {
    let port = TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    let server = Server::builder()
        .proxy(&[format!("127.0.0.1:{port}")])
        .arg("--mode")
        .arg("http")
        .arg("--backend-protocol")
        .arg("h2c")
        .start();
    let mut c = TlsClient::connect_version(server.port(), Tls::V13);
    for _ in 0..2 {
        let r = c.get("/x");
        assert_eq!(r.status, 502);
    }
    c.close();
    assert_no_panic(&server);
    let stats = server.stop();
    assert_eq!(stats["proxy_http_502"], 2, "{stats:?}");
    assert_eq!(stats["proxy_no_backend"], 2, "{stats:?}");
}

/// Waits up to 5 s for `backend` to have seen `n` request bodies broken off by a reset.
fn wait_for_resets(backend: &H2cBackend, n: usize) {
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        let seen = backend.resets.load(std::sync::atomic::Ordering::SeqCst);
        if seen >= n {
            assert_eq!(seen, n, "more resets than requests broken off");
            return;
        }
        assert!(Instant::now() < until, "{seen} resets seen of {n}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The trailers of an HTTP/1.1 client's chunked request go to the h2c backend as an h2
/// trailers HEADERS frame. A trailer section with more fields than a request head may have
/// (64), longer than the chunked parser takes (4 KiB), or with a field a trailer may not carry
/// is 400 to the client and a reset of the backend's stream (never a request that looks whole).
#[test]
fn chunked_request_trailers_reach_an_h2c_backend_within_bounds() {
    let backend = h2c_backend();
    let server = h2c_proxy(&backend);
    let p = server.port();
    let head = b"POST /echo HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n";

    let mut c = TlsClient::connect_version(p, Tls::V13);
    let mut req = head.to_vec();
    req.extend_from_slice(b"5\r\nhello\r\n0\r\nX-Sum: abc\r\nX-Sum: def\r\n\r\n");
    c.write_all(&req).expect("send");
    let r = c.read_response(false).expect("echo");
    assert_eq!((r.status, r.body.as_slice()), (200, &b"hello"[..]));
    assert_eq!(r.header("x-got-trailers"), Some("x-sum: abc, x-sum: def"));
    // An empty trailer section: the stream ends with its last DATA frame, as before.
    let mut req = head.to_vec();
    req.extend_from_slice(b"2\r\nhi\r\n0\r\n\r\n");
    c.write_all(&req).expect("send");
    let r = c.read_response(false).expect("echo");
    assert_eq!((r.status, r.body.as_slice()), (200, &b"hi"[..]));
    assert_eq!(r.header("x-got-trailers"), Some("none"));
    c.close();

    let many: String = (0..65).map(|i| format!("X-T{i}: {i}\r\n")).collect();
    let long = format!("X-Long: {}\r\n", "v".repeat(5000));
    let bad = [many, long, "Content-Length: 5\r\n".to_string()];
    for (i, trailers) in bad.iter().enumerate() {
        let mut c = TlsClient::connect_version(p, Tls::V13);
        // The backend has the stream and part of its body before the trailers come.
        let mut req = head.to_vec();
        req.extend_from_slice(b"5\r\nhello\r\n");
        c.write_all(&req).expect("send");
        std::thread::sleep(Duration::from_millis(300));
        send(&mut c, format!("0\r\n{trailers}\r\n").as_bytes());
        let r = c.read_response(false).expect("400");
        assert_eq!(r.status, 400, "{i}: {:?}", r.headers);
        assert_eq!(r.header("connection"), Some("close"), "{i}");
        wait_for_resets(&backend, i + 1);
    }

    // The backend connection serves the next client.
    let mut c = TlsClient::connect_version(p, Tls::V13);
    let mut req = head.to_vec();
    req.extend_from_slice(b"1\r\nx\r\n0\r\nGrpc-Timeout: 1S\r\n\r\n");
    c.write_all(&req).expect("send");
    let r = c.read_response(false).expect("echo");
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-got-trailers"), Some("grpc-timeout: 1S"));
    c.close();
    drop(backend);
    assert_no_panic(&server);
    let stats = server.stop();
    assert_eq!(stats["proxy_http_refused"], 3, "{stats:?}");
    assert_eq!(stats["proxy_http_502"], 0, "{stats:?}");
}

/// `GET /many-hints` (ten 103s from the backend, then 200 `hinted`) gives an HTTP/1.1 client
/// the first four 103s, then the final response.
fn many_hints_relay_four(c: &mut TlsClient) {
    c.write_all(&get_request("/many-hints", "")).expect("send");
    for n in 0..4 {
        let (status, fields) = c.read_head().expect("103");
        assert_eq!(status, 103, "{n}");
        assert_eq!(header(&fields, "x-n"), Some(n.to_string().as_str()));
    }
    let r = c.read_response(false).expect("200");
    assert_eq!((r.status, r.body.as_slice()), (200, &b"hinted"[..]));
}

/// Interim responses of an h2c backend reach HTTP/1.1 clients as HTTP/1.1 heads before the
/// final one (103 Early Hints, 102), also while the client's body is still awaited; at most
/// four per request (the rest dropped, the final response relayed); none to an HTTP/1.0 client.
#[test]
fn interim_responses_reach_http11_clients_but_not_http10_ones() {
    let backend = h2c_backend();
    let server = h2c_proxy(&backend);
    let p = server.port();
    let mut c = TlsClient::connect_version(p, Tls::V13);
    c.write_all(&get_request("/hints", "")).expect("send");
    let (status, fields) = c.read_head().expect("103");
    assert_eq!(status, 103);
    assert_eq!(header(&fields, "link"), Some("</s.css>; rel=preload"));
    let (status, fields) = c.read_head().expect("102");
    assert_eq!((status, header(&fields, "x-n")), (102, Some("p")));
    let r = c.read_response(false).expect("200");
    assert_eq!((r.status, r.body.as_slice()), (200, &b"hinted"[..]));

    many_hints_relay_four(&mut c);

    // Before the body: the client sees the hint, then sends the body, all of it relayed.
    c.write_all(b"POST /hints-first HTTP/1.1\r\nHost: localhost\r\nContent-Length: 5\r\n\r\n")
        .expect("send");
    let (status, fields) = c.read_head().expect("103");
    assert_eq!((status, header(&fields, "link")), (103, Some("</first>")));
    c.write_all(b"hello").expect("send");
    let r = c.read_response(false).expect("200");
    assert_eq!((r.status, r.body.as_slice()), (200, &b"hello"[..]));
    let r = c.get("/big/3");
    assert_eq!((r.status, r.body), (200, pattern(3)));
    c.close();

    // HTTP/1.0: the final response alone.
    let mut c = TlsClient::connect_version(p, Tls::V13);
    c.write_all(b"GET /hints HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .expect("send");
    let r = c.read_response(false).expect("200");
    assert_eq!((r.status, r.body.as_slice()), (200, &b"hinted"[..]));
    drop(c);
    drop(backend);
    assert_no_panic(&server);
    let stats = server.stop();
    assert_eq!(stats["proxy_http_502"], 0, "{stats:?}");
    assert_eq!(stats["proxy_backend_errors"], 0, "{stats:?}");
}

/// An HTTP/1.0 request without Host (which HTTP/1.0 allows) on an h2c site: `:authority` is
/// the server name the client sent in TLS, else the backend's address (nginx's
/// `$proxy_host`). HTTP/1.1 without Host stays 400 (RFC 9112 §3.2).
#[test]
fn an_http10_request_without_host_reaches_an_h2c_backend() {
    let backend = h2c_backend();
    let server = h2c_proxy(&backend);
    let p = server.port();
    let authority = |c: &mut TlsClient| {
        c.write_all(b"GET /fields HTTP/1.0\r\n\r\n").expect("send");
        let r = c.read_response(false).expect("fields");
        assert_eq!(r.status, 200, "{:?}", r.headers);
        let text = String::from_utf8_lossy(&r.body).to_string();
        text.lines()
            .find_map(|l| l.strip_prefix(":authority "))
            .unwrap_or_else(|| panic!("{text}"))
            .to_string()
    };
    let mut c = TlsClient::connect_version(p, Tls::V13);
    assert_eq!(authority(&mut c), "localhost");
    drop(c);
    let mut config = (*crate::support::client::ClientOpts::version(Tls::V13).config()).clone();
    config.enable_sni = false;
    let mut c = TlsClient::connect_with(p, std::sync::Arc::new(config));
    assert_eq!(authority(&mut c), format!("127.0.0.1:{}", backend.port));
    drop(c);
    let mut c = TlsClient::connect_version(p, Tls::V13);
    c.write_all(b"GET /fields HTTP/1.1\r\n\r\n").expect("send");
    let r = c.read_response(false).expect("400");
    assert_eq!(r.status, 400);
    drop(c);
    drop(backend);
    assert_no_panic(&server);
    let stats = server.stop();
    assert_eq!(stats["proxy_http_refused"], 1, "{stats:?}");
    assert_eq!(stats["proxy_http_502"], 0, "{stats:?}");
}

/// h2 clients on an h2c site get the backend's interim responses too (as h2 HEADERS without
/// END_STREAM), at most four a request, then the final response.
#[test]
fn interim_responses_reach_h2_clients() {
    if !require("curl") {
        return;
    }
    let backend = h2c_backend();
    let server = h2c_proxy(&backend);
    let p = server.port();
    for (path, hints) in [("/hints", 2), ("/many-hints", 4)] {
        let mut c = curl_h2(p);
        c.arg("-v").arg(url(p, path));
        let out = tools::run(c, b"", Duration::from_secs(60));
        assert!(out.status.success(), "{path}: {}", out.describe());
        assert_eq!(out.stdout, b"hinted", "{path}");
        let err = out.stderr_text();
        let heads: Vec<&str> = err.lines().filter(|l| l.starts_with("< HTTP/2 ")).collect();
        let mut want = vec!["< HTTP/2 103"; hints];
        if path == "/hints" {
            want[1] = "< HTTP/2 102";
        }
        want.push("< HTTP/2 200");
        assert_eq!(
            heads.iter().map(|l| l.trim()).collect::<Vec<_>>(),
            want,
            "{path}: {err}"
        );
        if path == "/hints" {
            assert!(err.contains("< link: </s.css>; rel=preload"), "{err}");
        }
    }
    drop(backend);
    assert_no_panic(&server);
    let stats = server.stop();
    assert_eq!(stats["proxy_http_502"], 0, "{stats:?}");
}

/// An HTTP/1.1 backend's interim responses reach HTTP/1.1 clients as on the other paths: at
/// most four a request, then the final response; and they do not keep the wait for it going
/// past --backend-timeout (a 102 every 300 ms against 1 s: 504 in about a second).
#[test]
fn interim_responses_of_an_http11_backend_are_bounded_for_http11_clients() {
    let raw = raw_backend();
    let server = h2_proxy(&format!("127.0.0.1:{raw}"))
        .arg("--backend-timeout")
        .arg("1")
        .start();
    let p = server.port();
    let mut c = TlsClient::connect_version(p, Tls::V13);
    many_hints_relay_four(&mut c);
    c.close();

    let mut c = TlsClient::connect_version(p, Tls::V13);
    let started = Instant::now();
    c.write_all(&get_request("/drip-hints", "")).expect("send");
    let mut interim = 0;
    let status = loop {
        let (status, _) = c.read_head().expect("a head");
        if status >= 200 {
            break status;
        }
        assert_eq!(status, 102);
        interim += 1;
    };
    assert_eq!(status, 504, "after {interim} interim responses");
    assert!(interim <= 4, "{interim} interim responses relayed");
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "504 after {:?}",
        started.elapsed()
    );
    drop(c);
    assert_no_panic(&server);
    let stats = server.stop();
    assert_eq!(stats["proxy_http_504"], 1, "{stats:?}");
}

/// An HTTP/1.1 backend written byte by byte (keep-alive, a thread per connection), for what
/// Python's `http.server` cannot send or read as it came: `GET /hints`: 103 Early Hints
/// (`link`), 102, then 200 `hinted`; `GET /many-hints`: ten 103s (`x-n: 0` ...), then 200
/// `hinted`; `GET /drip-hints`: a 102 every 300 ms for 6 s, then 200 `hinted`;
/// `GET /trailers`: `hello` chunked, then the trailers `x-sum: abc` and
/// `grpc-status: 0`; `GET /trailer-forbidden`: the same with `set-cookie: a=b` among them;
/// `GET /trailers-many`: 65 trailer fields; `POST /raw`: the request body's bytes as they came
/// (chunk lines and trailer section too) as the body, with `Content-Length`. Its threads end
/// with the test process.
fn raw_backend() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let _ = raw_backend_connection(conn);
            });
        }
    });
    port
}

fn raw_backend_connection(conn: TcpStream) -> std::io::Result<()> {
    use std::io::{Read, Write};
    let mut out = conn.try_clone()?;
    let mut r = BufReader::new(conn);
    let line = |r: &mut BufReader<TcpStream>| -> std::io::Result<String> {
        let mut l = String::new();
        if r.read_line(&mut l)? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        Ok(l)
    };
    loop {
        let request_line = line(&mut r)?;
        let path = request_line.split(' ').nth(1).unwrap_or("/").to_string();
        let (mut length, mut chunked) = (None, false);
        loop {
            let l = line(&mut r)?.to_ascii_lowercase();
            if l == "\r\n" {
                break;
            }
            if let Some(v) = l.strip_prefix("content-length:") {
                length = v.trim().parse::<usize>().ok();
            }
            chunked |= l.starts_with("transfer-encoding:") && l.contains("chunked");
        }
        let mut raw = Vec::new();
        if chunked {
            loop {
                let size_line = line(&mut r)?;
                raw.extend_from_slice(size_line.as_bytes());
                let hex = size_line.trim().split(';').next().unwrap_or("");
                let n = usize::from_str_radix(hex, 16).expect("chunk size");
                if n == 0 {
                    loop {
                        let t = line(&mut r)?;
                        raw.extend_from_slice(t.as_bytes());
                        if t == "\r\n" {
                            break;
                        }
                    }
                    break;
                }
                let mut data = vec![0; n + 2];
                r.read_exact(&mut data)?;
                raw.extend_from_slice(&data);
            }
        } else if let Some(n) = length {
            raw.resize(n, 0);
            r.read_exact(&mut raw)?;
        }
        let hinted = b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nhinted";
        let chunked_hello =
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: x-sum\r\n\r\n\
                             2\r\nhe\r\n3;x=1\r\nllo\r\n0\r\n";
        let answer: Vec<u8> = match path.as_str() {
            "/hints" => [
                &b"HTTP/1.1 103 Early Hints\r\nLink: </s.css>; rel=preload\r\n\r\n"[..],
                b"HTTP/1.1 102 Processing\r\n\r\n",
                hinted,
            ]
            .concat(),
            "/many-hints" => {
                let mut a: Vec<u8> = (0..10)
                    .flat_map(|n| {
                        format!("HTTP/1.1 103 Early Hints\r\nX-N: {n}\r\n\r\n").into_bytes()
                    })
                    .collect();
                a.extend_from_slice(hinted);
                a
            }
            "/trailers" => {
                format!("{chunked_hello}X-Sum: abc\r\nGrpc-Status: 0\r\n\r\n").into_bytes()
            }
            // The head and content first, so that the trailer section comes after the
            // response has begun.
            "/trailer-forbidden" => {
                out.write_all(chunked_hello.as_bytes())?;
                std::thread::sleep(Duration::from_millis(200));
                b"X-Sum: abc\r\nSet-Cookie: a=b\r\n\r\n".to_vec()
            }
            "/trailers-many" => {
                out.write_all(chunked_hello.as_bytes())?;
                std::thread::sleep(Duration::from_millis(200));
                let many: String = (0..65).map(|i| format!("x-{i}: 1\r\n")).collect();
                format!("{many}\r\n").into_bytes()
            }
            // A 102 every 300 ms for 6 s, then the answer: interim responses as a
            // keep-alive, longer than the proxy's --backend-timeout.
            "/drip-hints" => {
                for _ in 0..20 {
                    out.write_all(b"HTTP/1.1 102 Processing\r\n\r\n")?;
                    std::thread::sleep(Duration::from_millis(300));
                }
                hinted.to_vec()
            }
            // The body taken, and no answer.
            "/silent" => {
                std::thread::sleep(Duration::from_secs(20));
                return Ok(());
            }
            "/raw" => {
                let mut a = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", raw.len())
                    .into_bytes();
                a.extend_from_slice(&raw);
                a
            }
            _ => b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n".to_vec(),
        };
        out.write_all(&answer)?;
    }
}

/// What an h2 client got for one request.
#[derive(Debug, Default)]
struct H2Reply {
    /// The interim responses, in order.
    interim: Vec<(u16, http::HeaderMap)>,
    status: u16,
    fields: http::HeaderMap,
    body: Vec<u8>,
    trailers: Option<http::HeaderMap>,
    /// Why the stream did not end cleanly (a reset: its reason), if it did not.
    error: Option<String>,
}

/// Sends one request over h2 (Rust's `h2` as the client, over TLS to the proxy): `body` (none
/// when empty), then `trailers` when given; every stream on one connection.
fn h2_requests(
    port: u16,
    requests: Vec<(http::Request<()>, Vec<u8>, Option<http::HeaderMap>)>,
) -> Vec<H2Reply> {
    h2_requests_paced(port, requests, None)
}

/// [`h2_requests`], with each body sent in five pieces `gap` apart when `gap` is given.
fn h2_requests_paced(
    port: u16,
    requests: Vec<(http::Request<()>, Vec<u8>, Option<http::HeaderMap>)>,
    gap: Option<Duration>,
) -> Vec<H2Reply> {
    use crate::support::client::ClientOpts;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let exchanges = async {
        let mut config = (*ClientOpts::version(Tls::V13).config()).clone();
        config.alpn_protocols = vec![b"h2".to_vec()];
        let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .expect("connect");
        let name = rustls_pki_types::ServerName::try_from("localhost").expect("name");
        let tls = connector.connect(name, tcp).await.expect("handshake");
        let (mut client, conn) = h2::client::handshake(tls).await.expect("h2 handshake");
        let driver = tokio::spawn(conn);
        let mut replies = Vec::new();
        for (req, body, trailers) in requests {
            let mut reply = H2Reply::default();
            client = client.ready().await.expect("ready");
            let ends = body.is_empty() && trailers.is_none();
            let (mut response, mut stream) = client.send_request(req, ends).expect("request");
            if let (Some(gap), false) = (gap, body.is_empty()) {
                // The stream may be answered (and closed) before the body is all sent: the
                // reply says how.
                let piece = body.len().div_ceil(5);
                let mut open = true;
                for (i, part) in body.chunks(piece).enumerate() {
                    if i > 0 {
                        tokio::time::sleep(gap).await;
                    }
                    open = open
                        && h2c_send(&mut stream, part.to_vec().into(), false)
                            .await
                            .is_ok();
                }
                if open && trailers.is_none() {
                    let _ = stream.send_data(bytes::Bytes::new(), true);
                }
            } else if !body.is_empty() {
                h2c_send(&mut stream, body.into(), trailers.is_none())
                    .await
                    .expect("body");
            }
            if let Some(t) = trailers {
                stream.send_trailers(t).expect("trailers");
            }
            loop {
                match std::future::poll_fn(|cx| response.poll_informational(cx)).await {
                    Some(Ok(head)) => {
                        let (parts, ()) = head.into_parts();
                        reply.interim.push((parts.status.as_u16(), parts.headers));
                    }
                    Some(Err(e)) => {
                        reply.error = Some(e.to_string());
                        break;
                    }
                    None => break,
                }
            }
            let resp = match response.await {
                Ok(r) => r,
                Err(e) => {
                    reply.error = Some(e.to_string());
                    replies.push(reply);
                    continue;
                }
            };
            let (parts, mut from) = resp.into_parts();
            reply.status = parts.status.as_u16();
            reply.fields = parts.headers;
            while let Some(data) = from.data().await {
                match data {
                    Ok(d) => {
                        let _ = from.flow_control().release_capacity(d.len());
                        reply.body.extend_from_slice(&d);
                    }
                    Err(e) => {
                        reply.error = Some(format!("{:?}", e.reason()));
                        break;
                    }
                }
            }
            if reply.error.is_none() {
                match from.trailers().await {
                    Ok(t) => reply.trailers = t,
                    Err(e) => reply.error = Some(format!("{:?}", e.reason())),
                }
            }
            replies.push(reply);
        }
        drop(client);
        driver.abort();
        replies
    };
    rt.block_on(async { tokio::time::timeout(Duration::from_secs(60), exchanges).await })
        .expect("h2 exchanges within a minute")
}

fn get(port: u16, path: &str) -> (http::Request<()>, Vec<u8>, Option<http::HeaderMap>) {
    let req = http::Request::get(format!("https://localhost:{port}{path}"))
        .body(())
        .expect("request");
    (req, Vec::new(), None)
}

fn fields_of(pairs: &[(&str, &str)]) -> http::HeaderMap {
    let mut m = http::HeaderMap::new();
    for (k, v) in pairs {
        m.append(
            http::header::HeaderName::from_bytes(k.as_bytes()).expect("name"),
            http::HeaderValue::from_str(v).expect("value"),
        );
    }
    m
}

/// An HTTP/1.1 backend's interim responses reach h2 clients as HEADERS without END_STREAM
/// before the final response, by the h2c path's rules: at most four a request.
#[test]
fn an_http1_backends_interim_responses_reach_h2_clients() {
    let backend = raw_backend();
    let server = h2_proxy(&format!("127.0.0.1:{backend}")).start();
    let p = server.port();
    let replies = h2_requests(p, vec![get(p, "/hints"), get(p, "/many-hints")]);
    let [hints, many] = &replies[..] else {
        panic!("{replies:?}")
    };
    let statuses = |r: &H2Reply| r.interim.iter().map(|(s, _)| *s).collect::<Vec<_>>();
    assert_eq!(statuses(hints), [103, 102], "{hints:?}");
    assert_eq!(
        hints.interim[0].1["link"], "</s.css>; rel=preload",
        "{hints:?}"
    );
    assert_eq!(
        (hints.status, &hints.body[..]),
        (200, &b"hinted"[..]),
        "{hints:?}"
    );
    assert_eq!(statuses(many), [103; 4], "{many:?}");
    let ns: Vec<_> = many.interim.iter().map(|(_, f)| f["x-n"].clone()).collect();
    assert_eq!(ns, ["0", "1", "2", "3"], "{many:?}");
    assert_eq!(
        (many.status, &many.body[..]),
        (200, &b"hinted"[..]),
        "{many:?}"
    );
    assert_no_panic(&server);
    let stats = server.stop();
    assert_eq!(stats["proxy_http_502"], 0, "{stats:?}");
}

/// An HTTP/1.1 backend's chunked response trailers reach h2 clients as a trailers HEADERS
/// frame (the client sent no `TE: trailers`: h2 clients take them all); a section with a field
/// a trailer may not carry, or with more fields than a head may have, resets the stream after
/// the content rather than ending it as if whole.
#[test]
fn an_http1_backends_response_trailers_reach_h2_clients() {
    let backend = raw_backend();
    let server = h2_proxy(&format!("127.0.0.1:{backend}")).start();
    let p = server.port();
    let replies = h2_requests(
        p,
        vec![
            get(p, "/trailers"),
            get(p, "/trailer-forbidden"),
            get(p, "/trailers-many"),
            get(p, "/trailers"),
        ],
    );
    let [whole, forbidden, many, again] = &replies[..] else {
        panic!("{replies:?}")
    };
    for r in [whole, again] {
        assert_eq!(
            (r.status, &r.body[..], &r.error),
            (200, &b"hello"[..], &None),
            "{r:?}"
        );
        assert_eq!(r.fields["trailer"], "x-sum", "{r:?}");
        assert_eq!(
            r.trailers,
            Some(fields_of(&[("x-sum", "abc"), ("grpc-status", "0")])),
            "{r:?}"
        );
    }
    for r in [forbidden, many] {
        assert_eq!(r.status, 200, "{r:?}");
        assert!(
            r.error
                .as_deref()
                .is_some_and(|e| e.contains("INTERNAL_ERROR")),
            "{r:?}"
        );
        assert_eq!(r.trailers, None, "{r:?}");
    }
    assert_no_panic(&server);
    let stats = server.stop();
    assert_eq!(stats["proxy_h2_streams_reset"], 2, "{stats:?}");
}

/// An h2 client's request trailers reach an HTTP/1.1 backend as the trailer section of the
/// chunked body, without the fields a trailer may not carry; with a `Content-Length` (no
/// place for them in HTTP/1.1) they are dropped; past a head's field count, 400.
#[test]
fn h2_request_trailers_reach_an_http1_backend_in_the_chunked_body() {
    let backend = raw_backend();
    let server = h2_proxy(&format!("127.0.0.1:{backend}")).start();
    let p = server.port();
    let post = |length: Option<usize>, trailers: http::HeaderMap| {
        let mut req = http::Request::post(format!("https://localhost:{p}/raw"));
        if let Some(n) = length {
            req = req.header("content-length", n);
        }
        (
            req.body(()).expect("request"),
            b"abc".to_vec(),
            Some(trailers),
        )
    };
    let trailers = fields_of(&[
        ("x-sum", "1"),
        ("authorization", "secret"),
        ("cookie", "c=1"),
        ("x-forwarded-for", "6.6.6.6"),
        ("content-type", "text/evil"),
        ("x-sum", "2"),
    ]);
    let many: Vec<(String, &str)> = (0..65).map(|i| (format!("x-{i}"), "1")).collect();
    let many: Vec<(&str, &str)> = many.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    let replies = h2_requests(
        p,
        vec![
            post(None, trailers.clone()),
            post(Some(3), trailers),
            post(None, fields_of(&many)),
            post(None, fields_of(&[("x-only", "trailer")])),
        ],
    );
    let [chunked, sized, too_many, after] = &replies[..] else {
        panic!("{replies:?}")
    };
    let body = |r: &H2Reply| String::from_utf8_lossy(&r.body).to_string();
    assert_eq!(chunked.status, 200, "{chunked:?}");
    assert_eq!(
        body(chunked),
        "3\r\nabc\r\n0\r\nx-sum: 1\r\nx-sum: 2\r\n\r\n"
    );
    assert_eq!((sized.status, body(sized)), (200, "abc".into()));
    assert_eq!(too_many.status, 400, "{too_many:?}");
    // The connection goes on.
    assert_eq!(
        (after.status, body(after)),
        (200, "3\r\nabc\r\n0\r\nx-only: trailer\r\n\r\n".into())
    );
    assert_no_panic(&server);
    let stats = server.stop();
    assert_eq!(stats["proxy_http_refused"], 1, "{stats:?}");
}

/// `--backend-timeout` counts from the end of the request body, as over HTTP/1.1: an h2
/// client's upload that takes longer than it, to a backend taking it as it comes, is
/// answered (HTTP/1.1 and h2c backends alike), and a backend silent after the body is still
/// 504 at the timeout.
#[test]
fn an_upload_longer_than_the_backend_timeout_is_answered_over_h2() {
    let post = |port: u16, path: &str, body: &[u8]| {
        let req = http::Request::post(format!("https://localhost:{port}{path}"))
            .header("content-length", body.len())
            .body(())
            .expect("request");
        (req, body.to_vec(), None)
    };
    let body = pattern(5000);
    // Five pieces 400 ms apart: 1.6 s, against a 1 s --backend-timeout.
    let gap = Some(Duration::from_millis(400));

    let raw = raw_backend();
    let server = h2_proxy(&format!("127.0.0.1:{raw}"))
        .arg("--backend-timeout")
        .arg("1")
        .start();
    let p = server.port();
    let replies = h2_requests_paced(p, vec![post(p, "/raw", &body)], gap);
    assert_eq!(replies[0].status, 200, "{:?}", replies[0].error);
    assert!(replies[0].body == body, "the body came back changed");
    let started = Instant::now();
    let replies = h2_requests(p, vec![post(p, "/silent", b"x")]);
    assert_eq!(replies[0].status, 504, "{:?}", replies[0]);
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "504 after {:?}",
        started.elapsed()
    );
    assert_no_panic(&server);
    server.stop();

    let backend = h2c_backend();
    let server = h2c_proxy_builder(&backend)
        .arg("--alpn")
        .arg("h2,http/1.1")
        .arg("--backend-timeout")
        .arg("1")
        .start();
    let p = server.port();
    let replies = h2_requests_paced(p, vec![post(p, "/echo", &body)], gap);
    assert_eq!(replies[0].status, 200, "{:?}", replies[0].error);
    assert!(replies[0].body == body, "the body came back changed");
    assert_no_panic(&server);
    server.stop();
}
