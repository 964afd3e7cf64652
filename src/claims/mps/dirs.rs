//! A claim's directories on the node, `<root>/<claimUID>/{pipe,log,shm}`: made with the modes MPS
//! servers of any user need, checked against the 107 bytes a socket path may take, and removed with
//! the claim's tmpfs. A record's directory is trusted only under this root, since `stop` removes it.

use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use tracing::warn;

use super::{
    is_plain_name, pod, shm, MpsDaemonRecord, MpsDaemons, MpsError, LONGEST_SOCKET, MAX_SOCKET_PATH,
};

/// A claim's directories, as this process sees them.
pub(super) struct ClaimDirs {
    pub(super) claim: String,
    pub(super) dir: PathBuf,
    pub(super) pipe: PathBuf,
    pub(super) shm: PathBuf,
    pub(super) log: PathBuf,
}

impl ClaimDirs {
    fn io(&self, action: &'static str, path: &Path) -> impl FnOnce(io::Error) -> MpsError {
        let (claim, path) = (self.claim.clone(), path.to_path_buf());
        move |source| MpsError::Io {
            claim,
            action,
            path,
            source,
        }
    }
}

impl MpsDaemons {
    pub(super) fn dirs_for_uid(&self, claim_uid: &str) -> Result<ClaimDirs, MpsError> {
        if !is_plain_name(claim_uid) {
            return Err(MpsError::InvalidClaimUid {
                claim: claim_uid.to_string(),
            });
        }
        let dir = self.root.join(claim_uid);
        Ok(ClaimDirs {
            claim: claim_uid.to_string(),
            pipe: dir.join("pipe"),
            shm: dir.join("shm"),
            log: dir.join("log"),
            dir,
        })
    }

    /// A record's directory must be a claim directory under this root: `stop` removes it.
    pub(super) fn dirs_for_record(&self, record: &MpsDaemonRecord) -> Result<ClaimDirs, MpsError> {
        let foreign = || MpsError::ForeignDir {
            dir: record.dir.clone(),
            root: self.root.clone(),
        };
        let uid = record.claim_uid().ok_or_else(foreign)?;
        if record.dir.parent() != Some(self.root.as_path()) {
            return Err(foreign());
        }
        self.dirs_for_uid(uid).map_err(|_| foreign())
    }

    /// Makes the directories (keeping existing ones: containers may have them mounted) and clears
    /// a stale ready file. Modes: MPS servers run as the client's user, so they must reach and write
    /// `pipe` and `log`; those are sticky and world-writable like `/tmp`, their parents only
    /// traversable. The tmpfs on `shm` gets the same mode when mounted.
    pub(super) fn prepare_dirs(&self, dirs: &ClaimDirs) -> Result<(), MpsError> {
        let socket = dirs.pipe.join(LONGEST_SOCKET);
        if socket.as_os_str().len() > MAX_SOCKET_PATH {
            return Err(MpsError::PathTooLong {
                claim: dirs.claim.clone(),
                path: socket,
            });
        }
        for (dir, mode) in [
            (&self.root, 0o711),
            (&dirs.dir, 0o711),
            (&dirs.pipe, 0o1777),
            (&dirs.log, 0o1777),
            (&dirs.shm, 0o1777),
        ] {
            fs::create_dir_all(dir).map_err(dirs.io("creating", dir))?;
            if !shm::is_mount_point(dir) {
                fs::set_permissions(dir, fs::Permissions::from_mode(mode))
                    .map_err(dirs.io("setting the mode of", dir))?;
            }
        }
        let ready = dirs.log.join(pod::READY_FILE);
        match fs::remove_file(&ready) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(dirs.io("removing", &ready)(e)),
            _ => Ok(()),
        }
    }

    /// Unmounts the tmpfs and removes the claim's directory; failures are logged.
    pub(super) fn remove_dirs(&self, dirs: &ClaimDirs) {
        if let Err(e) = shm::unmount(&dirs.shm) {
            warn!(claim = %dirs.claim, path = %dirs.shm.display(), error = %e, "unmounting the MPS shared memory failed");
            return;
        }
        if let Err(e) = remove_dir_all(&dirs.dir) {
            warn!(claim = %dirs.claim, path = %dirs.dir.display(), error = %e, "removing the MPS daemon directory failed");
        }
    }
}

fn remove_dir_all(dir: &Path) -> io::Result<()> {
    match fs::remove_dir_all(dir) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}
