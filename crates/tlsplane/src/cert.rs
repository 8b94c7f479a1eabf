//! Certificates and keys: PEM loading and the generated localhost certificate.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::crypto::aws_lc_rs::sign::any_supported_type;
use rustls::sign::CertifiedKey;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use crate::Error;

/// Loads a certificate chain and its private key (ECDSA P-256/P-384, Ed25519 or RSA; PKCS#8,
/// SEC1 or PKCS#1) from PEM files, and checks that they belong together.
pub fn load_pem(cert_path: &Path, key_path: &Path) -> Result<Arc<CertifiedKey>, Error> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert_path)
        .map_err(|e| Error::Config(format!("{}: {e}", cert_path.display())))?
        .collect::<Result<_, _>>()
        .map_err(|e| Error::Config(format!("{}: {e}", cert_path.display())))?;
    if chain.is_empty() {
        return Err(Error::Config(format!("{}: no CERTIFICATE in PEM file", cert_path.display())));
    }
    let key = PrivateKeyDer::from_pem_file(key_path)
        .map_err(|e| Error::Config(format!("{}: no usable private key: {e}", key_path.display())))?;
    certified_key(chain, key)
}

/// Builds a [`CertifiedKey`] from DER parts, refusing a key that does not match the leaf.
pub fn certified_key(chain: Vec<CertificateDer<'static>>, key: PrivateKeyDer<'static>) -> Result<Arc<CertifiedKey>, Error> {
    let signing_key = any_supported_type(&key).map_err(|e| Error::Config(format!("unsupported private key: {e}")))?;
    let ck = CertifiedKey::new(chain, signing_key);
    ck.keys_match()
        .map_err(|e| Error::Config(format!("certificate and private key do not match: {e}")))?;
    Ok(Arc::new(ck))
}

/// Where the generated localhost certificate lives: `$TLSPLANE_HOME`, else
/// `$XDG_STATE_HOME/tlsplane`, else `$HOME/.local/state/tlsplane`.
pub fn default_state_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("TLSPLANE_HOME") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_STATE_HOME") {
        return PathBuf::from(d).join("tlsplane");
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("/tmp"));
    home.join(".local/state/tlsplane")
}

/// Paths of a generated certificate and key.
#[derive(Debug, Clone)]
pub struct GeneratedPaths {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// False when an existing pair was reused.
    pub created: bool,
}

/// Returns a self-signed ECDSA P-256 certificate for localhost, 127.0.0.1 and ::1 in `dir`,
/// generating it the first time and reusing it afterwards (so `curl --cacert` keeps working
/// across restarts). The key file is created with mode 0600.
pub fn ensure_localhost_cert(dir: &Path) -> Result<GeneratedPaths, Error> {
    let cert = dir.join("localhost-cert.pem");
    let key = dir.join("localhost-key.pem");
    if cert.exists() && key.exists() {
        return Ok(GeneratedPaths { cert, key, created: false });
    }
    std::fs::create_dir_all(dir).map_err(|e| Error::Config(format!("cannot create {}: {e}", dir.display())))?;
    let names = vec!["localhost".to_string(), "127.0.0.1".to_string(), "::1".to_string()];
    let ck = rcgen::generate_simple_self_signed(names).map_err(|e| Error::Config(format!("certificate generation failed: {e}")))?;
    write_private(&key, ck.key_pair.serialize_pem().as_bytes())?;
    std::fs::write(&cert, ck.cert.pem()).map_err(|e| Error::Config(format!("cannot write {}: {e}", cert.display())))?;
    Ok(GeneratedPaths { cert, key, created: true })
}

fn write_private(path: &Path, bytes: &[u8]) -> Result<(), Error> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| Error::Config(format!("cannot write {}: {e}", path.display())))?;
    f.write_all(bytes).map_err(|e| Error::Config(format!("cannot write {}: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_cert_is_reused_and_loads() {
        let dir = std::env::temp_dir().join(format!("tlsplane-cert-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let first = ensure_localhost_cert(&dir).unwrap();
        assert!(first.created);
        let again = ensure_localhost_cert(&dir).unwrap();
        assert!(!again.created);
        assert_eq!(std::fs::read(&first.cert).unwrap(), std::fs::read(&again.cert).unwrap());
        load_pem(&first.cert, &first.key).unwrap();
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&first.key).unwrap().permissions().mode() & 0o777, 0o600);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn mismatched_key_is_refused() {
        let a = rcgen::generate_simple_self_signed(vec!["a".into()]).unwrap();
        let b = rcgen::generate_simple_self_signed(vec!["b".into()]).unwrap();
        let key = PrivateKeyDer::try_from(b.key_pair.serialize_der()).unwrap();
        let err = certified_key(vec![a.cert.der().clone()], key).err().unwrap();
        assert!(err.to_string().contains("do not match"), "{err}");
    }
}
