//! Self-forks: a workload asked its node agent to fork it from inside
//! (`/run/ramify/fork`); the agent accepted the request into the Sandbox's
//! `status.selfFork.pending`, and the operator turns it into a BranchSet of the
//! Sandbox, owned by it (deleted with it), labelled with who forked and how deep. From
//! there it is an ordinary BranchSet: snapshotted, forked, decided, committed, visible
//! and counted by quota like any other.

use kube::api::{Api, PostParams};
use kube::{Resource, ResourceExt};
use ramify_crds::{
    Branch, BranchSet, BranchSetSpec, BranchSource, CommitMode, CommitSpec, LABEL_SELF_FORK_DEPTH,
    LABEL_SELF_FORK_OF, Policy, Sandbox, SelfForkRequest,
};
use tracing::{info, instrument};

use crate::context::Context;
use crate::error::Result;

/// The BranchSet that serves `req`, a request of `sbx`'s workload.
pub fn branch_set_for(sbx: &Sandbox, req: &SelfForkRequest, timeout_seconds: i32) -> BranchSet {
    let mut bs = BranchSet::new(
        &req.branch_set,
        BranchSetSpec {
            source: BranchSource {
                sandbox: Some(sbx.name_any()),
                snapshot: None,
            },
            // No command: each branch continues the snapshotted processes, whose call
            // returns that branch's name; its verdict file decides.
            branches: Some(
                req.branches
                    .iter()
                    .map(|name| Branch {
                        name: name.clone(),
                        run: Vec::new(),
                        env: Vec::new(),
                    })
                    .collect(),
            ),
            replicas: None,
            template: None,
            verdict: None,
            policy: Policy::FirstCommitWins,
            selected_branch: None,
            // Full: the winner's live processes become the workspace.
            commit: CommitSpec {
                mode: CommitMode::Full,
                paths: Vec::new(),
            },
            timeout_seconds,
            retain_losers: false,
            effects: None,
            warm_pool_size: None,
            placement: None,
            ttl_seconds_after_finished: ramify_crds::DEFAULT_TTL_SECONDS_AFTER_FINISHED,
        },
    );
    bs.metadata.namespace = sbx.namespace();
    bs.metadata.labels = Some(
        [
            (LABEL_SELF_FORK_OF.to_string(), sbx.name_any()),
            (LABEL_SELF_FORK_DEPTH.to_string(), req.depth.to_string()),
        ]
        .into(),
    );
    bs.metadata.owner_references = sbx.controller_owner_ref(&()).map(|o| vec![o]);
    bs
}

/// Creates the BranchSet of `sbx`'s pending self-fork, if it has one that has none yet.
/// Idempotent: the name is the request's, and an existing set is left alone.
#[instrument(skip_all, fields(sandbox = %sbx.name_any()))]
pub async fn serve(sbx: &Sandbox, ctx: &Context) -> Result<()> {
    let (Some(cfg), Some(req)) = (
        sbx.spec.self_fork.as_ref(),
        sbx.status
            .as_ref()
            .and_then(|s| s.self_fork.as_ref())
            .and_then(|s| s.pending.as_ref()),
    ) else {
        return Ok(());
    };
    let api: Api<BranchSet> =
        Api::namespaced(ctx.client.clone(), &sbx.namespace().unwrap_or_default());
    if api.get_opt(&req.branch_set).await?.is_some() {
        return Ok(());
    }
    let bs = branch_set_for(sbx, req, cfg.timeout_seconds);
    match api.create(&PostParams::default(), &bs).await {
        Ok(_) => {
            info!(branchset = %req.branch_set, branches = req.branches.len(), depth = req.depth, "self-fork requested from inside: BranchSet created");
            Ok(())
        }
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use ramify_crds::SandboxSpec;

    #[test]
    fn a_request_becomes_a_full_first_commit_wins_set_owned_by_the_sandbox() {
        let mut sbx = Sandbox::new(
            "ws",
            SandboxSpec {
                image: None,
                image_pull_policy: None,
                image_pull_secrets: vec![],
                rootfs: None,
                command: vec!["/bin/sh".into()],
                env: vec![],
                working_dir: None,
                resources: None,
                network: Default::default(),
                system_files: Default::default(),
                restore_from: None,
                node_name: None,
                allow_snapshot_with_secrets: false,
                self_fork: None,
                suspended: false,
                idle_suspend_seconds: None,
                pod: None,
            },
        );
        sbx.metadata.namespace = Some("team".into());
        sbx.metadata.uid = Some("uid-ws".into());
        let req = SelfForkRequest {
            number: 3,
            branch_set: ramify_crds::self_fork_name("ws", 3),
            branches: vec!["b0".into(), "b1".into()],
            depth: 2,
        };
        let bs = branch_set_for(&sbx, &req, 120);
        assert_eq!(bs.name_any(), "ws-self-3");
        assert_eq!(bs.namespace().as_deref(), Some("team"));
        assert_eq!(bs.spec.source.sandbox.as_deref(), Some("ws"));
        let names: Vec<_> = bs
            .spec
            .branches
            .as_ref()
            .unwrap()
            .iter()
            .map(|b| b.name.as_str())
            .collect();
        assert_eq!(names, ["b0", "b1"]);
        assert!(
            bs.spec
                .branches
                .as_ref()
                .unwrap()
                .iter()
                .all(|b| b.run.is_empty())
        );
        assert_eq!(bs.spec.commit.mode, CommitMode::Full);
        assert_eq!(bs.spec.policy, Policy::FirstCommitWins);
        assert_eq!(bs.spec.timeout_seconds, 120);
        assert_eq!(bs.labels()[LABEL_SELF_FORK_OF], "ws");
        assert_eq!(bs.labels()[LABEL_SELF_FORK_DEPTH], "2");
        assert_eq!(bs.owner_references()[0].uid, "uid-ws");
    }
}
