//! The C ABI of the hand-off receiver: `include/tlsplane.h` documents each function.
//!
//! This crate is the one place besides `tlsplane-sys` allowed `unsafe`, and only for what a C
//! ABI cannot avoid: turning the caller's pointers into references and slices, and setting
//! `errno`. Every `unsafe` block says why it is sound; all socket work is done by the safe
//! `tlsplane-handoff` crate. (It cannot live in `tlsplane-sys`, which `tlsplane-handoff`
//! depends on, nor in `tlsplane-handoff`, which forbids `unsafe` — and `#[no_mangle]` is
//! `unsafe_code` too.)

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::io;
use std::os::fd::{BorrowedFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use tlsplane_handoff::{ConnInfo, HandoffClient, ServerUids, Status};

/// `struct tlsplane_addr` in tlsplane.h.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct TlsplaneAddr {
    /// 0 none, 4 IPv4, 6 IPv6.
    pub family: u8,
    pub reserved: u8,
    /// Host byte order.
    pub port: u16,
    /// IPv4 in the first 4 bytes.
    pub addr: [u8; 16],
}

/// `struct tlsplane_conn_info` in tlsplane.h.
#[repr(C)]
pub struct TlsplaneConnInfo {
    pub conn_id: u64,
    pub plane: u8,
    pub reserved: u8,
    pub tls_version: u16,
    pub cipher_suite: u16,
    pub reserved2: u16,
    pub peer: TlsplaneAddr,
    pub local: TlsplaneAddr,
    pub server_name_len: u8,
    /// NUL-terminated.
    pub server_name: [u8; 256],
    pub alpn_len: u8,
    pub alpn: [u8; 255],
}

/// The handle `tlsplane_connect` returns: the Rust client, and what it knows of each
/// descriptor it accepted and not yet closed.
pub struct TlsplaneHandle {
    client: HandoffClient,
    conns: Mutex<HashMap<RawFd, ConnInfo>>,
}

impl TlsplaneHandle {
    fn info(&self, fd: RawFd) -> Option<ConnInfo> {
        let conns = self.conns.lock().unwrap_or_else(|p| p.into_inner());
        conns.get(&fd).cloned()
    }

    fn forget(&self, fd: RawFd) -> Option<ConnInfo> {
        let mut conns = self.conns.lock().unwrap_or_else(|p| p.into_inner());
        conns.remove(&fd)
    }
}

fn set_errno(e: c_int) {
    // SAFETY: __errno_location returns the calling thread's errno, valid for the thread's
    // life; writing an int to it is what C's `errno = e` does.
    unsafe { *libc::__errno_location() = e };
}

fn errno_of(e: &io::Error) -> c_int {
    if let Some(n) = e.raw_os_error() {
        return n;
    }
    match e.kind() {
        io::ErrorKind::InvalidData => libc::EPROTO,
        io::ErrorKind::UnexpectedEof => libc::ECONNRESET,
        io::ErrorKind::ConnectionAborted => libc::ECONNABORTED,
        io::ErrorKind::InvalidInput => libc::EINVAL,
        io::ErrorKind::PermissionDenied => libc::EPERM,
        _ => libc::EIO,
    }
}

/// Says on stderr why a connect was refused (another user at the path, a malformed
/// TLSPLANE_HANDOFF_UID): errno alone cannot name the user id found. At most once per 10 s,
/// for a program that retries in a loop.
fn report_refusal(e: &io::Error) {
    static BASE: OnceLock<Instant> = OnceLock::new();
    static NEXT_MS: AtomicU64 = AtomicU64::new(0);
    let now = BASE.get_or_init(Instant::now).elapsed().as_millis() as u64;
    let next = NEXT_MS.load(Ordering::Relaxed);
    let window = Duration::from_secs(10).as_millis() as u64;
    if now >= next
        && NEXT_MS
            .compare_exchange(next, now + window, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    {
        eprintln!("tlsplane: {e}");
    }
}

fn errno_of_status(s: Status) -> c_int {
    match s {
        Status::Ok => 0,
        Status::UnknownConnection => libc::ENOENT,
        Status::BadRequest => libc::EINVAL,
        Status::Unsupported => libc::EOPNOTSUPP,
        Status::Refused => libc::EPERM,
        _ => libc::EIO,
    }
}

fn addr_out(a: Option<std::net::SocketAddr>) -> TlsplaneAddr {
    let mut out = TlsplaneAddr {
        family: 0,
        reserved: 0,
        port: 0,
        addr: [0; 16],
    };
    if let Some(a) = a {
        out.port = a.port();
        match a.ip() {
            std::net::IpAddr::V4(ip) => {
                out.family = 4;
                out.addr[..4].copy_from_slice(&ip.octets());
            }
            std::net::IpAddr::V6(ip) => {
                out.family = 6;
                out.addr = ip.octets();
            }
        }
    }
    out
}

fn info_out(info: &ConnInfo) -> TlsplaneConnInfo {
    let mut out = TlsplaneConnInfo {
        conn_id: info.conn_id,
        plane: info.plane.to_wire(),
        reserved: 0,
        tls_version: info.tls_version,
        cipher_suite: info.cipher_suite,
        reserved2: 0,
        peer: addr_out(info.peer),
        local: addr_out(info.local),
        server_name_len: 0,
        server_name: [0; 256],
        alpn_len: 0,
        alpn: [0; 255],
    };
    // The wire format bounds both to 255 bytes.
    if let Some(name) = &info.server_name {
        let n = name.len().min(255);
        out.server_name[..n].copy_from_slice(&name.as_bytes()[..n]);
        out.server_name_len = n as u8;
    }
    if let Some(alpn) = &info.alpn {
        let n = alpn.len().min(255);
        out.alpn[..n].copy_from_slice(&alpn[..n]);
        out.alpn_len = n as u8;
    }
    out
}

/// `sizeof(struct tlsplane_conn_info)` as this library was built, for a C program to check
/// its header against.
#[no_mangle]
pub extern "C" fn tlsplane_conn_info_size() -> usize {
    std::mem::size_of::<TlsplaneConnInfo>()
}

/// Connects to `path`, trusting `server` (or failing with its error).
///
/// # Safety
/// `path` is NULL or a NUL-terminated string.
unsafe fn connect(path: *const c_char, server: io::Result<ServerUids>) -> *mut TlsplaneHandle {
    if path.is_null() {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    // SAFETY: the caller promises a NUL-terminated string, read only during this call.
    let path = unsafe { CStr::from_ptr(path) };
    let path = std::path::Path::new(std::ffi::OsStr::from_bytes(path.to_bytes()));
    match server.and_then(|server| HandoffClient::connect_trusting(path, &server)) {
        Ok(client) => Box::into_raw(Box::new(TlsplaneHandle {
            client,
            conns: Mutex::default(),
        })),
        Err(e) => {
            if matches!(
                e.kind(),
                io::ErrorKind::PermissionDenied | io::ErrorKind::InvalidInput
            ) {
                report_refusal(&e);
            }
            set_errno(errno_of(&e));
            std::ptr::null_mut()
        }
    }
}

/// See tlsplane.h.
///
/// # Safety
/// `path` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn tlsplane_connect(path: *const c_char) -> *mut TlsplaneHandle {
    // SAFETY: forwarded caller promise.
    unsafe { connect(path, ServerUids::from_env()) }
}

/// See tlsplane.h.
///
/// # Safety
/// `path` is NULL or a NUL-terminated string; `uids` is valid for reading `n_uids` user ids
/// (or `n_uids` is 0).
#[no_mangle]
pub unsafe extern "C" fn tlsplane_connect_uids(
    path: *const c_char,
    uids: *const libc::uid_t,
    n_uids: usize,
) -> *mut TlsplaneHandle {
    let uids: &[libc::uid_t] = if n_uids == 0 {
        &[]
    } else if uids.is_null() {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    } else {
        // SAFETY: the caller promises `n_uids` readable, initialised uid_t values, not
        // written during the call.
        unsafe { std::slice::from_raw_parts(uids, n_uids) }
    };
    // SAFETY: forwarded caller promise.
    unsafe { connect(path, Ok(ServerUids::new(uids.iter().copied()))) }
}

/// Borrows the handle behind a C pointer.
///
/// # Safety
/// `h` is NULL or a pointer from `tlsplane_connect` not yet given to `tlsplane_disconnect`.
unsafe fn handle<'a>(h: *const TlsplaneHandle) -> Option<&'a TlsplaneHandle> {
    // SAFETY: per the caller's promise, a non-null `h` points at a live handle that is only
    // ever shared (every method takes &self and locks what it changes).
    let h = unsafe { h.as_ref() };
    if h.is_none() {
        set_errno(libc::EINVAL);
    }
    h
}

/// See tlsplane.h.
///
/// # Safety
/// `h` as for [`handle`]; `out` is NULL or valid for writing one `tlsplane_conn_info`.
#[no_mangle]
pub unsafe extern "C" fn tlsplane_accept(
    h: *const TlsplaneHandle,
    out: *mut TlsplaneConnInfo,
) -> c_int {
    // SAFETY: forwarded caller promise.
    let Some(h) = (unsafe { handle(h) }) else {
        return -1;
    };
    match h.client.accept() {
        Ok(conn) => {
            if !out.is_null() {
                // SAFETY: the caller promises `out` is valid for one write of the struct.
                unsafe { out.write(info_out(&conn.info)) };
            }
            // The descriptor is the caller's now; tlsplane_close gives it back to the client.
            let (fd, info) = conn.into_parts();
            let fd = fd.into_raw_fd();
            let mut conns = h.conns.lock().unwrap_or_else(|p| p.into_inner());
            conns.insert(fd, info);
            fd
        }
        Err(e) => {
            set_errno(errno_of(&e));
            -1
        }
    }
}

/// See tlsplane.h.
///
/// # Safety
/// `h` as for [`handle`]; `buf` is valid for writing `len` bytes (or `len` is 0).
#[no_mangle]
pub unsafe extern "C" fn tlsplane_read(
    h: *const TlsplaneHandle,
    fd: c_int,
    buf: *mut c_void,
    len: usize,
) -> isize {
    // SAFETY: forwarded caller promise.
    let Some(h) = (unsafe { handle(h) }) else {
        return -1;
    };
    let Some(info) = h.info(fd) else {
        set_errno(libc::EBADF);
        return -1;
    };
    let buf: &mut [u8] = if len == 0 || buf.is_null() {
        &mut []
    } else {
        // SAFETY: the caller promises `buf` is valid for writes of `len` bytes and not used
        // elsewhere during the call; u8 has no alignment or validity requirement.
        unsafe { std::slice::from_raw_parts_mut(buf.cast::<u8>(), len) }
    };
    // SAFETY: `fd` was accepted through this handle and, per tlsplane.h, stays open until
    // tlsplane_close (which forgets it first); it is only borrowed for this call.
    let fd = unsafe { BorrowedFd::borrow_raw(fd) };
    match h.client.read(fd, &info, buf) {
        Ok(n) => n as isize,
        Err(e) => {
            set_errno(errno_of(&e));
            -1
        }
    }
}

/// See tlsplane.h.
///
/// # Safety
/// `h` as for [`handle`].
#[no_mangle]
pub unsafe extern "C" fn tlsplane_close(h: *const TlsplaneHandle, fd: c_int) -> c_int {
    // SAFETY: forwarded caller promise.
    let Some(h) = (unsafe { handle(h) }) else {
        return -1;
    };
    let Some(info) = h.forget(fd) else {
        set_errno(libc::EBADF);
        return -1;
    };
    // SAFETY: `fd` was accepted through this handle, which owned it until now (per
    // tlsplane.h the program closes it only through here); it was just forgotten, so nothing
    // else will close it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    match h.client.close(h.client.adopt(fd, info)) {
        Ok(Status::Ok) => 0,
        Ok(s) => {
            set_errno(errno_of_status(s));
            -1
        }
        Err(e) => {
            set_errno(errno_of(&e));
            -1
        }
    }
}

/// See tlsplane.h.
///
/// # Safety
/// `h` is NULL or a pointer from `tlsplane_connect`, given here once, with no call on it
/// running or to come.
#[no_mangle]
pub unsafe extern "C" fn tlsplane_disconnect(h: *mut TlsplaneHandle) {
    if !h.is_null() {
        // SAFETY: per the caller's promise, `h` came from Box::into_raw in tlsplane_connect
        // and nothing else uses it any more.
        drop(unsafe { Box::from_raw(h) });
    }
}
