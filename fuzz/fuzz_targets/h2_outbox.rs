//! The HTTP/2 outbox (crates/tlsplane-h2/src/transport.rs), the code of ours between h2 and the
//! client: frame sequences chosen by the fuzzer are written, cut at arbitrary points and in
//! vectored writes, to the transport h2 writes to, while file bodies are registered and
//! forgotten as `serve` does; the real pump sends what the outbox queues to an in-memory client.
//! What the client receives is checked against an independent model:
//! - exactly the frames written, with the payloads of DATA frames on streams with a file body
//!   replaced by the file's bytes;
//! - but a frame of a file stream that does not match its body (a padded DATA frame, DATA
//!   longer than the body's rest or on a body given up and dropped, the stream ending short of
//!   its body) is replaced by RST_STREAM(INTERNAL_ERROR), and the stream's later frames are
//!   dropped;
//! - a body range past the end of the file: an error, and what was received is the frames
//!   before it whole, then a prefix of the bad frame with nothing but real file bytes in its
//!   payload (never a zero-filled or foreign byte).
//!
//! Input: byte 0 chooses the plane (bit 0: kernel plane, file ranges sent by the client's
//! `write_file`; else the user plane, file bytes read into memory) and the largest write
//! (bits 1-3); byte 1 seeds the write sizes; the rest are operations (see `Model::parse`).
#![no_main]

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io::{self, IoSlice};
use std::os::unix::fs::FileExt;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use tlsplane_h2::transport::{self, Transport, FORGOTTEN, KEPT_STREAMS};
use tokio::io::AsyncWriteExt;

/// The file bodies are taken from; ranges may reach past its end.
const FILE_LEN: usize = 50_000;
/// Most bytes of frames one input writes: beyond the outbox's 64 KiB, so that h2's writes
/// wait for the pump ...
const MAX_WRITTEN: usize = 256 << 10;
/// ... and at most about this many writes (each of a file payload is a read of the file on the
/// user plane), so that tiny writes keep executions fast.
const MAX_WRITES: usize = 8192;
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;

struct Fixture {
    rt: tokio::runtime::Runtime,
    file: Arc<File>,
    content: Vec<u8>,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        // No zero byte: a placeholder byte sent in place of a file byte never matches.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let content: Vec<u8> = (0..FILE_LEN)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x as u8).max(1)
            })
            .collect();
        let path = std::env::temp_dir().join(format!("tlsplane-fuzz-h2-{}", std::process::id()));
        std::fs::write(&path, &content).expect("write the body file");
        let file = Arc::new(File::open(&path).expect("open the body file"));
        let _ = std::fs::remove_file(&path);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        Fixture { rt, file, content }
    })
}

/// The client: receives what the pump sends, and sends nothing.
struct Client {
    kernel: bool,
    received: Vec<u8>,
}

impl Transport for Client {
    fn sends_files(&self) -> bool {
        self.kernel
    }
    async fn readable(&mut self) -> io::Result<()> {
        Ok(())
    }
    async fn read(&mut self, _: &mut [u8]) -> io::Result<usize> {
        Ok(0)
    }
    async fn write_all(&mut self, data: &[u8]) -> io::Result<()> {
        self.received.extend_from_slice(data);
        Ok(())
    }
    /// As `sendfile` does: the range's bytes up to the end of the file, and an error if it
    /// ends first.
    async fn write_file(
        &mut self,
        prefix: &[u8],
        file: &File,
        offset: u64,
        len: u64,
    ) -> io::Result<()> {
        assert!(self.kernel, "a file range sent on the user plane");
        self.received.extend_from_slice(prefix);
        let have = (FILE_LEN as u64).saturating_sub(offset).min(len) as usize;
        let at = self.received.len();
        self.received.resize(at + have, 0);
        file.read_exact_at(&mut self.received[at..], offset)?;
        if (have as u64) < len {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "file ended"));
        }
        Ok(())
    }
}

/// What the writer does, in order.
enum Op {
    /// Register a file body range (`FileBodies::carry`), after all frames before it were
    /// written, as `serve` registers a body before h2 can send it.
    Carry { stream: u32, offset: u64, len: u64 },
    /// Forget a stream's body (`FileBodies::forget`), after the frames before it.
    Forget { stream: u32 },
    /// Frame bytes to write.
    Write(Vec<u8>),
}

/// The input, decoded, and what the client must receive.
struct Model {
    ops: Vec<Op>,
    /// What the client receives if all goes well: the frames, file bytes in their payloads.
    expected: Vec<u8>,
    /// The input ends with a body range past the end of the file: then `expected` ends where
    /// the outbox must stop (at the latest), and `good` is where the frames before it end.
    bad: bool,
    good: usize,
}

/// The file bodies as the outbox must keep them (`FileBodies::{carry, forget}`, the frames
/// that end streams), written apart from it.
#[derive(Default)]
struct Bodies {
    /// By stream: ranges not sent yet; a stream is kept until a frame ends it.
    files: HashMap<u32, VecDeque<(u64, u64)>>,
    /// Given up, oldest first; the last FORGOTTEN keep their ranges.
    forgotten: VecDeque<u32>,
    /// Given up longer ago: a DATA frame on one resets it.
    dropped: VecDeque<u32>,
    /// Reset by the outbox: h2's frames of them go nowhere.
    refused: VecDeque<u32>,
    /// A header block ending its stream goes on in CONTINUATION frames.
    block_ends: Option<u32>,
}

fn keep_last(ring: &mut VecDeque<u32>, stream: u32) {
    if !ring.contains(&stream) {
        ring.push_back(stream);
        if ring.len() > KEPT_STREAMS {
            ring.pop_front();
        }
    }
}

impl Bodies {
    fn carry(&mut self, stream: u32, offset: u64, len: u64) {
        if len == 0 {
            return;
        }
        // A new body on a stream given up: not the old one's rest.
        if let Some(at) = self.forgotten.iter().position(|&s| s == stream) {
            self.forgotten.remove(at);
            self.files.remove(&stream);
        }
        self.dropped.retain(|&s| s != stream);
        self.files.entry(stream).or_default().push_back((offset, len));
    }

    fn forget(&mut self, stream: u32) {
        if !self.files.contains_key(&stream) || self.forgotten.contains(&stream) {
            return;
        }
        self.forgotten.push_back(stream);
        if self.forgotten.len() > FORGOTTEN {
            if let Some(oldest) = self.forgotten.pop_front() {
                self.files.remove(&oldest);
                keep_last(&mut self.dropped, oldest);
            }
        }
    }

    fn ended(&mut self, stream: u32) {
        self.files.remove(&stream);
        self.forgotten.retain(|&s| s != stream);
        self.dropped.retain(|&s| s != stream);
    }

    /// What the client gets for one frame h2 writes (`payload` as written), appended to
    /// `out`; false when its file range reaches past the end of the file (an error: `out` then
    /// ends with what may have been sent of it).
    fn frame(&mut self, h: [u8; 9], payload: &[u8], content: &[u8], out: &mut Vec<u8>) -> bool {
        let len = payload.len();
        let (typ, flags) = (h[3], h[4]);
        let stream = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
        let ends = match typ {
            DATA if flags & END_STREAM != 0 => Some(true),
            HEADERS if flags & END_STREAM != 0 && flags & END_HEADERS == 0 => {
                self.block_ends = Some(stream);
                None
            }
            HEADERS if flags & END_STREAM != 0 => Some(true),
            CONTINUATION if flags & END_HEADERS != 0 && self.block_ends == Some(stream) => {
                self.block_ends = None;
                Some(true)
            }
            RST_STREAM => Some(false),
            _ => None,
        };
        if self.refused.contains(&stream) {
            if ends.is_some() {
                self.ended(stream);
                self.refused.retain(|&s| s != stream);
            }
            return true;
        }
        let refuse = |bodies: &mut Bodies, out: &mut Vec<u8>| {
            bodies.ended(stream);
            let mut rst = header(4, RST_STREAM, 0, stream).to_vec();
            rst.extend_from_slice(&2u32.to_be_bytes());
            out.extend_from_slice(&rst);
            keep_last(&mut bodies.refused, stream);
            true
        };
        if let Some(ranges) = self.files.get_mut(&stream) {
            let left: u64 = ranges.iter().map(|r| r.1).sum();
            let short = if typ == DATA { len as u64 != left } else { left > 0 };
            let bad_data = typ == DATA && (flags & PADDED != 0 || len as u64 > left);
            if bad_data || ends == Some(true) && short {
                return refuse(self, out);
            }
            out.extend_from_slice(&h);
            if typ != DATA {
                out.extend_from_slice(payload);
            } else {
                let mut left = len as u64;
                while left > 0 {
                    let r = ranges.front_mut().expect("checked against the body's rest");
                    let take = r.1.min(left);
                    let end = (r.0 + take).min(FILE_LEN as u64);
                    out.extend_from_slice(&content[r.0.min(end) as usize..end as usize]);
                    if r.0 + take > FILE_LEN as u64 {
                        return false;
                    }
                    r.0 += take;
                    r.1 -= take;
                    left -= take;
                    if r.1 == 0 {
                        ranges.pop_front();
                    }
                }
            }
        } else if typ == DATA && len > 0 && self.dropped.contains(&stream) {
            return refuse(self, out);
        } else {
            out.extend_from_slice(&h);
            out.extend_from_slice(payload);
        }
        if ends.is_some() {
            self.ended(stream);
        }
        true
    }
}

struct Bytes<'a>(&'a [u8]);

impl Bytes<'_> {
    fn u8(&mut self) -> Option<u8> {
        let (&b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(b)
    }
    fn u16(&mut self) -> Option<u16> {
        Some(u16::from_be_bytes([self.u8()?, self.u8()?]))
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_be_bytes([
            self.u8()?,
            self.u8()?,
            self.u8()?,
            self.u8()?,
        ]))
    }
}

fn header(len: usize, typ: u8, flags: u8, stream: u32) -> [u8; 9] {
    let l = (len as u32).to_be_bytes();
    let s = stream.to_be_bytes();
    [l[1], l[2], l[3], typ, flags, s[0], s[1], s[2], s[3]]
}

impl Model {
    /// Operations, each a tag byte and its arguments, until the input ends (a partial one is
    /// dropped) or a malformed frame:
    /// - 0 stream offset:u16 len:u16: register a body range of stream 1, 3, ... or 15 (the
    ///   range may reach past the end of the file);
    /// - 1 stream: forget the body of stream 1, 3, ... or 15 (more than FORGOTTEN, so that a
    ///   body given up is dropped);
    /// - 2 stream flags len:u16 fill: a DATA frame on stream 1, 3, ... or 17, the stream id's
    ///   reserved bit set when stream ≥ 128; its payload is `fill` bytes (on a file stream,
    ///   the placeholder bytes the file's replace);
    /// - 3 type flags stream:u32 len:u16 seed: any frame (len < 4096), DATA on a file stream
    ///   and frames that end streams included.
    fn parse(input: &[u8], content: &[u8], limit: usize) -> Model {
        let mut b = Bytes(input);
        let mut m = Model {
            ops: Vec::new(),
            expected: Vec::new(),
            bad: false,
            good: 0,
        };
        let mut bodies = Bodies::default();
        let mut written = 0usize;
        let mut frames = Vec::new();
        let flush = |m: &mut Model, frames: &mut Vec<u8>| {
            if !frames.is_empty() {
                m.ops.push(Op::Write(std::mem::take(frames)));
            }
        };
        while let Some(tag) = b.u8() {
            let (h, payload) = match tag % 4 {
                0 => {
                    let (Some(s), Some(offset), Some(len)) = (b.u8(), b.u16(), b.u16()) else {
                        break;
                    };
                    let stream = 1 + 2 * (s as u32 % 8);
                    let offset = offset as u64 % (FILE_LEN as u64 + 1000);
                    flush(&mut m, &mut frames);
                    m.ops.push(Op::Carry {
                        stream,
                        offset,
                        len: len as u64,
                    });
                    bodies.carry(stream, offset, len as u64);
                    continue;
                }
                1 => {
                    let Some(s) = b.u8() else { break };
                    let stream = 1 + 2 * (s as u32 % 8);
                    flush(&mut m, &mut frames);
                    m.ops.push(Op::Forget { stream });
                    bodies.forget(stream);
                    continue;
                }
                2 => {
                    let (Some(s), Some(flags), Some(len), Some(fill)) =
                        (b.u8(), b.u8(), b.u16(), b.u8())
                    else {
                        break;
                    };
                    let stream = 1 + 2 * (s as u32 % 9);
                    let id = if s >= 128 { stream | 1 << 31 } else { stream };
                    let len = len as usize;
                    (header(len, DATA, flags, id), vec![fill; len])
                }
                _ => {
                    let (Some(typ), Some(flags), Some(stream), Some(len), Some(seed)) =
                        (b.u8(), b.u8(), b.u32(), b.u16(), b.u8())
                    else {
                        break;
                    };
                    let len = len as usize % 4096;
                    let payload: Vec<u8> = (0..len)
                        .map(|i| seed.wrapping_add((i * 31) as u8))
                        .collect();
                    (header(len, typ, flags, stream), payload)
                }
            };
            if written + 9 + payload.len() > limit {
                continue; // neither written nor expected
            }
            written += 9 + payload.len();
            frames.extend_from_slice(&h);
            frames.extend_from_slice(&payload);
            m.good = m.expected.len();
            if !bodies.frame(h, &payload, content, &mut m.expected) {
                m.bad = true;
                break;
            }
        }
        flush(&mut m, &mut frames);
        if !m.bad {
            m.good = m.expected.len();
        }
        m
    }
}

/// Write sizes: xorshift from the input's seed, up to `max`.
struct Cuts {
    x: u32,
    max: usize,
}

impl Cuts {
    fn next(&mut self) -> usize {
        self.x ^= self.x << 13;
        self.x ^= self.x >> 17;
        self.x ^= self.x << 5;
        1 + self.x as usize % self.max
    }
}

fuzz_target!(|input: &[u8]| {
    if input.len() < 2 {
        return;
    }
    let f = fixture();
    let kernel = input[0] & 1 == 1;
    let max = [1, 3, 9, 10, 100, 4096, 20_000, 70_000][(input[0] >> 1) as usize % 8];
    let mut cuts = Cuts {
        x: (u32::from(input[1]) * 0x0101_0101) | 1,
        max,
    };
    let model = Model::parse(&input[2..], &f.content, MAX_WRITTEN.min(max * MAX_WRITES));
    let mut client = Client {
        kernel,
        received: Vec::new(),
    };
    let (written, pumped) = f.rt.block_on(async {
        let run = transport::run(&mut client, transport::Woken::fresh(), Duration::from_secs(10), |mut io| async move {
            let files = io.file_bodies();
            for op in &model.ops {
                match op {
                    Op::Carry {
                        stream,
                        offset,
                        len,
                    } => files.carry(*stream, f.file.clone(), *offset, *len),
                    Op::Forget { stream } => files.forget(*stream),
                    Op::Write(bytes) => {
                        let mut bytes = &bytes[..];
                        while !bytes.is_empty() {
                            // One to three slices, as h2's vectored writes of a header and
                            // its payload.
                            let mut slices = Vec::new();
                            let mut at = 0;
                            for _ in 0..1 + cuts.next() % 3 {
                                let n = cuts.next().min(bytes.len() - at);
                                slices.push(IoSlice::new(&bytes[at..at + n]));
                                at += n;
                            }
                            let n = io.write_vectored(&slices).await?;
                            assert!(n <= at, "took more than written");
                            bytes = &bytes[n..];
                        }
                    }
                }
            }
            io.shutdown().await
        });
        tokio::time::timeout(Duration::from_secs(20), run)
            .await
            .expect("the outbox and pump finish")
    });
    let received = &client.received;
    if model.bad {
        assert!(
            written.is_err() || pumped.is_err(),
            "a range past the end of the file sent without an error"
        );
        assert!(
            received.len() >= model.good,
            "the frames before a malformed one cut short: {} of {} bytes",
            received.len(),
            model.good
        );
        assert!(
            received.len() <= model.expected.len()
                && received[..] == model.expected[..received.len()],
            "bytes other than the frames' and the file's sent (received {}, expected at most {})",
            received.len(),
            model.expected.len()
        );
    } else {
        written.expect("frames written");
        pumped.expect("frames sent");
        assert!(
            received == &model.expected,
            "received {} bytes, not the {} expected (first difference at {:?})",
            received.len(),
            model.expected.len(),
            received
                .iter()
                .zip(&model.expected)
                .position(|(a, b)| a != b)
        );
    }
});
