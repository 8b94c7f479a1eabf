//! The data planes: who encrypts and decrypts application records after the handshake.

pub(crate) mod kernel;
pub(crate) mod user;

use rustls::{CipherSuite, ProtocolVersion, SupportedCipherSuite};
use tlsplane_sys::{KernelCipher, TlsVersion};

/// Which record layer a connection got.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlaneKind {
    /// Linux kTLS: the kernel encrypts (TX) and decrypts (RX); `sendfile` stays zero-copy.
    Kernel,
    /// rustls' record layer in this process.
    User,
}

impl PlaneKind {
    /// The name logs and metrics use (`kernel`, `user`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Kernel => "kernel",
            Self::User => "user",
        }
    }
}

/// Why a connection stayed in user space.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum FallbackReason {
    /// `--data-plane user`.
    Policy,
    /// The kernel has no TLS ULP.
    NoUlp,
    /// The kernel did not accept this version/cipher when probed.
    Suite,
    /// Attaching the ULP to this socket failed.
    UlpAttach,
    /// Bytes past the handshake were already buffered (not expected: handshake reads are exact).
    Buffered,
}

impl FallbackReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Policy => "policy",
            Self::NoUlp => "no_ulp",
            Self::Suite => "suite",
            Self::UlpAttach => "ulp_attach",
            Self::Buffered => "buffered",
        }
    }
}

/// The kernel's name for a negotiated suite, if kTLS can carry it at all.
pub(crate) fn kernel_suite(
    version: ProtocolVersion,
    suite: SupportedCipherSuite,
) -> Option<(TlsVersion, KernelCipher)> {
    let v = match version {
        ProtocolVersion::TLSv1_3 => TlsVersion::Tls13,
        ProtocolVersion::TLSv1_2 => TlsVersion::Tls12,
        _ => return None,
    };
    let c = match suite.suite() {
        CipherSuite::TLS13_AES_128_GCM_SHA256
        | CipherSuite::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256
        | CipherSuite::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256 => KernelCipher::Aes128Gcm,
        CipherSuite::TLS13_AES_256_GCM_SHA384
        | CipherSuite::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384
        | CipherSuite::TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384 => KernelCipher::Aes256Gcm,
        CipherSuite::TLS13_CHACHA20_POLY1305_SHA256
        | CipherSuite::TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256
        | CipherSuite::TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256 => {
            KernelCipher::Chacha20Poly1305
        }
        _ => return None,
    };
    Some((v, c))
}

/// The AEAD confidentiality limit of a suite, in records under one key.
pub(crate) fn confidentiality_limit(suite: SupportedCipherSuite) -> u64 {
    match suite {
        SupportedCipherSuite::Tls12(s) => s.common.confidentiality_limit,
        SupportedCipherSuite::Tls13(s) => s.common.confidentiality_limit,
    }
}
