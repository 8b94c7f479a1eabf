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
//! Whoever can write to the store cannot read or forge keys, but could stop the rotation;
//! nothing it writes does so for long. A value that does not open (garbage, another type, a
//! value sealed under another key-encryption key) is replaced by the next server to hold the
//! lease; a lease with no expiry, or a longer one than servers set, is cut to the servers'
//! own; generations only move forward on each server. And whatever the store does, a server
//! uses the store's keys for at most `--ticket-key-max-age` after they were made: past it (the
//! store frozen, unreachable, or replaying an old value) it drops them and seals tickets with
//! keys of its own until the store has newer ones. That bounds how long a key can decrypt
//! recorded sessions' resumption secrets, store or no store.
//!
//! The store is never on the handshake path: handshakes use the keys held in memory. With the
//! store unreachable a server keeps its keys (up to the maximum age), logs once, counts, and
//! reconnects; a server that starts without it uses keys of its own until it is back.

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::atomic::{AtomicI64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use aws_lc_rs::aead::{Aad, Nonce, RandomizedNonceKey, NONCE_LEN};
use base64::Engine as _;
use clap::Args;
use redis::IntoConnectionInfo as _;
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
/// A warning that the store's value or lease keeps repeating is logged at most this often
/// (with the number held back); every occurrence is counted.
const LOG_EVERY: Duration = Duration::from_secs(60);
const MAGIC: &[u8; 4] = b"TPK1";
const HEADER_LEN: usize = 4 + 8 + 8;
const TAG_LEN: usize = 16;
const KEK_INFO: &[u8] = b"tlsplane ticket store kek v1";
/// The longest value a server reads from the store (put in `CURRENT` for its name): a sealed
/// generation is at most `HEADER_LEN + 1 + KEY_LEN * KEYS_KEPT + TAG_LEN` bytes. A longer one
/// is not a server's; it is never sent to one, whose memory it would fill at every poll.
const MAX_VALUE_LEN: usize = 1024;
/// The value as the scripts below see it: its bytes; "" when there is none; `type:T` when the
/// key holds a Redis type other than a string, `size:N` when it holds a string longer than
/// `MAX_VALUE_LEN` (which no server writes: either is replaced like any value that does not
/// open, instead of failing every read with WRONGTYPE or sending megabytes at every poll).
/// The length is measured in the script rather than with `STRLEN`, so that the store's ACL
/// user needs no command beyond those documented in docs/FLEET.md.
const CURRENT: &str = r"
local function current(key)
  local t = redis.call('TYPE', key)['ok']
  if t == 'string' then
    local v = redis.call('GET', key)
    if #v > MAX_VALUE_LEN then return 'size:' .. #v end
    return v
  end
  if t == 'none' then return '' end
  return 'type:' .. t
end
";
fn current() -> String {
    CURRENT.replace("MAX_VALUE_LEN", &MAX_VALUE_LEN.to_string())
}
const READ: &str = "return current(KEYS[1])";
/// Sets the value only if it is still what the caller read: a rotation, a write-back or a
/// repair never replaces one another server made meanwhile.
const COMPARE_AND_SET: &str = r"
if current(KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2])
  return 1
end
return 0
";
/// Takes the lease (1), or finds it held (0), or finds it held with no expiry or a longer one
/// than servers set, and cuts it to theirs (2): a lease squatted for ever would stop the
/// rotation for ever.
const TAKE_LEASE: &str = r"
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
local ttl = redis.call('PTTL', KEYS[1])
if ttl < 0 or ttl > tonumber(ARGV[2]) then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 2
end
return 0
";

#[derive(Args, Debug, Clone, Default)]
pub struct TicketStoreArgs {
    /// Share session-ticket keys with the other servers of the fleet through Redis:
    /// `redis://HOST:PORT[/DB]`, `rediss://[USER@]HOST:PORT[/DB]` (TLS: the way to reach a
    /// store on another host), or `redis-sentinel://HOST:PORT[,HOST:PORT...]/MASTER` to follow
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
    /// Seconds after the store's keys were made that this server uses them at most: past it
    /// (the store frozen, unreachable, or replaying an old value) it drops them, tickets under
    /// them get full handshakes, and it seals tickets with keys of its own until the store has
    /// newer ones (`ticket_store_expired`). More than --ticket-rotation. Default: twice
    /// --ticket-rotation.
    #[arg(long, value_name = "S", value_parser = clap::value_parser!(u64).range(1..))]
    pub ticket_key_max_age: Option<u64>,
    /// The fleet's name: its servers share the store's value `NAME:ticket-keys` (and its lease
    /// `NAME:ticket-keys:lease`); several fleets can share one Redis.
    #[arg(long, value_name = "NAME", default_value = "tlsplane")]
    pub fleet: String,
    /// For a rediss:// store: the CA certificates (PEM) its certificate must chain to (its
    /// name or address must also match the URL's host). Default: the system's trusted roots.
    #[arg(long, value_name = "PEM")]
    pub ticket_store_ca: Option<PathBuf>,
    /// For a rediss:// store that asks for a client certificate (Redis's `tls-auth-clients
    /// yes`, its default): this server's certificate chain (PEM), with --ticket-store-tls-key.
    #[arg(long, value_name = "PEM", requires = "ticket_store_tls_key")]
    pub ticket_store_tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --ticket-store-tls-cert. Read at start.
    #[arg(long, value_name = "PEM", requires = "ticket_store_tls_cert")]
    pub ticket_store_tls_key: Option<PathBuf>,
    /// The password of the store's user (Redis ACL: the URL's USER, else `default`), from a
    /// file of one line, so that it is neither on the command line nor in the logs. Read at
    /// start.
    #[arg(long, value_name = "FILE")]
    pub ticket_store_password_file: Option<PathBuf>,
}

/// Where the store is.
#[derive(Clone, PartialEq, Eq)]
pub enum StoreUrl {
    /// `redis://`, `rediss://` or `unix://`, as written (it may hold a password: shown
    /// without it).
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
        let shown = without_password(s);
        if s.starts_with("rediss://") && s.contains('#') {
            return Err(format!(
                "{shown}: a rediss:// store's certificate is always checked (--ticket-store-ca names its CA)"
            ));
        }
        if s.starts_with("redis://") || s.starts_with("rediss://") || s.starts_with("unix://") {
            // Checked now, so that a typo fails the start rather than every reconnect.
            redis::Client::open(s).map_err(|e| format!("{shown}: {e}"))?;
            return Ok(Self::Redis(s.to_string()));
        }
        Err(format!(
            "{shown}: a store is redis://HOST:PORT[/DB], rediss://[USER@]HOST:PORT[/DB] or redis-sentinel://HOST:PORT[,...]/MASTER"
        ))
    }
}

/// `url` with the password of its user information, if any, replaced by `***`.
fn without_password(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let Some(at) = rest[..authority_end].rfind('@') else {
        return url.to_string();
    };
    match rest[..at].split_once(':') {
        Some((user, _)) => format!("{scheme}://{user}:***{}", &rest[at..]),
        None => url.to_string(),
    }
}

impl std::fmt::Display for StoreUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Redis(u) => f.write_str(&without_password(u)),
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

impl std::fmt::Debug for StoreUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StoreUrl({self})")
    }
}

/// The store and how to reach it, read at start: the address, and the certificates and the
/// password a `rediss://` or ACL-protected store needs. Cheap to clone (the ticket keys'
/// follower and the fleet's limits each connect with it).
#[derive(Clone)]
pub struct Store {
    url: StoreUrl,
    client: StoreClient,
}

#[derive(Clone)]
enum StoreClient {
    Redis(redis::Client),
    Sentinel {
        sentinels: Vec<String>,
        master: String,
    },
}

impl Store {
    /// A plain `redis://` store, for tests of what is decided without reaching it.
    #[cfg(test)]
    pub(crate) fn plain(url: &str) -> Store {
        Store {
            url: url.parse().expect("a redis:// URL"),
            client: StoreClient::Redis(redis::Client::open(url).expect("a redis:// URL")),
        }
    }
}

impl std::fmt::Display for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.url.fmt(f)
    }
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Store({})", self.url)
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
    /// Values that did not open, replaced by this server under the lease.
    pub heals: Counter,
    /// Leases found with no expiry or a longer one than servers set, cut by this server.
    pub leases_cut: Counter,
    /// Times the store's keys in use passed --ticket-key-max-age and were dropped, and values
    /// read that were already past it (not installed).
    pub expired: Counter,
}

/// One generation: the keys, oldest first, their number and when they last rotated.
struct Generation {
    number: u64,
    rotated_at: u64,
    keys: Vec<Zeroizing<Vec<u8>>>,
}

fn random_key() -> Zeroizing<Vec<u8>> {
    let mut k = Zeroizing::new(vec![0u8; KEY_LEN]);
    aws_lc_rs::rand::fill(&mut k).expect("the system's random source");
    k
}

impl Generation {
    /// The keys for the ticketer.
    fn ticket_keys(&self) -> Arc<TicketKeys> {
        Arc::new(TicketKeys::from_raw(&self.keys).expect("keys made by a server are 80 bytes"))
    }

    /// Keys owing nothing to any before: a current and a next key.
    fn fresh(number: u64, now: u64) -> Generation {
        Generation {
            number,
            rotated_at: now,
            keys: vec![random_key(), random_key()],
        }
    }

    /// The rotation of this generation: its keys, a new one appended, the newest three kept.
    fn rotated(&self, number: u64, now: u64) -> Generation {
        let mut keys: Vec<Zeroizing<Vec<u8>>> = self.keys.clone();
        keys.push(random_key());
        let excess = keys.len().saturating_sub(KEYS_KEPT);
        keys.drain(..excess);
        Generation {
            number,
            rotated_at: now,
            keys,
        }
    }

    fn same_keys(&self, other: &Generation) -> bool {
        self.keys.len() == other.keys.len()
            && self
                .keys
                .iter()
                .zip(&other.keys)
                .all(|(a, b)| a[..] == b[..])
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
    /// fleet or have its generation or its time changed.
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
                "it does not open with --ticket-store-kek (another key-encryption key, another fleet's value, or garbage)"
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

    /// Seconds the store's keys are used at most after they were made.
    fn max_age(&self) -> u64 {
        self.ticket_key_max_age
            .unwrap_or(self.ticket_rotation.saturating_mul(2))
    }

    /// The store, with what reaching it takes (certificates, password), read and checked as
    /// at start; None without --ticket-store.
    pub fn store(&self) -> anyhow::Result<Option<Store>> {
        let Some(url) = self.ticket_store.clone() else {
            return Ok(None);
        };
        if self.max_age() <= self.ticket_rotation {
            anyhow::bail!(
                "--ticket-key-max-age {}: more than --ticket-rotation {} (keys must outlive one rotation; twice it by default)",
                self.max_age(),
                self.ticket_rotation
            );
        }
        let client = match &url {
            StoreUrl::Sentinel { sentinels, master } => {
                let extras = [
                    (&self.ticket_store_ca, "--ticket-store-ca"),
                    (&self.ticket_store_tls_cert, "--ticket-store-tls-cert"),
                    (
                        &self.ticket_store_password_file,
                        "--ticket-store-password-file",
                    ),
                ];
                if let Some((_, flag)) = extras.iter().find(|(v, _)| v.is_some()) {
                    anyhow::bail!(
                        "{flag}: for a redis:// or rediss:// store (through Sentinel, TLS and passwords are not built yet)"
                    );
                }
                StoreClient::Sentinel {
                    sentinels: sentinels.clone(),
                    master: master.clone(),
                }
            }
            StoreUrl::Redis(u) => StoreClient::Redis(self.redis_client(u)?),
        };
        Ok(Some(Store { url, client }))
    }

    fn redis_client(&self, url: &str) -> anyhow::Result<redis::Client> {
        let shown = without_password(url);
        let mut info = url
            .into_connection_info()
            .map_err(|e| anyhow::anyhow!("--ticket-store {shown}: {e}"))?;
        if let Some(path) = &self.ticket_store_password_file {
            info.redis.password = Some(read_password(path)?);
        }
        let tls = matches!(info.addr, redis::ConnectionAddr::TcpTls { .. });
        if let redis::ConnectionAddr::Tcp(host, _) = &info.addr {
            if !is_loopback(host) {
                tracing::warn!(
                    "--ticket-store {shown}: another host over plain TCP: whoever is on the path can read the lease, stop the rotation and see {}; use rediss:// (docs/FLEET.md)",
                    if info.redis.password.is_some() { "the password" } else { "the traffic" }
                );
            }
        }
        let certificates = [
            (&self.ticket_store_ca, "--ticket-store-ca"),
            (&self.ticket_store_tls_cert, "--ticket-store-tls-cert"),
        ];
        if let Some((_, flag)) = certificates.iter().find(|(v, _)| v.is_some() && !tls) {
            anyhow::bail!("{flag}: for a rediss:// store, and --ticket-store is {shown}");
        }
        if tls {
            // The Redis client builds its TLS configuration on the process's default provider:
            // make it aws-lc-rs, as everywhere else, whatever else the build enables.
            let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
        }
        let client = if self.ticket_store_ca.is_some() || self.ticket_store_tls_cert.is_some() {
            redis::Client::build_with_tls(info, self.tls_certificates()?)
        } else {
            redis::Client::open(info)
        };
        client.map_err(|e| anyhow::anyhow!("--ticket-store {shown}: {e}"))
    }

    /// The CA and the client certificate and key files, read.
    fn tls_certificates(&self) -> anyhow::Result<redis::TlsCertificates> {
        let read = |flag: &str, path: &Path| {
            std::fs::read(path).map_err(|e| anyhow::anyhow!("{flag} {}: {e}", path.display()))
        };
        let root_cert = match &self.ticket_store_ca {
            Some(p) => Some(read("--ticket-store-ca", p)?),
            None => None,
        };
        let client_tls = match (&self.ticket_store_tls_cert, &self.ticket_store_tls_key) {
            (Some(cert), Some(key)) => {
                let context = |e: &dyn std::fmt::Display| {
                    anyhow::anyhow!("--ticket-store-tls-key {}: {e}", key.display())
                };
                let file = crate::secret_file::read(key, 64 * 1024).map_err(|e| context(&e))?;
                if file.world_readable {
                    tracing::warn!(
                        "--ticket-store-tls-key {}: readable by every user of this machine (chmod o-r)",
                        key.display()
                    );
                }
                Some(redis::ClientTlsConfig {
                    client_cert: read("--ticket-store-tls-cert", cert)?,
                    // The Redis client keeps its own copy of the key, which it does not zeroize.
                    client_key: file.bytes.to_vec(),
                })
            }
            _ => None,
        };
        Ok(redis::TlsCertificates {
            client_tls,
            root_cert,
        })
    }
}

fn is_loopback(host: &str) -> bool {
    host == "localhost"
        || host
            .trim_matches(['[', ']'])
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// The store's password: one line of a file.
fn read_password(path: &Path) -> anyhow::Result<String> {
    let context = |e: &dyn std::fmt::Display| {
        anyhow::anyhow!("--ticket-store-password-file {}: {e}", path.display())
    };
    let file = crate::secret_file::read(path, 4096).map_err(|e| context(&e))?;
    let line = file.text().map_err(|e| context(&e))?;
    if line.is_empty() || line.contains('\n') {
        return Err(context(&"one line, the password"));
    }
    if file.world_readable {
        tracing::warn!(
            "--ticket-store-password-file {}: readable by every user of this machine (chmod o-r)",
            path.display()
        );
    }
    // The Redis client keeps the password as a String of its own, which it does not zeroize.
    Ok(line.to_string())
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
    store: Option<Store>,
    kek: Option<&[u8]>,
    stats: Arc<TicketStoreStats>,
) -> anyhow::Result<Option<Arc<TicketKeyRing>>> {
    let (Some(store), Some(kek)) = (store, kek) else {
        return Ok(None);
    };
    let sealer = Sealer::new(kek, &args.fleet);
    let lifetime = u32::try_from(args.ticket_rotation).unwrap_or(u32::MAX);
    let own = Generation::fresh(0, now_secs());
    let ring = TicketKeyRing::with_lifetime(own.ticket_keys(), lifetime);
    let shown = store.to_string();
    let follower = Follower {
        store,
        sealer,
        key: format!("{}:ticket-keys", args.fleet),
        lease: format!("{}:ticket-keys:lease", args.fleet),
        node: {
            let mut id = [0u8; 8];
            aws_lc_rs::rand::fill(&mut id).expect("the system's random source");
            id.iter().map(|b| format!("{b:02x}")).collect()
        },
        period: args.ticket_rotation,
        max_age: args.max_age(),
        ring: ring.clone(),
        held: None,
        local: Some(own),
        stats,
        down: None,
        scripts: Scripts::default(),
        warnings: Warnings::default(),
    };
    let (first, synced) = std::sync::mpsc::sync_channel(1);
    on_own_thread("ticket-store", follower.run(first))?;
    if synced.recv_timeout(FIRST_SYNC_WAIT).is_err() {
        tracing::warn!(
            "ticket store {shown}: no answer within {FIRST_SYNC_WAIT:?}: listening with ticket keys of this process until it answers",
        );
    }
    Ok(Some(ring))
}

/// A warning let through at most every [`LOG_EVERY`], counting the ones held back.
#[derive(Default)]
struct Throttle {
    last: Option<Instant>,
    held_back: u64,
}

impl Throttle {
    /// `Some(warnings held back since the last one)` when one may be logged now.
    fn pass(&mut self) -> Option<u64> {
        let now = Instant::now();
        if self.last.is_some_and(|t| now.duration_since(t) < LOG_EVERY) {
            self.held_back += 1;
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.held_back))
    }
}

/// ", and N more like it since" for a throttled warning.
fn and_more(held_back: u64) -> String {
    match held_back {
        0 => String::new(),
        n => format!(" ({n} more since the last such warning)"),
    }
}

struct Follower {
    store: Store,
    sealer: Sealer,
    /// The store's names for the value and its lease.
    key: String,
    lease: String,
    /// This server's name in the lease.
    node: String,
    period: u64,
    max_age: u64,
    ring: Arc<TicketKeyRing>,
    /// The newest of the store's generations installed here, kept once its keys aged out so
    /// that nothing older, nor itself again, is installed.
    held: Option<Generation>,
    /// Keys of this process, while they are the ones in use (before the store answers, or
    /// once the store's aged out).
    local: Option<Generation>,
    stats: Arc<TicketStoreStats>,
    /// Why the store is out of reach, while it is (logged once).
    down: Option<String>,
    scripts: Scripts,
    warnings: Warnings,
}

/// The store's scripts, hashed once.
struct Scripts {
    read: redis::Script,
    compare_and_set: redis::Script,
    take_lease: redis::Script,
}

impl Default for Scripts {
    fn default() -> Self {
        Scripts {
            read: redis::Script::new(&[&current(), READ].concat()),
            compare_and_set: redis::Script::new(&[&current(), COMPARE_AND_SET].concat()),
            take_lease: redis::Script::new(TAKE_LEASE),
        }
    }
}

/// The warnings the store's misbehaviour repeats, each throttled on its own.
#[derive(Default)]
struct Warnings {
    unreadable: Throttle,
    repaired: Throttle,
    too_old: Throttle,
    lease_cut: Throttle,
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
pub(crate) async fn connect(store: &Store) -> Result<Conn, String> {
    let attempt = async {
        let client = match &store.client {
            StoreClient::Redis(c) => c.clone(),
            StoreClient::Sentinel { sentinels, master } => {
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

/// Why a sync failed: the store (reconnect).
struct StoreError(String);

/// The store's value as read: none, one that does not open (why), or a generation.
enum Stored {
    Missing,
    Unreadable(&'static str),
    Generation(Generation),
}

/// What the lease script found.
enum Lease {
    Taken,
    Held,
    Cut,
}

impl Follower {
    /// How often the value is read: often enough that servers learn a generation well inside
    /// the rotation period, which is what lets them rotate at different moments.
    fn poll(&self) -> Duration {
        Duration::from_millis((self.period * 1000 / 20).clamp(100, 10_000))
    }

    /// How long a lease lasts, and the longest one left standing: a few polls, at least 1 s.
    fn lease_ms(&self) -> u64 {
        (self.poll().as_millis() as u64 * 4).max(1000)
    }

    async fn run(mut self, first: std::sync::mpsc::SyncSender<()>) {
        let mut first = Some(first);
        let mut attempt = 0;
        loop {
            self.age(now_secs());
            let mut conn = match connect(&self.store).await {
                Ok(c) => c,
                Err(e) => {
                    self.failed(e);
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
                self.age(now_secs());
                if let Some(f) = first.take() {
                    let _ = f.try_send(());
                }
                match synced {
                    Ok(()) => self.reached(),
                    Err(StoreError(why)) => {
                        self.failed(why);
                        break;
                    }
                }
                tokio::time::sleep(self.poll()).await;
            }
        }
    }

    /// Whether `g`'s keys may still be used: made less than the maximum age ago.
    fn fresh(&self, g: &Generation, now: u64) -> bool {
        now < g.rotated_at.saturating_add(self.max_age)
    }

    /// The generation held, if its keys may still be used.
    fn fresh_held(&self, now: u64) -> Option<&Generation> {
        self.held.as_ref().filter(|g| self.fresh(g, now))
    }

    /// Whether a rotation is due: the keys held were made a period ago, or none may be used.
    fn rotation_due(&self, now: u64) -> bool {
        self.fresh_held(now)
            .is_none_or(|g| now >= g.rotated_at.saturating_add(self.period))
    }

    /// Drops the store's keys once they are past the maximum age, and rotates this process's
    /// own keys, while they are in use, every period.
    fn age(&mut self, now: u64) {
        match (&self.local, &self.held) {
            (None, Some(g)) if !self.fresh(g, now) => {
                self.stats.expired.fetch_add(1, Relaxed);
                tracing::warn!(
                    "ticket store {}: generation {} was made {} s ago and has reached --ticket-key-max-age ({} s): its keys are dropped (tickets under them get full handshakes) and tickets are sealed with keys of this process until the store has a newer generation",
                    self.store,
                    g.number,
                    now.saturating_sub(g.rotated_at),
                    self.max_age
                );
                self.use_local(Generation::fresh(0, now));
            }
            (Some(own), _) if now >= own.rotated_at.saturating_add(self.period) => {
                let next = own.rotated(0, now);
                self.use_local(next);
            }
            _ => {}
        }
    }

    fn use_local(&mut self, own: Generation) {
        self.ring.install(own.ticket_keys());
        self.stats.generation.store(0, Relaxed);
        self.local = Some(own);
    }

    /// A command, within its time limit.
    async fn query<T: redis::FromRedisValue>(
        conn: &mut Conn,
        invocation: &redis::ScriptInvocation<'_>,
    ) -> Result<T, StoreError> {
        match tokio::time::timeout(OP_TIMEOUT, invocation.invoke_async::<T>(conn)).await {
            Ok(r) => r.map_err(|e| StoreError(e.to_string())),
            Err(_) => Err(StoreError(format!("no answer within {OP_TIMEOUT:?}"))),
        }
    }

    /// The value as the scripts see it ("" for none).
    async fn read(&self, conn: &mut Conn) -> Result<Vec<u8>, StoreError> {
        Self::query(conn, &self.scripts.read.key(&self.key)).await
    }

    /// What a value read holds. A time ahead of this server's clock counts as now, so that a
    /// server whose clock runs ahead cannot make keys live longer.
    fn look(&self, raw: &[u8], now: u64) -> Stored {
        if raw.is_empty() {
            return Stored::Missing;
        }
        match self.sealer.open(raw) {
            Ok(mut g) => {
                g.rotated_at = g.rotated_at.min(now);
                Stored::Generation(g)
            }
            Err(why) => Stored::Unreadable(why),
        }
    }

    /// Whether `g`, read from the store, replaces the generation held: it may still be used,
    /// and it is newer, or the same number with other keys (two servers that each rotated
    /// from a value they could not read: the store's wins).
    fn takes(&self, g: &Generation, now: u64) -> bool {
        self.fresh(g, now)
            && self
                .held
                .as_ref()
                .is_none_or(|h| g.number > h.number || (g.number == h.number && !g.same_keys(h)))
    }

    /// Reads the value, installs a newer generation, gives back one the store lost, replaces
    /// one that does not open, and rotates when one is due and this server gets the lease.
    async fn sync(&mut self, conn: &mut Conn) -> Result<(), StoreError> {
        let raw = self.read(conn).await?;
        self.stats.connected.store(1, Relaxed);
        let now = now_secs();
        let behind = match self.look(&raw, now) {
            Stored::Generation(g) => {
                let behind = self.held.as_ref().is_some_and(|h| g.number < h.number);
                self.consider(g, now);
                behind
            }
            Stored::Missing => self.held.is_some(),
            Stored::Unreadable(why) => {
                self.unreadable(why);
                return self.with_lease(conn).await;
            }
        };
        if self.rotation_due(now) {
            return self.with_lease(conn).await;
        }
        if behind {
            // The store lost the value (restarted empty), or went back in time (a replica
            // promoted before the last write reached it): put the newest generation back.
            if let Some(h) = self.fresh_held(now) {
                let sealed = self.sealer.seal(h);
                self.write(conn, &raw, &sealed).await?;
            }
        }
        Ok(())
    }

    /// Installs `g` if it replaces the generation held; counts it if it is too old to.
    fn consider(&mut self, g: Generation, now: u64) {
        if self.takes(&g, now) {
            self.install(g);
        } else if !self.fresh(&g, now) && self.held.as_ref().is_none_or(|h| g.number > h.number) {
            self.stats.expired.fetch_add(1, Relaxed);
            if let Some(more) = self.warnings.too_old.pass() {
                tracing::warn!(
                    "ticket store {}: the value {} holds generation {}, made {} s ago, past --ticket-key-max-age ({} s): not installed; a newer one is made{}",
                    self.store,
                    self.key,
                    g.number,
                    now.saturating_sub(g.rotated_at),
                    self.max_age,
                    and_more(more)
                );
            }
        }
    }

    /// Under the lease, if this server gets it: reads the value again (another server may
    /// have just written it), then rotates if a rotation is due, or else puts the generation
    /// held in place of a value that does not open.
    async fn with_lease(&mut self, conn: &mut Conn) -> Result<(), StoreError> {
        match self.take_lease(conn).await? {
            Lease::Taken => {}
            Lease::Held => return Ok(()),
            Lease::Cut => {
                self.stats.leases_cut.fetch_add(1, Relaxed);
                if let Some(more) = self.warnings.lease_cut.pass() {
                    tracing::warn!(
                        "ticket store {}: the lease {} had no expiry, or a longer one than the {} ms servers set: cut to that, so that the rotation goes on{}",
                        self.store,
                        self.lease,
                        self.lease_ms(),
                        and_more(more)
                    );
                }
                return Ok(());
            }
        }
        let raw = self.read(conn).await?;
        let now = now_secs();
        let (readable, stored_number) = match self.look(&raw, now) {
            Stored::Generation(g) => {
                let number = g.number;
                self.consider(g, now);
                (true, number)
            }
            Stored::Missing => (true, 0),
            Stored::Unreadable(_) => (false, 0),
        };
        let held_number = self.held.as_ref().map_or(0, |h| h.number);
        if self.rotation_due(now) {
            // Numbers only go up, past anything seen; keys are carried over only from a
            // generation that may still be used.
            let number = stored_number.max(held_number).saturating_add(1);
            let next = match self.fresh_held(now) {
                Some(h) => h.rotated(number, now),
                None => Generation::fresh(number, now),
            };
            if self.write(conn, &raw, &self.sealer.seal(&next)).await? {
                self.stats.rotations.fetch_add(1, Relaxed);
                tracing::info!(
                    "ticket store {}: rotated the fleet's ticket keys to generation {number}",
                    self.store
                );
                if !readable {
                    self.repaired(number);
                }
                self.install(next);
            }
        } else if !readable {
            let Some(h) = self.fresh_held(now) else {
                return Ok(());
            };
            let (sealed, number) = (self.sealer.seal(h), h.number);
            if self.write(conn, &raw, &sealed).await? {
                self.repaired(number);
            }
        }
        Ok(())
    }

    /// Counts and tells that a value that did not open was replaced with generation `number`.
    fn repaired(&mut self, number: u64) {
        self.stats.heals.fetch_add(1, Relaxed);
        if let Some(more) = self.warnings.repaired.pass() {
            tracing::warn!(
                "ticket store {}: replaced the value {}, which did not open, with generation {number}{}",
                self.store,
                self.key,
                and_more(more)
            );
        }
    }

    /// A value that does not open: counted, and logged (throttled).
    fn unreadable(&mut self, why: &str) {
        self.stats.errors.fetch_add(1, Relaxed);
        if let Some(more) = self.warnings.unreadable.pass() {
            tracing::warn!(
                "ticket store {}: the value {}: {why}: keeping the ticket keys held; the next server to hold the lease replaces it{}",
                self.store,
                self.key,
                and_more(more)
            );
        }
    }

    /// Writes `new` if the value is still `expected` (as read); whether it did.
    async fn write(
        &self,
        conn: &mut Conn,
        expected: &[u8],
        new: &[u8],
    ) -> Result<bool, StoreError> {
        let mut invocation = self.scripts.compare_and_set.key(&self.key);
        invocation.arg(expected).arg(new);
        Self::query::<i64>(conn, &invocation).await.map(|n| n == 1)
    }

    /// The rotation lease: one server at a time makes the next generation or repairs the
    /// value. It expires by itself, so a server that dies holding it delays the rotation by a
    /// moment only; one with no expiry or a longer one is cut to that moment.
    async fn take_lease(&self, conn: &mut Conn) -> Result<Lease, StoreError> {
        let mut invocation = self.scripts.take_lease.key(&self.lease);
        invocation.arg(&self.node).arg(self.lease_ms());
        Ok(match Self::query::<i64>(conn, &invocation).await? {
            1 => Lease::Taken,
            2 => Lease::Cut,
            _ => Lease::Held,
        })
    }

    fn install(&mut self, g: Generation) {
        self.ring.install(g.ticket_keys());
        self.stats.installs.fetch_add(1, Relaxed);
        self.stats.generation.store(g.number as i64, Relaxed);
        let name = &g.keys[g.keys.len().saturating_sub(2)][..4];
        tracing::info!(
            "ticket store {}: generation {} installed ({} keys, encrypting with the key named {:02x}{:02x}{:02x}{:02x}...)",
            self.store,
            g.number,
            g.keys.len(),
            name[0],
            name[1],
            name[2],
            name[3]
        );
        self.held = Some(g);
        self.local = None;
    }

    fn reached(&mut self) {
        self.stats.connected.store(1, Relaxed);
        if self.down.take().is_some() {
            tracing::info!("ticket store {}: reached again", self.store);
        }
    }

    fn failed(&mut self, why: String) {
        self.stats.errors.fetch_add(1, Relaxed);
        self.stats.connected.store(0, Relaxed);
        if self.down.is_none() {
            tracing::warn!(
                "ticket store {}: {why}: keeping the ticket keys held; trying again",
                self.store
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
        let g = Generation::fresh(1, 1000);
        assert_eq!((g.number, g.keys.len()), (1, 2));
        let g = g.rotated(2, 2000);
        let g = g.rotated(3, 3000);
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
        // The longest value a server writes is one the scripts read back whole.
        assert!(value.len() <= MAX_VALUE_LEN, "{}", value.len());
        assert!(current().contains(&format!("if #v > {MAX_VALUE_LEN} then")));
    }

    #[test]
    fn a_rotation_keeps_the_newest_three_keys() {
        let g1 = Generation::fresh(1, 0);
        let g2 = g1.rotated(2, 10);
        let g3 = g2.rotated(3, 20);
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
        // TLS, and the certificate always checked.
        assert!("rediss://fleet@10.0.0.1:6380/2".parse::<StoreUrl>().is_ok());
        let insecure = "rediss://10.0.0.1:6380#insecure".parse::<StoreUrl>();
        assert!(insecure.unwrap_err().contains("always checked"));
    }

    #[test]
    fn a_store_url_is_shown_without_its_password() {
        let url: StoreUrl = "rediss://fleet:s3cret@10.0.0.1:6380/2".parse().unwrap();
        assert_eq!(url.to_string(), "rediss://fleet:***@10.0.0.1:6380/2");
        assert!(!format!("{url:?}").contains("s3cret"));
        let err = "rediss://fleet:s3cret@10.0.0.1:6380#x"
            .parse::<StoreUrl>()
            .unwrap_err();
        assert!(!err.contains("s3cret"), "{err}");
        // Nothing to hide: shown as written.
        for plain in ["redis://fleet@h:1", "redis://h:1/0", "unix:///run/r.sock"] {
            assert_eq!(without_password(plain), plain);
        }
        assert_eq!(without_password("redis://:pw@h:1"), "redis://:***@h:1");
    }

    /// A follower of a store it never reaches: what it decides, without Redis.
    fn follower(period: u64, max_age: u64) -> Follower {
        let store = Store::plain("redis://127.0.0.1:1");
        let own = Generation::fresh(0, 0);
        Follower {
            store,
            sealer: Sealer::new(&[7u8; 32], "t"),
            key: "t:ticket-keys".into(),
            lease: "t:ticket-keys:lease".into(),
            node: "n".into(),
            period,
            max_age,
            ring: TicketKeyRing::with_lifetime(own.ticket_keys(), period as u32),
            held: None,
            local: Some(own),
            stats: Arc::default(),
            down: None,
            scripts: Scripts::default(),
            warnings: Warnings::default(),
        }
    }

    #[test]
    fn the_stores_keys_are_dropped_past_the_maximum_age_whatever_the_store_does() {
        let mut f = follower(10, 20);
        let g = Generation::fresh(4, 1000);
        let name = g.ticket_keys().current_name();
        f.install(g);
        assert_eq!(f.ring.keys().current_name(), name);
        assert!(!f.rotation_due(1009));
        assert!(f.rotation_due(1010));
        // Frozen: no newer generation comes; the keys are used until the maximum age only.
        f.age(1019);
        assert_eq!(f.ring.keys().current_name(), name);
        f.age(1020);
        assert_ne!(f.ring.keys().current_name(), name);
        assert_eq!(f.stats.expired.load(Relaxed), 1);
        assert_eq!(f.stats.generation.load(Relaxed), 0);
        assert!(f.rotation_due(1020));
        // Its own keys rotate every period meanwhile.
        let own = f.ring.keys().current_name();
        f.age(1029);
        assert_eq!(f.ring.keys().current_name(), own);
        f.age(1030);
        assert_ne!(f.ring.keys().current_name(), own);
        assert_eq!(f.stats.expired.load(Relaxed), 1);
        // The aged-out generation, read again (a frozen or replayed value), is not installed.
        let again = f.look(
            &f.sealer.seal(&f.held.as_ref().unwrap().rotated(4, 1000)),
            1031,
        );
        let Stored::Generation(again) = again else {
            panic!("opens")
        };
        assert!(!f.takes(&again, 1031));
    }

    #[test]
    fn generations_only_move_forward() {
        let mut f = follower(10, 20);
        let g5 = Generation::fresh(5, 1000);
        let (older, same) = (g5.rotated(4, 995), g5.rotated(5, 1000));
        let same_keys = Generation {
            number: 5,
            rotated_at: 1001,
            keys: g5.keys.clone(),
        };
        f.install(g5);
        assert!(!f.takes(&older, 1001), "an older generation");
        assert!(!f.takes(&same_keys, 1001), "the same one, sealed again");
        // Two servers that rotated from a value they could not read: the store's wins.
        assert!(f.takes(&same, 1001));
        assert!(f.takes(&Generation::fresh(6, 1001), 1001));
        assert!(
            !f.takes(&Generation::fresh(6, 900), 1001),
            "newer, but past the maximum age (a value replayed to a new server)"
        );
        // A time ahead of the server's clock counts as now.
        let ahead = f.sealer.seal(&Generation::fresh(7, 5000));
        let Stored::Generation(ahead) = f.look(&ahead, 1001) else {
            panic!("opens")
        };
        assert_eq!(ahead.rotated_at, 1001);
        assert!(matches!(f.look(b"", 1001), Stored::Missing));
        assert!(matches!(f.look(b"type:list", 1001), Stored::Unreadable(_)));
    }
}
