//! One TCP connection to a port inside a sandbox, as `kubectl port-forward` makes to a
//! Pod: the sandbox's own network stack connects to `127.0.0.1:<port>` (its loopback,
//! so a server bound to loopback only is reached too), and the bytes travel over a Unix
//! socket pair whose other end the sandbox holds.
//!
//! The call is gVisor's `containerManager.PortForward` on the sandbox's control socket
//! (what `runsc port-forward` makes): the usual urpc JSON message, with the socket's
//! descriptor attached as `SCM_RIGHTS` (urpc's `FilePayload`). The sandbox connects
//! before it answers, so "nothing listens on that port" comes back as the call's error,
//! and the connection is ready once it answers. No `runsc` process is started: a
//! connection costs one call. `engine/tests/port_forward.rs` drives it on real runsc.

use std::io::{IoSlice, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream as StdUnixStream;
use std::path::Path;
use std::time::Duration;

use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};

use super::SandboxCtx;
use super::control::{Reply, parse_reply, request, socket_path};
use crate::error::{Error, Result};

pub const PORT_FORWARD: &str = "containerManager.PortForward";

/// How long the sandbox may take to connect and answer. A connection to a port that
/// nobody serves is refused at once; a sandbox that answers nothing in this time is
/// reported, not waited on.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// A reply larger than this is not a reply to this call.
const MAX_REPLY: usize = 64 << 10;

/// A connection to `port` on the sandbox's loopback, as the local end of a Unix socket
/// pair: what is written to it reaches the server in the sandbox, what the server
/// writes comes out of it, and its end of file is the server's close.
pub async fn connect(ctx: &SandboxCtx, port: u16) -> Result<tokio::net::UnixStream> {
    let id = ctx.id.clone();
    let path = socket_path(ctx);
    if !path.exists() {
        return Err(Error::Invalid(
            "its runsc keeps no control socket file (an older runsc, whose control socket \
             is abstract): port-forward needs the pinned runsc"
                .into(),
        ));
    }
    let req = request(
        PORT_FORWARD,
        &serde_json::json!({ "ContainerID": id, "Port": port }),
    )?;
    let (ours, theirs) = StdUnixStream::pair().map_err(|e| Error::io("socketpair", &path, e))?;
    let call = tokio::task::spawn_blocking(move || call_with_fd(&path, &req, &theirs));
    let reply = match call.await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            return Err(Error::Sandbox {
                id,
                reason: format!("control socket, {PORT_FORWARD}: {e}"),
            });
        }
        Err(e) => {
            return Err(Error::Sandbox {
                id,
                reason: format!("control socket, {PORT_FORWARD}: the call's task failed: {e}"),
            });
        }
    };
    if !reply.success {
        return Err(Error::Sandbox {
            id,
            reason: refused_reason(port, &reply.err),
        });
    }
    ours.set_nonblocking(true)
        .map_err(|e| Error::io("set non-blocking", Path::new("socketpair"), e))?;
    tokio::net::UnixStream::from_std(ours)
        .map_err(|e| Error::io("register", Path::new("socketpair"), e))
}

/// What the sandbox's refusal means, for the person who asked.
pub fn refused_reason(port: u16, err: &str) -> String {
    // gVisor's netstack says "connection was refused"; a host stack "connection refused".
    if err.contains("refused") {
        format!("nothing accepts connections on port {port} in the sandbox ({err})")
    } else {
        format!("port-forward to port {port}: {err}")
    }
}

/// The call, blocking: the request with `file` attached, then the reply. `file` is
/// closed here once sent (the sandbox holds its own copy).
fn call_with_fd(path: &Path, req: &[u8], file: &StdUnixStream) -> std::io::Result<Reply> {
    let mut s = connect_blocking(path)?;
    s.set_read_timeout(Some(CALL_TIMEOUT))?;
    s.set_write_timeout(Some(CALL_TIMEOUT))?;
    let fds = [file.as_raw_fd()];
    // The descriptor goes with the first bytes; the rest, if the socket took only part,
    // follows plainly (as urpc's own client does).
    let sent = sendmsg::<()>(
        s.as_raw_fd(),
        &[IoSlice::new(req)],
        &[ControlMessage::ScmRights(&fds)],
        MsgFlags::MSG_NOSIGNAL,
        None,
    )
    .map_err(std::io::Error::from)?;
    s.write_all(req.get(sent..).unwrap_or_default())?;
    let mut buf = Vec::with_capacity(128);
    let mut chunk = [0u8; 4096];
    loop {
        let n = s.read(&mut chunk)?;
        if n == 0 {
            return Err(std::io::Error::other(
                "the sandbox closed the connection before it answered",
            ));
        }
        buf.extend_from_slice(chunk.get(..n).unwrap_or_default());
        match parse_reply(&buf) {
            Ok(Some(reply)) => return Ok(reply),
            Ok(None) => {}
            Err(e) => return Err(std::io::Error::other(e.to_string())),
        }
        if buf.len() > MAX_REPLY {
            return Err(std::io::Error::other(format!(
                "a reply of over {MAX_REPLY} bytes"
            )));
        }
    }
}

/// Connects to a Unix socket at any path length (see [`super::control`]).
fn connect_blocking(path: &Path) -> std::io::Result<StdUnixStream> {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::OpenOptionsExt;
    if path.as_os_str().as_bytes().len() < 108 {
        return StdUnixStream::connect(path);
    }
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::fcntl::OFlag::O_PATH.bits())
        .open(path)?;
    StdUnixStream::connect(format!("/proc/self/fd/{}", f.as_raw_fd()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_connection_says_nothing_listens() {
        let r = refused_reason(
            8080,
            "creating netstack port forward connection: connecting endpoint: connection refused",
        );
        assert!(
            r.starts_with("nothing accepts connections on port 8080 in the sandbox"),
            "{r}"
        );
        assert_eq!(
            refused_reason(80, "container \"x\" not started"),
            "port-forward to port 80: container \"x\" not started"
        );
    }

    /// The descriptor travels with the request: a fake control server receives both,
    /// writes through the descriptor, and answers.
    #[test]
    fn the_request_carries_the_socket() {
        use nix::sys::socket::{ControlMessageOwned, recvmsg};
        use std::os::unix::net::UnixListener;
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let path = dir.path().join("runsc-x.sock");
        let listener = UnixListener::bind(&path).unwrap_or_else(|e| panic!("{e}"));
        let server = std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap_or_else(|e| panic!("{e}"));
            let mut buf = [0u8; 4096];
            let mut space = nix::cmsg_space!([std::os::fd::RawFd; 1]);
            let mut iov = [std::io::IoSliceMut::new(&mut buf)];
            let msg = recvmsg::<()>(
                conn.as_raw_fd(),
                &mut iov,
                Some(&mut space),
                MsgFlags::empty(),
            )
            .unwrap_or_else(|e| panic!("{e}"));
            let mut fds = Vec::new();
            for c in msg.cmsgs().unwrap_or_else(|e| panic!("{e}")) {
                if let ControlMessageOwned::ScmRights(f) = c {
                    fds.extend(f);
                }
            }
            let n = msg.bytes;
            let body: serde_json::Value =
                serde_json::from_slice(&buf[..n]).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(body["method"], PORT_FORWARD);
            assert_eq!(body["arg"]["Port"], 8080);
            assert_eq!(fds.len(), 1, "one descriptor attached");
            // Written through the received descriptor, as the sandbox's proxy does.
            let raw = fds.first().copied().unwrap_or_else(|| panic!("no fd"));
            nix::sys::socket::send(raw, b"hello", MsgFlags::MSG_NOSIGNAL)
                .unwrap_or_else(|e| panic!("{e}"));
            nix::unistd::close(raw).unwrap_or_else(|e| panic!("{e}"));
            conn.write_all(br#"{"success":true,"err":"","result":null}"#)
                .unwrap_or_else(|e| panic!("{e}"));
        });
        let (ours, theirs) = StdUnixStream::pair().unwrap_or_else(|e| panic!("{e}"));
        let reply = call_with_fd(&path, b"{\"method\":\"containerManager.PortForward\",\"arg\":{\"ContainerID\":\"x\",\"Port\":8080}}", &theirs)
            .unwrap_or_else(|e| panic!("{e}"));
        drop(theirs);
        assert!(reply.success);
        let mut got = [0u8; 5];
        let mut ours = ours;
        ours.read_exact(&mut got).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(&got, b"hello");
        server.join().unwrap_or_else(|_| panic!("server thread"));
    }
}
