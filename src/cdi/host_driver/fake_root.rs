//! A temporary directory laid out like a node's driver root, for the discovery tests.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use super::search::library_dirs;
use super::HostDriver;
use crate::gpu::HostArch;

pub const VERSION: &str = "550.90.07";

/// A temporary directory laid out like a node's driver root.
pub struct FakeRoot(tempfile::TempDir);

impl FakeRoot {
    pub fn new() -> Self {
        Self(tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}")))
    }

    pub fn path(&self) -> &Path {
        self.0.path()
    }

    pub fn write(&self, path: &str, content: &[u8], mode: u32) -> &Self {
        let full = self.path().join(path.trim_start_matches('/'));
        if let Some(parent) = full.parent() {
            fs::create_dir_all(parent).unwrap_or_else(|e| panic!("{}: {e}", parent.display()));
        }
        fs::write(&full, content).unwrap_or_else(|e| panic!("{}: {e}", full.display()));
        fs::set_permissions(&full, fs::Permissions::from_mode(mode))
            .unwrap_or_else(|e| panic!("{}: {e}", full.display()));
        self
    }

    pub fn lib(&self, path: &str) -> &Self {
        self.write(path, b"\x7fELF", 0o644)
    }

    pub fn bin(&self, path: &str) -> &Self {
        self.write(path, b"\x7fELF", 0o755)
    }

    /// A Container Toolkit hook binary of a release that knows the hooks `known` beyond create-symlinks
    /// and update-ldcache: their names are in it, as in the real binary's strings.
    pub fn hook_binary(&self, path: &str, known: &[&str]) -> &Self {
        let mut content = b"\x7fELF\0create-symlinks\0update-ldcache\0".to_vec();
        for name in known {
            content.extend_from_slice(name.as_bytes());
            content.push(0);
        }
        self.write(path, &content, 0o755)
    }

    pub fn symlink(&self, link: &str, target: &str) -> &Self {
        let full = self.path().join(link.trim_start_matches('/'));
        if let Some(parent) = full.parent() {
            fs::create_dir_all(parent).unwrap_or_else(|e| panic!("{}: {e}", parent.display()));
        }
        std::os::unix::fs::symlink(target, &full)
            .unwrap_or_else(|e| panic!("{}: {e}", full.display()));
        self
    }

    /// A Debian-style driver install of `VERSION` with the usual soname links.
    pub fn debian_driver() -> Self {
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

pub fn native_dir() -> String {
    library_dirs(HostArch::NATIVE).swap_remove(0)
}

pub fn discover(root: &FakeRoot) -> HostDriver {
    HostDriver::discover(root.path(), VERSION).unwrap_or_else(|e| panic!("discover: {e}"))
}

pub fn container_paths(driver: &HostDriver) -> Vec<String> {
    driver
        .files()
        .iter()
        .map(|f| f.container_path.to_string_lossy().into_owned())
        .collect()
}

pub fn error_text(root: &Path, version: &str) -> String {
    match HostDriver::discover(root, version) {
        Err(e) => e.to_string(),
        Ok(d) => panic!("discovery should fail, found {:?}", d.files()),
    }
}

/// Whether the tests run as root, which chroot needs (CI runs them as root); elsewhere a test that
/// chroots says so and passes.
pub fn running_as_root(test: &str) -> bool {
    use std::os::unix::fs::MetadataExt;
    let root = fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0);
    if !root {
        eprintln!("{test}: skipped, chroot needs root");
    }
    root
}

/// A file only a fake root has at its top. The stand-ins of [`FakeRoot::stand_in`] look for it at `/`
/// to tell whether they run inside the root.
pub const INSIDE_MARKER: &str = ".gpu-dra-fake-driver-root";

impl FakeRoot {
    /// A driver root laid out like an Ubuntu or RHEL host's `/` (merged `/usr`) that can run its own
    /// programs: this machine's `/bin/sh` with its loader and libraries (as `ldd` names them) copied
    /// to the same paths, so that a `libc.so.6` lies in the driver's library directory as on a host.
    pub fn host_like() -> Self {
        let root = Self::new();
        for (link, target) in [
            ("bin", "usr/bin"),
            ("lib", "usr/lib"),
            ("lib64", "usr/lib64"),
            ("sbin", "usr/sbin"),
        ] {
            fs::create_dir_all(root.path().join(target))
                .unwrap_or_else(|e| panic!("{target}: {e}"));
            root.symlink(link, target);
        }
        let ldd = std::process::Command::new("ldd")
            .arg("/bin/sh")
            .output()
            .unwrap_or_else(|e| panic!("ldd /bin/sh: {e}"));
        assert!(ldd.status.success(), "ldd /bin/sh: {ldd:?}");
        let text = String::from_utf8_lossy(&ldd.stdout);
        // `libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)` and `/lib64/ld-linux-x86-64.so.2 (0x...)`.
        let needed: Vec<&str> = text
            .lines()
            .filter_map(|line| line.split_whitespace().find(|word| word.starts_with('/')))
            .collect();
        assert!(!needed.is_empty(), "ldd /bin/sh named no files: {text}");
        for file in needed.into_iter().chain(["/bin/sh"]) {
            let to = root.path().join(file.trim_start_matches('/'));
            if let Some(parent) = to.parent() {
                fs::create_dir_all(parent).unwrap_or_else(|e| panic!("{}: {e}", parent.display()));
            }
            fs::copy(file, &to).unwrap_or_else(|e| panic!("{file} → {}: {e}", to.display()));
        }
        root.lib(&format!("{}/libnvidia-ml.so.1", native_dir()))
            .write(INSIDE_MARKER, b"", 0o644);
        root
    }

    /// A root like GKE's Container-Optimized OS: the driver's programs and libraries only (no loader,
    /// no shell, no libc), in `/bin` and `/lib64`.
    pub fn programs_only() -> Self {
        let root = Self::new();
        root.lib("/lib64/libnvidia-ml.so.1")
            .write(INSIDE_MARKER, b"", 0o644);
        root
    }

    /// A stand-in for the driver program at `path`: the `/bin/sh` script `body`, which uses shell
    /// built-ins only (a root has no other tools). Outside the root it fails as the real program does
    /// when this container's loader starts it: with the root's libc on `LD_LIBRARY_PATH`
    /// (`GLIBC_PRIVATE`), or without libnvidia-ml there (nvidia-smi's own message).
    pub fn stand_in(&self, path: &str, body: &str) -> &Self {
        let script = format!(
            r#"#!/bin/sh
if [ ! -e /{INSIDE_MARKER} ]; then
  nvml=
  saved_ifs=$IFS
  IFS=:
  for dir in $LD_LIBRARY_PATH; do
    if [ -e "$dir/libc.so.6" ]; then
      echo "$0: $dir/libc.so.6: version \`GLIBC_PRIVATE' not found (required by /lib64/ld-linux-x86-64.so.2)" >&2
      exit 127
    fi
    if [ -e "$dir/libnvidia-ml.so.1" ]; then nvml=yes; fi
  done
  IFS=$saved_ifs
  if [ -z "$nvml" ]; then
    echo "NVIDIA-SMI couldn't find libnvidia-ml.so library in your system. Please make sure that the NVIDIA Display Driver is properly installed and present in your system."
    exit 12
  fi
fi
{body}
"#
        );
        self.write(path, script.as_bytes(), 0o755)
    }
}
