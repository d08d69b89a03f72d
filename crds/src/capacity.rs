//! How a node's capacity is accounted, shared by the operator (which binds a Sandbox
//! only when it fits) and the node agent (which admits it again before it starts or
//! restores anything): the request of a sandbox, the names announced on a node's
//! Lease, the fair order in which waiting sandboxes are admitted, and the message that
//! says why one waits.

use std::collections::BTreeMap;

use crate::sandbox::{Sandbox, SandboxSpec};

/// Annotation on a node agent's Lease: how many sandboxes the node takes.
pub const ANNOTATION_MAX_SANDBOXES: &str = "ramify.dev/max-sandboxes";
/// Annotation on a node agent's Lease: the node's runsc version string.
pub const ANNOTATION_RUNSC_VERSION: &str = "ramify.dev/runsc-version";
/// Annotation on a node agent's Lease: CPU for sandboxes (a quantity, e.g. `1600m`):
/// the node's cores minus the agent's `--reserve-cpu`.
pub const ANNOTATION_ALLOCATABLE_CPU: &str = "ramify.dev/allocatable-cpu";
/// Annotation on a node agent's Lease: memory for sandboxes in bytes: the node's
/// MemTotal minus the agent's `--reserve-memory`.
pub const ANNOTATION_ALLOCATABLE_MEMORY: &str = "ramify.dev/allocatable-memory";

/// Condition type on a Sandbox: whether it is bound to a node.
pub const CONDITION_SCHEDULED: &str = "Scheduled";
/// Condition type on a Sandbox: whether its processes run.
pub const CONDITION_READY: &str = "Ready";
/// Reason (Scheduled or Ready False): the node has no room for the request yet; the
/// sandbox starts as soon as capacity frees.
pub const REASON_WAITING_FOR_CAPACITY: &str = "WaitingForCapacity";
/// Reason (Scheduled False): the request is larger than any node's allocatable; it
/// cannot start until a larger node joins.
pub const REASON_EXCEEDS_ALLOCATABLE: &str = "ExceedsAllocatable";

/// Reason (a BranchSet's `Forked` and `Ready` False): some of its branches wait for
/// capacity; the message says how many are admitted, how many wait, and why in their
/// Sandboxes' words (the node's numbers).
pub const REASON_BRANCHES_WAITING_FOR_CAPACITY: &str = REASON_WAITING_FOR_CAPACITY;
/// Reason (a BranchSet's `Ready` and `Forked` False, and a Warning Event): its
/// branches can never fit on any node they may run on while its source runs (a
/// branch asks more than a node's sandbox allocatable less what its sandboxes that are
/// not branches hold); the set fails at once instead of waiting for its timeout. The
/// word a Sandbox's `Scheduled` condition uses when the scheduler cannot place its Pod.
pub const REASON_BRANCHES_UNSCHEDULABLE: &str = crate::pod::REASON_UNSCHEDULABLE;

/// CPU a sandbox without `spec.resources.cpu` is accounted for (millicores).
pub const DEFAULT_CPU_REQUEST_MILLIS: u64 = 250;
/// Memory a sandbox without `spec.resources.memory` is accounted for (bytes).
pub const DEFAULT_MEMORY_REQUEST_BYTES: u64 = 256 << 20;

/// Parses a Kubernetes CPU quantity into millicores ("500m", "2", "1.5").
pub fn cpu_millis(q: &str) -> Option<u64> {
    if let Some(m) = q.strip_suffix('m') {
        return m.parse().ok();
    }
    let v: f64 = q.parse().ok()?;
    (v > 0.0).then(|| (v * 1000.0).round() as u64)
}

/// Parses a Kubernetes memory quantity into bytes ("512Mi", "1G", "1048576").
pub fn memory_bytes(q: &str) -> Option<u64> {
    const SUFFIXES: [(&str, u64); 12] = [
        ("Ki", 1 << 10),
        ("Mi", 1 << 20),
        ("Gi", 1 << 30),
        ("Ti", 1 << 40),
        ("Pi", 1 << 50),
        ("Ei", 1 << 60),
        ("k", 1_000),
        ("M", 1_000_000),
        ("G", 1_000_000_000),
        ("T", 1_000_000_000_000),
        ("P", 1_000_000_000_000_000),
        ("E", 1_000_000_000_000_000_000),
    ];
    for (suffix, mult) in SUFFIXES {
        if let Some(n) = q.strip_suffix(suffix) {
            let v: f64 = n.parse().ok()?;
            return Some((v * mult as f64) as u64);
        }
    }
    q.parse::<f64>().ok().map(|v| v as u64)
}

/// CPU and memory a sandbox occupies on its node, for admission.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Requests {
    pub cpu_millis: u64,
    pub memory_bytes: u64,
}

impl Requests {
    pub const ZERO: Requests = Requests {
        cpu_millis: 0,
        memory_bytes: 0,
    };

    /// Whether `self` fits into `room` in both resources.
    pub fn fits_in(&self, room: &Requests) -> bool {
        self.cpu_millis <= room.cpu_millis && self.memory_bytes <= room.memory_bytes
    }

    pub fn plus(&self, other: &Requests) -> Requests {
        Requests {
            cpu_millis: self.cpu_millis.saturating_add(other.cpu_millis),
            memory_bytes: self.memory_bytes.saturating_add(other.memory_bytes),
        }
    }

    pub fn minus(&self, other: &Requests) -> Requests {
        Requests {
            cpu_millis: self.cpu_millis.saturating_sub(other.cpu_millis),
            memory_bytes: self.memory_bytes.saturating_sub(other.memory_bytes),
        }
    }

    pub fn times(&self, n: u64) -> Requests {
        Requests {
            cpu_millis: self.cpu_millis.saturating_mul(n),
            memory_bytes: self.memory_bytes.saturating_mul(n),
        }
    }

    /// `1.5` (cores, as few decimals as needed).
    pub fn cpu_text(millis: u64) -> String {
        let s = format!("{:.3}", millis as f64 / 1000.0);
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }

    /// `1.5 GiB` or `768 MiB`.
    pub fn memory_text(bytes: u64) -> String {
        if bytes >= 1 << 30 {
            format!("{:.1} GiB", bytes as f64 / f64::from(1u32 << 30))
        } else {
            format!("{} MiB", bytes >> 20)
        }
    }
}

impl SandboxSpec {
    /// What the sandbox is accounted for: `spec.resources` (which are also its cgroup
    /// limits), else [`DEFAULT_CPU_REQUEST_MILLIS`] and [`DEFAULT_MEMORY_REQUEST_BYTES`].
    /// A branch's spec carries its source sandbox's resources, so its request defaults
    /// from its source.
    pub fn requests(&self) -> Requests {
        let res = self.resources.as_ref();
        Requests {
            cpu_millis: res
                .and_then(|r| r.cpu.as_deref())
                .and_then(cpu_millis)
                .unwrap_or(DEFAULT_CPU_REQUEST_MILLIS),
            memory_bytes: res
                .and_then(|r| r.memory.as_deref())
                .and_then(memory_bytes)
                .unwrap_or(DEFAULT_MEMORY_REQUEST_BYTES),
        }
    }
}

/// The fairness group of a sandbox: its BranchSet (`namespace/name`), else itself.
pub fn group_of(s: &Sandbox) -> String {
    let ns = s.metadata.namespace.as_deref().unwrap_or_default();
    match s.spec.restore_from.as_ref().and_then(|r| r.branch.as_ref()) {
        Some(b) => format!("{ns}/{}", b.branch_set),
        None => format!("{ns}/{}", s.metadata.name.as_deref().unwrap_or_default()),
    }
}

/// Its place within the group: branch index, then creation time and name.
pub fn rank_of(s: &Sandbox) -> (i64, String) {
    let index = s
        .spec
        .restore_from
        .as_ref()
        .and_then(|r| r.branch.as_ref())
        .map(|b| i64::from(b.index))
        .unwrap_or(0);
    let created = s
        .metadata
        .creation_timestamp
        .as_ref()
        .map(|t| t.0.as_millisecond())
        .unwrap_or(0);
    (
        index,
        format!(
            "{created:020}/{}",
            s.metadata.name.as_deref().unwrap_or_default()
        ),
    )
}

/// How [`waiting_message`] begins; a BranchSet quotes what follows it (`2 wait for
/// capacity on node vm: ...`).
pub const WAITING_FOR_CAPACITY: &str = "waiting for capacity";

/// Why a sandbox waits: `waiting for capacity on node vm: 1.5 of 1.6 CPU, 0.8 of
/// 21.5 GiB memory in use (asks 0.5 CPU, 256 MiB)`.
pub fn waiting_message(
    node: &str,
    used: &Requests,
    allocatable: &Requests,
    asks: &Requests,
) -> String {
    format!(
        "{WAITING_FOR_CAPACITY} on node {node}: {} of {} CPU, {} of {} memory in use (asks {} CPU, {})",
        Requests::cpu_text(used.cpu_millis),
        Requests::cpu_text(allocatable.cpu_millis),
        Requests::memory_text(used.memory_bytes),
        Requests::memory_text(allocatable.memory_bytes),
        Requests::cpu_text(asks.cpu_millis),
        Requests::memory_text(asks.memory_bytes),
    )
}

/// Why a sandbox cannot start on a node at all.
pub fn too_big_message(node: &str, allocatable: &Requests, asks: &Requests) -> String {
    format!(
        "asks {} CPU, {} but node {node} has {} CPU, {} for sandboxes in all",
        Requests::cpu_text(asks.cpu_millis),
        Requests::memory_text(asks.memory_bytes),
        Requests::cpu_text(allocatable.cpu_millis),
        Requests::memory_text(allocatable.memory_bytes),
    )
}

/// One sandbox waiting for admission.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Waiting<K> {
    pub key: K,
    /// Fairness group: the BranchSet of a branch, else the sandbox itself.
    pub group: String,
    /// Order within its group (branch index, then creation time, then name).
    pub rank: (i64, String),
    pub asks: Requests,
}

/// The fair order of waiting sandboxes: the groups take turns, and a group that
/// already has more admitted sandboxes waits behind those with fewer (`admitted`
/// counts them per group). A sandbox's turn is its group's admitted count plus its
/// position in the group; ties go to the group name that sorts first. So a 100-branch
/// set does not starve a 3-branch one: the small set's first branch goes next.
pub fn fair_order<K: Clone>(
    waiting: &[Waiting<K>],
    admitted: &dyn Fn(&str) -> usize,
) -> Vec<Waiting<K>> {
    let mut groups: BTreeMap<&str, Vec<&Waiting<K>>> = BTreeMap::new();
    for w in waiting {
        groups.entry(w.group.as_str()).or_default().push(w);
    }
    let mut turns: Vec<(usize, &str, &Waiting<K>)> = Vec::with_capacity(waiting.len());
    for (group, mut members) in groups {
        members.sort_by(|a, b| a.rank.cmp(&b.rank));
        let base = admitted(group);
        for (i, w) in members.into_iter().enumerate() {
            turns.push((base + i, group, w));
        }
    }
    turns.sort_by(|a, b| (a.0, a.1, &a.2.rank).cmp(&(b.0, b.1, &b.2.rank)));
    turns.into_iter().map(|(_, _, w)| w.clone()).collect()
}

/// Which of the `ordered` waiting sandboxes are admitted into `free` room: in order,
/// until the first that does not fit (later ones wait behind it, so a large request is
/// not overtaken forever). One that could never fit (`asks` beyond `allocatable`)
/// blocks nobody.
pub fn admit<K: Clone>(ordered: &[Waiting<K>], free: Requests, allocatable: &Requests) -> Vec<K> {
    let mut room = free;
    let mut out = Vec::new();
    for w in ordered {
        if !w.asks.fits_in(allocatable) {
            continue;
        }
        if !w.asks.fits_in(&room) {
            break;
        }
        room = room.minus(&w.asks);
        out.push(w.key.clone());
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn w(key: &str, group: &str, index: i64, cpu: u64) -> Waiting<String> {
        Waiting {
            key: key.into(),
            group: group.into(),
            rank: (index, String::new()),
            asks: Requests {
                cpu_millis: cpu,
                memory_bytes: 1,
            },
        }
    }

    #[test]
    fn quantities_parse_like_kubernetes() {
        assert_eq!(cpu_millis("500m"), Some(500));
        assert_eq!(cpu_millis("2"), Some(2000));
        assert_eq!(cpu_millis("1.5"), Some(1500));
        assert_eq!(cpu_millis("x"), None);
        assert_eq!(memory_bytes("512Mi"), Some(512 << 20));
        assert_eq!(memory_bytes("1G"), Some(1_000_000_000));
        assert_eq!(memory_bytes("1048576"), Some(1_048_576));
        assert_eq!(memory_bytes("lots"), None);
    }

    #[test]
    fn a_sandbox_without_resources_gets_the_documented_default() {
        let spec: SandboxSpec =
            serde_json::from_value(serde_json::json!({"command": ["sh"]})).unwrap();
        assert_eq!(
            spec.requests(),
            Requests {
                cpu_millis: 250,
                memory_bytes: 256 << 20
            }
        );
        let spec: SandboxSpec = serde_json::from_value(
            serde_json::json!({"command": ["sh"], "resources": {"cpu": "1.5"}}),
        )
        .unwrap();
        assert_eq!(spec.requests().cpu_millis, 1500);
        assert_eq!(spec.requests().memory_bytes, 256 << 20);
    }

    #[test]
    fn a_big_set_does_not_starve_a_small_one() {
        let mut waiting: Vec<_> = (2..100)
            .map(|i| w(&format!("big-b{i}"), "ns/big", i, 500))
            .collect();
        waiting.extend((0..3).map(|i| w(&format!("small-s{i}"), "ns/small", i, 500)));
        // The big set has two branches admitted already; the small set none.
        let admitted = |g: &str| if g == "ns/big" { 2 } else { 0 };
        let order: Vec<String> = fair_order(&waiting, &admitted)
            .into_iter()
            .map(|w| w.key)
            .collect();
        assert_eq!(
            &order[..6],
            [
                "small-s0", "small-s1", "big-b2", "small-s2", "big-b3", "big-b4"
            ]
        );
        // Within a group, branch index order.
        let pos = |k: &str| order.iter().position(|o| o == k).unwrap();
        assert!(pos("big-b10") < pos("big-b11"));
    }

    #[test]
    fn admission_stops_at_the_first_that_does_not_fit_but_skips_the_impossible() {
        let alloc = Requests {
            cpu_millis: 1600,
            memory_bytes: 100,
        };
        let ordered = vec![
            w("a", "a", 0, 500),
            w("huge", "huge", 0, 5000),
            w("b", "b", 0, 1000),
            w("c", "c", 0, 100),
        ];
        let free = Requests {
            cpu_millis: 1200,
            memory_bytes: 100,
        };
        // a fits; huge can never fit and is skipped; b does not fit now and c waits
        // behind it.
        assert_eq!(admit(&ordered, free, &alloc), ["a"]);
        assert!(admit(&ordered, Requests::ZERO, &alloc).is_empty());
    }

    #[test]
    fn the_waiting_message_says_how_much_is_in_use() {
        let m = waiting_message(
            "vm",
            &Requests {
                cpu_millis: 1500,
                memory_bytes: 768 << 20,
            },
            &Requests {
                cpu_millis: 1600,
                memory_bytes: 22 << 30,
            },
            &Requests {
                cpu_millis: 500,
                memory_bytes: 256 << 20,
            },
        );
        assert_eq!(
            m,
            "waiting for capacity on node vm: 1.5 of 1.6 CPU, 768 MiB of 22.0 GiB memory in use (asks 0.5 CPU, 256 MiB)"
        );
    }
}
