//! The HTTP proxy's request rules (`tlsplane_http::forward`), and the rules it shares with
//! serve's parser: what reaches a backend, and what is refused.

use tlsplane_http::forward::{
    parse_request_head, BadBody, BodyFraming, ForwardedPolicy, Framing, Head, Origin, RequestHead,
};
use tlsplane_http::{parse_request, HttpError, Limits, Parsed};

fn proxy(raw: &str, policy: ForwardedPolicy) -> Result<RequestHead, HttpError> {
    match parse_request_head(raw.as_bytes(), &Limits::default(), policy)? {
        Head::Complete(h, _) => Ok(h),
        Head::Incomplete => panic!("incomplete: {raw:?}"),
    }
}

/// What the backend is sent for `raw`.
fn sent(raw: &str, policy: ForwardedPolicy) -> String {
    let h = proxy(raw, policy).unwrap_or_else(|e| panic!("{raw:?} refused: {e}"));
    let mut out = Vec::new();
    let origin = Origin {
        client: "192.0.2.7".parse().unwrap(),
        proto: "https",
    };
    h.encode(origin, policy, &mut out);
    String::from_utf8(out).unwrap()
}

fn proxy_status(raw: &str) -> u16 {
    match proxy(raw, ForwardedPolicy::Replace) {
        Ok(h) => panic!("{raw:?} accepted: {h:?}"),
        Err(e) => e.status(),
    }
}

fn serve_status(raw: &str) -> Result<u8, u16> {
    match parse_request(raw.as_bytes(), &Limits::default()) {
        Ok(Parsed::Complete { request, .. }) => Ok(request.minor_version),
        Ok(Parsed::Incomplete) => panic!("incomplete: {raw:?}"),
        Err(e) => Err(e.status()),
    }
}

#[test]
fn connection_cannot_strip_host() {
    for conn in ["Host", "host, keep-alive", "close, HOST"] {
        let raw =
            format!("GET / HTTP/1.1\r\nHost: example.com\r\nConnection: {conn}\r\nX-A: 1\r\n\r\n");
        let out = sent(&raw, ForwardedPolicy::Off);
        assert!(out.contains("Host: example.com\r\n"), "{conn}: {out}");
    }
    // Other named fields still go (they are the client's to make hop-by-hop).
    let out = sent(
        "GET / HTTP/1.1\r\nHost: a\r\nConnection: X-A\r\nX-A: 1\r\n\r\n",
        ForwardedPolicy::Off,
    );
    assert!(!out.contains("X-A"), "{out}");
    // Framing named by Connection is written again from the parsed framing.
    let out = sent(
        "POST / HTTP/1.1\r\nHost: a\r\nConnection: Content-Length\r\nContent-Length: 3\r\n\r\n",
        ForwardedPolicy::Off,
    );
    assert!(out.contains("Content-Length: 3\r\n"), "{out}");
}

#[test]
fn absolute_form_goes_as_origin_form_with_its_host() {
    let out = sent(
        "GET http://Example.com:8443/a/b?q=1 HTTP/1.1\r\nHost: other.test\r\nX: y\r\n\r\n",
        ForwardedPolicy::Off,
    );
    assert_eq!(
        out,
        "GET /a/b?q=1 HTTP/1.1\r\nHost: Example.com:8443\r\nX: y\r\n\r\n"
    );
    let h = proxy(
        "GET https://example.com HTTP/1.1\r\nHost: x\r\n\r\n",
        ForwardedPolicy::Off,
    )
    .unwrap();
    assert_eq!(
        (h.target.as_str(), h.host.as_deref()),
        ("/", Some("example.com"))
    );
    let h = proxy(
        "GET http://example.com?x HTTP/1.0\r\n\r\n",
        ForwardedPolicy::Off,
    )
    .unwrap();
    assert_eq!(
        (h.target.as_str(), h.host.as_deref()),
        ("/?x", Some("example.com"))
    );
    assert!(sent(
        "GET http://example.com?x HTTP/1.0\r\n\r\n",
        ForwardedPolicy::Off
    )
    .contains("Host: example.com\r\n"));
    // Still HTTP/1.1's one Host; and `*` is left alone.
    assert_eq!(proxy_status("GET http://a/ HTTP/1.1\r\n\r\n"), 400);
    assert!(sent(
        "OPTIONS * HTTP/1.1\r\nHost: a\r\n\r\n",
        ForwardedPolicy::Off
    )
    .starts_with("OPTIONS * HTTP/1.1\r\n"));
    for bad in [
        "GET ftp://a/x HTTP/1.1\r\nHost: a\r\n\r\n",
        "GET http:///x HTTP/1.1\r\nHost: a\r\n\r\n",
        "GET http://user@a/x HTTP/1.1\r\nHost: a\r\n\r\n",
        "GET x HTTP/1.1\r\nHost: a\r\n\r\n",
    ] {
        assert_eq!(proxy_status(bad), 400, "{bad:?}");
    }
}

#[test]
fn only_a_websocket_upgrade_is_forwarded() {
    for raw in [
        "GET / HTTP/1.1\r\nHost: a\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: TLS/1.2\r\n\r\n",
    ] {
        let h = proxy(raw, ForwardedPolicy::Off).unwrap();
        assert_eq!(h.upgrade, None, "{raw:?}");
        let out = sent(raw, ForwardedPolicy::Off);
        assert!(
            !out.to_ascii_lowercase().contains("upgrade") && !out.contains("HTTP2-Settings"),
            "{out}"
        );
        assert!(h.keep_alive, "a plain request again");
    }
    let h = proxy(
        "GET / HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: h2c, WebSocket\r\n\r\n",
        ForwardedPolicy::Off,
    )
    .unwrap();
    assert_eq!(h.upgrade.as_deref(), Some("websocket"));
}

#[test]
fn transfer_codings_and_chunk_sizes_are_strict() {
    for raw in [
        "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: identity, chunked\r\n\r\n",
        "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: identity\r\nTransfer-Encoding: chunked\r\n\r\n",
        "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: foo, chunked\r\n\r\n",
    ] {
        assert_eq!(proxy_status(raw), 400, "{raw:?}");
    }
    let h = proxy(
        "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
        ForwardedPolicy::Off,
    )
    .unwrap();
    assert_eq!(h.framing, Framing::Chunked);
    for body in [
        &b"5 \r\nhello\r\n0\r\n\r\n"[..],
        b"5\t\r\nhello\r\n0\r\n\r\n",
        b"5 ;x\r\nhello\r\n0\r\n\r\n",
        b"5;\x00\r\nhello\r\n",
    ] {
        let mut f = BodyFraming::new(Framing::Chunked);
        assert_eq!(f.advance(body), Err(BadBody::ChunkSize), "{body:?}");
    }
    let mut f = BodyFraming::new(Framing::Chunked);
    assert_eq!(f.advance(b"5;a=b\r\nhello\r\n0\r\n\r\n"), Ok(19));
    assert!(f.is_done());
}

#[test]
fn trailers_are_checked_like_fields() {
    let end = |trailers: &[u8]| {
        let mut body = b"3\r\nabc\r\n0\r\n".to_vec();
        body.extend_from_slice(trailers);
        body.extend_from_slice(b"\r\n");
        // Byte by byte, as the worst split.
        let mut f = BodyFraming::new(Framing::Chunked);
        for b in &body {
            f.advance(std::slice::from_ref(b))?;
        }
        assert!(f.is_done());
        Ok::<_, BadBody>(())
    };
    assert_eq!(
        end(b"X-Checksum: abc\r\nServer-Timing: db;dur=53\r\n"),
        Ok(())
    );
    assert_eq!(
        end(b"X-Long-Name-That-Is-Longer-Than-Any-Forbidden-One: 1\r\n"),
        Ok(())
    );
    for bad in [
        &b"no colon here\r\n"[..],
        b"NoColon\r\n",
        b"Bad Name: 1\r\n",
        b"X-A : 1\r\n",
        b": empty name\r\n",
        b"X-A: 1\r\n folded\r\n",
        b"X-A: a\x00b\r\n",
        b"Content-Length: 5\r\n",
        b"content-length:5\r\n",
        b"Transfer-Encoding: chunked\r\n",
        b"Host: evil\r\n",
        b"X-Forwarded-For: 6.6.6.6\r\n",
        b"X_Forwarded_For: 6.6.6.6\r\n",
        b"Authorization: Basic x\r\n",
    ] {
        assert_eq!(
            end(bad),
            Err(BadBody::Trailer),
            "{:?}",
            String::from_utf8_lossy(bad)
        );
    }
}

#[test]
fn replace_drops_every_spelling_of_the_forwarding_fields() {
    let raw = "GET / HTTP/1.1\r\nHost: a\r\nX_Forwarded_For: 6.6.6.6\r\nx_forwarded_proto: http\r\n\
               X-Real-IP: 6.6.6.6\r\nX_Real_IP: 6.6.6.6\r\nX-Forwarded-Host: evil\r\nX-Forwarded-Port: 1\r\n\
               X-Keep_Me: k\r\n\r\n";
    let out = sent(raw, ForwardedPolicy::Replace);
    assert!(!out.contains("6.6.6.6") && !out.contains("evil"), "{out}");
    assert!(!out.contains("X-Forwarded-Port"), "{out}");
    assert!(out.contains("X-Keep_Me: k\r\n"), "{out}");
    assert!(out.contains("X-Forwarded-For: 192.0.2.7\r\n"), "{out}");
    // append keeps them (a trusted proxy in front wrote them).
    assert!(sent(raw, ForwardedPolicy::Append).contains("X-Real-IP: 6.6.6.6\r\n"));
}

#[test]
fn serve_and_proxy_read_versions_and_lengths_alike() {
    // One rule, asked of both parsers.
    let head = |v: &str, extra: &str| format!("GET / {v}\r\nHost: a\r\n{extra}\r\n");
    for v in ["HTTP/1.2", "HTTP/1.9"] {
        let raw = head(v, "");
        assert_eq!(serve_status(&raw), Ok(1), "serve {v}");
        let h = proxy(&raw, ForwardedPolicy::Off).unwrap_or_else(|e| panic!("proxy {v}: {e}"));
        assert_eq!(h.minor_version, 1, "proxy {v}");
        assert!(sent(&raw, ForwardedPolicy::Off).starts_with("GET / HTTP/1.1\r\n"));
    }
    for (v, want) in [
        ("HTTP/2.0", 505),
        ("HTTP/3", 505),
        ("HTTP/1.x", 400),
        ("HTTP/10.1", 400),
    ] {
        let raw = head(v, "");
        assert_eq!(serve_status(&raw), Err(want), "serve {v}");
        assert_eq!(proxy_status(&raw), want, "proxy {v}");
    }
    // Identical Content-Length values are one (RFC 9110 §8.6); differing ones are refused.
    for cl in [
        "Content-Length: 0, 0\r\n",
        "Content-Length: 0\r\nContent-Length: 0\r\n",
    ] {
        assert!(serve_status(&head("HTTP/1.1", cl)).is_ok(), "serve {cl:?}");
        let h = proxy(&head("HTTP/1.1", cl), ForwardedPolicy::Off).unwrap();
        assert_eq!(h.framing, Framing::Empty);
    }
    let post = |cl: &str| format!("POST / HTTP/1.1\r\nHost: a\r\n{cl}\r\n");
    let h = proxy(&post("Content-Length: 5, 5\r\n"), ForwardedPolicy::Off).unwrap();
    assert_eq!(h.framing, Framing::Length(5));
    assert!(
        sent(&post("Content-Length: 5, 5\r\n"), ForwardedPolicy::Off)
            .contains("Content-Length: 5\r\n")
    );
    for cl in [
        "Content-Length: 5, 6\r\n",
        "Content-Length: 5\r\nContent-Length: 6\r\n",
        "Content-Length: 5,\r\n",
    ] {
        assert_eq!(serve_status(&post(cl)), Err(400), "serve {cl:?}");
        assert_eq!(proxy_status(&post(cl)), 400, "proxy {cl:?}");
    }
}
