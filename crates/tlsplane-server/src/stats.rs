//! The runtime's counters, apart from the runtime: the key daemon's supervision
//! (`crate::keys`) counts into them too, and with them here it needs nothing of the runtime.

use std::sync::atomic::AtomicUsize;
use std::sync::Arc;

use tlsplane::stats::Counter;

use crate::limits::LimitStats;

/// Counters of the runtime itself (the TLS layer has its own, in `tlsplane::stats`).
#[derive(Default)]
pub struct RuntimeStats {
    /// TCP connections accepted.
    pub connections: Counter,
    /// Handshakes that failed (the TLS layer counts why).
    pub handshake_errors: Counter,
    /// Handshakes that did not finish within the handshake timeout.
    pub handshake_timeouts: Counter,
    /// Connections closed because they sent nothing before the first-byte deadline.
    pub first_byte_timeouts: Counter,
    /// Connection or handshake tasks that panicked (a bug: the network must never cause one).
    pub task_panics: Counter,
    /// Connections refused by a limit, by kind.
    pub limits: LimitStats,
    /// Connections accepted and not yet closed, whichever loop holds them.
    pub open: Arc<AtomicUsize>,
    /// Idle keep-alive connections closed to make room under --max-connections.
    pub idle_evicted: Counter,
    /// Connections accepted with the spare descriptor and reset at once because the process
    /// (EMFILE) or the system (ENFILE) was out of descriptors.
    pub accept_emfile: Counter,
    /// Handshakes in progress closed to make room under --max-handshakes-per-worker.
    pub handshakes_evicted: Counter,
    /// New connections whose first request (or end) came while they waited on the handshake
    /// loop for it, and those that moved from there when a full handshake started.
    pub first_request_here: Counter,
    pub first_request_moved: Counter,
    /// Configuration reloads that took effect.
    pub reloads: Counter,
    /// Configuration reloads that failed (the previous configuration stayed in force).
    pub reload_failures: Counter,
    /// Key daemons restarted after they died or were found stuck.
    pub keyd_restarts: Counter,
    /// Key daemons found stuck (a signature not answered within --keyd-timeout) and replaced.
    pub keyd_stuck: Counter,
    /// Connections made again to a key daemon started by hand (`--keyd unix:PATH`) after it
    /// could not be reached (restarted, say).
    pub keyd_reconnects: Counter,
    /// The shared ticket-key store's follower (`--ticket-store`).
    pub ticket_store: Arc<crate::ticket_store::TicketStoreStats>,
    /// The exchange of per-client counts with the fleet (`--fleet-limits`).
    pub limit_sync: Arc<crate::limit_sync::LimitSyncStats>,
    pub histograms: crate::admin::Histograms,
}
