#!/usr/bin/env bash
# The project's test command (README): installs what the tests need (scripts/setup-tests.sh),
# runs everything that can run on this machine, then the kernel-plane suite inside QEMU
# guests whose kernels have kTLS.
#
#   scripts/test.sh            all of it
#   SKIP_VM=1 scripts/test.sh  only the native suite (user plane) and the fuzzing run
#   SKIP_FUZZ=1 / FUZZ_SECONDS=N  skip the fuzzing run / fuzz each target for N seconds
#                      (default 30, three targets)
set -euo pipefail
cd "$(dirname "$0")/.."

# What the tests need, installed when missing (apt as root or with sudo; h2spec built with Go).
# shellcheck source=scripts/setup-tests.sh
. scripts/setup-tests.sh

# The build profile of the tests (Cargo.toml: release without LTO, much quicker to build);
# vm/ktls-suite takes the same, so nothing is compiled twice.
export TEST_PROFILE=${TEST_PROFILE:-test-release}
echo "== native: unit tests + end-to-end tests with real clients (user plane) =="
cargo test --profile "$TEST_PROFILE" --workspace -- --skip syscalls::
# The system-call budgets alone: a test running beside them (two threads) slows the client or
# the server at random, and every wait that a reply just missed adds calls to the count.
# The same selection of targets as above (a filter, not `--test e2e`): selecting one target
# unifies dependency features differently and compiled the workspace again (3.5 min in CI).
echo "== native: system calls per connection (tests/e2e/syscalls.rs), one test at a time =="
cargo test --profile "$TEST_PROFILE" --workspace -- --test-threads=1 syscalls::

if [ "${SKIP_FUZZ:-0}" = 1 ]; then
	echo "== fuzz: skipped (SKIP_FUZZ=1) =="
else
	echo "== fuzz: the TLS driver and the HTTP/2 code under libFuzzer, ${FUZZ_SECONDS:-30} s each (replays fuzz/regressions/ first) =="
	scripts/fuzz.sh
fi

if [ "${SKIP_VM:-0}" = 1 ]; then
	echo "== kernel plane: skipped (SKIP_VM=1) =="
	exit 0
fi
echo "== kernel plane: the same end-to-end tests inside QEMU guests with Linux kTLS =="
vm/ktls-suite
