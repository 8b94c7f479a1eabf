//! Who a receiver accepts at the hand-off path.
//!
//! A path is only a name: whoever binds it while tlsplane is away (a restart removes the
//! socket) would otherwise hand the program connections with a forged peer, server name and
//! ALPN, and read what the program answers. So every receiver (this crate, the C library, the
//! Python module, the `LD_PRELOAD` shim) checks the listening process's user id with
//! `SO_PEERCRED` right after connecting, before reading a byte, and refuses any other.

use std::fmt;
use std::io;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::path::Path;

/// The environment variable naming the user ids tlsplane may run as: decimal ids separated
/// by commas, no spaces (`999` or `999,1000`), at most [`MAX_SERVER_UIDS`]. Unset or empty:
/// the receiver's own effective uid. Root is trusted either way.
pub const SERVER_UID_ENV: &str = "TLSPLANE_HANDOFF_UID";

/// The most user ids `TLSPLANE_HANDOFF_UID` may name (the shim keeps them in a fixed array).
pub const MAX_SERVER_UIDS: usize = 16;

/// The user ids a receiver accepts as tlsplane's: root (which could impersonate anyone
/// anyway), and those given.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerUids {
    /// Besides root, sorted, without duplicates.
    others: Vec<u32>,
}

impl ServerUids {
    /// Root and `uids`.
    pub fn new(uids: impl IntoIterator<Item = u32>) -> Self {
        let mut others: Vec<u32> = uids.into_iter().filter(|&u| u != 0).collect();
        others.sort_unstable();
        others.dedup();
        Self { others }
    }

    /// What `TLSPLANE_HANDOFF_UID` says, or when it is unset or empty, root and this
    /// process's effective uid.
    pub fn from_env() -> io::Result<Self> {
        match std::env::var_os(SERVER_UID_ENV) {
            Some(v) if !v.is_empty() => Self::parse(v.to_str().unwrap_or("\u{fffd}")),
            _ => Ok(Self::new([tlsplane_sys::effective_uid()])),
        }
    }

    /// `TLSPLANE_HANDOFF_UID`'s syntax (see [`SERVER_UID_ENV`]), strictly: a mistake there
    /// must not quietly trust someone else.
    pub fn parse(list: &str) -> io::Result<Self> {
        let bad = |why: &str| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{SERVER_UID_ENV}={list:?}: {why}"),
            )
        };
        let mut uids = Vec::new();
        for item in list.split(',') {
            if item.is_empty() || !item.bytes().all(|b| b.is_ascii_digit()) {
                return Err(bad("expected decimal user ids separated by commas"));
            }
            // (uid_t)-1 is "no user", never a process's id.
            match item.parse::<u32>() {
                Ok(uid) if uid != u32::MAX => uids.push(uid),
                _ => return Err(bad("a user id out of range")),
            }
        }
        if uids.len() > MAX_SERVER_UIDS {
            return Err(bad("more than 16 user ids"));
        }
        Ok(Self::new(uids))
    }

    pub fn trusts(&self, uid: u32) -> bool {
        uid == 0 || self.others.binary_search(&uid).is_ok()
    }

    /// Checks who listens at the other end of `sock`, just connected to `path`: the error
    /// (`PermissionDenied`) names the user id found and the ones trusted.
    pub fn check(&self, sock: &UnixStream, path: &Path) -> io::Result<()> {
        let uid = tlsplane_sys::peer_uid(sock.as_fd())?;
        if self.trusts(uid) {
            return Ok(());
        }
        Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "refusing the hand-off socket {}: it is served by uid {uid}, not {self} \
                 ({SERVER_UID_ENV} names the user ids tlsplane may run as)",
                path.display()
            ),
        ))
    }
}

impl fmt::Display for ServerUids {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("root")?;
        match self.others.as_slice() {
            [] => Ok(()),
            [one] => write!(f, " or uid {one}"),
            more => {
                f.write_str(" or uids ")?;
                for (i, u) in more.iter().enumerate() {
                    write!(f, "{}{u}", if i > 0 { ", " } else { "" })?;
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_uid_list_is_parsed_strictly_and_root_is_always_trusted() {
        let s = ServerUids::parse("999,1000,999").unwrap();
        assert!(s.trusts(0) && s.trusts(999) && s.trusts(1000));
        assert!(!s.trusts(1001));
        assert_eq!(s.to_string(), "root or uids 999, 1000");
        assert_eq!(ServerUids::parse("0").unwrap().to_string(), "root");
        assert_eq!(ServerUids::new([65534]).to_string(), "root or uid 65534");
        for bad in [
            "",
            " 999",
            "999,",
            ",999",
            "99 9",
            "-1",
            "+5",
            "tlsplane",
            "4294967295",
            "4294967296",
            "1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17",
        ] {
            let e = ServerUids::parse(bad).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{bad:?}");
            assert!(e.to_string().contains(SERVER_UID_ENV), "{e}");
        }
        assert!(ServerUids::parse("1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16").is_ok());
    }
}
