//! `RootfsClass`: a root file system a cluster administrator declares for Sandboxes.

use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

/// Reason (status condition and Event) of a Sandbox whose root file system the node
/// agent refused: an unknown class, or a class whose directory is not inside the
/// agent's allowed rootfs roots. Such a sandbox never starts.
pub const REASON_ROOTFS_REFUSED: &str = "RootfsRefused";

/// A root file system on the nodes, declared by a cluster administrator. Sandboxes
/// name it with `spec.rootfs.class`; a Sandbox cannot name a node directory itself.
/// The node agent only accepts a class whose `path` lies inside one of its
/// `--rootfs-root` directories, resolved without following a symlink or `..` out of
/// that root, and never overlapping the agent's own state.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[kube(
    group = "ramify.dev",
    version = "v1alpha1",
    kind = "RootfsClass",
    shortname = "rfc",
    category = "ramify",
    printcolumn = r#"{"name":"Path","type":"string","jsonPath":".spec.path"}"#,
    printcolumn = r#"{"name":"OCI-Ref","type":"string","jsonPath":".spec.ociRef"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct RootfsClassSpec {
    /// Absolute node path of a root file system directory (or of an OCI image layout
    /// directory when `ociRef` is set). It must lie inside one of the node agent's
    /// `--rootfs-root` directories; the agent refuses anything else.
    #[x_kube(validation = Rule::new("self.startsWith('/') && !self.matches('(^|/)\\\\.\\\\.(/|$)')").message("spec.path must be an absolute path without '..'"))]
    #[schemars(length(min = 1, max = 4096))]
    pub path: String,
    /// Reference (tag) of a manifest in the OCI image layout at `path`; when empty,
    /// `path` is a plain directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 256))]
    pub oci_ref: Option<String>,
}
