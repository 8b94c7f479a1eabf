use std::fmt;

/// Why a request could not be served; [`HttpError::status`] gives the status
/// code to answer with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum HttpError {
    /// The request is malformed (400); the text says what was wrong.
    BadRequest(&'static str),
    /// The request line is longer than [`crate::Limits::max_request_line`] (414).
    RequestLineTooLong,
    /// The head is larger than [`crate::Limits::max_head_bytes`] (431).
    HeadTooLarge,
    /// The head has more than [`crate::Limits::max_headers`] header fields (431).
    TooManyHeaders,
    /// The protocol version is well-formed but of another major version than
    /// HTTP/1 (505). Later HTTP/1 minor versions are served as HTTP/1.1.
    VersionNotSupported,
    /// A `GET` or `HEAD` uses `Transfer-Encoding`, which we do not implement (501).
    TransferEncodingNotSupported,
    /// A `GET` or `HEAD` announces a body with `Content-Length` > 0; we accept
    /// none (413).
    BodyNotAccepted,
    /// The target exists but may not be served (403); the text says why.
    Forbidden(&'static str),
    /// The target does not exist (404).
    NotFound,
    /// An `Expect` other than `100-continue` (417).
    ExpectationFailed,
    /// The filesystem failed in a way that says nothing about the request (500).
    Io(std::io::ErrorKind),
}

impl HttpError {
    /// The HTTP status code to answer with.
    pub fn status(&self) -> u16 {
        match self {
            HttpError::BadRequest(_) => 400,
            HttpError::RequestLineTooLong => 414,
            HttpError::HeadTooLarge | HttpError::TooManyHeaders => 431,
            HttpError::VersionNotSupported => 505,
            HttpError::TransferEncodingNotSupported => 501,
            HttpError::BodyNotAccepted => 413,
            HttpError::Forbidden(_) => 403,
            HttpError::NotFound => 404,
            HttpError::ExpectationFailed => 417,
            HttpError::Io(_) => 500,
        }
    }
}

impl fmt::Display for HttpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HttpError::BadRequest(why) => write!(f, "bad request: {why}"),
            HttpError::RequestLineTooLong => f.write_str("request line too long"),
            HttpError::HeadTooLarge => f.write_str("request head too large"),
            HttpError::TooManyHeaders => f.write_str("too many header fields"),
            HttpError::VersionNotSupported => f.write_str("HTTP version not supported"),
            HttpError::TransferEncodingNotSupported => {
                f.write_str("Transfer-Encoding in a request is not supported")
            }
            HttpError::BodyNotAccepted => f.write_str("request bodies are not accepted"),
            HttpError::Forbidden(why) => write!(f, "forbidden: {why}"),
            HttpError::NotFound => f.write_str("not found"),
            HttpError::ExpectationFailed => f.write_str("unsupported expectation"),
            HttpError::Io(kind) => write!(f, "filesystem error: {kind}"),
        }
    }
}

impl std::error::Error for HttpError {}
