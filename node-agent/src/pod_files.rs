//! Cluster mode: the files the node agent shares with `ramify-pod` through the Pod's
//! `emptyDir`, by the names `ramify_crds::pod` gives them (the engine writes them:
//! [`ramify_engine::pod_files`]). `ramify-pod` runs as
//! [`POD_RUN_AS_USER`](ramify_crds::pod::POD_RUN_AS_USER), not root.

use std::path::Path;

use ramify_crds::pod::POD_EXIT_FILE;

use crate::error::Result;

/// Writes the exit code `ramify-pod` exits with into the Pod's volume, once the
/// sandbox has ended.
pub fn write_exit(volume: &Path, code: Option<i32>) -> Result<()> {
    Ok(ramify_engine::pod_files::write_exit(
        &volume.join(POD_EXIT_FILE),
        code,
    )?)
}
