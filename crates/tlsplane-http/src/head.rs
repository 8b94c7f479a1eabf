//! One request-head reader for every product (`serve`, the HTTP proxy): when to parse the
//! bytes read so far, and the limits every head is held to, whichever parser reads it.
//!
//! A client may send its head a byte per TLS record. Parsing the whole buffer again after
//! every read would cost O(head) per byte, O(head²) per head (16 KiB: 16,384 parses of up to
//! 16 KiB each). [`HeadReader`] instead looks at each byte once, remembering where it stopped,
//! and calls the parser only a bounded number of times per head:
//!
//! - on the first bytes of a head (what is not HTTP at all, a TLS record say, is refused at
//!   once);
//! - at the end of the request line (a malformed or unsupported request line: 400, 505);
//! - at the end of the head (the empty line);
//! - when the head has more lines than the field limit allows (431), or reaches
//!   [`Limits::max_head_bytes`] (431 unless it is complete).
//!
//! A request line longer than [`Limits::max_request_line`] is refused (414) as soon as it is,
//! by the reader itself.

use crate::{HttpError, Limits};

/// Where the reading of one request head stands. Make one per connection (or per head);
/// after a complete head it is ready for the next.
#[derive(Clone, Debug, Default)]
pub struct HeadReader {
    /// Bytes of the head (from its first byte) looked at so far.
    seen: usize,
    /// Bytes of the line being read, CR not counted.
    line: usize,
    /// Lines ended so far, leading empty lines (skipped by HTTP/1 parsers) not counted: the
    /// request line is the first.
    lines: usize,
}

impl HeadReader {
    /// A reader for a head not begun.
    pub fn new() -> Self {
        Self::default()
    }

    /// Reads the head in `buf` (all of it so far, from its first byte; the caller appends to
    /// it between calls and moves on by the returned length once it is complete). Only the
    /// bytes not seen before are looked at; `parse` (the product's parser, given the whole
    /// head so far) is called when one of the points in the module's documentation is
    /// reached, and returns the head and its length, or `None` for incomplete.
    ///
    /// `Ok(None)`: read more. An error is the status to answer with, then close.
    pub fn read<T>(
        &mut self,
        buf: &[u8],
        limits: &Limits,
        parse: impl FnOnce(&[u8]) -> Result<Option<(T, usize)>, HttpError>,
    ) -> Result<Option<(T, usize)>, HttpError> {
        if buf.len() < self.seen {
            // Not the head this reader began: start over (never happens with a caller that
            // keeps to the contract; costs one look at the bytes if it does).
            *self = Self::default();
        }
        // Nothing past the head limit can be part of an acceptable head.
        let end = buf.len().min(limits.max_head_bytes);
        let mut due = self.seen == 0 && !buf.is_empty();
        let mut at = self.seen;
        while at < end {
            let b = buf[at];
            at += 1;
            match b {
                b'\n' if self.line == 0 && self.lines == 0 => {} // a leading empty line
                b'\n' if self.line == 0 => {
                    // The empty line: the head ends here.
                    due = true;
                    break;
                }
                b'\n' => {
                    self.lines += 1;
                    self.line = 0;
                    // The request line, and the line one past the most fields allowed.
                    if self.lines == 1 || self.lines == limits.max_headers.saturating_add(2) {
                        due = true;
                    }
                }
                b'\r' => {}
                _ => {
                    self.line += 1;
                    if self.lines == 0 && self.line > limits.max_request_line {
                        return Err(HttpError::RequestLineTooLong);
                    }
                }
            }
        }
        self.seen = at;
        let full = buf.len() >= limits.max_head_bytes;
        if !due && !full {
            return Ok(None);
        }
        match parse(buf)? {
            Some((head, len)) => {
                *self = Self::default();
                Ok(Some((head, len)))
            }
            None if full => Err(HttpError::HeadTooLarge),
            None => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// serve's parser, counting its calls.
    fn counting<'a>(
        calls: &'a mut usize,
        limits: &'a Limits,
    ) -> impl FnMut(&[u8]) -> Result<Option<((), usize)>, HttpError> + 'a {
        move |buf: &[u8]| {
            *calls += 1;
            Ok(match crate::parse_request(buf, limits)? {
                crate::Parsed::Complete { head_len, .. } => Some(((), head_len)),
                crate::Parsed::Incomplete => None,
            })
        }
    }

    fn feed_bytewise(
        head: &[u8],
        limits: &Limits,
        calls: &mut usize,
    ) -> Result<Option<usize>, HttpError> {
        let mut r = HeadReader::new();
        let mut parse = counting(calls, limits);
        for n in 1..=head.len() {
            if let Some(((), len)) = r.read(&head[..n], limits, &mut parse)? {
                return Ok(Some(len));
            }
        }
        Ok(None)
    }

    #[test]
    fn a_head_a_byte_at_a_time_is_parsed_a_bounded_number_of_times() {
        let mut head = b"GET / HTTP/1.1\r\nHost: a\r\n".to_vec();
        for i in 0..60 {
            head.extend_from_slice(format!("x-{i}: {}\r\n", "v".repeat(200)).as_bytes());
        }
        head.extend_from_slice(b"\r\n");
        let mut calls = 0;
        let len = feed_bytewise(&head, &Limits::default(), &mut calls).unwrap();
        assert_eq!(len, Some(head.len()));
        assert!(calls <= 3, "{calls} parses");
    }

    #[test]
    fn the_request_line_limit_is_the_readers() {
        let limits = Limits::default();
        let head = format!(
            "GET /{} HTTP/1.1\r\n\r\n",
            "a".repeat(limits.max_request_line)
        );
        let mut calls = 0;
        let err = feed_bytewise(head.as_bytes(), &limits, &mut calls).unwrap_err();
        assert!(matches!(err, HttpError::RequestLineTooLong));
    }

    #[test]
    fn an_unfinished_head_at_the_limit_is_431() {
        let limits = Limits::default();
        let mut head = b"GET / HTTP/1.1\r\n".to_vec();
        while head.len() < limits.max_head_bytes {
            head.extend_from_slice(b"x: y\r\n");
        }
        head.truncate(limits.max_head_bytes);
        let mut calls = 0;
        let limits = Limits {
            max_headers: usize::MAX,
            ..limits
        };
        let err = feed_bytewise(&head, &limits, &mut calls).unwrap_err();
        assert!(matches!(err, HttpError::HeadTooLarge));
        assert!(calls <= 3, "{calls} parses");
    }

    #[test]
    fn a_pipelined_next_head_is_read_from_the_leftover() {
        let two = b"GET /a HTTP/1.1\r\nHost: a\r\n\r\nGET /b HTTP/1.1\r\nHost: a\r\n\r\n";
        let limits = Limits::default();
        let mut calls = 0;
        let mut r = HeadReader::new();
        let mut parse = counting(&mut calls, &limits);
        let ((), first) = r.read(two, &limits, &mut parse).unwrap().unwrap();
        assert_eq!(r.seen, 0, "ready for the next head");
        let ((), second) = r.read(&two[first..], &limits, &mut parse).unwrap().unwrap();
        assert_eq!(first + second, two.len());
    }

    #[test]
    fn leading_empty_lines_do_not_end_a_head() {
        let mut calls = 0;
        let head = b"\r\n\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n";
        let len = feed_bytewise(head, &Limits::default(), &mut calls).unwrap();
        assert_eq!(len, Some(head.len()));
    }
}
