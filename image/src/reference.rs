//! `spec.image`: parsed, normalised (Docker Hub's defaults) and its default pull policy.

use ramify_crds::ImagePullPolicy;

use super::{ImageError, Result};

/// A parsed image reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageRef {
    /// As written in the spec.
    pub given: String,
    pub(crate) inner: oci_client::Reference,
}

impl ImageRef {
    /// Parses `spec.image` (the CRD's pattern admits it already; an older CRD may not
    /// have checked).
    pub fn parse(s: &str) -> Result<Self> {
        let invalid = |why: String| ImageError::InvalidName {
            reference: s.to_string(),
            why,
        };
        if s.is_empty() || s.len() > 1024 || s.trim() != s {
            return Err(invalid("empty, too long or padded with spaces".into()));
        }
        let inner: oci_client::Reference = s.parse().map_err(|e| invalid(format!("{e}")))?;
        // What the CRD's pattern says of the path (oci-client accepts upper case).
        for c in inner.repository().split('/') {
            let b = c.as_bytes();
            let ok = !b.is_empty()
                && b.iter()
                    .all(|&x| x.is_ascii_lowercase() || x.is_ascii_digit() || b"._-".contains(&x))
                && b[0].is_ascii_alphanumeric()
                && b[b.len() - 1].is_ascii_alphanumeric();
            if !ok {
                return Err(invalid(format!(
                    "repository component {c:?} must be lowercase letters, digits and . _ - (not at either end)"
                )));
            }
        }
        if let Some(d) = inner.digest()
            && !is_sha256_digest(d)
        {
            return Err(invalid(format!(
                "digest {d:?} is not sha256:<64 hex digits>"
            )));
        }
        Ok(ImageRef {
            given: s.to_string(),
            inner,
        })
    }

    /// The registry host (with port) the image comes from.
    pub fn registry(&self) -> &str {
        self.inner.resolve_registry()
    }

    pub fn repository(&self) -> &str {
        self.inner.repository()
    }

    pub fn tag(&self) -> Option<&str> {
        self.inner.tag()
    }

    pub fn digest(&self) -> Option<&str> {
        self.inner.digest()
    }

    /// The same repository pinned to `digest` (how snapshots and restores name it).
    pub fn pinned(&self, digest: &str) -> String {
        format!("{}/{}@{digest}", self.inner.registry(), self.repository())
    }

    /// Whether this reference names one immutable image (by digest).
    pub fn is_pinned(&self) -> bool {
        self.digest().is_some()
    }
}

/// A `sha256:` digest with 64 lowercase hex digits.
pub fn is_sha256_digest(d: &str) -> bool {
    d.strip_prefix("sha256:").is_some_and(|h| {
        h.len() == 64
            && h.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

/// Kubernetes' default: `Always` for `:latest` or no tag (and no digest),
/// `IfNotPresent` otherwise.
pub fn default_policy(r: &ImageRef) -> ImagePullPolicy {
    if r.digest().is_some() {
        return ImagePullPolicy::IfNotPresent;
    }
    match r.tag() {
        None | Some("latest") => ImagePullPolicy::Always,
        Some(_) => ImagePullPolicy::IfNotPresent,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const D: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    #[test]
    fn references_parse_and_normalise() {
        let r = ImageRef::parse("127.0.0.1:5000/private/busybox:1").unwrap();
        assert_eq!(r.registry(), "127.0.0.1:5000");
        assert_eq!(r.repository(), "private/busybox");
        assert_eq!(r.tag(), Some("1"));
        assert_eq!(r.pinned(D), format!("127.0.0.1:5000/private/busybox@{D}"));
        let r = ImageRef::parse("busybox").unwrap();
        assert_eq!(r.repository(), "library/busybox");
        assert_eq!(r.tag(), Some("latest"));
        let r = ImageRef::parse(&format!("localhost:5000/a@{D}")).unwrap();
        assert_eq!(r.digest(), Some(D));
        assert!(r.is_pinned());
    }

    #[test]
    fn invalid_references_are_refused_naming_the_field() {
        for bad in [
            "",
            " busybox",
            "UPPER/case",
            "a@sha256:xyz",
            "a@md5:0123",
            "a:b:c:d",
        ] {
            let e = ImageRef::parse(bad).unwrap_err();
            assert!(
                matches!(e, ImageError::InvalidName { .. }),
                "{bad:?}: {e:?}"
            );
            assert!(e.to_string().contains("spec.image"), "{e}");
            assert!(e.is_permanent());
        }
    }

    #[test]
    fn the_default_policy_is_kubernetes_own() {
        let p = |s: &str| default_policy(&ImageRef::parse(s).unwrap());
        assert_eq!(p("busybox"), ImagePullPolicy::Always);
        assert_eq!(p("busybox:latest"), ImagePullPolicy::Always);
        assert_eq!(p("busybox:1"), ImagePullPolicy::IfNotPresent);
        assert_eq!(p(&format!("busybox@{D}")), ImagePullPolicy::IfNotPresent);
        assert_eq!(
            p(&format!("busybox:latest@{D}")),
            ImagePullPolicy::IfNotPresent
        );
    }
}
