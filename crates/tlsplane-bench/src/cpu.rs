//! The client's own CPU time, from `/proc/self/stat` (no unsafe, no libc).

use std::io;
use std::time::Duration;

/// `sysconf(_SC_CLK_TCK)`: 100 on every Linux architecture Rust targets
/// (the kernel's USER_HZ), so /proc times are in 10 ms ticks.
const CLK_TCK: u64 = 100;

/// User + system CPU time of this whole process (all threads, live and exited).
pub(crate) fn process_cpu_time() -> io::Result<Duration> {
    parse_stat(&std::fs::read_to_string("/proc/self/stat")?)
}

/// Parses utime (field 14) + stime (field 15) of a `/proc/PID/stat` line.
pub(crate) fn parse_stat(stat: &str) -> io::Result<Duration> {
    let bad = || {
        io::Error::new(
            io::ErrorKind::InvalidData,
            "unexpected /proc/self/stat format",
        )
    };
    // Field 2 (comm) is parenthesised and may contain spaces or ')': the
    // remaining fields start after the last ')', with field 3 (state).
    let rest = &stat[stat.rfind(')').ok_or_else(bad)? + 1..];
    let mut fields = rest.split_ascii_whitespace().skip(14 - 3);
    let utime: u64 = fields.next().and_then(|f| f.parse().ok()).ok_or_else(bad)?;
    let stime: u64 = fields.next().and_then(|f| f.parse().ok()).ok_or_else(bad)?;
    let ticks = utime + stime;
    Ok(Duration::from_millis(ticks * 1000 / CLK_TCK))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_fields_14_and_15() {
        let line = "4242 (tls (bench) x) R 1 4242 4242 0 -1 4194304 100 0 0 0 \
                    123 45 0 0 20 0 3 0 1000 1000000 500 18446744073709551615";
        assert_eq!(parse_stat(line).unwrap(), Duration::from_millis(1680));
    }

    #[test]
    fn rejects_garbage() {
        assert!(parse_stat("nonsense").is_err());
        assert!(parse_stat("1 (x) R 1 2").is_err());
    }

    #[test]
    fn reads_own_stat() {
        let a = process_cpu_time().unwrap();
        let mut x = 0u64;
        for i in 0..5_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(std::hint::black_box(i));
        }
        std::hint::black_box(x);
        assert!(process_cpu_time().unwrap() >= a);
    }
}
