//! Mapping a request-target onto a file under the document root, without
//! ever handing out a file that lies outside it.

use std::collections::HashSet;
use std::ffi::{CString, OsStr};
use std::fs::{self, File, Metadata};
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::HttpError;

const INDEX: &str = "index.html";
/// The one dot-directory served by default: RFC 8615's well-known URIs (ACME challenges,
/// security.txt).
const WELL_KNOWN: &[u8] = b".well-known";

/// Files a server must never hand out, whatever the path that leads to them: its private keys,
/// ticket keys and the like. Known by identity (device and inode), so that a symlink or a hard
/// link leading to one is refused as the file itself is, at no cost per request (the identity
/// comes with the descriptor's fstat, which serving needs anyway).
#[derive(Debug, Default)]
pub struct Withheld {
    files: HashSet<(u64, u64)>,
}

impl Withheld {
    /// Withholds the file at `path` (through symlinks), or for a directory every file in it;
    /// a path that does not exist is skipped.
    pub fn add(&mut self, path: &Path) {
        let Ok(meta) = fs::metadata(path) else {
            return;
        };
        if meta.is_dir() {
            for entry in fs::read_dir(path).into_iter().flatten().flatten() {
                if let Ok(m) = fs::metadata(entry.path()) {
                    if m.is_file() {
                        self.files.insert((m.dev(), m.ino()));
                    }
                }
            }
        } else {
            self.files.insert((meta.dev(), meta.ino()));
        }
    }

    fn holds(&self, meta: &Metadata) -> bool {
        !self.files.is_empty() && self.files.contains(&(meta.dev(), meta.ino()))
    }
}

/// The directory files are served from.
#[derive(Debug, Clone)]
pub struct DocRoot {
    root: PathBuf,
    allow_symlinks_outside: bool,
    /// Paths with a segment starting with '.' are served (other than `/.well-known/`, which
    /// always is).
    serve_dotfiles: bool,
    /// Never served, wherever they are found (see [`Withheld`]).
    withheld: Arc<Withheld>,
    /// The root directory, open, for `openat2` beneath it (see [`open_fast`]).
    dir: Option<Arc<OwnedFd>>,
}

impl DocRoot {
    /// Canonicalizes `dir`, which must be a directory.
    ///
    /// With `allow_symlinks_outside`, symlinks inside the root may lead
    /// anywhere; `..` in a request still never climbs above the root.
    pub fn new(dir: &Path, allow_symlinks_outside: bool) -> io::Result<DocRoot> {
        let root = fs::canonicalize(dir)?;
        if !fs::metadata(&root)?.is_dir() {
            return Err(io::Error::new(
                io::ErrorKind::NotADirectory,
                "document root is not a directory",
            ));
        }
        let dir = File::open(&root).ok().map(|f| Arc::new(OwnedFd::from(f)));
        Ok(DocRoot {
            root,
            allow_symlinks_outside,
            serve_dotfiles: false,
            withheld: Arc::default(),
            dir,
        })
    }

    /// Serve dot-files and dot-directories (`/.git/config`, `/.env`). Off by default: they
    /// are a tree's metadata and secrets far more often than its content.
    pub fn serve_dotfiles(mut self, yes: bool) -> Self {
        self.serve_dotfiles = yes;
        self
    }

    /// Whether dot-files are served.
    pub fn serves_dotfiles(&self) -> bool {
        self.serve_dotfiles
    }

    /// Never serve these files (answered 404, as if absent).
    pub fn withhold(&mut self, files: Arc<Withheld>) {
        self.withheld = files;
    }

    /// Whether `path` is this root or lies under it (both canonical, or `path` made so from
    /// its parent when it does not exist yet).
    pub fn contains(&self, path: &Path) -> bool {
        let canonical = fs::canonicalize(path).ok().or_else(|| {
            let parent = fs::canonicalize(path.parent()?).ok()?;
            Some(parent.join(path.file_name()?))
        });
        canonical.is_some_and(|p| p.starts_with(&self.root))
    }

    /// The canonical root directory.
    pub fn path(&self) -> &Path {
        &self.root
    }

    /// Whether symlinks may lead outside the root.
    pub fn allows_symlinks_outside(&self) -> bool {
        self.allow_symlinks_outside
    }

    fn check_inside(&self, canonical: &Path) -> Result<(), HttpError> {
        if self.allow_symlinks_outside || canonical.starts_with(&self.root) {
            Ok(())
        } else {
            Err(HttpError::Forbidden("outside the document root"))
        }
    }
}

/// A request-target split into decoded path segments.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Target<'a> {
    /// Decoded segments after dot-segment removal; none is empty, `.`, `..`,
    /// or contains `/`, `\` or NUL.
    pub segments: Vec<Vec<u8>>,
    /// The path ended in `/` (or in a dot segment, which means the same).
    pub trailing_slash: bool,
    /// The query, without `?`, as received.
    pub query: Option<&'a str>,
}

pub(crate) fn parse_target(raw: &str) -> Result<Target<'_>, HttpError> {
    let after_authority = strip_absolute_form(raw);
    let path_end = after_authority
        .find(['?', '#'])
        .unwrap_or(after_authority.len());
    let (path, rest) = after_authority.split_at(path_end);
    let query = rest
        .strip_prefix('?')
        .map(|q| q.split_once('#').map_or(q, |(q, _)| q));

    // Absolute-form with an empty path means the root.
    let path = if path.is_empty() && after_authority.len() != raw.len() {
        "/"
    } else {
        path
    };
    let Some(path) = path.strip_prefix('/') else {
        return Err(HttpError::BadRequest("request-target must start with '/'"));
    };

    let mut segments: Vec<Vec<u8>> = Vec::new();
    let mut trailing_slash = false;
    for raw_segment in path.split('/') {
        let segment = percent_decode(raw_segment)?;
        if segment.iter().any(|&b| b == 0 || b == b'/' || b == b'\\') {
            return Err(HttpError::BadRequest("forbidden byte in path segment"));
        }
        trailing_slash = true;
        match segment.as_slice() {
            b"" | b"." => {}
            b".." => {
                if segments.pop().is_none() {
                    return Err(HttpError::Forbidden("path climbs above the root"));
                }
            }
            _ => {
                trailing_slash = false;
                segments.push(segment);
            }
        }
    }
    Ok(Target {
        segments,
        trailing_slash,
        query,
    })
}

/// For `http://host/p` and `https://host/p` returns `/p`; other targets are
/// returned unchanged.
fn strip_absolute_form(raw: &str) -> &str {
    for scheme in ["http://", "https://"] {
        if let Some(prefix) = raw.get(..scheme.len()) {
            if prefix.eq_ignore_ascii_case(scheme) {
                let after = &raw[scheme.len()..];
                let authority_end = after.find(['/', '?', '#']).unwrap_or(after.len());
                return &after[authority_end..];
            }
        }
    }
    raw
}

fn percent_decode(s: &str) -> Result<Vec<u8>, HttpError> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hi = bytes.get(i + 1).and_then(|&b| hex_value(b));
            let lo = bytes.get(i + 2).and_then(|&b| hex_value(b));
            match (hi, lo) {
                (Some(hi), Some(lo)) => out.push(hi << 4 | lo),
                _ => return Err(HttpError::BadRequest("invalid percent-escape")),
            }
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    Ok(out)
}

fn hex_value(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// What a target resolved to.
pub(crate) enum Resolved {
    /// An opened regular file, its metadata (from the open descriptor) and
    /// the name that decides its content type.
    File {
        file: File,
        meta: Metadata,
        type_name: PathBuf,
    },
    /// A directory asked for without the trailing slash; the value is the
    /// `Location` to redirect to.
    Redirect(Vec<u8>),
}

pub(crate) fn resolve(root: &DocRoot, target: &Target<'_>) -> Result<Resolved, HttpError> {
    if !root.serve_dotfiles && names_dotfile(target) {
        return Err(HttpError::NotFound);
    }
    let found = resolve_path(root, target)?;
    if let Resolved::File { meta, .. } = &found {
        if root.withheld.holds(meta) {
            return Err(HttpError::NotFound);
        }
    }
    Ok(found)
}

/// A segment starting with '.' other than a leading `.well-known` (as nginx's and Caddy's
/// usual `location ~ /\.` rules).
fn names_dotfile(target: &Target<'_>) -> bool {
    target
        .segments
        .iter()
        .enumerate()
        .any(|(i, s)| s.first() == Some(&b'.') && !(i == 0 && s == WELL_KNOWN))
}

fn resolve_path(root: &DocRoot, target: &Target<'_>) -> Result<Resolved, HttpError> {
    if let Some(found) = open_fast(root, target)? {
        return Ok(found);
    }
    let mut path = root.root.clone();
    for segment in &target.segments {
        path.push(OsStr::from_bytes(segment));
    }
    let canonical = fs::canonicalize(&path).map_err(from_io)?;
    root.check_inside(&canonical)?;
    let meta = fs::metadata(&canonical).map_err(from_io)?;

    if meta.is_dir() {
        if !target.trailing_slash {
            return Ok(Resolved::Redirect(location(target)));
        }
        let index = match fs::canonicalize(canonical.join(INDEX)) {
            Ok(p) => p,
            Err(e) if is_missing(&e) => {
                return Err(HttpError::Forbidden("directory listing is disabled"))
            }
            Err(e) => return Err(from_io(e)),
        };
        root.check_inside(&index)?;
        let index_meta = fs::metadata(&index).map_err(from_io)?;
        if !index_meta.is_file() {
            return Err(HttpError::Forbidden("index is not a regular file"));
        }
        let (file, meta) = open_regular(root, &index)?;
        return Ok(Resolved::File {
            file,
            meta,
            type_name: PathBuf::from(INDEX),
        });
    }
    if !meta.is_file() {
        return Err(HttpError::Forbidden("not a regular file"));
    }
    if target.trailing_slash {
        // "/file.txt/" names a directory that does not exist.
        return Err(HttpError::NotFound);
    }
    let (file, meta) = open_regular(root, &canonical)?;
    let type_name = target
        .segments
        .last()
        .map(|s| PathBuf::from(OsStr::from_bytes(s)))
        .unwrap_or_default();
    Ok(Resolved::File {
        file,
        meta,
        type_name,
    })
}

/// The common case, a regular file, in two syscalls (`openat2`, fstat) instead of eight
/// (`canonicalize` costs a `readlink` per path component, then stat, open, fstat and a
/// `/proc/self/fd` check). The kernel itself refuses a path walk that leaves the root
/// (`RESOLVE_BENEATH`), so nothing outside it can be opened even if the tree changes meanwhile.
///
/// Beneath the root, the file is opened before it is looked at, as nginx does: the open is
/// `O_NONBLOCK | O_NOCTTY`, so a fifo cannot hang it, and only someone privileged can put a
/// device node inside the root (symlinks cannot lead out of it). A stat before the open cost a
/// second path walk on every request (docs/BENCHMARKS.md, "System calls per connection"),
/// and never closed the window in which a path is swapped after it.
/// With `allow_symlinks_outside` any symlink may lead to a device, so there the path is still
/// stat'ed first and only a regular file is opened.
///
/// `None` hands the request to the full check in [`resolve`], which decides exactly as before:
/// directories, and whatever `openat2` will not open (an absolute symlink, even one pointing
/// inside the root; a kernel before 5.6).
fn open_fast(root: &DocRoot, target: &Target<'_>) -> Result<Option<Resolved>, HttpError> {
    let (Some(dir), Some(last)) = (&root.dir, target.segments.last()) else {
        return Ok(None);
    };
    if target.trailing_slash {
        return Ok(None);
    }
    // Segments hold no NUL and no '/', so joining them with '/' is the relative path.
    let rel = CString::new(target.segments.join(&b'/')).map_err(|_| HttpError::NotFound)?;
    let resolve = if root.allow_symlinks_outside {
        // Stat before opening, as the full check does, so that no device or fifo a symlink
        // leads to is ever opened.
        match fs::metadata(root.root.join(OsStr::from_bytes(rel.as_bytes()))) {
            Ok(m) if m.is_file() => {}
            Ok(_) => return Ok(None),
            Err(e) if is_missing(&e) => return Err(HttpError::NotFound),
            Err(_) => return Ok(None),
        }
        0
    } else {
        tlsplane_sys::RESOLVE_BENEATH
    };
    // O_NONBLOCK: a fifo (or one swapped in after the stat) must not hang the open.
    let flags = libc::O_RDONLY | libc::O_NONBLOCK | libc::O_NOCTTY;
    let fd = match tlsplane_sys::openat2(dir.as_fd(), &rel, flags, resolve) {
        Ok(fd) => fd,
        Err(e) if is_missing(&e) => return Err(HttpError::NotFound),
        // Refused escapes (EXDEV), absolute symlinks, permissions, old kernels: the full check.
        Err(_) => return Ok(None),
    };
    let file = File::from(fd);
    let meta = file.metadata().map_err(from_io)?;
    if meta.is_dir() {
        // The full check redirects it, or serves its index.
        return Ok(None);
    }
    if !meta.is_file() {
        return Err(HttpError::Forbidden("not a regular file"));
    }
    Ok(Some(Resolved::File {
        file,
        meta,
        type_name: PathBuf::from(OsStr::from_bytes(last)),
    }))
}

/// Opens a path that was already checked to be a regular file, re-checking
/// on the descriptor because the file may have been swapped since.
fn open_regular(root: &DocRoot, canonical: &Path) -> Result<(File, Metadata), HttpError> {
    // O_NONBLOCK: a fifo swapped in after the check must not hang the open.
    // O_NOFOLLOW: the canonical path has no symlink, so one now is a swap.
    let file = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW)
        .open(canonical)
        .map_err(from_io)?;
    let meta = file.metadata().map_err(from_io)?;
    if !meta.is_file() {
        return Err(HttpError::Forbidden("not a regular file"));
    }
    if !root.allow_symlinks_outside {
        // Canonicalize-then-open leaves a window in which a directory on the
        // path could be replaced by a symlink; asking the kernel where the
        // descriptor really points closes it.
        let link = format!("/proc/self/fd/{}", file.as_raw_fd());
        if let Ok(actual) = fs::read_link(link) {
            root.check_inside(&actual)?;
        }
    }
    Ok((file, meta))
}

fn is_missing(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::NotFound | io::ErrorKind::NotADirectory
    )
}

fn from_io(e: io::Error) -> HttpError {
    if is_missing(&e) {
        return HttpError::NotFound;
    }
    match (e.kind(), e.raw_os_error()) {
        (io::ErrorKind::PermissionDenied, _) => HttpError::Forbidden("permission denied"),
        (_, Some(libc::ELOOP)) => HttpError::Forbidden("symlink loop or unexpected symlink"),
        (_, Some(libc::ENAMETOOLONG)) => HttpError::NotFound,
        (kind, _) => HttpError::Io(kind),
    }
}

/// The target with a trailing slash, rebuilt from the normalized segments so
/// that the redirect can never point elsewhere (`//host/` would be taken for
/// another host).
fn location(target: &Target<'_>) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    for segment in &target.segments {
        out.push(b'/');
        for &b in segment {
            if is_pchar_unencoded(b) {
                out.push(b);
            } else {
                push_pct(&mut out, b);
            }
        }
    }
    out.push(b'/');
    if let Some(query) = target.query {
        out.push(b'?');
        for &b in query.as_bytes() {
            // The query is kept as received, but nothing that could break the
            // header line may pass.
            if b.is_ascii_graphic() {
                out.push(b);
            } else {
                push_pct(&mut out, b);
            }
        }
    }
    out
}

fn is_pchar_unencoded(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=:@".contains(&b)
}

fn push_pct(out: &mut Vec<u8>, b: u8) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    out.push(b'%');
    out.push(HEX[usize::from(b >> 4)]);
    out.push(HEX[usize::from(b & 15)]);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn segs(t: &Target<'_>) -> Vec<String> {
        t.segments
            .iter()
            .map(|s| String::from_utf8_lossy(s).into_owned())
            .collect()
    }

    #[test]
    fn normalizes_segments() {
        let t = parse_target("/a/./b//c/../d").unwrap();
        assert_eq!(segs(&t), ["a", "b", "d"]);
        assert!(!t.trailing_slash);
        let t = parse_target("/a/b/..").unwrap();
        assert_eq!(segs(&t), ["a"]);
        assert!(t.trailing_slash);
        let t = parse_target("/").unwrap();
        assert!(t.segments.is_empty() && t.trailing_slash);
    }

    #[test]
    fn splits_query_and_fragment() {
        let t = parse_target("/a%20b?x=1#frag").unwrap();
        assert_eq!(segs(&t), ["a b"]);
        assert_eq!(t.query, Some("x=1"));
        let t = parse_target("/a#frag?not-query").unwrap();
        assert_eq!(t.query, None);
        assert_eq!(segs(&t), ["a"]);
    }

    #[test]
    fn absolute_form_keeps_only_the_path() {
        let t = parse_target("HTTPS://example.com:8443/x/y?q").unwrap();
        assert_eq!(segs(&t), ["x", "y"]);
        assert_eq!(t.query, Some("q"));
        let t = parse_target("http://example.com").unwrap();
        assert!(t.segments.is_empty() && t.trailing_slash);
        let t = parse_target("http://example.com?q").unwrap();
        assert!(t.segments.is_empty() && t.query == Some("q"));
    }

    #[test]
    fn rejects_bad_targets() {
        for (raw, status) in [
            ("*", 400),
            ("x/y", 400),
            ("", 400),
            ("/%", 400),
            ("/%4", 400),
            ("/%zz", 400),
            ("/%00", 400),
            ("/a%2fb", 400),
            ("/a%5cb", 400),
            ("/a\\b", 400),
            ("/..", 403),
            ("/%2e%2E/x", 403),
            ("/.%2e/x", 403),
            ("/a/../../x", 403),
            ("/a/%2e%2e/%2e%2e/x", 403),
        ] {
            assert_eq!(
                parse_target(raw).map(|_| ()).map_err(|e| e.status()),
                Err(status),
                "{raw:?}"
            );
        }
    }

    #[test]
    fn location_is_rebuilt_safely() {
        let t = parse_target("//evil.example/a%20b/?q=1").unwrap();
        assert_eq!(location(&t), b"/evil.example/a%20b/?q=1");
        let t = Target {
            segments: vec![b"x\r\ny".to_vec()],
            trailing_slash: false,
            query: Some("a b\r\n"),
        };
        assert_eq!(location(&t), b"/x%0D%0Ay/?a%20b%0D%0A");
    }
}

#[cfg(test)]
mod open_tests {
    use super::*;

    fn temp(tag: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("tlsplane-http-unit-{tag}-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        fs::canonicalize(dir).unwrap()
    }

    /// Simulates a path swapped after canonicalization: the descriptor check
    /// must catch a file that turns out to live elsewhere.
    #[test]
    fn descriptor_outside_root_is_refused() {
        let (inside, outside) = (temp("in"), temp("out"));
        let secret = outside.join("secret");
        fs::write(&secret, b"x").unwrap();
        let strict = DocRoot::new(&inside, false).unwrap();
        let result = open_regular(&strict, &secret).map(|_| ());
        if Path::new("/proc/self/fd").exists() {
            assert_eq!(
                result,
                Err(HttpError::Forbidden("outside the document root"))
            );
        }
        let lax = DocRoot::new(&inside, true).unwrap();
        assert!(open_regular(&lax, &secret).is_ok());
        // O_NOFOLLOW: a symlink in the last component is a swap, not a file.
        let link = inside.join("link");
        let _ = fs::remove_file(&link);
        std::os::unix::fs::symlink(&secret, &link).unwrap();
        assert_eq!(
            open_regular(&lax, &link).map(|_| ()),
            Err(HttpError::Forbidden("symlink loop or unexpected symlink"))
        );
        let _ = fs::remove_dir_all(inside);
        let _ = fs::remove_dir_all(outside);
    }
}

#[cfg(test)]
mod io_mapping_tests {
    use super::*;

    #[test]
    fn io_errors_map_to_statuses() {
        let status = |e: io::Error| from_io(e).status();
        assert_eq!(status(io::ErrorKind::NotFound.into()), 404);
        assert_eq!(status(io::ErrorKind::NotADirectory.into()), 404);
        // Matters when not running as root, where the integration test can't see it.
        assert_eq!(status(io::ErrorKind::PermissionDenied.into()), 403);
        assert_eq!(status(io::Error::from_raw_os_error(libc::EACCES)), 403);
        assert_eq!(status(io::Error::from_raw_os_error(libc::ELOOP)), 403);
        assert_eq!(
            status(io::Error::from_raw_os_error(libc::ENAMETOOLONG)),
            404
        );
        assert_eq!(status(io::Error::from_raw_os_error(libc::EIO)), 500);
    }
}

#[cfg(test)]
mod withheld_tests {
    use super::*;

    fn status(root: &DocRoot, raw: &str) -> Result<(), u16> {
        parse_target(raw)
            .and_then(|t| resolve(root, &t))
            .map(|_| ())
            .map_err(|e| e.status())
    }

    #[test]
    fn dotfiles_are_not_served_unless_allowed() {
        let dir = std::env::temp_dir().join(format!("tlsplane-http-dot-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        for d in [
            ".git",
            ".well-known/acme-challenge",
            "a/.hidden",
            "a/.well-known",
        ] {
            fs::create_dir_all(dir.join(d)).unwrap();
        }
        for f in [
            ".env",
            ".git/config",
            ".well-known/acme-challenge/token",
            "a/.hidden/x",
            "a/.well-known/y",
            "a/b.txt",
        ] {
            fs::write(dir.join(f), b"x").unwrap();
        }
        let root = DocRoot::new(&dir, false).unwrap();
        for hidden in [
            "/.env",
            "/.git/config",
            "/.git/",
            "/.git",
            "/%2egit/config",
            "/a/.hidden/x",
            "/a/.well-known/y",
            "/x/../.env",
        ] {
            assert_eq!(status(&root, hidden), Err(404), "{hidden}");
        }
        assert_eq!(status(&root, "/.well-known/acme-challenge/token"), Ok(()));
        assert_eq!(status(&root, "/a/b.txt"), Ok(()));
        let open = root.serve_dotfiles(true);
        for shown in ["/.env", "/.git/config", "/a/.hidden/x", "/a/.well-known/y"] {
            assert_eq!(status(&open, shown), Ok(()), "{shown}");
        }
        let _ = fs::remove_dir_all(dir);
    }

    #[test]
    fn withheld_files_are_not_served_by_any_path() {
        let base = std::env::temp_dir().join(format!("tlsplane-http-wh-{}", std::process::id()));
        let _ = fs::remove_dir_all(&base);
        let (www, state) = (base.join("www"), base.join("state"));
        fs::create_dir_all(&www).unwrap();
        fs::create_dir_all(&state).unwrap();
        fs::write(base.join("ticket.keys"), b"k").unwrap();
        fs::write(state.join("key.pem"), b"k").unwrap();
        fs::write(www.join("page.txt"), b"p").unwrap();
        std::os::unix::fs::symlink(base.join("ticket.keys"), www.join("keys-link")).unwrap();
        std::os::unix::fs::symlink(state.join("key.pem"), www.join("abs-link")).unwrap();
        fs::hard_link(base.join("ticket.keys"), www.join("keys-hard")).unwrap();
        let mut withheld = Withheld::default();
        withheld.add(&base.join("ticket.keys"));
        withheld.add(&state);
        withheld.add(&base.join("missing"));
        let withheld = Arc::new(withheld);
        let mut lax = DocRoot::new(&www, true).unwrap();
        assert_eq!(status(&lax, "/keys-link"), Ok(()));
        lax.withhold(withheld.clone());
        for path in ["/keys-link", "/abs-link", "/keys-hard"] {
            assert_eq!(status(&lax, path), Err(404), "{path}");
        }
        assert_eq!(status(&lax, "/page.txt"), Ok(()));
        let mut strict = DocRoot::new(&www, false).unwrap();
        strict.withhold(withheld);
        assert_eq!(status(&strict, "/keys-hard"), Err(404));
        assert_eq!(status(&strict, "/page.txt"), Ok(()));
        assert!(strict.contains(&www.join("page.txt")));
        assert!(strict.contains(&www.join("not-yet")));
        assert!(!strict.contains(&base.join("ticket.keys")));
        let _ = fs::remove_dir_all(base);
    }
}
