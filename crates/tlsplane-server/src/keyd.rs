//! `tlsplane keyd`: the key daemon. It alone reads the private keys; serving processes ask it
//! for signatures over a Unix socket (protocol and client: `tlsplane::keyd`).
//!
//! Started by `serve` (the default), it reads its token from stdin, drops its keys and exits
//! when stdin closes (the server stops or is gone) or on SIGTERM, and is killed if the server
//! dies (`PR_SET_PDEATHSIG`, SIGKILL, which also ends a stopped daemon). Started by hand
//! (`--keyd unix:PATH` on the server), it writes its token to `PATH.token` (mode 0600). Either
//! way it is non-dumpable (`PR_SET_DUMPABLE 0`: no core file, no ptrace or /proc/PID/mem by
//! other processes of its user), opens no network socket unless told to (`--listen-tls`), and
//! drops (zeroizes) its keys before it exits. SIGUSR1 makes it say on stderr how many
//! signatures it made and their mean cost, what it refused, and each TLS client's signatures
//! and refusals.
//!
//! Started by hand with `--listen-tls HOST:PORT`, it also (or only) serves servers on other
//! hosts (`serve --keyd tls://HOST:PORT`) over TCP and TLS 1.3: only clients whose certificate
//! `--client-ca` issued, each only with the keys `--authorize` grants the names in its
//! certificate, the same requests framed by their length (`tlsplane::keyd::tls`), one thread
//! per connection, never a HANDOFF, RELOAD or COMMIT (see [`remote`], [`grants`]). Started by
//! hand, SIGHUP makes it re-read its key files.
//!
//! `serve` keeps a spare daemon started with `--copy-from SOCKET`: it takes the keys of the
//! daemon in use over that daemon's socket (HANDOFF) instead of reading any file, so that it
//! can stand in with exactly the keys in force whatever the files hold by then (see
//! `crate::keys`). A daemon hands its keys only to a process of its own user whose parent is
//! its own parent and that is a key daemon started with `--copy-from`.

use std::collections::{HashMap, HashSet};
use std::ffi::OsString;
use std::io::{BufRead, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, RwLock};

use clap::Args;
use rustls::sign::SigningKey;
use socket2::{Domain, SockAddr, Socket, Type};
use tlsplane::keyd::{self as proto, op, TOKEN_LEN};

mod counters;
mod grants;
mod remote;

use counters::{counters, more, LogLimit};

#[derive(Args, Debug)]
pub struct KeydArgs {
    /// Unix socket to listen on (created with mode 0600, in a directory that no one but its
    /// owner, this daemon's user or root, may write).
    #[arg(long, value_name = "PATH", required_unless_present = "listen_tls")]
    pub socket: Option<PathBuf>,
    /// Also (or only) listen on TCP at HOST:PORT with TLS, for servers on other hosts
    /// (`serve --keyd tls://HOST:PORT`): only clients with a certificate issued by --client-ca
    /// are served. Port 0 picks a free port (the "listening" line says which).
    #[arg(
        long,
        value_name = "HOST:PORT",
        requires_all = ["tls_cert", "tls_key", "client_ca"]
    )]
    pub listen_tls: Option<String>,
    /// The daemon's certificate chain for --listen-tls (PEM); servers check it against their
    /// --keyd-ca.
    #[arg(long, value_name = "PEM", requires = "listen_tls")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, value_name = "PEM", requires = "listen_tls")]
    pub tls_key: Option<PathBuf>,
    /// The CA whose client certificates --listen-tls accepts (PEM; one or more certificates):
    /// a client certificate is what authenticates a server there.
    #[arg(long, value_name = "PEM", requires = "listen_tls")]
    pub client_ca: Option<PathBuf>,
    /// Which keys a client over TLS may use (repeatable; needed with --listen-tls):
    /// CLIENT=KEY[,KEY...]. CLIENT is a name in the client certificate's subjectAltName (DNS
    /// name, URI or IP address), or * for any; each KEY a key file as this daemon loads it
    /// (its --key, or the path its --config names), site:NAME for every key of the
    /// configuration's sites with that server name (or name), or * for every key. A client
    /// may use what the rules naming it grant, nothing else.
    #[arg(long, value_name = "CLIENT=KEYS", requires = "listen_tls")]
    pub authorize: Vec<grants::Rule>,
    /// Signatures a second one client over TLS may have (a burst of one second's worth); more
    /// are refused and counted. 0: no limit.
    #[arg(long, value_name = "N", default_value_t = 0, requires = "listen_tls")]
    pub client_sign_rate: u32,
    /// Seconds from the accept within which a client over TLS must complete its handshake.
    #[arg(long, value_name = "S", default_value_t = 10.0, value_parser = parse_seconds)]
    pub tls_handshake_timeout: f64,
    /// Seconds from the accept during which a TLS handshake gives way (--max-tls-handshakes)
    /// only to a new connection from a host that holds an established one, or for its
    /// address having more handshakes than the new one's would.
    #[arg(long, value_name = "S", default_value_t = 2.0, value_parser = parse_seconds)]
    pub tls_handshake_grace: f64,
    /// TLS handshakes in progress at once. Past it a new connection takes the place of one:
    /// if its host holds an established connection, any one of a host that holds none; else
    /// one of the address with the most, if it has more than the new one's would; else one
    /// older than --tls-handshake-grace; else it is closed.
    #[arg(long, value_name = "N", default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_tls_handshakes: u32,
    /// Established TLS connections at once (each a thread); more are closed.
    #[arg(long, value_name = "N", default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_tls_connections: u32,
    /// Established TLS connections of one client (its name in counts: the CLIENT of the
    /// --authorize rule that names it, or its certificate's first name) at once; more are
    /// closed.
    #[arg(long, value_name = "N", default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_tls_connections_per_client: u32,
    /// Seconds an established TLS connection may go without a request; then it is closed (a
    /// server opens another when it needs one).
    #[arg(long, value_name = "S", default_value_t = 600.0, value_parser = parse_seconds)]
    pub tls_idle_timeout: f64,
    /// TLS connections, handshakes included, from one address at once; more are closed at
    /// the accept.
    #[arg(long, value_name = "N", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_tls_connections_per_address: u32,
    /// An IPv6 peer's "address" for --max-tls-connections-per-address and
    /// --max-tls-handshakes: its first BITS bits (an IPv4 peer's is its address).
    #[arg(long, value_name = "BITS", default_value_t = 64, value_parser = clap::value_parser!(u8).range(1..=128))]
    pub tls_ipv6_prefix: u8,
    /// Configuration file: the daemon loads every key its [[site.cert]] entries name.
    #[arg(long, value_name = "FILE", conflicts_with = "key")]
    pub config: Option<PathBuf>,
    /// A key file to load (repeatable), instead of --config.
    #[arg(long, value_name = "PEM")]
    pub key: Vec<PathBuf>,
    /// User id allowed to connect besides this daemon's own user and root (repeatable).
    #[arg(long, value_name = "UID")]
    pub allow_uid: Vec<u32>,
    /// Started by `serve` (its pid): the token comes on stdin, and the daemon exits with it.
    #[arg(long, hide = true, requires = "socket")]
    pub parent: Option<u32>,
    /// The socket's mode, octal: 666 when it serves a server of another user (`serve --user`;
    /// then its directory is root's and the peer's uid and the token decide).
    #[arg(long, hide = true, default_value = "600", value_parser = parse_mode)]
    pub socket_mode: u32,
    /// Started by `serve` (or its launcher) to stand in for the daemon at this socket: takes
    /// that daemon's keys, handles and generations from it (HANDOFF) instead of reading any
    /// file; later RELOADs read the files as usual.
    #[arg(long, hide = true, value_name = "SOCKET", requires = "parent")]
    pub copy_from: Option<PathBuf>,
}

/// What the daemon loads keys from, again on each RELOAD.
enum Source {
    Config(PathBuf),
    Keys(Vec<PathBuf>),
}

/// Key files by site: each name of a site, and the key files of its certificates.
type SiteKeys = HashMap<String, HashSet<PathBuf>>;

/// The names of the sites whose certificates name the key file `path`.
fn sites_of(sites: &SiteKeys, path: &Path) -> HashSet<String> {
    sites
        .iter()
        .filter(|(_, keys)| keys.contains(path))
        .map(|(name, _)| name.clone())
        .collect()
}

impl Source {
    /// The key files it names, and which belong to each site.
    fn list(&self) -> Result<(Vec<PathBuf>, SiteKeys), String> {
        match self {
            Source::Keys(k) => Ok((k.clone(), SiteKeys::new())),
            Source::Config(path) => {
                let file = crate::config::ConfigFile::read(path)?;
                let mut sites = SiteKeys::new();
                for (names, keys) in file.site_keys() {
                    for n in names {
                        sites
                            .entry(n.to_ascii_lowercase())
                            .or_default()
                            .extend(keys.iter().cloned());
                    }
                }
                Ok((file.key_paths(), sites))
            }
        }
    }
}

/// Keys by handle, in generations. A RELOAD loads every key file again as a new generation:
/// a key that did not change (same file, same public key) keeps its handle, a new one gets a
/// new handle, a file that fails is remembered with its reason (KEY answers with it). Nothing
/// is dropped then: the server may still refuse the new configuration and keep signing with
/// the keys it has. Only when the server commits a generation are keys dropped, those used by
/// neither it nor the generation committed before it (handshakes begun under that one may
/// still be signing).
///
/// Generations only grow, and never wrap: a commit names one that was made and is not older
/// than the one in force, so that no request can make the daemon drop keys in use, nor stop
/// it dropping replaced ones (a commit of a generation past the latest would have done both).
#[derive(Default)]
struct Store {
    keys: HashMap<u32, Held>,
    /// The latest generation's files: handle, or why it could not be loaded.
    by_path: HashMap<PathBuf, Result<u32, String>>,
    /// The latest generation's sites, for `--authorize ...=site:NAME`.
    sites: SiteKeys,
    generation: u32,
    committed: u32,
    committed_before: u32,
    next_handle: u32,
}

struct Held {
    key: Arc<dyn SigningKey>,
    /// The key's encoding, for a HANDOFF (zeroized when dropped).
    der: tlsplane::cert::KeyDer,
    path: PathBuf,
    public_key: Vec<u8>,
    /// The latest generation that has it.
    generation: u32,
    /// The sites it was loaded for in that generation, for `--authorize ...=site:NAME`: a
    /// reload that gives its file to another site, with another key in it, leaves this key to
    /// the sites it was the key of.
    sites: HashSet<String>,
}

impl Store {
    /// Loads every key of `source` as a new generation; its number and how many keys loaded.
    fn load(&mut self, source: &Source) -> Result<(u32, u32), String> {
        let (paths, sites) = source.list()?;
        let g = self.generation.checked_add(1).ok_or(
            "no generation number left (one per reload, 2^32 of them): restart the daemon",
        )?;
        let first_handle = self.next_handle;
        let mut by_path = HashMap::new();
        let mut loaded = 0;
        for p in paths {
            let result = match tlsplane::cert::load_key_der(&p) {
                Ok((key, der)) => {
                    loaded += 1;
                    let public_key = key
                        .public_key()
                        .map(|k| k.as_ref().to_vec())
                        .unwrap_or_default();
                    let same = self
                        .keys
                        .iter_mut()
                        .find(|(_, h)| h.path == p && h.public_key == public_key);
                    let key_sites = sites_of(&sites, &p);
                    match same {
                        Some((&handle, held)) => {
                            held.generation = g;
                            held.sites = key_sites;
                            Ok(handle)
                        }
                        None => {
                            let Some(handle) = self.next_handle.checked_add(1) else {
                                // What this generation loaded so far is not in force.
                                self.keys.retain(|h, _| *h <= first_handle);
                                self.next_handle = first_handle;
                                return Err("no key handle left: restart the daemon".into());
                            };
                            self.next_handle = handle;
                            self.keys.insert(
                                self.next_handle,
                                Held {
                                    key,
                                    der,
                                    path: p.clone(),
                                    public_key,
                                    generation: g,
                                    sites: key_sites,
                                },
                            );
                            Ok(self.next_handle)
                        }
                    }
                }
                Err(tlsplane::Error::Config(why)) => Err(why),
                Err(e) => Err(e.to_string()),
            };
            by_path.insert(p, result);
        }
        self.by_path = by_path;
        self.sites = sites;
        self.generation = g;
        Ok((g, loaded))
    }

    /// Generation `g` is in force in the server: keys neither it nor the generation committed
    /// before it has are dropped. The one in force again is nothing to do; one older than it,
    /// or one never made, is refused.
    fn commit(&mut self, g: u32) -> Result<(), String> {
        if g == self.committed {
            return Ok(());
        }
        if g < self.committed || g > self.generation {
            return Err(format!(
                "generation {g} cannot be committed: {} is in force and {} is the latest",
                self.committed, self.generation
            ));
        }
        self.committed_before = self.committed;
        self.committed = g;
        let keep_from = self.committed_before;
        self.keys.retain(|_, h| h.generation >= keep_from);
        Ok(())
    }
}

/// The longest HANDOFF message: one key's path and encoding (an RSA-8192 PKCS#8 key is about
/// 4.8 KB; a path at most 4 KB).
const MAX_HANDOFF_MESSAGE: usize = 64 * 1024;

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u32).to_be_bytes());
    out.extend_from_slice(b);
}

/// Reads a HANDOFF message's fields in order.
struct Fields<'a>(&'a [u8]);

impl<'a> Fields<'a> {
    fn u8(&mut self) -> Result<u8, String> {
        let (&b, rest) = self.0.split_first().ok_or("short HANDOFF message")?;
        self.0 = rest;
        Ok(b)
    }
    fn u32(&mut self) -> Result<u32, String> {
        let b = self.0.get(..4).ok_or("short HANDOFF message")?;
        let v = u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
        self.0 = &self.0[4..];
        Ok(v)
    }
    fn bytes(&mut self) -> Result<&'a [u8], String> {
        let n = self.u32()? as usize;
        let b = self.0.get(..n).ok_or("short HANDOFF message")?;
        self.0 = &self.0[n..];
        Ok(b)
    }
    fn path(&mut self) -> Result<PathBuf, String> {
        Ok(PathBuf::from(std::ffi::OsStr::from_bytes(self.bytes()?)))
    }
}

impl Store {
    /// The store as HANDOFF sends it: a header (the generation counters, how many keys and
    /// paths follow), one message per key (its encoding included), one per key file of the
    /// latest generation (its handle or why it failed). Zeroized when dropped.
    fn handoff_messages(&self) -> Vec<zeroize::Zeroizing<Vec<u8>>> {
        let mut header = vec![proto::OK];
        for n in [
            self.generation,
            self.committed,
            self.committed_before,
            self.next_handle,
            self.keys.len() as u32,
            self.by_path.len() as u32,
        ] {
            header.extend_from_slice(&n.to_be_bytes());
        }
        let mut out = vec![zeroize::Zeroizing::new(header)];
        for (handle, held) in &self.keys {
            let mut m = zeroize::Zeroizing::new(Vec::with_capacity(64 + held.der.der.len()));
            m.extend_from_slice(&handle.to_be_bytes());
            m.extend_from_slice(&held.generation.to_be_bytes());
            m.push(held.der.format);
            put_bytes(&mut m, held.path.as_os_str().as_bytes());
            put_bytes(&mut m, &held.der.der);
            // Last, so that a daemon that does not know it reads the rest as before.
            m.extend_from_slice(&(held.sites.len() as u32).to_be_bytes());
            for site in &held.sites {
                put_bytes(&mut m, site.as_bytes());
            }
            out.push(m);
        }
        for (path, r) in &self.by_path {
            let mut m = Vec::new();
            put_bytes(&mut m, path.as_os_str().as_bytes());
            match r {
                Ok(h) => {
                    m.push(0);
                    m.extend_from_slice(&h.to_be_bytes());
                }
                Err(why) => {
                    m.push(1);
                    m.extend_from_slice(why.as_bytes());
                }
            }
            out.push(zeroize::Zeroizing::new(m));
        }
        out
    }

    /// The store a HANDOFF's messages describe; `next` gives each message in turn.
    fn from_handoff(
        mut next: impl FnMut() -> Result<zeroize::Zeroizing<Vec<u8>>, String>,
    ) -> Result<Store, String> {
        let header = next()?;
        let mut f = Fields(&header);
        if f.u8()? != proto::OK {
            return Err(format!(
                "HANDOFF refused: {}",
                String::from_utf8_lossy(&header[1..])
            ));
        }
        let mut store = Store {
            generation: f.u32()?,
            committed: f.u32()?,
            committed_before: f.u32()?,
            next_handle: f.u32()?,
            ..Store::default()
        };
        if !(store.committed_before <= store.committed && store.committed <= store.generation) {
            return Err("generations out of order".into());
        }
        let (keys, paths) = (f.u32()?, f.u32()?);
        for _ in 0..keys {
            let m = next()?;
            let mut f = Fields(&m);
            let (handle, generation, format) = (f.u32()?, f.u32()?, f.u8()?);
            let path = f.path()?;
            let der = tlsplane::cert::KeyDer {
                format,
                der: zeroize::Zeroizing::new(f.bytes()?.to_vec()),
            };
            let key = tlsplane::cert::key_from_der(&der)
                .map_err(|e| format!("{}: a key handed over: {e}", path.display()))?;
            let public_key = key
                .public_key()
                .map(|k| k.as_ref().to_vec())
                .unwrap_or_default();
            let mut sites = HashSet::new();
            if !f.0.is_empty() {
                for _ in 0..f.u32()? {
                    sites.insert(String::from_utf8_lossy(f.bytes()?).into_owned());
                }
            }
            if generation == store.generation {
                for site in &sites {
                    store
                        .sites
                        .entry(site.clone())
                        .or_default()
                        .insert(path.clone());
                }
            }
            store.keys.insert(
                handle,
                Held {
                    key,
                    der,
                    path,
                    public_key,
                    generation,
                    sites,
                },
            );
        }
        for _ in 0..paths {
            let m = next()?;
            let mut f = Fields(&m);
            let path = f.path()?;
            let r = match f.u8()? {
                0 => Ok(f.u32()?),
                _ => Err(String::from_utf8_lossy(f.0).into_owned()),
            };
            store.by_path.insert(path, r);
        }
        Ok(store)
    }
}

/// Takes the keys of the daemon at `socket` (started by the same server): the predecessor
/// this one stands in for.
fn copy_from(socket: &Path, token: &[u8; TOKEN_LEN]) -> anyhow::Result<Store> {
    let sock = Socket::new(Domain::UNIX, Type::SEQPACKET.cloexec(), None)?;
    let wait = Some(std::time::Duration::from_secs(10));
    sock.set_read_timeout(wait)?;
    sock.set_write_timeout(wait)?;
    sock.connect(&SockAddr::unix(socket)?)?;
    {
        use std::os::fd::AsFd;
        // The daemon it stands in for runs as this one does: no token to anyone else.
        let uid = tlsplane_sys::peer_uid(sock.as_fd())?;
        if uid != tlsplane_sys::current_uid() {
            anyhow::bail!(
                "{} is listened on by user id {uid}, not this daemon's: no token sent",
                socket.display()
            );
        }
    }
    let mut hello = zeroize::Zeroizing::new(vec![op::HELLO]);
    hello.extend_from_slice(token);
    sock.send(&hello)?;
    let mut buf = zeroize::Zeroizing::new(vec![0u8; MAX_HANDOFF_MESSAGE]);
    let mut recv = || -> Result<zeroize::Zeroizing<Vec<u8>>, String> {
        loop {
            match (&sock).read(&mut buf) {
                Ok(0) => return Err("the daemon closed the connection".into()),
                Ok(n) => return Ok(zeroize::Zeroizing::new(buf[..n].to_vec())),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e.to_string()),
            }
        }
    };
    if recv().map_err(anyhow::Error::msg)?.first() != Some(&proto::OK) {
        anyhow::bail!("the daemon at {} refused our token", socket.display());
    }
    sock.send(&[op::HANDOFF])?;
    Store::from_handoff(recv)
        .map_err(|e| anyhow::anyhow!("taking the keys of {}: {e}", socket.display()))
}

/// Whether the process at the other end of `sock` may have this daemon's keys: only a key
/// daemon started by the same parent (the server, or its launcher), as the same user, to stand
/// in for this one. With `serve --user` the user is the boundary: the daemons are root's and
/// the server (which started none of them, its launcher did) is not. Without it the server and
/// its daemons share a user, who can read the key files anyway; the checks then keep out
/// anything that is not such a daemon by mistake. A daemon started by hand hands over nothing.
fn may_take_over(sock: &Socket, parent: Option<u32>) -> Result<(), String> {
    use std::os::fd::AsFd;
    let parent = parent.ok_or("this daemon was started by hand")?;
    let (pid, uid) =
        tlsplane_sys::peer_cred(sock.as_fd()).map_err(|e| format!("SO_PEERCRED: {e}"))?;
    if uid != tlsplane_sys::current_uid() {
        return Err(format!("user id {uid} is not this daemon's"));
    }
    if pid == parent || parent_pid(pid) != Some(parent) {
        return Err(format!("pid {pid} is not a daemon started by pid {parent}"));
    }
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
    if args.get(1) != Some(&&b"keyd"[..]) || !args.contains(&&b"--copy-from"[..]) {
        return Err(format!(
            "pid {pid} is not a key daemon standing in for this one"
        ));
    }
    Ok(())
}

fn parent_pid(pid: u32) -> Option<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()?
        .rsplit_once(')')
        .and_then(|(_, r)| r.split_whitespace().nth(1))
        .and_then(|p| p.parse().ok())
}

pub fn run(args: KeydArgs) -> anyhow::Result<()> {
    tlsplane_sys::set_non_dumpable()?;
    if let Some(parent) = args.parent {
        // SIGKILL, not SIGTERM: it also ends a daemon that is stopped. An orderly exit, with
        // the keys dropped first, is when the server closes our stdin (or sends SIGTERM).
        tlsplane_sys::die_with_parent(libc::SIGKILL, parent)?;
    }
    let source = match &args.config {
        Some(c) => Source::Config(c.clone()),
        None if !args.key.is_empty() => Source::Keys(args.key.clone()),
        None => anyhow::bail!("keyd needs --config FILE or --key PEM"),
    };
    if args.listen_tls.is_some() && args.authorize.is_empty() {
        anyhow::bail!(
            "--listen-tls needs --authorize CLIENT=KEYS: which client certificates may use \
             which keys (--authorize '*=*' lets every client of --client-ca use every key)"
        );
    }
    if let Some(socket) = &args.socket {
        // Before the token file is written beside it.
        crate::unix_socket::check_dir("--socket", socket)?;
    }
    let mut token = zeroize::Zeroizing::new([0u8; TOKEN_LEN]);
    if args.parent.is_some() {
        let mut line = zeroize::Zeroizing::new(String::new());
        std::io::stdin().lock().read_line(&mut line)?;
        decode_hex(line.trim(), &mut token)
            .ok_or_else(|| anyhow::anyhow!("keyd: no token on stdin"))?;
    } else {
        rustls::crypto::aws_lc_rs::default_provider()
            .secure_random
            .fill(token.as_mut())
            .map_err(|_| anyhow::anyhow!("no random token"))?;
        if let Some(socket) = &args.socket {
            write_token_file(&token_path(socket), &token)?;
        }
    }
    let (store, loaded) = match &args.copy_from {
        Some(from) => {
            let store = copy_from(from, &token)?;
            let n = format!(
                "{} keys taken over from {}",
                store.keys.len(),
                from.display()
            );
            (store, n)
        }
        None => {
            let mut s = Store::default();
            let (first, n) = s.load(&source).map_err(anyhow::Error::msg)?;
            s.commit(first).map_err(anyhow::Error::msg)?;
            for (p, r) in &s.by_path {
                if let Err(why) = r {
                    // The server reports it too, with the site it belongs to.
                    tracing::debug!(path = %p.display(), "keyd: {why}");
                }
            }
            (s, format!("{n} keys loaded"))
        }
    };
    warn_unknown_grants(&args.authorize, &store);
    let store = Arc::new(RwLock::new(store));

    let tls = match &args.listen_tls {
        Some(addr) => Some(tls_listener(&args, addr)?),
        None => None,
    };
    let listener = match &args.socket {
        Some(socket) => Some(crate::unix_socket::bind_as(
            "--socket",
            socket,
            args.socket_mode,
            Type::SEQPACKET,
        )?),
        None => None,
    };
    let mut allowed = vec![tlsplane_sys::current_uid(), 0];
    allowed.extend(&args.allow_uid);

    // Exit paths: the parent closes our stdin (it exited), or SIGTERM/SIGINT.
    let socket_path = args.socket.clone();
    let exit = {
        let store = store.clone();
        move |why: &str| {
            // Drop every key (aws-lc clears key memory as it frees it).
            *store.write().unwrap_or_else(|e| e.into_inner()) = Store::default();
            if let Some(socket) = &socket_path {
                let _ = std::fs::remove_file(socket);
            }
            tracing::debug!("keyd exits: {why}");
            std::process::exit(0);
        }
    };
    if args.parent.is_some() {
        let exit = exit.clone();
        std::thread::spawn(move || {
            let mut sink = [0u8; 64];
            while matches!(std::io::stdin().read(&mut sink), Ok(n) if n > 0) {}
            exit("the server is gone");
        });
    }
    // Handlers before the "listening" line: a signal sent as soon as the daemon is up must
    // not meet the default action (which for SIGUSR1 is to die).
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    // SIGHUP reloads a daemon started by hand only: one started by a server reloads when
    // that server says so, and keeps the default action (a terminal's hangup ends it).
    let by_hand = args.parent.is_none();
    let (mut term, mut int, mut usr1, mut hup) = rt.block_on(async {
        use tokio::signal::unix::{signal, SignalKind};
        anyhow::Ok((
            signal(SignalKind::terminate())?,
            signal(SignalKind::interrupt())?,
            signal(SignalKind::user_defined1())?,
            if by_hand {
                Some(signal(SignalKind::hangup())?)
            } else {
                None
            },
        ))
    })?;
    let source = Arc::new(source);
    let clients = Arc::new(grants::Clients::default());
    {
        let (store, source, clients) = (store.clone(), source.clone(), clients.clone());
        let rules = args.authorize.clone();
        std::thread::spawn(move || {
            let why = rt.block_on(async {
                loop {
                    let hangup = async {
                        match hup.as_mut() {
                            Some(h) => h.recv().await,
                            None => std::future::pending().await,
                        }
                    };
                    tokio::select! {
                        _ = term.recv() => break "SIGTERM",
                        _ = int.recv() => break "SIGINT",
                        _ = usr1.recv() => report(&clients),
                        _ = hangup => reload_by_hand(&store, &source, &rules),
                    }
                }
            });
            exit(why);
        });
    }
    let mut listening = Vec::new();
    if let Some(socket) = &args.socket {
        listening.push(socket.display().to_string());
    }
    if let Some((listener, config)) = tls {
        listening.push(format!("tls://{}", listener.local_addr()?));
        let shared = Arc::new(remote::Shared {
            config,
            store: store.clone(),
            source: source.clone(),
            rules: args.authorize.clone(),
            clients,
            sign_rate: args.client_sign_rate,
            limits: remote::Limits {
                handshake_timeout: std::time::Duration::from_secs_f64(args.tls_handshake_timeout),
                handshake_grace: std::time::Duration::from_secs_f64(args.tls_handshake_grace),
                max_handshakes: args.max_tls_handshakes as usize,
                max_connections: args.max_tls_connections as usize,
                max_per_address: args.max_tls_connections_per_address as usize,
                max_per_client: args.max_tls_connections_per_client as usize,
                ipv6_prefix: args.tls_ipv6_prefix,
                idle_timeout: std::time::Duration::from_secs_f64(args.tls_idle_timeout),
            },
        });
        std::thread::Builder::new()
            .name("keyd-tls".into())
            .spawn(move || remote::serve(listener, shared))?;
    }
    tracing::info!("keyd: {loaded}; listening on {}", listening.join(" and "));
    let Some(listener) = listener else {
        // Only TCP: its thread serves, and a signal or the end of stdin ends the process.
        loop {
            std::thread::park();
        }
    };
    let token = Arc::new(token);
    loop {
        let (conn, _) = match listener.accept() {
            Ok(c) => c,
            Err(e) => {
                static LOG: LogLimit = LogLimit::new();
                if let Some(n) = LOG.allow() {
                    tracing::warn!(error = %e, "keyd: accept failed{}", more(n));
                }
                std::thread::sleep(std::time::Duration::from_millis(50));
                continue;
            }
        };
        let (store, source, token, allowed) = (
            store.clone(),
            source.clone(),
            token.clone(),
            allowed.clone(),
        );
        let parent = args.parent;
        std::thread::spawn(move || serve_conn(conn, &store, &source, &token, &allowed, parent));
    }
}

fn serve_conn(
    sock: Socket,
    store: &RwLock<Store>,
    source: &Source,
    token: &[u8; TOKEN_LEN],
    allowed: &[u32],
    parent: Option<u32>,
) {
    if let Err(why) = proto::check_hello(&sock, token, allowed) {
        static LOG: LogLimit = LogLimit::new();
        counters().unix_refused.fetch_add(1, Relaxed);
        if let Some(n) = LOG.allow() {
            tracing::warn!("keyd: connection refused: {why}{}", more(n));
        }
        let _ = sock.send(&[proto::ERR]);
        return;
    }
    let mut buf = vec![0u8; proto::MAX_MESSAGE];
    // SIGUSR1 (the report) may land on this thread: an interrupted wait goes on.
    loop {
        let n = match (&sock).read(&mut buf) {
            Ok(0) => return,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => return,
        };
        if buf[..n] == [op::HANDOFF] {
            hand_off(&sock, store, parent);
            return;
        }
        let reply = match &buf[..n] {
            [op::PING] => vec![proto::OK],
            request => answer(request, store, source, &Caller::Local),
        };
        loop {
            match sock.send(&reply) {
                Ok(_) => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => return,
            }
        }
    }
}

/// Answers a HANDOFF: the whole store to a daemon that stands in for this one, or a refusal
/// (logged: nothing else asks).
fn hand_off(sock: &Socket, store: &RwLock<Store>, parent: Option<u32>) {
    if let Err(why) = may_take_over(sock, parent) {
        tracing::warn!("keyd: HANDOFF refused: {why}");
        let _ = sock.send(&err(format!("HANDOFF refused: {why}")));
        return;
    }
    let messages = store
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .handoff_messages();
    for m in &messages {
        if let Err(e) = sock.send(m) {
            tracing::warn!("keyd: HANDOFF cut short: {e}");
            return;
        }
    }
}

/// SIGUSR1: how many signatures the daemon made and what one cost inside the signing library
/// (its clock, not the server's), what it refused, and each TLS client's signatures and
/// refusals, on stderr. The server's own view of the same signatures, round trip included, is
/// its `keyd_signatures` / `keyd_wait_ns` counters.
fn report(clients: &grants::Clients) {
    let stats = tlsplane::stats::global();
    let (n, ns) = (
        stats.signatures.load(Relaxed),
        stats.signature_ns.load(Relaxed),
    );
    let mean_us = if n == 0 {
        0.0
    } else {
        ns as f64 / n as f64 / 1e3
    };
    let total_ms = ns as f64 / 1e6;
    tracing::info!("keyd: {n} signatures in {total_ms:.1} ms, {mean_us:.1} µs each in the signer");
    tracing::info!("keyd: refused: {}", counters().line());
    for (name, signatures, refused) in clients.counts() {
        tracing::info!("keyd: client {name:?}: signatures={signatures} refused={refused}");
    }
}

/// SIGHUP, on a daemon started by hand: the key files again, as a new generation, in force
/// at once; the keys of the generation before stay (servers still use them until they
/// reload), older ones that no file holds any more are dropped.
fn reload_by_hand(store: &RwLock<Store>, source: &Source, rules: &[grants::Rule]) {
    let mut s = lock_write(store);
    let loaded = s
        .load(source)
        .and_then(|(g, n)| s.commit(g).map(|()| (g, n)));
    match loaded {
        Ok((g, n)) => {
            let failed = s.by_path.values().filter(|r| r.is_err()).count();
            tracing::info!("keyd: reloaded (SIGHUP): generation {g}, {n} keys, {failed} failed");
            drop(s);
            warn_unknown_grants(rules, &store.read().unwrap_or_else(|e| e.into_inner()));
        }
        Err(why) => tracing::warn!("keyd: reload (SIGHUP) failed, the keys stay: {why}"),
    }
}

/// What `--authorize` names that the daemon did not load.
fn warn_unknown_grants(rules: &[grants::Rule], store: &Store) {
    let loaded = store.by_path.keys().cloned().collect();
    for why in grants::unknown_keys(rules, &loaded, &store.sites) {
        tracing::warn!("keyd: --authorize: {why}");
    }
}

/// `--listen-tls`'s socket and TLS configuration.
fn tls_listener(
    args: &KeydArgs,
    addr: &str,
) -> anyhow::Result<(std::net::TcpListener, Arc<rustls::ServerConfig>)> {
    let (Some(cert), Some(key), Some(ca)) = (&args.tls_cert, &args.tls_key, &args.client_ca) else {
        anyhow::bail!("--listen-tls needs --tls-cert, --tls-key and --client-ca");
    };
    let config = proto::tls::server_config(cert, key, ca).map_err(anyhow::Error::msg)?;
    // A descriptor per connection, up to the caps: the usual soft limit of 1024 is below them.
    if let Err(e) = tlsplane_sys::raise_nofile_limit() {
        tracing::warn!(error = %e, "keyd: could not raise the open-files limit");
    }
    let listener = listen_tcp(addr).map_err(|e| anyhow::anyhow!("--listen-tls {addr}: {e}"))?;
    Ok((listener, config))
}

/// Connections the kernel completes before the daemon accepts them. A burst of peers larger
/// than the queue has the kernel drop handshakes' last ACKs, and a server's connection then
/// waits for a SYN-ACK retransmitted after 1 s, 2 s, ... however fast the daemon refuses the
/// peers.
const TCP_LISTEN_BACKLOG: i32 = 4096;

fn listen_tcp(addr: &str) -> std::io::Result<std::net::TcpListener> {
    use std::net::ToSocketAddrs;
    let addr = addr
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, "no address"))?;
    let sock = Socket::new(Domain::for_address(addr), Type::STREAM.cloexec(), None)?;
    sock.set_reuse_address(true)?;
    sock.bind(&addr.into())?;
    sock.listen(TCP_LISTEN_BACKLOG)?;
    Ok(sock.into())
}

fn parse_seconds(s: &str) -> Result<f64, String> {
    s.parse::<f64>()
        .ok()
        .filter(|v| v.is_finite() && *v > 0.0 && *v <= 3600.0)
        .ok_or_else(|| format!("{s:?}: expected seconds, more than 0 and at most 3600"))
}

fn err(why: impl AsRef<str>) -> Vec<u8> {
    let mut r = vec![proto::ERR];
    r.extend_from_slice(why.as_ref().as_bytes());
    r
}

/// Who asks. A client on the Unix socket holds the token: it is the server this daemon
/// serves, and may do anything. A client over TLS may use the keys its certificate's grant
/// names, and never make the daemon reload, commit (drop keys) or hand its keys over: other
/// servers use the same keys.
enum Caller<'a> {
    Local,
    Remote {
        grant: &'a grants::Grant,
        client: &'a grants::Client,
        /// Signatures a second (0: no limit).
        sign_rate: u32,
    },
}

impl Caller<'_> {
    /// A refusal for a client over TLS: counted, and logged at most once a second.
    fn refuse(&self, why: String) -> Vec<u8> {
        self.log_refusal(&why);
        err(why)
    }

    /// Counts and logs (at most once a second) a refusal of a client over TLS.
    fn log_refusal(&self, why: &str) {
        if let Caller::Remote { grant, client, .. } = self {
            static LOG: LogLimit = LogLimit::new();
            client.refused.fetch_add(1, Relaxed);
            if let Some(n) = LOG.allow() {
                tracing::warn!("keyd: client {}: {why}{}", grant.client, more(n));
            }
        }
    }

    /// Why it may not use the key loaded from `path` for the sites `key_sites`, if it may not.
    fn may_not_use(&self, path: &Path, key_sites: &HashSet<String>) -> Option<String> {
        match self {
            Caller::Remote { grant, .. } if !grant.allows(path, key_sites) => Some(format!(
                "client {} may not use the key {} (see keyd --authorize)",
                grant.client,
                path.display()
            )),
            _ => None,
        }
    }
}

fn answer(req: &[u8], store: &RwLock<Store>, source: &Source, caller: &Caller<'_>) -> Vec<u8> {
    let Some((&code, payload)) = req.split_first() else {
        return err("empty request");
    };
    match (code, caller) {
        (op::RELOAD | op::COMMIT | op::HANDOFF, Caller::Remote { .. }) => {
            counters().tls_requests_refused.fetch_add(1, Relaxed);
            caller.refuse(
                "RELOAD, COMMIT and HANDOFF are not served over TLS: the daemon's host reloads \
                 it (SIGHUP)"
                    .into(),
            )
        }
        (op::SIGN, _) => sign(payload, store, caller),
        (op::KEY, _) => key(payload, store, caller),
        (op::RELOAD, _) => match lock_write(store).load(source) {
            Ok((generation, _)) => {
                let mut r = vec![proto::OK];
                r.extend_from_slice(&generation.to_be_bytes());
                r
            }
            Err(why) => err(why),
        },
        (op::COMMIT, _) => match payload {
            [a, b, c, d] => match lock_write(store).commit(u32::from_be_bytes([*a, *b, *c, *d])) {
                Ok(()) => vec![proto::OK],
                Err(why) => err(why),
            },
            _ => err("malformed COMMIT"),
        },
        _ => err("unknown request"),
    }
}

fn lock_write(store: &RwLock<Store>) -> std::sync::RwLockWriteGuard<'_, Store> {
    store.write().unwrap_or_else(|e| e.into_inner())
}

fn sign(payload: &[u8], store: &RwLock<Store>, caller: &Caller<'_>) -> Vec<u8> {
    let Some((handle, scheme, message)) = proto::parse_sign(payload) else {
        return err("malformed SIGN");
    };
    let no_key = || err(format!("no key {handle} for {scheme:?}"));
    let (key, refusal) = {
        let s = store.read().unwrap_or_else(|e| e.into_inner());
        match s.keys.get(&handle) {
            // Checked against the sites the key was loaded for, not those its file has now.
            Some(h) => (Some(h.key.clone()), caller.may_not_use(&h.path, &h.sites)),
            None => (None, None),
        }
    };
    if let Some(why) = refusal {
        // The daemon's log says why; the client is told what a handle never made tells it,
        // so that walking the handles tells it nothing of other sites' keys.
        counters().tls_requests_refused.fetch_add(1, Relaxed);
        caller.log_refusal(&why);
        return no_key();
    }
    let Some(signer) = key.and_then(|k| k.choose_scheme(&[scheme])) else {
        return no_key();
    };
    if let Caller::Remote {
        client, sign_rate, ..
    } = caller
    {
        if !client.take(*sign_rate) {
            counters().tls_signatures_over_rate.fetch_add(1, Relaxed);
            return caller.refuse(format!(
                "past {sign_rate} signatures a second (--client-sign-rate)"
            ));
        }
    }
    match signer.sign(message) {
        Ok(sig) => {
            if let Caller::Remote { client, .. } = caller {
                client.signatures.fetch_add(1, Relaxed);
            }
            let mut r = Vec::with_capacity(1 + sig.len());
            r.push(proto::OK);
            r.extend_from_slice(&sig);
            r
        }
        Err(e) => err(e.to_string()),
    }
}

fn key(payload: &[u8], store: &RwLock<Store>, caller: &Caller<'_>) -> Vec<u8> {
    let path = Path::new(std::ffi::OsStr::from_bytes(payload));
    let s = store.read().unwrap_or_else(|e| e.into_inner());
    if let Some(why) = caller.may_not_use(path, &sites_of(&s.sites, path)) {
        counters().tls_requests_refused.fetch_add(1, Relaxed);
        return caller.refuse(why);
    }
    match s.by_path.get(path) {
        Some(Ok(h)) => match s.keys.get(h) {
            Some(held) => proto::key_reply(*h, held.key.as_ref()),
            None => err("key dropped"),
        },
        Some(Err(why)) => err(why),
        None => err(format!(
            "{}: not a key this daemon loaded (its configuration names the keys)",
            path.display()
        )),
    }
}

/// Where a daemon started by hand writes its token: next to its socket.
fn parse_mode(s: &str) -> Result<u32, String> {
    u32::from_str_radix(s, 8)
        .ok()
        .filter(|m| *m <= 0o777)
        .ok_or_else(|| format!("{s:?} is not an octal file mode"))
}

pub fn token_path(socket: &Path) -> PathBuf {
    let mut p = socket.as_os_str().to_owned();
    p.push(".token");
    p.into()
}

fn write_token_file(path: &Path, token: &[u8; TOKEN_LEN]) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let _ = std::fs::remove_file(path);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    f.write_all(encode_hex(token).as_bytes())?;
    Ok(())
}

pub fn encode_hex(b: &[u8]) -> zeroize::Zeroizing<String> {
    zeroize::Zeroizing::new(b.iter().map(|x| format!("{x:02x}")).collect())
}

pub fn decode_hex(s: &str, out: &mut [u8; TOKEN_LEN]) -> Option<()> {
    if s.len() != 2 * TOKEN_LEN {
        return None;
    }
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(())
}

/// Starts `tlsplane keyd` listening on `socket` for the keys `daemon_args` name, a child of
/// this process (dying with it), with `extra` arguments, and hands it `token` on its stdin,
/// which it keeps open: the daemon exits when that closes.
pub fn start_daemon_process(
    socket: &Path,
    daemon_args: &[OsString],
    extra: &[OsString],
    token: &[u8; TOKEN_LEN],
) -> anyhow::Result<(Child, ChildStdin)> {
    let mut child = Command::new(std::env::current_exe()?)
        .arg("keyd")
        .arg("--socket")
        .arg(socket)
        .args(daemon_args)
        .arg("--parent")
        .arg(std::process::id().to_string())
        .args(extra)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .map_err(|e| anyhow::anyhow!("cannot start the key daemon: {e}"))?;
    let mut stdin = child.stdin.take().expect("piped stdin");
    stdin.write_all(encode_hex(token).as_bytes())?;
    stdin.write_all(b"\n")?;
    Ok((child, stdin))
}

/// A new directory for a daemon's socket (0700, or 0711 for a daemon that serves another
/// user), under $RUNTIME_DIRECTORY (systemd's), $XDG_RUNTIME_DIR or the temporary directory.
pub fn private_dir(mode: u32) -> anyhow::Result<PathBuf> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
    let base = std::env::var_os("RUNTIME_DIRECTORY")
        .and_then(|dirs| std::env::split_paths(&dirs).next())
        .or_else(|| std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from))
        .filter(|p| p.is_dir())
        .unwrap_or_else(std::env::temp_dir);
    let mut rnd = [0u8; 8];
    rustls::crypto::aws_lc_rs::default_provider()
        .secure_random
        .fill(&mut rnd)
        .map_err(|_| anyhow::anyhow!("no randomness"))?;
    let dir = base.join(format!(
        "tlsplane-keyd-{}-{}",
        std::process::id(),
        encode_hex(&rnd).as_str()
    ));
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&dir)
        .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", dir.display()))?;
    if mode != 0o700 {
        // After creation, as the umask would have masked the mode given to mkdir; on the
        // directory opened without following a symlink, not by its path, which may have been
        // replaced since (the base may be a shared /tmp).
        let opened = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
            .open(&dir)
            .map_err(|e| anyhow::anyhow!("cannot open {}: {e}", dir.display()))?;
        if opened.metadata()?.uid() != tlsplane_sys::current_uid() {
            anyhow::bail!("{} is not the directory this process made", dir.display());
        }
        opened.set_permissions(std::fs::Permissions::from_mode(mode))?;
    }
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_handoff_carries_every_key_handle_and_generation() {
        let dir = std::env::temp_dir().join(format!("tlsplane-handoff-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let path = dir.join("k.pem");
        std::fs::write(&path, key.serialize_pem()).unwrap();
        let missing = dir.join("missing.pem");
        let mut store = Store::default();
        let source = Source::Keys(vec![path.clone(), missing.clone()]);
        let (g, _) = store.load(&source).unwrap();
        store.commit(g).unwrap();
        // A second generation, not committed: handed over as it is.
        store.load(&source).unwrap();
        let mut messages = store.handoff_messages().into_iter();
        let copy = Store::from_handoff(|| messages.next().ok_or("no more".into())).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(
            (copy.generation, copy.committed, copy.committed_before),
            (store.generation, store.committed, store.committed_before)
        );
        assert_eq!(copy.next_handle, store.next_handle);
        assert_eq!(copy.by_path, store.by_path);
        let handle = *store.by_path[&path].as_ref().unwrap();
        assert_eq!(
            copy.keys[&handle].public_key,
            store.keys[&handle].public_key
        );
        assert_eq!(
            copy.keys[&handle].generation,
            store.keys[&handle].generation
        );
        assert!(copy.by_path[&missing].is_err());
    }

    /// A new key in the key file at `path`.
    fn new_key(path: &Path) {
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        std::fs::write(path, key.serialize_pem()).unwrap();
    }

    #[test]
    fn generations_neither_wrap_nor_stick() {
        let dir = std::env::temp_dir().join(format!("tlsplane-generations-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("k.pem");
        new_key(&path);
        let source = Source::Keys(vec![path.clone()]);
        let mut store = Store::default();
        let (g1, _) = store.load(&source).unwrap();
        store.commit(g1).unwrap();
        let first = *store.by_path[&path].as_ref().unwrap();
        // Generations never made: refused, and nothing changes (a commit of 2^32-1 used to
        // make every later commit look old, so that no replaced key was dropped again).
        for never in [u32::MAX, g1 + 1] {
            let e = store.commit(never).unwrap_err();
            assert!(e.contains("cannot be committed"), "{e}");
        }
        assert_eq!((store.committed, store.generation), (g1, g1));
        // The key is replaced and reloaded: both kept while the generation before is.
        new_key(&path);
        let (g2, _) = store.load(&source).unwrap();
        store.commit(g2).unwrap();
        let second = *store.by_path[&path].as_ref().unwrap();
        assert_ne!(first, second);
        assert!(store.keys.contains_key(&first) && store.keys.contains_key(&second));
        // One older than the one in force: refused; the one in force again: nothing to do.
        assert!(store.commit(g1).is_err());
        store.commit(g2).unwrap();
        assert!(store.keys.contains_key(&first));
        // The next reload and commit retire the replaced key.
        let (g3, _) = store.load(&source).unwrap();
        store.commit(g3).unwrap();
        assert!(!store.keys.contains_key(&first), "the replaced key stays");
        assert!(store.keys.contains_key(&second));
        // At the end of the numbers a reload is refused: no wrap to 0, which no commit could
        // then reach.
        store.generation = u32::MAX;
        store.committed = u32::MAX;
        let e = store.load(&source).unwrap_err();
        assert!(e.contains("no generation number left"), "{e}");
        assert_eq!(store.generation, u32::MAX);
        // Handles too: a new key past the last handle is refused, and nothing half-loaded
        // stays.
        store.generation = g3;
        store.committed = g3;
        store.next_handle = u32::MAX;
        new_key(&path);
        let keys_before = store.keys.len();
        let e = store.load(&source).unwrap_err();
        let _ = std::fs::remove_dir_all(&dir);
        assert!(e.contains("no key handle left"), "{e}");
        assert_eq!((store.keys.len(), store.generation), (keys_before, g3));
    }

    /// A configuration file in `dir`: each site's name and key file.
    fn sites_config(dir: &Path, sites: &[(&str, &str)]) -> Source {
        let mut toml = String::new();
        for (name, key) in sites {
            toml += &format!(
                "[[site]]\nname = {name:?}\n[[site.cert]]\nchain = \"c.pem\"\nkey = {key:?}\n"
            );
        }
        let path = dir.join("sites.toml");
        std::fs::write(&path, toml).unwrap();
        Source::Config(path)
    }

    /// Signs with `handle` as the client `name`, whom `rules` grant keys.
    fn sign_as(store: &RwLock<Store>, rules: &[grants::Rule], name: &str, handle: u32) -> String {
        let cert = rcgen::generate_simple_self_signed(vec![name.to_string()]).unwrap();
        let grant = grants::Grant::for_names(rules, &grants::CertNames::of(cert.cert.der()));
        let client = grants::Clients::default().get(name, 0);
        let caller = Caller::Remote {
            grant: &grant,
            client: &client,
            sign_rate: 0,
        };
        let mut payload = handle.to_be_bytes().to_vec();
        payload.extend_from_slice(
            &u16::from(rustls::SignatureScheme::ECDSA_NISTP256_SHA256).to_be_bytes(),
        );
        payload.extend_from_slice(b"message");
        let reply = sign(&payload, store, &caller);
        match reply.split_first() {
            Some((&proto::OK, _)) => "signed".into(),
            _ => String::from_utf8_lossy(&reply[1..]).into_owned(),
        }
    }

    #[test]
    fn a_key_is_for_the_sites_it_was_loaded_for_not_those_its_file_is_given_to_later() {
        let dir = std::env::temp_dir().join(format!("tlsplane-key-sites-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (p, a2, b) = (dir.join("p.pem"), dir.join("a2.pem"), dir.join("b.pem"));
        for k in [&p, &a2, &b] {
            new_key(k);
        }
        let rules: Vec<grants::Rule> = ["a.example=site:a", "b.example=site:b"]
            .iter()
            .map(|r| r.parse().unwrap())
            .collect();
        let mut store = Store::default();
        let (g1, _) = store
            .load(&sites_config(&dir, &[("a", "p.pem"), ("b", "b.pem")]))
            .unwrap();
        store.commit(g1).unwrap();
        let old = *store.by_path[&p].as_ref().unwrap();
        // The reload gives p.pem, with a new key in it, to site b; site a gets another file.
        new_key(&p);
        let (g2, _) = store
            .load(&sites_config(
                &dir,
                &[("a", "a2.pem"), ("b", "b.pem"), ("b", "p.pem")],
            ))
            .unwrap();
        store.commit(g2).unwrap();
        let new = *store.by_path[&p].as_ref().unwrap();
        assert_ne!(old, new);
        // The copy a HANDOFF makes decides the same.
        let mut messages = store.handoff_messages().into_iter();
        let copy = Store::from_handoff(|| messages.next().ok_or("no more".into())).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        for store in [RwLock::new(store), RwLock::new(copy)] {
            // Site a's previous key, kept while its handshakes may still sign: a's, not b's.
            assert_eq!(sign_as(&store, &rules, "a.example", old), "signed");
            let refused = sign_as(&store, &rules, "b.example", old);
            // Told as of a handle never made: no path of another site's key.
            assert_eq!(refused, format!("no key {old} for ECDSA_NISTP256_SHA256"));
            // The key p.pem holds now: b's, not a's.
            assert_eq!(sign_as(&store, &rules, "b.example", new), "signed");
            assert!(sign_as(&store, &rules, "a.example", new).starts_with("no key"));
            let s = store.read().unwrap();
            let b_keys: HashSet<PathBuf> = [b.clone(), p.clone()].into();
            assert_eq!(s.sites["b"], b_keys);
        }
    }

    #[test]
    fn keys_are_handed_only_to_a_daemon_of_the_same_parent() {
        let (a, _b) = Socket::pair(Domain::UNIX, Type::SEQPACKET, None).unwrap();
        // Started by hand: nobody.
        assert!(may_take_over(&a, None)
            .unwrap_err()
            .contains("started by hand"));
        // The peer (this test process) has the right parent but is not a key daemon.
        let parent = parent_pid(std::process::id()).unwrap();
        assert!(may_take_over(&a, Some(parent))
            .unwrap_err()
            .contains("is not a key daemon"));
        // Nor is the parent itself.
        assert!(may_take_over(&a, Some(std::process::id()))
            .unwrap_err()
            .contains("is not a daemon started by"));
    }
}
