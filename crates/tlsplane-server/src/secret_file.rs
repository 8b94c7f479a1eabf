//! Files that hold secrets (ticket keys, the key-encryption key, a key daemon's token): read
//! whole into one buffer sized from the start and zeroized when dropped, so that no copy is
//! left behind in a freed buffer, and bounded, so that a wrong path (a log, a device) fails
//! at once instead of filling memory.

use std::io::Read;
use std::path::Path;

use zeroize::Zeroizing;

/// A secret file's bytes, and whether every user of the machine may read it (no `Debug`: it
/// would print the secret).
pub struct SecretFile {
    pub bytes: Zeroizing<Vec<u8>>,
    pub world_readable: bool,
}

impl SecretFile {
    /// The bytes as text, without the whitespace around them.
    pub fn text(&self) -> Result<&str, &'static str> {
        std::str::from_utf8(&self.bytes)
            .map(str::trim)
            .map_err(|_| "not text")
    }
}

/// Reads `path`, at most `max` bytes; a larger file is an error, not a prefix.
pub fn read(path: &Path, max: u64) -> Result<SecretFile, String> {
    let mut file = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let meta = file.metadata().map_err(|e| e.to_string())?;
    let too_large = |n: u64| format!("{n} bytes: too large for this file ({max} at most)");
    if meta.len() > max {
        return Err(too_large(meta.len()));
    }
    // One byte more than the size, so that read_to_end sees the end without growing it.
    let mut bytes = Zeroizing::new(Vec::with_capacity(meta.len() as usize + 1));
    (&mut file)
        .take(max + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| e.to_string())?;
    // The file grew since its size was read (a special file reports 0).
    if bytes.len() as u64 > max {
        return Err(too_large(bytes.len() as u64));
    }
    Ok(SecretFile {
        bytes,
        world_readable: std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o004 != 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_whole_files_within_the_bound_and_refuses_larger_ones() {
        let dir = std::env::temp_dir().join(format!("tlsplane-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("k");
        std::fs::write(&path, b"  abc\n").unwrap();
        let f = read(&path, 6).unwrap();
        assert_eq!(f.text().unwrap(), "abc");
        assert!(read(&path, 5).err().unwrap().contains("too large"));
        // A special file has no size to check first: the bound still holds.
        assert!(read(Path::new("/dev/zero"), 4096)
            .err()
            .unwrap()
            .contains("too large"));
        std::fs::write(&path, [0xff, 0xfe]).unwrap();
        assert_eq!(read(&path, 6).unwrap().text().unwrap_err(), "not text");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
