//! The node agent's Kubernetes side: it watches the Sandboxes and Snapshots bound to
//! its node (`status.nodeName`, a selectable field) and the BranchSets that commit into
//! its sandboxes, does the work with the [`Engine`], and reports through status. It
//! never talks to the operator directly.
//!
//! Crash safety: what the node holds is recorded in the [`registry`] before it is
//! reported, so a restarted agent resumes where it was: live sandboxes are re-adopted,
//! images are kept, a commit applied locally is reported instead of applied twice, and
//! anything the API no longer knows is destroyed (no orphans).

pub mod admission;
pub mod backoff;
mod commit;
pub mod commit_guard;
pub mod decided;
pub mod endpoint;
mod exit;
pub mod lease;
pub mod metrics;
pub mod pools;
pub mod registry;
pub mod resume;
mod rootfs_class;
pub mod verdict_watch;
pub mod writes;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use kube::core::DeserializeGuard;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};
use ramify_crds::{
    BranchSet, CommitMode, Condition, ConditionStatus, ConditionsExt, DiffSummary,
    FINALIZER_NODE_CLEANUP, REASON_ROOTFS_REFUSED, Sandbox as SandboxObj, SandboxPhase,
    Snapshot as SnapshotObj, SnapshotPhase, VerdictValue,
};
use serde_json::json;
use tokio::sync::Mutex as AsyncMutex;
use tracing::{info, instrument, warn};

use crate::control::Verdict;
use crate::engine::{Engine, Sandbox, StartRequest, WarmPool};
use crate::error::{Error, Result};
use crate::placement::Cidr;
use crate::rootfs::RootfsSource;
use crate::spec::{Resources, WorkloadSpec};
use metrics::AgentMetrics;
use registry::{Registry, SandboxRecord, SnapshotRecord};

const SANDBOX_MANAGER: &str = "ramify-node-agent/sandbox";
const BRANCH_MANAGER: &str = "ramify-node-agent/branch";
const COMMIT_MANAGER: &str = "ramify-node-agent/commit";
const SNAPSHOT_MANAGER: &str = "ramify-node-agent/snapshot";
/// At most this many changed files are listed in a status (the count is always exact).
const MAX_LISTED_FILES: usize = 256;

/// Agent settings.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    pub node: String,
    pub system_namespace: String,
    /// What sandboxes may hold of this node (capacity minus the reserve).
    pub allocatable: ramify_crds::capacity::Requests,
    /// Restores (and fresh starts) run at once.
    pub max_restores: usize,
}

type Handle = Arc<AsyncMutex<Option<Sandbox>>>;

/// The running agent.
pub struct Agent {
    pub client: Client,
    pub engine: Engine,
    pub cfg: AgentConfig,
    pub registry: Registry,
    pub metrics: AgentMetrics,
    recorder: Recorder,
    /// Live local sandboxes by Sandbox object uid.
    handles: Mutex<HashMap<String, Handle>>,
    /// Warm pools by Snapshot object uid.
    pools: pools::Pools<WarmPool>,
    /// Branch runs in flight, by Sandbox uid; `true` sent when the branch is deleted
    /// (its run and verdict commands are dropped: a loser goes at once).
    runners: Mutex<HashMap<String, tokio::sync::watch::Sender<bool>>>,
    /// Unique per agent process: tells runs this process started from earlier ones.
    epoch: String,
    /// The controllers' watch caches (set by `run`), read before the API server on
    /// the fork's critical path.
    cache: std::sync::OnceLock<AgentCache>,
    /// One reconcile at a time per Sandbox uid: two watches (bound here, and pinned
    /// here by spec) can deliver the same sandbox.
    in_flight: Mutex<HashMap<String, Arc<AsyncMutex<()>>>>,
    /// Sandboxes this process has reported Running: an older copy of the object (the
    /// other watch may deliver one) must not make it report again, with less.
    reported: Mutex<HashSet<String>>,
    /// What a sandbox's Running report carries (its provenance), until it lands.
    unreported: Mutex<HashMap<String, serde_json::Value>>,
    /// Capacity and restore slots of this node, starts in flight, deletions done.
    admission: admission::Admission,
    /// Branches of this node and which are frozen (decided, or lost).
    decided: decided::Decided,
    /// The controllers' per-object backoff, and their reports of permanent failures
    /// (naming this node).
    settler: ramify_runtime::settle::Settler,
}

/// What the agent's watches hold: its node's Snapshots, every BranchSet, and the
/// Sandboxes bound or pinned here.
struct AgentCache {
    snapshots: Store<DeserializeGuard<SnapshotObj>>,
    branchsets: Store<DeserializeGuard<BranchSet>>,
    bound: Store<DeserializeGuard<SandboxObj>>,
    pinned: Store<DeserializeGuard<SandboxObj>>,
}

fn now() -> Time {
    Time(Timestamp::now())
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Quantity parsing is shared with the operator's capacity accounting.
pub use ramify_crds::capacity::{cpu_millis, memory_bytes};

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
        resources: Resources {
            cpu_millis: res.cpu.as_deref().and_then(cpu_millis),
            memory_bytes: res.memory.as_deref().and_then(memory_bytes),
            pids: res.pids.and_then(|p| u64::try_from(p).ok()),
        },
    }
}

/// Egress allowlist of a Sandbox object (empty: deny everything).
pub fn egress_of(sbx: &SandboxObj) -> Result<Vec<Cidr>> {
    match sbx.spec.network.egress {
        ramify_crds::Egress::Deny => Ok(Vec::new()),
        ramify_crds::Egress::Allow => sbx
            .spec
            .network
            .allow
            .iter()
            .map(|r| r.cidr.parse())
            .collect(),
    }
}

/// Most effects recorded per branch, and the largest payload kept per effect.
const MAX_RECORDED_EFFECTS: usize = 64;
const MAX_EFFECT_PAYLOAD: usize = 4096;

/// The effects a control-directory scan found, bounded, in file-name order. Rejected
/// files (hostile or malformed) are not effects: they are logged, never executed.
pub fn requested_effects(scan: &crate::control::ControlScan) -> Vec<ramify_crds::RequestedEffect> {
    for r in &scan.rejected {
        warn!(rejected = %r, "ignoring a control file");
    }
    scan.effects
        .iter()
        .take(MAX_RECORDED_EFFECTS)
        .map(|e| {
            let payload = e.payload.to_string();
            ramify_crds::RequestedEffect {
                name: e.file.clone(),
                kind: e.kind.chars().take(64).collect(),
                payload: if payload.len() > MAX_EFFECT_PAYLOAD {
                    String::from("\"(payload over 4 KiB dropped)\"")
                } else {
                    payload
                },
            }
        })
        .collect()
}

/// `runsc version release-20260527.0` -> `release-20260527.0` (for status).
pub fn short_version(v: &str) -> &str {
    v.trim_start_matches("runsc version ").trim()
}

fn error_category(e: &Error) -> &'static str {
    e.category()
}

impl Agent {
    pub fn new(
        client: Client,
        engine: Engine,
        cfg: AgentConfig,
        registry: Registry,
        metrics: AgentMetrics,
    ) -> Self {
        let recorder = Recorder::new(
            client.clone(),
            Reporter {
                controller: "ramify-node-agent".into(),
                instance: Some(cfg.node.clone()),
            },
        );
        let admission = admission::Admission::new(cfg.allocatable, cfg.max_restores);
        let settler = backoff::settler(&cfg.node, recorder.clone());
        Self {
            client,
            engine,
            cfg,
            admission,
            decided: decided::Decided::default(),
            registry,
            metrics,
            recorder,
            handles: Mutex::new(HashMap::new()),
            pools: pools::Pools::default(),
            runners: Mutex::new(HashMap::new()),
            epoch: uuid::Uuid::new_v4().to_string(),
            cache: std::sync::OnceLock::new(),
            in_flight: Mutex::new(HashMap::new()),
            reported: Mutex::new(HashSet::new()),
            unreported: Mutex::new(HashMap::new()),
            settler,
        }
    }

    fn mark_reported(&self, uid: &str) {
        if let Ok(mut u) = self.unreported.lock() {
            u.remove(uid);
        }
        if let Ok(mut r) = self.reported.lock() {
            r.insert(uid.to_string());
        }
    }

    fn handle(&self, uid: &str) -> Option<Handle> {
        self.handles.lock().ok()?.get(uid).cloned()
    }

    fn insert_handle(&self, uid: &str, sb: Sandbox) -> Handle {
        let h: Handle = Arc::new(AsyncMutex::new(Some(sb)));
        if let Ok(mut m) = self.handles.lock() {
            m.insert(uid.to_string(), h.clone());
            self.metrics
                .sandboxes
                .set(i64::try_from(m.len()).unwrap_or(i64::MAX));
        }
        h
    }

    fn take_handle(&self, uid: &str) -> Option<Handle> {
        let mut m = self.handles.lock().ok()?;
        let h = m.remove(uid);
        self.metrics
            .sandboxes
            .set(i64::try_from(m.len()).unwrap_or(i64::MAX));
        h
    }

    async fn event(
        &self,
        obj: &impl Resource<DynamicType = ()>,
        warning: bool,
        reason: &str,
        note: String,
    ) {
        ramify_runtime::events::publish(
            &self.recorder,
            &obj.object_ref(&()),
            warning,
            reason,
            "NodeAgent",
            note,
        )
        .await;
    }

    /// Writes the agent-owned part of a Sandbox's status (always the whole part: with
    /// server-side apply, a field left out is a field given up).
    async fn write_sandbox_status(
        &self,
        obj: &SandboxObj,
        phase: SandboxPhase,
        sb: Option<&Sandbox>,
        ready: (bool, &str, String),
        extra: serde_json::Value,
    ) -> Result<()> {
        let api: Api<SandboxObj> =
            Api::namespaced(self.client.clone(), &obj.namespace().unwrap_or_default());
        let old = obj.status.clone().unwrap_or_default();
        let mut conditions = old.conditions.clone();
        let status = if ready.0 {
            ConditionStatus::True
        } else {
            ConditionStatus::False
        };
        conditions.set_condition(
            Condition::new("Ready", status, ready.1, ready.2, obj.metadata.generation),
            now(),
        );
        let mut st = json!({
            "phase": phase,
            "observedGeneration": obj.metadata.generation,
            "conditions": conditions.iter().filter(|c| c.type_ == "Ready").collect::<Vec<_>>(),
        });
        if let Some(sb) = sb {
            st["sandboxId"] = json!(sb.id);
            st["identity"] = json!(sb.identity.uid);
        }
        if let Some(t) = old.started_at.clone() {
            st["startedAt"] = json!(t);
        }
        if let Some(rf) = old.restored_from.clone() {
            st["restoredFrom"] = json!(rf);
        }
        if let Some(code) = old.exit_code {
            st["exitCode"] = json!(code);
        }
        if let Some(exit) = old.exit.clone() {
            st["exit"] = json!(exit);
        }
        if let (Some(dst), Some(src)) = (st.as_object_mut(), extra.as_object()) {
            for (k, v) in src {
                dst.insert(k.clone(), v.clone());
            }
        }
        let body = json!({"apiVersion": "ramify.dev/v1alpha1", "kind": "Sandbox", "status": st});
        writes::within(
            "status",
            api.patch_status(
                &obj.name_any(),
                &PatchParams::apply(SANDBOX_MANAGER).force(),
                &Patch::Apply(&body),
            ),
        )
        .await?;
        Ok(())
    }

    /// A cleanup step for `obj` that failed for good: logged with the object, counted.
    fn cleanup_failed(&self, obj: &impl Resource, step: &str, e: &Error) {
        warn!(
            object = %obj.meta().name.as_deref().unwrap_or_default(),
            namespace = obj.meta().namespace.as_deref().unwrap_or_default(),
            step,
            error = %e,
            "cleanup failed"
        );
        self.engine.count_cleanup_failure(step, e);
    }

    async fn release_finalizer<K>(&self, obj: &K) -> Result<()>
    where
        K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
            + Clone
            + serde::de::DeserializeOwned
            + std::fmt::Debug,
    {
        let api: Api<K> = Api::namespaced(
            self.client.clone(),
            &obj.meta().namespace.clone().unwrap_or_default(),
        );
        writes::within(
            "finalizer",
            ramify_runtime::finalizer::remove(&api, obj, FINALIZER_NODE_CLEANUP),
        )
        .await
    }

    // ----- Sandbox -------------------------------------------------------------

    #[instrument(skip_all, fields(sandbox = %obj.name_any()))]
    async fn reconcile_sandbox(self: &Arc<Self>, obj: &SandboxObj) -> Result<Action> {
        let uid = obj.uid().unwrap_or_default();
        if !self.is_mine(obj) {
            return Ok(Action::await_change());
        }
        let slot = self
            .in_flight
            .lock()
            .map_err(|_| Error::Join("in-flight lock poisoned".into()))?
            .entry(uid.clone())
            .or_default()
            .clone();
        let _serial = slot.lock().await;
        let res = self.reconcile_mine(obj, &uid).await;
        if obj.metadata.deletion_timestamp.is_some() && res.is_ok() {
            if let Ok(mut m) = self.in_flight.lock() {
                m.remove(&uid);
            }
            if let Ok(mut r) = self.reported.lock() {
                r.remove(&uid);
            }
            if let Ok(mut u) = self.unreported.lock() {
                u.remove(&uid);
            }
        }
        res
    }

    /// Bound here (`status.nodeName`), or pinned here by its spec and not yet bound: the
    /// operator binds a sandbox to its `spec.nodeName`, so a branch (whose spec names
    /// its snapshot's node) can start before the binding write lands.
    fn is_mine(&self, obj: &SandboxObj) -> bool {
        let me = Some(self.cfg.node.as_str());
        match obj.status.as_ref().and_then(|s| s.node_name.as_deref()) {
            Some(bound) => Some(bound) == me,
            None => obj.spec.node_name.as_deref() == me,
        }
    }

    async fn reconcile_mine(self: &Arc<Self>, obj: &SandboxObj, uid: &str) -> Result<Action> {
        let uid = uid.to_string();
        if obj.metadata.deletion_timestamp.is_some() {
            // A start or restore in flight for it finishes first (its sandbox is then
            // destroyed here): the finalizer never goes while something of it may
            // still come to exist on the node.
            if self.admission.is_starting(&uid) {
                return Ok(Action::requeue(Duration::from_millis(200)));
            }
            // From here on nothing is started for it again, whatever copy of the
            // object a lagging watch still delivers; and no freeze targets it.
            self.admission.bury(&uid);
            self.forget_branch(&uid);
            // A branch run holds the sandbox while its command runs: drop it now, so
            // a loser is destroyed at once rather than when its command ends.
            if let Ok(r) = self.runners.lock()
                && let Some(deleted) = r.get(&uid)
            {
                deleted.send_replace(true);
            }
            match self.take_handle(&uid) {
                Some(h) => {
                    // A branch run lets go of it at once (dropped above); a commit in
                    // progress is waited for.
                    let taken = h.lock().await.take();
                    match taken {
                        Some(sb) => {
                            // The object goes only once the node holds nothing of it.
                            info!(id = %sb.id, "destroying deleted sandbox");
                            if let Err(e) = self.engine.teardown(&sb).await {
                                // Held again, so the retry tears down what is left (a
                                // lease, a rule) instead of finding no handle and
                                // releasing the finalizer over a half-removed sandbox.
                                self.insert_handle(&uid, sb);
                                return Err(e);
                            }
                        }
                        None => {
                            info!("deleted sandbox was already handed over (commit) or destroyed")
                        }
                    }
                }
                None => info!("deleted sandbox has no local handle"),
            }
            self.registry.remove_sandbox(&uid)?;
            // Its room goes to whoever waits, now that nothing of it runs.
            self.admission.release(&uid);
            self.publish_capacity();
            self.release_finalizer(obj).await?;
            return Ok(Action::await_change());
        }
        if self.admission.is_buried(&uid) {
            // A stale copy of a sandbox whose deletion this agent completed.
            return Ok(Action::await_change());
        }
        let status = obj.status.clone().unwrap_or_default();
        if let Some(h) = self.handle(&uid) {
            return self.watch_running(obj, &uid, h).await;
        }
        if matches!(
            status.phase,
            SandboxPhase::Failed | SandboxPhase::Succeeded | SandboxPhase::Aborted
        ) {
            return Ok(Action::await_change());
        }
        if self.registry.sandbox(&uid)?.is_some_and(|r| r.handed_over) {
            info!("this winner's sandbox was handed to its parent by a Full commit");
            return Ok(Action::await_change());
        }
        if status.sandbox_id.is_some() {
            // It ran here, and this node no longer has it: report, never restart.
            self.write_sandbox_status(obj, SandboxPhase::Failed, None, (false, "SandboxLost", "the node agent has no record of this sandbox (its state was lost); it is not restarted fresh".into()), json!({})).await?;
            self.event(
                obj,
                true,
                "SandboxLost",
                "sandbox state lost on the node".into(),
            )
            .await;
            return Ok(Action::await_change());
        }
        if let Some(wait) = self.admit(obj, &uid).await? {
            return Ok(wait);
        }
        self.start_sandbox(obj, &uid).await
    }

    async fn start_sandbox(self: &Arc<Self>, obj: &SandboxObj, uid: &str) -> Result<Action> {
        let t0 = Instant::now();
        // In flight from here until its handle is held (or it failed): a deletion
        // meanwhile waits for it.
        let _claim = self.admission.claim(uid);
        let slot = self.admission.restores.permit(uid);
        self.publish_capacity();
        let started = match &obj.spec.restore_from {
            Some(rf) => self.restore_branch(obj, rf).await,
            None => match self.fresh_source(obj).await {
                // A failed API read is not the sandbox's fault: retried, not Failed.
                Err(e @ Error::Kube(_)) => return Err(e),
                Err(e) => Err(e),
                Ok((class, source)) => {
                    self.write_sandbox_status(
                        obj,
                        SandboxPhase::Starting,
                        None,
                        (false, "Starting", "starting".into()),
                        json!({}),
                    )
                    .await?;
                    self.start_fresh(obj, source.clone())
                        .await
                        .map(|sb| (sb, json!({}), None))
                        .map_err(|e| rootfs_class::name_the_field(&class, &source, e))
                }
            },
        };
        drop(slot);
        // A warm claim took no slot; any place it still had in the queue goes too.
        self.admission.restores.leave(uid);
        let (sb, extra, fork_generation) = match started {
            Ok(x) => x,
            Err(e) => {
                // Nothing of it runs: its room goes to whoever waits.
                self.admission.release(uid);
                self.publish_capacity();
                // Refused at the first reconcile and never retried: the spec's rootfs
                // (and the image's platform) is immutable, so a retry could only be
                // refused again.
                let reason = match &e {
                    Error::RootfsRefused(_) => REASON_ROOTFS_REFUSED,
                    Error::PlatformMismatch { .. } => ramify_crds::REASON_PLATFORM_MISMATCH,
                    _ if obj.spec.restore_from.is_some() => "RestoreFailed",
                    _ => "StartFailed",
                };
                self.metrics.failed("sandbox", error_category(&e));
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
        self.remember_branch(uid, obj, &sb);
        let h = self.insert_handle(uid, sb);
        if let Ok(mut u) = self.unreported.lock() {
            u.insert(uid.to_string(), extra.clone());
        }
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
        self.mark_reported(uid);
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

    /// Which RootfsClass a fresh sandbox names, and what it points to.
    async fn fresh_source(&self, obj: &SandboxObj) -> Result<(String, RootfsSource)> {
        match (&obj.spec.rootfs, &obj.spec.image) {
            (Some(r), _) => rootfs_class::source_of(&self.client, r).await,
            (None, Some(image)) => Err(Error::Invalid(format!(
                "spec.image {image:?} needs cluster mode (an image volume); this node runs standalone: use spec.rootfs.class"
            ))),
            (None, None) => Err(Error::Invalid(
                "neither spec.rootfs nor spec.image is set".into(),
            )),
        }
    }

    async fn start_fresh(&self, obj: &SandboxObj, rootfs: RootfsSource) -> Result<Sandbox> {
        self.engine
            .start(StartRequest {
                name: obj.name_any(),
                rootfs,
                workload: workload_of(obj),
                egress_allow: egress_of(obj)?,
            })
            .await
    }

    /// Restores a branch (warm pool first, then cold) and returns its provenance and
    /// its fork point (the parent's commit generation its snapshot recorded).
    async fn restore_branch(
        &self,
        obj: &SandboxObj,
        rf: &ramify_crds::RestoreFrom,
    ) -> Result<(Sandbox, serde_json::Value, Option<u64>)> {
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
        let snap = snap.ok_or_else(|| Error::Snapshot {
            id: rf.snapshot.clone(),
            reason: "not found".into(),
        })?;
        let st = snap.status.clone().unwrap_or_default();
        if st.phase != SnapshotPhase::Ready {
            return Err(Error::Snapshot {
                id: rf.snapshot.clone(),
                reason: format!("is {:?}, not Ready", st.phase),
            });
        }
        if st.node_name.as_deref() != Some(self.cfg.node.as_str()) {
            return Err(Error::Snapshot {
                id: rf.snapshot.clone(),
                reason: format!(
                    "is stored on node {:?}, not on {}",
                    st.node_name, self.cfg.node
                ),
            });
        }
        let rec = self
            .registry
            .snapshot(&snap.uid().unwrap_or_default())?
            .ok_or_else(|| Error::Snapshot {
                id: rf.snapshot.clone(),
                reason: "this node holds no image for it".into(),
            })?;
        let (name, index) = rf
            .branch
            .as_ref()
            .map(|b| (b.name.clone(), u32::try_from(b.index).unwrap_or(0)))
            .unwrap_or_else(|| (obj.name_any(), 0));

        let t0 = Instant::now();
        // A warm branch has no baseline manifest, so Paths commits restore cold.
        let warm = if track.is_empty() {
            self.pools
                .claim(
                    &snap.uid().unwrap_or_default(),
                    &name,
                    index,
                    Duration::from_secs(5),
                )
                .await
        } else {
            None
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
                    self.engine.fork_one(&rec.image_id, &name, index, &track)
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
        let extra = json!({"restoredFrom": {
            "snapshot": rf.snapshot,
            "runscVersion": short_version(self.engine.runsc().version()),
            "sha256": st.sha256,
            "warm": was_warm,
        }});
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

    async fn watch_running(
        self: &Arc<Self>,
        obj: &SandboxObj,
        uid: &str,
        h: Handle,
    ) -> Result<Action> {
        // Held by a branch's run or verdict command (or a commit): the sandbox is in
        // use, so look again later. Waiting here would hold up this sandbox's next
        // reconcile (its deletion among them) for as long as the command runs.
        let Ok(guard) = h.try_lock() else {
            return Ok(Action::requeue(Duration::from_secs(2)));
        };
        let Some(sb) = guard.as_ref() else {
            return Ok(Action::await_change());
        };
        // A frozen branch runs (it only does not get CPU); asking runsc would wait on it.
        let running = self.decided.is_frozen(uid) || self.engine.is_running(sb).await?;
        let status = obj.status.clone().unwrap_or_default();
        if !running && status.phase == SandboxPhase::Running {
            self.report_exit(obj, sb).await?;
            // Its processes are gone: so is what they held of the node.
            self.admission.capacity.leave(uid);
            self.publish_capacity();
            return Ok(Action::await_change());
        }
        let reported = self
            .reported
            .lock()
            .map(|r| r.contains(uid))
            .unwrap_or(false);
        if running
            && !reported
            && status.phase != SandboxPhase::Running
            && status.phase != SandboxPhase::Paused
        {
            // Re-adopted after a restart, or its first report did not land.
            let extra = self
                .unreported
                .lock()
                .ok()
                .and_then(|u| u.get(uid).cloned())
                .unwrap_or_else(|| json!({}));
            self.write_sandbox_status(
                obj,
                SandboxPhase::Running,
                Some(sb),
                (true, "Running", format!("running as {}", sb.id)),
                extra,
            )
            .await?;
            self.mark_reported(uid);
        }
        drop(guard);
        if let Some(branch) = obj
            .spec
            .restore_from
            .as_ref()
            .and_then(|r| r.branch.clone())
            && status.branch.as_ref().and_then(|b| b.verdict).is_none()
            && !self
                .runners
                .lock()
                .map(|r| r.contains_key(uid))
                .unwrap_or(true)
        {
            let rec = self.registry.sandbox(uid)?;
            let recorded = rec.as_ref().and_then(|r| r.outcome.clone());
            let started_by = rec.and_then(|r| r.run_epoch);
            if let Some(outcome) = recorded {
                // Decided, but the report did not land (API outage, or a crash in
                // between): send it again (frozen meanwhile).
                self.freeze_branch(uid).await;
                let api: Api<SandboxObj> =
                    Api::namespaced(self.client.clone(), &obj.namespace().unwrap_or_default());
                self.report_outcome(&api, &obj.name_any(), &outcome).await?;
            } else if started_by.as_deref() == Some(self.epoch.as_str()) {
                // This process ran it and finished: the outcome write is on its way.
            } else if started_by.is_some() {
                // The run was under way when the agent died; its result is unknown.
                self.write_outcome(obj, None, VerdictValue::Abort, "the node agent restarted while this branch ran; its outcome is unknown, so it aborts".into(), None, None, None).await?;
            } else {
                self.spawn_branch_run(obj.clone(), uid.to_string(), branch, 0);
            }
        }
        Ok(Action::requeue(Duration::from_secs(10)))
    }

    // ----- Branch runs ---------------------------------------------------------

    fn spawn_branch_run(
        self: &Arc<Self>,
        obj: SandboxObj,
        uid: String,
        branch: ramify_crds::BranchRef,
        fork_millis: i64,
    ) {
        let (deleted_tx, deleted) = tokio::sync::watch::channel(false);
        match self.runners.lock() {
            Ok(mut r) if !r.contains_key(&uid) => {
                r.insert(uid.clone(), deleted_tx);
            }
            _ => return,
        }
        let agent = self.clone();
        tokio::spawn(async move {
            let ran = agent
                .run_branch(&obj, &uid, &branch, fork_millis, deleted.clone())
                .await;
            if *deleted.borrow() {
                info!(sandbox = %obj.name_any(), "branch deleted while it ran; its run was dropped");
            } else if let Err(e) = ran {
                warn!(error = %e, sandbox = %obj.name_any(), "branch run failed");
                let reported = agent
                    .write_outcome(
                        &obj,
                        None,
                        VerdictValue::Abort,
                        format!("branch run failed: {e}"),
                        None,
                        Some(fork_millis),
                        None,
                    )
                    .await;
                if let Err(e) = reported {
                    // Recorded before the report: the next reconcile sends it again.
                    warn!(error = %e, sandbox = %obj.name_any(), namespace = obj.namespace().unwrap_or_default(), "reporting the failed run failed");
                    agent.metrics.failed("branch", e.category());
                }
            }
            if let Ok(mut r) = agent.runners.lock() {
                r.remove(&uid);
            }
        });
    }

    #[instrument(skip_all, fields(branch = %branch.name))]
    async fn run_branch(
        &self,
        obj: &SandboxObj,
        uid: &str,
        branch: &ramify_crds::BranchRef,
        fork_millis: i64,
        mut deleted: tokio::sync::watch::Receiver<bool>,
    ) -> Result<()> {
        let api: Api<BranchSet> =
            Api::namespaced(self.client.clone(), &obj.namespace().unwrap_or_default());
        let bs = api
            .get_opt(&branch.branch_set)
            .await?
            .ok_or_else(|| Error::Invalid(format!("BranchSet {} not found", branch.branch_set)))?;
        let (run, env) = match (&bs.spec.branches, &bs.spec.template) {
            (Some(list), _) => list
                .iter()
                .find(|b| b.name == branch.name)
                .map(|b| (b.run.clone(), b.env.clone()))
                .unwrap_or_default(),
            (None, Some(t)) => (t.run.clone(), t.env.clone()),
            _ => Default::default(),
        };
        let mut env: Vec<(String, String)> = env.into_iter().map(|e| (e.name, e.value)).collect();
        env.push(("RAMIFY_BRANCH".into(), branch.name.clone()));
        env.push(("RAMIFY_BRANCH_INDEX".into(), branch.index.to_string()));
        env.push(("RAMIFY_BRANCHSET".into(), branch.branch_set.clone()));
        let timeout = Duration::from_secs(u64::try_from(bs.spec.timeout_seconds).unwrap_or(600));
        self.registry
            .update_sandbox(uid, |rec| rec.run_epoch = Some(self.epoch.clone()))?;
        let h = self
            .handle(uid)
            .ok_or_else(|| Error::Invalid("branch sandbox vanished".into()))?;
        // One watcher of the verdict file per branch, bounded whatever the workload
        // writes (see `verdict_watch`); it needs no lock on the sandbox.
        let mut watch = {
            let g = h.lock().await;
            let sb = g
                .as_ref()
                .ok_or_else(|| Error::Invalid("branch sandbox vanished".into()))?;
            verdict_watch::VerdictWatch::new(sb.control_dir())
        };
        let t0 = Instant::now();

        // The workload may decide at any time through /run/ramify/verdict; the run and
        // the verdict command race against it.
        let decided = async {
            let mut exit_code = None;
            if !run.is_empty() {
                let out = {
                    let g = h.lock().await;
                    let sb = g
                        .as_ref()
                        .ok_or_else(|| Error::Invalid("branch sandbox vanished".into()))?;
                    self.engine.run_command(sb, &run, &env, timeout).await?
                };
                exit_code = Some(out.code);
                if let Some(v) = self.verdict_file(&h).await {
                    return Ok::<_, Error>((
                        exit_code,
                        v,
                        "the workload wrote /run/ramify/verdict".to_string(),
                    ));
                }
                if bs.spec.verdict.is_none() {
                    let v = if out.code == 0 {
                        VerdictValue::Commit
                    } else {
                        VerdictValue::Abort
                    };
                    return Ok((exit_code, v, format!("run exited {}", out.code)));
                }
            }
            if let Some(verdict) = &bs.spec.verdict {
                let vt = Duration::from_secs(u64::try_from(verdict.timeout_seconds).unwrap_or(60));
                let out = {
                    let g = h.lock().await;
                    let sb = g
                        .as_ref()
                        .ok_or_else(|| Error::Invalid("branch sandbox vanished".into()))?;
                    self.engine
                        .run_command(sb, &verdict.command, &env, vt)
                        .await
                };
                return Ok(match out {
                    Ok(o) if o.code == 0 => (
                        exit_code,
                        VerdictValue::Commit,
                        "verdict command exited 0".into(),
                    ),
                    Ok(o) => (
                        exit_code,
                        VerdictValue::Abort,
                        format!("verdict command exited {}", o.code),
                    ),
                    Err(Error::Timeout { seconds, .. }) => (
                        exit_code,
                        VerdictValue::Abort,
                        format!("verdict command timed out after {seconds}s"),
                    ),
                    Err(e) => return Err(e),
                });
            }
            // No command at all: the workload's verdict file decides (the watcher
            // below), or the timeout.
            std::future::pending().await
        };
        let watch_file = async {
            // The sandbox as it is now (a Full commit into this branch swaps it); not
            // known while a command holds it, and no commit swaps it meanwhile.
            let current = || h.try_lock().ok()?.as_ref().map(Sandbox::control_dir);
            let v = match watch.verdict(current).await {
                Verdict::Commit => VerdictValue::Commit,
                Verdict::Abort => VerdictValue::Abort,
            };
            (v, "the workload wrote /run/ramify/verdict".to_string())
        };
        let (exit_code, verdict, reason) = tokio::select! {
            r = decided => r?,
            (v, why) = watch_file => (None, v, why),
            () = tokio::time::sleep(timeout) => (None, VerdictValue::Abort, format!("no verdict within {}s", timeout.as_secs())),
            // Deleted (a loser, or its BranchSet went): dropping the run kills its
            // `runsc exec` and lets go of the sandbox, which is destroyed at once.
            () = until_deleted(&mut deleted) => {
                return Err(Error::Invalid("the branch was deleted while it ran".into()));
            }
        };
        let run_millis = millis(t0.elapsed());
        let diff = if bs.spec.commit.mode == CommitMode::Paths {
            let g = h.lock().await;
            match g.as_ref() {
                Some(sb) => self
                    .engine
                    .diff_since_restore(sb, &bs.spec.commit.paths)
                    .await
                    .ok(),
                None => None,
            }
        } else {
            None
        };
        let summary = diff.map(|d| DiffSummary {
            added: i64::try_from(d.added.len()).unwrap_or(i64::MAX),
            modified: i64::try_from(d.modified.len()).unwrap_or(i64::MAX),
            deleted: i64::try_from(d.deleted.len()).unwrap_or(i64::MAX),
            bytes: i64::try_from(d.bytes()).unwrap_or(i64::MAX),
        });
        self.write_outcome(
            obj,
            exit_code,
            verdict,
            reason,
            summary,
            Some(fork_millis),
            Some(run_millis),
        )
        .await
    }

    async fn verdict_file(&self, h: &Handle) -> Option<VerdictValue> {
        let g = h.lock().await;
        let sb = g.as_ref()?;
        match self.engine.control(sb).verdict? {
            Verdict::Commit => Some(VerdictValue::Commit),
            Verdict::Abort => Some(VerdictValue::Abort),
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn write_outcome(
        &self,
        obj: &SandboxObj,
        exit_code: Option<i32>,
        verdict: VerdictValue,
        reason: String,
        diff: Option<DiffSummary>,
        fork_millis: Option<i64>,
        run_millis: Option<i64>,
    ) -> Result<()> {
        let api: Api<SandboxObj> =
            Api::namespaced(self.client.clone(), &obj.namespace().unwrap_or_default());
        // The effects gate records what the branch asked for up to its verdict.
        let effects = match obj.uid().and_then(|u| self.handle(&u)) {
            Some(h) => {
                let g = h.lock().await;
                g.as_ref()
                    .map(|sb| requested_effects(&self.engine.control(sb)))
                    .unwrap_or_default()
            }
            None => Vec::new(),
        };
        let decided = json!({
            "effects": effects,
            "exitCode": exit_code,
            "verdict": verdict,
            "reason": reason,
            "diffSummary": diff,
            "forkMillis": fork_millis,
            "runMillis": run_millis,
            "finishedAt": now(),
        });
        // Record before reporting; an outcome already recorded is final (a later
        // fallback, e.g. "run failed" after the report itself failed, must not
        // replace the verdict the branch reached).
        let recorded = match obj.uid() {
            Some(u) => self.registry.update_sandbox(&u, |rec| {
                rec.outcome.get_or_insert_with(|| decided.clone());
            })?,
            None => None,
        };
        let outcome = recorded.and_then(|r| r.outcome).unwrap_or(decided);
        // Decided: it stops consuming CPU before the API server hears of it.
        if let Some(uid) = obj.uid() {
            self.freeze_branch(&uid).await;
        }
        self.report_outcome(&api, &obj.name_any(), &outcome).await?;
        info!(sandbox = %obj.name_any(), ?verdict, "branch verdict");
        Ok(())
    }

    /// Sends a recorded outcome, retrying through an API-server outage (a lost
    /// verdict would turn a winner into a timeout).
    async fn report_outcome(
        &self,
        api: &Api<SandboxObj>,
        name: &str,
        outcome: &serde_json::Value,
    ) -> Result<()> {
        let body = json!({"apiVersion": "ramify.dev/v1alpha1", "kind": "Sandbox", "status": {"branch": outcome}});
        let mut attempts = 0;
        loop {
            let sent = writes::within(
                "branch outcome",
                api.patch_status(
                    name,
                    &PatchParams::apply(BRANCH_MANAGER).force(),
                    &Patch::Apply(&body),
                ),
            )
            .await;
            match sent {
                Ok(_) => return Ok(()),
                // Deleted (lost the race, or its BranchSet ended): nothing to report.
                Err(Error::Kube(kube::Error::Api(s))) if s.code == 404 => return Ok(()),
                // Still recorded on disk: the sandbox's reconcile sends it again.
                Err(e) if attempts >= 8 => return Err(e),
                Err(e) => {
                    warn!(error = %e, sandbox = name, attempt = attempts, "reporting the branch outcome failed; retrying");
                    tokio::time::sleep(writes::backoff(attempts)).await;
                    attempts += 1;
                }
            }
        }
    }

    // ----- Snapshot ------------------------------------------------------------

    #[instrument(skip_all, fields(snapshot = %snap.name_any()))]
    async fn reconcile_snapshot(&self, snap: &SnapshotObj) -> Result<Action> {
        let uid = snap.uid().unwrap_or_default();
        let ns = snap.namespace().unwrap_or_default();
        if snap.status.as_ref().and_then(|s| s.node_name.as_deref()) != Some(self.cfg.node.as_str())
        {
            return Ok(Action::await_change());
        }
        if snap.metadata.deletion_timestamp.is_some() {
            if let Err(e) = self.pools.replace(&uid, None).await {
                self.cleanup_failed(snap, "close warm pool", &e);
            }
            self.admission.capacity.leave(&admission::pool_key(&uid));
            if let Some(rec) = self.registry.snapshot(&uid)? {
                self.engine.store().remove(&rec.image_id)?;
                self.registry.remove_snapshot(&uid)?;
            }
            self.release_finalizer(snap).await?;
            return Ok(Action::await_change());
        }
        let status = snap.status.clone().unwrap_or_default();
        if let Some(rec) = self.registry.snapshot(&uid)? {
            if status.phase != SnapshotPhase::Ready {
                // Captured before a crash, not yet reported.
                let meta = self.engine.store().meta(&rec.image_id)?;
                self.write_snapshot_ready(snap, &meta, None, rec.source_commit_generation)
                    .await?;
            }
            return self.keep_pool(snap, &uid, &rec).await;
        }
        if status.phase == SnapshotPhase::Failed {
            return Ok(Action::await_change());
        }
        if status.phase == SnapshotPhase::Ready {
            // Reported Ready from an image this node no longer has a record of (the
            // record was lost or unreadable): say so rather than capture anew.
            return self
                .fail_snapshot(
                    snap,
                    "ImageLost",
                    "this node has no record of the snapshot's image (lost or unreadable); it is not captured again".into(),
                )
                .await;
        }
        let sandboxes: Api<SandboxObj> = Api::namespaced(self.client.clone(), &ns);
        let Some(source) = sandboxes.get_opt(&snap.spec.source.sandbox).await? else {
            return Ok(Action::requeue(Duration::from_secs(1)));
        };
        let Some(h) = source.uid().and_then(|u| self.handle(&u)) else {
            // Not running here yet.
            return Ok(Action::requeue(Duration::from_millis(500)));
        };
        self.write_snapshot_phase(snap, SnapshotPhase::Capturing)
            .await?;
        let ttl = snap
            .spec
            .ttl_seconds
            .and_then(|s| u64::try_from(s).ok())
            .map(Duration::from_secs);
        let source_uid = source.uid().unwrap_or_default();
        let (info, generation) = {
            let mut g = h.lock().await;
            let Some(sb) = g.as_mut() else {
                return Ok(Action::requeue(Duration::from_secs(1)));
            };
            // The fork point, read under the lock commits take: it is the generation of
            // exactly the state captured.
            let generation = self
                .registry
                .sandbox(&source_uid)?
                .map(|r| r.commits.generation)
                .unwrap_or(0);
            let r = self.engine.snapshot(sb, ttl).await;
            if r.is_ok() {
                self.engine.persist(sb)?;
            }
            (r, generation)
        };
        let info = match info {
            Ok(i) => i,
            Err(e) => {
                self.metrics.failed("snapshot", error_category(&e));
                return self
                    .fail_snapshot(snap, "CaptureFailed", e.to_string())
                    .await;
            }
        };
        self.metrics
            .capture_seconds
            .observe(info.checkpoint.as_secs_f64());
        self.metrics
            .source_pause_seconds
            .observe(info.source_pause.as_secs_f64());
        self.registry.put_snapshot(&SnapshotRecord {
            namespace: ns,
            name: snap.name_any(),
            uid: uid.clone(),
            image_id: info.meta.id.clone(),
            source_commit_generation: generation,
        })?;
        self.write_snapshot_ready(snap, &info.meta, Some(info.source_pause), generation)
            .await?;
        self.event(
            snap,
            false,
            "Captured",
            format!(
                "{} bytes in {} ms (source paused {} ms)",
                info.meta.size_bytes,
                info.checkpoint.as_millis(),
                info.source_pause.as_millis()
            ),
        )
        .await;
        Ok(Action::requeue(Duration::from_millis(200)))
    }

    async fn keep_pool(
        &self,
        snap: &SnapshotObj,
        uid: &str,
        rec: &SnapshotRecord,
    ) -> Result<Action> {
        let want = snap
            .spec
            .warm_pool
            .as_ref()
            .map(|w| usize::try_from(w.size).unwrap_or(0))
            .unwrap_or(0);
        let reservation = admission::pool_key(uid);
        let have = self.pools.size(uid);
        if have.is_some() && have != Some(want) {
            // Resized or emptied: the old pool goes, and what it held with it.
            if let Err(e) = self.pools.replace(uid, None).await {
                self.cleanup_failed(snap, "close resized warm pool", &e);
            }
            self.admission.capacity.leave(&reservation);
        }
        if want == 0 {
            self.admission.capacity.leave(&reservation);
        } else if self.pools.size(uid).is_none() {
            // The pool's frozen branches hold memory (no CPU) of this node: it fills
            // once that fits, and its refills queue for restore slots like any restore.
            let group = format!(
                "pool/{}/{}",
                snap.namespace().unwrap_or_default(),
                snap.name_any()
            );
            let asks = self.pool_asks(snap, want);
            if self
                .admission
                .capacity
                .enter(&reservation, &group, (0, String::new()), asks)
            {
                let pool = self.engine.warm_pool_gated(
                    &rec.image_id,
                    want,
                    self.admission.restores.clone(),
                    group,
                );
                if let Err(e) = self.pools.replace(uid, Some(pool)).await {
                    self.cleanup_failed(snap, "close resized warm pool", &e);
                }
            }
            self.publish_capacity();
        }
        let ready = self.pools.ready(uid);
        let reported = snap
            .status
            .as_ref()
            .and_then(|s| s.warm.as_ref())
            .map(|w| w.ready);
        let ready_i32 = i32::try_from(ready).unwrap_or(i32::MAX);
        if want > 0 && reported != Some(ready_i32) {
            let api: Api<SnapshotObj> =
                Api::namespaced(self.client.clone(), &snap.namespace().unwrap_or_default());
            let body = json!({"apiVersion": "ramify.dev/v1alpha1", "kind": "Snapshot", "status": {"warm": {"ready": ready_i32}}});
            writes::within(
                "status",
                api.patch_status(
                    &snap.name_any(),
                    &PatchParams::apply("ramify-node-agent/warm-pool").force(),
                    &Patch::Apply(&body),
                ),
            )
            .await?;
        }
        // Claims drain the pool between reconciles: look again soon (a local check; the
        // status is written only when the count changed), so `warm.ready` stays true.
        Ok(if want > 0 {
            Action::requeue(Duration::from_millis(250))
        } else {
            Action::await_change()
        })
    }

    async fn write_snapshot_phase(&self, snap: &SnapshotObj, phase: SnapshotPhase) -> Result<()> {
        let api: Api<SnapshotObj> =
            Api::namespaced(self.client.clone(), &snap.namespace().unwrap_or_default());
        let body = json!({"apiVersion": "ramify.dev/v1alpha1", "kind": "Snapshot", "status": {"phase": phase}});
        writes::within(
            "status",
            api.patch_status(
                &snap.name_any(),
                &PatchParams::apply(SNAPSHOT_MANAGER).force(),
                &Patch::Apply(&body),
            ),
        )
        .await?;
        Ok(())
    }

    async fn write_snapshot_ready(
        &self,
        snap: &SnapshotObj,
        meta: &crate::store::SnapshotMeta,
        pause: Option<Duration>,
        source_generation: u64,
    ) -> Result<()> {
        let api: Api<SnapshotObj> =
            Api::namespaced(self.client.clone(), &snap.namespace().unwrap_or_default());
        let mut conditions = snap.status.clone().unwrap_or_default().conditions;
        conditions.set_condition(
            Condition::new(
                "Ready",
                ConditionStatus::True,
                "Captured",
                format!("image {} verified", meta.id),
                snap.metadata.generation,
            ),
            now(),
        );
        let body = json!({"apiVersion": "ramify.dev/v1alpha1", "kind": "Snapshot", "status": {
            "phase": SnapshotPhase::Ready,
            "sizeBytes": meta.size_bytes,
            "sha256": meta.sha256,
            "runscVersion": short_version(&meta.runsc_version),
            // Images recorded before platforms were came from ptrace.
            "platform": meta.platform.as_deref().unwrap_or("ptrace"),
            "captureMillis": meta.capture_millis,
            "sourceCommitGeneration": source_generation,
            "sourcePauseMillis": pause.map(millis).unwrap_or(i64::try_from(meta.source_pause_millis).unwrap_or(0)),
            "capturedAt": Time(Timestamp::from_millisecond(i64::try_from(meta.created_unix_ms).unwrap_or(0)).unwrap_or_else(|_| Timestamp::now())),
            "conditions": conditions.iter().filter(|c| c.type_ == "Ready").collect::<Vec<_>>(),
        }});
        writes::within(
            "status",
            api.patch_status(
                &snap.name_any(),
                &PatchParams::apply(SNAPSHOT_MANAGER).force(),
                &Patch::Apply(&body),
            ),
        )
        .await?;
        Ok(())
    }

    async fn fail_snapshot(
        &self,
        snap: &SnapshotObj,
        reason: &str,
        message: String,
    ) -> Result<Action> {
        let api: Api<SnapshotObj> =
            Api::namespaced(self.client.clone(), &snap.namespace().unwrap_or_default());
        let mut conditions = snap.status.clone().unwrap_or_default().conditions;
        conditions.set_condition(
            Condition::new(
                "Ready",
                ConditionStatus::False,
                reason,
                message.clone(),
                snap.metadata.generation,
            ),
            now(),
        );
        let body = json!({"apiVersion": "ramify.dev/v1alpha1", "kind": "Snapshot", "status": {
            "phase": SnapshotPhase::Failed,
            "conditions": conditions.iter().filter(|c| c.type_ == "Ready").collect::<Vec<_>>(),
        }});
        writes::within(
            "status",
            api.patch_status(
                &snap.name_any(),
                &PatchParams::apply(SNAPSHOT_MANAGER).force(),
                &Patch::Apply(&body),
            ),
        )
        .await?;
        self.event(snap, true, reason, message).await;
        Ok(Action::await_change())
    }
}

/// Returns once the branch is marked deleted (never, if nobody can say so any more).
async fn until_deleted(deleted: &mut tokio::sync::watch::Receiver<bool>) {
    if deleted.wait_for(|d| *d).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// The object, or `None` when it does not deserialize: such an object is reported
/// and skipped, so one bad object cannot wedge a controller.
fn admit<'a, K>(obj: &'a DeserializeGuard<K>, agent: &Agent, controller: &str) -> Option<&'a K> {
    match &obj.0 {
        Ok(o) => Some(o),
        Err(e) => {
            warn!(controller, error = %e.error, name = ?e.metadata.name, "skipping object that does not deserialize");
            agent.metrics.failed(controller, "invalid_object");
            None
        }
    }
}

async fn on_sandbox(obj: Arc<DeserializeGuard<SandboxObj>>, agent: Arc<Agent>) -> Result<Action> {
    let t0 = Instant::now();
    let r = match admit(&obj, &agent, "sandbox") {
        Some(s) => {
            let r = agent.reconcile_sandbox(s).await;
            backoff::settle(&agent, "sandbox", s, r).await
        }
        None => Ok(Action::await_change()),
    };
    agent.metrics.reconciled("sandbox", t0.elapsed());
    r
}

async fn on_snapshot(obj: Arc<DeserializeGuard<SnapshotObj>>, agent: Arc<Agent>) -> Result<Action> {
    let t0 = Instant::now();
    let r = match admit(&obj, &agent, "snapshot") {
        Some(s) => {
            let r = agent.reconcile_snapshot(s).await;
            backoff::settle(&agent, "snapshot", s, r).await
        }
        None => Ok(Action::await_change()),
    };
    agent.metrics.reconciled("snapshot", t0.elapsed());
    r
}

async fn on_branchset(obj: Arc<DeserializeGuard<BranchSet>>, agent: Arc<Agent>) -> Result<Action> {
    let t0 = Instant::now();
    let r = match admit(&obj, &agent, "commit") {
        Some(b) => {
            let r = agent.reconcile_commit(b).await;
            backoff::settle(&agent, "commit", b, r).await
        }
        None => Ok(Action::await_change()),
    };
    agent.metrics.reconciled("commit", t0.elapsed());
    r
}

/// Resumes local state, then runs the agent's controllers until shutdown.
pub async fn run(agent: Arc<Agent>) -> Result<()> {
    agent.resume().await?;
    agent.publish_capacity();
    let client = agent.client.clone();
    let mine = watcher::Config::default()
        .fields(&format!("status.nodeName={}", agent.cfg.node))
        .any_semantic();
    // A sandbox that waited for capacity or a restore slot is reconciled again the
    // moment it is granted (by both controllers: each ignores what it does not hold).
    let bound_ctl = Controller::new(
        Api::<DeserializeGuard<SandboxObj>>::all(client.clone()),
        mine.clone(),
    )
    .reconcile_on(agent.admission.subscribe());
    // Sandboxes pinned to this node by their spec (every branch: its snapshot's node)
    // are seen at creation, a binding write earlier than through `status.nodeName`.
    let pinned_ctl = Controller::new(
        Api::<DeserializeGuard<SandboxObj>>::all(client.clone()),
        watcher::Config::default()
            .fields(&format!("spec.nodeName={}", agent.cfg.node))
            .any_semantic(),
    )
    .reconcile_on(agent.admission.subscribe());
    let snap_ctl = Controller::new(
        Api::<DeserializeGuard<SnapshotObj>>::all(client.clone()),
        mine,
    );
    let commit_ctl = Controller::new(
        Api::<DeserializeGuard<BranchSet>>::all(client.clone()),
        watcher::Config::default().any_semantic(),
    );
    let _ = agent.cache.set(AgentCache {
        snapshots: snap_ctl.store(),
        branchsets: commit_ctl.store(),
        bound: bound_ctl.store(),
        pinned: pinned_ctl.store(),
    });
    let sandboxes = bound_ctl
        .shutdown_on_signal()
        .run(on_sandbox, backoff::error_policy("sandbox"), agent.clone())
        .for_each(|_| futures::future::ready(()));
    let pinned = pinned_ctl
        .shutdown_on_signal()
        .run(on_sandbox, backoff::error_policy("sandbox"), agent.clone())
        .for_each(|_| futures::future::ready(()));
    let snapshots = snap_ctl
        .shutdown_on_signal()
        .run(
            on_snapshot,
            backoff::error_policy("snapshot"),
            agent.clone(),
        )
        .for_each(|_| futures::future::ready(()));
    let commits = commit_ctl
        .shutdown_on_signal()
        .run(on_branchset, backoff::error_policy("commit"), agent.clone())
        .for_each(|_| futures::future::ready(()));
    let sweep = tokio::spawn(agent.clone().sweep_admission());
    info!(node = %agent.cfg.node, "node agent controllers running");
    tokio::join!(sandboxes, pinned, snapshots, commits);
    sweep.abort();
    Ok(())
}
