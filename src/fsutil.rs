//! File writes that a crash cannot leave half done: temp file in the same directory, then rename.
//! Two strengths:
//! - [`write_atomically`] also fsyncs the file and the directory, so the new contents survive a power
//!   cut. For state that outlives a reboot (the fault file, the fake backend's GPUs).
//! - [`write_for_this_boot`] does not: readers see the old or the new contents, never a mix, and a
//!   crash of the process loses nothing (what was written sits in the page cache). Only a power cut can
//!   leave the file old, empty or torn, and a power cut is a reboot. For state that recovery after a
//!   reboot checks anyway: the checkpoint and the CDI specs (see `claims/recovery.rs`).

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// Writes `contents` to `path` atomically and durably with the given file mode. The temporary name
/// starts with `.` and ends in `.tmp` so that watchers of the directory (CDI runtimes) never load it.
pub fn write_atomically(path: &Path, contents: &[u8], mode: u32) -> io::Result<()> {
    replace(path, contents, mode, Sync::ToDisk)
}

/// Writes `contents` to `path` atomically, without fsync: it holds until the next reboot (see the
/// module's comment). The temporary name is that of [`write_atomically`].
pub fn write_for_this_boot(path: &Path, contents: &[u8], mode: u32) -> io::Result<()> {
    replace(path, contents, mode, Sync::No)
}

/// [`write_for_this_boot`] for a file replaced many times a second: the old file is first renamed
/// aside to `<path>.old`, then the new one takes its name, then the old one is removed. ext4 writes a
/// file's data out at once when it is renamed over an existing file (`auto_da_alloc`), which cost
/// each checkpoint write a disk write and about half of its CPU time; renamed onto a free name, a
/// version replaced within the writeback delay never reaches the disk. A crash between the renames
/// leaves only `<path>.old`, which [`finish_interrupted_replace`] puts back.
pub fn replace_for_this_boot(path: &Path, contents: &[u8], mode: u32) -> io::Result<()> {
    let aside = aside_path(path);
    match fs::symlink_metadata(path) {
        // Only a file is replaced, as a rename over anything else would fail.
        Ok(meta) if !meta.file_type().is_file() => {
            return Err(io::Error::other(format!(
                "{} is not a regular file",
                path.display()
            )))
        }
        Ok(_) => fs::rename(path, &aside)?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    if let Err(error) = replace(path, contents, mode, Sync::No) {
        // Put the old version back so that the file is never missing for longer than the write.
        let _ = fs::rename(&aside, path);
        return Err(error);
    }
    remove_for_this_boot(&aside)
}

/// After a crash during [`replace_for_this_boot`]: a `<path>.old` without a `<path>` is the last
/// version and becomes `<path>` again; one beside a `<path>` is stale and goes.
pub fn finish_interrupted_replace(path: &Path) -> io::Result<()> {
    let aside = aside_path(path);
    if fs::symlink_metadata(&aside).is_err() {
        return Ok(());
    }
    match fs::symlink_metadata(path) {
        Ok(_) => remove_for_this_boot(&aside),
        Err(e) if e.kind() == io::ErrorKind::NotFound => fs::rename(&aside, path),
        Err(e) => Err(e),
    }
}

fn aside_path(path: &Path) -> std::path::PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".old");
    std::path::PathBuf::from(name)
}

#[derive(Clone, Copy, PartialEq)]
enum Sync {
    ToDisk,
    No,
}

fn replace(path: &Path, contents: &[u8], mode: u32, sync: Sync) -> io::Result<()> {
    let dir = path.parent().ok_or_else(|| {
        io::Error::new(io::ErrorKind::InvalidInput, "path has no parent directory")
    })?;
    let file_name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "path has no file name"))?;
    let tmp = dir.join(format!(
        ".{}.{}.{}.tmp",
        file_name.to_string_lossy(),
        std::process::id(),
        unique_suffix()
    ));
    let result = (|| {
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&tmp)?;
        file.write_all(contents)?;
        if sync == Sync::ToDisk {
            file.sync_all()?;
        }
        drop(file);
        fs::rename(&tmp, path)?;
        match sync {
            Sync::ToDisk => sync_dir(dir),
            Sync::No => Ok(()),
        }
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Removes `path`; a missing file is not an error. Like [`write_for_this_boot`], the removal holds
/// until the next reboot: after a power cut the file may be back.
pub fn remove_for_this_boot(path: &Path) -> io::Result<()> {
    match fs::remove_file(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}

/// Temp files of [`write_atomically`] that a crash left behind in `dir` for files named `<prefix>...`.
pub fn is_leftover_temp_file(file_name: &str, prefix: &str) -> bool {
    file_name.starts_with(&format!(".{prefix}")) && file_name.ends_with(".tmp")
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

fn unique_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    COUNTER.fetch_add(1, Ordering::Relaxed)
}

/// Moves a state file this build cannot use out of the way, as `<path>.<label>-<UTC time>` (e.g.
/// `checkpoint.json.corrupt-20261203T172746Z`; no colons, so the name is safe in every tool), with a
/// counter when that name is taken. A directory at `path` is moved the same way. Returns the new path.
pub fn set_aside(path: &Path, label: &str) -> io::Result<std::path::PathBuf> {
    let stamp = k8s_openapi::jiff::Timestamp::now().strftime("%Y%m%dT%H%M%SZ");
    let base = format!("{}.{label}-{stamp}", path.display());
    for attempt in 0..100u32 {
        let candidate = match attempt {
            0 => std::path::PathBuf::from(&base),
            n => std::path::PathBuf::from(format!("{base}-{n}")),
        };
        if fs::symlink_metadata(&candidate).is_ok() {
            continue;
        }
        fs::rename(path, &candidate)?;
        if let Some(dir) = path.parent() {
            sync_dir(dir)?;
        }
        return Ok(candidate);
    }
    Err(io::Error::new(
        io::ErrorKind::AlreadyExists,
        format!("{base} and 99 numbered names after it exist already"),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn both_writes_replace_the_file_whole_with_its_mode_and_leave_no_temp_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        write_atomically(&path, b"first", 0o600).unwrap();
        write_for_this_boot(&path, b"second, longer", 0o644).unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"second, longer");
        // The file is the new one (renamed over the old), with the new one's mode.
        let mode = fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o644);
        let names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("state.json")]);
        remove_for_this_boot(&path).unwrap();
        remove_for_this_boot(&path).unwrap();
        assert!(!path.exists());
    }

    #[test]
    fn a_replace_interrupted_between_its_renames_is_finished_from_the_file_set_aside() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("checkpoint.json");
        let aside = dir.path().join("checkpoint.json.old");
        replace_for_this_boot(&path, b"one", 0o600).unwrap();
        replace_for_this_boot(&path, b"two", 0o600).unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"two");
        assert!(!aside.exists());
        // Killed after the first rename: only the old version, aside.
        fs::rename(&path, &aside).unwrap();
        finish_interrupted_replace(&path).unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"two");
        assert!(!aside.exists());
        // Killed after the second rename: the new version in place, the old one still aside.
        fs::write(&aside, b"one").unwrap();
        finish_interrupted_replace(&path).unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"two");
        assert!(!aside.exists());
        finish_interrupted_replace(&path).unwrap();
    }

    #[test]
    fn a_failed_write_leaves_the_old_contents_and_no_temp_file() {
        let dir = tempfile::tempdir().unwrap();
        // A directory in the way of the rename makes it fail after the temp file was written.
        let blocked = dir.path().join("blocked");
        fs::create_dir(&blocked).unwrap();
        fs::write(blocked.join("inside"), b"x").unwrap();
        assert!(write_for_this_boot(&blocked, b"new", 0o600).is_err());
        assert!(replace_for_this_boot(&blocked, b"new", 0o600).is_err());
        // What stood there is untouched, and nothing was set aside.
        assert_eq!(fs::read(blocked.join("inside")).unwrap(), b"x");
        assert!(!dir.path().join("blocked.old").exists());
        let temps = fs::read_dir(dir.path())
            .unwrap()
            .filter(|e| {
                let name = e.as_ref().unwrap().file_name();
                is_leftover_temp_file(&name.to_string_lossy(), "blocked")
            })
            .count();
        assert_eq!(temps, 0);
    }
}
