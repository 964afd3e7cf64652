//! The DRA CEL environment with the scheduler's semantics (selectors of DeviceClasses and claims), the
//! selector checks and the allocation simulator that `gpu-dra cel` and `gpu-dra selectors` are built on.

pub mod allocator;
pub mod quantity;
mod subset;

use k8s_openapi::api::resource::v1::Device;

/// Kubernetes' limit on a selector expression (`CELSelectorExpressionMaxLength`).
pub const MAX_EXPRESSION_LENGTH: usize = 10 * 1024;
/// `CELSelectorExpressionMaxCost`: the runtime limit in the scheduler, the estimated one in the API server.
pub const MAX_COST: u64 = 1_000_000;

/// Why a selector gave no answer. Neither is "no match": in the scheduler both abort allocation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CelError {
    #[error("compile error: {0}")]
    Compile(String),
    #[error("runtime error: {0}")]
    Runtime(String),
}

/// Which environment compiles: the scheduler's (stored expressions: every field and function) or the
/// API server's rules for a new or changed selector.
#[derive(Debug, Clone, Default)]
pub enum Environment {
    #[default]
    Scheduler,
    ApiServer(FeatureGates),
}

#[derive(Debug, Clone, Copy, Default)]
pub struct FeatureGates {
    pub consumable_capacity: bool,
    pub list_type_attributes: bool,
}

/// A compiled selector expression.
#[derive(Debug, Clone)]
pub struct Selector {
    expression: String,
    inner: subset::Selector,
}

impl Selector {
    pub fn compile(expression: &str) -> Result<Selector, CelError> {
        Selector::compile_in(expression, &Environment::Scheduler)
    }

    pub fn compile_in(expression: &str, _environment: &Environment) -> Result<Selector, CelError> {
        let inner = subset::Selector::compile(expression).map_err(CelError::Compile)?;
        Ok(Selector {
            expression: expression.to_string(),
            inner,
        })
    }

    pub fn expression(&self) -> &str {
        &self.expression
    }

    pub fn matches(&self, device: &DeviceView) -> Result<bool, CelError> {
        self.inner
            .matches(&device.driver, &device.device)
            .map_err(CelError::Runtime)
    }

    pub fn estimated_cost(&self) -> Option<u64> {
        None
    }
}

/// One device as a selector sees it, converted once.
#[derive(Debug, Clone)]
pub struct DeviceView {
    driver: String,
    device: Device,
}

impl DeviceView {
    pub fn new(driver: &str, device: &Device) -> DeviceView {
        DeviceView {
            driver: driver.to_string(),
            device: device.clone(),
        }
    }
}
