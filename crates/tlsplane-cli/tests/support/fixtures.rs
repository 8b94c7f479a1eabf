//! Per-process fixtures: a document root with random files of awkward sizes, and certificates
//! generated with rcgen (a P-256 CA signing one leaf per key type).

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use aws_lc_rs::digest;
use rustls_pki_types::CertificateDer;

/// One file of the document root with known content.
pub struct DocFile {
    /// URL path, e.g. `/r16384.bin`.
    pub url: String,
    pub path: PathBuf,
    pub size: u64,
    pub sha256: [u8; 32],
}

pub struct Fixtures {
    /// Removed by the next test process that finds it stale (see [`cleanup_stale`]).
    pub base: PathBuf,
    /// The document root served by every test server.
    pub www: PathBuf,
    /// The content-identity files, smallest first (the last one is 64 MiB).
    pub files: Vec<DocFile>,
    /// `/hello.txt`: a short text file.
    pub hello: DocFile,
    /// `/text.txt`: ~40 KB of numbered lines (three records), for text-based tools.
    pub text: DocFile,
    /// A file next to (outside) the document root whose marker must never be served.
    pub secret_path: PathBuf,
    pub secret_marker: &'static str,
}

pub const SECRET_MARKER: &str = "TLSPLANE-E2E-SECRET-OUTSIDE-THE-DOCROOT-7f3a9c";
pub const HELLO: &[u8] = b"hello from the tlsplane end-to-end tests\n";
pub const SIZE_64M: u64 = 64 << 20;
pub const SIZE_1M7: u64 = (1 << 20) + 7;

/// The sizes of test 1: around one TLS record (16384), around nothing, around 1 MiB, and big.
pub const CONTENT_SIZES: [u64; 7] = [0, 1, 16383, 16384, 16385, SIZE_1M7, SIZE_64M];

pub fn sha256(data: &[u8]) -> [u8; 32] {
    digest::digest(&digest::SHA256, data)
        .as_ref()
        .try_into()
        .expect("32-byte digest")
}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

pub fn get() -> &'static Fixtures {
    static F: OnceLock<Fixtures> = OnceLock::new();
    F.get_or_init(create)
}

impl Fixtures {
    pub fn file(&self, size: u64) -> &DocFile {
        self.files
            .iter()
            .find(|f| f.size == size)
            .unwrap_or_else(|| panic!("no fixture file of {size} bytes"))
    }

    pub fn big(&self) -> &DocFile {
        self.file(SIZE_64M)
    }

    /// Content-identity files without the 64 MiB one.
    pub fn small_files(&self) -> impl Iterator<Item = &DocFile> {
        self.files.iter().filter(|f| f.size < SIZE_64M)
    }
}

/// Removes `tlsplane-e2e-PID` directories of test processes that no longer run.
fn cleanup_stale(tmp: &Path) {
    let Ok(entries) = fs::read_dir(tmp) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.strip_prefix("tlsplane-e2e-")) else {
            continue;
        };
        let Ok(pid) = pid.parse::<u32>() else {
            continue;
        };
        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = fs::remove_dir_all(e.path());
        }
    }
}

fn write_file(www: &Path, name: &str, content: &[u8]) -> DocFile {
    let path = www.join(name);
    fs::write(&path, content).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
    DocFile {
        url: format!("/{name}"),
        path,
        size: content.len() as u64,
        sha256: sha256(content),
    }
}

fn create() -> Fixtures {
    let tmp = std::env::temp_dir();
    cleanup_stale(&tmp);
    let base = tmp.join(format!("tlsplane-e2e-{}", std::process::id()));
    let _ = fs::remove_dir_all(&base);
    let www = base.join("www");
    fs::create_dir_all(www.join("sub")).expect("creating the document root");

    let mut files = Vec::new();
    let mut buf = vec![0u8; SIZE_64M as usize];
    aws_lc_rs::rand::fill(&mut buf).expect("random bytes");
    for size in CONTENT_SIZES {
        let name = match size {
            SIZE_64M => "r64m.bin".to_string(),
            SIZE_1M7 => "r1m7.bin".to_string(),
            n => format!("r{n}.bin"),
        };
        // Different sizes get different content (offset by size) so that a server serving the
        // wrong file of a similar size cannot pass.
        let start = (size as usize * 7919) % 4096;
        let end = start + size as usize;
        let content = if end <= buf.len() {
            &buf[start..end]
        } else {
            &buf[..size as usize]
        };
        files.push(write_file(&www, &name, content));
    }
    drop(buf);

    let hello = write_file(&www, "hello.txt", HELLO);
    let mut text = String::new();
    let mut i = 0;
    while text.len() < 40_000 {
        text.push_str(&format!(
            "line {i:06} of the tlsplane e2e text fixture, padded to a fixed width....\n"
        ));
        i += 1;
    }
    let text = write_file(&www, "text.txt", text.as_bytes());
    fs::write(www.join("sub/inner.txt"), b"inner\n").expect("sub/inner.txt");

    // Traversal targets: a secret next to the document root, and symlinks leading out of it.
    let secret_path = base.join("secret.txt");
    fs::write(&secret_path, SECRET_MARKER).expect("secret.txt");
    std::os::unix::fs::symlink("/etc", www.join("etc")).expect("symlink www/etc -> /etc");
    std::os::unix::fs::symlink("/etc/passwd", www.join("passwd")).expect("symlink www/passwd");
    std::os::unix::fs::symlink(&secret_path, www.join("secret-link.txt"))
        .expect("symlink www/secret-link.txt");

    Fixtures {
        base,
        www,
        files,
        hello,
        text,
        secret_path,
        secret_marker: SECRET_MARKER,
    }
}

/// Server key types.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CertKind {
    P256,
    P384,
    Ed25519,
    Rsa2048,
}

pub struct CertFiles {
    pub cert_pem: PathBuf,
    pub key_pem: PathBuf,
}

pub struct Pki {
    /// The CA every client trusts (PEM file, and DER for rustls).
    pub ca_pem: PathBuf,
    pub ca_der: CertificateDer<'static>,
    ca_cert: rcgen::Certificate,
    ca_key: rcgen::KeyPair,
    leaves: std::sync::Mutex<Vec<(CertKind, &'static CertFiles)>>,
}

pub fn pki() -> &'static Pki {
    static P: OnceLock<Pki> = OnceLock::new();
    P.get_or_init(|| {
        let dir = get().base.join("pki");
        fs::create_dir_all(&dir).expect("pki dir");
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "tlsplane e2e test CA");
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::CrlSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        let ca_key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).expect("CA key");
        let ca_cert = params.self_signed(&ca_key).expect("CA certificate");
        let ca_pem = dir.join("ca.pem");
        fs::write(&ca_pem, ca_cert.pem()).expect("ca.pem");
        let ca_der = ca_cert.der().clone().into_owned();
        Pki {
            ca_pem,
            ca_der,
            ca_cert,
            ca_key,
            leaves: std::sync::Mutex::new(Vec::new()),
        }
    })
}

impl Pki {
    /// The leaf certificate (localhost, 127.0.0.1) of the given key type, made on first use.
    pub fn leaf(&self, kind: CertKind) -> &'static CertFiles {
        let mut leaves = self.leaves.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, f)) = leaves.iter().find(|(k, _)| *k == kind) {
            return f;
        }
        let name = format!("{kind:?}").to_lowercase();
        let files = self.issue_in(
            &get().base.join("pki"),
            &name,
            &["localhost", "127.0.0.1"],
            kind,
        );
        let files: &'static CertFiles = Box::leak(Box::new(files));
        leaves.push((kind, files));
        files
    }

    /// A new leaf for `names` (DNS names, `*.` wildcards or IP addresses) with a new key of
    /// `kind`, signed by the test CA, written to `dir/<stem>.crt.pem` and `.key.pem`.
    pub fn issue_in(&self, dir: &Path, stem: &str, names: &[&str], kind: CertKind) -> CertFiles {
        self.issue_for(
            dir,
            stem,
            names,
            kind,
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
        )
    }

    /// As [`Pki::issue_in`], a client certificate (for a TLS server that asks for one).
    pub fn issue_client_in(&self, dir: &Path, stem: &str, kind: CertKind) -> CertFiles {
        let usage = rcgen::ExtendedKeyUsagePurpose::ClientAuth;
        self.issue_for(dir, stem, &[stem], kind, usage)
    }

    fn issue_for(
        &self,
        dir: &Path,
        stem: &str,
        names: &[&str],
        kind: CertKind,
        usage: rcgen::ExtendedKeyUsagePurpose,
    ) -> CertFiles {
        let key = match kind {
            CertKind::P256 => rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256),
            CertKind::P384 => rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P384_SHA384),
            CertKind::Ed25519 => rcgen::KeyPair::generate_for(&rcgen::PKCS_ED25519),
            CertKind::Rsa2048 => {
                rcgen::KeyPair::generate_rsa_for(&rcgen::PKCS_RSA_SHA256, rcgen::RsaKeySize::_2048)
            }
        }
        .unwrap_or_else(|e| panic!("generating a {kind:?} key: {e}"));
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let mut params = rcgen::CertificateParams::new(names.clone()).expect("leaf params");
        params.distinguished_name.push(
            rcgen::DnType::CommonName,
            names.first().cloned().unwrap_or_default(),
        );
        params.extended_key_usages = vec![usage];
        params.use_authority_key_identifier_extension = true;
        let cert = params
            .signed_by(&key, &self.ca_cert, &self.ca_key)
            .expect("signing the leaf");
        fs::create_dir_all(dir).expect("certificate dir");
        let files = CertFiles {
            cert_pem: dir.join(format!("{stem}.crt.pem")),
            key_pem: dir.join(format!("{stem}.key.pem")),
        };
        fs::write(&files.cert_pem, cert.pem()).expect("leaf cert");
        fs::write(&files.key_pem, key.serialize_pem()).expect("leaf key");
        files
    }
}
