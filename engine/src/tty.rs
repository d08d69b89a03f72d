//! A pseudo-terminal for an interactive exec (`kubectl ramify exec -it`).
//!
//! `runsc exec` gives the process in the sandbox a terminal when its own stdin, stdout
//! and stderr are one (gVisor's `StdioIsPty`), and then forwards every signal it gets
//! to the sandbox's foreground process group. So the agent opens a pty pair, hands the
//! replica to `runsc exec` as its stdio and its controlling terminal (`setsid --ctty`,
//! util-linux, like the `nsenter` every runsc command already runs under), and keeps
//! the controller end: the client's keystrokes are written to it, the process's output
//! read from it. The host's line discipline then does what a terminal does: ^C sends
//! SIGINT to `runsc exec` (forwarded to the foreground job inside), and a resize
//! (`TIOCSWINSZ` on the controller) sends it SIGWINCH (forwarded too), after which the
//! process reads the new size through its terminal.

use std::os::fd::OwnedFd;

use rustix::pty::OpenptFlags;
use rustix::termios::Winsize;

use crate::error::{Error, Result};

/// A terminal's size in characters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Size {
    pub cols: u16,
    pub rows: u16,
}

impl Default for Size {
    /// What a terminal is until its client says otherwise.
    fn default() -> Self {
        Size { cols: 80, rows: 24 }
    }
}

/// The controller end of a pty pair.
#[derive(Debug)]
pub struct Pty {
    controller: std::fs::File,
}

fn pty_error(what: &'static str, e: rustix::io::Errno) -> Error {
    Error::io(what, "/dev/ptmx", std::io::Error::from(e))
}

impl Pty {
    /// A new pair of `size`: the controller, and the replica for the process's stdio.
    /// Both close on exec (the replica is duplicated onto the child's 0, 1 and 2), so
    /// no other child of the agent inherits either.
    pub fn open(size: Size) -> Result<(Pty, OwnedFd)> {
        let flags = OpenptFlags::RDWR | OpenptFlags::NOCTTY | OpenptFlags::CLOEXEC;
        let controller = rustix::pty::openpt(flags).map_err(|e| pty_error("openpt", e))?;
        rustix::pty::grantpt(&controller).map_err(|e| pty_error("grantpt", e))?;
        rustix::pty::unlockpt(&controller).map_err(|e| pty_error("unlockpt", e))?;
        let replica = rustix::pty::ioctl_tiocgptpeer(&controller, flags)
            .map_err(|e| pty_error("open the pty's replica", e))?;
        let pty = Pty {
            controller: std::fs::File::from(controller),
        };
        pty.resize(size)?;
        Ok((pty, replica))
    }

    /// Sets the terminal's size; the process in the sandbox is told by SIGWINCH.
    pub fn resize(&self, size: Size) -> Result<()> {
        rustix::termios::tcsetwinsize(
            &self.controller,
            Winsize {
                ws_row: size.rows,
                ws_col: size.cols,
                ws_xpixel: 0,
                ws_ypixel: 0,
            },
        )
        .map_err(|e| pty_error("set the terminal size", e))
    }

    /// The terminal's size now.
    pub fn size(&self) -> Result<Size> {
        let w = rustix::termios::tcgetwinsize(&self.controller)
            .map_err(|e| pty_error("read the terminal size", e))?;
        Ok(Size {
            cols: w.ws_col,
            rows: w.ws_row,
        })
    }

    /// Another handle on the controller, for reading or writing it (blocking: use
    /// through `tokio::fs::File`, whose reads run on the blocking pool). Reading
    /// fails with `EIO` once every process holding the replica has exited.
    pub fn handle(&self) -> Result<std::fs::File> {
        self.controller
            .try_clone()
            .map_err(|e| Error::io("dup", "/dev/ptmx", e))
    }
}

/// What a terminal shows, read as it comes by a thread of its own (a read of a
/// terminal blocks until something is written or every writer is gone): for driving a
/// terminal as a person would, in tests and tools.
pub struct Screen {
    chunks: std::sync::mpsc::Receiver<Vec<u8>>,
    seen: String,
}

impl Screen {
    /// Reads `reader` (a [`Pty::handle`]) from now on.
    pub fn new(mut reader: std::fs::File) -> Screen {
        let (tx, chunks) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = std::io::Read::read(&mut reader, &mut buf) {
                if n == 0 || tx.send(buf.get(..n).unwrap_or_default().to_vec()).is_err() {
                    return;
                }
            }
        });
        Screen {
            chunks,
            seen: String::new(),
        }
    }

    /// Reads until `text` appears after what earlier calls consumed, and returns what
    /// was read up to and including it; `Err` with what it showed if `text` did not
    /// appear within `timeout` (or the terminal ended first).
    pub fn expect(
        &mut self,
        text: &str,
        timeout: std::time::Duration,
    ) -> std::result::Result<String, String> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if let Some(at) = self.seen.find(text) {
                let shown: String = self.seen.drain(..at + text.len()).collect();
                return Ok(shown);
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.chunks.recv_timeout(left) {
                Ok(b) => self.seen.push_str(&String::from_utf8_lossy(&b)),
                Err(e) => {
                    return Err(format!(
                        "{text:?} did not appear ({e}); the terminal showed {:?}",
                        self.seen
                    ));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    #[test]
    fn a_pty_carries_bytes_both_ways_and_keeps_its_size() {
        let (pty, replica) = Pty::open(Size {
            cols: 100,
            rows: 30,
        })
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            pty.size().ok(),
            Some(Size {
                cols: 100,
                rows: 30
            })
        );
        pty.resize(Size {
            cols: 132,
            rows: 43,
        })
        .unwrap_or_else(|e| panic!("{e}"));
        let w = rustix::termios::tcgetwinsize(&replica).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            (w.ws_col, w.ws_row),
            (132, 43),
            "the replica sees the new size"
        );
        let mut replica = std::fs::File::from(replica);
        let mut controller = pty.handle().unwrap_or_else(|e| panic!("{e}"));
        // Raw mode on the replica: bytes pass as they are (no echo, no line editing).
        let mut t = rustix::termios::tcgetattr(&replica).unwrap_or_else(|e| panic!("{e}"));
        t.make_raw();
        rustix::termios::tcsetattr(&replica, rustix::termios::OptionalActions::Now, &t)
            .unwrap_or_else(|e| panic!("{e}"));
        controller
            .write_all(b"in")
            .unwrap_or_else(|e| panic!("{e}"));
        let mut got = [0u8; 2];
        replica
            .read_exact(&mut got)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(&got, b"in");
        replica.write_all(b"out").unwrap_or_else(|e| panic!("{e}"));
        let mut got = [0u8; 3];
        controller
            .read_exact(&mut got)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(&got, b"out");
    }
}
