//! Self-forks, local first. The node that holds a sandbox asking to fork itself
//! checkpoints it on the spot and starts restoring its branches right away, before any
//! object exists; the operator's Snapshot of the set then adopts that capture, and each
//! branch object claims a branch restored ahead (as from a warm pool: a fresh identity,
//! a thaw). The API still records and decides everything (first commit wins, quotas,
//! capacity admission): the work done ahead only waits, frozen, for the objects, and
//! holds its memory in the node's capacity meanwhile.
//!
//! What is done ahead goes when its request settles (its set ended or is gone), when its
//! sandbox goes, or once every branch is claimed. A crash before the objects exist
//! leaves an image and sandboxes no record points to: the restarted agent removes them
//! (`resume`), and the request goes on the usual way (the operator's Snapshot captures).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kube::ResourceExt;
use ramify_crds::capacity::Requests;
use ramify_crds::{
    LABEL_BRANCHSET, Sandbox as SandboxObj, SelfForkRequest, Snapshot as SnapshotObj,
};
use ramify_engine::engine::{LocalSandbox, WarmPool};
use tracing::{info, warn};

use super::registry::SnapshotRecord;
use super::{Agent, Handle};
use crate::error::Result;

/// How long a branch object waits for its branch restored ahead (the restores started
/// when the request came, so they are usually done or nearly).
const CLAIM_TIMEOUT: Duration = Duration::from_secs(30);

/// One request's capture and its branches restored ahead.
pub(super) struct AheadFork {
    /// The Sandbox that asked (its uid).
    source_uid: String,
    /// The image captured when it asked, and the fork point it recorded.
    image_id: String,
    generation: u64,
    source_pause: Duration,
    capture: Duration,
    /// Shared with the claims waiting on it (the map's lock is never held across one).
    pool: Arc<WarmPool>,
    /// The capacity reservations of the frozen branches, one per branch (`<prefix>/<branch>`):
    /// each goes to its branch object when that asks for its own room.
    reservation: String,
    branches: Vec<String>,
    /// A Snapshot object took the image over (it owns it from then on).
    adopted: bool,
}

/// The node's requests with work done ahead, by `namespace/branchset`.
#[derive(Default)]
pub(super) struct AheadForks {
    map: Mutex<HashMap<String, AheadFork>>,
}

fn key(ns: &str, branch_set: &str) -> String {
    format!("{ns}/{branch_set}")
}

impl AheadForks {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, AheadFork>> {
        // Every update is one insert, remove or field write: a poisoned map is whole.
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn insert(&self, ns: &str, branch_set: &str, fork: AheadFork) -> Option<AheadFork> {
        self.lock().insert(key(ns, branch_set), fork)
    }

    fn take(&self, k: &str) -> Option<AheadFork> {
        self.lock().remove(k)
    }

    /// The keys whose source is not among `live` (sandbox uids), or whose branches
    /// were all handed out.
    fn finished(&self, live: &HashSet<String>) -> Vec<String> {
        self.lock()
            .iter()
            .filter(|(_, f)| !live.contains(&f.source_uid) || (f.adopted && f.pool.exhausted()))
            .map(|(k, _)| k.clone())
            .collect()
    }
}

impl Agent {
    /// Checkpoints `obj` for the self-fork `req` and starts restoring its branches, all
    /// before the request is recorded. Best effort: without room (memory for the
    /// frozen branches, store space) or when the capture fails, nothing is done ahead
    /// and the fork goes the usual way.
    pub(super) async fn fork_ahead(&self, obj: &SandboxObj, h: &Handle, req: &SelfForkRequest) {
        if !self.cfg.self_fork_ahead || self.cfg.mode == ramify_crds::pod::Mode::Cluster {
            // Cluster mode: its branches live in Pods of their own, which exist only
            // with the objects.
            return;
        }
        let ns = obj.namespace().unwrap_or_default();
        let uid = obj.uid().unwrap_or_default();
        let n = req.branches.len();
        // Under `pool/`, as a warm pool's: the admission sweep keeps what no Sandbox
        // object names.
        let group = format!("pool/{ns}/{}", req.branch_set);
        let reservation = format!("pool/ahead/{uid}/{}", req.number);
        // A frozen branch holds memory, no CPU (as a warm pool's).
        let asks = Requests {
            cpu_millis: 0,
            memory_bytes: obj.spec.requests().memory_bytes,
        };
        let mut fits = true;
        for b in &req.branches {
            fits = fits
                && self.admission.capacity.enter(
                    &format!("{reservation}/{b}"),
                    &group,
                    (0, String::new()),
                    asks,
                );
        }
        if !fits {
            self.leave_ahead_room(&reservation, &req.branches);
            self.metrics.ahead("skipped", 1);
            info!(sandbox = %obj.name_any(), "no room to restore a self-fork's branches ahead");
            return;
        }
        match self.capture_ahead(obj, &uid, h).await {
            Ok(Some((info, generation))) => {
                let pool = self.engine.warm_pool_once(
                    &info.meta.id,
                    n,
                    self.admission.restore_slots(),
                    group,
                );
                self.metrics.ahead("captured", 1);
                info!(sandbox = %obj.name_any(), branchset = %req.branch_set, image = %info.meta.id, pause_ms = info.source_pause.as_millis(), "self-fork captured on the spot; restoring its branches ahead");
                let replaced = self.ahead.insert(
                    &ns,
                    &req.branch_set,
                    AheadFork {
                        source_uid: uid,
                        image_id: info.meta.id.clone(),
                        generation,
                        source_pause: info.source_pause,
                        capture: info.checkpoint,
                        pool: Arc::new(pool),
                        reservation,
                        branches: req.branches.clone(),
                        adopted: false,
                    },
                );
                if let Some(old) = replaced {
                    self.discard_ahead(old).await;
                }
                self.publish_capacity();
                ramify_engine::fault::hold(ramify_engine::fault::SELF_FORK_AHEAD).await;
            }
            Ok(None) => {
                self.leave_ahead_room(&reservation, &req.branches);
                self.metrics.ahead("skipped", 1);
            }
            Err(e) => {
                self.leave_ahead_room(&reservation, &req.branches);
                self.metrics.ahead("skipped", 1);
                warn!(sandbox = %obj.name_any(), error = %e, "capturing a self-fork on the spot failed; the Snapshot captures it");
            }
        }
    }

    /// The capture, when the store has room for it: its image and the fork point.
    async fn capture_ahead(
        &self,
        obj: &SandboxObj,
        uid: &str,
        h: &Handle,
    ) -> Result<Option<(ramify_engine::engine::SnapshotInfo, u64)>> {
        if let Some(reason) = self.make_store_room(1, 0).await? {
            info!(sandbox = %obj.name_any(), reason, "no store room to capture a self-fork ahead");
            return Ok(None);
        }
        let (info, generation) = {
            let mut g = h.lock().await;
            let Some(sb) = g.as_mut().filter(|sb| sb.suspended.is_none()) else {
                return Ok(None);
            };
            // Read under the lock commits take, as the Snapshot's capture does.
            let generation = self
                .registry
                .sandbox(uid)?
                .map(|r| r.commits.generation)
                .unwrap_or(0);
            let info = self.engine.snapshot(sb, None).await?;
            self.engine.persist(sb)?;
            (info, generation)
        };
        let size = info.meta.size_bytes;
        if let Some(reason) = self.make_store_room(size, size).await? {
            info!(sandbox = %obj.name_any(), reason, "no store room to keep a self-fork's capture");
            self.engine.store().remove(&info.meta.id)?;
            return Ok(None);
        }
        Ok(Some((info, generation)))
    }

    /// The Snapshot a self-fork's BranchSet takes of its source, served by the capture
    /// made when the source asked (recorded as its image). `true` when it was: the
    /// Snapshot's capture is done. Only the set's own Snapshot (labelled with the set
    /// the source's pending request names) of that very sandbox adopts it.
    pub(super) fn adopt_ahead(
        &self,
        snap: &SnapshotObj,
        source: &SandboxObj,
    ) -> Result<Option<AdoptedCapture>> {
        let Some(set) = snap.labels().get(LABEL_BRANCHSET) else {
            return Ok(None);
        };
        let pending = source
            .status
            .as_ref()
            .and_then(|s| s.self_fork.as_ref())
            .and_then(|s| s.pending.as_ref());
        if pending.map(|p| &p.branch_set) != Some(set) {
            return Ok(None);
        }
        let ns = snap.namespace().unwrap_or_default();
        let mut map = self.ahead.lock();
        let Some(fork) = map.get_mut(&key(&ns, set)) else {
            return Ok(None);
        };
        if Some(&fork.source_uid) != source.uid().as_ref() || fork.adopted {
            return Ok(None);
        }
        // Recorded under the map's lock: a discard cannot remove the image in between.
        self.registry.put_snapshot(&SnapshotRecord {
            namespace: ns,
            name: snap.name_any(),
            uid: snap.uid().unwrap_or_default(),
            image_id: fork.image_id.clone(),
            source_commit_generation: fork.generation,
        })?;
        fork.adopted = true;
        Ok(Some(AdoptedCapture {
            image_id: fork.image_id.clone(),
            generation: fork.generation,
            source_pause: fork.source_pause,
            capture: fork.capture,
        }))
    }

    /// A branch of a self-fork restored ahead, for the branch object `obj` restoring
    /// `image_id`: `None` when there is none (the caller claims a warm pool's or
    /// restores cold).
    pub(super) async fn claim_ahead(
        &self,
        obj: &SandboxObj,
        image_id: &str,
        name: &str,
        index: u32,
    ) -> Option<Result<LocalSandbox>> {
        let branch = obj.spec.restore_from.as_ref()?.branch.as_ref()?;
        if !branch.self_fork {
            return None;
        }
        let ns = obj.namespace().unwrap_or_default();
        let k = key(&ns, &branch.branch_set);
        let pool = {
            let map = self.ahead.lock();
            let fork = map.get(&k)?;
            if !fork.adopted || fork.image_id != image_id {
                return None;
            }
            fork.pool.clone()
        };
        let claimed = pool.claim_as(name, index, CLAIM_TIMEOUT).await;
        if claimed.is_ok() {
            self.metrics.ahead("claimed", 1);
        }
        Some(claimed.map_err(Into::into))
    }

    fn leave_ahead_room(&self, reservation: &str, branches: &[String]) {
        for b in branches {
            self.admission.capacity.leave(&format!("{reservation}/{b}"));
        }
    }

    /// The set and branch of `obj`, when it is a branch of a self-fork whose work was
    /// done ahead here.
    fn ahead_of<'a>(&self, obj: &'a SandboxObj) -> Option<(String, &'a str)> {
        let branch = obj.spec.restore_from.as_ref()?.branch.as_ref()?;
        if !branch.self_fork {
            return None;
        }
        let k = key(&obj.namespace().unwrap_or_default(), &branch.branch_set);
        self.ahead
            .lock()
            .contains_key(&k)
            .then_some((k, branch.name.as_str()))
    }

    /// A branch object asking for its own room: the room its branch restored ahead
    /// held is its own now (the frozen branch is what it will run). `true` when it has
    /// a branch restored (or restoring) ahead, which needs no restore slot of its own.
    pub(super) fn yield_ahead_room(&self, obj: &SandboxObj) -> bool {
        let Some((k, branch)) = self.ahead_of(obj) else {
            return false;
        };
        let map = self.ahead.lock();
        let Some(fork) = map.get(&k) else {
            return false;
        };
        self.admission
            .capacity
            .leave(&format!("{}/{branch}", fork.reservation));
        !fork.pool.exhausted()
    }

    /// Settles the work done ahead for the request `pending` of a sandbox in `ns`.
    pub(super) async fn settle_ahead(&self, ns: &str, pending: &SelfForkRequest) {
        if let Some(fork) = self.ahead.take(&key(ns, &pending.branch_set)) {
            self.discard_ahead(fork).await;
        }
    }

    /// Drops what was done ahead for sandboxes no longer held (`live`: the uids of the
    /// sandboxes seen) and for requests whose branches were all claimed.
    pub(super) async fn tidy_ahead(&self, live: &HashSet<String>) {
        for k in self.ahead.finished(live) {
            if let Some(fork) = self.ahead.take(&k) {
                self.discard_ahead(fork).await;
            }
        }
    }

    /// Destroys what a request's work ahead still holds: its unclaimed branches, its
    /// room, and its image unless a Snapshot adopted it.
    async fn discard_ahead(&self, fork: AheadFork) {
        let unclaimed = fork.pool.ready();
        if let Err(e) = fork.pool.close().await {
            warn!(error = %e, "destroying a self-fork's branches restored ahead failed");
            self.engine
                .count_cleanup_failure("close fork ahead", e.category());
        }
        self.leave_ahead_room(&fork.reservation, &fork.branches);
        self.publish_capacity();
        if !fork.adopted {
            if let Err(e) = self.engine.store().remove(&fork.image_id) {
                warn!(image = %fork.image_id, error = %e, "removing a self-fork's capture failed");
                self.engine
                    .count_cleanup_failure("remove image", e.category());
            }
            self.metrics.ahead("capture_discarded", 1);
        }
        if unclaimed > 0 {
            self.metrics
                .ahead("discarded", u64::try_from(unclaimed).unwrap_or(0));
        }
    }
}

/// A capture made ahead, as its Snapshot records it.
pub(super) struct AdoptedCapture {
    pub image_id: String,
    pub generation: u64,
    pub source_pause: Duration,
    pub capture: Duration,
}
