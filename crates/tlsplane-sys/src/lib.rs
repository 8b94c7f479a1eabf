//! Every `unsafe` line of tlsplane's server lives here (the hand-off's C ABI,
//! tlsplane-handoff-c, has its own).
//!
//! The rest of the workspace forbids unsafe code (`[workspace.lints]` in the root Cargo.toml)
//! and reaches the kernel only through the safe functions below: kTLS set-up (`TCP_ULP`, `SOL_TLS`/`TLS_TX`/`TLS_RX`), record-typed
//! `recvmsg`/`sendmsg` (`TLS_GET_RECORD_TYPE`/`TLS_SET_RECORD_TYPE` control messages),
//! `sendfile(2)` and descriptor passing (`SCM_RIGHTS`). The server's calls are non-blocking
//! (`MSG_DONTWAIT` or a non-blocking descriptor), so callers drive them from an event loop and
//! see `WouldBlock` like any other socket operation; the few meant for the hand-off's client
//! libraries ([`recv_record_blocking`], [`send_with_fd`], [`recv_with_fd`]) honour the
//! descriptor's own mode.

use std::io;
use std::mem::zeroed;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use zeroize::Zeroize;

/// Linux UAPI constants (include/uapi/linux/tls.h, include/uapi/linux/tcp.h). Spelled out here
/// rather than taken from `libc` so that the exact values the kernel ABI fixes are reviewable in
/// one place.
mod uapi {
    pub const SOL_TLS: libc::c_int = 282;
    pub const TCP_ULP: libc::c_int = 31;
    pub const TLS_TX: libc::c_int = 1;
    pub const TLS_RX: libc::c_int = 2;
    pub const TLS_SET_RECORD_TYPE: libc::c_int = 1;
    pub const TLS_GET_RECORD_TYPE: libc::c_int = 2;
    pub const TLS_1_2_VERSION: u16 = 0x0303;
    pub const TLS_1_3_VERSION: u16 = 0x0304;
    pub const TLS_CIPHER_AES_GCM_128: u16 = 51;
    pub const TLS_CIPHER_AES_GCM_256: u16 = 52;
    pub const TLS_CIPHER_CHACHA20_POLY1305: u16 = 54;
}

/// TLS protocol version as the kernel names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TlsVersion {
    Tls12,
    Tls13,
}

/// The AEADs the Linux software kTLS implementation accepts and tlsplane offers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KernelCipher {
    Aes128Gcm,
    Aes256Gcm,
    Chacha20Poly1305,
}

impl KernelCipher {
    pub const ALL: [KernelCipher; 3] = [Self::Aes128Gcm, Self::Aes256Gcm, Self::Chacha20Poly1305];

    pub fn key_len(self) -> usize {
        match self {
            Self::Aes128Gcm => 16,
            Self::Aes256Gcm | Self::Chacha20Poly1305 => 32,
        }
    }

    /// Length of the implicit salt the kernel keeps apart from the per-record IV.
    pub fn salt_len(self) -> usize {
        match self {
            Self::Aes128Gcm | Self::Aes256Gcm => 4,
            Self::Chacha20Poly1305 => 0,
        }
    }
}

/// Which direction of a socket a key is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    Tx,
    Rx,
}

/// The kernel's `tls12_crypto_info_*` struct for one direction, built from key material.
///
/// Holds a traffic key, so it is wiped when dropped, whether or not the setsockopt succeeded.
pub struct CryptoInfo {
    bytes: Vec<u8>,
}

/// Why a [`CryptoInfo`] could not be built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CryptoInfoError(&'static str);

impl std::fmt::Display for CryptoInfoError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

impl std::error::Error for CryptoInfoError {}

impl CryptoInfo {
    /// `salt` is the implicit part of the nonce (4 bytes for AES-GCM, empty for ChaCha20), `iv`
    /// the rest (8 bytes for AES-GCM, 12 for ChaCha20), `rec_seq` the sequence number of the
    /// next record in this direction.
    pub fn new(
        version: TlsVersion,
        cipher: KernelCipher,
        key: &[u8],
        salt: &[u8],
        iv: &[u8],
        rec_seq: u64,
    ) -> Result<Self, CryptoInfoError> {
        if key.len() != cipher.key_len() {
            return Err(CryptoInfoError("key length does not match the cipher"));
        }
        if salt.len() != cipher.salt_len() || salt.len() + iv.len() != 12 {
            return Err(CryptoInfoError("salt/iv lengths do not match the cipher"));
        }
        let version: u16 = match version {
            TlsVersion::Tls12 => uapi::TLS_1_2_VERSION,
            TlsVersion::Tls13 => uapi::TLS_1_3_VERSION,
        };
        let cipher_type: u16 = match cipher {
            KernelCipher::Aes128Gcm => uapi::TLS_CIPHER_AES_GCM_128,
            KernelCipher::Aes256Gcm => uapi::TLS_CIPHER_AES_GCM_256,
            KernelCipher::Chacha20Poly1305 => uapi::TLS_CIPHER_CHACHA20_POLY1305,
        };
        // Each `tls12_crypto_info_*` struct is the 4-byte `tls_crypto_info` header followed
        // only by byte arrays, so it has no padding and is exactly the concatenation
        // header, iv, key, salt, rec_seq (ChaCha20-Poly1305 has no salt). The capacity is
        // exact so that no reallocation leaves a copy of the key behind in freed memory.
        let len = 4 + iv.len() + key.len() + salt.len() + 8;
        let mut bytes = Vec::with_capacity(len);
        bytes.extend_from_slice(&version.to_ne_bytes());
        bytes.extend_from_slice(&cipher_type.to_ne_bytes());
        bytes.extend_from_slice(iv);
        bytes.extend_from_slice(key);
        bytes.extend_from_slice(salt);
        bytes.extend_from_slice(&rec_seq.to_be_bytes());
        debug_assert_eq!(bytes.len(), len);
        Ok(Self { bytes })
    }
}

impl Drop for CryptoInfo {
    fn drop(&mut self) {
        self.bytes.zeroize();
    }
}

fn cvt(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

fn cvt_size(ret: libc::ssize_t) -> io::Result<usize> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret as usize)
    }
}

/// Attaches the "tls" upper-layer protocol to a connected TCP socket.
///
/// Fails with `ENOENT` when the kernel has no TLS ULP (module absent or not built), which is the
/// usual reason to stay on the user-space plane. A socket with the ULP but no keys still behaves
/// as plain TCP, so a later decision not to offload is harmless.
pub fn attach_tls_ulp(sock: BorrowedFd<'_>) -> io::Result<()> {
    let name = b"tls";
    // SAFETY: `sock` is a live descriptor for the duration of the borrow; the option value
    // points at a 3-byte buffer whose exact length is passed.
    cvt(unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_TCP,
            uapi::TCP_ULP,
            name.as_ptr() as *const libc::c_void,
            name.len() as libc::socklen_t,
        )
    })?;
    Ok(())
}

/// `struct open_how` of `openat2(2)` (linux/openat2.h, version 0: 24 bytes). libc's copy is
/// `#[non_exhaustive]`, so it cannot be built outside libc.
#[repr(C)]
struct OpenHow {
    flags: u64,
    mode: u64,
    resolve: u64,
}

/// `RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS`: the kernel fails the open with `EXDEV` if any step
/// of the path walk (`..`, an absolute symlink, a symlink leading out) leaves `dir`.
pub const RESOLVE_BENEATH: u64 = libc::RESOLVE_BENEATH | libc::RESOLVE_NO_MAGICLINKS;

/// `openat2(2)`: opens `path` relative to `dir` with `flags` (`O_CLOEXEC` is added) under the
/// path-walk restrictions in `resolve`. Kernels before 5.6 fail with `ENOSYS`.
pub fn openat2(
    dir: BorrowedFd<'_>,
    path: &std::ffi::CStr,
    flags: libc::c_int,
    resolve: u64,
) -> io::Result<OwnedFd> {
    let how = OpenHow {
        flags: (flags | libc::O_CLOEXEC) as u64,
        mode: 0,
        resolve,
    };
    // SAFETY: `dir` is live for the borrow, `path` is NUL-terminated, and `how` is an
    // initialised open_how whose exact size is passed; the kernel only reads both.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            dir.as_raw_fd(),
            path.as_ptr(),
            &how as *const OpenHow,
            std::mem::size_of::<OpenHow>(),
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a non-negative return of openat2 is a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit, as servers do at start-up (one open file
/// per connection; the usual soft default of 1024 would cap a server far below what the system
/// allows). Returns the soft limit in force afterwards.
pub fn raise_nofile_limit() -> io::Result<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid, exclusively borrowed rlimit the kernel fills in.
    cvt(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) })?;
    if lim.rlim_cur < lim.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: lim.rlim_max,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: `raised` is an initialised rlimit the kernel only reads.
        cvt(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) })?;
        lim.rlim_cur = lim.rlim_max;
    }
    Ok(lim.rlim_cur)
}

/// Bytes waiting in a socket's receive queue (`FIONREAD`), without reading them. Unlike a
/// `recv(MSG_PEEK)`, this does not make kTLS decrypt (and, for a bad record, count a second
/// decryption error for the read that follows).
pub fn queued_bytes(sock: BorrowedFd<'_>) -> io::Result<usize> {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one c_int through the pointer, which is valid and exclusive.
    cvt(unsafe { libc::ioctl(sock.as_raw_fd(), libc::FIONREAD, &mut n) })?;
    Ok(n.max(0) as usize)
}

/// Attaches a classic BPF program to a socket (`SO_ATTACH_FILTER`), replacing any other; with
/// an empty program, detaches the socket's filter (`SO_DETACH_FILTER`; none attached is fine).
/// On a listening TCP socket the program sees each SYN (and handshake ACK) before the kernel
/// makes a connection of it; returning 0 drops the packet. Connections accepted later start
/// with the filter the listener had when they were made.
pub fn set_socket_filter(sock: BorrowedFd<'_>, program: &[libc::sock_filter]) -> io::Result<()> {
    if program.is_empty() {
        let none: libc::c_int = 0;
        // SAFETY: SO_DETACH_FILTER reads no option value; the pointer and length are valid.
        let r = cvt(unsafe {
            libc::setsockopt(
                sock.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_DETACH_FILTER,
                (&none as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        });
        return match r {
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
            r => r.map(drop),
        };
    }
    let len = u16::try_from(program.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "BPF program too long"))?;
    let fprog = libc::sock_fprog {
        len,
        filter: program.as_ptr().cast_mut(),
    };
    // SAFETY: fprog points at `program`, valid for `len` instructions for the duration of the
    // call; the kernel copies (and checks) the program and keeps no pointer to it.
    cvt(unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_ATTACH_FILTER,
            (&fprog as *const libc::sock_fprog).cast(),
            std::mem::size_of::<libc::sock_fprog>() as libc::socklen_t,
        )
    })?;
    Ok(())
}

/// Sets the nice value of the calling thread only (Linux schedules threads, and
/// `setpriority(PRIO_PROCESS, tid)` addresses one). Raising it needs no privilege.
pub fn set_current_thread_nice(nice: i32) -> io::Result<()> {
    // SAFETY: gettid has no preconditions and cannot fail.
    let tid = unsafe { libc::gettid() };
    // SAFETY: plain integer arguments; the kernel validates them.
    cvt(unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice) })?;
    Ok(())
}

/// Makes this process non-dumpable (`PR_SET_DUMPABLE 0`): no core dump, and no other process
/// of the same user may ptrace it or read its memory through /proc/PID/mem (the key daemon).
pub fn set_non_dumpable() -> io::Result<()> {
    // SAFETY: prctl with integer arguments only.
    cvt(unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) })?;
    Ok(())
}

/// Asks the kernel to send `signal` to this process when its parent exits
/// (`PR_SET_PDEATHSIG`), then checks that the parent is still `parent` (it may have exited
/// before the call, which the kernel would not report).
pub fn die_with_parent(signal: i32, parent: u32) -> io::Result<()> {
    // SAFETY: prctl with integer arguments only.
    cvt(unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, signal as libc::c_ulong, 0, 0, 0) })?;
    // SAFETY: getppid has no preconditions.
    if unsafe { libc::getppid() } as u32 != parent {
        return Err(io::Error::other("the parent process is gone"));
    }
    Ok(())
}

/// The user id of the process at the other end of a connected Unix socket (`SO_PEERCRED`).
pub fn peer_uid(sock: BorrowedFd<'_>) -> io::Result<u32> {
    peer_cred(sock).map(|(_, uid)| uid)
}

/// The process id and user id of the process at the other end of a connected Unix socket,
/// as they were when it connected (`SO_PEERCRED`).
pub fn peer_cred(sock: BorrowedFd<'_>) -> io::Result<(u32, u32)> {
    ucred(sock).map(|c| (c.pid as u32, c.uid))
}

/// The user id and group id of the process at the other end of a connected Unix socket, as
/// they were when it connected (`SO_PEERCRED`): what `tlsplane handoff` checks a receiver by.
pub fn peer_ids(sock: BorrowedFd<'_>) -> io::Result<(u32, u32)> {
    ucred(sock).map(|c| (c.uid, c.gid))
}

fn ucred(sock: BorrowedFd<'_>) -> io::Result<libc::ucred> {
    // SAFETY: a zeroed ucred is a valid value of this plain C struct.
    let mut cred: libc::ucred = unsafe { zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: SO_PEERCRED writes at most `len` bytes into `cred`, which outlives the call.
    cvt(unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    })?;
    Ok(cred)
}

/// `SO_PEERGROUPS` (Linux 4.13): `asm-generic/socket.h`, which every architecture tlsplane
/// builds for uses (alpha, mips, parisc and sparc number it otherwise).
const SO_PEERGROUPS: libc::c_int = 59;

/// The supplementary group ids of the process at the other end of a connected Unix socket,
/// as they were when it connected (`SO_PEERGROUPS`): with [`peer_ids`], what a group check
/// must look at (a process's effective group is only one of its groups).
pub fn peer_groups(sock: BorrowedFd<'_>) -> io::Result<Vec<u32>> {
    // NGROUPS_MAX is 65536; start small and grow to what the kernel asks for (ERANGE).
    let mut groups: Vec<libc::gid_t> = vec![0; 32];
    loop {
        let mut len = (groups.len() * std::mem::size_of::<libc::gid_t>()) as libc::socklen_t;
        // SAFETY: SO_PEERGROUPS writes at most `len` bytes into `groups`, which outlives the
        // call, and sets `len` to the bytes written (or, with ERANGE, to the bytes needed).
        let r = unsafe {
            libc::getsockopt(
                sock.as_raw_fd(),
                libc::SOL_SOCKET,
                SO_PEERGROUPS,
                groups.as_mut_ptr().cast(),
                &mut len,
            )
        };
        let n = len as usize / std::mem::size_of::<libc::gid_t>();
        match cvt(r) {
            Ok(_) => {
                groups.truncate(n);
                return Ok(groups);
            }
            Err(e) if e.raw_os_error() == Some(libc::ERANGE) && n > groups.len() => {
                groups.resize(n, 0);
            }
            Err(e) => return Err(e),
        }
    }
}

/// `SO_PEERPIDFD` (Linux 6.5): `asm-generic/socket.h`, as [`SO_PEERGROUPS`].
const SO_PEERPIDFD: libc::c_int = 77;

/// A pidfd of the process at the other end of a connected Unix socket: the one that
/// connected, as `SO_PEERCRED`'s pid names it, even if that process has exited since
/// (`SO_PEERPIDFD`, Linux 6.5). Unlike a pid, it can never come to name another process.
pub fn peer_pidfd(sock: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    let mut fd: libc::c_int = -1;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: SO_PEERPIDFD writes at most `len` bytes (one int) into `fd`, which outlives the
    // call.
    cvt(unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_PEERPIDFD,
            (&mut fd as *mut libc::c_int).cast(),
            &mut len,
        )
    })?;
    if fd < 0 {
        return Err(io::Error::other("SO_PEERPIDFD returned no descriptor"));
    }
    // SAFETY: the kernel installed `fd` for us (close-on-exec); nobody else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `pidfd_open(2)` (Linux 5.3): a pidfd of process `pid` as it is now. Taken right after the
/// process connected, it names that process unless the pid was reused in between; prefer
/// [`peer_pidfd`] where the kernel has it.
pub fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    let pid =
        libc::pid_t::try_from(pid).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: pidfd_open takes a pid and flags (0), no pointer; a non-negative return is a new
    // descriptor (close-on-exec) that only this OwnedFd owns.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    let fd = cvt(fd as libc::c_int)?;
    // SAFETY: as above.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Whether the process `pidfd` names has not been reaped yet (it runs, or is a zombie):
/// `pidfd_send_signal(2)` with signal 0, which checks existence only. Not allowed to signal
/// it (`EPERM`) still means it exists.
pub fn pidfd_process_exists(pidfd: BorrowedFd<'_>) -> io::Result<bool> {
    // SAFETY: pidfd_send_signal with signal 0 and a null siginfo sends nothing; the
    // descriptor is borrowed for the call.
    let r = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            0,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    match cvt(r as libc::c_int) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EPERM) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::ESRCH) => Ok(false),
        Err(e) => Err(e),
    }
}

/// One `recv(2)` with `MSG_DONTWAIT`, whatever the descriptor's mode (shared with a thread
/// that writes blocking). No control buffer: descriptors the peer attached are closed by the
/// kernel as they arrive. `Ok(0)` with a non-empty `buf` is end of stream.
pub fn recv_nonblocking(sock: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: the kernel writes at most `buf.len()` bytes into `buf`, borrowed for the call.
    cvt_size(unsafe {
        libc::recv(
            sock.as_raw_fd(),
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_DONTWAIT,
        )
    })
}

/// Waits until `sock` has input or its end (or an error) to read, or `timeout_ms` passes
/// (`Ok(false)`; -1: no limit), with poll(2).
pub fn wait_readable(sock: BorrowedFd<'_>, timeout_ms: i32) -> io::Result<bool> {
    poll_one(sock, libc::POLLIN | libc::POLLRDHUP, timeout_ms)
}

/// poll(2) on one descriptor for `events`, again after a signal: whether any came within
/// `timeout_ms` (-1: no limit).
fn poll_one(sock: BorrowedFd<'_>, events: libc::c_short, timeout_ms: i32) -> io::Result<bool> {
    let mut p = libc::pollfd {
        fd: sock.as_raw_fd(),
        events,
        revents: 0,
    };
    loop {
        // SAFETY: one valid pollfd that outlives the call.
        match cvt(unsafe { libc::poll(&mut p, 1, timeout_ms) }) {
            Ok(n) => return Ok(n > 0),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
}

/// The effective user id of this process: the owner of the files it creates, and the one
/// its sockets' `SO_PEERCRED` reports.
pub fn effective_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// The real user id of this process.
pub fn current_uid() -> u32 {
    // SAFETY: getuid has no preconditions and cannot fail.
    unsafe { libc::getuid() }
}

/// A user's id and primary group id, from the password database (`getpwnam_r`).
pub fn lookup_user(name: &str) -> io::Result<Option<(u32, u32)>> {
    let cname = std::ffi::CString::new(name)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in a user name"))?;
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        // SAFETY: a zeroed passwd is a valid value of this plain C struct.
        let mut pwd: libc::passwd = unsafe { zeroed() };
        let mut found: *mut libc::passwd = std::ptr::null_mut();
        // SAFETY: every pointer is valid for the call: the name is NUL-terminated, `buf` is
        // `buf.len()` bytes that outlive the call, `pwd` and `found` are ours.
        let rc = unsafe {
            libc::getpwnam_r(
                cname.as_ptr(),
                &mut pwd,
                buf.as_mut_ptr().cast(),
                buf.len(),
                &mut found,
            )
        };
        match rc {
            0 if found.is_null() => return Ok(None),
            0 => return Ok(Some((pwd.pw_uid, pwd.pw_gid))),
            libc::ERANGE if buf.len() < 1 << 20 => buf.resize(buf.len() * 4, 0),
            e => return Err(io::Error::from_raw_os_error(e)),
        }
    }
}

/// Switches the whole process (every thread: glibc applies set*id to all of them) to `uid`
/// and `gid` for good: real, effective and saved ids, and the supplementary groups of `name`
/// (or only `gid` without a name). Then checks that root cannot be regained.
pub fn switch_user(name: Option<&str>, uid: u32, gid: u32) -> io::Result<()> {
    match name {
        Some(name) => {
            let cname = std::ffi::CString::new(name)
                .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in a user name"))?;
            // SAFETY: a NUL-terminated name and an integer.
            cvt(unsafe { libc::initgroups(cname.as_ptr(), gid) })?;
        }
        None => {
            let groups = [gid];
            // SAFETY: `groups` holds 1 valid gid_t for the duration of the call.
            cvt(unsafe { libc::setgroups(1, groups.as_ptr()) })?;
        }
    }
    // SAFETY: integer arguments only; groups first, while we may still change them.
    cvt(unsafe { libc::setresgid(gid, gid, gid) })?;
    // SAFETY: integer arguments only.
    cvt(unsafe { libc::setresuid(uid, uid, uid) })?;
    if uid != 0 {
        // SAFETY: integer argument only; it must fail now.
        if unsafe { libc::setuid(0) } == 0 {
            return Err(io::Error::other("root could be regained after the switch"));
        }
    }
    Ok(())
}

/// Sends SIGHUP to a process (`tlsplane reload`).
pub fn send_sighup(pid: i32) -> io::Result<()> {
    if pid <= 0 {
        // kill(0 or negative) would signal a whole process group.
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not a process id",
        ));
    }
    // SAFETY: plain integer arguments; a positive pid addresses one process.
    cvt(unsafe { libc::kill(pid, libc::SIGHUP) })?;
    Ok(())
}

/// The calling thread's kernel id, to address it with [`signal_thread`].
pub fn thread_id() -> i32 {
    // SAFETY: gettid takes nothing and cannot fail.
    unsafe { libc::gettid() }
}

/// Sends `signal` to one thread of this process (tgkill): a signal that lands on a thread
/// blocked in a system call, as a process-directed one may. Tests use it to check that such
/// calls go on.
pub fn signal_thread(tid: i32, signal: i32) -> io::Result<()> {
    if tid <= 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not a thread id",
        ));
    }
    // SAFETY: plain integer arguments; tgkill addresses one thread of this process only.
    cvt(unsafe { libc::syscall(libc::SYS_tgkill, libc::getpid(), tid, signal) } as libc::c_int)?;
    Ok(())
}

/// Installs a key for one direction (`TLS_TX` or `TLS_RX`).
pub fn set_crypto_info(
    sock: BorrowedFd<'_>,
    direction: Direction,
    info: &CryptoInfo,
) -> io::Result<()> {
    let optname = match direction {
        Direction::Tx => uapi::TLS_TX,
        Direction::Rx => uapi::TLS_RX,
    };
    // SAFETY: the descriptor is live for the borrow; the option value is the initialised
    // crypto-info struct held in `info.bytes`, passed with its exact length, and the kernel
    // copies it before returning.
    cvt(unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            uapi::SOL_TLS,
            optname,
            info.bytes.as_ptr() as *const libc::c_void,
            info.bytes.len() as libc::socklen_t,
        )
    })?;
    Ok(())
}

/// The sequence number of the next record the kernel will send on this socket (`rec_seq` of
/// `getsockopt(SOL_TLS, TLS_TX)`): under the current key, the records sent so far, counting
/// those rustls sent before the hand-off (the sequence was installed with the key). `cipher`
/// must be the TX key's cipher: the kernel wants the struct's exact size.
///
/// The kernel answers with the whole crypto-info struct, key included, so the copy is wiped
/// before this returns.
pub fn tx_record_seq(sock: BorrowedFd<'_>, cipher: KernelCipher) -> io::Result<u64> {
    // header, iv, key, salt, rec_seq: the layout `CryptoInfo::new` writes.
    let len = 4 + (12 - cipher.salt_len()) + cipher.key_len() + cipher.salt_len() + 8;
    let mut buf = [0u8; 56];
    let mut optlen = len as libc::socklen_t;
    // SAFETY: the descriptor is live for the borrow; `buf` is valid for writes of `len` bytes
    // (at most 56, its size) and `optlen` is a valid, exclusively borrowed length the kernel
    // updates.
    let r = cvt(unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            uapi::SOL_TLS,
            uapi::TLS_TX,
            buf.as_mut_ptr() as *mut libc::c_void,
            &mut optlen,
        )
    });
    let seq = u64::from_be_bytes(buf[len - 8..len].try_into().expect("8-byte rec_seq"));
    let short = (optlen as usize) < len;
    buf.zeroize();
    r?;
    if short {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "the kernel returned a shorter TLS_TX crypto info than its cipher's",
        ));
    }
    Ok(seq)
}

/// The soft `RLIMIT_NOFILE`: how many descriptors this process may have open.
pub fn nofile_limit() -> io::Result<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid, exclusively borrowed rlimit the kernel fills in.
    cvt(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) })?;
    Ok(lim.rlim_cur)
}

/// Room for one `cmsghdr` carrying a single byte, with the alignment the kernel expects.
#[repr(C, align(8))]
struct CmsgBuf([u8; 64]);

/// Receives from a kTLS RX socket, reporting the TLS content type of the record the bytes came
/// from. The kernel never mixes record types in one call: application data comes back as type
/// 23, and an alert or handshake record is returned on its own with its type.
///
/// Non-blocking (`MSG_DONTWAIT`). `Ok((0, 23))` is TCP EOF.
pub fn recv_record(sock: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<(usize, u8)> {
    recv_record_flags(sock, buf, libc::MSG_DONTWAIT)
}

fn recv_record_flags(
    sock: BorrowedFd<'_>,
    buf: &mut [u8],
    flags: libc::c_int,
) -> io::Result<(usize, u8)> {
    let mut cmsg = CmsgBuf([0; 64]);
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr() as *mut libc::c_void,
        iov_len: buf.len(),
    };
    // SAFETY: msghdr is a plain C struct for which all-zero is a valid value.
    let mut msg: libc::msghdr = unsafe { zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cmsg.0.as_mut_ptr() as *mut libc::c_void;
    msg.msg_controllen = cmsg.0.len() as _;
    // SAFETY: `msg` points at `iov` (which covers exactly `buf`) and at `cmsg`, all of which
    // outlive the call; the kernel writes at most their stated lengths.
    let n = cvt_size(unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, flags) })?;
    let mut record_type = 23u8;
    // SAFETY: CMSG_FIRSTHDR/CMSG_NXTHDR walk the control buffer the kernel filled, bounded by
    // the msg_controllen it set; CMSG_DATA of a SOL_TLS/TLS_GET_RECORD_TYPE header points at
    // one byte inside that buffer.
    unsafe {
        let mut hdr = libc::CMSG_FIRSTHDR(&msg);
        while !hdr.is_null() {
            if (*hdr).cmsg_level == uapi::SOL_TLS && (*hdr).cmsg_type == uapi::TLS_GET_RECORD_TYPE {
                record_type = *libc::CMSG_DATA(hdr);
            }
            hdr = libc::CMSG_NXTHDR(&msg, hdr);
        }
    }
    Ok((n, record_type))
}

/// Sends `data` as one or more records of the given TLS content type through kTLS TX (used for
/// alerts, close_notify and post-handshake messages). Non-blocking.
pub fn send_record(sock: BorrowedFd<'_>, record_type: u8, data: &[u8]) -> io::Result<usize> {
    let mut cmsg = CmsgBuf([0; 64]);
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    // SAFETY: all-zero msghdr is valid.
    let mut msg: libc::msghdr = unsafe { zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cmsg.0.as_mut_ptr() as *mut libc::c_void;
    // SAFETY: CMSG_SPACE/CMSG_LEN are pure size computations.
    let space = unsafe { libc::CMSG_SPACE(1) } as usize;
    assert!(space <= cmsg.0.len());
    msg.msg_controllen = space as _;
    // SAFETY: the control buffer is `space` bytes long and aligned, so CMSG_FIRSTHDR returns a
    // valid header pointer into it and CMSG_DATA points at the byte after that header. The
    // kernel only reads `data` (the iovec's mutable pointer type is the C API's, not a write).
    unsafe {
        let hdr = libc::CMSG_FIRSTHDR(&msg);
        (*hdr).cmsg_level = uapi::SOL_TLS;
        (*hdr).cmsg_type = uapi::TLS_SET_RECORD_TYPE;
        (*hdr).cmsg_len = libc::CMSG_LEN(1) as _;
        *libc::CMSG_DATA(hdr) = record_type;
        cvt_size(libc::sendmsg(
            sock.as_raw_fd(),
            &msg,
            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
        ))
    }
}

/// Like [`recv_record`], but honours the descriptor's own blocking mode (no `MSG_DONTWAIT`),
/// for client libraries whose callers chose a blocking socket.
pub fn recv_record_blocking(sock: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<(usize, u8)> {
    recv_record_flags(sock, buf, 0)
}

/// Control buffer for exactly one `SCM_RIGHTS` descriptor, aligned as `cmsghdr` wants.
#[repr(C, align(8))]
struct OneFdCmsg([u8; 24]);

/// A `msghdr` over `iov` and a control buffer of exactly the room one descriptor takes.
fn one_fd_msghdr(iov: &mut libc::iovec, cmsg: &mut OneFdCmsg) -> libc::msghdr {
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    assert!(space <= cmsg.0.len());
    // SAFETY: all-zero msghdr is valid.
    let mut msg: libc::msghdr = unsafe { zeroed() };
    msg.msg_iov = iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cmsg.0.as_mut_ptr() as *mut libc::c_void;
    msg.msg_controllen = space as _;
    msg
}

/// `sendmsg(2)` of `bytes` on a Unix socket with one descriptor attached (`SCM_RIGHTS`),
/// `MSG_NOSIGNAL` (a vanished peer is `EPIPE`, not a signal). The descriptor is duplicated into
/// the receiver when it reads; the caller's copy stays open. Returns the bytes sent: on a
/// stream socket possibly fewer than `bytes.len()` (the descriptor went with the first of
/// them); the rest is the caller's to send without a descriptor.
pub fn send_with_fd(sock: BorrowedFd<'_>, bytes: &[u8], fd: BorrowedFd<'_>) -> io::Result<usize> {
    if bytes.is_empty() {
        // Linux drops the control data of an empty message on a stream socket.
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "a descriptor must travel with at least one byte",
        ));
    }
    let mut cmsg = OneFdCmsg([0; 24]);
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    let msg = one_fd_msghdr(&mut iov, &mut cmsg);
    // SAFETY: the control buffer is CMSG_SPACE(int) bytes, aligned, so CMSG_FIRSTHDR is a valid header
    // pointer into it and CMSG_DATA points at room for one int after it (written unaligned, as
    // the C macros allow). The kernel only reads `bytes` and the control buffer, both borrowed
    // for the call, and takes its own reference on the descriptor, which is live for its borrow.
    unsafe {
        let hdr = libc::CMSG_FIRSTHDR(&msg);
        (*hdr).cmsg_level = libc::SOL_SOCKET;
        (*hdr).cmsg_type = libc::SCM_RIGHTS;
        (*hdr).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(hdr) as *mut RawFd, fd.as_raw_fd());
        cvt_size(libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL))
    }
}

/// `recvmsg(2)` on a Unix socket, taking at most one `SCM_RIGHTS` descriptor
/// (`MSG_CMSG_CLOEXEC`: it arrives close-on-exec). Honours the socket's blocking mode;
/// `EINTR` is returned to the caller, as from `read`.
///
/// Never leaks a descriptor: if the sender attached more than one, or the control data was cut
/// short (`MSG_CTRUNC`: the kernel then closes what did not fit), every descriptor that did
/// arrive is closed and the call fails with `InvalidData`. The control buffer has room for one
/// descriptor only, so on a socket with `SO_PASSCRED` set the credentials do not fit and every
/// read fails that way. `Ok((0, None))` with a non-empty `buf` is end of stream.
pub fn recv_with_fd(sock: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<(usize, Option<OwnedFd>)> {
    let mut cmsg = OneFdCmsg([0; 24]);
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr() as *mut libc::c_void,
        iov_len: buf.len(),
    };
    let mut msg = one_fd_msghdr(&mut iov, &mut cmsg);
    // SAFETY: `msg` points at `iov` (exactly `buf`) and at `cmsg` (`msg_controllen` bytes), all
    // outliving the call; the kernel writes at most their stated lengths.
    let n = cvt_size(unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) })?;
    let mut fds: Vec<OwnedFd> = Vec::new();
    // SAFETY: the walk is bounded by the msg_controllen the kernel set (at most the buffer's). An
    // SCM_RIGHTS header's payload is `cmsg_len - CMSG_LEN(0)` bytes of ints inside the buffer,
    // read unaligned; each is a new descriptor the kernel installed for us, owned by nobody
    // else, so wrapping it in an OwnedFd (which closes it on drop) is sound.
    unsafe {
        let mut hdr = libc::CMSG_FIRSTHDR(&msg);
        while !hdr.is_null() {
            if (*hdr).cmsg_level == libc::SOL_SOCKET && (*hdr).cmsg_type == libc::SCM_RIGHTS {
                let payload = ((*hdr).cmsg_len as usize).saturating_sub(libc::CMSG_LEN(0) as usize);
                let data = libc::CMSG_DATA(hdr) as *const RawFd;
                for i in 0..payload / std::mem::size_of::<RawFd>() {
                    let fd = std::ptr::read_unaligned(data.add(i));
                    if fd >= 0 {
                        fds.push(OwnedFd::from_raw_fd(fd));
                    }
                }
            }
            hdr = libc::CMSG_NXTHDR(&msg, hdr);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 || fds.len() > 1 {
        drop(fds); // closes each one
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "more than one descriptor (or truncated control data) in one message",
        ));
    }
    Ok((n, fds.pop()))
}

/// `sendfile(2)` from `file` at `*offset` to `sock`, advancing `*offset` by what was sent.
/// The socket must be non-blocking for this not to block.
pub fn sendfile(
    sock: BorrowedFd<'_>,
    file: BorrowedFd<'_>,
    offset: &mut u64,
    count: usize,
) -> io::Result<usize> {
    let mut off: libc::off_t = i64::try_from(*offset)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "file offset too large"))?;
    // SAFETY: both descriptors are live for their borrows; `off` is a valid, exclusively
    // borrowed off_t the kernel updates in place.
    let n =
        cvt_size(unsafe { libc::sendfile(sock.as_raw_fd(), file.as_raw_fd(), &mut off, count) })?;
    *offset = off as u64;
    Ok(n)
}

/// A pipe for `splice(2)`: both ends non-blocking, close-on-exec.
pub struct Pipe {
    pub read: OwnedFd,
    pub write: OwnedFd,
}

impl Pipe {
    pub fn new() -> io::Result<Self> {
        let mut fds = [0 as RawFd; 2];
        // SAFETY: pipe2 writes two descriptors into the array, which is valid and exclusive.
        cvt(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) })?;
        // SAFETY: on success both descriptors are new and owned by nobody else.
        Ok(unsafe {
            Self {
                read: OwnedFd::from_raw_fd(fds[0]),
                write: OwnedFd::from_raw_fd(fds[1]),
            }
        })
    }

    /// The pipe's capacity in bytes (64 KiB unless changed).
    pub fn capacity(&self) -> io::Result<usize> {
        // SAFETY: F_GETPIPE_SZ takes no argument and returns the size.
        let n = cvt(unsafe { libc::fcntl(self.write.as_raw_fd(), libc::F_GETPIPE_SZ) })?;
        Ok(n as usize)
    }
}

/// `splice(2)` of up to `len` bytes from `from` to `to` (one of them a pipe), non-blocking
/// (`SPLICE_F_NONBLOCK`: EAGAIN rather than a wait on either end). `Ok(0)`: end of input.
pub fn splice(from: BorrowedFd<'_>, to: BorrowedFd<'_>, len: usize) -> io::Result<usize> {
    // SAFETY: both descriptors are live for their borrows; null offsets mean "the current
    // position" (required for pipes and sockets), so the kernel writes through no pointer.
    cvt_size(unsafe {
        libc::splice(
            from.as_raw_fd(),
            std::ptr::null_mut(),
            to.as_raw_fd(),
            std::ptr::null_mut(),
            len,
            libc::SPLICE_F_NONBLOCK | libc::SPLICE_F_MOVE,
        )
    })
}

/// `send(2)` with `MSG_MORE`: the kernel keeps the TLS record open so that what follows (the
/// file body after response headers) shares a record instead of costing one of its own.
pub fn send_more(sock: BorrowedFd<'_>, data: &[u8]) -> io::Result<usize> {
    // SAFETY: the pointer and length describe `data`, borrowed for the call; the descriptor is
    // live for its borrow.
    cvt_size(unsafe {
        libc::send(
            sock.as_raw_fd(),
            data.as_ptr() as *const libc::c_void,
            data.len(),
            libc::MSG_MORE | libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
        )
    })
}

/// `accept4(2)` with `SOCK_NONBLOCK | SOCK_CLOEXEC`: the connection comes out non-blocking,
/// without the `ioctl(FIONBIO)` per connection that `std`'s accept and `set_nonblocking` cost.
pub fn accept_nonblocking(
    listener: BorrowedFd<'_>,
) -> io::Result<(std::net::TcpStream, std::net::SocketAddr)> {
    // SAFETY: an all-zero sockaddr_storage is a valid (unspecified) address.
    let mut addr: libc::sockaddr_storage = unsafe { zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    // SAFETY: `addr` and `len` are valid and exclusive for the call, and `len` holds the size
    // of `addr`; the kernel writes at most that many bytes.
    let fd = cvt(unsafe {
        libc::accept4(
            listener.as_raw_fd(),
            &mut addr as *mut libc::sockaddr_storage as *mut libc::sockaddr,
            &mut len,
            libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
        )
    })?;
    // SAFETY: accept4 returned a new descriptor that nothing else owns.
    let tcp = unsafe { std::net::TcpStream::from_raw_fd(fd) };
    let peer = match addr.ss_family as libc::c_int {
        libc::AF_INET => {
            // SAFETY: the family says the storage holds a sockaddr_in, which it is large
            // and aligned enough for.
            let a =
                unsafe { &*(&addr as *const libc::sockaddr_storage as *const libc::sockaddr_in) };
            std::net::SocketAddr::from((
                std::net::Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr)),
                u16::from_be(a.sin_port),
            ))
        }
        libc::AF_INET6 => {
            // SAFETY: as above, for a sockaddr_in6.
            let a =
                unsafe { &*(&addr as *const libc::sockaddr_storage as *const libc::sockaddr_in6) };
            std::net::SocketAddr::V6(std::net::SocketAddrV6::new(
                std::net::Ipv6Addr::from(a.sin6_addr.s6_addr),
                u16::from_be(a.sin6_port),
                a.sin6_flowinfo,
                a.sin6_scope_id,
            ))
        }
        _ => tcp.peer_addr()?,
    };
    Ok((tcp, peer))
}

/// Registers a listening socket with the current tokio runtime (call it inside one) for
/// readiness only, so that connections can be accepted without being registered themselves:
/// a connection refused by a limit then costs accept(2) and close(2), not two epoll_ctl calls
/// more, as with `tokio::net::TcpListener::accept`.
pub fn async_listener(
    l: std::net::TcpListener,
) -> io::Result<tokio::io::unix::AsyncFd<std::net::TcpListener>> {
    l.set_nonblocking(true)?;
    // SAFETY: the AsyncFd takes ownership of `l`; its descriptor stays open and refers to the
    // same socket until the AsyncFd drops it, which deregisters it first.
    unsafe { tokio::io::unix::AsyncFd::register(l) }.map_err(|e| e.into_parts().1)
}

/// Registers a mio epoll instance with the current tokio runtime (call it inside one): the
/// instance's descriptor turns readable when a socket registered in it has an event. Lets one
/// task watch many sockets that have no tokio registration of their own.
pub fn async_epoll(poll: mio::Poll) -> io::Result<tokio::io::unix::AsyncFd<mio::Poll>> {
    // SAFETY: the AsyncFd takes ownership of `poll`; its epoll descriptor stays open and refers
    // to the same instance until the AsyncFd drops it, which deregisters it first.
    unsafe { tokio::io::unix::AsyncFd::register(poll) }.map_err(|e| e.into_parts().1)
}

/// An epoll instance that watches sockets for the peer's end of the connection only
/// (`EPOLLRDHUP`, plus the `EPOLLHUP`/`EPOLLERR` epoll always reports), edge-triggered: the
/// hand-off keeps a duplicate of each socket it gave a program and must learn when the client
/// has gone without waking for every byte the program's reads take. A socket may also be
/// watched for input (`EPOLLIN`), for a lingering close.
///
/// epoll keys a registration by descriptor *and* open file description, and removes it only
/// when the last descriptor of that description closes: the program holds another one, so a
/// caller must [`PeerEndWatch::forget`] a socket before closing its own descriptor.
pub struct PeerEndWatch {
    epoll: OwnedFd,
}

impl PeerEndWatch {
    pub fn new() -> io::Result<Self> {
        // SAFETY: epoll_create1 takes no pointer; a non-negative return is a new descriptor
        // that only this OwnedFd owns.
        let fd = cvt(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) })?;
        // SAFETY: `fd` was just returned by the kernel and is owned by nobody else.
        Ok(Self {
            epoll: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }

    /// Watches `sock` under `token`: for its peer's end, and for input too when `input`.
    pub fn watch(&self, sock: BorrowedFd<'_>, token: u64, input: bool) -> io::Result<()> {
        let mut events = libc::EPOLLRDHUP | libc::EPOLLET;
        if input {
            events |= libc::EPOLLIN;
        }
        self.add(sock, token, events)
    }

    /// Watches `sock` under `token` for room to write (and its peer's end, and errors).
    pub fn watch_output(&self, sock: BorrowedFd<'_>, token: u64) -> io::Result<()> {
        self.add(
            sock,
            token,
            libc::EPOLLOUT | libc::EPOLLRDHUP | libc::EPOLLET,
        )
    }

    fn add(&self, sock: BorrowedFd<'_>, token: u64, events: libc::c_int) -> io::Result<()> {
        let mut ev = libc::epoll_event {
            events: events as u32,
            u64: token,
        };
        // SAFETY: `ev` is a valid epoll_event that outlives the call; both descriptors are open.
        cvt(unsafe {
            libc::epoll_ctl(
                self.epoll.as_raw_fd(),
                libc::EPOLL_CTL_ADD,
                sock.as_raw_fd(),
                &mut ev,
            )
        })
        .map(drop)
    }

    /// Stops watching `sock` (before its descriptor is closed: see the type's note).
    pub fn forget(&self, sock: BorrowedFd<'_>) -> io::Result<()> {
        let mut ev = libc::epoll_event { events: 0, u64: 0 };
        // SAFETY: as in `watch`; the event argument is ignored by EPOLL_CTL_DEL but must be
        // non-null on old kernels.
        cvt(unsafe {
            libc::epoll_ctl(
                self.epoll.as_raw_fd(),
                libc::EPOLL_CTL_DEL,
                sock.as_raw_fd(),
                &mut ev,
            )
        })
        .map(drop)
    }

    /// Waits up to `timeout_ms` (-1: no limit) and appends the tokens of the sockets that had
    /// an event to `out`. `EINTR` is an empty wait.
    pub fn wait(&self, out: &mut Vec<u64>, timeout_ms: i32) -> io::Result<()> {
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; 64];
        // SAFETY: the kernel writes at most `events.len()` entries into the array.
        let n = unsafe {
            libc::epoll_wait(
                self.epoll.as_raw_fd(),
                events.as_mut_ptr(),
                events.len() as libc::c_int,
                timeout_ms,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            return if e.kind() == io::ErrorKind::Interrupted {
                Ok(())
            } else {
                Err(e)
            };
        }
        out.extend(events[..n as usize].iter().map(|e| e.u64));
        Ok(())
    }
}

/// Waits until `sock` can be written or `timeout_ms` passes (`Ok(false)`), with poll(2): for
/// a descriptor whose blocking mode belongs to someone else (a handed-off socket).
pub fn wait_writable(sock: BorrowedFd<'_>, timeout_ms: i32) -> io::Result<bool> {
    poll_one(sock, libc::POLLOUT, timeout_ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pidfd_tells_a_living_or_zombie_process_from_a_reaped_one() {
        use std::os::fd::AsFd;
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        // Our own process, by the socket's peer (where the kernel has SO_PEERPIDFD) and by pid.
        if let Ok(fd) = peer_pidfd(a.as_fd()) {
            assert!(pidfd_process_exists(fd.as_fd()).unwrap());
        }
        let own = pidfd_open(std::process::id()).unwrap();
        assert!(pidfd_process_exists(own.as_fd()).unwrap());
        drop(b);
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let fd = pidfd_open(child.id()).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert!(
            pidfd_process_exists(fd.as_fd()).unwrap(),
            "a zombie still exists"
        );
        child.wait().unwrap();
        assert!(!pidfd_process_exists(fd.as_fd()).unwrap(), "reaped");
    }

    #[test]
    fn a_nonblocking_recv_does_not_wait_and_sees_the_end() {
        use std::io::Write;
        use std::os::fd::AsFd;
        let (a, mut b) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut buf = [0u8; 8];
        let e = recv_nonblocking(a.as_fd(), &mut buf).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
        assert!(!wait_readable(a.as_fd(), 0).unwrap());
        b.write_all(b"abc").unwrap();
        assert!(wait_readable(a.as_fd(), 1000).unwrap());
        assert_eq!(recv_nonblocking(a.as_fd(), &mut buf).unwrap(), 3);
        drop(b);
        assert!(wait_readable(a.as_fd(), 1000).unwrap());
        assert_eq!(recv_nonblocking(a.as_fd(), &mut buf).unwrap(), 0);
    }

    #[test]
    fn a_unix_peer_reports_its_groups() {
        use std::os::fd::AsFd;
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        // SAFETY: getgroups with a zero size only counts.
        let n = unsafe { libc::getgroups(0, std::ptr::null_mut()) };
        let mut own = vec![0 as libc::gid_t; n.max(0) as usize];
        // SAFETY: `own` has room for the `n` groups counted above.
        let n = unsafe { libc::getgroups(n, own.as_mut_ptr()) };
        own.truncate(n.max(0) as usize);
        let mut got = peer_groups(a.as_fd()).unwrap();
        got.sort_unstable();
        own.sort_unstable();
        own.dedup();
        got.dedup();
        assert_eq!(got, own);
        drop(b);
    }

    #[test]
    fn openat2_beneath_refuses_every_way_out() {
        use std::ffi::CString;
        use std::os::fd::AsFd;
        let base =
            std::env::temp_dir().join(format!("tlsplane-sys-openat2-{}", std::process::id()));
        let root = base.join("root");
        std::fs::create_dir_all(root.join("sub")).unwrap();
        std::fs::write(root.join("sub/in.txt"), b"in").unwrap();
        std::fs::write(root.join("top.txt"), b"top").unwrap();
        std::fs::write(base.join("out.txt"), b"out").unwrap();
        std::os::unix::fs::symlink("../top.txt", root.join("sub/rel")).unwrap();
        std::os::unix::fs::symlink("../out.txt", root.join("up")).unwrap();
        std::os::unix::fs::symlink(base.join("out.txt"), root.join("abs")).unwrap();
        let dir = std::fs::File::open(&root).unwrap();
        let open = |p: &str| {
            let p = CString::new(p).unwrap();
            openat2(dir.as_fd(), &p, libc::O_RDONLY, RESOLVE_BENEATH)
        };
        let read = |fd: OwnedFd| {
            std::fs::read_to_string(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap()
        };
        match open("sub/in.txt") {
            Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => {
                std::fs::remove_dir_all(&base).unwrap();
                return; // kernel before 5.6: callers fall back to their own checks
            }
            r => assert_eq!(read(r.unwrap()), "in"),
        }
        // A symlink that stays inside is followed.
        assert_eq!(read(open("sub/rel").unwrap()), "top");
        for way_out in ["../out.txt", "up", "abs", "sub/../../out.txt"] {
            let e = open(way_out).unwrap_err();
            assert_eq!(e.raw_os_error(), Some(libc::EXDEV), "{way_out}");
        }
        std::fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn crypto_info_sizes_match_the_kernel_abi() {
        // Sizes of tls12_crypto_info_{aes_gcm_128,aes_gcm_256,chacha20_poly1305} in
        // include/uapi/linux/tls.h; a mismatch makes setsockopt return EINVAL.
        let v = TlsVersion::Tls13;
        let a128 =
            CryptoInfo::new(v, KernelCipher::Aes128Gcm, &[0; 16], &[0; 4], &[0; 8], 0).unwrap();
        let a256 =
            CryptoInfo::new(v, KernelCipher::Aes256Gcm, &[0; 32], &[0; 4], &[0; 8], 0).unwrap();
        let chacha = CryptoInfo::new(
            v,
            KernelCipher::Chacha20Poly1305,
            &[0; 32],
            &[],
            &[0; 12],
            0,
        )
        .unwrap();
        assert_eq!(a128.bytes.len(), 40);
        assert_eq!(a256.bytes.len(), 56);
        assert_eq!(chacha.bytes.len(), 56);
    }

    #[test]
    fn crypto_info_encodes_fields_in_order() {
        let key = [0x11u8; 16];
        let info = CryptoInfo::new(
            TlsVersion::Tls13,
            KernelCipher::Aes128Gcm,
            &key,
            &[1, 2, 3, 4],
            &[5; 8],
            7,
        )
        .unwrap();
        let b = &info.bytes;
        assert_eq!(&b[0..2], &0x0304u16.to_ne_bytes());
        assert_eq!(&b[2..4], &51u16.to_ne_bytes());
        assert_eq!(&b[4..12], &[5; 8]);
        assert_eq!(&b[12..28], &key);
        assert_eq!(&b[28..32], &[1, 2, 3, 4]);
        assert_eq!(&b[32..40], &7u64.to_be_bytes());
    }

    #[test]
    fn tx_record_seq_of_a_socket_without_tls_is_an_error() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        use std::os::fd::AsFd;
        for cipher in KernelCipher::ALL {
            assert!(tx_record_seq(c.as_fd(), cipher).is_err());
        }
    }

    #[test]
    fn crypto_info_rejects_wrong_lengths() {
        assert!(CryptoInfo::new(
            TlsVersion::Tls13,
            KernelCipher::Aes256Gcm,
            &[0; 16],
            &[0; 4],
            &[0; 8],
            0
        )
        .is_err());
        assert!(CryptoInfo::new(
            TlsVersion::Tls12,
            KernelCipher::Chacha20Poly1305,
            &[0; 32],
            &[0; 4],
            &[0; 8],
            0
        )
        .is_err());
        assert!(CryptoInfo::new(
            TlsVersion::Tls12,
            KernelCipher::Chacha20Poly1305,
            &[0; 32],
            &[],
            &[0; 12],
            0
        )
        .is_ok());
    }

    /// How many of this process's descriptors refer to `path` (by /proc/self/fd's links):
    /// robust against other tests opening descriptors at the same time.
    fn open_copies_of(path: &std::path::Path) -> usize {
        std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
            .filter(|l| l == path)
            .count()
    }

    fn scratch_file(tag: &str) -> (std::path::PathBuf, std::fs::File) {
        let path = std::env::temp_dir().join(format!(
            "tlsplane-sys-fd-{tag}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        (path, f)
    }

    /// Sends `fds` in one SCM_RIGHTS message, as a misbehaving sender could.
    fn send_many_fds(sock: BorrowedFd<'_>, fds: &[RawFd]) {
        #[repr(C, align(8))]
        struct Big([u8; 128]);
        let mut cmsg = Big([0; 128]);
        let data_len = std::mem::size_of_val(fds) as u32;
        // SAFETY: test-only: the control buffer is 128 bytes, enough for CMSG_SPACE of the few
        // descriptors given; `byte` and `cmsg` outlive the sendmsg.
        unsafe {
            let space = libc::CMSG_SPACE(data_len) as usize;
            assert!(space <= 128);
            let byte = [7u8];
            let mut iov = libc::iovec {
                iov_base: byte.as_ptr() as *mut libc::c_void,
                iov_len: 1,
            };
            let mut msg: libc::msghdr = zeroed();
            msg.msg_iov = &mut iov;
            msg.msg_iovlen = 1;
            msg.msg_control = cmsg.0.as_mut_ptr() as *mut libc::c_void;
            msg.msg_controllen = space as _;
            let hdr = libc::CMSG_FIRSTHDR(&msg);
            (*hdr).cmsg_level = libc::SOL_SOCKET;
            (*hdr).cmsg_type = libc::SCM_RIGHTS;
            (*hdr).cmsg_len = libc::CMSG_LEN(data_len) as _;
            std::ptr::copy_nonoverlapping(
                fds.as_ptr() as *const u8,
                libc::CMSG_DATA(hdr),
                data_len as usize,
            );
            assert_eq!(libc::sendmsg(sock.as_raw_fd(), &msg, 0), 1);
        }
    }

    #[test]
    fn a_descriptor_travels_with_its_bytes() {
        use std::io::{Read, Seek, Write};
        use std::os::fd::AsFd;
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let (path, mut file) = scratch_file("one");
        file.write_all(b"through the socket").unwrap();
        assert_eq!(open_copies_of(&path), 1);
        assert_eq!(send_with_fd(a.as_fd(), b"header", file.as_fd()).unwrap(), 6);
        let mut buf = [0u8; 64];
        let (n, fd) = recv_with_fd(b.as_fd(), &mut buf).unwrap();
        assert_eq!(&buf[..n], b"header");
        let fd = fd.expect("a descriptor");
        assert_eq!(open_copies_of(&path), 2);
        // It arrived close-on-exec, and is the same open file.
        // SAFETY: F_GETFD on a live descriptor.
        let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFD) };
        assert_eq!(flags & libc::FD_CLOEXEC, libc::FD_CLOEXEC);
        let mut got = std::fs::File::from(fd);
        got.rewind().unwrap();
        let mut text = String::new();
        got.read_to_string(&mut text).unwrap();
        assert_eq!(text, "through the socket");
        drop(got);
        assert_eq!(open_copies_of(&path), 1);
        // Bytes without a descriptor come back with None; EOF is (0, None).
        (&a).write_all(b"plain").unwrap();
        let (n, fd) = recv_with_fd(b.as_fd(), &mut buf).unwrap();
        assert_eq!((&buf[..n], fd.is_none()), (&b"plain"[..], true));
        drop(a);
        let (n, fd) = recv_with_fd(b.as_fd(), &mut buf).unwrap();
        assert_eq!((n, fd.is_none()), (0, true));
        // A descriptor needs at least one byte to travel with.
        let (c, _d) = std::os::unix::net::UnixStream::pair().unwrap();
        assert!(send_with_fd(c.as_fd(), b"", file.as_fd()).is_err());
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn extra_or_truncated_descriptors_are_all_closed() {
        use std::os::fd::AsFd;
        let (path, file) = scratch_file("many");
        for count in [2usize, 3, 5] {
            let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
            let fds = vec![file.as_raw_fd(); count];
            send_many_fds(a.as_fd(), &fds);
            // In flight, the kernel holds references, not descriptors of ours.
            assert_eq!(open_copies_of(&path), 1);
            let mut buf = [0u8; 8];
            let e = recv_with_fd(b.as_fd(), &mut buf).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{count} descriptors");
            assert_eq!(open_copies_of(&path), 1, "{count} descriptors: one leaked");
        }
        // A peer on a pipe, not a socket: a clean error, nothing opened.
        let (r, _w) = {
            let p = Pipe::new().unwrap();
            (p.read, p.write)
        };
        assert!(recv_with_fd(r.as_fd(), &mut [0u8; 4]).is_err());
        assert!(send_with_fd(r.as_fd(), b"x", file.as_fd()).is_err());
        assert_eq!(open_copies_of(&path), 1);
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn recv_record_blocking_reads_plain_tcp_as_data() {
        use std::io::Write;
        use std::os::fd::AsFd;
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        c.write_all(b"abc").unwrap();
        let mut buf = [0u8; 16];
        // Blocks until the bytes are there (no MSG_DONTWAIT).
        let (n, ty) = recv_record_blocking(s.as_fd(), &mut buf).unwrap();
        assert_eq!((&buf[..n], ty), (&b"abc"[..], 23));
        drop(c);
        assert_eq!(recv_record_blocking(s.as_fd(), &mut buf).unwrap(), (0, 23));
    }

    #[test]
    fn ulp_on_a_non_socket_fails_cleanly() {
        let f = std::fs::File::open("/dev/null").unwrap();
        use std::os::fd::AsFd;
        assert!(attach_tls_ulp(f.as_fd()).is_err());
    }
}
