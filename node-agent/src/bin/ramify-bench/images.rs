//! The images scenario (`--scenarios images --image REF`): what a sandbox from a
//! container image costs on this node, next to plain runsc on the same root by hand.
//!
//! - the first pull of the image (download, digest checks, unpack, compose);
//! - `--image-starts` starts of a sandbox on it with its layers cached (the agent's
//!   image lookup, the netns, cgroup and bundle, `runsc run`), against `runsc run` of
//!   the same composed root by hand in a netns placed beforehand (the runsc floor);
//! - the disk those sandboxes use (one shared copy of the image) against one unpacked
//!   copy, and what a copy per sandbox would take;
//! - a snapshot and a cold fork of 4 of a sandbox of the image, against the same of a
//!   sandbox on a plain copy of the same root (a RootfsClass directory), alternating,
//!   in one run: whether a root from an image forks slower, and where.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Result;
use ramify_crds::ImagePullPolicy;
use ramify_engine::engine::{Engine, ForkOptions, LocalSandbox, StartRequest};
use ramify_engine::placement::{Placement, PlacementRequest, Standalone};
use ramify_engine::rootfs::RootfsSource;
use ramify_engine::runsc::{NetworkMode, SandboxCtx};
use ramify_engine::spec::{BundleParams, Resources, WorkloadSpec, oci_config, write_bundle};
use ramify_image::{Credentials, ImageRef, ImageStore, RegistryConfig};

fn sleeper() -> WorkloadSpec {
    WorkloadSpec {
        args: vec!["/bin/sh".into(), "-c".into(), "sleep 100000".into()],
        env: vec![],
        cwd: "/".into(),
        hostname: "bench".into(),
        user: None,
        system_files: false,
        system_file_mounts: Vec::new(),
        resources: Resources {
            cpu_millis: None,
            memory_bytes: None,
            pids: None,
        },
    }
}

fn median(v: &[Duration]) -> Duration {
    let mut v = v.to_vec();
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

fn ms(d: Duration) -> String {
    format!("{:.0} ms", d.as_secs_f64() * 1000.0)
}

fn list(v: &[Duration]) -> String {
    v.iter()
        .map(|d| format!("{:.0}", d.as_secs_f64() * 1000.0))
        .collect::<Vec<_>>()
        .join(", ")
}

/// `du -sb` of `dir` (hard links counted once, as the disk holds them).
fn du(dir: &Path, exclude: Option<&str>) -> u64 {
    let mut cmd = std::process::Command::new("du");
    cmd.arg("-sb");
    if let Some(x) = exclude {
        cmd.arg(format!("--exclude={x}"));
    }
    let out = cmd.arg(dir).output();
    out.ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .split_whitespace()
                .next()
                .and_then(|n| n.parse().ok())
        })
        .unwrap_or(0)
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1024.0 * 1024.0))
}

/// `runsc run` of `rootfs` by hand, in a netns placed beforehand: only the command
/// is timed. Everything it made is removed before returning.
async fn plain_run(
    engine: &Engine,
    placement: &Standalone,
    dir: &Path,
    rootfs: &Path,
    prefix: &str,
) -> Result<Duration> {
    let id = format!(
        "{prefix}{}-img{}",
        std::process::id(),
        &uuid::Uuid::new_v4().simple().to_string()[..6]
    );
    let p = placement
        .place(&PlacementRequest {
            id: id.clone(),
            egress_allow: vec![],
            pod_uid: None,
        })
        .await?;
    let sdir = dir.join("plain-image").join(&id);
    let control = sdir.join("control");
    std::fs::create_dir_all(&control)?;
    std::fs::create_dir_all(sdir.join("runsc-root"))?;
    let cfg = oci_config(
        &sleeper(),
        &BundleParams {
            rootfs,
            control_dir: &control,
            netns: p.netns.as_deref(),
            cgroups_path: &p.cgroups_path,
        },
    );
    write_bundle(&sdir.join("bundle"), &cfg)?;
    placement.before_start(&p).await?;
    let ctx = SandboxCtx {
        id,
        root: sdir.join("runsc-root"),
        netns: p.netns.clone(),
        network: NetworkMode::Sandbox,
    };
    let t = Instant::now();
    let ran = engine.runsc().run(&ctx, &sdir.join("bundle")).await;
    let took = t.elapsed();
    super::kill_mentioning(&ctx.root.to_string_lossy()).await;
    ramify_engine::cgroup::remove(&p.cgroups_path)?;
    placement.release(&p).await?;
    std::fs::remove_dir_all(&sdir)?;
    ran?;
    Ok(took)
}

pub struct ImageBench<'a> {
    pub engine: &'a Engine,
    pub placement: &'a Standalone,
    pub dir: &'a Path,
    /// The engine's rootfs cache: the image store lives beneath it.
    pub rootfs_cache: &'a Path,
    pub reference: &'a str,
    pub insecure: Vec<String>,
    pub starts: usize,
    pub prefix: &'a str,
}

impl ImageBench<'_> {
    pub async fn run(&self) -> Result<()> {
        let mut live = Vec::new();
        let r = self.run_inner(&mut live).await;
        for sb in live {
            let _ = self.engine.destroy(sb).await;
        }
        r
    }

    async fn run_inner(&self, live: &mut Vec<LocalSandbox>) -> Result<()> {
        let store = ImageStore::open(
            self.rootfs_cache,
            RegistryConfig {
                insecure: self.insecure.clone(),
            },
        )?;
        let reference = ImageRef::parse(self.reference)?;
        let anonymous = Credentials::Anonymous;
        let ensure = || {
            store.ensure(
                &reference,
                ImagePullPolicy::IfNotPresent,
                &anonymous,
                "bench",
            )
        };
        let t = Instant::now();
        let first = ensure().await?;
        let first_pull = t.elapsed();
        let mut starts = Vec::new();
        let mut lookups = Vec::new();
        for i in 0..self.starts {
            let t = Instant::now();
            let got = ensure().await?;
            lookups.push(t.elapsed());
            let sb = self
                .engine
                .start(StartRequest {
                    name: format!("image-{i}"),
                    rootfs: RootfsSource::Dir(got.rootfs.clone()),
                    workload: sleeper(),
                    egress_allow: vec![],
                })
                .await?;
            starts.push(t.elapsed());
            live.push(sb);
        }
        let mut plain = Vec::new();
        for _ in 0..self.starts {
            plain.push(
                plain_run(
                    self.engine,
                    self.placement,
                    self.dir,
                    &first.rootfs,
                    self.prefix,
                )
                .await?,
            );
        }
        let images = store.dir().to_path_buf();
        let cache = du(&images, None);
        let copy = du(&first.rootfs, None);
        let own = du(&self.dir.join("state"), Some("rootfs"));
        println!("\n## images: {} ({})", self.reference, first.digest);
        println!(
            "first pull (download, verify, unpack {} layers, compose): {}",
            first.layers_fetched,
            ms(first_pull)
        );
        println!(
            "start with its layers cached, {} runs (image lookup + netns + cgroup + bundle + runsc run): median {} [{}]; of which the image lookup: median {}",
            self.starts,
            ms(median(&starts)),
            list(&starts),
            ms(median(&lookups))
        );
        println!(
            "plain `runsc run` of the same root by hand (netns placed beforehand, only the command timed): median {} [{}]",
            ms(median(&plain)),
            list(&plain)
        );
        let over = median(&starts).as_secs_f64() - median(&plain).as_secs_f64();
        println!(
            "ramify's start costs {:.0} ms more than plain runsc (target: within 50 ms)",
            over * 1000.0
        );
        println!(
            "disk with {} sandboxes of it live: image cache {} (layers + one composed root of hard links), the sandboxes' own directories {}; one unpacked copy {}, a copy per sandbox would be {}",
            live.len(),
            mib(cache),
            mib(own),
            mib(copy),
            mib(copy * live.len() as u64)
        );
        for sb in live.drain(..) {
            self.engine.destroy(sb).await?;
        }
        self.forks(&first.rootfs).await
    }

    /// A snapshot and a cold fork of 4, of a sandbox on the image's root and of one on
    /// a plain copy of it, alternating, 3 runs each.
    async fn forks(&self, image_root: &Path) -> Result<()> {
        let copy = self.dir.join("roots").join("image-copy");
        if !copy.exists() {
            let st = std::process::Command::new("cp")
                .arg("-a")
                .arg(image_root)
                .arg(&copy)
                .status()?;
            anyhow::ensure!(st.success(), "copying {}", image_root.display());
        }
        let roots = [
            ("image", image_root.to_path_buf()),
            ("plain directory", copy),
        ];
        let mut took: [(Vec<Duration>, Vec<Duration>); 2] = Default::default();
        for run in 0..3 {
            for (i, (label, root)) in roots.iter().enumerate() {
                let mut src = self
                    .engine
                    .start(StartRequest {
                        name: format!("fork-{label}-{run}").replace(' ', "-"),
                        rootfs: RootfsSource::Dir(root.clone()),
                        workload: sleeper(),
                        egress_allow: vec![],
                    })
                    .await?;
                let t = Instant::now();
                let snap = self.engine.snapshot(&mut src, None).await;
                let snapped = t.elapsed();
                let snap = match snap {
                    Ok(s) => s,
                    Err(e) => {
                        self.engine.destroy(src).await?;
                        return Err(e.into());
                    }
                };
                let t = Instant::now();
                let forked = self
                    .engine
                    .fork(&snap.meta.id, 4, &ForkOptions::default())
                    .await;
                let fork = t.elapsed();
                self.engine.destroy(src).await?;
                for b in forked? {
                    self.engine.destroy(b).await?;
                }
                self.engine.store().remove(&snap.meta.id)?;
                took[i].0.push(snapped);
                took[i].1.push(fork);
            }
        }
        println!(
            "\n### fork of a sandbox of the image against one on a plain copy of its root (a RootfsClass directory), 3 runs each, alternating"
        );
        println!("| root | snapshot (median) | cold fork of 4 (median) | fork runs |");
        println!("|---|---|---|---|");
        for (i, (label, _)) in roots.iter().enumerate() {
            println!(
                "| {label} | {} | {} | {} |",
                ms(median(&took[i].0)),
                ms(median(&took[i].1)),
                list(&took[i].1)
            );
        }
        Ok(())
    }
}
