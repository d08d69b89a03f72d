//! `status.usage`: what a sandbox uses, as its cgroups on the node say.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde::{Deserialize, Serialize};

/// A sandbox's use of its node, sampled by its node agent from the sandbox's cgroups
/// (the gVisor sentry, gofer and the memory they hold for the workload).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SandboxUsage {
    /// CPU used, averaged over the agent's last sampling interval (`250m` is a
    /// quarter of a core).
    pub cpu: String,
    /// Resident memory: the working set (what the cgroup is charged minus the file
    /// pages the kernel could drop at once), as `kubectl top` counts a Pod's.
    pub memory: String,
    /// Of it, the sandbox's own pages: its workload's memory and the sentry's.
    pub memory_own: String,
    /// Of what the cgroup is charged, file pages: a snapshot's pages the sandbox read
    /// (a branch reads its snapshot lazily; siblings share the cached copy) and the
    /// files of its root. The node can drop the inactive ones under pressure.
    pub memory_shared: String,
    /// When the agent sampled these figures.
    pub sampled_at: Time,
}

/// `250m`: millicores as a Kubernetes quantity.
pub fn cpu_quantity(millis: u64) -> String {
    format!("{millis}m")
}

/// `312Mi` (to the nearest MiB), `12Ki` below one MiB, `0` for nothing.
pub fn memory_quantity(bytes: u64) -> String {
    const MI: u64 = 1 << 20;
    if bytes == 0 {
        "0".into()
    } else if bytes < MI {
        format!("{}Ki", bytes.div_ceil(1024))
    } else {
        format!("{}Mi", (bytes + MI / 2) / MI)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capacity::{cpu_millis, memory_bytes};

    #[test]
    fn quantities_read_back_as_what_they_say() {
        assert_eq!(cpu_quantity(0), "0m");
        assert_eq!(cpu_millis(&cpu_quantity(1250)), Some(1250));
        assert_eq!(memory_quantity(0), "0");
        assert_eq!(memory_quantity(1), "1Ki");
        assert_eq!(memory_quantity(300 << 20), "300Mi");
        assert_eq!(memory_quantity((300 << 20) + (600 << 10)), "301Mi");
        assert_eq!(memory_bytes(&memory_quantity(5 << 30)), Some(5 << 30));
    }
}
