# vm/guest/selftest.sh - proves the harness exercises kernel TLS in the guest,
# shellcheck shell=dash disable=SC1091
# without any tlsplane code.   Run: VM_SUITE=vm/guest/selftest.sh vm/run
#
# ktls_probe (vm/selftest/ktls_probe.c, static C, no TLS library) opens a
# 127.0.0.1 TCP pair, attaches the "tls" ULP to both ends, installs a dummy
# TLS 1.3 key as TLS_TX on one side and TLS_RX on the other, checks the first
# record is sealed on the wire and the rest is decrypted intact by the kernel.
# Each run must move TlsTxSw and TlsRxSw by exactly 1.
# Then curl/openssl are checked to work in the guest, and Debian's own OpenSSL is shown
# to use kTLS (TLS 1.2 TX+RX, TLS 1.3 TX) when enabled by 'Options = KTLS' in its config.
. /vm/lib.sh

step "environment"
echo "kernel $(uname -r) ($VM_LABEL: $VM_KERNEL_PKG $VM_KERNEL_PKG_VERSION), date $(date -u)"
[ -r /proc/net/tls_stat ] || fail "/proc/net/tls_stat missing: tls module not loaded"
grep -qw tls /proc/modules || grep -q 'tls' "/lib/modules/$(uname -r)/modules.builtin" ||
	fail "tls module not loaded"
pass "tls ULP present ($(grep -c . /proc/net/tls_stat) counters)"
{ [ -c /dev/urandom ] && [ -w /tmp ] && [ "$HOME" = /tmp ]; } || fail "guest basics (/dev/urandom, /tmp, HOME)"
pass "/dev/urandom, writable /tmp, HOME=/tmp"

for cipher in aes128 aes256 chacha20; do
	step "ktls_probe $cipher: TLS_TX + TLS_RX, software crypto"
	tx=$(tls_stat TlsTxSw) rx=$(tls_stat TlsRxSw)
	ctx=$(tls_stat TlsCurrTxSw) crx=$(tls_stat TlsCurrRxSw)
	derr=$(tls_stat TlsDecryptError)
	run /bin/ktls_probe "$cipher"
	assert_delta TlsTxSw "$tx" 1
	assert_delta TlsRxSw "$rx" 1
	assert_delta TlsDecryptError "$derr" 0
	# sockets are closed: the "current" gauges are back where they were
	assert_delta TlsCurrTxSw "$ctx" 0
	assert_delta TlsCurrRxSw "$crx" 0
done

step "ktls_probe aes128 --bad-key: the kernel rejects a record sealed with another key"
derr=$(tls_stat TlsDecryptError)
run /bin/ktls_probe aes128 --bad-key
assert_delta TlsDecryptError "$derr" 1

step "openssl + curl work in the guest (userspace TLS, not kTLS)"
cd /tmp || fail "cd /tmp"
run openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
	-subj /CN=localhost -addext subjectAltName=DNS:localhost -keyout /tmp/key.pem -out /tmp/cert.pem
bg_start s_server openssl s_server -accept 127.0.0.1:4433 -cert /tmp/cert.pem -key /tmp/key.pem -www -tls1_3
wait_port 4433
out=$(curl -sS --cacert /tmp/cert.pem https://localhost:4433/) || { bg_log s_server; fail "curl to s_server"; }
bg_stop s_server
echo "$out" | grep -q 'Protocol  *: TLSv1.3' || { echo "$out"; fail "unexpected s_server -www page"; }
pass "curl <-> openssl s_server TLS 1.3 over 127.0.0.1 (cert validity checked: guest clock sane)"

step "Debian's OpenSSL 3.0 with 'Options = KTLS': s_server <-> s_client use kTLS too"
# Debian's OpenSSL 3.0 has no s_server -ktls flag, but libssl is built with kTLS and turns
# it on through the config. OpenSSL 3.0 does TX+RX offload for TLS 1.2, TX only for 1.3.
cat > /tmp/ktls.cnf <<'CNF'
openssl_conf = c
[c]
ssl_conf = s
[s]
system_default = d
[d]
Options = KTLS
CNF
port=4440
# ossl_session PROTO CIPHER: one s_server/s_client session exchanging a line (server -rev)
ossl_session() {
	port=$((port + 1))
	bg_start ossl_srv env OPENSSL_CONF=/tmp/ktls.cnf openssl s_server -accept "127.0.0.1:$port" \
		-cert /tmp/cert.pem -key /tmp/key.pem "-$1" -cipher "$2" -ciphersuites TLS_AES_128_GCM_SHA256 -rev
	wait_port "$port"
	rm -f /tmp/cli.in
	mkfifo /tmp/cli.in
	OPENSSL_CONF=/tmp/ktls.cnf openssl s_client -connect "127.0.0.1:$port" "-$1" -cipher "$2" \
		-ciphersuites TLS_AES_128_GCM_SHA256 < /tmp/cli.in > /tmp/cli.log 2>&1 &
	cli=$!
	exec 3> /tmp/cli.in
	echo hello-ktls >&3
	i=0
	until grep -q sltk-olleh /tmp/cli.log; do
		i=$((i + 1))
		[ "$i" -lt 300 ] || { exec 3>&-; cat /tmp/cli.log; bg_log ossl_srv; fail "no reply over openssl $1"; }
		sleep 0.1
	done
	exec 3>&-
	wait "$cli"
	bg_stop ossl_srv
	pass "openssl $1 $2: line echoed reversed"
}
tx=$(tls_stat TlsTxSw) rx=$(tls_stat TlsRxSw)
ossl_session tls1_2 ECDHE-ECDSA-AES128-GCM-SHA256
assert_delta TlsTxSw "$tx" 2   # client + server
assert_delta TlsRxSw "$rx" 2
tx=$(tls_stat TlsTxSw) rx=$(tls_stat TlsRxSw)
ossl_session tls1_3 ECDHE-ECDSA-AES128-GCM-SHA256
assert_delta TlsTxSw "$tx" 2
echo "info: TLS 1.3 TlsRxSw +$(tls_delta TlsRxSw "$rx") (OpenSSL 3.0 has no TLS 1.3 kTLS RX)"
finish
