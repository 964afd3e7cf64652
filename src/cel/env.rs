//! The DRA CEL environment on the `cel` crate: the standard library, the strings and lists
//! extensions, the Kubernetes libraries, `cel.bind` and the cost-budget hook, built once per process.

use std::sync::{Arc, LazyLock};

use cel::common::ast::{ComprehensionExpr, Expr, IdedExpr, ListExpr, LiteralValue};
use cel::common::types::{DYN_TYPE, INT_TYPE};
use cel::parser::{Macro, MacroExprHelper, ParseError};
use cel::{DeclarationError, Env};

use super::values::{QUANTITY_TYPE, SEMVER_TYPE};
use super::{cost, library};

/// `cel.bind(name, value, body)` (cel-go `ext.Bindings`): `body` with `name` bound to `value`, as a
/// comprehension over no elements whose accumulator is `name`.
fn bind(
    helper: &mut MacroExprHelper<'_>,
    target: &mut Option<IdedExpr>,
    args: &mut Vec<IdedExpr>,
) -> Result<Option<IdedExpr>, ParseError> {
    if !matches!(target.as_ref().map(|t| &t.expr), Some(Expr::Ident(n)) if n == "cel") {
        return Ok(None);
    }
    let name = match args.first().map(|a| &a.expr) {
        Some(Expr::Ident(name)) => name.clone(),
        _ => {
            let id = args.first().map_or(0, |a| a.id);
            return Err(
                helper.new_error(id, "cel.bind() variable names must be simple identifiers")
            );
        }
    };
    let body = args.pop().unwrap_or_default();
    let init = args.pop().unwrap_or_default();
    let iter_range = helper.next_expr(Expr::List(ListExpr::new(Vec::new())));
    let loop_cond = helper.next_expr(Expr::Literal(LiteralValue::Boolean(false.into())));
    let loop_step = helper.next_expr(Expr::Ident(name.clone()));
    Ok(Some(helper.next_expr(Expr::Comprehension(Box::new(
        ComprehensionExpr {
            iter_range,
            iter_var: "#unused".to_owned(),
            iter_var2: None,
            accu_var: name,
            accu_init: init,
            loop_cond,
            loop_step,
            result: body,
        },
    )))))
}

fn build() -> Result<Env, DeclarationError> {
    let mut env = Env::stdlib();
    env.add_extension(cel::extensions::strings)?;
    env.add_extension(cel::extensions::lists)?;
    env.add_extension(library::register)?;
    env.add_type(QUANTITY_TYPE.to_owned())?;
    env.add_type(SEMVER_TYPE.to_owned())?;
    env.add_macro(Macro::receiver("bind", 3, bind))?;
    env.add_overload(
        cost::TICK,
        "dra_tick_dyn",
        vec![DYN_TYPE.to_owned()],
        cost::tick,
    )?;
    env.add_overload(
        cost::TICK,
        "dra_tick_dyn_int",
        vec![DYN_TYPE.to_owned(), INT_TYPE.to_owned()],
        cost::tick,
    )?;
    env.add_overload(
        cost::CHARGE_SIZE,
        "dra_charge_size_int",
        vec![INT_TYPE.to_owned()],
        cost::charge_size,
    )?;
    // cel-go keeps the last of duplicate map-literal keys.
    env.set_error_on_duplicate_map_keys(false);
    Ok(env)
}

static ENV: LazyLock<Result<Arc<Env>, String>> = LazyLock::new(|| {
    build()
        .map(Arc::new)
        .map_err(|e| format!("building the CEL environment: {e}"))
});

/// The shared environment (built on first use).
pub(crate) fn shared() -> Result<Arc<Env>, String> {
    ENV.clone()
}
