//! HTTP/2 settings shared by every product that speaks h2 (docs/HTTP2.md), each with its
//! reason: the server side clients talk to (`serve`, `proxy --mode http`), and the client
//! side the HTTP proxy talks to h2c backends with.
//!

use std::time::Duration;

/// Streams a client may have open at once (SETTINGS_MAX_CONCURRENT_STREAMS). RFC 9113 §6.5.2
/// advises no fewer than 100, so as not to limit parallelism.
pub const MAX_CONCURRENT_STREAMS: u32 = 100;
/// Largest header list a request may decode to (SETTINGS_MAX_HEADER_LIST_SIZE), checked by
/// h2 while it decodes, over CONTINUATION frames too (CVE-2024-27316) and whatever the HPACK
/// encoding: HTTP/1.1's head limit (16 KiB) plus RFC 9113's 32 bytes of accounting for each
/// of its 64 fields. h2's default is 16 MiB.
pub const MAX_HEADER_LIST: u32 = 16384 + 64 * 32;
/// Streams the client reset before they were accepted, queued at once (rapid reset,
/// CVE-2023-44487); beyond it the connection ends with GOAWAY(ENHANCE_YOUR_CALM). h2's
/// default, named here so that it cannot change under us with an upgrade.
pub const MAX_PENDING_ACCEPT_RESETS: usize = 20;
/// Streams reset by us for the client's protocol errors before the connection ends with
/// GOAWAY(ENHANCE_YOUR_CALM). A conformant client causes none; h2's default is 1024.
pub const MAX_LOCAL_ERROR_RESETS: usize = 100;
/// Streams we reset whose state is kept (to ignore their late frames) at once, and how long
/// (h2's defaults).
pub const MAX_CONCURRENT_RESETS: usize = 50;
pub const RESET_STREAM_DURATION: Duration = Duration::from_secs(1);
/// Body bytes h2 queues per stream before it stops granting capacity (h2's default ~400 KB),
/// where bodies are bytes in memory (the proxy's; `serve` queues placeholders of files).
pub const SEND_BUFFER: usize = 32 * 1024;

/// SETTINGS frames a client may send per second, in bursts of as many ([`crate::flood`]).
/// Browsers send two in a connection's life (theirs, and the acknowledgement of ours); h2
/// answers each non-acknowledgement with one of its own.
pub const MAX_SETTINGS_PER_SECOND: u32 = 100;
/// PING frames a client may send per second, in bursts of as many, plus one per DATA frame we
/// sent ([`crate::flood`]). Chromium and Firefox send one when they reuse a connection that
/// has been idle for a while (seconds apart at most); gRPC clients probe the bandwidth with a
/// PING per round trip of the data they receive, which the allowance per DATA frame covers
/// however short the round trip. Each is answered by h2.
pub const MAX_PINGS_PER_SECOND: u32 = 100;
/// WINDOW_UPDATE frames a client may send per DATA frame we sent ([`crate::flood`]), besides
/// two per stream it opened and [`WINDOW_UPDATES_AT_START`]: a client gives window back for
/// the data it receives, at most once per frame for the stream and once for the connection
/// (Chromium and curl once per half window; Firefox about the same). Envoy's rule and
/// default (`max_inbound_window_update_frames_per_data_frame_sent`). A cap per second
/// instead would cut a fast download with small windows.
pub const MAX_WINDOW_UPDATES_PER_DATA_FRAME: u32 = 10;
/// WINDOW_UPDATE frames before any data (browsers open the connection's window once).
pub const WINDOW_UPDATES_AT_START: u64 = 5;
/// PRIORITY frames a client may send per stream it opened, plus as many before the first
/// ([`crate::flood`]): Envoy's rule and default (`max_inbound_priority_frames_per_stream`).
/// Firefox built its RFC 7540 dependency tree with five PRIORITY frames at the start;
/// Chromium puts priorities in HEADERS; neither sends more than a few per stream.
pub const MAX_PRIORITY_PER_STREAM: u32 = 100;

/// The server side, as clients see it, queueing up to `send_buffer` body bytes per stream.
pub fn server(send_buffer: usize) -> h2::server::Builder {
    let mut builder = h2::server::Builder::new();
    builder
        .max_concurrent_streams(MAX_CONCURRENT_STREAMS)
        .max_header_list_size(MAX_HEADER_LIST)
        .max_pending_accept_reset_streams(MAX_PENDING_ACCEPT_RESETS)
        .max_local_error_reset_streams(Some(MAX_LOCAL_ERROR_RESETS))
        .max_concurrent_reset_streams(MAX_CONCURRENT_RESETS)
        .reset_stream_duration(RESET_STREAM_DURATION)
        .max_send_buffer_size(send_buffer);
    builder
}

/// Largest response header list (and trailer list) accepted from an h2c backend: the HTTP/1.1
/// proxy's limit on a backend's response head (64 KiB).
pub const MAX_BACKEND_HEADER_LIST: u32 = 65536;
/// Streams the proxy opens at once on one h2c backend connection; more go on another
/// connection (within --backend-max-connections). A backend's own
/// SETTINGS_MAX_CONCURRENT_STREAMS, when lower, is honoured by h2 (streams wait for a place).
pub const MAX_BACKEND_STREAMS: usize = 100;

/// The client side, towards h2c backends.
pub fn client() -> h2::client::Builder {
    let mut builder = h2::client::Builder::new();
    builder
        // The backend pushes nothing the proxy could forward (clients of the proxy get no
        // PUSH_PROMISE either).
        .enable_push(false)
        .max_header_list_size(MAX_BACKEND_HEADER_LIST)
        .max_concurrent_reset_streams(MAX_CONCURRENT_RESETS)
        .reset_stream_duration(RESET_STREAM_DURATION)
        .max_send_buffer_size(SEND_BUFFER);
    builder
}
