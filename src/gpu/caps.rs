//! MIG access device files: the NVIDIA driver guards each GPU instance and compute instance with a
//! capability whose `/dev/nvidia-caps/nvidia-cap<N>` a container needs besides the parent GPU's
//! device file. The minor `N` comes from the driver's `access` file under `/proc/driver/nvidia`.

use std::path::Path;

/// Where the driver's capability device files live (host and container alike).
const CAPS_DEVICE_DIR: &str = "/dev/nvidia-caps";

/// The capability device files of one MIG device, GPU instance first, then compute instance.
/// `proc_root` is the `/proc` the NVIDIA driver writes to (`<driver root>/proc`).
pub fn mig_device_files(
    proc_root: &Path,
    parent_minor: u32,
    gpu_instance: u32,
    compute_instance: u32,
) -> Result<Vec<String>, String> {
    let gi_dir = proc_root
        .join("driver/nvidia/capabilities")
        .join(format!("gpu{parent_minor}"))
        .join("mig")
        .join(format!("gi{gpu_instance}"));
    let ci_dir = gi_dir.join(format!("ci{compute_instance}"));
    [gi_dir.join("access"), ci_dir.join("access")]
        .iter()
        .map(|path| {
            device_file_minor(path).map(|minor| format!("{CAPS_DEVICE_DIR}/nvidia-cap{minor}"))
        })
        .collect()
}

/// Reads the `DeviceFileMinor: <N>` line of one capability `access` file.
fn device_file_minor(path: &Path) -> Result<u32, String> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        format!(
            "reading MIG capability file {}: {e} (is the NVIDIA driver loaded, and the driver root right?)",
            path.display()
        )
    })?;
    let value = text
        .lines()
        .find_map(|line| line.trim().strip_prefix("DeviceFileMinor:"))
        .ok_or_else(|| {
            format!(
                "MIG capability file {} has no \"DeviceFileMinor:\" line",
                path.display()
            )
        })?;
    value.trim().parse::<u32>().map_err(|_| {
        format!(
            "MIG capability file {}: \"DeviceFileMinor:{value}\" is not a device minor number",
            path.display()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_access(root: &Path, rel: &str, text: &str) {
        let path = root.join(rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }

    const ACCESS: &str = "DeviceFileMinor: {N}\nDeviceFileMode: 292\nDeviceFileModify: 1\n";

    #[test]
    fn reads_gi_then_ci_device_files() {
        let dir = tempfile::tempdir().unwrap();
        let base = "driver/nvidia/capabilities/gpu3/mig/gi5";
        write_access(
            dir.path(),
            &format!("{base}/access"),
            &ACCESS.replace("{N}", "48"),
        );
        write_access(
            dir.path(),
            &format!("{base}/ci0/access"),
            &ACCESS.replace("{N}", "49"),
        );
        assert_eq!(
            mig_device_files(dir.path(), 3, 5, 0).unwrap(),
            vec![
                "/dev/nvidia-caps/nvidia-cap48".to_string(),
                "/dev/nvidia-caps/nvidia-cap49".to_string()
            ]
        );
    }

    #[test]
    fn a_missing_file_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let base = "driver/nvidia/capabilities/gpu0/mig/gi1";
        write_access(
            dir.path(),
            &format!("{base}/access"),
            &ACCESS.replace("{N}", "12"),
        );
        let err = mig_device_files(dir.path(), 0, 1, 0).unwrap_err();
        assert!(err.contains("gpu0/mig/gi1/ci0/access"), "{err}");
        // Another GPU's minor does not find this GPU's files.
        let err = mig_device_files(dir.path(), 1, 1, 0).unwrap_err();
        assert!(err.contains("gpu1/mig/gi1/access"), "{err}");
    }

    #[test]
    fn a_malformed_line_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let base = "driver/nvidia/capabilities/gpu0/mig/gi2";
        write_access(
            dir.path(),
            &format!("{base}/access"),
            "DeviceFileMinor: twelve\n",
        );
        let err = mig_device_files(dir.path(), 0, 2, 0).unwrap_err();
        assert!(
            err.contains("gi2/access") && err.contains("twelve"),
            "{err}"
        );

        write_access(
            dir.path(),
            &format!("{base}/access"),
            "DeviceFileMode: 292\n",
        );
        let err = mig_device_files(dir.path(), 0, 2, 0).unwrap_err();
        assert!(err.contains("no \"DeviceFileMinor:\" line"), "{err}");
    }
}
