//! Warm pools: restored branches of one snapshot kept frozen, thawed and handed out on
//! claim under a fresh identity, refilled in the background.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tracing::warn;

use super::{Engine, LocalSandbox};
use crate::control;
use crate::error::{Error, Result};

impl Engine {
    /// Start a warm pool of `size` frozen branches of `snapshot`.
    pub fn warm_pool(&self, snapshot: &str, size: usize) -> WarmPool {
        WarmPool::start(self.clone(), snapshot.to_string(), size, None)
    }

    /// [`Engine::warm_pool`] whose refills each wait for a place in `gate` (the
    /// node's restore concurrency), queued as `group`.
    pub fn warm_pool_gated(
        &self,
        snapshot: &str,
        size: usize,
        gate: Arc<crate::capacity::FairGate>,
        group: String,
    ) -> WarmPool {
        WarmPool::start(
            self.clone(),
            snapshot.to_string(),
            size,
            Some((gate, group)),
        )
    }
}

/// The restore gate a warm pool's refills queue in, and their group there.
type RefillGate = (Arc<crate::capacity::FairGate>, String);

/// How long claims must pause before a warm pool refills.
const REFILL_SETTLE: Duration = Duration::from_millis(300);

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
}

#[derive(Default)]
struct PoolState {
    ready: VecDeque<LocalSandbox>,
    closed: bool,
    last_error: Option<String>,
    /// Refill failures in a row; reset by a success. Claimers give up at 3.
    failures: u32,
    restored: u64,
}

impl WarmPool {
    fn start(engine: Engine, snapshot: String, size: usize, gate: Option<RefillGate>) -> Self {
        let shared = Arc::new(PoolShared {
            state: Mutex::new(PoolState::default()),
            refill: Notify::new(),
            ready: Notify::new(),
        });
        let task = tokio::spawn(Self::refill_loop(
            engine.clone(),
            snapshot.clone(),
            size,
            shared.clone(),
            gate,
        ));
        WarmPool {
            engine,
            snapshot,
            size,
            shared,
            task: Mutex::new(Some(task)),
        }
    }

    async fn refill_loop(
        engine: Engine,
        snapshot: String,
        size: usize,
        shared: Arc<PoolShared>,
        gate: Option<RefillGate>,
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
                        p = g.acquire(&key, group, (0, String::new()), crate::capacity::ONE_RESTORE) => Some(p),
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
            let made = async {
                let (meta, img) = engine.verified_image(&snapshot).await?;
                let sb = engine
                    .restore_branch(
                        &meta,
                        &img,
                        &format!("warm-{index}"),
                        index,
                        &[],
                        super::fork::RestoreOn::default(),
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
                Ok::<_, Error>(sb)
            }
            .await;
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
                    if let Ok(mut s) = shared.state.lock() {
                        s.last_error = Some(e.to_string());
                        s.failures += 1;
                    }
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

    /// Number of frozen branches ready to hand out.
    pub fn ready(&self) -> usize {
        self.shared.state.lock().map(|s| s.ready.len()).unwrap_or(0)
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
        self.claim_inner(name, None, timeout).await
    }

    /// Like [`WarmPool::claim`], with the branch's position among its siblings (written
    /// into its identity).
    pub async fn claim_as(
        &self,
        name: &str,
        index: u32,
        timeout: Duration,
    ) -> Result<LocalSandbox> {
        self.claim_inner(name, Some(index), timeout).await
    }

    async fn claim_inner(
        &self,
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
                s.ready.pop_front()
            };
            if let Some(mut sb) = got {
                self.shared.refill.notify_one();
                sb.name = name.to_string();
                sb.identity = self.engine.next_identity(
                    name,
                    index.unwrap_or(sb.identity.index),
                    Some(&self.snapshot),
                    sb.identity.hostname.clone(),
                );
                let r = control::write_identity(&sb.control_dir(), &sb.identity)
                    .map_err(|e| Error::io("write identity", sb.control_dir(), e));
                let r = match r {
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
                return Ok(sb);
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
