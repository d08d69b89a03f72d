//! One entry of a sandbox's egress allowlist: a destination network and, when any are
//! listed, the only ports allowed to it (`spec.network.allow[]`'s `cidr` and `ports`).

use std::net::Ipv4Addr;

use serde::{Deserialize, Serialize};

use super::Cidr;
use crate::error::{Error, Result};

/// A destination network and the ports allowed to it, TCP and UDP alike (every port
/// and protocol when `ports` is empty). Written `10.0.0.0/8` or `10.0.0.0/8:443,8443`;
/// records of earlier agents, which held the network alone, read as every port.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Allowed {
    #[serde(flatten)]
    pub net: Cidr,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<u16>,
}

impl Allowed {
    /// Whether `ip` is in the destination network.
    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        let mask = u32::MAX
            .checked_shl(32 - u32::from(self.net.prefix))
            .unwrap_or(0);
        u32::from(self.net.addr) & mask == u32::from(ip) & mask
    }

    /// Whether a connection to `ip`, port `port`, is allowed.
    pub fn allows(&self, ip: Ipv4Addr, port: u16) -> bool {
        self.contains(ip) && (self.ports.is_empty() || self.ports.contains(&port))
    }
}

impl From<Cidr> for Allowed {
    fn from(net: Cidr) -> Self {
        Allowed {
            net,
            ports: Vec::new(),
        }
    }
}

impl std::str::FromStr for Allowed {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let (net, ports) = match s.split_once(':') {
            Some((net, ports)) => (net, Some(ports)),
            None => (s, None),
        };
        let mut allowed = Allowed::from(net.parse::<Cidr>()?);
        for p in ports.into_iter().flat_map(|p| p.split(',')) {
            match p.parse::<u16>() {
                Ok(port) if port > 0 => allowed.ports.push(port),
                _ => return Err(Error::Invalid(format!("bad port {p:?} in {s:?}"))),
            }
        }
        if ports.is_some() && allowed.ports.is_empty() {
            return Err(Error::Invalid(format!("no port after ':' in {s:?}")));
        }
        Ok(allowed)
    }
}

impl std::fmt::Display for Allowed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.net)?;
        if !self.ports.is_empty() {
            let ports: Vec<String> = self.ports.iter().map(u16::to_string).collect();
            write!(f, ":{}", ports.join(","))?;
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn written_and_read_back_with_or_without_ports() {
        for s in ["10.0.0.0/8", "192.0.2.7/32:443", "0.0.0.0/0:53,80,443"] {
            let a: Allowed = s.parse().unwrap();
            assert_eq!(a.to_string(), s);
            let json = serde_json::to_string(&a).unwrap();
            assert_eq!(serde_json::from_str::<Allowed>(&json).unwrap(), a);
        }
        for bad in [
            "10.0.0.0/8:",
            "10.0.0.0/8:0",
            "10.0.0.0/8:70000",
            "10.0.0.0/8:x",
        ] {
            assert!(bad.parse::<Allowed>().is_err(), "{bad}");
        }
    }

    #[test]
    fn an_earlier_agents_record_reads_as_every_port() {
        let old = serde_json::to_string(&"10.1.0.0/16".parse::<Cidr>().unwrap()).unwrap();
        let a: Allowed = serde_json::from_str(&old).unwrap();
        assert!(a.ports.is_empty());
        assert!(a.allows(Ipv4Addr::new(10, 1, 2, 3), 22));
    }

    #[test]
    fn ports_narrow_what_the_network_allows() {
        let a: Allowed = "10.1.0.0/16:443".parse().unwrap();
        assert!(a.allows(Ipv4Addr::new(10, 1, 9, 9), 443));
        assert!(!a.allows(Ipv4Addr::new(10, 1, 9, 9), 80));
        assert!(!a.allows(Ipv4Addr::new(10, 2, 0, 1), 443));
        let all: Allowed = "0.0.0.0/0".parse().unwrap();
        assert!(all.allows(Ipv4Addr::new(8, 8, 8, 8), 53));
    }
}
