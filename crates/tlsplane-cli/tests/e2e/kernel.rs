//! Test 10: post-handshake key changes. A client KeyUpdate (TLS 1.3) must either be honoured
//! (response intact) or end the connection cleanly (close_notify, no garbage) on kernels that
//! cannot re-key; the AEAD record limit must either re-key or close, never exceed it, never
//! corrupt data. The AEAD test needs the kernel plane (the limit is a kernel-plane feature);
//! the KeyUpdate test also runs on the user plane, where rustls must simply honour it.

use std::io;

use crate::support::client::{assert_file_body, End, Response, Tls, TlsClient, BOTH};
use crate::support::fixtures::{self, sha256, SIZE_1M7};
use crate::support::{get_request, kernel_only, kernel_rekeys, mode, Mode, Server};

enum Outcome {
    Responded(Response),
    CleanClose,
}

/// Reads a response, or recognises a clean close (close_notify before any byte of it).
fn response_or_clean_close(c: &mut TlsClient) -> Outcome {
    match c.read_response(false) {
        Ok(r) => Outcome::Responded(r),
        Err(e) if e.kind() == io::ErrorKind::ConnectionAborted && c.leftover().is_empty() => {
            Outcome::CleanClose
        }
        Err(e) => panic!(
            "neither a response nor a clean close: {e} (kind {:?}); {} bytes of partial response",
            e.kind(),
            c.leftover().len()
        ),
    }
}

/// What the server said at start-up: whether this kernel can re-key TLS 1.3 (Linux >= 6.14).
#[test]
fn client_key_update() {
    let fx = fixtures::get();
    let server = Server::start();
    let mut c = TlsClient::connect_version(server.port(), Tls::V13);
    assert_file_body(&c.get(&fx.hello.url), &fx.hello, "before KeyUpdate");
    // KeyUpdate(update_requested), then a request under the new key, in one write.
    c.conn.refresh_traffic_keys().expect("queueing a KeyUpdate");
    c.write_all(&get_request(&fx.text.url, ""))
        .expect("request after KeyUpdate");
    let outcome = response_or_clean_close(&mut c);
    match &outcome {
        Outcome::Responded(r) => {
            assert_file_body(r, &fx.text, "response after KeyUpdate");
            // The server's own KeyUpdate (it was requested) is behind us; keep going under it.
            c.write_all(&get_request(&fx.hello.url, "Connection: close\r\n"))
                .expect("second request");
            assert_file_body(
                &c.read_response(false).expect("second response"),
                &fx.hello,
                "second request after KeyUpdate",
            );
            let (rest, end) = c.read_to_end();
            assert!(rest.is_empty());
            assert!(matches!(end, End::CloseNotify), "{end:?}");
        }
        Outcome::CleanClose => {
            let (rest, end) = c.read_to_end();
            assert!(rest.is_empty(), "garbage after close_notify");
            assert!(matches!(end, End::CloseNotify), "{end:?}");
        }
    }
    // The server says at start-up whether this kernel can re-key TLS 1.3 (Linux >= 6.14); the
    // outcome must follow from it, not merely be one of the two acceptable ones.
    let kernel_rekeys = kernel_rekeys(&server);
    let stats = server.stop();
    if mode() == Mode::Kernel {
        eprintln!("kernel can re-key TLS 1.3: {kernel_rekeys}");
        assert_eq!(
            matches!(outcome, Outcome::Responded(_)),
            kernel_rekeys,
            "KeyUpdate outcome must match the kernel's rekey support: {stats:?}"
        );
    }
    match mode() {
        Mode::User => {
            assert!(
                matches!(outcome, Outcome::Responded(_)),
                "the user plane (rustls) must honour KeyUpdate"
            );
            assert_eq!(stats["key_update_unsupported"], 0);
            assert_eq!(stats["http_requests"], 3);
        }
        Mode::Kernel => match outcome {
            Outcome::Responded(_) => {
                assert_eq!(
                    stats["key_updates"], 1,
                    "a response after KeyUpdate means the kernel re-keyed: {stats:?}"
                );
                assert_eq!(stats["key_update_unsupported"], 0, "{stats:?}");
                assert_eq!(stats["http_requests"], 3);
            }
            Outcome::CleanClose => {
                assert_eq!(
                    stats["key_update_unsupported"], 1,
                    "a close after KeyUpdate must be the no-rekey path: {stats:?}"
                );
                assert_eq!(stats["key_updates"], 0, "{stats:?}");
                assert_eq!(stats["http_requests"], 1);
            }
        },
    }
}

/// A KeyUpdate storm: 12 KeyUpdate requests in one write, then a request. On the kernel
/// plane each costs two setsockopt calls and a key schedule step (a storm crashed HAProxy with
/// kTLS), so it allows 8 a second and ends the connection with unexpected_message at the 9th;
/// kernels that cannot re-key end it cleanly at the first. rustls (user plane) honours up to
/// 32 without application data in between.
#[test]
fn key_update_storm_is_cut_off_on_the_kernel_plane() {
    let fx = fixtures::get();
    let server = Server::start();
    let mut c = TlsClient::connect_version(server.port(), Tls::V13);
    assert_file_body(&c.get(&fx.hello.url), &fx.hello, "before the storm");
    for _ in 0..12 {
        c.conn.refresh_traffic_keys().expect("queueing a KeyUpdate");
    }
    c.write_all(&get_request(&fx.text.url, "Connection: close\r\n"))
        .expect("request after the storm");
    let response = c.read_response(false);
    let (_, end) = c.read_to_end();
    let rekeys = kernel_rekeys(&server);
    let stats = server.stop();
    match (mode(), rekeys) {
        (Mode::User, _) => {
            assert_file_body(&response.expect("response"), &fx.text, "after the storm");
            assert_eq!(stats["limit_key_updates"], 0, "{stats:?}");
        }
        (Mode::Kernel, true) => {
            assert!(response.is_err(), "the storm was answered: {stats:?}");
            assert!(
                matches!(end, End::Alert(rustls::AlertDescription::UnexpectedMessage))
                    || format!("{:?}", response.as_ref().err()).contains("UnexpectedMessage"),
                "expected unexpected_message: {end:?} / {:?}",
                response.err()
            );
            assert_eq!(stats["limit_key_updates"], 1, "{stats:?}");
            assert_eq!(stats["key_updates"], 8, "8 KeyUpdates allowed: {stats:?}");
        }
        (Mode::Kernel, false) => {
            assert_eq!(stats["key_update_unsupported"], 1, "{stats:?}");
            assert_eq!(stats["limit_key_updates"], 0, "{stats:?}");
        }
    }
}

/// Server records under each key, from the client's view of inbound records after the
/// handshake. TLS 1.3 KeyUpdate records are recognised by size: a 5-byte handshake message
/// + content type + 16-byte tag = 22 bytes, which no response record here has.
fn records_per_key(c: &TlsClient, v: Tls) -> Vec<usize> {
    let post = &c.io.inbound.records[c.handshake_records_in..];
    if v == Tls::V12 {
        return vec![post.len()];
    }
    let mut per_key = vec![0];
    for (typ, len) in post {
        assert_eq!(*typ, 23, "TLS 1.3 records are all outer type 23: {post:?}");
        *per_key.last_mut().expect("non-empty") += 1;
        if *len == 22 {
            per_key.push(0);
        }
    }
    per_key
}

#[test]
fn aead_record_limit() {
    if !kernel_only("the AEAD record limit (--aead-record-limit) of the kernel plane") {
        return;
    }
    const LIMIT: usize = 64;
    let fx = fixtures::get();
    let f = fx.file(SIZE_1M7);
    let content = std::fs::read(&f.path).expect("fixture");
    for v in BOTH {
        let server = Server::builder()
            .arg("--aead-record-limit")
            .arg(LIMIT.to_string())
            .start();
        let mut c = TlsClient::connect_version(server.port(), v);
        c.write_all(&get_request(&f.url, "Connection: close\r\n"))
            .expect("request");
        let mut body = Vec::new();
        let complete = match c.read_head() {
            Ok((status, _)) => {
                assert_eq!(status, 200);
                match c.read_body_with(f.size, |b| body.extend_from_slice(b)) {
                    Ok(()) => true,
                    Err(e) => {
                        assert_eq!(
                            e.kind(),
                            io::ErrorKind::ConnectionAborted,
                            "{v:?}: the body must end complete or with close_notify: {e}"
                        );
                        false
                    }
                }
            }
            Err(e) => {
                assert_eq!(
                    e.kind(),
                    io::ErrorKind::ConnectionAborted,
                    "{v:?}: the response must come or close_notify: {e}"
                );
                false
            }
        };
        body.extend_from_slice(c.leftover());
        assert!(
            body.len() <= content.len() && body == content[..body.len()],
            "{v:?}: received bytes are not a prefix of the file: corrupt data"
        );
        let (rest, end) = c.read_to_end();
        assert!(
            rest.is_empty(),
            "{v:?}: data after the response or after close_notify"
        );
        assert!(matches!(end, End::CloseNotify), "{v:?}: {end:?}");
        let per_key = records_per_key(&c, v);
        eprintln!(
            "{v:?}: complete={complete}, {} body bytes, server records per key {per_key:?}",
            body.len()
        );
        let kernel_rekeys = kernel_rekeys(&server);
        let stats = server.stop();
        assert_eq!(complete, kernel_rekeys && v == Tls::V13, "{v:?}: re-key exactly when TLS 1.3 on a kernel that can (rekey: {kernel_rekeys}): {stats:?}");
        if complete {
            assert!(sha256(&body) == f.sha256);
            assert!(
                stats["aead_limit_rekeys"] >= 1,
                "{v:?}: a complete 1 MiB body under a 64-record limit needs re-keying: {stats:?}"
            );
            assert_eq!(v, Tls::V13, "only TLS 1.3 can re-key");
        } else {
            assert!(
                stats["aead_limit_closes"] >= 1,
                "{v:?}: closed early without counting it: {stats:?}"
            );
        }
        for (i, n) in per_key.iter().enumerate() {
            assert!(*n <= LIMIT, "{v:?}: {n} records under server key #{i}, limit {LIMIT} (records per key: {per_key:?})");
        }
    }
}
