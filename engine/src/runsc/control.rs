//! The sandbox's own control socket: pause, resume and "is it paused" without starting
//! a `runsc` process.
//!
//! Every `runsc pause` or `runsc resume` starts a Go program that reads the container's
//! state file, connects to the sandbox's control server, makes one call and rewrites
//! the state file: about 20 ms on an idle machine, 120-140 ms when four share 2 cores,
//! nearly all of it process start-up. The call itself is a JSON message on a Unix
//! socket (gVisor's urpc) and takes well under a millisecond. A warm claim is one
//! resume, so the agent makes that call itself.
//!
//! Pauses nest in the sandbox's kernel and a resume of a running kernel panics it, so
//! the agent must know the state before it acts. `runsc` keeps it in its state file;
//! the agent asks the sandbox instead (`containerManager.IsPaused`, added to the pinned
//! runsc by `hack/runsc/patches/0003-control-is-paused.patch`). A runsc without that
//! method (Debian's, an unpatched build) answers "unknown method", and the agent goes
//! on with the CLI for that runsc ([`Support`]).
//!
//! The wire format (gVisor's `pkg/urpc`, at the pinned version): the client writes
//! `{"method":M,"arg":A}` on a stream socket, the server answers
//! `{"success":bool,"err":string,"result":R}`, both as bare JSON values.
//! `engine/tests/control_socket.rs` pins it against the pinned runsc.

use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use serde::Deserialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

use super::SandboxCtx;
use crate::error::{Error, Result};

pub const PAUSE: &str = "containerManager.Pause";
pub const RESUME: &str = "containerManager.Resume";
pub const IS_PAUSED: &str = "containerManager.IsPaused";
pub const SET_HOSTNAME: &str = "containerManager.SetHostname";

/// How long one call may take. A pause waits for every task to stop (a task inside a
/// long host system call delays it), so this is generous; a sandbox that answers
/// nothing in this time is reported, not waited on forever.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// A reply larger than this is not a reply to any call made here.
const MAX_REPLY: usize = 64 << 10;

/// Where runsc puts a sandbox's control socket (`runsc/sandbox/sandbox.go`,
/// `controlSocketName`: the first of its root directory, /var/run, /run and /tmp where
/// it could create it; the agent gives every sandbox a root of its own).
pub fn socket_path(ctx: &SandboxCtx) -> PathBuf {
    ctx.root.join(format!("runsc-{}.sock", ctx.id))
}

/// `{"method":M,"arg":A}`, what a urpc client writes for one call.
pub fn request(method: &str, arg: &serde_json::Value) -> Result<Vec<u8>> {
    Ok(serde_json::to_vec(
        &serde_json::json!({ "method": method, "arg": arg }),
    )?)
}

/// What the control server answers to one call.
#[derive(Debug, Deserialize, PartialEq)]
pub struct Reply {
    pub success: bool,
    #[serde(default)]
    pub err: String,
    #[serde(default)]
    pub result: serde_json::Value,
}

/// The reply at the start of `buf`: `Ok(None)` while it is still incomplete.
pub fn parse_reply(buf: &[u8]) -> Result<Option<Reply>> {
    let mut it = serde_json::Deserializer::from_slice(buf).into_iter::<Reply>();
    match it.next() {
        None => Ok(None),
        Some(Ok(r)) => Ok(Some(r)),
        Some(Err(e)) if e.is_eof() => Ok(None),
        Some(Err(e)) => Err(e.into()),
    }
}

/// Whether the pinned runsc's control server can be driven directly. Learnt from the
/// first sandbox asked, once per runsc (the agent runs one).
#[derive(Clone, Debug, Default)]
pub struct Support(Arc<AtomicU8>);

const YES: u8 = 1;
const NO: u8 = 2;

impl Support {
    /// `None` until a sandbox answered (or refused) `IsPaused`.
    pub fn known(&self) -> Option<bool> {
        match self.0.load(Ordering::Relaxed) {
            YES => Some(true),
            NO => Some(false),
            _ => None, // 0: not asked yet
        }
    }

    /// Pauses and resumes through the runsc CLI only (`true`), or through the control
    /// socket where the sandbox answers on it (`false`, the default). Only for
    /// sandboxes paused after the switch: a sandbox's pause is undone the way it was
    /// made. The benches time both ways in one run with it.
    pub fn use_cli_only(&self, cli: bool) {
        self.0.store(if cli { NO } else { 0 }, Ordering::Relaxed);
    }

    fn set(&self, yes: bool) {
        self.0.store(if yes { YES } else { NO }, Ordering::Relaxed);
    }
}

/// One call on the control socket at `path`.
pub async fn call(
    id: &str,
    path: &Path,
    method: &'static str,
    arg: serde_json::Value,
) -> Result<serde_json::Value> {
    let err = |reason: String| Error::Sandbox {
        id: id.to_string(),
        reason: format!("control socket, {method}: {reason}"),
    };
    let req = request(method, &arg)?;
    let exchange = async {
        let mut s = connect(path).await.map_err(|e| err(e.to_string()))?;
        s.write_all(&req).await.map_err(|e| err(e.to_string()))?;
        let mut buf = Vec::with_capacity(128);
        let mut chunk = [0u8; 4096];
        loop {
            let n = s.read(&mut chunk).await.map_err(|e| err(e.to_string()))?;
            if n == 0 {
                return Err(err(
                    "the sandbox closed the connection before it answered".into()
                ));
            }
            buf.extend_from_slice(&chunk[..n]);
            if let Some(reply) = parse_reply(&buf)? {
                return Ok(reply);
            }
            if buf.len() > MAX_REPLY {
                return Err(err(format!("a reply of over {MAX_REPLY} bytes")));
            }
        }
    };
    let reply = tokio::time::timeout(CALL_TIMEOUT, exchange)
        .await
        .map_err(|_| Error::Timeout {
            command: format!("{method} on the control socket of sandbox {id}"),
            seconds: CALL_TIMEOUT.as_secs(),
        })??;
    if reply.success {
        Ok(reply.result)
    } else {
        Err(err(reply.err))
    }
}

/// Connects to a Unix socket at any path length: a path over `sun_path`'s 108 bytes is
/// reached through `/proc/self/fd` of an `O_PATH` descriptor, as runsc itself does.
async fn connect(path: &Path) -> std::io::Result<UnixStream> {
    use std::os::unix::ffi::OsStrExt;
    if path.as_os_str().as_bytes().len() < 108 {
        return UnixStream::connect(path).await;
    }
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::fcntl::OFlag::O_PATH.bits())
        .open(path)?;
    let via = format!("/proc/self/fd/{}", f.as_raw_fd());
    let s = UnixStream::connect(&via).await;
    drop(f);
    s
}

/// Sets the hostname of the sandbox's root UTS namespace over its control socket
/// (`containerManager.SetHostname`, added to the pinned runsc by
/// `hack/runsc/patches/0004-control-set-hostname.patch`), which a restored branch needs
/// (gVisor restores the checkpointed hostname). `Ok(false)`: this runsc cannot (no
/// socket file, or no such method, learnt once in `support`), and the caller execs
/// `hostname` in the sandbox instead.
pub async fn set_hostname(ctx: &SandboxCtx, support: &Support, host: &str) -> Result<bool> {
    if support.known() == Some(false) {
        return Ok(false);
    }
    let path = socket_path(ctx);
    if !path.exists() {
        return Ok(false);
    }
    let arg = serde_json::Value::String(host.to_string());
    let set = call(&ctx.id, &path, SET_HOSTNAME, arg).await.map(|_| ());
    let instead = "restored branches get their hostnames through `runsc exec`";
    Ok(learn(support, SET_HOSTNAME, instead, set)?.is_some())
}

/// What one call tells of this runsc: `Some` its answer, and the method is known to be
/// there; `None` when the control server refused the method (an unpatched runsc),
/// learnt once in `support` and logged with what the agent does `instead`. Any other
/// error is the call's own.
fn learn<T>(support: &Support, method: &str, instead: &str, r: Result<T>) -> Result<Option<T>> {
    match r {
        Ok(v) => {
            support.set(true);
            Ok(Some(v))
        }
        Err(Error::Sandbox { reason, .. }) if reason.ends_with(": unknown method") => {
            tracing::info!(
                "this runsc's control server has no {method} (not the pinned, patched \
                 runsc): {instead}"
            );
            support.set(false);
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// The sandbox's control server, when this runsc's can be driven directly; `None`
/// means "use the runsc CLI" (no socket file: an older runsc with an abstract socket;
/// or a runsc without `IsPaused`).
#[derive(Clone, Debug)]
pub struct Control {
    id: String,
    path: PathBuf,
}

impl Control {
    /// The sandbox's control server if it can tell whether it is paused. Costs one call
    /// (the answer is needed anyway: see [`Control::paused`]).
    pub async fn of(ctx: &SandboxCtx, support: &Support) -> Result<Option<(Control, bool)>> {
        if support.known() == Some(false) {
            return Ok(None);
        }
        let path = socket_path(ctx);
        if !path.exists() {
            return Ok(None);
        }
        let c = Control {
            id: ctx.id.clone(),
            path,
        };
        let paused = c.paused().await;
        let instead = "pauses and resumes go through the runsc CLI";
        Ok(learn(support, IS_PAUSED, instead, paused)?.map(|p| (c, p)))
    }

    /// Whether the sandbox's kernel is paused.
    pub async fn paused(&self) -> Result<bool> {
        let v = call(&self.id, &self.path, IS_PAUSED, serde_json::Value::Null).await?;
        v.as_bool()
            .ok_or_else(|| Error::RunscOutput(format!("{IS_PAUSED} of sandbox {}: {v}", self.id)))
    }

    /// Stops every task of the sandbox (returns once they are stopped). Pauses nest:
    /// call it only on a sandbox that is not paused.
    pub async fn pause(&self) -> Result<()> {
        call(&self.id, &self.path, PAUSE, serde_json::Value::Null)
            .await
            .map(|_| ())
    }

    /// Lets the sandbox's tasks run again. Only on a paused sandbox: the sandbox's
    /// kernel panics on a resume it was not paused for.
    pub async fn resume(&self) -> Result<()> {
        call(&self.id, &self.path, RESUME, serde_json::Value::Null)
            .await
            .map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_is_the_method_and_its_argument() {
        let r = request(PAUSE, &serde_json::Value::Null).unwrap_or_default();
        assert_eq!(
            String::from_utf8_lossy(&r),
            r#"{"arg":null,"method":"containerManager.Pause"}"#
        );
    }

    #[test]
    fn replies_are_read_whole_or_not_at_all() {
        let whole = br#"{"success":true,"err":"","result":true}"#;
        for cut in 1..whole.len() {
            assert!(
                matches!(parse_reply(&whole[..cut]), Ok(None)),
                "a reply cut at {cut} is incomplete"
            );
        }
        let r = parse_reply(whole).ok().flatten();
        assert_eq!(
            r,
            Some(Reply {
                success: true,
                err: String::new(),
                result: serde_json::Value::Bool(true),
            })
        );
        let refused = br#"{"success":false,"err":"unknown method","result":null}"#;
        let r = parse_reply(refused).ok().flatten();
        assert!(r.is_some_and(|r| !r.success && r.err == "unknown method"));
        assert!(parse_reply(b"<html>").is_err(), "not JSON is an error");
    }

    #[test]
    fn the_socket_is_in_the_sandboxs_root() {
        let ctx = SandboxCtx {
            id: "b-1".into(),
            root: "/var/lib/ramify/sandboxes/b-1/runsc-root".into(),
            netns: None,
            network: super::super::NetworkMode::None,
        };
        assert_eq!(
            socket_path(&ctx),
            PathBuf::from("/var/lib/ramify/sandboxes/b-1/runsc-root/runsc-b-1.sock")
        );
    }

    #[tokio::test]
    async fn a_call_goes_through_a_socket_of_any_path_length() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let deep = dir.path().join("d".repeat(100)).join("e".repeat(40));
        std::fs::create_dir_all(&deep).unwrap_or_else(|e| panic!("{e}"));
        for path in [dir.path().join("s.sock"), deep.join("s.sock")] {
            // bind has the same limit: the long one is bound through a short symlink.
            let short = dir.path().join("l");
            let bind_at = if path.as_os_str().len() < 108 {
                path.clone()
            } else {
                std::os::unix::fs::symlink(&deep, &short).unwrap_or_else(|e| panic!("{e}"));
                short.join("s.sock")
            };
            let l = tokio::net::UnixListener::bind(&bind_at).unwrap_or_else(|e| panic!("{e}"));
            let server = tokio::spawn(async move {
                let (mut s, _) = l.accept().await.unwrap_or_else(|e| panic!("{e}"));
                let mut buf = vec![0u8; 256];
                let n = s.read(&mut buf).await.unwrap_or(0);
                let got = String::from_utf8_lossy(&buf[..n]).into_owned();
                // Answered in two writes, as a stream may deliver it.
                let _ = s.write_all(br#"{"success":true,"#).await;
                tokio::time::sleep(Duration::from_millis(20)).await;
                let _ = s.write_all(br#""err":"","result":false}"#).await;
                got
            });
            let v = call("t", &path, IS_PAUSED, serde_json::Value::Null)
                .await
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            assert_eq!(v, serde_json::Value::Bool(false));
            let got = server.await.unwrap_or_default();
            assert_eq!(got, r#"{"arg":null,"method":"containerManager.IsPaused"}"#);
        }
    }
}
