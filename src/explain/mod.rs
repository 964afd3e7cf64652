//! `gpu-dra explain`: why a pod (or a claim) is Pending. For every node it runs the scheduler's DRA
//! allocation step (the allocator in `cel::allocator`, the one behind `gpu-dra selectors allocate`) on
//! what the cluster holds, after the node filters the scheduler runs before it (unschedulable, node
//! name, taints, node affinity), and says "fits, with these devices" or why not, in specific words.
//!
//! The pieces, in the order they run:
//! - [`cluster`]: the objects, from the API server (kubeconfig, as kubectl finds it) or from a dump;
//! - [`subject`]: what to place: the pod's claims (templates resolved) or the claims of a file;
//! - [`plan`]: the claims' requests checked (classes exist, selectors compile) before any node;
//! - [`extended`]: a pod's extended resources (`nvidia.com/gpu: 2`): the device plugin's count, or
//!   the claim the scheduler makes for them per node;
//! - [`decide`]: one verdict per node, from the allocator, with [`reasons`] breaking a "no" down;
//! - [`domains`]: for a pod of a ComputeDomain, what the domain says: not placed (the pod waits for
//!   it), its clique full, or not Ready;
//! - [`report`]: the summary and the per-node lines as a table, JSON or YAML, and the exit code.
//!
//! ```ignore
//! let cluster = Cluster::from_dump_files(&[PathBuf::from("cluster.yaml")])?;
//! let report = explain(&cluster, &Target::Pod { namespace: "ml".into(), name: "train".into() })?;
//! print!("{}", report.to_table());
//! std::process::exit(report.exit_code());
//! ```

pub mod cluster;
pub mod decide;
mod domains;
mod dump;
pub mod extended;
mod index;
mod joint;
mod plan;
mod reasons;
pub mod report;
pub mod subject;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_domains;
#[cfg(test)]
mod tests_extended;
#[cfg(test)]
mod tests_shares;

use std::path::PathBuf;

use thiserror::Error;

pub use cluster::Cluster;
pub use report::{Output, Report};
pub use subject::{Subject, Target};

/// The file name under which the binary acts as the kubectl plugin `kubectl gpu-dra` (kubectl maps the
/// `-` of a command name to `_` in the executable's name).
pub const KUBECTL_PLUGIN: &str = "kubectl-gpu_dra";

/// The name usage lines show: `kubectl gpu-dra` when invoked through the plugin's name, else `gpu-dra`.
pub fn command_name(argv0: Option<&std::ffi::OsStr>) -> &'static str {
    let file = argv0
        .map(std::path::Path::new)
        .and_then(|path| path.file_name())
        .and_then(|name| name.to_str());
    if file == Some(KUBECTL_PLUGIN) {
        "kubectl gpu-dra"
    } else {
        "gpu-dra"
    }
}

/// Why there is no answer: the input is bad, an object is missing, the API server failed, or a claim
/// cannot be decided anywhere (an unknown DeviceClass, a selector that does not compile). Exit code 2.
#[derive(Debug, Error)]
pub enum ExplainError {
    // Causes are part of the message, not `source`s, so that a chain printer does not repeat them.
    #[error("{}: cannot read: {error}", .file.display())]
    Read {
        file: PathBuf,
        error: std::io::Error,
    },
    #[error("{origin}: {message}")]
    Input { origin: String, message: String },
    #[error("{kind} {name} not found")]
    NotFound { kind: &'static str, name: String },
    #[error("{0}")]
    Client(crate::apiclient::ApiClientError),
    #[error("kubeconfig: {0}")]
    Kubeconfig(String),
    #[error("API server: {what}: {error}")]
    Api {
        what: String,
        error: Box<kube::Error>,
    },
    #[error("{subject}: {message}")]
    Subject { subject: String, message: String },
    #[error("claim {claim}: {message}")]
    Claim { claim: String, message: String },
}

impl ExplainError {
    /// `explain` exits 2 on every error (0 and 1 mean "fits somewhere" and "fits nowhere").
    pub fn exit_code(&self) -> i32 {
        2
    }
}

/// Decides `target` against `cluster`: resolves the claims, then runs every node.
pub fn explain(cluster: &Cluster, target: &Target) -> Result<Report, ExplainError> {
    let subject = Subject::resolve(cluster, target)?;
    let report = decide::decide(cluster, &subject)?;
    Ok(domains::apply(cluster, &subject, report))
}

/// Where the cluster is read from.
#[derive(Debug, Clone)]
pub enum Source {
    /// The API server: this kubeconfig, else as kubectl finds one (`$KUBECONFIG`, `~/.kube/config`,
    /// in-cluster); `context` picks a context of it.
    Live {
        kubeconfig: Option<PathBuf>,
        context: Option<String>,
    },
    /// Dumps (`kubectl get ... -A -o yaml`).
    Dump(Vec<PathBuf>),
}

impl Target {
    /// The claims and templates of a `--claim` file.
    pub fn claim_file(path: &std::path::Path) -> Result<Target, ExplainError> {
        Ok(Target::Claims {
            origin: path.display().to_string(),
            claims: Cluster::from_dump_files(&[path.to_path_buf()])?,
        })
    }
}

/// Reads the cluster from `source` and decides `target`: what `gpu-dra explain` runs.
pub async fn run(source: &Source, target: &Target) -> Result<Report, ExplainError> {
    let cluster = match source {
        Source::Dump(paths) => Cluster::from_dump_files(paths)?,
        Source::Live {
            kubeconfig,
            context,
        } => {
            let client = cluster::client(kubeconfig.as_deref(), context.as_deref()).await?;
            Cluster::fetch(&client, target).await?
        }
    };
    let report = explain(&cluster, target);
    // The command exits right after printing: freeing a big cluster's objects one by one would only
    // add time (a good part of a second for a thousand GPU nodes); the exit frees them at once.
    std::mem::forget(cluster);
    report
}
