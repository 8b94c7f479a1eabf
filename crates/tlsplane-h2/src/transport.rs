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
//!   copy encryption needs. A frame of a file stream that does not match its body resets the
//!   stream instead (`Outbox::refuse`): no byte but the file's goes as the file.
//! - the client's frames are counted against the control-frame caps before h2 reads them
//!   ([`crate::flood`]); past one h2 gets none of its bytes any more, and the product ends
//!   the connection ([`Floods`]).
//! - the product may learn when a stream's last frame has been written ([`StreamEnds`]).
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
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes};
use tlsplane::{PlaneKind, TlsStream};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::flood::{Flood, Inbound};

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
/// the server used a fraction of its core); writing every ~4 responses of 1 KiB lets the two
/// overlap, at few more writes; 2 KiB cost more CPU per request and 6 KiB overlapped less
/// (docs/BENCHMARKS.md, "One HTTP/2 connection, 10 streams").
pub const EARLY_FLUSH: usize = 4 * 1024;
/// User plane: file DATA frames up to this long are read from the file in one piece when
/// their header comes ([`Outbox::take`]): small responses, where the second read was a large
/// share of the work. Reading 16 KiB frames whole too made large files cost more
/// (docs/BENCHMARKS.md, "One HTTP/2 connection, 10 streams").
const SMALL_FILE_FRAME: usize = 4 * 1024;
/// The frame header's length (RFC 9113 §4.1).
const FRAME_HEADER: usize = 9;
/// A file DATA frame's payload on the kernel plane: with its header, one full TLS record
/// (16,384 bytes of plaintext; [`FileBodies::frame_limit`]).
pub const KERNEL_FILE_FRAME: usize = 16 * 1024 - FRAME_HEADER;
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const INTERNAL_ERROR: u32 = 0x2;
/// Streams remembered after their file bodies were dropped, or after we reset them, so that
/// a late frame of one is never sent as it is: h2 holds at most one frame of a stream after
/// its reset, far fewer streams back than this.
pub const KEPT_STREAMS: usize = 64;
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

/// What becomes of the payload of the frame h2 is writing.
#[derive(Clone, Copy, Default, PartialEq, Eq)]
enum Payload {
    /// Queued as written.
    #[default]
    Bytes,
    /// Placeholders of the file body of this stream: its bytes go in their place.
    File(u32),
    /// User plane: placeholders of a file DATA frame whose bytes were all read in when its
    /// header came; dropped as h2 writes them.
    FileRead,
    /// A frame of a stream we reset (`Outbox::refuse`): dropped.
    Dropped,
}

/// Where h2's writes stand in its frame sequence.
#[derive(Default)]
struct Frames {
    header: [u8; FRAME_HEADER],
    /// Header bytes seen of the current frame (the payload follows once all 9 are). They are
    /// queued once all have come: the frame may be one to drop or replace.
    header_len: usize,
    /// Payload bytes of the current frame still to come.
    payload_left: usize,
    payload: Payload,
    /// The stream the current frame ends, once its last byte is taken, and whether whole
    /// (END_STREAM) or reset (RST_STREAM).
    ends: Option<(u32, bool)>,
    /// A header block with END_STREAM goes on in CONTINUATION frames: the stream ends with it.
    block_ends: Option<u32>,
}

/// Where a watched stream's end stands ([`StreamEnds`]).
enum End {
    /// Its last frame has not been written by h2 yet.
    Waiting(Option<Waker>),
    /// Its last frame is queued, or being sent, by the pump: whole or reset.
    Queued(bool, Option<Waker>),
    /// Sent to the client (true: whole), or never will be (false).
    Done(bool),
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
    /// The client's frames, counted against the control-frame caps ([`crate::flood`]).
    limits: Inbound,
    /// The product, waiting to hear that the client passed a cap.
    flood_watcher: Option<Waker>,
    pieces: VecDeque<Piece>,
    /// Bytes (of both kinds) queued.
    queued: usize,
    frames: Frames,
    /// File ranges by stream, in the order their DATA will be written; a stream is kept
    /// (its ranges all sent) until its last frame, so that DATA beyond its body is known.
    files: HashMap<u32, VecDeque<FileRange>>,
    /// Streams whose bodies were given up, oldest first ([`FileBodies::forget`]).
    forgotten: VecDeque<u32>,
    /// Streams whose given-up bodies were dropped from `files` (older than the last
    /// [`FORGOTTEN`]): a DATA frame on one would be placeholders with nothing to put in.
    dropped: VecDeque<u32>,
    /// Streams we reset because h2's frames did not match their file bodies
    /// (`Outbox::refuse`): h2's later frames of them are dropped.
    refused: VecDeque<u32>,
    /// Streams whose end a product waits for ([`StreamEnds`]).
    ends: HashMap<u32, End>,
    /// Of those, the ones whose last frame is queued, and being sent by the pump.
    queued_ends: Vec<u32>,
    sending_ends: Vec<u32>,
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
            limits: Inbound::new(Instant::now()),
            flood_watcher: None,
            pieces: VecDeque::new(),
            queued: 0,
            frames: Frames::default(),
            files: HashMap::new(),
            forgotten: VecDeque::new(),
            dropped: VecDeque::new(),
            refused: VecDeque::new(),
            ends: HashMap::new(),
            queued_ends: Vec::new(),
            sending_ends: Vec::new(),
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
            _ if matches!(f.payload, Payload::File(_)) => f.payload_left,
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

    /// File bytes registered for `stream` and not sent yet.
    fn file_left(&self, stream: u32) -> Option<u64> {
        let ranges = self.files.get(&stream)?;
        Some(ranges.iter().map(|r| r.len).sum())
    }

    /// Takes `n` bytes of the file body of `stream` in place of `n` placeholder bytes (the
    /// frame's header checked there are as many).
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
        Ok(())
    }

    /// Takes bytes h2 wrote, following its frames; returns how many were taken (all of
    /// `buf`, unless a file could not be read: an error).
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
                buf = &buf[n..];
                if f.header_len == FRAME_HEADER {
                    self.frame_begins()?;
                }
                continue;
            }
            let n = f.payload_left.min(buf.len());
            match f.payload {
                Payload::FileRead | Payload::Dropped => {}
                Payload::File(stream) => self.push_file(stream, n)?,
                Payload::Bytes => self.push_bytes(&buf[..n]),
            }
            buf = &buf[n..];
            self.frames.payload_left -= n;
            if self.frames.payload_left == 0 {
                self.frame_ends();
            }
        }
        Ok(total)
    }

    /// The current frame's header is all in: what becomes of the frame.
    fn frame_begins(&mut self) -> io::Result<()> {
        let h = self.frames.header;
        let len = u32::from_be_bytes([0, h[0], h[1], h[2]]) as usize;
        let (kind, flags) = (h[3], h[4]);
        let stream = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
        let f = &mut self.frames;
        f.payload_left = len;
        f.payload = Payload::Bytes;
        f.ends = match kind {
            DATA if flags & END_STREAM != 0 => Some((stream, true)),
            HEADERS if flags & END_STREAM != 0 && flags & END_HEADERS == 0 => {
                f.block_ends = Some(stream);
                None
            }
            HEADERS if flags & END_STREAM != 0 => Some((stream, true)),
            CONTINUATION if flags & END_HEADERS != 0 && f.block_ends == Some(stream) => {
                f.block_ends = None;
                Some((stream, true))
            }
            RST_STREAM => Some((stream, false)),
            _ => None,
        };
        if kind == DATA {
            self.limits.data_frame_sent();
        }
        if self.refused.contains(&stream) {
            self.frames.payload = Payload::Dropped;
        } else if let Some(left) = self.file_left(stream) {
            let ends = self.frames.ends.is_some_and(|(_, whole)| whole);
            // What the stream's end would leave of the body unsent.
            let short = if kind == DATA {
                len as u64 != left
            } else {
                left > 0
            };
            if kind == DATA && flags & PADDED != 0 {
                // h2 never pads; the payload would not be the body alone.
                self.refuse(stream, "a padded DATA frame");
            } else if kind == DATA && len as u64 > left {
                self.refuse(stream, "DATA beyond its file body");
            } else if ends && short {
                // The client would take a short body for the whole file.
                self.refuse(stream, "the stream ended before its file body");
            } else {
                self.push_bytes(&h);
                if kind == DATA {
                    self.frames.payload = Payload::File(stream);
                    self.read_small_frame(stream, len)?;
                }
            }
        } else if kind == DATA && len > 0 && self.dropped.contains(&stream) {
            self.refuse(stream, "DATA on a stream whose file body was dropped");
        } else {
            self.push_bytes(&h);
        }
        if len == 0 {
            self.frame_ends();
        }
        Ok(())
    }

    /// User plane: a small file DATA frame's payload is read in one piece when its header
    /// comes. h2 writes a frame's first bytes with the bytes before them and the rest on their
    /// own, which was two reads of the file per frame. Not past OUTBOX: the pump's batches
    /// stay cut where h2's writes stop for want of room, every 64 KiB of a long body, which
    /// the record layer cuts into whole records (65,572 bytes left a 36-byte record every 4).
    fn read_small_frame(&mut self, stream: u32, len: usize) -> io::Result<()> {
        if !self.sendfile && len > 0 && len <= SMALL_FILE_FRAME && self.queued + len <= OUTBOX {
            self.push_file(stream, len)?;
            self.frames.payload = Payload::FileRead;
        }
        Ok(())
    }

    /// The current frame's last byte is taken.
    fn frame_ends(&mut self) {
        self.frames.header_len = 0;
        let Some((stream, whole)) = self.frames.ends.take() else {
            return;
        };
        // h2 writes nothing more on the stream.
        self.files.remove(&stream);
        self.forgotten.retain(|&s| s != stream);
        self.dropped.retain(|&s| s != stream);
        if self.frames.payload == Payload::Dropped {
            self.refused.retain(|&s| s != stream);
        } else {
            self.end_queued(stream, whole);
        }
    }

    /// `stream`'s last frame is queued: its end is the pump's to send.
    fn end_queued(&mut self, stream: u32, whole: bool) {
        if let Some(end) = self.ends.get_mut(&stream) {
            if let End::Waiting(waker) = end {
                *end = End::Queued(whole, waker.take());
                self.queued_ends.push(stream);
            }
        }
    }

    /// A watched stream's end is known without anything more to send: the client reset it,
    /// or the pump is gone.
    fn end_done(&mut self, stream: u32, whole: bool) {
        if let Some(end) = self.ends.get_mut(&stream) {
            let waker = match end {
                End::Waiting(w) | End::Queued(_, w) => w.take(),
                End::Done(_) => return,
            };
            *end = End::Done(whole);
            if let Some(w) = waker {
                w.wake();
            }
        }
    }

    /// The pump sent the batch with these streams' last frames.
    fn ends_sent(&mut self, streams: &[u32]) {
        for &stream in streams {
            if let Some(End::Queued(whole, _)) = self.ends.get(&stream) {
                let whole = *whole;
                self.end_done(stream, whole);
            }
        }
    }

    /// h2's frames on `stream` do not match the file body registered for it (h2 changed how
    /// it frames bodies): the stream is reset (RST_STREAM(INTERNAL_ERROR)) in place of the
    /// current frame, and h2's later frames of it go nowhere, so that no byte that is not the
    /// file's, and no short body, reaches the client as the file. Counted in
    /// `h2_file_body_resets`.
    fn refuse(&mut self, stream: u32, why: &str) {
        static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
            tracing::warn!(
                stream,
                "h2 framed a file body unlike the body registered ({why}): stream reset \
                 (further ones are only counted, in h2_file_body_resets)"
            );
        }
        let resets = &tlsplane::stats::global().h2_file_body_resets;
        resets.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.files.remove(&stream);
        self.forgotten.retain(|&s| s != stream);
        self.dropped.retain(|&s| s != stream);
        let mut rst = [0u8; FRAME_HEADER + 4];
        rst[..FRAME_HEADER].copy_from_slice(&[0, 0, 4, RST_STREAM, 0, 0, 0, 0, 0]);
        rst[5..9].copy_from_slice(&stream.to_be_bytes());
        rst[9..].copy_from_slice(&INTERNAL_ERROR.to_be_bytes());
        self.push_bytes(&rst);
        keep_last(&mut self.refused, stream, KEPT_STREAMS);
        self.frames.payload = Payload::Dropped;
        self.end_queued(stream, false);
        // Its end is told; h2's later frames of the stream, should any come, go nowhere.
        self.frames.ends = None;
    }
}

impl Outbox {
    /// Follows the client's bytes just read (`inbound`) through the control-frame caps: h2
    /// gets those before a frame past its cap, and none after. Streams the client reset end
    /// their watches. Returns whether a cap was passed (nothing more is to be read).
    fn admit_inbound(&mut self) -> bool {
        let n = self.limits.admit(&self.inbound, Instant::now);
        for stream in std::mem::take(&mut self.limits.resets) {
            self.end_done(stream, false);
        }
        let Some(flood) = self.limits.flooded() else {
            return false;
        };
        self.inbound.truncate(n);
        if self.inbound.is_empty() {
            self.inbound = Vec::new();
            self.inbound_at = 0;
        }
        tracing::debug!(frame = flood.name(), "h2 client past a control-frame cap");
        if let Some(watcher) = self.flood_watcher.take() {
            watcher.wake();
        }
        true
    }
}

/// Appends `stream` to `ring`, which keeps the last `max`.
fn keep_last(ring: &mut VecDeque<u32>, stream: u32, max: usize) {
    if !ring.contains(&stream) {
        ring.push_back(stream);
        if ring.len() > max {
            ring.pop_front();
        }
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
        outbox.dropped.retain(|&s| s != stream);
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
    /// bytes (so that h2's flow-control windows stay the client's). Older ones are dropped,
    /// and a DATA frame of one that came all the same would reset its stream
    /// (`Outbox::refuse`), never go with placeholders.
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
                keep_last(&mut outbox.dropped, oldest, KEPT_STREAMS);
            }
        }
    }

    /// Whether `stream` was reset because h2's frames did not match its file body: its
    /// sender should reset it in h2 too (`send_reset`), so that h2 stops framing a body the
    /// client no longer gets and gives its window back.
    pub fn refused(&self, stream: impl Into<u32>) -> bool {
        let stream = stream.into();
        lock(&self.0).refused.contains(&stream)
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

/// Tells when a stream's last byte has gone to the client (for the access log's duration,
/// which over HTTP/1.1 ends at the response's last byte too): see [`watch`](Self::watch).
#[derive(Clone)]
pub struct StreamEnds(Arc<Mutex<Outbox>>);

impl StreamEnds {
    /// Watches `stream` (an [`h2::StreamId`], or its number): call before its last frame can
    /// be sent (before handing h2 its end). Dropping the watch forgets it.
    pub fn watch(&self, stream: impl Into<u32>) -> EndWatch {
        let stream = stream.into();
        lock(&self.0).ends.insert(stream, End::Waiting(None));
        EndWatch {
            outbox: self.0.clone(),
            stream,
        }
    }
}

/// A stream whose end is watched ([`StreamEnds::watch`]).
pub struct EndWatch {
    outbox: Arc<Mutex<Outbox>>,
    stream: u32,
}

impl EndWatch {
    /// Waits until the stream's last frame has been written to the client: true when it ended
    /// the stream whole (END_STREAM), false when the stream was reset (by either side) or the
    /// connection failed first.
    pub async fn sent(&mut self) -> bool {
        std::future::poll_fn(|cx| {
            let mut outbox = lock(&self.outbox);
            match outbox.ends.get_mut(&self.stream) {
                Some(End::Done(whole)) => Poll::Ready(*whole),
                Some(End::Waiting(w) | End::Queued(_, w)) => {
                    *w = Some(cx.waker().clone());
                    Poll::Pending
                }
                None => Poll::Ready(false),
            }
        })
        .await
    }
}

impl Drop for EndWatch {
    fn drop(&mut self) {
        lock(&self.outbox).ends.remove(&self.stream);
    }
}

/// Tells when the client passed a control-frame cap ([`crate::flood`]): the pump then gives h2
/// nothing more of its bytes, and the product ends the connection with
/// GOAWAY(ENHANCE_YOUR_CALM) (h2's `abrupt_shutdown`).
#[derive(Clone)]
pub struct Floods(Arc<Mutex<Outbox>>);

impl Floods {
    /// Waits until the client passes a cap: which one. Ready at once from then on.
    pub async fn flooded(&self) -> Flood {
        std::future::poll_fn(|cx| {
            let mut outbox = lock(&self.0);
            match outbox.limits.flooded() {
                Some(flood) => Poll::Ready(flood),
                None => {
                    // Polled at every turn of the product's loop: the waker is cloned only
                    // when it changed.
                    let watcher = &mut outbox.flood_watcher;
                    if !watcher.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                        *watcher = Some(cx.waker().clone());
                    }
                    Poll::Pending
                }
            }
        })
        .await
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

    pub fn stream_ends(&self) -> StreamEnds {
        StreamEnds(self.outbox.clone())
    }

    pub fn floods(&self) -> Floods {
        Floods(self.outbox.clone())
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
    outbox.admit_inbound();
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
        // Streams whose last frame was not sent never will be.
        let watched: Vec<u32> = outbox.ends.keys().copied().collect();
        for stream in watched {
            outbox.end_done(stream, false);
        }
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
    // The client's input ended, or passed a control-frame cap: nothing more is read.
    let mut input_done = lock(outbox).limits.flooded().is_some();
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
                    input_done = shared.admit_inbound();
                }
                if let Some(reader) = shared.reader.take() {
                    reader.wake();
                }
            },
            pieces = std::future::poll_fn(|cx| next_pieces(outbox, cx)) => {
                let Some(pieces) = pieces else { return Ok(()) };
                let sent = tokio::time::timeout(stall, send(tls, pieces)).await;
                let mut shared = lock(outbox);
                shared.sending = false;
                if matches!(sent, Ok(Ok(()))) {
                    let ends = std::mem::take(&mut shared.sending_ends);
                    shared.ends_sent(&ends);
                }
                drop(shared);
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
    outbox.sending_ends = std::mem::take(&mut outbox.queued_ends);
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
    use std::sync::atomic::Ordering::Relaxed;

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
        assert_eq!(ob.file_left(1), Some(0), "the body was taken whole");
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

    /// Registers `len` bytes of `file` as stream `stream`'s body.
    fn register(ob: &mut Outbox, stream: u32, file: &Arc<File>, len: u64) {
        ob.files.entry(stream).or_default().push_back(FileRange {
            file: file.clone(),
            offset: 0,
            len,
        });
    }

    /// Frames of a file stream that do not match its body (h2 framing it unlike today's h2:
    /// padded, longer than the body's rest, ending the stream short of it, or on a body that
    /// was given up and dropped) reset the stream in the offending frame's place, and h2's
    /// later frames of it are dropped, on both planes and however the writes are cut. The
    /// client gets no byte in place of the file's but the file's, the other stream's frames
    /// whole, the reset counted.
    #[test]
    fn frames_unlike_the_file_body_reset_its_stream_and_send_no_other_bytes() {
        let content = b"0123456789";
        let headers = |stream| frame(HEADERS, END_HEADERS, stream, b"\x88");
        let rst = frame(RST_STREAM, 0, 1, &INTERNAL_ERROR.to_be_bytes());
        // (case, the frames of stream 1 h2 writes, what the client gets of them before the
        // reset, streams given up before)
        let cases: [(&str, Vec<u8>, Vec<u8>, bool); 5] = [
            ("padded", frame(DATA, PADDED, 1, &[0; 5]), vec![], false),
            ("too long", frame(DATA, 0, 1, &[0; 11]), vec![], false),
            (
                "short end",
                frame(DATA, END_STREAM, 1, &[0; 4]),
                vec![],
                false,
            ),
            (
                "trailers before the body's end",
                [
                    frame(DATA, 0, 1, &[0; 4]),
                    frame(HEADERS, END_STREAM | END_HEADERS, 1, b"\x88"),
                ]
                .concat(),
                frame(DATA, 0, 1, b"0123"),
                false,
            ),
            ("a dropped body", frame(DATA, 0, 1, &[0; 4]), vec![], true),
        ];
        for (case, theirs, before_reset, dropped) in cases {
            let mut written = [headers(1), headers(3)].concat();
            written.extend(&theirs);
            // h2 goes on with the stream it thinks open, then another's, then resets it.
            written.extend(frame(DATA, 0, 1, &[0; 3]));
            written.extend(frame(DATA, END_STREAM, 3, b"abc"));
            written.extend(frame(RST_STREAM, 0, 1, &8u32.to_be_bytes()));
            written.extend(frame(0x6, 0, 0, &[1; 8]));
            let mut expected = [headers(1), headers(3)].concat();
            expected.extend(&before_reset);
            expected.extend(&rst);
            expected.extend(frame(DATA, END_STREAM, 3, b"abc"));
            expected.extend(frame(0x6, 0, 0, &[1; 8]));
            for sendfile in [false, true] {
                for cut in [1, 4, 9, 10, 13, written.len()] {
                    let mut ob = outbox(sendfile);
                    let file = temp_file(content);
                    if dropped {
                        let bodies = FileBodies(Arc::new(Mutex::new(outbox(sendfile))));
                        // Stream 1's, then as many given up after it as are kept.
                        for stream in [1u32].into_iter().chain((101..).step_by(2).take(FORGOTTEN)) {
                            bodies.carry(stream, file.clone(), 0, 10);
                            bodies.forget(stream);
                        }
                        let mut registry = lock(&bodies.0);
                        std::mem::swap(&mut ob.files, &mut registry.files);
                        std::mem::swap(&mut ob.forgotten, &mut registry.forgotten);
                        std::mem::swap(&mut ob.dropped, &mut registry.dropped);
                    } else {
                        register(&mut ob, 1, &file, content.len() as u64);
                    }
                    ob.ends.insert(1, End::Waiting(None));
                    let counted = tlsplane::stats::global().h2_file_body_resets.load(Relaxed);
                    for chunk in written.chunks(cut) {
                        assert_eq!(ob.take(chunk).expect("taken"), chunk.len(), "{case}");
                    }
                    let got = sent(&mut ob);
                    assert!(got == expected, "{case}, sendfile {sendfile}, cut {cut}");
                    assert!(
                        tlsplane::stats::global().h2_file_body_resets.load(Relaxed) > counted,
                        "{case}: not counted"
                    );
                    assert!(
                        matches!(ob.ends.get(&1), Some(End::Queued(false, _))),
                        "{case}"
                    );
                    assert!(!ob.files.contains_key(&1), "{case}");
                    assert!(ob.refused.is_empty(), "{case}: h2's reset ends the refusal");
                }
            }
        }
    }

    /// A Transport over an in-memory pipe, its other end a real h2 client's.
    struct Pipe(tokio::io::DuplexStream);

    impl Transport for Pipe {
        fn sends_files(&self) -> bool {
            false
        }
        async fn readable(&mut self) -> io::Result<()> {
            Ok(())
        }
        async fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            tokio::io::AsyncReadExt::read(&mut self.0, buf).await
        }
        async fn write_all(&mut self, data: &[u8]) -> io::Result<()> {
            tokio::io::AsyncWriteExt::write_all(&mut self.0, data).await
        }
        async fn write_file(&mut self, _: &[u8], _: &File, _: u64, _: u64) -> io::Result<()> {
            unreachable!("the user plane sends no file ranges")
        }
    }

    /// With the `h2` this crate is built with (pinned in Cargo.toml): a product that hands h2
    /// more placeholders than the file body it registered, or fewer, as an h2 framing
    /// bodies otherwise than today's would, gets its stream reset (INTERNAL_ERROR), counted,
    /// and the client receives not one byte in the file's place; the connection's other
    /// streams, before and after, are whole.
    #[tokio::test]
    async fn a_body_h2_frames_unlike_its_file_resets_its_stream_only() {
        let content: Vec<u8> = (0..100u32).map(|i| (i % 250) as u8 + 1).collect();
        let file = temp_file(&content);
        let (client_io, server_io) = tokio::io::duplex(1 << 20);
        let server = tokio::spawn(async move {
            let mut pipe = Pipe(server_io);
            let (served, _) = run(&mut pipe, Woken::fresh(), Duration::from_secs(5), |io| {
                let files = io.file_bodies();
                async move {
                    let handshake = crate::settings::server(1 << 20).handshake::<_, H2Body>(io);
                    let mut conn = handshake.await?;
                    while let Some(accepted) = conn.accept().await {
                        let (req, mut send) = accepted?;
                        // (bytes registered, placeholders handed to h2)
                        let (registered, handed) = match req.uri().path() {
                            "/more" => (10, 20),
                            "/fewer" => (30, 20),
                            _ => (20, 20),
                        };
                        let mut stream = send.send_response(http::Response::new(()), false)?;
                        files.carry(stream.stream_id(), file.clone(), 0, registered);
                        stream.send_data(H2Body::file(handed), true)?;
                    }
                    Ok::<_, h2::Error>(())
                }
            })
            .await;
            served
        });
        let counted = tlsplane::stats::global().h2_file_body_resets.load(Relaxed);
        let (mut client, conn) = h2::client::handshake(client_io).await.expect("handshake");
        let driver = tokio::spawn(conn);
        let mut got = Vec::new();
        for path in ["/", "/more", "/fewer", "/"] {
            let req = http::Request::get(format!("https://localhost{path}"))
                .body(())
                .expect("request");
            let (response, _) = client.send_request(req, true).expect("sent");
            let mut body = response.await.expect("response head").into_body();
            let (mut bytes, mut reset) = (Vec::new(), None);
            while let Some(data) = body.data().await {
                match data {
                    Ok(d) => {
                        let _ = body.flow_control().release_capacity(d.len());
                        bytes.extend_from_slice(&d);
                    }
                    Err(e) => {
                        reset = e.reason();
                        break;
                    }
                }
            }
            got.push((bytes, reset));
        }
        drop(client);
        let _ = driver.await;
        server.await.expect("server task").expect("server's h2");
        let whole = (content[..20].to_vec(), None);
        let refused = (Vec::new(), Some(h2::Reason::INTERNAL_ERROR));
        assert_eq!(got, [whole.clone(), refused.clone(), refused, whole]);
        let counted_now = tlsplane::stats::global().h2_file_body_resets.load(Relaxed);
        assert!(counted_now >= counted + 2, "{counted} -> {counted_now}");
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
