//! The access log shared by `serve` and `proxy`: one line per request (proxy TCP mode: per
//! connection), written once its response has been sent, so that the bytes and the duration
//! are known.
//!
//! Without `--access-log-file` lines go to stderr through `tracing`, as they always did. With
//! it they are appended to the file, opened with O_APPEND and written by one write(2) per line
//! with no buffer in between (nothing is lost when the process exits, and lines from several
//! workers never interleave). The file is opened again at each reload (SIGHUP), so rotation
//! is: rename the file, then `tlsplane reload`; new lines go to a new file at the path.
//!
//! A handler holds an `Option<AccessLog>`: with the log off nothing here runs, so a request
//! pays no clock read, copy or allocation for it.

use std::fs::File;
use std::io::Write;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, SystemTime};

/// How a line is written (`--access-log-format`).
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Format {
    /// `key=value` fields.
    #[default]
    Text,
    /// nginx's `combined` format.
    Combined,
    /// One JSON object per line.
    Json,
}

/// The access log of one configuration generation.
pub struct AccessLog {
    format: Format,
    /// `None`: lines go to stderr through `tracing`.
    file: Option<File>,
    /// A write failed already (a full disk would otherwise give a warning per request).
    write_failed: std::sync::atomic::AtomicBool,
}

/// What one line says. Byte strings are the client's, as sent (escaped when written).
pub struct Entry<'a> {
    pub peer: SocketAddr,
    pub host: Option<&'a [u8]>,
    /// `None` for a proxied TCP connection, which has no request.
    pub request: Option<RequestLine<'a>>,
    /// `None` when no status was sent (a TCP connection; a response cut by a reset).
    pub status: Option<u16>,
    /// Response body bytes sent to the client.
    pub bytes: u64,
    /// From the request head's arrival (TCP mode: the connection's) to the response's last
    /// byte.
    pub duration: Duration,
    pub user_agent: Option<&'a [u8]>,
    pub referer: Option<&'a [u8]>,
    pub plane: &'a str,
    pub server_name: Option<&'a str>,
    /// Proxy: the backend that answered.
    pub backend: Option<&'a str>,
    /// Proxy TCP mode: how the connection ended.
    pub outcome: Option<&'a str>,
}

impl<'a> Entry<'a> {
    /// A request refused before it was parsed (a bad head): no request fields, the reason as
    /// its outcome.
    pub fn refused(
        tls: &'a tlsplane::TlsStream,
        peer: SocketAddr,
        status: u16,
        bytes: u64,
        duration: Duration,
        why: &'a str,
    ) -> Self {
        Entry {
            peer,
            host: None,
            request: None,
            status: Some(status),
            bytes,
            duration,
            user_agent: None,
            referer: None,
            plane: tls.plane().as_str(),
            server_name: tls.info().server_name.as_deref(),
            backend: None,
            outcome: Some(why),
        }
    }
}

pub struct RequestLine<'a> {
    pub method: &'a str,
    pub target: &'a str,
    /// As logged: `HTTP/1.0`, `HTTP/1.1` (see [`http1`]) or `HTTP/2.0`.
    pub protocol: &'static str,
}

impl AccessLog {
    /// The access log `--access-log` (`on`), `--access-log-file` (`file`) and
    /// `--access-log-format` ask for, if any; the file (if any) is opened now. Products call
    /// it through `ServerArgs::access_log`.
    pub fn open(
        on: bool,
        file: Option<&Path>,
        format: Format,
    ) -> anyhow::Result<Option<AccessLog>> {
        if !on && file.is_none() {
            return Ok(None);
        }
        let file = match file {
            Some(path) => Some(open_append(path)?),
            None => None,
        };
        Ok(Some(AccessLog {
            format,
            file,
            write_failed: Default::default(),
        }))
    }

    pub fn write(&self, e: &Entry<'_>) {
        let line = match self.format {
            Format::Text if self.file.is_none() => {
                // As before: structured fields through tracing.
                let request = e.request.as_ref();
                tracing::info!(
                    peer = %e.peer,
                    host = %Lossy(e.host),
                    method = %request.map_or("-", |r| r.method),
                    target = %request.map_or("-", |r| r.target),
                    protocol = %request.map_or("-", |r| r.protocol),
                    status = e.status.unwrap_or(0),
                    bytes = e.bytes,
                    duration = e.duration.as_secs_f64(),
                    user_agent = %Lossy(e.user_agent),
                    referer = %Lossy(e.referer),
                    plane = %e.plane,
                    server_name = %e.server_name.unwrap_or("-"),
                    backend = %e.backend.unwrap_or("-"),
                    outcome = %e.outcome.unwrap_or("-"),
                    "{}",
                    if request.is_some() {
                        "request"
                    } else {
                        "connection"
                    }
                );
                return;
            }
            Format::Text => text(e, SystemTime::now()),
            Format::Combined => combined(e, SystemTime::now()),
            Format::Json => json(e, SystemTime::now()),
        };
        match &self.file {
            Some(f) => {
                // One write(2) of the whole line: O_APPEND makes it atomic against the other
                // workers' lines for a regular file.
                if let Err(err) = (&*f).write_all(line.as_bytes()) {
                    use std::sync::atomic::Ordering::Relaxed;
                    if !self.write_failed.swap(true, Relaxed) {
                        tracing::warn!(error = %err, "access log write failed (further failures until the next reload are not reported)");
                    }
                }
            }
            None => tracing::info!("{}", line.trim_end()),
        }
    }
}

fn open_append(path: &Path) -> anyhow::Result<File> {
    use anyhow::Context;
    std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(path)
        .with_context(|| format!("cannot open the access log {}", path.display()))
}

/// The protocol of an HTTP/1 request, as logged: 0 for HTTP/1.0, else HTTP/1.1 (later minor
/// versions are served as 1.1).
pub fn http1(minor_version: u8) -> &'static str {
    if minor_version == 0 {
        "HTTP/1.0"
    } else {
        "HTTP/1.1"
    }
}

/// A client's bytes for a text or tracing line: `-` when absent.
struct Lossy<'a>(Option<&'a [u8]>);

impl std::fmt::Display for Lossy<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            None => f.write_str("-"),
            Some(b) => f.write_str(&escape(b)),
        }
    }
}

/// nginx's escaping of logged variables: `"`, `\`, control bytes and bytes outside ASCII
/// as `\xHH`, so that a line cannot be split or a field closed by what a client sent.
fn escape(b: &[u8]) -> String {
    let mut out = String::with_capacity(b.len());
    for &c in b {
        if c == b'"' || c == b'\\' || !(0x20..0x7f).contains(&c) {
            out.push_str(&format!("\\x{c:02X}"));
        } else {
            out.push(c as char);
        }
    }
    out
}

fn dash_or_escaped(b: Option<&[u8]>) -> String {
    b.map_or_else(|| "-".to_owned(), escape)
}

fn text(e: &Entry<'_>, now: SystemTime) -> String {
    let request = e.request.as_ref();
    format!(
        "{} peer={} host={} method={} target={} protocol={} status={} bytes={} duration={:.6} \
         user_agent=\"{}\" referer=\"{}\" plane={} server_name={} backend={}{}\n",
        iso8601(now),
        e.peer,
        dash_or_escaped(e.host),
        request.map_or("-".into(), |r| escape(r.method.as_bytes())),
        request.map_or("-".into(), |r| escape(r.target.as_bytes())),
        request.map_or("-", |r| r.protocol),
        e.status.map_or("-".into(), |s| s.to_string()),
        e.bytes,
        e.duration.as_secs_f64(),
        dash_or_escaped(e.user_agent),
        dash_or_escaped(e.referer),
        e.plane,
        e.server_name.unwrap_or("-"),
        e.backend.unwrap_or("-"),
        e.outcome.map_or(String::new(), |o| format!(" outcome={o}")),
    )
}

/// nginx's `combined`:
/// `$remote_addr - $remote_user [$time_local] "$request" $status $body_bytes_sent
/// "$http_referer" "$http_user_agent"` (time in UTC).
fn combined(e: &Entry<'_>, now: SystemTime) -> String {
    let request = match &e.request {
        Some(r) => escape(format!("{} {} {}", r.method, r.target, r.protocol).as_bytes()),
        None => "-".into(),
    };
    format!(
        "{} - - [{}] \"{}\" {} {} \"{}\" \"{}\"\n",
        e.peer.ip(),
        clf_time(now),
        request,
        e.status.unwrap_or(0),
        e.bytes,
        dash_or_escaped(e.referer),
        dash_or_escaped(e.user_agent),
    )
}

fn json(e: &Entry<'_>, now: SystemTime) -> String {
    let lossy = |b: Option<&[u8]>| b.map(|b| String::from_utf8_lossy(b).into_owned());
    let request = e.request.as_ref();
    let mut line = serde_json::json!({
        "time": iso8601(now),
        "peer": e.peer.to_string(),
        "host": lossy(e.host),
        "method": request.map(|r| r.method),
        "target": request.map(|r| r.target),
        "protocol": request.map(|r| r.protocol),
        "status": e.status,
        "bytes": e.bytes,
        "duration": e.duration.as_secs_f64(),
        "user_agent": lossy(e.user_agent),
        "referer": lossy(e.referer),
        "plane": e.plane,
        "server_name": e.server_name,
        "backend": e.backend,
        "outcome": e.outcome,
    })
    .to_string();
    line.push('\n');
    line
}

/// (year, month 1-12, day, hour, minute, second) in UTC.
fn civil(t: SystemTime) -> (i64, u32, u32, u64, u64, u64) {
    let secs = t
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rem) = ((secs / 86400) as i64, secs % 86400);
    // Howard Hinnant's days_from_civil, inverted.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day, rem / 3600, rem / 60 % 60, rem % 60)
}

fn iso8601(t: SystemTime) -> String {
    let (y, mo, d, h, mi, s) = civil(t);
    format!("{y:04}-{mo:02}-{d:02}T{h:02}:{mi:02}:{s:02}Z")
}

/// `10/Oct/2000:13:55:36 +0000`.
fn clf_time(t: SystemTime) -> String {
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    let (y, mo, d, h, mi, s) = civil(t);
    format!(
        "{d:02}/{}/{y:04}:{h:02}:{mi:02}:{s:02} +0000",
        MONTHS[mo as usize - 1]
    )
}

/// The value of header field `name` in a request head (the first such field), for the log
/// only: the head was already parsed and checked, so a plain line scan is enough.
pub fn header<'a>(head: &'a [u8], name: &str) -> Option<&'a [u8]> {
    head.split(|&b| b == b'\n').skip(1).find_map(|line| {
        let colon = line.iter().position(|&b| b == b':')?;
        if !line[..colon].eq_ignore_ascii_case(name.as_bytes()) {
            return None;
        }
        let value = &line[colon + 1..];
        let start = value.iter().position(|&b| b != b' ' && b != b'\t')?;
        let end = value
            .iter()
            .rposition(|&b| b != b' ' && b != b'\t' && b != b'\r')?;
        Some(&value[start..=end])
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates() {
        let t = SystemTime::UNIX_EPOCH + Duration::from_secs(971_186_136);
        assert_eq!(clf_time(t), "10/Oct/2000:13:55:36 +0000");
        assert_eq!(iso8601(t), "2000-10-10T13:55:36Z");
        let leap = SystemTime::UNIX_EPOCH + Duration::from_secs(951_782_400);
        assert_eq!(iso8601(leap), "2000-02-29T00:00:00Z");
    }

    #[test]
    fn escapes_as_nginx() {
        assert_eq!(escape(b"a\"b\\c\x01\xff"), "a\\x22b\\x5Cc\\x01\\xFF");
    }

    #[test]
    fn finds_header_values() {
        let head = b"GET / HTTP/1.1\r\nHost: a\r\nuser-agent:  curl/8 \r\nX: y\r\n\r\n";
        assert_eq!(header(head, "User-Agent"), Some(&b"curl/8"[..]));
        assert_eq!(header(head, "Referer"), None);
        assert_eq!(header(head, "Host"), Some(&b"a"[..]));
    }
}
