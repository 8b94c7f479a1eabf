//! Load generator behind `tlsplane bench`.
//!
//! * `bench handshake TARGET`: repeated connect + TLS handshake (+ optional
//!   GET) + close_notify, counting full vs resumed handshakes, failures by
//!   reason, latency percentiles and the client's own CPU per handshake.
//! * `bench throughput URL`: keep-alive connections GETting a URL, reporting
//!   body bytes/s, requests/s, latency and client CPU per GB.
//!
//! The binary embeds it as:
//! ```ignore
//! #[derive(clap::Subcommand)]
//! enum Cmd { #[command(subcommand)] Bench(tlsplane_bench::BenchCommand), /* ... */ }
//! // ...
//! Cmd::Bench(b) => tlsplane_bench::run(b)?,
//! ```
//! [`run`] needs no async runtime from its caller: the handshake loops use
//! blocking sockets on their own threads, and the tokio engine (only used
//! when one thread must multiplex several loops) builds its own
//! current-thread runtimes.

#![forbid(unsafe_code)]

mod args;
mod cpu;
mod engine;
mod handshake;
mod http;
mod net;
mod stats;
mod throughput;
mod tls;

use std::sync::Arc;

use anyhow::Result;

pub use args::{
    EngineChoice, Group, HandshakeArgs, LoadArgs, ResumeMode, ThroughputArgs, TlsArgs, TlsVersion,
};
pub use stats::{Latency, Report};

use engine::{execute, Work};
use stats::{Mode, RunInfo};

/// `tlsplane bench ...`
#[derive(clap::Subcommand, Debug)]
pub enum BenchCommand {
    /// Measure TLS handshakes per second (connect, handshake, close; repeat).
    Handshake(HandshakeArgs),
    /// Measure HTTPS GET throughput over keep-alive connections.
    Throughput(ThroughputArgs),
}

/// Runs a benchmark and prints its report (JSON with `--json`) on stdout.
pub fn run(cmd: BenchCommand) -> Result<()> {
    let (report, json) = match &cmd {
        BenchCommand::Handshake(a) => (run_handshake(a)?, a.load.json),
        BenchCommand::Throughput(a) => (run_throughput(a)?, a.load.json),
    };
    if json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{}", report.to_text());
    }
    Ok(())
}

/// Runs `bench handshake` and returns its report without printing it.
pub fn run_handshake(a: &HandshakeArgs) -> Result<Report> {
    let (plan, request) = a.plan()?;
    let with_request = request.is_some();
    let params = Arc::new(handshake::HsParams {
        addr: plan.addr,
        server_name: plan.server_name.clone(),
        request,
        timeout: plan.timeout,
    });
    let out = execute(&plan, Work::Handshake(params))?;
    Ok(Report::build(
        RunInfo {
            mode: Mode::Handshake { with_request },
            target: plan.target_label.clone(),
            engine: plan.engine.name(),
            connections: plan.connections,
            threads: plan.threads,
            elapsed: out.elapsed,
            cpu: out.cpu,
        },
        &out.stats,
    ))
}

/// Runs `bench throughput` and returns its report without printing it.
pub fn run_throughput(a: &ThroughputArgs) -> Result<Report> {
    let (plan, request) = a.plan()?;
    let params = Arc::new(throughput::TpParams {
        addr: plan.addr,
        server_name: plan.server_name.clone(),
        request,
        sha256: a.verify_sha256,
        timeout: plan.timeout,
    });
    let out = execute(&plan, Work::Throughput(params))?;
    Ok(Report::build(
        RunInfo {
            mode: Mode::Throughput,
            target: plan.target_label.clone(),
            engine: plan.engine.name(),
            connections: plan.connections,
            threads: plan.threads,
            elapsed: out.elapsed,
            cpu: out.cpu,
        },
        &out.stats,
    ))
}
