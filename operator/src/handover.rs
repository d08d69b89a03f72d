//! Cluster mode, after a `Full` commit: the parent's sandbox is the winner's, which
//! runs in the winner's Pod (its network namespace and cgroup). That Pod is handed to
//! the parent: relabelled as the parent's (so a Service selecting the parent's
//! `spec.pod.labels` reaches the winner's server), re-owned by it (so it outlives the
//! winner's Sandbox and goes with the parent), named in the parent's `status.pod`; the
//! parent's old Pod, whose sandbox the commit destroyed, is deleted.
//!
//! Which Sandboxes share a sandbox is read from status: after a Full commit the parent
//! reports the winner's `sandboxId`. The node agent keeps the winner's finalizer until
//! the Pod no longer names the winner as an owner, so the winner's deletion cannot
//! take the Pod (and the parent's processes) with it before this ran. Idempotent: each
//! step is redone until the parent's `status.pod` names the Pod.

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, Patch, PatchParams, Preconditions};
use kube::{Resource, ResourceExt};
use ramify_crds::capacity::CONDITION_SCHEDULED;
use ramify_crds::pod::{MANAGER_OPERATOR_POD, REASON_POD_HANDED_OVER};
use ramify_crds::{CommitMode, Sandbox, branch_sandbox_name};
use serde_json::{Value, json};
use tracing::info;

use crate::context::Context;
use crate::error::Result;

/// Among Sandboxes sharing one sandbox (the same `status.sandboxId`), the one that
/// holds it now: the one no other names as the winner of its `Full` commit (a winner
/// of a winner, in nested sets, hands it on up the chain).
pub fn holder<'a>(group: &[&'a Sandbox]) -> Option<&'a Sandbox> {
    let won: Vec<String> = group
        .iter()
        .filter_map(|s| s.status.as_ref()?.last_commit.as_ref())
        .filter(|c| c.commit.mode == CommitMode::Full)
        .map(|c| branch_sandbox_name(&c.branch_set, &c.winner))
        .collect();
    let mut holders = group.iter().filter(|s| !won.contains(&s.name_any()));
    let h = holders.next()?;
    // Two that nobody names: not a commit's doing (a status copied by hand?): leave it.
    holders.next().is_none().then_some(*h)
}

/// Among Sandboxes sharing one sandbox, the one it first ran for (whose Pod it runs
/// in): the one that names no other of them as the winner of its `Full` commit.
pub fn origin<'a>(group: &[&'a Sandbox]) -> Option<&'a Sandbox> {
    let names: Vec<String> = group.iter().map(|s| s.name_any()).collect();
    let mut origins = group.iter().filter(|s| {
        s.status
            .as_ref()
            .and_then(|st| st.last_commit.as_ref())
            .filter(|c| c.commit.mode == CommitMode::Full)
            .is_none_or(|c| !names.contains(&branch_sandbox_name(&c.branch_set, &c.winner)))
    });
    let o = origins.next()?;
    origins.next().is_none().then_some(*o)
}

/// The merge patch that makes `pod` the Pod of `holder`: its labels (the old owner's
/// ramify labels removed, the holder's added), the holder as its only owner.
pub fn patch(holder: &Sandbox, pod: &Pod) -> Result<Value> {
    let labels = crate::pod::labels(holder)?;
    let mut patch_labels = serde_json::Map::new();
    for key in pod.labels().keys() {
        if !labels.contains_key(key) {
            patch_labels.insert(key.clone(), Value::Null);
        }
    }
    for (k, v) in &labels {
        patch_labels.insert(k.clone(), json!(v));
    }
    let mut meta = json!({
        "labels": patch_labels,
        "ownerReferences": [crate::pod::controller(holder)?],
    });
    let annotations = holder.spec.pod.clone().unwrap_or_default().annotations;
    if !annotations.is_empty() {
        meta["annotations"] = json!(annotations);
    }
    Ok(json!({"metadata": meta}))
}

/// The Sandboxes of `sbx`'s namespace running the same sandbox as `sbx` (itself
/// included), from the cache.
fn sharing(sbx: &Sandbox, ctx: &Context) -> Vec<Sandbox> {
    let Some(id) = sbx.status.as_ref().and_then(|s| s.sandbox_id.clone()) else {
        return Vec::new();
    };
    let ns = sbx.namespace();
    let (all, _) = ctx.cache.everything();
    all.iter()
        .filter_map(|g| g.0.as_ref().ok())
        .filter(|s| {
            s.namespace() == ns
                && s.metadata.deletion_timestamp.is_none()
                && s.status.as_ref().and_then(|st| st.sandbox_id.as_ref()) == Some(&id)
        })
        .chain(std::iter::once(sbx))
        .fold(Vec::<Sandbox>::new(), |mut v, s| {
            if !v.iter().any(|x| x.uid() == s.uid()) {
                v.push(s.clone());
            }
            v
        })
}

/// Hands the Pod of the sandbox `sbx` shares (as a Full commit's parent or winner) to
/// whichever Sandbox holds it now, when that is not done yet. Returns whether it acted.
pub async fn reconcile(sbx: &Sandbox, ctx: &Context) -> Result<bool> {
    ctx.cache.synced().await?;
    let group = sharing(sbx, ctx);
    if group.len() < 2 {
        return Ok(false);
    }
    let refs: Vec<&Sandbox> = group.iter().collect();
    let Some(holder) = holder(&refs) else {
        return Ok(false);
    };
    // The Pod the sandbox runs in: its origin's (the holder's own Pod lost its
    // sandbox to the commit).
    let held = holder.status.as_ref().and_then(|s| s.pod.clone());
    let Some(from) = origin(&refs)
        .and_then(|o| o.status.as_ref()?.pod.clone())
        .filter(|p| !p.name.is_empty() && !p.uid.is_empty())
    else {
        return Ok(false);
    };
    if held.as_ref().is_some_and(|h| h.uid == from.uid) {
        return Ok(false); // handed over already
    }
    let ns = holder.namespace().unwrap_or_default();
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    let Some(pod) = pods.get_opt(&from.name).await? else {
        return Ok(false); // gone: the node agent ends the sandbox, saying so
    };
    if pod.uid().as_deref() != Some(from.uid.as_str()) {
        return Ok(false);
    }
    let body = patch(holder, &pod)?;
    let params = PatchParams {
        field_manager: Some(MANAGER_OPERATOR_POD.into()),
        ..Default::default()
    };
    let pod = pods
        .patch(&from.name, &params, &Patch::Merge(&body))
        .await?;
    // The holder's binding names the Pod: its node is the same (branches run on their
    // snapshot's node, which is their parent's).
    let status = holder.status.clone().unwrap_or_default();
    let scheduled: Vec<_> = status
        .conditions
        .iter()
        .filter(|c| c.type_ == CONDITION_SCHEDULED)
        .collect();
    let node = crate::pod::node_of(&pod).map(str::to_string);
    let sandboxes: Api<Sandbox> = Api::namespaced(ctx.client.clone(), &ns);
    crate::writes::status(
        &sandboxes,
        &holder.name_any(),
        ramify_crds::MANAGER_OPERATOR_SANDBOX_BINDING,
        None,
        &json!({"nodeName": node.or(status.node_name.clone()), "conditions": scheduled, "pod": crate::pod::pod_ref(&pod)}),
    )
    .await?;
    // Its old Pod held the sandbox the commit replaced: nothing runs in it.
    if let Some(old) = held.filter(|h| h.uid != from.uid) {
        let dp = DeleteParams {
            preconditions: Some(Preconditions {
                uid: Some(old.uid.clone()),
                resource_version: None,
            }),
            ..DeleteParams::background()
        };
        match pods.delete(&old.name, &dp).await {
            Ok(_) => {}
            Err(e)
                if ramify_runtime::api_error::is_object_not_found(&e)
                    || matches!(&e, kube::Error::Api(s) if s.code == 409) => {}
            Err(e) => return Err(e.into()),
        }
    }
    info!(holder = %holder.name_any(), pod = %from.name, "handed the Pod over");
    ctx.event(
        &holder.object_ref(&()),
        false,
        REASON_POD_HANDED_OVER,
        format!(
            "its sandbox runs in Pod {} since a Full commit; the Pod is its own now",
            from.name
        ),
    )
    .await;
    Ok(true)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn sbx(name: &str, committed: Option<(&str, &str, &str)>) -> Sandbox {
        let mut v = json!({
            "apiVersion": "ramify.dev/v1alpha1", "kind": "Sandbox",
            "metadata": {"name": name, "namespace": "ns", "uid": format!("uid-{name}")},
            "spec": {"command": ["sh"], "pod": {"labels": {"app": "web"}}},
            "status": {"sandboxId": "shared"},
        });
        if let Some((bs, winner, mode)) = committed {
            v["status"]["lastCommit"] = json!({"branchSet": bs, "branchSetUid": "u",
                "winner": winner, "mode": mode, "fileCount": 0, "bytes": 0});
        }
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn the_parent_of_a_full_commit_holds_the_winners_sandbox() {
        let (p, w) = (sbx("ws", Some(("try", "b2", "Full"))), sbx("try-b2", None));
        assert_eq!(holder(&[&w, &p]).unwrap().name_any(), "ws");
        assert_eq!(holder(&[&p, &w]).unwrap().name_any(), "ws");
        // Nested: the winner of a winner hands it on up.
        let gp = sbx("top", Some(("up", "ws", "Full")));
        let p = sbx("up-ws", Some(("try", "b2", "Full")));
        let w = sbx("try-b2", None);
        assert_eq!(holder(&[&w, &gp, &p]).unwrap().name_any(), "top");
        assert_eq!(origin(&[&gp, &p, &w]).unwrap().name_any(), "try-b2");
        // A Paths commit moves no sandbox; two unrelated: nobody.
        let p = sbx("ws", Some(("try", "b2", "Paths")));
        assert!(holder(&[&p, &w]).is_none());
    }

    #[test]
    fn the_patch_relabels_and_reowns() {
        let p = sbx("ws", Some(("try", "b2", "Full")));
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "try-b2", "labels": {"ramify.dev/sandbox-uid": "uid-try-b2",
                "ramify.dev/sandbox": "try-b2", "app.kubernetes.io/managed-by": "ramify",
                "extra": "x"}}
        }))
        .unwrap();
        let v = patch(&p, &pod).unwrap();
        let l = &v["metadata"]["labels"];
        assert_eq!(l["ramify.dev/sandbox-uid"], "uid-ws");
        assert_eq!(l["ramify.dev/sandbox"], "ws");
        assert_eq!(l["app"], "web");
        assert_eq!(l["extra"], Value::Null);
        let o = &v["metadata"]["ownerReferences"];
        assert_eq!(o.as_array().unwrap().len(), 1);
        assert_eq!(o[0]["uid"], "uid-ws");
        assert_eq!(o[0]["controller"], true);
    }
}
