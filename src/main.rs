//! The `gpu-dra` command line: parses flags and calls into the library; no logic of its own.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};

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
    Plugin(PluginArgs),
    /// Print the ResourceSlices this node would publish.
    Devices(DevicesArgs),
    /// A local end-to-end walkthrough with the fake backend and in-process API server and kubelet.
    Demo,
    /// Fake GPU backend tools.
    Fake {
        #[command(subcommand)]
        command: FakeCommand,
    },
    /// NVML tools, for checking a node with real GPUs.
    Nvml {
        #[command(subcommand)]
        command: NvmlCommand,
    },
}

#[derive(Subcommand)]
enum NvmlCommand {
    /// Print what NVML reports about the node's GPUs (read-only: changes nothing on them).
    Probe {
        /// Where the host's root filesystem (with the NVIDIA driver) is mounted.
        #[arg(long, env = "NVIDIA_DRIVER_ROOT", default_value = "/")]
        driver_root: PathBuf,
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
    /// Where the host's root filesystem (with the NVIDIA driver) is mounted (with --backend nvml).
    #[arg(long, env = "NVIDIA_DRIVER_ROOT", default_value = "/")]
    driver_root: PathBuf,
    /// How MIG-capable GPUs are published: none (whole GPUs), static (the MIG devices an admin made),
    /// dynamic (every profile and placement, created on demand).
    #[arg(long, env = "MIG_MODE", value_enum, default_value_t = MigMode::Static)]
    mig_mode: MigMode,
}

impl BackendArgs {
    fn choice(&self) -> BackendChoice {
        match self.backend {
            Backend::Nvml => BackendChoice::Nvml {
                driver_root: self.driver_root.clone(),
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
    let cli = Cli::parse();
    match cli.command {
        Command::Plugin(args) => run_plugin(args),
        Command::Devices(args) => print_devices(args),
        Command::Demo => {
            // The demo tells its own story on stdout (including the fault it injects); logs only for errors
            // unless RUST_LOG asks.
            init_logging(LogFormat::Text, "error");
            runtime()?.block_on(gpu_dra::demo::run(&mut std::io::stdout()))
        }
        Command::Fake {
            command: FakeCommand::Profiles,
        } => {
            print!("{}", gpu_dra::gpu::describe_builtin_profiles());
            Ok(())
        }
        Command::Nvml {
            command:
                NvmlCommand::Probe {
                    driver_root,
                    library,
                },
        } => {
            let report = gpu_dra::gpu::nvml::probe(gpu_dra::gpu::NvmlOptions {
                library_path: library,
                driver_root,
            })?;
            print!("{report}");
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
            print!("{}", serde_yaml::to_string(&profile)?);
            Ok(())
        }
    }
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
    };
    let kubeconfig = args.kubeconfig;
    runtime()?.block_on(async move {
        // Handlers go in before anything is created, so a signal never finds sockets to leave behind.
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).context("installing SIGTERM handler")?;
        let mut int = signal(SignalKind::interrupt()).context("installing SIGINT handler")?;
        let client = gpu_dra::plugin::kube_client(kubeconfig.as_deref()).await?;
        let plugin = gpu_dra::plugin::start(config, client).await?;
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM received, shutting down"),
            _ = int.recv() => tracing::info!("SIGINT received, shutting down"),
        }
        plugin.shutdown().await;
        Ok(())
    })
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
    print!("{text}");
    Ok(())
}
