//! The body framing the proxy follows between a client and a backend
//! (crates/tlsplane-http/src/forward.rs, `BodyFraming`): chunk-size lines, extensions and
//! trailers from either party. It must never panic, never claim more bytes than it was given,
//! and decide the same however the stream is cut: fed whole or in pieces, the same bytes
//! belong to the body, and the same error (or none) ends it.
//!
//! Input: byte 0 chooses the framing (0-1 chunked, 2 a length of byte 1, 3 until close);
//! byte 1 also seeds the cut points; the rest is the stream.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tlsplane_http::forward::{BadBody, BodyFraming, Framing};

/// How a stream ends for the framing: bytes of the body, whether it is done, or its error.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Body { used: usize, done: bool },
    Bad { used_before: usize, error: BadBody },
}

fn follow(framing: Framing, stream: &[u8], cuts: &[usize]) -> Outcome {
    let mut body = BodyFraming::new(framing);
    let mut used = 0;
    let mut at = 0;
    let mut ends = cuts.iter().copied().chain(std::iter::once(stream.len()));
    while at < stream.len() {
        let end = ends.next().unwrap_or(stream.len()).clamp(at + 1, stream.len());
        match body.advance(&stream[at..end]) {
            Ok(n) => {
                assert!(n <= end - at, "{n} bytes claimed of {}", end - at);
                used += n;
                if n < end - at {
                    assert!(body.is_done(), "bytes left over before the body ended");
                    return Outcome::Body { used, done: true };
                }
            }
            Err(error) => {
                return Outcome::Bad {
                    used_before: at,
                    error,
                }
            }
        }
        at = end;
        if body.is_done() {
            break;
        }
    }
    Outcome::Body {
        used,
        done: body.is_done(),
    }
}

fuzz_target!(|data: &[u8]| {
    let [mode, seed, stream @ ..] = data else {
        return;
    };
    let framing = match mode % 4 {
        0 | 1 => Framing::Chunked,
        2 => Framing::Length(u64::from(*seed)),
        _ => Framing::UntilClose,
    };
    let whole = follow(framing, stream, &[]);
    // Cut points from the seed: small pieces, as a slow sender's reads come.
    let mut cuts = Vec::new();
    let mut at = 0usize;
    let mut x = u32::from(*seed) | 1;
    while at < stream.len() {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        at += 1 + (x % 7) as usize;
        cuts.push(at);
    }
    let cut = follow(framing, stream, &cuts);
    match (&whole, &cut) {
        // An error is found at the same byte however the stream is cut; only where the
        // piece that held it began differs.
        (Outcome::Bad { error: a, .. }, Outcome::Bad { error: b, .. }) => assert_eq!(a, b),
        _ => assert_eq!(whole, cut, "whole vs cut at {cuts:?}"),
    }
});
