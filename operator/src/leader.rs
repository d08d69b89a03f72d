//! Leader election on a `coordination.k8s.io/v1` Lease, so two operator replicas are
//! safe: only the holder reconciles. Acquisition and renewal use optimistic
//! concurrency (the Lease's resourceVersion), so two candidates can never both win.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::Client;
use kube::api::{Api, PostParams};
use tracing::{info, warn};

use crate::error::{Error, Result, is_not_found};

/// Leader election settings.
#[derive(Clone, Debug)]
pub struct LeaderConfig {
    pub namespace: String,
    pub lease_name: String,
    pub identity: String,
    pub lease_duration: Duration,
}

impl LeaderConfig {
    fn renew_every(&self) -> Duration {
        self.lease_duration / 3
    }
}

/// Whether a lease held by someone else has expired.
pub fn expired(spec: &LeaseSpec, now: Timestamp) -> bool {
    let Some(renew) = spec.renew_time.as_ref() else {
        return true;
    };
    let secs = i64::from(spec.lease_duration_seconds.unwrap_or(15));
    renew.0 + SignedDuration::from_secs(secs) < now
}

/// One attempt to take or renew the lease. `Ok(true)` when we hold it afterwards.
pub async fn try_acquire(client: &Client, cfg: &LeaderConfig) -> Result<bool> {
    let api: Api<Lease> = Api::namespaced(client.clone(), &cfg.namespace);
    let now = Timestamp::now();
    let duration_secs = i32::try_from(cfg.lease_duration.as_secs()).unwrap_or(15);
    match api.get_opt(&cfg.lease_name).await? {
        None => {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(cfg.lease_name.clone()),
                    namespace: Some(cfg.namespace.clone()),
                    ..Default::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(cfg.identity.clone()),
                    lease_duration_seconds: Some(duration_secs),
                    acquire_time: Some(MicroTime(now)),
                    renew_time: Some(MicroTime(now)),
                    lease_transitions: Some(0),
                    ..Default::default()
                }),
            };
            match api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
                Err(e) => Err(e.into()),
            }
        }
        Some(mut lease) => {
            let spec = lease.spec.get_or_insert_with(Default::default);
            let ours = spec.holder_identity.as_deref() == Some(cfg.identity.as_str());
            if !ours && !expired(spec, now) {
                return Ok(false);
            }
            if !ours {
                spec.holder_identity = Some(cfg.identity.clone());
                spec.acquire_time = Some(MicroTime(now));
                spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
            }
            spec.renew_time = Some(MicroTime(now));
            spec.lease_duration_seconds = Some(duration_secs);
            // replace() sends the resourceVersion we read: a concurrent writer makes it 409.
            match api
                .replace(&cfg.lease_name, &PostParams::default(), &lease)
                .await
            {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
                Err(e) if is_not_found(&e) => Ok(false),
                Err(e) => Err(e.into()),
            }
        }
    }
}

/// Blocks until this replica holds the lease.
pub async fn acquire(client: &Client, cfg: &LeaderConfig) {
    loop {
        match try_acquire(client, cfg).await {
            Ok(true) => {
                info!(identity = %cfg.identity, lease = %cfg.lease_name, "became leader");
                return;
            }
            Ok(false) => {}
            Err(e) => warn!(error = %e, "leader election attempt failed"),
        }
        tokio::time::sleep(cfg.renew_every()).await;
    }
}

/// Renews the lease until a renewal fails for a whole lease duration; then returns the
/// error, and the caller must stop reconciling (another replica may take over).
pub async fn hold(client: &Client, cfg: &LeaderConfig) -> Error {
    let mut last_ok = tokio::time::Instant::now();
    loop {
        tokio::time::sleep(cfg.renew_every()).await;
        match try_acquire(client, cfg).await {
            Ok(true) => last_ok = tokio::time::Instant::now(),
            Ok(false) => return Error::Invalid("leader lease was taken by another replica".into()),
            Err(e) => {
                warn!(error = %e, "lease renewal failed");
                if last_ok.elapsed() >= cfg.lease_duration {
                    return e;
                }
            }
        }
    }
}
