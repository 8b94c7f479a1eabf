//! The transport `h2` runs on, over a [`TlsStream`] of either plane, shared by every product
//! that speaks HTTP/2, and the way file bodies reach the client without passing through h2.
//!
//! `h2` wants an `AsyncRead + AsyncWrite` transport, while [`TlsStream`] has async `read`,
//! `write_all` and `write_file`. [`run`] runs h2's side and a pump in the connection's own
//! task:
//! - inbound, the pump reads the client's bytes into a buffer it hands over to h2 whole, and
//!   reads again once h2 took all of it; an idle connection holds no buffer (the pump waits for
//!   readiness before it allocates one);
//! - outbound, what h2 writes is queued in an [`Outbox`] the pump drains to the client. The
//!   outbox follows h2's frames as they are written (every frame starts with a 9-byte header
//!   that gives its length, type and stream). The payload of a DATA frame on a stream whose body
//!   is a file ([`FileBodies::carry`]) is not taken from h2 at all: h2 was given placeholder
//!   bytes ([`H2Body::file`]), and the outbox puts the file's bytes in their place. On the
//!   kernel plane it queues the file range itself, and the pump writes the frame header with
//!   `MSG_MORE` and the payload by `sendfile(2)` (header and payload share a record; the file
//!   never enters this process); on the user plane it reads the range into the queue, the one
//!   copy encryption needs.
//!
//! - h2's side runs until it waits (all the streams it can serve now are served), then the
//!   pump sends what it queued, in one write: a round of requests read together is answered
//!   together. Except that once [`EARLY_FLUSH`] bytes are queued and the pump is idle, the
//!   product's loop may let the pump send them at once ([`Flusher`]; serve and proxy do when
//!   the connection is the only busy h2 connection of its worker): the client starts on the
//!   first responses while we serve the rest, instead of the two taking turns.
//!
//! So h2 keeps the protocol (framing, flow control, stream states, HPACK, its hardening) and
//! tlsplane only decides where a DATA payload's bytes come from, in the frame order and
//! within the flow-control windows h2 decided.

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::future::Future;
use std::io::{self, IoSlice};
use std::os::unix::fs::FileExt;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::{Buf, Bytes};
use tlsplane::{PlaneKind, TlsStream};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// What one TLS read moves (a record's plaintext).
const IO_BUF: usize = 16 * 1024;
/// Bytes h2 may have queued in the outbox before its writes wait for the pump: a few full
/// DATA frames, so the pump always has a batch to write while h2 prepares the next.
const OUTBOX: usize = 64 * 1024;
/// Streams given up whose file bodies are kept for a DATA frame h2 may have framed already
/// ([`FileBodies::forget`]).
pub const FORGOTTEN: usize = 4;
/// Bytes queued at which the pump may send them before h2's side has served all it can
/// ([`Flusher`]). Answering a round of 10 small requests in one write made the client and the
/// server take turns, each idle while the other worked (one h2 connection, `h2load -m 10`:
/// server 70 % of its core, client 25 %); writing every ~4 responses of 1 KiB lets the two
/// overlap, at few more writes. In one run, 2 KiB cost more CPU per request (13.4 against
/// 12.0 µs) and 6 KiB overlapped less (74.9k against 78.6k req/s) (docs/BENCHMARKS.md,
/// "One HTTP/2 connection, 10 streams").
pub const EARLY_FLUSH: usize = 4 * 1024;
/// User plane: file DATA frames up to this long are read from the file in one piece when
/// their header comes ([`Outbox::take`]): small responses, where the second read was a large
/// share of the work. With 16 KiB frames read whole too, the 10 MiB row of bench/h2-peers
/// cost 1.12–1.14× the build before in two runs (1.07 and 0.98 with this limit, ±5 %).
const SMALL_FILE_FRAME: usize = 4 * 1024;
/// The frame header's length (RFC 9113 §4.1).
const FRAME_HEADER: usize = 9;
/// A file DATA frame's payload on the kernel plane: with its header, one full TLS record
/// (16,384 bytes of plaintext; [`FileBodies::frame_limit`]).
pub const KERNEL_FILE_FRAME: usize = 16 * 1024 - FRAME_HEADER;
const DATA: u8 = 0x0;
const PADDED: u8 = 0x8;
/// What an [`H2Body::file`] placeholder's bytes are taken from (never sent).
static PLACEHOLDER: [u8; 16 * 1024] = [0; 16 * 1024];

/// A stream's body as h2 carries it: bytes, or the placeholder of a file range whose bytes
/// the outbox puts in (registered first with [`FileBodies::carry`]).
pub enum H2Body {
    Bytes(Bytes),
    File { remaining: usize },
}

impl H2Body {
    /// `len` bytes of the file range registered for the stream it is sent on.
    pub fn file(len: usize) -> Self {
        H2Body::File { remaining: len }
    }
}

impl Buf for H2Body {
    fn remaining(&self) -> usize {
        match self {
            H2Body::Bytes(b) => b.remaining(),
            H2Body::File { remaining } => *remaining,
        }
    }
    fn chunk(&self) -> &[u8] {
        match self {
            H2Body::Bytes(b) => b.chunk(),
            H2Body::File { remaining } => &PLACEHOLDER[..(*remaining).min(PLACEHOLDER.len())],
        }
    }
    fn advance(&mut self, n: usize) {
        match self {
            H2Body::Bytes(b) => b.advance(n),
            H2Body::File { remaining } => {
                assert!(n <= *remaining, "advance past the end");
                *remaining -= n;
            }
        }
    }
}

/// A file range queued to be sent as DATA payloads.
struct FileRange {
    file: Arc<File>,
    offset: u64,
    len: u64,
}

/// One part of the outbound byte stream.
enum Piece {
    Bytes(Vec<u8>),
    /// Kernel plane: sent by `sendfile(2)`.
    File(FileRange),
}

/// Where h2's writes stand in its frame sequence.
#[derive(Default)]
struct Frames {
    header: [u8; FRAME_HEADER],
    /// Header bytes seen of the current frame (the payload follows once all 9 are).
    header_len: usize,
    /// Payload bytes of the current frame still to come.
    payload_left: usize,
    /// The current frame is DATA on a stream whose body is a file.
    file_stream: Option<u32>,
    /// User plane: the current frame's file bytes were all read in when its header came; its
    /// placeholders are dropped as h2 writes them.
    file_read: bool,
}

/// The queues between h2 and the pump: what h2 wrote and the pump has not sent yet, and the
/// client's bytes h2 has not read yet.
struct Outbox {
    /// The client's bytes read last, and how far h2 has read them (empty: the pump may read).
    inbound: Vec<u8>,
    inbound_at: usize,
    /// The client's input ended (or the pump is gone): h2 reads its end.
    inbound_end: bool,
    /// h2, waiting for the client's bytes.
    reader: Option<Waker>,
    pieces: VecDeque<Piece>,
    /// Bytes (of both kinds) queued.
    queued: usize,
    frames: Frames,
    /// File ranges by stream, in the order their DATA will be written.
    files: HashMap<u32, VecDeque<FileRange>>,
    /// Streams whose bodies were given up, oldest first ([`FileBodies::forget`]).
    forgotten: VecDeque<u32>,
    /// File payloads go as ranges for `sendfile` (kernel plane), not as bytes.
    sendfile: bool,
    /// h2 shut its write side down, or dropped the transport: nothing more will come.
    shut: bool,
    /// The pump is gone (the client's side failed): h2's writes fail.
    broken: bool,
    /// The pump is writing pieces it took: it takes no more until done.
    sending: bool,
    /// h2, waiting for room.
    writer: Option<Waker>,
    /// The pump, waiting for pieces or for h2 to take the inbound bytes.
    pump: Option<Waker>,
    /// What h2 writes first that the client already had from the greeting ([`Woken`]), and
    /// how much of it h2 has written: checked, never sent twice.
    skip: Vec<u8>,
    skipped: usize,
}

impl Outbox {
    fn new(sendfile: bool) -> Self {
        Outbox {
            inbound: Vec::new(),
            inbound_at: 0,
            inbound_end: false,
            reader: None,
            pieces: VecDeque::new(),
            queued: 0,
            frames: Frames::default(),
            files: HashMap::new(),
            forgotten: VecDeque::new(),
            sendfile,
            shut: false,
            broken: false,
            sending: false,
            writer: None,
            pump: None,
            skip: Vec::new(),
            skipped: 0,
        }
    }

    /// How many more bytes h2 may write now: up to [`OUTBOX`] queued, and on the kernel plane
    /// always the rest of a file DATA frame (at most [`KERNEL_FILE_FRAME`]) once its header
    /// has begun. A frame cut across two of the pump's batches would be sent as two records
    /// (`sendfile` ends its record), one of them small.
    fn room(&self) -> usize {
        let free = OUTBOX.saturating_sub(self.queued);
        if !self.sendfile {
            return free;
        }
        let f = &self.frames;
        let rest = match f.header_len {
            0 => 0,
            n if n < FRAME_HEADER => FRAME_HEADER - n,
            _ if f.file_stream.is_some() => f.payload_left,
            _ => 0,
        };
        free.max(rest)
    }

    fn push_bytes(&mut self, bytes: &[u8]) {
        if let Some(Piece::Bytes(last)) = self.pieces.back_mut() {
            last.extend_from_slice(bytes);
        } else {
            let piece = Self::new_piece(self.sendfile, bytes);
            self.pieces.push_back(Piece::Bytes(piece));
        }
        self.queued += bytes.len();
    }

    /// A new run of bytes, starting with `first`. On the user plane, where file payloads are
    /// read into it too, sized for a whole batch at once: growing it frame by frame copied
    /// the queue over and over.
    fn new_piece(sendfile: bool, first: &[u8]) -> Vec<u8> {
        let mut v = if sendfile {
            Vec::with_capacity(first.len().max(64))
        } else {
            Vec::with_capacity(OUTBOX + PLACEHOLDER.len() + FRAME_HEADER)
        };
        v.extend_from_slice(first);
        v
    }

    /// Takes `n` bytes of the file body of `stream` in place of `n` placeholder bytes.
    fn push_file(&mut self, stream: u32, mut n: usize) -> io::Result<()> {
        let ranges = self.files.get_mut(&stream).ok_or_else(|| missing(stream))?;
        while n > 0 {
            let range = ranges.front_mut().ok_or_else(|| missing(stream))?;
            let take = (range.len.min(n as u64)) as usize;
            let part = FileRange {
                file: range.file.clone(),
                offset: range.offset,
                len: take as u64,
            };
            range.offset += take as u64;
            range.len -= take as u64;
            if range.len == 0 {
                ranges.pop_front();
            }
            n -= take;
            if self.sendfile {
                match self.pieces.back_mut() {
                    // Contiguous with the range queued last (a frame continued over writes).
                    Some(Piece::File(last))
                        if Arc::ptr_eq(&last.file, &part.file)
                            && last.offset + last.len == part.offset =>
                    {
                        last.len += part.len;
                    }
                    _ => self.pieces.push_back(Piece::File(part)),
                }
            } else {
                // The user plane encrypts from memory: read the bytes here, once.
                let at = match self.pieces.back_mut() {
                    Some(Piece::Bytes(last)) => last,
                    _ => {
                        let piece = Self::new_piece(self.sendfile, &[]);
                        self.pieces.push_back(Piece::Bytes(piece));
                        match self.pieces.back_mut() {
                            Some(Piece::Bytes(v)) => v,
                            _ => unreachable!("just pushed"),
                        }
                    }
                };
                let start = at.len();
                at.resize(start + take, 0);
                if let Err(e) = part.file.read_exact_at(&mut at[start..], part.offset) {
                    // What was read, and the zeros after it, must not be sent as the body.
                    at.truncate(start);
                    return Err(if e.kind() == io::ErrorKind::UnexpectedEof {
                        io::Error::new(e.kind(), "file shrank while being sent")
                    } else {
                        e
                    });
                }
                let copied = &tlsplane::stats::global().file_bytes_copied;
                copied.fetch_add(take as u64, std::sync::atomic::Ordering::Relaxed);
            }
            self.queued += take;
        }
        if ranges.is_empty() {
            self.files.remove(&stream);
        }
        Ok(())
    }

    /// Takes bytes h2 wrote, following its frames; returns how many were taken (all of
    /// `buf` unless the frame sequence makes no sense, which is an error).
    fn take(&mut self, mut buf: &[u8]) -> io::Result<usize> {
        let total = buf.len();
        if self.skipped < self.skip.len() {
            let n = (self.skip.len() - self.skipped).min(buf.len());
            if buf[..n] != self.skip[self.skipped..self.skipped + n] {
                // The client had other bytes from the greeting than h2 now sends: what
                // follows would not make sense to it.
                return Err(io::Error::other("h2's opening differs from the greeting's"));
            }
            self.skipped += n;
            buf = &buf[n..];
            if self.skipped == self.skip.len() {
                self.skip = Vec::new();
                self.skipped = 0;
            }
        }
        while !buf.is_empty() {
            let f = &mut self.frames;
            if f.header_len < FRAME_HEADER {
                let n = (FRAME_HEADER - f.header_len).min(buf.len());
                f.header[f.header_len..f.header_len + n].copy_from_slice(&buf[..n]);
                f.header_len += n;
                let h = f.header;
                let done = f.header_len == FRAME_HEADER;
                self.push_bytes(&buf[..n]);
                buf = &buf[n..];
                if done {
                    let len = u32::from_be_bytes([0, h[0], h[1], h[2]]) as usize;
                    let stream = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
                    let f = &mut self.frames;
                    f.payload_left = len;
                    f.file_stream = None;
                    f.file_read = false;
                    if h[3] == DATA && self.files.contains_key(&stream) {
                        if h[4] & PADDED != 0 {
                            // h2 never pads; the payload would not be the body alone.
                            return Err(io::Error::other("padded DATA on a file stream"));
                        }
                        f.file_stream = Some(stream);
                        if !self.sendfile
                            && len > 0
                            && len <= SMALL_FILE_FRAME
                            && self.queued + len <= OUTBOX
                        {
                            // One read for the whole payload: h2 writes a frame's first bytes
                            // with the bytes before them and the rest on their own, which
                            // was two reads of the file per frame. Not past OUTBOX: the pump's
                            // batches stay cut where h2's writes stop for want of room, every
                            // 64 KiB of a long body, which the record layer cuts into whole
                            // records (65,572 bytes left a 36-byte record every 4).
                            self.push_file(stream, len)?;
                            self.frames.file_read = true;
                        }
                    }
                    if len == 0 {
                        self.frames.header_len = 0;
                    }
                }
                continue;
            }
            let n = f.payload_left.min(buf.len());
            match f.file_stream {
                Some(_) if f.file_read => {}
                Some(stream) => self.push_file(stream, n)?,
                None => self.push_bytes(&buf[..n]),
            }
            buf = &buf[n..];
            let f = &mut self.frames;
            f.payload_left -= n;
            if f.payload_left == 0 {
                f.header_len = 0;
            }
        }
        Ok(total)
    }
}

fn missing(stream: u32) -> io::Error {
    io::Error::other(format!("DATA on stream {stream} beyond its file body"))
}

fn lock(outbox: &Mutex<Outbox>) -> MutexGuard<'_, Outbox> {
    // A panic while holding it left nothing half-written that matters more than going on.
    outbox.lock().unwrap_or_else(|e| e.into_inner())
}

/// Registers file bodies of a connection's streams, for the outbox to send in place of their
/// placeholders.
#[derive(Clone)]
pub struct FileBodies(Arc<Mutex<Outbox>>);

impl FileBodies {
    /// The next `len` bytes sent on `stream` (an [`h2::StreamId`], or its number) as
    /// [`H2Body::file`] are `file`'s from `offset`. Call before sending them.
    pub fn carry(&self, stream: impl Into<u32>, file: Arc<File>, offset: u64, len: u64) {
        if len == 0 {
            return;
        }
        let mut outbox = lock(&self.0);
        let stream = stream.into();
        if let Some(at) = outbox.forgotten.iter().position(|&s| s == stream) {
            // A new body on a stream whose old one was given up: not the old one's rest.
            outbox.forgotten.remove(at);
            outbox.files.remove(&stream);
        }
        let ranges = outbox.files.entry(stream).or_default();
        ranges.push_back(FileRange { file, offset, len });
    }

    /// The stream ended before its body was sent (reset, or the connection failed): h2 sends
    /// no more of its DATA than it had already framed.
    ///
    /// That may still be one frame: h2 takes a DATA frame into its write buffer when there is
    /// window for it, and writes it to the outbox when there is room, so a frame can be
    /// between the two when the stream is given up. Its payload is placeholders, which must
    /// never reach the client. So the body's rest is kept for the [`FORGOTTEN`] streams given
    /// up last (h2 holds one DATA frame at a time), and such a frame still carries the file's
    /// bytes; older ones are dropped.
    pub fn forget(&self, stream: impl Into<u32>) {
        let mut outbox = lock(&self.0);
        let stream = stream.into();
        if !outbox.files.contains_key(&stream) || outbox.forgotten.contains(&stream) {
            return;
        }
        outbox.forgotten.push_back(stream);
        if outbox.forgotten.len() > FORGOTTEN {
            if let Some(oldest) = outbox.forgotten.pop_front() {
                outbox.files.remove(&oldest);
            }
        }
    }

    /// The most file bytes to give h2 at once (it makes one DATA frame of each such piece).
    ///
    /// On the kernel plane a frame's header goes with `MSG_MORE` and its payload by
    /// `sendfile`, which ends the record at its last byte. A 16,384-byte payload after the
    /// 9-byte header filled one record and closed a second holding only its last 9 bytes:
    /// two records, two AEAD operations and 22 bytes of overhead for every frame. With
    /// payloads of [`KERNEL_FILE_FRAME`] the header and payload fill exactly one record. On
    /// the user plane the record layer cuts whole batches into full records: no limit.
    pub fn frame_limit(&self) -> usize {
        if lock(&self.0).sendfile {
            KERNEL_FILE_FRAME
        } else {
            usize::MAX
        }
    }
}

/// Lets the pump send what h2 has queued before h2's side has served all it can: see
/// [`flush_if_due`](Self::flush_if_due).
#[derive(Clone)]
pub struct Flusher(Arc<Mutex<Outbox>>);

impl Flusher {
    /// When at least [`EARLY_FLUSH`] bytes are queued and the pump is idle, lets the pump send
    /// them now: returns after one turn of the task, in which the pump runs (it is polled
    /// after h2's side, [`run`]). Call it from the loop that serves streams, between streams.
    /// Otherwise returns at once.
    pub async fn flush_if_due(&self) {
        let due = {
            let outbox = lock(&self.0);
            outbox.queued >= EARLY_FLUSH && !outbox.sending && !outbox.broken
        };
        if due {
            let mut yielded = false;
            std::future::poll_fn(|cx| {
                if yielded {
                    return Poll::Ready(());
                }
                yielded = true;
                // The pump is polled right after this turn of h2's side ([`run`]); this
                // resumes in the next turn.
                cx.waker().wake_by_ref();
                Poll::Pending
            })
            .await;
        }
    }
}

/// Where h2 starts on a connection whose opening the product kept without it
/// ([`crate::greeting`]): the client's bytes so far, which h2 reads first, and the bytes h2
/// will write first that the client already had (h2's SETTINGS and acknowledgements of the
/// client's), which the outbox checks and drops.
#[derive(Default)]
pub struct Woken {
    replay: Vec<u8>,
    skip: Vec<u8>,
}

impl Woken {
    pub(crate) fn new(replay: Vec<u8>, skip: Vec<u8>) -> Self {
        Woken { replay, skip }
    }

    /// h2 starts the connection itself: nothing read or sent before.
    pub fn fresh() -> Self {
        Self::default()
    }

    pub fn replay(&self) -> &[u8] {
        &self.replay
    }

    pub fn skip(&self) -> &[u8] {
        &self.skip
    }
}

/// What h2 reads the client's bytes from and writes its own to.
pub struct H2Io {
    outbox: Arc<Mutex<Outbox>>,
}

impl H2Io {
    pub fn file_bodies(&self) -> FileBodies {
        FileBodies(self.outbox.clone())
    }

    pub fn flusher(&self) -> Flusher {
        Flusher(self.outbox.clone())
    }

    /// A transport in memory with no pump: h2 reads `inbound`, then waits for more; what it
    /// writes stays queued ([`Written::written`]). For learning h2's opening.
    pub(crate) fn in_memory(inbound: Vec<u8>) -> (Self, Written) {
        let mut outbox = Outbox::new(false);
        outbox.inbound = inbound;
        let outbox = Arc::new(Mutex::new(outbox));
        (
            H2Io {
                outbox: outbox.clone(),
            },
            Written(outbox),
        )
    }

    fn take_writes(
        &mut self,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let mut outbox = lock(&self.outbox);
        if outbox.broken {
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        }
        if outbox.room() == 0 {
            outbox.writer = Some(cx.waker().clone());
            return Poll::Pending;
        }
        let mut taken = 0;
        'bufs: for buf in bufs {
            let mut buf: &[u8] = buf;
            while !buf.is_empty() {
                let room = outbox.room();
                if room == 0 {
                    break 'bufs;
                }
                let n = buf.len().min(room);
                taken += outbox.take(&buf[..n])?;
                buf = &buf[n..];
            }
        }
        if let Some(pump) = outbox.pump.take() {
            pump.wake();
        }
        Poll::Ready(Ok(taken))
    }

    fn shut(&self) {
        let mut outbox = lock(&self.outbox);
        outbox.shut = true;
        if let Some(pump) = outbox.pump.take() {
            pump.wake();
        }
    }
}

impl Drop for H2Io {
    fn drop(&mut self) {
        self.shut();
    }
}

impl AsyncRead for H2Io {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let mut outbox = lock(&self.outbox);
        let at = outbox.inbound_at;
        let held = &outbox.inbound[at..];
        if held.is_empty() {
            if outbox.inbound_end {
                return Poll::Ready(Ok(()));
            }
            outbox.reader = Some(cx.waker().clone());
            return Poll::Pending;
        }
        let n = held.len().min(buf.remaining());
        buf.put_slice(&held[..n]);
        outbox.inbound_at += n;
        if outbox.inbound_at == outbox.inbound.len() {
            // All taken: the buffer goes, the pump may read again.
            outbox.inbound = Vec::new();
            outbox.inbound_at = 0;
            if let Some(pump) = outbox.pump.take() {
                pump.wake();
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for H2Io {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().take_writes(cx, &[IoSlice::new(buf)])
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().take_writes(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        true
    }
    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        // The pump sends everything queued without being asked.
        Poll::Ready(Ok(()))
    }
    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.shut();
        Poll::Ready(Ok(()))
    }
}

/// What h2 wrote on an [`H2Io::in_memory`] transport.
pub(crate) struct Written(Arc<Mutex<Outbox>>);

impl Written {
    pub(crate) fn written(&self) -> Vec<u8> {
        let outbox = lock(&self.0);
        let mut out = Vec::new();
        for piece in &outbox.pieces {
            if let Piece::Bytes(b) = piece {
                out.extend_from_slice(b);
            }
        }
        out
    }
}

/// The client's side of a connection, which the pump moves bytes to and from: a [`TlsStream`]
/// of either plane in the products, bytes in memory in the fuzz targets (fuzz/).
pub trait Transport {
    /// File payloads are to be written as ranges by [`write_file`](Self::write_file) (the
    /// kernel plane's `sendfile`), not read into memory first.
    fn sends_files(&self) -> bool;
    /// Waits until a read would not wait (it may return early), holding no buffer meanwhile.
    fn readable(&mut self) -> impl Future<Output = io::Result<()>>;
    /// The client's next bytes; `Ok(0)` at its end. Cancel-safe.
    fn read(&mut self, buf: &mut [u8]) -> impl Future<Output = io::Result<usize>>;
    fn write_all(&mut self, data: &[u8]) -> impl Future<Output = io::Result<()>>;
    /// `prefix`, then `len` bytes of `file` from `offset`.
    fn write_file(
        &mut self,
        prefix: &[u8],
        file: &File,
        offset: u64,
        len: u64,
    ) -> impl Future<Output = io::Result<()>>;
}

impl Transport for TlsStream {
    fn sends_files(&self) -> bool {
        self.plane() == PlaneKind::Kernel
    }
    async fn readable(&mut self) -> io::Result<()> {
        TlsStream::readable(self).await
    }
    async fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        TlsStream::read(self, buf).await
    }
    async fn write_all(&mut self, data: &[u8]) -> io::Result<()> {
        TlsStream::write_all(self, data).await
    }
    async fn write_file(
        &mut self,
        prefix: &[u8],
        file: &File,
        offset: u64,
        len: u64,
    ) -> io::Result<()> {
        TlsStream::write_file(self, prefix, file, offset, len).await
    }
}

/// Runs `conn` (h2's side of one connection, given its transport) and the pump between that
/// transport and `tls`, in the calling task, until both end: `conn`'s output, and how the
/// pump ended (an error from the client's side, or a client that took none of our bytes for
/// `stall`). `conn` is polled first, every time: the pump sends what it queued in that turn
/// ([`Flusher`] relies on it). h2 starts from `woken`: what the greeting read and sent
/// ([`Woken::fresh`] when there was none).
pub async fn run<T, F, Fut>(
    tls: &mut T,
    woken: Woken,
    stall: Duration,
    conn: F,
) -> (Fut::Output, io::Result<()>)
where
    T: Transport,
    F: FnOnce(H2Io) -> Fut,
    Fut: Future,
{
    let mut outbox = Outbox::new(tls.sends_files());
    outbox.inbound = woken.replay;
    outbox.skip = woken.skip;
    let outbox = Arc::new(Mutex::new(outbox));
    let io = H2Io {
        outbox: outbox.clone(),
    };
    tokio::join!(biased; conn(io), pump(tls, &outbox, stall))
}

/// Marks the outbox broken when the pump ends, however it ends, so that h2 is not left
/// waiting for room that never comes.
struct PumpGone<'a>(&'a Mutex<Outbox>);

impl Drop for PumpGone<'_> {
    fn drop(&mut self) {
        let mut outbox = lock(self.0);
        outbox.broken = true;
        outbox.inbound_end = true;
        outbox.pieces.clear();
        outbox.files.clear();
        if let Some(writer) = outbox.writer.take() {
            writer.wake();
        }
        if let Some(reader) = outbox.reader.take() {
            reader.wake();
        }
    }
}

/// Moves bytes between the client (`tls`) and h2 until h2 is done with the connection:
/// the client's to h2, the outbox's to the client. A client that takes none of our bytes for
/// `stall` ends the connection.
async fn pump<T: Transport>(
    tls: &mut T,
    outbox: &Mutex<Outbox>,
    stall: Duration,
) -> io::Result<()> {
    let _gone = PumpGone(outbox);
    // The client's input ended.
    let mut input_done = false;
    loop {
        tokio::select! {
            read = read_for_h2(tls, outbox), if !input_done => {
                let read = read?;
                let mut shared = lock(outbox);
                if read.is_empty() {
                    input_done = true;
                    shared.inbound_end = true;
                } else {
                    shared.inbound = read;
                }
                if let Some(reader) = shared.reader.take() {
                    reader.wake();
                }
            },
            pieces = std::future::poll_fn(|cx| next_pieces(outbox, cx)) => {
                let Some(pieces) = pieces else { return Ok(()) };
                let sent = tokio::time::timeout(stall, send(tls, pieces)).await;
                lock(outbox).sending = false;
                match sent {
                    Ok(sent) => sent?,
                    Err(_) => {
                        return Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            "the client took none of our bytes",
                        ))
                    }
                }
            },
        }
    }
}

/// Once h2 has taken the bytes read last, the client's next bytes (empty at its end). The
/// buffer is allocated only once the client has sent something: an idle connection holds
/// none. Cancel-safe: waiting and [`Transport::read`] are.
async fn read_for_h2<T: Transport>(tls: &mut T, outbox: &Mutex<Outbox>) -> io::Result<Vec<u8>> {
    std::future::poll_fn(|cx| {
        let mut shared = lock(outbox);
        if shared.inbound.is_empty() {
            Poll::Ready(())
        } else {
            shared.pump = Some(cx.waker().clone());
            Poll::Pending
        }
    })
    .await;
    tls.readable().await?;
    let mut buf = vec![0u8; IO_BUF];
    let n = tls.read(&mut buf).await?;
    buf.truncate(n);
    Ok(buf)
}

/// The pieces queued, when there are some; `None` when h2 is done and all was sent.
fn next_pieces(outbox: &Mutex<Outbox>, cx: &mut Context<'_>) -> Poll<Option<VecDeque<Piece>>> {
    let mut outbox = lock(outbox);
    if outbox.pieces.is_empty() {
        if outbox.shut {
            return Poll::Ready(None);
        }
        outbox.pump = Some(cx.waker().clone());
        return Poll::Pending;
    }
    outbox.queued = 0;
    outbox.sending = true;
    let pieces = std::mem::take(&mut outbox.pieces);
    if let Some(writer) = outbox.writer.take() {
        writer.wake();
    }
    Poll::Ready(Some(pieces))
}

/// Writes queued pieces in order: bytes ahead of a file range go with `MSG_MORE`, so the
/// frame header shares a record with the payload that `sendfile` sends.
async fn send<T: Transport>(tls: &mut T, mut pieces: VecDeque<Piece>) -> io::Result<()> {
    while let Some(piece) = pieces.pop_front() {
        match piece {
            Piece::Bytes(bytes) => match pieces.pop_front() {
                Some(Piece::File(r)) => tls.write_file(&bytes, &r.file, r.offset, r.len).await?,
                Some(Piece::Bytes(_)) => unreachable!("adjacent bytes are merged"),
                None => tls.write_all(&bytes).await?,
            },
            Piece::File(r) => tls.write_file(&[], &r.file, r.offset, r.len).await?,
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(typ: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let len = payload.len() as u32;
        let mut f = len.to_be_bytes()[1..].to_vec();
        f.extend_from_slice(&[typ, flags]);
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    fn outbox(sendfile: bool) -> Outbox {
        Outbox::new(sendfile)
    }

    /// What the client would receive: bytes as they are, file ranges read.
    fn sent(outbox: &mut Outbox) -> Vec<u8> {
        let mut out = Vec::new();
        for piece in outbox.pieces.drain(..) {
            match piece {
                Piece::Bytes(b) => out.extend_from_slice(&b),
                Piece::File(r) => {
                    let mut b = vec![0u8; r.len as usize];
                    r.file.read_exact_at(&mut b, r.offset).expect("read range");
                    out.extend_from_slice(&b);
                }
            }
        }
        out
    }

    fn temp_file(content: &[u8]) -> Arc<File> {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static N: AtomicUsize = AtomicUsize::new(0);
        let path = std::env::temp_dir().join(format!(
            "tlsplane-h2-outbox-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::write(&path, content).expect("write temp file");
        let file = File::open(&path).expect("open temp file");
        let _ = std::fs::remove_file(&path);
        Arc::new(file)
    }

    /// Frames as h2 writes them for two streams, one with a file body (placeholders), one with
    /// bytes, around control frames; cut into writes of every size from 1 byte up: the client
    /// gets the frames with the file's bytes in the placeholders' place, on both planes.
    #[test]
    fn file_bytes_replace_placeholders_in_data_frames_however_writes_are_cut() {
        let content: Vec<u8> = (0..40_000u32).map(|i| (i * 7 % 251) as u8 + 1).collect();
        let (offset, len) = (1000u64, 30_000usize);
        let body = &content[offset as usize..offset as usize + len];
        let mut written = Vec::new();
        let mut expected = Vec::new();
        let mut both = |typ, flags, stream, payload: &[u8], real: &[u8]| {
            written.extend(frame(typ, flags, stream, payload));
            expected.extend(frame(typ, flags, stream, real));
        };
        let settings = [0u8, 3, 0, 0, 0, 100];
        both(0x4, 0, 0, &settings, &settings);
        both(0x1, 0x4, 1, b"\x88", b"\x88"); // HEADERS :status 200
        both(0x1, 0x4, 3, b"\x88", b"\x88");
        let zeros = vec![0u8; 16_384];
        both(DATA, 0, 1, &zeros, &body[..16_384]);
        both(DATA, 0, 3, b"not a file", b"not a file");
        both(0x6, 0, 0, &[1; 8], &[1; 8]); // PING
        both(DATA, 0, 1, &zeros[..100], &body[16_384..16_484]);
        both(DATA, 0x1, 1, &zeros[..len - 16_484], &body[16_484..]);
        both(DATA, 0x1, 3, b"", b"");
        for sendfile in [true, false] {
            for cut in [1, 2, 5, 9, 10, 100, 4096, 20_000, written.len()] {
                let mut ob = outbox(sendfile);
                let file = temp_file(&content);
                ob.files.entry(1).or_default().push_back(FileRange {
                    file: file.clone(),
                    offset,
                    len: 16_384,
                });
                ob.files.entry(1).or_default().push_back(FileRange {
                    file,
                    offset: offset + 16_384,
                    len: (len - 16_384) as u64,
                });
                for chunk in written.chunks(cut) {
                    assert_eq!(ob.take(chunk).expect("well-formed frames"), chunk.len());
                }
                assert!(ob.files.is_empty(), "a file body left unsent");
                assert_eq!(ob.queued, expected.len());
                if sendfile {
                    assert!(ob.pieces.iter().any(|p| matches!(p, Piece::File(_))));
                } else {
                    assert!(ob.pieces.iter().all(|p| matches!(p, Piece::Bytes(_))));
                }
                assert!(sent(&mut ob) == expected, "cut {cut}, sendfile {sendfile}");
            }
        }
    }

    /// On the user plane a file DATA frame's payload is read from the file once, when its
    /// header comes, however h2 cuts the placeholders over its writes (it writes a frame's
    /// first bytes with what precedes them, the rest on their own).
    #[test]
    fn a_file_frame_is_read_in_one_piece_when_its_header_comes() {
        let content: Vec<u8> = (0..3000u32).map(|i| (i % 251) as u8 + 1).collect();
        let mut ob = outbox(false);
        ob.files.entry(1).or_default().push_back(FileRange {
            file: temp_file(&content),
            offset: 0,
            len: 3000,
        });
        let data = frame(DATA, 0x1, 1, &[0; 3000]);
        assert_eq!(
            ob.take(&data[..FRAME_HEADER]).expect("header"),
            FRAME_HEADER
        );
        assert_eq!(
            ob.queued,
            FRAME_HEADER + 3000,
            "the payload is queued with its header"
        );
        assert!(ob.files.is_empty(), "the body was taken whole");
        for part in data[FRAME_HEADER..].chunks(700) {
            assert_eq!(ob.take(part).expect("placeholders"), part.len());
        }
        assert_eq!(ob.queued, FRAME_HEADER + 3000, "placeholders add nothing");
        let mut expected = data[..FRAME_HEADER].to_vec();
        expected.extend_from_slice(&content);
        assert!(sent(&mut ob) == expected);
    }

    /// What the pump writes, in memory.
    struct Recorder {
        writes: Arc<Mutex<Vec<Vec<u8>>>>,
    }

    impl Transport for Recorder {
        fn sends_files(&self) -> bool {
            false
        }
        async fn readable(&mut self) -> io::Result<()> {
            std::future::pending().await
        }
        async fn read(&mut self, _: &mut [u8]) -> io::Result<usize> {
            std::future::pending().await
        }
        async fn write_all(&mut self, data: &[u8]) -> io::Result<()> {
            lock_writes(&self.writes).push(data.to_vec());
            Ok(())
        }
        async fn write_file(&mut self, _: &[u8], _: &File, _: u64, _: u64) -> io::Result<()> {
            unreachable!("the user plane sends no file ranges")
        }
    }

    fn lock_writes(w: &Mutex<Vec<Vec<u8>>>) -> MutexGuard<'_, Vec<Vec<u8>>> {
        w.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Bytes h2 queued go out at a [`Flusher::flush_if_due`] once there are
    /// [`EARLY_FLUSH`] of them, before h2's side waits; fewer wait for the rest of the round.
    #[tokio::test]
    async fn queued_bytes_go_out_at_a_flush_point_once_there_are_enough() {
        use tokio::io::AsyncWriteExt;
        let writes = Arc::new(Mutex::new(Vec::new()));
        let mut client = Recorder {
            writes: writes.clone(),
        };
        let ping = frame(0x6, 0, 0, &[7; 8]);
        let data = frame(DATA, 0, 1, &vec![b'x'; EARLY_FLUSH]);
        let seen = writes.clone();
        let (written_at, pumped) = run(
            &mut client,
            Woken::fresh(),
            Duration::from_secs(5),
            |mut io| async move {
                let flusher = io.flusher();
                let mut written_at = Vec::new();
                io.write_all(&ping).await.expect("queued");
                flusher.flush_if_due().await;
                written_at.push(lock_writes(&seen).len());
                io.write_all(&data).await.expect("queued");
                flusher.flush_if_due().await;
                written_at.push(lock_writes(&seen).len());
                io.write_all(&ping).await.expect("queued");
                written_at
            },
        )
        .await;
        pumped.expect("pump");
        assert_eq!(written_at, [0, 1], "writes seen at each flush point");
        let writes = lock_writes(&writes);
        assert_eq!(writes.len(), 2);
        assert_eq!(writes[0].len(), 2 * FRAME_HEADER + 8 + EARLY_FLUSH);
        assert_eq!(writes[1].len(), FRAME_HEADER + 8);
    }

    /// A DATA frame longer than the file body registered, or padded, is refused rather than
    /// sent with bytes that are not the body's.
    #[test]
    fn data_beyond_the_file_body_or_padded_is_an_error() {
        let mut ob = outbox(true);
        ob.files.entry(1).or_default().push_back(FileRange {
            file: temp_file(b"0123456789"),
            offset: 0,
            len: 10,
        });
        let err = ob.take(&frame(DATA, 0, 1, &[0; 11])).expect_err("too long");
        assert!(err.to_string().contains("beyond its file body"), "{err}");
        let mut ob = outbox(true);
        ob.files.entry(1).or_default().push_back(FileRange {
            file: temp_file(b"0123456789"),
            offset: 0,
            len: 10,
        });
        let err = ob
            .take(&frame(DATA, PADDED, 1, &[0; 5]))
            .expect_err("padded");
        assert!(err.to_string().contains("padded"), "{err}");
    }

    /// A file that shrank after its length was announced ends the connection on the user
    /// plane (sendfile reports it on the kernel plane): never a short or zero-filled body.
    #[test]
    fn a_file_shorter_than_announced_is_an_error_on_the_user_plane() {
        let mut ob = outbox(false);
        ob.files.entry(1).or_default().push_back(FileRange {
            file: temp_file(b"0123"),
            offset: 0,
            len: 10,
        });
        let data = frame(DATA, 0, 1, &[0; 10]);
        let err = ob.take(&data).expect_err("shrank");
        assert!(err.to_string().contains("shrank"), "{err}");
        // The frame's header went out; none of the file's bytes nor zeros in their place.
        assert_eq!(sent(&mut ob), data[..FRAME_HEADER]);
    }

    /// A DATA frame h2 framed before its stream was given up (`forget`) still carries the
    /// file's bytes, never the placeholders; a body given up long ago is dropped.
    #[test]
    fn a_frame_in_flight_when_its_body_is_forgotten_still_carries_the_file() {
        for sendfile in [false, true] {
            let mut ob = outbox(sendfile);
            let bodies = FileBodies(Arc::new(Mutex::new(outbox(sendfile))));
            let file = temp_file(b"0123456789");
            bodies.carry(1u32, file.clone(), 0, 10);
            bodies.forget(1u32);
            // Take the registry over into the outbox under test.
            std::mem::swap(&mut ob.files, &mut lock(&bodies.0).files);
            std::mem::swap(&mut ob.forgotten, &mut lock(&bodies.0).forgotten);
            let data = frame(DATA, 0, 1, &[0; 4]);
            ob.take(&data).expect("a frame framed before the reset");
            let mut expected = data[..FRAME_HEADER].to_vec();
            expected.extend_from_slice(b"0123");
            assert!(sent(&mut ob) == expected, "sendfile {sendfile}");
        }
        // Only the last FORGOTTEN bodies given up are kept.
        let bodies = FileBodies(Arc::new(Mutex::new(outbox(true))));
        let file = temp_file(b"0123456789");
        for stream in (1..).step_by(2).take(FORGOTTEN + 1) {
            bodies.carry(stream as u32, file.clone(), 0, 10);
            bodies.forget(stream as u32);
        }
        let kept = lock(&bodies.0);
        assert_eq!(kept.files.len(), FORGOTTEN);
        assert!(!kept.files.contains_key(&1), "the oldest is dropped");
    }
}
