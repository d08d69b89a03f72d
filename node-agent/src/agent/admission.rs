//! The agent's second line of defence on capacity, and what it knows of sandboxes in
//! flight.
//!
//! - Before anything is started or restored for a Sandbox, its request must be
//!   granted by the node's capacity gate and (for a cold restore or a fresh start) a
//!   restore slot must be free. Both queue fairly by BranchSet. A sandbox that waits
//!   is not polled: the gate re-runs its reconcile the moment it is granted.
//! - A start or restore in flight is claimed (in memory, before it begins), and a
//!   Sandbox whose deletion this agent completed is remembered: a deletion never
//!   releases the finalizer while a start for that sandbox may still be running, and a
//!   stale copy of a deleted object (one watch lags the other) never starts it again.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::channel::mpsc::{UnboundedReceiver, UnboundedSender, unbounded};
use kube::ResourceExt;
use kube::core::DeserializeGuard;
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use ramify_crds::capacity::{
    self as cap, CONDITION_READY, REASON_EXCEEDS_ALLOCATABLE, REASON_WAITING_FOR_CAPACITY,
    Requests, group_of, rank_of,
};
use ramify_crds::{ConditionsExt, Sandbox as SandboxObj, SandboxPhase};
use serde_json::json;
use tracing::{info, warn};

use super::Agent;
use crate::capacity::{FairGate, ONE_RESTORE, restore_slots};
use crate::error::Result;

/// How many completed deletions are remembered (stale copies arrive within seconds).
const TOMBSTONES: usize = 4096;
/// A waiting sandbox is looked at again after this long even without a grant (a
/// safety net; grants re-run its reconcile at once).
const WAIT_RECHECK: Duration = Duration::from_secs(60);

type SandboxRef = ObjectRef<DeserializeGuard<SandboxObj>>;

/// Who to wake when a gate grants a key.
#[derive(Default)]
struct Triggers {
    refs: Mutex<HashMap<String, SandboxRef>>,
    subscribers: Mutex<Vec<UnboundedSender<SandboxRef>>>,
}

impl Triggers {
    fn fire(&self, key: &str) {
        let Some(r) = self.refs.lock().ok().and_then(|m| m.get(key).cloned()) else {
            return; // not a Sandbox (a warm-pool refill)
        };
        if let Ok(mut subs) = self.subscribers.lock() {
            subs.retain(|tx| tx.unbounded_send(r.clone()).is_ok());
        }
    }
}

/// Capacity, restore slots, starts in flight and completed deletions of this node.
pub struct Admission {
    pub capacity: Arc<FairGate>,
    pub restores: Arc<FairGate>,
    triggers: Arc<Triggers>,
    starting: Mutex<HashSet<String>>,
    gone: Mutex<(HashSet<String>, VecDeque<String>)>,
}

/// A start or restore in flight for a sandbox (released on drop).
pub struct StartClaim<'a> {
    admission: &'a Admission,
    uid: String,
}

impl Drop for StartClaim<'_> {
    fn drop(&mut self) {
        if let Ok(mut s) = self.admission.starting.lock() {
            s.remove(&self.uid);
        }
    }
}

/// The capacity gate's key for the warm pool of a Snapshot (by uid).
pub fn pool_key(snapshot_uid: &str) -> String {
    format!("pool/{snapshot_uid}")
}

impl Admission {
    /// The restore gate as the engine's warm pools queue in it.
    pub fn restore_slots(&self) -> Arc<dyn ramify_engine::RestoreSlots> {
        Arc::new(crate::capacity::RestoreGate(self.restores.clone()))
    }

    pub fn new(allocatable: Requests, max_restores: usize) -> Self {
        let triggers = Arc::new(Triggers::default());
        let (t1, t2) = (triggers.clone(), triggers.clone());
        Self {
            capacity: Arc::new(FairGate::new(allocatable, move |k| t1.fire(k))),
            restores: Arc::new(FairGate::new(restore_slots(max_restores), move |k| {
                t2.fire(k)
            })),
            triggers,
            starting: Mutex::new(HashSet::new()),
            gone: Mutex::new((HashSet::new(), VecDeque::new())),
        }
    }

    /// A stream of Sandboxes to reconcile again: each one a gate granted.
    pub fn subscribe(&self) -> UnboundedReceiver<SandboxRef> {
        let (tx, rx) = unbounded();
        if let Ok(mut s) = self.triggers.subscribers.lock() {
            s.push(tx);
        }
        rx
    }

    /// Reconciles the Sandbox `r` again (a drain began or ended).
    pub(super) fn wake(&self, r: SandboxRef) {
        if let Ok(mut subs) = self.triggers.subscribers.lock() {
            subs.retain(|tx| tx.unbounded_send(r.clone()).is_ok());
        }
    }

    pub(super) fn remember_ref(&self, uid: &str, obj: &SandboxObj) {
        if let Ok(mut m) = self.triggers.refs.lock() {
            m.entry(uid.to_string()).or_insert_with(|| {
                ObjectRef::new(&obj.name_any()).within(&obj.namespace().unwrap_or_default())
            });
        }
    }

    /// Marks a start or restore in flight (before it begins).
    pub fn claim(&self, uid: &str) -> StartClaim<'_> {
        if let Ok(mut s) = self.starting.lock() {
            s.insert(uid.to_string());
        }
        StartClaim {
            admission: self,
            uid: uid.to_string(),
        }
    }

    pub fn is_starting(&self, uid: &str) -> bool {
        self.starting
            .lock()
            .map(|s| s.contains(uid))
            .unwrap_or(true)
    }

    /// The deletion of `uid` has begun: nothing is ever started for it again.
    pub fn bury(&self, uid: &str) {
        if let Ok(mut g) = self.gone.lock() {
            let (set, order) = &mut *g;
            if set.insert(uid.to_string()) {
                order.push_back(uid.to_string());
                while order.len() > TOMBSTONES {
                    if let Some(old) = order.pop_front() {
                        set.remove(&old);
                    }
                }
            }
        }
    }

    pub fn is_buried(&self, uid: &str) -> bool {
        self.gone.lock().map(|g| g.0.contains(uid)).unwrap_or(false)
    }

    /// The node holds nothing of `uid` any more: its capacity and any slot go to
    /// whoever waits.
    pub fn release(&self, uid: &str) {
        self.restores.leave(uid);
        self.capacity.leave(uid);
        if let Ok(mut m) = self.triggers.refs.lock() {
            m.remove(uid);
        }
    }

    /// Entries of sandboxes this agent no longer sees (deleted while it was not
    /// looking, or bound elsewhere): `known` says whether a uid is still around.
    pub fn sweep(&self, known: &mut dyn FnMut(&str) -> bool) -> Vec<String> {
        let mut keys = self.capacity.keys();
        keys.extend(self.restores.keys());
        keys.sort();
        keys.dedup();
        let stale: Vec<String> = keys
            .into_iter()
            .filter(|k| !k.starts_with("pool/") && !self.is_starting(k) && !known(k))
            .collect();
        for k in &stale {
            self.release(k);
        }
        stale
    }
}

impl Agent {
    /// Asks for `obj`'s request and, when the start will restore cold or start fresh,
    /// a restore slot. `None`: go ahead (both are held). `Some(action)`: it waits; when
    /// it is bound here, its status says why.
    pub(super) async fn admit(&self, obj: &SandboxObj, uid: &str) -> Result<Option<Action>> {
        let a = &self.admission;
        a.remember_ref(uid, obj);
        let (group, rank, asks) = (group_of(obj), rank_of(obj), obj.spec.requests());
        // Cluster mode: kube-scheduler admitted its Pod, whose requests are its own.
        let scheduled = self.cfg.mode == ramify_crds::pod::Mode::Cluster;
        // A self-fork's branch restored ahead hands its room over first (fork_ahead.rs).
        let ahead = self.yield_ahead_room(obj);
        if !scheduled && !a.capacity.enter(uid, &group, rank.clone(), asks) {
            self.publish_capacity();
            let limit = a.capacity.limit();
            let (reason, message) = if asks.fits_in(&limit) {
                let used = a.capacity.usage().used;
                (
                    REASON_WAITING_FOR_CAPACITY,
                    cap::waiting_message(&self.cfg.node, &used, &limit, &asks),
                )
            } else {
                (
                    REASON_EXCEEDS_ALLOCATABLE,
                    cap::too_big_message(&self.cfg.node, &limit, &asks),
                )
            };
            self.note_waiting(obj, reason, message).await;
            return Ok(Some(Action::requeue(WAIT_RECHECK)));
        }
        self.publish_capacity();
        if ahead || self.warm_branch_ready(obj).await {
            return Ok(None);
        }
        if !a.restores.enter(uid, &group, rank, ONE_RESTORE) {
            self.publish_capacity();
            return Ok(Some(Action::requeue(WAIT_RECHECK)));
        }
        Ok(None)
    }

    /// Says why a sandbox waits, once per reason, and only when it is bound here (an
    /// unbound branch shows the operator's `Scheduled` condition; writing both would
    /// double the API calls of every waiting branch).
    pub(super) async fn note_waiting(&self, obj: &SandboxObj, reason: &str, message: String) {
        let st = obj.status.clone().unwrap_or_default();
        if st.node_name.as_deref() != Some(self.cfg.node.as_str())
            || st
                .conditions
                .get_condition(CONDITION_READY)
                // Said once per reason; a Pod's progress (scheduled, container
                // creating) is worth saying as it changes.
                .is_some_and(|c| {
                    c.reason == reason
                        && (reason != ramify_crds::pod::REASON_WAITING_FOR_POD
                            || c.message == message)
                })
        {
            return;
        }
        info!(sandbox = %obj.name_any(), reason, %message, "waiting");
        // A suspended sandbox waiting to resume stays suspended meanwhile.
        let phase = if st.phase == SandboxPhase::Suspended {
            SandboxPhase::Suspended
        } else {
            SandboxPhase::Pending
        };
        if let Err(e) = self
            .write_sandbox_status(obj, phase, None, (false, reason, message), json!({}))
            .await
        {
            warn!(error = %e, sandbox = %obj.name_any(), reason, "could not report waiting");
        }
    }

    /// A warm claim restores nothing: it needs no restore slot.
    async fn warm_branch_ready(&self, obj: &SandboxObj) -> bool {
        let Some(rf) = &obj.spec.restore_from else {
            return false;
        };
        let ns = obj.namespace().unwrap_or_default();
        let Some(uid) = self.cache.get().and_then(|c| {
            c.snapshots
                .get(&ObjectRef::new(&rf.snapshot).within(&ns))
                .and_then(|s| s.0.as_ref().ok().and_then(|s| s.uid()))
        }) else {
            return false;
        };
        self.pools.ready(&uid) > 0
    }

    /// What a warm pool of `size` holds: memory for each frozen branch (its source
    /// sandbox's request, the default when that is not in view), no CPU.
    pub(super) fn pool_asks(&self, snap: &ramify_crds::Snapshot, size: usize) -> Requests {
        let ns = snap.namespace().unwrap_or_default();
        let source = self.cache.get().and_then(|c| {
            c.bound
                .get(&ObjectRef::new(&snap.spec.source.sandbox).within(&ns))
                .and_then(|s| s.0.as_ref().ok().map(|s| s.spec.requests()))
        });
        let per = source.unwrap_or(Requests {
            cpu_millis: 0,
            memory_bytes: cap::DEFAULT_MEMORY_REQUEST_BYTES,
        });
        Requests {
            cpu_millis: 0,
            memory_bytes: per
                .memory_bytes
                .saturating_mul(u64::try_from(size).unwrap_or(u64::MAX)),
        }
    }

    /// Re-adopted after a restart: it holds its request whatever the room.
    pub(super) fn readopt(&self, obj: &SandboxObj, uid: &str) {
        self.admission.remember_ref(uid, obj);
        self.admission
            .capacity
            .force(uid, &group_of(obj), rank_of(obj), obj.spec.requests());
        self.publish_capacity();
    }

    /// Exports the gates' state as metrics.
    pub(super) fn publish_capacity(&self) {
        let c = self.admission.capacity.usage();
        let r = self.admission.restores.usage();
        let m = &self.metrics;
        let set = |resource: &str, of: &str, v: u64| {
            m.capacity
                .get_or_create(&super::metrics::CapacityLabels {
                    resource: resource.into(),
                    of: of.into(),
                })
                .set(i64::try_from(v).unwrap_or(i64::MAX));
        };
        set("cpu_millis", "allocatable", c.limit.cpu_millis);
        set("memory_bytes", "allocatable", c.limit.memory_bytes);
        set("cpu_millis", "used", c.used.cpu_millis);
        set("memory_bytes", "used", c.used.memory_bytes);
        m.admission_waiting
            .set(i64::try_from(c.waiting).unwrap_or(i64::MAX));
        m.restores_running
            .set(i64::try_from(r.granted).unwrap_or(i64::MAX));
        m.restores_waiting
            .set(i64::try_from(r.waiting).unwrap_or(i64::MAX));
    }

    /// Every few seconds: drops gate entries of sandboxes no watch shows any more.
    pub(super) async fn sweep_admission(self: Arc<Self>) {
        let mut unseen: HashSet<String> = HashSet::new();
        loop {
            tokio::time::sleep(Duration::from_secs(5)).await;
            let Some(cache) = self.cache.get() else {
                continue;
            };
            let mut seen: HashSet<String> = HashSet::new();
            for store in [&cache.bound, &cache.pinned] {
                for o in store.state() {
                    if let Some(uid) = o.0.as_ref().ok().and_then(|s| s.uid()) {
                        seen.insert(uid);
                    }
                }
            }
            let held: HashSet<String> = self.held.uids().into_iter().collect();
            // Twice unseen in a row: a re-list swaps a store whole, never empties it.
            let mut now_unseen = HashSet::new();
            let stale = self.admission.sweep(&mut |k| {
                if seen.contains(k) || held.contains(k) {
                    return true;
                }
                now_unseen.insert(k.to_string());
                !unseen.contains(k)
            });
            for k in stale {
                info!(uid = %k, "released the capacity of a sandbox no watch shows any more");
            }
            unseen = now_unseen;
            self.publish_capacity();
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_buried_sandbox_stays_buried_and_a_claim_is_seen_until_dropped() {
        let a = Admission::new(
            Requests {
                cpu_millis: 1000,
                memory_bytes: 1 << 30,
            },
            1,
        );
        {
            let _c = a.claim("u1");
            assert!(a.is_starting("u1"));
        }
        assert!(!a.is_starting("u1"));
        a.bury("u1");
        assert!(a.is_buried("u1"));
        assert!(!a.is_buried("u2"));
        for i in 0..TOMBSTONES {
            a.bury(&format!("x{i}"));
        }
        assert!(!a.is_buried("u1"), "bounded: the oldest are forgotten");
    }

    #[test]
    fn the_sweep_releases_what_no_watch_shows() {
        let a = Admission::new(
            Requests {
                cpu_millis: 1000,
                memory_bytes: 1 << 30,
            },
            1,
        );
        let r = Requests {
            cpu_millis: 600,
            memory_bytes: 1,
        };
        assert!(a.capacity.enter("kept", "g", (0, String::new()), r));
        assert!(!a.capacity.enter("waits", "h", (0, String::new()), r));
        let _c = a.claim("claimed");
        a.capacity
            .force("claimed", "c", (0, String::new()), Requests::ZERO);
        let gone = a.sweep(&mut |k| k == "kept");
        assert_eq!(gone, ["waits"]);
        a.sweep(&mut |k| k == "waits");
        assert!(!a.capacity.contains("kept"));
        assert!(a.capacity.contains("claimed"), "a start in flight is kept");
    }
}
