//! Cross-node commit (a BranchSet with `spec.placement` whose winner ran on another
//! node than its parent), Full mode: the winner's whole live state travels.
//!
//! - The parent's node asks for it: annotation `ramify.dev/ship` (the set's uid) on the
//!   winner's Sandbox, which wakes the winner's node.
//! - The winner's node checkpoints the winner (thawed for it, frozen again after),
//!   uploads the image to the object store, drops its local copy and reports
//!   `status.shipped` (image, sha256, fork point).
//! - The parent's node downloads and verifies it, restores it on the root filesystem
//!   resolved there (the same digest) and commits it exactly as a local winner: the
//!   first-commit-wins guard, the crash-safe record, the old parent destroyed. The
//!   restored copy that does not commit (refused, failed) is destroyed at once.

use std::time::Instant;

use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::Action;
use ramify_crds::{ANNOTATION_SHIP, BranchSet, Sandbox as SandboxObj, ShippedWinner};
use serde_json::json;
use tracing::{info, warn};

use super::registry::SandboxRecord;
use super::{Agent, writes};
use crate::error::{EngineError, Error, Result};
use ramify_engine::engine::LocalSandbox;
use ramify_engine::freezer::Depth;

impl Agent {
    /// Whether a winner runs on another node than this one.
    pub(super) fn runs_elsewhere(&self, winner: &SandboxObj) -> bool {
        let node = winner
            .status
            .as_ref()
            .and_then(|s| s.node_name.as_deref())
            .or(winner.spec.node_name.as_deref());
        node.is_some_and(|n| n != self.cfg.node)
    }

    /// The parent's side: `None` while the winner is being shipped (asked for here,
    /// once); otherwise the commit of the shipped winner, applied or refused.
    pub(super) async fn commit_shipped(
        &self,
        bs: &BranchSet,
        parent_uid: &str,
        winner: &SandboxObj,
    ) -> Result<Option<super::commit::Applied>> {
        let bs_uid = bs.uid().unwrap_or_default();
        let shipped = winner
            .status
            .as_ref()
            .and_then(|s| s.shipped.clone())
            .filter(|s| s.branch_set_uid == bs_uid);
        let Some(sh) = shipped else {
            if winner.annotations().get(ANNOTATION_SHIP) != Some(&bs_uid) {
                let api: Api<SandboxObj> =
                    Api::namespaced(self.client.clone(), &winner.namespace().unwrap_or_default());
                let body = json!({"metadata": {"annotations": {ANNOTATION_SHIP: bs_uid}}});
                api.patch(
                    &winner.name_any(),
                    &PatchParams::default(),
                    &Patch::Merge(&body),
                )
                .await?;
                info!(winner = %winner.name_any(), "asked the winner's node to ship it here");
            }
            return Ok(None);
        };
        let remote = self.remote.store().cloned().ok_or_else(|| {
            Error::Engine(EngineError::Invalid(format!(
                "winner {} ran on node {} and node {} has no object store to fetch it from",
                winner.name_any(),
                sh.node,
                self.cfg.node
            )))
        })?;
        let winner_uid = winner.uid().unwrap_or_default();
        let t0 = Instant::now();
        let replica = async {
            self.download_image(winner, &remote, &sh.image, &sh.sha256)
                .await?;
            let (_, source, pulled) = self.fresh_source(winner).await?;
            let want = winner.status.as_ref().and_then(|s| s.image_digest.as_ref());
            if let (Some(p), Some(want)) = (&pulled, want)
                && &p.digest != want
            {
                return Err(Error::Engine(EngineError::RootfsRefused(format!(
                    "the winner's image resolves to {} on node {}, not {want}",
                    p.digest, self.cfg.node
                ))));
            }
            self.engine
                .resume_moved(&winner.name_any(), &sh.image, source, None, None)
                .await
                .map_err(Error::from)
        }
        .await;
        let (replica, restored) = match replica {
            Ok(r) => r,
            Err(e) => {
                if e.is_permanent() {
                    self.engine.store().remove(&sh.image).ok();
                }
                return Err(e);
            }
        };
        // Recorded as the winner (its fork point travels with it): the commit below is
        // the local one, and a crash before its commit point destroys this copy (its
        // Sandbox is bound to another node, so it is an orphan here).
        self.registry.put_sandbox(&SandboxRecord {
            namespace: winner.namespace().unwrap_or_default(),
            name: winner.name_any(),
            uid: winner_uid.clone(),
            sandbox_id: replica.id.clone(),
            fork_generation: u64::try_from(sh.fork_generation).ok(),
            ..Default::default()
        })?;
        self.insert_handle(&winner_uid, replica);
        ramify_engine::fault::hold(ramify_engine::fault::SHIPPED_RESTORED).await;
        let applied = self.apply_commit(bs, parent_uid, winner).await;
        if !matches!(applied, Ok(super::commit::Applied::Done(..))) {
            self.discard_replica(&winner_uid).await;
        }
        if applied.is_ok() {
            // Committed or refused: the store's copy is of no use any more.
            self.drop_remote_copy(&sh.image, &sh.sha256).await;
            info!(winner = %winner.name_any(), from = %sh.node, restore_ms = restored.as_millis() as u64,
                total_ms = t0.elapsed().as_millis() as u64, "committed a winner shipped from another node");
        }
        applied.map(Some)
    }

    async fn report_shipped(&self, obj: &SandboxObj, shipped: &ShippedWinner) -> Result<()> {
        let api: Api<SandboxObj> =
            Api::namespaced(self.client.clone(), &obj.namespace().unwrap_or_default());
        writes::status(
            &api,
            &obj.name_any(),
            ramify_crds::MANAGER_AGENT_SHIP,
            None,
            &json!({"shipped": shipped}),
        )
        .await?;
        Ok(())
    }

    /// A restored winner that did not commit: destroyed, its record gone.
    async fn discard_replica(&self, winner_uid: &str) {
        let taken = match self.take_handle(winner_uid) {
            Some(h) => h.lock().await.take(),
            None => None,
        };
        if let Some(sb) = taken {
            self.engine
                .destroy_or_report(sb, "a shipped winner that did not commit")
                .await;
        }
        if let Err(e) = self.registry.remove_sandbox(winner_uid) {
            warn!(error = %e, "removing a shipped winner's record failed");
        }
    }

    /// The winner's side: ships it when its parent's node asked (`ramify.dev/ship`) and
    /// it has not been shipped for that set yet. `None`: nothing to do.
    pub(super) async fn ship_winner(
        &self,
        obj: &SandboxObj,
        uid: &str,
        sb: &mut LocalSandbox,
    ) -> Result<Option<Action>> {
        let Some(bs_uid) = obj.annotations().get(ANNOTATION_SHIP) else {
            return Ok(None);
        };
        let st = obj.status.clone().unwrap_or_default();
        if st
            .shipped
            .as_ref()
            .is_some_and(|s| &s.branch_set_uid == bs_uid)
        {
            return Ok(None);
        }
        // Shipped already (this copy of the object predates the report): reported
        // again, never shipped twice.
        let recorded = self
            .registry
            .sandbox(uid)?
            .and_then(|r| r.shipped)
            .filter(|s| &s.branch_set_uid == bs_uid);
        if let Some(shipped) = recorded {
            self.report_shipped(obj, &shipped).await?;
            return Ok(Some(Action::await_change()));
        }
        let remote = self.remote.store().cloned().ok_or_else(|| {
            Error::Engine(EngineError::Invalid(format!(
                "asked to ship winner {} to its parent's node, and node {} has no object store",
                obj.name_any(),
                self.cfg.node
            )))
        })?;
        let fork_generation = self
            .registry
            .sandbox(uid)?
            .and_then(|r| r.fork_generation)
            .unwrap_or(0);
        ramify_engine::fault::hold(ramify_engine::fault::SHIP_ASKED).await;
        let t0 = Instant::now();
        // Decided, so paused: a checkpoint needs it running.
        self.decided.thaw(uid).await?;
        let captured = self.engine.snapshot(sb, None).await;
        if let Err(e) = self.engine.persist(sb) {
            warn!(error = %e, "recording the shipped winner failed");
        }
        self.freeze_branch(uid, Depth::Pause).await;
        let info = captured?;
        let store = self.engine.store();
        let up = remote.upload(store, &info.meta.id).await;
        // Its node needs no copy: the parent's node restores from the store's.
        if let Err(e) = store.remove(&info.meta.id) {
            warn!(image = %info.meta.id, error = %e, "removing a shipped image failed");
        }
        let up = up?;
        let shipped = ShippedWinner {
            branch_set_uid: bs_uid.clone(),
            node: self.cfg.node.clone(),
            image: info.meta.id.clone(),
            sha256: up.image_sha256.clone(),
            size_bytes: i64::try_from(info.meta.size_bytes).unwrap_or(i64::MAX),
            fork_generation: i64::try_from(fork_generation).unwrap_or(i64::MAX),
            ship_millis: i64::try_from(t0.elapsed().as_millis()).unwrap_or(i64::MAX),
        };
        self.registry
            .update_sandbox(uid, |r| r.shipped = Some(shipped.clone()))?;
        self.report_shipped(obj, &shipped).await?;
        let note = format!(
            "checkpointed and uploaded for its parent's node in {} ms ({} bytes)",
            shipped.ship_millis, shipped.size_bytes
        );
        self.event(obj, false, "Shipped", note).await;
        Ok(Some(Action::await_change()))
    }
}
