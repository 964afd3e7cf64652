//! Where the driver's files are under a driver root: the library, binary and firmware tables, and the
//! lookups below the root that follow its symlinks as the host would and read its ld.so.cache.

use std::collections::{BTreeSet, HashSet, VecDeque};
use std::ffi::OsString;
use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path, PathBuf};

use super::{DriverFile, FileKind};
use crate::cdi::ldcache;
use crate::gpu::HostArch;

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

/// The driver's two core libraries, whose other versions discovery reports when the wanted one is
/// missing: libnvidia-ml (NVML, nvidia-smi) and libcuda (CUDA).
pub(super) const CORE: [&str; 2] = [NVML_LIBRARY, CUDA_LIBRARY];
/// Required: the plugin talks to the driver through it, so a driver root without it is not the root
/// of the driver that answered.
pub(super) const NVML_LIBRARY: &str = "libnvidia-ml";
/// Expected but not required: without it CUDA cannot start in a container (unless the image brings a
/// forward-compatibility libcuda), yet the GPUs can still be published, watched and used by NVML-only
/// workloads; NVIDIA's Container Toolkit treats it as optional too.
pub(super) const CUDA_LIBRARY: &str = "libcuda";

/// Applications dlopen these by their bare `.so` name, so the toolkit links that name to the soname too.
const DEV_LINKS: [&str; 2] = ["libcuda", "libnvidia-opticalflow"];

/// Library directories below a driver root of `arch`, most specific first, since the first file of a
/// name wins: `/usr/lib` and `/lib` come last because they hold the 32-bit libraries on Red Hat-like hosts.
pub(super) fn library_dirs(arch: Option<HostArch>) -> Vec<String> {
    let multiarch = |prefix: &str| arch.map(|arch| format!("{prefix}/{}", arch.multiarch));
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

/// Where the GPU Operator's toolkit container installs the toolkit's programs on the host.
const TOOLKIT_DIR: &str = "/usr/local/nvidia/toolkit";

pub(super) const BINARIES: [&str; 5] = [
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
];

/// Real caches are well under 1 MiB; a far larger file is not one.
const MAX_LD_CACHE_BYTES: u64 = 64 << 20;

/// Symlink chains longer than this are loops, as the kernel's own limit says.
const MAX_SYMLINKS: usize = 40;
/// Lookups below the driver root, treating its symlinks as the host would (absolute targets are
/// relative to the root, not to the plugin's filesystem).
pub(super) struct Finder<'a> {
    root: &'a Path,
    host_root: &'a Path,
    arch: Option<HostArch>,
    warnings: Vec<String>,
}

impl<'a> Finder<'a> {
    /// A finder for a driver root of the host `arch` (normally [`HostArch::NATIVE`]).
    pub(super) fn new(root: &'a Path, host_root: &'a Path, arch: Option<HostArch>) -> Self {
        Self {
            root,
            host_root,
            arch,
            warnings: Vec::new(),
        }
    }

    /// The library directories of this root's architecture.
    pub(super) fn library_dirs(&self) -> Vec<String> {
        library_dirs(self.arch)
    }

    /// What was skipped, for the operator.
    pub(super) fn into_warnings(self) -> Vec<String> {
        self.warnings
    }

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

    /// The first regular file (through symlinks) in `dirs` whose name is a version of library `stem`
    /// (`libnvidia-ml.so.1`, `libnvidia-ml.so.550.90.07`), whatever the version.
    pub(super) fn any_version_of(&mut self, dirs: &[String], stem: &str) -> Option<DriverFile> {
        let prefix = format!("{stem}.so.");
        for dir in dirs {
            let Some((_, names)) = self.list(Path::new(dir)) else {
                continue;
            };
            let found = names
                .iter()
                .filter(|name| name.starts_with(&prefix))
                .find_map(|name| {
                    self.file(Path::new(dir).join(name), FileKind::Library(Compute), false)
                });
            if found.is_some() {
                return found;
            }
        }
        None
    }

    pub(super) fn executable(&mut self, name: &str, kind: FileKind) -> Option<DriverFile> {
        BINARY_DIRS
            .iter()
            .find_map(|dir| self.file(Path::new(dir).join(name), kind, true))
    }

    /// The Container Toolkit's hook binary `name`: where the driver's tools are, then where the GPU
    /// Operator installs the toolkit on the host (`/usr/local/nvidia/toolkit`).
    pub(super) fn hook_binary(&mut self, name: &str) -> Option<DriverFile> {
        BINARY_DIRS
            .iter()
            .chain([TOOLKIT_DIR].iter())
            .find_map(|dir| self.file(Path::new(dir).join(name), FileKind::Binary, true))
    }

    /// The driver's libraries of `version`, first file of each name in `dirs` order, and the names of
    /// required libraries present in other versions (for the error when this version is missing).
    pub(super) fn libraries(
        &mut self,
        dirs: &[String],
        version: &str,
    ) -> (Vec<DriverFile>, BTreeSet<String>) {
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
                    if CORE.contains(&stem) && file_version.contains('.') {
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

    /// Directories that the root's ld.so.cache gives for the driver's libraries, for its architecture.
    pub(super) fn ld_cache_dirs(&mut self) -> Vec<String> {
        let Some(native) = self.arch.map(|arch| arch.ld_cache_flags) else {
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
    pub(super) fn firmware(&mut self, version: &str) -> Vec<DriverFile> {
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
    use super::super::fake_root::*;
    use super::*;
    use crate::cdi::host_driver::{FileKind, LibraryClass};

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
        let Some(native) = HostArch::NATIVE.map(|arch| arch.ld_cache_flags) else {
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
        if HostArch::NATIVE.is_some() {
            assert!(
                driver.warnings().iter().any(|w| w.contains("ld.so.cache")),
                "{:?}",
                driver.warnings()
            );
        }
    }
}
