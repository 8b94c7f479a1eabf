//! Unix listening sockets that no other user can replace, redirect or use to change another
//! file's mode.
//!
//! A socket file is only as safe as its directory: whoever can write the directory can
//! remove the socket (while its server restarts, say) and bind their own in its place, or
//! swap in a symlink between a `bind` and a `chmod` by path, so that a server running as
//! root changes the mode of any file. So a socket goes only into a directory that root or
//! this process's user owns and no one else can write, every ancestor likewise (a sticky
//! one, as /tmp, lets no other user rename what root or this user owns in it), and so does
//! every directory and symlink the path as given goes through (clients use that path: a
//! symlink another user owns there could be pointed elsewhere later); it is bound
//! under a temporary name there, given its mode, and renamed into place, so that the path
//! never names a socket of another mode, and a stale socket left by a killed server is
//! replaced in one step.

use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use socket2::{Domain, SockAddr, Socket, Type};

/// The mode a missing socket directory is created with: anyone may reach the socket in it
/// (who is served is the server's decision, e.g. `SO_PEERCRED`), only its owner may write.
pub const DIR_MODE: u32 = 0o755;

/// Connections the kernel queues before the server accepts them.
const BACKLOG: i32 = 1024;

/// Binds a listening stream socket at `path` with file mode `mode`, creating its directory
/// ([`DIR_MODE`]) when missing. Refuses a directory that another user could write, a path
/// that is something else than a socket, and a socket that a live server listens on.
/// `what` names the socket in errors ("hand-off socket").
pub fn bind(what: &str, path: &Path, mode: u32) -> anyhow::Result<UnixListener> {
    let socket = bind_as(what, path, mode, Type::STREAM)?;
    Ok(UnixListener::from(std::os::fd::OwnedFd::from(socket)))
}

/// [`bind`] for a listening socket of type `ty` (the key daemon's is `SOCK_SEQPACKET`).
pub fn bind_as(what: &str, path: &Path, mode: u32, ty: Type) -> anyhow::Result<Socket> {
    let name = path
        .file_name()
        .with_context(|| format!("{what} {}: no file name", path.display()))?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let created = !dir.exists();
    if created {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(DIR_MODE)
            .create(dir)
            .with_context(|| format!("{what} {}: creating {}", path.display(), dir.display()))?;
    }
    let dir = check_dir(what, path)?;
    if created {
        // Its own mode, whatever the umask took away (checked above: ours, in a safe parent).
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(DIR_MODE))
            .with_context(|| format!("{what} {}: {}", path.display(), dir.display()))?;
    }
    let path = dir.join(name);
    refuse_taken(what, &path, ty)?;
    let temporary = dir.join(format!(
        ".{}.{}.tmp",
        name.to_string_lossy(),
        std::process::id()
    ));
    let _ = std::fs::remove_file(&temporary);
    let listen = || -> std::io::Result<Socket> {
        let socket = Socket::new(Domain::UNIX, ty.cloexec(), None)?;
        socket.bind(&SockAddr::unix(&temporary)?)?;
        socket.listen(BACKLOG)?;
        Ok(socket)
    };
    let socket = listen().with_context(|| format!("{what} {}", path.display()))?;
    // By path, in a directory only root and this user can write: nothing can be swapped in.
    let placed = std::fs::set_permissions(&temporary, std::fs::Permissions::from_mode(mode))
        .and_then(|()| std::fs::rename(&temporary, &path));
    if let Err(e) = placed {
        let _ = std::fs::remove_file(&temporary);
        return Err(e).with_context(|| format!("{what} {}", path.display()));
    }
    Ok(socket)
}

/// The canonical directory of the socket at `path`, if no user but root and this one could
/// write it or an ancestor (see [`bind`]); else an error that names the fix. For a server
/// that writes files beside its socket before binding it.
pub fn check_dir(what: &str, path: &Path) -> anyhow::Result<PathBuf> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let canonical = dir
        .canonicalize()
        .with_context(|| format!("{what} {}: its directory", path.display()))?;
    owned_by_us(&canonical)
        .and_then(|()| walk_is_ours(dir))
        .map_err(|why| {
            anyhow::anyhow!(
                "{what} {}: {why}: another user could replace the socket. Use a directory that \
             only root or this user ({}) can write, e.g. $RUNTIME_DIRECTORY or /run/tlsplane \
             (created with mode {DIR_MODE:o} when missing)",
                path.display(),
                tlsplane_sys::effective_uid()
            )
        })?;
    Ok(canonical)
}

/// Why the path `dir`, as given, goes through a symlink or a directory that a user other
/// than root and this one could change, if it does: each symlink must be owned by root or
/// this user, each directory passed through as [`owned_by_us`] wants an ancestor (the
/// canonical directory itself is checked there).
fn walk_is_ours(dir: &Path) -> Result<(), String> {
    use std::path::Component;
    const MAX_LINKS: usize = 40;
    let me = tlsplane_sys::effective_uid();
    let start = if dir.is_absolute() {
        PathBuf::from("/")
    } else {
        std::env::current_dir().map_err(|e| format!("the current directory: {e}"))?
    };
    let mut at = start;
    let mut left: Vec<std::ffi::OsString> = Vec::new();
    // Reversed: the next component is popped from the end.
    fn push(left: &mut Vec<std::ffi::OsString>, p: &Path) {
        left.extend(p.components().rev().map(|c| c.as_os_str().to_os_string()));
    }
    push(&mut left, dir);
    let mut links = 0;
    while let Some(c) = left.pop() {
        match Path::new(&c).components().next() {
            Some(Component::RootDir) => at = PathBuf::from("/"),
            Some(Component::ParentDir) => {
                at.pop();
            }
            Some(Component::Normal(name)) => {
                let next = at.join(name);
                let meta = std::fs::symlink_metadata(&next)
                    .map_err(|e| format!("{}: {e}", next.display()))?;
                if meta.file_type().is_symlink() {
                    if meta.uid() != 0 && meta.uid() != me {
                        return Err(format!(
                            "{} is a symlink owned by uid {}",
                            next.display(),
                            meta.uid()
                        ));
                    }
                    links += 1;
                    if links > MAX_LINKS {
                        return Err(format!("{}: too many symlinks", dir.display()));
                    }
                    let target = std::fs::read_link(&next)
                        .map_err(|e| format!("{}: {e}", next.display()))?;
                    push(&mut left, &target);
                } else {
                    ancestor_is_ours(&next, meta.uid(), meta.mode())?;
                    at = next;
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// Why directory `d` (owner `uid`, `mode`) on the way to the socket's could be changed by a
/// user other than root and this one, if it could (a sticky one may be writable).
fn ancestor_is_ours(d: &Path, uid: u32, mode: u32) -> Result<(), String> {
    let me = tlsplane_sys::effective_uid();
    if uid != 0 && uid != me {
        return Err(format!("{} is owned by uid {uid}", d.display()));
    }
    if mode & 0o022 != 0 && mode & 0o1000 == 0 {
        return Err(format!(
            "{} is writable by others (mode {:o})",
            d.display(),
            mode & 0o7777
        ));
    }
    Ok(())
}

/// Why `dir` (canonical) could be written by a user other than root and this one, if it
/// could: it or an ancestor is owned by another user, or group- or world-writable (an
/// ancestor may be, if sticky: its entries owned by root or this user stay theirs).
fn owned_by_us(dir: &Path) -> Result<(), String> {
    let me = tlsplane_sys::effective_uid();
    let mut at = Some(dir);
    let mut last = true;
    while let Some(d) = at {
        let meta = std::fs::metadata(d).map_err(|e| format!("{}: {e}", d.display()))?;
        let (uid, mode) = (meta.uid(), meta.mode());
        if uid != 0 && uid != me {
            return Err(format!("{} is owned by uid {uid}", d.display()));
        }
        let sticky = mode & 0o1000 != 0;
        if mode & 0o022 != 0 && (last || !sticky) {
            return Err(format!(
                "{} is writable by {} (mode {:o})",
                d.display(),
                if mode & 0o002 != 0 {
                    "anyone"
                } else {
                    "its group"
                },
                mode & 0o7777
            ));
        }
        last = false;
        at = d.parent();
    }
    Ok(())
}

/// Refuses a path that is not a socket, or that a live server listens on.
fn refuse_taken(what: &str, path: &Path, ty: Type) -> anyhow::Result<()> {
    use std::os::unix::fs::FileTypeExt;
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return Ok(());
    };
    if !meta.file_type().is_socket() {
        bail!(
            "{what}: {} exists and is not a socket; remove it or choose another path",
            path.display()
        );
    }
    if let Some(why) = listened_on(path, ty) {
        bail!(
            "{what}: something already listens on {} ({why})",
            path.display()
        );
    }
    Ok(())
}

/// Whether a server listens on the socket file at `path` (what a probe's connect said), as
/// far as can be told: only a refusal (nobody bound to it: a dead server's) or its removal
/// says nobody does. A listener of another type (`EPROTOTYPE`), one whose backlog is full
/// (`EAGAIN`: the probe does not wait) or a probe not allowed to connect is taken as live.
fn listened_on(path: &Path, ty: Type) -> Option<String> {
    let probe = Socket::new(Domain::UNIX, ty.cloexec().nonblocking(), None)
        .and_then(|probe| probe.connect(&SockAddr::unix(path)?));
    match probe {
        Ok(()) => Some("it accepted a connection".into()),
        Err(e) if matches!(e.raw_os_error(), Some(libc::ECONNREFUSED | libc::ENOENT)) => None,
        Err(e) => Some(format!("a probe's connect: {e}")),
    }
}

/// The default directory for a product's sockets: systemd's `$RUNTIME_DIRECTORY` (its first
/// entry) when set, else `/run/tlsplane`.
pub fn default_dir() -> PathBuf {
    std::env::var_os("RUNTIME_DIRECTORY")
        .and_then(|v| {
            v.to_str()
                .and_then(|s| s.split(':').next())
                .filter(|s| !s.is_empty())
                .map(PathBuf::from)
        })
        .unwrap_or_else(|| PathBuf::from("/run/tlsplane"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    fn scratch(what: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "tlsplane-unix-socket-{what}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn a_socket_goes_into_a_created_directory_with_its_mode() {
        let base = scratch("created");
        let path = base.join("run/app.sock");
        let listener = bind("test socket", &path, 0o666).unwrap();
        let meta = std::fs::symlink_metadata(&path).unwrap();
        assert_eq!(meta.mode() & 0o777, 0o666);
        assert_eq!(
            std::fs::metadata(base.join("run")).unwrap().mode() & 0o777,
            DIR_MODE
        );
        UnixStream::connect(&path).expect("connectable");
        // A live one is not replaced; once closed, it is (a killed server's stale socket).
        assert!(bind("test socket", &path, 0o666).is_err());
        drop(listener);
        let _again = bind("test socket", &path, 0o600).unwrap();
        assert_eq!(
            std::fs::symlink_metadata(&path).unwrap().mode() & 0o777,
            0o600
        );
        // No temporary name is left behind.
        assert_eq!(std::fs::read_dir(base.join("run")).unwrap().count(), 1);
        let _ = std::fs::remove_dir_all(base);
    }

    #[test]
    fn a_live_listener_of_another_type_or_with_a_full_backlog_is_never_replaced() {
        let base = scratch("live");
        std::fs::create_dir_all(&base).unwrap();
        // A datagram-free SOCK_SEQPACKET listener: a stream probe fails with EPROTOTYPE.
        let path = base.join("seq.sock");
        let _seq = bind_as("test socket", &path, 0o600, Type::SEQPACKET).unwrap();
        let e = bind("test socket", &path, 0o600).unwrap_err();
        assert!(format!("{e:#}").contains("already listens"), "{e:#}");
        // A listener whose backlog is full: refused at once, not after a wait.
        let path = base.join("full.sock");
        let full = Socket::new(Domain::UNIX, Type::STREAM, None).unwrap();
        full.bind(&SockAddr::unix(&path).unwrap()).unwrap();
        full.listen(0).unwrap();
        let _queued: Vec<UnixStream> = (0..2)
            .filter_map(|_| {
                let s = Socket::new(Domain::UNIX, Type::STREAM.nonblocking(), None).unwrap();
                s.connect(&SockAddr::unix(&path).unwrap()).ok()?;
                Some(UnixStream::from(std::os::fd::OwnedFd::from(s)))
            })
            .collect();
        let (tx, rx) = std::sync::mpsc::channel();
        let p = path.clone();
        std::thread::spawn(move || {
            let _ = tx.send(
                bind("test socket", &p, 0o600)
                    .map(drop)
                    .map_err(|e| format!("{e:#}")),
            );
        });
        let got = rx
            .recv_timeout(std::time::Duration::from_secs(5))
            .expect("the probe waited on a full backlog");
        assert!(got.unwrap_err().contains("already listens"));
        let _ = std::fs::remove_dir_all(base);
    }

    #[test]
    fn a_path_through_a_symlink_another_user_owns_is_refused() {
        if tlsplane_sys::effective_uid() != 0 {
            return; // (lchown to another user needs root)
        }
        let base = scratch("symlink");
        std::fs::create_dir_all(base.join("real")).unwrap();
        std::os::unix::fs::symlink("real", base.join("ours")).unwrap();
        std::os::unix::fs::symlink("real", base.join("theirs")).unwrap();
        std::os::unix::fs::lchown(base.join("theirs"), Some(65534), Some(65534)).unwrap();
        // Ours: fine (its directory, `real`, is ours).
        bind("test socket", &base.join("ours/a.sock"), 0o600).unwrap();
        // Another user's, even pointing at our own directory: it could be repointed later.
        let e = bind("test socket", &base.join("theirs/b.sock"), 0o600).unwrap_err();
        assert!(
            format!("{e:#}").contains("symlink owned by uid 65534"),
            "{e:#}"
        );
        assert!(!base.join("real/b.sock").exists());
        // One met inside another symlink's target counts as well.
        std::os::unix::fs::symlink(base.join("theirs"), base.join("hop")).unwrap();
        assert!(bind("test socket", &base.join("hop/c.sock"), 0o600).is_err());
        let _ = std::fs::remove_dir_all(base);
    }

    #[test]
    fn a_directory_others_can_write_is_refused() {
        let base = scratch("shared");
        std::fs::create_dir_all(&base).unwrap();
        for mode in [0o777, 0o1777, 0o775] {
            std::fs::set_permissions(&base, std::fs::Permissions::from_mode(mode)).unwrap();
            let e = bind("test socket", &base.join("app.sock"), 0o666).unwrap_err();
            assert!(
                format!("{e:#}").contains("another user could replace"),
                "{e:#}"
            );
            assert!(!base.join("app.sock").exists());
        }
        // Below a sticky world-writable directory (as /tmp), a directory of ours is fine.
        std::fs::set_permissions(&base, std::fs::Permissions::from_mode(0o1777)).unwrap();
        bind("test socket", &base.join("own/app.sock"), 0o666).unwrap();
        // Not below a non-sticky one.
        std::fs::set_permissions(&base, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(bind("test socket", &base.join("own/b.sock"), 0o666).is_err());
        // Something else at the path is never replaced.
        std::fs::set_permissions(&base, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::write(base.join("file"), b"x").unwrap();
        assert!(bind("test socket", &base.join("file"), 0o666).is_err());
        assert_eq!(std::fs::read(base.join("file")).unwrap(), b"x");
        let _ = std::fs::remove_dir_all(base);
    }
}
