//! The NVIDIA Container Toolkit's CDI hooks in the claim specs: which hook binary (found under the driver
//! root, or given by the admin), and the `create-symlinks` and `update-ldcache` hooks the driver's
//! libraries need, written as the toolkit writes them.

use std::collections::HashSet;
use std::fs;
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

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CdiHook {
    /// The path the container runtime executes, on the host.
    pub host_path: PathBuf,
    pub cli: HookCli,
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
    Ok(CdiHook {
        host_path: path.into(),
        cli: hook_cli(name),
    })
}

/// Two `createContainer` hooks as the Container Toolkit writes them: `create-symlinks` for the sonames
/// (`libcuda.so.1`) and the bare `libcuda.so`, which applications open by name and only the versioned
/// files are mounted, and `update-ldcache` for the library directories, so the linker finds them.
pub(super) fn library_hooks(hook: &CdiHook, files: &[DriverFile]) -> Vec<Hook> {
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
    if !folders.is_empty() {
        let args = folders
            .into_iter()
            .flat_map(|f| ["--folder".to_string(), f])
            .collect();
        hooks.push(hook.hook("update-ldcache", args));
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
}
