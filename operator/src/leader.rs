//! Leader election on a `coordination.k8s.io/v1` Lease, so two operator replicas are
//! safe: only the holder reconciles. Acquisition and renewal use optimistic
//! concurrency (the Lease's resourceVersion), so two candidates can never both win.
//!
//! As in client-go, a candidate judges a lease held by another replica from when it
//! last saw the lease *change*, on its own monotonic clock: it never compares the
//! holder's `renewTime` with its own wall clock, so clock skew between replicas can
//! neither make a live holder look expired nor a dead one look alive. The holder steps
//! down when no renewal succeeded within the renew deadline (shorter than the lease
//! duration, and every attempt is cut off at it: a hung API call cannot keep a replica
//! leading after its lease expired in the others' eyes).

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, PostParams};
use tokio::time::Instant;
use tracing::{info, warn};

use crate::error::{Error, Result, is_not_found};

/// Leader election settings.
#[derive(Clone, Debug)]
pub struct LeaderConfig {
    pub namespace: String,
    pub lease_name: String,
    pub identity: String,
    /// How long others wait, from the last change they saw, before taking over.
    pub lease_duration: Duration,
    /// The holder steps down when no renewal succeeded for this long.
    pub renew_deadline: Duration,
    /// Pause between attempts (to acquire, or to renew).
    pub retry_period: Duration,
}

impl LeaderConfig {
    /// client-go's proportions: for a 15 s lease, renew within 10 s, try every 2 s.
    pub fn new(
        namespace: &str,
        lease_name: &str,
        identity: &str,
        lease_duration: Duration,
    ) -> Self {
        Self {
            namespace: namespace.into(),
            lease_name: lease_name.into(),
            identity: identity.into(),
            lease_duration,
            renew_deadline: lease_duration * 2 / 3,
            retry_period: lease_duration * 2 / 15,
        }
    }
}

/// The part of a lease that changes with every renewal or transition.
#[derive(Clone, Debug, PartialEq)]
struct Record {
    holder: Option<String>,
    renew_time: Option<MicroTime>,
    acquire_time: Option<MicroTime>,
    transitions: Option<i32>,
    duration_seconds: Option<i32>,
}

impl Record {
    fn of(spec: &LeaseSpec) -> Self {
        Self {
            holder: spec.holder_identity.clone(),
            renew_time: spec.renew_time.clone(),
            acquire_time: spec.acquire_time.clone(),
            transitions: spec.lease_transitions,
            duration_seconds: spec.lease_duration_seconds,
        }
    }
}

/// What this replica last saw of the lease, and when by its own monotonic clock.
#[derive(Debug, Default)]
pub struct Observation {
    last: Option<(Record, Instant)>,
}

impl Observation {
    /// Records the lease as read at `now`: its observed time moves only when the
    /// record changed since the last read.
    pub fn observe(&mut self, spec: &LeaseSpec, now: Instant) {
        let record = Record::of(spec);
        match &self.last {
            Some((r, _)) if *r == record => {}
            _ => self.last = Some((record, now)),
        }
    }

    /// Whether the lease last observed is free to take at `now`: nobody holds it, or
    /// it has not changed for the duration its holder declared (`default` if none).
    pub fn expired(&self, now: Instant, default: Duration) -> bool {
        let Some((record, seen)) = &self.last else {
            return false;
        };
        if record.holder.as_deref().is_none_or(str::is_empty) {
            return true;
        }
        let duration = record
            .duration_seconds
            .and_then(|s| u64::try_from(s).ok())
            .map_or(default, Duration::from_secs);
        now.duration_since(*seen) >= duration
    }

    /// The holder last observed.
    pub fn holder(&self) -> Option<&str> {
        self.last.as_ref().and_then(|(r, _)| r.holder.as_deref())
    }
}

/// One replica's side of the election.
pub struct Elector {
    client: Client,
    cfg: LeaderConfig,
    observed: Observation,
}

impl Elector {
    pub fn new(client: Client, cfg: LeaderConfig) -> Self {
        Self {
            client,
            cfg,
            observed: Observation::default(),
        }
    }

    /// One attempt to take or renew the lease. `Ok(true)` when we hold it afterwards.
    pub async fn try_acquire_or_renew(&mut self) -> Result<bool> {
        let api: Api<Lease> = Api::namespaced(self.client.clone(), &self.cfg.namespace);
        let cfg = self.cfg.clone();
        let cfg = &cfg;
        let wall = Timestamp::now();
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
                        acquire_time: Some(MicroTime(wall)),
                        renew_time: Some(MicroTime(wall)),
                        lease_transitions: Some(0),
                        ..Default::default()
                    }),
                };
                match api.create(&PostParams::default(), &lease).await {
                    Ok(created) => {
                        self.observe(&created);
                        Ok(true)
                    }
                    Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
                    Err(e) => Err(e.into()),
                }
            }
            Some(mut lease) => {
                self.observe(&lease);
                let spec = lease.spec.get_or_insert_with(Default::default);
                let ours = spec.holder_identity.as_deref() == Some(cfg.identity.as_str());
                if !ours && !self.observed.expired(Instant::now(), cfg.lease_duration) {
                    return Ok(false);
                }
                if !ours {
                    spec.holder_identity = Some(cfg.identity.clone());
                    spec.acquire_time = Some(MicroTime(wall));
                    spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
                }
                // For people and tools reading the lease; no replica decides by it.
                spec.renew_time = Some(MicroTime(wall));
                spec.lease_duration_seconds = Some(duration_secs);
                // replace() sends the resourceVersion we read: a concurrent writer makes it 409.
                match api
                    .replace(&cfg.lease_name, &PostParams::default(), &lease)
                    .await
                {
                    Ok(written) => {
                        self.observe(&written);
                        Ok(true)
                    }
                    Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
                    Err(e) if is_not_found(&e) => Ok(false),
                    Err(e) => Err(e.into()),
                }
            }
        }
    }

    fn observe(&mut self, lease: &Lease) {
        if let Some(spec) = &lease.spec {
            self.observed.observe(spec, Instant::now());
        }
    }

    /// Blocks until this replica holds the lease.
    pub async fn acquire(&mut self) {
        loop {
            let attempt =
                tokio::time::timeout(self.cfg.renew_deadline, self.try_acquire_or_renew()).await;
            match attempt {
                Ok(Ok(true)) => {
                    info!(identity = %self.cfg.identity, lease = %self.cfg.lease_name, "became leader");
                    return;
                }
                Ok(Ok(false)) => {}
                Ok(Err(e)) => warn!(error = %e, "leader election attempt failed"),
                Err(_) => {
                    warn!(timeout = ?self.cfg.renew_deadline, "leader election attempt timed out")
                }
            }
            tokio::time::sleep(self.cfg.retry_period).await;
        }
    }

    /// Renews the lease until that fails: another replica took it, or no renewal
    /// succeeded within the renew deadline (each attempt is cut off there). Returns why;
    /// the caller must stop reconciling at once.
    pub async fn hold(&mut self) -> Error {
        let mut renewed = Instant::now();
        loop {
            tokio::time::sleep(self.cfg.retry_period).await;
            let deadline = renewed + self.cfg.renew_deadline;
            match tokio::time::timeout_at(deadline, self.try_acquire_or_renew()).await {
                Ok(Ok(true)) => renewed = Instant::now(),
                Ok(Ok(false)) => {
                    return Error::LeadershipLost(format!(
                        "the lease is held by {}",
                        self.observed.holder().unwrap_or("another replica")
                    ));
                }
                Ok(Err(e)) => {
                    warn!(error = %e, "lease renewal failed");
                    if Instant::now() >= deadline {
                        return Error::LeadershipLost(format!(
                            "no renewal succeeded within {:?}: {e}",
                            self.cfg.renew_deadline
                        ));
                    }
                }
                Err(_) => {
                    return Error::LeadershipLost(format!(
                        "no renewal succeeded within {:?} (the last attempt hung)",
                        self.cfg.renew_deadline
                    ));
                }
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use k8s_openapi::jiff::SignedDuration;

    fn spec(holder: &str, renew: Timestamp) -> LeaseSpec {
        LeaseSpec {
            holder_identity: Some(holder.into()),
            lease_duration_seconds: Some(15),
            renew_time: Some(MicroTime(renew)),
            ..Default::default()
        }
    }

    const LEASE: Duration = Duration::from_secs(15);

    #[test]
    fn a_live_holder_whose_clock_is_behind_keeps_its_lease() {
        // The holder's clock is an hour behind ours: every renewTime it writes looks
        // long expired by our clock (the old rule took the lease at once).
        let t0 = Instant::now();
        let mut o = Observation::default();
        let behind = Timestamp::now() - SignedDuration::from_hours(1);
        for i in 0..20u32 {
            let now = t0 + Duration::from_secs(5) * i;
            o.observe(
                &spec(
                    "other",
                    behind + SignedDuration::from_secs(5 * i64::from(i)),
                ),
                now,
            );
            assert!(
                !o.expired(now, LEASE),
                "taken from a live holder at renewal {i}"
            );
        }
    }

    #[test]
    fn a_dead_holder_whose_clock_was_ahead_loses_its_lease_after_the_duration() {
        // The holder's clock was an hour ahead: its last renewTime is in our future (the
        // old rule would have waited an hour). It stopped renewing: the record no
        // longer changes, so the lease is free one lease duration after we first saw it.
        let t0 = Instant::now();
        let mut o = Observation::default();
        let ahead = spec("other", Timestamp::now() + SignedDuration::from_hours(1));
        o.observe(&ahead, t0);
        o.observe(&ahead, t0 + Duration::from_secs(10));
        assert!(!o.expired(t0 + Duration::from_secs(14), LEASE));
        o.observe(&ahead, t0 + Duration::from_secs(15));
        assert!(o.expired(t0 + Duration::from_secs(15), LEASE));
    }

    #[test]
    fn a_change_restarts_the_wait_and_a_free_lease_is_free_at_once() {
        let t0 = Instant::now();
        let mut o = Observation::default();
        // Nothing observed yet: never presumed free.
        assert!(!o.expired(t0, LEASE));
        let now = Timestamp::now();
        o.observe(&spec("a", now), t0);
        o.observe(&spec("b", now), t0 + Duration::from_secs(14));
        assert!(!o.expired(t0 + Duration::from_secs(20), LEASE));
        assert!(o.expired(t0 + Duration::from_secs(29), LEASE));
        assert_eq!(o.holder(), Some("b"));
        // The holder's declared duration counts, not ours.
        let mut short = spec("c", now);
        short.lease_duration_seconds = Some(2);
        o.observe(&short, t0);
        assert!(o.expired(t0 + Duration::from_secs(2), LEASE));
        // Released (no holder): free now.
        o.observe(&LeaseSpec::default(), t0);
        assert!(o.expired(t0, LEASE));
    }

    #[test]
    fn the_renew_deadline_is_shorter_than_the_lease() {
        let c = LeaderConfig::new("ns", "l", "me", LEASE);
        assert_eq!(c.renew_deadline, Duration::from_secs(10));
        assert_eq!(c.retry_period, Duration::from_secs(2));
        assert!(c.renew_deadline + c.retry_period < c.lease_duration);
    }

    /// An API server that accepts connections and never answers: a renewal against it
    /// hangs. The holder must step down within the renew deadline (the old `hold`
    /// waited on the hung call for ever, leading after its lease had expired).
    #[tokio::test]
    async fn a_hung_renewal_ends_leadership_within_the_renew_deadline() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let sink = tokio::spawn(async move {
            let mut held = Vec::new();
            loop {
                let (conn, _) = listener.accept().await.unwrap();
                held.push(conn);
            }
        });
        let config = kube::Config::new(format!("http://{addr}").parse().unwrap());
        let client = Client::try_from(config).unwrap();
        let cfg = LeaderConfig {
            renew_deadline: Duration::from_millis(1500),
            retry_period: Duration::from_millis(200),
            ..LeaderConfig::new("ns", "lease", "me", Duration::from_secs(3))
        };
        let mut elector = Elector::new(client, cfg.clone());
        let t0 = std::time::Instant::now();
        let err = tokio::time::timeout(Duration::from_secs(20), elector.hold())
            .await
            .expect("hold() never returned: a hung renewal kept this replica leading");
        let took = t0.elapsed();
        assert!(matches!(err, Error::LeadershipLost(_)), "{err:?}");
        assert!(
            took >= cfg.renew_deadline && took < cfg.lease_duration,
            "stepped down after {took:?} (deadline {:?}, lease {:?})",
            cfg.renew_deadline,
            cfg.lease_duration
        );
        assert_eq!(err.category(), "leadership");
        sink.abort();
    }
}
