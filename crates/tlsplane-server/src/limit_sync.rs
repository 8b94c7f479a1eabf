//! Per-client rates across a fleet (`--fleet-limits`, docs/FLEET.md): each server keeps its
//! own token buckets (`crate::limits`), and a thread of its own exchanges, every
//! `--fleet-limits-period`, the tokens this server took with the counts of the whole fleet in
//! the store. The tokens the other servers took are then taken from this server's buckets
//! too, so that an address spreading its connections over N servers gets about its rate in
//! total, not N times it. The accept path never waits for the store; what the fleet has not
//! heard of yet is at most one period's worth of each server's tokens.
//!
//! The store holds, per window of [`WINDOW_MS`] (wall clock, the same on every server), one
//! hash of counts, one field per client and kind of token, each the fleet's total in that
//! window; a window expires by itself three windows later. A server reads the current window
//! and the one before (whose last counts may arrive after it moved on), and takes what grew
//! there beyond its own part. A client this server has not seen for [`WATCH_FOR`] is no longer
//! exchanged: the store's load grows with the clients that use their rates, not with
//! connections.
//!
//! Client addresses go to the store as a keyed hash (HMAC-SHA256 under a key derived from the
//! key-encryption key): the store sees neither addresses nor how to link them to one.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use aws_lc_rs::hmac;
use tlsplane::stats::Counter;

use crate::limits::{Admission, ClientKey, Usage};
use crate::ticket_store::{connect, on_own_thread, Conn, Store, OP_TIMEOUT, RECONNECT_BACKOFF};

/// The store's windows of counts, milliseconds.
const WINDOW_MS: u64 = 1000;
/// A client is exchanged while it took a token here within this long.
const WATCH_FOR: Duration = Duration::from_secs(5);
/// Clients exchanged at most per period; beyond it, those seen here least recently are left
/// out (`limit_sync_dropped`).
const MAX_WATCHED: usize = 20_000;
/// Fields per script call, so that one call holds the store for a moment only.
const BATCH: usize = 1024;
const HASH_INFO: &[u8] = b"tlsplane fleet limits client v1";
/// Adds this server's tokens to the current window and returns, for each field, the fleet's
/// counts in the current and the previous window.
/// KEYS: current window, previous window. ARGV: expiry (ms), then field, count pairs.
const EXCHANGE: &str = r"
local out = {}
for i = 2, #ARGV, 2 do
  local n = tonumber(ARGV[i + 1])
  local cur
  if n > 0 then
    cur = redis.call('HINCRBY', KEYS[1], ARGV[i], n)
  else
    cur = tonumber(redis.call('HGET', KEYS[1], ARGV[i]) or '0')
  end
  out[#out + 1] = cur
  out[#out + 1] = tonumber(redis.call('HGET', KEYS[2], ARGV[i]) or '0')
end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return out
";

/// What the exchange counts (/metrics, --stats).
#[derive(Default)]
pub struct LimitSyncStats {
    /// Unix time (ms) of the last exchange that succeeded (0: none yet).
    pub last_exchange_ms: AtomicI64,
    /// Exchanges that succeeded.
    pub rounds: Counter,
    /// Exchanges that failed (store unreachable or slow).
    pub errors: Counter,
    /// Client entries exchanged, all rounds together.
    pub clients: Counter,
    /// Tokens the other servers took, taken here.
    pub remote_tokens: Counter,
    /// Clients left out of an exchange because more than the most exchanged at once wanted
    /// it.
    pub dropped: Counter,
}

impl LimitSyncStats {
    /// How old the fleet's counts held here are, ms (-1: never exchanged).
    pub fn lag_ms(&self) -> i64 {
        match self.last_exchange_ms.load(Relaxed) {
            0 => -1,
            t => (unix_ms() as i64 - t).max(0),
        }
    }
}

/// What the exchange needs from the server's start: where the store is, the fleet's name and
/// the key-encryption key (for the keyed hash of addresses).
#[derive(Clone)]
pub struct LimitSync {
    store: Store,
    prefix: String,
    period: Duration,
    hash: hmac::Key,
    stats: Arc<LimitSyncStats>,
}

impl std::fmt::Debug for LimitSync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LimitSync")
            .field("store", &self.store)
            .field("prefix", &self.prefix)
            .field("period", &self.period)
            .finish_non_exhaustive()
    }
}

impl LimitSync {
    pub fn new(
        store: Store,
        fleet: &str,
        kek: &[u8],
        period: Duration,
        stats: Arc<LimitSyncStats>,
    ) -> Self {
        let key = tlsplane::tickets::derive_key(kek, HASH_INFO);
        LimitSync {
            store,
            prefix: format!("{fleet}:limits:"),
            period: period.max(Duration::from_millis(10)),
            hash: hmac::Key::new(hmac::HMAC_SHA256, &key[..]),
            stats,
        }
    }

    /// Starts the exchange for `admission`, on a thread of its own.
    pub fn start(self, admission: Arc<Admission>) -> std::io::Result<()> {
        on_own_thread("limit-sync", Exchange::new(self, admission).run())
    }
}

/// One client's place in the exchange.
struct Watched {
    /// What the store calls it.
    field: [u8; 8],
    /// When it last took a token here.
    used_at: Instant,
    /// Tokens taken here that the store has not counted yet.
    pending: Usage,
    /// The window `seen_current` belongs to, and the fleet's counts last read (the current
    /// and the previous window), by kind; `None` before the first read.
    seen: Option<Seen>,
}

#[derive(Clone, Copy)]
struct Seen {
    window: u64,
    current: [i64; 3],
    previous: [i64; 3],
}

/// The fleet's counts read now: by kind, (current window, previous window).
type Read = [(i64, i64); 3];

/// The tokens the rest of the fleet took since `seen` (none before a first read: a first
/// read takes what the current window holds), given this server's `own` part added now.
fn remote_since(seen: Option<Seen>, window: u64, read: &Read, own: &Usage) -> Usage {
    let mut out = [0u32; 3];
    for k in 0..3 {
        let (cur, prev) = read[k];
        let grew = match seen {
            Some(s) if s.window == window => (cur - s.current[k]) + (prev - s.previous[k]),
            // The current window then is the previous one now.
            Some(s) if s.window + 1 == window => (prev - s.current[k]) + cur,
            _ => cur,
        };
        out[k] = (grew - own[k] as i64).clamp(0, u32::MAX as i64) as u32;
    }
    out
}

struct Exchange {
    config: LimitSync,
    admission: Arc<Admission>,
    kinds: Vec<usize>,
    watched: HashMap<ClientKey, Watched>,
    /// Why the store is out of reach, while it is (logged once).
    down: Option<String>,
}

impl Exchange {
    fn new(config: LimitSync, admission: Arc<Admission>) -> Self {
        let limited = admission.limited_kinds();
        Exchange {
            kinds: (0..3).filter(|&k| limited[k]).collect(),
            config,
            admission,
            watched: HashMap::new(),
            down: None,
        }
    }

    async fn run(mut self) {
        let mut attempt = 0;
        let mut used = Vec::new();
        loop {
            let mut conn = match connect(&self.config.store).await {
                Ok(c) => c,
                Err(e) => {
                    self.failed(e);
                    self.gather(&mut used);
                    tokio::time::sleep(RECONNECT_BACKOFF[attempt]).await;
                    attempt = (attempt + 1).min(RECONNECT_BACKOFF.len() - 1);
                    continue;
                }
            };
            attempt = 0;
            loop {
                let started = tokio::time::Instant::now();
                self.gather(&mut used);
                match self.exchange(&mut conn).await {
                    Ok(()) => self.reached(),
                    Err(e) => {
                        self.failed(e);
                        break;
                    }
                }
                tokio::time::sleep_until(started + self.config.period).await;
            }
        }
    }

    /// Takes the tokens used since the last round from the table into `watched`, and forgets
    /// the clients not seen for a while.
    fn gather(&mut self, used: &mut Vec<(ClientKey, Usage)>) {
        used.clear();
        self.admission.take_usage(used);
        let now = Instant::now();
        for (key, n) in used.drain(..) {
            let w = self.watched.entry(key).or_insert_with(|| Watched {
                field: field_of(&self.config.hash, key),
                used_at: now,
                pending: [0; 3],
                seen: None,
            });
            w.used_at = now;
            for (p, n) in w.pending.iter_mut().zip(n) {
                *p = p.saturating_add(n);
            }
        }
        self.watched.retain(|_, w| {
            now.saturating_duration_since(w.used_at) < WATCH_FOR || w.pending != [0; 3]
        });
        if self.watched.len() > MAX_WATCHED {
            let mut by_age: Vec<(Instant, ClientKey)> =
                self.watched.iter().map(|(k, w)| (w.used_at, *k)).collect();
            by_age.sort_unstable_by_key(|a| std::cmp::Reverse(a.0));
            for (_, k) in &by_age[MAX_WATCHED..] {
                self.watched.remove(k);
            }
            self.config
                .stats
                .dropped
                .fetch_add((by_age.len() - MAX_WATCHED) as u64, Relaxed);
        }
    }

    /// One round: every watched client's new tokens to the store, the fleet's counts back,
    /// what the others took taken here.
    async fn exchange(&mut self, conn: &mut Conn) -> Result<(), String> {
        if self.watched.is_empty() || self.kinds.is_empty() {
            // Nothing to exchange: a PING, so that the lag says whether the store answers.
            let ping = redis::cmd("PING");
            match tokio::time::timeout(OP_TIMEOUT, ping.query_async::<()>(conn)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(e.to_string()),
                Err(_) => return Err(format!("no answer within {OP_TIMEOUT:?}")),
            }
            self.config
                .stats
                .last_exchange_ms
                .store(unix_ms() as i64, Relaxed);
            return Ok(());
        }
        let window = unix_ms() / WINDOW_MS;
        let (current, previous) = (
            format!("{}{window}", self.config.prefix),
            format!("{}{}", self.config.prefix, window - 1),
        );
        let keys: Vec<ClientKey> = self.watched.keys().copied().collect();
        let per_batch = (BATCH / self.kinds.len()).max(1);
        let script = redis::Script::new(EXCHANGE);
        for batch in keys.chunks(per_batch) {
            let mut call = script.key(&current);
            call.key(&previous).arg(3 * WINDOW_MS);
            for key in batch {
                let w = &self.watched[key];
                for &k in &self.kinds {
                    let mut field = [0u8; 9];
                    field[..8].copy_from_slice(&w.field);
                    field[8] = k as u8;
                    call.arg(&field[..]).arg(w.pending[k]);
                }
            }
            let counts: Vec<i64> =
                match tokio::time::timeout(OP_TIMEOUT, call.invoke_async(conn)).await {
                    Ok(Ok(c)) => c,
                    Ok(Err(e)) => return Err(e.to_string()),
                    Err(_) => return Err(format!("no answer within {OP_TIMEOUT:?}")),
                };
            if counts.len() != 2 * batch.len() * self.kinds.len() {
                return Err(format!(
                    "{} counts for {} fields",
                    counts.len(),
                    batch.len()
                ));
            }
            let mut counts = counts.chunks_exact(2);
            for key in batch {
                let w = self.watched.get_mut(key).expect("watched");
                let mut read: Read = [(0, 0); 3];
                for &k in &self.kinds {
                    let c = counts.next().expect("counted above");
                    read[k] = (c[0], c[1]);
                }
                let remote = remote_since(w.seen, window, &read, &w.pending);
                w.seen = Some(Seen {
                    window,
                    current: read.map(|r| r.0),
                    previous: read.map(|r| r.1),
                });
                w.pending = [0; 3];
                if remote != [0; 3] {
                    self.admission.debit(*key, remote);
                    let n: u64 = remote.iter().map(|&n| n as u64).sum();
                    self.config.stats.remote_tokens.fetch_add(n, Relaxed);
                }
            }
            self.config
                .stats
                .clients
                .fetch_add(batch.len() as u64, Relaxed);
        }
        self.config
            .stats
            .last_exchange_ms
            .store(unix_ms() as i64, Relaxed);
        Ok(())
    }

    fn reached(&mut self) {
        self.config.stats.rounds.fetch_add(1, Relaxed);
        if self.down.take().is_some() {
            tracing::info!(
                "fleet limits: counts exchanged again with store {}",
                self.config.store
            );
        }
    }

    fn failed(&mut self, why: String) {
        self.config.stats.errors.fetch_add(1, Relaxed);
        if self.down.is_none() {
            tracing::warn!(
                "fleet limits: store {}: {why}: per-client rates count this server's connections only until it answers",
                self.config.store
            );
            self.down = Some(why);
        }
    }
}

/// What the store calls a client: the first 8 bytes of its keyed hash.
fn field_of(hash: &hmac::Key, key: ClientKey) -> [u8; 8] {
    let tag = hmac::sign(hash, &key.bytes());
    let mut f = [0u8; 8];
    f.copy_from_slice(&tag.as_ref()[..8]);
    f
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(window: u64, current: i64, previous: i64) -> Option<Seen> {
        Some(Seen {
            window,
            current: [current, 0, 0],
            previous: [previous, 0, 0],
        })
    }

    fn read(current: i64, previous: i64) -> Read {
        [(current, previous), (0, 0), (0, 0)]
    }

    #[test]
    fn what_the_others_took_is_what_grew_beyond_our_own_part() {
        // Same window: 10 → 17 with 3 of ours, and 2 late in the previous window.
        assert_eq!(
            remote_since(seen(5, 10, 4), 5, &read(17, 6), &[3, 0, 0])[0],
            6
        );
        // The window moved on: what was current (10) is the previous now (12), and the new
        // one holds 5, 1 of them ours.
        assert_eq!(
            remote_since(seen(5, 10, 4), 6, &read(5, 12), &[1, 0, 0])[0],
            6
        );
        // A first read (or after a gap): the current window only, less our part.
        assert_eq!(remote_since(None, 6, &read(5, 50), &[2, 0, 0])[0], 3);
        assert_eq!(
            remote_since(seen(1, 10, 4), 6, &read(5, 50), &[0, 0, 0])[0],
            5
        );
        // Never below nothing (a store that restarted empty reads less than before).
        assert_eq!(remote_since(seen(5, 10, 4), 5, &read(0, 0), &[0; 3])[0], 0);
    }

    #[test]
    fn fields_hide_addresses_and_differ_by_key() {
        let a = LimitSync::new(
            crate::ticket_store::Store::plain("redis://127.0.0.1"),
            "f",
            &[1; 32],
            Duration::from_millis(100),
            Default::default(),
        );
        let b = LimitSync::new(
            crate::ticket_store::Store::plain("redis://127.0.0.1"),
            "f",
            &[2; 32],
            Duration::from_millis(100),
            Default::default(),
        );
        let k = ClientKey::V4(0x7f000001);
        assert_eq!(field_of(&a.hash, k), field_of(&a.hash, k));
        assert_ne!(field_of(&a.hash, k), field_of(&b.hash, k));
        assert_ne!(
            field_of(&a.hash, k),
            field_of(&a.hash, ClientKey::V4(0x7f000002))
        );
        assert!(!field_of(&a.hash, k).windows(4).any(|w| w == [127, 0, 0, 1]));
    }
}
