//! MIG access device files: the NVIDIA driver guards each GPU instance and compute instance with a
//! capability whose `/dev/nvidia-caps/nvidia-cap<N>` a container needs besides the parent GPU's
//! device file. The minor `N` of each comes from the driver's table `/proc/driver/nvidia-caps/mig-minors`
//! (lines like `gpu0/gi1/access 12`), as NVIDIA's toolkit reads it; the node itself usually exists
//! nowhere on the host (only `nvidia-modprobe` makes it), so CDI specs carry its numbers.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Where the driver's capability device files live in a container.
pub const CAPS_DEVICE_DIR: &str = "/dev/nvidia-caps";

/// The table's path below a `/proc`.
pub const MIG_MINORS: &str = "driver/nvidia-caps/mig-minors";

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CapsError {
    #[error("reading the MIG capability table {}: {reason} (is the NVIDIA driver loaded, and the driver root right?)", path.display())]
    Unreadable { path: PathBuf, reason: String },
    #[error("the MIG capability table {} has no line for {capability} (GPU minor {gpu_minor} beyond the driver's table?)", path.display())]
    Missing {
        path: PathBuf,
        capability: String,
        gpu_minor: u32,
    },
}

/// The driver's table of MIG capability minors: `gpu<minor>/gi<id>/access` and
/// `gpu<minor>/gi<id>/ci<id>/access` → the minor of its `nvidia-cap<N>` device file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigMinors {
    path: PathBuf,
    minors: HashMap<String, u32>,
}

impl MigMinors {
    /// Parses the table's text; `path` is where it was read, for messages. Lines that are not
    /// `<capability> <minor>` are skipped, as NVIDIA's toolkit skips them.
    pub fn parse(path: &Path, text: &str) -> Self {
        let minors = text
            .lines()
            .filter_map(|line| {
                let (capability, minor) = line.trim().split_once(' ')?;
                Some((capability.to_string(), minor.trim().parse::<u32>().ok()?))
            })
            .collect();
        MigMinors {
            path: path.to_path_buf(),
            minors,
        }
    }

    /// Reads the table at `path`.
    pub fn read(path: &Path) -> Result<Self, CapsError> {
        let text = std::fs::read_to_string(path).map_err(|e| CapsError::Unreadable {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        Ok(Self::parse(path, &text))
    }

    /// Where the table was read.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The capability device files of one MIG device, GPU instance first, then compute instance.
    pub fn device_files(
        &self,
        gpu_minor: u32,
        gpu_instance: u32,
        compute_instance: u32,
    ) -> Result<Vec<String>, CapsError> {
        let gi = format!("gpu{gpu_minor}/gi{gpu_instance}/access");
        let ci = format!("gpu{gpu_minor}/gi{gpu_instance}/ci{compute_instance}/access");
        [gi, ci]
            .into_iter()
            .map(|capability| match self.minors.get(&capability) {
                Some(minor) => Ok(cap_device_file(*minor)),
                None => Err(CapsError::Missing {
                    path: self.path.clone(),
                    capability,
                    gpu_minor,
                }),
            })
            .collect()
    }
}

/// `/dev/nvidia-caps/nvidia-cap<minor>`: `nvidia-modprobe` names the node by its minor.
pub fn cap_device_file(minor: u32) -> String {
    format!("{CAPS_DEVICE_DIR}/nvidia-cap{minor}")
}

/// The table as the driver writes it: `config` and `monitor`, then for each of `gpus` GPU minors 15
/// GPU instances of 1 + 8 compute instances each (`gpu6/gi11/ci7/access 920`). The fake backend
/// writes this for its GPUs.
pub fn driver_table(gpus: u32) -> String {
    let mut text = String::from("config 1\nmonitor 2\n");
    for gpu in 0..gpus {
        for gi in 0..15u32 {
            let base = 3 + gpu * 135 + gi * 9;
            text.push_str(&format!("gpu{gpu}/gi{gi}/access {base}\n"));
            for ci in 0..8u32 {
                text.push_str(&format!(
                    "gpu{gpu}/gi{gi}/ci{ci}/access {}\n",
                    base + 1 + ci
                ));
            }
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    // As a node with the NVIDIA driver has it (the MIG user guide's example lines).
    const TABLE: &str = "config 1\nmonitor 2\ngpu0/gi0/access 3\ngpu0/gi0/ci0/access 4\n\
                         gpu0/gi1/access 12\ngpu0/gi1/ci0/access 13\ngpu3/gi3/ci3/access 439\n\
                         gpu3/gi3/access 435\ngarbage line here\ngpu1/gi2/access x\n";

    #[test]
    fn reads_gi_then_ci_device_files_from_the_table() {
        let table = MigMinors::parse(Path::new("/proc/driver/nvidia-caps/mig-minors"), TABLE);
        assert_eq!(
            table.device_files(0, 1, 0).unwrap(),
            [
                "/dev/nvidia-caps/nvidia-cap12",
                "/dev/nvidia-caps/nvidia-cap13"
            ]
        );
        assert_eq!(
            table.device_files(3, 3, 3).unwrap(),
            [
                "/dev/nvidia-caps/nvidia-cap435",
                "/dev/nvidia-caps/nvidia-cap439"
            ]
        );
    }

    #[test]
    fn a_missing_line_names_the_capability_and_the_table() {
        let table = MigMinors::parse(
            Path::new("/driver/proc/driver/nvidia-caps/mig-minors"),
            TABLE,
        );
        let err = table.device_files(0, 1, 1).unwrap_err().to_string();
        assert!(err.contains("gpu0/gi1/ci1/access"), "{err}");
        assert!(
            err.contains("/driver/proc/driver/nvidia-caps/mig-minors"),
            "{err}"
        );
        // Another GPU's minor does not find this GPU's lines; a malformed minor is no line at all.
        let err = table.device_files(1, 2, 0).unwrap_err().to_string();
        assert!(err.contains("gpu1/gi2/access"), "{err}");

        let dir = tempfile::tempdir().unwrap();
        let err = MigMinors::read(&dir.path().join("mig-minors"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("mig-minors") && err.contains("driver root"),
            "{err}"
        );
    }

    #[test]
    fn the_driver_table_numbers_as_the_driver_does() {
        let table = MigMinors::parse(Path::new("t"), &driver_table(7));
        for (gpu, gi, ci, gi_minor, ci_minor) in [
            (0, 0, 0, 3, 4),
            (0, 1, 0, 12, 13),
            (3, 3, 3, 435, 439),
            (6, 11, 7, 912, 920),
        ] {
            assert_eq!(
                table.device_files(gpu, gi, ci).unwrap(),
                [cap_device_file(gi_minor), cap_device_file(ci_minor)]
            );
        }
        assert!(table.device_files(7, 0, 0).is_err());
    }
}
