//! `tlsplane handoff`: established connections handed to receivers on a Unix socket (issue
//! 21), natively on the user relay plane: Python receivers (`python/tlsplane_handoff.py`)
//! and rustls clients.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::client::{ClientOpts, Tls};
use crate::support::{tools, Server};

fn python_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../python")
}

/// python3 runs the receivers: missing natively is a failure, in the kernel-mode guest (which
/// has none) a skipped test.
pub(crate) fn have_python() -> bool {
    tools::require("python3")
}

/// Runs a Python receiver: `script` with `client` connected to `socket` (the module's
/// `connect`). Its stdout is piped.
fn receiver(socket: &Path, script: &str) -> Child {
    let program = format!(
        "import sys, os, json, socket\nimport tlsplane_handoff\nclient = tlsplane_handoff.connect({:?})\n{script}",
        socket.display().to_string()
    );
    Command::new("python3")
        .arg("-c")
        .arg(program)
        .env("PYTHONPATH", python_dir())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("python3")
}

/// Waits until the server's log says `n` receivers connected (a hand-off before that finds
/// no receiver).
pub(crate) fn wait_receivers(server: &Server, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let seen = server
            .stderr_lines()
            .iter()
            .filter(|l| l.contains("hand-off receiver connected"))
            .count();
        if seen >= n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{n} receivers did not connect; stderr:\n{}",
            server.stderr_lines().join("\n")
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Connections handed off, on either plane (natively the user relay; in the kernel-mode
/// guest the kTLS socket itself).
pub(crate) fn handed_off(stats: &crate::support::Stats) -> u64 {
    stats.get("handoff_user_plane") + stats.get("handoff_kernel_plane")
}

pub(crate) fn scratch(what: &str) -> PathBuf {
    crate::sites::scratch(what)
}

pub(crate) fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

pub(crate) type Client = tokio_rustls::client::TlsStream<tokio::net::TcpStream>;

pub(crate) async fn connect(port: u16, alpn: &[&[u8]]) -> Client {
    connect_to(port, "localhost", alpn).await
}

async fn connect_to(port: u16, name: &str, alpn: &[&[u8]]) -> Client {
    let mut config = (*ClientOpts::version(Tls::V13).config()).clone();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    let sock = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name.to_string().try_into().expect("name"), sock)
        .await
        .expect("handshake")
}

/// Reads to the end: the bytes, and whether the end was a close_notify.
async fn read_to_end(c: &mut Client, limit: Duration) -> (Vec<u8>, bool) {
    let mut got = Vec::new();
    match tokio::time::timeout(limit, c.read_to_end(&mut got)).await {
        Ok(Ok(_)) => (got, true),
        Ok(Err(_)) => (got, false),
        Err(_) => panic!("no end within {limit:?} (got {} bytes)", got.len()),
    }
}

fn stdout_of(mut child: Child) -> String {
    let mut out = String::new();
    child
        .stdout
        .take()
        .expect("piped")
        .read_to_string(&mut out)
        .expect("stdout");
    let _ = child.wait();
    out
}

#[test]
fn a_python_receiver_echoes_and_sees_the_header() {
    if !have_python() {
        return;
    }
    let dir = scratch("handoff-echo");
    let socket = dir.join("app.sock");
    let server = Server::builder()
        .handoff(&socket)
        .arg("--alpn")
        .arg("echo/1")
        .start();
    let rx = receiver(
        &socket,
        r#"
sock, info = client.accept()
data = b""
while True:
    b = sock.recv(65536)
    if not b:
        break
    sock.sendall(b)
    data += b
print(json.dumps({"conn_id": info.conn_id, "plane": info.plane, "version": info.tls_version,
                  "suite": info.cipher_suite, "name": info.server_name,
                  "alpn": info.alpn.decode() if info.alpn else None,
                  "peer": list(info.peer), "local": list(info.local), "bytes": len(data)}))
client.close(sock, info)
"#,
    );
    wait_receivers(&server, 1);
    let data: Vec<u8> = (0..200_000).map(|i| (i % 251) as u8).collect();
    let (got, clean, client_port) = runtime().block_on(async {
        let c = connect(server.port(), &[b"echo/1"]).await;
        let client_port = c.get_ref().0.local_addr().unwrap().port();
        // Both ways at once: the receiver echoes as it reads.
        let (mut r, mut w) = tokio::io::split(c);
        let writer = async {
            w.write_all(&data).await.expect("write");
            w.shutdown().await.expect("close_notify");
            w
        };
        let reader = async {
            let mut got = Vec::new();
            let r2 = tokio::time::timeout(Duration::from_secs(20), r.read_to_end(&mut got)).await;
            (got, matches!(r2, Ok(Ok(_))))
        };
        let (_w, (got, clean)) = tokio::join!(writer, reader);
        (got, clean, client_port)
    });
    assert!(got == data, "echoed {} of {} bytes", got.len(), data.len());
    assert!(clean, "the end was not a close_notify");
    let out = stdout_of(rx);
    let header: serde_json::Value = serde_json::from_str(out.trim()).expect("receiver output");
    assert_eq!(header["plane"], 2, "{header}");
    assert_eq!(header["version"], 0x0304, "{header}");
    assert_ne!(header["suite"], 0, "{header}");
    assert_eq!(header["name"], "localhost", "{header}");
    assert_eq!(header["alpn"], "echo/1", "{header}");
    assert_eq!(header["peer"][1], client_port, "{header}");
    assert_eq!(header["local"][1], server.port(), "{header}");
    assert_eq!(header["bytes"], data.len(), "{header}");
    assert!(header["conn_id"].as_u64().unwrap() > 0, "{header}");
    let stats = server.stop();
    assert!(!socket.exists(), "the socket file outlived the server");
    assert_eq!(handed_off(&stats), 1);
    assert_eq!(
        stats.get("handoff_relayed_bytes"),
        2 * data.len() as u64,
        "{stats:?}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_receiver_whose_uid_is_not_allowed_is_closed_and_gets_nothing() {
    let dir = scratch("handoff-uid");
    let socket = dir.join("app.sock");
    // Not this process's uid (tests run as root or as a user; neither is 12345 here).
    assert_ne!(uid_of_self(), 12345);
    let server = Server::builder()
        .handoff(&socket)
        .arg("--handoff-allow-uid")
        .arg("12345")
        .start();
    let mut rx = std::os::unix::net::UnixStream::connect(&socket).expect("connect");
    rx.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut buf = [0u8; 64];
    assert_eq!(
        rx.read(&mut buf).expect("closed, not timed out"),
        0,
        "a refused receiver got bytes"
    );
    // A client meanwhile: nobody may receive it, so it is closed.
    let (got, _) = runtime().block_on(async {
        let mut c = connect(server.port(), &[]).await;
        read_to_end(&mut c, Duration::from_secs(10)).await
    });
    assert!(got.is_empty());
    let stats = server.stop();
    assert_eq!(stats.get("handoff_receivers_refused"), 1, "{stats:?}");
    assert_eq!(stats.get("handoff_receivers_accepted"), 0, "{stats:?}");
    assert_eq!(stats.get("handoff_refused_no_receiver"), 1, "{stats:?}");
    assert_eq!(handed_off(&stats), 0, "{stats:?}");
    let _ = std::fs::remove_dir_all(dir);
}

fn uid_of_self() -> u32 {
    let out = Command::new("id").arg("-u").output().expect("id -u");
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

#[test]
fn a_receiver_that_dies_mid_connection_resets_the_connections_it_did_not_end() {
    if !have_python() {
        return;
    }
    let dir = scratch("handoff-dies");
    let socket = dir.join("app.sock");
    let server = Server::builder().handoff(&socket).start();
    // The receiver answers, then is killed holding the connection: its death must not look
    // like an end of the response.
    let rx = receiver(
        &socket,
        r#"
sock, info = client.accept()
assert sock.recv(4) == b"ping"
sock.sendall(b"pong")
import signal
os.kill(os.getpid(), signal.SIGKILL)
"#,
    );
    wait_receivers(&server, 1);
    let started = Instant::now();
    let (got, clean) = runtime().block_on(async {
        let mut c = connect(server.port(), &[]).await;
        c.write_all(b"ping").await.unwrap();
        c.flush().await.unwrap();
        read_to_end(&mut c, Duration::from_secs(15)).await
    });
    let took = started.elapsed();
    let _ = stdout_of(rx);
    assert_eq!(got, b"pong");
    // The program never ended the connection: the client must not see a clean end.
    assert!(!clean, "the client's end was a close_notify");
    assert!(took < Duration::from_secs(10), "the end took {took:?}");
    let stats = server.stop();
    assert_eq!(stats.get("handoff_receivers_lost"), 1, "{stats:?}");
    assert_eq!(
        stats.get("handoff_relay_reset_receiver_gone")
            + stats.get("handoff_kernel_released_receiver_gone"),
        1,
        "{stats:?}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn two_receivers_share_the_connections() {
    if !have_python() {
        return;
    }
    let dir = scratch("handoff-two");
    let socket = dir.join("app.sock");
    let server = Server::builder().handoff(&socket).start();
    let script = |tag: &str| {
        format!(
            r#"
while True:
    try:
        sock, info = client.accept()
    except Exception:
        break
    sock.sendall(b"{tag}")
    client.close(sock, info)
"#
        )
    };
    let mut a = receiver(&socket, &script("A"));
    let mut b = receiver(&socket, &script("B"));
    wait_receivers(&server, 2);
    let tags = runtime().block_on(async {
        let mut tags = Vec::new();
        for _ in 0..6 {
            let mut c = connect(server.port(), &[]).await;
            let (got, clean) = read_to_end(&mut c, Duration::from_secs(10)).await;
            assert!(clean);
            tags.push(String::from_utf8(got).unwrap());
        }
        tags
    });
    let stats = server.stop();
    let _ = (a.kill(), b.kill(), a.wait(), b.wait());
    assert!(
        tags.iter().any(|t| t == "A") && tags.iter().any(|t| t == "B"),
        "both receivers must get connections: {tags:?}"
    );
    assert!(tags.iter().all(|t| t == "A" || t == "B"), "{tags:?}");
    assert_eq!(handed_off(&stats), 6, "{stats:?}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn sites_hand_off_on_their_own_sockets() {
    use crate::support::fixtures::{pki, CertKind};
    if !have_python() {
        return;
    }
    let dir = scratch("handoff-sites");
    let a = pki().issue_in(&dir, "a", &["a.test"], CertKind::P256);
    let leaf = pki().leaf(CertKind::P256);
    let (sock_a, sock_d) = (dir.join("a.sock"), dir.join("d.sock"));
    let toml = format!(
        "[server]\nhandoff-socket = {:?}\n\n\
         [[site]]\nserver-names = [\"a.test\"]\nhandoff-socket = \"a.sock\"\nalpn = [\"x-a\"]\n\
         [[site.cert]]\nchain = {:?}\nkey = {:?}\n\n\
         [[site]]\ndefault = true\n\
         [[site.cert]]\nchain = {:?}\nkey = {:?}\n",
        sock_d.display().to_string(),
        a.cert_pem,
        a.key_pem,
        leaf.cert_pem,
        leaf.key_pem,
    );
    let config = dir.join("handoff.toml");
    std::fs::write(&config, toml).unwrap();
    // check-config knows a hand-off file by its handoff-socket.
    let out = Command::new(crate::support::server_bin())
        .arg("check-config")
        .arg(&config)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "check-config: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // (The builder's --handoff-socket is the [server] one: the file's sites override it.)
    let server = Server::builder()
        .handoff(&sock_d)
        .config_file(&config)
        .start();
    let script = |tag: &str| {
        format!(
            r#"
sock, info = client.accept()
sock.sendall(b"{tag} " + (info.server_name or "-").encode() + b" " + (info.alpn or b"-"))
client.close(sock, info)
"#
        )
    };
    let ra = receiver(&sock_a, &script("A"));
    let rd = receiver(&sock_d, &script("D"));
    wait_receivers(&server, 2);
    let (got_a, got_d) = runtime().block_on(async {
        let mut c = connect_to(server.port(), "a.test", &[b"x-a"]).await;
        let a = read_to_end(&mut c, Duration::from_secs(10)).await;
        let mut c = connect_to(server.port(), "localhost", &[]).await;
        let d = read_to_end(&mut c, Duration::from_secs(10)).await;
        (a, d)
    });
    let _ = (stdout_of(ra), stdout_of(rd));
    assert_eq!(String::from_utf8_lossy(&got_a.0), "A a.test x-a");
    assert_eq!(String::from_utf8_lossy(&got_d.0), "D localhost -");
    let stats = server.stop();
    assert_eq!(handed_off(&stats), 2, "{stats:?}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_receiver_that_stops_receiving_gets_a_bounded_queue_then_refusals() {
    let dir = scratch("handoff-queue");
    let socket = dir.join("app.sock");
    let server = Server::builder()
        .handoff(&socket)
        .arg("--handoff-queue")
        .arg("2")
        .start();
    // A receiver that never reads: frames fill the socket's buffer, then the queue.
    let rx = std::os::unix::net::UnixStream::connect(&socket).expect("connect");
    wait_receivers(&server, 1);
    let rt = runtime();
    let (refused, mut open) = rt.block_on(async {
        let mut open = Vec::new();
        for _ in 0..2000 {
            let mut c = connect(server.port(), &[]).await;
            // A refused client reads close_notify at once; a queued one reads nothing.
            let mut b = [0u8; 1];
            match tokio::time::timeout(Duration::from_millis(50), c.read(&mut b)).await {
                Ok(Ok(0)) => return (Some(open.len()), open),
                Ok(r) => panic!("a client queued for hand-off read {r:?}"),
                Err(_) => open.push(c),
            }
        }
        (None, open)
    });
    let before = refused.expect("no refusal after 2000 connections");
    // The receiver goes: its queued connections end. Those never written to it (the queue's,
    // and one whose write it left unfinished) end as refused ones do, with close_notify, on
    // either plane.
    drop(rx);
    let clean = rt.block_on(async {
        let mut clean = 0;
        for c in &mut open {
            clean += usize::from(read_to_end(c, Duration::from_secs(10)).await.1);
        }
        clean
    });
    assert!(
        clean >= 2,
        "{clean} of {} ended with close_notify",
        open.len()
    );
    let stats = server.stop();
    // (A refusal whose close_notify took over 50 ms counts among `before`.)
    let full = stats.get("handoff_refused_queue_full");
    assert!(full >= 1, "{stats:?}");
    assert!(handed_off(&stats) <= before as u64, "{stats:?}");
    assert_eq!(
        handed_off(&stats) + full,
        stats.get("handoff_established"),
        "{stats:?}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_reload_keeps_the_socket_and_its_receivers_and_applies_new_ids() {
    use crate::support::fixtures::{pki, CertKind};
    let dir = scratch("handoff-reload");
    let leaf = pki().leaf(CertKind::P256);
    let socket = dir.join("app.sock");
    let pid_file = dir.join("pid");
    let config = dir.join("handoff.toml");
    let write = |uid: u32| {
        let toml = format!(
            "[[site]]\ndefault = true\nhandoff-socket = \"app.sock\"\nhandoff-allow-uids = [{uid}]\n\
             [[site.cert]]\nchain = {:?}\nkey = {:?}\n",
            leaf.cert_pem, leaf.key_pem,
        );
        std::fs::write(&config, toml).unwrap();
    };
    let reload = || {
        let out = Command::new(crate::support::server_bin())
            .args(["reload", "--pid-file"])
            .arg(&pid_file)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "reload: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    write(12345);
    let server = Server::builder()
        .handoff(&socket)
        .config_file(&config)
        .arg("--pid-file")
        .arg(pid_file.to_str().unwrap())
        // (The admin endpoint holds the counters to the end: the socket file must go anyway.)
        .arg("--admin")
        .arg(format!("unix:{}", dir.join("admin.sock").display()))
        .start();
    let refused = |server: &Server| {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let n = server
                .stderr_lines()
                .iter()
                .filter(|l| l.contains("hand-off receiver refused"))
                .count();
            if n > 0 || Instant::now() > deadline {
                return n;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let mut first = std::os::unix::net::UnixStream::connect(&socket).unwrap();
    first
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    assert_eq!(first.read(&mut [0u8; 8]).unwrap(), 0, "uid 12345 only");
    assert_eq!(refused(&server), 1);
    // Now this process's uid: a receiver that connects after the reload is served.
    write(uid_of_self());
    reload();
    let mut rx = std::os::unix::net::UnixStream::connect(&socket).unwrap();
    rx.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    wait_receivers(&server, 1);
    let frame_start = |rx: &mut std::os::unix::net::UnixStream| {
        // A plain read drops the descriptor (the kernel closes it); the frame's first bytes
        // are enough here.
        let mut magic = [0u8; 4];
        rx.read_exact(&mut magic).expect("a CONNECTION frame");
        assert_eq!(&magic, b"TLPH");
    };
    let rt = runtime();
    let _c1 = rt.block_on(connect(server.port(), &[]));
    frame_start(&mut rx);
    // Another reload: the socket and the receiver connected to it are kept.
    reload();
    let _c2 = rt.block_on(connect(server.port(), &[]));
    // The rest of the first frame, then the second one's start (a read stops at each
    // descriptor).
    let mut got = Vec::new();
    while !got.windows(4).any(|w| w == b"TLPH") {
        let mut buf = [0u8; 4096];
        let n = rx
            .read(&mut buf)
            .expect("no second CONNECTION frame after the reload");
        assert!(n > 0, "the receiver was closed by the reload");
        got.extend_from_slice(&buf[..n]);
    }
    drop((rx, _c1, _c2));
    let stats = server.stop();
    assert!(!socket.exists(), "the socket file outlived the server");
    assert_eq!(handed_off(&stats), 2, "{stats:?}");
    assert_eq!(stats.get("handoff_receivers_refused"), 1, "{stats:?}");
    assert_eq!(stats.get("reloads"), 2, "{stats:?}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn curl_gets_an_answer_from_a_python_receiver_over_tls_1_2_and_1_3() {
    if !have_python() {
        return;
    }
    let dir = scratch("handoff-curl");
    let socket = dir.join("app.sock");
    let server = Server::builder()
        .handoff(&socket)
        .arg("--alpn")
        .arg("http/1.1")
        .start();
    // As the README's example: read the request, answer, close.
    let rx = receiver(
        &socket,
        r#"
for _ in range(2):
    sock, info = client.accept()
    request = sock.recv(65536)
    body = b"%s %s %x %s\n" % (request.split(b"\r\n")[0], info.alpn, info.tls_version,
                               info.server_name.encode())
    sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
                 % (len(body), body))
    client.close(sock, info)
"#,
    );
    wait_receivers(&server, 1);
    for (v, hex) in [(Tls::V13, "304"), (Tls::V12, "303")] {
        let out = v
            .curl(server.port(), 20)
            .arg(format!("https://localhost:{}/hello", server.port()))
            .output()
            .expect("curl");
        assert!(
            out.status.success(),
            "curl {}: {}",
            v.name(),
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            format!("GET /hello HTTP/1.1 http/1.1 {hex} localhost\n")
        );
    }
    let _ = stdout_of(rx);
    let stats = server.stop();
    assert_eq!(handed_off(&stats), 2, "{stats:?}");
    let _ = std::fs::remove_dir_all(dir);
}
