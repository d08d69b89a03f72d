//! A Sandbox's `spec.rootfs.class`: the administrator's RootfsClass it names, turned
//! into a [`RootfsSource`] the engine resolves inside this node's rootfs roots.

use kube::Client;
use kube::api::Api;
use ramify_crds::{Rootfs, RootfsClass};

use crate::error::{EngineError, Error, Result};
use ramify_engine::rootfs::RootfsSource;

/// The class a Sandbox names and where it says its root filesystem is. Refusals
/// (no class named, a removed field set, no such class) name the Sandbox field; a
/// failed API read is returned as is (transient: the caller retries).
pub async fn source_of(client: &Client, rootfs: &Rootfs) -> Result<(String, RootfsSource)> {
    // The schema rejects these; an older CRD in the cluster might not.
    if let Some(p) = &rootfs.path {
        return Err(Error::Engine(EngineError::RootfsRefused(format!(
            "spec.rootfs.path {p:?}: a Sandbox cannot name a node directory; set spec.rootfs.class"
        ))));
    }
    if rootfs.oci_ref.is_some() {
        return Err(Error::Engine(EngineError::RootfsRefused(
            "spec.rootfs.ociRef: a Sandbox cannot name a node OCI layout; set spec.rootfs.class"
                .into(),
        )));
    }
    let Some(name) = rootfs.class.clone() else {
        return Err(Error::Engine(EngineError::RootfsRefused(
            "spec.rootfs.class must name a RootfsClass".into(),
        )));
    };
    let api: Api<RootfsClass> = Api::all(client.clone());
    let class = api.get_opt(&name).await?.ok_or_else(|| {
        Error::Engine(EngineError::RootfsRefused(format!(
            "spec.rootfs.class {name:?}: no RootfsClass of that name (kubectl get rootfsclasses)"
        )))
    })?;
    let path = class.spec.path.clone().into();
    let source = match class.spec.oci_ref {
        Some(reference) => RootfsSource::OciLayout {
            path,
            reference: Some(reference),
        },
        None => RootfsSource::Dir(path),
    };
    Ok((name, source))
}

/// An engine refusal (or a rootfs that is not usable) of the class's path, said in
/// terms of the Sandbox's field.
pub fn name_the_field(class: &str, source: &RootfsSource, e: Error) -> Error {
    let path = match source {
        RootfsSource::Dir(p) | RootfsSource::OciLayout { path: p, .. } => p,
    };
    let say = |m: String| {
        format!(
            "spec.rootfs.class {class:?} (RootfsClass path {}): {m}",
            path.display()
        )
    };
    match e {
        Error::Engine(EngineError::RootfsRefused(m)) => {
            Error::Engine(EngineError::RootfsRefused(say(m)))
        }
        Error::Engine(EngineError::Rootfs(m)) => Error::Engine(EngineError::Rootfs(say(m))),
        other => other,
    }
}
