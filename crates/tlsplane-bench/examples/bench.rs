//! Stand-alone driver with the same arguments as `tlsplane bench ...`:
//! `cargo run --release -p tlsplane-bench --example bench -- handshake 127.0.0.1:8443 --insecure-no-verify`

use clap::Parser;

#[derive(Parser, Debug)]
#[command(name = "bench", about = "TLS handshake / throughput load generator")]
struct Cli {
    #[command(subcommand)]
    cmd: tlsplane_bench::BenchCommand,
}

fn main() -> anyhow::Result<()> {
    tlsplane_bench::run(Cli::parse().cmd)
}
