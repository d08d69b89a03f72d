//! The objects the plan creates: the snapshot of a source sandbox, and the branch
//! sandboxes restored from it.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::{Resource, ResourceExt};
use ramify_crds::{
    BranchRef, BranchSet, FINALIZER_NODE_CLEANUP, LABEL_BRANCH, LABEL_BRANCHSET,
    LABEL_SELF_FORK_DEPTH, LABEL_SELF_FORK_OF, RestoreFrom, Sandbox, SandboxSpec, Snapshot,
    SnapshotMode, SnapshotSource, SnapshotSpec, WarmPool,
};

use super::branch_sandbox_name;

fn owner_ref(bs: &BranchSet) -> Option<OwnerReference> {
    bs.controller_owner_ref(&())
}

/// The Live snapshot a BranchSet takes of its source sandbox, owned by the set.
pub(super) fn snapshot_for(bs: &BranchSet, name: &str, source: &str) -> Snapshot {
    let mut snap = Snapshot::new(
        name,
        SnapshotSpec {
            source: SnapshotSource {
                sandbox: source.to_string(),
            },
            mode: SnapshotMode::Live,
            warm_pool: bs.spec.warm_pool_size.map(|size| WarmPool {
                size,
                nodes: Vec::new(),
            }),
            ttl_seconds: None,
        },
    );
    snap.metadata = ObjectMeta {
        name: Some(name.to_string()),
        namespace: bs.metadata.namespace.clone(),
        labels: Some(
            [(
                LABEL_BRANCHSET.to_string(),
                bs.metadata.name.clone().unwrap_or_default(),
            )]
            .into(),
        ),
        owner_references: owner_ref(bs).map(|o| vec![o]),
        finalizers: Some(vec![FINALIZER_NODE_CLEANUP.to_string()]),
        ..Default::default()
    };
    snap
}

/// The sandbox of branch `index`, restored from `snapshot` with the parent's spec.
pub(super) fn branch_sandbox(
    bs: &BranchSet,
    parent: &Sandbox,
    snapshot: &str,
    node: Option<String>,
    branch: &str,
    index: usize,
) -> Sandbox {
    let bs_name = bs.metadata.name.clone().unwrap_or_default();
    let name = branch_sandbox_name(&bs_name, branch);
    let spec = SandboxSpec {
        image: parent.spec.image.clone(),
        // The branch restores the snapshot's image by digest; these say how to pull it
        // again should its node have lost it.
        image_pull_policy: parent.spec.image_pull_policy,
        image_pull_secrets: parent.spec.image_pull_secrets.clone(),
        rootfs: parent.spec.rootfs.clone(),
        command: Vec::new(),
        env: parent.spec.env.clone(),
        working_dir: parent.spec.working_dir.clone(),
        resources: parent.spec.resources.clone(),
        network: parent.spec.network.clone(),
        // What the branch's snapshot recorded decides its mounts; this says the same.
        system_files: parent.spec.system_files,
        restore_from: Some(RestoreFrom {
            snapshot: snapshot.to_string(),
            branch: Some(BranchRef {
                branch_set: bs_name.clone(),
                name: branch.to_string(),
                index: i32::try_from(index).unwrap_or(i32::MAX),
                self_fork: bs.labels().contains_key(LABEL_SELF_FORK_OF),
            }),
        }),
        node_name: node,
        allow_snapshot_with_secrets: parent.spec.allow_snapshot_with_secrets,
        // A branch may fork again, within the depth its set's label counts.
        self_fork: parent.spec.self_fork.clone(),
        // A branch runs to its verdict; only a workspace is suspended.
        suspended: false,
        idle_suspend_seconds: None,
        // Cluster mode: a branch's Pod goes to its snapshot's node, tolerating what its
        // parent's tolerates, at its priority; the parent's labels (which a Service may
        // select) and its placement rules stay the parent's.
        pod: parent
            .spec
            .pod
            .as_ref()
            .map(ramify_crds::pod::PodSettings::for_branch),
    };
    let mut sbx = Sandbox::new(&name, spec);
    sbx.metadata = ObjectMeta {
        name: Some(name),
        namespace: bs.metadata.namespace.clone(),
        labels: Some({
            let mut l: std::collections::BTreeMap<String, String> = [
                (LABEL_BRANCHSET.to_string(), bs_name),
                (LABEL_BRANCH.to_string(), branch.to_string()),
            ]
            .into();
            // A self-fork's branches carry its depth: a branch forking again nests one deeper.
            for key in [LABEL_SELF_FORK_OF, LABEL_SELF_FORK_DEPTH] {
                if let Some(v) = bs.labels().get(key) {
                    l.insert(key.to_string(), v.clone());
                }
            }
            l
        }),
        owner_references: owner_ref(bs).map(|o| vec![o]),
        // Born with the finalizer: a branch can never run without node-side cleanup.
        finalizers: Some(vec![FINALIZER_NODE_CLEANUP.to_string()]),
        ..Default::default()
    };
    sbx
}
