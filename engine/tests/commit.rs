//! Branch isolation, commit Paths and commit Full on real runsc.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use ramify_engine::diff::Change;
use ramify_engine::engine::ForkOptions;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn branch_writes_are_private_until_commit_paths_promotes_exactly_the_allowlist() {
    let h = harness("paths").await;
    let mut parent = h
        .start("parent", "while true; do sleep 1; done", vec![])
        .await;
    h.sh(
        &parent,
        "mkdir -p /work/sub && echo parent-before > /work/sub/p.txt",
    )
    .await;
    let snap = h.engine.snapshot(&mut parent, None).await.unwrap();
    let opts = ForkOptions {
        name_prefix: "br".into(),
        track: vec!["/work/**".into(), "/etc/**".into()],
    };
    let mut branches = h.engine.fork(&snap.meta.id, 2, &opts).await.unwrap();
    let b = branches.pop().unwrap();
    let a = branches.pop().unwrap();

    // Branch A: add, modify, delete under /work; also touch things outside the allowlist.
    h.sh(
        &a,
        "echo new-file > /work/a.txt && echo changed > /work/seed.txt && rm /work/keep.txt \
              && echo x > /work/sub/q.bin && echo secret > /etc/app.conf && echo t > /tmp/scratch",
    )
    .await;
    // Invisible to sibling B and to the parent.
    for (who, sb) in [("B", &b), ("parent", &parent)] {
        let out = h
            .sh(
                sb,
                "cat /work/a.txt 2>/dev/null; cat /work/seed.txt; ls /work",
            )
            .await;
        assert!(!out.contains("new-file"), "{who} sees A's new file: {out}");
        assert!(
            out.contains("seed") && !out.contains("changed"),
            "{who} sees A's modification: {out}"
        );
        assert!(out.contains("keep.txt"), "{who} lost keep.txt: {out}");
    }
    // And the host rootfs (the shared lower layer) is untouched.
    assert_eq!(
        std::fs::read_to_string(h.rootfs.join("work/seed.txt")).unwrap(),
        "seed\n"
    );
    assert!(!h.rootfs.join("work/a.txt").exists());

    let report = h
        .engine
        .commit_paths(&parent, &a, &["/work/**".into()])
        .await
        .unwrap();
    assert_eq!(
        report.diff.added,
        vec![
            Change {
                path: "/work/a.txt".into(),
                size: 9
            },
            Change {
                path: "/work/sub/q.bin".into(),
                size: 2
            }
        ]
    );
    assert_eq!(
        report.diff.modified,
        vec![Change {
            path: "/work/seed.txt".into(),
            size: 8
        }]
    );
    assert_eq!(
        report.diff.deleted,
        vec![Change {
            path: "/work/keep.txt".into(),
            size: 5
        }]
    );
    assert_eq!(report.bytes, 19);

    let out = h
        .sh(
            &parent,
            "cat /work/a.txt /work/seed.txt /work/sub/q.bin /work/sub/p.txt; ls /work",
        )
        .await;
    assert_eq!(
        out,
        "new-file\nchanged\nx\nparent-before\na.txt\nseed.txt\nsub\n"
    );
    // Outside the allowlist nothing moved.
    let out = h
        .engine
        .exec(&parent, &["cat", "/etc/app.conf"])
        .await
        .unwrap();
    assert_ne!(
        out.code, 0,
        "non-allowlisted /etc/app.conf reached the parent"
    );
    let out = h
        .engine
        .exec(&parent, &["cat", "/tmp/scratch"])
        .await
        .unwrap();
    assert_ne!(out.code, 0);
    // B is still isolated from the commit.
    assert!(!h.sh(&b, "ls /work").await.contains("a.txt"));

    h.destroy_clean(a).await;
    h.destroy_clean(b).await;
    h.destroy_clean(parent).await;
    h.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_full_makes_the_winners_process_and_files_the_parents() {
    let h = harness("full").await;
    let mut parent = h.start("parent", COUNTER, vec![]).await;
    h.counter_past(&parent, 0).await;
    let snap = h.engine.snapshot(&mut parent, None).await.unwrap();
    let mut branches = h
        .engine
        .fork(&snap.meta.id, 2, &ForkOptions::default())
        .await
        .unwrap();
    let loser = branches.pop().unwrap();
    let winner = branches.pop().unwrap();
    // The winner gets its own file and a second, long-running process.
    h.sh(&winner, "echo won > /work/result.txt; (while true; do date +%s > /tmp/beat; sleep 0.1; done) >/dev/null 2>&1 &").await;
    h.sh(&parent, "echo parent-only > /work/parent.txt").await;
    let winner_id = winner.id.clone();
    let old_parent_id = parent.id.clone();
    let (old_dir, old_cg) = (parent.dir.clone(), parent.cgroups_path().to_string());
    let winner_count = h.counter(&winner).await;

    h.engine.commit_full(&mut parent, winner).await.unwrap();

    assert_eq!(
        parent.id, winner_id,
        "parent handle must point at the winner's container"
    );
    assert_eq!(parent.name, "parent");
    assert_eq!(h.sh(&parent, "cat /work/result.txt").await, "won\n");
    assert_ne!(
        h.engine
            .exec(&parent, &["cat", "/work/parent.txt"])
            .await
            .unwrap()
            .code,
        0
    );
    let c1 = h.counter(&parent).await;
    assert!(
        c1 >= winner_count,
        "counter went back: {winner_count} -> {c1}"
    );
    // The winner's counter loop runs on in the parent (the wait fails if it stopped).
    h.counter_past(&parent, c1).await;
    assert!(
        h.sh(&parent, "ps").await.contains("date +%s"),
        "winner's background process is gone"
    );
    // The identity seen inside is the parent's name now.
    assert!(
        h.sh(&parent, "cat /run/ramify/identity")
            .await
            .contains("\"name\":\"parent\"")
    );
    // The old parent is gone completely.
    let left = h.engine.leftovers(&old_parent_id, &old_dir, &old_cg).await;
    assert!(left.is_empty(), "old parent left {left:#?}");

    h.destroy_clean(loser).await;
    h.destroy_clean(parent).await;
    h.assert_no_leftovers_except(&[]).await;
    h.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nested_fork_commits_into_its_parent_branch_not_the_root() {
    let h = harness("nested").await;
    let mut root = h
        .start("root", "while true; do sleep 1; done", vec![])
        .await;
    let s1 = h.engine.snapshot(&mut root, None).await.unwrap();
    let mut level1 = h
        .engine
        .fork(
            &s1.meta.id,
            1,
            &ForkOptions {
                name_prefix: "l1".into(),
                track: vec![],
            },
        )
        .await
        .unwrap();
    let mut mid = level1.pop().unwrap();
    h.sh(&mid, "echo mid > /work/mid.txt").await;
    // The branch is itself a source: snapshot and fork it again.
    let s2 = h.engine.snapshot(&mut mid, None).await.unwrap();
    let opts = ForkOptions {
        name_prefix: "l2".into(),
        track: vec!["/work/**".into()],
    };
    let mut level2 = h.engine.fork(&s2.meta.id, 1, &opts).await.unwrap();
    let leaf = level2.pop().unwrap();
    assert_eq!(h.sh(&leaf, "cat /work/mid.txt").await, "mid\n");
    h.sh(&leaf, "echo leaf > /work/leaf.txt").await;
    let report = h
        .engine
        .commit_paths(&mid, &leaf, &["/work/**".into()])
        .await
        .unwrap();
    assert_eq!(report.diff.added.len(), 1);
    assert_eq!(h.sh(&mid, "cat /work/leaf.txt").await, "leaf\n");
    assert_ne!(
        h.engine
            .exec(&root, &["cat", "/work/leaf.txt"])
            .await
            .unwrap()
            .code,
        0,
        "nested commit leaked into the root"
    );
    assert_ne!(
        h.engine
            .exec(&root, &["cat", "/work/mid.txt"])
            .await
            .unwrap()
            .code,
        0
    );
    h.destroy_clean(leaf).await;
    h.destroy_clean(mid).await;
    h.destroy_clean(root).await;
    h.finish().await;
}

/// A Paths commit applies all or nothing: when one of its paths cannot be written in
/// the parent (here the parent turned a directory the winner writes into into a file),
/// none of the others is, and no staging directory is left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paths_commit_that_cannot_apply_fully_applies_nothing() {
    let h = harness("atomic").await;
    let mut parent = h
        .start("parent", "while true; do sleep 1; done", vec![])
        .await;
    h.sh(&parent, "mkdir -p /work/x && echo old > /work/a.txt")
        .await;
    let snap = h.engine.snapshot(&mut parent, None).await.unwrap();
    let opts = ForkOptions {
        name_prefix: "w".into(),
        track: vec!["/work/**".into()],
    };
    let w = h
        .engine
        .fork(&snap.meta.id, 1, &opts)
        .await
        .unwrap()
        .pop()
        .unwrap();
    // Sorted, /work/a.txt comes before /work/x/y: a plain unpack would write it first.
    h.sh(
        &w,
        "echo new > /work/a.txt && echo y > /work/x/y && rm /work/seed.txt",
    )
    .await;
    h.sh(&parent, "rmdir /work/x && echo file > /work/x").await;
    let err = h
        .engine
        .commit_paths(&parent, &w, &["/work/**".into()])
        .await
        .expect_err("a commit that cannot apply was accepted");
    eprintln!("refused: {err}");
    assert!(err.to_string().contains("nothing applied"), "{err}");
    assert!(err.to_string().contains("/work/x"), "{err}");
    let state = h
        .sh(
            &parent,
            "cat /work/a.txt /work/x /work/seed.txt; ls -a / | grep -c ramify-commit || true",
        )
        .await;
    assert_eq!(state, "old\nfile\nseed\n0\n", "the parent changed");

    // Once the parent's obstacle is gone, the same commit applies in full.
    h.sh(&parent, "rm /work/x").await;
    h.engine
        .commit_paths(&parent, &w, &["/work/**".into()])
        .await
        .unwrap();
    let state = h
        .sh(
            &parent,
            "cat /work/a.txt /work/x/y; test -e /work/seed.txt || echo gone; ls -a / | grep -c ramify-commit || true",
        )
        .await;
    assert_eq!(state, "new\ny\ngone\n0\n");
    h.destroy_clean(w).await;
    h.destroy_clean(parent).await;
    h.finish().await;
}
