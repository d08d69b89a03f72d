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
//! The node agent names what happened from these facts (its `exit_reason`, as the
//! kubelet's `OOMKilled`). The cgroup is runsc's per-sandbox one, which stays until the sandbox is deleted, so
//! it can be read after the exit.

use std::io::{BufRead, BufReader, Read};
use std::path::Path;

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
    read_boot_log(log).0
}

/// How its first process ended, and the loader's failure to read its pages file
/// (a lazily restored sandbox whose pages file was cut short), from the sandbox
/// process's log.
fn read_boot_log(log: impl Read) -> (BootExit, Option<String>) {
    let mut exit = None;
    let mut panic = None;
    let mut pages = None;
    for line in BufReader::new(log.take(MAX_LOG_BYTES))
        .split(b'\n')
        .map_while(Result::ok)
    {
        let line = String::from_utf8_lossy(&line);
        if pages.is_none()
            && let Some((_, what)) = line.split_once("Async page loading failed: ")
        {
            pages = Some(format!(
                "gVisor could not read a page from the snapshot's pages file ({})",
                what.trim().chars().take(300).collect::<String>()
            ));
        }
        if let Some((_, what)) = line.split_once("application exiting with ") {
            exit = parse_exit(what.trim()).or(exit);
        } else if panic.is_none()
            && (line.starts_with("panic: ") || line.starts_with("fatal error: "))
        {
            panic = Some(line.trim().chars().take(300).collect::<String>());
        }
    }
    let exit = match (exit, panic) {
        (Some(e), _) => e,
        (None, Some(p)) => BootExit::Panicked(p),
        (None, None) => BootExit::Unknown,
    };
    (exit, pages)
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

/// What a sandbox's end left behind: its boot log's last word and its cgroups' counters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ending {
    pub boot: BootExit,
    pub limits: LimitFacts,
    /// Why its lazily loaded memory was lost, if it was: the engine stopped it because
    /// its pages file changed, or gVisor failed to read a page from it.
    pub pages_lost: Option<String>,
}

/// How `sb` ended (call once it stopped running). Reads files: run it off the async
/// workers.
pub fn observe(runsc: &Runsc, sb: &LocalSandbox) -> Ending {
    observe_parts(runsc, sb.ctx(), sb.cgroups_path())
}

/// [`observe`] from a sandbox's runsc context and cgroup (what a blocking task can own).
pub fn observe_parts(runsc: &Runsc, ctx: &SandboxCtx, cgroups_path: &str) -> Ending {
    let (boot, failed_read) =
        open_log(&runsc.boot_log(ctx)).map_or((BootExit::Unknown, None), read_boot_log);
    Ending {
        boot,
        limits: read_limits(cgroups_path),
        pages_lost: crate::engine::lost_reason(ctx).or(failed_read),
    }
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
    fn the_boot_log_says_when_a_page_could_not_be_read() {
        let log = "I1207 save_restore.go:1848] Async page loading failed: read for MemoryFile(0xc0001) pages [0x1000, 0x2000) (total 4096 bytes) returned 0 bytes, error: <nil>\nI1207 boot.go:675] application exiting with killed by signal 9\n";
        let (exit, pages) = read_boot_log(log.as_bytes());
        assert_eq!(exit, BootExit::Signaled(9));
        assert!(pages.unwrap().contains("returned 0 bytes"));
        assert_eq!(read_boot_log(EXIT3.as_bytes()).1, None);
    }
}
