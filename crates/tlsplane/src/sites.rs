//! Many sites on one listener: which site a connection is for, by its server name (SNI), and
//! which of the site's certificates to present.
//!
//! A name is matched as nginx matches `server_name`: an exact name first, then the longest
//! `*.suffix` wildcard (which covers any depth below the suffix: `*.example.com` matches
//! `a.example.com` and `a.b.example.com`, not `example.com`), then the default site. Names are
//! compared case-insensitively, without a trailing dot. The lookup walks the name's labels
//! once and does one hash lookup per label, whatever the number of sites.

use std::collections::HashMap;
use std::sync::Arc;

use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

use crate::Error;

/// Server names to site numbers (positions in the caller's list of sites).
#[derive(Debug, Default, Clone)]
pub struct SiteNames {
    exact: HashMap<Box<str>, usize>,
    /// `*.example.com` is stored as `example.com`.
    wildcard: HashMap<Box<str>, usize>,
    default: Option<usize>,
}

/// A configured name, checked and normalized.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NamePattern {
    Exact(String),
    /// The suffix after `*.`.
    Wildcard(String),
}

impl NamePattern {
    /// Parses `example.com`, `*.example.com` (also an IP address, which only a Host header can
    /// carry). Refuses empty labels, `*` anywhere but a whole first label, and characters no
    /// host name has.
    pub fn parse(name: &str) -> Result<Self, String> {
        let lower = name.trim_end_matches('.').to_ascii_lowercase();
        let (wild, rest) = match lower.strip_prefix("*.") {
            Some(rest) => (true, rest),
            None => (false, lower.as_str()),
        };
        let ip = !wild && rest.parse::<std::net::IpAddr>().is_ok();
        if rest.is_empty()
            || (!ip
                && rest.split('.').any(|label| {
                    label.is_empty()
                        || label.len() > 63
                        || !label
                            .bytes()
                            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
                }))
        {
            return Err(format!(
                "{name:?} is not a server name (expected e.g. example.com or *.example.com)"
            ));
        }
        Ok(if wild {
            Self::Wildcard(rest.to_string())
        } else {
            Self::Exact(rest.to_string())
        })
    }
}

impl std::fmt::Display for NamePattern {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Exact(n) => f.write_str(n),
            Self::Wildcard(s) => write!(f, "*.{s}"),
        }
    }
}

impl SiteNames {
    /// Builds the table from each site's names (site `i` is `names[i]`). A name claimed by two
    /// sites is an error naming both by number.
    pub fn new(names: &[Vec<NamePattern>], default: Option<usize>) -> Result<Self, Error> {
        Self::with_labels(names, default, |i| format!("#{}", i + 1))
    }

    /// As [`SiteNames::new`], naming the sites of an error by `label` (a configuration's site
    /// names, which an operator recognises, rather than their order in the file).
    pub fn with_labels(
        names: &[Vec<NamePattern>],
        default: Option<usize>,
        label: impl Fn(usize) -> String,
    ) -> Result<Self, Error> {
        let mut t = Self {
            default,
            ..Self::default()
        };
        for (site, patterns) in names.iter().enumerate() {
            for p in patterns {
                let (map, key) = match p {
                    NamePattern::Exact(n) => (&mut t.exact, n),
                    NamePattern::Wildcard(s) => (&mut t.wildcard, s),
                };
                if let Some(other) = map.insert(key.as_str().into(), site) {
                    if other != site {
                        return Err(Error::Config(format!(
                            "server name {p} is claimed by two sites ({} and {})",
                            label(other),
                            label(site)
                        )));
                    }
                }
            }
        }
        Ok(t)
    }

    /// The site for a name: exact, else the longest wildcard, else the default site.
    pub fn lookup(&self, name: &str) -> Option<usize> {
        self.matching(name).or(self.default)
    }

    /// The site whose names cover `name` (exact or wildcard), ignoring the default site.
    pub fn matching(&self, name: &str) -> Option<usize> {
        let name = name.strip_suffix('.').unwrap_or(name);
        let lowered;
        let name = if name.bytes().any(|b| b.is_ascii_uppercase()) {
            lowered = name.to_ascii_lowercase();
            lowered.as_str()
        } else {
            name
        };
        if let Some(&s) = self.exact.get(name) {
            return Some(s);
        }
        if self.wildcard.is_empty() {
            return None;
        }
        // Suffixes after each dot, longest first.
        name.match_indices('.')
            .find_map(|(i, _)| self.wildcard.get(&name[i + 1..]).copied())
    }

    pub fn default_site(&self) -> Option<usize> {
        self.default
    }
}

/// What to do with a ClientHello whose name (or lack of one) matches no site when there is no
/// default site.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum UnknownName {
    /// A fatal `unrecognized_name` alert (RFC 6066), as nginx's `ssl_reject_handshake` does.
    #[default]
    Alert,
    /// Reset the connection without a reply (tells a scanner nothing).
    Reset,
}

impl std::str::FromStr for UnknownName {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "alert" => Ok(Self::Alert),
            "reset" => Ok(Self::Reset),
            other => Err(format!("unknown {other:?} (expected alert or reset)")),
        }
    }
}

/// A site's certificates, one per key type: presents the first whose key can sign with a
/// scheme the client offers (so list ECDSA before RSA to prefer it, as nginx does with two
/// `ssl_certificate`s); when none can, the first, and rustls refuses the handshake with the
/// alert that says why.
#[derive(Debug)]
pub(crate) struct SiteCerts {
    pub(crate) certs: Vec<Arc<CertifiedKey>>,
}

impl ResolvesServerCert for SiteCerts {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        if self.certs.len() > 1 {
            let offered = hello.signature_schemes();
            if let Some(c) = self
                .certs
                .iter()
                .find(|c| c.key.choose_scheme(offered).is_some())
            {
                return Some(c.clone());
            }
        }
        self.certs.first().cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pats(names: &[&str]) -> Vec<NamePattern> {
        names
            .iter()
            .map(|n| NamePattern::parse(n).unwrap())
            .collect()
    }

    #[test]
    fn exact_beats_longest_wildcard_beats_default() {
        let t = SiteNames::new(
            &[
                pats(&["www.example.com"]),
                pats(&["*.example.com"]),
                pats(&["*.eu.example.com"]),
                pats(&["other.org"]),
            ],
            Some(3),
        )
        .unwrap();
        assert_eq!(t.lookup("www.example.com"), Some(0));
        assert_eq!(t.lookup("WWW.Example.COM."), Some(0));
        assert_eq!(t.lookup("shop.example.com"), Some(1));
        assert_eq!(t.lookup("a.b.example.com"), Some(1));
        assert_eq!(t.lookup("shop.eu.example.com"), Some(2));
        assert_eq!(
            t.lookup("example.com"),
            Some(3),
            "a wildcard is not its apex"
        );
        assert_eq!(t.matching("example.com"), None);
        assert_eq!(t.lookup("nothing.test"), Some(3));
        let no_default = SiteNames::new(&[pats(&["a.test"])], None).unwrap();
        assert_eq!(no_default.lookup("b.test"), None);
    }

    #[test]
    fn names_are_checked_and_unique() {
        for bad in [
            "",
            "*",
            "a..b",
            "foo.*.com",
            "*foo.com",
            "a b.com",
            "*.",
            "é.com",
        ] {
            assert!(NamePattern::parse(bad).is_err(), "{bad:?} accepted");
        }
        assert_eq!(
            NamePattern::parse("*.Example.com.").unwrap(),
            NamePattern::Wildcard("example.com".into())
        );
        assert_eq!(
            NamePattern::parse("::1").unwrap(),
            NamePattern::Exact("::1".into())
        );
        let e = SiteNames::new(&[pats(&["a.test"]), pats(&["A.test"])], None).unwrap_err();
        assert!(e.to_string().contains("#1 and #2"), "{e}");
    }
}
