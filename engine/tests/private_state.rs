//! The agent's state is its own: after a sandbox ran, wrote to its control mount,
//! was snapshotted and forked, no file or directory under the engine's state is
//! readable by group or others. And a sandbox's rootfs is a read-only bind mount of
//! the directory that was checked, whatever happens to its path afterwards.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use common::*;
use ramify_engine::engine::ForkOptions;
use ramify_engine::error::Error;

/// Every path under `dir` whose mode lets group or others in. Not checked, and not
/// descended into: the mount points in `skip` (the sandboxes' read-only rootfs bind
/// mounts: the administrator's root filesystem) and what a workload wrote to its own
/// `/run/ramify` (below `sandboxes/<id>/control`: the gofer gives it the mode the
/// workload chose). Both sit in `sandboxes/<id>`, which must itself be 0700: nobody
/// else can reach them.
fn open_to_others(dir: &Path, skip: &[PathBuf]) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(p) = stack.pop() {
        let md = std::fs::symlink_metadata(&p).unwrap();
        if md.file_type().is_symlink() || skip.contains(&p) {
            continue;
        }
        let workload_written = p
            .ancestors()
            .skip(1)
            .any(|a| a.file_name().is_some_and(|n| n == "control"));
        if workload_written {
            continue;
        }
        if md.mode() & 0o077 != 0 {
            out.push(format!("{:o} {}", md.mode() & 0o7777, p.display()));
        }
        if md.is_dir() {
            for e in std::fs::read_dir(&p).unwrap() {
                stack.push(e.unwrap().path());
            }
        }
    }
    out
}

fn mount_options(point: &Path) -> Option<String> {
    let m = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    m.lines()
        .map(|l| l.split(' ').collect::<Vec<_>>())
        .find(|f| f.len() > 5 && Path::new(f[4]) == point)
        .map(|f| f[5].to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_state_file_is_readable_by_others_after_a_snapshot() {
    let h = harness("private").await;
    let mut parent = h.start("parent", COUNTER, vec![]).await;
    // What the workload writes through its control mount lands on the host (gofer).
    h.sh(&parent, "mkdir -p /run/ramify/effects && echo '{}' > /run/ramify/effects/a.json && echo abort > /run/ramify/verdict")
        .await;
    let snap = h.engine.snapshot(&mut parent, None).await.unwrap();
    let branches = h
        .engine
        .fork(&snap.meta.id, 1, &ForkOptions::default())
        .await
        .unwrap();
    let state = h.dir.join("state");
    let mounts: Vec<PathBuf> = [&parent, &branches[0]]
        .iter()
        .map(|s| s.rootfs_mount())
        .collect();
    for m in &mounts {
        let opts = mount_options(m).unwrap_or_else(|| panic!("{} is not a mount", m.display()));
        assert!(
            opts.split(',').any(|o| o == "ro"),
            "{}: {opts}",
            m.display()
        );
    }
    let image = state.join("snapshots").join(&snap.meta.id).join("image");
    let mut sealed = 0;
    for e in std::fs::read_dir(&image).unwrap() {
        let mode = e.unwrap().metadata().unwrap().mode() & 0o777;
        assert_eq!(mode, 0o400, "a sealed image file is owner read-only");
        sealed += 1;
    }
    assert!(sealed > 0);
    let open = open_to_others(&state, &mounts);
    // What the workload wrote is on the host, behind the sandbox's 0700 directories.
    let control = parent.control_dir();
    assert_eq!(
        std::fs::read_to_string(control.join("verdict")).unwrap(),
        "abort\n"
    );
    for d in [&parent.dir, &control] {
        let mode = std::fs::metadata(d).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o700, "{}", d.display());
    }
    assert!(
        open.is_empty(),
        "readable by others under the state:\n{}",
        open.join("\n")
    );
    for b in branches {
        h.destroy_clean(b).await;
    }
    h.destroy_clean(parent).await;
    h.finish().await;
}

/// The rootfs a sandbox gets is the directory that was resolved, not whatever its
/// path names later: a swap of the path (for a symlink to `/`) after the start does
/// not reach the running sandbox, and a fork, which resolves the path again, is
/// refused instead of following it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_swapped_rootfs_path_reaches_no_sandbox() {
    let h = harness("swap").await;
    let rootfs = h.own_rootfs("mine");
    std::fs::write(rootfs.join("work/which"), "original\n").unwrap();
    let mut sb = h.start_from("swap", &rootfs, COUNTER, vec![]).await;
    let snap = h.engine.snapshot(&mut sb, None).await.unwrap();
    // Swap: the checked directory moves away, a symlink to the node's / takes its path.
    std::fs::rename(&rootfs, h.dir.join(ROOTS).join("moved")).unwrap();
    std::os::unix::fs::symlink("/", &rootfs).unwrap();
    assert_eq!(h.sh(&sb, "cat /work/which").await, "original\n");
    // The node has /etc/os-release; the busybox rootfs has none.
    assert!(Path::new("/etc/os-release").exists());
    assert_eq!(
        h.sh(&sb, "test -e /etc/os-release && echo node || echo own")
            .await,
        "own\n",
        "the sandbox sees the node's /"
    );
    match h
        .engine
        .fork(&snap.meta.id, 1, &ForkOptions::default())
        .await
    {
        Err(Error::RootfsRefused(m)) => assert!(m.contains("leaves the rootfs root"), "{m}"),
        other => panic!("a fork through the swapped path must be refused: {other:?}"),
    }
    // Nothing the host does through the mount writes the administrator's rootfs.
    let err = std::fs::write(sb.rootfs_mount().join("work/x"), "x").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EROFS), "{err}");
    h.destroy_clean(sb).await;
    h.assert_no_leftovers_except(&[]).await;
    h.finish().await;
}
