//! The Helm chart (`charts/ramify`) and the kustomize bases (`config/`) against the
//! real helm (built from the Go module proxy by `hack/helm/build.sh`) and the real
//! kube-apiserver: strict lint, the values schema, every rendered object accepted by a
//! server-side dry run, a real install whose ServiceAccounts hold exactly the
//! permissions the components need (checked with the API server's own authorizer), and
//! the copies of the generated CRDs kept identical to `crds/yaml`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use ramify_e2e::{ControlPlane, KubectlOutput, TestNamespace, install_crds, repo_root};
use serde::Deserialize;
use serde_json::Value;

const CHART: &str = "charts/ramify";
const GENERATED_CRDS: &str = "crds/yaml/ramify.dev.yaml";

/// helm, built (or found in the cache) by `hack/helm/build.sh`. These tests need it:
/// when it cannot be built they fail, they never skip.
fn helm_bin() -> &'static Path {
    static HELM: OnceLock<PathBuf> = OnceLock::new();
    HELM.get_or_init(|| {
        let out = Command::new(repo_root().join("hack/helm/build.sh"))
            .stdin(Stdio::null())
            .stderr(Stdio::inherit())
            .output()
            .expect("running hack/helm/build.sh");
        assert!(
            out.status.success(),
            "hack/helm/build.sh failed (its output is above); the chart tests need helm"
        );
        let path = PathBuf::from(String::from_utf8(out.stdout).unwrap().trim());
        assert!(
            path.is_file(),
            "hack/helm/build.sh printed {}, which is not a file",
            path.display()
        );
        path
    })
}

/// Runs helm in the repository root with `args`; `kubeconfig` for commands that talk to
/// a cluster. helm's own config/cache/data directories are kept out of $HOME.
fn helm(args: &[&str], kubeconfig: Option<&Path>) -> KubectlOutput {
    let home = std::env::temp_dir().join("ramify-e2e-helm");
    let mut cmd = Command::new(helm_bin());
    cmd.current_dir(repo_root())
        .args(args)
        .env("HELM_CONFIG_HOME", home.join("config"))
        .env("HELM_CACHE_HOME", home.join("cache"))
        .env("HELM_DATA_HOME", home.join("data"))
        .stdin(Stdio::null());
    match kubeconfig {
        Some(k) => cmd.env("KUBECONFIG", k),
        // No cluster: make sure nothing is read from the environment's kubeconfig.
        None => cmd.env("KUBECONFIG", "/dev/null"),
    };
    let out = cmd.output().expect("running helm");
    KubectlOutput {
        success: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// `helm template` of the chart; panics with helm's error if it fails.
fn template(release: &str, namespace: &str, extra: &[&str]) -> String {
    let mut args = vec!["template", release, CHART, "--namespace", namespace];
    args.extend_from_slice(extra);
    let out = helm(&args, None);
    assert!(
        out.success,
        "helm {} failed:\n{}",
        args.join(" "),
        out.stderr
    );
    out.stdout
}

/// The objects of a multi-document YAML stream (empty documents dropped).
fn objects(yaml: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(yaml)
        .map(|doc| Value::deserialize(doc).expect("valid YAML"))
        .filter(|v| !v.is_null())
        .collect()
}

fn find<'a>(objs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objs.iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} rendered"))
}

fn strings(v: &Value) -> Vec<&str> {
    v.as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

async fn control_plane() -> ControlPlane {
    let cp = ControlPlane::ensure().expect("control plane");
    let client = cp.client().await.expect("client");
    install_crds(&client)
        .await
        .expect("CRDs installed and Established");
    cp
}

fn kubectl_ok(cp: &ControlPlane, args: &[&str], stdin: Option<&str>) -> KubectlOutput {
    let out = cp.kubectl_run(args, stdin).expect("running kubectl");
    assert!(
        out.success,
        "kubectl {} failed:\n{}",
        args.join(" "),
        out.stderr
    );
    out
}

/// `helm lint --strict` turns every warning into a failure.
#[test]
fn lint_is_clean_in_strict_mode() {
    for extra in [&[][..], &["--set", "serviceMonitor.enabled=true"][..]] {
        let mut args = vec!["lint", "--strict", CHART];
        args.extend_from_slice(extra);
        let out = helm(&args, None);
        assert!(
            out.success && out.stdout.contains("0 chart(s) failed"),
            "helm {} failed:\n{}{}",
            args.join(" "),
            out.stdout,
            out.stderr
        );
    }
}

/// The chart refuses clusters older than its CRDs need (selectableFields: 1.31).
#[test]
fn refuses_kubernetes_older_than_1_31() {
    let out = helm(&["template", "r", CHART, "--kube-version", "1.30.4"], None);
    assert!(
        !out.success
            && out
                .stderr
                .contains("chart requires kubeVersion: >=1.31.0-0"),
        "{}",
        out.stderr
    );
    let out = helm(&["template", "r", CHART, "--kube-version", "1.31.0"], None);
    assert!(out.success, "{}", out.stderr);
}

/// values.schema.json rejects wrong values before anything is rendered, naming the key.
#[test]
fn schema_rejects_bad_values_with_the_key_named() {
    for (set, want) in [
        (
            "operator.replicas=-1",
            "at '/operator/replicas': minimum: got -1, want 0",
        ),
        (
            "operator.replica=2",
            "at '/operator': additional properties 'replica' not allowed",
        ),
        (
            "api.replicas=-1",
            "at '/api/replicas': minimum: got -1, want 0",
        ),
        (
            "agent.platform=firecracker",
            "at '/agent/platform': value must be one of 'auto', 'systrap', 'ptrace', 'kvm'",
        ),
        ("agent.stateDir=var/lib/ramify", "at '/agent/stateDir'"),
        ("mode=kubernetes", "at '/mode'"),
        (
            "agent.network.bridge=a-name-far-too-long",
            "at '/agent/network/bridge'",
        ),
        (
            "agent.network.subnet=10.88.0.0",
            "at '/agent/network/subnet'",
        ),
        ("agent.reserve.cpu=lots", "at '/agent/reserve/cpu'"),
        (
            "agent.maxConcurrentRestores=-1",
            "at '/agent/maxConcurrentRestores'",
        ),
        (
            "agent.snapshotStoreQuota=lots",
            "at '/agent/snapshotStoreQuota'",
        ),
        (
            "agent.image.pullPolicy=Sometimes",
            "at '/agent/image/pullPolicy'",
        ),
        (
            "networkPolicy.enabled=maybe",
            "at '/networkPolicy/enabled': got string, want boolean",
        ),
        (
            "serviceMonitor.interval=soon",
            "at '/serviceMonitor/interval'",
        ),
    ] {
        let out = helm(&["template", "r", CHART, "--set", set], None);
        assert!(!out.success, "--set {set} was accepted");
        assert!(
            out.stderr
                .contains("values don't meet the specifications of the schema")
                && out.stderr.contains(want),
            "--set {set}: expected a schema error containing {want:?}, got:\n{}",
            out.stderr
        );
    }
}

/// The chart and config/crd carry copies of the generated CRDs (helm and kustomize read
/// only files inside their root); they must not drift from crds/yaml.
#[test]
fn crd_copies_match_the_generated_yaml() {
    let root = repo_root();
    let generated = std::fs::read_to_string(root.join(GENERATED_CRDS)).unwrap();
    for copy in [
        "charts/ramify/crds/ramify.dev.yaml",
        "config/crd/ramify.dev.yaml",
    ] {
        let text =
            std::fs::read_to_string(root.join(copy)).unwrap_or_else(|e| panic!("{copy}: {e}"));
        assert!(
            text == generated,
            "{copy} differs from {GENERATED_CRDS}: run `make crds` (it refreshes both copies)"
        );
    }
}

/// The rendered defaults say what the README promises.
#[test]
fn defaults_render_the_documented_deployment() {
    let objs = objects(&template("ramify", "ramify-system", &[]));

    let op = find(&objs, "Deployment", "ramify-operator");
    assert_eq!(op["spec"]["replicas"], 2);
    let pod = &op["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    let args = strings(&c["args"]);
    for want in [
        "--metrics-addr=0.0.0.0:8080",
        "--system-namespace=ramify-system",
        "--leader-elect",
        "--log-json",
    ] {
        assert!(args.contains(&want), "operator args lack {want}: {args:?}");
    }
    assert_eq!(c["env"][0]["name"], "POD_NAME");
    assert_eq!(
        c["env"][0]["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.name"
    );
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(c["image"], "ghcr.io/ramify-dev/operator:0.1.0");
    let sc = &c["securityContext"];
    assert_eq!(sc["allowPrivilegeEscalation"], false);
    assert_eq!(sc["readOnlyRootFilesystem"], true);
    assert_eq!(sc["capabilities"]["drop"][0], "ALL");
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    assert_eq!(
        pod["securityContext"]["seccompProfile"]["type"],
        "RuntimeDefault"
    );
    assert!(c["resources"]["requests"].is_object());

    let ds = find(&objs, "DaemonSet", "ramify-node-agent");
    let pod = &ds["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    let args = strings(&c["args"]);
    for want in [
        "--node-name=$(NODE_NAME)",
        "--system-namespace=ramify-system",
        "--state-dir=/var/lib/ramify",
        "--metrics-addr=0.0.0.0:8081",
        "--platform=auto",
        "--reserve-cpu=400m",
        "--reserve-memory=2Gi",
        "--mode=standalone",
        "--bridge=ramify0",
        "--subnet=10.88.0.0/16",
        "--cgroup-parent=/ramify",
        "--leave-pod-cgroup",
        "--rootfs-root=/var/lib/ramify-rootfs",
        "--rootfs-cache=/var/cache/ramify/rootfs",
    ] {
        assert!(args.contains(&want), "agent args lack {want}: {args:?}");
    }
    // The image's entrypoint is the agent binary: its `run` subcommand first.
    assert_eq!(args.first(), Some(&"run"), "agent args: {args:?}");
    assert!(
        !args
            .iter()
            .any(|a| a.starts_with("--max-concurrent-restores")),
        "derived from the cores unless set: {args:?}"
    );
    assert!(
        !args.iter().any(|a| a.starts_with("--snapshot-store-quota")),
        "half the state directory's file system unless set: {args:?}"
    );
    assert_eq!(
        c["env"][0]["valueFrom"]["fieldRef"]["fieldPath"],
        "spec.nodeName"
    );
    assert_eq!(c["image"], "ghcr.io/ramify-dev/node-agent:0.1.0");
    assert_eq!(c["securityContext"]["privileged"], true);
    assert_eq!(pod["hostPID"], true);
    // Standalone placement makes the sandboxes' bridge, iptables rules and netns in
    // the node's network namespace.
    assert_eq!(pod["hostNetwork"], true);
    assert_eq!(pod["dnsPolicy"], "ClusterFirstWithHostNet");
    let netns = c["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["mountPath"] == "/run/netns")
        .expect("/run/netns mounted");
    assert_eq!(netns["mountPropagation"], "Bidirectional");
    let host_paths: Vec<&str> = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v["hostPath"]["path"].as_str())
        .collect();
    assert_eq!(
        host_paths,
        [
            "/var/lib/ramify",
            "/var/lib/ramify-rootfs",
            "/var/cache/ramify/rootfs",
            "/run/netns",
            "/sys/fs/cgroup"
        ]
    );
    // The administrator's root filesystems are mounted read-only.
    let root = c["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["mountPath"] == "/var/lib/ramify-rootfs")
        .expect("the rootfs root mounted");
    assert_eq!(root["readOnly"], true);

    // The agent's exec/log/diff endpoint: mTLS, announced as the pod IP, its
    // certificate from a Secret (not a host path).
    for want in [
        "--endpoint-listen=0.0.0.0:8443",
        "--endpoint-advertise=$(POD_IP)",
        "--endpoint-cert=/etc/ramify/endpoint/tls.crt",
        "--endpoint-key=/etc/ramify/endpoint/tls.key",
        "--endpoint-client-ca=/etc/ramify/endpoint/ca.crt",
    ] {
        assert!(args.contains(&want), "agent args lack {want}: {args:?}");
    }
    assert_eq!(
        c["env"][1]["valueFrom"]["fieldRef"]["fieldPath"],
        "status.podIP"
    );
    let endpoint_tls = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "endpoint-tls")
        .expect("endpoint-tls volume");
    assert_eq!(
        endpoint_tls["secret"]["secretName"],
        "ramify-node-agent-tls"
    );

    // ramify-api: restricted like the operator, serving the APIService.
    let api = find(&objs, "Deployment", "ramify-api");
    let api_pod = &api["spec"]["template"]["spec"];
    let ac = &api_pod["containers"][0];
    let api_args = strings(&ac["args"]);
    for want in [
        "--listen=0.0.0.0:8443",
        "--system-namespace=ramify-system",
        "--agent-client-cert=/etc/ramify/tls/client.crt",
        "--log-json",
    ] {
        assert!(
            api_args.contains(&want),
            "api args lack {want}: {api_args:?}"
        );
    }
    assert_eq!(ac["image"], "ghcr.io/ramify-dev/api:0.1.0");
    assert_eq!(ac["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(ac["securityContext"]["capabilities"]["drop"][0], "ALL");
    assert_eq!(api_pod["securityContext"]["runAsNonRoot"], true);
    assert_eq!(ac["readinessProbe"]["httpGet"]["scheme"], "HTTPS");
    assert_eq!(api_pod["serviceAccountName"], "ramify-api");
    let apisvc = find(&objs, "APIService", "v1alpha1.subresources.ramify.dev");
    assert_eq!(apisvc["spec"]["service"]["name"], "ramify-api");
    assert_eq!(apisvc["spec"]["service"]["namespace"], "ramify-system");
    assert!(apisvc["spec"]["insecureSkipTLSVerify"].is_null());
    let ca_bundle = apisvc["spec"]["caBundle"].as_str().unwrap();
    assert_eq!(
        find(&objs, "Secret", "ramify-api-tls")["data"]["ca.crt"],
        ca_bundle,
        "the APIService trusts the CA that signed ramify-api's serving certificate"
    );
    // The CA's key is in a Secret no pod mounts.
    for (kind, name) in [
        ("Deployment", "ramify-api"),
        ("Deployment", "ramify-operator"),
        ("DaemonSet", "ramify-node-agent"),
    ] {
        let vols = find(&objs, kind, name)["spec"]["template"]["spec"]["volumes"].clone();
        assert!(
            !vols.to_string().contains("ramify-ca"),
            "{name} mounts the CA: {vols}"
        );
    }

    // User roles: aggregated into the built-in roles; exec/log/diff only in edit.
    let edit = find(&objs, "ClusterRole", "ramify-edit");
    let view = find(&objs, "ClusterRole", "ramify-view");
    assert_eq!(
        edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"],
        "true"
    );
    assert_eq!(
        view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"],
        "true"
    );
    let grants = |role: &Value, group: &str| -> Vec<String> {
        role["rules"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| strings(&r["apiGroups"]).contains(&group))
            .flat_map(|r| strings(&r["resources"]).into_iter().map(str::to_string))
            .collect()
    };
    assert_eq!(
        grants(edit, "subresources.ramify.dev"),
        [
            "sandboxes/exec",
            "sandboxes/log",
            "sandboxes/diff",
            "sandboxes/portforward"
        ]
    );
    assert!(grants(view, "subresources.ramify.dev").is_empty());

    // Separate identities; tokens mounted only by the pods that use the API.
    for sa in ["ramify-operator", "ramify-node-agent", "ramify-api"] {
        assert_eq!(
            find(&objs, "ServiceAccount", sa)["automountServiceAccountToken"],
            false
        );
    }
    assert_eq!(
        op["spec"]["template"]["spec"]["serviceAccountName"],
        "ramify-operator"
    );
    assert_eq!(pod["serviceAccountName"], "ramify-node-agent");

    // Nothing sensitive is granted, nor wildcards.
    for o in objs
        .iter()
        .filter(|o| o["kind"] == "Role" || o["kind"] == "ClusterRole")
    {
        for rule in o["rules"].as_array().unwrap() {
            for field in ["apiGroups", "resources", "verbs"] {
                let list = strings(&rule[field]);
                assert!(
                    !list.contains(&"*"),
                    "wildcard in {}: {rule}",
                    o["metadata"]
                );
            }
            let resources = strings(&rule["resources"]);
            // One exception: the node agent gets (never lists or watches) the image
            // pull Secrets a Sandbox names, in a rule of its own.
            if resources.contains(&"secrets") {
                assert_eq!(o["metadata"]["name"], "ramify-node-agent", "{rule}");
                assert_eq!(resources, ["secrets"], "{rule}");
                assert_eq!(strings(&rule["verbs"]), ["get"], "{rule}");
            }
            // And the agent gets (never lists, watches or patches) its own Node, to
            // drain when it is cordoned.
            if resources.contains(&"nodes") {
                assert_eq!(o["metadata"]["name"], "ramify-node-agent", "{rule}");
                assert_eq!(resources, ["nodes"], "{rule}");
                assert_eq!(strings(&rule["verbs"]), ["get"], "{rule}");
                continue;
            }
            for forbidden in ["pods", "pods/exec", "nodes", "configmaps"] {
                assert!(
                    !resources.contains(&forbidden),
                    "{} grants {forbidden}",
                    o["metadata"]["name"]
                );
            }
        }
    }

    // The agent's endpoint admits ramify-api only; ramify-api its HTTPS port only.
    let np = find(&objs, "NetworkPolicy", "ramify-node-agent");
    assert_eq!(np["spec"]["ingress"][1]["ports"][0]["port"], "endpoint");
    assert_eq!(
        np["spec"]["ingress"][1]["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"],
        "api"
    );
    let np = find(&objs, "NetworkPolicy", "ramify-api");
    assert_eq!(np["spec"]["ingress"][0]["ports"][0]["port"], "https");
    assert_eq!(np["spec"]["ingress"].as_array().unwrap().len(), 1);

    // Metrics: two Services, two NetworkPolicies on the metrics port, no ServiceMonitor.
    for (name, port) in [
        ("ramify-operator-metrics", 8080),
        ("ramify-node-agent-metrics", 8081),
    ] {
        assert_eq!(
            find(&objs, "Service", name)["spec"]["ports"][0]["port"],
            port
        );
    }
    for name in ["ramify-operator", "ramify-node-agent"] {
        let np = find(&objs, "NetworkPolicy", name);
        assert_eq!(np["spec"]["policyTypes"][0], "Ingress");
        assert_eq!(np["spec"]["ingress"][0]["ports"][0]["port"], "metrics");
    }
    assert!(!objs.iter().any(|o| o["kind"] == "ServiceMonitor"));
    find(&objs, "PodDisruptionBudget", "ramify-operator");
}

/// `agent.platform` reaches the agent's `--platform` (default `auto`: the agent probes
/// systrap at its start), and each platform the agent knows renders.
#[test]
fn agent_platform_is_a_value() {
    for platform in ["auto", "systrap", "ptrace", "kvm"] {
        let objs = objects(&template(
            "ramify",
            "ramify-system",
            &["--set", &format!("agent.platform={platform}")],
        ));
        let ds = find(&objs, "DaemonSet", "ramify-node-agent");
        let args = strings(&ds["spec"]["template"]["spec"]["containers"][0]["args"]);
        let want = format!("--platform={platform}");
        assert!(
            args.contains(&want.as_str()),
            "agent args lack {want}: {args:?}"
        );
        assert_eq!(
            args.iter().filter(|a| a.starts_with("--platform")).count(),
            1,
            "{args:?}"
        );
    }
}

#[test]
fn agent_snapshot_store_quota_is_a_value() {
    let objs = objects(&template(
        "ramify",
        "ramify-system",
        &["--set", "agent.snapshotStoreQuota=50Gi"],
    ));
    let ds = find(&objs, "DaemonSet", "ramify-node-agent");
    let args = strings(&ds["spec"]["template"]["spec"]["containers"][0]["args"]);
    assert!(
        args.contains(&"--snapshot-store-quota=50Gi"),
        "agent args: {args:?}"
    );
}

/// `mode`: standalone (the default) gives no Pod rights and no kubelet mount; cluster
/// passes the mode and the Pod image (by digest when one is set) to the operator, gives
/// the operator the Pod verbs it needs and the agent read access to Pods, and mounts
/// the kubelet's root into the agent; the agent is on the node's network either way.
#[test]
fn cluster_mode_is_a_value() {
    let pod_rules = |objs: &[Value], role: &str| -> Vec<String> {
        find(objs, "ClusterRole", role)["rules"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| strings(&r["resources"]).contains(&"pods"))
            .flat_map(|r| strings(&r["verbs"]).into_iter().map(String::from))
            .collect()
    };
    let objs = objects(&template("ramify", "ramify-system", &[]));
    let op = find(&objs, "Deployment", "ramify-operator");
    let op_args = strings(&op["spec"]["template"]["spec"]["containers"][0]["args"]);
    assert!(op_args.contains(&"--mode=standalone"), "{op_args:?}");
    assert!(!op_args.iter().any(|a| a.starts_with("--pod-image")));
    assert!(pod_rules(&objs, "ramify-operator").is_empty());
    assert!(pod_rules(&objs, "ramify-node-agent").is_empty());
    let ds = find(&objs, "DaemonSet", "ramify-node-agent");
    assert_eq!(ds["spec"]["template"]["spec"]["hostNetwork"], true);

    let digest = format!("sha256:{}", "a".repeat(64));
    let objs = objects(&template(
        "ramify",
        "ramify-system",
        &[
            "--set",
            "mode=cluster",
            "--set",
            "podImage.repository=registry.example/ramify/pod",
            "--set",
            &format!("podImage.digest={digest}"),
            "--set",
            "agent.kubeletRootDir=/data/kubelet",
        ],
    ));
    let op = find(&objs, "Deployment", "ramify-operator");
    let op_args = strings(&op["spec"]["template"]["spec"]["containers"][0]["args"]);
    let want = format!("--pod-image=registry.example/ramify/pod@{digest}");
    for want in ["--mode=cluster", want.as_str()] {
        assert!(
            op_args.contains(&want),
            "operator args lack {want}: {op_args:?}"
        );
    }
    let mut verbs = pod_rules(&objs, "ramify-operator");
    verbs.sort();
    assert_eq!(verbs, ["create", "delete", "get", "list", "patch", "watch"]);
    let mut verbs = pod_rules(&objs, "ramify-node-agent");
    verbs.sort();
    assert_eq!(verbs, ["get", "list", "watch"]);
    let ds = find(&objs, "DaemonSet", "ramify-node-agent");
    let spec = &ds["spec"]["template"]["spec"];
    assert_eq!(spec["hostNetwork"], true, "egress rules must be the node's");
    let args = strings(&spec["containers"][0]["args"]);
    for want in ["--mode=cluster", "--kubelet-root-dir=/data/kubelet"] {
        assert!(args.contains(&want), "agent args lack {want}: {args:?}");
    }
    assert!(!args.iter().any(|a| a.starts_with("--bridge")), "{args:?}");
    let vol = spec["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "kubelet-root")
        .expect("the kubelet root volume");
    assert_eq!(vol["hostPath"]["path"], "/data/kubelet");
    let mount = spec["containers"][0]["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == "kubelet-root")
        .expect("the kubelet root mount");
    assert_eq!(mount["mountPath"], "/data/kubelet");
    assert_eq!(mount["mountPropagation"], "HostToContainer");
}

/// `objectStore` unset (the embedded default): no object store flag, no Secret mounted.
/// Set: the agent's flags name it, and the credentials Secret is mounted read-only
/// where `--object-store-credentials-dir` points; a bucket is required.
#[test]
fn object_store_is_a_value_and_its_secret_is_mounted() {
    let objs = objects(&template("ramify", "ramify-system", &[]));
    let ds = find(&objs, "DaemonSet", "ramify-node-agent");
    let spec = &ds["spec"]["template"]["spec"];
    let args = strings(&spec["containers"][0]["args"]);
    assert!(
        !args.iter().any(|a| a.starts_with("--object-store")),
        "{args:?}"
    );
    let objs = objects(&template(
        "ramify",
        "ramify-system",
        &[
            "--set",
            "objectStore.endpoint=https://s3.example",
            "--set",
            "objectStore.bucket=snaps",
            "--set",
            "objectStore.prefix=team-a",
            "--set",
            "objectStore.credentialsSecret=s3-creds",
        ],
    ));
    let ds = find(&objs, "DaemonSet", "ramify-node-agent");
    let spec = &ds["spec"]["template"]["spec"];
    let args = strings(&spec["containers"][0]["args"]);
    for want in [
        "--object-store-endpoint=https://s3.example",
        "--object-store-bucket=snaps",
        "--object-store-region=us-east-1",
        "--object-store-prefix=team-a",
        "--object-store-credentials-dir=/etc/ramify/object-store",
    ] {
        assert!(args.contains(&want), "agent args lack {want}: {args:?}");
    }
    let vol = spec["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "object-store-credentials")
        .expect("the credentials volume");
    assert_eq!(vol["secret"]["secretName"], "s3-creds");
    let mount = spec["containers"][0]["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == "object-store-credentials")
        .expect("the credentials mount");
    assert_eq!(mount["mountPath"], "/etc/ramify/object-store");
    assert_eq!(mount["readOnly"], true);
    let out = helm(
        &[
            "template",
            "r",
            CHART,
            "--set",
            "objectStore.endpoint=https://s3.example",
        ],
        None,
    );
    assert!(
        !out.success && out.stderr.contains("objectStore.bucket is required"),
        "{}",
        out.stderr
    );
}

/// `serviceMonitor.enabled=true` adds one ServiceMonitor over both metrics Services (the
/// monitoring.coreos.com CRD is not on the test control plane, so this is checked on
/// the rendered output only).
#[test]
fn service_monitor_renders_when_enabled() {
    let objs = objects(&template(
        "ramify",
        "ramify-system",
        &[
            "--set",
            "serviceMonitor.enabled=true",
            "--set",
            "serviceMonitor.labels.release=prometheus",
        ],
    ));
    let monitors: Vec<&Value> = objs
        .iter()
        .filter(|o| o["kind"] == "ServiceMonitor")
        .collect();
    assert_eq!(monitors.len(), 1);
    let sm = monitors[0];
    assert_eq!(sm["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(sm["metadata"]["labels"]["release"], "prometheus");
    assert_eq!(sm["spec"]["endpoints"][0]["port"], "metrics");
    assert_eq!(sm["spec"]["endpoints"][0]["interval"], "30s");
    // Its selector picks exactly the two metrics Services.
    let expr = &sm["spec"]["selector"]["matchExpressions"][0];
    let components = strings(&expr["values"]);
    let selected: Vec<&str> = objs
        .iter()
        .filter(|o| o["kind"] == "Service")
        .filter(|o| {
            let labels = &o["metadata"]["labels"];
            sm["spec"]["selector"]["matchLabels"]
                .as_object()
                .unwrap()
                .iter()
                .all(|(k, v)| &labels[k] == v)
                && labels[expr["key"].as_str().unwrap()]
                    .as_str()
                    .is_some_and(|c| components.contains(&c))
        })
        .filter_map(|o| o["metadata"]["name"].as_str())
        .collect();
    assert_eq!(
        selected,
        ["ramify-node-agent-metrics", "ramify-operator-metrics"]
    );
}

/// Every object the chart renders (CRDs included), with the defaults and with the other
/// switches flipped, is accepted by the real kube-apiserver (server-side dry run: schema,
/// defaulting, validation and admission, nothing persisted).
#[tokio::test]
async fn rendered_chart_is_accepted_by_the_apiserver() {
    let cp = control_plane().await;
    let client = cp.client().await.unwrap();
    let ns = TestNamespace::create(&client, "chart").await.unwrap();
    let variants: [&[&str]; 4] = [
        &[],
        // Cluster mode.
        &[
            "--set",
            "mode=cluster",
            "--set",
            "podImage.digest=sha256:0000000000000000000000000000000000000000000000000000000000000000",
        ],
        // Every other value set.
        &[
            "--set",
            "operator.replicas=1",
            "--set",
            "operator.logJson=false",
            "--set",
            "operator.image.tag=dev",
            "--set-json",
            r#"operator.affinity={"nodeAffinity":{"requiredDuringSchedulingIgnoredDuringExecution":{"nodeSelectorTerms":[{"matchExpressions":[{"key":"node-role.kubernetes.io/control-plane","operator":"DoesNotExist"}]}]}}}"#,
            "--set",
            "operator.podAnnotations.example\\.com/team=platform",
            "--set-json",
            r#"networkPolicy.metricsFrom=[{"namespaceSelector":{"matchLabels":{"kubernetes.io/metadata.name":"monitoring"}}}]"#,
            "--set",
            "agent.platform=kvm",
            "--set",
            "agent.stateDir=/srv/ramify",
            "--set",
            "agent.priorityClassName=system-node-critical",
            "--set-json",
            r#"agent.nodeSelector={"ramify.dev/sandbox-node":"true"}"#,
            "--set-json",
            r#"agent.tolerations=[{"key":"ramify.dev/sandbox-node","operator":"Exists","effect":"NoSchedule"}]"#,
            "--set-json",
            r#"imagePullSecrets=[{"name":"regcred"}]"#,
            "--set",
            "fullnameOverride=sbx",
        ],
        // The optional objects off.
        &[
            "--set",
            "networkPolicy.enabled=false",
            "--set",
            "serviceMonitor.enabled=false",
        ],
    ];
    for (i, extra) in variants.iter().enumerate() {
        let mut args = vec!["--include-crds"];
        args.extend_from_slice(extra);
        let rendered = template("ramify", &ns.name, &args);
        let objs = objects(&rendered);
        assert!(objs.len() >= 16, "variant {i}: only {} objects", objs.len());
        let out = kubectl_ok(
            &cp,
            &[
                "apply",
                "--server-side",
                "--force-conflicts",
                "--dry-run=server",
                "-f",
                "-",
            ],
            Some(&rendered),
        );
        let accepted = out
            .stdout
            .lines()
            .filter(|l| l.ends_with("serverside-applied (server dry run)"))
            .count();
        assert_eq!(
            accepted,
            objs.len(),
            "variant {i}: not every object was accepted:\n{}",
            out.stdout
        );
    }
    ns.delete().await.unwrap();
}

/// The operator's and ramify-api's pods meet the "restricted" Pod Security Standard
/// (checked by the API server's PodSecurity admission); the agent is, by necessity,
/// "privileged".
#[tokio::test]
async fn operator_meets_the_restricted_pod_security_standard() {
    let cp = control_plane().await;
    let client = cp.client().await.unwrap();
    let ns = TestNamespace::create(&client, "chart-psa").await.unwrap();
    kubectl_ok(
        &cp,
        &[
            "label",
            "namespace",
            &ns.name,
            "pod-security.kubernetes.io/warn=restricted",
        ],
        None,
    );
    let apply = |show_only: &str| {
        let rendered = template("ramify", &ns.name, &["--show-only", show_only]);
        kubectl_ok(
            &cp,
            &["apply", "--server-side", "--dry-run=server", "-f", "-"],
            Some(&rendered),
        )
    };
    for (what, template) in [
        ("the operator", "templates/operator-deployment.yaml"),
        ("ramify-api", "templates/api-deployment.yaml"),
    ] {
        let out = apply(template);
        assert!(
            !out.stderr.contains("would violate PodSecurity"),
            "{what} is not 'restricted':\n{}",
            out.stderr
        );
    }
    let out = apply("templates/agent-daemonset.yaml");
    assert!(
        out.stderr.contains("would violate PodSecurity"),
        "expected the privileged agent to be flagged (is the warn label honoured?):\n{}",
        out.stderr
    );
    ns.delete().await.unwrap();
}

/// What a ServiceAccount may do, asked of the API server's authorizer. `resource` may
/// name a subresource ("sandboxes.ramify.dev/status"): for `kubectl auth can-i` the
/// part after a slash is an object name, so it goes to `--subresource`.
fn can_i(cp: &ControlPlane, sa: &str, verb: &str, resource: &str, scope: &[&str]) -> bool {
    let (resource, sub) = resource.split_once('/').unwrap_or((resource, ""));
    let mut args = vec!["auth", "can-i", verb, resource, "--as", sa];
    if !sub.is_empty() {
        args.extend(["--subresource", sub]);
    }
    args.extend_from_slice(scope);
    let out = cp.kubectl_run(&args, None).expect("running kubectl");
    match out.stdout.trim() {
        "yes" => true,
        "no" => false,
        _ => panic!("kubectl {}: {}{}", args.join(" "), out.stdout, out.stderr),
    }
}

/// A SubjectAccessReview: may `user` do `verb` on `resource[/subresource]` (optionally
/// the object `name`) of `group` in `namespace`?
#[allow(clippy::too_many_arguments)]
fn review(
    cp: &ControlPlane,
    user: &str,
    verb: &str,
    group: &str,
    resource: &str,
    subresource: &str,
    name: &str,
    namespace: &str,
) -> bool {
    let body = serde_json::json!({
        "apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
        "spec": {"user": user, "groups": ["system:authenticated"], "resourceAttributes": {
            "verb": verb, "group": group, "resource": resource, "subresource": subresource,
            "name": name, "namespace": namespace}}});
    let out = kubectl_ok(
        cp,
        &["create", "-f", "-", "-o", "jsonpath={.status.allowed}"],
        Some(&body.to_string()),
    );
    out.stdout.trim() == "true"
}

/// Uninstalls a release on drop (ignoring errors): the cleanup of a failed test.
struct Uninstall {
    release: String,
    namespace: String,
    kubeconfig: PathBuf,
}

impl Drop for Uninstall {
    fn drop(&mut self) {
        let args = [
            "uninstall",
            &self.release,
            "-n",
            &self.namespace,
            "--ignore-not-found",
        ];
        let _ = helm(&args, Some(&self.kubeconfig));
    }
}

/// A real `helm install`: the release installs, its ServiceAccounts can do exactly what
/// the operator and the agent need and nothing sensitive, and `helm uninstall` removes
/// the cluster-wide objects too.
#[tokio::test]
async fn installed_rbac_grants_what_is_needed_and_nothing_more() {
    let cp = control_plane().await;
    let client = cp.client().await.unwrap();
    let ns = TestNamespace::create(&client, "chart-rbac").await.unwrap();
    let release = format!("r{}", &ns.name[ns.name.len() - 8..]);
    let kc = Some(cp.kubeconfig.as_path());
    let out = helm(&["install", &release, CHART, "-n", &ns.name], kc);
    assert!(out.success, "helm install failed:\n{}", out.stderr);
    // A failed assertion below must not leave the release's ClusterRoles behind.
    let _cleanup = Uninstall {
        release: release.clone(),
        namespace: ns.name.clone(),
        kubeconfig: cp.kubeconfig.clone(),
    };

    let op = format!(
        "system:serviceaccount:{}:{release}-ramify-operator",
        ns.name
    );
    let agent = format!(
        "system:serviceaccount:{}:{release}-ramify-node-agent",
        ns.name
    );
    let api = format!("system:serviceaccount:{}:{release}-ramify-api", ns.name);
    let all: &[&str] = &["--all-namespaces"];
    let here: &[&str] = &["-n", &ns.name];
    let other: &[&str] = &["-n", "default"];
    #[rustfmt::skip]
    let cases: &[(&str, &str, &str, &[&str], bool)] = &[
        // The operator: all three kinds everywhere, their status, events.
        (&op, "create", "sandboxes.ramify.dev", all, true),
        (&op, "delete", "snapshots.ramify.dev", all, true),
        (&op, "watch", "branchsets.ramify.dev", all, true),
        (&op, "patch", "branchsets.ramify.dev/status", all, true),
        (&op, "update", "sandboxes.ramify.dev/status", all, true),
        (&op, "update", "branchsets.ramify.dev/finalizers", all, true),
        (&op, "create", "events.events.k8s.io", all, true),
        // ... Leases only in the release namespace.
        (&op, "create", "leases.coordination.k8s.io", here, true),
        (&op, "watch", "leases.coordination.k8s.io", here, true),
        (&op, "update", "leases.coordination.k8s.io", other, false),
        (&op, "delete", "leases.coordination.k8s.io", here, false),
        // The agent: reads, patches (finalizer) and reports status; never creates.
        (&agent, "watch", "sandboxes.ramify.dev", all, true),
        (&agent, "patch", "snapshots.ramify.dev", all, true),
        (&agent, "patch", "sandboxes.ramify.dev/status", all, true),
        (&agent, "update", "snapshots.ramify.dev/status", all, true),
        (&agent, "get", "branchsets.ramify.dev", all, true),
        // RootfsClasses are the administrator's: the agent reads them, nobody here writes.
        (&agent, "watch", "rootfsclasses.ramify.dev", all, true),
        (&agent, "get", "rootfsclasses.ramify.dev", all, true),
        (&agent, "create", "rootfsclasses.ramify.dev", all, false),
        (&agent, "patch", "rootfsclasses.ramify.dev", all, false),
        (&op, "create", "rootfsclasses.ramify.dev", all, false),
        (&op, "delete", "rootfsclasses.ramify.dev", all, false),
        (&agent, "create", "events.events.k8s.io", all, true),
        (&agent, "create", "sandboxes.ramify.dev", all, false),
        (&agent, "delete", "snapshots.ramify.dev", all, false),
        (&agent, "patch", "branchsets.ramify.dev", all, false),
        (&agent, "patch", "branchsets.ramify.dev/status", all, false),
        // The image pull Secrets a Sandbox names, each by name: get, never list/watch.
        (&agent, "get", "secrets", all, true),
        (&agent, "list", "secrets", all, false),
        (&agent, "watch", "secrets", all, false),
        (&agent, "update", "secrets", all, false),
        (&agent, "update", "leases.coordination.k8s.io", here, true),
        (&agent, "list", "leases.coordination.k8s.io", here, false),
        (&agent, "create", "leases.coordination.k8s.io", other, false),
        // ramify-api: finds a sandbox's node and its agent's endpoint; asks the
        // authorizer about each caller; reads the front proxy's settings.
        (&api, "get", "sandboxes.ramify.dev", all, true),
        (&api, "list", "sandboxes.ramify.dev", all, false),
        (&api, "patch", "sandboxes.ramify.dev", all, false),
        (&api, "get", "snapshots.ramify.dev", all, false),
        (&api, "create", "subjectaccessreviews.authorization.k8s.io", all, true),
        (&api, "get", "leases.coordination.k8s.io", here, true),
        (&api, "list", "leases.coordination.k8s.io", here, false),
        (&api, "get", "leases.coordination.k8s.io", other, false),
    ];
    for (sa, verb, resource, scope, want) in cases {
        assert_eq!(
            can_i(&cp, sa, verb, resource, scope),
            *want,
            "{sa} {verb} {resource} {scope:?}"
        );
    }
    // None holds anything sensitive, anywhere.
    for sa in [&op, &agent, &api] {
        for (verb, resource) in [
            ("get", "secrets"),
            ("list", "secrets"),
            ("create", "pods/exec"),
            ("create", "pods"),
            ("patch", "nodes"),
            ("create", "serviceaccounts/token"),
            ("impersonate", "serviceaccounts"),
            ("bind", "clusterroles.rbac.authorization.k8s.io"),
            ("escalate", "roles.rbac.authorization.k8s.io"),
            ("update", "customresourcedefinitions.apiextensions.k8s.io"),
            ("delete", "namespaces"),
        ] {
            // The agent's one exception (see above).
            if sa == &agent && (verb, resource) == ("get", "secrets") {
                continue;
            }
            for scope in [all, here] {
                assert!(
                    !can_i(&cp, sa, verb, resource, scope),
                    "{sa} may {verb} {resource} {scope:?}"
                );
            }
        }
    }

    // Asked as SubjectAccessReviews (`kubectl auth can-i` can neither name one object
    // of a kind nor a group whose discovery lists only subresources):
    let sub = |user: &str, verb: &str, sub: &str, namespace: &str| {
        review(
            &cp,
            user,
            verb,
            "subresources.ramify.dev",
            "sandboxes",
            sub,
            "",
            namespace,
        )
    };
    // ramify-api reads the front proxy's ConfigMap, and no other.
    for (name, want) in [
        ("extension-apiserver-authentication", true),
        ("kube-root-ca.crt", false),
    ] {
        assert_eq!(
            review(&cp, &api, "get", "", "configmaps", "", name, "kube-system"),
            want,
            "ramify-api get configmap {name}"
        );
    }
    // No component may use the subresources itself; a user bound to the release's
    // ramify-edit in a namespace may, there only, and holds nothing in the release
    // namespace. (Its aggregation into `edit` is tested for real in access.rs.)
    for (sa, what) in [
        (&op, "exec"),
        (&agent, "exec"),
        (&api, "exec"),
        (&api, "log"),
    ] {
        assert!(
            !sub(sa, "get", what, "default"),
            "{sa} may get sandboxes/{what}"
        );
    }
    let edit_role = format!("--clusterrole={release}-ramify-edit");
    kubectl_ok(
        &cp,
        &[
            "create",
            "rolebinding",
            "dana-edit",
            "-n",
            "default",
            &edit_role,
            "--user=dana",
        ],
        None,
    );
    for what in ["exec", "log", "diff"] {
        assert!(
            sub("dana", "get", what, "default"),
            "edit lacks sandboxes/{what}"
        );
        assert!(
            !sub("dana", "get", what, &ns.name),
            "dana may {what} in {}",
            ns.name
        );
    }
    for (verb, resource, sub) in [
        ("create", "pods", "exec"),
        ("get", "pods", ""),
        ("get", "leases", ""),
    ] {
        let group = if resource == "leases" {
            "coordination.k8s.io"
        } else {
            ""
        };
        assert!(
            !review(&cp, "dana", verb, group, resource, sub, "", &ns.name),
            "dana may {verb} {resource}/{sub} in the release namespace"
        );
    }
    kubectl_ok(
        &cp,
        &["delete", "rolebinding", "dana-edit", "-n", "default"],
        None,
    );

    let out = helm(&["uninstall", &release, "-n", &ns.name, "--wait"], kc);
    assert!(out.success, "helm uninstall failed:\n{}", out.stderr);
    let selector = format!("app.kubernetes.io/instance={release}");
    let left = kubectl_ok(
        &cp,
        &[
            "get",
            "clusterroles,clusterrolebindings",
            "-l",
            &selector,
            "-o",
            "name",
        ],
        None,
    );
    assert!(
        left.stdout.trim().is_empty(),
        "left behind: {}",
        left.stdout
    );
    ns.delete().await.unwrap();
}

/// `kubectl apply -k config/default` (CRDs, namespace, ServiceAccounts, RBAC) is
/// accepted by the API server, client-side and server-side.
#[tokio::test]
async fn kustomize_default_is_accepted() {
    let cp = control_plane().await;
    // The namespaced objects of a dry run need their namespace to exist (a dry-run
    // Namespace is not persisted). The operator tests use ramify-system too: created
    // idempotently, never deleted.
    let ns = kubectl_ok(
        &cp,
        &[
            "create",
            "namespace",
            "ramify-system",
            "--dry-run=client",
            "-o",
            "yaml",
        ],
        None,
    );
    kubectl_ok(&cp, &["apply", "-f", "-"], Some(&ns.stdout));
    // kubectl runs in the test's working directory (e2e/): absolute paths.
    let dir = repo_root().join("config/default");
    let dir = dir.to_str().unwrap();
    let count = objects(&kubectl_ok(&cp, &["kustomize", dir], None).stdout).len();
    for mode in [
        &["--dry-run=server"][..],
        &["--server-side", "--force-conflicts", "--dry-run=server"][..],
    ] {
        let mut args = vec!["apply", "-k", dir];
        args.extend_from_slice(mode);
        let out = kubectl_ok(&cp, &args, None);
        let accepted = out
            .stdout
            .lines()
            .filter(|l| l.ends_with("(server dry run)"))
            .count();
        assert_eq!(
            accepted, count,
            "{mode:?}: not every object was accepted:\n{}",
            out.stdout
        );
    }
}

/// config/rbac holds the same ServiceAccounts, roles and bindings as the chart renders
/// for release "ramify" in ramify-system (labels aside).
#[tokio::test]
async fn kustomize_rbac_matches_the_chart() {
    let cp = control_plane().await;
    let essence = |objs: Vec<Value>| -> BTreeMap<String, Value> {
        objs.into_iter()
            .filter(|o| {
                [
                    "ServiceAccount",
                    "Role",
                    "ClusterRole",
                    "RoleBinding",
                    "ClusterRoleBinding",
                ]
                .contains(&o["kind"].as_str().unwrap_or_default())
            })
            .map(|mut o| {
                let key = format!(
                    "{} {}/{}",
                    o["kind"].as_str().unwrap(),
                    o["metadata"]["namespace"].as_str().unwrap_or(""),
                    o["metadata"]["name"].as_str().unwrap()
                );
                o.as_object_mut().unwrap().remove("metadata");
                (key, o)
            })
            .collect()
    };
    let chart = essence(objects(&template("ramify", "ramify-system", &[])));
    let dir = repo_root().join("config/default");
    let out = kubectl_ok(&cp, &["kustomize", dir.to_str().unwrap()], None);
    let config = essence(objects(&out.stdout));
    assert_eq!(
        chart.keys().collect::<Vec<_>>(),
        config.keys().collect::<Vec<_>>()
    );
    for (key, c) in &chart {
        assert_eq!(
            c, &config[key],
            "{key} differs between the chart and config/rbac"
        );
    }
}
