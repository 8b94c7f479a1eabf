//! `tlsplane proxy` in TCP mode: real backends (threads on loopback sockets), a rustls client
//! reading and writing at the same time, byte-exact checks, half-closes both ways, resets,
//! backends that are down, the PROXY protocol header and Unix-socket backends.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::client::{ClientOpts, Tls};
use crate::support::fixtures::sha256;
use crate::support::{Server, Stats};

/// A TCP echo backend: every connection gets its bytes back and, after the client's EOF, an
/// EOF of its own.
fn echo_backend() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(c) = c else { break };
            std::thread::spawn(move || echo(c));
        }
    });
    addr
}

fn echo(mut c: TcpStream) {
    let mut buf = vec![0u8; 65536];
    loop {
        match c.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if c.write_all(&buf[..n]).is_err() {
                    return;
                }
            }
        }
    }
    let _ = c.shutdown(Shutdown::Write);
}

/// A backend whose one connection runs `f`.
fn one_shot_backend(f: impl FnOnce(TcpStream) + Send + 'static) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    std::thread::spawn(move || {
        if let Ok((c, _)) = l.accept() {
            f(c);
        }
    });
    addr
}

fn proxy_to(backends: &[String]) -> Server {
    Server::builder().proxy(backends).start()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

type Client = tokio_rustls::client::TlsStream<tokio::net::TcpStream>;

async fn connect(port: u16, v: Tls) -> Client {
    let sock = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    let connector = tokio_rustls::TlsConnector::from(ClientOpts::version(v).config());
    let c = connector
        .connect("localhost".try_into().expect("name"), sock)
        .await
        .expect("handshake with the proxy");
    settle_on_kernel_plane().await;
    c
}

/// In kernel mode, gives the server time to hand the connection to kTLS before the client
/// may half-close: the kernel attaches TLS only to an ESTABLISHED socket, so a FIN that comes
/// first (CLOSE_WAIT) makes it refuse, and `--data-plane kernel` then closes the connection
/// (`auto` would carry it on the user plane). Bytes sent together with the client's Finished
/// are another matter (decrypted by rustls, so copied): this keeps them apart too.
async fn settle_on_kernel_plane() {
    if crate::support::mode() == crate::support::Mode::Kernel {
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// Sends `data` and a close_notify while reading everything that comes back, at the same
/// time; returns what came back and whether it ended with a close_notify (a clean EOF).
async fn echo_round(client: Client, data: Vec<u8>) -> (Vec<u8>, bool) {
    let (mut r, mut w) = tokio::io::split(client);
    let writer = async move {
        for chunk in data.chunks(100_003) {
            w.write_all(chunk).await.expect("write to the proxy");
        }
        w.shutdown().await.expect("close_notify to the proxy");
    };
    let reader = async move {
        let mut got = Vec::new();
        let clean = match r.read_to_end(&mut got).await {
            Ok(_) => true,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => false,
            Err(e) => panic!("read from the proxy: {e}"),
        };
        (got, clean)
    };
    let ((), out) = tokio::join!(writer, reader);
    out
}

#[test]
fn tcp_mode_echoes_every_size_byte_exact_both_ways_at_once() {
    let backend = echo_backend();
    let server = proxy_to(&[backend.to_string()]);
    let rt = runtime();
    let mut sizes = vec![0usize, 1, 16383, 16384, 16385, 100_003, (1 << 20) + 7];
    let mut rounds = 0;
    for v in [Tls::V13, Tls::V12] {
        if v == Tls::V13 {
            sizes.push(64 << 20);
        }
        for &n in &sizes {
            let data: Vec<u8> = (0..n).map(|i| (i * 131 % 251) as u8).collect();
            let want = sha256(&data);
            let (got, clean) = rt.block_on(async {
                let c = connect(server.port(), v).await;
                echo_round(c, data).await
            });
            assert_eq!(got.len(), n, "{v:?} {n} B: length of the echo");
            assert!(sha256(&got) == want, "{v:?} {n} B: the echo differs");
            assert!(
                clean,
                "{v:?} {n} B: the backend's EOF must reach the client as close_notify"
            );
            rounds += 1;
        }
        sizes.retain(|&n| n < 64 << 20);
    }
    let stats = server.stop();
    assert_eq!(stats["proxy_forwarded"], rounds);
    assert_eq!(stats["proxy_client_errors"], 0, "{stats:?}");
    assert_eq!(stats["proxy_backend_errors"], 0, "{stats:?}");
    let total: u64 = sizes.iter().map(|&n| n as u64).sum::<u64>() * 2 + (64 << 20);
    copied_or_spliced(&stats, total);
}

/// Every byte went through the proxy one way or the other (copied, or spliced on the kernel
/// plane), in each direction.
fn copied_or_spliced(stats: &Stats, each_way: u64) {
    let moved = |dir: &str| {
        stats
            .0
            .get(&format!("proxy_bytes_to_{dir}_copied"))
            .copied()
            .unwrap_or(0)
            + stats
                .0
                .get(&format!("proxy_bytes_to_{dir}_spliced"))
                .copied()
                .unwrap_or(0)
    };
    assert_eq!(
        moved("backend"),
        each_way,
        "bytes to the backend: {stats:?}"
    );
    assert_eq!(moved("client"), each_way, "bytes to the client: {stats:?}");
}

#[test]
fn backend_closing_first_leaves_the_client_direction_open() {
    let (tx, rx) = mpsc::channel();
    let backend = one_shot_backend(move |mut c| {
        c.write_all(b"hello").unwrap();
        c.shutdown(Shutdown::Write).unwrap();
        let mut got = Vec::new();
        let r = c.read_to_end(&mut got);
        let _ = tx.send((r.is_ok(), got));
    });
    let server = proxy_to(&[backend.to_string()]);
    let rt = runtime();
    let data: Vec<u8> = (0..(1 << 20) + 3).map(|i| (i % 253) as u8).collect();
    let sent = data.clone();
    rt.block_on(async move {
        let mut c = connect(server.port(), Tls::V13).await;
        let mut greeting = Vec::new();
        c.read_to_end(&mut greeting)
            .await
            .expect("the backend's EOF arrives as close_notify");
        assert_eq!(greeting, b"hello");
        // Half-closed by the server: the client may still send (TLS 1.3 half-close).
        c.write_all(&sent)
            .await
            .expect("write after the server's close_notify");
        c.shutdown().await.expect("close_notify");
        drop(server.stop());
    });
    let (ok, got) = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("backend result");
    assert!(ok, "the backend's read failed");
    assert_eq!(got.len(), data.len());
    assert!(got == data, "bytes after the backend's half-close differ");
}

#[test]
fn client_closing_first_leaves_the_backend_direction_open() {
    let backend = one_shot_backend(move |mut c| {
        let mut got = Vec::new();
        c.read_to_end(&mut got).unwrap();
        // The client has finished sending; answer after its EOF, then end.
        let answer: Vec<u8> = got.iter().rev().copied().collect();
        c.write_all(&answer).unwrap();
        c.write_all(b"!").unwrap();
    });
    let server = proxy_to(&[backend.to_string()]);
    let rt = runtime();
    rt.block_on(async move {
        let mut c = connect(server.port(), Tls::V12).await;
        c.write_all(b"abcdef").await.unwrap();
        c.shutdown().await.unwrap();
        let mut got = Vec::new();
        c.read_to_end(&mut got).await.expect("clean end");
        assert_eq!(got, b"fedcba!");
        let stats = server.stop();
        assert_eq!(stats["proxy_backend_errors"], 0);
    });
}

fn reset(c: TcpStream) {
    socket2::SockRef::from(&c)
        .set_linger(Some(Duration::ZERO))
        .unwrap();
    drop(c);
}

#[test]
fn a_backend_reset_resets_the_client() {
    let backend = one_shot_backend(move |mut c| {
        let mut b = [0u8; 1];
        c.read_exact(&mut b).unwrap();
        c.write_all(b"partial").unwrap();
        std::thread::sleep(Duration::from_millis(200));
        reset(c);
    });
    let server = proxy_to(&[backend.to_string()]);
    let rt = runtime();
    rt.block_on(async move {
        let mut c = connect(server.port(), Tls::V13).await;
        c.write_all(b"x").await.unwrap();
        let mut got = Vec::new();
        let r = c.read_to_end(&mut got).await;
        assert_eq!(
            r.map_err(|e| e.kind()),
            Err(std::io::ErrorKind::ConnectionReset),
            "a backend reset must reach the client as a reset (after {:?})",
            String::from_utf8_lossy(&got)
        );
        assert_eq!(got, b"partial");
        let stats = server.stop();
        assert_eq!(stats["proxy_backend_errors"], 1, "{stats:?}");
    });
}

#[test]
fn a_client_reset_resets_the_backend() {
    let (tx, rx) = mpsc::channel();
    let backend = one_shot_backend(move |mut c| {
        let mut got = Vec::new();
        let r = c.read_to_end(&mut got);
        let _ = tx.send(r.map_err(|e| e.kind()));
    });
    let server = proxy_to(&[backend.to_string()]);
    let rt = runtime();
    rt.block_on(async move {
        let mut c = connect(server.port(), Tls::V13).await;
        c.write_all(b"some bytes").await.unwrap();
        c.flush().await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        let (sock, _) = c.into_inner();
        let sock = sock.into_std().unwrap();
        reset(sock);
        let r = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("backend result");
        assert_eq!(
            r,
            Err(std::io::ErrorKind::ConnectionReset),
            "the backend must see a reset, not a clean EOF"
        );
        let stats = server.stop();
        assert_eq!(stats["proxy_client_errors"], 1, "{stats:?}");
    });
}

/// A port nothing listens on.
fn closed_port() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let a = l.local_addr().unwrap();
    drop(l);
    a
}

#[test]
fn a_down_backend_is_skipped_and_counted() {
    let server = proxy_to(&[closed_port().to_string(), echo_backend().to_string()]);
    let rt = runtime();
    for i in 0..4 {
        let (got, clean) = rt.block_on(async {
            let c = connect(server.port(), Tls::V13).await;
            echo_round(c, format!("round {i}").into_bytes()).await
        });
        assert_eq!(got, format!("round {i}").into_bytes());
        assert!(clean);
    }
    let stats = server.stop();
    assert_eq!(stats["proxy_forwarded"], 4);
    // Tried once, then left out of the rotation (--backend-down-time).
    assert_eq!(stats["proxy_backend_connect_failures"], 1, "{stats:?}");
}

#[test]
fn no_backend_up_closes_the_client_at_once() {
    let server = proxy_to(&[closed_port().to_string()]);
    let rt = runtime();
    rt.block_on(async {
        let mut c = connect(server.port(), Tls::V13).await;
        let t = Instant::now();
        let mut got = Vec::new();
        let r = tokio::time::timeout(Duration::from_secs(5), c.read_to_end(&mut got))
            .await
            .expect("the proxy must not leave the client waiting");
        assert!(r.is_ok(), "close_notify expected: {r:?}");
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    });
    let stats = server.stop();
    assert_eq!(stats["proxy_no_backend"], 1, "{stats:?}");
}

/// Reads a PROXY header off `c`, then echoes the rest.
fn proxy_header_backend(tx: mpsc::Sender<Vec<u8>>) -> SocketAddr {
    one_shot_backend(move |mut c| {
        let mut first = [0u8; 16];
        c.read_exact(&mut first[..5]).unwrap();
        let header = if &first[..5] == b"PROXY" {
            let mut line = first[..5].to_vec();
            let mut b = [0u8; 1];
            while !line.ends_with(b"\r\n") {
                c.read_exact(&mut b).unwrap();
                line.push(b[0]);
            }
            line
        } else {
            c.read_exact(&mut first[5..]).unwrap();
            let len = u16::from_be_bytes([first[14], first[15]]) as usize;
            let mut rest = vec![0u8; len];
            c.read_exact(&mut rest).unwrap();
            let mut all = first.to_vec();
            all.extend(rest);
            all
        };
        tx.send(header).unwrap();
        echo(c);
    })
}

#[test]
fn proxy_protocol_v1_carries_the_client_address() {
    let (tx, rx) = mpsc::channel();
    let backend = proxy_header_backend(tx);
    let server = Server::builder()
        .proxy(&[backend.to_string()])
        .arg("--proxy-protocol")
        .arg("v1")
        .start();
    let rt = runtime();
    let port = server.port();
    let local = rt.block_on(async {
        let c = connect(port, Tls::V13).await;
        let local = c.get_ref().0.local_addr().unwrap();
        let (got, _) = echo_round(c, b"after the header".to_vec()).await;
        assert_eq!(got, b"after the header");
        local
    });
    let header = String::from_utf8(rx.recv_timeout(Duration::from_secs(5)).unwrap()).unwrap();
    assert_eq!(
        header,
        format!("PROXY TCP4 127.0.0.1 127.0.0.1 {} {port}\r\n", local.port())
    );
    drop(server.stop());
}

/// PROXY v2 TLVs by type.
fn tlv_map(mut rest: &[u8]) -> std::collections::BTreeMap<u8, Vec<u8>> {
    let mut tlvs = std::collections::BTreeMap::new();
    while rest.len() >= 3 {
        let l = u16::from_be_bytes([rest[1], rest[2]]) as usize;
        tlvs.insert(rest[0], rest[3..3 + l].to_vec());
        rest = &rest[3 + l..];
    }
    tlvs
}

#[test]
fn proxy_protocol_v2_carries_the_address_and_the_tls_facts() {
    let rt = runtime();
    // The suite as OpenSSL names it, as HAProxy sends it (the preferred one for a P-256 key).
    for (v, version, cipher) in [
        (Tls::V13, "TLSv1.3", "TLS_AES_128_GCM_SHA256"),
        (Tls::V12, "TLSv1.2", "ECDHE-ECDSA-AES128-GCM-SHA256"),
    ] {
        let (tx, rx) = mpsc::channel();
        let backend = proxy_header_backend(tx);
        // TCP mode offers no ALPN unless told: told here, for the TLV to carry it.
        let server = Server::builder()
            .proxy(&[backend.to_string()])
            .arg("--proxy-protocol")
            .arg("v2")
            .arg("--alpn")
            .arg("http/1.1")
            .start();
        let port = server.port();
        let local = rt.block_on(async {
            let c = connect(port, v).await;
            let local = c.get_ref().0.local_addr().unwrap();
            let (got, _) = echo_round(c, b"payload".to_vec()).await;
            assert_eq!(got, b"payload");
            local
        });
        let h = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert_eq!(&h[..12], b"\r\n\r\n\0\r\nQUIT\n");
        assert_eq!(h[12], 0x21, "version 2, PROXY");
        assert_eq!(h[13], 0x11, "TCP over IPv4");
        assert_eq!(&h[16..20], &[127, 0, 0, 1]);
        assert_eq!(u16::from_be_bytes([h[24], h[25]]), local.port());
        assert_eq!(u16::from_be_bytes([h[26], h[27]]), port);
        let tlvs = tlv_map(&h[28..]);
        assert_eq!(
            tlvs.get(&0x01).map(Vec::as_slice),
            Some(&b"http/1.1"[..]),
            "ALPN"
        );
        assert_eq!(
            tlvs.get(&0x02).map(Vec::as_slice),
            Some(&b"localhost"[..]),
            "authority"
        );
        let ssl = tlvs.get(&0x20).expect("the SSL TLV");
        assert_eq!(ssl[0] & 1, 1, "client connected over TLS");
        let subs = tlv_map(&ssl[5..]);
        let text = |t: u8| {
            subs.get(&t)
                .map(|s| String::from_utf8_lossy(s).into_owned())
        };
        assert_eq!(text(0x21).as_deref(), Some(version), "SSL_VERSION");
        assert_eq!(text(0x23).as_deref(), Some(cipher), "SSL_CIPHER");
        drop(server.stop());
    }
}

#[test]
fn unix_socket_backend() {
    let dir = tempdir();
    let path = dir.join("backend.sock");
    let l = std::os::unix::net::UnixListener::bind(&path).unwrap();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { break };
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 65536];
                while let Ok(n) = c.read(&mut buf) {
                    if n == 0 || c.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                let _ = c.shutdown(Shutdown::Write);
            });
        }
    });
    let server = proxy_to(&[format!("unix:{}", path.display())]);
    let rt = runtime();
    let data: Vec<u8> = (0..300_000).map(|i| (i % 7) as u8).collect();
    let (got, clean) = rt.block_on(async {
        let c = connect(server.port(), Tls::V13).await;
        echo_round(c, data.clone()).await
    });
    assert!(got == data && clean);
    drop(server.stop());
    let _ = std::fs::remove_dir_all(dir);
}

fn tempdir() -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!(
        "tlsplane-proxy-test-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A backend that answers every connection with `tag` and closes.
fn tagged_backend(tag: &'static str) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { break };
            let _ = c.write_all(tag.as_bytes());
        }
    });
    addr
}

async fn read_all_from(port: u16, name: &str) -> Vec<u8> {
    let sock = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    let connector = tokio_rustls::TlsConnector::from(ClientOpts::version(Tls::V13).config());
    let mut c = connector
        .connect(name.to_string().try_into().expect("name"), sock)
        .await
        .expect("handshake");
    settle_on_kernel_plane().await;
    let mut got = Vec::new();
    c.read_to_end(&mut got).await.expect("clean end");
    got
}

#[test]
fn sites_by_server_name_have_their_own_backends() {
    use crate::support::fixtures::{pki, CertKind};
    let dir = crate::sites::scratch("proxy-sites");
    let a = pki().issue_in(&dir, "a", &["a.test"], CertKind::P256);
    let b = pki().issue_in(&dir, "b", &["*.b.test"], CertKind::P256);
    let (ba, bb, bd) = (
        tagged_backend("A"),
        tagged_backend("B"),
        tagged_backend("default"),
    );
    let toml = format!(
        "[server]\nto = [\"{bd}\"]\n\n\
         [[site]]\nserver-names = [\"a.test\"]\nto = [\"{ba}\"]\n\
         [[site.cert]]\nchain = {:?}\nkey = {:?}\n\n\
         [[site]]\nserver-names = [\"*.b.test\"]\nto = [\"{bb}\"]\n\
         [[site.cert]]\nchain = {:?}\nkey = {:?}\n\n\
         [[site]]\ndefault = true\n\
         [[site.cert]]\nchain = {:?}\nkey = {:?}\n",
        a.cert_pem,
        a.key_pem,
        b.cert_pem,
        b.key_pem,
        pki().leaf(CertKind::P256).cert_pem,
        pki().leaf(CertKind::P256).key_pem,
    );
    let config = dir.join("proxy.toml");
    std::fs::write(&config, toml).unwrap();
    // check-config knows a proxy's file by its backends.
    let out = std::process::Command::new(crate::support::server_bin())
        .arg("check-config")
        .arg(&config)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "check-config: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let server = Server::builder().proxy(&[]).config_file(&config).start();
    let rt = runtime();
    rt.block_on(async {
        assert_eq!(read_all_from(server.port(), "a.test").await, b"A");
        assert_eq!(read_all_from(server.port(), "x.b.test").await, b"B");
        assert_eq!(read_all_from(server.port(), "localhost").await, b"default");
    });
    drop(server.stop());
}

#[test]
fn kernel_plane_moves_proxied_bytes_by_splice_only() {
    if !crate::support::kernel_only("splice through kTLS in tlsplane proxy") {
        return;
    }
    let backend = echo_backend();
    let server = proxy_to(&[backend.to_string()]);
    let rt = runtime();
    let n = (4 << 20) + 5;
    let data: Vec<u8> = (0..n).map(|i| (i % 241) as u8).collect();
    for v in [Tls::V13, Tls::V12] {
        let (got, clean) = rt.block_on(async {
            // (connect waits for the kernel to take over: nothing rides with the Finished.)
            let c = connect(server.port(), v).await;
            echo_round(c, data.clone()).await
        });
        assert!(got == data, "{v:?}: echo differs");
        assert!(clean, "{v:?}: close_notify expected");
    }
    let stats = server.stop();
    let each_way = 2 * n as u64;
    assert_eq!(
        stats["proxy_bytes_to_backend_spliced"], each_way,
        "{stats:?}"
    );
    assert_eq!(
        stats["proxy_bytes_to_client_spliced"], each_way,
        "{stats:?}"
    );
    assert_eq!(stats["proxy_bytes_to_backend_copied"], 0, "{stats:?}");
    assert_eq!(stats["proxy_bytes_to_client_copied"], 0, "{stats:?}");
    // The client's close_notify met splice (EINVAL) and was read as a record: both ends clean.
    assert_eq!(stats["close_notify_received"], 2, "{stats:?}");
}

/// A TLS 1.3 KeyUpdate in the middle of a proxied stream: honoured (user plane, and kernels
/// that re-key: the stream goes on) or the connection ends with close_notify (kernels that
/// cannot re-key), never corrupted bytes.
#[test]
fn key_update_in_the_middle_of_a_proxied_stream() {
    use crate::support::client::{End, TlsClient};
    let backend = echo_backend();
    let server = proxy_to(&[backend.to_string()]);
    let mut c = TlsClient::connect_version(server.port(), Tls::V13);
    std::thread::sleep(Duration::from_millis(300));
    let first: Vec<u8> = (0..50_000).map(|i| (i % 13) as u8).collect();
    c.write_all(&first).unwrap();
    let mut got = vec![0u8; first.len()];
    let mut at = 0;
    while at < got.len() {
        match c.read_plain(&mut got[at..]) {
            Ok(0) => panic!("EOF before the echo"),
            Ok(n) => at += n,
            Err(e) => panic!("read: {e}"),
        }
    }
    assert!(got == first);
    c.conn.refresh_traffic_keys().expect("KeyUpdate");
    let second = b"after the KeyUpdate".to_vec();
    let wrote = c.write_all(&second);
    let _ = c.send_close_notify();
    let (rest, end) = c.read_to_end();
    let stats = server.stop();
    if stats["key_update_unsupported"] == 1 {
        // This kernel cannot re-key: the server ended the stream cleanly, nothing corrupted.
        assert!(rest.is_empty() || rest == second, "{rest:?}");
        assert!(matches!(end, End::CloseNotify | End::Io(..)), "{end:?}");
    } else {
        assert!(wrote.is_ok());
        assert_eq!(
            rest, second,
            "the stream must go on under the new key ({end:?})"
        );
        assert!(matches!(end, End::CloseNotify), "{end:?}");
        if crate::support::mode() == crate::support::Mode::Kernel {
            assert_eq!(stats["key_updates"], 1, "{stats:?}");
        }
    }
}

/// nginx behind the proxy with `listen ... proxy_protocol`, logging `$proxy_protocol_addr`:
/// a real PROXY-protocol parser, not ours, reads the client's address from our header.
#[test]
fn nginx_logs_the_client_address_from_the_proxy_header() {
    let Some(nginx) = crate::support::tools::find_in_path("nginx") else {
        eprintln!("SKIPPED: nginx not installed");
        return;
    };
    for version in ["v1", "v2"] {
        let dir = tempdir();
        let port = closed_port().port();
        let log = dir.join("access.log");
        std::fs::write(
            dir.join("nginx.conf"),
            format!(
                "daemon off; master_process off; worker_processes 1;\n\
                 pid {d}/nginx.pid; error_log {d}/error.log;\n\
                 events {{ worker_connections 64; }}\n\
                 http {{\n\
                   client_body_temp_path {d}; proxy_temp_path {d}; fastcgi_temp_path {d};\n\
                   uwsgi_temp_path {d}; scgi_temp_path {d};\n\
                   log_format pp '$proxy_protocol_addr $proxy_protocol_port';\n\
                   server {{ listen 127.0.0.1:{port} proxy_protocol; access_log {log} pp;\n\
                     location / {{ return 200 \"hello from nginx\\n\"; }} }}\n\
                 }}\n",
                d = dir.display(),
                log = log.display()
            ),
        )
        .unwrap();
        let mut child = std::process::Command::new(&nginx)
            .arg("-p")
            .arg(&dir)
            .arg("-c")
            .arg(dir.join("nginx.conf"))
            .arg("-e")
            .arg(dir.join("error.log"))
            .stdin(std::process::Stdio::null())
            .spawn()
            .expect("start nginx");
        let up = (0..200).any(|_| {
            std::thread::sleep(Duration::from_millis(25));
            TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        assert!(
            up,
            "nginx did not listen: {:?}",
            std::fs::read_to_string(dir.join("error.log"))
        );
        // (That probe connection sent no header: nginx logs nothing for it.)
        let server = Server::builder()
            .proxy(&[format!("127.0.0.1:{port}")])
            .arg("--proxy-protocol")
            .arg(version)
            .start();
        let rt = runtime();
        let (local, response) = rt.block_on(async {
            let mut c = connect(server.port(), Tls::V13).await;
            let local = c.get_ref().0.local_addr().unwrap();
            c.write_all(b"GET / HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
                .await
                .unwrap();
            let mut got = Vec::new();
            c.read_to_end(&mut got).await.expect("clean end");
            (local, String::from_utf8_lossy(&got).into_owned())
        });
        drop(server.stop());
        let _ = child.kill();
        let _ = child.wait();
        assert!(
            response.starts_with("HTTP/1.1 200"),
            "{version}: {response}"
        );
        assert!(
            response.ends_with("hello from nginx\n"),
            "{version}: {response}"
        );
        let logged = std::fs::read_to_string(&log).unwrap_or_default();
        assert_eq!(
            logged.trim(),
            format!("127.0.0.1 {}", local.port()),
            "{version}: nginx's $proxy_protocol_addr and port must be the client's"
        );
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// The largest buffer `net.ipv4.<name>` lets TCP autotune to, in bytes.
fn sysctl_max(name: &str) -> u64 {
    let v = std::fs::read_to_string(format!("/proc/sys/net/ipv4/{name}")).expect(name);
    v.split_whitespace()
        .last()
        .and_then(|m| m.parse().ok())
        .expect(name)
}

/// The proxy's resident set, KiB.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}

#[test]
fn a_client_that_stops_reading_stops_the_proxy_reading_the_backend() {
    use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
    // More than every socket buffer on the way can hold: two send buffers of at most
    // tcp_wmem's maximum, two receive buffers of at most tcp_rmem's, and 16 MiB more.
    let total = 2 * (sysctl_max("tcp_wmem") + sysctl_max("tcp_rmem")) + (16 << 20);
    let pattern = |at: u64| (at % 251) as u8;
    let written = Arc::new(AtomicU64::new(0));
    let backend = {
        let written = written.clone();
        one_shot_backend(move |mut c| {
            let mut chunk = vec![0u8; 64 << 10];
            let mut at = 0u64;
            while at < total {
                let n = chunk.len().min((total - at) as usize);
                for (i, b) in chunk[..n].iter_mut().enumerate() {
                    *b = pattern(at + i as u64);
                }
                if c.write_all(&chunk[..n]).is_err() {
                    return;
                }
                at += n as u64;
                written.store(at, SeqCst);
            }
            let _ = c.shutdown(Shutdown::Write);
        })
    };
    let server = proxy_to(&[backend.to_string()]);
    let rt = runtime();
    rt.block_on(async {
        let mut c = connect(server.port(), Tls::V13).await;
        let mut buf = vec![0u8; 64 << 10];
        let mut got = 0u64;
        let check = |data: &[u8], got: &mut u64| {
            for (i, &b) in data.iter().enumerate() {
                assert_eq!(b, pattern(*got + i as u64), "byte {}", *got + i as u64);
            }
            *got += data.len() as u64;
        };
        while got < 1 << 20 {
            let n = c.read(&mut buf).await.expect("read");
            assert!(n > 0, "early end");
            check(&buf[..n], &mut got);
        }
        let before = rss_kib(server.pid());
        // The client reads nothing more: the backend must stall once the buffers on the way
        // are full, without the proxy taking its bytes into memory.
        let mut last = written.load(SeqCst);
        let started = Instant::now();
        loop {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let now = written.load(SeqCst);
            if now == last || started.elapsed() > Duration::from_secs(20) {
                break;
            }
            last = now;
        }
        let stalled_at = written.load(SeqCst);
        let grew = rss_kib(server.pid()).saturating_sub(before);
        assert!(
            stalled_at < total,
            "the backend wrote everything to a client that read 1 MiB"
        );
        assert!(
            grew < 8 << 10,
            "the proxy grew by {grew} KiB while its client did not read \
             (the backend had written {} MiB)",
            stalled_at >> 20
        );
        // Reading again, the client gets every byte, in order, and the backend's end.
        loop {
            let n = c.read(&mut buf).await.expect("read after the pause");
            if n == 0 {
                break;
            }
            check(&buf[..n], &mut got);
        }
        assert_eq!(got, total, "bytes lost or added");
    });
    let stats = server.stop();
    assert_eq!(stats["proxy_backend_errors"], 0, "{stats:?}");
    assert_eq!(stats["proxy_client_errors"], 0, "{stats:?}");
}

/// A backend's host name is resolved when the configuration loads: one that does not resolve
/// stops the start with its name, rather than failing every connection later.
#[test]
fn a_backend_name_that_does_not_resolve_stops_the_start() {
    let mut cmd = std::process::Command::new(crate::support::server_bin());
    cmd.args([
        "proxy",
        "--to",
        "bad_host!name:80",
        "--listen",
        "127.0.0.1:0",
    ]);
    // A proxy that starts anyway runs until the timeout, which fails the test.
    let out = crate::support::tools::run(cmd, b"", Duration::from_secs(20));
    let err = out.stderr_text();
    assert!(!out.status.success(), "{}", out.describe());
    assert!(
        err.contains("backend bad_host!name:80: cannot resolve"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

// Issue 19 §7 through the proxy: the relay drops its in-flight read of the client whenever the
// backend has data, so a read that is sending a reply (the user plane's no_renegotiation alert;
// on kernels that re-key, the kernel plane's KeyUpdate answer) must, if dropped, finish that
// reply later, whole and once. The client below stops reading until the proxy is blocked
// writing to it, sends its request, reads in small steps with pauses (so that the proxy reads
// the request between writes to a socket that is still nearly full), then reads everything:
// every byte must arrive, in order, in a record stream that decrypts record by record.
//
// What these tests cannot do is force the cancel: the relay reads only after a write to the
// client has completed, and Linux wakes a blocked writer only once a third of its send buffer
// is free, so a reply of some 30 bytes nearly always goes out at once (not one blocked in 46
// runs, some at client MSS 88 or with `--buffer 1048576`). The library test
// (crates/tlsplane/tests/cancel.rs) builds that socket state on the server's side, where a
// client cannot. Made to happen (a reply cut after 10 bytes and its read left waiting, in a
// patched server), the re-sent prefix of the code before be708a8 fails the TLS 1.2 test here
// ("record ... does not decrypt") and today's code passes it; a KeyUpdate left unanswered (the
// kernel plane's loss before be708a8) fails the TLS 1.3 one.

/// Bytes the backend streams per connection: more than the proxy can hold on the client's side
/// (its send buffer, at most tcp_wmem's maximum, and its own buffers), so that data is left
/// on the backend's side while the client does not read.
fn stalled_stream_total() -> u64 {
    sysctl_max("tcp_wmem") + (4 << 20)
}

/// The client's receive buffer: small, so that the proxy's segments are small too.
const SMALL_RCVBUF: usize = 8192;
/// Read steps (each this many bytes, then a pause) after the request, before reading freely.
const STEPS: usize = 8;
const STEP_BYTES: usize = 64 << 10;
const STEP_PAUSE: Duration = Duration::from_millis(40);

fn stream_byte(at: u64) -> u8 {
    (at % 251) as u8
}

/// A backend that waits for one byte from its client, then streams `total` bytes of
/// `stream_byte`, then its EOF.
fn streaming_backend(total: u64) -> SocketAddr {
    one_shot_backend(move |mut c| {
        let mut go = [0u8; 1];
        if c.read_exact(&mut go).is_err() {
            return;
        }
        let mut chunk = vec![0u8; 64 << 10];
        let mut at = 0u64;
        while at < total {
            let n = chunk.len().min((total - at) as usize);
            for (i, b) in chunk[..n].iter_mut().enumerate() {
                *b = stream_byte(at + i as u64);
            }
            if c.write_all(&chunk[..n]).is_err() {
                return;
            }
            at += n as u64;
        }
        let _ = c.shutdown(Shutdown::Write);
    })
}

/// A client socket with a small receive buffer, connected to the proxy.
fn small_window_socket(port: u16) -> TcpStream {
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    s.set_recv_buffer_size(SMALL_RCVBUF).unwrap();
    s.connect(&SocketAddr::from(([127, 0, 0, 1], port)).into())
        .unwrap();
    let s: TcpStream = s.into();
    s.set_nodelay(true).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(10))).unwrap();
    s
}

/// Waits, not reading, until the bytes queued on `sock` stop growing: the client's window is
/// closed, and the proxy fills its send buffer and blocks in its write.
fn wait_for_a_full_window(sock: &TcpStream) {
    let mut peek = vec![0u8; 4 * SMALL_RCVBUF];
    let mut last = 0;
    let started = Instant::now();
    loop {
        std::thread::sleep(Duration::from_millis(150));
        let queued = sock.peek(&mut peek).expect("peek");
        if queued > 0 && queued == last {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the client's window never filled ({queued} bytes queued)"
        );
        last = queued;
    }
    // The proxy's send buffer fills behind the closed window.
    std::thread::sleep(Duration::from_millis(100));
}

/// Checks a piece of the stream at offset `*got`.
fn check_stream(data: &[u8], got: &mut u64) {
    if let Some(i) = (0..data.len()).find(|&i| data[i] != stream_byte(*got + i as u64)) {
        panic!("byte {} of the stream is wrong", *got + i as u64);
    }
    *got += data.len() as u64;
}

/// TLS 1.3: a KeyUpdate with update_requested while the client's window is full. The proxy
/// must answer it with its own KeyUpdate (seen here as rustls' receive sequence starting over
/// during the stream), and every byte must arrive. Kernels that cannot re-key end the
/// connection cleanly instead.
#[test]
fn a_key_update_from_a_client_whose_window_is_full_is_answered_and_nothing_is_lost() {
    use crate::support::client::{End, TlsClient};
    let total = stalled_stream_total();
    let server = proxy_to(&[streaming_backend(total).to_string()]);
    let mut config = (*ClientOpts::version(Tls::V13).config()).clone();
    config.enable_secret_extraction = true;
    let mut c = TlsClient::over(small_window_socket(server.port()), Arc::new(config));
    c.handshake().expect("handshake with the proxy");
    if crate::support::mode() == crate::support::Mode::Kernel {
        std::thread::sleep(Duration::from_millis(300));
    }
    c.write_all(b"g").expect("start the stream");
    wait_for_a_full_window(&c.io.sock);
    c.conn.refresh_traffic_keys().expect("queue a KeyUpdate");
    c.flush_tls().expect("send the KeyUpdate");

    let mut got = 0u64;
    let mut buf = vec![0u8; 64 << 10];
    let mut end = None;
    'steps: for _ in 0..STEPS {
        let until = got + STEP_BYTES as u64;
        while got < until {
            match c.read_plain(&mut buf) {
                Ok(0) => break 'steps,
                Ok(n) => check_stream(&buf[..n], &mut got),
                Err(e) => {
                    end = Some(format!("{e}"));
                    break 'steps;
                }
            }
        }
        std::thread::sleep(STEP_PAUSE);
    }
    let (rest, how) = c.read_to_end();
    check_stream(&rest, &mut got);
    let post_handshake = c.io.inbound.records.len() - c.handshake_records_in;
    // Closed before the proxy stops, which would otherwise wait for it (lingering close).
    let TlsClient { conn, io, .. } = c;
    drop(io);
    let stats = server.stop();
    if stats["key_update_unsupported"] == 1 {
        // A kernel that cannot re-key ends the connection with close_notify (checked as the
        // existing KeyUpdate test does); the bytes before it were checked as they came.
        assert!(matches!(how, End::CloseNotify | End::Io(..)), "{how:?}");
        return;
    }
    assert_eq!(end, None, "the client failed while reading in steps");
    assert!(matches!(how, End::CloseNotify), "{how:?} after {got} bytes");
    assert_eq!(got, total, "bytes lost or added");
    let (rx_seq, _) = conn
        .dangerous_extract_secrets()
        .expect("the client's secrets")
        .rx;
    assert!(
        rx_seq < post_handshake as u64,
        "the proxy never answered the KeyUpdate: the client's receive key is the handshake's \
         ({rx_seq} records under it, {post_handshake} since the handshake)"
    );
    assert_eq!(stats["proxy_client_errors"], 0, "{stats:?}");
    if crate::support::mode() == crate::support::Mode::Kernel {
        assert_eq!(stats["key_updates"], 1, "{stats:?}");
    }
}

/// TLS 1.2: a renegotiation request (a ClientHello under the session's key) while the client's
/// window is full. The user plane refuses it with one no_renegotiation warning alert and goes
/// on: every byte arrives, the alert exactly once, in a record stream that decrypts record by
/// record (a reply sent twice, or its prefix, would not). The kernel plane ends the connection
/// with a no_renegotiation alert: the bytes before it intact. The client's record layer is its
/// own (rustls' keys, extracted after the handshake): rustls' client cannot renegotiate.
#[test]
fn a_renegotiation_request_from_a_client_whose_window_is_full_is_refused_and_nothing_is_lost() {
    use rustls::crypto::cipher::{InboundOpaqueMessage, OutboundChunks, OutboundPlainMessage};
    use rustls::{ConnectionTrafficSecrets, ContentType, ProtocolVersion, SupportedCipherSuite};
    const SUITE: SupportedCipherSuite =
        rustls::crypto::aws_lc_rs::cipher_suite::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256;

    let total = stalled_stream_total();
    let server = proxy_to(&[streaming_backend(total).to_string()]);
    let opts = ClientOpts {
        suites: Some(vec![SUITE]),
        ..ClientOpts::version(Tls::V12)
    };
    let mut config = (*opts.config()).clone();
    config.enable_secret_extraction = true;
    let config = Arc::new(config);
    let mut tcp = small_window_socket(server.port());
    let mut conn = rustls::ClientConnection::new(config.clone(), "localhost".try_into().unwrap())
        .expect("client");
    while conn.is_handshaking() {
        conn.complete_io(&mut tcp)
            .expect("handshake with the proxy");
    }
    // The backend sends nothing before the client's first byte: nothing follows the handshake
    // that rustls could have read before its keys are taken out.
    let secrets = conn
        .dangerous_extract_secrets()
        .expect("the client's secrets");
    let SupportedCipherSuite::Tls12(suite) = SUITE else {
        unreachable!()
    };
    let (mut tx_seq, ConnectionTrafficSecrets::Aes128Gcm { key, iv }) = secrets.tx else {
        panic!("not the suite asked for")
    };
    let mut encrypter = suite
        .aead_alg
        .encrypter(key, &iv.as_ref()[..4], &iv.as_ref()[4..]);
    let (mut rx_seq, ConnectionTrafficSecrets::Aes128Gcm { key, iv }) = secrets.rx else {
        panic!("not the suite asked for")
    };
    let mut decrypter = suite.aead_alg.decrypter(key, &iv.as_ref()[..4]);
    let mut send_record = |tcp: &mut TcpStream, typ: ContentType, payload: &[u8]| {
        let record = encrypter
            .encrypt(
                OutboundPlainMessage {
                    typ,
                    version: ProtocolVersion::TLSv1_2,
                    payload: OutboundChunks::Single(payload),
                },
                tx_seq,
            )
            .expect("encrypt")
            .encode();
        tx_seq += 1;
        tcp.write_all(&record).expect("send a record");
    };

    if crate::support::mode() == crate::support::Mode::Kernel {
        std::thread::sleep(Duration::from_millis(300));
    }
    send_record(&mut tcp, ContentType::ApplicationData, b"g");
    wait_for_a_full_window(&tcp);
    let mut hello = Vec::new();
    rustls::ClientConnection::new(config, "localhost".try_into().unwrap())
        .expect("client")
        .write_tls(&mut hello)
        .expect("a ClientHello");
    assert_eq!(hello[0], 22, "a handshake record");
    send_record(&mut tcp, ContentType::Handshake, &hello[5..]);

    // Records as they come, decrypted one by one.
    let mut input: Vec<u8> = Vec::new();
    let mut chunk = vec![0u8; 64 << 10];
    let mut got = 0u64;
    let mut alerts: Vec<[u8; 2]> = Vec::new();
    let mut raw_read = 0usize;
    let mut eof = false;
    let mut step = 0;
    while !eof {
        let n = match tcp.read(&mut chunk) {
            Ok(n) => n,
            // The kernel plane ends the connection after its refusal: a reset ends it too.
            Err(e)
                if e.kind() == std::io::ErrorKind::ConnectionReset
                    && crate::support::mode() == crate::support::Mode::Kernel =>
            {
                0
            }
            Err(e) => panic!("read after {got} bytes: {e}"),
        };
        eof = n == 0;
        input.extend_from_slice(&chunk[..n]);
        raw_read += n;
        while input.len() >= 5 {
            let len = 5 + u16::from_be_bytes([input[3], input[4]]) as usize;
            if input.len() < len {
                break;
            }
            let mut record: Vec<u8> = input.drain(..len).collect();
            let typ = ContentType::from(record[0]);
            let version = ProtocolVersion::from(u16::from_be_bytes([record[1], record[2]]));
            let plain = decrypter
                .decrypt(
                    InboundOpaqueMessage::new(typ, version, &mut record[5..]),
                    rx_seq,
                )
                .unwrap_or_else(|e| {
                    panic!(
                        "record {rx_seq} ({typ:?}, {len} bytes) after {got} bytes of the stream \
                         does not decrypt: {e}"
                    )
                });
            rx_seq += 1;
            match plain.typ {
                ContentType::ApplicationData => {
                    assert!(
                        alerts.is_empty() || alerts == [[1, 100]],
                        "data after {alerts:?}"
                    );
                    check_stream(plain.payload, &mut got);
                }
                ContentType::Alert => {
                    let a: [u8; 2] = plain.payload.to_vec().try_into().expect("a 2-byte alert");
                    alerts.push(a);
                }
                other => panic!("a {other:?} record from the proxy"),
            }
        }
        if step < STEPS && raw_read >= STEP_BYTES {
            raw_read = 0;
            step += 1;
            std::thread::sleep(STEP_PAUSE);
        }
    }
    assert!(
        input.is_empty(),
        "{} bytes of a cut record at the end",
        input.len()
    );
    drop(tcp);
    let stats = server.stop();
    match crate::support::mode() {
        crate::support::Mode::User => {
            // warning no_renegotiation, once; then the backend's end as close_notify.
            assert_eq!(alerts, [[1, 100], [1, 0]], "after {got} bytes");
            assert_eq!(got, total, "bytes lost or added");
            assert_eq!(stats["proxy_client_errors"], 0, "{stats:?}");
        }
        // The kernel plane refuses with a fatal alert (or, if that cannot be sent within its
        // second, with none) and ends the connection.
        crate::support::Mode::Kernel => {
            assert!(alerts.is_empty() || alerts == [[2, 100]], "{alerts:?}");
            assert_eq!(stats["renegotiations_refused"], 1, "{stats:?}");
        }
    }
}
