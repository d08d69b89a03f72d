//! What the scale run creates (Sandboxes and BranchSets, from a few tasks at once) and
//! how it follows them (watch events, time to Running and to Committed).

use super::*;

/// What the run creates: a Sandbox, or a BranchSet forking one of them.
#[derive(Clone, Copy, Debug)]
pub(super) enum Job {
    Sandbox(usize),
    BranchSet { index: usize, source: usize },
}

pub(super) fn sandbox_name(i: usize) -> String {
    format!("sbx-{i:04}")
}

pub(super) fn branchset_name(j: usize) -> String {
    format!("bs-{j:03}")
}

/// The branch of set `j` that commits: deterministic, and different across sets.
pub(super) fn commit_index(j: usize, replicas: usize) -> usize {
    j % replicas
}

/// The objects in creation order: every BranchSet right after its source Sandbox (the
/// sources spread evenly over the Sandboxes), so sets and sandboxes go together.
pub(super) fn jobs(cfg: &ScaleConfig) -> Vec<Job> {
    let stride = (cfg.sandboxes / cfg.branchsets.max(1)).max(1);
    let mut out = Vec::with_capacity(cfg.sandboxes + cfg.branchsets);
    for i in 0..cfg.sandboxes {
        out.push(Job::Sandbox(i));
        if i % stride == 0 && i / stride < cfg.branchsets {
            out.push(Job::BranchSet {
                index: i / stride,
                source: i,
            });
        }
    }
    out
}

pub(super) fn sandbox_object(i: usize) -> Result<Sandbox, ScaleError> {
    serde_json::from_value(serde_json::json!({
        "apiVersion": ramify_crds::API_VERSION, "kind": "Sandbox",
        "metadata": {"name": sandbox_name(i)},
        "spec": {
            // Never started: the simulated nodes run nothing.
            "rootfs": {"class": "simulated"},
            "command": ["/bin/sh", "-c", "while true; do sleep 1; done"],
        },
    }))
    .map_err(|e| ScaleError::Check(format!("building Sandbox {i}: {e}")))
}

pub(super) fn branchset_object(
    j: usize,
    source: usize,
    replicas: usize,
) -> Result<BranchSet, ScaleError> {
    let k = commit_index(j, replicas);
    serde_json::from_value(serde_json::json!({
        "apiVersion": ramify_crds::API_VERSION, "kind": "BranchSet",
        "metadata": {
            "name": branchset_name(j),
            "annotations": {ANNOTATION_SIMULATED_COMMIT_INDEX: k.to_string()},
        },
        "spec": {
            "source": {"sandbox": sandbox_name(source)},
            "replicas": replicas,
            // What a real node would run to the same verdict as the stand-in's.
            "template": {"run": ["/bin/sh", "-c", format!("test $RAMIFY_BRANCH_INDEX -eq {k}")]},
            "commit": {"mode": "Full"},
            "timeoutSeconds": 3600,
        },
    }))
    .map_err(|e| ScaleError::Check(format!("building BranchSet {j}: {e}")))
}

/// Creates every object from `cfg.creators` tasks at once; returns when each one's
/// create call was issued.
pub(super) async fn create_all(
    driver: &Client,
    ns: &str,
    cfg: &ScaleConfig,
) -> Result<HashMap<String, Instant>, ScaleError> {
    let jobs = Arc::new(jobs(cfg));
    let next = Arc::new(AtomicUsize::new(0));
    let created = Arc::new(Mutex::new(HashMap::with_capacity(jobs.len())));
    let tasks: Vec<_> = (0..cfg.creators)
        .map(|_| {
            let (jobs, next, created) = (jobs.clone(), next.clone(), created.clone());
            let sandboxes: Api<Sandbox> = Api::namespaced(driver.clone(), ns);
            let branchsets: Api<BranchSet> = Api::namespaced(driver.clone(), ns);
            let replicas = cfg.replicas;
            tokio::spawn(async move {
                loop {
                    let Some(job) = jobs.get(next.fetch_add(1, Ordering::Relaxed)).copied() else {
                        return Ok::<(), ScaleError>(());
                    };
                    let t = Instant::now();
                    let (name, r) = match job {
                        Job::Sandbox(i) => {
                            let o = sandbox_object(i)?;
                            (
                                sandbox_name(i),
                                sandboxes
                                    .create(&PostParams::default(), &o)
                                    .await
                                    .map(|_| ()),
                            )
                        }
                        Job::BranchSet { index, source } => {
                            let o = branchset_object(index, source, replicas)?;
                            (
                                branchset_name(index),
                                branchsets
                                    .create(&PostParams::default(), &o)
                                    .await
                                    .map(|_| ()),
                            )
                        }
                    };
                    r.map_err(api_call(format!("creating {name}")))?;
                    if let Ok(mut c) = created.lock() {
                        c.insert(name, t);
                    }
                }
            })
        })
        .collect();
    for t in futures::future::join_all(tasks).await {
        t.map_err(|e| ScaleError::Check(format!("a creating task died: {e}")))??;
    }
    let created = created
        .lock()
        .map(|c| c.clone())
        .map_err(|_| ScaleError::Check("the creation times were poisoned".into()))?;
    Ok(created)
}

/// What the driver's watches have seen, and when.
#[derive(Default, Clone)]
pub(super) struct Seen {
    /// The run's own Sandboxes (not branches), first seen Running.
    pub(super) running: HashMap<String, Instant>,
    /// BranchSets, first seen with a winner / Committed.
    pub(super) winner: HashMap<String, Instant>,
    pub(super) committed: HashMap<String, Instant>,
    /// Branch sandboxes that exist now, and every one ever seen.
    pub(super) branches_live: HashSet<String>,
    pub(super) branches_seen: HashSet<String>,
}

/// Two watches (Sandboxes and BranchSets of the run's namespace) recording [`Seen`]:
/// the run waits on them, never polls the API server.
pub(super) struct Tracker {
    pub(super) seen: Arc<Mutex<Seen>>,
    pub(super) changed: tokio::sync::watch::Receiver<u64>,
    pub(super) tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Tracker {
    pub(super) async fn start(driver: &Client, ns: &str) -> Result<Tracker, ScaleError> {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let (tx, changed) = tokio::sync::watch::channel(0u64);
        let tx = Arc::new(tx);
        let (synced_tx, mut synced) = tokio::sync::mpsc::channel::<()>(2);
        let sandboxes = follow(
            Api::<Sandbox>::namespaced(driver.clone(), ns),
            (seen.clone(), tx.clone(), synced_tx.clone()),
            record_sandbox,
        );
        let branchsets = follow(
            Api::<BranchSet>::namespaced(driver.clone(), ns),
            (seen.clone(), tx, synced_tx),
            record_branchset,
        );
        let tracker = Tracker {
            seen,
            changed,
            tasks: vec![sandboxes, branchsets],
        };
        // Both watches listed once: nothing created from here on goes unseen.
        for _ in 0..2 {
            tokio::time::timeout(Duration::from_secs(30), synced.recv())
                .await
                .map_err(|_| {
                    ScaleError::Timeout(Duration::from_secs(30), "the driver's watches".into())
                })?;
        }
        Ok(tracker)
    }

    pub(super) fn seen(&self) -> Result<Seen, ScaleError> {
        self.seen
            .lock()
            .map(|s| s.clone())
            .map_err(|_| ScaleError::Check("the watches' record was poisoned".into()))
    }

    /// Waits until `done` holds of what the watches saw, or `deadline`.
    pub(super) async fn until(
        &mut self,
        deadline: Instant,
        what: &str,
        done: impl Fn(&Seen) -> bool,
    ) -> Result<(), ScaleError> {
        let started = Instant::now();
        loop {
            self.changed.borrow_and_update();
            {
                let seen = self
                    .seen
                    .lock()
                    .map_err(|_| ScaleError::Check("the watches' record was poisoned".into()))?;
                if done(&seen) {
                    return Ok(());
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if tokio::time::timeout(left, self.changed.changed())
                .await
                .is_err()
            {
                let seen = self.seen()?;
                return Err(ScaleError::Timeout(
                    started.elapsed(),
                    format!(
                        "{what} (seen: {} Sandboxes Running, {} winners, {} Committed, {} branches now, {} ever)",
                        seen.running.len(),
                        seen.winner.len(),
                        seen.committed.len(),
                        seen.branches_live.len(),
                        seen.branches_seen.len()
                    ),
                ));
            }
        }
    }

    pub(super) fn stop(&self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Where a watch records what it sees: the record, its change count, and the signal
/// that its first listing is in.
type Record = (
    Arc<Mutex<Seen>>,
    Arc<tokio::sync::watch::Sender<u64>>,
    tokio::sync::mpsc::Sender<()>,
);

/// Watches every `K` of `api`, recording each event with `record`.
pub(super) fn follow<K>(
    api: Api<K>,
    (seen, changed, synced): Record,
    record: fn(&mut Seen, watcher::Event<K>, Instant),
) -> tokio::task::JoinHandle<()>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    tokio::spawn(async move {
        let stream = kube::runtime::watcher(api, watcher::Config::default());
        futures::pin_mut!(stream);
        while let Some(ev) = stream.next().await {
            // A failed watch re-lists by itself.
            let Ok(ev) = ev else { continue };
            if matches!(ev, watcher::Event::InitDone) {
                let _ = synced.try_send(());
            }
            let now = Instant::now();
            match seen.lock() {
                Ok(mut s) => record(&mut s, ev, now),
                Err(_) => return,
            }
            changed.send_modify(|n| *n += 1);
        }
    })
}

pub(super) fn record_sandbox(s: &mut Seen, ev: watcher::Event<Sandbox>, now: Instant) {
    match ev {
        watcher::Event::Init => s.branches_live.clear(),
        watcher::Event::Apply(o) | watcher::Event::InitApply(o) => {
            let name = o.name_any();
            if o.labels().contains_key(LABEL_BRANCHSET) {
                s.branches_seen.insert(name.clone());
                s.branches_live.insert(name);
            } else if o.status.as_ref().map(|st| st.phase) == Some(SandboxPhase::Running) {
                s.running.entry(name).or_insert(now);
            }
        }
        watcher::Event::Delete(o) => {
            s.branches_live.remove(&o.name_any());
        }
        watcher::Event::InitDone => {}
    }
}

pub(super) fn record_branchset(s: &mut Seen, ev: watcher::Event<BranchSet>, now: Instant) {
    if let watcher::Event::Apply(o) | watcher::Event::InitApply(o) = ev {
        let st = o.status.clone().unwrap_or_default();
        if st.winner.is_some() {
            s.winner.entry(o.name_any()).or_insert(now);
        }
        if st.phase == BranchSetPhase::Committed {
            s.committed.entry(o.name_any()).or_insert(now);
        }
    }
}
