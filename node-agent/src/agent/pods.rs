//! Cluster mode: the Pods backing this node's Sandboxes (`ramify_crds::pod`).
//!
//! The agent watches the Pods on its node that carry a Sandbox's UID label; a Pod
//! event wakes its Sandbox's reconcile (by the Pod's controller reference). A Sandbox
//! starts (or restores) only once its Pod is on this node, controlled by it, not being
//! deleted, and its `ramify-pod` container runs: until then it says it waits
//! (`WaitingForPod`). A sandbox whose Pod is deleted while it lives is destroyed, and
//! its Sandbox fails saying so (`PodDeleted`); a branch whose Pod is evicted too
//! (`PodEvicted`), while a workspace moves to a new Pod (see `evicted`).

use std::time::Duration;

use futures::FutureExt;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::core::DeserializeGuard;
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use ramify_crds::pod::{
    LABEL_WARM_POOL, MANAGED_PODS, POD_CONTAINER, REASON_POD_DELETED, REASON_POD_EVICTED,
    REASON_WAITING_FOR_POD, pod_name,
};
use ramify_crds::{Sandbox as SandboxObj, SandboxPhase};
use serde_json::json;
use tracing::{info, instrument, warn};

use super::{Agent, Handle};
use crate::error::{Error, Result};

/// A sandbox waiting for its Pod is looked at again after this long even without a
/// Pod event (a safety net: Pod events wake it at once).
const POD_RECHECK: Duration = Duration::from_secs(30);

/// The Pods this agent watches: ramify's on its node (backing a Sandbox, or kept in a
/// Snapshot's warm pool).
pub fn watch_config(node: &str) -> watcher::Config {
    watcher::Config::default()
        .fields(&format!("spec.nodeName={node}"))
        .labels(MANAGED_PODS)
        .any_semantic()
}

/// A quiet wait (no status write) for the Pod watch to see a warm pool Pod adopted.
const ADOPTION_SEEN: Duration = Duration::from_millis(250);

/// Cluster mode: the Pods of one Snapshot's warm pool on this node, read from the Pod
/// watch's store.
pub struct PoolPods {
    pub store: kube::runtime::reflector::Store<Pod>,
    pub snapshot_uid: String,
    /// The Snapshot's namespace: a Pod elsewhere is never filled, whatever it claims
    /// (labels and owner references are anyone's to write in their own namespace).
    pub namespace: String,
    pub node: String,
}

impl PoolPods {
    /// Whether `pod` is a pool Pod of this snapshot on this node, ready for a branch.
    fn fillable(&self, pod: &Pod) -> bool {
        let controlled = pod.metadata.owner_references.as_ref().is_some_and(|o| {
            o.iter().any(|o| {
                o.controller == Some(true) && o.kind == "Snapshot" && o.uid == self.snapshot_uid
            })
        });
        pod.namespace().as_deref() == Some(self.namespace.as_str())
            && pod.labels().get(LABEL_WARM_POOL) == Some(&self.snapshot_uid)
            && controlled
            && pod.metadata.deletion_timestamp.is_none()
            && pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(self.node.as_str())
            && container_state(pod).is_ok()
            && pod.uid().is_some_and(|u| !u.is_empty())
    }
}

impl ramify_engine::engine::PodSupply for PoolPods {
    fn in_pool(&self) -> Vec<ramify_engine::engine::PoolPod> {
        let mut pods: Vec<_> = self
            .store
            .state()
            .iter()
            .filter(|p| self.fillable(p))
            .map(|p| ramify_engine::engine::PoolPod {
                uid: p.uid().unwrap_or_default(),
                name: p.name_any(),
            })
            .collect();
        pods.sort_by(|a, b| a.name.cmp(&b.name));
        pods
    }

    fn lives(&self, uid: &str) -> bool {
        self.store.state().iter().any(|p| {
            p.uid().as_deref() == Some(uid)
                && p.metadata.deletion_timestamp.is_none()
                && p.namespace().as_deref() == Some(self.namespace.as_str())
        })
    }
}

/// The UID of the Sandbox controlling `pod`, if one does.
fn controller_uid(pod: &Pod) -> Option<&str> {
    pod.metadata
        .owner_references
        .as_ref()?
        .iter()
        .find(|o| o.controller == Some(true) && o.kind == "Sandbox")
        .map(|o| o.uid.as_str())
}

/// The Sandbox a Pod event concerns (its controller), for the Sandbox controller.
pub fn sandbox_of(pod: &Pod) -> Option<ObjectRef<DeserializeGuard<SandboxObj>>> {
    let owner = pod
        .metadata
        .owner_references
        .as_ref()?
        .iter()
        .find(|o| o.controller == Some(true) && o.kind == "Sandbox")?;
    Some(ObjectRef::new(&owner.name).within(&pod.namespace().unwrap_or_default()))
}

/// Whether the Pod's `ramify-pod` container runs, or what it is doing instead.
fn container_state(pod: &Pod) -> std::result::Result<(), String> {
    let st = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.name == POD_CONTAINER))
        .and_then(|c| c.state.as_ref());
    match st {
        Some(s) if s.running.is_some() => Ok(()),
        Some(s) => match (&s.waiting, &s.terminated) {
            (Some(w), _) => Err(format!(
                "waiting: {}",
                w.reason.as_deref().unwrap_or("no reason given")
            )),
            (None, Some(t)) => Err(format!(
                "terminated: {}, exit code {}",
                t.reason.as_deref().unwrap_or("no reason given"),
                t.exit_code
            )),
            (None, None) => Err("no state reported".into()),
        },
        None => Err("not started yet".into()),
    }
}

/// Before a start: the UID of the Pod the sandbox may start in, or what it waits for.
pub fn ready_to_start(
    pod: Option<&Pod>,
    sandbox_uid: &str,
    key: &str,
    node: &str,
) -> std::result::Result<String, String> {
    let Some(pod) = pod else {
        return Err(format!(
            "waiting for its Pod {key} to be scheduled to node {node}"
        ));
    };
    if controller_uid(pod) != Some(sandbox_uid) {
        return Err(format!(
            "waiting for its Pod {key}: the Pod of that name is not controlled by this Sandbox"
        ));
    }
    if pod.metadata.deletion_timestamp.is_some() {
        return Err(format!("waiting for its Pod {key}: it is being deleted"));
    }
    if disruption(pod).is_some() {
        return Err(format!("waiting for its Pod {key}: it is being evicted"));
    }
    let on = pod.spec.as_ref().and_then(|s| s.node_name.as_deref());
    if on != Some(node) {
        return Err(format!(
            "waiting for its Pod {key} to be scheduled to node {node} (it is on {})",
            on.unwrap_or("no node yet")
        ));
    }
    if let Err(state) = container_state(pod) {
        return Err(format!(
            "waiting for container {POD_CONTAINER} of its Pod {key} to run ({state})"
        ));
    }
    let uid = pod.uid().unwrap_or_default();
    if uid.is_empty() {
        return Err(format!("waiting for its Pod {key}: it has no UID yet"));
    }
    Ok(uid)
}

/// Why a sandbox placed in the Pod with `placed_uid` must end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodGone {
    pub reason: &'static str,
    pub message: String,
    /// The Pod is being evicted (`DisruptionTarget`: the eviction API, a drain, a
    /// preemption, a taint) and still exists: a workspace can move out of it first.
    pub disrupted: bool,
}

/// The Pod's `DisruptionTarget` condition, if it is True: set before an eviction, a
/// drain, a preemption, a NoExecute taint or a node shutdown deletes the Pod.
pub fn disruption(pod: &Pod) -> Option<&k8s_openapi::api::core::v1::PodCondition> {
    pod.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "DisruptionTarget" && c.status == "True")
}

/// While a sandbox lives in the Pod with `placed_uid`: why it must end, if it must.
/// Evictions are told apart from plain deletions (a drain or a preemption marks the
/// Pod `DisruptionTarget` before deleting it). Once the sandbox has `ended`, its Pod's
/// container exits by design (the exit file): only the Pod's deletion counts then.
pub fn gone(pod: Option<&Pod>, placed_uid: &str, key: &str, ended: bool) -> Option<PodGone> {
    let deleted = |message: String| {
        Some(PodGone {
            reason: REASON_POD_DELETED,
            message,
            disrupted: false,
        })
    };
    let evicted = |message: String| {
        Some(PodGone {
            reason: REASON_POD_EVICTED,
            message,
            disrupted: false,
        })
    };
    let Some(pod) = pod else {
        return deleted(format!("its Pod {key} was deleted"));
    };
    if pod.uid().as_deref() != Some(placed_uid) {
        return deleted(format!(
            "its Pod {key} was deleted (a Pod of that name now has another UID)"
        ));
    }
    let status = pod.status.as_ref();
    if let Some(c) = disruption(pod) {
        return Some(PodGone {
            reason: REASON_POD_EVICTED,
            message: format!(
                "its Pod {key} was evicted ({}): {}",
                c.reason.as_deref().unwrap_or("DisruptionTarget"),
                c.message.as_deref().unwrap_or("no message given")
            ),
            disrupted: true,
        });
    }
    if status.and_then(|s| s.reason.as_deref()) == Some("Evicted") {
        return evicted(format!(
            "its Pod {key} was evicted: {}",
            status
                .and_then(|s| s.message.as_deref())
                .unwrap_or("no message given")
        ));
    }
    if pod.metadata.deletion_timestamp.is_some() {
        return deleted(format!("its Pod {key} is being deleted"));
    }
    if !ended
        && let Err(state) = container_state(pod)
        && state.starts_with("terminated")
    {
        return evicted(format!(
            "the container {POD_CONTAINER} of its Pod {key} ended while the sandbox ran ({state})"
        ));
    }
    None
}

/// Whether the Sandbox's processes ended (as reported).
fn ended(obj: &SandboxObj) -> bool {
    obj.status.as_ref().is_some_and(|s| {
        matches!(
            s.phase,
            SandboxPhase::Failed | SandboxPhase::Succeeded | SandboxPhase::Aborted
        )
    })
}

impl Agent {
    /// The Pods store, once it holds its first full list (`None` before, and in
    /// standalone mode).
    pub(super) fn pods_synced(&self) -> Option<&kube::runtime::reflector::Store<Pod>> {
        let store = self.cache.get()?.pods.as_ref()?;
        matches!(store.wait_until_ready().now_or_never(), Some(Ok(()))).then_some(store)
    }

    /// Its Pod's key and name: the one its binding names (a warm pool Pod it
    /// adopted), else its own.
    fn pod_key(obj: &SandboxObj) -> (String, String) {
        let ns = obj.namespace().unwrap_or_default();
        let name = obj
            .status
            .as_ref()
            .and_then(|s| s.pod.as_ref())
            .map(|p| p.name.clone())
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| pod_name(&obj.name_any()));
        (format!("{ns}/{name}"), name)
    }

    /// Cluster mode, before a start: the UID of the Pod to start the sandbox in, or
    /// the action to wait with (its status says what it waits for).
    pub(super) async fn pod_to_start_in(
        &self,
        obj: &SandboxObj,
        uid: &str,
    ) -> std::result::Result<String, Action> {
        let Some(store) = self.pods_synced() else {
            return Err(Action::requeue(Duration::from_secs(1)));
        };
        let (key, name) = Self::pod_key(obj);
        let pod = store.get(&ObjectRef::new(&name).within(&obj.namespace().unwrap_or_default()));
        // Bound to a warm pool Pod it adopted, which the watch still shows in its pool.
        if pod
            .as_ref()
            .is_some_and(|p| p.labels().contains_key(LABEL_WARM_POOL))
        {
            return Err(Action::requeue(ADOPTION_SEEN));
        }
        match ready_to_start(pod.as_deref(), uid, &key, &self.cfg.node) {
            Ok(pod_uid) => Ok(pod_uid),
            Err(message) => {
                self.note_waiting(obj, REASON_WAITING_FOR_POD, message)
                    .await;
                Err(Action::requeue(POD_RECHECK))
            }
        }
    }

    /// Cluster mode, for a sandbox held here: why it must end because of its Pod. The
    /// Pod is the one it was placed in, found by UID: after a Full commit a parent runs
    /// in the winner's Pod, whose name is the winner's.
    pub(super) fn pod_gone(&self, obj: &SandboxObj, uid: &str) -> Option<PodGone> {
        let placed_uid = self.held.pod_of(uid)?;
        let store = self.pods_synced()?;
        let pod = store
            .state()
            .into_iter()
            .find(|p| p.uid().as_deref() == Some(placed_uid.as_str()));
        let key = match &pod {
            Some(p) => format!("{}/{}", p.namespace().unwrap_or_default(), p.name_any()),
            None => Self::pod_key(obj).0,
        };
        gone(
            pod.as_deref(),
            &placed_uid,
            &key,
            self.has_ended(obj, &placed_uid),
        )
    }

    /// Cluster mode: whether a Pod on this node still names the Sandbox with `uid` as
    /// an owner while another sandbox held here runs in it. A Full commit's winner keeps
    /// its finalizer until its Pod (the parent's sandbox runs in it) is handed to the
    /// parent: the Pod would otherwise be garbage-collected with the winner's Sandbox.
    /// A parent deleted meanwhile took its sandbox along: nothing to wait for then.
    pub(super) fn pod_held_for_another(&self, uid: &str) -> bool {
        let Some(store) = self.pods_synced() else {
            return true; // not known yet: wait for the list
        };
        let Some(placed) = self.held.pods() else {
            return true;
        };
        store.state().iter().any(|p| {
            let owned = p
                .metadata
                .owner_references
                .as_ref()
                .is_some_and(|o| o.iter().any(|o| o.uid == uid));
            let pod_uid = p.uid().unwrap_or_default();
            owned && placed.iter().any(|(s, pu)| s != uid && *pu == pod_uid)
        })
    }

    /// Whether the sandbox in the Pod with `pod_uid` ended: as reported, or as told
    /// to the Pod (the exit file is written before the report, and the watch may still
    /// deliver the Sandbox as Running while its Pod's container already exited).
    fn has_ended(&self, obj: &SandboxObj, pod_uid: &str) -> bool {
        ended(obj)
            || ramify_crds::pod::pod_volume_on_host(&self.cfg.kubelet_root_dir, pod_uid)
                .join(ramify_crds::pod::POD_EXIT_FILE)
                .exists()
    }

    /// Its Pod is gone (or going): the sandbox is destroyed, and a Sandbox that had not
    /// ended fails saying why (the Pod's deletion is not the workload's). A sandbox that
    /// had ended is only cleaned up: its Pod's cgroup and netns must not be held.
    #[instrument(skip_all, fields(sandbox = %obj.name_any(), reason = why.reason))]
    pub(super) async fn end_for_pod(
        &self,
        obj: &SandboxObj,
        uid: &str,
        h: Handle,
        why: PodGone,
    ) -> Result<Action> {
        // A branch run lets go of the sandbox at once.
        self.runners.stop(uid);
        let mut guard = h.lock().await;
        let Some(sb) = guard.as_ref() else {
            return Ok(Action::await_change());
        };
        let pod_uid = sb
            .placed
            .pod
            .as_ref()
            .map(|p| p.uid.as_str())
            .unwrap_or_default();
        if !self.has_ended(obj, pod_uid) {
            warn!(id = %sb.id, message = %why.message, "the sandbox must end (its Pod is gone, or its node drained): destroying it");
            // Said first: a failed teardown is retried with the Sandbox already Failed.
            self.write_sandbox_status(
                obj,
                SandboxPhase::Failed,
                Some(sb),
                (false, why.reason, why.message.clone()),
                json!({}),
            )
            .await?;
            self.metrics.failed("sandbox", "pod_gone");
            self.event(obj, true, why.reason, why.message.clone()).await;
        } else {
            info!(id = %sb.id, message = %why.message, "the sandbox had ended: cleaning it up");
        }
        if let Err(e) = self.engine.teardown(sb).await.map_err(Error::from) {
            self.cleanup_failed(obj, "destroy after its Pod went", &e);
            return Err(e);
        }
        *guard = None;
        drop(guard);
        self.take_handle(uid);
        self.decided.forget(uid);
        self.admission.capacity.leave(uid);
        self.publish_capacity();
        Ok(Action::await_change())
    }

    /// Cluster mode: a sandbox that could not start in its Pod (`pod_uid`) ends the Pod
    /// too, failed; a failure to say so is logged and counted (the start's own failure
    /// is what gets reported).
    pub(super) fn fail_pod(&self, obj: &SandboxObj, pod_uid: &str) {
        let volume = ramify_crds::pod::pod_volume_on_host(&self.cfg.kubelet_root_dir, pod_uid);
        if let Err(e) = crate::pod_files::write_exit(&volume, Some(1)) {
            self.cleanup_failed(obj, "end the Pod of a sandbox that did not start", &e);
        }
    }

    /// Cluster mode: the Pod learns that its sandbox ended (its `ramify-pod` exits with
    /// the code, so the Pod's phase follows the Sandbox's).
    pub(super) fn write_pod_exit(
        &self,
        sb: &ramify_engine::engine::LocalSandbox,
        code: Option<i32>,
    ) -> Result<()> {
        match &sb.placed.pod {
            Some(pod) => crate::pod_files::write_exit(&pod.volume, code),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const NODE: &str = "n1";
    const SBX: &str = "sbx-uid";

    fn pod(json: serde_json::Value) -> Pod {
        let mut base = json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "w", "namespace": "ns", "uid": "pod-uid",
                "ownerReferences": [{"apiVersion": "ramify.dev/v1alpha1", "kind": "Sandbox",
                    "name": "w", "uid": SBX, "controller": true}]},
            "spec": {"nodeName": NODE, "containers": [{"name": POD_CONTAINER}]},
            "status": {"containerStatuses": [{"name": POD_CONTAINER, "ready": true,
                "restartCount": 0, "image": "i", "imageID": "",
                "state": {"running": {}}}]}
        });
        merge(&mut base, json);
        serde_json::from_value(base).unwrap()
    }

    fn merge(a: &mut serde_json::Value, b: serde_json::Value) {
        match (a, b) {
            (serde_json::Value::Object(a), serde_json::Value::Object(b)) => {
                for (k, v) in b {
                    merge(a.entry(k).or_insert(serde_json::Value::Null), v);
                }
            }
            (a, b) => *a = b,
        }
    }

    /// A tenant can label a Pod of its own namespace as another tenant's pool Pod and
    /// name that Snapshot as its owner (the API server does not check owner references
    /// across namespaces): filling it would restore the other tenant's memory into it.
    #[test]
    fn only_the_snapshots_own_pool_pods_on_this_node_are_filled() {
        use ramify_engine::engine::PodSupply;
        let pool_pod = |name: &str, uid: &str, extra: serde_json::Value| {
            let mut p = pod(json!({"metadata": {"name": name, "uid": uid,
                "labels": {LABEL_WARM_POOL: "snap-uid"},
                "ownerReferences": [{"apiVersion": "ramify.dev/v1alpha1", "kind": "Snapshot",
                    "name": "snap", "uid": "snap-uid", "controller": true}]}}));
            let mut v = serde_json::to_value(&p).unwrap();
            merge(&mut v, extra);
            p = serde_json::from_value(v).unwrap();
            p
        };
        let (store, mut writer) = kube::runtime::reflector::store::<Pod>();
        for p in [
            pool_pod("ok", "u-ok", json!({})),
            pool_pod(
                "forged",
                "u-forged",
                json!({"metadata": {"namespace": "tenant-b"}}),
            ),
            pool_pod("elsewhere", "u-else", json!({"spec": {"nodeName": "n2"}})),
            pool_pod(
                "other-snap",
                "u-other",
                json!({"metadata": {"labels": {LABEL_WARM_POOL: "x"}}}),
            ),
            pool_pod(
                "going",
                "u-going",
                json!({"metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z"}}),
            ),
            pool_pod(
                "starting",
                "u-starting",
                json!({"status": {"containerStatuses": [{"name": POD_CONTAINER,
                "ready": false, "restartCount": 0, "image": "i", "imageID": "",
                "state": {"waiting": {"reason": "ContainerCreating"}}}]}}),
            ),
            // Adopted: a branch's now (label gone, owner the branch's Sandbox).
            pod(json!({"metadata": {"name": "adopted", "uid": "u-adopted"}})),
        ] {
            writer.apply_watcher_event(&kube::runtime::watcher::Event::Apply(p));
        }
        let supply = PoolPods {
            store,
            snapshot_uid: "snap-uid".into(),
            namespace: "ns".into(),
            node: NODE.into(),
        };
        let names: Vec<String> = supply.in_pool().into_iter().map(|p| p.name).collect();
        assert_eq!(names, ["ok"]);
        // An adopted Pod lives on (its branch waits in it for its claim); a Pod being
        // deleted, or another namespace's, does not.
        assert!(supply.lives("u-ok") && supply.lives("u-adopted"));
        assert!(!supply.lives("u-going") && !supply.lives("u-forged") && !supply.lives("nope"));
    }

    #[test]
    fn a_running_pod_of_this_sandbox_on_this_node_is_ready() {
        assert_eq!(
            ready_to_start(Some(&pod(json!({}))), SBX, "ns/w", NODE),
            Ok("pod-uid".into())
        );
    }

    #[test]
    fn otherwise_it_says_what_it_waits_for() {
        let wait = |p: Option<Pod>| ready_to_start(p.as_ref(), SBX, "ns/w", NODE).unwrap_err();
        assert!(wait(None).contains("to be scheduled to node n1"));
        let other = pod(json!({"metadata": {"ownerReferences": [{"apiVersion": "v1",
            "kind": "Sandbox", "name": "w", "uid": "someone-else", "controller": true}]}}));
        assert!(wait(Some(other)).contains("not controlled by this Sandbox"));
        let deleting = pod(json!({"metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z"}}));
        assert!(wait(Some(deleting)).contains("being deleted"));
        let elsewhere = pod(json!({"spec": {"nodeName": "n2"}}));
        assert!(wait(Some(elsewhere)).contains("(it is on n2)"));
        let creating = pod(
            json!({"status": {"containerStatuses": [{"name": POD_CONTAINER,
            "ready": false, "restartCount": 0, "image": "i", "imageID": "",
            "state": {"waiting": {"reason": "ContainerCreating"}}}]}}),
        );
        let m = wait(Some(creating));
        assert!(
            m.contains("container sandbox") && m.contains("ContainerCreating"),
            "{m}"
        );
        let no_status = pod(json!({"status": {"containerStatuses": []}}));
        assert!(wait(Some(no_status)).contains("not started yet"));
    }

    #[test]
    fn a_live_pod_keeps_its_sandbox() {
        assert_eq!(gone(Some(&pod(json!({}))), "pod-uid", "ns/w", false), None);
    }

    #[test]
    fn deletion_and_eviction_end_the_sandbox_with_their_reasons() {
        let g = |p: Option<Pod>| gone(p.as_ref(), "pod-uid", "ns/w", false).unwrap();
        assert_eq!(g(None).reason, REASON_POD_DELETED);
        let replaced = pod(json!({"metadata": {"uid": "new-uid"}}));
        assert_eq!(g(Some(replaced)).reason, REASON_POD_DELETED);
        let deleting = pod(json!({"metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z"}}));
        assert_eq!(g(Some(deleting)).reason, REASON_POD_DELETED);
        let kubelet = pod(json!({"status": {"phase": "Failed", "reason": "Evicted",
            "message": "The node was low on resource: memory."}}));
        let e = g(Some(kubelet));
        assert_eq!(e.reason, REASON_POD_EVICTED);
        assert!(e.message.contains("low on resource"), "{}", e.message);
        assert!(
            !e.disrupted,
            "the kubelet stopped it already: nothing left to move"
        );
        let drained = pod(
            json!({"metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z"},
            "status": {"conditions": [{"type": "DisruptionTarget", "status": "True",
                "reason": "EvictionByEvictionAPI", "message": "Eviction API: evicting"}]}}),
        );
        let e = g(Some(drained.clone()));
        assert_eq!(e.reason, REASON_POD_EVICTED);
        assert!(e.message.contains("EvictionByEvictionAPI"), "{}", e.message);
        assert!(e.disrupted, "a workspace moves out of it");
        assert!(
            ready_to_start(Some(&drained), SBX, "ns/w", NODE)
                .unwrap_err()
                .contains("being deleted")
        );
        let marked = pod(
            json!({"status": {"conditions": [{"type": "DisruptionTarget",
            "status": "True", "reason": "EvictionByEvictionAPI"}]}}),
        );
        assert!(
            ready_to_start(Some(&marked), SBX, "ns/w", NODE)
                .unwrap_err()
                .contains("being evicted"),
            "a Pod on its way out is never started in"
        );
        let died = pod(
            json!({"status": {"containerStatuses": [{"name": POD_CONTAINER,
            "ready": false, "restartCount": 0, "image": "i", "imageID": "",
            "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}]}}),
        );
        let e = g(Some(died.clone()));
        assert_eq!(e.reason, REASON_POD_EVICTED);
        assert!(e.message.contains("OOMKilled"), "{}", e.message);
        // Once the sandbox ended, its container exits by design; a deletion still counts.
        assert_eq!(gone(Some(&died), "pod-uid", "ns/w", true), None);
        assert!(gone(None, "pod-uid", "ns/w", true).is_some());
    }

    #[test]
    fn pod_events_map_to_their_sandbox() {
        let r = sandbox_of(&pod(json!({}))).unwrap();
        assert_eq!(r.name, "w");
        assert_eq!(r.namespace.as_deref(), Some("ns"));
        let orphan = pod(json!({"metadata": {"ownerReferences": []}}));
        assert!(sandbox_of(&orphan).is_none());
    }
}
