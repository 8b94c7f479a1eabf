//! Runs python/test_handoff.py (the standard-library module python/tlsplane_handoff.py)
//! against a fake tlsplane written with this crate's sender: the two implementations of the
//! wire format must agree.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::process::Command;

use tlsplane_handoff::wire::Message;
use tlsplane_handoff::{read_frame, send_connection, send_reply, ConnInfo, Plane, Reply, Status};

#[path = "common/impostor.rs"]
mod impostor;
use impostor::Impostor;

#[test]
fn the_python_module_receives_reads_and_closes() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let script = root.join("python/test_handoff.py");
    let dir = std::env::temp_dir().join(format!("tlsplane-handoff-py-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("handoff.sock");
    let listener = UnixListener::bind(&path).unwrap();

    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut tls_client = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (handed, peer) = l.accept().unwrap();
    let info = ConnInfo {
        conn_id: 77,
        // No kTLS natively: every record reads as data, so this runs the module's
        // kernel-plane recvmsg and its CLOSE request.
        plane: Plane::Kernel,
        tls_version: 0x0303,
        cipher_suite: 0xc02f,
        peer: Some(peer),
        local: Some(handed.local_addr().unwrap()),
        server_name: Some("py.example".into()),
        alpn: Some(b"h2".to_vec()),
    };
    tls_client.write_all(b"hello from the TLS client").unwrap();
    tls_client.shutdown(std::net::Shutdown::Write).unwrap();

    let sent_info = info.clone();
    let fake = std::thread::spawn(move || {
        let info = sent_info;
        let (sock, _) = listener.accept().unwrap();
        // Bounded: a receiver that sends no HELLO fails the test, not hangs it.
        sock.set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .unwrap();
        let mut frame = Vec::new();
        read_frame(&sock, &mut frame).unwrap().unwrap();
        assert_eq!(
            Message::decode(&frame),
            Ok(Some(Message::Hello {
                flags: tlsplane_handoff::wire::ENDS_WITH_CLOSE
            })),
            "the module's first frame"
        );
        send_connection(&sock, handed.as_fd(), &info).unwrap();
        drop(handed);
        let (_, fd) = read_frame(&sock, &mut frame).unwrap().unwrap();
        assert!(fd.is_none());
        let Some(Message::Close {
            request_id,
            conn_id,
        }) = Message::decode(&frame).unwrap()
        else {
            panic!("expected CLOSE");
        };
        assert_eq!(conn_id, 77);
        send_reply(
            &sock,
            &Reply {
                request_id,
                conn_id,
                status: Status::Ok,
            },
        )
        .unwrap();
        // Bad server name byte, descriptor attached.
        let mut bad = vec![0u8; 1024];
        let n = Message::Connection(ConnInfo {
            server_name: Some("x".into()),
            ..info_copy()
        })
        .encode(&mut bad)
        .unwrap();
        bad[63] = b' ';
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        tlsplane_sys::send_with_fd(sock.as_fd(), &bad[..n], c.as_fd()).unwrap();
    });

    let mut good = vec![0u8; 1024];
    let n = Message::Connection(info.clone()).encode(&mut good).unwrap();
    let good_hex: String = good[..n].iter().map(|b| format!("{b:02x}")).collect();
    let out = Command::new("python3")
        .arg("-B") // no __pycache__ in the source tree
        .arg(&script)
        .arg(&path)
        .arg(&good_hex)
        .output()
        .expect("python3");
    fake.join().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(
        lines,
        [
            "info=77 1 0303 c02f py.example h2 127.0.0.1",
            "data=hello from the TLS client",
            "close=0",
            "accept_bad=ProtocolError(bad server name)",
            "accept_gone=ConnectionResetError",
            "fds_leaked=0",
            "fuzz_accepted_some=True",
            "control_records=True True aborted",
            "queue_bound=[1, 2] dropped=2 closes=[3, 4]",
            "ends=hello=True [1, 0, 2, None, None]",
            "done",
        ],
        "{stdout}"
    );
    let mut reply = Vec::new();
    tls_client.read_to_end(&mut reply).unwrap();
    assert_eq!(reply, b"pong");
    std::fs::remove_dir_all(&dir).unwrap();
}

fn info_copy() -> ConnInfo {
    ConnInfo {
        conn_id: 1,
        plane: Plane::UserRelay,
        tls_version: 0x0304,
        cipher_suite: 0x1301,
        peer: None,
        local: None,
        server_name: None,
        alpn: None,
    }
}

/// The module refuses another user listening at the path unless `TLSPLANE_HANDOFF_UID` or
/// `connect(server_uids=...)` trusts that user, and refuses a malformed variable.
#[test]
fn the_python_module_refuses_another_user_at_the_path_unless_trusted() {
    let Some(imp) = Impostor::start("python", "") else {
        return;
    };
    let program = r#"
import os, sys
import tlsplane_handoff as th
path = sys.argv[1]
def attempt(what, **kw):
    try:
        client = th.connect(path, **kw)
    except PermissionError as e:
        print("%s: PermissionError %d %s" % (what, e.errno, e.strerror))
        return
    except ValueError as e:
        print("%s: ValueError %s" % (what, e))
        return
    sock, info = client.accept()
    print("%s: accepted %s %s" % (what, info.server_name, info.peer[0]))
    sock.close()
    client.disconnect()
os.environ.pop("TLSPLANE_HANDOFF_UID", None)
attempt("default")
os.environ["TLSPLANE_HANDOFF_UID"] = "1000,2000"
attempt("env 1000,2000")
os.environ["TLSPLANE_HANDOFF_UID"] = "65534"
attempt("env 65534")
os.environ["TLSPLANE_HANDOFF_UID"] = "nobody"
attempt("env nobody")
attempt("argument", server_uids=[65534])
"#;
    let python_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../python");
    let out = Command::new("python3")
        .arg("-B")
        .arg("-c")
        .arg(program)
        .arg(&imp.path)
        .env("PYTHONPATH", python_dir)
        .output()
        .expect("python3");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let path = imp.path.display();
    let refused = |trusted: &str| {
        format!(
            "PermissionError 1 refusing the hand-off socket {path}: it is served by uid \
             65534, not {trusted} (TLSPLANE_HANDOFF_UID names the user ids tlsplane may run as)"
        )
    };
    assert_eq!(
        stdout.lines().collect::<Vec<_>>(),
        [
            format!("default: {}", refused("root")),
            format!("env 1000,2000: {}", refused("root or uids 1000, 2000")),
            "env 65534: accepted forged.example 203.0.113.7".into(),
            "env nobody: ValueError TLSPLANE_HANDOFF_UID='nobody': expected decimal user ids \
             separated by commas"
                .into(),
            "argument: accepted forged.example 203.0.113.7".into(),
        ],
        "{stdout}{stderr}"
    );
}
