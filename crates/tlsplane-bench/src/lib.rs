//! Load generator behind `tlsplane bench` (the `tlsplane-bench` binary, which `tlsplane bench`
//! runs).
//!
//! * `bench handshake TARGET`: repeated connect + TLS handshake (+ optional
//!   GET) + close_notify, counting full vs resumed handshakes, failures by
//!   reason, latency percentiles and the client's own CPU per handshake.
//! * `bench throughput URL`: keep-alive connections GETting a URL, reporting
//!   body bytes/s, requests/s, latency and client CPU per GB.
//! * `bench flood TARGET`: a handshake flood as an attacker runs it: one
//!   canned ClientHello replayed on `--concurrency` connections kept in
//!   flight, each reset as soon as the server's first flight is in; reports
//!   first flights per second, failures by kind and the client's own CPU
//!   (see `flood.rs`).
//! * `bench hold TARGET`: N keep-alive connections opened (handshake + one GET each) and held
//!   idle; the server's RSS growth per held connection, and whether the oldest of them and a
//!   new one are still served (see `hold.rs`).
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

mod args;
mod cpu;
mod engine;
mod flood;
mod handshake;
mod hold;
mod http;
mod net;
mod stats;
mod throughput;
mod tls;

use std::sync::Arc;

use anyhow::Result;

pub use args::{
    EngineChoice, FloodArgs, Group, HandshakeArgs, HoldArgs, LoadArgs, ResumeMode, ThroughputArgs,
    TlsArgs, TlsVersion,
};
pub use hold::HoldReport;
pub use stats::{FlightShape, FloodReport, Latency, Report};

use engine::{execute, Work};
use stats::{Mode, RunInfo};

/// `tlsplane bench ...`
#[derive(clap::Subcommand, Debug)]
pub enum BenchCommand {
    /// Measure TLS handshakes per second (connect, handshake, close; repeat).
    Handshake(HandshakeArgs),
    /// Measure HTTPS GET throughput over keep-alive connections.
    Throughput(ThroughputArgs),
    /// Handshake flood: replay one canned ClientHello on C connections kept in
    /// flight, reset each once the server's first flight is in (no client crypto).
    Flood(FloodArgs),
    /// Open N keep-alive connections (handshake + one GET each) and hold them idle; report
    /// the server's memory per held connection and check it still serves the oldest and a
    /// new one.
    Hold(HoldArgs),
}

/// Runs a benchmark and prints its report (JSON with `--json`) on stdout.
pub fn run(cmd: BenchCommand) -> Result<()> {
    match &cmd {
        BenchCommand::Handshake(a) => {
            let r = run_handshake(a)?;
            emit(&r, a.load.json, Report::to_text)?;
            // With --request, a cycle succeeds when its response does.
            let ok = if r.response_latency_us.is_some() {
                r.requests
            } else {
                r.handshakes
            };
            nothing_succeeded(ok, r.failures_total)
        }
        BenchCommand::Throughput(a) => {
            let r = run_throughput(a)?;
            emit(&r, a.load.json, Report::to_text)?;
            nothing_succeeded(r.requests, r.failures_total)
        }
        BenchCommand::Flood(a) => {
            let r = run_flood(a)?;
            emit(&r, a.json, FloodReport::to_text)?;
            nothing_succeeded(r.flights, r.failures_total)
        }
        BenchCommand::Hold(a) => {
            let report = run_hold(a)?;
            emit(&report, a.json, HoldReport::to_text)?;
            if !report.ok() {
                anyhow::bail!("not every connection was held and served (see the report)");
            }
            Ok(())
        }
    }
}

/// A run where no attempt succeeded measured nothing: say so in the exit status (scripts and
/// CI check that), not only in the report.
fn nothing_succeeded(ok: u64, failed: u64) -> Result<()> {
    if ok == 0 {
        anyhow::bail!("no attempt succeeded ({failed} failed): nothing was measured");
    }
    Ok(())
}

fn emit<R: serde::Serialize>(report: &R, json: bool, text: fn(&R) -> String) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string(report)?);
    } else {
        print!("{}", text(report));
    }
    Ok(())
}

/// Runs `bench flood` and returns its report without printing it.
pub fn run_flood(a: &FloodArgs) -> Result<FloodReport> {
    let plan = a.plan()?;
    let (hello, conn) = flood::canned_hello(&plan)?;
    let (flight_records, probe) = match plan.flight_records {
        Some(n) => (n, None),
        None => {
            let shape = flood::probe(plan.addr, plan.timeout, conn, &hello)?;
            (shape.records, Some(shape))
        }
    };
    let params = Arc::new(flood::FloodParams {
        addr: plan.addr,
        hello,
        flight_records,
        timeout: plan.timeout,
    });
    let client_hello_bytes = params.hello.len();
    let out = flood::execute(&plan, params)?;
    Ok(FloodReport::build(
        stats::FloodRunInfo {
            target: plan.target_label.clone(),
            concurrency: plan.concurrency,
            threads: plan.threads,
            elapsed: out.elapsed,
            cpu: out.cpu,
            client_hello_bytes,
            flight_records,
            probe,
        },
        &out.stats,
    ))
}

/// Runs `bench hold` and returns its report without printing it.
pub fn run_hold(a: &HoldArgs) -> Result<HoldReport> {
    hold::run(&a.plan()?)
}

/// Runs `bench handshake` and returns its report without printing it.
pub fn run_handshake(a: &HandshakeArgs) -> Result<Report> {
    let (plan, request) = a.plan()?;
    let with_request = request.is_some();
    let mut addrs = vec![plan.addr];
    addrs.extend(a.also_addrs()?);
    let params = Arc::new(handshake::HsParams {
        addrs,
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
