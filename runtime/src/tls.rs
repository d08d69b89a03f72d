//! TLS for ramify's own endpoints: the aggregated API (`ramify-api`, authenticating the
//! kube-apiserver's front proxy by its client certificate) and the node agents' mTLS
//! endpoint (which serves `ramify-api` only). rustls with the ring provider, as kube
//! itself uses.

use std::path::Path;
use std::sync::Arc;

use rustls::client::danger::HandshakeSignatureValid;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{ClientConfig, DigitallySignedStruct, DistinguishedName, RootCertStore, ServerConfig};

/// Why a TLS configuration could not be built.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{what} {path}: {reason}")]
    Pem {
        what: &'static str,
        path: String,
        reason: String,
    },
    #[error("{0}: no certificate in it")]
    NoCertificate(String),
    #[error("TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
    #[error("client certificate verifier: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The certificates of a PEM file (a chain, or a CA bundle).
pub fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| TlsError::Pem {
            what: "certificates",
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate(path.display().to_string()));
    }
    Ok(certs)
}

/// The private key of a PEM file.
pub fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| TlsError::Pem {
        what: "private key",
        path: path.display().to_string(),
        reason: e.to_string(),
    })
}

/// A root store of the CA certificates in a PEM text (`what` names it in errors).
pub fn roots_from_pem(pem: &str, what: &str) -> Result<RootCertStore, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Pem {
            what: "CA bundle",
            path: what.to_string(),
            reason: e.to_string(),
        })?;
    roots(certs, what)
}

/// A root store of the CA certificates in a PEM file.
pub fn roots_from_file(path: &Path) -> Result<RootCertStore, TlsError> {
    roots(load_certs(path)?, &path.display().to_string())
}

fn roots(certs: Vec<CertificateDer<'static>>, what: &str) -> Result<RootCertStore, TlsError> {
    let mut store = RootCertStore::empty();
    let (added, _) = store.add_parsable_certificates(certs);
    if added == 0 {
        return Err(TlsError::NoCertificate(what.to_string()));
    }
    Ok(store)
}

/// Who may connect to a server.
pub enum ClientAuth {
    /// Anyone; a client certificate, when offered, must chain to these roots (the
    /// caller then decides per request what a verified certificate allows).
    Optional(RootCertStore),
    /// Only clients whose certificate chains to these roots and names this DNS name
    /// (subjectAltName): the handshake fails for anyone else.
    RequiredNamed(RootCertStore, String),
}

/// A server configuration for `cert`/`key`, speaking HTTP/1.1.
pub fn server_config(cert: &Path, key: &Path, auth: ClientAuth) -> Result<ServerConfig, TlsError> {
    let provider = provider();
    let verifier: Arc<dyn ClientCertVerifier> = match auth {
        ClientAuth::Optional(roots) => {
            WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                .allow_unauthenticated()
                .build()?
        }
        ClientAuth::RequiredNamed(roots, name) => Arc::new(NamedClientVerifier {
            inner: WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                .build()?,
            name,
        }),
    };
    let mut cfg = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_client_cert_verifier(verifier)
        .with_single_cert(load_certs(cert)?, load_key(key)?)?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(cfg)
}

/// A client configuration trusting `roots` and presenting `cert`/`key`.
pub fn client_config(
    roots: RootCertStore,
    cert: &Path,
    key: &Path,
) -> Result<ClientConfig, TlsError> {
    let mut cfg = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_client_auth_cert(load_certs(cert)?, load_key(key)?)?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(cfg)
}

/// Whether a (verified) certificate names `name` among its subjectAltName DNS names.
pub fn cert_names(cert: &CertificateDer<'_>, name: &str) -> bool {
    let Ok(server_name) = ServerName::try_from(name) else {
        return false;
    };
    webpki::EndEntityCert::try_from(cert)
        .is_ok_and(|ee| ee.verify_is_valid_for_subject_name(&server_name).is_ok())
}

/// A client verifier that also requires one subjectAltName: the agents share a CA with
/// other ramify certificates, but serve only the one that names `ramify-api`.
#[derive(Debug)]
struct NamedClientVerifier {
    inner: Arc<dyn ClientCertVerifier>,
    name: String,
}

impl ClientCertVerifier for NamedClientVerifier {
    fn client_auth_mandatory(&self) -> bool {
        true
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let verified = self
            .inner
            .verify_client_cert(end_entity, intermediates, now)?;
        if !cert_names(end_entity, &self.name) {
            return Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::NotValidForName,
            ));
        }
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// The subject common name of a DER certificate (what the kube-apiserver's
/// `--requestheader-allowed-names` lists). Only called on certificates the TLS layer
/// has verified; anything malformed yields `None`.
pub fn common_name(cert: &[u8]) -> Option<String> {
    // Certificate ::= SEQUENCE { tbsCertificate SEQUENCE { [0] version OPTIONAL,
    //   serialNumber, signature, issuer, validity, subject, ... }, ... }
    let (_, cert_body, _) = der_tlv(cert)?;
    let (_, mut tbs, _) = der_tlv(cert_body)?;
    let mut fields = Vec::new();
    while !tbs.is_empty() && fields.len() < 7 {
        let (tag, value, rest) = der_tlv(tbs)?;
        fields.push((tag, value));
        tbs = rest;
    }
    let skip = usize::from(fields.first()?.0 == 0xa0);
    // After the optional version: serial, signature algorithm, issuer, validity, subject.
    let (tag, mut subject) = *fields.get(skip + 4)?;
    if tag != 0x30 {
        return None;
    }
    const CN: &[u8] = &[0x55, 0x04, 0x03];
    while !subject.is_empty() {
        let (_, rdn, rest) = der_tlv(subject)?;
        subject = rest;
        let mut set = rdn;
        while !set.is_empty() {
            let (_, atv, more) = der_tlv(set)?;
            set = more;
            let (oid_tag, oid, value) = der_tlv(atv)?;
            if oid_tag == 0x06 && oid == CN {
                let (_, text, _) = der_tlv(value)?;
                return String::from_utf8(text.to_vec()).ok();
            }
        }
    }
    None
}

/// One DER tag-length-value: (tag, value, the bytes after it).
fn der_tlv(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n]
            .iter()
            .fold(0usize, |acc, b| (acc << 8) | usize::from(*b));
        (len, &rest[n..])
    };
    if rest.len() < len {
        return None;
    }
    Some((tag, &rest[..len], &rest[len..]))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use std::process::Command;

    /// A certificate made by openssl (the tool that makes the control plane's), so the
    /// parser is checked against real encodings, with and without a version field.
    fn openssl_cert(dir: &Path, subj: &str, san: Option<&str>) -> CertificateDer<'static> {
        let key = dir.join("k.pem");
        let crt = dir.join("c.pem");
        let mut c = Command::new("openssl");
        c.args([
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
        ])
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&crt)
        .args(["-subj", subj]);
        if let Some(san) = san {
            c.args(["-addext", &format!("subjectAltName={san}")]);
        }
        let out = c
            .output()
            .expect("openssl is installed (hack/install-deps.sh)");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        load_certs(&crt).unwrap().remove(0)
    }

    fn tempdir(test: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("ramify-tls-{}-{test}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn common_name_is_read_from_real_certificates() {
        let dir = tempdir("cn");
        let c = openssl_cert(&dir, "/O=system:masters/CN=front-proxy-client", None);
        assert_eq!(common_name(&c).as_deref(), Some("front-proxy-client"));
        let c = openssl_cert(&dir, "/CN=alice/O=team-a", None);
        assert_eq!(common_name(&c).as_deref(), Some("alice"));
        let c = openssl_cert(&dir, "/O=no-common-name", None);
        assert_eq!(common_name(&c), None);
        assert_eq!(common_name(b"\x30\x82\xff"), None);
        assert_eq!(common_name(&[]), None);
    }

    #[test]
    fn cert_names_checks_the_subject_alt_names_only() {
        let dir = tempdir("san");
        let c = openssl_cert(&dir, "/CN=ramify-api", Some("DNS:ramify-api"));
        assert!(cert_names(&c, "ramify-api"));
        assert!(!cert_names(&c, "ramify-node-agent"));
        // A common name alone does not count.
        let c = openssl_cert(&dir, "/CN=ramify-api", Some("DNS:other"));
        assert!(!cert_names(&c, "ramify-api"));
    }
}
