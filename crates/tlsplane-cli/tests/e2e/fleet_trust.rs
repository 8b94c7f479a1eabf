//! The fleet's store against whoever can write to it, and reached over TLS (docs/FLEET.md,
//! "What a writer of the store can do", "Across hosts: TLS and an ACL user"): a value that
//! does not open and a lease that never expires are repaired within a lease period and the
//! rotation goes on; keys past `--ticket-key-max-age` are refused whatever the store holds;
//! a `rediss://` store with client certificates and a least-privileged ACL user serves the
//! fleet, and wrong credentials are refused without showing the password.

use std::fs;
use std::io::{Read, Write};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustls::pki_types::UnixTime;
use rustls::{ClientConfig, HandshakeKind};

use crate::fleet::{
    client_with_ticket, fleet_member, generation, installed, no_panic, redis_cli, visit, wait_for,
    wait_log, write_kek, Redis,
};
use crate::sites::scratch;
use crate::support::client::{ClientOpts, Tls};
use crate::support::fixtures::{self, CertKind};
use crate::support::{tools, Server};

/// Seconds between rotations: short, and long enough for a ticket to be offered (tickets are
/// announced for as long).
const ROTATION: u64 = 2;
/// The lease servers rotating every [`ROTATION`] take (four polls of a twentieth of it, at
/// least 1 s), and the longest they leave standing.
const LEASE: Duration = Duration::from_secs(1);
/// Room for a loaded machine on top of what the servers promise.
const SLACK: Duration = Duration::from_secs(1);
const VALUE: &str = "tlsplane:ticket-keys";
const LEASE_KEY: &str = "tlsplane:ticket-keys:lease";

/// A server of the fleet at `redis`, rotating every [`ROTATION`].
fn member(redis: &Redis, kek: &Path, extra: &[&str]) -> Server {
    extra
        .iter()
        .fold(fleet_member(&redis.url(), kek), |b, a| b.arg(*a))
        .arg("--ticket-rotation")
        .arg(ROTATION.to_string())
        .start()
}

fn secs(d: u64) -> Duration {
    Duration::from_secs(d)
}

fn logged_by_either(a: &Server, b: &Server, what: &str) -> bool {
    [a, b]
        .iter()
        .any(|s| s.stderr_lines().iter().any(|l| l.contains(what)))
}

/// The newest generation either server installed.
fn newest(a: &Server, b: &Server) -> u64 {
    generation(a).max(generation(b))
}

#[test]
fn a_garbage_value_and_a_squatted_lease_heal_within_a_lease_period() {
    if !tools::require("redis-server") {
        return;
    }
    let dir = scratch("fleet-trust-heal");
    let kek = write_kek(&dir.join("kek"));
    let redis = Redis::start(&dir);
    let (a, b) = (member(&redis, &kek, &[]), member(&redis, &kek, &[]));
    wait_for("both servers on the store's keys", secs(5), || {
        generation(&a) >= 1 && generation(&b) >= 1
    });

    // Garbage, then a key of another type (every GET of it fails): each is replaced by the
    // next server to hold the lease, within a lease period (one another server may hold).
    let list = "redis.call('DEL', KEYS[1]); redis.call('RPUSH', KEYS[1], 'x')";
    let writes: [&[&str]; 2] = [&["SET", VALUE, "garbage"], &["EVAL", list, "1", VALUE]];
    for write in writes {
        redis_cli(redis.port, write);
        let written = Instant::now();
        wait_for(
            &format!("the value opening again after {write:?}"),
            LEASE + SLACK,
            || redis_cli(redis.port, &["GET", VALUE]).starts_with("TPK1"),
        );
        eprintln!("{write:?}: replaced in {:?}", written.elapsed());
    }
    // A value of 8 MiB that looks like a server's: replaced as well, and never sent to a
    // server (which would hold it, and send it back to compare, at every poll).
    let sent_before = redis_output_bytes(redis.port);
    let big = "redis.call('SET', KEYS[1], 'TPK1' .. string.rep('x', 8388608))";
    redis_cli(redis.port, &["EVAL", big, "1", VALUE]);
    wait_for("the 8 MiB value replaced", LEASE + SLACK, || {
        redis_cli(redis.port, &["STRLEN", VALUE])
            .trim()
            .parse::<u64>()
            .is_ok_and(|n| n < 1024)
    });
    let sent = redis_output_bytes(redis.port) - sent_before;
    assert!(sent < 1 << 20, "Redis sent {sent} bytes to the servers");
    assert!(logged_by_either(
        &a,
        &b,
        "the next server to hold the lease replaces it"
    ));

    // Then a lease with no expiry: cut to the servers' own the next time one needs it, and
    // the rotation goes on one lease later.
    redis_cli(redis.port, &["SET", LEASE_KEY, "squatter"]);
    let n = newest(&a, &b);
    wait_for(
        "a rotation after the repairs, despite the squatted lease",
        secs(ROTATION) + LEASE + SLACK,
        || generation(&a) > n && generation(&b) > n,
    );
    assert!(logged_by_either(&a, &b, "had no expiry"));

    // The fleet shares its keys as before.
    let c = client_with_ticket(a.port(), Tls::V13);
    assert_eq!(visit(b.port(), &c), HandshakeKind::Resumed);

    no_panic(&a);
    no_panic(&b);
    let (sa, sb) = (a.stop(), b.stop());
    let sum = |name: &str| sa.get(name) + sb.get(name);
    assert!(sum("ticket_store_heals") >= 3, "{sa:?} {sb:?}");
    assert!(sum("ticket_store_leases_cut") >= 1, "{sa:?} {sb:?}");
    assert!(sum("ticket_store_errors") >= 2, "{sa:?} {sb:?}");
}

/// What Redis has sent to its clients so far (`INFO stats`).
fn redis_output_bytes(port: u16) -> u64 {
    redis_cli(port, &["INFO", "stats"])
        .lines()
        .find_map(|l| l.strip_prefix("total_net_output_bytes:"))
        .and_then(|n| n.trim().parse().ok())
        .expect("total_net_output_bytes in INFO stats")
}

/// A clock that stands still, so that a client offers its ticket however old it is: what is
/// refused then is refused by the server.
#[derive(Debug)]
struct StoppedClock(UnixTime);

impl rustls::time_provider::TimeProvider for StoppedClock {
    fn current_time(&self) -> Option<UnixTime> {
        Some(self.0)
    }
}

fn client_with_a_stopped_clock() -> Arc<ClientConfig> {
    let mut config = (*ClientOpts::version(Tls::V13).config()).clone();
    config.time_provider = Arc::new(StoppedClock(UnixTime::now()));
    Arc::new(config)
}

/// A writer of the store that holds the rotation lease, each time for less than the servers'
/// own lease (so that none is cut) and again before it expires: the rotation stops, and no
/// repair can tell it from a server's lease. Stops when dropped.
struct Squatter {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Squatter {
    fn start(port: u16) -> Squatter {
        let mut conn = std::net::TcpStream::connect(("127.0.0.1", port)).expect("redis");
        let mut squat = move || {
            let mut reply = [0u8; 64];
            conn.write_all(format!("SET {LEASE_KEY} squatter PX 900\r\n").as_bytes())
                .and_then(|()| conn.read(&mut reply))
                .expect("SET the lease");
        };
        squat();
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                while !stop.load(Relaxed) {
                    std::thread::sleep(Duration::from_millis(150));
                    squat();
                }
            })
        };
        Squatter {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Squatter {
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[test]
fn keys_past_the_maximum_age_are_refused_when_the_store_is_frozen_or_replays_them() {
    if !tools::require("redis-server") {
        return;
    }
    let dir = scratch("fleet-trust-age");
    let kek = write_kek(&dir.join("kek"));
    let redis = Redis::start(&dir);
    let (a, b) = (member(&redis, &kek, &[]), member(&redis, &kek, &[]));
    wait_for("both servers on the store's keys", secs(5), || {
        generation(&a) >= 1 && generation(&b) >= 1
    });

    // Just after a rotation, the store is frozen: nothing newer comes.
    let frozen = newest(&a, &b) + 1;
    let rotated = wait_log(&a, &installed(frozen), secs(ROTATION) + LEASE + SLACK);
    let squatter = Squatter::start(redis.port);
    redis_cli(redis.port, &["COPY", VALUE, "saved", "REPLACE"]);
    let (on_a, on_b) = (client_with_a_stopped_clock(), client_with_a_stopped_clock());
    for (client, server) in [(&on_a, &b), (&on_b, &a)] {
        assert_eq!(visit(server.port(), client), HandshakeKind::Full);
    }
    assert_eq!(
        visit(a.port(), &on_a),
        HandshakeKind::Resumed,
        "shared keys"
    );
    assert_eq!(
        visit(b.port(), &on_b),
        HandshakeKind::Resumed,
        "shared keys"
    );

    // Past the maximum age (twice the rotation by default; a poll to notice), both servers
    // drop the store's keys: the tickets under them get full handshakes, and each server
    // seals with keys of its own.
    let max_age = secs(2 * ROTATION) + Duration::from_millis(300);
    std::thread::sleep((rotated + max_age).saturating_duration_since(Instant::now()));
    assert_eq!(visit(a.port(), &on_a), HandshakeKind::Full, "A, an old key");
    assert_eq!(visit(b.port(), &on_b), HandshakeKind::Full, "B, an old key");
    for s in [&a, &b] {
        wait_log(s, "has reached --ticket-key-max-age", SLACK);
        assert_eq!(generation(s), frozen, "no rotation while frozen");
    }
    assert_eq!(
        visit(a.port(), &on_a),
        HandshakeKind::Resumed,
        "A's own keys"
    );
    assert_eq!(
        visit(b.port(), &on_a),
        HandshakeKind::Full,
        "A's keys are A's"
    );

    // The store thawed: the next rotation brings new keys, none of the frozen generation's.
    drop(squatter);
    wait_log(&a, &installed(frozen + 1), LEASE + SLACK);
    wait_log(&b, &installed(frozen + 1), SLACK);
    let c = client_with_ticket(a.port(), Tls::V13);
    assert_eq!(visit(b.port(), &c), HandshakeKind::Resumed, "thawed");
    no_panic(&a);
    no_panic(&b);
    for stats in [a.stop(), b.stop()] {
        assert_eq!(stats.get("ticket_store_expired"), 1, "{stats:?}");
    }

    // The frozen generation replayed to a server that starts: too old to install; it makes a
    // newer one.
    redis_cli(redis.port, &["COPY", "saved", VALUE, "REPLACE"]);
    let late = member(&redis, &kek, &[]);
    wait_log(&late, &installed(frozen + 1), SLACK);
    let lines = late.stderr_lines().join("\n");
    assert!(!lines.contains(&installed(frozen)), "{lines}");
    assert!(lines.contains("not installed"), "{lines}");
    no_panic(&late);
    assert!(late.stop().get("ticket_store_expired") >= 1);

    // A maximum age that would drop keys before they rotate is refused.
    let mut cmd = std::process::Command::new(crate::support::server_bin());
    cmd.args(["serve", "--listen", "127.0.0.1:0", "--ticket-store"])
        .arg(redis.url())
        .arg("--ticket-store-kek")
        .arg(&kek)
        .args(["--ticket-rotation", "60", "--ticket-key-max-age", "60", "."]);
    let out = tools::run(cmd, b"", secs(30));
    assert!(!out.status.success(), "{}", out.describe());
    assert!(
        out.stderr_text()
            .contains("--ticket-key-max-age 60: more than --ticket-rotation 60"),
        "{}",
        out.describe()
    );
}

#[test]
fn a_store_over_tls_with_an_acl_user_shares_keys_and_refuses_wrong_credentials() {
    if !tools::require("redis-server") {
        return;
    }
    let dir = scratch("fleet-trust-tls");
    let kek = write_kek(&dir.join("kek"));
    let pki = fixtures::pki();
    let store_cert = pki.leaf(CertKind::P256);
    let client = pki.issue_client_in(&dir, "fleet-server", CertKind::P256);
    let password = "Tr0ub4dor-fleet";
    let password_file = dir.join("store.password");
    fs::write(&password_file, format!("{password}\n")).unwrap();
    let path = |p: &Path| p.to_str().unwrap().to_string();
    // TLS only, client certificates required; the default user off, and the fleet's user
    // allowed its keys and the commands its scripts run, nothing more (docs/FLEET.md).
    let mut options: Vec<String> = [
        "--tls-cert-file",
        &path(&store_cert.cert_pem),
        "--tls-key-file",
        &path(&store_cert.key_pem),
        "--tls-ca-cert-file",
        &path(&pki.ca_pem),
        "--tls-auth-clients",
        "yes",
        "--user",
        "default",
        "off",
        "--user",
        "fleet",
        "on",
        &format!(">{password}"),
    ]
    .map(String::from)
    .to_vec();
    options.extend(ACL_RULES.split(' ').map(String::from));
    let redis = Redis::start_with(&dir, options, true);
    let url = |user: &str| format!("rediss://{user}@127.0.0.1:{}", redis.port);
    let credentials = [
        "--fleet",
        "tls-fleet",
        "--ticket-store-ca",
        &path(&pki.ca_pem),
        "--ticket-store-tls-cert",
        &path(&client.cert_pem),
        "--ticket-store-tls-key",
        &path(&client.key_pem),
    ];
    let server = |user: &str, extra: &[&str], with_ca: bool| {
        let skip = if with_ca { 0 } else { 2 };
        let b = fleet_member(&url(user), &kek);
        let b = credentials[..2]
            .iter()
            .chain(&credentials[2 + skip..])
            .chain(extra)
            .fold(b, |b, a| b.arg(*a));
        b.start()
    };
    let with_password = ["--ticket-store-password-file", &path(&password_file)];
    let limits = ["--fleet-limits", "--client-handshake-rate", "1000"];
    let a = server("fleet", &[&with_password[..], &limits].concat(), true);
    let b = server("fleet", &with_password, true);
    for s in [&a, &b] {
        wait_log(s, &installed(1), secs(5));
    }
    let c = client_with_ticket(a.port(), Tls::V13);
    assert_eq!(visit(b.port(), &c), HandshakeKind::Resumed);

    // A wrong password (in the URL: shown without it), and no CA for the store's certificate
    // (the system's roots do not know it): no keys from the store, and no password in the log.
    let wrong = "Wr0ng-fleet-pw";
    let refused = [
        (
            server(&format!("fleet:{wrong}"), &[], true),
            "authentication failed",
        ),
        (server("fleet", &with_password, false), "certificate"),
    ];
    for (s, why) in &refused {
        wait_log(s, why, secs(5));
        let lines = s.stderr_lines().join("\n");
        assert!(!lines.contains("installed"), "{lines}");
        assert!(
            !lines.contains(wrong) && !lines.contains(password),
            "{lines}"
        );
    }
    assert!(refused[0]
        .0
        .stderr_lines()
        .iter()
        .any(|l| l.contains("rediss://fleet:***@127.0.0.1")));
    for (s, _) in refused {
        no_panic(&s);
        s.stop();
    }

    no_panic(&a);
    no_panic(&b);
    let (sa, sb) = (a.stop(), b.stop());
    for stats in [&sa, &sb] {
        assert_eq!(stats.get("ticket_store_errors"), 0, "{stats:?}");
    }
    // The fleet's limits go through the same connection.
    assert!(sa.get("limit_sync_rounds") > 0, "{sa:?}");
    assert_eq!(sa.get("limit_sync_errors"), 0, "{sa:?}");
}

/// What the fleet's Redis user needs (docs/FLEET.md): the fleet's keys, the script commands,
/// and the commands the scripts run.
const ACL_RULES: &str = "~tls-fleet:* resetchannels -@all +ping +eval +evalsha +script|load \
                         +type +get +set +pttl +pexpire +hget +hincrby";
