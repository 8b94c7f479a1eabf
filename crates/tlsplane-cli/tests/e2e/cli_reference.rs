//! docs/CLI.md is the `--help` of `tlsplane` and of each of its commands, rendered from the
//! built binary, so that the option reference cannot drift from the clap definitions. The
//! test fails when the file differs; `TLSPLANE_BLESS=1` writes it instead:
//!
//!     TLSPLANE_BLESS=1 cargo test --profile test-release -p tlsplane-cli --test e2e -- cli_reference
//!
//! The rendering is deterministic: the binary runs with an empty environment (clap shows the
//! values of `env` variables it reads), `COLUMNS` fixed, and `argv[0]` = `tlsplane`, and clap
//! is built without `wrap_help`, so help wraps at its fixed width, never the terminal's.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::support::server_bin;

const REGENERATE: &str =
    "TLSPLANE_BLESS=1 cargo test --profile test-release -p tlsplane-cli --test e2e -- cli_reference";

/// `tlsplane ARGS`, its standard output, with no environment but a fixed width.
fn help(args: &[&str]) -> String {
    let out = Command::new(server_bin())
        .arg0("tlsplane")
        .args(args)
        .env_clear()
        .env("COLUMNS", "100")
        .output()
        .expect("run tlsplane");
    assert!(
        out.status.success(),
        "tlsplane {}: {}\n{}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("help is UTF-8");
    let lines: Vec<&str> = text.lines().map(str::trim_end).collect();
    lines.join("\n").trim_end().to_string()
}

/// The names listed under `Commands:` in the top-level help, but `help`.
fn commands(top: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut inside = false;
    for line in top.lines() {
        if line.starts_with("Commands:") {
            inside = true;
            continue;
        }
        if inside {
            if !line.starts_with(' ') {
                break;
            }
            // A command's name is indented by two spaces; its wrapped help by more.
            if line.starts_with("  ") && !line.starts_with("   ") {
                let name = line.split_whitespace().next().expect("a command name");
                if name != "help" {
                    names.push(name.to_string());
                }
            }
        }
    }
    assert!(
        !names.is_empty(),
        "no commands in `tlsplane --help`:\n{top}"
    );
    names
}

/// The whole of docs/CLI.md.
fn render() -> String {
    let top = help(&["--help"]);
    let mut md = String::from(
        "# tlsplane command-line reference\n\n\
         Generated from the program's `--help` by the e2e test `cli_reference`\n\
         (`crates/tlsplane-cli/tests/e2e/cli_reference.rs`); do not edit by hand. After a\n\
         change to an option, regenerate it with\n\n",
    );
    md.push_str(&format!("```sh\n{REGENERATE}\n```\n\n"));
    md.push_str(
        "Options explained at more length, with the metrics, reloads and logging:\n\
         [USAGE.md](USAGE.md). The configuration file: [CONFIG.md](CONFIG.md).\n\
         `tlsplane bench` runs the load generator, a binary of its own: `tlsplane bench --help`\n\
         prints its options ([BENCHMARKS.md](BENCHMARKS.md)).\n\n",
    );
    let names = commands(&top);
    md.push_str("Commands: ");
    md.push_str(
        &names
            .iter()
            .map(|n| format!("[`{n}`](#tlsplane-{n})"))
            .collect::<Vec<_>>()
            .join(", "),
    );
    md.push_str(".\n\n## tlsplane\n\n```text\n");
    md.push_str(&top);
    md.push_str("\n```\n");
    for name in &names {
        // `help NAME` rather than `NAME --help`: `bench` passes `--help` on to its own binary.
        md.push_str(&format!("\n## tlsplane {name}\n\n```text\n"));
        md.push_str(&help(&["help", name]));
        md.push_str("\n```\n");
    }
    md
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[test]
fn cli_reference_matches_the_help_of_every_command() {
    let root = repo_root();
    if !root.join("Cargo.toml").exists() {
        eprintln!("skipped: no source tree here (a copy of the test binary, as in the VM)");
        return;
    }
    let path = root.join("docs/CLI.md");
    let rendered = render();
    if std::env::var_os("TLSPLANE_BLESS").is_some_and(|v| v == "1") {
        std::fs::write(&path, &rendered).expect("write docs/CLI.md");
        return;
    }
    let current = std::fs::read_to_string(&path).unwrap_or_default();
    if current == rendered {
        return;
    }
    let first = current
        .lines()
        .zip(rendered.lines())
        .position(|(a, b)| a != b)
        .unwrap_or_else(|| current.lines().count().min(rendered.lines().count()));
    panic!(
        "docs/CLI.md differs from the program's --help (first at line {}):\n  file: {:?}\n  help: {:?}\n\
         Regenerate it with:\n  {REGENERATE}",
        first + 1,
        current.lines().nth(first).unwrap_or("<end of file>"),
        rendered.lines().nth(first).unwrap_or("<end of help>"),
    );
}

#[test]
fn cli_reference_lists_every_command_but_hidden_ones() {
    let names = commands(&help(&["--help"]));
    for expected in [
        "serve",
        "proxy",
        "handoff",
        "check-config",
        "reload",
        "keyd",
        "bench",
    ] {
        assert!(names.iter().any(|n| n == expected), "{expected}: {names:?}");
    }
    assert!(!names.iter().any(|n| n == "keyd-launcher"), "{names:?}");
}
