//! The shared memory of one MPS claim: a tmpfs with a size limit, mounted by the plugin at
//! `<plugin-dir>/mps/<claimUID>/shm`. The MPS server (in the daemon's Pod) and the claim's containers
//! mount it at `/dev/shm`, so they see one memory, as MPS needs. A tmpfs rather than a directory: a
//! directory on the kubelet's disk would let a pod fill `/var/lib/kubelet` uncounted. Its pages are
//! charged to the memory cgroup of the container that writes them, so a pod pays for what it stores.
//!
//! The plugins directory is mounted with `Bidirectional` propagation, so the mount made in the
//! plugin's container reaches the host, where the runtime binds it into containers.

use std::path::Path;

use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sys::statfs::{statfs, TMPFS_MAGIC};

/// Whether `dir` is the root of a tmpfs (or inside one).
pub fn is_tmpfs(dir: &Path) -> bool {
    statfs(dir).is_ok_and(|fs| fs.filesystem_type() == TMPFS_MAGIC)
}

/// Mounts a tmpfs of `size_bytes` at `dir` (world-writable and sticky like `/dev/shm`: MPS servers
/// and clients run as the workload's user), unless one is mounted there already.
pub fn mount_tmpfs(dir: &Path, size_bytes: u64) -> nix::Result<()> {
    if is_mount_point(dir) && is_tmpfs(dir) {
        return Ok(());
    }
    let options = format!("size={size_bytes},mode=1777");
    mount(
        Some("gpu-dra-mps-shm"),
        dir,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        Some(options.as_str()),
    )
}

/// Unmounts the tmpfs at `dir` if one is mounted there. Detached: a container that still holds it
/// keeps its view until it ends, and the memory goes with the last user.
pub fn unmount(dir: &Path) -> nix::Result<()> {
    if !is_mount_point(dir) {
        return Ok(());
    }
    umount2(dir, MntFlags::MNT_DETACH)
}

/// Whether `dir` is a mount point: its device differs from its parent's.
pub fn is_mount_point(dir: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let (Ok(own), Some(Ok(parent))) = (std::fs::metadata(dir), dir.parent().map(std::fs::metadata))
    else {
        return false;
    };
    own.dev() != parent.dev()
}

/// The size of the tmpfs mounted at `dir`, in bytes.
pub fn tmpfs_size(dir: &Path) -> Option<u64> {
    let fs = statfs(dir).ok()?;
    (fs.filesystem_type() == TMPFS_MAGIC).then(|| fs.blocks() * fs.block_size() as u64)
}

/// The size of a claim's tmpfs unless its MPS config or `--mps-shm-size` says otherwise: what
/// containers get for `/dev/shm` by default, 64 MiB, in containerd's CRI (`defaultShmSize`,
/// internal/cri/server/podsandbox/helpers_linux.go) and in Docker (`DefaultShmSize`,
/// daemon/config/config.go). A claim's containers see this tmpfs at `/dev/shm` instead of the
/// runtime's, so they get the size they would get without MPS; a workload that needs more (NCCL,
/// PyTorch DataLoader workers) asks for it with `shmSize`, as it would with an `emptyDir` of medium
/// `Memory`.
pub const DEFAULT_SIZE: u64 = 64 * 1024 * 1024;

/// The node's default size of a claim's tmpfs: [`DEFAULT_SIZE`].
pub fn default_size() -> u64 {
    DEFAULT_SIZE
}

/// The node's memory (`MemTotal`), which bounds what a claim may ask for its tmpfs.
pub fn node_memory() -> Option<u64> {
    use procfs::Current;
    procfs::Meminfo::current()
        .ok()
        .map(|memory| memory.mem_total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_size_is_what_containers_get_for_dev_shm() {
        assert_eq!(default_size(), 64 * 1024 * 1024);
        assert!(node_memory().is_some_and(|memory| memory > default_size()));
    }

    #[test]
    fn a_plain_directory_is_neither_a_mount_point_nor_a_tmpfs_mount() {
        let dir = tempfile::tempdir().unwrap();
        let inner = dir.path().join("shm");
        std::fs::create_dir(&inner).unwrap();
        assert!(!is_mount_point(&inner));
        assert!(unmount(&inner).is_ok(), "nothing to unmount is fine");
    }
}
