//! `tlsplane check-config` and `tlsplane reload`: an operator's two tools around a
//! configuration file.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Args;

use tlsplane_server::config::{load_sites, ConfigFile, SiteNeeds};
use tlsplane_server::server::{server_options_of, Alpn, Product};

#[derive(Args, Debug)]
pub struct CheckArgs {
    /// The configuration file to check.
    pub file: PathBuf,
}

#[derive(Args, Debug)]
pub struct ReloadArgs {
    /// The running server's pid file (its --pid-file).
    #[arg(long, value_name = "FILE")]
    pub pid_file: PathBuf,
    /// Seconds to wait for the server to report the outcome.
    #[arg(long, default_value_t = 30)]
    pub timeout: u64,
}

/// The fleet's options, as a server would check them at start (the key-encryption key read).
fn fleet(server: &tlsplane_server::server::ServerArgs, errors: &mut Vec<String>) {
    if let Err(e) = tlsplane_server::server::check_fleet(server) {
        errors.push(format!("{e:#}"));
    }
}

pub fn check_config(args: CheckArgs) -> anyhow::Result<()> {
    let file = ConfigFile::read(&args.file).map_err(anyhow::Error::msg)?;
    let mut errors = Vec::new();
    // A file that names backends is a proxy's; checked against the proxy's options.
    let (needs, alpn) = if file.is_handoff() {
        match server_options_of::<crate::handoff::HandoffArgs>(&file, &|_| false, Vec::new()) {
            Ok(o) => {
                fleet(crate::handoff::Handoff::server(&o), &mut errors);
                (
                    crate::handoff::site_needs(&o),
                    crate::handoff::Handoff::alpn(&o),
                )
            }
            Err(e) => {
                errors.push(format!("{e:#}"));
                (
                    SiteNeeds::Handoff {
                        default: tlsplane_server::config::HandoffTarget {
                            socket: Default::default(),
                            uids: vec![],
                            gids: vec![],
                        },
                    },
                    Alpn::new(None, &[], None),
                )
            }
        }
    } else if file.is_proxy() {
        match server_options_of::<crate::proxy::ProxyArgs>(&file, &|_| false, Vec::new()) {
            Ok(o) => {
                fleet(crate::proxy::Proxy::server(&o), &mut errors);
                (crate::proxy::site_needs(&o), crate::proxy::Proxy::alpn(&o))
            }
            Err(e) => {
                errors.push(format!("{e:#}"));
                (
                    SiteNeeds::Backends {
                        default: vec![],
                        protocol: Some(tlsplane_server::config::BackendProtocol::Http1),
                    },
                    Alpn::new(None, &[], None),
                )
            }
        }
    } else {
        let options = server_options_of::<crate::serve::ServeArgs>(&file, &|_| false, Vec::new());
        let alpn = match &options {
            Ok(o) => {
                fleet(crate::serve::Serve::server(o), &mut errors);
                crate::serve::Serve::alpn(o)
            }
            Err(_) => Alpn::new(
                None,
                &tlsplane_server::server::HTTP1_ALPN,
                Some(&tlsplane_server::server::SERVE_ALPN),
            ),
        };
        let needs = SiteNeeds::Root {
            allow_symlinks_outside: match options {
                Ok(o) => o.allow_symlinks_outside,
                Err(e) => {
                    errors.push(format!("{e:#}"));
                    false
                }
            },
        };
        (needs, alpn)
    };
    // Session-ticket keys, read as a server would read them (relative to the working
    // directory, as a server started here would).
    if let Some(path) = file.server.get("ticket-keys").and_then(|v| v.as_str()) {
        if let Err(e) = tlsplane_server::server::read_ticket_keys(Some(path.as_ref())) {
            errors.push(format!("{e:#}"));
        }
    }
    // Keys are read here, by the operator's tool, as keyd would read them.
    match load_sites(&file, &needs, &alpn, &tlsplane::cert::load_key) {
        Ok(sites) => {
            for w in &sites.warnings {
                eprintln!("warning: {w}");
            }
            if errors.is_empty() {
                let certs: usize = sites.tls.iter().map(|s| s.certs.len()).sum();
                println!(
                    "{}: ok: {} sites, {} certificates",
                    file.path.display(),
                    sites.serve.len(),
                    certs
                );
                return Ok(());
            }
        }
        Err(e) => errors.extend(e),
    }
    for e in &errors {
        eprintln!("error: {e}");
    }
    anyhow::bail!(
        "{}: {} error(s); a server would not start with it",
        file.path.display(),
        errors.len()
    )
}

/// The number of the last reload a server recorded (0: none yet).
fn last_reload(path: &std::path::Path) -> (u64, String) {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let line = text.lines().next().unwrap_or_default();
    match line.split_once(' ') {
        Some((n, rest)) => (n.parse().unwrap_or(0), rest.to_string()),
        None => (0, String::new()),
    }
}

pub fn reload(args: ReloadArgs) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(&args.pid_file).map_err(|e| {
        anyhow::anyhow!(
            "{}: {e} (is a server running with --pid-file {0}?)",
            args.pid_file.display()
        )
    })?;
    let pid: i32 = text
        .trim()
        .parse()
        .map_err(|_| anyhow::anyhow!("{}: not a pid: {:?}", args.pid_file.display(), text))?;
    let status = tlsplane_server::runtime::reload_status_path(&args.pid_file);
    let (before, _) = last_reload(&status);
    tlsplane_sys::send_sighup(pid).map_err(|e| {
        anyhow::anyhow!(
            "cannot signal pid {pid} (from {}): {e}",
            args.pid_file.display()
        )
    })?;
    let deadline = Instant::now() + Duration::from_secs(args.timeout);
    loop {
        let (n, outcome) = last_reload(&status);
        if n > before {
            if outcome == "ok" {
                println!("reloaded (pid {pid})");
                return Ok(());
            }
            if let Some(what) = outcome.strip_prefix("partial: ") {
                // Asked for and not done: a script must not take it for done.
                anyhow::bail!("reloaded (pid {pid}) but not all of it: {what}");
            }
            anyhow::bail!(
                "reload {}; the server keeps its previous configuration",
                outcome
            );
        }
        if Instant::now() >= deadline {
            anyhow::bail!(
                "pid {pid} did not report the reload's outcome within {} s",
                args.timeout
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
