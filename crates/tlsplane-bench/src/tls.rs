//! rustls client configuration.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::{Resumption, Tls12Resumption};
use rustls::crypto::{aws_lc_rs, CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName, UnixTime};

use crate::args::{resolve_version, Group, ResumeMode, TlsArgs, TlsVersion};

/// How the server certificate is checked.
#[derive(Debug, Clone)]
pub(crate) enum Verify {
    CaFile(PathBuf),
    Insecure,
}

pub(crate) fn verify_mode(tls: &TlsArgs) -> Result<Verify> {
    match (&tls.cacert, tls.insecure_no_verify) {
        (Some(_), true) => bail!("--cacert and --insecure-no-verify are mutually exclusive"),
        (Some(p), false) => Ok(Verify::CaFile(p.clone())),
        (None, true) => Ok(Verify::Insecure),
        (None, false) => bail!(
            "no trust anchor: pass --cacert PEM to verify the server certificate, or \
             --insecure-no-verify to skip verification (system/web roots are not used)"
        ),
    }
}

fn kx_group(g: Group) -> &'static dyn rustls::crypto::SupportedKxGroup {
    use aws_lc_rs::kx_group;
    match g {
        Group::X25519 => kx_group::X25519,
        Group::X25519Mlkem768 => kx_group::X25519MLKEM768,
        Group::Secp256r1 => kx_group::SECP256R1,
        Group::Secp384r1 => kx_group::SECP384R1,
    }
}

/// Finds a cipher suite of the aws-lc-rs provider by its rustls name.
pub(crate) fn find_suite(name: &str) -> Result<rustls::SupportedCipherSuite> {
    let all = aws_lc_rs::ALL_CIPHER_SUITES;
    all.iter()
        .find(|s| {
            s.suite()
                .as_str()
                .is_some_and(|n| n.eq_ignore_ascii_case(name.trim()))
        })
        .copied()
        .ok_or_else(|| {
            let names: Vec<&str> = all.iter().filter_map(|s| s.suite().as_str()).collect();
            anyhow!(
                "--cipher: unknown suite `{name}`; known: {}",
                names.join(", ")
            )
        })
}

fn suite_version(s: &rustls::SupportedCipherSuite) -> TlsVersion {
    match s {
        rustls::SupportedCipherSuite::Tls12(_) => TlsVersion::V12,
        rustls::SupportedCipherSuite::Tls13(_) => TlsVersion::V13,
    }
}

/// Builds the base client config (resumption is set per loop by [`loop_config`]).
pub(crate) fn build_config(
    tls: &TlsArgs,
    resume: ResumeMode,
    alpn: Vec<Vec<u8>>,
    verify: Verify,
) -> Result<(ClientConfig, Option<TlsVersion>)> {
    let mut provider: CryptoProvider = aws_lc_rs::default_provider();
    let mut cipher_version = None;
    if let Some(name) = &tls.cipher {
        let suite = find_suite(name)?;
        cipher_version = Some(suite_version(&suite));
        provider.cipher_suites = vec![suite];
    }
    if let Some(g) = tls.group {
        provider.kx_groups = vec![kx_group(g)];
    }
    let version = resolve_version(tls.tls, cipher_version, tls.group, resume)?;
    let versions: &[&'static rustls::SupportedProtocolVersion] = match version {
        Some(TlsVersion::V12) => &[&rustls::version::TLS12],
        Some(TlsVersion::V13) => &[&rustls::version::TLS13],
        None => &[&rustls::version::TLS13, &rustls::version::TLS12],
    };
    let sig_algs = provider.signature_verification_algorithms;
    let builder = ClientConfig::builder_with_provider(Arc::new(provider))
        .with_protocol_versions(versions)
        .context("TLS configuration")?;
    let mut config = match verify {
        Verify::Insecure => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(NoCertVerification(sig_algs)))
            .with_no_client_auth(),
        Verify::CaFile(path) => {
            let mut roots = RootCertStore::empty();
            let certs = CertificateDer::pem_file_iter(&path)
                .with_context(|| format!("--cacert {}", path.display()))?;
            for cert in certs {
                let cert = cert.with_context(|| format!("--cacert {}", path.display()))?;
                roots
                    .add(cert)
                    .with_context(|| format!("--cacert {}: bad certificate", path.display()))?;
            }
            if roots.is_empty() {
                bail!("--cacert {}: no certificates found", path.display());
            }
            builder.with_root_certificates(roots).with_no_client_auth()
        }
    };
    config.alpn_protocols = alpn;
    config.resumption = Resumption::disabled();
    Ok((config, version))
}

/// The config one connection loop uses for its whole life: a clone of the
/// base with a session store of its own (so resumption is per loop).
pub(crate) fn loop_config(base: &ClientConfig, session_cache: bool) -> Arc<ClientConfig> {
    let mut c = base.clone();
    c.resumption = if session_cache {
        Resumption::in_memory_sessions(32).tls12_resumption(Tls12Resumption::SessionIdOrTickets)
    } else {
        Resumption::disabled()
    };
    Arc::new(c)
}

/// `--insecure-no-verify`: accepts any certificate chain and name, but still
/// checks the handshake signature against the presented certificate's key.
#[derive(Debug)]
struct NoCertVerification(WebPkiSupportedAlgorithms);

impl ServerCertVerifier for NoCertVerification {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_schemes()
    }
}
