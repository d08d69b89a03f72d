//! Plumbing shared by the operator and the node agent.

pub mod events;
pub mod finalizer;
pub mod http;
pub mod https;
pub mod logging;
pub mod tls;

pub use http::{Health, render, serve};
