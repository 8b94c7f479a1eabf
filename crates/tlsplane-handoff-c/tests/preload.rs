//! Builds the LD_PRELOAD shim (preload/tlsplane_preload.c) and tests/c/preload_frames.c with
//! `cc`, and runs the program under the shim against a fake tlsplane that sends what a real
//! one does not yet: a REPLY, a frame of an unknown kind with a descriptor, a CONNECTION with
//! a bad body, an IPv6 peer, then goes away. The shim must stay in step with the frames, close
//! the descriptors it drops, and report the end (tlsplane-cli's e2e `handoff_preload` tests
//! run it behind the real `tlsplane handoff`). And with no tlsplane there, `listen` fails.
//!
//! Kernel plane (1): the fake hands over a plain TCP socket as plane 1 (tests/c/kernel_frames.c):
//! reads and writes pass through, closing (or shutdown(SHUT_WR)) sends exactly one CLOSE,
//! a relay connection too, all after the shim's HELLO (ENDS_WITH_CLOSE). No kTLS natively, so tests/c/fake_ktls.c, preloaded after the
//! shim, plays a kTLS socket's records for tests/c/kernel_echo.c (the program the kTLS guest
//! runs): a KeyUpdate goes to tlsplane as KEY_UPDATE, close_notify is end of stream, another
//! alert ECONNRESET, a stray record EPROTO.

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tlsplane_handoff::wire::Message;
use tlsplane_handoff::{send_connection, send_reply, ConnInfo, Plane, Reply, Status};

#[path = "../../tlsplane-handoff/tests/common/impostor.rs"]
mod impostor;
use impostor::Impostor;

fn compile(args: &[&str], src: &Path, out: &Path) {
    let res = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .args(["-O2", "-Wall", "-Wextra", "-Werror"])
        .args(args)
        .arg("-o")
        .arg(out)
        .arg(src)
        .args(["-ldl", "-pthread"])
        .output()
        .expect("a C compiler (cc)");
    assert!(
        res.status.success(),
        "cc {}:\n{}",
        src.display(),
        String::from_utf8_lossy(&res.stderr)
    );
}

fn info(conn_id: u64, peer: &str) -> ConnInfo {
    ConnInfo {
        conn_id,
        plane: Plane::UserRelay,
        tls_version: 0x0304,
        cipher_suite: 0x1301,
        peer: Some(peer.parse().unwrap()),
        local: Some("127.0.0.1:8443".parse().unwrap()),
        server_name: Some("preload.example".into()),
        alpn: None,
    }
}

/// A "connection": one end of a socketpair with `byte` waiting to be read on it, and the
/// other end, which the fake keeps.
fn conn(byte: u8) -> (UnixStream, UnixStream) {
    let (mut ours, theirs) = UnixStream::pair().unwrap();
    ours.write_all(&[byte]).unwrap();
    (ours, theirs)
}

/// A scratch directory named for the test, with the shim and the program (tests/c/PROG.c)
/// built in it: (dir, shim, program).
fn build(test: &str, prog: &str) -> (PathBuf, PathBuf, PathBuf) {
    let crate_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let dir = std::env::temp_dir().join(format!("tlsplane-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let shim = dir.join("libtlsplane_preload.so");
    compile(
        &["-shared", "-fPIC"],
        &crate_dir.join("preload/tlsplane_preload.c"),
        &shim,
    );
    let exe = dir.join(prog);
    compile(
        &["-std=c99"],
        &crate_dir.join(format!("tests/c/{prog}.c")),
        &exe,
    );
    (dir, shim, exe)
}

/// A port nothing listens on: the program binds it, the shim takes the socket over.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn listen_fails_loudly_when_tlsplane_is_not_there() {
    let (dir, shim, exe) = build("preload-missing", "preload_frames");
    let port = free_port();
    let out = Command::new(&exe)
        .arg(port.to_string())
        .env("LD_PRELOAD", &shim)
        .env("TLSPLANE_HANDOFF", dir.join("nobody.sock"))
        .env("TLSPLANE_LISTEN", format!("127.0.0.1:{port}"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    // listen fails with connect's errno: the port is not served in plain text instead.
    assert_eq!(stdout, "listen: No such file or directory\n", "{stderr}");
    assert!(
        stderr.contains("tlsplane-preload: cannot connect to TLSPLANE_HANDOFF"),
        "{stderr}"
    );
    assert_eq!(out.status.code(), Some(1));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_preload_shim_stays_in_step_with_frames_and_drops_what_it_cannot_use() {
    let (dir, shim, exe) = build("preload-frames", "preload_frames");
    let path = dir.join("handoff.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let port = free_port();

    let fake = std::thread::spawn(move || {
        // Bounded: without the shim nobody connects (the test then fails, it does not hang).
        listener.set_nonblocking(true).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let sock = loop {
            match listener.accept() {
                Ok((sock, _)) => break sock,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() > deadline {
                        return None;
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => panic!("accept: {e}"),
            }
        };
        sock.set_nonblocking(false).unwrap();
        let mut kept = Vec::new();
        // A REPLY (to a request nobody made here): skipped whole.
        send_reply(
            &sock,
            &Reply {
                request_id: 7,
                conn_id: 1,
                status: Status::Ok,
            },
        )
        .unwrap();
        let (a, a_theirs) = conn(b'A');
        send_connection(&sock, a_theirs.as_fd(), &info(1, "10.1.2.3:4444")).unwrap();
        kept.push(a);
        // A kind this reader does not know, longer than the prefix, with a descriptor: the
        // frame skipped, the descriptor closed.
        let (x, x_theirs) = conn(b'X');
        let mut unknown = b"TLPH\x01\x09\x00\x0c".to_vec();
        unknown.extend_from_slice(&[1, 2, 3, 4]);
        tlsplane_sys::send_with_fd(sock.as_fd(), &unknown, x_theirs.as_fd()).unwrap();
        kept.push(x);
        // A CONNECTION with an unknown plane: that connection dropped, the stream read on.
        let (b, b_theirs) = conn(b'B');
        let mut bad = vec![0u8; 1024];
        let n = Message::Connection(info(2, "10.9.9.9:9"))
            .encode(&mut bad)
            .unwrap();
        bad[16] = 0;
        tlsplane_sys::send_with_fd(sock.as_fd(), &bad[..n], b_theirs.as_fd()).unwrap();
        kept.push(b);
        let (c, c_theirs) = conn(b'C');
        send_connection(&sock, c_theirs.as_fd(), &info(3, "[2001:db8::1]:5555")).unwrap();
        kept.push(c);
        drop((a_theirs, x_theirs, b_theirs, c_theirs));
        drop(sock); // then tlsplane goes away
        Some(kept)
    });

    let mut child = Command::new(&exe)
        .arg(port.to_string())
        .env("LD_PRELOAD", &shim)
        .env("TLSPLANE_HANDOFF", &path)
        .env("TLSPLANE_LISTEN", port.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let kept = fake.join().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while kept.is_some() && child.try_wait().unwrap().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    assert!(
        kept.is_some(),
        "the program did not connect to the hand-off socket"
    );
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{stdout}{stderr}");
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(
        lines,
        [
            "peer=10.1.2.3 port=4444 data=A",
            // The program's socket is IPv4; an IPv6 peer still comes as itself.
            "peer=2001:db8::1 port=5555 data=C",
            "end=ECONNABORTED",
            "after=EAGAIN",
            "leaked=0",
        ],
        "{stdout}{stderr}"
    );
    assert!(
        stderr.contains("tlsplane-preload: the hand-off connection is closed"),
        "{stderr}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Reads one frame the program sent on the hand-off connection; None at end of stream or
/// when nothing comes within the read timeout.
fn next_frame(sock: &mut UnixStream) -> Option<Vec<u8>> {
    let mut f = vec![0u8; 8];
    sock.read_exact(&mut f).ok()?;
    let len = usize::from(u16::from_be_bytes([f[6], f[7]])).max(8);
    f.resize(len, 0);
    sock.read_exact(&mut f[8..]).ok()?;
    Some(f)
}

fn describe(frame: Option<Vec<u8>>) -> String {
    let Some(f) = frame else {
        return "no frame".into();
    };
    match Message::decode(&f) {
        Ok(Some(Message::Close { conn_id, .. })) => format!("CLOSE {conn_id:#x}"),
        Ok(Some(Message::Hello { flags })) => format!("HELLO {flags:#x}"),
        Ok(Some(Message::KeyUpdate {
            conn_id,
            record_plaintext,
            ..
        })) => format!("KEY_UPDATE {conn_id:#x} {record_plaintext:?}"),
        other => format!("frame {other:?}"),
    }
}

/// A connected TCP pair on loopback: (the client's end, the server's end).
fn tcp_pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let client = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (server, _) = l.accept().unwrap();
    (client, server)
}

/// Writes `line` to the program and reads as many bytes back: whether they are the same.
fn echoes(peer: &mut (impl Read + Write), line: &[u8]) -> bool {
    peer.write_all(line).unwrap();
    let mut back = vec![0u8; line.len()];
    peer.read_exact(&mut back).is_ok() && back == line
}

/// What a read on the client's end gives within the timeout.
fn peer_read(peer: &mut impl Read) -> String {
    let mut b = [0u8; 16];
    match peer.read(&mut b) {
        Ok(0) => "end of stream".into(),
        Ok(n) => format!("{n} bytes"),
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
            "nothing".into()
        }
        Err(e) => format!("error {e}"),
    }
}

#[test]
fn the_preload_shim_sends_close_for_kernel_plane_connections_and_reads_pass_through() {
    let (dir, shim, exe) = build("preload-kernel", "kernel_frames");
    let path = dir.join("handoff.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let port = free_port();

    let fake = std::thread::spawn(move || {
        let mut seen = Vec::new();
        listener.set_nonblocking(true).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut sock = loop {
            match listener.accept() {
                Ok((sock, _)) => break sock,
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if Instant::now() > deadline {
                        seen.push("nobody connected".to_string());
                        return seen;
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => panic!("accept: {e}"),
            }
        };
        sock.set_nonblocking(false).unwrap();
        // Bounded: a shim that sends nothing makes the test fail, not hang.
        sock.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let timeout = Some(Duration::from_secs(3));
        // 0. The shim's first frame: its promise to end every connection with a CLOSE.
        seen.push(describe(next_frame(&mut sock)));

        // 1. Kernel plane, here a plain TCP socket (no kTLS, so no control record): the
        // program's reads and writes pass through byte-exact, and its close sends CLOSE.
        let (mut peer, server) = tcp_pair();
        peer.set_read_timeout(timeout).unwrap();
        let mut k = info(0x1122_3344_5566_7788, "10.1.2.3:4444");
        k.plane = Plane::Kernel;
        send_connection(&sock, server.as_fd(), &k).unwrap();
        drop(server);
        let mut line: Vec<u8> = (0..2999u32)
            .map(|i| match (i * 7 + 13) % 256 {
                10 => 11,
                b => b as u8,
            })
            .collect();
        line.push(b'\n');
        seen.push(format!("kernel echo exact: {}", echoes(&mut peer, &line)));
        seen.push(describe(next_frame(&mut sock)));
        seen.push(format!("kernel peer: {}", peer_read(&mut peer)));

        // 2. User relay plane: the same, and its CLOSE (tlsplane relays close_notify after
        // what the program wrote; without it the client would get a reset).
        let (mut relay, relay_theirs) = UnixStream::pair().unwrap();
        relay.set_read_timeout(timeout).unwrap();
        send_connection(&sock, relay_theirs.as_fd(), &info(2, "10.1.2.3:4445")).unwrap();
        drop(relay_theirs);
        seen.push(format!(
            "relay echo exact: {}",
            echoes(&mut relay, b"relay plane\n")
        ));
        seen.push(describe(next_frame(&mut sock)));
        seen.push(format!("relay peer: {}", peer_read(&mut relay)));

        // 3. Kernel plane, shutdown(SHUT_WR): CLOSE at once and no FIN (it would come before
        // tlsplane's close_notify); the program's close afterwards sends no second CLOSE.
        let (mut peer, server) = tcp_pair();
        let mut k = info(3, "10.1.2.3:4446");
        k.plane = Plane::Kernel;
        send_connection(&sock, server.as_fd(), &k).unwrap();
        drop(server);
        peer.set_read_timeout(timeout).unwrap();
        seen.push(format!("shut echo exact: {}", echoes(&mut peer, b"shut\n")));
        seen.push(describe(next_frame(&mut sock)));
        peer.set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        seen.push(format!("after shutdown, peer: {}", peer_read(&mut peer)));
        peer.shutdown(std::net::Shutdown::Write).unwrap();
        peer.set_read_timeout(timeout).unwrap();
        seen.push(format!("after close, peer: {}", peer_read(&mut peer)));

        // 4. Kernel plane, dup2 of another file onto the descriptor closes the connection:
        // CLOSE then (the program holds the descriptor, now /dev/null, open to the end).
        let (mut peer, server) = tcp_pair();
        let mut k = info(4, "10.1.2.3:4447");
        k.plane = Plane::Kernel;
        send_connection(&sock, server.as_fd(), &k).unwrap();
        drop(server);
        peer.set_read_timeout(timeout).unwrap();
        seen.push(format!("dup2 echo exact: {}", echoes(&mut peer, b"dup2\n")));
        seen.push(describe(next_frame(&mut sock)));
        seen.push(format!("after dup2, peer: {}", peer_read(&mut peer)));

        // Then tlsplane goes away; whatever else the program sends is read to its end.
        sock.shutdown(std::net::Shutdown::Write).unwrap();
        while let Some(f) = next_frame(&mut sock) {
            seen.push(describe(Some(f)));
        }
        seen.push("hand-off end".into());
        seen
    });

    let mut child = Command::new(&exe)
        .arg(port.to_string())
        .env("LD_PRELOAD", &shim)
        .env("TLSPLANE_HANDOFF", &path)
        .env("TLSPLANE_LISTEN", port.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let seen = fake.join().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while child.try_wait().unwrap().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(
        seen,
        [
            "HELLO 0x1",
            "kernel echo exact: true",
            "CLOSE 0x1122334455667788",
            "kernel peer: end of stream",
            "relay echo exact: true",
            "CLOSE 0x2",
            "relay peer: end of stream",
            "shut echo exact: true",
            "CLOSE 0x3",
            "after shutdown, peer: nothing",
            "after close, peer: end of stream",
            "dup2 echo exact: true",
            "CLOSE 0x4",
            "after dup2, peer: end of stream",
            // Nothing more: no CLOSE twice.
            "hand-off end",
        ],
        "{stdout}{stderr}"
    );
    assert!(out.status.success(), "{stdout}{stderr}");
    assert_eq!(
        stdout.lines().collect::<Vec<_>>(),
        [
            "line bytes=3000",
            "line bytes=12",
            "shutdown=0 then read=0",
            "line bytes=5",
            "dup2=1",
            "line bytes=5",
            "end=ECONNABORTED",
            "leaked=0",
        ],
        "{stdout}{stderr}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A record as tests/c/fake_ktls.c reads it off a TCP stream: type, 2-byte length, payload.
fn record(ty: u8, payload: &[u8]) -> Vec<u8> {
    let mut r = vec![ty];
    r.extend_from_slice(&u16::try_from(payload.len()).unwrap().to_be_bytes());
    r.extend_from_slice(payload);
    r
}

/// What the program sent for one connection, in order, and what its peer saw at the end.
fn kernel_conn(
    sock: &mut UnixStream,
    conn_id: u64,
    records: &[Vec<u8>],
    echo: &[u8],
) -> Vec<String> {
    let (mut peer, server) = tcp_pair();
    peer.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let mut k = info(conn_id, "10.1.2.3:4444");
    k.plane = Plane::Kernel;
    send_connection(&*sock, server.as_fd(), &k).unwrap();
    drop(server);
    // (A program that stops reading may reset the connection: the echo then tells.)
    let _ = peer.write_all(&records.concat());
    let mut back = vec![0u8; echo.len()];
    let mut seen = vec![format!(
        "{conn_id:#x} echo exact: {}",
        peer.read_exact(&mut back).is_ok() && back == echo
    )];
    // The frames this connection caused, up to its CLOSE (or none within the timeout).
    loop {
        let f = next_frame(sock);
        let last = f.is_none() || describe(f.clone()).starts_with("CLOSE");
        seen.push(describe(f));
        if last {
            break;
        }
    }
    seen.push(format!("{conn_id:#x} peer: {}", peer_read(&mut peer)));
    seen
}

#[test]
fn the_preload_shim_handles_control_records_of_a_kernel_plane_connection() {
    // No kTLS natively: tests/c/fake_ktls.c, preloaded after the shim, plays the kTLS
    // socket's receive side (EIO at a control record, recvmsg with the record type,
    // EKEYEXPIRED after a KeyUpdate) over records the test writes on a plain TCP socket.
    let (dir, shim, exe) = build("preload-records", "kernel_echo");
    let crate_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let fake_ktls = dir.join("libfake_ktls.so");
    compile(
        &["-shared", "-fPIC"],
        &crate_dir.join("tests/c/fake_ktls.c"),
        &fake_ktls,
    );
    let path = dir.join("handoff.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let port = free_port();

    let fake = std::thread::spawn(move || {
        listener.set_nonblocking(true).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut sock = loop {
            match listener.accept() {
                Ok((sock, _)) => break sock,
                Err(e) if e.kind() == ErrorKind::WouldBlock && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => return vec![format!("nobody connected: {e}")],
            }
        };
        sock.set_nonblocking(false).unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let hello = describe(next_frame(&mut sock));
        if hello != "HELLO 0x1" {
            return vec![format!("first frame: {hello}")];
        }
        let key_update = [24u8, 0, 0, 1, 1]; // KeyUpdate, update_requested
        let mut seen = kernel_conn(
            &mut sock,
            0xa1,
            &[
                record(23, b"hello "),
                record(22, &key_update),
                record(23, b"world\n"),
                record(21, &[1, 0]), // close_notify
            ],
            b"hello world\n",
        );
        let alert = [record(23, b"x"), record(21, &[2, 40])]; // handshake_failure
        seen.extend(kernel_conn(&mut sock, 0xb2, &alert, b"x"));
        let ccs = [record(20, &[1])]; // change_cipher_spec: no business here
        seen.extend(kernel_conn(&mut sock, 0xc3, &ccs, b""));

        // tlsplane goes away while a connection is open: a KeyUpdate then has nobody to
        // re-key it, and the read fails at once (ECONNRESET), not after the 5 s bound.
        let (mut peer, server) = tcp_pair();
        peer.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let mut k = info(0xd4, "10.1.2.3:4444");
        k.plane = Plane::Kernel;
        send_connection(&sock, server.as_fd(), &k).unwrap();
        drop(server);
        peer.write_all(&record(23, b"a")).unwrap();
        let mut back = [0u8; 1];
        let echoed = peer.read_exact(&mut back).is_ok() && back == *b"a";
        seen.push(format!("0xd4 echo exact: {echoed}"));
        sock.set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        seen.push(describe(next_frame(&mut sock))); // nothing stray before
        sock.shutdown(std::net::Shutdown::Both).unwrap();
        let started = Instant::now();
        let _ = peer.write_all(&record(22, &key_update));
        seen.push(format!("0xd4 peer: {}", peer_read(&mut peer)));
        seen.push(format!(
            "within 2 s: {}",
            started.elapsed() < Duration::from_secs(2)
        ));
        seen
    });

    let mut child = Command::new(&exe)
        .arg(port.to_string())
        .env(
            "LD_PRELOAD",
            format!("{} {}", shim.display(), fake_ktls.display()),
        )
        .env("TLSPLANE_HANDOFF", &path)
        .env("TLSPLANE_LISTEN", port.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let seen = fake.join().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while child.try_wait().unwrap().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(
        seen,
        [
            "0xa1 echo exact: true",
            "KEY_UPDATE 0xa1 [24, 0, 0, 1, 1]",
            "CLOSE 0xa1",
            "0xa1 peer: end of stream",
            "0xb2 echo exact: true",
            "CLOSE 0xb2",
            "0xb2 peer: end of stream",
            "0xc3 echo exact: true",
            "CLOSE 0xc3",
            "0xc3 peer: end of stream",
            "0xd4 echo exact: true",
            "no frame",
            "0xd4 peer: end of stream",
            "within 2 s: true",
        ],
        "{stderr}"
    );
    assert!(out.status.success(), "{stderr}");
    let conns: Vec<&str> = stderr
        .lines()
        .filter(|l| !l.starts_with("tlsplane-preload:"))
        .collect();
    assert_eq!(
        conns,
        [
            "conn bytes=12 end=eof",
            "conn bytes=1 end=ECONNRESET",
            "conn bytes=0 end=EPROTO",
            "conn bytes=1 end=ECONNRESET",
            "accept: ECONNABORTED",
        ],
        "{stderr}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The shim's hand-off connection, once the program under it connects (10 s at most), past
/// its first frame, which must be a HELLO with ENDS_WITH_CLOSE.
fn accept_within(listener: &UnixListener) -> Option<UnixStream> {
    listener.set_nonblocking(true).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match listener.accept() {
            Ok((mut sock, _)) => {
                sock.set_nonblocking(false).unwrap();
                sock.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                assert_eq!(describe(next_frame(&mut sock)), "HELLO 0x1");
                sock.set_read_timeout(None).unwrap();
                return Some(sock);
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(_) => return None,
        }
    }
}

/// Bytes to echo, different per connection.
fn payload(seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let len = 1000 + (x % 30_000) as usize;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A threaded server under the shim (tests/c/shim_servers.c, 8 threads in accept) serves 200
/// kernel-plane connections from 8 clients at once, byte-exact, each closed with exactly one
/// CLOSE, while: a thread forks 200 children that close the listening socket (none may hang
/// on a lock another thread held at the fork); another hammers getsockname and close; and the
/// fake stops reading the hand-off connection for 0.8 s, so that the program's CLOSEs find no
/// room (they wait, 2 s at most): an unrelated close() meanwhile must not wait behind them.
#[test]
fn a_threaded_server_that_forks_is_served_without_deadlock_or_waiting_behind_a_send() {
    let (dir, shim, exe) = build("preload-threads", "shim_servers");
    let path = dir.join("handoff.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let port = free_port();
    let mut child = Command::new(&exe)
        .args([&port.to_string(), "threads", "8"])
        .env("LD_PRELOAD", &shim)
        .env("TLSPLANE_HANDOFF", &path)
        .env("TLSPLANE_LISTEN", port.to_string())
        .env("SHIM_STRESS", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let sock = accept_within(&listener).expect("the program did not connect");
    let sender = std::sync::Mutex::new(sock.try_clone().unwrap());
    let pause = std::sync::atomic::AtomicBool::new(false);
    let done = std::sync::atomic::AtomicUsize::new(0);
    const CONNS: u64 = 200;
    let (closes, echoed) = std::thread::scope(|s| {
        let reader = s.spawn(|| {
            let mut sock = sock;
            sock.set_read_timeout(Some(Duration::from_secs(10)))
                .unwrap();
            let mut closes = Vec::new();
            while (closes.len() as u64) < CONNS {
                if pause.swap(false, std::sync::atomic::Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(800));
                }
                match describe(next_frame(&mut sock)).strip_prefix("CLOSE ") {
                    Some(id) => closes.push(id.to_string()),
                    None => break,
                }
            }
            closes
        });
        let clients: Vec<_> = (0..8u64)
            .map(|c| {
                let (sender, pause, done) = (&sender, &pause, &done);
                s.spawn(move || {
                    let mut exact = 0;
                    for i in 0..CONNS / 8 {
                        let id = c * 1000 + i;
                        let (mut peer, server) = tcp_pair();
                        peer.set_read_timeout(Some(Duration::from_secs(10)))
                            .unwrap();
                        let mut k = info(id, "10.1.2.3:4444");
                        k.plane = Plane::Kernel;
                        send_connection(&sender.lock().unwrap(), server.as_fd(), &k).unwrap();
                        drop(server);
                        let body = payload(id);
                        peer.write_all(&body).unwrap();
                        peer.shutdown(std::net::Shutdown::Write).unwrap();
                        let mut back = Vec::new();
                        let _ = peer.read_to_end(&mut back);
                        exact += usize::from(back == body);
                        if done.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 60 {
                            pause.store(true, std::sync::atomic::Ordering::SeqCst);
                        }
                    }
                    exact
                })
            })
            .collect();
        let echoed: usize = clients.into_iter().map(|c| c.join().unwrap()).sum();
        (reader.join().unwrap(), echoed)
    });
    drop(child.stdin.take()); // the program reports and exits
    let deadline = Instant::now() + Duration::from_secs(10);
    while child.try_wait().unwrap().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(echoed, CONNS as usize, "echoes not exact; {stdout}{stderr}");
    let mut sorted = closes.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(
        (closes.len(), sorted.len()),
        (CONNS as usize, CONNS as usize),
        "one CLOSE per connection: {closes:?}\n{stderr}"
    );
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.first(), Some(&"listening"), "{stdout}{stderr}");
    assert_eq!(lines.get(1), Some(&"served=200"), "{stdout}{stderr}");
    let stress = lines.get(2).copied().unwrap_or_default();
    assert!(
        stress.starts_with("forks=200 hung=0 close_max_ms="),
        "{stdout}{stderr}"
    );
    let close_max_ms: u64 = stress.rsplit('=').next().unwrap().parse().unwrap();
    assert!(
        close_max_ms < 400,
        "an unrelated close() waited {close_max_ms} ms\n{stderr}"
    );
    assert_eq!(lines.get(3), Some(&"done"), "{stdout}{stderr}");
    std::fs::remove_dir_all(&dir).unwrap();
}

fn unhex(hex: &str) -> Vec<u8> {
    (0..hex.len() / 2)
        .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap())
        .collect()
}

/// What the impostor's connections got back, as they come, for `limit`.
fn impostor_replies(imp: &Impostor, limit: Duration) -> Vec<Vec<u8>> {
    imp.conns(usize::MAX, limit)
        .iter()
        .map(|l| unhex(l.rsplit(' ').next().unwrap_or_default()))
        .collect()
}

/// An unmodified `python3 -m http.server` under the shim, as root, serving a file only root
/// may read. tlsplane goes away and another user binds the path: the shim keeps trying (every
/// 200 ms) but takes nothing from it, and says so once; the impostor never gets the file.
/// With that user already there, listen fails (EPERM). Trusting its uid
/// (TLSPLANE_HANDOFF_UID) lets its forged connection in and it gets the file: the check is
/// what decides.
#[test]
fn the_shim_never_takes_a_connection_from_another_user_at_the_path() {
    let Some(imp_dir) = Impostor::make_dir("shim") else {
        return;
    };
    let (dir, shim, frames) = build("preload-impostor", "preload_frames");
    let www = dir.join("www");
    std::fs::create_dir_all(&www).unwrap();
    std::fs::write(www.join("public.txt"), "served to anyone\n").unwrap();
    let secret = www.join("secret.txt");
    std::fs::write(&secret, "only root may read this\n").unwrap();
    std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let path = imp_dir.join("handoff.sock");
    let http_server = |uid_env: Option<&str>, err: &Path| {
        let port = free_port();
        let mut cmd = Command::new("python3");
        cmd.args([
            "-m",
            "http.server",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
        ])
        .current_dir(&www)
        .env("LD_PRELOAD", &shim)
        .env("TLSPLANE_HANDOFF", &path)
        .env("TLSPLANE_LISTEN", format!("127.0.0.1:{port}"))
        .env_remove("TLSPLANE_HANDOFF_UID")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(err).unwrap());
        if let Some(v) = uid_env {
            cmd.env("TLSPLANE_HANDOFF_UID", v);
        }
        cmd.spawn().expect("python3")
    };

    // tlsplane (this test, as root) hands over one request, then goes away.
    let listener = UnixListener::bind(&path).unwrap();
    let err_a = dir.join("http-a.err");
    let mut py = http_server(None, &err_a);
    let sock = accept_within(&listener).expect("http.server did not connect");
    let (mut ours, theirs) = UnixStream::pair().unwrap();
    send_connection(&sock, theirs.as_fd(), &info(1, "10.1.2.3:4444")).unwrap();
    drop(theirs);
    ours.write_all(b"GET /public.txt HTTP/1.0\r\n\r\n").unwrap();
    let mut reply = Vec::new();
    ours.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let _ = ours.read_to_end(&mut reply);
    let reply = String::from_utf8_lossy(&reply).into_owned();
    assert!(reply.ends_with("served to anyone\n"), "{reply}");
    drop((sock, listener));
    std::fs::remove_file(&path).unwrap();

    let imp = Impostor::start_in(imp_dir, "GET /secret.txt HTTP/1.0\r\n\r\n").unwrap();
    let replies = impostor_replies(&imp, Duration::from_millis(1500));
    let _ = py.kill();
    let _ = py.wait();
    let err = std::fs::read_to_string(&err_a).unwrap();
    assert!(
        replies.len() >= 3,
        "the shim stopped trying: {replies:?}\n{err}"
    );
    assert!(
        replies.iter().all(Vec::is_empty),
        "the impostor was answered: {:?}\n{err}",
        replies
            .iter()
            .map(|r| String::from_utf8_lossy(r).into_owned())
            .collect::<Vec<_>>()
    );
    let refusal = format!(
        "tlsplane-preload: refusing the hand-off socket {}: it is served by uid 65534, not root",
        path.display()
    );
    assert_eq!(
        err.matches(&refusal).count(),
        1,
        "logged once per 10 s:\n{err}"
    );
    assert!(!err.contains("reconnected"), "{err}");

    // Another user there at listen: refused; a malformed list of ids fails the listen too.
    let listen_with = |uid_env: Option<&str>| {
        let port = free_port();
        let mut cmd = Command::new(&frames);
        cmd.arg(port.to_string())
            .env("LD_PRELOAD", &shim)
            .env("TLSPLANE_HANDOFF", &path)
            .env("TLSPLANE_LISTEN", port.to_string())
            .env_remove("TLSPLANE_HANDOFF_UID");
        if let Some(v) = uid_env {
            cmd.env("TLSPLANE_HANDOFF_UID", v);
        }
        let out = cmd.output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        (stdout, String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (stdout, stderr) = listen_with(None);
    assert_eq!(stdout, "listen: Operation not permitted\n", "{stderr}");
    assert!(stderr.contains(&refusal), "{stderr}");
    let (stdout, stderr) = listen_with(Some("1000,"));
    assert_eq!(stdout, "listen: Invalid argument\n", "{stderr}");
    assert!(
        stderr.contains("TLSPLANE_HANDOFF_UID: expected"),
        "{stderr}"
    );

    // Trusted, the same impostor is served the file.
    let err_b = dir.join("http-b.err");
    let mut py = http_server(Some("1000,65534"), &err_b);
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut served = None;
    while served.is_none() && Instant::now() < deadline {
        served = impostor_replies(&imp, Duration::from_millis(200))
            .into_iter()
            .find(|r| !r.is_empty());
    }
    let _ = py.kill();
    let _ = py.wait();
    let err = std::fs::read_to_string(&err_b).unwrap();
    let served = String::from_utf8_lossy(&served.unwrap_or_default()).into_owned();
    assert!(
        served.starts_with("HTTP/1.0 200") && served.ends_with("only root may read this\n"),
        "{served}\n{err}"
    );
    assert!(
        err.contains("203.0.113.7"),
        "the forged peer is logged:\n{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// An accept-then-fork server under the shim (tests/c/shim_servers.c forkper, the shape of
/// socketserver.ForkingMixIn): the parent closes its copy of each kernel-plane connection at
/// once while its child serves it. Its CLOSE (tlsplane's close_notify) must wait for the
/// child's close, not come with the parent's, which would cut the child's answer short. A child
/// killed mid-connection sends no CLOSE (tlsplane then resets the connection: a cut answer
/// must not look whole).
#[test]
fn a_fork_per_connection_server_sends_close_when_the_child_is_done() {
    fork_per_connection_server_closes("preload-forkper", None);
}

/// The same, after the server dropped root (setuid after listen, as daemons do): the process
/// is no longer dumpable, which is what made kcmp(2) fail with EPERM and the parent's close
/// send the CLOSE at once (every answer empty).
#[test]
fn a_fork_per_connection_server_that_dropped_root_sends_close_when_the_child_is_done() {
    fork_per_connection_server_closes("preload-forkper-nobody", Some("65534"));
}

/// The children of `pid` (/proc's list, its main thread's).
fn children_of(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

fn fork_per_connection_server_closes(test: &str, drop_uid: Option<&str>) {
    let (dir, shim, exe) = build(test, "shim_servers");
    let path = dir.join("handoff.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let port = free_port();
    let mut child = Command::new(&exe)
        .args([&port.to_string(), "forkper"])
        .env("LD_PRELOAD", &shim)
        .env("TLSPLANE_HANDOFF", &path)
        .env("TLSPLANE_LISTEN", port.to_string())
        .env("SHIM_DROP_UID", drop_uid.unwrap_or(""))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut sock = accept_within(&listener).expect("the program did not connect");
    let mut seen = Vec::new();
    for id in 1..=5u64 {
        let (mut peer, server) = tcp_pair();
        peer.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut k = info(id, "10.1.2.3:4444");
        k.plane = Plane::Kernel;
        send_connection(&sock, server.as_fd(), &k).unwrap();
        drop(server);
        let body = payload(id);
        seen.push(format!("{id} echo exact: {}", echoes(&mut peer, &body)));
        // The parent has long closed its copy; the child still serves.
        sock.set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        seen.push(format!(
            "{id} while served: {}",
            describe(next_frame(&mut sock))
        ));
        if id == 5 {
            // Killed mid-connection: no CLOSE, from the child or from the parent.
            for pid in children_of(child.id()) {
                let _ = Command::new("kill")
                    .args(["-KILL", &pid.to_string()])
                    .status();
            }
            seen.push(format!("{id} peer: {}", peer_read(&mut peer)));
            sock.set_read_timeout(Some(Duration::from_millis(1500)))
                .unwrap();
            seen.push(format!("{id} after: {}", describe(next_frame(&mut sock))));
            break;
        }
        peer.shutdown(std::net::Shutdown::Write).unwrap();
        seen.push(format!("{id} peer: {}", peer_read(&mut peer)));
        sock.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        seen.push(format!("{id} after: {}", describe(next_frame(&mut sock))));
    }
    drop(child.stdin.take());
    let deadline = Instant::now() + Duration::from_secs(10);
    while child.try_wait().unwrap().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let want: Vec<String> = (1..=5)
        .flat_map(|id| {
            [
                format!("{id} echo exact: true"),
                format!("{id} while served: no frame"),
                format!("{id} peer: end of stream"),
                if id == 5 {
                    format!("{id} after: no frame")
                } else {
                    format!("{id} after: CLOSE {id:#x}")
                },
            ]
        })
        .collect();
    assert_eq!(seen, want, "{stdout}{stderr}");
    assert_eq!(stdout, "listening\nserved=4\ndone\n", "{stderr}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A pre-fork server under the shim (tests/c/shim_servers.c prefork: 4 processes forked after
/// listen, each in a blocking accept on the shared socket). The fake sends each CONNECTION
/// frame in two pieces, 5 ms apart, as a stream may carry it: a process must take the whole
/// frame, or another one, waiting in its own accept, reads the tail as a frame of its own.
#[test]
fn a_pre_fork_server_takes_whole_frames_in_each_process() {
    let (dir, shim, exe) = build("preload-prefork", "shim_servers");
    let path = dir.join("handoff.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let port = free_port();
    let mut child = Command::new(&exe)
        .args([&port.to_string(), "prefork", "4"])
        .env("LD_PRELOAD", &shim)
        .env("TLSPLANE_HANDOFF", &path)
        .env("TLSPLANE_LISTEN", port.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let sock = accept_within(&listener).expect("the program did not connect");
    std::thread::sleep(Duration::from_millis(200)); // the processes are forked and accepting
    const CONNS: u64 = 40;
    let mut peers = Vec::new();
    for id in 1..=CONNS {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let mut frame = vec![0u8; 1024];
        let n = Message::Connection(info(id, "10.1.2.3:4444"))
            .encode(&mut frame)
            .unwrap();
        tlsplane_sys::send_with_fd(sock.as_fd(), &frame[..8], theirs.as_fd()).unwrap();
        std::thread::sleep(Duration::from_millis(5));
        (&sock).write_all(&frame[8..n]).unwrap();
        peers.push((id, ours));
    }
    let exact = std::thread::scope(|s| {
        let checks: Vec<_> = peers
            .iter_mut()
            .map(|(id, peer)| {
                s.spawn(move || {
                    peer.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
                    // A connection the program lost fails here: it counts as not echoed.
                    let line = format!("connection {id}\n");
                    let mut back = vec![0u8; line.len()];
                    let exact = peer.write_all(line.as_bytes()).is_ok()
                        && peer.read_exact(&mut back).is_ok()
                        && back == line.as_bytes();
                    // Its process is then free for the next connection.
                    let _ = peer.shutdown(std::net::Shutdown::Write);
                    exact && peer_read(peer) == "end of stream"
                })
            })
            .collect();
        checks
            .into_iter()
            .map(|c| c.join().unwrap())
            .filter(|&e| e)
            .count()
    });
    drop(child.stdin.take());
    let deadline = Instant::now() + Duration::from_secs(10);
    while child.try_wait().unwrap().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(exact, CONNS as usize, "{stdout}{stderr}");
    assert_eq!(stdout, "listening\nserved=40\ndone\n", "{stderr}");
    assert!(!stderr.contains("closed or broken"), "{stderr}");
    drop(sock);
    std::fs::remove_dir_all(&dir).unwrap();
}
