//! ComputeDomains: multi-node NVLink for jobs whose pods span several nodes of one NVLink clique
//! (GB200 NVL72 and similar). A user creates a `ComputeDomain`; the controller (`gpu-dra controller`)
//! places it on one clique and one IMEX channel number and writes the ResourceClaimTemplate its
//! workload pods use, whose selector lets the scheduler choose only that clique's nodes. On each node,
//! the kubelet plugin publishes IMEX channel devices (`imex-channel-<N>`), and preparing one starts the
//! domain's IMEX daemon there, waits for it, and hands the container the channel's device node.
//!
//! - `api`: the `ComputeDomain` resource (ours and NVIDIA's shape), the channel config, names;
//! - `channels`: the channel devices a fabric node publishes (pure);
//! - `placement`: which clique and channel a domain gets, and why a domain cannot fit (pure);
//! - `controller`: the controller mode that places domains, writes their templates and status;
//! - `imex`: the IMEX daemon of one domain on one node (config, Pod, supervisor, stand-in);
//! - `membership`: the plugin's side: a node joining and leaving its domains.

pub mod api;
pub mod channels;
pub mod controller;
pub mod imex;
pub mod membership;
pub mod placement;
