//! A client's bytes, from the fuzzer, to an HTTP/2 server set up as `serve` sets one up: h2's
//! server with `serve`'s settings (tlsplane_h2::settings::server), on tlsplane's transport (the
//! outbox and the pump, file bodies carried by the outbox), each request answered by `serve`'s
//! h2 answers (tlsplane_h2::serve: request body drained, request converted, 413 for a body on
//! GET/HEAD, else planned by tlsplane-http over a document root, response sent with its file
//! body). Left out: what is the product's alone (sites, counters, access log, idle timeouts).
//! A panic anywhere is a crash; libFuzzer's -timeout and -rss_limit_mb bound time and memory.
//!
//! Time is tokio's paused clock: once nothing is left to do, it jumps to the next timer, so
//! the stall timeouts of a client that grants no window pass at once.
//!
//! With bit 6 of byte 0, the connection opens as the products open it: the client's bytes go
//! to tlsplane_h2's greeting until it wakes h2, which then starts from what the greeting read
//! and sent (the transport checks that h2's first bytes are the ones the greeting sent).
//!
//! Input: byte 0: bit 0 the kernel plane (file ranges to the client's `write_file`), bit 1
//! prepends the client preface, bit 2 an empty SETTINGS frame after it, bits 3-5 the largest
//! read, bit 6 the greeting; byte 1 seeds the read sizes; the rest is what the client sends. After it the client
//! stays quiet for a minute (taking what the server sends), then ends its side.
#![no_main]

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::OnceLock;
use std::time::{Duration, SystemTime};

use futures_util::stream::{FuturesUnordered, StreamExt};
use h2::server::SendResponse;
use h2::RecvStream;
use libfuzzer_sys::fuzz_target;
use tlsplane_h2::serve::{drain, refused, request, send_response, FILE_SEND_BUFFER};
use tlsplane_h2::greeting::{Greeting, Heard};
use tlsplane_h2::settings;
use tlsplane_h2::transport::{self, FileBodies, H2Body, Transport, Woken};
use tlsplane_http::{respond, DocRoot};

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const EMPTY_SETTINGS: &[u8] = &[0, 0, 0, 4, 0, 0, 0, 0, 0];

struct Fixture {
    rt: tokio::runtime::Runtime,
    root: DocRoot,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        // The same files each run: one directory serves every run (and libFuzzer's -jobs).
        let dir = std::env::temp_dir().join("tlsplane-fuzz-h2-root");
        std::fs::create_dir_all(dir.join("dir")).expect("document root");
        std::fs::write(dir.join("index.html"), b"<p>hello</p>\n").expect("index.html");
        let big: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(dir.join("big.bin"), big).expect("big.bin");
        std::fs::write(dir.join("empty.txt"), b"").expect("empty.txt");
        std::fs::write(dir.join("dir/a.txt"), b"a\n").expect("dir/a.txt");
        let root = DocRoot::new(&dir, false).expect("DocRoot");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .expect("runtime");
        Fixture { rt, root }
    })
}

/// The client: sends the input in reads of varying sizes, takes what the server sends.
struct Client {
    kernel: bool,
    input: Vec<u8>,
    at: usize,
    max_read: usize,
    x: u32,
    scratch: Vec<u8>,
}

impl Transport for Client {
    fn sends_files(&self) -> bool {
        self.kernel
    }
    async fn readable(&mut self) -> io::Result<()> {
        Ok(())
    }
    async fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.at == self.input.len() {
            tokio::time::sleep(Duration::from_secs(60)).await;
            return Ok(0);
        }
        self.x ^= self.x << 13;
        self.x ^= self.x >> 17;
        self.x ^= self.x << 5;
        let n = (1 + self.x as usize % self.max_read)
            .min(buf.len())
            .min(self.input.len() - self.at);
        buf[..n].copy_from_slice(&self.input[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
    async fn write_all(&mut self, _: &[u8]) -> io::Result<()> {
        Ok(())
    }
    async fn write_file(&mut self, _: &[u8], file: &File, offset: u64, len: u64) -> io::Result<()> {
        assert!(self.kernel, "a file range sent on the user plane");
        self.scratch.resize(len as usize, 0);
        file.read_exact_at(&mut self.scratch, offset)
    }
}

/// One stream, answered as `serve` answers it (crates/tlsplane-cli/src/serve/http2.rs).
async fn answer(
    mut req: http::Request<RecvStream>,
    mut send: SendResponse<H2Body>,
    files: &FileBodies,
    root: &DocRoot,
    stall: Duration,
) {
    let had_body = !req.body().is_end_stream() && drain(req.body_mut(), stall).await;
    let request = request(&req);
    let resp =
        refused(&request, had_body).unwrap_or_else(|| respond(&request, root, SystemTime::now()));
    let _ = send_response(&mut send, resp, files, stall, None).await;
}

fuzz_target!(|input: &[u8]| {
    if input.len() < 2 {
        return;
    }
    let f = fixture();
    let mut bytes = Vec::with_capacity(input.len() + PREFACE.len() + 9);
    if input[0] & 2 != 0 {
        bytes.extend_from_slice(PREFACE);
        if input[0] & 4 != 0 {
            bytes.extend_from_slice(EMPTY_SETTINGS);
        }
    }
    bytes.extend_from_slice(&input[2..]);
    let mut client = Client {
        kernel: input[0] & 1 == 1,
        input: bytes,
        at: 0,
        max_read: [1, 7, 9, 64, 512, 4096, 16384, 65536][(input[0] >> 3) as usize % 8],
        x: (u32::from(input[1]) * 0x0101_0101) | 1,
        scratch: Vec::new(),
    };
    let greet = input[0] & 64 != 0;
    f.rt.block_on(async {
        let woken = if greet {
            let mut greeting = Greeting::new();
            let mut buf = vec![0u8; 16 * 1024];
            loop {
                let n = client.read(&mut buf).await.expect("in memory");
                if n == 0 {
                    // The connection ended in its opening.
                    return;
                }
                if greeting.hear(&buf[..n]) == Heard::Wake {
                    break greeting.wake();
                }
            }
        } else {
            Woken::fresh()
        };
        let stall = Duration::from_secs(10);
        let served = transport::run(&mut client, woken, stall, |io| async move {
            let files = io.file_bodies();
            let floods = io.floods();
            let mut conn = settings::server(FILE_SEND_BUFFER)
                .handshake::<_, H2Body>(io)
                .await?;
            let mut streams = FuturesUnordered::new();
            let mut flooded = false;
            loop {
                tokio::select! {
                    // As the products do (h2_connection.rs): past a control-frame cap the
                    // client's bytes stop, and the connection ends.
                    _ = floods.flooded(), if !flooded => {
                        flooded = true;
                        conn.abrupt_shutdown(h2::Reason::ENHANCE_YOUR_CALM);
                    }
                    accepted = conn.accept() => match accepted {
                        Some(Ok((req, send))) => {
                            streams.push(answer(req, send, &files, &f.root, stall));
                        }
                        Some(Err(e)) => return Err(e),
                        None => return Ok(()),
                    },
                    Some(()) = streams.next(), if !streams.is_empty() => {}
                }
            }
        });
        // Virtual time: the connection ends soon after the client's input does. How it ends
        // (a protocol error of the client's, the client's end) does not matter here.
        let (h2_side, _pump) = tokio::time::timeout(Duration::from_secs(3600), served)
            .await
            .expect("the connection ends after the client's");
        // Except that h2 must send first exactly what the greeting sent for it.
        if let Err(e) = h2_side {
            let e = e.to_string();
            assert!(!e.contains("differs from the greeting"), "{e}");
        }
    });
});
