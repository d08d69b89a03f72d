//! Registry credentials from `imagePullSecrets`: the `.dockerconfigjson` of each Secret
//! named (in order; the first one with an entry for the image's registry wins).
//!
//! A `.dockerconfigjson` is `{"auths": {"<host>": {"auth": base64("user:pass")}}}`, or
//! with `username`/`password` instead of `auth`. Keys may be bare hosts
//! (`127.0.0.1:5000`), URLs (`https://127.0.0.1:5000/v2/`) or Docker Hub's legacy
//! `https://index.docker.io/v1/`; they are matched by host (and port).

use std::collections::BTreeMap;

use base64::Engine as _;
use serde::Deserialize;

use super::{ImageError, Result};

/// What a pull authenticates with.
#[derive(Clone, PartialEq, Eq)]
pub enum Credentials {
    Anonymous,
    Basic { username: String, password: String },
}

impl std::fmt::Debug for Credentials {
    // Never the password, in a log or an error.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Credentials::Anonymous => f.write_str("Anonymous"),
            Credentials::Basic { username, .. } => write!(f, "Basic({username}, ***)"),
        }
    }
}

#[derive(Deserialize)]
struct DockerConfig {
    #[serde(default)]
    auths: BTreeMap<String, AuthEntry>,
}

#[derive(Deserialize)]
struct AuthEntry {
    #[serde(default)]
    auth: Option<String>,
    #[serde(default)]
    username: Option<String>,
    #[serde(default)]
    password: Option<String>,
}

/// The host (and port) a `.dockerconfigjson` key names: scheme and path dropped,
/// Docker Hub's aliases folded into `index.docker.io`.
fn key_host(key: &str) -> String {
    let k = key
        .strip_prefix("https://")
        .or_else(|| key.strip_prefix("http://"))
        .unwrap_or(key);
    let host = k.split('/').next().unwrap_or(k).to_ascii_lowercase();
    fold_hub(host)
}

fn fold_hub(host: String) -> String {
    match host.as_str() {
        "docker.io" | "registry-1.docker.io" | "index.docker.io" => "index.docker.io".into(),
        _ => host,
    }
}

/// The credentials for `registry` in one Secret's `.dockerconfigjson` (`None`: the
/// Secret has no entry for it). `secret` names the Secret in errors.
pub fn from_docker_config(
    json: &[u8],
    registry: &str,
    secret: &str,
) -> Result<Option<Credentials>> {
    let bad = |why: String| ImageError::Secret(format!("Secret {secret:?}: {why}"));
    let cfg: DockerConfig = serde_json::from_slice(json)
        .map_err(|e| bad(format!(".dockerconfigjson does not parse: {e}")))?;
    let want = fold_hub(registry.to_ascii_lowercase());
    let Some((_, entry)) = cfg.auths.iter().find(|(k, _)| key_host(k) == want) else {
        return Ok(None);
    };
    if let Some(auth) = entry.auth.as_deref().filter(|a| !a.is_empty()) {
        let raw = base64::engine::general_purpose::STANDARD
            .decode(auth.trim())
            .map_err(|e| bad(format!("auths[{registry}].auth is not base64: {e}")))?;
        let text = String::from_utf8(raw)
            .map_err(|_| bad(format!("auths[{registry}].auth is not UTF-8")))?;
        let (u, p) = text
            .split_once(':')
            .ok_or_else(|| bad(format!("auths[{registry}].auth is not user:password")))?;
        return Ok(Some(Credentials::Basic {
            username: u.into(),
            password: p.into(),
        }));
    }
    match (&entry.username, &entry.password) {
        (Some(u), Some(p)) => Ok(Some(Credentials::Basic {
            username: u.clone(),
            password: p.clone(),
        })),
        _ => Err(bad(format!(
            "auths[{registry}] has neither auth nor username and password"
        ))),
    }
}

/// A pull Secret as read: its name, type and `.dockerconfigjson` bytes.
pub type PullSecret = (String, Option<String>, Option<Vec<u8>>);

/// The credentials for `registry` from Secrets, in the order the Sandbox names them;
/// anonymous when none has an entry.
pub fn credentials_for(secrets: &[PullSecret], registry: &str) -> Result<Credentials> {
    for (name, type_, data) in secrets {
        if type_.as_deref() != Some(ramify_crds::SECRET_TYPE_DOCKERCONFIGJSON) {
            return Err(ImageError::Secret(format!(
                "Secret {name:?} is of type {:?}, not {}",
                type_.as_deref().unwrap_or(""),
                ramify_crds::SECRET_TYPE_DOCKERCONFIGJSON
            )));
        }
        let data = data.as_deref().ok_or_else(|| {
            ImageError::Secret(format!(
                "Secret {name:?} has no {} key",
                ramify_crds::SECRET_KEY_DOCKERCONFIGJSON
            ))
        })?;
        if let Some(c) = from_docker_config(data, registry, name)? {
            return Ok(c);
        }
    }
    Ok(Credentials::Anonymous)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn b64(s: &str) -> String {
        base64::engine::general_purpose::STANDARD.encode(s)
    }

    #[test]
    fn auth_and_username_password_forms_match_by_host() {
        let cfg = format!(
            r#"{{"auths":{{"https://127.0.0.1:5000/v2/":{{"auth":"{}"}},"other:1":{{"username":"u","password":"p"}}}}}}"#,
            b64("alice:s3:cret")
        );
        assert_eq!(
            from_docker_config(cfg.as_bytes(), "127.0.0.1:5000", "s").unwrap(),
            Some(Credentials::Basic {
                username: "alice".into(),
                password: "s3:cret".into()
            })
        );
        assert_eq!(
            from_docker_config(cfg.as_bytes(), "other:1", "s").unwrap(),
            Some(Credentials::Basic {
                username: "u".into(),
                password: "p".into()
            })
        );
        // Another port is another registry.
        assert_eq!(
            from_docker_config(cfg.as_bytes(), "127.0.0.1:5001", "s").unwrap(),
            None
        );
        let hub = format!(
            r#"{{"auths":{{"https://index.docker.io/v1/":{{"auth":"{}"}}}}}}"#,
            b64("a:b")
        );
        assert!(
            from_docker_config(hub.as_bytes(), "index.docker.io", "s")
                .unwrap()
                .is_some()
        );
    }

    #[test]
    fn malformed_secrets_are_errors_naming_the_secret_and_never_the_password() {
        for cfg in [
            "not json",
            r#"{"auths":{"h":{"auth":"!!!"}}}"#,
            r#"{"auths":{"h":{}}}"#,
        ] {
            let e = from_docker_config(cfg.as_bytes(), "h", "regcred").unwrap_err();
            assert!(e.to_string().contains("\"regcred\""), "{e}");
            assert!(!e.is_permanent());
        }
        let no_colon = format!(r#"{{"auths":{{"h":{{"auth":"{}"}}}}}}"#, b64("nocolon"));
        assert!(from_docker_config(no_colon.as_bytes(), "h", "s").is_err());
        let c = Credentials::Basic {
            username: "u".into(),
            password: "hunter2".into(),
        };
        assert!(!format!("{c:?}").contains("hunter2"));
    }

    #[test]
    fn secrets_are_tried_in_order_and_must_be_dockerconfigjson() {
        let t = Some(ramify_crds::SECRET_TYPE_DOCKERCONFIGJSON.to_string());
        let other = br#"{"auths":{"elsewhere":{"username":"x","password":"y"}}}"#.to_vec();
        let ours = br#"{"auths":{"h:1":{"username":"u","password":"p"}}}"#.to_vec();
        let got = credentials_for(
            &[
                ("a".into(), t.clone(), Some(other.clone())),
                ("b".into(), t.clone(), Some(ours)),
            ],
            "h:1",
        )
        .unwrap();
        assert!(matches!(got, Credentials::Basic { ref username, .. } if username == "u"));
        assert_eq!(
            credentials_for(&[("a".into(), t.clone(), Some(other))], "h:1").unwrap(),
            Credentials::Anonymous
        );
        let e = credentials_for(&[("o".into(), Some("Opaque".into()), None)], "h:1").unwrap_err();
        assert!(e.to_string().contains("Opaque"), "{e}");
        let e = credentials_for(&[("m".into(), t, None)], "h:1").unwrap_err();
        assert!(e.to_string().contains(".dockerconfigjson"), "{e}");
    }
}
