//! Cluster mode: a new Pod for a workspace that moved out of its evicted Pod.
//!
//! The node agent checkpoints a workspace whose Pod is being evicted and reports it
//! `Suspended`, `status.suspension` naming its image (see the agent's `evicted`). Once
//! the old Pod is gone (deleted here if it ended without being deleted), the binding's
//! `status.pod` is cleared under the resourceVersion read (Event `Moved`), and the
//! Sandbox gets a new Pod of the same name: placed by the scheduler on any node when
//! the object store holds the image, else pinned to the node that kept it (so after
//! `kubectl drain` it waits, `Unschedulable`, for `kubectl uncordon`). `status.nodeName`
//! stays until the new Pod is placed, so a deletion meanwhile is finished by the node
//! holding the image, which removes it (and the store's copy).

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, Preconditions};
use kube::runtime::controller::Action;
use kube::{Resource, ResourceExt};
use ramify_crds::capacity::CONDITION_SCHEDULED;
use ramify_crds::{REASON_MOVED, Sandbox, SandboxPhase};
use serde_json::json;
use tracing::info;

use crate::context::Context;
use crate::error::Result;

/// How soon a sandbox whose old Pod is still going is looked at again (its Pod's
/// events wake it anyway).
const OLD_POD_RECHECK: Duration = Duration::from_secs(2);

/// What to do about a bound Sandbox's Pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Its Pod is its Pod: nothing to do.
    Keep,
    /// It moved out of its Pod, which is still being deleted: wait.
    WaitForOldPod,
    /// It moved out of its Pod, which ended without being deleted: delete it.
    DeleteOldPod { name: String, uid: String },
    /// It moved out of its Pod, which is gone: clear `status.pod`, so it gets a new one.
    Unbind,
}

/// Whether `sbx` is a workspace out of its Pod: `Suspended`, its image recorded.
fn moved_out(sbx: &Sandbox) -> bool {
    sbx.status
        .as_ref()
        .is_some_and(|s| s.phase == SandboxPhase::Suspended && s.suspension.is_some())
}

/// What to do, from the Pod `status.pod` names (`old`: that name in the cache).
pub fn decide(sbx: &Sandbox, old: Option<&Pod>) -> Decision {
    let Some(known) = sbx.status.as_ref().and_then(|s| s.pod.as_ref()) else {
        return Decision::Keep;
    };
    if !moved_out(sbx) {
        return Decision::Keep;
    }
    let Some(pod) = old.filter(|p| p.uid().as_deref() == Some(known.uid.as_str())) else {
        return Decision::Unbind;
    };
    if pod.metadata.deletion_timestamp.is_some() {
        return Decision::WaitForOldPod;
    }
    let ended = pod
        .status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .is_some_and(|p| p == "Succeeded" || p == "Failed");
    if ended {
        return Decision::DeleteOldPod {
            name: known.name.clone(),
            uid: known.uid.clone(),
        };
    }
    // Its Pod lives (a suspended workspace that still has it): nothing moves.
    Decision::Keep
}

/// Whether `sbx` needs a new Pod: bound, moved out, and no Pod named any more.
pub fn needs_pod(sbx: &Sandbox) -> bool {
    moved_out(sbx)
        && sbx
            .status
            .as_ref()
            .is_some_and(|s| s.node_name.is_some() && s.pod.is_none())
}

/// The node its new Pod must go to: the node holding its image, unless the object
/// store has a copy.
pub fn pinned(sbx: &Sandbox) -> Option<String> {
    let x = sbx.status.as_ref()?.suspension.as_ref()?;
    (!x.remote).then(|| x.node.clone())
}

/// Acts on [`decide`]. `None`: nothing to do here.
pub async fn reconcile(sbx: &Sandbox, api: &Api<Sandbox>, ctx: &Context) -> Result<Option<Action>> {
    if sbx.status.as_ref().and_then(|s| s.pod.as_ref()).is_none() || !moved_out(sbx) {
        return Ok(None);
    }
    ctx.cache.pods_synced().await?;
    let ns = sbx.namespace().unwrap_or_default();
    let status = sbx.status.clone().unwrap_or_default();
    let Some(known) = status.pod.clone() else {
        return Ok(None);
    };
    match decide(sbx, ctx.cache.pod(&ns, &known.name).as_ref()) {
        Decision::Keep => Ok(None),
        Decision::WaitForOldPod => Ok(Some(Action::requeue(OLD_POD_RECHECK))),
        Decision::DeleteOldPod { name, uid } => {
            let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
            let dp = DeleteParams {
                preconditions: Some(Preconditions {
                    uid: Some(uid),
                    resource_version: None,
                }),
                ..DeleteParams::background()
            };
            match pods.delete(&name, &dp).await {
                Ok(_) => {}
                Err(e)
                    if ramify_runtime::api_error::is_object_not_found(&e)
                        || matches!(&e, kube::Error::Api(s) if s.code == 409) => {}
                Err(e) => return Err(e.into()),
            }
            Ok(Some(Action::requeue(OLD_POD_RECHECK)))
        }
        Decision::Unbind => {
            // The binding manager's fields but `pod`: server-side apply drops it.
            let scheduled: Vec<_> = status
                .conditions
                .iter()
                .filter(|c| c.type_ == CONDITION_SCHEDULED)
                .collect();
            let written = crate::writes::status(
                api,
                &sbx.name_any(),
                ramify_crds::MANAGER_OPERATOR_SANDBOX_BINDING,
                sbx.resource_version().as_deref(),
                &json!({"nodeName": status.node_name, "conditions": scheduled}),
            )
            .await;
            match written {
                Ok(_) => {}
                // Changed since read (the agent claimed it, or reported): looked at again.
                Err(e) if e.is_conflict() => return Ok(Some(Action::requeue(OLD_POD_RECHECK))),
                Err(e) => return Err(e),
            }
            let to = match pinned(sbx) {
                Some(node) => format!("on node {node}, which holds its image"),
                None => "on any node: the object store has its image".to_string(),
            };
            let message = format!(
                "its Pod {} was evicted and is gone; it resumes in a new Pod {to}",
                known.name
            );
            info!(sandbox = %sbx.name_any(), %message, "moving");
            ctx.event(&sbx.object_ref(&()), false, REASON_MOVED, message)
                .await;
            Ok(Some(Action::await_change()))
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn sandbox(status: serde_json::Value) -> Sandbox {
        serde_json::from_value(json!({
            "apiVersion": "ramify.dev/v1alpha1", "kind": "Sandbox",
            "metadata": {"name": "ws", "namespace": "ns", "uid": "u"},
            "spec": {"command": ["sh"]},
            "status": status,
        }))
        .unwrap()
    }

    fn moved(remote: bool) -> Sandbox {
        sandbox(json!({"phase": "Suspended", "nodeName": "n1",
            "pod": {"name": "ws", "uid": "pod-1"},
            "suspension": {"node": "n1", "image": "susp-1", "sha256": "ab", "remote": remote}}))
    }

    fn pod(uid: &str, extra: serde_json::Value) -> Pod {
        let mut v = json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "ws", "namespace": "ns", "uid": uid}});
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn a_moved_workspace_waits_for_its_old_pod_then_is_unbound() {
        let ws = moved(false);
        let deleting = pod(
            "pod-1",
            json!({"metadata": {"name": "ws", "uid": "pod-1", "deletionTimestamp": "2026-01-01T00:00:00Z"}}),
        );
        assert_eq!(decide(&ws, Some(&deleting)), Decision::WaitForOldPod);
        let ended = pod("pod-1", json!({"status": {"phase": "Succeeded"}}));
        assert_eq!(
            decide(&ws, Some(&ended)),
            Decision::DeleteOldPod {
                name: "ws".into(),
                uid: "pod-1".into()
            }
        );
        assert_eq!(decide(&ws, None), Decision::Unbind);
        // A Pod of that name with another UID is not its old Pod.
        assert_eq!(
            decide(&ws, Some(&pod("pod-2", json!({})))),
            Decision::Unbind
        );
        // Unbound: a new Pod, pinned to the node holding the image unless stored.
        let mut unbound = ws.clone();
        unbound.status.as_mut().unwrap().pod = None;
        assert!(needs_pod(&unbound));
        assert_eq!(pinned(&unbound).as_deref(), Some("n1"));
        assert_eq!(pinned(&moved(true)), None);
    }

    #[test]
    fn a_running_sandbox_or_one_whose_pod_lives_keeps_it() {
        let running = sandbox(json!({"phase": "Running", "nodeName": "n1",
            "pod": {"name": "ws", "uid": "pod-1"}}));
        assert_eq!(decide(&running, None), Decision::Keep);
        assert!(!needs_pod(&running));
        let live = pod("pod-1", json!({"status": {"phase": "Running"}}));
        assert_eq!(decide(&moved(false), Some(&live)), Decision::Keep);
        let unbound_running = sandbox(json!({"phase": "Running", "nodeName": "n1"}));
        assert!(!needs_pod(&unbound_running));
    }
}
