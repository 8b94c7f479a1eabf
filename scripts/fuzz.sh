#!/usr/bin/env bash
# Coverage-guided fuzzing with libFuzzer, on stable Rust: the instrumentation cargo-fuzz adds,
# minus the sanitizer (which needs nightly); a panic is the crash we look for. Targets
# (fuzz/fuzz_targets/):
#   server_input  the server-side TLS driver, client bytes from the first byte or after a handshake
#   h2_outbox     the HTTP/2 outbox: h2's frames, cut anyhow, with file bytes put in place of
#                 placeholder DATA payloads; checks the bytes sent against a model
#   h2_server     client bytes to h2's server with serve's settings, transport and answers
#   handoff_wire  hand-off frames from either side: decode, and a decoded one round-trips
#   chunked_body  the proxy's body framing (chunked sizes, extensions, trailers): the same
#                 decision however the stream is cut
#
#   scripts/fuzz.sh            build, replay fuzz/regressions/<target>/, then fuzz each target
#                              for FUZZ_SECONDS (30: about 150 s in all)
#   FUZZ_SECONDS=0 scripts/fuzz.sh   build and replay only
#   FUZZ_TARGETS="h2_outbox" scripts/fuzz.sh   only these targets
#
# Inputs that crash are written to fuzz/artifacts/; copy a fixed one to fuzz/regressions/.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"

target=x86_64-unknown-linux-gnu
# --target keeps these flags off build scripts and proc macros, as cargo-fuzz does.
export RUSTFLAGS="--cfg fuzzing -Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares -Cdebug-assertions -Coverflow-checks"
targets=${FUZZ_TARGETS:-server_input h2_outbox h2_server handoff_wire chunked_body}
bins=()
for t in $targets; do bins+=(--bin "$t"); done
cargo build --release --locked --target "$target" "${bins[@]}" 2>&1 | tail -n 3

status=0
for t in $targets; do
	echo "== fuzz: $t: replaying fuzz/regressions/$t =="
	"target/$target/release/$t" regressions/$t/* 2>&1 | tail -n 2 || status=1
	seconds=${FUZZ_SECONDS:-30}
	if [ "$seconds" -gt 0 ]; then
		echo "== fuzz: $t for ${seconds}s =="
		corpus=$(mktemp -d)
		log=$(mktemp)
		cp regressions/$t/* "$corpus"/
		mkdir -p artifacts/$t
		rc=0
		"target/$target/release/$t" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
			-artifact_prefix=artifacts/$t/ -print_final_stats=1 "$corpus" >"$log" 2>&1 || rc=$?
		grep -E '^(#[0-9]+ +DONE|stat::number_of_executed_units|stat::average_exec_per_sec|stat::new_units_added|==[0-9]+== ERROR)|panicked at' "$log" || true
		if [ "$rc" != 0 ]; then
			status=1
			tail -n 40 "$log"
		fi
		rm -rf "$corpus" "$log"
	fi
done
[ "$status" = 0 ] && echo "fuzz: no crash" || echo "fuzz: CRASH (see fuzz/artifacts/)"
exit "$status"
