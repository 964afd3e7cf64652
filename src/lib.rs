//! gpu-dra: a Kubernetes Dynamic Resource Allocation driver for NVIDIA GPUs.
//!
//! The modules follow the data flow: `gpu` (backends) → `devices` (DRA devices) → `slices` (planner and
//! publisher); the kubelet calls `kubelet` (gRPC) → `claims` (prepare/unprepare) → `cdi` (spec files).
//! `plugin` wires them together and `cli` holds the commands that `src/main.rs` dispatches to; `demo`
//! walks through it all with the test doubles in `support` (both only with the `doubles` feature: the
//! node binary leaves them out).

pub mod api;
pub mod apiclient;
pub mod boot;
pub mod cdi;
pub mod cel;
pub mod claims;
pub mod cli;
#[cfg(feature = "doubles")]
pub mod demo;
pub mod devices;
pub mod domains;
pub mod explain;
pub mod fsutil;
pub mod gpu;
pub mod health;
pub mod kubelet;
pub mod observability;
pub mod plugin;
pub mod proto;
pub mod quantity;
pub mod slices;

#[cfg(feature = "doubles")]
#[path = "../tests/support/mod.rs"]
pub mod support;
