//! tlsplane: TLS split in two planes.
//!
//! The **control plane** (this crate, on rustls with the aws-lc-rs provider) runs the handshake,
//! owns certificates and keys, and handles alerts and post-handshake messages. The **data plane**
//! moves application records: preferably the Linux kernel ([`plane::kernel`], kTLS), so that
//! `sendfile(2)` keeps its zero-copy path, otherwise rustls' own record layer in user space
//! ([`plane::user`]). The choice is made per connection after the handshake and the application
//! sees one [`TlsStream`] either way.
//!
//! Every system call that needs `unsafe` lives in `tlsplane-sys`; this crate forbids it.

mod buf;
pub mod cert;
pub mod config;
pub mod error;
mod handshake;
pub mod hello;
mod inner_type;
pub mod keyd;
pub mod linger;
pub mod plane;
pub mod probe;
pub mod sites;
pub mod stats;
mod stream;
pub mod tickets;

pub use config::{Acceptor, DataPlanePolicy, ServerOptions, SiteTls};
pub use error::Error;
pub use linger::Linger;
pub use plane::kernel::{HandedKeyError, HandedKeys, ReKeyed};
pub use plane::PlaneKind;
pub use stream::{ConnectionInfo, DetachedTlsStream, KernelHandoff, Received, Spliced, TlsStream};
