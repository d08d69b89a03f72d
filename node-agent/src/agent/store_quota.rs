//! The snapshot store's quota (`--snapshot-store-quota`): the recorded images of a node
//! never add up to more (an image being captured is counted once its size is known,
//! so the disk may hold it over the quota meanwhile). Before a capture, and again once
//! its size is known, images that no
//! live object needs are evicted, least recently used first; a referenced image is
//! never evicted, and when only referenced ones are left the new snapshot is refused
//! with reason `StoreFull` saying what holds the space.
//!
//! Referenced: a Snapshot somebody created (not a BranchSet's automatic one), the
//! automatic snapshot of a BranchSet that has not ended, any Snapshot a BranchSet
//! that has not ended forks from, or one a Sandbox waits to be restored from. What is
//! left, an ended BranchSet's automatic snapshot, is only a record of the fork point:
//! evicting it frees its image and marks it `Expired` (reason `Evicted`), and the set's
//! `ttlSecondsAfterFinished` deletes it later. An image a live sandbox still reads (a
//! lazy restore) is never evicted, and a deleted one is counted until its last reader
//! ends (`store/held.rs`).

use kube::ResourceExt;
use ramify_crds::{
    BranchSet, Condition, ConditionStatus, ConditionsExt, REASON_EVICTED, Sandbox as SandboxObj,
    SandboxPhase, Snapshot as SnapshotObj, SnapshotPhase,
};
use serde_json::json;
use tracing::{info, instrument};

use super::{Agent, admission, now, writes};
use crate::error::Result;

/// `1536` -> `1.5 KiB`: sizes in messages, exact enough to compare.
fn bytes_text(b: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < units.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", units[i])
    }
}

/// A Snapshot on this node whose image could go.
struct Candidate {
    snap: SnapshotObj,
    image_id: String,
    bytes: u64,
    last_used_ms: u64,
    /// Set when only the watch cache's view of this BranchSet holds it.
    unsure_owner: Option<(String, String)>,
}

/// What the store holds, from the caches: images that may go (least recently used
/// first), images held only until the API confirms their set ended, and the names of
/// the kept ones.
#[derive(Default)]
struct Candidates {
    free: Vec<Candidate>,
    unsure: Vec<Candidate>,
    held: Vec<String>,
}

/// Why a snapshot's image stays, or that it may go.
#[derive(Debug, PartialEq, Eq)]
enum Hold {
    /// Needed by a live object: never evicted.
    Kept,
    /// Held only because the watch cache does not show its BranchSet ended (yet):
    /// the API server is asked before a refusal, since a watch may lag a set that
    /// just ended.
    OwnerNotSeenEnded { owner: String, uid: String },
    /// Nothing needs it.
    Free,
}

/// Whether `snap` is needed by a live object, judged from the agent's watch caches.
fn hold(snap: &SnapshotObj, sets: &[BranchSet], sandboxes: &[SandboxObj]) -> Hold {
    let ns = snap.namespace();
    let name = snap.name_any();
    let owner = snap
        .owner_references()
        .iter()
        .find(|o| o.kind == "BranchSet" && o.controller == Some(true));
    let Some(owner) = owner else {
        return Hold::Kept; // created by someone: theirs to delete
    };
    let ended = |b: &BranchSet| b.status.as_ref().is_some_and(|s| s.phase.is_ended());
    let same_ns = |b: &BranchSet| b.namespace() == ns;
    let forked_from = sets.iter().any(|b| {
        same_ns(b) && !ended(b) && b.spec.source.snapshot.as_deref() == Some(name.as_str())
    });
    let restoring = sandboxes.iter().any(|s| {
        s.namespace() == ns
            && s.spec
                .restore_from
                .as_ref()
                .is_some_and(|r| r.snapshot == name)
            && s.status
                .as_ref()
                .is_none_or(|st| st.phase != SandboxPhase::Running)
    });
    if forked_from || restoring {
        return Hold::Kept;
    }
    // An owner this agent does not see (not yet labelled, or going), or not ended.
    let owner_ended = sets
        .iter()
        .find(|b| same_ns(b) && b.uid().as_deref() == Some(owner.uid.as_str()))
        .is_some_and(ended);
    if owner_ended {
        Hold::Free
    } else {
        Hold::OwnerNotSeenEnded {
            owner: owner.name.clone(),
            uid: owner.uid.clone(),
        }
    }
}

/// Whether `snap` is needed by a live object (see [`hold`]), trusting the caches.
#[cfg(test)]
fn referenced(snap: &SnapshotObj, sets: &[BranchSet], sandboxes: &[SandboxObj]) -> bool {
    hold(snap, sets, sandboxes) != Hold::Free
}

impl Agent {
    /// The Snapshots of this node whose images nothing needs (least recently used
    /// first), those held only by the cache's view of their BranchSet, and the names of
    /// those that are needed (for the refusal's message).
    fn eviction_candidates(&self) -> Result<Candidates> {
        let mut out = Candidates::default();
        let Some(cache) = self.cache.get() else {
            return Ok(out);
        };
        let ok = |o: &std::sync::Arc<kube::core::DeserializeGuard<_>>| o.0.as_ref().ok().cloned();
        let sets: Vec<BranchSet> = cache.branchsets.state().iter().filter_map(ok).collect();
        let sandboxes: Vec<SandboxObj> = [&cache.bound, &cache.pinned]
            .iter()
            .flat_map(|s| s.state())
            .filter_map(|o| o.0.as_ref().ok().cloned())
            .collect();
        // Images live sandboxes read (lazy restores): evicting one frees nothing.
        let read = self.engine.store().images_read();
        for o in cache.snapshots.state() {
            let Ok(snap) = &o.0 else { continue };
            let Some(rec) = snap
                .uid()
                .and_then(|u| self.registry.snapshot(&u).ok().flatten())
            else {
                continue; // no image here
            };
            let Ok(meta) = self.engine.store().meta(&rec.image_id) else {
                continue;
            };
            if read.contains_key(&rec.image_id) {
                out.held.push(format!(
                    "{}/{} (read by a live sandbox)",
                    rec.namespace, rec.name
                ));
                continue;
            }
            let unsure_owner = match hold(snap, &sets, &sandboxes) {
                Hold::Kept => {
                    out.held.push(format!("{}/{}", rec.namespace, rec.name));
                    continue;
                }
                Hold::OwnerNotSeenEnded { owner, uid } => Some((owner, uid)),
                Hold::Free => None,
            };
            let c = Candidate {
                snap: snap.clone(),
                last_used_ms: self.engine.store().last_used_ms(&meta),
                bytes: meta.size_bytes,
                image_id: rec.image_id,
                unsure_owner,
            };
            if c.unsure_owner.is_some() {
                out.unsure.push(c);
            } else {
                out.free.push(c);
            }
        }
        out.free.sort_by_key(|c| c.last_used_ms);
        out.unsure.sort_by_key(|c| c.last_used_ms);
        out.held.sort();
        Ok(out)
    }

    /// Whether the API server says `c`'s BranchSet has ended (or is gone): the watch
    /// cache may not have caught up with a set that ended a moment ago.
    async fn owner_ended_now(&self, c: &Candidate) -> Result<bool> {
        let Some((owner, uid)) = &c.unsure_owner else {
            return Ok(true);
        };
        let api: kube::Api<BranchSet> =
            kube::Api::namespaced(self.client.clone(), &c.snap.namespace().unwrap_or_default());
        Ok(match api.get_opt(owner).await? {
            Some(b) if b.uid().as_deref() == Some(uid.as_str()) => {
                b.status.as_ref().is_some_and(|s| s.phase.is_ended())
            }
            // Gone, or a new set of the same name: the snapshot's owner is no more
            // (the garbage collector deletes the snapshot too).
            _ => true,
        })
    }

    /// Makes room for an image of `need` bytes under the quota, evicting what no
    /// object needs; `in_store` of them are already in the store (a captured image
    /// not yet recorded). `Ok(None)`: it fits; `Ok(Some(reason))`: it does not, and why.
    #[instrument(skip(self))]
    pub(super) async fn make_store_room(&self, need: u64, in_store: u64) -> Result<Option<String>> {
        let quota = self.cfg.snapshot_store_quota;
        if quota == 0 {
            return Ok(None);
        }
        loop {
            let used = self.engine.store().total_bytes()?.saturating_sub(in_store);
            if used.saturating_add(need) <= quota {
                return Ok(None);
            }
            let Candidates {
                free,
                unsure,
                mut held,
            } = self.eviction_candidates()?;
            let mut next = free.into_iter().next();
            if next.is_none() {
                // Before refusing: the sets the cache does not show ended, as the API
                // server has them now.
                for c in unsure {
                    if self.owner_ended_now(&c).await? {
                        info!(snapshot = %c.snap.name_any(), "its BranchSet ended, as the API server says (the watch had not shown it yet)");
                        next = Some(c);
                        break;
                    }
                    held.push(format!(
                        "{}/{}",
                        c.snap.namespace().unwrap_or_default(),
                        c.snap.name_any()
                    ));
                }
                held.sort();
            }
            let Some(c) = next else {
                let mut names = held.iter().take(5).cloned().collect::<Vec<_>>().join(", ");
                if held.len() > 5 {
                    names.push_str(&format!(" and {} more", held.len() - 5));
                }
                return Ok(Some(format!(
                    "the snapshot store of node {} is full: {} of its {} quota is used by {} snapshots still referenced ({names}), and this image needs {}; delete Snapshots or BranchSets that are done, or raise the agent's --snapshot-store-quota",
                    self.cfg.node,
                    bytes_text(used),
                    bytes_text(quota),
                    held.len(),
                    bytes_text(need),
                )));
            };
            self.evict(&c, used, quota).await?;
        }
    }

    /// Frees `c`'s image and marks its Snapshot `Expired` (reason `Evicted`).
    async fn evict(&self, c: &Candidate, used: u64, quota: u64) -> Result<()> {
        let uid = c.snap.uid().unwrap_or_default();
        if let Err(e) = self.pools.replace(&uid, None).await {
            self.cleanup_failed(&c.snap, "close warm pool", &e);
        }
        self.admission.capacity.leave(&admission::pool_key(&uid));
        self.engine.store().remove(&c.image_id)?;
        self.registry.remove_snapshot(&uid)?;
        let message = format!(
            "image evicted from node {}'s snapshot store ({} of its {} quota used): its BranchSet ended and nothing forks from it; it was the least recently used of those",
            self.cfg.node,
            bytes_text(used),
            bytes_text(quota)
        );
        info!(snapshot = %c.snap.name_any(), bytes = c.bytes, "evicted from the snapshot store");
        let mut conditions = c.snap.status.clone().unwrap_or_default().conditions;
        conditions.set_condition(
            Condition::new(
                "Ready",
                ConditionStatus::False,
                REASON_EVICTED,
                message.clone(),
                c.snap.metadata.generation,
            ),
            now(),
        );
        let body = json!({
            "phase": SnapshotPhase::Expired,
            "conditions": conditions.iter().filter(|c| c.type_ == "Ready").collect::<Vec<_>>(),
        });
        let api: kube::Api<SnapshotObj> =
            kube::Api::namespaced(self.client.clone(), &c.snap.namespace().unwrap_or_default());
        writes::status(
            &api,
            &c.snap.name_any(),
            ramify_crds::MANAGER_AGENT_SNAPSHOT,
            None,
            &body,
        )
        .await?;
        self.event(&c.snap, false, REASON_EVICTED, message).await;
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn obj<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> T {
        serde_json::from_value(v).unwrap()
    }

    fn snap(name: &str, owner: Option<&str>) -> SnapshotObj {
        let owners = owner.map(|o| {
            json!([{"apiVersion": "ramify.dev/v1alpha1", "kind": "BranchSet", "name": o,
                    "uid": format!("uid-{o}"), "controller": true}])
        });
        obj(json!({
            "apiVersion": "ramify.dev/v1alpha1", "kind": "Snapshot",
            "metadata": {"name": name, "namespace": "n", "ownerReferences": owners.unwrap_or(json!([]))},
            "spec": {"source": {"sandbox": "w"}}
        }))
    }

    fn set(name: &str, phase: &str, from: Option<&str>) -> BranchSet {
        let source = match from {
            Some(s) => json!({"snapshot": s}),
            None => json!({"sandbox": "w"}),
        };
        obj(json!({
            "apiVersion": "ramify.dev/v1alpha1", "kind": "BranchSet",
            "metadata": {"name": name, "namespace": "n", "uid": format!("uid-{name}")},
            "spec": {"source": source, "replicas": 1},
            "status": {"phase": phase}
        }))
    }

    fn restoring(from: &str, phase: &str) -> SandboxObj {
        obj(json!({
            "apiVersion": "ramify.dev/v1alpha1", "kind": "Sandbox",
            "metadata": {"name": "r", "namespace": "n"},
            "spec": {"restoreFrom": {"snapshot": from}},
            "status": {"phase": phase}
        }))
    }

    #[test]
    fn sizes_read_as_people_write_them() {
        assert_eq!(bytes_text(512), "512 B");
        assert_eq!(bytes_text(1536), "1.5 KiB");
        assert_eq!(bytes_text(3 << 30), "3.0 GiB");
    }

    #[test]
    fn only_an_ended_sets_own_snapshot_that_nothing_forks_from_may_go() {
        let done = set("done", "Committed", None);
        let running = set("running", "Running", None);
        // A user's Snapshot, and a running set's own, are always kept.
        assert!(referenced(
            &snap("mine", None),
            std::slice::from_ref(&done),
            &[]
        ));
        assert!(referenced(
            &snap("running-s", Some("running")),
            &[running],
            &[]
        ));
        // An owner this agent does not see is kept too.
        assert!(referenced(&snap("x", Some("unseen")), &[], &[]));
        // An ended set's own snapshot may go...
        let s = snap("done-s", Some("done"));
        assert!(!referenced(&s, std::slice::from_ref(&done), &[]));
        // ...unless a live set forks from it, or a sandbox waits to restore it.
        let forks = set("again", "Forking", Some("done-s"));
        assert!(referenced(&s, &[done.clone(), forks], &[]));
        let forked = set("again", "Exhausted", Some("done-s"));
        assert!(!referenced(&s, &[done.clone(), forked], &[]));
        assert!(referenced(
            &s,
            std::slice::from_ref(&done),
            &[restoring("done-s", "Starting")]
        ));
        assert!(!referenced(&s, &[done], &[restoring("done-s", "Running")]));
    }

    #[test]
    fn a_set_the_cache_does_not_show_ended_is_asked_of_the_api_server_before_a_refusal() {
        let running = set("running", "Running", None);
        let unsure =
            |h: Hold| matches!(h, Hold::OwnerNotSeenEnded { ref owner, .. } if owner == "running");
        // Not ended in the cache, or not in it at all: only the API server can say.
        assert!(unsure(hold(
            &snap("running-s", Some("running")),
            std::slice::from_ref(&running),
            &[]
        )));
        assert!(unsure(hold(&snap("running-s", Some("running")), &[], &[])));
        // Something live needs it: kept whatever its set is.
        let forks = set("again", "Forking", Some("running-s"));
        assert_eq!(
            hold(&snap("running-s", Some("running")), &[running, forks], &[]),
            Hold::Kept
        );
    }
}
