//! `tlsplane check-config` and `tlsplane reload`: an operator's two tools around a
//! configuration file.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Args;

use tlsplane_server::config::{load_sites, ConfigFile, Sites, PRODUCTS};
use tlsplane_server::served_secrets::ServedSecrets;
use tlsplane_server::server::{default_options, server_options_of, Product};

#[derive(Args, Debug)]
pub struct CheckArgs {
    /// The configuration file to check.
    pub file: PathBuf,
    /// The product that will run it: the file is checked as `tlsplane PRODUCT --config FILE`
    /// would check it at start. Default: the file's own `product = "..."`, else guessed from
    /// what it names (backends: proxy; a hand-off socket: handoff; else serve).
    #[arg(long, value_name = "serve|proxy|handoff", value_parser = clap::builder::PossibleValuesParser::new(PRODUCTS))]
    pub product: Option<String>,
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

/// The product a file is checked for, and why that one.
fn product_of(
    file: &ConfigFile,
    asked: Option<&str>,
) -> anyhow::Result<(&'static str, &'static str)> {
    let named = |p: &str| PRODUCTS.into_iter().find(|known| *known == p);
    if let Some(p) = asked {
        file.check_product(p).map_err(anyhow::Error::msg)?;
        return Ok((named(p).unwrap_or("serve"), "--product"));
    }
    if let Some(p) = file.product.as_deref().and_then(named) {
        return Ok((p, "the file's `product`"));
    }
    Ok(if file.is_handoff() {
        ("handoff", "guessed: it names a hand-off socket")
    } else if file.is_proxy() {
        ("proxy", "guessed: it names backends")
    } else {
        ("serve", "guessed: it names no backends")
    })
}

pub fn check_config(args: CheckArgs) -> anyhow::Result<()> {
    let file = ConfigFile::read(&args.file).map_err(anyhow::Error::msg)?;
    let (product, why) = product_of(&file, args.product.as_deref())?;
    let checked = match product {
        "handoff" => check_for::<crate::handoff::Handoff>(&file),
        "proxy" => check_for::<crate::proxy::Proxy>(&file),
        _ => check_for::<crate::serve::Serve>(&file),
    };
    match checked {
        Ok(sites) => {
            let certs: usize = sites.tls.iter().map(|s| s.certs.len()).sum();
            println!(
                "{}: ok: {} sites, {} certificates, for `tlsplane {product} --config` ({why})",
                file.path.display(),
                sites.serve.len(),
                certs
            );
            Ok(())
        }
        Err(errors) => {
            for e in &errors {
                eprintln!("error: {e}");
            }
            anyhow::bail!(
                "{}: {} error(s); `tlsplane {product} --config` ({why}) would not start with it",
                file.path.display(),
                errors.len()
            )
        }
    }
}

/// What `P --config FILE` checks at start, without starting anything; the keys are read here,
/// by the operator's tool, as keyd would read them. Warnings are printed as found.
fn check_for<P: Product>(file: &ConfigFile) -> Result<Sites, Vec<String>> {
    let mut errors = Vec::new();
    let options = match server_options_of::<P::Args>(file, &|_| false, Vec::new()) {
        Ok(o) => o,
        Err(e) => {
            errors.push(format!("{e:#}"));
            // The sites are still worth checking, under the product's defaults.
            match default_options::<P::Args>() {
                Ok(o) => o,
                Err(_) => return Err(errors),
            }
        }
    };
    let server = P::server(&options);
    let mut push = |r: anyhow::Result<()>| {
        if let Err(e) = r {
            errors.push(format!("{e:#}"));
        }
    };
    push(P::check_args(&options, true));
    push(tlsplane_server::server::check_fleet(server));
    push(tlsplane_server::server::read_ticket_keys(server.ticket_keys.as_deref()).map(|_| ()));
    let loaded = load_sites(
        file,
        &P::site_needs(&options),
        &P::alpn(&options),
        &tlsplane::cert::load_key,
    );
    let mut sites = match loaded {
        Ok(sites) => sites,
        Err(e) => {
            errors.extend(e);
            return Err(errors);
        }
    };
    for w in &sites.warnings {
        eprintln!("warning: {w}");
    }
    if let Err(e) = ServedSecrets::of(server, Some(file), None, None).guard(&mut sites) {
        errors.extend(e);
    }
    if errors.is_empty() {
        Ok(sites)
    } else {
        Err(errors)
    }
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
