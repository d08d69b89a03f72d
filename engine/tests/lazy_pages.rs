//! Lazy restores on real runsc (`restore --lazy-pages`, the patched build of
//! hack/runsc/build.sh): a branch of a sandbox holding 256 MiB costs the memory it
//! touches, reads every byte right when it does touch them, checkpoints whole (a nested
//! fork sees its parent branch's writes and the pages it never touched), and keeps
//! reading after its image is deleted. The last test prints the memory of one branch
//! restored lazily, in the background and eagerly by the same runsc.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use ramify_engine::LocalSandbox;
use ramify_engine::engine::ForkOptions;
use ramify_engine::runsc::{Platform, RestorePages, Runsc, RunscConfig};

/// MiB the source holds in its tmpfs (/tmp is in the sandbox's memory).
const BIG_MIB: u64 = 256;

/// Urandom (nothing to share or compress) into the tmpfs, its checksum recorded, then
/// idle: the source's memory is the file.
fn source_script() -> String {
    format!(
        "dd if=/dev/urandom of=/tmp/big bs=1M count={BIG_MIB} 2>/dev/null && \
         md5sum /tmp/big > /tmp/big.md5 && echo ok > /tmp/ready; \
         while true; do sleep 1; done"
    )
}

fn current(restore_pages: RestorePages) -> RunscConfig {
    RunscConfig {
        binary: current_runsc(),
        restore_pages,
        ..RunscConfig::default()
    }
}

/// A harness on the current runsc in the mode `auto` picks, which must be lazy: a
/// runsc without the flag fails the test (it is the one these tests are about).
async fn lazy_harness(test: &str) -> Harness {
    let h = harness_with(test, current(RestorePages::Auto), None).await;
    let runsc = h.engine.runsc();
    assert!(
        runsc.caps().lazy_pages,
        "{} ({}) has no `restore --lazy-pages`: rebuild it with hack/runsc/build.sh",
        runsc.binary().display(),
        runsc.version()
    );
    assert_eq!(runsc.restore_pages(), RestorePages::Lazy);
    h
}

/// The source with its 256 MiB written; returns it and the checksum of its file.
async fn big_source(h: &Harness, name: &str) -> (LocalSandbox, String) {
    let sb = h.start(name, &source_script(), vec![]).await;
    let s = &sb;
    eventually(
        Duration::from_secs(180),
        &format!("{name} to write its {BIG_MIB} MiB"),
        || async move {
            let out = h.engine.exec(s, &["cat", "/tmp/ready"]).await.unwrap();
            (out.stdout_str().trim() == "ok").then_some(())
        },
    )
    .await;
    let md5 = h.sh(&sb, "cat /tmp/big.md5").await;
    (sb, checksum(&md5))
}

/// The hash of an `md5sum` line.
fn checksum(line: &str) -> String {
    let sum = line
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string();
    assert_eq!(sum.len(), 32, "not an md5sum line: {line:?}");
    sum
}

async fn md5(h: &Harness, sb: &LocalSandbox, path: &str) -> String {
    checksum(&h.sh(sb, &format!("md5sum {path}")).await)
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1024.0 * 1024.0))
}

/// The branch's cgroup memory once it stops changing (by under 1 MiB over half a
/// second): what a background restore settles at after loading every page, and
/// proof a lazy one loads nothing behind the application's back.
async fn settled_memory(h: &Harness, sb: &LocalSandbox) -> u64 {
    let last = std::cell::Cell::new(h.engine.memory_bytes(sb).unwrap());
    let last = &last;
    eventually(
        Duration::from_secs(60),
        &format!("the memory of {} to settle", sb.name),
        || async move {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let now = h.engine.memory_bytes(sb).unwrap();
            let prev = last.replace(now);
            (now.abs_diff(prev) < (1 << 20)).then_some(now)
        },
    )
    .await
}

async fn fork_one(h: &Harness, snapshot: &str, prefix: &str) -> LocalSandbox {
    let opts = ForkOptions {
        name_prefix: prefix.into(),
        ..ForkOptions::default()
    };
    h.engine
        .fork(snapshot, 1, &opts)
        .await
        .unwrap_or_else(|e| panic!("fork {prefix}: {e}"))
        .pop()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lazy_branch_holds_what_it_touched_and_reads_every_byte_right() {
    let h = lazy_harness("lazy-read").await;
    let (mut src, sum) = big_source(&h, "lazy-src").await;
    let src_before = h.engine.memory_bytes(&src).unwrap();
    let snap = h.engine.snapshot(&mut src, None).await.unwrap();
    let image = snap.meta.size_bytes;
    assert!(image >= BIG_MIB << 20, "image of {image} bytes");
    // The snapshot does not bill its source: the image's page cache, written by the
    // source's sentry, is charged to the node (engine/billing.rs). Before, the source
    // was charged the whole image on top of its own memory.
    let src_after = h.engine.memory_bytes(&src).unwrap();
    eprintln!(
        "source {} before its snapshot, {} after (image {})",
        mib(src_before),
        mib(src_after),
        mib(image)
    );
    assert!(
        src_after < src_before + (32 << 20),
        "the snapshot billed its source: {} -> {}",
        mib(src_before),
        mib(src_after)
    );
    assert!(
        !ramify_engine::cgroup::file("memory", &format!("{}-billing", src.cgroups_path()), "")
            .exists(),
        "the checkpoint's billing cgroup is left"
    );

    let branch = fork_one(&h, &snap.meta.id, "lazy").await;
    let at_restore = h.engine.memory_bytes(&branch).unwrap();
    let settled = settled_memory(&h, &branch).await;
    eprintln!(
        "lazy branch of a {} image: {} right after the restore, {} settled",
        mib(image),
        mib(at_restore),
        mib(settled)
    );
    for (when, m) in [
        ("right after the restore", at_restore),
        ("settled", settled),
    ] {
        assert!(
            m < image / 2,
            "a lazy branch holds {} {when}: not under half its {} image",
            mib(m),
            mib(image)
        );
    }

    // Every page, read from the image as it is touched, is the source's.
    assert_eq!(md5(&h, &branch, "/tmp/big").await, sum);
    let read_all = h.engine.memory_bytes(&branch).unwrap();
    eprintln!(
        "lazy branch after reading all {BIG_MIB} MiB: {}",
        mib(read_all)
    );
    assert!(
        read_all > settled,
        "reading every page loads them into the branch"
    );

    h.destroy_clean(branch).await;
    h.destroy_clean(src).await;
    h.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nested_fork_of_a_lazy_branch_has_its_writes_and_the_pages_it_never_touched() {
    let h = lazy_harness("lazy-nested").await;
    let (mut src, sum) = big_source(&h, "nest-src").await;
    let snap = h.engine.snapshot(&mut src, None).await.unwrap();
    h.destroy_clean(src).await;

    // The middle branch writes a file and a marker and touches nothing of /tmp/big:
    // its checkpoint must load those pages from the first image to be whole.
    let mut middle = fork_one(&h, &snap.meta.id, "nest-mid").await;
    h.sh(
        &middle,
        "dd if=/dev/urandom of=/tmp/mine bs=1M count=16 2>/dev/null && echo middle > /tmp/marker",
    )
    .await;
    let mine = md5(&h, &middle, "/tmp/mine").await;
    let nested = h.engine.snapshot(&mut middle, None).await.unwrap();
    // Nothing of the first image or the middle branch is left: the nested image stands
    // on its own.
    h.destroy_clean(middle).await;
    h.engine.store().remove(&snap.meta.id).unwrap();

    let leaf = fork_one(&h, &nested.meta.id, "nest-leaf").await;
    assert_eq!(h.sh(&leaf, "cat /tmp/marker").await.trim(), "middle");
    assert_eq!(md5(&h, &leaf, "/tmp/mine").await, mine);
    assert_eq!(md5(&h, &leaf, "/tmp/big").await, sum);

    h.destroy_clean(leaf).await;
    h.finish().await;
}

/// Processes holding a deleted file that was under `dir` open.
fn holders_of_deleted(dir: &Path) -> Vec<String> {
    let prefix = dir.display().to_string();
    let mut found = Vec::new();
    for p in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(fds) = std::fs::read_dir(p.path().join("fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            if let Ok(target) = std::fs::read_link(fd.path()) {
                let t = target.display().to_string();
                if t.starts_with(&prefix) && t.ends_with("(deleted)") {
                    found.push(format!("{} -> {t}", fd.path().display()));
                }
            }
        }
    }
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lazy_branch_reads_on_after_its_image_is_deleted() {
    let h = lazy_harness("lazy-deleted").await;
    let (mut src, sum) = big_source(&h, "del-src").await;
    let snap = h.engine.snapshot(&mut src, None).await.unwrap();
    h.destroy_clean(src).await;
    let branch = fork_one(&h, &snap.meta.id, "del").await;
    let image_dir = h.engine.store().dir().join(&snap.meta.id);

    let store = h.engine.store();
    let total = store.total_bytes().unwrap();
    assert!(
        store.images_read().contains_key(&snap.meta.id),
        "the branch reads no image file"
    );
    store.remove(&snap.meta.id).unwrap();
    assert!(!image_dir.exists());
    assert!(
        store.meta(&snap.meta.id).is_err(),
        "a deleted image is still found"
    );
    // The branch reads its pages file for its life: the image is held aside and still
    // counted by the store (its quota), never deleted under it or freed on paper only.
    assert_eq!(store.held().len(), 1);
    assert!(
        store.total_bytes().unwrap() >= total,
        "a deleted image a sandbox reads is not counted"
    );
    assert!(store.sweep_held().unwrap().is_empty());

    assert_eq!(md5(&h, &branch, "/tmp/big").await, sum);
    assert!(h.engine.is_running(&branch).await.unwrap());

    // Its last reader gone, it goes (teardown sweeps), and nothing holds its files.
    h.destroy_clean(branch).await;
    assert!(
        store.held().is_empty(),
        "the held image outlived its reader"
    );
    assert_eq!(store.total_bytes().unwrap(), 0);
    assert_eq!(holders_of_deleted(store.dir()), Vec::<String>::new());
    h.finish().await;
}

/// A pages file cut short under lazy branches (by anyone with root on the node): a
/// branch that reads a lost page gets no other bytes (gVisor stops it, and its ending
/// says why); one that has not read yet is seen at once and stopped by the engine with
/// the reason; a sibling on an intact copy of the same memory reads every byte right
/// and runs on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pages_file_cut_short_stops_its_branches_with_the_reason_and_spares_a_sibling() {
    let h = lazy_harness("lazy-cut").await;
    let (mut src, sum) = big_source(&h, "cut-src").await;
    // Two images of the same memory: one to cut, one intact.
    let cut = h.engine.snapshot(&mut src, None).await.unwrap();
    let intact = h.engine.snapshot(&mut src, None).await.unwrap();
    h.destroy_clean(src).await;
    let reader = fork_one(&h, &cut.meta.id, "cut-read").await;
    let idle = fork_one(&h, &cut.meta.id, "cut-idle").await;
    let sibling = fork_one(&h, &intact.meta.id, "intact").await;
    for b in [&reader, &idle, &sibling] {
        assert_eq!(h.engine.pages_lost(b), None, "{} lost nothing yet", b.name);
    }

    let (_, image) = h
        .engine
        .store()
        .verify(&cut.meta.id, h.engine.runsc().version())
        .unwrap();
    let pages = image.join(ramify_engine::engine::PAGES_FILE);
    let len = std::fs::metadata(&pages).unwrap().len();
    assert!(len > BIG_MIB << 20, "the pages file holds {len} bytes");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&pages)
        .unwrap()
        .set_len(len / 2)
        .unwrap();

    // Seen before anything reads: both branches of the cut image, not the sibling.
    for b in [&reader, &idle] {
        let why = h
            .engine
            .pages_lost(b)
            .expect("the cut pages file is not seen");
        assert!(why.contains("changed size"), "{why}");
    }
    assert_eq!(h.engine.pages_lost(&sibling), None);

    // A read of a lost page: an error, never other bytes; gVisor stops the sandbox.
    let out = h.engine.exec(&reader, &["md5sum", "/tmp/big"]).await;
    if let Ok(out) = &out {
        assert_ne!(
            out.code,
            0,
            "md5sum read a file cut short: {}",
            out.stdout_str()
        );
        assert!(
            !out.stdout_str().contains(&sum),
            "lost pages read back whole"
        );
    }
    // The other is stopped by the engine, as the node agent does on its next look.
    let why = h.engine.pages_lost(&idle).unwrap();
    h.engine.end_for_lost_pages(&idle, &why).await.unwrap();
    for (b, says) in [(&reader, "could not read a page"), (&idle, "changed size")] {
        let e = &h.engine;
        eventually(
            Duration::from_secs(30),
            &format!("{} to stop", b.name),
            || async move { (!e.is_running(b).await.unwrap()).then_some(()) },
        )
        .await;
        let ending = ramify_engine::exit_reason::observe(h.engine.runsc(), b);
        let said = ending
            .pages_lost
            .clone()
            .unwrap_or_else(|| panic!("the ending of {} does not say why: {ending:?}", b.name));
        assert!(said.contains(says), "{said}");
        println!("{} ended: {said}", b.name);
    }

    // The sibling reads every byte of the same memory from its own copy, and runs on.
    assert_eq!(md5(&h, &sibling, "/tmp/big").await, sum);
    assert!(h.engine.is_running(&sibling).await.unwrap());
    for b in [reader, idle, sibling] {
        h.destroy_clean(b).await;
    }
    h.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debians_runsc_restores_eagerly_and_refuses_lazy() {
    let _ = rootfs().await; // the tool check: runsc is installed
    let debian = |restore_pages| RunscConfig {
        binary: "/usr/bin/runsc".into(),
        platform: Platform::Ptrace,
        restore_pages,
        ..RunscConfig::default()
    };
    let r = Runsc::detect(debian(RestorePages::Auto)).await.unwrap();
    assert!(!r.caps().lazy_pages && !r.caps().background);
    assert_eq!(r.restore_pages(), RestorePages::Eager);
    let e = Runsc::detect(debian(RestorePages::Lazy))
        .await
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(e.contains("--restore-pages=lazy"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_of_a_branch_lazy_against_background_and_eager() {
    let lazy = lazy_harness("pages-lazy").await;
    // One store for all three, as one agent restarted in another mode would have.
    let state = lazy.engine.config().state_dir.clone();
    let background = harness_with(
        "pages-bg",
        current(RestorePages::Background),
        Some(state.clone()),
    )
    .await;
    let eager = harness_with("pages-eager", current(RestorePages::Eager), Some(state)).await;
    assert_eq!(
        background.engine.runsc().restore_pages(),
        RestorePages::Background
    );
    assert_eq!(eager.engine.runsc().restore_pages(), RestorePages::Eager);

    let (mut src, sum) = big_source(&lazy, "pages-src").await;
    let snap = lazy.engine.snapshot(&mut src, None).await.unwrap();
    lazy.destroy_clean(src).await;
    let image = snap.meta.size_bytes;

    let mut rows = Vec::new();
    for (mode, h) in [
        ("lazy", &lazy),
        ("background", &background),
        ("eager", &eager),
    ] {
        // Hashed here, so the fork's time is the restore's (and the image's page cache
        // is charged to this process, as to an agent, not to the branch).
        h.engine
            .store()
            .verify(&snap.meta.id, h.engine.runsc().version())
            .unwrap();
        let t = Instant::now();
        let b = fork_one(h, &snap.meta.id, &format!("pages-{mode}")).await;
        let fork = t.elapsed();
        let at_restore = h.engine.memory_bytes(&b).unwrap();
        let settled = settled_memory(h, &b).await;
        let t = Instant::now();
        assert_eq!(md5(h, &b, "/tmp/big").await, sum, "{mode}");
        let read = t.elapsed();
        let read_all = h.engine.memory_bytes(&b).unwrap();
        rows.push((mode, fork, at_restore, settled, read, read_all));
        h.destroy_clean(b).await;
    }
    eprintln!(
        "\nmemory of one branch of a sandbox holding {BIG_MIB} MiB (image {}), {}:",
        mib(image),
        lazy.engine.runsc().version()
    );
    eprintln!(
        "| restore | fork | right after restore | settled | md5sum of all | after reading all |"
    );
    eprintln!("|---|---|---|---|---|---|");
    for (mode, fork, at, settled, read, all) in &rows {
        eprintln!(
            "| {mode} | {:.0} ms | {} | {} | {:.0} ms | {} |",
            fork.as_secs_f64() * 1000.0,
            mib(*at),
            mib(*settled),
            read.as_secs_f64() * 1000.0,
            mib(*all)
        );
    }
    let settled = |m: &str| rows.iter().find(|r| r.0 == m).map(|r| r.3).unwrap();
    assert!(
        settled("lazy") * 2 < settled("background"),
        "lazy {} against background {}",
        mib(settled("lazy")),
        mib(settled("background"))
    );

    eager.finish().await;
    background.finish().await;
    lazy.finish().await;
}
