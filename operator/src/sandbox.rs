//! Sandbox reconciler: adds the node-cleanup finalizer and binds each Sandbox to a
//! node (`status.nodeName`). The node agent on that node does the rest.

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::Api;
use kube::core::DeserializeGuard;
use kube::core::object::HasStatus;
use kube::runtime::controller::Action;
use kube::{Resource, ResourceExt};
use ramify_crds::capacity::{
    CONDITION_SCHEDULED, REASON_EXCEEDS_ALLOCATABLE, REASON_WAITING_FOR_CAPACITY,
};
use ramify_crds::{
    Condition, ConditionStatus, ConditionsExt, FINALIZER_NODE_CLEANUP, Sandbox, SandboxPhase,
    SnapshotPhase,
};
use serde_json::json;
use tracing::instrument;

use crate::capacity::{self, Decision};
use crate::context::Context;
use crate::error::Result;
use crate::nodes;

pub const CONTROLLER: &str = "sandbox";

/// Reconciles one Sandbox.
#[instrument(skip_all, fields(sandbox = %obj.name_any(), ns = obj.namespace().unwrap_or_default()))]
pub async fn reconcile(obj: Arc<DeserializeGuard<Sandbox>>, ctx: Arc<Context>) -> Result<Action> {
    let started = Instant::now();
    let res = match &obj.0 {
        Ok(sbx) => reconcile_sandbox(sbx, &ctx).await,
        Err(invalid) => {
            crate::report_invalid(&ctx, "Sandbox", invalid).await;
            Ok(Action::await_change())
        }
    };
    ctx.metrics.reconciled(CONTROLLER, started.elapsed());
    res
}

async fn reconcile_sandbox(sbx: &Sandbox, ctx: &Context) -> Result<Action> {
    let ns = sbx.namespace().unwrap_or_default();
    let name = sbx.name_any();
    let api: Api<Sandbox> = Api::namespaced(ctx.client.clone(), &ns);
    let status = sbx.status().cloned().unwrap_or_default();

    if sbx.metadata.deletion_timestamp.is_some() {
        crate::metrics::forget_phase(&ctx.metrics, "Sandbox", &ns, &name);
        return release_if_unbound_or_lost(sbx, &api, ctx).await;
    }
    crate::metrics::set_phase(
        &ctx.metrics,
        "Sandbox",
        &format!("{:?}", status.phase),
        &ns,
        &name,
    );
    if !sbx.finalizers().iter().any(|f| f == FINALIZER_NODE_CLEANUP) {
        crate::add_finalizer(&api, sbx).await?;
        return Ok(Action::await_change());
    }
    if status.node_name.is_some() {
        crate::self_fork::serve(sbx, ctx).await?;
        return Ok(Action::requeue(Duration::from_secs(300)));
    }

    // Bind: explicit node, else the node holding the snapshot, else the freest node.
    let node = if let Some(node) = &sbx.spec.node_name {
        node.clone()
    } else if let Some(restore) = &sbx.spec.restore_from {
        ctx.cache.synced().await?;
        let Some(snap) = ctx.cache.snapshot(&ns, &restore.snapshot) else {
            return unschedulable(
                sbx,
                &api,
                ctx,
                "SnapshotNotFound",
                format!("snapshot {} not found", restore.snapshot),
                false,
            )
            .await;
        };
        let st = snap.status.clone().unwrap_or_default();
        match (st.phase, st.node_name) {
            (SnapshotPhase::Ready, Some(node)) => node,
            (SnapshotPhase::Failed | SnapshotPhase::Expired, _) => {
                // No silent fallback: a restore that cannot happen fails the sandbox.
                return unschedulable(
                    sbx,
                    &api,
                    ctx,
                    "SnapshotUnusable",
                    format!(
                        "snapshot {} is {:?}; the sandbox is not started fresh in its place",
                        restore.snapshot, st.phase
                    ),
                    true,
                )
                .await;
            }
            _ => {
                return unschedulable(
                    sbx,
                    &api,
                    ctx,
                    "SnapshotNotReady",
                    format!("waiting for snapshot {}", restore.snapshot),
                    false,
                )
                .await;
            }
        }
    } else {
        let agents = ctx
            .nodes
            .list(&ctx.client, &ctx.settings.system_namespace)
            .await?;
        ctx.cache.synced().await?;
        let count = |node: &str| u32::try_from(ctx.cache.sandboxes_on(node)).unwrap_or(u32::MAX);
        let (sbx_state, snap_state) = ctx.cache.everything();
        let (all, snaps) = (oks(&sbx_state), oks(&snap_state));
        let chosen = capacity::choose(
            sbx,
            &agents,
            &all,
            &|node| capacity::pools_on(node, &snaps, &all),
            &|s| target_node(ctx, s),
        );
        match chosen {
            Some(Ok(node)) => node,
            Some(Err(d)) => return wait_for_capacity(sbx, &api, ctx, d).await,
            None => match nodes::choose(&agents, &count) {
                Some(node) => node,
                None => {
                    return unschedulable(
                        sbx,
                        &api,
                        ctx,
                        "NoNodeAgent",
                        "no live node agent with free capacity".into(),
                        false,
                    )
                    .await;
                }
            },
        }
    };
    // Bind only what fits: the node's sandboxes leave room for its request, and it is
    // next in the fair order. One the node agent already began with is there.
    if !capacity::started(sbx) {
        let agents = ctx
            .nodes
            .list(&ctx.client, &ctx.settings.system_namespace)
            .await?;
        if let Some(alloc) = agents
            .iter()
            .find(|a| a.node == node)
            .and_then(|a| a.allocatable)
        {
            ctx.cache.synced().await?;
            let (sbx_state, snap_state) = ctx.cache.everything();
            let (all, snaps) = (oks(&sbx_state), oks(&snap_state));
            let reserved = capacity::pools_on(&node, &snaps, &all);
            let d = capacity::decide(sbx, &node, &alloc, &all, &reserved, &|s| {
                target_node(ctx, s)
            });
            if d != Decision::Bind {
                return wait_for_capacity(sbx, &api, ctx, d).await;
            }
        }
    }
    let mut conditions = status.conditions.clone();
    conditions.set_condition(
        Condition::new(
            CONDITION_SCHEDULED,
            ConditionStatus::True,
            "Bound",
            format!("bound to node {node}"),
            sbx.metadata.generation,
        ),
        Time(Timestamp::now()),
    );
    crate::writes::status(
        &api,
        &name,
        ramify_crds::MANAGER_OPERATOR_SANDBOX_BINDING,
        binding_guard(sbx).as_deref(),
        &json!({"nodeName": node, "conditions": conditions.iter().filter(|c| c.type_ == CONDITION_SCHEDULED).collect::<Vec<_>>()}),
    )
    .await?;
    if sbx
        .spec
        .restore_from
        .as_ref()
        .and_then(|r| r.branch.as_ref())
        .is_none()
    {
        // Branches are bound where their snapshot is, by construction: an Event per
        // branch would only add an API write to the fork's critical path.
        ctx.event(
            &sbx.object_ref(&()),
            false,
            "Scheduled",
            format!("bound to node {node}"),
        )
        .await;
    }
    Ok(Action::requeue(Duration::from_secs(300)))
}

/// The resourceVersion a binding is written against: the one the node was chosen on,
/// so a choice made on a stale object is not written; none for a sandbox its spec
/// pins, whose node was never chosen. A branch is bound by its BranchSet's reconcile
/// the moment it is created, so this reconcile, started on the object as created,
/// lost that race on almost every branch: with a guard, one failed write after
/// another (retried at once while the cache trailed: 916 at 400 branches), and the
/// same binding in the end.
fn binding_guard(sbx: &Sandbox) -> Option<String> {
    if sbx.spec.node_name.is_some() {
        None
    } else {
        sbx.resource_version()
    }
}

/// A sandbox that does not fit yet: `Scheduled` False says why; it is looked at again
/// from the cache every few seconds (no API call unless the reason changes).
async fn wait_for_capacity(
    sbx: &Sandbox,
    api: &Api<Sandbox>,
    ctx: &Context,
    d: Decision,
) -> Result<Action> {
    let (reason, message) = match d {
        Decision::TooBig(m) => (REASON_EXCEEDS_ALLOCATABLE, m),
        Decision::Wait(m) => (REASON_WAITING_FOR_CAPACITY, m),
        Decision::Bind => return Ok(Action::requeue(Duration::from_millis(10))),
    };
    unschedulable(sbx, api, ctx, reason, message, false).await
}

async fn unschedulable(
    sbx: &Sandbox,
    api: &Api<Sandbox>,
    ctx: &Context,
    reason: &str,
    message: String,
    fatal: bool,
) -> Result<Action> {
    let mut conditions = sbx.status.clone().unwrap_or_default().conditions;
    let before = conditions.get_condition(CONDITION_SCHEDULED).cloned();
    let retry = if fatal {
        Action::await_change()
    } else {
        Action::requeue(Duration::from_secs(2))
    };
    // Said already: writing it again on every look would be a write per waiting
    // sandbox every two seconds.
    if before
        .as_ref()
        .is_some_and(|c| c.status == ConditionStatus::False && c.reason == reason)
        && (!fatal || sbx.status.as_ref().map(|s| s.phase) == Some(SandboxPhase::Failed))
    {
        return Ok(retry);
    }
    conditions.set_condition(
        Condition::new(
            CONDITION_SCHEDULED,
            ConditionStatus::False,
            reason,
            message.clone(),
            sbx.metadata.generation,
        ),
        Time(Timestamp::now()),
    );
    let mut status = json!({"conditions": conditions.iter().filter(|c| c.type_ == CONDITION_SCHEDULED).collect::<Vec<_>>()});
    if fatal {
        status["phase"] = json!(SandboxPhase::Failed);
    }
    crate::writes::status(
        api,
        &sbx.name_any(),
        ramify_crds::MANAGER_OPERATOR_SANDBOX_BINDING,
        None,
        &status,
    )
    .await?;
    // Branches wait in their BranchSet's view; an Event each would be an API write
    // per branch (a 100-replica set on a small node).
    let is_branch = sbx
        .spec
        .restore_from
        .as_ref()
        .is_some_and(|r| r.branch.is_some());
    if before.map(|c| c.reason) != Some(reason.to_string())
        && !(is_branch && reason == REASON_WAITING_FOR_CAPACITY)
    {
        ctx.event(&sbx.object_ref(&()), true, reason, message).await;
    }
    Ok(retry)
}

/// The objects of a cache snapshot that deserialized.
fn oks<K>(state: &[std::sync::Arc<DeserializeGuard<K>>]) -> Vec<&K> {
    state.iter().filter_map(|g| g.0.as_ref().ok()).collect()
}

/// The node a not-yet-bound sandbox is meant for: its pin, else its snapshot's node;
/// `None`: any node.
fn target_node(ctx: &Context, s: &Sandbox) -> Option<String> {
    if let Some(n) = &s.spec.node_name {
        return Some(n.clone());
    }
    let rf = s.spec.restore_from.as_ref()?;
    let ns = s.metadata.namespace.as_deref().unwrap_or_default();
    ctx.cache.snapshot(ns, &rf.snapshot)?.status?.node_name
}

/// A Sandbox being deleted: the node agent releases the finalizer after cleaning up.
/// The operator releases it only when no node ever held the sandbox, or when the node
/// agent has been gone for longer than the grace period.
async fn release_if_unbound_or_lost(
    sbx: &Sandbox,
    api: &Api<Sandbox>,
    ctx: &Context,
) -> Result<Action> {
    if !sbx.finalizers().iter().any(|f| f == FINALIZER_NODE_CLEANUP) {
        return Ok(Action::await_change());
    }
    // A sandbox pinned by its spec may be running on that node before it is bound.
    let node = sbx
        .status
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .or_else(|| sbx.spec.node_name.clone());
    let release = match node {
        None => true,
        Some(node) => crate::node_lost_for(ctx, &node).await? > ctx.settings.node_lost_grace,
    };
    if release {
        crate::remove_finalizer(api, sbx).await?;
        return Ok(Action::await_change());
    }
    Ok(Action::requeue(Duration::from_secs(30)))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn only_a_binding_the_operator_chose_is_guarded() {
        let mut sbx: Sandbox = serde_json::from_value(json!({
            "apiVersion": "ramify.dev/v1alpha1", "kind": "Sandbox",
            "metadata": {"name": "s", "namespace": "ns", "resourceVersion": "7"},
            "spec": {"command": ["sh"]},
        }))
        .unwrap();
        assert_eq!(binding_guard(&sbx).as_deref(), Some("7"));
        // A branch (or any pinned sandbox): its node is its spec's, whatever changed.
        sbx.spec.node_name = Some("vm".into());
        assert_eq!(binding_guard(&sbx), None);
    }
}
