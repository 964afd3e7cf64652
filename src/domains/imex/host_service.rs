//! Whether the host runs NVIDIA's own IMEX service. A node runs one IMEX daemon, and the host's
//! `nvidia-imex.service` takes the ports and the role ours would have, so the plugin starts none beside
//! it (NVIDIA's driver only asks, in its prerequisites, that the service be disabled and masked).
//!
//! systemd keeps the symlink `/run/systemd/units/invocation:<unit>` (the unit's invocation ID) from
//! the start of a unit until it is inactive or failed, when it unlinks it (`unit_export_state_files`
//! and `unit_unlink_state_files` in systemd's `src/core/unit.c`; journald reads it). systemd calls
//! these files internal, so this is a best effort: absent on a host without systemd, or where a
//! later systemd moves them, and then the supervisor's port check still finds the host's daemon.

use std::fs;
use std::path::Path;

/// NVIDIA's systemd unit of the IMEX daemon.
pub const HOST_SERVICE: &str = "nvidia-imex.service";

/// Where systemd says the unit runs, below the host's root.
fn invocation_link() -> String {
    format!("run/systemd/units/invocation:{HOST_SERVICE}")
}

/// Why this node must not start an IMEX daemon of its own, when the host (whose `/` this process sees
/// at `host_root`) runs `nvidia-imex.service`; `None` when it does not, or cannot be told.
pub fn host_imex_service(host_root: &Path) -> Option<String> {
    let link = host_root.join(invocation_link());
    // A symlink to an invocation ID, not to a file: whether it exists, not where it points.
    fs::symlink_metadata(&link).ok()?;
    Some(format!(
        "the host runs NVIDIA's IMEX service {HOST_SERVICE} (systemd's /{} exists while the unit is active), and a node runs one IMEX daemon; to let gpu-dra run it, stop the host's for good: `systemctl disable --now {HOST_SERVICE} && systemctl mask {HOST_SERVICE}`; to use the host's daemon instead, run the plugin with `--imex-mode host`",
        invocation_link()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_whose_systemd_runs_the_service_is_named_with_the_fix() {
        let host = tempfile::tempdir().unwrap();
        assert_eq!(host_imex_service(host.path()), None, "no /run/systemd");
        let units = host.path().join("run/systemd/units");
        fs::create_dir_all(&units).unwrap();
        // Other units run; NVIDIA's fabric manager is not the IMEX service.
        std::os::unix::fs::symlink(
            "5c1b0e0f2c1e4d6f9d3a1b2c3d4e5f60",
            units.join("invocation:nvidia-fabricmanager.service"),
        )
        .unwrap();
        assert_eq!(host_imex_service(host.path()), None);

        // As systemd writes it: a symlink whose target is the invocation ID, no file.
        std::os::unix::fs::symlink(
            "0f9e8d7c6b5a49382716a5b4c3d2e1f0",
            units.join("invocation:nvidia-imex.service"),
        )
        .unwrap();
        let reason = host_imex_service(host.path()).expect("the service runs");
        for expected in [
            "nvidia-imex.service",
            "systemctl disable --now nvidia-imex.service && systemctl mask nvidia-imex.service",
            "--imex-mode host",
        ] {
            assert!(reason.contains(expected), "{expected:?} not in {reason:?}");
        }

        // Stopped: systemd unlinks it.
        fs::remove_file(units.join("invocation:nvidia-imex.service")).unwrap();
        assert_eq!(host_imex_service(host.path()), None);
    }
}
