//! A Sandbox's `spec.image` on this node: its pull secrets (read by name, only those
//! named), the pull itself with its conditions and Events in Kubernetes' words, the
//! image a snapshot pins for its restores, and the cache's garbage collection.

use std::collections::HashSet;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;
use kube::{Client, ResourceExt};
use ramify_crds::{
    REASON_ERR_IMAGE_PULL, REASON_IMAGE_PULL_BACKOFF, REASON_PULLED, REASON_PULLING,
    SECRET_KEY_DOCKERCONFIGJSON, Sandbox as SandboxObj, SandboxPhase,
};
use serde_json::json;
use tracing::{info, warn};

use super::Agent;
use crate::error::{EngineError, Error, Result};
use ramify_engine::Engine;
use ramify_engine::spec::WorkloadSpec;
use ramify_image::{
    Credentials, ImageError, ImageRef, ImageStore, PulledImage, RegistryConfig, credentials_for,
    default_policy,
};

/// How often unused images and layers are looked for (also after every deletion).
pub const IMAGE_GC_INTERVAL: Duration = Duration::from_secs(300);
/// An image this process used within this long is kept even if nothing records it
/// yet (a sandbox starting from it).
pub const IMAGE_GC_GRACE: Duration = Duration::from_secs(600);

/// The node's image cache and its upkeep: the store (opened on first use, under the
/// engine's rootfs cache), pull secrets read by name, the image a snapshot pins, and
/// the garbage collection of what no sandbox or snapshot uses. Its own state; the
/// Sandbox controller's pulls ([`Agent::pull_for`]) go through it.
pub struct Images {
    client: Client,
    engine: Engine,
    registries: RegistryConfig,
    store: OnceLock<Arc<ImageStore>>,
    /// Wakes the GC (a sandbox or snapshot went).
    gc_kick: tokio::sync::Notify,
}

impl Images {
    pub fn new(client: Client, engine: Engine, registries: RegistryConfig) -> Self {
        Self {
            client,
            engine,
            registries,
            store: OnceLock::new(),
            gc_kick: tokio::sync::Notify::new(),
        }
    }

    /// The node's image cache (opened on first use, under the rootfs cache).
    pub fn store(&self) -> Result<&Arc<ImageStore>> {
        if let Some(s) = self.store.get() {
            return Ok(s);
        }
        let store = ImageStore::open(self.engine.rootfs_policy().cache(), self.registries.clone())?;
        let _ = self.store.set(store);
        self.store
            .get()
            .ok_or_else(|| Error::Engine(EngineError::Join("image store not set".into())))
    }

    /// Runs the GC soon (a sandbox or snapshot went).
    pub fn kick_gc(&self) {
        self.gc_kick.notify_one();
    }

    /// The credentials for `registry` from the Secrets `names` of `namespace` (each
    /// read by name; nothing else of the namespace is).
    async fn credentials(
        &self,
        namespace: &str,
        names: &[String],
        registry: &str,
    ) -> Result<Credentials> {
        if names.is_empty() {
            return Ok(Credentials::Anonymous);
        }
        let api: Api<Secret> = Api::namespaced(self.client.clone(), namespace);
        let mut secrets = Vec::new();
        for n in names {
            let s = api.get_opt(n).await?.ok_or_else(|| {
                ImageError::Secret(format!("Secret {n:?} not found in namespace {namespace}"))
            })?;
            let data = s
                .data
                .as_ref()
                .and_then(|d| d.get(SECRET_KEY_DOCKERCONFIGJSON))
                .map(|b| b.0.clone());
            secrets.push((n.clone(), s.type_.clone(), data));
        }
        Ok(credentials_for(&secrets, registry)?)
    }

    /// Makes sure the image a snapshot pins (`status.image`) is on the node before a
    /// restore: from the cache, or pulled again by that digest with the branch's
    /// pull secrets (or its source sandbox's).
    pub async fn ensure_snapshot_image(
        &self,
        secrets: &[ramify_crds::ImagePullSecret],
        snap: &ramify_crds::Snapshot,
    ) -> Result<()> {
        let Some(pinned) = snap.status.as_ref().and_then(|s| s.image.clone()) else {
            return Ok(());
        };
        let store = self.store()?;
        if let Some(d) = snap.status.as_ref().and_then(|s| s.image_digest.as_deref())
            && store.record(d).is_some()
        {
            return Ok(());
        }
        let ns = snap.namespace().unwrap_or_default();
        let mut names: Vec<String> = secrets.iter().map(|s| s.name.clone()).collect();
        if names.is_empty() {
            let sandboxes: Api<SandboxObj> = Api::namespaced(self.client.clone(), &ns);
            if let Some(src) = sandboxes.get_opt(&snap.spec.source.sandbox).await? {
                names = src
                    .spec
                    .image_pull_secrets
                    .iter()
                    .map(|s| s.name.clone())
                    .collect();
            }
        }
        let registry = ImageRef::parse(&pinned)?.registry().to_string();
        let creds = self.credentials(&ns, &names, &registry).await?;
        let p = store.ensure_pinned(&pinned, &creds).await?;
        info!(image = %pinned, millis = p.millis, "snapshot image pulled again by digest");
        Ok(())
    }

    /// The manifest digests some sandbox or snapshot of this node uses.
    async fn in_use(&self, store: &ImageStore) -> Result<HashSet<String>> {
        let mut used = HashSet::new();
        for sb in self.engine.recover().await?.sandboxes {
            used.extend(store.digest_of_rootfs(&sb.rootfs));
        }
        for meta in self.engine.store().list()? {
            used.extend(store.digest_of_rootfs(&meta.rootfs));
        }
        Ok(used)
    }

    /// One GC pass of the image cache.
    pub async fn gc(&self, grace: Duration) -> Result<ramify_image::gc::GcReport> {
        let store = self.store()?;
        let used = self.in_use(store).await?;
        Ok(store.gc(&used, grace).await?)
    }

    /// Runs GC every [`IMAGE_GC_INTERVAL`] and whenever a sandbox or snapshot went (and
    /// the sweep of held snapshot images, `store/held.rs`).
    pub async fn gc_loop(&self) {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(IMAGE_GC_INTERVAL) => {}
                _ = self.gc_kick.notified() => {}
            }
            if let Err(e) = self.gc(IMAGE_GC_GRACE).await {
                warn!(error = %e, "image cache GC failed");
                self.engine.count_cleanup_failure("image gc", e.category());
            }
            // Snapshot images deleted while a sandbox read them, whose readers are gone
            // (a teardown sweeps too; this catches a reader that died on its own).
            if let Err(e) = self.engine.store().sweep_held() {
                warn!(error = %e, "removing deleted snapshot images nobody reads any more");
                self.engine
                    .count_cleanup_failure("held images", e.category());
            }
        }
    }
}

impl Agent {
    /// Pulls (or finds) a fresh sandbox's image, saying so in its status: `Pulling`
    /// while it runs; on a failure `ErrImagePull` (then `ImagePullBackOff` while
    /// retried with backoff) with the registry's message, and a warning Event.
    pub(super) async fn pull_for(&self, obj: &SandboxObj, image: &str) -> Result<PulledImage> {
        let ns = obj.namespace().unwrap_or_default();
        let reference = ImageRef::parse(image)?;
        let policy = obj
            .spec
            .image_pull_policy
            .unwrap_or_else(|| default_policy(&reference));
        let names: Vec<String> = obj
            .spec
            .image_pull_secrets
            .iter()
            .map(|s| s.name.clone())
            .collect();
        let prior = obj
            .status
            .as_ref()
            .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Ready"))
            .map(|c| c.reason.clone())
            .unwrap_or_default();
        let failed_before = prior == REASON_ERR_IMAGE_PULL || prior == REASON_IMAGE_PULL_BACKOFF;
        let creds = self
            .images
            .credentials(&ns, &names, reference.registry())
            .await;
        if !failed_before
            && !creds.as_ref().is_ok_and(|c| {
                self.images
                    .store()
                    .is_ok_and(|i| i.cached(&reference, policy, c, &ns))
            })
        {
            self.write_sandbox_status(
                obj,
                SandboxPhase::Starting,
                None,
                (false, REASON_PULLING, format!("pulling image {image:?}")),
                json!({}),
            )
            .await?;
        }
        let got = async {
            let creds = creds?;
            Ok::<_, Error>(
                self.images
                    .store()?
                    .ensure(&reference, policy, &creds, &ns)
                    .await?,
            )
        }
        .await;
        match got {
            Ok(p) => {
                if p.pulled {
                    self.event(
                        obj,
                        false,
                        REASON_PULLED,
                        format!(
                            "image {image:?} is {} ({} new layers) in {} ms",
                            p.digest, p.layers_fetched, p.millis
                        ),
                    )
                    .await;
                }
                Ok(p)
            }
            // A failed API read (of a Secret) is retried like any other.
            Err(e @ Error::Kube(_)) => Err(e),
            Err(Error::Image(e)) if !e.is_permanent() => {
                // Retried with the per-object backoff; meanwhile said in the status.
                let reason = if failed_before {
                    REASON_IMAGE_PULL_BACKOFF
                } else {
                    e.reason()
                };
                let msg = e.to_string();
                warn!(image, error = %msg, "image pull failed");
                self.write_sandbox_status(
                    obj,
                    SandboxPhase::Starting,
                    None,
                    (false, reason, msg.clone()),
                    json!({}),
                )
                .await?;
                self.event(obj, true, e.reason(), msg).await;
                Err(Error::Image(e))
            }
            Err(e) => Err(e),
        }
    }
}

/// The workload of a Sandbox from an image: what the spec says, the image config
/// for what it leaves out (command: entrypoint + cmd; env: the image's, then the
/// spec's over it; working dir; user).
pub fn workload_with_image(
    mut w: WorkloadSpec,
    obj: &SandboxObj,
    p: &PulledImage,
) -> Result<WorkloadSpec> {
    let c = &p.config;
    if obj.spec.command.is_empty() {
        w.args = c.argv();
        if w.args.is_empty() {
            return Err(Error::Engine(EngineError::Invalid(format!(
                "spec.command is empty and image {} has no entrypoint or cmd",
                p.pinned
            ))));
        }
    }
    let mut env = c.env_pairs();
    for (k, v) in std::mem::take(&mut w.env) {
        env.retain(|(ek, _)| ek != &k);
        env.push((k, v));
    }
    w.env = env;
    if obj.spec.working_dir.is_none() && c.working_dir.starts_with('/') {
        w.cwd = c.working_dir.clone();
    }
    let (uid, gid) = ramify_image::config::resolve_user(&c.user, &p.rootfs).map_err(|why| {
        ImageError::Refused {
            reference: p.pinned.clone(),
            why,
        }
    })?;
    w.user = (uid, gid).ne(&(0, 0)).then_some((uid, gid));
    Ok(w)
}
