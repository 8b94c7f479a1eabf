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
        send_connection(&sock, handed.as_fd(), &info).unwrap();
        drop(handed);
        let mut frame = Vec::new();
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
