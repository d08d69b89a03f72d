//! Commit: Full (the winner's sandbox becomes the parent) and Paths (the winner's
//! changed files are copied into the parent, all or nothing), with the scripts a Paths
//! commit runs in the parent.

use std::path::Path;

use tracing::{info, instrument};

use super::{Engine, LocalSandbox};
use crate::cmd::Output;
use crate::control;
use crate::diff::{self, Diff, Manifest};
use crate::error::{Error, Result};

/// What a commit Paths did.
#[derive(Debug, Clone, Default)]
pub struct CommitReport {
    pub diff: Diff,
    pub bytes: u64,
    pub skipped: Vec<String>,
}

/// A Paths commit as planned from the winner, before it touches the parent.
#[derive(Debug, Clone)]
pub struct PathsCommit {
    /// What changed under the globs since the winner's restore.
    pub diff: Diff,
    /// Paths to copy (added and modified), sorted.
    copy: Vec<String>,
    /// The winner's manifest now: the tarball is checked against it.
    now: Manifest,
    skipped: Vec<String>,
}

impl PathsCommit {
    /// Every path the commit writes or deletes in the parent.
    pub fn paths(&self) -> Vec<String> {
        let mut p: Vec<String> = self
            .copy
            .iter()
            .cloned()
            .chain(self.diff.deleted.iter().map(|c| c.path.clone()))
            .collect();
        p.sort();
        p
    }
}

impl Engine {
    /// Regular files under the roots of `globs`, as seen inside the sandbox.
    pub async fn manifest(
        &self,
        sb: &LocalSandbox,
        globs: &[String],
    ) -> Result<(Manifest, Vec<String>)> {
        let roots = diff::glob_roots(globs)?;
        let mut argv: Vec<&str> = vec!["/bin/sh", "-c", diff::MANIFEST_SCRIPT, "ramify-manifest"];
        argv.extend(roots.iter().map(String::as_str));
        let out = self.exec_ok(sb, &argv).await?;
        let (m, _skipped) = diff::parse_manifest(&out.stdout_str())?;
        Ok((m, roots))
    }

    /// Commit Paths: copy the files the winner changed (since its restore) under the
    /// allowlisted globs into the parent, delete the ones it deleted, and report.
    #[instrument(skip(self, parent, winner), fields(parent = %parent.id, winner = %winner.id))]
    pub async fn commit_paths(
        &self,
        parent: &LocalSandbox,
        winner: &LocalSandbox,
        globs: &[String],
    ) -> Result<CommitReport> {
        let plan = self.plan_paths_commit(winner, globs).await?;
        self.apply_paths_commit(parent, winner, plan).await
    }

    /// The first step of a Paths commit, touching only the winner: what it changed
    /// under `globs` since its restore. The caller may refuse it (the agent checks the
    /// paths against the parent's commits since the fork point) before applying it.
    pub async fn plan_paths_commit(
        &self,
        winner: &LocalSandbox,
        globs: &[String],
    ) -> Result<PathsCommit> {
        let baseline = winner.baseline.as_ref().ok_or_else(|| {
            Error::Invalid(format!(
                "branch {} was not forked with tracked paths; no baseline to diff against",
                winner.name
            ))
        })?;
        let roots = diff::glob_roots(globs)?;
        // Component-wise: a tracked `/work` does not cover `/workspace`.
        if !roots.iter().all(|r| {
            winner
                .tracked_roots
                .iter()
                .any(|t| Path::new(r).starts_with(t))
        }) {
            return Err(Error::Invalid(format!(
                "commit paths {globs:?} are outside the tracked roots {:?}",
                winner.tracked_roots
            )));
        }
        let allow = diff::globset(globs)?;
        let (now, skipped) = self.manifest(winner, globs).await?;
        let d = diff::diff(baseline, &now, &allow);
        if !d.deleted.is_empty() {
            // A deletion is committed only when a second manifest agrees: a manifest
            // that came back whole but empty (seen once under load: every tracked
            // file of the parent was deleted by a commit) must not read as "the
            // branch deleted everything". Refused, the commit is retried.
            let (again, _) = self.manifest(winner, globs).await?;
            diff::deletions_confirmed(&d.deleted, &again)?;
        }
        let mut copy: Vec<String> = d
            .added
            .iter()
            .chain(&d.modified)
            .map(|c| c.path.clone())
            .collect();
        copy.sort();
        // Every path handed to a shell or tar below passed `diff::valid_path` in
        // `parse_manifest`; check again here, it is what keeps `..` out of the parent.
        if let Some(p) = copy
            .iter()
            .chain(d.deleted.iter().map(|c| &c.path))
            .find(|p| !diff::valid_path(p))
        {
            return Err(Error::Invalid(format!("refusing to commit path {p:?}")));
        }
        Ok(PathsCommit {
            diff: d,
            copy,
            now,
            skipped,
        })
    }

    /// Applies a planned Paths commit into the parent, all or nothing.
    pub async fn apply_paths_commit(
        &self,
        parent: &LocalSandbox,
        winner: &LocalSandbox,
        plan: PathsCommit,
    ) -> Result<CommitReport> {
        let PathsCommit {
            diff: d,
            copy,
            now,
            skipped,
        } = plan;
        // Never write or delete through a symlink of the parent: a path whose ancestor
        // (or itself) is a symlink in the parent would land outside the allowlist.
        let touched: Vec<String> = copy
            .iter()
            .chain(d.deleted.iter().map(|c| &c.path))
            .cloned()
            .collect();
        if !touched.is_empty() {
            let mut argv: Vec<String> = vec![
                "/bin/sh".into(),
                "-c".into(),
                PARENT_CHECK_SCRIPT.into(),
                "ramify-check".into(),
            ];
            argv.extend(touched);
            let out = self
                .inner
                .runsc
                .exec(
                    &parent.ctx,
                    &argv,
                    &[],
                    None,
                    self.inner.cfg.exec_timeout,
                    None,
                )
                .await?;
            let blocked = out.stdout_str();
            if out.code != 0 || !blocked.trim().is_empty() {
                return Err(Error::Invalid(format!(
                    "commit refused, nothing applied: {} {}",
                    blocked.trim().chars().take(1000).collect::<String>(),
                    out.stderr_str().trim()
                )));
            }
        }
        // The tarball travels on a `runsc exec` stdout, capped at MAX_STDOUT: refuse a
        // commit that cannot fit up front, with its size, rather than tar and cut it.
        let tar_bytes: u64 = d
            .added
            .iter()
            .chain(&d.modified)
            .map(|c| c.size.div_ceil(512) * 512 + 1024 + (c.path.len() as u64).div_ceil(512) * 512)
            .sum::<u64>()
            + 10240;
        if !copy.is_empty() && tar_bytes > crate::cmd::MAX_STDOUT as u64 {
            return Err(Error::Invalid(format!(
                "commit refused: {} changed files of {} bytes exceed the {}-byte limit of a Paths commit",
                copy.len(),
                d.bytes(),
                crate::cmd::MAX_STDOUT
            )));
        }
        let stage = format!("/.ramify-commit-{}", uuid::Uuid::new_v4().simple());
        if !copy.is_empty() {
            let tarball = winner
                .dir
                .join(format!("commit-{}.tar", uuid::Uuid::new_v4().simple()));
            let mut argv: Vec<String> = vec!["tar".into(), "-cf".into(), "-".into(), "--".into()];
            argv.extend(copy.iter().cloned());
            let out = self
                .exec_or_fail(winner, &argv, None, "tar of changed files failed")
                .await?;
            // The winner's tar is the workload's: check what it produced, entry by
            // entry, against what was asked for, before the parent unpacks it.
            let wanted: Manifest = copy
                .iter()
                .filter_map(|p| now.get(p).map(|e| (p.clone(), e.clone())))
                .collect();
            diff::check_commit_tar(&out.stdout, &wanted)?;
            std::fs::write(&tarball, &out.stdout).map_err(|e| Error::io("write", &tarball, e))?;
            // Stage first: a failure while unpacking (no space, a bad entry) leaves the
            // parent's files as they were.
            let argv: Vec<String> = vec![
                "/bin/sh".into(),
                "-c".into(),
                PARENT_STAGE_SCRIPT.into(),
                "ramify-stage".into(),
                stage.clone(),
            ];
            let res = self
                .exec_or_fail(
                    parent,
                    &argv,
                    Some(&tarball),
                    "staging the commit in the parent failed, nothing applied",
                )
                .await;
            std::fs::remove_file(&tarball).ok();
            res?;
        }
        if !copy.is_empty() || !d.deleted.is_empty() {
            let mut argv: Vec<String> = vec![
                "/bin/sh".into(),
                "-c".into(),
                PARENT_APPLY_SCRIPT.into(),
                "ramify-apply".into(),
                stage.clone(),
            ];
            argv.extend(copy.iter().cloned());
            argv.push("--delete".into());
            argv.extend(d.deleted.iter().map(|c| c.path.clone()));
            self.exec_or_fail(
                parent,
                &argv,
                None,
                "applying the staged commit in the parent failed (a retry rolls it forward)",
            )
            .await?;
        }
        let bytes = d.bytes();
        info!(
            added = d.added.len(),
            modified = d.modified.len(),
            deleted = d.deleted.len(),
            bytes,
            "commit paths"
        );
        Ok(CommitReport {
            diff: d,
            bytes,
            skipped,
        })
    }

    /// Runs a commit step in `sb` (with the exec timeout); a non-zero exit is an error
    /// that says `what` and carries the step's stderr.
    async fn exec_or_fail(
        &self,
        sb: &LocalSandbox,
        argv: &[String],
        stdin: Option<&Path>,
        what: &str,
    ) -> Result<Output> {
        // As root inside the sandbox, whatever user the workload (its image) runs as:
        // the commit stages next to `/` and writes files the workload's user may not
        // (gVisor's root is the sandbox's, not the node's).
        let mut cmd = self
            .inner
            .runsc
            .exec_cmd_as(&sb.ctx, argv, &[], Some("0:0"))?
            .timeout(self.inner.cfg.exec_timeout);
        if let Some(p) = stdin {
            cmd = cmd.stdin_file(p);
        }
        let out = cmd.output().await?;
        if out.code != 0 {
            return Err(Error::Sandbox {
                id: sb.id.clone(),
                reason: format!("{what}: {}", out.stderr_str()),
            });
        }
        Ok(out)
    }

    /// Commit Full: the winner's live sandbox becomes the parent. The parent handle now
    /// points at the winner's runsc container (keeping the parent's name and index with
    /// a fresh identity); the old parent sandbox is torn down.
    #[instrument(skip(self, parent, winner), fields(parent = %parent.id, winner = %winner.id))]
    pub async fn commit_full(
        &self,
        parent: &mut LocalSandbox,
        mut winner: LocalSandbox,
    ) -> Result<()> {
        self.adopt_as_parent(parent, &mut winner)?;
        let old = std::mem::replace(parent, winner);
        self.destroy(old).await
    }

    /// The first step of a Full commit, touching only the winner: it takes the
    /// parent's name and index with a fresh identity, and its control outputs
    /// (verdict, effects) are cleared. Repeatable; the caller records the swap, then
    /// destroys the old parent (the agent does so in that order, to survive a crash).
    pub fn adopt_as_parent(&self, parent: &LocalSandbox, winner: &mut LocalSandbox) -> Result<()> {
        winner.name = parent.name.clone();
        winner.identity = self.next_identity(
            &parent.name,
            parent.identity.index,
            winner.restored_from.as_deref(),
            winner.identity.hostname.clone(),
        );
        control::write_identity(&winner.control_dir(), &winner.identity)
            .map_err(|e| Error::io("write identity", winner.control_dir(), e))?;
        control::clear_outputs(&winner.control_dir())
            .map_err(|e| Error::io("clear control dir", winner.control_dir(), e))
    }

    /// Files changed under `globs` since the branch was restored (needs a baseline:
    /// the branch must have been forked with those globs tracked).
    pub async fn diff_since_restore(&self, sb: &LocalSandbox, globs: &[String]) -> Result<Diff> {
        let baseline = sb.baseline.as_ref().ok_or_else(|| {
            Error::Invalid(format!(
                "sandbox {} has no baseline: it was not forked with tracked paths",
                sb.name
            ))
        })?;
        let allow = diff::globset(globs)?;
        let (now, _) = self.manifest(sb, globs).await?;
        Ok(diff::diff(baseline, &now, &allow))
    }
}

/// Prints every reason a commit could not apply cleanly in the parent: a path (or an
/// ancestor) that is a symlink there, an ancestor that is not a directory, a target that
/// is a directory. Checked before anything is written, so the apply cannot stop halfway
/// on them.
const PARENT_CHECK_SCRIPT: &str = r#"for p in "$@"; do
  if [ -d "$p" ] && [ ! -L "$p" ]; then echo "is a directory in the parent: $p"; fi
  d="$p"
  while [ -n "$d" ] && [ "$d" != / ]; do
    if [ -L "$d" ]; then echo "is a symlink in the parent: $d"
    elif [ "$d" != "$p" ] && [ -e "$d" ] && [ ! -d "$d" ]; then echo "is not a directory in the parent: $d"; fi
    d="${d%/*}"
  done
done"#;

/// Unpacks the winner's tarball (stdin) into a fresh staging directory `$1` in the
/// parent; stale staging directories of an interrupted commit go first, and a failed
/// unpack removes its own.
const PARENT_STAGE_SCRIPT: &str = r#"rm -rf /.ramify-commit-* && mkdir -m 700 "$1" && { tar -xf - -C "$1" || { rc=$?; rm -rf "$1"; exit $rc; }; }"#;

/// Moves the staged files (`$1` + path) into place and deletes the paths after
/// `--delete`, then drops the staging directory. Renames only: a rerun after an
/// interruption rolls forward to the same result.
const PARENT_APPLY_SCRIPT: &str = r#"stage="$1"; shift
del=
for p in "$@"; do
  if [ "$p" = --delete ]; then del=1; continue; fi
  if [ -n "$del" ]; then rm -f "$p" || exit 1; continue; fi
  if [ -e "$stage$p" ]; then
    d="${p%/*}"
    if [ -n "$d" ]; then mkdir -p "$d" || exit 1; fi
    mv -f "$stage$p" "$p" || exit 1
  fi
done
rm -rf "$stage""#;
