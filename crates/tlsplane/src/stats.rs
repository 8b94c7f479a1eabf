//! Process-wide counters. Cheap relaxed atomics: they are for operators and tests, not for
//! synchronisation.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

macro_rules! counters {
    ($( $(#[$doc:meta])* $name:ident ),* $(,)?) => {
        /// Counters of the TLS layer; read them with [`Stats::snapshot`].
        #[derive(Default)]
        pub struct Stats { $( $(#[$doc])* pub $name: AtomicU64, )* }

        impl Stats {
            /// All counters as (name, value) pairs, in declaration order.
            pub fn snapshot(&self) -> Vec<(&'static str, u64)> {
                vec![ $( (stringify!($name), self.$name.load(Relaxed)), )* ]
            }
        }
    };
}

counters! {
    /// Handshakes completed.
    handshakes,
    /// Handshakes that resumed a session.
    handshakes_resumed,
    /// Handshakes that failed (any reason).
    handshake_failures,
    /// Handshake failures caused by the peer's input (bad ClientHello, bad record, alert).
    handshake_peer_errors,
    /// Connections whose records the kernel encrypts and decrypts.
    plane_kernel,
    /// Connections on the user-space record layer.
    plane_user,
    /// Why a connection stayed in user space: policy said so.
    fallback_policy,
    /// ... the kernel has no TLS ULP.
    fallback_no_ulp,
    /// ... the kernel cannot take the negotiated suite.
    fallback_suite,
    /// ... attaching the ULP to this socket failed.
    fallback_ulp_attach,
    /// ... records were already buffered past the handshake (never expected: reads are exact).
    fallback_buffered,
    /// Key hand-off to the kernel failed after the point of no return; connection closed.
    kernel_setup_failures,
    /// Connections refused because `--data-plane kernel` was required but not possible.
    kernel_required_refused,
    /// Alerts we sent (fatal or close_notify) on the kernel plane.
    kernel_alerts_sent,
    /// Peer alerts received on the kernel plane (close_notify excluded).
    kernel_alerts_received,
    /// close_notify received from the peer (either plane).
    close_notify_received,
    /// Records that failed to decrypt on the kernel plane (EBADMSG).
    kernel_decrypt_errors,
    /// KeyUpdate messages handled by re-keying the kernel.
    key_updates,
    /// KeyUpdate received on a kernel without TLS 1.3 rekey: connection ended cleanly.
    key_update_unsupported,
    /// Connections ended because the peer sent KeyUpdates faster than allowed (kernel plane).
    limit_key_updates,
    /// Renegotiation attempts (a TLS 1.2 ClientHello after the handshake) refused on the
    /// kernel plane; on the user plane rustls refuses them itself.
    renegotiations_refused,
    /// Connections re-keyed (TLS 1.3) because the AEAD confidentiality limit came near.
    aead_limit_rekeys,
    /// Connections closed because the AEAD limit came near and re-keying was impossible.
    aead_limit_closes,
    /// Unexpected post-handshake messages from the peer on the kernel plane.
    kernel_unexpected_messages,
    /// Application bytes delivered to the application, by plane (decrypted by the kernel or
    /// by rustls).
    bytes_rx_kernel,
    bytes_rx_user,
    /// Application bytes the application wrote, by plane (encrypted by the kernel, including
    /// sendfile, or by rustls).
    bytes_tx_kernel,
    bytes_tx_user,
    /// Connections that spoke plain HTTP to the TLS port (answered as the product chose).
    plain_http_requests,
    /// ClientHellos whose server name (or lack of one) matched no site, with no default site:
    /// refused with unrecognized_name or a reset.
    unknown_server_names,
    /// Signatures the key daemon did not deliver (it is down, slow or refused): each failed
    /// a handshake.
    keyd_sign_failures,
    /// Signatures made by this process with a key it holds (the server with `--keyd off`, or
    /// the key daemon), and the time spent making them (in the signing library, ns).
    signatures,
    signature_ns,
    /// Signatures the key daemon made for this server, and the time the handshakes waited for
    /// them (request sent to reply read, ns: the round trip and the daemon's signature).
    keyd_signatures,
    keyd_wait_ns,
    /// Closes that read and dropped the client's input until its end or a deadline after the
    /// last byte was sent (see `linger`): a close with unread input would reset the connection
    /// and destroy the response still on its way.
    lingering_closes,
    /// ... of them, ended by a deadline (between reads or in all) before the client closed.
    lingering_timeouts,
    /// ... of them, ended because the client sent more than the byte cap.
    lingering_byte_limits,
    /// Bytes read and dropped by lingering closes.
    lingering_bytes,
}

/// Connections open now, by plane: gauges (they go down), apart from the counters.
#[derive(Default)]
pub struct OpenByPlane {
    pub kernel: std::sync::atomic::AtomicI64,
    pub user: std::sync::atomic::AtomicI64,
}

/// The process-wide open-connection gauges.
pub fn open_by_plane() -> &'static OpenByPlane {
    static OPEN: std::sync::OnceLock<OpenByPlane> = std::sync::OnceLock::new();
    OPEN.get_or_init(OpenByPlane::default)
}

/// An established connection's place in [`open_by_plane`], left when it drops.
pub(crate) struct OpenGuard(crate::PlaneKind);

impl OpenGuard {
    pub(crate) fn new(plane: crate::PlaneKind) -> Self {
        Self::gauge(plane).fetch_add(1, Relaxed);
        OpenGuard(plane)
    }

    fn gauge(plane: crate::PlaneKind) -> &'static std::sync::atomic::AtomicI64 {
        match plane {
            crate::PlaneKind::Kernel => &open_by_plane().kernel,
            crate::PlaneKind::User => &open_by_plane().user,
        }
    }
}

impl Drop for OpenGuard {
    fn drop(&mut self) {
        Self::gauge(self.0).fetch_sub(1, Relaxed);
    }
}

/// The process-wide counters.
pub fn global() -> &'static Stats {
    static STATS: std::sync::OnceLock<Stats> = std::sync::OnceLock::new();
    STATS.get_or_init(Stats::default)
}

pub(crate) fn bump(c: &AtomicU64) {
    c.fetch_add(1, Relaxed);
}

pub(crate) fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Relaxed);
}

/// Renders counters as one JSON object (names are identifiers, values integers: no escaping).
pub fn to_json(pairs: &[(&'static str, u64)]) -> String {
    let body: Vec<String> = pairs.iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
    format!("{{{}}}", body.join(","))
}
