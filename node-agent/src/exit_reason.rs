//! Why a sandbox ended, read once its processes are gone, as the kubelet reports a
//! container's termination:
//! - the exit code or signal of its first process, from the sandbox process's own log
//!   (`runsc boot` writes "application exiting with exit status 3" or "... killed by
//!   signal 9"; nothing else keeps it once the sandbox is gone: the agent is not the
//!   sandbox process's parent, so it cannot wait for it);
//! - an out-of-memory kill, from the sandbox's memory cgroup (`memory.oom_control`
//!   counts kills; the host kernel kills a gVisor process when the sandbox exceeds its
//!   limit, and gVisor reports its first process killed by signal 9, or dies with it);
//! - the pids limit, from its pids cgroup (`pids.events` counts refused forks; gVisor
//!   stops when it cannot create a thread).
//!
//! The cgroup is runsc's per-sandbox one, which stays until the sandbox is deleted, so
//! it can be read after the exit.

use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use ramify_crds::{ExitReason, SandboxExit};

use crate::cgroup;
use crate::engine::LocalSandbox;
use crate::runsc::{Runsc, SandboxCtx};

/// How the first process ended, as the sandbox process logged it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BootExit {
    /// "application exiting with exit status N".
    Exited(i32),
    /// "application exiting with killed by signal N".
    Signaled(i32),
    /// No exit line, and runsc itself panicked (the first line of the panic).
    Panicked(String),
    /// No exit line (the sandbox process was killed, or the log is missing).
    Unknown,
}

/// What the sandbox's cgroups counted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LimitFacts {
    /// Out-of-memory kills, with the memory limit in bytes.
    pub oom_kills: u64,
    pub memory_limit: Option<u64>,
    /// Forks refused by the pids limit, with the limit.
    pub pids_refused: u64,
    pub pids_limit: Option<u64>,
}

/// Most of a boot log read: an info-level log is a few KiB, a panic's goroutine dump a
/// few MiB; the exit line is the last thing the sandbox process writes.
const MAX_LOG_BYTES: u64 = 16 << 20;

/// How the sandbox process's log says its first process ended.
pub fn parse_boot_log(log: impl Read) -> BootExit {
    let mut exit = None;
    let mut panic = None;
    for line in BufReader::new(log.take(MAX_LOG_BYTES))
        .split(b'\n')
        .map_while(Result::ok)
    {
        let line = String::from_utf8_lossy(&line);
        if let Some((_, what)) = line.split_once("application exiting with ") {
            exit = parse_exit(what.trim()).or(exit);
        } else if panic.is_none()
            && (line.starts_with("panic: ") || line.starts_with("fatal error: "))
        {
            panic = Some(line.trim().chars().take(300).collect::<String>());
        }
    }
    match (exit, panic) {
        (Some(e), _) => e,
        (None, Some(p)) => BootExit::Panicked(p),
        (None, None) => BootExit::Unknown,
    }
}

/// "exit status 3" / "killed by signal 9" (gVisor's WaitStatus text).
fn parse_exit(what: &str) -> Option<BootExit> {
    let number = |rest: &str| -> Option<i32> {
        rest.split(|c: char| !c.is_ascii_digit())
            .next()
            .and_then(|d| d.parse().ok())
    };
    if let Some(rest) = what.strip_prefix("exit status ") {
        return number(rest).map(BootExit::Exited);
    }
    if let Some(rest) = what.strip_prefix("killed by signal ") {
        return number(rest).map(BootExit::Signaled);
    }
    None
}

/// Reads the counters of `cgroups_path` (cgroup v1: `memory.oom_control`,
/// `memory.limit_in_bytes`, `pids.events`, `pids.max`). A file that cannot be read
/// counts as nothing happened: the report then rests on the log alone.
pub fn read_limits(cgroups_path: &str) -> LimitFacts {
    let read = |controller: &str, file: &str| {
        std::fs::read_to_string(cgroup::file(controller, cgroups_path, file)).ok()
    };
    let field = |text: &Option<String>, key: &str| -> u64 {
        text.as_deref()
            .and_then(|t| {
                t.lines().find_map(|l| {
                    let (k, v) = l.split_once(' ')?;
                    (k == key).then(|| v.trim().parse().ok())?
                })
            })
            .unwrap_or(0)
    };
    let oom = read("memory", "memory.oom_control");
    let pids_events = read("pids", "pids.events");
    // An unlimited memory cgroup reports a huge page-aligned number: no limit.
    let memory_limit = read("memory", "memory.limit_in_bytes")
        .and_then(|t| t.trim().parse::<u64>().ok())
        .filter(|&b| b < (1 << 62));
    let pids_limit = read("pids", "pids.max").and_then(|t| t.trim().parse().ok());
    LimitFacts {
        oom_kills: field(&oom, "oom_kill"),
        memory_limit,
        pids_refused: field(&pids_events, "max"),
        pids_limit,
    }
}

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
pub fn classify(boot: &BootExit, limits: &LimitFacts) -> SandboxExit {
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
    let (reason, limit, message) = if limits.oom_kills > 0 {
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

/// How `sb` ended (call once it stopped running). Reads files: run it off the async
/// workers.
pub fn observe(runsc: &Runsc, sb: &LocalSandbox) -> SandboxExit {
    observe_parts(runsc, sb.ctx(), sb.cgroups_path())
}

/// [`observe`] from a sandbox's runsc context and cgroup (what a blocking task can own).
pub fn observe_parts(runsc: &Runsc, ctx: &SandboxCtx, cgroups_path: &str) -> SandboxExit {
    let boot = open_log(&runsc.boot_log(ctx)).map_or(BootExit::Unknown, parse_boot_log);
    classify(&boot, &read_limits(cgroups_path))
}

/// The log, never through a symlink or a FIFO (the sandbox directory is the agent's,
/// but a hang here would stall the sandbox's reconcile).
fn open_log(path: &Path) -> Option<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .ok()?;
    f.metadata().ok()?.is_file().then_some(f)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    const EXIT3: &str =
        "I1201 15:49:10.398944       1 loader.go:1140] Process should have started...
I1201 15:49:10.915171       1 loader.go:1423] Gofer socket disconnected, killing container \"e3\"
I1201 15:49:10.915227       1 boot.go:675] application exiting with exit status 3
I1201 15:49:10.915470       1 cli.go:310] Exiting with status: 768
";

    #[test]
    fn the_boot_log_says_how_the_first_process_ended() {
        assert_eq!(parse_boot_log(EXIT3.as_bytes()), BootExit::Exited(3));
        let sig = "I1201 boot.go:675] application exiting with killed by signal 11\nI1201 cli.go:310] Exiting with status: 11\n";
        assert_eq!(parse_boot_log(sig.as_bytes()), BootExit::Signaled(11));
        // Debian's 2022 runsc words it the same way.
        let old =
            "I1201 15:49:18.713751   22013 boot.go:389] application exiting with exit status 0\n";
        assert_eq!(parse_boot_log(old.as_bytes()), BootExit::Exited(0));
        let panic = "I1201 loader.go] Process should have started...\npanic: Unknown syscall 56 error: createSysmsgThread: failed to get clone\n\ngoroutine 1 [running]:\n";
        assert!(
            matches!(parse_boot_log(panic.as_bytes()), BootExit::Panicked(p) if p.contains("createSysmsgThread"))
        );
        assert_eq!(parse_boot_log(&b""[..]), BootExit::Unknown);
    }

    #[test]
    fn a_limit_hit_names_the_limit_and_wins_over_the_exit_line() {
        let oom = LimitFacts {
            oom_kills: 1,
            memory_limit: Some(256 << 20),
            ..Default::default()
        };
        let e = classify(&BootExit::Signaled(9), &oom);
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
        let e = classify(&BootExit::Panicked("panic: x".into()), &pids);
        assert_eq!(e.reason, ExitReason::PidsLimitReached);
        assert_eq!(e.limit.as_deref(), Some("512"));
        assert!(e.message.contains("512 processes"), "{}", e.message);

        let none = LimitFacts::default();
        assert_eq!(
            classify(&BootExit::Exited(0), &none).reason,
            ExitReason::Completed
        );
        let e = classify(&BootExit::Exited(3), &none);
        assert_eq!((e.reason, e.code), (ExitReason::Error, Some(3)));
        assert!(e.message.contains("code 3"), "{}", e.message);
        assert_eq!(
            classify(&BootExit::Panicked("panic: y".into()), &none).reason,
            ExitReason::SandboxCrashed
        );
        assert_eq!(
            classify(&BootExit::Unknown, &none).reason,
            ExitReason::Unknown
        );
    }

    #[test]
    fn quantities_are_written_as_kubernetes_does() {
        assert_eq!(quantity(256 << 20), "256Mi");
        assert_eq!(quantity(2 << 30), "2Gi");
        assert_eq!(quantity(1000), "1000");
        assert_eq!(quantity(1536 << 10), "1536Ki");
    }
}
