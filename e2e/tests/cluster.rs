//! Cluster mode on the real node (kubelet + containerd + kube-proxy, hack/node): every
//! Sandbox is backed by a Pod kube-scheduler placed, its gVisor sandbox runs in that
//! Pod's network namespace and cgroup, and the Pod's container (`ramify-pod`, pulled
//! from the local registry) streams its console to `kubectl logs` and ends with it.
//! ResourceQuota, node selectors, Pod deletion and eviction act on sandboxes as on any
//! Pod. Real control plane, real kubelet, real runsc: nothing here is simulated.
//!
//! One node per machine: the tests take [`RealNode::exclusive`]; run under the runsc
//! lock like the other real-node tests.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod objectstore;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, EvictParams, ListParams, PostParams};
use ramify_crds::capacity::{CONDITION_READY, CONDITION_SCHEDULED};
use ramify_crds::pod::{
    LABEL_SANDBOX_UID, REASON_POD_DELETED, REASON_POD_EVICTED, REASON_POD_REFUSED,
    REASON_UNSCHEDULABLE,
};
use ramify_crds::{BranchSetPhase, ConditionsExt, Sandbox, SandboxPhase};
use ramify_e2e::ControlPlane;
use ramify_e2e::access::{port_forward, serves};
use ramify_e2e::node::{RealNode, cgroup_roots};
use ramify_e2e::registry::Registry;
use ramify_e2e::system::System;

/// The test's cluster: the real node, and ramify's operator and node agent in cluster
/// mode (the agent announcing the kubelet's node).
struct Bed {
    sys: System,
    node: RealNode,
    /// busybox:1 of the test registry, by digest.
    busybox: String,
    /// The plain busybox image imported into the node (for ordinary Pods).
    node_busybox: String,
}

async fn bed(name: &str) -> Bed {
    bed_with(name, &[]).await
}

/// [`bed`] with more node agent flags (an object store).
async fn bed_with(name: &str, agent_args: &[&str]) -> Bed {
    let reg = Registry::shared().unwrap();
    let pod_image = reg.ramify_pod_image("e2e-cluster").unwrap();
    let busybox = reg.image("busybox:1").unwrap().by_digest();
    let (node_busybox, _) = RealNode::busybox_image().unwrap();
    let cp = ControlPlane::ensure().unwrap();
    let node = RealNode::start_pulling_from(&cp, &[reg.addr()])
        .await
        .unwrap();
    eprintln!(
        "cluster: node Ready {:.1}s after up.sh",
        node.ready_after.as_secs_f64()
    );
    let sys = System::start_cluster_mode_with(name, &node, &pod_image, agent_args).await;
    Bed {
        sys,
        node,
        busybox,
        node_busybox,
    }
}

impl Bed {
    fn kubectl(&self, args: &[&str]) -> ramify_e2e::KubectlOutput {
        let mut a = vec!["-n", self.sys.ns.name.as_str()];
        a.extend(args);
        self.sys.cp.kubectl_run(&a, None).unwrap()
    }

    fn kubectl_ok(&self, args: &[&str]) -> String {
        let out = self.kubectl(args);
        assert!(
            out.success,
            "kubectl {args:?}: {}\n{}",
            out.stderr,
            self.sys.diagnostics()
        );
        out.stdout
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.sys.client.clone(), &self.sys.ns.name)
    }

    /// Waits until BranchSet `bs` ended; it must have committed `winner`.
    async fn committed(&self, bs: &str, winner: &str) {
        let got = self
            .sys
            .wait_branchset(bs, "ended", 300, |b| {
                b.status.as_ref().is_some_and(|s| s.phase.is_ended())
            })
            .await;
        let st = got.status.unwrap();
        assert_eq!(st.phase, BranchSetPhase::Committed, "{st:#?}");
        assert_eq!(st.winner.as_deref(), Some(winner));
    }

    /// The Pod the Sandbox's status names (default before it has one).
    async fn pod_ref(&self, name: &str) -> ramify_crds::PodRef {
        let sbx = self.sys.sandboxes().get(name).await.unwrap();
        sbx.status.and_then(|s| s.pod).unwrap_or_default()
    }

    /// The name of the Pod the Sandbox's status names (empty before it has one).
    async fn current_pod(&self, name: &str) -> String {
        self.pod_ref(name).await.name
    }

    /// The Sandbox's phase now.
    async fn current_phase(&self, name: &str) -> SandboxPhase {
        let sbx = self.sys.sandboxes().get(name).await.unwrap();
        sbx.status.map(|s| s.phase).unwrap_or_default()
    }

    /// A Sandbox of busybox:1 running `script`, with `extra` spec lines.
    fn sandbox(&self, name: &str, script: &str, extra: &str) -> String {
        format!(
            r#"apiVersion: ramify.dev/v1alpha1
kind: Sandbox
metadata:
  name: {name}
spec:
  image: {}
  command: ["/bin/sh", "-c", {}]
  resources: {{cpu: 200m, memory: 128Mi}}
{extra}"#,
            self.busybox,
            serde_json::to_string(script).unwrap()
        )
    }

    /// Waits for `phase`; fails at once when the sandbox ends in another one.
    async fn phase(&self, name: &str, phase: SandboxPhase, secs: u64) -> Sandbox {
        let s = self
            .sys
            .wait_sandbox(name, &format!("{phase:?}"), secs, move |s| {
                s.status.as_ref().is_some_and(|st| {
                    st.phase == phase
                        || matches!(
                            st.phase,
                            SandboxPhase::Failed | SandboxPhase::Succeeded | SandboxPhase::Aborted
                        )
                })
            })
            .await;
        let got = s.status.as_ref().map(|st| st.phase);
        assert_eq!(
            got,
            Some(phase),
            "{name}: {:#?}\n{}",
            s.status,
            self.sys.diagnostics()
        );
        s
    }

    /// Waits until condition `type_` of the Sandbox has `reason`; returns its message.
    async fn reason(&self, name: &str, type_: &'static str, reason: &'static str) -> String {
        let s = self
            .sys
            .wait_sandbox(name, &format!("{type_} reason {reason}"), 120, move |s| {
                s.status
                    .as_ref()
                    .and_then(|st| st.conditions.get_condition(type_))
                    .is_some_and(|c| c.reason == reason)
            })
            .await;
        s.status
            .unwrap()
            .conditions
            .get_condition(type_)
            .unwrap()
            .message
            .clone()
    }

    /// Polls until `f` holds (a condition on the node or the API), failing after `secs`.
    async fn until(&self, what: &str, secs: u64, mut f: impl AsyncFnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(secs);
        while !f().await {
            assert!(
                Instant::now() < deadline,
                "{what} within {secs}s\n{}",
                self.sys.diagnostics()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The count of a [`COUNTER`] sandbox, read in it.
    async fn count(&self, name: &str) -> u64 {
        self.sys
            .number_on(&self.sys.state_dir, name, "/home/app/count")
            .await
    }

    /// The UID of the Pod the Sandbox's status names.
    async fn pod_uid(&self, name: &str) -> String {
        self.pod_ref(name).await.uid
    }

    /// Waits until `name` runs again in a Pod other than `old_pod` (it moved).
    async fn running_in_new_pod(&self, name: &str, old_pod: &str, secs: u64) -> Sandbox {
        let old = old_pod.to_string();
        let s = self
            .sys
            .wait_sandbox(name, "Running in a new Pod", secs, move |s| {
                s.status.as_ref().is_some_and(|st| {
                    matches!(st.phase, SandboxPhase::Failed | SandboxPhase::Succeeded)
                        || (st.phase == SandboxPhase::Running
                            && st.pod.as_ref().is_some_and(|p| p.uid != old))
                })
            })
            .await;
        assert_eq!(
            s.status.as_ref().map(|st| st.phase),
            Some(SandboxPhase::Running),
            "{name}: {:#?}\n{}",
            s.status,
            self.sys.diagnostics()
        );
        s
    }

    /// Evicts `name`'s Pod and follows its workspace to its new Pod: Suspended
    /// (`PodEvicted`, checkpointed), then Running in a new Pod, counting on.
    async fn evict_and_follow(&self, name: &str) -> Moved {
        let before = self.count(name).await;
        let old_pod = self.pod_uid(name).await;
        let t0 = Instant::now();
        self.pods()
            .evict(name, &EvictParams::default())
            .await
            .unwrap();
        let msg = self.reason(name, CONDITION_READY, REASON_POD_EVICTED).await;
        assert!(
            msg.contains("checkpointed with its processes, memory and files"),
            "{msg}"
        );
        let s = self.running_in_new_pod(name, &old_pod, 180).await;
        let took = t0.elapsed();
        let after = self.count(name).await;
        Moved {
            before,
            after,
            took,
            message: msg,
            sandbox: s,
        }
    }

    async fn teardown(mut self) {
        let ns = self.sys.ns.name.clone();
        self.sys.teardown_and_check_clean().await;
        // No Pod of the test namespace is left, nor anything of ramify under kubepods.
        let left = ramify_cgroups_under_kubepods();
        assert!(
            left.is_empty(),
            "sandbox cgroups left under kubepods: {left:?}"
        );
        let _ = ns;
        self.node.stop().unwrap();
    }
}

/// The directories of a Pod's cgroup (cgroupfs driver: `kubepods[/qos]/pod<uid>`) in the
/// memory hierarchy.
/// Counts in a shell variable (memory) and mirrors it to a file: after a move it goes
/// on from where it was; a fresh start would count from 1 again.
const COUNTER: &str = "i=0; while true; do i=$((i+1)); echo $i > /home/app/count; sleep 0.1; done";

/// A workspace followed through a move.
struct Moved {
    /// Its count before the eviction and once it ran again.
    before: u64,
    after: u64,
    /// From the eviction to Running in the new Pod.
    took: Duration,
    /// What its `Ready` condition said while it moved.
    message: String,
    sandbox: Sandbox,
}

fn pod_memory_cgroup(uid: &str) -> Option<PathBuf> {
    let root = cgroup_roots()
        .into_iter()
        .find(|r| r.ends_with("memory"))?
        .join("kubepods");
    [
        root.join(format!("pod{uid}")),
        root.join(format!("burstable/pod{uid}")),
        root.join(format!("besteffort/pod{uid}")),
    ]
    .into_iter()
    .find(|p| p.is_dir())
}

/// `ramify-*` cgroups anywhere under kubepods (a sandbox's, inside its Pod's).
fn ramify_cgroups_under_kubepods() -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack: Vec<PathBuf> = cgroup_roots().iter().map(|r| r.join("kubepods")).collect();
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                if e.file_name().to_string_lossy().starts_with("ramify-") {
                    out.push(e.path());
                }
                stack.push(e.path());
            }
        }
    }
    out
}

fn read_u64(p: &std::path::Path) -> u64 {
    std::fs::read_to_string(p)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// `curl` from the host, with a short timeout; the body on success.
fn curl(url: &str) -> Option<String> {
    let out = Command::new("curl")
        .args(["-sf", "--max-time", "3", url])
        .stdin(Stdio::null())
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// A Sandbox from an image becomes a Running Pod placed by the scheduler on the real
/// node: it answers on the Pod IP and through a Service selecting the Pod's labels,
/// `kubectl logs` shows its console, its requests show on the node, its memory counts
/// in the Pod's cgroup, it gets no service-account token, its egress is denied (another
/// Pod, the node itself), and a sandbox that exits ends its Pod with its exit code.
#[tokio::test]
async fn a_sandbox_is_a_pod_placed_by_the_scheduler() {
    let _one_node = RealNode::exclusive().await;
    let bed = bed("cluster").await;
    let started = Instant::now();
    bed.sys.apply(&bed.sandbox(
        "web",
        "echo hello from the sandbox; mkdir -p /home/app/www && echo served-by-ramify > /home/app/www/index.html && exec httpd -f -p 8080 -h /home/app/www",
        "  pod:\n    labels: {app: ramify-web}\n",
    ));
    let web = bed.phase("web", SandboxPhase::Running, 300).await;
    eprintln!(
        "cluster: apply -> Running {:.2}s (first pull of the pod and workload images included)",
        started.elapsed().as_secs_f64()
    );
    let st = web.status.clone().unwrap();
    assert_eq!(st.node_name.as_deref(), Some(bed.node.name.as_str()));
    let pod_ref = st.pod.clone().expect("status.pod");
    assert_eq!(pod_ref.name, "web");

    // The Pod: owned by the Sandbox, placed by the scheduler on the node, no token.
    let pod = bed.pods().get("web").await.unwrap();
    let owner = &pod.metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!(owner.kind, "Sandbox");
    assert_eq!(Some(&owner.uid), web.metadata.uid.as_ref());
    assert_eq!(owner.controller, Some(true));
    assert_eq!(
        pod.metadata.labels.as_ref().unwrap().get(LABEL_SANDBOX_UID),
        web.metadata.uid.as_ref()
    );
    let spec = pod.spec.clone().unwrap();
    assert_eq!(spec.node_name.as_deref(), Some(bed.node.name.as_str()));
    assert_eq!(spec.automount_service_account_token, Some(false));
    let c = &spec.containers[0];
    assert!(
        c.volume_mounts
            .iter()
            .flatten()
            .all(|m| !m.mount_path.contains("serviceaccount")),
        "{:?}",
        c.volume_mounts
    );
    let requests = c.resources.as_ref().unwrap().requests.clone().unwrap();
    assert_eq!(requests["cpu"].0, "200m");
    assert_eq!(requests["memory"].0, "128Mi");
    let pod_status = pod.status.clone().unwrap();
    assert_eq!(pod_status.phase.as_deref(), Some("Running"));
    let pod_ip = pod_status.pod_ip.clone().unwrap();
    assert_eq!(pod_ref.uid, pod.metadata.uid.clone().unwrap());

    // kubectl logs shows the workload's console output.
    bed.until("kubectl logs shows the sandbox's console", 60, async || {
        bed.kubectl(&["logs", "web"])
            .stdout
            .contains("hello from the sandbox")
    })
    .await;

    // The sandbox answers on the Pod IP, and through a Service selecting the Pod.
    bed.until("the sandbox answers on its Pod IP", 60, async || {
        curl(&format!("http://{pod_ip}:8080/")).as_deref() == Some("served-by-ramify")
    })
    .await;
    bed.sys.apply(
        "apiVersion: v1\nkind: Service\nmetadata: {name: web}\nspec:\n  selector: {app: ramify-web}\n  ports: [{port: 80, targetPort: 8080}]\n",
    );
    let cluster_ip = bed
        .kubectl_ok(&["get", "service", "web", "-o", "jsonpath={.spec.clusterIP}"])
        .trim()
        .to_string();
    bed.until("the Service reaches the sandbox", 60, async || {
        curl(&format!("http://{cluster_ip}/")).as_deref() == Some("served-by-ramify")
    })
    .await;
    // And through `kubectl ramify port-forward`: the API server, ramify-api and the
    // agent's endpoint into the sandbox inside its Pod, as in standalone mode.
    let _api = bed.sys.start_api();
    let (mut fwd, local) = port_forward(&bed.sys.cp.kubeconfig, &bed.sys.ns.name, "web", 8080);
    serves(
        local,
        "served-by-ramify",
        "port-forward to a sandbox in a Pod",
    )
    .await;
    let _ = fwd.kill();
    let _ = fwd.wait();

    // The node accounts the Pod's requests; the sandbox's memory is in the Pod's cgroup.
    let describe = bed
        .sys
        .cp
        .kubectl_run(&["describe", "node", &bed.node.name], None)
        .unwrap()
        .stdout;
    let line = describe
        .lines()
        .find(|l| l.contains(&bed.sys.ns.name) && l.contains(" web "))
        .unwrap_or_else(|| panic!("web not among the node's pods:\n{describe}"));
    assert!(line.contains("200m"), "{line}");
    let pod_cg = pod_memory_cgroup(&pod_ref.uid).expect("the Pod's memory cgroup");
    let inner: Vec<_> = std::fs::read_dir(&pod_cg)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("ramify-"))
        .collect();
    assert_eq!(
        inner.len(),
        1,
        "one sandbox cgroup inside {}",
        pod_cg.display()
    );
    let sandbox_mem = read_u64(&inner[0].path().join("memory.usage_in_bytes"));
    let pod_mem = read_u64(&pod_cg.join("memory.usage_in_bytes"));
    eprintln!(
        "cluster: sandbox memory {} KiB, in the Pod's cgroup {} KiB",
        sandbox_mem / 1024,
        pod_mem / 1024
    );
    assert!(
        sandbox_mem > 1 << 20,
        "the sandbox uses memory in its cgroup"
    );
    assert!(
        pod_mem >= sandbox_mem,
        "the Pod's cgroup counts the sandbox"
    );
    assert_eq!(
        read_u64(&pod_cg.join("memory.limit_in_bytes")),
        128 << 20,
        "the Pod's limit is the sandbox's"
    );

    // Egress is denied: neither another Pod on the node nor the node itself.
    let listener = serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "listener"},
        "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "main", "image": bed.node_busybox, "imagePullPolicy": "Never",
                "command": ["sh", "-c", "while true; do echo reached | nc -l -p 9000; done"]}]}
    });
    bed.pods()
        .create(
            &PostParams::default(),
            &serde_json::from_value(listener).unwrap(),
        )
        .await
        .unwrap();
    let mut listener_ip = String::new();
    bed.until("the listener Pod runs", 120, async || {
        let p = bed.pods().get("listener").await.unwrap();
        let st = p.status.unwrap_or_default();
        listener_ip = st.pod_ip.unwrap_or_default();
        st.phase.as_deref() == Some("Running") && !listener_ip.is_empty()
    })
    .await;
    // The node's own pods reach it (so a refusal below is the sandbox's policy). The
    // Pod runs before its `nc` listens: asked until it answers.
    bed.until("the node reaches the listener Pod", 30, async || {
        curl_nc(&listener_ip).as_deref() == Some("reached")
    })
    .await;
    // The kubelet listens on the node IP (hack/node/up.sh: the plane's port base + 10).
    let base: u16 = std::env::var("RAMIFY_CP_PORT_BASE")
        .ok()
        .and_then(|b| b.parse().ok())
        .unwrap_or(16440);
    let kubelet = format!("{}:{}", bed.node.ip, base + 10);
    assert!(
        std::net::TcpStream::connect_timeout(&kubelet.parse().unwrap(), Duration::from_secs(3))
            .is_ok(),
        "the kubelet does not listen on {kubelet}"
    );
    for (what, target) in [
        ("another Pod", format!("{listener_ip} 9000")),
        ("the node's kubelet", kubelet.replace(':', " ")),
    ] {
        let (code, out) = bed.sys.exec(
            "web",
            &format!("echo x | nc -w 2 {target} && echo CONNECTED"),
        );
        assert!(
            code != 0 && !out.contains("CONNECTED") && !out.contains("reached"),
            "the sandbox reached {what} ({target}): code {code}, {out}"
        );
    }

    // A sandbox that exits ends its Pod with its exit code.
    bed.sys
        .apply(&bed.sandbox("once", "echo about to fail; exit 3", ""));
    let once = bed.phase("once", SandboxPhase::Failed, 300).await;
    assert_eq!(once.status.unwrap().exit_code, Some(3));
    bed.until(
        "the Pod of a sandbox that exited 3 fails with 3",
        60,
        async || {
            let p = bed.pods().get("once").await.unwrap();
            let st = p.status.unwrap_or_default();
            let code = st
                .container_statuses
                .unwrap_or_default()
                .first()
                .and_then(|c| c.state.as_ref()?.terminated.as_ref().map(|t| t.exit_code));
            st.phase.as_deref() == Some("Failed") && code == Some(3)
        },
    )
    .await;
    assert!(
        bed.kubectl(&["logs", "once"])
            .stdout
            .contains("about to fail"),
        "the exited sandbox's console stays in kubectl logs"
    );

    // Deleting the Sandbox deletes its Pod and the sandbox.
    bed.sys
        .sandboxes()
        .delete("web", &DeleteParams::default())
        .await
        .unwrap();
    bed.until("web's Pod is gone", 120, async || {
        bed.pods().get_opt("web").await.unwrap().is_none()
    })
    .await;
    bed.pods()
        .delete("listener", &DeleteParams::default())
        .await
        .unwrap();
    bed.teardown().await;
}

/// `nc` from the host to a listener Pod's port 9000; what it answered.
fn curl_nc(ip: &str) -> Option<String> {
    let out = Command::new("busybox")
        .args(["nc", "-w", "3", ip, "9000"])
        .stdin(Stdio::null())
        .output()
        .ok()?;
    let s = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (!s.is_empty()).then_some(s)
}

/// The scheduler and the API server decide for sandboxes as for Pods: a ResourceQuota
/// for two Pods keeps the third sandbox Pending with the quota's message until room is
/// freed, a node selector no node matches keeps one Pending with the scheduler's
/// message, a deleted Pod ends its sandbox, saying so, an evicted workspace moves to a
/// new Pod with its memory, and `kubectl drain` moves the node's workspaces out (they
/// wait, nothing of them running, until `kubectl uncordon`).
#[tokio::test]
async fn quotas_selectors_deletion_eviction_and_drain_act_on_sandboxes() {
    let _one_node = RealNode::exclusive().await;
    let bed = bed("cluster-policy").await;
    bed.sys.apply(
        "apiVersion: v1\nkind: ResourceQuota\nmetadata: {name: two-pods}\nspec:\n  hard: {pods: \"2\"}\n",
    );
    let forever = "while true; do sleep 1; done";
    for name in ["a", "b"] {
        bed.sys.apply(&bed.sandbox(name, COUNTER, ""));
        bed.phase(name, SandboxPhase::Running, 300).await;
    }
    bed.sys.apply(&bed.sandbox("c", COUNTER, ""));
    let msg = bed
        .reason("c", CONDITION_SCHEDULED, REASON_POD_REFUSED)
        .await;
    assert!(
        msg.contains("exceeded quota") && msg.contains("two-pods"),
        "{msg}"
    );
    assert_eq!(bed.current_phase("c").await, SandboxPhase::Pending);

    bed.sys.apply(&bed.sandbox(
        "nowhere",
        forever,
        "  pod:\n    nodeSelector: {ramify.dev/e2e-no-such-node: \"true\"}\n",
    ));
    // The quota counts Pods: free a place first so the selector is what keeps it.
    bed.pods()
        .delete("a", &DeleteParams::default())
        .await
        .unwrap();
    let msg = bed.reason("a", CONDITION_READY, REASON_POD_DELETED).await;
    assert!(msg.contains("deleted"), "{msg}");
    let a = bed.phase("a", SandboxPhase::Failed, 60).await;
    assert!(a.status.unwrap().sandbox_id.is_some());
    // The quota did its part: without it c starts, and nowhere waits for a node its
    // selector matches.
    bed.kubectl_ok(&["delete", "resourcequota", "two-pods"]);
    let msg = bed
        .reason("nowhere", CONDITION_SCHEDULED, REASON_UNSCHEDULABLE)
        .await;
    assert!(msg.contains("node affinity/selector"), "{msg}");
    bed.phase("c", SandboxPhase::Running, 300).await;
    assert_eq!(bed.current_phase("nowhere").await, SandboxPhase::Pending);
    // Nothing of a runs: its Pod is gone, its sandbox destroyed.
    let pods = bed.pods().list(&ListParams::default()).await.unwrap();
    let names: Vec<_> = pods
        .items
        .iter()
        .filter_map(|p| p.metadata.name.clone())
        .collect();
    assert!(!names.contains(&"a".into()), "{names:?}");

    // An evicted workspace moves: checkpointed out of its Pod, resumed in a new one
    // with its processes and memory (its count goes on; a fresh start counts from 1).
    let m = bed.evict_and_follow("b").await;
    assert!(
        m.after > m.before,
        "b counted {} before its eviction and {} after: {}",
        m.before,
        m.after,
        m.message
    );
    assert!(m.message.contains("holds the image"), "{}", m.message);
    eprintln!(
        "evicted b moved to a new Pod in {:.1} s, counting on ({} -> {})",
        m.took.as_secs_f64(),
        m.before,
        m.after
    );
    bed.sys.event("b", ramify_crds::REASON_MOVED).await;
    let b_id = m.sandbox.status.unwrap().sandbox_id.unwrap();

    // `kubectl drain` evicts the node's sandbox Pods like any other (their controller
    // is the Sandbox, so no --force; their emptyDir needs --delete-emptydir-data): both
    // workspaces move out, and with the node cordoned their new Pods wait, pinned to the
    // node holding their images, with nothing of them running.
    let c_id = bed
        .sys
        .sandboxes()
        .get("c")
        .await
        .unwrap()
        .status
        .and_then(|s| s.sandbox_id)
        .expect("c's sandbox id");
    let counts = [bed.count("b").await, bed.count("c").await];
    let pods_before = [bed.pod_uid("b").await, bed.pod_uid("c").await];
    let drain = bed
        .sys
        .cp
        .kubectl_run(
            &[
                "drain",
                &bed.node.name,
                "--ignore-daemonsets",
                "--delete-emptydir-data",
                "--timeout=180s",
            ],
            None,
        )
        .unwrap();
    assert!(
        drain.success,
        "kubectl drain: {}{}",
        drain.stdout, drain.stderr
    );
    for name in ["b", "c"] {
        let msg = bed
            .reason(name, CONDITION_SCHEDULED, REASON_UNSCHEDULABLE)
            .await;
        assert!(
            msg.contains("unschedulable") || msg.contains("node"),
            "{msg}"
        );
        assert_eq!(bed.current_phase(name).await, SandboxPhase::Suspended);
    }
    bed.until("nothing of the drained workspaces runs", 60, async || {
        [&b_id, &c_id].iter().all(|id| {
            let ps = Command::new("pgrep").args(["-f", id]).output().unwrap();
            ps.stdout.is_empty()
        }) && ramify_cgroups_under_kubepods().is_empty()
    })
    .await;
    let uncordon = bed
        .sys
        .cp
        .kubectl_run(&["uncordon", &bed.node.name], None)
        .unwrap();
    assert!(uncordon.success, "{}", uncordon.stderr);
    for (i, name) in ["b", "c"].into_iter().enumerate() {
        bed.running_in_new_pod(name, &pods_before[i], 300).await;
        let now = bed.count(name).await;
        assert!(
            now > counts[i],
            "{name} counted {} before the drain and {now} after",
            counts[i]
        );
    }
    bed.teardown().await;
}

/// With an object store, an evicted workspace's image goes through it: uploaded before
/// its old Pod ends (no copy is kept on the node), downloaded and verified where its
/// new Pod runs, and dropped from the store once it runs again.
#[tokio::test]
async fn an_evicted_workspace_moves_through_the_object_store() {
    let _one_node = RealNode::exclusive().await;
    let store = objectstore::TestStore::new();
    let args = store.agent_args();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let bed = bed_with("cluster-move-store", &args).await;
    bed.sys.apply(&bed.sandbox("ws", COUNTER, ""));
    bed.phase("ws", SandboxPhase::Running, 300).await;
    bed.until("ws counts", 60, async || bed.count("ws").await > 5)
        .await;
    let m = bed.evict_and_follow("ws").await;
    assert!(
        m.message.contains("a copy is in the object store"),
        "{}",
        m.message
    );
    assert!(m.after > m.before, "{} then {}", m.before, m.after);
    let downloaded = bed.sys.event("ws", "Downloaded").await;
    assert!(
        downloaded
            .note
            .as_deref()
            .is_some_and(|n| n.contains("verified")),
        "{downloaded:?}"
    );
    eprintln!(
        "evicted ws moved through the object store in {:.1} s ({} -> {})",
        m.took.as_secs_f64(),
        m.before,
        m.after
    );
    let client = store.client();
    bed.until("the store's copy dropped once it runs", 60, async || {
        client.list_images().await.unwrap().is_empty()
    })
    .await;
    bed.teardown().await;
}

/// An eviction while the node agent is down: the workspace's Pod, told to stop, finds
/// the agent's heartbeat stale and stays (Terminating) instead of ending with the
/// workspace inside; the agent, back, sees the eviction and moves the workspace out,
/// counting on in a new Pod.
#[tokio::test]
async fn an_eviction_while_the_node_agent_is_down_waits_for_it_and_moves_the_workspace() {
    let _one_node = RealNode::exclusive().await;
    let mut bed = bed("cluster-move-agent-down").await;
    bed.sys.apply(&bed.sandbox("ws", COUNTER, ""));
    bed.phase("ws", SandboxPhase::Running, 300).await;
    bed.until("ws counts", 60, async || bed.count("ws").await > 5)
        .await;
    let old_pod = bed.pod_uid("ws").await;
    let beat = ramify_crds::pod::pod_volume_on_host(&bed.node.dir.join("kubelet"), &old_pod)
        .join(ramify_crds::pod::POD_HEARTBEAT_FILE);
    bed.until(
        "the agent's heartbeat in the Pod's volume",
        30,
        async || beat.exists(),
    )
    .await;

    bed.sys.agent.kill().unwrap();
    let stale = Duration::from_secs(ramify_crds::pod::POD_HEARTBEAT_STALE_SECONDS);
    bed.until("the heartbeat goes stale", 60, async || {
        std::fs::metadata(&beat)
            .and_then(|m| m.modified())
            .is_ok_and(|t| t.elapsed().is_ok_and(|a| a > stale))
    })
    .await;
    let before = bed.count("ws").await;
    bed.pods()
        .evict("ws", &EvictParams::default())
        .await
        .unwrap();
    // The Pod waits for the agent (a running one gets 2 s to say the workspace moves).
    bed.until("ramify-pod says it waits for the agent", 60, async || {
        bed.kubectl(&["logs", "ws"])
            .stdout
            .contains("node agent is down")
    })
    .await;
    assert_eq!(bed.current_phase("ws").await, SandboxPhase::Running);

    let t0 = Instant::now();
    bed.sys.agent.start().unwrap();
    let msg = bed.reason("ws", CONDITION_READY, REASON_POD_EVICTED).await;
    assert!(
        msg.contains("checkpointed with its processes, memory and files"),
        "{msg}"
    );
    bed.running_in_new_pod("ws", &old_pod, 180).await;
    let after = bed.count("ws").await;
    assert!(
        after > before,
        "counted {before} before, {after} after: not moved"
    );
    eprintln!(
        "evicted with the agent down: moved {:.1} s after the agent's restart ({before} -> {after})",
        t0.elapsed().as_secs_f64()
    );
    bed.teardown().await;
}

/// A BranchSet forks a live sandbox in cluster mode: each branch is a Pod on the
/// snapshot's node, restored from the snapshot inside it; the first branch that commits
/// promotes its files (Paths) into the parent, the others' Pods go. A branch whose Pod
/// is evicted fails, saying so. Then a Full commit:
/// the winner's sandbox becomes the parent's, in the winner's Pod, which is handed to
/// the parent, so the parent's Service reaches the winner's server.
#[tokio::test]
async fn a_branchset_forks_a_pod_backed_sandbox_and_commits_paths_then_full() {
    let _one_node = RealNode::exclusive().await;
    let bed = bed("cluster-fork").await;
    bed.sys.apply(&bed.sandbox(
        "workspace",
        "mkdir -p /home/app/work /home/app/www && echo mode=slow > /home/app/work/app.conf; echo workspace > /home/app/www/index.html; httpd -p 8080 -h /home/app/www; i=0; while true; do i=$((i+1)); echo $i > /home/app/count; sleep 0.2; done",
        "  pod:\n    labels: {app: ramify-ws}\n",
    ));
    bed.phase("workspace", SandboxPhase::Running, 300).await;
    bed.sys.apply(
        r#"apiVersion: ramify.dev/v1alpha1
kind: BranchSet
metadata:
  name: try
spec:
  source: {sandbox: workspace}
  branches:
    - name: broken
      run: ["/bin/sh", "-c", "echo mode=broken > /home/app/work/app.conf"]
    - name: fast
      run: ["/bin/sh", "-c", "echo mode=fast > /home/app/work/app.conf"]
  verdict:
    command: ["/bin/sh", "-c", "grep -q mode=fast /home/app/work/app.conf"]
  commit:
    mode: Paths
    paths: ["/home/app/work/**"]
  timeoutSeconds: 240
"#,
    );
    // Each branch runs in a Pod of its own on the snapshot's node.
    bed.until("both branches have Pods on the node", 240, async || {
        let mut on_node = 0;
        for b in ["try-broken", "try-fast"] {
            if let Some(p) = bed.pods().get_opt(b).await.unwrap()
                && p.spec.and_then(|s| s.node_name).as_deref() == Some(bed.node.name.as_str())
            {
                on_node += 1;
            }
        }
        on_node == 2
    })
    .await;
    bed.committed("try", "fast").await;
    bed.sys.wait_branches_gone("try", 120).await;
    bed.until("the branches' Pods are gone", 120, async || {
        bed.pods().get_opt("try-broken").await.unwrap().is_none()
            && bed.pods().get_opt("try-fast").await.unwrap().is_none()
    })
    .await;
    let (code, conf) = bed.sys.exec("workspace", "cat /home/app/work/app.conf");
    assert_eq!((code, conf.as_str()), (0, "mode=fast"));

    // Nesting: a BranchSet forks a branch (its Pod), commits (Full) into it, and the
    // branch then commits (Full) into the workspace through its control file, which a
    // non-root image's user writes.
    bed.sys.apply(
        "apiVersion: ramify.dev/v1alpha1\nkind: BranchSet\nmetadata: {name: outer}\nspec:\n  source: {sandbox: workspace}\n  branches: [{name: explore}]\n  timeoutSeconds: 300\n",
    );
    bed.phase("outer-explore", SandboxPhase::Running, 240).await;
    bed.sys
        .apply(&ramify_e2e::manifests::nested_inner_branchset(
            "/home/app/work/nested",
            240,
        ));
    bed.committed("inner", "left").await;
    // The nested commit landed in the branch (now in the inner winner's Pod), not in
    // the workspace.
    assert_eq!(
        bed.sys.exec("outer-explore", "cat /home/app/work/nested").1,
        "left"
    );
    assert_ne!(
        bed.sys.exec("workspace", "test -e /home/app/work/nested").0,
        0
    );
    bed.until("the branch is in the inner winner's Pod", 120, async || {
        bed.current_pod("outer-explore").await == "inner-left"
    })
    .await;
    // The image runs as a non-root user: its control directory is its own.
    assert_eq!(bed.sys.exec("outer-explore", "id -u").1, "1000");
    let (code, identity) = bed
        .sys
        .exec("outer-explore", "cat /run/ramify/identity 2>&1");
    assert!(
        code == 0 && identity.starts_with('{'),
        "the workload reads its identity: {code} {identity}"
    );
    assert_eq!(
        bed.sys
            .exec("outer-explore", "echo commit > /run/ramify/verdict")
            .0,
        0
    );
    bed.committed("outer", "explore").await;
    assert_eq!(
        bed.sys.exec("workspace", "cat /home/app/work/nested").1,
        "left"
    );
    bed.sys.wait_branches_gone("outer", 120).await;
    bed.sys.wait_branches_gone("inner", 120).await;

    // A branch whose Pod is evicted fails, saying so; its sibling runs on.
    bed.sys.apply(
        "apiVersion: ramify.dev/v1alpha1\nkind: BranchSet\nmetadata: {name: held}\nspec:\n  source: {sandbox: workspace}\n  policy: Manual\n  branches: [{name: gone}, {name: kept}]\n  timeoutSeconds: 240\n",
    );
    bed.phase("held-gone", SandboxPhase::Running, 240).await;
    bed.phase("held-kept", SandboxPhase::Running, 240).await;
    bed.pods()
        .evict("held-gone", &EvictParams::default())
        .await
        .unwrap();
    let held = bed
        .sys
        .wait_branchset("held", "branch gone failed", 120, |b| {
            b.status.as_ref().is_some_and(|s| {
                s.branches
                    .iter()
                    .any(|b| b.name == "gone" && b.phase == ramify_crds::BranchPhase::Failed)
            })
        })
        .await;
    let x = held
        .status
        .unwrap()
        .branches
        .into_iter()
        .find(|b| b.name == "gone")
        .unwrap();
    assert!(x.reason.contains("evicted"), "{}", x.reason);
    assert_eq!(bed.current_phase("held-kept").await, SandboxPhase::Running);
    bed.sys
        .branchsets()
        .delete("held", &DeleteParams::default())
        .await
        .unwrap();
    bed.sys.wait_branches_gone("held", 120).await;

    // A Full commit: the parent's Service follows its sandbox into the winner's Pod.
    bed.sys.apply(
        "apiVersion: v1\nkind: Service\nmetadata: {name: ws}\nspec:\n  selector: {app: ramify-ws}\n  ports: [{port: 80, targetPort: 8080}]\n",
    );
    let cluster_ip = bed
        .kubectl_ok(&["get", "service", "ws", "-o", "jsonpath={.spec.clusterIP}"])
        .trim()
        .to_string();
    let url = format!("http://{cluster_ip}/");
    bed.until("the Service reaches the workspace", 60, async || {
        curl(&url).as_deref() == Some("workspace")
    })
    .await;
    let parent = bed.sys.sandboxes().get("workspace").await.unwrap();
    let parent_uid = parent.metadata.uid;
    // The Pod the parent runs in now: the nested Full commit above moved it into the
    // inner winner's, so it is not named after the parent.
    let old_pod = parent.status.unwrap().pod.expect("status.pod").name;
    bed.sys.apply(
        r#"apiVersion: ramify.dev/v1alpha1
kind: BranchSet
metadata:
  name: whole
spec:
  source: {sandbox: workspace}
  branches:
    - name: one
      run: ["/bin/sh", "-c", "echo one > /home/app/www/index.html"]
    - name: two
      run: ["/bin/sh", "-c", "echo two > /home/app/www/index.html"]
  verdict:
    command: ["/bin/sh", "-c", "grep -q two /home/app/www/index.html"]
  commit:
    mode: Full
  timeoutSeconds: 240
"#,
    );
    bed.committed("whole", "two").await;
    bed.until("the Service reaches the winner's server", 120, async || {
        curl(&url).as_deref() == Some("two")
    })
    .await;
    bed.sys.wait_branches_gone("whole", 120).await;
    // The parent's Pod is the winner's now: relabelled, owned by the parent; the
    // parent's old Pod and the loser's are gone.
    bed.until(
        "the parent's old Pod and the loser's are gone",
        120,
        async || {
            bed.pods().get_opt(&old_pod).await.unwrap().is_none()
                && bed.pods().get_opt("whole-one").await.unwrap().is_none()
        },
    )
    .await;
    let ws = bed.phase("workspace", SandboxPhase::Running, 10).await;
    let pod_ref = ws.status.unwrap().pod.expect("status.pod");
    assert_eq!(pod_ref.name, "whole-two");
    let selected = bed
        .pods()
        .list(&ListParams::default().labels("app=ramify-ws"))
        .await
        .unwrap();
    let names: Vec<_> = selected.iter().map(|p| p.name_any()).collect();
    assert_eq!(names, ["whole-two"]);
    let pod = &selected.items[0];
    let owners = pod.metadata.owner_references.clone().unwrap();
    assert_eq!(owners.len(), 1, "{owners:?}");
    assert_eq!(Some(&owners[0].uid), parent_uid.as_ref());
    assert_eq!(owners[0].controller, Some(true));
    assert_eq!(Some(pod_ref.uid.clone()), pod.metadata.uid);
    assert_eq!(
        pod.metadata.labels.as_ref().unwrap().get(LABEL_SANDBOX_UID),
        parent_uid.as_ref()
    );
    // The workspace is the winner's: its files and its counting process, alive.
    let (code, conf) = bed.sys.exec(
        "workspace",
        "cat /home/app/www/index.html /home/app/work/app.conf",
    );
    assert_eq!((code, conf.as_str()), (0, "two\nmode=fast"));
    let (_, c1) = bed.sys.exec("workspace", "cat /home/app/count");
    bed.until("the workspace keeps counting", 30, async || {
        let (_, c2) = bed.sys.exec("workspace", "cat /home/app/count");
        c2.parse::<u64>().unwrap_or(0) > c1.parse::<u64>().unwrap_or(u64::MAX)
    })
    .await;
    // Deleting the parent deletes the Pod it holds.
    bed.sys
        .sandboxes()
        .delete("workspace", &DeleteParams::default())
        .await
        .unwrap();
    bed.until(
        "the handed-over Pod goes with its parent",
        120,
        async || bed.pods().get_opt("whole-two").await.unwrap().is_none(),
    )
    .await;
    bed.teardown().await;
}

/// Cluster mode's warm pool: a Snapshot keeps Pods on its node, each holding a frozen
/// branch; a BranchSet's branches adopt those Pods (relabelled, re-owned) and thaw the
/// branch already living in them, instead of waiting for Pods of their own; the pool
/// refills with new Pods; a Full commit hands the winner's adopted Pod to the parent;
/// deleting the Snapshot takes its Pods.
#[tokio::test]
async fn a_warm_pool_of_pods_serves_a_fork_and_refills() {
    let _one_node = RealNode::exclusive().await;
    let bed = bed("cluster-warm").await;
    bed.sys.apply(&bed.sandbox(
        "ws",
        "mkdir -p /home/app && echo start > /home/app/f; i=0; while true; do i=$((i+1)); echo $i > /home/app/count; sleep 0.2; done",
        "  pod:\n    labels: {app: pool-ws}\n",
    ));
    bed.phase("ws", SandboxPhase::Running, 300).await;
    bed.sys.apply(
        "apiVersion: ramify.dev/v1alpha1\nkind: Snapshot\nmetadata: {name: base}\nspec:\n  source: {sandbox: ws}\n  warmPool: {size: 3}\n",
    );
    let snaps: Api<ramify_crds::Snapshot> =
        Api::namespaced(bed.sys.client.clone(), &bed.sys.ns.name);
    let snap = bed
        .sys
        .wait_for(snaps.clone(), "base", "a warm pool of 3 Pods", 300, |s| {
            s.status
                .as_ref()
                .and_then(|st| st.warm.as_ref())
                .is_some_and(|w| w.ready == 3 && w.pods.len() == 3)
        })
        .await;
    let snap_uid = snap.metadata.uid.clone().unwrap();
    let pool: Vec<String> = snap.status.unwrap().warm.unwrap().pods;
    let listed = bed
        .pods()
        .list(&ListParams::default().labels(&format!("ramify.dev/warm-pool={snap_uid}")))
        .await
        .unwrap();
    assert_eq!(
        listed.items.len(),
        3,
        "{:?}",
        listed
            .items
            .iter()
            .map(|p| p.name_any())
            .collect::<Vec<_>>()
    );
    for p in &listed.items {
        assert!(
            pool.contains(&p.name_any()),
            "{} not in {pool:?}",
            p.name_any()
        );
        let owner = &p.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), Some(&owner.uid)),
            ("Snapshot", Some(&snap_uid))
        );
        assert!(
            !p.labels().contains_key("app"),
            "a pool Pod is not the source's"
        );
        assert_eq!(
            p.spec.as_ref().unwrap().node_name.as_deref(),
            Some(bed.node.name.as_str())
        );
    }

    // The effects gate too: each branch asks for an effect; only the winner's runs,
    // once, after approval.
    let (url, seen) = ramify_e2e::webhook::receiver().await;
    let effect = |b: &str| {
        format!(
            r#"echo {b} > /home/app/f && echo '{{\"kind\":\"deploy\",\"payload\":{{\"by\":\"{b}\"}}}}' > /run/ramify/effects/01-deploy.json"#
        )
    };
    bed.sys.apply(&format!(
        r#"apiVersion: ramify.dev/v1alpha1
kind: BranchSet
metadata:
  name: pick
spec:
  source: {{snapshot: base}}
  branches:
    - name: a
      run: ["/bin/sh", "-c", "{}"]
    - name: b
      run: ["/bin/sh", "-c", "{}"]
    - name: c
      run: ["/bin/sh", "-c", "{}"]
  verdict:
    command: ["/bin/sh", "-c", "sleep 2; grep -q b /home/app/f"]
  commit:
    mode: Full
  effects:
    approval: Required
    executor: {{webhook: {{url: "{url}"}}}}
  timeoutSeconds: 240
"#,
        effect("a"),
        effect("b"),
        effect("c")
    ));
    // Every branch runs in a pool Pod (each its own), adopted: labelled with its UID
    // and owned by it; each was served warm; none got a Pod of its own name.
    let mut adopted = Vec::new();
    for b in ["pick-a", "pick-b", "pick-c"] {
        let s = bed.phase(b, SandboxPhase::Running, 240).await;
        let st = s.status.clone().unwrap();
        let pod = st.pod.clone().expect("status.pod");
        assert!(
            pool.contains(&pod.name),
            "{b} runs in {} (pool {pool:?})",
            pod.name
        );
        assert!(
            st.restored_from.as_ref().is_some_and(|r| r.warm),
            "{b}: {:?}",
            st.restored_from
        );
        let p = bed.pods().get(&pod.name).await.unwrap();
        assert_eq!(p.labels().get(LABEL_SANDBOX_UID), s.metadata.uid.as_ref());
        assert!(!p.labels().contains_key("ramify.dev/warm-pool"));
        let owner = &p.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), Some(&owner.uid)),
            ("Sandbox", s.metadata.uid.as_ref())
        );
        assert!(
            bed.pods().get_opt(b).await.unwrap().is_none(),
            "{b} got a Pod of its own"
        );
        adopted.push(pod.name);
    }
    let adopted_by = adopted.clone();
    adopted.sort();
    adopted.dedup();
    assert_eq!(adopted.len(), 3, "two branches share a Pod: {adopted:?}");

    // The Full commit: the parent runs in the winner's adopted Pod.
    bed.committed("pick", "b").await;
    let winner_pod = adopted_by[1].clone();
    bed.until(
        "the parent holds the winner's adopted Pod",
        120,
        async || {
            bed.current_pod("ws").await == winner_pod
                && bed.pods().get_opt("ws").await.unwrap().is_none()
        },
    )
    .await;
    // A Service selecting the parent reaches that Pod: it carries the parent's labels.
    let held = bed.pods().get(&winner_pod).await.unwrap();
    assert_eq!(
        held.labels().get("app").map(String::as_str),
        Some("pool-ws")
    );
    assert_eq!(bed.sys.exec("ws", "cat /home/app/f").1, "b");
    let (_, c1) = bed.sys.exec("ws", "cat /home/app/count");
    bed.until("the committed workspace counts on", 30, async || {
        let (_, c2) = bed.sys.exec("ws", "cat /home/app/count");
        c2.parse::<u64>().unwrap_or(0) > c1.parse::<u64>().unwrap_or(u64::MAX)
    })
    .await;
    bed.sys.wait_branches_gone("pick", 120).await;

    // The winner's effect waits for approval, then runs once; the losers' never.
    bed.sys
        .wait_branchset("pick", "the winner's effect awaits approval", 60, |b| {
            b.status.as_ref().is_some_and(|s| {
                s.effects.iter().any(|e| {
                    e.id == "b/01-deploy.json"
                        && e.state == ramify_crds::EffectState::AwaitingApproval
                })
            })
        })
        .await;
    assert!(
        seen.lock().unwrap().is_empty(),
        "nothing runs before approval"
    );
    let (code, _, err) = bed.sys.plugin(&["approve", "pick"]);
    assert_eq!(code, 0, "{err}");
    bed.sys
        .wait_branchset("pick", "the winner's effect executed", 60, |b| {
            b.status.as_ref().is_some_and(|s| {
                s.effects.iter().any(|e| {
                    e.id == "b/01-deploy.json" && e.state == ramify_crds::EffectState::Executed
                })
            })
        })
        .await;
    let calls = seen.lock().unwrap().clone();
    assert_eq!(calls.len(), 1, "{calls:#?}");
    assert_eq!(calls[0].1["payload"]["by"], "b");

    // The pool refills with new Pods.
    let refilled = bed
        .sys
        .wait_for(snaps.clone(), "base", "the pool refilled", 300, |s| {
            s.status
                .as_ref()
                .and_then(|st| st.warm.as_ref())
                .is_some_and(|w| w.ready == 3)
        })
        .await;
    let again = refilled.status.unwrap().warm.unwrap().pods;
    assert!(
        again.iter().all(|p| !adopted.contains(p)),
        "{again:?} vs {adopted:?}"
    );

    // The Snapshot goes, and its Pods with it.
    snaps
        .delete("base", &DeleteParams::default())
        .await
        .unwrap();
    bed.until("the pool's Pods are gone", 120, async || {
        bed.pods()
            .list(&ListParams::default().labels(&format!("ramify.dev/warm-pool={snap_uid}")))
            .await
            .unwrap()
            .items
            .is_empty()
    })
    .await;
    bed.sys
        .sandboxes()
        .delete("ws", &DeleteParams::default())
        .await
        .unwrap();
    bed.until("no Pod is left", 120, async || {
        bed.pods()
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .is_empty()
    })
    .await;
    bed.teardown().await;
}

/// Where a cluster-mode fault strikes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FaultStep {
    /// Branch Pods exist, not every branch runs yet.
    Fork,
    /// The winner is decided, the commit not reported yet.
    Commit,
    /// Inside the agent's Full commit: the parent's record names the winner's sandbox
    /// (in the winner's Pod), the old parent sandbox is not destroyed, no Pod handed over.
    FullCommitSwap,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FaultVictim {
    Kubelet,
    NodeAgent,
    Operator,
    ApiServer,
}

/// One cell of the cluster fault matrix on the shared bed: a workspace, a Full-commit
/// BranchSet of two, `victim` SIGKILLed at `step` and brought back. Returns the outcome.
async fn cluster_fault_cell(
    bed: &mut Bed,
    i: usize,
    step: FaultStep,
    victim: FaultVictim,
) -> String {
    let (ws, bs) = (format!("ws{i}"), format!("bs{i}"));
    let fault_dir =
        std::env::temp_dir().join(format!("ramify-cluster-fault-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&fault_dir).unwrap();
    let marker = fault_dir.join(ramify_engine::fault::FULL_COMMIT_RECORDED);
    if step == FaultStep::FullCommitSwap {
        let dir = fault_dir.to_string_lossy().into_owned();
        bed.sys.agent.set_env(
            "RAMIFY_FAULT_HOLD",
            Some(ramify_engine::fault::FULL_COMMIT_RECORDED),
        );
        bed.sys.agent.set_env("RAMIFY_FAULT_DIR", Some(&dir));
        bed.sys.agent.kill().unwrap();
        bed.sys.agent.start().unwrap();
    }
    bed.sys.apply(&bed.sandbox(
        &ws,
        "mkdir -p /home/app && echo start > /home/app/f; while true; do sleep 1; done",
        "",
    ));
    bed.phase(&ws, SandboxPhase::Running, 300).await;
    let old_pod = bed.current_pod(&ws).await;
    bed.sys.apply(&format!(
        r#"apiVersion: ramify.dev/v1alpha1
kind: BranchSet
metadata:
  name: {bs}
spec:
  source: {{sandbox: {ws}}}
  branches:
    - name: a
      run: ["/bin/sh", "-c", "sleep 1; echo a > /home/app/f"]
    - name: b
      run: ["/bin/sh", "-c", "sleep 1; echo b > /home/app/f"]
  verdict:
    command: ["/bin/sh", "-c", "grep -q b /home/app/f"]
  commit:
    mode: Full
  timeoutSeconds: 240
"#
    ));
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut hit = false;
    while Instant::now() < deadline {
        let st = bed
            .sys
            .branchsets()
            .get_opt(&bs)
            .await
            .ok()
            .flatten()
            .and_then(|b| b.status)
            .unwrap_or_default();
        hit = match step {
            FaultStep::Fork => {
                let pods = bed.pods().list(&ListParams::default()).await.unwrap();
                let branch_pods = pods
                    .items
                    .iter()
                    .filter(|p| p.name_any().starts_with(&format!("{bs}-")))
                    .count();
                branch_pods > 0
                    && st
                        .branches
                        .iter()
                        .any(|b| b.phase == ramify_crds::BranchPhase::Forking)
            }
            FaultStep::Commit => st.winner.is_some() && st.phase != BranchSetPhase::Committed,
            FaultStep::FullCommitSwap => marker.exists(),
        };
        if hit || st.phase.is_ended() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    if step == FaultStep::FullCommitSwap {
        assert!(
            hit,
            "{step:?}/{victim:?}: the agent never reached its hold point"
        );
    }
    match victim {
        FaultVictim::Kubelet => {
            bed.node.kill_kubelet().unwrap();
            bed.node.restart_kubelet(&bed.sys.client).await.unwrap();
        }
        FaultVictim::NodeAgent => {
            bed.sys.agent.kill().unwrap();
            bed.sys.agent.set_env("RAMIFY_FAULT_HOLD", None);
            bed.sys.agent.start().unwrap();
        }
        FaultVictim::Operator => {
            bed.sys.operator.kill().unwrap();
            bed.sys.operator.start().unwrap();
        }
        FaultVictim::ApiServer => {
            // Same etcd data and certificates; the kubelet, the operator and the agent
            // keep running and must find their way back on their own.
            bed.sys.cp.kill_apiserver().unwrap();
            bed.sys.cp.recover().unwrap();
        }
    }
    // A held agent that was not the victim goes on from its hold point.
    std::fs::remove_file(&marker).ok();
    let got = bed
        .sys
        .wait_branchset(&bs, "ended", 240, |b| {
            b.status.as_ref().is_some_and(|s| s.phase.is_ended())
        })
        .await;
    let st = got.status.unwrap();
    let parent = bed.sys.sandboxes().get(&ws).await.unwrap();
    let commits = parent.status.as_ref().map_or(0, |s| s.commits);
    let (_, file) = bed.sys.exec(&ws, "cat /home/app/f");
    let outcome = if st.phase == BranchSetPhase::Committed {
        assert_eq!(
            st.winner.as_deref(),
            Some("b"),
            "{step:?}/{victim:?}: {st:#?}"
        );
        assert_eq!(commits, 1, "{step:?}/{victim:?}: committed once");
        assert_eq!(file, "b", "{step:?}/{victim:?}");
        // The parent runs in the winner's Pod, handed to it; its old Pod is gone.
        let winner_pod = format!("{bs}-b");
        bed.until(
            "the winner's Pod is handed to the parent",
            120,
            async || {
                bed.current_pod(&ws).await == winner_pod
                    && bed.pods().get_opt(&old_pod).await.unwrap().is_none()
            },
        )
        .await;
        "committed b once, Pod handed over".to_string()
    } else {
        assert_eq!(commits, 0, "{step:?}/{victim:?}: no half commit");
        assert_eq!(file, "start", "{step:?}/{victim:?}");
        let why = st
            .conditions
            .get_condition("Ready")
            .map(|c| c.message.clone())
            .unwrap_or_default();
        assert!(
            !why.is_empty(),
            "{step:?}/{victim:?}: an end without a winner says why"
        );
        format!(
            "{:?}: {}",
            st.phase,
            why.chars().take(60).collect::<String>()
        )
    };
    // Nothing of the set or its parent is left: no Pod, no sandbox (checked by the
    // teardown at the end), no ramify cgroup under kubepods.
    bed.sys
        .branchsets()
        .delete(&bs, &DeleteParams::default())
        .await
        .unwrap();
    bed.sys.wait_branches_gone(&bs, 120).await;
    bed.sys
        .sandboxes()
        .delete(&ws, &DeleteParams::default())
        .await
        .unwrap();
    bed.until("no Pod of the cell is left", 120, async || {
        let pods = bed.pods().list(&ListParams::default()).await.unwrap();
        pods.items.is_empty() && ramify_cgroups_under_kubepods().is_empty()
    })
    .await;
    std::fs::remove_dir_all(&fault_dir).ok();
    format!(
        "{}{outcome}; nothing left",
        if hit {
            ""
        } else {
            "(step passed before the kill) "
        }
    )
}

/// The fault matrix in cluster mode: the kubelet, the node agent, the operator and the
/// API server SIGKILLed (and brought back) where a Pod-backed fork can lose something: while the
/// branch Pods start, with the winner decided, and inside the agent's Full commit (the
/// parent's record names the winner's sandbox, which lives in the winner's Pod, not
/// yet handed to the parent). After each: one winner committed once and the parent in
/// the winner's Pod, or an end with a reason and the parent untouched; no Pod, sandbox
/// or cgroup left. The matrix is printed.
#[tokio::test]
async fn kubelet_agent_operator_and_api_server_killed_at_each_step_lose_nothing() {
    let _one_node = RealNode::exclusive().await;
    let mut bed = bed("cluster-faults").await;
    // Every step with every victim.
    let steps = [
        FaultStep::Fork,
        FaultStep::Commit,
        FaultStep::FullCommitSwap,
    ];
    let victims = [
        FaultVictim::Kubelet,
        FaultVictim::NodeAgent,
        FaultVictim::Operator,
        FaultVictim::ApiServer,
    ];
    let cells = steps
        .iter()
        .flat_map(|s| victims.iter().map(move |v| (*s, *v)));
    let mut rows = Vec::new();
    for (i, (step, victim)) in cells.enumerate() {
        let outcome = cluster_fault_cell(&mut bed, i, step, victim).await;
        eprintln!("cluster fault: {step:?} x {victim:?}: {outcome}");
        rows.push(format!("| {step:?} | {victim:?} | {outcome} |"));
    }
    println!("\n| step | killed | outcome |\n|---|---|---|");
    for r in &rows {
        println!("{r}");
    }
    bed.teardown().await;
}
