//! The sandboxes this node agent holds: each one's handle (the engine's
//! [`LocalSandbox`] behind a lock a branch run or a commit holds while it works), the
//! Pod it was placed in (cluster mode), one reconcile at a time per Sandbox, and
//! whether its Running report landed. The Sandbox controller and everything else
//! that needs a held sandbox go through this type; nothing else keeps that state.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use ramify_engine::engine::LocalSandbox;
use tokio::sync::Mutex as AsyncMutex;

use super::Handle;
use super::metrics::AgentMetrics;

pub(super) struct HeldSandboxes {
    metrics: AgentMetrics,
    /// Live local sandboxes by Sandbox object uid.
    handles: Mutex<HashMap<String, Handle>>,
    /// Cluster mode: the UID of the Pod each held sandbox was placed in, by Sandbox
    /// uid (read without the handle's lock, which a branch run holds for long).
    placed_pods: Mutex<HashMap<String, String>>,
    /// One reconcile at a time per Sandbox uid: two watches (bound here, and pinned
    /// here by spec) can deliver the same sandbox.
    in_flight: Mutex<HashMap<String, Arc<AsyncMutex<()>>>>,
    /// Sandboxes this process has reported Running: an older copy of the object (the
    /// other watch may deliver one) must not make it report again, with less.
    reported: Mutex<HashSet<String>>,
    /// What a sandbox's Running report carries (its provenance), until it lands.
    unreported: Mutex<HashMap<String, serde_json::Value>>,
}

impl HeldSandboxes {
    pub(super) fn new(metrics: AgentMetrics) -> Self {
        HeldSandboxes {
            metrics,
            handles: Mutex::default(),
            placed_pods: Mutex::default(),
            in_flight: Mutex::default(),
            reported: Mutex::default(),
            unreported: Mutex::default(),
        }
    }

    fn count(&self, n: usize) {
        self.metrics
            .sandboxes
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    pub(super) fn get(&self, uid: &str) -> Option<Handle> {
        self.handles.lock().ok()?.get(uid).cloned()
    }

    /// Holds `sb` as the sandbox of `uid`.
    pub(super) fn insert(&self, uid: &str, sb: LocalSandbox) -> Handle {
        let h: Handle = Arc::new(AsyncMutex::new(Some(sb)));
        if let Ok(mut m) = self.handles.lock() {
            m.insert(uid.to_string(), h.clone());
            self.count(m.len());
        }
        h
    }

    /// Lets go of the sandbox of `uid` (its Pod placement is the caller's to clear).
    pub(super) fn take(&self, uid: &str) -> Option<Handle> {
        let mut m = self.handles.lock().ok()?;
        let h = m.remove(uid);
        self.count(m.len());
        h
    }

    /// The uids of every held sandbox.
    pub(super) fn uids(&self) -> Vec<String> {
        self.handles
            .lock()
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default()
    }

    /// Every held sandbox with its uid.
    pub(super) fn all(&self) -> Vec<(String, Handle)> {
        self.handles
            .lock()
            .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default()
    }

    /// The lock that keeps reconciles of one Sandbox one at a time.
    pub(super) fn reconcile_slot(&self, uid: &str) -> Option<Arc<AsyncMutex<()>>> {
        Some(
            self.in_flight
                .lock()
                .ok()?
                .entry(uid.to_string())
                .or_default()
                .clone(),
        )
    }

    /// Records that `uid` lives in the Pod `pod` (none: in no Pod any more). Returns
    /// the Pod it left, when no other held sandbox lives there.
    pub(super) fn place(&self, uid: &str, pod: Option<&str>) -> Option<String> {
        let mut m = self.placed_pods.lock().ok()?;
        let old = match pod {
            Some(p) => m.insert(uid.to_string(), p.to_string()),
            None => m.remove(uid),
        };
        old.filter(|o| Some(o.as_str()) != pod && !m.values().any(|v| v == o))
    }

    /// The Pod the sandbox of `uid` lives in.
    pub(super) fn pod_of(&self, uid: &str) -> Option<String> {
        self.placed_pods.lock().ok()?.get(uid).cloned()
    }

    /// Every Pod a held sandbox lives in, by Sandbox uid.
    pub(super) fn pods(&self) -> Option<HashMap<String, String>> {
        self.placed_pods.lock().ok().map(|m| m.clone())
    }

    /// What the Running report of `uid` is to carry, until it lands.
    pub(super) fn to_report(&self, uid: &str, extra: serde_json::Value) {
        if let Ok(mut u) = self.unreported.lock() {
            u.insert(uid.to_string(), extra);
        }
    }

    /// What the Running report of `uid` carries (nothing noted: an empty object).
    pub(super) fn report_of(&self, uid: &str) -> serde_json::Value {
        self.unreported
            .lock()
            .ok()
            .and_then(|u| u.get(uid).cloned())
            .unwrap_or_else(|| serde_json::json!({}))
    }

    pub(super) fn mark_reported(&self, uid: &str) {
        if let Ok(mut u) = self.unreported.lock() {
            u.remove(uid);
        }
        if let Ok(mut r) = self.reported.lock() {
            r.insert(uid.to_string());
        }
    }

    pub(super) fn is_reported(&self, uid: &str) -> bool {
        self.reported
            .lock()
            .map(|r| r.contains(uid))
            .unwrap_or(false)
    }

    /// Forgets what this process noted of a sandbox it no longer holds (deleted, or
    /// moved to another node): its reconcile slot and whether it was reported.
    pub(super) fn forget(&self, uid: &str) {
        if let Ok(mut m) = self.in_flight.lock() {
            m.remove(uid);
        }
        if let Ok(mut r) = self.reported.lock() {
            r.remove(uid);
        }
        if let Ok(mut u) = self.unreported.lock() {
            u.remove(uid);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_pod_is_left_only_when_no_held_sandbox_lives_there() {
        let held = HeldSandboxes::new(AgentMetrics::new("release-test", &Default::default()));
        assert_eq!(held.place("a", Some("pod-1")), None);
        assert_eq!(held.place("b", Some("pod-1")), None);
        // a moves out: b still lives in pod-1.
        assert_eq!(held.place("a", None), None);
        assert_eq!(held.pod_of("b").as_deref(), Some("pod-1"));
        // b moves to pod-2: pod-1 is left.
        assert_eq!(held.place("b", Some("pod-2")), Some("pod-1".into()));
        assert_eq!(held.place("b", Some("pod-2")), None);
        assert_eq!(held.pods().unwrap().len(), 1);
    }

    #[test]
    fn a_report_is_noted_until_it_lands_and_forgotten_with_the_sandbox() {
        let held = HeldSandboxes::new(AgentMetrics::new("release-test", &Default::default()));
        held.to_report("a", serde_json::json!({"from": "snap"}));
        assert_eq!(held.report_of("a")["from"], "snap");
        assert!(!held.is_reported("a"));
        held.mark_reported("a");
        assert!(held.is_reported("a"));
        assert_eq!(held.report_of("a"), serde_json::json!({}));
        held.forget("a");
        assert!(!held.is_reported("a"));
    }
}
