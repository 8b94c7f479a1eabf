use std::path::Path;

const DEFAULT: &str = "application/octet-stream";

// A short hand-kept table covers what static sites actually ship; a full
// MIME database would be a heavy dependency for little gain.
const TYPES: &[(&str, &str)] = &[
    ("html", "text/html; charset=utf-8"),
    ("htm", "text/html; charset=utf-8"),
    ("css", "text/css; charset=utf-8"),
    ("js", "text/javascript; charset=utf-8"),
    ("mjs", "text/javascript; charset=utf-8"),
    ("json", "application/json"),
    ("map", "application/json"),
    ("txt", "text/plain; charset=utf-8"),
    ("xml", "application/xml"),
    ("svg", "image/svg+xml"),
    ("png", "image/png"),
    ("jpg", "image/jpeg"),
    ("jpeg", "image/jpeg"),
    ("gif", "image/gif"),
    ("webp", "image/webp"),
    ("avif", "image/avif"),
    ("ico", "image/x-icon"),
    ("wasm", "application/wasm"),
    ("pdf", "application/pdf"),
    ("zip", "application/zip"),
    ("gz", "application/gzip"),
    ("tar", "application/x-tar"),
    ("mp4", "video/mp4"),
    ("webm", "video/webm"),
    ("mp3", "audio/mpeg"),
    ("woff", "font/woff"),
    ("woff2", "font/woff2"),
    ("ttf", "font/ttf"),
    ("otf", "font/otf"),
    ("csv", "text/csv; charset=utf-8"),
    ("md", "text/markdown; charset=utf-8"),
];

/// The `Content-Type` for a file, chosen by its extension (case-insensitive);
/// `application/octet-stream` when the extension is unknown or missing.
/// Text types carry `; charset=utf-8`.
pub fn content_type(path: &Path) -> &'static str {
    let Some(ext) = path.extension() else {
        return DEFAULT;
    };
    let ext = ext.as_encoded_bytes();
    TYPES
        .iter()
        .find(|(known, _)| known.as_bytes().eq_ignore_ascii_case(ext))
        .map_or(DEFAULT, |&(_, ty)| ty)
}
