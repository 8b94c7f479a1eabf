//! End-to-end tests of `tlsplane serve`: the real binary, real clients (curl, openssl s_client,
//! Python's ssl, rustls), real sockets.
//!
//! Run natively (user-space record layer; this is the default):
//!     cargo test -p tlsplane-cli --test e2e
//! Run under kTLS (inside the VM, with the compiled test binary and the server binary copied in;
//! `vm/ktls-suite` does this):
//!     TLSPLANE_TEST_DATA_PLANE=kernel TLSPLANE_BIN=/bin/tlsplane /bin/e2e --test-threads=1
//! In kernel mode every server also checks /proc/net/tls_stat deltas against its own counters
//! (servers are serialised for that), python3 tests skip when python3 is absent, and the
//! kernel-only tests (KeyUpdate on the kernel plane, AEAD limit) run instead of skipping.

mod support;

#[path = "e2e/access_log.rs"]
mod access_log;
#[path = "e2e/alerts.rs"]
mod alerts;
#[path = "e2e/alpn.rs"]
mod alpn;
#[path = "e2e/bad_input.rs"]
mod bad_input;
#[path = "e2e/bench_cli.rs"]
mod bench_cli;
#[path = "e2e/cli_reference.rs"]
mod cli_reference;
#[path = "e2e/coalesced.rs"]
mod coalesced;
#[path = "e2e/config.rs"]
mod config;
#[path = "e2e/content.rs"]
mod content;
#[path = "e2e/control.rs"]
mod control;
#[path = "e2e/descriptors.rs"]
mod descriptors;
#[path = "e2e/fleet.rs"]
mod fleet;
#[path = "e2e/fleet_trust.rs"]
mod fleet_trust;
#[path = "e2e/h2spec.rs"]
mod h2spec;
#[path = "e2e/handoff.rs"]
mod handoff;
#[path = "e2e/handoff_c.rs"]
mod handoff_c;
#[path = "e2e/handoff_preload.rs"]
mod handoff_preload;
#[path = "e2e/handoff_readme.rs"]
mod handoff_readme;
#[path = "e2e/handoff_trust.rs"]
mod handoff_trust;
#[path = "e2e/hello_records.rs"]
mod hello_records;
#[path = "e2e/hello_refusals.rs"]
mod hello_refusals;
#[path = "e2e/http.rs"]
mod http;
#[path = "e2e/http2.rs"]
mod http2;
#[path = "e2e/http2_abuse.rs"]
mod http2_abuse;
#[path = "e2e/http2_access_log.rs"]
mod http2_access_log;
#[path = "e2e/http2_browser.rs"]
mod http2_browser;
#[path = "e2e/http2_control_flood.rs"]
mod http2_control_flood;
#[path = "e2e/http2_flood.rs"]
mod http2_flood;
#[path = "e2e/kernel.rs"]
mod kernel;
#[path = "e2e/keyd.rs"]
mod keyd;
#[path = "e2e/keyd_trust.rs"]
mod keyd_trust;
#[path = "e2e/limits.rs"]
mod limits;
#[path = "e2e/linger.rs"]
mod linger;
#[path = "e2e/metrics.rs"]
mod metrics;
#[path = "e2e/mutated_hellos.rs"]
mod mutated_hellos;
#[path = "e2e/operations.rs"]
mod operations;
#[path = "e2e/panics.rs"]
mod panics;
#[path = "e2e/post_handshake_records.rs"]
mod post_handshake_records;
#[path = "e2e/proxy.rs"]
mod proxy;
#[path = "e2e/proxy_h2.rs"]
mod proxy_h2;
#[path = "e2e/proxy_http.rs"]
mod proxy_http;
#[path = "e2e/proxy_responses.rs"]
mod proxy_responses;
#[path = "e2e/reload.rs"]
mod reload;
#[path = "e2e/send_timeout.rs"]
mod send_timeout;
#[path = "e2e/served_secrets.rs"]
mod served_secrets;
#[path = "e2e/shutdown.rs"]
mod shutdown;
#[path = "e2e/sites.rs"]
mod sites;
#[path = "e2e/suites.rs"]
mod suites;
#[path = "e2e/syscalls.rs"]
mod syscalls;
#[path = "e2e/traversal.rs"]
mod traversal;
