//! The DRA CEL environment as the scheduler evaluates device selectors (`k8s.io/dynamic-resource-
//! allocation/cel`): compile a selector once, with the scheduler's or the API server's rules, and
//! evaluate it against prepared devices under the runtime cost limit.

pub mod allocator;
mod check;
mod cost;
mod device;
mod env;
mod estimate;
pub mod eval;
pub mod extended_resources;
pub mod input;
mod library;
/// The crate's quantity type, where the CEL environment has always offered it.
pub use crate::quantity;
pub mod selectors;
pub mod semver;
mod shortcuts;
mod values;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_env;
#[cfg(test)]
mod tests_language;
#[cfg(test)]
mod tests_library;
#[cfg(test)]
mod tests_upstream;

use std::sync::Arc;

use cel::common::types::CelBool;
use cel::common::value::{CowVal, Val};
use cel::context::VariableResolver;
use cel::{Context, Env, ExecutionError, IdedExpr, Value};

pub use check::{DeviceMap, DeviceReference};
pub use device::DeviceView;

/// Kubernetes' limit on a selector expression (`CELSelectorExpressionMaxLength`).
pub const MAX_EXPRESSION_LENGTH: usize = 10 * 1024;
/// `CELSelectorExpressionMaxCost`: runtime limit in the scheduler, estimated limit in the API server.
pub const MAX_COST: u64 = 1_000_000;
/// Deepest bracket nesting and expression tree accepted; cel-go's parser default
/// (`parser.MaxRecursionDepth`) is 250.
pub const MAX_RECURSION_DEPTH: u16 = 250;

/// Stack for compiling: the parser recurses deeply per nesting level (about 100 KiB per nested list
/// in debug builds), so compiling runs on a thread of its own with this much (reserved, not committed).
const COMPILE_STACK: usize = 256 << 20;
/// Evaluations of expressions nested deeper than this (after instrumentation) run on a thread with
/// [`COMPILE_STACK`]; shallower ones, i.e. every realistic selector, run on the caller's thread.
const INLINE_EVAL_DEPTH: usize = 32;

/// Appended by the scheduler to every "no such key" error (`cel/errors.go`).
const NO_SUCH_KEY_HINT: &str =
    "consider using CEL optional chaining (.? followed by orValue()) or guarding the check with has() for optional fields";

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CelError {
    #[error("compile error: {0}")]
    Compile(String),
    #[error("runtime error: {0}")]
    Runtime(String),
}

/// Which environment compiles: the scheduler's (StoredExpressions: every field and function) or the
/// API server's rules for a new or changed selector.
#[derive(Debug, Clone, Default)]
pub enum Environment {
    #[default]
    Scheduler,
    ApiServer(FeatureGates),
}

/// The API server's feature gates that change the DRA CEL environment.
#[derive(Debug, Clone, Copy, Default)]
pub struct FeatureGates {
    /// `DRAConsumableCapacity`: declares `device.allowMultipleAllocations`.
    pub consumable_capacity: bool,
    /// `DRAListTypeAttributes`: list attributes and `includes()`.
    pub list_type_attributes: bool,
}

/// A compiled selector. It is `Send + Sync` and cheap to evaluate many times: the parsed and
/// instrumented expression is kept, and each evaluation only builds a small `Context`.
pub struct Selector {
    expression: String,
    program: IdedExpr,
    constants: Vec<Box<dyn Val>>,
    estimated_cost: Option<u64>,
    depth: usize,
    references: Vec<DeviceReference>,
    env: Arc<Env>,
}

impl std::fmt::Debug for Selector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Selector")
            .field("expression", &self.expression)
            .field("estimated_cost", &self.estimated_cost)
            .finish_non_exhaustive()
    }
}

/// The variables of one evaluation: `device` and the pre-parsed constants.
struct Variables<'a> {
    device: &'a dyn Val,
    constants: &'a [Box<dyn Val>],
}

impl VariableResolver for Variables<'_> {
    fn resolve<'b>(&'b self, variable: &str) -> Option<CowVal<'b, 'b>> {
        if variable == "device" {
            return Some(CowVal::Borrowed(self.device));
        }
        let index: usize = variable.strip_prefix(cost::CONST_PREFIX)?.parse().ok()?;
        self.constants
            .get(index)
            .map(|c| CowVal::Borrowed(c.as_ref()))
    }
}

fn parse_errors(errors: cel::ParseErrors) -> CelError {
    let text = errors
        .errors
        .iter()
        .map(|e| e.msg.clone())
        .collect::<Vec<_>>()
        .join("; ");
    CelError::Compile(format!("Syntax error: {text}"))
}

/// The scheduler's text for an evaluation error.
fn runtime_error(error: ExecutionError) -> CelError {
    let text = match error {
        ExecutionError::NoSuchKey(key) => format!("no such key: {key}. {NO_SUCH_KEY_HINT}"),
        ExecutionError::FunctionError { message, .. } => message,
        other => other.to_string(),
    };
    CelError::Runtime(text)
}

impl Selector {
    /// Compiles `expression` for the scheduler (`Environment::Scheduler`).
    pub fn compile(expression: &str) -> Result<Selector, CelError> {
        Self::compile_in(expression, &Environment::Scheduler)
    }

    /// Compiles `expression` in `environment`: length limit, parse, static checks and, for the API
    /// server, the estimated cost limit.
    pub fn compile_in(expression: &str, environment: &Environment) -> Result<Selector, CelError> {
        if expression.len() > MAX_EXPRESSION_LENGTH {
            return Err(CelError::Compile(format!(
                "expression is {} bytes long, more than the limit of {MAX_EXPRESSION_LENGTH}",
                expression.len()
            )));
        }
        let (expression, environment) = (expression.to_owned(), environment.clone());
        let compiler = std::thread::Builder::new()
            .name("cel-compile".to_owned())
            .stack_size(COMPILE_STACK)
            .spawn(move || Self::compile_here(&expression, &environment))
            .map_err(|e| CelError::Compile(format!("starting the compiler thread: {e}")))?;
        compiler
            .join()
            .unwrap_or_else(|_| Err(CelError::Compile("the compiler thread panicked".to_owned())))
    }

    fn compile_here(expression: &str, environment: &Environment) -> Result<Selector, CelError> {
        if expression.len() > MAX_EXPRESSION_LENGTH {
            return Err(CelError::Compile(format!(
                "expression is {} bytes long, more than the limit of {MAX_EXPRESSION_LENGTH}",
                expression.len()
            )));
        }
        let env = env::shared().map_err(CelError::Compile)?;
        let parsed = parse(&env, expression)?;
        if depth(&parsed) > usize::from(MAX_RECURSION_DEPTH) {
            return Err(CelError::Compile(format!(
                "expression recursion limit exceeded: {MAX_RECURSION_DEPTH}"
            )));
        }
        let gates = match environment {
            Environment::Scheduler => None,
            Environment::ApiServer(gates) => Some(*gates),
        };
        check::Checker::new(gates)
            .check(&parsed)
            .map_err(CelError::Compile)?;
        if let Some(t) = check::non_bool_result(&parsed) {
            return Err(CelError::Compile(format!(
                "must evaluate to bool or the unknown type, not {t}"
            )));
        }
        let estimated_cost = match environment {
            Environment::Scheduler => None,
            Environment::ApiServer(_) => {
                let cost = estimate::estimate(&parsed);
                if cost > MAX_COST {
                    return Err(CelError::Compile(format!(
                        "too complex, exceeds cost limit: estimated cost {cost}, limit {MAX_COST}"
                    )));
                }
                Some(cost)
            }
        };
        let references = check::device_references(&parsed);
        let instrumented = cost::instrument(parsed);
        let program = shortcuts::index_device_fields(instrumented.expr);
        Ok(Selector {
            expression: expression.to_owned(),
            references,
            depth: depth(&program),
            program,
            constants: instrumented.constants,
            estimated_cost,
            env,
        })
    }

    /// The source text.
    pub fn expression(&self) -> &str {
        &self.expression
    }

    /// The literal attribute and capacity lookups of the expression (domains, and names in them).
    pub fn references(&self) -> &[DeviceReference] {
        &self.references
    }

    /// Evaluates the selector against `device`: `Ok(true)` / `Ok(false)` for match / no match, and
    /// only `CelError::Runtime` otherwise.
    pub fn matches(&self, device: &DeviceView) -> Result<bool, CelError> {
        if self.depth <= INLINE_EVAL_DEPTH {
            return self.evaluate(device);
        }
        std::thread::scope(|scope| {
            let evaluation = std::thread::Builder::new()
                .name("cel-eval".to_owned())
                .stack_size(COMPILE_STACK)
                .spawn_scoped(scope, || self.evaluate(device))
                .map_err(|e| CelError::Runtime(format!("starting the evaluation thread: {e}")))?;
            evaluation.join().unwrap_or_else(|_| {
                Err(CelError::Runtime(
                    "the evaluation thread panicked".to_owned(),
                ))
            })
        })
    }

    fn evaluate(&self, device: &DeviceView) -> Result<bool, CelError> {
        let device_val = device
            .value
            .as_ref()
            .map_err(|e| CelError::Runtime(e.clone()))?;
        let variables = Variables {
            device: device_val,
            constants: &self.constants,
        };
        let mut context = Context::with_env(self.env.clone());
        context.set_variable_resolver(&variables);
        let budget = cost::Budget::start(MAX_COST);
        let result = Value::resolve_val(&self.program, &context);
        if budget.exceeded() {
            return Err(CelError::Runtime(cost::COST_EXCEEDED.to_owned()));
        }
        let value = result.map_err(runtime_error)?;
        match value.downcast_ref::<CelBool>() {
            Some(b) => Ok(*b.inner()),
            None => Err(CelError::Runtime(format!(
                "CEL result of type {} could not be converted to bool",
                value.get_type().name()
            ))),
        }
    }

    /// The API server's estimated worst-case cost (computed in `Environment::ApiServer` only; `None`
    /// for the scheduler, which does not estimate either).
    pub fn estimated_cost(&self) -> Option<u64> {
        self.estimated_cost
    }
}

/// The depth of the expression tree (its evaluation recurses this deep).
fn depth(expr: &IdedExpr) -> usize {
    let mut deepest = 0;
    check::for_each_child(expr, &mut |child| deepest = deepest.max(depth(child)));
    deepest + 1
}

/// Parses with the environment's macros and cel-go's recursion limit.
fn parse(env: &Env, expression: &str) -> Result<IdedExpr, CelError> {
    if nesting_depth(expression) > usize::from(MAX_RECURSION_DEPTH) {
        return Err(CelError::Compile(format!(
            "expression nests deeper than the limit of {MAX_RECURSION_DEPTH}"
        )));
    }
    env.parser()
        .max_recursion_depth(MAX_RECURSION_DEPTH)
        .parse(expression)
        .map_err(parse_errors)
}

/// The deepest nesting of brackets outside string literals: checked before parsing, so that the
/// parser never recurses deep enough to exhaust the stack.
fn nesting_depth(expression: &str) -> usize {
    let (mut depth, mut max) = (0usize, 0usize);
    let mut quote: Option<u8> = None;
    let mut escaped = false;
    for &b in expression.as_bytes() {
        match quote {
            Some(q) => {
                if escaped {
                    escaped = false;
                } else if b == b'\\' {
                    escaped = true;
                } else if b == q {
                    quote = None;
                }
            }
            None => match b {
                b'"' | b'\'' => quote = Some(b),
                b'(' | b'[' | b'{' => {
                    depth += 1;
                    max = max.max(depth);
                }
                b')' | b']' | b'}' => depth = depth.saturating_sub(1),
                _ => {}
            },
        }
    }
    max
}
