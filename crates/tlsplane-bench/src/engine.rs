//! Runs connection loops on OS threads (blocking) or current-thread tokio
//! runtimes, shows progress, and collects the merged [`Stats`].
//!
//! Why blocking is the default whenever each loop has its own thread
//! (`--connections` <= `--threads`, including the default 1/1): the client's
//! CPU per handshake is lower in every mode, because a load generator that
//! costs less leaves more of the machine to the server it measures (the
//! figures: CLIENT_COST.md, "Blocking vs tokio engine", and docs/BENCHMARKS.md,
//! "Client cost").
//!
//! The blocking cycle is 11 syscalls (socket, 3 setsockopt, connect, writev
//! of the ClientHello, 2 recvfrom, one send of Finished + close_notify with
//! MSG_MORE, shutdown, close); tokio adds epoll_ctl add/del, epoll_wait and
//! getsockopt, plus reactor and task bookkeeping. Both engines send the
//! client's last flight, the request or close_notify, and the FIN in one
//! segment. Tokio is used only for `--connections` > `--threads`, where one
//! thread must multiplex several loops. Details: CLIENT_COST.md.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};
use rustls::ClientConfig;

use crate::args::{Engine, Plan, Stop};
use crate::cpu::process_cpu_time;
use crate::handshake::{self, HsParams};
use crate::stats::Stats;
use crate::throughput::{self, TpParams};
use crate::tls::loop_config;

/// Shared run control: when to stop, and live counters for the progress line.
pub(crate) struct Control {
    measure_from: Instant,
    end: Option<Instant>,
    /// Measured operations still to start (`--count`).
    remaining: Option<AtomicU64>,
    pub ok: AtomicU64,
    pub failed: AtomicU64,
    pub bytes: AtomicU64,
}

impl Control {
    pub(crate) fn new(measure_from: Instant, stop: Stop) -> Control {
        let (end, remaining) = match stop {
            Stop::After(d) => (Some(measure_from + d), None),
            Stop::Count(n) => (None, Some(AtomicU64::new(n))),
        };
        Control {
            measure_from,
            end,
            remaining,
            ok: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
        }
    }

    /// Whether to start another operation: `None` = stop, `Some(measured)`.
    pub(crate) fn next(&self) -> Option<bool> {
        let now = Instant::now();
        if now < self.measure_from {
            return Some(false);
        }
        if self.end.is_some_and(|end| now >= end) {
            return None;
        }
        if let Some(rem) = &self.remaining {
            rem.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |r| r.checked_sub(1))
                .ok()?;
        }
        Some(true)
    }

    /// Live counters (measured operations only).
    pub(crate) fn note(&self, ok: bool, bytes: u64) {
        if ok {
            self.ok.fetch_add(1, Ordering::Relaxed);
        } else {
            self.failed.fetch_add(1, Ordering::Relaxed);
        }
        if bytes > 0 {
            self.bytes.fetch_add(bytes, Ordering::Relaxed);
        }
    }
}

/// What the loops do.
#[derive(Clone)]
pub(crate) enum Work {
    Handshake(Arc<HsParams>),
    Throughput(Arc<TpParams>),
}

pub(crate) struct Outcome {
    pub stats: Stats,
    pub elapsed: Duration,
    pub cpu: Duration,
}

fn blocking_loop(work: &Work, ctl: &Control, cfg: Arc<ClientConfig>) -> Stats {
    match work {
        Work::Handshake(p) => handshake::blocking_loop(p, ctl, cfg),
        Work::Throughput(p) => throughput::blocking_loop(p, ctl, cfg),
    }
}

fn tokio_thread(work: Work, ctl: Arc<Control>, cfgs: Vec<Arc<ClientConfig>>) -> Result<Stats> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("building tokio runtime")?;
    rt.block_on(async move {
        let mut set = tokio::task::JoinSet::new();
        for cfg in cfgs {
            let ctl = ctl.clone();
            match &work {
                Work::Handshake(p) => set.spawn(handshake::tokio_loop(p.clone(), ctl, cfg)),
                Work::Throughput(p) => set.spawn(throughput::tokio_loop(p.clone(), ctl, cfg)),
            };
        }
        let mut total = Stats::default();
        while let Some(r) = set.join_next().await {
            total.merge(r.map_err(|e| anyhow!("connection loop panicked: {e}"))?);
        }
        Ok(total)
    })
}

/// How often the progress line is shown: rewritten in place every second on a terminal,
/// else (a log file, a CI job) a line of its own every 5 s, so a long run shows it is alive
/// without filling the log.
pub(crate) fn progress_every(terminal: bool) -> Duration {
    Duration::from_secs(if terminal { 1 } else { 5 })
}

pub(crate) fn progress(ctl: &Control, throughput: bool, terminal: bool) {
    use std::fmt::Write as _;
    use std::io::Write;
    let now = Instant::now();
    let mut line = String::new();
    if now < ctl.measure_from {
        let _ = write!(
            line,
            "warming up, {:.0} s left",
            (ctl.measure_from - now).as_secs_f64()
        );
    } else {
        let secs = (now - ctl.measure_from).as_secs_f64().max(1e-3);
        let ok = ctl.ok.load(Ordering::Relaxed);
        let failed = ctl.failed.load(Ordering::Relaxed);
        let _ = if throughput {
            let bytes = ctl.bytes.load(Ordering::Relaxed);
            write!(
                line,
                "[{secs:5.0} s] {ok} requests  {:.0}/s  {:.3} GB/s  {failed} failed",
                ok as f64 / secs,
                bytes as f64 / 1e9 / secs
            )
        } else {
            write!(
                line,
                "[{secs:5.0} s] {ok} ok  {:.0}/s  {failed} failed",
                ok as f64 / secs
            )
        };
    }
    let mut err = std::io::stderr().lock();
    let _ = if terminal {
        write!(err, "\r\x1b[2K{line}")
    } else {
        writeln!(err, "progress {line}")
    };
    let _ = err.flush();
}

/// Runs the plan to completion.
pub(crate) fn execute(plan: &Plan, work: Work) -> Result<Outcome> {
    use std::io::IsTerminal;
    let terminal = std::io::stderr().is_terminal();
    let throughput = matches!(work, Work::Throughput(_));
    // aws-lc seeds its process-wide RNG on first use, which burns ~40 ms of
    // CPU: do it before measuring so it pollutes neither the first
    // handshake's latency nor the CPU per handshake.
    plan.config
        .crypto_provider()
        .secure_random
        .fill(&mut [0u8; 32])
        .map_err(|e| anyhow!("seeding the RNG: {e:?}"))?;
    let started = Instant::now();
    let measure_from = started + plan.warmup;
    let ctl = Arc::new(Control::new(measure_from, plan.stop));
    let mut cpu_start = if plan.warmup.is_zero() {
        Some(process_cpu_time().context("reading /proc/self/stat")?)
    } else {
        None
    };

    // Spread the loops over the threads as evenly as possible.
    let (tx, rx) = mpsc::channel::<Result<Stats>>();
    let mut handles = Vec::with_capacity(plan.threads);
    for t in 0..plan.threads {
        let n_loops =
            plan.connections / plan.threads + usize::from(t < plan.connections % plan.threads);
        let cfgs: Vec<_> = (0..n_loops)
            .map(|_| loop_config(&plan.config, plan.session_cache))
            .collect();
        let (tx, ctl, work, engine) = (tx.clone(), ctl.clone(), work.clone(), plan.engine);
        let h = std::thread::Builder::new()
            .name(format!("bench-{t}"))
            .spawn(move || {
                let r = match engine {
                    Engine::Blocking => {
                        let mut total = Stats::default();
                        for cfg in cfgs {
                            // choose_engine guarantees one loop per thread.
                            total.merge(blocking_loop(&work, &ctl, cfg));
                        }
                        Ok(total)
                    }
                    Engine::Tokio => tokio_thread(work, ctl, cfgs),
                };
                let _ = tx.send(r);
            })
            .context("spawning bench thread")?;
        handles.push(h);
    }
    drop(tx);

    let tick = progress_every(terminal);
    let mut next_tick = started + tick;
    let mut merged = Stats::default();
    let mut done = 0;
    let mut first_err = None;
    while done < plan.threads {
        if cpu_start.is_none() && Instant::now() >= measure_from {
            cpu_start = Some(process_cpu_time()?);
        }
        let mut wake = next_tick;
        if cpu_start.is_none() {
            wake = wake.min(measure_from);
        }
        match rx.recv_timeout(wake.saturating_duration_since(Instant::now())) {
            Ok(Ok(st)) => {
                merged.merge(st);
                done += 1;
            }
            Ok(Err(e)) => {
                first_err.get_or_insert(e);
                done += 1;
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if Instant::now() >= next_tick {
                    progress(&ctl, throughput, terminal);
                    next_tick += tick;
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    let finished = Instant::now();
    let cpu_end = process_cpu_time()?;
    if terminal {
        use std::io::Write;
        let _ = write!(std::io::stderr(), "\r\x1b[2K");
    }
    for h in handles {
        if h.join().is_err() {
            first_err.get_or_insert(anyhow!("a bench thread panicked"));
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    let cpu_start = cpu_start.unwrap_or(cpu_end);
    Ok(Outcome {
        stats: merged,
        elapsed: finished.saturating_duration_since(measure_from),
        cpu: cpu_end.saturating_sub(cpu_start),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn count_stops_after_n() {
        let ctl = Control::new(Instant::now(), Stop::Count(3));
        assert_eq!(ctl.next(), Some(true));
        assert_eq!(ctl.next(), Some(true));
        assert_eq!(ctl.next(), Some(true));
        assert_eq!(ctl.next(), None);
        assert_eq!(ctl.next(), None);
    }

    #[test]
    fn warmup_is_unmeasured_and_duration_ends() {
        let start = Instant::now() + Duration::from_millis(50);
        let ctl = Control::new(start, Stop::After(Duration::from_millis(30)));
        assert_eq!(ctl.next(), Some(false));
        std::thread::sleep(Duration::from_millis(55));
        assert_eq!(ctl.next(), Some(true));
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(ctl.next(), None);
    }
}
