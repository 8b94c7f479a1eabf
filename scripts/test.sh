#!/usr/bin/env bash
# The project's test command (README): everything that can run on this machine, then the
# kernel-plane suite inside QEMU guests whose kernels have kTLS.
#
#   scripts/test.sh            all of it
#   SKIP_VM=1 scripts/test.sh  only the native suite (user plane)
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== native: unit tests + end-to-end tests with real clients (user plane) =="
cargo test --release --workspace

if [ "${SKIP_VM:-0}" = 1 ]; then
	echo "== kernel plane: skipped (SKIP_VM=1) =="
	exit 0
fi
echo "== kernel plane: the same end-to-end tests inside QEMU guests with Linux kTLS =="
vm/ktls-suite
