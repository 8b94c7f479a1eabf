//! Builds tests/c/accept_read.c with `cc` against the staticlib and runs it against a fake
//! tlsplane: the C library receives a passed TCP socket, reads it through `tlsplane_read`,
//! asks for close_notify through `tlsplane_close`, and refuses a bad header. And
//! tests/c/trust.c against another user listening at the path: refused unless trusted.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::Command;

use tlsplane_handoff::wire::{self, Message};
use tlsplane_handoff::{read_frame, send_connection, send_reply, ConnInfo, Plane, Reply, Status};

#[path = "../../tlsplane-handoff/tests/common/impostor.rs"]
mod impostor;
use impostor::Impostor;

/// The staticlib cargo built for this test: beside the test binary in target/<profile>/deps
/// (built there on every `cargo test`, while the copy in target/<profile>/ is only refreshed
/// by `cargo build`).
fn staticlib() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().join("libtlsplane_handoff_c.a")
}

/// tests/c/PROG.c built against the staticlib, in `dir`.
fn compile(dir: &Path, prog: &str) -> PathBuf {
    let crate_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let lib = staticlib();
    assert!(lib.exists(), "{} not built", lib.display());
    let exe = dir.join(prog);
    let out = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .args([
            "-std=c99",
            "-D_DEFAULT_SOURCE",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-o",
        ])
        .arg(&exe)
        .arg(crate_dir.join(format!("tests/c/{prog}.c")))
        .arg("-I")
        .arg(crate_dir.join("include"))
        .arg(&lib)
        .args(["-lpthread", "-ldl", "-lm"])
        .output()
        .expect("a C compiler (cc)");
    assert!(
        out.status.success(),
        "cc failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    exe
}

#[test]
fn a_c_program_receives_reads_and_closes_through_the_library() {
    let dir = std::env::temp_dir().join(format!("tlsplane-handoff-c-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let exe = compile(&dir, "accept_read");
    let path = dir.join("handoff.sock");
    let listener = UnixListener::bind(&path).unwrap();

    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut tls_client = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (handed, peer) = l.accept().unwrap();
    let info = ConnInfo {
        conn_id: 4242,
        // Natively there is no kTLS: the socket reports every record as data, so this runs
        // the kernel-plane read (recvmsg with the record-type cmsg) and close (a CLOSE request).
        plane: Plane::Kernel,
        tls_version: 0x0304,
        cipher_suite: 0x1303,
        peer: Some(peer),
        local: Some(handed.local_addr().unwrap()),
        server_name: Some("c.example".into()),
        alpn: Some(b"http/1.1".to_vec()),
    };
    let payload: Vec<u8> = (0..300u32).map(|i| b'a' + (i % 26) as u8).collect();
    tls_client.write_all(&payload).unwrap();
    tls_client.shutdown(std::net::Shutdown::Write).unwrap();

    let fake = std::thread::spawn(move || {
        let (sock, _) = listener.accept().unwrap();
        // Bounded: a receiver that sends no HELLO fails the test, not hangs it.
        sock.set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .unwrap();
        let mut frame = Vec::new();
        read_frame(&sock, &mut frame).unwrap().unwrap();
        assert_eq!(
            Message::decode(&frame),
            Ok(Some(Message::Hello {
                flags: wire::ENDS_WITH_CLOSE
            })),
            "the library's first frame"
        );
        send_connection(&sock, handed.as_fd(), &info).unwrap();
        drop(handed);
        let (_, fd) = read_frame(&sock, &mut frame).unwrap().unwrap();
        assert!(fd.is_none());
        let (request_id, conn_id) = match Message::decode(&frame).unwrap() {
            Some(Message::Close {
                request_id,
                conn_id,
            }) => (request_id, conn_id),
            other => panic!("expected CLOSE, got {other:?}"),
        };
        assert_eq!(conn_id, 4242);
        send_reply(
            &sock,
            &Reply {
                request_id,
                conn_id,
                status: Status::Ok,
            },
        )
        .unwrap();
        // A relayed connection: its CLOSE is queued by the time its end reaches the relay.
        let (mut relay, handed) = UnixStream::pair().unwrap();
        let relayed = ConnInfo {
            conn_id: 4343,
            plane: Plane::UserRelay,
            ..info.clone()
        };
        send_connection(&sock, handed.as_fd(), &relayed).unwrap();
        drop(handed);
        let mut answer = Vec::new();
        relay.read_to_end(&mut answer).unwrap();
        sock.set_nonblocking(true).unwrap();
        let queued = matches!(read_frame(&sock, &mut frame), Ok(Some(_)));
        sock.set_nonblocking(false).unwrap();
        assert!(
            queued
                && matches!(
                    Message::decode(&frame),
                    Ok(Some(Message::Close { conn_id: 4343, .. }))
                ),
            "no CLOSE queued when the relayed connection ended"
        );
        assert_eq!(answer, b"relayed");
        // A header with an unknown plane, its descriptor attached: refused with EPROTO.
        let (_c2, s2) = {
            let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
            (c, l.accept().unwrap().0)
        };
        let mut bad = vec![0u8; 1024];
        let n = Message::Connection(ConnInfo {
            conn_id: 1,
            plane: Plane::RawTcp,
            tls_version: 0,
            cipher_suite: 0,
            peer: None,
            local: None,
            server_name: None,
            alpn: None,
        })
        .encode(&mut bad)
        .unwrap();
        bad[16] = 0;
        tlsplane_sys::send_with_fd(sock.as_fd(), &bad[..n], s2.as_fd()).unwrap();
        drop(sock); // then tlsplane goes away
    });

    let out = Command::new(&exe).arg(&path).output().unwrap();
    fake.join().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let expect = [
        "size_ok=1".to_string(),
        "connect_missing=ENOENT".into(),
        "conn_id=4242 plane=1 version=0304 suite=1303".into(),
        "sni=c.example sni_len=9 alpn=http/1.1".into(),
        format!("peer=127.0.0.1:{} family=4 local_family=4", peer.port()),
        format!("data={}", String::from_utf8_lossy(&payload)),
        "short_read=EINVAL".into(),
        "close=0".into(),
        "read_after_close=EBADF".into(),
        "close_unknown=EBADF".into(),
        "plane=2 close=0".into(),
        "accept_bad=EPROTO".into(),
        "accept_gone=ECONNRESET".into(),
        "fds_leaked=0".into(),
    ];
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines, expect, "{stdout}");

    // What the C program wrote reached the TLS client, then its close.
    let mut reply = Vec::new();
    tls_client.read_to_end(&mut reply).unwrap();
    assert_eq!(reply, b"pong");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// tlsplane_connect refuses another user listening at the path (EPERM, and says why on
/// stderr) unless TLSPLANE_HANDOFF_UID names it; tlsplane_connect_uids decides by its own
/// list; a malformed variable is EINVAL.
#[test]
fn the_c_library_refuses_another_user_at_the_path_unless_trusted() {
    let Some(imp) = Impostor::start("c", "") else {
        return;
    };
    let exe = compile(imp.dir(), "trust");
    let run = |uid_env: Option<&str>, arg: Option<&str>| {
        let mut cmd = Command::new(&exe);
        cmd.arg(&imp.path)
            .args(arg)
            .env_remove("TLSPLANE_HANDOFF_UID");
        if let Some(v) = uid_env {
            cmd.env("TLSPLANE_HANDOFF_UID", v);
        }
        let out = cmd.output().unwrap();
        (
            String::from_utf8_lossy(&out.stdout).trim().to_string(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let accepted = "accepted forged.example 203.0.113.7:4242";
    let (out, err) = run(None, None);
    assert_eq!(out, "refused EPERM", "{err}");
    let said = format!(
        "tlsplane: refusing the hand-off socket {}: it is served by uid 65534, not root",
        imp.path.display()
    );
    assert!(err.contains(&said), "{err}");
    assert_eq!(run(Some("1000,65533"), None).0, "refused EPERM");
    assert_eq!(run(Some("65534"), None).0, accepted);
    let (out, err) = run(Some("65534 "), None);
    assert_eq!(out, "refused EINVAL");
    assert!(err.contains("TLSPLANE_HANDOFF_UID=\"65534 \""), "{err}");
    assert_eq!(run(None, Some("65534")).0, accepted);
    // The argument, not the variable, decides.
    assert_eq!(run(Some("65534"), Some("1000")).0, "refused EPERM");
}
