//! Shared test harness: a busybox rootfs, an engine per test under a unique state
//! dir, and a once-per-process sweep of leftovers from dead test runs.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use ramify_engine::engine::{Engine, EngineConfig, LocalSandbox, StartRequest};
use ramify_engine::placement::{Allowed, Standalone, StandaloneConfig};
use ramify_engine::rootfs::RootfsSource;
use ramify_engine::roots::RootfsConfig;
use ramify_engine::runsc::RunscConfig;
use ramify_engine::spec::{Resources, WorkloadSpec};
use tokio::sync::OnceCell;

pub const PREFIX: &str = "ramify-test-";
pub const BRIDGE: &str = "rmytest0";
pub const SUBNET: &str = "10.231.0.0/16";
pub const GATEWAY: &str = "10.231.0.1";
/// A test's own rootfs root, under its directory (a rootfs copied or unpacked there).
pub const ROOTS: &str = "roots";

fn base() -> PathBuf {
    std::env::temp_dir().join("ramify-test")
}

/// Fail loudly (never skip) when the node lacks what real sandboxes need.
fn require_tools() {
    let mut missing = Vec::new();
    for (tool, pkg) in [
        ("/usr/bin/runsc", "runsc"),
        ("/bin/busybox", "busybox-static"),
        ("/usr/sbin/iptables", "iptables"),
        ("/usr/bin/nsenter", "util-linux"),
    ] {
        let found = if tool.ends_with("runsc") {
            let bin = std::env::var_os("RAMIFY_RUNSC").unwrap_or_else(|| "runsc".into());
            std::process::Command::new(bin)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        } else {
            Path::new(tool).exists()
        };
        if !found {
            missing.push(format!("{tool} (apt package {pkg})"));
        }
    }
    assert!(
        missing.is_empty(),
        "these tests run real gVisor sandboxes and need: {}. Run node-agent/scripts/install-deps.sh as root.",
        missing.join(", ")
    );
    assert!(
        nix::unistd::geteuid().is_root(),
        "these tests must run as root (netns, cgroups, iptables)"
    );
}

static SETUP: OnceCell<PathBuf> = OnceCell::const_new();

/// Busybox rootfs shared by the tests of this process; sweep orphans first.
pub async fn rootfs() -> PathBuf {
    SETUP
        .get_or_init(|| async {
            require_tools();
            let swept = ramify_engine::sweep::sweep_orphans(PREFIX, "/ramify-test").await;
            if !swept.is_empty() {
                eprintln!("swept leftovers of earlier test runs: {swept:#?}");
            }
            // Per-process directories of dead test processes.
            if let Ok(rd) = std::fs::read_dir(base()) {
                for e in rd.flatten() {
                    let name = e.file_name().to_string_lossy().into_owned();
                    if let Some(pid) = name.split('-').next().and_then(|p| p.parse::<u32>().ok())
                        && !Path::new("/proc").join(pid.to_string()).exists()
                    {
                        // A killed test may have left a Tmpfs mounted in there.
                        let mounts =
                            std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
                        for m in mounts.lines().filter_map(|l| l.split(' ').nth(4)) {
                            if Path::new(m).starts_with(e.path()) {
                                let _ = std::process::Command::new("umount")
                                    .args(["-l", m])
                                    .status();
                            }
                        }
                        let _ = std::fs::remove_dir_all(e.path());
                    }
                }
            }
            let root = base().join(format!("{}-rootfs", std::process::id()));
            let _ = std::fs::remove_dir_all(&root);
            for d in [
                "bin",
                "proc",
                "sys",
                "dev",
                "tmp",
                "etc",
                "work",
                "run/ramify",
                "root",
            ] {
                std::fs::create_dir_all(root.join(d)).unwrap();
            }
            std::fs::copy("/bin/busybox", root.join("bin/busybox")).unwrap();
            let list = std::process::Command::new("/bin/busybox")
                .arg("--list")
                .output()
                .unwrap();
            for applet in String::from_utf8_lossy(&list.stdout).lines() {
                if applet != "busybox" && !applet.is_empty() {
                    std::os::unix::fs::symlink("busybox", root.join("bin").join(applet)).unwrap();
                }
            }
            std::fs::write(root.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\n").unwrap();
            for f in ["hosts", "hostname", "resolv.conf"] {
                std::fs::write(root.join("etc").join(f), "").unwrap();
            }
            std::fs::write(root.join("work/seed.txt"), "seed\n").unwrap();
            std::fs::write(root.join("work/keep.txt"), "keep\n").unwrap();
            root
        })
        .await
        .clone()
}

/// The tests' standalone placement (bridge, subnet and IP leases shared by all).
pub fn standalone() -> Standalone {
    Standalone::new(StandaloneConfig {
        bridge: BRIDGE.into(),
        subnet: SUBNET.into(),
        ipam_dir: base().join("ipam"),
        cgroup_parent: "/ramify-test".into(),
    })
    .unwrap()
}

pub struct Harness {
    pub engine: Engine,
    pub rootfs: PathBuf,
    pub dir: PathBuf,
}

pub async fn harness(test: &str) -> Harness {
    // RAMIFY_RUNSC picks another runsc (e.g. a current release built from the
    // gvisor.dev Go module); default: the one on PATH (Debian's package). The platform
    // is the agent's default, `auto`: systrap where it works, else ptrace.
    harness_with(
        test,
        RunscConfig {
            binary: std::env::var_os("RAMIFY_RUNSC").map_or_else(|| "runsc".into(), Into::into),
            ..RunscConfig::default()
        },
        None,
    )
    .await
}

/// A harness on a given runsc and platform; `state_dir` shares another harness's
/// state (its snapshot store) instead of a fresh one.
pub async fn harness_with(test: &str, runsc: RunscConfig, state_dir: Option<PathBuf>) -> Harness {
    let rootfs = rootfs().await;
    let dir = base().join(format!(
        "{}-{test}-{}",
        std::process::id(),
        &uuid::Uuid::new_v4().simple().to_string()[..6]
    ));
    std::fs::create_dir_all(dir.join(ROOTS)).unwrap();
    let placement = standalone();
    let engine = Engine::new(
        EngineConfig {
            state_dir: state_dir.unwrap_or_else(|| dir.join("state")),
            // The shared busybox rootfs, and `<dir>/roots` for a test's own rootfs.
            rootfs: RootfsConfig {
                roots: vec![rootfs.clone(), dir.join(ROOTS)],
                cache: dir.join("rootfs-cache"),
                protected: vec![],
            },
            id_prefix: PREFIX.into(),
            id_owner: None,
            runsc,
            exec_timeout: Duration::from_secs(60),
        },
        Arc::new(placement),
    )
    .await
    .unwrap_or_else(|e| panic!("engine: {e}"));
    Harness {
        engine,
        rootfs,
        dir,
    }
}

/// The pinned current runsc (`hack/runsc/build.sh`: built from the Go module proxy,
/// cached), whatever RAMIFY_RUNSC says: what the tests of systrap need.
pub fn current_runsc() -> PathBuf {
    // The manifest directory at run time: the binary may have been built in another clone.
    let script = Path::new(
        &std::env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR (run under cargo test)"),
    )
    .join("../hack/runsc/build.sh");
    let out = std::process::Command::new(&script)
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", script.display()));
    assert!(
        out.status.success(),
        "building the current runsc failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

/// Polls `cond` every 100 ms until it holds; panics with `what` after `secs`.
/// The lines of `iptables -S` that mention any of `needles`.
pub fn iptables_lines_mentioning(needles: &[&str]) -> Vec<String> {
    let out = std::process::Command::new("iptables")
        .args(["-w", "5", "-S"])
        .output()
        .unwrap();
    assert!(out.status.success());
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| needles.iter().any(|n| l.contains(n)))
        .map(str::to_string)
        .collect()
}

pub async fn poll_until(what: &str, secs: u64, mut cond: impl AsyncFnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(secs);
    while !cond().await {
        assert!(
            std::time::Instant::now() < deadline,
            "{what} within {secs}s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

impl Harness {
    /// `n` branches of snapshot `snap_id`, named `b0`.., tracking nothing.
    pub async fn fork_n(&self, snap_id: &str, n: u32) -> Vec<LocalSandbox> {
        self.engine
            .fork(
                snap_id,
                n,
                &ramify_engine::engine::ForkOptions {
                    name_prefix: "b".into(),
                    track: vec![],
                },
            )
            .await
            .unwrap_or_else(|e| panic!("fork: {e}"))
    }

    /// `n` branches of a fresh snapshot of `parent`, named `b0`...
    pub async fn snapshot_and_fork(&self, parent: &mut LocalSandbox, n: u32) -> Vec<LocalSandbox> {
        let snap = self
            .engine
            .snapshot(parent, None)
            .await
            .unwrap_or_else(|e| panic!("snapshot: {e}"));
        self.fork_n(&snap.meta.id, n).await
    }

    pub fn workload(&self, script: &str) -> WorkloadSpec {
        WorkloadSpec {
            args: vec!["/bin/sh".into(), "-c".into(), script.into()],
            env: vec![("PATH".into(), "/bin".into())],
            cwd: "/".into(),
            hostname: "sandbox".into(),
            user: None,
            system_files: true,
            system_file_mounts: Vec::new(),
            resources: Resources {
                cpu_millis: Some(1000),
                memory_bytes: Some(512 << 20),
                pids: None,
            },
        }
    }

    pub async fn start(&self, name: &str, script: &str, egress: Vec<Allowed>) -> LocalSandbox {
        self.start_from(name, &self.rootfs.clone(), script, egress)
            .await
    }

    /// Starts a sandbox from another rootfs (inside one of the engine's roots).
    pub async fn start_from(
        &self,
        name: &str,
        rootfs: &Path,
        script: &str,
        egress: Vec<Allowed>,
    ) -> LocalSandbox {
        self.engine
            .start(StartRequest {
                name: name.into(),
                rootfs: RootfsSource::Dir(rootfs.to_path_buf()),
                workload: self.workload(script),
                egress_allow: egress,
            })
            .await
            .unwrap_or_else(|e| panic!("start {name}: {e}"))
    }

    /// A private copy of the shared rootfs at `<dir>/roots/<name>` (a test's own root),
    /// for tests that move or change it.
    pub fn own_rootfs(&self, name: &str) -> PathBuf {
        let rootfs = self.dir.join(ROOTS).join(name);
        let st = std::process::Command::new("cp")
            .arg("-a")
            .arg(&self.rootfs)
            .arg(&rootfs)
            .status()
            .unwrap();
        assert!(st.success(), "copying the rootfs to {}", rootfs.display());
        rootfs
    }

    pub async fn sh(&self, sb: &LocalSandbox, script: &str) -> String {
        let out = self
            .engine
            .exec(sb, &["/bin/sh", "-c", script])
            .await
            .unwrap_or_else(|e| panic!("exec: {e}"));
        if out.code != 0 {
            // What gVisor said meanwhile: why a command was killed (a signal, a fault).
            let log =
                std::fs::read_to_string(self.engine.runsc().boot_log(sb.ctx())).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            panic!(
                "`{script}` in {} exited {}: {}{}\n--- the sandbox's log, last lines ---\n{}",
                sb.name,
                out.code,
                out.stdout_str(),
                out.stderr_str(),
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
        out.stdout_str()
    }

    pub async fn counter(&self, sb: &LocalSandbox) -> u64 {
        // The workload rewrites the file with `>`: a read can land between the truncate and
        // the write, so read until it is not empty.
        self.sh(sb, READ_COUNTER).await.trim().parse().unwrap()
    }

    /// Destroy and assert nothing is left on the host.
    pub async fn destroy_clean(&self, sb: LocalSandbox) {
        let (id, dir, cg) = (sb.id.clone(), sb.dir.clone(), sb.cgroups_path().to_string());
        self.engine
            .destroy(sb)
            .await
            .unwrap_or_else(|e| panic!("destroy {id}: {e}"));
        let left = self.engine.leftovers(&id, &dir, &cg).await;
        assert!(left.is_empty(), "leftovers of {id}: {left:#?}");
    }

    pub async fn finish(self) {
        for id in self.engine.store().list().unwrap() {
            self.engine.store().remove(&id.id).unwrap();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Polls `check` every 50 ms until it yields a value, and fails with `what` once
/// `within` has passed: the suite's wait for anything that happens asynchronously
/// (never a fixed sleep before an assertion).
pub async fn eventually<T, F, Fut>(within: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = std::time::Instant::now() + within;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "not within {within:?}: {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

impl Harness {
    /// Waits until the COUNTER workload of `sb` has gone past `floor`; returns the value.
    pub async fn counter_past(&self, sb: &LocalSandbox, floor: u64) -> u64 {
        eventually(
            Duration::from_secs(30),
            &format!("the counter of {} to pass {floor}", sb.name),
            || async move {
                let c = self.counter(sb).await;
                (c > floor).then_some(c)
            },
        )
        .await
    }

    /// Waits until the file `path` in `sb` exists and is not empty.
    pub async fn written(&self, sb: &LocalSandbox, path: &str) {
        let script = format!("[ -s {path} ] && echo yes || echo no");
        eventually(
            Duration::from_secs(30),
            &format!("{path} to be written in {}", sb.name),
            || {
                let script = script.clone();
                async move { (self.sh(sb, &script).await.trim() == "yes").then_some(()) }
            },
        )
        .await
    }
}

const READ_COUNTER: &str =
    "while :; do c=$(cat /tmp/counter); [ -n \"$c\" ] && break; done; echo $c";

pub const COUNTER: &str =
    "i=0; while true; do i=$((i+1)); echo $i > /tmp/counter; sleep 0.05; done";

impl Harness {
    /// Assert no sandbox this engine ever created, except `keep`, left anything behind.
    pub async fn assert_no_leftovers_except(&self, keep: &[&str]) {
        for id in self.engine.issued_ids() {
            if keep.contains(&id.as_str()) {
                continue;
            }
            let (dir, cg) = self.engine.paths_of(&id);
            let left = self.engine.leftovers(&id, &dir, &cg).await;
            assert!(left.is_empty(), "leftovers of {id}: {left:#?}");
        }
    }
}

/// A stand-in for "another machine": a network namespace joined to the host by a veth
/// pair, routed (through the host's FORWARD path) like any address off this node. Its
/// name is an orphan-sweepable id (`<PREFIX><pid>-ext<n>`), so a crashed test leaves
/// nothing the next run does not remove. Dropping it deletes the netns and the pair.
pub struct ExtNet {
    pub netns: String,
    /// The address of the outside machine.
    pub ip: std::net::Ipv4Addr,
}

impl ExtNet {
    pub fn new() -> ExtNet {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let pid = std::process::id();
        let netns = format!("{PREFIX}{pid}-ext{n}");
        let host_if = format!("rx{pid}x{n}");
        assert!(host_if.len() <= 15, "{host_if}");
        // 198.18.0.0/15 (benchmarking range): one /30 per ExtNet.
        let third = (pid % 256) as u8;
        let fourth = ((n % 64) * 4) as u8;
        let host_ip = std::net::Ipv4Addr::new(198, 18, third, fourth + 1);
        let ip = std::net::Ipv4Addr::new(198, 18, third, fourth + 2);
        let run = |args: &[&str]| {
            let out = std::process::Command::new("ip")
                .args(args)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "ip {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        let ext = ExtNet { netns, ip };
        run(&["netns", "add", &ext.netns]);
        run(&[
            "link", "add", &host_if, "type", "veth", "peer", "name", "ext0", "netns", &ext.netns,
        ]);
        run(&["addr", "add", &format!("{host_ip}/30"), "dev", &host_if]);
        run(&["link", "set", &host_if, "up"]);
        run(&[
            "-n",
            &ext.netns,
            "addr",
            "add",
            &format!("{ip}/30"),
            "dev",
            "ext0",
        ]);
        run(&["-n", &ext.netns, "link", "set", "ext0", "up"]);
        run(&["-n", &ext.netns, "link", "set", "lo", "up"]);
        run(&[
            "-n",
            &ext.netns,
            "route",
            "add",
            "default",
            "via",
            &host_ip.to_string(),
        ]);
        ext
    }

    /// A TCP listener on `ip` inside the namespace, bound on a thread that joined it
    /// (the socket stays in the namespace it was created in). Returns its port and
    /// what the first connection sent, or None if none came within `wait`.
    pub fn listen_once(&self, wait: Duration) -> (u16, std::thread::JoinHandle<Option<String>>) {
        let ns = std::fs::File::open(Path::new("/run/netns").join(&self.netns)).unwrap();
        let ip = self.ip;
        let (tx, rx) = std::sync::mpsc::channel();
        let t = std::thread::spawn(move || {
            nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
            let l = std::net::TcpListener::bind((ip, 0)).unwrap();
            tx.send(l.local_addr().unwrap().port()).unwrap();
            l.set_nonblocking(true).unwrap();
            let deadline = std::time::Instant::now() + wait;
            while std::time::Instant::now() < deadline {
                match l.accept() {
                    Ok((mut s, _)) => {
                        use std::io::Read;
                        s.set_nonblocking(false).unwrap();
                        s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
                        let mut buf = String::new();
                        let _ = s.read_to_string(&mut buf);
                        return Some(buf);
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
            None
        });
        (rx.recv().unwrap(), t)
    }
}

impl Drop for ExtNet {
    fn drop(&mut self) {
        // The veth pair goes with the namespace.
        let _ = std::process::Command::new("ip")
            .args(["netns", "delete", &self.netns])
            .status();
    }
}

/// A size-limited tmpfs mounted on `dir` for the life of the guard: unmounted on drop,
/// including when the test panics.
pub struct Tmpfs {
    pub dir: PathBuf,
}

impl Tmpfs {
    pub fn mount(dir: &Path, size: &str) -> Tmpfs {
        std::fs::create_dir_all(dir).unwrap();
        let st = std::process::Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size}"),
                "ramify-test-tmpfs",
            ])
            .arg(dir)
            .status()
            .unwrap();
        assert!(st.success(), "mount tmpfs on {}", dir.display());
        Tmpfs {
            dir: dir.to_path_buf(),
        }
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let ok = std::process::Command::new("umount")
            .arg(&self.dir)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            // Something still holds a file there: detach it now, freed when released.
            let _ = std::process::Command::new("umount")
                .arg("-l")
                .arg(&self.dir)
                .status();
        }
    }
}
