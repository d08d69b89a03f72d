//! A sandbox's console log as the endpoint serves it (`kubectl ramify logs`): all of
//! it, what it printed since `sinceSeconds` or `sinceTime`, or its last `tailLines`
//! lines of that, and with `follow` what it prints next, as it comes, until the
//! sandbox stops running or the client goes. The query parameters are a Pod log's
//! (`PodLogOptions`). The times come from the agent's index beside the log
//! ([`ramify_engine::console_times`]), which [`Agent::time_console_logs`] keeps.

use std::collections::{HashMap, HashSet};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use futures::Stream;
use ramify_engine::console_times;
use tokio::io::AsyncReadExt;
use tracing::warn;

use super::Agent;

/// How often a followed log is read again once it reached its end.
const FOLLOW_POLL: Duration = Duration::from_millis(200);
/// Every this many empty polls, whether the sandbox still runs is asked.
const ALIVE_EVERY: u32 = 10;
/// How often the length of every held sandbox's console log is sampled: the
/// precision of `since`.
const SAMPLE_EVERY: Duration = Duration::from_secs(1);

/// What the client asked for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LogOptions {
    pub follow: bool,
    pub tail_lines: Option<u64>,
    /// Only what was printed from this time on.
    pub since: Option<SystemTime>,
}

impl LogOptions {
    /// From the query's `follow` (`true`/`1`), `tailLines` (a count), and at most one
    /// of `sinceSeconds` (a positive count of seconds before `now`) and `sinceTime` (an
    /// RFC 3339 time), as `query` gives each parameter's values. Anything else is
    /// refused with the parameter and what was wrong.
    pub fn parse(
        query: impl Fn(&str) -> Vec<String>,
        now: SystemTime,
    ) -> Result<LogOptions, String> {
        let follow = query("follow").iter().any(|v| v == "true" || v == "1");
        let tail_lines = match query("tailLines").last() {
            None => None,
            Some(v) => Some(
                v.parse::<u64>()
                    .map_err(|_| format!("tailLines must be a count of lines, not {v:?}"))?,
            ),
        };
        let since = match (query("sinceSeconds").last(), query("sinceTime").last()) {
            (Some(_), Some(_)) => {
                return Err("at most one of sinceSeconds and sinceTime may be given".into());
            }
            (Some(v), None) => match v.parse::<u64>() {
                Ok(secs) if secs > 0 => Some(console_times::seconds_before(now, secs)),
                _ => {
                    return Err(format!(
                        "sinceSeconds must be a positive count of seconds, not {v:?}"
                    ));
                }
            },
            (None, Some(v)) => Some(SystemTime::from(
                v.parse::<k8s_openapi::jiff::Timestamp>().map_err(|e| {
                    format!("sinceTime must be an RFC 3339 time like 2026-12-07T17:00:00Z, not {v:?}: {e}")
                })?,
            )),
            (None, None) => None,
        };
        Ok(LogOptions {
            follow,
            tail_lines,
            since,
        })
    }
}

/// The offset where the last `lines` lines of `f` start (a last line without its
/// newline counts as a line), reading backwards from the end in blocks: a long log
/// costs what its tail does.
pub fn tail_offset(f: &mut std::fs::File, lines: u64) -> std::io::Result<u64> {
    const BLOCK: u64 = 64 << 10;
    let len = f.seek(SeekFrom::End(0))?;
    if lines == 0 {
        return Ok(len);
    }
    let mut end = len;
    let mut newlines = 0u64;
    let mut buf = vec![0u8; BLOCK as usize];
    let mut skip_last = true; // the newline that ends the log ends its last line
    while end > 0 {
        let start = end.saturating_sub(BLOCK);
        let n = (end - start) as usize;
        f.seek(SeekFrom::Start(start))?;
        f.read_exact(&mut buf[..n])?;
        for i in (0..n).rev() {
            if buf[i] != b'\n' {
                skip_last = false;
                continue;
            }
            if skip_last && start + i as u64 == len - 1 {
                skip_last = false;
                continue;
            }
            newlines += 1;
            if newlines == lines {
                return Ok(start + i as u64 + 1);
            }
        }
        end = start;
    }
    Ok(0)
}

/// The log's bytes from where `opts` says, then (following) what is appended, until
/// `alive` says the sandbox stopped and the end is read.
pub fn stream<F, Fut>(
    path: PathBuf,
    opts: LogOptions,
    alive: F,
) -> impl Stream<Item = std::io::Result<Bytes>>
where
    F: Fn() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = bool> + Send,
{
    struct State<F> {
        path: PathBuf,
        file: Option<tokio::fs::File>,
        opts: LogOptions,
        alive: F,
        empty_polls: u32,
        ending: bool,
    }
    let state = State {
        path,
        file: None,
        opts,
        alive,
        empty_polls: 0,
        ending: false,
    };
    futures::stream::unfold(state, |mut s| async move {
        loop {
            if s.file.is_none() {
                match open_at(&s.path, s.opts.tail_lines, s.opts.since) {
                    Ok(Some(f)) => s.file = Some(tokio::fs::File::from_std(f)),
                    // Nothing printed yet: an empty log, or wait for one.
                    Ok(None) if !s.opts.follow || s.ending => return None,
                    Ok(None) => {}
                    Err(e) => return Some((Err(e), s)),
                }
            }
            if let Some(f) = s.file.as_mut() {
                let mut buf = vec![0u8; 64 << 10];
                match f.read(&mut buf).await {
                    Ok(0) => {}
                    Ok(n) => {
                        buf.truncate(n);
                        s.empty_polls = 0;
                        return Some((Ok(Bytes::from(buf)), s));
                    }
                    Err(e) => return Some((Err(e), s)),
                }
            }
            // At the end of what is written.
            if !s.opts.follow || s.ending {
                return None;
            }
            s.empty_polls += 1;
            if s.empty_polls % ALIVE_EVERY == 0 && !(s.alive)().await {
                // One more read catches what it printed before it stopped.
                s.ending = true;
                continue;
            }
            tokio::time::sleep(FOLLOW_POLL).await;
        }
    })
}

/// The log opened at the start of what it printed since `since`, or of its last `tail`
/// lines of that; None when there is none yet.
fn open_at(
    path: &Path,
    tail: Option<u64>,
    since: Option<SystemTime>,
) -> std::io::Result<Option<std::fs::File>> {
    let mut f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let since = match since {
        Some(t) => console_times::since_offset(path, &mut f, t)?,
        None => 0,
    };
    let tail = match tail {
        Some(n) => tail_offset(&mut f, n)?,
        None => 0,
    };
    f.seek(SeekFrom::Start(since.max(tail)))?;
    Ok(Some(f))
}

/// The time index of the console logs of the sandboxes held here, kept by sampling
/// their lengths: the length each log had at its last record.
#[derive(Default)]
pub struct ConsoleClock {
    seen: HashMap<PathBuf, u64>,
}

impl ConsoleClock {
    /// One round at `now_ms` over `logs`, the console logs of the sandboxes held now:
    /// each that grew since its last record gets one. A log seen for the first time
    /// (a restarted agent) is compared with its index's last record; the logs of
    /// sandboxes gone are forgotten.
    pub fn round(&mut self, logs: &[PathBuf], now_ms: u64) {
        for log in logs {
            let Ok(len) = std::fs::metadata(log).map(|m| m.len()) else {
                continue; // nothing printed yet
            };
            let index = console_times::index_path(log);
            let last = match self.seen.get(log) {
                Some(l) => *l,
                None => console_times::last_length(&index).unwrap_or(0),
            };
            if len == last {
                self.seen.insert(log.clone(), last);
                continue;
            }
            match console_times::record(&index, now_ms, len) {
                Ok(()) => {
                    self.seen.insert(log.clone(), len);
                }
                Err(e) => {
                    warn!(log = %log.display(), error = %e, "recording when the console log grew failed");
                }
            }
        }
        let held: HashSet<&PathBuf> = logs.iter().collect();
        self.seen.retain(|l, _| held.contains(l));
    }
}

impl Agent {
    /// Every [`SAMPLE_EVERY`], a [`ConsoleClock`] round over the held sandboxes' logs.
    pub(super) async fn time_console_logs(self: Arc<Self>) {
        let mut clock = ConsoleClock::default();
        loop {
            tokio::time::sleep(SAMPLE_EVERY).await;
            let logs: Vec<PathBuf> = self
                .held
                .all()
                .into_iter()
                .filter_map(|(_, h)| {
                    // Busy (a commit, a resume): sampled next time.
                    h.try_lock()
                        .ok()
                        .and_then(|g| g.as_ref().map(|sb| self.engine.log_path(sb)))
                })
                .collect();
            clock.round(&logs, console_times::millis(SystemTime::now()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;
    use std::io::Write;

    fn log_with(text: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let path = dir.path().join("console.log");
        std::fs::write(&path, text).unwrap_or_else(|e| panic!("{e}"));
        (dir, path)
    }

    fn tail(text: &str, n: u64) -> String {
        let (_d, path) = log_with(text);
        let mut f = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{e}"));
        let at = tail_offset(&mut f, n).unwrap_or_else(|e| panic!("{e}"));
        text[at as usize..].to_string()
    }

    #[test]
    fn the_last_lines_are_the_tail() {
        assert_eq!(tail("a\nb\nc\n", 2), "b\nc\n");
        assert_eq!(
            tail("a\nb\nc", 2),
            "b\nc",
            "a last line without its newline counts"
        );
        assert_eq!(tail("a\nb\nc\n", 10), "a\nb\nc\n");
        assert_eq!(tail("a\nb\nc\n", 0), "");
        assert_eq!(tail("", 3), "");
        assert_eq!(tail("\n\n", 1), "\n");
        // Across the 64 KiB blocks it reads backwards.
        let long: String = (0..20_000).map(|i| format!("line {i}\n")).collect();
        assert_eq!(tail(&long, 3), "line 19997\nline 19998\nline 19999\n");
        assert_eq!(tail(&long, 20_000), long);
    }

    fn parse(q: &[(&str, &str)]) -> Result<LogOptions, String> {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        LogOptions::parse(
            |k| {
                q.iter()
                    .filter(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
                    .collect()
            },
            now,
        )
    }

    #[test]
    fn options_are_a_pod_logs() {
        assert_eq!(
            parse(&[("follow", "true"), ("tailLines", "5")]),
            Ok(LogOptions {
                follow: true,
                tail_lines: Some(5),
                since: None,
            })
        );
        assert_eq!(parse(&[]), Ok(LogOptions::default()));
        assert!(matches!(
            parse(&[("tailLines", "-1")]),
            Err(why) if why.contains("tailLines")
        ));
        let epoch = SystemTime::UNIX_EPOCH;
        assert_eq!(
            parse(&[("sinceSeconds", "60")]).map(|o| o.since),
            Ok(Some(epoch + Duration::from_secs(1_000_000 - 60)))
        );
        assert_eq!(
            parse(&[("sinceTime", "1970-01-01T00:01:40.5Z")]).map(|o| o.since),
            Ok(Some(epoch + Duration::from_millis(100_500)))
        );
        for bad in [
            vec![("sinceSeconds", "0")],
            vec![("sinceSeconds", "-5")],
            vec![("sinceSeconds", "5m")],
        ] {
            assert!(
                matches!(parse(&bad), Err(why) if why.contains("sinceSeconds")),
                "{bad:?}"
            );
        }
        assert!(matches!(
            parse(&[("sinceTime", "yesterday")]),
            Err(why) if why.contains("sinceTime") && why.contains("RFC 3339")
        ));
        assert!(matches!(
            parse(&[("sinceSeconds", "5"), ("sinceTime", "1970-01-01T00:01:40Z")]),
            Err(why) if why.contains("at most one")
        ));
    }

    #[test]
    fn since_and_tail_together_give_the_last_lines_of_what_came_since() {
        let (_d, path) = log_with("early 1\nearly 2\nlate 1\nlate 2\nlate 3\n");
        let index = console_times::index_path(&path);
        console_times::record(&index, 1_000, 16).unwrap_or_else(|e| panic!("{e}"));
        console_times::record(&index, 2_000, 37).unwrap_or_else(|e| panic!("{e}"));
        let read = |tail: Option<u64>, since_ms: u64| {
            let since = SystemTime::UNIX_EPOCH + Duration::from_millis(since_ms);
            let mut f = open_at(&path, tail, Some(since))
                .unwrap_or_else(|e| panic!("{e}"))
                .unwrap_or_else(|| panic!("no log"));
            let mut s = String::new();
            f.read_to_string(&mut s).unwrap_or_else(|e| panic!("{e}"));
            s
        };
        assert_eq!(read(None, 1_500), "late 1\nlate 2\nlate 3\n");
        assert_eq!(read(Some(2), 1_500), "late 2\nlate 3\n");
        assert_eq!(
            read(Some(10), 1_500),
            "late 1\nlate 2\nlate 3\n",
            "no further back than since"
        );
        assert_eq!(
            read(None, 500),
            "early 1\nearly 2\nlate 1\nlate 2\nlate 3\n"
        );
        assert_eq!(read(None, 2_000), "", "nothing printed since");
    }

    #[test]
    fn the_clock_records_a_log_when_it_grew_and_picks_up_after_a_restart() {
        let (_d, path) = log_with("one\n");
        let index = console_times::index_path(&path);
        let records = || std::fs::metadata(&index).map(|m| m.len() / 16).unwrap_or(0);
        let logs = vec![path.clone()];
        let mut clock = ConsoleClock::default();
        clock.round(&logs, 1_000);
        clock.round(&logs, 2_000);
        assert_eq!(records(), 1, "one record while it did not grow");
        std::fs::write(&path, "one\ntwo\n").unwrap_or_else(|e| panic!("{e}"));
        clock.round(&logs, 3_000);
        assert_eq!(records(), 2);
        assert_eq!(console_times::length_at(&index, 2_999).ok(), Some(4));
        assert_eq!(console_times::length_at(&index, 3_000).ok(), Some(8));
        // A restarted agent's clock: no second record of the same length.
        let mut again = ConsoleClock::default();
        again.round(&logs, 4_000);
        assert_eq!(records(), 2);
        // Its sandbox gone, the log is forgotten.
        again.round(&[], 5_000);
        assert!(again.seen.is_empty());
    }

    #[tokio::test]
    async fn following_shows_what_comes_and_ends_when_the_sandbox_stops() {
        let (_d, path) = log_with("first\n");
        let alive = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        let a = alive.clone();
        let opts = LogOptions {
            follow: true,
            ..LogOptions::default()
        };
        let mut s = Box::pin(stream(path.clone(), opts, move || {
            let a = a.clone();
            async move { a.load(std::sync::atomic::Ordering::SeqCst) }
        }));
        let first = s.next().await.and_then(Result::ok);
        assert_eq!(first.as_deref(), Some(&b"first\n"[..]));
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap_or_else(|e| panic!("{e}"));
        f.write_all(b"second\n").unwrap_or_else(|e| panic!("{e}"));
        let second = s.next().await.and_then(Result::ok);
        assert_eq!(second.as_deref(), Some(&b"second\n"[..]));
        f.write_all(b"last words\n")
            .unwrap_or_else(|e| panic!("{e}"));
        alive.store(false, std::sync::atomic::Ordering::SeqCst);
        let mut rest = Vec::new();
        while let Some(chunk) = s.next().await {
            rest.extend_from_slice(&chunk.unwrap_or_else(|e| panic!("{e}")));
        }
        assert_eq!(
            rest, b"last words\n",
            "what it printed before it stopped, then the end"
        );
    }
}
