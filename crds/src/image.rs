//! Sandboxes from container images (`spec.image`): the pull policy, pull secrets, and
//! the reasons the node agent reports a pull with (Kubernetes' own words, so that
//! people and tools that know Pods read them alike).

use serde::{Deserialize, Serialize};

/// When the node agent asks the registry for `spec.image`, like a Pod's
/// `imagePullPolicy`. Unset: `Always` for a `:latest` (or untagged) reference,
/// `IfNotPresent` otherwise.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, schemars::JsonSchema)]
pub enum ImagePullPolicy {
    /// Resolve the reference at the registry on every start (layers already cached
    /// are not downloaded again).
    Always,
    /// Use the image this namespace pulled before under this reference; pull only
    /// when there is none.
    IfNotPresent,
    /// Never contact the registry: start only from an image this namespace pulled
    /// before (`ErrImageNeverPull` otherwise).
    Never,
}

/// A Secret in the Sandbox's namespace, by name (of type
/// `kubernetes.io/dockerconfigjson`), like a Pod's `imagePullSecrets` entry.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, schemars::JsonSchema)]
pub struct ImagePullSecret {
    /// Name of the Secret.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
}

/// `Ready` reason while (and when) the registry refused or failed a pull: the message
/// carries the registry's words. Retried with backoff.
pub const REASON_ERR_IMAGE_PULL: &str = "ErrImagePull";
/// `Ready` reason after repeated pull failures, while the agent waits to retry.
pub const REASON_IMAGE_PULL_BACKOFF: &str = "ImagePullBackOff";
/// `Ready` reason (and the sandbox `Failed`) when `spec.image` is not a reference.
pub const REASON_INVALID_IMAGE_NAME: &str = "InvalidImageName";
/// `Ready` reason when the policy is `Never` and this namespace has no such image.
pub const REASON_ERR_IMAGE_NEVER_PULL: &str = "ErrImageNeverPull";
/// `Ready` reason (and the sandbox `Failed`) when the image's content is refused: a
/// layer entry that would leave its root, a device node, an unsupported media type.
pub const REASON_IMAGE_REFUSED: &str = "ImageRefused";
/// `Ready` reason while the image is being pulled and unpacked.
pub const REASON_PULLING: &str = "Pulling";
/// Event reason once the image is on the node (its digest in the message).
pub const REASON_PULLED: &str = "Pulled";

/// The Secret type an image pull secret must have.
pub const SECRET_TYPE_DOCKERCONFIGJSON: &str = "kubernetes.io/dockerconfigjson";
/// The key of that Secret holding the docker config.
pub const SECRET_KEY_DOCKERCONFIGJSON: &str = ".dockerconfigjson";

/// What `spec.image` must look like (RE2, anchored): an optional registry host (as
/// Docker tells one: it has a dot or a port, or is `localhost`), lowercase repository
/// path components, an optional tag and an optional
/// sha256 digest. The agent parses it again (`InvalidImageName` if it still fails).
pub const IMAGE_REFERENCE_PATTERN: &str = r"^(([A-Za-z0-9-]+\.)+[A-Za-z0-9-]+(:[0-9]{1,5})?/|[A-Za-z0-9-]+:[0-9]{1,5}/|localhost/)?[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*(/[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*)*(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[a-f0-9]{64})?$";
