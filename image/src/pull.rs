//! Talking to the registry: the manifest (through an index to this node's platform),
//! the config and the layers, each checked against its digest before it is used.
//!
//! A new client is made for every pull: its token and credential caches then never
//! carry one namespace's credentials into another namespace's pull.

use std::io::{Seek, Write};
use std::path::Path;

use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::manifest::OciDescriptor;
use oci_client::secrets::RegistryAuth;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::reference::{ImageRef, is_sha256_digest};
use super::{Credentials, ImageError, Result};

/// Which registries are spoken to over plain HTTP (a node setting,
/// `--insecure-registry`): `HOST:PORT` entries, or `loopback` for every registry on
/// 127.0.0.0/8, `localhost` or `[::1]`. Everything else is HTTPS.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RegistryConfig {
    pub insecure: Vec<String>,
}

impl RegistryConfig {
    pub fn is_insecure(&self, registry: &str) -> bool {
        let host = registry
            .rsplit_once(':')
            .filter(|(_, port)| port.bytes().all(|b| b.is_ascii_digit()))
            .map_or(registry, |(h, _)| h);
        let loopback = host == "localhost"
            || host == "[::1]"
            || host
                .parse::<std::net::Ipv4Addr>()
                .is_ok_and(|ip| ip.is_loopback());
        self.insecure
            .iter()
            .any(|e| e == registry || (e == "loopback" && loopback))
    }
}

/// The media types a manifest request accepts.
const MANIFEST_TYPES: &[&str] = &[
    oci_client::manifest::OCI_IMAGE_MEDIA_TYPE,
    oci_client::manifest::IMAGE_MANIFEST_MEDIA_TYPE,
    oci_client::manifest::OCI_IMAGE_INDEX_MEDIA_TYPE,
    oci_client::manifest::IMAGE_MANIFEST_LIST_MEDIA_TYPE,
];

/// Layer media types this agent unpacks (gzip or plain tar, OCI or Docker names).
const LAYER_TYPES: &[&str] = &[
    oci_client::manifest::IMAGE_LAYER_MEDIA_TYPE,
    oci_client::manifest::IMAGE_LAYER_GZIP_MEDIA_TYPE,
    oci_client::manifest::IMAGE_DOCKER_LAYER_TAR_MEDIA_TYPE,
    oci_client::manifest::IMAGE_DOCKER_LAYER_GZIP_MEDIA_TYPE,
];

/// Largest manifest or config accepted.
pub const MAX_JSON_BYTES: usize = 4 << 20;

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Probe {
    #[serde(default)]
    media_type: Option<String>,
    #[serde(default)]
    manifests: Option<Vec<IndexEntry>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct IndexEntry {
    digest: String,
    #[serde(default)]
    platform: Option<PlatformJson>,
}

#[derive(Deserialize)]
struct PlatformJson {
    #[serde(default)]
    architecture: String,
    #[serde(default)]
    os: String,
}

/// An image manifest (the parts used).
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Manifest {
    pub config: Descriptor,
    #[serde(default)]
    pub layers: Vec<Descriptor>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Descriptor {
    #[serde(default)]
    pub media_type: String,
    pub digest: String,
    #[serde(default)]
    pub size: i64,
}

/// This node's platform in OCI's words (`linux`, `amd64`/`arm64`/...).
pub fn node_platform() -> (&'static str, &'static str) {
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        "powerpc64" => "ppc64le",
        other => other,
    };
    ("linux", arch)
}

pub fn sha256_hex(b: &[u8]) -> String {
    hex::encode(Sha256::digest(b))
}

/// A pull session for one reference with one set of credentials.
pub struct Puller {
    client: oci_client::Client,
    auth: RegistryAuth,
    reference: ImageRef,
}

fn pull_err(r: &ImageRef, e: impl std::fmt::Display) -> ImageError {
    ImageError::Pull {
        reference: r.given.clone(),
        message: e.to_string(),
    }
}

fn refused(r: &ImageRef, why: impl Into<String>) -> ImageError {
    ImageError::Refused {
        reference: r.given.clone(),
        why: why.into(),
    }
}

impl Puller {
    pub fn new(reference: &ImageRef, creds: &Credentials, cfg: &RegistryConfig) -> Self {
        // reqwest is built without a crypto provider of its own: the workspace's ring.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let protocol = if cfg.is_insecure(reference.registry()) {
            ClientProtocol::Http
        } else {
            ClientProtocol::Https
        };
        let client = oci_client::Client::new(ClientConfig {
            protocol,
            // Platform choice is ours (`resolve`), with the digest checks.
            platform_resolver: None,
            connect_timeout: Some(std::time::Duration::from_secs(10)),
            read_timeout: Some(std::time::Duration::from_secs(60)),
            ..ClientConfig::default()
        });
        let auth = match creds {
            Credentials::Anonymous => RegistryAuth::Anonymous,
            Credentials::Basic { username, password } => {
                RegistryAuth::Basic(username.clone(), password.clone())
            }
        };
        Puller {
            client,
            auth,
            reference: reference.clone(),
        }
    }

    async fn manifest_raw(&self, r: &oci_client::Reference) -> Result<Vec<u8>> {
        let (body, _) = self
            .client
            .pull_manifest_raw(r, &self.auth, MANIFEST_TYPES)
            .await
            .map_err(|e| pull_err(&self.reference, error_chain(&e)))?;
        if body.len() > MAX_JSON_BYTES {
            return Err(refused(&self.reference, "manifest larger than 4 MiB"));
        }
        Ok(body.to_vec())
    }

    /// The image manifest of this node's platform and its digest (checked: the
    /// sha256 of the bytes received, equal to the digest asked for when there was one).
    pub async fn resolve(&self) -> Result<(String, Manifest)> {
        let r = &self.reference;
        let body = self.manifest_raw(&r.inner).await?;
        let digest = format!("sha256:{}", sha256_hex(&body));
        if let Some(want) = r.digest()
            && want != digest
        {
            return Err(pull_err(
                r,
                format!("the registry sent a manifest of digest {digest}, not {want}"),
            ));
        }
        let probe: Probe = serde_json::from_slice(&body)
            .map_err(|e| refused(r, format!("manifest does not parse: {e}")))?;
        let is_index = probe.manifests.is_some()
            || probe.media_type.as_deref().is_some_and(|m| {
                m == oci_client::manifest::OCI_IMAGE_INDEX_MEDIA_TYPE
                    || m == oci_client::manifest::IMAGE_MANIFEST_LIST_MEDIA_TYPE
            });
        let (digest, body) = if is_index {
            let (os, arch) = node_platform();
            let entries = probe.manifests.unwrap_or_default();
            let chosen = entries
                .iter()
                .find(|m| {
                    m.platform
                        .as_ref()
                        .is_some_and(|p| p.os == os && p.architecture == arch)
                })
                .ok_or_else(|| {
                    let have: Vec<String> = entries
                        .iter()
                        .filter_map(|m| m.platform.as_ref())
                        .map(|p| format!("{}/{}", p.os, p.architecture))
                        .collect();
                    pull_err(
                        r,
                        format!(
                            "the image index has no {os}/{arch} manifest (it has: {})",
                            have.join(", ")
                        ),
                    )
                })?;
            if !is_sha256_digest(&chosen.digest) {
                return Err(refused(
                    r,
                    format!("index entry digest {:?} is not sha256", chosen.digest),
                ));
            }
            let sub = r.inner.clone_with_digest(chosen.digest.clone());
            let body = self.manifest_raw(&sub).await?;
            let got = format!("sha256:{}", sha256_hex(&body));
            if got != chosen.digest {
                return Err(pull_err(
                    r,
                    format!(
                        "the registry sent a manifest of digest {got}, not {}",
                        chosen.digest
                    ),
                ));
            }
            (got, body)
        } else {
            (digest, body)
        };
        let manifest: Manifest = serde_json::from_slice(&body)
            .map_err(|e| refused(r, format!("image manifest does not parse: {e}")))?;
        for l in &manifest.layers {
            if !LAYER_TYPES.contains(&l.media_type.as_str()) {
                return Err(refused(
                    r,
                    format!(
                        "layer {} has media type {:?} (supported: tar, tar+gzip)",
                        l.digest, l.media_type
                    ),
                ));
            }
        }
        for d in std::iter::once(&manifest.config).chain(&manifest.layers) {
            if !is_sha256_digest(&d.digest) {
                return Err(refused(r, format!("digest {:?} is not sha256", d.digest)));
            }
        }
        Ok((digest, manifest))
    }

    fn oci_desc(d: &Descriptor) -> OciDescriptor {
        OciDescriptor {
            media_type: d.media_type.clone(),
            digest: d.digest.clone(),
            size: d.size,
            ..Default::default()
        }
    }

    /// A small blob (the config) in memory, checked against its digest.
    pub async fn blob_bytes(&self, d: &Descriptor) -> Result<Vec<u8>> {
        let r = &self.reference;
        if usize::try_from(d.size).unwrap_or(usize::MAX) > MAX_JSON_BYTES {
            return Err(refused(r, format!("config {} larger than 4 MiB", d.digest)));
        }
        let mut out = Vec::new();
        self.client
            .pull_blob(&r.inner, &Self::oci_desc(d), &mut out)
            .await
            .map_err(|e| pull_err(r, error_chain(&e)))?;
        if format!("sha256:{}", sha256_hex(&out)) != d.digest {
            return Err(pull_err(
                r,
                format!("blob {} does not match its digest", d.digest),
            ));
        }
        Ok(out)
    }

    /// A layer blob into `path` (created), then hashed again from the file itself: the
    /// returned file (rewound) is what was checked.
    pub async fn blob_file(&self, d: &Descriptor, path: &Path) -> Result<std::fs::File> {
        let r = &self.reference;
        let file = tokio::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
            .await
            .map_err(|e| ImageError::io(path, e))?;
        let mut w = tokio::io::BufWriter::new(file);
        self.client
            .pull_blob(&r.inner, &Self::oci_desc(d), &mut w)
            .await
            .map_err(|e| pull_err(r, error_chain(&e)))?;
        let file = w.into_inner().into_std().await;
        let path = path.to_path_buf();
        let want = d.digest.clone();
        let r2 = r.clone();
        tokio::task::spawn_blocking(move || {
            let mut file = file;
            file.flush().map_err(|e| ImageError::io(&path, e))?;
            file.rewind().map_err(|e| ImageError::io(&path, e))?;
            let mut h = Sha256::new();
            std::io::copy(&mut file, &mut HashWriter(&mut h))
                .map_err(|e| ImageError::io(&path, e))?;
            if format!("sha256:{}", hex::encode(h.finalize())) != want {
                return Err(pull_err(
                    &r2,
                    format!("blob {want} does not match its digest"),
                ));
            }
            file.rewind().map_err(|e| ImageError::io(&path, e))?;
            Ok(file)
        })
        .await
        .map_err(|e| ImageError::io("hash", std::io::Error::other(e.to_string())))?
    }
}

struct HashWriter<'a>(&'a mut Sha256);

impl Write for HashWriter<'_> {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.update(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// An error and its causes in one line (the registry's message is often a cause).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_http_only_for_the_registries_named_or_loopback_when_asked() {
        let none = RegistryConfig::default();
        assert!(!none.is_insecure("127.0.0.1:5000"));
        let one = RegistryConfig {
            insecure: vec!["10.0.0.5:5000".into()],
        };
        assert!(one.is_insecure("10.0.0.5:5000"));
        assert!(!one.is_insecure("10.0.0.5:5001"));
        assert!(!one.is_insecure("127.0.0.1:5000"));
        let lo = RegistryConfig {
            insecure: vec!["loopback".into()],
        };
        for r in [
            "127.0.0.1:5000",
            "127.9.9.9:1",
            "localhost:5000",
            "[::1]:5000",
            "localhost",
        ] {
            assert!(lo.is_insecure(r), "{r}");
        }
        for r in [
            "registry.example:5000",
            "10.0.0.1:5000",
            "localhost.evil.example:5000",
        ] {
            assert!(!lo.is_insecure(r), "{r}");
        }
    }
}
