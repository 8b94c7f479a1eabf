//! `tlsplane bench` as a script runs it: its exit status, its report when nothing succeeded,
//! its progress lines on a stderr that is not a terminal, and `--resolve`.

use std::process::Command;
use std::time::Duration;

use crate::support::tools::{run, Output};
use crate::support::{server_bin, Server};

fn bench(args: &[&str], timeout: Duration) -> Output {
    let mut cmd = Command::new(server_bin());
    cmd.arg("bench").args(args);
    run(cmd, b"", timeout)
}

#[test]
fn bench_fails_when_nothing_succeeded_and_says_n_a() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let dead = closed.local_addr().expect("addr").to_string();
    drop(closed);
    let out = bench(
        &["handshake", &dead, "--insecure-no-verify", "--count", "3"],
        Duration::from_secs(30),
    );
    assert!(!out.status.success(), "{}", out.describe());
    let report = out.stdout_text();
    assert!(report.contains("latency µs     n/a"), "{report}");
    assert!(!report.contains("p50 0"), "{report}");
    assert!(
        out.stderr_text().contains("no attempt succeeded"),
        "{}",
        out.describe()
    );
}

#[test]
fn bench_resolves_with_resolve_and_shows_progress_in_a_log() {
    let server = Server::start();
    let port = server.port();
    // The name is never looked up (.invalid cannot resolve): --resolve gives its address.
    let target = format!("bench.invalid:{port}");
    let resolve = format!("bench.invalid:{port}:127.0.0.1");
    let out = bench(
        &[
            "handshake",
            &target,
            "--resolve",
            &resolve,
            "--insecure-no-verify",
            // A request per connection: a client that closes right after its handshake races
            // the kernel plane's hand-off (kernel_setup_failures), which this is not about.
            "--request",
            "/hello.txt",
            "--duration",
            "5.5",
        ],
        Duration::from_secs(60),
    );
    assert!(out.status.success(), "{}", out.describe());
    assert!(out.stdout_text().contains("p50 "), "{}", out.describe());
    // stderr is a pipe here: a plain line every 5 s, no terminal escapes.
    let err = out.stderr_text();
    let lines: Vec<&str> = err
        .lines()
        .filter(|l| l.starts_with("progress ["))
        .collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(lines[0].contains(" ok "), "{err}");
    assert!(!err.contains('\x1b'), "{err}");
    drop(server.stop());
}
