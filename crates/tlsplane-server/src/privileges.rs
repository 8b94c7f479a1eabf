//! `--user`: a server started as root gives root up once its ports are bound, as nginx's
//! workers do, while its private keys stay with a key daemon that keeps root.
//!
//! A key daemon killed after the switch must come back with the keys, which the server can
//! no longer read; so with `--user` the server first starts a launcher (`tlsplane
//! keyd-launcher`, hidden) that stays root and whose only job is to start key daemons when
//! the server asks. The launcher chooses where each daemon listens (a fresh root-owned
//! directory): a server that was taken over can ask for a new daemon, never for a root
//! process to touch a path of its choosing.

use std::ffi::OsString;
use std::io::{BufRead, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Who the server becomes: `NAME` (its primary group and supplementary groups) or
/// `UID[:GID]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunAs {
    pub name: Option<String>,
    pub uid: u32,
    pub gid: u32,
}

impl FromStr for RunAs {
    type Err = String;

    fn from_str(s: &str) -> Result<RunAs, String> {
        let numeric = |t: &str| t.parse::<u32>().ok();
        if let Some(uid) = s.split(':').next().and_then(numeric) {
            let gid = match s.split_once(':') {
                None => uid,
                Some((_, g)) => numeric(g).ok_or_else(|| format!("{s:?}: not UID:GID"))?,
            };
            return Ok(RunAs {
                name: None,
                uid,
                gid,
            });
        }
        match tlsplane_sys::lookup_user(s) {
            Ok(Some((uid, gid))) => Ok(RunAs {
                name: Some(s.to_string()),
                uid,
                gid,
            }),
            Ok(None) => Err(format!("no user {s:?} on this system")),
            Err(e) => Err(format!("cannot look up user {s:?}: {e}")),
        }
    }
}

impl std::fmt::Display for RunAs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.name {
            Some(n) => write!(f, "{n} (uid {}, gid {})", self.uid, self.gid),
            None => write!(f, "uid {}, gid {}", self.uid, self.gid),
        }
    }
}

impl RunAs {
    /// Refuses to start when the switch cannot happen (not root).
    pub fn check_can_switch(&self) -> anyhow::Result<()> {
        let me = tlsplane_sys::current_uid();
        if me != 0 && me != self.uid {
            anyhow::bail!("--user {self}: only root can switch users (this is uid {me})");
        }
        Ok(())
    }

    /// Switches this process for good (after the ports are bound).
    pub fn switch(&self) -> anyhow::Result<()> {
        tlsplane_sys::switch_user(self.name.as_deref(), self.uid, self.gid)
            .map_err(|e| anyhow::anyhow!("cannot switch to {self}: {e}"))?;
        tracing::info!("running as {self}");
        Ok(())
    }
}

/// Arguments of the hidden `keyd-launcher` subcommand.
#[derive(clap::Args, Debug)]
pub struct LauncherArgs {
    /// The server's pid: the launcher dies with it.
    #[arg(long)]
    pub parent: u32,
    /// The server's user id after the switch, allowed to use the daemons.
    #[arg(long)]
    pub allow_uid: u32,
    /// What each daemon loads (`--config FILE` or `--key PEM`).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pub daemon_args: Vec<OsString>,
}

/// How many daemons a launcher runs at once: the one in use, its spare, one being started and
/// one being stopped. A server that was taken over cannot make it start more.
const MAX_LAUNCHED: usize = 4;

/// The launcher's protocol, one line each way: `spawn HEXTOKEN` (a daemon that reads the key
/// files) or `copy HEXTOKEN PID` (one that takes the keys of daemon PID, one of this
/// launcher's) → `spawned PID SOCKET` or `failed REASON`; `stop PID` → nothing; and unasked,
/// `exited PID STATUS` when a daemon it started ends other than by `stop`. Closing its stdin
/// stops every daemon and the launcher.
pub fn run_launcher(args: LauncherArgs) -> anyhow::Result<()> {
    tlsplane_sys::set_non_dumpable()?;
    tlsplane_sys::die_with_parent(libc::SIGKILL, args.parent)?;
    let daemons: Arc<Mutex<Vec<Daemon>>> = Arc::default();
    let out = Arc::new(Mutex::new(std::io::stdout()));
    let say = {
        let out = out.clone();
        move |line: String| {
            let mut o = out.lock().unwrap_or_else(|e| e.into_inner());
            let _ = writeln!(o, "{line}");
            let _ = o.flush();
        }
    };
    {
        let (daemons, say) = (daemons.clone(), say.clone());
        std::thread::spawn(move || loop {
            std::thread::sleep(Duration::from_millis(20));
            let mut all = daemons.lock().unwrap_or_else(|e| e.into_inner());
            let mut i = 0;
            while i < all.len() {
                match all[i].child.try_wait() {
                    Ok(Some(status)) => {
                        let d = all.swap_remove(i);
                        let _ = std::fs::remove_dir_all(&d.dir);
                        say(format!("exited {} {status}", d.child.id()));
                    }
                    _ => i += 1,
                }
            }
        });
    }
    let take = |pid: u32| -> Option<Daemon> {
        let mut all = daemons.lock().unwrap_or_else(|e| e.into_inner());
        let i = all.iter().position(|d| d.child.id() == pid)?;
        Some(all.swap_remove(i))
    };
    let mut stdin = std::io::stdin().lock();
    loop {
        // Bounded: the server on the other end may be one that was taken over.
        let mut line = zeroize::Zeroizing::new(String::new());
        if (&mut stdin).take(256).read_line(&mut line)? == 0 {
            break;
        }
        if !line.ends_with('\n') {
            say("failed request too long".into());
            break;
        }
        let words: Vec<&str> = line.split_whitespace().collect();
        let (hex, from) = match words.as_slice() {
            ["stop", pid] => {
                if let Some(mut d) = pid.parse().ok().and_then(take) {
                    // Apart: a stuck daemon takes a second to give up on.
                    std::thread::spawn(move || {
                        stop_daemon(&mut d.child, d.stdin.take());
                        let _ = std::fs::remove_dir_all(&d.dir);
                    });
                }
                continue;
            }
            ["spawn", hex] => (*hex, None),
            ["copy", hex, pid] => {
                let all = daemons.lock().unwrap_or_else(|e| e.into_inner());
                match all.iter().find(|d| pid.parse() == Ok(d.child.id())) {
                    Some(d) => (*hex, Some(d.socket.clone())),
                    None => {
                        say(format!("failed no daemon {pid} of this launcher"));
                        continue;
                    }
                }
            }
            _ => {
                say("failed unknown request".into());
                continue;
            }
        };
        if daemons.lock().unwrap_or_else(|e| e.into_inner()).len() >= MAX_LAUNCHED {
            say(format!("failed {MAX_LAUNCHED} daemons run already"));
            continue;
        }
        match start_daemon(&args, hex, from.as_deref()) {
            Ok(d) => {
                say(format!("spawned {} {}", d.child.id(), d.socket.display()));
                daemons.lock().unwrap_or_else(|e| e.into_inner()).push(d);
            }
            Err(e) => say(format!("failed {e:#}")),
        }
    }
    let all = std::mem::take(&mut *daemons.lock().unwrap_or_else(|e| e.into_inner()));
    for mut d in all {
        stop_daemon(&mut d.child, d.stdin.take());
        let _ = std::fs::remove_dir_all(&d.dir);
    }
    Ok(())
}

/// A daemon a launcher started: the process, the pipe whose closing stops it, its socket and
/// the socket's directory.
struct Daemon {
    child: Child,
    stdin: Option<ChildStdin>,
    dir: PathBuf,
    socket: PathBuf,
}

/// An orderly exit first (the daemon zeroizes its keys when its stdin closes), then SIGKILL.
pub fn stop_daemon(child: &mut Child, stdin: Option<ChildStdin>) {
    drop(stdin);
    let deadline = Instant::now() + Duration::from_secs(1);
    while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// A daemon for the server, reading the key files or, with `from`, taking the keys of the
/// daemon listening there.
fn start_daemon(args: &LauncherArgs, hex: &str, from: Option<&Path>) -> anyhow::Result<Daemon> {
    let mut token = zeroize::Zeroizing::new([0u8; tlsplane::keyd::TOKEN_LEN]);
    crate::keyd::decode_hex(hex, &mut token).ok_or_else(|| anyhow::anyhow!("not a token"))?;
    // Root's directory, searchable by all: the server (another user now) reaches the socket
    // but cannot replace it. Who may use it is checked per connection (SO_PEERCRED) and by
    // the token.
    let dir = crate::keyd::private_dir(0o711)?;
    let socket = dir.join("keyd.sock");
    let allow = args.allow_uid.to_string();
    let mut extra = vec![
        std::ffi::OsString::from("--allow-uid"),
        allow.into(),
        "--socket-mode".into(),
        "666".into(),
    ];
    if let Some(from) = from {
        extra.extend(["--copy-from".into(), from.as_os_str().to_owned()]);
    }
    let (child, stdin) =
        crate::keyd::start_daemon_process(&socket, &args.daemon_args, &extra, &token)?;
    Ok(Daemon {
        child,
        stdin: Some(stdin),
        dir,
        socket,
    })
}

/// The server's end of a launcher.
pub struct Launcher {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: std::sync::mpsc::Receiver<String>,
    /// Daemons it said ended, and how, not yet asked about.
    exited: std::collections::HashMap<u32, String>,
}

/// What the launcher said about a daemon.
pub enum Event {
    Spawned { pid: u32, socket: PathBuf },
    Failed(String),
    Exited { pid: u32, status: String },
}

impl Launcher {
    /// Starts one, as root, before the server switches users.
    pub fn start(allow_uid: u32, daemon_args: &[OsString]) -> anyhow::Result<Launcher> {
        let mut child = Command::new(std::env::current_exe()?)
            .arg("keyd-launcher")
            .arg("--parent")
            .arg(std::process::id().to_string())
            .arg("--allow-uid")
            .arg(allow_uid.to_string())
            .arg("--")
            .args(daemon_args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| anyhow::anyhow!("cannot start the key daemon launcher: {e}"))?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("keyd-launcher".into())
            .spawn(move || {
                for line in std::io::BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            })?;
        Ok(Launcher {
            child,
            stdin,
            lines,
            exited: Default::default(),
        })
    }

    fn say(&mut self, line: &str) -> anyhow::Result<()> {
        let stdin = self
            .stdin
            .as_mut()
            .ok_or_else(|| anyhow::anyhow!("the key daemon launcher is stopped"))?;
        stdin
            .write_all(line.as_bytes())
            .and_then(|()| stdin.flush())
            .map_err(|e| anyhow::anyhow!("the key daemon launcher is gone: {e}"))
    }

    /// Asks for a daemon with `token`, reading the key files, or with `copy_of` taking the
    /// keys of that daemon (one this launcher started); its pid and socket.
    pub fn spawn(
        &mut self,
        hex_token: &str,
        copy_of: Option<u32>,
    ) -> anyhow::Result<(u32, PathBuf)> {
        let request = zeroize::Zeroizing::new(match copy_of {
            None => format!("spawn {hex_token}\n"),
            Some(pid) => format!("copy {hex_token} {pid}\n"),
        });
        self.say(&request)?;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.next(left) {
                Some(Event::Spawned { pid, socket }) => return Ok((pid, socket)),
                Some(Event::Failed(why)) => anyhow::bail!("{why}"),
                Some(Event::Exited { pid, status }) => {
                    self.exited.insert(pid, status);
                }
                None if self.child.try_wait()?.is_some() => {
                    anyhow::bail!("the key daemon launcher is gone")
                }
                None => anyhow::bail!("the key daemon launcher did not answer"),
            }
        }
    }

    /// Stops daemon `pid` (in the background: a stuck one takes a second).
    pub fn stop(&mut self, pid: u32) {
        let _ = self.say(&format!("stop {pid}\n"));
        self.exited.remove(&pid);
    }

    /// How daemon `pid` ended, if the launcher said it has, waiting up to `wait` for news.
    pub fn exited(&mut self, pid: u32, wait: Duration) -> Option<String> {
        if let Some(Event::Exited { pid, status }) = self.next(wait) {
            self.exited.insert(pid, status);
        }
        while let Some(Event::Exited { pid, status }) = self.next(Duration::ZERO) {
            self.exited.insert(pid, status);
        }
        self.exited.remove(&pid)
    }

    /// The launcher's next word, waiting up to `wait`.
    fn next(&mut self, wait: Duration) -> Option<Event> {
        let line = self.lines.recv_timeout(wait).ok()?;
        let mut words = line.splitn(3, ' ');
        match (words.next(), words.next(), words.next()) {
            (Some("spawned"), Some(pid), Some(socket)) => Some(Event::Spawned {
                pid: pid.parse().ok()?,
                socket: PathBuf::from(socket),
            }),
            (Some("exited"), Some(pid), rest) => Some(Event::Exited {
                pid: pid.parse().ok()?,
                status: rest.unwrap_or("").to_string(),
            }),
            (Some("failed"), first, rest) => Some(Event::Failed(
                [first, rest]
                    .into_iter()
                    .flatten()
                    .collect::<Vec<_>>()
                    .join(" "),
            )),
            _ => Some(Event::Failed(format!(
                "unexpected word from the launcher: {line}"
            ))),
        }
    }

    /// Whether the launcher itself has ended.
    pub fn is_gone(&mut self) -> bool {
        !matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Launcher {
    fn drop(&mut self) {
        // The launcher stops its daemon (orderly) and exits when its stdin closes.
        stop_daemon(&mut self.child, self.stdin.take());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn users_are_named_or_numbered() {
        let root: RunAs = "root".parse().unwrap();
        assert_eq!(
            (root.uid, root.gid, root.name.as_deref()),
            (0, 0, Some("root"))
        );
        let n: RunAs = "65534".parse().unwrap();
        assert_eq!((n.uid, n.gid, n.name), (65534, 65534, None));
        let ng: RunAs = "1000:33".parse().unwrap();
        assert_eq!((ng.uid, ng.gid), (1000, 33));
        assert!("1000:x".parse::<RunAs>().is_err());
        assert!("no-such-user-here"
            .parse::<RunAs>()
            .unwrap_err()
            .contains("no user"));
    }
}
