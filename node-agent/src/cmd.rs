//! Running host commands: always a null (or given) stdin, captured output, typed errors.

use std::ffi::OsString;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use tokio::process::Command;

use crate::error::{Error, Result};

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
    log_file: Option<std::path::PathBuf>,
    env: Vec<(OsString, OsString)>,
}

impl Cmd {
    pub fn new(program: impl Into<OsString>) -> Self {
        Cmd {
            argv: vec![program.into()],
            timeout: Duration::from_secs(120),
            stdin_file: None,
            log_file: None,
            env: Vec::new(),
        }
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
        let mut c = self.build()?;
        let child = c.spawn().map_err(|source| {
            if source.kind() == std::io::ErrorKind::NotFound {
                Error::MissingTool(self.argv[0].to_string_lossy().into_owned())
            } else {
                Error::Spawn {
                    command: self.display(),
                    source,
                }
            }
        })?;
        let out = tokio::time::timeout(self.timeout, child.wait_with_output())
            .await
            .map_err(|_| Error::Timeout {
                command: self.display(),
                seconds: self.timeout.as_secs(),
            })?
            .map_err(|source| Error::Spawn {
                command: self.display(),
                source,
            })?;
        let mut stderr = out.stderr;
        if let Some(p) = &self.log_file {
            // What this invocation appended (bounded), standing in for stderr.
            if let Ok(all) = std::fs::read(p) {
                let from = (log_start as usize)
                    .min(all.len())
                    .max(all.len().saturating_sub(8192));
                stderr = all[from..].to_vec();
            }
        }
        Ok(Output {
            // A signal death has no code; report it as 128+signal like a shell.
            code: out.status.code().unwrap_or_else(|| {
                use std::os::unix::process::ExitStatusExt;
                128 + out.status.signal().unwrap_or(0)
            }),
            stdout: out.stdout,
            stderr,
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
