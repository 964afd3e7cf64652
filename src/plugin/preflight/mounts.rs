//! Whether the kubelet's and the container runtime's directories are volumes from the host, read from
//! this process's mount table (`/proc/self/mountinfo`).

use std::path::{Path, PathBuf};

use super::PreflightError;

/// One kubelet or CDI directory that must be a hostPath volume, for [`check_host_paths`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubeletDir {
    /// The flag and its variable, for messages.
    pub flag: &'static str,
    pub path: PathBuf,
    /// Who on the host needs to see it, and what.
    pub seen_by: &'static str,
}

/// A directory of [`KubeletDir`] that is not a hostPath volume, and where it is instead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotMounted {
    pub dir: KubeletDir,
    pub found: String,
}

/// One line of `/proc/self/mountinfo`: what is mounted where.
#[derive(Debug, Clone, PartialEq, Eq)]
struct MountEntry {
    /// The directory of the mounted filesystem that appears at `mount_point` (a hostPath's host path,
    /// relative to its filesystem).
    root: String,
    mount_point: PathBuf,
}

/// The mounts of a mountinfo text, in its order (a later mount at the same point covers an earlier one);
/// a line `procfs` cannot read is skipped. `procfs` leaves the kernel's octal escapes in the paths (a
/// kubelet directory with a space in it would match nothing), so they are decoded here.
fn parse_mountinfo(text: &str) -> Vec<MountEntry> {
    text.lines()
        .filter_map(|line| procfs::process::MountInfo::from_line(line).ok())
        .map(|mount| MountEntry {
            root: unescape_mountinfo(&mount.root),
            mount_point: PathBuf::from(unescape_mountinfo(&mount.mount_point.to_string_lossy())),
        })
        .collect()
}

/// The kernel writes space, tab, newline and backslash in mountinfo paths as `\ooo` octal escapes.
pub(super) fn unescape_mountinfo(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes
            .get(i + 1..i + 4)
            .filter(|digits| bytes[i] == b'\\' && digits.iter().all(|d| (b'0'..=b'7').contains(d)));
        match octal.and_then(|d| u8::from_str_radix(std::str::from_utf8(d).ok()?, 8).ok()) {
            Some(byte) => {
                out.push(byte);
                i += 4;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Checks that each directory is on a volume from the host: the mount that holds it (itself, or one
/// above it such as a hostPath of all of `/var/lib/kubelet`) must not be the container's own root
/// filesystem, nor an emptyDir. `mountinfo` is this process's `/proc/self/mountinfo`.
pub fn check_host_paths(dirs: &[KubeletDir], mountinfo: &str) -> Result<(), PreflightError> {
    let mounts = parse_mountinfo(mountinfo);
    let not_mounted: Vec<NotMounted> = dirs
        .iter()
        .filter_map(|dir| {
            let found = where_mounted(&dir.path, &mounts)?;
            Some(NotMounted {
                dir: dir.clone(),
                found,
            })
        })
        .collect();
    if not_mounted.is_empty() {
        Ok(())
    } else {
        Err(PreflightError::HostPathNotMounted { dirs: not_mounted })
    }
}

/// `None` when `path` is on a volume from the host; else where it is instead.
fn where_mounted(path: &Path, mounts: &[MountEntry]) -> Option<String> {
    // Mountinfo names mount points with symlinks resolved (/var/run is often a link to /run).
    let resolved = match std::fs::canonicalize(path) {
        Ok(resolved) => resolved,
        Err(_) => return Some("does not exist in this container".to_string()),
    };
    // The last of the longest mount points wins: it is the mount on top.
    let holder = mounts
        .iter()
        .filter(|m| resolved.starts_with(&m.mount_point))
        .fold(None::<&MountEntry>, |best, m| match best {
            Some(b) if b.mount_point.as_os_str().len() > m.mount_point.as_os_str().len() => Some(b),
            _ => Some(m),
        });
    match holder {
        None => Some("is on no mount listed in /proc/self/mountinfo".to_string()),
        Some(m) if m.mount_point == Path::new("/") => {
            Some("is on the container's own root filesystem".to_string())
        }
        Some(m) if m.root.contains("/volumes/kubernetes.io~empty-dir/") => Some(format!(
            "is an emptyDir volume (mounted at {})",
            m.mount_point.display()
        )),
        Some(_) => None,
    }
}
