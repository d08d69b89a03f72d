//! A sandbox's console log as the endpoint serves it (`kubectl ramify logs`): all of
//! it, or its last `tailLines` lines, and with `follow` what it prints next, as it
//! comes, until the sandbox stops running or the client goes. The query parameters
//! are a Pod log's (`PodLogOptions`).

use std::io::{Read, Seek, SeekFrom};
use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use futures::Stream;
use tokio::io::AsyncReadExt;

/// How often a followed log is read again once it reached its end.
const FOLLOW_POLL: Duration = Duration::from_millis(200);
/// Every this many empty polls, whether the sandbox still runs is asked.
const ALIVE_EVERY: u32 = 10;

/// What the client asked for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LogOptions {
    pub follow: bool,
    pub tail_lines: Option<u64>,
}

impl LogOptions {
    /// From the query's `follow` (`true`/`1`) and `tailLines` (a count); a `tailLines`
    /// that is no count is refused with what was wrong.
    pub fn parse(follow: &[String], tail_lines: &[String]) -> Result<LogOptions, String> {
        let follow = follow.iter().any(|v| v == "true" || v == "1");
        let tail_lines = match tail_lines.last() {
            None => None,
            Some(v) => Some(
                v.parse::<u64>()
                    .map_err(|_| format!("tailLines must be a count of lines, not {v:?}"))?,
            ),
        };
        Ok(LogOptions { follow, tail_lines })
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
                match open_at(&s.path, s.opts.tail_lines) {
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

/// The log opened at the start of its last `tail` lines; None when there is none yet.
fn open_at(path: &PathBuf, tail: Option<u64>) -> std::io::Result<Option<std::fs::File>> {
    let mut f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let from = match tail {
        Some(n) => tail_offset(&mut f, n)?,
        None => 0,
    };
    f.seek(SeekFrom::Start(from))?;
    Ok(Some(f))
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

    #[test]
    fn options_are_a_pod_logs() {
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        assert_eq!(
            LogOptions::parse(&s(&["true"]), &s(&["5"])),
            Ok(LogOptions {
                follow: true,
                tail_lines: Some(5)
            })
        );
        assert_eq!(LogOptions::parse(&[], &[]), Ok(LogOptions::default()));
        assert!(matches!(
            LogOptions::parse(&[], &s(&["-1"])),
            Err(why) if why.contains("tailLines")
        ));
    }

    #[tokio::test]
    async fn following_shows_what_comes_and_ends_when_the_sandbox_stops() {
        let (_d, path) = log_with("first\n");
        let alive = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        let a = alive.clone();
        let opts = LogOptions {
            follow: true,
            tail_lines: None,
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
