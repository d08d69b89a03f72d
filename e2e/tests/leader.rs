//! The operator's leader election against a real kube-apiserver: one replica leads, a
//! second takes over only after the lease went unchanged for its duration (by the
//! second's own clock), a live holder whose clock is skewed keeps its lease, and a
//! holder whose lease was taken steps down with `LeadershipLost`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::Client;
use kube::api::{Api, PostParams};
use ramify_e2e::{ControlPlane, TestNamespace};
use ramify_operator::error::Error;
use ramify_operator::leader::{Elector, LeaderConfig};
use serde_json::json;

const LEASE: Duration = Duration::from_secs(3);

fn config(ns: &str, identity: &str) -> LeaderConfig {
    LeaderConfig {
        renew_deadline: Duration::from_secs(2),
        retry_period: Duration::from_millis(300),
        ..LeaderConfig::new(ns, "ramify-operator", identity, LEASE)
    }
}

async fn setup(prefix: &str) -> (Client, TestNamespace) {
    let cp = ControlPlane::ensure().expect("control plane");
    let client = cp.client().await.expect("client");
    let ns = TestNamespace::create(&client, prefix)
        .await
        .expect("namespace");
    (client, ns)
}

async fn holder(client: &Client, ns: &str) -> Option<String> {
    let api: Api<Lease> = Api::namespaced(client.clone(), ns);
    api.get("ramify-operator")
        .await
        .unwrap()
        .spec?
        .holder_identity
}

/// Tries to take the lease every retry period for `for_`; returns when it was taken.
async fn try_for(e: &mut Elector, for_: Duration) -> Option<Instant> {
    let deadline = Instant::now() + for_;
    while Instant::now() < deadline {
        if e.try_acquire_or_renew().await.unwrap() {
            return Some(Instant::now());
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    None
}

#[tokio::test]
async fn a_second_replica_takes_over_only_after_the_leader_stopped_renewing() {
    let (client, ns) = setup("leader").await;
    let mut a = Elector::new(client.clone(), config(&ns.name, "replica-a"));
    tokio::time::timeout(Duration::from_secs(10), a.acquire())
        .await
        .expect("the first replica never became leader");
    let leading = tokio::spawn(async move { a.hold().await });

    // While the leader renews, the other never gets the lease.
    let mut b = Elector::new(client.clone(), config(&ns.name, "replica-b"));
    assert_eq!(
        try_for(&mut b, LEASE * 2).await,
        None,
        "took the lease of a live leader"
    );
    assert_eq!(
        holder(&client, &ns.name).await.as_deref(),
        Some("replica-a")
    );

    // The leader dies without a word: the lease goes stale.
    leading.abort();
    let stopped = Instant::now();
    let took = try_for(&mut b, LEASE * 4)
        .await
        .expect("the lease of a dead leader was never taken");
    let after = took.duration_since(stopped);
    // Its last renewal was at most one retry period before it stopped.
    assert!(
        after >= LEASE - Duration::from_millis(400),
        "taken {after:?} after the leader stopped, before the lease ran out"
    );
    assert!(
        after < LEASE * 3,
        "taken only {after:?} after the leader stopped"
    );
    assert_eq!(
        holder(&client, &ns.name).await.as_deref(),
        Some("replica-b")
    );
    ns.delete().await.unwrap();
}

/// The holder's clock is an hour behind: every renewTime it writes looks long expired
/// to a replica that compares it with its own clock (the old rule took the lease at
/// once). It keeps renewing, so the lease keeps changing: it is never taken.
#[tokio::test]
async fn a_live_holder_whose_clock_is_behind_keeps_its_lease() {
    let (client, ns) = setup("leader-skew").await;
    let api: Api<Lease> = Api::namespaced(client.clone(), &ns.name);
    let lease: Lease = serde_json::from_value(json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": "ramify-operator", "namespace": ns.name},
        "spec": {"holderIdentity": "skewed", "leaseDurationSeconds": LEASE.as_secs()},
    }))
    .unwrap();
    api.create(&PostParams::default(), &lease).await.unwrap();
    let renewing = tokio::spawn({
        let api = api.clone();
        async move {
            loop {
                let mut l = api.get("ramify-operator").await.unwrap();
                let behind = Timestamp::now() - SignedDuration::from_hours(1);
                l.spec.as_mut().unwrap().renew_time = Some(MicroTime(behind));
                // A conflict with the candidate's write is fine: it lost.
                let _ = api
                    .replace("ramify-operator", &PostParams::default(), &l)
                    .await;
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    });
    let mut b = Elector::new(client.clone(), config(&ns.name, "replica-b"));
    let taken = try_for(&mut b, LEASE * 3).await;
    renewing.abort();
    assert_eq!(
        taken, None,
        "took the lease of a live holder with a skewed clock"
    );
    assert_eq!(holder(&client, &ns.name).await.as_deref(), Some("skewed"));
    // Stopped renewing: free after the lease duration, by the candidate's clock.
    assert!(
        try_for(&mut b, LEASE * 4).await.is_some(),
        "a stale lease was never taken"
    );
    ns.delete().await.unwrap();
}

#[tokio::test]
async fn a_leader_whose_lease_was_taken_steps_down_with_leadership_lost() {
    let (client, ns) = setup("leader-lost").await;
    let mut a = Elector::new(client.clone(), config(&ns.name, "replica-a"));
    tokio::time::timeout(Duration::from_secs(10), a.acquire())
        .await
        .expect("never became leader");
    let leading = tokio::spawn(async move { a.hold().await });
    // Someone else writes the lease as its own (an operator of another build, a person).
    let api: Api<Lease> = Api::namespaced(client.clone(), &ns.name);
    let mut l = api.get("ramify-operator").await.unwrap();
    let spec = l.spec.as_mut().unwrap();
    spec.holder_identity = Some("intruder".into());
    spec.renew_time = Some(MicroTime(Timestamp::now()));
    api.replace("ramify-operator", &PostParams::default(), &l)
        .await
        .unwrap();
    let err = tokio::time::timeout(LEASE * 2, leading)
        .await
        .expect("the leader kept leading on a lease held by another")
        .unwrap();
    match err {
        Error::LeadershipLost(why) => assert!(why.contains("intruder"), "{why}"),
        other => panic!("lost the lease as {other:?}, not LeadershipLost"),
    }
    ns.delete().await.unwrap();
}
