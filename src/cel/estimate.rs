//! A static worst-case cost estimate in the spirit of cel-go's estimator with the DRA size bounds
//! (`cel/compile.go` `sizeEstimator`), used by the API-server check. Rules: a call, an identifier and a
//! field selection cost 1; `quantity()` / `semver()` / `isQuantity()` / `isSemver()` on a string add a
//! tenth of its length; `includes` adds 48 and `in` on a list its size; a comprehension costs its
//! range, its init and its result plus, per iteration of its range's worst-case size, its condition
//! and step. Sizes: list literals exactly, `device.attributes` / `device.capacity` and their domains 32
//! entries, an attribute value 64 (string or list), `split` as long as its string, `map` / `filter` as
//! their range, anything else 64.

use cel::common::ast::{operators, EntryExpr, Expr, IdedExpr, LiteralValue};

/// Size assumed for a value the estimator knows nothing about.
const UNKNOWN_SIZE: u64 = 64;
/// Entries of `device.attributes`, `device.capacity` and of each domain.
const MAP_SIZE: u64 = 32;
/// An attribute value: a string of at most 64 bytes or a list of at most 48 values.
const ATTRIBUTE_SIZE: u64 = 64;
/// Estimated cost of `includes` (`ResourceSliceMaxAttributeValuesPerDevice`).
const INCLUDES_COST: u64 = 48;

/// Worst-case cost and size of an expression's value.
#[derive(Clone, Copy)]
struct Estimate {
    cost: u64,
    size: u64,
}

/// The estimated worst-case cost of evaluating `expr` (before instrumentation).
pub(crate) fn estimate(expr: &IdedExpr) -> u64 {
    Estimator.estimate(expr, 0).cost
}

struct Estimator;

/// How deep below `device` an expression reads: 1 for `device.attributes`, 2 for a domain, 3 for a
/// value.
fn device_depth(expr: &IdedExpr) -> Option<u32> {
    match &expr.expr {
        Expr::Ident(n) if n == "device" => Some(0),
        Expr::Select(s) if !s.test => device_depth(&s.operand).map(|d| d + 1),
        Expr::Call(c)
            if c.target.is_none()
                && [
                    operators::INDEX,
                    operators::OPT_INDEX,
                    operators::OPT_SELECT,
                ]
                .contains(&c.func_name.as_str()) =>
        {
            c.args.first().and_then(device_depth).map(|d| d + 1)
        }
        _ => None,
    }
}

impl Estimator {
    fn estimate(&self, expr: &IdedExpr, depth: u32) -> Estimate {
        // Deeper than any parse we accept; stop rather than recurse without bound.
        if depth > 2000 {
            return Estimate {
                cost: u64::MAX,
                size: UNKNOWN_SIZE,
            };
        }
        let sub = |e: &IdedExpr| self.estimate(e, depth + 1);
        match &expr.expr {
            Expr::Literal(LiteralValue::String(s)) => Estimate {
                cost: 0,
                size: s.inner().len() as u64,
            },
            Expr::Literal(_) => Estimate { cost: 0, size: 1 },
            Expr::Ident(_) => Estimate {
                cost: 1,
                size: UNKNOWN_SIZE,
            },
            Expr::Select(s) => {
                let operand = sub(&s.operand);
                let size = match device_depth(expr) {
                    Some(1) | Some(2) => MAP_SIZE,
                    Some(3) => ATTRIBUTE_SIZE,
                    _ => UNKNOWN_SIZE,
                };
                Estimate {
                    cost: operand.cost.saturating_add(1),
                    size,
                }
            }
            Expr::List(l) => {
                let cost = l
                    .elements
                    .iter()
                    .fold(1u64, |acc, e| acc.saturating_add(sub(e).cost));
                Estimate {
                    cost,
                    size: l.elements.len() as u64,
                }
            }
            Expr::Map(m) => {
                let mut cost = 1u64;
                for entry in &m.entries {
                    if let EntryExpr::MapEntry(e) = &entry.expr {
                        cost = cost
                            .saturating_add(sub(&e.key).cost)
                            .saturating_add(sub(&e.value).cost);
                    }
                }
                Estimate {
                    cost,
                    size: m.entries.len() as u64,
                }
            }
            Expr::Struct(_) | Expr::Unspecified => Estimate {
                cost: 1,
                size: UNKNOWN_SIZE,
            },
            Expr::Comprehension(c) => {
                let range = sub(&c.iter_range);
                let init = sub(&c.accu_init);
                let per_iteration = sub(&c.loop_cond)
                    .cost
                    .saturating_add(sub(&c.loop_step).cost);
                let result = sub(&c.result);
                let cost = range
                    .cost
                    .saturating_add(init.cost)
                    .saturating_add(range.size.saturating_mul(per_iteration))
                    .saturating_add(result.cost);
                // `map` / `filter` build at most one element per iteration.
                let size = if matches!(&c.accu_init.expr, Expr::List(l) if l.elements.is_empty()) {
                    range.size
                } else {
                    result.size
                };
                Estimate { cost, size }
            }
            Expr::Call(call) => {
                let target = call.target.as_deref().map(sub);
                let args: Vec<Estimate> = call.args.iter().map(sub).collect();
                let mut cost = args
                    .iter()
                    .chain(target.iter())
                    .fold(1u64, |acc, e| acc.saturating_add(e.cost));
                let first_size = args.first().map_or(0, |a| a.size);
                let mut size = UNKNOWN_SIZE;
                match call.func_name.as_str() {
                    "quantity" | "isQuantity" | "semver" | "isSemver" => {
                        cost = cost.saturating_add(first_size.div_ceil(10));
                    }
                    "includes" => cost = cost.saturating_add(INCLUDES_COST),
                    "@in" => {
                        let container = args.get(1).map_or(0, |a| a.size);
                        cost = cost.saturating_add(container);
                    }
                    "split" => size = target.map_or(UNKNOWN_SIZE, |t| t.size),
                    operators::INDEX | operators::OPT_INDEX | operators::OPT_SELECT => {
                        size = match device_depth(expr) {
                            Some(1) | Some(2) => MAP_SIZE,
                            Some(3) => ATTRIBUTE_SIZE,
                            _ => UNKNOWN_SIZE,
                        };
                    }
                    operators::ADD => {
                        size = args.iter().fold(0u64, |acc, a| acc.saturating_add(a.size));
                    }
                    _ => {}
                }
                Estimate { cost, size }
            }
        }
    }
}
