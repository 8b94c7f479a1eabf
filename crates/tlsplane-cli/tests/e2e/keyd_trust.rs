//! What the key daemon trusts, and what it gives: over TLS, a client certificate signs only
//! with the keys granted to its names, no remote client can make the daemon drop or retire
//! keys, and peers sending slowly cannot keep servers out; on the Unix socket, the socket is
//! made with its mode (no chmod by path), only in a directory others cannot write, and a
//! server sends its token only to a daemon of a user it trusts.

use std::ffi::OsString;
use std::fs;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::keyd::{
    index, keyd_exchange, keyd_pki, keyd_tls_client, send_signal, try_handshake, ExternalKeyd,
    KeydPki, TlsKeyd,
};
use crate::support::client::tcp_connect_from;
use crate::support::fixtures::{self, CertKind};
use crate::support::{server_bin, Server};

/// A request, framed: `[length][op][payload]`.
fn framed(op: u8, payload: &[u8]) -> Vec<u8> {
    let mut out = ((1 + payload.len()) as u32).to_be_bytes().to_vec();
    out.push(op);
    out.extend_from_slice(payload);
    out
}

const KEY: u8 = 2;
const SIGN: u8 = 3;
const RELOAD: u8 = 4;
const COMMIT: u8 = 5;
const PING: u8 = 7;
/// ECDSA P-256 with SHA-256.
const ECDSA_P256_SHA256: [u8; 2] = [0x04, 0x03];

type KeydConn = rustls::StreamOwned<rustls::ClientConnection, TcpStream>;

/// KEY for `path`: the handle and the public key (SubjectPublicKeyInfo), or the refusal.
fn ask_key(c: &mut KeydConn, path: &Path) -> Result<(u32, Vec<u8>), String> {
    let reply = keyd_exchange(c, &framed(KEY, path.as_os_str().as_encoded_bytes()))?;
    match reply.split_first() {
        Some((0, r)) => {
            let n = r[5] as usize;
            Ok((
                u32::from_be_bytes(r[..4].try_into().unwrap()),
                r[6 + 2 * n..].to_vec(),
            ))
        }
        _ => Err(String::from_utf8_lossy(&reply[1..]).into_owned()),
    }
}

/// SIGN `message` with `handle` (ECDSA P-256): the signature, or the refusal.
fn sign(c: &mut KeydConn, handle: u32, message: &[u8]) -> Result<Vec<u8>, String> {
    let mut payload = handle.to_be_bytes().to_vec();
    payload.extend_from_slice(&ECDSA_P256_SHA256);
    payload.extend_from_slice(message);
    let reply = keyd_exchange(c, &framed(SIGN, &payload))?;
    match reply.split_first() {
        Some((0, sig)) => Ok(sig.to_vec()),
        _ => Err(String::from_utf8_lossy(&reply[1..]).into_owned()),
    }
}

/// Whether `sig` over `message` verifies with the P-256 key whose SubjectPublicKeyInfo is
/// `spki` (its last 65 bytes are the uncompressed point).
fn verifies(spki: &[u8], message: &[u8], sig: &[u8]) -> bool {
    use aws_lc_rs::signature::{UnparsedPublicKey, ECDSA_P256_SHA256_ASN1};
    UnparsedPublicKey::new(&ECDSA_P256_SHA256_ASN1, &spki[spki.len() - 65..])
        .verify(message, sig)
        .is_ok()
}

/// The refusal of a request that must be refused.
fn refusal(r: Result<Vec<u8>, String>) -> String {
    match r {
        Ok(reply) if reply.first() == Some(&1) => String::from_utf8_lossy(&reply[1..]).into(),
        other => panic!("not a refusal: {other:?}"),
    }
}

/// Waits until `keyd` has logged a line containing `what` `n` times, at most 5 s; the last.
fn wait_keyd_line(keyd: &TlsKeyd, what: &str, n: usize) -> String {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let lines = keyd.lines();
        let found: Vec<&String> = lines.iter().filter(|l| l.contains(what)).collect();
        if found.len() >= n {
            return found[n - 1].clone();
        }
        assert!(Instant::now() < deadline, "no {what:?} in {lines:#?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The value of `name=` in a report line.
fn field(line: &str, name: &str) -> u64 {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{name}=")))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name}= in {line:?}"))
}

/// SIGUSR1's report: the line of refusals, and `client`'s line.
fn report(keyd: &TlsKeyd, n: usize, clients: &[&str]) -> (String, Vec<String>) {
    send_signal(keyd.child.id(), "-USR1");
    let refused = wait_keyd_line(keyd, "keyd: refused:", n);
    let lines = clients
        .iter()
        .map(|c| wait_keyd_line(keyd, &format!("client {c:?}:"), n))
        .collect();
    (refused, lines)
}

#[test]
fn a_client_certificate_signs_only_with_its_own_keys_and_no_remote_client_drops_keys() {
    let dir = crate::sites::scratch("keyd-trust-grants");
    let pki = keyd_pki(&dir, "k");
    let a_client = pki.issue("a", &["a-servers.example"]);
    let b_client = pki.issue("b", &["spiffe://fleet/b"]);
    let site_a = fixtures::pki().issue_in(&dir, "site-a", &["a.example"], CertKind::P256);
    let site_b = fixtures::pki().issue_in(&dir, "site-b", &["b.example"], CertKind::P256);
    let (key_a, key_b) = (&site_a.key_pem, &site_b.key_pem);
    // The daemon loads the keys its configuration's sites name; A's servers are granted
    // site A's keys by its name, B's servers B's key by its file.
    let site = |names, cert: &fixtures::CertFiles| crate::sites::SiteSpec {
        names,
        default: false,
        certs: vec![fixtures::CertFiles {
            cert_pem: cert.cert_pem.clone(),
            key_pem: cert.key_pem.clone(),
        }],
        content: "x",
    };
    let config = crate::sites::write_config(
        &dir,
        "",
        &[site(&["a.example"], &site_a), site(&["b.example"], &site_b)],
    );
    let arg = |s: &str| OsString::from(s);
    let keyd = TlsKeyd::start_with(
        &pki,
        0,
        &[
            arg("--config"),
            config.into(),
            arg("--authorize"),
            arg("a-servers.example=site:a.example"),
            arg("--authorize"),
            arg(&format!("spiffe://fleet/b={}", key_b.display())),
            arg("--client-sign-rate"),
            arg("10"),
        ],
    );
    let port = keyd.port;
    let mut a = keyd_tls_client(port, &pki.ca_pem, Some(&a_client));
    let mut b = keyd_tls_client(port, &pki.ca_pem, Some(&b_client));
    // Not named by any rule: its certificate is the CA's, but it is told it may use no key,
    // and closed, right after its handshake.
    let mut stranger = keyd_tls_client(port, &pki.ca_pem, Some(&pki.client));
    let why = refusal(keyd_exchange(&mut stranger, &framed(PING, b"")));
    assert!(
        why.contains("client server.example may use no key"),
        "{why}"
    );
    keyd_exchange(&mut stranger, &framed(PING, b"")).expect_err("a client with no grant kept");

    // Each client's own key: a handle, and signatures that verify.
    let (handle_a, spki_a) = ask_key(&mut a, key_a).expect("A's key for A");
    let (handle_b, spki_b) = ask_key(&mut b, key_b).expect("B's key for B (its URI)");
    let sig = sign(&mut a, handle_a, b"by a").expect("A signs with A's key");
    assert!(verifies(&spki_a, b"by a", &sig));
    let sig = sign(&mut b, handle_b, b"by b").expect("B signs with B's key");
    assert!(verifies(&spki_b, b"by b", &sig));

    // Another site's key, by path or by handle: refused. By handle, as if there were none:
    // walking the handles tells a client no other site's key file.
    let e = ask_key(&mut a, key_b).expect_err("A got B's key");
    assert!(e.contains("may not use"), "{e}");
    let never_made = sign(&mut a, 1_000_000, b"by a").expect_err("a handle never made");
    for (c, handle, other_key) in [(&mut a, handle_b, key_b), (&mut b, handle_a, key_a)] {
        let e = sign(c, handle, b"by another").expect_err("signed with another site's key");
        assert_eq!(
            e,
            never_made.replace("1000000", &handle.to_string()),
            "{} in it?",
            other_key.display()
        );
    }

    // No remote client reloads or commits: no generation it names, however large, makes the
    // daemon drop (or stop retiring) keys.
    for request in [
        framed(RELOAD, b""),
        framed(COMMIT, &u32::MAX.to_be_bytes()),
        framed(COMMIT, &1u32.to_be_bytes()),
    ] {
        let why = refusal(keyd_exchange(&mut a, &request));
        assert!(why.contains("not served over TLS"), "{why}");
    }
    assert!(
        sign(&mut a, handle_a, b"still").is_ok(),
        "A's key was dropped"
    );

    // The key host rotates B's key and reloads (SIGHUP): the new key under a new handle, the
    // old one kept for servers that have not reloaded yet, retired at the next reload.
    let new_b = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
    fs::write(key_b, new_b.serialize_pem()).unwrap();
    send_signal(keyd.child.id(), "-HUP");
    wait_keyd_line(&keyd, "reloaded (SIGHUP): generation 2", 1);
    let (handle_b2, spki_b2) = ask_key(&mut b, key_b).expect("the new key");
    assert_ne!((handle_b2, &spki_b2), (handle_b, &spki_b));
    assert!(sign(&mut b, handle_b, b"old").is_ok(), "retired at once");
    send_signal(keyd.child.id(), "-HUP");
    wait_keyd_line(&keyd, "reloaded (SIGHUP): generation 3", 1);
    let e = sign(&mut b, handle_b, b"old").expect_err("the replaced key was kept");
    assert!(e.contains("no key"), "{e}");
    let sig = sign(&mut b, handle_b2, b"new").expect("the new key signs");
    assert!(verifies(&spki_b2, b"new", &sig));

    // Past its rate (10 a second, a burst of 10), A is refused; B is not held back by it.
    let burst: Vec<Result<Vec<u8>, String>> =
        (0..30).map(|_| sign(&mut a, handle_a, b"burst")).collect();
    let over = burst
        .iter()
        .filter(|r| r.as_ref().is_err_and(|e| e.contains("signatures a second")))
        .count();
    let made = burst.iter().filter(|r| r.is_ok()).count();
    assert_eq!(over + made, 30, "{burst:?}");
    assert!((5..=15).contains(&made), "{made} of 30 made: {burst:?}");
    assert!(sign(&mut b, handle_b2, b"b").is_ok());

    // Counted per client: signatures made, and refusals (keys not granted, RELOAD/COMMIT,
    // past the rate); the client with no grant, once.
    let (refused, clients) = report(&keyd, 1, &["a-servers.example", "spiffe://fleet/b"]);
    assert_eq!(field(&clients[0], "signatures"), 2 + made as u64);
    assert_eq!(field(&clients[0], "refused"), 5 + over as u64);
    assert_eq!(field(&clients[1], "signatures"), 4);
    assert_eq!(field(&clients[1], "refused"), 1);
    assert_eq!(field(&refused, "tls_requests_refused"), 6, "{refused}");
    assert_eq!(field(&refused, "tls_refused_no_grant"), 1, "{refused}");
    assert_eq!(
        field(&refused, "tls_signatures_over_rate"),
        over as u64,
        "{refused}"
    );
    let lines = keyd.lines();
    assert!(!lines.iter().any(|l| l.contains("panicked")), "{lines:#?}");

    // A daemon over TLS with no rule at all would serve no one: it does not start.
    let out = Command::new(server_bin())
        .args(["keyd", "--listen-tls", "127.0.0.1:0", "--tls-cert"])
        .arg(&pki.daemon.cert_pem)
        .arg("--tls-key")
        .arg(&pki.daemon.key_pem)
        .arg("--client-ca")
        .arg(&pki.ca_pem)
        .arg("--key")
        .arg(key_a)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("--authorize"),
        "{stderr}"
    );
}

/// Peers that each open a connection to `port` from one of `sources` (`per_source` each) and
/// send one byte of a ClientHello every `every`, opening a new connection `pause` after the
/// daemon closed theirs.
struct SlowPeers {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<SlowReport>>,
    opened: Arc<std::sync::atomic::AtomicUsize>,
}

#[derive(Debug, Default)]
struct SlowReport {
    opened: usize,
    /// How long each connection of the first wave was open until it was seen closed, or
    /// (still open at the end) until then.
    first_wave: Vec<(Duration, bool)>,
}

/// A TLS record header and the start of a ClientHello: a record that is never completed.
const HELLO_START: [u8; 12] = [0x16, 3, 1, 2, 0, 1, 0, 1, 0xfc, 3, 3, 0];

/// One slow peer: its source, its connection (when it opened, bytes sent, whether of the first
/// wave), and when its last one was closed.
struct Peer {
    source: Ipv4Addr,
    conn: Option<(TcpStream, Instant, usize, bool)>,
    closed: Option<Instant>,
}

impl Peer {
    /// One round: a byte more on its connection, or a new connection if the pause is over.
    fn round(&mut self, port: u16, first: bool, pause: Duration, report: &mut SlowReport) {
        if let Some((sock, since, sent, first_wave)) = &mut self.conn {
            let mut b = [0u8; 1];
            let closed = !matches!(sock.read(&mut b),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
            let byte = HELLO_START.get(*sent).copied().unwrap_or(0);
            if closed || sock.write(&[byte]).is_err() {
                if *first_wave {
                    report.first_wave.push((since.elapsed(), true));
                }
                self.conn = None;
                self.closed = Some(Instant::now());
            } else {
                *sent += 1;
            }
        }
        let paused = self.closed.is_some_and(|t| t.elapsed() < pause);
        if self.conn.is_none() && !paused {
            if let Ok(sock) = tcp_connect_from(self.source, port) {
                let _ = sock.set_nonblocking(true);
                self.conn = Some((sock, Instant::now(), 0, first));
                report.opened += 1;
            }
        }
    }
}

impl SlowPeers {
    fn start(
        port: u16,
        sources: Vec<Ipv4Addr>,
        per_source: usize,
        every: Duration,
        pause: Duration,
    ) -> SlowPeers {
        let stop = Arc::new(AtomicBool::new(false));
        let opened = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (stop2, opened2) = (stop.clone(), opened.clone());
        let thread = std::thread::spawn(move || {
            let mut peers: Vec<Peer> = sources
                .iter()
                .flat_map(|s| std::iter::repeat_n(*s, per_source))
                .map(|source| Peer {
                    source,
                    conn: None,
                    closed: None,
                })
                .collect();
            let mut report = SlowReport::default();
            let mut first = true;
            while !stop2.load(Relaxed) {
                for p in peers.iter_mut() {
                    p.round(port, first, pause, &mut report);
                }
                opened2.store(report.opened, Relaxed);
                first = false;
                std::thread::sleep(every);
            }
            for (_, since, _, first_wave) in peers.iter().filter_map(|p| p.conn.as_ref()) {
                if *first_wave {
                    report.first_wave.push((since.elapsed(), false));
                }
            }
            report
        });
        SlowPeers {
            stop,
            thread: Some(thread),
            opened,
        }
    }

    fn wait_opened(&self, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.opened.load(Relaxed) < n {
            assert!(Instant::now() < deadline, "the slow peers did not connect");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn stop(mut self) -> SlowReport {
        self.stop.store(true, Relaxed);
        self.thread.take().unwrap().join().unwrap()
    }
}

impl Drop for SlowPeers {
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
    }
}

#[test]
fn slow_peers_from_many_addresses_keep_no_server_from_a_keyd_over_tls() {
    // 1,100 peers, and the daemon's descriptors for them: above the usual soft limit.
    tlsplane_sys::raise_nofile_limit().expect("open-files limit");
    let dir = crate::sites::scratch("keyd-trust-slow");
    let pki = keyd_pki(&dir, "k");
    let site = fixtures::pki().issue_in(&dir, "site", &["localhost", "127.0.0.1"], CertKind::P256);
    let deadline = Duration::from_secs(3);
    let keyd = TlsKeyd::start_with(
        &pki,
        0,
        &[
            "--key".into(),
            site.key_pem.clone().into(),
            "--authorize".into(),
            "server.example=*".into(),
            "--tls-handshake-timeout".into(),
            deadline.as_secs().to_string().into(),
        ],
    );
    // 300 from one address (past its cap of 64), 800 from 40 others (20 each: under it, but
    // past the 256 handshakes in progress), each sending a byte every 250 ms, more often than
    // any timeout per read would notice. The 256 let in hold every handshake slot until their
    // deadline (those cut short come back only after it).
    let every = Duration::from_millis(250);
    let pause = deadline + Duration::from_secs(1);
    // The one address first: connecting beside the others, its handshakes could give way to
    // theirs fast enough never to reach its cap.
    let one = SlowPeers::start(
        keyd.port,
        vec![Ipv4Addr::new(127, 0, 0, 2)],
        300,
        every,
        pause,
    );
    one.wait_opened(300);
    let many = SlowPeers::start(
        keyd.port,
        (1..=40).map(|i| Ipv4Addr::new(127, 0, 1, i)).collect(),
        20,
        every,
        pause,
    );
    many.wait_opened(800);
    let flood_started = Instant::now();

    // A server started now connects (its first connection, while the slots are taken), and
    // serves handshakes from several threads, opening more connections to the daemon.
    let server_lines = format!(
        "keyd = {:?}\nkeyd-tls-cert = {:?}\nkeyd-tls-key = {:?}\nkeyd-ca = {:?}\n",
        keyd.url(),
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
    let server = Server::builder().workers(2).config_file(&config).start();
    let port = server.port();
    let outcomes: Vec<_> = (0..4)
        .map(|_| {
            std::thread::spawn(move || (0..5).map(|_| try_handshake(port)).collect::<Vec<_>>())
        })
        .flat_map(|t| t.join().unwrap())
        .collect();
    let served_within = flood_started.elapsed();
    let failed: Vec<_> = outcomes.iter().filter(|(r, _)| r.is_err()).collect();
    assert!(
        failed.is_empty(),
        "{} of 20 failed: {failed:?}",
        failed.len()
    );
    assert!(
        served_within < deadline,
        "served after the slow handshakes' deadline ({served_within:?}): not while they held \
         every slot"
    );
    // Past the deadline of the first wave's handshakes, and a round of the peers to see it.
    std::thread::sleep((deadline + 3 * every).saturating_sub(flood_started.elapsed()));
    assert_eq!(index(port), "a", "a handshake after the flood");
    let (one, many) = (one.stop(), many.stop());
    let flood = flood_started.elapsed();

    // No connection of the first wave outlived the deadline (by more than a round of the
    // peers and the time to accept them all), however often it sent a byte.
    let limit = deadline + every + Duration::from_millis(500);
    for (who, r) in [("one address", &one), ("40 addresses", &many)] {
        let held: Vec<_> = r
            .first_wave
            .iter()
            .filter(|(lived, closed)| !closed || *lived > limit)
            .collect();
        assert!(held.is_empty(), "{who}: held past {limit:?}: {held:?}");
        assert!(r.first_wave.len() >= 300, "{who}: {r:?}");
    }
    let (refused, _) = report(&keyd, 1, &[]);
    // The one address had at most 64 at once: the others of its 300 were refused at the
    // accept (fewer than 236: some of its 64 gave way to others meanwhile).
    assert!(field(&refused, "tls_refused_per_address") > 0, "{refused}");
    assert!(field(&refused, "tls_handshakes_evicted") > 0, "{refused}");
    assert!(field(&refused, "tls_handshakes_timed_out") > 0, "{refused}");
    // Thousands of refusals, a few lines: at most one a second per kind.
    let lines = keyd.lines();
    let warnings = lines.iter().filter(|l| l.contains("WARN")).count();
    let seconds = flood.as_secs() + 2;
    assert!(
        warnings as u64 <= 4 * seconds,
        "{warnings} warnings in {flood:?}: {lines:#?}"
    );
    assert!(!lines.iter().any(|l| l.contains("panicked")), "{lines:#?}");
    eprintln!(
        "flood of {flood:?}: {} + {} connections opened; the server served 20 handshakes \
         {served_within:?} into it; {refused}; {warnings} warnings",
        one.opened, many.opened
    );
    let stats = server.stop();
    assert_eq!(stats.get("keyd_sign_failures"), 0, "{stats:?}");
    assert_eq!(stats.get("keyd_failovers"), 0, "{stats:?}");
}

/// `tlsplane keyd --socket DIR/keyd.sock --key KEY` run to its end or `wait`; its stderr.
fn keyd_in(dir: &Path, key: &Path, wait: Duration) -> (Option<std::process::ExitStatus>, String) {
    let mut child = Command::new(server_bin())
        .arg("keyd")
        .arg("--socket")
        .arg(dir.join("keyd.sock"))
        .arg("--key")
        .arg(key)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let until = Instant::now() + wait;
    let status = loop {
        match child.try_wait().unwrap() {
            Some(s) => break Some(s),
            None if Instant::now() >= until => break None,
            None => std::thread::sleep(Duration::from_millis(20)),
        }
    };
    let _ = child.kill();
    let _ = child.wait();
    let mut err = String::new();
    let _ = child.stderr.take().unwrap().read_to_string(&mut err);
    (status, err)
}

#[test]
fn keyd_makes_its_socket_with_its_mode_only_where_others_cannot_write() {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let dir = crate::sites::scratch("keyd-trust-socket");
    let key = fixtures::pki().issue_in(&dir, "site", &["localhost"], CertKind::P256);
    // A directory anyone may write (no sticky bit): refused before anything is made there.
    let open = dir.join("open");
    fs::create_dir(&open).unwrap();
    fs::set_permissions(&open, fs::Permissions::from_mode(0o777)).unwrap();
    let (status, err) = keyd_in(&open, &key.key_pem, Duration::from_secs(10));
    assert!(status.is_some_and(|s| !s.success()), "{status:?}: {err}");
    assert!(
        err.contains("another user could replace the socket"),
        "{err}"
    );
    assert!(
        fs::read_dir(&open).unwrap().next().is_none(),
        "made files in it"
    );

    // A private directory: the socket is bound under a temporary name there, given its mode
    // and renamed into place, never chmod-ed at its path (where a symlink put there between
    // the bind and a chmod would have the chmod change its target).
    let private = dir.join("private");
    fs::create_dir(&private).unwrap();
    fs::set_permissions(&private, fs::Permissions::from_mode(0o755)).unwrap();
    let socket = private.join("keyd.sock");
    let trace = dir.join("strace.out");
    let traced = Command::new("strace")
        .args([
            "-f",
            "-qq",
            "-e",
            "trace=chmod,fchmodat,fchmod,bind,rename,renameat,renameat2",
            "-o",
        ])
        .arg(&trace)
        .arg(server_bin())
        .arg("keyd")
        .arg("--socket")
        .arg(&socket)
        .arg("--key")
        .arg(&key.key_pem)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
    let Ok(mut traced) = traced else {
        eprintln!("no strace here: the socket's mode is checked only by keyd_in");
        return;
    };
    let until = Instant::now() + Duration::from_secs(10);
    while !fs::metadata(&socket).is_ok_and(|m| m.file_type().is_socket()) {
        assert!(Instant::now() < until, "no socket");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mode = fs::metadata(&socket).unwrap().permissions().mode() & 0o777;
    // Killing strace detaches keyd, which would live on: end it first.
    for keyd in crate::handoff_c::children_of(traced.id()) {
        let _ = Command::new("kill").arg(keyd.to_string()).status();
    }
    let _ = traced.kill();
    let _ = traced.wait();
    assert_eq!(mode, 0o600);
    let calls = fs::read_to_string(&trace).unwrap();
    let name = socket.to_str().unwrap();
    let by_path: Vec<&str> = calls
        .lines()
        .filter(|l| (l.contains("chmod(") || l.contains("chmodat(")) && l.contains(name))
        .collect();
    assert!(by_path.is_empty(), "chmod by path: {by_path:?}");
    let bound_at_path = calls
        .lines()
        .any(|l| l.contains("bind(") && l.contains(&format!("\"{name}\"")));
    assert!(
        !bound_at_path,
        "bound at its path, not renamed there: {calls}"
    );
    let renamed = calls
        .lines()
        .any(|l| l.contains("rename") && l.contains(&format!("\"{name}\"")));
    assert!(renamed, "not renamed into place: {calls}");
}

#[test]
fn a_server_uses_only_a_keyd_of_a_user_it_trusts() {
    use std::os::unix::fs::PermissionsExt;
    // A key daemon started by hand by user 65534, in its own directory: a socket of a user
    // the server does not know to trust (it could be one put in the real daemon's place).
    let dir = std::env::temp_dir().join(format!("tlsplane-e2e-keyd-peer-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    let leaf = fixtures::pki().leaf(CertKind::P256);
    let key = dir.join("key.pem");
    fs::copy(&leaf.key_pem, &key).unwrap();
    fs::set_permissions(&key, fs::Permissions::from_mode(0o644)).unwrap();
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o755)).unwrap();
    std::os::unix::fs::chown(&dir, Some(65534), Some(65534)).unwrap();
    let socket = dir.join("keyd.sock");
    let daemon = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(server_bin())
        .arg("keyd")
        .arg("--socket")
        .arg(&socket)
        .arg("--key")
        .arg(&key)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
    let Ok(daemon) = daemon else {
        eprintln!("SKIPPED: no setpriv");
        return;
    };
    let mut daemon = ExternalKeyd(daemon);
    let until = Instant::now() + Duration::from_secs(10);
    while !(socket.exists() && socket.with_extension("sock.token").exists()) {
        assert!(
            Instant::now() < until && daemon.0.try_wait().unwrap().is_none(),
            "the daemon of user 65534 did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let keyd_arg = format!("unix:{}", socket.display());

    // Not told of that user: the server neither sends it its token nor starts.
    let mut refused = Command::new(server_bin())
        .arg("serve")
        .arg(&fixtures::get().www)
        .arg("--cert")
        .arg(&leaf.cert_pem)
        .arg("--key")
        .arg(&leaf.key_pem)
        .args(["--listen", "127.0.0.1:0", "--keyd", &keyd_arg])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let until = Instant::now() + Duration::from_secs(10);
    let status = loop {
        match refused.try_wait().unwrap() {
            Some(s) => break Some(s),
            None if Instant::now() >= until => break None,
            None => std::thread::sleep(Duration::from_millis(20)),
        }
    };
    let _ = refused.kill();
    let mut err = String::new();
    let _ = refused.stderr.take().unwrap().read_to_string(&mut err);
    let _ = refused.wait();
    assert!(
        status.is_some_and(|s| !s.success()),
        "the server used the daemon of user 65534 ({status:?}): {err}"
    );
    assert!(
        err.contains("user id 65534") && err.contains("no token sent"),
        "{err}"
    );

    // Told that its daemon runs as 65534 (--keyd-uid): it uses it.
    let site = crate::sites::scratch("keyd-trust-peer");
    let config = crate::sites::write_config(
        &site,
        "",
        &[crate::sites::SiteSpec {
            names: &["localhost"],
            default: true,
            certs: vec![fixtures::CertFiles {
                cert_pem: leaf.cert_pem.clone(),
                key_pem: key.clone(),
            }],
            content: "a",
        }],
    );
    let server = Server::builder()
        .config_file(&config)
        .arg("--keyd")
        .arg(keyd_arg)
        .arg("--keyd-uid")
        .arg("65534")
        .start();
    let (r, _) = try_handshake(server.port());
    r.expect("a handshake signed by the daemon of user 65534");
    let stats = server.stop();
    drop(daemon);
    let _ = fs::remove_dir_all(&dir);
    assert!(stats.get("keyd_signatures") >= 1, "{stats:?}");
}

/// A site `localhost` whose key is `site`'s, for a server that signs through `keyd`.
fn site_through(dir: &Path, pki: &KeydPki, keyd: &TlsKeyd, site: &fixtures::CertFiles) -> PathBuf {
    let server_lines = format!(
        "keyd = {:?}\nkeyd-tls-cert = {:?}\nkeyd-tls-key = {:?}\nkeyd-ca = {:?}\n",
        keyd.url(),
        pki.client.cert_pem,
        pki.client.key_pem,
        pki.ca_pem
    );
    crate::sites::write_config(
        dir,
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
    )
}

#[test]
fn a_keyd_over_tls_closes_idle_connections_caps_each_client_and_servers_reconnect_unharmed() {
    let dir = crate::sites::scratch("keyd-trust-idle");
    let pki = keyd_pki(&dir, "k");
    let c_client = pki.issue("c", &["c.example"]);
    let site = fixtures::pki().issue_in(&dir, "site", &["localhost", "127.0.0.1"], CertKind::P256);
    let idle = Duration::from_millis(1500);
    let arg = |s: &str| OsString::from(s);
    let keyd = TlsKeyd::start_with(
        &pki,
        0,
        &[
            arg("--key"),
            site.key_pem.clone().into(),
            arg("--authorize"),
            arg("server.example=*"),
            arg("--authorize"),
            arg("c.example=*"),
            arg("--tls-idle-timeout"),
            arg(&idle.as_secs_f64().to_string()),
            arg("--max-tls-connections-per-client"),
            arg("2"),
        ],
    );
    let ping = framed(PING, b"");
    // One client holds at most two connections: a third is closed after its handshake.
    let mut c1 = keyd_tls_client(keyd.port, &pki.ca_pem, Some(&c_client));
    let mut c2 = keyd_tls_client(keyd.port, &pki.ca_pem, Some(&c_client));
    assert_eq!(keyd_exchange(&mut c1, &ping), Ok(vec![0]));
    assert_eq!(keyd_exchange(&mut c2, &ping), Ok(vec![0]));
    let mut c3 = keyd_tls_client(keyd.port, &pki.ca_pem, Some(&c_client));
    keyd_exchange(&mut c3, &ping).expect_err("a third connection of c.example");

    // Another client is not held back by it: a server signs through the daemon.
    let config = site_through(&dir, &pki, &keyd, &site);
    let server = Server::builder().workers(1).config_file(&config).start();
    let port = server.port();
    assert_eq!(index(port), "a");
    // Idle past the timeout: the daemon closes every connection, the server's pooled ones too.
    std::thread::sleep(idle + Duration::from_millis(500));
    keyd_exchange(&mut c1, &ping).expect_err("an idle connection kept");
    let (refused, _) = report(&keyd, 1, &[]);
    assert_eq!(field(&refused, "tls_refused_per_client"), 1, "{refused}");
    assert!(field(&refused, "tls_idle_closed") >= 3, "{refused}");
    // The server's next signatures find its connection closed and are made on a new one: no
    // handshake fails, and the daemon is not taken out of use.
    for _ in 0..3 {
        assert_eq!(index(port), "a");
    }
    let stats = server.stop();
    assert_eq!(stats.get("keyd_sign_failures"), 0, "{stats:?}");
    assert_eq!(stats.get("keyd_failovers"), 0, "{stats:?}");
    assert!(stats.get("keyd_signatures") >= 4, "{stats:?}");
    let lines = keyd.lines();
    assert!(!lines.iter().any(|l| l.contains("panicked")), "{lines:#?}");
}

/// PING on a new connection of `pki`'s client to `port` whose handshake takes `pause` longer
/// than it needs (its ClientHello, the pause, then the rest), as a server far away makes it.
fn slow_handshake_ping(port: u16, pki: &KeydPki, pause: Duration) -> Result<Vec<u8>, String> {
    let mut c = keyd_tls_client(port, &pki.ca_pem, Some(&pki.client));
    c.conn
        .write_tls(&mut c.sock)
        .map_err(|e| format!("ClientHello: {e}"))?;
    std::thread::sleep(pause);
    keyd_exchange(&mut c, &framed(PING, b""))
}

#[test]
fn a_flood_from_many_addresses_cuts_short_no_handshake_of_a_server_that_is_in() {
    let dir = crate::sites::scratch("keyd-trust-churn");
    let pki = keyd_pki(&dir, "k");
    let site = fixtures::pki().issue_in(&dir, "site", &["localhost", "127.0.0.1"], CertKind::P256);
    let keyd = TlsKeyd::start_with(
        &pki,
        0,
        &[
            "--key".into(),
            site.key_pem.clone().into(),
            "--authorize".into(),
            "server.example=*".into(),
            "--max-tls-handshakes".into(),
            "16".into(),
        ],
    );
    // A server that is in: its pool holds a connection to the daemon.
    let config = site_through(&dir, &pki, &keyd, &site);
    let server = Server::builder().workers(2).config_file(&config).start();
    let port = server.port();
    assert_eq!(index(port), "a");

    // 40 addresses, one connection each, each new one as soon as the daemon closed the last:
    // more than the 16 handshakes in progress, all from addresses with no more than a
    // server's. Cutting short the oldest for each newcomer, the daemon cut short every
    // handshake that took more than a few of the peers' rounds.
    let flood_started = Instant::now();
    let peers = SlowPeers::start(
        keyd.port,
        (1..=40).map(|i| Ipv4Addr::new(127, 0, 3, i)).collect(),
        1,
        Duration::from_millis(5),
        Duration::ZERO,
    );
    peers.wait_opened(200);
    // A handshake that takes half a second, from the server's host, and handshakes of the
    // server on four threads at once (its pool opens more connections meanwhile).
    let (slow, outcomes) = std::thread::scope(|scope| {
        let slow = scope.spawn(|| slow_handshake_ping(keyd.port, &pki, Duration::from_millis(500)));
        let outcomes: Vec<_> = (0..4)
            .map(|_| scope.spawn(|| (0..5).map(|_| try_handshake(port)).collect::<Vec<_>>()))
            .collect::<Vec<_>>()
            .into_iter()
            .flat_map(|t| t.join().unwrap())
            .collect();
        (slow.join().unwrap(), outcomes)
    });
    let report_of_peers = peers.stop();
    let flood = flood_started.elapsed();
    assert_eq!(
        slow,
        Ok(vec![0]),
        "the server's slow handshake was cut short"
    );
    let failed: Vec<_> = outcomes.iter().filter(|(r, _)| r.is_err()).collect();
    assert!(
        failed.is_empty(),
        "{} of 20 failed: {failed:?}",
        failed.len()
    );

    let (refused, _) = report(&keyd, 1, &[]);
    assert!(
        field(&refused, "tls_refused_handshakes_full") > 0,
        "{refused}"
    );
    let lines = keyd.lines();
    let warnings = lines.iter().filter(|l| l.contains("WARN")).count();
    assert!(
        warnings as u64 <= 5 * (flood.as_secs() + 2),
        "{warnings} warnings in {flood:?}: {lines:#?}"
    );
    assert!(!lines.iter().any(|l| l.contains("panicked")), "{lines:#?}");
    eprintln!(
        "flood of {flood:?}: {} connections opened; {refused}; {warnings} warnings",
        report_of_peers.opened
    );
    let stats = server.stop();
    assert_eq!(stats.get("keyd_sign_failures"), 0, "{stats:?}");
    assert_eq!(stats.get("keyd_failovers"), 0, "{stats:?}");
}
