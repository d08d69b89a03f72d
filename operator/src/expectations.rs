//! What the BranchSet reconciler created and its watch has not shown it yet (the
//! "expectations" of Kubernetes' own ReplicaSet controller). A set's reconcile plans
//! from the informer cache, and its next reconcile (triggered by its own status write
//! or by one branch's event) often starts before the watch delivered the branches it
//! just created: without this it created them all again (answered 409) and bound each
//! again, an API create and a status write per missing branch per reconcile (at 40
//! sets of 10 on a busy API server, 632 repeated creates and as many binds).
//!
//! Only an optimisation over the cache: lost with the process (a new operator creates
//! again and gets 409, as before), and an entry is trusted for [`PATIENCE`] at most.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a creation is trusted to show up in the cache before it is made again.
pub const PATIENCE: Duration = Duration::from_secs(30);

/// Objects created but not yet observed, by key (see [`key`]).
#[derive(Default)]
pub struct Expectations {
    created: Mutex<HashMap<String, Instant>>,
}

/// The key of object `name` created for the BranchSet of uid `owner_uid` (a set
/// deleted and created again under its name has another uid: its objects are its own).
pub fn key(owner_uid: &str, name: &str) -> String {
    format!("{owner_uid}/{name}")
}

impl Expectations {
    /// Records that `key` was created just now.
    pub fn created(&self, key: String) {
        self.created_at(key, Instant::now());
    }

    fn created_at(&self, key: String, at: Instant) {
        if let Ok(mut m) = self.created.lock() {
            // Entries past their patience go here, so the map stays small.
            m.retain(|_, t| at.saturating_duration_since(*t) < PATIENCE);
            m.insert(key, at);
        }
    }

    /// Whether `key` was created within [`PATIENCE`] and not observed since: it must
    /// not be created again yet.
    pub fn pending(&self, key: &str) -> bool {
        self.pending_at(key, Instant::now())
    }

    fn pending_at(&self, key: &str, now: Instant) -> bool {
        self.created
            .lock()
            .ok()
            .and_then(|m| m.get(key).copied())
            .is_some_and(|t| now.saturating_duration_since(t) < PATIENCE)
    }

    /// The cache holds `key` now: nothing is expected of it any more.
    pub fn observed(&self, key: &str) {
        if let Ok(mut m) = self.created.lock() {
            m.remove(key);
        }
    }

    /// Entries held (for tests).
    pub fn len(&self) -> usize {
        self.created.lock().map(|m| m.len()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_creation_is_pending_until_observed_or_past_its_patience() {
        let e = Expectations::default();
        let t0 = Instant::now();
        let k = key("uid-1", "bs-b0");
        assert!(!e.pending_at(&k, t0), "nothing created yet");
        e.created_at(k.clone(), t0);
        assert!(e.pending_at(&k, t0 + Duration::from_secs(1)));
        // Another set of the same name (another uid) expects nothing.
        assert!(!e.pending_at(&key("uid-2", "bs-b0"), t0));
        e.observed(&k);
        assert!(!e.pending_at(&k, t0 + Duration::from_secs(1)));

        // Never observed: created again once its patience ran out.
        e.created_at(k.clone(), t0);
        assert!(e.pending_at(&k, t0 + PATIENCE - Duration::from_millis(1)));
        assert!(!e.pending_at(&k, t0 + PATIENCE));
    }

    #[test]
    fn stale_entries_are_pruned() {
        let e = Expectations::default();
        let t0 = Instant::now();
        for i in 0..100 {
            e.created_at(key("uid", &format!("b{i}")), t0);
        }
        assert_eq!(e.len(), 100);
        e.created_at(key("uid", "late"), t0 + PATIENCE);
        assert_eq!(e.len(), 1, "only the new entry is left");
    }
}
