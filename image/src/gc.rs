//! Removing what no sandbox or snapshot uses: composed rootfs of manifests nobody
//! references (and not used by this process within the grace period), then the
//! layers no remaining manifest lists, then tag records pointing at removed images.

use std::collections::HashSet;
use std::path::Path;
use std::time::Duration;

use tracing::info;

use super::cache::ImageStore;
use super::{ImageError, Result};

/// What one GC pass removed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct GcReport {
    pub images: Vec<String>,
    pub layers: Vec<String>,
}

fn digests_in(dir: &Path) -> Result<Vec<String>> {
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(ImageError::io(dir, e)),
    };
    let mut out = Vec::new();
    for e in rd {
        let e = e.map_err(|e| ImageError::io(dir, e))?;
        let name = e.file_name().to_string_lossy().into_owned();
        if name.len() == 64 && name.bytes().all(|b| b.is_ascii_hexdigit()) {
            out.push(format!("sha256:{name}"));
        }
    }
    Ok(out)
}

impl ImageStore {
    /// Removes every composed image whose manifest digest is not in `in_use` (nor used
    /// by this process within `grace`), then every layer no kept image lists.
    pub async fn gc(&self, in_use: &HashSet<String>, grace: Duration) -> Result<GcReport> {
        let _guard = self.materialise_lock().await;
        let mut report = GcReport::default();
        let mut kept_layers = HashSet::new();
        for d in digests_in(&self.dir().join("rootfs/sha256"))? {
            let keep = in_use.contains(&d) || self.recently_used(&d, grace);
            match (keep, self.record(&d)) {
                (true, Some(rec)) => kept_layers.extend(rec.layers),
                // Kept but unreadable: its layers cannot be told; keep them all.
                (true, None) => return Ok(report),
                (false, _) => {
                    let p = self.image_dir(&d);
                    std::fs::remove_dir_all(&p).map_err(|e| ImageError::io(&p, e))?;
                    report.images.push(d);
                }
            }
        }
        for l in digests_in(&self.dir().join("layers/sha256"))? {
            if !kept_layers.contains(&l) {
                let p = self.layer_dir(&l);
                std::fs::remove_dir_all(&p).map_err(|e| ImageError::io(&p, e))?;
                report.layers.push(l);
            }
        }
        if !report.images.is_empty() || !report.layers.is_empty() {
            info!(
                images = report.images.len(),
                layers = report.layers.len(),
                "image cache: unused images and layers removed"
            );
        }
        Ok(report)
    }
}
