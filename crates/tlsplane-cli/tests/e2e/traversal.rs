//! Test 5: no way out of the document root, by dot segments (plain or percent-encoded), empty
//! segments, or symlinks leading outside.

use crate::support::client::{End, Tls};
use crate::support::fixtures;
use crate::support::Server;

use super::http::{raw_exchange, status_of};

#[test]
fn traversal_is_refused() {
    let fx = fixtures::get();
    let passwd = std::fs::read_to_string("/etc/passwd").expect("reading /etc/passwd");
    let passwd_line = passwd
        .lines()
        .find(|l| !l.trim().is_empty())
        .expect("a line of /etc/passwd")
        .to_string();
    let server = Server::start();
    let targets = [
        "/../etc/passwd",
        "/%2e%2e/%2e%2e/etc/passwd",
        "/%2E%2E/%2E%2E/%2E%2E/%2E%2E/etc/passwd",
        "/..%2f..%2fetc/passwd",
        "/..%2f..%2f..%2f..%2f..%2fetc%2fpasswd",
        "//etc/passwd",
        "/etc/passwd",
        "/etc/./passwd",
        "/passwd",
        "/../secret.txt",
        "/%2e%2e/secret.txt",
        "/%2e%2e%2fsecret.txt",
        "/sub/../../secret.txt",
        "/sub/%2e%2e/%2e%2e/secret.txt",
        "/secret-link.txt",
        "/./../secret.txt",
        "/..%5csecret.txt",
        "/%00/../secret.txt",
    ];
    for (i, t) in targets.iter().enumerate() {
        let v = if i % 2 == 0 { Tls::V13 } else { Tls::V12 };
        let req = format!("GET {t} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
        let (raw, end) = raw_exchange(server.port(), v, req.as_bytes());
        let status = status_of(&raw);
        let text = String::from_utf8_lossy(&raw);
        assert!(
            (400..500).contains(&status),
            "GET {t}: status {status}, want 4xx; response:\n{text}"
        );
        assert!(
            !text.contains(&passwd_line),
            "GET {t}: /etc/passwd content leaked:\n{text}"
        );
        assert!(
            !text.contains("root:"),
            "GET {t}: /etc/passwd-like content leaked:\n{text}"
        );
        assert!(
            !text.contains(fx.secret_marker),
            "GET {t}: the file outside the root leaked:\n{text}"
        );
        assert!(matches!(end, End::CloseNotify), "GET {t}: {end:?}");
    }
    // Inside the root, a dot segment that stays inside still works (or is refused), never escapes.
    let req = "GET /sub/../hello.txt HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";
    let (raw, _) = raw_exchange(server.port(), Tls::V13, req.as_bytes());
    let status = status_of(&raw);
    assert!(
        status == 200 || (400..500).contains(&status),
        "GET /sub/../hello.txt: {status}"
    );
    if status == 200 {
        assert!(raw.ends_with(fixtures::HELLO));
    }
    let stats = server.stop();
    assert!(stats["http_responses_4xx"] >= targets.len() as u64);
}
