//! Plumbing shared by the operator and the node agent.

pub mod backoff;
pub mod events;
pub mod failure;
pub mod finalizer;
pub mod http;
pub mod settle;

pub use http::{Health, render, serve};
