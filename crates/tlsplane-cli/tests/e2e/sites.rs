//! Many sites by server name (`serve --config`): each gets its own certificate and content,
//! checked with real clients (curl, openssl s_client) by the certificate's bytes, not its name.
//! (openssl s_client with no input closes right after its handshake, before the kernel can
//! take the connection: in kernel mode those count as refused, not as kernel-plane ones.)

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::support::fixtures::{self, CertFiles, CertKind};
use crate::support::{tools, Server};

/// A site to write into a configuration file.
pub struct SiteSpec<'a> {
    pub names: &'a [&'a str],
    pub default: bool,
    pub certs: Vec<CertFiles>,
    /// The content of its /index.html (and its root's name).
    pub content: &'a str,
}

/// A directory for one test's configuration, certificates and roots.
pub fn scratch(test: &str) -> PathBuf {
    let dir = fixtures::get().base.join("sites").join(test);
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// Writes `dir/tlsplane.toml` for these sites (roots `dir/<content>/index.html`), with extra
/// lines for `[server]`.
pub fn write_config(dir: &Path, server: &str, sites: &[SiteSpec]) -> PathBuf {
    let mut toml = format!("[server]\n{server}\n");
    for s in sites {
        let root = dir.join(s.content);
        fs::create_dir_all(&root).expect("site root");
        fs::write(root.join("index.html"), s.content).expect("index.html");
        toml.push_str(&format!(
            "\n[[site]]\nserver-names = {:?}\nroot = {:?}\ndefault = {}\n",
            s.names, s.content, s.default
        ));
        for c in &s.certs {
            toml.push_str(&format!(
                "[[site.cert]]\nchain = {:?}\nkey = {:?}\n",
                c.cert_pem, c.key_pem
            ));
        }
    }
    let path = dir.join("tlsplane.toml");
    fs::write(&path, toml).expect("config");
    path
}

/// The leaf certificate of a PEM chain file, as PEM text without line breaks.
pub fn leaf_pem(path: &Path) -> String {
    let text = fs::read_to_string(path).expect("chain file");
    first_pem(&text).unwrap_or_else(|| panic!("no certificate in {}", path.display()))
}

fn first_pem(text: &str) -> Option<String> {
    let start = text.find("-----BEGIN CERTIFICATE-----")?;
    let end = text[start..].find("-----END CERTIFICATE-----")? + start;
    Some(text[start..end].split_whitespace().collect())
}

/// The certificate the server presents for `sni` (openssl s_client), as [`leaf_pem`] gives it;
/// `extra` adds s_client options (versions, signature algorithms).
pub fn served_leaf(port: u16, sni: &str, extra: &[&str]) -> String {
    let mut cmd = Command::new("openssl");
    // A request, and s_client waits for the server's close (-ign_eof): a client that closes
    // right after its handshake races the kernel plane's hand-off (kernel_setup_failures),
    // which is not what this looks at.
    cmd.args([
        "s_client",
        "-ign_eof",
        "-connect",
        &format!("127.0.0.1:{port}"),
    ])
    .args(["-servername", sni])
    .args(extra);
    let request = format!("GET / HTTP/1.0\r\nHost: {sni}\r\n\r\n");
    let out = tools::run(cmd, request.as_bytes(), Duration::from_secs(10));
    first_pem(&out.stdout_text()).unwrap_or_else(|| {
        panic!(
            "s_client -servername {sni} got no certificate: {}",
            out.describe()
        )
    })
}

/// curl GET https://<name>:port/ trusting the test CA, resolved to 127.0.0.1; (status, body).
pub fn curl_site(port: u16, name: &str, host: Option<&str>) -> (String, String) {
    let mut cmd = Command::new("curl");
    cmd.args(["-sS", "--http1.1", "--max-time", "10", "--cacert"])
        .arg(&fixtures::pki().ca_pem)
        .args(["--resolve", &format!("{name}:{port}:127.0.0.1")])
        .args(["-w", "\n%{http_code}"]);
    if let Some(h) = host {
        cmd.args(["-H", &format!("Host: {h}")]);
    }
    cmd.arg(format!("https://{name}:{port}/"));
    let out = tools::run(cmd, b"", Duration::from_secs(15));
    assert!(out.status.success(), "curl {name}: {}", out.describe());
    let text = out.stdout_text();
    let (body, code) = text.rsplit_once('\n').expect("curl -w code");
    (code.to_string(), body.to_string())
}

#[test]
fn exact_wildcard_and_default_sites_each_serve_their_certificate_and_content() {
    if !tools::require("curl") || !tools::require("openssl") {
        return;
    }
    let dir = scratch("three");
    let pki = fixtures::pki();
    let exact = pki.issue_in(&dir, "exact", &["a.test"], CertKind::P256);
    let wild = pki.issue_in(&dir, "wild", &["*.w.test", "w.test"], CertKind::P256);
    let fallback = pki.issue_in(&dir, "default", &["other.test"], CertKind::P256);
    let want = [
        leaf_pem(&exact.cert_pem),
        leaf_pem(&wild.cert_pem),
        leaf_pem(&fallback.cert_pem),
    ];
    let config = write_config(
        &dir,
        "",
        &[
            SiteSpec {
                names: &["a.test"],
                default: false,
                certs: vec![exact],
                content: "site-exact",
            },
            SiteSpec {
                names: &["*.w.test"],
                default: false,
                certs: vec![wild],
                content: "site-wild",
            },
            SiteSpec {
                names: &[],
                default: true,
                certs: vec![fallback],
                content: "site-default",
            },
        ],
    );
    let server = Server::builder()
        .config_file(&config)
        .expect_user_fallbacks()
        .start();
    let port = server.port();
    // (name asked for, site number); names differ in case from the configured ones.
    for (name, site) in [
        ("a.test", 0),
        ("A.Test", 0),
        ("x.w.test", 1),
        ("deep.x.W.test", 1),
        ("other.test", 2),
    ] {
        assert_eq!(
            served_leaf(port, name, &[]),
            want[site],
            "openssl s_client -servername {name}: not site {site}'s certificate"
        );
    }
    for (name, content) in [
        ("a.test", "site-exact"),
        ("x.w.test", "site-wild"),
        ("other.test", "site-default"),
    ] {
        assert_eq!(
            curl_site(port, name, None),
            ("200".to_string(), content.to_string()),
            "curl https://{name}/"
        );
    }
    // TLS for a.test, Host for the wildcard site: not this connection's site.
    let (code, _) = curl_site(port, "a.test", Some("x.w.test"));
    assert_eq!(code, "421", "a Host of another site must get 421");
    // A Host the default site answers for, on a connection to a named site: also another site.
    let (code, _) = curl_site(port, "a.test", Some("unknown.test"));
    assert_eq!(code, "421");
    let stats = server.stop();
    assert!(stats.get("http_responses_4xx") >= 2, "{stats:?}");
}

#[test]
fn a_site_with_ecdsa_and_rsa_serves_rsa_only_to_clients_without_ecdsa() {
    if !tools::require("openssl") {
        return;
    }
    let dir = scratch("dual");
    let pki = fixtures::pki();
    let ecdsa = pki.issue_in(&dir, "ecdsa", &["dual.test"], CertKind::P256);
    let rsa = pki.issue_in(&dir, "rsa", &["dual.test"], CertKind::Rsa2048);
    let (want_ecdsa, want_rsa) = (leaf_pem(&ecdsa.cert_pem), leaf_pem(&rsa.cert_pem));
    let config = write_config(
        &dir,
        "",
        &[SiteSpec {
            names: &["dual.test"],
            default: true,
            certs: vec![ecdsa, rsa],
            content: "dual",
        }],
    );
    let server = Server::builder()
        .config_file(&config)
        .expect_user_fallbacks()
        .start();
    let port = server.port();
    for v in ["-tls1_3", "-tls1_2"] {
        assert_eq!(
            served_leaf(port, "dual.test", &[v]),
            want_ecdsa,
            "{v}: a client that accepts ECDSA gets the first (ECDSA) certificate"
        );
    }
    assert_eq!(
        served_leaf(
            port,
            "dual.test",
            &[
                "-tls1_3",
                "-sigalgs",
                "rsa_pss_rsae_sha256:rsa_pss_rsae_sha384"
            ]
        ),
        want_rsa,
        "TLS 1.3 client offering only RSA-PSS"
    );
    assert_eq!(
        served_leaf(
            port,
            "dual.test",
            &["-tls1_2", "-sigalgs", "RSA+SHA256:RSA-PSS+SHA256"]
        ),
        want_rsa,
        "TLS 1.2 client offering only RSA signatures"
    );
    assert_eq!(
        served_leaf(
            port,
            "dual.test",
            &["-tls1_2", "-cipher", "ECDHE-RSA-AES128-GCM-SHA256"]
        ),
        want_rsa,
        "TLS 1.2 client offering only ECDHE-RSA suites"
    );
    server.stop();
}

#[test]
fn a_name_for_no_site_without_a_default_is_refused_as_configured() {
    if !tools::require("openssl") {
        return;
    }
    let dir = scratch("unknown");
    let cert = fixtures::pki().issue_in(&dir, "only", &["only.test"], CertKind::P256);
    let want = leaf_pem(&cert.cert_pem);
    let config = write_config(
        &dir,
        "",
        &[SiteSpec {
            names: &["only.test"],
            default: false,
            certs: vec![cert],
            content: "only",
        }],
    );
    let s_client = |port: u16, sni: Option<&str>| {
        let mut cmd = Command::new("openssl");
        cmd.args(["s_client", "-connect", &format!("127.0.0.1:{port}")]);
        match sni {
            Some(n) => cmd.args(["-servername", n]),
            None => cmd.arg("-noservername"),
        };
        let out = tools::run(cmd, b"", Duration::from_secs(10));
        format!("{}{}", out.stdout_text(), out.stderr_text())
    };

    let server = Server::builder()
        .config_file(&config)
        .expect_user_fallbacks()
        .start();
    let port = server.port();
    assert_eq!(served_leaf(port, "only.test", &[]), want);
    for sni in [Some("nope.test"), None] {
        let text = s_client(port, sni);
        assert!(
            text.contains("unrecognized name") || text.contains("alert number 112"),
            "{sni:?}: expected an unrecognized_name alert:\n{text}"
        );
        assert!(first_pem(&text).is_none(), "a certificate was sent: {text}");
    }
    let stats = server.stop();
    assert_eq!(stats.get("unknown_server_names"), 2, "{stats:?}");

    let server = Server::builder()
        .config_file(&config)
        .expect_user_fallbacks()
        .arg("--unknown-name")
        .arg("reset")
        .start();
    let text = s_client(server.port(), Some("nope.test"));
    assert!(
        !text.contains("alert") && first_pem(&text).is_none(),
        "--unknown-name reset must send nothing:\n{text}"
    );
    let stats = server.stop();
    assert_eq!(stats.get("unknown_server_names"), 1, "{stats:?}");
}
