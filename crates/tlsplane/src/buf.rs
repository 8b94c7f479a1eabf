//! Output buffer for TLS bytes: grown (and zero-filled) only when it must get bigger, then
//! reused. `Vec::resize` before every encryption would zero-fill the whole chunk each time,
//! which showed in profiles of bulk transfers (docs/BENCHMARKS.md, "Where the time goes").

pub(crate) struct OutBuf {
    buf: Vec<u8>,
    len: usize,
}

impl OutBuf {
    pub(crate) fn new() -> Self {
        Self {
            buf: Vec::new(),
            len: 0,
        }
    }

    /// Writable space after the filled part, at least `min` bytes long.
    pub(crate) fn spare(&mut self, min: usize) -> &mut [u8] {
        if self.buf.len() < self.len + min {
            self.buf.resize(self.len + min, 0);
        }
        &mut self.buf[self.len..]
    }

    pub(crate) fn commit(&mut self, n: usize) {
        debug_assert!(self.len + n <= self.buf.len());
        self.len += n;
    }

    pub(crate) fn filled(&self) -> &[u8] {
        &self.buf[..self.len]
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub(crate) fn clear(&mut self) {
        self.len = 0;
    }

    /// Frees the buffer if it is empty and has grown beyond `max` bytes.
    pub(crate) fn release_if_larger(&mut self, max: usize) {
        if self.len == 0 && self.buf.len() > max {
            self.buf = Vec::new();
        }
    }

    #[cfg(test)]
    fn allocated(&self) -> usize {
        self.buf.len()
    }
}

/// Plaintext received but not yet handed to the application: filled all at once or appended
/// to, then copied out in whatever pieces the caller's buffers allow. The allocation is kept
/// for the next fill.
#[derive(Default)]
pub(crate) struct Pending {
    buf: Vec<u8>,
    pos: usize,
    end: usize,
}

impl Pending {
    pub(crate) fn from_vec(buf: Vec<u8>) -> Self {
        let end = buf.len();
        Self { buf, pos: 0, end }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.pos >= self.end
    }

    /// Frees the allocation if nothing is pending.
    pub(crate) fn release(&mut self) {
        if self.is_empty() {
            *self = Self::default();
        }
    }

    pub(crate) fn extend(&mut self, data: &[u8]) {
        if self.is_empty() {
            self.pos = 0;
            self.end = 0;
        }
        self.buf.truncate(self.end);
        self.buf.extend_from_slice(data);
        self.end = self.buf.len();
    }

    /// An empty buffer of `len` bytes to read into; `filled(n)` then makes its first `n` bytes
    /// the content (until then the content is empty, so a failed read leaves nothing behind).
    pub(crate) fn space(&mut self, len: usize) -> &mut [u8] {
        if self.buf.len() < len {
            self.buf.resize(len, 0);
        }
        self.pos = 0;
        self.end = 0;
        &mut self.buf[..len]
    }

    pub(crate) fn filled(&mut self, n: usize) {
        debug_assert!(n <= self.buf.len());
        self.pos = 0;
        self.end = n;
    }

    /// Copies out as much as fits into `out`.
    pub(crate) fn take_into(&mut self, out: &mut [u8]) -> usize {
        let n = out.len().min(self.end.saturating_sub(self.pos));
        out[..n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
        self.pos += n;
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pending_hands_out_pieces_in_order() {
        let mut p = Pending::from_vec(b"hello".to_vec());
        let mut out = [0u8; 2];
        assert_eq!(p.take_into(&mut out), 2);
        assert_eq!(&out, b"he");
        p.extend(b" world");
        let mut rest = [0u8; 32];
        let n = p.take_into(&mut rest);
        assert_eq!(&rest[..n], b"llo world");
        assert!(p.is_empty());
        assert_eq!(p.take_into(&mut rest), 0);
        // A read into `space` that fails (never calls `filled`) leaves nothing to deliver.
        p.space(16)[..3].copy_from_slice(b"abc");
        assert!(p.is_empty());
        p.space(16)[..3].copy_from_slice(b"xyz");
        p.filled(3);
        assert_eq!(p.take_into(&mut rest), 3);
        assert_eq!(&rest[..3], b"xyz");
        assert!(p.is_empty());
    }

    #[test]
    fn spare_grows_and_commit_appends() {
        let mut b = OutBuf::new();
        b.spare(4)[..3].copy_from_slice(b"abc");
        b.commit(3);
        b.spare(100)[..2].copy_from_slice(b"de");
        b.commit(2);
        assert_eq!(b.filled(), b"abcde");
        b.clear();
        assert!(b.is_empty());
        assert!(b.spare(10).len() >= 10);
        b.spare(100_000);
        b.release_if_larger(64 * 1024);
        assert_eq!(b.allocated(), 0);
        b.spare(1000)[..1].copy_from_slice(b"x");
        b.commit(1);
        b.release_if_larger(10);
        assert_eq!(b.filled(), b"x", "never frees what is not sent yet");
    }
}
