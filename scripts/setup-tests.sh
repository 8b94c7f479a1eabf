#!/usr/bin/env bash
# Installs what the test command (scripts/test.sh) needs on Debian 12: the real TLS peers and
# servers the tests talk to, the C compiler for the hand-off's C library and shim, the QEMU
# guest toolchain for the kernel plane, and h2spec (a Go program, built from pinned versions).
# Sourced by scripts/test.sh and .ci/run; safe to run again: it installs only what is missing.
#
# As root it uses apt-get; otherwise sudo if it can run without a password; otherwise it
# names what is missing and the tests that need it skip (or fail under CI=true).

# Why each: curl, openssl, gnutls-cli, python3 (ssl) as TLS clients; python3-h2 (HTTP/2 abuse
# cases), python3-prometheus-client (/metrics parsing), python3-grpcio (gRPC through the
# proxy); h2load (nghttp2-client) and headless chromium for HTTP/2; nginx (PROXY headers,
# benchmark comparison) and wrk; strace for the system-call budgets; redis-server for the
# fleet; gcc, g++ and libc6-dev for the C library, the shim and the fuzz build; QEMU, busybox,
# cpio, kmod, xz and zstd for the kernel-plane guests; golang-go to build h2spec.
TLSPLANE_TEST_PACKAGES=(
	curl openssl gnutls-bin python3 python3-prometheus-client python3-h2 python3-grpcio
	nginx-light wrk strace nghttp2-client chromium redis-server
	gcc g++ libc6-dev
	qemu-system-x86 busybox-static cpio kmod xz-utils zstd ca-certificates
)

tlsplane_missing_packages() {
	local p
	for p in "${TLSPLANE_TEST_PACKAGES[@]}"; do
		dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || echo "$p"
	done
	command -v go >/dev/null || echo golang-go
}

tlsplane_as_root() {
	if [ "$(id -u)" = 0 ]; then
		"$@"
	elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
		sudo "$@"
	else
		return 1
	fi
}

tlsplane_setup_tests() {
	local missing
	if ! command -v dpkg-query >/dev/null; then
		echo "== setup: not a Debian system; install by hand: ${TLSPLANE_TEST_PACKAGES[*]} =="
	else
		missing=$(tlsplane_missing_packages | tr '\n' ' ')
		if [ -n "$missing" ]; then
			echo "== setup: installing $missing=="
			# shellcheck disable=SC2086
			if ! { tlsplane_as_root env DEBIAN_FRONTEND=noninteractive apt-get update -q &&
				tlsplane_as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
					--no-install-recommends $missing; }; then
				echo "== setup: could not install (not root, no sudo?): $missing"
				echo "   the tests that need them skip, or fail under CI=true =="
			fi
		fi
	fi

	# h2spec, HTTP/2 conformance (tests/e2e/h2spec.rs): built once into a directory named by its
	# version and reused. It has no go.mod, so `go install ...@version` would take its
	# dependencies at their newest (which need a newer Go than Debian 12's 1.19); they are
	# pinned here instead, at versions Go 1.19 builds.
	local version=v2.2.1+incompatible
	local dir="${XDG_CACHE_HOME:-$HOME/.cache}/tlsplane-ci/h2spec-$version"
	if [ ! -x "$dir/h2spec" ] && command -v go >/dev/null; then
		echo "== setup: building h2spec $version into $dir =="
		local src
		src=$(mktemp -d)
		cat >"$src/go.mod" <<EOF
module tlsplane.ci/h2spec

go 1.19

require (
	github.com/summerwind/h2spec $version
	github.com/fatih/color v1.15.0
	github.com/spf13/cobra v1.7.0
	golang.org/x/net v0.17.0
)
EOF
		(cd "$src" && GOFLAGS=-mod=mod go build -o "$dir/h2spec" github.com/summerwind/h2spec/cmd/h2spec) ||
			echo "== setup: h2spec did not build; tests/e2e/h2spec.rs skips (fails under CI=true) =="
		rm -rf "$src"
	elif [ ! -x "$dir/h2spec" ]; then
		echo "== setup: no Go toolchain: no h2spec; tests/e2e/h2spec.rs skips (fails under CI=true) =="
	fi
	export PATH="$dir:$PATH"
}

tlsplane_setup_tests
