//! Why a sandbox ended, in the words of a Sandbox's status (`status.exit`): the facts
//! the engine reads once its processes are gone ([`ramify_engine::exit_reason`]: the
//! first process's exit line, the cgroups' counters), named as the kubelet names a
//! container's termination (`OOMKilled` wins over "killed by signal 9").

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use ramify_crds::{ExitReason, SandboxExit};
use ramify_engine::LocalSandbox;
use ramify_engine::exit_reason::{BootExit, Ending, LimitFacts};
use ramify_engine::runsc::{Runsc, SandboxCtx};

/// A byte count as a Kubernetes quantity: `268435456` -> `256Mi`.
pub fn quantity(bytes: u64) -> String {
    for (suffix, shift) in [("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10)] {
        if bytes >= 1 << shift && bytes.is_multiple_of(1 << shift) {
            return format!("{}{suffix}", bytes >> shift);
        }
    }
    bytes.to_string()
}

fn signal_name(sig: i32) -> String {
    nix::sys::signal::Signal::try_from(sig)
        .map(|s| format!("signal {sig} ({})", s.as_str()))
        .unwrap_or_else(|_| format!("signal {sig}"))
}

/// Names what happened. A limit the cgroup saw hit wins over the exit line (an
/// out-of-memory kill reads as "killed by signal 9"), as the kubelet says `OOMKilled`.
pub fn classify(boot: &BootExit, limits: &LimitFacts, pages_lost: Option<&str>) -> SandboxExit {
    let (code, signal) = match boot {
        BootExit::Exited(c) => (Some(*c), None),
        BootExit::Signaled(s) => (None, Some(*s)),
        _ => (None, None),
    };
    let how = match boot {
        BootExit::Exited(c) => format!("its first process exited with code {c}"),
        BootExit::Signaled(s) => format!("its first process was killed by {}", signal_name(*s)),
        BootExit::Panicked(p) => format!("gVisor stopped ({p})"),
        BootExit::Unknown => "the sandbox process was killed".into(),
    };
    let (reason, limit, message) = if let Some(lost) = pages_lost {
        // What made the workload fail (a read error, the agent's stop): not a limit.
        (
            ExitReason::SnapshotPagesLost,
            None,
            format!("the sandbox was stopped: {lost}"),
        )
    } else if limits.oom_kills > 0 {
        let limit = limits.memory_limit.map(quantity);
        let named = limit
            .as_deref()
            .map_or("its memory limit".to_string(), |l| {
                format!("its memory limit of {l}")
            });
        (
            ExitReason::OomKilled,
            limit,
            format!(
                "the sandbox ran out of memory: it reached {named} and the out-of-memory killer ended it; {how}"
            ),
        )
    } else if limits.pids_refused > 0 {
        let limit = limits.pids_limit.map(|p| p.to_string());
        let named = limit.as_deref().map_or("its pids limit".to_string(), |l| {
            format!("its limit of {l} processes and threads")
        });
        (
            ExitReason::PidsLimitReached,
            limit,
            format!(
                "the sandbox reached {named} ({} forks refused); {how}",
                limits.pids_refused
            ),
        )
    } else {
        match boot {
            BootExit::Exited(0) => (
                ExitReason::Completed,
                None,
                "its first process exited with code 0".into(),
            ),
            BootExit::Exited(_) | BootExit::Signaled(_) => (ExitReason::Error, None, how),
            BootExit::Panicked(_) => (ExitReason::SandboxCrashed, None, how),
            BootExit::Unknown => (
                ExitReason::Unknown,
                None,
                "the sandbox process ended without logging how its first process ended".into(),
            ),
        }
    };
    SandboxExit {
        reason,
        code,
        signal,
        limit,
        message,
        finished_at: Some(Time(Timestamp::now())),
    }
}

/// How `sb` ended, for its status (call once it stopped running). Reads files: run it
/// off the async workers.
pub fn observe(runsc: &Runsc, sb: &LocalSandbox) -> SandboxExit {
    let Ending {
        boot,
        limits,
        pages_lost,
    } = ramify_engine::exit_reason::observe(runsc, sb);
    classify(&boot, &limits, pages_lost.as_deref())
}

/// [`observe`] from a sandbox's runsc context and cgroup (what a blocking task can own).
pub fn observe_parts(runsc: &Runsc, ctx: &SandboxCtx, cgroups_path: &str) -> SandboxExit {
    let Ending {
        boot,
        limits,
        pages_lost,
    } = ramify_engine::exit_reason::observe_parts(runsc, ctx, cgroups_path);
    classify(&boot, &limits, pages_lost.as_deref())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn a_limit_hit_names_the_limit_and_wins_over_the_exit_line() {
        let oom = LimitFacts {
            oom_kills: 1,
            memory_limit: Some(256 << 20),
            ..Default::default()
        };
        let e = classify(&BootExit::Signaled(9), &oom, None);
        assert_eq!(e.reason, ExitReason::OomKilled);
        assert_eq!(e.signal, Some(9));
        assert_eq!(e.limit.as_deref(), Some("256Mi"));
        assert!(e.message.contains("256Mi"), "{}", e.message);
        assert!(e.message.contains("SIGKILL"), "{}", e.message);

        let pids = LimitFacts {
            pids_refused: 3,
            pids_limit: Some(512),
            ..Default::default()
        };
        let e = classify(&BootExit::Panicked("panic: x".into()), &pids, None);
        assert_eq!(e.reason, ExitReason::PidsLimitReached);
        assert_eq!(e.limit.as_deref(), Some("512"));
        assert!(e.message.contains("512 processes"), "{}", e.message);

        let none = LimitFacts::default();
        assert_eq!(
            classify(&BootExit::Exited(0), &none, None).reason,
            ExitReason::Completed
        );
        let e = classify(&BootExit::Exited(3), &none, None);
        assert_eq!((e.reason, e.code), (ExitReason::Error, Some(3)));
        assert!(e.message.contains("code 3"), "{}", e.message);
        assert_eq!(
            classify(&BootExit::Panicked("panic: y".into()), &none, None).reason,
            ExitReason::SandboxCrashed
        );
        assert_eq!(
            classify(&BootExit::Unknown, &none, None).reason,
            ExitReason::Unknown
        );
    }

    #[test]
    fn lost_pages_are_named_over_the_exit_line_and_any_limit() {
        let oom = LimitFacts {
            oom_kills: 1,
            ..Default::default()
        };
        let e = classify(
            &BootExit::Signaled(9),
            &oom,
            Some("the snapshot's pages file changed size under it"),
        );
        assert_eq!(e.reason, ExitReason::SnapshotPagesLost);
        assert_eq!(e.signal, Some(9));
        assert!(e.message.contains("changed size"), "{}", e.message);
    }

    #[test]
    fn quantities_are_written_as_kubernetes_does() {
        assert_eq!(quantity(256 << 20), "256Mi");
        assert_eq!(quantity(2 << 30), "2Gi");
        assert_eq!(quantity(1000), "1000");
        assert_eq!(quantity(1536 << 10), "1536Ki");
    }
}
