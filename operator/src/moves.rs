//! Moving a suspended Sandbox to another node (standalone mode). A suspended sandbox
//! whose image has a verified copy in the object store (`status.suspension.remote`) is
//! not tied to its node: when it is asked to resume (`spec.suspended: false`) and its
//! node cannot take it back (its node agent's lease ran out, the node is being
//! drained, or it has no room for its request while another node does), the operator
//! rebinds `status.nodeName` to a live node with room; that node's agent downloads the
//! image and resumes it there.
//!
//! Never two resumes: the rebinding is written under the resourceVersion it was
//! decided on, and a node agent about to resume the sandbox claims it first (Ready
//! reason `Resuming`, written under the resourceVersion it read). One of the two
//! writes fails, and a claimed sandbox is never moved. A sandbox its spec pins to a
//! node stays there.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::Api;
use kube::runtime::controller::Action;
use kube::{Resource, ResourceExt};
use ramify_crds::capacity::{CONDITION_SCHEDULED, Requests};
use ramify_crds::{
    CONDITION_SUSPENDED, Condition, ConditionStatus, ConditionsExt, REASON_IDLE, REASON_MOVED,
    REASON_RESUMING, Sandbox, SandboxPhase,
};
use serde_json::json;
use tracing::info;

use crate::capacity;
use crate::context::Context;
use crate::error::Result;
use crate::nodes::NodeAgent;

/// How often a suspended sandbox asked to resume is looked at while it waits for its
/// node (a node agent that died is noticed within a lease's duration plus this).
pub const RESUME_WAIT_RETRY: Duration = Duration::from_secs(5);

/// Whether `s` is a suspended sandbox asked to resume that could move: it has a copy
/// in the object store, no pin, and no node agent has claimed its resume.
pub fn movable(s: &Sandbox) -> bool {
    let Some(st) = s.status.as_ref() else {
        return false;
    };
    let claimed = st
        .conditions
        .get_condition("Ready")
        .is_some_and(|c| c.reason == REASON_RESUMING);
    // Suspended for idleness: it waits for an exec on its node, not for a move.
    let idle = st
        .conditions
        .get_condition(CONDITION_SUSPENDED)
        .is_some_and(|c| c.reason == REASON_IDLE);
    s.metadata.deletion_timestamp.is_none()
        && !s.spec.suspended
        && s.spec.node_name.is_none()
        && st.phase == SandboxPhase::Suspended
        && st.suspension.as_ref().is_some_and(|x| x.remote)
        && !claimed
        && !idle
}

/// Where a movable sandbox should go, and why; `None`: it stays (its node can take it,
/// or no other node can). `free` is what a node has left for sandboxes (`None`: the
/// node announces no allocatable; it is taken to have room).
pub fn destination(
    s: &Sandbox,
    agents: &[NodeAgent],
    free: &dyn Fn(&str) -> Option<Requests>,
) -> Option<(String, String)> {
    if !movable(s) {
        return None;
    }
    let current = s.status.as_ref()?.node_name.clone()?;
    let asks = s.spec.requests();
    let fits = |node: &str| free(node).is_none_or(|f| asks.fits_in(&f));
    let here = agents.iter().find(|a| a.node == current);
    let why = match here {
        Some(NodeAgent {
            draining: Some(d), ..
        }) => format!("node {current} is being drained ({d})"),
        Some(a) if a.live && fits(&current) => return None,
        Some(a) if a.live => {
            let f = free(&current).unwrap_or(Requests::ZERO);
            format!(
                "node {current} has no room for it ({} CPU and {} free; it asks {} CPU and {})",
                Requests::cpu_text(f.cpu_millis),
                Requests::memory_text(f.memory_bytes),
                Requests::cpu_text(asks.cpu_millis),
                Requests::memory_text(asks.memory_bytes)
            )
        }
        _ => format!("the node agent of {current} is not running"),
    };
    // The live node with the most CPU left among those it fits on; ties by name.
    let to = agents
        .iter()
        .filter(|a| a.takes_work() && a.node != current)
        .filter(|a| a.allocatable.is_some() && fits(&a.node))
        .map(|a| (free(&a.node).map_or(0, |f| f.cpu_millis), a.node.as_str()))
        .max_by(|(fa, na), (fb, nb)| fa.cmp(fb).then_with(|| nb.cmp(na)))?
        .1
        .to_string();
    Some((to, why))
}

/// Moves `s` if it should move; `Some(action)` when it is a suspended sandbox waiting
/// to resume (looked at again every [`RESUME_WAIT_RETRY`]), `None` otherwise.
pub async fn reconcile(s: &Sandbox, api: &Api<Sandbox>, ctx: &Context) -> Result<Option<Action>> {
    if !movable(s) {
        return Ok(None);
    }
    let agents = ctx
        .nodes
        .list(&ctx.client, &ctx.settings.system_namespace)
        .await?;
    ctx.cache.synced().await?;
    let (sbx_state, snap_state) = ctx.cache.everything();
    let all: Vec<&Sandbox> = sbx_state.iter().filter_map(|o| o.0.as_ref().ok()).collect();
    let snaps: Vec<_> = snap_state
        .iter()
        .filter_map(|o| o.0.as_ref().ok())
        .collect();
    let free = |node: &str| {
        let alloc = agents.iter().find(|a| a.node == node)?.allocatable?;
        let reserved = capacity::pools_on(node, &snaps, &all);
        Some(capacity::free_on(node, &alloc, &all, &reserved))
    };
    let Some((to, why)) = destination(s, &agents, &free) else {
        return Ok(Some(Action::requeue(RESUME_WAIT_RETRY)));
    };
    let from = s
        .status
        .as_ref()
        .and_then(|st| st.node_name.clone())
        .unwrap_or_default();
    match write(s, api, &from, &to, &why).await {
        Ok(()) => {}
        // Claimed or changed meanwhile: decided again on what it is now.
        Err(e) if e.is_conflict() => return Ok(Some(Action::requeue(Duration::from_millis(200)))),
        Err(e) => return Err(e),
    }
    info!(sandbox = %s.name_any(), %from, %to, %why, "moved a suspended sandbox");
    ctx.event(
        &s.object_ref(&()),
        false,
        REASON_MOVED,
        format!("moved from node {from} to {to} ({why}): it resumes there from the object store"),
    )
    .await;
    Ok(Some(Action::await_change()))
}

/// Rebinds `s` to `to`, guarded by the resourceVersion the move was decided on.
async fn write(s: &Sandbox, api: &Api<Sandbox>, from: &str, to: &str, why: &str) -> Result<()> {
    let mut conditions = s.status.clone().unwrap_or_default().conditions;
    conditions.set_condition(
        Condition::new(
            CONDITION_SCHEDULED,
            ConditionStatus::True,
            REASON_MOVED,
            format!("moved from node {from} to {to} ({why})"),
            s.metadata.generation,
        ),
        Time(Timestamp::now()),
    );
    let status = json!({
        "nodeName": to,
        "conditions": conditions.iter().filter(|c| c.type_ == CONDITION_SCHEDULED).collect::<Vec<_>>(),
    });
    crate::writes::status(
        api,
        &s.name_any(),
        ramify_crds::MANAGER_OPERATOR_SANDBOX_BINDING,
        s.resource_version().as_deref(),
        &status,
    )
    .await?;
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn agent(node: &str, live: bool) -> NodeAgent {
        NodeAgent {
            node: node.into(),
            live,
            capacity: 64,
            allocatable: Some(Requests {
                cpu_millis: 1600,
                memory_bytes: 8 << 30,
            }),
            draining: None,
            gone_for: (!live).then_some(std::time::Duration::from_secs(1)),
        }
    }

    fn suspended(remote: bool, ready_reason: &str) -> Sandbox {
        serde_json::from_value(json!({
            "apiVersion": "ramify.dev/v1alpha1", "kind": "Sandbox",
            "metadata": {"name": "ws", "namespace": "ns", "uid": "u"},
            "spec": {"command": ["sh"], "resources": {"cpu": "500m", "memory": "256Mi"}},
            "status": {"phase": "Suspended", "nodeName": "a",
                       "suspension": {"node": "a", "image": "susp-1", "sha256": "x", "remote": remote},
                       "conditions": [{"type": "Ready", "status": "False", "reason": ready_reason,
                                       "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}]},
        }))
        .unwrap()
    }

    fn room(cpu: u64) -> Option<Requests> {
        Some(Requests {
            cpu_millis: cpu,
            memory_bytes: 8 << 30,
        })
    }

    #[test]
    fn a_sandbox_whose_node_agent_is_gone_moves_to_the_freest_live_node() {
        let agents = [agent("a", false), agent("b", true), agent("c", true)];
        let free = |n: &str| room(if n == "b" { 600 } else { 1200 });
        let (to, why) = destination(&suspended(true, "Suspended"), &agents, &free).unwrap();
        assert_eq!(to, "c");
        assert_eq!(why, "the node agent of a is not running");
    }

    #[test]
    fn a_full_node_gives_it_up_only_to_a_node_with_room() {
        let agents = [agent("a", true), agent("b", true)];
        let (to, why) = destination(&suspended(true, "Suspended"), &agents, &|n: &str| {
            room(if n == "a" { 400 } else { 1600 })
        })
        .unwrap();
        assert_eq!(to, "b");
        assert!(
            why.starts_with("node a has no room for it (0.4 CPU"),
            "{why}"
        );
        // Room at home: it stays. No room anywhere: it waits at home.
        assert_eq!(
            destination(&suspended(true, "Suspended"), &agents, &|_: &str| room(
                1600
            )),
            None
        );
        assert_eq!(
            destination(&suspended(true, "Suspended"), &agents, &|_: &str| room(100)),
            None
        );
    }

    #[test]
    fn a_draining_node_gives_up_its_suspended_workspaces_and_takes_none() {
        let drained = |n: &str| NodeAgent {
            draining: Some("kernel upgrade".into()),
            ..agent(n, true)
        };
        let free = |_: &str| room(1600);
        let ws = suspended(true, "Suspended");
        let (to, why) = destination(&ws, &[drained("a"), agent("b", true)], &free).unwrap();
        assert_eq!(
            (to.as_str(), why.as_str()),
            ("b", "node a is being drained (kernel upgrade)")
        );
        // Nowhere else to go: it waits.
        assert_eq!(destination(&ws, &[drained("a"), drained("b")], &free), None);
    }

    #[test]
    fn only_an_unclaimed_unpinned_sandbox_with_a_remote_copy_moves() {
        let agents = [agent("a", false), agent("b", true)];
        let free = |_: &str| room(1600);
        // No copy in the object store: its image is only on its node.
        assert_eq!(
            destination(&suspended(false, "Suspended"), &agents, &free),
            None
        );
        // A node agent claimed its resume.
        assert_eq!(
            destination(&suspended(true, REASON_RESUMING), &agents, &free),
            None
        );
        // Pinned by its spec, or asked to stay suspended.
        let mut pinned = suspended(true, "Suspended");
        pinned.spec.node_name = Some("a".into());
        assert_eq!(destination(&pinned, &agents, &free), None);
        let mut staying = suspended(true, "Suspended");
        staying.spec.suspended = true;
        assert_eq!(destination(&staying, &agents, &free), None);
        // Suspended for idleness: it waits for an exec on its node.
        let mut idle = suspended(true, "Suspended");
        if let Some(st) = idle.status.as_mut() {
            st.conditions.push(Condition {
                type_: CONDITION_SUSPENDED.into(),
                status: ConditionStatus::True,
                reason: REASON_IDLE.into(),
                ..st.conditions[0].clone()
            });
        }
        assert_eq!(destination(&idle, &agents, &free), None);
        assert!(destination(&suspended(true, "Suspended"), &agents, &free).is_some());
    }
}
