//! A hostile workload on real runsc: it plants hostile entries in its own control
//! mount, and a winner with hostile files (and a hostile `tar`) tries to promote
//! something outside the allowlist through commit Paths.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use ramify_engine::control::{EFFECTS_DIR, MAX_EFFECTS, Rejected, VERDICT_FILE, Verdict};
use ramify_engine::engine::{ForkOptions, LocalSandbox};

fn timed_scan(h: &Harness, sb: &LocalSandbox, what: &str) -> ramify_engine::control::ControlScan {
    let t = Instant::now();
    let s = h.engine.control(sb);
    let took = t.elapsed();
    eprintln!(
        "{what}: scan {took:?}, verdict {:?}, {} effects, rejected {:?}",
        s.verdict,
        s.effects.len(),
        s.rejected
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
    );
    assert!(took < Duration::from_secs(1), "{what}: scan took {took:?}");
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_control_mount_is_scanned_fast_bounded_and_reported() {
    let h = harness("hostile-ctl").await;
    let sb = h
        .start("evil", "while true; do sleep 1; done", vec![])
        .await;
    // A verdict that is a symlink to /etc/shadow, 5000 effect files.
    h.sh(
        &sb,
        "cd /run/ramify && ln -s /etc/shadow verdict && i=0; while [ $i -lt 5000 ]; do \
         echo '{\"kind\":\"k\"}' > effects/$i.json; i=$((i+1)); done",
    )
    .await;
    let s = timed_scan(&h, &sb, "verdict -> /etc/shadow, 5000 effects");
    assert_eq!(s.verdict, None);
    assert!(
        s.rejected
            .contains(&Rejected::NotRegular(VERDICT_FILE.into()))
    );
    assert!(s.effects.len() <= MAX_EFFECTS);
    assert!(s.rejected.contains(&Rejected::TooMany(MAX_EFFECTS)));

    // A 10 MiB verdict.
    h.sh(
        &sb,
        "cd /run/ramify && rm -rf verdict effects && mkdir effects && head -c 10485760 /dev/zero > verdict",
    )
    .await;
    let s = timed_scan(&h, &sb, "10 MiB verdict");
    assert_eq!(s.verdict, None);
    assert!(
        s.rejected
            .iter()
            .any(|r| matches!(r, Rejected::TooLarge(n, _) if n == VERDICT_FILE))
    );

    // A FIFO named verdict (the scanner must not block on it), if the gofer lets the
    // workload create one; and an effects dir that is a symlink to /etc.
    let fifo = h
        .engine
        .exec(
            &sb,
            &[
                "/bin/sh",
                "-c",
                "cd /run/ramify && rm -f verdict && mkfifo verdict",
            ],
        )
        .await
        .unwrap();
    h.sh(
        &sb,
        "cd /run/ramify && rm -rf effects && ln -s /etc effects",
    )
    .await;
    let s = timed_scan(&h, &sb, "FIFO verdict, effects -> /etc");
    eprintln!(
        "mkfifo in the control mount: exit {} {}",
        fifo.code,
        fifo.stderr_str().trim()
    );
    assert_eq!(s.verdict, None);
    assert!(s.effects.is_empty());
    assert!(
        s.rejected
            .contains(&Rejected::NotRegular(EFFECTS_DIR.into()))
    );
    // gVisor may keep a FIFO made on a gofer mount inside the sentry: the host
    // directory then holds nothing. Whatever is on the host is handled.
    let host_side = std::fs::symlink_metadata(sb.control_dir().join(VERDICT_FILE));
    eprintln!(
        "host side of the FIFO: {:?}",
        host_side.as_ref().map(|m| m.file_type())
    );
    if fifo.code == 0 && host_side.is_ok() {
        assert!(
            s.rejected
                .contains(&Rejected::NotRegular(VERDICT_FILE.into()))
        );
    }
    // Names that are control characters and garbage are reported escaped.
    h.sh(
        &sb,
        "cd /run/ramify && rm -f effects && mkdir effects && printf '{}' > \"effects/$(printf 'a\\033[31m\\nb').json\"",
    )
    .await;
    let s = timed_scan(&h, &sb, "escape sequence in a name");
    assert_eq!(s.rejected.len(), 1);
    assert!(!s.rejected[0].to_string().contains('\n'));
    assert!(!s.rejected[0].to_string().contains('\u{1b}'));
    h.destroy_clean(sb).await;
    h.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_paths_from_a_hostile_winner_promotes_nothing_outside_the_allowlist() {
    let h = harness("hostile-commit").await;
    let mut parent = h
        .start("parent", "while true; do sleep 1; done", vec![])
        .await;
    // The parent has a symlink under the allowlisted dir pointing at its /etc.
    h.sh(&parent, "ln -s /etc /work/plink && echo parent > /etc/mine")
        .await;
    let snap = h.engine.snapshot(&mut parent, None).await.unwrap();
    let opts = ForkOptions {
        name_prefix: "w".into(),
        track: vec!["/work/**".into()],
    };
    let mut ws = h.engine.fork(&snap.meta.id, 3, &opts).await.unwrap();
    let (w3, w2, w1) = (ws.pop().unwrap(), ws.pop().unwrap(), ws.pop().unwrap());
    let parent_passwd = h.sh(&parent, "cat /etc/passwd").await;

    // 1. Hostile files, honest tools: symlinks out of /work, a name with `..`, a name
    //    with a newline, a directory named with a newline, plus one legit file.
    h.sh(
        &w1,
        "echo pwned > /etc/passwd; ln -s /etc/passwd /work/evil; ln -s /etc /work/dirlink; \
         ln -s /nonexistent /work/dangling; ln -s loop /work/loop; \
         echo dots > '/work/a..b'; echo nl > \"/work/$(printf 'x\\ny')\"; \
         mkdir \"/work/$(printf 'd\\n')\" && mkdir -p \"/work/$(printf 'd\\n')/etc\" && echo nl2 > \"/work/$(printf 'd\\n')/etc/passwd\"; \
         echo legit > /work/legit.txt",
    )
    .await;
    let report = h
        .engine
        .commit_paths(&parent, &w1, &["/work/**".into()])
        .await
        .unwrap_or_else(|e| panic!("commit w1: {e}"));
    let promoted: Vec<&str> = report
        .diff
        .added
        .iter()
        .chain(&report.diff.modified)
        .map(|c| c.path.as_str())
        .collect();
    eprintln!("w1 promoted {promoted:?}, skipped {:?}", report.skipped);
    assert!(promoted.iter().all(|p| p.starts_with("/work/")));
    assert!(promoted.contains(&"/work/legit.txt"));
    assert!(promoted.contains(&"/work/a..b"));
    assert_eq!(h.sh(&parent, "cat /etc/passwd").await, parent_passwd);
    let ls = h.sh(&parent, "ls -A /work").await;
    for bad in ["evil", "dirlink", "dangling", "loop"] {
        assert!(!ls.contains(bad), "{bad} reached the parent: {ls}");
    }
    assert_eq!(h.sh(&parent, "cat /work/legit.txt").await, "legit\n");

    // 2. A hostile `tar` in the winner emits /etc/passwd along with the requested file.
    h.sh(
        &w2,
        "echo ok > /work/w2.txt && echo pwned > /etc/passwd && rm /bin/tar && \
         printf '#!/bin/sh\\ncd / && exec /bin/busybox tar -cf - etc/passwd work/w2.txt\\n' > /bin/tar && chmod +x /bin/tar",
    )
    .await;
    let err = h
        .engine
        .commit_paths(&parent, &w2, &["/work/**".into()])
        .await
        .expect_err("hostile tarball accepted");
    eprintln!("w2 (hostile tar): {err}");
    assert!(err.to_string().contains("etc/passwd"), "{err}");
    assert_eq!(h.sh(&parent, "cat /etc/passwd").await, parent_passwd);
    let out = h
        .engine
        .exec(&parent, &["cat", "/work/w2.txt"])
        .await
        .unwrap();
    assert_ne!(out.code, 0, "half of a refused commit reached the parent");

    // 3. The winner turns the parent's symlink /work/plink (-> /etc) into a real
    //    directory holding `mine`: unpacking it in the parent would write /etc/mine.
    h.sh(
        &w3,
        "rm /work/plink && mkdir /work/plink && echo pwned > /work/plink/mine",
    )
    .await;
    let err = h
        .engine
        .commit_paths(&parent, &w3, &["/work/**".into()])
        .await
        .expect_err("commit through a parent symlink accepted");
    eprintln!("w3 (through the parent's symlink): {err}");
    assert!(err.to_string().contains("/work/plink"), "{err}");
    assert_eq!(h.sh(&parent, "cat /etc/mine").await, "parent\n");

    for w in [w1, w2, w3] {
        h.destroy_clean(w).await;
    }
    h.destroy_clean(parent).await;
    h.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_paths_refuses_a_setuid_file_from_the_winner() {
    let h = harness("hostile-suid").await;
    let mut parent = h
        .start("parent", "while true; do sleep 1; done", vec![])
        .await;
    let snap = h.engine.snapshot(&mut parent, None).await.unwrap();
    let opts = ForkOptions {
        name_prefix: "s".into(),
        track: vec!["/work/**".into()],
    };
    let mut ws = h.engine.fork(&snap.meta.id, 1, &opts).await.unwrap();
    let w = ws.pop().unwrap();
    // A root-owned setuid (and a setgid) program next to an ordinary file.
    let modes = h
        .sh(
            &w,
            "cp /bin/busybox /work/suid && chmod 4755 /work/suid && \
             echo g > /work/sgid && chmod 2755 /work/sgid && echo ok > /work/plain && \
             stat -c '%a %n' /work/suid /work/sgid",
        )
        .await;
    assert_eq!(modes, "4755 /work/suid\n2755 /work/sgid\n", "setup");
    let err = h
        .engine
        .commit_paths(&parent, &w, &["/work/**".into()])
        .await
        .expect_err("setuid file promoted");
    eprintln!("setuid winner: {err}");
    let msg = err.to_string();
    assert!(msg.contains("setuid/setgid/sticky"), "{msg}");
    assert!(
        msg.contains("work/sgid") || msg.contains("work/suid"),
        "{msg}"
    );
    // Nothing of the refused commit reached the parent.
    let ls = h.sh(&parent, "ls -A /work").await;
    for f in ["suid", "sgid", "plain"] {
        assert!(!ls.contains(f), "{f} reached the parent: {ls}");
    }
    h.destroy_clean(w).await;
    h.destroy_clean(parent).await;
    h.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_paths_from_a_winner_whose_tar_floods_stdout_is_cut_off() {
    let h = harness("hostile-flood").await;
    let mut parent = h
        .start("parent", "while true; do sleep 1; done", vec![])
        .await;
    let snap = h.engine.snapshot(&mut parent, None).await.unwrap();
    let opts = ForkOptions {
        name_prefix: "f".into(),
        track: vec!["/work/**".into()],
    };
    let mut ws = h.engine.fork(&snap.meta.id, 1, &opts).await.unwrap();
    let w = ws.pop().unwrap();
    // The winner's `tar` writes forever.
    h.sh(
        &w,
        "echo ok > /work/flood.txt && rm /bin/tar && \
         printf '#!/bin/sh\\nexec /bin/busybox yes\\n' > /bin/tar && chmod +x /bin/tar",
    )
    .await;
    let t = Instant::now();
    let err = h
        .engine
        .commit_paths(&parent, &w, &["/work/**".into()])
        .await
        .expect_err("endless tarball accepted");
    let msg = err.to_string();
    eprintln!(
        "flooding tar, after {:?}: {}",
        t.elapsed(),
        msg.chars()
            .rev()
            .take(120)
            .collect::<String>()
            .chars()
            .rev()
            .collect::<String>()
    );
    assert!(
        matches!(
            err,
            ramify_engine::error::Error::OutputTooLarge { stream: "stdout", limit, .. }
                if limit == ramify_engine::cmd::MAX_STDOUT
        ),
        "{msg}"
    );
    assert!(msg.contains(&format!(
        "more than {} bytes",
        ramify_engine::cmd::MAX_STDOUT
    )));
    let out = h
        .engine
        .exec(&parent, &["cat", "/work/flood.txt"])
        .await
        .unwrap();
    assert_ne!(out.code, 0, "part of a refused commit reached the parent");
    h.destroy_clean(w).await;
    h.destroy_clean(parent).await;
    h.finish().await;
}

/// What a sandbox writes to `/run/ramify` lands on the node: it is a quota'd tmpfs, so a
/// workload cannot fill the node's disk (or its inode table) through it, and the agent
/// still reads the control files afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_control_mount_has_a_quota() {
    use ramify_engine::engine::{CONTROL_QUOTA_BYTES, CONTROL_QUOTA_INODES};
    let h = harness("ctl-quota").await;
    let sb = h
        .start("filler", "while true; do sleep 1; done", vec![])
        .await;
    let out = h
        .engine
        .exec(
            &sb,
            &[
                "/bin/sh",
                "-c",
                "head -c 209715200 /dev/zero > /run/ramify/fill",
            ],
        )
        .await
        .unwrap();
    eprintln!(
        "200 MiB into /run/ramify: exit {} {}",
        out.code,
        out.stderr_str().trim()
    );
    assert_ne!(out.code, 0, "200 MiB fit in the control mount");
    let on_host = std::fs::metadata(sb.control_dir().join("fill"))
        .unwrap()
        .len();
    assert!(
        on_host <= CONTROL_QUOTA_BYTES,
        "{on_host} bytes on the node"
    );
    h.sh(&sb, "rm /run/ramify/fill").await;

    h.sh(
        &sb,
        "i=0; while [ $i -lt 6000 ]; do touch /run/ramify/f$i 2>/dev/null || break; i=$((i+1)); done",
    )
    .await;
    let files = std::fs::read_dir(sb.control_dir()).unwrap().count() as u64;
    eprintln!("files the workload could create: {files}");
    assert!(files <= CONTROL_QUOTA_INODES, "{files} files");

    // The agent still reads the control mount: a verdict written now is seen.
    h.sh(
        &sb,
        "rm -f /run/ramify/f*; echo commit > /run/ramify/verdict",
    )
    .await;
    assert_eq!(h.engine.control(&sb).verdict, Some(Verdict::Commit));
    h.destroy_clean(sb).await;
    h.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workload_command_that_prints_without_end_costs_only_its_tail() {
    use ramify_engine::engine::RUN_OUTPUT_TAIL;
    let h = harness("hostile-chatty").await;
    let sb = h
        .start("chatty", "while true; do sleep 1; done", vec![])
        .await;
    // 64 MiB on stdout, then the exit code that decides the verdict.
    let out = h
        .engine
        .run_command(
            &sb,
            &[
                "/bin/sh".into(),
                "-c".into(),
                "head -c 67108864 /dev/zero; echo last-line; exit 7".into(),
            ],
            &[],
            Duration::from_secs(120),
        )
        .await
        .expect("a chatty command is not an error");
    assert_eq!(out.code, 7);
    assert_eq!(out.stdout.len(), RUN_OUTPUT_TAIL);
    assert!(out.stdout.ends_with(b"last-line\n"));
    h.destroy_clean(sb).await;
    h.finish().await;
}
