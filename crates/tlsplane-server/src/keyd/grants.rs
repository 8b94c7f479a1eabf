//! Which keys a client of `keyd --listen-tls` may use, and what each client did.
//!
//! Every client certificate the client CA issued completes the TLS handshake; that alone
//! grants nothing. `--authorize CLIENT=KEYS` rules give a client certificate that bears the
//! name CLIENT (a subjectAltName DNS name, URI or IP address; `*`: any) the keys KEYS (key
//! files as the daemon loaded them, `site:NAME` for every key of the configuration's sites of
//! that name, `*` for all). A client may use the union of what the rules naming it grant, and
//! nothing else: one compromised serving host signs for its own sites, not for every site.
//!
//! Per client (the rule's CLIENT that named it; with `*`, the certificate's first name) the
//! daemon counts signatures and refusals, and can cap its signatures a second
//! (`--client-sign-rate`).

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Clients counted apart at most; any further one is counted with the others under one name.
const MAX_CLIENTS: usize = 1024;
const OTHER_CLIENTS: &str = "(other clients)";

/// Who a rule is for.
#[derive(Clone, Debug, PartialEq, Eq)]
enum ClientName {
    Any,
    Dns(String),
    Uri(String),
    Ip(IpAddr),
}

/// Which keys a rule grants.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Keys {
    All,
    File(PathBuf),
    Site(String),
}

/// One `--authorize CLIENT=KEY[,KEY...]`.
#[derive(Clone, Debug)]
pub struct Rule {
    client: ClientName,
    keys: Vec<Keys>,
    /// CLIENT as written: the client's name in counts and logs.
    written: String,
}

impl FromStr for Rule {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let form = || {
            format!(
                "{s:?}: expected CLIENT=KEY[,KEY...]: CLIENT a name in the client \
                 certificate (DNS name, URI or IP address) or *, each KEY a key file, \
                 site:NAME or *"
            )
        };
        let (client, keys) = s.split_once('=').ok_or_else(form)?;
        let written = client.trim().to_string();
        let client = match written.as_str() {
            "" => return Err(form()),
            "*" => ClientName::Any,
            c => match c.parse::<IpAddr>() {
                Ok(ip) => ClientName::Ip(ip),
                Err(_) if c.contains(':') => ClientName::Uri(c.to_string()),
                Err(_) => ClientName::Dns(c.to_ascii_lowercase()),
            },
        };
        let keys = keys
            .split(',')
            .map(str::trim)
            .map(|k| match k {
                "" => Err(form()),
                "*" => Ok(Keys::All),
                _ => Ok(match k.strip_prefix("site:") {
                    Some(name) if !name.is_empty() => Keys::Site(name.to_ascii_lowercase()),
                    Some(_) => return Err(form()),
                    None => Keys::File(PathBuf::from(k)),
                }),
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Rule {
            client,
            keys,
            written,
        })
    }
}

/// What the rules name that the daemon did not load: a typo grants nothing, and is said at
/// start and on each reload.
pub fn unknown_keys(
    rules: &[Rule],
    loaded: &HashSet<PathBuf>,
    sites: &HashMap<String, HashSet<PathBuf>>,
) -> Vec<String> {
    let mut out = Vec::new();
    for k in rules.iter().flat_map(|r| &r.keys) {
        match k {
            Keys::File(p) if !loaded.contains(p) => {
                out.push(format!("{}: not a key file this daemon loads", p.display()))
            }
            Keys::Site(name) if !sites.contains_key(name) => {
                out.push(format!("site:{name}: no site of that name in --config"))
            }
            _ => {}
        }
    }
    out
}

/// The names a client certificate bears (its subjectAltName).
#[derive(Debug, Default)]
pub struct CertNames {
    dns: Vec<String>,
    uris: Vec<String>,
    ips: Vec<IpAddr>,
}

impl CertNames {
    /// The names of the DER certificate `der`; none if it cannot be parsed (the TLS
    /// handshake, which checked it, parsed it already).
    pub fn of(der: &[u8]) -> CertNames {
        use x509_parser::prelude::*;
        let mut names = CertNames::default();
        let Ok((_, cert)) = X509Certificate::from_der(der) else {
            return names;
        };
        let Ok(Some(san)) = cert.subject_alternative_name() else {
            return names;
        };
        for n in &san.value.general_names {
            match n {
                GeneralName::DNSName(d) => names.dns.push(d.to_ascii_lowercase()),
                GeneralName::URI(u) => names.uris.push(u.to_string()),
                GeneralName::IPAddress(b) => {
                    if let Ok(a) = <[u8; 4]>::try_from(*b) {
                        names.ips.push(IpAddr::from(a));
                    } else if let Ok(a) = <[u8; 16]>::try_from(*b) {
                        names.ips.push(IpAddr::from(a));
                    }
                }
                _ => {}
            }
        }
        names
    }

    fn matches(&self, client: &ClientName) -> bool {
        match client {
            ClientName::Any => true,
            ClientName::Dns(d) => self.dns.contains(d),
            ClientName::Uri(u) => self.uris.contains(u),
            ClientName::Ip(ip) => self.ips.contains(ip),
        }
    }

    /// The first name, for logs.
    pub fn first(&self) -> String {
        self.dns
            .first()
            .cloned()
            .or_else(|| self.uris.first().cloned())
            .or_else(|| self.ips.first().map(IpAddr::to_string))
            .unwrap_or_else(|| "(a certificate without names)".into())
    }
}

/// What one client may use: the keys of every rule that names it.
#[derive(Debug)]
pub struct Grant {
    /// The client's name in counts and logs.
    pub client: String,
    keys: Vec<Keys>,
}

impl Grant {
    pub fn for_names(rules: &[Rule], names: &CertNames) -> Grant {
        let matching: Vec<&Rule> = rules.iter().filter(|r| names.matches(&r.client)).collect();
        let client = matching
            .iter()
            .find(|r| r.client != ClientName::Any)
            .map_or_else(|| names.first(), |r| r.written.clone());
        Grant {
            client,
            keys: matching.iter().flat_map(|r| r.keys.clone()).collect(),
        }
    }

    /// Whether no rule names this client.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Whether it may use the key loaded from `path` for the sites `key_sites`.
    pub fn allows(&self, path: &Path, key_sites: &HashSet<String>) -> bool {
        self.keys.iter().any(|k| match k {
            Keys::All => true,
            Keys::File(p) => p == path,
            Keys::Site(name) => key_sites.contains(name),
        })
    }
}

/// One client's counts, and its signatures' budget.
#[derive(Debug)]
pub struct Client {
    pub name: String,
    pub signatures: AtomicU64,
    /// Requests refused: keys it may not use, or past its rate.
    pub refused: AtomicU64,
    bucket: Mutex<Bucket>,
}

#[derive(Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Client {
    /// Whether one more signature is within `rate` a second (0: no limit), with a burst of
    /// one second's worth.
    pub fn take(&self, rate: u32) -> bool {
        if rate == 0 {
            return true;
        }
        let mut b = self.bucket.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let rate = f64::from(rate);
        b.tokens = (b.tokens + now.duration_since(b.at).as_secs_f64() * rate).min(rate);
        b.at = now;
        if b.tokens >= 1.0 {
            b.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// Every client seen, by name.
#[derive(Debug, Default)]
pub struct Clients {
    table: Mutex<HashMap<String, Arc<Client>>>,
}

impl Clients {
    /// The client called `name` (made at its first connection).
    pub fn get(&self, name: &str, rate: u32) -> Arc<Client> {
        let mut table = self.table.lock().unwrap_or_else(|e| e.into_inner());
        let name = if table.len() >= MAX_CLIENTS && !table.contains_key(name) {
            OTHER_CLIENTS
        } else {
            name
        };
        table
            .entry(name.to_string())
            .or_insert_with(|| {
                Arc::new(Client {
                    name: name.to_string(),
                    signatures: AtomicU64::new(0),
                    refused: AtomicU64::new(0),
                    bucket: Mutex::new(Bucket {
                        tokens: f64::from(rate),
                        at: Instant::now(),
                    }),
                })
            })
            .clone()
    }

    /// (name, signatures, refused) of each client, by name.
    pub fn counts(&self) -> Vec<(String, u64, u64)> {
        let table = self.table.lock().unwrap_or_else(|e| e.into_inner());
        let mut out: Vec<_> = table
            .values()
            .map(|c| {
                (
                    c.name.clone(),
                    c.signatures.load(Relaxed),
                    c.refused.load(Relaxed),
                )
            })
            .collect();
        out.sort();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(dns: &[&str], uris: &[&str]) -> CertNames {
        CertNames {
            dns: dns.iter().map(|s| s.to_string()).collect(),
            uris: uris.iter().map(|s| s.to_string()).collect(),
            ips: Vec::new(),
        }
    }

    #[test]
    fn a_client_may_use_what_the_rules_naming_it_grant_and_nothing_else() {
        let rules: Vec<Rule> = [
            "a.example=/k/a.pem",
            "A.example=site:www.a.example",
            "spiffe://fleet/b=/k/b.pem,/k/b2.pem",
            "ops.example=*",
        ]
        .iter()
        .map(|r| r.parse().unwrap())
        .collect();
        let sites = HashMap::from([(
            "www.a.example".to_string(),
            HashSet::from([PathBuf::from("/k/a-site.pem")]),
        )]);
        let of = |path: &str| super::super::sites_of(&sites, Path::new(path));
        let a = Grant::for_names(&rules, &names(&["a.example"], &[]));
        assert_eq!(a.client, "a.example");
        assert!(a.allows(Path::new("/k/a.pem"), &of("/k/a.pem")));
        assert!(a.allows(Path::new("/k/a-site.pem"), &of("/k/a-site.pem")));
        assert!(!a.allows(Path::new("/k/b.pem"), &of("/k/b.pem")));
        let b = Grant::for_names(&rules, &names(&["b.example"], &["spiffe://fleet/b"]));
        assert!(b.allows(Path::new("/k/b2.pem"), &of("/k/b2.pem")));
        assert!(!b.allows(Path::new("/k/a.pem"), &of("/k/a.pem")));
        let nobody = Grant::for_names(&rules, &names(&["c.example"], &[]));
        assert!(nobody.is_empty());
        assert!(!nobody.allows(Path::new("/k/a.pem"), &of("/k/a.pem")));
        let ops = Grant::for_names(&rules, &names(&["ops.example"], &[]));
        assert!(ops.allows(Path::new("/anything.pem"), &of("/anything.pem")));
        // A name is a whole name: no suffix, no prefix.
        let near = Grant::for_names(&rules, &names(&["x.a.example", "a.example.net"], &[]));
        assert!(near.is_empty());
        let any: Rule = "*=/k/shared.pem".parse().unwrap();
        let g = Grant::for_names(&[any], &names(&["z.example"], &[]));
        assert_eq!(g.client, "z.example");
        assert!(g.allows(Path::new("/k/shared.pem"), &of("/k/shared.pem")));
        for bad in ["a.example", "=/k", "a.example=", "a=site:", "a=/k,,/j"] {
            assert!(bad.parse::<Rule>().is_err(), "{bad}");
        }
        assert_eq!(
            unknown_keys(&rules, &HashSet::from([PathBuf::from("/k/a.pem")]), &sites),
            vec![
                "/k/b.pem: not a key file this daemon loads".to_string(),
                "/k/b2.pem: not a key file this daemon loads".to_string()
            ]
        );
    }

    #[test]
    fn a_client_past_its_rate_is_refused_until_the_budget_refills() {
        let clients = Clients::default();
        let c = clients.get("a", 5);
        let granted = (0..20).filter(|_| c.take(5)).count();
        assert_eq!(granted, 5, "a burst of one second's worth");
        std::thread::sleep(std::time::Duration::from_millis(250));
        assert!(c.take(5), "refilled at 5 a second");
        assert!((0..100).all(|_| c.take(0)), "0: no limit");
        // The table is bounded: clients past it share one entry.
        for i in 0..MAX_CLIENTS + 10 {
            clients.get(&format!("c{i}"), 0);
        }
        assert_eq!(clients.counts().len(), MAX_CLIENTS + 1);
    }
}
