//! `--imex-mode host`: for sites that run NVIDIA's `nvidia-imex` as a host service (NVIDIA's DRA driver
//! calls it `hostManaged`, behind its `HostManagedIMEXDaemon` gate). The plugin starts no daemon and
//! writes no IMEX configuration: the host's daemon, its peers file and its TLS are the admin's. A channel
//! prepare asks the host's daemon whether it is READY, as NVIDIA's plugin does
//! (`chroot <driver-root> nvidia-imex-ctl -q --u=<socket>`, where the socket is the command service's Unix
//! socket that the host's `config.cfg` names in `IMEX_CMD_UNIX_DOMAIN_PATH`), reports that state in the
//! node's entry of the domain's status, and gives the container the channel device files as in the
//! plugin's own mode.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use futures::future::BoxFuture;

use crate::domains::membership::{DaemonSpec, DomainDaemons, Peer};
use crate::gpu::DriverCommand;

/// Where NVIDIA's prerequisites put the host daemon's command socket (`IMEX_CMD_UNIX_DOMAIN_PATH`).
pub const DEFAULT_SOCKET: &str = "/etc/nvidia-imex/imex_ctrl.sock";
/// How long `nvidia-imex-ctl -q` may take to answer.
const CTL_TIMEOUT: Duration = Duration::from_secs(5);

/// The host's IMEX daemon, as the plugin asks it.
#[derive(Debug, Clone)]
pub struct HostImex {
    ctl: Ctl,
}

/// How the host's daemon is asked, with the query's arguments.
#[derive(Debug, Clone)]
enum Ctl {
    /// The driver root's `nvidia-imex-ctl` (`chroot <root> /usr/bin/nvidia-imex-ctl`).
    Driver(DriverCommand, Vec<String>),
    /// A program run as it is (tests, the fake backend's `--imex-host-ctl`).
    Program(PathBuf, Vec<String>),
    /// Why it cannot be asked.
    Missing(String),
}

impl HostImex {
    /// The driver root's `nvidia-imex-ctl`, asking the daemon behind `socket` (its path on the host).
    pub fn new(driver_root: &Path, socket: &Path) -> Self {
        let ctl = match DriverCommand::find(driver_root, "nvidia-imex-ctl") {
            Err(error) => Ctl::Missing(format!(
                    "nvidia-imex-ctl not found under the driver root {} ({error}): is NVIDIA's IMEX package installed on this node? `--imex-mode host` asks the host's nvidia-imex.service",
                driver_root.display()
            )),
            Ok(command) => {
                // Inside the root, the host's path is the socket's path; outside it (a root that cannot
                // run its programs), the socket is where this process sees the host's file.
                let socket = if command.runs_inside_root() {
                    socket.to_path_buf()
                } else {
                    driver_root.join(socket.strip_prefix("/").unwrap_or(socket))
                };
                Ctl::Driver(command, query_args(&socket))
            }
        };
        HostImex { ctl }
    }

    /// `program` run as it is with the query's arguments (the fake backend's `--imex-host-ctl`).
    pub fn with_program(program: PathBuf, socket: &Path) -> Self {
        HostImex {
            ctl: Ctl::Program(program, query_args(socket)),
        }
    }

    /// `Ok` when the host's daemon answers READY, else why not.
    pub async fn query(&self) -> Result<(), String> {
        let (mut command, describe) = match &self.ctl {
            Ctl::Program(program, args) => {
                let mut command = std::process::Command::new(program);
                command.args(args);
                (command, program.display().to_string())
            }
            Ctl::Driver(ctl, args) => {
                let mut command = ctl.command();
                command.args(args);
                (command, ctl.describe())
            }
            Ctl::Missing(reason) => return Err(reason.clone()),
        };
        command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let child = tokio::process::Command::from(command)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("running {describe}: {e}"))?;
        let output = tokio::time::timeout(CTL_TIMEOUT, child.wait_with_output())
            .await
            .map_err(|_| {
                format!("the host's nvidia-imex daemon did not answer {describe} -q within {CTL_TIMEOUT:?}")
            })?
            .map_err(|e| format!("running {describe}: {e}"))?;
        let stdout = String::from_utf8_lossy(&output.stdout);
        // NVIDIA's plugin accepts an answer that contains READY.
        if output.status.success() && stdout.contains("READY") {
            return Ok(());
        }
        let said = format!(
            "{} {}",
            stdout.trim(),
            String::from_utf8_lossy(&output.stderr).trim()
        );
        Err(format!(
            "the host's nvidia-imex daemon is not ready: {describe} -q ({}): {}",
            output.status,
            said.trim()
        ))
    }
}

fn query_args(socket: &Path) -> Vec<String> {
    vec!["-q".into(), format!("--u={}", socket.display())]
}

impl DomainDaemons for HostImex {
    /// Starts nothing: the host runs the daemon. A node without `nvidia-imex-ctl` is refused here.
    fn ensure<'a>(&'a self, _spec: &'a DaemonSpec) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            match &self.ctl {
                Ctl::Missing(reason) => Err(reason.clone()),
                Ctl::Driver(..) | Ctl::Program(..) => Ok(()),
            }
        })
    }

    /// The host daemon's peers are the admin's (its own nodes_config.cfg).
    fn set_peers(&self, _domain_uid: &str, _peers: &[Peer]) -> Result<bool, String> {
        Ok(false)
    }

    fn state<'a>(&'a self, _domain_uid: &'a str) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(self.query())
    }

    /// Leaves the host's daemon running.
    fn stop<'a>(&'a self, _domain_uid: &'a str) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async { Ok(()) })
    }

    fn running(&self) -> BoxFuture<'_, Vec<String>> {
        Box::pin(async { Vec::new() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn script(dir: &Path, body: &str) -> PathBuf {
        let path = dir.join("nvidia-imex-ctl");
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    #[tokio::test]
    async fn the_host_daemon_is_asked_over_its_socket_and_its_answer_decides() {
        let dir = tempfile::tempdir().unwrap();
        let socket = Path::new(DEFAULT_SOCKET);
        // Answers READY only when asked with -q over the default socket, as NVIDIA's plugin asks.
        let ready = script(
            dir.path(),
            "[ \"$1\" = -q ] && [ \"$2\" = --u=/etc/nvidia-imex/imex_ctrl.sock ] && echo READY",
        );
        assert_eq!(HostImex::with_program(ready, socket).query().await, Ok(()));

        let waiting = script(
            dir.path(),
            "echo UNAVAILABLE; echo 'waiting for quorum' >&2",
        );
        let error = HostImex::with_program(waiting, socket)
            .query()
            .await
            .unwrap_err();
        assert!(
            error.starts_with("the host's nvidia-imex daemon is not ready")
                && error.contains("UNAVAILABLE waiting for quorum"),
            "{error}"
        );

        let failing = script(dir.path(), "echo 'cannot connect to socket' >&2; exit 1");
        let error = HostImex::with_program(failing, socket)
            .query()
            .await
            .unwrap_err();
        assert!(error.contains("cannot connect to socket"), "{error}");
    }

    #[tokio::test]
    async fn a_root_without_nvidia_imex_ctl_is_refused_with_what_to_install() {
        let root = tempfile::tempdir().unwrap();
        let host = HostImex::new(root.path(), Path::new(DEFAULT_SOCKET));
        let spec = DaemonSpec {
            domain_uid: "u".into(),
            domain: "team/job".into(),
            peers: Vec::new(),
        };
        let error = host.ensure(&spec).await.unwrap_err();
        assert!(
            error.starts_with("nvidia-imex-ctl not found under the driver root")
                && error.contains("is NVIDIA's IMEX package installed"),
            "{error}"
        );
        assert_eq!(host.state("u").await.unwrap_err(), error);
        assert_eq!(host.running().await, Vec::<String>::new());
        assert_eq!(host.set_peers("u", &[]), Ok(false));
    }
}
