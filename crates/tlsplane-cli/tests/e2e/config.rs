//! `tlsplane check-config` (and `serve --config` refusing what it refuses): the documented
//! example is accepted, every error is reported with its file, site and reason, and
//! certificates near expiry or not covering their names are warned about.

use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::sites::{scratch, write_config, SiteSpec};
use crate::support::fixtures::{self, CertKind};
use crate::support::{server_bin, tools};

fn check_config(path: &Path) -> tools::Output {
    let mut cmd = Command::new(server_bin());
    cmd.arg("check-config").arg(path);
    tools::run(cmd, b"", Duration::from_secs(30))
}

/// The first ```toml block of docs/CONFIG.md (compiled in: the kernel-plane guests have the
/// test binary, not the source tree).
fn documented_example() -> String {
    let text = include_str!("../../../../docs/CONFIG.md");
    let start = text
        .find("```toml\n")
        .expect("a ```toml block in docs/CONFIG.md")
        + 8;
    let len = text[start..].find("```").expect("end of the toml block");
    text[start..start + len].to_string()
}

#[test]
fn the_documented_example_is_accepted() {
    let dir = scratch("doc-example");
    let example = documented_example();
    let path = dir.join("tlsplane.toml");
    fs::write(&path, &example).expect("example");
    // Make what it names: each site's root, and certificates for its names at its paths.
    let table: toml::Table = example.parse().expect("the example is TOML");
    let sites = table["site"].as_array().expect("[[site]]");
    let pki = fixtures::pki();
    for (i, site) in sites.iter().enumerate() {
        fs::create_dir_all(dir.join(site["root"].as_str().expect("root"))).expect("root");
        let names: Vec<&str> = site
            .get("server-names")
            .and_then(|n| n.as_array())
            .map(|a| a.iter().filter_map(|v| v.as_str()).collect())
            .unwrap_or_default();
        let names = if names.is_empty() {
            vec!["default.test"]
        } else {
            names
        };
        for (j, cert) in site["cert"]
            .as_array()
            .expect("[[site.cert]]")
            .iter()
            .enumerate()
        {
            let (chain, key) = (
                cert["chain"].as_str().unwrap(),
                cert["key"].as_str().unwrap(),
            );
            let kind = if chain.contains("rsa") {
                CertKind::Rsa2048
            } else {
                CertKind::P256
            };
            let made = pki.issue_in(&dir.join("made"), &format!("{i}-{j}"), &names, kind);
            for (from, to) in [(&made.cert_pem, chain), (&made.key_pem, key)] {
                let to = dir.join(to);
                fs::create_dir_all(to.parent().unwrap()).unwrap();
                fs::copy(from, &to).expect("placing a certificate");
            }
        }
    }
    let out = check_config(&path);
    assert!(out.status.success(), "{}", out.describe());
    assert!(
        out.stdout_text().contains("ok: 3 sites, 4 certificates"),
        "{}",
        out.describe()
    );
    assert!(!out.stderr_text().contains("warning"), "{}", out.describe());
}

#[test]
fn every_error_is_reported_with_its_file_site_and_reason() {
    let dir = scratch("errors");
    let pki = fixtures::pki();
    let good = pki.issue_in(&dir, "good", &["good.test"], CertKind::P256);
    let other = pki.issue_in(&dir, "other", &["other.test"], CertKind::P256);
    let missing_key = pki.issue_in(&dir, "missing", &["missing.test"], CertKind::P256);
    fs::remove_file(&missing_key.key_pem).unwrap();
    let mut mismatched = pki.issue_in(&dir, "mismatched", &["mismatch.test"], CertKind::P256);
    mismatched.key_pem = other.key_pem.clone();
    // The leaf, then a certificate that did not issue it.
    let broken = pki.issue_in(&dir, "broken", &["broken.test"], CertKind::P256);
    let chain = format!(
        "{}{}",
        fs::read_to_string(&broken.cert_pem).unwrap(),
        fs::read_to_string(&other.cert_pem).unwrap()
    );
    fs::write(&broken.cert_pem, chain).unwrap();
    let spec = |names, cert, content| SiteSpec {
        names,
        default: false,
        certs: vec![cert],
        content,
    };
    let config = write_config(
        &dir,
        "",
        &[
            spec(&["good.test"], good, "good"),
            spec(&["missing.test"], missing_key, "missing"),
            spec(&["mismatch.test"], mismatched, "mismatch"),
            spec(&["broken.test"], broken, "broken"),
            spec(&["foo.*.test"], other, "badname"),
        ],
    );
    let out = check_config(&config);
    assert!(!out.status.success(), "{}", out.describe());
    let err = out.stderr_text();
    let file = config.display().to_string();
    for (site, reason) in [
        ("missing.test", "No such file"),
        ("mismatch.test", "does not belong to the certificate"),
        ("broken.test", "broken chain"),
        ("foo.*.test", "is not a server name"),
    ] {
        assert!(
            err.lines().any(|l| l.contains(&file)
                && l.contains(&format!("site \"{site}\""))
                && l.contains(reason)),
            "no error line naming {file}, site {site} and {reason:?}:\n{err}"
        );
    }
    assert!(!err.contains("site \"good.test\""), "{err}");

    // `serve` refuses the same file, with the same reasons, before it listens.
    let mut cmd = Command::new(server_bin());
    cmd.args(["serve", "--listen", "127.0.0.1:0", "--config"])
        .arg(&config);
    let serve = tools::run(cmd, b"", Duration::from_secs(30));
    assert!(!serve.status.success(), "{}", serve.describe());
    assert!(
        serve.stderr_text().contains("broken chain")
            && !serve.stderr_text().contains("listening on https"),
        "{}",
        serve.describe()
    );

    // A name claimed twice, an unknown [server] option, a bad value: each named.
    let a = pki.issue_in(&dir, "a", &["a.test"], CertKind::P256);
    let b = pki.issue_in(&dir, "b", &["a.test"], CertKind::P256);
    let dup = write_config(
        &dir,
        "colour = \"blue\"",
        &[spec(&["a.test"], a, "a"), spec(&["A.test"], b, "b")],
    );
    let err = check_config(&dup).stderr_text();
    assert!(
        err.contains(r#"a.test is claimed by two sites ("a.test" and "A.test")"#),
        "{err}"
    );
    assert!(err.contains("[server] colour: no such option"), "{err}");
    let text = fs::read_to_string(&dup).unwrap();
    fs::write(
        &dup,
        text.replace("colour = \"blue\"", "workers = \"many\""),
    )
    .unwrap();
    let err = check_config(&dup).stderr_text();
    assert!(
        err.contains(&format!(
            "{}: [server]: invalid value 'many' for '--workers",
            dup.display()
        )),
        "{err}"
    );
}

#[test]
fn certificates_near_expiry_or_not_covering_a_name_are_warned_about() {
    if !tools::require("openssl") {
        return;
    }
    let dir = scratch("warnings");
    let (cert, key) = (dir.join("soon.pem"), dir.join("soon.key"));
    let mut cmd = Command::new("openssl");
    cmd.args([
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
        "-days",
        "3",
        "-subj",
        "/CN=soon.test",
        "-addext",
        "subjectAltName=DNS:soon.test",
        "-keyout",
    ])
    .arg(&key)
    .arg("-out")
    .arg(&cert);
    assert!(tools::run(cmd, b"", Duration::from_secs(30))
        .status
        .success());
    let config = write_config(
        &dir,
        "",
        &[SiteSpec {
            names: &["soon.test", "*.elsewhere.test"],
            default: true,
            certs: vec![fixtures::CertFiles {
                cert_pem: cert.clone(),
                key_pem: key,
            }],
            content: "soon",
        }],
    );
    let out = check_config(&config);
    assert!(
        out.status.success(),
        "warnings are not errors: {}",
        out.describe()
    );
    let err = out.stderr_text();
    assert!(
        err.lines().any(|l| l.starts_with("warning:")
            && l.contains("expires on")
            && l.contains("in 3 days")),
        "{err}"
    );
    assert!(
        err.contains("does not cover the configured name *.elsewhere.test"),
        "{err}"
    );
    assert!(!err.contains("configured name soon.test"), "{err}");
}

/// A self-signed certificate for `name` valid from `from` to `until` (years), and its key.
fn dated_certificate(dir: &Path, name: &str, from: i32, until: i32) -> fixtures::CertFiles {
    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).expect("key");
    let mut params = rcgen::CertificateParams::new(vec![name.to_string()]).expect("params");
    params.not_before = rcgen::date_time_ymd(from, 1, 1);
    params.not_after = rcgen::date_time_ymd(until, 1, 1);
    let cert = params.self_signed(&key).expect("certificate");
    let files = fixtures::CertFiles {
        cert_pem: dir.join(format!("{name}.pem")),
        key_pem: dir.join(format!("{name}.key")),
    };
    std::fs::write(&files.cert_pem, cert.pem()).unwrap();
    std::fs::write(&files.key_pem, key.serialize_pem()).unwrap();
    files
}

#[test]
fn a_certificate_outside_its_dates_is_refused_unless_allowed() {
    for (what, from, until, says) in [
        ("expired", 2000, 2001, "the certificate expired on"),
        (
            "not-yet-valid",
            2090,
            2091,
            "the certificate is not valid before",
        ),
    ] {
        let dir = scratch(&format!("dates-{what}"));
        let files = dated_certificate(&dir, &format!("{what}.test"), from, until);
        let config = write_config(
            &dir,
            "",
            &[SiteSpec {
                names: &[],
                default: true,
                certs: vec![files],
                content: what,
            }],
        );
        let out = check_config(&config);
        assert!(!out.status.success(), "{what}: {}", out.describe());
        let err = out.stderr_text();
        assert!(
            err.contains(says) && err.contains("allow-invalid-dates = true"),
            "{what}: {err}"
        );
        // Allowed explicitly: a warning only.
        let text = std::fs::read_to_string(&config).unwrap();
        std::fs::write(
            &config,
            text.replace("key = ", "allow-invalid-dates = true\nkey = "),
        )
        .unwrap();
        let out = check_config(&config);
        assert!(out.status.success(), "{what}: {}", out.describe());
        assert!(
            out.stderr_text()
                .lines()
                .any(|l| l.starts_with("warning:") && l.contains(says)),
            "{what}: {}",
            out.describe()
        );
    }
}

#[test]
fn backend_protocol_is_a_proxy_http_mode_key() {
    let dir = scratch("backend-protocol");
    let pki = fixtures::pki();
    let cert = pki.issue_in(&dir, "p", &["p.test"], CertKind::P256);
    // A `serve` site with it: refused, naming the site and what the key is for.
    let config = write_config(
        &dir,
        "",
        &[SiteSpec {
            names: &["p.test"],
            default: false,
            certs: vec![pki.issue_in(&dir, "s", &["p.test"], CertKind::P256)],
            content: "p",
        }],
    );
    let text = fs::read_to_string(&config).unwrap();
    fs::write(
        &config,
        text.replace(
            "default = false\n",
            "default = false\nbackend-protocol = \"h2c\"\n",
        ),
    )
    .unwrap();
    let out = check_config(&config);
    assert!(!out.status.success(), "{}", out.describe());
    assert!(
        out.stderr_text()
            .contains("site \"p.test\": `backend-protocol` is for `tlsplane proxy --mode http`"),
        "{}",
        out.describe()
    );

    let proxy = |server: &str, protocol: &str| {
        let path = dir.join("proxy.toml");
        fs::write(
            &path,
            format!(
                "[server]\n{server}\n[[site]]\nserver-names = [\"p.test\"]\nto = [\"127.0.0.1:9\"]\n\
                 backend-protocol = \"{protocol}\"\n[[site.cert]]\nchain = {:?}\nkey = {:?}\n",
                cert.cert_pem, cert.key_pem
            ),
        )
        .unwrap();
        check_config(&path)
    };
    // A proxy in HTTP mode takes it.
    let out = proxy("mode = \"http\"", "h2c");
    assert!(out.status.success(), "{}", out.describe());
    assert!(
        out.stdout_text().contains("ok: 1 sites"),
        "{}",
        out.describe()
    );
    // TCP mode forwards bytes unchanged: it has no backend protocol.
    let out = proxy("", "h2c");
    assert!(!out.status.success(), "{}", out.describe());
    assert!(
        out.stderr_text()
            .contains("site \"p.test\": `backend-protocol` is for `--mode http`"),
        "{}",
        out.describe()
    );
    // A value that is not a protocol is named with the ones that are.
    let out = proxy("mode = \"http\"", "h3");
    assert!(!out.status.success(), "{}", out.describe());
    assert!(
        out.stderr_text()
            .contains("unknown variant `h3`, expected `http1` or `h2c`"),
        "{}",
        out.describe()
    );
}
