//! `tlsplane handoff`'s trust boundaries (issue 36): where its socket may live, who may
//! receive (supplementary groups too, refusals logged at a bounded rate, a reload that
//! removes an id ends the receivers it allowed, at most --handoff-max-receivers), and what a
//! client sees when the program holding its connection goes away without ending it: a
//! reset, never a clean close_notify (a receiver that promised a CLOSE for each connection,
//! HELLO's ENDS_WITH_CLOSE, and one that promised nothing).

use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tlsplane_handoff::wire::{self, Message};
use tlsplane_handoff::{ConnInfo, Plane, Reply, Status};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::handoff::{connect, have_python, runtime, scratch, wait_receivers};
use crate::support::client::{End, Tls, TlsClient};
use crate::support::fixtures::{pki, CertKind};
use crate::support::{kernel_only, kernel_rekeys, mode, tools, Mode, Server};

/// Set (to the hand-off socket's path) in the environment of this test binary run again as
/// a receiver ([`receiver_that_streams_until_killed`]).
const CHILD_SOCKET: &str = "TLSPLANE_TEST_HANDOFF_RECEIVER";

/// A receiver with no Python and no C compiler (the kernel-mode guest has neither): this
/// test binary again, running the ignored test below.
fn spawn_streaming_receiver(socket: &Path) -> Child {
    Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--ignored",
            "--exact",
            "handoff_trust::receiver_that_streams_until_killed",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_SOCKET, socket)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("the test binary as a receiver")
}

/// Run by [`spawn_streaming_receiver`] only: takes one connection, reads the request, and
/// writes a response that never ends, until it is killed.
#[test]
#[ignore = "a receiver process for a_receiver_killed_mid_response_leaves_its_client_a_reset"]
fn receiver_that_streams_until_killed() {
    let Some(socket) = std::env::var_os(CHILD_SOCKET) else {
        return;
    };
    let client = tlsplane_handoff::HandoffClient::connect(&socket).expect("connect");
    let conn = client.accept().expect("a connection");
    let mut buf = [0u8; 64];
    let n = client
        .read(std::os::fd::AsFd::as_fd(&conn), &conn.info, &mut buf)
        .expect("the request");
    assert!(n > 0);
    // Out of the library's hands: its end (the kill) is an abandonment, never a CLOSE.
    let mut out = std::fs::File::from(conn.into_parts().0);
    let chunk = vec![b'x'; 65536];
    loop {
        if out.write_all(&chunk).is_err() {
            std::process::exit(1);
        }
    }
}

#[test]
fn a_receiver_killed_mid_response_leaves_its_client_a_reset() {
    let dir = scratch("handoff-killed");
    let socket = dir.join("app.sock");
    let server = Server::builder().handoff(&socket).start();
    let mut rx = spawn_streaming_receiver(&socket);
    wait_receivers(&server, 1);
    let (got, end) = runtime().block_on(async {
        let mut c = connect(server.port(), &[]).await;
        c.write_all(b"GET /big\r\n").await.unwrap();
        c.flush().await.unwrap();
        let mut got = 0usize;
        let mut buf = vec![0u8; 65536];
        let mut killed = false;
        let end = loop {
            let r = tokio::time::timeout(Duration::from_secs(10), c.read(&mut buf)).await;
            match r.expect("no end within 10 s of the last bytes") {
                Ok(0) => break Ok(()),
                Ok(n) => got += n,
                Err(e) => break Err(e),
            }
            // Mid-response: the program is killed while it writes.
            if got >= 1 << 20 && !killed {
                rx.kill().expect("kill -9");
                killed = true;
            }
        };
        (got, end)
    });
    let _ = rx.wait();
    assert!(got >= 1 << 20, "got {got} bytes");
    let err = end.expect_err("the client saw a clean close_notify after a killed program");
    assert_eq!(
        err.kind(),
        std::io::ErrorKind::ConnectionReset,
        "expected a reset: {err}"
    );
    let stats = server.stop();
    let reset = match mode() {
        Mode::User => stats.get("handoff_relay_reset_receiver_gone"),
        Mode::Kernel => stats.get("handoff_kernel_released_receiver_gone"),
    };
    assert_eq!(reset, 1, "{stats:?}");
    assert_eq!(stats.get("handoff_receivers_lost"), 1, "{stats:?}");
    let _ = std::fs::remove_dir_all(dir);
}

/// Starts `tlsplane handoff` on `socket`; its output once it exits (it must, within 10 s).
fn start_expecting_failure(socket: &Path) -> tools::Output {
    let leaf = pki().leaf(CertKind::P256);
    let mut cmd = Command::new(crate::support::server_bin());
    cmd.arg("handoff")
        .arg("--handoff-socket")
        .arg(socket)
        .arg("--cert")
        .arg(&leaf.cert_pem)
        .arg("--key")
        .arg(&leaf.key_pem)
        .args(["--listen", "127.0.0.1:0", "--keyd", "off"]);
    tools::run(cmd, b"", Duration::from_secs(10))
}

#[test]
fn the_socket_lives_only_in_a_directory_no_other_user_can_write() {
    if !have_python() {
        return;
    }
    let dir = scratch("handoff-socket-dir");
    // A directory anyone can write, sticky (as /tmp) or not: refused, with the fix named.
    let shared = dir.join("shared");
    std::fs::create_dir(&shared).unwrap();
    for mode in [0o1777, 0o777] {
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(mode)).unwrap();
        let out = start_expecting_failure(&shared.join("app.sock"));
        assert!(!out.status.success(), "{}", out.describe());
        assert!(
            out.stderr_text()
                .contains("another user could replace the socket")
                && out.stderr_text().contains("/run/tlsplane"),
            "{}",
            out.describe()
        );
        assert!(!shared.join("app.sock").exists());
    }
    // A missing directory is created (755), the socket in it is 666: a user of another uid
    // whose allowed group is only a supplementary one connects and is served.
    let socket = dir.join("run/tlsplane/app.sock");
    let server = Server::builder()
        .handoff(&socket)
        .arg("--handoff-allow-gid")
        .arg("4242")
        .start();
    let meta = std::fs::metadata(socket.parent().unwrap()).unwrap();
    assert_eq!(meta.permissions().mode() & 0o7777, 0o755);
    let meta = std::fs::symlink_metadata(&socket).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o666);
    let as_nobody = |groups: &str| {
        let mut c = Command::new("setpriv");
        c.args(["--reuid=65534", "--regid=65534"]);
        match groups {
            "" => c.arg("--clear-groups"),
            g => c.arg(format!("--groups={g}")),
        };
        // (A python3 other users can run: root's own may not be.)
        c.env("PATH", "/usr/local/bin:/usr/bin:/bin");
        c.args(["python3", "-c"]).arg(format!(
            "import socket, time\ns = socket.socket(socket.AF_UNIX)\ns.connect({:?})\n\
             s.settimeout(1)\nprint(len(s.recv(1)))",
            socket.display().to_string()
        ));
        c
    };
    // Refused (only its own group, 65534): closed at once. Twenty of them log one line or two.
    for _ in 0..20 {
        let out = tools::run(as_nobody(""), b"", Duration::from_secs(10));
        assert!(out.status.success(), "{}", out.describe());
        assert_eq!(
            out.stdout_text().trim(),
            "0",
            "a refused receiver got bytes"
        );
    }
    // Allowed by its supplementary group 4242: kept open (its recv times out after 1 s).
    let out = tools::run(as_nobody("4242"), b"", Duration::from_secs(15));
    assert!(
        out.stderr_text().contains("timed out"),
        "the receiver in group 4242 was not kept: {}",
        out.describe()
    );
    wait_receivers(&server, 1);
    let refused_lines = server
        .stderr_lines()
        .iter()
        .filter(|l| l.contains("hand-off receiver refused"))
        .count();
    let stats = server.stop();
    assert_eq!(stats.get("handoff_receivers_refused"), 20, "{stats:?}");
    assert_eq!(stats.get("handoff_receivers_accepted"), 1, "{stats:?}");
    assert!(
        (1..=3).contains(&refused_lines),
        "{refused_lines} refusal lines for 20 refusals"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_reload_that_removes_a_uid_disconnects_its_receiver_and_resets_its_connections() {
    let dir = scratch("handoff-revoke");
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
    write(tlsplane_sys::current_uid());
    let server = Server::builder()
        .handoff(&socket)
        .config_file(&config)
        .arg("--pid-file")
        .arg(pid_file.to_str().unwrap())
        .start();
    let rx = std::os::unix::net::UnixStream::connect(&socket).unwrap();
    rx.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    wait_receivers(&server, 1);
    let rt = runtime();
    let mut client = rt.block_on(connect(server.port(), &[]));
    let mut frame = Vec::new();
    let (_, held) = tlsplane_handoff::read_frame(&rx, &mut frame)
        .expect("a CONNECTION frame")
        .expect("not the end");
    let held = held.expect("its descriptor");
    // The receiver's uid is no longer allowed.
    write(12345);
    let out = Command::new(crate::support::server_bin())
        .args(["reload", "--pid-file"])
        .arg(&pid_file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let started = Instant::now();
    match tlsplane_handoff::read_frame(&rx, &mut frame) {
        Ok(None) => {}
        other => panic!("the revoked receiver is still connected: {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(5));
    // The connection it holds is reset, though it still has its descriptor.
    let end = rt.block_on(async {
        let mut buf = [0u8; 64];
        tokio::time::timeout(Duration::from_secs(10), client.read(&mut buf))
            .await
            .expect("the held connection did not end")
    });
    let err = end.expect_err("the client saw a clean end of a connection nobody ended");
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset, "{err}");
    drop(held);
    let lines = server.stderr_lines();
    let stats = server.stop();
    assert_eq!(stats.get("handoff_receivers_revoked"), 1, "{stats:?}");
    assert!(
        lines.iter().any(|l| l.contains("no longer allows its ids")),
        "{lines:?}"
    );
    assert!(!lines.iter().any(|l| l.contains("panicked")));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_receiver_that_reads_no_replies_never_stalls_the_server() {
    let dir = scratch("handoff-replies");
    let socket = dir.join("app.sock");
    // (The default --handoff-reply-queue, 1024.)
    let server = Server::builder().handoff(&socket).start();
    let mut rx = std::os::unix::net::UnixStream::connect(&socket).unwrap();
    wait_receivers(&server, 1);
    // Requests that each get a reply, never read: far more than the socket buffers hold.
    // tlsplane must go on reading them (or let the receiver go), never stop reading because
    // its replies cannot be written.
    rx.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut frame = [0u8; 64];
    let n = tlsplane_handoff::Message::Close {
        request_id: 1,
        conn_id: 7,
    }
    .encode(&mut frame)
    .unwrap();
    let started = Instant::now();
    let mut sent = 0usize;
    let end = loop {
        match rx.write_all(&frame[..n]) {
            Ok(()) => sent += 1,
            Err(e) => break e,
        }
        if sent == 200_000 {
            panic!("200000 requests went through: were the replies read?");
        }
    };
    assert!(
        matches!(
            end.kind(),
            std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
        ),
        "the receiver's requests stalled after {sent} ({:?}): {end}",
        started.elapsed()
    );
    let lines = server.wait_lines("reads none of its replies", 1, Duration::from_secs(10));
    let stats = server.stop();
    assert_eq!(
        stats.get("handoff_receivers_reply_overflow"),
        1,
        "{stats:?}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.contains("reads none of its replies")),
        "{lines:?}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

// The end of a handed connection: a receiver's promise (HELLO, ENDS_WITH_CLOSE), and the
// judgement of one that promised nothing.

/// A receiver written frame by frame in the test (no library): it sends exactly what a test
/// needs, whatever the receivers' libraries do.
struct RawReceiver(UnixStream);

impl RawReceiver {
    /// Connects; with `hello`, sends a HELLO with those flags first.
    fn connect(socket: &Path, hello: Option<u32>) -> Self {
        let sock = UnixStream::connect(socket).expect("connect to the hand-off socket");
        sock.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let rx = Self(sock);
        if let Some(flags) = hello {
            rx.send(&Message::Hello { flags });
        }
        rx
    }

    fn send(&self, m: &Message<'_>) {
        let mut buf = [0u8; 128];
        let n = m.encode(&mut buf).unwrap();
        (&self.0).write_all(&buf[..n]).expect("a request");
    }

    fn close(&self, request_id: u32, conn_id: u64) {
        self.send(&Message::Close {
            request_id,
            conn_id,
        });
    }

    fn frame(&self) -> std::io::Result<Option<(Vec<u8>, Option<OwnedFd>)>> {
        let mut frame = Vec::new();
        Ok(tlsplane_handoff::read_frame(&self.0, &mut frame)?.map(|(_, fd)| (frame, fd)))
    }

    fn accept(&self) -> (OwnedFd, ConnInfo) {
        let (frame, fd) = self.frame().expect("a frame").expect("not the end");
        match Message::decode(&frame) {
            Ok(Some(Message::Connection(info))) => (fd.expect("its descriptor"), info),
            other => panic!("expected a CONNECTION, got {other:?}"),
        }
    }

    fn reply(&self) -> Reply {
        let (frame, _) = self.frame().expect("a frame").expect("not the end");
        match Message::decode(&frame) {
            Ok(Some(Message::Reply(r))) => r,
            other => panic!("expected a REPLY, got {other:?}"),
        }
    }

    /// Whether tlsplane ended the connection (replies before the end are skipped), within
    /// the read timeout.
    fn ended(&self) -> bool {
        loop {
            match self.frame() {
                Ok(None) => return true,
                Ok(Some(_)) => {}
                Err(e) => return e.kind() == std::io::ErrorKind::ConnectionReset,
            }
        }
    }
}

/// Writes `bytes` to a handed descriptor (a kTLS socket or a relay's end alike).
fn write_to(fd: OwnedFd, bytes: &[u8]) -> OwnedFd {
    let mut f = std::fs::File::from(fd);
    f.write_all(bytes)
        .expect("a write to the handed connection");
    OwnedFd::from(f)
}

fn is_reset(end: &End) -> bool {
    matches!(end, End::Io(std::io::ErrorKind::ConnectionReset, _))
}

#[test]
fn a_receiver_that_ends_with_close_has_every_end_without_one_reset() {
    let dir = scratch("handoff-ends-with-close");
    let socket = dir.join("app.sock");
    let server = Server::builder().handoff(&socket).start();
    let rx = RawReceiver::connect(&socket, Some(wire::ENDS_WITH_CLOSE));
    wait_receivers(&server, 1);
    let mut clients: Vec<TlsClient> = Vec::new();
    let mut held = Vec::new();
    for _ in 0..3 {
        clients.push(TlsClient::connect_version(server.port(), Tls::V13));
        let (fd, info) = rx.accept();
        held.push((write_to(fd, b"hi"), info));
    }
    let mut held = held.into_iter();
    let (ended, ended_info) = held.next().unwrap();
    let (cut, _) = held.next().unwrap();
    let (kept, _) = held.next().unwrap();
    // Ended as the libraries end one: a CLOSE, then the descriptor goes (no reply awaited).
    rx.close(1, ended_info.conn_id);
    drop(ended);
    // Closed bare by a program that lives on.
    drop(cut);
    assert_eq!(rx.reply().status, Status::Ok);
    // Its receiver connection ends while it still holds the last one, closed bare after.
    drop(rx);
    std::thread::sleep(Duration::from_millis(100));
    drop(kept);
    let ends: Vec<(Vec<u8>, End)> = clients.iter_mut().map(|c| c.read_to_end()).collect();
    assert_eq!(ends[0].0, b"hi");
    assert!(matches!(ends[0].1, End::CloseNotify), "{:?}", ends[0]);
    assert!(is_reset(&ends[1].1), "a bare close: {:?}", ends[1]);
    assert!(
        is_reset(&ends[2].1),
        "held past its receiver: {:?}",
        ends[2]
    );

    // A HELLO after a receiver's first frame is a protocol error: it is disconnected.
    let late = RawReceiver::connect(&socket, None);
    wait_receivers(&server, 2);
    late.close(1, 7);
    late.send(&Message::Hello {
        flags: wire::ENDS_WITH_CLOSE,
    });
    assert!(late.ended(), "a late HELLO was taken");
    let lines = server.stderr_lines();
    let stats = server.stop();
    assert_eq!(
        stats.get("handoff_receivers_ends_with_close"),
        1,
        "{stats:?}"
    );
    assert_eq!(
        stats.get("handoff_receivers_protocol_errors"),
        1,
        "{stats:?}"
    );
    let reset = match mode() {
        Mode::User => stats.get("handoff_relay_reset_receiver_gone"),
        Mode::Kernel => stats.get("handoff_kernel_released_receiver_gone"),
    };
    assert_eq!(reset, 2, "{stats:?}");
    assert!(!lines.iter().any(|l| l.contains("panicked")));
    let _ = std::fs::remove_dir_all(dir);
}

/// Set (to the hand-off socket's path) in the environment of this test binary run again as
/// a receiver that promises nothing ([`raw_receiver_that_holds_its_connection`]); the other
/// says how it ends: `exit` (status 0, holding its connection) or `wait` (to be killed).
const RAW_CHILD_SOCKET: &str = "TLSPLANE_TEST_RAW_RECEIVER";
const RAW_CHILD_END: &str = "TLSPLANE_TEST_RAW_RECEIVER_END";

/// Run by [`a_receiver_that_promised_nothing_and_exits_holding_a_connection_leaves_it_a_reset`]
/// only: no HELLO; takes one connection, writes to it, says `ready`, then ends as told.
#[test]
#[ignore = "a receiver process for a_receiver_that_promised_nothing_and_exits_holding_a_connection_leaves_it_a_reset"]
fn raw_receiver_that_holds_its_connection() {
    let Some(socket) = std::env::var_os(RAW_CHILD_SOCKET) else {
        return;
    };
    let rx = RawReceiver::connect(Path::new(&socket), None);
    let (fd, _) = rx.accept();
    let _held = write_to(fd, b"held");
    println!("ready");
    if std::env::var(RAW_CHILD_END).as_deref() == Ok("exit") {
        std::process::exit(0);
    }
    std::thread::sleep(Duration::from_secs(60));
}

#[test]
fn a_receiver_that_promised_nothing_and_exits_holding_a_connection_leaves_it_a_reset() {
    use std::io::BufRead;
    let dir = scratch("handoff-exits-holding");
    let socket = dir.join("app.sock");
    let me = tlsplane_sys::current_uid();
    let mut builder = Server::builder()
        .handoff(&socket)
        .arg("--handoff-allow-uid")
        .arg(me.to_string());
    if me == 0 {
        // tlsplane as another user than its receiver's: the kernel hides the receiver's
        // exit code from it (it reads 0), not that it exits.
        builder = builder.arg("--user").arg("65534:65534");
    }
    let server = builder.start();
    for (k, end) in ["exit", "wait"].into_iter().enumerate() {
        let mut child = Command::new(std::env::current_exe().expect("test binary"))
            .args([
                "--ignored",
                "--exact",
                "handoff_trust::raw_receiver_that_holds_its_connection",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(RAW_CHILD_SOCKET, &socket)
            .env(RAW_CHILD_END, end)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("the test binary as a receiver");
        wait_receivers(&server, k + 1);
        let mut client = TlsClient::connect_version(server.port(), Tls::V13);
        let out = std::io::BufReader::new(child.stdout.take().unwrap());
        // (After the harness's "test NAME ... " on the same line.)
        let ready = out
            .lines()
            .map_while(Result::ok)
            .any(|l| l.ends_with("ready"));
        assert!(ready, "{end}: the receiver did not take its connection");
        if end == "wait" {
            child.kill().expect("kill -9");
        }
        // Reaped only after: tlsplane sees the exit (a zombie), not a vanished process.
        let (got, how) = client.read_to_end();
        let _ = child.wait();
        assert!(is_reset(&how), "{end}: {how:?} after {got:?}");
    }
    let stats = server.stop();
    assert_eq!(
        stats.get("handoff_relay_reset_receiver_gone")
            + stats.get("handoff_kernel_released_receiver_gone"),
        2,
        "{stats:?}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_receiver_its_writing_thread_lost_still_has_its_queued_requests_served() {
    let dir = scratch("handoff-lost-by-writer");
    let socket = dir.join("app.sock");
    let server = Server::builder()
        .handoff(&socket)
        .arg("--handoff-reply-queue")
        .arg("1000000")
        .start();
    let rx = RawReceiver::connect(&socket, None);
    wait_receivers(&server, 1);
    let mut client = TlsClient::connect_version(server.port(), Tls::V13);
    let (fd, info) = rx.accept();
    let fd = write_to(fd, b"whole");
    // It reads nothing more: tlsplane's next write to it (the first reply) fails while its
    // requests, its CLOSE first, are still queued. Those are its, all the same.
    rx.0.shutdown(std::net::Shutdown::Read).unwrap();
    let mut batch = Vec::new();
    let mut frame = [0u8; 64];
    for k in 0..4000u32 {
        let conn_id = if k == 0 { info.conn_id } else { 7 };
        let m = Message::Close {
            request_id: k,
            conn_id,
        };
        let n = m.encode(&mut frame).unwrap();
        batch.extend_from_slice(&frame[..n]);
    }
    // (tlsplane shuts its end once it lost the receiver: the tail may not go.)
    let _ = (&rx.0).write_all(&batch);
    drop(fd);
    let (got, how) = client.read_to_end();
    assert_eq!(got, b"whole");
    assert!(matches!(how, End::CloseNotify), "{how:?}");
    drop(rx);
    let lines = server.stderr_lines();
    let stats = server.stop();
    assert_eq!(
        stats.get("handoff_receivers_reply_overflow"),
        0,
        "a lost receiver taken for one that reads no replies: {stats:?}"
    );
    assert!(!lines
        .iter()
        .any(|l| l.contains("reads none of its replies")));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn receivers_and_kept_kernel_plane_sockets_are_capped() {
    let dir = scratch("handoff-caps");
    let socket = dir.join("app.sock");
    let server = Server::builder()
        .handoff(&socket)
        .arg("--handoff-max-receivers")
        .arg("2")
        .arg("--handoff-max-kept")
        .arg("1")
        .start();
    let rx = RawReceiver::connect(&socket, None);
    let second = RawReceiver::connect(&socket, None);
    wait_receivers(&server, 2);
    let third = RawReceiver::connect(&socket, None);
    assert!(
        third.ended(),
        "a receiver past --handoff-max-receivers was kept"
    );
    drop(second);
    server.wait_lines("hand-off receiver gone", 1, Duration::from_secs(10));
    // Both go to `rx`: the first on the kernel plane (when there is one), the second
    // relayed, tlsplane keeping one kernel-plane socket at most.
    let mut clients = Vec::new();
    let mut planes = Vec::new();
    let mut held = Vec::new();
    for _ in 0..2 {
        clients.push(TlsClient::connect_version(server.port(), Tls::V13));
        let (fd, info) = rx.accept();
        planes.push(info.plane);
        held.push((fd, info));
    }
    // Ended only once both are held: a duplicate let go at the first CLOSE frees its place.
    for (fd, info) in held {
        rx.close(1, info.conn_id);
        drop(fd);
        assert_eq!(rx.reply().status, Status::Ok);
    }
    let first = match mode() {
        Mode::User => Plane::UserRelay,
        Mode::Kernel => Plane::Kernel,
    };
    assert_eq!(planes, [first, Plane::UserRelay]);
    for c in &mut clients {
        let (_, how) = c.read_to_end();
        assert!(matches!(how, End::CloseNotify), "{how:?}");
    }
    let lines = server.stderr_lines();
    let stats = server.stop();
    assert_eq!(stats.get("handoff_receivers_over_limit"), 1, "{stats:?}");
    assert_eq!(
        stats.get("handoff_kernel_relayed_kept_full"),
        u64::from(mode() == Mode::Kernel),
        "{stats:?}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.contains("--handoff-max-receivers receivers are connected")),
        "{lines:?}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_key_update_waiting_for_room_in_its_socket_holds_up_no_other_request() {
    if !kernel_only("a KeyUpdate tlsplane sends on a handed kTLS socket") {
        return;
    }
    let dir = scratch("handoff-key-update-waits");
    let socket = dir.join("app.sock");
    let server = Server::builder().handoff(&socket).start();
    if !kernel_rekeys(&server) {
        eprintln!("SKIPPED: this kernel cannot re-key TLS 1.3");
        return;
    }
    let rx = RawReceiver::connect(&socket, Some(wire::ENDS_WITH_CLOSE));
    wait_receivers(&server, 1);
    let mut a = TlsClient::connect_version(server.port(), Tls::V13);
    let (fa, ia) = rx.accept();
    let mut b = TlsClient::connect_version(server.port(), Tls::V13);
    let (fb, ib) = rx.accept();
    assert_eq!(ia.plane, Plane::Kernel);
    // The program fills a's socket: its client reads nothing for now.
    let fa = std::net::TcpStream::from(fa);
    fa.set_nonblocking(true).unwrap();
    let chunk = vec![b'x'; 65536];
    let mut sent = 0;
    loop {
        match (&fa).write(&chunk) {
            Ok(n) => sent += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(e) => panic!("filling the socket: {e}"),
        }
    }
    fa.set_nonblocking(false).unwrap();
    // The client re-keys, asks for tlsplane's KeyUpdate, and sends more under its new key.
    a.conn.refresh_traffic_keys().expect("KeyUpdate");
    a.write_all(b"after").unwrap();
    let mut buf = vec![0u8; 65536];
    let (n, typ) = tlsplane_sys::recv_record_blocking(fa.as_fd(), &mut buf).unwrap();
    assert_eq!(typ, 22, "the client's KeyUpdate");
    rx.send(&Message::KeyUpdate {
        request_id: 1,
        conn_id: ia.conn_id,
        record_plaintext: &buf[..n],
    });
    rx.close(2, ib.conn_id);
    drop(fb);
    // b's CLOSE is answered while a's KeyUpdate waits for its client to make room.
    let first = rx.reply();
    assert_eq!((first.request_id, first.status), (2, Status::Ok));
    let mut got = 0;
    while got < sent {
        got += a.read_plain(&mut buf).expect("the program's bytes");
    }
    let second = rx.reply();
    assert_eq!((second.request_id, second.status), (1, Status::Ok));
    // Under the new key: what the client sent after its KeyUpdate.
    let (n, typ) = tlsplane_sys::recv_record_blocking(fa.as_fd(), &mut buf).unwrap();
    assert_eq!((&buf[..n], typ), (&b"after"[..], 23));
    rx.close(3, ia.conn_id);
    assert_eq!(rx.reply().request_id, 3);
    drop(fa);
    for c in [&mut a, &mut b] {
        let (_, how) = c.read_to_end();
        assert!(matches!(how, End::CloseNotify), "{how:?}");
    }
    let stats = server.stop();
    assert_eq!(stats.get("handoff_kernel_key_update_waits"), 1, "{stats:?}");
    assert_eq!(stats.get("handoff_kernel_key_updates"), 1, "{stats:?}");
    let _ = std::fs::remove_dir_all(dir);
}
