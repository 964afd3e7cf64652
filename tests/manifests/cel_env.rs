//! The CEL environment the admission policies run in: the `cel` crate's standard library plus the few
//! functions of Kubernetes' CEL library that the policies call (`isQuantity`, `quantity`,
//! `<Quantity>.asApproximateFloat()`, `<list>.min()`), and objects handed to CEL as the API server hands
//! them. A quantity is its approximate value as a double here, where Kubernetes has a Quantity type;
//! e2e/least-privilege.sh and e2e/config-admission.sh check the policies against the real thing.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::{Arc, OnceLock};

use cel::common::types::{CelBool, CelDouble, CelString, LIST_TYPE};
use cel::common::value::CowVal;
use cel::{Context, Env, ExecutionError};
use regex::Regex;
use serde_json::Value as Json;

pub fn compile(expression: &str) -> Result<cel::Program, String> {
    kubernetes()
        .compile(expression)
        .map_err(|e| format!("{expression}: {e}"))
}

/// What an admission expression sees: `request`, `object`, `oldObject`, `params`, and `variables` as they
/// are defined.
pub struct Bindings {
    top: Vec<(&'static str, cel::Value)>,
    variables: HashMap<String, cel::Value>,
}

impl Bindings {
    pub fn new<const N: usize>(top: [(&'static str, Json); N]) -> Self {
        Bindings {
            top: top
                .iter()
                .map(|(name, value)| (*name, to_cel(value)))
                .collect(),
            variables: HashMap::new(),
        }
    }

    pub fn set_variable(&mut self, name: &str, value: cel::Value) {
        self.variables.insert(name.to_string(), value);
    }

    pub fn evaluate(&self, expression: &str) -> Result<cel::Value, String> {
        // A policy's expressions run for every request of a test: compile each once per thread.
        thread_local! {
            static PROGRAMS: RefCell<HashMap<String, Rc<cel::Program>>> = RefCell::new(HashMap::new());
        }
        let cached = PROGRAMS.with(|programs| programs.borrow().get(expression).cloned());
        let program = match cached {
            Some(program) => program,
            None => {
                let program = Rc::new(compile(expression)?);
                PROGRAMS.with(|programs| {
                    programs
                        .borrow_mut()
                        .insert(expression.to_string(), program.clone())
                });
                program
            }
        };
        let mut context = Context::with_env(kubernetes());
        for (name, value) in &self.top {
            context.add_variable_from_value(*name, value.clone());
        }
        context
            .add_variable_from_value("variables", cel::Value::Map(self.variables.clone().into()));
        program
            .execute(&context)
            .map_err(|e| format!("{expression}: {e}"))
    }
}

/// JSON as the API server hands it to CEL: a number that is a whole int64 is an `int` (never a `uint`, and
/// `50.0` too), any other a `double`.
fn to_cel(value: &Json) -> cel::Value {
    match value {
        Json::Null => cel::Value::Null,
        Json::Bool(b) => cel::Value::Bool(*b),
        Json::Number(n) => match (n.as_i64(), n.as_f64()) {
            (Some(i), _) => cel::Value::Int(i),
            (None, Some(f)) if f.fract() == 0.0 && f.abs() < i64::MAX as f64 => {
                cel::Value::Int(f as i64)
            }
            (None, f) => cel::Value::Float(f.unwrap_or(f64::NAN)),
        },
        Json::String(s) => cel::Value::String(Arc::new(s.clone())),
        Json::Array(items) => cel::Value::List(Arc::new(items.iter().map(to_cel).collect())),
        Json::Object(object) => cel::Value::Map(
            object
                .iter()
                .map(|(k, v)| (k.clone(), to_cel(v)))
                .collect::<HashMap<_, _>>()
                .into(),
        ),
    }
}

/// The environment, built once: every evaluation needs it.
fn kubernetes() -> Arc<Env> {
    static ENV: OnceLock<Arc<Env>> = OnceLock::new();
    ENV.get_or_init(|| Arc::new(build())).clone()
}

fn build() -> Env {
    let mut env = Env::stdlib();
    cel::add_overload!(env, fn is_quantity: (CelString) -> CelBool).expect("isQuantity");
    cel::add_overload!(env, fn quantity: (CelString) -> Result<CelDouble>).expect("quantity");
    cel::add_member_overload!(env, fn as_approximate_float: (CelDouble) -> CelDouble)
        .expect("asApproximateFloat");
    env.add_member_overload("min", "list.min()", LIST_TYPE, vec![], min)
        .expect("min");
    env
}

/// Kubernetes' quantity syntax (`k8s.io/apimachinery/pkg/api/resource`): a signed decimal number, then a
/// binary suffix (`Ki`..`Ei`), a decimal one (`n`..`E`) or an exponent (`e3`).
fn parts(text: &str) -> Option<(f64, f64)> {
    static SYNTAX: OnceLock<Regex> = OnceLock::new();
    let syntax = SYNTAX.get_or_init(|| {
        Regex::new(r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(?:([eE][+-]?[0-9]+)|([KMGTPE]i)|([numkMGTPE]))?$")
            .expect("a valid regex")
    });
    let captures = syntax.captures(text)?;
    let number: f64 = captures[1].parse().ok()?;
    let multiplier = if let Some(exponent) = captures.get(2) {
        10f64.powi(exponent.as_str()[1..].parse().ok()?)
    } else if let Some(binary) = captures.get(3) {
        let power = "KMGTPE".find(&binary.as_str()[..1])? as i32 + 1;
        2f64.powi(10 * power)
    } else if let Some(decimal) = captures.get(4) {
        let power = "num kMGTPE".find(decimal.as_str())? as i32 - 3;
        10f64.powi(3 * power)
    } else {
        1.0
    };
    Some((number, multiplier))
}

fn is_quantity(text: &CelString<'_>) -> CelBool {
    CelBool::from(parts(text.inner()).is_some())
}

fn quantity(text: &CelString<'_>) -> Result<CelDouble, ExecutionError> {
    let (number, multiplier) = parts(text.inner()).ok_or_else(|| {
        ExecutionError::function_error("quantity", "quantities must match the regular expression")
    })?;
    // Kubernetes caps a quantity at 2^63 - 1.
    Ok(CelDouble::from((number * multiplier).min(i64::MAX as f64)))
}

fn as_approximate_float(value: &CelDouble) -> CelDouble {
    *value
}

/// The smallest string of a list of strings (all the policies need).
fn min<'b, 'v>(args: Vec<CowVal<'b, 'v>>) -> Result<CowVal<'b, 'v>, ExecutionError> {
    let list = args
        .first()
        .and_then(|list| list.as_ref().as_iterable())
        .ok_or_else(|| ExecutionError::function_error("min", "not a list"))?;
    let mut items = list.iter();
    let mut smallest: Option<String> = None;
    while let Some(item) = items.next() {
        let text = item
            .downcast_ref::<CelString>()
            .ok_or_else(|| ExecutionError::function_error("min", "only lists of strings here"))?
            .inner();
        if smallest.as_deref().is_none_or(|s| text < s) {
            smallest = Some(text.to_string());
        }
    }
    let smallest =
        smallest.ok_or_else(|| ExecutionError::function_error("min", "the list is empty"))?;
    Ok(CowVal::owned(CelString::from(smallest)))
}

#[test]
fn quantities_read_as_kubernetes_reads_them() {
    let value = |text: &str| parts(text).map(|(n, m)| n * m);
    assert_eq!(value("10Gi"), Some(10.0 * 1024.0 * 1024.0 * 1024.0));
    assert_eq!(value("1.5Ki"), Some(1536.0));
    assert_eq!(value("1k"), Some(1000.0));
    assert_eq!(value("1e3"), Some(1000.0));
    assert_eq!(value("100m"), Some(0.1));
    assert_eq!(value("-1"), Some(-1.0));
    for bad in ["", " 1", "1 Gi", "Gi", "1GB", "1.2.3", "0x10", "1Ki "] {
        assert_eq!(value(bad), None, "{bad:?}");
    }
}
