//! Where `serve` gets its private keys: from a key daemon it starts and supervises (the
//! default), from one started by hand (`--keyd unix:PATH`), or read into this process
//! (`--keyd off`, weaker: a memory disclosure in the server then discloses the keys).

use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustls::sign::SigningKey;
use tlsplane::keyd::{Endpoint, KeydClient, TOKEN_LEN};

use crate::privileges::{Event, Launcher, RunAs};

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeydMode {
    /// Start a key daemon (a child process of this server) and supervise it.
    On,
    /// Read keys in this process.
    Off,
    /// Use a daemon started by hand (`tlsplane keyd --socket PATH ...`).
    Unix(PathBuf),
}

impl FromStr for KeydMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "on" => Ok(Self::On),
            "off" => Ok(Self::Off),
            _ => match s.strip_prefix("unix:") {
                Some(p) if !p.is_empty() => Ok(Self::Unix(PathBuf::from(p))),
                _ => Err(format!("{s:?}: expected on, off or unix:PATH")),
            },
        }
    }
}

/// A key daemon this server started.
enum Spawned {
    /// Our child.
    Child {
        child: Child,
        /// Its stdin: the daemon drops its keys and exits when this closes.
        stdin: Option<ChildStdin>,
        /// The private (0700) directory of its socket.
        dir: PathBuf,
    },
    /// The launcher's child (`--user`), which the launcher stops and cleans up after.
    Launched { pid: u32 },
}

impl Drop for Spawned {
    fn drop(&mut self) {
        if let Spawned::Child { child, stdin, dir } = self {
            crate::privileges::stop_daemon(child, stdin.take());
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// The server's key source.
pub struct Keys {
    mode: KeydMode,
    /// What the daemon loads (`--config FILE` or `--key PEM`).
    daemon_args: Vec<OsString>,
    client: Mutex<Option<Arc<KeydClient>>>,
    spawned: Mutex<Option<Spawned>>,
    /// With `--user`: what starts daemons as root once this server is not.
    launcher: Mutex<Option<Launcher>>,
    /// How long a signature may take (`--keyd-timeout`).
    sign_timeout: Duration,
    stopping: AtomicBool,
}

impl Keys {
    /// Starts (or connects to) the key daemon for the keys `daemon_args` name. `run_as`:
    /// the user this server becomes once its ports are bound; its daemons are then started by
    /// a launcher that stays root (see [`crate::privileges`]). A signature not made within
    /// `sign_timeout` fails its handshake.
    pub fn start(
        mode: KeydMode,
        daemon_args: Vec<OsString>,
        run_as: Option<&RunAs>,
        sign_timeout: Duration,
    ) -> anyhow::Result<Arc<Self>> {
        let launcher = match (&mode, run_as) {
            (KeydMode::On, Some(user)) => Some(Launcher::start(user.uid, &daemon_args)?),
            _ => None,
        };
        let keys = Arc::new(Self {
            mode,
            daemon_args,
            client: Mutex::new(None),
            spawned: Mutex::new(None),
            launcher: Mutex::new(launcher),
            sign_timeout,
            stopping: AtomicBool::new(false),
        });
        match &keys.mode {
            KeydMode::Off => {}
            KeydMode::On => keys.spawn()?,
            KeydMode::Unix(socket) => {
                keys.set_client(connect_external(socket, keys.sign_timeout)?);
            }
        }
        Ok(keys)
    }

    /// Starts a daemon and connects to it (replacing any previous one).
    fn spawn(&self) -> anyhow::Result<()> {
        let mut token = zeroize::Zeroizing::new([0u8; TOKEN_LEN]);
        rustls::crypto::aws_lc_rs::default_provider()
            .secure_random
            .fill(token.as_mut())
            .map_err(|_| anyhow::anyhow!("no random token"))?;
        let mut launcher = self.launcher.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(launcher) = launcher.as_mut() {
            let (pid, socket) = launcher.spawn(&crate::keyd::encode_hex(token.as_ref()))?;
            let client =
                wait_until_listening(Endpoint { socket, token }, self.sign_timeout, || {
                    Ok(match launcher.next(Duration::from_millis(5)) {
                        Some(Event::Exited { pid: p, status }) if p == pid => Some(status),
                        _ => None,
                    })
                })?;
            self.set_client(client);
            *self.spawned.lock().unwrap_or_else(|e| e.into_inner()) =
                Some(Spawned::Launched { pid });
            return Ok(());
        }
        drop(launcher);
        let dir = private_dir(0o700)?;
        let socket = dir.join("keyd.sock");
        let (mut child, stdin) = start_daemon_process(&socket, &self.daemon_args, &[], &token)?;
        let client = wait_until_listening(Endpoint { socket, token }, self.sign_timeout, || {
            Ok(child.try_wait()?.map(|status| status.to_string()))
        });
        let spawned = Spawned::Child {
            child,
            stdin: Some(stdin),
            dir,
        };
        // On an error, dropping `spawned` stops the daemon and removes its directory.
        let client = client?;
        self.set_client(client);
        *self.spawned.lock().unwrap_or_else(|e| e.into_inner()) = Some(spawned);
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
        match self.client() {
            None => tlsplane::cert::load_key(path),
            Some(c) => c
                .key(path)
                .map(|k| k as Arc<dyn SigningKey>)
                .map_err(|e| tlsplane::Error::Config(e.to_string())),
        }
    }

    /// Has the daemon re-read its key files (a reload); the generation to commit once the
    /// configuration built on them is in force. Nothing to do without a daemon.
    pub fn reload(&self) -> anyhow::Result<Option<u32>> {
        match self.client() {
            Some(c) => Ok(Some(c.reload()?)),
            None => Ok(None),
        }
    }

    /// The configuration built on generation `g` is in force: the daemon may drop keys
    /// neither it nor the previous one uses.
    pub fn commit(&self, g: Option<u32>) {
        if let (Some(c), Some(g)) = (self.client(), g) {
            if let Err(e) = c.commit(g) {
                tracing::warn!(error = %e, "the key daemon did not take the commit");
            }
        }
    }

    /// Watches the daemon: when the one this server started dies, or is stuck (it let a
    /// signature time out), starts another; with `--keyd unix:PATH`, connects again (reading
    /// the token file again: a daemon restarted by hand has a new token) when the daemon
    /// cannot be reached. Then asks for a reload (new handles), through `reload`. Each step is
    /// logged once and counted.
    pub fn supervise(
        self: &Arc<Self>,
        reload: tokio::sync::mpsc::UnboundedSender<&'static str>,
        stats: Arc<crate::runtime::RuntimeStats>,
    ) {
        if self.mode == KeydMode::Off {
            return;
        }
        let keys = self.clone();
        let _ = std::thread::Builder::new()
            .name("keyd-watch".into())
            .spawn(move || loop {
                std::thread::sleep(Duration::from_millis(20));
                if keys.stopping.load(Relaxed) {
                    return;
                }
                let back = match &keys.mode {
                    KeydMode::Unix(socket) => keys.reconnect_if_broken(socket, &stats),
                    _ => keys.restart_if_dead_or_stuck(&stats),
                };
                if let Some(why) = back {
                    let _ = reload.send(why);
                }
            });
    }

    /// Starts another daemon if ours died or is stuck; why, once it is back (None: nothing
    /// was wrong, or the server is stopping).
    fn restart_if_dead_or_stuck(
        &self,
        stats: &crate::runtime::RuntimeStats,
    ) -> Option<&'static str> {
        if let Some(status) = self.died() {
            tracing::error!(
                "the key daemon exited ({status}); handshakes fail until it is restarted"
            );
        } else if self.stuck() {
            // Alive but not answering (stopped, deadlocked): every handshake would wait out
            // the timeout. Its keys are not zeroized by a kill, but a stuck process would not
            // zeroize them on request either.
            tracing::error!(
                "the key daemon did not answer a signature within {} s: replacing it",
                self.sign_timeout.as_secs_f64()
            );
            stats.keyd_stuck.fetch_add(1, Relaxed);
            self.kill_stuck();
        } else {
            return None;
        }
        stats.keyd_restarts.fetch_add(1, Relaxed);
        // Retry until it comes back (a key file may be missing right now).
        let back = self.retry(
            Duration::from_secs(5),
            || self.spawn(),
            |e| {
                tracing::error!("restarting the key daemon failed: {e:#}; retrying");
            },
        );
        back.then(|| {
            tracing::info!("key daemon restarted");
            "key daemon restarted"
        })
    }

    /// The `--keyd unix:PATH` side: connects again if the daemon could not be reached; why,
    /// once it is back (None: nothing was wrong, or the server is stopping).
    fn reconnect_if_broken(
        &self,
        socket: &Path,
        stats: &crate::runtime::RuntimeStats,
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
            self.set_client(connect_external(socket, self.sign_timeout)?);
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

    /// Kills a stuck daemon that is our child at once (an orderly stop would wait for it). One
    /// the launcher started is stopped by the launcher when it starts the next.
    fn kill_stuck(&self) {
        if let Some(Spawned::Child { child, .. }) = self
            .spawned
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_mut()
        {
            let _ = child.kill();
        }
    }

    /// How the daemon this server started ended, if it has.
    fn died(&self) -> Option<String> {
        let launched = {
            let mut s = self.spawned.lock().unwrap_or_else(|e| e.into_inner());
            match s.as_mut() {
                Some(Spawned::Child { child, .. }) => {
                    return match child.try_wait() {
                        Ok(Some(status)) => Some(status.to_string()),
                        _ => None,
                    }
                }
                Some(Spawned::Launched { pid }) => *pid,
                None => return None,
            }
        };
        let mut l = self.launcher.lock().unwrap_or_else(|e| e.into_inner());
        let l = l.as_mut()?;
        if l.is_gone() {
            return Some("with its launcher".into());
        }
        match l.next(Duration::ZERO) {
            Some(Event::Exited { pid, status }) if pid == launched => Some(status),
            _ => None,
        }
    }

    /// Stops supervision and the daemon (at exit).
    pub fn stop(&self) {
        self.stopping.store(true, Relaxed);
        *self.spawned.lock().unwrap_or_else(|e| e.into_inner()) = None;
        *self.launcher.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
}

/// Starts `tlsplane keyd` listening on `socket` for the keys `daemon_args` name, a child of
/// this process (dying with it), with `extra` arguments, and hands it `token` on its stdin,
/// which it keeps open: the daemon exits when that closes.
pub fn start_daemon_process(
    socket: &Path,
    daemon_args: &[OsString],
    extra: &[&str],
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
    stdin.write_all(crate::keyd::encode_hex(token).as_bytes())?;
    stdin.write_all(b"\n")?;
    Ok((child, stdin))
}

/// Connects to a daemon started by hand (`--keyd unix:PATH`), with the token it wrote beside
/// its socket.
fn connect_external(socket: &Path, sign_timeout: Duration) -> anyhow::Result<Arc<KeydClient>> {
    let token_file = crate::keyd::token_path(socket);
    let hex = zeroize::Zeroizing::new(std::fs::read_to_string(&token_file).map_err(|e| {
        anyhow::anyhow!(
            "--keyd unix:{}: {}: {e}",
            socket.display(),
            token_file.display()
        )
    })?);
    let mut token = zeroize::Zeroizing::new([0u8; TOKEN_LEN]);
    crate::keyd::decode_hex(hex.trim(), &mut token)
        .ok_or_else(|| anyhow::anyhow!("{}: not a token", token_file.display()))?;
    KeydClient::connect(
        Endpoint {
            socket: socket.to_path_buf(),
            token,
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

/// A new directory for a daemon's socket (0700, or 0711 for a daemon that serves another
/// user), under $XDG_RUNTIME_DIR or the temporary directory.
pub fn private_dir(mode: u32) -> anyhow::Result<PathBuf> {
    use std::os::unix::fs::DirBuilderExt;
    let base = std::env::var_os("XDG_RUNTIME_DIR")
        .map(PathBuf::from)
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
        crate::keyd::encode_hex(&rnd).as_str()
    ));
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&dir)
        .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", dir.display()))?;
    if mode != 0o700 {
        // After creation: the umask would have masked the mode given to mkdir.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode))?;
    }
    Ok(dir)
}
