//! `gpu-dra explain` (also `kubectl gpu-dra explain`): names the pod, claim or claim file to explain and
//! where the cluster is read from, and turns the library's report into output and an exit code.

use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, ValueEnum};

use super::{emit, runtime, Output};

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ExplainKind {
    Pod,
    Claim,
}

#[derive(Args)]
pub struct ExplainArgs {
    /// What to explain: a pod (its claims, templates resolved) or one ResourceClaim.
    #[arg(value_enum, required_unless_present = "claim_file", requires = "name")]
    kind: Option<ExplainKind>,
    /// NAMESPACE/NAME, or NAME in --namespace.
    name: Option<String>,
    /// Instead: a file of ResourceClaims or ResourceClaimTemplates, placed together as one pod's claims.
    #[arg(long = "claim", value_name = "FILE", conflicts_with_all = ["kind", "name"])]
    claim_file: Option<PathBuf>,
    #[arg(short = 'n', long, default_value = "default")]
    namespace: String,
    /// Read the cluster from a dump instead of the API server (`kubectl get pods,resourceclaims,
    /// resourceclaimtemplates,deviceclasses,resourceslices,nodes -A -o yaml`; for pods of ComputeDomains
    /// also `kubectl get computedomains.gpu.dra.dev,computedomains.resource.nvidia.com -A -o yaml`).
    /// Repeatable.
    #[arg(long = "from", value_name = "DUMP")]
    from: Vec<PathBuf>,
    /// Kubeconfig file; else as kubectl finds one ($KUBECONFIG, ~/.kube/config, in-cluster).
    #[arg(long, conflicts_with = "from")]
    kubeconfig: Option<PathBuf>,
    /// The kubeconfig context to use.
    #[arg(long, conflicts_with = "from")]
    context: Option<String>,
    #[arg(short = 'o', long, value_enum, default_value = "table")]
    output: Output,
}

/// `gpu-dra explain`: the report's exit code (0 fits on some node, 1 on none, 2 an error) for
/// [`exit_with`](super::exit_with).
pub fn explain(args: ExplainArgs) -> Result<i32> {
    use crate::explain::{Source, Target};
    let target = match (args.kind, &args.name, &args.claim_file) {
        (_, _, Some(file)) => Target::claim_file(file)?,
        (Some(kind), Some(name), None) => {
            let (namespace, name) = Target::split_name(name, &args.namespace);
            match kind {
                ExplainKind::Pod => Target::Pod { namespace, name },
                ExplainKind::Claim => Target::Claim { namespace, name },
            }
        }
        _ => anyhow::bail!("name a pod or a claim (explain pod NS/NAME), or pass --claim FILE"),
    };
    let source = if args.from.is_empty() {
        Source::Live {
            kubeconfig: args.kubeconfig,
            context: args.context,
        }
    } else {
        Source::Dump(args.from)
    };
    let report = runtime()?.block_on(crate::explain::run(&source, &target))?;
    let output = match args.output {
        Output::Table => crate::explain::Output::Table,
        Output::Json => crate::explain::Output::Json,
        Output::Yaml => crate::explain::Output::Yaml,
    };
    emit(&report.render(output));
    if let Some(error) = &report.error {
        eprintln!("error: {error}");
    }
    Ok(report.exit_code())
}
