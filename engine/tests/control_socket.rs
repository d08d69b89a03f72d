//! Pause, resume and a restored branch's hostname through the sandbox's control socket,
//! on the pinned runsc (`hack/runsc/build.sh`, with `0003-control-is-paused.patch` and
//! `0004-control-set-hostname.patch`): the wire protocol
//! the agent speaks is pinned here, against the runsc it ships with. A runsc whose
//! control server changed (another method name, another reply shape, another socket
//! place) fails these tests, not a user's warm claim.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::*;
use ramify_engine::LocalSandbox;
use ramify_engine::freezer::{self, Depth, Way};
use ramify_engine::runsc::RunscConfig;
use ramify_engine::runsc::control::{self, Control};

/// Counts into the control directory, which the host sees: the test watches the
/// sandbox run or stand still without an exec (refused while it is paused).
const TICKER: &str = "i=0; while true; do i=$((i+1)); echo $i > /run/ramify/tick.tmp; mv /run/ramify/tick.tmp /run/ramify/tick; sleep 0.02; done";

async fn pinned(test: &str) -> Harness {
    harness_with(
        test,
        RunscConfig {
            binary: current_runsc(),
            ..RunscConfig::default()
        },
        None,
    )
    .await
}

/// A harness on the pinned runsc and a sandbox named `name` whose ticker runs.
async fn ticking(name: &str) -> (Harness, LocalSandbox, u64) {
    let h = pinned(name).await;
    let sb = h.start(name, TICKER, vec![]).await;
    let t = ticks_past(&sb, 0).await;
    (h, sb, t)
}

fn tick_file(sb: &LocalSandbox) -> PathBuf {
    sb.control_dir().join("tick")
}

fn tick(sb: &LocalSandbox) -> u64 {
    std::fs::read_to_string(tick_file(sb))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// Waits until the ticker has moved past `floor`.
async fn ticks_past(sb: &LocalSandbox, floor: u64) -> u64 {
    eventually(Duration::from_secs(30), "the ticker to move", || async {
        let t = tick(sb);
        (t > floor).then_some(t)
    })
    .await
}

/// The ticker stands still: the same value over a quarter of a second (it ticks
/// every 20 ms when it runs).
async fn stands_still(sb: &LocalSandbox) -> bool {
    let a = tick(sb);
    tokio::time::sleep(Duration::from_millis(250)).await;
    tick(sb) == a
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pinned_runsc_is_paused_and_resumed_through_its_control_socket() {
    let (h, sb, t0) = ticking("ctl").await;

    // Where runsc put the socket, and the method the patch adds.
    let path = control::socket_path(sb.ctx());
    assert!(path.exists(), "no control socket at {}", path.display());
    let support = h.engine.runsc().control_support().clone();
    let (c, paused) = Control::of(sb.ctx(), &support)
        .await
        .unwrap()
        .unwrap_or_else(|| {
            panic!(
                "{} answers no containerManager.IsPaused: rebuild it with hack/runsc/build.sh",
                h.engine.runsc().version()
            )
        });
    assert!(!paused, "a running sandbox says it is paused");
    assert_eq!(support.known(), Some(true));

    c.pause().await.unwrap();
    assert!(c.paused().await.unwrap());
    assert!(stands_still(&sb).await, "the sandbox ran on while paused");
    // runsc's own state file is not told (the agent's mark is: see below).
    let st = h.engine.runsc().state(sb.ctx()).await.unwrap();
    assert_eq!(st.status, "running");
    c.resume().await.unwrap();
    assert!(!c.paused().await.unwrap());
    let t1 = ticks_past(&sb, tick(&sb)).await;
    assert!(t1 > t0);

    // An unknown method is refused with the urpc error, not a hang or a crash.
    let e = control::call(
        &sb.id,
        &path,
        "containerManager.NoSuchThing",
        serde_json::Value::Null,
    )
    .await
    .unwrap_err();
    assert!(e.to_string().contains("unknown method"), "{e}");
    assert!(h.engine.is_running(&sb).await.unwrap());

    h.destroy_clean(sb).await;
    h.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agents_pauses_go_through_the_control_socket_and_never_nest() {
    let (h, sb, _) = ticking("ctlpause").await;
    let runsc = h.engine.runsc().clone();
    let pause = || freezer::pause(&runsc, sb.ctx(), &sb.dir, sb.cgroups_path(), Depth::Pause);
    let resume = || freezer::resume(&runsc, sb.ctx(), &sb.dir, sb.cgroups_path());

    pause().await.unwrap();
    assert_eq!(freezer::paused_by(&sb.dir), Some(Way::Control));
    assert!(stands_still(&sb).await);
    // An exec into it is refused at once, with the reason (it would wait otherwise).
    let e = h.engine.exec(&sb, &["true"]).await.unwrap_err();
    assert!(e.to_string().contains("paused"), "{e}");
    // Paused again (an agent that restarted): no second, nested pause, so one resume
    // lets it run.
    pause().await.unwrap();
    resume().await.unwrap();
    assert_eq!(freezer::paused_by(&sb.dir), None);
    let t = ticks_past(&sb, tick(&sb)).await;
    // A resume of a running sandbox is nothing (its kernel would panic on a second).
    resume().await.unwrap();
    ticks_past(&sb, t).await;

    // A mark left by an agent killed between the mark and the pause: the resume finds
    // the sandbox running and leaves it so; the next pause really pauses.
    std::fs::write(sb.dir.join("paused"), b"control").unwrap();
    resume().await.unwrap();
    let t = ticks_past(&sb, tick(&sb)).await;
    std::fs::write(sb.dir.join("paused"), b"control").unwrap();
    pause().await.unwrap();
    assert!(
        stands_still(&sb).await,
        "a pause over a stale mark did not pause"
    );
    resume().await.unwrap();
    ticks_past(&sb, t).await;

    // Frozen on top (a loser), thawed and resumed.
    freezer::pause(&runsc, sb.ctx(), &sb.dir, sb.cgroups_path(), Depth::Freeze)
        .await
        .unwrap();
    assert!(stands_still(&sb).await);
    resume().await.unwrap();
    ticks_past(&sb, tick(&sb)).await;

    // A look into a paused sandbox resumes it for the exec and pauses it again.
    pause().await.unwrap();
    let look = h.engine.look(&sb).await.unwrap();
    assert_eq!(h.sh(&sb, "echo seen").await.trim(), "seen");
    look.end().await.unwrap();
    assert_eq!(freezer::paused_by(&sb.dir), Some(Way::Control));
    assert!(stands_still(&sb).await);
    resume().await.unwrap();

    assert!(h.engine.is_running(&sb).await.unwrap());
    h.destroy_clean(sb).await;
    h.finish().await;
}

/// A pause made by `runsc pause` (an agent from before the control socket, whose mark
/// is empty) is resumed by `runsc resume`, and then runsc's state is right again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_made_by_the_runsc_cli_is_resumed_by_it() {
    let (h, sb, _) = ticking("clipause").await;
    let runsc = h.engine.runsc().clone();
    std::fs::write(sb.dir.join("paused"), b"").unwrap();
    runsc.pause(sb.ctx()).await.unwrap();
    assert_eq!(freezer::paused_by(&sb.dir), Some(Way::Cli));
    assert!(stands_still(&sb).await);
    freezer::resume(&runsc, sb.ctx(), &sb.dir, sb.cgroups_path())
        .await
        .unwrap();
    assert_eq!(runsc.state(sb.ctx()).await.unwrap().status, "running");
    ticks_past(&sb, tick(&sb)).await;
    assert_eq!(h.sh(&sb, "echo ok").await.trim(), "ok");
    h.destroy_clean(sb).await;
    h.finish().await;
}

/// What a pause and a resume cost each way, on one sandbox, in one run (printed, not
/// asserted: `make bench` has the figures).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_and_resume_each_way_timed() {
    let (h, sb, _) = ticking("ctltime").await;
    let runsc = h.engine.runsc().clone();
    let support = runsc.control_support().clone();
    let (c, _) = Control::of(sb.ctx(), &support).await.unwrap().unwrap();
    let (mut cli, mut ctl) = (Vec::new(), Vec::new());
    for _ in 0..7 {
        let t = Instant::now();
        runsc.pause(sb.ctx()).await.unwrap();
        runsc.resume(sb.ctx()).await.unwrap();
        cli.push(t.elapsed());
        let t = Instant::now();
        c.pause().await.unwrap();
        c.resume().await.unwrap();
        ctl.push(t.elapsed());
    }
    cli.sort();
    ctl.sort();
    eprintln!(
        "pause + resume, median of 7: runsc CLI {:?}, control socket {:?}",
        cli[3], ctl[3]
    );
    ticks_past(&sb, tick(&sb)).await;
    h.destroy_clean(sb).await;
    h.finish().await;
}

/// A hostname over the control socket (what a restored branch gets): the sandbox and
/// every exec see it at once, a name sethostname(2) refuses is refused with the reason,
/// and what each way costs, on one sandbox in one run (printed, not asserted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pinned_runsc_takes_a_hostname_through_its_control_socket() {
    let h = pinned("ctlhost").await;
    let sb = h.start("ctlhost", "sleep 100000", vec![]).await;
    let support = h.engine.runsc().hostname_support().clone();
    assert_eq!(support.known(), None);
    assert!(
        control::set_hostname(sb.ctx(), &support, "renamed-1")
            .await
            .unwrap(),
        "the pinned runsc has no SetHostname"
    );
    assert_eq!(support.known(), Some(true));
    assert_eq!(h.sh(&sb, "hostname").await.trim(), "renamed-1");
    assert_eq!(
        h.sh(&sb, "cat /proc/sys/kernel/hostname").await.trim(),
        "renamed-1"
    );
    let e = control::set_hostname(sb.ctx(), &support, &"h".repeat(65))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("longer than 64"), "{e}");
    assert_eq!(h.sh(&sb, "hostname").await.trim(), "renamed-1");

    let (mut exec, mut socket) = (Vec::new(), Vec::new());
    for i in 0..7 {
        let t = Instant::now();
        h.engine
            .exec_hostname(&sb, &format!("exec-{i}"))
            .await
            .unwrap();
        exec.push(t.elapsed());
        let t = Instant::now();
        h.engine
            .set_hostname(&sb, &format!("socket-{i}"))
            .await
            .unwrap();
        socket.push(t.elapsed());
    }
    assert_eq!(h.sh(&sb, "hostname").await.trim(), "socket-6");
    exec.sort();
    socket.sort();
    eprintln!(
        "a hostname, median of 7: runsc exec hostname {:?}, control socket {:?}",
        exec[3], socket[3]
    );
    h.destroy_clean(sb).await;
    h.finish().await;
}
