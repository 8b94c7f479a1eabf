//! A blocking rustls client (aws-lc-rs provider) over std's TcpStream, with its own I/O loop
//! so tests can watch every TLS record written and read, plus a small HTTP/1.1 response
//! reader that keeps leftovers (pipelining).

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use rustls::client::ClientConnection;
use rustls::crypto::{aws_lc_rs as provider, CryptoProvider, SupportedKxGroup};
use rustls::{ClientConfig, RootCertStore, SupportedCipherSuite};
use rustls_pki_types::ServerName;

use super::fixtures;

/// TLS version under test.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tls {
    V12,
    V13,
}

pub const BOTH: [Tls; 2] = [Tls::V13, Tls::V12];

impl Tls {
    pub fn rustls(self) -> &'static rustls::SupportedProtocolVersion {
        match self {
            Tls::V12 => &rustls::version::TLS12,
            Tls::V13 => &rustls::version::TLS13,
        }
    }

    pub fn protocol(self) -> rustls::ProtocolVersion {
        match self {
            Tls::V12 => rustls::ProtocolVersion::TLSv1_2,
            Tls::V13 => rustls::ProtocolVersion::TLSv1_3,
        }
    }

    /// As OpenSSL and curl print it.
    pub fn name(self) -> &'static str {
        match self {
            Tls::V12 => "TLSv1.2",
            Tls::V13 => "TLSv1.3",
        }
    }

    /// curl pinned to this version, trusting the test CA, with `localhost:port` resolved to
    /// 127.0.0.1 and the whole transfer limited to `max_time` seconds; verbose, so that stderr
    /// reports what was negotiated. The caller adds the URL (and any suite option).
    pub fn curl(self, port: u16, max_time: u32) -> std::process::Command {
        let mut cmd = std::process::Command::new("curl");
        cmd.args([
            "-sS",
            "-v",
            "--fail",
            "--http1.1",
            "--connect-timeout",
            "10",
        ])
        .args(["--max-time", &max_time.to_string(), "--cacert"])
        .arg(&fixtures::pki().ca_pem)
        .args(["--resolve", &format!("localhost:{port}:127.0.0.1")])
        .args(match self {
            Tls::V12 => ["--tlsv1.2", "--tls-max", "1.2"],
            Tls::V13 => ["--tlsv1.3", "--tls-max", "1.3"],
        });
        cmd
    }

    pub fn openssl_flag(self) -> &'static str {
        match self {
            Tls::V12 => "-tls1_2",
            Tls::V13 => "-tls1_3",
        }
    }
}

/// What the client offers.
#[derive(Clone)]
pub struct ClientOpts {
    pub versions: Vec<Tls>,
    pub groups: Option<Vec<&'static dyn SupportedKxGroup>>,
    pub suites: Option<Vec<SupportedCipherSuite>>,
}

impl ClientOpts {
    pub fn version(v: Tls) -> Self {
        Self {
            versions: vec![v],
            groups: None,
            suites: None,
        }
    }

    pub fn config(&self) -> Arc<ClientConfig> {
        let base = provider::default_provider();
        let provider = CryptoProvider {
            kx_groups: self.groups.clone().unwrap_or(base.kx_groups.clone()),
            cipher_suites: self.suites.clone().unwrap_or(base.cipher_suites.clone()),
            ..base
        };
        let mut roots = RootCertStore::empty();
        roots
            .add(fixtures::pki().ca_der.clone())
            .expect("adding the test CA");
        let versions: Vec<_> = self.versions.iter().map(|v| v.rustls()).collect();
        let mut config = ClientConfig::builder_with_provider(Arc::new(provider))
            .with_protocol_versions(&versions)
            .expect("client protocol versions")
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Arc::new(config)
    }
}

/// Parses a byte stream into TLS record headers as it passes.
#[derive(Default, Debug, Clone)]
pub struct RecordLog {
    /// (content type, payload length) of every complete record header seen.
    pub records: Vec<(u8, u16)>,
    pending: Vec<u8>,
    /// Payload bytes of the current record still to skip.
    skip: usize,
}

impl RecordLog {
    pub fn feed(&mut self, mut data: &[u8]) {
        while !data.is_empty() {
            if self.skip > 0 {
                let n = self.skip.min(data.len());
                self.skip -= n;
                data = &data[n..];
                continue;
            }
            let need = 5 - self.pending.len();
            let n = need.min(data.len());
            self.pending.extend_from_slice(&data[..n]);
            data = &data[n..];
            if self.pending.len() == 5 {
                let len = u16::from_be_bytes([self.pending[3], self.pending[4]]);
                self.records.push((self.pending[0], len));
                self.skip = len as usize;
                self.pending.clear();
            }
        }
    }

    /// Records of one buffer that holds whole records only.
    pub fn parse(buf: &[u8]) -> Vec<(u8, u16)> {
        let mut l = RecordLog::default();
        l.feed(buf);
        assert!(
            l.pending.is_empty() && l.skip == 0,
            "buffer does not end on a record boundary"
        );
        l.records
    }
}

/// The socket as rustls sees it: every write (a vectored write is one socket write) and every
/// inbound record is logged.
pub struct Io {
    pub sock: TcpStream,
    pub writes: Vec<Vec<u8>>,
    pub inbound: RecordLog,
}

impl Read for Io {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.sock.read(buf)?;
        self.inbound.feed(&buf[..n]);
        Ok(n)
    }
}

impl Write for Io {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_vectored(&[io::IoSlice::new(buf)])
    }

    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        let mut all = Vec::new();
        for b in bufs {
            all.extend_from_slice(b);
        }
        self.sock.write_all(&all)?;
        let n = all.len();
        self.writes.push(all);
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.sock.flush()
    }
}

/// How a connection ended, seen from the client.
#[derive(Debug)]
pub enum End {
    /// close_notify, then EOF: a clean TLS close.
    CloseNotify,
    /// TCP EOF without close_notify.
    TruncatedEof,
    /// The server sent a fatal alert.
    Alert(rustls::AlertDescription),
    /// Another TLS error.
    Tls(rustls::Error),
    /// A socket error (reset, timeout...).
    Io(io::ErrorKind, String),
}

impl End {
    fn from_io(e: io::Error) -> End {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            return End::TruncatedEof;
        }
        if let Some(t) = e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()) {
            return match t {
                rustls::Error::AlertReceived(a) => End::Alert(*a),
                other => End::Tls(other.clone()),
            };
        }
        if matches!(
            e.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
        ) {
            return End::Io(
                io::ErrorKind::TimedOut,
                format!("the server sent nothing for {READ_TIMEOUT:?}"),
            );
        }
        End::Io(e.kind(), e.to_string())
    }
}

#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn content_length(&self) -> Option<u64> {
        self.header("content-length").map(|v| {
            v.parse()
                .unwrap_or_else(|_| panic!("bad Content-Length {v:?}"))
        })
    }
}

pub struct TlsClient {
    pub conn: ClientConnection,
    pub io: Io,
    /// Inbound records that belong to the handshake (see `handshake`).
    pub handshake_records_in: usize,
    /// Decrypted bytes not yet consumed by the HTTP reader.
    plain: Vec<u8>,
}

/// Longest wait for any single read or write: fail fast when the server stalls.
pub const READ_TIMEOUT: Duration = Duration::from_secs(10);

pub fn tcp_connect(port: u16) -> TcpStream {
    let sock = TcpStream::connect(("127.0.0.1", port))
        .unwrap_or_else(|e| panic!("connect to 127.0.0.1:{port}: {e}"));
    with_timeouts(sock)
}

/// Connects to 127.0.0.1:`port` from the loopback address `source` (e.g. 127.0.0.2), as a
/// second client would.
pub fn tcp_connect_from(source: std::net::Ipv4Addr, port: u16) -> io::Result<TcpStream> {
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
    s.bind(&std::net::SocketAddr::from((source, 0)).into())?;
    s.connect(&std::net::SocketAddr::from(([127, 0, 0, 1], port)).into())?;
    Ok(with_timeouts(s.into()))
}

fn with_timeouts(sock: TcpStream) -> TcpStream {
    sock.set_read_timeout(Some(READ_TIMEOUT))
        .expect("read timeout");
    sock.set_write_timeout(Some(READ_TIMEOUT))
        .expect("write timeout");
    sock.set_nodelay(true).expect("nodelay");
    sock
}

impl TlsClient {
    /// TCP connect and a ClientConnection, without handshaking yet.
    pub fn new(port: u16, config: Arc<ClientConfig>) -> TlsClient {
        Self::over(tcp_connect(port), config)
    }

    /// A TLS client over an already connected socket (not handshaken yet).
    pub fn over(sock: TcpStream, config: Arc<ClientConfig>) -> TlsClient {
        let conn = ClientConnection::new(
            config,
            ServerName::try_from("localhost").expect("name").to_owned(),
        )
        .expect("client connection");
        TlsClient {
            conn,
            io: Io {
                sock,
                writes: Vec::new(),
                inbound: RecordLog::default(),
            },
            handshake_records_in: 0,
            plain: Vec::new(),
        }
    }

    /// Connects and completes the handshake.
    pub fn connect(port: u16, opts: &ClientOpts) -> TlsClient {
        Self::connect_with(port, opts.config())
    }

    pub fn connect_with(port: u16, config: Arc<ClientConfig>) -> TlsClient {
        let mut c = Self::new(port, config);
        c.handshake()
            .unwrap_or_else(|e| panic!("handshake with 127.0.0.1:{port} failed: {e:?}"));
        c
    }

    pub fn connect_version(port: u16, v: Tls) -> TlsClient {
        Self::connect(port, &ClientOpts::version(v))
    }

    /// Writes whatever rustls has queued.
    pub fn flush_tls(&mut self) -> io::Result<()> {
        while self.conn.wants_write() {
            self.conn.write_tls(&mut self.io)?;
        }
        Ok(())
    }

    /// Reads once from the socket into rustls and processes it. Ok(0) is TCP EOF.
    pub fn read_tls_once(&mut self) -> io::Result<usize> {
        let n = self.conn.read_tls(&mut self.io)?;
        self.conn
            .process_new_packets()
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        Ok(n)
    }

    /// Completes the handshake. The server sends nothing but its handshake flight before our
    /// Finished, so the inbound records counted here are exactly the handshake's.
    pub fn handshake(&mut self) -> Result<(), End> {
        loop {
            self.flush_tls().map_err(End::from_io)?;
            if !self.conn.is_handshaking() {
                break;
            }
            match self.read_tls_once() {
                Ok(0) => return Err(End::TruncatedEof),
                Ok(_) => {}
                Err(e) => return Err(End::from_io(e)),
            }
        }
        self.handshake_records_in = self.io.inbound.records.len();
        Ok(())
    }

    pub fn write_all(&mut self, data: &[u8]) -> io::Result<()> {
        self.conn.writer().write_all(data)?;
        self.flush_tls()
    }

    /// Queues a close_notify and sends it.
    pub fn send_close_notify(&mut self) -> io::Result<()> {
        self.conn.send_close_notify();
        self.flush_tls()
    }

    /// Reads some plaintext (first from the HTTP leftovers). Ok(0) only after close_notify.
    pub fn read_plain(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if !self.plain.is_empty() {
            let n = buf.len().min(self.plain.len());
            buf[..n].copy_from_slice(&self.plain[..n]);
            self.plain.drain(..n);
            return Ok(n);
        }
        loop {
            match self.conn.reader().read(buf) {
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
            self.flush_tls()?;
            self.read_tls_once()?;
        }
    }

    /// Reads until the connection ends; returns the plaintext and how it ended.
    pub fn read_to_end(&mut self) -> (Vec<u8>, End) {
        let mut out = std::mem::take(&mut self.plain);
        let mut buf = vec![0u8; 65536];
        loop {
            match self.read_plain(&mut buf) {
                Ok(0) => return (out, End::CloseNotify),
                Ok(n) => out.extend_from_slice(&buf[..n]),
                Err(e) => return (out, End::from_io(e)),
            }
        }
    }

    /// Appends more decrypted bytes to the HTTP leftovers.
    fn fill(&mut self) -> io::Result<()> {
        let mut buf = [0u8; 16384];
        loop {
            match self.conn.reader().read(&mut buf) {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::ConnectionAborted,
                        "close_notify before the end of the response",
                    ))
                }
                Ok(n) => {
                    self.plain.extend_from_slice(&buf[..n]);
                    return Ok(());
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
            self.flush_tls()?;
            self.read_tls_once()?;
        }
    }

    /// Reads a response head; returns status and headers (names lowercased).
    pub fn read_head(&mut self) -> io::Result<(u16, Vec<(String, String)>)> {
        let end = loop {
            if let Some(p) = self.plain.windows(4).position(|w| w == b"\r\n\r\n") {
                break p;
            }
            self.fill()?;
        };
        let head = String::from_utf8(self.plain[..end].to_vec())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "non-UTF-8 head"))?;
        self.plain.drain(..end + 4);
        let mut lines = head.split("\r\n");
        let status_line = lines.next().unwrap_or_default();
        assert!(
            status_line.starts_with("HTTP/1.1 "),
            "bad status line {status_line:?}"
        );
        let status = status_line[9..12]
            .parse()
            .unwrap_or_else(|_| panic!("bad status line {status_line:?}"));
        let headers = lines
            .map(|l| {
                let (k, v) = l
                    .split_once(':')
                    .unwrap_or_else(|| panic!("bad header line {l:?}"));
                (k.trim().to_ascii_lowercase(), v.trim().to_string())
            })
            .collect();
        Ok((status, headers))
    }

    /// Reads exactly `n` body bytes, handing them to `sink` as they come.
    pub fn read_body_with(&mut self, mut n: u64, mut sink: impl FnMut(&[u8])) -> io::Result<()> {
        while n > 0 {
            if self.plain.is_empty() {
                self.fill()?;
            }
            let take = (self.plain.len() as u64).min(n) as usize;
            sink(&self.plain[..take]);
            self.plain.drain(..take);
            n -= take as u64;
        }
        Ok(())
    }

    /// Reads one response; `head_only` for HEAD requests (no body whatever the headers say).
    pub fn read_response(&mut self, head_only: bool) -> io::Result<Response> {
        let (status, headers) = self.read_head()?;
        let mut resp = Response {
            status,
            headers,
            body: Vec::new(),
        };
        let has_body = !head_only && status != 304 && status != 204 && status >= 200;
        if has_body {
            let len = resp.content_length().unwrap_or_else(|| {
                panic!(
                    "response {status} without Content-Length: {:?}",
                    resp.headers
                )
            });
            let mut body = Vec::with_capacity(len as usize);
            self.read_body_with(len, |b| body.extend_from_slice(b))?;
            resp.body = body;
        }
        Ok(resp)
    }

    /// Sends a GET and reads its response.
    pub fn get(&mut self, path: &str) -> Response {
        self.write_all(&super::get_request(path, ""))
            .expect("sending a request");
        self.read_response(false)
            .unwrap_or_else(|e| panic!("reading the response to GET {path}: {e}"))
    }

    /// A polite close: our close_notify, then the server's close_notify and EOF, nothing else.
    /// (Dropping the socket instead races with a SIGTERM that follows: the server may be
    /// closing the idle connection while our FIN/RST arrives.)
    pub fn close(mut self) {
        self.send_close_notify().expect("sending close_notify");
        let (rest, end) = self.read_to_end();
        assert!(
            rest.is_empty(),
            "{} bytes of data after our close_notify",
            rest.len()
        );
        assert!(
            matches!(end, End::CloseNotify),
            "the server must answer close_notify with close_notify: {end:?}"
        );
    }

    /// Bytes of decrypted data received but not consumed.
    pub fn leftover(&self) -> &[u8] {
        &self.plain
    }
}

/// One GET on a fresh connection, closed politely.
pub fn fetch(port: u16, v: Tls, path: &str) -> Response {
    let mut c = TlsClient::connect_version(port, v);
    let resp = c.get(path);
    c.close();
    resp
}

/// Asserts a 200 with exactly the file's content.
pub fn assert_file_body(resp: &Response, f: &fixtures::DocFile, what: &str) {
    assert_eq!(resp.status, 200, "{what}: status for {}", f.url);
    assert_eq!(
        resp.content_length(),
        Some(f.size),
        "{what}: Content-Length for {}",
        f.url
    );
    assert_eq!(
        resp.body.len() as u64,
        f.size,
        "{what}: body length for {}",
        f.url
    );
    assert!(
        fixtures::sha256(&resp.body) == f.sha256,
        "{what}: SHA-256 of {} differs from the file",
        f.url
    );
}
