//! The `store` scenario: a real snapshot image (a busybox source with `--store-dirty`
//! MiB of urandom in memory, captured by the engine) uploaded to and downloaded from
//! the object store (`RAMIFY_S3_*`, as hack/objectstore/up.sh writes them), against
//! plain copies of the same bytes in the same run: a local read+write copy (fsync'd,
//! as a download is), and the raw files put to and got from the same store (no zstd,
//! no hashing). The download is also timed reading one range at a time, the same
//! bytes, to show what the parallel ranged reads add.

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use futures::StreamExt;
use object_store::{ObjectStoreExt, WriteMultipart};
use ramify_engine::StartRequest;
use ramify_engine::engine::Engine;
use ramify_engine::rootfs::RootfsSource;
use ramify_engine::store::{SnapshotMeta, SnapshotStore};
use ramify_remote::{Credentials, RemoteConfig, RemoteStore};

fn env(name: &str) -> Result<String> {
    std::env::var(name).with_context(|| {
        format!("{name} is not set: start hack/objectstore/up.sh and `source` its env file")
    })
}

fn rate(bytes: u64, d: Duration) -> String {
    format!(
        "{:>8.1} MB/s ({:.0} ms)",
        bytes as f64 / 1e6 / d.as_secs_f64(),
        d.as_secs_f64() * 1000.0
    )
}

pub async fn run(engine: &Engine, rootfs: &Path, dir: &Path, dirty_mib: u64) -> Result<()> {
    let cfg = RemoteConfig {
        endpoint: env("RAMIFY_S3_ENDPOINT")?,
        bucket: env("RAMIFY_S3_BUCKET")?,
        region: env("RAMIFY_S3_REGION")?,
        prefix: format!("bench/{}", uuid::Uuid::new_v4()),
        credentials: Some(Credentials::from_dir(Path::new(&env(
            "RAMIFY_S3_CREDENTIALS_DIR",
        )?))?),
    };
    let remote = RemoteStore::new(&cfg)?;
    let one_range = RemoteStore::new(&cfg)?.with_ranges_in_flight(1);
    let mut src = engine
        .start(StartRequest {
            name: "store-src".into(),
            rootfs: RootfsSource::Dir(rootfs.to_path_buf()),
            workload: super::workload(dirty_mib),
            egress_allow: vec![],
        })
        .await?;
    let r = async {
        let deadline = Instant::now() + Duration::from_secs(120);
        while engine.exec(&src, &["test", "-e", "/tmp/ready"]).await?.code != 0 {
            anyhow::ensure!(Instant::now() < deadline, "the source did not get ready");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let snap = engine.snapshot(&mut src, None).await?;
        measure(engine.store(), &remote, &one_range, &snap.meta, dir).await
    }
    .await;
    let _ = engine.destroy(src).await;
    r
}

async fn measure(
    local: &SnapshotStore,
    remote: &RemoteStore,
    one_range: &RemoteStore,
    meta: &SnapshotMeta,
    dir: &Path,
) -> Result<()> {
    let size = meta.size_bytes;
    let img = local.dir().join(&meta.id).join("image");
    println!(
        "\n== object store: one snapshot image, {} in {} files ==",
        super::mib(size),
        meta.files.len()
    );
    // Upload and download through ramify (zstd, sha256, multipart, verified).
    let t = Instant::now();
    let up = remote.upload(local, &meta.id).await?;
    let upload = t.elapsed();
    let other = SnapshotStore::open(dir.join("downloaded"))?;
    let t = Instant::now();
    let down = remote.download(&other, &meta.sha256).await?;
    let download = t.elapsed();
    other.verify(&meta.id, &meta.runsc_version)?;
    let serial = SnapshotStore::open(dir.join("downloaded-one-range"))?;
    let t = Instant::now();
    one_range.download(&serial, &meta.sha256).await?;
    let download_one_range = t.elapsed();
    serial.verify(&meta.id, &meta.runsc_version)?;

    // Baselines on the same bytes.
    let copy_dir = dir.join("plain-copy");
    std::fs::create_dir_all(&copy_dir)?;
    let t = Instant::now();
    for f in &meta.files {
        let mut out = std::fs::File::create(copy_dir.join(&f.name))?;
        std::io::copy(&mut std::fs::File::open(img.join(&f.name))?, &mut out)?;
        out.flush()?;
        out.sync_all()?;
    }
    let copy = t.elapsed();
    let store = remote.object_store();
    let raw = |name: &str| object_store::path::Path::from(format!("bench-raw/{}/{name}", meta.id));
    let t = Instant::now();
    for f in &meta.files {
        let bytes = tokio::fs::read(img.join(&f.name)).await?;
        let mut w =
            WriteMultipart::new_with_chunk_size(store.put_multipart(&raw(&f.name)).await?, 8 << 20);
        for c in bytes.chunks(1 << 20) {
            w.wait_for_capacity(2).await?;
            w.write(c);
        }
        w.finish().await?;
    }
    let raw_put = t.elapsed();
    let raw_dir = dir.join("raw-get");
    std::fs::create_dir_all(&raw_dir)?;
    let t = Instant::now();
    for f in &meta.files {
        let mut out = std::fs::File::create(raw_dir.join(&f.name))?;
        let mut s = store.get(&raw(&f.name)).await?.into_stream();
        while let Some(b) = s.next().await {
            out.write_all(&b?)?;
        }
        out.sync_all()?;
    }
    let raw_get = t.elapsed();
    for f in &meta.files {
        let _ = store.delete(&raw(&f.name)).await;
    }
    remote.delete(&meta.sha256).await?;

    println!("| {:<58} | {:>24} |", "", "throughput (image bytes)");
    println!(
        "| {:<58} | {:>24} |",
        "ramify upload (zstd + sha256 + multipart, verified)",
        rate(size, upload)
    );
    println!(
        "| {:<58} | {:>24} |",
        "ramify download (decompress + sha256, landed, verified)",
        rate(size, download)
    );
    println!(
        "| {:<58} | {:>24} |",
        format!(
            "  the same, one {} MiB range at a time (not {})",
            ramify_remote::RANGE_BYTES >> 20,
            ramify_remote::PARALLEL_RANGES
        ),
        rate(size, download_one_range)
    );
    println!(
        "| {:<58} | {:>24} |",
        "baseline: local read+write copy (fsync)",
        rate(size, copy)
    );
    println!(
        "| {:<58} | {:>24} |",
        "baseline: raw put of the files to the same store",
        rate(size, raw_put)
    );
    println!(
        "| {:<58} | {:>24} |",
        "baseline: raw get of the files from the same store",
        rate(size, raw_get)
    );
    println!(
        "stored {} compressed ({:.1}% of the image); received {}; load average {}",
        super::mib(up.bytes_sent),
        up.bytes_sent as f64 * 100.0 / size.max(1) as f64,
        super::mib(down.bytes_received),
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );
    Ok(())
}
