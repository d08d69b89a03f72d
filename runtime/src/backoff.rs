//! Retry delays for the controllers' error policies: per object, exponential with
//! jitter and a cap, forgotten on the object's next success. One object failing again
//! and again waits longer and longer (up to the cap) without slowing any other object;
//! the jitter spreads the retries of many objects that failed together (an API-server
//! outage) instead of sending them back in one burst.
//!
//! Errors that no retry can fix (an invalid object, a missing one) are not retried on
//! a timer at all: the controllers report them in status and wait for the object to
//! change (see [`is_permanent`]).

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Error categories (the `error` label of `reconcile_failures`) that a retry cannot fix:
/// the object itself is wrong, or what it names does not exist. The same object retried
/// fails the same way, so it waits for a change instead.
pub const PERMANENT_CATEGORIES: [&str; 6] = [
    "invalid",
    "not_found",
    "unsupported",
    "version_mismatch",
    "corrupt_image",
    "image_lost",
];

/// Whether errors of `category` are permanent (see [`PERMANENT_CATEGORIES`]).
pub fn is_permanent(category: &str) -> bool {
    PERMANENT_CATEGORIES.contains(&category)
}

/// The category of a Kubernetes API error by its HTTP status: the same label whichever
/// binary saw it. `None` for errors that are not an API status (transport, decoding).
pub fn kube_category(err: &kube::Error) -> Option<&'static str> {
    let kube::Error::Api(s) = err else {
        return None;
    };
    Some(match s.code {
        404 if crate::api_error::is_object_not_found(err) => "not_found",
        // A path not served (yet): an API server starting, a CRD being installed.
        404 => "not_served",
        // Bad request, or refused by the schema (validation, CEL, immutable fields).
        400 | 422 => "invalid",
        409 => "conflict",
        401 | 403 => "forbidden",
        429 => "throttled",
        _ => "kube_api",
    })
}

/// The CamelCase form of a category, for condition and Event reasons
/// (`not_found` -> `NotFound`).
pub fn reason_of(category: &str) -> String {
    category
        .split('_')
        .map(|w| {
            let mut c = w.chars();
            match c.next() {
                Some(f) => f.to_ascii_uppercase().to_string() + c.as_str(),
                None => String::new(),
            }
        })
        .collect()
}

/// Exponential backoff with a cap and jitter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policy {
    /// The delay after the first failure (before jitter).
    pub base: Duration,
    /// No delay is longer than this.
    pub cap: Duration,
}

impl Policy {
    /// The delay before the retry after `failures` failures in a row (1 = the first),
    /// with `jitter` in `[0, 1)`: the step `d = min(cap, base * 2^(failures - 1))`, then
    /// a point of `[d/2, d]` chosen by the jitter ("equal jitter": it never waits less
    /// than half the step, never more than the cap).
    pub fn delay(&self, failures: u32, jitter: f64) -> Duration {
        let exp = failures.saturating_sub(1).min(31);
        let step = self
            .base
            .checked_mul(1u32 << exp)
            .unwrap_or(self.cap)
            .min(self.cap);
        let j = if jitter.is_finite() {
            jitter.clamp(0.0, 1.0)
        } else {
            0.0
        };
        let half = step / 2;
        half + half.mul_f64(j)
    }
}

/// A uniformly distributed number of `[0, 1)` from the standard library's per-process
/// random hash keys (jitter needs no cryptographic quality, only independence).
pub fn jitter() -> f64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(0);
    // 53 random bits: exactly representable in an f64 mantissa.
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    failures: u32,
    last: Instant,
}

/// Failures in a row per object (by key), and the delay each next retry waits.
#[derive(Debug)]
pub struct Tracker {
    policy: Policy,
    entries: Mutex<HashMap<String, Entry>>,
}

/// Entries kept before stale ones are dropped (an object deleted while it failed never
/// succeeds, so its entry would otherwise stay).
const PRUNE_ABOVE: usize = 1024;

impl Tracker {
    pub fn new(policy: Policy) -> Self {
        Self {
            policy,
            entries: Mutex::default(),
        }
    }

    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// Records one more failure of `key`; returns the failures in a row and how long to
    /// wait before the next attempt.
    pub fn failed(&self, key: &str) -> (u32, Duration) {
        self.failed_with(key, jitter())
    }

    fn failed_with(&self, key: &str, jitter: f64) -> (u32, Duration) {
        let now = Instant::now();
        let Ok(mut entries) = self.entries.lock() else {
            // A poisoned map (a panic elsewhere): back off as far as allowed.
            return (u32::MAX, self.policy.cap);
        };
        if entries.len() > PRUNE_ABOVE {
            let stale = self.policy.cap * 4;
            entries.retain(|_, e| now.duration_since(e.last) < stale);
        }
        let e = entries.entry(key.to_string()).or_insert(Entry {
            failures: 0,
            last: now,
        });
        e.failures = e.failures.saturating_add(1);
        e.last = now;
        (e.failures, self.policy.delay(e.failures, jitter))
    }

    /// `key` succeeded: its next failure starts from the base delay again.
    pub fn succeeded(&self, key: &str) {
        if let Ok(mut entries) = self.entries.lock() {
            entries.remove(key);
        }
    }

    /// Failures in a row of `key` so far.
    pub fn failures(&self, key: &str) -> u32 {
        self.entries
            .lock()
            .ok()
            .and_then(|e| e.get(key).map(|e| e.failures))
            .unwrap_or(0)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const P: Policy = Policy {
        base: Duration::from_millis(200),
        cap: Duration::from_secs(30),
    };

    #[test]
    fn the_delay_doubles_per_failure_up_to_the_cap() {
        // Without jitter's upper half: exactly half the step.
        let lows: Vec<u128> = (1..=12).map(|n| P.delay(n, 0.0).as_millis()).collect();
        assert_eq!(
            lows,
            [
                100, 200, 400, 800, 1600, 3200, 6400, 12800, 15000, 15000, 15000, 15000
            ]
        );
        // The top of the range is the step itself, never above the cap.
        assert_eq!(P.delay(1, 1.0), Duration::from_millis(200));
        assert_eq!(P.delay(8, 1.0), Duration::from_millis(25600));
        assert_eq!(P.delay(9, 1.0), Duration::from_secs(30));
        assert_eq!(P.delay(u32::MAX, 1.0), Duration::from_secs(30));
        // A failure count of 0 behaves as the first.
        assert_eq!(P.delay(0, 0.5), P.delay(1, 0.5));
    }

    #[test]
    fn jitter_spreads_a_step_over_its_upper_half_and_garbage_jitter_is_harmless() {
        for n in 1..40 {
            let step = P
                .base
                .checked_mul(1 << (n - 1).min(31))
                .unwrap_or(P.cap)
                .min(P.cap);
            for j in [0.0, 0.1, 0.5, 0.99, 1.0] {
                let d = P.delay(n, j);
                assert!(
                    d >= step / 2 && d <= step && d <= P.cap,
                    "n={n} j={j} d={d:?}"
                );
            }
            for j in [f64::NAN, f64::INFINITY, -3.0, 7.0] {
                let d = P.delay(n, j);
                assert!(d >= step / 2 && d <= step, "n={n} j={j} d={d:?}");
            }
        }
        // Different jitter, different delays: retries of objects that failed together
        // do not line up.
        assert!(P.delay(5, 0.1) < P.delay(5, 0.9));
    }

    #[test]
    fn random_jitter_is_in_range_and_varies() {
        let draws: Vec<f64> = (0..200).map(|_| jitter()).collect();
        assert!(draws.iter().all(|j| (0.0..1.0).contains(j)));
        let distinct: std::collections::BTreeSet<u64> = draws.iter().map(|j| j.to_bits()).collect();
        assert!(distinct.len() > 150, "jitter barely varies: {distinct:?}");
        let mean = draws.iter().sum::<f64>() / draws.len() as f64;
        assert!((0.3..0.7).contains(&mean), "mean {mean}");
    }

    #[test]
    fn failures_count_per_object_and_a_success_resets_only_that_object() {
        let t = Tracker::new(P);
        for _ in 0..5 {
            t.failed_with("a", 0.0);
        }
        let (n, d) = t.failed_with("a", 0.0);
        assert_eq!((n, d), (6, Duration::from_millis(3200)));
        // Another object starts from the base delay.
        assert_eq!(t.failed_with("b", 0.0), (1, Duration::from_millis(100)));
        t.succeeded("a");
        assert_eq!(t.failures("a"), 0);
        assert_eq!(t.failures("b"), 1);
        assert_eq!(t.failed_with("a", 0.0), (1, Duration::from_millis(100)));
    }

    #[test]
    fn stale_entries_of_vanished_objects_are_pruned() {
        let t = Tracker::new(Policy {
            base: Duration::from_millis(1),
            cap: Duration::from_millis(1),
        });
        for i in 0..=PRUNE_ABOVE {
            t.failed_with(&format!("gone-{i}"), 0.0);
        }
        std::thread::sleep(Duration::from_millis(10));
        t.failed_with("live", 0.0);
        let len = t.entries.lock().unwrap().len();
        assert_eq!(len, 1, "stale entries kept: {len}");
    }

    #[test]
    fn categories() {
        assert!(is_permanent("invalid") && is_permanent("not_found"));
        assert!(!is_permanent("kube_api") && !is_permanent("conflict") && !is_permanent("io"));
        assert_eq!(reason_of("not_found"), "NotFound");
        assert_eq!(reason_of("invalid"), "Invalid");
        let api =
            |code| kube::Error::Api(kube::core::Status::failure("", "").with_code(code).boxed());
        let gone = kube::core::Status::failure("x not found", "NotFound").with_code(404);
        assert_eq!(
            kube_category(&kube::Error::Api(gone.boxed())),
            Some("not_found")
        );
        // `404 page not found`: a path the API server does not serve yet, retried.
        assert_eq!(kube_category(&api(404)), Some("not_served"));
        assert!(!is_permanent("not_served"));
        assert_eq!(kube_category(&api(422)), Some("invalid"));
        assert_eq!(kube_category(&api(409)), Some("conflict"));
        assert_eq!(kube_category(&api(503)), Some("kube_api"));
        assert_eq!(kube_category(&api(403)), Some("forbidden"));
    }
}
