//! File writes that a crash cannot leave half done: temp file in the same directory, fsync, rename,
//! fsync of the directory. Used for CDI specs and the checkpoint.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// Writes `contents` to `path` atomically with the given file mode. The temporary name starts with `.`
/// and ends in `.tmp` so that watchers of the directory (CDI runtimes) never load it.
pub fn write_atomically(path: &Path, contents: &[u8], mode: u32) -> io::Result<()> {
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
        file.sync_all()?;
        fs::rename(&tmp, path)?;
        sync_dir(dir)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Removes `path` and makes the removal durable; a missing file is not an error.
pub fn remove_durably(path: &Path) -> io::Result<()> {
    match fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    }
    match path.parent() {
        Some(dir) => sync_dir(dir),
        None => Ok(()),
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
