//! The life of a server-side h2 connection, the same for every product that speaks h2: its
//! streams as they come, the idle timeout, the idle eviction under --max-connections, shutdown,
//! and the end of a connection a client keeps open after our GOAWAY. Products give what to do
//! with each stream.

use std::cell::Cell;
use std::future::Future;
use std::io;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use bytes::Buf;
use futures_util::stream::{FuturesUnordered, StreamExt};
use h2::server::{Connection, SendResponse};
use h2::RecvStream;
use tlsplane::stats::Counter;
use tlsplane::TlsStream;
use tlsplane_h2::flood::Flood;
use tlsplane_h2::greeting::{self, Greeting, Heard};
use tlsplane_h2::transport::{Floods, Flusher, H2Io, Woken};
use tlsplane_server::runtime::Idle;
use tokio::sync::watch;
use tokio::time::{timeout_at, Instant};

/// What one read of a connection's opening takes at most: the client's opening frames and the
/// header of the frame that wakes h2 (a request's first bytes), which the pump reads the rest
/// of. Small, and allocated only while a read is under way: a 16 KiB buffer freed just before
/// h2's allocations left holes in the heap that cost a used connection ~7 KiB of RSS more
/// (docs/HTTP2.md, "The opening").
const OPENING_READ: usize = 1024;

/// HTTP/2 counters, shared by the products that speak it (on /metrics as
/// `tlsplane_h2_*_total`).
#[derive(Default)]
pub(crate) struct H2Stats {
    /// Connections that chose h2.
    pub connections: Counter,
    /// Of those, connections h2 was started for: the client sent more than its opening (a
    /// request, or any frame the opening does not take). The others cost no h2 state.
    pub started: Counter,
    /// Streams (requests) accepted.
    pub streams: Counter,
    /// Connections we ended with GOAWAY(ENHANCE_YOUR_CALM): a flood h2 bounds (rapid reset,
    /// too many resets we had to send, floods of small frames).
    pub goaway_calm: Counter,
    /// Connections we ended with GOAWAY for another protocol error of the client's
    /// (PROTOCOL_ERROR, COMPRESSION_ERROR, FRAME_SIZE_ERROR, FLOW_CONTROL_ERROR, ...).
    pub goaway_protocol: Counter,
    /// Streams reset, or connections ended, because the client granted no window or took
    /// none of our bytes for the stall timeout.
    pub stalls: Counter,
    /// Idle connections (no stream open) sent GOAWAY to make room for a new connection under
    /// --max-connections.
    pub evictions: Counter,
    /// Connections ended with GOAWAY(ENHANCE_YOUR_CALM) (counted in `goaway_calm` too) for
    /// passing a control-frame cap ([`tlsplane_h2::flood`]), by the frame's kind, in the
    /// order of [`Flood::ALL`].
    pub floods: [Counter; 4],
}

/// How many counters [`H2Stats::counters`] gives.
const COUNTERS: usize = 11;

impl H2Stats {
    /// The counters under `names` (the product's: [`SERVE`](Self::SERVE),
    /// [`PROXY`](Self::PROXY)).
    pub(crate) fn counters(
        &self,
        names: &[&'static str; COUNTERS],
    ) -> [(&'static str, u64); COUNTERS] {
        let values = [
            &self.connections,
            &self.started,
            &self.streams,
            &self.goaway_calm,
            &self.goaway_protocol,
            &self.stalls,
            &self.evictions,
            &self.floods[0],
            &self.floods[1],
            &self.floods[2],
            &self.floods[3],
        ];
        std::array::from_fn(|i| (names[i], values[i].load(Relaxed)))
    }

    pub(crate) const SERVE: [&'static str; COUNTERS] = [
        "h2_connections",
        "h2_started",
        "h2_streams",
        "h2_goaway_calm",
        "h2_goaway_protocol",
        "h2_stalls",
        "h2_evictions",
        "h2_flood_settings",
        "h2_flood_ping",
        "h2_flood_window_update",
        "h2_flood_priority",
    ];
    pub(crate) const PROXY: [&'static str; COUNTERS] = [
        "proxy_h2_connections",
        "proxy_h2_started",
        "proxy_h2_streams",
        "proxy_h2_goaway_calm",
        "proxy_h2_goaway_protocol",
        "proxy_h2_stalls",
        "proxy_h2_evictions",
        "proxy_h2_flood_settings",
        "proxy_h2_flood_ping",
        "proxy_h2_flood_window_update",
        "proxy_h2_flood_priority",
    ];

    /// Counts a connection ended for passing the cap on `flood` frames.
    fn count_flood(&self, flood: Flood) {
        let at = Flood::ALL.iter().position(|&f| f == flood).unwrap_or(0);
        self.floods[at].fetch_add(1, Relaxed);
        self.goaway_calm.fetch_add(1, Relaxed);
    }

    /// Counts how h2's side of a connection ended, when it was an error we sent GOAWAY for.
    pub(crate) fn count_end(&self, e: &h2::Error) {
        if !e.is_go_away() || e.is_remote() {
            return;
        }
        match e.reason() {
            Some(h2::Reason::NO_ERROR) | None => {}
            Some(h2::Reason::ENHANCE_YOUR_CALM) => self.goaway_calm.fetch_add(1, Relaxed),
            Some(_) => self.goaway_protocol.fetch_add(1, Relaxed),
        }
    }
}

thread_local! {
    /// h2 connections of this worker (its thread) with streams open.
    static BUSY_HERE: Cell<usize> = const { Cell::new(0) };
}

/// Counts its connection in [`BUSY_HERE`] while it has streams open.
struct Busy(bool);

impl Busy {
    fn set(&mut self, busy: bool) {
        if self.0 != busy {
            self.0 = busy;
            BUSY_HERE.with(|n| {
                n.set(if busy {
                    n.get() + 1
                } else {
                    n.get().saturating_sub(1)
                })
            });
        }
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.set(false);
    }
}

/// What a connection's opening needs from its product.
pub(crate) struct Opening<'a> {
    /// The client's preface and first SETTINGS within this (its first request head).
    pub header_timeout: Duration,
    /// Then no request for this long: GOAWAY and the end.
    pub idle_timeout: Duration,
    pub stop: &'a mut watch::Receiver<bool>,
    pub idle: &'a Idle,
    pub stats: &'a H2Stats,
    /// The product's counters of header timeouts and of idle timeouts.
    pub header_timeouts: &'a Counter,
    pub timeouts: &'a Counter,
}

/// The opening of a connection whose client chose h2, kept without h2
/// ([`tlsplane_h2::greeting`]): sends h2's SETTINGS, acknowledges the client's, and waits for
/// its first request as an idle connection waits (the idle timeout, eviction under
/// --max-connections, shutdown: GOAWAY naming no stream, then the end). Returns where h2
/// starts, or `None` when the connection ended first (the caller closes it).
pub(crate) async fn open(tls: &mut TlsStream, o: Opening<'_>) -> io::Result<Option<Woken>> {
    o.stats.connections.fetch_add(1, Relaxed);
    let Some(opening) = greeting::opening() else {
        // h2 did not show what it sends first: it opens the connection itself.
        o.stats.started.fetch_add(1, Relaxed);
        return Ok(Some(Woken::fresh()));
    };
    // The stream's futures are boxed for the moment they run: this future is what a
    // connection in its opening holds while it waits, and inline they would make it several
    // KiB (docs/HTTP2.md, "The opening").
    Box::pin(tls.write_all(opening)).await?;
    if *o.stop.borrow() {
        Box::pin(tls.write_all(&greeting::GOAWAY_NONE_PROCESSED)).await?;
        return Ok(None);
    }
    let mut greeting = Greeting::new();
    let started = Instant::now();
    let mut idle_since = None;
    loop {
        let deadline = match idle_since {
            None => started + o.header_timeout,
            Some(since) => since + o.idle_timeout,
        };
        let wait = async {
            tokio::select! {
                ready = tls.readable() => Opened::Readable(ready),
                _ = tokio::time::sleep_until(deadline) => Opened::Timeout,
                _ = o.stop.changed() => Opened::Stop,
            }
        };
        // Once the preface is in, an idle connection like any: the first to go when a new one
        // needs room under --max-connections.
        let mut step = if idle_since.is_some() {
            o.idle.wait(wait).await.unwrap_or(Opened::Evicted)
        } else {
            wait.await
        };
        let mut bytes = Vec::new();
        if let Opened::Readable(ready) = step {
            ready?;
            // Readiness may come before a whole record (the kernel plane's is the socket's):
            // the read that follows is held to the same deadline. Reads are cancel-safe, and
            // the buffer exists only while one is under way.
            bytes = vec![0u8; OPENING_READ];
            step = match timeout_at(deadline, Box::pin(tls.read(&mut bytes))).await {
                Ok(n) => {
                    bytes.truncate(n?);
                    Opened::Readable(Ok(()))
                }
                Err(_) => Opened::Timeout,
            };
        }
        match step {
            Opened::Readable(_) => {}
            Opened::Timeout if idle_since.is_none() => {
                o.header_timeouts.fetch_add(1, Relaxed);
                return Ok(None);
            }
            ended => {
                match ended {
                    Opened::Timeout => o.timeouts.fetch_add(1, Relaxed),
                    Opened::Evicted => o.stats.evictions.fetch_add(1, Relaxed),
                    _ => {}
                };
                Box::pin(tls.write_all(&greeting::GOAWAY_NONE_PROCESSED)).await?;
                return Ok(None);
            }
        }
        if bytes.is_empty() {
            return Ok(None);
        }
        match greeting.hear(&bytes) {
            Heard::Wake => {
                o.stats.started.fetch_add(1, Relaxed);
                return Ok(Some(greeting.wake()));
            }
            Heard::Asleep { acks: 0 } => {}
            Heard::Asleep { acks } => {
                Box::pin(tls.write_all(&greeting::SETTINGS_ACK.repeat(acks))).await?;
            }
        }
        if idle_since.is_none() && greeting.preface_done() {
            idle_since = Some(Instant::now());
        }
    }
}

/// What ended one wait of a connection's opening.
enum Opened {
    Readable(io::Result<()>),
    Timeout,
    Stop,
    Evicted,
}

/// What the loop needs from its product and connection.
pub(crate) struct Lifetime<'a> {
    /// No stream open for this long: GOAWAY; still open this long after it: the end.
    pub idle_timeout: Duration,
    pub stop: &'a mut watch::Receiver<bool>,
    pub idle: &'a Idle,
    pub stats: &'a H2Stats,
    /// The product's counter of idle timeouts.
    pub timeouts: &'a Counter,
    /// The connection's outbox ([`H2Io::flusher`]), sent early between streams.
    pub flush: Flusher,
    /// The client passing a control-frame cap ([`H2Io::floods`]).
    pub floods: Floods,
}

/// Runs `conn` until it ends (the client's GOAWAY or end, ours after the idle timeout, an
/// eviction or at shutdown, an error), starting `on_stream` for each stream the client opens;
/// up to h2's SETTINGS_MAX_CONCURRENT_STREAMS of them run at once, in this task.
pub(crate) async fn run<B, F, Fut>(
    conn: &mut Connection<H2Io, B>,
    life: Lifetime<'_>,
    mut on_stream: F,
) -> Result<(), h2::Error>
where
    B: Buf,
    F: FnMut(http::Request<RecvStream>, SendResponse<B>) -> Fut,
    Fut: Future<Output = ()>,
{
    let Lifetime {
        idle_timeout,
        stop,
        idle,
        stats,
        timeouts,
        flush,
        floods,
    } = life;
    // Made at the first stream and dropped when the last ends: an empty FuturesUnordered
    // still holds a stub task as large as a stream's future (~1.6 KiB for serve), which an
    // idle connection need not keep.
    let mut streams: Option<FuturesUnordered<Fut>> = None;
    let mut idle_since = Instant::now();
    // When we sent GOAWAY (None: not yet).
    let mut going_away: Option<Instant> = None;
    if *stop.borrow() {
        conn.graceful_shutdown();
        going_away = Some(Instant::now());
    }
    let mut busy = Busy(false);
    // The client passed a control-frame cap: h2 gets none of its bytes any more.
    let mut flooded = false;
    loop {
        busy.set(streams.is_some());
        // The only connection of its worker with work: let the responses of this round that
        // are queued go out while the rest are served, so that the client works on them
        // meanwhile instead of the two taking turns. With other connections busy the worker
        // does their work in the gaps, and writing early only cuts every connection's rounds
        // smaller (docs/BENCHMARKS.md, "One HTTP/2 connection, 10 streams").
        if BUSY_HERE.with(Cell::get) == 1 {
            flush.flush_if_due().await;
        }
        let quiet = streams.is_none();
        let step = async {
            tokio::select! {
                accepted = conn.accept() => Step::Accepted(accepted),
                flood = floods.flooded(), if !flooded => Step::Flooded(flood),
                Some(()) = async { streams.as_mut()?.next().await }, if !quiet => Step::StreamDone,
                // No stream open for the idle timeout: GOAWAY, and the connection ends.
                _ = tokio::time::sleep_until(idle_since + idle_timeout),
                    if quiet && going_away.is_none() => Step::IdleTimeout,
                // Shutting down: GOAWAY, the streams in flight finish.
                _ = stop.changed(), if going_away.is_none() => Step::Stop,
                // Our GOAWAY went out and no stream of ours is left, yet h2 has not closed:
                // its graceful close waits for the client's acknowledgement of a PING, which
                // a client may never send (it would hold the connection forever, idle or
                // flooding us with frames). Another idle timeout, and the connection ends.
                _ = tokio::time::sleep_until(
                        going_away.unwrap_or(idle_since).max(idle_since) + idle_timeout
                    ),
                    if quiet && going_away.is_some() => Step::GoneQuiet,
            }
        };
        // With no stream open the connection is idle, as a keep-alive HTTP/1.1 connection
        // between requests: the first to go when a new one needs room under
        // --max-connections.
        let step = if quiet && going_away.is_none() {
            idle.wait(step).await.unwrap_or(Step::Evicted)
        } else {
            step.await
        };
        match step {
            Step::Accepted(Some(Ok((request, send)))) => {
                stats.streams.fetch_add(1, Relaxed);
                streams
                    .get_or_insert_with(FuturesUnordered::new)
                    .push(on_stream(request, send));
            }
            Step::Accepted(Some(Err(e))) => {
                stats.count_end(&e);
                return Err(e);
            }
            Step::Accepted(None) => return Ok(()),
            Step::GoneQuiet => {
                stats.stalls.fetch_add(1, Relaxed);
                return Ok(());
            }
            Step::Flooded(flood) => {
                // GOAWAY naming the last stream h2 took; its streams in flight end with the
                // connection, which h2 closes once the GOAWAY is out.
                flooded = true;
                stats.count_flood(flood);
                conn.abrupt_shutdown(h2::Reason::ENHANCE_YOUR_CALM);
                going_away = Some(Instant::now());
            }
            Step::StreamDone => {
                if streams.as_ref().is_some_and(FuturesUnordered::is_empty) {
                    streams = None;
                    idle_since = Instant::now();
                }
            }
            Step::IdleTimeout | Step::Stop | Step::Evicted => {
                match step {
                    Step::IdleTimeout => timeouts.fetch_add(1, Relaxed),
                    Step::Evicted => stats.evictions.fetch_add(1, Relaxed),
                    _ => {}
                }
                conn.graceful_shutdown();
                going_away = Some(Instant::now());
            }
        }
    }
}

/// What ended one wait of a connection's loop.
enum Step<T> {
    Accepted(Option<Result<T, h2::Error>>),
    StreamDone,
    IdleTimeout,
    Stop,
    Evicted,
    GoneQuiet,
    Flooded(Flood),
}
