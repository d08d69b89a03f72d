//! A real Kubernetes node in the test bed: kubelet v1.36.3 + containerd 2.x (runc, CNI
//! bridge) joined to the real control plane. A busybox Pod runs, `kubectl logs` and
//! `kubectl exec` reach it through the API server, and hack/node/down.sh leaves the host
//! as it found it. Run under the runsc lock (the node's address, bridge and iptables
//! chains are host-wide).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, PostParams};
use ramify_e2e::node::{KUBELET_CHAINS, KUBELET_SYSCTLS, RealNode, host_state, kubepods_pids};
use ramify_e2e::{ControlPlane, TestNamespace};

fn sysctls() -> Vec<String> {
    KUBELET_SYSCTLS
        .iter()
        .map(|k| {
            let v = std::fs::read_to_string(format!("/proc/sys/{}", k.replace('.', "/"))).unwrap();
            format!("{k}={}", v.trim())
        })
        .collect()
}

fn pod(name: &str, image: &str, script: &str) -> Pod {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [{
                "name": "main", "image": image, "imagePullPolicy": "Never",
                "command": ["sh", "-c", script],
            }],
        },
    }))
    .unwrap()
}

/// Polls the Pod until its phase is one of `phases`; panics with its status otherwise.
async fn wait_phase(pods: &Api<Pod>, name: &str, phases: &[&str], timeout: Duration) -> Pod {
    let deadline = Instant::now() + timeout;
    loop {
        let p = pods.get(name).await.unwrap();
        let phase = p
            .status
            .as_ref()
            .and_then(|s| s.phase.clone())
            .unwrap_or_default();
        if phases.contains(&phase.as_str()) {
            return p;
        }
        assert!(
            Instant::now() < deadline,
            "Pod {name} not {phases:?} within {timeout:?}: {:?}",
            p.status
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Runs a Pod to its end; its phase and its container's exit code.
async fn run_to_completion(
    pods: &Api<Pod>,
    name: &str,
    image: &str,
    script: &str,
) -> (String, Option<i32>) {
    pods.create(&PostParams::default(), &pod(name, image, script))
        .await
        .unwrap();
    let p = wait_phase(
        pods,
        name,
        &["Succeeded", "Failed"],
        Duration::from_secs(120),
    )
    .await;
    let phase = p
        .status
        .as_ref()
        .and_then(|s| s.phase.clone())
        .unwrap_or_default();
    (phase, exit_code(&p))
}

fn exit_code(p: &Pod) -> Option<i32> {
    p.status.as_ref()?.container_statuses.as_ref()?[0]
        .state
        .as_ref()?
        .terminated
        .as_ref()
        .map(|t| t.exit_code)
}

#[tokio::test]
async fn busybox_pod_runs_and_kubectl_logs_and_exec_reach_it() {
    let _one_node = RealNode::exclusive().await;
    let cp = ControlPlane::ensure().expect("control plane");
    let client = cp.client().await.unwrap();
    let (image, image_id) = RealNode::busybox_image().expect("node images built");
    let sysctls_before = sysctls();
    let mut node = RealNode::start(&cp).await.expect("node Ready");
    eprintln!(
        "node Ready {:.1} s after up.sh started",
        node.ready_after.as_secs_f64()
    );

    // The real kubelet and containerd registered it, with the node IP on lo.
    let n: Node = Api::all(client.clone()).get(&node.name).await.unwrap();
    let status = n.status.unwrap();
    let info = status.node_info.unwrap();
    assert_eq!(info.kubelet_version, "v1.36.3");
    assert!(
        info.container_runtime_version
            .starts_with("containerd://2."),
        "{}",
        info.container_runtime_version
    );
    let addresses = status.addresses.unwrap_or_default();
    assert!(
        addresses
            .iter()
            .any(|a| a.type_ == "InternalIP" && a.address == node.ip),
        "{addresses:?}"
    );
    // kubelet changed these at start; up.sh put them back once it had.
    assert_eq!(
        sysctls(),
        sysctls_before,
        "sysctls not put back after kubelet started"
    );

    let ns = TestNamespace::create(&client, "node").await.unwrap();
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns.name);
    let started = Instant::now();
    pods.create(
        &PostParams::default(),
        &pod(
            "echo",
            &image,
            "echo hello from $(hostname); echo second line; exec sleep 3600",
        ),
    )
    .await
    .unwrap();
    let running = wait_phase(&pods, "echo", &["Running"], Duration::from_secs(120)).await;
    eprintln!(
        "busybox Pod Running after {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let ip = running
        .status
        .as_ref()
        .and_then(|s| s.pod_ip.clone())
        .unwrap_or_default();
    // The archive built here is what ran (containerd reports its config digest).
    let status = running
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref());
    assert_eq!(
        status.map(|c| c[0].image_id.as_str()),
        Some(image_id.as_str())
    );
    assert!(
        ip.starts_with("10.91."),
        "Pod IP {ip} not from the node's CNI subnet"
    );

    // kubectl logs: API server -> kubelet (its client certificate) -> containerd's log.
    let started = Instant::now();
    let logs = cp
        .kubectl_until_ok(&["-n", &ns.name, "logs", "echo"], Duration::from_secs(30))
        .unwrap();
    assert!(logs.success, "kubectl logs failed: {}", logs.stderr);
    assert_eq!(logs.stdout, "hello from echo\nsecond line\n");
    eprintln!(
        "kubectl logs answered in {:.2} s",
        started.elapsed().as_secs_f64()
    );

    // kubectl exec: a new process in the running container, its output streamed back.
    let started = Instant::now();
    let exec = cp
        .kubectl_run(
            &[
                "-n",
                &ns.name,
                "exec",
                "echo",
                "--",
                "sh",
                "-c",
                "echo exec $((6 * 7)); cat /proc/1/cmdline",
            ],
            None,
        )
        .unwrap();
    assert!(exec.success, "kubectl exec failed: {}", exec.stderr);
    assert_eq!(exec.stdout, "exec 42\nsleep\u{0}3600\u{0}");
    eprintln!(
        "kubectl exec answered in {:.2} s",
        started.elapsed().as_secs_f64()
    );
    // A command that fails reports its exit code through exec too.
    let failing = cp
        .kubectl_run(
            &["-n", &ns.name, "exec", "echo", "--", "sh", "-c", "exit 7"],
            None,
        )
        .unwrap();
    assert!(!failing.success);
    assert!(failing.stderr.contains("exit code 7"), "{}", failing.stderr);

    // Pods that run to completion: Succeeded with exit 0, Failed with the exit code.
    assert_eq!(
        run_to_completion(&pods, "once", &image, "echo done").await,
        ("Succeeded".into(), Some(0))
    );
    assert_eq!(
        run_to_completion(&pods, "fails", &image, "echo failing >&2; exit 3").await,
        ("Failed".into(), Some(3))
    );
    let logs = cp
        .kubectl_run(&["-n", &ns.name, "logs", "once"], None)
        .unwrap();
    assert_eq!(logs.stdout, "done\n");

    ns.delete().await.unwrap();
    node.stop().expect("node stopped cleanly");
}

#[tokio::test]
async fn node_down_leaves_nothing_behind() {
    let _one_node = RealNode::exclusive().await;
    let cp = ControlPlane::ensure().expect("control plane");
    let client = cp.client().await.unwrap();
    let (image, _) = RealNode::busybox_image().expect("node images built");
    let dir = RealNode::dir_for(&cp);
    let before = host_state(&dir);
    let mut node = RealNode::start(&cp).await.expect("node Ready");

    // A running Pod, so there are shims, a pause and a container process, a netns, an
    // IP lease and rootfs mounts for down.sh to remove.
    let ns = TestNamespace::create(&client, "node-down").await.unwrap();
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns.name);
    pods.create(
        &PostParams::default(),
        &pod("sleeper", &image, "exec sleep 3600"),
    )
    .await
    .unwrap();
    wait_phase(&pods, "sleeper", &["Running"], Duration::from_secs(120)).await;

    // The comparison below is not vacuous: while the node runs, all of this is there.
    let during = host_state(&dir);
    for expected in [
        "cgroup ",
        "iptables -t filter -N KUBE-FIREWALL",
        "iptables -t filter -A INPUT -j KUBE-FIREWALL",
        "lo address",
        "link rmynode0",
        "directory /run/ramify-node-",
        "mount ",
        "process ",
    ] {
        assert!(
            during.iter().any(|l| l.starts_with(expected)),
            "no `{expected}` while the node runs: {during:#?}"
        );
    }
    for chain in KUBELET_CHAINS {
        assert!(
            during.iter().any(|l| l.contains(chain)),
            "kubelet added no {chain}: {during:#?}"
        );
    }
    let mut pids: Vec<String> = node.pids().iter().map(u32::to_string).collect();
    let pod_processes = kubepods_pids();
    assert!(
        pod_processes.len() >= 2,
        "pause and sleep: {pod_processes:?}"
    );
    pids.extend(pod_processes);

    let started = Instant::now();
    node.stop().expect("down.sh removed everything it knows of");
    eprintln!("down.sh took {:.1} s", started.elapsed().as_secs_f64());
    let after = host_state(&dir);
    assert_eq!(after, before, "the host differs from before up.sh");
    let nodes: Api<Node> = Api::all(client.clone());
    assert!(
        nodes.get_opt(&node.name).await.unwrap().is_none(),
        "the Node object is left"
    );
    for pid in &pids {
        assert!(
            !Path::new("/proc").join(pid).exists(),
            "process {pid} survived down.sh"
        );
    }
    // Idempotent: a second down.sh finds nothing to do and succeeds.
    let again = RealNode::script("down", &cp.dir, &dir).status().unwrap();
    assert!(again.success());
    assert_eq!(host_state(&dir), before);
    let _ = ns.delete().await;
}

#[tokio::test]
async fn down_after_a_failed_up_leaves_nothing_behind() {
    let _one_node = RealNode::exclusive().await;
    let cp = ControlPlane::ensure().expect("control plane");
    RealNode::build().expect("node built");
    let dir = RealNode::dir_for(&cp);
    let before = host_state(&dir);
    // The kubelet's port taken: up.sh gets as far as a running containerd, the node IP
    // on lo and a started kubelet, which then exits.
    let base: u16 = std::env::var("RAMIFY_CP_PORT_BASE")
        .ok()
        .and_then(|b| b.parse().ok())
        .unwrap_or(16440);
    let taken = std::net::TcpListener::bind(("0.0.0.0", base + 10)).expect("kubelet port free");
    let up = RealNode::script("up", &cp.dir, &dir).output().unwrap();
    drop(taken);
    let stderr = String::from_utf8_lossy(&up.stderr);
    assert!(
        !up.status.success(),
        "up.sh succeeded with its port taken: {stderr}"
    );
    assert!(stderr.contains("kubelet exited"), "{stderr}");
    assert_ne!(
        host_state(&dir),
        before,
        "up.sh failed before changing anything"
    );
    let down = RealNode::script("down", &cp.dir, &dir).status().unwrap();
    assert!(down.success());
    assert_eq!(
        host_state(&dir),
        before,
        "the host differs from before up.sh"
    );
}

/// hack/images/oci-archive.py: the same tree gives the same archive byte for byte, whatever
/// the files' times and the directory's path; another content gives another digest.
#[test]
fn image_archives_are_reproducible() {
    let root = ramify_e2e::repo_root();
    let work = root.join(format!(".ramify/oci-archive-test-{}", std::process::id()));
    let tree = |name: &str, content: &str| {
        let dir = work.join(name);
        std::fs::create_dir_all(dir.join("bin")).unwrap();
        std::fs::create_dir_all(dir.join("etc/empty")).unwrap();
        std::fs::write(dir.join("bin/tool"), content).unwrap();
        std::os::unix::fs::symlink("/bin/tool", dir.join("bin/sh")).unwrap();
        std::fs::hard_link(dir.join("bin/tool"), dir.join("bin/tool2")).unwrap();
        dir
    };
    let pack = |dir: &Path, out: &str| {
        let out = work.join(out);
        let run = std::process::Command::new(root.join("hack/images/oci-archive.py"))
            .arg(dir)
            .arg("ramify.local/test:1")
            .arg(&out)
            .args(["--cmd", "[\"/bin/sh\"]"])
            .output()
            .unwrap();
        assert!(
            run.status.success(),
            "{}",
            String::from_utf8_lossy(&run.stderr)
        );
        (
            String::from_utf8_lossy(&run.stdout).trim().to_string(),
            std::fs::read(out).unwrap(),
        )
    };
    let _ = std::fs::remove_dir_all(&work);
    let first = tree("a", "echo one");
    let (digest, bytes) = pack(&first, "a.tar");
    assert!(
        digest.starts_with("sha256:") && digest.len() == 71,
        "{digest}"
    );
    // Same content elsewhere, other inodes, another mtime.
    let second = tree("b", "echo one");
    std::fs::File::options()
        .write(true)
        .open(second.join("bin/tool"))
        .unwrap()
        .set_modified(std::time::UNIX_EPOCH + Duration::from_secs(123_456_789))
        .unwrap();
    assert_eq!(pack(&second, "b.tar"), (digest.clone(), bytes));
    let third = tree("c", "echo two");
    assert_ne!(pack(&third, "c.tar").0, digest);
    std::fs::remove_dir_all(&work).unwrap();
}
