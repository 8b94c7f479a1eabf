use tlsplane_http::{parse_request, HttpError, Limits, Method, Parsed, Request};

fn complete(buf: &[u8]) -> (usize, Request) {
    match parse_request(buf, &Limits::default()) {
        Ok(Parsed::Complete { head_len, request }) => (head_len, request),
        other => panic!("expected a complete request, got {other:?}"),
    }
}

fn status_of(buf: &[u8], limits: &Limits) -> u16 {
    match parse_request(buf, limits) {
        Err(e) => e.status(),
        other => panic!("expected an error, got {other:?}"),
    }
}

#[test]
fn parses_a_simple_get() {
    let buf = b"GET /index.html?x=1 HTTP/1.1\r\nHost: example.com\r\nUser-Agent: t\r\n\r\n";
    let (len, r) = complete(buf);
    assert_eq!(len, buf.len());
    assert_eq!(r.method, Method::Get);
    assert_eq!(r.target, "/index.html?x=1");
    assert_eq!(r.minor_version, 1);
    assert!(r.keep_alive);
    assert_eq!(r.if_none_match, None);
    assert_eq!(r.range, None);
}

#[test]
fn parses_head_and_other_methods() {
    let (_, r) = complete(b"HEAD / HTTP/1.1\r\nHost: a\r\n\r\n");
    assert_eq!(r.method, Method::Head);
    let (_, r) = complete(b"DELETE /x HTTP/1.1\r\nHost: a\r\n\r\n");
    assert_eq!(r.method, Method::Other("DELETE".into()));
    let (_, r) = complete(b"get /x HTTP/1.1\r\nHost: a\r\n\r\n");
    assert_eq!(r.method, Method::Other("get".into()));
    assert_eq!(r.method.as_str(), "get");
}

#[test]
fn incomplete_heads_ask_for_more() {
    let full = b"GET / HTTP/1.1\r\nHost: a\r\nRange: bytes=0-1\r\n\r\n";
    for cut in 0..full.len() {
        assert_eq!(
            parse_request(&full[..cut], &Limits::default()),
            Ok(Parsed::Incomplete),
            "cut at {cut}"
        );
    }
    assert!(matches!(
        parse_request(full, &Limits::default()),
        Ok(Parsed::Complete { .. })
    ));
}

#[test]
fn pipelined_requests_are_found_by_head_len() {
    let buf = b"GET /a HTTP/1.1\r\nHost: h\r\n\r\nHEAD /b HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\nGET /c";
    let (first_len, first) = complete(buf);
    assert_eq!(first.target, "/a");
    assert!(first.keep_alive);
    let (second_len, second) = complete(&buf[first_len..]);
    assert_eq!(second.method, Method::Head);
    assert_eq!(second.target, "/b");
    assert!(!second.keep_alive);
    assert_eq!(
        parse_request(&buf[first_len + second_len..], &Limits::default()),
        Ok(Parsed::Incomplete)
    );
}

#[test]
fn accepts_leading_empty_lines_and_bare_lf() {
    let buf = b"\r\n\r\nGET /x HTTP/1.1\nHost: a\n\n";
    let (len, r) = complete(buf);
    assert_eq!(len, buf.len());
    assert_eq!(r.target, "/x");
}

#[test]
fn request_line_limit_is_414_complete_or_not() {
    let limits = Limits {
        max_request_line: 32,
        ..Limits::default()
    };
    // "GET " + target + " HTTP/1.1" is exactly 32 bytes: allowed.
    let target = format!("/{}", "a".repeat(32 - 4 - 9 - 1));
    let ok = format!("GET {target} HTTP/1.1\r\nHost: a\r\n\r\n");
    assert!(matches!(
        parse_request(ok.as_bytes(), &limits),
        Ok(Parsed::Complete { .. })
    ));
    // An exactly-full line whose LF has not arrived yet is still fine.
    let partial = format!("GET {target} HTTP/1.1\r");
    assert_eq!(
        parse_request(partial.as_bytes(), &limits),
        Ok(Parsed::Incomplete)
    );

    let long = format!("GET {target}b HTTP/1.1\r\nHost: a\r\n\r\n");
    assert_eq!(status_of(long.as_bytes(), &limits), 414);
    let long_incomplete = format!("GET /{}", "a".repeat(40));
    assert_eq!(
        parse_request(long_incomplete.as_bytes(), &limits),
        Err(HttpError::RequestLineTooLong)
    );
    // The default limit, without any line ending yet.
    let huge = format!("GET /{}", "a".repeat(8200));
    assert_eq!(status_of(huge.as_bytes(), &Limits::default()), 414);
}

#[test]
fn head_limit_is_431_complete_or_not() {
    let limits = Limits {
        max_head_bytes: 64,
        ..Limits::default()
    };
    let mut buf = b"GET / HTTP/1.1\r\nHost: a\r\n".to_vec();
    while buf.len() <= 64 {
        buf.extend_from_slice(b"X: y\r\n");
    }
    assert_eq!(parse_request(&buf, &limits), Err(HttpError::HeadTooLarge));
    buf.extend_from_slice(b"\r\n");
    assert_eq!(status_of(&buf, &limits), 431);

    // At exactly the limit without a complete head we still wait.
    let mut exact = b"GET / HTTP/1.1\r\nHost: a\r\nX: ".to_vec();
    exact.resize(64, b'y');
    assert_eq!(parse_request(&exact, &limits), Ok(Parsed::Incomplete));

    // Many small headers with the default limit: 431 even while incomplete.
    let mut flood = b"GET / HTTP/1.1\r\n".to_vec();
    while flood.len() <= 16384 {
        flood.extend_from_slice(b"A-Long-Header-Name: some long value here\r\n");
    }
    let limits = Limits {
        max_headers: 10_000,
        ..Limits::default()
    };
    assert_eq!(status_of(&flood, &limits), 431);
}

#[test]
fn too_many_headers_is_431() {
    let mut buf = b"GET / HTTP/1.1\r\nHost: a\r\n".to_vec();
    for i in 0..63 {
        buf.extend_from_slice(format!("X-{i}: v\r\n").as_bytes());
    }
    let mut ok = buf.clone();
    ok.extend_from_slice(b"\r\n");
    // 64 headers: exactly the default limit.
    assert!(matches!(
        parse_request(&ok, &Limits::default()),
        Ok(Parsed::Complete { .. })
    ));
    buf.extend_from_slice(b"X-64: v\r\n");
    // One too many, even before the head is complete.
    assert_eq!(
        parse_request(&buf, &Limits::default()),
        Err(HttpError::TooManyHeaders)
    );
    buf.extend_from_slice(b"\r\n");
    assert_eq!(status_of(&buf, &Limits::default()), 431);

    let small = Limits {
        max_headers: 2,
        ..Limits::default()
    };
    assert_eq!(
        status_of(b"GET / HTTP/1.1\r\nHost: a\r\nA: 1\r\nB: 2\r\n\r\n", &small),
        431
    );
    // A limit above the stack array goes through the heap path.
    let big = Limits {
        max_headers: 500,
        ..Limits::default()
    };
    assert!(matches!(
        parse_request(&ok, &big),
        Ok(Parsed::Complete { .. })
    ));
}

#[test]
fn other_versions_are_505_and_garbage_400() {
    let l = Limits::default();
    assert_eq!(status_of(b"GET / HTTP/2.0\r\nHost: a\r\n\r\n", &l), 505);
    assert_eq!(status_of(b"GET / HTTP/3\r\n\r\n", &l), 505);
    assert_eq!(status_of(b"GET / HTTP/10.1\r\nHost: a\r\n\r\n", &l), 400);
    // Detected before the head is complete.
    assert_eq!(status_of(b"GET / HTTP/2.0\r\n", &l), 505);
    assert_eq!(status_of(b"GET / HTTP/x.y\r\n\r\n", &l), 400);
    assert_eq!(status_of(b"GET / FTP/1.0\r\n\r\n", &l), 400);
    assert_eq!(status_of(b"GET /\r\n\r\n", &l), 400);
    assert_eq!(status_of(b"\x00\x01\x02 garbage\r\n\r\n", &l), 400);
    assert_eq!(status_of(b"GET  / HTTP/1.1\r\nHost: a\r\n\r\n", &l), 400);
    assert_eq!(status_of(b"GET / HTTP/1.1\r\nHost : a\r\n\r\n", &l), 400);
    assert_eq!(
        status_of(b"GET / HTTP/1.1\r\nHost: a\r\n folded\r\n\r\n", &l),
        400
    );
    assert_eq!(
        status_of(b"GET / HTTP/1.1\r\nBad\x01Name: a\r\n\r\n", &l),
        400
    );
}

#[test]
fn host_rules() {
    let l = Limits::default();
    assert_eq!(status_of(b"GET / HTTP/1.1\r\n\r\n", &l), 400);
    assert_eq!(
        status_of(b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", &l),
        400
    );
    // HTTP/1.0 predates Host.
    let (_, r) = complete(b"GET / HTTP/1.0\r\n\r\n");
    assert_eq!(r.minor_version, 0);
}

#[test]
fn bodies_are_refused() {
    let l = Limits::default();
    let te = b"GET / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n";
    assert_eq!(
        parse_request(te, &l),
        Err(HttpError::TransferEncodingNotSupported)
    );
    assert_eq!(status_of(te, &l), 501);
    let te_and_cl =
        b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n";
    assert_eq!(status_of(te_and_cl, &l), 501);
    assert_eq!(
        status_of(
            b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\n",
            &l
        ),
        413
    );
    assert_eq!(
        status_of(
            b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 99999999999999999999999\r\n\r\n",
            &l
        ),
        413
    );
    assert_eq!(
        status_of(
            b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: -1\r\n\r\n",
            &l
        ),
        400
    );
    assert_eq!(
        status_of(
            b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 1x\r\n\r\n",
            &l
        ),
        400
    );
    assert_eq!(
        status_of(
            b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\nContent-Length: 2\r\n\r\n",
            &l
        ),
        400
    );
    assert_eq!(
        status_of(
            b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 0, 1\r\n\r\n",
            &l
        ),
        400
    );
    // An explicit empty body is no body.
    let (_, r) =
        complete(b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\nContent-Length: 0, 0\r\n\r\n");
    assert_eq!(r.target, "/");
}

#[test]
fn keep_alive_rules() {
    let ka = |buf: &[u8]| complete(buf).1.keep_alive;
    assert!(ka(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"));
    assert!(!ka(
        b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"
    ));
    assert!(!ka(
        b"GET / HTTP/1.1\r\nHost: a\r\nConnection: Upgrade, CLOSE\r\n\r\n"
    ));
    assert!(!ka(
        b"GET / HTTP/1.1\r\nHost: a\r\nConnection: foo\r\nConnection: close\r\n\r\n"
    ));
    assert!(!ka(b"GET / HTTP/1.0\r\n\r\n"));
    assert!(ka(b"GET / HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n"));
    assert!(!ka(
        b"GET / HTTP/1.0\r\nConnection: keep-alive, close\r\n\r\n"
    ));
    // Substrings of other tokens do not count.
    assert!(ka(
        b"GET / HTTP/1.1\r\nHost: a\r\nConnection: closed\r\n\r\n"
    ));
}

#[test]
fn conditional_and_range_headers_are_captured() {
    let (_, r) = complete(
        b"GET /f HTTP/1.1\r\nHost: a\r\nif-none-match: \"a\"\r\nIf-None-Match:  W/\"b\" \r\n\
          If-Modified-Since: Sun, 06 Nov 1994 08:49:37 GMT\r\nRANGE: bytes=0-1\r\nIf-Range: \"a\"\r\n\r\n",
    );
    assert_eq!(r.if_none_match.as_deref(), Some("\"a\", W/\"b\""));
    assert_eq!(
        r.if_modified_since.as_deref(),
        Some("Sun, 06 Nov 1994 08:49:37 GMT")
    );
    assert_eq!(r.range.as_deref(), Some("bytes=0-1"));
    assert_eq!(r.if_range.as_deref(), Some("\"a\""));

    // A repeated Range becomes a list, which is then treated as multi-range.
    let (_, r) =
        complete(b"GET /f HTTP/1.1\r\nHost: a\r\nRange: bytes=0-1\r\nRange: bytes=2-3\r\n\r\n");
    assert_eq!(r.range.as_deref(), Some("bytes=0-1, bytes=2-3"));
}

#[test]
fn error_display_and_status_are_consistent() {
    for (e, status) in [
        (HttpError::BadRequest("x"), 400),
        (HttpError::RequestLineTooLong, 414),
        (HttpError::HeadTooLarge, 431),
        (HttpError::TooManyHeaders, 431),
        (HttpError::VersionNotSupported, 505),
        (HttpError::TransferEncodingNotSupported, 501),
        (HttpError::BodyNotAccepted, 413),
        (HttpError::Forbidden("x"), 403),
        (HttpError::NotFound, 404),
        (HttpError::Io(std::io::ErrorKind::Other), 500),
    ] {
        assert_eq!(e.status(), status);
        assert!(!e.to_string().is_empty());
    }
}

/// Deterministic pseudo-random inputs: nothing may panic, and every
/// Complete must report a head length within the buffer.
#[test]
fn arbitrary_bytes_never_panic() {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let seeds: [&[u8]; 4] = [
        b"GET /a%20b?x HTTP/1.1\r\nHost: a\r\nRange: bytes=0-1\r\nConnection: close\r\n\r\n",
        b"HEAD / HTTP/1.0\r\nIf-None-Match: *\r\n\r\n",
        b"\r\n\r\nGET / HTTP/2.0\r\n\r\n",
        b"\xff\xfe\x00GET",
    ];
    let limits = [
        Limits::default(),
        Limits {
            max_request_line: 0,
            max_head_bytes: 0,
            max_headers: 0,
        },
        Limits {
            max_request_line: 10,
            max_head_bytes: 40,
            max_headers: 1,
        },
        Limits {
            max_request_line: usize::MAX,
            max_head_bytes: usize::MAX,
            max_headers: usize::MAX,
        },
    ];
    for round in 0..4000 {
        let mut buf = seeds[round % seeds.len()].to_vec();
        for _ in 0..(next() % 6) {
            let len = buf.len().max(1) as u64;
            let i = (next() % len) as usize;
            match next() % 3 {
                0 if !buf.is_empty() => {
                    let last = buf.len() - 1;
                    buf[i.min(last)] = next() as u8;
                }
                1 => {
                    let at = i.min(buf.len());
                    buf.insert(at, next() as u8);
                }
                _ => buf.truncate(i),
            }
        }
        for l in &limits {
            if let Ok(Parsed::Complete { head_len, .. }) = parse_request(&buf, l) {
                assert!(head_len <= buf.len());
            }
        }
    }
}

#[test]
fn a_space_inside_the_request_target_is_400_not_505() {
    let l = Limits::default();
    assert_eq!(status_of(b"GET /a b HTTP/1.1\r\nHost: a\r\n\r\n", &l), 400);
    assert_eq!(
        status_of(b"GET /a b c HTTP/1.1\r\nHost: a\r\n\r\n", &l),
        400
    );
    // Known before the head is complete too.
    assert_eq!(status_of(b"GET /a b HTTP/1.1\r\n", &l), 400);
}

#[test]
fn later_http1_minor_versions_are_served_as_11() {
    // RFC 9112 §2.3.
    for line in ["HTTP/1.2", "HTTP/1.9"] {
        let req = "GET /x HTTP/1.1\r\nHost: a\r\n\r\n".replace("HTTP/1.1", line);
        let (len, r) = complete(req.as_bytes());
        assert_eq!(len, req.len(), "{line}");
        assert_eq!(r.minor_version, 1, "{line}");
        assert_eq!(r.method, Method::Get);
        assert_eq!(r.target, "/x");
        assert!(r.keep_alive, "{line}: 1.1 semantics");
    }
    // After empty lines, incomplete, and with HTTP/1.1 rules (Host required).
    assert!(matches!(
        parse_request(b"\r\nGET / HTTP/1.2\r\nHost: a\r\n", &Limits::default()),
        Ok(Parsed::Incomplete)
    ));
    let (_, r) = complete(b"\r\nGET / HTTP/1.2\r\nHost: a\r\n\r\n");
    assert_eq!(r.minor_version, 1);
    assert_eq!(
        status_of(b"GET / HTTP/1.2\r\n\r\n", &Limits::default()),
        400
    );
    // 1.0 keeps its own semantics; 2.0 and later majors are still 505.
    let (_, r) = complete(b"GET / HTTP/1.0\r\n\r\n");
    assert_eq!(r.minor_version, 0);
    assert!(!r.keep_alive);
    assert_eq!(
        status_of(b"GET / HTTP/2.0\r\nHost: a\r\n\r\n", &Limits::default()),
        505
    );
}

#[test]
fn other_methods_with_a_body_are_complete_requests_that_close() {
    // The server answers 405 with Allow (docs/USAGE.md, "HTTP behaviour of `serve`"); the body is never read, so no keep-alive.
    for req in [
        &b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello"[..],
        b"PUT /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
    ] {
        let (_, r) = complete(req);
        assert!(matches!(r.method, Method::Other(_)));
        assert!(!r.keep_alive, "{}", String::from_utf8_lossy(req));
    }
    // Without a body an other method keeps the connection.
    let (_, r) = complete(b"DELETE /x HTTP/1.1\r\nHost: a\r\n\r\n");
    assert!(r.keep_alive);
    // Smuggling signs are still refused first.
    assert_eq!(
        status_of(
            b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
            &Limits::default()
        ),
        400
    );
}

#[test]
fn version_boundaries() {
    // RFC 9112 §2.3: HTTP-version = "HTTP/" DIGIT "." DIGIT. 1.0 and 1.1 as they are, a later
    // HTTP/1 minor as 1.1, another major 505 (HTTP/2 and HTTP/3 are often written without a
    // minor), anything outside the grammar 400.
    let l = Limits::default();
    let req = |v: &str| format!("GET / {v}\r\nHost: a\r\n\r\n");
    for (v, minor) in [
        ("HTTP/1.0", 0),
        ("HTTP/1.1", 1),
        ("HTTP/1.2", 1),
        ("HTTP/1.9", 1),
    ] {
        assert_eq!(complete(req(v).as_bytes()).1.minor_version, minor, "{v}");
    }
    for v in [
        "HTTP/0.9", "HTTP/2.0", "HTTP/2", "HTTP/3.0", "HTTP/3", "HTTP/9.9",
    ] {
        assert_eq!(status_of(req(v).as_bytes(), &l), 505, "{v}");
    }
    // HTTP/1 without its minor is our major, malformed: not a version we cannot speak.
    for v in [
        "HTTP/1",
        "HTTP/1.",
        "HTTP/10.1",
        "HTTP/1.10",
        "HTTP/1.a",
        "HTTP/2.x",
        "HTTP/2x",
        "HTTP/2.0x",
        "http/1.1",
        "HTTP/",
    ] {
        assert_eq!(status_of(req(v).as_bytes(), &l), 400, "{v}");
    }
    // Whatever the version, the line must end like any other request line: a CR must be
    // followed by LF, as for HTTP/1.1.
    for v in ["HTTP/1.1", "HTTP/1.2", "HTTP/2.0"] {
        let bare_cr = format!("GET / {v}\rX\nHost: a\r\n\r\n");
        assert_eq!(status_of(bare_cr.as_bytes(), &l), 400, "{v} with a bare CR");
        let trailing_space = format!("GET / {v} \r\nHost: a\r\n\r\n");
        assert_eq!(
            status_of(trailing_space.as_bytes(), &l),
            400,
            "{v} with a trailing space"
        );
    }
    // HTTP/0.9's request line has no version at all.
    assert_eq!(status_of(b"GET /index.html\r\n", &l), 400);
}

/// However a request is cut into reads, an answer given early must be the answer the whole
/// request gets: no 505 for a line that turns out to be garbage.
#[test]
fn early_answers_agree_with_the_whole_request() {
    let l = Limits::default();
    for full in [
        &b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"[..],
        b"GET / HTTP/1.2\r\nHost: a\r\n\r\n",
        b"GET / HTTP/1.2x\r\nHost: a\r\n\r\n",
        b"GET / HTTP/2.0\r\nHost: a\r\n\r\n",
        b"GET / HTTP/2.0x\r\nHost: a\r\n\r\n",
        b"GET / HTTP/2.0 x\r\nHost: a\r\n\r\n",
        b"GET / HTTP/2x\r\nHost: a\r\n\r\n",
        b"GET / HTTP/20\r\nHost: a\r\n\r\n",
        b"GET / HTTP/2.0\rX\nHost: a\r\n\r\n",
        b"GET / HTTP/1\r\nHost: a\r\n\r\n",
        b"GET /a b HTTP/1.1\r\nHost: a\r\n\r\n",
        b"POST /x HTTP/1.2\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello",
    ] {
        let whole = parse_request(full, &l).map_err(|e| e.status());
        for cut in 0..full.len() {
            if let Err(e) = parse_request(&full[..cut], &l) {
                assert_eq!(
                    Err(e.status()),
                    whole,
                    "{:?} cut after {:?}",
                    String::from_utf8_lossy(full),
                    String::from_utf8_lossy(&full[..cut])
                );
            }
        }
    }
}

#[test]
fn later_minor_version_heads_over_the_limit_are_431() {
    // The limit that bounds the caller's buffer holds for a head served as 1.1 too.
    let limits = Limits {
        max_head_bytes: 64,
        ..Limits::default()
    };
    for v in ["HTTP/1.1", "HTTP/1.2"] {
        let mut buf = format!("GET / {v}\r\nHost: a\r\nX: ").into_bytes();
        buf.resize(65, b'y');
        assert_eq!(
            parse_request(&buf, &limits),
            Err(HttpError::HeadTooLarge),
            "{v}"
        );
        // At exactly the limit it still waits.
        buf.truncate(64);
        assert_eq!(parse_request(&buf, &limits), Ok(Parsed::Incomplete), "{v}");
    }
    let mut big = b"GET / HTTP/1.2\r\nHost: a\r\nX: ".to_vec();
    big.resize(17_000, b'y');
    assert_eq!(status_of(&big, &Limits::default()), 431);
}

#[test]
fn host_name_drops_the_port_and_ipv6_brackets() {
    let host = |h: &str| {
        let buf = format!("GET / HTTP/1.1\r\nHost: {h}\r\n\r\n");
        complete(buf.as_bytes()).1.host_name().map(str::to_owned)
    };
    assert_eq!(host("Example.com:8443").as_deref(), Some("Example.com"));
    assert_eq!(host("example.com").as_deref(), Some("example.com"));
    assert_eq!(host("[::1]:8443").as_deref(), Some("::1"));
    assert_eq!(host("127.0.0.1:1").as_deref(), Some("127.0.0.1"));
    let (_, r) = complete(b"GET / HTTP/1.0\r\n\r\n");
    assert_eq!(r.host_name(), None);
}
