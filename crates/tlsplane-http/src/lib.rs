//! HTTP/1.1 request parsing and static-file response planning for `tlsplane serve`.
//!
//! The crate does no network I/O: the caller owns sockets and buffers, feeds
//! received bytes to [`parse_request`], asks [`respond`] what to send, writes
//! [`Response::head`] and then the [`Body`] (a [`Body::File`] is meant for
//! `sendfile`). Only filesystem look-ups (stat, `openat2`, canonicalize, open) happen here.
//!
//! # Behaviour worth knowing
//!
//! * Only `GET` and `HEAD` are served; anything else gets `405` with
//!   `Allow: GET, HEAD`, whatever its framing. If such a request announces a
//!   body (`Content-Length` > 0 or `Transfer-Encoding`), its
//!   [`Request::keep_alive`] is false and the `405` says `Connection: close`:
//!   the body is never read, so it would otherwise be taken for the next
//!   request.
//! * A `GET` or `HEAD` carrying a body is refused while parsing:
//!   `Transfer-Encoding` gives `501`, `Content-Length` greater than zero gives
//!   `413`. The caller should close the connection after either, for the same
//!   reason.
//! * `HTTP/1.1` requests must carry exactly one `Host` header (`400` otherwise),
//!   as RFC 9112 §3.2 demands of servers.
//! * `HTTP/1.0` and `HTTP/1.1` are served as such, a later HTTP/1 minor version
//!   (`HTTP/1.2` ... `HTTP/1.9`) as `HTTP/1.1` (RFC 9112 §2.3). Another major
//!   version, with or without its minor (`HTTP/0.9`, `HTTP/2.0`, `HTTP/3`), gets
//!   `505`; a request line outside the grammar gets `400`: a space in the
//!   target, more or fewer than two spaces, `HTTP/1` or `HTTP/10.1` (the version
//!   is `HTTP/` DIGIT `.` DIGIT), no version at all (an HTTP/0.9-style line).
//!   The answer does not depend on how the request was split across reads.
//! * There are no directory listings: a directory without `index.html` is `403`.
//! * A path with a segment starting with `.` (`/.git/config`, `/.env`) is `404` unless the
//!   [`DocRoot`] serves dot-files; `/.well-known/` is always served. Files the server holds
//!   secret ([`Withheld`]: its keys) are `404` whatever path leads to them.
//! * A request-target may be origin-form or absolute-form (`https://host/p`,
//!   of which only the path is used). `..` segments are resolved lexically and
//!   give `403` when they would climb above the root; a percent-decoded `/`,
//!   `\` or NUL inside a segment gives `400`.
//! * Unless the [`DocRoot`] allows symlinks leading outside, no file outside
//!   the root is ever opened. A regular file is opened with `openat2(2)`
//!   relative to the root with `RESOLVE_BENEATH`, so the kernel refuses any
//!   path walk that leaves it (three syscalls per request). What that cannot
//!   open (an absolute symlink, a directory, a kernel before 5.6) takes the
//!   full check: the canonical path must lie inside the canonical root before
//!   opening, and the descriptor's `/proc/self/fd` path after (when `/proc` is
//!   mounted), so a symlink swapped in between cannot leak an outside file.
//! * Nothing but a regular file is opened: the type is checked with a stat
//!   before the open and again on the descriptor.
//! * Ranges: one `bytes=` range is honoured for `GET`; several ranges, other
//!   units or malformed specs are ignored and the whole file is sent (RFC 9110
//!   §14.2 allows this). `HEAD` ignores `Range`, as RFC 9110 §14.2 requires
//!   for methods other than `GET`. A zero-length file ignores `Range` too and
//!   is sent as `200` with an empty body, since there is no byte a range could
//!   describe and clients fare better with an empty success than with `416`.

#![warn(missing_docs)]

mod date;
mod error;
pub mod forward;
mod head;
mod mime;
mod parse;
mod resolve;
mod response;
mod rules;

pub use date::{http_date, parse_http_date};
pub use error::HttpError;
pub use head::HeadReader;
pub use mime::content_type;
pub use parse::{parse_request, Limits, Method, Parsed, Request};
pub use resolve::{DocRoot, Withheld};
pub use response::{
    error_response, error_response_at, fields_of, reason_phrase, respond, Body, Response,
};
