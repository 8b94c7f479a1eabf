//! The opening of a server-side h2 connection, kept without h2 until the client's first
//! request, so that a connection that never asks for anything costs what an idle HTTP/1.1
//! connection costs.
//!
//! h2 allocates ~28 KiB of buffers when a connection starts (its write buffer, the frame
//! reader's buffer, the HPACK decoder's scratch) and keeps them for the connection's life;
//! they were most of the 40 KiB an idle h2 connection cost against nginx's 15 (docs/HTTP2.md,
//! "Measured (step 3)"). Many h2 connections never send a request, or not for a long while:
//! browsers' preconnects, pools kept warm, and an attacker holding connections open. Before
//! the first request the protocol state is tiny: our SETTINGS (the same bytes for every
//! connection), the client's SETTINGS and connection window increments, and acknowledgements.
//!
//! So [`Greeting`] takes the client's opening frames (the preface, SETTINGS, the SETTINGS
//! acknowledgement, connection WINDOW_UPDATE: nothing else, each checked as h2 would) and says
//! which SETTINGS acknowledgements to send; the product sends them, having first sent
//! [`opening`] (what h2 itself sends first). At the first frame of any other kind, or anything
//! it does not take as plainly valid, it hands over ([`Greeting::wake`]): h2 is started, reads
//! everything the client sent from the start, and its first bytes out, which the client
//! already had from us, are checked and dropped by the transport
//! ([`crate::transport::Woken`]). h2 so sees the whole connection and decides everything it
//! decides today (errors, floods, settings); the greeting only delays its start. It does no
//! I/O (the products' loops do), so it is tested and fuzzed in memory.

use std::future::Future as _;
use std::sync::OnceLock;
use std::task::{Context, Poll, Waker};

use crate::transport::{H2Io, Woken};

/// The client connection preface's fixed part (RFC 9113 §3.4); a SETTINGS frame follows.
pub const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// A SETTINGS frame with the ACK flag.
pub const SETTINGS_ACK: [u8; 9] = [0, 0, 0, 0x4, 0x1, 0, 0, 0, 0];
/// GOAWAY(NO_ERROR) naming stream 0: no stream was processed, a client may retry any.
pub const GOAWAY_NONE_PROCESSED: [u8; 17] = [
    0, 0, 8, 0x7, 0, 0, 0, 0, 0, // header: 8 bytes, GOAWAY, stream 0
    0, 0, 0, 0, // last stream id 0
    0, 0, 0, 0, // NO_ERROR
];

/// Frames after the preface taken before h2 is woken anyway: a conformant client sends one
/// SETTINGS, its acknowledgement of ours and a WINDOW_UPDATE or two; more is h2's to judge
/// (a SETTINGS flood among them).
const MAX_FRAMES: usize = 6;
/// Bytes held for h2: the preface and [`MAX_FRAMES`] frames of at most 60 bytes of payload
/// (ten settings).
const MAX_HELD: usize = PREFACE.len() + MAX_FRAMES * (FRAME_HEADER + MAX_SETTINGS_PAYLOAD);
const MAX_SETTINGS_PAYLOAD: usize = 60;
const FRAME_HEADER: usize = 9;
const SETTINGS: u8 = 0x4;
const WINDOW_UPDATE: u8 = 0x8;
const ACK: u8 = 0x1;
/// The initial connection flow-control window (RFC 9113 §6.9.2) and the largest (§6.9.1).
const INITIAL_WINDOW: u64 = 65_535;
const MAX_WINDOW: u64 = (1 << 31) - 1;

/// What the client's bytes so far call for.
#[derive(Debug, PartialEq, Eq)]
pub enum Heard {
    /// Keep waiting; first send this many SETTINGS acknowledgements ([`SETTINGS_ACK`]).
    Asleep { acks: usize },
    /// Start h2 now, with [`Greeting::wake`].
    Wake,
}

/// The client's side of a connection's opening, until h2 takes over.
#[derive(Default)]
pub struct Greeting {
    /// Everything the client sent, for h2 to read from the start.
    held: Vec<u8>,
    /// How far `held` has been parsed (the preface, then whole frames).
    parsed: usize,
    frames: usize,
    /// SETTINGS acknowledged by us so far (acknowledgements already asked for).
    acked: usize,
    /// The client acknowledged our SETTINGS.
    ours_acked: bool,
    /// The connection window's increments so far.
    window: u64,
}

impl Greeting {
    pub fn new() -> Self {
        Self::default()
    }

    /// The preface and the client's first SETTINGS frame have come (RFC 9113 §3.4: the
    /// client's connection preface): from here the connection waits as an idle one.
    pub fn preface_done(&self) -> bool {
        self.frames > 0
    }

    /// Takes the client's next bytes.
    pub fn hear(&mut self, bytes: &[u8]) -> Heard {
        // Kept whatever follows: h2 reads it all once woken.
        self.held.extend_from_slice(bytes);
        if self.held.len() > MAX_HELD {
            return Heard::Wake;
        }
        if self.parsed < PREFACE.len() {
            let n = self.held.len().min(PREFACE.len());
            if self.held[..n] != PREFACE[..n] {
                return Heard::Wake;
            }
            if n < PREFACE.len() {
                return Heard::Asleep { acks: 0 };
            }
            self.parsed = PREFACE.len();
        }
        let mut acks = 0;
        while self.held.len() - self.parsed >= FRAME_HEADER {
            let h = &self.held[self.parsed..self.parsed + FRAME_HEADER];
            let len = u32::from_be_bytes([0, h[0], h[1], h[2]]) as usize;
            let (kind, flags) = (h[3], h[4]);
            let stream = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
            let first = self.frames == 0;
            let takes = stream == 0
                && match kind {
                    SETTINGS if flags & ACK == 0 => {
                        len.is_multiple_of(6) && len <= MAX_SETTINGS_PAYLOAD
                    }
                    // Our SETTINGS, acknowledged (once; never before the client's own).
                    SETTINGS => len == 0 && !first && !self.ours_acked,
                    WINDOW_UPDATE => len == 4 && !first,
                    _ => false,
                };
            if !takes || self.frames == MAX_FRAMES {
                return Heard::Wake;
            }
            let end = self.parsed + FRAME_HEADER + len;
            if self.held.len() < end {
                // The rest of a frame it takes (bounded by MAX_HELD).
                break;
            }
            let payload = &self.held[self.parsed + FRAME_HEADER..end];
            match kind {
                SETTINGS if flags & ACK == 0 => {
                    if !payload.chunks(6).all(plainly_valid) {
                        return Heard::Wake;
                    }
                    acks += 1;
                }
                SETTINGS => self.ours_acked = true,
                _ => {
                    let inc = u32::from_be_bytes([payload[0], payload[1], payload[2], payload[3]])
                        & 0x7fff_ffff;
                    self.window += u64::from(inc);
                    // A zero increment or an overflow is a connection error: h2's to send.
                    if inc == 0 || INITIAL_WINDOW + self.window > MAX_WINDOW {
                        return Heard::Wake;
                    }
                }
            }
            self.frames += 1;
            self.parsed = end;
        }
        self.acked += acks;
        Heard::Asleep { acks }
    }

    /// What h2 starts from: everything the client sent, and what we sent for h2 already
    /// ([`opening`] and our acknowledgements), which h2 will send again first.
    pub fn wake(self) -> Woken {
        let mut skip = opening().unwrap_or_default().to_vec();
        for _ in 0..self.acked {
            skip.extend_from_slice(&SETTINGS_ACK);
        }
        Woken::new(self.held, skip)
    }
}

/// A setting h2 would take without a connection error (RFC 9113 §6.5.2), among those it
/// knows; others (RFC 8441's ENABLE_CONNECT_PROTOCOL, unknown ones, which h2 ignores) are
/// left to h2 all the same.
fn plainly_valid(setting: &[u8]) -> bool {
    let id = u16::from_be_bytes([setting[0], setting[1]]);
    let value = u32::from_be_bytes([setting[2], setting[3], setting[4], setting[5]]);
    match id {
        // HEADER_TABLE_SIZE, MAX_CONCURRENT_STREAMS, MAX_HEADER_LIST_SIZE: any value.
        0x1 | 0x3 | 0x6 => true,
        // ENABLE_PUSH
        0x2 => value <= 1,
        // INITIAL_WINDOW_SIZE
        0x4 => u64::from(value) <= MAX_WINDOW,
        // MAX_FRAME_SIZE
        0x5 => (16_384..=16_777_215).contains(&value),
        _ => false,
    }
}

/// What h2, set up as [`crate::settings::server`] sets it up, sends first on a connection
/// (its SETTINGS), the same bytes for every connection: learned once by running h2 in memory
/// on a client that sends only the preface, so that it follows h2 and the settings as they
/// are. `None` if h2 did not behave so (another version of it may not): then the products
/// start h2 at once, as before the greeting.
pub fn opening() -> Option<&'static [u8]> {
    static OPENING: OnceLock<Option<Vec<u8>>> = OnceLock::new();
    OPENING
        .get_or_init(|| learn_opening(&crate::settings::server(crate::settings::SEND_BUFFER)))
        .as_deref()
}

/// Runs h2's server handshake in memory on the preface alone, and what it wrote until it waits
/// for the client's next frame.
pub(crate) fn learn_opening(builder: &h2::server::Builder) -> Option<Vec<u8>> {
    let (io, outbox) = H2Io::in_memory(PREFACE.to_vec());
    let mut cx = Context::from_waker(Waker::noop());
    let mut handshake = Box::pin(builder.handshake::<_, bytes::Bytes>(io));
    // In memory h2 waits only for input, and the preface is all of it: the handshake is done
    // in one poll.
    let Poll::Ready(Ok(mut conn)) = handshake.as_mut().poll(&mut cx) else {
        return None;
    };
    // Whatever it sends before the client's next frame (nothing more, with h2 0.4.20).
    if conn.poll_accept(&mut cx).is_ready() {
        return None;
    }
    Some(outbox.written())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
        f.extend_from_slice(&[kind, flags]);
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    fn settings(pairs: &[(u16, u32)]) -> Vec<u8> {
        let mut p = Vec::new();
        for (id, v) in pairs {
            p.extend_from_slice(&id.to_be_bytes());
            p.extend_from_slice(&v.to_be_bytes());
        }
        frame(SETTINGS, 0, 0, &p)
    }

    /// curl's opening, as nghttp2 sends it.
    fn curl_opening() -> Vec<u8> {
        let mut b = PREFACE.to_vec();
        b.extend(settings(&[(3, 100), (4, 10 << 20), (2, 0)]));
        b.extend(frame(WINDOW_UPDATE, 0, 0, &1_048_510_465u32.to_be_bytes()));
        b
    }

    #[test]
    fn h2_opens_with_its_settings_and_the_same_bytes_for_every_product() {
        let o = opening().expect("h2 sends its SETTINGS on a client's preface alone");
        assert!(o.len() >= FRAME_HEADER, "{o:?}");
        assert_eq!(o[3], SETTINGS);
        assert_eq!(o[4] & ACK, 0);
        let len = u32::from_be_bytes([0, o[0], o[1], o[2]]) as usize;
        assert_eq!(o.len(), FRAME_HEADER + len, "one frame: {o:?}");
        // serve's builder differs only in what is not on the wire.
        let serve = learn_opening(&crate::settings::server(crate::serve::FILE_SEND_BUFFER));
        assert_eq!(serve.as_deref(), Some(o));
    }

    #[test]
    fn an_opening_is_taken_whatever_the_cuts() {
        let mut all = curl_opening();
        all.extend(frame(SETTINGS, ACK, 0, &[]));
        for cut in 1..all.len() {
            let mut g = Greeting::new();
            let mut acks = 0;
            for part in [&all[..cut], &all[cut..]] {
                match g.hear(part) {
                    Heard::Asleep { acks: a } => acks += a,
                    Heard::Wake => panic!("woken at cut {cut}"),
                }
            }
            assert_eq!(acks, 1, "cut {cut}");
            assert!(g.preface_done());
            assert!(g.ours_acked);
        }
    }

    #[test]
    fn the_first_other_frame_wakes_h2_with_everything_sent() {
        let mut g = Greeting::new();
        assert_eq!(g.hear(&curl_opening()), Heard::Asleep { acks: 1 });
        // A HEADERS frame's header is enough: its payload is h2's to read.
        let headers = frame(0x1, 0x5, 1, &[0x82, 0x84, 0x87, 0x41, 0x01, b'a']);
        assert_eq!(g.hear(&headers[..10]), Heard::Wake);
        let woken = g.wake();
        let mut expect = curl_opening();
        expect.extend_from_slice(&headers[..10]);
        assert_eq!(woken.replay(), &expect[..]);
        let mut skip = opening().expect("learnt").to_vec();
        skip.extend_from_slice(&SETTINGS_ACK);
        assert_eq!(woken.skip(), &skip[..]);
    }

    #[test]
    fn what_h2_must_judge_wakes_it() {
        let cases: Vec<(&str, Vec<u8>)> = vec![
            ("a bad preface", b"GET / HTTP/1.1\r\n\r\n".to_vec()),
            ("PING first", frame(0x6, 0, 0, &[0; 8])),
            ("SETTINGS on a stream", frame(SETTINGS, 0, 1, &[])),
            ("SETTINGS of 5 bytes", frame(SETTINGS, 0, 0, &[0; 5])),
            ("an ACK with a payload", {
                let mut b = settings(&[]);
                b.extend(frame(SETTINGS, ACK, 0, &[0; 6]));
                b
            }),
            ("an ACK first", frame(SETTINGS, ACK, 0, &[])),
            ("ENABLE_PUSH 2", settings(&[(2, 2)])),
            ("a window of 2^31", settings(&[(4, 1 << 31)])),
            ("a frame size too small", settings(&[(5, 16_383)])),
            ("an unknown setting", settings(&[(0x99, 1)])),
            ("a zero increment", {
                let mut b = settings(&[]);
                b.extend(frame(WINDOW_UPDATE, 0, 0, &[0; 4]));
                b
            }),
            ("a window past 2^31-1", {
                let mut b = settings(&[]);
                b.extend(frame(WINDOW_UPDATE, 0, 0, &0x7fff_0000u32.to_be_bytes()));
                b.extend(frame(WINDOW_UPDATE, 0, 0, &0x7fff_0000u32.to_be_bytes()));
                b
            }),
            ("a second ACK", {
                let mut b = settings(&[]);
                b.extend(frame(SETTINGS, ACK, 0, &[]));
                b.extend(frame(SETTINGS, ACK, 0, &[]));
                b
            }),
            ("a SETTINGS flood", {
                let mut b = Vec::new();
                for _ in 0..=MAX_FRAMES {
                    b.extend(settings(&[(3, 10)]));
                }
                b
            }),
            ("a large SETTINGS frame", settings(&[(3, 1); 11])),
        ];
        for (what, bytes) in cases {
            let mut g = Greeting::new();
            let mut input = PREFACE.to_vec();
            if what == "a bad preface" {
                input.clear();
            }
            input.extend(bytes);
            // Whole, and byte by byte: h2 is woken either way, before any ACK for the frame
            // it must judge.
            assert_eq!(g.hear(&input), Heard::Wake, "{what}");
            let mut g = Greeting::new();
            let mut woke = false;
            for b in &input {
                if g.hear(std::slice::from_ref(b)) == Heard::Wake {
                    woke = true;
                    break;
                }
            }
            assert!(woke, "{what}, byte by byte");
        }
    }

    /// A client in memory: sends `input` in reads of at most `cut` bytes, then ends; keeps
    /// what it is sent.
    struct Scripted {
        input: Vec<u8>,
        at: usize,
        cut: usize,
        got: Vec<u8>,
    }

    impl crate::transport::Transport for Scripted {
        fn sends_files(&self) -> bool {
            false
        }
        async fn readable(&mut self) -> std::io::Result<()> {
            Ok(())
        }
        async fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let n = self.cut.min(buf.len()).min(self.input.len() - self.at);
            buf[..n].copy_from_slice(&self.input[self.at..self.at + n]);
            self.at += n;
            Ok(n)
        }
        async fn write_all(&mut self, data: &[u8]) -> std::io::Result<()> {
            self.got.extend_from_slice(data);
            Ok(())
        }
        async fn write_file(
            &mut self,
            _: &[u8],
            _: &std::fs::File,
            _: u64,
            _: u64,
        ) -> std::io::Result<()> {
            unreachable!("no file bodies here")
        }
    }

    /// Serves a connection on `client` as the products do, through the greeting or not, and
    /// returns what the client got: each request answered 204.
    async fn serve(mut client: Scripted, greet: bool) -> Vec<u8> {
        use crate::transport::{run, Transport};
        let woken = if greet {
            let mut g = Greeting::new();
            client
                .write_all(opening().expect("learnt"))
                .await
                .expect("memory");
            let mut buf = vec![0u8; 16 * 1024];
            loop {
                let n = client.read(&mut buf).await.expect("memory");
                if n == 0 {
                    return client.got;
                }
                match g.hear(&buf[..n]) {
                    Heard::Wake => break g.wake(),
                    Heard::Asleep { acks } => {
                        for _ in 0..acks {
                            client.write_all(&SETTINGS_ACK).await.expect("memory");
                        }
                    }
                }
            }
        } else {
            Woken::fresh()
        };
        let stall = std::time::Duration::from_secs(5);
        let (h2_side, _) = run(&mut client, woken, stall, |io| async move {
            let builder = crate::settings::server(crate::settings::SEND_BUFFER);
            let mut conn = builder.handshake::<_, bytes::Bytes>(io).await?;
            while let Some(accepted) = conn.accept().await {
                let (_req, mut send) = accepted?;
                let resp = http::Response::builder()
                    .status(204)
                    .body(())
                    .expect("head");
                send.send_response(resp, true)?;
            }
            Ok::<_, h2::Error>(())
        })
        .await;
        if let Err(e) = h2_side {
            assert!(!e.to_string().contains("differs"), "{e}");
        }
        client.got
    }

    /// The client cannot tell a connection opened by the greeting from one h2 opened: the
    /// same bytes reach it, however its bytes are cut, whatever frame wakes h2.
    #[tokio::test]
    async fn the_client_gets_the_same_bytes_as_from_h2_alone() {
        let get = frame(0x1, 0x5, 1, &[0x82, 0x84, 0x87, 0x41, 0x01, b'a']);
        let ping = frame(0x6, 0, 0, &[1; 8]);
        let mut with_ack = curl_opening();
        with_ack.extend(frame(SETTINGS, ACK, 0, &[]));
        let mut two_settings = with_ack.clone();
        two_settings.extend(settings(&[(1, 0)]));
        let openings = [curl_opening(), with_ack, two_settings];
        for opening_sent in &openings {
            for then in [&get, &ping] {
                let mut input = opening_sent.clone();
                input.extend_from_slice(then);
                for cut in [1, 9, 33, 64, input.len()] {
                    let client = |_: ()| Scripted {
                        input: input.clone(),
                        at: 0,
                        cut,
                        got: Vec::new(),
                    };
                    let alone = serve(client(()), false).await;
                    let greeted = serve(client(()), true).await;
                    assert!(alone.len() > 9 + 9, "h2 answered: {alone:?}");
                    assert_eq!(greeted, alone, "cut {cut}, input {input:?}");
                }
            }
        }
    }
}
