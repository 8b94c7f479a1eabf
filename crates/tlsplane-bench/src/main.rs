//! `tlsplane-bench`: the load generator as its own binary, so that the server binary does not
//! link it. `tlsplane bench ARGS` runs this binary (the one beside it) with the same ARGS;
//! run it directly the same way: `tlsplane-bench handshake 127.0.0.1:8443 --insecure-no-verify`.

use clap::Parser;

/// Load generators: TLS handshakes per second, HTTPS throughput, handshake floods, idle
/// connections held.
#[derive(Parser, Debug)]
#[command(name = "tlsplane-bench", version)]
struct Cli {
    #[command(subcommand)]
    cmd: tlsplane_bench::BenchCommand,
}

fn main() {
    if let Err(e) = tlsplane_bench::run(Cli::parse().cmd) {
        eprintln!("tlsplane bench: error: {e:#}");
        std::process::exit(1);
    }
}
