//! The server core every tlsplane product shares: the configuration (flags and the TOML file
//! behind them, the sites), listeners and workers (the runtime), the lobby where silent
//! connections wait, limits and admission, reload on SIGHUP, the admin endpoint (`/metrics`),
//! the access log, and the key daemon (`tlsplane keyd`, its supervision, `--user`).
//!
//! A product (`serve`, `proxy`, `handoff`, in the `tlsplane` binary) is a
//! [`server::Product`] that builds a [`runtime::Handler`]: given an established TLS
//! connection, serve it. [`server::run`] starts everything else the same way for every
//! product.
//!
//! What products use: [`server`] (flags, `Product`, `run`), [`runtime`] (`Handler`, the
//! connection context, `RuntimeStats`), [`config`] (sites, their origins, backends) and
//! [`access_log`]; the binary also runs [`keyd`] and the `--user` launcher ([`privileges`]).
//! [`admin`], [`keys`] and [`limits`] are public for the types of the flags and counters
//! above; the lobby and the counters' module are internal.

pub mod access_log;
pub mod admin;
pub mod config;
pub mod keyd;
pub mod keys;
pub mod limit_sync;
pub mod limits;
mod lobby;
pub mod privileges;
pub mod runtime;
pub mod secret_file;
pub mod served_secrets;
pub mod server;
mod stats;
pub mod ticket_store;
pub mod unix_socket;
