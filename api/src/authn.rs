//! Who is calling: the kube-apiserver's front proxy vouches for the user.
//!
//! The aggregation layer authenticates the user, then calls us with its own client
//! certificate (`--proxy-client-cert-file`) and the user in request headers
//! (`X-Remote-User`, `X-Remote-Group`, `X-Remote-Extra-*`). Those headers mean
//! something only on a connection whose client certificate chains to the
//! requestheader CA and, when the API server lists allowed names, carries one of them
//! as its common name: anyone else could write them. The CA, the names and the header
//! names come from the `extension-apiserver-authentication` ConfigMap the API server
//! publishes in kube-system (what every aggregated API server reads).

use std::collections::BTreeMap;

use http::HeaderMap;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use rustls::RootCertStore;
use rustls::pki_types::CertificateDer;

/// Namespace and name of the ConfigMap the API server publishes its front-proxy
/// settings in.
pub const AUTH_CONFIG_MAP: (&str, &str) = ("kube-system", "extension-apiserver-authentication");

#[derive(Debug, thiserror::Error)]
pub enum AuthnError {
    #[error(
        "configmap kube-system/extension-apiserver-authentication: {0} (is the kube-apiserver started with --requestheader-client-ca-file?)"
    )]
    Config(String),
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("{0}")]
    Tls(#[from] ramify_runtime::tls::TlsError),
    /// The caller is not the front proxy (or sent no user).
    #[error("{0}")]
    Unauthenticated(String),
}

/// The front proxy's settings.
#[derive(Debug, Clone)]
pub struct FrontProxy {
    /// PEM of the CA that signs the proxy's client certificate.
    pub client_ca_pem: String,
    allowed_names: Vec<String>,
    username_headers: Vec<String>,
    uid_headers: Vec<String>,
    group_headers: Vec<String>,
    extra_prefixes: Vec<String>,
}

/// The user the front proxy authenticated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    pub name: String,
    pub uid: Option<String>,
    pub groups: Vec<String>,
    pub extra: BTreeMap<String, Vec<String>>,
}

impl FrontProxy {
    /// Reads the settings from the API server's ConfigMap.
    pub async fn load(client: &kube::Client) -> Result<Self, AuthnError> {
        let api: Api<ConfigMap> = Api::namespaced(client.clone(), AUTH_CONFIG_MAP.0);
        let cm = api.get(AUTH_CONFIG_MAP.1).await?;
        Self::from_data(&cm.data.unwrap_or_default())
    }

    pub fn from_data(data: &BTreeMap<String, String>) -> Result<Self, AuthnError> {
        let client_ca_pem = data
            .get("requestheader-client-ca-file")
            .filter(|v| !v.trim().is_empty())
            .cloned()
            .ok_or_else(|| AuthnError::Config("no requestheader-client-ca-file".into()))?;
        // Lists are JSON arrays of strings; absent means empty.
        let list = |key: &str| -> Result<Vec<String>, AuthnError> {
            match data.get(key) {
                None => Ok(Vec::new()),
                Some(v) if v.trim().is_empty() => Ok(Vec::new()),
                Some(v) => {
                    serde_json::from_str(v).map_err(|e| AuthnError::Config(format!("{key}: {e}")))
                }
            }
        };
        let fp = FrontProxy {
            client_ca_pem,
            allowed_names: list("requestheader-allowed-names")?,
            username_headers: list("requestheader-username-headers")?,
            uid_headers: list("requestheader-uid-headers")?,
            group_headers: list("requestheader-group-headers")?,
            extra_prefixes: list("requestheader-extra-headers-prefix")?,
        };
        if fp.username_headers.is_empty() {
            return Err(AuthnError::Config(
                "no requestheader-username-headers".into(),
            ));
        }
        Ok(fp)
    }

    /// The roots the TLS layer verifies client certificates against.
    pub fn roots(&self) -> Result<RootCertStore, AuthnError> {
        Ok(ramify_runtime::tls::roots_from_pem(
            &self.client_ca_pem,
            "requestheader-client-ca-file",
        )?)
    }

    /// The user of a request. `cert` is the client certificate the TLS layer verified
    /// against [`FrontProxy::roots`] (`None`: the client sent none).
    pub fn user(
        &self,
        cert: Option<&CertificateDer<'_>>,
        headers: &HeaderMap,
    ) -> Result<User, AuthnError> {
        let Some(cert) = cert else {
            return Err(AuthnError::Unauthenticated(
                "no client certificate: only the kube-apiserver's front proxy may call this API"
                    .into(),
            ));
        };
        if !self.allowed_names.is_empty() {
            let cn = ramify_runtime::tls::common_name(cert).unwrap_or_default();
            if !self.allowed_names.contains(&cn) {
                return Err(AuthnError::Unauthenticated(format!(
                    "client certificate {cn:?} is not one of the front proxy's names {:?}",
                    self.allowed_names
                )));
            }
        }
        let first = |names: &[String]| {
            names
                .iter()
                .find_map(|h| headers.get(h.as_str()))
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
                .filter(|v| !v.is_empty())
        };
        let name = first(&self.username_headers)
            .ok_or_else(|| AuthnError::Unauthenticated("the front proxy sent no user".into()))?;
        let groups = self
            .group_headers
            .iter()
            .flat_map(|h| headers.get_all(h.as_str()).iter())
            .filter_map(|v| v.to_str().ok())
            .map(str::to_string)
            .collect();
        let mut extra: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (key, value) in headers {
            let lower = key.as_str();
            let Some(rest) = self
                .extra_prefixes
                .iter()
                .find_map(|p| lower.strip_prefix(p.to_ascii_lowercase().as_str()))
            else {
                continue;
            };
            // Keys are percent-encoded by the proxy (they may hold '/').
            let k = percent_encoding::percent_decode_str(rest)
                .decode_utf8_lossy()
                .to_lowercase();
            if let Ok(v) = value.to_str() {
                extra.entry(k).or_default().push(v.to_string());
            }
        }
        Ok(User {
            name,
            uid: first(&self.uid_headers),
            groups,
            extra,
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn proxy(allowed: &str) -> FrontProxy {
        let data: BTreeMap<String, String> = [
            (
                "requestheader-client-ca-file",
                "-----BEGIN CERTIFICATE-----\n",
            ),
            ("requestheader-allowed-names", allowed),
            ("requestheader-username-headers", r#"["X-Remote-User"]"#),
            ("requestheader-group-headers", r#"["X-Remote-Group"]"#),
            (
                "requestheader-extra-headers-prefix",
                r#"["X-Remote-Extra-"]"#,
            ),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        FrontProxy::from_data(&data).unwrap()
    }

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn headers_count_only_with_a_certificate() {
        let fp = proxy("[]");
        let h = headers(&[("x-remote-user", "system:admin")]);
        assert!(matches!(
            fp.user(None, &h),
            Err(AuthnError::Unauthenticated(_))
        ));
    }

    #[test]
    fn a_certificate_outside_the_allowed_names_is_refused() {
        // Not a parsable certificate: no common name, so not an allowed name.
        let fp = proxy(r#"["front-proxy-client"]"#);
        let cert = CertificateDer::from(vec![0x30, 0x00]);
        let h = headers(&[("x-remote-user", "alice")]);
        assert!(matches!(
            fp.user(Some(&cert), &h),
            Err(AuthnError::Unauthenticated(m)) if m.contains("front-proxy-client")
        ));
    }

    #[test]
    fn user_groups_and_extra_come_from_the_configured_headers() {
        let fp = proxy("");
        let cert = CertificateDer::from(vec![0x30, 0x00]);
        let h = headers(&[
            ("x-remote-user", "alice"),
            ("x-remote-group", "team-a"),
            ("x-remote-group", "system:authenticated"),
            ("x-remote-extra-scopes", "read"),
            ("x-remote-extra-example.com%2fteam", "a"),
        ]);
        let u = fp.user(Some(&cert), &h).unwrap();
        assert_eq!(u.name, "alice");
        assert_eq!(u.groups, ["team-a", "system:authenticated"]);
        assert_eq!(u.extra["scopes"], ["read"]);
        assert_eq!(u.extra["example.com/team"], ["a"]);
        assert!(matches!(
            fp.user(Some(&cert), &headers(&[("x-remote-group", "g")])),
            Err(AuthnError::Unauthenticated(_))
        ));
    }

    #[test]
    fn a_config_map_without_the_ca_is_an_error() {
        assert!(matches!(
            FrontProxy::from_data(&BTreeMap::new()),
            Err(AuthnError::Config(_))
        ));
    }
}
