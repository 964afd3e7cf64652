//! The GPU backend on the command line: the flags that choose it (shared by `plugin`, `devices` and
//! `selectors check`) and the commands that show what it sees: `devices`, `fake` and `nvml probe`.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Subcommand, ValueEnum};

use super::{emit, Output};
use crate::devices::MigMode;
use crate::plugin::BackendChoice;

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Backend {
    Nvml,
    Fake,
}

#[derive(Args)]
pub struct BackendArgs {
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
    pub(super) driver_root: PathBuf,
    /// Where this process sees the driver root, e.g. a hostPath mount of it in the plugin's pod
    /// (with --backend nvml); the driver root itself when absent.
    #[arg(long, env = "CONTAINER_DRIVER_ROOT")]
    pub(super) container_driver_root: Option<PathBuf>,
    /// How MIG-capable GPUs are published: none (whole GPUs), static (the MIG devices an admin made),
    /// dynamic (every profile and placement, created on demand).
    #[arg(long, env = "MIG_MODE", value_enum, default_value_t = MigMode::Static)]
    pub(super) mig_mode: MigMode,
}

impl BackendArgs {
    pub(super) fn choice(&self) -> BackendChoice {
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
pub struct DevicesArgs {
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
    /// IMEX channels published where the node's GPUs joined an NVLink clique (as the plugin's flag).
    #[arg(long, default_value_t = crate::domains::channels::DEFAULT_CHANNELS,
          value_parser = clap::value_parser!(u32).range(0..=1))]
    imex_channels: u32,
}

#[derive(Subcommand)]
pub enum FakeCommand {
    /// List the built-in fake GPU profiles.
    Profiles,
    /// Print a built-in profile as YAML: a starting point for a custom `--fake-profile` file.
    Show {
        /// A built-in profile name (see `gpu-dra fake profiles`).
        name: String,
    },
    /// Stand-in for NVIDIA's nvidia-cuda-mps-control (MPS sharing with the fake backend): -d starts
    /// the daemon, -f runs it in the foreground, neither sends stdin's commands to it;
    /// -multiuser-server is multi-user mode.
    #[cfg(feature = "doubles")]
    #[command(hide = true, disable_help_flag = true)]
    MpsControlDaemon {
        /// NVIDIA's options, read as NVIDIA's program reads them (`-multiuser-server` has one dash,
        /// which clap would take for short flags).
        #[arg(allow_hyphen_values = true, trailing_var_arg = true, num_args = 0..)]
        options: Vec<String>,
    },
    /// Stand-in for NVIDIA's nvidia-imex (ComputeDomains with the fake backend): runs in the
    /// foreground with the config given.
    #[cfg(feature = "doubles")]
    #[command(hide = true)]
    ImexDaemon {
        /// The daemon's config.cfg.
        #[arg(short = 'c')]
        config: PathBuf,
    },
    /// Stand-in for NVIDIA's nvidia-imex-ctl: `-q` prints READY when the daemon of the config answers.
    #[cfg(feature = "doubles")]
    #[command(hide = true)]
    ImexCtl {
        /// Query the daemon's state once.
        #[arg(short = 'q', required = true)]
        query: bool,
        /// The daemon's config.cfg.
        #[arg(short = 'c')]
        config: PathBuf,
    },
}

#[derive(Subcommand)]
pub enum NvmlCommand {
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

/// `gpu-dra devices`.
pub fn print_devices(args: DevicesArgs) -> Result<()> {
    let backend = crate::plugin::open_backend(&args.backend.choice(), &args.node_name)?;
    let inventory = backend.inventory()?;
    let mut node = crate::devices::node_devices(&inventory, args.backend.mig_mode);
    node.channels = crate::domains::channels::channel_devices(&inventory, args.imex_channels);
    let version = crate::slices::ServerVersion {
        minor: args.kubernetes_minor,
    };
    let slices =
        crate::slices::desired_slices(&args.driver_name, &args.node_name, "", &node, version);
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
        Output::Table => crate::devices::table(&devices),
    };
    emit(&text);
    Ok(())
}

/// `gpu-dra fake ...`.
pub fn fake(command: FakeCommand) -> Result<()> {
    match command {
        FakeCommand::Profiles => {
            emit(&crate::gpu::describe_builtin_profiles());
            Ok(())
        }
        FakeCommand::Show { name } => {
            let profile = crate::gpu::builtin_profile(&name).with_context(|| {
                format!(
                    "unknown fake GPU profile {name:?} (built-in profiles: {})",
                    crate::gpu::builtin_profile_names().join(", ")
                )
            })?;
            emit(&serde_yaml::to_string(&profile)?);
            Ok(())
        }
        #[cfg(feature = "doubles")]
        FakeCommand::MpsControlDaemon { options } => {
            use crate::claims::mps::stand_in::{run, Mode};
            match Mode::from_args(&options) {
                Ok(mode) => std::process::exit(run(mode)?),
                Err(why) => {
                    eprintln!("nvidia-cuda-mps-control (stand-in): {why}");
                    std::process::exit(1)
                }
            }
        }
        #[cfg(feature = "doubles")]
        FakeCommand::ImexDaemon { config } => {
            std::process::exit(crate::domains::imex::stand_in::daemon(&config))
        }
        #[cfg(feature = "doubles")]
        FakeCommand::ImexCtl { query: _, config } => {
            std::process::exit(crate::domains::imex::stand_in::ctl_query(&config))
        }
    }
}

/// `gpu-dra nvml ...`.
pub fn nvml(command: NvmlCommand) -> Result<()> {
    match command {
        NvmlCommand::Probe {
            driver_root,
            container_driver_root,
            library,
        } => {
            let report = crate::gpu::nvml::probe(crate::gpu::NvmlOptions {
                library_path: library,
                driver_root: container_driver_root.unwrap_or(driver_root),
            })?;
            emit(&report.to_string());
            Ok(())
        }
    }
}
