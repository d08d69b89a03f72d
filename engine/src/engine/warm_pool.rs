//! Warm pools: restored branches of one snapshot kept frozen, thawed and handed out on
//! claim under a fresh identity, refilled in the background. A pool keeps its branches
//! in sandboxes of their own (standalone mode) or one in each of its Pods (cluster
//! mode: [`PodSupply`] says which Pods, and a claim names the Pod its branch adopted).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use tokio::sync::Notify;
use tracing::warn;

use super::{Engine, LocalSandbox};
use crate::control;
use crate::error::{Error, Result};

impl Engine {
    /// Start a warm pool of `size` frozen branches of `snapshot`.
    pub fn warm_pool(&self, snapshot: &str, size: usize) -> WarmPool {
        WarmPool::start(
            self.clone(),
            snapshot.to_string(),
            size,
            None,
            None,
            Refill::Always,
        )
    }

    /// Cluster mode: a warm pool keeping one frozen branch of `snapshot` in each Pod
    /// `supply` names, its refills queued in `gate` as `group`.
    pub fn warm_pool_in_pods(
        &self,
        snapshot: &str,
        supply: Arc<dyn PodSupply>,
        gate: Arc<dyn RestoreSlots>,
        group: String,
    ) -> WarmPool {
        let shared = PoolShared::new();
        let task = tokio::spawn(refill_in_pods(
            self.clone(),
            snapshot.to_string(),
            supply,
            shared.clone(),
            (gate, group),
        ));
        WarmPool {
            engine: self.clone(),
            snapshot: snapshot.to_string(),
            size: 0,
            shared,
            task: Mutex::new(Some(task)),
        }
    }

    /// [`Engine::warm_pool`] whose refills each wait for a place in `gate` (the
    /// node's restore concurrency), queued as `group`; on `rootfs` when the image was
    /// taken on another node (its recorded root filesystem is that node's).
    pub fn warm_pool_gated(
        &self,
        snapshot: &str,
        size: usize,
        gate: Arc<dyn RestoreSlots>,
        group: String,
        rootfs: Option<crate::rootfs::RootfsSource>,
    ) -> WarmPool {
        WarmPool::start(
            self.clone(),
            snapshot.to_string(),
            size,
            Some((gate, group)),
            rootfs,
            Refill::Always,
        )
    }

    /// `size` frozen branches of `snapshot` restored once, all at once, never refilled:
    /// the branches of a fork the node knows is coming, restored before their objects
    /// exist (a self-fork's). Each restore waits for a place in `gate` as `group`. Once
    /// they are all restored and handed out, a claim on it fails at once.
    pub fn warm_pool_once(
        &self,
        snapshot: &str,
        size: usize,
        gate: Arc<dyn RestoreSlots>,
        group: String,
    ) -> WarmPool {
        WarmPool::start(
            self.clone(),
            snapshot.to_string(),
            size,
            Some((gate, group)),
            None,
            Refill::Never,
        )
    }
}

/// Whether a warm pool restores again what its claims took.
#[derive(Clone, Copy)]
enum Refill {
    Always,
    /// Up to its size once: then it only hands out what it holds.
    Never,
}

/// The restore gate a warm pool's refills queue in, and their group there.
type RefillGate = (Arc<dyn RestoreSlots>, String);

/// Where a warm pool's refills wait their turn to restore: the node's restore
/// concurrency, shared with everything else that restores there (the node agent's is
/// its fair admission gate). A refill is a CPU-bound restore; queued here, it never
/// starts beside more restores than the node allows.
pub trait RestoreSlots: Send + Sync {
    /// Waits for a slot for `key`, queued as one of `group`; the slot is held until the
    /// returned value drops.
    fn acquire<'a>(&'a self, key: &'a str, group: &'a str) -> BoxFuture<'a, Box<dyn Send>>;
    /// Gives up `key`'s place in the queue (its wait was abandoned).
    fn leave(&self, key: &str);
}

/// How long claims must pause before a warm pool refills.
const REFILL_SETTLE: Duration = Duration::from_millis(300);
/// How often a pool in Pods looks at its Pods (a local read of the Pod watch's store).
const POD_POLL: Duration = Duration::from_millis(500);
/// Restores into one Pod that may fail in a row before the Pod is given up.
const POD_TRIES: u32 = 3;

/// A Pod a warm pool may keep a branch in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolPod {
    pub uid: String,
    pub name: String,
}

/// Cluster mode: the Pods of a warm pool, as they are now.
pub trait PodSupply: Send + Sync + 'static {
    /// The pool's Pods on this node ready to hold a branch.
    fn in_pool(&self) -> Vec<PoolPod>;
    /// Whether the Pod with `uid` still lives (an adopted Pod leaves the pool, and its
    /// branch waits in it for its claim; a deleted one takes its branch along).
    fn lives(&self, uid: &str) -> bool;
}

/// K restored branches of one snapshot, kept frozen (cgroup freezer) and handed out
/// on claim with a thaw; refilled in the background.
pub struct WarmPool {
    engine: Engine,
    snapshot: String,
    size: usize,
    shared: Arc<PoolShared>,
    /// Refill task; None once closed. Behind a lock so that `close` takes `&self`: a
    /// pool shared with claimers in flight can be closed without waiting for them.
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

struct PoolShared {
    state: Mutex<PoolState>,
    /// Wakes the refill task.
    refill: Notify,
    /// Wakes claimers waiting for a ready branch.
    ready: Notify,
    /// Wakes every restore of a pool filled once that waits for a slot: the pool closed.
    closing: Notify,
}

impl PoolShared {
    /// Records a restore that failed (claimers read it).
    fn failed(&self, e: &Error) {
        if let Ok(mut s) = self.state.lock() {
            s.last_error = Some(e.to_string());
            s.failures += 1;
        }
    }

    fn new() -> Arc<Self> {
        Arc::new(PoolShared {
            state: Mutex::new(PoolState::default()),
            refill: Notify::new(),
            ready: Notify::new(),
            closing: Notify::new(),
        })
    }
}

#[derive(Default)]
struct PoolState {
    ready: VecDeque<LocalSandbox>,
    closed: bool,
    last_error: Option<String>,
    /// Refill failures in a row; reset by a success. Claimers give up at 3.
    failures: u32,
    restored: u64,
    /// Cluster mode: the names of the Pods of `ready`'s branches, by Pod UID.
    pod_names: HashMap<String, String>,
    /// Cluster mode: the Pod a branch is being restored into now.
    restoring: Option<String>,
    /// Cluster mode: failed restores in a row, by Pod UID.
    pod_failures: HashMap<String, u32>,
    /// When the last claim was served (refills wait for claims to pause).
    last_claim: Option<Instant>,
    /// A pool that never refills has restored all it will: claims on an empty one
    /// fail at once instead of waiting.
    exhausted: bool,
}

/// The Pod UID a branch lives in (cluster mode).
fn pod_of(sb: &LocalSandbox) -> Option<&str> {
    sb.placed.pod.as_ref().map(|p| p.uid.as_str())
}

/// Restores branch `index` of `snapshot` (into the Pod `pod_uid`, in cluster mode; on
/// `rootfs` instead of the image's recorded one, when given) and pauses it.
async fn restore_frozen(
    engine: &Engine,
    snapshot: &str,
    index: u32,
    pod_uid: Option<&str>,
    rootfs: Option<&crate::rootfs::RootfsSource>,
) -> Result<LocalSandbox> {
    let (meta, img) = engine.verified_image(snapshot).await?;
    let rootfs = match rootfs {
        Some(r) => Some(r.resolve(engine.rootfs_policy()).await?),
        None => None,
    };
    let sb = engine
        .restore_branch(
            &meta,
            &img,
            &format!("warm-{index}"),
            index,
            &[],
            super::fork::RestoreOn { pod_uid, rootfs },
        )
        .await?;
    if let Err(e) = crate::freezer::pause(
        engine.runsc(),
        &sb.ctx,
        &sb.dir,
        &sb.placed.cgroups_path,
        crate::freezer::Depth::Pause,
    )
    .await
    {
        engine
            .destroy_or_report(sb, "freezing it for the warm pool failed")
            .await;
        return Err(e);
    }
    Ok(sb)
}

/// Cluster mode's refill: one frozen branch in each of the pool's Pods; a branch whose
/// Pod is gone is destroyed.
async fn refill_in_pods(
    engine: Engine,
    snapshot: String,
    supply: Arc<dyn PodSupply>,
    shared: Arc<PoolShared>,
    (gate, group): RefillGate,
) {
    let mut index: u32 = 0;
    loop {
        let in_pool = supply.in_pool();
        let (stale, target, settle) = {
            let Ok(mut s) = shared.state.lock() else {
                return;
            };
            if s.closed {
                return;
            }
            let (keep, stale): (Vec<_>, Vec<_>) = s
                .ready
                .drain(..)
                .partition(|sb| pod_of(sb).is_some_and(|u| supply.lives(u)));
            s.ready = keep.into();
            for sb in &stale {
                if let Some(u) = pod_of(sb) {
                    s.pod_names.remove(u);
                }
            }
            s.pod_failures
                .retain(|u, _| in_pool.iter().any(|p| &p.uid == u));
            let target = in_pool
                .iter()
                .find(|p| {
                    !s.ready.iter().any(|sb| pod_of(sb) == Some(p.uid.as_str()))
                        && s.pod_failures.get(&p.uid).copied().unwrap_or(0) < POD_TRIES
                })
                .cloned();
            if target.is_some() {
                s.restoring = target.as_ref().map(|p| p.uid.clone());
            }
            let settle = s
                .last_claim
                .map(|t| REFILL_SETTLE.saturating_sub(t.elapsed()))
                .filter(|d| !d.is_zero());
            (stale, target, settle)
        };
        for sb in stale {
            engine
                .destroy_or_report(sb, "its warm pool Pod is gone")
                .await;
        }
        let Some(target) = target else {
            let _ = tokio::time::timeout(POD_POLL, shared.refill.notified()).await;
            continue;
        };
        // Claims come in bursts: a refill (a CPU-bound restore) waits for them to pause.
        if let Some(d) = settle {
            tokio::time::sleep(d).await;
        }
        let key = format!("{group}#{index}");
        let _slot = gate.acquire(&key, &group).await;
        let made = if supply.lives(&target.uid) {
            restore_frozen(&engine, &snapshot, index, Some(&target.uid), None).await
        } else {
            Err(Error::Snapshot {
                id: snapshot.clone(),
                reason: format!("warm pool Pod {} went before its restore", target.name),
            })
        };
        drop(_slot);
        index += 1;
        let mut leftover = None;
        match made {
            Ok(sb) => {
                if let Ok(mut s) = shared.state.lock() {
                    s.restoring = None;
                    if s.closed {
                        leftover = Some(sb);
                    } else {
                        s.pod_failures.remove(&target.uid);
                        s.pod_names.insert(target.uid.clone(), target.name.clone());
                        s.ready.push_back(sb);
                        s.restored += 1;
                        s.failures = 0;
                    }
                }
                shared.ready.notify_waiters();
            }
            Err(e) => {
                warn!(error = %e, snapshot = %snapshot, pod = %target.name, "warm pool refill in a Pod failed");
                if let Ok(mut s) = shared.state.lock() {
                    s.restoring = None;
                    s.last_error = Some(e.to_string());
                    s.failures += 1;
                    *s.pod_failures.entry(target.uid.clone()).or_default() += 1;
                }
                shared.ready.notify_waiters();
                tokio::time::sleep(POD_POLL).await;
            }
        }
        if let Some(sb) = leftover {
            engine
                .destroy_or_report(sb, "its warm pool was closed while it was restored")
                .await;
            return;
        }
    }
}

impl WarmPool {
    fn start(
        engine: Engine,
        snapshot: String,
        size: usize,
        gate: Option<RefillGate>,
        rootfs: Option<crate::rootfs::RootfsSource>,
        refill: Refill,
    ) -> Self {
        let shared = PoolShared::new();
        let task = match refill {
            Refill::Always => tokio::spawn(Self::refill_loop(
                engine.clone(),
                snapshot.clone(),
                size,
                shared.clone(),
                (gate, rootfs),
            )),
            Refill::Never => tokio::spawn(Self::fill_once(
                engine.clone(),
                snapshot.clone(),
                size,
                shared.clone(),
                gate,
            )),
        };
        WarmPool {
            engine,
            snapshot,
            size,
            shared,
            task: Mutex::new(Some(task)),
        }
    }

    /// Restores `size` branches at once, each as soon as the gate gives it a slot (a
    /// fork of N is restored as N branches objects would be, not one after the other),
    /// then marks the pool exhausted: it never restores again.
    async fn fill_once(
        engine: Engine,
        snapshot: String,
        size: usize,
        shared: Arc<PoolShared>,
        gate: Option<RefillGate>,
    ) {
        let one = |index: u32| {
            let (engine, snapshot, shared, gate) = (
                engine.clone(),
                snapshot.clone(),
                shared.clone(),
                gate.clone(),
            );
            async move {
                let closing = shared.closing.notified();
                if shared.state.lock().map_or(true, |s| s.closed) {
                    return;
                }
                let _slot = match &gate {
                    Some((g, group)) => {
                        let key = format!("{group}#{index}");
                        tokio::select! {
                            p = g.acquire(&key, group) => Some(p),
                            () = closing => {
                                g.leave(&key);
                                return;
                            }
                        }
                    }
                    None => None,
                };
                let made = restore_frozen(&engine, &snapshot, index, None, None).await;
                drop(_slot);
                match made {
                    Ok(sb) => {
                        let leftover = match shared.state.lock() {
                            Ok(mut s) if !s.closed => {
                                s.ready.push_back(sb);
                                s.restored += 1;
                                None
                            }
                            _ => Some(sb),
                        };
                        if let Some(sb) = leftover {
                            engine
                                .destroy_or_report(
                                    sb,
                                    "its warm pool was closed while it was restored",
                                )
                                .await;
                        }
                    }
                    Err(e) => {
                        warn!(error = %e, snapshot = %snapshot, "a restore ahead failed");
                        shared.failed(&e);
                    }
                }
                shared.ready.notify_waiters();
            }
        };
        let count = u32::try_from(size).unwrap_or(u32::MAX);
        futures::future::join_all((0..count).map(one)).await;
        if let Ok(mut s) = shared.state.lock() {
            s.exhausted = true;
        }
        shared.ready.notify_waiters();
    }

    async fn refill_loop(
        engine: Engine,
        snapshot: String,
        size: usize,
        shared: Arc<PoolShared>,
        (gate, rootfs): (Option<RefillGate>, Option<crate::rootfs::RootfsSource>),
    ) {
        let mut index: u32 = 0;
        loop {
            let (have, closed) = match shared.state.lock() {
                Ok(s) => (s.ready.len(), s.closed),
                Err(_) => return,
            };
            if closed {
                return;
            }
            if have >= size {
                shared.refill.notified().await;
                // Claims come in bursts (a BranchSet forks N at once). A refill is a
                // CPU-bound restore: starting it after the first claim would slow the
                // rest of the burst (and the API writes that report it), so wait until
                // claims pause.
                while tokio::time::timeout(REFILL_SETTLE, shared.refill.notified())
                    .await
                    .is_ok()
                {}
                continue;
            }
            // Wait for a restore slot; a close (or claim) meanwhile gives it up and
            // looks again.
            let _slot = match &gate {
                Some((g, group)) => {
                    let key = format!("{group}#{index}");
                    let acquired = tokio::select! {
                        p = g.acquire(&key, group) => Some(p),
                        () = shared.refill.notified() => None,
                    };
                    match acquired {
                        Some(p) => Some(p),
                        None => {
                            g.leave(&key);
                            continue;
                        }
                    }
                }
                None => None,
            };
            let made = restore_frozen(&engine, &snapshot, index, None, rootfs.as_ref()).await;
            index += 1;
            match made {
                Ok(sb) => {
                    let mut leftover = None;
                    if let Ok(mut s) = shared.state.lock() {
                        if s.closed {
                            leftover = Some(sb);
                        } else {
                            s.ready.push_back(sb);
                            s.restored += 1;
                            s.failures = 0;
                        }
                    }
                    if let Some(sb) = leftover {
                        engine
                            .destroy_or_report(sb, "its warm pool was closed while it was restored")
                            .await;
                        return;
                    }
                    shared.ready.notify_waiters();
                }
                Err(e) => {
                    warn!(error = %e, snapshot = %snapshot, "warm pool refill failed");
                    shared.failed(&e);
                    shared.ready.notify_waiters();
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        }
    }

    pub fn snapshot(&self) -> &str {
        &self.snapshot
    }

    /// How many frozen branches the pool keeps.
    pub fn size(&self) -> usize {
        self.size
    }

    /// A pool that never refills ([`Engine::warm_pool_once`]) with nothing left to
    /// hand out: every branch was restored (or failed to) and claimed.
    pub fn exhausted(&self) -> bool {
        self.shared
            .state
            .lock()
            .is_ok_and(|s| s.exhausted && s.ready.is_empty())
    }

    /// Number of frozen branches ready to hand out.
    pub fn ready(&self) -> usize {
        self.shared.state.lock().map(|s| s.ready.len()).unwrap_or(0)
    }

    /// Cluster mode: the names of the Pods holding a ready branch, sorted.
    pub fn ready_pods(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .shared
            .state
            .lock()
            .map(|s| {
                s.ready
                    .iter()
                    .filter_map(|sb| s.pod_names.get(pod_of(sb)?).cloned())
                    .collect()
            })
            .unwrap_or_default();
        names.sort();
        names
    }

    /// Cluster mode: whether a branch lives, or is being restored, in the Pod `pod_uid`.
    pub fn holds_in(&self, pod_uid: &str) -> bool {
        self.shared.state.lock().is_ok_and(|s| {
            s.restoring.as_deref() == Some(pod_uid)
                || s.ready.iter().any(|sb| pod_of(sb) == Some(pod_uid))
        })
    }

    /// Wait until at least `n` branches are ready (or the pool fails repeatedly).
    pub async fn wait_ready(&self, n: usize, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let notified = self.shared.ready.notified();
            {
                let s = self
                    .shared
                    .state
                    .lock()
                    .map_err(|_| Error::Join("pool lock poisoned".into()))?;
                if s.ready.len() >= n {
                    return Ok(());
                }
                if let Some(e) = s.last_error.as_ref().filter(|_| s.failures >= 3) {
                    return Err(Error::Snapshot {
                        id: self.snapshot.clone(),
                        reason: format!("warm pool cannot restore: {e}"),
                    });
                }
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    command: format!("warm pool {} to reach {n}", self.snapshot),
                    seconds: timeout.as_secs(),
                });
            }
            let _ = tokio::time::timeout(Duration::from_millis(200), notified).await;
        }
    }

    /// Hand out a ready branch: fresh identity written, then thawed. Waits for a
    /// branch when the pool is empty.
    pub async fn claim(&self, name: &str, timeout: Duration) -> Result<LocalSandbox> {
        self.claim_where(|sb| pod_of(sb).is_none(), "", name, None, timeout)
            .await
    }

    /// Like [`WarmPool::claim`], with the branch's position among its siblings (written
    /// into its identity).
    pub async fn claim_as(
        &self,
        name: &str,
        index: u32,
        timeout: Duration,
    ) -> Result<LocalSandbox> {
        self.claim_where(|sb| pod_of(sb).is_none(), "", name, Some(index), timeout)
            .await
    }

    /// Cluster mode: hand out the branch living in the Pod `pod_uid` (a branch adopted
    /// that Pod), waiting while it is being restored there. Fails at once when the pool
    /// holds none there.
    pub async fn claim_in(
        &self,
        pod_uid: &str,
        name: &str,
        index: u32,
        timeout: Duration,
    ) -> Result<LocalSandbox> {
        self.claim_where(
            |sb| pod_of(sb) == Some(pod_uid),
            pod_uid,
            name,
            Some(index),
            timeout,
        )
        .await
    }

    /// Takes the first ready branch `pick` accepts (waiting for one up to `timeout`)
    /// and hands it out. `pod_uid`: the Pod the claim waits on (cluster mode; it fails
    /// at once when nothing lives or is being restored there), or empty.
    async fn claim_where(
        &self,
        pick: impl Fn(&LocalSandbox) -> bool,
        pod_uid: &str,
        name: &str,
        index: Option<u32>,
        timeout: Duration,
    ) -> Result<LocalSandbox> {
        let deadline = Instant::now() + timeout;
        loop {
            let notified = self.shared.ready.notified();
            let got = {
                let mut s = self
                    .shared
                    .state
                    .lock()
                    .map_err(|_| Error::Join("pool lock poisoned".into()))?;
                if s.closed {
                    // Closed while this claim waited: nothing will come.
                    return Err(Error::Snapshot {
                        id: self.snapshot.clone(),
                        reason: "warm pool closed".into(),
                    });
                }
                let at = s.ready.iter().position(&pick);
                let got = at.and_then(|i| s.ready.remove(i));
                if got.is_none() && s.exhausted {
                    return Err(Error::Snapshot {
                        id: self.snapshot.clone(),
                        reason: match &s.last_error {
                            Some(e) => format!(
                                "every branch restored ahead was handed out or failed to restore ({e})"
                            ),
                            None => "every branch restored ahead was handed out".into(),
                        },
                    });
                }
                if got.is_none() && !pod_uid.is_empty() && s.restoring.as_deref() != Some(pod_uid) {
                    return Err(Error::Snapshot {
                        id: self.snapshot.clone(),
                        reason: format!("the warm pool holds no branch in Pod {pod_uid}"),
                    });
                }
                if let Some(u) = got.as_ref().and_then(pod_of) {
                    s.pod_names.remove(u);
                }
                if got.is_some() {
                    s.last_claim = Some(Instant::now());
                }
                got
            };
            if let Some(sb) = got {
                self.shared.refill.notify_one();
                return self.hand_out(sb, name, index).await;
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    command: format!("claim from warm pool {}", self.snapshot),
                    seconds: timeout.as_secs(),
                });
            }
            let _ = tokio::time::timeout(Duration::from_millis(200), notified).await;
        }
    }

    /// A claimed branch as `name` (at `index`): its fresh identity written, then
    /// thawed; destroyed when either fails.
    async fn hand_out(
        &self,
        mut sb: LocalSandbox,
        name: &str,
        index: Option<u32>,
    ) -> Result<LocalSandbox> {
        sb.name = name.to_string();
        sb.identity = self.engine.next_identity(
            name,
            index.unwrap_or(sb.identity.index),
            Some(&self.snapshot),
            sb.identity.hostname.clone(),
        );
        let r = match control::write_identity(&sb.control_dir(), &sb.identity)
            .map_err(|e| Error::io("write identity", sb.control_dir(), e))
        {
            Ok(()) => {
                crate::freezer::resume(
                    self.engine.runsc(),
                    &sb.ctx,
                    &sb.dir,
                    &sb.placed.cgroups_path,
                )
                .await
            }
            Err(e) => Err(e),
        };
        if let Err(e) = r {
            self.engine
                .destroy_or_report(sb, "handing it out of the warm pool failed")
                .await;
            return Err(e);
        }
        Ok(sb)
    }

    /// Stop refilling and destroy every frozen branch.
    pub async fn close(&self) -> Result<()> {
        let drained: Vec<LocalSandbox> = match self.shared.state.lock() {
            Ok(mut s) => {
                s.closed = true;
                s.ready.drain(..).collect()
            }
            Err(_) => Vec::new(),
        };
        self.shared.refill.notify_one();
        self.shared.closing.notify_waiters();
        // Let an in-flight restore finish so it is destroyed, not leaked.
        let task = self.task.lock().ok().and_then(|mut t| t.take());
        if let Some(task) = task
            && let Err(e) = task.await
        {
            warn!(error = %e, snapshot = %self.snapshot, "warm pool refill task failed");
        }
        let mut first = None;
        for sb in drained {
            if let Err(e) = self.engine.destroy(sb).await {
                first.get_or_insert(e);
            }
        }
        let more: Vec<LocalSandbox> = match self.shared.state.lock() {
            Ok(mut s) => s.ready.drain(..).collect(),
            Err(_) => Vec::new(),
        };
        for sb in more {
            if let Err(e) = self.engine.destroy(sb).await {
                first.get_or_insert(e);
            }
        }
        match first {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl Drop for WarmPool {
    /// A pool dropped without `close` still releases its branches: the refill task
    /// sees `closed` and destroys an in-flight branch itself; ready ones are destroyed
    /// on the runtime if there is one (otherwise the orphan sweep gets them).
    fn drop(&mut self) {
        let task = self.task.get_mut().ok().and_then(Option::take);
        if task.is_none() {
            return;
        }
        let drained: Vec<LocalSandbox> = match self.shared.state.lock() {
            Ok(mut s) => {
                s.closed = true;
                s.ready.drain(..).collect()
            }
            Err(_) => Vec::new(),
        };
        self.shared.refill.notify_one();
        self.shared.closing.notify_waiters();
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let engine = self.engine.clone();
            rt.spawn(async move {
                for sb in drained {
                    if let Err(e) = engine.destroy(sb).await {
                        warn!(error = %e, "destroying a dropped pool's branch");
                    }
                }
            });
        } else if !drained.is_empty() {
            warn!(
                count = drained.len(),
                "warm pool dropped outside a runtime; branches left to the orphan sweep"
            );
        }
    }
}
