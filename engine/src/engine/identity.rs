//! A sandbox's identity (written to its control directory): a fresh one per sandbox
//! and per hand-out, and the hostname a restored branch gets.

use std::sync::atomic::Ordering;

use tracing::{instrument, warn};

use super::{Engine, LocalSandbox};
use crate::control::Identity;
use crate::error::{Error, Result};
use crate::runsc::control as socket;

impl Engine {
    pub(super) fn next_identity(
        &self,
        name: &str,
        index: u32,
        snapshot: Option<&str>,
        hostname: Option<String>,
    ) -> Identity {
        Identity {
            name: name.into(),
            index,
            uid: uuid::Uuid::new_v4().to_string(),
            generation: self.inner.generation.fetch_add(1, Ordering::Relaxed),
            snapshot: snapshot.map(str::to_string),
            seed: fresh_seed(),
            hostname,
        }
    }

    /// Give a restored branch its own hostname. gVisor restores the UTS namespace from
    /// the checkpoint (the restore spec's `hostname` is ignored), so every branch would
    /// otherwise carry the source's hostname. Over the sandbox's control socket where
    /// the runsc has `SetHostname` (the pinned, patched one): well under a millisecond,
    /// against 85-180 ms for starting `runsc exec` and a program in the sandbox, while
    /// the branch already runs with the source's hostname. Elsewhere, or if the socket
    /// call fails, [`Engine::exec_hostname`].
    #[instrument(skip(self, sb), fields(id = %sb.id))]
    pub async fn set_hostname(&self, sb: &LocalSandbox, host: &str) -> Result<()> {
        match socket::set_hostname(&sb.ctx, self.inner.runsc.hostname_support(), host).await {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(e) => {
                warn!(error = %e, "setting the hostname over the control socket failed; through `runsc exec`")
            }
        }
        self.exec_hostname(sb, host).await
    }

    /// Sets the hostname by running the sandbox's own `hostname` program: setting it
    /// needs CAP_SYS_ADMIN, which the workload does not have, so one
    /// `runsc exec --cap CAP_SYS_ADMIN <id> hostname <h>`.
    pub async fn exec_hostname(&self, sb: &LocalSandbox, host: &str) -> Result<()> {
        let mut argv = self.inner.runsc.global_args(&sb.ctx);
        argv.extend(["exec".into(), "--cap".into(), "CAP_SYS_ADMIN".into()]);
        let mut env = sb.workload.env.clone();
        if !env.iter().any(|(k, _)| k == "PATH") {
            env.push((
                "PATH".into(),
                "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
            ));
        }
        for (k, v) in &env {
            argv.push("--env".into());
            argv.push(format!("{k}={v}").into());
        }
        argv.extend([sb.id.clone().into(), "hostname".into(), host.into()]);
        let mut it = argv.into_iter();
        let mut cmd = crate::cmd::Cmd::new(it.next().unwrap_or_default())
            .args(it)
            .timeout(self.inner.cfg.exec_timeout);
        if let Some(ns) = &sb.ctx.netns {
            cmd = cmd.wrapped_in(vec![
                "nsenter".into(),
                format!("--net={}", ns.display()).into(),
                "--".into(),
            ]);
        }
        let out = cmd.output().await?;
        if out.code != 0 {
            return Err(Error::Sandbox {
                id: sb.id.clone(),
                reason: format!(
                    "`hostname {host}` exited {}: {}",
                    out.code,
                    out.stderr_str().trim()
                ),
            });
        }
        Ok(())
    }
}

/// 32 bytes from the OS CSPRNG (getrandom, through uuid v4) as 64 hex characters.
fn fresh_seed() -> String {
    let mut s = String::with_capacity(64);
    s.push_str(&uuid::Uuid::new_v4().simple().to_string());
    s.push_str(&uuid::Uuid::new_v4().simple().to_string());
    s
}

/// The hostname of a restored branch: the workload's hostname (reduced to a DNS label)
/// followed by the random part of the sandbox id, at most 63 characters.
pub fn branch_hostname(base: &str, sandbox_id: &str) -> String {
    let suffix: String = sandbox_id
        .rsplit('-')
        .next()
        .unwrap_or_default()
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .take(16)
        .collect::<String>()
        .to_ascii_lowercase();
    let mut label: String = base
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    label = label.trim_matches('-').to_string();
    if label.is_empty() {
        label = "ramify".into();
    }
    label.truncate(62 - suffix.len());
    let label = label.trim_end_matches('-');
    if suffix.is_empty() {
        label.to_string()
    } else {
        format!("{label}-{suffix}")
    }
}
