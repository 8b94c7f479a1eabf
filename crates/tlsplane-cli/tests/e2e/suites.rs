//! Test 7: every cipher suite, key-exchange group and certificate type the server offers
//! negotiates with a real client, and data then flows intact. Assertions are on what the
//! client reports as negotiated, not on exit codes.

use std::time::Duration;

use rustls::crypto::aws_lc_rs::{cipher_suite as cs, kx_group};
use rustls::crypto::SupportedKxGroup;
use rustls::NamedGroup;

use crate::support::client::{assert_file_body, ClientOpts, Tls, TlsClient, BOTH};
use crate::support::fixtures::{self, sha256};
use crate::support::tools::{self, header, line_value, split_http};
use crate::support::{CertKind, Server};

use super::content::s_client_get;

const TLS13_SUITES: [&str; 3] = [
    "TLS_AES_128_GCM_SHA256",
    "TLS_AES_256_GCM_SHA384",
    "TLS_CHACHA20_POLY1305_SHA256",
];
const TLS12_ECDSA: [&str; 3] = [
    "ECDHE-ECDSA-AES128-GCM-SHA256",
    "ECDHE-ECDSA-AES256-GCM-SHA384",
    "ECDHE-ECDSA-CHACHA20-POLY1305",
];
const TLS12_RSA: [&str; 3] = [
    "ECDHE-RSA-AES128-GCM-SHA256",
    "ECDHE-RSA-AES256-GCM-SHA384",
    "ECDHE-RSA-CHACHA20-POLY1305",
];

/// Checks an s_client run fetched /text.txt intact over the expected version, and returns its
/// stderr summary.
fn check_s_client(out: &tools::Output, v: Tls, what: &str) -> String {
    assert!(
        out.status.success(),
        "{what}: s_client failed:\n{}",
        out.describe()
    );
    let err = out.stderr_text();
    assert_eq!(
        line_value(&err, &["Protocol version:"]).as_deref(),
        Some(v.name()),
        "{what}:\n{err}"
    );
    let (status, headers, body) = split_http(&out.stdout);
    let text = &fixtures::get().text;
    assert_eq!(status, 200, "{what}");
    assert_eq!(
        header(&headers, "content-length"),
        Some(text.size.to_string().as_str()),
        "{what}"
    );
    assert!(
        sha256(&body) == text.sha256,
        "{what}: body differs from text.txt"
    );
    err
}

fn openssl_suites(v: Tls, cert: CertKind, suites: &[&str]) {
    if !tools::require("openssl") {
        return;
    }
    let server = Server::builder().cert(cert).start();
    for suite in suites {
        let flag = if v == Tls::V13 {
            "-ciphersuites"
        } else {
            "-cipher"
        };
        let out = s_client_get(server.port(), v, "/text.txt", &[flag, suite]);
        let err = check_s_client(&out, v, suite);
        assert_eq!(
            line_value(&err, &["Ciphersuite:"]).as_deref(),
            Some(*suite),
            "negotiated suite:\n{err}"
        );
    }
    let stats = server.stop();
    assert_eq!(stats["handshakes"], suites.len() as u64);
    assert_eq!(stats["http_requests"], suites.len() as u64);
}

#[test]
fn suites_tls13_openssl() {
    openssl_suites(Tls::V13, CertKind::P256, &TLS13_SUITES);
}

#[test]
fn suites_tls12_ecdsa_openssl() {
    openssl_suites(Tls::V12, CertKind::P256, &TLS12_ECDSA);
}

#[test]
fn suites_tls12_rsa_openssl() {
    openssl_suites(Tls::V12, CertKind::Rsa2048, &TLS12_RSA);
}

/// curl's own names for the negotiated suite are OpenSSL's; `-v` prints
/// `SSL connection using TLSv1.x / SUITE`.
fn curl_suites(v: Tls, cert: CertKind, suites: &[&str]) {
    if !tools::require("curl") {
        return;
    }
    let text = &fixtures::get().text;
    let server = Server::builder().cert(cert).start();
    let port = server.port();
    for suite in suites {
        let url = format!("https://localhost:{port}/text.txt");
        let mut cmd = v.curl(port, 20);
        cmd.args([
            if v == Tls::V13 {
                "--tls13-ciphers"
            } else {
                "--ciphers"
            },
            suite,
        ])
        .args(["-o", "-", &url]);
        let out = tools::run(cmd, b"", Duration::from_secs(30));
        assert!(out.status.success(), "curl {suite}:\n{}", out.describe());
        let err = out.stderr_text();
        let want = format!("SSL connection using {} / {suite}", v.name());
        assert!(err.contains(&want), "curl did not report `{want}`:\n{err}");
        assert!(
            sha256(&out.stdout) == text.sha256,
            "curl {suite}: body differs"
        );
    }
    assert_eq!(server.stop()["handshakes"], suites.len() as u64);
}

#[test]
fn suites_tls13_curl() {
    curl_suites(Tls::V13, CertKind::P256, &TLS13_SUITES);
}

#[test]
fn suites_tls12_ecdsa_curl() {
    curl_suites(Tls::V12, CertKind::P256, &TLS12_ECDSA);
}

#[test]
fn suites_tls12_rsa_curl() {
    curl_suites(Tls::V12, CertKind::Rsa2048, &TLS12_RSA);
}

/// Every suite from rustls' side too, asserting `negotiated_cipher_suite`.
#[test]
fn suites_rustls() {
    let text = &fixtures::get().text;
    for (cert, suites) in [
        (
            CertKind::P256,
            vec![
                cs::TLS13_AES_128_GCM_SHA256,
                cs::TLS13_AES_256_GCM_SHA384,
                cs::TLS13_CHACHA20_POLY1305_SHA256,
            ],
        ),
        (
            CertKind::P256,
            vec![
                cs::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
                cs::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,
                cs::TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256,
            ],
        ),
        (
            CertKind::Rsa2048,
            vec![
                cs::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,
                cs::TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384,
                cs::TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256,
            ],
        ),
    ] {
        let server = Server::builder().cert(cert).start();
        for suite in &suites {
            let v = if suite.version() == &rustls::version::TLS13 {
                Tls::V13
            } else {
                Tls::V12
            };
            let opts = ClientOpts {
                versions: vec![v],
                groups: None,
                suites: Some(vec![*suite]),
            };
            let mut c = TlsClient::connect(server.port(), &opts);
            assert_eq!(
                c.conn.negotiated_cipher_suite().map(|s| s.suite()),
                Some(suite.suite())
            );
            assert_eq!(c.conn.protocol_version(), Some(v.protocol()));
            assert_file_body(&c.get("/text.txt"), text, &format!("{:?}", suite.suite()));
        }
        assert_eq!(server.stop()["handshakes"], suites.len() as u64);
    }
}

/// True when an OpenSSL group report (`Server Temp Key: ECDH, prime256v1, 256 bits`,
/// `Server Temp Key: X25519, 253 bits`, or newer `Negotiated TLS1.3 group: X25519`) names `group`.
fn group_matches(group: &str, reported: &str) -> bool {
    let names: &[&str] = match group {
        "X25519" => &["X25519"],
        "P-256" => &["prime256v1", "P-256", "secp256r1"],
        "P-384" => &["secp384r1", "P-384"],
        other => panic!("unknown group {other}"),
    };
    names.iter().any(|n| reported.contains(n)) && !reported.contains("MLKEM")
}

/// Groups through OpenSSL. The RSA certificate keeps TLS 1.2 clients from also having to
/// offer the certificate's curve (OpenSSL restricts ECDSA certificates to offered groups).
#[test]
fn groups_openssl() {
    if !tools::require("openssl") {
        return;
    }
    let server = Server::builder().cert(CertKind::Rsa2048).start();
    let mut n = 0;
    for v in BOTH {
        for group in ["X25519", "P-256", "P-384"] {
            let out = s_client_get(server.port(), v, "/text.txt", &["-groups", group]);
            let err = check_s_client(&out, v, group);
            let reported = line_value(
                &err,
                &[
                    "Negotiated TLS1.3 group:",
                    "Server Temp Key:",
                    "Peer Temp Key:",
                ],
            )
            .unwrap_or_else(|| panic!("s_client reported no key-exchange group:\n{err}"));
            assert!(
                group_matches(group, &reported),
                "{v:?}: asked for {group}, s_client reports {reported:?}"
            );
            n += 1;
        }
    }
    assert_eq!(server.stop()["handshakes"], n);
}

/// Groups through rustls, including the hybrid post-quantum X25519MLKEM768 (TLS 1.3 only).
#[test]
fn groups_rustls() {
    let text = &fixtures::get().text;
    let server = Server::start();
    let groups: [(&'static dyn SupportedKxGroup, NamedGroup, &[Tls]); 4] = [
        (
            kx_group::X25519MLKEM768,
            NamedGroup::X25519MLKEM768,
            &[Tls::V13],
        ),
        (kx_group::X25519, NamedGroup::X25519, &BOTH),
        (kx_group::SECP256R1, NamedGroup::secp256r1, &BOTH),
        (kx_group::SECP384R1, NamedGroup::secp384r1, &BOTH),
    ];
    let mut n = 0;
    for (group, name, versions) in groups {
        for &v in versions {
            let opts = ClientOpts {
                versions: vec![v],
                groups: Some(vec![group]),
                suites: None,
            };
            let mut c = TlsClient::connect(server.port(), &opts);
            assert_eq!(
                c.conn.negotiated_key_exchange_group().map(|g| g.name()),
                Some(name),
                "{v:?}"
            );
            assert_file_body(&c.get("/text.txt"), text, &format!("{v:?} {name:?}"));
            n += 1;
        }
    }
    assert_eq!(server.stop()["handshakes"], n);
}

/// Ed25519 and P-384 server keys, with rustls, curl and openssl over both versions.
#[test]
fn cert_types_ed25519_and_p384() {
    let text = &fixtures::get().text;
    let have_curl = tools::require("curl");
    let have_openssl = tools::require("openssl");
    for (cert, sig) in [(CertKind::Ed25519, "Ed25519"), (CertKind::P384, "ECDSA")] {
        let server = Server::builder().cert(cert).start();
        let port = server.port();
        let mut n = 0;
        for v in BOTH {
            let mut c = TlsClient::connect_version(port, v);
            assert_file_body(&c.get("/text.txt"), text, &format!("rustls {cert:?} {v:?}"));
            n += 1;
            if have_openssl {
                let out = s_client_get(port, v, "/text.txt", &[]);
                let err = check_s_client(&out, v, &format!("{cert:?}"));
                let reported = line_value(&err, &["Signature type:"]).unwrap_or_default();
                assert!(
                    reported.eq_ignore_ascii_case(sig),
                    "{cert:?} {v:?}: signature type {reported:?}, want {sig}:\n{err}"
                );
                n += 1;
            }
            if have_curl {
                let mut cmd = v.curl(port, 20);
                cmd.args(["-o", "-", &format!("https://localhost:{port}/text.txt")]);
                let out = tools::run(cmd, b"", Duration::from_secs(30));
                assert!(
                    out.status.success(),
                    "curl {cert:?} {v:?}:\n{}",
                    out.describe()
                );
                assert!(out
                    .stderr_text()
                    .contains(&format!("SSL connection using {} /", v.name())));
                assert!(
                    sha256(&out.stdout) == text.sha256,
                    "curl {cert:?} {v:?}: body differs"
                );
                n += 1;
            }
        }
        assert_eq!(server.stop()["handshakes"], n);
    }
}
