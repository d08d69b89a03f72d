//! Executors of released effects. Each effect is executed at most once per executor
//! attempt and every attempt carries the same identity: a Job is named after the
//! BranchSet and the effect (creating it twice is refused by the API server), and a
//! webhook POST carries an `Idempotency-Key` that is the same on every retry.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use k8s_openapi::api::batch::v1::Job;
use kube::api::{Api, PostParams};
use kube::{Client, Resource, ResourceExt};
use ramify_crds::{BranchSet, EffectStatus, Executor, JobExecutor, LABEL_BRANCHSET};
use serde_json::json;

/// What an attempt came to.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Done; the message says how (HTTP status, Job name).
    Executed {
        message: String,
        job: Option<String>,
    },
    /// Refused for good (4xx, an invalid Job); not retried.
    Refused(String),
    /// Not now (5xx, unreachable): retry later with the same identity.
    Retry(String),
}

/// The name of the Job that runs an effect: stable, DNS-safe, short. The effect id is
/// hashed with SHA-256 (not `DefaultHasher`, whose output may change between Rust
/// releases): an upgraded operator must find the Job an earlier build created for an
/// effect still marked Executing, never create a second one.
pub fn job_name(bs: &str, effect_id: &str) -> String {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(effect_id.as_bytes());
    let prefix: String = bs.chars().take(40).collect();
    format!("{prefix}-fx-{}", hex::encode(&digest[..6]))
}

/// The idempotency key of an effect: the BranchSet's uid and the effect's id.
pub fn idempotency_key(bs: &BranchSet, e: &EffectStatus) -> String {
    format!("{}/{}", bs.uid().unwrap_or_default(), e.id)
}

/// Executes one effect.
pub async fn execute(
    client: &Client,
    bs: &BranchSet,
    executor: &Executor,
    e: &EffectStatus,
) -> Outcome {
    match (&executor.webhook, &executor.job) {
        (Some(w), _) => webhook(&w.url, bs, e).await,
        (None, Some(j)) => job(client, bs, j, e).await,
        (None, None) => Outcome::Refused("the executor names neither a webhook nor a job".into()),
    }
}

async fn job(client: &Client, bs: &BranchSet, spec: &JobExecutor, e: &EffectStatus) -> Outcome {
    let ns = bs.namespace().unwrap_or_default();
    let name = job_name(&bs.name_any(), &e.id);
    let owner = bs.controller_owner_ref(&());
    let job: Job = match serde_json::from_value(json!({
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": name,
            "namespace": ns,
            "labels": {LABEL_BRANCHSET: bs.name_any(), "ramify.dev/effect": "true"},
            "ownerReferences": owner.map(|o| vec![o]),
        },
        "spec": {
            "backoffLimit": 0,
            "template": {"spec": {
                "restartPolicy": "Never",
                "serviceAccountName": spec.service_account_name,
                "containers": [{
                    "name": "effect",
                    "image": spec.image,
                    "command": if spec.command.is_empty() { None } else { Some(&spec.command) },
                    "env": [
                        {"name": "RAMIFY_EFFECT_ID", "value": e.id},
                        {"name": "RAMIFY_EFFECT_KIND", "value": e.kind},
                        {"name": "RAMIFY_EFFECT_PAYLOAD", "value": e.payload},
                    ],
                }],
            }},
        },
    })) {
        Ok(j) => j,
        Err(err) => return Outcome::Refused(format!("job template: {err}")),
    };
    let api: Api<Job> = Api::namespaced(client.clone(), &ns);
    match api.create(&PostParams::default(), &job).await {
        Ok(_) => Outcome::Executed {
            message: format!("job {name} created"),
            job: Some(name),
        },
        // Created by an earlier attempt (an operator restarted in between): done, once.
        Err(kube::Error::Api(s)) if s.code == 409 => Outcome::Executed {
            message: format!("job {name} exists (created by an earlier attempt)"),
            job: Some(name),
        },
        Err(kube::Error::Api(s)) if (400..500).contains(&s.code) => {
            Outcome::Refused(s.message.clone())
        }
        Err(err) => Outcome::Retry(err.to_string()),
    }
}

async fn webhook(url: &str, bs: &BranchSet, e: &EffectStatus) -> Outcome {
    let connector = match hyper_rustls::HttpsConnectorBuilder::new().with_native_roots() {
        Ok(b) => b.https_or_http().enable_http1().build(),
        Err(err) => return Outcome::Retry(format!("TLS roots: {err}")),
    };
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build::<_, Full<Bytes>>(connector);
    let body = json!({
        "id": e.id,
        "branchSet": bs.name_any(),
        "namespace": bs.namespace(),
        "branch": e.branch,
        "kind": e.kind,
        "payload": serde_json::from_str::<serde_json::Value>(&e.payload).unwrap_or(serde_json::Value::Null),
    });
    let req = match http::Request::post(url)
        .header("content-type", "application/json")
        .header("idempotency-key", idempotency_key(bs, e))
        .body(Full::new(Bytes::from(body.to_string())))
    {
        Ok(r) => r,
        Err(err) => return Outcome::Refused(format!("bad webhook request: {err}")),
    };
    match tokio::time::timeout(Duration::from_secs(10), client.request(req)).await {
        Err(_) => Outcome::Retry(format!("{url}: no answer within 10s")),
        Ok(Err(err)) => Outcome::Retry(format!("{url}: {err}")),
        Ok(Ok(resp)) => {
            let status = resp.status();
            let text = resp
                .into_body()
                .collect()
                .await
                .map(|b| {
                    String::from_utf8_lossy(&b.to_bytes())
                        .chars()
                        .take(200)
                        .collect::<String>()
                })
                .unwrap_or_default();
            if status.is_success() {
                Outcome::Executed {
                    message: format!("webhook answered {status}"),
                    job: None,
                }
            } else if status.is_client_error() {
                Outcome::Refused(format!("webhook answered {status}: {text}"))
            } else {
                Outcome::Retry(format!("webhook answered {status}: {text}"))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_names_are_stable_dns_labels() {
        let a = job_name("try-fixes", "fix-b/01-deploy.json");
        assert_eq!(a, job_name("try-fixes", "fix-b/01-deploy.json"));
        assert_ne!(a, job_name("try-fixes", "fix-b/02-deploy.json"));
        assert!(
            a.len() <= 63
                && a.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'),
            "{a}"
        );
        assert!(job_name(&"x".repeat(200), "a/b").len() <= 63);
    }

    /// The name is a fixed function of its inputs, the same in every build: the first
    /// 48 bits of SHA-256("fix-b/01-deploy.json"), as `sha256sum` prints them.
    #[test]
    fn job_names_do_not_depend_on_the_build() {
        assert_eq!(
            job_name("try-fixes", "fix-b/01-deploy.json"),
            "try-fixes-fx-f92b98327c2c"
        );
    }
}
