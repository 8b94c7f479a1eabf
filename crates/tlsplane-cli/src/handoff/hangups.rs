//! Which ended first: a relayed connection (its program closed or shut down its end of the
//! socketpair) or the program's receiver connection.
//!
//! A program that closes a connection and one killed while it holds the connection look
//! alike on the socketpair: its end closes. Two things tell them apart, checked when the end
//! is seen, not when the relay has drained what came before it:
//! - the order of ends: one epoll set watches the hang-up of every receiver and of every
//!   relayed socketpair end; the kernel queues ready entries in the order their hang-ups
//!   happened, and one thread reads them in that order, so a connection whose receiver went
//!   first was abandoned;
//! - the receiver's process: a dying process is marked exiting (`PF_EXITING`, in
//!   `/proc/PID/stat`) before the kernel releases any of its descriptors (and it releases
//!   them newest first, so the connections before the receiver's), so an end seen while
//!   the process that connected as the receiver is exiting, or gone, was a death.
//!
//! Otherwise the connection ended in order (its client gets close_notify); abandoned, its
//! client gets a reset. A program that closes a connection in the very moment it exits may
//! see it reset: it fails as a cut, never as a false whole.

use std::collections::{HashMap, HashSet};
use std::os::fd::BorrowedFd;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tlsplane_sys::PeerEndWatch;
use tokio::sync::watch;

/// Tokens of receivers carry this bit; relays' are a counter below it.
const RECEIVER: u64 = 1 << 63;

/// How a relayed connection's program end stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum End {
    Open,
    /// Closed or shut down while its receiver was connected.
    Orderly,
    /// Its receiver went first.
    Abandoned,
}

pub struct Hangups {
    watch: PeerEndWatch,
    table: Mutex<Table>,
}

#[derive(Default)]
struct Table {
    /// Receivers watched and not yet seen to go.
    receivers: HashSet<u64>,
    /// Open relays by token: their receiver and its process id, and where their end is told.
    relays: HashMap<u64, (u64, u32, Arc<watch::Sender<End>>)>,
    next: u64,
}

/// A relay's end, as the watching thread decides it.
pub struct RelayEnd {
    token: u64,
    end: Arc<watch::Sender<End>>,
    hangups: Arc<Hangups>,
}

impl Hangups {
    pub fn start() -> std::io::Result<Arc<Self>> {
        let h = Arc::new(Self {
            watch: PeerEndWatch::new()?,
            table: Mutex::new(Table::default()),
        });
        let weak = Arc::downgrade(&h);
        std::thread::Builder::new()
            .name("handoff-hangups".into())
            .spawn(move || watch_loop(&weak))?;
        Ok(h)
    }

    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Watches receiver `id`'s connection (before it is given any connection).
    pub fn watch_receiver(&self, id: u64, sock: BorrowedFd<'_>) -> std::io::Result<()> {
        self.table().receivers.insert(id);
        let watched = self.watch.watch(sock, RECEIVER | id, false);
        if watched.is_err() {
            self.table().receivers.remove(&id);
        }
        watched
    }

    /// Watches `ours`, tlsplane's end of a relay about to be handed to receiver `receiver`
    /// of process `pid` (before the program has its end). A receiver already seen to go
    /// makes it abandoned.
    pub fn watch_relay(
        self: &Arc<Self>,
        receiver: u64,
        pid: u32,
        ours: BorrowedFd<'_>,
    ) -> std::io::Result<RelayEnd> {
        let mut t = self.table();
        t.next += 1;
        let token = t.next;
        let start = if t.receivers.contains(&receiver) {
            End::Open
        } else {
            End::Abandoned
        };
        let end = Arc::new(watch::channel(start).0);
        t.relays.insert(token, (receiver, pid, end.clone()));
        drop(t);
        if let Err(e) = self.watch.watch(ours, token, false) {
            self.table().relays.remove(&token);
            return Err(e);
        }
        Ok(RelayEnd {
            token,
            end,
            hangups: self.clone(),
        })
    }

    /// Events in the kernel's order.
    fn on_events(&self, tokens: &[u64]) {
        let mut t = self.table();
        for &token in tokens {
            if token & RECEIVER != 0 {
                let id = token & !RECEIVER;
                if !t.receivers.remove(&id) {
                    continue;
                }
                // Every connection of its still open is abandoned, whatever comes later.
                t.relays.retain(|_, (r, _, end)| {
                    if *r == id {
                        end.send_replace(End::Abandoned);
                        return false;
                    }
                    true
                });
            } else if let Some((_, pid, end)) = t.relays.remove(&token) {
                end.send_replace(if exiting(pid) {
                    End::Abandoned
                } else {
                    End::Orderly
                });
            }
        }
    }
}

impl RelayEnd {
    /// Whether the program ended the connection in order: waits for the watching thread to
    /// have seen the end (the caller read it already), at most `limit` (then: not in order).
    pub async fn orderly(&self, limit: Duration) -> bool {
        let mut rx = self.end.subscribe();
        let seen = tokio::time::timeout(limit, async {
            rx.wait_for(|e| *e != End::Open).await.map(|e| *e)
        })
        .await;
        matches!(seen, Ok(Ok(End::Orderly)))
    }

    pub fn is_abandoned(&self) -> bool {
        *self.end.borrow() == End::Abandoned
    }

    /// Resolves once the connection is known to be abandoned (its receiver went first).
    pub async fn abandoned(&self) {
        let mut rx = self.end.subscribe();
        let _ = rx.wait_for(|e| *e == End::Abandoned).await;
    }
}

impl Drop for RelayEnd {
    /// (Its descriptor leaves the epoll set when it closes, after this.)
    fn drop(&mut self) {
        self.hangups.table().relays.remove(&self.token);
    }
}

/// Whether process `pid` is exiting or gone: `PF_EXITING` in the flags of
/// `/proc/PID/stat`, or a zombie, or no such process.
fn exiting(pid: u32) -> bool {
    const PF_EXITING: u64 = 0x4;
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return true;
    };
    // After the command's closing parenthesis: state, ppid, pgrp, session, tty, tpgid, flags.
    let mut fields = stat
        .rsplit_once(')')
        .map_or("", |(_, rest)| rest)
        .split_ascii_whitespace();
    let state = fields.next().unwrap_or("X");
    let flags: u64 = fields.nth(5).and_then(|f| f.parse().ok()).unwrap_or(0);
    matches!(state, "Z" | "X" | "x") || flags & PF_EXITING != 0
}

fn watch_loop(hangups: &Weak<Hangups>) {
    let mut ready = Vec::new();
    loop {
        let Some(h) = hangups.upgrade() else {
            return;
        };
        ready.clear();
        // Wakes now and then to notice the product is gone.
        if let Err(e) = h.watch.wait(&mut ready, 1000) {
            tracing::warn!(error = %e, "hand-off: epoll_wait failed");
            std::thread::sleep(Duration::from_millis(100));
        }
        h.on_events(&ready);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_live_process_is_not_exiting_and_a_reaped_one_is_gone() {
        assert!(!exiting(std::process::id()));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        assert!(exiting(pid));
    }
}
