//! A file server must never hand out the server's own secrets: a TLS private key, the fleet's
//! ticket keys or key-encryption key, the ticket store's password and client key, the key
//! daemon's socket and token, the directory where the generated localhost key is kept, and
//! its access log. A configuration that puts one under a served root is
//! refused (at start, at each reload, and by `check-config`), and every document root withholds
//! them by identity, so that a symlink or hard link inside a root that leads to one is
//! answered 404 as well.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tlsplane_http::Withheld;

use crate::config::{ConfigFile, Origin, Sites};
use crate::keys::KeydMode;
use crate::server::ServerArgs;

/// The secrets a server is configured with: what each is (the option that names it) and where.
pub struct ServedSecrets {
    items: Vec<(String, PathBuf)>,
}

impl ServedSecrets {
    /// The secrets of a server with these options: the sites' key files (`file`), or without
    /// a file the key of `--key` (`flag_key`); `state_dir`: where the generated localhost
    /// certificate lives, when it is in use.
    pub fn of(
        server: &ServerArgs,
        file: Option<&ConfigFile>,
        flag_key: Option<&Path>,
        state_dir: Option<&Path>,
    ) -> Self {
        let mut items: Vec<(String, PathBuf)> = Vec::new();
        let mut add = |what: &str, p: &Path| items.push((what.to_string(), p.to_path_buf()));
        if let Some(f) = file {
            for key in f.key_paths() {
                add("the private key", &key);
            }
        }
        if let Some(key) = flag_key {
            add("--key", key);
        }
        if let Some(dir) = state_dir {
            add(
                "the state directory (TLSPLANE_HOME) holding the generated key",
                dir,
            );
        }
        if let Some(p) = &server.ticket_keys {
            add("--ticket-keys", p);
        }
        if let Some(p) = &server.store.ticket_store_kek {
            add("--ticket-store-kek", p);
        }
        if let Some(p) = &server.keyd_tls_key {
            add("--keyd-tls-key", p);
        }
        if let Some(p) = &server.store.ticket_store_tls_key {
            add("--ticket-store-tls-key", p);
        }
        if let Some(p) = &server.store.ticket_store_password_file {
            add("--ticket-store-password-file", p);
        }
        if let Some(p) = &server.access_log_file {
            add("--access-log-file (clients' addresses and requests)", p);
        }
        if let KeydMode::Unix(socket) = &server.keyd {
            add("the key daemon's socket (--keyd unix:)", socket);
            add(
                "the key daemon's token file",
                &crate::keyd::token_path(socket),
            );
        }
        Self { items }
    }

    /// Why `root` (what site `label` serves) cannot be served: the secrets under it.
    pub fn under(&self, root: &tlsplane_http::DocRoot, label: &str) -> Vec<String> {
        self.items
            .iter()
            .filter(|(_, p)| root.contains(p))
            .map(|(what, p)| {
                format!(
                    "{what} {} lies under the document root {} (site {label:?}), which would serve it to anyone: keep secrets outside served directories",
                    p.display(),
                    root.path().display()
                )
            })
            .collect()
    }

    /// Refuses sites whose root holds a secret; has every root withhold them all.
    pub fn guard(&self, sites: &mut Sites) -> Result<(), Vec<String>> {
        let mut errors = Vec::new();
        let mut withheld = Withheld::default();
        for (_, p) in &self.items {
            withheld.add(p);
        }
        let withheld = Arc::new(withheld);
        for site in &mut sites.serve {
            if let Origin::Root(root) = &mut site.origin {
                errors.extend(self.under(root, &site.label));
                root.withhold(withheld.clone());
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors)
        }
    }
}
