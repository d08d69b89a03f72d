//! An exec on the node endpoint, streamed over the Kubernetes channel protocol (as
//! `pods/exec`): the command's output on channels 1 and 2 as it comes, then its exit
//! status on 3. With `stdin=true` what the client sends on channel 0 is its stdin, and
//! a v5 close of channel 0 is its end of file. With `tty=true` the command runs on a
//! terminal ([`ramify_engine::tty`]): its output comes on channel 1 alone, channel 0
//! is what is typed, and channel 4 (`{"Width":W,"Height":H}`) resizes it. A client
//! that goes away kills the command.

use std::process::Stdio;

use futures::{SinkExt, StreamExt};
use ramify_crds::subresources::{
    self as sub, CHANNEL_CLOSE, CHANNEL_RESIZE, CHANNEL_STATUS, CHANNEL_STDERR, CHANNEL_STDIN,
    CHANNEL_STDOUT,
};
use ramify_engine::cmd::Cmd;
use ramify_engine::tty::{Pty, Size};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tracing::warn;

/// How the command is attached (the request's `stdin` and `tty`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Attach {
    pub stdin: bool,
    pub tty: bool,
}

impl Attach {
    /// From the query values of `stdin` and `tty` (`true` or `1`, as a Pod exec's).
    pub fn parse(stdin: &[String], tty: &[String]) -> Attach {
        let yes = |v: &[String]| v.iter().any(|s| s == "true" || s == "1");
        Attach {
            stdin: yes(stdin),
            tty: yes(tty),
        }
    }
}

/// A resize message's size (`{"Width":W,"Height":H}`); `None` for anything else.
pub fn parse_resize(body: &[u8]) -> Option<Size> {
    #[derive(serde::Deserialize)]
    #[serde(rename_all = "PascalCase")]
    struct Resize {
        width: u16,
        height: u16,
    }
    let r: Resize = serde_json::from_slice(body).ok()?;
    (r.width > 0 && r.height > 0).then_some(Size {
        cols: r.width,
        rows: r.height,
    })
}

/// The started command: its process, and its terminal if it has one.
struct Started {
    child: tokio::process::Child,
    pty: Option<Pty>,
}

fn start(cmd: &Cmd, attach: Attach) -> ramify_engine::Result<Started> {
    if attach.tty {
        let (pty, replica) = Pty::open(Size::default())?;
        let dup = |what| {
            replica
                .try_clone()
                .map_err(|e| ramify_engine::Error::io(what, "/dev/pts", e))
        };
        let (out, err) = (dup("dup the terminal")?, dup("dup the terminal")?);
        let child = cmd.spawn_with(Stdio::from(replica), Stdio::from(out), Stdio::from(err))?;
        return Ok(Started {
            child,
            pty: Some(pty),
        });
    }
    let stdin = if attach.stdin {
        Stdio::piped()
    } else {
        Stdio::null()
    };
    let child = cmd.spawn_with(stdin, Stdio::piped(), Stdio::piped())?;
    Ok(Started { child, pty: None })
}

/// Runs the command, streaming its output as channel messages while it comes and the
/// client's input to it, then its exit status.
pub async fn run<S>(ws: WebSocketStream<S>, cmd: Cmd, attach: Attach)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut tx, rx) = ws.split();
    let Started { mut child, pty } = match start(&cmd, attach) {
        Ok(s) => s,
        Err(e) => {
            let _ = send_status(&mut tx, &sub::exec_failure(&e.to_string())).await;
            return;
        }
    };
    let (frames_tx, mut frames) = tokio::sync::mpsc::channel::<Message>(16);
    let mut input: Option<Box<dyn AsyncWrite + Send + Unpin>> = None;
    match &pty {
        Some(p) => match (p.handle(), p.handle()) {
            (Ok(read), Ok(write)) => {
                tokio::spawn(pump(
                    tokio::fs::File::from_std(read),
                    CHANNEL_STDOUT,
                    frames_tx.clone(),
                ));
                if attach.stdin {
                    input = Some(Box::new(tokio::fs::File::from_std(write)));
                }
            }
            (Err(e), _) | (_, Err(e)) => {
                let _ = send_status(&mut tx, &sub::exec_failure(&e.to_string())).await;
                return;
            }
        },
        None => {
            if let Some(out) = child.stdout.take() {
                tokio::spawn(pump(out, CHANNEL_STDOUT, frames_tx.clone()));
            }
            if let Some(err) = child.stderr.take() {
                tokio::spawn(pump(err, CHANNEL_STDERR, frames_tx.clone()));
            }
            if let Some(stdin) = child.stdin.take() {
                input = Some(Box::new(stdin));
            }
        }
    }
    drop(frames_tx);
    // The client's side, on a task of its own: a command that does not read its stdin
    // must not hold up its output.
    let (gone_tx, mut gone) = tokio::sync::oneshot::channel::<()>();
    let reader = tokio::spawn(read_client(rx, input, pty, gone_tx));
    loop {
        tokio::select! {
            frame = frames.recv() => match frame {
                Some(m) => {
                    if tx.send(m).await.is_err() {
                        // The client is gone: dropping the child kills it.
                        reader.abort();
                        return;
                    }
                }
                // Every output stream ended.
                None => break,
            },
            _ = &mut gone => {
                reader.abort();
                return;
            }
        }
    }
    let status = match child.wait().await {
        Ok(st) => {
            use std::os::unix::process::ExitStatusExt;
            sub::exit_status(st.code().unwrap_or_else(|| 128 + st.signal().unwrap_or(0)))
        }
        Err(e) => sub::exec_failure(&format!("waiting for runsc exec: {e}")),
    };
    let _ = send_status(&mut tx, &status).await;
    let _ = tx.close().await;
    reader.abort();
}

/// What the client sends: stdin, resizes, the end of stdin; `gone` fires when it
/// closes the stream.
async fn read_client<R>(
    mut rx: R,
    mut input: Option<Box<dyn AsyncWrite + Send + Unpin>>,
    pty: Option<Pty>,
    gone: tokio::sync::oneshot::Sender<()>,
) where
    R: futures::Stream<Item = Result<Message, tokio_tungstenite::tungstenite::Error>> + Unpin,
{
    while let Some(m) = rx.next().await {
        let b = match m {
            Ok(Message::Binary(b)) => b,
            Ok(Message::Close(_)) | Err(_) => break,
            Ok(_) => continue,
        };
        match b.split_first() {
            Some((&CHANNEL_STDIN, data)) => {
                if let Some(w) = input.as_mut()
                    && (w.write_all(data).await.is_err() || w.flush().await.is_err())
                {
                    // The command closed its stdin: the rest is dropped.
                    input = None;
                }
            }
            Some((&CHANNEL_RESIZE, body)) => {
                if let (Some(p), Some(size)) = (&pty, parse_resize(body))
                    && let Err(e) = p.resize(size)
                {
                    warn!(error = %e, "resizing an exec's terminal failed");
                }
            }
            Some((&CHANNEL_CLOSE, [CHANNEL_STDIN])) => {
                // End of file: the command reads what was sent, then nothing.
                if let Some(mut w) = input.take() {
                    let _ = w.shutdown().await;
                }
            }
            _ => {}
        }
    }
    let _ = gone.send(());
}

pub async fn send_status<W>(tx: &mut W, status: &serde_json::Value) -> Result<(), W::Error>
where
    W: futures::Sink<Message> + Unpin,
{
    let mut frame = vec![CHANNEL_STATUS];
    frame.extend_from_slice(status.to_string().as_bytes());
    tx.send(Message::Binary(frame.into())).await
}

/// Copies one output stream into channel messages until it ends (a terminal's ends
/// with `EIO` once the command and everything it started have closed it).
async fn pump<R: AsyncRead + Unpin>(
    mut r: R,
    channel: u8,
    out: tokio::sync::mpsc::Sender<Message>,
) {
    let mut buf = vec![0u8; 32 << 10];
    loop {
        match r.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                let mut frame = Vec::with_capacity(n + 1);
                frame.push(channel);
                frame.extend_from_slice(buf.get(..n).unwrap_or_default());
                if out.send(Message::Binary(frame.into())).await.is_err() {
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attach_and_resize_read_as_a_pod_execs() {
        let t = |v: &str| vec![v.to_string()];
        assert_eq!(
            Attach::parse(&t("true"), &t("1")),
            Attach {
                stdin: true,
                tty: true
            }
        );
        assert_eq!(Attach::parse(&[], &t("false")), Attach::default());
        assert_eq!(
            parse_resize(br#"{"Width":120,"Height":40}"#),
            Some(Size {
                cols: 120,
                rows: 40
            })
        );
        assert_eq!(parse_resize(br#"{"Width":0,"Height":40}"#), None);
        assert_eq!(parse_resize(b"garbage"), None);
    }
}
