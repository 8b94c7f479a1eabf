//! After a TLS 1.3 handshake, records RFC 8446 answers with unexpected_message get that
//! alert, encrypted, not a bare FIN (tlsfuzzer's zero-content-type and fragmented-KeyUpdate
//! cases, which nginx passes): a record whose inner plaintext is all zeros (no content type,
//! §5.4), and a KeyUpdate split over two records with application data between them (§5.1).
//!
//! The client is rustls, for the handshake; then it takes its traffic keys and writes the
//! records itself, with rustls' own record protection (`MessageEncrypter`).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use rustls::crypto::cipher::{
    InboundOpaqueMessage, MessageDecrypter, MessageEncrypter, OutboundChunks, OutboundPlainMessage,
};
use rustls::{ConnectionTrafficSecrets, ContentType, ProtocolVersion};

use crate::support::client::{tcp_connect, ClientOpts, Tls};
use crate::support::{mode, Mode, Server};

const UNEXPECTED_MESSAGE: [u8; 2] = [2, 10];

/// What a case sends: records, each its inner content type and plaintext.
type Records = Vec<(ContentType, Vec<u8>)>;

/// A TLS 1.3 connection past its handshake whose records the test writes and reads itself.
struct RawRecords {
    sock: TcpStream,
    tx: (u64, Box<dyn MessageEncrypter>),
    rx: (u64, Box<dyn MessageDecrypter>),
}

impl RawRecords {
    fn connect(port: u16) -> RawRecords {
        let mut config = (*ClientOpts::version(Tls::V13).config()).clone();
        config.enable_secret_extraction = true;
        let name = "localhost".try_into().unwrap();
        let mut conn = rustls::ClientConnection::new(Arc::new(config), name).unwrap();
        let mut sock = tcp_connect(port);
        while conn.is_handshaking() {
            conn.complete_io(&mut sock).expect("handshake");
        }
        while conn.wants_write() {
            conn.write_tls(&mut sock).expect("client Finished");
        }
        let aead = conn
            .negotiated_cipher_suite()
            .and_then(|s| s.tls13())
            .expect("a TLS 1.3 suite")
            .aead_alg;
        let secrets = conn.dangerous_extract_secrets().expect("traffic secrets");
        let parts = |s: ConnectionTrafficSecrets| match s {
            ConnectionTrafficSecrets::Aes128Gcm { key, iv }
            | ConnectionTrafficSecrets::Aes256Gcm { key, iv }
            | ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv } => (key, iv),
            _ => panic!("an unexpected AEAD"),
        };
        let (tx_key, tx_iv) = parts(secrets.tx.1);
        let (rx_key, rx_iv) = parts(secrets.rx.1);
        RawRecords {
            sock,
            tx: (secrets.tx.0, aead.encrypter(tx_key, tx_iv)),
            rx: (secrets.rx.0, aead.decrypter(rx_key, rx_iv)),
        }
    }

    /// One record of inner content type `typ` holding `data` (`Unknown(0)` with zeros: a
    /// record with no content type at all).
    fn record(&mut self, typ: ContentType, data: &[u8]) -> Vec<u8> {
        let plain = OutboundPlainMessage {
            typ,
            version: ProtocolVersion::TLSv1_2,
            payload: OutboundChunks::Single(data),
        };
        let sealed = self.tx.1.encrypt(plain, self.tx.0).expect("encrypt");
        self.tx.0 += 1;
        sealed.encode()
    }

    /// The server's first alert, decrypted (other records, its session tickets, skipped), or
    /// how the connection ended without one.
    fn alert(&mut self) -> Result<Vec<u8>, String> {
        self.sock
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        loop {
            let mut header = [0u8; 5];
            if let Err(e) = self.sock.read_exact(&mut header) {
                return Err(format!("no alert: the connection ended ({e})"));
            }
            let len = u16::from_be_bytes([header[3], header[4]]) as usize;
            let mut body = vec![0u8; len];
            self.sock
                .read_exact(&mut body)
                .map_err(|e| format!("a record cut short: {e}"))?;
            if header[0] != 23 {
                return Err(format!("a plaintext record of type {}", header[0]));
            }
            let opaque = InboundOpaqueMessage::new(
                ContentType::ApplicationData,
                ProtocolVersion::TLSv1_2,
                &mut body,
            );
            let plain = self
                .rx
                .1
                .decrypt(opaque, self.rx.0)
                .map_err(|e| format!("a record that does not decrypt: {e}"))?;
            self.rx.0 += 1;
            if plain.typ == ContentType::Alert {
                return Ok(plain.payload.to_vec());
            }
        }
    }
}

#[test]
fn records_without_content_type_or_interleaved_with_a_key_update_get_unexpected_message() {
    if mode() == Mode::Kernel {
        // The kernel decrypts these records, not rustls: a record with no content type is
        // EBADMSG to it, as a record that fails to decrypt (bad_record_mac), and it stops at
        // the first fragment of a KeyUpdate (decode_error). docs/LIMITS.md, the rustls record errors.
        eprintln!("SKIPPED: the user plane's alerts (the kernel plane answers these itself)");
        return;
    }
    let server = Server::start();
    let port = server.port();
    let request = b"GET /hello.txt HTTP/1.1\r\nHost: localhost\r\n\r\n";
    let mut cases: Vec<(String, Records)> = vec![
        (
            "no content type".into(),
            vec![(ContentType::Unknown(0), vec![])],
        ),
        (
            "no content type, padded".into(),
            vec![(ContentType::Unknown(0), vec![0; 100])],
        ),
        (
            "no content type after a request".into(),
            vec![
                (ContentType::ApplicationData, request.to_vec()),
                (ContentType::Unknown(0), vec![0; 10]),
            ],
        ),
    ];
    let key_update = [24u8, 0, 0, 1, 0];
    for split in 1..key_update.len() {
        cases.push((
            format!("a KeyUpdate split after {split} bytes around application data"),
            vec![
                (ContentType::Handshake, key_update[..split].to_vec()),
                (ContentType::ApplicationData, request.to_vec()),
                (ContentType::Handshake, key_update[split..].to_vec()),
            ],
        ));
    }
    for (what, records) in cases {
        let mut c = RawRecords::connect(port);
        let wire: Vec<u8> = records
            .iter()
            .flat_map(|(typ, data)| c.record(*typ, data))
            .collect();
        c.sock.write_all(&wire).expect("sending the records");
        assert_eq!(c.alert(), Ok(UNEXPECTED_MESSAGE.to_vec()), "{what}");
    }
    let lines = server.stderr_lines();
    assert!(
        !lines.iter().any(|l| l.contains("panicked")),
        "{}",
        lines.join("\n")
    );
    server.stop();
}
