//! `gpu-dra cel eval`: one expression against one device read from a file, with the exit codes of the
//! contract in DESIGN.md (0 true or false, 2 compile error, 3 runtime error).

use std::path::Path;

use k8s_openapi::api::resource::v1::Device;

use super::{CelError, DeviceView, Environment, Selector};

/// Why `cel eval` has no true or false to print.
#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    #[error("device file {path}: {reason}")]
    DeviceFile { path: String, reason: String },
    #[error(transparent)]
    Cel(#[from] CelError),
}

impl EvalError {
    /// The process exit code: 2 for a compile error, 3 for a runtime error, 1 for an unreadable device.
    pub fn exit_code(&self) -> i32 {
        match self {
            EvalError::Cel(CelError::Compile(_)) => 2,
            EvalError::Cel(CelError::Runtime(_)) => 3,
            EvalError::DeviceFile { .. } => 1,
        }
    }
}

/// Reads one device in the JSON (or YAML) shape of a `resource.k8s.io/v1` Device.
pub fn read_device(path: &Path) -> Result<Device, EvalError> {
    let failed = |reason: String| EvalError::DeviceFile {
        path: path.display().to_string(),
        reason,
    };
    let text = std::fs::read_to_string(path).map_err(|e| failed(e.to_string()))?;
    // YAML is a superset of JSON, and its errors name line and column.
    let device: Device = serde_yaml::from_str(&text).map_err(|e| failed(e.to_string()))?;
    // k8s-openapi fills a missing required field with its default; a device without a name is a mistake.
    if device.name.is_empty() {
        return Err(failed("missing field `name`".to_string()));
    }
    Ok(device)
}

/// Evaluates `expression` on the device in `path` as the scheduler would for a device of `driver`
/// (which also gives unqualified attribute names their domain).
pub fn eval_file(
    path: &Path,
    driver: &str,
    expression: &str,
    environment: &Environment,
) -> Result<bool, EvalError> {
    // A compile error does not depend on the device, so it is reported first.
    let selector = Selector::compile_in(expression, environment)?;
    let device = read_device(path)?;
    Ok(selector.matches(&DeviceView::new(driver, &device))?)
}
