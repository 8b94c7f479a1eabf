//! What the key daemon refused, counted, and its refusals' log lines, rate-limited: a flood of
//! peers must not become a flood of lines. The counts are in the daemon's SIGUSR1 report.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{SystemTime, UNIX_EPOCH};

/// The key daemon's counters of refusals, and of idle connections it closed (signatures are
/// `tlsplane::stats`'s).
#[derive(Debug, Default)]
pub struct Counters {
    /// TLS connections closed at accept: their address had `--max-tls-connections-per-address`
    /// open already.
    pub tls_refused_per_address: AtomicU64,
    /// TLS connections closed after their handshake: `--max-tls-connections` were
    /// established already.
    pub tls_refused_full: AtomicU64,
    /// TLS connections closed after their handshake: their client had
    /// `--max-tls-connections-per-client` established already.
    pub tls_refused_per_client: AtomicU64,
    /// TLS connections closed after their handshake: no `--authorize` rule names their
    /// certificate.
    pub tls_refused_no_grant: AtomicU64,
    /// TLS connections closed at accept: `--max-tls-handshakes` were in progress and none
    /// might give way to it.
    pub tls_refused_handshakes_full: AtomicU64,
    /// TLS handshakes cut short to make room for a new connection (`--max-tls-handshakes` in
    /// progress).
    pub tls_handshakes_evicted: AtomicU64,
    /// TLS handshakes not done within `--tls-handshake-timeout` of the accept.
    pub tls_handshakes_timed_out: AtomicU64,
    /// TLS handshakes that failed otherwise: no certificate, one of another CA, not TLS.
    pub tls_handshakes_failed: AtomicU64,
    /// Requests over TLS refused: a key the client may not use, RELOAD, COMMIT or HANDOFF.
    pub tls_requests_refused: AtomicU64,
    /// Signatures refused to a client past `--client-sign-rate`.
    pub tls_signatures_over_rate: AtomicU64,
    /// Established TLS connections closed after `--tls-idle-timeout` without a request.
    pub tls_idle_closed: AtomicU64,
    /// Connections to the Unix socket refused: a user or token it does not take.
    pub unix_refused: AtomicU64,
}

impl Counters {
    /// `name=value` for each, in one line.
    pub fn line(&self) -> String {
        [
            ("tls_refused_per_address", &self.tls_refused_per_address),
            ("tls_refused_full", &self.tls_refused_full),
            ("tls_refused_per_client", &self.tls_refused_per_client),
            ("tls_refused_no_grant", &self.tls_refused_no_grant),
            (
                "tls_refused_handshakes_full",
                &self.tls_refused_handshakes_full,
            ),
            ("tls_handshakes_evicted", &self.tls_handshakes_evicted),
            ("tls_handshakes_timed_out", &self.tls_handshakes_timed_out),
            ("tls_handshakes_failed", &self.tls_handshakes_failed),
            ("tls_requests_refused", &self.tls_requests_refused),
            ("tls_signatures_over_rate", &self.tls_signatures_over_rate),
            ("tls_idle_closed", &self.tls_idle_closed),
            ("unix_refused", &self.unix_refused),
        ]
        .iter()
        .map(|(name, c)| format!("{name}={}", c.load(Relaxed)))
        .collect::<Vec<_>>()
        .join(" ")
    }
}

pub fn counters() -> &'static Counters {
    static COUNTERS: std::sync::OnceLock<Counters> = std::sync::OnceLock::new();
    COUNTERS.get_or_init(Counters::default)
}

/// At most one log line a second of one kind; the line says how many were left out before it.
#[derive(Debug, Default)]
pub struct LogLimit {
    second: AtomicU64,
    left_out: AtomicU64,
}

impl LogLimit {
    pub const fn new() -> Self {
        LogLimit {
            second: AtomicU64::new(0),
            left_out: AtomicU64::new(0),
        }
    }

    /// Whether a line may go now: Some(how many were left out since the last one).
    pub fn allow(&self) -> Option<u64> {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let last = self.second.load(Relaxed);
        if now != last
            && self
                .second
                .compare_exchange(last, now, Relaxed, Relaxed)
                .is_ok()
        {
            Some(self.left_out.swap(0, Relaxed))
        } else {
            self.left_out.fetch_add(1, Relaxed);
            None
        }
    }
}

/// ", and N more like it since the last line" when some were left out.
pub fn more(left_out: u64) -> String {
    if left_out == 0 {
        String::new()
    } else {
        format!(" (and {left_out} more like it since the last such line)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_a_second_and_the_count_of_those_left_out() {
        let limit = LogLimit::new();
        let allowed: Vec<u64> = (0..10_000).filter_map(|_| limit.allow()).collect();
        // The loop may straddle a second's boundary.
        assert!(matches!(allowed.len(), 1 | 2), "{allowed:?}");
        std::thread::sleep(std::time::Duration::from_millis(1100));
        let left_out = limit.allow().expect("a line in the next second");
        assert_eq!(
            allowed.iter().sum::<u64>() + left_out,
            10_000 - allowed.len() as u64
        );
    }
}
