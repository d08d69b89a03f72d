//! Decided branches stop consuming CPU. A branch whose verdict is recorded (its run
//! finished and it waits for the set's decision) is paused (`runsc pause`, see
//! [`ramify_engine::freezer`]) until it is committed or deleted, and so is every loser the moment its BranchSet
//! names a winner, before any API call. A frozen branch gives its CPU back to the
//! node's capacity at once and keeps only the memory it holds.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use kube::ResourceExt;
use ramify_crds::capacity::Requests;
use ramify_crds::{BranchSet, Sandbox as SandboxObj};
use tracing::{debug, warn};

use super::Agent;
use crate::error::{Error, Result};
use ramify_engine::cgroup;
use ramify_engine::engine::LocalSandbox;
use ramify_engine::freezer;

/// Where a branch lives on the node (read without its handle: a running command
/// holds that).
#[derive(Clone, Debug)]
pub struct BranchPlace {
    pub cgroups_path: String,
    pub dir: std::path::PathBuf,
    /// What `runsc pause`/`resume` address.
    pub ctx: ramify_engine::runsc::SandboxCtx,
    /// `namespace/branchset`.
    pub set: String,
    pub branch: String,
    pub asks: Requests,
}

/// The branches of this node, and which of them are frozen: it freezes and thaws
/// them (through the engine's runsc) and keeps the frozen-branches gauge. What a
/// frozen branch gives back to the node's capacity is the agent's to settle.
pub struct Decided {
    runsc: ramify_engine::runsc::Runsc,
    metrics: super::metrics::AgentMetrics,
    places: Mutex<HashMap<String, BranchPlace>>,
    frozen: Mutex<HashSet<String>>,
}

impl Decided {
    pub fn new(runsc: ramify_engine::runsc::Runsc, metrics: super::metrics::AgentMetrics) -> Self {
        Decided {
            runsc,
            metrics,
            places: Mutex::default(),
            frozen: Mutex::default(),
        }
    }

    pub fn is_frozen(&self, uid: &str) -> bool {
        self.frozen.lock().map(|f| f.contains(uid)).unwrap_or(false)
    }

    fn place(&self, uid: &str) -> Option<BranchPlace> {
        self.places.lock().ok()?.get(uid).cloned()
    }

    pub fn count(&self) -> usize {
        self.frozen.lock().map(|f| f.len()).unwrap_or(0)
    }

    fn publish_count(&self) {
        self.metrics
            .frozen_branches
            .set(i64::try_from(self.count()).unwrap_or(i64::MAX));
    }

    /// Remembers a branch's place (at its start, or re-adopted after a restart).
    pub(super) fn remember(&self, uid: &str, obj: &SandboxObj, sb: &LocalSandbox) {
        let Some(b) = obj
            .spec
            .restore_from
            .as_ref()
            .and_then(|r| r.branch.as_ref())
        else {
            return;
        };
        if let Ok(mut p) = self.places.lock() {
            p.insert(
                uid.to_string(),
                BranchPlace {
                    cgroups_path: sb.cgroups_path().to_string(),
                    dir: sb.dir.clone(),
                    ctx: sb.ctx().clone(),
                    set: format!("{}/{}", obj.namespace().unwrap_or_default(), b.branch_set),
                    branch: b.name.clone(),
                    asks: obj.spec.requests(),
                },
            );
        }
    }

    /// A commit Full swapped another sandbox in under this branch (it was the parent
    /// of a nested set): freezes and thaws now go to that one.
    pub(super) fn rehome(&self, uid: &str, sb: &LocalSandbox) {
        if let Ok(mut p) = self.places.lock()
            && let Some(place) = p.get_mut(uid)
        {
            place.cgroups_path = sb.cgroups_path().to_string();
            place.dir = sb.dir.clone();
            place.ctx = sb.ctx().clone();
        }
    }

    /// The branch is going (deleted) or handed over (committed Full): no freeze may
    /// target it any more.
    pub(super) fn forget(&self, uid: &str) {
        if let Ok(mut p) = self.places.lock() {
            p.remove(uid);
        }
        if let Ok(mut f) = self.frozen.lock() {
            f.remove(uid);
        }
        self.publish_count();
    }

    /// The depth for a branch whose outcome is `outcome`: an aborted branch only waits
    /// for its deletion; one that would commit may still be picked, so it must resume
    /// intact.
    pub(super) fn depth_for(outcome: &serde_json::Value) -> freezer::Depth {
        if outcome.get("verdict").and_then(|v| v.as_str()) == Some("Abort") {
            freezer::Depth::Freeze
        } else {
            freezer::Depth::Pause
        }
    }

    /// Freezes a decided branch (idempotent). Returns what it holds of the node now
    /// (no CPU, the memory it holds) when this call froze it. A failure is logged: the
    /// branch then keeps running until it is deleted.
    pub(super) async fn freeze(&self, uid: &str, depth: freezer::Depth) -> Option<Requests> {
        if self.is_frozen(uid) {
            return None;
        }
        let place = self.place(uid).filter(|p| p.dir.exists())?;
        // A person's look (an exec, a port-forward) is never waited for: it keeps the
        // branch running, and the last one to end freezes it.
        let r = freezer::pause_over_looks(
            &self.runsc,
            &place.ctx,
            &place.dir,
            &place.cgroups_path,
            depth,
        )
        .await
        .map(|o| o == freezer::Outcome::Done)
        .map_err(Error::from);
        match r {
            Ok(true) => {
                if let Ok(mut f) = self.frozen.lock() {
                    f.insert(uid.to_string());
                }
                self.publish_count();
                debug!(branch = %place.branch, "frozen");
                let held = cgroup::memory_usage(&place.cgroups_path)
                    .unwrap_or(place.asks.memory_bytes)
                    .min(place.asks.memory_bytes);
                Some(Requests {
                    cpu_millis: 0,
                    memory_bytes: held,
                })
            }
            Ok(false) => None,
            Err(e) => {
                warn!(error = %e, branch = %place.branch, "could not freeze a decided branch");
                None
            }
        }
    }

    /// Thaws a frozen branch for its commit. A person's look in progress is not waited
    /// for: the branch runs for it already, and no look pauses it again.
    pub(super) async fn thaw(&self, uid: &str) -> Result<()> {
        // Gone already (destroyed): nothing is frozen.
        let Some(place) = self.place(uid).filter(|p| p.dir.exists()) else {
            return Ok(());
        };
        freezer::resume_over_looks(&self.runsc, &place.ctx, &place.dir, &place.cgroups_path)
            .await?;
        if let Ok(mut f) = self.frozen.lock() {
            f.remove(uid);
        }
        Ok(())
    }

    /// The branches of `bs` on this node other than its winner (none before it has one).
    fn losers(&self, bs: &BranchSet) -> Vec<String> {
        let Some(winner) = bs.status.as_ref().and_then(|s| s.winner.clone()) else {
            return Vec::new();
        };
        let set = format!("{}/{}", bs.namespace().unwrap_or_default(), bs.name_any());
        self.places
            .lock()
            .map(|p| {
                p.iter()
                    .filter(|(_, b)| b.set == set && b.branch != winner)
                    .map(|(u, _)| u.clone())
                    .collect()
            })
            .unwrap_or_default()
    }
}

impl Agent {
    /// Freezes a decided branch and gives what it no longer uses back to the node's
    /// capacity.
    pub(super) async fn freeze_branch(&self, uid: &str, depth: freezer::Depth) {
        if let Some(held) = self.decided.freeze(uid, depth).await {
            self.admission.capacity.settle(uid, held);
            self.publish_capacity();
        }
    }

    /// A winner is known: every other branch of the set on this node stops now, before
    /// the API server hears of anything (the losers' deletions follow).
    pub(super) async fn freeze_losers(&self, bs: &BranchSet) {
        let losers = self.decided.losers(bs);
        futures::future::join_all(
            losers
                .iter()
                .map(|u| self.freeze_branch(u, freezer::Depth::Freeze)),
        )
        .await;
    }
}
