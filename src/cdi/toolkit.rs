//! Finds the CDI spec the NVIDIA Container Toolkit generated for this node (kind `nvidia.com/gpu`) and looks up
//! its device for a GPU or MIG device, so that a claim can name the toolkit's device when the node has one,
//! resolving names across spec directories the way container runtimes do.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::spec::{validate, Spec};

/// The kind of the toolkit's GPU spec, `nvidia-ctk cdi generate`'s default.
pub const TOOLKIT_KIND: &str = "nvidia.com/gpu";

/// Spec files are a few hundred KiB at most; anything far larger is not a spec.
const MAX_SPEC_BYTES: u64 = 16 << 20;

/// A file skipped while looking for the toolkit's spec, or a device dropped from it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolkitWarning {
    pub path: PathBuf,
    pub reason: String,
}

impl fmt::Display for ToolkitWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CDI spec {}: {}", self.path.display(), self.reason)
    }
}

/// What [`ToolkitSpec::find`] saw: the toolkit's devices, if any file has them, and what it skipped.
#[derive(Debug, Default)]
pub struct ToolkitSearch {
    pub spec: Option<ToolkitSpec>,
    pub warnings: Vec<ToolkitWarning>,
}

/// The devices of every valid `nvidia.com/gpu` spec file in the CDI directories, each from the file that
/// wins it: a later directory overrides an earlier one, and a name defined twice at the same priority is
/// dropped, as the CDI library's cache does.
#[derive(Clone, Debug)]
pub struct ToolkitSpec {
    /// Device name to the file that defines it.
    devices: BTreeMap<String, PathBuf>,
    /// The files that were kept, lowest priority first.
    files: Vec<PathBuf>,
}

/// The toolkit's index name of a device: NVML's GPU index, and for a MIG device also its index among the
/// GPU's MIG devices as NVML enumerates them (`nvidia-ctk cdi generate --device-name-strategy=index`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceIndex {
    pub gpu: u32,
    pub mig: Option<u32>,
}

impl DeviceIndex {
    pub fn gpu(gpu: u32) -> Self {
        Self { gpu, mig: None }
    }

    pub fn mig(gpu: u32, mig: u32) -> Self {
        Self {
            gpu,
            mig: Some(mig),
        }
    }
}

impl fmt::Display for DeviceIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.mig {
            Some(mig) => write!(f, "{}:{mig}", self.gpu),
            None => write!(f, "{}", self.gpu),
        }
    }
}

/// Only the kind, to skip other vendors' specs without judging fields we do not model.
#[derive(Deserialize)]
struct KindOnly {
    kind: String,
}

impl ToolkitSpec {
    /// Reads the `*.yaml` / `*.json` files directly in `cdi_dirs` (lowest priority first, e.g. `/etc/cdi`
    /// then `/var/run/cdi`). Files of the toolkit's kind must parse and validate as the runtime requires;
    /// others are skipped, and malformed files of any kind are reported as warnings.
    pub fn find(cdi_dirs: &[PathBuf]) -> ToolkitSearch {
        let mut warnings = Vec::new();
        let mut devices: BTreeMap<String, (usize, PathBuf)> = BTreeMap::new();
        let mut conflicts = BTreeSet::new();
        let mut files = Vec::new();
        for (priority, dir) in cdi_dirs.iter().enumerate() {
            for path in spec_files(dir, &mut warnings) {
                let spec = match read_spec(&path) {
                    Ok(Some(spec)) => spec,
                    Ok(None) => continue,
                    Err(reason) => {
                        warnings.push(ToolkitWarning { path, reason });
                        continue;
                    }
                };
                for device in &spec.devices {
                    match devices.get(&device.name) {
                        Some((p, other)) if *p == priority => {
                            warnings.push(ToolkitWarning {
                                path: path.clone(),
                                reason: format!(
                                    "device {:?} is also in {}, at the same priority: the runtime \
                                     resolves neither",
                                    device.name,
                                    other.display()
                                ),
                            });
                            conflicts.insert(device.name.clone());
                        }
                        _ => {
                            devices.insert(device.name.clone(), (priority, path.clone()));
                        }
                    }
                }
                files.push(path);
            }
        }
        // As in the CDI cache, a conflict anywhere drops the name, even if a later directory redefines it.
        for name in &conflicts {
            devices.remove(name);
        }
        let spec = (!files.is_empty()).then(|| ToolkitSpec {
            devices: devices.into_iter().map(|(n, (_, p))| (n, p)).collect(),
            files,
        });
        ToolkitSearch { spec, warnings }
    }

    /// The qualified CDI id (`nvidia.com/gpu=<name>`) of the toolkit's device for a GPU (`GPU-…`) or MIG
    /// device (`MIG-…`): the device named by its UUID, else, when `index` is given, the device named by
    /// that index. The caller must pass the index as NVML numbers it, which is what the toolkit used.
    pub fn device_for(&self, gpu_uuid: &str, index: Option<DeviceIndex>) -> Option<String> {
        let is_uuid = gpu_uuid.starts_with("GPU-") || gpu_uuid.starts_with("MIG-");
        let by_uuid = || {
            self.devices
                .keys()
                .find(|name| name.eq_ignore_ascii_case(gpu_uuid))
        };
        let name = is_uuid.then(by_uuid).flatten().or_else(|| {
            let index = index?.to_string();
            self.devices.get_key_value(&index).map(|(name, _)| name)
        })?;
        Some(format!("{TOOLKIT_KIND}={name}"))
    }

    /// The file that defines a device, for logs.
    pub fn spec_file_of(&self, device_name: &str) -> Option<&Path> {
        self.devices.get(device_name).map(PathBuf::as_path)
    }

    /// The highest-priority file kept, for logs.
    pub fn path(&self) -> &Path {
        self.files.last().map_or(Path::new(""), PathBuf::as_path)
    }

    /// Every file kept, lowest priority first.
    pub fn paths(&self) -> &[PathBuf] {
        &self.files
    }

    /// The names the runtime can resolve (including the toolkit's `all`).
    pub fn device_names(&self) -> impl Iterator<Item = &str> {
        self.devices.keys().map(String::as_str)
    }
}

/// Spec files directly in `dir`, sorted; a missing directory is normal (the toolkit may use the other one).
fn spec_files(dir: &Path, warnings: &mut Vec<ToolkitWarning>) -> Vec<PathBuf> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Vec::new(),
        Err(e) => {
            warnings.push(ToolkitWarning {
                path: dir.into(),
                reason: format!("cannot list the directory: {e}"),
            });
            return Vec::new();
        }
    };
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| Some(e.ok()?.path()))
        .filter(|p| {
            matches!(
                p.extension().and_then(|e| e.to_str()),
                Some("yaml" | "json")
            )
        })
        .collect();
    files.sort();
    files
}

/// The spec in `path` if it is the toolkit's kind; `Err` says why the file is unusable.
fn read_spec(path: &Path) -> Result<Option<Spec>, String> {
    let meta = fs::metadata(path).map_err(|e| e.to_string())?;
    if !meta.is_file() {
        return Err("not a regular file".into());
    }
    if meta.len() > MAX_SPEC_BYTES {
        return Err(format!("{} bytes, too large for a CDI spec", meta.len()));
    }
    let text = fs::read_to_string(path).map_err(|e| e.to_string())?;
    let json = path.extension().is_some_and(|e| e == "json");
    let kind: KindOnly = parse(&text, json).map_err(|e| format!("not a CDI spec: {e}"))?;
    if kind.kind != TOOLKIT_KIND {
        return Ok(None);
    }
    let spec: Spec =
        parse(&text, json).map_err(|e| format!("malformed {TOOLKIT_KIND} spec: {e}"))?;
    // A runtime drops a spec that fails validation, and with it every device id we could return.
    validate(&spec).map_err(|e| e.to_string())?;
    Ok(Some(spec))
}

fn parse<T: for<'de> Deserialize<'de>>(text: &str, json: bool) -> Result<T, String> {
    if json {
        serde_json::from_str(text).map_err(|e| e.to_string())
    } else {
        serde_yaml::from_str(text).map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FULL_GPU: &str = include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/toolkit/nvidia.yaml"
    ));
    const MIG: &str = include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/toolkit/nvidia-mig.yaml"
    ));
    const GPU0: &str = "GPU-4cf8db2d-06c0-7d70-1a51-e59b25b2c16c";
    const GPU1: &str = "GPU-9a1e4f3b-7c2d-4e8f-b5a6-0d1c2e3f4a5b";
    const MIG_UUID: &str = "MIG-5c89b4f5-0d91-5a4b-8c3e-2f1a0b9c8d7e";

    /// `/etc/cdi` and `/var/run/cdi` in a temporary directory.
    struct CdiDirs {
        _tmp: tempfile::TempDir,
        etc: PathBuf,
        run: PathBuf,
    }

    impl CdiDirs {
        fn new() -> Self {
            let tmp = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
            let (etc, run) = (tmp.path().join("etc/cdi"), tmp.path().join("var/run/cdi"));
            for dir in [&etc, &run] {
                fs::create_dir_all(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
            }
            Self {
                _tmp: tmp,
                etc,
                run,
            }
        }

        fn write(&self, dir: &Path, name: &str, text: &str) -> PathBuf {
            let path = dir.join(name);
            fs::write(&path, text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            path
        }

        fn find(&self) -> ToolkitSearch {
            ToolkitSpec::find(&[self.etc.clone(), self.run.clone()])
        }
    }

    fn spec_of(search: ToolkitSearch) -> ToolkitSpec {
        match search.spec {
            Some(spec) => spec,
            None => panic!("no toolkit spec found; warnings: {:?}", search.warnings),
        }
    }

    #[test]
    fn the_fixtures_are_valid_specs_of_the_toolkit_kind() {
        for text in [FULL_GPU, MIG] {
            let spec: Spec = serde_yaml::from_str(text).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(spec.kind, TOOLKIT_KIND);
            assert_eq!(spec.cdi_version, "0.5.0");
            validate(&spec).unwrap_or_else(|e| panic!("{e}"));
        }
    }

    #[test]
    fn finds_devices_by_uuid_first_then_by_index() {
        let dirs = CdiDirs::new();
        let path = dirs.write(&dirs.run, "nvidia.yaml", FULL_GPU);
        let search = dirs.find();
        assert!(search.warnings.is_empty(), "{:?}", search.warnings);
        let spec = spec_of(search);
        assert_eq!(spec.path(), path);
        assert_eq!(
            spec.device_for(GPU0, Some(DeviceIndex::gpu(1))),
            Some(format!("nvidia.com/gpu={GPU0}"))
        );
        assert_eq!(
            spec.device_for(&GPU1.to_uppercase(), None),
            Some(format!("nvidia.com/gpu={GPU1}"))
        );
        // A GPU the spec does not name by UUID: only the index, and only when given.
        let unknown = "GPU-00000000-0000-0000-0000-000000000000";
        assert_eq!(spec.device_for(unknown, None), None);
        assert_eq!(
            spec.device_for(unknown, Some(DeviceIndex::gpu(1))),
            Some("nvidia.com/gpu=1".into())
        );
        assert_eq!(spec.device_for(unknown, Some(DeviceIndex::gpu(7))), None);
        // "all" is a device of the spec, never a GPU's.
        assert_eq!(spec.device_for("all", None), None);
        assert!(spec.device_names().any(|n| n == "all"));
    }

    #[test]
    fn finds_mig_devices_by_uuid_and_by_gpu_and_mig_index() {
        let dirs = CdiDirs::new();
        dirs.write(&dirs.etc, "nvidia.yaml", MIG);
        let spec = spec_of(dirs.find());
        assert_eq!(
            spec.device_for(MIG_UUID, None),
            Some(format!("nvidia.com/gpu={MIG_UUID}"))
        );
        assert_eq!(
            spec.device_for(
                "MIG-ffffffff-0d91-5a4b-8c3e-2f1a0b9c8d7e",
                Some(DeviceIndex::mig(0, 1))
            ),
            Some("nvidia.com/gpu=0:1".into())
        );
        assert_eq!(
            spec.device_for(
                "MIG-ffffffff-0d91-5a4b-8c3e-2f1a0b9c8d7e",
                Some(DeviceIndex::gpu(0))
            ),
            Some("nvidia.com/gpu=0".into())
        );
    }

    #[test]
    fn a_later_directory_wins_and_both_files_are_kept() {
        let dirs = CdiDirs::new();
        let etc = dirs.write(&dirs.etc, "nvidia.yaml", FULL_GPU);
        // A fresher spec in /var/run/cdi that knows only GPU 0.
        let fresh: String = FULL_GPU
            .split("\n- containerEdits:")
            .filter(|part| !part.contains(GPU1) && !part.contains("name: \"1\""))
            .collect::<Vec<_>>()
            .join("\n- containerEdits:");
        let run = dirs.write(&dirs.run, "nvidia.yaml", &fresh);
        let search = dirs.find();
        assert!(search.warnings.is_empty(), "{:?}", search.warnings);
        let spec = spec_of(search);
        assert_eq!(spec.paths(), [etc.clone(), run.clone()]);
        assert_eq!(spec.path(), run);
        assert_eq!(spec.spec_file_of(GPU0), Some(run.as_path()));
        assert_eq!(spec.spec_file_of("all"), Some(run.as_path()));
        // Still resolvable by the runtime from the older file.
        assert_eq!(spec.spec_file_of(GPU1), Some(etc.as_path()));
        assert_eq!(
            spec.device_for(GPU1, None),
            Some(format!("nvidia.com/gpu={GPU1}"))
        );
    }

    #[test]
    fn malformed_and_invalid_files_are_skipped_with_warnings() {
        let dirs = CdiDirs::new();
        let good = dirs.write(&dirs.etc, "nvidia.yaml", FULL_GPU);
        let broken = dirs.write(
            &dirs.run,
            "broken.yaml",
            "cdiVersion: 0.5.0\nkind: [nvidia.com/gpu\n",
        );
        let empty_edits = dirs.write(
            &dirs.run,
            "nvidia-bad.json",
            r#"{"cdiVersion":"0.5.0","kind":"nvidia.com/gpu","devices":[{"name":"GPU-x","containerEdits":{}}]}"#,
        );
        let unknown_version = dirs.write(
            &dirs.run,
            "nvidia-future.yaml",
            &FULL_GPU.replace("cdiVersion: 0.5.0", "cdiVersion: 9.9.9"),
        );
        let search = dirs.find();
        let spec = spec_of(ToolkitSearch {
            spec: search.spec,
            warnings: Vec::new(),
        });
        assert_eq!(spec.paths(), [good]);
        assert_eq!(spec.device_for("GPU-x", None), None);
        let warned: Vec<_> = search.warnings.iter().map(|w| w.path.clone()).collect();
        assert_eq!(warned, [broken, empty_edits, unknown_version]);
        let text: Vec<_> = search.warnings.iter().map(ToString::to_string).collect();
        assert!(text[1].contains("containerEdits is empty"), "{}", text[1]);
        assert!(text[2].contains("unknown cdiVersion"), "{}", text[2]);
    }

    #[test]
    fn other_kinds_and_other_extensions_are_ignored_silently() {
        let dirs = CdiDirs::new();
        dirs.write(
            &dirs.run,
            "gpu-dra-claim.json",
            r#"{"cdiVersion":"0.5.0","kind":"k8s.gpu.dra.dev/gpu","devices":[],"netDevices":[]}"#,
        );
        dirs.write(&dirs.run, "nvidia.yaml.bak", "garbage: [");
        let search = dirs.find();
        assert!(search.spec.is_none());
        assert!(search.warnings.is_empty(), "{:?}", search.warnings);
        // Missing directories are no reason to warn either.
        let search = ToolkitSpec::find(&[PathBuf::from("/nonexistent/cdi")]);
        assert!(search.spec.is_none() && search.warnings.is_empty());
    }

    #[test]
    fn a_name_twice_in_one_directory_resolves_to_nothing() {
        let dirs = CdiDirs::new();
        dirs.write(&dirs.run, "nvidia.yaml", FULL_GPU);
        dirs.write(&dirs.run, "nvidia-copy.yaml", FULL_GPU);
        let search = dirs.find();
        assert!(
            search
                .warnings
                .iter()
                .any(|w| w.reason.contains(GPU0) && w.reason.contains("same priority")),
            "{:?}",
            search.warnings
        );
        let spec = spec_of(search);
        assert_eq!(spec.device_for(GPU0, Some(DeviceIndex::gpu(0))), None);
    }
}
