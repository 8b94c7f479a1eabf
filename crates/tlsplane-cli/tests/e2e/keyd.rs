//! The key daemon: private keys live in it and not in the serving process (proved by reading
//! both processes' memory), and when it dies handshakes fail fast, it is restarted, service
//! resumes and nothing established is lost.

use std::fs;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::support::client::{ClientOpts, Tls, TlsClient};
use crate::support::fixtures::{self, CertKind};
use crate::support::{server_bin, tools, Server};

/// A DER element: (tag, content) and the rest.
fn der(b: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = b.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (first as usize, rest)
    } else {
        let n = (first & 0x7f) as usize;
        let len = rest
            .get(..n)?
            .iter()
            .fold(0usize, |l, &x| (l << 8) | x as usize);
        (len, &rest[n..])
    };
    Some((tag, rest.get(..len)?, &rest[len..]))
}

/// The elements of a DER SEQUENCE's content.
fn elements(mut b: &[u8]) -> Vec<(u8, &[u8])> {
    let mut out = Vec::new();
    while let Some((t, c, rest)) = der(b) {
        out.push((t, c));
        b = rest;
    }
    out
}

/// The secret numbers of a PKCS#8 key file: the ECDSA scalar, the Ed25519 seed, or RSA's d, p
/// and q (big-endian, without leading zeros).
fn secrets(key_pem: &Path) -> Vec<Vec<u8>> {
    use rustls_pki_types::pem::PemObject;
    let key = rustls_pki_types::PrivateKeyDer::from_pem_file(key_pem).expect("key file");
    let (_, pkcs8, _) = der(key.secret_der()).expect("PKCS#8");
    let parts = elements(pkcs8);
    let inner = parts[2].1; // privateKey OCTET STRING
    let strip = |x: &[u8]| {
        x.iter()
            .skip_while(|&&b| b == 0)
            .copied()
            .collect::<Vec<u8>>()
    };
    match der(inner).expect("inner key") {
        // Ed25519: an OCTET STRING holding the seed.
        (0x04, seed, _) => vec![seed.to_vec()],
        (0x30, seq, _) => {
            let e = elements(seq);
            if e.len() >= 9 {
                // RSAPrivateKey: version, n, e, d, p, q, ...
                vec![strip(e[3].1), strip(e[4].1), strip(e[5].1)]
            } else {
                // ECPrivateKey: version, privateKey, ...
                vec![e[1].1.to_vec()]
            }
        }
        other => panic!("unexpected key structure {other:?}"),
    }
}

/// Which of `needles` (in either byte order: DER is big-endian, a bignum in memory
/// little-endian) occur in the readable memory of process `pid`.
fn found_in_memory(pid: u32, needles: &[Vec<u8>]) -> Vec<bool> {
    let maps = fs::read_to_string(format!("/proc/{pid}/maps")).expect("maps");
    let mut mem = fs::File::open(format!("/proc/{pid}/mem")).expect("/proc/PID/mem (needs root)");
    let forms: Vec<[Vec<u8>; 2]> = needles
        .iter()
        .map(|n| [n.clone(), n.iter().rev().copied().collect()])
        .collect();
    let mut found = vec![false; needles.len()];
    for line in maps.lines() {
        let mut f = line.split_whitespace();
        let (Some(range), Some(perms)) = (f.next(), f.next()) else {
            continue;
        };
        if !perms.starts_with('r') || line.contains("[vvar") || line.contains("[vsyscall]") {
            continue;
        }
        let (a, b) = range.split_once('-').unwrap();
        let (a, b) = (
            u64::from_str_radix(a, 16).unwrap(),
            u64::from_str_radix(b, 16).unwrap(),
        );
        let mut buf = vec![0u8; (b - a) as usize];
        if mem.seek(SeekFrom::Start(a)).is_err() || mem.read_exact(&mut buf).is_err() {
            continue;
        }
        for (i, [be, le]) in forms.iter().enumerate() {
            if !found[i] && buf.windows(be.len()).any(|w| w == &be[..] || w == &le[..]) {
                found[i] = true;
            }
        }
    }
    found
}

fn parent_of(pid: u32) -> Option<u32> {
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()?
        .rsplit_once(')')
        .and_then(|(_, r)| r.split_whitespace().nth(1))
        .and_then(|p| p.parse().ok())
}

/// When process `pid` started (clock ticks since boot), if it is alive.
fn start_time(pid: u32) -> Option<u64> {
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()?
        .rsplit_once(')')
        .and_then(|(_, r)| r.split_whitespace().nth(19))
        .and_then(|t| t.parse().ok())
}

/// The key daemons `serve` started: its children whose command line says `keyd`, or with
/// `--user` its launcher's; oldest first.
fn keyd_pids(server_pid: u32) -> Vec<u32> {
    let mut found: Vec<(u64, u32)> = Vec::new();
    for e in fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Some(ppid) = parent_of(pid) else {
            continue;
        };
        let cmdline = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let ours = ppid == server_pid || parent_of(ppid) == Some(server_pid);
        if ours && cmdline.split(|&b| b == 0).any(|a| a == b"keyd") {
            found.push((start_time(pid).unwrap_or(u64::MAX), pid));
        }
    }
    found.sort();
    found.into_iter().map(|(_, pid)| pid).collect()
}

/// The key daemon in use: the oldest (its spare is always started after it, from it).
fn keyd_pid(server_pid: u32) -> u32 {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(&pid) = keyd_pids(server_pid).first() {
            return pid;
        }
        assert!(
            Instant::now() < deadline,
            "no key daemon under pid {server_pid}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until every thread of `pid` is stopped (state T), at most 5 s.
fn wait_stopped(pid: u32) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let states: Vec<String> = fs::read_dir(format!("/proc/{pid}/task"))
            .expect("the daemon's threads")
            .flatten()
            .map(|t| {
                let stat = fs::read_to_string(t.path().join("stat")).unwrap_or_default();
                // The state follows the command name's closing parenthesis.
                stat.rsplit_once(") ")
                    .map(|(_, rest)| rest[..1].to_string())
                    .unwrap_or_default()
            })
            .collect();
        if states.iter().all(|s| s == "T") {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "pid {pid} not stopped 5 s after SIGSTOP: {states:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn some_handshakes(port: u16) {
    for v in [Tls::V13, Tls::V12] {
        let mut c = TlsClient::connect_version(port, v);
        assert_eq!(c.get(&fixtures::get().hello.url).status, 200);
        c.close();
    }
}

#[test]
fn private_keys_are_in_keyd_and_never_in_the_serving_process() {
    if process_uid() != 0 {
        eprintln!("SKIPPED: reading another process's memory needs root");
        return;
    }
    for kind in [CertKind::P256, CertKind::Ed25519, CertKind::Rsa2048] {
        let secret = secrets(&fixtures::pki().leaf(kind).key_pem);
        let server = Server::builder().cert(kind).start();
        some_handshakes(server.port());
        let in_server = found_in_memory(server.pid(), &secret);
        let in_keyd = found_in_memory(keyd_pid(server.pid()), &secret);
        assert!(
            in_server.iter().all(|f| !f),
            "{kind:?}: private key material in the serving process: {in_server:?}"
        );
        assert!(
            in_keyd.iter().all(|f| *f),
            "{kind:?}: the scan must find the key in keyd (else it proves nothing): {in_keyd:?}"
        );
        server.stop();
    }
    // And the same scan does find a key that `--keyd off` read into the server.
    let secret = secrets(&fixtures::pki().leaf(CertKind::P256).key_pem);
    let server = Server::builder().arg("--keyd").arg("off").start();
    some_handshakes(server.port());
    assert!(found_in_memory(server.pid(), &secret).iter().all(|f| *f));
    server.stop();
}

fn process_uid() -> u32 {
    fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(u32::MAX)
}

/// How a handshake attempt ended, and how long it took.
pub(crate) fn try_handshake(port: u16) -> (Result<(), String>, Duration) {
    let t = Instant::now();
    let mut c = TlsClient::new(port, ClientOpts::version(Tls::V13).config());
    let r = c.handshake().map_err(|e| format!("{e:?}"));
    (r, t.elapsed())
}

/// The connection established before the daemon's trouble still works, and new ones are made.
fn still_served(mut kept: TlsClient, port: u16) {
    assert_eq!(
        kept.get(&fixtures::get().hello.url).status,
        200,
        "the established connection was lost"
    );
    kept.close();
    some_handshakes(port);
}

/// Tries handshakes until one succeeds, at most `limit` after `what` happened (now).
fn service_back_within(port: u16, limit: Duration, what: &str) {
    let since = Instant::now();
    loop {
        let (r, _) = try_handshake(port);
        if r.is_ok() {
            eprintln!("service back {:?} after {what}", since.elapsed());
            return;
        }
        assert!(
            since.elapsed() < limit,
            "no successful handshake {limit:?} after {what}: {r:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Signatures are counted and timed where they are made: by the daemon (its SIGUSR1 report),
/// never by the server when keyd holds the keys (which also shows the server signs nothing
/// itself), and by the server with `--keyd off`; the server times its waits on keyd.
#[test]
fn signatures_are_counted_where_they_are_made() {
    let server = Server::builder().start();
    some_handshakes(server.port());
    let keyd = keyd_pid(server.pid());
    send_signal(keyd, "-USR1");
    let line = wait_line(&server, " signatures in ");
    let made: u64 = line
        .split("keyd: ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no count in {line:?}"));
    assert!(made >= 2, "{line}");
    assert_eq!(
        keyd_pid(server.pid()),
        keyd,
        "SIGUSR1 must not end the daemon"
    );
    let stats = server.stop();
    assert_eq!(stats.get("signatures"), 0, "the server signed: {stats:?}");
    assert_eq!(stats.get("keyd_signatures"), made, "{stats:?}");
    assert!(stats.get("keyd_wait_ns") > 0, "{stats:?}");

    let server = Server::builder().arg("--keyd").arg("off").start();
    some_handshakes(server.port());
    let stats = server.stop();
    assert!(stats.get("signatures") >= 2, "{stats:?}");
    assert!(stats.get("signature_ns") > 0, "{stats:?}");
    assert_eq!(stats.get("keyd_signatures"), 0, "{stats:?}");
}

#[test]
fn a_dead_or_stuck_keyd_fails_handshakes_fast_and_is_replaced_without_losing_connections() {
    // Handshake-only connections close before the kernel could take them.
    let server = Server::builder()
        .expect_user_fallbacks()
        // Not shorter: under emulation a fresh daemon's first signature has taken over 1 s,
        // and a daemon that slow is (rightly) taken for stuck.
        .arg("--keyd-timeout")
        .arg("3")
        .start();
    let port = server.port();
    let hello = &fixtures::get().hello.url;
    let mut kept = TlsClient::connect_version(port, Tls::V13);
    assert_eq!(kept.get(hello).status, 200);
    let keyd = keyd_pid(server.pid());

    // A stuck daemon: the handshake waits at most the three-second timeout, then gets an alert;
    // the server replaces the daemon.
    let signal = |sig: &str, pid: u32| {
        assert!(Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .unwrap()
            .success())
    };
    // If an assertion fails while it is stopped, kill it: a stopped daemon would hold the
    // server's stderr open and hang the harness.
    struct KillOnDrop(u32);
    impl Drop for KillOnDrop {
        fn drop(&mut self) {
            let _ = Command::new("kill")
                .args(["-KILL", &self.0.to_string()])
                .stderr(std::process::Stdio::null())
                .status();
        }
    }
    let _stopped = KillOnDrop(keyd);
    signal("-STOP", keyd);
    // kill(2) returns before the stop: a pending SIGSTOP stops the process only once the
    // thread it was given to runs, and until then its other threads still answer.
    wait_stopped(keyd);
    let (r, took) = try_handshake(port);
    let err = r.expect_err("a handshake succeeded without its key daemon");
    assert!(
        err.contains("InternalError"),
        "expected an internal_error alert: {err}"
    );
    assert!(
        took < Duration::from_millis(4500),
        "the failure took {took:?}"
    );
    service_back_within(port, Duration::from_secs(4), "keyd was found stuck");
    wait_spares(&server, 2);
    let replaced = keyd_pid(server.pid());
    assert_ne!(replaced, keyd, "the stuck daemon was replaced");
    let keyd = replaced;

    // Killed: restarted, and service is back within 2 s.
    signal("-KILL", keyd);
    service_back_within(port, Duration::from_secs(2), "keyd was killed");
    assert_ne!(keyd_pid(server.pid()), keyd, "a new daemon runs");
    still_served(kept, port);
    let lines = server.stderr_lines();
    let count = |what: &str| lines.iter().filter(|l| l.contains(what)).count();
    assert_eq!(count("the key daemon exited"), 1, "{lines:#?}");
    assert_eq!(
        count("the key daemon did not answer a signature within 3 s"),
        1,
        "{lines:#?}"
    );
    // Its spare took over each time, with the keys in force: nothing was read again.
    assert_eq!(count("the spare key daemon took over"), 2, "{lines:#?}");
    assert_eq!(count("reloading the configuration"), 0, "{lines:#?}");
    let stats = server.stop();
    assert_eq!(stats.get("keyd_restarts"), 2, "{stats:?}");
    assert_eq!(stats.get("keyd_stuck"), 1, "{stats:?}");
    assert!(stats.get("keyd_sign_failures") >= 1, "{stats:?}");
    assert_eq!(
        stats.get("handshake_peer_errors"),
        0,
        "our key daemon's failures are not the peers': {stats:?}"
    );
}

#[test]
fn an_external_keyd_serves_the_server_that_holds_its_token() {
    let dir = crate::sites::scratch("external-keyd");
    let leaf = fixtures::pki().leaf(CertKind::P256);
    let socket = dir.join("keyd.sock");
    let _keyd = start_external_keyd(&socket, &leaf.key_pem);
    let token = dir.join("keyd.sock.token");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        fs::metadata(&token).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let server = Server::builder()
        .arg("--keyd")
        .arg(format!("unix:{}", socket.display()))
        .start();
    some_handshakes(server.port());
    server.stop();

    // A wrong token is refused at start-up, with the reason.
    fs::write(&token, "00".repeat(32)).unwrap();
    let mut cmd = Command::new(server_bin());
    cmd.args(["serve", "--listen", "127.0.0.1:0", "--keyd"])
        .arg(format!("unix:{}", socket.display()))
        .arg("--cert")
        .arg(&leaf.cert_pem)
        .arg("--key")
        .arg(&leaf.key_pem);
    let out = tools::run(cmd, b"", Duration::from_secs(20));
    assert!(!out.status.success(), "{}", out.describe());
    assert!(
        out.stderr_text().contains("--keyd unix:"),
        "{}",
        out.describe()
    );
}

/// A daemon started by a test, killed when the test ends, failed or not (one left running
/// would hold the harness's output open).
pub(crate) struct ExternalKeyd(pub(crate) std::process::Child);

impl Drop for ExternalKeyd {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `tlsplane keyd --socket SOCKET --key KEY`, once its socket and token file are there.
fn start_external_keyd(socket: &Path, key: &Path) -> ExternalKeyd {
    let token = socket.with_extension("sock.token");
    let _ = fs::remove_file(&token);
    let keyd = ExternalKeyd(
        Command::new(server_bin())
            .args(["keyd", "--socket"])
            .arg(socket)
            .arg("--key")
            .arg(key)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("tlsplane keyd"),
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while !(socket.exists() && token.exists()) {
        assert!(Instant::now() < deadline, "keyd did not start");
        std::thread::sleep(Duration::from_millis(10));
    }
    keyd
}

#[test]
fn an_external_keyd_restarted_by_hand_is_found_again() {
    let dir = crate::sites::scratch("external-keyd-restart");
    let leaf = fixtures::pki().leaf(CertKind::P256);
    let socket = dir.join("keyd.sock");
    let keyd = start_external_keyd(&socket, &leaf.key_pem);
    // Handshake-only connections close before the kernel could take them.
    let server = Server::builder()
        .expect_user_fallbacks()
        .arg("--keyd")
        .arg(format!("unix:{}", socket.display()))
        .start();
    let port = server.port();
    let hello = &fixtures::get().hello.url;
    let mut kept = TlsClient::connect_version(port, Tls::V13);
    assert_eq!(kept.get(hello).status, 200);
    let token_before = fs::read(socket.with_extension("sock.token")).unwrap();

    // Restarted by hand: a new process, a new token.
    drop(keyd);
    let _keyd = start_external_keyd(&socket, &leaf.key_pem);
    assert_ne!(
        fs::read(socket.with_extension("sock.token")).unwrap(),
        token_before,
        "the new daemon has a new token"
    );
    service_back_within(
        port,
        Duration::from_secs(5),
        "the external keyd was restarted",
    );
    still_served(kept, port);
    let lines = server.stderr_lines();
    let count = |what: &str| lines.iter().filter(|l| l.contains(what)).count();
    assert_eq!(
        count("cannot be reached; connecting again"),
        1,
        "{lines:#?}"
    );
    assert_eq!(count("connected again to the key daemon"), 1, "{lines:#?}");
    let stats = server.stop();
    assert_eq!(stats.get("keyd_reconnects"), 1, "{stats:?}");
}

/// `/proc/PID/status`'s `Uid:` or `Gid:` line: real, effective, saved, filesystem.
fn ids(pid: u32, which: &str) -> String {
    fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix(which))
        .unwrap()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

/// A site whose document root and certificate nobody may read but whose key only root may
/// (0600), and a configuration for it.
fn site_for_another_user(test: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    use std::os::unix::fs::PermissionsExt;
    // Its own directory, searchable by all: the fixtures' may not be.
    let dir = std::env::temp_dir().join(format!("tlsplane-e2e-{test}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(dir.join("www")).unwrap();
    let leaf = fixtures::pki().leaf(CertKind::P256);
    fs::copy(&leaf.cert_pem, dir.join("cert.pem")).unwrap();
    fs::copy(&leaf.key_pem, dir.join("key.pem")).unwrap();
    fs::write(dir.join("www/index.html"), "served as nobody\n").unwrap();
    let mode = |p: &Path, m: u32| fs::set_permissions(p, fs::Permissions::from_mode(m)).unwrap();
    for d in [&dir, &dir.join("www")] {
        mode(d, 0o755);
    }
    mode(&dir.join("cert.pem"), 0o644);
    mode(&dir.join("www/index.html"), 0o644);
    mode(&dir.join("key.pem"), 0o600);
    let config = dir.join("tlsplane.toml");
    fs::write(
        &config,
        "[[site]]\ndefault = true\nroot = \"www\"\n[[site.cert]]\nchain = \"cert.pem\"\nkey = \"key.pem\"\n",
    )
    .unwrap();
    mode(&config, 0o644);
    (dir, config)
}

pub(crate) fn hup(pid: u32) {
    send_signal(pid, "-HUP");
}

pub(crate) fn send_signal(pid: u32, signal: &str) {
    assert!(Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .unwrap()
        .success());
}

/// Waits for a stderr line containing `what`, at most 5 s.
/// Waits until `n` spares have taken their keys over (each logs it once it listens), at most
/// 5 s. The daemon in use must not be killed before: a spare still copying from it dies with
/// it, and with both lost the keys in force are gone (the fallback is the key files).
fn wait_spares(server: &crate::support::Server, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let lines = server.stderr_lines();
        if lines
            .iter()
            .filter(|l| l.contains("keys taken over from"))
            .count()
            >= n
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "fewer than {n} spares took over: {lines:#?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

pub(crate) fn wait_line(server: &crate::support::Server, what: &str) -> String {
    // Generous: a daemon started again under emulation takes seconds to be tried and used.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(l) = server.stderr_lines().into_iter().find(|l| l.contains(what)) {
            return l;
        }
        assert!(
            Instant::now() < deadline,
            "no line with {what:?}: {:#?}",
            server.stderr_lines()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn with_user_the_server_runs_unprivileged_and_keyd_keeps_the_keys() {
    if process_uid() != 0 {
        eprintln!("SKIPPED: switching users needs root");
        return;
    }
    const NOBODY: &str = "65534 65534 65534 65534";
    let (dir, config) = site_for_another_user("user");
    // Handshake-only connections (after the keyd kill) close before the kernel could take
    // them.
    let server = Server::builder()
        .expect_user_fallbacks()
        .config_file(&config)
        .arg("--user")
        .arg("65534:65534")
        .start();
    let port = server.port();
    let mut kept = TlsClient::connect_version(port, Tls::V13);
    assert_eq!(kept.get("/index.html").status, 200);
    assert_eq!(ids(server.pid(), "Uid:"), NOBODY, "the server's user ids");
    assert_eq!(ids(server.pid(), "Gid:"), NOBODY, "the server's group ids");
    let keyd = keyd_pid(server.pid());
    assert_eq!(ids(keyd, "Uid:"), "0 0 0 0", "keyd keeps root");
    let secret = secrets(&dir.join("key.pem"));
    assert!(
        found_in_memory(server.pid(), &secret).iter().all(|f| !f),
        "key material in the server"
    );

    // A reload re-reads the key through keyd, as root.
    hup(server.pid());
    wait_line(&server, "configuration reloaded");
    // The reload's new spare copies the keys in force from the daemon in use: killed before
    // it has them, both would be lost.
    wait_spares(&server, 2);
    // A killed keyd comes back from the launcher, with the key the server cannot read.
    assert!(Command::new("kill")
        .args(["-KILL", &keyd.to_string()])
        .status()
        .unwrap()
        .success());
    let killed = Instant::now();
    loop {
        let (r, _) = try_handshake(port);
        if r.is_ok() {
            break;
        }
        assert!(
            killed.elapsed() < Duration::from_secs(2),
            "no handshake 2 s after keyd was killed: {r:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let again = keyd_pid(server.pid());
    assert_ne!(again, keyd, "a new daemon runs");
    assert_eq!(ids(again, "Uid:"), "0 0 0 0", "the new keyd is root's too");
    assert_eq!(kept.get("/index.html").status, 200, "a connection was lost");
    kept.close();
    let stats = server.stop();
    assert_eq!(stats.get("keyd_restarts"), 1, "{stats:?}");
    assert_eq!(stats.get("reload_failures"), 0, "{stats:?}");

    // The proof that the server cannot open the key: with the key in the server
    // (--keyd off, read before the switch), a reload must read it again, and fails.
    let server = Server::builder()
        .config_file(&config)
        .arg("--user")
        .arg("65534:65534")
        .arg("--keyd")
        .arg("off")
        .start();
    assert_eq!(ids(server.pid(), "Uid:"), NOBODY);
    hup(server.pid());
    let failed = wait_line(&server, "reload failed");
    assert!(
        failed.contains("key.pem") && failed.contains("ermission denied"),
        "the reload should fail on the key file: {failed}"
    );
    let mut c = TlsClient::connect_version(server.port(), Tls::V13);
    assert_eq!(
        c.get("/index.html").status,
        200,
        "the old set stays in force"
    );
    c.close();
    let stats = server.stop();
    assert_eq!(stats.get("reload_failures"), 1, "{stats:?}");
    let _ = fs::remove_dir_all(dir);
}

#[test]
fn with_user_but_not_root_the_server_refuses_to_start() {
    if process_uid() == 0 {
        // As root the switch is allowed; the refusal is for everyone else. Use a user id
        // that root is not, run through `setpriv` when it exists.
        let out = Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(server_bin())
            .args(["serve", "--listen", "127.0.0.1:0", "--user", "0"])
            .output();
        let Ok(out) = out else {
            eprintln!("SKIPPED: no setpriv");
            return;
        };
        let err = String::from_utf8_lossy(&out.stderr);
        if err.contains("setpriv:") {
            // E.g. the binary's directory is not searchable by that user.
            eprintln!("SKIPPED: setpriv could not run the server: {err}");
            return;
        }
        assert!(!out.status.success(), "{err}");
        assert!(err.contains("only root can switch users"), "{err}");
        return;
    }
    let out = Command::new(server_bin())
        .args(["serve", "--listen", "127.0.0.1:0", "--user", "0"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("only root can switch users"), "{err}");
}

/// A server with one site, `localhost`, whose root is `a` (its index.html says "a"), from a
/// configuration file in the test's own directory, which the test then changes on disk; the
/// site's certificate and key files.
fn server_with_own_site(test: &str) -> (Server, std::path::PathBuf, fixtures::CertFiles) {
    use crate::sites::{write_config, SiteSpec};
    let dir = crate::sites::scratch(test);
    let leaf = fixtures::pki().issue_in(&dir, "site", &["localhost", "127.0.0.1"], CertKind::P256);
    let config = write_config(
        &dir,
        "",
        &[SiteSpec {
            names: &["localhost"],
            default: true,
            certs: vec![fixtures::CertFiles {
                cert_pem: leaf.cert_pem.clone(),
                key_pem: leaf.key_pem.clone(),
            }],
            content: "a",
        }],
    );
    // Handshake-only connections close before the kernel could take them.
    let server = Server::builder()
        .expect_user_fallbacks()
        .config_file(&config)
        .start();
    assert_eq!(index(server.port()), "a");
    (server, config, leaf)
}

/// The body of `GET /`.
pub(crate) fn index(port: u16) -> String {
    let mut c = TlsClient::connect_version(port, Tls::V13);
    let r = c.get("/");
    c.close();
    assert_eq!(r.status, 200);
    String::from_utf8_lossy(&r.body).into_owned()
}

/// SIGKILL to the key daemon in use; when.
fn kill_keyd(server: &Server) -> u32 {
    let keyd = keyd_pid(server.pid());
    send_signal(keyd, "-KILL");
    keyd
}

#[test]
fn a_killed_keyd_brings_back_the_configuration_in_force_not_an_edit_not_yet_reloaded() {
    let (server, config, _) = server_with_own_site("keyd-kill-edit");
    let port = server.port();
    // Edited on disk, not reloaded: the site's root is now `b`.
    let dir = config.parent().unwrap();
    fs::create_dir_all(dir.join("b")).unwrap();
    fs::write(dir.join("b/index.html"), "b").unwrap();
    let text = fs::read_to_string(&config).unwrap();
    fs::write(&config, text.replace("root = \"a\"", "root = \"b\"")).unwrap();
    let killed = kill_keyd(&server);
    service_back_within(port, Duration::from_secs(1), "keyd was killed");
    assert_ne!(keyd_pid(server.pid()), killed);
    assert_eq!(index(port), "a", "an edit that was not reloaded went live");
    let lines = server.stderr_lines();
    assert!(
        !lines
            .iter()
            .any(|l| l.contains("reloading the configuration")),
        "{lines:#?}"
    );
    // The edit goes live when asked for.
    hup(server.pid());
    wait_line(&server, "configuration reloaded");
    assert_eq!(index(port), "b");
    let stats = server.stop();
    assert_eq!(stats.get("keyd_restarts"), 1, "{stats:?}");
}

#[test]
fn a_killed_keyd_serves_on_while_the_configuration_on_disk_is_broken() {
    let (server, config, _) = server_with_own_site("keyd-kill-broken-toml");
    let port = server.port();
    // Half-way through an edit.
    fs::write(&config, "[[site]\nroot = ").unwrap();
    let mut kept = TlsClient::connect_version(port, Tls::V13);
    assert_eq!(kept.get("/").status, 200);
    kill_keyd(&server);
    service_back_within(port, Duration::from_secs(1), "keyd was killed");
    assert_eq!(index(port), "a");
    // Killed again while the file is still broken: the new spare has the keys too, though
    // nothing could read them from the files.
    wait_spares(&server, 2);
    kill_keyd(&server);
    service_back_within(port, Duration::from_secs(1), "keyd was killed again");
    assert_eq!(
        kept.get("/").status,
        200,
        "the established connection was lost"
    );
    kept.close();
    let lines = server.stderr_lines();
    let count = |what: &str| lines.iter().filter(|l| l.contains(what)).count();
    assert_eq!(count("the spare key daemon took over"), 2, "{lines:#?}");
    assert_eq!(count("retrying"), 0, "{lines:#?}");
    let stats = server.stop();
    assert_eq!(stats.get("keyd_restarts"), 2, "{stats:?}");
    assert_eq!(stats.get("reload_failures"), 0, "{stats:?}");
}

#[test]
fn a_killed_keyd_signs_with_the_key_in_force_when_the_file_holds_another() {
    let (server, _, leaf) = server_with_own_site("keyd-kill-new-key");
    let port = server.port();
    // A renewal that writes the new key before its certificate: the file's key no longer
    // matches the certificate in force.
    let other = fixtures::pki().leaf(CertKind::P256);
    fs::copy(&other.key_pem, &leaf.key_pem).unwrap();
    kill_keyd(&server);
    // The client checks the signature against the certificate in force: a handshake proves
    // the key in force signed it.
    service_back_within(port, Duration::from_secs(1), "keyd was killed");
    wait_spares(&server, 2);
    kill_keyd(&server);
    service_back_within(port, Duration::from_secs(1), "keyd was killed again");
    // A reload now fails (the key does not match), and the keys in force stay.
    hup(server.pid());
    wait_line(&server, "reload failed");
    assert_eq!(index(port), "a");
    wait_spares(&server, 3);
    kill_keyd(&server);
    service_back_within(port, Duration::from_secs(1), "keyd was killed a third time");
    let stats = server.stop();
    assert_eq!(stats.get("keyd_restarts"), 3, "{stats:?}");
    assert_eq!(stats.get("reload_failures"), 1, "{stats:?}");
}

#[test]
fn with_both_daemons_killed_service_heals_by_itself_once_the_key_file_is_right_again() {
    let (server, _, leaf) = server_with_own_site("keyd-kill-both");
    let port = server.port();
    let good = fs::read(&leaf.key_pem).unwrap();
    fs::copy(&fixtures::pki().leaf(CertKind::P256).key_pem, &leaf.key_pem).unwrap();
    // The daemon in use and its spare at once: the keys in force are gone, and the file
    // holds a key that does not match the certificate.
    let pids = keyd_pids(server.pid());
    assert_eq!(pids.len(), 2, "a daemon and its spare: {pids:?}");
    for pid in pids {
        send_signal(pid, "-KILL");
    }
    std::thread::sleep(Duration::from_millis(1500));
    assert!(try_handshake(port).0.is_err(), "served without the key");
    // Put back (the renewal's certificate never came): no reload by hand.
    fs::write(&leaf.key_pem, good).unwrap();
    service_back_within(port, Duration::from_secs(5), "the key file was put back");
    assert_eq!(index(port), "a");
    let lines = server.stderr_lines();
    let failed = lines.iter().filter(|l| l.contains("reload failed")).count();
    assert!(
        (1..=4).contains(&failed),
        "{failed} failed reloads: {lines:#?}"
    );
    server.stop();
}

// ---- Key daemons on other hosts: `keyd --listen-tls`, `serve --keyd tls://...` ----

/// A CA of its own, a certificate for a key daemon (127.0.0.1) and one for a server (its
/// client certificate towards the daemons, named `server.example`), as PEM files in `dir`.
pub(crate) struct KeydPki {
    pub(crate) ca_pem: std::path::PathBuf,
    pub(crate) daemon: fixtures::CertFiles,
    pub(crate) client: fixtures::CertFiles,
    ca: rcgen::Certificate,
    ca_key: rcgen::KeyPair,
    dir: std::path::PathBuf,
    stem: String,
}

impl KeydPki {
    /// Another certificate of this CA, for client and server use, with these subjectAltNames
    /// (DNS names; IP addresses; `spiffe://...` as URIs).
    pub(crate) fn issue(&self, name: &str, names: &[&str]) -> fixtures::CertFiles {
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.subject_alt_names = names
            .iter()
            .map(|n| match (n.parse(), n.starts_with("spiffe:")) {
                (Ok(ip), _) => rcgen::SanType::IpAddress(ip),
                (_, true) => rcgen::SanType::URI(n.to_string().try_into().unwrap()),
                _ => rcgen::SanType::DnsName(n.to_string().try_into().unwrap()),
            })
            .collect();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        params.extended_key_usages = vec![
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let cert = params.signed_by(&key, &self.ca, &self.ca_key).unwrap();
        let files = fixtures::CertFiles {
            cert_pem: self.dir.join(format!("{}-{name}.crt.pem", self.stem)),
            key_pem: self.dir.join(format!("{}-{name}.key.pem", self.stem)),
        };
        fs::write(&files.cert_pem, cert.pem()).unwrap();
        fs::write(&files.key_pem, key.serialize_pem()).unwrap();
        files
    }
}

pub(crate) fn keyd_pki(dir: &Path, stem: &str) -> KeydPki {
    let ca_key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, format!("{stem} keyd CA"));
    params.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    let ca = params.self_signed(&ca_key).unwrap();
    let ca_pem = dir.join(format!("{stem}-ca.pem"));
    fs::write(&ca_pem, ca.pem()).unwrap();
    let mut pki = KeydPki {
        ca_pem,
        daemon: fixtures::CertFiles {
            cert_pem: Default::default(),
            key_pem: Default::default(),
        },
        client: fixtures::CertFiles {
            cert_pem: Default::default(),
            key_pem: Default::default(),
        },
        ca,
        ca_key,
        dir: dir.to_path_buf(),
        stem: stem.to_string(),
    };
    pki.daemon = pki.issue("daemon", &["127.0.0.1"]);
    pki.client = pki.issue("server", &["server.example"]);
    pki
}

/// `tlsplane keyd --listen-tls 127.0.0.1:PORT` holding `key`, its stderr kept; killed when
/// dropped.
pub(crate) struct TlsKeyd {
    pub(crate) child: std::process::Child,
    pub(crate) port: u16,
    lines: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl TlsKeyd {
    /// On `port` (0: any), once it listens; the client `server.example` may use every key.
    fn start(pki: &KeydPki, key: &Path, port: u16) -> TlsKeyd {
        let mut args = vec!["--key".into(), key.as_os_str().to_owned()];
        args.extend(["--authorize", "server.example=*"].map(Into::into));
        TlsKeyd::start_with(pki, port, &args)
    }

    /// On `port` (0: any), with `args` (the keys, --authorize, ...), once it listens.
    pub(crate) fn start_with(pki: &KeydPki, port: u16, args: &[std::ffi::OsString]) -> TlsKeyd {
        use std::io::BufRead;
        let mut child = Command::new(server_bin())
            .arg("keyd")
            .arg("--listen-tls")
            .arg(format!("127.0.0.1:{port}"))
            .arg("--tls-cert")
            .arg(&pki.daemon.cert_pem)
            .arg("--tls-key")
            .arg(&pki.daemon.key_pem)
            .arg("--client-ca")
            .arg(&pki.ca_pem)
            .args(args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("tlsplane keyd");
        let stderr = std::io::BufReader::new(child.stderr.take().unwrap());
        let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let kept = lines.clone();
        std::thread::spawn(move || {
            for line in stderr.lines().map_while(Result::ok) {
                if let Some(p) = line
                    .split("listening on tls://127.0.0.1:")
                    .nth(1)
                    .and_then(|r| r.split_whitespace().next())
                    .and_then(|p| p.parse::<u16>().ok())
                {
                    let _ = tx.send(p);
                }
                kept.lock().unwrap().push(line);
            }
        });
        let mut keyd = TlsKeyd {
            child,
            port: 0,
            lines,
        };
        keyd.port = rx
            .recv_timeout(Duration::from_secs(10))
            .unwrap_or_else(|_| panic!("keyd did not listen: {:#?}", keyd.lines()));
        keyd
    }

    pub(crate) fn url(&self) -> String {
        format!("tls://127.0.0.1:{}", self.port)
    }

    pub(crate) fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    pub(crate) fn assert_alive(&mut self) {
        assert!(
            self.child.try_wait().unwrap().is_none(),
            "keyd exited: {:#?}",
            self.lines()
        );
    }
}

impl Drop for TlsKeyd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A site `localhost` whose key exists only in the daemons' memory: its file is removed once
/// `daemons` have loaded it, before the server starts. The configuration names the daemons.
fn keyless_site(
    test: &str,
    daemons: usize,
) -> (
    std::path::PathBuf,
    KeydPki,
    Vec<TlsKeyd>,
    fixtures::CertFiles,
) {
    let dir = crate::sites::scratch(test);
    let pki = keyd_pki(&dir, "k");
    let site = fixtures::pki().issue_in(&dir, "site", &["localhost", "127.0.0.1"], CertKind::P256);
    let keyds: Vec<TlsKeyd> = (0..daemons)
        .map(|_| TlsKeyd::start(&pki, &site.key_pem, 0))
        .collect();
    let urls: Vec<String> = keyds.iter().map(TlsKeyd::url).collect();
    let server_lines = format!(
        "keyd = {:?}\nkeyd-tls-cert = {:?}\nkeyd-tls-key = {:?}\nkeyd-ca = {:?}\n",
        urls.join(","),
        pki.client.cert_pem,
        pki.client.key_pem,
        pki.ca_pem
    );
    let config = crate::sites::write_config(
        &dir,
        &server_lines,
        &[crate::sites::SiteSpec {
            names: &["localhost"],
            default: true,
            certs: vec![fixtures::CertFiles {
                cert_pem: site.cert_pem.clone(),
                key_pem: site.key_pem.clone(),
            }],
            content: "a",
        }],
    );
    (config, pki, keyds, site)
}

#[test]
fn a_server_signs_through_a_keyd_over_tls_and_never_reads_the_key_file() {
    let (config, pki, mut keyds, site) = keyless_site("keyd-tls", 1);
    // Nothing but the daemon's memory holds the key from now on.
    let saved = fs::read(&site.key_pem).unwrap();
    fs::remove_file(&site.key_pem).unwrap();
    let server = Server::builder().config_file(&config).start();
    let port = server.port();
    // TLS 1.3 and 1.2, each a full handshake signed by the daemon.
    for v in [Tls::V13, Tls::V12] {
        let mut c = TlsClient::connect_version(port, v);
        let r = c.get("/");
        assert_eq!((r.status, &r.body[..]), (200, &b"a"[..]));
        c.close();
    }
    assert_eq!(index(port), "a");
    // A reload asks the daemon for the key again (KEY); it neither reloads nor commits
    // anything over TLS.
    fs::write(&site.key_pem, &saved).unwrap();
    hup(server.pid());
    wait_line(&server, "configuration reloaded");
    assert_eq!(index(port), "a");
    keyds[0].assert_alive();
    assert!(!keyds[0].lines().iter().any(|l| l.contains("panicked")));
    // Restarted on its port between two handshakes: the server's idle connections to it are
    // dead, and the next handshake still succeeds (its call is made again on a new one).
    let keyd_port = keyds[0].port;
    keyds.clear();
    keyds.push(TlsKeyd::start(&pki, &site.key_pem, keyd_port));
    // With a request: a client that closes right after its handshake may have its FIN reach
    // the server before the handshake ends there, which the kernel plane refuses
    // (docs/LIMITS.md) and the guests' check of every connection's plane would count.
    let mut first = TlsClient::connect_version(port, Tls::V13);
    assert_eq!(
        first.get("/").status,
        200,
        "the first handshake after a restart of the daemon"
    );
    first.close();
    let stats = server.stop();
    assert_eq!(stats.get("keyd_failovers"), 0, "{stats:?}");
    assert_eq!(stats.get("reloads"), 1, "{stats:?}");
    assert_eq!(stats.get("signatures"), 0, "the server signed: {stats:?}");
    assert!(stats.get("keyd_signatures") >= 4, "{stats:?}");
    assert_eq!(stats.get("keyd_sign_failures"), 0, "{stats:?}");
}

/// A raw client of a daemon's TLS port: `client` is the certificate it shows, if any.
pub(crate) fn keyd_tls_client(
    port: u16,
    ca: &Path,
    client: Option<&fixtures::CertFiles>,
) -> rustls::StreamOwned<rustls::ClientConnection, std::net::TcpStream> {
    use rustls_pki_types::pem::PemObject;
    let provider = std::sync::Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls_pki_types::CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    let config = match client {
        Some(c) => builder
            .with_client_auth_cert(
                rustls_pki_types::CertificateDer::pem_file_iter(&c.cert_pem)
                    .unwrap()
                    .map(|c| c.unwrap())
                    .collect(),
                rustls_pki_types::PrivateKeyDer::from_pem_file(&c.key_pem).unwrap(),
            )
            .unwrap(),
        None => builder.with_no_client_auth(),
    };
    let tcp = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let conn =
        rustls::ClientConnection::new(std::sync::Arc::new(config), "127.0.0.1".try_into().unwrap())
            .unwrap();
    rustls::StreamOwned::new(conn, tcp)
}

/// Sends `bytes` and reads the daemon's answer: its frame, or why there was none.
pub(crate) fn keyd_exchange(
    s: &mut rustls::StreamOwned<rustls::ClientConnection, std::net::TcpStream>,
    bytes: &[u8],
) -> Result<Vec<u8>, String> {
    use std::io::Write;
    s.write_all(bytes).map_err(|e| format!("write: {e}"))?;
    s.flush().map_err(|e| format!("flush: {e}"))?;
    let mut len = [0u8; 4];
    s.read_exact(&mut len).map_err(|e| format!("read: {e}"))?;
    let mut reply = vec![0u8; u32::from_be_bytes(len) as usize];
    s.read_exact(&mut reply).map_err(|e| format!("read: {e}"))?;
    Ok(reply)
}

/// PING (op 7), framed.
const PING: [u8; 5] = [0, 0, 0, 1, 7];

#[test]
fn a_keyd_over_tls_serves_only_clients_with_a_certificate_from_its_ca() {
    let dir = crate::sites::scratch("keyd-tls-refusals");
    let pki = keyd_pki(&dir, "k");
    let other = keyd_pki(&dir, "other");
    let site = fixtures::pki().issue_in(&dir, "site", &["localhost"], CertKind::P256);
    let mut keyd = TlsKeyd::start(&pki, &site.key_pem, 0);
    let port = keyd.port;

    // A client of its CA is answered (else the refusals below would prove nothing).
    let mut good = keyd_tls_client(port, &pki.ca_pem, Some(&pki.client));
    assert_eq!(keyd_exchange(&mut good, &PING), Ok(vec![0]));
    // KEY for a path the daemon loaded: a handle and the public key.
    let mut key = vec![2u8];
    key.extend_from_slice(site.key_pem.as_os_str().as_encoded_bytes());
    let mut framed = (key.len() as u32).to_be_bytes().to_vec();
    framed.extend_from_slice(&key);
    let reply = keyd_exchange(&mut good, &framed).unwrap();
    assert_eq!(reply[0], 0, "{reply:?}");

    // No certificate, or one from another CA: refused, nothing answered.
    let mut none = keyd_tls_client(port, &pki.ca_pem, None);
    let e = keyd_exchange(&mut none, &PING).expect_err("served without a certificate");
    assert!(
        e.contains("CertificateRequired") || e.contains("read"),
        "{e}"
    );
    let mut stranger = keyd_tls_client(port, &pki.ca_pem, Some(&other.client));
    let e = keyd_exchange(&mut stranger, &PING).expect_err("served another CA's client");
    assert!(e.contains("UnknownCA") || e.contains("read"), "{e}");
    // Not TLS at all.
    let mut plain = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    plain
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    use std::io::Write;
    plain.write_all(&PING).unwrap();
    let mut sink = Vec::new();
    let _ = plain.read_to_end(&mut sink);
    assert!(!sink.starts_with(&[0, 0, 0, 1, 0]), "{sink:?}");

    // Bad frames from an authenticated client end its connection, not the daemon.
    for bad in [
        &[0u8, 0, 0, 0][..],
        &[0xff, 0xff, 0xff, 0xff],
        &[0, 0, 0x20, 0x01],
    ] {
        let mut c = keyd_tls_client(port, &pki.ca_pem, Some(&pki.client));
        assert_eq!(keyd_exchange(&mut c, &PING), Ok(vec![0]));
        let e = keyd_exchange(&mut c, bad).expect_err("an answer to a bad length");
        assert!(e.contains("read"), "{e}");
    }
    // Requests that are not the protocol's: refused in words, the connection kept.
    for request in [
        &[0u8, 0, 0, 1, 99][..],
        &[0, 0, 0, 2, 3, 1],
        &[0, 0, 0, 1, 6],
    ] {
        let reply = keyd_exchange(&mut good, request).unwrap();
        assert_eq!(reply[0], 1, "{request:?}: {reply:?}");
    }
    assert_eq!(keyd_exchange(&mut good, &PING), Ok(vec![0]));
    keyd.assert_alive();
    let lines = keyd.lines();
    assert!(!lines.iter().any(|l| l.contains("panicked")), "{lines:#?}");
    // Logged (at most a line a second) and each counted: no certificate, another CA's, not
    // TLS.
    assert!(
        lines.iter().any(|l| l.contains("TLS handshake from")),
        "the refusals are logged: {lines:#?}"
    );
    send_signal(keyd.child.id(), "-USR1");
    let deadline = Instant::now() + Duration::from_secs(5);
    while !keyd
        .lines()
        .iter()
        .any(|l| l.contains("tls_handshakes_failed=3 "))
    {
        assert!(Instant::now() < deadline, "{:#?}", keyd.lines());
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn with_two_keyds_over_tls_handshakes_go_on_through_the_other_when_one_dies() {
    let (config, pki, mut keyds, site) = keyless_site("keyd-tls-failover", 2);
    // Kept aside to start a daemon again; the server never sees a key file.
    let saved = fs::read(&site.key_pem).unwrap();
    fs::remove_file(&site.key_pem).unwrap();
    let server = Server::builder()
        .expect_user_fallbacks()
        .config_file(&config)
        .start();
    let port = server.port();

    // Handshakes in a loop, each success and failure with when it happened. Each step waits
    // for handshakes to succeed rather than for a fixed time: under emulation (the kernel-plane
    // guests) a handshake can take a large part of any fixed window.
    type Outcomes = (Vec<Duration>, Vec<(Duration, String)>);
    let outcomes = std::sync::Arc::new(std::sync::Mutex::new(Outcomes::default()));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (stop2, seen, started) = (stop.clone(), outcomes.clone(), Instant::now());
    let looper = std::thread::spawn(move || {
        while !stop2.load(std::sync::atomic::Ordering::Relaxed) {
            let (r, _) = try_handshake(port);
            let mut seen = seen.lock().unwrap();
            match r {
                Ok(()) => seen.0.push(started.elapsed()),
                Err(e) => seen.1.push((started.elapsed(), e)),
            }
            drop(seen);
            std::thread::sleep(Duration::from_millis(5));
        }
    });
    let five_ok_after = |from: Duration, what: &str| {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let seen = outcomes.lock().unwrap();
            if seen.0.iter().filter(|t| **t >= from).count() >= 5 {
                return;
            }
            assert!(Instant::now() < deadline, "{what}: {seen:?}");
            drop(seen);
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    five_ok_after(Duration::ZERO, "no handshakes through A and B");
    // A dies (SIGKILL): the next handshakes go to B.
    let a_port = keyds[0].port;
    let killed_a = started.elapsed();
    drop(keyds.remove(0));
    five_ok_after(
        killed_a + Duration::from_millis(200),
        "no handshakes through B after A died",
    );
    // A is started again on its port, from the key file (put back for it alone).
    let back_a = started.elapsed();
    fs::write(&site.key_pem, &saved).unwrap();
    let a = TlsKeyd::start(&pki, &site.key_pem, a_port);
    fs::remove_file(&site.key_pem).unwrap();
    wait_line(&server, "is back in use");
    // B dies: only A is left, and serves again.
    let killed_b = started.elapsed();
    keyds.clear();
    keyds.push(a);
    five_ok_after(
        killed_b + Duration::from_millis(200),
        "no handshakes through A, back, after B died",
    );
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    looper.join().unwrap();
    let (ok, failed) = std::mem::take(&mut *outcomes.lock().unwrap());
    eprintln!(
        "{} handshakes, {} failed: {failed:?}; A killed at {killed_a:?}, started again at {back_a:?}, B killed at {killed_b:?}",
        ok.len() + failed.len(),
        failed.len()
    );
    assert!(
        failed.len() <= 2,
        "more than the in-flight handshakes failed: {failed:?}"
    );
    keyds[0].assert_alive();
    let lines = server.stderr_lines();
    let count = |what: &str| lines.iter().filter(|l| l.contains(what)).count();
    assert_eq!(count("is back in use"), 1, "{lines:#?}");
    let stats = server.stop();
    assert_eq!(stats.get("keyd_failovers"), 2, "{stats:?}");
    assert_eq!(stats.get("keyd_reconnects"), 1, "{stats:?}");
    assert_eq!(stats.get("signatures"), 0, "{stats:?}");
    assert!(!keyds[0].lines().iter().any(|l| l.contains("panicked")));
}

#[test]
fn with_two_keyds_over_tls_a_stuck_one_fails_one_handshake_then_is_left_until_it_answers() {
    let (config, _pki, keyds, site) = keyless_site("keyd-tls-stuck", 2);
    fs::remove_file(&site.key_pem).unwrap();
    let server = Server::builder()
        .expect_user_fallbacks()
        .arg("--keyd-timeout")
        .arg("1")
        .config_file(&config)
        .start();
    let port = server.port();
    some_keyless_handshakes(port, 4);
    let stuck = keyds[0].child.id();
    send_signal(stuck, "-STOP");
    wait_stopped(stuck);
    // One handshake at a time: the first whose signature goes to the stopped daemon waits the
    // timeout and fails; every later one goes to the other daemon.
    let mut outcomes = Vec::new();
    for _ in 0..20 {
        outcomes.push(try_handshake(port));
    }
    let failed: Vec<_> = outcomes.iter().filter(|(r, _)| r.is_err()).collect();
    assert_eq!(failed.len(), 1, "{outcomes:?}");
    for (r, took) in &failed {
        let e = r.as_ref().unwrap_err();
        assert!(e.contains("InternalError"), "{e}");
        assert!(
            *took >= Duration::from_millis(900) && *took < Duration::from_secs(3),
            "waited {took:?}"
        );
    }
    let slow = outcomes
        .iter()
        .filter(|(_, took)| *took > Duration::from_millis(900))
        .count();
    assert!(
        slow <= 1,
        "the stopped daemon was waited for again: {outcomes:?}"
    );
    send_signal(stuck, "-CONT");
    wait_line(&server, "is back in use");
    some_keyless_handshakes(port, 4);
    let stats = server.stop();
    assert_eq!(stats.get("keyd_failovers"), 1, "{stats:?}");
    assert_eq!(stats.get("keyd_reconnects"), 1, "{stats:?}");
    assert_eq!(
        stats.get("keyd_sign_failures"),
        failed.len() as u64,
        "{stats:?}"
    );
    for k in &keyds {
        assert!(!k.lines().iter().any(|l| l.contains("panicked")));
    }
}

/// `n` TLS 1.3 handshakes with a GET each, all served.
fn some_keyless_handshakes(port: u16, n: usize) {
    for _ in 0..n {
        assert_eq!(index(port), "a");
    }
}
