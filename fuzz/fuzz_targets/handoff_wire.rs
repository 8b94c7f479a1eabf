//! The hand-off wire format (crates/tlsplane-handoff/src/wire.rs), which tlsplane reads from
//! receivers (programs of other users) and receivers read from the socket they connect to:
//! any bytes decode to a message, a kind to skip, or an error, never a panic; a decoded
//! message encodes to a frame that decodes to the same message; a kernel-plane record is
//! classified whatever its type and bytes.
//!
//! Input: byte 0 is a record type for `classify_record`; the rest is one frame.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tlsplane_handoff::wire::{classify_record, Message};

fuzz_target!(|data: &[u8]| {
    let Some((&record_type, frame)) = data.split_first() else {
        return;
    };
    let _ = classify_record(record_type, frame);
    let Ok(Some(message)) = Message::decode(frame) else {
        return;
    };
    let len = message.encoded_len().expect("a decoded message has a length");
    let mut out = vec![0u8; len];
    let n = message.encode(&mut out).expect("a decoded message encodes");
    assert_eq!(n, len, "encode wrote what encoded_len said");
    let again = Message::decode(&out[..n]).expect("an encoded message decodes");
    assert_eq!(again.as_ref(), Some(&message), "round trip");
});
