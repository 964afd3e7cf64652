//! Code shared by the benchmarks, included by each with `#[path = "common/mod.rs"] mod common;`:
//! timing helpers, slice planning, and the 1,000-node cluster built from the slices gpu-dra publishes.

// Each benchmark uses a part of it.
#![allow(dead_code)]

pub mod fleet;
pub mod measure;
pub mod planning;
