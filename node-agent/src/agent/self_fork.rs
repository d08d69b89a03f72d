//! Self-forks, node side: serving the `/run/ramify/fork` requests of this node's
//! sandboxes (see [`ramify_engine::self_fork`] for the file protocol).
//!
//! One loop for the whole node, woken at once when a `fork` file is written in a
//! running sandbox's control directory (inotify, `self_fork_wake.rs`) and every
//! [`POLL`] regardless: for each running sandbox it stats one file (`fork`) in its
//! control directory, or, while a request is pending, looks its BranchSet up in the
//! watch cache. An accepted request goes into the Sandbox's
//! `status.selfFork.pending` (the operator creates the BranchSet from it); when that
//! BranchSet ends without a winner the original's `fork-result` says so and it goes
//! on; when a branch won, the winner is the workspace already (a Full commit) and the
//! request is simply cleared. A branch learns its name from its own `fork-result`,
//! written when it is restored ([`Agent::announce_self_fork_branch`]).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::reflector::ObjectRef;
use ramify_crds::{
    BranchSetPhase, LABEL_SELF_FORK_DEPTH, MANAGER_AGENT_SELF_FORK, Sandbox as SandboxObj,
    SandboxPhase, SelfForkRequest, self_fork_name,
};
use serde_json::{Value, json};
use tracing::{info, warn};

use super::{Agent, writes};
use crate::error::{Error, Result};
use ramify_engine::engine::LocalSandbox;
use ramify_engine::self_fork as proto;

/// How often the control directories are looked at.
pub const POLL: Duration = Duration::from_millis(250);
/// How long a request that does not parse must stay the same before it is refused.
const UNPARSED_GRACE: Duration = Duration::from_secs(1);
/// How long a pending request's BranchSet may be missing from the cache before the
/// API server is asked whether it still exists (the operator creates it after the
/// request is recorded).
const MISSING_GRACE: Duration = Duration::from_secs(20);

impl Agent {
    /// Serves self-fork requests until the agent stops.
    pub(super) async fn sweep_self_forks(self: Arc<Self>) {
        let mut missing: HashMap<String, Instant> = HashMap::new();
        let mut unparsed: HashMap<String, (Vec<u8>, Instant)> = HashMap::new();
        let mut wake = super::self_fork_wake::ForkWake::new();
        loop {
            wake.wait(POLL).await;
            let Some(cache) = self.cache.get() else {
                continue;
            };
            let mut seen = HashSet::new();
            let mut dirs = HashSet::new();
            for store in [&cache.bound, &cache.pinned] {
                for o in store.state() {
                    let Ok(obj) = &o.0 else { continue };
                    let Some(uid) = obj.uid() else { continue };
                    if !seen.insert(uid.clone()) {
                        continue;
                    }
                    if let Err(e) = self
                        .self_fork_step(obj, &uid, &mut missing, &mut unparsed, &mut dirs)
                        .await
                    {
                        warn!(sandbox = %obj.name_any(), error = %e, "serving a self-fork failed; retrying");
                    }
                }
            }
            wake.watch_only(&dirs);
            self.tidy_ahead(&seen).await;
            missing.retain(|uid, _| seen.contains(uid));
            unparsed.retain(|uid, _| seen.contains(uid));
        }
    }

    async fn self_fork_step(
        &self,
        obj: &SandboxObj,
        uid: &str,
        missing: &mut HashMap<String, Instant>,
        unparsed: &mut HashMap<String, (Vec<u8>, Instant)>,
        watch: &mut HashSet<std::path::PathBuf>,
    ) -> Result<()> {
        let status = obj.status.clone().unwrap_or_default();
        if status.phase != SandboxPhase::Running || obj.metadata.deletion_timestamp.is_some() {
            return Ok(());
        }
        let Some(h) = self.handle(uid) else {
            return Ok(());
        };
        // Busy (a command, a snapshot, a commit): next time.
        let Some(dir) = h
            .try_lock()
            .ok()
            .and_then(|g| g.as_ref().map(LocalSandbox::control_dir))
        else {
            return Ok(());
        };
        watch.insert(dir.clone());
        let sf = status.self_fork.clone().unwrap_or_default();
        if let Some(pending) = &sf.pending {
            return self
                .settle_pending(obj, uid, &dir, sf.requests, pending, missing)
                .await;
        }
        let bytes = match ramify_engine::control::read_bounded(
            &dir,
            proto::REQUEST_FILE,
            proto::MAX_REQUEST_BYTES,
        ) {
            Ok(None) => return Ok(()),
            Ok(Some(b)) => Ok(b),
            Err(r) => Err(r.to_string()),
        };
        // A request caught half-written (`echo ... > fork` truncates, then writes) is
        // read again; only one that stays the same and unreadable for UNPARSED_GRACE is
        // refused. Two reads in a row are not enough: the sandbox's write may reach the
        // node's file a while after its truncation (seen: a request refused as empty
        // when two wake-ups came before the write landed).
        if let Ok(b) = &bytes {
            if proto::parse_request(b).is_err() {
                let since = match unparsed.get(uid) {
                    Some((seen, at)) if seen == b => *at,
                    _ => {
                        unparsed.insert(uid.to_string(), (b.clone(), Instant::now()));
                        return Ok(());
                    }
                };
                if since.elapsed() < UNPARSED_GRACE {
                    return Ok(());
                }
            }
            unparsed.remove(uid);
        }
        // Taken out before anything is recorded: a crash from here on loses the request,
        // never forks it twice; the mark tells the restarted agent to say so.
        self.mark_taken(uid, Some(sf.requests + 1))?;
        ramify_engine::control::remove_entry(&dir.join(proto::REQUEST_FILE))
            .map_err(|e| Error::io("remove the fork request", &dir, e))?;
        let accepted = bytes.and_then(|b| self.accept(obj, sf.requests, &b));
        let req = match accepted {
            Ok(req) => req,
            Err(why) => {
                self.refuse(obj, &dir, &why).await?;
                return self.mark_taken(uid, None);
            }
        };
        // Captured and its branches restoring before anything is recorded: the
        // records follow (fork_ahead.rs).
        self.fork_ahead(obj, &h, &req).await;
        let ns = obj.namespace().unwrap_or_default();
        let api: Api<SandboxObj> = Api::namespaced(self.client.clone(), &ns);
        let body = json!({"selfFork": {"requests": req.number, "pending": req}});
        if let Err(e) =
            writes::status(&api, &obj.name_any(), MANAGER_AGENT_SELF_FORK, None, &body).await
        {
            self.settle_ahead(&ns, &req).await;
            self.refuse(
                obj,
                &dir,
                &format!("could not record the request ({e}); ask again"),
            )
            .await?;
            return self.mark_taken(uid, None);
        }
        self.mark_taken(uid, None)?;
        info!(sandbox = %obj.name_any(), branchset = %req.branch_set, branches = ?req.branches, depth = req.depth, "self-fork accepted");
        self.event(
            obj,
            false,
            "SelfFork",
            format!(
                "the workload forked itself {} ways ({}): BranchSet {}",
                req.branches.len(),
                req.branches.join(", "),
                req.branch_set
            ),
        )
        .await;
        Ok(())
    }

    /// Records (`Some(number)`) or clears the request taken out and not yet recorded.
    fn mark_taken(&self, uid: &str, number: Option<i64>) -> Result<()> {
        self.registry
            .update_sandbox(uid, |r| r.self_fork_taken = number)?;
        Ok(())
    }

    /// At start-up, for a sandbox re-adopted live: a request the last agent took out of
    /// its control directory but never recorded (it stopped in between) is answered,
    /// so the workload does not wait for ever. Nothing of it was forked.
    pub(super) async fn answer_lost_request(&self, obj: &SandboxObj, uid: &str, sb: &LocalSandbox) {
        let Ok(Some(rec)) = self.registry.sandbox(uid) else {
            return;
        };
        let Some(number) = rec.self_fork_taken else {
            return;
        };
        let recorded = obj
            .status
            .as_ref()
            .and_then(|s| s.self_fork.as_ref())
            .is_some_and(|f| f.requests >= number);
        if !recorded {
            let why = "the node agent restarted while it took this fork request: nothing was forked; ask again";
            if let Err(e) = self.refuse(obj, &sb.control_dir(), why).await {
                warn!(sandbox = %obj.name_any(), error = %e, "answering a fork request lost to a restart failed");
                return;
            }
        }
        if let Err(e) = self.mark_taken(uid, None) {
            warn!(sandbox = %obj.name_any(), error = %e, "clearing a taken fork request failed");
        }
    }

    /// Checks a request against the Sandbox's `spec.selfFork`; the refusal says why.
    fn accept(
        &self,
        obj: &SandboxObj,
        requests: i64,
        bytes: &[u8],
    ) -> std::result::Result<SelfForkRequest, String> {
        let Some(cfg) = &obj.spec.self_fork else {
            return Err(format!(
                "self-fork is off for Sandbox {}: set spec.selfFork (maxBranches, maxDepth) to allow it",
                obj.name_any()
            ));
        };
        let req = proto::parse_request(bytes).map_err(|r| r.to_string())?;
        let max = usize::try_from(cfg.max_branches).unwrap_or(0);
        if req.count() > max {
            return Err(format!(
                "asked for {} branches; spec.selfFork.maxBranches is {max}",
                req.count()
            ));
        }
        // A branch of a self-fork carries its set's depth; forking it nests one deeper.
        let depth = obj
            .labels()
            .get(LABEL_SELF_FORK_DEPTH)
            .and_then(|d| d.parse::<i32>().ok())
            .unwrap_or(0)
            + 1;
        if depth > cfg.max_depth {
            return Err(format!(
                "this fork would nest {depth} deep; spec.selfFork.maxDepth is {}",
                cfg.max_depth
            ));
        }
        let number = requests + 1;
        let branch_set = self_fork_name(&obj.name_any(), number);
        // The set's name is a label value of its children: at most 63 characters.
        if branch_set.len() > 63 {
            return Err(format!(
                "Sandbox name {} is too long for a self-fork: its BranchSet {branch_set} would exceed 63 characters",
                obj.name_any()
            ));
        }
        Ok(SelfForkRequest {
            number,
            branch_set,
            branches: req.names(),
            depth,
        })
    }

    async fn refuse(&self, obj: &SandboxObj, dir: &std::path::Path, why: &str) -> Result<()> {
        warn!(sandbox = %obj.name_any(), why, "self-fork refused");
        proto::write_result(dir, &proto::refused_result(why))
            .map_err(|e| Error::io("write the fork result", dir, e))?;
        self.event(obj, true, "SelfForkRefused", why.to_string())
            .await;
        Ok(())
    }

    /// A pending request: answered and cleared once its BranchSet ended.
    async fn settle_pending(
        &self,
        obj: &SandboxObj,
        uid: &str,
        dir: &std::path::Path,
        requests: i64,
        pending: &SelfForkRequest,
        missing: &mut HashMap<String, Instant>,
    ) -> Result<()> {
        let ns = obj.namespace().unwrap_or_default();
        let cached = self.cache.get().and_then(|c| {
            c.branchsets
                .get(&ObjectRef::new(&pending.branch_set).within(&ns))
                .and_then(|b| b.0.as_ref().ok().cloned())
        });
        let result: Option<Value> = match cached {
            Some(bs) => {
                missing.remove(uid);
                let st = bs.status.clone().unwrap_or_default();
                match st.phase {
                    // The winner is the workspace now: nothing to tell the original.
                    BranchSetPhase::Committed => None,
                    BranchSetPhase::Exhausted
                    | BranchSetPhase::Failed
                    | BranchSetPhase::Conflict => {
                        let message = st
                            .conditions
                            .iter()
                            .find(|c| c.type_ == "Ready")
                            .map(|c| c.message.clone())
                            .unwrap_or_default();
                        Some(proto::no_winner_result(
                            &pending.branch_set,
                            &format!("{:?}", st.phase),
                            &message,
                        ))
                    }
                    _ => return Ok(()),
                }
            }
            None => {
                let since = *missing.entry(uid.to_string()).or_insert_with(Instant::now);
                if since.elapsed() < MISSING_GRACE {
                    return Ok(());
                }
                let api: Api<ramify_crds::BranchSet> = Api::namespaced(self.client.clone(), &ns);
                if writes::within(
                    "get the self-fork's BranchSet",
                    api.get_opt(&pending.branch_set),
                )
                .await?
                .is_some()
                {
                    // Not labelled with this node yet: the operator binds it first.
                    missing.insert(uid.to_string(), Instant::now());
                    return Ok(());
                }
                missing.remove(uid);
                Some(proto::refused_result(&format!(
                    "BranchSet {} was deleted before any branch committed",
                    pending.branch_set
                )))
            }
        };
        if let Some(r) = &result {
            proto::write_result(dir, r).map_err(|e| Error::io("write the fork result", dir, e))?;
        }
        self.settle_ahead(&ns, pending).await;
        let api: Api<SandboxObj> = Api::namespaced(self.client.clone(), &ns);
        writes::status(
            &api,
            &obj.name_any(),
            MANAGER_AGENT_SELF_FORK,
            None,
            &json!({"selfFork": {"requests": requests}}),
        )
        .await?;
        info!(sandbox = %obj.name_any(), branchset = %pending.branch_set, answered = result.is_some(), "self-fork settled");
        Ok(())
    }

    /// Tells a restored branch of a self-fork which branch it is (its `fork-result`).
    pub(super) fn announce_self_fork_branch(
        &self,
        sb: &LocalSandbox,
        branch: &ramify_crds::BranchRef,
    ) -> Result<()> {
        if !branch.self_fork {
            return Ok(());
        }
        let dir = sb.control_dir();
        // The request the source wrote may still have been open when it was captured
        // (a capture right after the request is read: fork_ahead.rs), and the restore
        // opens it again here, empty: read as this branch's own request, it would be
        // refused, and that refusal would be the branch's answer.
        ramify_engine::control::remove_entry(&dir.join(proto::REQUEST_FILE))
            .map_err(|e| Error::io("remove the source's fork request", &dir, e))?;
        proto::write_result(
            &dir,
            &proto::branch_result(&branch.branch_set, &branch.name, branch.index),
        )
        .map_err(|e| Error::io("write the fork result", &dir, e))
    }
}
