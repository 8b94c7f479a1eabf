use std::fmt;
use std::io;

/// Errors of the split-plane TLS layer.
///
/// Each variant says which side caused it, so callers can count peer misbehaviour apart from
/// local failures (as a proxy would record client, upstream or internal errors).
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// The peer broke the TLS protocol (bad record, bad handshake message, failed decryption).
    /// Where TLS allowed it, an alert was sent before this was returned.
    Protocol(rustls::Error),
    /// The peer sent a fatal alert.
    PeerAlert(u8),
    /// The peer closed the TCP connection during the handshake.
    PeerClosedInHandshake,
    /// A socket or file operation failed.
    Io(io::Error),
    /// The kernel plane was required but could not be used for this connection.
    KernelRequired(&'static str),
    /// Our configuration is unusable (certificate, key, options).
    Config(String),
    /// The client spoke plain HTTP to the TLS port; it was answered with the configured
    /// response.
    PlainHttp,
    /// The ClientHello is longer than the configured cap (its length as claimed); it was
    /// answered with an illegal_parameter alert without being read.
    ClientHelloTooLarge(usize),
    /// The ClientHello was still incomplete after the configured number of records (this
    /// many) and went on in another; it was answered with an unexpected_message alert.
    ClientHelloTooManyRecords(usize),
    /// The ClientHello offered more session tickets (PSK identities: this many) than the
    /// configured cap; it was answered with an illegal_parameter alert before any was tried.
    ClientHelloTooManyPskIdentities(usize),
    /// The caller's admission check refused the ClientHello (a limit); the connection was
    /// reset without a reply.
    Refused,
    /// The ClientHello names no site this server has (or names none, and there is no default
    /// site); it was refused with an unrecognized_name alert or a reset, as configured.
    UnknownServerName(Option<String>),
}

impl Error {
    /// True when the peer, not this process, is at fault.
    pub fn is_peer_fault(&self) -> bool {
        // rustls' `General` errors are ours (e.g. a signature the key daemon did not make).
        if matches!(self, Error::Protocol(rustls::Error::General(_))) {
            return false;
        }
        matches!(
            self,
            Error::Protocol(_)
                | Error::PeerAlert(_)
                | Error::PeerClosedInHandshake
                | Error::PlainHttp
                | Error::ClientHelloTooLarge(_)
                | Error::ClientHelloTooManyRecords(_)
                | Error::ClientHelloTooManyPskIdentities(_)
                | Error::UnknownServerName(_)
        ) || matches!(self, Error::Io(e) if matches!(e.kind(), io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe | io::ErrorKind::UnexpectedEof | io::ErrorKind::TimedOut))
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Protocol(e) => write!(f, "TLS protocol error: {e}"),
            Error::PeerAlert(d) => write!(f, "peer sent fatal alert {d}"),
            Error::PeerClosedInHandshake => {
                f.write_str("peer closed the connection during the handshake")
            }
            Error::Io(e) => write!(f, "I/O error: {e}"),
            Error::KernelRequired(why) => {
                write!(f, "kernel data plane required but unavailable: {why}")
            }
            Error::Config(s) => write!(f, "configuration error: {s}"),
            Error::PlainHttp => f.write_str("plain HTTP on the TLS port (answered, closed)"),
            Error::ClientHelloTooLarge(n) => {
                write!(f, "ClientHello of {n} bytes is over the size cap")
            }
            Error::ClientHelloTooManyRecords(n) => {
                write!(f, "ClientHello still incomplete after {n} records")
            }
            Error::ClientHelloTooManyPskIdentities(n) => {
                write!(f, "ClientHello offers {n} session tickets, over the cap")
            }
            Error::Refused => f.write_str("refused by an admission limit at the ClientHello"),
            Error::UnknownServerName(Some(n)) => write!(f, "no site for server name {n:?}"),
            Error::UnknownServerName(None) => {
                f.write_str("no server name (SNI) sent and no default site")
            }
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Protocol(e) => Some(e),
            Error::Io(e) => Some(e),
            _ => None,
        }
    }
}

impl From<io::Error> for Error {
    fn from(e: io::Error) -> Self {
        Error::Io(e)
    }
}

impl From<rustls::Error> for Error {
    fn from(e: rustls::Error) -> Self {
        Error::Protocol(e)
    }
}

impl From<Error> for io::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::Io(e) => e,
            Error::PeerClosedInHandshake => {
                io::Error::new(io::ErrorKind::UnexpectedEof, e.to_string())
            }
            other => io::Error::new(io::ErrorKind::InvalidData, other.to_string()),
        }
    }
}
