//! Several servers as one (docs/FLEET.md): session tickets issued by one resume on every
//! server given the same `--ticket-keys` file, after a restart too, and through a rotation.
//!
//! Servers run one after another, not side by side: in kernel mode the guests run one
//! server at a time (their /proc/net/tls_stat is checked per server). A server that is
//! started afresh is "another node" as far as tickets go: nothing of the first survives in it
//! but the key file.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use rustls::{ClientConfig, HandshakeKind};

use crate::sites::scratch;
use crate::support::client::{ClientOpts, Tls, TlsClient};
use crate::support::{fixtures, server_bin, tools, Server};

fn random_key() -> Vec<u8> {
    let mut k = vec![0u8; 80];
    aws_lc_rs::rand::fill(&mut k).unwrap();
    k
}

fn write_keys(path: &Path, keys: &[&[u8]]) {
    let text: String = keys
        .iter()
        .map(|k| base64::engine::general_purpose::STANDARD.encode(k) + "\n")
        .collect();
    // Replaced by a rename, as a deployment tool would.
    let tmp = path.with_extension("tmp");
    fs::write(&tmp, text).unwrap();
    fs::rename(&tmp, path).unwrap();
}

fn node(keys: Option<&Path>, pid_file: Option<&Path>) -> Server {
    let mut b = Server::builder();
    if let Some(k) = keys {
        b = b.arg("--ticket-keys").arg(k.to_str().unwrap());
    }
    if let Some(p) = pid_file {
        b = b.arg("--pid-file").arg(p.to_str().unwrap());
    }
    b.start()
}

/// Connects with `client` (whose session store holds what earlier connections left), gets a
/// page so that the server's tickets arrive, and says how the handshake went.
pub(crate) fn visit(port: u16, client: &Arc<ClientConfig>) -> HandshakeKind {
    let mut c = TlsClient::connect_with(port, client.clone());
    let kind = c.conn.handshake_kind().expect("handshake done");
    assert_eq!(c.get(&fixtures::get().hello.url).status, 200);
    c.close();
    kind
}

/// As [`visit`], for a loop that counts failures rather than stop at one: None if the
/// handshake or the page failed.
pub(crate) fn try_visit(port: u16, client: &Arc<ClientConfig>) -> Option<HandshakeKind> {
    let mut c = TlsClient::over(crate::support::client::tcp_connect(port), client.clone());
    c.handshake().ok()?;
    let kind = c.conn.handshake_kind()?;
    let ok = c.get(&fixtures::get().hello.url).status == 200;
    c.close();
    ok.then_some(kind)
}

/// A client that has been to `port` once (a full handshake) and holds its ticket.
pub(crate) fn client_with_ticket(port: u16, v: Tls) -> Arc<ClientConfig> {
    let client = ClientOpts::version(v).config();
    assert_eq!(visit(port, &client), HandshakeKind::Full);
    client
}

fn reload(pid_file: &Path) {
    let mut cmd = Command::new(server_bin());
    cmd.args(["reload", "--pid-file"]).arg(pid_file);
    let out = tools::run(cmd, b"", Duration::from_secs(40));
    assert!(out.status.success(), "{}", out.describe());
}

pub(crate) fn no_panic(server: &Server) {
    let lines = server.stderr_lines();
    assert!(
        !lines.iter().any(|l| l.contains("panicked")),
        "{}",
        lines.join("\n")
    );
}

#[test]
fn tickets_resume_on_every_server_holding_the_keys_and_only_there() {
    let dir = scratch("fleet-resume");
    let keys = dir.join("ticket.keys");
    write_keys(&keys, &[&random_key(), &random_key()]);
    let other_keys = dir.join("other.keys");
    write_keys(&other_keys, &[&random_key()]);

    // Node A issues tickets to four clients (TLS 1.3 and 1.2), then goes away.
    let a = node(Some(&keys), None);
    let on_b = client_with_ticket(a.port(), Tls::V13);
    let on_b12 = client_with_ticket(a.port(), Tls::V12);
    let on_plain = client_with_ticket(a.port(), Tls::V13);
    let on_other = client_with_ticket(a.port(), Tls::V13);
    no_panic(&a);
    let stats = a.stop();
    assert_eq!(stats.get("handshakes_resumed"), 0, "{stats:?}");

    // Node B (or A restarted: a new process) holds the same file: A's tickets resume there.
    let b = node(Some(&keys), None);
    assert_eq!(visit(b.port(), &on_b), HandshakeKind::Resumed, "TLS 1.3");
    assert_eq!(visit(b.port(), &on_b12), HandshakeKind::Resumed, "TLS 1.2");
    // The newest ticket the client holds is B's own now.
    assert_eq!(visit(b.port(), &on_b12), HandshakeKind::Resumed, "B's own");
    no_panic(&b);
    let stats = b.stop();
    assert_eq!(stats.get("handshakes_resumed"), 3, "{stats:?}");
    // B tells the tickets A issued from its own.
    assert_eq!(stats.get("handshakes_resumed_remote"), 2, "{stats:?}");
    assert_eq!(stats.get("handshakes_resumed_local"), 1, "{stats:?}");

    // A server with keys of its own, or with another file, cannot read them: full handshakes,
    // and the connection goes on.
    let plain = node(None, None);
    assert_eq!(visit(plain.port(), &on_plain), HandshakeKind::Full);
    plain.stop();
    let other = node(Some(&other_keys), None);
    assert_eq!(visit(other.port(), &on_other), HandshakeKind::Full);
    other.stop();
}

#[test]
fn a_rotation_keeps_the_previous_keys_tickets_and_drops_older_ones() {
    let dir = scratch("fleet-rotation");
    let (k1, k2, k3, k4) = (random_key(), random_key(), random_key(), random_key());
    let keys = dir.join("ticket.keys");
    let pid_file = dir.join("tlsplane.pid");
    let name = |k: &[u8]| format!("{:02x}{:02x}{:02x}{:02x}", k[0], k[1], k[2], k[3]);

    // [k1, k2]: k1 encrypts, k2 is the next key. P and Q hold k1 tickets.
    write_keys(&keys, &[&k1, &k2]);
    let a = node(Some(&keys), Some(&pid_file));
    let logged = |s: &Server, k: &[u8]| {
        s.stderr_lines()
            .iter()
            .any(|l| l.contains(&format!("encrypting with the key named {}", name(k))))
    };
    assert!(logged(&a, &k1), "{}", a.stderr_lines().join("\n"));
    let p = client_with_ticket(a.port(), Tls::V13);
    let q = client_with_ticket(a.port(), Tls::V13);

    // Rotation 1: [k1, k2, k3]: k2 encrypts; k1's tickets still resume. R gets a k2 ticket.
    write_keys(&keys, &[&k1, &k2, &k3]);
    reload(&pid_file);
    assert!(logged(&a, &k2), "{}", a.stderr_lines().join("\n"));
    assert_eq!(visit(a.port(), &p), HandshakeKind::Resumed);
    let r = client_with_ticket(a.port(), Tls::V13);
    no_panic(&a);
    let stats = a.stop();
    assert_eq!(stats.get("reloads"), 1, "{stats:?}");

    // A server that has not rotated yet ([k1, k2]) resumes a rotated one's tickets: it knew
    // k2 as its next key.
    write_keys(&keys, &[&k1, &k2]);
    let behind = node(Some(&keys), None);
    assert_eq!(visit(behind.port(), &r), HandshakeKind::Resumed);
    behind.stop();

    // The rotated server again, after a restart. S gets a k2 ticket.
    write_keys(&keys, &[&k1, &k2, &k3]);
    let a = node(Some(&keys), Some(&pid_file));
    let s_client = client_with_ticket(a.port(), Tls::V13);

    // Rotation 2: [k2, k3, k4]: k1 is gone and its tickets with it; k2's still resume.
    write_keys(&keys, &[&k2, &k3, &k4]);
    reload(&pid_file);
    assert!(logged(&a, &k3));
    assert_eq!(visit(a.port(), &q), HandshakeKind::Full);
    assert_eq!(visit(a.port(), &s_client), HandshakeKind::Resumed);

    // A broken file fails the reload and leaves the keys in force.
    fs::write(&keys, "not base64!\n").unwrap();
    let mut cmd = Command::new(server_bin());
    cmd.args(["reload", "--pid-file"]).arg(&pid_file);
    let _ = tools::run(cmd, b"", Duration::from_secs(40));
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !a.stderr_lines().iter().any(|l| l.contains("reload failed")) {
        assert!(
            std::time::Instant::now() < deadline,
            "no reload failure logged"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        a.stderr_lines()
            .iter()
            .any(|l| l.contains("--ticket-keys") && l.contains("line 1: not base64")),
        "{}",
        a.stderr_lines().join("\n")
    );
    let k3_ticket = client_with_ticket(a.port(), Tls::V13);
    assert_eq!(visit(a.port(), &k3_ticket), HandshakeKind::Resumed);
    no_panic(&a);
    let stats = a.stop();
    assert_eq!(stats.get("reload_failures"), 1, "{stats:?}");
}

#[test]
fn a_bad_key_file_is_refused_before_listening_with_its_reason() {
    let dir = scratch("fleet-bad-keys");
    let cases: [(&str, Vec<u8>, &str); 4] = [
        ("missing", Vec::new(), "No such file"),
        ("empty", b"# no keys yet\n".to_vec(), "no ticket key in it"),
        (
            "short",
            format!(
                "{}\n",
                base64::engine::general_purpose::STANDARD.encode([7u8; 32])
            )
            .into_bytes(),
            "line 1: a key is 48 or 80 bytes",
        ),
        ("binary", random_key(), "not"),
    ];
    let fx = fixtures::get();
    let leaf = fixtures::pki().leaf(fixtures::CertKind::P256);
    for (what, content, reason) in cases {
        let path: PathBuf = dir.join(what);
        if what != "missing" {
            fs::write(&path, content).unwrap();
        }
        let mut cmd = Command::new(server_bin());
        cmd.args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--keyd",
            "off",
            "--cert",
        ])
        .arg(&leaf.cert_pem)
        .arg("--key")
        .arg(&leaf.key_pem)
        .arg("--ticket-keys")
        .arg(&path)
        .arg(&fx.www);
        let out = tools::run(cmd, b"", Duration::from_secs(30));
        let err = out.stderr_text();
        assert!(!out.status.success(), "{what}: {}", out.describe());
        assert!(
            err.contains("--ticket-keys") && err.contains(reason),
            "{what}: {err}"
        );
        assert!(!err.contains("listening on"), "{what}: {err}");
        assert!(!err.contains("panicked"), "{what}: {err}");
    }

    // check-config reads the file as a server would.
    let config = dir.join("tlsplane.toml");
    let check = |server: &str, reason: &str| {
        fs::write(
            &config,
            format!(
                "[server]\n{server}\n[[site]]\nserver-names = [\"localhost\"]\n\
                 default = true\nroot = {:?}\n[[site.cert]]\nchain = {:?}\nkey = {:?}\n",
                fx.www, leaf.cert_pem, leaf.key_pem
            ),
        )
        .unwrap();
        let mut cmd = Command::new(server_bin());
        cmd.arg("check-config").arg(&config);
        let out = tools::run(cmd, b"", Duration::from_secs(30));
        assert!(!out.status.success(), "{server}: {}", out.describe());
        assert!(
            out.stderr_text().contains(reason),
            "{server}: {}",
            out.describe()
        );
    };
    check(
        &format!("ticket-keys = {:?}", dir.join("short")),
        "line 1: a key is 48 or 80 bytes",
    );
    // And the fleet's store options as a server would at start.
    check(
        &format!(
            "ticket-store = \"redis://127.0.0.1:1\"\nticket-store-kek = {:?}",
            dir.join("missing")
        ),
        "--ticket-store-kek",
    );
    check(
        "fleet-limits = true\nclient-handshake-rate = \"5/s\"",
        "--fleet-limits exchanges counts through the fleet's store",
    );
    let kek = write_kek(&dir.join("kek"));
    check(
        &format!(
            "ticket-store = \"redis://127.0.0.1:1\"\nticket-store-kek = {kek:?}\nfleet-limits = true"
        ),
        "none is set",
    );
}

/// A Redis server of the test's own on a loopback port, with nothing kept on disk (so that a
/// restart brings it back empty, as a store that lost its data).
pub(crate) struct Redis {
    child: Option<std::process::Child>,
    pub(crate) port: u16,
    dir: PathBuf,
    /// Options besides the port and the directory (`--replicaof`, TLS, users).
    options: Vec<String>,
    /// Whether `port` is a TLS port (`--tls-port`, and no plain one).
    tls: bool,
}

/// A loopback port free now.
pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Redis {
    pub(crate) fn start(dir: &Path) -> Redis {
        Redis::start_with(dir, Vec::new(), false)
    }

    fn start_replica(dir: &Path, primary: Option<u16>) -> Redis {
        let options = primary
            .iter()
            .flat_map(|p| ["--replicaof".to_string(), "127.0.0.1".into(), p.to_string()])
            .collect();
        Redis::start_with(dir, options, false)
    }

    /// With `options`; on a TLS port alone if `tls`.
    pub(crate) fn start_with(dir: &Path, options: Vec<String>, tls: bool) -> Redis {
        let mut r = Redis {
            child: None,
            port: free_port(),
            dir: dir.to_path_buf(),
            options,
            tls,
        };
        r.restart();
        r
    }

    fn restart(&mut self) {
        let port = self.port.to_string();
        let ports: &[&str] = match self.tls {
            true => &["--port", "0", "--tls-port", &port],
            false => &["--port", &port],
        };
        let child = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(ports)
            .arg("--dir")
            .arg(&self.dir)
            .args(&self.options)
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("redis-server");
        self.child = Some(child);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "redis-server did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub(crate) fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub(crate) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Seconds between rotations in these tests: short, so that a test sees two, and long
/// enough that a ticket issued just before one is still fresh (tickets are announced for it).
const ROTATION: u64 = 4;

/// A key-encryption key at `path`: 32 random bytes, base64.
pub(crate) fn write_kek(path: &Path) -> PathBuf {
    let kek = base64::engine::general_purpose::STANDARD.encode(&random_key()[..32]);
    fs::write(path, kek).unwrap();
    path.to_path_buf()
}

/// A server of the fleet whose store is at `url`, yet to start.
pub(crate) fn fleet_member(url: &str, kek: &Path) -> crate::support::ServerBuilder {
    Server::builder()
        .arg("--ticket-store")
        .arg(url)
        .arg("--ticket-store-kek")
        .arg(kek.to_str().unwrap())
}

/// A server that follows the store at `url`, rotating every [`ROTATION`].
fn store_node(url: &str, kek: &Path) -> Server {
    fleet_member(url, kek)
        .arg("--ticket-rotation")
        .arg(ROTATION.to_string())
        .start()
}

/// Waits for `server` to log `what`; when it saw it.
pub(crate) fn wait_log(server: &Server, what: &str, within: Duration) -> std::time::Instant {
    let logged = || server.stderr_lines().iter().any(|l| l.contains(what));
    if !poll_until(within, logged) {
        panic!(
            "no `{what}` within {within:?}:\n{}",
            server.stderr_lines().join("\n")
        );
    }
    std::time::Instant::now()
}

/// Polls `ok` until it holds (true) or `within` has passed (false).
pub(crate) fn poll_until(within: Duration, mut ok: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + within;
    while !ok() {
        if std::time::Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}

/// The generation `server` installed last, from its log.
pub(crate) fn generation(server: &Server) -> u64 {
    server
        .stderr_lines()
        .iter()
        .filter_map(|l| {
            let (_, rest) = l.split_once("generation ")?;
            rest.split_once(" installed")?.0.parse().ok()
        })
        .max()
        .unwrap_or(0)
}

pub(crate) fn installed(n: u64) -> String {
    format!("generation {n} installed")
}

#[test]
fn a_store_shares_keys_through_rotations_restarts_and_its_own_outage() {
    if !tools::require("redis-server") {
        return;
    }
    let dir = scratch("fleet-store");
    let kek = write_kek(&dir.join("kek"));
    let mut redis = Redis::start(&dir);
    let a = store_node(&redis.url(), &kek);
    wait_log(&a, &installed(1), Duration::from_secs(5));
    let b = store_node(&redis.url(), &kek);
    wait_log(&b, &installed(1), Duration::from_secs(5));

    // A ticket from A resumes on B.
    let c1 = client_with_ticket(a.port(), Tls::V13);
    assert_eq!(
        visit(b.port(), &c1),
        HandshakeKind::Resumed,
        "before a rotation"
    );

    // A ticket issued just before a rotation resumes on B after it (its key is B's previous
    // one then).
    let n = generation(&a) + 1;
    let rotated = wait_log(&a, &installed(n), Duration::from_secs(2 * ROTATION));
    std::thread::sleep(
        (rotated + Duration::from_secs(ROTATION))
            .saturating_duration_since(std::time::Instant::now() + Duration::from_millis(1200)),
    );
    assert_eq!(generation(&a), n, "rotated early");
    let c2 = client_with_ticket(a.port(), Tls::V13);
    wait_log(&a, &installed(n + 1), Duration::from_secs(ROTATION));
    wait_log(&b, &installed(n + 1), Duration::from_secs(ROTATION));
    assert_eq!(
        visit(b.port(), &c2),
        HandshakeKind::Resumed,
        "after a rotation"
    );

    // A restarted: it takes the fleet's keys from the store before it listens.
    no_panic(&a);
    let a_stats = a.stop();
    let a = store_node(&redis.url(), &kek);
    assert!(generation(&a) > n, "{}", a.stderr_lines().join("\n"));
    let c3 = client_with_ticket(b.port(), Tls::V13);
    assert_eq!(
        visit(a.port(), &c3),
        HandshakeKind::Resumed,
        "after A's restart"
    );

    // The store goes away: handshakes and resumption go on with the keys held; it comes back
    // empty and gets the fleet's generation back.
    // Killed under traffic: a client going back and forth between A and B, resuming.
    let held = generation(&a).max(generation(&b));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let traffic = {
        let (ports, stop) = ([a.port(), b.port()], stop.clone());
        let client = client_with_ticket(a.port(), Tls::V13);
        std::thread::spawn(move || {
            let (mut failed, mut resumed, mut visits) = (0, 0, 0);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                match try_visit(ports[visits % 2], &client) {
                    None => failed += 1,
                    Some(HandshakeKind::Resumed) => resumed += 1,
                    Some(_) => {}
                }
                visits += 1;
            }
            (failed, resumed, visits)
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    redis.kill();
    wait_log(
        &a,
        "keeping the ticket keys held",
        Duration::from_secs(ROTATION),
    );
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (failed, resumed, visits) = traffic.join().unwrap();
    assert_eq!(failed, 0, "{visits} visits while Redis was killed");
    assert_eq!(resumed, visits, "every visit resumed");
    let c4 = client_with_ticket(a.port(), Tls::V13);
    assert_eq!(visit(b.port(), &c4), HandshakeKind::Resumed, "store down");
    redis.restart();
    wait_log(&a, "reached again", Duration::from_secs(10));
    wait_log(&b, "reached again", Duration::from_secs(10));
    let c5 = client_with_ticket(b.port(), Tls::V13);
    assert_eq!(visit(a.port(), &c5), HandshakeKind::Resumed, "store back");
    assert!(
        generation(&a) >= held && generation(&b) >= held,
        "the store's generation went back: held {held}, now {} and {}",
        generation(&a),
        generation(&b)
    );

    // A server that joins now gets the fleet's keys from the store, not new ones.
    let joined = store_node(&redis.url(), &kek);
    assert!(
        generation(&joined) >= held,
        "held {held}: {}",
        joined.stderr_lines().join("\n")
    );
    let c8 = client_with_ticket(a.port(), Tls::V13);
    assert_eq!(visit(joined.port(), &c8), HandshakeKind::Resumed, "joined");
    no_panic(&joined);
    joined.stop();

    // A server with another key-encryption key cannot read the store's keys. It replaces the
    // value it cannot open (as it would garbage), the fleet's servers put theirs back, and
    // each side keeps the keys it holds meanwhile.
    let other_kek = write_kek(&dir.join("other-kek"));
    let stranger = store_node(&redis.url(), &other_kek);
    wait_log(
        &stranger,
        "does not open with --ticket-store-kek",
        Duration::from_secs(5),
    );
    let c6 = client_with_ticket(a.port(), Tls::V13);
    assert_eq!(visit(stranger.port(), &c6), HandshakeKind::Full);
    let c7 = client_with_ticket(a.port(), Tls::V13);
    assert_eq!(visit(b.port(), &c7), HandshakeKind::Resumed, "keys held");
    no_panic(&stranger);
    stranger.stop();

    for s in [&a, &b] {
        no_panic(s);
    }
    let (a_stats2, b_stats) = (a.stop(), b.stop());
    let rotations = a_stats.get("ticket_store_rotations")
        + a_stats2.get("ticket_store_rotations")
        + b_stats.get("ticket_store_rotations");
    assert!(rotations >= 3, "{a_stats:?} {a_stats2:?} {b_stats:?}");
    assert!(a_stats2.get("ticket_store_errors") >= 1, "{a_stats2:?}");
}

/// Runs `redis-cli -p PORT ARGS...` and returns its output.
pub(crate) fn redis_cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .arg("-p")
        .arg(port.to_string())
        .args(args)
        .output()
        .expect("redis-cli");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub(crate) fn wait_for(what: &str, within: Duration, ok: impl FnMut() -> bool) {
    assert!(poll_until(within, ok), "{what} within {within:?}");
}

#[test]
fn servers_follow_a_sentinel_failover_and_keep_resuming() {
    if !tools::require("redis-server") {
        return;
    }
    let dir = scratch("fleet-sentinel");
    let kek = write_kek(&dir.join("kek"));
    // A primary, its replica and one Sentinel (quorum 1) that fails over half a second after
    // the primary stops answering.
    let mut primary = Redis::start(&mkdir(dir.join("primary")));
    let replica = Redis::start_replica(&mkdir(dir.join("replica")), Some(primary.port));
    let replica_port = replica.port;
    let sentinel_port = free_port();
    let sentinel_conf = dir.join("sentinel.conf");
    fs::write(
        &sentinel_conf,
        format!(
            "port {sentinel_port}\nbind 127.0.0.1\ndir {}\n\
             sentinel monitor fleet 127.0.0.1 {} 1\n\
             sentinel down-after-milliseconds fleet 500\n\
             sentinel failover-timeout fleet 3000\n",
            dir.display(),
            primary.port
        ),
    )
    .unwrap();
    let mut sentinel = Command::new("redis-server")
        .arg(&sentinel_conf)
        .arg("--sentinel")
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("redis sentinel");
    wait_for("the replica in sync", Duration::from_secs(10), || {
        redis_cli(replica_port, &["info", "replication"]).contains("master_link_status:up")
    });
    wait_for(
        "the Sentinel knowing the replica",
        Duration::from_secs(15),
        || {
            redis_cli(sentinel_port, &["sentinel", "replicas", "fleet"])
                .contains(&replica_port.to_string())
        },
    );

    let url = format!("redis-sentinel://127.0.0.1:{sentinel_port}/fleet");
    let a = store_node(&url, &kek);
    wait_log(&a, &installed(1), Duration::from_secs(5));
    let b = store_node(&url, &kek);
    wait_log(&b, &installed(1), Duration::from_secs(5));
    let c1 = client_with_ticket(a.port(), Tls::V13);
    assert_eq!(
        visit(b.port(), &c1),
        HandshakeKind::Resumed,
        "before the failover"
    );

    // The primary dies; the Sentinel promotes the replica; the servers follow it.
    primary.kill();
    wait_for("the failover", Duration::from_secs(20), || {
        redis_cli(
            sentinel_port,
            &["sentinel", "get-master-addr-by-name", "fleet"],
        )
        .contains(&replica_port.to_string())
    });
    let c2 = client_with_ticket(a.port(), Tls::V13);
    assert_eq!(
        visit(b.port(), &c2),
        HandshakeKind::Resumed,
        "during the failover"
    );
    wait_log(&a, "reached again", Duration::from_secs(10));
    wait_log(&b, "reached again", Duration::from_secs(10));
    // Rotations go on, written to the new primary.
    let n = generation(&a).max(generation(&b));
    wait_log(&a, &installed(n + 1), Duration::from_secs(3 * ROTATION));
    wait_log(&b, &installed(n + 1), Duration::from_secs(3 * ROTATION));
    assert!(redis_cli(replica_port, &["role"]).starts_with("master"));
    let c3 = client_with_ticket(b.port(), Tls::V13);
    assert_eq!(
        visit(a.port(), &c3),
        HandshakeKind::Resumed,
        "after the failover"
    );

    for s in [&a, &b] {
        no_panic(s);
    }
    let (a_stats, b_stats) = (a.stop(), b.stop());
    assert!(a_stats.get("ticket_store_errors") >= 1, "{a_stats:?}");
    assert!(b_stats.get("handshakes_resumed") >= 2, "{b_stats:?}");
    let _ = sentinel.kill();
    let _ = sentinel.wait();
    drop(replica);
}

fn mkdir(p: PathBuf) -> PathBuf {
    fs::create_dir_all(&p).unwrap();
    p
}

/// The per-client handshake rate of the fleet-limits test, a second.
const FLEET_RATE: u64 = 20;

/// A server of a fleet sharing its per-client rates through the store at `url`.
fn limited_node(url: &str, kek: &Path) -> Server {
    fleet_member(url, kek)
        .arg("--fleet-limits")
        .arg("--client-handshake-rate")
        .arg(FLEET_RATE.to_string())
        .start()
}

/// Full handshakes (+ a GET) from `source`, going round `ports` as fast as the servers
/// answer for `run`: when each that was served ended, from the start.
fn round_robin(source: std::net::Ipv4Addr, ports: &[u16], run: Duration) -> Vec<Duration> {
    let start = std::time::Instant::now();
    let mut served = Vec::new();
    for port in ports.iter().cycle() {
        if start.elapsed() >= run {
            break;
        }
        if crate::limits::served_from(source, *port) {
            served.push(start.elapsed());
        }
    }
    served
}

#[test]
fn a_client_spreading_over_three_servers_gets_its_rate_in_total() {
    if !tools::require("redis-server") {
        return;
    }
    let dir = scratch("fleet-limits");
    let kek = write_kek(&dir.join("kek"));
    let mut redis = Redis::start(&dir);
    let nodes: Vec<Server> = (0..3).map(|_| limited_node(&redis.url(), &kek)).collect();
    let ports: Vec<u16> = nodes.iter().map(|n| n.port()).collect();

    // Each server alone would serve the client FLEET_RATE a second, 3 × that in all. Past the
    // first bursts (each server's, before the first exchanges), the fleet serves about
    // FLEET_RATE a second in all.
    let (warm, run) = (Duration::from_secs(2), Duration::from_secs(7));
    let served = round_robin(std::net::Ipv4Addr::new(127, 0, 0, 3), &ports, run);
    let steady = served.iter().filter(|t| **t >= warm).count() as f64 / (run - warm).as_secs_f64();
    assert!(
        (0.8 * FLEET_RATE as f64..=1.2 * FLEET_RATE as f64).contains(&steady),
        "{steady:.1} handshakes a second past the first {warm:?} ({} in all over {run:?}); \
         the fleet's rate is {FLEET_RATE}/s",
        served.len()
    );
    eprintln!(
        "fleet limits: {steady:.1}/s past {warm:?}, {} served in {run:?}",
        served.len()
    );
    // Another address has its own budget.
    assert!(crate::limits::served_from(
        std::net::Ipv4Addr::new(127, 0, 0, 4),
        ports[0]
    ));

    // The store down: connections are served on each server's own counts; nothing fails.
    redis.kill();
    for n in &nodes {
        wait_log(
            n,
            "per-client rates count this server",
            Duration::from_secs(5),
        );
    }
    let alone = round_robin(
        std::net::Ipv4Addr::new(127, 0, 0, 5),
        &ports,
        Duration::from_secs(1),
    );
    assert!(
        alone.len() as u64 >= 3 * FLEET_RATE,
        "{} served with the store down: each server's own burst is {FLEET_RATE}",
        alone.len()
    );
    redis.restart();
    for n in &nodes {
        wait_log(n, "counts exchanged again", Duration::from_secs(10));
    }

    let mut rounds = 0;
    for n in nodes {
        no_panic(&n);
        let stats = n.stop();
        assert!(stats.get("limit_sync_remote_tokens") > 0, "{stats:?}");
        assert!(stats.get("limit_sync_errors") >= 1, "{stats:?}");
        assert!(stats.get("limit_client_handshake_rate") > 0, "{stats:?}");
        rounds += stats.get("limit_sync_rounds");
    }
    assert!(rounds >= 3 * 10, "{rounds} exchanges");
}
