//! Cluster mode: the Pod backing a Sandbox (see `ramify_crds::pod`). [`build`] is pure:
//! the Sandbox in, the Pod the operator creates out.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, Capabilities, Container, EmptyDirVolumeSource, NodeAffinity, NodeSelector,
    NodeSelectorRequirement, NodeSelectorTerm, Pod, PodSecurityContext, PodSpec,
    ResourceRequirements, SeccompProfile, SecurityContext, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::ResourceExt;
use ramify_crds::capacity::Requests;
use ramify_crds::pod::{
    ANNOTATION_POD_TEMPLATE, LABEL_MANAGED_BY, LABEL_SANDBOX, LABEL_SANDBOX_UID, LABEL_WARM_POOL,
    MANAGED_BY_RAMIFY, POD_ARG_MOVE_WAIT, POD_CONTAINER, POD_MOUNT, POD_RUN_AS_USER,
    POD_TERMINATION_GRACE_SECONDS, POD_VOLUME, PodSettings, pod_name, warm_pod_name,
};
use ramify_crds::{PodRef, Sandbox, Snapshot};

use crate::error::{Error, Result};

/// A label value's longest.
const LABEL_VALUE_MAX: usize = 63;
/// The kubelet's grace between SIGTERM and SIGKILL for a branch's (or a warm pool's)
/// Pod: `ramify-pod` ends at once. A workspace's Pod has
/// [`POD_TERMINATION_GRACE_SECONDS`].
const TERMINATION_GRACE_SECONDS: i64 = 10;

/// The Pod of `sbx`: its name, namespace and requests, `image` (`ramify-pod`) as its
/// one container, owned by the Sandbox. `node`: the node it must run on (a branch's
/// snapshot's node, a `spec.nodeName`), as a required node affinity in place of the
/// node part of `spec.pod.affinity`.
pub fn build(sbx: &Sandbox, image: &str, node: Option<&str>) -> Result<Pod> {
    let settings = sbx.spec.pod.clone().unwrap_or_default();
    let meta = ObjectMeta {
        name: Some(pod_name(&sbx.name_any())),
        namespace: sbx.namespace(),
        labels: Some(labels(sbx)?),
        annotations: (!settings.annotations.is_empty()).then(|| settings.annotations.clone()),
        owner_references: Some(vec![controller(sbx)?]),
        ..Default::default()
    };
    let mut pod = assemble(meta, settings, sbx.spec.requests(), image, node);
    let branch = sbx
        .spec
        .restore_from
        .as_ref()
        .is_some_and(|r| r.branch.is_some());
    if !branch {
        movable(&mut pod);
    }
    Ok(pod)
}

/// A workspace's Pod (not a branch's, which ends with its Pod): evicted, its sandbox
/// is checkpointed and moved to a new Pod, and `ramify-pod` waits for that (the node
/// agent's `moving` file, then its exit file) within a grace long enough for it.
fn movable(pod: &mut Pod) {
    let Some(spec) = pod.spec.as_mut() else {
        return;
    };
    spec.termination_grace_period_seconds = Some(POD_TERMINATION_GRACE_SECONDS);
    for c in &mut spec.containers {
        c.args
            .get_or_insert_with(Vec::new)
            .push(POD_ARG_MOVE_WAIT.into());
    }
}

/// The `n`th warm pool Pod of `snap` (on `node`, its node): the Pod a branch of its
/// source `source` would get, owned by the Snapshot, labelled only as ramify's and as
/// the pool's (a Service selecting the source never reaches it), annotated with the
/// [`template`] it was built with.
pub fn build_pool(
    snap: &Snapshot,
    source: &Sandbox,
    image: &str,
    node: &str,
    n: u32,
) -> Result<Pod> {
    let name = snap.name_any();
    let uid = snap
        .uid()
        .ok_or_else(|| Error::Invalid(format!("snapshot {name} has no uid")))?;
    let settings = source.spec.pod.clone().unwrap_or_default().for_branch();
    let requests = source.spec.requests();
    let meta = ObjectMeta {
        name: Some(warm_pod_name(&name, n)),
        namespace: snap.namespace(),
        labels: Some(
            [
                (LABEL_MANAGED_BY.to_string(), MANAGED_BY_RAMIFY.to_string()),
                (LABEL_WARM_POOL.to_string(), uid.clone()),
            ]
            .into(),
        ),
        annotations: Some(
            [(
                ANNOTATION_POD_TEMPLATE.to_string(),
                template(&requests, &settings),
            )]
            .into(),
        ),
        owner_references: Some(vec![OwnerReference {
            api_version: ramify_crds::API_VERSION.into(),
            kind: "Snapshot".into(),
            name,
            uid,
            controller: Some(true),
            block_owner_deletion: Some(true),
        }]),
        ..Default::default()
    };
    Ok(assemble(meta, settings, requests, image, Some(node)))
}

/// A hash of what a Pod is built with besides its name, labels and owner: its requests
/// and its scheduling settings. A branch adopts a warm pool Pod only when its own
/// would hash the same (a pool Pod of another size would break its accounting).
pub fn template(requests: &Requests, settings: &PodSettings) -> String {
    use sha2::{Digest, Sha256};
    let v = serde_json::json!({
        "cpuMillis": requests.cpu_millis,
        "memoryBytes": requests.memory_bytes,
        "settings": settings,
    });
    let digest = Sha256::digest(v.to_string().as_bytes());
    digest[..8].iter().map(|b| format!("{b:02x}")).collect()
}

/// The [`template`] of `sbx`'s own Pod.
pub fn template_of(sbx: &Sandbox) -> String {
    template(
        &sbx.spec.requests(),
        &sbx.spec.pod.clone().unwrap_or_default(),
    )
}

/// Whether `pod` is (still) in the warm pool of the Snapshot with `snap_uid`: labelled
/// so and controlled by it. An adopted Pod is neither.
pub fn in_pool_of(pod: &Pod, snap_uid: &str) -> bool {
    pod.labels().get(LABEL_WARM_POOL).map(String::as_str) == Some(snap_uid)
        && pod
            .owner_references()
            .iter()
            .any(|o| o.controller == Some(true) && o.kind == "Snapshot" && o.uid == snap_uid)
}

/// The Pod with `meta`: `settings` placing it, `requests` as its container's requests
/// and limits, pinned to `node` when given.
fn assemble(
    meta: ObjectMeta,
    settings: PodSettings,
    requests: Requests,
    image: &str,
    node: Option<&str>,
) -> Pod {
    let mut affinity = settings.affinity;
    if let Some(node) = node {
        affinity.get_or_insert_with(Affinity::default).node_affinity = Some(on_node(node));
    }

    let mut memory = requests.memory_bytes.to_string();
    if requests.memory_bytes.is_multiple_of(1 << 20) {
        memory = format!("{}Mi", requests.memory_bytes >> 20);
    }
    let amounts: BTreeMap<String, Quantity> = [
        (
            "cpu".to_string(),
            Quantity(format!("{}m", requests.cpu_millis)),
        ),
        ("memory".to_string(), Quantity(memory)),
    ]
    .into();

    let container = Container {
        name: POD_CONTAINER.into(),
        image: Some(image.into()),
        args: Some(vec!["--dir".into(), POD_MOUNT.into()]),
        volume_mounts: Some(vec![VolumeMount {
            name: POD_VOLUME.into(),
            mount_path: POD_MOUNT.into(),
            ..Default::default()
        }]),
        resources: Some(ResourceRequirements {
            requests: Some(amounts.clone()),
            limits: Some(amounts),
            ..Default::default()
        }),
        security_context: Some(SecurityContext {
            allow_privilege_escalation: Some(false),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".into()]),
                ..Default::default()
            }),
            read_only_root_filesystem: Some(true),
            ..Default::default()
        }),
        ..Default::default()
    };

    Pod {
        metadata: meta,
        spec: Some(PodSpec {
            containers: vec![container],
            restart_policy: Some("Never".into()),
            automount_service_account_token: Some(false),
            enable_service_links: Some(false),
            termination_grace_period_seconds: Some(TERMINATION_GRACE_SECONDS),
            node_selector: (!settings.node_selector.is_empty()).then_some(settings.node_selector),
            tolerations: (!settings.tolerations.is_empty()).then_some(settings.tolerations),
            affinity,
            priority_class_name: settings.priority_class_name,
            // Restricted Pod Security; the emptyDir is the group's, so ramify-pod reads
            // what the node agent writes there group-readable.
            security_context: Some(PodSecurityContext {
                run_as_non_root: Some(true),
                run_as_user: Some(POD_RUN_AS_USER),
                run_as_group: Some(POD_RUN_AS_USER),
                fs_group: Some(POD_RUN_AS_USER),
                seccomp_profile: Some(SeccompProfile {
                    type_: "RuntimeDefault".into(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            volumes: Some(vec![Volume {
                name: POD_VOLUME.into(),
                empty_dir: Some(EmptyDirVolumeSource::default()),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        status: None,
    }
}

/// The labels of `sbx`'s Pod: `spec.pod.labels`, then ramify's own (which win over
/// any of the same key).
pub fn labels(sbx: &Sandbox) -> Result<BTreeMap<String, String>> {
    let name = sbx.name_any();
    let uid = sbx
        .uid()
        .ok_or_else(|| Error::Invalid(format!("sandbox {name} has no uid")))?;
    let mut labels = sbx.spec.pod.clone().unwrap_or_default().labels;
    labels.insert(LABEL_SANDBOX_UID.into(), uid);
    if name.len() <= LABEL_VALUE_MAX {
        labels.insert(LABEL_SANDBOX.into(), name);
    } else {
        labels.remove(LABEL_SANDBOX);
    }
    labels.insert(LABEL_MANAGED_BY.into(), MANAGED_BY_RAMIFY.into());
    Ok(labels)
}

/// `sbx` as the controlling owner of its Pod.
pub fn controller(sbx: &Sandbox) -> Result<OwnerReference> {
    let name = sbx.name_any();
    let uid = sbx
        .uid()
        .ok_or_else(|| Error::Invalid(format!("sandbox {name} has no uid")))?;
    Ok(OwnerReference {
        api_version: ramify_crds::API_VERSION.into(),
        kind: "Sandbox".into(),
        name,
        uid,
        controller: Some(true),
        block_owner_deletion: Some(true),
    })
}

/// A required node affinity for exactly `node` (by name, not by a label it may lack).
fn on_node(node: &str) -> NodeAffinity {
    NodeAffinity {
        required_during_scheduling_ignored_during_execution: Some(NodeSelector {
            node_selector_terms: vec![NodeSelectorTerm {
                match_fields: Some(vec![NodeSelectorRequirement {
                    key: "metadata.name".into(),
                    operator: "In".into(),
                    values: Some(vec![node.into()]),
                }]),
                ..Default::default()
            }],
        }),
        ..Default::default()
    }
}

/// Whether `pod` is `sbx`'s: its controller is this Sandbox (by uid, not by name: a
/// deleted Sandbox's Pod may outlive it under the same name).
pub fn is_of(pod: &Pod, sbx: &Sandbox) -> bool {
    let uid = sbx.uid();
    pod.owner_references()
        .iter()
        .any(|o| o.controller == Some(true) && o.kind == "Sandbox" && Some(&o.uid) == uid.as_ref())
}

/// What `status.pod` says of `pod`.
pub fn pod_ref(pod: &Pod) -> PodRef {
    PodRef {
        name: pod.name_any(),
        uid: pod.uid().unwrap_or_default(),
        ip: pod
            .status
            .as_ref()
            .and_then(|s| s.pod_ip.clone())
            .filter(|ip| !ip.is_empty()),
    }
}

/// The scheduler's word on a Pod it has not placed: `Some(message)` when its
/// `PodScheduled` condition is False for reason `Unschedulable`.
pub fn unschedulable(pod: &Pod) -> Option<String> {
    pod.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| {
            c.type_ == "PodScheduled"
                && c.status == "False"
                && c.reason.as_deref() == Some("Unschedulable")
        })
        .map(|c| {
            c.message
                .clone()
                .unwrap_or_else(|| "the scheduler cannot place the Pod".into())
        })
}

/// The node the scheduler placed `pod` on.
pub fn node_of(pod: &Pod) -> Option<&str> {
    pod.spec
        .as_ref()?
        .node_name
        .as_deref()
        .filter(|n| !n.is_empty())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use serde_json::json;

    fn sandbox(extra: serde_json::Value) -> Sandbox {
        let mut v = json!({
            "apiVersion": "ramify.dev/v1alpha1", "kind": "Sandbox",
            "metadata": {"name": "s", "namespace": "team", "uid": "u-1"},
            "spec": {"command": ["sh"]},
        });
        for (k, x) in extra.as_object().unwrap() {
            v["spec"][k] = x.clone();
        }
        serde_json::from_value(v).unwrap()
    }

    fn wire(p: &Pod) -> serde_json::Value {
        serde_json::to_value(p).unwrap()
    }

    #[test]
    fn the_pod_is_the_sandboxs_own() {
        let p = wire(&build(&sandbox(json!({})), "reg/ramify/pod@sha256:ab", None).unwrap());
        let m = &p["metadata"];
        assert_eq!(m["name"], "s");
        assert_eq!(m["namespace"], "team");
        assert_eq!(
            m["labels"],
            json!({"ramify.dev/sandbox-uid": "u-1", "ramify.dev/sandbox": "s",
                   "app.kubernetes.io/managed-by": "ramify"})
        );
        assert_eq!(
            m["ownerReferences"],
            json!([{"apiVersion": "ramify.dev/v1alpha1", "kind": "Sandbox", "name": "s",
                    "uid": "u-1", "controller": true, "blockOwnerDeletion": true}])
        );
        assert!(m.get("annotations").is_none());
        let s = &p["spec"];
        assert_eq!(s["restartPolicy"], "Never");
        assert_eq!(s["automountServiceAccountToken"], false);
        assert_eq!(s["enableServiceLinks"], false);
        // A workspace moves when evicted: ramify-pod waits for that, within 120 s.
        assert_eq!(s["terminationGracePeriodSeconds"], 120);
        assert!(s.get("affinity").is_none() && s.get("nodeSelector").is_none());
        let c = &s["containers"][0];
        assert_eq!(c["name"], "sandbox");
        assert_eq!(c["image"], "reg/ramify/pod@sha256:ab");
        assert_eq!(c["args"], json!(["--dir", "/ramify", "--move-wait"]));
        assert_eq!(
            c["volumeMounts"],
            json!([{"name": "ramify", "mountPath": "/ramify"}])
        );
        assert_eq!(s["volumes"], json!([{"name": "ramify", "emptyDir": {}}]));
        // The same accounting as standalone capacity: 250m / 256Mi by default.
        let want = json!({"cpu": "250m", "memory": "256Mi"});
        assert_eq!(c["resources"], json!({"requests": want, "limits": want}));
    }

    #[test]
    fn a_branchs_pod_ends_with_it_and_never_waits_for_a_move() {
        let b = sandbox(
            json!({"restoreFrom": {"snapshot": "snap", "branch": {"branchSet": "bs", "name": "b0", "index": 0}}}),
        );
        let p = wire(&build(&b, "i", Some("n1")).unwrap());
        assert_eq!(p["spec"]["terminationGracePeriodSeconds"], 10);
        assert_eq!(
            p["spec"]["containers"][0]["args"],
            json!(["--dir", "/ramify"])
        );
    }

    #[test]
    fn restricted_pod_security() {
        let p = wire(&build(&sandbox(json!({})), "i", None).unwrap());
        let psc = &p["spec"]["securityContext"];
        assert_eq!(psc["runAsNonRoot"], true);
        assert_eq!(psc["runAsUser"], 65532);
        assert_eq!(psc["runAsGroup"], 65532);
        assert_eq!(psc["seccompProfile"], json!({"type": "RuntimeDefault"}));
        let sc = &p["spec"]["containers"][0]["securityContext"];
        assert_eq!(sc["allowPrivilegeEscalation"], false);
        assert_eq!(sc["capabilities"], json!({"drop": ["ALL"]}));
        assert_eq!(sc["readOnlyRootFilesystem"], true);
    }

    #[test]
    fn requests_are_the_sandboxs_resources() {
        let p = wire(
            &build(
                &sandbox(json!({"resources": {"cpu": "1.5", "memory": "1Gi"}})),
                "i",
                None,
            )
            .unwrap(),
        );
        let want = json!({"cpu": "1500m", "memory": "1024Mi"});
        assert_eq!(
            p["spec"]["containers"][0]["resources"],
            json!({"requests": want, "limits": want})
        );
    }

    #[test]
    fn placement_and_user_labels_cannot_override_ramifys() {
        let sbx = sandbox(json!({"pod": {
            "nodeSelector": {"pool": "sandboxes"},
            "tolerations": [{"key": "sbx", "operator": "Exists", "effect": "NoSchedule"}],
            "priorityClassName": "batch",
            "labels": {"app": "web", "app.kubernetes.io/managed-by": "me"},
            "annotations": {"team": "a"},
            "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 1, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname"}}]},
                "nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 1, "preference": {"matchExpressions": [{"key": "z", "operator": "Exists"}]}}]}},
        }}));
        let p = wire(&build(&sbx, "i", None).unwrap());
        let labels = &p["metadata"]["labels"];
        assert_eq!(labels["app"], "web");
        assert_eq!(labels["app.kubernetes.io/managed-by"], "ramify");
        assert_eq!(labels["ramify.dev/sandbox-uid"], "u-1");
        assert_eq!(p["metadata"]["annotations"], json!({"team": "a"}));
        let s = &p["spec"];
        assert_eq!(s["nodeSelector"], json!({"pool": "sandboxes"}));
        assert_eq!(s["tolerations"][0]["key"], "sbx");
        assert_eq!(s["priorityClassName"], "batch");
        // Unpinned: the user's affinity as written.
        assert_eq!(
            s["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["weight"],
            1
        );
        assert!(s["affinity"]["podAntiAffinity"].is_object());
    }

    #[test]
    fn a_branch_goes_to_its_snapshots_node_only() {
        let sbx = sandbox(json!({
            "restoreFrom": {"snapshot": "snap"},
            "pod": {"affinity": {
                "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                    {"weight": 1, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname"}}]},
                "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "z", "operator": "Exists"}]}]}}}},
        }));
        let p = wire(&build(&sbx, "i", Some("node-3")).unwrap());
        let a = &p["spec"]["affinity"];
        assert_eq!(
            a["nodeAffinity"],
            json!({"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-3"]}]}]}})
        );
        // The rest of the user's affinity stays.
        assert!(a["podAntiAffinity"].is_object());
        // Without any affinity of the user's too.
        let p = wire(&build(&sandbox(json!({})), "i", Some("n")).unwrap());
        assert_eq!(
            p["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
                ["nodeSelectorTerms"][0]["matchFields"][0]["values"],
            json!(["n"])
        );
    }

    #[test]
    fn a_warm_pool_pod_is_a_branchs_pod_owned_by_the_snapshot() {
        let source = sandbox(json!({"resources": {"cpu": "500m", "memory": "512Mi"},
            "pod": {"labels": {"app": "web"}, "priorityClassName": "batch",
                    "nodeSelector": {"pool": "a"}}}));
        let snap: Snapshot = serde_json::from_value(json!({
            "apiVersion": "ramify.dev/v1alpha1", "kind": "Snapshot",
            "metadata": {"name": "snap", "namespace": "team", "uid": "snap-uid"},
            "spec": {"source": {"sandbox": "s"}},
        }))
        .unwrap();
        let pod = build_pool(&snap, &source, "i", "node-1", 2).unwrap();
        let p = wire(&pod);
        assert_eq!(p["metadata"]["name"], "snap-warm-2");
        assert_eq!(p["metadata"]["namespace"], "team");
        // Only ramify's labels: a Service selecting the source never reaches it.
        assert_eq!(
            p["metadata"]["labels"],
            json!({"app.kubernetes.io/managed-by": "ramify", "ramify.dev/warm-pool": "snap-uid"})
        );
        assert_eq!(p["metadata"]["ownerReferences"][0]["kind"], "Snapshot");
        assert_eq!(p["metadata"]["ownerReferences"][0]["uid"], "snap-uid");
        assert_eq!(p["spec"]["priorityClassName"], "batch");
        assert!(p["spec"].get("nodeSelector").is_none());
        assert_eq!(
            p["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
                ["nodeSelectorTerms"][0]["matchFields"][0]["values"],
            json!(["node-1"])
        );
        assert!(in_pool_of(&pod, "snap-uid"));
        assert!(!in_pool_of(&pod, "other"));
        // Pool Pods become branches: they never wait for a move.
        assert_eq!(p["spec"]["terminationGracePeriodSeconds"], 10);
        assert_eq!(
            p["spec"]["containers"][0]["args"],
            json!(["--dir", "/ramify"])
        );
        // A branch of the source hashes as the pool Pod was built; another size not.
        let mut branch = source.clone();
        branch.spec.pod = source.spec.pod.as_ref().map(PodSettings::for_branch);
        let hash = &p["metadata"]["annotations"]["ramify.dev/pod-template"];
        assert_eq!(hash, &json!(template_of(&branch)));
        let mut bigger = branch.clone();
        bigger.spec.resources =
            serde_json::from_value(json!({"cpu": "1", "memory": "512Mi"})).unwrap();
        assert_ne!(hash, &json!(template_of(&bigger)));
        // Adopted (relabelled, re-owned): no longer the pool's.
        let mut adopted = pod.clone();
        adopted
            .metadata
            .labels
            .as_mut()
            .unwrap()
            .remove(LABEL_WARM_POOL);
        assert!(!in_pool_of(&adopted, "snap-uid"));
    }

    #[test]
    fn a_long_name_is_not_a_label() {
        let mut sbx = sandbox(json!({}));
        let long = "a".repeat(64);
        sbx.metadata.name = Some(long.clone());
        let p = build(&sbx, "i", None).unwrap();
        assert_eq!(p.metadata.name.as_deref(), Some(long.as_str()));
        let labels = p.metadata.labels.unwrap();
        assert!(!labels.contains_key(LABEL_SANDBOX));
        assert_eq!(labels[LABEL_SANDBOX_UID], "u-1");
    }

    #[test]
    fn only_a_pod_this_sandbox_controls_is_its() {
        let sbx = sandbox(json!({}));
        let mut pod = build(&sbx, "i", None).unwrap();
        assert!(is_of(&pod, &sbx));
        let mut other = sbx.clone();
        other.metadata.uid = Some("u-2".into());
        assert!(!is_of(&pod, &other));
        pod.metadata.owner_references = None;
        assert!(!is_of(&pod, &sbx));
        let mut no_uid = sbx.clone();
        no_uid.metadata.uid = None;
        assert!(build(&no_uid, "i", None).is_err());
    }

    #[test]
    fn what_the_scheduler_said() {
        let mut pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "s", "uid": "p-1"},
            "spec": {"containers": []},
            "status": {"conditions": [{"type": "PodScheduled", "status": "False",
                "reason": "Unschedulable", "message": "0/3 nodes are available: 3 Insufficient cpu."}]},
        }))
        .unwrap();
        assert_eq!(
            unschedulable(&pod).as_deref(),
            Some("0/3 nodes are available: 3 Insufficient cpu.")
        );
        assert_eq!(node_of(&pod), None);
        assert_eq!(
            pod_ref(&pod),
            PodRef {
                name: "s".into(),
                uid: "p-1".into(),
                ip: None
            }
        );
        pod.spec.as_mut().unwrap().node_name = Some("n1".into());
        pod.status = serde_json::from_value(json!({"podIP": "10.0.0.7", "conditions": [
            {"type": "PodScheduled", "status": "True"}]}))
        .unwrap();
        assert_eq!(unschedulable(&pod), None);
        assert_eq!(node_of(&pod), Some("n1"));
        assert_eq!(pod_ref(&pod).ip.as_deref(), Some("10.0.0.7"));
    }
}
