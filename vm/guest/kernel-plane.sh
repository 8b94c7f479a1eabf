# vm/guest/kernel-plane.sh - tlsplane's kernel-plane suite, run in the guest by vm/ktls-suite.
#
# Every connection here must be carried by kTLS (TX and RX in the kernel): the server runs
# with --data-plane kernel, which closes any connection it cannot offload, and each check
# compares tlsplane's own counters with the kernel's /proc/net/tls_stat.
. /vm/lib.sh

WWW=/tmp/www
ST=/tmp/state
export TLSPLANE_HOME=$ST
mkdir -p "$WWW"
head -c 1048583 /dev/urandom > "$WWW/big.bin"
head -c 16385 /dev/urandom > "$WWW/r16385.bin"
want_big=$(sha256sum < "$WWW/big.bin" | cut -d' ' -f1)
want_small=$(sha256sum < "$WWW/r16385.bin" | cut -d' ' -f1)

json_field() { # NAME FILE: integer field of the tlsplane-stats line
	sed -n 's/.*tlsplane-stats //p' "$2" | tr ',{}' '\n\n\n' | awk -F: -v k="\"$1\"" '$1 == k { print $2 }'
}

start_server() { # NAME PORT ARGS...
	local name=$1 port=$2
	shift 2
	bg_start "$name" tlsplane serve "$WWW" --listen "127.0.0.1:$port" --workers 1 --stats "$@"
	wait_port "$port" 20 || { bg_log "$name"; fail "$name did not start"; }
}

stop_server() { # NAME: SIGTERM, wait for exit, keep the log
	local pid
	pid=$(cat "/tmp/$1.pid")
	kill -TERM "$pid"
	for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
	kill -0 "$pid" 2>/dev/null && fail "$1 did not exit on SIGTERM"
	grep -q tlsplane-stats "/tmp/$1.log" || { bg_log "$1"; fail "$1 printed no stats"; }
}

CURL="curl -sS --cacert $ST/localhost-cert.pem"

step "cipher matrix: each suite negotiated and offloaded (TX and RX in the kernel)"
start_server matrix 8443 --data-plane kernel
tx0=$(tls_stat TlsTxSw); rx0=$(tls_stat TlsRxSw); de0=$(tls_stat TlsDecryptError)
n=0
for spec in \
	"--tlsv1.3 --tls-max 1.3 --tls13-ciphers TLS_AES_128_GCM_SHA256" \
	"--tlsv1.3 --tls-max 1.3 --tls13-ciphers TLS_AES_256_GCM_SHA384" \
	"--tlsv1.3 --tls-max 1.3 --tls13-ciphers TLS_CHACHA20_POLY1305_SHA256" \
	"--tls-max 1.2 --ciphers ECDHE-ECDSA-AES128-GCM-SHA256" \
	"--tls-max 1.2 --ciphers ECDHE-ECDSA-AES256-GCM-SHA384" \
	"--tls-max 1.2 --ciphers ECDHE-ECDSA-CHACHA20-POLY1305"; do
	before=$(tls_stat TlsTxSw)
	# shellcheck disable=SC2086
	got=$($CURL $spec -w '' https://localhost:8443/big.bin | sha256sum | cut -d' ' -f1)
	assert_eq "$got" "$want_big" "content via kTLS with $spec"
	assert_delta TlsTxSw "$before" 1
	# shellcheck disable=SC2086
	$CURL $spec -v -o /dev/null https://localhost:8443/r16385.bin 2>&1 | grep -E "SSL connection using" || true
	n=$((n + 2))
	pass "$spec: sha256 ok, TlsTxSw +1"
done
stop_server matrix
assert_eq "$(json_field plane_kernel /tmp/matrix.log)" "$n" "plane_kernel == connections"
assert_eq "$(json_field plane_user /tmp/matrix.log)" 0 "no user-plane connection"
assert_delta TlsTxSw "$tx0" "$n"
assert_delta TlsRxSw "$rx0" "$n"
assert_delta TlsDecryptError "$de0" 0
pass "cipher matrix: $n kernel-plane connections, TlsTxSw/TlsRxSw +$n each"

step "openssl s_client (not our client) over kTLS, both versions"
start_server ossl 8444 --data-plane kernel
tx0=$(tls_stat TlsTxSw)
for v in -tls1_3 -tls1_2; do
	got=$(printf 'GET /big.bin HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n' |
		openssl s_client -connect 127.0.0.1:8444 -servername localhost -CAfile "$ST/localhost-cert.pem" $v -quiet -ign_eof 2>/dev/null |
		sed '1,/^\r$/d' | sha256sum | cut -d' ' -f1)
	assert_eq "$got" "$want_big" "openssl s_client $v body"
done
stop_server ossl
assert_delta TlsTxSw "$tx0" 2
assert_eq "$(json_field plane_kernel /tmp/ossl.log)" 2 "openssl connections on the kernel plane"
pass "openssl s_client -tls1_3 and -tls1_2 over kTLS"

step "per-connection fallback: a suite this kernel cannot take goes to user space"
# Make the kernel really unable to do ChaCha20-Poly1305: unload the AEAD template and stop
# the kernel from auto-loading it again while the server probes.
old_modprobe=$(cat /proc/sys/kernel/modprobe)
echo /bin/false > /proc/sys/kernel/modprobe
rmmod chacha20poly1305 2>/dev/null || true
if ktls_probe_ok chacha20; then
	skip "chacha20poly1305 is built into $(uname -r): cannot make the kernel refuse a suite"
else
	start_server fallback 8445 --data-plane auto
	tx0=$(tls_stat TlsTxSw)
	got=$($CURL --tlsv1.3 --tls-max 1.3 --tls13-ciphers TLS_CHACHA20_POLY1305_SHA256 https://localhost:8445/big.bin | sha256sum | cut -d' ' -f1)
	assert_eq "$got" "$want_big" "ChaCha20 connection (user plane) serves identical bytes"
	assert_delta TlsTxSw "$tx0" 0
	got=$($CURL --tlsv1.3 --tls-max 1.3 --tls13-ciphers TLS_AES_128_GCM_SHA256 https://localhost:8445/big.bin | sha256sum | cut -d' ' -f1)
	assert_eq "$got" "$want_big" "AES-128-GCM connection beside it (kernel plane)"
	assert_delta TlsTxSw "$tx0" 1
	stop_server fallback
	assert_eq "$(json_field fallback_suite /tmp/fallback.log)" 1 "fallback reason 'suite' counted"
	assert_eq "$(json_field plane_user /tmp/fallback.log)" 1 "one user-plane connection"
	assert_eq "$(json_field plane_kernel /tmp/fallback.log)" 1 "one kernel-plane connection"
	pass "ChaCha20 refused by the kernel -> user plane, same bytes, reason counted"

	start_server strict 8446 --data-plane kernel
	if $CURL --tlsv1.3 --tls-max 1.3 --tls13-ciphers TLS_CHACHA20_POLY1305_SHA256 -o /dev/null https://localhost:8446/big.bin 2>/dev/null; then
		fail "--data-plane kernel served a connection the kernel could not take"
	fi
	stop_server strict
	assert_eq "$(json_field kernel_required_refused /tmp/strict.log)" 1 "refusal counted"
	assert_eq "$(json_field plane_user /tmp/strict.log)" 0 "nothing served from user space"
	pass "--data-plane kernel closes a connection it cannot offload and counts it"
fi
echo "$old_modprobe" > /proc/sys/kernel/modprobe
modprobe chacha20poly1305 2>/dev/null || true

# Each test's time in the log (libtest's --report-time, an unstable option that
# RUSTC_BOOTSTRAP lets a stable build's harness take): what to look at when the guests' share
# of CI's time grows.
export RUSTC_BOOTSTRAP=1
timed="-Z unstable-options --report-time"
if [ "$VM_LABEL" = new ]; then
	step "end-to-end suite (same tests as natively) with the kernel plane required"
	# Skipped: tests of trust boundaries whose bytes never reach a data plane (the key
	# daemon's grants and slow peers, sockets' directories and owners, reload revocation,
	# refused configurations and ClientHellos, the fleet store): they run natively.
	run /bin/e2e --test-threads=1 $timed --skip keyd_trust:: --skip fleet_trust:: \
		--skip hello_refusals:: --skip served_secrets::serve_refuses \
		--skip served_secrets::check_config --skip handoff_trust::the_socket_lives \
		--skip handoff_trust::a_reload_that --skip handoff_trust::a_receiver_that_reads_no
else
	# Under emulation the whole suite takes about 11 minutes a kernel; the older kernels run the
	# tests whose bytes cross the kernel's TLS code (records, alerts, sendfile, splice,
	# KeyUpdate, close_notify, lingering close, shutdown; each suite is in the cipher matrix
	# above), and the newest runs everything, so that CI stays well under its time limit.
	# Filters match anywhere in a name: `proxy::` alone would also take http2_abuse::proxy::
	# (HTTP/2 flood limits, nothing of the kernel's), which cost a minute or so per guest.
	# Skipped too: three tests of HTTP alone (a head's size and deadline, range and
	# conditional answers), 33 s of each older kernel's run (7.3's --report-time).
	step "end-to-end tests of the data path with the kernel plane required (all of them: kernel 'new')"
	run /bin/e2e --test-threads=1 $timed --skip proxy_http --skip http2_abuse \
		--skip bad_input::header_flood --skip bad_input::slow_header --skip http::range_conditional \
		alerts:: bad_input:: coalesced:: content:: control:: http:: kernel:: linger:: proxy:: \
		shutdown::
fi
finish
