//! Cluster mode: the agent's heartbeat in the volume of every Pod holding one of its
//! sandboxes (`ramify_crds::pod::POD_HEARTBEAT_FILE`). A workspace Pod told to stop
//! while the agent is down (an eviction racing the agent's restart) finds it stale and
//! waits for the agent to come back and move the workspace out, instead of ending with
//! the workspace inside. The beat starts only once the Pod watch has synced: from then
//! on the agent sees an eviction and decides within the Pod's short linger.

use std::sync::Arc;
use std::time::Duration;

use ramify_crds::pod::{POD_HEARTBEAT_FILE, POD_HEARTBEAT_SECONDS, pod_volume_on_host};
use tracing::debug;

use super::Agent;

impl Agent {
    /// Touches the heartbeat of every held sandbox's Pod, every
    /// [`POD_HEARTBEAT_SECONDS`], once the Pod watch has synced.
    pub(super) async fn heartbeat_pods(self: Arc<Self>) {
        while self.pods_synced().is_none() {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        loop {
            self.beat_once();
            tokio::time::sleep(Duration::from_secs(POD_HEARTBEAT_SECONDS)).await;
        }
    }

    /// Records that the sandbox `uid` lives in the Pod `pod` (none: in no Pod any
    /// more). A Pod left without a sandbox of this agent loses its heartbeat: told to
    /// stop, it has nothing to wait for (a stale one would hold it for its grace
    /// period, as if the agent were down).
    pub(super) fn place(&self, uid: &str, pod: Option<&str>) {
        if let Some(old) = self.held.place(uid, pod) {
            let beat =
                pod_volume_on_host(&self.cfg.kubelet_root_dir, &old).join(POD_HEARTBEAT_FILE);
            if let Err(e) = std::fs::remove_file(&beat)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                debug!(pod_uid = %old, error = %e, "could not remove a Pod's heartbeat");
            }
        }
    }

    fn beat_once(&self) {
        let Some(pods) = self.held.pods() else {
            return;
        };
        let pods: Vec<String> = pods.into_values().collect();
        for uid in pods {
            let volume = pod_volume_on_host(&self.cfg.kubelet_root_dir, &uid);
            // A Pod whose volume is gone is ending: nothing to tell it.
            if volume.is_dir()
                && let Err(e) = std::fs::write(volume.join(POD_HEARTBEAT_FILE), b"alive\n")
            {
                debug!(pod_uid = %uid, error = %e, "could not touch a Pod's heartbeat");
            }
        }
    }
}
