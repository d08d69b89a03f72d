//! An interactive exec on real runsc: a shell on a terminal shows its prompt and runs
//! what is typed, sees its terminal's size and a resize, is interrupted by ^C like a
//! shell at a keyboard, and exits with its code; and a piped stdin reaches a command
//! whole (10 MiB).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use common::*;
use ramify_engine::tty::{Pty, Screen, Size};
use tokio::io::AsyncWriteExt;

/// How long a test waits for a terminal to show something.
const WAIT: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shell_on_a_terminal_runs_what_is_typed_resizes_is_interrupted_and_exits_with_its_code() {
    let h = harness_with(
        "exec-tty",
        ramify_engine::runsc::RunscConfig {
            binary: current_runsc(),
            ..Default::default()
        },
        None,
    )
    .await;
    let sb = h.start("tty", "while true; do sleep 1; done", vec![]).await;

    let (pty, replica) = Pty::open(Size { cols: 90, rows: 30 }).unwrap();
    let dup = || Stdio::from(replica.try_clone().unwrap());
    let cmd = h
        .engine
        .exec_command(&sb, &["/bin/sh".to_string()], true)
        .unwrap();
    let mut child = cmd.spawn_with(dup(), dup(), dup()).unwrap();
    drop(replica);
    let mut keys = tokio::fs::File::from_std(pty.handle().unwrap());
    let mut screen = Screen::new(pty.handle().unwrap());
    // Its own prompt first (what is typed before it is echoed by the terminal as it
    // comes); then one set by hand, written so that its echo is not the prompt.
    screen.expect("# ", WAIT).unwrap();
    keys.write_all(b"PS1='rea''dy> '\n").await.unwrap();
    screen.expect("ready> ", WAIT).unwrap();
    // (`tty` would say "not a tty": gVisor's terminal from the host has no name in
    // the sandbox's /dev; `test -t` asks what matters, isatty.)
    keys.write_all(b"test -t 0 && test -t 1 && echo term$((6*7))\n")
        .await
        .unwrap();
    let shown = screen.expect("ready> ", WAIT).unwrap();
    assert!(shown.contains("term42"), "no terminal: {shown:?}");

    // Its size, then a resize. (What a command prints is told from the echo of what
    // was typed by arithmetic: `Z$((2+0))Z` prints `Z2Z`.)
    keys.write_all(b"stty size; echo Z$((1+0))Z\n")
        .await
        .unwrap();
    let shown = screen.expect("Z1Z", WAIT).unwrap();
    assert!(shown.contains("30 90"), "{shown:?}");
    pty.resize(Size {
        cols: 132,
        rows: 43,
    })
    .unwrap();
    keys.write_all(b"stty size; echo Z$((2+0))Z\n")
        .await
        .unwrap();
    let shown = screen.expect("Z2Z", WAIT).unwrap();
    assert!(shown.contains("43 132"), "after the resize: {shown:?}");

    // ^C interrupts the foreground command, not the shell.
    keys.write_all(b"sleep 100; echo sl$((0))ept\n")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let t0 = Instant::now();
    keys.write_all(b"\x03").await.unwrap();
    keys.write_all(b"echo Z$((3+0))Z\n").await.unwrap();
    let shown = screen.expect("Z3Z", WAIT).unwrap();
    assert!(
        t0.elapsed() < Duration::from_secs(20),
        "^C took {:?}",
        t0.elapsed()
    );
    assert!(!shown.contains("sl0ept"), "{shown:?}");

    keys.write_all(b"exit 3\n").await.unwrap();
    let st = tokio::time::timeout(Duration::from_secs(30), child.wait())
        .await
        .expect("the shell did not exit")
        .unwrap();
    assert_eq!(st.code(), Some(3));

    // A piped stdin, whole: 10 MiB through `wc -c`.
    let mut child = h
        .engine
        .exec_command(&sb, &["wc".to_string(), "-c".to_string()], false)
        .unwrap()
        .spawn_with(Stdio::piped(), Stdio::piped(), Stdio::piped())
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let feed = tokio::spawn(async move {
        stdin.write_all(&vec![b'x'; 10 << 20]).await.unwrap();
    });
    let out = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
        .await
        .expect("wc did not end")
        .unwrap();
    feed.await.unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "10485760");

    h.destroy_clean(sb).await;
    h.finish().await;
}
