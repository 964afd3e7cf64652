//! The compile-phase checks that cel-go's type checker makes and the `cel` crate (a parser and
//! interpreter only) does not: undeclared identifiers and functions, fields of `device`, the features
//! the API server gates, and a best-effort check that the result can be a bool. Also the literal
//! attribute and capacity names an expression looks up, for `selectors check`'s suggestions.

use std::collections::BTreeSet;

use cel::common::ast::{operators, EntryExpr, Expr, IdedExpr, LiteralValue, MapExpr, StructExpr};

use super::FeatureGates;

/// Calls `f` on each direct child of `expr`.
pub(crate) fn for_each_child<'a>(expr: &'a IdedExpr, f: &mut dyn FnMut(&'a IdedExpr)) {
    match &expr.expr {
        Expr::Call(call) => {
            if let Some(target) = &call.target {
                f(target);
            }
            call.args.iter().for_each(&mut *f);
        }
        Expr::Comprehension(c) => {
            for e in [
                &c.iter_range,
                &c.accu_init,
                &c.loop_cond,
                &c.loop_step,
                &c.result,
            ] {
                f(e);
            }
        }
        Expr::Select(s) => f(&s.operand),
        Expr::List(l) => l.elements.iter().for_each(&mut *f),
        Expr::Map(MapExpr { entries }) | Expr::Struct(StructExpr { entries, .. }) => {
            entries.iter().for_each(|entry| match &entry.expr {
                EntryExpr::MapEntry(e) => {
                    f(&e.key);
                    f(&e.value);
                }
                EntryExpr::StructField(s) => f(&s.value),
            })
        }
        Expr::Ident(_) | Expr::Literal(_) | Expr::Unspecified => {}
    }
}

/// Calls `f` on each direct child of `expr`, mutably (the same children as [`for_each_child`]).
pub(crate) fn for_each_child_mut(expr: &mut IdedExpr, f: &mut dyn FnMut(&mut IdedExpr)) {
    match &mut expr.expr {
        Expr::Call(call) => {
            if let Some(target) = &mut call.target {
                f(target);
            }
            call.args.iter_mut().for_each(&mut *f);
        }
        Expr::Comprehension(c) => {
            for e in [
                &mut c.iter_range,
                &mut c.accu_init,
                &mut c.loop_cond,
                &mut c.loop_step,
                &mut c.result,
            ] {
                f(e);
            }
        }
        Expr::Select(s) => f(&mut s.operand),
        Expr::List(l) => l.elements.iter_mut().for_each(&mut *f),
        Expr::Map(MapExpr { entries }) | Expr::Struct(StructExpr { entries, .. }) => {
            entries.iter_mut().for_each(|entry| match &mut entry.expr {
                EntryExpr::MapEntry(e) => {
                    f(&mut e.key);
                    f(&mut e.value);
                }
                EntryExpr::StructField(s) => f(&mut s.value),
            })
        }
        Expr::Ident(_) | Expr::Literal(_) | Expr::Unspecified => {}
    }
}

/// Functions called as `f(..)`, namespaced ones included.
const GLOBAL_FUNCTIONS: &[&str] = &[
    "size",
    "int",
    "uint",
    "double",
    "string",
    "bytes",
    "bool",
    "type",
    "dyn",
    "matches",
    "quantity",
    "isQuantity",
    "sign",
    "semver",
    "isSemver",
    "optional.of",
    "optional.ofNonZeroValue",
    "optional.none",
    "strings.quote",
    "lists.range",
    "sets.contains",
    "sets.equivalent",
    "sets.intersects",
];

/// Functions called as `x.f(..)`.
const MEMBER_FUNCTIONS: &[&str] = &[
    // standard
    "size",
    "contains",
    "startsWith",
    "endsWith",
    "matches",
    // optional
    "hasValue",
    "value",
    "orValue",
    "or",
    // ext.Strings
    "charAt",
    "indexOf",
    "lastIndexOf",
    "lowerAscii",
    "upperAscii",
    "replace",
    "split",
    "substring",
    "trim",
    "join",
    "format",
    // ext.Lists
    "slice",
    "flatten",
    "distinct",
    "reverse",
    "sort",
    // Kubernetes lists and regex
    "isSorted",
    "sum",
    "min",
    "max",
    "find",
    "findAll",
    "includes",
    // quantity and semver
    "isGreaterThan",
    "isLessThan",
    "compareTo",
    "add",
    "sub",
    "asInteger",
    "isInteger",
    "asApproximateFloat",
    "major",
    "minor",
    "patch",
];

/// Identifiers that name types (`type(x) == int`).
const TYPE_NAMES: &[&str] = &[
    "int",
    "uint",
    "double",
    "bool",
    "string",
    "bytes",
    "list",
    "map",
    "type",
    "null_type",
    "dyn",
];

const OPERATORS: &[&str] = &[
    operators::CONDITIONAL,
    operators::LOGICAL_AND,
    operators::LOGICAL_OR,
    operators::LOGICAL_NOT,
    operators::SUBSTRACT,
    operators::ADD,
    operators::MULTIPLY,
    operators::DIVIDE,
    operators::MODULO,
    operators::EQUALS,
    operators::NOT_EQUALS,
    operators::GREATER_EQUALS,
    operators::LESS_EQUALS,
    operators::GREATER,
    operators::LESS,
    operators::NEGATE,
    operators::INDEX,
    operators::OPT_INDEX,
    operators::OPT_SELECT,
    operators::NOT_STRICTLY_FALSE,
    operators::IN,
];

const DEVICE_FIELDS: &[&str] = &[
    "driver",
    "attributes",
    "capacity",
    "allowMultipleAllocations",
];

/// What the checked environment offers; `None` gates mean the scheduler's (everything).
pub(crate) struct Checker {
    pub gates: Option<FeatureGates>,
    scopes: Vec<String>,
}

/// Internal names made by macros start with these; source identifiers cannot.
fn is_internal(name: &str) -> bool {
    name.starts_with('@') || name.starts_with('#')
}

/// The dotted name `expr` spells (`a.b.c`), if it is one.
fn qualified_name(expr: &IdedExpr) -> Option<String> {
    match &expr.expr {
        Expr::Ident(name) => Some(name.clone()),
        Expr::Select(s) if !s.test => {
            qualified_name(&s.operand).map(|p| format!("{p}.{}", s.field))
        }
        _ => None,
    }
}

impl Checker {
    pub(crate) fn new(gates: Option<FeatureGates>) -> Checker {
        Checker {
            gates,
            scopes: Vec::new(),
        }
    }

    fn in_scope(&self, name: &str) -> bool {
        self.scopes.iter().any(|s| s == name)
    }

    fn is_device(&self, expr: &IdedExpr) -> bool {
        matches!(&expr.expr, Expr::Ident(n) if n == "device") && !self.in_scope("device")
    }

    /// `device.attributes[d][id]` (any access form): a value of type `any` without list-type
    /// attributes.
    fn is_attribute_value(&self, expr: &IdedExpr) -> bool {
        let operand = |e: &'_ IdedExpr| -> Option<IdedExpr> {
            match &e.expr {
                Expr::Select(s) => Some((*s.operand).clone()),
                Expr::Call(c)
                    if c.target.is_none()
                        && [
                            operators::INDEX,
                            operators::OPT_INDEX,
                            operators::OPT_SELECT,
                        ]
                        .contains(&c.func_name.as_str()) =>
                {
                    c.args.first().cloned()
                }
                _ => None,
            }
        };
        let Some(domain) = operand(expr) else {
            return false;
        };
        let Some(attributes) = operand(&domain) else {
            return false;
        };
        matches!(&attributes.expr, Expr::Select(s) if s.field == "attributes" && self.is_device(&s.operand))
    }

    pub(crate) fn check(&mut self, expr: &IdedExpr) -> Result<(), String> {
        match &expr.expr {
            Expr::Ident(name) => {
                if name == "device"
                    || self.in_scope(name)
                    || is_internal(name)
                    || TYPE_NAMES.contains(&name.as_str())
                {
                    Ok(())
                } else {
                    Err(format!("undeclared reference to '{name}'"))
                }
            }
            Expr::Select(s) => {
                if self.is_device(&s.operand) {
                    let gated = s.field == "allowMultipleAllocations"
                        && self.gates.is_some_and(|g| !g.consumable_capacity);
                    if !DEVICE_FIELDS.contains(&s.field.as_str()) || gated {
                        return Err(format!("undefined field '{}'", s.field));
                    }
                    return Ok(());
                }
                self.check(&s.operand)
            }
            Expr::Call(call) => {
                let name = call.func_name.as_str();
                if let Some(target) = &call.target {
                    let namespaced = qualified_name(target)
                        .filter(|ns| !self.in_scope(ns.split('.').next().unwrap_or_default()))
                        .map(|ns| format!("{ns}.{name}"));
                    if namespaced.is_some_and(|n| GLOBAL_FUNCTIONS.contains(&n.as_str())) {
                        return call.args.iter().try_for_each(|a| self.check(a));
                    }
                    let gated =
                        name == "includes" && self.gates.is_some_and(|g| !g.list_type_attributes);
                    if (!MEMBER_FUNCTIONS.contains(&name) && !is_internal(name)) || gated {
                        return Err(format!("undeclared reference to '{name}'"));
                    }
                    self.check(target)?;
                } else if !OPERATORS.contains(&name)
                    && !GLOBAL_FUNCTIONS.contains(&name)
                    && !is_internal(name)
                {
                    return Err(format!("undeclared reference to '{name}'"));
                }
                call.args.iter().try_for_each(|a| self.check(a))
            }
            Expr::Comprehension(c) => {
                self.check(&c.iter_range)?;
                if self.gates.is_some_and(|g| !g.list_type_attributes)
                    && self.is_attribute_value(&c.iter_range)
                {
                    return Err("expression of type 'any' cannot be range of a comprehension (must be list, map, or dynamic)".to_owned());
                }
                self.check(&c.accu_init)?;
                let depth = self.scopes.len();
                self.scopes.push(c.accu_var.clone());
                self.scopes.push(c.iter_var.clone());
                if let Some(v) = &c.iter_var2 {
                    self.scopes.push(v.clone());
                }
                let result = [&c.loop_cond, &c.loop_step, &c.result]
                    .into_iter()
                    .try_for_each(|e| self.check(e));
                self.scopes.truncate(depth);
                result
            }
            Expr::Struct(s) => Err(format!("undeclared reference to '{}'", s.type_name)),
            Expr::List(_) | Expr::Map(_) => {
                let mut result = Ok(());
                for_each_child(expr, &mut |child| {
                    if result.is_ok() {
                        result = self.check(child);
                    }
                });
                result
            }
            Expr::Literal(_) => Ok(()),
            Expr::Unspecified => Err("unsupported expression".to_owned()),
        }
    }
}

/// The static type of the root expression where it is obviously not bool (cel-go would report it).
pub(crate) fn non_bool_result(expr: &IdedExpr) -> Option<&'static str> {
    match &expr.expr {
        Expr::Literal(literal) => match literal {
            LiteralValue::Boolean(_) => None,
            LiteralValue::Bytes(_) => Some("bytes"),
            LiteralValue::Double(_) => Some("double"),
            LiteralValue::Int(_) => Some("int"),
            LiteralValue::Null => Some("null_type"),
            LiteralValue::String(_) => Some("string"),
            LiteralValue::UInt(_) => Some("uint"),
        },
        Expr::Ident(name) if name == "device" => Some("kubernetes.DRADevice"),
        Expr::Select(s)
            if !s.test && matches!(&s.operand.expr, Expr::Ident(n) if n == "device") =>
        {
            match s.field.as_str() {
                "driver" => Some("string"),
                "attributes" => Some("map(string, map(string, dyn))"),
                "capacity" => Some("map(string, map(string, kubernetes.Quantity))"),
                _ => None,
            }
        }
        Expr::Call(call) => match (call.target.is_some(), call.func_name.as_str()) {
            (false, "quantity") => Some("kubernetes.Quantity"),
            (false, "semver") => Some("kubernetes.Semver"),
            (false, "size" | "int" | "sign") => Some("int"),
            (false, "string") => Some("string"),
            (false, "double") => Some("double"),
            (false, "uint") => Some("uint"),
            (true, "compareTo" | "major" | "minor" | "patch" | "asInteger" | "size") => Some("int"),
            (true, "asApproximateFloat") => Some("double"),
            _ => None,
        },
        _ => None,
    }
}

/// The map of `device` that a name is looked up in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DeviceMap {
    Attributes,
    Capacity,
}

/// A lookup with literal keys in `device.attributes` or `device.capacity`: the domain, and the name
/// when the expression looks one up in it (`.name`, `["name"]`, `.?name`, `[?"name"]`, `has(..)`,
/// `"name" in ..`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DeviceReference {
    pub map: DeviceMap,
    pub domain: String,
    pub name: Option<String>,
}

/// Every literal lookup in `device.attributes` and `device.capacity` that `expr` makes, sorted. Names
/// computed at run time, or reached through variables (`cel.bind`), are not seen.
pub(crate) fn device_references(expr: &IdedExpr) -> Vec<DeviceReference> {
    let mut found = BTreeSet::new();
    collect_references(expr, false, &mut found);
    found.into_iter().collect()
}

/// The operand and the literal key of `x.key`, `x["key"]`, `x[?"key"]` or `x.?key`.
fn lookup(expr: &IdedExpr) -> Option<(&IdedExpr, &str)> {
    match &expr.expr {
        Expr::Select(s) => Some((&s.operand, s.field.as_str())),
        Expr::Call(c)
            if c.target.is_none()
                && c.args.len() == 2
                && [
                    operators::INDEX,
                    operators::OPT_INDEX,
                    operators::OPT_SELECT,
                ]
                .contains(&c.func_name.as_str()) =>
        {
            match &c.args[1].expr {
                Expr::Literal(LiteralValue::String(key)) => Some((&c.args[0], key.inner())),
                _ => None,
            }
        }
        _ => None,
    }
}

/// `device.attributes[domain]` or `device.capacity[domain]`, while `device` is the variable.
fn domain_lookup(expr: &IdedExpr, shadowed: bool) -> Option<(DeviceMap, &str)> {
    let (operand, domain) = lookup(expr)?;
    let Expr::Select(s) = &operand.expr else {
        return None;
    };
    if shadowed || s.test || !matches!(&s.operand.expr, Expr::Ident(n) if n == "device") {
        return None;
    }
    match s.field.as_str() {
        "attributes" => Some((DeviceMap::Attributes, domain)),
        "capacity" => Some((DeviceMap::Capacity, domain)),
        _ => None,
    }
}

fn collect_references(expr: &IdedExpr, shadowed: bool, found: &mut BTreeSet<DeviceReference>) {
    let mut add = |map, domain: &str, name: Option<&str>| {
        found.insert(DeviceReference {
            map,
            domain: domain.to_owned(),
            name: name.map(str::to_owned),
        });
    };
    if let Some((map, domain)) = domain_lookup(expr, shadowed) {
        add(map, domain, None);
    }
    if let Some((operand, name)) = lookup(expr) {
        if let Some((map, domain)) = domain_lookup(operand, shadowed) {
            add(map, domain, Some(name));
        }
    }
    if let Expr::Call(c) = &expr.expr {
        if c.func_name == operators::IN && c.args.len() == 2 {
            if let (Expr::Literal(LiteralValue::String(name)), Some((map, domain))) =
                (&c.args[0].expr, domain_lookup(&c.args[1], shadowed))
            {
                add(map, domain, Some(name.inner()));
            }
        }
    }
    if let Expr::Comprehension(c) = &expr.expr {
        // A comprehension variable named `device` hides the device inside the loop.
        let inner = shadowed
            || [
                c.iter_var.as_str(),
                c.accu_var.as_str(),
                c.iter_var2.as_deref().unwrap_or_default(),
            ]
            .contains(&"device");
        collect_references(&c.iter_range, shadowed, found);
        collect_references(&c.accu_init, shadowed, found);
        for e in [&c.loop_cond, &c.loop_step, &c.result] {
            collect_references(e, inner, found);
        }
        return;
    }
    for_each_child(expr, &mut |child| {
        collect_references(child, shadowed, found)
    });
}
