mod common;

use std::fs;
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::{body_bytes, get, head, now, req, root, TempDir};
use tlsplane_http::{
    content_type, error_response, error_response_at, http_date, parse_request, respond, Body,
    DocRoot, Limits, Method, Parsed,
};

fn site() -> TempDir {
    let dir = TempDir::new("site");
    dir.write("hello.txt", b"hello, world\n");
    dir.write("index.html", b"<h1>root</h1>");
    dir.write("sub/index.html", b"<h1>sub</h1>");
    dir.write("sub/data.json", b"{}");
    dir.write("digits.bin", b"0123456789");
    dir.write("empty.txt", b"");
    dir.mkdir("noindex");
    dir.write("etc/passwd", b"inside the root\n");
    dir
}

fn status(dir: &TempDir, target: &str) -> u16 {
    respond(&get(target), &root(dir), now()).status
}

#[test]
fn serves_a_file_with_full_headers() {
    let dir = site();
    let resp = respond(&get("/hello.txt"), &root(&dir), now());
    assert_eq!(resp.status, 200);
    assert!(resp.keep_alive);
    let h = head(&resp);
    assert_eq!(h.status_line, "HTTP/1.1 200 OK");
    assert_eq!(h.get("Server"), Some("tlsplane"));
    assert_eq!(h.get("Date"), Some("Tue, 14 Nov 2023 22:13:20 GMT"));
    assert_eq!(h.get("Content-Type"), Some("text/plain; charset=utf-8"));
    assert_eq!(h.get("Content-Length"), Some("13"));
    assert_eq!(h.get("Accept-Ranges"), Some("bytes"));
    assert_eq!(h.get("Connection"), Some("keep-alive"));
    assert_eq!(h.get("Content-Range"), None);
    let mtime = fs::metadata(dir.path().join("hello.txt"))
        .unwrap()
        .modified()
        .unwrap();
    assert_eq!(h.get("Last-Modified"), Some(http_date(mtime).as_str()));
    let nanos = mtime.duration_since(UNIX_EPOCH).unwrap().as_nanos();
    assert_eq!(h.get("ETag"), Some(format!("\"{nanos:x}-d\"").as_str()));
    match &resp.body {
        Body::File { offset, len, .. } => assert_eq!((*offset, *len), (0, 13)),
        other => panic!("expected a file body, got {other:?}"),
    }
    assert_eq!(body_bytes(resp), b"hello, world\n");
}

#[test]
fn connection_close_is_announced() {
    let dir = site();
    let mut r = get("/hello.txt");
    r.keep_alive = false;
    let resp = respond(&r, &root(&dir), now());
    assert!(!resp.keep_alive);
    assert_eq!(head(&resp).get("Connection"), Some("close"));
    let mut r = get("/missing");
    r.keep_alive = false;
    let resp = respond(&r, &root(&dir), now());
    assert_eq!(head(&resp).get("Connection"), Some("close"));
}

#[test]
fn head_matches_get_without_body() {
    let dir = site();
    let root = root(&dir);
    for target in ["/hello.txt", "/", "/missing", "/sub", "/empty.txt"] {
        let g = respond(&get(target), &root, now());
        let h = respond(&req(Method::Head, target), &root, now());
        assert_eq!(g.status, h.status, "{target}");
        assert_eq!(g.head, h.head, "{target}");
        assert!(matches!(h.body, Body::Empty), "{target}");
    }
    let h = respond(&req(Method::Head, "/hello.txt"), &root, now());
    assert_eq!(head(&h).get("Content-Length"), Some("13"));
}

#[test]
fn other_methods_are_405() {
    let dir = site();
    for m in ["POST", "PUT", "DELETE", "OPTIONS", "get"] {
        let resp = respond(
            &req(Method::Other(m.into()), "/hello.txt"),
            &root(&dir),
            now(),
        );
        assert_eq!(resp.status, 405);
        let h = head(&resp);
        assert_eq!(h.get("Allow"), Some("GET, HEAD"));
        assert_eq!(body_bytes(resp), b"405 Method Not Allowed\n");
    }
}

#[test]
fn missing_files_are_404() {
    let dir = site();
    assert_eq!(status(&dir, "/nope.txt"), 404);
    assert_eq!(status(&dir, "/nodir/nope.txt"), 404);
    // A file used as a directory.
    assert_eq!(status(&dir, "/hello.txt/"), 404);
    assert_eq!(status(&dir, "/hello.txt/x"), 404);
    assert_eq!(status(&dir, &format!("/{}", "n".repeat(300))), 404);
    let resp = respond(&get("/nope.txt"), &root(&dir), now());
    let h = head(&resp);
    assert_eq!(h.get("Content-Type"), Some("text/plain; charset=utf-8"));
    assert_eq!(h.get("Content-Length"), Some("14"));
    assert_eq!(body_bytes(resp), b"404 Not Found\n");
}

#[test]
fn directories_redirect_or_serve_index() {
    let dir = site();
    let root = root(&dir);
    let resp = respond(&get("/sub"), &root, now());
    assert_eq!(resp.status, 301);
    assert_eq!(head(&resp).get("Location"), Some("/sub/"));
    let resp = respond(&get("/sub?a=1&b=%20"), &root, now());
    assert_eq!(head(&resp).get("Location"), Some("/sub/?a=1&b=%20"));
    // The redirect is rebuilt from the normalized path, so `//host` cannot
    // turn it into an off-site link.
    let resp = respond(&get("//sub"), &root, now());
    assert_eq!(head(&resp).get("Location"), Some("/sub/"));
    let resp = respond(&get("/./sub/../sub"), &root, now());
    assert_eq!(head(&resp).get("Location"), Some("/sub/"));

    let resp = respond(&get("/sub/"), &root, now());
    assert_eq!(resp.status, 200);
    assert_eq!(
        head(&resp).get("Content-Type"),
        Some("text/html; charset=utf-8")
    );
    assert_eq!(body_bytes(resp), b"<h1>sub</h1>");
    let resp = respond(&get("/"), &root, now());
    assert_eq!(body_bytes(resp), b"<h1>root</h1>");
    let resp = respond(&get("/sub/data.json"), &root, now());
    assert_eq!(head(&resp).get("Content-Type"), Some("application/json"));
    // No listings.
    assert_eq!(respond(&get("/noindex/"), &root, now()).status, 403);
    assert_eq!(respond(&get("/noindex"), &root, now()).status, 301);
    // An index that is itself a directory is not served either.
    dir.mkdir("weird/index.html");
    assert_eq!(respond(&get("/weird/"), &root, now()).status, 403);
}

#[test]
fn target_forms() {
    let dir = site();
    assert_eq!(status(&dir, "/hello.txt?x=1#frag"), 200);
    assert_eq!(status(&dir, "/hello.txt#frag"), 200);
    assert_eq!(status(&dir, "/hel%6Co.txt"), 200);
    assert_eq!(status(&dir, "https://example.com/hello.txt"), 200);
    assert_eq!(status(&dir, "http://example.com"), 200);
    assert_eq!(status(&dir, "/sub/../hello.txt"), 200);
    assert_eq!(status(&dir, "/./hello.txt"), 200);
    dir.write("with space.txt", b"x");
    assert_eq!(status(&dir, "/with%20space.txt"), 200);
}

#[test]
fn malformed_targets_are_400() {
    let dir = site();
    for target in [
        "*",
        "hello.txt",
        "ftp://example.com/hello.txt",
        "/%",
        "/%zz",
        "/%0",
        "/%00",
        "/hello.txt%00.png",
        "/sub%2fdata.json",
        "/sub%5cdata.json",
        "/sub\\data.json",
    ] {
        assert_eq!(status(&dir, target), 400, "{target:?}");
    }
}

#[test]
fn traversal_never_leaves_the_root() {
    let dir = site();
    for target in [
        "/../etc/passwd",
        "/%2e%2e/%2e%2e/etc/passwd",
        "/%2E%2E/etc/passwd",
        "/.%2e/x",
        "/%2e./x",
        "/a/../../x",
        "/sub/../../etc/passwd",
        "/sub/%2e%2e/%2e%2e/etc/passwd",
        "http://h/../etc/passwd",
    ] {
        let resp = respond(&get(target), &root(&dir), now());
        assert_eq!(resp.status, 403, "{target:?}");
        assert_ne!(body_bytes(resp), b"inside the root\n");
    }
    // `//etc/passwd` is not an absolute path: it stays inside the root.
    let resp = respond(&get("//etc/passwd"), &root(&dir), now());
    assert_eq!(resp.status, 200);
    assert_eq!(body_bytes(resp), b"inside the root\n");
    let resp = respond(&get("/etc//passwd"), &root(&dir), now());
    assert_eq!(body_bytes(resp), b"inside the root\n");
}

#[test]
fn symlinks_outside_are_refused_by_default() {
    let dir = site();
    let outside = TempDir::new("outside");
    outside.write("secret.txt", b"top secret");
    symlink(outside.path(), dir.path().join("out")).unwrap();
    symlink(
        outside.path().join("secret.txt"),
        dir.path().join("secret.txt"),
    )
    .unwrap();
    symlink("/etc", dir.path().join("etclink")).unwrap();
    dir.mkdir("linkdir");
    symlink(
        outside.path().join("secret.txt"),
        dir.path().join("linkdir/index.html"),
    )
    .unwrap();

    let strict = DocRoot::new(dir.path(), false).unwrap();
    assert!(!strict.allows_symlinks_outside());
    for target in [
        "/out/secret.txt",
        "/secret.txt",
        "/linkdir/",
        "/etclink/passwd",
        "/etclink/hostname",
    ] {
        let resp = respond(&get(target), &strict, now());
        assert_eq!(resp.status, 403, "{target}");
        assert!(matches!(resp.body, Body::Bytes(_)));
    }

    let lax = DocRoot::new(dir.path(), true).unwrap();
    let resp = respond(&get("/out/secret.txt"), &lax, now());
    assert_eq!(resp.status, 200);
    assert_eq!(body_bytes(resp), b"top secret");
    let resp = respond(&get("/secret.txt"), &lax, now());
    assert_eq!(body_bytes(resp), b"top secret");
    let resp = respond(&get("/linkdir/"), &lax, now());
    assert_eq!(body_bytes(resp), b"top secret");
    if let Ok(passwd) = fs::read("/etc/passwd") {
        let resp = respond(&get("/etclink/passwd"), &lax, now());
        assert_eq!(resp.status, 200);
        assert_eq!(body_bytes(resp), passwd);
    }
    // `..` still cannot climb out, symlinks allowed or not.
    assert_eq!(respond(&get("/../etc/passwd"), &lax, now()).status, 403);
    // `..` is resolved in the URL, not through the symlink.
    let resp = respond(&get("/out/../hello.txt"), &lax, now());
    assert_eq!(body_bytes(resp), b"hello, world\n");
}

#[test]
fn symlinks_inside_are_followed() {
    let dir = site();
    symlink(dir.path().join("hello.txt"), dir.path().join("alias.txt")).unwrap();
    symlink("sub", dir.path().join("subalias")).unwrap();
    symlink("../hello.txt", dir.path().join("sub/up.txt")).unwrap();
    let root = root(&dir);
    let resp = respond(&get("/alias.txt"), &root, now());
    assert_eq!(resp.status, 200);
    assert_eq!(body_bytes(resp), b"hello, world\n");
    let resp = respond(&get("/subalias/data.json"), &root, now());
    assert_eq!(body_bytes(resp), b"{}");
    let resp = respond(&get("/sub/up.txt"), &root, now());
    assert_eq!(body_bytes(resp), b"hello, world\n");
    // A symlink loop is refused, not followed forever.
    symlink("loop", dir.path().join("loop")).unwrap();
    assert_eq!(respond(&get("/loop"), &root, now()).status, 403);
    // A dangling symlink is simply missing.
    symlink("nowhere", dir.path().join("dangling")).unwrap();
    assert_eq!(respond(&get("/dangling"), &root, now()).status, 404);
}

#[test]
fn special_files_are_403_without_blocking() {
    let dir = site();
    let sock = dir.path().join("sock");
    let _listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    assert_eq!(status(&dir, "/sock"), 403);
    if Path::new("/dev/null").exists() {
        symlink("/dev/null", dir.path().join("null")).unwrap();
        let lax = DocRoot::new(dir.path(), true).unwrap();
        assert_eq!(respond(&get("/null"), &lax, now()).status, 403);
    }
    let fifo = dir.path().join("fifo");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .is_ok_and(|s| s.success());
    if made {
        // Opening a fifo for reading would block without a writer.
        assert_eq!(status(&dir, "/fifo"), 403);
    }
}

#[test]
fn unreadable_files_are_403() {
    let dir = site();
    let path = dir.write("private.txt", b"private");
    fs::set_permissions(&path, fs::Permissions::from_mode(0o000)).unwrap();
    // Root reads anything; only then is there nothing to check.
    if fs::File::open(&path).is_err() {
        assert_eq!(status(&dir, "/private.txt"), 403);
    }
    fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).unwrap();
}

fn ranged(dir: &TempDir, target: &str, range: &str) -> tlsplane_http::Response {
    let mut r = get(target);
    r.range = Some(range.to_owned());
    respond(&r, &root(dir), now())
}

#[test]
fn single_ranges_are_206() {
    let dir = site();
    for (range, content_range, bytes) in [
        ("bytes=2-5", "bytes 2-5/10", &b"2345"[..]),
        ("bytes=7-", "bytes 7-9/10", b"789"),
        ("bytes=-3", "bytes 7-9/10", b"789"),
        ("bytes=-100", "bytes 0-9/10", b"0123456789"),
        ("bytes=8-100", "bytes 8-9/10", b"89"),
        ("bytes=0-0", "bytes 0-0/10", b"0"),
        ("bytes=9-9", "bytes 9-9/10", b"9"),
    ] {
        let resp = ranged(&dir, "/digits.bin", range);
        assert_eq!(resp.status, 206, "{range}");
        let h = head(&resp);
        assert_eq!(h.status_line, "HTTP/1.1 206 Partial Content");
        assert_eq!(h.get("Content-Range"), Some(content_range), "{range}");
        assert_eq!(
            h.get("Content-Length"),
            Some(bytes.len().to_string().as_str())
        );
        assert!(h.get("ETag").is_some());
        assert_eq!(body_bytes(resp), bytes, "{range}");
    }
}

#[test]
fn unsatisfiable_ranges_are_416() {
    let dir = site();
    for range in ["bytes=-0", "bytes=10-", "bytes=10-20", "bytes=1000-"] {
        let resp = ranged(&dir, "/digits.bin", range);
        assert_eq!(resp.status, 416, "{range}");
        let h = head(&resp);
        assert_eq!(h.get("Content-Range"), Some("bytes */10"));
        assert_eq!(h.get("Content-Length"), Some("26"));
        assert_eq!(body_bytes(resp), b"416 Range Not Satisfiable\n");
    }
}

#[test]
fn unusable_ranges_are_ignored() {
    let dir = site();
    for range in [
        "bytes=5-2",
        "bytes=0-1,4-5",
        "bytes=0-1, 4-5",
        "bytes=x-y",
        "bytes=-",
        "lines=0-1",
        "garbage",
    ] {
        let resp = ranged(&dir, "/digits.bin", range);
        assert_eq!(resp.status, 200, "{range}");
        assert_eq!(head(&resp).get("Content-Range"), None);
        assert_eq!(body_bytes(resp), b"0123456789");
    }
    // HEAD ignores Range (RFC 9110 §14.2 defines it for GET only).
    let mut r = req(Method::Head, "/digits.bin");
    r.range = Some("bytes=0-1".into());
    let resp = respond(&r, &root(&dir), now());
    assert_eq!(resp.status, 200);
    assert_eq!(head(&resp).get("Content-Length"), Some("10"));
    // An empty file has nothing to range over: 200 with an empty body.
    for range in ["bytes=0-", "bytes=-1", "bytes=0-0"] {
        let resp = ranged(&dir, "/empty.txt", range);
        assert_eq!(resp.status, 200, "{range}");
        assert_eq!(head(&resp).get("Content-Length"), Some("0"));
        assert!(matches!(resp.body, Body::Empty));
    }
}

fn etag_of(dir: &TempDir, target: &str) -> String {
    let resp = respond(&get(target), &root(dir), now());
    head(&resp).get("ETag").unwrap().to_owned()
}

fn mtime_of(dir: &TempDir, rel: &str) -> SystemTime {
    fs::metadata(dir.path().join(rel))
        .unwrap()
        .modified()
        .unwrap()
}

#[test]
fn if_range_gates_the_range() {
    let dir = site();
    let etag = etag_of(&dir, "/digits.bin");
    let last_modified = http_date(mtime_of(&dir, "digits.bin"));
    let with = |if_range: &str| {
        let mut r = get("/digits.bin");
        r.range = Some("bytes=0-1".into());
        r.if_range = Some(if_range.to_owned());
        respond(&r, &root(&dir), now()).status
    };
    assert_eq!(with(&etag), 206);
    assert_eq!(with(&last_modified), 206);
    assert_eq!(with(&format!("W/{etag}")), 200);
    assert_eq!(with("\"something-else\""), 200);
    assert_eq!(with("Thu, 01 Jan 1970 00:00:00 GMT"), 200);
    assert_eq!(with("not a validator"), 200);
}

#[test]
fn if_none_match_gives_304() {
    let dir = site();
    let etag = etag_of(&dir, "/hello.txt");
    let last_modified = http_date(mtime_of(&dir, "hello.txt"));
    for inm in [
        etag.clone(),
        format!("W/{etag}"),
        format!("\"other\", {etag}"),
        "*".to_owned(),
    ] {
        let mut r = get("/hello.txt");
        r.if_none_match = Some(inm.clone());
        let resp = respond(&r, &root(&dir), now());
        assert_eq!(resp.status, 304, "{inm}");
        let h = head(&resp);
        assert_eq!(h.status_line, "HTTP/1.1 304 Not Modified");
        assert_eq!(h.get("ETag"), Some(etag.as_str()));
        assert_eq!(h.get("Last-Modified"), Some(last_modified.as_str()));
        assert!(h.get("Date").is_some());
        assert_eq!(h.get("Content-Length"), None);
        assert!(matches!(resp.body, Body::Empty));
    }
    // HEAD too.
    let mut r = req(Method::Head, "/hello.txt");
    r.if_none_match = Some(etag.clone());
    assert_eq!(respond(&r, &root(&dir), now()).status, 304);
    // A 304 also wins over Range.
    let mut r = get("/hello.txt");
    r.if_none_match = Some(etag);
    r.range = Some("bytes=0-1".into());
    assert_eq!(respond(&r, &root(&dir), now()).status, 304);

    let mut r = get("/hello.txt");
    r.if_none_match = Some("\"other\"".into());
    assert_eq!(respond(&r, &root(&dir), now()).status, 200);
}

#[test]
fn if_modified_since_gives_304() {
    let dir = site();
    let mtime = mtime_of(&dir, "hello.txt");
    let with = |ims: String, inm: Option<&str>| {
        let mut r = get("/hello.txt");
        r.if_modified_since = Some(ims);
        r.if_none_match = inm.map(str::to_owned);
        respond(&r, &root(&dir), now()).status
    };
    // Second granularity: the stored nanoseconds do not make it "newer".
    assert_eq!(with(http_date(mtime), None), 304);
    assert_eq!(
        with(http_date(mtime + Duration::from_secs(3600)), None),
        304
    );
    assert_eq!(with(http_date(mtime - Duration::from_secs(1)), None), 200);
    assert_eq!(with("Thu, 01 Jan 1970 00:00:00 GMT".into(), None), 200);
    // The obsolete date forms count too.
    assert_eq!(with("Friday, 31-Dec-99 23:59:59 GMT".into(), None), 200);
    assert_eq!(with("not a date".into(), None), 200);
    // If-None-Match, when present, decides alone.
    assert_eq!(with(http_date(mtime), Some("\"other\"")), 200);
}

#[test]
fn content_types_by_extension() {
    for (name, ty) in [
        ("a.html", "text/html; charset=utf-8"),
        ("a.HTM", "text/html; charset=utf-8"),
        ("a.css", "text/css; charset=utf-8"),
        ("a.js", "text/javascript; charset=utf-8"),
        ("a.mjs", "text/javascript; charset=utf-8"),
        ("a.json", "application/json"),
        ("a.txt", "text/plain; charset=utf-8"),
        ("a.xml", "application/xml"),
        ("a.svg", "image/svg+xml"),
        ("a.png", "image/png"),
        ("a.jpg", "image/jpeg"),
        ("a.JPEG", "image/jpeg"),
        ("a.gif", "image/gif"),
        ("a.webp", "image/webp"),
        ("a.ico", "image/x-icon"),
        ("a.wasm", "application/wasm"),
        ("a.pdf", "application/pdf"),
        ("a.zip", "application/zip"),
        ("a.tar.gz", "application/gzip"),
        ("a.tar", "application/x-tar"),
        ("a.mp4", "video/mp4"),
        ("a.webm", "video/webm"),
        ("a.mp3", "audio/mpeg"),
        ("a.woff", "font/woff"),
        ("a.woff2", "font/woff2"),
        ("a.ttf", "font/ttf"),
        ("a.otf", "font/otf"),
        ("a.csv", "text/csv; charset=utf-8"),
        ("a.md", "text/markdown; charset=utf-8"),
        ("Makefile", "application/octet-stream"),
        (".htaccess", "application/octet-stream"),
        ("a.unknown", "application/octet-stream"),
    ] {
        assert_eq!(content_type(Path::new(name)), ty, "{name}");
    }
    let dir = site();
    dir.write("style.CSS", b"body{}");
    dir.write("blob", b"\x00\x01");
    let resp = respond(&get("/style.CSS"), &root(&dir), now());
    assert_eq!(
        head(&resp).get("Content-Type"),
        Some("text/css; charset=utf-8")
    );
    let resp = respond(&get("/blob"), &root(&dir), now());
    assert_eq!(
        head(&resp).get("Content-Type"),
        Some("application/octet-stream")
    );
    assert_eq!(head(&resp).get("X-Content-Type-Options"), Some("nosniff"));
}

#[test]
fn error_responses_are_small_and_framed() {
    for (code, text) in [
        (400, "400 Bad Request\n"),
        (403, "403 Forbidden\n"),
        (404, "404 Not Found\n"),
        (405, "405 Method Not Allowed\n"),
        (413, "413 Content Too Large\n"),
        (414, "414 URI Too Long\n"),
        (416, "416 Range Not Satisfiable\n"),
        (431, "431 Request Header Fields Too Large\n"),
        (500, "500 Internal Server Error\n"),
        (501, "501 Not Implemented\n"),
        (503, "503 Service Unavailable\n"),
        (505, "505 HTTP Version Not Supported\n"),
    ] {
        for keep_alive in [false, true] {
            let resp = error_response(code, keep_alive);
            assert_eq!(resp.status, code);
            assert_eq!(resp.keep_alive, keep_alive);
            let h = head(&resp);
            assert_eq!(
                h.get("Content-Length"),
                Some(text.len().to_string().as_str())
            );
            assert_eq!(h.get("Content-Type"), Some("text/plain; charset=utf-8"));
            assert_eq!(
                h.get("Connection"),
                Some(if keep_alive { "keep-alive" } else { "close" })
            );
            assert_eq!(h.get("Content-Range"), None);
            assert_eq!(h.get("Allow").is_some(), code == 405);
            assert!(h.get("Date").is_some());
            assert_eq!(body_bytes(resp), text.as_bytes());
        }
    }
    let resp = error_response_at(404, true, now());
    assert_eq!(head(&resp).get("Date"), Some(http_date(now()).as_str()));
    // Codes that cannot appear in a status line fall back to 500.
    assert_eq!(error_response(7, false).status, 500);
    assert_eq!(error_response(1000, false).status, 500);
    // Codes that forbid content get none.
    let resp = error_response(304, true);
    assert_eq!(head(&resp).get("Content-Length"), None);
    assert!(matches!(resp.body, Body::Empty));
}

#[test]
fn doc_root_must_be_a_directory() {
    let dir = site();
    assert!(DocRoot::new(&dir.path().join("hello.txt"), false).is_err());
    assert!(DocRoot::new(&dir.path().join("missing"), false).is_err());
    let root = DocRoot::new(&dir.path().join("sub/.."), false).unwrap();
    assert_eq!(root.path(), fs::canonicalize(dir.path()).unwrap());
}

/// The full loop the server runs: parse pipelined bytes, answer each.
#[test]
fn parse_then_respond_pipelined() {
    let dir = site();
    let root = root(&dir);
    let buf = b"GET /hello.txt HTTP/1.1\r\nHost: a\r\n\r\nHEAD /digits.bin HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n";
    let mut at = 0;
    let mut statuses = Vec::new();
    while at < buf.len() {
        let Ok(Parsed::Complete { head_len, request }) =
            parse_request(&buf[at..], &Limits::default())
        else {
            panic!("incomplete");
        };
        at += head_len;
        let resp = respond(&request, &root, now());
        statuses.push((
            resp.status,
            resp.keep_alive,
            head(&resp).get("Content-Length").map(str::to_owned),
        ));
    }
    assert_eq!(
        statuses,
        [
            (200, true, Some("13".into())),
            (200, false, Some("10".into()))
        ]
    );
}

/// Odd targets from the network must never panic and never serve the
/// outside secret.
#[test]
fn arbitrary_targets_never_panic_or_escape() {
    let dir = site();
    let outside = TempDir::new("outside2");
    outside.write("secret", b"SECRET");
    symlink(outside.path(), dir.path().join("out")).unwrap();
    let root = root(&dir);
    let pieces = [
        "/",
        "..",
        ".",
        "%2e",
        "%2E%2e",
        "%",
        "%0",
        "%00",
        "%2f",
        "%5c",
        "\\",
        "?",
        "#",
        "out",
        "secret",
        "etc",
        "passwd",
        "sub",
        "index.html",
        "\u{e9}",
        "%ff",
        "http://",
        "//",
        "*",
    ];
    let mut state = 12345u64;
    for _ in 0..3000 {
        let mut target = String::new();
        for _ in 0..(state % 7) {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            target.push_str(pieces[(state >> 33) as usize % pieces.len()]);
        }
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
        let resp = respond(&get(&target), &root, now());
        // Whatever the outcome, the head must be well-framed.
        head(&resp);
        assert_ne!(body_bytes(resp), b"SECRET", "{target:?}");
    }
}

/// Parsing and planning agree on a method other than GET/HEAD: 405 with `Allow` whatever the
/// request carries, and `Connection: close` when it announces a body, which is never read.
#[test]
fn other_methods_with_a_body_get_405_and_close() {
    let dir = site();
    let root = root(&dir);
    for (buf, keep_alive) in [
        (
            &b"POST /hello.txt HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello"[..],
            false,
        ),
        (
            b"PUT /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
            false,
        ),
        (
            b"POST /hello.txt HTTP/1.2\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello",
            false,
        ),
        (b"POST /x HTTP/1.0\r\nContent-Length: 1\r\n\r\nx", false),
        (b"DELETE /hello.txt HTTP/1.1\r\nHost: a\r\n\r\n", true),
        (
            b"POST /hello.txt HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n",
            true,
        ),
    ] {
        let text = String::from_utf8_lossy(buf);
        let Ok(Parsed::Complete { request, .. }) = parse_request(buf, &Limits::default()) else {
            panic!("not a complete request: {text:?}");
        };
        let resp = respond(&request, &root, now());
        assert_eq!(resp.status, 405, "{text:?}");
        assert_eq!(resp.keep_alive, keep_alive, "{text:?}");
        let h = head(&resp);
        assert_eq!(h.get("Allow"), Some("GET, HEAD"), "{text:?}");
        let connection = if keep_alive { "keep-alive" } else { "close" };
        assert_eq!(h.get("Connection"), Some(connection), "{text:?}");
    }
    // GET and HEAD with a body are refused while parsing; the caller closes after the answer.
    let l = Limits::default();
    for (buf, status) in [
        (
            &b"GET /hello.txt HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello"[..],
            413,
        ),
        (
            b"HEAD /hello.txt HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n",
            501,
        ),
    ] {
        let e = parse_request(buf, &l).expect_err("refused");
        assert_eq!(e.status(), status);
        let h = head(&error_response(e.status(), false));
        assert_eq!(h.get("Connection"), Some("close"));
    }
}
