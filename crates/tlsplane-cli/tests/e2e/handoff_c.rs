//! `tlsplane handoff` to C programs on both planes (issue 21): a file server on the C library
//! (`handoff_files.c`: sendfile on the handed descriptor) and an unmodified echo server under
//! the LD_PRELOAD shim, each through a client KeyUpdate (both directions) mid-stream and a
//! client close_notify; and echo servers of the shapes people preload the shim into
//! (`shim_servers.c`: threaded, pre-fork, fork per connection) under many clients at once.
//!
//! Natively the connections go over the user relay; in the kernel-mode guest (vm/ktls-suite)
//! the program receives the kTLS socket itself: tlsplane copies nothing after the hand-off
//! (`handoff_relayed_bytes` 0), re-keys on the program's request, and /proc/net/tls_stat
//! moves. The guest has no C compiler: vm/ktls-suite builds the programs on the host and
//! names their directory in `TLSPLANE_TEST_PREBUILT`.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::handoff::{scratch, wait_receivers};
use crate::support::client::{End, Tls, TlsClient};
use crate::support::{kernel_rekeys, mode, tls_stat, Mode, Server};

/// A program the tests run: prebuilt (the guest) or compiled here once.
fn program(name: &str) -> PathBuf {
    if let Ok(dir) = std::env::var("TLSPLANE_TEST_PREBUILT") {
        let p = Path::new(&dir).join(name);
        assert!(p.exists(), "{} is not there", p.display());
        return p;
    }
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    let dir = BUILT.get_or_init(|| {
        let dir = scratch("handoff-c-programs");
        build_programs(&dir);
        dir
    });
    dir.join(name)
}

/// Builds what vm/ktls-suite builds for the guest (keep the two in step).
fn build_programs(out: &Path) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let lib = static_lib();
    let cc = |args: &[&str]| {
        let res = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
            .args(["-O2", "-Wall", "-Wextra", "-Werror"])
            .args(args)
            .output()
            .expect("a C compiler (cc)");
        assert!(
            res.status.success(),
            "cc {args:?}:\n{}",
            String::from_utf8_lossy(&res.stderr)
        );
    };
    let include = root.join("crates/tlsplane-handoff-c/include");
    cc(&[
        "-I",
        include.to_str().unwrap(),
        "-o",
        out.join("handoff_files").to_str().unwrap(),
        root.join("crates/tlsplane-cli/tests/e2e/handoff_files.c")
            .to_str()
            .unwrap(),
        lib.to_str().unwrap(),
        "-lpthread",
        "-ldl",
        "-lm",
    ]);
    cc(&[
        "-shared",
        "-fPIC",
        "-o",
        out.join("libtlsplane_preload.so").to_str().unwrap(),
        root.join("crates/tlsplane-handoff-c/preload/tlsplane_preload.c")
            .to_str()
            .unwrap(),
        "-ldl",
        "-pthread",
    ]);
    cc(&[
        "-std=c99",
        "-D_GNU_SOURCE",
        "-o",
        out.join("preload_echo").to_str().unwrap(),
        root.join("crates/tlsplane-cli/tests/e2e/preload_echo.c")
            .to_str()
            .unwrap(),
    ]);
    cc(&[
        "-std=c99",
        "-o",
        out.join("shim_servers").to_str().unwrap(),
        root.join("crates/tlsplane-handoff-c/tests/c/shim_servers.c")
            .to_str()
            .unwrap(),
        "-pthread",
    ]);
}

/// The C library's static archive: cargo builds it with the workspace's tests (in deps/,
/// beside this test binary), else it is built here.
fn static_lib() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    for dir in [deps, deps.parent().unwrap()] {
        let p = dir.join("libtlsplane_handoff_c.a");
        if p.exists() {
            return p;
        }
    }
    let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["build", "--release", "-p", "tlsplane-handoff-c"])
        .status()
        .expect("cargo");
    assert!(status.success(), "building the C library failed");
    let p = deps.parent().unwrap().join("libtlsplane_handoff_c.a");
    assert!(p.exists(), "{} not built", p.display());
    p
}

/// /proc/net/tls_stat in kernel mode (natively there is none).
fn kernel_tls_stat() -> std::collections::BTreeMap<String, u64> {
    if mode() == Mode::Kernel {
        tls_stat()
    } else {
        Default::default()
    }
}

/// The program's stdout lines, as they come, up to `n` of them (or its end).
fn lines_of(child: &mut Child, n: usize, limit: Duration) -> Vec<String> {
    let out = child.stdout.take().expect("piped");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let deadline = Instant::now() + limit;
    let mut got = Vec::new();
    while got.len() < n {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(l) => got.push(l),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
            Err(_) => panic!("the program printed {got:?}, not {n} lines"),
        }
    }
    got
}

fn body(data: &[u8], seed: u32) -> Vec<u8> {
    let mut x = seed;
    (0..data.len())
        .map(|_| {
            x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
            (x >> 16) as u8
        })
        .collect()
}

/// Checks the planes' own evidence: counted on the right plane, nothing relayed on the
/// kernel plane, and the kernel's TLS counters moved by `conns`.
fn assert_plane(
    stats: &crate::support::Stats,
    conns: u64,
    tls0: &std::collections::BTreeMap<String, u64>,
) {
    match mode() {
        Mode::Kernel => {
            assert_eq!(stats.get("handoff_kernel_plane"), conns, "{stats:?}");
            assert_eq!(stats.get("handoff_user_plane"), 0, "{stats:?}");
            assert_eq!(
                stats.get("handoff_relayed_bytes"),
                0,
                "tlsplane copied bytes after the hand-off: {stats:?}"
            );
            let tls1 = tls_stat();
            for key in ["TlsTxSw", "TlsRxSw"] {
                let d = tls1.get(key).copied().unwrap_or(0) - tls0.get(key).copied().unwrap_or(0);
                assert!(d >= conns, "{key} moved by {d}, not {conns}");
            }
            assert_eq!(stats.get("handoff_kernel_kept"), 0, "{stats:?}");
        }
        Mode::User => {
            assert_eq!(stats.get("handoff_user_plane"), conns, "{stats:?}");
            assert!(stats.get("handoff_relayed_bytes") > 0, "{stats:?}");
        }
    }
}

/// `handoff_files` serving `files` for `conns` connections behind a fresh `tlsplane handoff`,
/// its receiver connected.
struct Files {
    dir: PathBuf,
    server: Server,
    prog: Child,
}

fn files_behind_handoff(what: &str, files: &[(&str, &[u8])], conns: u32) -> Files {
    let dir = scratch(what);
    let www = dir.join("www");
    std::fs::create_dir_all(&www).unwrap();
    for (name, bytes) in files {
        std::fs::write(www.join(name), bytes).unwrap();
    }
    let socket = dir.join("app.sock");
    let server = Server::builder().handoff(&socket).start();
    let prog = Command::new(program("handoff_files"))
        .arg(&socket)
        .arg(&www)
        .arg(conns.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("handoff_files");
    wait_receivers(&server, 1);
    Files { dir, server, prog }
}

#[test]
fn a_c_program_serves_files_by_sendfile_through_a_key_update_and_close_notify() {
    let big = body(&vec![0; (1 << 20) + 7], 1);
    let small = body(&[0; 16385], 2);
    let tls0 = kernel_tls_stat();
    let Files {
        dir,
        server,
        mut prog,
    } = files_behind_handoff(
        "handoff-c-files",
        &[("big.bin", &big), ("small.bin", &small)],
        2,
    );
    let rekeys = mode() == Mode::User || kernel_rekeys(&server);

    // A rustls client: a file, a KeyUpdate (update_requested: the program's side re-keys
    // both ways), a file under the new keys, then close_notify.
    let mut c = TlsClient::connect_version(server.port(), Tls::V13);
    let r = c.get("/big.bin");
    assert_eq!(r.status, 200);
    assert!(r.body == big, "big.bin: {} bytes differ", r.body.len());
    if rekeys {
        c.conn.refresh_traffic_keys().expect("KeyUpdate");
        let r = c.get("/small.bin");
        assert_eq!(r.status, 200);
        assert!(r.body == small, "small.bin after KeyUpdate differs");
    }
    c.send_close_notify().expect("close_notify");
    let (rest, end) = c.read_to_end();
    assert!(rest.is_empty(), "bytes after the last response");
    assert!(matches!(end, End::CloseNotify), "the end was {end:?}");

    // curl, TLS 1.2 this time: byte-exact by sendfile.
    let out = Tls::V12
        .curl(server.port(), 20)
        .arg(format!("https://localhost:{}/big.bin", server.port()))
        .output()
        .expect("curl");
    assert!(
        out.status.success(),
        "curl: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.stdout == big, "curl got {} bytes", out.stdout.len());

    let lines = lines_of(&mut prog, 2, Duration::from_secs(20));
    let _ = prog.wait();
    let want_plane = if mode() == Mode::Kernel { 1 } else { 2 };
    let requests = if rekeys { 2 } else { 1 };
    assert!(
        lines[0].contains(&format!(
            "plane {want_plane} version 0x304 requests {requests} end EOF"
        )),
        "{lines:?}"
    );
    assert!(
        lines[1].contains(&format!("plane {want_plane} version 0x303 requests 1 end")),
        "{lines:?}"
    );
    let stats = server.stop();
    assert_plane(&stats, 2, &tls0);
    if mode() == Mode::Kernel {
        assert_eq!(stats.get("handoff_kernel_key_updates"), 1, "{stats:?}");
        assert_eq!(stats.get("handoff_kernel_closes"), 2, "{stats:?}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn an_unmodified_server_under_the_shim_echoes_through_a_key_update_and_close_notify() {
    let dir = scratch("handoff-c-shim");
    let socket = dir.join("app.sock");
    let tls0 = kernel_tls_stat();
    let server = Server::builder().handoff(&socket).start();
    let rekeys = mode() == Mode::User || kernel_rekeys(&server);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut prog = Command::new(program("preload_echo"))
        .arg(port.to_string())
        .env("LD_PRELOAD", program("libtlsplane_preload.so"))
        .env("TLSPLANE_HANDOFF", &socket)
        .env("TLSPLANE_LISTEN", format!("127.0.0.1:{port}"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("preload_echo");
    wait_receivers(&server, 1);

    // preload_echo serves two connections, echoing each to its end.
    for k in 0..2u32 {
        let mut c = TlsClient::connect_version(server.port(), Tls::V13);
        let first = body(&[0; 3000], 10 + k);
        c.write_all(&first).unwrap();
        let mut got = vec![0; first.len()];
        read_exact(&mut c, &mut got);
        assert!(got == first, "echo before KeyUpdate");
        if rekeys {
            c.conn.refresh_traffic_keys().expect("KeyUpdate");
            let second = body(&[0; 40000], 20 + k);
            c.write_all(&second).unwrap();
            let mut got = vec![0; second.len()];
            read_exact(&mut c, &mut got);
            assert!(got == second, "echo after KeyUpdate");
        }
        if k == 0 {
            c.send_close_notify().unwrap();
        } else {
            // A bare TCP half-close (no close_notify): the program reads its end, closes, and
            // the shim's CLOSE still finds tlsplane keeping the socket (it waits a while after
            // the client's FIN), so the client gets its close_notify all the same.
            c.io.sock.shutdown(std::net::Shutdown::Write).unwrap();
        }
        let (rest, end) = c.read_to_end();
        assert!(rest.is_empty(), "bytes after the echo");
        assert!(
            matches!(end, End::CloseNotify),
            "connection {k}: the end was {end:?}"
        );
    }
    // Its last line says both connections ended (read returned 0) and were closed.
    let lines = lines_of(&mut prog, usize::MAX, Duration::from_secs(20));
    let _ = prog.wait();
    assert!(lines.iter().all(|l| !l.starts_with("error")), "{lines:?}");
    assert_eq!(lines.last().map(String::as_str), Some("done"), "{lines:?}");
    let stats = server.stop();
    assert_plane(&stats, 2, &tls0);
    if mode() == Mode::Kernel && rekeys {
        assert_eq!(stats.get("handoff_kernel_key_updates"), 2, "{stats:?}");
        assert_eq!(stats.get("handoff_kernel_closes"), 2, "{stats:?}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

fn read_exact(c: &mut TlsClient, buf: &mut [u8]) {
    let mut got = 0;
    while got < buf.len() {
        let n = c.read_plain(&mut buf[got..]).expect("read");
        assert!(n > 0, "the end after {got} of {} bytes", buf.len());
        got += n;
    }
}

#[test]
fn a_c_program_killed_mid_connection_leaves_its_client_a_reset() {
    let tls0 = kernel_tls_stat();
    let Files {
        dir,
        server,
        mut prog,
    } = files_behind_handoff(
        "handoff-c-killed",
        &[("a.txt", b"served before the program died\n")],
        1,
    );
    let mut c = TlsClient::connect_version(server.port(), Tls::V13);
    let r = c.get("/a.txt");
    assert_eq!(r.body, b"served before the program died\n");
    // The connection is open (keep-alive) and the program waits for its next request: it
    // dies with the descriptor open, without asking for a close. tlsplane resets the
    // connection (on the kernel plane through its duplicate, the socket's last descriptor
    // now): a close_notify would tell the client that nothing more was to come.
    let started = Instant::now();
    prog.kill().unwrap();
    let _ = prog.wait();
    let (rest, end) = c.read_to_end();
    assert!(rest.is_empty(), "bytes after the response");
    assert!(
        matches!(end, End::Io(std::io::ErrorKind::ConnectionReset, _)),
        "the end was {end:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(10));
    let stats = server.stop();
    assert_eq!(stats.get("handoff_receivers_lost"), 1, "{stats:?}");
    assert_plane(&stats, 1, &tls0);
    let reset_counter = match mode() {
        Mode::Kernel => "handoff_kernel_released_receiver_gone",
        Mode::User => "handoff_relay_reset_receiver_gone",
    };
    assert_eq!(stats.get(reset_counter), 1, "{stats:?}");
    let _ = std::fs::remove_dir_all(dir);
}

/// On the kernel plane a handed connection is the program's: tlsplane stopping (or
/// restarting) leaves it working, and the C library then sends its close_notify itself.
#[test]
fn a_kernel_plane_connection_outlives_tlsplane() {
    if !crate::support::kernel_only("a connection that outlives tlsplane (the relay does not)") {
        return;
    }
    let text = b"the program serves on after tlsplane is gone\n";
    let Files {
        dir,
        server,
        mut prog,
    } = files_behind_handoff("handoff-c-outlives", &[("a.txt", text)], 1);
    let mut c = TlsClient::connect_version(server.port(), Tls::V13);
    assert_eq!(c.get("/a.txt").body, text);
    let stats = server.stop();
    assert_eq!(stats.get("handoff_kernel_plane"), 1, "{stats:?}");
    assert_eq!(
        stats.get("handoff_kernel_released_receiver_gone"),
        0,
        "{stats:?}"
    );
    assert_eq!(c.get("/a.txt").body, text, "after tlsplane stopped");
    c.send_close_notify().unwrap();
    let (rest, end) = c.read_to_end();
    assert!(rest.is_empty());
    assert!(matches!(end, End::CloseNotify), "the end was {end:?}");
    let lines = lines_of(&mut prog, 1, Duration::from_secs(20));
    let _ = prog.wait();
    assert!(lines[0].contains("requests 2 end EOF"), "{lines:?}");
    let _ = std::fs::remove_dir_all(dir);
}

/// One client of an echo server: a body, the same bytes back, then close_notify both ways.
fn echo_once(port: u16, seed: u32) -> Result<(), String> {
    let mut c = TlsClient::connect_version(port, Tls::V13);
    let len = 1000 + (seed as usize * 7919) % 40_000;
    let sent = body(&vec![0; len], seed);
    c.write_all(&sent).map_err(|e| format!("write: {e}"))?;
    let mut got = vec![0; sent.len()];
    let mut n = 0;
    while n < got.len() {
        match c.read_plain(&mut got[n..]) {
            Ok(0) => return Err(format!("end after {n} of {len} bytes")),
            Ok(k) => n += k,
            Err(e) => return Err(format!("read after {n} of {len} bytes: {e}")),
        }
    }
    if got != sent {
        return Err(format!("{len} bytes echoed, not the same"));
    }
    c.send_close_notify()
        .map_err(|e| format!("close_notify: {e}"))?;
    match c.read_to_end() {
        (rest, End::CloseNotify) if rest.is_empty() => Ok(()),
        (rest, end) => Err(format!("{} bytes more, then {end:?}", rest.len())),
    }
}

/// Echo servers of the shapes people preload the shim into (`shim_servers.c`, knowing nothing
/// of tlsplane): 8 threads each in accept; 4 processes forked after listen, each in accept on
/// the shared socket (their frames must not interleave); and one that forks a child per
/// connection and closes its own copy at once (on the kernel plane the CLOSE must wait for the
/// child's). Each serves 48 connections from 12 clients at once, byte-exact, each ended with
/// close_notify.
#[test]
fn threaded_pre_fork_and_fork_per_connection_servers_under_the_shim_serve_many_clients() {
    let dir = scratch("handoff-c-shapes");
    let socket = dir.join("app.sock");
    let tls0 = kernel_tls_stat();
    let server = Server::builder().handoff(&socket).start();
    let tls_port = server.port();
    const CLIENTS: u32 = 12;
    const EACH: u32 = 4;
    let shapes = [("threads", "8"), ("prefork", "4"), ("forkper", "1")];
    for (i, (shape, n)) in shapes.into_iter().enumerate() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut prog = Command::new(program("shim_servers"))
            .args([&port.to_string(), shape, n])
            .env("LD_PRELOAD", program("libtlsplane_preload.so"))
            .env("TLSPLANE_HANDOFF", &socket)
            .env("TLSPLANE_LISTEN", format!("127.0.0.1:{port}"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("shim_servers");
        wait_receivers(&server, i + 1);
        let failures: Vec<String> = std::thread::scope(|s| {
            let clients: Vec<_> = (0..CLIENTS)
                .map(|c| {
                    s.spawn(move || {
                        (0..EACH)
                            .filter_map(|k| echo_once(tls_port, c * EACH + k + 1).err())
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            clients
                .into_iter()
                .flat_map(|c| c.join().unwrap())
                .collect()
        });
        assert!(failures.is_empty(), "{shape}: {failures:?}");
        drop(prog.stdin.take()); // it reports and stops
        let lines = lines_of(&mut prog, 3, Duration::from_secs(20));
        let _ = prog.kill();
        let _ = prog.wait();
        let served = format!("served={}", CLIENTS * EACH);
        assert_eq!(lines, ["listening", served.as_str(), "done"], "{shape}");
    }
    let stats = server.stop();
    let conns = u64::from(3 * CLIENTS * EACH);
    assert_plane(&stats, conns, &tls0);
    if mode() == Mode::Kernel {
        assert_eq!(stats.get("handoff_kernel_closes"), conns, "{stats:?}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// `shim_servers forkper` under the shim, served by `server`; `env` set for it (e.g.
/// SHIM_DROP_UID). Its stdin is piped: dropping it stops the program.
fn fork_per_connection_under_the_shim(
    server: &Server,
    socket: &Path,
    env: &[(&str, &str)],
) -> Child {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let prog = Command::new(program("shim_servers"))
        .args([&port.to_string(), "forkper"])
        .env("LD_PRELOAD", program("libtlsplane_preload.so"))
        .env("TLSPLANE_HANDOFF", socket)
        .env("TLSPLANE_LISTEN", format!("127.0.0.1:{port}"))
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("shim_servers");
    wait_receivers(server, 1);
    prog
}

/// The children of process `pid` (its main thread's, from /proc).
pub(crate) fn children_of(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// A fork-per-connection server under the shim whose child (the process serving the
/// connection; the parent closed its copy at once) is killed mid-connection: the shim sent
/// HELLO with ENDS_WITH_CLOSE and the dead child no CLOSE, so the client gets a reset (user
/// relay; on the kernel plane nothing, tlsplane's duplicate still holding the socket), never
/// a close_notify that would pass a cut answer off as whole. A connection the child ends
/// still gets its close_notify.
#[test]
fn a_fork_per_connection_child_killed_under_the_shim_leaves_its_client_a_reset() {
    let dir = scratch("handoff-c-forkper-killed");
    let socket = dir.join("app.sock");
    let tls0 = kernel_tls_stat();
    let server = Server::builder().handoff(&socket).start();
    let mut prog = fork_per_connection_under_the_shim(&server, &socket, &[]);
    echo_once(server.port(), 1).expect("a connection the child ends");
    let mut c = TlsClient::connect_version(server.port(), Tls::V13);
    let first = body(&[0; 3000], 2);
    c.write_all(&first).unwrap();
    let mut got = vec![0; first.len()];
    read_exact(&mut c, &mut got);
    assert!(got == first, "echo before the kill");
    let kids = children_of(prog.id());
    assert_eq!(kids.len(), 1, "the child serving the connection: {kids:?}");
    if mode() == Mode::Kernel {
        // tlsplane keeps a duplicate of a kernel-plane socket, so the child's copy going is
        // no end it can see (it lets go 30 s after the client's end, or when the receiver
        // goes): what matters is that no close_notify comes.
        c.io.sock
            .set_read_timeout(Some(Duration::from_secs(3)))
            .unwrap();
    }
    let status = Command::new("kill")
        .args(["-KILL", &kids[0].to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let (rest, end) = c.read_to_end();
    assert!(rest.is_empty(), "bytes after the echo");
    let want = match mode() {
        Mode::User => std::io::ErrorKind::ConnectionReset,
        Mode::Kernel => std::io::ErrorKind::TimedOut,
    };
    assert!(
        matches!(&end, End::Io(kind, _) if *kind == want),
        "the end was {end:?}"
    );
    drop(prog.stdin.take());
    let lines = lines_of(&mut prog, 3, Duration::from_secs(20));
    let _ = prog.kill();
    let _ = prog.wait();
    // The killed child counted nothing.
    assert_eq!(lines, ["listening", "served=1", "done"]);
    let stats = server.stop();
    assert_eq!(
        stats.get("handoff_receivers_ends_with_close"),
        1,
        "{stats:?}"
    );
    assert_plane(&stats, 2, &tls0);
    let _ = std::fs::remove_dir_all(dir);
}

/// A fork-per-connection server under the shim that drops root after listen (setuid to
/// nobody, as daemons do: the process is then not dumpable, and kcmp(2) on its children fails
/// with EPERM) serves whole answers, each ended with close_notify: the parent's close right
/// after the fork must not end the connection its child still serves.
#[test]
fn a_fork_per_connection_server_that_drops_root_under_the_shim_serves_whole_answers() {
    let dir = scratch("handoff-c-forkper-nobody");
    let socket = dir.join("app.sock");
    let tls0 = kernel_tls_stat();
    let server = Server::builder().handoff(&socket).start();
    let mut prog =
        fork_per_connection_under_the_shim(&server, &socket, &[("SHIM_DROP_UID", "65534")]);
    let failures: Vec<String> = (1..=4)
        .filter_map(|seed| echo_once(server.port(), seed).err())
        .collect();
    assert!(failures.is_empty(), "{failures:?}");
    drop(prog.stdin.take());
    let lines = lines_of(&mut prog, 3, Duration::from_secs(20));
    let _ = prog.kill();
    let _ = prog.wait();
    assert_eq!(lines, ["listening", "served=4", "done"]);
    let stats = server.stop();
    // Under the promise each close_notify above is a CLOSE the child sent after its parent
    // had dropped root (without one the relay resets).
    assert_eq!(
        stats.get("handoff_receivers_ends_with_close"),
        1,
        "{stats:?}"
    );
    assert_plane(&stats, 4, &tls0);
    if mode() == Mode::Kernel {
        assert_eq!(stats.get("handoff_kernel_closes"), 4, "{stats:?}");
    }
    let _ = std::fs::remove_dir_all(dir);
}
