//! A look at the ClientHello before rustls spends any crypto on it: its size, its server name
//! (which site it is for), and whether it carries a session ticket this server issued. Admission needs both before the ECDHE and the
//! signature (a flood is cheap only if refusing it is cheaper), and rustls decides on a
//! resumption inside the same call that does that crypto, so it cannot tell us in time.
//!
//! This reads, it never decides the protocol: rustls still parses and validates the whole
//! message afterwards. Anything this cannot make sense of is left to rustls ("not a hello"),
//! and a malformed extension list only makes the hello count as a full handshake.

use rustls::server::ProducesTickets;

/// What a ClientHello tells before the server answers it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HelloInfo {
    /// Length of the handshake message (its body, as its header says).
    pub len: usize,
    /// It offers a session ticket (TLS 1.3 PSK identity or TLS 1.2 SessionTicket) that this
    /// server's ticketer decrypts: rustls will resume, not run a full handshake, unless the
    /// binder or the ticket's age is wrong (then the handshake fails, still without a
    /// signature). Session-ID resumption (TLS 1.2 without tickets) counts as full.
    pub resumption: bool,
    /// The host name it asks for (SNI), lowercased, when it sends one that is plain ASCII
    /// (rustls validates it afterwards).
    pub server_name: Option<String>,
}

/// What the buffered bytes are, so far.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Peek {
    /// The ClientHello has started but is not complete yet.
    More,
    /// Its header claims more than the cap: refuse without reading it.
    TooLarge(usize),
    /// The whole ClientHello is buffered.
    Hello(HelloInfo),
    /// Not a ClientHello in handshake records: rustls will say what is wrong with it.
    NotHello,
}

const CT_HANDSHAKE: u8 = 22;
const HS_CLIENT_HELLO: u8 = 1;
const EXT_SERVER_NAME: u16 = 0;
const EXT_SESSION_TICKET: u16 = 35;
const EXT_PRE_SHARED_KEY: u16 = 41;

/// Looks at the start of a connection's input (`buf` from its first byte). `ticketer`
/// decrypts offered tickets (a few AEAD bytes, ~1 µs; rustls does it again if it resumes).
pub(crate) fn peek(buf: &[u8], max_len: usize, ticketer: &dyn ProducesTickets) -> Peek {
    let mut pos = 0;
    // The message reassembled from record fragments; borrowed when one record holds it all.
    let mut joined: Vec<u8> = Vec::new();
    while pos + 5 <= buf.len() {
        if buf[pos] != CT_HANDSHAKE {
            return Peek::NotHello;
        }
        let rec_len = u16::from_be_bytes([buf[pos + 3], buf[pos + 4]]) as usize;
        let frag = &buf[pos + 5..buf.len().min(pos + 5 + rec_len)];
        let msg: &[u8] = if pos == 0 && frag.len() >= 4 {
            frag
        } else {
            joined.extend_from_slice(frag);
            &joined
        };
        if msg.len() >= 4 {
            if msg[0] != HS_CLIENT_HELLO {
                return Peek::NotHello;
            }
            let len = u32::from_be_bytes([0, msg[1], msg[2], msg[3]]) as usize;
            if len > max_len {
                return Peek::TooLarge(len);
            }
            if msg.len() >= 4 + len {
                let ext = Extensions::find(&msg[4..4 + len]).unwrap_or_default();
                return Peek::Hello(HelloInfo {
                    len,
                    resumption: ext.ticket.is_some_and(|t| ticketer.decrypt(t).is_some()),
                    server_name: ext.server_name.and_then(host_name),
                });
            }
        }
        if frag.len() < rec_len {
            return Peek::More;
        }
        if rec_len == 0 {
            // Empty handshake fragments: rustls limits those; do not walk a flood of them.
            return Peek::NotHello;
        }
        if pos == 0 && joined.is_empty() {
            joined.extend_from_slice(frag);
        }
        pos += 5 + rec_len;
    }
    Peek::More
}

/// A cursor over the ClientHello body; every read is bounds-checked (None: malformed).
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }
    fn u8(&mut self) -> Option<usize> {
        self.take(1).map(|b| b[0] as usize)
    }
    fn u16(&mut self) -> Option<usize> {
        self.take(2)
            .map(|b| u16::from_be_bytes([b[0], b[1]]) as usize)
    }
    fn vec8(&mut self) -> Option<&'a [u8]> {
        let n = self.u8()?;
        self.take(n)
    }
    fn vec16(&mut self) -> Option<&'a [u8]> {
        let n = self.u16()?;
        self.take(n)
    }
}

/// What the ClientHello's extensions offer, as far as admission and site choice care.
#[derive(Default)]
struct Extensions<'a> {
    /// The first ticket offered: the first PSK identity (TLS 1.3), else a non-empty
    /// SessionTicket extension (TLS 1.2).
    ticket: Option<&'a [u8]>,
    /// The first host_name of the server_name extension.
    server_name: Option<&'a [u8]>,
}

impl<'a> Extensions<'a> {
    /// None: the message is malformed (a resumption is then not counted on, and rustls will
    /// refuse it anyway).
    fn find(body: &'a [u8]) -> Option<Self> {
        let mut r = Reader(body);
        r.take(2 + 32)?; // legacy_version, random
        r.vec8()?; // legacy_session_id
        r.vec16()?; // cipher_suites
        r.vec8()?; // legacy_compression_methods
        let mut exts = Reader(r.vec16()?);
        let mut found = Self::default();
        let mut tls12_ticket = None;
        while !exts.0.is_empty() {
            let typ = exts.u16()? as u16;
            let data = exts.vec16()?;
            match typ {
                EXT_SERVER_NAME => {
                    let mut names = Reader(Reader(data).vec16()?);
                    while !names.0.is_empty() {
                        let kind = names.u8()?;
                        let name = names.vec16()?;
                        if kind == 0 && found.server_name.is_none() {
                            found.server_name = Some(name);
                        }
                    }
                }
                EXT_PRE_SHARED_KEY => {
                    // Always the last extension (RFC 8446 4.2.11).
                    let mut identities = Reader(Reader(data).vec16()?);
                    let identity = identities.vec16()?;
                    found.ticket = (!identity.is_empty()).then_some(identity);
                    return Some(found);
                }
                EXT_SESSION_TICKET if !data.is_empty() => tls12_ticket = Some(data),
                _ => {}
            }
        }
        found.ticket = tls12_ticket;
        Some(found)
    }
}

/// A host name as sites are looked up by: ASCII, lowercased, no trailing dot.
fn host_name(raw: &[u8]) -> Option<String> {
    let s = std::str::from_utf8(raw).ok()?;
    let s = s.strip_suffix('.').unwrap_or(s);
    (!s.is_empty() && s.is_ascii()).then(|| s.to_ascii_lowercase())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Decrypts exactly one ticket.
    #[derive(Debug)]
    struct OneTicket(&'static [u8]);

    impl ProducesTickets for OneTicket {
        fn enabled(&self) -> bool {
            true
        }
        fn lifetime(&self) -> u32 {
            60
        }
        fn encrypt(&self, _plain: &[u8]) -> Option<Vec<u8>> {
            None
        }
        fn decrypt(&self, cipher: &[u8]) -> Option<Vec<u8>> {
            (cipher == self.0).then(|| b"state".to_vec())
        }
    }

    const OURS: &[u8] = b"our-ticket";

    fn ext(typ: u16, data: &[u8]) -> Vec<u8> {
        let mut e = typ.to_be_bytes().to_vec();
        e.extend_from_slice(&(data.len() as u16).to_be_bytes());
        e.extend_from_slice(data);
        e
    }

    fn psk(identity: &[u8]) -> Vec<u8> {
        let mut ids = (identity.len() as u16).to_be_bytes().to_vec();
        ids.extend_from_slice(identity);
        ids.extend_from_slice(&[0, 0, 0, 1]); // obfuscated_ticket_age
        let mut d = (ids.len() as u16).to_be_bytes().to_vec();
        d.extend_from_slice(&ids);
        d.extend_from_slice(&[0, 33, 32]); // binders: one of 32 bytes
        d.extend_from_slice(&[7; 32]);
        d
    }

    /// A ClientHello handshake message with these extensions.
    fn hello(exts: &[Vec<u8>]) -> Vec<u8> {
        let mut b = vec![3, 3];
        b.extend_from_slice(&[1; 32]);
        b.push(32);
        b.extend_from_slice(&[2; 32]);
        b.extend_from_slice(&[0, 2, 0x13, 0x01, 1, 0]);
        let all: Vec<u8> = exts.concat();
        b.extend_from_slice(&(all.len() as u16).to_be_bytes());
        b.extend_from_slice(&all);
        let mut m = vec![HS_CLIENT_HELLO];
        m.extend_from_slice(&(b.len() as u32).to_be_bytes()[1..]);
        m.extend_from_slice(&b);
        m
    }

    /// `msg` cut into handshake records of at most `frag` bytes.
    fn records(msg: &[u8], frag: usize) -> Vec<u8> {
        let mut out = Vec::new();
        for c in msg.chunks(frag) {
            out.extend_from_slice(&[CT_HANDSHAKE, 3, 1]);
            out.extend_from_slice(&(c.len() as u16).to_be_bytes());
            out.extend_from_slice(c);
        }
        out
    }

    fn peek_all(wire: &[u8]) -> Peek {
        peek(wire, 16384, &OneTicket(OURS))
    }

    #[test]
    fn full_and_resumed_hellos_are_told_apart() {
        let full = hello(&[ext(0, b"\0\0")]);
        let ours = hello(&[ext(0, b"\0\0"), ext(EXT_PRE_SHARED_KEY, &psk(OURS))]);
        let foreign = hello(&[ext(EXT_PRE_SHARED_KEY, &psk(b"someone-elses"))]);
        let tls12 = hello(&[ext(EXT_SESSION_TICKET, OURS)]);
        let tls12_empty = hello(&[ext(EXT_SESSION_TICKET, b"")]);
        for (msg, resumption) in [
            (&full, false),
            (&ours, true),
            (&foreign, false),
            (&tls12, true),
            (&tls12_empty, false),
        ] {
            let want = Peek::Hello(HelloInfo {
                len: msg.len() - 4,
                resumption,
                server_name: None,
            });
            assert_eq!(peek_all(&records(msg, 16384)), want);
            // The same, fragmented over many records.
            assert_eq!(peek_all(&records(msg, 7)), want);
        }
    }

    fn sni(name: &[u8]) -> Vec<u8> {
        let mut entry = vec![0];
        entry.extend_from_slice(&(name.len() as u16).to_be_bytes());
        entry.extend_from_slice(name);
        let mut d = (entry.len() as u16).to_be_bytes().to_vec();
        d.extend_from_slice(&entry);
        ext(EXT_SERVER_NAME, &d)
    }

    #[test]
    fn server_name_is_read_with_or_without_a_ticket() {
        let name_of = |msg: &[u8]| match peek_all(&records(msg, 16384)) {
            Peek::Hello(h) => (h.server_name, h.resumption),
            other => panic!("{other:?}"),
        };
        assert_eq!(
            name_of(&hello(&[sni(b"WWW.Example.com.")])),
            (Some("www.example.com".into()), false)
        );
        assert_eq!(
            name_of(&hello(&[
                sni(b"a.test"),
                ext(EXT_PRE_SHARED_KEY, &psk(OURS))
            ])),
            (Some("a.test".into()), true)
        );
        assert_eq!(name_of(&hello(&[sni(b"\xff\xfe")])), (None, false));
        assert_eq!(name_of(&hello(&[ext(21, b"")])), (None, false));
    }

    #[test]
    fn partial_input_asks_for_more_and_never_reads_out_of_bounds() {
        let msg = hello(&[ext(EXT_PRE_SHARED_KEY, &psk(OURS))]);
        for frag in [3, 16384] {
            let wire = records(&msg, frag);
            for cut in 0..wire.len() {
                assert_eq!(peek_all(&wire[..cut]), Peek::More, "cut at {cut}");
            }
        }
    }

    #[test]
    fn oversized_hello_is_refused_from_its_header() {
        let big = hello(&[ext(21, &vec![0; 20_000])]);
        let wire = records(&big, 16384);
        assert_eq!(peek_all(&wire[..9]), Peek::TooLarge(big.len() - 4));
    }

    #[test]
    fn other_input_is_left_to_rustls() {
        assert_eq!(peek_all(b"GET / HTTP/1.1\r\n"), Peek::NotHello);
        assert_eq!(peek_all(&[21, 3, 3, 0, 2, 2, 40]), Peek::NotHello);
        // A handshake record holding a ServerHello.
        assert_eq!(peek_all(&records(&[2, 0, 0, 1, 0], 100)), Peek::NotHello);
        assert_eq!(peek_all(&[22, 3, 1, 0, 0, 22, 3, 1, 0, 0]), Peek::NotHello);
    }

    #[test]
    fn malformed_extensions_count_as_full() {
        let mut msg = hello(&[ext(EXT_PRE_SHARED_KEY, &psk(OURS))]);
        // Claim a longer extension list than there is.
        let n = msg.len();
        msg[n - ext(EXT_PRE_SHARED_KEY, &psk(OURS)).len() - 1] += 1;
        match peek_all(&records(&msg, 16384)) {
            Peek::Hello(h) => assert!(!h.resumption),
            other => panic!("{other:?}"),
        }
    }
}
