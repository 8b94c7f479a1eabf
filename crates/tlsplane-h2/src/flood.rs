//! Caps on the control frames a client sends, checked on the client's bytes before h2 reads
//! them.
//!
//! h2 answers every SETTINGS and PING frame (an acknowledgement each) and takes every
//! WINDOW_UPDATE and PRIORITY frame, with no bound of its own but that it stops reading while
//! it cannot write an acknowledgement: a client sending 200,000 PINGs had 200,000 answers, and
//! the connection went on until the idle timeout. So the pump follows the client's frames
//! ([`Inbound::admit`]) and counts these four kinds, each against a cap a browser never
//! reaches (the reasons are with the caps, in [`crate::settings`]):
//! - SETTINGS and PING, per second: a bucket each, full at start;
//! - PING, besides, one more per DATA frame we sent (gRPC clients probe the bandwidth with a
//!   PING per round trip of the data they receive);
//! - WINDOW_UPDATE, per DATA frame we sent and per stream opened: a client gives window back
//!   for what it received (Envoy's rule, `max_inbound_window_update_frames_per_data_frame_sent`);
//! - PRIORITY, per stream opened (Envoy's `max_inbound_priority_frames_per_stream`).
//!
//! The frame that passes its cap and everything after it never reach h2; the product ends the
//! connection with GOAWAY(ENHANCE_YOUR_CALM) ([`crate::transport::Floods`]).

use std::time::Instant;

use crate::settings;

/// The client connection preface (RFC 9113 §3.4), before its first frame.
const PREFACE: usize = 24;
const FRAME_HEADER: usize = 9;
const HEADERS: u8 = 0x1;
const PRIORITY: u8 = 0x2;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const RST_STREAM: u8 = 0x3;
const WINDOW_UPDATE: u8 = 0x8;

/// The kind of control frame whose cap a client passed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flood {
    Settings,
    Ping,
    WindowUpdate,
    Priority,
}

impl Flood {
    pub const ALL: [Flood; 4] = [
        Flood::Settings,
        Flood::Ping,
        Flood::WindowUpdate,
        Flood::Priority,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Flood::Settings => "SETTINGS",
            Flood::Ping => "PING",
            Flood::WindowUpdate => "WINDOW_UPDATE",
            Flood::Priority => "PRIORITY",
        }
    }
}

/// Frames a second, in bursts of as many: a token bucket, full at start.
struct Bucket {
    per_second: u64,
    /// In millionths of a frame.
    tokens: u64,
    at: Instant,
}

const UNIT: u64 = 1_000_000;

impl Bucket {
    fn new(per_second: u32, now: Instant) -> Self {
        Bucket {
            per_second: per_second.into(),
            tokens: u64::from(per_second) * UNIT,
            at: now,
        }
    }

    fn full(&self) -> u64 {
        self.per_second * UNIT
    }

    /// Takes one frame's token; false when there is none.
    fn take(&mut self, now: Instant) -> bool {
        let elapsed = now.saturating_duration_since(self.at);
        self.at = now;
        // Microseconds times frames a second: millionths of a frame.
        let refill = (elapsed.as_micros() as u64).saturating_mul(self.per_second);
        self.tokens = self.tokens.saturating_add(refill).min(self.full());
        if self.tokens < UNIT {
            return false;
        }
        self.tokens -= UNIT;
        true
    }

    /// One frame more may come (up to a full bucket).
    fn credit(&mut self) {
        self.tokens = (self.tokens + UNIT).min(self.full());
    }
}

/// The client's frames as the pump hands them to h2, and the control frames among them
/// counted against their caps.
pub(crate) struct Inbound {
    /// Bytes of the preface still to come.
    preface_left: usize,
    header: [u8; FRAME_HEADER],
    header_len: usize,
    payload_left: usize,
    settings: Bucket,
    pings: Bucket,
    window_updates: u64,
    priorities: u64,
    /// Streams the client opened (HEADERS on a stream above every one before).
    streams: u64,
    last_stream: u32,
    /// DATA frames h2 wrote to the client.
    data_frames_sent: u64,
    /// Client's streams it reset (RST_STREAM), not yet told to the outbox.
    pub(crate) resets: Vec<u32>,
    flooded: Option<Flood>,
}

impl Inbound {
    pub(crate) fn new(now: Instant) -> Self {
        Inbound {
            preface_left: PREFACE,
            header: [0; FRAME_HEADER],
            header_len: 0,
            payload_left: 0,
            settings: Bucket::new(settings::MAX_SETTINGS_PER_SECOND, now),
            pings: Bucket::new(settings::MAX_PINGS_PER_SECOND, now),
            window_updates: 0,
            priorities: 0,
            streams: 0,
            last_stream: 0,
            data_frames_sent: 0,
            resets: Vec::new(),
            flooded: None,
        }
    }

    /// The cap the client passed, if it did.
    pub(crate) fn flooded(&self) -> Option<Flood> {
        self.flooded
    }

    /// h2 wrote a DATA frame: the client may give window back for it, and probe with a PING.
    pub(crate) fn data_frame_sent(&mut self) {
        self.data_frames_sent += 1;
        self.pings.credit();
    }

    /// Follows `bytes`, the client's next; returns how many of them h2 may have: all, unless a
    /// frame among them passes its cap, then those before it (what came of that frame's
    /// header earlier went to h2, which never gets the rest). Once a cap is passed, none.
    /// The clock is read only for SETTINGS and PING, once per call.
    pub(crate) fn admit(&mut self, bytes: &[u8], mut clock: impl FnMut() -> Instant) -> usize {
        if self.flooded.is_some() {
            return 0;
        }
        let mut now = None;
        let mut at = 0;
        while at < bytes.len() {
            if self.preface_left > 0 {
                let n = self.preface_left.min(bytes.len() - at);
                self.preface_left -= n;
                at += n;
                continue;
            }
            if self.header_len < FRAME_HEADER {
                let start = at;
                let n = (FRAME_HEADER - self.header_len).min(bytes.len() - at);
                self.header[self.header_len..self.header_len + n]
                    .copy_from_slice(&bytes[at..at + n]);
                self.header_len += n;
                at += n;
                if self.header_len < FRAME_HEADER {
                    continue;
                }
                let now = &mut now;
                if let Err(flood) = self.count(|| *now.get_or_insert_with(&mut clock)) {
                    self.flooded = Some(flood);
                    // The frame's start, or where this read starts when its first header
                    // bytes came before (h2 has them, and never gets the rest).
                    return start;
                }
                self.payload_left =
                    u32::from_be_bytes([0, self.header[0], self.header[1], self.header[2]])
                        as usize;
                if self.payload_left == 0 {
                    self.header_len = 0;
                }
                continue;
            }
            let n = self.payload_left.min(bytes.len() - at);
            self.payload_left -= n;
            at += n;
            if self.payload_left == 0 {
                self.header_len = 0;
            }
        }
        bytes.len()
    }

    /// Counts the frame whose header is complete; the cap it passes, if any.
    fn count(&mut self, now: impl FnOnce() -> Instant) -> Result<(), Flood> {
        let h = &self.header;
        let stream = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
        let (flood, within) = match h[3] {
            HEADERS => {
                if stream > self.last_stream {
                    self.last_stream = stream;
                    self.streams += 1;
                }
                return Ok(());
            }
            RST_STREAM => {
                self.resets.push(stream);
                return Ok(());
            }
            SETTINGS => (Flood::Settings, self.settings.take(now())),
            PING => (Flood::Ping, self.pings.take(now())),
            WINDOW_UPDATE => {
                self.window_updates += 1;
                let per_data = u64::from(settings::MAX_WINDOW_UPDATES_PER_DATA_FRAME);
                let allowed = settings::WINDOW_UPDATES_AT_START
                    + 2 * self.streams
                    + per_data * self.data_frames_sent;
                (Flood::WindowUpdate, self.window_updates <= allowed)
            }
            PRIORITY => {
                self.priorities += 1;
                let per_stream = u64::from(settings::MAX_PRIORITY_PER_STREAM);
                (
                    Flood::Priority,
                    self.priorities <= per_stream * (1 + self.streams),
                )
            }
            _ => return Ok(()),
        };
        if within {
            Ok(())
        } else {
            Err(flood)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn frame(typ: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
        f.extend_from_slice(&[typ, flags]);
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    const PREFACE_BYTES: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

    fn ping() -> Vec<u8> {
        frame(PING, 0, 0, &[7; 8])
    }

    /// Feeds `bytes` cut into pieces of `cut`; returns how many were admitted.
    fn feed(inbound: &mut Inbound, bytes: &[u8], cut: usize, now: Instant) -> usize {
        let mut admitted = 0;
        for piece in bytes.chunks(cut) {
            let n = inbound.admit(piece, || now);
            admitted += n;
            if n < piece.len() {
                break;
            }
        }
        admitted
    }

    /// A PING flood is admitted up to the bucket, then cut at the start of the first PING
    /// past it, however the bytes are cut; nothing after is admitted.
    #[test]
    fn a_ping_flood_is_cut_at_the_first_ping_past_the_cap() {
        let cap = settings::MAX_PINGS_PER_SECOND as usize;
        let mut bytes = PREFACE_BYTES.to_vec();
        bytes.extend(frame(SETTINGS, 0, 0, &[]));
        let before = bytes.len();
        for _ in 0..cap + 50 {
            bytes.extend(ping());
        }
        let frame_start = before + cap * ping().len();
        for cut in [1, 5, 9, 10, 17, 100, 4096, bytes.len()] {
            // Header bytes of the frame past the cap in reads before the one that completes
            // its header went to h2 (which never gets the rest).
            let last_read = (frame_start + FRAME_HEADER - 1) / cut * cut;
            let expected = frame_start.max(last_read);
            let now = Instant::now();
            let mut inbound = Inbound::new(now);
            assert_eq!(feed(&mut inbound, &bytes, cut, now), expected, "cut {cut}");
            assert_eq!(inbound.flooded(), Some(Flood::Ping));
            assert_eq!(inbound.admit(&ping(), || now), 0, "nothing after");
        }
    }

    /// The buckets refill with time: PINGs and SETTINGS at their cap's rate, for seconds,
    /// are all admitted; DATA frames sent let one PING more each through.
    #[test]
    fn control_frames_at_the_caps_rate_pass_and_data_sent_earns_pings() {
        let start = Instant::now();
        let mut inbound = Inbound::new(start);
        assert_eq!(inbound.admit(PREFACE_BYTES, || start), PREFACE_BYTES.len());
        let per_second = settings::MAX_PINGS_PER_SECOND.min(settings::MAX_SETTINGS_PER_SECOND);
        for i in 0..5 * per_second {
            let now = start + Duration::from_secs(1) * i / per_second;
            let both = [ping(), frame(SETTINGS, 0, 0, &[])].concat();
            assert_eq!(inbound.admit(&both, || now), both.len(), "frame {i}");
        }
        assert_eq!(inbound.flooded(), None);
        // A PING per DATA frame sent, however many, at no time passing.
        let now = start + Duration::from_secs(5);
        for _ in 0..10 * settings::MAX_PINGS_PER_SECOND {
            inbound.data_frame_sent();
            assert_eq!(inbound.admit(&ping(), || now), ping().len());
        }
        assert_eq!(inbound.flooded(), None);
    }

    /// WINDOW_UPDATEs: a few at the start, then as many per DATA frame sent as the cap
    /// allows; one more is a flood. PRIORITY: the cap per stream opened.
    #[test]
    fn window_updates_follow_data_sent_and_priority_streams_opened() {
        let now = Instant::now();
        let update = frame(WINDOW_UPDATE, 0, 0, &1u32.to_be_bytes());
        let mut inbound = Inbound::new(now);
        inbound.admit(PREFACE_BYTES, || now);
        for _ in 0..settings::WINDOW_UPDATES_AT_START {
            assert_eq!(inbound.admit(&update, || now), update.len());
        }
        for _ in 0..3 {
            inbound.data_frame_sent();
            for _ in 0..settings::MAX_WINDOW_UPDATES_PER_DATA_FRAME {
                assert_eq!(inbound.admit(&update, || now), update.len());
            }
        }
        assert_eq!(inbound.admit(&update, || now), 0);
        assert_eq!(inbound.flooded(), Some(Flood::WindowUpdate));

        let priority = frame(PRIORITY, 0, 3, &[0, 0, 0, 1, 16]);
        let headers = frame(HEADERS, 0x5, 1, &[0x82]);
        let mut inbound = Inbound::new(now);
        inbound.admit(PREFACE_BYTES, || now);
        assert_eq!(inbound.admit(&headers, || now), headers.len());
        for _ in 0..2 * settings::MAX_PRIORITY_PER_STREAM {
            assert_eq!(inbound.admit(&priority, || now), priority.len());
        }
        // HEADERS on a stream seen before opens none.
        assert_eq!(inbound.admit(&headers, || now), headers.len());
        let mut two = priority.clone();
        two.extend(&priority);
        assert_eq!(inbound.admit(&two, || now), 0);
        assert_eq!(inbound.flooded(), Some(Flood::Priority));
    }

    /// A frame whose header began in an earlier read is cut where this read starts; frames'
    /// payloads (a SETTINGS type byte among them) are not taken for headers.
    #[test]
    fn headers_split_across_reads_and_payloads_are_followed() {
        let now = Instant::now();
        let mut inbound = Inbound::new(now);
        inbound.admit(PREFACE_BYTES, || now);
        // DATA whose payload looks like SETTINGS frames: not counted.
        let fake: Vec<u8> = (0..500).flat_map(|_| frame(SETTINGS, 0, 0, &[])).collect();
        let data = frame(0x0, 0, 1, &fake);
        assert_eq!(inbound.admit(&data, || now), data.len());
        let cap = settings::MAX_SETTINGS_PER_SECOND as usize;
        let settings_frame = frame(SETTINGS, 0, 0, &[]);
        let flood: Vec<u8> = (0..cap).flat_map(|_| settings_frame.clone()).collect();
        assert_eq!(inbound.admit(&flood, || now), flood.len());
        assert_eq!(inbound.flooded(), None);
        // The next one's header cut after 4 bytes: those go; the rest never.
        assert_eq!(inbound.admit(&settings_frame[..4], || now), 4);
        assert_eq!(inbound.admit(&settings_frame[4..], || now), 0);
        assert_eq!(inbound.flooded(), Some(Flood::Settings));
    }
}
