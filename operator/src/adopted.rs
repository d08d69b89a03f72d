//! Cluster mode: warm pool Pods this operator adopted for a branch and its Pod watch
//! may not show so yet (see [`crate::warm_pods`]). Held in the context, shared by every
//! reconcile.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;

/// How long an adoption is remembered for the Pod watch to catch up with it.
const ADOPTED_MEMORY: Duration = Duration::from_secs(600);

/// Pool Pods adopted by this operator and perhaps not yet seen so by its Pod watch, by
/// the adopting Sandbox's UID: a look at the branch before the watch catches up must
/// bind it to the Pod it adopted, not adopt a second one.
#[derive(Default)]
pub struct Adopted {
    by_sandbox: Mutex<HashMap<String, (Pod, Instant)>>,
}

impl Adopted {
    pub(crate) fn record(&self, sandbox_uid: &str, pod: Pod) {
        if let Ok(mut m) = self.by_sandbox.lock() {
            m.retain(|_, (_, at)| at.elapsed() < ADOPTED_MEMORY);
            m.insert(sandbox_uid.to_string(), (pod, Instant::now()));
        }
    }

    pub(crate) fn of(&self, sandbox_uid: &str) -> Option<Pod> {
        let m = self.by_sandbox.lock().ok()?;
        m.get(sandbox_uid)
            .filter(|(_, at)| at.elapsed() < ADOPTED_MEMORY)
            .map(|(p, _)| p.clone())
    }

    pub(crate) fn taken(&self, pod_uid: &str) -> bool {
        self.by_sandbox.lock().is_ok_and(|m| {
            m.values()
                .any(|(p, at)| at.elapsed() < ADOPTED_MEMORY && p.uid().as_deref() == Some(pod_uid))
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(uid: &str) -> Pod {
        serde_json::from_value(json!({"metadata": {"name": "p", "uid": uid}})).unwrap()
    }

    #[test]
    fn an_adoption_is_remembered_for_its_sandbox_and_its_pod() {
        let a = Adopted::default();
        assert!(a.of("s1").is_none() && !a.taken("p1"));
        a.record("s1", pod("p1"));
        assert_eq!(a.of("s1").unwrap().uid().as_deref(), Some("p1"));
        assert!(a.taken("p1"));
        assert!(!a.taken("p2"));
        assert!(a.of("s2").is_none());
    }
}
