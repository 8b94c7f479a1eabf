//! serve never hands out the server's own secrets: a configuration that puts a private key,
//! the ticket keys, the key-encryption key, the key daemon's socket or the generated key's
//! state directory under a served root is refused (at start, by a reload, by check-config), a
//! symlink or hard link leading to one is answered 404, and dot-files are not served unless
//! asked for (`/.well-known/` always is).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use base64::Engine as _;

use crate::sites::scratch;
use crate::support::client::Tls;
use crate::support::fixtures::{self, CertKind};
use crate::support::{server_bin, tools, Server};

use super::http::{raw_exchange, status_of};

const REFUSED: &str = "lies under the document root";

fn random_line(n: usize) -> String {
    let mut k = vec![0u8; n];
    aws_lc_rs::rand::fill(&mut k).unwrap();
    base64::engine::general_purpose::STANDARD.encode(k) + "\n"
}

/// Replaced by a rename, as a deployment tool would (a new inode).
fn write_by_rename(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    fs::write(&tmp, text).unwrap();
    fs::rename(&tmp, path).unwrap();
}

fn run_serve(args: &[&str], home: Option<&Path>) -> tools::Output {
    let mut cmd = Command::new(server_bin());
    cmd.arg("serve")
        .args(args)
        .args(["--listen", "127.0.0.1:0", "--keyd", "off"]);
    if let Some(h) = home {
        cmd.env("TLSPLANE_HOME", h);
    }
    tools::run(cmd, b"", Duration::from_secs(30))
}

fn check_config(args: &[&str], file: &Path) -> tools::Output {
    let mut cmd = Command::new(server_bin());
    cmd.arg("check-config").args(args).arg(file);
    tools::run(cmd, b"", Duration::from_secs(30))
}

fn get(port: u16, path: &str) -> (u16, Vec<u8>) {
    let req = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    let (raw, _) = raw_exchange(port, Tls::V13, req.as_bytes());
    (status_of(&raw), raw)
}

fn reload(pid_file: &Path) -> tools::Output {
    let mut cmd = Command::new(server_bin());
    cmd.args(["reload", "--pid-file"]).arg(pid_file);
    tools::run(cmd, b"", Duration::from_secs(40))
}

/// Each secret under the served directory is refused before anything starts, with the
/// option that names it; nothing is generated into it; the same files outside are fine.
#[test]
fn serve_refuses_to_start_with_a_secret_under_its_root() {
    let dir = scratch("secrets-refused");
    let www = dir.join("www");
    fs::create_dir_all(&www).unwrap();
    let leaf = fixtures::pki().leaf(CertKind::P256);
    let key_inside = www.join("server.key");
    fs::copy(&leaf.key_pem, &key_inside).unwrap();
    fs::write(www.join("ticket.keys"), random_line(80)).unwrap();
    fs::write(www.join("ticket.kek"), random_line(32)).unwrap();
    fs::write(www.join("redis.pw"), "a password\n").unwrap();
    fs::copy(&leaf.key_pem, www.join("store-client.key")).unwrap();
    let kek_outside = dir.join("ticket.kek");
    fs::write(&kek_outside, random_line(32)).unwrap();
    let kek_outside = kek_outside.to_str().unwrap().to_string();
    let (w, cert, key) = (
        www.to_str().unwrap(),
        leaf.cert_pem.to_str().unwrap(),
        leaf.key_pem.to_str().unwrap(),
    );
    let in_www = |name: &str| www.join(name).to_str().unwrap().to_string();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (vec!["--key".into(), in_www("server.key")], "--key"),
        (
            vec![
                "--key".into(),
                key.into(),
                "--ticket-keys".into(),
                in_www("ticket.keys"),
            ],
            "--ticket-keys",
        ),
        (
            vec![
                "--key".into(),
                key.into(),
                "--ticket-store".into(),
                "redis://127.0.0.1:1".into(),
                "--ticket-store-kek".into(),
                in_www("ticket.kek"),
            ],
            "--ticket-store-kek",
        ),
        (
            vec![
                "--key".into(),
                key.into(),
                "--keyd".into(),
                format!("unix:{}", in_www("keyd.sock")),
            ],
            "the key daemon's socket",
        ),
        (
            vec![
                "--key".into(),
                key.into(),
                "--ticket-store".into(),
                "redis://fleet@127.0.0.1:1".into(),
                "--ticket-store-kek".into(),
                kek_outside.clone(),
                "--ticket-store-password-file".into(),
                in_www("redis.pw"),
            ],
            "--ticket-store-password-file",
        ),
        (
            vec![
                "--key".into(),
                key.into(),
                "--ticket-store".into(),
                "rediss://127.0.0.1:1".into(),
                "--ticket-store-kek".into(),
                kek_outside.clone(),
                "--ticket-store-tls-cert".into(),
                cert.into(),
                "--ticket-store-tls-key".into(),
                in_www("store-client.key"),
            ],
            "--ticket-store-tls-key",
        ),
        (
            vec![
                "--key".into(),
                key.into(),
                "--access-log-file".into(),
                in_www("access.log"),
            ],
            "--access-log-file",
        ),
    ];
    for (extra, what) in &cases {
        let mut args = vec![w, "--cert", cert];
        args.extend(extra.iter().map(String::as_str));
        let mut cmd = Command::new(server_bin());
        cmd.arg("serve")
            .args(["--listen", "127.0.0.1:0"])
            .args(&args);
        if !extra.iter().any(|a| a == "--keyd") {
            cmd.args(["--keyd", "off"]);
        }
        let out = tools::run(cmd, b"", Duration::from_secs(30));
        let err = out.stderr_text();
        assert!(
            !out.status.success(),
            "{what}: started:\n{}",
            out.describe()
        );
        assert!(
            err.contains(what) && err.contains(REFUSED),
            "{what}: not refused for the secret:\n{}",
            out.describe()
        );
    }
    // The generated certificate's state directory under the root: refused before generating.
    let state = www.join("state");
    let out = run_serve(&[w], Some(&state));
    assert!(!out.status.success(), "{}", out.describe());
    assert!(
        out.stderr_text().contains("TLSPLANE_HOME") && out.stderr_text().contains(REFUSED),
        "{}",
        out.describe()
    );
    assert!(
        !state.join("localhost-key.pem").exists(),
        "a key was generated into the root"
    );

    // A site root holding its own key: serve --config and check-config refuse it alike.
    let config = dir.join("tlsplane.toml");
    fs::write(
        &config,
        format!(
            "[[site]]\nserver-names = [\"localhost\"]\ndefault = true\nroot = \"www\"\n\
             [[site.cert]]\nchain = {:?}\nkey = \"www/server.key\"\n",
            leaf.cert_pem
        ),
    )
    .unwrap();
    let out = run_serve(&["--config", config.to_str().unwrap()], None);
    let line = out
        .stderr_text()
        .lines()
        .find(|l| l.contains(REFUSED))
        .map(|l| l[l.find("the private key").unwrap_or(0)..].to_string())
        .unwrap_or_else(|| panic!("serve --config did not refuse:\n{}", out.describe()));
    let checked = check_config(&[], &config);
    assert!(!checked.status.success(), "{}", checked.describe());
    assert!(
        checked.stderr_text().contains(&line),
        "check-config: {}\nwant {line}",
        checked.describe()
    );
}

/// A running server: dot-files 404 (but /.well-known/), its ticket keys 404 through a symlink
/// and a hard link, before and after a reload that replaced the keys file; a reload putting a
/// secret under a root fails and changes nothing; a site's `serve-dotfiles` serves them.
#[test]
fn dotfiles_and_secrets_are_not_served() {
    let dir = scratch("secrets-withheld");
    let www = dir.join("www");
    for d in [".git", ".well-known/acme-challenge", "sub/.hidden"] {
        fs::create_dir_all(www.join(d)).unwrap();
    }
    for (f, text) in [
        (".git/config", "[core]\n"),
        (".env", "PASSWORD=x\n"),
        (".well-known/acme-challenge/token", "challenge\n"),
        ("sub/.hidden/x", "x\n"),
        ("index.html", "index\n"),
    ] {
        fs::write(www.join(f), text).unwrap();
    }
    let keys = dir.join("ticket.keys");
    write_by_rename(&keys, &random_line(80));
    std::os::unix::fs::symlink(&keys, www.join("keys-link")).unwrap();
    fs::hard_link(&keys, www.join("keys-hard")).unwrap();
    let leaf = fixtures::pki().leaf(CertKind::P256);
    let site = |extra: &str, root: &str| {
        format!(
            "[server]\nticket-keys = {keys:?}\nallow-symlinks-outside = true\n\
             [[site]]\nserver-names = [\"localhost\"]\ndefault = true\nroot = {root:?}\n{extra}\n\
             [[site.cert]]\nchain = {:?}\nkey = {:?}\n",
            leaf.cert_pem, leaf.key_pem
        )
    };
    let config = dir.join("tlsplane.toml");
    fs::write(&config, site("", "www")).unwrap();
    let pid_file = dir.join("tlsplane.pid");
    let server = Server::builder()
        .config_file(&config)
        .arg("--pid-file")
        .arg(pid_file.to_str().unwrap())
        .start();
    let port = server.port();
    let hidden = [
        "/.git/config",
        "/.env",
        "/%2eenv",
        "/sub/.hidden/x",
        "/.git/",
        "/.git",
    ];
    for p in hidden {
        assert_eq!(get(port, p).0, 404, "{p}");
    }
    assert_eq!(get(port, "/.well-known/acme-challenge/token").0, 200);
    for p in ["/keys-link", "/keys-hard"] {
        let (status, raw) = get(port, p);
        assert_eq!(status, 404, "{p}: {}", String::from_utf8_lossy(&raw));
    }

    // The keys replaced (a new file), the link follows the name: withheld after the reload too.
    write_by_rename(&keys, &random_line(80));
    let out = reload(&pid_file);
    assert!(out.status.success(), "{}", out.describe());
    assert_eq!(get(port, "/keys-link").0, 404, "after the reload");

    // A reload that would serve the directory holding the keys fails; the old root stays.
    fs::write(&config, site("", ".")).unwrap();
    let out = reload(&pid_file);
    assert!(!out.status.success(), "{}", out.describe());
    assert!(
        server
            .stderr_lines()
            .iter()
            .any(|l| l.contains("--ticket-keys") && l.contains(REFUSED)),
        "the reload's refusal is not logged"
    );
    assert_eq!(get(port, "/index.html").0, 200);

    // The site's own option.
    fs::write(&config, site("serve-dotfiles = true", "www")).unwrap();
    let out = reload(&pid_file);
    assert!(out.status.success(), "{}", out.describe());
    let (status, raw) = get(port, "/.env");
    assert_eq!(status, 200);
    assert!(raw.ends_with(b"PASSWORD=x\n"));
    assert_eq!(
        get(port, "/keys-link").0,
        404,
        "withheld with dot-files served too"
    );
    let lines = server.stderr_lines();
    assert!(!lines.iter().any(|l| l.contains("panicked")));
    server.stop();
}

/// check-config checks a file for the product that will run it: `--product`, else the file's
/// `product`; its errors are the product's own, and a product refuses a file declared for
/// another.
#[test]
fn check_config_checks_for_the_product() {
    let dir = scratch("check-product");
    let leaf = fixtures::pki().leaf(CertKind::P256);
    let cert = format!(
        "[[site.cert]]\nchain = {:?}\nkey = {:?}\n",
        leaf.cert_pem, leaf.key_pem
    );
    fs::create_dir_all(dir.join("www")).unwrap();
    let write = |name: &str, head: &str, site: &str| -> PathBuf {
        let p = dir.join(name);
        fs::write(
            &p,
            format!(
                "{head}\n[[site]]\nserver-names = [\"localhost\"]\ndefault = true\n{site}\n{cert}"
            ),
        )
        .unwrap();
        p
    };
    let proxy_file = write("proxy.toml", "", "to = [\"127.0.0.1:9\"]");
    let serve_file = write("serve.toml", "", "root = \"www\"");
    // Guessed as before, and saying so.
    let out = check_config(&[], &proxy_file);
    assert!(out.status.success(), "{}", out.describe());
    assert!(
        out.stdout_text()
            .contains("ok: 1 sites, 1 certificates, for `tlsplane proxy --config` (guessed"),
        "{}",
        out.describe()
    );

    // For serve, what serve itself says about it.
    let served = run_serve(&["--config", proxy_file.to_str().unwrap()], None);
    assert!(!served.status.success(), "{}", served.describe());
    let want = "`to` (backends) is for `tlsplane proxy`";
    assert!(served.stderr_text().contains(want), "{}", served.describe());
    let out = check_config(&["--product", "serve"], &proxy_file);
    assert!(!out.status.success(), "{}", out.describe());
    assert!(out.stderr_text().contains(want), "{}", out.describe());

    let out = check_config(&["--product", "proxy"], &serve_file);
    assert!(!out.status.success(), "{}", out.describe());
    assert!(
        out.stderr_text().contains("`root` is for `tlsplane serve`"),
        "{}",
        out.describe()
    );
    let out = check_config(&["--product", "serve"], &serve_file);
    assert!(out.status.success(), "{}", out.describe());

    // Declared in the file: checked for it, and refused by the others.
    let declared = write("declared.toml", "product = \"proxy\"", "root = \"www\"");
    let out = check_config(&[], &declared);
    assert!(!out.status.success(), "{}", out.describe());
    assert!(
        out.stderr_text().contains("`root` is for `tlsplane serve`"),
        "{}",
        out.describe()
    );
    let out = check_config(&["--product", "serve"], &declared);
    assert!(!out.status.success(), "{}", out.describe());
    assert!(
        out.stderr_text()
            .contains("this file is for `tlsplane proxy`"),
        "{}",
        out.describe()
    );
    let served = run_serve(&["--config", declared.to_str().unwrap()], None);
    assert!(!served.status.success(), "{}", served.describe());
    assert!(
        served
            .stderr_text()
            .contains("this file is for `tlsplane proxy`"),
        "{}",
        served.describe()
    );
}
