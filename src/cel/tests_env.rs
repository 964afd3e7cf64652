//! The limits (length, nesting, runtime cost), the API server's environment and robustness against
//! odd input.

use std::time::{Duration, Instant};

use serde_json::json;

use super::tests::{eval, view};
use super::{CelError, Environment, FeatureGates, Selector, MAX_EXPRESSION_LENGTH};

/// Upstream's `expensive` case (`cel/compile_test.go`): 7 nested `all` over 10 elements.
const EXPENSIVE: &str = "[1, 2, 3, 4, 5, 6, 7, 8, 9, 10].all(x, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10].all(y, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10].all(z, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10].all(z2, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10].all(z3, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10].all(z4, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10].all(z5, int('1'.find('[0-9]*')) < 100)))))))";

const TYPICAL: &str = r#"device.driver == "gpu.dra.dev" && device.attributes["gpu.dra.dev"].type == "gpu" && device.capacity["gpu.dra.dev"].memory.compareTo(quantity("40Gi")) >= 0"#;

fn gpu() -> super::DeviceView {
    view(
        "gpu.dra.dev",
        json!({
            "attributes": {"type": {"string": "gpu"}, "ids": {"ints": [1, 2]}},
            "capacity": {"memory": {"value": "80Gi"}},
            "allowMultipleAllocations": true
        }),
    )
}

fn api(consumable_capacity: bool, list_type_attributes: bool) -> Environment {
    Environment::ApiServer(FeatureGates {
        consumable_capacity,
        list_type_attributes,
    })
}

#[test]
fn selector_is_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Selector>();
    assert_send_sync::<super::DeviceView>();
}

#[test]
fn expensive_expression_hits_the_runtime_cost_limit_quickly() {
    let selector = Selector::compile(EXPENSIVE).expect("compiles for the scheduler");
    let start = Instant::now();
    let got = selector.matches(&gpu());
    assert_eq!(
        got,
        Err(CelError::Runtime(
            "operation cancelled: actual cost limit exceeded".into()
        ))
    );
    // About 125,000 innermost iterations before the limit: ~2.5 s in a debug build, far less in release.
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "took {:?}",
        start.elapsed()
    );
    // The budget is per evaluation: the next one starts afresh.
    assert_eq!(
        Selector::compile(TYPICAL).and_then(|s| s.matches(&gpu())),
        Ok(true)
    );
    assert_eq!(selector.matches(&gpu()), got);
}

#[test]
fn cost_limit_is_not_absorbed_by_logical_operators() {
    let expression = format!("({EXPENSIVE}) || true");
    let got = eval(&expression, &gpu());
    assert!(
        matches!(&got, Err(CelError::Runtime(t)) if t.contains("actual cost limit exceeded")),
        "{got:?}"
    );
}

#[test]
fn map_filter_and_string_growth_are_charged() {
    let d = gpu();
    let lists = "lists.range(1000).map(a, lists.range(1000).filter(b, b > a).size()).size() > 0";
    let got = eval(lists, &d);
    assert!(
        matches!(&got, Err(CelError::Runtime(t)) if t.contains("actual cost limit exceeded")),
        "{got:?}"
    );
    let got = eval("lists.range(1000000000).size() > 0", &d);
    assert!(
        matches!(&got, Err(CelError::Runtime(t)) if t.contains("actual cost limit exceeded")),
        "{got:?}"
    );
    assert_eq!(eval("lists.range(1000).size() == 1000", &d), Ok(true));
    // Each bind makes the string ten times longer: 1e10 bytes at the end unless the budget stops it.
    let names = ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j"];
    let mut growth = "size(j) > 0".to_owned();
    for pair in names.windows(2).rev() {
        let ten = [pair[0]; 10].join(" + ");
        growth = format!("cel.bind({}, {ten}, {growth})", pair[1]);
    }
    let growth = format!("cel.bind(a, '0123456789', {growth})");
    let got = eval(&growth, &d);
    assert!(
        matches!(&got, Err(CelError::Runtime(t)) if t.contains("actual cost limit exceeded")),
        "{got:?}"
    );
}

#[test]
fn a_normal_selector_is_far_under_budget() {
    // Loops of a realistic size pass: 32 domains × 32 ids.
    let d = gpu();
    let expression = "lists.range(32).all(i, lists.range(32).all(j, i + j >= 0))";
    assert_eq!(eval(expression, &d), Ok(true));
    assert_eq!(eval(TYPICAL, &d), Ok(true));
}

#[test]
fn expression_length_is_limited() {
    let at_limit = format!("true{}", " ".repeat(MAX_EXPRESSION_LENGTH - 4));
    assert_eq!(eval(&at_limit, &gpu()), Ok(true));
    let over = format!("true{}", " ".repeat(MAX_EXPRESSION_LENGTH - 3));
    let got = eval(&over, &gpu());
    assert!(
        matches!(&got, Err(CelError::Compile(t)) if t.contains("10240")),
        "{got:?}"
    );
}

#[test]
fn nesting_is_limited_without_crashing() {
    let d = gpu();
    let nested = |n: usize| format!("{}true{}", "(".repeat(n), ")".repeat(n));
    assert_eq!(eval(&nested(200), &d), Ok(true));
    let lists = |n: usize| format!("size({}1{}) == 1", "[".repeat(n), "]".repeat(n));
    assert_eq!(eval(&lists(100), &d), Ok(true));
    for deep in [
        nested(100_000),
        lists(5_000),
        format!("{}true", "!".repeat(100_000)),
    ] {
        let got = eval(&deep, &d);
        assert!(matches!(got, Err(CelError::Compile(_))), "{got:?}");
    }
    // Chains that the parser nests without brackets: deep ones are rejected, not crashed on.
    let sum = |n: usize| format!("{}1 > 0", "1 + ".repeat(n));
    assert_eq!(eval(&sum(200), &d), Ok(true));
    let selects = format!("device{} == 1", ".a".repeat(2_000));
    for deep in [sum(2_000), selects] {
        let got = eval(&deep, &d);
        assert!(
            matches!(&got, Err(CelError::Compile(t)) if t.contains("recursion limit")),
            "{got:?}"
        );
    }
}

#[test]
fn odd_expressions_never_panic() {
    let d = gpu();
    let odd = [
        "",
        " ",
        "\"",
        "'abc",
        "\"\"\"x",
        "device.",
        "device.attributes[",
        "1 +",
        ")(",
        "{",
        "[1,",
        "9223372036854775808 > 0",
        "99999999999999999999999999 == 1",
        "-9223372036854775808 < 0",
        "device.attributes[1]",
        "device.attributes[1].x",
        "device[1]",
        "device['driver'] == ''",
        "1/0 == 1",
        "1 % 0 == 0",
        "\"a\" + 1 == 'a1'",
        "[1] + 'a' == []",
        "{1: 2}[3] == 2",
        "{null: 1}.size() == 1",
        "has(1)",
        "has(device)",
        "device.attributes.x.y.z",
        "dyn(1) == 1",
        "1.0 == 1",
        "1u == 1",
        "-(-9223372036854775807 - 1) > 0",
        "'x'.matches('(')",
        "b'\\xff' == b'\\xff'",
        "r'\\d' == '\\\\d'",
        "cel.bind(x)",
        "cel.bind(x, 1)",
        "cel.bind(x, 1, 2, 3)",
        "x.bind(y, 1, y)",
        "[].all(x, x)",
        "{}.exists(k, k)",
        "[1].map(x, y, x)",
        "optional.none().value()",
        "device.attributes[?'x'].orValue({}).size() == 0",
        "type(device) == int",
        "quantity(1)",
        "semver(\"1.0.0\", 1)",
        "'a'.substring(5) == ''",
        "lists.range(-1) == []",
        "\u{1F600} == 1",
        "device.driver.size() == 11 ? true : 1",
        "[1, 2][5] == 0",
        "'abc'[0] == 'a'",
        "Foo{a: 1}",
        "google.protobuf.Int64Value{value: 1} == 1",
    ];
    for expression in odd {
        // Any outcome is fine as long as it is a value or an error.
        let _ = eval(expression, &d);
        let _ = Selector::compile_in(expression, &api(false, false)).map(|s| s.matches(&d));
    }
}

#[test]
fn api_server_gates_fields_and_functions() {
    let d = gpu();
    let multi = "device.allowMultipleAllocations";
    let compile = |e: &str, env: &Environment| Selector::compile_in(e, env).map(|_| ());
    assert_eq!(
        compile(multi, &api(false, true)),
        Err(CelError::Compile(
            "undefined field 'allowMultipleAllocations'".into()
        ))
    );
    assert_eq!(compile(multi, &api(true, false)), Ok(()));
    assert_eq!(compile(multi, &Environment::Scheduler), Ok(()));
    let includes = r#"device.attributes["gpu.dra.dev"].type.includes("gpu")"#;
    assert_eq!(
        compile(includes, &api(true, false)),
        Err(CelError::Compile(
            "undeclared reference to 'includes'".into()
        ))
    );
    let selector =
        Selector::compile_in(includes, &api(false, true)).expect("compiles with the gate");
    assert_eq!(selector.matches(&d), Ok(true));
    let iterate = r#"device.attributes["gpu.dra.dev"].ids.exists(id, id == 1)"#;
    let got = compile(iterate, &api(true, false));
    assert!(
        matches!(&got, Err(CelError::Compile(t)) if t.contains("cannot be range of a comprehension")),
        "{got:?}"
    );
    assert_eq!(compile(iterate, &api(false, true)), Ok(()));
    // Iterating over the domains or ids themselves stays allowed.
    assert_eq!(
        compile(
            r#"device.attributes.exists_one(x, x == "gpu.dra.dev")"#,
            &api(false, false)
        ),
        Ok(())
    );
}

#[test]
fn api_server_estimates_cost() {
    let got = Selector::compile_in(EXPENSIVE, &api(true, true));
    assert!(
        matches!(&got, Err(CelError::Compile(t)) if t.contains("too complex, exceeds cost limit")),
        "{got:?}"
    );
    let typical = Selector::compile_in(TYPICAL, &api(true, true)).expect("typical selector");
    let cost = typical
        .estimated_cost()
        .expect("estimated in API-server mode");
    assert!(cost > 0 && cost < 100, "{cost}");
    assert_eq!(
        Selector::compile(TYPICAL).map(|s| s.estimated_cost()),
        Ok(None)
    );
    // A loop over a list attribute is charged its worst-case 64 elements.
    let loop_cost = Selector::compile_in(
        r#"device.attributes["d"].ids.exists(x, x > 0)"#,
        &api(true, true),
    )
    .ok()
    .and_then(|s| s.estimated_cost());
    assert!(
        loop_cost.is_some_and(|c| c > 64 * 3 && c < 64 * 20),
        "{loop_cost:?}"
    );
    // Nested loops over 64-element attributes stay under the limit; four levels do not.
    let nested = |n: usize| {
        let mut e = "true".to_owned();
        for i in 0..n {
            e = format!(r#"device.attributes["d"].ids.all(x{i}, {e})"#);
        }
        e
    };
    assert!(Selector::compile_in(&nested(2), &api(true, true)).is_ok());
    let got = Selector::compile_in(&nested(4), &api(true, true));
    assert!(
        matches!(&got, Err(CelError::Compile(t)) if t.contains("too complex")),
        "{got:?}"
    );
}

/// Evaluation rate over prepared devices; run with `cargo test --release -- --ignored --nocapture`.
#[test]
#[ignore]
fn evaluation_rate() {
    let d = gpu();
    for expression in [
        r#"device.driver == "gpu.dra.dev" && device.attributes["gpu.dra.dev"].type == "gpu""#,
        r#"device.capacity["gpu.dra.dev"].memory.compareTo(quantity("40Gi")) >= 0"#,
    ] {
        let selector = Selector::compile(expression).expect("compiles");
        let n = 1_000_000u32;
        let start = Instant::now();
        for _ in 0..n {
            assert_eq!(selector.matches(&d), Ok(true));
        }
        let rate = f64::from(n) / start.elapsed().as_secs_f64();
        eprintln!("{rate:.0} evaluations/s: {expression}");
    }
}

/// Upstream's `TestCELFeatureCombinations`: which feature-dependent expressions compile where.
#[test]
fn feature_combinations() {
    let scalar = r#"device.attributes["dra.example.com"].ready"#;
    let list = r#"device.attributes["dra.example.com"].ids.exists(id, id == 1)"#;
    let includes = r#"device.attributes["dra.example.com"].name.includes("fish")"#;
    let multi = "device.allowMultipleAllocations";
    let both = r#"device.allowMultipleAllocations && device.attributes["dra.example.com"].ids.exists(id, id == 1)"#;
    let d = view(
        "dra.example.com",
        json!({
            "attributes": {"ready": {"bool": true}, "ids": {"ints": [1, 2]}, "name": {"string": "fish"}},
            "allowMultipleAllocations": true
        }),
    );
    for (consumable, lists) in [(false, false), (true, false), (false, true), (true, true)] {
        let expectations = [
            (scalar, true),
            (list, lists),
            (includes, lists),
            (multi, consumable),
            (both, lists && consumable),
        ];
        for (expression, compiles) in expectations {
            let got = Selector::compile_in(expression, &api(consumable, lists));
            assert_eq!(
                got.is_ok(),
                compiles,
                "{expression} with {consumable}/{lists}: {got:?}"
            );
            if let Ok(selector) = got {
                assert_eq!(selector.matches(&d), Ok(true), "{expression}");
            }
            // The scheduler (StoredExpressions) ignores the gates.
            assert_eq!(eval(expression, &d), Ok(true), "{expression}");
        }
    }
}
