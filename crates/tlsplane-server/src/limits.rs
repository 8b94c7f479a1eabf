//! Admission control: limits checked when a connection is accepted, before the server reads
//! its ClientHello or spends any crypto on it (Tempesta's frang limits, HAProxy's maxconn and
//! maxsslrate). A refused connection is closed with a reset and counted by kind; nothing here
//! ever closes a connection that was admitted.
//!
//! Per-client limits key on the client's address: IPv4 /32, IPv6 /64 (one subscriber's
//! usual allocation; an IPv4-mapped IPv6 address counts as IPv4). They are checked before
//! the global ones, so that a connection its client's limits refuse never costs another
//! client its connection (the eviction a global limit makes room with).
//!
//! The per-client state lives in a table of fixed size (--client-table-size; HAProxy's stick
//! tables, nginx's `limit_req` zones): O(1) work per connection, sharded so that workers
//! seldom wait on each other's lock. When it is full, a new address takes the place of the
//! address seen least recently that has no connection open, whatever its budgets say:
//! refusing new addresses instead would let whoever fills the table lock everyone else out.
//! An evicted address whose budgets had not refilled gets them back, so such evictions are
//! counted apart (`client_table_hot_evictions`): to reset its own budget that way, a client
//! must make the table forget it, i.e. bring more new addresses than the table holds between
//! two of its own connections. Addresses with connections open are never evicted (their
//! count of connections would be lost); if every entry has one, a new address is admitted
//! without per-client limits (`client_table_untracked`), which a table at least as large as
//! --max-connections never needs.
//!
//! With --fleet-limits the rates count across the fleet: the tokens taken here are noted per
//! client ([`Admission::take_usage`] hands them to `crate::limit_sync`), and the tokens the
//! other servers took are taken from the same buckets ([`Admission::debit`]). Decisions stay
//! local and immediate; only the buckets' contents reflect the fleet.

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tlsplane::stats::Counter;

/// Limits, as flags (`serve` and later `proxy` flatten these). 0 means unlimited.
#[derive(clap::Args, Debug, Clone)]
pub struct LimitArgs {
    /// Connections open at once, all workers together (0: as many as the open-files limit
    /// leaves room for).
    #[arg(long, default_value_t = 0)]
    pub max_connections: usize,
    /// Handshakes in progress at once per worker (bounds a flood's memory); beyond it a
    /// new connection evicts a slow handshake (--handshake-evict-after) or is refused.
    #[arg(long, default_value_t = 1024)]
    pub max_handshakes_per_worker: usize,
    /// Connections open at once from one client address (/32, /64).
    #[arg(long, default_value_t = 0)]
    pub client_max_connections: u32,
    /// At --max-handshakes-per-worker, a new connection takes the place of the oldest
    /// handshake in progress that has not sent a whole ClientHello yet (silent or trickling:
    /// slowloris; no crypto spent on it), else of the oldest past its ClientHello if that
    /// began at least this many seconds ago; otherwise it is refused. 0: only the former.
    #[arg(long, default_value_t = 1.0)]
    pub handshake_evict_after: f64,
    /// Of those, full (not resumed) handshakes at once per worker; the rest of
    /// --max-handshakes-per-worker is kept for resumptions, so that under overload resumed
    /// handshakes are still served (default: 3/4 of --max-handshakes-per-worker).
    #[arg(long)]
    pub max_full_handshakes_per_worker: Option<usize>,
    /// Full handshakes from one client address, sustained: per second (`20`, `20/s`) or per
    /// minute (`30/min`).
    #[arg(long, default_value_t = Rate::ZERO)]
    pub client_handshake_rate: Rate,
    /// ... and in a burst (default: the per-second rate, at least 1).
    #[arg(long)]
    pub client_handshake_burst: Option<u32>,
    /// Resumed handshakes (a session ticket this server issued) from one client address, as
    /// --client-handshake-rate; burst = 2 × the per-second rate, at least 2. Counted apart
    /// from full handshakes: a resumption costs no signature, so it can be allowed more.
    #[arg(long, default_value_t = Rate::ZERO)]
    pub client_resumed_rate: Rate,
    /// Handshakes one client address may leave unfinished (failed, reset or timed out before
    /// Finished) before its new connections are refused, as --client-handshake-rate; burst =
    /// 2 × the per-second rate, at least 2.
    #[arg(long, default_value_t = Rate::ZERO)]
    pub client_incomplete_rate: Rate,
    /// A client address refused by its handshake or incomplete-handshake rate has its new
    /// connections dropped by the kernel (a socket filter on the listeners drops its SYNs)
    /// until its budget has a token again, instead of each being accepted and reset: a
    /// flooding address then costs the server almost nothing. Up to 64 addresses at a time;
    /// the others are refused at accept as without it. Its clients see their connection
    /// attempts time out (SYN retransmissions) rather than be reset.
    #[arg(long)]
    pub client_block: bool,
    /// Client addresses the per-client limits keep track of at once, at most (~0.2 KiB each,
    /// allocated as the table fills: ~26 MiB at the default). When it is full, the address
    /// seen least recently that has no connection open makes room (`client_table_evictions`;
    /// `client_table_hot_evictions` counts those whose budgets had not refilled, which get
    /// them back).
    #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(u32).range(1..))]
    pub client_table_size: u32,
    /// Longest ClientHello accepted, bytes; a longer one gets an illegal_parameter alert from
    /// its 4-byte header, before it is read.
    #[arg(long, default_value_t = tlsplane::config::DEFAULT_MAX_CLIENT_HELLO)]
    pub max_client_hello: usize,
    /// Records a ClientHello may span; one still incomplete after them gets an
    /// unexpected_message alert (clients send one; each record can cost the server a read).
    #[arg(long, default_value_t = tlsplane::config::DEFAULT_MAX_CLIENT_HELLO_RECORDS,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub max_client_hello_records: usize,
    /// Session tickets (PSK identities) a ClientHello may offer; one with more gets an
    /// illegal_parameter alert before any is tried (clients offer one).
    #[arg(long, default_value_t = tlsplane::config::DEFAULT_MAX_PSK_IDENTITIES,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub max_psk_identities: usize,
    /// KeyUpdate messages a connection may send per second on the kernel plane (burst as
    /// many); beyond it the connection ends with unexpected_message (0: unlimited). On the
    /// user plane rustls allows 32 in a row without application data.
    #[arg(long, default_value_t = tlsplane::config::DEFAULT_KEY_UPDATES_PER_SECOND)]
    pub key_updates_per_second: u32,
    /// Seconds a new connection may stay silent before its first byte (0: only the handshake
    /// timeout applies).
    #[arg(long, default_value_t = 5.0)]
    pub first_byte_timeout: f64,
    /// Share the per-client rates (--client-handshake-rate, --client-resumed-rate,
    /// --client-incomplete-rate) with the other servers of the fleet through --ticket-store:
    /// each server counts locally and exchanges its counts in batches (--fleet-limits-period),
    /// so that an address spreading its connections over the fleet gets about its rate in
    /// total. Connections are never held for the store.
    #[arg(long)]
    pub fleet_limits: bool,
    /// Seconds between two exchanges of counts with the store (--fleet-limits).
    #[arg(long, default_value_t = 0.2, value_name = "S")]
    pub fleet_limits_period: f64,
}

impl LimitArgs {
    /// The full-handshake share of the per-worker handshake cap (0: none).
    pub fn max_full_handshakes(&self) -> usize {
        self.max_full_handshakes_per_worker
            .unwrap_or(match self.max_handshakes_per_worker {
                0 => 0,
                n => (n * 3 / 4).max(1),
            })
    }

    pub fn handshake_evict_after(&self) -> Option<Duration> {
        (self.handshake_evict_after > 0.0)
            .then(|| Duration::from_secs_f64(self.handshake_evict_after))
    }

    pub fn first_byte_timeout(&self) -> Option<Duration> {
        (self.first_byte_timeout > 0.0).then(|| Duration::from_secs_f64(self.first_byte_timeout))
    }
}

/// Events per second, written `N` or `N/s` (per second) or `N/min` (per minute); 0 is
/// "no limit". A per-minute form is there for budgets below one a second (nginx's `r/m`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rate {
    per_second: f64,
}

impl Rate {
    pub const ZERO: Rate = Rate { per_second: 0.0 };

    #[cfg(test)]
    fn per_second(n: u32) -> Rate {
        Rate {
            per_second: n as f64,
        }
    }

    fn is_limit(self) -> bool {
        self.per_second > 0.0
    }

    /// A bucket of twice the per-second rate, at least 2 (so that a client may retry once).
    fn double_burst(self) -> f64 {
        (2.0 * self.per_second).max(2.0)
    }
}

impl std::fmt::Display for Rate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.per_second {
            0.0 => f.write_str("0"),
            r if r.fract() == 0.0 => write!(f, "{r}/s"),
            r => write!(f, "{}/min", (r * 60.0).round()),
        }
    }
}

impl std::str::FromStr for Rate {
    type Err = String;

    fn from_str(s: &str) -> Result<Rate, String> {
        let (count, per) = match s.split_once('/') {
            None => (s, 1.0),
            Some((count, "s" | "sec" | "second")) => (count, 1.0),
            Some((count, "m" | "min" | "minute")) => (count, 60.0),
            Some((_, unit)) => {
                return Err(format!(
                    "unknown unit {unit:?}: write N (per second), N/s or N/min"
                ))
            }
        };
        let n: u32 = count
            .trim()
            .parse()
            .map_err(|_| format!("{count:?} is not a whole number of events"))?;
        Ok(Rate {
            per_second: n as f64 / per,
        })
    }
}

/// Why a connection was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    MaxConnections,
    HandshakesPerWorker,
    ClientConnections,
    ClientHandshakeRate,
    ClientIncomplete,
    FullHandshakesPerWorker,
    ClientResumedRate,
    ClientHelloSize,
    ClientHelloRecords,
    PskIdentities,
}

/// One counter per [`Refusal`].
#[derive(Default)]
pub struct LimitStats {
    pub max_connections: Counter,
    pub handshakes_per_worker: Counter,
    pub client_connections: Counter,
    pub client_handshake_rate: Counter,
    pub client_incomplete: Counter,
    pub full_handshakes_per_worker: Counter,
    pub client_resumed_rate: Counter,
    pub client_hello_size: Counter,
    pub client_hello_records: Counter,
    pub psk_identities: Counter,
    /// Times a client address was put on the listeners' drop filter (--client-block).
    pub client_blocks: Counter,
    /// The per-client table's counters, shared with the table.
    pub client_table: Arc<TableStats>,
}

/// What the per-client table did.
#[derive(Default)]
pub struct TableStats {
    /// Addresses in it now (a gauge).
    pub size: Counter,
    /// Addresses forgotten to make room for a new one.
    pub evictions: Counter,
    /// Of those, addresses whose budgets had not refilled (they got them back).
    pub hot_evictions: Counter,
    /// Connections admitted without per-client limits: the table was full of addresses with
    /// connections open.
    pub untracked: Counter,
}

impl LimitStats {
    pub fn count(&self, r: Refusal) {
        let c = match r {
            Refusal::MaxConnections => &self.max_connections,
            Refusal::HandshakesPerWorker => &self.handshakes_per_worker,
            Refusal::ClientConnections => &self.client_connections,
            Refusal::ClientHandshakeRate => &self.client_handshake_rate,
            Refusal::ClientIncomplete => &self.client_incomplete,
            Refusal::FullHandshakesPerWorker => &self.full_handshakes_per_worker,
            Refusal::ClientResumedRate => &self.client_resumed_rate,
            Refusal::ClientHelloSize => &self.client_hello_size,
            Refusal::ClientHelloRecords => &self.client_hello_records,
            Refusal::PskIdentities => &self.psk_identities,
        };
        c.fetch_add(1, Relaxed);
    }

    /// Gauges: (name, help, value).
    pub fn gauges(&self) -> [(&'static str, &'static str, i64); 1] {
        [(
            "client_table_size",
            "Client addresses in the per-client limits' table",
            self.client_table.size.load(Relaxed) as i64,
        )]
    }

    pub fn snapshot(&self) -> [(&'static str, u64); 14] {
        [
            ("limit_max_connections", self.max_connections.load(Relaxed)),
            (
                "limit_max_handshakes_per_worker",
                self.handshakes_per_worker.load(Relaxed),
            ),
            (
                "limit_client_max_connections",
                self.client_connections.load(Relaxed),
            ),
            (
                "limit_client_handshake_rate",
                self.client_handshake_rate.load(Relaxed),
            ),
            (
                "limit_client_incomplete_rate",
                self.client_incomplete.load(Relaxed),
            ),
            (
                "limit_max_full_handshakes_per_worker",
                self.full_handshakes_per_worker.load(Relaxed),
            ),
            (
                "limit_client_resumed_rate",
                self.client_resumed_rate.load(Relaxed),
            ),
            (
                "limit_max_client_hello",
                self.client_hello_size.load(Relaxed),
            ),
            (
                "limit_max_client_hello_records",
                self.client_hello_records.load(Relaxed),
            ),
            (
                "limit_max_psk_identities",
                self.psk_identities.load(Relaxed),
            ),
            ("client_blocks", self.client_blocks.load(Relaxed)),
            (
                "client_table_evictions",
                self.client_table.evictions.load(Relaxed),
            ),
            (
                "client_table_hot_evictions",
                self.client_table.hot_evictions.load(Relaxed),
            ),
            (
                "client_table_untracked",
                self.client_table.untracked.load(Relaxed),
            ),
        ]
    }
}

/// A client address as the limits count it: IPv4 /32, IPv6 /64.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum ClientKey {
    V4(u32),
    /// The /64 prefix.
    V6(u64),
}

impl ClientKey {
    /// Its bytes: a tag and the address (or prefix), for a keyed hash.
    pub fn bytes(&self) -> [u8; 9] {
        let mut b = [0u8; 9];
        match *self {
            ClientKey::V4(a) => {
                b[0] = 4;
                b[1..5].copy_from_slice(&a.to_be_bytes());
            }
            ClientKey::V6(p) => {
                b[0] = 6;
                b[1..].copy_from_slice(&p.to_be_bytes());
            }
        }
        b
    }

    fn of(addr: IpAddr) -> Self {
        match addr {
            IpAddr::V4(v4) => ClientKey::V4(v4.into()),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => ClientKey::V4(v4.into()),
                None => ClientKey::V6((u128::from(v6) >> 64) as u64),
            },
        }
    }
}

/// A token bucket: `rate` tokens a second, at most `burst`.
#[derive(Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn full(burst: f64, now: Instant) -> Self {
        Bucket {
            tokens: burst,
            at: now,
        }
    }

    fn refill(&mut self, rate: Rate, burst: f64, now: Instant) {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + dt * rate.per_second).min(burst);
        self.at = now;
    }

    fn take(&mut self, rate: Rate, burst: f64, now: Instant) -> bool {
        self.refill(rate, burst, now);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }

    /// How long until the bucket holds a token.
    fn until_token(&mut self, rate: Rate, burst: f64, now: Instant) -> Duration {
        self.refill(rate, burst, now);
        if self.tokens >= 1.0 || !rate.is_limit() {
            return Duration::ZERO;
        }
        Duration::from_secs_f64((1.0 - self.tokens) / rate.per_second)
    }

    fn has(&mut self, rate: Rate, burst: f64, now: Instant) -> bool {
        self.refill(rate, burst, now);
        self.tokens >= 1.0
    }
}

#[derive(Debug)]
struct Client {
    connections: u32,
    /// Full handshakes.
    handshakes: Bucket,
    resumed: Bucket,
    incomplete: Bucket,
    /// When this client last finished a handshake or offered one of our tickets: it may hold
    /// a ticket, so it may resume (see [`Admission::admit`]).
    resumer_at: Option<Instant>,
    /// With --fleet-limits: tokens taken here that the fleet has not been told of yet, by
    /// [`Usage`] kind.
    unsynced: Usage,
}

/// Tokens taken from one client's buckets, by kind: full handshakes, resumed handshakes,
/// incomplete handshakes (what --fleet-limits exchanges).
pub type Usage = [u32; 3];
const FULL: usize = 0;
const RESUMED: usize = 1;
const INCOMPLETE: usize = 2;

impl Client {
    /// Whether forgetting this client would give it nothing back: its buckets are full again
    /// and it has not resumed lately (a new entry starts so).
    fn is_cold(&mut self, a: &LimitArgs, burst: f64, now: Instant) -> bool {
        let full = |b: &mut Bucket, r: Rate, burst: f64| {
            !r.is_limit() || {
                b.refill(r, burst, now);
                b.tokens >= burst
            }
        };
        let (q, inc) = (a.client_resumed_rate, a.client_incomplete_rate);
        let recent = self
            .resumer_at
            .is_some_and(|t| now.saturating_duration_since(t) < RESUMER_FOR);
        full(&mut self.handshakes, a.client_handshake_rate, burst)
            && full(&mut self.resumed, q, q.double_burst())
            && full(&mut self.incomplete, inc, inc.double_burst())
            && !recent
    }
}

/// A client that finished a handshake or resumed within this long may still resume when its
/// full-handshake budget is spent, so its ClientHello is read before it is refused; any other
/// (a flood of canned ClientHellos never finishes one) is refused at accept, which is what
/// keeps a refusal cheap: no read, no parse.
const RESUMER_FOR: Duration = Duration::from_secs(10);

/// The per-client table: `shards` of fixed capacity, each an index and, through the entries
/// with no connection open, a list from the most to the least recently seen. A key's shard is
/// chosen by a keyed hash, so an attacker cannot aim its addresses at one shard.
struct ClientTable {
    shards: Box<[Mutex<Shard>]>,
    hasher: RandomState,
    stats: Arc<TableStats>,
}

/// An end of the list, or no neighbour.
const NIL: u32 = u32::MAX;

struct Shard {
    /// Where each key's entry is in `slots`.
    index: HashMap<ClientKey, u32>,
    /// Filled up to `cap`, then reused: an entry is only ever replaced.
    slots: Vec<Slot>,
    cap: usize,
    /// Entries with no connection open, most recently seen first.
    newest: u32,
    oldest: u32,
    /// With --fleet-limits: the keys whose `unsynced` went from nothing to something since
    /// the last [`Admission::take_usage`] (a key may be here twice if it was evicted and came
    /// back; the second finds nothing left).
    dirty: Vec<ClientKey>,
}

struct Slot {
    key: ClientKey,
    client: Client,
    /// Neighbours in the list, towards `newest` and towards `oldest`.
    newer: u32,
    older: u32,
    /// In the list: exactly when `client.connections` is 0.
    listed: bool,
}

impl ClientTable {
    fn new(size: usize, stats: Arc<TableStats>) -> Self {
        // A shard per 1,024 entries, up to 64: enough that two workers seldom want the same
        // lock, few enough that each shard's LRU order stays close to the whole table's.
        let n = (size / 1024).clamp(1, 64);
        let cap = size / n;
        let shards = (0..n)
            .map(|_| {
                Mutex::new(Shard {
                    index: HashMap::new(),
                    slots: Vec::new(),
                    cap,
                    newest: NIL,
                    oldest: NIL,
                    dirty: Vec::new(),
                })
            })
            .collect();
        ClientTable {
            shards,
            hasher: RandomState::new(),
            stats,
        }
    }

    fn shard(&self, key: ClientKey) -> std::sync::MutexGuard<'_, Shard> {
        let i = self.hasher.hash_one(key) as usize % self.shards.len();
        // The table holds only counters: a panic elsewhere cannot leave it inconsistent.
        self.shards[i].lock().unwrap_or_else(|e| e.into_inner())
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap().slots.len())
            .sum()
    }
}

impl Shard {
    fn get_mut(&mut self, key: ClientKey) -> Option<&mut Client> {
        let i = *self.index.get(&key)?;
        Some(&mut self.slots[i as usize].client)
    }

    /// A token of `kind` taken from `key`'s bucket, for the fleet to hear of.
    fn note_use(&mut self, key: ClientKey, kind: usize) {
        let cap = self.cap;
        let Some(c) = self.get_mut(key) else {
            return;
        };
        let first = c.unsynced == [0; 3];
        c.unsynced[kind] = c.unsynced[kind].saturating_add(1);
        // Bounded: each entry joins once per exchange, and more than twice the shard's
        // entries can only be evictions coming back, whose earlier place finds nothing.
        if first && self.dirty.len() < 2 * cap {
            self.dirty.push(key);
        }
    }

    /// The entry of `key`, now the most recently seen: found, new, or in the place of the
    /// least recently seen entry with no connection open. `None`: the shard is full of
    /// entries with connections open.
    fn entry(
        &mut self,
        key: ClientKey,
        fresh: impl FnOnce() -> Client,
        is_hot: impl FnOnce(&mut Client) -> bool,
        stats: &TableStats,
    ) -> Option<u32> {
        if let Some(&i) = self.index.get(&key) {
            if self.slots[i as usize].listed {
                self.unlink(i);
                self.push_newest(i);
            }
            return Some(i);
        }
        let i = if self.slots.len() < self.cap {
            if self.slots.capacity() == 0 {
                // All at once, on the shard's first client: growing later would move the
                // whole shard while its lock is held (an admission's worst case).
                self.slots.reserve_exact(self.cap);
                self.index.reserve(self.cap);
            }
            self.slots.push(Slot {
                key,
                client: fresh(),
                newer: NIL,
                older: NIL,
                listed: false,
            });
            stats.size.fetch_add(1, Relaxed);
            (self.slots.len() - 1) as u32
        } else {
            let i = self.oldest;
            if i == NIL {
                return None;
            }
            self.unlink(i);
            let slot = &mut self.slots[i as usize];
            self.index.remove(&slot.key);
            stats.evictions.fetch_add(1, Relaxed);
            if is_hot(&mut slot.client) {
                stats.hot_evictions.fetch_add(1, Relaxed);
            }
            slot.key = key;
            slot.client = fresh();
            i
        };
        self.index.insert(key, i);
        self.push_newest(i);
        Some(i)
    }

    /// One more connection open for entry `i`: out of the list while it has any.
    fn connect(&mut self, i: u32) {
        let slot = &mut self.slots[i as usize];
        slot.client.connections += 1;
        if slot.listed {
            self.unlink(i);
        }
    }

    /// A connection of entry `key` closed; back in the list, as the newest, once it has none.
    fn disconnect(&mut self, key: ClientKey) -> Option<&mut Client> {
        let i = *self.index.get(&key)?;
        let slot = &mut self.slots[i as usize];
        slot.client.connections = slot.client.connections.saturating_sub(1);
        if slot.client.connections == 0 && !slot.listed {
            self.push_newest(i);
        }
        Some(&mut self.slots[i as usize].client)
    }

    fn unlink(&mut self, i: u32) {
        let (newer, older) = {
            let s = &mut self.slots[i as usize];
            s.listed = false;
            (
                std::mem::replace(&mut s.newer, NIL),
                std::mem::replace(&mut s.older, NIL),
            )
        };
        match newer {
            NIL => self.newest = older,
            n => self.slots[n as usize].older = older,
        }
        match older {
            NIL => self.oldest = newer,
            o => self.slots[o as usize].newer = newer,
        }
    }

    fn push_newest(&mut self, i: u32) {
        let head = self.newest;
        {
            let s = &mut self.slots[i as usize];
            s.listed = true;
            s.newer = NIL;
            s.older = head;
        }
        match head {
            NIL => self.oldest = i,
            h => self.slots[h as usize].newer = i,
        }
        self.newest = i;
    }
}

/// The per-client table and the configured limits, shared by every worker.
pub struct Admission {
    args: LimitArgs,
    per_client: bool,
    clients: ClientTable,
    /// --client-block: addresses whose SYNs the listeners drop, until when.
    blocked: Mutex<Vec<(ClientKey, Instant)>>,
    /// Bumped when an address is added to `blocked` (each listener then re-filters).
    blocked_changed: tokio::sync::watch::Sender<u64>,
}

/// Addresses on the listeners' drop filter at once, at most: the filter compares each SYN
/// (and each packet of the connections made while it is attached) with every entry.
const MAX_BLOCKED: usize = 64;
/// How long an address stays on the filter at least and at most, whatever its budget says.
const BLOCK_MIN: Duration = Duration::from_millis(100);
const BLOCK_MAX: Duration = Duration::from_secs(60);

/// An admitted connection's place in the per-client table; released when dropped. A ticket
/// dropped before [`Ticket::handshake_done`] (failure, reset, timeout, even a panic) counts
/// against its client's incomplete-handshake budget.
pub struct Ticket {
    admission: Arc<Admission>,
    key: Option<ClientKey>,
    handshake_done: bool,
}

impl Ticket {
    /// Gives the place back for a connection refused by a global limit: a refusal, not the
    /// client's unfinished handshake.
    pub fn refused(mut self) {
        self.handshake_done = true;
    }

    pub fn handshake_done(&mut self) {
        self.handshake_done = true;
        if let Some(key) = self.key {
            if let Some(c) = self.admission.clients.shard(key).get_mut(key) {
                c.resumer_at = Some(Instant::now());
            }
        }
    }

    /// Decides on the connection's ClientHello, before any crypto: a full handshake needs a
    /// place among the worker's `full_in_progress` and a token of its client's full-handshake
    /// rate, a resumption one of its resumed rate.
    pub fn on_hello(&mut self, resumption: bool, full_in_progress: usize) -> Result<(), Refusal> {
        let a = &self.admission.args;
        let max_full = a.max_full_handshakes();
        if !resumption && max_full > 0 && full_in_progress >= max_full {
            // A refusal, not the client's unfinished handshake.
            self.handshake_done = true;
            return Err(Refusal::FullHandshakesPerWorker);
        }
        let Some(key) = self.key else {
            return Ok(());
        };
        let now = Instant::now();
        let burst = self.admission.handshake_burst();
        let mut shard = self.admission.clients.shard(key);
        let Some(c) = shard.get_mut(key) else {
            return Ok(());
        };
        let (verdict, kind) = if resumption {
            c.resumer_at = Some(now);
            let r = a.client_resumed_rate;
            if r.is_limit() && !c.resumed.take(r, r.double_burst(), now) {
                (Err(Refusal::ClientResumedRate), RESUMED)
            } else {
                (Ok(()), RESUMED)
            }
        } else {
            let r = a.client_handshake_rate;
            if r.is_limit() && !c.handshakes.take(r, burst, now) {
                (Err(Refusal::ClientHandshakeRate), FULL)
            } else {
                (Ok(()), FULL)
            }
        };
        if verdict.is_err() {
            self.handshake_done = true;
        } else if a.fleet_limits {
            shard.note_use(key, kind);
        }
        verdict
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let Some(key) = self.key else {
            return;
        };
        let rate = self.admission.args.client_incomplete_rate;
        let mut shard = self.admission.clients.shard(key);
        if let Some(c) = shard.disconnect(key) {
            if !self.handshake_done
                && rate.is_limit()
                && c.incomplete.take(rate, rate.double_burst(), Instant::now())
                && self.admission.args.fleet_limits
            {
                shard.note_use(key, INCOMPLETE);
            }
        }
    }
}

impl Admission {
    /// `table` counts what the per-client table does.
    pub fn new(args: LimitArgs, table: Arc<TableStats>) -> Arc<Self> {
        let per_client = args.client_max_connections > 0
            || args.client_handshake_rate.is_limit()
            || args.client_resumed_rate.is_limit()
            || args.client_incomplete_rate.is_limit();
        Arc::new(Admission {
            clients: ClientTable::new(args.client_table_size.max(1) as usize, table),
            args,
            per_client,
            blocked: Mutex::new(Vec::new()),
            blocked_changed: tokio::sync::watch::Sender::new(0),
        })
    }

    fn handshake_burst(&self) -> f64 {
        match self.args.client_handshake_burst {
            Some(b) => b.max(1) as f64,
            None => self.args.client_handshake_rate.per_second.ceil().max(1.0),
        }
    }

    /// Decides on a connection just accepted, [`Admission::admit_client`] then
    /// [`Admission::admit_global`] (the runtime makes room between the two).
    #[cfg(test)]
    pub fn admit(
        self: &Arc<Self>,
        peer: SocketAddr,
        open: usize,
        handshaking: usize,
    ) -> Result<Ticket, Refusal> {
        let ticket = self.admit_client(peer)?;
        match self.admit_global(open, handshaking) {
            Ok(()) => Ok(ticket),
            Err(refusal) => {
                ticket.refused();
                Err(refusal)
            }
        }
    }

    /// The global limits: `open` is the number of connections open now (all workers),
    /// `handshaking` the handshakes in progress on this worker. Checked after
    /// [`Admission::admit_client`], and after the runtime made room by evicting a connection
    /// if it could: only for a connection its client's limits admitted.
    pub fn admit_global(&self, open: usize, handshaking: usize) -> Result<(), Refusal> {
        let a = &self.args;
        if a.max_connections > 0 && open >= a.max_connections {
            return Err(Refusal::MaxConnections);
        }
        if a.max_handshakes_per_worker > 0 && handshaking >= a.max_handshakes_per_worker {
            return Err(Refusal::HandshakesPerWorker);
        }
        Ok(())
    }

    /// The per-client limits of a connection just accepted from `peer`; the ticket holds its
    /// place among its client's connections (give it back with [`Ticket::refused`] if a
    /// global limit then refuses it).
    pub fn admit_client(self: &Arc<Self>, peer: SocketAddr) -> Result<Ticket, Refusal> {
        let untracked = || Ticket {
            admission: self.clone(),
            key: None,
            handshake_done: false,
        };
        if !self.per_client {
            return Ok(untracked());
        }
        let a = &self.args;
        let key = ClientKey::of(peer.ip());
        let now = Instant::now();
        let (rate, burst) = (a.client_handshake_rate, self.handshake_burst());
        let inc = a.client_incomplete_rate;
        let mut shard = self.clients.shard(key);
        let fresh = || Client {
            connections: 0,
            handshakes: Bucket::full(burst, now),
            resumed: Bucket::full(a.client_resumed_rate.double_burst(), now),
            incomplete: Bucket::full(inc.double_burst(), now),
            resumer_at: None,
            unsynced: [0; 3],
        };
        let is_hot = |c: &mut Client| !c.is_cold(a, burst, now);
        let Some(i) = shard.entry(key, fresh, is_hot, &self.clients.stats) else {
            self.clients.stats.untracked.fetch_add(1, Relaxed);
            return Ok(untracked());
        };
        let c = &mut shard.slots[i as usize].client;
        if a.client_max_connections > 0 && c.connections >= a.client_max_connections {
            return Err(Refusal::ClientConnections);
        }
        if inc.is_limit() && !c.incomplete.has(inc, inc.double_burst(), now) {
            return Err(Refusal::ClientIncomplete);
        }
        // The rate tokens are taken at the ClientHello ([`Ticket::on_hello`]), once it is
        // known whether it resumes; a client with no full-handshake token left that has not
        // resumed lately is refused here already, before anything is read.
        let resumer = c
            .resumer_at
            .is_some_and(|t| now.saturating_duration_since(t) < RESUMER_FOR);
        if rate.is_limit() && !resumer && !c.handshakes.has(rate, burst, now) {
            return Err(Refusal::ClientHandshakeRate);
        }
        shard.connect(i);
        Ok(Ticket {
            admission: self.clone(),
            key: Some(key),
            handshake_done: false,
        })
    }
}

/// --fleet-limits: what the fleet's exchange of counts takes from the table and gives back.
impl Admission {
    /// Whether this server shares its per-client rates with the fleet.
    pub fn fleet_limits(&self) -> bool {
        self.args.fleet_limits && self.per_client
    }

    /// Moves the tokens taken since the last call into `out`, by client.
    pub fn take_usage(&self, out: &mut Vec<(ClientKey, Usage)>) {
        for shard in self.clients.shards.iter() {
            let mut shard = shard.lock().unwrap_or_else(|e| e.into_inner());
            let dirty = std::mem::take(&mut shard.dirty);
            for key in &dirty {
                if let Some(c) = shard.get_mut(*key) {
                    let used = std::mem::take(&mut c.unsynced);
                    if used != [0; 3] {
                        out.push((*key, used));
                    }
                }
            }
            // The allocation back, for the next exchange.
            let mut dirty = dirty;
            dirty.clear();
            shard.dirty = dirty;
        }
    }

    /// Takes from `key`'s buckets the tokens the rest of the fleet took: its next
    /// connections here see what it spent everywhere. A bucket goes at most one burst below
    /// empty, so that a count the store gave twice (a retried exchange) costs the client a
    /// bounded wait, not a long one. Nothing for a client this table does not hold.
    pub fn debit(&self, key: ClientKey, remote: Usage) {
        let a = &self.args;
        let now = Instant::now();
        let mut shard = self.clients.shard(key);
        let Some(c) = shard.get_mut(key) else {
            return;
        };
        let take = |b: &mut Bucket, r: Rate, burst: f64, n: u32| {
            if r.is_limit() && n > 0 {
                b.refill(r, burst, now);
                b.tokens = (b.tokens - n as f64).max(-burst);
            }
        };
        let (q, inc) = (a.client_resumed_rate, a.client_incomplete_rate);
        take(
            &mut c.handshakes,
            a.client_handshake_rate,
            self.handshake_burst(),
            remote[FULL],
        );
        take(&mut c.resumed, q, q.double_burst(), remote[RESUMED]);
        take(
            &mut c.incomplete,
            inc,
            inc.double_burst(),
            remote[INCOMPLETE],
        );
    }

    /// The kinds of [`Usage`] that have a limit (the others are not exchanged).
    pub fn limited_kinds(&self) -> [bool; 3] {
        let a = &self.args;
        [
            a.client_handshake_rate.is_limit(),
            a.client_resumed_rate.is_limit(),
            a.client_incomplete_rate.is_limit(),
        ]
    }
}

impl Admission {
    /// After `refusal` of a connection from `peer`: with --client-block, when the refusal was
    /// its handshake or incomplete-handshake budget, puts its address on the listeners' drop
    /// filter until that budget has a token again. Whether it did.
    pub fn block_refused(&self, peer: SocketAddr, refusal: Refusal) -> bool {
        let a = &self.args;
        if !a.client_block {
            return false;
        }
        let key = ClientKey::of(peer.ip());
        let now = Instant::now();
        let wait = {
            let mut shard = self.clients.shard(key);
            let Some(c) = shard.get_mut(key) else {
                return false;
            };
            match refusal {
                Refusal::ClientHandshakeRate => {
                    let (r, burst) = (a.client_handshake_rate, self.handshake_burst());
                    c.handshakes.until_token(r, burst, now)
                }
                Refusal::ClientIncomplete => {
                    let r = a.client_incomplete_rate;
                    c.incomplete.until_token(r, r.double_burst(), now)
                }
                _ => return false,
            }
        };
        let until = now + wait.clamp(BLOCK_MIN, BLOCK_MAX);
        let mut blocked = self.blocked.lock().unwrap_or_else(|e| e.into_inner());
        blocked.retain(|(_, t)| *t > now);
        // Already on it (a SYN that was in flight when the filter was attached), or full.
        if blocked.len() >= MAX_BLOCKED || blocked.iter().any(|(k, _)| *k == key) {
            return false;
        }
        blocked.push((key, until));
        drop(blocked);
        self.blocked_changed.send_modify(|g| *g += 1);
        true
    }

    /// Tells when an address was put on the drop filter.
    pub fn subscribe_blocks(&self) -> tokio::sync::watch::Receiver<u64> {
        self.blocked_changed.subscribe()
    }

    /// The drop filter for the addresses blocked now (empty: none), and when the first of
    /// them is due to leave it.
    pub fn block_filter(&self, now: Instant) -> (Vec<libc::sock_filter>, Option<Instant>) {
        let mut blocked = self.blocked.lock().unwrap_or_else(|e| e.into_inner());
        blocked.retain(|(_, t)| *t > now);
        let next = blocked.iter().map(|(_, t)| *t).min();
        let keys: Vec<ClientKey> = blocked.iter().map(|(k, _)| *k).collect();
        (drop_filter(&keys), next)
    }
}

/// A classic BPF program for a listening socket that drops packets from `keys` (IPv4 /32,
/// IPv6 /64, by the source address in the IP header) and passes every other whole. Empty
/// when there is nothing to drop.
fn drop_filter(keys: &[ClientKey]) -> Vec<libc::sock_filter> {
    // Opcodes (include/uapi/linux/filter.h, bpf_common.h) and the offset that makes a load
    // relative to the network header (SKF_NET_OFF): TCP's filter runs with the data pointer
    // at the TCP header.
    const LD_B_ABS: u16 = 0x30;
    const LD_W_ABS: u16 = 0x20;
    const AND_K: u16 = 0x54;
    const JEQ_K: u16 = 0x15;
    const JA: u16 = 0x05;
    const RET_K: u16 = 0x06;
    const NET: u32 = (-0x10_0000i32) as u32;
    const PASS: u32 = u32::MAX;
    const DROP: u32 = 0;
    let op = |code: u16, jt: u8, jf: u8, k: u32| libc::sock_filter { code, jt, jf, k };
    if keys.is_empty() {
        return Vec::new();
    }
    let (mut v4, mut v6) = (Vec::new(), Vec::new());
    for k in keys {
        match *k {
            ClientKey::V4(a) => v4.push(a),
            ClientKey::V6(prefix) => v6.push(prefix),
        }
    }
    // 0: version nibble; 2-3: IPv4 → the IPv4 list at 7; 4-5: IPv6 → its list; 6: other.
    let v4_len = 2 + 2 * v4.len() as u32;
    let mut p = vec![
        op(LD_B_ABS, 0, 0, NET),
        op(AND_K, 0, 0, 0xf0),
        op(JEQ_K, 0, 1, 0x40),
        op(JA, 0, 0, 3),
        op(JEQ_K, 0, 1, 0x60),
        op(JA, 0, 0, 1 + v4_len),
        op(RET_K, 0, 0, PASS),
        // IPv4: the source address, against each entry.
        op(LD_W_ABS, 0, 0, NET + 12),
    ];
    for a in v4 {
        p.push(op(JEQ_K, 0, 1, a));
        p.push(op(RET_K, 0, 0, DROP));
    }
    p.push(op(RET_K, 0, 0, PASS));
    // IPv6: the source's first 64 bits, as two words, against each entry.
    for prefix in v6 {
        p.push(op(LD_W_ABS, 0, 0, NET + 8));
        p.push(op(JEQ_K, 0, 3, (prefix >> 32) as u32));
        p.push(op(LD_W_ABS, 0, 0, NET + 12));
        p.push(op(JEQ_K, 0, 1, prefix as u32));
        p.push(op(RET_K, 0, 0, DROP));
    }
    p.push(op(RET_K, 0, 0, PASS));
    p
}

/// Closes a refused connection with a reset: no FIN handshake, no TIME_WAIT on our side.
pub fn reset(tcp: std::net::TcpStream) {
    let _ = socket2::SockRef::from(&tcp).set_linger(Some(Duration::ZERO));
    drop(tcp);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args() -> LimitArgs {
        LimitArgs {
            max_connections: 0,
            max_handshakes_per_worker: 0,
            client_max_connections: 0,
            client_handshake_rate: Rate::ZERO,
            client_handshake_burst: None,
            client_incomplete_rate: Rate::ZERO,
            max_full_handshakes_per_worker: None,
            client_resumed_rate: Rate::ZERO,
            max_client_hello: 16384,
            max_client_hello_records: 16,
            max_psk_identities: 4,
            first_byte_timeout: 0.0,
            handshake_evict_after: 0.0,
            key_updates_per_second: 8,
            client_block: false,
            client_table_size: 100_000,
            fleet_limits: false,
            fleet_limits_period: 0.2,
        }
    }

    /// Whether a connection from `src` to `to` completes within 300 ms (a dropped SYN is
    /// retransmitted only after a second).
    fn connects(src: &str, to: SocketAddr) -> bool {
        let domain = socket2::Domain::for_address(to);
        let s = socket2::Socket::new(domain, socket2::Type::STREAM, None).unwrap();
        s.bind(&peer(src).into()).unwrap();
        s.connect_timeout(&to.into(), Duration::from_millis(300))
            .is_ok()
    }

    #[test]
    fn the_drop_filter_drops_connections_from_blocked_addresses_only() {
        use std::os::fd::AsFd;
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let to = l.local_addr().unwrap();
        let blocked = [
            ClientKey::of("127.0.0.2".parse().unwrap()),
            ClientKey::of("fd00::1".parse().unwrap()),
            ClientKey::of("127.0.0.4".parse().unwrap()),
        ];
        tlsplane_sys::set_socket_filter(l.as_fd(), &drop_filter(&blocked)).unwrap();
        assert!(connects("127.0.0.3:0", to), "not blocked");
        assert!(!connects("127.0.0.2:0", to), "blocked");
        assert!(!connects("127.0.0.4:0", to), "blocked");
        tlsplane_sys::set_socket_filter(l.as_fd(), &drop_filter(&[])).unwrap();
        assert!(connects("127.0.0.2:0", to), "unblocked");

        // IPv6, by /64: ::1's prefix is 0.
        let Ok(l6) = std::net::TcpListener::bind("[::1]:0") else {
            eprintln!("SKIPPED the IPv6 half: no ::1");
            return;
        };
        let to6 = l6.local_addr().unwrap();
        tlsplane_sys::set_socket_filter(l6.as_fd(), &drop_filter(&blocked)).unwrap();
        assert!(
            connects("[::1]:0", to6),
            "another /64 is blocked, not ::1's"
        );
        let mine = [blocked[0], ClientKey::of("::2".parse().unwrap())];
        tlsplane_sys::set_socket_filter(l6.as_fd(), &drop_filter(&mine)).unwrap();
        assert!(!connects("[::1]:0", to6), "::1's /64 is blocked");
    }

    #[test]
    fn a_client_refused_by_its_rate_is_blocked_until_its_next_token() {
        let mut a = args();
        a.client_handshake_rate = "6/min".parse().unwrap();
        a.client_handshake_burst = Some(1);
        a.client_block = true;
        let adm = Admission::new(a, Default::default());
        let p = peer("10.0.0.1:1000");
        let changes = adm.subscribe_blocks();
        // A flooder: takes its token and never finishes (one that finished lately would be
        // heard out, as it may resume, and is never blocked).
        let mut t = adm.admit(p, 0, 0).expect("first");
        t.on_hello(false, 0).expect("its token");
        drop(t);
        let refusal = adm.admit(p, 0, 0).err().expect("out of tokens");
        assert_eq!(refusal, Refusal::ClientHandshakeRate);
        assert!(adm.block_refused(p, refusal));
        assert!(changes.has_changed().unwrap());
        assert!(!adm.block_refused(p, refusal), "once on the filter");
        let now = Instant::now();
        let (program, next) = adm.block_filter(now);
        assert!(!program.is_empty());
        // A token in 10 s (6 a minute).
        let wait = next.expect("an expiry") - now;
        assert!(
            wait > Duration::from_secs(9) && wait <= Duration::from_secs(10),
            "{wait:?}"
        );
        // Past it, the filter is empty again.
        let (program, next) = adm.block_filter(now + Duration::from_secs(11));
        assert!(program.is_empty() && next.is_none());
        // Other refusals block nobody, and nothing is blocked without --client-block.
        assert!(!adm.block_refused(peer("10.0.0.2:1"), Refusal::MaxConnections));
        let mut off = args();
        off.client_handshake_rate = "6/min".parse().unwrap();
        let adm = Admission::new(off, Default::default());
        assert!(!adm.block_refused(p, Refusal::ClientHandshakeRate));
    }

    fn peer(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn tokens_taken_on_one_server_are_taken_from_the_others_buckets() {
        let mut a = args();
        a.client_handshake_rate = "6/min".parse().unwrap();
        a.client_handshake_burst = Some(3);
        a.client_incomplete_rate = "6/min".parse().unwrap();
        a.fleet_limits = true;
        let (one, two) = (
            Admission::new(a.clone(), Default::default()),
            Admission::new(a, Default::default()),
        );
        assert!(one.fleet_limits());
        let p = peer("10.0.0.1:1000");
        // Two full handshakes on the first server, one finished, one not.
        let mut t = one.admit(p, 0, 0).unwrap();
        t.on_hello(false, 0).unwrap();
        t.handshake_done();
        drop(t);
        let mut t = one.admit(p, 0, 0).unwrap();
        t.on_hello(false, 0).unwrap();
        drop(t);
        let mut used = Vec::new();
        one.take_usage(&mut used);
        assert_eq!(used, vec![(ClientKey::of(p.ip()), [2, 0, 1])]);
        used.clear();
        one.take_usage(&mut used);
        assert!(used.is_empty(), "taken once");

        // The second server has seen the client once; told of the first's two, it has one
        // token of three left.
        let t = two.admit(p, 0, 0).unwrap();
        t.refused();
        two.debit(ClientKey::of(p.ip()), [2, 0, 1]);
        let mut t = two.admit(p, 0, 0).unwrap();
        t.on_hello(false, 0).unwrap();
        t.handshake_done();
        drop(t);
        // (It finished a handshake lately, so it is heard out to its ClientHello.)
        let mut t = two.admit(p, 0, 0).unwrap();
        assert_eq!(
            t.on_hello(false, 0),
            Err(Refusal::ClientHandshakeRate),
            "the fleet's three are spent"
        );
        drop(t);
        // A count given twice costs at most one burst below empty.
        two.debit(ClientKey::of(p.ip()), [1000, 0, 0]);
        let mut shard = two.clients.shard(ClientKey::of(p.ip()));
        let c = shard.get_mut(ClientKey::of(p.ip())).unwrap();
        assert!(c.handshakes.tokens >= -3.0 && c.handshakes.tokens < -2.9);
    }

    #[test]
    fn ipv6_clients_are_keyed_by_their_64_prefix_and_mapped_ipv4_as_ipv4() {
        let a = ClientKey::of("2001:db8:1:2:aaaa::1".parse().unwrap());
        let b = ClientKey::of("2001:db8:1:2:bbbb::9".parse().unwrap());
        let c = ClientKey::of("2001:db8:1:3::1".parse().unwrap());
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_eq!(
            ClientKey::of("::ffff:10.0.0.1".parse().unwrap()),
            ClientKey::of("10.0.0.1".parse().unwrap())
        );
    }

    #[test]
    fn rates_are_read_per_second_or_per_minute() {
        let r = |s: &str| s.parse::<Rate>().map(|r| r.per_second);
        assert_eq!(r("20"), Ok(20.0));
        assert_eq!(r("20/s"), Ok(20.0));
        assert_eq!(r("30/min"), Ok(0.5));
        assert_eq!(r("0"), Ok(0.0));
        assert!(r("1.5").is_err());
        assert!(r("3/h").unwrap_err().contains("N/min"));
        assert!(r("-1").is_err());
        assert_eq!("30/min".parse::<Rate>().unwrap().to_string(), "30/min");
        assert_eq!("7".parse::<Rate>().unwrap().to_string(), "7/s");
    }

    #[test]
    fn a_per_minute_rate_refills_a_token_in_its_fraction_of_a_minute() {
        let rate: Rate = "6/min".parse().unwrap();
        let t0 = Instant::now();
        let mut b = Bucket::full(2.0, t0);
        assert!(b.take(rate, 2.0, t0));
        assert!(b.take(rate, 2.0, t0));
        assert!(!b.take(rate, 2.0, t0 + Duration::from_secs(9)));
        assert!(b.take(rate, 2.0, t0 + Duration::from_millis(10_001)));
        assert!(!b.take(rate, 2.0, t0 + Duration::from_millis(10_002)));
    }

    #[test]
    fn handshake_rate_refuses_the_excess_of_a_burst_per_client() {
        let mut a = args();
        a.client_handshake_rate = Rate::per_second(1);
        a.client_handshake_burst = Some(5);
        let adm = Admission::new(a, Default::default());
        let mut tickets = Vec::new();
        for _ in 0..5 {
            let mut t = adm
                .admit(peer("10.0.0.1:1000"), 0, 0)
                .expect("within burst");
            t.on_hello(false, 0).expect("within burst");
            tickets.push(t);
        }
        assert_eq!(
            adm.admit(peer("10.0.0.1:1001"), 0, 0).err(),
            Some(Refusal::ClientHandshakeRate)
        );
        assert!(adm.admit(peer("10.0.0.2:1000"), 0, 0).is_ok());
    }

    #[test]
    fn resumptions_have_their_own_budget_and_a_resumer_is_heard_out() {
        let mut a = args();
        a.client_handshake_rate = Rate::per_second(1);
        a.client_resumed_rate = Rate::per_second(1); // burst 2
        let adm = Admission::new(a, Default::default());
        let p = peer("10.0.0.1:1");
        adm.admit(p, 0, 0).unwrap().on_hello(false, 0).unwrap();
        // Out of full handshakes, and never resumed: refused at accept.
        assert_eq!(adm.admit(p, 0, 0).err(), Some(Refusal::ClientHandshakeRate));
        // A client that finished its handshake (so holds a ticket) is admitted, and refused
        // only if it asks for a full handshake.
        let q = peer("10.0.0.2:1");
        let mut t = adm.admit(q, 0, 0).unwrap();
        t.on_hello(false, 0).unwrap();
        t.handshake_done();
        drop(t);
        let mut t = adm.admit(q, 0, 0).expect("a resumer is heard out");
        assert_eq!(t.on_hello(false, 0), Err(Refusal::ClientHandshakeRate));
        adm.admit(q, 0, 0).unwrap().on_hello(true, 0).unwrap();
        adm.admit(q, 0, 0).unwrap().on_hello(true, 0).unwrap();
        assert_eq!(
            adm.admit(q, 0, 0).unwrap().on_hello(true, 0),
            Err(Refusal::ClientResumedRate)
        );
    }

    #[test]
    fn full_handshakes_leave_room_for_resumptions() {
        let mut a = args();
        a.max_handshakes_per_worker = 8;
        assert_eq!(a.max_full_handshakes(), 6);
        a.max_full_handshakes_per_worker = Some(2);
        let adm = Admission::new(a, Default::default());
        let p = peer("10.0.0.1:1");
        assert!(adm.admit(p, 0, 2).unwrap().on_hello(false, 1).is_ok());
        assert_eq!(
            adm.admit(p, 0, 2).unwrap().on_hello(false, 2),
            Err(Refusal::FullHandshakesPerWorker)
        );
        assert!(adm.admit(p, 0, 2).unwrap().on_hello(true, 2).is_ok());
    }

    #[test]
    fn refusals_at_the_hello_are_not_incomplete_handshakes() {
        let mut a = args();
        a.client_incomplete_rate = Rate::per_second(1); // burst 2
        a.max_full_handshakes_per_worker = Some(1);
        let adm = Admission::new(a, Default::default());
        let p = peer("10.0.0.1:1");
        for _ in 0..5 {
            let mut t = adm.admit(p, 0, 0).unwrap();
            assert!(t.on_hello(false, 1).is_err());
        }
        assert!(adm.admit(p, 0, 0).is_ok());
    }

    #[test]
    fn connection_limit_frees_a_place_when_a_ticket_drops() {
        let mut a = args();
        a.client_max_connections = 2;
        let adm = Admission::new(a, Default::default());
        let t1 = adm.admit(peer("10.0.0.1:1"), 0, 0).unwrap();
        let _t2 = adm.admit(peer("10.0.0.1:2"), 0, 0).unwrap();
        assert_eq!(
            adm.admit(peer("10.0.0.1:3"), 0, 0).err(),
            Some(Refusal::ClientConnections)
        );
        drop(t1);
        assert!(adm.admit(peer("10.0.0.1:4"), 0, 0).is_ok());
    }

    #[test]
    fn incomplete_handshakes_close_the_door_until_the_budget_refills() {
        let mut a = args();
        a.client_incomplete_rate = Rate::per_second(1); // burst 2
        let adm = Admission::new(a, Default::default());
        let mut done = adm.admit(peer("10.0.0.1:1"), 0, 0).unwrap();
        done.handshake_done();
        drop(done);
        for _ in 0..2 {
            drop(adm.admit(peer("10.0.0.1:1"), 0, 0).unwrap());
        }
        assert_eq!(
            adm.admit(peer("10.0.0.1:1"), 0, 0).err(),
            Some(Refusal::ClientIncomplete)
        );
        assert!(adm.admit(peer("10.0.0.9:1"), 0, 0).is_ok());
    }

    #[test]
    fn global_limits_refuse_at_their_caps() {
        let mut a = args();
        a.max_connections = 10;
        a.max_handshakes_per_worker = 3;
        let adm = Admission::new(a, Default::default());
        assert_eq!(
            adm.admit(peer("10.0.0.1:1"), 10, 0).err(),
            Some(Refusal::MaxConnections)
        );
        assert_eq!(
            adm.admit(peer("10.0.0.1:1"), 9, 3).err(),
            Some(Refusal::HandshakesPerWorker)
        );
        assert!(adm.admit(peer("10.0.0.1:1"), 9, 2).is_ok());
    }

    #[test]
    fn a_client_refused_by_its_own_limit_is_refused_before_the_global_limits() {
        let mut a = args();
        a.max_connections = 1;
        a.client_handshake_rate = "6/min".parse().unwrap();
        a.client_handshake_burst = Some(1);
        let adm = Admission::new(a, Default::default());
        let p = peer("10.0.0.1:1");
        adm.admit(p, 0, 0).unwrap().on_hello(false, 0).unwrap();
        // At the connection limit, the client's own refusal comes first: the runtime makes
        // room (evicts) only between the two, for a connection the client's limits admitted.
        assert_eq!(
            adm.admit_client(p).err(),
            Some(Refusal::ClientHandshakeRate)
        );
        assert_eq!(adm.admit(p, 1, 0).err(), Some(Refusal::ClientHandshakeRate));
        // A global refusal gives the client's place back and is no unfinished handshake.
        let mut a = args();
        a.max_connections = 1;
        a.client_max_connections = 1;
        a.client_incomplete_rate = Rate::per_second(1); // burst 2
        let adm = Admission::new(a, Default::default());
        for _ in 0..5 {
            assert_eq!(adm.admit(p, 1, 0).err(), Some(Refusal::MaxConnections));
        }
        assert!(adm.admit(p, 0, 0).is_ok(), "its place was not given back");
    }

    fn table(size: u32) -> (Arc<Admission>, Arc<TableStats>) {
        let mut a = args();
        a.client_handshake_rate = "6/min".parse().unwrap();
        a.client_handshake_burst = Some(1);
        a.client_table_size = size;
        let stats = Arc::new(TableStats::default());
        (Admission::new(a, stats.clone()), stats)
    }

    fn v4(i: u32) -> SocketAddr {
        SocketAddr::from((std::net::Ipv4Addr::from(0x0a00_0000 + i), 1))
    }

    #[test]
    fn a_full_table_forgets_the_least_recently_seen_client_and_counts_it() {
        let (adm, stats) = table(4);
        for i in 0..4 {
            drop(adm.admit(v4(i), 0, 0).unwrap());
        }
        // 0 is seen again: 1 is now the least recently seen.
        drop(adm.admit(v4(0), 0, 0).unwrap());
        // A client out of tokens (refused) is seen too: kept, its refusal stands.
        let mut t = adm.admit(v4(3), 0, 0).unwrap();
        t.on_hello(false, 0).unwrap();
        t.handshake_done = true;
        drop(t);
        drop(adm.admit(v4(2), 0, 0).unwrap());
        assert_eq!(
            adm.admit(v4(3), 0, 0).err(),
            Some(Refusal::ClientHandshakeRate)
        );
        drop(adm.admit(v4(10), 0, 0).unwrap());
        assert_eq!(adm.clients.len(), 4);
        assert_eq!(stats.size.load(Relaxed), 4);
        assert_eq!(stats.evictions.load(Relaxed), 1);
        assert_eq!(stats.hot_evictions.load(Relaxed), 0, "1's budget was full");
        let shard = adm.clients.shard(ClientKey::of(v4(0).ip()));
        assert!(
            !shard.index.contains_key(&ClientKey::of(v4(1).ip())),
            "1 forgotten"
        );
        for kept in [0, 2, 3, 10] {
            assert!(
                shard.index.contains_key(&ClientKey::of(v4(kept).ip())),
                "{kept}"
            );
        }
        drop(shard);
        assert_eq!(
            adm.admit(v4(3), 0, 0).err(),
            Some(Refusal::ClientHandshakeRate)
        );
    }

    #[test]
    fn clients_with_connections_open_are_never_forgotten() {
        let (adm, stats) = table(2);
        let held: Vec<Ticket> = (0..2).map(|i| adm.admit(v4(i), 0, 0).unwrap()).collect();
        // Full of clients with a connection open: a new one is admitted, untracked.
        let t = adm.admit(v4(5), 0, 0).expect("admitted untracked");
        assert!(t.key.is_none());
        assert_eq!(stats.untracked.load(Relaxed), 1);
        assert_eq!(stats.evictions.load(Relaxed), 0);
        drop(held);
        // Both are idle now; 0 was released first, so it is the older of the two.
        drop(adm.admit(v4(6), 0, 0).unwrap());
        let shard = adm.clients.shard(ClientKey::of(v4(0).ip()));
        assert!(!shard.index.contains_key(&ClientKey::of(v4(0).ip())));
        assert!(shard.index.contains_key(&ClientKey::of(v4(1).ip())));
    }

    #[test]
    fn evicting_a_client_whose_budget_is_spent_is_counted_apart() {
        let (adm, stats) = table(1);
        let mut t = adm.admit(v4(0), 0, 0).unwrap();
        t.on_hello(false, 0).unwrap();
        drop(t);
        assert!(adm.admit(v4(0), 0, 0).is_err());
        drop(adm.admit(v4(1), 0, 0).unwrap());
        assert_eq!(stats.evictions.load(Relaxed), 1);
        assert_eq!(stats.hot_evictions.load(Relaxed), 1);
        // The rule's price: forgotten, 0 has its budget back.
        assert!(adm.admit(v4(0), 0, 0).is_ok());
    }

    #[test]
    fn the_table_never_holds_more_than_its_size_whatever_the_shards() {
        for size in [1, 7, 1023, 1024, 5000, 70_000] {
            let (adm, stats) = table(size);
            for i in 0..size + 3000 {
                drop(adm.admit(v4(i), 0, 0).unwrap());
            }
            let len = adm.clients.len();
            assert!(len <= size as usize && len as u64 == stats.size.load(Relaxed));
            // Shards fill unevenly: most of the size is used all the same.
            assert!(len as f64 >= size as f64 * 0.9, "{len} of {size}");
        }
    }

    /// `cargo test --release -p tlsplane-server admission_cost -- --ignored --nocapture`:
    /// admission of 1 M distinct IPv6 /64 clients, one connection each (admitted, then
    /// closed), into a table of the default size and into one that holds them all.
    #[test]
    #[ignore]
    fn admission_cost_with_a_million_distinct_clients() {
        fn rss_kib() -> u64 {
            let s = std::fs::read_to_string("/proc/self/statm").unwrap();
            let pages: u64 = s.split_whitespace().nth(1).unwrap().parse().unwrap();
            pages * 4
        }
        const N: u64 = 1_000_000;
        println!(
            "an entry: {} B in its shard's slab, {} B in its index (+ the index's slack)",
            std::mem::size_of::<Slot>(),
            std::mem::size_of::<(ClientKey, u32)>() + 1
        );
        for size in [100_000u32, 1_000_000] {
            let mut a = args();
            a.client_handshake_rate = "1/min".parse().unwrap();
            a.client_incomplete_rate = "1/min".parse().unwrap();
            a.client_table_size = size;
            let stats = Arc::new(TableStats::default());
            let adm = Admission::new(a, stats.clone());
            let mut ns = vec![0u64; N as usize];
            let before = rss_kib();
            let started = Instant::now();
            for i in 0..N {
                // Spread over a /32: 2001:db8:XXXX:XXXX::1.
                let ip =
                    std::net::Ipv6Addr::from((0x2001_0db8u128 << 96) | ((i as u128) << 64) | 1);
                let p = SocketAddr::from((ip, 443));
                let t0 = Instant::now();
                let mut t = adm.admit(p, 0, 0).unwrap();
                t.handshake_done();
                drop(t);
                ns[i as usize] = t0.elapsed().as_nanos() as u64;
            }
            let total = started.elapsed();
            let grew = rss_kib().saturating_sub(before);
            ns.sort_unstable();
            let q = |f: f64| ns[((ns.len() as f64 * f) as usize).min(ns.len() - 1)];
            println!(
                "table {size}: {N} clients in {total:?}; per admission+close: p50 {} ns, p99 {} ns, \
                 p99.9 {} ns, max {} ns; size {}, evictions {}; RSS +{} MiB ({} B per entry)",
                q(0.5),
                q(0.99),
                q(0.999),
                ns[ns.len() - 1],
                stats.size.load(Relaxed),
                stats.evictions.load(Relaxed),
                grew / 1024,
                grew * 1024 / stats.size.load(Relaxed).max(1),
            );
        }
    }
}
