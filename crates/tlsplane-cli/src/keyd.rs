//! `tlsplane keyd`: the key daemon. It alone reads the private keys; serving processes ask it
//! for signatures over a Unix socket (protocol and client: `tlsplane::keyd`).
//!
//! Started by `serve` (the default), it reads its token from stdin, drops its keys and exits
//! when stdin closes (the server stops or is gone) or on SIGTERM, and is killed if the server
//! dies (`PR_SET_PDEATHSIG`, SIGKILL, which also ends a stopped daemon). Started by hand
//! (`--keyd unix:PATH` on the server), it writes its token to `PATH.token` (mode 0600). Either
//! way it is non-dumpable (`PR_SET_DUMPABLE 0`: no core file, no ptrace or /proc/PID/mem by
//! other processes of its user), opens no network socket, and drops (zeroizes) its keys before
//! it exits. SIGUSR1 makes it say on stderr how many signatures it made and their mean cost.

use std::collections::HashMap;
use std::io::{BufRead, Read};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use clap::Args;
use rustls::sign::SigningKey;
use socket2::{Domain, SockAddr, Socket, Type};
use tlsplane::keyd::{self as proto, op, TOKEN_LEN};

#[derive(Args, Debug)]
pub struct KeydArgs {
    /// Unix socket to listen on (created, mode 0600; keep its directory private).
    #[arg(long, value_name = "PATH")]
    pub socket: PathBuf,
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
    #[arg(long, hide = true)]
    pub parent: Option<u32>,
    /// The socket's mode, octal: 666 when it serves a server of another user (`serve --user`;
    /// then its directory is root's and the peer's uid and the token decide).
    #[arg(long, hide = true, default_value = "600", value_parser = parse_mode)]
    pub socket_mode: u32,
}

/// What the daemon loads keys from, again on each RELOAD.
enum Source {
    Config(PathBuf),
    Keys(Vec<PathBuf>),
}

impl Source {
    fn paths(&self) -> Result<Vec<PathBuf>, String> {
        match self {
            Source::Keys(k) => Ok(k.clone()),
            Source::Config(path) => Ok(crate::config::ConfigFile::read(path)?.key_paths()),
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
#[derive(Default)]
struct Store {
    keys: HashMap<u32, Held>,
    /// The latest generation's files: handle, or why it could not be loaded.
    by_path: HashMap<PathBuf, Result<u32, String>>,
    generation: u32,
    committed: u32,
    committed_before: u32,
    next_handle: u32,
}

struct Held {
    key: Arc<dyn SigningKey>,
    path: PathBuf,
    public_key: Vec<u8>,
    /// The latest generation that has it.
    generation: u32,
}

impl Store {
    /// Loads every key of `source` as a new generation; its number and how many keys loaded.
    fn load(&mut self, source: &Source) -> Result<(u32, u32), String> {
        let paths = source.paths()?;
        self.generation += 1;
        let g = self.generation;
        let mut by_path = HashMap::new();
        let mut loaded = 0;
        for p in paths {
            let result = match tlsplane::cert::load_key(&p) {
                Ok(key) => {
                    loaded += 1;
                    let public_key = key
                        .public_key()
                        .map(|k| k.as_ref().to_vec())
                        .unwrap_or_default();
                    let same = self
                        .keys
                        .iter_mut()
                        .find(|(_, h)| h.path == p && h.public_key == public_key);
                    match same {
                        Some((&handle, held)) => {
                            held.generation = g;
                            Ok(handle)
                        }
                        None => {
                            self.next_handle += 1;
                            self.keys.insert(
                                self.next_handle,
                                Held {
                                    key,
                                    path: p.clone(),
                                    public_key,
                                    generation: g,
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
        Ok((g, loaded))
    }

    /// Generation `g` is in force in the server.
    fn commit(&mut self, g: u32) {
        if g <= self.committed {
            return;
        }
        self.committed_before = self.committed;
        self.committed = g;
        let keep_from = self.committed_before;
        self.keys.retain(|_, h| h.generation >= keep_from);
    }
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
        write_token_file(&token_path(&args.socket), &token)?;
    }
    let store = Arc::new(RwLock::new(Store::default()));
    let (first, n) = {
        let mut s = store.write().unwrap_or_else(|e| e.into_inner());
        let loaded = s.load(&source).map_err(anyhow::Error::msg)?;
        s.commit(loaded.0);
        for (p, r) in &s.by_path {
            if let Err(why) = r {
                // The server reports it too, with the site it belongs to.
                tracing::debug!(path = %p.display(), "keyd: {why}");
            }
        }
        loaded
    };
    let _ = first;

    let _ = std::fs::remove_file(&args.socket);
    let listener = Socket::new(Domain::UNIX, Type::SEQPACKET.cloexec(), None)?;
    listener.bind(&SockAddr::unix(&args.socket)?)?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(
        &args.socket,
        std::fs::Permissions::from_mode(args.socket_mode),
    )?;
    listener.listen(128)?;
    let mut allowed = vec![tlsplane_sys::current_uid(), 0];
    allowed.extend(&args.allow_uid);

    // Exit paths: the parent closes our stdin (it exited), or SIGTERM/SIGINT.
    let socket_path = args.socket.clone();
    let exit = {
        let store = store.clone();
        move |why: &str| {
            // Drop every key (aws-lc clears key memory as it frees it).
            *store.write().unwrap_or_else(|e| e.into_inner()) = Store::default();
            let _ = std::fs::remove_file(&socket_path);
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
    let (mut term, mut int, mut usr1) = rt.block_on(async {
        use tokio::signal::unix::{signal, SignalKind};
        anyhow::Ok((
            signal(SignalKind::terminate())?,
            signal(SignalKind::interrupt())?,
            signal(SignalKind::user_defined1())?,
        ))
    })?;
    std::thread::spawn(move || {
        let why = rt.block_on(async {
            loop {
                tokio::select! {
                    _ = term.recv() => break "SIGTERM",
                    _ = int.recv() => break "SIGINT",
                    _ = usr1.recv() => report_signatures(),
                }
            }
        });
        exit(why);
    });
    eprintln!(
        "keyd: {n} keys loaded; listening on {}",
        args.socket.display()
    );

    let source = Arc::new(source);
    let token = Arc::new(token);
    loop {
        let (conn, _) = match listener.accept() {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "keyd: accept failed");
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
        std::thread::spawn(move || serve_conn(conn, &store, &source, &token, &allowed));
    }
}

fn serve_conn(
    sock: Socket,
    store: &RwLock<Store>,
    source: &Source,
    token: &[u8; TOKEN_LEN],
    allowed: &[u32],
) {
    if let Err(why) = proto::check_hello(&sock, token, allowed) {
        tracing::warn!("keyd: connection refused: {why}");
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
        let reply = answer(&buf[..n], store, source);
        loop {
            match sock.send(&reply) {
                Ok(_) => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => return,
            }
        }
    }
}

/// SIGUSR1: how many signatures the daemon made and what one cost inside the signing library
/// (its clock, not the server's), on stderr. The server's own view of the same signatures,
/// round trip included, is its `keyd_signatures` / `keyd_wait_ns` counters.
fn report_signatures() {
    use std::sync::atomic::Ordering::Relaxed;
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
    eprintln!("keyd: {n} signatures in {total_ms:.1} ms, {mean_us:.1} µs each in the signer");
}

fn err(why: impl AsRef<str>) -> Vec<u8> {
    let mut r = vec![proto::ERR];
    r.extend_from_slice(why.as_ref().as_bytes());
    r
}

fn answer(req: &[u8], store: &RwLock<Store>, source: &Source) -> Vec<u8> {
    let Some((&code, payload)) = req.split_first() else {
        return err("empty request");
    };
    match code {
        op::SIGN => {
            let Some((handle, scheme, message)) = proto::parse_sign(payload) else {
                return err("malformed SIGN");
            };
            let key = store
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .keys
                .get(&handle)
                .map(|h| h.key.clone());
            let Some(signer) = key.and_then(|k| k.choose_scheme(&[scheme])) else {
                return err(format!("no key {handle} for {scheme:?}"));
            };
            match signer.sign(message) {
                Ok(sig) => {
                    let mut r = Vec::with_capacity(1 + sig.len());
                    r.push(proto::OK);
                    r.extend_from_slice(&sig);
                    r
                }
                Err(e) => err(e.to_string()),
            }
        }
        op::KEY => {
            let path = Path::new(std::ffi::OsStr::from_bytes(payload));
            let s = store.read().unwrap_or_else(|e| e.into_inner());
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
        op::RELOAD => match store
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .load(source)
        {
            Ok((generation, _)) => {
                let mut r = vec![proto::OK];
                r.extend_from_slice(&generation.to_be_bytes());
                r
            }
            Err(why) => err(why),
        },
        op::COMMIT => match payload.get(..4) {
            Some(b) => {
                let g = u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
                store.write().unwrap_or_else(|e| e.into_inner()).commit(g);
                vec![proto::OK]
            }
            None => err("malformed COMMIT"),
        },
        _ => err("unknown request"),
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
