//! Cluster mode: a Snapshot's warm pool is Pods. A fork must not pay for a Pod's
//! creation, its CNI set-up and its container's start on its critical path, so a Ready
//! Snapshot with `spec.warmPool.size: N` keeps N Pods on its node ([`keep`]), each built
//! as a branch of its source would be, owned by the Snapshot and labelled only as
//! ramify's and the pool's. The node agent keeps a frozen branch in each
//! (`status.warm.pods` names those ready). A branch of that snapshot adopts one of them
//! ([`adopt`]: relabelled and re-owned in one write guarded by the Pod's
//! resourceVersion, so two branches never adopt one Pod) instead of getting a Pod of its
//! own; the agent then thaws the branch already living in it. The pool refills with new
//! Pods.

use std::collections::BTreeSet;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::{Resource, ResourceExt};
use ramify_crds::pod::{
    ANNOTATION_POD_TEMPLATE, LABEL_SANDBOX_UID, MANAGER_OPERATOR_POD, Mode,
    REASON_WARM_POOL_UNAVAILABLE, warm_pod_name,
};
use ramify_crds::{Sandbox, Snapshot};
use serde_json::json;
use tracing::{debug, info};

use crate::context::Context;
use crate::error::{Error, Result};

/// How soon a pool is looked at again without an event (Pod events and the agent's
/// `status.warm` writes wake it at once).
const KEEP_RECHECK: Duration = Duration::from_secs(30);
/// How soon Pods the API server refused (a ResourceQuota may free) are tried again.
const REFUSED_RETRY: Duration = Duration::from_secs(10);
/// Names tried for new pool Pods in one look, past those the cache shows taken: a
/// Pod of a free-looking name may exist unseen (another owner's, or not cached yet).
/// Four times the largest pool, and some.
const NAME_TRIES: u32 = 4 * 32 + 64;
/// The cached Pods of `ns` (ramify's: the Pod watch selects only those).
pub(crate) fn pods_in(ctx: &Context, ns: &str) -> Vec<Pod> {
    ctx.cache
        .pods
        .state()
        .iter()
        .filter_map(|g| g.0.as_ref().ok())
        .filter(|p| p.metadata.namespace.as_deref() == Some(ns))
        .cloned()
        .collect()
}

/// A Ready Snapshot in cluster mode: creates its missing pool Pods and deletes the
/// extra ones (those without a ready branch first). Returns how soon to look again.
/// Pods that cannot be made count as a failure of `controller` (the caller).
pub async fn keep(
    snap: &Snapshot,
    ctx: &Context,
    controller: &'static str,
) -> Result<Option<Duration>> {
    if ctx.settings.mode != Mode::Cluster {
        return Ok(None);
    }
    let want = snap
        .spec
        .warm_pool
        .as_ref()
        .map_or(0, |w| usize::try_from(w.size).unwrap_or(0));
    let status = snap.status.clone().unwrap_or_default();
    let (Some(uid), Some(node)) = (snap.uid(), status.node_name.clone()) else {
        return Ok(None);
    };
    let ns = snap.namespace().unwrap_or_default();
    ctx.cache.pods_synced().await?;
    let all = pods_in(ctx, &ns);
    let mut pool: Vec<&Pod> = all
        .iter()
        .filter(|p| crate::pod::in_pool_of(p, &uid) && p.metadata.deletion_timestamp.is_none())
        .collect();
    if pool.is_empty() && want == 0 {
        return Ok(None);
    }
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    let ready: BTreeSet<String> = status
        .warm
        .as_ref()
        .map(|w| w.pods.iter().cloned().collect())
        .unwrap_or_default();
    if pool.len() > want {
        // Those without a ready branch go first, then the newest names.
        pool.sort_by_key(|p| {
            (
                ready.contains(&p.name_any()),
                std::cmp::Reverse(p.name_any()),
            )
        });
        for p in &pool[..pool.len() - want] {
            let dp = DeleteParams {
                preconditions: Some(Preconditions {
                    uid: p.uid(),
                    resource_version: None,
                }),
                ..DeleteParams::background()
            };
            match pods.delete(&p.name_any(), &dp).await {
                Ok(_) => debug!(pod = %p.name_any(), "warm pool Pod deleted (pool shrank)"),
                Err(e) if gone_or_changed(&e) => {}
                Err(e) => return Err(e.into()),
            }
        }
        return Ok(Some(KEEP_RECHECK));
    }
    if pool.len() < want {
        let Some(source) = ctx.cache.sandbox(&ns, &snap.spec.source.sandbox) else {
            unavailable(
                controller,
                snap,
                ctx,
                format!(
                    "its source sandbox {} is gone, and pool Pods are built as its branches' Pods would be",
                    snap.spec.source.sandbox
                ),
            )
            .await;
            return Ok(Some(KEEP_RECHECK));
        };
        let image = ctx
            .settings
            .pod_image
            .as_deref()
            .ok_or_else(|| Error::Invalid("cluster mode without a pod image".into()))?;
        let taken: BTreeSet<String> = all.iter().map(ResourceExt::name_any).collect();
        let mut missing = want - pool.len();
        let params = PostParams {
            field_manager: Some(MANAGER_OPERATOR_POD.into()),
            ..Default::default()
        };
        for n in 0..NAME_TRIES {
            if missing == 0 {
                break;
            }
            let name = warm_pod_name(&snap.name_any(), n);
            if taken.contains(&name) {
                continue;
            }
            let pod = crate::pod::build_pool(snap, &source, image, &node, n)?;
            match pods.create(&params, &pod).await {
                Ok(_) => missing -= 1,
                // Not in the cache: someone's, or ours and not seen yet. The next name.
                Err(kube::Error::Api(e)) if e.code == 409 => {}
                Err(kube::Error::Api(e)) if matches!(e.code, 400 | 403 | 422) => {
                    unavailable(controller, snap, ctx, e.message).await;
                    return Ok(Some(REFUSED_RETRY));
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
    Ok(Some(KEEP_RECHECK))
}

/// A Warning Event on `snap`: its pool Pods cannot be made (never a silent fallback:
/// its branches restore cold in Pods of their own meanwhile).
async fn unavailable(controller: &'static str, snap: &Snapshot, ctx: &Context, why: String) {
    ctx.metrics
        .failures
        .get_or_create(&crate::metrics::FailureLabels {
            controller: controller.into(),
            error: "warm_pool_unavailable".into(),
        })
        .inc();
    ctx.event(
        &snap.object_ref(&()),
        true,
        REASON_WARM_POOL_UNAVAILABLE,
        format!("warm pool Pods cannot be created: {why}"),
    )
    .await;
}

/// A Pod `sbx` adopted earlier: remembered, or seen so by the Pod watch.
pub fn adopted_before(sbx: &Sandbox, ctx: &Context) -> Option<Pod> {
    let uid = sbx.uid()?;
    let ns = sbx.namespace().unwrap_or_default();
    let cached = pods_in(ctx, &ns)
        .into_iter()
        .find(|p| crate::pod::is_of(p, sbx) && p.labels().get(LABEL_SANDBOX_UID) == Some(&uid));
    cached.or_else(|| ctx.adopted.of(&uid))
}

/// Adopts a ready pool Pod of `sbx`'s snapshot for it, when there is one built as its
/// own Pod would be (on `pinned`, when it must be on a node): relabelled as its Pod and
/// re-owned by it in one merge patch guarded by the Pod's resourceVersion. Siblings
/// start at different Pods (by branch index); a lost race tries the next one.
pub async fn adopt(sbx: &Sandbox, ctx: &Context, pinned: Option<&str>) -> Result<Option<Pod>> {
    let Some(rf) = &sbx.spec.restore_from else {
        return Ok(None);
    };
    let ns = sbx.namespace().unwrap_or_default();
    let Some(snap) = ctx.cache.snapshot(&ns, &rf.snapshot) else {
        return Ok(None);
    };
    let (Some(snap_uid), Some(sbx_uid)) = (snap.uid(), sbx.uid()) else {
        return Ok(None);
    };
    let ready: BTreeSet<String> = snap
        .status
        .as_ref()
        .and_then(|s| s.warm.as_ref())
        .map(|w| w.pods.iter().cloned().collect())
        .unwrap_or_default();
    if ready.is_empty() {
        return Ok(None);
    }
    let template = crate::pod::template_of(sbx);
    let mut candidates: Vec<Pod> = pods_in(ctx, &ns)
        .into_iter()
        .filter(|p| {
            ready.contains(&p.name_any())
                && crate::pod::in_pool_of(p, &snap_uid)
                && p.metadata.deletion_timestamp.is_none()
                && p.annotations().get(ANNOTATION_POD_TEMPLATE) == Some(&template)
                && pinned.is_none_or(|n| crate::pod::node_of(p) == Some(n))
                && !p.uid().is_some_and(|u| ctx.adopted.taken(&u))
        })
        .collect();
    if candidates.is_empty() {
        return Ok(None);
    }
    candidates.sort_by_key(ResourceExt::name_any);
    let index = rf
        .branch
        .as_ref()
        .map_or(0, |b| usize::try_from(b.index).unwrap_or(0));
    let start = index % candidates.len();
    candidates.rotate_left(start);
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    let params = PatchParams {
        field_manager: Some(MANAGER_OPERATOR_POD.into()),
        ..Default::default()
    };
    for pod in candidates {
        let mut body = crate::handover::patch(sbx, &pod)?;
        // Two branches racing for one Pod: the second write fails (409) and tries the
        // next Pod.
        body["metadata"]["resourceVersion"] = json!(pod.resource_version());
        match pods
            .patch(&pod.name_any(), &params, &Patch::Merge(&body))
            .await
        {
            Ok(adopted) => {
                ctx.adopted.record(&sbx_uid, adopted.clone());
                ctx.metrics.warm_pods_adopted.inc();
                info!(sandbox = %sbx.name_any(), pod = %adopted.name_any(), "adopted a warm pool Pod");
                return Ok(Some(adopted));
            }
            Err(e) if gone_or_changed(&e) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Ok(None)
}

/// A write on a Pod that is gone (404) or changed meanwhile (409).
fn gone_or_changed(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 404 || s.code == 409)
}
