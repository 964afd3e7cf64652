//! The `gpu-dra` command line: parses flags and calls into the library; no logic of its own. The flags
//! and what each command does are in `gpu_dra::cli`.

use anyhow::Result;

use gpu_dra::cli::cel::{CelCommand, SelectorsCommand};
use gpu_dra::cli::{self, exit_with, Cli, Command};

fn main() -> Result<()> {
    match Cli::from_env().command {
        Command::Plugin(args) => cli::plugin::run_plugin(*args),
        Command::Controller(args) => cli::controller::run_controller(args),
        Command::MpsDaemon(args) => cli::plugin::mps_daemon(args),
        Command::ImexDaemon(args) => cli::plugin::imex_daemon(args),
        Command::Devices(args) => cli::backend::print_devices(args),
        Command::Fake { command } => cli::backend::fake(command),
        Command::Nvml { command } => cli::backend::nvml(command),
        Command::Cel {
            command: CelCommand::Eval(args),
        } => cli::cel::cel_eval(args),
        Command::Selectors {
            command: SelectorsCommand::Check(args),
        } => exit_with(cli::cel::selectors_check(args)),
        Command::Selectors {
            command: SelectorsCommand::Allocate(args),
        } => exit_with(cli::cel::selectors_allocate(args)),
        Command::Explain(args) => exit_with(cli::explain::explain(args)),
        Command::PodDevices(args) => cli::pod_devices::pod_devices(args),
        #[cfg(feature = "doubles")]
        Command::Demo => cli::demo(),
    }
}
