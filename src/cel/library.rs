//! The Kubernetes CEL libraries of the DRA environment, ported onto the `cel` crate: quantity and
//! semver (`k8s.io/apiserver/pkg/cel/library/{quantity,semverlib}.go`), the list functions
//! (`lists.go`), `find` / `findAll` (`regex.go`), DRA's `includes` and the `sets` extension.

use std::cell::RefCell;
use std::cmp::Ordering;
use std::collections::HashMap;
use std::sync::Arc;

use cel::common::types::{
    CelBool, CelDouble, CelInt, CelList, CelString, Type, BOOL_TYPE, DYN_TYPE, INT_TYPE, LIST_TYPE,
    STRING_TYPE,
};
use cel::common::value::{CowVal, FromVal, Val};
use cel::{DeclarationError, Env, ExecutionError};
use regex::Regex;

use super::semver::Semver;
use super::values::{QuantityVal, SemverVal, QUANTITY_TYPE, SEMVER_TYPE};
use crate::quantity::Quantity;

/// Most values a list attribute may hold (`ResourceSliceMaxAttributeValuesPerDevice`).
pub const INCLUDES_MAX_LIST: usize = 48;

type Args<'b, 'v> = Vec<CowVal<'b, 'v>>;
type Ret<'b, 'v> = Result<CowVal<'b, 'v>, ExecutionError>;

/// Argument `i` as `T`; the dispatcher only calls an overload with matching types, so a mismatch is a
/// defensive error, not a panic.
fn arg<'a, 'b, 'v, T: FromVal<'a, 'v> + Val>(
    args: &'a Args<'b, 'v>,
    i: usize,
) -> Result<&'a T, ExecutionError> {
    let value = args
        .get(i)
        .ok_or_else(|| ExecutionError::invalid_argument_count(i + 1, args.len()))?;
    value
        .as_ref()
        .downcast_ref::<T>()
        .ok_or_else(|| ExecutionError::UnexpectedType {
            got: value.get_type().name().to_owned(),
            want: T::cel_type().name().to_owned(),
        })
}

fn owned<'b, 'v, T: Val + 'v>(value: T) -> Ret<'b, 'v> {
    Ok(CowVal::owned(value))
}

fn quantity_arg<'a>(args: &'a Args<'_, '_>, i: usize) -> Result<&'a Quantity, ExecutionError> {
    arg::<QuantityVal>(args, i).map(|q| &q.0)
}

fn semver_arg<'a>(args: &'a Args<'_, '_>, i: usize) -> Result<&'a Semver, ExecutionError> {
    arg::<SemverVal>(args, i).map(|v| &v.0)
}

fn ordering(o: Ordering) -> i64 {
    match o {
        Ordering::Less => -1,
        Ordering::Equal => 0,
        Ordering::Greater => 1,
    }
}

// ---- quantity ----

fn quantity<'b, 'v>(args: Args<'b, 'v>) -> Ret<'b, 'v> {
    let text = arg::<CelString>(&args, 0)?.inner();
    Quantity::parse(text)
        .map(|q| CowVal::owned(QuantityVal(q)))
        .map_err(|e| ExecutionError::function_error("quantity", e))
}

fn is_quantity<'b, 'v>(args: Args<'b, 'v>) -> Ret<'b, 'v> {
    let text = arg::<CelString>(&args, 0)?.inner();
    owned(CelBool::from(Quantity::parse(text).is_ok()))
}

fn q_compare_to<'b, 'v>(args: Args<'b, 'v>) -> Ret<'b, 'v> {
    let o = quantity_arg(&args, 0)?.cmp(quantity_arg(&args, 1)?);
    owned(CelInt::from(ordering(o)))
}

fn q_greater<'b, 'v>(args: Args<'b, 'v>) -> Ret<'b, 'v> {
    owned(CelBool::from(
        quantity_arg(&args, 0)? > quantity_arg(&args, 1)?,
    ))
}

fn q_less<'b, 'v>(args: Args<'b, 'v>) -> Ret<'b, 'v> {
    owned(CelBool::from(
        quantity_arg(&args, 0)? < quantity_arg(&args, 1)?,
    ))
}

fn q_add<'b, 'v>(args: Args<'b, 'v>) -> Ret<'b, 'v> {
    owned(QuantityVal(
        quantity_arg(&args, 0)?.add(quantity_arg(&args, 1)?),
    ))
}

fn q_add_int<'b, 'v>(args: Args<'b, 'v>) -> Ret<'b, 'v> {
    let rhs = Quantity::from_int(*arg::<CelInt>(&args, 1)?.inner());
    owned(QuantityVal(quantity_arg(&args, 0)?.add(&rhs)))
}

fn q_sub<'b, 'v>(args: Args<'b, 'v>) -> Ret<'b, 'v> {
    owned(QuantityVal(
        quantity_arg(&args, 0)?.sub(quantity_arg(&args, 1)?),
    ))
}

fn q_sub_int<'b, 'v>(args: Args<'b, 'v>) -> Ret<'b, 'v> {
    let rhs = Quantity::from_int(*arg::<CelInt>(&args, 1)?.inner());
    owned(QuantityVal(quantity_arg(&args, 0)?.sub(&rhs)))
}

fn q_as_integer<'b, 'v>(args: Args<'b, 'v>) -> Ret<'b, 'v> {
    match quantity_arg(&args, 0)?.as_integer() {
        Some(i) => owned(CelInt::from(i)),
        None => Err(ExecutionError::function_error(
            "asInteger",
            "cannot convert value to integer",
        )),
    }
}

fn q_is_integer<'b, 'v>(args: Args<'b, 'v>) -> Ret<'b, 'v> {
    owned(CelBool::from(quantity_arg(&args, 0)?.is_integer()))
}

fn q_as_float<'b, 'v>(args: Args<'b, 'v>) -> Ret<'b, 'v> {
    owned(CelDouble::from(
        quantity_arg(&args, 0)?.as_approximate_float(),
    ))
}

fn q_sign<'b, 'v>(args: Args<'b, 'v>) -> Ret<'b, 'v> {
    owned(CelInt::from(quantity_arg(&args, 0)?.sign()))
}

// ---- semver ----

fn parse_semver(text: &str, normalize: bool) -> Result<Semver, super::semver::SemverError> {
    if normalize {
        Semver::parse_normalized(text)
    } else {
        Semver::parse(text)
    }
}

fn semver<'b, 'v>(args: Args<'b, 'v>) -> Ret<'b, 'v> {
    let text = arg::<CelString>(&args, 0)?.inner();
    let normalize = args.len() > 1 && *arg::<CelBool>(&args, 1)?.inner();
    parse_semver(text, normalize)
        .map(|v| CowVal::owned(SemverVal(v)))
        .map_err(|e| ExecutionError::function_error("semver", e))
}

fn is_semver<'b, 'v>(args: Args<'b, 'v>) -> Ret<'b, 'v> {
    let text = arg::<CelString>(&args, 0)?.inner();
    let normalize = args.len() > 1 && *arg::<CelBool>(&args, 1)?.inner();
    owned(CelBool::from(parse_semver(text, normalize).is_ok()))
}

fn v_major<'b, 'v>(args: Args<'b, 'v>) -> Ret<'b, 'v> {
    owned(CelInt::from(semver_arg(&args, 0)?.major()))
}

fn v_minor<'b, 'v>(args: Args<'b, 'v>) -> Ret<'b, 'v> {
    owned(CelInt::from(semver_arg(&args, 0)?.minor()))
}

fn v_patch<'b, 'v>(args: Args<'b, 'v>) -> Ret<'b, 'v> {
    owned(CelInt::from(semver_arg(&args, 0)?.patch()))
}

fn v_compare_to<'b, 'v>(args: Args<'b, 'v>) -> Ret<'b, 'v> {
    let o = semver_arg(&args, 0)?.compare(semver_arg(&args, 1)?);
    owned(CelInt::from(ordering(o)))
}

fn v_greater<'b, 'v>(args: Args<'b, 'v>) -> Ret<'b, 'v> {
    let o = semver_arg(&args, 0)?.compare(semver_arg(&args, 1)?);
    owned(CelBool::from(o == Ordering::Greater))
}

fn v_less<'b, 'v>(args: Args<'b, 'v>) -> Ret<'b, 'v> {
    let o = semver_arg(&args, 0)?.compare(semver_arg(&args, 1)?);
    owned(CelBool::from(o == Ordering::Less))
}

// ---- lists ----

fn list_items<'a, 'v>(args: &'a Args<'_, 'v>) -> Result<&'a [Box<dyn Val + 'v>], ExecutionError> {
    arg::<CelList>(args, 0).map(|l| l.inner())
}

/// Compares two list elements as upstream's `Comparer` does (numbers across int / uint / double).
fn compare(a: &dyn Val, b: &dyn Val, function: &str) -> Result<Ordering, ExecutionError> {
    let overload = || {
        ExecutionError::no_such_member_overload(
            function,
            vec![
                "list".to_owned(),
                a.get_type().name().to_owned(),
                b.get_type().name().to_owned(),
            ],
        )
    };
    a.as_comparer().ok_or_else(overload)?.compare(b)
}

fn is_sorted<'b, 'v>(args: Args<'b, 'v>) -> Ret<'b, 'v> {
    let items = list_items(&args)?;
    for pair in items.windows(2) {
        if compare(pair[0].as_ref(), pair[1].as_ref(), "isSorted")? == Ordering::Greater {
            return owned(CelBool::from(false));
        }
    }
    owned(CelBool::from(true))
}

fn sum<'b, 'v>(args: Args<'b, 'v>) -> Ret<'b, 'v> {
    let items = list_items(&args)?;
    let Some(first) = items.first() else {
        // Upstream returns the zero of the list's static element type; without static types an
        // empty list sums to int 0.
        return owned(CelInt::from(0));
    };
    let mut acc: Box<dyn Val + 'v> = first.clone();
    for item in &items[1..] {
        let next = acc
            .as_adder()
            .ok_or_else(|| {
                ExecutionError::no_such_overload("sum", vec![acc.get_type().name().to_owned()])
            })?
            .add(item.as_ref())?
            .into_owned();
        acc = next;
    }
    Ok(CowVal::Owned(acc))
}

fn extreme<'b, 'v>(args: Args<'b, 'v>, name: &str, replace_when: Ordering) -> Ret<'b, 'v> {
    let items = list_items(&args)?;
    let Some(mut best) = items.first() else {
        return Err(ExecutionError::function_error(
            name,
            format!("{name} called on empty list"),
        ));
    };
    for item in &items[1..] {
        if compare(best.as_ref(), item.as_ref(), name)? == replace_when {
            best = item;
        }
    }
    Ok(CowVal::Owned(best.clone()))
}

fn min<'b, 'v>(args: Args<'b, 'v>) -> Ret<'b, 'v> {
    extreme(args, "min", Ordering::Greater)
}

fn max<'b, 'v>(args: Args<'b, 'v>) -> Ret<'b, 'v> {
    extreme(args, "max", Ordering::Less)
}

fn index_of<'b, 'v>(args: Args<'b, 'v>) -> Ret<'b, 'v> {
    let items = list_items(&args)?;
    let needle = args[1].as_ref();
    let found = items.iter().position(|item| item.equals(needle));
    owned(CelInt::from(found.map_or(-1, |i| i as i64)))
}

fn last_index_of<'b, 'v>(args: Args<'b, 'v>) -> Ret<'b, 'v> {
    let items = list_items(&args)?;
    let needle = args[1].as_ref();
    let found = items.iter().rposition(|item| item.equals(needle));
    owned(CelInt::from(found.map_or(-1, |i| i as i64)))
}

/// DRA's `includes`: list membership (at most 48 values) or scalar equality.
fn includes<'b, 'v>(args: Args<'b, 'v>) -> Ret<'b, 'v> {
    let needle = args
        .get(1)
        .ok_or_else(|| ExecutionError::invalid_argument_count(2, args.len()))?;
    let target = args[0].as_ref();
    if let Some(list) = target.downcast_ref::<CelList>() {
        for (i, item) in list.inner().iter().enumerate() {
            if i >= INCLUDES_MAX_LIST {
                return Err(ExecutionError::function_error(
                    "includes",
                    format!("'includes' function cannot be applied to lists longer than {INCLUDES_MAX_LIST} values"),
                ));
            }
            if item.equals(needle.as_ref()) {
                return owned(CelBool::from(true));
            }
        }
        return owned(CelBool::from(false));
    }
    owned(CelBool::from(target.equals(needle.as_ref())))
}

fn sets_contains<'b, 'v>(args: Args<'b, 'v>) -> Ret<'b, 'v> {
    let all = arg::<CelList>(&args, 0)?.inner();
    let wanted = arg::<CelList>(&args, 1)?.inner();
    let found = wanted
        .iter()
        .all(|w| all.iter().any(|a| a.equals(w.as_ref())));
    owned(CelBool::from(found))
}

fn sets_equivalent<'b, 'v>(args: Args<'b, 'v>) -> Ret<'b, 'v> {
    let a = arg::<CelList>(&args, 0)?.inner();
    let b = arg::<CelList>(&args, 1)?.inner();
    let covers = |x: &[Box<dyn Val + 'v>], y: &[Box<dyn Val + 'v>]| {
        y.iter().all(|w| x.iter().any(|a| a.equals(w.as_ref())))
    };
    owned(CelBool::from(covers(a, b) && covers(b, a)))
}

fn sets_intersects<'b, 'v>(args: Args<'b, 'v>) -> Ret<'b, 'v> {
    let a = arg::<CelList>(&args, 0)?.inner();
    let b = arg::<CelList>(&args, 1)?.inner();
    let any = a.iter().any(|x| b.iter().any(|y| x.equals(y.as_ref())));
    owned(CelBool::from(any))
}

// ---- regex ----

/// Patterns kept compiled per thread; cleared when full so that generated patterns cannot grow it.
const REGEX_CACHE_SIZE: usize = 256;

thread_local! {
    static REGEXES: RefCell<HashMap<String, Arc<Regex>>> = RefCell::new(HashMap::new());
}

fn compiled(pattern: &str, function: &str) -> Result<Arc<Regex>, ExecutionError> {
    if let Some(re) = REGEXES.with(|c| c.borrow().get(pattern).cloned()) {
        return Ok(re);
    }
    let re =
        Arc::new(Regex::new(pattern).map_err(|e| {
            ExecutionError::function_error(function, format!("Illegal regex: {e}"))
        })?);
    REGEXES.with(|c| {
        let mut cache = c.borrow_mut();
        if cache.len() >= REGEX_CACHE_SIZE {
            cache.clear();
        }
        cache.insert(pattern.to_owned(), re.clone());
    });
    Ok(re)
}

/// Upstream's cost of a regex search beyond the call itself (which the caller's tick charges):
/// ceil((1 + text length) / 10) × ceil(pattern length / 4), less 1.
fn charge_regex(text: &str, pattern: &str) -> Result<(), ExecutionError> {
    let text_cost = (1 + text.len() as u64).div_ceil(10);
    let pattern_cost = (pattern.len() as u64).div_ceil(4);
    super::cost::charge(text_cost.saturating_mul(pattern_cost).saturating_sub(1))
}

fn find<'b, 'v>(args: Args<'b, 'v>) -> Ret<'b, 'v> {
    let text = arg::<CelString>(&args, 0)?.inner();
    let pattern = arg::<CelString>(&args, 1)?.inner();
    charge_regex(text, pattern)?;
    let re = compiled(pattern, "find")?;
    let found = re.find(text).map_or("", |m| m.as_str());
    owned(CelString::from(found.to_owned()))
}

fn find_all<'b, 'v>(args: Args<'b, 'v>) -> Ret<'b, 'v> {
    let text = arg::<CelString>(&args, 0)?.inner();
    let pattern = arg::<CelString>(&args, 1)?.inner();
    charge_regex(text, pattern)?;
    let re = compiled(pattern, "findAll")?;
    let limit = if args.len() > 2 {
        *arg::<CelInt>(&args, 2)?.inner()
    } else {
        -1
    };
    let take = usize::try_from(limit).unwrap_or(usize::MAX);
    let items: Vec<Box<dyn Val + 'v>> = re
        .find_iter(text)
        .take(take)
        .map(|m| Box::new(CelString::from(m.as_str().to_owned())) as Box<dyn Val + 'v>)
        .collect();
    owned(CelList::from(items))
}

fn t(ty: &Type) -> Type {
    ty.to_owned()
}

/// Declares every function of this module on `env`. `includes` is declared for any receiver.
pub fn register(env: &mut Env) -> Result<(), DeclarationError> {
    let (q, v) = (&QUANTITY_TYPE, &SEMVER_TYPE);
    env.add_overload(
        "quantity",
        "string_to_quantity",
        vec![t(&STRING_TYPE)],
        quantity,
    )?;
    env.add_overload(
        "isQuantity",
        "is_quantity_string",
        vec![t(&STRING_TYPE)],
        is_quantity,
    )?;
    env.add_overload("sign", "quantity_sign", vec![t(q)], q_sign)?;
    let quantity_methods: [(&str, &str, Vec<Type>, cel::common::functions::Function); 10] = [
        ("compareTo", "quantity_compare_to", vec![t(q)], q_compare_to),
        (
            "isGreaterThan",
            "quantity_is_greater_than",
            vec![t(q)],
            q_greater,
        ),
        ("isLessThan", "quantity_is_less_than", vec![t(q)], q_less),
        ("add", "quantity_add", vec![t(q)], q_add),
        ("add", "quantity_add_int", vec![t(&INT_TYPE)], q_add_int),
        ("sub", "quantity_sub", vec![t(q)], q_sub),
        ("sub", "quantity_sub_int", vec![t(&INT_TYPE)], q_sub_int),
        ("asInteger", "quantity_get_int", vec![], q_as_integer),
        ("isInteger", "quantity_is_integer", vec![], q_is_integer),
        (
            "asApproximateFloat",
            "quantity_get_float",
            vec![],
            q_as_float,
        ),
    ];
    for (name, id, params, f) in quantity_methods {
        env.add_member_overload(name, id, t(q), params, f)?;
    }

    env.add_overload("semver", "string_to_semver", vec![t(&STRING_TYPE)], semver)?;
    env.add_overload(
        "semver",
        "string_bool_to_semver",
        vec![t(&STRING_TYPE), t(&BOOL_TYPE)],
        semver,
    )?;
    env.add_overload(
        "isSemver",
        "is_semver_string",
        vec![t(&STRING_TYPE)],
        is_semver,
    )?;
    env.add_overload(
        "isSemver",
        "is_semver_string_bool",
        vec![t(&STRING_TYPE), t(&BOOL_TYPE)],
        is_semver,
    )?;
    let semver_methods: [(&str, &str, Vec<Type>, cel::common::functions::Function); 6] = [
        ("major", "semver_major", vec![], v_major),
        ("minor", "semver_minor", vec![], v_minor),
        ("patch", "semver_patch", vec![], v_patch),
        ("compareTo", "semver_compare_to", vec![t(v)], v_compare_to),
        (
            "isGreaterThan",
            "semver_is_greater_than",
            vec![t(v)],
            v_greater,
        ),
        ("isLessThan", "semver_is_less_than", vec![t(v)], v_less),
    ];
    for (name, id, params, f) in semver_methods {
        env.add_member_overload(name, id, t(v), params, f)?;
    }

    let list_methods: [(&str, &str, Vec<Type>, cel::common::functions::Function); 6] = [
        ("isSorted", "list_is_sorted", vec![], is_sorted),
        ("sum", "list_sum", vec![], sum),
        ("min", "list_min", vec![], min),
        ("max", "list_max", vec![], max),
        (
            "indexOf",
            "list_a_index_of_int",
            vec![t(&DYN_TYPE)],
            index_of,
        ),
        (
            "lastIndexOf",
            "list_a_last_index_of_int",
            vec![t(&DYN_TYPE)],
            last_index_of,
        ),
    ];
    for (name, id, params, f) in list_methods {
        env.add_member_overload(name, id, t(&LIST_TYPE), params, f)?;
    }
    env.add_member_overload(
        "includes",
        "dra_includes_dyn_dyn",
        t(&DYN_TYPE),
        vec![t(&DYN_TYPE)],
        includes,
    )?;

    let s = &STRING_TYPE;
    env.add_member_overload("find", "string_find_string", t(s), vec![t(s)], find)?;
    env.add_member_overload(
        "findAll",
        "string_find_all_string",
        t(s),
        vec![t(s)],
        find_all,
    )?;
    env.add_member_overload(
        "findAll",
        "string_find_all_string_int",
        t(s),
        vec![t(s), t(&INT_TYPE)],
        find_all,
    )?;

    let l = &LIST_TYPE;
    env.add_overload(
        "sets.contains",
        "list_sets_contains_list",
        vec![t(l), t(l)],
        sets_contains,
    )?;
    env.add_overload(
        "sets.equivalent",
        "list_sets_equivalent_list",
        vec![t(l), t(l)],
        sets_equivalent,
    )?;
    env.add_overload(
        "sets.intersects",
        "list_sets_intersects_list",
        vec![t(l), t(l)],
        sets_intersects,
    )?;
    Ok(())
}
