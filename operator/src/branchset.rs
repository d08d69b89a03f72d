//! BranchSet reconciler: observes, asks `plan` what to do, and does it. The status is
//! written with server-side apply carrying the resourceVersion that was read, so a
//! winner is recorded by exactly one write even across operator replicas and restarts
//! (and the schema refuses any later change of `status.winner`).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::core::DeserializeGuard;
use kube::runtime::controller::Action;
use kube::{Resource, ResourceExt};
use ramify_crds::capacity::CONDITION_READY;
use ramify_crds::{
    BranchPhase, BranchSet, LABEL_BRANCHSET, LABEL_NODE, MANAGER_OPERATOR_NODE_LOST,
    REASON_NODE_LOST, Sandbox, SandboxPhase, Snapshot,
};
use serde_json::json;
use tracing::{debug, instrument, warn};

use crate::context::Context;
use crate::error::{Result, is_not_found};
use crate::expectations;
use crate::plan::{self, Observed};

mod never_fits;
pub use never_fits::{may_never_fit, never_fits};

pub const CONTROLLER: &str = "branchset";

/// Reconciles one BranchSet.
#[instrument(skip_all, fields(branchset = %obj.name_any(), ns = obj.namespace().unwrap_or_default()))]
pub async fn reconcile(obj: Arc<DeserializeGuard<BranchSet>>, ctx: Arc<Context>) -> Result<Action> {
    let started = Instant::now();
    let res = match &obj.0 {
        Ok(bs) => reconcile_branchset(bs, &ctx).await,
        Err(invalid) => {
            crate::report_invalid(&ctx, "BranchSet", invalid).await;
            Ok(Action::await_change())
        }
    };
    ctx.metrics.reconciled(CONTROLLER, started.elapsed());
    res
}

async fn reconcile_branchset(bs: &BranchSet, ctx: &Context) -> Result<Action> {
    if bs.metadata.deletion_timestamp.is_some() {
        // Children go with ownerReferences (garbage collection).
        crate::metrics::set_phase_opt(
            &ctx.metrics,
            "BranchSet",
            None,
            &bs.namespace().unwrap_or_default(),
            &bs.name_any(),
        );
        return Ok(Action::await_change());
    }
    // An ended set whose ttlSecondsAfterFinished passed is deleted and nothing more.
    let ttl_left = match crate::ttl::due(bs) {
        Some(_) => match crate::ttl::expire(ctx, bs).await? {
            Some(left) => Some(left),
            None => return Ok(Action::await_change()),
        },
        None => None,
    };
    let ns = bs.namespace().unwrap_or_default();
    let name = bs.name_any();
    let sandboxes: Api<Sandbox> = Api::namespaced(ctx.client.clone(), &ns);
    let snapshots: Api<Snapshot> = Api::namespaced(ctx.client.clone(), &ns);

    // Observe.
    let snap_name = match (&bs.spec.source.sandbox, &bs.spec.source.snapshot) {
        (_, Some(s)) => s.clone(),
        _ => plan::snapshot_name(&name),
    };
    // Read from the informer cache: no API round trip on the fork's critical path.
    ctx.cache.synced().await?;
    let snapshot = ctx.cache.snapshot(&ns, &snap_name);
    let mut branches = ctx.cache.sandboxes_labelled(&ns, LABEL_BRANCHSET, &name);
    let uid = bs.metadata.uid.clone().unwrap_or_default();
    for b in &branches {
        ctx.expectations
            .observed(&expectations::key(&uid, &b.name_any()));
    }
    if snapshot.is_some() {
        ctx.expectations
            .observed(&expectations::key(&uid, &snap_name));
    }
    let parent_name = bs
        .spec
        .source
        .sandbox
        .clone()
        .or_else(|| snapshot.as_ref().map(|s| s.spec.source.sandbox.clone()));
    let parent = parent_name.and_then(|p| ctx.cache.sandbox(&ns, &p));
    // The agent of the parent's node watches only BranchSets labelled with it: label
    // first, so it sees this one before any branch of it exists.
    if let Some(node) = parent.as_ref().and_then(|p| {
        // A branch (the parent of a nested set) is pinned by its spec.
        p.status
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .or_else(|| p.spec.node_name.clone())
    }) && bs.labels().get(LABEL_NODE) != Some(&node)
    {
        label_node(ctx, bs, &node).await?;
        return Ok(Action::await_change()); // the label write is a change: seen again
    }
    // A branch the status says existed but the cache lacks is either gone or not yet
    // seen by this watch (a new leader's cache may trail the old leader's writes). A
    // vanished branch fails for good, so confirm with the API server before deciding.
    for sbx in to_confirm(bs, &branches) {
        if let Some(live) = sandboxes.get_opt(&sbx).await? {
            branches.push(live);
        }
    }
    let agents = node_agents(ctx, bs, &branches).await?;
    let nodes = placement_nodes(bs, &agents);
    let lost = lost_nodes(&agents, ctx.settings.branch_node_lost_grace);
    let cluster_mode = ctx.settings.mode == ramify_crds::pod::Mode::Cluster;
    // Looked at only while it may decide something: standalone mode (in cluster mode
    // the scheduler places the Pods), no winner, no branch admitted.
    let never_fits = if cluster_mode || !may_never_fit(bs, &branches) {
        None
    } else {
        let (sbx_state, _) = ctx.cache.everything();
        let all: Vec<&Sandbox> = sbx_state.iter().filter_map(|g| g.0.as_ref().ok()).collect();
        never_fits(bs, snapshot.as_ref(), parent.as_ref(), &agents, &all)
    };
    let mut plan = plan::plan(&Observed {
        bs,
        snapshot: snapshot.as_ref(),
        parent: parent.as_ref(),
        branches: &branches,
        nodes: &nodes,
        lost_nodes: &lost,
        cluster_mode,
        never_fits: never_fits.as_deref(),
        now: Timestamp::now(),
    });

    // What this operator created and its watch has not shown yet is not created again
    // (it would be answered 409, and each branch bound again).
    plan.create_branches.retain(|b| {
        !ctx.expectations
            .pending(&expectations::key(&uid, &b.name_any()))
    });
    if plan.create_snapshot.as_ref().is_some_and(|s| {
        ctx.expectations
            .pending(&expectations::key(&uid, &s.name_any()))
    }) {
        plan.create_snapshot = None;
    }

    // Write the status first: the winner is decided by this write succeeding.
    let old = bs.status.clone().unwrap_or_default();
    let mut resource_version = bs.resource_version();
    // Creating branches decides nothing (creation is idempotent and a branch that
    // existed is never re-created), so while there is no winner they go out with the
    // status write instead of after it: this is the fork's critical path.
    let fork_now = plan.status.winner.is_none() && !plan.create_branches.is_empty();
    let (written, forked) = if plan.status != old {
        let write = write_status(ctx, bs, resource_version.clone(), &plan.status);
        if fork_now {
            let (w, f) = futures::join!(
                write,
                create_branches(ctx, &uid, &sandboxes, &plan.create_branches)
            );
            (Some(w), Some(f))
        } else {
            (Some(write.await), None)
        }
    } else {
        (None, None)
    };
    if let Some(f) = forked {
        f?;
    }
    if let Some(written) = written {
        match written {
            Ok(rv) => resource_version = rv,
            Err(e) if e.is_conflict() => {
                if old.winner.is_none() && plan.status.winner.is_some() {
                    ctx.metrics.commit_conflicts.inc();
                }
                return Err(e);
            }
            Err(e) => return Err(e),
        }
    }
    crate::metrics::set_phase(
        &ctx.metrics,
        "BranchSet",
        &format!("{:?}", plan.status.phase),
        &ns,
        &name,
    );
    if let Some(d) = plan.forked_after {
        ctx.metrics.fork_latency.observe(d.as_secs_f64());
        let warm = plan.status.branches.iter().filter(|b| b.warm).count() as u64;
        ctx.metrics.warm_hits.inc_by(warm);
        ctx.metrics
            .warm_misses
            .inc_by(plan.status.branches.len() as u64 - warm);
    }
    if let Some(d) = plan.invalidated_after {
        ctx.metrics.invalidation_latency.observe(d.as_secs_f64());
    }
    let reference = bs.object_ref(&());
    for note in &plan.notes {
        ctx.event(&reference, note.warning, note.reason, note.message.clone())
            .await;
    }
    // After the Events: what the status write above decided is announced even when an
    // effect runs next (this reconcile ends there, and the next one decides nothing new).
    if let Some(action) = release_next_effect(ctx, bs, resource_version, &plan.status).await? {
        return Ok(action);
    }

    // Act: deletions first (losers go at once, all together), then creations.
    let deletions = plan.delete_branches.iter().map(|sbx| {
        let sandboxes = &sandboxes;
        async move {
            match sandboxes.delete(sbx, &DeleteParams::background()).await {
                Ok(_) => {
                    debug!(sandbox = %sbx, "deleted branch");
                    Ok(())
                }
                Err(e) if is_not_found(&e) => Ok(()),
                Err(e) => Err(e),
            }
        }
    });
    futures::future::try_join_all(deletions).await?;
    fail_lost(ctx, &sandboxes, &branches, &plan.fail_lost).await?;
    abort_nested(ctx, &ns, &plan.invalidated_parents).await?;
    if let Some(snap) = &plan.create_snapshot {
        create_ignoring_exists(&snapshots, snap).await?;
        ctx.expectations
            .created(expectations::key(&uid, &snap.name_any()));
    }
    if !fork_now || plan.status == old {
        create_branches(ctx, &uid, &sandboxes, &plan.create_branches).await?;
    }
    let mut next = plan.requeue.unwrap_or(Duration::from_secs(300));
    if let Some(watch) = watch_nodes(&plan.status, &agents) {
        next = next.min(watch);
    }
    if let Some(left) = ttl_left {
        next = next.min(left + Duration::from_millis(100));
    }
    Ok(Action::requeue(next))
}

/// Creates branches, all in parallel: this is the fork's critical path (the node
/// agent starts each one when it sees it created, pinned by `spec.nodeName`). Then
/// binds them, all in parallel: the binding writes come after every create, so that
/// on a busy API server they do not hold up the later creates.
/// A set's branch creates (and bindings) in flight at once (client-go's default burst).
const WRITES_IN_FLIGHT: usize = 10;

async fn create_branches(
    ctx: &Context,
    bs_uid: &str,
    sandboxes: &Api<Sandbox>,
    branches: &[Sandbox],
) -> Result<()> {
    // Collected first: a stream over the closure is not Send for every lifetime.
    let creations: Vec<_> = branches
        .iter()
        .map(|sbx| async move {
            create_ignoring_exists(sandboxes, sbx).await?;
            ctx.expectations
                .created(expectations::key(bs_uid, &sbx.name_any()));
            Ok::<_, crate::error::Error>(())
        })
        .collect();
    // At most WRITES_IN_FLIGHT at once: a hundred creates at once (each through the
    // CRD's CEL rules) starve the API server's other clients for a moment; in a row of
    // ten they take about as long.
    futures::stream::iter(creations)
        .buffer_unordered(WRITES_IN_FLIGHT)
        .try_collect::<Vec<()>>()
        .await?;
    // Cluster mode: a branch is bound once its Pod is scheduled (pinned to the
    // snapshot's node), by the Sandbox reconciler, with `status.pod`; a binding written
    // here would race it and drop that.
    if ctx.settings.mode == ramify_crds::pod::Mode::Cluster {
        return Ok(());
    }
    let bindings: Vec<_> = branches
        .iter()
        .map(|sbx| bind_branch(sandboxes, sbx))
        .collect();
    futures::stream::iter(bindings)
        .buffer_unordered(WRITES_IN_FLIGHT)
        .try_collect::<Vec<_>>()
        .await?;
    Ok(())
}

/// The recorded branches whose sandbox the cache lacks and whose absence decides
/// something, to be confirmed with the API server (a new leader's cache may trail the
/// old leader's writes; a vanished branch fails for good). Only a branch still
/// `Forking` or `Running` is failed when its sandbox vanished, and an ended set only
/// cleans up what exists: asking about every other one (each loser after the winner,
/// every branch of an ended set) cost one GET after another on every reconcile, 871
/// answered 404 at 40 sets of 10.
pub fn to_confirm(bs: &BranchSet, cached: &[Sandbox]) -> Vec<String> {
    let Some(status) = bs.status.as_ref().filter(|s| !s.phase.is_ended()) else {
        return Vec::new();
    };
    status
        .branches
        .iter()
        .filter(|b| matches!(b.phase, BranchPhase::Forking | BranchPhase::Running))
        .filter_map(|b| b.sandbox.clone())
        .filter(|sbx| {
            !cached
                .iter()
                .any(|s| s.metadata.name.as_deref() == Some(sbx.as_str()))
        })
        .collect()
}

/// How often an undecided set looks at its branches' nodes without an event: a node
/// agent's death is no change of any object the set watches.
const UNDECIDED_REQUEUE: Duration = Duration::from_secs(15);
/// How often while a node carrying one of its undecided branches is not live: its
/// branches fail soon after the grace runs out.
const NODE_DOWN_REQUEUE: Duration = Duration::from_secs(2);

/// The node agents (through the lease cache), listed only while the set is undecided
/// and may still spread branches (`spec.placement`) or has branches whose node may be
/// lost, or is committing (its winner's node may be lost before it shipped the
/// winner); empty otherwise.
async fn node_agents(
    ctx: &Context,
    bs: &BranchSet,
    branches: &[Sandbox],
) -> Result<Vec<crate::nodes::NodeAgent>> {
    let decided = bs.status.as_ref().is_some_and(|s| {
        (s.winner.is_some() && s.phase != ramify_crds::BranchSetPhase::Committing)
            || s.phase.is_ended()
    });
    if decided || (bs.spec.placement.is_none() && branches.is_empty()) {
        return Ok(Vec::new());
    }
    ctx.nodes
        .list(&ctx.client, &ctx.settings.system_namespace)
        .await
}

/// The nodes a set with `spec.placement` spreads its branches over: those taking work
/// (live, not draining), by name.
fn placement_nodes(bs: &BranchSet, agents: &[crate::nodes::NodeAgent]) -> Vec<String> {
    if bs.spec.placement.is_none() {
        return Vec::new();
    }
    let mut nodes: Vec<String> = agents
        .iter()
        .filter(|a| a.takes_work())
        .map(|a| a.node.clone())
        .collect();
    nodes.sort();
    nodes
}

/// The nodes whose agent has been gone longer than `grace`, with how long: their
/// undecided branches fail (`NodeLost`).
pub fn lost_nodes(
    agents: &[crate::nodes::NodeAgent],
    grace: Duration,
) -> BTreeMap<String, Duration> {
    agents
        .iter()
        .filter_map(|a| Some((a.node.clone(), a.gone_for.filter(|g| *g > grace)?)))
        .collect()
}

/// When to look again at an undecided or committing set's nodes without an event:
/// every [`UNDECIDED_REQUEUE`], and every [`NODE_DOWN_REQUEUE`] while a node carrying
/// one of its undecided branches (or, committing, its winner) is not live. `None` once
/// the set ended, or is decided and not committing.
pub fn watch_nodes(
    status: &ramify_crds::BranchSetStatus,
    agents: &[crate::nodes::NodeAgent],
) -> Option<Duration> {
    if status.phase.is_ended() {
        return None;
    }
    let committing = status.phase == ramify_crds::BranchSetPhase::Committing;
    if status.winner.is_some() && !committing {
        return None;
    }
    let undecided: Vec<&ramify_crds::BranchStatus> = status
        .branches
        .iter()
        .filter(|b| match &status.winner {
            Some(w) => committing && &b.name == w,
            None => matches!(
                b.phase,
                BranchPhase::Pending | BranchPhase::Forking | BranchPhase::Running
            ),
        })
        .collect();
    if undecided.is_empty() {
        return None;
    }
    let down = undecided.iter().any(|b| {
        agents
            .iter()
            .any(|a| !a.live && b.node.as_deref() == Some(a.node.as_str()))
    });
    Some(if down {
        NODE_DOWN_REQUEUE
    } else {
        UNDECIDED_REQUEUE
    })
}

/// Fails each branch Sandbox whose node agent is gone for good: phase `Failed` and
/// `Ready=False` (`NodeLost`) as [`MANAGER_OPERATOR_NODE_LOST`] (its agent writes
/// nothing meanwhile, and on its return destroys the branch), guarded by the
/// resourceVersion read, so a verdict that landed meanwhile is never overwritten; and a
/// Warning Event on it. The set's status, written before, already records them failed.
async fn fail_lost(
    ctx: &Context,
    sandboxes: &Api<Sandbox>,
    branches: &[Sandbox],
    lost: &[plan::LostBranch],
) -> Result<()> {
    for l in lost {
        let Some(sbx) = branches
            .iter()
            .find(|s| s.metadata.name.as_deref() == Some(l.sandbox.as_str()))
        else {
            continue;
        };
        let mut conditions = Vec::new();
        ramify_crds::ConditionsExt::set_condition(
            &mut conditions,
            ramify_crds::Condition::new(
                CONDITION_READY,
                ramify_crds::ConditionStatus::False,
                REASON_NODE_LOST,
                l.message.clone(),
                sbx.metadata.generation,
            ),
            k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(Timestamp::now()),
        );
        let written = crate::writes::status(
            sandboxes,
            &l.sandbox,
            MANAGER_OPERATOR_NODE_LOST,
            sbx.metadata.resource_version.as_deref(),
            &json!({"phase": SandboxPhase::Failed, "conditions": conditions}),
        )
        .await;
        match written {
            Ok(_) => {}
            // Changed since read (a verdict, or its agent back): the next reconcile,
            // which that change triggers, looks again.
            Err(e) if e.is_conflict() => {
                debug!(sandbox = %l.sandbox, "branch changed before it was failed for its lost node");
                continue;
            }
            Err(crate::error::Error::Kube(e)) if is_not_found(&e) => continue,
            Err(e) => return Err(e),
        }
        warn!(sandbox = %l.sandbox, node = %l.node, "branch failed: its node agent is gone");
        ctx.metrics.branches_node_lost.inc();
        ctx.event(
            &sbx.object_ref(&()),
            true,
            REASON_NODE_LOST,
            l.message.clone(),
        )
        .await;
    }
    Ok(())
}

/// Sets the BranchSet's [`LABEL_NODE`] (server-side apply of that one label).
async fn label_node(ctx: &Context, bs: &BranchSet, node: &str) -> Result<()> {
    let api: Api<BranchSet> =
        Api::namespaced(ctx.client.clone(), &bs.namespace().unwrap_or_default());
    let body = json!({
        "apiVersion": ramify_crds::API_VERSION, "kind": "BranchSet",
        "metadata": {"name": bs.name_any(), "labels": {LABEL_NODE: node}},
    });
    let pp = kube::api::PatchParams::apply(ramify_crds::MANAGER_OPERATOR_NODE_LABEL).force();
    // A metadata write, not a status one: the same deadline as the status writer's.
    match tokio::time::timeout(
        crate::writes::WRITE_TIMEOUT,
        api.patch(&bs.name_any(), &pp, &kube::api::Patch::Apply(&body)),
    )
    .await
    {
        Ok(r) => r.map(|_| ()).map_err(crate::error::Error::from),
        Err(_) => Err(crate::error::Error::Timeout(
            "API write (node label)".into(),
        )),
    }
}

/// BranchSets nested under an invalidated branch abort with it: their branch sandboxes
/// are deleted now; their own reconcile (triggered by the parent's deletion) records
/// `Failed/ParentInvalidated`.
async fn abort_nested(ctx: &Context, ns: &str, parents: &[String]) -> Result<()> {
    if parents.is_empty() {
        return Ok(());
    }
    let api: Api<BranchSet> = Api::namespaced(ctx.client.clone(), ns);
    let sandboxes: Api<Sandbox> = Api::namespaced(ctx.client.clone(), ns);
    for nested in api.list(&ListParams::default()).await?.items {
        let nested_parent = nested.status.as_ref().and_then(|s| s.parent.clone());
        if nested_parent.is_some_and(|p| parents.contains(&p)) {
            let sel = format!("{LABEL_BRANCHSET}={}", nested.name_any());
            for sbx in sandboxes
                .list(&ListParams::default().labels(&sel))
                .await?
                .items
            {
                if sbx.metadata.deletion_timestamp.is_none() {
                    match sandboxes
                        .delete(&sbx.name_any(), &DeleteParams::background())
                        .await
                    {
                        Ok(_) => {}
                        // Gone already: what the deletion wanted. Anything else (403,
                        // 5xx, a timeout) fails the reconcile, which backs off and
                        // retries: a nested branch left running would outlive its parent.
                        Err(e) if is_not_found(&e) => {}
                        Err(e) => return Err(e.into()),
                    }
                }
            }
        }
    }
    Ok(())
}

async fn create_ignoring_exists<K>(api: &Api<K>, obj: &K) -> Result<()>
where
    K: Resource + Clone + serde::de::DeserializeOwned + serde::Serialize + std::fmt::Debug,
{
    match api.create(&PostParams::default(), obj).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Binds a new branch to its snapshot's node right away (the node agent watches
/// `status.nodeName`), instead of waiting for the Sandbox reconciler's own pass.
async fn bind_branch(api: &Api<Sandbox>, sbx: &Sandbox) -> Result<()> {
    let (Some(name), Some(node)) = (sbx.metadata.name.as_deref(), sbx.spec.node_name.as_deref())
    else {
        return Ok(());
    };
    let cond = ramify_crds::Condition::new(
        "Scheduled",
        ramify_crds::ConditionStatus::True,
        "Bound",
        format!("bound to node {node}, where its snapshot is"),
        Some(1),
    );
    let mut conditions = Vec::new();
    ramify_crds::ConditionsExt::set_condition(
        &mut conditions,
        cond,
        k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(Timestamp::now()),
    );
    crate::writes::status(
        api,
        name,
        ramify_crds::MANAGER_OPERATOR_SANDBOX_BINDING,
        None,
        &json!({"nodeName": node, "conditions": conditions}),
    )
    .await?;
    Ok(())
}

/// Writes the whole status, guarded by `resource_version`; returns the new one.
async fn write_status(
    ctx: &Context,
    bs: &BranchSet,
    resource_version: Option<String>,
    status: &ramify_crds::BranchSetStatus,
) -> Result<Option<String>> {
    let api: Api<BranchSet> =
        Api::namespaced(ctx.client.clone(), &bs.namespace().unwrap_or_default());
    let written = crate::writes::status(
        &api,
        &bs.name_any(),
        ramify_crds::MANAGER_OPERATOR_BRANCHSET,
        resource_version.as_deref(),
        status,
    )
    .await?;
    Ok(written.resource_version())
}

/// Executes the next released effect, one per reconcile: it is marked `Executing` (a
/// guarded write: one operator owns it) before the executor runs, and `Executed` or
/// `Failed` after. An operator that dies in between finds it `Executing` and runs it
/// again with the same identity (Job name, idempotency key), so it happens once.
async fn release_next_effect(
    ctx: &Context,
    bs: &BranchSet,
    resource_version: Option<String>,
    status: &ramify_crds::BranchSetStatus,
) -> Result<Option<Action>> {
    let Some(executor) = bs.spec.effects.as_ref().and_then(|e| e.executor.clone()) else {
        return Ok(None);
    };
    let Some(next) = plan::next_effect(status).cloned() else {
        return Ok(None);
    };
    let mut st = status.clone();
    // Claim it first with a write guarded by the resourceVersion this reconcile read,
    // on a retry too: a stale read (the watch cache trailing this operator's own last
    // write, which said Executed) then conflicts here, before anything runs, instead
    // of running the effect a second time. The message changes on every attempt, so
    // the claim is always a real write.
    let claim = if next.state == ramify_crds::EffectState::Released {
        "handed to the executor"
    } else {
        "handed to the executor again"
    };
    set_effect(
        &mut st,
        &next.id,
        ramify_crds::EffectState::Executing,
        claim.into(),
        None,
    );
    let rv = write_status(ctx, bs, resource_version, &st).await?;
    let outcome = crate::effects::execute(&ctx.client, bs, &executor, &next).await;
    let (state, message, job, requeue) = match outcome {
        crate::effects::Outcome::Executed { message, job } => (
            ramify_crds::EffectState::Executed,
            message,
            job,
            Duration::ZERO,
        ),
        crate::effects::Outcome::Refused(m) => {
            (ramify_crds::EffectState::Failed, m, None, Duration::ZERO)
        }
        crate::effects::Outcome::Retry(m) => (
            ramify_crds::EffectState::Executing,
            format!("will retry: {m}"),
            None,
            Duration::from_secs(2),
        ),
    };
    let warning = state == ramify_crds::EffectState::Failed;
    set_effect(&mut st, &next.id, state, message.clone(), job);
    write_status(ctx, bs, rv, &st).await?;
    ctx.event(
        &bs.object_ref(&()),
        warning,
        "Effect",
        format!("{}: {message}", next.id),
    )
    .await;
    Ok(Some(Action::requeue(requeue.max(Duration::from_millis(1)))))
}

fn set_effect(
    st: &mut ramify_crds::BranchSetStatus,
    id: &str,
    state: ramify_crds::EffectState,
    message: String,
    job: Option<String>,
) {
    if let Some(e) = st.effects.iter_mut().find(|e| e.id == id) {
        e.state = state;
        e.message = message;
        if job.is_some() {
            e.job = job;
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    pub(super) fn set(phase: &str, branches: &[(&str, &str)]) -> BranchSet {
        let branches: Vec<_> = branches
            .iter()
            .map(|(name, phase)| serde_json::json!({"name": name, "sandbox": format!("bs-{name}"), "phase": phase}))
            .collect();
        serde_json::from_value(serde_json::json!({
            "apiVersion": "ramify.dev/v1alpha1", "kind": "BranchSet",
            "metadata": {"name": "bs", "namespace": "ns", "uid": "u"},
            "spec": {"source": {"sandbox": "ws"}, "replicas": branches.len()},
            "status": {"phase": phase, "branches": branches},
        }))
        .unwrap()
    }

    pub(super) fn sandbox(name: &str) -> Sandbox {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "ramify.dev/v1alpha1", "kind": "Sandbox",
            "metadata": {"name": name, "namespace": "ns"},
            "spec": {"command": ["sh"]},
        }))
        .unwrap()
    }

    pub(super) fn agent(node: &str, gone_for: Option<u64>) -> crate::nodes::NodeAgent {
        crate::nodes::NodeAgent {
            node: node.into(),
            live: gone_for.is_none(),
            capacity: 4,
            allocatable: None,
            draining: None,
            gone_for: gone_for.map(Duration::from_secs),
        }
    }

    #[test]
    fn a_node_is_lost_once_its_agent_is_gone_past_the_grace() {
        let agents = [
            agent("live", None),
            agent("late", Some(59)),
            agent("gone", Some(61)),
        ];
        let lost = lost_nodes(&agents, Duration::from_secs(60));
        assert_eq!(
            lost.into_iter().collect::<Vec<_>>(),
            [("gone".to_string(), Duration::from_secs(61))]
        );
    }

    #[test]
    fn an_undecided_or_committing_set_looks_at_its_nodes_sooner_while_one_is_down() {
        let with_nodes = |phase: &str| {
            let mut bs = set(phase, &[("a", "Running"), ("b", "Failed")]);
            let st = bs.status.as_mut().unwrap();
            st.branches[0].node = Some("n1".into());
            st.branches[1].node = Some("n2".into());
            st.clone()
        };
        let running = with_nodes("Running");
        let up = [agent("n1", None), agent("n2", Some(5))];
        assert_eq!(watch_nodes(&running, &up), Some(UNDECIDED_REQUEUE));
        // n2 carries only an ended branch; n1 carries an undecided one.
        let down = [agent("n1", Some(1)), agent("n2", None)];
        assert_eq!(watch_nodes(&running, &down), Some(NODE_DOWN_REQUEUE));
        // Committing: only the winner's node counts (its agent may be lost before it
        // ships the winner).
        let mut committing = with_nodes("Committing");
        committing.winner = Some("a".into());
        assert_eq!(watch_nodes(&committing, &down), Some(NODE_DOWN_REQUEUE));
        committing.winner = Some("b".into());
        assert_eq!(watch_nodes(&committing, &down), Some(UNDECIDED_REQUEUE));
        let mut decided = with_nodes("Committed");
        decided.winner = Some("a".into());
        assert_eq!(watch_nodes(&decided, &down), None);
        assert_eq!(watch_nodes(&with_nodes("Exhausted"), &down), None);
    }

    #[test]
    fn only_undecided_branches_the_cache_lacks_are_confirmed_with_the_api_server() {
        let bs = set(
            "Running",
            &[
                ("a", "Forking"),
                ("b", "Running"),
                ("c", "Failed"),
                ("d", "Succeeded"),
                ("e", "Running"),
            ],
        );
        // e is cached; c (aborted) and d (decided) change nothing if they vanished.
        assert_eq!(to_confirm(&bs, &[sandbox("bs-e")]), vec!["bs-a", "bs-b"]);
        // A winner's losers are invalidated whether or not their sandboxes exist.
        let decided = set(
            "Committing",
            &[
                ("a", "Invalidated"),
                ("b", "Succeeded"),
                ("c", "Invalidated"),
            ],
        );
        assert!(to_confirm(&decided, &[]).is_empty());
        // An ended set cleans up what its cache holds; nothing to ask.
        let ended = set("Committed", &[("a", "Running"), ("b", "Won")]);
        assert!(to_confirm(&ended, &[]).is_empty());
        // No status yet: nothing recorded, nothing to confirm.
        let mut fresh = set("Pending", &[]);
        fresh.status = None;
        assert!(to_confirm(&fresh, &[]).is_empty());
    }
}
