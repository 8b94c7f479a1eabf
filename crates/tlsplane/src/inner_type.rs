//! TLS 1.3 records that RFC 8446 answers with `unexpected_message` and rustls (0.23) refuses
//! without any alert, leaving the client a bare FIN:
//!
//! - a record whose inner plaintext is all zeros, so has no content type (§5.4), which rustls
//!   reports as `IllegalTlsInnerPlaintext`;
//! - a record of another type between two fragments of a handshake message (§5.1: "Handshake
//!   messages MUST NOT be interleaved with other record types"), `MessageInterleavedWith
//!   HandshakeMessage`, as a KeyUpdate split around application data.
//!
//! rustls has no way to send an alert of our choosing, and once it has failed its connection
//! gives up neither its keys nor its record layer. So the decrypter of each TLS 1.3 suite is
//! wrapped: it sees every record rustls decrypts, and reports both cases as the one decryption
//! error rustls answers with an encrypted `unexpected_message` alert of its own (a protected
//! change_cipher_spec, §5). The connection's error then names that instead of the real cause;
//! the alert on the wire is the one the RFC asks for. The kernel plane decrypts without rustls
//! and is not affected (see `plane::kernel`).

use rustls::crypto::cipher::{
    AeadKey, InboundOpaqueMessage, InboundPlainMessage, Iv, MessageDecrypter, MessageEncrypter,
    Tls13AeadAlgorithm, UnsupportedOperationError,
};
use rustls::{ConnectionTrafficSecrets, ContentType, Error, PeerMisbehaved};

/// `suite` with its decrypter checking inner content types and handshake framing. Leaked
/// once per suite (suites are `'static` in rustls).
pub(crate) fn checked(suite: rustls::SupportedCipherSuite) -> rustls::SupportedCipherSuite {
    let rustls::SupportedCipherSuite::Tls13(inner) = suite else {
        return suite;
    };
    let aead_alg: &'static CheckedAead = Box::leak(Box::new(CheckedAead(inner.aead_alg)));
    rustls::SupportedCipherSuite::Tls13(Box::leak(Box::new(rustls::Tls13CipherSuite {
        common: rustls::CipherSuiteCommon {
            suite: inner.common.suite,
            hash_provider: inner.common.hash_provider,
            confidentiality_limit: inner.common.confidentiality_limit,
        },
        hkdf_provider: inner.hkdf_provider,
        aead_alg,
        quic: inner.quic,
    })))
}

struct CheckedAead(&'static dyn Tls13AeadAlgorithm);

impl Tls13AeadAlgorithm for CheckedAead {
    fn encrypter(&self, key: AeadKey, iv: Iv) -> Box<dyn MessageEncrypter> {
        self.0.encrypter(key, iv)
    }

    fn decrypter(&self, key: AeadKey, iv: Iv) -> Box<dyn MessageDecrypter> {
        Box::new(CheckedDecrypter {
            inner: self.0.decrypter(key, iv),
            framing: Framing::default(),
        })
    }

    fn key_len(&self) -> usize {
        self.0.key_len()
    }

    fn extract_keys(
        &self,
        key: AeadKey,
        iv: Iv,
    ) -> Result<ConnectionTrafficSecrets, UnsupportedOperationError> {
        self.0.extract_keys(key, iv)
    }

    fn fips(&self) -> bool {
        self.0.fips()
    }
}

struct CheckedDecrypter {
    inner: Box<dyn MessageDecrypter>,
    /// Handshake messages under this key (a key changes only between messages).
    framing: Framing,
}

/// The error rustls answers with an `unexpected_message` alert from its decryption path.
fn unexpected_message() -> Error {
    PeerMisbehaved::IllegalMiddleboxChangeCipherSpec.into()
}

impl MessageDecrypter for CheckedDecrypter {
    fn decrypt<'a>(
        &mut self,
        msg: InboundOpaqueMessage<'a>,
        seq: u64,
    ) -> Result<InboundPlainMessage<'a>, Error> {
        let plain = match self.inner.decrypt(msg, seq) {
            Err(Error::PeerMisbehaved(PeerMisbehaved::IllegalTlsInnerPlaintext)) => {
                return Err(unexpected_message())
            }
            other => other?,
        };
        if plain.typ == ContentType::Handshake {
            self.framing.feed(plain.payload);
        } else if self.framing.mid_message() {
            return Err(unexpected_message());
        }
        Ok(plain)
    }
}

/// Where the handshake messages of a record stream stand: their 4-byte headers (type, 24-bit
/// length) as they come, and how much of the current message's body is still to come.
#[derive(Default)]
struct Framing {
    header: usize,
    length: [u8; 3],
    body_left: usize,
}

impl Framing {
    fn feed(&mut self, mut data: &[u8]) {
        while !data.is_empty() {
            if self.body_left > 0 {
                let n = self.body_left.min(data.len());
                self.body_left -= n;
                data = &data[n..];
                continue;
            }
            if self.header > 0 {
                self.length[self.header - 1] = data[0];
            }
            self.header += 1;
            data = &data[1..];
            if self.header == 4 {
                self.header = 0;
                self.body_left =
                    u32::from_be_bytes([0, self.length[0], self.length[1], self.length[2]])
                        as usize;
            }
        }
    }

    fn mid_message(&self) -> bool {
        self.header > 0 || self.body_left > 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn framing_follows_messages_across_records() {
        let mut f = Framing::default();
        // A KeyUpdate in one record, then split after each of its bytes.
        f.feed(&[24, 0, 0, 1, 0]);
        assert!(!f.mid_message());
        for split in 1..5 {
            let msg = [24u8, 0, 0, 1, 1];
            f.feed(&msg[..split]);
            assert!(f.mid_message(), "after {split} bytes");
            f.feed(&msg[split..]);
            assert!(!f.mid_message(), "whole after a split at {split}");
        }
        // Two messages in a record, the second cut short; an empty-bodied one is whole.
        f.feed(&[4, 0, 0, 2, 9, 9, 24, 0]);
        assert!(f.mid_message());
        f.feed(&[0, 1, 0, 20, 0, 0, 0]);
        assert!(!f.mid_message());
        // A long body spread over records.
        f.feed(&[11, 0, 1, 0]);
        f.feed(&[0; 200]);
        assert!(f.mid_message());
        f.feed(&[0; 56]);
        assert!(!f.mid_message());
    }
}
