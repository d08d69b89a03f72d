//! Identity per fork on real runsc: every branch restored from one snapshot reads fresh
//! bytes from /dev/urandom, has its own identity (uid, seed) and its own hostname; what
//! a process drew *before* the snapshot is, necessarily, the same in every branch.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::*;
use ramify_engine::control::Identity;
use ramify_engine::engine::{ForkOptions, LocalSandbox};

/// Every 100 ms: `<n> <drawn before the snapshot> <fresh read> <read on an fd opened
/// before the snapshot> <hostname>`. `PRE` is a shell variable filled once at boot (a buffered
/// secret), fd 3 stays open on /dev/urandom across checkpoint and restore.
const RANDOM_LOOP: &str = r#"PRE=$(head -c16 /dev/urandom | od -An -tx1 | tr -d ' \n')
exec 3</dev/urandom
i=0
while true; do
  i=$((i+1))
  NOW=$(head -c16 /dev/urandom | od -An -tx1 | tr -d ' \n')
  FD=$(head -c16 <&3 | od -An -tx1 | tr -d ' \n')
  echo "$i $PRE $NOW $FD $(hostname)" >> /tmp/rand
  sleep 0.1
done"#;

struct Line {
    n: u64,
    pre: String,
    now: String,
    fd: String,
    host: String,
}

async fn lines(h: &Harness, sb: &LocalSandbox) -> Vec<Line> {
    h.sh(sb, "cat /tmp/rand")
        .await
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() == 5 && f[1..4].iter().all(|x| x.len() == 32)).then(|| Line {
                n: f[0].parse().unwrap(),
                pre: f[1].into(),
                now: f[2].into(),
                fd: f[3].into(),
                host: f[4].into(),
            })
        })
        .collect()
}

fn identity_of(raw: &str) -> Identity {
    serde_json::from_str(raw).unwrap_or_else(|e| panic!("identity {raw:?}: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn branches_read_fresh_urandom_and_get_their_own_identity_and_hostname() {
    let h = harness("urandom").await;
    let mut parent = h.start("parent", RANDOM_LOOP, vec![]).await;
    h.written(&parent, "/tmp/rand").await;
    let parent_id = identity_of(&h.sh(&parent, "cat /run/ramify/identity").await);
    assert_eq!(parent_id.hostname.as_deref(), Some("sandbox"));
    assert_eq!(h.sh(&parent, "hostname").await.trim(), "sandbox");
    let boot_parent = h
        .sh(
            &parent,
            "cat /proc/sys/kernel/random/boot_id 2>/dev/null || echo absent",
        )
        .await;

    let snap = h.engine.snapshot(&mut parent, None).await.unwrap();
    // Lines the parent had written when it was checkpointed are in every branch.
    let at_snapshot = lines(&h, &parent).await.len() as u64;
    let branches = h
        .engine
        .fork(
            &snap.meta.id,
            3,
            &ForkOptions {
                name_prefix: "rnd".into(),
                track: vec![],
            },
        )
        .await
        .unwrap_or_else(|e| panic!("fork: {e}"));
    // The parent draws on after the snapshot too: its reads join the ones no branch
    // may repeat.
    let parent_lines = eventually(
        Duration::from_secs(30),
        "the parent to draw again after the snapshot",
        || async {
            let ls = lines(&h, &parent).await;
            (ls.len() as u64 > at_snapshot + 1).then_some(ls)
        },
    )
    .await;
    let pre = parent_lines[0].pre.clone();
    let mut seen_now: HashSet<String> = parent_lines.iter().map(|l| l.now.clone()).collect();
    let mut seen_fd: HashSet<String> = parent_lines.iter().map(|l| l.fd.clone()).collect();
    let mut uids = HashSet::from([parent_id.uid.clone()]);
    let mut seeds = HashSet::from([parent_id.seed.clone()]);
    let mut hostnames = HashSet::from(["sandbox".to_string()]);
    let mut exec_reads = HashSet::new();
    for b in &branches {
        // Wait (bounded) until the branch has drawn a few times after its restore: each
        // line costs several process spawns, slow under ptrace on a busy machine.
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let mut ls = lines(&h, b).await;
        while ls.iter().filter(|l| l.n > at_snapshot + 1).count() < 3
            && std::time::Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(200)).await;
            ls = lines(&h, b).await;
        }
        let fresh: Vec<&Line> = ls.iter().filter(|l| l.n > at_snapshot + 1).collect();
        assert!(
            fresh.len() >= 3,
            "branch {} wrote only {} lines after its restore",
            b.name,
            fresh.len()
        );
        for l in &fresh {
            // Drawn before the snapshot: the same bytes in every branch (the limit).
            assert_eq!(l.pre, pre, "buffered randomness differs in {}", b.name);
            // Read after the restore: never seen in the parent or a sibling.
            assert!(
                seen_now.insert(l.now.clone()),
                "branch {} read bytes from /dev/urandom that another branch or the parent also read: {}",
                b.name,
                l.now
            );
            assert!(
                seen_fd.insert(l.fd.clone()),
                "branch {} read repeated bytes through an fd opened before the snapshot: {}",
                b.name,
                l.fd
            );
        }
        let r = h
            .sh(b, "head -c16 /dev/urandom | od -An -tx1 | tr -d ' \\n'")
            .await;
        assert_eq!(r.len(), 32);
        assert!(
            exec_reads.insert(r),
            "two branches' execs read the same bytes"
        );

        let id = identity_of(&h.sh(b, "cat /run/ramify/identity").await);
        assert_eq!(id, b.identity);
        assert_eq!(id.snapshot.as_deref(), Some(snap.meta.id.as_str()));
        assert!(uids.insert(id.uid.clone()), "uid reused: {}", id.uid);
        assert_eq!(id.seed.len(), 64);
        assert!(id.seed.bytes().all(|c| c.is_ascii_hexdigit()));
        assert!(seeds.insert(id.seed.clone()), "seed reused: {}", id.seed);
        let host = id
            .hostname
            .clone()
            .unwrap_or_else(|| panic!("branch {} has no hostname of its own", b.name));
        assert!(host.starts_with("sandbox-") && host.len() <= 63, "{host}");
        assert_eq!(h.sh(b, "hostname").await.trim(), host);
        assert_eq!(h.sh(b, "cat /proc/sys/kernel/hostname").await.trim(), host);
        assert!(hostnames.insert(host.clone()), "hostname reused: {host}");
        // gVisor restores the UTS namespace from the checkpoint (the restore spec's
        // hostname is ignored): right after the restore the branch still has the
        // parent's hostname, until the agent's `hostname` exec lands.
        let before: Vec<&str> = fresh
            .iter()
            .map(|l| l.host.as_str())
            .filter(|x| *x != host)
            .collect();
        assert!(before.iter().all(|x| *x == "sandbox"), "{before:?}");
        assert_eq!(fresh[fresh.len() - 1].host, host);
        eprintln!(
            "{}: {} post-restore line(s) still showed the snapshot's hostname",
            b.name,
            before.len()
        );
        eprintln!(
            "{}: hostname {host}, uid {}, pre {}, fresh reads {} .. {}",
            b.name,
            id.uid,
            fresh[0].pre,
            fresh[0].now,
            fresh[fresh.len() - 1].now
        );
        let boot = h
            .sh(
                b,
                "cat /proc/sys/kernel/random/boot_id 2>/dev/null || echo absent",
            )
            .await;
        eprintln!(
            "{}: boot_id {} (parent {})",
            b.name,
            boot.trim(),
            boot_parent.trim()
        );
    }
    // The parent keeps the spec's hostname.
    assert_eq!(h.sh(&parent, "hostname").await.trim(), "sandbox");
    for b in branches {
        h.destroy_clean(b).await;
    }
    h.destroy_clean(parent).await;
    h.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_pool_claims_get_fresh_identity_and_keep_their_own_hostname() {
    let h = harness("warm-identity").await;
    let mut parent = h.start("parent", RANDOM_LOOP, vec![]).await;
    h.written(&parent, "/tmp/rand").await;
    let snap = h.engine.snapshot(&mut parent, None).await.unwrap();
    let pool = h.engine.warm_pool(&snap.meta.id, 2);
    pool.wait_ready(2, Duration::from_secs(60)).await.unwrap();
    let a = pool
        .claim_as("wa", 0, Duration::from_secs(30))
        .await
        .unwrap();
    let b = pool
        .claim_as("wb", 1, Duration::from_secs(30))
        .await
        .unwrap();
    let mut hosts = HashSet::new();
    let mut reads = HashSet::new();
    for sb in [&a, &b] {
        let id = identity_of(&h.sh(sb, "cat /run/ramify/identity").await);
        assert_eq!(id, sb.identity, "claimed branch reads a stale identity");
        assert_eq!(id.name, sb.name);
        let host = id.hostname.clone().expect("warm branch hostname");
        assert_eq!(h.sh(sb, "hostname").await.trim(), host);
        assert!(hosts.insert(host));
        let r = h
            .sh(sb, "head -c16 /dev/urandom | od -An -tx1 | tr -d ' \\n'")
            .await;
        assert!(reads.insert(r));
    }
    assert_ne!(a.identity.seed, b.identity.seed);
    pool.close().await.unwrap();
    h.destroy_clean(a).await;
    h.destroy_clean(b).await;
    h.destroy_clean(parent).await;
    h.finish().await;
}
