//! HTTP/2 conformance: h2spec (github.com/summerwind/h2spec, installed by `scripts/setup-tests.sh`, which the test command runs) against
//! `serve --alpn h2,http/1.1`, every case including the strict ones (`-S`). Each case must
//! pass, except those listed in [`EXPECTED_FAILURES`] (docs/HTTP2.md, "Conformance and
//! abuse", says why for each; today there are none).
//!
//! h2spec is a Go program, not a Debian package: without it the test is skipped with a notice,
//! except in CI (`CI=true`), where the test command has installed it and its absence is a failure.

use std::time::Duration;

use crate::support::fixtures;
use crate::support::tools;
use crate::support::Server;

/// Case ids (h2spec's `section/number`, as `h2spec http2/6.9.1/3` runs one) that fail and
/// are explained in docs/HTTP2.md. Empty: all 146 cases of h2spec 2.2.1 pass.
const EXPECTED_FAILURES: &[&str] = &[];

/// Cases h2spec 2.2.1 runs with `-S`; fewer would mean some were not run at all.
const CASES: usize = 146;

/// The outcome of each case of a JUnit report: (id, passed).
fn cases(report: &str) -> Vec<(String, bool)> {
    let mut out = Vec::new();
    // Each <testsuite package="http2/6.9.1" ...> holds its cases in order; a case's number is
    // its position (h2spec's own numbering).
    for suite in report.split("<testsuite ").skip(1) {
        let package = attr(suite, "package").unwrap_or_else(|| panic!("no package: {suite}"));
        for (i, case) in suite.split("<testcase ").skip(1).enumerate() {
            let body = case.split("</testcase>").next().unwrap_or(case);
            let failed = body.contains("<failure") || body.contains("<error");
            let skipped = body.contains("<skipped");
            assert!(!skipped, "h2spec skipped {package}/{}: {body}", i + 1);
            out.push((format!("{package}/{}", i + 1), !failed));
        }
    }
    out
}

fn attr<'a>(tag: &'a str, name: &str) -> Option<&'a str> {
    let start = tag.find(&format!("{name}=\""))? + name.len() + 2;
    let len = tag[start..].find('"')?;
    Some(&tag[start..start + len])
}

/// h2spec, or None (after saying so) where it is not installed outside CI.
pub(crate) fn h2spec() -> Option<std::path::PathBuf> {
    let Some(h2spec) = tools::find_in_path("h2spec") else {
        if std::env::var("CI").as_deref() == Ok("true") {
            panic!("CI=true and h2spec is not installed: scripts/setup-tests.sh builds it with Go");
        }
        eprintln!("SKIPPED: h2spec is not installed (scripts/setup-tests.sh builds it; by hand: GOBIN=~/go/bin go install github.com/summerwind/h2spec/cmd/h2spec@v2.2.1+incompatible)");
        return None;
    };
    Some(h2spec)
}

#[test]
fn h2spec_every_case_passes_or_is_explained() {
    let Some(h2spec) = h2spec() else { return };
    let server = Server::builder().arg("--alpn").arg("h2,http/1.1").start();
    every_case_passes(&h2spec, server.port(), "serve");
    // Each case's client errors are answered, never a panic (Server::stop checks stderr).
    server.stop();
}

/// Runs all of h2spec's cases against `port`: the failures must be [`EXPECTED_FAILURES`].
pub(crate) fn every_case_passes(h2spec: &std::path::Path, port: u16, name: &str) {
    let dir = fixtures::get().base.join(format!("h2spec-{name}"));
    std::fs::create_dir_all(&dir).expect("report dir");
    let report = dir.join("report.xml");
    let _ = std::fs::remove_file(&report);
    let mut c = std::process::Command::new(h2spec);
    // -t TLS (ALPN h2), -k the test CA is not in h2spec's trust store, -S strict cases too,
    // -o each case's timeout in seconds.
    c.args(["-t", "-k", "-S", "-h", "127.0.0.1", "-o", "2"])
        .args(["-p", &port.to_string()])
        .arg("-j")
        .arg(&report);
    let out = tools::run(c, b"", Duration::from_secs(120));
    let text = out.stdout_text();
    let summary = text
        .lines()
        .find(|l| l.contains(" tests, "))
        .unwrap_or_else(|| panic!("no h2spec summary: {}", out.describe()));
    eprintln!("h2spec: {summary}");
    let xml = std::fs::read_to_string(&report)
        .unwrap_or_else(|e| panic!("no h2spec report ({e}): {}", out.describe()));
    let cases = cases(&xml);
    assert_eq!(cases.len(), CASES, "{summary}");
    let failed: Vec<&str> = cases
        .iter()
        .filter(|(_, passed)| !passed)
        .map(|(id, _)| id.as_str())
        .collect();
    assert_eq!(
        failed,
        EXPECTED_FAILURES,
        "h2spec failures differ from the documented ones (docs/HTTP2.md):\n{}",
        text.split("Failures:").nth(1).unwrap_or(&text)
    );
    // h2spec's exit status agrees with its report (non-zero exactly when a case failed).
    assert_eq!(
        out.status.success(),
        failed.is_empty(),
        "{}",
        out.describe()
    );
}
