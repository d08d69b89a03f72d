//! Checking the scale run's outcome (every Sandbox running, every BranchSet's expected
//! winner committed) and deleting everything, until nothing is left.

use super::*;

/// Checks the outcome: every Sandbox Running, and every BranchSet Committed with
/// exactly one winner, the expected one, committed into its parent. Returns a summary.
pub(super) async fn check_outcome(
    driver: &Client,
    ns: &str,
    cfg: &ScaleConfig,
) -> Result<String, ScaleError> {
    let sandboxes: Api<Sandbox> = Api::namespaced(driver.clone(), ns);
    let all = sandboxes
        .list(&ListParams::default())
        .await
        .map_err(api_call("listing Sandboxes"))?
        .items;
    let by_name: HashMap<String, &Sandbox> = all.iter().map(|s| (s.name_any(), s)).collect();
    let mut wrong = Vec::new();
    let own: Vec<&Sandbox> = all
        .iter()
        .filter(|s| !s.labels().contains_key(LABEL_BRANCHSET))
        .collect();
    if own.len() != cfg.sandboxes {
        wrong.push(format!(
            "{} Sandboxes exist, {} were created",
            own.len(),
            cfg.sandboxes
        ));
    }
    for s in &own {
        let phase = s.status.as_ref().map(|st| st.phase).unwrap_or_default();
        if phase != SandboxPhase::Running {
            wrong.push(format!("Sandbox {} is {phase:?}", s.name_any()));
        }
    }
    let sets = Api::<BranchSet>::namespaced(driver.clone(), ns)
        .list(&ListParams::default())
        .await
        .map_err(api_call("listing BranchSets"))?
        .items;
    if sets.len() != cfg.branchsets {
        wrong.push(format!(
            "{} BranchSets exist, {} were created",
            sets.len(),
            cfg.branchsets
        ));
    }
    let mut winners: BTreeMap<String, usize> = BTreeMap::new();
    for bs in &sets {
        let name = bs.name_any();
        let st = bs.status.clone().unwrap_or_default();
        let expected = bs
            .annotations()
            .get(ANNOTATION_SIMULATED_COMMIT_INDEX)
            .map(|k| format!("b{k}"));
        let won: Vec<&str> = st
            .branches
            .iter()
            .filter(|b| b.phase == BranchPhase::Won)
            .map(|b| b.name.as_str())
            .collect();
        let committed_verdicts = st
            .branches
            .iter()
            .filter(|b| b.verdict == Some(ramify_crds::VerdictValue::Commit))
            .count();
        if st.phase != BranchSetPhase::Committed {
            wrong.push(format!("BranchSet {name} is {:?}", st.phase));
        }
        if st.winner.is_none() || st.winner != expected {
            wrong.push(format!(
                "BranchSet {name}: winner {:?}, expected {expected:?}",
                st.winner
            ));
        }
        if won.len() != 1 || committed_verdicts != 1 {
            wrong.push(format!(
                "BranchSet {name}: {} branches Won ({won:?}), {committed_verdicts} commit verdicts",
                won.len()
            ));
        }
        if st.branches.len() != cfg.replicas {
            wrong.push(format!(
                "BranchSet {name}: {} branches in status",
                st.branches.len()
            ));
        }
        let parent = st.parent.as_deref().and_then(|p| by_name.get(p));
        let applied = parent
            .and_then(|p| p.status.as_ref())
            .and_then(|s| s.last_commit.as_ref());
        if applied.map(|c| (c.branch_set_uid.clone(), c.winner.clone()))
            != Some((
                bs.uid().unwrap_or_default(),
                st.winner.clone().unwrap_or_default(),
            ))
        {
            wrong.push(format!(
                "BranchSet {name}: its parent's lastCommit is {applied:?}"
            ));
        }
        if let Some(w) = st.winner {
            *winners.entry(w).or_default() += 1;
        }
    }
    if !wrong.is_empty() {
        let n = wrong.len();
        wrong.truncate(10);
        return Err(ScaleError::Check(format!(
            "{n} problems, the first: {}",
            wrong.join("; ")
        )));
    }
    Ok(format!(
        "{} Sandboxes Running; {} BranchSets Committed, each with exactly one winner, the expected one, in its parent (winners: {})",
        own.len(),
        sets.len(),
        winners
            .iter()
            .map(|(w, n)| format!("{w} x{n}"))
            .collect::<Vec<_>>()
            .join(", ")
    ))
}

/// Deletes every BranchSet, Snapshot and Sandbox of the run, as a user would.
pub(super) async fn delete_everything(driver: &Client, ns: &str) -> Result<(), ScaleError> {
    let dp = DeleteParams::background();
    let lp = ListParams::default();
    Api::<BranchSet>::namespaced(driver.clone(), ns)
        .delete_collection(&dp, &lp)
        .await
        .map_err(api_call("deleting the BranchSets"))?;
    Api::<Snapshot>::namespaced(driver.clone(), ns)
        .delete_collection(&dp, &lp)
        .await
        .map_err(api_call("deleting the Snapshots"))?;
    Api::<Sandbox>::namespaced(driver.clone(), ns)
        .delete_collection(&dp, &lp)
        .await
        .map_err(api_call("deleting the Sandboxes"))?;
    Ok(())
}

/// How many `K` exist in `ns`.
pub(super) async fn count<K>(driver: &Client, ns: &str) -> Result<usize, ScaleError>
where
    K: kube::Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    let list = Api::<K>::namespaced(driver.clone(), ns)
        .list_metadata(&ListParams::default())
        .await
        .map_err(api_call(format!("listing {}s", K::kind(&()))))?;
    Ok(list.items.len())
}

/// Waits until no Sandbox, Snapshot or BranchSet is left in `ns`; returns how many
/// are (0, or the count at the deadline).
pub(super) async fn wait_until_empty(
    driver: &Client,
    ns: &str,
    deadline: Instant,
) -> Result<usize, ScaleError> {
    loop {
        let left = count::<Sandbox>(driver, ns).await?
            + count::<Snapshot>(driver, ns).await?
            + count::<BranchSet>(driver, ns).await?;
        if left == 0 || Instant::now() > deadline {
            return Ok(left);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
