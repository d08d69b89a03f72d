//! Async driver for the `runsc` CLI: one `--root` per sandbox, every command for a
//! sandbox run inside that sandbox's network namespace (its control socket is an
//! abstract unix socket, which belongs to a netns), capabilities detected at start-up.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use tracing::{debug, instrument};

use crate::cmd::{Cmd, Output};
use crate::error::{Error, Result};
pub use crate::platform::Platform;
use crate::platform::PlatformDecision;

pub mod control;
pub mod port_forward;
pub mod restore_pages;
pub use restore_pages::RestorePages;

/// How the root filesystem is kept private to a sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OverlayFlag {
    /// `--overlay2=root:memory`: only the rootfs is overlaid; bind mounts (the control
    /// mount) stay writable through to the host.
    Overlay2Root,
    /// Legacy `--overlay` overlays *every* mount, including bind mounts (verified on
    /// Debian's runsc 20221219): writes to the control mount would never reach the host.
    LegacyAll,
}

/// Sandbox network mode as passed to runsc.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum NetworkMode {
    /// gVisor's own netstack on the interfaces of the sandbox's netns. Checkpointable.
    Sandbox,
    /// Loopback only.
    None,
}

impl NetworkMode {
    fn as_str(self) -> &'static str {
        match self {
            NetworkMode::Sandbox => "sandbox",
            NetworkMode::None => "none",
        }
    }
}

/// What the installed runsc can do, detected from its help output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunscCaps {
    /// Full first line of `runsc --version`; checkpoint and restore must match on it.
    pub version: String,
    /// Release date parsed from the version (e.g. 20221219), when recognisable.
    pub release_date: Option<u32>,
    /// `checkpoint --leave-running` exists *and* is trusted (it hangs and breaks the
    /// source's gofer in releases before 2023, so it is only trusted from 2024 on).
    pub leave_running: bool,
    pub leave_running_flag: bool,
    /// `restore --background`: pages loaded after the restore returns.
    pub background: bool,
    /// `restore --lazy-pages` (a patched runsc, hack/runsc/patches): pages loaded only
    /// when the sandbox touches them.
    pub lazy_pages: bool,
    /// `checkpoint --compression`.
    pub compression: bool,
    pub overlay: OverlayFlag,
    /// Old runsc decides "root netns" by whether /proc/sys/net/core/rmem_default exists,
    /// which recent kernels expose in every netns, so it refuses `--network=sandbox`.
    /// When set, run/restore hide /proc/sys/net in a private mount namespace.
    pub hide_proc_sys_net: bool,
}

impl RunscCaps {
    /// Parse the outputs of `runsc --version`, `runsc help checkpoint`,
    /// `runsc help restore` and `runsc flags`. Pure, so it is unit tested.
    pub fn parse(
        version_out: &str,
        checkpoint_help: &str,
        restore_help: &str,
        flags: &str,
    ) -> Result<Self> {
        let version = version_out
            .lines()
            .next()
            .map(str::trim)
            .filter(|l| l.starts_with("runsc version"))
            .ok_or_else(|| {
                Error::RunscOutput(format!("unexpected --version output {version_out:?}"))
            })?
            .to_string();
        let release_date = parse_release_date(&version);
        let has = |text: &str, flag: &str| {
            text.lines().any(|l| {
                let t = l.trim_start();
                t.starts_with(&format!("-{flag} "))
                    || t == format!("-{flag}")
                    || t.starts_with(&format!("--{flag} "))
            })
        };
        let leave_running_flag = has(checkpoint_help, "leave-running");
        let overlay = if has(flags, "overlay2") {
            OverlayFlag::Overlay2Root
        } else if has(flags, "overlay") {
            OverlayFlag::LegacyAll
        } else {
            return Err(Error::Unsupported {
                version,
                what: "neither --overlay2 nor --overlay: sandboxes would write through to the shared rootfs".into(),
            });
        };
        Ok(RunscCaps {
            leave_running: leave_running_flag && release_date.is_some_and(|d| d >= 20240101),
            leave_running_flag,
            background: has(restore_help, "background"),
            lazy_pages: has(restore_help, "lazy-pages"),
            compression: has(checkpoint_help, "compression"),
            overlay,
            hide_proc_sys_net: release_date.is_some_and(|d| d < 20240601),
            release_date,
            version,
        })
    }
}

/// Finds the first 8-digit run that looks like a date (2018..2099) in a version string:
/// Debian's `0.0~20221219.0`, upstream's `release-20240610.0`.
fn parse_release_date(version: &str) -> Option<u32> {
    let bytes = version.as_bytes();
    let mut i = 0;
    while i + 8 <= bytes.len() {
        let window = &version[i..i + 8];
        let before_ok = i == 0 || !bytes[i - 1].is_ascii_digit();
        let after_ok = i + 8 == bytes.len() || !bytes[i + 8].is_ascii_digit();
        if before_ok
            && after_ok
            && window.bytes().all(|b| b.is_ascii_digit())
            && let Ok(d) = window.parse::<u32>()
            && (20180101..20991231).contains(&d)
        {
            return Some(d);
        }
        i += 1;
    }
    None
}

/// Where one sandbox's runsc state lives and which netns its commands run in.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct SandboxCtx {
    pub id: String,
    pub root: PathBuf,
    pub netns: Option<PathBuf>,
    pub network: NetworkMode,
}

/// `runsc state` JSON (subset).
#[derive(Debug, Clone, Deserialize)]
pub struct RunscState {
    pub id: String,
    pub status: String,
    #[serde(default)]
    pub pid: i64,
}

#[derive(Debug, Clone)]
pub struct RunscConfig {
    pub binary: PathBuf,
    /// What to run sandboxes on; `Auto` probes systrap at start-up.
    pub platform: Platform,
    /// Directory for runsc debug logs (one file per command), if wanted.
    pub debug_log_dir: Option<PathBuf>,
    /// Override for the leave-running decision (None: trust detection).
    pub force_leave_running: Option<bool>,
    /// How restores load memory; `Auto` is resolved from the caps at start-up.
    pub restore_pages: RestorePages,
}

impl Default for RunscConfig {
    fn default() -> Self {
        RunscConfig {
            binary: PathBuf::from("runsc"),
            platform: Platform::Auto,
            debug_log_dir: None,
            force_leave_running: None,
            restore_pages: RestorePages::Auto,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Runsc {
    cfg: RunscConfig,
    caps: RunscCaps,
    platform: PlatformDecision,
    /// Resolved: never `Auto`.
    restore_pages: RestorePages,
    /// Whether sandboxes' control servers are driven directly (learnt from the first).
    control: control::Support,
    /// Whether its sandboxes take a hostname over the control socket.
    hostname: control::Support,
}

impl Runsc {
    /// Probe the binary and detect its capabilities.
    #[instrument(skip_all, fields(binary = %cfg.binary.display()))]
    pub async fn detect(cfg: RunscConfig) -> Result<Self> {
        let binary = cfg.binary.clone();
        let probe = |args: &'static [&'static str]| {
            let c = Cmd::new(binary.as_os_str())
                .args(args.iter().copied())
                .timeout(Duration::from_secs(20));
            let binary = binary.clone();
            async move {
                match c.output().await {
                    Err(Error::MissingTool(_)) => Err(Error::MissingTool(format!(
                        "{} (install gVisor: `apt-get install runsc` or a release from gvisor.dev)",
                        binary.display()
                    ))),
                    // `runsc help X` exits non-zero on some releases; its text is on stdout or stderr.
                    Ok(o) => Ok(format!("{}{}", o.stdout_str(), o.stderr_str())),
                    Err(e) => Err(e),
                }
            }
        };
        let version = probe(&["--version"]).await?;
        let ck = probe(&["help", "checkpoint"]).await?;
        let rs = probe(&["help", "restore"]).await?;
        let flags = probe(&["flags"]).await?;
        let mut caps = RunscCaps::parse(&version, &ck, &rs, &flags)?;
        if let Some(f) = cfg.force_leave_running {
            caps.leave_running = f && caps.leave_running_flag;
        }
        // Before the platform probe (which starts a sandbox): a mode this runsc lacks
        // refuses at once.
        let restore_pages = cfg.restore_pages.resolve(&caps)?;
        let platform = crate::platform::resolve(&cfg.binary, cfg.platform).await?;
        debug!(?caps, ?platform, %restore_pages, "runsc detected");
        Ok(Runsc {
            cfg,
            caps,
            platform,
            restore_pages,
            control: control::Support::default(),
            hostname: control::Support::default(),
        })
    }

    /// Whether this runsc's sandboxes can be paused and resumed through their control
    /// sockets ([`control`]); `None` until a sandbox was asked.
    pub fn control_support(&self) -> &control::Support {
        &self.control
    }

    /// Whether this runsc's sandboxes take a hostname over their control sockets
    /// ([`control::set_hostname`]); `None` until a sandbox was asked.
    pub fn hostname_support(&self) -> &control::Support {
        &self.hostname
    }

    pub fn caps(&self) -> &RunscCaps {
        &self.caps
    }

    pub fn version(&self) -> &str {
        &self.caps.version
    }

    /// The platform sandboxes run on (resolved: never `Auto`) and why.
    pub fn platform(&self) -> &PlatformDecision {
        &self.platform
    }

    /// How restores load memory (resolved: never `Auto`).
    pub fn restore_pages(&self) -> RestorePages {
        self.restore_pages
    }

    pub fn binary(&self) -> &Path {
        &self.cfg.binary
    }

    /// The global flags for one sandbox: state root, platform, network, overlay.
    pub fn global_args(&self, ctx: &SandboxCtx) -> Vec<OsString> {
        let mut a: Vec<OsString> = vec![
            self.cfg.binary.clone().into_os_string(),
            format!("--root={}", ctx.root.display()).into(),
            format!("--platform={}", self.platform.platform.as_str()).into(),
            format!("--network={}", ctx.network.as_str()).into(),
        ];
        match self.caps.overlay {
            OverlayFlag::Overlay2Root => a.push("--overlay2=root:memory".into()),
            OverlayFlag::LegacyAll => a.push("--overlay".into()),
        }
        match &self.cfg.debug_log_dir {
            Some(d) => {
                a.push("--debug".into());
                a.push(format!("--debug-log={}/{}.%COMMAND%.log", d.display(), ctx.id).into());
            }
            None => {
                // The sandbox process's own log at info level (a few KiB): it is where
                // runsc says how the first process ended ("application exiting with
                // exit status 3"), which nothing else reports once the sandbox is gone.
                a.push(format!("--debug-log={}", self.boot_log(ctx).display()).into());
                a.push("--debug-command=boot".into());
            }
        }
        a
    }

    /// Build a runsc command line for `ctx`, wrapped so it runs in the sandbox's netns.
    /// `creates_network` marks run/restore, the commands that scrape the netns.
    fn command(&self, ctx: &SandboxCtx, sub: &[OsString], creates_network: bool) -> Cmd {
        let mut argv = self.global_args(ctx);
        argv.extend(sub.iter().cloned());
        let mut it = argv.into_iter();
        let mut cmd = Cmd::new(it.next().unwrap_or_default()).args(it);
        if let Some(ns) = &ctx.netns {
            let hide = creates_network
                && ctx.network == NetworkMode::Sandbox
                && self.caps.hide_proc_sys_net;
            if hide {
                // A private mount namespace where /proc/sys/net is an empty tmpfs, so the
                // old root-netns heuristic sees a non-root netns (which it is). The mount
                // dies with the runsc process; nothing leaks to the host.
                cmd = cmd.wrapped_in(vec![
                    "unshare".into(),
                    "--mount".into(),
                    "--propagation=private".into(),
                    "--".into(),
                    "sh".into(),
                    "-c".into(),
                    r#"mount -t tmpfs -o size=4k,mode=0555 ramify-hide /proc/sys/net && exec nsenter --net="$0" -- "$@""#
                        .into(),
                    ns.clone().into_os_string(),
                ]);
            } else {
                cmd = cmd.wrapped_in(vec![
                    "nsenter".into(),
                    format!("--net={}", ns.display()).into(),
                    "--".into(),
                ]);
            }
        }
        cmd
    }

    /// Log file for a sandbox's console output and runsc's own run/restore messages.
    fn console_log(ctx: &SandboxCtx) -> PathBuf {
        ctx.root.with_file_name("console.log")
    }

    /// The log of the sandbox process (`runsc boot`): how its first process ended.
    pub fn boot_log(&self, ctx: &SandboxCtx) -> PathBuf {
        match &self.cfg.debug_log_dir {
            Some(d) => d.join(format!("{}.boot.log", ctx.id)),
            None => ctx.root.with_file_name("boot.log"),
        }
    }

    /// Where `run` and `restore` write the sandbox process's pid.
    pub fn pid_file(ctx: &SandboxCtx) -> PathBuf {
        ctx.root.with_file_name("sandbox.pid")
    }

    /// The pid `run` or `restore` wrote (`None` before, or if runsc wrote none).
    pub fn sandbox_pid(ctx: &SandboxCtx) -> Option<i32> {
        std::fs::read_to_string(Self::pid_file(ctx))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    #[instrument(skip(self, ctx), fields(id = %ctx.id))]
    pub async fn run(&self, ctx: &SandboxCtx, bundle: &Path) -> Result<()> {
        // A pid left from an earlier run names a process that is gone (or recycled), and
        // an earlier boot log tells how an earlier sandbox ended.
        let _ = std::fs::remove_file(Self::pid_file(ctx));
        let _ = std::fs::remove_file(self.boot_log(ctx));
        let c = self.command(
            ctx,
            &[
                "run".into(),
                format!("--bundle={}", bundle.display()).into(),
                format!("--pid-file={}", Self::pid_file(ctx).display()).into(),
                "--detach".into(),
                ctx.id.clone().into(),
            ],
            true,
        );
        c.log_to(&Self::console_log(ctx)).run().await.map(|_| ())
    }

    #[instrument(skip(self, ctx), fields(id = %ctx.id))]
    pub async fn restore(&self, ctx: &SandboxCtx, bundle: &Path, image: &Path) -> Result<()> {
        let _ = std::fs::remove_file(Self::pid_file(ctx));
        let _ = std::fs::remove_file(self.boot_log(ctx));
        let mut sub: Vec<OsString> = vec![
            "restore".into(),
            format!("--image-path={}", image.display()).into(),
            format!("--bundle={}", bundle.display()).into(),
            format!("--pid-file={}", Self::pid_file(ctx).display()).into(),
            "--detach".into(),
        ];
        // Resolved against the caps at start-up (uncompressed images included).
        if let Some(flag) = self.restore_pages.restore_flag() {
            sub.push(flag.into());
        }
        sub.push(ctx.id.clone().into());
        self.command(ctx, &sub, true)
            .log_to(&Self::console_log(ctx))
            .timeout(Duration::from_secs(300))
            .run()
            .await
            .map(|_| ())
    }

    #[instrument(skip(self, ctx), fields(id = %ctx.id))]
    pub async fn checkpoint(
        &self,
        ctx: &SandboxCtx,
        image: &Path,
        leave_running: bool,
    ) -> Result<()> {
        let mut sub: Vec<OsString> = vec![
            "checkpoint".into(),
            format!("--image-path={}", image.display()).into(),
        ];
        if leave_running {
            if !self.caps.leave_running_flag {
                return Err(Error::Unsupported {
                    version: self.caps.version.clone(),
                    what: "checkpoint --leave-running".into(),
                });
            }
            sub.push("--leave-running".into());
        }
        if self.caps.compression {
            sub.push("--compression=none".into());
        }
        sub.push(ctx.id.clone().into());
        self.command(ctx, &sub, false)
            .timeout(Duration::from_secs(300))
            .run()
            .await
            .map(|_| ())
    }

    /// Run a process in the sandbox. The exit code is the process's; a runsc-level
    /// failure (no such container) also shows up as a non-zero code with stderr.
    #[instrument(skip(self, ctx, env), fields(id = %ctx.id))]
    /// The `runsc exec` command line for `argv` (not started).
    pub fn exec_cmd(
        &self,
        ctx: &SandboxCtx,
        argv: &[String],
        env: &[(String, String)],
    ) -> Result<Cmd> {
        self.exec_cmd_as(ctx, argv, env, None)
    }

    /// [`Runsc::exec_cmd`] as `user` (`uid[:gid]` inside the sandbox) instead of the
    /// workload's own user.
    pub fn exec_cmd_as(
        &self,
        ctx: &SandboxCtx,
        argv: &[String],
        env: &[(String, String)],
        user: Option<&str>,
    ) -> Result<Cmd> {
        if argv.is_empty() {
            return Err(Error::Invalid("exec needs a command".into()));
        }
        let mut sub: Vec<OsString> = vec!["exec".into()];
        if let Some(u) = user {
            sub.push("--user".into());
            sub.push(u.into());
        }
        for (k, v) in env {
            sub.push("--env".into());
            sub.push(format!("{k}={v}").into());
        }
        sub.push(ctx.id.clone().into());
        sub.extend(argv.iter().map(OsString::from));
        Ok(self.command(ctx, &sub, false))
    }

    pub async fn exec(
        &self,
        ctx: &SandboxCtx,
        argv: &[String],
        env: &[(String, String)],
        stdin: Option<&Path>,
        timeout: Duration,
        tail: Option<usize>,
    ) -> Result<Output> {
        let mut attempt = 0;
        loop {
            let mut c = self.exec_cmd(ctx, argv, env)?.timeout(timeout);
            if let Some(p) = stdin {
                c = c.stdin_file(p);
            }
            if let Some(tail) = tail {
                c = c.keep_tail(tail, tail);
            }
            let out = c.output().await?;
            // The sandbox's control server refused the connection: the command never
            // started, so it is tried again. Seen once in a full suite on a loaded
            // machine, right after a restore (a Unix socket refuses a connect while its
            // listener's backlog is full); a sandbox that is gone refuses every time.
            if attempt < 3 && out.code != 0 && refused_by_control_server(&out.stderr) {
                attempt += 1;
                tracing::debug!(id = %ctx.id, attempt, "runsc exec: control server refused; again");
                tokio::time::sleep(Duration::from_millis(50 << attempt)).await;
                continue;
            }
            return Ok(out);
        }
    }

    #[instrument(skip(self, ctx), fields(id = %ctx.id))]
    pub async fn kill(&self, ctx: &SandboxCtx) -> Result<()> {
        let c = self.command(
            ctx,
            &[
                "kill".into(),
                "--all".into(),
                ctx.id.clone().into(),
                "KILL".into(),
            ],
            false,
        );
        c.run().await.map(|_| ())
    }

    #[instrument(skip(self, ctx), fields(id = %ctx.id))]
    pub async fn delete_force(&self, ctx: &SandboxCtx) -> Result<()> {
        let c = self.command(
            ctx,
            &["delete".into(), "--force".into(), ctx.id.clone().into()],
            false,
        );
        c.run().await.map(|_| ())
    }

    #[instrument(skip(self, ctx), fields(id = %ctx.id))]
    pub async fn state(&self, ctx: &SandboxCtx) -> Result<RunscState> {
        let out = self
            .command(ctx, &["state".into(), ctx.id.clone().into()], false)
            .run()
            .await?;
        serde_json::from_slice(&out.stdout)
            .map_err(|e| Error::RunscOutput(format!("runsc state: {e}: {}", out.stdout_str())))
    }

    pub async fn pause(&self, ctx: &SandboxCtx) -> Result<()> {
        self.command(ctx, &["pause".into(), ctx.id.clone().into()], false)
            .run()
            .await
            .map(|_| ())
    }

    pub async fn resume(&self, ctx: &SandboxCtx) -> Result<()> {
        self.command(ctx, &["resume".into(), ctx.id.clone().into()], false)
            .run()
            .await
            .map(|_| ())
    }
}

/// Whether `runsc exec` failed to reach the sandbox at all (its command never ran).
fn refused_by_control_server(stderr: &[u8]) -> bool {
    let e = String::from_utf8_lossy(stderr);
    e.contains("connecting to control server") && e.contains("connection refused")
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEBIAN_CK: &str = "checkpoint [flags] <container id> - save current state of container.\n  -image-path string\n    \tdirectory path to saved container image\n  -leave-running\n    \trestart the container after checkpointing\n  -work-path string\n    \tignored\n";
    const DEBIAN_RS: &str =
        "restore [flags] <container id>\n  -bundle string\n  -detach\n  -image-path string\n";
    const NEW_CK: &str =
        "  -compression value\n    \tcompression\n  -image-path string\n  -leave-running\n";
    const NEW_RS: &str = "  -background\n    \trestore in background\n  -direct\n";
    const PATCHED_RS: &str = "  -background\n    \trestore in background\n  -direct\n  -lazy-pages\n    \tload memory pages from the image only when the application accesses them\n";

    #[test]
    fn parses_debian_runsc() {
        let caps = RunscCaps::parse(
            "runsc version 0.0~20221219.0\nspec: 1.0.2-dev\n",
            DEBIAN_CK,
            DEBIAN_RS,
            "  -overlay\n    \tDEPRECATED\n  -overlay2 value\n    \twrap mounts\n",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(caps.version, "runsc version 0.0~20221219.0");
        assert_eq!(caps.release_date, Some(20221219));
        assert!(caps.leave_running_flag);
        assert!(
            !caps.leave_running,
            "leave-running is broken in 2022 releases"
        );
        assert!(!caps.background);
        assert!(!caps.lazy_pages);
        assert!(!caps.compression);
        assert_eq!(caps.overlay, OverlayFlag::Overlay2Root);
        assert!(caps.hide_proc_sys_net);
    }

    #[test]
    fn parses_new_runsc() {
        let caps = RunscCaps::parse(
            "runsc version release-20250512.0\n",
            NEW_CK,
            NEW_RS,
            "  -overlay2 value\n",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert!(caps.leave_running && caps.background && caps.compression);
        assert!(!caps.lazy_pages);
        assert!(!caps.hide_proc_sys_net);
        let patched = RunscCaps::parse(
            "runsc version release-20260527.0-a81fd9dd382e+p03b59809\n",
            NEW_CK,
            PATCHED_RS,
            "  -overlay2 value\n",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert!(patched.lazy_pages && patched.background);
    }

    #[test]
    fn legacy_overlay_only_and_garbage() {
        let caps = RunscCaps::parse("runsc version 0.0~20200101.0\n", "", "", "  -overlay\n")
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(caps.overlay, OverlayFlag::LegacyAll);
        assert!(RunscCaps::parse("bash: runsc: not found", "", "", "-overlay2 x").is_err());
        assert!(RunscCaps::parse("runsc version x\n", "", "", "").is_err());
    }

    #[test]
    fn release_dates() {
        assert_eq!(
            parse_release_date("runsc version 0.0~20221219.0"),
            Some(20221219)
        );
        assert_eq!(
            parse_release_date("runsc version release-20240610.0"),
            Some(20240610)
        );
        assert_eq!(
            parse_release_date("runsc version 0.0.0-20240610123456"),
            None
        );
        assert_eq!(parse_release_date("runsc version ramify-go"), None);
    }
}

#[cfg(test)]
mod exec_retry_tests {
    #[test]
    fn only_a_refused_connection_to_the_control_server_is_tried_again() {
        let refused = b"executing processes for container: executing command \"sh\" in sandbox: connecting to control server at PID 12421: connection refused";
        assert!(super::refused_by_control_server(refused));
        assert!(!super::refused_by_control_server(b"sh: exit 1"));
        assert!(!super::refused_by_control_server(
            b"connecting to control server at PID 1: no such process"
        ));
    }
}
