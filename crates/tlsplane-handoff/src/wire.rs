//! The hand-off wire protocol: pure, I/O-free, no allocation on encode (callers own buffers).
//!
//! Every message on a hand-off Unix stream connection, in either direction, is one *frame*:
//!
//! ```text
//! offset size  field (integers big-endian)
//!  0     4     magic "TLPH" (0x54 0x4c 0x50 0x48)
//!  4     1     version: 1
//!  5     1     kind: 1 CONNECTION, 2 REPLY (tlsplane -> program)
//!                    3 KEY_UPDATE, 4 CLOSE, 5 HELLO  (program -> tlsplane)
//!  6     2     length: the whole frame's length in bytes, these 8 included,
//!              at least the kind's v1 minimum and at most 16448
//!  8     ...   the kind's fields, then (later minor revisions) more fields that a v1
//!              reader skips: it reads what it knows and ignores the rest up to `length`
//! ```
//!
//! A frame of a kind the reader does not know is skipped whole (a descriptor that came with
//! it is closed). Another version or magic is an error: the stream cannot be framed any more.
//!
//! CONNECTION (v1 minimum 64 bytes + name + ALPN), sent with exactly one descriptor
//! (`SCM_RIGHTS`) attached to its first byte:
//!
//! ```text
//!  8     8     connection id (tlsplane's, unique while tlsplane runs)
//! 16     1     plane: 1 kernel (kTLS socket), 2 user relay (one end of a socketpair that
//!              tlsplane relays through its own record layer), 3 raw TCP (the ClientHello
//!              still unread: no TLS was done)
//! 17     1     reserved, sent 0, ignored
//! 18     2     TLS version, wire value (0x0303 TLS 1.2, 0x0304 TLS 1.3; 0 on raw TCP)
//! 20     2     cipher suite, IANA value (e.g. 0x1301; 0 on raw TCP)
//! 22    20     peer address  (see below)
//! 42    20     local address (see below)
//! 62     1     n: server name length, 0 = the client sent none
//! 63     n     server name (printable ASCII, as the client sent it in SNI)
//! 63+n   1     m: ALPN protocol length, 0 = none negotiated
//! 64+n   m     ALPN protocol id (bytes)
//! ```
//!
//! An address is 20 bytes: family (1: 0 none, 4 IPv4, 6 IPv6), reserved (1, sent 0,
//! ignored), port (2), address (16: IPv4 in the first 4, the other 12 zero). Family 0 has port
//! and address all zero. IPv6 flow info and scope id are not carried.
//!
//! KEY_UPDATE (v1 minimum 22 + p): the program read a handshake record on a kernel-plane
//! socket; tlsplane, which keeps the traffic secrets, installs the next RX key (and, when the
//! peer asked for it, answers with its own KeyUpdate and installs the next TX key).
//!
//! ```text
//!  8     4     request id (echoed in the REPLY)
//! 12     8     connection id
//! 20     2     p: plaintext length, 1..=16384
//! 22     p     the record's plaintext as the kernel returned it (handshake message(s),
//!              starting with the handshake type, 24 for KeyUpdate)
//! ```
//!
//! CLOSE (v1 minimum 20): send close_notify on the connection.
//!
//! ```text
//!  8     4     request id
//! 12     8     connection id
//! ```
//!
//! HELLO (v1 minimum 12): what the receiver promises, sent at most once, as its first frame.
//! tlsplane answers nothing; a HELLO after any other frame is a protocol error.
//!
//! ```text
//!  8     4     flags: bit 0 ENDS_WITH_CLOSE (this receiver ends every connection it is
//!              handed, on both planes, with a CLOSE sent before it lets go of the
//!              descriptor: one that ends without a CLOSE was abandoned, and is reset);
//!              other bits sent 0, ignored
//! ```
//!
//! REPLY (v1 minimum 22): tlsplane's answer to one KEY_UPDATE or CLOSE.
//!
//! ```text
//!  8     4     request id of the request answered
//! 12     8     connection id
//! 20     2     status: 0 ok, 1 unknown connection, 2 bad request, 3 unsupported (the
//!              kernel cannot re-key: tlsplane closes the connection with an alert),
//!              4 failed, 5 refused (not this program's connection); others: future codes,
//!              to be treated as failures
//! ```

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// The first four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"TLPH";
/// The protocol version this crate speaks.
pub const VERSION: u8 = 1;
/// Magic, version, kind, length.
pub const PREFIX_LEN: usize = 8;
/// The largest frame a reader accepts: a KEY_UPDATE with a full record's plaintext, and room.
pub const MAX_FRAME_LEN: usize = 16448;
/// The largest record plaintext a KEY_UPDATE carries (TLS's record limit).
pub const MAX_RECORD_PLAINTEXT: usize = 16384;

/// Frame kinds.
pub mod kind {
    pub const CONNECTION: u8 = 1;
    pub const REPLY: u8 = 2;
    pub const KEY_UPDATE: u8 = 3;
    pub const CLOSE: u8 = 4;
    pub const HELLO: u8 = 5;
}

/// HELLO flag: the receiver sends a CLOSE for every connection it ends, before it lets go
/// of the descriptor (see [`Message::Hello`]).
pub const ENDS_WITH_CLOSE: u32 = 1;

const CONNECTION_MIN: usize = 64;
const KEY_UPDATE_MIN: usize = 22;
const CLOSE_MIN: usize = 20;
const REPLY_MIN: usize = 22;
const HELLO_MIN: usize = 12;
const ADDR_LEN: usize = 20;

/// Why a frame could not be decoded or encoded. Never a panic.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// The frame does not start with [`MAGIC`].
    BadMagic,
    /// A version this crate does not speak.
    UnsupportedVersion(u8),
    /// The length field is below the kind's minimum or above [`MAX_FRAME_LEN`].
    BadLength(usize),
    /// Fewer bytes than the length field (or a field inside) says.
    Truncated,
    /// A frame of another kind than the caller asked for.
    WrongKind(u8),
    /// A plane value this version does not define.
    UnknownPlane(u8),
    /// An address family other than 0, 4, 6, or non-zero bytes where the family has none.
    BadAddress,
    /// A server name that is empty where present, longer than 255 bytes, or not printable
    /// ASCII.
    BadServerName,
    /// An ALPN protocol id that is empty where present or longer than 255 bytes.
    BadAlpn,
    /// A KEY_UPDATE plaintext that is empty or longer than [`MAX_RECORD_PLAINTEXT`].
    BadPlaintext,
    /// The caller's output buffer is smaller than the frame (`needed` bytes).
    BufferTooSmall { needed: usize },
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::BadMagic => f.write_str("not a tlsplane hand-off frame (bad magic)"),
            Error::UnsupportedVersion(v) => write!(f, "unsupported hand-off version {v}"),
            Error::BadLength(n) => write!(f, "bad hand-off frame length {n}"),
            Error::Truncated => f.write_str("truncated hand-off frame"),
            Error::WrongKind(k) => write!(f, "unexpected hand-off frame kind {k}"),
            Error::UnknownPlane(p) => write!(f, "unknown plane {p}"),
            Error::BadAddress => f.write_str("bad socket address"),
            Error::BadServerName => f.write_str("bad server name"),
            Error::BadAlpn => f.write_str("bad ALPN protocol"),
            Error::BadPlaintext => f.write_str("bad KeyUpdate record plaintext length"),
            Error::BufferTooSmall { needed } => write!(f, "output buffer needs {needed} bytes"),
        }
    }
}

impl std::error::Error for Error {}

/// How the program reads the descriptor it received.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Plane {
    /// A kTLS socket: plaintext in and out, the kernel does the records. Control records make
    /// a plain `read` fail with `EIO`; read them with `recvmsg` (see [`crate::HandoffClient::read`]).
    Kernel,
    /// One end of a socketpair; tlsplane relays it through its user-space record layer.
    UserRelay,
    /// The raw TCP socket with the ClientHello unread: the program does its own TLS.
    RawTcp,
}

impl Plane {
    pub fn to_wire(self) -> u8 {
        match self {
            Plane::Kernel => 1,
            Plane::UserRelay => 2,
            Plane::RawTcp => 3,
        }
    }

    pub fn from_wire(v: u8) -> Result<Self, Error> {
        match v {
            1 => Ok(Plane::Kernel),
            2 => Ok(Plane::UserRelay),
            3 => Ok(Plane::RawTcp),
            v => Err(Error::UnknownPlane(v)),
        }
    }
}

/// What a program learns with each descriptor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnInfo {
    pub conn_id: u64,
    pub plane: Plane,
    /// Wire value: 0x0303 TLS 1.2, 0x0304 TLS 1.3 (0 on [`Plane::RawTcp`]).
    pub tls_version: u16,
    /// IANA cipher suite value (0 on [`Plane::RawTcp`]).
    pub cipher_suite: u16,
    pub peer: Option<SocketAddr>,
    pub local: Option<SocketAddr>,
    /// The SNI the client sent (printable ASCII, at most 255 bytes).
    pub server_name: Option<String>,
    /// The negotiated ALPN protocol id (1 to 255 bytes).
    pub alpn: Option<Vec<u8>>,
}

/// A frame's first 8 bytes, checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Prefix {
    pub kind: u8,
    /// The whole frame's length, prefix included: `PREFIX_LEN..=MAX_FRAME_LEN`.
    pub len: usize,
}

impl Prefix {
    /// Checks magic, version and the length's bounds (not yet the kind's minimum: unknown
    /// kinds have none). `bytes` may be longer than the prefix.
    pub fn decode(bytes: &[u8]) -> Result<Self, Error> {
        let p = bytes.get(..PREFIX_LEN).ok_or(Error::Truncated)?;
        if p[..4] != MAGIC {
            return Err(Error::BadMagic);
        }
        if p[4] != VERSION {
            return Err(Error::UnsupportedVersion(p[4]));
        }
        let len = u16::from_be_bytes([p[6], p[7]]) as usize;
        if !(PREFIX_LEN..=MAX_FRAME_LEN).contains(&len) {
            return Err(Error::BadLength(len));
        }
        Ok(Prefix { kind: p[5], len })
    }
}

/// A reply's status.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Status {
    Ok,
    UnknownConnection,
    BadRequest,
    /// The kernel cannot re-key this connection; tlsplane ends it with an alert.
    Unsupported,
    Failed,
    /// The connection was not handed to this program.
    Refused,
    /// A code this version does not name: treat as a failure.
    Other(u16),
}

impl Status {
    pub fn to_wire(self) -> u16 {
        match self {
            Status::Ok => 0,
            Status::UnknownConnection => 1,
            Status::BadRequest => 2,
            Status::Unsupported => 3,
            Status::Failed => 4,
            Status::Refused => 5,
            Status::Other(v) => v,
        }
    }

    pub fn from_wire(v: u16) -> Self {
        match v {
            0 => Status::Ok,
            1 => Status::UnknownConnection,
            2 => Status::BadRequest,
            3 => Status::Unsupported,
            4 => Status::Failed,
            5 => Status::Refused,
            v => Status::Other(v),
        }
    }
}

/// tlsplane's answer to one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reply {
    pub request_id: u32,
    pub conn_id: u64,
    pub status: Status,
}

/// One decoded frame of a kind this version knows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message<'a> {
    /// tlsplane -> program, with one descriptor.
    Connection(ConnInfo),
    /// tlsplane -> program.
    Reply(Reply),
    /// program -> tlsplane: re-key after this handshake record.
    KeyUpdate {
        request_id: u32,
        conn_id: u64,
        record_plaintext: &'a [u8],
    },
    /// program -> tlsplane: send close_notify.
    Close { request_id: u32, conn_id: u64 },
    /// program -> tlsplane, its first frame: what it promises ([`ENDS_WITH_CLOSE`]; the
    /// other bits are sent 0 and ignored).
    Hello { flags: u32 },
}

impl Message<'_> {
    pub fn kind(&self) -> u8 {
        match self {
            Message::Connection(_) => kind::CONNECTION,
            Message::Reply(_) => kind::REPLY,
            Message::KeyUpdate { .. } => kind::KEY_UPDATE,
            Message::Close { .. } => kind::CLOSE,
            Message::Hello { .. } => kind::HELLO,
        }
    }

    /// The length of this message's frame, after checking every field as `decode` would.
    pub fn encoded_len(&self) -> Result<usize, Error> {
        Ok(match self {
            Message::Connection(info) => {
                let name = check_server_name(info.server_name.as_deref())?;
                let alpn = check_alpn(info.alpn.as_deref())?;
                CONNECTION_MIN + name + alpn
            }
            Message::Reply(_) => REPLY_MIN,
            Message::KeyUpdate {
                record_plaintext, ..
            } => {
                if record_plaintext.is_empty() || record_plaintext.len() > MAX_RECORD_PLAINTEXT {
                    return Err(Error::BadPlaintext);
                }
                KEY_UPDATE_MIN + record_plaintext.len()
            }
            Message::Close { .. } => CLOSE_MIN,
            Message::Hello { .. } => HELLO_MIN,
        })
    }

    /// Writes the frame at the start of `out`; returns its length.
    pub fn encode(&self, out: &mut [u8]) -> Result<usize, Error> {
        let len = self.encoded_len()?;
        let out = out
            .get_mut(..len)
            .ok_or(Error::BufferTooSmall { needed: len })?;
        out.fill(0);
        out[..4].copy_from_slice(&MAGIC);
        out[4] = VERSION;
        out[5] = self.kind();
        out[6..8].copy_from_slice(&(len as u16).to_be_bytes());
        match self {
            Message::Connection(info) => {
                out[8..16].copy_from_slice(&info.conn_id.to_be_bytes());
                out[16] = info.plane.to_wire();
                out[18..20].copy_from_slice(&info.tls_version.to_be_bytes());
                out[20..22].copy_from_slice(&info.cipher_suite.to_be_bytes());
                put_addr(&mut out[22..42], info.peer);
                put_addr(&mut out[42..62], info.local);
                let name = info.server_name.as_deref().unwrap_or("").as_bytes();
                out[62] = name.len() as u8;
                out[63..63 + name.len()].copy_from_slice(name);
                let alpn = info.alpn.as_deref().unwrap_or(&[]);
                let at = 63 + name.len();
                out[at] = alpn.len() as u8;
                out[at + 1..at + 1 + alpn.len()].copy_from_slice(alpn);
            }
            Message::Reply(r) => {
                out[8..12].copy_from_slice(&r.request_id.to_be_bytes());
                out[12..20].copy_from_slice(&r.conn_id.to_be_bytes());
                out[20..22].copy_from_slice(&r.status.to_wire().to_be_bytes());
            }
            Message::KeyUpdate {
                request_id,
                conn_id,
                record_plaintext,
            } => {
                out[8..12].copy_from_slice(&request_id.to_be_bytes());
                out[12..20].copy_from_slice(&conn_id.to_be_bytes());
                out[20..22].copy_from_slice(&(record_plaintext.len() as u16).to_be_bytes());
                out[22..].copy_from_slice(record_plaintext);
            }
            Message::Close {
                request_id,
                conn_id,
            } => {
                out[8..12].copy_from_slice(&request_id.to_be_bytes());
                out[12..20].copy_from_slice(&conn_id.to_be_bytes());
            }
            Message::Hello { flags } => {
                out[8..12].copy_from_slice(&flags.to_be_bytes());
            }
        }
        Ok(len)
    }

    /// Decodes one whole frame (`frame` may hold more bytes after it; they are not read).
    /// `Ok(None)`: a well-framed message of a kind this version does not know, to be skipped.
    pub fn decode(frame: &[u8]) -> Result<Option<Message<'_>>, Error> {
        let prefix = Prefix::decode(frame)?;
        let f = frame.get(..prefix.len).ok_or(Error::Truncated)?;
        let min = match prefix.kind {
            kind::CONNECTION => CONNECTION_MIN,
            kind::REPLY => REPLY_MIN,
            kind::KEY_UPDATE => KEY_UPDATE_MIN,
            kind::CLOSE => CLOSE_MIN,
            kind::HELLO => HELLO_MIN,
            _ => return Ok(None),
        };
        if f.len() < min {
            return Err(Error::BadLength(f.len()));
        }
        let u32_at = |i: usize| u32::from_be_bytes([f[i], f[i + 1], f[i + 2], f[i + 3]]);
        let u64_at = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&f[i..i + 8]);
            u64::from_be_bytes(b)
        };
        let u16_at = |i: usize| u16::from_be_bytes([f[i], f[i + 1]]);
        Ok(Some(match prefix.kind {
            kind::CONNECTION => {
                let plane = Plane::from_wire(f[16])?;
                let peer = get_addr(&f[22..42])?;
                let local = get_addr(&f[42..62])?;
                let n = f[62] as usize;
                let name = f.get(63..63 + n).ok_or(Error::Truncated)?;
                let m = *f.get(63 + n).ok_or(Error::Truncated)? as usize;
                let alpn = f.get(64 + n..64 + n + m).ok_or(Error::Truncated)?;
                let server_name = if n == 0 {
                    None
                } else {
                    if !name.iter().all(|b| (0x21..=0x7e).contains(b)) {
                        return Err(Error::BadServerName);
                    }
                    // Printable ASCII is UTF-8.
                    Some(String::from_utf8_lossy(name).into_owned())
                };
                Message::Connection(ConnInfo {
                    conn_id: u64_at(8),
                    plane,
                    tls_version: u16_at(18),
                    cipher_suite: u16_at(20),
                    peer,
                    local,
                    server_name,
                    alpn: (m != 0).then(|| alpn.to_vec()),
                })
            }
            kind::REPLY => Message::Reply(Reply {
                request_id: u32_at(8),
                conn_id: u64_at(12),
                status: Status::from_wire(u16_at(20)),
            }),
            kind::KEY_UPDATE => {
                let p = u16_at(20) as usize;
                if p == 0 || p > MAX_RECORD_PLAINTEXT {
                    return Err(Error::BadPlaintext);
                }
                Message::KeyUpdate {
                    request_id: u32_at(8),
                    conn_id: u64_at(12),
                    record_plaintext: f.get(22..22 + p).ok_or(Error::Truncated)?,
                }
            }
            kind::HELLO => Message::Hello { flags: u32_at(8) },
            _ => Message::Close {
                request_id: u32_at(8),
                conn_id: u64_at(12),
            },
        }))
    }
}

fn check_server_name(name: Option<&str>) -> Result<usize, Error> {
    match name {
        None => Ok(0),
        Some(n) if n.is_empty() || n.len() > 255 => Err(Error::BadServerName),
        Some(n) if !n.bytes().all(|b| (0x21..=0x7e).contains(&b)) => Err(Error::BadServerName),
        Some(n) => Ok(n.len()),
    }
}

fn check_alpn(alpn: Option<&[u8]>) -> Result<usize, Error> {
    match alpn {
        None => Ok(0),
        Some(a) if a.is_empty() || a.len() > 255 => Err(Error::BadAlpn),
        Some(a) => Ok(a.len()),
    }
}

/// Every `SocketAddr` fits; IPv6 flow info and scope id are dropped.
fn put_addr(out: &mut [u8], addr: Option<SocketAddr>) {
    // `out` is 20 zeroed bytes.
    let Some(addr) = addr else { return };
    out[2..4].copy_from_slice(&addr.port().to_be_bytes());
    match addr.ip() {
        IpAddr::V4(ip) => {
            out[0] = 4;
            out[4..8].copy_from_slice(&ip.octets());
        }
        IpAddr::V6(ip) => {
            out[0] = 6;
            out[4..20].copy_from_slice(&ip.octets());
        }
    }
}

fn get_addr(b: &[u8]) -> Result<Option<SocketAddr>, Error> {
    debug_assert_eq!(b.len(), ADDR_LEN);
    let port = u16::from_be_bytes([b[2], b[3]]);
    match b[0] {
        0 if port == 0 && b[4..].iter().all(|&x| x == 0) => Ok(None),
        4 if b[8..].iter().all(|&x| x == 0) => Ok(Some(SocketAddr::new(
            Ipv4Addr::new(b[4], b[5], b[6], b[7]).into(),
            port,
        ))),
        6 => {
            let mut o = [0u8; 16];
            o.copy_from_slice(&b[4..20]);
            Ok(Some(SocketAddr::new(Ipv6Addr::from(o).into(), port)))
        }
        _ => Err(Error::BadAddress),
    }
}

/// What a record read from a kernel-plane socket means to a reader.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordAction<'a> {
    /// Application data (or, with 0 bytes, TCP end of stream): give it to the application.
    Data,
    /// close_notify: end of stream for the application.
    CloseNotify,
    /// Any other alert: the connection is over (`level`, `description` as TLS numbers).
    Alert { level: u8, description: u8 },
    /// A handshake record (a KeyUpdate, in practice): hand it to tlsplane as KEY_UPDATE,
    /// then read on.
    Handshake(&'a [u8]),
    /// An alert of the wrong size, an empty handshake record, or a content type that has no
    /// business after the handshake.
    Malformed(u8),
}

/// Classifies one record as the kernel returned it (`record_type` from `TLS_GET_RECORD_TYPE`,
/// `plaintext` the bytes read in that call).
pub fn classify_record(record_type: u8, plaintext: &[u8]) -> RecordAction<'_> {
    match (record_type, plaintext) {
        (23, _) => RecordAction::Data,
        (21, [_, 0]) => RecordAction::CloseNotify,
        (21, &[level, description]) => RecordAction::Alert { level, description },
        (22, p) if !p.is_empty() => RecordAction::Handshake(p),
        (t, _) => RecordAction::Malformed(t),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> ConnInfo {
        ConnInfo {
            conn_id: 0x0102_0304_0506_0708,
            plane: Plane::Kernel,
            tls_version: 0x0304,
            cipher_suite: 0x1301,
            peer: Some("192.0.2.7:51234".parse().unwrap()),
            local: Some("[2001:db8::1]:443".parse().unwrap()),
            server_name: Some("example.com".into()),
            alpn: Some(b"h2".to_vec()),
        }
    }

    fn encode(m: &Message<'_>) -> Vec<u8> {
        let mut buf = vec![0u8; MAX_FRAME_LEN];
        let n = m.encode(&mut buf).unwrap();
        buf.truncate(n);
        buf
    }

    #[test]
    fn connection_layout_is_the_documented_one() {
        let b = encode(&Message::Connection(sample()));
        assert_eq!(b.len(), 64 + 11 + 2);
        assert_eq!(&b[..8], &[b'T', b'L', b'P', b'H', 1, 1, 0, 77]);
        assert_eq!(&b[8..16], &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(&b[16..22], &[1, 0, 0x03, 0x04, 0x13, 0x01]);
        assert_eq!(&b[22..30], &[4, 0, 0xc8, 0x22, 192, 0, 2, 7]);
        assert!(b[30..42].iter().all(|&x| x == 0));
        assert_eq!(&b[42..46], &[6, 0, 0x01, 0xbb]);
        assert_eq!(
            &b[46..62],
            &"2001:db8::1".parse::<Ipv6Addr>().unwrap().octets()
        );
        assert_eq!(b[62], 11);
        assert_eq!(&b[63..74], b"example.com");
        assert_eq!(&b[74..], &[2, b'h', b'2']);
        assert_eq!(
            Message::decode(&b).unwrap(),
            Some(Message::Connection(sample()))
        );
    }

    #[test]
    fn every_message_round_trips() {
        let mut bare = sample();
        bare.plane = Plane::RawTcp;
        bare.peer = None;
        bare.local = None;
        bare.server_name = None;
        bare.alpn = None;
        let long = ConnInfo {
            server_name: Some("a".repeat(255)),
            alpn: Some(vec![0xff; 255]),
            plane: Plane::UserRelay,
            ..sample()
        };
        let ku = [24u8, 0, 0, 1, 1];
        let big = vec![22u8; MAX_RECORD_PLAINTEXT];
        let msgs = [
            Message::Connection(sample()),
            Message::Connection(bare),
            Message::Connection(long),
            Message::Reply(Reply {
                request_id: 9,
                conn_id: u64::MAX,
                status: Status::Unsupported,
            }),
            Message::Reply(Reply {
                request_id: 0,
                conn_id: 0,
                status: Status::Other(999),
            }),
            Message::KeyUpdate {
                request_id: 7,
                conn_id: 42,
                record_plaintext: &ku,
            },
            Message::KeyUpdate {
                request_id: 7,
                conn_id: 42,
                record_plaintext: &big,
            },
            Message::Close {
                request_id: 3,
                conn_id: 5,
            },
            Message::Hello {
                flags: ENDS_WITH_CLOSE,
            },
            Message::Hello { flags: u32::MAX },
        ];
        for m in &msgs {
            let b = encode(m);
            assert_eq!(b.len(), m.encoded_len().unwrap());
            assert!(b.len() <= MAX_FRAME_LEN);
            assert_eq!(Message::decode(&b).unwrap().as_ref(), Some(m));
            // Trailing bytes after the frame are not read.
            let mut more = b.clone();
            more.extend_from_slice(b"next frame");
            assert_eq!(Message::decode(&more).unwrap().as_ref(), Some(m));
            // Every strict prefix of a frame is an error, never a panic.
            for cut in 0..b.len() {
                assert!(Message::decode(&b[..cut]).is_err(), "{m:?} cut at {cut}");
            }
        }
    }

    #[test]
    fn hello_layout_is_the_documented_one() {
        let b = encode(&Message::Hello {
            flags: ENDS_WITH_CLOSE,
        });
        assert_eq!(b, [b'T', b'L', b'P', b'H', 1, 5, 0, 12, 0, 0, 0, 1]);
        // A later revision's longer HELLO, with bits this one does not name: the flags are
        // read as sent (the reader tests its bits), the tail is skipped.
        let mut longer = b.clone();
        longer[8] = 0x80;
        longer.extend_from_slice(&[0xaa; 4]);
        longer[7] = 16;
        assert_eq!(
            Message::decode(&longer).unwrap(),
            Some(Message::Hello { flags: 0x8000_0001 })
        );
        // Shorter than its minimum: an error, not a HELLO without flags.
        let mut short = b[..8].to_vec();
        short[7] = 8;
        assert_eq!(Message::decode(&short), Err(Error::BadLength(8)));
    }

    #[test]
    fn future_fields_and_kinds_are_skipped() {
        // A v1.x sender appends a field: the length grows, a v1 reader ignores the tail.
        let mut b = encode(&Message::Connection(sample()));
        b.extend_from_slice(&[0xaa; 10]);
        let len = b.len() as u16;
        b[6..8].copy_from_slice(&len.to_be_bytes());
        assert_eq!(
            Message::decode(&b).unwrap(),
            Some(Message::Connection(sample()))
        );
        // An unknown kind is well-framed and skipped.
        let mut u = encode(&Message::Close {
            request_id: 1,
            conn_id: 1,
        });
        u[5] = 200;
        assert_eq!(Message::decode(&u).unwrap(), None);
    }

    #[test]
    fn malformed_frames_are_named_errors() {
        let good = encode(&Message::Connection(sample()));
        let with = |i: usize, v: u8| {
            let mut b = good.clone();
            b[i] = v;
            Message::decode(&b).map(|m| m.map(|_| ()))
        };
        assert_eq!(with(0, b'X'), Err(Error::BadMagic));
        assert_eq!(with(4, 2), Err(Error::UnsupportedVersion(2)));
        assert_eq!(with(16, 9), Err(Error::UnknownPlane(9)));
        assert_eq!(with(22, 5), Err(Error::BadAddress)); // family 5
        assert_eq!(with(30, 1), Err(Error::BadAddress)); // IPv4 with bytes past its 4
        assert_eq!(with(63, b' '), Err(Error::BadServerName));
        assert_eq!(with(63, 0xc3), Err(Error::BadServerName));
        assert_eq!(with(62, 200), Err(Error::Truncated)); // name runs past the frame
                                                          // Length field: below the kind's minimum, above the maximum, or past the bytes.
        let mut b = good.clone();
        b[6..8].copy_from_slice(&20u16.to_be_bytes());
        assert_eq!(Message::decode(&b), Err(Error::BadLength(20)));
        b[6..8].copy_from_slice(&u16::MAX.to_be_bytes());
        assert_eq!(Message::decode(&b), Err(Error::BadLength(65535)));
        b[6..8].copy_from_slice(&7u16.to_be_bytes());
        assert_eq!(Message::decode(&b), Err(Error::BadLength(7)));
        b[6..8].copy_from_slice(&200u16.to_be_bytes());
        assert_eq!(Message::decode(&b), Err(Error::Truncated));
        // Family 0 with a port is not "no address".
        let mut none = sample();
        none.peer = None;
        let mut b = encode(&Message::Connection(none));
        b[23] = 9; // reserved: ignored
        assert!(Message::decode(&b).is_ok());
        b[25] = 80;
        assert_eq!(Message::decode(&b), Err(Error::BadAddress));
        // KEY_UPDATE: empty plaintext, or one longer than the frame.
        let mut k = encode(&Message::KeyUpdate {
            request_id: 1,
            conn_id: 2,
            record_plaintext: &[24, 0, 0, 1, 0],
        });
        k[20..22].copy_from_slice(&0u16.to_be_bytes());
        assert_eq!(Message::decode(&k), Err(Error::BadPlaintext));
        k[20..22].copy_from_slice(&6u16.to_be_bytes());
        assert_eq!(Message::decode(&k), Err(Error::Truncated));
    }

    #[test]
    fn encoding_refuses_what_decoding_would() {
        let mut buf = [0u8; 1024];
        for name in ["", "has space", "ünicode", &"a".repeat(256)] {
            let info = ConnInfo {
                server_name: Some(name.into()),
                ..sample()
            };
            assert_eq!(
                Message::Connection(info).encode(&mut buf),
                Err(Error::BadServerName),
                "{name:?}"
            );
        }
        for alpn in [vec![], vec![1; 256]] {
            let info = ConnInfo {
                alpn: Some(alpn),
                ..sample()
            };
            assert_eq!(
                Message::Connection(info).encode(&mut buf),
                Err(Error::BadAlpn)
            );
        }
        let empty = Message::KeyUpdate {
            request_id: 0,
            conn_id: 0,
            record_plaintext: &[],
        };
        assert_eq!(empty.encode(&mut buf), Err(Error::BadPlaintext));
        assert_eq!(
            Message::Connection(sample()).encode(&mut buf[..76]),
            Err(Error::BufferTooSmall { needed: 77 })
        );
    }

    /// xorshift64*: deterministic, no dependency.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    /// Random bytes, and valid frames with random bytes changed, cut or grown: decoding never
    /// panics, and whatever it accepts encodes back to a frame that decodes the same.
    #[test]
    fn random_input_never_panics_and_accepted_frames_round_trip() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let seeds: Vec<Vec<u8>> = vec![
            encode(&Message::Connection(sample())),
            encode(&Message::Reply(Reply {
                request_id: 1,
                conn_id: 2,
                status: Status::Ok,
            })),
            encode(&Message::KeyUpdate {
                request_id: 1,
                conn_id: 2,
                record_plaintext: &[24, 0, 0, 1, 1],
            }),
            encode(&Message::Close {
                request_id: 1,
                conn_id: 2,
            }),
            encode(&Message::Hello {
                flags: ENDS_WITH_CLOSE,
            }),
        ];
        let mut accepted = 0;
        for round in 0..200_000 {
            let mut b = if round % 4 == 0 {
                let mut b = vec![0u8; rng.below(700)];
                b.iter_mut().for_each(|x| *x = rng.next() as u8);
                if rng.below(2) == 0 && b.len() >= 8 {
                    b[..5].copy_from_slice(&[b'T', b'L', b'P', b'H', 1]);
                }
                b
            } else {
                seeds[rng.below(seeds.len())].clone()
            };
            for _ in 0..rng.below(4) {
                if b.is_empty() {
                    break;
                }
                match rng.below(3) {
                    0 => {
                        let i = rng.below(b.len());
                        b[i] = rng.next() as u8;
                    }
                    1 => b.truncate(rng.below(b.len())),
                    _ => b.extend((0..rng.below(40)).map(|_| rng.next() as u8)),
                }
            }
            let _ = Prefix::decode(&b);
            if let Ok(Some(m)) = Message::decode(&b) {
                accepted += 1;
                let again = encode(&m);
                assert_eq!(Message::decode(&again).unwrap().as_ref(), Some(&m));
            }
        }
        assert!(
            accepted > 1000,
            "the mutations should leave many frames valid"
        );
    }

    #[test]
    fn records_are_classified() {
        assert_eq!(classify_record(23, b"GET /"), RecordAction::Data);
        assert_eq!(classify_record(23, b""), RecordAction::Data);
        assert_eq!(classify_record(21, &[1, 0]), RecordAction::CloseNotify);
        assert_eq!(
            classify_record(21, &[2, 40]),
            RecordAction::Alert {
                level: 2,
                description: 40
            }
        );
        assert_eq!(classify_record(21, &[2]), RecordAction::Malformed(21));
        assert_eq!(
            classify_record(22, &[24, 0, 0, 1, 1]),
            RecordAction::Handshake(&[24, 0, 0, 1, 1])
        );
        assert_eq!(classify_record(22, &[]), RecordAction::Malformed(22));
        assert_eq!(classify_record(20, &[1]), RecordAction::Malformed(20));
    }
}
