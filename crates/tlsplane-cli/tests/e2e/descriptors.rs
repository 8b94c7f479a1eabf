//! The open-files limit: connections past it are served by evicting idle ones, never left
//! waiting in the accept queue, and running out of descriptors anyway costs a reset, not a
//! storm of warnings.

use std::time::{Duration, Instant};

use crate::support::client::{ClientOpts, Tls, TlsClient};
use crate::support::{fixtures, Server};

const NOFILE: u64 = 256;

fn have_prlimit() -> bool {
    if crate::support::tools::find_in_path("prlimit").is_none() {
        eprintln!("SKIPPED: no prlimit to start the server with a low open-files limit");
        return false;
    }
    true
}

/// A connection that finished its handshake, or why not (after how long).
fn handshaken_client(port: u16) -> Result<TlsClient, String> {
    let started = Instant::now();
    // The server's reset can already meet the client in `connect` (loopback): a refusal too.
    let sock = std::net::TcpStream::connect(("127.0.0.1", port))
        .map_err(|e| format!("connect: {e} after {:?}", started.elapsed()))?;
    sock.set_read_timeout(Some(Duration::from_secs(3)))
        .expect("timeout");
    sock.set_write_timeout(Some(Duration::from_secs(3)))
        .expect("timeout");
    let mut c = TlsClient::over(sock, ClientOpts::version(Tls::V13).config());
    c.handshake()
        .map_err(|e| format!("handshake: {e:?} after {:?}", started.elapsed()))?;
    Ok(c)
}

/// A keep-alive connection that made one request, or why not (after how long).
fn keep_alive_client(port: u16) -> Result<TlsClient, String> {
    let started = Instant::now();
    let mut c = handshaken_client(port)?;
    c.write_all(&crate::support::get_request(&fixtures::get().hello.url, ""))
        .map_err(|e| format!("request: {e}"))?;
    match c.read_response(false) {
        Ok(r) if r.status == 200 => Ok(c),
        Ok(r) => Err(format!("status {}", r.status)),
        Err(e) => Err(format!("response: {e} after {:?}", started.elapsed())),
    }
}

fn accept_warnings(server: &Server) -> usize {
    server
        .stderr_lines()
        .iter()
        .filter(|l| l.contains("accept failed"))
        .count()
}

/// --max-connections 0 follows the open-files limit: past it the longest-idle connections
/// make room, so every new client is served at once (before, accept failed with EMFILE
/// first, eviction never ran, and new clients waited for an idle timeout).
#[test]
fn at_the_open_files_limit_idle_connections_make_room() {
    if !have_prlimit() {
        return;
    }
    let server = Server::builder().nofile(NOFILE).start();
    let port = server.port();
    let mut held = Vec::new();
    let mut slowest = Duration::ZERO;
    let total = NOFILE as usize + 50;
    for i in 0..total {
        let started = Instant::now();
        let c = keep_alive_client(port).unwrap_or_else(|e| {
            panic!(
                "connection {i} of {total} (open-files limit {NOFILE}) was not served: {e}; \
                 stderr:\n{}",
                server.stderr_lines().join("\n")
            )
        });
        slowest = slowest.max(started.elapsed());
        held.push(c);
    }
    assert!(
        slowest < Duration::from_secs(2),
        "the slowest connection took {slowest:?}"
    );
    // The first (longest idle) was closed to make room.
    let mut first = held.remove(0);
    let (_, end) = first.read_to_end();
    assert!(
        matches!(end, crate::support::client::End::CloseNotify),
        "the longest-idle connection was not closed with close_notify: {end:?}"
    );
    let warnings = accept_warnings(&server);
    drop(held);
    let stats = server.stop();
    assert_eq!(warnings, 0, "accept failed: the limit came after EMFILE");
    assert_eq!(stats["accept_emfile"], 0, "{stats:?}");
    assert!(
        stats["idle_evicted"] >= (total - NOFILE as usize) as u64,
        "{stats:?}"
    );
}

/// With --max-connections above what the open-files limit allows, accept fails with EMFILE:
/// the spare descriptor takes the waiting connection off the queue and resets it at once
/// (before, it waited in the queue, and each retry logged a warning, 20 a second).
#[test]
fn out_of_descriptors_new_clients_are_reset_at_once_and_the_warning_is_throttled() {
    if !have_prlimit() {
        return;
    }
    let server = Server::builder()
        .nofile(NOFILE)
        .arg("--max-connections")
        .arg("10000")
        .start();
    let port = server.port();
    let started = Instant::now();
    let mut held = Vec::new();
    let mut refused = 0;
    for i in 0..NOFILE as usize + 50 {
        let t = Instant::now();
        // No request: a response's file would be the descriptor that fails first.
        match handshaken_client(port) {
            Ok(c) => held.push(c),
            Err(e) => {
                assert!(
                    t.elapsed() < Duration::from_secs(2),
                    "connection {i} waited {:?} before it failed: {e}",
                    t.elapsed()
                );
                refused += 1;
            }
        }
    }
    assert!(refused >= 10, "only {refused} connections failed");
    let elapsed = started.elapsed();
    let warnings = accept_warnings(&server);
    let lines = server.stderr_lines();
    drop(held);
    let stats = server.stop();
    assert!(
        stats["accept_emfile"] >= refused as u64,
        "{refused} refused: {stats:?}"
    );
    assert!(
        warnings <= elapsed.as_secs() as usize + 1,
        "{warnings} accept warnings in {elapsed:?}"
    );
    assert!(!lines.iter().any(|l| l.contains("panicked")));
}
