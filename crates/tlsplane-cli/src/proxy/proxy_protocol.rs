//! The PROXY protocol header (HAProxy's doc/proxy-protocol.txt) a TLS terminator puts in
//! front of what it forwards, so that the backend learns the client's address (and, in
//! version 2, what the TLS handshake negotiated). Pure encoding, no I/O.

use std::net::SocketAddr;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Version {
    V1,
    V2,
}

impl std::str::FromStr for Version {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "v1" | "1" => Ok(Self::V1),
            "v2" | "2" => Ok(Self::V2),
            _ => Err(format!("{s:?}: expected v1 or v2")),
        }
    }
}

/// What the header carries beyond the addresses (version 2 only).
#[derive(Clone, Debug, Default)]
pub struct TlsFacts<'a> {
    pub alpn: Option<&'a [u8]>,
    pub server_name: Option<&'a str>,
    /// "TLSv1.3", as OpenSSL names versions (what HAProxy sends).
    pub version: Option<&'a str>,
    /// The suite's name as OpenSSL gives it ([`cipher_name`]).
    pub cipher: Option<&'a str>,
}

/// A cipher suite's name as OpenSSL, and so HAProxy, puts it in the SSL_CIPHER TLV: the PROXY
/// protocol's own example of that TLV is an OpenSSL name ("ECDHE-RSA-AES128-GCM-SHA256"), and
/// what backends match on (nginx's `$proxy_protocol_tlv_ssl_cipher`, HAProxy's fetches).
/// OpenSSL names TLS 1.3 suites as IANA does (TLS_AES_128_GCM_SHA256); rustls' own names
/// (TLS13_AES_128_GCM_SHA256) are neither. A suite not listed keeps rustls' name.
pub fn cipher_name(suite: rustls::CipherSuite) -> std::borrow::Cow<'static, str> {
    use rustls::CipherSuite as S;
    let name = match suite {
        S::TLS13_AES_128_GCM_SHA256 => "TLS_AES_128_GCM_SHA256",
        S::TLS13_AES_256_GCM_SHA384 => "TLS_AES_256_GCM_SHA384",
        S::TLS13_CHACHA20_POLY1305_SHA256 => "TLS_CHACHA20_POLY1305_SHA256",
        S::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256 => "ECDHE-ECDSA-AES128-GCM-SHA256",
        S::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384 => "ECDHE-ECDSA-AES256-GCM-SHA384",
        S::TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256 => "ECDHE-ECDSA-CHACHA20-POLY1305",
        S::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256 => "ECDHE-RSA-AES128-GCM-SHA256",
        S::TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384 => "ECDHE-RSA-AES256-GCM-SHA384",
        S::TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256 => "ECDHE-RSA-CHACHA20-POLY1305",
        other => return format!("{other:?}").into(),
    };
    name.into()
}

const V2_SIGNATURE: [u8; 12] = *b"\r\n\r\n\0\r\nQUIT\n";
const PP2_TYPE_ALPN: u8 = 0x01;
const PP2_TYPE_AUTHORITY: u8 = 0x02;
const PP2_TYPE_SSL: u8 = 0x20;
const PP2_SUBTYPE_SSL_VERSION: u8 = 0x21;
const PP2_SUBTYPE_SSL_CIPHER: u8 = 0x23;
const PP2_CLIENT_SSL: u8 = 0x01;

/// The header for a connection from `client` to `server` (our listening address).
pub fn header(version: Version, client: SocketAddr, server: SocketAddr, tls: &TlsFacts) -> Vec<u8> {
    // A v4 client on a dual-stack listener shows up as ::ffff:a.b.c.d; the backend wants a.b.c.d.
    let (client, server) = (canonical(client), canonical(server));
    match version {
        Version::V1 => v1(client, server),
        Version::V2 => v2(client, server, tls),
    }
}

fn canonical(a: SocketAddr) -> SocketAddr {
    match a {
        SocketAddr::V6(v6) => match v6.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(v4.into(), v6.port()),
            None => a,
        },
        v4 => v4,
    }
}

fn v1(client: SocketAddr, server: SocketAddr) -> Vec<u8> {
    match (client, server) {
        (SocketAddr::V4(c), SocketAddr::V4(s)) => format!(
            "PROXY TCP4 {} {} {} {}\r\n",
            c.ip(),
            s.ip(),
            c.port(),
            s.port()
        ),
        (SocketAddr::V6(c), SocketAddr::V6(s)) => format!(
            "PROXY TCP6 {} {} {} {}\r\n",
            c.ip(),
            s.ip(),
            c.port(),
            s.port()
        ),
        // Families differ (cannot happen on one TCP connection): the spec's "unknown".
        _ => "PROXY UNKNOWN\r\n".to_string(),
    }
    .into_bytes()
}

fn v2(client: SocketAddr, server: SocketAddr, tls: &TlsFacts) -> Vec<u8> {
    let mut body = Vec::with_capacity(128);
    let family = match (client, server) {
        (SocketAddr::V4(c), SocketAddr::V4(s)) => {
            body.extend_from_slice(&c.ip().octets());
            body.extend_from_slice(&s.ip().octets());
            body.extend_from_slice(&c.port().to_be_bytes());
            body.extend_from_slice(&s.port().to_be_bytes());
            0x11 // AF_INET, STREAM
        }
        (SocketAddr::V6(c), SocketAddr::V6(s)) => {
            body.extend_from_slice(&c.ip().octets());
            body.extend_from_slice(&s.ip().octets());
            body.extend_from_slice(&c.port().to_be_bytes());
            body.extend_from_slice(&s.port().to_be_bytes());
            0x21 // AF_INET6, STREAM
        }
        _ => 0x00, // AF_UNSPEC: the backend ignores the addresses
    };
    if let Some(alpn) = tls.alpn {
        tlv(&mut body, PP2_TYPE_ALPN, alpn);
    }
    if let Some(name) = tls.server_name {
        tlv(&mut body, PP2_TYPE_AUTHORITY, name.as_bytes());
    }
    let mut ssl = vec![PP2_CLIENT_SSL, 0, 0, 0, 0]; // client over TLS; verify = 0 (no client cert)
    if let Some(v) = tls.version {
        tlv(&mut ssl, PP2_SUBTYPE_SSL_VERSION, v.as_bytes());
    }
    if let Some(c) = tls.cipher {
        tlv(&mut ssl, PP2_SUBTYPE_SSL_CIPHER, c.as_bytes());
    }
    tlv(&mut body, PP2_TYPE_SSL, &ssl);
    let mut out = Vec::with_capacity(16 + body.len());
    out.extend_from_slice(&V2_SIGNATURE);
    out.push(0x21); // version 2, PROXY command
    out.push(family);
    // Bounded: addresses (≤ 36) + ALPN (≤ 255) + SNI (≤ 255) + a few short TLVs.
    out.extend_from_slice(&(body.len() as u16).to_be_bytes());
    out.extend_from_slice(&body);
    out
}

fn tlv(out: &mut Vec<u8>, kind: u8, value: &[u8]) {
    let len = value.len().min(u16::MAX as usize);
    out.push(kind);
    out.extend_from_slice(&(len as u16).to_be_bytes());
    out.extend_from_slice(&value[..len]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v1_names_both_ends() {
        let h = header(
            Version::V1,
            "127.0.0.2:5000".parse().unwrap(),
            "[::ffff:127.0.0.1]:8443".parse().unwrap(),
            &TlsFacts::default(),
        );
        assert_eq!(h, b"PROXY TCP4 127.0.0.2 127.0.0.1 5000 8443\r\n");
        let h = header(
            Version::V1,
            "[::1]:5000".parse().unwrap(),
            "[::1]:8443".parse().unwrap(),
            &TlsFacts::default(),
        );
        assert_eq!(h, b"PROXY TCP6 ::1 ::1 5000 8443\r\n");
    }

    #[test]
    fn v2_carries_addresses_and_tls_tlvs() {
        let facts = TlsFacts {
            alpn: Some(b"h2"),
            server_name: Some("a.example"),
            version: Some("TLSv1.3"),
            cipher: Some("TLS_AES_128_GCM_SHA256"),
        };
        let h = header(
            Version::V2,
            "10.0.0.1:1234".parse().unwrap(),
            "10.0.0.2:443".parse().unwrap(),
            &facts,
        );
        assert_eq!(&h[..12], &V2_SIGNATURE);
        assert_eq!(h[12], 0x21);
        assert_eq!(h[13], 0x11);
        let len = u16::from_be_bytes([h[14], h[15]]) as usize;
        assert_eq!(h.len(), 16 + len);
        assert_eq!(
            &h[16..28],
            &[10, 0, 0, 1, 10, 0, 0, 2, 0x04, 0xd2, 0x01, 0xbb]
        );
        // Walk the TLVs.
        let mut tlvs = Vec::new();
        let mut rest = &h[28..];
        while !rest.is_empty() {
            let l = u16::from_be_bytes([rest[1], rest[2]]) as usize;
            tlvs.push((rest[0], rest[3..3 + l].to_vec()));
            rest = &rest[3 + l..];
        }
        assert_eq!(tlvs[0], (PP2_TYPE_ALPN, b"h2".to_vec()));
        assert_eq!(tlvs[1], (PP2_TYPE_AUTHORITY, b"a.example".to_vec()));
        assert_eq!(tlvs[2].0, PP2_TYPE_SSL);
        let ssl = &tlvs[2].1;
        assert_eq!(ssl[0], PP2_CLIENT_SSL);
        assert_eq!(&ssl[5..8], &[PP2_SUBTYPE_SSL_VERSION, 0, 7]);
        assert_eq!(&ssl[8..15], b"TLSv1.3");
        assert_eq!(ssl[15], PP2_SUBTYPE_SSL_CIPHER);
    }

    #[test]
    fn cipher_names_are_openssls() {
        let provider = tlsplane::config::crypto_provider();
        for suite in &provider.cipher_suites {
            let name = cipher_name(suite.suite());
            assert!(!name.starts_with("TLS13_"), "{name}");
            // OpenSSL's TLS 1.2 names have no TLS_ prefix and dashes; its TLS 1.3 ones are
            // IANA's.
            let tls13 = suite.version() == &rustls::version::TLS13;
            assert_eq!(name.starts_with("TLS_"), tls13, "{name}");
            assert_eq!(name.contains('-'), !tls13, "{name}");
        }
        use rustls::CipherSuite as S;
        assert_eq!(
            cipher_name(S::TLS13_AES_128_GCM_SHA256),
            "TLS_AES_128_GCM_SHA256"
        );
        assert_eq!(
            cipher_name(S::TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256),
            "ECDHE-ECDSA-CHACHA20-POLY1305"
        );
    }
}
