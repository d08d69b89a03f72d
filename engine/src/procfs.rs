//! Host processes as `/proc` shows them: which pids mention a string on their command
//! line, and a live process's start time (a pid plus it names one process for good).

/// Start time (clock ticks since boot, field 22 of `/proc/<pid>/stat`) of a live
/// process; `None` once it is gone or a zombie. With the pid it names one process for
/// good: a recycled pid has another start time.
pub fn proc_start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: fields after the
    // last ')' are plain.
    let mut rest = stat.rsplit_once(')')?.1.split_whitespace();
    let state = rest.next()?;
    if state == "Z" || state == "X" {
        return None;
    }
    rest.nth(18)?.parse().ok()
}

/// Pids whose command line mentions `needle` (runsc's sandbox and gofer processes
/// carry their --root, which contains the sandbox id).
pub fn pids_mentioning(needle: &str) -> Vec<i32> {
    let me = std::process::id() as i32;
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()))
        .filter(|&pid| pid != me)
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| String::from_utf8_lossy(&c).contains(needle))
                .unwrap_or(false)
        })
        .collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn a_process_start_time_is_stable_and_a_zombie_has_none() {
        let me = i32::try_from(std::process::id()).unwrap();
        let t = proc_start_time(me).expect("this process is alive");
        assert_eq!(proc_start_time(me), Some(t));
        // An exited child that is not reaped yet is a zombie: not alive.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = i32::try_from(child.id()).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while proc_start_time(pid).is_some() {
            assert!(Instant::now() < deadline, "child never exited");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(
            std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| s.contains(") Z "))
        );
        child.wait().unwrap();
        assert_eq!(proc_start_time(pid), None);
    }
}
