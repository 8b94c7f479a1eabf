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
    /// Who issued the ticket, when it is one of the shared keys (`ServerOptions::ticket_keys`).
    pub ticket_issuer: Option<crate::tickets::TicketIssuer>,
    /// TLS 1.3 PSK identities offered (rustls tries each until one resumes).
    pub psk_identities: usize,
}

/// What the buffered bytes are, so far.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Peek {
    /// The ClientHello has started but is not complete yet.
    More,
    /// Its header claims more than the cap: refuse without reading it.
    TooLarge(usize),
    /// It is still incomplete after this many records (the cap) and another one starts:
    /// refuse without reading further.
    TooManyRecords(usize),
    /// A handshake record claims a fragment longer than a plaintext record may carry (this
    /// many bytes): record_overflow (RFC 8446 §5.1), from its header.
    RecordOverflow(usize),
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
/// Handshake message header: type (1) and length (3).
const HS_HEADER_LEN: usize = 4;
/// The longest fragment of a plaintext record (2^14, RFC 8446 §5.1; RFC 5246 §6.2.1). rustls
/// allows ciphertext's expansion on every record, encrypted or not, so a longer hello record
/// is refused here, from its header: waiting for its body would only let a client hold the
/// connection longer.
const MAX_PLAINTEXT_FRAGMENT: usize = 16384;

/// The ClientHello as read so far, kept between reads so that each read costs only its new
/// bytes. Reading it again from the start of the input on every read made a hello sent in
/// 1-byte records quadratic: 16 KB in 16,384 records took 1.6 s of CPU.
///
/// The input itself is left as it is (rustls reads it from its first byte afterwards); only
/// the handshake message is copied out, once, when its records span more than one.
#[derive(Default)]
pub(crate) struct HelloReader {
    /// Where the first record not yet taken into `joined` starts in the input.
    next_record: usize,
    /// Whole records taken so far.
    records: usize,
    /// The handshake message's bytes from those records (empty while one record may hold it
    /// all, which is then read in place).
    joined: Vec<u8>,
}

impl HelloReader {
    /// Looks at a connection's input (`buf` from its first byte, the same bytes as in the
    /// previous call and maybe more). `max_len` caps the message, `max_records` the records it
    /// may span. `ticketer` decrypts offered tickets (a few AEAD bytes, ~1 µs; rustls does it
    /// again if it resumes).
    pub(crate) fn peek(
        &mut self,
        buf: &[u8],
        max_len: usize,
        max_records: usize,
        ticketer: Ticketer<'_>,
    ) -> Peek {
        loop {
            let pos = self.next_record;
            let Some(header) = buf.get(pos..pos + 5) else {
                return Peek::More;
            };
            if header[0] != CT_HANDSHAKE {
                return Peek::NotHello;
            }
            let rec_len = u16::from_be_bytes([header[3], header[4]]) as usize;
            if rec_len > MAX_PLAINTEXT_FRAGMENT {
                return Peek::RecordOverflow(rec_len);
            }
            if rec_len == 0 {
                // rustls refuses an empty handshake fragment from its header (a flood of them
                // costs nothing to send).
                return Peek::NotHello;
            }
            if self.records >= max_records {
                return Peek::TooManyRecords(self.records);
            }
            let end = pos + 5 + rec_len;
            let frag = &buf[pos + 5..end.min(buf.len())];
            // The message header, as soon as it is in (a few bytes, wherever they came from):
            // a wrong type or an oversized length is refused before the rest is waited for.
            let len = match self.message_len(frag) {
                None => None,
                Some((HS_CLIENT_HELLO, len)) if len > max_len => return Peek::TooLarge(len),
                Some((HS_CLIENT_HELLO, len)) => Some(len),
                Some(_) => return Peek::NotHello,
            };
            if end > buf.len() {
                return Peek::More;
            }
            self.next_record = end;
            self.records += 1;
            let Some(len) = len else {
                self.joined.extend_from_slice(frag);
                continue;
            };
            if self.joined.is_empty() && frag.len() >= HS_HEADER_LEN + len {
                // One record holds it all, the usual case: read it in place.
                return Peek::Hello(info(&frag[HS_HEADER_LEN..][..len], ticketer));
            }
            self.joined.extend_from_slice(frag);
            if self.joined.len() >= HS_HEADER_LEN + len {
                return Peek::Hello(info(&self.joined[HS_HEADER_LEN..][..len], ticketer));
            }
        }
    }

    /// The handshake message's type and length, once its header is in `joined` followed by
    /// `frag` (None before that).
    fn message_len(&self, frag: &[u8]) -> Option<(u8, usize)> {
        let mut head = [0u8; HS_HEADER_LEN];
        let have = self.joined.len().min(HS_HEADER_LEN);
        head[..have].copy_from_slice(&self.joined[..have]);
        let need = HS_HEADER_LEN - have;
        head[have..].copy_from_slice(frag.get(..need)?);
        Some((
            head[0],
            u32::from_be_bytes([0, head[1], head[2], head[3]]) as usize,
        ))
    }
}

/// What a whole ClientHello body offers.
fn info(body: &[u8], ticketer: Ticketer<'_>) -> HelloInfo {
    let ext = Extensions::find(body).unwrap_or_default();
    // Some(issuer if known): the ticket opens.
    let opened = ext.ticket.and_then(|t| match ticketer.1 {
        Some(ring) => ring.issuer_of(t).map(Some),
        None => ticketer.0.decrypt(t).map(|plain| {
            // The session state inside holds the resumption secret.
            drop(zeroize::Zeroizing::new(plain));
            None
        }),
    });
    HelloInfo {
        len: body.len(),
        resumption: opened.is_some(),
        server_name: ext.server_name.and_then(host_name),
        ticket_issuer: opened.flatten(),
        psk_identities: ext.psk_identities,
    }
}

/// The ticketer, and the same as a ring of shared keys when it is one (which tells who
/// issued a ticket).
pub(crate) type Ticketer<'a> = (
    &'a dyn ProducesTickets,
    Option<&'a crate::tickets::TicketKeyRing>,
);

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
    /// The PSK identities offered (TLS 1.3).
    psk_identities: usize,
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
                    identities.take(4)?; // obfuscated_ticket_age
                    found.psk_identities = 1;
                    while !identities.0.is_empty() {
                        identities.vec16()?;
                        identities.take(4)?;
                        found.psk_identities += 1;
                    }
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

    const MAX_RECORDS: usize = crate::config::DEFAULT_MAX_CLIENT_HELLO_RECORDS;

    fn peek_all(wire: &[u8]) -> Peek {
        HelloReader::default().peek(wire, 16384, usize::MAX, (&OneTicket(OURS), None))
    }

    /// Feeds `wire` to one reader in steps of `step` bytes, as reads would bring it; every
    /// answer before the last must be `More`.
    fn peek_in_steps(wire: &[u8], step: usize, max_records: usize) -> Peek {
        let mut reader = HelloReader::default();
        let mut upto = 0;
        loop {
            upto = (upto + step).min(wire.len());
            let got = reader.peek(&wire[..upto], 16384, max_records, (&OneTicket(OURS), None));
            if got != Peek::More || upto == wire.len() {
                return got;
            }
        }
    }

    #[test]
    fn every_psk_identity_is_counted() {
        // Five identities, the first ours: counted whole, the first still opened.
        let mut ids = Vec::new();
        for id in [OURS, b"b", b"c", b"d", b"e"] {
            ids.extend_from_slice(&(id.len() as u16).to_be_bytes());
            ids.extend_from_slice(id);
            ids.extend_from_slice(&[0, 0, 0, 1]);
        }
        let mut data = (ids.len() as u16).to_be_bytes().to_vec();
        data.extend_from_slice(&ids);
        data.extend_from_slice(&[0, 33, 32]);
        data.extend_from_slice(&[0u8; 32]);
        let Peek::Hello(info) =
            peek_all(&records(&hello(&[ext(EXT_PRE_SHARED_KEY, &data)]), 16384))
        else {
            panic!("not a hello");
        };
        assert_eq!((info.psk_identities, info.resumption), (5, true));
        // A list cut inside an identity is malformed: counted as no ticket at all.
        let cut = &ids[..ids.len() - 3];
        let mut data = (cut.len() as u16).to_be_bytes().to_vec();
        data.extend_from_slice(cut);
        let Peek::Hello(info) =
            peek_all(&records(&hello(&[ext(EXT_PRE_SHARED_KEY, &data)]), 16384))
        else {
            panic!("not a hello");
        };
        assert_eq!((info.psk_identities, info.resumption), (0, false));
    }

    #[test]
    fn full_and_resumed_hellos_are_told_apart() {
        let full = hello(&[ext(0, b"\0\0")]);
        let ours = hello(&[ext(0, b"\0\0"), ext(EXT_PRE_SHARED_KEY, &psk(OURS))]);
        let foreign = hello(&[ext(EXT_PRE_SHARED_KEY, &psk(b"someone-elses"))]);
        let tls12 = hello(&[ext(EXT_SESSION_TICKET, OURS)]);
        let tls12_empty = hello(&[ext(EXT_SESSION_TICKET, b"")]);
        for (msg, resumption, psk_identities) in [
            (&full, false, 0),
            (&ours, true, 1),
            (&foreign, false, 1),
            (&tls12, true, 0),
            (&tls12_empty, false, 0),
        ] {
            let want = Peek::Hello(HelloInfo {
                len: msg.len() - 4,
                resumption,
                server_name: None,
                ticket_issuer: None,
                psk_identities,
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
    fn fed_in_pieces_it_reads_as_fed_whole() {
        let msgs = [
            hello(&[sni(b"a.test")]),
            hello(&[sni(b"a.test"), ext(EXT_PRE_SHARED_KEY, &psk(OURS))]),
            hello(&[ext(21, &[0; 3000])]),
        ];
        for msg in &msgs {
            for frag in [1, 2, 3, 5, 100, 16384] {
                let wire = records(msg, frag);
                let whole = peek_all(&wire);
                assert!(matches!(whole, Peek::Hello(_)), "{whole:?}");
                // One record per read, and a byte (or a few) per read.
                assert_eq!(
                    peek_in_steps(&wire, frag + 5, usize::MAX),
                    whole,
                    "frag {frag}"
                );
                for step in [1, 3, 7] {
                    assert_eq!(peek_in_steps(&wire, step, usize::MAX), whole, "frag {frag}");
                }
            }
        }
    }

    /// `msg` cut into exactly `n` handshake records (of sizes differing by one at most).
    fn n_records(msg: &[u8], n: usize) -> Vec<u8> {
        let mut out = Vec::new();
        let mut from = 0;
        for i in 1..=n {
            let to = msg.len() * i / n;
            out.extend_from_slice(&records(&msg[from..to], 16384));
            from = to;
        }
        out
    }

    #[test]
    fn hello_over_too_many_records_is_refused_at_the_first_extra_one() {
        let msg = hello(&[sni(b"a.test")]);
        // Exactly at the cap: served.
        let wire = n_records(&msg, MAX_RECORDS);
        assert_eq!(wire.len(), msg.len() + 5 * MAX_RECORDS);
        assert!(matches!(
            peek_in_steps(&wire, 1, MAX_RECORDS),
            Peek::Hello(_)
        ));
        // One more record: refused once its header is in, without its body.
        let wire = n_records(&msg, MAX_RECORDS + 1);
        let extra_header_end = (MAX_RECORDS * 5 + msg.len() * MAX_RECORDS / (MAX_RECORDS + 1)) + 5;
        for step in [1, 6, wire.len()] {
            let mut reader = HelloReader::default();
            let mut upto = 0;
            let got = loop {
                upto = (upto + step).min(wire.len());
                match reader.peek(&wire[..upto], 16384, MAX_RECORDS, (&OneTicket(OURS), None)) {
                    Peek::More => continue,
                    other => break other,
                }
            };
            assert_eq!(got, Peek::TooManyRecords(MAX_RECORDS), "step {step}");
            assert!(
                upto < extra_header_end + step,
                "step {step}: read up to {upto}"
            );
        }
        // A large hello in 1-byte records: refused after the cap, not after 16 K records.
        let big = records(&hello(&[ext(21, &[0; 16000])]), 1);
        assert_eq!(
            peek_in_steps(&big, 6, MAX_RECORDS),
            Peek::TooManyRecords(MAX_RECORDS)
        );
    }

    /// Each read costs its new bytes only: 16 KB in 1-byte records, one record per call and no
    /// record cap, took 1.6 s when every call re-read the input from its start.
    #[test]
    fn one_record_per_read_is_linear() {
        let msg = hello(&[ext(21, &[0; 16000])]);
        let wire = records(&msg, 1);
        let started = std::time::Instant::now();
        assert!(matches!(
            peek_in_steps(&wire, 6, usize::MAX),
            Peek::Hello(h) if h.len == msg.len() - 4
        ));
        let took = started.elapsed();
        assert!(
            took < std::time::Duration::from_millis(300),
            "{} records took {took:?}",
            wire.len() / 6
        );
    }

    #[test]
    fn other_input_is_left_to_rustls() {
        assert_eq!(peek_all(b"GET / HTTP/1.1\r\n"), Peek::NotHello);
        assert_eq!(peek_all(&[21, 3, 3, 0, 2, 2, 40]), Peek::NotHello);
        // A handshake record holding a ServerHello.
        assert_eq!(peek_all(&records(&[2, 0, 0, 1, 0], 100)), Peek::NotHello);
        assert_eq!(peek_all(&[22, 3, 1, 0, 0, 22, 3, 1, 0, 0]), Peek::NotHello);
        // Empty records after a start: refused by rustls from their headers, so not waited for.
        let mut wire = records(&hello(&[]), 1);
        wire.truncate(6 * 3);
        wire.extend_from_slice(&[22, 3, 1, 0, 0]);
        assert_eq!(peek_all(&wire), Peek::NotHello);
    }

    /// A plaintext record carries 2^14 bytes at most: one more is refused from its header,
    /// first record or a later one, however much of it came.
    #[test]
    fn oversized_records_overflow() {
        let msg = hello(&[ext(21, &[0; 16000])]);
        assert!(matches!(peek_all(&records(&msg, 16384)), Peek::Hello(_)));
        let mut wire = vec![22, 3, 1, 0x40, 0x01];
        wire.extend_from_slice(&msg[..4]);
        assert_eq!(peek_all(&wire), Peek::RecordOverflow(16385));
        let mut wire = records(&msg[..100], 100);
        wire.extend_from_slice(&[22, 3, 1, 0xff, 0xff]);
        assert_eq!(peek_all(&wire), Peek::RecordOverflow(0xffff));
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
