//! Hand-off of established TLS connections to other programs over `SCM_RIGHTS` (issue 21).
//!
//! tlsplane runs the handshake, keeps the keys, and passes the connected socket, with a small
//! versioned header ([`ConnInfo`]), to a program connected to its hand-off Unix socket. The
//! program reads and writes plaintext; on the kernel plane the descriptor is the kTLS socket
//! itself, and the program sends tlsplane KEY_UPDATE and CLOSE requests on the same Unix
//! connection, since the traffic secrets never leave tlsplane.
//!
//! - [`wire`]: the byte layout (also in docs/HANDOFF.md), pure and I/O-free.
//! - [`HandoffClient`]: the blocking Rust receiver; [`send_connection`] and [`send_reply`]:
//!   what the sending side calls.
//! - [`ServerUids`]: who a receiver accepts at the hand-off path (`SO_PEERCRED`,
//!   `TLSPLANE_HANDOFF_UID`), since anyone may bind that path while tlsplane is away.
//!
//! The C ABI lives in `tlsplane-handoff-c` (it needs `unsafe` for raw pointers; this crate
//! forbids it), the Python module in `python/tlsplane_handoff.py`.

mod client;
mod trust;
pub mod wire;

pub use client::{
    read_frame, send_connection, send_reply, Connection, HandoffClient, DEFAULT_QUEUE_LIMIT,
};
pub use trust::{ServerUids, MAX_SERVER_UIDS, SERVER_UID_ENV};
pub use wire::{ConnInfo, Error, Message, Plane, Reply, Status};
