//! The node's warm pools, by Snapshot uid. The map's lock is held only to look a pool
//! up, add or remove it, never across a claim (which may wait seconds for a branch) or
//! a close (which destroys every frozen branch): restores from different snapshots do
//! not wait for each other, nor for a pool being torn down.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::error::{Error, Result};
use ramify_engine::engine::{LocalSandbox, WarmPool};

/// What the map holds: a pool of pre-restored branches.
pub trait Pool: Send + Sync + 'static {
    /// What a claim hands out.
    type Claimed;
    /// Branches the pool keeps.
    fn size(&self) -> usize;
    /// Branches ready to hand out now.
    fn ready(&self) -> usize;
    fn claim_as(
        &self,
        name: &str,
        index: u32,
        timeout: Duration,
    ) -> impl Future<Output = Result<Self::Claimed>> + Send;
    /// Cluster mode: the branch living in the Pod `pod_uid`, or `None` when the pool
    /// holds none there (nor restores one).
    fn claim_in(
        &self,
        pod_uid: &str,
        name: &str,
        index: u32,
        timeout: Duration,
    ) -> impl Future<Output = Option<Result<Self::Claimed>>> + Send;
    /// Cluster mode: the Pods holding a ready branch.
    fn ready_pods(&self) -> Vec<String>;
    fn close(&self) -> impl Future<Output = Result<()>> + Send;
}

impl Pool for WarmPool {
    type Claimed = LocalSandbox;
    fn size(&self) -> usize {
        WarmPool::size(self)
    }
    fn ready(&self) -> usize {
        WarmPool::ready(self)
    }
    async fn claim_as(&self, name: &str, index: u32, timeout: Duration) -> Result<LocalSandbox> {
        Ok(WarmPool::claim_as(self, name, index, timeout).await?)
    }
    async fn claim_in(
        &self,
        pod_uid: &str,
        name: &str,
        index: u32,
        timeout: Duration,
    ) -> Option<Result<LocalSandbox>> {
        if !self.holds_in(pod_uid) {
            return None;
        }
        Some(
            WarmPool::claim_in(self, pod_uid, name, index, timeout)
                .await
                .map_err(Error::from),
        )
    }
    fn ready_pods(&self) -> Vec<String> {
        WarmPool::ready_pods(self)
    }
    async fn close(&self) -> Result<()> {
        Ok(WarmPool::close(self).await?)
    }
}

/// The pools by Snapshot uid.
pub struct Pools<P> {
    map: Mutex<HashMap<String, Arc<P>>>,
}

impl<P> Default for Pools<P> {
    fn default() -> Self {
        Self {
            map: Mutex::default(),
        }
    }
}

impl<P: Pool> Pools<P> {
    fn get(&self, uid: &str) -> Option<Arc<P>> {
        self.map.lock().ok()?.get(uid).cloned()
    }

    /// A branch of the pool of `uid`, when it has one ready; `None` when there is no
    /// such pool or it is empty (the caller restores cold).
    pub async fn claim(
        &self,
        uid: &str,
        name: &str,
        index: u32,
        timeout: Duration,
    ) -> Option<Result<P::Claimed>> {
        let pool = self.get(uid).filter(|p| p.ready() > 0)?;
        Some(pool.claim_as(name, index, timeout).await)
    }

    /// Cluster mode: the branch of the pool of `uid` living in the Pod `pod_uid`;
    /// `None` when there is none there (the caller restores cold in that Pod).
    pub async fn claim_in(
        &self,
        uid: &str,
        pod_uid: &str,
        name: &str,
        index: u32,
        timeout: Duration,
    ) -> Option<Result<P::Claimed>> {
        let pool = self.get(uid)?;
        pool.claim_in(pod_uid, name, index, timeout).await
    }

    /// Cluster mode: the Pods of the pool of `uid` holding a ready branch.
    pub fn ready_pods(&self, uid: &str) -> Vec<String> {
        self.get(uid).map(|p| p.ready_pods()).unwrap_or_default()
    }

    /// Whether `uid` has a pool.
    pub fn has(&self, uid: &str) -> bool {
        self.get(uid).is_some()
    }

    /// Branches ready in the pool of `uid` (0 without one).
    pub fn ready(&self, uid: &str) -> usize {
        self.get(uid).map_or(0, |p| p.ready())
    }

    /// The size of the pool of `uid`, if it has one.
    pub fn size(&self, uid: &str) -> Option<usize> {
        self.get(uid).map(|p| p.size())
    }

    /// Puts `pool` (or none) in place of the pool of `uid` and closes the one it
    /// replaces, if any, outside the lock.
    pub async fn replace(&self, uid: &str, pool: Option<P>) -> Result<()> {
        let old = match self.map.lock() {
            Ok(mut m) => match pool {
                Some(p) => m.insert(uid.to_string(), Arc::new(p)),
                None => m.remove(uid),
            },
            Err(_) => None,
        };
        match old {
            Some(old) => old.close().await,
            None => Ok(()),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use tokio::time::Instant;

    /// A test double of a pool whose claims and close take a known time.
    struct Slow {
        claim: Duration,
        close: Duration,
    }

    impl Pool for Slow {
        type Claimed = String;
        fn size(&self) -> usize {
            1
        }
        fn ready(&self) -> usize {
            1
        }
        async fn claim_as(&self, name: &str, _: u32, _: Duration) -> Result<String> {
            tokio::time::sleep(self.claim).await;
            Ok(name.to_string())
        }
        async fn claim_in(
            &self,
            pod_uid: &str,
            name: &str,
            _: u32,
            _: Duration,
        ) -> Option<Result<String>> {
            (pod_uid == "pod-a").then(|| Ok(format!("{name} in {pod_uid}")))
        }
        fn ready_pods(&self) -> Vec<String> {
            vec!["pod-a".into()]
        }
        async fn close(&self) -> Result<()> {
            tokio::time::sleep(self.close).await;
            Ok(())
        }
    }

    fn pools() -> Arc<Pools<Slow>> {
        let p = Arc::new(Pools::default());
        for uid in ["a", "b"] {
            p.map.lock().unwrap().insert(
                uid.into(),
                Arc::new(Slow {
                    claim: Duration::from_secs(2),
                    close: Duration::from_secs(10),
                }),
            );
        }
        p
    }

    #[tokio::test(start_paused = true)]
    async fn a_claim_in_a_pod_goes_to_that_pods_branch_or_nowhere() {
        let p = pools();
        let got = p
            .claim_in("a", "pod-a", "x", 0, Duration::from_secs(5))
            .await;
        assert_eq!(got.unwrap().unwrap(), "x in pod-a");
        // Nothing in that Pod, or no such pool: the caller restores cold.
        assert!(
            p.claim_in("a", "pod-b", "x", 0, Duration::from_secs(5))
                .await
                .is_none()
        );
        assert!(
            p.claim_in("c", "pod-a", "x", 0, Duration::from_secs(5))
                .await
                .is_none()
        );
        assert_eq!(p.ready_pods("a"), vec!["pod-a".to_string()]);
        assert!(p.ready_pods("c").is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn claims_on_different_pools_proceed_together() {
        let p = pools();
        let t0 = Instant::now();
        let (a, b) = tokio::join!(
            p.claim("a", "x", 0, Duration::from_secs(5)),
            p.claim("b", "y", 0, Duration::from_secs(5))
        );
        assert_eq!(
            (a.unwrap().unwrap(), b.unwrap().unwrap()),
            ("x".into(), "y".into())
        );
        // Two 2 s claims at once: 2 s, not 4 s (one lock held across each claim).
        assert_eq!(t0.elapsed(), Duration::from_secs(2));
    }

    #[tokio::test(start_paused = true)]
    async fn a_claim_does_not_wait_for_another_pools_close() {
        let p = pools();
        let t0 = Instant::now();
        let closing = tokio::spawn({
            let p = p.clone();
            async move { p.replace("a", None).await }
        });
        tokio::task::yield_now().await;
        let got = p.claim("b", "y", 0, Duration::from_secs(5)).await;
        assert_eq!(got.unwrap().unwrap(), "y");
        assert_eq!(
            t0.elapsed(),
            Duration::from_secs(2),
            "the claim waited for the close"
        );
        // The closed pool is gone at once; its close ends on its own.
        assert!(p.claim("a", "x", 0, Duration::from_secs(5)).await.is_none());
        closing.await.unwrap().unwrap();
        assert_eq!(t0.elapsed(), Duration::from_secs(10));
    }
}
