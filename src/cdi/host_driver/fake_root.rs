//! A temporary directory laid out like a node's driver root, for the discovery tests.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use super::search::library_dirs;
use super::HostDriver;

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
    library_dirs().swap_remove(0)
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
