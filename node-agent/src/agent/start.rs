//! Starting a Sandbox: fresh from its RootfsClass, or a branch from its snapshot (a
//! warm pool first, then a cold restore), recorded before it is reported Running.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use ramify_crds::{
    BranchSet, CommitMode, REASON_ROOTFS_REFUSED, Sandbox as SandboxObj, SandboxPhase,
    Snapshot as SnapshotObj, SnapshotPhase,
};
use serde_json::json;
use tracing::warn;

use super::registry::SandboxRecord;
use super::{Agent, millis, now, rootfs_class, short_version};
use crate::error::{EngineError, Error, Result};
use ramify_engine::engine::{LocalSandbox, StartRequest};
use ramify_engine::placement::{Allowed, Cidr};
use ramify_engine::rootfs::RootfsSource;
use ramify_engine::spec::{Resources, WorkloadSpec};

/// Quantity parsing is shared with the operator's capacity accounting.
use ramify_crds::capacity::{cpu_millis, memory_bytes};

/// The workload of a Sandbox object.
pub fn workload_of(sbx: &SandboxObj) -> WorkloadSpec {
    let res = sbx
        .spec
        .resources
        .clone()
        .unwrap_or(ramify_crds::Resources {
            cpu: None,
            memory: None,
            pids: None,
        });
    WorkloadSpec {
        args: sbx.spec.command.clone(),
        env: sbx
            .spec
            .env
            .iter()
            .map(|e| (e.name.clone(), e.value.clone()))
            .collect(),
        cwd: sbx.spec.working_dir.clone().unwrap_or_else(|| "/".into()),
        hostname: sbx.name_any().chars().take(63).collect(),
        user: None,
        system_files: sbx.spec.system_files.is_managed(),
        system_file_mounts: Vec::new(),
        resources: Resources {
            cpu_millis: res.cpu.as_deref().and_then(cpu_millis),
            memory_bytes: res.memory.as_deref().and_then(memory_bytes),
            pids: res.pids.and_then(|p| u64::try_from(p).ok()),
        },
    }
}

/// Egress allowlist of a Sandbox object (empty: deny everything): each destination
/// with its ports.
pub fn egress_of(sbx: &SandboxObj) -> Result<Vec<Allowed>> {
    match sbx.spec.network.egress {
        ramify_crds::Egress::Deny => Ok(Vec::new()),
        ramify_crds::Egress::Allow => sbx
            .spec
            .network
            .allow
            .iter()
            .map(|r| {
                let mut a = Allowed::from(r.cidr.parse::<Cidr>().map_err(Error::from)?);
                for p in &r.ports {
                    // 1-65535 in the schema; anything else is refused, never widened.
                    let port = u16::try_from(p.0).ok().filter(|p| *p > 0).ok_or_else(|| {
                        Error::Engine(EngineError::Invalid(format!(
                            "spec.network.allow[].ports: {} is not a port",
                            p.0
                        )))
                    })?;
                    a.ports.push(port);
                }
                Ok(a)
            })
            .collect(),
    }
}

/// Cluster mode: how long a branch waits for the frozen branch being restored in the
/// warm pool Pod it adopted.
const POD_CLAIM_TIMEOUT: Duration = Duration::from_secs(60);

impl Agent {
    pub(super) async fn start_sandbox(
        self: &Arc<Self>,
        obj: &SandboxObj,
        uid: &str,
        pod_uid: Option<&str>,
    ) -> Result<Action> {
        let t0 = Instant::now();
        // In flight from here until its handle is held (or it failed): a deletion
        // meanwhile waits for it.
        let _claim = self.admission.claim(uid);
        let slot = self.admission.restores.permit(uid);
        self.publish_capacity();
        let started = match &obj.spec.restore_from {
            Some(rf) => self.start_from_snapshot(obj, rf, pod_uid).await,
            None => match self.fresh_source(obj).await {
                // A failed API read is not the sandbox's fault: retried, not Failed.
                Err(e @ Error::Kube(_)) => return Err(e),
                // A pull the registry refused or failed: retried with backoff (its
                // status says ErrImagePull / ImagePullBackOff); nothing was started.
                Err(Error::Image(e)) if !e.is_permanent() => return Err(Error::Image(e)),
                Err(e) => Err(e),
                Ok((class, source, image)) => {
                    let extra = match &image {
                        Some(p) => json!({"imageDigest": p.digest}),
                        None => json!({}),
                    };
                    let workload = match &image {
                        Some(p) => super::images::workload_with_image(workload_of(obj), obj, p),
                        None => Ok(workload_of(obj)),
                    };
                    match workload {
                        Err(e) => Err(e),
                        Ok(workload) => {
                            self.write_sandbox_status(
                                obj,
                                SandboxPhase::Starting,
                                None,
                                (false, "Starting", "starting".into()),
                                extra.clone(),
                            )
                            .await?;
                            self.start_fresh(obj, source.clone(), workload, pod_uid)
                                .await
                                .map(|sb| (sb, extra, None))
                                .map_err(|e| match &image {
                                    Some(_) => e,
                                    None => rootfs_class::name_the_field(&class, &source, e),
                                })
                        }
                    }
                }
            },
        };
        // A self-fork's branch learns which branch it is before it is reported running;
        // one that cannot be told would wait forever: it fails like a failed restore.
        let started = match (
            started,
            obj.spec
                .restore_from
                .as_ref()
                .and_then(|r| r.branch.as_ref()),
        ) {
            (Ok((sb, extra, fg)), Some(branch)) => {
                match self.announce_self_fork_branch(&sb, branch) {
                    Ok(()) => Ok((sb, extra, fg)),
                    Err(e) => {
                        if let Err(d) = self.engine.destroy(sb).await {
                            warn!(error = %d, "destroying a branch that could not be told its name failed");
                        }
                        Err(e)
                    }
                }
            }
            (started, _) => started,
        };
        drop(slot);
        // A warm claim took no slot; any place it still had in the queue goes too.
        self.admission.restores.leave(uid);
        let (sb, extra, fork_generation) = match started {
            Ok(x) => x,
            Err(Error::Engine(EngineError::NotYet(why))) => {
                // Nothing of it runs yet: its room goes to whoever waits meanwhile.
                self.admission.release(uid);
                self.publish_capacity();
                return self.not_yet(obj, why).await;
            }
            Err(e) => {
                // Nothing of it runs: its room goes to whoever waits.
                self.admission.release(uid);
                self.publish_capacity();
                // The object store down while the image downloads: retried with
                // backoff, like the API server; a corrupt object fails it below.
                if matches!(e, Error::Remote(_)) && !e.is_permanent() {
                    return Err(e);
                }
                // Refused at the first reconcile and never retried: the spec's rootfs
                // (and the image's platform) is immutable, so a retry could only be
                // refused again.
                let reason = match &e {
                    Error::Engine(EngineError::RootfsRefused(_)) => REASON_ROOTFS_REFUSED,
                    Error::Engine(EngineError::PlatformMismatch { .. }) => {
                        ramify_crds::REASON_PLATFORM_MISMATCH
                    }
                    Error::Image(ie) => ie.reason(),
                    Error::Remote(_) if e.is_permanent() => "RemoteImageRefused",
                    _ if obj.spec.restore_from.is_some() => "RestoreFailed",
                    _ => "StartFailed",
                };
                self.metrics.failed("sandbox", e.category());
                if let Some(pod_uid) = pod_uid {
                    self.fail_pod(obj, pod_uid);
                }
                self.write_sandbox_status(
                    obj,
                    SandboxPhase::Failed,
                    None,
                    (false, reason, e.to_string()),
                    json!({}),
                )
                .await?;
                self.event(obj, true, reason, e.to_string()).await;
                return Ok(Action::await_change());
            }
        };
        // Record before reporting: a crash from here on re-adopts the sandbox.
        self.engine.persist(&sb)?;
        self.registry.put_sandbox(&SandboxRecord {
            namespace: obj.namespace().unwrap_or_default(),
            name: obj.name_any(),
            uid: uid.to_string(),
            sandbox_id: sb.id.clone(),
            fork_generation,
            ..Default::default()
        })?;
        let mut extra = extra;
        extra["startedAt"] = json!(now());
        let fork_millis = millis(t0.elapsed());
        // Held from here on: if the report below fails (an API-server outage), the
        // retry finds the sandbox and reports it; it never starts a second one.
        let running_as = format!("running as {}", sb.id);
        self.decided.remember(uid, obj, &sb);
        let h = self.insert_handle(uid, sb);
        self.held.to_report(uid, extra.clone());
        {
            let g = h.lock().await;
            self.write_sandbox_status(
                obj,
                SandboxPhase::Running,
                g.as_ref(),
                (true, "Running", running_as),
                extra,
            )
            .await?;
        }
        self.held.mark_reported(uid);
        if let Some(branch) = obj
            .spec
            .restore_from
            .as_ref()
            .and_then(|r| r.branch.clone())
        {
            self.spawn_branch_run(obj.clone(), uid.to_string(), branch, fork_millis);
        }
        Ok(Action::requeue(Duration::from_secs(10)))
    }

    /// Which RootfsClass a fresh sandbox names and what it points to, or the image it
    /// names, pulled (its composed rootfs lies in the rootfs cache).
    pub(super) async fn fresh_source(
        &self,
        obj: &SandboxObj,
    ) -> Result<(String, RootfsSource, Option<ramify_image::PulledImage>)> {
        match (&obj.spec.rootfs, &obj.spec.image) {
            (Some(r), _) => rootfs_class::source_of(&self.client, r)
                .await
                .map(|(c, s)| (c, s, None)),
            (None, Some(image)) => {
                let p = self.pull_for(obj, image).await?;
                Ok((image.clone(), RootfsSource::Dir(p.rootfs.clone()), Some(p)))
            }
            (None, None) => Err(Error::Engine(EngineError::Invalid(
                "neither spec.rootfs nor spec.image is set".into(),
            ))),
        }
    }

    async fn start_fresh(
        &self,
        obj: &SandboxObj,
        rootfs: RootfsSource,
        workload: WorkloadSpec,
        pod_uid: Option<&str>,
    ) -> Result<LocalSandbox> {
        Ok(self
            .engine
            .start_in(
                StartRequest {
                    name: obj.name_any(),
                    rootfs,
                    workload,
                    egress_allow: egress_of(obj)?,
                },
                pod_uid,
            )
            .await?)
    }

    /// Restores a branch (warm pool first, then cold) and returns its provenance and
    /// its fork point (the parent's commit generation its snapshot recorded).
    async fn start_from_snapshot(
        &self,
        obj: &SandboxObj,
        rf: &ramify_crds::RestoreFrom,
        pod_uid: Option<&str>,
    ) -> Result<(LocalSandbox, serde_json::Value, Option<u64>)> {
        let ns = obj.namespace().unwrap_or_default();
        let snaps: Api<SnapshotObj> = Api::namespaced(self.client.clone(), &ns);
        // The watch cache first (a Ready snapshot of this node is there); the API
        // server when the cache has not seen it Ready yet. Both reads at once: this is
        // the fork's critical path.
        let cached = self.cache.get().and_then(|c| {
            let snap = c.snapshots.get(&ObjectRef::new(&rf.snapshot).within(&ns))?;
            let snap = snap.0.as_ref().ok()?;
            let st = snap.status.as_ref()?;
            (st.phase == SnapshotPhase::Ready).then(|| snap.clone())
        });
        let (snap, track) = tokio::try_join!(
            async {
                match cached {
                    Some(s) => Ok(Some(s)),
                    None => snaps.get_opt(&rf.snapshot).await.map_err(Error::from),
                }
            },
            self.tracked_globs(obj)
        )?;
        let snap = snap.ok_or_else(|| {
            Error::Engine(EngineError::Snapshot {
                id: rf.snapshot.clone(),
                reason: "not found".into(),
            })
        })?;
        let st = snap.status.clone().unwrap_or_default();
        if st.phase != SnapshotPhase::Ready {
            return Err(Error::Engine(EngineError::Snapshot {
                id: rf.snapshot.clone(),
                reason: format!("is {:?}, not Ready", st.phase),
            }));
        }
        // Taken on another node (a BranchSet with spec.placement): its image comes from
        // the object store, once per node, onto the root filesystem resolved here.
        let fetched = st.node_name.as_deref() != Some(self.cfg.node.as_str());
        let (rec, fetched_rootfs) = if fetched {
            let (rec, rootfs) = self.fetched_snapshot(obj, &snap).await?;
            (rec, Some(rootfs))
        } else {
            let rec = self
                .registry
                .snapshot(&snap.uid().unwrap_or_default())?
                .ok_or_else(|| {
                    Error::Engine(EngineError::Snapshot {
                        id: rf.snapshot.clone(),
                        reason: "this node holds no image for it".into(),
                    })
                })?;
            (rec, None)
        };
        let (name, index) = rf
            .branch
            .as_ref()
            .map(|b| (b.name.clone(), u32::try_from(b.index).unwrap_or(0)))
            .unwrap_or_else(|| (obj.name_any(), 0));

        let t0 = Instant::now();
        // A warm branch has no baseline manifest, so Paths commits restore cold.
        let snap_uid = snap.uid().unwrap_or_default();
        let warm = match pod_uid {
            // Cluster mode: a warm pool's Pods are on the snapshot's node only.
            Some(_) if fetched => None,
            // Cluster mode: the branch living in the warm pool Pod this Sandbox
            // adopted (waiting while it is restored there).
            Some(pod_uid) => {
                let claimed = self
                    .pools
                    .claim_in(&snap_uid, pod_uid, &name, index, POD_CLAIM_TIMEOUT)
                    .await;
                match claimed {
                    // Its Pod's netns and cgroup are the cold restore's: it goes first.
                    Some(Ok(sb)) if !track.is_empty() => {
                        self.engine
                            .destroy_or_report(sb, "a Paths branch restores cold in its Pod")
                            .await;
                        None
                    }
                    other => other,
                }
            }
            None if track.is_empty() => {
                match self.claim_ahead(obj, &rec.image_id, &name, index).await {
                    Some(claimed) => Some(claimed),
                    None => {
                        self.pools
                            .claim(&snap_uid, &name, index, Duration::from_secs(5))
                            .await
                    }
                }
            }
            None => None,
        };
        let (sb, was_warm) = match warm {
            Some(Ok(sb)) => {
                self.metrics.warm_hits.inc();
                self.metrics
                    .warm_claim_seconds
                    .observe(t0.elapsed().as_secs_f64());
                (sb, true)
            }
            other => {
                if let Some(Err(e)) = other {
                    warn!(error = %e, "warm claim failed; restoring cold");
                }
                self.metrics.warm_misses.inc();
                // A cold restore takes a while: say so (a warm claim goes straight to
                // Running). The note goes out while the restore runs, not before it,
                // and a failed note never costs the restored sandbox: it is reported
                // Running (or Failed) next anyway.
                // The image the snapshot pins, pulled again by digest if this node
                // lost it (never a newer tag).
                if !fetched {
                    self.images
                        .ensure_snapshot_image(&obj.spec.image_pull_secrets, &snap)
                        .await?;
                    // Its checkpoint too, from the object store if this node lost it.
                    self.remote.ensure_local_image(&snap, &rec).await?;
                }
                let restore = self.engine.fork_one_in(
                    &rec.image_id,
                    &name,
                    index,
                    &track,
                    pod_uid,
                    fetched_rootfs,
                );
                let (noted, sb) = futures::join!(
                    self.write_sandbox_status(
                        obj,
                        SandboxPhase::Starting,
                        None,
                        (
                            false,
                            "Restoring",
                            format!("restoring from snapshot {}", rf.snapshot),
                        ),
                        json!({}),
                    ),
                    restore
                );
                if let Err(e) = noted {
                    warn!(error = %e, "could not report Restoring");
                }
                let sb = sb?;
                self.metrics
                    .restore_seconds
                    .observe(t0.elapsed().as_secs_f64());
                (sb, false)
            }
        };
        let mut extra = json!({"restoredFrom": {
            "snapshot": rf.snapshot,
            "runscVersion": short_version(self.engine.runsc().version()),
            "sha256": st.sha256,
            "warm": was_warm,
            "fetched": fetched,
        }});
        if let Some(d) = &st.image_digest {
            extra["imageDigest"] = json!(d);
        }
        Ok((sb, extra, Some(rec.source_commit_generation)))
    }

    /// Globs to record right after restore (a Paths commit diffs against them).
    async fn tracked_globs(&self, obj: &SandboxObj) -> Result<Vec<String>> {
        let Some(branch) = obj
            .spec
            .restore_from
            .as_ref()
            .and_then(|r| r.branch.as_ref())
        else {
            return Ok(Vec::new());
        };
        let ns = obj.namespace().unwrap_or_default();
        let cached = self.cache.get().and_then(|c| {
            let bs = c
                .branchsets
                .get(&ObjectRef::new(&branch.branch_set).within(&ns))?;
            bs.0.as_ref().ok().cloned()
        });
        let bs = match cached {
            Some(bs) => Some(bs),
            None => {
                let api: Api<BranchSet> = Api::namespaced(self.client.clone(), &ns);
                api.get_opt(&branch.branch_set).await?
            }
        };
        Ok(match bs {
            Some(bs) if bs.spec.commit.mode == CommitMode::Paths => bs.spec.commit.paths.clone(),
            _ => Vec::new(),
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use serde_json::json;

    fn with_network(network: serde_json::Value) -> SandboxObj {
        let spec = serde_json::from_value(json!({"command": ["sh"], "network": network}));
        SandboxObj::new("ws", spec.unwrap())
    }

    #[test]
    fn the_allowlist_keeps_each_destinations_ports() {
        let sbx = with_network(json!({"egress": "Allow", "allow": [
            {"cidr": "10.0.0.0/8", "ports": [443, 8443]},
            {"cidr": "192.0.2.7/32"},
        ]}));
        let allow: Vec<String> = egress_of(&sbx)
            .unwrap()
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(allow, ["10.0.0.0/8:443,8443", "192.0.2.7/32"]);
        assert!(
            egress_of(&with_network(json!({"egress": "Deny"})))
                .unwrap()
                .is_empty()
        );
        // What the schema refuses is refused here too, never widened to every port.
        let bad = with_network(
            json!({"egress": "Allow", "allow": [{"cidr": "10.0.0.0/8", "ports": [0]}]}),
        );
        assert!(egress_of(&bad).is_err());
    }
}
