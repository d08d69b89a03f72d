//! How many streams one sandbox may have open at once on this node: each exec is a
//! `runsc exec` process on the node, each port-forward connection a socket pair and a
//! proxy in the sandbox, and a tenant must not spend the node's processes and memory on
//! them. A stream over the limit is refused (HTTP 429) with the limit in its message.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// What kind of stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    Exec,
    PortForward,
}

impl Kind {
    /// The most a sandbox may have open at once.
    pub fn limit(self) -> usize {
        match self {
            Kind::Exec => 32,
            Kind::PortForward => 128,
        }
    }

    fn what(self) -> &'static str {
        match self {
            Kind::Exec => "execs",
            Kind::PortForward => "port-forward connections",
        }
    }
}

/// Streams open per sandbox and kind.
#[derive(Default)]
pub struct StreamLimits {
    open: Mutex<HashMap<(String, Kind), usize>>,
}

/// An open stream, counted until dropped.
pub struct Stream {
    limits: Arc<StreamLimits>,
    key: (String, Kind),
}

impl Drop for Stream {
    fn drop(&mut self) {
        if let Ok(mut m) = self.limits.open.lock()
            && let Some(n) = m.get_mut(&self.key)
        {
            *n = n.saturating_sub(1);
            if *n == 0 {
                m.remove(&self.key);
            }
        }
    }
}

impl StreamLimits {
    /// Counts a new stream of `kind` into sandbox `id` (`name` for the message), or
    /// says why not.
    pub fn open(self: &Arc<Self>, id: &str, name: &str, kind: Kind) -> Result<Stream, String> {
        let key = (id.to_string(), kind);
        let mut m = self
            .open
            .lock()
            .map_err(|_| "the stream count is unavailable".to_string())?;
        let n = m.entry(key.clone()).or_insert(0);
        if *n >= kind.limit() {
            return Err(format!(
                "sandbox {name} has {} {} open, the most one may have: close one first",
                *n,
                kind.what()
            ));
        }
        *n += 1;
        Ok(Stream {
            limits: self.clone(),
            key,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sandbox_gets_its_limit_of_each_kind_and_a_closed_stream_frees_its_place() {
        let l = Arc::new(StreamLimits::default());
        let mut held: Vec<Stream> = (0..Kind::Exec.limit())
            .map(|_| {
                l.open("a", "ns/a", Kind::Exec)
                    .unwrap_or_else(|e| panic!("{e}"))
            })
            .collect();
        let refused = l.open("a", "ns/a", Kind::Exec).err().unwrap_or_default();
        assert_eq!(
            refused,
            "sandbox ns/a has 32 execs open, the most one may have: close one first"
        );
        // Another kind, another sandbox: counted apart.
        assert!(l.open("a", "ns/a", Kind::PortForward).is_ok());
        assert!(l.open("b", "ns/b", Kind::Exec).is_ok());
        held.pop();
        assert!(l.open("a", "ns/a", Kind::Exec).is_ok());
        drop(held);
        assert!(l.open.lock().map(|m| m.is_empty()).unwrap_or(false));
    }
}
