//! A compile-time rewrite that makes evaluation cheaper without changing any value, error or cost:
//! field selections on `device` become indexing with the field's name.
//!
//! The crate evaluates `device.driver` as a qualified name on every evaluation: it allocates the
//! segments and their dotted join, and looks `device.driver` up as a variable and as a type before it
//! tries `device`; a selection on any other operand (`device.attributes[d].type`) also allocates its
//! list of segments first. `device["driver"]` resolves the identifier alone and indexes with a
//! literal. The rewrite runs after the cost instrumentation, so the charges are those of the source.

use cel::common::ast::{operators, CallExpr, Expr, IdedExpr, LiteralValue};

use super::check::{for_each_child, for_each_child_mut};

/// Rewrites `device.f` to `device["f"]`, and `device.attributes[d].f` / `device.capacity[d].f` to
/// `device.attributes[d]["f"]`. Where that is the same:
/// - `device` is the device object, whose fields selecting and indexing both read through its
///   `Indexer::get`. An expression in which a comprehension or `cel.bind` binds the name `device` is
///   left as it is.
/// - `device.attributes[d]` is always a map (a domain the device lacks reads as an empty map), and on
///   a map selecting `.f` and indexing `["f"]` both call the map's `Indexer::get` with the string
///   `f`; its one error, no such key, is passed on unchanged by both.
///
/// Presence tests (`has(device.driver)`) and optional selections (`.?f`) are not rewritten.
pub(crate) fn index_device_fields(mut expr: IdedExpr) -> IdedExpr {
    if binds_device(&expr) {
        return expr;
    }
    let mut next_id = max_id(&expr);
    rewrite(&mut expr, &mut next_id);
    expr
}

fn rewrite(expr: &mut IdedExpr, next_id: &mut u64) {
    for_each_child_mut(expr, &mut |child| rewrite(child, next_id));
    let Expr::Select(select) = &mut expr.expr else {
        return;
    };
    if select.test || !(is_device(&select.operand) || is_domain_map(&select.operand)) {
        return;
    }
    *next_id += 1;
    let name = IdedExpr {
        id: *next_id,
        expr: Expr::Literal(LiteralValue::String(
            std::mem::take(&mut select.field).into(),
        )),
    };
    let operand = std::mem::take(&mut *select.operand);
    expr.expr = Expr::Call(CallExpr {
        func_name: operators::INDEX.to_owned(),
        target: None,
        args: vec![operand, name],
    });
}

fn is_device(expr: &IdedExpr) -> bool {
    matches!(&expr.expr, Expr::Ident(name) if name == "device")
}

/// `device["attributes"][d]` or `device["capacity"][d]` (as already rewritten, children first).
fn is_domain_map(expr: &IdedExpr) -> bool {
    let Expr::Call(call) = &expr.expr else {
        return false;
    };
    if call.func_name != operators::INDEX || call.target.is_some() || call.args.len() != 2 {
        return false;
    }
    let Expr::Call(inner) = &call.args[0].expr else {
        return false;
    };
    inner.func_name == operators::INDEX
        && inner.target.is_none()
        && inner.args.len() == 2
        && is_device(&inner.args[0])
        && matches!(&inner.args[1].expr, Expr::Literal(LiteralValue::String(field))
            if field.inner() == "attributes" || field.inner() == "capacity")
}

/// Whether a comprehension (a macro or `cel.bind`) anywhere in `expr` binds the name `device`.
fn binds_device(expr: &IdedExpr) -> bool {
    if let Expr::Comprehension(c) = &expr.expr {
        let device = Some("device");
        if [
            Some(c.iter_var.as_str()),
            c.iter_var2.as_deref(),
            Some(c.accu_var.as_str()),
        ]
        .contains(&device)
        {
            return true;
        }
    }
    let mut found = false;
    for_each_child(expr, &mut |child| found = found || binds_device(child));
    found
}

fn max_id(expr: &IdedExpr) -> u64 {
    let mut max = expr.id;
    for_each_child(expr, &mut |child| max = max.max(max_id(child)));
    max
}

#[cfg(test)]
mod tests {
    use super::super::tests::{gpu, view};
    use super::super::{cost, env, parse, DeviceView, Selector};
    use serde_json::json;

    /// `expression` compiled as usual, and with the instrumented program left as it was.
    fn rewritten_and_general(expression: &str) -> (Selector, Selector) {
        let rewritten = Selector::compile(expression).expect("compiles");
        let mut general = Selector::compile(expression).expect("compiles");
        let env = env::shared().expect("environment");
        let instrumented = cost::instrument(parse(&env, expression).expect("parses"));
        general.program = instrumented.expr;
        general.constants = instrumented.constants;
        (rewritten, general)
    }

    #[test]
    fn indexing_device_fields_gives_the_same_results_and_errors() {
        let devices: Vec<DeviceView> = vec![
            gpu(),
            view("gpu.dra.dev", json!({})),
            view(
                "gpu.dra.dev",
                json!({"attributes": {"type": {"string": "mig"}},
                       "capacity": {"memory": {"value": "80Gi"}}}),
            ),
        ];
        let expressions = [
            r#"device.driver == "dra.example.com""#,
            r#"device.allowMultipleAllocations"#,
            r#"device.attributes["dra.example.com"].name == "fish""#,
            r#"device.attributes["gpu.dra.dev"].type == "mig""#,
            r#"device.attributes["dra.example.com"].nosuch == 1"#,
            r#"device.attributes["no.such.domain"].name == "fish""#,
            r#"device.attributes["dra.example.com"].count > 2"#,
            r#"device.attributes["dra.example.com"]["name"] == "fish""#,
            r#"device.attributes["other.example.com"].name.startsWith("b") || device.attributes["dra.example.com"].nosuch"#,
            r#"device.attributes["dra.example.com"].nosuch || true"#,
            r#"device.capacity["gpu.dra.dev"].memory.compareTo(quantity("40Gi")) >= 0"#,
            r#"device.capacity["dra.example.com"].memory.isGreaterThan(quantity("1Gi"))"#,
            r#"has(device.attributes["dra.example.com"].name) && !has(device.attributes.nodomain.name)"#,
            r#"size(device.attributes) >= 1 && "dra.example.com" in device.attributes"#,
            r#"device.attributes["dra.example.com"].?name.orValue("") == "fish""#,
            r#"device.attributes["dra.example.com"].exists(k, k == "name")"#,
            r#"cel.bind(a, device.attributes["dra.example.com"], a.name == "fish")"#,
            r#"device.attributes["dra.example.com"].version.isGreaterThan(semver("1.0.0"))"#,
            r#"device.attributes["dra.example.com"].names.exists(n, n == device.attributes["dra.example.com"].name)"#,
        ];
        for expression in expressions {
            let (rewritten, general) = rewritten_and_general(expression);
            assert_ne!(
                rewritten.program, general.program,
                "{expression}: not rewritten"
            );
            for (i, device) in devices.iter().enumerate() {
                assert_eq!(
                    rewritten.matches(device),
                    general.matches(device),
                    "{expression} on device {i}"
                );
            }
        }
    }

    #[test]
    fn device_bound_by_a_macro_is_not_rewritten() {
        for expression in [
            r#"[1].all(device, device > 0) && device.driver == "dra.example.com""#,
            r#"cel.bind(device, 1, device == 1)"#,
            r#"has(device.driver)"#,
        ] {
            let (rewritten, general) = rewritten_and_general(expression);
            assert_eq!(rewritten.program, general.program, "{expression}");
            assert_eq!(rewritten.matches(&gpu()), general.matches(&gpu()));
        }
    }
}
