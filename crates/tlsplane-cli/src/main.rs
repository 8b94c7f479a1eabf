//! `tlsplane`: HTTPS static files, a TLS-terminating proxy and the hand-off of TLS
//! connections over split-plane TLS, and their key daemon. `tlsplane bench` runs the load
//! generator, a separate binary (`tlsplane-bench`) that this one does not link.

mod check;
mod h2_connection;
mod handoff;
mod proxy;
mod serve;

use tlsplane_server::{keyd, privileges, server};

use clap::{Parser, Subcommand};

/// Split-plane TLS for Linux: handshakes in user space (rustls + aws-lc-rs), records in the
/// kernel (kTLS) when it can take them, in user space otherwise.
#[derive(Parser, Debug)]
#[command(name = "tlsplane", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Serve a directory over HTTPS (HTTP/1.1), file bodies by sendfile on the kernel plane.
    Serve(serve::ServeArgs),
    /// Terminate TLS in front of a plain TCP or Unix-socket backend: after the handshake,
    /// bytes flow both ways unchanged (half-closes kept), optionally behind a PROXY header.
    Proxy(proxy::ProxyArgs),
    /// Hand established TLS connections to other programs: each site's receivers connect to
    /// its Unix socket (uid/gid checked with SO_PEERCRED) and get each connection as a
    /// descriptor they read and write plaintext on (docs/HANDOFF.md), least pending first.
    Handoff(handoff::HandoffArgs),
    /// Check a configuration file as a start would load it (certificates, keys, chains, names,
    /// roots): every error with its file, site and reason; warnings for certificates near
    /// expiry or not covering a configured name. Exits 1 on any error.
    CheckConfig(check::CheckArgs),
    /// Make a running server re-read its configuration (SIGHUP to the pid in its pid file) and
    /// report the outcome: exit 0 when the new configuration is in force, 1 when the server
    /// kept the previous one.
    Reload(check::ReloadArgs),
    /// The key daemon: holds private keys and signs for servers over a private Unix socket
    /// (`serve` starts one itself unless --keyd off; start one by hand for --keyd unix:PATH).
    Keyd(keyd::KeydArgs),
    /// Started by a server with --user, as root: starts its key daemons.
    #[command(hide = true)]
    KeydLauncher(privileges::LauncherArgs),
    /// Load generators: TLS handshakes per second, HTTPS throughput (runs the tlsplane-bench
    /// binary beside this one with these arguments; `tlsplane bench --help` for its help).
    #[command(disable_help_flag = true)]
    Bench {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, num_args = 0..)]
        args: Vec<std::ffi::OsString>,
    },
}

/// One line per panic, so that a bug the network can trigger repeatedly cannot flood the log
/// (or burn CPU) with backtraces; the first panic still gets one if `RUST_BACKTRACE` asks.
fn install_panic_hook() {
    use std::sync::atomic::{AtomicBool, Ordering};
    static FIRST: AtomicBool = AtomicBool::new(true);
    std::panic::set_hook(Box::new(|info| {
        let thread = std::thread::current();
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .copied()
            .or_else(|| info.payload().downcast_ref::<String>().map(String::as_str))
            .unwrap_or("(non-string payload)");
        let at = info
            .location()
            .map(|l| format!("{}:{}", l.file(), l.line()))
            .unwrap_or_default();
        eprintln!(
            "tlsplane: thread '{}' panicked at {at}: {msg} (a bug; the connection was closed)",
            thread.name().unwrap_or("?")
        );
        if FIRST.swap(false, Ordering::Relaxed) {
            let bt = std::backtrace::Backtrace::capture();
            if bt.status() == std::backtrace::BacktraceStatus::Captured {
                eprintln!("{bt}");
            }
        }
    }));
}

/// `tlsplane bench ARGS`: becomes (exec) the `tlsplane-bench` binary beside this one, so that
/// scripts keep calling `tlsplane bench` while the server binary does not link the load
/// generator.
fn run_bench(args: Vec<std::ffi::OsString>) -> anyhow::Result<()> {
    use std::os::unix::process::CommandExt;
    let exe = std::env::current_exe()
        .map_err(|e| anyhow::anyhow!("cannot find this binary's directory: {e}"))?;
    let bench = exe.with_file_name("tlsplane-bench");
    if !bench.exists() {
        anyhow::bail!(
            "the load generator is its own binary, and {} does not exist: build it with \
             `cargo build --release -p tlsplane-bench` (a plain `cargo build --release` at the \
             workspace root builds it too) and keep it beside tlsplane",
            bench.display()
        );
    }
    // Usage lines then read `tlsplane bench ...`, as the command typed.
    let err = std::process::Command::new(&bench)
        .arg0("tlsplane bench")
        .args(args)
        .exec();
    Err(anyhow::anyhow!("cannot run {}: {err}", bench.display()))
}

fn main() {
    use clap::{CommandFactory, FromArgMatches};
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    install_panic_hook();
    let filter = tracing_subscriber::EnvFilter::try_from_env("TLSPLANE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        // Colour only for a person at a terminal: in a file or a journal the escape codes
        // are noise that breaks grep.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let result = match cli.command {
        Command::Serve(args) => server::run::<serve::Serve>(
            args,
            matches
                .subcommand_matches("serve")
                .expect("the serve subcommand was parsed"),
        ),
        Command::Proxy(args) => server::run::<proxy::Proxy>(
            args,
            matches
                .subcommand_matches("proxy")
                .expect("the proxy subcommand was parsed"),
        ),
        Command::Handoff(args) => server::run::<handoff::Handoff>(
            args,
            matches
                .subcommand_matches("handoff")
                .expect("the handoff subcommand was parsed"),
        ),
        Command::CheckConfig(args) => check::check_config(args),
        Command::Reload(args) => check::reload(args),
        Command::Keyd(args) => keyd::run(args),
        Command::KeydLauncher(args) => privileges::run_launcher(args),
        Command::Bench { args } => run_bench(args),
    };
    if let Err(e) = result {
        eprintln!("tlsplane: error: {e:#}");
        std::process::exit(1);
    }
}
