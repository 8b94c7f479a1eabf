//! Certificates and keys: PEM loading and the generated localhost certificate.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::crypto::aws_lc_rs::sign::any_supported_type;
use rustls::sign::{CertifiedKey, SigningKey};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use crate::Error;

/// Loads a certificate chain and its private key (ECDSA P-256/P-384, Ed25519 or RSA; PKCS#8,
/// SEC1 or PKCS#1) from PEM files, and checks that they belong together.
pub fn load_pem(cert_path: &Path, key_path: &Path) -> Result<Arc<CertifiedKey>, Error> {
    let chain = load_chain(cert_path)?;
    let key = load_key(key_path)?;
    with_key(chain, key, cert_path, key_path)
}

/// A certificate chain from a PEM file (leaf first).
pub fn load_chain(cert_path: &Path) -> Result<Vec<CertificateDer<'static>>, Error> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert_path)
        .map_err(|e| Error::Config(format!("{}: {}", cert_path.display(), pem_error(&e))))?
        .collect::<Result<_, _>>()
        .map_err(|e| Error::Config(format!("{}: {}", cert_path.display(), pem_error(&e))))?;
    if chain.is_empty() {
        return Err(Error::Config(format!(
            "{}: no CERTIFICATE in PEM file",
            cert_path.display()
        )));
    }
    Ok(chain)
}

/// A PEM parse error as an operator reads it: the PEM crate prints the offending line as a
/// list of byte values (`[45, 45, 45, …]`), which says nothing to a person; show it as text.
fn pem_error(e: &rustls_pki_types::pem::Error) -> String {
    use rustls_pki_types::pem::Error as E;
    let text = |b: &[u8]| String::from_utf8_lossy(b).trim().to_string();
    match e {
        E::MissingSectionEnd { end_marker } => {
            format!(
                "no \"-----END {}-----\" line (a truncated file?)",
                text(end_marker)
            )
        }
        E::IllegalSectionStart { line } => format!("malformed BEGIN line {:?}", text(line)),
        other => other.to_string(),
    }
}

/// A private key from a PEM file, ready to sign. The file's bytes are zeroized once parsed.
pub fn load_key(key_path: &Path) -> Result<Arc<dyn SigningKey>, Error> {
    load_key_der(key_path).map(|(key, _)| key)
}

/// A private key's encoding, as the key daemon keeps it to hand its keys to its successor
/// without reading the file again (which may have changed since). Zeroized when dropped.
pub struct KeyDer {
    /// 1: PKCS#1 (RSA), 2: SEC1 (EC), 3: PKCS#8.
    pub format: u8,
    pub der: zeroize::Zeroizing<Vec<u8>>,
}

/// [`load_key`], and the key's DER encoding.
pub fn load_key_der(key_path: &Path) -> Result<(Arc<dyn SigningKey>, KeyDer), Error> {
    let pem = zeroize::Zeroizing::new(
        std::fs::read(key_path)
            .map_err(|e| Error::Config(format!("{}: cannot read: {e}", key_path.display())))?,
    );
    let key = PrivateKeyDer::from_pem_slice(&pem).map_err(|e| {
        let why = if contains(&pem, b"-----BEGIN ENCRYPTED PRIVATE KEY-----") {
            "the key is encrypted, which is not supported (decrypt it with e.g. \
             `openssl pkey -in KEY -out PLAIN` and keep that file private)"
                .to_string()
        } else if matches!(e, rustls_pki_types::pem::Error::NoItemsFound) {
            "no PRIVATE KEY, EC PRIVATE KEY or RSA PRIVATE KEY block in PEM file".to_string()
        } else {
            format!("no usable private key: {}", pem_error(&e))
        };
        Error::Config(format!("{}: {why}", key_path.display()))
    })?;
    let format = match &key {
        PrivateKeyDer::Pkcs1(_) => 1,
        PrivateKeyDer::Sec1(_) => 2,
        _ => 3,
    };
    let der = KeyDer {
        format,
        der: zeroize::Zeroizing::new(key.secret_der().to_vec()),
    };
    let signing = key_from_der(&der).map_err(|e| {
        Error::Config(format!(
            "{}: unsupported private key: {e}",
            key_path.display()
        ))
    })?;
    Ok((signing, der))
}

/// The signing key that `der` encodes.
pub fn key_from_der(der: &KeyDer) -> Result<Arc<dyn SigningKey>, rustls::Error> {
    Ok(Arc::new(TimedKey(uncounted_key_from_der(der)?)))
}

fn uncounted_key_from_der(der: &KeyDer) -> Result<Arc<dyn SigningKey>, rustls::Error> {
    use rustls_pki_types::{PrivatePkcs1KeyDer, PrivatePkcs8KeyDer, PrivateSec1KeyDer};
    let bytes = der.der.as_slice();
    let key = match der.format {
        1 => PrivateKeyDer::Pkcs1(PrivatePkcs1KeyDer::from(bytes)),
        2 => PrivateKeyDer::Sec1(PrivateSec1KeyDer::from(bytes)),
        _ => PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(bytes)),
    };
    any_supported_type(&key)
}

/// [`load_key`] for a key that authenticates a connection of the key daemon's own (its TLS
/// certificate, a server's client certificate towards it), not a site: its signatures are not
/// counted with the sites' (`signatures`).
pub fn load_transport_key(key_path: &Path) -> Result<Arc<dyn SigningKey>, Error> {
    let (_, der) = load_key_der(key_path)?;
    uncounted_key_from_der(&der).map_err(|e| {
        Error::Config(format!(
            "{}: unsupported private key: {e}",
            key_path.display()
        ))
    })
}

/// A key this process holds, whose signatures are counted and timed (`signatures`,
/// `signature_ns`): what a signature costs where it is made, in the server (`--keyd off`) or
/// in the key daemon, is then measured rather than inferred from profiles. Two clock reads
/// per signature (vDSO, tens of ns) against a signature of tens of µs.
#[derive(Debug)]
struct TimedKey(Arc<dyn SigningKey>);

#[derive(Debug)]
struct TimedSigner(Box<dyn rustls::sign::Signer>);

impl SigningKey for TimedKey {
    fn choose_scheme(
        &self,
        offered: &[rustls::SignatureScheme],
    ) -> Option<Box<dyn rustls::sign::Signer>> {
        let signer = self.0.choose_scheme(offered)?;
        Some(Box::new(TimedSigner(signer)))
    }

    fn public_key(&self) -> Option<rustls_pki_types::SubjectPublicKeyInfoDer<'_>> {
        self.0.public_key()
    }

    fn algorithm(&self) -> rustls::SignatureAlgorithm {
        self.0.algorithm()
    }
}

impl rustls::sign::Signer for TimedSigner {
    fn sign(&self, message: &[u8]) -> Result<Vec<u8>, rustls::Error> {
        let started = std::time::Instant::now();
        let signature = self.0.sign(message);
        let stats = crate::stats::global();
        crate::stats::bump(&stats.signatures);
        crate::stats::add(&stats.signature_ns, started.elapsed().as_nanos() as u64);
        signature
    }

    fn scheme(&self) -> rustls::SignatureScheme {
        self.0.scheme()
    }
}

/// A chain and a key that must belong to its leaf (checked).
pub fn with_key(
    chain: Vec<CertificateDer<'static>>,
    key: Arc<dyn SigningKey>,
    cert_path: &Path,
    key_path: &Path,
) -> Result<Arc<CertifiedKey>, Error> {
    matching(chain, key).map_err(|e| match e {
        Error::Config(why) => Error::Config(format!(
            "{} and {}: {why}",
            key_path.display(),
            cert_path.display()
        )),
        e => e,
    })
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// Builds a [`CertifiedKey`] from DER parts, refusing a key that does not match the leaf.
pub fn certified_key(
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<Arc<CertifiedKey>, Error> {
    let signing_key = any_supported_type(&key)
        .map_err(|e| Error::Config(format!("unsupported private key: {e}")))?;
    matching(chain, signing_key)
}

fn matching(
    chain: Vec<CertificateDer<'static>>,
    key: Arc<dyn SigningKey>,
) -> Result<Arc<CertifiedKey>, Error> {
    let ck = CertifiedKey::new(chain, key);
    ck.keys_match().map_err(|e| {
        Error::Config(match e {
            rustls::Error::InconsistentKeys(rustls::InconsistentKeys::KeyMismatch) => {
                "the private key does not belong to the certificate (first in the chain)".into()
            }
            e => format!("cannot check that the private key belongs to the certificate: {e}"),
        })
    })?;
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
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/tmp"));
    home.join(".local/state/tlsplane")
}

/// Paths of a generated certificate, its key and the CA that signed it.
#[cfg(feature = "localhost-cert")]
#[derive(Debug, Clone)]
pub struct GeneratedPaths {
    /// Trust anchor for clients (`curl --cacert`).
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
    /// False when an existing set was reused.
    pub created: bool,
}

/// Returns an ECDSA P-256 certificate for localhost, 127.0.0.1 and ::1 in `dir`, issued by a
/// local CA made for the purpose, generating both the first time and reusing them afterwards
/// (so `curl --cacert` keeps working across restarts). Two levels rather than one self-signed
/// certificate because verifiers disagree about the latter: webpki refuses a CA certificate as
/// a server certificate, and OpenSSL refuses a self-signed leaf that is not a CA. The CA's key
/// is not kept, so it cannot issue anything else. Key files are created with mode 0600.
#[cfg(feature = "localhost-cert")]
pub fn ensure_localhost_cert(dir: &Path) -> Result<GeneratedPaths, Error> {
    let ca = dir.join("localhost-ca.pem");
    let cert = dir.join("localhost-cert.pem");
    let key = dir.join("localhost-key.pem");
    if ca.exists() && cert.exists() && key.exists() {
        return Ok(GeneratedPaths {
            ca,
            cert,
            key,
            created: false,
        });
    }
    std::fs::create_dir_all(dir)
        .map_err(|e| Error::Config(format!("cannot create {}: {e}", dir.display())))?;
    let gen_err = |e: rcgen::Error| Error::Config(format!("certificate generation failed: {e}"));
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).map_err(gen_err)?;
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Constrained(0));
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "tlsplane local CA");
    ca_params.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::CrlSign,
    ];
    let ca_key = rcgen::KeyPair::generate().map_err(gen_err)?;
    let ca_cert = ca_params.self_signed(&ca_key).map_err(gen_err)?;
    let names = vec![
        "localhost".to_string(),
        "127.0.0.1".to_string(),
        "::1".to_string(),
    ];
    let mut leaf_params = rcgen::CertificateParams::new(names).map_err(gen_err)?;
    leaf_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "localhost");
    leaf_params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    let leaf_key = rcgen::KeyPair::generate().map_err(gen_err)?;
    let leaf_cert = leaf_params
        .signed_by(&leaf_key, &ca_cert, &ca_key)
        .map_err(gen_err)?;
    write_private(&key, leaf_key.serialize_pem().as_bytes())?;
    std::fs::write(&cert, leaf_cert.pem())
        .map_err(|e| Error::Config(format!("cannot write {}: {e}", cert.display())))?;
    std::fs::write(&ca, ca_cert.pem())
        .map_err(|e| Error::Config(format!("cannot write {}: {e}", ca.display())))?;
    Ok(GeneratedPaths {
        ca,
        cert,
        key,
        created: true,
    })
}

#[cfg(feature = "localhost-cert")]
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
    f.write_all(bytes)
        .map_err(|e| Error::Config(format!("cannot write {}: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(feature = "localhost-cert")]
    fn generated_cert_is_reused_and_loads() {
        use rustls::client::danger::ServerCertVerifier as _;
        let dir = std::env::temp_dir().join(format!("tlsplane-cert-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let first = ensure_localhost_cert(&dir).unwrap();
        assert!(first.created);
        let again = ensure_localhost_cert(&dir).unwrap();
        assert!(!again.created);
        assert_eq!(
            std::fs::read(&first.cert).unwrap(),
            std::fs::read(&again.cert).unwrap()
        );
        load_pem(&first.cert, &first.key).unwrap();
        // The leaf verifies against the CA file with webpki (what rustls clients use).
        let ca = CertificateDer::from_pem_file(&first.ca).unwrap();
        let mut roots = rustls::RootCertStore::empty();
        roots.add(ca).unwrap();
        let leaf = CertificateDer::from_pem_file(&first.cert).unwrap();
        let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
            std::sync::Arc::new(roots),
            std::sync::Arc::new(crate::config::crypto_provider()),
        )
        .build()
        .unwrap();
        let name = rustls_pki_types::ServerName::try_from("localhost").unwrap();
        verifier
            .verify_server_cert(&leaf, &[], &name, &[], rustls_pki_types::UnixTime::now())
            .unwrap();
        let ip = rustls_pki_types::ServerName::try_from("127.0.0.1").unwrap();
        verifier
            .verify_server_cert(&leaf, &[], &ip, &[], rustls_pki_types::UnixTime::now())
            .unwrap();
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(&first.key).unwrap().permissions().mode() & 0o777,
            0o600
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn mismatched_key_is_refused() {
        let a = rcgen::generate_simple_self_signed(vec!["a".into()]).unwrap();
        let b = rcgen::generate_simple_self_signed(vec!["b".into()]).unwrap();
        let key = PrivateKeyDer::try_from(b.key_pair.serialize_der()).unwrap();
        let err = certified_key(vec![a.cert.der().clone()], key)
            .err()
            .unwrap();
        assert!(err.to_string().contains("does not belong"), "{err}");
    }

    #[test]
    fn a_truncated_pem_file_is_reported_as_text_not_byte_values() {
        let dir = std::env::temp_dir().join(format!("tlsplane-pem-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cert = dir.join("cut.pem");
        let pem = rcgen::generate_simple_self_signed(vec!["a".into()])
            .unwrap()
            .cert
            .pem();
        std::fs::write(&cert, &pem[..pem.len() / 2]).unwrap();
        let err = load_chain(&cert).err().unwrap().to_string();
        assert!(err.contains("-----END CERTIFICATE-----"), "{err}");
        assert!(!err.contains("[45, 45"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
