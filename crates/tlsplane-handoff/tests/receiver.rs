//! The receiver against a fake tlsplane: a Unix listener in a temporary directory that passes
//! TCP sockets connected over 127.0.0.1, and answers requests.

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;

use tlsplane_handoff::wire::{self, kind, Message};
use tlsplane_handoff::{
    read_frame, send_connection, send_reply, ConnInfo, HandoffClient, Plane, Reply, ServerUids,
    Status,
};

#[path = "common/impostor.rs"]
mod impostor;
use impostor::{Impostor, IMPOSTOR_UID};

fn socket_path(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tlsplane-handoff-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir.join("handoff.sock")
}

/// A TCP connection over loopback: (the "TLS client" end, the end tlsplane would hand off).
fn tcp_pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (s, _) = l.accept().unwrap();
    (c, s)
}

/// The kernel's name of the socket behind `fd`, e.g. `socket:[12345]`.
fn socket_name(fd: &impl AsRawFd) -> PathBuf {
    std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap()
}

/// How many descriptors of this process refer to that socket: exact even while other tests
/// open descriptors of their own.
fn copies(name: &PathBuf) -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|l| l == name)
        .count()
}

/// The first frame a receiver sends: HELLO, announcing that it ends every connection with a
/// CLOSE.
fn expect_hello(theirs: &UnixStream) {
    let mut frame = Vec::new();
    read_frame(theirs, &mut frame).unwrap().unwrap();
    assert_eq!(
        Message::decode(&frame).unwrap(),
        Some(Message::Hello {
            flags: wire::ENDS_WITH_CLOSE
        }),
        "the receiver's first frame"
    );
}

fn info_for(id: u64, plane: Plane, s: &TcpStream) -> ConnInfo {
    ConnInfo {
        conn_id: id,
        plane,
        tls_version: 0x0304,
        cipher_suite: 0x1302,
        peer: Some(s.peer_addr().unwrap()),
        local: Some(s.local_addr().unwrap()),
        server_name: Some("app.example".into()),
        alpn: Some(b"http/1.1".to_vec()),
    }
}

#[test]
fn a_passed_tcp_socket_carries_bytes_both_ways() {
    let path = socket_path("bytes");
    let listener = UnixListener::bind(&path).unwrap();
    let (mut tls_client, handed) = tcp_pair();
    let name = socket_name(&handed);
    let info = info_for(17, Plane::UserRelay, &handed);
    let sent_info = info.clone();
    let sender = std::thread::spawn(move || {
        let (sock, _) = listener.accept().unwrap();
        send_connection(&sock, handed.as_fd(), &sent_info).unwrap();
        drop(handed); // the receiver's copy is now the only one
        sock
    });
    let client = HandoffClient::connect(&path).unwrap();
    let conn = client.accept().unwrap();
    let _sock = sender.join().unwrap();
    assert_eq!(conn.info, info);
    assert_eq!(copies(&name), 1, "exactly the received descriptor");

    tls_client.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    let mut buf = [0u8; 64];
    let mut got = Vec::new();
    while got.len() < 18 {
        let n = client.read(conn.as_fd(), &conn.info, &mut buf).unwrap();
        assert!(n > 0);
        got.extend_from_slice(&buf[..n]);
    }
    assert_eq!(got, b"GET / HTTP/1.1\r\n\r\n");

    // The user-relay plane's descriptor is a socketpair end, not TCP (here the fake passed
    // TCP, so see it as raw TCP to write through a TcpStream).
    let (fd, info) = conn.into_tcp_stream().unwrap_err().into_parts();
    let conn = client.adopt(
        fd,
        ConnInfo {
            plane: Plane::RawTcp,
            ..info
        },
    );
    let (mut out, info) = conn.into_tcp_stream().unwrap();
    assert_eq!(out.peer_addr().unwrap(), info.peer.unwrap());
    assert_eq!(out.local_addr().unwrap(), info.local.unwrap());
    out.write_all(b"HTTP/1.1 204 No Content\r\n\r\n").unwrap();
    let conn = client.adopt(out.into(), info);
    assert_eq!(client.close(conn).unwrap(), Status::Ok);
    assert_eq!(copies(&name), 0, "closed by close()");
    let mut reply = Vec::new();
    tls_client.read_to_end(&mut reply).unwrap();
    assert_eq!(reply, b"HTTP/1.1 204 No Content\r\n\r\n");
    std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
}

/// The fake tlsplane's side of requests: answers each KEY_UPDATE and CLOSE, first sending a
/// connection so that the reply arrives behind one.
#[test]
fn requests_are_answered_while_connections_queue() {
    let (ours, theirs) = UnixStream::pair().unwrap();
    let (mut tls_client, handed) = tcp_pair();
    let name = socket_name(&handed);
    let info = info_for(5, Plane::Kernel, &handed);
    let sent_info = info.clone();
    let fake = std::thread::spawn(move || {
        expect_hello(&theirs);
        let mut frame = Vec::new();
        let mut seen = Vec::new();
        // To the client's end (a reset, when it goes with the last reply unread).
        while let Ok(Some((prefix, fd))) = read_frame(&theirs, &mut frame) {
            assert!(fd.is_none());
            let (request_id, conn_id, status) = match Message::decode(&frame).unwrap() {
                Some(Message::KeyUpdate {
                    request_id,
                    conn_id,
                    record_plaintext,
                }) => {
                    assert_eq!(record_plaintext, [24, 0, 0, 1, 1]);
                    // A connection overtakes the reply.
                    send_connection(&theirs, handed.as_fd(), &sent_info).unwrap();
                    (request_id, conn_id, Status::Ok)
                }
                Some(Message::Close {
                    request_id,
                    conn_id,
                }) => (request_id, conn_id, Status::UnknownConnection),
                other => panic!("unexpected {other:?}"),
            };
            seen.push(prefix.kind);
            let reply = Reply {
                request_id,
                conn_id,
                status,
            };
            // The last CLOSE, sent as the connection is dropped, has no client to answer.
            let _ = send_reply(&theirs, &reply);
        }
        seen
    });
    let client = std::sync::Arc::new(HandoffClient::from_stream(ours));
    // One thread waits in accept() while another asks for a re-key: the reply must reach the
    // second, the connection the first.
    let acceptor = {
        let client = client.clone();
        std::thread::spawn(move || client.accept().unwrap())
    };
    assert_eq!(client.key_update(5, &[24, 0, 0, 1, 1]).unwrap(), Status::Ok);
    let conn = acceptor.join().unwrap();
    assert_eq!(conn.info, info);
    assert_eq!(client.close_notify(99).unwrap(), Status::UnknownConnection);

    // Kernel-plane reads want room for a control record.
    let e = client
        .read(conn.as_fd(), &conn.info, &mut [0u8; 8])
        .unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
    // Without kTLS the socket reports plain data, which a kernel-plane read returns as is.
    tls_client.write_all(b"hello").unwrap();
    let mut buf = [0u8; 64];
    let n = client.read(conn.as_fd(), &conn.info, &mut buf).unwrap();
    assert_eq!(&buf[..n], b"hello");

    drop(conn); // a CLOSE, not waited for
    drop(client); // the fake sees end of stream and returns
    let seen = fake.join().unwrap();
    assert_eq!(seen, [kind::KEY_UPDATE, kind::CLOSE, kind::CLOSE]);
    assert_eq!(copies(&name), 0);
}

#[test]
fn malformed_headers_are_refused_and_their_descriptors_closed() {
    let (ours, theirs) = UnixStream::pair().unwrap();
    let (_tls_client, handed) = tcp_pair();
    let name = socket_name(&handed);
    let client = HandoffClient::from_stream(ours);
    let good = info_for(1, Plane::RawTcp, &handed);
    let mut frame = vec![0u8; wire::MAX_FRAME_LEN];
    let n = Message::Connection(good.clone())
        .encode(&mut frame)
        .unwrap();
    frame.truncate(n);

    // Well framed, bad plane: refused, its descriptor closed, the stream still usable.
    let mut bad = frame.clone();
    bad[16] = 9;
    tlsplane_sys::send_with_fd(theirs.as_fd(), &bad, handed.as_fd()).unwrap();
    let e = client.accept().unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
    assert!(e.to_string().contains("plane"), "{e}");
    assert_eq!(copies(&name), 1, "only the sender's copy is left");

    // A CONNECTION without a descriptor is refused too.
    (&theirs).write_all(&frame).unwrap();
    assert_eq!(
        client.accept().unwrap_err().kind(),
        std::io::ErrorKind::InvalidData
    );

    // An unknown kind is skipped, the descriptor with it closed; the next one arrives.
    let mut unknown = frame.clone();
    unknown[5] = 77;
    tlsplane_sys::send_with_fd(theirs.as_fd(), &unknown, handed.as_fd()).unwrap();
    send_connection(&theirs, handed.as_fd(), &good).unwrap();
    let conn = client.accept().unwrap();
    assert_eq!(conn.info, good);
    assert_eq!(copies(&name), 2);
    drop(conn);
    assert_eq!(copies(&name), 1);

    // Bad magic: the stream cannot be framed any more; this and every later call fails.
    let mut magic = frame.clone();
    magic[0] = b'X';
    tlsplane_sys::send_with_fd(theirs.as_fd(), &magic, handed.as_fd()).unwrap();
    assert_eq!(
        client.accept().unwrap_err().kind(),
        std::io::ErrorKind::InvalidData
    );
    assert_eq!(copies(&name), 1);
    send_connection(&theirs, handed.as_fd(), &good).unwrap();
    assert!(client.accept().is_err());
    assert!(client.close_notify(1).is_err());
}

#[test]
fn tlsplane_going_away_is_an_error_not_a_hang() {
    let (ours, theirs) = UnixStream::pair().unwrap();
    let client = HandoffClient::from_stream(ours);
    expect_hello(&theirs);
    // Half a prefix, then the end.
    (&theirs).write_all(b"TLP").unwrap();
    drop(theirs);
    let e = client.accept().unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
    // The client is broken for good: requests fail at once rather than wait.
    assert!(client.key_update(1, &[24, 0, 0, 1, 0]).is_err());
}

/// Eight threads ask at once; the fake answers in reverse order of arrival, each with a
/// status that names the request: every thread must get its own answer.
#[test]
fn concurrent_requests_each_get_their_own_reply() {
    let (ours, theirs) = UnixStream::pair().unwrap();
    let fake = std::thread::spawn(move || {
        expect_hello(&theirs);
        let mut frame = Vec::new();
        let mut asked = Vec::new();
        while asked.len() < 8 {
            let (_, fd) = read_frame(&theirs, &mut frame).unwrap().unwrap();
            assert!(fd.is_none());
            match Message::decode(&frame).unwrap() {
                Some(Message::Close {
                    request_id,
                    conn_id,
                }) => asked.push((request_id, conn_id)),
                other => panic!("unexpected {other:?}"),
            }
        }
        for &(request_id, conn_id) in asked.iter().rev() {
            let status = Status::Other(1000 + conn_id as u16);
            send_reply(
                &theirs,
                &Reply {
                    request_id,
                    conn_id,
                    status,
                },
            )
            .unwrap();
        }
        // An answer to nothing asked is skipped: the client reads on to the end of stream.
        send_reply(
            &theirs,
            &Reply {
                request_id: 999_999,
                conn_id: 0,
                status: Status::Ok,
            },
        )
        .unwrap();
        theirs
    });
    let client = std::sync::Arc::new(HandoffClient::from_stream(ours));
    let threads: Vec<_> = (0..8u64)
        .map(|i| {
            let client = client.clone();
            std::thread::spawn(move || (i, client.close_notify(i).unwrap()))
        })
        .collect();
    for t in threads {
        let (i, status) = t.join().unwrap();
        assert_eq!(status, Status::Other(1000 + i as u16));
    }
    let theirs = fake.join().unwrap();
    drop(theirs);
    assert_eq!(
        client.accept().unwrap_err().kind(),
        std::io::ErrorKind::UnexpectedEof
    );
}

#[test]
fn a_descriptor_on_a_reply_is_closed_and_the_reply_used() {
    let (ours, theirs) = UnixStream::pair().unwrap();
    let (_c, stray) = tcp_pair();
    let name = socket_name(&stray);
    let fake = std::thread::spawn(move || {
        expect_hello(&theirs);
        let mut frame = Vec::new();
        read_frame(&theirs, &mut frame).unwrap().unwrap();
        let Some(Message::Close { request_id, .. }) = Message::decode(&frame).unwrap() else {
            panic!("expected CLOSE");
        };
        let mut reply = [0u8; 64];
        let n = Message::Reply(Reply {
            request_id,
            conn_id: 3,
            status: Status::Refused,
        })
        .encode(&mut reply)
        .unwrap();
        tlsplane_sys::send_with_fd(theirs.as_fd(), &reply[..n], stray.as_fd()).unwrap();
        (theirs, stray)
    });
    let client = HandoffClient::from_stream(ours);
    assert_eq!(client.close_notify(3).unwrap(), Status::Refused);
    let (_theirs, _stray) = fake.join().unwrap();
    assert_eq!(copies(&name), 1, "only the sender's copy");
}

/// Another user listening at the path (as anyone can while tlsplane restarts) is refused
/// before a byte is read; trusting that user's id lets its forged connection through, so the
/// check is what decides.
#[test]
fn another_user_listening_at_the_path_is_refused_unless_its_uid_is_trusted() {
    let Some(imp) = Impostor::start("rust", "") else {
        return;
    };
    let refused = |r: std::io::Result<HandoffClient>| match r {
        Ok(_) => panic!("connected to uid {IMPOSTOR_UID}"),
        Err(e) => e,
    };
    // The default: root and this process's own uid (root here).
    let own = ServerUids::new([tlsplane_sys::effective_uid()]);
    let e = refused(HandoffClient::connect_trusting(&imp.path, &own));
    assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{e}");
    let want = format!("served by uid {IMPOSTOR_UID}, not root (TLSPLANE_HANDOFF_UID");
    assert!(e.to_string().contains(&want), "{e}");
    if std::env::var_os(tlsplane_handoff::SERVER_UID_ENV).is_none() {
        let e = refused(HandoffClient::connect(&imp.path));
        assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{e}");
    }
    let other = ServerUids::new([1000]);
    let e = refused(HandoffClient::connect_trusting(&imp.path, &other));
    assert!(e.to_string().contains("not root or uid 1000"), "{e}");

    let trusting = ServerUids::new([IMPOSTOR_UID]);
    let client = HandoffClient::connect_trusting(&imp.path, &trusting).unwrap();
    let conn = client.accept().unwrap();
    assert_eq!(conn.info.server_name.as_deref(), Some("forged.example"));
    assert_eq!(conn.info.peer, Some("203.0.113.7:4242".parse().unwrap()));
}

/// Connections queue only while a request waits for its reply and nobody accepts: past the
/// limit each is ended on arrival (a CLOSE to tlsplane, and a relayed one closed), counted,
/// and the queue keeps the first ones in order.
#[test]
fn connections_past_the_queue_limit_are_ended_on_arrival_and_counted() {
    let (ours, theirs) = UnixStream::pair().unwrap();
    let fake = std::thread::spawn(move || {
        expect_hello(&theirs);
        let mut frame = Vec::new();
        read_frame(&theirs, &mut frame).unwrap().unwrap();
        let Some(Message::Close { request_id, .. }) = Message::decode(&frame).unwrap() else {
            panic!("expected CLOSE");
        };
        // Five connections while the client waits for the reply: 100..=103 on the kernel
        // plane, 104 relayed.
        let mut peers = Vec::new();
        for id in 100..105u64 {
            let (peer, handed) = tcp_pair();
            let plane = if id == 104 {
                Plane::UserRelay
            } else {
                Plane::Kernel
            };
            send_connection(&theirs, handed.as_fd(), &info_for(id, plane, &handed)).unwrap();
            peers.push(peer);
        }
        let reply = Reply {
            request_id,
            conn_id: 99,
            status: Status::Ok,
        };
        send_reply(&theirs, &reply).unwrap();
        // What the client asked afterwards, to its end.
        let mut closes = Vec::new();
        while read_frame(&theirs, &mut frame).unwrap().is_some() {
            if let Some(Message::Close { conn_id, .. }) = Message::decode(&frame).unwrap() {
                closes.push(conn_id);
            }
        }
        (peers, closes)
    });
    let client = HandoffClient::from_stream(ours).with_queue_limit(3);
    assert_eq!(client.close_notify(99).unwrap(), Status::Ok);
    assert_eq!(client.connections_dropped(), 2);
    let queued: Vec<u64> = (0..3)
        .map(|_| client.accept().unwrap().info.conn_id)
        .collect();
    assert_eq!(queued, [100, 101, 102]);
    drop(client);
    let (mut peers, closes) = fake.join().unwrap();
    assert_eq!(
        closes,
        [103, 104, 100, 101, 102],
        "a CLOSE for each dropped connection, then for each accepted one as it is dropped"
    );
    // The dropped connections' descriptors are closed: their clients see the end.
    for peer in &mut peers[3..] {
        peer.set_read_timeout(Some(std::time::Duration::from_secs(3)))
            .unwrap();
        assert_eq!(peer.read(&mut [0u8; 8]).unwrap(), 0);
    }
}

/// What the hand-off connection holds when `peer`, the far end of a handed connection, sees
/// its end (read 0 or an error) while another thread runs `end`: the connection id of the
/// CLOSE queued by then, if any. tlsplane judges a connection by whether its CLOSE was
/// queued when the descriptor's end reached it: the CLOSE must come first.
fn close_queued_at_the_end(
    theirs: &UnixStream,
    peer: &mut impl Read,
    end: impl FnOnce() + Send,
) -> Option<u64> {
    std::thread::scope(|s| {
        s.spawn(end);
        let _ = peer.read(&mut [0u8; 8]);
    });
    theirs.set_nonblocking(true).unwrap();
    let mut frame = Vec::new();
    let got = match read_frame(theirs, &mut frame) {
        Ok(Some(_)) => match Message::decode(&frame).unwrap() {
            Some(Message::Close { conn_id, .. }) => Some(conn_id),
            other => panic!("unexpected {other:?}"),
        },
        Ok(None) => None,
        Err(e) if e.kind() == ErrorKind::WouldBlock => None,
        other => panic!("unexpected {other:?}"),
    };
    theirs.set_nonblocking(false).unwrap();
    got
}

/// The receiver's side of ENDS_WITH_CLOSE: every connection the client hands out, on either
/// plane, ends with a CLOSE queued before its descriptor goes, whether closed or dropped;
/// none for the raw TCP plane, a descriptor taken out of the library, or a connection that
/// outlives its client (whose hand-off connection ends with the client all the same).
#[test]
fn every_connection_ends_with_a_close_queued_before_its_descriptor_goes() {
    let (ours, theirs) = UnixStream::pair().unwrap();
    let client = HandoffClient::from_stream(ours);
    expect_hello(&theirs);
    let relay = |id: u64| {
        let (peer, handed) = UnixStream::pair().unwrap();
        let (_, like_tcp) = tcp_pair();
        send_connection(
            &theirs,
            handed.as_fd(),
            &info_for(id, Plane::UserRelay, &like_tcp),
        )
        .unwrap();
        (peer, client.accept().unwrap())
    };
    let (mut peer, conn) = relay(1);
    let dropped = close_queued_at_the_end(&theirs, &mut peer, || drop(conn));
    let (mut peer, conn) = relay(2);
    let closed = close_queued_at_the_end(&theirs, &mut peer, || {
        assert_eq!(client.close(conn).unwrap(), Status::Ok);
    });
    assert_eq!((dropped, closed), (Some(1), Some(2)));
    let (mut peer, conn) = relay(3);
    let (fd, _) = conn.into_parts();
    assert_eq!(
        close_queued_at_the_end(&theirs, &mut peer, || drop(fd)),
        None
    );

    let (mut peer, handed) = tcp_pair();
    send_connection(
        &theirs,
        handed.as_fd(),
        &info_for(4, Plane::RawTcp, &handed),
    )
    .unwrap();
    drop(handed);
    let conn = client.accept().unwrap();
    assert_eq!(
        close_queued_at_the_end(&theirs, &mut peer, || drop(conn)),
        None
    );

    // Kernel plane: close waits for tlsplane's answer (here a thread's) before closing.
    let (mut peer, handed) = tcp_pair();
    send_connection(
        &theirs,
        handed.as_fd(),
        &info_for(5, Plane::Kernel, &handed),
    )
    .unwrap();
    drop(handed);
    let conn = client.accept().unwrap();
    let answered = std::thread::scope(|s| {
        let closer = s.spawn(|| client.close(conn).unwrap());
        let mut frame = Vec::new();
        read_frame(&theirs, &mut frame).unwrap().unwrap();
        let Some(Message::Close {
            request_id,
            conn_id: 5,
        }) = Message::decode(&frame).unwrap()
        else {
            panic!("expected CLOSE 5");
        };
        let reply = Reply {
            request_id,
            conn_id: 5,
            status: Status::Refused,
        };
        send_reply(&theirs, &reply).unwrap();
        closer.join().unwrap()
    });
    assert_eq!(answered, Status::Refused);
    assert_eq!(
        peer.read(&mut [0u8; 8]).unwrap(),
        0,
        "closed after the answer"
    );

    let (mut peer, conn) = relay(6);
    drop(client);
    assert_eq!(
        close_queued_at_the_end(&theirs, &mut peer, || drop(conn)),
        None
    );
    let mut frame = Vec::new();
    assert!(
        read_frame(&theirs, &mut frame).unwrap().is_none(),
        "the client's end"
    );
}
