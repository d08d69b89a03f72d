//! Test lanes: `hack/test.sh` runs test binaries in two lanes at once, each with its own
//! control plane, object store and registry (set through `RAMIFY_CP_*`, `RAMIFY_S3_*`)
//! and, chosen here from `RAMIFY_E2E_LANE`, its own e2e state directory, bridges,
//! subnets and cgroup parents. Two systems in different lanes never share an address, a
//! rule, a directory or a cgroup, and a lane's sweep of earlier runs never touches the
//! other lane's. Lane 0 (no variable) keeps the names a single run always had.

use std::path::PathBuf;

use crate::repo_root;

/// Most extra nodes a system starts (bridges `rmye2en1`.., subnets 10.71/16.. in lane 0;
/// see [`crate::lane`]).
pub const MAX_EXTRA_NODES: usize = 8;

/// The most lanes (subnets 10.110/16 .. 10.198/16 for lanes 1..9).
const MAX_LANE: u8 = 9;

/// This process's lane: `RAMIFY_E2E_LANE` (0 when unset; a value past 9 is refused).
pub fn lane() -> u8 {
    match std::env::var("RAMIFY_E2E_LANE") {
        Err(_) => 0,
        Ok(v) => match v.trim().parse::<u8>() {
            Ok(n) if n <= MAX_LANE => n,
            _ => panic!("RAMIFY_E2E_LANE={v:?}: a lane is a number from 0 to {MAX_LANE}"),
        },
    }
}

/// Where this lane's systems keep their state (`.ramify/e2e`, `.ramify/e2e-lane1`, ...).
pub fn base_dir() -> PathBuf {
    match lane() {
        0 => repo_root().join(".ramify/e2e"),
        k => repo_root().join(format!(".ramify/e2e-lane{k}")),
    }
}

/// The bridge of a system's main node agent (`rmye2e0`, `rmye2e1`, ...).
pub fn bridge() -> String {
    format!("rmye2e{}", lane())
}

/// The first two octets (with the dot) of the main agent's /16.
pub fn subnet_prefix() -> String {
    subnet_prefix_of(lane())
}

/// The bridge of extra node `k` (1-based) of a system.
pub fn extra_bridge(k: usize) -> String {
    match lane() {
        0 => format!("rmye2en{k}"),
        l => format!("rmye2e{l}n{k}"),
    }
}

/// The subnet prefix of extra node `k` (1-based, at most 8).
pub fn extra_subnet_prefix(k: usize) -> String {
    extra_subnet_prefix_of(lane(), k)
}

/// What this lane's cgroup parents start with (`ramify-e2e-`, `ramify-e2e1-`, ...).
pub fn cgroup_prefix() -> String {
    match lane() {
        0 => "ramify-e2e-".to_string(),
        k => format!("ramify-e2e{k}-"),
    }
}

fn subnet_prefix_of(lane: u8) -> String {
    match lane {
        0 => "10.89.".to_string(),
        k => format!("10.{}.", 100 + 10 * u32::from(k)),
    }
}

fn extra_subnet_prefix_of(lane: u8, k: usize) -> String {
    match lane {
        0 => format!("10.{}.", 70 + k),
        l => format!("10.{}.", 100 + 10 * usize::from(l) + k),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lanes_never_share_a_subnet() {
        let mut all: Vec<String> = (0..=MAX_LANE)
            .flat_map(|l| {
                std::iter::once(subnet_prefix_of(l))
                    .chain((1..=8).map(move |k| extra_subnet_prefix_of(l, k)))
            })
            .collect();
        let n = all.len();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), n, "two lanes or nodes share a subnet");
        // Nothing else on the test bed uses these /16s (demo 10.88, test demo 10.90,
        // real node 10.91, helm 10.92, engine tests 10.231, the engine's example 10.232).
        for taken in ["10.88.", "10.90.", "10.91.", "10.92.", "10.231.", "10.232."] {
            assert!(!all.iter().any(|s| s == taken), "{taken} is taken");
        }
    }
}
