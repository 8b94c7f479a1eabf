//! Test 3: the first request travels in the same socket write as the client's Finished, so the
//! server sees application data right behind the handshake (on the kernel plane those bytes
//! must stay in the socket for kTLS, with the right sequence number).
//!
//! rustls buffers plaintext written before the handshake completes and flushes it together with
//! its last handshake flight. In TLS 1.2 that flight is the client's last one only when the
//! session is resumed (in a full handshake the server's Finished comes last), so the TLS 1.2
//! case resumes a session first.

use std::io::Write;

use rustls::HandshakeKind;

use crate::support::client::{assert_file_body, ClientOpts, End, RecordLog, Tls, TlsClient};
use crate::support::fixtures;
use crate::support::{get_request, Server};

const CT_CCS: u8 = 20;
const CT_HANDSHAKE: u8 = 22;
const CT_APPDATA: u8 = 23;

fn coalesced(v: Tls, resume: bool) {
    let fx = fixtures::get();
    let f = fx.file(16385);
    let server = Server::start();
    let config = ClientOpts::version(v).config();
    if resume {
        let mut warm = TlsClient::connect_with(server.port(), config.clone());
        assert_file_body(&warm.get(&fx.hello.url), &fx.hello, "warm-up");
        assert_eq!(warm.conn.handshake_kind(), Some(HandshakeKind::Full));
        warm.send_close_notify().expect("close_notify");
        let (_, end) = warm.read_to_end();
        assert!(matches!(end, End::CloseNotify), "{end:?}");
    }

    let mut c = TlsClient::new(server.port(), config);
    c.conn
        .writer()
        .write_all(&get_request(&f.url, "Connection: close\r\n"))
        .expect("buffering the early request");
    assert!(c.conn.is_handshaking());
    let finishing = loop {
        let before = c.io.writes.len();
        c.flush_tls().expect("writing handshake records");
        if !c.conn.is_handshaking() {
            break before..c.io.writes.len();
        }
        let n = c
            .read_tls_once()
            .unwrap_or_else(|e| panic!("{v:?} handshake: {e}"));
        assert!(n > 0, "{v:?}: EOF during the handshake");
    };
    let expected_kind = if resume {
        HandshakeKind::Resumed
    } else {
        HandshakeKind::Full
    };
    assert_eq!(c.conn.handshake_kind(), Some(expected_kind), "{v:?}");
    assert_eq!(
        finishing.len(),
        1,
        "{v:?}: the client's last flight and the request must go out in one write, got {} writes",
        finishing.len()
    );
    let records = RecordLog::parse(&c.io.writes[finishing.start]);
    match v {
        Tls::V13 => {
            // Everything after ServerHello is outer type 23: Finished, then the request.
            let appdata = records.iter().filter(|(t, _)| *t == CT_APPDATA).count();
            assert!(appdata >= 2, "{v:?}: the finishing write must hold Finished and the request (>= 2 type-23 records): {records:?}");
            assert_eq!(records.last().map(|r| r.0), Some(CT_APPDATA));
            assert!(
                records
                    .iter()
                    .all(|(t, _)| *t == CT_APPDATA || *t == CT_CCS),
                "{records:?}"
            );
        }
        Tls::V12 => {
            let last_hs = records
                .iter()
                .rposition(|(t, _)| *t == CT_HANDSHAKE)
                .unwrap_or_else(|| panic!("no Finished in the finishing write: {records:?}"));
            assert!(
                records[..last_hs].iter().any(|(t, _)| *t == CT_CCS),
                "ChangeCipherSpec before Finished: {records:?}"
            );
            assert!(
                records[last_hs + 1..].iter().any(|(t, _)| *t == CT_APPDATA),
                "{v:?}: application data must follow Finished in the same write: {records:?}"
            );
        }
    }
    let writes_after_handshake = c.io.writes.len();
    let resp = c
        .read_response(false)
        .unwrap_or_else(|e| panic!("{v:?}: response to the coalesced request: {e}"));
    assert_file_body(&resp, f, "coalesced first request");
    let (rest, end) = c.read_to_end();
    assert!(rest.is_empty());
    assert!(matches!(end, End::CloseNotify), "{v:?}: {end:?}");
    assert_eq!(
        c.io.writes.len(),
        writes_after_handshake,
        "the request was not re-sent"
    );
    let stats = server.stop();
    assert_eq!(stats["handshakes"], if resume { 2 } else { 1 });
    assert_eq!(stats["handshakes_resumed"], u64::from(resume));
    assert_eq!(stats["http_requests"], if resume { 2 } else { 1 });
    assert_eq!(stats["http_io_errors"], 0);
}

#[test]
fn request_coalesced_with_finished_tls13() {
    coalesced(Tls::V13, false);
}

#[test]
fn request_coalesced_with_finished_tls13_resumed() {
    coalesced(Tls::V13, true);
}

#[test]
fn request_coalesced_with_finished_tls12_resumed() {
    coalesced(Tls::V12, true);
}
