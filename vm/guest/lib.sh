# vm/guest/lib.sh - helpers for guest suites of the tlsplane kTLS VM harness.
# shellcheck shell=dash disable=SC1091
# In the guest it is /vm/lib.sh (also $VM_LIB). Use from a suite with:
#     . /vm/lib.sh
# Shell is busybox sh (ash): POSIX plus `local`. No bash-isms.
#
# kTLS counters (/proc/net/tls_stat):
#   tls_stat NAME                  print counter NAME (e.g. TlsTxSw); rc 1 and no output
#                                  if this kernel has no such counter / no tls module
#   tls_has NAME                   rc 0 if the counter exists on this kernel
#   tls_stat_all                   print the whole table
#   tls_delta NAME BEFORE          print (current - BEFORE)
#   assert_delta NAME BEFORE EXP   fail unless current - BEFORE == EXP
#   assert_delta_ge NAME BEFORE MIN   fail unless current - BEFORE >= MIN
#   assert_stat NAME EXP           fail unless current value == EXP (e.g. TlsCurrTxSw 0)
#   tls_snapshot FILE              save the table; tls_snap NAME FILE prints a saved value
#   assert_snap_delta NAME FILE EXP   like assert_delta with BEFORE taken from FILE
# Results:
#   pass MSG                       print "PASS: MSG" (counted)
#   fail MSG                       print "FAIL: MSG" and the tls_stat table (stderr), exit 1
#                                  (inside $(...) or a subshell this exits only that subshell)
#   skip MSG                       print "SKIP: MSG" (counted)
#   finish                         print the summary line, exit 0
#   assert_eq GOT WANT MSG         fail unless the strings are equal
#   run CMD...                     echo "+ CMD", run it, fail if it exits non-zero
#   run_fail CMD...                run CMD, fail if it exits zero
#   step MSG                       print a section header
# Processes / network:
#   wait_port PORT [SECS]          wait until something LISTENs on TCP PORT (default 20 s)
#   wait_file PATH [SECS]          wait until PATH exists
#   bg_start NAME CMD...           start CMD in background, log to /tmp/NAME.log, pid in
#                                  /tmp/NAME.pid; bg_stop NAME kills it; bg_log NAME prints log
#   ktls_probe_ok [CIPHER]         rc 0 if the kernel does kTLS TX+RX (runs /bin/ktls_probe)
# Environment: HOME=/tmp TMPDIR=/tmp, VM_LABEL (6.12|6.1|new), VM_DATA=/data,
#   files from VM_FILES in /data/, VM_BINARIES + curl, openssl, ktls_probe in /bin.

VM_LIB=${VM_LIB:-/vm/lib.sh}
VM_DATA=${VM_DATA:-/data}
TLS_STAT_FILE=${TLS_STAT_FILE:-/proc/net/tls_stat}
_vm_pass=0
_vm_skip=0

tls_stat() {
	[ -r "$TLS_STAT_FILE" ] || return 1
	awk -v n="$1" '$1 == n { print $2; found = 1 } END { exit found ? 0 : 1 }' "$TLS_STAT_FILE"
}

tls_has() { tls_stat "$1" >/dev/null; }

tls_stat_all() { cat "$TLS_STAT_FILE" 2>/dev/null || echo "(no $TLS_STAT_FILE)"; }

_vm_need_stat() {
	local v
	v=$(tls_stat "$1") || fail "kTLS counter $1 not present on kernel $(uname -r)"
	echo "$v"
}

tls_delta() {
	local now
	now=$(_vm_need_stat "$1") || exit 1
	echo $((now - $2))
}

assert_delta() {
	local now d
	now=$(_vm_need_stat "$1") || exit 1
	d=$((now - $2))
	[ "$d" -eq "$3" ] || fail "$1 moved by $d (from $2 to $now), expected $3"
	pass "$1 moved by $d (from $2 to $now)"
}

assert_delta_ge() {
	local now d
	now=$(_vm_need_stat "$1") || exit 1
	d=$((now - $2))
	[ "$d" -ge "$3" ] || fail "$1 moved by $d (from $2 to $now), expected >= $3"
	pass "$1 moved by $d (>= $3)"
}

assert_stat() {
	local now
	now=$(_vm_need_stat "$1") || exit 1
	[ "$now" -eq "$2" ] || fail "$1 is $now, expected $2"
	pass "$1 is $now"
}

tls_snapshot() { cat "$TLS_STAT_FILE" > "$1" 2>/dev/null || : > "$1"; }

tls_snap() { awk -v n="$1" '$1 == n { print $2; f = 1 } END { exit f ? 0 : 1 }' "$2"; }

assert_snap_delta() {
	local before
	before=$(tls_snap "$1" "$2") || fail "kTLS counter $1 not in snapshot $2"
	assert_delta "$1" "$before" "$3"
}

pass() { _vm_pass=$((_vm_pass + 1)); echo "PASS: $*"; }
skip() { _vm_skip=$((_vm_skip + 1)); echo "SKIP: $*"; }
step() { echo; echo "=== $* ==="; }

# To stderr, so the message shows even when fail runs inside $(...).
fail() {
	{
		echo "FAIL: $*"
		echo "--- /proc/net/tls_stat at failure:"
		tls_stat_all
		# TCP's memory (pages) against its limits: under pressure the kernel shrinks send
		# buffers and refuses allocations, which the data path meets as waits or errors.
		echo "--- /proc/net/sockstat, tcp_mem at failure:"
		cat /proc/net/sockstat /proc/sys/net/ipv4/tcp_mem 2>/dev/null
	} >&2
	exit 1
}

finish() {
	echo "SUITE-SUMMARY: $_vm_pass passed, $_vm_skip skipped, 0 failed (kernel $(uname -r))"
	exit 0
}

assert_eq() {
	[ "$1" = "$2" ] || fail "${3:-values differ}: got '$1', want '$2'"
	pass "${3:-value} = '$2'"
}

run() {
	echo "+ $*"
	"$@" || fail "command failed (rc=$?): $*"
}

run_fail() {
	echo "+ (expect failure) $*"
	if "$@"; then fail "command unexpectedly succeeded: $*"; fi
	pass "failed as expected: $*"
}

# Listening sockets have state 0A in /proc/net/tcp{,6}; ports are hex.
wait_port() {
	local port=$1 secs=${2:-20} hex i=0
	hex=$(printf ':%04X ' "$port")
	while [ "$i" -lt $((secs * 10)) ]; do
		if cat /proc/net/tcp /proc/net/tcp6 2>/dev/null |
			awk -v p="$hex" '$4 == "0A" && index($2 " ", p) { f = 1 } END { exit !f }'; then
			return 0
		fi
		sleep 0.1
		i=$((i + 1))
	done
	fail "nothing listening on port $port after ${secs}s"
}

wait_file() {
	local i=0 secs=${2:-20}
	while [ ! -e "$1" ]; do
		[ "$i" -ge $((secs * 10)) ] && fail "$1 did not appear within ${secs}s"
		sleep 0.1
		i=$((i + 1))
	done
}

bg_start() {
	local name=$1
	shift
	echo "+ $* &  (log /tmp/$name.log)"
	"$@" > "/tmp/$name.log" 2>&1 &
	echo $! > "/tmp/$name.pid"
}

bg_stop() {
	local pid
	pid=$(cat "/tmp/$1.pid" 2>/dev/null) || return 0
	kill "$pid" 2>/dev/null
	sleep 0.2
	kill -9 "$pid" 2>/dev/null
	wait "$pid" 2>/dev/null
	rm -f "/tmp/$1.pid"
	return 0
}

bg_log() { echo "--- /tmp/$1.log:"; cat "/tmp/$1.log" 2>/dev/null; }

ktls_probe_ok() { /bin/ktls_probe "${1:-aes128}" >/dev/null 2>&1; }
