//! Builds the LD_PRELOAD shim (`preload/tlsplane_preload.c`) into the profile's output
//! directory beside the binaries (`target/release/libtlsplane_preload.so`), so that a plain
//! `cargo build --release` leaves users a shim to preload instead of a `cc` line to type.
//! The shim is a C shared object loaded into programs that know nothing of Rust: it is not
//! linked into this crate. The compiler is the one the `cc` crate finds (`CC`, the target's).

use std::path::{Path, PathBuf};
use std::process::Command;

const SHIM: &str = "preload/tlsplane_preload.c";
const SHIM_SO: &str = "libtlsplane_preload.so";

fn main() {
    println!("cargo:rerun-if-changed={SHIM}");
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let built = out_dir.join(SHIM_SO);
    let compiler = cc::Build::new().opt_level(2).get_compiler();
    let mut cmd: Command = compiler.to_command();
    cmd.args(["-shared", "-fPIC", "-Wall", "-Wextra", "-o"])
        .arg(&built)
        .arg(SHIM)
        .args(["-ldl", "-pthread"]);
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("{SHIM}: cannot run the C compiler {cmd:?}: {e}"));
    assert!(status.success(), "{SHIM}: {cmd:?} failed ({status})");
    // OUT_DIR is <target>/<profile>/build/<crate>-<hash>/out: the profile directory, where
    // cargo puts the binaries, is three levels up.
    if let Some(profile_dir) = out_dir.ancestors().nth(3).filter(|d| d.is_dir()) {
        copy(&built, &profile_dir.join(SHIM_SO));
    }
}

fn copy(from: &Path, to: &Path) {
    // Through a temporary name: a program preloading the old file keeps a whole one.
    let tmp = to.with_extension("so.tmp");
    std::fs::copy(from, &tmp).unwrap_or_else(|e| panic!("{}: {e}", tmp.display()));
    std::fs::rename(&tmp, to).unwrap_or_else(|e| panic!("{}: {e}", to.display()));
}
