//! Test doubles for what a development machine lacks: a Kubernetes API server (`apiserver`), a kubelet
//! (`kubelet`), the container runtime's CDI injection (`cdi_runtime`) and the scheduler's allocation
//! step (`allocator`, pure; `scheduler`, through the API). They are compiled into the library
//! (see `src/lib.rs`) because `gpu-dra demo` and the benchmark drive the same doubles as the tests.

pub use crate::cel::allocator;
pub mod apiserver;
pub mod cdi_runtime;
pub mod cluster;
pub mod grpc_dial;
pub mod harness;
pub mod kubelet;
pub mod kubelet_pods;
pub mod packing;
pub mod pod_runner;
pub mod pods;
pub mod rack;
pub mod scheduler;
