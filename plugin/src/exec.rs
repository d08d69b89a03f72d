//! `kubectl ramify exec [-i] [-t] NAME -- COMMAND...`: runs a command in a sandbox
//! through the aggregated API (RBAC: `get` on `sandboxes/exec`), over the Kubernetes
//! channel protocol `kubectl exec` speaks: stdin on channel 0, stdout 1, stderr 2, the
//! final status 3, terminal resizes 4 (`{"Width":W,"Height":H}`), and (v5) the end of
//! stdin as a close of channel 0. With `-t` the local terminal is put in raw mode for
//! the command's life and its size follows the window (SIGWINCH).

use std::io::Write;
use std::process::ExitCode;

use futures::{SinkExt, StreamExt};
use kube::Client;
use ramify_crds::subresources as sub;
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::Message;

use crate::{Error, Result, api_error, subresource_url};

/// How the command is attached.
#[derive(Clone, Copy, Debug, Default)]
pub struct Attach {
    /// Pass this process's stdin to the command (`-i`).
    pub stdin: bool,
    /// Give the command a terminal (`-t`).
    pub tty: bool,
}

/// The exec request's query: the command and how it is attached (a Pod exec's names).
pub fn query(command: &[String], attach: Attach) -> Vec<(&str, String)> {
    let mut q: Vec<(&str, String)> = command.iter().map(|c| ("command", c.clone())).collect();
    q.push(("stdout", "true".into()));
    // A terminal has one output stream.
    q.push(("stderr", (!attach.tty).to_string()));
    if attach.stdin {
        q.push(("stdin", "true".into()));
    }
    if attach.tty {
        q.push(("tty", "true".into()));
    }
    q
}

/// The resize message for a terminal of `cols` x `rows`.
pub fn resize_frame(cols: u16, rows: u16) -> Vec<u8> {
    let mut frame = vec![sub::CHANNEL_RESIZE];
    frame.extend_from_slice(
        serde_json::json!({"Width": cols, "Height": rows})
            .to_string()
            .as_bytes(),
    );
    frame
}

/// The local terminal in raw mode, put back as it was on drop.
struct RawMode {
    saved: rustix::termios::Termios,
}

impl RawMode {
    fn enter() -> Option<RawMode> {
        let stdin = std::io::stdin();
        let saved = rustix::termios::tcgetattr(&stdin).ok()?;
        let mut raw = saved.clone();
        raw.make_raw();
        rustix::termios::tcsetattr(&stdin, rustix::termios::OptionalActions::Now, &raw).ok()?;
        Some(RawMode { saved })
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        let _ = rustix::termios::tcsetattr(
            std::io::stdin(),
            rustix::termios::OptionalActions::Now,
            &self.saved,
        );
    }
}

/// The local terminal's size, when stdout is one.
fn local_size() -> Option<(u16, u16)> {
    let w = rustix::termios::tcgetwinsize(std::io::stdout()).ok()?;
    (w.ws_col > 0 && w.ws_row > 0).then_some((w.ws_col, w.ws_row))
}

/// Runs `command`, printing its output as it comes; exits with the command's code.
pub async fn exec(
    client: &Client,
    ns: &str,
    sandbox: &str,
    command: &[String],
    attach: Attach,
) -> Result<ExitCode> {
    let q = query(command, attach);
    let pairs: Vec<(&str, &str)> = q.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let req = http::Request::get(subresource_url(ns, sandbox, sub::SUBRESOURCE_EXEC, &pairs))
        .body(Vec::new())
        .map_err(|e| Error::Other(e.to_string()))?;
    let conn = client.connect(req).await.map_err(api_error)?;
    let closable = conn.supports_stream_close();
    let (mut tx, mut rx) = conn.into_stream().split();

    // Everything sent goes through one queue: stdin, resizes, the close of stdin.
    let (out_tx, mut out_rx) = mpsc::channel::<Vec<u8>>(16);
    let _raw = if attach.tty { RawMode::enter() } else { None };
    if attach.tty {
        let (cols, rows) = local_size().unwrap_or((80, 24));
        let _ = out_tx.send(resize_frame(cols, rows)).await;
        let resizes = out_tx.clone();
        tokio::spawn(async move {
            let Ok(mut winch) =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::window_change())
            else {
                return;
            };
            while winch.recv().await.is_some() {
                if let Some((cols, rows)) = local_size()
                    && resizes.send(resize_frame(cols, rows)).await.is_err()
                {
                    return;
                }
            }
        });
    }
    if attach.stdin {
        // A thread of its own: a read of a terminal blocks, and must not keep the
        // process alive once the command ended.
        let input = out_tx.clone();
        std::thread::spawn(move || {
            let mut stdin = std::io::stdin().lock();
            let mut buf = vec![0u8; 32 << 10];
            loop {
                match std::io::Read::read(&mut stdin, buf.get_mut(1..).unwrap_or_default()) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        let mut frame = vec![sub::CHANNEL_STDIN];
                        frame.extend_from_slice(buf.get(1..=n).unwrap_or_default());
                        if input.blocking_send(frame).is_err() {
                            return;
                        }
                    }
                }
            }
            // The end of stdin, where the protocol can say it (v5).
            if closable {
                let _ = input.blocking_send(vec![sub::CHANNEL_CLOSE, sub::CHANNEL_STDIN]);
            }
        });
    }
    drop(out_tx);
    tokio::spawn(async move {
        while let Some(frame) = out_rx.recv().await {
            if tx.send(Message::Binary(frame.into())).await.is_err() {
                return;
            }
        }
    });

    let (mut stdout, mut stderr) = (std::io::stdout(), std::io::stderr());
    while let Some(msg) = rx.next().await {
        let msg = msg.map_err(|e| Error::Other(format!("exec stream: {e}")))?;
        let Message::Binary(data) = msg else {
            if msg.is_close() {
                break;
            }
            continue;
        };
        let Some((&channel, body)) = data.split_first() else {
            continue;
        };
        let written = match channel {
            sub::CHANNEL_STDOUT => stdout.write_all(body).and_then(|()| stdout.flush()),
            sub::CHANNEL_STDERR => stderr.write_all(body),
            sub::CHANNEL_STATUS => {
                let status: serde_json::Value =
                    serde_json::from_slice(body).map_err(|e| Error::Other(e.to_string()))?;
                return match sub::exit_code(&status) {
                    Ok(code) => Ok(ExitCode::from(u8::try_from(code).unwrap_or(1))),
                    Err(message) => Err(Error::Other(message)),
                };
            }
            _ => Ok(()),
        };
        written.map_err(|e| Error::Other(format!("writing output: {e}")))?;
    }
    Err(Error::Other(
        "the exec stream ended without the command's exit status".into(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_terminal_asks_for_one_stream_and_stdin_is_asked_for_by_name() {
        let cmd = vec!["sh".to_string()];
        let q = query(
            &cmd,
            Attach {
                stdin: true,
                tty: true,
            },
        );
        assert!(q.contains(&("stdin", "true".into())));
        assert!(q.contains(&("tty", "true".into())));
        assert!(q.contains(&("stderr", "false".into())));
        let q = query(&cmd, Attach::default());
        assert!(!q.iter().any(|(k, _)| *k == "stdin" || *k == "tty"));
        assert!(q.contains(&("stderr", "true".into())));
        assert_eq!(
            resize_frame(100, 40),
            b"\x04{\"Height\":40,\"Width\":100}".to_vec()
        );
    }
}
