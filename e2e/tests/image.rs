//! Sandboxes from container images (`spec.image`), against the real test registry
//! (`hack/registry/up.sh`: distribution on loopback, `private/*` behind htpasswd) with
//! the test images (`hack/images/build.sh`), real runsc and the real kube-apiserver.
//!
//! Run under the runsc lock: `flock -o /tmp/ramify-runsc.lock cargo test -p ramify-e2e
//! --test image -- --nocapture --test-threads 1`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, DeleteParams, PostParams};
use ramify_crds::{Sandbox, SandboxPhase, Snapshot, SnapshotPhase};
use ramify_e2e::system::System;

/// The test registry (`ramify_e2e::registry`: distribution on loopback, `private/*`
/// behind htpasswd, the test images pushed), as these tests read it.
struct Registry(std::sync::Arc<ramify_e2e::registry::Registry>);

/// One System at a time: every operator binds any unbound Sandbox (see system.rs).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

impl Registry {
    fn shared() -> Registry {
        Registry(ramify_e2e::registry::Registry::shared().expect("the test registry"))
    }

    /// (reference, digest) of a pushed image.
    fn image(&self, name: &str) -> (String, String) {
        let i = self.0.image(name).expect("a pushed test image");
        (i.reference, i.digest)
    }

    /// Bytes of an image's blobs (compressed).
    fn size(&self, name: &str) -> u64 {
        self.0.image(name).map(|i| i.size).unwrap_or(0)
    }

    fn dockerconfigjson(&self) -> String {
        self.0
            .dockerconfigjson()
            .expect("the registry's pull secret")
    }

    /// Pushes another image under `busybox:moving`.
    fn move_tag(&self) {
        self.0.retag_busybox_v2().expect("retag busybox:moving");
    }
}

/// Runs `cmd` in a sandbox (the agent's CLI, as `System::exec`); its stdout, trimmed.
/// Fails the test, with the CLI's stderr, when the command fails.
fn exec_ok(sys: &System, sandbox: &str, cmd: &str) -> String {
    let out = Command::new(ramify_e2e::binary("ramify-node-agent").unwrap())
        .arg("--runsc")
        .arg(&sys.runsc)
        .args(["exec", "--state-dir"])
        .arg(&sys.state_dir)
        .arg(format!("{}/{sandbox}", sys.ns.name))
        .args(["--", "/bin/sh", "-c", cmd])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "exec {cmd:?} in {sandbox}: {}\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr),
        sys.diagnostics()
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

async fn system(name: &str) -> System {
    System::start_with(name, &["--insecure-registry", "loopback"], &[]).await
}

fn image_sandbox(name: &str, image: &str, extra: &str) -> String {
    format!(
        "apiVersion: ramify.dev/v1alpha1\nkind: Sandbox\nmetadata: {{name: {name}}}\nspec:\n  image: {image:?}\n{extra}"
    )
}

fn ready_reason(s: &Sandbox) -> String {
    s.status
        .as_ref()
        .and_then(|st| st.conditions.iter().find(|c| c.type_ == "Ready"))
        .map(|c| c.reason.clone())
        .unwrap_or_default()
}

fn ready_message(s: &Sandbox) -> String {
    s.status
        .as_ref()
        .and_then(|st| st.conditions.iter().find(|c| c.type_ == "Ready"))
        .map(|c| c.message.clone())
        .unwrap_or_default()
}

async fn running(sys: &System, name: &str, secs: u64) -> Sandbox {
    // Running, or Failed (said at once rather than after the deadline).
    let sb = sys
        .wait_sandbox(name, "Running", secs, |s| {
            s.status.as_ref().is_some_and(|st| {
                st.phase == SandboxPhase::Running || st.phase == SandboxPhase::Failed
            })
        })
        .await;
    assert_eq!(
        sb.status.as_ref().map(|st| st.phase),
        Some(SandboxPhase::Running),
        "{name}: {}\n{}",
        ready_message(&sb),
        sys.diagnostics()
    );
    sb
}

fn cache_dir(sys: &System) -> PathBuf {
    sys.log_dir.join("rootfs-cache/images")
}

/// Files under `dir` (recursively), for disk figures.
fn du(dir: &Path) -> u64 {
    let out = Command::new("du").args(["-sb"]).arg(dir).output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// [`du`] of sandbox directories without their rootfs bind mounts (the shared image).
fn du_own(dir: &Path) -> u64 {
    let out = Command::new("du")
        .args(["-sb", "--exclude=rootfs"])
        .arg(dir)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn an_anonymous_image_runs_with_its_config_and_execs() {
    let _serial = SERIAL.lock().await;
    let reg = Registry::shared();
    let sys = system("img-anon").await;
    let (busybox, digest) = reg.image("busybox:1");
    let t0 = Instant::now();
    // No command: the image's entrypoint and cmd; its env, working dir and user.
    sys.apply(&image_sandbox("bb", &busybox, ""));
    let sb = running(&sys, "bb", 180).await;
    let first = t0.elapsed();
    let st = sb.status.unwrap();
    assert_eq!(st.image_digest.as_deref(), Some(digest.as_str()));
    assert_eq!(exec_ok(&sys, "bb", "cat /etc/ramify-image"), "busybox v1");
    let status = exec_ok(&sys, "bb", "cat /proc/1/status");
    assert!(
        status
            .lines()
            .any(|l| l.starts_with("Uid:") && l.contains("1000")),
        "the image's user 1000 runs the workload:\n{status}"
    );
    let environ = exec_ok(&sys, "bb", "tr '\\0' '\\n' < /proc/1/environ");
    assert!(environ.contains("RAMIFY_IMAGE=busybox"), "{environ}");
    let cwd = exec_ok(&sys, "bb", "readlink /proc/1/cwd");
    assert_eq!(cwd, "/home/app");
    let pulled = sys.event("bb", ramify_crds::REASON_PULLED).await;
    assert!(pulled.note.unwrap_or_default().contains(&digest));

    // A second sandbox of the same image: the layers are cached (no pull), and the
    // rootfs is shared, not copied.
    let before = du(&cache_dir(&sys));
    let t1 = Instant::now();
    sys.apply(&image_sandbox(
        "bb2",
        &busybox,
        "  command: [\"/bin/sh\", \"-c\", \"echo spec-command > /tmp/out; sleep 3600\"]\n  env: [{name: EXTRA, value: \"1\"}]\n",
    ));
    let sb2 = running(&sys, "bb2", 120).await;
    let cached = t1.elapsed();
    assert_eq!(
        sb2.status.unwrap().image_digest.as_deref(),
        Some(digest.as_str())
    );
    assert_eq!(exec_ok(&sys, "bb2", "cat /tmp/out"), "spec-command");
    let environ = exec_ok(&sys, "bb2", "tr '\\0' '\\n' < /proc/1/environ");
    assert!(
        environ.contains("EXTRA=1") && environ.contains("RAMIFY_IMAGE=busybox"),
        "{environ}"
    );
    let after = du(&cache_dir(&sys));
    assert_eq!(
        before, after,
        "a second sandbox of a cached image adds nothing to the cache"
    );
    eprintln!(
        "busybox:1: first pull+unpack+start {} ms; start with layers cached {} ms; cache {} bytes",
        first.as_millis(),
        cached.as_millis(),
        after
    );
    sys.teardown_and_check_clean().await;
}

async fn secret(sys: &System, name: &str, body: &str) {
    let api: Api<Secret> = Api::namespaced(sys.client.clone(), &sys.ns.name);
    let s = Secret {
        metadata: kube::api::ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        type_: Some(ramify_crds::SECRET_TYPE_DOCKERCONFIGJSON.into()),
        data: Some(
            [(
                ramify_crds::SECRET_KEY_DOCKERCONFIGJSON.to_string(),
                ByteString(body.as_bytes().to_vec()),
            )]
            .into(),
        ),
        ..Default::default()
    };
    api.create(&PostParams::default(), &s).await.unwrap();
}

#[tokio::test]
async fn a_private_image_needs_the_right_pull_secret() {
    let _serial = SERIAL.lock().await;
    let reg = Registry::shared();
    let sys = system("img-private").await;
    let (private, digest) = reg.image("private/busybox:1");
    let good = reg.dockerconfigjson();
    let v: serde_json::Value = serde_json::from_str(&good).unwrap();
    let addr = v["auths"]
        .as_object()
        .unwrap()
        .keys()
        .next()
        .unwrap()
        .clone();
    let bad = serde_json::json!({"auths": {addr: {"username": "ramify", "password": "wrong"}}})
        .to_string();
    secret(&sys, "good", &good).await;
    secret(&sys, "bad", &bad).await;
    sys.apply(&image_sandbox("none", &private, ""));
    sys.apply(&image_sandbox(
        "wrong",
        &private,
        "  imagePullSecrets: [{name: bad}]\n",
    ));
    for name in ["none", "wrong"] {
        // Retried with backoff; said in the status; no sandbox ever started.
        let sb = sys
            .wait_sandbox(name, "ImagePullBackOff", 120, |s| {
                ready_reason(s) == ramify_crds::REASON_IMAGE_PULL_BACKOFF
            })
            .await;
        let st = sb.status.clone().unwrap();
        assert_eq!(st.phase, SandboxPhase::Starting);
        assert!(st.sandbox_id.is_none(), "{name}: {st:?}");
        let msg = ready_message(&sb);
        assert!(
            msg.contains(&private) && msg.to_lowercase().contains("authoriz"),
            "{name}: the registry's refusal is in the message: {msg}"
        );
        let ev = sys.event(name, ramify_crds::REASON_ERR_IMAGE_PULL).await;
        assert!(ev.note.unwrap_or_default().contains(&private));
    }
    // The right secret (listed after one without an entry for the registry).
    secret(
        &sys,
        "other",
        r#"{"auths":{"elsewhere.example":{"username":"a","password":"b"}}}"#,
    )
    .await;
    sys.apply(&image_sandbox(
        "right",
        &private,
        "  imagePullSecrets: [{name: other}, {name: good}]\n",
    ));
    let sb = running(&sys, "right", 120).await;
    assert_eq!(
        sb.status.unwrap().image_digest.as_deref(),
        Some(digest.as_str())
    );
    assert_eq!(
        exec_ok(&sys, "right", "cat /etc/ramify-image"),
        "private busybox v1"
    );
    // Pulled by one namespace's credentials, the cached image does not serve the
    // sandbox without them: it still fails.
    let none = sys.sandboxes().get("none").await.unwrap();
    assert_ne!(none.status.unwrap().phase, SandboxPhase::Running);
    sys.teardown_and_check_clean().await;
}

#[tokio::test]
async fn a_moved_tag_never_moves_a_snapshot_even_when_the_cache_lost_it() {
    let _serial = SERIAL.lock().await;
    let reg = Registry::shared();
    let sys = system("img-moved").await;
    // `push` (in start) sets the tag `moving` to busybox:1's image.
    let (moving, d1) = reg.image("busybox:moving");
    assert_eq!(d1, reg.image("busybox:1").1, "the tag starts at busybox:1");
    sys.apply(&image_sandbox("src", &moving, ""));
    running(&sys, "src", 180).await;
    sys.apply("apiVersion: ramify.dev/v1alpha1\nkind: Snapshot\nmetadata: {name: snap}\nspec: {source: {sandbox: src}}\n");
    let snaps: Api<Snapshot> = Api::namespaced(sys.client.clone(), &sys.ns.name);
    let snap = sys
        .wait_for(snaps.clone(), "snap", "Ready", 120, |s: &Snapshot| {
            s.status
                .as_ref()
                .is_some_and(|st| st.phase == SnapshotPhase::Ready)
        })
        .await;
    let st = snap.status.unwrap();
    assert_eq!(st.image_digest.as_deref(), Some(d1.as_str()));
    let pinned = st.image.clone().unwrap();
    assert!(pinned.ends_with(&format!("@{d1}")), "{pinned}");
    // The tag moves.
    reg.move_tag();
    let (_, d2) = reg.image("busybox:moving");
    assert_ne!(d1, d2);
    sys.apply(&image_sandbox(
        "fresh",
        &moving,
        "  imagePullPolicy: Always\n",
    ));
    let fresh = running(&sys, "fresh", 120).await;
    assert_eq!(
        fresh.status.unwrap().image_digest.as_deref(),
        Some(d2.as_str())
    );
    assert_eq!(
        exec_ok(&sys, "fresh", "cat /etc/ramify-image"),
        "busybox v2"
    );
    // A branch restores the snapshot's image, not the tag's.
    // As the operator makes branches: the parent's (moving) image, restoreFrom.
    let branch = |name: &str| {
        format!(
            "apiVersion: ramify.dev/v1alpha1\nkind: Sandbox\nmetadata: {{name: {name}}}\nspec: {{image: {moving:?}, restoreFrom: {{snapshot: snap}}}}\n"
        )
    };
    sys.apply(&branch("b1"));
    let b1 = running(&sys, "b1", 120).await;
    assert_eq!(
        b1.status.unwrap().image_digest.as_deref(),
        Some(d1.as_str())
    );
    assert_eq!(exec_ok(&sys, "b1", "cat /etc/ramify-image"), "busybox v1");
    // The node loses the image (its source and first branch gone, the cache emptied
    // of it): the next branch pulls it again by digest, never by the tag.
    let dp = DeleteParams::default();
    for n in ["src", "b1"] {
        sys.sandboxes().delete(n, &dp).await.unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while sys.sandboxes().get_opt("src").await.unwrap().is_some()
        || sys.sandboxes().get_opt("b1").await.unwrap().is_some()
    {
        assert!(
            Instant::now() < deadline,
            "sources not deleted\n{}",
            sys.diagnostics()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let lost = cache_dir(&sys)
        .join("rootfs/sha256")
        .join(d1.trim_start_matches("sha256:"));
    assert!(
        lost.is_dir(),
        "{} missing before the test removes it",
        lost.display()
    );
    std::fs::remove_dir_all(&lost).unwrap();
    sys.apply(&branch("b2"));
    let b2 = running(&sys, "b2", 180).await;
    assert_eq!(
        b2.status.unwrap().image_digest.as_deref(),
        Some(d1.as_str())
    );
    assert_eq!(exec_ok(&sys, "b2", "cat /etc/ramify-image"), "busybox v1");
    assert!(lost.is_dir(), "pulled again by digest");
    sys.teardown_and_check_clean().await;
}

#[tokio::test]
async fn a_multi_arch_index_runs_this_nodes_platform() {
    let _serial = SERIAL.lock().await;
    let reg = Registry::shared();
    let sys = system("img-multi").await;
    let (multi, index) = reg.image("multi:1");
    let (_, amd64) = reg.image("busybox:1");
    sys.apply(&image_sandbox("m", &multi, ""));
    let sb = running(&sys, "m", 180).await;
    // The platform manifest (busybox:1's), not the index, nor arm64's first entry.
    assert_eq!(
        sb.status.unwrap().image_digest.as_deref(),
        Some(amd64.as_str())
    );
    assert_ne!(index, amd64);
    assert_eq!(exec_ok(&sys, "m", "cat /etc/ramify-image"), "busybox v1");
    let (code, _) = sys.exec("m", "test -e /etc/ramify-platform");
    assert_ne!(code, 0, "the arm64 image's marker is not there");
    sys.teardown_and_check_clean().await;
}

#[tokio::test]
async fn whiteouts_and_opaque_directories_hide_lower_layers() {
    let _serial = SERIAL.lock().await;
    let reg = Registry::shared();
    let sys = system("img-wh").await;
    let (wh, _) = reg.image("whiteout:1");
    sys.apply(&image_sandbox(
        "w",
        &wh,
        "  command: [\"/bin/sh\", \"-c\", \"sleep 3600\"]\n",
    ));
    running(&sys, "w", 180).await;
    assert_eq!(exec_ok(&sys, "w", "ls /data"), "keep.txt");
    assert_eq!(exec_ok(&sys, "w", "ls /opaque"), "new.txt");
    sys.teardown_and_check_clean().await;
}

/// Every `ramify-escape*` file anywhere the hostile layers aim at.
fn escapes(sys: &System) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for dir in [
        PathBuf::from("/"),
        PathBuf::from("/tmp"),
        sys.log_dir.clone(),
        sys.log_dir.join("rootfs-cache"),
        cache_dir(sys),
        cache_dir(sys).join("tmp"),
    ] {
        if let Ok(rd) = std::fs::read_dir(&dir) {
            out.extend(
                rd.flatten()
                    .map(|e| e.path())
                    .filter(|p| p.to_string_lossy().contains("ramify-escape")),
            );
        }
    }
    out
}

#[tokio::test]
async fn hostile_layers_are_refused_or_contained() {
    let _serial = SERIAL.lock().await;
    let reg = Registry::shared();
    let sys = system("img-hostile").await;
    let cmd = "  command: [\"/bin/sh\", \"-c\", \"sleep 3600\"]\n";
    for kind in ["dotdot", "symlink", "hardlink"] {
        let (r, _) = reg.image(&format!("hostile/{kind}:1"));
        sys.apply(&image_sandbox(kind, &r, cmd));
        let sb = sys
            .wait_sandbox(kind, "Failed", 120, |s| {
                s.status
                    .as_ref()
                    .is_some_and(|st| st.phase == SandboxPhase::Failed)
            })
            .await;
        assert_eq!(
            ready_reason(&sb),
            ramify_crds::REASON_IMAGE_REFUSED,
            "{kind}"
        );
        assert!(sb.status.unwrap().sandbox_id.is_none());
        eprintln!(
            "hostile/{kind}: refused: {}",
            ready_message(&sys.sandboxes().get(kind).await.unwrap())
        );
    }
    // Contained: devices skipped, setuid stripped, 10k files unpacked.
    for kind in ["device", "setuid", "manyfiles"] {
        let (r, _) = reg.image(&format!("hostile/{kind}:1"));
        sys.apply(&image_sandbox(kind, &r, cmd));
        running(&sys, kind, 240).await;
    }
    assert_ne!(
        sys.exec(
            "device",
            "test -e /dev/ramify-mem || test -e /dev/ramify-sda"
        )
        .0,
        0
    );
    let mode = exec_ok(
        &sys,
        "setuid",
        "stat -c %a /bin/ramify-setuid /bin/ramify-setgid",
    );
    assert_eq!(mode, "755\n755");
    assert_eq!(exec_ok(&sys, "manyfiles", "ls /many/d042 | wc -l"), "100");
    assert_eq!(exec_ok(&sys, "manyfiles", "ls /many | wc -l"), "100");
    let left = escapes(&sys);
    assert!(left.is_empty(), "written outside the cache: {left:?}");
    // Nothing of the refused pulls is left half-made.
    let tmp: Vec<_> = std::fs::read_dir(cache_dir(&sys).join("tmp"))
        .unwrap()
        .flatten()
        .collect();
    assert!(tmp.is_empty(), "{tmp:?}");
    // A layer altered after the push fails its sha256 at download: never unpacked,
    // nothing started; retried with backoff, as a kubelet retries a digest mismatch (a
    // transfer may have been cut), with the digests in the status.
    let (corrupt, _) = reg.image("hostile/corrupt:1");
    sys.apply(&image_sandbox("corrupt", &corrupt, cmd));
    let sb = sys
        .wait_sandbox("corrupt", "ImagePullBackOff", 120, |s| {
            ready_reason(s) == ramify_crds::REASON_IMAGE_PULL_BACKOFF
        })
        .await;
    let msg = ready_message(&sb);
    assert!(
        msg.to_lowercase().contains("digest") && msg.contains(&corrupt),
        "the digest mismatch is in the message: {msg}"
    );
    let st = sb.status.unwrap();
    assert_eq!(st.phase, SandboxPhase::Starting);
    assert!(st.sandbox_id.is_none(), "{st:?}");
    eprintln!("hostile/corrupt: not started, retried: {msg}");
    sys.teardown_and_check_clean().await;
}

#[tokio::test]
async fn an_invalid_image_reference_is_refused_by_the_schema() {
    let _serial = SERIAL.lock().await;
    let sys = system("img-invalid").await;
    for bad in ["UPPER/case:1", "a b", "repo@sha256:xyz"] {
        let out = sys
            .cp
            .kubectl_run(
                &["apply", "-n", &sys.ns.name, "-f", "-"],
                Some(&image_sandbox("bad", bad, "")),
            )
            .unwrap();
        assert!(!out.success, "{bad} accepted");
        assert!(out.stderr.contains("spec.image"), "{bad}: {}", out.stderr);
    }
    sys.teardown_and_check_clean().await;
}

/// The realistic image: its first pull and start, a start with its layers cached, and
/// the disk N sandboxes of it take (the figures are printed; the assertions are that
/// the cache holds one copy whatever N).
#[tokio::test]
async fn the_workspace_image_pulls_once_and_n_sandboxes_share_one_copy() {
    let _serial = SERIAL.lock().await;
    let reg = Registry::shared();
    let sys = system("img-ws").await;
    let (ws, digest) = reg.image("workspace:py");
    let t0 = Instant::now();
    sys.apply(&image_sandbox("ws0", &ws, ""));
    let sb = running(&sys, "ws0", 600).await;
    let first = t0.elapsed();
    assert_eq!(
        sb.status.unwrap().image_digest.as_deref(),
        Some(digest.as_str())
    );
    assert_eq!(
        exec_ok(
            &sys,
            "ws0",
            "python3 -c 'import sqlite3; print(sqlite3.sqlite_version_info[0])'"
        ),
        "3"
    );
    // Debian's setuid binaries lost their bits in the cache.
    let su = exec_ok(&sys, "ws0", "stat -c %a /bin/su");
    assert_eq!(su, "755");
    let one = du(&cache_dir(&sys));
    const N: usize = 4;
    let mut cached = Vec::new();
    for i in 1..N {
        let t = Instant::now();
        sys.apply(&image_sandbox(&format!("ws{i}"), &ws, ""));
        running(&sys, &format!("ws{i}"), 120).await;
        cached.push(t.elapsed().as_millis());
    }
    let n = du(&cache_dir(&sys));
    assert_eq!(one, n, "{N} sandboxes of one image use one copy of it");
    let layers = du(&cache_dir(&sys).join("layers"));
    let sandboxes = du_own(&sys.state_dir.join("engine/sandboxes"));
    eprintln!(
        "workspace:py ({} bytes compressed): first pull+unpack+start {} ms; starts with layers cached {:?} ms; cache {} bytes (layers {} bytes; the rootfs is hard links) for 1 and for {N} sandboxes; the {N} sandboxes' own directories {} bytes",
        reg.size("workspace:py"),
        first.as_millis(),
        cached,
        n,
        layers,
        sandboxes
    );
    sys.teardown_and_check_clean().await;
}

/// The whole flow on an image: a Sandbox from workspace:py, a BranchSet forks it (its
/// branches restore the snapshot's image), the passing branch commits into the parent.
#[tokio::test]
async fn a_branchset_forks_and_commits_a_sandbox_from_an_image() {
    let _serial = SERIAL.lock().await;
    let reg = Registry::shared();
    let sys = system("img-bs").await;
    let (ws, digest) = reg.image("workspace:py");
    sys.apply(&image_sandbox(
        "workspace",
        &ws,
        "  command: [\"/bin/sh\", \"-c\", \"echo mode=slow > /work/app.conf; exec sleep infinity\"]\n",
    ));
    running(&sys, "workspace", 600).await;
    sys.apply(
        r#"apiVersion: ramify.dev/v1alpha1
kind: BranchSet
metadata:
  name: try-fixes
spec:
  source: {sandbox: workspace}
  branches:
    - name: fix-a
      run: ["/bin/sh", "-c", "echo mode=broken > /work/app.conf"]
    - name: fix-b
      run: ["/bin/sh", "-c", "python3 -c \"open('/work/app.conf','w').write('mode=fast\\n')\""]
  verdict:
    command: ["/bin/sh", "-c", "grep -q mode=fast /work/app.conf"]
  timeoutSeconds: 120
"#,
    );
    let bs = sys
        .wait_branchset("try-fixes", "ended", 240, |b: &ramify_crds::BranchSet| {
            b.status.as_ref().is_some_and(|s| {
                matches!(
                    s.phase,
                    ramify_crds::BranchSetPhase::Committed
                        | ramify_crds::BranchSetPhase::Exhausted
                        | ramify_crds::BranchSetPhase::Failed
                )
            })
        })
        .await;
    let st = bs.status.unwrap();
    assert_eq!(st.phase, ramify_crds::BranchSetPhase::Committed, "{st:#?}");
    assert_eq!(st.winner.as_deref(), Some("fix-b"));
    sys.wait_branches_gone("try-fixes", 60).await;
    assert_eq!(
        exec_ok(&sys, "workspace", "cat /work/app.conf"),
        "mode=fast"
    );
    let parent = sys
        .sandboxes()
        .get("workspace")
        .await
        .unwrap()
        .status
        .unwrap();
    assert_eq!(parent.commits, 1);
    assert_eq!(parent.image_digest.as_deref(), Some(digest.as_str()));
    let snaps: Api<Snapshot> = Api::namespaced(sys.client.clone(), &sys.ns.name);
    let snap = snaps
        .get(&st.snapshot.unwrap())
        .await
        .unwrap()
        .status
        .unwrap();
    assert_eq!(snap.image_digest.as_deref(), Some(digest.as_str()));
    sys.teardown_and_check_clean().await;
}

/// The parent's workload: seeds a 200k-row database, then holds a large dict in memory
/// (never written anywhere) and answers `/work/ask` with its size, so a branch shows
/// that it runs the restored process, not a fresh one.
const HOLD_OUT_WORKLOAD: &str = r#"
import os, sqlite3, time
os.makedirs('/work', exist_ok=True)
db = sqlite3.connect('/work/app.db')
db.execute('CREATE TABLE items (id INTEGER PRIMARY KEY, name TEXT NOT NULL)')
db.executemany('INSERT INTO items VALUES (?, ?)', ((i, 'item-%d' % i) for i in range(200000)))
db.commit()
db.close()
cache = {i: 'value-%d' % i for i in range(300000)}
open('/work/ready', 'w').write('ok')
while True:
    if os.path.exists('/work/ask'):
        os.remove('/work/ask')
        open('/work/dict.len.tmp', 'w').write(str(len(cache)))
        os.rename('/work/dict.len.tmp', '/work/dict.len')
    time.sleep(0.05)
"#;

/// Every branch's verdict: all rows kept with their names, a migration recorded, the
/// in-memory dict still there; it records the winner's dump checksum.
const HOLD_OUT_VERDICT: &str = r#"
import os, sqlite3, time, hashlib
db = sqlite3.connect('/work/app.db')
assert db.execute('SELECT count(*) FROM items').fetchone()[0] == 200000
assert db.execute("SELECT count(*) FROM items WHERE name = ''").fetchone()[0] == 0
m = db.execute('SELECT name FROM migration').fetchone()[0]
open('/work/ask', 'w').write('1')
for _ in range(400):
    if os.path.exists('/work/dict.len'):
        break
    time.sleep(0.05)
assert open('/work/dict.len').read() == '300000'
dump = hashlib.sha256('\n'.join(db.iterdump()).encode()).hexdigest()
open('/work/verdict.sum', 'w').write(m + ' ' + dump)
"#;

/// The dump checksum of the parent's database, as the verdict computes it.
const HOLD_OUT_SUM: &str = r#"
import sqlite3, hashlib
db = sqlite3.connect('/work/app.db')
m = db.execute('SELECT name FROM migration').fetchone()[0]
print(m + ' ' + hashlib.sha256('\n'.join(db.iterdump()).encode()).hexdigest())
"#;

/// The hold-out workload on the python+sqlite image: five destructive migrations of a
/// 200k-row database race; the two that keep every row pass their verdict, exactly
/// one commits, the parent's database is then the winner's (the same dump), its
/// in-memory dict survived, and nothing of the losers is left on the node.
#[tokio::test]
async fn five_destructive_migrations_of_a_seeded_database_commit_exactly_one() {
    let _serial = SERIAL.lock().await;
    let reg = Registry::shared();
    let sys = system("img-holdout").await;
    let (ws, _) = reg.image("workspace:py");
    let sandbox = serde_json::json!({
        "apiVersion": "ramify.dev/v1alpha1", "kind": "Sandbox",
        "metadata": {"name": "db"},
        "spec": {
            "image": ws,
            "command": ["python3", "-c", "import os; exec(os.environ['WORKLOAD'])"],
            "env": [{"name": "WORKLOAD", "value": HOLD_OUT_WORKLOAD}],
            "resources": {"cpu": "250m", "memory": "512Mi"},
        }
    });
    let t0 = Instant::now();
    sys.apply(&sandbox.to_string());
    running(&sys, "db", 600).await;
    let deadline = Instant::now() + Duration::from_secs(300);
    while sys.exec("db", "cat /work/ready").1 != "ok" {
        assert!(Instant::now() < deadline, "the database was never seeded");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let seeded = t0.elapsed();
    let migrate = |sql: &str| {
        vec![
            "python3".to_string(),
            "-c".into(),
            format!(
                "import sqlite3; db = sqlite3.connect('/work/app.db'); db.executescript({sql:?}); db.commit()"
            ),
        ]
    };
    let record = |name: &str| {
        format!(" CREATE TABLE migration (name TEXT); INSERT INTO migration VALUES ('{name}');")
    };
    let branches = [
        ("drop", "DROP TABLE items;".to_string()),
        ("halve", "DELETE FROM items WHERE id % 2 = 0;".to_string()),
        (
            "score",
            "ALTER TABLE items ADD COLUMN score INTEGER NOT NULL DEFAULT 0; UPDATE items SET score = id * 2;".to_string()
                + &record("score"),
        ),
        ("blank", "UPDATE items SET name = '';".to_string() + &record("blank")),
        (
            "index",
            "CREATE INDEX items_name ON items(name); ALTER TABLE items ADD COLUMN flag INTEGER NOT NULL DEFAULT 1;".to_string()
                + &record("index"),
        ),
    ];
    let set = serde_json::json!({
        "apiVersion": "ramify.dev/v1alpha1", "kind": "BranchSet",
        "metadata": {"name": "migrate"},
        "spec": {
            "source": {"sandbox": "db"},
            "branches": branches.iter().map(|(n, sql)| serde_json::json!({"name": n, "run": migrate(sql)})).collect::<Vec<_>>(),
            "verdict": {"command": ["python3", "-c", HOLD_OUT_VERDICT], "timeoutSeconds": 300},
            "commit": {"mode": "Full"},
            "timeoutSeconds": 900,
        }
    });
    let t1 = Instant::now();
    sys.apply(&set.to_string());
    let bs = sys
        .wait_branchset("migrate", "ended", 900, |b: &ramify_crds::BranchSet| {
            b.status.as_ref().is_some_and(|s| s.phase.is_ended())
        })
        .await;
    let forked = t1.elapsed();
    let st = bs.status.unwrap();
    assert_eq!(st.phase, ramify_crds::BranchSetPhase::Committed, "{st:#?}");
    let winner = st.winner.clone().unwrap();
    assert!(
        winner == "score" || winner == "index",
        "{winner} kept every row? {st:#?}"
    );
    sys.wait_branches_gone("migrate", 120).await;
    let parent = sys.sandboxes().get("db").await.unwrap().status.unwrap();
    assert_eq!(parent.commits, 1, "exactly one commit");
    // The parent's database is the winner's: the same dump its verdict recorded.
    let recorded = exec_ok(&sys, "db", "cat /work/verdict.sum");
    assert!(recorded.starts_with(&format!("{winner} ")), "{recorded}");
    let now = exec_ok(
        &sys,
        "db",
        &format!("python3 -c {}", shell_quote(HOLD_OUT_SUM)),
    );
    assert_eq!(now, recorded, "the parent's database is the winner's");
    // Its in-memory dict came with it.
    exec_ok(&sys, "db", "rm -f /work/dict.len; echo 1 > /work/ask");
    let deadline = Instant::now() + Duration::from_secs(30);
    while sys.exec("db", "cat /work/dict.len").1 != "300000" {
        assert!(Instant::now() < deadline, "the parent's dict is gone");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Nothing of the losers: only the parent's sandbox is on the node.
    let left: Vec<String> = std::fs::read_dir(sys.state_dir.join("engine/sandboxes"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left.len(), 1, "sandboxes on the node: {left:?}");
    let verdicts: Vec<String> = st
        .branches
        .iter()
        .map(|b| format!("{}={:?}", b.name, b.verdict))
        .collect();
    eprintln!(
        "hold-out: seeded 200k rows + a 300k-entry dict in {} ms; 5 migrations forked, judged and {winner} committed in {} ms; verdicts {verdicts:?}",
        seeded.as_millis(),
        forked.as_millis()
    );
    sys.teardown_and_check_clean().await;
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}
