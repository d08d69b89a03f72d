//! Identity and control mount, egress policy, abort and failed-restore cleanup,
//! corrupted and foreign snapshots, warm pools: all on real runsc.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::HashSet;
use std::path::Path;
use std::time::Duration;

use common::*;
use ramify_engine::control::{Identity, Rejected, Verdict};
use ramify_engine::engine::ForkOptions;
use ramify_engine::error::Error;

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn egress_is_denied_by_default_and_opened_by_allowlist() {
    let h = harness("egress").await;
    // The destination is off this host (the host itself is never reachable, see
    // a_sandbox_has_no_route_to_the_host_even_with_egress_to_everywhere).
    let ext = ExtNet::new();
    let denied = h
        .start("denied", "while true; do sleep 1; done", vec![])
        .await;
    let allowed = h
        .start(
            "allowed",
            "while true; do sleep 1; done",
            vec![format!("{}/32", ext.ip).parse().unwrap()],
        )
        .await;
    let (port, got) = ext.listen_once(Duration::from_secs(6));
    let out = h
        .engine
        .exec(
            &denied,
            &[
                "/bin/sh",
                "-c",
                &format!("echo from-denied | nc -w 2 {} {port}", ext.ip),
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
        got.join().unwrap(),
        None,
        "the listener received a connection from the denied sandbox"
    );

    let (port, got) = ext.listen_once(Duration::from_secs(10));
    h.sh(
        &allowed,
        &format!("echo from-allowed | nc -w 2 {} {port}", ext.ip),
    )
    .await;
    assert_eq!(got.join().unwrap().as_deref(), Some("from-allowed\n"));
    h.destroy_clean(denied).await;
    h.destroy_clean(allowed).await;
    drop(ext);
    h.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_and_failed_restore_leave_nothing_behind() {
    let h = harness("abort").await;
    // A private copy of the rootfs so it can be taken away to make a restore fail.
    let rootfs = h.own_rootfs("rootfs-copy");
    let mut parent = h.start_from("parent", &rootfs, COUNTER, vec![]).await;
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
    let v = h.counter_past(&parent, 0).await;
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
    assert!(
        !ramify_engine::freezer::is_paused(&a.dir),
        "a claimed branch is handed out paused"
    );
    let c1 = h.counter(&a).await;
    assert!(
        c1 >= v,
        "claimed branch does not come from the snapshot ({c1} < {v})"
    );
    // The claimed branch runs (the wait fails if it stayed frozen).
    h.counter_past(&a, c1).await;
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

/// A gate with room for every restore (the agent's is its fair admission gate).
struct Unbounded;

impl ramify_engine::engine::RestoreSlots for Unbounded {
    fn acquire<'a>(
        &'a self,
        _key: &'a str,
        _group: &'a str,
    ) -> futures::future::BoxFuture<'a, Box<dyn Send>> {
        Box::pin(async { Box::new(()) as Box<dyn Send> })
    }
    fn leave(&self, _key: &str) {}
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_restored_once_hands_out_its_branches_then_refuses_at_once() {
    let h = harness("pool-once").await;
    let mut parent = h.start("parent", COUNTER, vec![]).await;
    h.counter_past(&parent, 0).await;
    let snap = h.engine.snapshot(&mut parent, None).await.unwrap();
    let pool = h.engine.warm_pool_once(
        &snap.meta.id,
        2,
        std::sync::Arc::new(Unbounded),
        "once".into(),
    );
    // Claims wait for branches still restoring.
    let a = pool
        .claim_as("a", 0, Duration::from_secs(60))
        .await
        .unwrap();
    let b = pool
        .claim_as("b", 1, Duration::from_secs(60))
        .await
        .unwrap();
    let ida: Identity = serde_json::from_str(&h.sh(&a, "cat /run/ramify/identity").await).unwrap();
    let idb: Identity = serde_json::from_str(&h.sh(&b, "cat /run/ramify/identity").await).unwrap();
    assert_eq!((ida.name.as_str(), idb.name.as_str()), ("a", "b"));
    // Nothing more comes: no refill, and a claim says so at once.
    let t = std::time::Instant::now();
    let err = pool
        .claim_as("c", 2, Duration::from_secs(30))
        .await
        .unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    assert!(err.to_string().contains("handed out"), "{err}");
    assert!(pool.exhausted());
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(pool.ready(), 0, "a pool restored once never refills");
    pool.close().await.unwrap();
    h.destroy_clean(a).await;
    h.destroy_clean(b).await;
    h.destroy_clean(parent).await;
    h.assert_no_leftovers_except(&[]).await;
    h.finish().await;
}

/// Every address of this host except loopback (the sandbox's own loopback is its own),
/// IPv6 link-local ones scoped to the sandbox's link.
fn host_addresses() -> Vec<String> {
    let out = std::process::Command::new("ip")
        .args(["-o", "addr", "show"])
        .output()
        .unwrap();
    let mut addrs: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(3))
        .filter_map(|a| a.split('/').next())
        .filter(|a| !a.starts_with("127.") && *a != "::1")
        .map(|a| {
            if a.starts_with("fe80:") {
                format!("{a}%eth0")
            } else {
                a.to_string()
            }
        })
        .collect();
    addrs.sort();
    addrs.dedup();
    addrs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_has_no_route_to_the_host_even_with_egress_to_everywhere() {
    use std::io::{Read, Write};
    use std::sync::{Arc, Mutex};
    let h = harness("no-host").await;
    // "Everywhere else": a separate network namespace the sandbox must reach.
    let ext = ExtNet::new();
    let sb = h
        .start(
            "open",
            "while true; do sleep 1; done",
            vec!["0.0.0.0/0".parse().unwrap()],
        )
        .await;
    // One listener on every address of the host (dual-stack: 0.0.0.0 and ::), keeping
    // what each connection sends.
    let l = std::net::TcpListener::bind("[::]:0").unwrap();
    let port = l.local_addr().unwrap().port();
    l.set_nonblocking(true).unwrap();
    let got: Arc<Mutex<Vec<String>>> = Arc::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let acceptor = {
        let (got, stop) = (got.clone(), stop.clone());
        std::thread::spawn(move || {
            let keep = |(mut s, peer): (std::net::TcpStream, std::net::SocketAddr)| {
                s.set_nonblocking(false).unwrap();
                s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
                let mut buf = String::new();
                let _ = s.read_to_string(&mut buf);
                got.lock().unwrap().push(format!("{peer}: {}", buf.trim()));
            };
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                match l.accept() {
                    Ok(c) => keep(c),
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
            // Whatever reached the listener before the stop is in its backlog: drain
            // it, so a connection from the sandbox cannot go unseen.
            while let Ok(c) = l.accept() {
                keep(c);
            }
        })
    };
    // The listener is reachable from the host itself (so silence below means blocked).
    for a in ["127.0.0.1", GATEWAY, "::1"] {
        let mut s = std::net::TcpStream::connect((a, port))
            .unwrap_or_else(|e| panic!("host cannot reach its own listener on {a}: {e}"));
        s.write_all(format!("from-host-{a}").as_bytes()).unwrap();
    }
    // The sandbox reaches the outside: 0.0.0.0/0 opens egress.
    let (ext_port, ext_got) = ext.listen_once(Duration::from_secs(10));
    h.sh(
        &sb,
        &format!("echo from-open | nc -w 2 {} {ext_port}", ext.ip),
    )
    .await;
    assert_eq!(ext_got.join().unwrap().as_deref(), Some("from-open\n"));

    // And none of the host's addresses, tried all at once.
    let targets = host_addresses();
    assert!(targets.iter().any(|t| t == GATEWAY), "{targets:?}");
    let script = format!(
        "for t in {}; do (echo from-sandbox-$t | nc -w 3 $t {port} >/dev/null 2>&1; echo \"$t $?\") & done; wait",
        targets.join(" ")
    );
    let out = h.sh(&sb, &script).await;
    eprintln!("host addresses tried from the sandbox (address, nc exit):\n{out}");
    // Every nc has exited (the script waits for them): what they sent is in the
    // listener's backlog, drained once the host's own three connections are in.
    eventually(
        Duration::from_secs(10),
        "the host's own connections to reach the listener",
        || async {
            let got = got.lock().unwrap();
            ["127.0.0.1", GATEWAY, "::1"]
                .iter()
                .all(|a| got.iter().any(|g| g.ends_with(&format!("from-host-{a}"))))
                .then_some(())
        },
    )
    .await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    acceptor.join().unwrap();
    let got = got.lock().unwrap().clone();
    eprintln!("the host listener received: {got:#?}");
    for a in ["127.0.0.1", GATEWAY, "::1"] {
        assert!(
            got.iter().any(|g| g.ends_with(&format!("from-host-{a}"))),
            "{got:?}"
        );
    }
    let leaked: Vec<&String> = got.iter().filter(|g| g.contains("from-sandbox")).collect();
    assert!(
        leaked.is_empty(),
        "the sandbox reached the host: {leaked:#?}"
    );
    let connected: Vec<&str> = out.lines().filter(|l| l.ends_with(" 0")).collect();
    assert!(
        connected.is_empty(),
        "nc connected from the sandbox to host addresses: {connected:?}"
    );
    assert_eq!(out.lines().count(), targets.len(), "{out}");
    h.destroy_clean(sb).await;
    drop(ext);
    h.finish().await;
}

/// A sandbox id of this test process, for a placement made without an engine.
fn placement_id() -> String {
    format!(
        "{PREFIX}{}-{}",
        std::process::id(),
        &uuid::Uuid::new_v4().simple().to_string()[..10]
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orphan_sweep_removes_every_rule_of_a_dead_owners_placement() {
    use ramify_engine::placement::{Placement, PlacementRequest, chain_name};
    let h = harness("sweep").await;
    let p = standalone();
    // An owner pid above the kernel's pid_max limit (2^22): never alive.
    let id = format!(
        "{PREFIX}4194305-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..10]
    );
    let chain = chain_name(&id);
    let placed = p
        .place(&PlacementRequest {
            id: id.clone(),
            egress_allow: vec!["0.0.0.0/0".parse().unwrap()],
            pod_uid: None,
        })
        .await
        .unwrap();
    let rules = iptables_lines_mentioning(&[&id, &chain]);
    eprintln!("rules of the placement: {rules:#?}");
    assert!(
        rules
            .iter()
            .any(|l| l.starts_with("-A INPUT ") && l.contains(&id) && l.ends_with("-j DROP")),
        "no host-input rule: {rules:#?}"
    );
    assert!(
        rules
            .iter()
            .any(|l| l.starts_with("-A FORWARD ") && l.contains(&chain)),
        "no egress rule: {rules:#?}"
    );
    let swept = ramify_engine::sweep::sweep_orphans(PREFIX, "/ramify-test").await;
    eprintln!("swept: {swept:#?}");
    let left = iptables_lines_mentioning(&[&id, &chain]);
    assert!(left.is_empty(), "the sweep left {left:#?}");
    assert!(!Path::new("/run/netns").join(&id).exists());
    // The sweep does not release IP leases; the release does (and tolerates the rest gone).
    let _ = p.release(&placed).await;
    h.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_into_a_full_store_fails_cleanly_and_leaves_the_source_running() {
    let h = harness("full-store").await;
    // Only the snapshot store is on the small file system: the sandbox itself runs.
    let store = h.engine.store().dir().to_path_buf();
    let tmpfs = Tmpfs::mount(&store, "8m");
    let mut sb = h.start("big", COUNTER, vec![]).await;
    // 48 MiB of incompressible memory (/tmp is in the sandbox's memory overlay) does
    // not fit in 8 MiB.
    let sum = h
        .sh(
            &sb,
            "head -c 50331648 /dev/urandom > /tmp/big && sha256sum /tmp/big",
        )
        .await;
    let before = h.counter(&sb).await;
    let err = h
        .engine
        .snapshot(&mut sb, None)
        .await
        .expect_err("a 48 MiB image fit in an 8 MiB store");
    let msg = err.to_string();
    eprintln!("snapshot into a full store: {msg}");
    assert!(
        msg.contains("no space left") && msg.contains("ENOSPC"),
        "no clear reason: {msg}"
    );
    assert!(
        msg.contains(&store.display().to_string()),
        "the store is not named: {msg}"
    );
    // The source runs on, unchanged.
    assert!(h.engine.is_running(&sb).await.unwrap(), "source stopped");
    assert_eq!(h.sh(&sb, "sha256sum /tmp/big").await, sum);
    // The source's counter runs on (the wait fails if it stopped).
    h.counter_past(&sb, before).await;
    // Nothing half-written stays in the store, and the space is free again.
    let left: Vec<_> = std::fs::read_dir(&store)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "store keeps {left:?}");
    assert!(h.engine.store().list().unwrap().is_empty());
    h.destroy_clean(sb).await;
    drop(tmpfs);
    h.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_removes_the_input_jump_of_a_placement_made_by_an_older_agent() {
    use ramify_engine::placement::{Placement, PlacementRequest, chain_name};
    let h = harness("legacy-release").await;
    let p = standalone();
    let id = placement_id();
    let chain = chain_name(&id);
    let placed = p
        .place(&PlacementRequest {
            id: id.clone(),
            egress_allow: vec![],
            pod_uid: None,
        })
        .await
        .unwrap();
    // Turn it into what an older agent made: INPUT jumped into the egress chain.
    let ip = placed.address.as_ref().unwrap().ip;
    let comment = format!("ramify:{id}");
    let ipt = |args: &[&str]| {
        let out = std::process::Command::new("iptables")
            .args(["-w", "5"])
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "iptables {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let input: Vec<String> = iptables_lines_mentioning(&[&id])
        .into_iter()
        .filter(|l| l.starts_with("-A INPUT "))
        .collect();
    assert_eq!(input.len(), 1, "{input:?}");
    let del: Vec<String> = input[0]
        .split_whitespace()
        .skip(1)
        .map(|s| s.trim_matches('"').to_string())
        .collect();
    let mut args = vec!["-D"];
    args.extend(del.iter().map(String::as_str));
    ipt(&args);
    ipt(&[
        "-I",
        "INPUT",
        "1",
        "-s",
        &format!("{ip}/32"),
        "-m",
        "comment",
        "--comment",
        &comment,
        "-j",
        &chain,
    ]);
    p.release(&placed)
        .await
        .unwrap_or_else(|e| panic!("release of an older placement: {e}"));
    let left = iptables_lines_mentioning(&[&id, &chain]);
    assert!(left.is_empty(), "release left {left:#?}");
    assert!(!Path::new("/run/netns").join(&id).exists());
    h.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_whose_workload_exits_stops_running_and_a_live_one_keeps_running() {
    use ramify_engine::procfs::proc_start_time;
    let h = harness("exit").await;
    let quitter = h.start("quitter", "sleep 1; exit 0", vec![]).await;
    let runner = h
        .start("runner", "while true; do sleep 1; done", vec![])
        .await;
    assert!(h.engine.is_running(&quitter).await.unwrap());
    assert!(h.engine.is_running(&runner).await.unwrap());
    // The sandbox process runsc names: alive, with a stable start time.
    let pid = i32::try_from(h.engine.runsc().state(quitter.ctx()).await.unwrap().pid).unwrap();
    let started = proc_start_time(pid).expect("sandbox process alive");
    // The same process `runsc run` wrote to its pid file: the agent trusts that one
    // without asking runsc.
    assert_eq!(
        ramify_engine::runsc::Runsc::sandbox_pid(quitter.ctx()),
        Some(pid)
    );
    // ...and its command line names the sandbox (what the agent checks before trusting
    // a pid file).
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
    assert!(
        cmdline
            .windows(quitter.id.len())
            .any(|w| w == quitter.id.as_bytes()),
        "{}",
        String::from_utf8_lossy(&cmdline)
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while h.engine.is_running(&quitter).await.unwrap() {
        assert!(
            std::time::Instant::now() < deadline,
            "a sandbox whose workload exited still counts as running"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // runsc agrees, and the process is gone (or a zombie) or is another one.
    assert_eq!(
        h.engine.runsc().state(quitter.ctx()).await.unwrap().status,
        "stopped"
    );
    assert_ne!(proc_start_time(pid), Some(started));
    assert!(h.engine.is_running(&runner).await.unwrap());
    // A restored branch's pid file names its sandbox process too.
    let mut runner = runner;
    let snap = h.engine.snapshot(&mut runner, None).await.unwrap();
    let branch = h
        .engine
        .fork(&snap.meta.id, 1, &ForkOptions::default())
        .await
        .unwrap()
        .pop()
        .unwrap();
    let st = h.engine.runsc().state(branch.ctx()).await.unwrap();
    assert_eq!(st.status, "running");
    assert_eq!(
        ramify_engine::runsc::Runsc::sandbox_pid(branch.ctx()).map(i64::from),
        Some(st.pid)
    );
    assert!(h.engine.is_running(&branch).await.unwrap());
    h.destroy_clean(branch).await;
    h.destroy_clean(quitter).await;
    h.destroy_clean(runner).await;
    h.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_of_a_half_made_placement_removes_its_rules_and_frees_its_address() {
    use ramify_engine::placement::{Placement, PlacementRequest, chain_name};
    let h = harness("half-made").await;
    let p = standalone();
    let id = placement_id();
    let chain = chain_name(&id);
    let mut placed = p
        .place(&PlacementRequest {
            id: id.clone(),
            egress_allow: vec![],
            pod_uid: None,
        })
        .await
        .unwrap();
    let ip = placed.address.as_ref().unwrap().ip.to_string();
    let lease = std::env::temp_dir()
        .join("ramify-test/ipam")
        .join(format!("ramify-{BRIDGE}"))
        .join(&ip);
    assert!(lease.exists(), "no lease file {}", lease.display());
    assert!(!iptables_lines_mentioning(&[&id]).is_empty());
    // What a crash between placement and the sandbox's record leaves the agent to
    // clean up from its directory alone: the id, the chain name, the netns, no address.
    placed.address = None;
    placed.host_veth = None;
    p.release(&placed)
        .await
        .unwrap_or_else(|e| panic!("release of a half-made placement: {e}"));
    let left = iptables_lines_mentioning(&[&id, &chain]);
    assert!(left.is_empty(), "release left {left:#?}");
    assert!(!lease.exists(), "the address {ip} is still leased");
    assert!(!Path::new("/run/netns").join(&id).exists());
    // A retry of a teardown that failed later on (a process slow to die) releases
    // again: what is gone already is no error.
    p.release(&placed)
        .await
        .unwrap_or_else(|e| panic!("a second release of the same placement: {e}"));
    h.finish().await;
}

/// A sandbox busy with system calls survives being paused and resumed again and again,
/// as decided branches and warm-pool branches are. The cgroup freezer did not: on
/// systrap a task frozen inside a seccomp user-notification loses it, and the Sentry
/// then dies with SIGSEGV ("failed waiting for seccomp notify ... no such file"), seen
/// once in about 40 commit races; `freezer::pause` stops the tasks through runsc.
#[tokio::test]
async fn a_busy_sandbox_survives_many_pauses_and_resumes() {
    let h = harness("pauses").await;
    // Many short system calls, all the time (each `echo` into a file is several).
    let sb = h
        .start(
            "busy",
            "i=0; while true; do i=$((i+1)); echo $i > /tmp/counter; echo $i > /dev/null; done",
            vec![],
        )
        .await;
    let v = h.counter_past(&sb, 0).await;
    let runsc = h.engine.runsc().clone();
    for round in 0..40 {
        ramify_engine::freezer::pause(
            &runsc,
            sb.ctx(),
            &sb.dir,
            sb.cgroups_path(),
            ramify_engine::freezer::Depth::Pause,
        )
        .await
        .unwrap_or_else(|e| panic!("pause {round}: {e}"));
        assert!(ramify_engine::freezer::is_paused(&sb.dir));
        ramify_engine::freezer::resume(&runsc, sb.ctx(), &sb.dir, sb.cgroups_path())
            .await
            .unwrap_or_else(|e| panic!("resume {round}: {e}"));
        assert!(!ramify_engine::freezer::is_paused(&sb.dir));
    }
    assert!(
        h.engine.is_running(&sb).await.unwrap(),
        "the sandbox died while paused and resumed"
    );
    // It still works and runs on from where it was.
    h.counter_past(&sb, v).await;
    h.destroy_clean(sb).await;
    h.finish().await;
}

/// The agent marks a pause in the sandbox's directory before it runs `runsc pause`, so
/// that a pause is never forgotten. Killed between the two, it leaves a mark on a
/// running sandbox: the next resume (a winner thawed for its commit) must not fail on
/// it forever (`runsc resume` refuses a running sandbox), and the next pause must
/// really pause. Seen in the cluster fault matrix: the winner's commit retried
/// `runsc resume` until the set timed out.
#[tokio::test]
async fn a_pause_mark_left_by_a_killed_agent_is_mended() {
    let h = harness("pausemark").await;
    let sb = h
        .start(
            "marked",
            "i=0; while true; do i=$((i+1)); echo $i > /tmp/counter; sleep 0.05; done",
            vec![],
        )
        .await;
    let v = h.counter_past(&sb, 0).await;
    let runsc = h.engine.runsc().clone();
    let mark = sb.dir.join("paused");
    use ramify_engine::freezer;
    // Marked, never paused: the resume succeeds and clears the mark.
    std::fs::write(&mark, b"").unwrap();
    assert!(freezer::is_paused(&sb.dir));
    freezer::resume(&runsc, sb.ctx(), &sb.dir, sb.cgroups_path())
        .await
        .unwrap_or_else(|e| panic!("resume of a marked, running sandbox: {e}"));
    assert!(!freezer::is_paused(&sb.dir));
    let v = h.counter_past(&sb, v).await;
    // Marked, never paused: a pause pauses it.
    std::fs::write(&mark, b"").unwrap();
    freezer::pause(
        &runsc,
        sb.ctx(),
        &sb.dir,
        sb.cgroups_path(),
        freezer::Depth::Pause,
    )
    .await
    .unwrap_or_else(|e| panic!("pause of a marked, running sandbox: {e}"));
    assert_eq!(runsc.state(sb.ctx()).await.unwrap().status, "paused");
    freezer::resume(&runsc, sb.ctx(), &sb.dir, sb.cgroups_path())
        .await
        .unwrap_or_else(|e| panic!("resume: {e}"));
    h.counter_past(&sb, v).await;
    h.destroy_clean(sb).await;
    h.finish().await;
}
