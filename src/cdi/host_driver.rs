//! Finds the NVIDIA driver's user-space files (CUDA / NVML libraries, tools, GSP firmware) under the driver
//! root the plugin sees, and turns them into the CDI container edits that give a container what CUDA needs:
//! read-only bind mounts, plus the Container Toolkit's symlink and ldcache hooks when its hook binary is there.

use std::collections::{BTreeSet, HashSet, VecDeque};
use std::ffi::OsString;
use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path, PathBuf};

use super::ldcache;
use super::spec::{ContainerEdits, Hook, Mount};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LibraryClass {
    /// CUDA, NVML, OpenCL and their JIT, compiler and debugger helpers.
    Compute,
    /// NVENC, NVDEC and optical flow.
    Video,
}

use LibraryClass::{Compute, Video};

/// The driver's version-suffixed libraries that compute and video workloads load: the file name before
/// `.so.<version>` (a trailing `*` stands for any suffix), and the soname the dynamic linker looks for where it
/// is not the versioned name itself (libnvidia-gpucomp and the pkcs11 libraries are linked by that name).
const LIBRARIES: [(&str, LibraryClass, Option<&str>); 13] = [
    ("libcuda", Compute, Some("libcuda.so.1")),
    ("libnvidia-ml", Compute, Some("libnvidia-ml.so.1")),
    (
        "libnvidia-ptxjitcompiler",
        Compute,
        Some("libnvidia-ptxjitcompiler.so.1"),
    ),
    ("libnvidia-nvvm", Compute, Some("libnvidia-nvvm.so.4")),
    ("libnvidia-gpucomp", Compute, None),
    (
        "libnvidia-allocator",
        Compute,
        Some("libnvidia-allocator.so.1"),
    ),
    ("libnvidia-cfg", Compute, Some("libnvidia-cfg.so.1")),
    ("libnvidia-opencl", Compute, Some("libnvidia-opencl.so.1")),
    ("libcudadebugger", Compute, Some("libcudadebugger.so.1")),
    // libnvidia-pkcs11 and libnvidia-pkcs11-openssl3 (confidential computing).
    ("libnvidia-pkcs11*", Compute, None),
    ("libnvidia-encode", Video, Some("libnvidia-encode.so.1")),
    ("libnvcuvid", Video, Some("libnvcuvid.so.1")),
    (
        "libnvidia-opticalflow",
        Video,
        Some("libnvidia-opticalflow.so.1"),
    ),
];

/// Without these the driver is unusable in a container: CUDA needs libcuda; NVML and nvidia-smi need
/// libnvidia-ml.
const REQUIRED: [&str; 2] = ["libcuda", "libnvidia-ml"];

/// Applications dlopen these by their bare `.so` name, so the toolkit links that name to the soname too.
const DEV_LINKS: [&str; 2] = ["libcuda", "libnvidia-opticalflow"];

/// This machine's Debian multiarch triple: only its directories are searched, since another
/// architecture's libcuda is of no use.
const MULTIARCH: Option<&str> = if cfg!(target_arch = "x86_64") {
    Some("x86_64-linux-gnu")
} else if cfg!(target_arch = "aarch64") {
    Some("aarch64-linux-gnu")
} else {
    None
};

/// Library directories below the driver root, most specific first, since the first file of a name wins:
/// `/usr/lib` and `/lib` come last because they hold the 32-bit libraries on Red Hat-like hosts.
fn library_dirs() -> Vec<String> {
    let multiarch = |prefix: &str| MULTIARCH.map(|triple| format!("{prefix}/{triple}"));
    let mut dirs: Vec<String> = multiarch("/usr/lib").into_iter().collect();
    dirs.extend(["/usr/lib64", "/lib64"].map(String::from));
    dirs.extend(multiarch("/lib"));
    dirs.extend(["/usr/local/nvidia/lib64", "/usr/lib", "/lib"].map(String::from));
    dirs
}

const BINARY_DIRS: [&str; 4] = [
    "/usr/bin",
    "/usr/local/bin",
    "/usr/local/nvidia/bin",
    "/bin",
];

const BINARIES: [&str; 5] = [
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
];

/// Hook binaries in order of preference; `nvidia-ctk` carries the same hooks under its `hook` command.
const HOOK_BINARIES: [&str; 2] = ["nvidia-cdi-hook", "nvidia-ctk"];

const MOUNT_OPTIONS: [&str; 4] = ["ro", "nosuid", "nodev", "bind"];

/// Real caches are well under 1 MiB; a far larger file is not one.
const MAX_LD_CACHE_BYTES: u64 = 64 << 20;

/// Symlink chains longer than this are loops, as the kernel's own limit says.
const MAX_SYMLINKS: usize = 40;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileKind {
    Library(LibraryClass),
    Binary,
    Firmware,
}

/// One driver file to bind-mount into containers. `container_path` and `host_path` are absolute, UTF-8 and
/// free of `..`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriverFile {
    pub kind: FileKind,
    /// Where the container sees it: the search path below the driver root, e.g.
    /// `/usr/lib/x86_64-linux-gnu/libcuda.so.550.90.07`.
    pub container_path: PathBuf,
    /// What the runtime bind-mounts: the file, with the driver root's own symlinks resolved, under the
    /// host's driver root.
    pub host_path: PathBuf,
    /// Where the plugin found it, under the driver root it was given.
    pub found_at: PathBuf,
    /// For libraries: the soname link the container needs, and the bare `.so` link (pointing at the soname).
    soname: Option<&'static str>,
    dev_link: bool,
}

/// How a hook binary takes the hook name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HookCli {
    /// `nvidia-cdi-hook <hook> ...`
    CdiHook,
    /// `nvidia-ctk hook <hook> ...`
    Ctk,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CdiHook {
    /// The path the container runtime executes, on the host.
    pub host_path: PathBuf,
    pub cli: HookCli,
}

#[derive(Clone, Debug, Default)]
pub struct DiscoveryOptions {
    /// The driver root as the host sees it, which the runtime needs for `hostPath` and the hook's `path`.
    /// `None` means `/`: the driver is installed on the host itself, whatever path the plugin sees it at.
    /// With the GPU Operator's driver container it is typically `/run/nvidia/driver`.
    pub host_driver_root: Option<PathBuf>,
    /// An `nvidia-cdi-hook` or `nvidia-ctk` to use instead of one in the driver root. It must be a path
    /// that is the same in the plugin and on the host (e.g. a copy in the plugin's directory under
    /// `/var/lib/kubelet/plugins`, mounted at the same path); it is checked here and written verbatim.
    pub cdi_hook: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum HostDriverError {
    #[error("driver version {0:?} is not a version like 550.90.07")]
    InvalidVersion(String),
    #[error("driver root {}: {reason}", root.display())]
    InvalidRoot { root: PathBuf, reason: String },
    #[error("driver root {}: {source}", root.display())]
    RootUnreadable { root: PathBuf, source: io::Error },
    /// `searched` lists the directories below the root, including those the root's ld.so.cache named.
    #[error("{missing} not found under driver root {} (searched {searched}); {hint}", root.display())]
    MissingLibraries {
        root: PathBuf,
        version: String,
        /// The missing file names, e.g. `libcuda.so.550.90.07`.
        missing: String,
        searched: String,
        hint: String,
    },
    #[error("CDI hook {}: {reason}", path.display())]
    HookOverride { path: PathBuf, reason: String },
}

/// The driver files of one driver version under one driver root.
#[derive(Clone, Debug)]
pub struct HostDriver {
    driver_root: PathBuf,
    version: String,
    files: Vec<DriverFile>,
    hook: Option<CdiHook>,
    warnings: Vec<String>,
}

impl HostDriver {
    /// Discovers with the default options: the host's driver root is `/` and the hook comes from the
    /// driver root, if it has one.
    pub fn discover(driver_root: &Path, driver_version: &str) -> Result<Self, HostDriverError> {
        Self::discover_with(driver_root, driver_version, &DiscoveryOptions::default())
    }

    pub fn discover_with(
        driver_root: &Path,
        driver_version: &str,
        options: &DiscoveryOptions,
    ) -> Result<Self, HostDriverError> {
        let version_ok = driver_version.starts_with(|c: char| c.is_ascii_digit())
            && driver_version
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '.');
        if !version_ok {
            return Err(HostDriverError::InvalidVersion(driver_version.into()));
        }
        let invalid_root = |root: &Path, reason: &str| HostDriverError::InvalidRoot {
            root: root.into(),
            reason: reason.into(),
        };
        if !driver_root.is_absolute() {
            return Err(invalid_root(driver_root, "not an absolute path"));
        }
        match fs::metadata(driver_root) {
            Ok(meta) if meta.is_dir() => {}
            Ok(_) => return Err(invalid_root(driver_root, "not a directory")),
            Err(source) => {
                return Err(HostDriverError::RootUnreadable {
                    root: driver_root.into(),
                    source,
                })
            }
        }
        let host_root = options
            .host_driver_root
            .clone()
            .unwrap_or_else(|| PathBuf::from("/"));
        if !host_root.is_absolute() || host_root.to_str().is_none() {
            return Err(invalid_root(
                &host_root,
                "the host driver root must be an absolute UTF-8 path",
            ));
        }

        let mut finder = Finder {
            root: driver_root,
            host_root: &host_root,
            warnings: Vec::new(),
        };
        // The cache's directories are for this ABI, so they go before the generic /usr/lib and /lib.
        let mut dirs = library_dirs();
        let mut at = dirs
            .iter()
            .position(|d| d == "/usr/lib")
            .unwrap_or(dirs.len());
        for dir in finder.ld_cache_dirs() {
            if !dirs.contains(&dir) {
                dirs.insert(at, dir);
                at += 1;
            }
        }
        let (mut files, other_versions) = finder.libraries(&dirs, driver_version);

        let missing: Vec<String> = REQUIRED
            .iter()
            .map(|stem| format!("{stem}.so.{driver_version}"))
            .filter(|name| !files.iter().any(|f| f.container_path.ends_with(name)))
            .collect();
        if !missing.is_empty() {
            let hint = if other_versions.is_empty() {
                "no version of them is there either: is the driver installed at this root?"
                    .to_string()
            } else {
                let found: Vec<_> = other_versions.into_iter().collect();
                format!(
                    "found {} instead: the driver at this root is not version {driver_version}",
                    found.join(", ")
                )
            };
            return Err(HostDriverError::MissingLibraries {
                root: driver_root.into(),
                version: driver_version.into(),
                missing: missing.join(" and "),
                searched: dirs.join(", "),
                hint,
            });
        }

        for name in BINARIES {
            if let Some(file) = finder.executable(name, FileKind::Binary) {
                files.push(file);
            }
        }
        files.extend(finder.firmware(driver_version));
        let hook = match &options.cdi_hook {
            Some(path) => Some(hook_override(path)?),
            None => HOOK_BINARIES.iter().find_map(|name| {
                let file = finder.executable(name, FileKind::Binary)?;
                Some(CdiHook {
                    host_path: file.host_path,
                    cli: hook_cli(name),
                })
            }),
        };
        let warnings = finder.warnings;
        Ok(Self {
            driver_root: driver_root.into(),
            version: driver_version.into(),
            files,
            hook,
            warnings,
        })
    }

    pub fn driver_root(&self) -> &Path {
        &self.driver_root
    }

    pub fn version(&self) -> &str {
        &self.version
    }

    /// Libraries (in the table's order), then binaries, then firmware.
    pub fn files(&self) -> &[DriverFile] {
        &self.files
    }

    pub fn cdi_hook(&self) -> Option<&CdiHook> {
        self.hook.as_ref()
    }

    /// Things skipped during discovery that an operator may want to see in the log (unreadable
    /// directories, a corrupt ld.so.cache, files that are not executables).
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// Read-only bind mounts of every file at its container path, plus, with a hook binary, two
    /// `createContainer` hooks as the Container Toolkit writes them: `create-symlinks` for the sonames
    /// (`libcuda.so.1`) and the bare `libcuda.so`, which applications open by name and only the versioned
    /// files are mounted, and `update-ldcache` for the library directories, so the linker finds them.
    pub fn container_edits(&self) -> ContainerEdits {
        let path_str = |p: &Path| p.to_string_lossy().into_owned();
        let mounts = self
            .files
            .iter()
            .map(|f| Mount {
                host_path: path_str(&f.host_path),
                container_path: path_str(&f.container_path),
                options: MOUNT_OPTIONS.iter().map(|o| o.to_string()).collect(),
                mount_type: None,
            })
            .collect();
        let Some(hook) = &self.hook else {
            return ContainerEdits {
                mounts,
                ..Default::default()
            };
        };

        let mut links = Vec::new();
        let mut link_paths = HashSet::new();
        let mut folders: Vec<String> = Vec::new();
        for file in self
            .files
            .iter()
            .filter(|f| matches!(f.kind, FileKind::Library(_)))
        {
            let (Some(dir), Some(name)) = (
                file.container_path.parent(),
                file.container_path.file_name(),
            ) else {
                continue;
            };
            let (dir, name) = (path_str(dir), name.to_string_lossy());
            if !folders.contains(&dir) {
                folders.push(dir.clone());
            }
            let Some(soname) = file.soname.filter(|s| *s != name) else {
                continue;
            };
            // Targets are relative, as the toolkit writes them, so the links stay inside the container.
            let mut add = |target: &str, link: String| {
                if link_paths.insert(link.clone()) {
                    links.extend(["--link".to_string(), format!("{target}::{link}")]);
                }
            };
            add(&name, format!("{dir}/{soname}"));
            if file.dev_link {
                if let Some((stem, _)) = soname.split_once(".so.") {
                    add(soname, format!("{dir}/{stem}.so"));
                }
            }
        }

        let mut hooks = Vec::new();
        if !links.is_empty() {
            hooks.push(hook.hook("create-symlinks", links));
        }
        if !folders.is_empty() {
            let args = folders
                .into_iter()
                .flat_map(|f| ["--folder".to_string(), f])
                .collect();
            hooks.push(hook.hook("update-ldcache", args));
        }
        ContainerEdits {
            mounts,
            hooks,
            ..Default::default()
        }
    }
}

impl CdiHook {
    fn hook(&self, name: &str, args: Vec<String>) -> Hook {
        let base = self
            .host_path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let mut all = vec![base];
        if self.cli == HookCli::Ctk {
            all.push("hook".into());
        }
        all.push(name.into());
        all.extend(args);
        Hook {
            hook_name: "createContainer".into(),
            path: self.host_path.to_string_lossy().into_owned(),
            args: all,
            env: vec!["NVIDIA_CTK_DEBUG=false".into()],
            timeout: None,
        }
    }
}

fn hook_cli(file_name: &str) -> HookCli {
    if file_name == "nvidia-ctk" {
        HookCli::Ctk
    } else {
        HookCli::CdiHook
    }
}

fn hook_override(path: &Path) -> Result<CdiHook, HostDriverError> {
    let fail = |reason: String| HostDriverError::HookOverride {
        path: path.into(),
        reason,
    };
    if !path.is_absolute() || path.to_str().is_none() {
        return Err(fail("not an absolute UTF-8 path".into()));
    }
    let meta = fs::metadata(path).map_err(|e| fail(e.to_string()))?;
    if !meta.is_file() || meta.permissions().mode() & 0o111 == 0 {
        return Err(fail("not an executable file".into()));
    }
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default();
    Ok(CdiHook {
        host_path: path.into(),
        cli: hook_cli(name),
    })
}

/// Lookups below the driver root, treating its symlinks as the host would (absolute targets are
/// relative to the root, not to the plugin's filesystem).
struct Finder<'a> {
    root: &'a Path,
    host_root: &'a Path,
    warnings: Vec<String>,
}

impl Finder<'_> {
    /// Resolves `path` (absolute, as seen from the root) to the path of what it names, following
    /// symlinks inside the root; the result is absolute and free of `.`, `..` and symlinks.
    fn resolve(&self, path: &Path) -> io::Result<PathBuf> {
        let mut resolved = PathBuf::from("/");
        let mut pending: VecDeque<OsString> = parts(path);
        let mut hops = 0;
        while let Some(part) = pending.pop_front() {
            if part == ".." {
                resolved.pop();
                continue;
            }
            let candidate = resolved.join(&part);
            let on_disk = self.on_disk(&candidate);
            if !fs::symlink_metadata(&on_disk)?.file_type().is_symlink() {
                resolved = candidate;
                continue;
            }
            hops += 1;
            if hops > MAX_SYMLINKS {
                return Err(io::Error::other("too many levels of symbolic links"));
            }
            let target = fs::read_link(&on_disk)?;
            if target.is_absolute() {
                resolved = PathBuf::from("/");
            }
            let mut next = parts(&target);
            next.extend(pending);
            pending = next;
        }
        Ok(resolved)
    }

    fn on_disk(&self, resolved: &Path) -> PathBuf {
        self.root
            .join(resolved.strip_prefix("/").unwrap_or(resolved))
    }

    /// The names in a directory below the root, sorted, with the directory's resolved path; `None` when it
    /// does not exist (not worth a warning) or cannot be read (worth one).
    fn list(&mut self, dir: &Path) -> Option<(PathBuf, Vec<String>)> {
        let listing = self.resolve(dir).and_then(|resolved| {
            let names = fs::read_dir(self.on_disk(&resolved))?
                .filter_map(|e| e.ok()?.file_name().into_string().ok())
                .collect::<Vec<_>>();
            Ok((resolved, names))
        });
        match listing {
            Ok((resolved, mut names)) => {
                names.sort();
                Some((resolved, names))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(e) => {
                self.warn(dir, &e.to_string());
                None
            }
        }
    }

    /// A regular file at `container_path` below the root (through symlinks), as a driver file.
    fn file(
        &mut self,
        container_path: PathBuf,
        kind: FileKind,
        executable: bool,
    ) -> Option<DriverFile> {
        let resolved = match self.resolve(&container_path) {
            Ok(r) => r,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return None,
            Err(e) => {
                self.warn(&container_path, &e.to_string());
                return None;
            }
        };
        let found_at = self.on_disk(&resolved);
        let meta = fs::metadata(&found_at).ok()?;
        if !meta.is_file() {
            return None;
        }
        if executable && meta.permissions().mode() & 0o111 == 0 {
            self.warn(&container_path, "not executable, skipped");
            return None;
        }
        let host_path = self
            .host_root
            .join(resolved.strip_prefix("/").unwrap_or(&resolved));
        if host_path.to_str().is_none() {
            self.warn(
                &container_path,
                "resolves to a path that is not UTF-8, skipped",
            );
            return None;
        }
        Some(DriverFile {
            kind,
            container_path,
            host_path,
            found_at,
            soname: None,
            dev_link: false,
        })
    }

    fn executable(&mut self, name: &str, kind: FileKind) -> Option<DriverFile> {
        BINARY_DIRS
            .iter()
            .find_map(|dir| self.file(Path::new(dir).join(name), kind, true))
    }

    /// The driver's libraries of `version`, first file of each name in `dirs` order, and the names of
    /// required libraries present in other versions (for the error when this version is missing).
    fn libraries(&mut self, dirs: &[String], version: &str) -> (Vec<DriverFile>, BTreeSet<String>) {
        let mut found: Vec<(usize, DriverFile)> = Vec::new();
        let mut names_found = HashSet::new();
        let mut other_versions = BTreeSet::new();
        let mut scanned = HashSet::new();
        for dir in dirs {
            let Some((resolved_dir, names)) = self.list(Path::new(dir)) else {
                continue;
            };
            // /lib64 is often a link to /usr/lib64: one directory, searched once, under its first name.
            if !scanned.insert(resolved_dir) {
                continue;
            }
            for name in names {
                let Some((index, file_version)) = match_library(&name) else {
                    continue;
                };
                let (stem, class, soname) = LIBRARIES[index];
                if file_version != version {
                    if REQUIRED.contains(&stem) && file_version.contains('.') {
                        other_versions.insert(name);
                    }
                    continue;
                }
                if names_found.contains(&name) {
                    continue;
                }
                let kind = FileKind::Library(class);
                if let Some(mut file) = self.file(Path::new(dir).join(&name), kind, false) {
                    file.soname = soname;
                    file.dev_link = DEV_LINKS.contains(&stem);
                    names_found.insert(name);
                    found.push((index, file));
                }
            }
        }
        found.sort_by(|(a, fa), (b, fb)| a.cmp(b).then(fa.container_path.cmp(&fb.container_path)));
        (found.into_iter().map(|(_, f)| f).collect(), other_versions)
    }

    /// Directories that the root's ld.so.cache gives for the driver's libraries, for this architecture.
    fn ld_cache_dirs(&mut self) -> Vec<String> {
        let Some(native) = ldcache::NATIVE_FLAGS else {
            return Vec::new();
        };
        let cache = Path::new("/etc/ld.so.cache");
        let read = |r: PathBuf| {
            let path = self.on_disk(&r);
            if fs::metadata(&path)?.len() > MAX_LD_CACHE_BYTES {
                return Err(io::Error::other("too large for an ld.so.cache, not used"));
            }
            fs::read(path)
        };
        let data = match self.resolve(cache).and_then(read) {
            Ok(data) => data,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Vec::new(),
            Err(e) => {
                self.warn(cache, &e.to_string());
                return Vec::new();
            }
        };
        let entries = match ldcache::parse(&data) {
            Ok(entries) => entries,
            Err(e) => {
                self.warn(cache, &format!("{e}, not used"));
                return Vec::new();
            }
        };
        let mut dirs = Vec::new();
        for entry in entries.iter().filter(|e| e.flags == native) {
            if match_library(&entry.soname).is_none() {
                continue;
            }
            let dir = Path::new(&entry.path).parent().and_then(Path::to_str);
            if let Some(dir) = dir.filter(|d| d.starts_with('/') && !dirs.iter().any(|x| x == d)) {
                dirs.push(dir.to_string());
            }
        }
        dirs
    }

    fn warn(&mut self, path: &Path, what: &str) {
        self.warnings.push(format!(
            "{} (under driver root {}): {what}",
            path.display(),
            self.root.display()
        ));
    }

    /// GSP firmware of this driver version, which nvidia-smi reads on some drivers.
    fn firmware(&mut self, version: &str) -> Vec<DriverFile> {
        let dir = PathBuf::from(format!("/lib/firmware/nvidia/{version}"));
        let Some((_, names)) = self.list(&dir) else {
            return Vec::new();
        };
        names
            .into_iter()
            .filter(|n| n.starts_with("gsp") && n.ends_with(".bin"))
            .filter_map(|n| self.file(dir.join(n), FileKind::Firmware, false))
            .collect()
    }
}

/// The path's parts after the root, as they come (`..` included), to resolve one by one.
fn parts(path: &Path) -> VecDeque<OsString> {
    path.components()
        .filter_map(|c| match c {
            Component::Normal(p) => Some(p.to_os_string()),
            Component::ParentDir => Some("..".into()),
            _ => None,
        })
        .collect()
}

/// The index in `LIBRARIES` and the version suffix of a file named `<stem>.so.<suffix>`.
fn match_library(name: &str) -> Option<(usize, &str)> {
    let (stem, suffix) = name.split_once(".so.")?;
    let index = LIBRARIES
        .iter()
        .position(|(known, _, _)| match known.strip_suffix('*') {
            Some(prefix) => stem.starts_with(prefix),
            None => stem == *known,
        })?;
    Some((index, suffix))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cdi::spec::{minimum_version, validate, Device, DeviceNode, Spec};

    const VERSION: &str = "550.90.07";

    /// A temporary directory laid out like a node's driver root.
    struct FakeRoot(tempfile::TempDir);

    impl FakeRoot {
        fn new() -> Self {
            Self(tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}")))
        }

        fn path(&self) -> &Path {
            self.0.path()
        }

        fn write(&self, path: &str, content: &[u8], mode: u32) -> &Self {
            let full = self.path().join(path.trim_start_matches('/'));
            if let Some(parent) = full.parent() {
                fs::create_dir_all(parent).unwrap_or_else(|e| panic!("{}: {e}", parent.display()));
            }
            fs::write(&full, content).unwrap_or_else(|e| panic!("{}: {e}", full.display()));
            fs::set_permissions(&full, fs::Permissions::from_mode(mode))
                .unwrap_or_else(|e| panic!("{}: {e}", full.display()));
            self
        }

        fn lib(&self, path: &str) -> &Self {
            self.write(path, b"\x7fELF", 0o644)
        }

        fn bin(&self, path: &str) -> &Self {
            self.write(path, b"\x7fELF", 0o755)
        }

        fn symlink(&self, link: &str, target: &str) -> &Self {
            let full = self.path().join(link.trim_start_matches('/'));
            if let Some(parent) = full.parent() {
                fs::create_dir_all(parent).unwrap_or_else(|e| panic!("{}: {e}", parent.display()));
            }
            std::os::unix::fs::symlink(target, &full)
                .unwrap_or_else(|e| panic!("{}: {e}", full.display()));
            self
        }

        /// A Debian-style driver install of `VERSION` with the usual soname links.
        fn debian_driver() -> Self {
            let root = Self::new();
            let dir = native_dir();
            for stem in [
                "libcuda",
                "libnvidia-ml",
                "libnvidia-ptxjitcompiler",
                "libnvidia-nvvm",
            ] {
                root.lib(&format!("{dir}/{stem}.so.{VERSION}"));
            }
            root.lib(&format!("{dir}/libnvidia-pkcs11-openssl3.so.{VERSION}"))
                .lib(&format!("{dir}/libnvcuvid.so.{VERSION}"))
                .symlink(
                    &format!("{dir}/libcuda.so.1"),
                    &format!("libcuda.so.{VERSION}"),
                )
                .bin("/usr/bin/nvidia-smi")
                .bin("/usr/bin/nvidia-cuda-mps-control")
                .lib(&format!("/lib/firmware/nvidia/{VERSION}/gsp_ga10x.bin"))
                .lib(&format!("/lib/firmware/nvidia/{VERSION}/gsp_tu10x.bin"))
                .lib(&format!("/lib/firmware/nvidia/{VERSION}/README"));
            root
        }
    }

    fn native_dir() -> String {
        library_dirs().swap_remove(0)
    }

    fn discover(root: &FakeRoot) -> HostDriver {
        HostDriver::discover(root.path(), VERSION).unwrap_or_else(|e| panic!("discover: {e}"))
    }

    fn container_paths(driver: &HostDriver) -> Vec<String> {
        driver
            .files()
            .iter()
            .map(|f| f.container_path.to_string_lossy().into_owned())
            .collect()
    }

    fn error_text(root: &Path, version: &str) -> String {
        match HostDriver::discover(root, version) {
            Err(e) => e.to_string(),
            Ok(d) => panic!("discovery should fail, found {:?}", d.files()),
        }
    }

    #[test]
    fn finds_libraries_binaries_and_firmware_of_the_version() {
        let root = FakeRoot::debian_driver();
        let dir = native_dir();
        // Another driver's leftovers are not this driver's files.
        root.lib(&format!("{dir}/libnvidia-ml.so.535.104.05"))
            .lib(&format!("{dir}/libnvidia-cfg.so.535.104.05"))
            .lib("/lib/firmware/nvidia/535.104.05/gsp_ga10x.bin");
        let driver = discover(&root);
        let expected = [
            format!("{dir}/libcuda.so.{VERSION}"),
            format!("{dir}/libnvidia-ml.so.{VERSION}"),
            format!("{dir}/libnvidia-ptxjitcompiler.so.{VERSION}"),
            format!("{dir}/libnvidia-nvvm.so.{VERSION}"),
            format!("{dir}/libnvidia-pkcs11-openssl3.so.{VERSION}"),
            format!("{dir}/libnvcuvid.so.{VERSION}"),
            "/usr/bin/nvidia-smi".into(),
            "/usr/bin/nvidia-cuda-mps-control".into(),
            format!("/lib/firmware/nvidia/{VERSION}/gsp_ga10x.bin"),
            format!("/lib/firmware/nvidia/{VERSION}/gsp_tu10x.bin"),
        ];
        assert_eq!(container_paths(&driver), expected);
        let kinds: Vec<_> = driver.files().iter().map(|f| f.kind).collect();
        assert_eq!(kinds[0], FileKind::Library(LibraryClass::Compute));
        assert_eq!(kinds[5], FileKind::Library(LibraryClass::Video));
        assert_eq!(kinds[6], FileKind::Binary);
        assert_eq!(kinds[9], FileKind::Firmware);
        assert!(driver.cdi_hook().is_none());
        assert!(driver.warnings().is_empty(), "{:?}", driver.warnings());
    }

    #[test]
    fn another_version_is_an_error_naming_version_root_and_what_is_there() {
        let root = FakeRoot::debian_driver();
        let err = error_text(root.path(), "560.35.03");
        let root_text = root.path().display().to_string();
        for part in [
            "libcuda.so.560.35.03 and libnvidia-ml.so.560.35.03 not found",
            root_text.as_str(),
            &native_dir(),
            "/usr/lib64",
            &format!("libcuda.so.{VERSION}"),
            "not version 560.35.03",
        ] {
            assert!(err.contains(part), "{err:?} lacks {part:?}");
        }
    }

    #[test]
    fn missing_libcuda_or_an_empty_root_is_an_error() {
        let root = FakeRoot::new();
        root.lib(&format!("/usr/lib64/libnvidia-ml.so.{VERSION}"));
        let err = error_text(root.path(), VERSION);
        assert!(
            err.starts_with(&format!(
                "libcuda.so.{VERSION} not found under driver root {}",
                root.path().display()
            )),
            "{err}"
        );

        let empty = FakeRoot::new();
        let err = error_text(empty.path(), VERSION);
        assert!(
            err.contains("is the driver installed at this root?"),
            "{err}"
        );

        let missing = empty.path().join("nope");
        assert!(error_text(&missing, VERSION).contains("nope"));
        assert!(error_text(empty.path(), "../550").contains("not a version"));
        assert!(error_text(Path::new("driver-root"), VERSION).contains("not an absolute path"));
    }

    #[test]
    fn container_paths_strip_the_root_and_host_paths_use_the_host_root() {
        let root = FakeRoot::debian_driver();
        let lib = format!("{}/libcuda.so.{VERSION}", native_dir());
        let driver = discover(&root);
        let cuda = &driver.files()[0];
        assert_eq!(cuda.container_path, Path::new(&lib));
        assert_eq!(cuda.host_path, Path::new(&lib));
        assert_eq!(cuda.found_at, root.path().join(lib.trim_start_matches('/')));

        let options = DiscoveryOptions {
            host_driver_root: Some("/run/nvidia/driver".into()),
            ..Default::default()
        };
        let driver = HostDriver::discover_with(root.path(), VERSION, &options)
            .unwrap_or_else(|e| panic!("{e}"));
        let mount = &driver.container_edits().mounts[0];
        assert_eq!(mount.container_path, lib);
        assert_eq!(mount.host_path, format!("/run/nvidia/driver{lib}"));
        assert_eq!(mount.options, ["ro", "nosuid", "nodev", "bind"]);
    }

    #[test]
    fn symlinks_resolve_inside_the_root_without_duplicate_mounts() {
        // Red Hat layout with /lib64 an absolute link, which must not escape to the plugin's own /usr/lib64.
        let root = FakeRoot::new();
        root.lib(&format!("/usr/lib64/libcuda.so.{VERSION}"))
            .lib(&format!("/usr/lib64/nvidia/libnvidia-ml.so.{VERSION}.real"))
            .symlink(
                &format!("/usr/lib64/libnvidia-ml.so.{VERSION}"),
                &format!("/usr/lib64/nvidia/libnvidia-ml.so.{VERSION}.real"),
            )
            .symlink("/lib64", "/usr/lib64")
            // 32-bit copies in /usr/lib lose to the 64-bit ones.
            .lib(&format!("/usr/lib/libcuda.so.{VERSION}"))
            .symlink("/usr/bin/nvidia-smi", "../../opt/bin/nvidia-smi")
            .bin("/opt/bin/nvidia-smi");
        let driver = discover(&root);
        assert_eq!(
            container_paths(&driver),
            [
                format!("/usr/lib64/libcuda.so.{VERSION}"),
                format!("/usr/lib64/libnvidia-ml.so.{VERSION}"),
                "/usr/bin/nvidia-smi".to_string(),
            ]
        );
        let nvml = &driver.files()[1];
        assert_eq!(
            nvml.host_path,
            Path::new(&format!("/usr/lib64/nvidia/libnvidia-ml.so.{VERSION}.real"))
        );
        assert_eq!(
            driver.files()[2].host_path,
            Path::new("/opt/bin/nvidia-smi")
        );
    }

    #[test]
    fn symlink_loops_are_skipped_with_a_warning() {
        let root = FakeRoot::debian_driver();
        root.symlink("/usr/local/nvidia/bin", "/usr/local/nvidia/bin2")
            .symlink("/usr/local/nvidia/bin2", "/usr/local/nvidia/bin")
            .symlink(
                "/usr/bin/nvidia-debugdump",
                "/usr/local/nvidia/bin/nvidia-debugdump",
            );
        let driver = discover(&root);
        assert!(!container_paths(&driver)
            .iter()
            .any(|p| p.contains("debugdump")));
        assert!(
            driver
                .warnings()
                .iter()
                .any(|w| w.contains("nvidia-debugdump") && w.contains("symbolic links")),
            "{:?}",
            driver.warnings()
        );
    }

    #[test]
    fn ld_so_cache_adds_directories_in_both_formats() {
        let Some(native) = ldcache::NATIVE_FLAGS else {
            return;
        };
        for with_old_table in [false, true] {
            let root = FakeRoot::debian_driver();
            root.lib(&format!("/opt/nvidia/lib/libnvidia-opencl.so.{VERSION}"))
                .lib(&format!("/opt/other/lib/libnvidia-cfg.so.{VERSION}"))
                .lib(&format!("/opt/i386/libnvidia-encode.so.{VERSION}"))
                // A 32-bit copy in the generic /usr/lib loses to the cache's 64-bit directory.
                .lib(&format!("/usr/lib/libnvidia-opencl.so.{VERSION}"));
            let cache = ldcache::build::cache(
                &[
                    (
                        native,
                        "libnvidia-opencl.so.1",
                        "/opt/nvidia/lib/libnvidia-opencl.so.1",
                    ),
                    // Not a driver library: its directory is not searched.
                    (native, "libfoo.so.1", "/opt/other/lib/libfoo.so.1"),
                    // Another ABI: not searched either.
                    (
                        0x0003,
                        "libnvidia-encode.so.1",
                        "/opt/i386/libnvidia-encode.so.1",
                    ),
                ],
                with_old_table,
            );
            root.write("/etc/ld.so.cache", &cache, 0o644);
            let paths = container_paths(&discover(&root));
            let opencl = format!("/opt/nvidia/lib/libnvidia-opencl.so.{VERSION}");
            assert!(paths.contains(&opencl), "{paths:?}");
            assert!(
                !paths
                    .iter()
                    .any(|p| p.starts_with("/usr/lib/libnvidia-opencl")),
                "{paths:?}"
            );
            assert!(
                !paths
                    .iter()
                    .any(|p| p.contains("libnvidia-cfg") || p.contains("encode")),
                "{paths:?}"
            );
        }
    }

    #[test]
    fn a_corrupt_ld_so_cache_is_a_warning() {
        let root = FakeRoot::debian_driver();
        root.lib("/etc/ld.so.cache");
        let driver = discover(&root);
        assert_eq!(
            driver.files()[0].kind,
            FileKind::Library(LibraryClass::Compute)
        );
        if ldcache::NATIVE_FLAGS.is_some() {
            assert!(
                driver.warnings().iter().any(|w| w.contains("ld.so.cache")),
                "{:?}",
                driver.warnings()
            );
        }
    }

    #[test]
    fn no_hooks_without_a_hook_binary() {
        let root = FakeRoot::debian_driver();
        let edits = discover(&root).container_edits();
        assert!(edits.hooks.is_empty());
        assert_eq!(edits.mounts.len(), 10);
        // A hook binary that is not executable is no hook binary.
        root.lib("/usr/bin/nvidia-cdi-hook");
        let driver = discover(&root);
        assert!(driver.container_edits().hooks.is_empty());
        assert!(driver
            .warnings()
            .iter()
            .any(|w| w.contains("nvidia-cdi-hook")));
    }

    #[test]
    fn hooks_create_soname_links_and_update_the_ldcache() {
        let root = FakeRoot::debian_driver();
        root.lib(&format!("/usr/lib64/libnvidia-opticalflow.so.{VERSION}"))
            .bin("/usr/bin/nvidia-cdi-hook")
            .bin("/usr/bin/nvidia-ctk");
        let driver = discover(&root);
        assert_eq!(
            driver.cdi_hook(),
            Some(&CdiHook {
                host_path: "/usr/bin/nvidia-cdi-hook".into(),
                cli: HookCli::CdiHook
            })
        );
        let edits = driver.container_edits();
        // The hook binaries themselves are not mounted.
        assert!(edits
            .mounts
            .iter()
            .all(|m| !m.container_path.ends_with("/nvidia-cdi-hook")
                && !m.container_path.ends_with("/nvidia-ctk")));
        let dir = native_dir();
        let [symlinks, ldcache] = edits.hooks.as_slice() else {
            panic!("two hooks expected: {:?}", edits.hooks);
        };
        let link = |target: &str, link: &str| ["--link".to_string(), format!("{target}::{link}")];
        let mut expected = vec!["nvidia-cdi-hook".to_string(), "create-symlinks".into()];
        expected.extend(link(
            &format!("libcuda.so.{VERSION}"),
            &format!("{dir}/libcuda.so.1"),
        ));
        expected.extend(link("libcuda.so.1", &format!("{dir}/libcuda.so")));
        expected.extend(link(
            &format!("libnvidia-ml.so.{VERSION}"),
            &format!("{dir}/libnvidia-ml.so.1"),
        ));
        expected.extend(link(
            &format!("libnvidia-ptxjitcompiler.so.{VERSION}"),
            &format!("{dir}/libnvidia-ptxjitcompiler.so.1"),
        ));
        expected.extend(link(
            &format!("libnvidia-nvvm.so.{VERSION}"),
            &format!("{dir}/libnvidia-nvvm.so.4"),
        ));
        // libnvidia-pkcs11-openssl3 has no other soname: no link.
        expected.extend(link(
            &format!("libnvcuvid.so.{VERSION}"),
            &format!("{dir}/libnvcuvid.so.1"),
        ));
        expected.extend(link(
            &format!("libnvidia-opticalflow.so.{VERSION}"),
            "/usr/lib64/libnvidia-opticalflow.so.1",
        ));
        expected.extend(link(
            "libnvidia-opticalflow.so.1",
            "/usr/lib64/libnvidia-opticalflow.so",
        ));
        assert_eq!(symlinks.args, expected);
        assert_eq!(
            ldcache.args,
            [
                "nvidia-cdi-hook",
                "update-ldcache",
                "--folder",
                &dir,
                "--folder",
                "/usr/lib64"
            ]
        );
        for hook in [symlinks, ldcache] {
            assert_eq!(hook.hook_name, "createContainer");
            assert_eq!(hook.path, "/usr/bin/nvidia-cdi-hook");
        }
    }

    #[test]
    fn hook_paths_are_host_paths_and_an_override_is_used_verbatim() {
        let root = FakeRoot::debian_driver();
        root.bin("/usr/local/nvidia/bin/nvidia-ctk");
        let options = DiscoveryOptions {
            host_driver_root: Some("/run/nvidia/driver".into()),
            ..Default::default()
        };
        let driver = HostDriver::discover_with(root.path(), VERSION, &options)
            .unwrap_or_else(|e| panic!("{e}"));
        let hooks = driver.container_edits().hooks;
        assert_eq!(
            hooks[0].path,
            "/run/nvidia/driver/usr/local/nvidia/bin/nvidia-ctk"
        );
        assert_eq!(
            hooks[0].args[..3],
            ["nvidia-ctk", "hook", "create-symlinks"]
        );
        assert_eq!(hooks[1].args[..3], ["nvidia-ctk", "hook", "update-ldcache"]);

        let plugin_dir = FakeRoot::new();
        plugin_dir.bin("/nvidia-cdi-hook");
        let hook = plugin_dir.path().join("nvidia-cdi-hook");
        let options = DiscoveryOptions {
            cdi_hook: Some(hook.clone()),
            ..Default::default()
        };
        let driver = HostDriver::discover_with(root.path(), VERSION, &options)
            .unwrap_or_else(|e| panic!("{e}"));
        let hooks = driver.container_edits().hooks;
        assert_eq!(hooks[0].path, hook.to_string_lossy());
        assert_eq!(hooks[0].args[..2], ["nvidia-cdi-hook", "create-symlinks"]);

        let options = DiscoveryOptions {
            cdi_hook: Some(plugin_dir.path().join("missing-hook")),
            ..Default::default()
        };
        match HostDriver::discover_with(root.path(), VERSION, &options) {
            Err(e) => assert!(e.to_string().contains("missing-hook"), "{e}"),
            Ok(_) => panic!("a missing hook override must be an error"),
        }
    }

    #[test]
    fn edits_validate_as_a_cdi_spec_at_the_minimum_version_with_unique_absolute_paths() {
        let with_hook = FakeRoot::debian_driver();
        with_hook.bin("/usr/bin/nvidia-cdi-hook");
        let without_hook = FakeRoot::debian_driver();
        for (root, hooks) in [(&with_hook, 2), (&without_hook, 0)] {
            let edits = discover(root).container_edits();
            assert_eq!(edits.hooks.len(), hooks);
            let mut spec = Spec {
                kind: "k8s.gpu.dra.dev/gpu".into(),
                devices: vec![Device {
                    name: "gpu-0".into(),
                    container_edits: ContainerEdits {
                        device_nodes: vec![DeviceNode {
                            path: "/dev/nvidia0".into(),
                            ..Default::default()
                        }],
                        ..Default::default()
                    },
                    ..Default::default()
                }],
                container_edits: edits.clone(),
                ..Default::default()
            };
            spec.cdi_version = minimum_version(&spec).into();
            assert_eq!(spec.cdi_version, "0.3.0");
            validate(&spec).unwrap_or_else(|e| panic!("{e}"));

            let mut seen = HashSet::new();
            for mount in &edits.mounts {
                assert!(mount.container_path.starts_with('/') && mount.host_path.starts_with('/'));
                assert!(
                    seen.insert(mount.container_path.clone()),
                    "{} twice",
                    mount.container_path
                );
            }
            for hook in &edits.hooks {
                assert!(hook.path.starts_with('/'));
            }
        }
    }
}
