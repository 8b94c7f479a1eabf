//! The `LD_PRELOAD` shim (`crates/tlsplane-handoff-c/preload/tlsplane_preload.c`, issue 21):
//! programs never written for tlsplane, unmodified, behind `tlsplane handoff` (user relay
//! plane): `python3 -m http.server` and a C echo server using `accept4`. Each test builds the
//! shim with `cc` as docs/HANDOFF.md says, and each fails without it (no receiver connects).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::handoff::{connect, have_python, runtime, scratch, wait_receivers};
use crate::support::client::Tls;
use crate::support::{mode, tools, Mode, Server};

fn cc() -> String {
    std::env::var("CC").unwrap_or_else(|_| "cc".into())
}

/// A C compiler is there, or (only in the kernel-mode guest, which has none) the test skips.
fn have_cc() -> bool {
    if tools::find_in_path(&cc()).is_some() {
        return true;
    }
    assert!(
        mode() == Mode::Kernel,
        "these tests need a C compiler (`{}`) in PATH",
        cc()
    );
    eprintln!("SKIPPED: no C compiler in the kernel-mode guest");
    false
}

fn compile(args: &[&str], src: &Path, out: &Path) {
    let res = Command::new(cc())
        .args(["-O2", "-Wall", "-Wextra", "-Werror"])
        .args(args)
        .arg("-o")
        .arg(out)
        .arg(src)
        .args(["-ldl", "-pthread"])
        .output()
        .expect("cc");
    assert!(
        res.status.success(),
        "cc {}:\n{}",
        src.display(),
        String::from_utf8_lossy(&res.stderr)
    );
}

/// The shim, built once per test run with the documented command.
fn shim() -> &'static Path {
    static SHIM: OnceLock<PathBuf> = OnceLock::new();
    SHIM.get_or_init(|| {
        let dir = scratch("handoff-preload-shim");
        let out = dir.join("libtlsplane_preload.so");
        let src = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tlsplane-handoff-c/preload/tlsplane_preload.c");
        compile(&["-shared", "-fPIC"], &src, &out);
        out
    })
}

/// A port nothing listens on: the program binds it, the shim takes the socket over.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `cmd` under the shim, taking over its listening socket on 127.0.0.1:`port`.
fn preloaded(mut cmd: Command, socket: &Path, port: u16) -> Command {
    cmd.env("LD_PRELOAD", shim())
        .env("TLSPLANE_HANDOFF", socket)
        .env("TLSPLANE_LISTEN", format!("127.0.0.1:{port}"))
        .stdin(Stdio::null());
    cmd
}

/// The program under the shim, killed when dropped (also when an assertion fails first).
struct Program(Child);

impl Drop for Program {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn wait_for_file_line(path: &Path, needle: &str, n: usize) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        if text.matches(needle).count() >= n || Instant::now() > deadline {
            return text;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn an_unmodified_python_http_server_serves_files_over_tls_through_the_shim_across_a_restart() {
    if !have_python() || !have_cc() || !tools::require("curl") {
        eprintln!("skipped: needs python3, cc and curl");
        return;
    }
    let dir = scratch("handoff-preload-http");
    let socket = dir.join("app.sock");
    let www = dir.join("www");
    std::fs::create_dir_all(&www).unwrap();
    // Not a multiple of anything, spanning many TLS records.
    let blob: Vec<u8> = (0..300_001u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(www.join("blob.bin"), &blob).unwrap();
    let server = Server::builder()
        .handoff(&socket)
        .arg("--alpn")
        .arg("http/1.1")
        .start();
    let port = free_port();
    let (out_path, err_path) = (dir.join("http.out"), dir.join("http.err"));
    let mut cmd = Command::new("python3");
    // -u: unbuffered stdout, so that its banner is there to read; the server is unmodified.
    cmd.args([
        "-u",
        "-m",
        "http.server",
        &port.to_string(),
        "--bind",
        "127.0.0.1",
    ])
    .current_dir(&www);
    let py = Program(
        preloaded(cmd, &socket, port)
            .stdout(std::fs::File::create(&out_path).unwrap())
            .stderr(std::fs::File::create(&err_path).unwrap())
            .spawn()
            .expect("python3"),
    );
    wait_receivers(&server, 1);
    let fetch = |tls_port: u16, i: usize| {
        let out = Tls::V13
            .curl(tls_port, 20)
            .arg(format!("https://localhost:{tls_port}/blob.bin"))
            .output()
            .expect("curl");
        assert!(
            out.status.success(),
            "curl {i}: {}\nhttp.server stderr:\n{}",
            String::from_utf8_lossy(&out.stderr),
            std::fs::read_to_string(&err_path).unwrap_or_default()
        );
        assert!(
            out.stdout == blob,
            "curl {i}: {} bytes, not the file's {}",
            out.stdout.len(),
            blob.len()
        );
    };
    // Two connections (http.server answers HTTP/1.0: one request per connection), each file
    // byte-exact.
    fetch(server.port(), 0);
    fetch(server.port(), 1);
    let stats = server.stop();
    assert_eq!(stats.get("handoff_user_plane"), 2, "{stats:?}");
    // tlsplane restarts: the shim connects again (every 200 ms) and the program, which saw
    // nothing of it, serves on.
    let server = Server::builder()
        .handoff(&socket)
        .arg("--alpn")
        .arg("http/1.1")
        .start();
    wait_receivers(&server, 1);
    fetch(server.port(), 2);
    // http.server logs each request with the client's address: the real peer's, from the
    // hand-off header (an AF_UNIX peer would not print as 127.0.0.1).
    let err = wait_for_file_line(&err_path, "\"GET /blob.bin HTTP/1.1\" 200", 3);
    drop(py);
    let logged: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("GET /blob.bin"))
        .collect();
    assert_eq!(logged.len(), 3, "http.server stderr:\n{err}");
    for l in &logged {
        assert!(l.starts_with("127.0.0.1 - - ["), "{l}\n{err}");
    }
    assert!(!err.contains("Traceback"), "http.server stderr:\n{err}");
    assert!(
        err.contains("tlsplane-preload: reconnected to TLSPLANE_HANDOFF"),
        "{err}"
    );
    // getsockname on the taken-over socket still names what the program bound.
    let banner = std::fs::read_to_string(&out_path).unwrap();
    assert!(
        banner.contains(&format!("Serving HTTP on 127.0.0.1 port {port}")),
        "{banner}"
    );
    let stats = server.stop();
    assert_eq!(stats.get("handoff_user_plane"), 1, "{stats:?}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_c_server_using_accept4_echoes_through_the_shim_and_sees_the_real_peer() {
    if !have_cc() {
        return;
    }
    let dir = scratch("handoff-preload-echo");
    let socket = dir.join("app.sock");
    let exe = dir.join("preload_echo");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/e2e/preload_echo.c");
    compile(&["-std=c99", "-D_GNU_SOURCE"], &src, &exe);
    let server = Server::builder().handoff(&socket).start();
    let port = free_port();
    let out_path = dir.join("echo.out");
    let echo = Program(
        preloaded(Command::new(&exe), &socket, port)
            .arg(port.to_string())
            .stdout(std::fs::File::create(&out_path).unwrap())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("preload_echo"),
    );
    wait_receivers(&server, 1);
    let data: Vec<u8> = (0..150_000).map(|i| (i % 253) as u8).collect();
    let mut ports = Vec::new();
    for _ in 0..2 {
        let (got, client_port) = runtime().block_on(async {
            let c = connect(server.port(), &[]).await;
            let client_port = c.get_ref().0.local_addr().unwrap().port();
            let (mut r, mut w) = tokio::io::split(c);
            let writer = async {
                w.write_all(&data).await.expect("write");
                w.shutdown().await.expect("close_notify");
                w
            };
            let reader = async {
                let mut got = Vec::new();
                let _ =
                    tokio::time::timeout(Duration::from_secs(20), r.read_to_end(&mut got)).await;
                got
            };
            let (_w, got) = tokio::join!(writer, reader);
            (got, client_port)
        });
        assert!(
            got == data,
            "echoed {} of {} bytes; program said:\n{}",
            got.len(),
            data.len(),
            std::fs::read_to_string(&out_path).unwrap_or_default()
        );
        ports.push(client_port);
    }
    let out = wait_for_file_line(&out_path, "done", 1);
    drop(echo);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines,
        [
            format!("listening port={port}"),
            format!(
                "conn1 family=inet peer=127.0.0.1:{} len_ok=1 cloexec=1 nonblock=1",
                ports[0]
            ),
            "then=EAGAIN".into(),
            format!(
                "conn2 family=inet peer=127.0.0.1:{} len_ok=1 cloexec=0 nonblock=0",
                ports[1]
            ),
            "done".into(),
        ],
        "{out}"
    );
    let stats = server.stop();
    assert_eq!(stats.get("handoff_user_plane"), 2, "{stats:?}");
    let _ = std::fs::remove_dir_all(dir);
}
