//! Resuming after a restart: re-adopt what the registry says this node holds, destroy
//! what the API no longer knows.
//!
//! One policy for bad records, whichever store holds them: a registry record or a
//! sandbox record that does not parse is skipped and reported (a Warning Event on the
//! node's Lease, `ramify_node_agent_corrupt_records_total`, a log line), never fatal to
//! the resume and never silently ignored. The registry record is set aside
//! (`.corrupt`), so the object it backed reads as lost here (its reconcile reports
//! `SandboxLost`, or the snapshot's image as lost); a sandbox directory whose record
//! does not parse cannot be re-adopted, so it is destroyed.

use std::collections::{BTreeMap, HashSet};

use k8s_openapi::api::core::v1::ObjectReference;
use kube::ResourceExt;
use kube::api::{Api, ListParams};
use ramify_crds::{Sandbox as SandboxObj, Snapshot as SnapshotObj};
use tracing::{info, instrument, warn};

use super::Agent;
use super::metrics::RecordLabels;
use super::registry::CorruptRecord;
use crate::error::{Error, Result};
use ramify_engine::engine::LocalSandbox;

impl Agent {
    /// Re-adopts what the registry says this node holds and destroys what the API no
    /// longer knows: sandboxes and images whose objects are gone, and sandbox
    /// directories no record points to. Run once at start-up, before the controllers.
    #[instrument(skip(self))]
    pub async fn resume(&self) -> Result<()> {
        let listed = self.bound_objects::<SandboxObj>().await?;
        let live: HashSet<String> = listed.keys().cloned().collect();
        let recovered = self.engine.recover().await?;
        for sb in &recovered.sandboxes {
            self.engine.mend_billing(sb);
        }
        for bad in recovered.unreadable {
            self.report_corrupt("sandbox-dir", &bad.path.display().to_string(), &bad.error)
                .await;
            let why = "its record does not parse, so it cannot be re-adopted";
            self.engine.destroy_or_report(bad.handle, why).await;
        }
        let mut local: BTreeMap<String, LocalSandbox> = recovered
            .sandboxes
            .into_iter()
            .map(|s| (s.id.clone(), s))
            .collect();
        let records = self.registry.sandboxes()?;
        self.skip_corrupt("sandbox", &records.corrupt).await;
        // Full commits a crash cut short first: their records already name the winner's
        // sandbox; what is left is the winner's record and the old parent sandbox.
        for (uid, mut rec) in records.by_uid() {
            if let Some(pending) = rec.pending_full_commit.clone() {
                info!(sandbox = %rec.name, retired = %pending.retired_sandbox_id, "finishing a Full commit cut short");
                let retired = local.remove(&pending.retired_sandbox_id);
                if let Err(e) = self.finish_full_commit(&mut rec, retired).await {
                    warn!(sandbox = %rec.name, uid = %uid, error = %e, "could not finish a Full commit's clean-up");
                }
            }
        }
        let records = self.registry.sandboxes()?;
        let mut suspended_images: HashSet<String> = HashSet::new();
        for (uid, rec) in records.by_uid() {
            if rec.handed_over {
                // A Full commit's winner: its sandbox is its parent's now.
                if !live.contains(&uid) {
                    self.registry.remove_sandbox(&uid)?;
                }
                continue;
            }
            match local.remove(&rec.sandbox_id) {
                Some(mut sb) if live.contains(&uid) => {
                    // A suspend a crash cut short is settled first: it either runs on
                    // or is suspended. One that is neither is lost (and reported so).
                    if let Err(e) = self.engine.settle_suspend(&mut sb).await {
                        warn!(sandbox = %rec.name, error = %e, "a suspended sandbox cannot be re-adopted");
                        self.engine.destroy_or_report(sb, &e.to_string()).await;
                        self.registry.remove_sandbox(&uid)?;
                        continue;
                    }
                    if let Some(s) = &sb.suspended {
                        info!(sandbox = %rec.name, id = %sb.id, image = %s.image, "re-adopted suspended sandbox");
                        suspended_images.insert(s.image.clone());
                        if let Some(obj) = listed.get(&uid) {
                            // Nothing of it runs: it holds no room until it resumes.
                            self.admission.remember_ref(&uid, obj);
                        }
                        self.insert_handle(&uid, sb);
                        continue;
                    }
                    info!(sandbox = %rec.name, id = %sb.id, "re-adopted live sandbox");
                    if let Some(obj) = listed.get(&uid) {
                        // It holds its request; a decided branch is frozen again.
                        self.readopt(obj, &uid);
                        self.decided.remember(&uid, obj, &sb);
                        self.answer_lost_request(obj, &uid, &sb).await;
                    }
                    let decided = rec.outcome.as_ref().map(super::decided::Decided::depth_for);
                    self.insert_handle(&uid, sb);
                    if let Some(depth) = decided {
                        self.freeze_branch(&uid, depth).await;
                    }
                }
                Some(sb) => {
                    info!(sandbox = %rec.name, id = %sb.id, "destroying orphan: its Sandbox object is gone or bound to another node");
                    let why = format!(
                        "orphan of {}/{} (the object is gone or bound to another node)",
                        rec.namespace, rec.name
                    );
                    self.engine.destroy_or_report(sb, &why).await;
                    self.registry.remove_sandbox(&uid)?;
                }
                None => {
                    // The record outlived its sandbox (crash during destroy): the
                    // reconcile reports the loss; nothing to clean on the host.
                    if !live.contains(&uid) {
                        self.registry.remove_sandbox(&uid)?;
                    }
                }
            }
        }
        for (_, sb) in local {
            info!(id = %sb.id, "destroying unrecorded sandbox");
            self.engine
                .destroy_or_report(sb, "no registry record points to it")
                .await;
        }
        let live_snaps = self.bound_here::<SnapshotObj>().await?;
        // What suspended sandboxes' processes are now: kept with them; so is the image
        // of a workspace moved out of its evicted Pod, which its object names.
        let mut kept = suspended_images;
        for obj in listed.values() {
            if let Some(x) = obj
                .status
                .as_ref()
                .filter(|s| s.phase == ramify_crds::SandboxPhase::Suspended)
                .and_then(|s| s.suspension.as_ref())
                .filter(|x| x.node == self.cfg.node)
            {
                kept.insert(x.image.clone());
            }
        }
        let records = self.registry.snapshots()?;
        self.skip_corrupt("snapshot", &records.corrupt).await;
        for (uid, rec) in records.by_uid() {
            if live_snaps.contains(&uid) {
                kept.insert(rec.image_id);
            } else {
                self.remove_image(&rec.image_id, "its Snapshot object is gone");
                self.registry.remove_snapshot(&uid)?;
            }
        }
        // Every image directory, sealed or not: a capture cut short by a crash leaves
        // one without metadata, which `list()` does not show.
        let store_dir = self.engine.store().dir().to_path_buf();
        for entry in std::fs::read_dir(&store_dir).map_err(|e| Error::io("read", &store_dir, e))? {
            let entry = entry.map_err(|e| Error::io("read", &store_dir, e))?;
            let id = entry.file_name().to_string_lossy().into_owned();
            if !kept.contains(&id) {
                info!(image = %id, "removing unrecorded snapshot image");
                self.remove_image(&id, "no registry record points to it");
            }
        }
        Ok(())
    }

    /// The uids of the objects of kind `K` bound to this node.
    async fn bound_here<K>(&self) -> Result<HashSet<String>>
    where
        K: kube::Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    {
        Ok(self.bound_objects::<K>().await?.into_keys().collect())
    }

    /// The objects of kind `K` bound to this node, by uid.
    async fn bound_objects<K>(&self) -> Result<std::collections::HashMap<String, K>>
    where
        K: kube::Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    {
        let bound = ListParams::default().fields(&format!("status.nodeName={}", self.cfg.node));
        let api: Api<K> = Api::all(self.client.clone());
        Ok(api
            .list(&bound)
            .await?
            .items
            .into_iter()
            .filter_map(|o| Some((o.uid()?, o)))
            .collect())
    }

    /// Removes a stored image on a cleanup path: a failure is logged and counted.
    fn remove_image(&self, id: &str, why: &str) {
        if let Err(e) = self.engine.store().remove(id) {
            warn!(image = %id, why, error = %e, "removing a snapshot image failed");
            self.engine
                .count_cleanup_failure("remove image", e.category());
        }
    }

    /// Reports each corrupt registry record and sets it aside.
    async fn skip_corrupt(&self, record: &str, corrupt: &[CorruptRecord]) {
        for bad in corrupt {
            let shown = bad.path.display().to_string();
            let aside = match self.registry.quarantine(bad) {
                Ok(p) => format!("moved to {}", p.display()),
                Err(e) => format!("could not be moved aside: {e}"),
            };
            self.report_corrupt(record, &shown, &format!("{}; {aside}", bad.error))
                .await;
        }
    }

    /// One skipped record: a log line, the metric, and a Warning Event on this node's
    /// Lease (the record may not even say which object it backed).
    pub(super) async fn report_corrupt(&self, record: &str, path: &str, error: &str) {
        warn!(record, path, error, "skipping a record that does not parse");
        self.metrics
            .corrupt_records
            .get_or_create(&RecordLabels {
                record: record.to_string(),
            })
            .inc();
        let lease = ObjectReference {
            api_version: Some("coordination.k8s.io/v1".into()),
            kind: Some("Lease".into()),
            name: Some(super::lease::lease_name(&self.cfg.node)),
            namespace: Some(self.cfg.system_namespace.clone()),
            ..Default::default()
        };
        ramify_runtime::events::publish(
            &self.recorder,
            &lease,
            true,
            "CorruptRecord",
            "Resume",
            format!("{record} record {path} skipped: {error}"),
        )
        .await;
    }
}
