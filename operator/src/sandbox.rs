//! Sandbox reconciler: adds the node-cleanup finalizer and binds each Sandbox to a
//! node (`status.nodeName`). The node agent on that node does the rest.

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use kube::core::DeserializeGuard;
use kube::core::object::HasStatus;
use kube::runtime::controller::Action;
use kube::{Resource, ResourceExt};
use ramify_crds::capacity::{
    CONDITION_SCHEDULED, REASON_EXCEEDS_ALLOCATABLE, REASON_WAITING_FOR_CAPACITY,
};
use ramify_crds::pod::{MANAGER_OPERATOR_POD, Mode, REASON_POD_REFUSED, REASON_UNSCHEDULABLE};
use ramify_crds::{
    Condition, ConditionStatus, ConditionsExt, FINALIZER_NODE_CLEANUP, PodRef, Sandbox,
    SandboxPhase, SnapshotPhase,
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
        // A Full commit's winner: its Pod goes to the parent before it can go with it.
        if ctx.settings.mode == Mode::Cluster {
            crate::handover::reconcile(sbx, ctx).await?;
        }
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
        if ctx.settings.mode == Mode::Cluster {
            if crate::handover::reconcile(sbx, ctx).await? {
                return Ok(Action::await_change()); // its status changed: seen again
            }
            // A workspace moved out of its evicted Pod: a new Pod, once the old is gone.
            if let Some(action) = crate::repod::reconcile(sbx, &api, ctx).await? {
                return Ok(action);
            }
            if crate::repod::needs_pod(sbx) {
                return bind_to_pod(sbx, &api, ctx, crate::repod::pinned(sbx)).await;
            }
            refresh_pod(sbx, &api, ctx).await?;
        } else if let Some(action) = crate::moves::reconcile(sbx, &api, ctx).await? {
            // Suspended and asked to resume: moved, or looked at while it waits.
            return Ok(action);
        }
        crate::self_fork::serve(sbx, ctx).await?;
        return Ok(Action::requeue(Duration::from_secs(300)));
    }

    // Bind: explicit node, else the node holding the snapshot, else the freest node
    // (cluster mode: the node kube-scheduler places the Sandbox's Pod on).
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
                Some(WAIT_RETRY),
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
                    None,
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
                    Some(WAIT_RETRY),
                )
                .await;
            }
        }
    } else if ctx.settings.mode == Mode::Cluster {
        return bind_to_pod(sbx, &api, ctx, None).await;
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
                        Some(WAIT_RETRY),
                    )
                    .await;
                }
            },
        }
    };
    // Cluster mode: the scheduler admits the Pod (pinned to `node`), not the agents'
    // capacity.
    if ctx.settings.mode == Mode::Cluster {
        return bind_to_pod(sbx, &api, ctx, Some(node)).await;
    }
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
    bind(sbx, &api, ctx, &node, binding_guard(sbx).as_deref(), None).await
}

/// Writes the binding to `node` (`status.nodeName`, `Scheduled` True; in cluster mode
/// `status.pod` too) and says so in an Event.
async fn bind(
    sbx: &Sandbox,
    api: &Api<Sandbox>,
    ctx: &Context,
    node: &str,
    guard: Option<&str>,
    pod: Option<PodRef>,
) -> Result<Action> {
    let mut conditions = sbx.status.clone().unwrap_or_default().conditions;
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
    let mut status = json!({"nodeName": node, "conditions": conditions.iter().filter(|c| c.type_ == CONDITION_SCHEDULED).collect::<Vec<_>>()});
    if let Some(pod) = pod {
        status["pod"] = json!(pod);
    }
    crate::writes::status(
        api,
        &sbx.name_any(),
        ramify_crds::MANAGER_OPERATOR_SANDBOX_BINDING,
        guard,
        &status,
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
    unschedulable(sbx, api, ctx, reason, message, Some(WAIT_RETRY)).await
}

/// `Scheduled` False for `reason` (written only when the reason changes, an Event then
/// too), looked at again after `retry`; `None`: for good, the sandbox fails.
async fn unschedulable(
    sbx: &Sandbox,
    api: &Api<Sandbox>,
    ctx: &Context,
    reason: &str,
    message: String,
    retry: Option<Duration>,
) -> Result<Action> {
    let fatal = retry.is_none();
    let retry = retry.map_or_else(Action::await_change, Action::requeue);
    let mut conditions = sbx.status.clone().unwrap_or_default().conditions;
    let before = conditions.get_condition(CONDITION_SCHEDULED).cloned();
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
    // A bound sandbox waiting for a new Pod (it moved out of an evicted one) keeps its
    // node: the fields of this manager left out of an apply are given up.
    let st = sbx.status.clone().unwrap_or_default();
    if let Some(node) = &st.node_name {
        status["nodeName"] = json!(node);
    }
    if let Some(pod) = &st.pod {
        status["pod"] = json!(pod);
    }
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

/// How soon a sandbox waiting for capacity (or its snapshot) is looked at again, from
/// the cache.
const WAIT_RETRY: Duration = Duration::from_secs(2);
/// How soon a Pod the API server refused is tried again (a ResourceQuota may free).
const POD_REFUSED_RETRY: Duration = Duration::from_secs(10);
/// How soon a Sandbox waiting on its Pod is looked at again without a Pod event (each
/// change of the Pod wakes it anyway).
const POD_WAIT_RETRY: Duration = Duration::from_secs(30);

/// Cluster mode: binds `sbx` to the node its Pod was scheduled on, creating the Pod
/// first. `pinned`: the node the Pod must go to (a branch's snapshot's, a
/// `spec.nodeName`). Until the scheduler places it, `Scheduled` False says why
/// (refused by the API server, unschedulable), written only when that changes.
async fn bind_to_pod(
    sbx: &Sandbox,
    api: &Api<Sandbox>,
    ctx: &Context,
    pinned: Option<String>,
) -> Result<Action> {
    let ns = sbx.namespace().unwrap_or_default();
    let name = ramify_crds::pod::pod_name(&sbx.name_any());
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    ctx.cache.pods_synced().await?;
    // Its own Pod; else one it adopted earlier; else a warm pool Pod to adopt; else a
    // new one.
    // A workspace moving to a new Pod never takes an old or a pool Pod.
    let moving = crate::repod::needs_pod(sbx);
    let found = match ctx.cache.pod(&ns, &name) {
        Some(pod) => Some(pod),
        None if moving => None,
        None => match crate::warm_pods::adopted_before(sbx, ctx) {
            Some(pod) => Some(pod),
            None => crate::warm_pods::adopt(sbx, ctx, pinned.as_deref()).await?,
        },
    };
    let pod = match found {
        Some(pod) => pod,
        None => {
            let image = ctx.settings.pod_image.as_deref().ok_or_else(|| {
                crate::error::Error::Invalid("cluster mode without a pod image".into())
            })?;
            let want = crate::pod::build(sbx, image, pinned.as_deref())?;
            let params = PostParams {
                field_manager: Some(MANAGER_OPERATOR_POD.into()),
                ..Default::default()
            };
            match pods.create(&params, &want).await {
                Ok(pod) => pod,
                // Created by an earlier reconcile the cache has not seen yet (or by
                // someone else: its owner says).
                Err(kube::Error::Api(e)) if e.code == 409 => pods.get(&name).await?,
                // A ResourceQuota (403), a LimitRange or an admission policy (422, 400):
                // the API server's message names it. Tried again, since quota frees.
                Err(kube::Error::Api(e)) if matches!(e.code, 400 | 403 | 422) => {
                    return refused(sbx, api, ctx, e.message).await;
                }
                Err(e) => return Err(e.into()),
            }
        }
    };
    if !crate::pod::is_of(&pod, sbx) {
        return refused(
            sbx,
            api,
            ctx,
            format!("pod {name} exists and is not this Sandbox's"),
        )
        .await;
    }
    if let Some(node) = crate::pod::node_of(&pod) {
        // The scheduler's choice is the truth: no resourceVersion guard.
        let node = node.to_string();
        return bind(sbx, api, ctx, &node, None, Some(crate::pod::pod_ref(&pod))).await;
    }
    match crate::pod::unschedulable(&pod) {
        Some(message) => {
            unschedulable(
                sbx,
                api,
                ctx,
                REASON_UNSCHEDULABLE,
                message,
                Some(POD_WAIT_RETRY),
            )
            .await
        }
        // Not looked at by the scheduler yet: its verdict comes as a Pod event.
        None => Ok(Action::requeue(POD_WAIT_RETRY)),
    }
}

/// `Scheduled` False, reason `PodRefused`, with `message`; tried again shortly.
async fn refused(
    sbx: &Sandbox,
    api: &Api<Sandbox>,
    ctx: &Context,
    message: String,
) -> Result<Action> {
    unschedulable(
        sbx,
        api,
        ctx,
        REASON_POD_REFUSED,
        message,
        Some(POD_REFUSED_RETRY),
    )
    .await
}

/// Cluster mode, a bound Sandbox: `status.pod` follows its Pod's IP (which the Pod gets
/// after it was scheduled). Written only when it changed, with every field of the
/// binding manager.
async fn refresh_pod(sbx: &Sandbox, api: &Api<Sandbox>, ctx: &Context) -> Result<()> {
    let status = sbx.status.clone().unwrap_or_default();
    let (Some(node), Some(known)) = (status.node_name.as_deref(), status.pod.as_ref()) else {
        return Ok(());
    };
    ctx.cache.pods_synced().await?;
    let ns = sbx.namespace().unwrap_or_default();
    let Some(pod) = ctx.cache.pod(&ns, &known.name) else {
        return Ok(());
    };
    let now = crate::pod::pod_ref(&pod);
    if now.uid != known.uid || now.ip.is_none() || now.ip == known.ip {
        return Ok(());
    }
    let scheduled: Vec<_> = status
        .conditions
        .iter()
        .filter(|c| c.type_ == CONDITION_SCHEDULED)
        .collect();
    crate::writes::status(
        api,
        &sbx.name_any(),
        ramify_crds::MANAGER_OPERATOR_SANDBOX_BINDING,
        None,
        &json!({"nodeName": node, "conditions": scheduled, "pod": now}),
    )
    .await?;
    Ok(())
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
