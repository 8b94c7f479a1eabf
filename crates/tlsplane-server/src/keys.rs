//! Where `serve` gets its private keys: from a key daemon it starts and supervises (the
//! default), from one started by hand (`--keyd unix:PATH`), or read into this process
//! (`--keyd off`, weaker: a memory disclosure in the server then discloses the keys).

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustls::sign::SigningKey;
use tlsplane::keyd::tls::KeydFleet;
use tlsplane::keyd::{Endpoint, KeydClient, TOKEN_LEN};

use crate::privileges::{Launcher, RunAs};

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeydMode {
    /// Start a key daemon (a child process of this server) and supervise it.
    On,
    /// Read keys in this process.
    Off,
    /// Use a daemon started by hand (`tlsplane keyd --socket PATH ...`).
    Unix(PathBuf),
    /// Use daemons on other hosts (`tlsplane keyd --listen-tls ...`), over TLS: `tls://HOST:PORT`
    /// each, used in turn, a signature that one loses made by the next.
    Tls(Vec<String>),
}

/// The server's TLS client credentials towards `--keyd tls://` daemons.
#[derive(Clone, Debug, Default)]
pub struct KeydTls {
    /// Its client certificate and key (PEM), which the daemons' --client-ca issued.
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    /// The CA that issued the daemons' certificates.
    pub ca: Option<PathBuf>,
}

impl FromStr for KeydMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "on" => Ok(Self::On),
            "off" => Ok(Self::Off),
            _ if s.starts_with(tlsplane::keyd::tls::URL_PREFIX) => {
                let urls: Vec<String> = s.split(',').map(|u| u.trim().to_string()).collect();
                for u in &urls {
                    tlsplane::keyd::tls::parse_url(u)?;
                }
                Ok(Self::Tls(urls))
            }
            _ => match s.strip_prefix("unix:") {
                Some(p) if !p.is_empty() => Ok(Self::Unix(PathBuf::from(p))),
                _ => Err(format!(
                    "{s:?}: expected on, off, unix:PATH or tls://HOST:PORT[,tls://HOST:PORT...]"
                )),
            },
        }
    }
}

/// A key daemon this server started, directly or (`--user`) through the launcher.
struct Daemon {
    pid: u32,
    socket: PathBuf,
    /// Our child; None: the launcher's, which stops it when asked.
    own: Option<OwnDaemon>,
}

struct OwnDaemon {
    child: Child,
    /// Its stdin: the daemon drops its keys and exits when this closes.
    stdin: Option<ChildStdin>,
    /// The private (0700) directory of its socket.
    dir: PathBuf,
}

impl Drop for OwnDaemon {
    fn drop(&mut self) {
        crate::privileges::stop_daemon(&mut self.child, self.stdin.take());
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The daemons of `--keyd on`: the one in use, and its spare, which holds the same keys under
/// the same handles, copied from it (HANDOFF) after each reload and never read from a file.
///
/// Why a spare: a daemon that dies takes its keys with it, and reading the files again
/// would not bring back the keys in force. The configuration on disk may have been edited
/// and not reloaded yet, or be broken half-way through an edit, and a renewal may have
/// written a new key before its certificate, so that the file's key no longer matches the
/// certificate in force. The server itself must never hold the keys (that is what the daemon
/// is for), so another daemon does: when the one in use dies or is stuck, the server switches
/// to the spare at once (the configuration in force, its keys and handles, untouched: no
/// reload) and starts a new spare copied from it. A copy comes only from a daemon of the same
/// parent and user (see `tlsplane keyd`'s HANDOFF), never through the server.
#[derive(Default)]
struct Daemons {
    in_use: Option<Daemon>,
    spare: Option<Daemon>,
}

/// The server's key source.
pub struct Keys {
    mode: KeydMode,
    /// What the daemon loads (`--config FILE` or `--key PEM`).
    daemon_args: Vec<OsString>,
    /// One token for every daemon this server starts: the client keeps it when it switches
    /// to the spare, and a spare shows it to the daemon whose keys it takes.
    token: zeroize::Zeroizing<[u8; TOKEN_LEN]>,
    client: Mutex<Option<Arc<KeydClient>>>,
    /// With `--keyd tls://...`: the daemons on other hosts.
    fleet: Option<Arc<KeydFleet>>,
    daemons: Mutex<Daemons>,
    /// With `--user`: what starts daemons as root once this server is not.
    launcher: Mutex<Option<Launcher>>,
    /// How long a signature may take (`--keyd-timeout`).
    sign_timeout: Duration,
    /// With `--keyd unix:PATH`: the daemon's user id when it is neither root nor this
    /// server's (`--keyd-uid`).
    daemon_uid: Option<u32>,
    stopping: AtomicBool,
    /// A daemon was started from the files (both were lost): the configuration in force has
    /// no keys until a reload on it succeeds, which the supervisor asks for again until one
    /// does (the files may be fixed later: the outage must end by itself then).
    reload_owed: AtomicBool,
}

impl Keys {
    /// Starts (or connects to) the key daemon for the keys `daemon_args` name, and its spare.
    /// `run_as`: the user this server becomes once its ports are bound; its daemons are then
    /// started by a launcher that stays root (see [`crate::privileges`]). A signature not
    /// made within `sign_timeout` fails its handshake. `daemon_uid`: with `unix:PATH`, the
    /// daemon's user if it is neither root nor this server's; no token goes to another.
    pub fn start(
        mode: KeydMode,
        daemon_args: Vec<OsString>,
        run_as: Option<&RunAs>,
        sign_timeout: Duration,
        tls: &KeydTls,
        daemon_uid: Option<u32>,
    ) -> anyhow::Result<Arc<Self>> {
        if daemon_uid.is_some() && !matches!(mode, KeydMode::Unix(_)) {
            anyhow::bail!("--keyd-uid goes with --keyd unix:PATH");
        }
        let launcher = match (&mode, run_as) {
            (KeydMode::On, Some(user)) => Some(Launcher::start(user.uid, &daemon_args)?),
            _ => None,
        };
        let mut token = zeroize::Zeroizing::new([0u8; TOKEN_LEN]);
        rustls::crypto::aws_lc_rs::default_provider()
            .secure_random
            .fill(token.as_mut())
            .map_err(|_| anyhow::anyhow!("no random token"))?;
        let fleet = match &mode {
            KeydMode::Tls(urls) => Some(connect_fleet(urls, tls, sign_timeout)?),
            _ => {
                if tls.cert.is_some() || tls.key.is_some() || tls.ca.is_some() {
                    anyhow::bail!(
                        "--keyd-tls-cert, --keyd-tls-key and --keyd-ca go with --keyd tls://"
                    );
                }
                None
            }
        };
        let keys = Arc::new(Self {
            mode,
            daemon_args,
            token,
            client: Mutex::new(None),
            fleet,
            daemons: Mutex::default(),
            launcher: Mutex::new(launcher),
            sign_timeout,
            daemon_uid,
            stopping: AtomicBool::new(false),
            reload_owed: AtomicBool::new(false),
        });
        match &keys.mode {
            KeydMode::Off | KeydMode::Tls(_) => {}
            KeydMode::On => {
                let first = keys.launch(None)?;
                keys.set_client(KeydClient::connect(
                    keys.endpoint(&first.socket),
                    keys.sign_timeout,
                )?);
                keys.lock_daemons().in_use = Some(first);
                if let Err(e) = keys.renew_spare() {
                    // The supervisor tries again.
                    tracing::warn!("no spare key daemon yet: {e:#}");
                }
            }
            KeydMode::Unix(socket) => {
                keys.set_client(connect_external(socket, keys.sign_timeout, daemon_uid)?);
            }
        }
        Ok(keys)
    }

    fn endpoint(&self, socket: &Path) -> Endpoint {
        // Its own daemons are root's (with --user) or this server's user's.
        Endpoint {
            socket: socket.to_path_buf(),
            token: self.token.clone(),
            daemon_uid: None,
        }
    }

    fn lock_daemons(&self) -> std::sync::MutexGuard<'_, Daemons> {
        self.daemons.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts a daemon that reads the key files, or with `copy_of` one that takes that
    /// daemon's keys; returns once it listens.
    fn launch(&self, copy_of: Option<&Daemon>) -> anyhow::Result<Daemon> {
        let mut launcher = self.launcher.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(launcher) = launcher.as_mut() {
            let hex = crate::keyd::encode_hex(self.token.as_ref());
            let (pid, socket) = launcher.spawn(&hex, copy_of.map(|d| d.pid))?;
            let ready = wait_until_listening(self.endpoint(&socket), self.sign_timeout, || {
                Ok(launcher.exited(pid, Duration::from_millis(5)))
            });
            if let Err(e) = ready {
                launcher.stop(pid);
                return Err(e);
            }
            return Ok(Daemon {
                pid,
                socket,
                own: None,
            });
        }
        drop(launcher);
        let dir = crate::keyd::private_dir(0o700)?;
        let socket = dir.join("keyd.sock");
        let extra: Vec<OsString> = match copy_of {
            Some(d) => vec!["--copy-from".into(), d.socket.clone().into()],
            None => Vec::new(),
        };
        let (mut child, stdin) =
            crate::keyd::start_daemon_process(&socket, &self.daemon_args, &extra, &self.token)?;
        let ready = wait_until_listening(self.endpoint(&socket), self.sign_timeout, || {
            Ok(child.try_wait()?.map(|status| status.to_string()))
        });
        let daemon = Daemon {
            pid: child.id(),
            socket,
            own: Some(OwnDaemon {
                child,
                stdin: Some(stdin),
                dir,
            }),
        };
        // On an error, dropping `daemon` stops it and removes its directory.
        ready?;
        Ok(daemon)
    }

    /// Stops a daemon: orderly (it zeroizes its keys), or killed at once if it is stuck.
    fn retire(&self, mut daemon: Daemon, kill: bool) {
        match daemon.own.as_mut() {
            Some(own) => {
                if kill {
                    let _ = own.child.kill();
                }
            }
            None => {
                if let Some(l) = self
                    .launcher
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .as_mut()
                {
                    l.stop(daemon.pid);
                }
            }
        }
    }

    /// How `daemon` ended, if it has.
    fn exited(&self, daemon: &mut Daemon) -> Option<String> {
        if let Some(own) = daemon.own.as_mut() {
            return match own.child.try_wait() {
                Ok(Some(status)) => Some(status.to_string()),
                _ => None,
            };
        }
        let mut l = self.launcher.lock().unwrap_or_else(|e| e.into_inner());
        let l = l.as_mut()?;
        if l.is_gone() {
            return Some("with its launcher".into());
        }
        l.exited(daemon.pid, Duration::ZERO)
    }

    /// Replaces the spare by a copy of the daemon in use (after a reload: the keys in force
    /// changed).
    fn renew_spare(&self) -> anyhow::Result<()> {
        let mut daemons = self.lock_daemons();
        let in_use = daemons
            .in_use
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("no key daemon in use"))?;
        let spare = self.launch(Some(in_use))?;
        if let Some(old) = daemons.spare.replace(spare) {
            self.retire(old, false);
        }
        Ok(())
    }

    /// The client of the daemon in use, if keys are in one.
    fn client(&self) -> Option<Arc<KeydClient>> {
        self.client
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn set_client(&self, client: Arc<KeydClient>) {
        *self.client.lock().unwrap_or_else(|e| e.into_inner()) = Some(client);
    }

    /// The signing key for the key file `path`.
    pub fn load(&self, path: &Path) -> Result<Arc<dyn SigningKey>, tlsplane::Error> {
        if let Some(fleet) = &self.fleet {
            return fleet
                .key(path)
                .map(|k| k as Arc<dyn SigningKey>)
                .map_err(|e| tlsplane::Error::Config(e.to_string()));
        }
        match self.client() {
            None => tlsplane::cert::load_key(path),
            Some(c) => c
                .key(path)
                .map(|k| k as Arc<dyn SigningKey>)
                .map_err(|e| tlsplane::Error::Config(e.to_string())),
        }
    }

    /// Has the daemon re-read its key files (a reload); the generation to commit once the
    /// configuration built on them is in force. Nothing to do without a daemon, nor with
    /// daemons over TLS: they serve other servers too, and reload when their host says so
    /// (SIGHUP); the reload asks them for its keys again.
    pub fn reload(&self) -> anyhow::Result<Option<u32>> {
        if self.fleet.is_some() {
            return Ok(None);
        }
        match self.client() {
            Some(c) => Ok(Some(c.reload()?)),
            None => Ok(None),
        }
    }

    /// The configuration built on generation `g` is in force (or will be as soon as this
    /// returns): the daemon may drop keys neither it nor the previous one uses, and the spare
    /// is replaced by a copy that has the new keys, before the configuration that uses them
    /// serves a handshake.
    pub fn commit(&self, g: Option<u32>) {
        self.reload_owed.store(false, Relaxed);
        if let (Some(c), Some(g)) = (self.client(), g) {
            if let Err(e) = c.commit(g) {
                tracing::warn!(error = %e, "the key daemon did not take the commit");
            }
        }
        if self.mode == KeydMode::On && g.is_some() {
            if let Err(e) = self.renew_spare() {
                // A spare without the new keys must not stand in; the supervisor starts
                // another.
                tracing::warn!("the spare key daemon could not be renewed: {e:#}");
                if let Some(old) = self.lock_daemons().spare.take() {
                    self.retire(old, false);
                }
            }
        }
    }

    /// Watches the daemon: when the one this server started dies, or is stuck (it let a
    /// signature time out), its spare takes over and a new spare is made; with `--keyd
    /// unix:PATH`, connects again (reading the token file again: a daemon restarted by hand
    /// has a new token) when the daemon cannot be reached, then asks for a reload (new
    /// handles), through `reload`. Each step is logged once and counted.
    pub fn supervise(
        self: &Arc<Self>,
        reload: tokio::sync::mpsc::UnboundedSender<&'static str>,
        stats: Arc<crate::stats::RuntimeStats>,
    ) {
        if self.mode == KeydMode::Off {
            return;
        }
        let keys = self.clone();
        let _ = std::thread::Builder::new()
            .name("keyd-watch".into())
            .spawn(move || {
                let mut spare = SpareRetry::default();
                let mut owed = SpareRetry::default();
                loop {
                    std::thread::sleep(Duration::from_millis(20));
                    if keys.stopping.load(Relaxed) {
                        return;
                    }
                    let back = match &keys.mode {
                        KeydMode::Unix(socket) => keys.reconnect_if_broken(socket, &stats),
                        KeydMode::Tls(_) => {
                            // Keys learn their handles on a daemon back in use as they sign
                            // there: no reload.
                            if let Some(fleet) = &keys.fleet {
                                let back = fleet.probe();
                                stats.keyd_reconnects.fetch_add(back as u64, Relaxed);
                            }
                            None
                        }
                        _ => {
                            let back = keys.replace_if_dead_or_stuck(&stats);
                            keys.keep_a_spare(&mut spare);
                            back
                        }
                    };
                    if let Some(why) = back {
                        let _ = reload.send(why);
                        owed = SpareRetry::default();
                        owed.next_try = Some(Instant::now() + Duration::from_millis(500));
                    } else if keys.reload_owed.load(Relaxed)
                        && owed.next_try.is_none_or(|t| Instant::now() >= t)
                    {
                        // The last one failed (say, a key file that does not match its
                        // certificate yet): again, less and less often.
                        let _ = reload.send("the key daemon restarted from the files has no configuration in force yet");
                        owed.delay = (owed.delay * 2)
                            .clamp(Duration::from_secs(1), Duration::from_secs(30));
                        owed.next_try = Some(Instant::now() + owed.delay);
                    }
                }
            });
    }

    /// If the daemon in use died or is stuck, puts its spare in its place (no reload: the
    /// configuration in force keeps its keys); without a spare, starts a daemon from the
    /// files, and returns why a reload is needed (new handles).
    fn replace_if_dead_or_stuck(&self, stats: &crate::stats::RuntimeStats) -> Option<&'static str> {
        let mut daemons = self.lock_daemons();
        let status = daemons.in_use.as_mut().and_then(|d| self.exited(d));
        let kill = if let Some(status) = status {
            tracing::error!("the key daemon exited ({status})");
            false
        } else if self.stuck() {
            // Alive but not answering (stopped, deadlocked): every handshake would wait out
            // the timeout. Its keys are not zeroized by a kill, but a stuck process would not
            // zeroize them on request either.
            tracing::error!(
                "the key daemon did not answer a signature within {} s: replacing it",
                self.sign_timeout.as_secs_f64()
            );
            stats.keyd_stuck.fetch_add(1, Relaxed);
            true
        } else {
            return None;
        };
        stats.keyd_restarts.fetch_add(1, Relaxed);
        if let Some(old) = daemons.in_use.take() {
            self.retire(old, kill);
        }
        if let Some(mut spare) = daemons.spare.take() {
            let switched = match self.exited(&mut spare) {
                Some(status) => Err(anyhow::anyhow!("it exited too ({status})")),
                None => match self.client() {
                    Some(c) => c
                        .switch(self.endpoint(&spare.socket))
                        .map_err(anyhow::Error::from),
                    None => Err(anyhow::anyhow!("no client")),
                },
            };
            match switched {
                Ok(()) => {
                    tracing::info!(
                        "the spare key daemon took over with the keys in force; a new spare is started"
                    );
                    daemons.in_use = Some(spare);
                    return None;
                }
                Err(e) => {
                    tracing::error!("the spare key daemon cannot take over: {e:#}");
                    self.retire(spare, true);
                }
            }
        }
        drop(daemons);
        self.restart_from_files()
    }

    /// Without a spare (both daemons lost at once): a daemon that reads the key files, and a
    /// reload for the handles it gives. Retries until it is back, each distinct reason logged
    /// once.
    fn restart_from_files(&self) -> Option<&'static str> {
        let mut last = String::new();
        let attempt = || {
            let daemon = self.launch(None)?;
            self.set_client(KeydClient::connect(
                self.endpoint(&daemon.socket),
                self.sign_timeout,
            )?);
            self.lock_daemons().in_use = Some(daemon);
            self.reload_owed.store(true, Relaxed);
            Ok(())
        };
        let back = self.retry(Duration::from_secs(5), attempt, |e| {
            let why = format!("{e:#}");
            if why != last {
                tracing::error!("restarting the key daemon failed: {why}; retrying");
                last = why;
            }
        });
        back.then(|| {
            tracing::info!("key daemon restarted from the key files");
            "key daemon restarted from the key files"
        })
    }

    /// Makes a spare when there is none (or it died), retrying with a growing delay; each
    /// distinct reason it fails for is logged once.
    fn keep_a_spare(&self, state: &mut SpareRetry) {
        let status = {
            let mut daemons = self.lock_daemons();
            if daemons.in_use.is_none() {
                return;
            }
            match daemons.spare.as_mut() {
                Some(d) => match self.exited(d) {
                    Some(status) => {
                        daemons.spare = None;
                        status
                    }
                    None => return,
                },
                None => String::new(),
            }
        };
        if !status.is_empty() {
            tracing::warn!("the spare key daemon exited ({status}); starting another");
        }
        if state.next_try.is_some_and(|t| Instant::now() < t) {
            return;
        }
        match self.renew_spare() {
            Ok(()) => {
                if !state.last_error.is_empty() {
                    tracing::info!("a spare key daemon runs again");
                }
                *state = SpareRetry::default();
            }
            Err(e) => {
                let why = format!("{e:#}");
                if why != state.last_error {
                    tracing::warn!("no spare key daemon: {why}; retrying");
                    state.last_error = why;
                }
                state.delay =
                    (state.delay * 2).clamp(Duration::from_millis(50), Duration::from_secs(5));
                state.next_try = Some(Instant::now() + state.delay);
            }
        }
    }

    /// The `--keyd unix:PATH` side: connects again if the daemon could not be reached; why,
    /// once it is back (None: nothing was wrong, or the server is stopping).
    fn reconnect_if_broken(
        &self,
        socket: &Path,
        stats: &crate::stats::RuntimeStats,
    ) -> Option<&'static str> {
        if self.client().is_none_or(|c| c.broken() == 0) {
            return None;
        }
        tracing::error!(
            "the key daemon at {} cannot be reached; connecting again",
            socket.display()
        );
        let mut last = String::new();
        let attempt = || {
            self.set_client(connect_external(
                socket,
                self.sign_timeout,
                self.daemon_uid,
            )?);
            Ok(())
        };
        let back = self.retry(Duration::from_secs(1), attempt, |e| {
            // Once per distinct reason: a daemon being restarted goes through a few (no
            // socket, no token file yet, ...).
            let why = format!("{e:#}");
            if why != last {
                tracing::warn!("the key daemon is not back yet: {why}; retrying");
                last = why;
            }
        });
        back.then(|| {
            stats.keyd_reconnects.fetch_add(1, Relaxed);
            tracing::info!("connected again to the key daemon at {}", socket.display());
            "key daemon connected again"
        })
    }

    /// Calls `attempt` until it succeeds, waiting 50 ms after the first failure and twice as
    /// long after each next one, up to `cap`; `failed` hears each failure. False if the server
    /// is stopping first.
    fn retry(
        &self,
        cap: Duration,
        mut attempt: impl FnMut() -> anyhow::Result<()>,
        mut failed: impl FnMut(&anyhow::Error),
    ) -> bool {
        let mut delay = Duration::from_millis(50);
        loop {
            if self.stopping.load(Relaxed) {
                return false;
            }
            match attempt() {
                Ok(()) => return true,
                Err(e) => {
                    failed(&e);
                    std::thread::sleep(delay);
                    delay = (delay * 2).min(cap);
                }
            }
        }
    }

    /// Whether the current daemon let a signature time out.
    fn stuck(&self) -> bool {
        self.client().is_some_and(|c| c.timeouts() > 0)
    }

    /// Stops supervision and the daemons (at exit).
    pub fn stop(&self) {
        self.stopping.store(true, Relaxed);
        *self.lock_daemons() = Daemons::default();
        *self.launcher.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
}

/// When the supervisor next tries to make a spare, and why the last try failed.
#[derive(Default)]
struct SpareRetry {
    next_try: Option<Instant>,
    delay: Duration,
    last_error: String,
}

/// The daemons of `--keyd tls://...`, with the server's client certificate.
fn connect_fleet(
    urls: &[String],
    tls: &KeydTls,
    sign_timeout: Duration,
) -> anyhow::Result<Arc<KeydFleet>> {
    let (Some(cert), Some(key), Some(ca)) = (&tls.cert, &tls.key, &tls.ca) else {
        anyhow::bail!("--keyd tls:// needs --keyd-tls-cert, --keyd-tls-key and --keyd-ca");
    };
    let config = tlsplane::keyd::tls::client_config(cert, key, ca).map_err(anyhow::Error::msg)?;
    KeydFleet::connect(urls, config, sign_timeout)
        .map_err(|e| anyhow::anyhow!("--keyd {}: {e}", urls.join(",")))
}

/// Connects to a daemon started by hand (`--keyd unix:PATH`), with the token it wrote beside
/// its socket.
fn connect_external(
    socket: &Path,
    sign_timeout: Duration,
    daemon_uid: Option<u32>,
) -> anyhow::Result<Arc<KeydClient>> {
    let token_file = crate::keyd::token_path(socket);
    let context = |e: &dyn std::fmt::Display| {
        anyhow::anyhow!(
            "--keyd unix:{}: {}: {e}",
            socket.display(),
            token_file.display()
        )
    };
    let file = crate::secret_file::read(&token_file, 4096).map_err(|e| context(&e))?;
    let mut token = zeroize::Zeroizing::new([0u8; TOKEN_LEN]);
    crate::keyd::decode_hex(file.text().map_err(|e| context(&e))?, &mut token)
        .ok_or_else(|| context(&"not a token"))?;
    KeydClient::connect(
        Endpoint {
            socket: socket.to_path_buf(),
            token,
            daemon_uid,
        },
        sign_timeout,
    )
    .map_err(|e| anyhow::anyhow!("--keyd unix:{}: {e}", socket.display()))
}

/// Connects to a daemon just started, which loads every key before it listens: waits for
/// that, at most 30 s, or for `exited` to say how it ended first.
fn wait_until_listening(
    endpoint: Endpoint,
    sign_timeout: Duration,
    mut exited: impl FnMut() -> anyhow::Result<Option<String>>,
) -> anyhow::Result<Arc<KeydClient>> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match KeydClient::connect(endpoint.clone(), sign_timeout) {
            Ok(c) => return Ok(c),
            Err(_) if Instant::now() < deadline => {
                if let Some(status) = exited()? {
                    anyhow::bail!("the key daemon exited ({status}) before it listened");
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => anyhow::bail!("the key daemon did not answer within 30 s: {e}"),
        }
    }
}
