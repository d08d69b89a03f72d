//! Identity and control mount, egress policy, abort and failed-restore cleanup,
//! corrupted and foreign snapshots, warm pools: all on real runsc.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::*;
use ramify_node_agent::control::{Identity, Rejected, Verdict};
use ramify_node_agent::engine::ForkOptions;
use ramify_node_agent::error::Error;
use tokio::io::AsyncReadExt;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_branch_has_its_own_identity_and_control_files_reach_the_host() {
    let h = harness("identity").await;
    let mut parent = h
        .start(
            "parent",
            "cat /run/ramify/identity > /tmp/boot-identity; while true; do sleep 1; done",
            vec![],
        )
        .await;
    let parent_id: Identity =
        serde_json::from_str(&h.sh(&parent, "cat /run/ramify/identity").await).unwrap();
    let snap = h.engine.snapshot(&mut parent, None).await.unwrap();
    let branches = h
        .engine
        .fork(
            &snap.meta.id,
            3,
            &ForkOptions {
                name_prefix: "id".into(),
                track: vec![],
            },
        )
        .await
        .unwrap();
    let mut uids = HashSet::from([parent_id.uid.clone()]);
    for b in &branches {
        let seen: Identity =
            serde_json::from_str(&h.sh(b, "cat /run/ramify/identity").await).unwrap();
        assert_eq!(seen.name, b.name);
        assert_eq!(
            seen, b.identity,
            "branch reads a different identity than the agent issued"
        );
        assert_eq!(seen.snapshot.as_deref(), Some(snap.meta.id.as_str()));
        assert!(
            uids.insert(seen.uid.clone()),
            "identity uid reused: {}",
            seen.uid
        );
        // What the workload read before the snapshot is of course the parent's.
        assert!(
            h.sh(b, "cat /tmp/boot-identity")
                .await
                .contains("\"name\":\"parent\"")
        );
    }
    // Verdict and effects written inside a branch reach the host side (the control
    // mount is not overlaid with --overlay2=root:memory) and only that branch's dir.
    let (a, b) = (&branches[0], &branches[1]);
    h.sh(a, "echo commit > /run/ramify/verdict; echo '{\"kind\":\"deploy\",\"payload\":{\"env\":\"prod\"}}' > /run/ramify/effects/001.json; \
            echo 'garbage' > /run/ramify/effects/002.json; ln -s /etc/passwd /run/ramify/effects/003.json").await;
    h.sh(
        b,
        "echo abort > /run/ramify/verdict; echo maybe > /run/ramify/verdict.tmp",
    )
    .await;
    let sa = h.engine.control(a);
    assert_eq!(sa.verdict, Some(Verdict::Commit));
    assert_eq!(sa.effects.len(), 1);
    assert_eq!(sa.effects[0].kind, "deploy");
    assert!(
        sa.rejected
            .iter()
            .any(|r| matches!(r, Rejected::Malformed(f, _) if f == "002.json")),
        "{:?}",
        sa.rejected
    );
    assert!(
        sa.rejected
            .contains(&Rejected::NotRegular("003.json".into())),
        "{:?}",
        sa.rejected
    );
    assert_eq!(h.engine.control(b).verdict, Some(Verdict::Abort));
    assert_eq!(h.engine.control(&branches[2]).verdict, None);
    assert_eq!(h.engine.control(&parent).verdict, None);
    for b in branches {
        h.destroy_clean(b).await;
    }
    h.destroy_clean(parent).await;
    h.finish().await;
}

/// Accept one connection on the bridge gateway (an address of this machine) and
/// return what was sent, or None if nothing arrives in time.
async fn listen_once(l: tokio::net::TcpListener, wait: Duration) -> Option<String> {
    let accepted = tokio::time::timeout(wait, l.accept()).await.ok()?.ok()?;
    let mut s = accepted.0;
    let mut buf = String::new();
    let _ = tokio::time::timeout(Duration::from_secs(3), s.read_to_string(&mut buf)).await;
    Some(buf)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn egress_is_denied_by_default_and_opened_by_allowlist() {
    let h = harness("egress").await;
    let denied = h
        .start("denied", "while true; do sleep 1; done", vec![])
        .await;
    let allowed = h
        .start(
            "allowed",
            "while true; do sleep 1; done",
            vec![GATEWAY.parse().unwrap()],
        )
        .await;
    // The bridge (and its gateway address) exists once a sandbox is placed.
    let l = tokio::net::TcpListener::bind((GATEWAY, 0)).await.unwrap();
    let port = l.local_addr().unwrap().port();
    let got = tokio::spawn(listen_once(l, Duration::from_secs(6)));
    let out = h
        .engine
        .exec(
            &denied,
            &[
                "/bin/sh",
                "-c",
                &format!("echo from-denied | nc -w 2 {GATEWAY} {port}"),
            ],
        )
        .await
        .unwrap();
    assert_ne!(
        out.code,
        0,
        "denied sandbox connected out: {}",
        out.stdout_str()
    );
    assert_eq!(
        got.await.unwrap(),
        None,
        "the listener received a connection from the denied sandbox"
    );

    let l = tokio::net::TcpListener::bind((GATEWAY, 0)).await.unwrap();
    let port = l.local_addr().unwrap().port();
    let got = tokio::spawn(listen_once(l, Duration::from_secs(10)));
    h.sh(
        &allowed,
        &format!("echo from-allowed | nc -w 2 {GATEWAY} {port}"),
    )
    .await;
    assert_eq!(got.await.unwrap().as_deref(), Some("from-allowed\n"));
    // The sandboxes cannot reach each other either (isolated bridge ports).
    h.destroy_clean(denied).await;
    h.destroy_clean(allowed).await;
    h.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_and_failed_restore_leave_nothing_behind() {
    let h = harness("abort").await;
    // A private copy of the rootfs so it can be taken away to make a restore fail.
    let rootfs = h.dir.join("rootfs-copy");
    let st = std::process::Command::new("cp")
        .arg("-a")
        .arg(&h.rootfs)
        .arg(&rootfs)
        .status()
        .unwrap();
    assert!(st.success());
    let mut parent = h
        .engine
        .start(ramify_node_agent::StartRequest {
            name: "parent".into(),
            rootfs: ramify_node_agent::rootfs::RootfsSource::Dir(rootfs.clone()),
            workload: h.workload(COUNTER),
            egress_allow: vec![],
        })
        .await
        .unwrap();
    let snap = h.engine.snapshot(&mut parent, None).await.unwrap();
    // Abort a healthy branch.
    let mut br = h
        .engine
        .fork(&snap.meta.id, 1, &ForkOptions::default())
        .await
        .unwrap();
    h.sh(&br[0], "echo x > /work/x").await;
    h.destroy_clean(br.pop().unwrap()).await;
    // Abort the parent too, then make restores impossible: the lower rootfs is gone.
    h.destroy_clean(parent).await;
    std::fs::rename(&rootfs, h.dir.join("rootfs-gone")).unwrap();
    let err = h
        .engine
        .fork(&snap.meta.id, 2, &ForkOptions::default())
        .await
        .expect_err("restore without its rootfs must fail");
    eprintln!("failed restore reported: {err}");
    h.assert_no_leftovers_except(&[]).await;
    let sandboxes = std::fs::read_dir(h.dir.join("state/sandboxes"))
        .unwrap()
        .count();
    assert_eq!(sandboxes, 0, "sandbox directories left behind");
    h.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupted_or_foreign_snapshots_are_refused_before_restore() {
    let h = harness("corrupt").await;
    let mut parent = h.start("parent", COUNTER, vec![]).await;
    let snap = h.engine.snapshot(&mut parent, None).await.unwrap();
    h.destroy_clean(parent).await;
    let issued_before = h.engine.issued_ids().len();
    let dir = h.engine.store().dir().join(&snap.meta.id);
    // Flip one byte in the middle of the largest image file.
    let f = snap.meta.files.iter().max_by_key(|f| f.size).unwrap();
    let p = dir.join("image").join(&f.name);
    let mut bytes = std::fs::read(&p).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(&p, &bytes).unwrap();
    match h
        .engine
        .fork(&snap.meta.id, 1, &ForkOptions::default())
        .await
    {
        Err(Error::CorruptImage { file, .. }) => assert_eq!(file, f.name),
        other => panic!("expected CorruptImage, got {other:?}"),
    }
    assert_eq!(
        h.engine.issued_ids().len(),
        issued_before,
        "a sandbox was created from a corrupt image"
    );
    // Restore the byte; now pretend the image came from another runsc.
    bytes[mid] ^= 0x40;
    std::fs::write(&p, &bytes).unwrap();
    let meta_path = dir.join("meta.json");
    let mut meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&meta_path).unwrap()).unwrap();
    meta["runsc_version"] = "runsc version release-20990101.0".into();
    std::fs::write(&meta_path, serde_json::to_vec(&meta).unwrap()).unwrap();
    match h
        .engine
        .fork(&snap.meta.id, 1, &ForkOptions::default())
        .await
    {
        Err(e @ Error::VersionMismatch { .. }) => assert!(e.to_string().contains("20990101")),
        other => panic!("expected VersionMismatch, got {other:?}"),
    }
    assert_eq!(h.engine.issued_ids().len(), issued_before);
    h.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_pool_hands_out_frozen_branches_and_refills() {
    let h = harness("pool").await;
    let mut parent = h.start("parent", COUNTER, vec![]).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let v = h.counter(&parent).await;
    let snap = h.engine.snapshot(&mut parent, None).await.unwrap();
    let pool = h.engine.warm_pool(&snap.meta.id, 2);
    pool.wait_ready(2, Duration::from_secs(60)).await.unwrap();
    let t = std::time::Instant::now();
    let a = pool
        .claim("claimed-a", Duration::from_secs(30))
        .await
        .unwrap();
    let claim = t.elapsed();
    eprintln!("warm claim took {claim:?}");
    assert!(claim < Duration::from_millis(200), "claim took {claim:?}");
    let state = std::fs::read_to_string(ramify_node_agent::cgroup::freezer_state_path(
        a.cgroups_path(),
    ))
    .unwrap();
    assert_eq!(state.trim(), "THAWED");
    let c1 = h.counter(&a).await;
    assert!(
        c1 >= v,
        "claimed branch does not come from the snapshot ({c1} < {v})"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(h.counter(&a).await > c1, "claimed branch is not running");
    let id: Identity = serde_json::from_str(&h.sh(&a, "cat /run/ramify/identity").await).unwrap();
    assert_eq!(id.name, "claimed-a");
    // The pool refills in the background.
    pool.wait_ready(2, Duration::from_secs(60)).await.unwrap();
    let b = pool
        .claim("claimed-b", Duration::from_secs(30))
        .await
        .unwrap();
    let idb: Identity = serde_json::from_str(&h.sh(&b, "cat /run/ramify/identity").await).unwrap();
    assert_ne!(id.uid, idb.uid);
    pool.close().await.unwrap();
    h.destroy_clean(a).await;
    h.destroy_clean(b).await;
    h.destroy_clean(parent).await;
    h.assert_no_leftovers_except(&[]).await;
    h.finish().await;
}
