//! Test 9: SIGTERM during a large response: no new connections, the response completes intact,
//! the connection then ends with close_notify and the server exits 0 well within its grace.

use std::time::{Duration, Instant};

use aws_lc_rs::digest;

use crate::support::client::{End, TlsClient, BOTH};
use crate::support::fixtures;
use crate::support::{get_request, Server};

#[test]
fn sigterm_during_64mib_response() {
    let fx = fixtures::get();
    let big = fx.big();
    for v in BOTH {
        // Long enough for 64 MiB through an emulated guest that shares its cores.
        let grace = 60;
        // The first response is answered on the handshake loop; after SIGTERM it must be
        // given the grace, not the (shorter) handshake timeout.
        let mut server = Server::builder()
            .shutdown_grace(grace)
            .arg("--handshake-timeout")
            .arg("1")
            .start();
        let port = server.port();
        let mut c = TlsClient::connect_version(port, v);
        c.write_all(&get_request(&big.url, "")).expect("request");
        let (status, headers) = c.read_head().expect("head");
        assert_eq!(status, 200);
        assert!(headers
            .iter()
            .any(|(k, val)| k == "content-length" && *val == big.size.to_string()));
        let mut ctx = digest::Context::new(&digest::SHA256);
        let mut got = 0u64;
        // Read slowly: 2 MiB over ~0.5 s, then signal, then keep reading slowly for longer
        // than the handshake timeout (6 MiB over ~1.5 s).
        let slow = |c: &mut TlsClient, ctx: &mut digest::Context, got: &mut u64, n: u64| {
            for _ in 0..(n / (256 << 10)) {
                c.read_body_with(256 << 10, |b| ctx.update(b))
                    .expect("body");
                *got += 256 << 10;
                std::thread::sleep(Duration::from_millis(60));
            }
        };
        slow(&mut c, &mut ctx, &mut got, 2 << 20);
        server.terminate();
        let signalled = Instant::now();
        slow(&mut c, &mut ctx, &mut got, 6 << 20);
        // The listener closes promptly: new connections are refused.
        let deadline = Instant::now() + Duration::from_secs(3);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            assert!(
                Instant::now() < deadline,
                "{v:?}: new connections still accepted 3 s after SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        c.read_body_with(big.size - got, |b| ctx.update(b))
            .unwrap_or_else(|e| {
                panic!("{v:?}: the in-flight response broke off after SIGTERM: {e}")
            });
        let body_done = Instant::now();
        assert!(
            ctx.finish().as_ref() == big.sha256,
            "{v:?}: the 64 MiB body differs from the file"
        );
        let (rest, end) = c.read_to_end();
        let closed = Instant::now();
        assert!(rest.is_empty(), "{v:?}: data after the body");
        assert!(
            matches!(end, End::CloseNotify) && closed - body_done < Duration::from_secs(3),
            "{v:?}: after the response in flight at SIGTERM, the server must close the connection with close_notify \
             promptly; got {end:?} {:?} after the body ({:?} after SIGTERM, grace {grace} s)",
            closed - body_done,
            signalled.elapsed()
        );
        // A client closes on the end of the stream; until then the server lingers (reading
        // what the client may still send) and the connection is in flight.
        drop(c);
        let status = server.wait_exit(Duration::from_secs(5));
        assert!(
            status.is_some(),
            "{v:?}: the server still runs {:?} after SIGTERM, with nothing left in flight",
            signalled.elapsed()
        );
        assert!(
            status.is_some_and(|s| s.success()),
            "{v:?}: exit {status:?}"
        );
        assert!(
            signalled.elapsed() < Duration::from_secs(grace),
            "{v:?}: exit only after the grace period"
        );
        let stats = server.stop();
        assert_eq!(stats["http_requests"], 1);
        assert_eq!(stats["http_io_errors"], 0, "{v:?}: {stats:?}");
    }
}
