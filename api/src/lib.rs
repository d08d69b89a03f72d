//! ramify-api: the aggregated API `subresources.ramify.dev` (see
//! [`ramify_crds::subresources`]). The kube-apiserver authenticates the user and
//! proxies `/apis/subresources.ramify.dev/...` here (an APIService); this server
//! authenticates the proxy ([`authn`]), authorizes the user per call ([`authz`]) and
//! relays the call to the sandbox's node agent over mTLS ([`agents`]).

pub mod agents;
pub mod authn;
pub mod authz;
pub mod server;
