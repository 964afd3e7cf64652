//! The `gpu-dra` command line: the clap definitions of every subcommand and what each one does, so that
//! `src/main.rs` only parses and dispatches, and tests can call a command as a library function.
//! The top of the binary: errors are `anyhow` here, and the exit codes each command promises are set here.

pub mod backend;
pub mod cel;
pub mod controller;
pub mod explain;
pub mod plugin;
pub mod pod_devices;

use anyhow::{Context, Result};
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};

use backend::{DevicesArgs, FakeCommand, NvmlCommand};
use cel::{CelCommand, SelectorsCommand};
use explain::ExplainArgs;
use plugin::{ImexDaemonArgs, MpsDaemonArgs, PluginArgs};

// No doc comments on the clap types themselves: clap would show them in `--help` as about texts.
#[derive(Parser)]
#[command(
    name = "gpu-dra",
    version,
    about = "Kubernetes DRA driver for NVIDIA GPUs"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Run the kubelet plugin on this node.
    Plugin(Box<PluginArgs>),
    /// Run the ComputeDomain controller (one replica leads, elected with a Lease): places domains on
    /// NVLink cliques and writes their IMEX channel claim templates and status.
    Controller(controller::ControllerArgs),
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
    /// Which GPU each container on this node has: the kubelet's PodResources API and the node's
    /// ResourceSlices, as dcgm-exporter maps them.
    PodDevices(pod_devices::PodDevicesArgs),
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
    /// PID 1 of a ComputeDomain's IMEX daemon Pod, which the plugin creates: runs nvidia-imex,
    /// reports whether it is ready and restarts it when the domain's peers change.
    #[command(hide = true)]
    ImexDaemon(ImexDaemonArgs),
    /// NVML tools, for checking a node with real GPUs.
    Nvml {
        #[command(subcommand)]
        command: NvmlCommand,
    },
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Yaml,
    Json,
    Table,
}

impl Cli {
    /// Parses the process's arguments, or exits with clap's usage error.
    pub fn from_env() -> Self {
        // Installed as `kubectl-gpu_dra`, it is the kubectl plugin `kubectl gpu-dra`: usage says so.
        let name = crate::explain::command_name(std::env::args_os().next().as_deref());
        let matches = Cli::command().bin_name(name).get_matches();
        Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
    }
}

/// `gpu-dra demo`.
#[cfg(feature = "doubles")]
pub fn demo() -> Result<()> {
    // The demo tells its own story on stdout (including the fault it injects); logs only for errors
    // unless RUST_LOG asks.
    crate::observability::init_logging(crate::observability::LogFormat::Text, "error");
    runtime()?.block_on(crate::demo::run(&mut std::io::stdout()))
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

/// Exits with the code `selectors` chose, or 2 with the message on stderr (anyhow's default would be 1,
/// which means "matches nothing" / "not allocatable" there).
pub fn exit_with(result: Result<i32>) -> ! {
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
