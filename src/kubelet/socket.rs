//! Unix sockets the kubelet dials: a stale file from a previous instance is replaced, and the socket is
//! made accessible to its owner only (the kubelet runs as root), never to the world.

use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use futures::{Stream, StreamExt};
use thiserror::Error;
use tokio::net::{UnixListener, UnixStream};
use tokio_stream::wrappers::UnixListenerStream;

use super::authority::LenientAuthority;

#[derive(Debug, Error)]
pub enum SocketError {
    #[error("creating directory {path}: {source}")]
    Directory {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} exists and is not a socket; refusing to replace it")]
    NotASocket { path: String },
    #[error("removing stale socket {path}: {source}")]
    RemoveStale {
        path: String,
        source: std::io::Error,
    },
    #[error("listening on {path}: {source}")]
    Bind {
        path: String,
        source: std::io::Error,
    },
}

/// Binds a listening socket at `path` with mode 0600, creating the directory if needed.
pub fn bind_private_socket(path: &Path) -> Result<UnixListener, SocketError> {
    let shown = path.display().to_string();
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|source| SocketError::Directory {
            path: dir.display().to_string(),
            source,
        })?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            std::fs::remove_file(path).map_err(|source| SocketError::RemoveStale {
                path: shown.clone(),
                source,
            })?
        }
        Ok(_) => return Err(SocketError::NotASocket { path: shown }),
        Err(_) => {}
    }
    // The umask would leave a window where the socket is world-accessible between bind and chmod, so
    // bind under a restrictive umask. umask is process-wide; sockets are bound at start only.
    let previous = set_umask(0o077);
    let bound = UnixListener::bind(path);
    set_umask(previous);
    let listener = bound.map_err(|source| SocketError::Bind {
        path: shown.clone(),
        source,
    })?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(|source| {
        SocketError::Bind {
            path: shown,
            source,
        }
    })?;
    Ok(listener)
}

/// The connections accepted on `listener`, each behind [`LenientAuthority`]: the kubelet's registration
/// client sends the socket path as `:authority`, which tonic's HTTP/2 server would otherwise refuse.
/// Accept errors (out of file descriptors) are retried after growing pauses (`accept.rs`), never
/// handed to tonic, which would retry at once and spin.
pub fn lenient_incoming(
    listener: UnixListener,
) -> impl Stream<Item = std::io::Result<LenientAuthority<UnixStream>>> {
    super::accept::with_backoff(UnixListenerStream::new(listener))
        .map(|connection| Ok(LenientAuthority::new(connection)))
}

/// How often a served socket's file is looked at (`socket_lost`).
pub const SOCKET_CHECK_INTERVAL: Duration = Duration::from_secs(2);

/// The file a socket was bound as: device and inode, so that a new file at the same path is told apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SocketFile {
    dev: u64,
    ino: u64,
}

impl SocketFile {
    /// The socket file now at `path`; `None` when there is none.
    pub fn at(path: &Path) -> Option<SocketFile> {
        let meta = std::fs::symlink_metadata(path).ok()?;
        meta.file_type().is_socket().then(|| SocketFile {
            dev: meta.dev(),
            ino: meta.ino(),
        })
    }
}

/// Resolves, with what happened in words, once the file at `path` is no longer the socket `bound`:
/// removed (a wiped plugin directory) or replaced (another instance bound it). The kubelet dials the
/// path, so from then on it cannot reach the server behind `bound`, although the server runs on; the
/// caller ends the server so that `/healthz` fails and the kubelet restarts the plugin.
pub async fn socket_lost(path: PathBuf, bound: Option<SocketFile>, every: Duration) -> String {
    loop {
        tokio::time::sleep(every).await;
        let now = SocketFile::at(&path);
        if now != bound {
            let what = if now.is_none() {
                "removed"
            } else {
                "replaced by another"
            };
            return format!("socket {} was {what}", path.display());
        }
    }
}

/// Removes the socket file at `path` if it is one (used at shutdown).
pub fn remove_socket(path: &Path) {
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if meta.file_type().is_socket() {
            let _ = std::fs::remove_file(path);
        }
    }
}

fn set_umask(mask: u32) -> u32 {
    let mode = nix::sys::stat::Mode::from_bits_truncate(mask as nix::libc::mode_t);
    nix::sys::stat::umask(mode).bits() as u32
}
