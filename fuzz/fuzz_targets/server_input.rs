//! Arbitrary bytes from a client, split into writes at arbitrary points, into the server-side
//! TLS driver: either from the first byte (the handshake), or after a real handshake (the user
//! plane's record layer). A panic anywhere in tlsplane or rustls is a crash.
//!
//! Input: byte 0 chooses the phase (even: handshake, odd: after a TLS 1.3 handshake, or TLS
//! 1.2 when bit 1 is set), byte 1 the write sizes; the rest is what the client sends.
#![no_main]

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

struct Fixture {
    rt: tokio::runtime::Runtime,
    listener: tokio::net::TcpListener,
    acceptor: tlsplane::Acceptor,
    client13: Arc<rustls::ClientConfig>,
    client12: Arc<rustls::ClientConfig>,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("tlsplane-fuzz-{}", std::process::id()));
        let g = tlsplane::cert::ensure_localhost_cert(&dir).expect("certificate");
        let cert = tlsplane::cert::load_pem(&g.cert, &g.key).expect("load");
        let mut opts = tlsplane::ServerOptions::new(cert);
        opts.policy = tlsplane::DataPlanePolicy::User;
        opts.plain_http_response = Some(b"HTTP/1.1 400 Bad Request\r\n\r\n".to_vec().into());
        let acceptor = tlsplane::Acceptor::new(opts).expect("acceptor");
        let mut roots = rustls::RootCertStore::empty();
        let ca = std::fs::read(&g.ca).expect("ca");
        for c in rustls_pki_types::pem::PemObject::pem_slice_iter(&ca) {
            roots.add(c.expect("ca pem")).expect("root");
        }
        let _ = std::fs::remove_dir_all(&dir);
        let client = |v: &'static rustls::SupportedProtocolVersion| {
            Arc::new(
                rustls::ClientConfig::builder_with_provider(Arc::new(
                    rustls::crypto::aws_lc_rs::default_provider(),
                ))
                .with_protocol_versions(&[v])
                .expect("versions")
                .with_root_certificates(roots.clone())
                .with_no_client_auth(),
            )
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let listener = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .expect("listen");
        Fixture {
            rt,
            listener,
            acceptor,
            client13: client(&rustls::version::TLS13),
            client12: client(&rustls::version::TLS12),
        }
    })
}

async fn send_split(
    w: &mut (impl AsyncWriteExt + Unpin),
    mut data: &[u8],
    sizes: u8,
) -> std::io::Result<()> {
    let mut step = (sizes as usize % 7) + 1;
    while !data.is_empty() {
        let n = (step * 37 % 300 + 1).min(data.len());
        w.write_all(&data[..n]).await?;
        w.flush().await?;
        data = &data[n..];
        step += sizes as usize | 1;
    }
    Ok(())
}

fuzz_target!(|input: &[u8]| {
    if input.len() < 2 {
        return;
    }
    let (mode, sizes, payload) = (input[0], input[1], &input[2..]);
    let f = fixture();
    f.rt.block_on(async {
        let addr = f.listener.local_addr().expect("addr");
        let client = async {
            let mut tcp = tokio::net::TcpStream::connect(addr).await?;
            if mode & 1 == 1 {
                let config = if mode & 2 == 0 {
                    &f.client13
                } else {
                    &f.client12
                };
                let name = rustls_pki_types::ServerName::try_from("localhost").expect("name");
                let tls = tokio_rustls::TlsConnector::from(config.clone())
                    .connect(name, tcp)
                    .await?;
                tcp = tls.into_inner().0;
            }
            let _ = send_split(&mut tcp, payload, sizes).await;
            let _ = tcp.shutdown().await;
            let mut sink = vec![0u8; 4096];
            while tcp.read(&mut sink).await.unwrap_or(0) > 0 {}
            std::io::Result::Ok(())
        };
        let server = async {
            let (tcp, _) = f.listener.accept().await.expect("accept");
            if let Ok(mut tls) = f.acceptor.accept(tcp).await {
                let mut buf = vec![0u8; 16384];
                while let Ok(n) = tls.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                }
                let _ = tls.shutdown().await;
            }
        };
        let _ = tokio::time::timeout(Duration::from_secs(5), async {
            tokio::join!(client, server)
        })
        .await;
    });
});
