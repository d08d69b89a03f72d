//! The gVisor platform on real runsc: `auto` takes systrap where it works and falls back
//! to ptrace (saying why), snapshots record their platform, and an image restores on
//! another platform only where that was seen to work.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use ramify_engine::engine::ForkOptions;
use ramify_engine::error::Error;
use ramify_engine::platform;
use ramify_engine::runsc::{Platform, RunscConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_takes_systrap_where_it_works_and_falls_back_to_ptrace_saying_why() {
    let _ = rootfs().await; // the tool check: runsc is installed
    let current = current_runsc();
    let d = platform::resolve(&current, Platform::Auto).await.unwrap();
    assert_eq!(d.platform, Platform::Systrap, "{}", d.reason);
    assert_eq!(d.requested, Platform::Auto);
    // Debian's 2022 runsc has no systrap: ptrace, with runsc's own words for why.
    let d = platform::resolve(std::path::Path::new("/usr/bin/runsc"), Platform::Auto)
        .await
        .unwrap();
    assert_eq!(d.platform, Platform::Ptrace);
    assert!(
        d.reason.contains("systrap does not work") && d.reason.contains("unknown platform"),
        "{}",
        d.reason
    );
    // The runsc the suite runs on (RAMIFY_RUNSC or Debian's) gets its engines the same
    // answer, and its sandboxes run with it.
    let h = harness("platform-auto").await;
    let p = h.engine.runsc().platform().platform;
    assert_ne!(p, Platform::Auto);
    let mut sb = h.start("auto", COUNTER, vec![]).await;
    let snap = h.engine.snapshot(&mut sb, None).await.unwrap();
    assert_eq!(snap.meta.platform.as_deref(), Some(p.as_str()));
    h.destroy_clean(sb).await;
    h.finish().await;
}

async fn counter_advances(h: &Harness, sb: &ramify_engine::LocalSandbox) {
    let first = h.counter(sb).await;
    poll_until("the restored counter advances", 20, async || {
        h.counter(sb).await > first
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ptrace_image_forks_on_systrap_and_a_systrap_image_is_refused_on_ptrace() {
    let current = current_runsc();
    let on = |p: Platform| RunscConfig {
        binary: current.clone(),
        platform: p,
        ..RunscConfig::default()
    };
    let ptrace = harness_with("plat-ptrace", on(Platform::Ptrace), None).await;
    // Both engines share one snapshot store, as one agent restarted on another
    // platform would.
    let state = ptrace.engine.config().state_dir.clone();
    let systrap = harness_with("plat-systrap", on(Platform::Systrap), Some(state)).await;
    assert_eq!(ptrace.engine.runsc().platform().platform, Platform::Ptrace);
    assert_eq!(
        systrap.engine.runsc().platform().platform,
        Platform::Systrap
    );

    // ptrace -> systrap: the branch continues the source's processes, and its system
    // calls work (the upgrade path from agents that only ran ptrace).
    let mut src = ptrace.start("on-ptrace", COUNTER, vec![]).await;
    counter_advances(&ptrace, &src).await;
    let snap = ptrace.engine.snapshot(&mut src, None).await.unwrap();
    assert_eq!(snap.meta.platform.as_deref(), Some("ptrace"));
    let branch = systrap
        .engine
        .fork(&snap.meta.id, 1, &ForkOptions::default())
        .await
        .unwrap()
        .pop()
        .unwrap();
    counter_advances(&systrap, &branch).await;
    let out = systrap
        .sh(
            &branch,
            "dd if=/dev/zero of=/dev/null bs=1 count=10000 2>&1",
        )
        .await;
    assert!(out.contains("10000+0 records out"), "{out}");
    assert!(systrap.engine.is_running(&branch).await.unwrap());

    // systrap -> ptrace: refused before runsc runs, with the reason.
    let mut src2 = systrap.start("on-systrap", COUNTER, vec![]).await;
    let snap2 = systrap.engine.snapshot(&mut src2, None).await.unwrap();
    assert_eq!(snap2.meta.platform.as_deref(), Some("systrap"));
    let before = ptrace.engine.issued_ids().len();
    match ptrace
        .engine
        .fork(&snap2.meta.id, 1, &ForkOptions::default())
        .await
    {
        Err(e @ Error::PlatformMismatch { .. }) => {
            let msg = e.to_string();
            assert!(
                msg.contains("systrap") && msg.contains("ptrace") && msg.contains("SIGSEGV"),
                "{msg}"
            );
        }
        other => panic!("a systrap image restored on ptrace: {other:?}"),
    }
    assert_eq!(
        ptrace.engine.issued_ids().len(),
        before,
        "a refused restore must not start a sandbox"
    );

    systrap.destroy_clean(branch).await;
    systrap.destroy_clean(src2).await;
    ptrace.destroy_clean(src).await;
    systrap.finish().await;
    ptrace.finish().await;
}
