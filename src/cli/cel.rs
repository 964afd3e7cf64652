//! CEL offline: `gpu-dra cel eval` (one expression against one device) and `gpu-dra selectors`
//! (DeviceClasses and claims against devices, or one claim decided as the scheduler's allocator would),
//! with the exit codes their help texts promise.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Subcommand, ValueEnum};

use super::backend::BackendArgs;
use super::emit;

#[derive(Subcommand)]
pub enum CelCommand {
    /// Evaluate one expression against one device: prints true or false (exit 0); a compile error exits
    /// 2, a runtime error 3, an unreadable device file 1.
    Eval(CelEvalArgs),
}

#[derive(Args)]
pub struct CelEvalArgs {
    /// A file holding one device in the JSON (or YAML) shape of a resource.k8s.io/v1 Device.
    #[arg(long)]
    device: PathBuf,
    /// `device.driver`, and the domain of attribute and capacity names without one.
    #[arg(long, default_value = "gpu.dra.dev")]
    driver: String,
    /// Also apply the API server's rules for a new or changed selector (feature-gated fields and
    /// functions, the estimated cost limit), as `kubectl apply` of a DeviceClass or claim would meet them.
    #[arg(long)]
    new_expression: bool,
    /// With --new-expression: the DRAConsumableCapacity gate (device.allowMultipleAllocations).
    #[arg(long, requires = "new_expression")]
    consumable_capacity: bool,
    /// With --new-expression: the DRAListTypeAttributes gate (list attributes, includes()).
    #[arg(long, requires = "new_expression")]
    list_type_attributes: bool,
    /// The CEL expression.
    expression: String,
}

#[derive(Subcommand)]
pub enum SelectorsCommand {
    /// For each DeviceClass and claim request: the devices that match, those that do not and the first
    /// selector that said no, and CEL errors (blocking). Exit 0 all good, 1 something matches nothing,
    /// 2 an error.
    Check(SelectorsCheckArgs),
    /// Decide one ResourceClaim on one node as the scheduler's allocator would. Exit 0 allocated,
    /// 1 not allocatable (with the reason), 2 invalid input or a CEL error.
    Allocate(SelectorsAllocateArgs),
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum CheckOutput {
    Table,
    Json,
}

#[derive(Args)]
pub struct SelectorsCheckArgs {
    /// A file of DeviceClasses (YAML or JSON; several documents or a List). Repeatable.
    #[arg(long = "class")]
    classes: Vec<PathBuf>,
    /// A file of ResourceClaims or ResourceClaimTemplates. Repeatable.
    #[arg(long = "claim")]
    claims: Vec<PathBuf>,
    /// A file of ResourceSlices to check against; without it, the devices this node would publish.
    #[arg(long = "slices")]
    slices: Vec<PathBuf>,
    #[arg(long, env = "DRIVER_NAME", default_value = "gpu.dra.dev")]
    driver_name: String,
    #[arg(long, env = "NODE_NAME", default_value = "local-node")]
    node_name: String,
    #[command(flatten)]
    backend: BackendArgs,
    /// The Kubernetes minor version whose slice layout the node's devices take.
    #[arg(long, default_value_t = 35)]
    kubernetes_minor: u32,
    #[arg(short = 'o', long, value_enum, default_value = "table")]
    output: CheckOutput,
}

#[derive(Args)]
pub struct SelectorsAllocateArgs {
    /// The ResourceClaim (or ResourceClaimTemplate) file; it must hold exactly one.
    #[arg(long)]
    claim: PathBuf,
    /// A file of DeviceClasses. Repeatable.
    #[arg(long = "class")]
    classes: Vec<PathBuf>,
    /// A file of ResourceSlices. Repeatable.
    #[arg(long = "slices", required = true)]
    slices: Vec<PathBuf>,
    /// The node's name; by default the one node the slices name.
    #[arg(long)]
    node: Option<String>,
    /// The node's labels, for slices with a node selector: K=V,K=V.
    #[arg(long, value_delimiter = ',')]
    node_labels: Vec<String>,
    /// What other claims hold: [{"driver", "pool", "device"}], with "shareID" and
    /// "consumedCapacity" for a share of a device that allows multiple allocations.
    #[arg(long)]
    in_use: Option<PathBuf>,
    #[arg(short = 'o', long, value_enum, default_value = "table")]
    output: CheckOutput,
}

/// `gpu-dra cel eval`: exits with the evaluation error's own code (2 compile, 3 runtime, 1 unreadable).
pub fn cel_eval(args: CelEvalArgs) -> Result<()> {
    let environment = if args.new_expression {
        crate::cel::Environment::ApiServer(crate::cel::FeatureGates {
            consumable_capacity: args.consumable_capacity,
            list_type_attributes: args.list_type_attributes,
        })
    } else {
        crate::cel::Environment::Scheduler
    };
    match crate::cel::eval::eval_file(&args.device, &args.driver, &args.expression, &environment) {
        Ok(result) => {
            emit(&format!("{result}\n"));
            Ok(())
        }
        Err(error) => {
            eprintln!("{error}");
            std::process::exit(error.exit_code());
        }
    }
}

/// `gpu-dra selectors check`: the exit code (0 all good, 1 something matches nothing) for
/// [`exit_with`](super::exit_with).
pub fn selectors_check(args: SelectorsCheckArgs) -> Result<i32> {
    use crate::cel::{input, selectors};
    let mut classes = Vec::new();
    for path in &args.classes {
        classes.extend(input::load_device_classes(path)?);
    }
    let mut claims = Vec::new();
    for path in &args.claims {
        claims.extend(input::load_claims(path)?);
    }
    anyhow::ensure!(
        !classes.is_empty() || !claims.is_empty(),
        "nothing to check: pass --class and/or --claim files"
    );
    let slices = if args.slices.is_empty() {
        let backend = crate::plugin::open_backend(&args.backend.choice(), &args.node_name)?;
        let node = crate::devices::node_devices(&backend.inventory()?, args.backend.mig_mode);
        let version = crate::slices::ServerVersion {
            minor: args.kubernetes_minor,
        };
        crate::slices::desired_slices(&args.driver_name, &args.node_name, "", &node, version)
    } else {
        let mut slices = Vec::new();
        for path in &args.slices {
            slices.extend(input::load_slices(path)?);
        }
        slices
    };
    let report = selectors::check(
        &args.driver_name,
        &classes,
        &claims,
        &selectors::slice_devices(&slices),
    );
    match args.output {
        CheckOutput::Table => emit(&report.to_table()),
        CheckOutput::Json => emit(&report.to_json()),
    }
    Ok(report.exit_code())
}

/// `gpu-dra selectors allocate`: the exit code (0 allocated, 1 not allocatable) for
/// [`exit_with`](super::exit_with).
pub fn selectors_allocate(args: SelectorsAllocateArgs) -> Result<i32> {
    use crate::cel::input;
    use crate::cel::selectors::simulate::{simulate, Simulation};
    let mut claims = input::load_claims(&args.claim)?;
    anyhow::ensure!(
        claims.len() == 1,
        "{}: holds {} claims; selectors allocate decides one",
        args.claim.display(),
        claims.len()
    );
    let mut classes = Vec::new();
    for path in &args.classes {
        classes.extend(input::load_device_classes(path)?);
    }
    let mut slices = Vec::new();
    for path in &args.slices {
        slices.extend(input::load_slices_allow_empty(path)?);
    }
    let mut node_labels = std::collections::BTreeMap::new();
    for pair in args.node_labels.iter().filter(|p| !p.is_empty()) {
        let (key, value) = pair
            .split_once('=')
            .with_context(|| format!("--node-labels {pair:?} is not KEY=VALUE"))?;
        node_labels.insert(key.to_string(), value.to_string());
    }
    let in_use = match &args.in_use {
        Some(path) => input::load_in_use(path)?,
        None => Default::default(),
    };
    let simulation = Simulation {
        claim: claims.remove(0),
        classes,
        slices,
        node: args.node,
        node_labels,
        in_use,
    };
    let decision = simulate(&simulation)?;
    match args.output {
        CheckOutput::Table => emit(&decision.to_text()),
        CheckOutput::Json => emit(&decision.to_json()),
    }
    Ok(decision.exit_code())
}
