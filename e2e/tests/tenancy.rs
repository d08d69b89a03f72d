//! Tenants never reach the node's files: a Sandbox cannot name a node directory (the
//! API server rejects it), a RootfsClass that points outside the agent's rootfs roots
//! (or leads out of one through a symlink) is refused at the first reconcile with
//! `RootfsRefused` in status and an Event, and no spec field that names a path reads
//! a file of the node from inside a sandbox. The agent's own state stays private.
//! Real control plane, real operator and node agent processes, real runsc.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use kube::api::{Api, ListParams};
use ramify_crds::{REASON_ROOTFS_REFUSED, RootfsClass, Sandbox, SandboxPhase};
use ramify_e2e::system::{System, declare_class, open_to_others};
use ramify_e2e::{ControlPlane, TestNamespace, binary};

/// Tests run one at a time (each starts its own operator and agent).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// How long a refusal may take from `kubectl apply` to `Failed` in status.
const REFUSAL_SECS: u64 = 30;

fn sandbox_yaml(name: &str, rootfs: &str, extra: &str) -> String {
    format!(
        "apiVersion: ramify.dev/v1alpha1\nkind: Sandbox\nmetadata: {{name: {name}}}\nspec:\n  rootfs: {rootfs}\n  command: [/bin/sh, -c, 'sleep 3600']\n{extra}"
    )
}

/// A Sandbox that names a node path is rejected by the API server, naming the field,
/// whatever the path; so is a RootfsClass path with `..` or a relative one.
#[tokio::test]
async fn a_sandbox_cannot_name_a_node_path() {
    let cp = ControlPlane::ensure().unwrap();
    let client = cp.client().await.unwrap();
    ramify_e2e::install_crds(&client).await.unwrap();
    let ns = TestNamespace::create(&client, "tenancy-api").await.unwrap();
    let mut report = Vec::new();
    let mut failures = Vec::new();
    let cases: &[(&str, &str, &[&str])] = &[
        (
            "{path: /}",
            "spec.rootfs.path",
            &["cannot name a node directory"],
        ),
        (
            "{path: /var/lib/ramify}",
            "spec.rootfs.path",
            &["cannot name a node directory"],
        ),
        (
            "{path: /var/lib/ramify/agent}",
            "spec.rootfs.path",
            &["cannot name a node directory"],
        ),
        (
            "{path: /var/lib/ramify/rootfs/../../..}",
            "spec.rootfs.path",
            &["cannot name a node directory"],
        ),
        (
            "{path: /var/lib/ramify/rootfs/busybox}",
            "spec.rootfs.path",
            &["cannot name a node directory"],
        ),
        (
            "{class: busybox, path: /}",
            "spec.rootfs.path",
            &["cannot name a node directory"],
        ),
        (
            "{class: busybox, ociRef: latest}",
            "spec.rootfs.ociRef",
            &["cannot name a node OCI layout"],
        ),
        ("{}", "spec.rootfs.class", &["must name a RootfsClass"]),
        (
            "{class: ../../etc}",
            "spec.rootfs.class",
            &["lowercase DNS subdomain"],
        ),
    ];
    for (i, (rootfs, field, fragments)) in cases.iter().enumerate() {
        let out = cp
            .kubectl_run(
                &["apply", "-n", &ns.name, "-f", "-"],
                Some(&sandbox_yaml(&format!("api-{i}"), rootfs, "")),
            )
            .unwrap();
        report.push(format!("Sandbox rootfs {rootfs}: {}", out.stderr.trim()));
        if out.success {
            failures.push(format!("rootfs {rootfs}: accepted"));
            continue;
        }
        for f in std::iter::once(field).chain(fragments.iter()) {
            if !out.stderr.contains(f) {
                failures.push(format!(
                    "rootfs {rootfs}: error lacks {f:?}: {}",
                    out.stderr
                ));
            }
        }
    }
    for (path, fragment) in [
        (
            "/var/lib/ramify/rootfs/../agent",
            "spec.path must be an absolute path without '..'",
        ),
        ("..", "spec.path must be an absolute path without '..'"),
        (
            "rootfs/busybox",
            "spec.path must be an absolute path without '..'",
        ),
    ] {
        let yaml = format!(
            "apiVersion: ramify.dev/v1alpha1\nkind: RootfsClass\nmetadata: {{name: bad-class}}\nspec: {{path: '{path}'}}\n"
        );
        let out = cp.kubectl_run(&["apply", "-f", "-"], Some(&yaml)).unwrap();
        report.push(format!("RootfsClass path {path}: {}", out.stderr.trim()));
        if out.success || !out.stderr.contains(fragment) {
            failures.push(format!("RootfsClass path {path}: {}", out.stderr));
        }
    }
    eprintln!("{}", report.join("\n"));
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    let sandboxes: Api<Sandbox> = Api::namespaced(client.clone(), &ns.name);
    assert!(
        sandboxes
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .is_empty()
    );
    ns.delete().await.unwrap();
}

/// What a refused Sandbox shows: Failed with RootfsRefused naming the field and a
/// warning Event, within [`REFUSAL_SECS`]; no sandbox id, nothing on the node.
async fn assert_refused(sys: &System, name: &str, fragment: &str) -> (Duration, String) {
    let t0 = Instant::now();
    let s = sys
        .wait_sandbox(name, "Failed (RootfsRefused)", REFUSAL_SECS, |s| {
            s.status
                .as_ref()
                .is_some_and(|st| st.phase == SandboxPhase::Failed)
        })
        .await;
    let took = t0.elapsed();
    let st = s.status.unwrap();
    let ready = st
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")
        .unwrap_or_else(|| panic!("{name}: no Ready condition"));
    assert_eq!(ready.reason, REASON_ROOTFS_REFUSED, "{name}: {ready:?}");
    assert!(
        ready.message.contains("spec.rootfs.class"),
        "{name}: {}",
        ready.message
    );
    assert!(
        ready.message.contains(fragment),
        "{name}: {}",
        ready.message
    );
    assert!(
        st.sandbox_id.is_none(),
        "{name} started as {:?}",
        st.sandbox_id
    );
    assert!(st.started_at.is_none());
    // The Event, published with the status.
    sys.wait_event(
        false,
        REFUSAL_SECS,
        &format!("{name}: RootfsRefused Event"),
        |e| {
            e.reason.as_deref() == Some(REASON_ROOTFS_REFUSED)
                && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name)
                && e.type_.as_deref() == Some("Warning")
                && e.note.as_deref().is_some_and(|n| n.contains(fragment))
        },
    )
    .await;
    (took, ready.message.clone())
}

/// Sandbox directories the agent holds (a refused sandbox must leave none).
fn sandbox_dirs(sys: &System) -> usize {
    std::fs::read_dir(sys.state_dir.join("engine/sandboxes"))
        .map(|rd| rd.count())
        .unwrap_or(0)
}

/// Makes `dir` a minimal rootfs (so a refusal is never "not a rootfs").
fn copy_rootfs(from: &Path, to: &Path) {
    let st = Command::new("cp")
        .arg("-a")
        .arg(from)
        .arg(to)
        .status()
        .unwrap();
    assert!(st.success());
}

#[tokio::test]
async fn rootfs_classes_outside_the_roots_are_refused_and_nothing_starts() {
    let _serial = SERIAL.lock().await;
    let sys = System::start("rootfs-refused").await;
    let tag = &sys.ns.name[sys.ns.name.len() - 8..];
    let root = &sys.rootfs_root;
    // Escapes planted inside the allowed root, and a real rootfs outside it.
    let outside = sys.state_dir.parent().unwrap().join("outside");
    std::fs::create_dir_all(&outside).unwrap();
    copy_rootfs(&sys.rootfs, &outside.join("rootfs"));
    std::fs::create_dir_all(outside.join("layout")).unwrap();
    let planted: Vec<PathBuf> = ["to-slash", "to-state", "up", "parent-out"]
        .iter()
        .map(|n| root.join(format!("{tag}-{n}")))
        .collect();
    symlink("/", &planted[0]).unwrap();
    symlink(&sys.state_dir, &planted[1]).unwrap();
    symlink("..", &planted[2]).unwrap();
    symlink(&outside, &planted[3]).unwrap();
    let state = sys.state_dir.to_string_lossy().into_owned();
    // `<root>/<tag>-up` is `..` (the e2e directory), where this system's base is.
    let base_name = sys
        .state_dir
        .parent()
        .unwrap()
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let engine_state = sys
        .state_dir
        .join("engine/snapshots")
        .to_string_lossy()
        .into_owned();
    let p = |i: usize, rest: &str| format!("{}{rest}", planted[i].display());
    // (what, class path, ociRef, expected fragment)
    let cases: Vec<(&str, String, Option<&str>, &str)> = vec![
        (
            "the node's /",
            "/".into(),
            None,
            "not inside an allowed rootfs root",
        ),
        (
            "/var/lib/ramify",
            "/var/lib/ramify".into(),
            None,
            "not inside an allowed rootfs root",
        ),
        (
            "the agent's state dir",
            state.clone(),
            None,
            "not inside an allowed rootfs root",
        ),
        (
            "the agent's snapshot images",
            engine_state,
            None,
            "not inside an allowed rootfs root",
        ),
        (
            "a symlink in the root to /",
            p(0, ""),
            None,
            "leaves the rootfs root",
        ),
        (
            "a symlink in the root to the state dir",
            p(1, ""),
            None,
            "leaves the rootfs root",
        ),
        (
            "a '..' through a symlink in the root",
            p(2, &format!("/{}/outside/rootfs", base_name)),
            None,
            "leaves the rootfs root",
        ),
        (
            "a dir whose parent is a symlink out of the root",
            p(3, "/rootfs"),
            None,
            "leaves the rootfs root",
        ),
        (
            "a rootfs outside the roots",
            outside.join("rootfs").to_string_lossy().into_owned(),
            None,
            "not inside an allowed rootfs root",
        ),
        (
            "an OCI layout outside the roots",
            outside.join("layout").to_string_lossy().into_owned(),
            Some("latest"),
            "not inside an allowed rootfs root",
        ),
        (
            "an OCI layout behind a symlink out of the root",
            p(3, "/layout"),
            Some("latest"),
            "leaves the rootfs root",
        ),
    ];
    let mut report = Vec::new();
    for (i, (what, path, oci, fragment)) in cases.iter().enumerate() {
        let class = format!("refused-{tag}-{i}");
        declare_class(&sys.client, &class, path, *oci).await;
        let name = format!("bad-{i}");
        sys.apply(&sandbox_yaml(&name, &format!("{{class: {class}}}"), ""));
        let (took, msg) = assert_refused(&sys, &name, fragment).await;
        report.push(format!(
            "{what} ({path}): Failed/{REASON_ROOTFS_REFUSED} in {} ms: {msg}",
            took.as_millis()
        ));
    }
    // A class nobody declared.
    sys.apply(&sandbox_yaml("bad-unknown", "{class: no-such-class}", ""));
    let (took, msg) = assert_refused(&sys, "bad-unknown", "no RootfsClass of that name").await;
    report.push(format!(
        "unknown class: Failed/{REASON_ROOTFS_REFUSED} in {} ms: {msg}",
        took.as_millis()
    ));
    eprintln!("{}", report.join("\n"));
    assert_eq!(
        sandbox_dirs(&sys),
        0,
        "a refused sandbox left state on the node"
    );

    // Refused means refused for good: nothing retries it into Running.
    sys.running_workspace().await;
    for i in 0..cases.len() {
        let s = sys.sandboxes().get(&format!("bad-{i}")).await.unwrap();
        assert_eq!(s.status.unwrap().phase, SandboxPhase::Failed);
    }
    let classes: Api<RootfsClass> = Api::all(sys.client.clone());
    for i in 0..cases.len() {
        let _ = classes
            .delete(&format!("refused-{tag}-{i}"), &Default::default())
            .await;
    }
    for p in &planted {
        std::fs::remove_file(p).unwrap();
    }
    sys.teardown_and_check_clean().await;
}

/// Applies a probe Sandbox and waits until it runs or fails; returns its phase, its
/// Ready message and, when it runs, what it wrote to `/work/out` (once it wrote its
/// last line, `done`).
async fn run_probe(sys: &System, name: &str, yaml: &str) -> (SandboxPhase, String, Option<String>) {
    sys.apply(yaml);
    let s = sys
        .wait_sandbox(name, "Running or Failed", 120, |s| {
            s.status
                .as_ref()
                .is_some_and(|st| matches!(st.phase, SandboxPhase::Running | SandboxPhase::Failed))
        })
        .await;
    let st = s.status.unwrap();
    let msg = st
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")
        .map(|c| c.message.clone())
        .unwrap_or_default();
    if st.phase != SandboxPhase::Running {
        return (st.phase, msg, None);
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (code, out) = sys.exec(name, "cat /work/out");
        if code == 0 && out.ends_with("done") {
            return (st.phase, msg, Some(out));
        }
        assert!(Instant::now() < deadline, "{name} never finished: {out}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A marker file on the node, then every Sandbox spec field that names a path aimed at
/// it: the marker is never read from inside a sandbox. The state the agent keeps for
/// these sandboxes, a snapshot included, is readable by nobody else.
#[tokio::test]
async fn no_spec_field_reaches_the_nodes_files() {
    let _serial = SERIAL.lock().await;
    let sys = System::start("no-node-files").await;
    let secret = format!("node-secret-{}", uuid::Uuid::new_v4().simple());
    let marker_dir = sys.state_dir.parent().unwrap().join("marker");
    std::fs::create_dir_all(&marker_dir).unwrap();
    let marker = marker_dir.join("marker.txt");
    std::fs::write(&marker, format!("{secret}\n")).unwrap();
    let m = marker.display().to_string();
    let md = marker_dir.display().to_string();
    // Read attempts: by absolute path, relative to the working directory, through
    // /proc's links, through `..` above the control mount, through env.
    let probe = format!(
        "for p in \"$MARKER\" marker.txt ./marker.txt {m} /proc/1/root{m} /proc/self/root{m} /proc/1/cwd/marker.txt /run/ramify/../..{m} ../../../../..{m}; do cat \"$p\"; done; ls -la . / /run/ramify; cat /etc/shadow /etc/hostname"
    );
    let mut report = Vec::new();
    // env and command name the marker; the class is the allowed one.
    let yaml = format!(
        "apiVersion: ramify.dev/v1alpha1\nkind: Sandbox\nmetadata: {{name: probe}}\nspec:\n  rootfs: {{class: {}}}\n  workingDir: /work\n  env: [{{name: MARKER, value: {m}}}, {{name: PATH, value: /bin}}]\n  command: [/bin/sh, -c, 'mkdir -p /work; ({probe}) > /work/out 2>&1; echo done >> /work/out; sleep 3600']\n",
        sys.rootfs_class
    );
    let (phase, _, out) = run_probe(&sys, "probe", &yaml).await;
    report.push(format!("env MARKER={m} + command reads: phase {phase:?}"));
    let out = out.unwrap_or_else(|| panic!("the probe did not run\n{}", sys.diagnostics()));
    report.push(format!("probe output:\n{out}"));
    assert!(
        !out.contains(&secret),
        "the node's marker was read from inside:\n{out}"
    );
    // The same from `kubectl ramify exec`'s path (the agent's exec), argv naming it.
    for argv in [
        format!("cat {m}"),
        format!("cat /proc/1/root{m}"),
        format!("cd {md} && cat marker.txt"),
        "cat /proc/mounts".into(),
    ] {
        let (code, out) = sys.exec("probe", &argv);
        report.push(format!(
            "exec `{argv}`: exit {code}: {}",
            out.lines().next().unwrap_or("")
        ));
        assert!(
            !out.contains(&secret),
            "exec `{argv}` read the marker: {out}"
        );
    }
    // workingDir naming the marker's directory: the sandbox's own (empty) directory of
    // that name, never the node's.
    let cwd_yaml = format!(
        "apiVersion: ramify.dev/v1alpha1\nkind: Sandbox\nmetadata: {{name: probe-cwd}}\nspec:\n  rootfs: {{class: {}}}\n  workingDir: {md}\n  env: [{{name: PATH, value: /bin}}]\n  command: [/bin/sh, -c, 'mkdir -p /work; (pwd; ls -la; cat marker.txt ./marker.txt) > /work/out 2>&1; echo done >> /work/out; sleep 3600']\n",
        sys.rootfs_class
    );
    let (phase, msg, out) = run_probe(&sys, "probe-cwd", &cwd_yaml).await;
    assert!(!msg.contains(&secret));
    match out {
        Some(out) => {
            assert!(
                !out.contains(&secret),
                "workingDir read the node's marker:\n{out}"
            );
            report.push(format!(
                "workingDir {md}: {phase:?}, in its own directory:\n{out}"
            ));
        }
        None => report.push(format!("workingDir {md}: {phase:?}: {msg}")),
    }

    // The class that names the marker's directory is refused (not inside a root).
    declare_class(
        &sys.client,
        &format!("marker-{}", &secret[12..20]),
        &md,
        None,
    )
    .await;
    sys.apply(&sandbox_yaml(
        "probe-class",
        &format!("{{class: marker-{}}}", &secret[12..20]),
        "",
    ));
    let (took, msg) =
        assert_refused(&sys, "probe-class", "not inside an allowed rootfs root").await;
    report.push(format!(
        "rootfs class {md}: refused in {} ms: {msg}",
        took.as_millis()
    ));
    let classes: Api<RootfsClass> = Api::all(sys.client.clone());
    let _ = classes
        .delete(&format!("marker-{}", &secret[12..20]), &Default::default())
        .await;

    // A snapshot of the probe, then the whole agent state: owner-only.
    let snap = "apiVersion: ramify.dev/v1alpha1\nkind: Snapshot\nmetadata: {name: probe-snap}\nspec: {source: {sandbox: probe}}\n";
    sys.apply(snap);
    let snaps: Api<ramify_crds::Snapshot> = Api::namespaced(sys.client.clone(), &sys.ns.name);
    sys.wait_for(
        snaps,
        "probe-snap",
        "Ready",
        120,
        |s: &ramify_crds::Snapshot| {
            s.status
                .as_ref()
                .is_some_and(|st| st.phase == ramify_crds::SnapshotPhase::Ready)
        },
    )
    .await;
    let mounts: Vec<PathBuf> = std::fs::read_dir(sys.state_dir.join("engine/sandboxes"))
        .unwrap()
        .flatten()
        .map(|e| e.path().join("rootfs"))
        .collect();
    assert!(!mounts.is_empty());
    let open = open_to_others(&sys.state_dir, &mounts);
    assert!(
        open.is_empty(),
        "readable by others under the agent's state:\n{}",
        open.join("\n")
    );
    assert_eq!(
        std::fs::read_to_string(&marker).unwrap(),
        format!("{secret}\n")
    );
    eprintln!("{}", report.join("\n"));
    sys.teardown_and_check_clean().await;
}

/// An agent configured with a rootfs root that overlaps its own state refuses to start.
#[tokio::test]
async fn an_agent_refuses_a_root_overlapping_its_state() {
    let _serial = SERIAL.lock().await;
    let base = ramify_e2e::lane::base_dir().join(format!(
        "overlap-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..6]
    ));
    let state = base.join("agent");
    std::fs::create_dir_all(&state).unwrap();
    let runsc = ramify_e2e::system::runsc();
    for (root, fragment) in [
        (base.clone(), "overlaps the agent's state directory"),
        (state.join("engine"), "overlaps the agent's state directory"),
        (PathBuf::from("/"), "overlaps the agent's state directory"),
    ] {
        let out = Command::new(binary("ramify-node-agent").unwrap())
            .arg("--runsc")
            .arg(&runsc)
            .args(["run", "--node-name", "overlap", "--state-dir"])
            .arg(&state)
            .arg("--rootfs-root")
            .arg(&root)
            .arg("--rootfs-cache")
            .arg(base.join("cache"))
            .args(["--bridge", &ramify_e2e::lane::bridge()])
            .args([
                "--subnet",
                &format!("{}0.0/16", ramify_e2e::lane::subnet_prefix()),
            ])
            .env("KUBECONFIG", "/nonexistent")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        eprintln!(
            "--rootfs-root {}: exit {:?}: {}",
            root.display(),
            out.status.code(),
            err.trim()
        );
        assert!(
            !out.status.success(),
            "started with root {}",
            root.display()
        );
        assert!(err.contains(fragment), "{}: {err}", root.display());
    }
    std::fs::remove_dir_all(&base).unwrap();
}
