//! Minimal HTTP/1.1 response-head handling (no allocation).

use std::io::Read;

use crate::stats::Failure;

/// Largest response head accepted.
pub(crate) const MAX_HEAD: usize = 16 * 1024;

/// Reads from `r` into `buf` until a whole response head is in: the head, and how many bytes
/// of `buf` were filled (the head, then the start of the body).
pub(crate) fn read_head(r: &mut impl Read, buf: &mut [u8]) -> Result<(Head, usize), Failure> {
    let mut filled = 0;
    loop {
        let limit = buf.len().min(MAX_HEAD);
        if filled == limit {
            return Err(Failure::BadResponse("response head too large"));
        }
        match r.read(&mut buf[filled..limit]) {
            Ok(0) => return Err(Failure::BadResponse("closed before the response head")),
            Ok(n) => filled += n,
            Err(e) => return Err(Failure::from_io(e, false)),
        }
        if let Some(h) = parse_head(&buf[..filled])? {
            return Ok((h, filled));
        }
    }
}

/// The parts of a response head the benchmarks need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Head {
    /// Bytes of the head, including the final CRLFCRLF.
    pub len: usize,
    pub status: u16,
    pub content_length: Option<u64>,
    /// `Connection: close` was sent (or the response is HTTP/1.0 without keep-alive).
    pub close: bool,
}

/// Parses a response head from the start of `buf`: `Ok(None)` if incomplete.
pub(crate) fn parse_head(buf: &[u8]) -> Result<Option<Head>, Failure> {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut resp = httparse::Response::new(&mut headers);
    let len = match resp.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => {
            return Err(Failure::BadResponse("too many headers"))
        }
        Err(_) => return Err(Failure::BadResponse("malformed response head")),
    };
    let status = resp.code.unwrap_or(0);
    let mut close = resp.version == Some(0);
    let mut content_length = None;
    for h in resp.headers.iter() {
        if h.name.eq_ignore_ascii_case("content-length") {
            let v = std::str::from_utf8(h.value)
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
                .ok_or(Failure::BadResponse("bad Content-Length"))?;
            if content_length.is_some_and(|c| c != v) {
                return Err(Failure::BadResponse("conflicting Content-Length"));
            }
            content_length = Some(v);
        } else if h.name.eq_ignore_ascii_case("connection") {
            for tok in h.value.split(|&b| b == b',') {
                let tok = tok.trim_ascii();
                if tok.eq_ignore_ascii_case(b"close") {
                    close = true;
                } else if tok.eq_ignore_ascii_case(b"keep-alive") {
                    close = false;
                }
            }
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            return Err(Failure::BadResponse("Transfer-Encoding is not supported"));
        }
    }
    Ok(Some(Head {
        len,
        status,
        content_length,
        close,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_complete_head() {
        let r = b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\nConnection: keep-alive\r\n\r\nhello";
        let h = parse_head(r).unwrap().unwrap();
        assert_eq!(h.status, 200);
        assert_eq!(h.content_length, Some(12));
        assert!(!h.close);
        assert_eq!(&r[h.len..], b"hello");
    }

    #[test]
    fn partial_and_close() {
        assert_eq!(parse_head(b"HTTP/1.1 200 OK\r\nContent-Le").unwrap(), None);
        let h = parse_head(b"HTTP/1.1 404 Not Found\r\nconnection: Close\r\n\r\n")
            .unwrap()
            .unwrap();
        assert_eq!((h.status, h.content_length, h.close), (404, None, true));
        let h = parse_head(b"HTTP/1.0 200 OK\r\n\r\n").unwrap().unwrap();
        assert!(h.close);
    }

    #[test]
    fn rejects_bad_heads() {
        assert!(parse_head(b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n").is_err());
        assert!(parse_head(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n").is_err());
        assert!(parse_head(b"garbage\r\n\r\n").is_err());
    }
}
