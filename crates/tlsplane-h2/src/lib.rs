//! HTTP/2 for tlsplane's products (docs/HTTP2.md). hyperium's `h2` does the protocol; this
//! crate holds what tlsplane writes around it, apart from the products so that the fuzz
//! targets (fuzz/) drive the same code the products run:
//!
//! - [`transport`]: the transport h2 runs on over a [`tlsplane::TlsStream`] (or any
//!   [`transport::Transport`]), whose outbox follows h2's frames and puts file bytes in place
//!   of the placeholder payloads of file bodies;
//! - [`flood`]: the caps on the control frames a client sends (SETTINGS, PING,
//!   WINDOW_UPDATE, PRIORITY), which h2 would answer or take without end;
//! - [`greeting`]: a connection's opening kept without h2 until the first request, so that
//!   h2's buffers are allocated only for connections that ask for something;
//! - [`settings`]: the h2 settings every product uses, each with its reason;
//! - [`serve`]: `serve`'s answers to h2 requests, planned by `tlsplane-http`.

pub mod flood;
pub mod greeting;
pub mod serve;
pub mod settings;
pub mod transport;
