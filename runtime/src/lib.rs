//! Plumbing shared by the operator and the node agent.

pub mod api_error;
pub mod backoff;
pub mod events;
pub mod failure;
pub mod finalizer;
pub mod http;
pub mod https;
pub mod logging;
pub mod settle;
pub mod status;
pub mod tls;

pub use http::{Health, render, serve};
