//! ALPN: what serve and both proxy modes offer (`--alpn`, a site's `alpn` key, the products'
//! defaults), and the alert a client offering nothing the server speaks gets.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use crate::support::client::Tls;
use crate::support::fixtures::{self, CertKind, HELLO};
use crate::support::tools::{self, require};
use crate::support::Server;

/// `openssl s_client` offering `alpn` (none if empty), sending `input`; its output.
fn s_client(port: u16, v: Tls, alpn: &str, input: &[u8]) -> tools::Output {
    let mut o = std::process::Command::new("openssl");
    o.args(["s_client", "-connect"])
        .arg(format!("127.0.0.1:{port}"))
        .args(["-servername", "localhost", "-CAfile"])
        .arg(&fixtures::pki().ca_pem)
        .arg(v.openssl_flag());
    if !alpn.is_empty() {
        o.args(["-alpn", alpn]);
    }
    // -ign_eof: read until the server closes, after the input.
    o.arg("-ign_eof");
    tools::run(o, input, Duration::from_secs(20))
}

const GET_HELLO_1_0: &[u8] = b"GET /hello.txt HTTP/1.0\r\n\r\n";

#[test]
fn a_client_offering_no_protocol_the_server_speaks_gets_no_application_protocol() {
    require("openssl");
    let server = Server::start();
    for v in [Tls::V13, Tls::V12] {
        for offer in ["h2", "spdy/3,h2"] {
            let out = s_client(server.port(), v, offer, b"");
            let err = out.stderr_text();
            assert!(
                err.contains("no application protocol"),
                "{v:?} -alpn {offer}: no alert: {}",
                out.describe()
            );
        }
    }
    server.stop();
}

#[test]
fn serve_speaks_http_1_0_by_alpn() {
    require("openssl");
    require("curl");
    let server = Server::start();
    let out = s_client(server.port(), Tls::V13, "http/1.0", GET_HELLO_1_0);
    assert!(
        out.stdout_text().contains("ALPN protocol: http/1.0"),
        "{}",
        out.describe()
    );
    let (status, _, body) = tools::split_http(
        &out.stdout[out
            .stdout
            .windows(9)
            .position(|w| w == b"HTTP/1.1 ")
            .expect("a response")..],
    );
    // s_client prints its session after what it read.
    assert!(
        status == 200 && body.starts_with(HELLO),
        "{}",
        out.describe()
    );
    // curl --http1.0 offers only http/1.0.
    let mut c = Tls::V13.curl(server.port(), 10);
    c.arg("--http1.0")
        .arg(format!("https://localhost:{}/hello.txt", server.port()));
    let out = tools::run(c, b"", Duration::from_secs(20));
    assert!(out.status.success(), "curl --http1.0: {}", out.describe());
    assert_eq!(out.stdout, HELLO);
    // And HTTP/1.1 is still preferred when offered with it.
    let out = s_client(server.port(), Tls::V12, "http/1.0,http/1.1", GET_HELLO_1_0);
    assert!(
        out.stdout_text().contains("ALPN protocol: http/1.1"),
        "{}",
        out.describe()
    );
    server.stop();
}

#[test]
fn alpn_flag_sets_what_is_offered_and_http_products_refuse_others() {
    require("openssl");
    let server = Server::builder().arg("--alpn").arg("http/1.0").start();
    let out = s_client(server.port(), Tls::V13, "http/1.1", b"");
    assert!(
        out.stderr_text().contains("no application protocol"),
        "{}",
        out.describe()
    );
    let out = s_client(server.port(), Tls::V13, "http/1.1,http/1.0", GET_HELLO_1_0);
    assert!(
        out.stdout_text().contains("ALPN protocol: http/1.0"),
        "{}",
        out.describe()
    );
    server.stop();
    // serve speaks HTTP/1, and h2 when named (docs/HTTP2.md), nothing else: any other id
    // would have clients speak what it cannot read. HTTP mode of the proxy too.
    let leaf = fixtures::pki().leaf(CertKind::P256);
    let start = |product: &[&str], alpn: &str| {
        std::process::Command::new(crate::support::server_bin())
            .args(product)
            .args(["--keyd", "off", "--listen", "127.0.0.1:0", "--alpn", alpn])
            .arg("--cert")
            .arg(&leaf.cert_pem)
            .arg("--key")
            .arg(&leaf.key_pem)
            .output()
            .expect("run")
    };
    let www = fixtures::get().www.to_string_lossy().into_owned();
    for (product, alpn, refused, speaks) in [
        (
            vec!["serve", www.as_str()],
            "h2,spdy/3,http/1.1",
            "\"spdy/3\"",
            "HTTP/2 and HTTP/1 only",
        ),
        (
            vec!["proxy", "--mode", "http", "--to", "127.0.0.1:9"],
            "h2,http/1.1,spdy/3",
            "\"spdy/3\"",
            "HTTP/2 and HTTP/1 only",
        ),
    ] {
        let out = start(&product, alpn);
        assert!(!out.status.success(), "{product:?} --alpn {alpn} started");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(refused) && err.contains(speaks),
            "{product:?}: {err}"
        );
    }
}

/// A TCP backend that answers every connection with `banner` and closes.
fn banner_backend(banner: &'static [u8]) -> std::net::SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { break };
            std::thread::spawn(move || {
                let _ = c.write_all(banner);
                let _ = c.shutdown(std::net::Shutdown::Write);
                let mut sink = [0u8; 1024];
                while matches!(c.read(&mut sink), Ok(n) if n > 0) {}
                drop::<TcpStream>(c);
            });
        }
    });
    addr
}

#[test]
fn the_tcp_proxy_offers_no_alpn_unless_told() {
    require("openssl");
    let backend = banner_backend(b"SSH-2.0-backend\r\n");
    let server = Server::builder().proxy(&[backend.to_string()]).start();
    // A client offering a protocol the proxy knows nothing of is passed to the backend.
    for (v, offer) in [(Tls::V13, "h2"), (Tls::V12, "imap"), (Tls::V13, "")] {
        let out = s_client(server.port(), v, offer, b"");
        assert!(
            out.stdout_text().contains("SSH-2.0-backend"),
            "{v:?} -alpn {offer:?}: {}",
            out.describe()
        );
        assert!(
            out.stdout_text().contains("No ALPN negotiated"),
            "{}",
            out.describe()
        );
    }
    server.stop();
    let server = Server::builder()
        .proxy(&[backend.to_string()])
        .arg("--alpn")
        .arg("imap,h2")
        .start();
    let out = s_client(server.port(), Tls::V13, "h2,imap", b"");
    assert!(
        out.stdout_text().contains("ALPN protocol: imap"),
        "{}",
        out.describe()
    );
    let out = s_client(server.port(), Tls::V13, "http/1.1", b"");
    assert!(
        out.stderr_text().contains("no application protocol"),
        "{}",
        out.describe()
    );
    server.stop();
}
