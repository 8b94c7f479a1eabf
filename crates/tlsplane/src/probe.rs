//! What the running kernel's TLS offload can do, found out once per process by trying it on a
//! loopback socket pair (the way quinn-udp turns features off when the kernel refuses them),
//! so that per-connection decisions are made before the point of no return: once rustls has
//! handed over its secrets, the connection cannot go back to rustls' record layer.

use std::collections::HashSet;
use std::io;
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsFd;

use tlsplane_sys::{
    attach_tls_ulp, set_crypto_info, CryptoInfo, Direction, KernelCipher, TlsVersion,
};

/// The kernel's kTLS capabilities.
#[derive(Debug, Clone)]
pub struct KernelSupport {
    /// The TLS upper-layer protocol can be attached to TCP sockets.
    pub ulp: bool,
    /// Why `ulp` is false, or a summary when true.
    pub reason: String,
    /// (version, cipher) pairs the kernel accepted for both TX and RX.
    pub suites: HashSet<(TlsVersion, KernelCipher)>,
    /// TLS 1.3 keys can be replaced after installation (Linux 6.14+), so KeyUpdate and AEAD
    /// limits are handled by re-keying instead of closing.
    pub tls13_rekey: bool,
}

impl KernelSupport {
    /// No offload at all, with the reason shown to operators.
    pub fn disabled(reason: &str) -> Self {
        Self {
            ulp: false,
            reason: reason.to_string(),
            suites: HashSet::new(),
            tls13_rekey: false,
        }
    }

    /// Tries the kernel. Never fails: anything that goes wrong means "not supported".
    pub fn probe() -> Self {
        match Self::try_probe() {
            Ok(s) => s,
            Err(e) => Self::disabled(&format!("kTLS probe failed: {e}")),
        }
    }

    fn try_probe() -> io::Result<Self> {
        let (a, _b) = loopback_pair()?;
        if let Err(e) = attach_tls_ulp(a.as_fd()) {
            let why = match e.raw_os_error() {
                _ if e.kind() == io::ErrorKind::NotFound => {
                    "no TLS ULP in this kernel (CONFIG_TLS off or module `tls` not loaded)"
                        .to_string()
                }
                _ => format!("TCP_ULP \"tls\" refused: {e}"),
            };
            return Ok(Self::disabled(&why));
        }
        let mut suites = HashSet::new();
        for version in [TlsVersion::Tls13, TlsVersion::Tls12] {
            for cipher in KernelCipher::ALL {
                if try_suite(version, cipher).unwrap_or(false) {
                    suites.insert((version, cipher));
                }
            }
        }
        let tls13_rekey = try_rekey().unwrap_or(false);
        let reason = format!(
            "kTLS available: {} suite/version pairs, TLS 1.3 rekey {}",
            suites.len(),
            if tls13_rekey { "yes" } else { "no" }
        );
        Ok(Self {
            ulp: true,
            reason,
            suites,
            tls13_rekey,
        })
    }

    /// Whether a connection of this version and cipher can go to the kernel.
    pub fn supports(&self, version: TlsVersion, cipher: KernelCipher) -> bool {
        self.ulp && self.suites.contains(&(version, cipher))
    }

    /// Removes a pair, as if the kernel had refused it (operators excluding a suite; tests).
    pub fn exclude(&mut self, version: TlsVersion, cipher: KernelCipher) {
        self.suites.remove(&(version, cipher));
    }
}

fn loopback_pair() -> io::Result<(TcpStream, TcpStream)> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    let a = TcpStream::connect(l.local_addr()?)?;
    let (b, _) = l.accept()?;
    Ok((a, b))
}

fn dummy_info(version: TlsVersion, cipher: KernelCipher) -> CryptoInfo {
    let key = [0u8; 32];
    let salt = [0u8; 4];
    let iv = [0u8; 12];
    CryptoInfo::new(
        version,
        cipher,
        &key[..cipher.key_len()],
        &salt[..cipher.salt_len()],
        &iv[..12 - cipher.salt_len()],
        0,
    )
    .expect("dummy lengths follow the cipher")
}

fn try_suite(version: TlsVersion, cipher: KernelCipher) -> io::Result<bool> {
    let (a, _b) = loopback_pair()?;
    attach_tls_ulp(a.as_fd())?;
    let info = dummy_info(version, cipher);
    Ok(set_crypto_info(a.as_fd(), Direction::Tx, &info).is_ok()
        && set_crypto_info(a.as_fd(), Direction::Rx, &info).is_ok())
}

fn try_rekey() -> io::Result<bool> {
    let (a, _b) = loopback_pair()?;
    attach_tls_ulp(a.as_fd())?;
    let info = dummy_info(TlsVersion::Tls13, KernelCipher::Aes128Gcm);
    set_crypto_info(a.as_fd(), Direction::Tx, &info)?;
    Ok(set_crypto_info(a.as_fd(), Direction::Tx, &info).is_ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_never_fails_and_is_consistent() {
        let s = KernelSupport::probe();
        if !s.ulp {
            assert!(s.suites.is_empty());
            assert!(!s.tls13_rekey);
            assert!(!s.supports(TlsVersion::Tls13, KernelCipher::Aes128Gcm));
        }
        assert!(!s.reason.is_empty());
    }

    #[test]
    fn exclude_removes_support() {
        let mut s = KernelSupport {
            ulp: true,
            reason: String::new(),
            suites: HashSet::new(),
            tls13_rekey: false,
        };
        s.suites
            .insert((TlsVersion::Tls12, KernelCipher::Chacha20Poly1305));
        assert!(s.supports(TlsVersion::Tls12, KernelCipher::Chacha20Poly1305));
        s.exclude(TlsVersion::Tls12, KernelCipher::Chacha20Poly1305);
        assert!(!s.supports(TlsVersion::Tls12, KernelCipher::Chacha20Poly1305));
    }
}
