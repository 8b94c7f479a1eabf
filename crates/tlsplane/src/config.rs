//! Server configuration: the rustls `ServerConfig` tlsplane needs, and the data-plane policy.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use rustls::crypto::aws_lc_rs::{self as provider, cipher_suite as cs, kx_group};
use rustls::crypto::CryptoProvider;
use rustls::server::{ProducesTickets, StoresServerSessions};
use rustls::sign::CertifiedKey;
use rustls::ServerConfig;

use crate::probe::KernelSupport;
use crate::sites::{SiteCerts, SiteNames, UnknownName};
use crate::tickets::TicketKeyRing;
use crate::Error;

/// Where application records should be encrypted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DataPlanePolicy {
    /// Kernel when it can take the connection, user space otherwise (per connection).
    #[default]
    Auto,
    /// Kernel only: refuse to start without a TLS ULP, and close connections it cannot take.
    Kernel,
    /// Always user space.
    User,
}

impl FromStr for DataPlanePolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "kernel" => Ok(Self::Kernel),
            "user" => Ok(Self::User),
            other => Err(format!(
                "unknown data plane {other:?} (expected auto, kernel or user)"
            )),
        }
    }
}

impl fmt::Display for DataPlanePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::Kernel => "kernel",
            Self::User => "user",
        })
    }
}

/// One site's TLS: its certificates and what it negotiates. Which site a connection is for is
/// decided by [`ServerOptions::names`].
#[derive(Clone, Debug)]
pub struct SiteTls {
    /// One chain per key type (e.g. ECDSA and RSA), most preferred first: see `sites::SiteCerts`.
    pub certs: Vec<Arc<CertifiedKey>>,
    /// ALPN protocols offered, most preferred first.
    pub alpn: Vec<Vec<u8>>,
    /// TLS versions accepted.
    pub versions: Vec<&'static rustls::SupportedProtocolVersion>,
}

impl SiteTls {
    /// A site with these certificates, HTTP/1.1 by ALPN, TLS 1.3 and 1.2.
    pub fn new(certs: Vec<Arc<CertifiedKey>>) -> Self {
        Self {
            certs,
            alpn: vec![b"http/1.1".to_vec()],
            versions: vec![&rustls::version::TLS13, &rustls::version::TLS12],
        }
    }
}

/// What a server needs to accept TLS connections.
#[derive(Clone)]
pub struct ServerOptions {
    /// The sites, by number (see `names`).
    pub sites: Vec<SiteTls>,
    /// Which site a server name is for (and the default site).
    pub names: Arc<SiteNames>,
    /// A ClientHello for no site (and no default site): see [`UnknownName`].
    pub unknown_name: UnknownName,
    pub policy: DataPlanePolicy,
    /// TLS 1.3 tickets sent after each full handshake (0 disables TLS 1.3 resumption).
    pub tls13_tickets: usize,
    /// Records encrypted under one key on the kernel plane before we re-key or close. `None`
    /// uses the suite's confidentiality limit (as rustls would); tests lower it.
    pub aead_record_limit: Option<u64>,
    /// Bytes to answer with when a client speaks plain HTTP to the TLS port (its first bytes
    /// are an HTTP method and a space), instead of the alert rustls would send; the product
    /// chooses them (e.g. a 400 saying to use https). `None`: treat it as any bad record.
    pub plain_http_response: Option<Arc<[u8]>>,
    /// Longest ClientHello accepted (its handshake message, bytes); a longer one is refused
    /// from its header with an illegal_parameter alert, before it is read or parsed.
    pub max_client_hello: usize,
    /// Records a ClientHello may span; one still incomplete after them is refused with an
    /// unexpected_message alert. Each record costs a read when a client sends them apart, and
    /// a real client needs one (two for a very large post-quantum hello).
    pub max_client_hello_records: usize,
    /// Session tickets (TLS 1.3 PSK identities) a ClientHello may offer; one offering more is
    /// refused with an illegal_parameter alert before rustls tries them, since it tries to
    /// open each in turn.
    pub max_psk_identities: usize,
    /// KeyUpdate messages a peer may send per second on the kernel plane (burst: as many),
    /// where each costs two setsockopt calls and a key schedule step; beyond it the
    /// connection ends with an unexpected_message alert (a KeyUpdate storm crashed HAProxy
    /// with kTLS, haproxy#3450). 0: unlimited. On the user plane rustls applies its own rule
    /// (at most 32 KeyUpdate requests without application data in between).
    pub key_updates_per_second: u32,
    /// How a closing connection (a last response, a refused handshake's alert) waits for the
    /// client's input before it closes: see [`crate::linger`].
    pub linger: crate::Linger,
    /// Read the client's handshake records after the server's first flight without going
    /// past the end of the handshake (a peek, then whole records up to its Finished), so
    /// that the application data a client sends right behind its Finished stays in the
    /// socket for the kernel to decrypt. For connections whose socket is handed to another
    /// program (which can only read what the socket holds). Costs one `MSG_PEEK` per client
    /// flight, and only on connections that may go to the kernel plane.
    pub exact_handshake_reads: bool,
    /// The ticketer of given session-ticket keys (`--ticket-keys`, a shared store), shared
    /// with the other servers that hold them and kept across restarts: see
    /// [`crate::tickets`]. Whoever gives it installs new keys in it. `None`: rustls makes
    /// random keys for this process (rotated every 6 hours, kept across reloads).
    pub ticket_keys: Option<Arc<TicketKeyRing>>,
}

/// The default KeyUpdate rate: GnuTLS allows 8 per second.
pub const DEFAULT_KEY_UPDATES_PER_SECOND: u32 = 8;

/// The default ClientHello cap: one full record. Browsers send 0.5-2 KB (~1.5 KB with an
/// X25519MLKEM768 key share); rustls itself would take up to 64 KiB.
pub const DEFAULT_MAX_CLIENT_HELLO: usize = 16384;

/// The default cap on the records a ClientHello may span. Clients send one record (two for a
/// hello over 16 KB); tools that fragment it to get past censoring middleboxes cut it at the
/// server name (2-3 records) or into ~100-byte records (~16 for a 1.6 KB hello). Each record
/// sent on its own costs the server a read and a wakeup: at 16, a hello in 1-byte records
/// costs about one full handshake of server CPU, where 16,000 of them cost hundreds
/// (docs/BENCHMARKS.md, "Trickled input").
pub const DEFAULT_MAX_CLIENT_HELLO_RECORDS: usize = 16;

/// Browsers and TLS libraries offer one session ticket (OpenSSL may add an external PSK):
/// rustls tries to open every identity offered until one resumes, each a key derivation and
/// an AEAD attempt, so a ClientHello of hundreds of made-up identities would cost many times
/// a full handshake.
pub const DEFAULT_MAX_PSK_IDENTITIES: usize = 4;

impl ServerOptions {
    /// One site, the default for every name, with this certificate.
    pub fn new(cert: Arc<CertifiedKey>) -> Self {
        Self {
            sites: vec![SiteTls::new(vec![cert])],
            names: Arc::new(SiteNames::new(&[Vec::new()], Some(0)).expect("no names, no clash")),
            unknown_name: UnknownName::default(),
            policy: DataPlanePolicy::Auto,
            tls13_tickets: 1,
            aead_record_limit: None,
            plain_http_response: None,
            max_client_hello: DEFAULT_MAX_CLIENT_HELLO,
            max_client_hello_records: DEFAULT_MAX_CLIENT_HELLO_RECORDS,
            max_psk_identities: DEFAULT_MAX_PSK_IDENTITIES,
            key_updates_per_second: DEFAULT_KEY_UPDATES_PER_SECOND,
            linger: crate::linger::DEFAULT_LINGER,
            exact_handshake_reads: false,
            ticket_keys: None,
        }
    }
}

/// The crypto provider: aws-lc-rs, restricted to the suites and groups tlsplane supports.
/// Every suite here is one Linux kTLS can also take (AES-GCM and ChaCha20-Poly1305), so the
/// kernel plane is never ruled out by negotiation alone.
///
/// The order is the server's preference (see `ignore_client_order` below): AES-128-GCM first.
/// Its SHA-256 transcript and key schedule run on SHA-NI, while the SHA-384 of the AES-256
/// suites has no hardware path on CPUs without SHA-512 instructions, where it is a large share
/// of a full TLS 1.3 handshake (docs/BENCHMARKS.md, "Where the time goes"); AES-128-GCM is
/// also what browsers prefer.
pub fn crypto_provider() -> CryptoProvider {
    CryptoProvider {
        cipher_suites: vec![
            cs::TLS13_AES_128_GCM_SHA256,
            cs::TLS13_AES_256_GCM_SHA384,
            cs::TLS13_CHACHA20_POLY1305_SHA256,
            cs::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
            cs::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,
            cs::TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256,
            cs::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,
            cs::TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384,
            cs::TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256,
        ],
        kx_groups: vec![
            kx_group::X25519MLKEM768,
            kx_group::X25519,
            kx_group::SECP256R1,
            kx_group::SECP384R1,
        ],
        ..provider::default_provider()
    }
}

/// [`crypto_provider`] as servers use it: the TLS 1.3 suites' decrypters also answer records
/// rustls would refuse without an alert (see `inner_type`).
fn server_crypto_provider() -> CryptoProvider {
    static SUITES: std::sync::OnceLock<Vec<rustls::SupportedCipherSuite>> =
        std::sync::OnceLock::new();
    let base = crypto_provider();
    let suites = SUITES.get_or_init(|| {
        base.cipher_suites
            .iter()
            .map(|s| crate::inner_type::checked(*s))
            .collect()
    });
    CryptoProvider {
        cipher_suites: suites.clone(),
        ..base
    }
}

/// Every site's ticketer, and the same as a ring when its keys are given (to install new ones).
type Ticketer = (Arc<dyn ProducesTickets>, Option<Arc<TicketKeyRing>>);

/// The ticketer: the ring given, or without one rustls's own (random keys made in this
/// process).
fn ticketer(ring: Option<Arc<TicketKeyRing>>) -> Result<Ticketer, Error> {
    Ok(match ring {
        Some(ring) => (ring.clone(), Some(ring)),
        None => (
            provider::Ticketer::new().map_err(|e| Error::Config(e.to_string()))?,
            None,
        ),
    })
}

/// Accepts TLS connections: holds each site's rustls configuration, the policy and what the
/// kernel can do. Cheap to share between workers (`Arc` inside).
#[derive(Clone)]
pub struct Acceptor {
    /// One rustls configuration per site, by site number.
    pub(crate) sites: Arc<[Arc<ServerConfig>]>,
    pub(crate) names: Arc<SiteNames>,
    pub(crate) unknown_name: UnknownName,
    /// Shared by every site and kept across reloads, so that tickets issued before a reload
    /// still resume after it.
    pub(crate) ticketer: Arc<dyn ProducesTickets>,
    /// The ticketer when the keys are given (`ServerOptions::ticket_keys`): a reload installs
    /// the keys read again into it.
    pub(crate) ticket_ring: Option<Arc<TicketKeyRing>>,
    /// TLS 1.2 session-ID resumption state, shared as the ticketer is.
    session_storage: Arc<dyn StoresServerSessions + Send + Sync>,
    pub(crate) policy: DataPlanePolicy,
    pub(crate) kernel: Arc<KernelSupport>,
    pub(crate) aead_record_limit: Option<u64>,
    pub(crate) plain_http_response: Option<Arc<[u8]>>,
    pub(crate) max_client_hello: usize,
    pub(crate) max_client_hello_records: usize,
    pub(crate) max_psk_identities: usize,
    pub(crate) key_updates_per_second: u32,
    /// Shared: every connection keeps a reference for its close (a copy would make each
    /// `TlsStream` larger).
    pub(crate) linger: Arc<crate::Linger>,
    pub(crate) exact_handshake_reads: bool,
}

impl Acceptor {
    /// Builds the acceptor. With [`DataPlanePolicy::Kernel`] this fails when the kernel has no
    /// TLS ULP, so a server asked for the kernel plane refuses to start rather than silently
    /// running in user space.
    pub fn new(opts: ServerOptions) -> Result<Self, Error> {
        let kernel = match opts.policy {
            DataPlanePolicy::User => KernelSupport::disabled("data plane set to user"),
            _ => KernelSupport::probe(),
        };
        Self::with_kernel_support(opts, kernel)
    }

    /// As [`Acceptor::new`] with an explicit kernel capability set (tests, forced fallbacks).
    pub fn with_kernel_support(opts: ServerOptions, kernel: KernelSupport) -> Result<Self, Error> {
        let (ticketer, ring) = ticketer(opts.ticket_keys.clone())?;
        let session_storage = rustls::server::ServerSessionMemoryCache::new(4096);
        Self::build(opts, Arc::new(kernel), (ticketer, ring), session_storage)
    }

    /// A new acceptor for a reloaded configuration: new sites and options, the same session
    /// ticket keys and session cache (clients resume across the reload), and the same kernel
    /// probe unless the data-plane policy changed.
    ///
    /// The same ticket-key ring stays (its owner installs new keys in it); a ring given now
    /// and not before, or the reverse, makes a new ticketer, and tickets issued before the
    /// reload then get full handshakes.
    pub fn reload(&self, opts: ServerOptions) -> Result<Self, Error> {
        let kernel = if opts.policy == self.policy {
            self.kernel.clone()
        } else {
            Arc::new(match opts.policy {
                DataPlanePolicy::User => KernelSupport::disabled("data plane set to user"),
                _ => KernelSupport::probe(),
            })
        };
        let ticketer = match (&opts.ticket_keys, &self.ticket_ring) {
            (Some(given), Some(held)) if Arc::ptr_eq(given, held) => {
                (self.ticketer.clone(), Some(held.clone()))
            }
            (None, None) => (self.ticketer.clone(), None),
            (given, _) => ticketer(given.clone())?,
        };
        Self::build(opts, kernel, ticketer, self.session_storage.clone())
    }

    fn build(
        opts: ServerOptions,
        kernel: Arc<KernelSupport>,
        (ticketer, ticket_ring): Ticketer,
        session_storage: Arc<dyn StoresServerSessions + Send + Sync>,
    ) -> Result<Self, Error> {
        if opts.policy == DataPlanePolicy::Kernel && !kernel.ulp {
            return Err(Error::Config(format!(
                "--data-plane kernel: this kernel cannot offload TLS ({}); use --data-plane auto or user, or load the `tls` module",
                kernel.reason
            )));
        }
        if opts.sites.is_empty() {
            return Err(Error::Config("no site to serve".into()));
        }
        let provider = Arc::new(server_crypto_provider());
        let mut sites = Vec::with_capacity(opts.sites.len());
        for (i, site) in opts.sites.into_iter().enumerate() {
            if site.certs.is_empty() {
                return Err(Error::Config(format!("site #{} has no certificate", i + 1)));
            }
            let mut config = ServerConfig::builder_with_provider(provider.clone())
                .with_protocol_versions(&site.versions)
                .map_err(|e| Error::Config(format!("site #{}: {e}", i + 1)))?
                .with_no_client_auth()
                .with_cert_resolver(Arc::new(SiteCerts { certs: site.certs }));
            config.alpn_protocols = site.alpn;
            config.enable_secret_extraction = true;
            config.ignore_client_order = true;
            config.send_tls13_tickets = opts.tls13_tickets;
            config.ticketer = ticketer.clone();
            config.session_storage = session_storage.clone();
            sites.push(Arc::new(config));
        }
        Ok(Self {
            sites: sites.into(),
            names: opts.names,
            unknown_name: opts.unknown_name,
            ticketer,
            ticket_ring,
            session_storage,
            policy: opts.policy,
            kernel,
            aead_record_limit: opts.aead_record_limit,
            plain_http_response: opts.plain_http_response,
            max_client_hello: opts.max_client_hello,
            max_client_hello_records: opts.max_client_hello_records,
            max_psk_identities: opts.max_psk_identities,
            key_updates_per_second: opts.key_updates_per_second,
            linger: Arc::new(opts.linger),
            exact_handshake_reads: opts.exact_handshake_reads,
        })
    }

    pub fn policy(&self) -> DataPlanePolicy {
        self.policy
    }

    /// What the kernel was found to support at start-up.
    pub fn kernel_support(&self) -> &KernelSupport {
        &self.kernel
    }

    /// Which site a server name is for, as the ClientHello's SNI is matched.
    pub fn names(&self) -> &Arc<SiteNames> {
        &self.names
    }
}
