//! Which boot of the node this is. The checkpoint, the fault file and the fake GPUs' state each record
//! the boot they were written in, so that a node reboot (GPU state gone, `/var/run/cdi` emptied) is
//! told apart from a plugin restart. The kernel's boot id is the source; `--boot-id-file` replaces it
//! where a node reboot is acted out without rebooting the host (e2e/day-two.sh).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The kernel's boot id: a random UUID drawn at every boot.
pub const KERNEL_BOOT_ID: &str = "/proc/sys/kernel/random/boot_id";

static SOURCE: OnceLock<PathBuf> = OnceLock::new();

/// Reads the boot id from `path` instead of the kernel, for the rest of this process. Set once, at
/// start, before anything reads it; a second call is ignored.
pub fn read_boot_id_from(path: &Path) {
    let _ = SOURCE.set(path.to_path_buf());
}

/// This boot of the node; empty where it cannot be read.
pub fn current_boot_id() -> String {
    let path = SOURCE
        .get()
        .map(PathBuf::as_path)
        .unwrap_or(Path::new(KERNEL_BOOT_ID));
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}
