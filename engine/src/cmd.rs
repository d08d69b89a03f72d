//! Running host commands: always a null (or given) stdin, captured output, typed errors.

use std::ffi::OsString;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::process::Command;

use crate::error::{Error, Result};

/// Most bytes of stdout kept from one command. Commit tarballs travel on a `runsc exec`'s
/// stdout, so this is also the largest Paths commit. Anything the workload runs (its
/// `tar`, a branch's run or verdict command) writes here, so it must be bounded.
pub const MAX_STDOUT: usize = 256 << 20;
/// Most bytes of stderr kept from one command: error text, never data.
pub const MAX_STDERR: usize = 1 << 20;
/// Tail of a `log_to` file reported in place of stderr.
const LOG_TAIL: u64 = 8192;

/// Output of a finished command.
#[derive(Debug, Clone)]
pub struct Output {
    pub code: i32,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

impl Output {
    pub fn stdout_str(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }
    pub fn stderr_str(&self) -> String {
        String::from_utf8_lossy(&self.stderr).into_owned()
    }
}

/// A command line kept as data so errors can print it exactly.
#[derive(Debug, Clone)]
pub struct Cmd {
    argv: Vec<OsString>,
    timeout: Duration,
    stdin_file: Option<std::path::PathBuf>,
    stdin_bytes: Option<Vec<u8>>,
    log_file: Option<std::path::PathBuf>,
    env: Vec<(OsString, OsString)>,
    max_stdout: usize,
    max_stderr: usize,
    /// Keep the last `max_*` bytes of each stream instead of failing past them.
    tail_only: bool,
}

impl Cmd {
    pub fn new(program: impl Into<OsString>) -> Self {
        Cmd {
            argv: vec![program.into()],
            timeout: Duration::from_secs(120),
            stdin_file: None,
            stdin_bytes: None,
            log_file: None,
            env: Vec::new(),
            max_stdout: MAX_STDOUT,
            max_stderr: MAX_STDERR,
            tail_only: false,
        }
    }

    /// Lower (or raise) the output caps: a command writing more than `stdout` or
    /// `stderr` bytes is killed and fails with [`Error::OutputTooLarge`].
    /// Keep only the last `stdout` / `stderr` bytes of each stream, however much the
    /// command writes (a workload's own command: its output volume is its business,
    /// the agent's memory is not).
    pub fn keep_tail(mut self, stdout: usize, stderr: usize) -> Self {
        self.max_stdout = stdout;
        self.max_stderr = stderr;
        self.tail_only = true;
        self
    }

    pub fn max_output(mut self, stdout: usize, stderr: usize) -> Self {
        self.max_stdout = stdout;
        self.max_stderr = stderr;
        self
    }

    pub fn arg(mut self, a: impl Into<OsString>) -> Self {
        self.argv.push(a.into());
        self
    }

    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        self.argv.extend(args.into_iter().map(Into::into));
        self
    }

    pub fn env(mut self, k: impl Into<OsString>, v: impl Into<OsString>) -> Self {
        self.env.push((k.into(), v.into()));
        self
    }

    pub fn timeout(mut self, t: Duration) -> Self {
        self.timeout = t;
        self
    }

    /// Feed these bytes as stdin instead of /dev/null (a batch for `iptables-restore`
    /// or `ip -batch -`: one process instead of one per step).
    pub fn stdin_bytes(mut self, b: impl Into<Vec<u8>>) -> Self {
        self.stdin_bytes = Some(b.into());
        self
    }

    /// Feed this file as stdin instead of /dev/null.
    pub fn stdin_file(mut self, p: &Path) -> Self {
        self.stdin_file = Some(p.to_path_buf());
        self
    }

    /// Send stdout and stderr to a file instead of pipes. Needed for `runsc run` and
    /// `restore --detach`: the sandbox inherits them and keeps them open for its
    /// whole life, so reading a pipe to EOF would wait for the sandbox to exit.
    pub fn log_to(mut self, p: &Path) -> Self {
        self.log_file = Some(p.to_path_buf());
        self
    }

    /// Prefix this command line with another (e.g. `nsenter --net=...`).
    pub fn wrapped_in(self, prefix: Vec<OsString>) -> Self {
        let mut argv = prefix;
        argv.extend(self.argv);
        Cmd { argv, ..self }
    }

    pub fn display(&self) -> String {
        self.argv
            .iter()
            .map(|a| {
                let s = a.to_string_lossy();
                if s.is_empty() || s.contains(|c: char| c.is_whitespace() || c == '\'' || c == '"')
                {
                    format!("'{}'", s.replace('\'', "'\\''"))
                } else {
                    s.into_owned()
                }
            })
            .collect::<Vec<_>>()
            .join(" ")
    }

    fn build(&self) -> Result<Command> {
        let Some((prog, rest)) = self.argv.split_first() else {
            return Err(Error::Invalid("empty command line".into()));
        };
        let mut c = Command::new(prog);
        c.args(rest);
        for (k, v) in &self.env {
            c.env(k, v);
        }
        match &self.stdin_file {
            Some(p) => {
                let f = std::fs::File::open(p).map_err(|e| Error::io("open stdin", p, e))?;
                c.stdin(Stdio::from(f));
            }
            None if self.stdin_bytes.is_some() => {
                c.stdin(Stdio::piped());
            }
            None => {
                c.stdin(Stdio::null());
            }
        }
        match &self.log_file {
            Some(p) => {
                let f = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(p)
                    .map_err(|e| Error::io("open log", p, e))?;
                let f2 = f.try_clone().map_err(|e| Error::io("dup log", p, e))?;
                c.stdout(Stdio::from(f)).stderr(Stdio::from(f2));
            }
            None => {
                c.stdout(Stdio::piped()).stderr(Stdio::piped());
            }
        }
        c.kill_on_drop(true);
        Ok(c)
    }

    /// Run to completion and return the output whatever the exit code.
    pub async fn output(&self) -> Result<Output> {
        let log_start = self
            .log_file
            .as_ref()
            .and_then(|p| std::fs::metadata(p).ok())
            .map_or(0, |m| m.len());
        let started = std::time::Instant::now();
        let mut c = self.build()?;
        let mut child = c.spawn().map_err(|source| {
            if source.kind() == std::io::ErrorKind::NotFound {
                Error::MissingTool(self.argv[0].to_string_lossy().into_owned())
            } else {
                Error::Spawn {
                    command: self.display(),
                    source,
                }
            }
        })?;
        let (out, err) = (child.stdout.take(), child.stderr.take());
        let stdin = child.stdin.take();
        let feed = async {
            if let (Some(mut w), Some(bytes)) = (stdin, &self.stdin_bytes) {
                // A child that exits without reading all of it closes the pipe: its
                // exit code says what went wrong, not this write.
                let _ = w.write_all(bytes).await;
            }
            Ok(())
        };
        let finished = async {
            // Both pipes are drained together (a child blocked on a full stderr pipe
            // would never close stdout), each up to its cap, while stdin is fed.
            let (stdout, stderr, ()) = tokio::try_join!(
                read_capped(out, self.max_stdout, "stdout", self.tail_only),
                read_capped(err, self.max_stderr, "stderr", self.tail_only),
                feed,
            )?;
            let status = child.wait().await.map_err(Capped::Io)?;
            Ok::<_, Capped>((status, stdout, stderr))
        };
        let (status, stdout, mut stderr) = match tokio::time::timeout(self.timeout, finished).await
        {
            Err(_) => {
                return Err(Error::Timeout {
                    command: self.display(),
                    seconds: self.timeout.as_secs(),
                });
            }
            Ok(Err(Capped::Io(source))) => {
                return Err(Error::Spawn {
                    command: self.display(),
                    source,
                });
            }
            Ok(Err(Capped::Over { stream, limit })) => {
                // Stop the writer now instead of draining it; the child is reaped by
                // tokio once it is dead (kill_on_drop covers the error paths above).
                let _ = child.start_kill();
                let _ = child.wait().await;
                return Err(Error::OutputTooLarge {
                    command: self.display(),
                    stream,
                    limit,
                });
            }
            Ok(Ok(r)) => r,
        };
        // Where a fork's time goes, command by command (RUST_LOG=ramify_node_agent::cmd=debug).
        tracing::debug!(
            took_ms = started.elapsed().as_secs_f64() * 1000.0,
            code = status.code(),
            command = %self.display(),
            "command finished"
        );
        if let Some(p) = &self.log_file {
            // What this invocation appended (its last LOG_TAIL bytes), standing in for
            // stderr. Only the tail is read: the sandbox's console output goes to the
            // same file and may be arbitrarily large.
            if let Some(tail) = read_tail(p, log_start, LOG_TAIL) {
                stderr = tail;
            }
        }
        Ok(Output {
            // A signal death has no code; report it as 128+signal like a shell.
            code: status.code().unwrap_or_else(|| {
                use std::os::unix::process::ExitStatusExt;
                128 + status.signal().unwrap_or(0)
            }),
            stdout,
            stderr,
        })
    }

    /// Start it with stdout and stderr piped to the caller, who reads them as they
    /// come (a streamed exec) and reaps it; dropping the child kills it.
    pub fn spawn(&self) -> Result<tokio::process::Child> {
        self.build()?.spawn().map_err(|source| Error::Spawn {
            command: self.display(),
            source,
        })
    }

    /// Start it with the given stdio (an interactive exec: a terminal, or a piped
    /// stdin); dropping the child kills it.
    pub fn spawn_with(
        &self,
        stdin: Stdio,
        stdout: Stdio,
        stderr: Stdio,
    ) -> Result<tokio::process::Child> {
        let mut c = self.build()?;
        c.stdin(stdin).stdout(stdout).stderr(stderr);
        c.spawn().map_err(|source| Error::Spawn {
            command: self.display(),
            source,
        })
    }

    /// Run and require exit code 0.
    pub async fn run(&self) -> Result<Output> {
        let out = self.output().await?;
        if out.code != 0 {
            return Err(Error::Command {
                command: self.display(),
                status: format!("exit code {}", out.code),
                stderr: out.stderr_str().trim().to_string(),
            });
        }
        Ok(out)
    }
}

/// Why reading a child's pipe stopped early.
enum Capped {
    Io(std::io::Error),
    Over { stream: &'static str, limit: usize },
}

/// Everything from `pipe` (none: empty), failing as soon as it exceeds `limit` bytes.
/// Never holds more than `limit` bytes: the chunk that would cross it is not kept.
async fn read_capped(
    pipe: Option<impl AsyncRead + Unpin>,
    limit: usize,
    stream: &'static str,
    tail_only: bool,
) -> std::result::Result<Vec<u8>, Capped> {
    let mut buf = Vec::new();
    let Some(mut pipe) = pipe else {
        return Ok(buf);
    };
    let mut chunk = vec![0u8; 64 << 10];
    loop {
        let n = pipe.read(&mut chunk).await.map_err(Capped::Io)?;
        if n == 0 {
            return Ok(buf);
        }
        if buf.len().saturating_add(n) > limit {
            if !tail_only {
                return Err(Capped::Over { stream, limit });
            }
            // Drop the oldest bytes: what is kept never exceeds `limit`.
            let keep = &chunk[n.saturating_sub(limit)..n];
            let drop = (buf.len() + keep.len()).saturating_sub(limit);
            buf.drain(..drop);
            buf.extend_from_slice(keep);
            continue;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// At most the last `max` bytes of `path` past offset `from`.
fn read_tail(path: &Path, from: u64, max: u64) -> Option<Vec<u8>> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(path).ok()?;
    let len = f.metadata().ok()?.len();
    let start = from.min(len).max(len.saturating_sub(max));
    f.seek(SeekFrom::Start(start)).ok()?;
    let mut out = Vec::new();
    f.take(max).read_to_end(&mut out).ok()?;
    Some(out)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    /// Peak resident memory of this process (VmHWM), in bytes.
    fn peak_rss() -> u64 {
        let s = std::fs::read_to_string("/proc/self/status").unwrap();
        let kb: u64 = s
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap();
        kb * 1024
    }

    #[tokio::test]
    async fn endless_stdout_is_cut_at_the_cap_with_a_typed_error() {
        // `yes` never stops: without a cap this buffers until the timeout (or OOM).
        let before = peak_rss();
        let t = std::time::Instant::now();
        let err = Cmd::new("yes")
            .timeout(Duration::from_secs(60))
            .output()
            .await
            .expect_err("endless output accepted");
        let took = t.elapsed();
        match &err {
            Error::OutputTooLarge { stream, limit, .. } => {
                assert_eq!(*stream, "stdout");
                assert_eq!(*limit, MAX_STDOUT);
            }
            other => panic!("expected OutputTooLarge, got {other}"),
        }
        let msg = err.to_string();
        assert!(
            msg.contains(&format!("more than {MAX_STDOUT} bytes")) && msg.contains("yes"),
            "{msg}"
        );
        let grown = peak_rss().saturating_sub(before);
        eprintln!("{msg} after {took:?}; peak RSS grew by {grown} bytes");
        // The buffer holds at most the cap (plus a 64 KiB read chunk and allocator slack).
        assert!(
            grown <= (MAX_STDOUT as u64) + (32 << 20),
            "peak RSS grew by {grown} bytes for a {MAX_STDOUT}-byte cap"
        );
        assert!(took < Duration::from_secs(60), "took {took:?}");
    }

    #[tokio::test]
    async fn output_up_to_the_cap_is_kept_and_one_byte_more_is_refused() {
        let cap = 100_000;
        let sh = |n: usize| {
            Cmd::new("sh")
                .args(["-c", &format!("head -c {n} /dev/zero")])
                .max_output(cap, 1000)
        };
        let out = sh(cap).output().await.unwrap();
        assert_eq!(out.code, 0);
        assert_eq!(out.stdout.len(), cap);
        let err = sh(cap + 1).output().await.expect_err("over the cap");
        assert!(
            matches!(err, Error::OutputTooLarge { stream: "stdout", limit, .. } if limit == cap),
            "{err}"
        );
        // stderr has its own cap; the child is killed, not waited for.
        let t = std::time::Instant::now();
        let err = Cmd::new("sh")
            .args(["-c", "head -c 5000 /dev/zero >&2; sleep 30"])
            .max_output(cap, 1000)
            .output()
            .await
            .expect_err("stderr over the cap");
        assert!(
            matches!(
                err,
                Error::OutputTooLarge {
                    stream: "stderr",
                    limit: 1000,
                    ..
                }
            ),
            "{err}"
        );
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "waited for the child"
        );
        assert!(
            err.to_string().contains("more than 1000 bytes to stderr"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn a_huge_log_file_is_reported_by_its_tail() {
        let d = tempfile::tempdir().unwrap();
        let log = d.path().join("console.log");
        let out = Cmd::new("sh")
            .args(["-c", "head -c 3000000 /dev/zero; echo the-end >&2; exit 3"])
            .log_to(&log)
            .output()
            .await
            .unwrap();
        assert_eq!(out.code, 3);
        assert!(out.stderr.len() as u64 <= LOG_TAIL);
        assert!(String::from_utf8_lossy(&out.stderr).ends_with("the-end\n"));
    }

    #[tokio::test]
    async fn stdin_bytes_reach_the_child_and_a_child_that_ignores_them_is_fine() {
        // 4 MiB: more than a pipe holds, so feeding and draining must overlap.
        let big = vec![b'x'; 4 << 20];
        let out = Cmd::new("cat")
            .stdin_bytes(big.clone())
            .run()
            .await
            .unwrap();
        assert_eq!(out.stdout, big);
        let out = Cmd::new("sh")
            .args(["-c", "exit 4"])
            .stdin_bytes(big)
            .output()
            .await
            .unwrap();
        assert_eq!(out.code, 4);
    }

    #[tokio::test]
    async fn keep_tail_keeps_the_last_bytes_of_any_amount_and_never_fails() {
        // 3 MiB of numbered lines through a 10 000-byte tail: the end survives, the
        // start does not, the exit code is the command's.
        let out = Cmd::new("sh")
            .args(["-c", "seq 1 400000; echo done >&2; exit 3"])
            .keep_tail(10_000, 3)
            .output()
            .await
            .unwrap();
        assert_eq!(out.code, 3);
        assert_eq!(out.stdout.len(), 10_000);
        let text = out.stdout_str();
        assert!(
            text.ends_with("399999\n400000\n"),
            "{}",
            &text[text.len() - 20..]
        );
        assert!(!text.contains("\n1000\n"));
        assert_eq!(out.stderr, b"ne\n");
    }
}
