//! Session-ticket keys shared by a fleet through Redis (`--ticket-store`, docs/FLEET.md).
//!
//! The store holds one value per fleet: the keys in use (previous, current, next: the same
//! rotation as `--ticket-keys`, see `tlsplane::tickets`), their generation and when they last
//! rotated, sealed with AES-256-GCM under a key-encryption key that only the fleet's servers
//! read (`--ticket-store-kek`), so the store never sees a usable key.
//!
//! Every server polls the value and installs a newer generation into its ticketer. When a
//! rotation is due, the first server to take a short lease (`SET NX PX`) makes the next
//! generation (a new key appended, the oldest dropped) and writes it only if the value is
//! still the one it read (a compare-and-set script), so two servers never publish different
//! keys for one generation. A store that lost the value (restarted empty, or a replica
//! promoted before it had the last write) gets the newest generation back from the first
//! server that holds it: nothing a fleet issued is forgotten because the store was.
//!
//! The store is never on the handshake path: handshakes use the keys held in memory. With the
//! store unreachable a server keeps its keys (resumption goes on until they would have
//! rotated out), logs once, counts, and reconnects; a server that starts without it uses keys
//! of its own until it is back.

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::atomic::{AtomicI64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aws_lc_rs::aead::{Aad, Nonce, RandomizedNonceKey, NONCE_LEN};
use base64::Engine as _;
use clap::Args;
use tlsplane::stats::Counter;
use tlsplane::tickets::{TicketKeyRing, TicketKeys};
use zeroize::Zeroizing;

/// Bytes of each key the store's servers make (a 16-byte name and a 64-byte secret).
const KEY_LEN: usize = 80;
/// Keys in a generation at most: previous, current, next.
const KEYS_KEPT: usize = 3;
/// Each store command's time limit.
pub(crate) const OP_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a server starting up waits for the store's keys before it listens with keys of
/// its own.
const FIRST_SYNC_WAIT: Duration = Duration::from_secs(2);
/// Waits between attempts to reach a store that is down: doubled up to the last.
pub(crate) const RECONNECT_BACKOFF: [Duration; 4] = [
    Duration::from_millis(250),
    Duration::from_millis(500),
    Duration::from_secs(1),
    Duration::from_secs(2),
];
const MAGIC: &[u8; 4] = b"TPK1";
const HEADER_LEN: usize = 4 + 8 + 8;
const TAG_LEN: usize = 16;
const KEK_INFO: &[u8] = b"tlsplane ticket store kek v1";
/// Sets the value only if it is still what the caller read ("" for none): a rotation or a
/// write-back never replaces one another server made meanwhile.
const COMPARE_AND_SET: &str = r"
local cur = redis.call('GET', KEYS[1])
if (cur == false and ARGV[1] == '') or cur == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2])
  return 1
end
return 0
";

#[derive(Args, Debug, Clone, Default)]
pub struct TicketStoreArgs {
    /// Share session-ticket keys with the other servers of the fleet through Redis:
    /// `redis://HOST:PORT[/DB]`, or `redis-sentinel://HOST:PORT[,HOST:PORT...]/MASTER` to follow
    /// Sentinel's failovers. Needs --ticket-store-kek. Handshakes never wait for the store.
    #[arg(long, value_name = "URL", conflicts_with = "ticket_keys")]
    pub ticket_store: Option<StoreUrl>,
    /// The key-encryption key of the keys in the store: a file with one base64 line of at
    /// least 32 random bytes (`openssl rand 32 | base64 -w0`), the same on every server of the
    /// fleet, which only they can read. Read at start.
    #[arg(long, value_name = "FILE")]
    pub ticket_store_kek: Option<PathBuf>,
    /// Seconds between rotations of the store's ticket keys (tickets are announced for as long,
    /// at most 6 hours).
    #[arg(long, value_name = "S", default_value_t = 21600, value_parser = clap::value_parser!(u64).range(1..))]
    pub ticket_rotation: u64,
    /// The fleet's name: its servers share the store's value `NAME:ticket-keys` (and its lease
    /// `NAME:ticket-keys:lease`); several fleets can share one Redis.
    #[arg(long, value_name = "NAME", default_value = "tlsplane")]
    pub fleet: String,
}

/// Where the store is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreUrl {
    Redis(String),
    Sentinel {
        sentinels: Vec<String>,
        master: String,
    },
}

impl FromStr for StoreUrl {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(rest) = s.strip_prefix("redis-sentinel://") {
            let (hosts, master) = rest
                .split_once('/')
                .ok_or("redis-sentinel://HOST:PORT[,HOST:PORT...]/MASTER: no master name")?;
            if master.is_empty() || hosts.is_empty() {
                return Err("redis-sentinel://HOST:PORT[,HOST:PORT...]/MASTER".into());
            }
            let sentinels = hosts.split(',').map(|h| format!("redis://{h}")).collect();
            return Ok(Self::Sentinel {
                sentinels,
                master: master.to_string(),
            });
        }
        if s.starts_with("redis://") || s.starts_with("unix://") {
            // Checked now, so that a typo fails the start rather than every reconnect.
            redis::Client::open(s).map_err(|e| format!("{s}: {e}"))?;
            return Ok(Self::Redis(s.to_string()));
        }
        Err(format!(
            "{s}: a store is redis://HOST:PORT[/DB] or redis-sentinel://HOST:PORT[,...]/MASTER"
        ))
    }
}

impl std::fmt::Display for StoreUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Redis(u) => f.write_str(u),
            Self::Sentinel { sentinels, master } => {
                let hosts: Vec<&str> = sentinels
                    .iter()
                    .map(|s| s.trim_start_matches("redis://"))
                    .collect();
                write!(f, "redis-sentinel://{}/{master}", hosts.join(","))
            }
        }
    }
}

/// What the store's servers count (/metrics, --stats).
#[derive(Default)]
pub struct TicketStoreStats {
    /// 1 while the store answers, 0 when it does not (or none is configured).
    pub connected: AtomicI64,
    /// The generation of the store's keys in use (0: keys of this process only).
    pub generation: AtomicI64,
    /// Rotations this server made (it held the lease).
    pub rotations: Counter,
    /// Generations installed from the store.
    pub installs: Counter,
    /// Store commands that failed (unreachable, timed out, a value that does not open).
    pub errors: Counter,
}

/// One generation: the keys, oldest first, their number and when they last rotated.
struct Generation {
    number: u64,
    rotated_at: u64,
    keys: Vec<Zeroizing<Vec<u8>>>,
}

impl Generation {
    /// The keys for the ticketer.
    fn ticket_keys(&self) -> Arc<TicketKeys> {
        Arc::new(TicketKeys::from_raw(&self.keys).expect("keys made by a server are 80 bytes"))
    }

    /// The next generation: a new key appended, at most three kept. From none: a current and
    /// a next key.
    fn next(current: Option<&Generation>, now: u64) -> Generation {
        let mut keys: Vec<Zeroizing<Vec<u8>>> = current
            .map(|g| g.keys.iter().map(|k| Zeroizing::new(k.to_vec())).collect())
            .unwrap_or_default();
        let fresh = if keys.is_empty() { 2 } else { 1 };
        for _ in 0..fresh {
            let mut k = Zeroizing::new(vec![0u8; KEY_LEN]);
            aws_lc_rs::rand::fill(&mut k).expect("the system's random source");
            keys.push(k);
        }
        let excess = keys.len().saturating_sub(KEYS_KEPT);
        keys.drain(..excess);
        Generation {
            number: current.map_or(1, |g| g.number + 1),
            rotated_at: now,
            keys,
        }
    }
}

/// Seals and opens the store's value under the key-encryption key.
struct Sealer {
    kek: RandomizedNonceKey,
    fleet: String,
}

impl Sealer {
    fn new(kek_bytes: &[u8], fleet: &str) -> Self {
        Self {
            kek: tlsplane::tickets::derive_aead_key(kek_bytes, KEK_INFO),
            fleet: fleet.to_string(),
        }
    }

    /// The header and the fleet's name are authenticated: a value cannot be moved to another
    /// fleet or have its generation changed.
    fn aad(&self, header: &[u8]) -> Vec<u8> {
        [header, self.fleet.as_bytes()].concat()
    }

    fn seal(&self, g: &Generation) -> Vec<u8> {
        let mut header = Vec::with_capacity(HEADER_LEN);
        header.extend_from_slice(MAGIC);
        header.extend_from_slice(&g.number.to_be_bytes());
        header.extend_from_slice(&g.rotated_at.to_be_bytes());
        let mut body = Zeroizing::new(Vec::with_capacity(1 + KEY_LEN * KEYS_KEPT + TAG_LEN));
        body.push(g.keys.len() as u8);
        for k in &g.keys {
            body.extend_from_slice(k);
        }
        let nonce = self
            .kek
            .seal_in_place_append_tag(Aad::from(self.aad(&header)), &mut *body)
            .expect("sealing a few hundred bytes");
        // `body` is ciphertext now.
        [&header[..], nonce.as_ref(), &body[..]].concat()
    }

    fn open(&self, value: &[u8]) -> Result<Generation, &'static str> {
        if value.len() < HEADER_LEN + NONCE_LEN + TAG_LEN || &value[..4] != MAGIC {
            return Err("not a tlsplane ticket-key value");
        }
        let (header, rest) = value.split_at(HEADER_LEN);
        let (nonce, sealed) = rest.split_at(NONCE_LEN);
        let number = u64::from_be_bytes(header[4..12].try_into().expect("8 bytes"));
        let rotated_at = u64::from_be_bytes(header[12..20].try_into().expect("8 bytes"));
        let nonce = Nonce::try_assume_unique_for_key(nonce).map_err(|_| "bad nonce")?;
        let mut body = Zeroizing::new(sealed.to_vec());
        let plain = self
            .kek
            .open_in_place(nonce, Aad::from(self.aad(header)), &mut body)
            .map_err(|_| {
                "it does not open with --ticket-store-kek (another key-encryption key, or another fleet's value)"
            })?;
        let Some((&n, keys)) = plain.split_first() else {
            return Err("no keys in it");
        };
        let n = n as usize;
        if n == 0 || n > KEYS_KEPT || keys.len() != n * KEY_LEN {
            return Err("a malformed key list");
        }
        Ok(Generation {
            number,
            rotated_at,
            keys: keys
                .chunks(KEY_LEN)
                .map(|k| Zeroizing::new(k.to_vec()))
                .collect(),
        })
    }
}

/// Reads the key-encryption key file: one base64 line of at least 32 bytes.
impl TicketStoreArgs {
    /// The key-encryption key, with --ticket-store (which needs it).
    pub fn read_kek(&self) -> anyhow::Result<Option<Zeroizing<Vec<u8>>>> {
        if self.ticket_store.is_none() {
            return Ok(None);
        }
        let path = self.ticket_store_kek.as_ref().ok_or_else(|| {
            anyhow::anyhow!("--ticket-store needs --ticket-store-kek FILE (the key-encryption key)")
        })?;
        read_kek(path).map(Some)
    }
}

fn read_kek(path: &Path) -> anyhow::Result<Zeroizing<Vec<u8>>> {
    let context =
        |e: &dyn std::fmt::Display| anyhow::anyhow!("--ticket-store-kek {}: {e}", path.display());
    let file = crate::secret_file::read(path, 4096).map_err(|e| context(&e))?;
    let line = file.text().map_err(|e| context(&e))?;
    if file.world_readable {
        tracing::warn!(
            "--ticket-store-kek {}: readable by every user of this machine; whoever reads it and the store can decrypt the sessions the fleet resumes (chmod o-r)",
            path.display()
        );
    }
    let mut kek = Zeroizing::new(Vec::with_capacity(line.len()));
    base64::engine::general_purpose::STANDARD
        .decode_vec(line, &mut kek)
        .map_err(|_| context(&"not one line of base64 (`openssl rand 32 | base64 -w0`)"))?;
    if kek.len() < 32 {
        return Err(context(&format!(
            "{} bytes: a key-encryption key is at least 32 random bytes",
            kek.len()
        )));
    }
    Ok(kek)
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Starts following the store: returns the ticketer every site uses, with the store's keys
/// if it answered within a moment, else with keys of this process until it does.
pub fn start(
    args: &TicketStoreArgs,
    kek: Option<&[u8]>,
    stats: Arc<TicketStoreStats>,
) -> anyhow::Result<Option<Arc<TicketKeyRing>>> {
    let (Some(url), Some(kek)) = (args.ticket_store.clone(), kek) else {
        return Ok(None);
    };
    let sealer = Sealer::new(kek, &args.fleet);
    let lifetime = u32::try_from(args.ticket_rotation).unwrap_or(u32::MAX);
    let own = Generation::next(None, now_secs());
    let ring = TicketKeyRing::with_lifetime(own.ticket_keys(), lifetime);
    let follower = Follower {
        url,
        sealer,
        key: format!("{}:ticket-keys", args.fleet),
        lease: format!("{}:ticket-keys:lease", args.fleet),
        node: {
            let mut id = [0u8; 8];
            aws_lc_rs::rand::fill(&mut id).expect("the system's random source");
            id.iter().map(|b| format!("{b:02x}")).collect()
        },
        period: args.ticket_rotation,
        ring: ring.clone(),
        held: None,
        stats,
        down: None,
    };
    let (first, synced) = std::sync::mpsc::sync_channel(1);
    on_own_thread("ticket-store", follower.run(first))?;
    if synced.recv_timeout(FIRST_SYNC_WAIT).is_err() {
        tracing::warn!(
            "ticket store {}: no answer within {:?}: listening with ticket keys of this process until it answers",
            args.ticket_store.as_ref().expect("checked"),
            FIRST_SYNC_WAIT
        );
    }
    Ok(Some(ring))
}

struct Follower {
    url: StoreUrl,
    sealer: Sealer,
    /// The store's names for the value and its lease.
    key: String,
    lease: String,
    /// This server's name in the lease.
    node: String,
    period: u64,
    ring: Arc<TicketKeyRing>,
    /// The store's generation installed last (what a store that lost it gets back).
    held: Option<Generation>,
    stats: Arc<TicketStoreStats>,
    /// Why the store is out of reach, while it is (logged once).
    down: Option<String>,
}

pub(crate) type Conn = redis::aio::MultiplexedConnection;

/// Runs `work` on a thread of its own with a runtime of its own: a store's slowness or
/// outage never holds a worker.
pub(crate) fn on_own_thread(
    name: &str,
    work: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || rt.block_on(work))?;
    Ok(())
}

/// A connection to the store (the primary, through Sentinel), within [`OP_TIMEOUT`].
pub(crate) async fn connect(url: &StoreUrl) -> Result<Conn, String> {
    let attempt = async {
        let client = match url {
            StoreUrl::Redis(u) => redis::Client::open(u.as_str())?,
            StoreUrl::Sentinel { sentinels, master } => {
                let mut s = redis::sentinel::SentinelClient::build(
                    sentinels.clone(),
                    master.clone(),
                    None,
                    redis::sentinel::SentinelServerType::Master,
                )?;
                s.async_get_client().await?
            }
        };
        client.get_multiplexed_async_connection().await
    };
    match tokio::time::timeout(OP_TIMEOUT, attempt).await {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("no connection within {OP_TIMEOUT:?}")),
    }
}

/// Why a sync failed: the store (reconnect), or its value (keep the connection).
enum SyncError {
    Store(String),
    Value(String),
}

impl Follower {
    /// How often the value is read: often enough that servers learn a generation well inside
    /// the rotation period, which is what lets them rotate at different moments.
    fn poll(&self) -> Duration {
        Duration::from_millis((self.period * 1000 / 20).clamp(100, 10_000))
    }

    async fn run(mut self, first: std::sync::mpsc::SyncSender<()>) {
        let mut first = Some(first);
        let mut attempt = 0;
        loop {
            let mut conn = match connect(&self.url).await {
                Ok(c) => c,
                Err(e) => {
                    self.failed(e, false);
                    if let Some(f) = first.take() {
                        let _ = f.try_send(());
                    }
                    tokio::time::sleep(RECONNECT_BACKOFF[attempt]).await;
                    attempt = (attempt + 1).min(RECONNECT_BACKOFF.len() - 1);
                    continue;
                }
            };
            attempt = 0;
            loop {
                let synced = self.sync(&mut conn).await;
                if let Some(f) = first.take() {
                    let _ = f.try_send(());
                }
                match synced {
                    Ok(()) => self.reached(),
                    // A value that does not open is not a connection problem: the store
                    // answers; it is read again later, and never overwritten.
                    Err(SyncError::Value(why)) => self.failed(why, true),
                    Err(SyncError::Store(why)) => {
                        self.failed(why, false);
                        break;
                    }
                }
                tokio::time::sleep(self.poll()).await;
            }
        }
    }

    /// A command, within its time limit.
    async fn query<T: redis::FromRedisValue>(
        conn: &mut Conn,
        cmd: &redis::Cmd,
    ) -> Result<T, SyncError> {
        match tokio::time::timeout(OP_TIMEOUT, cmd.query_async::<T>(conn)).await {
            Ok(r) => r.map_err(|e| SyncError::Store(e.to_string())),
            Err(_) => Err(SyncError::Store(format!("no answer within {OP_TIMEOUT:?}"))),
        }
    }

    /// Reads the value, installs a newer generation, gives back one the store lost, and
    /// rotates when one is due and this server gets the lease.
    async fn sync(&mut self, conn: &mut Conn) -> Result<(), SyncError> {
        let value: Option<Vec<u8>> = Self::query(conn, redis::cmd("GET").arg(&self.key)).await?;
        self.stats.connected.store(1, Relaxed);
        let stored = value.as_deref().map(|v| self.open(v)).transpose()?;
        let stored_number = stored.as_ref().map(|g| g.number);
        let held_number = self.held.as_ref().map(|g| g.number);
        match (stored, held_number) {
            (Some(s), h) if h.is_none_or(|h| s.number > h) => self.install(s),
            (Some(s), Some(h)) if s.number < h => {
                // The store went back in time (a replica promoted before the last write
                // reached it): put the newest generation back.
                let held = self.sealer.seal(self.held.as_ref().expect("held"));
                self.write(conn, value.as_deref(), &held).await?;
            }
            (None, Some(_)) => {
                // The store lost the value (restarted empty): put it back.
                let held = self.sealer.seal(self.held.as_ref().expect("held"));
                self.write(conn, None, &held).await?;
            }
            _ => {}
        }
        let now = now_secs();
        let due = match &self.held {
            Some(g) => now >= g.rotated_at.saturating_add(self.period),
            None => stored_number.is_none(),
        };
        if due && self.take_lease(conn).await? {
            // Read again under the lease: another server may have rotated just before.
            let value: Option<Vec<u8>> =
                Self::query(conn, redis::cmd("GET").arg(&self.key)).await?;
            let current = value.as_deref().map(|v| self.open(v)).transpose()?;
            let still_due = current
                .as_ref()
                .is_none_or(|g| now >= g.rotated_at.saturating_add(self.period));
            if still_due {
                let next = Generation::next(current.as_ref(), now);
                if self
                    .write(conn, value.as_deref(), &self.sealer.seal(&next))
                    .await?
                {
                    self.stats.rotations.fetch_add(1, Relaxed);
                    tracing::info!(
                        "ticket store {}: rotated the fleet's ticket keys to generation {}",
                        self.url,
                        next.number
                    );
                    self.install(next);
                }
            }
        }
        Ok(())
    }

    fn open(&self, value: &[u8]) -> Result<Generation, SyncError> {
        self.sealer
            .open(value)
            .map_err(|e| SyncError::Value(format!("the value {}: {e}", self.key)))
    }

    /// Writes `new` if the value is still `expected`; whether it did.
    async fn write(
        &self,
        conn: &mut Conn,
        expected: Option<&[u8]>,
        new: &[u8],
    ) -> Result<bool, SyncError> {
        let script = redis::Script::new(COMPARE_AND_SET);
        let mut invocation = script.key(&self.key);
        invocation.arg(expected.unwrap_or(b"")).arg(new);
        match tokio::time::timeout(OP_TIMEOUT, invocation.invoke_async::<i64>(conn)).await {
            Ok(r) => r
                .map(|n| n == 1)
                .map_err(|e| SyncError::Store(e.to_string())),
            Err(_) => Err(SyncError::Store(format!("no answer within {OP_TIMEOUT:?}"))),
        }
    }

    /// The rotation lease: one server at a time makes the next generation. It expires by
    /// itself, so a server that dies holding it delays the rotation by a moment only.
    async fn take_lease(&self, conn: &mut Conn) -> Result<bool, SyncError> {
        let ms = (self.poll().as_millis() as u64 * 4).max(1000);
        let got: Option<String> = Self::query(
            conn,
            redis::cmd("SET")
                .arg(&self.lease)
                .arg(&self.node)
                .arg("NX")
                .arg("PX")
                .arg(ms),
        )
        .await?;
        Ok(got.is_some())
    }

    fn install(&mut self, g: Generation) {
        self.ring.install(g.ticket_keys());
        self.stats.installs.fetch_add(1, Relaxed);
        self.stats.generation.store(g.number as i64, Relaxed);
        let name = &g.keys[g.keys.len().saturating_sub(2)][..4];
        tracing::info!(
            "ticket store {}: generation {} installed ({} keys, encrypting with the key named {:02x}{:02x}{:02x}{:02x}...)",
            self.url,
            g.number,
            g.keys.len(),
            name[0],
            name[1],
            name[2],
            name[3]
        );
        self.held = Some(g);
    }

    fn reached(&mut self) {
        self.stats.connected.store(1, Relaxed);
        if self.down.take().is_some() {
            tracing::info!("ticket store {}: reached again", self.url);
        }
    }

    fn failed(&mut self, why: String, answers: bool) {
        self.stats.errors.fetch_add(1, Relaxed);
        self.stats.connected.store(i64::from(answers), Relaxed);
        if self.down.is_none() {
            tracing::warn!(
                "ticket store {}: {why}: keeping the ticket keys held; trying again",
                self.url
            );
            self.down = Some(why);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sealed_generation_opens_only_under_its_kek_and_fleet() {
        let g = Generation::next(None, 1000);
        assert_eq!((g.number, g.keys.len()), (1, 2));
        let g = Generation::next(Some(&g), 2000);
        let g = Generation::next(Some(&g), 3000);
        assert_eq!((g.number, g.rotated_at, g.keys.len()), (3, 3000, 3));
        let sealer = Sealer::new(&[7u8; 32], "a");
        let value = sealer.seal(&g);
        let back = sealer.open(&value).unwrap();
        assert_eq!((back.number, back.rotated_at), (3, 3000));
        assert!(back.keys.iter().zip(&g.keys).all(|(a, b)| a[..] == b[..]));
        // No key bytes in the clear.
        for k in &g.keys {
            assert!(!value.windows(16).any(|w| w == &k[..16]));
        }
        assert!(Sealer::new(&[8u8; 32], "a").open(&value).is_err());
        assert!(Sealer::new(&[7u8; 32], "b").open(&value).is_err());
        for i in 0..value.len() {
            let mut bad = value.clone();
            bad[i] ^= 0x40;
            assert!(sealer.open(&bad).is_err(), "byte {i}");
        }
        assert!(sealer.open(&value[..value.len() - 1]).is_err());
        assert!(sealer.open(b"").is_err());
    }

    #[test]
    fn a_rotation_keeps_the_newest_three_keys() {
        let g1 = Generation::next(None, 0);
        let g2 = Generation::next(Some(&g1), 10);
        let g3 = Generation::next(Some(&g2), 20);
        assert_eq!(g2.keys[..2], g1.keys[..]);
        assert_eq!(g3.keys[..2], g2.keys[1..]);
        // The current key (the one before the last) of g2 was g1's next.
        assert_eq!(g2.ticket_keys().current_name(), g1.keys[1][..16]);
    }

    #[test]
    fn store_urls() {
        assert_eq!(
            "redis-sentinel://127.0.0.1:1,127.0.0.1:2/m".parse::<StoreUrl>(),
            Ok(StoreUrl::Sentinel {
                sentinels: vec!["redis://127.0.0.1:1".into(), "redis://127.0.0.1:2".into()],
                master: "m".into()
            })
        );
        assert_eq!(
            "redis-sentinel://127.0.0.1:1,127.0.0.1:2/m"
                .parse::<StoreUrl>()
                .unwrap()
                .to_string(),
            "redis-sentinel://127.0.0.1:1,127.0.0.1:2/m"
        );
        assert!("redis://127.0.0.1:6379/0".parse::<StoreUrl>().is_ok());
        assert!("redis-sentinel://127.0.0.1:1".parse::<StoreUrl>().is_err());
        assert!("http://x".parse::<StoreUrl>().is_err());
    }
}
