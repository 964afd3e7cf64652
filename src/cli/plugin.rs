//! The node's long-running processes: `gpu-dra plugin` (flags and environment → [`PluginConfig`], the
//! preflight, signals), `gpu-dra mps-daemon` and `gpu-dra imex-daemon`, PID 1 of the MPS and IMEX
//! daemon Pods the plugin creates.
//! Where either is PID 1 of its container, it first splits off a reaper of orphans (`plugin::reaper`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;

use super::backend::BackendArgs;
use super::runtime;
use crate::observability::{init_logging, LogFormat};
use crate::plugin::PluginConfig;

#[derive(Args)]
pub struct PluginArgs {
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
    /// NVIDIA's consumable shares, under --driver-name gpu.nvidia.com only: 'disabled', 'memory',
    /// 'unlimited' or a number of shares per device. A GpuNodePolicy's spec.sharing wins over it.
    #[arg(long, env = "CONSUMABLE_SHARES", default_value = "disabled")]
    consumable_shares: String,
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
    /// Under --driver-name gpu.nvidia.com: the namespace NVIDIA's DRA driver ran in, where its plugin
    /// made the Deployments of MPS daemons; those of the claims taken over from it are deleted there.
    #[arg(long, env = "NVIDIA_DRIVER_NAMESPACE", default_value = crate::claims::DEFAULT_NVIDIA_NAMESPACE)]
    nvidia_namespace: String,
    /// The size limit of each MPS claim's shared-memory tmpfs (a Kubernetes quantity, e.g. 8Gi) where
    /// the claim's MPS config sets no `shmSize`; 64Mi when absent, the /dev/shm containerd and Docker
    /// give a container.
    #[arg(long, env = "MPS_SHM_SIZE")]
    mps_shm_size: Option<String>,
    /// Whether a node whose GPUs joined an NVLink clique publishes its IMEX channel device (1) for
    /// ComputeDomains, or not (0). A node serves one domain at a time, so there is one device.
    #[arg(long, env = "IMEX_CHANNELS", default_value_t = crate::domains::channels::DEFAULT_CHANNELS,
          value_parser = clap::value_parser!(u32).range(0..=1))]
    imex_channels: u32,
    /// The address other nodes' IMEX daemons reach this node's at (the Pod's status.hostIP); the
    /// Node's InternalIP when absent.
    #[arg(long, env = "NODE_IP")]
    node_ip: Option<String>,
    /// Who runs the node's IMEX daemon for ComputeDomains: the plugin, in a Pod of its own, or the
    /// host (`nvidia-imex.service`), which the plugin then only asks whether it is ready.
    #[arg(long, env = "IMEX_MODE", value_enum, default_value_t = crate::domains::membership::ImexMode::Plugin)]
    imex_mode: crate::domains::membership::ImexMode,
    /// With --imex-mode host: the host daemon's command socket (`IMEX_CMD_UNIX_DOMAIN_PATH` of its
    /// config.cfg), as a path on the host.
    #[arg(long, env = "IMEX_HOST_SOCKET", default_value = crate::domains::imex::host_managed::DEFAULT_SOCKET)]
    imex_host_socket: PathBuf,
    /// With --imex-mode host: the program to ask instead of the driver root's nvidia-imex-ctl (run
    /// as it is, with `-q --u=<socket>`), e.g. a stand-in with the fake backend.
    #[arg(long, env = "IMEX_HOST_CTL")]
    imex_host_ctl: Option<PathBuf>,
    /// Where this node's boot id is read (a node reboot is told from a plugin restart by it); the
    /// kernel's when absent. For acting out a reboot on a host that does not reboot (e2e/day-two.sh).
    #[arg(long, env = "BOOT_ID_FILE")]
    boot_id_file: Option<PathBuf>,
    /// The container's terminationMessagePath: why the plugin refused to start goes there, when the
    /// file exists (the kubelet shows it as the container's last state).
    #[arg(
        long,
        env = "TERMINATION_MESSAGE_PATH",
        default_value = crate::plugin::preflight::TERMINATION_LOG
    )]
    termination_message_path: PathBuf,
}

#[derive(Args)]
pub struct MpsDaemonArgs {
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
    /// Start the control daemon in multi-user mode (`-M`).
    #[arg(long)]
    multi_user: bool,
}

#[derive(Args)]
pub struct ImexDaemonArgs {
    /// The readiness probe: exit 0 when this ready file exists, 1 otherwise.
    #[arg(long, value_name = "READY_FILE", conflicts_with_all = ["dir", "program", "ctl_program"])]
    check_ready: Option<PathBuf>,
    /// The domain's directory (config.cfg, nodes_config.cfg) as the daemon sees it.
    #[arg(long, required_unless_present = "check_ready")]
    dir: Option<PathBuf>,
    /// nvidia-imex (its path inside the driver root with --driver-root), or `stand-in`.
    #[arg(long, required_unless_present = "check_ready")]
    program: Option<String>,
    /// nvidia-imex-ctl (its path inside the driver root with --driver-root), or `stand-in`.
    #[arg(long, required_unless_present = "check_ready")]
    ctl_program: Option<String>,
    /// Enter this root (chroot) before starting the daemon.
    #[arg(long)]
    driver_root: Option<PathBuf>,
    #[arg(long)]
    library_path: Option<PathBuf>,
}

/// `gpu-dra plugin`: runs until SIGTERM or SIGINT; a failed preflight exits with its own code.
pub fn run_plugin(args: PluginArgs) -> Result<()> {
    init_logging(args.log_format, "info");
    if crate::plugin::reaper::adopts_orphans() {
        std::process::exit(crate::plugin::reaper::supervise_this_program()?);
    }
    crate::plugin::reaper::unblock_forwarded_signals()?;
    if let Some(path) = &args.boot_id_file {
        crate::boot::read_boot_id_from(path);
        // An empty id would make every checkpoint look like one of an earlier boot.
        if crate::boot::current_boot_id().is_empty() {
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
    let consumable_shares = consumable_shares(&args.consumable_shares, &args.driver_name)?;
    let config = PluginConfig {
        consumable_shares,
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
        api: crate::apiclient::ApiTimeouts::default(),
        mps: crate::plugin::MpsConfig {
            namespace: args.namespace,
            own_pod: args.pod_name,
            image: args.mps_daemon_image,
            shm_size: match &args.mps_shm_size {
                Some(size) => shm_size(size)?,
                None => crate::claims::mps::shm::default_size(),
            },
            nvidia_namespace: args.nvidia_namespace,
        },
        sharing_timeout: crate::claims::SHARING_TIMEOUT,
        call_budget: crate::claims::CALL_BUDGET,
        mig_timeout: crate::claims::MIG_TIMEOUT,
        domains: crate::domains::membership::DomainsConfig {
            imex_channels: args.imex_channels,
            node_ip: args.node_ip,
            imex_mode: args.imex_mode,
            host_socket: args.imex_host_socket,
            host_ctl: args.imex_host_ctl,
        },
        start_bounds: None,
    };
    use crate::plugin::preflight::{self, DriverRootSetting, Environment, Preflight};
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
        let client = crate::plugin::kube_client(kubeconfig.as_deref(), &config.api).await;
        if preflight.run(client.as_ref().ok()).await.is_err() {
            // Told already: in the log, the termination message and the Events.
            std::process::exit(preflight::EXIT_CODE);
        }
        let client = client?;
        let plugin = crate::plugin::start(config, client).await?;
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM received, shutting down"),
            _ = int.recv() => tracing::info!("SIGINT received, shutting down"),
        }
        plugin.shutdown().await;
        Ok(())
    })
}

fn shm_size(text: &str) -> Result<u64> {
    let quantity = crate::quantity::Quantity::parse(text)
        .with_context(|| format!("--mps-shm-size {text:?} is not a quantity"))?;
    quantity
        .as_integer()
        .and_then(|bytes| u64::try_from(bytes).ok())
        .filter(|bytes| *bytes >= 1024 * 1024)
        .with_context(|| {
            format!("--mps-shm-size {text:?} must be a whole number of bytes, at least 1Mi")
        })
}

/// `gpu-dra mps-daemon`: exits with the readiness check's or the supervised daemon's code.
pub fn mps_daemon(args: MpsDaemonArgs) -> Result<()> {
    use crate::claims::mps::supervisor::{supervise, SupervisorArgs};
    // PID 1 of the daemon's Pod: an MPS server whose control daemon died is handed to it.
    run_daemon_pod(args.check_ready, || {
        let missing = |flag: &str| anyhow::anyhow!("--{flag} is required");
        Ok(supervise(SupervisorArgs {
            claim: args.claim.ok_or_else(|| missing("claim"))?,
            pipe_dir: args.pipe_dir.ok_or_else(|| missing("pipe-dir"))?,
            log_dir: args.log_dir.ok_or_else(|| missing("log-dir"))?,
            shm_dir: args.shm_dir.ok_or_else(|| missing("shm-dir"))?,
            driver_root: args.driver_root,
            program: args.program.ok_or_else(|| missing("program"))?,
            library_path: args.library_path,
            commands: args.commands,
            multi_user: args.multi_user,
        }))
    })
}

/// `gpu-dra imex-daemon`: exits with the readiness check's or the supervised daemon's code.
pub fn imex_daemon(args: ImexDaemonArgs) -> Result<()> {
    use crate::domains::imex::supervisor::{supervise, SupervisorArgs};
    run_daemon_pod(args.check_ready, || {
        let missing = |flag: &str| anyhow::anyhow!("--{flag} is required");
        Ok(supervise(SupervisorArgs {
            dir: args.dir.ok_or_else(|| missing("dir"))?,
            program: args.program.ok_or_else(|| missing("program"))?,
            ctl_program: args.ctl_program.ok_or_else(|| missing("ctl-program"))?,
            driver_root: args.driver_root,
            library_path: args.library_path,
        }))
    })
}

/// What a daemon Pod's container runs (`gpu-dra mps-daemon`, `gpu-dra imex-daemon`): with
/// `--check-ready FILE` its readiness probe (the file exists); otherwise, as PID 1 of the Pod (which
/// adopts whatever the daemon leaves behind), the supervisor `supervise` makes, until it gives the exit
/// code.
fn run_daemon_pod<F, E>(
    check_ready: Option<PathBuf>,
    supervise: impl FnOnce() -> Result<F>,
) -> Result<()>
where
    F: std::future::Future<Output = Result<i32, E>>,
    E: std::error::Error + Send + Sync + 'static,
{
    if let Some(ready) = check_ready {
        std::process::exit(crate::claims::mps::supervisor::check_ready(&ready));
    }
    init_logging(LogFormat::Text, "info");
    if crate::plugin::reaper::adopts_orphans() {
        std::process::exit(crate::plugin::reaper::supervise_this_program()?);
    }
    crate::plugin::reaper::unblock_forwarded_signals()?;
    let supervising = supervise()?;
    let code = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?
        .block_on(supervising)?;
    std::process::exit(code)
}

/// `--consumable-shares` with NVIDIA's meaning, accepted only under NVIDIA's driver name: under our
/// own name a GpuNodePolicy says per node pool what is shared and how.
fn consumable_shares(text: &str, driver: &str) -> Result<Option<crate::devices::Shares>> {
    let shares = crate::devices::Shares::nvidia_flag(text).map_err(anyhow::Error::msg)?;
    if shares.is_some() && driver != crate::api::NVIDIA_DRIVER_NAME {
        anyhow::bail!(
            "--consumable-shares (CONSUMABLE_SHARES) is NVIDIA's flag, taken only under --driver-name {}; \
             under {driver} set spec.sharing.shares in a GpuNodePolicy instead",
            crate::api::NVIDIA_DRIVER_NAME
        );
    }
    Ok(shares)
}

#[cfg(test)]
mod consumable_shares_tests {
    use super::consumable_shares;
    use crate::devices::ShareCapacity;

    #[test]
    fn the_flag_takes_nvidias_values_under_nvidias_name_only() {
        let nvidia = crate::api::NVIDIA_DRIVER_NAME;
        assert_eq!(consumable_shares("disabled", "gpu.dra.dev").unwrap(), None);
        let four = consumable_shares("4", nvidia).unwrap().unwrap();
        assert_eq!(four.capacity, ShareCapacity::Count(4));
        assert!(four.gpus && four.mig_devices && four.nvidia);
        let memory = consumable_shares(" memory ", nvidia).unwrap().unwrap();
        assert_eq!(memory.capacity, ShareCapacity::NvidiaMemory);
        let wrong = consumable_shares("-2", nvidia).unwrap_err().to_string();
        assert_eq!(
            wrong,
            "invalid value for --consumable-shares: \"-2\" (must be 'disabled', 'memory', 'unlimited', or a positive integer)"
        );
        let ours = consumable_shares("unlimited", "gpu.dra.dev")
            .unwrap_err()
            .to_string();
        assert!(
            ours.contains("set spec.sharing.shares in a GpuNodePolicy"),
            "{ours}"
        );
        assert!(consumable_shares("1", nvidia).is_err());
    }
}
