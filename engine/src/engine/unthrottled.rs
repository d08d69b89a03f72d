//! The platform's work is not charged to the tenant: a checkpoint and a restore run at
//! the node's speed whatever the sandbox's CPU limit.
//!
//! gVisor's sentry does the checkpoint (serialising the kernel, writing every page) and
//! the restore (loading them) inside the sandbox's cgroup, so a `cpu: 50m` sandbox paid
//! 20x the wall time of an unlimited one for the same work: 3.3 to 6.5 s per restore and
//! about 1 s of checkpoint (its source paused all that time), against about 0.45 s and
//! 70 ms at 400m. So:
//! - a checkpoint lifts the sandbox's CFS quota for the time of `runsc checkpoint` (the
//!   workload is paused by the checkpoint itself: only the sentry's work runs) and puts
//!   it back;
//! - a restore runs from a bundle without the CPU limit (runsc creates the cgroup from
//!   it), and the limit is written into the cgroup as soon as the restore and the
//!   branch's own set-up (its hostname) are done, before it is handed to anyone.
//!
//! The node's cap on all sandboxes (their parent cgroup) still applies, so the agent,
//! the kubelet and the control plane keep their CPU. In cluster mode the Pod's own
//! cgroup (the kubelet's) keeps its limit: only the sandbox's cgroup inside it is lifted.

use serde_json::Value;
use tracing::warn;

use super::{Engine, LocalSandbox};
use crate::cgroup;
use crate::error::{Error, Result};
use crate::spec::CPU_PERIOD_US;

/// The CFS quota (µs per [`CPU_PERIOD_US`]) of `millis` of CPU.
pub(crate) fn quota_us(millis: u64) -> i64 {
    i64::try_from(millis * CPU_PERIOD_US / 1000).unwrap_or(i64::MAX)
}

/// Sets the sandbox's CFS quota (`-1`: none) in the cpu hierarchy. A cgroup without the
/// file (no cpu controller here) is left alone.
fn set_quota(cgroups_path: &str, quota: i64) -> Result<()> {
    let period = cgroup::file("cpu", cgroups_path, "cpu.cfs_period_us");
    let path = cgroup::file("cpu", cgroups_path, "cpu.cfs_quota_us");
    if !path.exists() {
        return Ok(());
    }
    if quota > 0 {
        std::fs::write(&period, CPU_PERIOD_US.to_string())
            .map_err(|e| Error::io("write", &period, e))?;
    }
    std::fs::write(&path, quota.to_string()).map_err(|e| Error::io("write", &path, e))
}

/// A sandbox whose CPU limit is lifted until [`Lifted::restore`] (or drop) puts it back.
#[must_use = "the CPU limit comes back when this is restored or dropped"]
pub(crate) struct Lifted {
    cgroups_path: String,
    quota: Option<i64>,
}

impl Lifted {
    /// Puts the sandbox's own CPU limit back.
    pub(crate) fn restore(mut self) -> Result<()> {
        self.put_back()
    }

    fn put_back(&mut self) -> Result<()> {
        match self.quota.take() {
            Some(q) => set_quota(&self.cgroups_path, q),
            None => Ok(()),
        }
    }
}

impl Drop for Lifted {
    fn drop(&mut self) {
        if let Err(e) = self.put_back() {
            warn!(cgroup = %self.cgroups_path, error = %e, "putting a sandbox's CPU limit back");
        }
    }
}

impl Engine {
    /// Lifts a running sandbox's CPU limit (for its checkpoint).
    pub(crate) fn lift_cpu_limit(&self, sb: &LocalSandbox) -> Lifted {
        let quota = sb.workload.resources.cpu_millis.map(quota_us);
        if quota.is_some()
            && let Err(e) = set_quota(sb.cgroups_path(), -1)
        {
            // Only slower, not wrong: the checkpoint runs at the sandbox's own limit.
            warn!(id = %sb.id, error = %e, "lifting the CPU limit for a checkpoint");
        }
        Lifted {
            cgroups_path: sb.cgroups_path().to_string(),
            quota,
        }
    }

    /// `runsc restore` of `sb` from `img` without its CPU limit; the limit comes back
    /// when the returned [`Lifted`] is restored or dropped (also when the restore failed).
    pub(crate) async fn restore_unthrottled(
        &self,
        sb: &LocalSandbox,
        img: &std::path::Path,
    ) -> Result<Lifted> {
        let lifted = Lifted {
            cgroups_path: sb.cgroups_path().to_string(),
            quota: sb.workload.resources.cpu_millis.map(quota_us),
        };
        let config = sb.bundle_dir().join("config.json");
        let limited: Option<Value> = match lifted.quota {
            Some(_) => {
                let bytes = std::fs::read(&config).map_err(|e| Error::io("read", &config, e))?;
                let mut v: Value = serde_json::from_slice(&bytes)?;
                let full = v.clone();
                if let Some(r) = v
                    .pointer_mut("/linux/resources")
                    .and_then(Value::as_object_mut)
                {
                    r.remove("cpu");
                }
                crate::spec::write_bundle(&sb.bundle_dir(), &v)?;
                Some(full)
            }
            None => None,
        };
        let restored = async {
            self.inner.placement.before_start(&sb.placed).await?;
            self.inner
                .runsc
                .restore(&sb.ctx, &sb.bundle_dir(), img)
                .await
        }
        .await;
        // The bundle says what the sandbox is again (its record, a later restore).
        if let Some(full) = limited {
            crate::spec::write_bundle(&sb.bundle_dir(), &full)?;
        }
        if restored.is_ok() {
            self.seal_pages(sb, img);
        }
        restored.map(|()| lifted)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn quotas_are_millis_of_the_period() {
        assert_eq!(super::quota_us(50), 5_000);
        assert_eq!(super::quota_us(1000), 100_000);
        assert_eq!(super::quota_us(2500), 250_000);
    }
}
