//! The NVIDIA Container Toolkit's CDI hooks in the claim specs: which hook binary (found under the driver
//! root, or given by the admin) and which hooks it knows, and the hooks its own CDI library writes for the
//! driver's files (`pkg/nvcdi`, `NewDriverLibraryDiscoverer`), in its order and with its arguments:
//! `create-symlinks`, `enable-cuda-compat`, `update-ldcache`, `disable-device-node-modification`.

use std::collections::HashSet;
use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use super::{DriverFile, FileKind, HostDriverError};
use crate::cdi::spec::Hook;

/// Hook binaries in order of preference; `nvidia-ctk` carries the same hooks under its `hook` command.
pub(super) const HOOK_BINARIES: [&str; 2] = ["nvidia-cdi-hook", "nvidia-ctk"];
/// How a hook binary takes the hook name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HookCli {
    /// `nvidia-cdi-hook <hook> ...`
    CdiHook,
    /// `nvidia-ctk hook <hook> ...`
    Ctk,
}

/// The hook names that not every release of the hook binary knows. Before v1.18.0 a hook binary fails
/// on a hook name it does not know (v1.18.0 made that a warning), and a failed `createContainer` hook
/// fails the container, so a hook goes into a spec only when its binary has it. The toolkit never meets
/// this: it writes specs for its own binary, of its own release.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KnownHooks {
    /// Since v1.17.5.
    pub enable_cuda_compat: bool,
    /// Since v1.18.0.
    pub disable_device_node_modification: bool,
}

pub(super) const ENABLE_CUDA_COMPAT: &str = "enable-cuda-compat";
pub(super) const DISABLE_DEVICE_NODE_MODIFICATION: &str = "disable-device-node-modification";

impl KnownHooks {
    /// What the hook binary at `path` (as this process sees it) knows, from the hook names compiled into
    /// it: a release that has a hook has its name as a string in the binary (the command's name), one
    /// that does not, has not. Reading beats running it: the binary is the host's, built for the host's
    /// libc, and need not run in the plugin's container.
    pub fn of_binary(path: &Path) -> io::Result<Self> {
        let bytes = fs::read(path)?;
        let has = |name: &str| bytes.windows(name.len()).any(|w| w == name.as_bytes());
        Ok(Self {
            enable_cuda_compat: has(ENABLE_CUDA_COMPAT),
            disable_device_node_modification: has(DISABLE_DEVICE_NODE_MODIFICATION),
        })
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CdiHook {
    /// The path the container runtime executes, on the host.
    pub host_path: PathBuf,
    pub cli: HookCli,
    pub known: KnownHooks,
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

pub(super) fn hook_cli(file_name: &str) -> HookCli {
    if file_name == "nvidia-ctk" {
        HookCli::Ctk
    } else {
        HookCli::CdiHook
    }
}

pub(super) fn hook_override(path: &Path) -> Result<CdiHook, HostDriverError> {
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
    let known = KnownHooks::of_binary(path).map_err(|e| fail(e.to_string()))?;
    Ok(CdiHook {
        host_path: path.into(),
        cli: hook_cli(name),
        known,
    })
}

/// The `createContainer` hooks the Container Toolkit writes for a driver of `driver_version`, in its order:
/// - `create-symlinks` for the sonames (`libcuda.so.1`) and the bare `libcuda.so`, which applications open
///   by name, where only the versioned files are mounted;
/// - `enable-cuda-compat --host-driver-version=<version>`: where the image brings CUDA forward
///   compatibility libraries (`/usr/local/cuda/compat/libcuda.so.*`) newer than the host's driver, an
///   `/etc/ld.so.conf.d/00-compat-<uuid>.conf` naming that directory, so that the ldcache (next) puts
///   them before the driver's;
/// - `update-ldcache` for the library directories, so the linker finds them;
/// - `disable-device-node-modification`: the container's `/proc/driver/nvidia/params` says
///   `ModifyDeviceFiles: 0`, so that CUDA in the container never makes or changes device nodes.
///
/// The two later hooks only where the binary knows them ([`KnownHooks`]).
pub(super) fn toolkit_hooks(
    hook: &CdiHook,
    files: &[DriverFile],
    driver_version: &str,
) -> Vec<Hook> {
    let path_str = |p: &Path| p.to_string_lossy().into_owned();
    let mut links = Vec::new();
    let mut link_paths = HashSet::new();
    let mut folders: Vec<String> = Vec::new();
    for file in files
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
    if hook.known.enable_cuda_compat {
        let version = format!("--host-driver-version={driver_version}");
        hooks.push(hook.hook(ENABLE_CUDA_COMPAT, vec![version]));
    }
    if !folders.is_empty() {
        let args = folders
            .into_iter()
            .flat_map(|f| ["--folder".to_string(), f])
            .collect();
        hooks.push(hook.hook("update-ldcache", args));
    }
    if hook.known.disable_device_node_modification {
        hooks.push(hook.hook(DISABLE_DEVICE_NODE_MODIFICATION, Vec::new()));
    }
    hooks
}

#[cfg(test)]
mod tests {
    use super::super::fake_root::*;
    use super::*;
    use crate::cdi::host_driver::{DiscoveryOptions, HostDriver};

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
                cli: HookCli::CdiHook,
                known: KnownHooks::default(),
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

    /// The names of a spec's hooks, with the hook command (after `nvidia-ctk hook`) and its arguments.
    fn hook_args(root: &FakeRoot) -> Vec<Vec<String>> {
        discover(root)
            .container_edits()
            .hooks
            .iter()
            .map(|h| {
                assert_eq!(
                    (h.hook_name.as_str(), h.env.as_slice()),
                    (
                        "createContainer",
                        ["NVIDIA_CTK_DEBUG=false".to_string()].as_slice()
                    )
                );
                h.args.clone()
            })
            .collect()
    }

    /// A hook binary of v1.18 or later (both names in it) gets the toolkit's four hooks in the toolkit's
    /// order; v1.17.5 to v1.17.x (enable-cuda-compat only) three; an older one the two every release has,
    /// since it would fail the container on a hook it does not know.
    #[test]
    fn the_toolkits_hooks_in_its_order_where_the_binary_knows_them() {
        let version_arg = format!("--host-driver-version={VERSION}");
        let dir = native_dir();
        for (known, expected) in [
            (
                &[ENABLE_CUDA_COMPAT, DISABLE_DEVICE_NODE_MODIFICATION][..],
                &[
                    "create-symlinks",
                    ENABLE_CUDA_COMPAT,
                    "update-ldcache",
                    DISABLE_DEVICE_NODE_MODIFICATION,
                ][..],
            ),
            (
                &[ENABLE_CUDA_COMPAT][..],
                &["create-symlinks", ENABLE_CUDA_COMPAT, "update-ldcache"][..],
            ),
            (&[][..], &["create-symlinks", "update-ldcache"][..]),
        ] {
            let root = FakeRoot::debian_driver();
            root.hook_binary("/usr/bin/nvidia-cdi-hook", known);
            let hooks = hook_args(&root);
            let names: Vec<&str> = hooks.iter().map(|h| h[1].as_str()).collect();
            assert_eq!(names, expected, "binary knowing {known:?}");
            for hook in &hooks {
                match hook[1].as_str() {
                    ENABLE_CUDA_COMPAT => {
                        assert_eq!(hook[2..], [version_arg.as_str()])
                    }
                    DISABLE_DEVICE_NODE_MODIFICATION => assert_eq!(hook.len(), 2),
                    "update-ldcache" => {
                        assert_eq!(hook[2..], ["--folder".to_string(), dir.clone()])
                    }
                    _ => {}
                }
            }
        }

        // nvidia-ctk carries them under `hook`; the GPU Operator installs it in /usr/local/nvidia/toolkit.
        let root = FakeRoot::debian_driver();
        root.hook_binary(
            "/usr/local/nvidia/toolkit/nvidia-ctk",
            &[ENABLE_CUDA_COMPAT, DISABLE_DEVICE_NODE_MODIFICATION],
        );
        assert_eq!(
            discover(&root).cdi_hook().map(|h| h.host_path.clone()),
            Some("/usr/local/nvidia/toolkit/nvidia-ctk".into())
        );
        let hooks = hook_args(&root);
        assert_eq!(
            hooks[1],
            ["nvidia-ctk", "hook", ENABLE_CUDA_COMPAT, &version_arg]
        );
        assert_eq!(
            hooks[3],
            ["nvidia-ctk", "hook", DISABLE_DEVICE_NODE_MODIFICATION]
        );
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
}
