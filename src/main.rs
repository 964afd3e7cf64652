//! The `gpu-dra` command line: parses flags and calls into the library; no logic of its own.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};

use gpu_dra::devices::MigMode;
use gpu_dra::observability::{init_logging, LogFormat};
use gpu_dra::plugin::{BackendChoice, PluginConfig};

#[derive(Parser)]
#[command(
    name = "gpu-dra",
    version,
    about = "Kubernetes DRA driver for NVIDIA GPUs"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the kubelet plugin on this node.
    Plugin(Box<PluginArgs>),
    /// Print the ResourceSlices this node would publish.
    Devices(DevicesArgs),
    /// Evaluate CEL selectors offline, with the scheduler's semantics.
    Cel {
        #[command(subcommand)]
        command: CelCommand,
    },
    /// Check DeviceClass and claim selectors against devices, or decide a claim as the scheduler would.
    Selectors {
        #[command(subcommand)]
        command: SelectorsCommand,
    },
    /// Why a pod is Pending: the scheduler's DRA decision for its claims on every node, with the
    /// devices it would get or a reason per node. Exit 0 it fits on some node, 1 on none, 2 an error.
    Explain(ExplainArgs),
    /// A local end-to-end walkthrough with the fake backend and in-process API server and kubelet
    /// (builds with `--features doubles` only).
    #[cfg(feature = "doubles")]
    Demo,
    /// Fake GPU backend tools.
    Fake {
        #[command(subcommand)]
        command: FakeCommand,
    },
    /// PID 1 of a claim's MPS daemon Pod, which the plugin creates: runs the control daemon and
    /// applies the claim's limits.
    #[command(hide = true)]
    MpsDaemon(MpsDaemonArgs),
    /// NVML tools, for checking a node with real GPUs.
    Nvml {
        #[command(subcommand)]
        command: NvmlCommand,
    },
}

#[derive(Subcommand)]
enum CelCommand {
    /// Evaluate one expression against one device: prints true or false (exit 0); a compile error exits
    /// 2, a runtime error 3, an unreadable device file 1.
    Eval(CelEvalArgs),
}

#[derive(Args)]
struct CelEvalArgs {
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
enum SelectorsCommand {
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
struct SelectorsCheckArgs {
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
struct SelectorsAllocateArgs {
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

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ExplainKind {
    Pod,
    Claim,
}

#[derive(Args)]
struct ExplainArgs {
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
    /// resourceclaimtemplates,deviceclasses,resourceslices,nodes -A -o yaml`). Repeatable.
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

#[derive(Subcommand)]
enum NvmlCommand {
    /// Print what NVML reports about the node's GPUs (read-only: changes nothing on them).
    Probe {
        /// The NVIDIA driver's root on the host (`/`, or `/run/nvidia/driver`).
        #[arg(long, env = "NVIDIA_DRIVER_ROOT", default_value = "/")]
        driver_root: PathBuf,
        /// Where this process sees the driver root; the driver root itself when absent.
        #[arg(long, env = "CONTAINER_DRIVER_ROOT")]
        container_driver_root: Option<PathBuf>,
        /// An explicit libnvidia-ml.so.1 to load.
        #[arg(long)]
        library: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
enum FakeCommand {
    /// List the built-in fake GPU profiles.
    Profiles,
    /// Print a built-in profile as YAML: a starting point for a custom `--fake-profile` file.
    Show {
        /// A built-in profile name (see `gpu-dra fake profiles`).
        name: String,
    },
    /// Stand-in for NVIDIA's nvidia-cuda-mps-control (MPS sharing with the fake backend): -d starts
    /// the daemon, -f runs it in the foreground, neither sends stdin's commands to it.
    #[cfg(feature = "doubles")]
    #[command(hide = true)]
    MpsControlDaemon {
        /// Start the daemon in the background; return once it runs.
        #[arg(short = 'd', conflicts_with = "foreground")]
        daemon: bool,
        /// Run the daemon in the foreground.
        #[arg(short = 'f')]
        foreground: bool,
    },
}

#[derive(Args)]
struct MpsDaemonArgs {
    /// The readiness probe: exit 0 when this ready file exists, 1 otherwise.
    #[arg(long, value_name = "READY_FILE", conflicts_with_all = ["claim", "program"])]
    check_ready: Option<PathBuf>,
    #[arg(long, required_unless_present = "check_ready")]
    claim: Option<String>,
    #[arg(long, required_unless_present = "check_ready")]
    pipe_dir: Option<PathBuf>,
    #[arg(long, required_unless_present = "check_ready")]
    log_dir: Option<PathBuf>,
    #[arg(long, required_unless_present = "check_ready")]
    shm_dir: Option<PathBuf>,
    #[arg(long)]
    driver_root: Option<PathBuf>,
    /// The control program (its path inside the driver root with --driver-root), or `stand-in`.
    #[arg(long, required_unless_present = "check_ready")]
    program: Option<String>,
    #[arg(long)]
    library_path: Option<PathBuf>,
    /// A control command that applies a limit; repeated, applied in order.
    #[arg(long = "command")]
    commands: Vec<String>,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Backend {
    Nvml,
    Fake,
}

#[derive(Args)]
struct BackendArgs {
    /// GPU backend.
    #[arg(
        long = "backend",
        env = "GPU_BACKEND",
        value_enum,
        default_value = "nvml"
    )]
    backend: Backend,
    /// Built-in fake profile name or YAML profile path (with --backend fake).
    #[arg(long, env = "FAKE_GPU_PROFILE", default_value = "dgx-h100")]
    fake_profile: String,
    /// File where the fake GPUs keep MIG devices created at run time, so they outlive plugin restarts
    /// as real GPU state does (with --backend fake); in memory when absent.
    #[arg(long, env = "FAKE_GPU_STATE")]
    fake_state: Option<PathBuf>,
    /// The NVIDIA driver's root on the host (with --backend nvml): `/` for a driver installed on the
    /// host, `/run/nvidia/driver` under the GPU Operator's driver container. Host paths in claim CDI
    /// specs (libraries, hooks, device nodes) are under it.
    #[arg(long, env = "NVIDIA_DRIVER_ROOT", default_value = "/")]
    driver_root: PathBuf,
    /// Where this process sees the driver root, e.g. a hostPath mount of it in the plugin's pod
    /// (with --backend nvml); the driver root itself when absent.
    #[arg(long, env = "CONTAINER_DRIVER_ROOT")]
    container_driver_root: Option<PathBuf>,
    /// How MIG-capable GPUs are published: none (whole GPUs), static (the MIG devices an admin made),
    /// dynamic (every profile and placement, created on demand).
    #[arg(long, env = "MIG_MODE", value_enum, default_value_t = MigMode::Static)]
    mig_mode: MigMode,
}

impl BackendArgs {
    fn choice(&self) -> BackendChoice {
        match self.backend {
            Backend::Nvml => BackendChoice::Nvml {
                driver_root: self
                    .container_driver_root
                    .clone()
                    .unwrap_or_else(|| self.driver_root.clone()),
                host_driver_root: self.driver_root.clone(),
            },
            Backend::Fake => BackendChoice::Fake {
                profile: self.fake_profile.clone(),
                state_file: self.fake_state.clone(),
            },
        }
    }
}

#[derive(Args)]
struct PluginArgs {
    #[arg(long, env = "DRIVER_NAME", default_value = "gpu.dra.dev")]
    driver_name: String,
    #[arg(long, env = "NODE_NAME")]
    node_name: String,
    /// Kubeconfig file; in-cluster configuration when absent.
    #[arg(long, env = "KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    #[arg(
        long,
        env = "KUBELET_REGISTRY_DIR",
        default_value = "/var/lib/kubelet/plugins_registry"
    )]
    kubelet_registry_dir: PathBuf,
    #[arg(
        long,
        env = "KUBELET_PLUGINS_DIR",
        default_value = "/var/lib/kubelet/plugins"
    )]
    kubelet_plugins_dir: PathBuf,
    #[arg(long, env = "CDI_ROOT", default_value = "/var/run/cdi")]
    cdi_root: PathBuf,
    #[command(flatten)]
    backend: BackendArgs,
    /// Address for /healthz, /readyz and /metrics; empty disables.
    #[arg(long, env = "HTTP_ADDR", default_value = "0.0.0.0:8080")]
    http_addr: String,
    #[arg(long, env = "LOG_FORMAT", value_enum, default_value = "text")]
    log_format: LogFormat,
    /// Seconds between checks of the backend for changed GPUs.
    #[arg(long, env = "RESCAN_SECONDS", default_value_t = 5)]
    rescan_seconds: u64,
    /// Seconds start-up waits for the API server (the GpuNodePolicy in force, a checkpoint rebuild)
    /// before it goes on without the answer (then --mig-mode applies until the policy is read).
    #[arg(long, env = "STARTUP_API_TIMEOUT_SECONDS", default_value_t = 5)]
    startup_api_timeout_seconds: u64,
    /// The plugin's namespace, where it makes the Pods of MPS control daemons.
    #[arg(long, env = "POD_NAMESPACE", default_value = "gpu-dra")]
    namespace: String,
    /// The plugin's own Pod; the MPS daemons' Pods run its image unless --mps-daemon-image says otherwise.
    #[arg(long, env = "POD_NAME")]
    pod_name: Option<String>,
    /// The image of the MPS daemons' Pods (it must hold this binary as /usr/local/bin/gpu-dra).
    #[arg(long, env = "MPS_DAEMON_IMAGE")]
    mps_daemon_image: Option<String>,
    /// The size limit of each MPS claim's shared-memory tmpfs (a Kubernetes quantity, e.g. 8Gi);
    /// half of the node's memory when absent.
    #[arg(long, env = "MPS_SHM_SIZE")]
    mps_shm_size: Option<String>,
    /// Where this node's boot id is read (a node reboot is told from a plugin restart by it); the
    /// kernel's when absent. For acting out a reboot on a host that does not reboot (e2e/day-two.sh).
    #[arg(long, env = "BOOT_ID_FILE")]
    boot_id_file: Option<PathBuf>,
    /// The container's terminationMessagePath: why the plugin refused to start goes there, when the
    /// file exists (the kubelet shows it as the container's last state).
    #[arg(
        long,
        env = "TERMINATION_MESSAGE_PATH",
        default_value = gpu_dra::plugin::preflight::TERMINATION_LOG
    )]
    termination_message_path: PathBuf,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Output {
    Yaml,
    Json,
    Table,
}

#[derive(Args)]
struct DevicesArgs {
    #[arg(long, env = "DRIVER_NAME", default_value = "gpu.dra.dev")]
    driver_name: String,
    #[arg(long, env = "NODE_NAME", default_value = "local-node")]
    node_name: String,
    #[command(flatten)]
    backend: BackendArgs,
    #[arg(short = 'o', long, value_enum, default_value = "table")]
    output: Output,
    /// The Kubernetes minor version whose slice layout to print (34: counter sets beside devices;
    /// 35 and later: counter sets in slices of their own).
    #[arg(long, default_value_t = 35)]
    kubernetes_minor: u32,
}

fn main() -> Result<()> {
    // Installed as `kubectl-gpu_dra`, it is the kubectl plugin `kubectl gpu-dra`: usage says so.
    let name = gpu_dra::explain::command_name(std::env::args_os().next().as_deref());
    let matches = Cli::command().bin_name(name).get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    match cli.command {
        Command::Explain(args) => exit_with(explain(args)),
        Command::Plugin(args) => run_plugin(*args),
        Command::Devices(args) => print_devices(args),
        #[cfg(feature = "doubles")]
        Command::Demo => {
            // The demo tells its own story on stdout (including the fault it injects); logs only for errors
            // unless RUST_LOG asks.
            init_logging(LogFormat::Text, "error");
            runtime()?.block_on(gpu_dra::demo::run(&mut std::io::stdout()))
        }
        Command::Cel {
            command: CelCommand::Eval(args),
        } => cel_eval(args),
        Command::Selectors {
            command: SelectorsCommand::Check(args),
        } => exit_with(selectors_check(args)),
        Command::Selectors {
            command: SelectorsCommand::Allocate(args),
        } => exit_with(selectors_allocate(args)),
        Command::Fake {
            command: FakeCommand::Profiles,
        } => {
            emit(&gpu_dra::gpu::describe_builtin_profiles());
            Ok(())
        }
        Command::Nvml {
            command:
                NvmlCommand::Probe {
                    driver_root,
                    container_driver_root,
                    library,
                },
        } => {
            let report = gpu_dra::gpu::nvml::probe(gpu_dra::gpu::NvmlOptions {
                library_path: library,
                driver_root: container_driver_root.unwrap_or(driver_root),
            })?;
            emit(&report.to_string());
            Ok(())
        }
        Command::Fake {
            command: FakeCommand::Show { name },
        } => {
            let profile = gpu_dra::gpu::builtin_profile(&name).with_context(|| {
                format!(
                    "unknown fake GPU profile {name:?} (built-in profiles: {})",
                    gpu_dra::gpu::builtin_profile_names().join(", ")
                )
            })?;
            emit(&serde_yaml::to_string(&profile)?);
            Ok(())
        }
        Command::MpsDaemon(args) => mps_daemon(args),
        #[cfg(feature = "doubles")]
        Command::Fake {
            command: FakeCommand::MpsControlDaemon { daemon, foreground },
        } => {
            use gpu_dra::claims::mps::stand_in::{run, Mode};
            let mode = match (daemon, foreground) {
                (true, _) => Mode::Background,
                (_, true) => Mode::Foreground,
                _ => Mode::Client,
            };
            std::process::exit(run(mode)?)
        }
    }
}

fn shm_size(text: &str) -> Result<u64> {
    let quantity = gpu_dra::quantity::Quantity::parse(text)
        .with_context(|| format!("--mps-shm-size {text:?} is not a quantity"))?;
    quantity
        .as_integer()
        .and_then(|bytes| u64::try_from(bytes).ok())
        .filter(|bytes| *bytes >= 1024 * 1024)
        .with_context(|| {
            format!("--mps-shm-size {text:?} must be a whole number of bytes, at least 1Mi")
        })
}

fn mps_daemon(args: MpsDaemonArgs) -> Result<()> {
    use gpu_dra::claims::mps::supervisor::{check_ready, supervise, SupervisorArgs};
    if let Some(ready) = args.check_ready {
        std::process::exit(check_ready(&ready));
    }
    init_logging(LogFormat::Text, "info");
    // PID 1 of the daemon's Pod: an MPS server whose control daemon died is handed to it.
    if gpu_dra::plugin::reaper::adopts_orphans() {
        std::process::exit(gpu_dra::plugin::reaper::supervise_this_program()?);
    }
    gpu_dra::plugin::reaper::unblock_forwarded_signals()?;
    let missing = |flag: &str| anyhow::anyhow!("--{flag} is required");
    let supervisor = SupervisorArgs {
        claim: args.claim.ok_or_else(|| missing("claim"))?,
        pipe_dir: args.pipe_dir.ok_or_else(|| missing("pipe-dir"))?,
        log_dir: args.log_dir.ok_or_else(|| missing("log-dir"))?,
        shm_dir: args.shm_dir.ok_or_else(|| missing("shm-dir"))?,
        driver_root: args.driver_root,
        program: args.program.ok_or_else(|| missing("program"))?,
        library_path: args.library_path,
        commands: args.commands,
    };
    let code = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?
        .block_on(supervise(supervisor))?;
    std::process::exit(code)
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    // The plugin's blocking work is short file and NVML calls; a small pool bounds the threads (and the
    // allocator arenas that come with each) on nodes with many cores, which keeps memory low.
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cores.clamp(1, 4))
        .max_blocking_threads(8)
        .enable_all()
        .build()
        .context("starting the async runtime")
}

fn run_plugin(args: PluginArgs) -> Result<()> {
    init_logging(args.log_format, "info");
    if gpu_dra::plugin::reaper::adopts_orphans() {
        std::process::exit(gpu_dra::plugin::reaper::supervise_this_program()?);
    }
    gpu_dra::plugin::reaper::unblock_forwarded_signals()?;
    if let Some(path) = &args.boot_id_file {
        gpu_dra::boot::read_boot_id_from(path);
        // An empty id would make every checkpoint look like one of an earlier boot.
        if gpu_dra::boot::current_boot_id().is_empty() {
            anyhow::bail!(
                "--boot-id-file {}: missing, unreadable or empty",
                path.display()
            );
        }
    }
    let http_addr = match args.http_addr.trim() {
        "" => None,
        addr => Some(
            addr.parse::<SocketAddr>()
                .with_context(|| format!("--http-addr {addr:?} is not an address:port"))?,
        ),
    };
    let config = PluginConfig {
        driver_name: args.driver_name,
        node_name: args.node_name,
        registry_dir: args.kubelet_registry_dir,
        plugins_dir: args.kubelet_plugins_dir,
        cdi_root: args.cdi_root,
        backend: args.backend.choice(),
        http_addr,
        rescan_interval: Duration::from_secs(args.rescan_seconds.max(1)),
        mig_mode: args.backend.mig_mode,
        startup_api_timeout: Duration::from_secs(args.startup_api_timeout_seconds.max(1)),
        api: gpu_dra::apiclient::ApiTimeouts::default(),
        mps: gpu_dra::plugin::MpsConfig {
            namespace: args.namespace,
            own_pod: args.pod_name,
            image: args.mps_daemon_image,
            shm_size: match &args.mps_shm_size {
                Some(size) => shm_size(size)?,
                None => gpu_dra::claims::mps::mps_shm::default_size(),
            },
        },
        sharing_timeout: gpu_dra::claims::SHARING_TIMEOUT,
    };
    use gpu_dra::plugin::preflight::{self, DriverRootSetting, Environment, Preflight};
    let preflight = Preflight::new(
        &config,
        DriverRootSetting {
            host: args.backend.driver_root.clone(),
            container: args.backend.container_driver_root.clone(),
        },
        Environment::detect(&args.termination_message_path),
    );
    let kubeconfig = args.kubeconfig;
    runtime()?.block_on(async move {
        // Handlers go in before anything is created, so a signal never finds sockets to leave behind.
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).context("installing SIGTERM handler")?;
        let mut int = signal(SignalKind::interrupt()).context("installing SIGINT handler")?;
        let client = gpu_dra::plugin::kube_client(kubeconfig.as_deref(), &config.api).await;
        if preflight.run(client.as_ref().ok()).await.is_err() {
            // Told already: in the log, the termination message and the Events.
            std::process::exit(preflight::EXIT_CODE);
        }
        let client = client?;
        let plugin = gpu_dra::plugin::start(config, client).await?;
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM received, shutting down"),
            _ = int.recv() => tracing::info!("SIGINT received, shutting down"),
        }
        plugin.shutdown().await;
        Ok(())
    })
}

fn cel_eval(args: CelEvalArgs) -> Result<()> {
    let environment = if args.new_expression {
        gpu_dra::cel::Environment::ApiServer(gpu_dra::cel::FeatureGates {
            consumable_capacity: args.consumable_capacity,
            list_type_attributes: args.list_type_attributes,
        })
    } else {
        gpu_dra::cel::Environment::Scheduler
    };
    match gpu_dra::cel::eval::eval_file(&args.device, &args.driver, &args.expression, &environment)
    {
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

fn print_devices(args: DevicesArgs) -> Result<()> {
    let backend = gpu_dra::plugin::open_backend(&args.backend.choice(), &args.node_name)?;
    let inventory = backend.inventory()?;
    let node = gpu_dra::devices::node_devices(&inventory, args.backend.mig_mode);
    let version = gpu_dra::slices::ServerVersion {
        minor: args.kubernetes_minor,
    };
    let slices =
        gpu_dra::slices::desired_slices(&args.driver_name, &args.node_name, "", &node, version);
    let devices: Vec<_> = node.devices().cloned().collect();
    let text = match args.output {
        Output::Json => serde_json::to_string_pretty(&slices)? + "\n",
        Output::Yaml => slices
            .iter()
            .map(serde_yaml::to_string)
            .collect::<Result<Vec<_>, _>>()?
            .iter()
            .map(|doc| format!("---\n{doc}"))
            .collect(),
        Output::Table => gpu_dra::devices::table(&devices),
    };
    emit(&text);
    Ok(())
}

/// Exits with the code `selectors` chose, or 2 with the message on stderr (anyhow's default would be 1,
/// which means "matches nothing" / "not allocatable" there).
fn exit_with(result: Result<i32>) -> ! {
    match result {
        Ok(code) => std::process::exit(code),
        Err(error) => {
            eprintln!("error: {}", error_text(&error));
            std::process::exit(2)
        }
    }
}

/// The error and its causes, as anyhow's `{:#}` writes them, but each cause once: the library's errors
/// write their cause into their own text and also return it as `source()`, which `{:#}` repeats.
fn error_text(error: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in error.chain().map(ToString::to_string) {
        if text.is_empty() {
            text = cause;
        } else if !text.contains(&cause) {
            text.push_str(": ");
            text.push_str(&cause);
        }
    }
    text
}

fn explain(args: ExplainArgs) -> Result<i32> {
    use gpu_dra::explain::{Source, Target};
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
    let report = runtime()?.block_on(gpu_dra::explain::run(&source, &target))?;
    let output = match args.output {
        Output::Table => gpu_dra::explain::Output::Table,
        Output::Json => gpu_dra::explain::Output::Json,
        Output::Yaml => gpu_dra::explain::Output::Yaml,
    };
    emit(&report.render(output));
    if let Some(error) = &report.error {
        eprintln!("error: {error}");
    }
    Ok(report.exit_code())
}

fn selectors_check(args: SelectorsCheckArgs) -> Result<i32> {
    use gpu_dra::cel::{input, selectors};
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
        let backend = gpu_dra::plugin::open_backend(&args.backend.choice(), &args.node_name)?;
        let node = gpu_dra::devices::node_devices(&backend.inventory()?, args.backend.mig_mode);
        let version = gpu_dra::slices::ServerVersion {
            minor: args.kubernetes_minor,
        };
        gpu_dra::slices::desired_slices(&args.driver_name, &args.node_name, "", &node, version)
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

fn selectors_allocate(args: SelectorsAllocateArgs) -> Result<i32> {
    use gpu_dra::cel::input;
    use gpu_dra::cel::selectors::simulate::{simulate, Simulation};
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

/// Writes a command's output to stdout. A reader that went away (`gpu-dra ... | head`) is not an error:
/// the rest of the output is dropped, as `print!` would panic on the broken pipe instead.
fn emit(text: &str) {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
    {
        Ok(()) => {}
        Err(error) if error.kind() == std::io::ErrorKind::BrokenPipe => {}
        Err(error) => {
            eprintln!("error: cannot write the output: {error}");
            std::process::exit(1);
        }
    }
}
