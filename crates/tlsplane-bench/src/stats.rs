//! Per-loop counters, merging, and the final [`Report`].

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io;
use std::time::Duration;

use hdrhistogram::Histogram;
use rustls::{CipherSuite, HandshakeKind, NamedGroup, ProtocolVersion};
use serde::Serialize;

/// Highest latency the histograms track exactly (larger values saturate).
const HIST_MAX_US: u64 = 120_000_000;

pub(crate) fn new_hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, HIST_MAX_US, 3).expect("valid histogram bounds")
}

/// Why one operation failed.
#[derive(Debug)]
pub(crate) enum Failure {
    Connect(io::ErrorKind),
    Handshake(rustls::Error),
    /// TLS error after the handshake (bad record, unexpected alert...).
    Tls(rustls::Error),
    Io(io::ErrorKind),
    Timeout,
    BadStatus(u16),
    BadResponse(&'static str),
    Sha256Mismatch,
}

impl Failure {
    /// Classifies an I/O error returned while talking TLS: rustls errors come
    /// wrapped in `InvalidData`, socket timeouts as `WouldBlock`/`TimedOut`.
    pub(crate) fn from_io(e: io::Error, handshaking: bool) -> Failure {
        if e.kind() == io::ErrorKind::InvalidData {
            if let Some(tls) = e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()) {
                return if handshaking {
                    Failure::Handshake(tls.clone())
                } else {
                    Failure::Tls(tls.clone())
                };
            }
        }
        match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => Failure::Timeout,
            k => Failure::Io(k),
        }
    }

    pub(crate) fn from_connect(e: io::Error) -> Failure {
        match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => Failure::Timeout,
            k => Failure::Connect(k),
        }
    }

    /// The key under which the failure is counted.
    pub(crate) fn reason(&self) -> String {
        match self {
            Failure::Connect(k) => format!("connect: {k:?}"),
            Failure::Handshake(e) => format!("handshake: {e}"),
            Failure::Tls(e) => format!("tls: {e}"),
            Failure::Io(k) => format!("io: {k:?}"),
            Failure::Timeout => "timeout".to_string(),
            Failure::BadStatus(s) => format!("bad_status: {s}"),
            Failure::BadResponse(why) => format!("bad_response: {why}"),
            Failure::Sha256Mismatch => "sha256_mismatch".to_string(),
        }
    }
}

/// What a completed handshake negotiated.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Negotiated {
    pub version: Option<ProtocolVersion>,
    pub suite: Option<CipherSuite>,
    pub group: Option<NamedGroup>,
}

impl Negotiated {
    pub(crate) fn of(c: &rustls::CommonState) -> Negotiated {
        Negotiated {
            version: c.protocol_version(),
            suite: c.negotiated_cipher_suite().map(|s| s.suite()),
            group: c.negotiated_key_exchange_group().map(|g| g.name()),
        }
    }

    pub(crate) fn version_name(&self) -> String {
        self.version
            .map(version_name)
            .unwrap_or_else(|| "none".into())
    }

    pub(crate) fn suite_name(&self) -> String {
        opt_name(self.suite, CipherSuite::as_str)
    }

    pub(crate) fn group_name(&self) -> String {
        opt_name(self.group, NamedGroup::as_str)
    }
}

/// Counters of one loop (or of several, merged). Recording never allocates
/// except for the first occurrence of a failure reason or negotiated tuple.
pub(crate) struct Stats {
    /// Handshake latency (handshake mode) or request latency (throughput mode), µs.
    pub latency: Histogram<u64>,
    /// Connect start to end of response, µs (handshake mode with --request).
    pub response: Histogram<u64>,
    pub handshakes: u64,
    pub full: u64,
    pub full_hrr: u64,
    pub resumed: u64,
    pub requests: u64,
    pub bytes: u64,
    pub failures: BTreeMap<String, u64>,
    pub negotiated: Vec<(Negotiated, u64)>,
}

impl Default for Stats {
    fn default() -> Self {
        Stats {
            latency: new_hist(),
            response: new_hist(),
            handshakes: 0,
            full: 0,
            full_hrr: 0,
            resumed: 0,
            requests: 0,
            bytes: 0,
            failures: BTreeMap::new(),
            negotiated: Vec::new(),
        }
    }
}

fn micros(d: Duration) -> u64 {
    (d.as_micros().min(u64::MAX as u128) as u64).max(1)
}

impl Stats {
    /// A completed handshake; `latency` is recorded in the main histogram
    /// only when `timed` (handshake mode).
    pub(crate) fn handshake(
        &mut self,
        kind: Option<HandshakeKind>,
        neg: Negotiated,
        latency: Duration,
        timed: bool,
    ) {
        self.handshakes += 1;
        match kind {
            Some(HandshakeKind::Resumed) => self.resumed += 1,
            Some(HandshakeKind::FullWithHelloRetryRequest) => {
                self.full += 1;
                self.full_hrr += 1;
            }
            _ => self.full += 1,
        }
        if timed {
            self.latency.saturating_record(micros(latency));
        }
        match self.negotiated.iter_mut().find(|(n, _)| *n == neg) {
            Some((_, c)) => *c += 1,
            None => self.negotiated.push((neg, 1)),
        }
    }

    pub(crate) fn response(&mut self, total: Duration, body_bytes: u64) {
        self.requests += 1;
        self.bytes += body_bytes;
        self.response.saturating_record(micros(total));
    }

    pub(crate) fn request(&mut self, latency: Duration, body_bytes: u64) {
        self.requests += 1;
        self.bytes += body_bytes;
        self.latency.saturating_record(micros(latency));
    }

    pub(crate) fn failure(&mut self, f: &Failure) {
        *self.failures.entry(f.reason()).or_insert(0) += 1;
    }

    pub(crate) fn failures_total(&self) -> u64 {
        self.failures.values().sum()
    }

    pub(crate) fn merge(&mut self, o: Stats) {
        self.latency.add(&o.latency).expect("same histogram bounds");
        self.response
            .add(&o.response)
            .expect("same histogram bounds");
        self.handshakes += o.handshakes;
        self.full += o.full;
        self.full_hrr += o.full_hrr;
        self.resumed += o.resumed;
        self.requests += o.requests;
        self.bytes += o.bytes;
        for (k, v) in o.failures {
            *self.failures.entry(k).or_insert(0) += v;
        }
        for (n, c) in o.negotiated {
            match self.negotiated.iter_mut().find(|(m, _)| *m == n) {
                Some((_, d)) => *d += c,
                None => self.negotiated.push((n, c)),
            }
        }
    }
}

/// Latency percentiles in microseconds.
#[derive(Serialize, Debug, Clone, Copy, PartialEq, Default)]
pub struct Latency {
    /// Operations measured (0: nothing succeeded, the percentiles mean nothing).
    pub samples: u64,
    pub p50: u64,
    pub p90: u64,
    pub p99: u64,
    pub max: u64,
    pub mean: f64,
}

impl Latency {
    pub(crate) fn of(h: &Histogram<u64>) -> Latency {
        if h.is_empty() {
            return Latency::default();
        }
        Latency {
            samples: h.len(),
            p50: h.value_at_quantile(0.50),
            p90: h.value_at_quantile(0.90),
            p99: h.value_at_quantile(0.99),
            max: h.max(),
            mean: (h.mean() * 10.0).round() / 10.0,
        }
    }

    /// "p50 .. p90 .. p99 .. max .. (mean ..)", or "n/a" when nothing was measured.
    pub(crate) fn to_text(self) -> String {
        if self.samples == 0 {
            return "n/a (nothing succeeded)".into();
        }
        format!(
            "p50 {}  p90 {}  p99 {}  max {}  (mean {:.1})",
            self.p50, self.p90, self.p99, self.max, self.mean
        )
    }
}

/// The result of one benchmark run (`--json` prints it as one object).
#[derive(Serialize, Debug, Clone)]
pub struct Report {
    /// "handshake" or "throughput".
    pub mode: &'static str,
    /// TARGET or URL as given.
    pub target: String,
    /// "blocking" or "tokio".
    pub engine: &'static str,
    pub connections: usize,
    /// OS threads actually used.
    pub threads: usize,
    /// Measured wall time.
    pub duration_s: f64,
    /// Completed TLS handshakes (full + resumed).
    pub handshakes: u64,
    pub full: u64,
    /// Of `full`, those that needed a HelloRetryRequest.
    pub full_with_hrr: u64,
    pub resumed: u64,
    /// Completed HTTP requests with a good response.
    pub requests: u64,
    pub failures: BTreeMap<String, u64>,
    pub failures_total: u64,
    /// Handshakes/s (handshake mode) or requests/s (throughput mode).
    pub rate_per_s: f64,
    /// Connect start to handshake complete (handshake mode) or request
    /// write to last body byte (throughput mode).
    pub latency_us: Latency,
    /// Connect start to end of response (handshake mode with --request).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub response_latency_us: Option<Latency>,
    /// Client process user+system CPU during the measured phase.
    pub client_cpu_s: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_cpu_us_per_handshake: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_cpu_s_per_gb: Option<f64>,
    /// Response body bytes received.
    pub bytes: u64,
    /// Body bytes per second / 1e9.
    pub gbytes_per_s: f64,
    /// Negotiated protocol versions, suites and groups → counts.
    pub versions: BTreeMap<String, u64>,
    pub suites: BTreeMap<String, u64>,
    pub groups: BTreeMap<String, u64>,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    Handshake { with_request: bool },
    Throughput,
}

pub(crate) struct RunInfo {
    pub mode: Mode,
    pub target: String,
    pub engine: &'static str,
    pub connections: usize,
    pub threads: usize,
    pub elapsed: Duration,
    pub cpu: Duration,
}

fn version_name(v: ProtocolVersion) -> String {
    match v {
        ProtocolVersion::TLSv1_2 => "TLSv1.2".into(),
        ProtocolVersion::TLSv1_3 => "TLSv1.3".into(),
        other => other
            .as_str()
            .map(str::to_string)
            .unwrap_or_else(|| format!("{other:?}")),
    }
}

fn opt_name<T: std::fmt::Debug>(v: Option<T>, as_str: fn(&T) -> Option<&'static str>) -> String {
    match v {
        None => "none".into(),
        Some(x) => as_str(&x)
            .map(str::to_string)
            .unwrap_or_else(|| format!("{x:?}")),
    }
}

pub(crate) fn round(v: f64, digits: i32) -> f64 {
    let m = 10f64.powi(digits);
    (v * m).round() / m
}

impl Report {
    pub(crate) fn build(info: RunInfo, st: &Stats) -> Report {
        let secs = info.elapsed.as_secs_f64().max(1e-9);
        let cpu = info.cpu.as_secs_f64();
        let (rate, cpu_hs, cpu_gb) = match info.mode {
            Mode::Handshake { .. } => (
                st.handshakes as f64 / secs,
                (st.handshakes > 0).then(|| round(cpu * 1e6 / st.handshakes as f64, 1)),
                None,
            ),
            Mode::Throughput => (
                st.requests as f64 / secs,
                None,
                (st.bytes > 0).then(|| round(cpu / (st.bytes as f64 / 1e9), 4)),
            ),
        };
        let mut versions = BTreeMap::new();
        let mut suites = BTreeMap::new();
        let mut groups = BTreeMap::new();
        for (n, c) in &st.negotiated {
            *versions.entry(n.version_name()).or_insert(0) += c;
            *suites.entry(n.suite_name()).or_insert(0) += c;
            *groups.entry(n.group_name()).or_insert(0) += c;
        }
        Report {
            mode: match info.mode {
                Mode::Handshake { .. } => "handshake",
                Mode::Throughput => "throughput",
            },
            target: info.target,
            engine: info.engine,
            connections: info.connections,
            threads: info.threads,
            duration_s: round(secs, 3),
            handshakes: st.handshakes,
            full: st.full,
            full_with_hrr: st.full_hrr,
            resumed: st.resumed,
            requests: st.requests,
            failures: st.failures.clone(),
            failures_total: st.failures_total(),
            rate_per_s: round(rate, 1),
            latency_us: Latency::of(&st.latency),
            response_latency_us: matches!(info.mode, Mode::Handshake { with_request: true })
                .then(|| Latency::of(&st.response)),
            client_cpu_s: round(cpu, 3),
            client_cpu_us_per_handshake: cpu_hs,
            client_cpu_s_per_gb: cpu_gb,
            bytes: st.bytes,
            gbytes_per_s: round(st.bytes as f64 / 1e9 / secs, 4),
            versions,
            suites,
            groups,
        }
    }

    /// The human-readable report.
    pub fn to_text(&self) -> String {
        fn top(m: &BTreeMap<String, u64>) -> String {
            let mut v: Vec<_> = m.iter().collect();
            v.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
            let parts: Vec<String> = v.iter().take(4).map(|(k, c)| format!("{k} {c}")).collect();
            if parts.is_empty() {
                "-".into()
            } else {
                parts.join(", ")
            }
        }
        let lat = |l: &Latency| l.to_text();
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{} bench  {}  engine={} connections={} threads={}  measured {:.3} s",
            self.mode, self.target, self.engine, self.connections, self.threads, self.duration_s
        );
        if self.mode == "handshake" {
            let _ = writeln!(
                s,
                "  handshakes     {:>10}  {:.1}/s  (full {}, resumed {}, hello-retry {})",
                self.handshakes, self.rate_per_s, self.full, self.resumed, self.full_with_hrr
            );
            let _ = writeln!(s, "  latency µs     {}", lat(&self.latency_us));
            if let Some(r) = &self.response_latency_us {
                let _ = writeln!(s, "  response µs    {}  ({} ok)", lat(r), self.requests);
            }
        } else {
            let _ = writeln!(
                s,
                "  requests       {:>10}  {:.1}/s",
                self.requests, self.rate_per_s
            );
            let _ = writeln!(
                s,
                "  body bytes     {:>10}  {:.4} GB/s  ({:.1} MiB/s)",
                self.bytes,
                self.gbytes_per_s,
                self.gbytes_per_s * 1e9 / 1048576.0
            );
            let _ = writeln!(s, "  latency µs     {}", lat(&self.latency_us));
            let _ = writeln!(
                s,
                "  connections    {} handshakes (full {}, resumed {})",
                self.handshakes, self.full, self.resumed
            );
        }
        if self.failures.is_empty() {
            let _ = writeln!(s, "  failures       0");
        } else {
            let _ = writeln!(s, "  failures       {}", self.failures_total);
            for (k, v) in &self.failures {
                let _ = writeln!(s, "    {v:>10}  {k}");
            }
        }
        let _ = write!(s, "  client CPU     {:.3} s", self.client_cpu_s);
        if let Some(c) = self.client_cpu_us_per_handshake {
            let _ = write!(s, "  = {c:.1} µs/handshake");
        }
        if let Some(c) = self.client_cpu_s_per_gb {
            let _ = write!(s, "  = {c:.3} s/GB");
        }
        let _ = writeln!(s, "  (/proc/self/stat, 10 ms ticks)");
        let _ = writeln!(s, "  versions       {}", top(&self.versions));
        let _ = writeln!(s, "  suites         {}", top(&self.suites));
        let _ = writeln!(s, "  groups         {}", top(&self.groups));
        s
    }
}

// ---------------------------------------------------------------- flood

/// Why one flood attempt did not get the server's whole first flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FloodFailure {
    /// Nothing listening (RST to the SYN).
    ConnectRefused,
    /// Any other connect (or socket) error.
    Connect(io::ErrorKind),
    /// The server reset the connection before its first flight was complete.
    ResetByServer,
    /// The attempt took longer than `--timeout`.
    Timeout,
    /// The server closed (FIN) before its first flight was complete.
    ClosedEarly,
    /// The server answered with a TLS alert record instead of its flight.
    Alert,
    /// Any other error while sending the ClientHello or reading.
    Io(io::ErrorKind),
}

impl FloodFailure {
    pub(crate) fn from_connect(e: &io::Error) -> FloodFailure {
        match e.kind() {
            io::ErrorKind::ConnectionRefused => FloodFailure::ConnectRefused,
            io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => FloodFailure::Timeout,
            k => FloodFailure::Connect(k),
        }
    }

    pub(crate) fn from_io(e: &io::Error) -> FloodFailure {
        match e.kind() {
            io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe => FloodFailure::ResetByServer,
            io::ErrorKind::UnexpectedEof => FloodFailure::ClosedEarly,
            io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => FloodFailure::Timeout,
            k => FloodFailure::Io(k),
        }
    }

    /// The key under which the failure is counted.
    pub(crate) fn reason(&self) -> String {
        match self {
            FloodFailure::ConnectRefused => "connect_refused".into(),
            FloodFailure::Connect(k) => format!("connect: {k:?}"),
            FloodFailure::ResetByServer => "reset_by_server".into(),
            FloodFailure::Timeout => "timeout".into(),
            FloodFailure::ClosedEarly => "closed_early".into(),
            FloodFailure::Alert => "alert".into(),
            FloodFailure::Io(k) => format!("io: {k:?}"),
        }
    }
}

/// Counters of one flood loop (or several, merged).
pub(crate) struct FloodStats {
    /// Connect start to the last record of the server's first flight, µs.
    pub latency: Histogram<u64>,
    pub attempts: u64,
    pub flights: u64,
    /// Failures by kind; the reason string is built once per kind.
    pub failures: Vec<(FloodFailure, u64)>,
}

impl Default for FloodStats {
    fn default() -> Self {
        FloodStats {
            latency: new_hist(),
            attempts: 0,
            flights: 0,
            failures: Vec::new(),
        }
    }
}

impl FloodStats {
    pub(crate) fn flight(&mut self, latency: Duration) {
        self.attempts += 1;
        self.flights += 1;
        self.latency.saturating_record(micros(latency));
    }

    pub(crate) fn failure(&mut self, f: FloodFailure) {
        self.attempts += 1;
        match self.failures.iter_mut().find(|(g, _)| *g == f) {
            Some((_, n)) => *n += 1,
            None => self.failures.push((f, 1)),
        }
    }

    pub(crate) fn merge(&mut self, o: FloodStats) {
        self.latency.add(&o.latency).expect("same histogram bounds");
        self.attempts += o.attempts;
        self.flights += o.flights;
        for (f, n) in o.failures {
            match self.failures.iter_mut().find(|(g, _)| *g == f) {
                Some((_, m)) => *m += n,
                None => self.failures.push((f, n)),
            }
        }
    }
}

/// What the probe handshake learnt about the server's first flight.
#[derive(Serialize, Debug, Clone, Default, PartialEq)]
pub struct FlightShape {
    /// Records up to and including the one that completes the flight.
    pub records: u32,
    /// Their total size on the wire (headers included).
    pub bytes: usize,
    /// Content type of each record (22 handshake, 20 change_cipher_spec,
    /// 23 application data: TLS 1.3's encrypted handshake).
    pub record_types: Vec<u8>,
    pub version: String,
    pub suite: String,
    pub group: String,
}

/// The result of `bench flood` (`--json` prints it as one object).
#[derive(Serialize, Debug, Clone)]
pub struct FloodReport {
    /// "flood".
    pub mode: &'static str,
    pub target: String,
    /// Connections kept in flight.
    pub concurrency: usize,
    /// OS threads (current-thread tokio runtimes) actually used.
    pub threads: usize,
    /// Measured wall time.
    pub duration_s: f64,
    /// Attempts finished in the measured phase (flights + failures).
    pub attempts: u64,
    /// Server first flights received in full: handshakes the server paid an
    /// ECDHE and a signature for, and that were then reset.
    pub flights: u64,
    /// `flights` per second.
    pub rate_per_s: f64,
    /// Failures by kind: connect_refused, reset_by_server, timeout,
    /// closed_early, alert, "connect: ..." or "io: ..." for anything else.
    pub failures: BTreeMap<String, u64>,
    pub failures_total: u64,
    /// Connect start to the end of the server's first flight.
    pub latency_us: Latency,
    /// Client process user+system CPU during the measured phase.
    pub client_cpu_s: f64,
    /// `client_cpu_s` over the measured wall time, in % of one core.
    pub client_cpu_percent: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_cpu_us_per_flight: Option<f64>,
    /// Size of the canned ClientHello sent on every connection.
    pub client_hello_bytes: usize,
    /// Records counted as the server's first flight.
    pub flight_records: u32,
    /// The probe handshake's findings (absent with `--flight-records`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub probe: Option<FlightShape>,
}

pub(crate) struct FloodRunInfo {
    pub target: String,
    pub concurrency: usize,
    pub threads: usize,
    pub elapsed: Duration,
    pub cpu: Duration,
    pub client_hello_bytes: usize,
    pub flight_records: u32,
    pub probe: Option<FlightShape>,
}

impl FloodReport {
    pub(crate) fn build(info: FloodRunInfo, st: &FloodStats) -> FloodReport {
        let secs = info.elapsed.as_secs_f64().max(1e-9);
        let cpu = info.cpu.as_secs_f64();
        let failures: BTreeMap<String, u64> =
            st.failures.iter().map(|(f, n)| (f.reason(), *n)).collect();
        FloodReport {
            mode: "flood",
            target: info.target,
            concurrency: info.concurrency,
            threads: info.threads,
            duration_s: round(secs, 3),
            attempts: st.attempts,
            flights: st.flights,
            rate_per_s: round(st.flights as f64 / secs, 1),
            failures_total: failures.values().sum(),
            failures,
            latency_us: Latency::of(&st.latency),
            client_cpu_s: round(cpu, 3),
            client_cpu_percent: round(cpu / secs * 100.0, 1),
            client_cpu_us_per_flight: (st.flights > 0)
                .then(|| round(cpu * 1e6 / st.flights as f64, 1)),
            client_hello_bytes: info.client_hello_bytes,
            flight_records: info.flight_records,
            probe: info.probe,
        }
    }

    /// The human-readable report.
    pub fn to_text(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "flood bench  {}  concurrency={} threads={}  measured {:.3} s",
            self.target, self.concurrency, self.threads, self.duration_s
        );
        let _ = writeln!(
            s,
            "  first flights  {:>10}  {:.1}/s  ({} attempts)",
            self.flights, self.rate_per_s, self.attempts
        );
        let _ = writeln!(s, "  latency µs     {}", self.latency_us.to_text());
        if self.failures.is_empty() {
            let _ = writeln!(s, "  failures       0");
        } else {
            let _ = writeln!(s, "  failures       {}", self.failures_total);
            for (k, v) in &self.failures {
                let _ = writeln!(s, "    {v:>10}  {k}");
            }
        }
        let _ = write!(
            s,
            "  client CPU     {:.3} s = {:.1}% of one core",
            self.client_cpu_s, self.client_cpu_percent
        );
        if let Some(c) = self.client_cpu_us_per_flight {
            let _ = write!(s, "  = {c:.1} µs/flight");
        }
        let _ = writeln!(s, "  (/proc/self/stat, 10 ms ticks)");
        let _ = write!(
            s,
            "  ClientHello    {} bytes, first flight = {} records",
            self.client_hello_bytes, self.flight_records
        );
        match &self.probe {
            Some(p) => {
                let _ = writeln!(
                    s,
                    " ({} bytes, types {:?}; probe: {} {} {})",
                    p.bytes, p.record_types, p.version, p.suite, p.group
                );
            }
            None => {
                let _ = writeln!(s, " (--flight-records, no probe)");
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn neg(v: ProtocolVersion, g: Option<NamedGroup>) -> Negotiated {
        Negotiated {
            version: Some(v),
            suite: Some(CipherSuite::TLS13_AES_128_GCM_SHA256),
            group: g,
        }
    }

    fn info(mode: Mode, secs: f64, cpu_ms: u64) -> RunInfo {
        RunInfo {
            mode,
            target: "127.0.0.1:1".into(),
            engine: "blocking",
            connections: 2,
            threads: 2,
            elapsed: Duration::from_secs_f64(secs),
            cpu: Duration::from_millis(cpu_ms),
        }
    }

    #[test]
    fn handshake_report_math() {
        let mut a = Stats::default();
        let mut b = Stats::default();
        let n = neg(ProtocolVersion::TLSv1_3, Some(NamedGroup::X25519));
        for i in 1..=100u64 {
            let s = if i % 2 == 0 { &mut a } else { &mut b };
            let kind = if i <= 10 {
                HandshakeKind::Full
            } else if i <= 12 {
                HandshakeKind::FullWithHelloRetryRequest
            } else {
                HandshakeKind::Resumed
            };
            s.handshake(Some(kind), n, Duration::from_micros(i * 10), true);
        }
        b.handshake(
            Some(HandshakeKind::Resumed),
            neg(ProtocolVersion::TLSv1_2, None),
            Duration::from_micros(5),
            true,
        );
        a.failure(&Failure::Timeout);
        b.failure(&Failure::Timeout);
        b.failure(&Failure::BadStatus(503));
        a.merge(b);
        let r = Report::build(
            info(
                Mode::Handshake {
                    with_request: false,
                },
                2.0,
                300,
            ),
            &a,
        );
        assert_eq!(r.handshakes, 101);
        assert_eq!(r.full, 12);
        assert_eq!(r.full_with_hrr, 2);
        assert_eq!(r.resumed, 89);
        assert_eq!(r.rate_per_s, 50.5);
        assert_eq!(r.failures_total, 3);
        assert_eq!(r.failures["timeout"], 2);
        assert_eq!(r.failures["bad_status: 503"], 1);
        // 0.3 s of CPU over 101 handshakes.
        assert_eq!(r.client_cpu_us_per_handshake, Some(2970.3));
        assert_eq!(r.client_cpu_s_per_gb, None);
        assert_eq!(r.latency_us.max, 1000);
        assert_eq!(r.latency_us.p50, 500);
        assert_eq!(r.latency_us.p90, 900);
        assert_eq!(r.latency_us.p99, 990);
        assert!(r.response_latency_us.is_none());
        assert_eq!(r.versions["TLSv1.3"], 100);
        assert_eq!(r.versions["TLSv1.2"], 1);
        assert_eq!(r.suites["TLS13_AES_128_GCM_SHA256"], 101);
        assert_eq!(r.groups["X25519"], 100);
        assert_eq!(r.groups["none"], 1);

        let json: serde_json::Value = serde_json::to_value(&r).unwrap();
        for key in [
            "mode",
            "target",
            "connections",
            "threads",
            "duration_s",
            "handshakes",
            "full",
            "resumed",
            "failures",
            "rate_per_s",
            "latency_us",
            "client_cpu_us_per_handshake",
            "bytes",
            "gbytes_per_s",
            "versions",
            "suites",
        ] {
            assert!(json.get(key).is_some(), "missing {key}");
        }
        assert!(json.get("client_cpu_s_per_gb").is_none());
        assert!(r.to_text().contains("µs/handshake"));
    }

    #[test]
    fn throughput_report_math() {
        let mut s = Stats::default();
        for _ in 0..1000 {
            s.request(Duration::from_micros(200), 1_000_000);
        }
        let r = Report::build(info(Mode::Throughput, 4.0, 500), &s);
        assert_eq!(r.requests, 1000);
        assert_eq!(r.bytes, 1_000_000_000);
        assert_eq!(r.rate_per_s, 250.0);
        assert_eq!(r.gbytes_per_s, 0.25);
        assert_eq!(r.client_cpu_s_per_gb, Some(0.5));
        assert_eq!(r.client_cpu_us_per_handshake, None);
        assert_eq!(r.latency_us.p50, 200);
        assert!(r.to_text().contains("s/GB"));
    }

    #[test]
    fn empty_report_has_no_nan() {
        let r = Report::build(
            info(Mode::Handshake { with_request: true }, 0.0, 0),
            &Stats::default(),
        );
        assert_eq!(r.client_cpu_us_per_handshake, None);
        assert_eq!(r.latency_us, Latency::default());
        assert_eq!(r.response_latency_us, Some(Latency::default()));
        let text = serde_json::to_string(&r).unwrap();
        assert!(!text.contains("NaN") && !text.contains("null,\"client_cpu_us"));
    }

    #[test]
    fn flood_report_math() {
        let mut a = FloodStats::default();
        let mut b = FloodStats::default();
        for i in 1..=100u64 {
            a.flight(Duration::from_micros(i * 100));
        }
        a.failure(FloodFailure::Timeout);
        b.failure(FloodFailure::Timeout);
        b.failure(FloodFailure::ResetByServer);
        b.failure(FloodFailure::from_connect(&io::Error::from(
            io::ErrorKind::ConnectionRefused,
        )));
        b.failure(FloodFailure::from_io(&io::Error::from(
            io::ErrorKind::UnexpectedEof,
        )));
        b.failure(FloodFailure::from_io(&io::Error::from(
            io::ErrorKind::BrokenPipe,
        )));
        b.failure(FloodFailure::Connect(io::ErrorKind::AddrNotAvailable));
        a.merge(b);
        let r = FloodReport::build(
            FloodRunInfo {
                target: "127.0.0.1:1".into(),
                concurrency: 8,
                threads: 1,
                elapsed: Duration::from_secs(2),
                cpu: Duration::from_millis(500),
                client_hello_bytes: 247,
                flight_records: 3,
                probe: None,
            },
            &a,
        );
        assert_eq!((r.attempts, r.flights), (107, 100));
        assert_eq!(r.rate_per_s, 50.0);
        assert_eq!(r.failures_total, 7);
        assert_eq!(r.failures["timeout"], 2);
        assert_eq!(r.failures["reset_by_server"], 2);
        assert_eq!(r.failures["connect_refused"], 1);
        assert_eq!(r.failures["closed_early"], 1);
        assert_eq!(r.failures["connect: AddrNotAvailable"], 1);
        assert_eq!(r.client_cpu_percent, 25.0);
        assert_eq!(r.client_cpu_us_per_flight, Some(5000.0));
        assert!(
            (9990..=10010).contains(&r.latency_us.max),
            "{}",
            r.latency_us.max
        );
        let json: serde_json::Value = serde_json::to_value(&r).unwrap();
        assert_eq!(json["mode"], "flood");
        for key in [
            "concurrency",
            "flights",
            "rate_per_s",
            "failures",
            "latency_us",
            "client_cpu_s",
            "client_cpu_percent",
            "client_hello_bytes",
            "flight_records",
        ] {
            assert!(json.get(key).is_some(), "missing {key}");
        }
        assert!(json.get("probe").is_none());
        assert!(r.to_text().contains("% of one core"));

        let r = FloodReport::build(
            FloodRunInfo {
                target: "x".into(),
                concurrency: 1,
                threads: 1,
                elapsed: Duration::ZERO,
                cpu: Duration::ZERO,
                client_hello_bytes: 0,
                flight_records: 1,
                probe: Some(FlightShape::default()),
            },
            &FloodStats::default(),
        );
        let text = serde_json::to_string(&r).unwrap();
        assert!(!text.contains("NaN") && !text.contains("null"), "{text}");
    }

    #[test]
    fn failure_classification() {
        let e = io::Error::new(
            io::ErrorKind::InvalidData,
            rustls::Error::AlertReceived(rustls::AlertDescription::HandshakeFailure),
        );
        let f = Failure::from_io(e, true);
        assert_eq!(
            f.reason(),
            "handshake: received fatal alert: HandshakeFailure"
        );
        let f = Failure::from_io(io::Error::from(io::ErrorKind::WouldBlock), true);
        assert_eq!(f.reason(), "timeout");
        let f = Failure::from_io(io::Error::from(io::ErrorKind::ConnectionReset), false);
        assert_eq!(f.reason(), "io: ConnectionReset");
        let f = Failure::from_connect(io::Error::from(io::ErrorKind::ConnectionRefused));
        assert_eq!(f.reason(), "connect: ConnectionRefused");
    }
}
