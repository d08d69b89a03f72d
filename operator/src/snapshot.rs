//! Snapshot reconciler: adds the node-cleanup finalizer, binds each Snapshot to the
//! node that runs its source sandbox, labels one that asks other nodes for warm pools,
//! records capture metrics and deletes expired snapshots (TTL). The node agent
//! captures and reports.

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::core::DeserializeGuard;
use kube::runtime::controller::Action;
use kube::{Resource, ResourceExt};
use ramify_crds::{
    Condition, ConditionStatus, ConditionsExt, FINALIZER_NODE_CLEANUP, LABEL_WARM_ELSEWHERE,
    Snapshot, SnapshotPhase,
};
use serde_json::json;
use tracing::instrument;

use crate::context::Context;
use crate::error::Result;

pub const CONTROLLER: &str = "snapshot";

/// Reconciles one Snapshot.
#[instrument(skip_all, fields(snapshot = %obj.name_any(), ns = obj.namespace().unwrap_or_default()))]
pub async fn reconcile(obj: Arc<DeserializeGuard<Snapshot>>, ctx: Arc<Context>) -> Result<Action> {
    let started = Instant::now();
    let res = match &obj.0 {
        Ok(snap) => reconcile_snapshot(snap, &ctx).await,
        Err(invalid) => {
            crate::report_invalid(&ctx, "Snapshot", invalid).await;
            Ok(Action::await_change())
        }
    };
    ctx.metrics.reconciled(CONTROLLER, started.elapsed());
    res
}

async fn reconcile_snapshot(snap: &Snapshot, ctx: &Context) -> Result<Action> {
    let ns = snap.namespace().unwrap_or_default();
    let name = snap.name_any();
    let api: Api<Snapshot> = Api::namespaced(ctx.client.clone(), &ns);
    let status = snap.status.clone().unwrap_or_default();

    if snap.metadata.deletion_timestamp.is_some() {
        crate::metrics::forget_phase(&ctx.metrics, "Snapshot", &ns, &name);
        if snap
            .finalizers()
            .iter()
            .any(|f| f == FINALIZER_NODE_CLEANUP)
        {
            let release = match &status.node_name {
                None => true,
                Some(node) => crate::node_lost_for(ctx, node).await? > ctx.settings.node_lost_grace,
            };
            if release {
                crate::remove_finalizer(&api, snap).await?;
            } else {
                return Ok(Action::requeue(Duration::from_secs(30)));
            }
        }
        return Ok(Action::await_change());
    }
    if !snap
        .finalizers()
        .iter()
        .any(|f| f == FINALIZER_NODE_CLEANUP)
    {
        crate::add_finalizer(&api, snap).await?;
        return Ok(Action::await_change());
    }

    // Pools asked of other nodes: their agents watch the Snapshots so labelled (the
    // label stays, so they see the list shrink too).
    let elsewhere = snap
        .spec
        .warm_pool
        .as_ref()
        .is_some_and(|w| !w.nodes.is_empty());
    if elsewhere && snap.labels().get(LABEL_WARM_ELSEWHERE).map(String::as_str) != Some("true") {
        let label = json!({"metadata": {"labels": {LABEL_WARM_ELSEWHERE: "true"}}});
        api.patch_metadata(&name, &PatchParams::default(), &Patch::Merge(&label))
            .await?;
    }

    crate::metrics::set_phase(
        &ctx.metrics,
        "Snapshot",
        &format!("{:?}", status.phase),
        &ns,
        &name,
    );

    if status.phase == SnapshotPhase::Ready {
        // Cluster mode: its warm pool's Pods.
        let pool = crate::warm_pods::keep(snap, ctx, CONTROLLER).await?;
        if let (Some(ttl), Some(at)) = (snap.spec.ttl_seconds, status.captured_at.as_ref()) {
            let expires = at.0 + SignedDuration::from_secs(ttl);
            let now = Timestamp::now();
            if now >= expires {
                ctx.event(
                    &snap.object_ref(&()),
                    false,
                    ramify_crds::REASON_EXPIRED,
                    format!("TTL of {ttl}s passed; deleting"),
                )
                .await;
                api.delete(&name, &DeleteParams::background()).await?;
                return Ok(Action::await_change());
            }
            let wait: Duration = expires.duration_since(now).try_into().unwrap_or_default();
            let wait = wait + Duration::from_millis(100);
            return Ok(Action::requeue(pool.map_or(wait, |p| p.min(wait))));
        }
        return Ok(pool.map_or_else(Action::await_change, Action::requeue));
    }
    if status.node_name.is_some() {
        return Ok(Action::await_change());
    }

    // Bind to the node that runs the source.
    ctx.cache.synced().await?;
    let source = ctx.cache.sandbox(&ns, &snap.spec.source.sandbox);
    let node = source
        .as_ref()
        .and_then(|s| s.status.as_ref())
        .and_then(|s| s.node_name.clone());
    let mut conditions = status.conditions.clone();
    let (cond, node) = match node {
        Some(node) => (
            Condition::new(
                "Scheduled",
                ConditionStatus::True,
                "Bound",
                format!("capturing on node {node}"),
                snap.metadata.generation,
            ),
            Some(node),
        ),
        None => {
            let why = if source.is_none() {
                format!("source sandbox {} not found", snap.spec.source.sandbox)
            } else {
                format!(
                    "source sandbox {} is not bound to a node yet",
                    snap.spec.source.sandbox
                )
            };
            (
                Condition::new(
                    "Scheduled",
                    ConditionStatus::False,
                    "SourceNotRunning",
                    why,
                    snap.metadata.generation,
                ),
                None,
            )
        }
    };
    // Still waiting for the same reason: said already (rewriting it on every look
    // would be a write per waiting snapshot per second).
    let before = status.conditions.get_condition("Scheduled");
    if node.is_none()
        && before.is_some_and(|b| {
            b.status == cond.status && b.reason == cond.reason && b.message == cond.message
        })
    {
        return Ok(Action::requeue(Duration::from_secs(1)));
    }
    conditions.set_condition(cond, Time(Timestamp::now()));
    let mut body = json!({"conditions": conditions.iter().filter(|c| c.type_ == "Scheduled").collect::<Vec<_>>()});
    if let Some(node) = &node {
        body["nodeName"] = json!(node);
    }
    crate::writes::status(
        &api,
        &name,
        ramify_crds::MANAGER_OPERATOR_SNAPSHOT_BINDING,
        snap.resource_version().as_deref(),
        &body,
    )
    .await?;
    Ok(if node.is_some() {
        Action::await_change()
    } else {
        Action::requeue(Duration::from_secs(1))
    })
}
