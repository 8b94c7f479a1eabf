# vm/guest/suite.sh - default guest suite of vm/run (runs as `sh /suite.sh ARGS...`).
# shellcheck shell=dash disable=SC1091
#
# 1. sanity: the kernel does kTLS (ktls_probe: TlsTxSw/TlsRxSw +1 each);
# 2. runs every program given in VM_BINARIES, in order, as `/bin/NAME ARGS...`
#    (ARGS = what follows `vm/run --`); each must exit 0;
# 3. prints the kTLS counter deltas those programs caused. With VM_ENV containing
#    VM_REQUIRE_KTLS=1 it also asserts that TlsTxSw and TlsRxSw moved.
# Write your own suite (VM_SUITE=path) for anything more specific; see lib.sh.
. /vm/lib.sh

step "kTLS sanity ($(uname -r))"
tx=$(tls_stat TlsTxSw) || fail "no kTLS counters: tls module missing on $(uname -r)"
rx=$(tls_stat TlsRxSw)
run /bin/ktls_probe aes128
assert_delta TlsTxSw "$tx" 1
assert_delta TlsRxSw "$rx" 1

tls_snapshot /tmp/suite.before
n=0
while read -r name; do
	[ -n "$name" ] || continue
	n=$((n + 1))
	step "/bin/$name $*"
	"/bin/$name" "$@" || fail "/bin/$name exited $?"
	pass "/bin/$name"
done < /etc/vm-binaries
[ "$n" -gt 0 ] || skip "no VM_BINARIES given"

step "kTLS counter deltas caused by VM_BINARIES"
for c in TlsTxSw TlsRxSw TlsTxDevice TlsRxDevice TlsDecryptError TlsRxDeviceResync TlsDecryptRetry TlsRxNoPadViolation; do
	b=$(tls_snap "$c" /tmp/suite.before) || continue
	echo "  $c: +$(tls_delta "$c" "$b")"
done
echo "  TlsCurrTxSw now $(tls_stat TlsCurrTxSw), TlsCurrRxSw now $(tls_stat TlsCurrRxSw)"
if [ "${VM_REQUIRE_KTLS:-0}" = 1 ]; then
	assert_snap_delta_ge() { assert_delta_ge "$1" "$(tls_snap "$1" /tmp/suite.before)" "$2"; }
	assert_snap_delta_ge TlsTxSw 1
	assert_snap_delta_ge TlsRxSw 1
fi
finish
