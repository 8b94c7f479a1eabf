//! The floor of `h2` itself (docs/HTTP2.md, "The floor of h2"): CPU per request of
//! hyperium's h2 server answering 1 KiB responses to 100 streams at a time, in memory. No
//! TLS, no socket, no file (unless asked), no tokio reactor, none of serve's work: the
//! client's bytes are made here, once per batch, and the server's are parsed only far enough
//! to see each stream end.
//! The server is configured as serve's (`settings::server`), sends serve's header fields for
//! a 1 KiB file, and is driven the leanest way h2 allows: one task that accepts a stream and
//! answers it in place. So this is less than serve can spend per request over h2, and
//! anything built on h2 costs at least this much.
//!
//!     cargo run --release -p tlsplane-h2 --example h2_floor -- [REQUESTS] [ROUNDS] [FILE]
//!
//! (REQUESTS per round: 1,000,000; ROUNDS: 5). With FILE, each response's body is read from
//! it as a file server must (open, fstat, pread, close: the system calls serve makes for a
//! small file on the user plane) instead of being one `Bytes` in memory. Prints the CPU time
//! of the process per request (from /proc/self/stat, 10 ms ticks) per round, then the median
//! and range.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Instant;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

const STREAMS: u32 = 100;
const BODY: usize = 1024;

/// What the client and the server share: when a batch's streams have all ended, the client
/// may send the next (as h2load does with -m 100, it never exceeds the 100 streams allowed).
struct Wire {
    open: u32,
    reader: Option<Waker>,
    next_stream: u32,
    batches_left: u64,
    first: bool,
    /// Bytes of the server's output not yet parsed into whole frames (a frame header may be
    /// split between writes).
    partial: Vec<u8>,
    /// Payload bytes of the current frame still to skip.
    skip: usize,
    ended: u64,
    /// Client bytes made and not yet read by h2 (its preface reader takes 24 bytes).
    unread: Vec<u8>,
    read_at: usize,
}

fn frame(out: &mut Vec<u8>, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
    let len = payload.len() as u32;
    out.extend_from_slice(&len.to_be_bytes()[1..]);
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
}

impl Wire {
    /// The client's next bytes: its opening with the first batch, then a batch of HEADERS
    /// (GET, END_STREAM) and the WINDOW_UPDATE that gives back the connection window the
    /// previous batch used, as h2load does.
    fn client_bytes(&mut self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 * STREAMS as usize);
        if self.first {
            out.extend_from_slice(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");
            // SETTINGS: ENABLE_PUSH 0, INITIAL_WINDOW_SIZE 1 GiB (h2load's -w 30); the ack of
            // the server's SETTINGS (h2 wrote them before it read anything).
            let mut s = Vec::new();
            s.extend_from_slice(&[0, 2, 0, 0, 0, 0]);
            s.extend_from_slice(&[0, 4]);
            s.extend_from_slice(&(1u32 << 30).to_be_bytes());
            frame(&mut out, 0x4, 0, 0, &s);
            frame(&mut out, 0x4, 0x1, 0, &[]);
            // The connection window: 1 GiB as well (h2load's -W 30).
            frame(&mut out, 0x8, 0, 0, &((1u32 << 30) - 65535).to_be_bytes());
        } else {
            // What the last batch used of the connection window.
            let used = STREAMS * BODY as u32;
            frame(&mut out, 0x8, 0, 0, &used.to_be_bytes());
        }
        for _ in 0..STREAMS {
            let id = self.next_stream;
            self.next_stream += 2;
            let block: Vec<u8> = if id == 1 {
                // :method GET, :scheme https (static), then :path, :authority and user-agent
                // as literals added to the dynamic table.
                let mut b = vec![0x82, 0x87];
                for (prefix, value) in [
                    (0x44u8, &b"/1k.bin"[..]),
                    (0x41, &b"127.0.0.1:9443"[..]),
                    (0x7a, &b"h2load nghttp2/1.52.0"[..]),
                ] {
                    b.push(prefix);
                    b.push(value.len() as u8);
                    b.extend_from_slice(value);
                }
                b
            } else {
                // All five from the tables: path 64, authority 63, user-agent 62.
                vec![0x82, 0x87, 0xc0, 0xbf, 0xbe]
            };
            frame(&mut out, 0x1, 0x5, id, &block);
        }
        self.first = false;
        self.open = STREAMS;
        out
    }

    /// Follows the server's frames; a DATA frame with END_STREAM ends a stream.
    fn server_bytes(&mut self, mut buf: &[u8]) {
        loop {
            if self.skip > 0 {
                let n = self.skip.min(buf.len());
                self.skip -= n;
                buf = &buf[n..];
            }
            if buf.is_empty() {
                return;
            }
            let need = 9 - self.partial.len();
            let n = need.min(buf.len());
            self.partial.extend_from_slice(&buf[..n]);
            buf = &buf[n..];
            if self.partial.len() < 9 {
                return;
            }
            let h = &self.partial;
            let len = u32::from_be_bytes([0, h[0], h[1], h[2]]) as usize;
            if h[3] == 0x0 && h[4] & 0x1 != 0 {
                self.ended += 1;
                self.open -= 1;
                if self.open == 0 {
                    if let Some(w) = self.reader.take() {
                        w.wake();
                    }
                }
            }
            self.partial.clear();
            self.skip = len;
        }
    }
}

#[derive(Clone)]
struct Io(Arc<Mutex<Wire>>);

impl AsyncRead for Io {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let mut w = self.0.lock().unwrap();
        if w.read_at == w.unread.len() {
            if w.open > 0 {
                w.reader = Some(cx.waker().clone());
                return Poll::Pending;
            }
            if w.batches_left == 0 {
                return Poll::Ready(Ok(())); // end of input: h2 finishes the connection
            }
            w.batches_left -= 1;
            w.unread = w.client_bytes();
            w.read_at = 0;
        }
        let n = buf.remaining().min(w.unread.len() - w.read_at);
        let at = w.read_at;
        buf.put_slice(&w.unread[at..at + n]);
        w.read_at += n;
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Io {
    fn poll_write(self: Pin<&mut Self>, _: &mut Context<'_>, b: &[u8]) -> Poll<io::Result<usize>> {
        self.0.lock().unwrap().server_bytes(b);
        Poll::Ready(Ok(b.len()))
    }
    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// utime + stime of this process, in seconds.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").expect("/proc/self/stat");
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .expect("stat")
        .1
        .split_whitespace()
        .collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    ticks as f64 / 100.0
}

/// The body of a response: the file's bytes, read afresh, or the same bytes in memory.
fn body(file: Option<&Path>, memory: &Bytes) -> Bytes {
    let Some(path) = file else {
        return memory.clone();
    };
    let f = File::open(path).expect("FILE");
    let len = f.metadata().expect("fstat").len() as usize;
    let mut bytes = vec![0; len];
    f.read_exact_at(&mut bytes, 0).expect("pread");
    Bytes::from(bytes)
}

async fn serve(io: Io, file: Option<&Path>) -> u64 {
    let memory = Bytes::from(vec![0x5a; BODY]);
    let mut conn = tlsplane_h2::settings::server(tlsplane_h2::settings::SEND_BUFFER)
        .handshake::<_, Bytes>(io)
        .await
        .expect("h2 handshake");
    let mut answered = 0;
    while let Some(next) = conn.accept().await {
        let (_req, mut respond) = next.expect("request");
        // serve's fields for a 1 KiB file (curl --http2 -D - https://.../1k.bin), made the
        // cheapest way `http` has: known names, static values, no parsing.
        let mut head = http::Response::new(());
        let fields = head.headers_mut();
        for (name, value) in [
            (header::SERVER, "tlsplane"),
            (header::DATE, "Fri, 27 Nov 2026 07:50:24 GMT"),
            (header::CONTENT_TYPE, "application/octet-stream"),
            (header::CONTENT_LENGTH, "1024"),
            (header::LAST_MODIFIED, "Fri, 27 Nov 2026 07:49:23 GMT"),
            (header::ETAG, "\"18ebd7729f8621bf-400\""),
            (header::ACCEPT_RANGES, "bytes"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ] {
            fields.append(name, HeaderValue::from_static(value));
        }
        let mut send = respond.send_response(head, false).expect("send_response");
        send.send_data(body(file, &memory), true)
            .expect("send_data");
        answered += 1;
    }
    answered
}

fn main() {
    let mut args = std::env::args().skip(1);
    let requests: u64 = args
        .next()
        .map_or(1_000_000, |a| a.parse().expect("REQUESTS"));
    let rounds: usize = args.next().map_or(5, |a| a.parse().expect("ROUNDS"));
    let file = args.next().map(PathBuf::from);
    if let Some(f) = &file {
        let len = std::fs::metadata(f).expect("FILE").len();
        assert_eq!(
            len, BODY as u64,
            "FILE must hold {BODY} bytes (content-length)"
        );
    }
    let batches = requests.div_ceil(u64::from(STREAMS));
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let mut per_request = Vec::new();
    for round in 1..=rounds {
        let wire = Arc::new(Mutex::new(Wire {
            open: 0,
            reader: None,
            next_stream: 1,
            batches_left: batches,
            first: true,
            partial: Vec::with_capacity(9),
            skip: 0,
            ended: 0,
            unread: Vec::new(),
            read_at: 0,
        }));
        let (cpu0, wall0) = (cpu_seconds(), Instant::now());
        let answered = rt.block_on(serve(Io(wire.clone()), file.as_deref()));
        let (cpu, wall) = (cpu_seconds() - cpu0, wall0.elapsed().as_secs_f64());
        let ended = wire.lock().unwrap().ended;
        assert_eq!(
            ended,
            batches * u64::from(STREAMS),
            "every stream answered to its end"
        );
        let us = cpu / answered as f64 * 1e6;
        println!(
            "round {round}: {answered} requests, {us:.2} µs CPU / request ({:.2} µs wall)",
            wall / answered as f64 * 1e6
        );
        per_request.push(us);
    }
    per_request.sort_by(f64::total_cmp);
    println!(
        "h2 alone, 1 KiB x {STREAMS} streams, body {}: {:.2} µs CPU / request, median of {rounds} ({:.2}–{:.2})",
        if file.is_some() { "read from FILE" } else { "in memory" },
        per_request[per_request.len() / 2],
        per_request[0],
        per_request[per_request.len() - 1]
    );
}
