//! The NVIDIA driver's user-space files (CUDA / NVML libraries, tools, GSP firmware) under a driver root, and
//! the CDI container edits that give a container what CUDA needs: read-only bind mounts from the host's
//! driver root, plus the Container Toolkit's symlink and ldcache hooks when its hook binary is there.

#[cfg(test)]
pub(crate) mod fake_root;
mod hooks;
mod search;

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use super::spec::{ContainerEdits, Mount};
use crate::gpu::HostArch;
use hooks::{hook_cli, hook_override, toolkit_hooks, HOOK_BINARIES};
pub use hooks::{CdiHook, HookCli, KnownHooks};
pub use search::LibraryClass;
use search::{Finder, BINARIES, CUDA_LIBRARY, NVML_LIBRARY};

const MOUNT_OPTIONS: [&str; 4] = ["ro", "nosuid", "nodev", "bind"];

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
        /// The missing file name, e.g. `libnvidia-ml.so.550.90.07`.
        missing: String,
        searched: String,
        hint: String,
    },
    #[error("CDI hook {}: {reason}", path.display())]
    HookOverride { path: PathBuf, reason: String },
}

/// The library directories below a driver root, with those its ld.so.cache names for the driver's
/// libraries: the cache's directories are for this ABI, so they go before the generic /usr/lib and /lib.
fn search_dirs(finder: &mut Finder) -> Vec<String> {
    let mut dirs = finder.library_dirs();
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
    dirs
}

/// Where some version of libnvidia-ml is under `driver_root` (the path this process sees the root
/// at), looking where [`HostDriver::discover`] looks: the library directories and those of the root's
/// ld.so.cache, with the root's symlinks followed inside it. Without it a directory is no driver root.
/// `Err` lists the directories searched.
pub fn find_nvml_library(driver_root: &Path) -> Result<PathBuf, String> {
    find_nvml_library_of(driver_root, HostArch::NATIVE)
}

/// [`find_nvml_library`] for a driver root of the host `arch`.
fn find_nvml_library_of(driver_root: &Path, arch: Option<HostArch>) -> Result<PathBuf, String> {
    let host_root = PathBuf::from("/");
    let mut finder = Finder::new(driver_root, &host_root, arch);
    let dirs = search_dirs(&mut finder);
    finder
        .any_version_of(&dirs, NVML_LIBRARY)
        .map(|file| file.found_at)
        .ok_or_else(|| dirs.join(", "))
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
        Self::discover_of(driver_root, driver_version, options, HostArch::NATIVE)
    }

    /// [`HostDriver::discover_with`] for a driver root of the host `arch`.
    fn discover_of(
        driver_root: &Path,
        driver_version: &str,
        options: &DiscoveryOptions,
        arch: Option<HostArch>,
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

        let mut finder = Finder::new(driver_root, &host_root, arch);
        let dirs = search_dirs(&mut finder);
        let (mut files, other_versions) = finder.libraries(&dirs, driver_version);

        let has = |stem: &str| {
            let name = format!("{stem}.so.{driver_version}");
            files.iter().any(|f| f.container_path.ends_with(&name))
        };
        let searched = dirs.join(", ");
        let found_instead = |stem: &str| -> Vec<String> {
            let prefix = format!("{stem}.so.");
            other_versions
                .iter()
                .filter(|name| name.starts_with(&prefix))
                .cloned()
                .collect()
        };
        if !has(NVML_LIBRARY) {
            let others: Vec<String> = other_versions.iter().cloned().collect();
            let hint = if others.is_empty() {
                "no version of it is there either: is the driver installed at this root?"
                    .to_string()
            } else {
                format!(
                    "found {} instead: the driver at this root is not version {driver_version}",
                    others.join(", ")
                )
            };
            return Err(HostDriverError::MissingLibraries {
                root: driver_root.into(),
                version: driver_version.into(),
                missing: format!("{NVML_LIBRARY}.so.{driver_version}"),
                searched,
                hint,
            });
        }
        let mut warnings = Vec::new();
        if !has(CUDA_LIBRARY) {
            let others = found_instead(CUDA_LIBRARY);
            let instead = if others.is_empty() {
                String::new()
            } else {
                format!(", only {}", others.join(", "))
            };
            warnings.push(format!(
                "{CUDA_LIBRARY}.so.{driver_version} not found under driver root {} (searched \
                 {searched}){instead}, although {NVML_LIBRARY}.so.{driver_version} is there: \
                 containers get the driver's other files but no libcuda, so CUDA cannot start in \
                 them unless their image brings a CUDA forward-compatibility libcuda; install the \
                 driver's CUDA library at this root (libcuda1 or libnvidia-compute-<branch> on \
                 Debian and Ubuntu) to run CUDA workloads",
                driver_root.display()
            ));
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
                let file = finder.hook_binary(name)?;
                // Unreadable, it gets the hooks every release has; the warning says why no more.
                let known = KnownHooks::of_binary(&file.found_at).unwrap_or_else(|e| {
                    warnings.push(format!(
                        "{}: {e}: containers get only the create-symlinks and update-ldcache hooks",
                        file.found_at.display()
                    ));
                    KnownHooks::default()
                });
                Some(CdiHook {
                    host_path: file.host_path,
                    cli: hook_cli(name),
                    known,
                })
            }),
        };
        warnings.extend(finder.into_warnings());
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

    /// Read-only bind mounts of every file at its container path, `NVIDIA_CTK_LIBCUDA_DIR`, plus, with a
    /// hook binary, the `createContainer` hooks the Container Toolkit writes for the driver's files (see
    /// `hooks::toolkit_hooks`).
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
        let hooks = match &self.hook {
            Some(hook) => toolkit_hooks(hook, &self.files, &self.version),
            None => Vec::new(),
        };
        // As the toolkit's specs since v1.19: where libcuda is, for tools in the container that look
        // for the host's driver beside the image's CUDA.
        let libcuda = format!("{CUDA_LIBRARY}.so.{}", self.version);
        let env = self
            .files
            .iter()
            .find(|f| f.container_path.ends_with(&libcuda))
            .and_then(|f| f.container_path.parent())
            .map(|dir| vec![format!("NVIDIA_CTK_LIBCUDA_DIR={}", dir.display())])
            .unwrap_or_default();
        ContainerEdits {
            env,
            mounts,
            hooks,
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::fake_root::*;
    use super::*;
    use crate::cdi::spec::{minimum_version, validate, Device, DeviceNode, Spec};
    use std::collections::HashSet;

    /// A driver root holding both architectures' files, as a multi-arch image or a careless copy can:
    /// `/usr/lib/<triple>` for each, and an ld.so.cache naming a directory for each ABI.
    fn two_architectures_root() -> FakeRoot {
        let root = FakeRoot::new();
        for triple in ["aarch64-linux-gnu", "x86_64-linux-gnu"] {
            for stem in ["libnvidia-ml", "libcuda"] {
                root.lib(&format!("/usr/lib/{triple}/{stem}.so.{VERSION}"));
            }
        }
        root.lib(&format!("/opt/arm/libnvidia-opencl.so.{VERSION}"))
            .lib(&format!("/opt/x86/libnvidia-encode.so.{VERSION}"));
        let cache = crate::cdi::ldcache::build::cache(
            &[
                (
                    HostArch::AARCH64.ld_cache_flags,
                    "libnvidia-opencl.so.1",
                    "/opt/arm/libnvidia-opencl.so.1",
                ),
                (
                    HostArch::X86_64.ld_cache_flags,
                    "libnvidia-encode.so.1",
                    "/opt/x86/libnvidia-encode.so.1",
                ),
            ],
            false,
        );
        root.write("/etc/ld.so.cache", &cache, 0o644);
        root
    }

    /// Grace hosts (GH200, GB200) keep the driver in `/usr/lib/aarch64-linux-gnu`: discovery on such a
    /// host takes those files and its ld.so.cache's AArch64 entries, never the other architecture's,
    /// whatever machine runs this test.
    #[test]
    fn an_aarch64_host_gets_its_own_libraries_and_ld_cache_directories() {
        let root = two_architectures_root();
        for (arch, own, other) in [
            (HostArch::AARCH64, "aarch64-linux-gnu", "x86_64-linux-gnu"),
            (HostArch::X86_64, "x86_64-linux-gnu", "aarch64-linux-gnu"),
        ] {
            let driver = HostDriver::discover_of(
                root.path(),
                VERSION,
                &DiscoveryOptions::default(),
                Some(arch),
            )
            .unwrap_or_else(|e| panic!("{own}: {e}"));
            let paths = container_paths(&driver);
            for stem in ["libnvidia-ml", "libcuda"] {
                let path = format!("/usr/lib/{own}/{stem}.so.{VERSION}");
                assert!(paths.contains(&path), "{own}: {path} not in {paths:?}");
            }
            assert!(
                !paths.iter().any(|p| p.contains(other)),
                "{own}: the other architecture's files must not be mounted: {paths:?}"
            );
            let (cached, not_cached) = if arch == HostArch::AARCH64 {
                ("/opt/arm/libnvidia-opencl", "/opt/x86/")
            } else {
                ("/opt/x86/libnvidia-encode", "/opt/arm/")
            };
            assert!(
                paths.iter().any(|p| p.starts_with(cached)),
                "{own}: {cached} from the ld.so.cache not in {paths:?}"
            );
            assert!(
                !paths.iter().any(|p| p.starts_with(not_cached)),
                "{own}: {not_cached} is another ABI's: {paths:?}"
            );
            assert!(driver.warnings().is_empty(), "{:?}", driver.warnings());

            let nvml = find_nvml_library_of(root.path(), Some(arch)).unwrap();
            assert!(
                nvml.to_string_lossy().contains(own),
                "{own}: {}",
                nvml.display()
            );
        }
    }

    /// An AArch64 root without its own libnvidia-ml is no driver root for that host, even with an
    /// x86-64 copy beside it; the error names the AArch64 directories it searched.
    #[test]
    fn an_aarch64_host_with_only_x86_64_libraries_has_no_driver() {
        let root = FakeRoot::new();
        root.lib(&format!(
            "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.{VERSION}"
        ));
        let searched = find_nvml_library_of(root.path(), Some(HostArch::AARCH64)).unwrap_err();
        assert!(
            searched.starts_with("/usr/lib/aarch64-linux-gnu, ")
                && searched.contains("/lib/aarch64-linux-gnu")
                && !searched.contains("x86_64"),
            "{searched}"
        );
        let err = HostDriver::discover_of(
            root.path(),
            VERSION,
            &DiscoveryOptions::default(),
            Some(HostArch::AARCH64),
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains(&format!("libnvidia-ml.so.{VERSION} not found"))
                && err.contains("aarch64"),
            "{err}"
        );
    }

    #[test]
    fn another_version_is_an_error_naming_version_root_and_what_is_there() {
        let root = FakeRoot::debian_driver();
        let err = error_text(root.path(), "560.35.03");
        let root_text = root.path().display().to_string();
        for part in [
            "libnvidia-ml.so.560.35.03 not found",
            root_text.as_str(),
            &native_dir(),
            "/usr/lib64",
            &format!("libcuda.so.{VERSION}"),
            &format!("libnvidia-ml.so.{VERSION}"),
            "not version 560.35.03",
        ] {
            assert!(err.contains(part), "{err:?} lacks {part:?}");
        }
    }

    #[test]
    fn a_root_without_libnvidia_ml_is_an_error() {
        let root = FakeRoot::new();
        root.lib(&format!("/usr/lib64/libcuda.so.{VERSION}"));
        let err = error_text(root.path(), VERSION);
        assert!(
            err.starts_with(&format!(
                "libnvidia-ml.so.{VERSION} not found under driver root {}",
                root.path().display()
            )),
            "{err}"
        );

        let empty = FakeRoot::new();
        let err = error_text(empty.path(), VERSION);
        assert!(
            err.contains("no version of it is there either: is the driver installed at this root?"),
            "{err}"
        );

        let missing = empty.path().join("nope");
        assert!(error_text(&missing, VERSION).contains("nope"));
        assert!(error_text(empty.path(), "../550").contains("not a version"));
        assert!(error_text(Path::new("driver-root"), VERSION).contains("not an absolute path"));
    }

    /// NVIDIA's mock NVML lays out a driver root with libnvidia-ml only, as does a node with the
    /// distribution's NVML package but not its CUDA one: the GPUs still work for NVML, so discovery
    /// goes on and says what is missing, where it looked and what that costs.
    #[test]
    fn a_root_without_libcuda_is_discovered_with_a_warning_naming_the_file_and_the_dirs() {
        let root = FakeRoot::new();
        root.lib(&format!("/usr/lib64/libnvidia-ml.so.{VERSION}"))
            .lib("/usr/lib64/libcuda.so.535.183.01");
        let driver = HostDriver::discover(root.path(), VERSION)
            .unwrap_or_else(|e| panic!("a root without libcuda is refused: {e}"));
        assert_eq!(
            container_paths(&driver),
            [format!("/usr/lib64/libnvidia-ml.so.{VERSION}")]
        );
        let warning = driver
            .warnings()
            .iter()
            .find(|w| w.contains("libcuda"))
            .unwrap_or_else(|| panic!("no warning about libcuda: {:?}", driver.warnings()));
        for part in [
            format!(
                "libcuda.so.{VERSION} not found under driver root {}",
                root.path().display()
            ),
            "/usr/lib64".to_string(),
            "only libcuda.so.535.183.01".to_string(),
            format!("libnvidia-ml.so.{VERSION} is there"),
            "CUDA cannot start".to_string(),
        ] {
            assert!(warning.contains(&part), "{warning:?} lacks {part:?}");
        }
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
