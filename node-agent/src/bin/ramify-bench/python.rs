//! The python scenario (`--scenarios python --python-tar TAR`): what a branch of a real
//! workspace costs in memory, and how much of it is only read.
//!
//! The workspace is the image tests' (Debian with python3 and sqlite3, the root
//! filesystem `hack/images/debootstrap.sh` builds): a python process seeds a
//! `--python-rows` SQLite database under `/work` (the sandbox's memory) and holds a
//! `--python-dict`-entry dict. It is snapshotted and forked `--python-branches` ways,
//! restored lazily and then in the background (every page loaded: a full copy, what
//! every branch cost before lazy pages), in one run. Each branch does a branch's work:
//! a migration that rewrites a tenth of the rows, a query over every row, and the
//! workspace process summing its dict. Each branch's memory cgroup is read idle and
//! after its work.
//!
//! Then the read-only share (the step after lazy pages: mapping the pages file
//! privately instead of copying a page on first touch): every page of a lazy branch's
//! memory file, after its work, is compared with the snapshot's pages: a page equal to
//! one of the image's is one the branch only read, and could be shared.

use std::collections::HashSet;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use nix::unistd::{Whence, lseek};
use ramify_engine::engine::{Engine, ForkOptions, LocalSandbox, PAGES_FILE, StartRequest};
use ramify_engine::placement::Standalone;
use ramify_engine::rootfs::RootfsSource;
use ramify_engine::runsc::{RestorePages, Runsc};
use ramify_engine::spec::{Resources, WorkloadSpec};
use sha2::{Digest, Sha256};

use super::lazy::engine_in;
use super::mib;

const PAGE: usize = 4096;

/// The workspace process: seeds the database, holds the dict, and on `/work/ask` sums
/// the lengths of the dict's values (reading every entry, as a branch reading its
/// in-memory state does; CPython's reference counts write to what it reads).
fn workspace_script(rows: u64, dict: u64) -> String {
    format!(
        r#"
import os, sqlite3, time
os.makedirs('/work', exist_ok=True)
db = sqlite3.connect('/work/app.db')
db.execute('CREATE TABLE items (id INTEGER PRIMARY KEY, name TEXT NOT NULL)')
db.executemany('INSERT INTO items VALUES (?, ?)', ((i, 'item-%d' % i) for i in range({rows})))
db.commit()
db.close()
cache = {{i: 'value-%d' % i for i in range({dict})}}
open('/tmp/ready', 'w').write('ok')
while True:
    if os.path.exists('/work/ask'):
        os.remove('/work/ask')
        open('/work/answer.tmp', 'w').write(str(sum(len(v) for v in cache.values())))
        os.rename('/work/answer.tmp', '/work/answer')
    time.sleep(0.05)
"#
    )
}

/// A branch's work: a migration of a tenth of the rows, a query over all of them, and
/// the workspace process's sum over its dict.
const BRANCH_WORK: &str = r#"
import os, sqlite3, time
db = sqlite3.connect('/work/app.db')
db.execute("UPDATE items SET name = name || '-migrated' WHERE id % 10 = 0")
db.commit()
n = db.execute("SELECT count(*), sum(length(name)) FROM items").fetchone()
open('/work/ask', 'w').write('1')
for _ in range(1200):
    if os.path.exists('/work/answer'):
        break
    time.sleep(0.05)
print(n[0], open('/work/answer').read())
"#;

pub struct PythonBench<'a> {
    pub engine: &'a Engine,
    pub placement: &'a Arc<Standalone>,
    /// Where the root filesystem is unpacked (an allowed root of the engine).
    pub roots: &'a Path,
    pub tar: &'a Path,
    pub rows: u64,
    pub dict: u64,
    pub branches: u32,
}

/// Unpacks the root filesystem tarball once (with the control mount's mount point).
fn unpack(tar: &Path, roots: &Path) -> Result<PathBuf> {
    let dir = roots.join("workspace-py");
    if dir.join("run/ramify").is_dir() {
        return Ok(dir);
    }
    std::fs::create_dir_all(&dir)?;
    let st = std::process::Command::new("tar")
        .args(["-xpf"])
        .arg(tar)
        .args(["--numeric-owner", "-C"])
        .arg(&dir)
        .status()?;
    if !st.success() {
        bail!("unpacking {}", tar.display());
    }
    std::fs::create_dir_all(dir.join("run/ramify"))?;
    Ok(dir)
}

fn workload(script: String) -> WorkloadSpec {
    WorkloadSpec {
        args: vec!["python3".into(), "-c".into(), script],
        env: vec![("PATH".into(), "/usr/local/bin:/usr/bin:/bin".into())],
        cwd: "/".into(),
        hostname: "workspace".into(),
        user: None,
        system_files: false,
        system_file_mounts: Vec::new(),
        resources: Resources {
            cpu_millis: None,
            memory_bytes: Some(1 << 30),
            pids: None,
        },
    }
}

/// The branch's cgroup memory once it stops changing by more than 1 MiB over half a
/// second (a background restore loading its pages settles; a lazy one holds still).
async fn settled(engine: &Engine, sb: &LocalSandbox) -> Result<u64> {
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut last = engine.memory_bytes(sb)?;
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = engine.memory_bytes(sb)?;
        if now.abs_diff(last) < (1 << 20) || Instant::now() > deadline {
            return Ok(now);
        }
        last = now;
    }
}

/// The SHA-256 of every non-zero page of the image's pages file.
fn image_pages(pages: &Path) -> Result<HashSet<[u8; 32]>> {
    let mut f = std::fs::File::open(pages).with_context(|| pages.display().to_string())?;
    let mut out = HashSet::new();
    let mut buf = vec![0u8; PAGE];
    loop {
        match f.read_exact(&mut buf) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => break,
            Err(e) => return Err(e.into()),
        }
        if buf.iter().any(|&b| b != 0) {
            out.insert(Sha256::digest(&buf).into());
        }
    }
    Ok(out)
}

/// A branch's memory after its work, page by page: resident, equal to a page of its
/// image, zero.
#[derive(Default)]
struct Share {
    resident: u64,
    same: u64,
    zero: u64,
}

/// Walks the populated ranges (SEEK_DATA / SEEK_HOLE) of the sandbox process's memory
/// files (gVisor's memfds), through `/proc/<pid>/fd`.
fn share(sb: &LocalSandbox, image: &HashSet<[u8; 32]>) -> Result<Share> {
    let pid = Runsc::sandbox_pid(sb.ctx()).context("the branch's sandbox process")?;
    let mut out = Share::default();
    let mut buf = vec![0u8; PAGE];
    for fd in std::fs::read_dir(format!("/proc/{pid}/fd"))?.flatten() {
        let Ok(target) = std::fs::read_link(fd.path()) else {
            continue;
        };
        // gVisor's memory files; not its small bookkeeping memfds (memory-usage).
        if !target.to_string_lossy().starts_with("/memfd:")
            || target.to_string_lossy().contains("memory-usage")
        {
            continue;
        }
        let f = std::fs::File::open(fd.path())?;
        let len = f.metadata()?.len();
        let raw = std::os::fd::AsRawFd::as_raw_fd(&f);
        let mut off: i64 = 0;
        while (off as u64) < len {
            // ENXIO: no data after off.
            let Ok(data) = lseek(raw, off, Whence::SeekData) else {
                break;
            };
            let end = lseek(raw, data, Whence::SeekHole).unwrap_or(len as i64);
            let mut at = data;
            while at + PAGE as i64 <= end {
                f.read_exact_at(&mut buf, at as u64).with_context(|| {
                    format!("{} at {at} (len {len}, data to {end})", target.display())
                })?;
                out.resident += PAGE as u64;
                if buf.iter().all(|&b| b == 0) {
                    out.zero += PAGE as u64;
                } else if image.contains(&<[u8; 32]>::from(Sha256::digest(&buf))) {
                    out.same += PAGE as u64;
                }
                at += PAGE as i64;
            }
            off = end;
        }
    }
    Ok(out)
}

fn pct(part: u64, whole: u64) -> String {
    format!("{:.0}%", part as f64 * 100.0 / whole.max(1) as f64)
}

impl PythonBench<'_> {
    pub async fn run(&self) -> Result<()> {
        let root = unpack(self.tar, self.roots)?;
        let lazy = engine_in(self.engine, self.placement, RestorePages::Lazy).await?;
        let background = engine_in(self.engine, self.placement, RestorePages::Background).await?;
        let n = self.branches;
        let mut src = lazy
            .start(StartRequest {
                name: "py-src".into(),
                rootfs: RootfsSource::Dir(root),
                workload: workload(workspace_script(self.rows, self.dict)),
                egress_allow: vec![],
            })
            .await?;
        let prepared = async {
            let deadline = Instant::now() + Duration::from_secs(600);
            while lazy.exec(&src, &["test", "-e", "/tmp/ready"]).await?.code != 0 {
                if Instant::now() > deadline {
                    bail!("the python workspace was not seeded in 10 minutes");
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            let before = lazy.memory_bytes(&src)?;
            let snap = lazy.snapshot(&mut src, None).await?;
            let after = lazy.memory_bytes(&src)?;
            anyhow::Ok((before, snap, after))
        }
        .await;
        lazy.destroy(src).await?;
        let (src_before, snap, src_after) = prepared?;
        let id = snap.meta.id.clone();
        let result = self
            .measure(&lazy, &background, &id, n, (src_before, src_after))
            .await;
        lazy.store().remove(&id)?;
        result
    }

    async fn measure(
        &self,
        lazy: &Engine,
        background: &Engine,
        id: &str,
        n: u32,
        (src_before, src_after): (u64, u64),
    ) -> Result<()> {
        let (meta, img) = lazy.store().verify(id, lazy.runsc().version())?;
        let image = image_pages(&img.join(PAGES_FILE)).context("the image's pages")?;
        let mut rows = Vec::new();
        let mut shares = Vec::new();
        for (mode, engine) in [("lazy", lazy), ("background (a full copy)", background)] {
            let branches = engine
                .fork(
                    id,
                    n,
                    &ForkOptions {
                        name_prefix: format!("py-{}", &mode[..4]),
                        track: vec![],
                    },
                )
                .await?;
            let measured = async {
                let mut idle = 0;
                for b in &branches {
                    idle += settled(engine, b).await?;
                }
                for b in &branches {
                    let out = engine.exec(b, &["python3", "-c", BRANCH_WORK]).await?;
                    if out.code != 0 {
                        bail!("the work of {} failed: {}", b.name, out.stderr_str());
                    }
                }
                let mut worked = 0;
                for b in &branches {
                    worked += settled(engine, b).await?;
                }
                if mode == "lazy" {
                    for b in &branches {
                        shares.push(share(b, &image)?);
                    }
                }
                anyhow::Ok((idle, worked))
            }
            .await;
            for b in branches {
                engine.destroy(b).await?;
            }
            rows.push((mode, measured?));
        }
        let per = |b: u64| mib(b / u64::from(n));
        println!();
        println!(
            "## A python workspace ({} rows in SQLite, a {}-entry dict) forked {n} ways",
            self.rows, self.dict
        );
        println!(
            "The source: {} in its memory cgroup before its snapshot, {} after; the image: {}.",
            mib(src_before),
            mib(src_after),
            mib(meta.size_bytes)
        );
        println!();
        println!(
            "| restored | per branch, idle | per branch, after its work | all {n} branches after their work |"
        );
        println!("|---|---|---|---|");
        for (mode, (idle, worked)) in &rows {
            println!(
                "| {mode} | {} | {} | {} |",
                per(*idle),
                per(*worked),
                mib(*worked)
            );
        }
        let total = shares.iter().fold(Share::default(), |a, s| Share {
            resident: a.resident + s.resident,
            same: a.same + s.same,
            zero: a.zero + s.zero,
        });
        let own = total.resident - total.same - total.zero;
        println!();
        println!(
            "Of a lazy branch's memory file after its work ({} resident per branch): {} only read (equal to a page of the snapshot: sharable by mapping the pages file privately), {} zero, {} its own (written or new).",
            per(total.resident),
            pct(total.same, total.resident),
            pct(total.zero, total.resident),
            pct(own, total.resident)
        );
        Ok(())
    }
}
