//! What this node gives to sandboxes and who gets it next.
//!
//! - The **sandbox allocatable** is the node's cores and memory (from `/proc`) minus a
//!   reserve for the system, the agent and, on the embedded default, the control plane.
//! - A **ceiling**: every sandbox's cgroup lives under one parent whose CPU quota and
//!   memory limit are the allocatable, so however many sandboxes run, the rest of the
//!   node keeps its share. Each sandbox's own limits stay below it.
//! - A [`FairGate`] admits waiting work in the fair order of
//!   [`ramify_crds::capacity::fair_order`]: one gate for capacity (CPU and memory
//!   requests), one for how many restores (or fresh starts) run at once.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use ramify_crds::capacity::{self as cap, Requests, Waiting};
use tokio::sync::Notify;

use crate::error::{EngineError, Error, Result};

const CGROUP_ROOT: &str = "/sys/fs/cgroup";
/// The CFS period the ceiling's quota is expressed in (the kernel's default).
const CPU_PERIOD_US: u64 = 100_000;

/// The node's CPU (millicores: cores x 1000) and memory (MemTotal), read from `/proc`.
pub fn node_capacity() -> Result<Requests> {
    let cpuinfo = Path::new("/proc/cpuinfo");
    let cpus = std::fs::read_to_string(cpuinfo).map_err(|e| Error::io("read", cpuinfo, e))?;
    let cores = cpus
        .lines()
        .filter(|l| l.split(':').next().is_some_and(|k| k.trim() == "processor"))
        .count()
        .max(1) as u64;
    let meminfo = Path::new("/proc/meminfo");
    let mem = std::fs::read_to_string(meminfo).map_err(|e| Error::io("read", meminfo, e))?;
    let kib = mem
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .ok_or_else(|| {
            Error::Engine(EngineError::Invalid("no MemTotal in /proc/meminfo".into()))
        })?;
    Ok(Requests {
        cpu_millis: cores * 1000,
        memory_bytes: kib * 1024,
    })
}

/// The sandbox allocatable: capacity minus the reserve. A reserve that leaves nothing
/// is refused (the node would admit no sandbox at all).
pub fn allocatable(capacity: Requests, reserve: Requests) -> Result<Requests> {
    let a = capacity.minus(&reserve);
    if a.cpu_millis == 0 || a.memory_bytes == 0 {
        return Err(Error::Engine(EngineError::Invalid(format!(
            "the reserve ({} CPU, {}) leaves nothing of this node ({} CPU, {}) for sandboxes",
            Requests::cpu_text(reserve.cpu_millis),
            Requests::memory_text(reserve.memory_bytes),
            Requests::cpu_text(capacity.cpu_millis),
            Requests::memory_text(capacity.memory_bytes),
        ))));
    }
    Ok(a)
}

/// The default of `--max-concurrent-restores`: two per core. Restores run at the node's
/// speed (not under the sandbox's CPU limit) and load pages lazily, and much of a
/// restore is not on a CPU (runsc's start, the image's reads, its gofer): on 2 cores a
/// self-fork of 4 returned in 1314 ms with 4 restores at a time against 2035 ms with 2
/// (`self_fork_bench`, one run, debug builds), as 2 had beaten 1 before (a BranchSet of
/// 4 from a live sandbox: 1028 against 1356 ms). The sandboxes' parent cgroup still
/// caps their CPU at the allocatable.
pub fn default_max_restores(capacity: &Requests) -> usize {
    usize::try_from(capacity.cpu_millis * 2 / 1000)
        .unwrap_or(1)
        .max(1)
}

fn rel(parent: &str) -> Result<&str> {
    let r = parent.trim_matches('/');
    if r.is_empty() || r.split('/').any(|c| c == ".." || c.is_empty()) {
        return Err(Error::Engine(EngineError::Invalid(format!(
            "cgroup parent {parent:?} must name a cgroup below the root"
        ))));
    }
    Ok(r)
}

/// Puts the allocatable on the sandboxes' parent cgroup: a CPU quota of that many
/// cores and a memory limit of that many bytes (cgroup v1 `cpu` and `memory`
/// hierarchies, or the unified v2 tree). Idempotent; run at every agent start.
/// Returns the files written.
pub fn apply_ceiling(parent: &str, allocatable: &Requests) -> Result<Vec<PathBuf>> {
    let rel = rel(parent)?;
    let quota = allocatable.cpu_millis * CPU_PERIOD_US / 1000;
    let root = Path::new(CGROUP_ROOT);
    let writes: Vec<(PathBuf, String)> = if root.join("cgroup.controllers").exists() {
        // v2: the controllers must be enabled for the children of every ancestor.
        let mut dir = root.to_path_buf();
        for comp in rel.split('/') {
            let ctl = dir.join("cgroup.subtree_control");
            std::fs::write(&ctl, "+cpu +memory").map_err(|e| Error::io("write", &ctl, e))?;
            dir = dir.join(comp);
            std::fs::create_dir_all(&dir).map_err(|e| Error::io("create cgroup", &dir, e))?;
        }
        vec![
            (dir.join("cpu.max"), format!("{quota} {CPU_PERIOD_US}")),
            (dir.join("memory.max"), allocatable.memory_bytes.to_string()),
        ]
    } else {
        let cpu = root.join("cpu").join(rel);
        let mem = root.join("memory").join(rel);
        for d in [&cpu, &mem] {
            std::fs::create_dir_all(d).map_err(|e| Error::io("create cgroup", d, e))?;
        }
        vec![
            (cpu.join("cpu.cfs_period_us"), CPU_PERIOD_US.to_string()),
            (cpu.join("cpu.cfs_quota_us"), quota.to_string()),
            (
                mem.join("memory.limit_in_bytes"),
                allocatable.memory_bytes.to_string(),
            ),
        ]
    };
    for (path, value) in &writes {
        std::fs::write(path, value).map_err(|e| Error::io("write", path, e))?;
    }
    Ok(writes.into_iter().map(|(p, _)| p).collect())
}

/// The ceiling as the kernel holds it: (CPU millicores, memory bytes) of the parent.
pub fn read_ceiling(parent: &str) -> Result<Requests> {
    let rel = rel(parent)?;
    let root = Path::new(CGROUP_ROOT);
    let read = |p: PathBuf| -> Result<String> {
        std::fs::read_to_string(&p)
            .map(|s| s.trim().to_string())
            .map_err(|e| Error::io("read", p, e))
    };
    let bad = |what: &str, v: &str| {
        Error::Engine(EngineError::Invalid(format!(
            "cgroup {what} {v:?} not understood"
        )))
    };
    if root.join("cgroup.controllers").exists() {
        let dir = root.join(rel);
        let cpu = read(dir.join("cpu.max"))?;
        let mut it = cpu.split_whitespace();
        let (q, p) = (it.next().unwrap_or(""), it.next().unwrap_or(""));
        let (q, p): (u64, u64) = (
            q.parse().map_err(|_| bad("cpu.max", &cpu))?,
            p.parse().map_err(|_| bad("cpu.max", &cpu))?,
        );
        let mem = read(dir.join("memory.max"))?;
        Ok(Requests {
            cpu_millis: q * 1000 / p.max(1),
            memory_bytes: mem.parse().map_err(|_| bad("memory.max", &mem))?,
        })
    } else {
        let q = read(root.join("cpu").join(rel).join("cpu.cfs_quota_us"))?;
        let p = read(root.join("cpu").join(rel).join("cpu.cfs_period_us"))?;
        let m = read(root.join("memory").join(rel).join("memory.limit_in_bytes"))?;
        let q: u64 = q.parse().map_err(|_| bad("cpu.cfs_quota_us", &q))?;
        let p: u64 = p.parse().map_err(|_| bad("cpu.cfs_period_us", &p))?;
        Ok(Requests {
            cpu_millis: q * 1000 / p.max(1),
            memory_bytes: m.parse().map_err(|_| bad("memory.limit_in_bytes", &m))?,
        })
    }
}

/// One unit of the restore gate (its limit is N of these).
pub const ONE_RESTORE: Requests = Requests {
    cpu_millis: 1,
    memory_bytes: 0,
};

/// A gate's limit of `n` restores at once.
pub fn restore_slots(n: usize) -> Requests {
    ONE_RESTORE.times(u64::try_from(n).unwrap_or(u64::MAX))
}

struct Entry {
    group: String,
    rank: (i64, String),
    asks: Requests,
    granted: bool,
    /// Granted and then settled (a decided, frozen branch): it still holds what it
    /// asks now (its memory) but no longer counts as its group's running work.
    settled: bool,
}

/// Admits keyed work into a budget in the fair order (groups take turns; within a
/// group, by rank; strict: a request that does not fit yet is not overtaken). Entries
/// stay until they leave, whether or not anyone waits on them: a grant is a
/// reservation. `on_grant` is told each key as it is granted (the agent re-runs that
/// sandbox's reconcile then, instead of polling).
pub struct FairGate {
    limit: Requests,
    entries: Mutex<HashMap<String, Entry>>,
    changed: Notify,
    on_grant: Box<dyn Fn(&str) + Send + Sync>,
}

/// How a gate stands: what is granted, of what, and how many wait.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GateUsage {
    pub used: Requests,
    pub limit: Requests,
    pub waiting: usize,
    pub granted: usize,
}

impl FairGate {
    pub fn new(limit: Requests, on_grant: impl Fn(&str) + Send + Sync + 'static) -> Self {
        Self {
            limit,
            entries: Mutex::new(HashMap::new()),
            changed: Notify::new(),
            on_grant: Box::new(on_grant),
        }
    }

    pub fn limit(&self) -> Requests {
        self.limit
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        // A panic while holding the lock leaves consistent entries (every update is
        // one insert or field write), so a poisoned lock is still usable.
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues `key` (once; later calls keep its place) and says whether it is granted.
    pub fn enter(&self, key: &str, group: &str, rank: (i64, String), asks: Requests) -> bool {
        let granted = {
            let mut e = self.lock();
            e.entry(key.to_string()).or_insert_with(|| Entry {
                group: group.to_string(),
                rank,
                asks,
                granted: false,
                settled: false,
            });
            self.rebalance(&mut e)
        };
        self.announce(&granted);
        self.is_granted(key)
    }

    /// Records `key` as granted whatever the room (work found running after a restart:
    /// it holds what it holds).
    pub fn force(&self, key: &str, group: &str, rank: (i64, String), asks: Requests) {
        self.lock().insert(
            key.to_string(),
            Entry {
                group: group.to_string(),
                rank,
                asks,
                granted: true,
                settled: false,
            },
        );
    }

    pub fn is_granted(&self, key: &str) -> bool {
        self.lock().get(key).is_some_and(|e| e.granted)
    }

    pub fn contains(&self, key: &str) -> bool {
        self.lock().contains_key(key)
    }

    /// A granted entry now holds `asks` (less, usually) and no longer counts as its
    /// group's running work; the room it gave up goes to whoever waits.
    pub fn settle(&self, key: &str, asks: Requests) {
        let granted = {
            let mut e = self.lock();
            if let Some(x) = e.get_mut(key).filter(|x| x.granted) {
                x.asks = asks;
                x.settled = true;
            }
            self.rebalance(&mut e)
        };
        self.announce(&granted);
    }

    /// Removes `key` (granted or waiting); its room goes to whoever waits.
    pub fn leave(&self, key: &str) {
        let granted = {
            let mut e = self.lock();
            if e.remove(key).is_none() {
                return;
            }
            self.rebalance(&mut e)
        };
        self.announce(&granted);
    }

    pub fn keys(&self) -> Vec<String> {
        self.lock().keys().cloned().collect()
    }

    pub fn usage(&self) -> GateUsage {
        let e = self.lock();
        let mut u = GateUsage {
            used: Requests::ZERO,
            limit: self.limit,
            waiting: 0,
            granted: 0,
        };
        for x in e.values() {
            if x.granted {
                u.used = u.used.plus(&x.asks);
                u.granted += 1;
            } else {
                u.waiting += 1;
            }
        }
        u
    }

    /// Waits until `key` is granted (entering it first), then holds it until the
    /// permit is dropped. For background work that may wait (warm-pool refills).
    pub async fn acquire(
        self: &Arc<Self>,
        key: &str,
        group: &str,
        rank: (i64, String),
        asks: Requests,
    ) -> GatePermit {
        loop {
            let notified = self.changed.notified();
            if self.enter(key, group, rank.clone(), asks) {
                return GatePermit {
                    gate: self.clone(),
                    key: key.to_string(),
                };
            }
            notified.await;
        }
    }

    /// Takes over a granted entry: it leaves the gate when the permit drops.
    pub fn permit(self: &Arc<Self>, key: &str) -> Option<GatePermit> {
        self.is_granted(key).then(|| GatePermit {
            gate: self.clone(),
            key: key.to_string(),
        })
    }

    fn rebalance(&self, e: &mut HashMap<String, Entry>) -> Vec<String> {
        let mut used = Requests::ZERO;
        let mut running: HashMap<&str, usize> = HashMap::new();
        let mut waiting = Vec::new();
        for (k, x) in e.iter() {
            if x.granted {
                used = used.plus(&x.asks);
                if !x.settled {
                    *running.entry(x.group.as_str()).or_default() += 1;
                }
            } else {
                waiting.push(Waiting {
                    key: k.clone(),
                    group: x.group.clone(),
                    rank: x.rank.clone(),
                    asks: x.asks,
                });
            }
        }
        if waiting.is_empty() {
            return Vec::new();
        }
        let ordered = cap::fair_order(&waiting, &|g| running.get(g).copied().unwrap_or(0));
        let granted = cap::admit(&ordered, self.limit.minus(&used), &self.limit);
        for k in &granted {
            if let Some(x) = e.get_mut(k) {
                x.granted = true;
            }
        }
        granted
    }

    fn announce(&self, granted: &[String]) {
        if granted.is_empty() {
            return;
        }
        for k in granted {
            (self.on_grant)(k);
        }
        self.changed.notify_waiters();
    }
}

/// A [`FairGate`] as the engine's warm pools queue in it: each refill asks for one
/// restore slot ([`ONE_RESTORE`]), unranked.
pub struct RestoreGate(pub Arc<FairGate>);

impl ramify_engine::RestoreSlots for RestoreGate {
    fn acquire<'a>(
        &'a self,
        key: &'a str,
        group: &'a str,
    ) -> futures::future::BoxFuture<'a, Box<dyn Send>> {
        Box::pin(async move {
            let permit = self
                .0
                .acquire(key, group, (0, String::new()), ONE_RESTORE)
                .await;
            Box::new(permit) as Box<dyn Send>
        })
    }

    fn leave(&self, key: &str) {
        self.0.leave(key);
    }
}

/// A granted place in a [`FairGate`]; dropping it leaves the gate.
pub struct GatePermit {
    gate: Arc<FairGate>,
    key: String,
}

impl Drop for GatePermit {
    fn drop(&mut self) {
        self.gate.leave(&self.key);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn req(cpu: u64) -> Requests {
        Requests {
            cpu_millis: cpu,
            memory_bytes: 1 << 20,
        }
    }

    fn gate(cpu: u64) -> (Arc<FairGate>, Arc<Mutex<Vec<String>>>) {
        let told = Arc::new(Mutex::new(Vec::new()));
        let t = told.clone();
        let g = FairGate::new(
            Requests {
                cpu_millis: cpu,
                memory_bytes: 1 << 30,
            },
            move |k| t.lock().unwrap().push(k.to_string()),
        );
        (Arc::new(g), told)
    }

    #[test]
    fn the_node_reports_cores_and_memory() {
        let c = node_capacity().unwrap();
        assert!(
            c.cpu_millis >= 1000 && c.cpu_millis.is_multiple_of(1000),
            "{c:?}"
        );
        assert!(c.memory_bytes > 64 << 20, "{c:?}");
        let a = allocatable(
            c,
            Requests {
                cpu_millis: 400,
                memory_bytes: 2 << 30,
            },
        );
        if c.memory_bytes > 2 << 30 {
            assert_eq!(a.unwrap().cpu_millis, c.cpu_millis - 400);
        }
        assert!(
            allocatable(c, c).is_err(),
            "a reserve of everything is refused"
        );
        assert_eq!(
            default_max_restores(&Requests {
                cpu_millis: 2000,
                memory_bytes: 0
            }),
            4
        );
        assert_eq!(
            default_max_restores(&Requests {
                cpu_millis: 500,
                memory_bytes: 0
            }),
            1
        );
        assert_eq!(
            default_max_restores(&Requests {
                cpu_millis: 16000,
                memory_bytes: 0
            }),
            32
        );
    }

    #[test]
    fn work_waits_for_room_and_gets_it_when_room_frees() {
        let (g, told) = gate(1600);
        assert!(g.enter("ws", "ns/ws", (0, String::new()), req(500)));
        assert!(g.enter("b0", "ns/bs", (0, String::new()), req(500)));
        assert!(g.enter("b1", "ns/bs", (1, String::new()), req(500)));
        assert!(!g.enter("b2", "ns/bs", (2, String::new()), req(500)));
        let u = g.usage();
        assert_eq!((u.used.cpu_millis, u.waiting, u.granted), (1500, 1, 3));
        told.lock().unwrap().clear();
        // A decided branch gives up its CPU: the next one is granted, and told.
        g.settle("b0", Requests::ZERO);
        assert!(g.is_granted("b2"));
        assert_eq!(*told.lock().unwrap(), ["b2"]);
        g.leave("b1");
        g.leave("b1");
        assert_eq!(g.usage().used.cpu_millis, 1000);
    }

    #[test]
    fn a_small_set_is_served_before_the_rest_of_a_big_one() {
        let (g, told) = gate(1000);
        for i in 0..100 {
            g.enter(&format!("big-{i}"), "ns/big", (i, String::new()), req(500));
        }
        for i in 0..3 {
            assert!(!g.enter(
                &format!("small-{i}"),
                "ns/small",
                (i, String::new()),
                req(500)
            ));
        }
        told.lock().unwrap().clear();
        // Room frees one slot at a time: the sets take turns (the one with fewer
        // running goes first), the small one is not queued behind 98 branches.
        g.leave("big-0");
        g.leave("big-1");
        g.leave("small-0");
        assert_eq!(*told.lock().unwrap(), ["small-0", "big-2", "small-1"]);
    }

    #[tokio::test]
    async fn a_permit_waits_its_turn_and_leaves_when_dropped() {
        let (g, _) = gate(1);
        let first = g.acquire("a", "a", (0, String::new()), ONE_RESTORE).await;
        let g2 = g.clone();
        let second = tokio::spawn(async move {
            let _p = g2.acquire("b", "b", (0, String::new()), ONE_RESTORE).await;
        });
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(!second.is_finished(), "one restore at a time");
        drop(first);
        tokio::time::timeout(std::time::Duration::from_secs(5), second)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(g.usage().granted, 0);
    }
}
