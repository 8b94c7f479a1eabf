//! Process-wide counters. Cheap relaxed atomics: they are for operators and tests, not for
//! synchronisation.
//!
//! Every worker bumps them on every read and write, so each [`Counter`] is split into shards on
//! cache lines of their own, one per thread (round-robin), and summed only when read (a scrape,
//! the exit line): one shared atomic would bounce its cache line between all cores. Shards per
//! counter rather than one block of all counters per thread, so that a counter stays a plain
//! field with the methods of the atomic it replaced and nothing has to be registered.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering, Ordering::Relaxed};
use std::sync::OnceLock;

/// A counter (or a gauge, with [`Counter::fetch_sub`]) bumped from many threads: `fetch_add`
/// touches only the calling thread's shard, `load` sums all shards (wrapping, so a gauge raised
/// on one thread and lowered on another sums right; read it `as i64` if it may go below zero).
/// A sum is not a snapshot of one instant: it is exact once the bumping threads are quiet or
/// joined, so never use one for an admission decision.
///
/// Cost: [`shards`] cache lines of 64 bytes (512 bytes up to 4 cores, 4 KiB from 32 on) and
/// a 16-byte pointer to them.
pub struct Counter {
    shards: Box<[Shard]>,
}

#[derive(Default)]
#[repr(align(64))]
struct Shard(AtomicU64);

/// Shards per [`Counter`]: a power of two, twice the cores (each worker runs two threads, a
/// handshake loop and a connection loop, and the main and admin threads bump a few too), at
/// least 8 and at most 64. Threads beyond that share shards, round-robin.
pub fn shards() -> usize {
    static SHARDS: OnceLock<usize> = OnceLock::new();
    *SHARDS.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        cores.saturating_mul(2).next_power_of_two().clamp(8, 64)
    })
}

/// The calling thread's shard number, given in turn at its first bump and kept for life.
fn thread_shard() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static SHARD: Cell<usize> = const { Cell::new(usize::MAX) };
    }
    SHARD.with(|s| {
        let mut i = s.get();
        if i == usize::MAX {
            i = NEXT.fetch_add(1, Relaxed) % shards();
            s.set(i);
        }
        i
    })
}

impl Counter {
    fn shard(&self) -> &AtomicU64 {
        &self.shards[thread_shard() & (self.shards.len() - 1)].0
    }

    /// Adds `n`. Unlike the atomic's, returns nothing: no thread sees the total.
    #[inline]
    pub fn fetch_add(&self, n: u64, order: Ordering) {
        self.shard().fetch_add(n, order);
    }

    /// Subtracts `n` (a gauge going down).
    #[inline]
    pub fn fetch_sub(&self, n: u64, order: Ordering) {
        self.shard().fetch_sub(n, order);
    }

    /// The sum of all shards.
    pub fn load(&self, order: Ordering) -> u64 {
        self.shards
            .iter()
            .fold(0u64, |sum, s| sum.wrapping_add(s.0.load(order)))
    }
}

impl Default for Counter {
    fn default() -> Self {
        Counter {
            shards: (0..shards()).map(|_| Shard::default()).collect(),
        }
    }
}

impl std::fmt::Debug for Counter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.load(Relaxed).fmt(f)
    }
}

macro_rules! counters {
    ($( $(#[$doc:meta])* $name:ident ),* $(,)?) => {
        /// Counters of the TLS layer; read them with [`Stats::snapshot`].
        #[derive(Default)]
        pub struct Stats { $( $(#[$doc])* pub $name: Counter, )* }

        impl Stats {
            /// All counters as (name, value) pairs, in declaration order.
            pub fn snapshot(&self) -> Vec<(&'static str, u64)> {
                vec![ $( (stringify!($name), self.$name.load(Relaxed)), )* ]
            }
        }
    };
}

counters! {
    /// Handshakes completed.
    handshakes,
    /// Handshakes that resumed a session.
    handshakes_resumed,
    /// Handshakes that failed (any reason).
    handshake_failures,
    /// Handshake failures caused by the peer's input (bad ClientHello, bad record, alert).
    handshake_peer_errors,
    /// Connections whose records the kernel encrypts and decrypts.
    plane_kernel,
    /// Connections on the user-space record layer.
    plane_user,
    /// Why a connection stayed in user space: policy said so.
    fallback_policy,
    /// ... the kernel has no TLS ULP.
    fallback_no_ulp,
    /// ... the kernel cannot take the negotiated suite.
    fallback_suite,
    /// ... attaching the ULP to this socket failed.
    fallback_ulp_attach,
    /// ... records were already buffered past the handshake (never expected: reads are exact).
    fallback_buffered,
    /// Key hand-off to the kernel failed after the point of no return; connection closed.
    kernel_setup_failures,
    /// Connections refused because `--data-plane kernel` was required but not possible.
    kernel_required_refused,
    /// Alerts we sent (fatal or close_notify) on the kernel plane.
    kernel_alerts_sent,
    /// Peer alerts received on the kernel plane (close_notify excluded).
    kernel_alerts_received,
    /// close_notify received from the peer (either plane).
    close_notify_received,
    /// Records that failed to decrypt on the kernel plane (EBADMSG).
    kernel_decrypt_errors,
    /// KeyUpdate messages handled by re-keying the kernel.
    key_updates,
    /// KeyUpdate received on a kernel without TLS 1.3 rekey: connection ended cleanly.
    key_update_unsupported,
    /// Connections ended because the peer sent KeyUpdates faster than allowed (kernel plane).
    limit_key_updates,
    /// Renegotiation attempts (a TLS 1.2 ClientHello after the handshake) refused on the
    /// kernel plane; on the user plane rustls refuses them itself.
    renegotiations_refused,
    /// Connections re-keyed (TLS 1.3) because the AEAD confidentiality limit came near.
    aead_limit_rekeys,
    /// Connections closed because the AEAD limit came near and re-keying was impossible.
    aead_limit_closes,
    /// Unexpected post-handshake messages from the peer on the kernel plane.
    kernel_unexpected_messages,
    /// Application bytes delivered to the application, by plane (decrypted by the kernel or
    /// by rustls).
    bytes_rx_kernel,
    bytes_rx_user,
    /// Application bytes the application wrote, by plane (encrypted by the kernel, including
    /// sendfile, or by rustls).
    bytes_tx_kernel,
    bytes_tx_user,
    /// File bytes sent by `sendfile(2)` on the kernel plane (part of `bytes_tx_kernel`): read
    /// from the page cache and encrypted by the kernel, they never entered this process.
    sendfile_bytes,
    /// File bytes read into this process to be encrypted and sent (the user plane's file
    /// bodies, over HTTP/1.1 or h2): the copy the kernel plane's `sendfile` saves. Stays 0 on
    /// the kernel plane.
    file_bytes_copied,
    /// HTTP/2 streams reset because h2 framed a file body unlike the body registered for it
    /// (a DATA frame longer than the body's rest, padded, or on a body given up; the stream
    /// ending short of it): never expected with the `h2` version pinned, and never sent with
    /// bytes that are not the file's (tlsplane-h2's transport).
    h2_file_body_resets,
    /// Connections that spoke plain HTTP to the TLS port (answered as the product chose).
    plain_http_requests,
    /// ClientHellos whose server name (or lack of one) matched no site, with no default site:
    /// refused with unrecognized_name or a reset.
    unknown_server_names,
    /// Signatures the key daemon did not deliver (it is down, slow or refused): each failed
    /// a handshake.
    keyd_sign_failures,
    /// Key daemons reached over TLS (`--keyd tls://...`) taken out of use after a call to one
    /// was lost or not answered: the next signatures go to the others until it is back.
    keyd_failovers,
    /// Signatures made by this process with a key it holds (the server with `--keyd off`, or
    /// the key daemon), and the time spent making them (in the signing library, ns).
    signatures,
    signature_ns,
    /// Signatures the key daemon made for this server, and the time the handshakes waited for
    /// them (request sent to reply read, ns: the round trip and the daemon's signature).
    keyd_signatures,
    keyd_wait_ns,
    /// Of the resumptions, those on a ticket of the shared keys (`--ticket-keys`,
    /// `--ticket-store`) that this process issued, and those that another issued (another
    /// server of the fleet, or this one before a restart).
    handshakes_resumed_local,
    handshakes_resumed_remote,
    /// Closes that read and dropped the client's input until its end or a deadline after the
    /// last byte was sent (see `linger`): a close with unread input would reset the connection
    /// and destroy the response still on its way.
    lingering_closes,
    /// ... of them, ended by a deadline (between reads or in all) before the client closed.
    lingering_timeouts,
    /// ... of them, ended because the client sent more than the byte cap.
    lingering_byte_limits,
    /// Bytes read and dropped by lingering closes.
    lingering_bytes,
    /// Writes that failed because the kernel ended the connection: the client had taken none
    /// of our bytes (a closed window, or no acknowledgement) for the send timeout
    /// (`--send-timeout`, `TCP_USER_TIMEOUT`).
    send_timeouts,
}

/// Connections open now, by plane: gauges (they go down), apart from the counters. A
/// connection usually opens on a handshake thread and closes on a connection thread.
#[derive(Default)]
pub struct OpenByPlane {
    pub kernel: Counter,
    pub user: Counter,
}

/// The process-wide open-connection gauges.
pub fn open_by_plane() -> &'static OpenByPlane {
    static OPEN: std::sync::OnceLock<OpenByPlane> = std::sync::OnceLock::new();
    OPEN.get_or_init(OpenByPlane::default)
}

/// An established connection's place in [`open_by_plane`], left when it drops.
pub(crate) struct OpenGuard(crate::PlaneKind);

impl OpenGuard {
    pub(crate) fn new(plane: crate::PlaneKind) -> Self {
        Self::gauge(plane).fetch_add(1, Relaxed);
        OpenGuard(plane)
    }

    fn gauge(plane: crate::PlaneKind) -> &'static Counter {
        match plane {
            crate::PlaneKind::Kernel => &open_by_plane().kernel,
            crate::PlaneKind::User => &open_by_plane().user,
        }
    }
}

impl Drop for OpenGuard {
    fn drop(&mut self) {
        Self::gauge(self.0).fetch_sub(1, Relaxed);
    }
}

/// The process-wide counters.
pub fn global() -> &'static Stats {
    static STATS: std::sync::OnceLock<Stats> = std::sync::OnceLock::new();
    STATS.get_or_init(Stats::default)
}

pub(crate) fn bump(c: &Counter) {
    c.fetch_add(1, Relaxed);
}

pub(crate) fn add(c: &Counter, n: u64) {
    c.fetch_add(n, Relaxed);
}

/// Renders counters as one JSON object (names are identifiers, values integers: no escaping).
pub fn to_json(pairs: &[(&'static str, u64)]) -> String {
    let body: Vec<String> = pairs.iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
    format!("{{{}}}", body.join(","))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_counter_sums_the_shards_of_all_threads() {
        let c = Counter::default();
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    for _ in 0..10_000 {
                        c.fetch_add(1, Relaxed);
                    }
                    c.fetch_add(5, Relaxed);
                });
            }
        });
        assert_eq!(c.load(Relaxed), 8 * 10_005);
        let used = c.shards.iter().filter(|s| s.0.load(Relaxed) > 0).count();
        assert!(used > 1, "8 threads bumped {used} shard(s): not sharded");
    }

    #[test]
    fn a_gauge_raised_on_one_thread_and_lowered_on_another_sums_right() {
        let g = Counter::default();
        let on_new_thread = |f: &(dyn Fn() + Sync)| std::thread::scope(|s| s.spawn(f).join());
        on_new_thread(&|| g.fetch_add(3, Relaxed)).unwrap();
        on_new_thread(&|| g.fetch_sub(5, Relaxed)).unwrap();
        assert_eq!(g.load(Relaxed) as i64, -2);
        on_new_thread(&|| g.fetch_add(2, Relaxed)).unwrap();
        assert_eq!(g.load(Relaxed), 0);
    }
}
