//! The configuration file (`serve --config FILE`, `check-config FILE`) and the sites it
//! describes. Without a file, the command line describes one site (the document root, the
//! certificate) that is the default for every name: both build the same [`Sites`].
//!
//! The file's `[server]` table holds the global options under the names of their flags
//! (`max-connections = 10000` is `--max-connections 10000`); they are parsed by the same
//! command-line parser, so a value means the same in both places and is checked the same way,
//! and a flag given on the command line wins over the file.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use rustls::sign::SigningKey;
use serde::Deserialize;
use tlsplane::sites::{NamePattern, SiteNames};
use tlsplane::SiteTls;
use tlsplane_http::DocRoot;

/// Certificates closer than this to their end are warned about.
const EXPIRY_WARNING: Duration = Duration::from_secs(14 * 24 * 3600);

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct FileToml {
    /// The product the file is for (`serve`, `proxy`, `handoff`): the others refuse it, and
    /// `check-config` checks it for that product.
    product: Option<String>,
    #[serde(default)]
    server: toml::Table,
    #[serde(default, rename = "site")]
    sites: Vec<SiteToml>,
}

#[derive(Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct SiteToml {
    /// A label for messages and logs (default: the first server name).
    name: Option<String>,
    #[serde(default)]
    server_names: Vec<String>,
    /// `serve`: the document root.
    root: Option<PathBuf>,
    /// `serve`: serve dot-files and dot-directories under the root; default: --serve-dotfiles.
    serve_dotfiles: Option<bool>,
    /// `proxy`: the backends (`HOST:PORT` or `unix:PATH`); default: the `--to` flags.
    to: Option<Vec<String>>,
    /// `proxy --mode http`: what its backends speak; default: --backend-protocol.
    backend_protocol: Option<BackendProtocol>,
    /// `handoff`: the Unix socket its connections are handed off on; default: --handoff-socket.
    handoff_socket: Option<PathBuf>,
    /// `handoff`: the user ids allowed to receive them; default: --handoff-allow-uid.
    handoff_allow_uids: Option<Vec<u32>>,
    /// `handoff`: the group ids allowed to receive them; default: --handoff-allow-gid.
    handoff_allow_gids: Option<Vec<u32>>,
    #[serde(default)]
    default: bool,
    #[serde(default, rename = "cert")]
    certs: Vec<CertToml>,
    alpn: Option<Vec<String>>,
    tls_versions: Option<Vec<String>>,
}

#[derive(Deserialize, Debug, Clone)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct CertToml {
    chain: PathBuf,
    key: PathBuf,
    /// Serve the certificate even outside its validity dates (expired, or not yet valid):
    /// otherwise that refuses the start, the reload and `check-config`, since every client
    /// that checks dates would fail its handshake.
    #[serde(default)]
    allow_invalid_dates: bool,
}

/// A configuration file, read and parsed (nothing it names is loaded yet).
#[derive(Debug)]
pub struct ConfigFile {
    pub path: PathBuf,
    /// The product it declares itself for (`product = "..."`), if it does.
    pub product: Option<String>,
    /// The `[server]` table, as written.
    pub server: toml::Table,
    sites: Vec<SiteToml>,
}

impl ConfigFile {
    pub fn read(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
        let parsed: FileToml = toml::from_str(&text).map_err(|e| {
            let at = e.span().map(|span| {
                let before = &text[..span.start.min(text.len())];
                let line = before.matches('\n').count() + 1;
                let col = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
                format!(":{line}:{col}")
            });
            format!(
                "{}{}: {}",
                path.display(),
                at.unwrap_or_default(),
                one_line(e.message())
            )
        })?;
        if let Some(p) = &parsed.product {
            if !PRODUCTS.contains(&p.as_str()) {
                return Err(format!(
                    "{}: product = {p:?}: expected one of {}",
                    path.display(),
                    PRODUCTS.join(", ")
                ));
            }
        }
        if parsed.sites.is_empty() {
            return Err(format!(
                "{}: no [[site]]: a configuration needs at least one site",
                path.display()
            ));
        }
        Ok(Self {
            path: path.to_path_buf(),
            product: parsed.product,
            server: parsed.server,
            sites: parsed.sites,
        })
    }

    /// Refuses a file that declares itself for another product than `command`.
    pub fn check_product(&self, command: &str) -> Result<(), String> {
        match &self.product {
            Some(p) if p != command => Err(format!(
                "{}: product = {p:?}: this file is for `tlsplane {p}`, not `tlsplane {command}`",
                self.path.display()
            )),
            _ => Ok(()),
        }
    }

    /// Every key file the sites name (what the key daemon loads), resolved.
    pub fn key_paths(&self) -> Vec<PathBuf> {
        self.sites
            .iter()
            .flat_map(|s| s.certs.iter().map(|c| self.resolve(&c.key)))
            .collect()
    }

    /// Each site's names (its `name`, if any, and its server names) and the key files its
    /// certificates name, resolved: what `keyd --authorize CLIENT=site:NAME` grants.
    pub fn site_keys(&self) -> Vec<(Vec<String>, Vec<PathBuf>)> {
        self.sites
            .iter()
            .map(|s| {
                let names = s.name.iter().chain(&s.server_names).cloned().collect();
                let keys = s.certs.iter().map(|c| self.resolve(&c.key)).collect();
                (names, keys)
            })
            .collect()
    }

    /// A path as written in the file: relative ones are relative to the file's directory.
    fn resolve(&self, p: &Path) -> PathBuf {
        match self.path.parent() {
            Some(dir) if p.is_relative() => dir.join(p),
            _ => p.to_path_buf(),
        }
    }

    /// The `[server]` table as command-line arguments (`--name=value`), for the options the
    /// command line did not set itself (`given`), against the flags `cmd` knows.
    pub fn server_args(
        &self,
        cmd: &clap::Command,
        given: impl Fn(&str) -> bool,
    ) -> Result<Vec<OsString>, String> {
        let file = self.path.display();
        let mut out = Vec::new();
        for (key, value) in &self.server {
            let arg = cmd
                .get_arguments()
                .find(|a| a.get_long() == Some(key.as_str()))
                .filter(|_| !matches!(key.as_str(), "config" | "help" | "version"))
                .ok_or_else(|| {
                    format!("{file}: [server] {key}: no such option (see `tlsplane serve --help`)")
                })?;
            if given(arg.get_id().as_str()) {
                continue;
            }
            let is_switch = matches!(arg.get_action(), clap::ArgAction::SetTrue);
            let mut push = |v: &toml::Value| -> Result<(), String> {
                let text = match v {
                    toml::Value::String(s) => s.clone(),
                    toml::Value::Integer(i) => i.to_string(),
                    toml::Value::Float(f) => f.to_string(),
                    toml::Value::Boolean(b) if is_switch => {
                        if *b {
                            out.push(format!("--{key}").into());
                        }
                        return Ok(());
                    }
                    toml::Value::Boolean(b) => b.to_string(),
                    other => {
                        return Err(format!(
                            "{file}: [server] {key}: a {} is not a value for this option",
                            other.type_str()
                        ))
                    }
                };
                out.push(format!("--{key}={text}").into());
                Ok(())
            };
            match value {
                toml::Value::Array(items) => {
                    for v in items {
                        push(v)?;
                    }
                }
                v => push(v)?,
            }
        }
        Ok(out)
    }
}

/// The products a configuration file can be for (`product = "..."`).
pub const PRODUCTS: [&str; 3] = ["serve", "proxy", "handoff"];

/// What a site needs besides its TLS: what to call it in messages, and what the product
/// serves it from.
pub struct SiteServe {
    pub label: String,
    pub origin: Origin,
}

/// Where a site's content comes from, by product.
pub enum Origin {
    /// `serve`: files under a document root.
    Root(DocRoot),
    /// `proxy`: these backends, in round-robin order, spoken to in `protocol` (HTTP mode;
    /// TCP mode forwards bytes unchanged and has every site at the flag's `http1`).
    Backends {
        to: Vec<Backend>,
        protocol: BackendProtocol,
    },
    /// `handoff`: the receivers connected to this socket.
    Handoff(HandoffTarget),
}

/// What an HTTP-mode proxy speaks to a site's backends (`--backend-protocol`, a site's
/// `backend-protocol`).
#[derive(clap::ValueEnum, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum BackendProtocol {
    /// HTTP/1.1 (keep-alive pool), for HTTP/1.1 and h2 clients alike.
    Http1,
    /// Cleartext HTTP/2 with prior knowledge, for h2 clients.
    H2c,
}

/// Where a proxy forwards a connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Backend {
    /// `HOST:PORT`; a host name is resolved when the configuration is loaded (the
    /// proxy's `Pool::new`).
    Tcp(String),
    Unix(PathBuf),
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Backend::Tcp(a) => f.write_str(a),
            Backend::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

impl std::str::FromStr for Backend {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::parse_in(s, None)
    }
}

impl Backend {
    /// Parses `HOST:PORT` or `unix:PATH`; a relative PATH is relative to `base` if given
    /// (a configuration file's directory).
    pub fn parse_in(s: &str, base: Option<&Path>) -> Result<Self, String> {
        if let Some(path) = s.strip_prefix("unix:") {
            if path.is_empty() {
                return Err("unix: needs a path".into());
            }
            let p = Path::new(path);
            return Ok(Backend::Unix(match base {
                Some(dir) if p.is_relative() => dir.join(p),
                _ => p.to_path_buf(),
            }));
        }
        let (host, port) = s
            .rsplit_once(':')
            .ok_or_else(|| format!("{s:?}: expected HOST:PORT or unix:PATH"))?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() {
            return Err(format!("{s:?}: no host"));
        }
        match port.parse::<u16>() {
            Ok(p) if p > 0 => Ok(Backend::Tcp(s.to_string())),
            _ => Err(format!("{s:?}: {port:?} is not a port")),
        }
    }
}

/// Where `tlsplane handoff` hands a site's connections, and who may receive them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HandoffTarget {
    pub socket: PathBuf,
    /// A receiver whose user id is here, or whose group id is in `gids`, is served; with both
    /// empty, only the user tlsplane runs as.
    pub uids: Vec<u32>,
    pub gids: Vec<u32>,
}

/// What the product needs of each site: `serve` a document root, `proxy` backends.
#[derive(Clone, Debug)]
pub enum SiteNeeds {
    Root {
        allow_symlinks_outside: bool,
        /// --serve-dotfiles: for sites whose `serve-dotfiles` key does not say.
        serve_dotfiles: bool,
    },
    /// `default`: the backends of a site that names none (the `--to` flags); `protocol`: what
    /// they speak when a site does not say (--backend-protocol), `None` in TCP mode (where a
    /// site's `backend-protocol` is refused).
    Backends {
        default: Vec<Backend>,
        protocol: Option<BackendProtocol>,
    },
    /// `default`: the socket and ids of a site that names none (the flags).
    Handoff { default: HandoffTarget },
}

impl ConfigFile {
    /// Whether the file describes a proxy (a site or `[server]` names backends) rather than
    /// a file server.
    pub fn is_proxy(&self) -> bool {
        self.server.contains_key("to") || self.sites.iter().any(|s| s.to.is_some())
    }

    /// Whether the file describes a hand-off server (a site or `[server]` names a hand-off
    /// socket).
    pub fn is_handoff(&self) -> bool {
        self.server.contains_key("handoff-socket")
            || self.sites.iter().any(|s| s.handoff_socket.is_some())
    }
}

/// Every site, loaded: what the acceptor needs (TLS per site, the name table) and what the
/// product needs (document roots), by the same site numbers.
pub struct Sites {
    pub tls: Vec<SiteTls>,
    pub serve: Vec<SiteServe>,
    pub names: Arc<SiteNames>,
    /// Things worth an operator's attention that do not stop a start (certificate expiry,
    /// a name a certificate does not cover).
    pub warnings: Vec<String>,
}

/// Where private keys come from: the key daemon, or (`--keyd off`) read in this process.
pub type KeyLoader<'a> = &'a dyn Fn(&Path) -> Result<Arc<dyn SigningKey>, tlsplane::Error>;

/// A chain and the key for it, checked to belong together.
fn certified(
    chain_path: &Path,
    key_path: &Path,
    keys: KeyLoader,
) -> Result<Arc<rustls::sign::CertifiedKey>, tlsplane::Error> {
    let chain = tlsplane::cert::load_chain(chain_path)?;
    let key = keys(key_path)?;
    tlsplane::cert::with_key(chain, key, chain_path, key_path)
}

/// ALPN ids from `--alpn` or a site's `alpn` key: `none` (or nothing) is no ALPN at all;
/// each id is what the client must send byte for byte. Ids that cannot be sent (empty, over
/// 255 bytes) are checked by [`check_alpn`].
pub fn alpn_ids(list: &[String]) -> Vec<Vec<u8>> {
    if list.iter().all(|p| p.trim().is_empty()) || list == ["none"] {
        return Vec::new();
    }
    list.iter().map(|p| p.trim().as_bytes().to_vec()).collect()
}

/// What a product offers by ALPN.
pub struct Alpn {
    /// For sites without an `alpn` key.
    pub default: Vec<Vec<u8>>,
    /// For proxy sites without an `alpn` key whose backends speak h2c, when it differs from
    /// `default`: h2 offered first, as their backends speak it.
    pub h2c_default: Option<Vec<Vec<u8>>>,
    /// The ids the product can speak, when it knows what it carries (`None`: anything, as
    /// the TCP proxy and hand-off, which do not read the protocol). Any other id would have
    /// clients speak a protocol it cannot read, so it is refused at load.
    pub speaks: Option<&'static [&'static [u8]]>,
}

/// The ALPN ids of HTTP/1 (RFC 7301): what serve and HTTP mode speak, most preferred first.
pub const HTTP1_ALPN: [&[u8]; 2] = [b"http/1.1", b"http/1.0"];

/// What `serve` can speak: HTTP/1, and HTTP/2 (`h2`) for those who opt in (it is offered
/// only when `--alpn` or a site's `alpn` names it; docs/HTTP2.md).
pub const SERVE_ALPN: [&[u8]; 3] = [b"h2", b"http/1.1", b"http/1.0"];

impl Alpn {
    /// `--alpn` if given (checked), else `default`.
    pub fn new(
        flag: Option<&[String]>,
        default: &[&[u8]],
        speaks: Option<&'static [&'static [u8]]>,
    ) -> Self {
        Self {
            default: match flag {
                Some(list) => alpn_ids(list),
                None => default.iter().map(|p| p.to_vec()).collect(),
            },
            h2c_default: None,
            speaks,
        }
    }

    /// What a site without an `alpn` key offers, by where its content comes from.
    pub fn default_for(&self, origin: Option<&Origin>) -> &[Vec<u8>] {
        match (origin, &self.h2c_default) {
            (
                Some(Origin::Backends {
                    protocol: BackendProtocol::H2c,
                    ..
                }),
                Some(h2c),
            ) => h2c,
            _ => &self.default,
        }
    }
}

/// Why an ALPN list cannot be offered, if it cannot.
pub fn check_alpn(ids: &[Vec<u8>], alpn: &Alpn) -> Result<(), String> {
    for id in ids {
        if id.is_empty() || id.len() > 255 {
            return Err(format!(
                "ALPN id {:?}: must be 1 to 255 bytes",
                String::from_utf8_lossy(id)
            ));
        }
        if let Some(speaks) = alpn.speaks {
            if !speaks.contains(&id.as_slice()) {
                let what = if speaks.contains(&b"h2".as_slice()) {
                    "HTTP/2 and HTTP/1 only (h2, http/1.1, http/1.0)"
                } else {
                    "HTTP/1 only (http/1.1, http/1.0)"
                };
                return Err(format!(
                    "ALPN id {:?}: this server speaks {what}",
                    String::from_utf8_lossy(id)
                ));
            }
        }
    }
    Ok(())
}

/// One site from the command line: every name, this origin and certificate.
pub fn single_site(
    origin: Origin,
    chain: &Path,
    key: &Path,
    alpn: &Alpn,
    keys: KeyLoader,
) -> anyhow::Result<Sites> {
    check_alpn(&alpn.default, alpn).map_err(|e| anyhow::anyhow!("--alpn: {e}"))?;
    let cert = certified(chain, key, keys)?;
    let mut tls = SiteTls::new(vec![cert]);
    tls.alpn = alpn.default_for(Some(&origin)).to_vec();
    Ok(Sites {
        tls: vec![tls],
        serve: vec![SiteServe {
            label: "default".into(),
            origin,
        }],
        names: Arc::new(SiteNames::new(&[Vec::new()], Some(0))?),
        warnings: Vec::new(),
    })
}

/// Loads every site of `file`: certificates, keys, chains, names, document roots. Errors name
/// the file, the site and the reason, all of them at once (a start or `check-config` fixes
/// them in one go, not one per run).
pub fn load_sites(
    file: &ConfigFile,
    needs: &SiteNeeds,
    alpn: &Alpn,
    keys: KeyLoader,
) -> Result<Sites, Vec<String>> {
    let mut errors = Vec::new();
    if let Err(e) = check_alpn(&alpn.default, alpn) {
        errors.push(format!("{}: alpn: {e}", file.path.display()));
    }
    let mut warnings = Vec::new();
    let mut tls = Vec::new();
    let mut serve = Vec::new();
    let mut names = Vec::new();
    let mut default = None;
    let mut labels = Vec::new();
    let now = SystemTime::now();
    for (i, site) in file.sites.iter().enumerate() {
        let label = site
            .name
            .clone()
            .or_else(|| site.server_names.first().cloned())
            .unwrap_or_else(|| {
                if site.default {
                    "default".into()
                } else {
                    format!("#{}", i + 1)
                }
            });
        labels.push(label.clone());
        let at = format!("{}: site {label:?}", file.path.display());
        let mut fail = |why: String| errors.push(format!("{at}: {why}"));
        let mut patterns = Vec::new();
        for n in &site.server_names {
            match NamePattern::parse(n) {
                Ok(p) => patterns.push(p),
                Err(e) => fail(e),
            }
        }
        if site.server_names.is_empty() && !site.default {
            fail("no server-names (only the default site may have none)".into());
        }
        if site.default {
            match default {
                None => default = Some(i),
                Some(d) => fail(format!(
                    "a second default site (site {:?} is the default already)",
                    labels[d]
                )),
            }
        }
        if site.serve_dotfiles.is_some() && !matches!(needs, SiteNeeds::Root { .. }) {
            fail("`serve-dotfiles` is for `tlsplane serve`; only serve sites have a root".into());
        }
        let handoff_keys = site.handoff_socket.is_some()
            || site.handoff_allow_uids.is_some()
            || site.handoff_allow_gids.is_some();
        if site.backend_protocol.is_some() {
            match needs {
                SiteNeeds::Backends {
                    protocol: Some(_), ..
                } => {}
                SiteNeeds::Backends { protocol: None, .. } => fail(
                    "`backend-protocol` is for `--mode http` (TCP mode forwards bytes unchanged)"
                        .into(),
                ),
                _ => fail(
                    "`backend-protocol` is for `tlsplane proxy --mode http`; only proxy sites have backends"
                        .into(),
                ),
            }
        }
        let origin = match (needs, &site.root, &site.to) {
            (SiteNeeds::Handoff { .. }, root, to) if root.is_some() || to.is_some() => {
                fail("`root` and `to` are for serve and proxy; `handoff` sites have a `handoff-socket`".into());
                None
            }
            (SiteNeeds::Handoff { default }, _, _) => {
                let target = HandoffTarget {
                    socket: match &site.handoff_socket {
                        Some(p) => file.resolve(p),
                        None => default.socket.clone(),
                    },
                    uids: site
                        .handoff_allow_uids
                        .clone()
                        .unwrap_or_else(|| default.uids.clone()),
                    gids: site
                        .handoff_allow_gids
                        .clone()
                        .unwrap_or_else(|| default.gids.clone()),
                };
                if target.socket.as_os_str().is_empty() {
                    fail("no hand-off socket (`handoff-socket = \"PATH\"` in the site, or --handoff-socket)".into());
                    None
                } else {
                    Some(Origin::Handoff(target))
                }
            }
            (_, _, _) if handoff_keys => {
                fail("`handoff-socket` and `handoff-allow-*` are for `tlsplane handoff`".into());
                None
            }
            (SiteNeeds::Root { .. }, _, Some(_)) => {
                fail("`to` (backends) is for `tlsplane proxy`; `serve` sites have a root".into());
                None
            }
            (SiteNeeds::Root { .. }, None, None) => {
                fail("no root (the directory this site serves)".into());
                None
            }
            (
                SiteNeeds::Root {
                    allow_symlinks_outside,
                    serve_dotfiles,
                },
                Some(root),
                None,
            ) => {
                let root = file.resolve(root);
                match DocRoot::new(&root, *allow_symlinks_outside) {
                    Ok(r) => Some(Origin::Root(
                        r.serve_dotfiles(site.serve_dotfiles.unwrap_or(*serve_dotfiles)),
                    )),
                    Err(e) => {
                        fail(format!("root {}: {e}", root.display()));
                        None
                    }
                }
            }
            (SiteNeeds::Backends { .. }, Some(_), _) => {
                fail("`root` is for `tlsplane serve`; `proxy` sites have backends (`to`)".into());
                None
            }
            (SiteNeeds::Backends { default, protocol }, None, to) => {
                let mut backends = Vec::new();
                for b in to.iter().flatten() {
                    match Backend::parse_in(b, file.path.parent()) {
                        Ok(b) => backends.push(b),
                        Err(e) => fail(format!("to {b:?}: {e}")),
                    }
                }
                if to.is_none() {
                    backends = default.clone();
                }
                if backends.is_empty() {
                    fail("no backends (`to = [\"HOST:PORT\"]` in the site, or --to)".into());
                    None
                } else {
                    Some(Origin::Backends {
                        to: backends,
                        protocol: site
                            .backend_protocol
                            .or(*protocol)
                            .unwrap_or(BackendProtocol::Http1),
                    })
                }
            }
        };
        if site.certs.is_empty() {
            fail("no [[site.cert]] (each site needs a certificate chain and its key)".into());
        }
        let mut certs = Vec::new();
        for c in &site.certs {
            let (chain, key) = (file.resolve(&c.chain), file.resolve(&c.key));
            match certified(&chain, &key, keys) {
                Ok(ck) => {
                    if let Err(why) = check_chain(&ck) {
                        fail(format!("{}: {why}", chain.display()));
                        continue;
                    }
                    if let Some(why) = outside_validity(&ck, now) {
                        if !c.allow_invalid_dates {
                            fail(format!(
                                "{}: {why} (to serve it anyway: `allow-invalid-dates = true` in its [[site.cert]])",
                                chain.display()
                            ));
                            continue;
                        }
                        warnings.push(format!("{at}: {}: {why}", chain.display()));
                    }
                    warnings.extend(
                        certificate_warnings(&ck, &patterns, now)
                            .into_iter()
                            .map(|w| format!("{at}: {}: {w}", chain.display())),
                    );
                    certs.push(ck);
                }
                Err(e) => fail(strip_config_prefix(&e)),
            }
        }
        let mut site_tls = SiteTls::new(certs);
        site_tls.alpn = match &site.alpn {
            Some(ids) => alpn_ids(ids),
            None => alpn.default_for(origin.as_ref()).to_vec(),
        };
        if site.alpn.is_some() {
            if let Err(e) = check_alpn(&site_tls.alpn, alpn) {
                fail(format!("alpn: {e}"));
            }
        }
        if let Some(versions) = &site.tls_versions {
            site_tls.versions.clear();
            for v in versions {
                match v.as_str() {
                    "1.3" => site_tls.versions.push(&rustls::version::TLS13),
                    "1.2" => site_tls.versions.push(&rustls::version::TLS12),
                    other => fail(format!(
                        "tls-versions: {other:?} is not a version (expected \"1.3\" or \"1.2\")"
                    )),
                }
            }
            if versions.is_empty() {
                fail("tls-versions is empty".into());
            }
        }
        tls.push(site_tls);
        names.push(patterns);
        if let Some(origin) = origin {
            serve.push(SiteServe { label, origin });
        }
    }
    let table = match SiteNames::with_labels(&names, default, |i| format!("{:?}", labels[i])) {
        Ok(t) => Some(t),
        Err(e) => {
            // Say which sites by label rather than by number.
            errors.push(format!(
                "{}: {}",
                file.path.display(),
                strip_config_prefix(&e)
            ));
            None
        }
    };
    match table {
        Some(table) if errors.is_empty() => Ok(Sites {
            tls,
            serve,
            names: Arc::new(table),
            warnings,
        }),
        _ => Err(errors),
    }
}

fn strip_config_prefix(e: &tlsplane::Error) -> String {
    match e {
        tlsplane::Error::Config(s) => s.clone(),
        e => e.to_string(),
    }
}

fn one_line(s: &str) -> String {
    s.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

/// A chain in order: each certificate issued by the next (names compared; the signatures are
/// left to clients). A wrong intermediate or a reversed file is the classic broken chain that
/// browsers with a cached intermediate hide and other clients fail on.
fn check_chain(ck: &rustls::sign::CertifiedKey) -> Result<(), String> {
    use x509_parser::prelude::*;
    let mut parsed = Vec::new();
    for (i, der) in ck.cert.iter().enumerate() {
        let (_, c) = X509Certificate::from_der(der.as_ref())
            .map_err(|e| format!("certificate {} of the chain cannot be parsed: {e}", i + 1))?;
        parsed.push(c);
    }
    for (i, pair) in parsed.windows(2).enumerate() {
        if pair[0].issuer().as_raw() != pair[1].subject().as_raw() {
            return Err(format!(
                "broken chain: certificate {} ({}) did not issue certificate {} (issued by {}); \
                 the file must hold the leaf first, then each issuer in order",
                i + 2,
                pair[1].subject(),
                i + 1,
                pair[0].issuer()
            ));
        }
    }
    Ok(())
}

/// Why the leaf certificate is not valid at `now`: expired, or not valid yet.
fn outside_validity(ck: &rustls::sign::CertifiedKey, now: SystemTime) -> Option<String> {
    use x509_parser::prelude::*;
    let (_, cert) = X509Certificate::from_der(ck.cert.first()?.as_ref()).ok()?;
    let now_secs = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let validity = cert.validity();
    if validity.not_after.timestamp() < now_secs {
        Some(format!("the certificate expired on {}", validity.not_after))
    } else if validity.not_before.timestamp() > now_secs {
        Some(format!(
            "the certificate is not valid before {}",
            validity.not_before
        ))
    } else {
        None
    }
}

/// Expiry within [`EXPIRY_WARNING`], and configured names the leaf certificate does not
/// cover. (Past dates are [`outside_validity`]'s.)
fn certificate_warnings(
    ck: &rustls::sign::CertifiedKey,
    names: &[NamePattern],
    now: SystemTime,
) -> Vec<String> {
    use x509_parser::prelude::*;
    let mut out = Vec::new();
    let Some(leaf) = ck.cert.first() else {
        return out;
    };
    let Ok((_, cert)) = X509Certificate::from_der(leaf.as_ref()) else {
        out.push("the certificate cannot be parsed to check its dates and names".into());
        return out;
    };
    let now_secs = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let not_after = cert.validity().not_after;
    let left = not_after.timestamp() - now_secs;
    if (0..EXPIRY_WARNING.as_secs() as i64).contains(&left) {
        out.push(format!(
            "the certificate expires on {not_after}, in {} days",
            (left + 86399) / 86400
        ));
    }
    let mut dns = Vec::new();
    let mut ips = Vec::new();
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for n in &san.value.general_names {
            match n {
                GeneralName::DNSName(d) => dns.push(d.to_ascii_lowercase()),
                GeneralName::IPAddress(b) => {
                    if let Ok(a) = <[u8; 4]>::try_from(*b) {
                        ips.push(std::net::IpAddr::from(a));
                    } else if let Ok(a) = <[u8; 16]>::try_from(*b) {
                        ips.push(std::net::IpAddr::from(a));
                    }
                }
                _ => {}
            }
        }
    }
    for n in names {
        if !covers(&dns, &ips, n) {
            out.push(format!(
                "the certificate does not cover the configured name {n}"
            ));
        }
    }
    out
}

/// Whether a certificate's names cover a configured name, as a client would check it: an
/// exact DNS name, a `*.` name covering one label, an IP address; a configured wildcard is
/// covered only by the same wildcard.
fn covers(dns: &[String], ips: &[std::net::IpAddr], name: &NamePattern) -> bool {
    match name {
        NamePattern::Exact(n) => {
            if let Ok(ip) = n.parse::<std::net::IpAddr>() {
                return ips.contains(&ip);
            }
            dns.iter().any(|d| {
                d == n
                    || d.strip_prefix("*.").is_some_and(|suffix| {
                        n.split_once('.').is_some_and(|(_, rest)| rest == suffix)
                    })
            })
        }
        NamePattern::Wildcard(s) => dns.iter().any(|d| d.strip_prefix("*.") == Some(s)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coverage_follows_certificate_rules() {
        let dns = vec!["www.example.com".to_string(), "*.shop.example.com".into()];
        let ips = vec!["127.0.0.1".parse().unwrap()];
        let p = |s: &str| NamePattern::parse(s).unwrap();
        assert!(covers(&dns, &ips, &p("www.example.com")));
        assert!(covers(&dns, &ips, &p("a.shop.example.com")));
        assert!(!covers(&dns, &ips, &p("a.b.shop.example.com")));
        assert!(!covers(&dns, &ips, &p("example.com")));
        assert!(covers(&dns, &ips, &p("*.shop.example.com")));
        assert!(!covers(&dns, &ips, &p("*.example.com")));
        assert!(covers(&dns, &ips, &p("127.0.0.1")));
        assert!(!covers(&dns, &ips, &p("::1")));
    }
}
