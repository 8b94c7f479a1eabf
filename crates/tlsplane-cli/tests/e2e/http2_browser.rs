//! A real browser over HTTP/2 (issue 22): headless Chromium loads a page with 50 assets
//! (25 images, 13 scripts, 12 style sheets) from `serve --alpn h2,http/1.1`, and Chromium's
//! own network log (`--log-net-log`, JSON) must show the page and every asset fetched over
//! h2 on one (or two) sessions, each answered 200 with the file's exact length in DATA
//! frames; the page's scripts report what ran and loaded in the DOM Chromium prints; the
//! server's access log has a line per request, all `HTTP/2.0`.
//!
//! Chromium (Debian `chromium`) trusts the test's certificate by its public key only
//! (`--ignore-certificate-errors-spki-list`, with its own profile directory: Chromium
//! honours that list only then), not by ignoring every certificate error. Without Chromium
//! the test is skipped with a notice, except under CI (`CI=true`), where it fails; in the
//! kernel-plane guests (no browser there) it is skipped.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::fixtures::{self, CertKind};
use crate::support::{mode, tools, Mode, Server};

/// Chromium, kill included, must be done within this (it takes ~2-5 s here).
const BROWSER_TIMEOUT: Duration = Duration::from_secs(60);
const IMAGES: usize = 25;
const SCRIPTS: usize = 13;
const STYLES: usize = 12;

/// The Chromium binary, or None when the test should be skipped (said on stderr).
fn chromium() -> Option<PathBuf> {
    if mode() == Mode::Kernel {
        eprintln!("SKIPPED: no browser in the kernel-plane guests");
        return None;
    }
    let found = ["chromium", "chromium-browser"]
        .iter()
        .find_map(|n| tools::find_in_path(n));
    if found.is_none() {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "CI=true and Chromium is not installed (Debian package `chromium`; scripts/setup-tests.sh installs it)"
        );
        eprintln!("SKIPPED: Chromium is not installed (Debian package `chromium`)");
    }
    found
}

/// A 1×1 GIF, then `extra` bytes after its trailer (decoders stop at the trailer), so that
/// images of many sizes, some spanning several DATA frames, are all valid.
fn gif(extra: usize) -> Vec<u8> {
    const PIXEL: &[u8] = b"GIF89a\x01\x00\x01\x00\x80\x00\x00\x00\x00\x00\xff\xff\xff\
        !\xf9\x04\x01\x00\x00\x00\x00,\x00\x00\x00\x00\x01\x00\x01\x00\x00\x02\x02D\x01\x00;";
    let mut v = PIXEL.to_vec();
    v.extend((0..extra).map(|i| (i * 7 + 3) as u8));
    v
}

/// Writes the page and its assets to `root`; returns each path with its size, the page first.
fn write_site(root: &Path) -> Vec<(String, u64)> {
    fs::create_dir_all(root).expect("site root");
    let mut files = Vec::new();
    let mut body = String::new();
    let put = |name: String, data: Vec<u8>, files: &mut Vec<(String, u64)>| {
        fs::write(root.join(&name), &data).expect("asset");
        files.push((format!("/{name}"), data.len() as u64));
    };
    for i in 0..IMAGES {
        // Up to ~200 KiB: several 16 KiB DATA frames and TLS records.
        put(format!("img{i}.gif"), gif(i * 8191), &mut files);
        body.push_str(&format!("<img src=\"img{i}.gif\" alt=\"\">"));
    }
    for i in 0..SCRIPTS {
        let js = format!("document.documentElement.setAttribute('data-s{i}', 'ran');\n");
        put(format!("s{i}.js"), js.into_bytes(), &mut files);
        body.push_str(&format!("<script src=\"s{i}.js\"></script>"));
    }
    let mut head = String::new();
    for i in 0..STYLES {
        let css = format!(".c{i} {{ margin-left: {}px; }}\n", i + 1);
        put(format!("c{i}.css"), css.into_bytes(), &mut files);
        head.push_str(&format!("<link rel=\"stylesheet\" href=\"c{i}.css\">"));
    }
    // At the load event: how many images decoded and style sheets parsed.
    let report = "<script>addEventListener('load', () => {\
        const img = [...document.images].filter(i => i.complete && i.naturalWidth === 1).length;\
        const css = [...document.styleSheets].filter(s => s.cssRules.length === 1).length;\
        document.documentElement.setAttribute('data-loaded', `img=${img} css=${css}`);\
        });</script>";
    let page = format!(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>50 assets</title>{head}</head>\
         <body>{body}{report}</body></html>\n"
    );
    fs::write(root.join("index.html"), &page).expect("index.html");
    files.insert(0, ("/".to_string(), page.len() as u64));
    files
}

/// `--ignore-certificate-errors-spki-list`'s value for this key: base64 of the SHA-256 of its
/// SubjectPublicKeyInfo.
fn spki_pin(key_pem: &Path) -> String {
    let pem = fs::read_to_string(key_pem).expect("key file");
    let key = rcgen::KeyPair::from_pem(&pem).expect("key PEM");
    base64(&fixtures::sha256(&key.public_key_der()))
}

fn base64(data: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in data.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | (u32::from(*b) << (16 - 8 * i)));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(A[(n >> (18 - 6 * i)) as usize & 63] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Runs Chromium in its own process group, killed (the whole group) at `BROWSER_TIMEOUT` and
/// after it exits (helpers such as crashpad may outlive it). Returns (success, stdout, stderr).
fn run_browser(mut cmd: Command, dir: &Path) -> (bool, String, String) {
    let (out_path, err_path) = (dir.join("stdout"), dir.join("stderr"));
    cmd.stdin(Stdio::null())
        .stdout(fs::File::create(&out_path).expect("stdout file"))
        .stderr(fs::File::create(&err_path).expect("stderr file"))
        .process_group(0);
    let mut child = cmd.spawn().expect("starting chromium");
    let group = format!("-{}", child.id());
    let kill_group = || {
        let _ = Command::new("kill")
            .args(["-KILL", "--", &group])
            .stderr(Stdio::null())
            .status();
    };
    let deadline = Instant::now() + BROWSER_TIMEOUT;
    let status = loop {
        if let Some(s) = child.try_wait().expect("try_wait") {
            break Some(s);
        }
        if Instant::now() > deadline {
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    kill_group();
    if status.is_none() {
        let _ = child.wait();
    }
    let stdout = fs::read_to_string(&out_path).unwrap_or_default();
    let stderr = fs::read_to_string(&err_path).unwrap_or_default();
    assert!(
        status.is_some(),
        "chromium did not finish within {BROWSER_TIMEOUT:?} (killed); stderr:\n{stderr}"
    );
    (status.is_some_and(|s| s.success()), stdout, stderr)
}

/// The net log's events with their type names (Chromium exited, so the log is whole JSON:
/// `{"constants": {...}, "events": [...]}`).
fn net_log_events(path: &Path) -> Vec<(String, serde_json::Value)> {
    let text = fs::read_to_string(path).expect("chromium's net log");
    let log: serde_json::Value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()));
    let constants = &log["constants"];
    let events = log["events"].as_array().cloned().unwrap_or_default();
    let names: BTreeMap<u64, String> = constants["logEventTypes"]
        .as_object()
        .expect("logEventTypes in the net log")
        .iter()
        .filter_map(|(k, v)| Some((v.as_u64()?, k.clone())))
        .collect();
    events
        .into_iter()
        .filter_map(|e| Some((names.get(&e["type"].as_u64()?)?.clone(), e)))
        .collect()
}

/// A header list as the net log writes it (`["name: value", ...]`) → the value of `name`.
fn logged_header(headers: &serde_json::Value, name: &str) -> Option<String> {
    let prefix = format!("{name}: ");
    headers
        .as_array()?
        .iter()
        .filter_map(|h| h.as_str())
        .find_map(|h| h.strip_prefix(&prefix).map(str::to_owned))
}

#[derive(Default, Debug)]
struct Stream {
    path: String,
    status: Option<String>,
    data: u64,
    fin: bool,
}

#[test]
fn chromium_loads_a_page_of_50_assets_over_one_h2_connection() {
    let Some(browser) = chromium() else { return };
    let dir = crate::sites::scratch("http2_browser");
    let files = write_site(&dir.join("www"));
    assert_eq!(files.len(), 1 + IMAGES + SCRIPTS + STYLES);
    let leaf = fixtures::pki().leaf(CertKind::P256);
    let log = dir.join("access.log");
    let config = dir.join("tlsplane.toml");
    fs::write(
        &config,
        format!(
            "[server]\naccess-log-file = {:?}\nalpn = \"h2,http/1.1\"\n\n\
             [[site]]\ndefault = true\nroot = {:?}\n[[site.cert]]\nchain = {:?}\nkey = {:?}\n",
            log,
            dir.join("www"),
            leaf.cert_pem,
            leaf.key_pem
        ),
    )
    .expect("config");
    let server = Server::builder().config_file(&config).start();
    let port = server.port();
    let origin = format!("https://localhost:{port}");

    let net_log = dir.join("netlog.json");
    let mut cmd = Command::new(&browser);
    cmd.args([
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-extensions",
        // localhost to the server's address; every other name fails at once, so the browser's
        // own background requests (if any) stay off the network.
        "--host-resolver-rules=MAP localhost 127.0.0.1, MAP * ~NOTFOUND",
        "--net-log-capture-mode=Default",
        "--dump-dom",
    ])
    .arg(format!("--user-data-dir={}", dir.join("profile").display()))
    .arg(format!(
        "--ignore-certificate-errors-spki-list={}",
        spki_pin(&leaf.key_pem)
    ))
    .arg(format!("--log-net-log={}", net_log.display()))
    .arg(format!("{origin}/"));
    let started = Instant::now();
    let (ok, dom, stderr) = run_browser(cmd, &dir);
    eprintln!("chromium took {:?}", started.elapsed());
    assert!(ok, "chromium failed; stderr:\n{stderr}");

    // What the page saw: every script ran, every image decoded, every style sheet parsed.
    for i in 0..SCRIPTS {
        assert!(
            dom.contains(&format!("data-s{i}=\"ran\"")),
            "script s{i}.js did not run; DOM:\n{dom}\nstderr:\n{stderr}"
        );
    }
    let loaded = format!("data-loaded=\"img={IMAGES} css={STYLES}\"");
    assert!(
        dom.contains(&loaded),
        "not {loaded}; DOM:\n{dom}\nstderr:\n{stderr}"
    );

    // Chromium's own log: the h2 sessions to the server, and each stream on them.
    let events = net_log_events(&net_log);
    let host = format!("localhost:{port}");
    let sessions: BTreeSet<u64> = events
        .iter()
        .filter(|(name, e)| name == "HTTP2_SESSION" && e["params"]["host"] == host.as_str())
        .filter_map(|(_, e)| e["source"]["id"].as_u64())
        .collect();
    assert!(
        (1..=2).contains(&sessions.len()),
        "HTTP/2 sessions to {host}: {sessions:?} (want one, at most two)"
    );
    let mut streams: BTreeMap<(u64, u64), Stream> = BTreeMap::new();
    let mut initialized = 0;
    for (name, e) in &events {
        let Some(session) = e["source"]["id"].as_u64() else {
            continue;
        };
        if !sessions.contains(&session) {
            continue;
        }
        let p = &e["params"];
        let key = (session, p["stream_id"].as_u64().unwrap_or(0));
        match name.as_str() {
            "HTTP2_SESSION_INITIALIZED" => {
                assert_eq!(p["protocol"], "h2", "{e}");
                initialized += 1;
            }
            "HTTP2_SESSION_SEND_HEADERS" => {
                let s = streams.entry(key).or_default();
                s.path = logged_header(&p["headers"], ":path").expect(":path");
                assert_eq!(
                    logged_header(&p["headers"], ":authority").as_deref(),
                    Some(host.as_str())
                );
            }
            "HTTP2_SESSION_RECV_HEADERS" => {
                streams.entry(key).or_default().status = logged_header(&p["headers"], ":status");
            }
            "HTTP2_SESSION_RECV_DATA" => {
                let s = streams.entry(key).or_default();
                s.data += p["size"].as_u64().unwrap_or(0);
                s.fin |= p["fin"].as_bool().unwrap_or(false);
            }
            _ => {}
        }
    }
    assert_eq!(
        initialized,
        sessions.len(),
        "sessions not initialised as h2"
    );
    for (path, size) in &files {
        let on_h2: Vec<&Stream> = streams.values().filter(|s| &s.path == path).collect();
        assert_eq!(on_h2.len(), 1, "{path} on h2 streams: {on_h2:?}");
        let s = on_h2[0];
        assert_eq!(s.status.as_deref(), Some("200"), "{path}: {s:?}");
        assert!(s.data == *size && s.fin, "{path}: {size} bytes, got {s:?}");
    }
    // And the browser's requests for the origin: every one of them went out on those sessions
    // (as HTTP/2 request headers, never as HTTP/1.1).
    let urls: BTreeSet<String> = events
        .iter()
        .filter(|(name, _)| name == "URL_REQUEST_START_JOB")
        .filter_map(|(_, e)| e["params"]["url"].as_str())
        .filter(|u| u.starts_with(&origin))
        .map(str::to_owned)
        .collect();
    for (path, _) in &files {
        assert!(
            urls.contains(&format!("{origin}{path}")),
            "{path} not in {urls:?}"
        );
    }
    assert!(
        !events
            .iter()
            .any(|(name, _)| name == "HTTP_TRANSACTION_SEND_REQUEST_HEADERS"),
        "a request went out as HTTP/1.x"
    );

    // The server's side: one access-log line per request, each HTTP/2.0 (a favicon request,
    // if Chromium makes one, is answered 404 and logged too).
    let deadline = Instant::now() + Duration::from_secs(5);
    let lines = loop {
        let text = fs::read_to_string(&log).unwrap_or_default();
        let lines: Vec<String> = text.lines().map(str::to_owned).collect();
        let served = lines.iter().filter(|l| l.contains("status=200")).count();
        if served >= files.len() || Instant::now() > deadline {
            break lines;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    for (path, _) in &files {
        let target = format!("target={path} ");
        let hits: Vec<&String> = lines.iter().filter(|l| l.contains(&target)).collect();
        assert_eq!(hits.len(), 1, "{path} in the access log: {lines:#?}");
        assert!(
            hits[0].contains("protocol=HTTP/2.0") && hits[0].contains("status=200"),
            "{}",
            hits[0]
        );
    }
    assert!(
        lines.iter().all(|l| l.contains("protocol=HTTP/2.0")),
        "{lines:#?}"
    );
    let extra: Vec<&String> = lines
        .iter()
        .filter(|l| {
            !files
                .iter()
                .any(|(p, _)| l.contains(&format!("target={p} ")))
        })
        .collect();
    assert!(
        extra.iter().all(|l| l.contains("target=/favicon.ico ")),
        "unexpected requests: {extra:#?}"
    );

    let stderr_lines = server.stderr_lines();
    let stats = server.stop();
    assert!(
        !stderr_lines.iter().any(|l| l.contains("panicked")),
        "{}",
        stderr_lines.join("\n")
    );
    assert_eq!(stats.get("http_responses_2xx"), files.len() as u64);
}
