//! The runtime cost limit (upstream: cel-go's actual-cost tracking with `cel.CostLimit`): the parsed
//! expression is rewritten so that each comprehension iteration, before it runs, and each call that
//! may build a large value pass through `__tick`, which charges a per-thread budget and fails once it
//! is spent. An iteration is charged what cel-go charges for its condition and step (1 per identifier,
//! selection and call). Constant `quantity("..")` / `semver("..")` calls are replaced by pre-parsed
//! values at the same time.

use std::cell::Cell;

use cel::common::ast::{
    operators, CallExpr, ComprehensionExpr, EntryExpr, Expr, IdedExpr, LiteralValue,
};
use cel::common::types::{CelInt, CelList, CelMap, CelString};
use cel::common::value::{CowVal, Val};
use cel::ExecutionError;

use super::semver::Semver;
use super::values::{QuantityVal, SemverVal};
use crate::quantity::Quantity;

/// The internal function that charges the budget; not callable from expressions (the static check
/// rejects the name).
pub(crate) const TICK: &str = "__tick";
/// The internal function that charges for the list `lists.range(n)` is about to build.
pub(crate) const CHARGE_SIZE: &str = "__charge_size";
/// Prefix of the identifiers that stand for pre-parsed constants.
pub(crate) const CONST_PREFIX: &str = "@const";
/// Text of the error when the budget is spent (cel-go's wording).
pub(crate) const COST_EXCEEDED: &str = "operation cancelled: actual cost limit exceeded";

thread_local! {
    static REMAINING: Cell<u64> = const { Cell::new(u64::MAX) };
    static EXCEEDED: Cell<bool> = const { Cell::new(false) };
}

/// A budget for one evaluation on this thread; dropping it restores the one it replaced.
pub(crate) struct Budget {
    saved: (u64, bool),
}

impl Budget {
    pub(crate) fn start(limit: u64) -> Budget {
        let saved = (
            REMAINING.with(|r| r.replace(limit)),
            EXCEEDED.with(|e| e.replace(false)),
        );
        Budget { saved }
    }

    /// Whether the budget ran out at any point. An exceeded limit cancels the evaluation even where
    /// `||`, `&&` or a macro would otherwise have absorbed the error.
    pub(crate) fn exceeded(&self) -> bool {
        EXCEEDED.with(Cell::get)
    }
}

impl Drop for Budget {
    fn drop(&mut self) {
        REMAINING.with(|r| r.set(self.saved.0));
        EXCEEDED.with(|e| e.set(self.saved.1));
    }
}

/// `__tick(x)` / `__tick(x, weight)`: charges `weight` (default 1), plus a tenth of the size of a
/// newly built string or list (as cel-go charges for traversing values), and returns `x` unchanged.
pub(crate) fn tick<'b, 'v>(
    mut args: Vec<CowVal<'b, 'v>>,
) -> Result<CowVal<'b, 'v>, ExecutionError> {
    let mut cost = 1u64;
    if args.len() == 2 {
        let weight = args
            .pop()
            .and_then(|w| w.downcast_ref::<CelInt>().map(|w| *w.inner()));
        cost = weight.and_then(|w| u64::try_from(w).ok()).unwrap_or(1);
    }
    let value = args
        .pop()
        .ok_or_else(|| ExecutionError::invalid_argument_count(1, 0))?;
    if value.is_owned() {
        if let Some(s) = value.downcast_ref::<CelString>() {
            cost += s.inner().len() as u64 / 10;
        } else if let Some(l) = value.downcast_ref::<CelList>() {
            cost += l.inner().len() as u64 / 10;
        } else if let Some(m) = value.downcast_ref::<CelMap>() {
            cost += m.inner().len() as u64 / 10;
        }
    }
    charge(cost)?;
    Ok(value)
}

/// `__charge_size(n)`: charges `n` (one per element of a list about to be built) and returns `n`,
/// so that `lists.range(1000000000)` fails before it allocates.
pub(crate) fn charge_size<'b, 'v>(
    mut args: Vec<CowVal<'b, 'v>>,
) -> Result<CowVal<'b, 'v>, ExecutionError> {
    let n = args
        .pop()
        .ok_or_else(|| ExecutionError::invalid_argument_count(1, 0))?;
    let size = n.downcast_ref::<CelInt>().map_or(0, |n| *n.inner());
    charge(u64::try_from(size).unwrap_or(0))?;
    Ok(n)
}

/// Takes `cost` from this thread's budget; fails once it is spent.
pub(crate) fn charge(cost: u64) -> Result<(), ExecutionError> {
    let left = REMAINING.with(|r| {
        let left = r.get().saturating_sub(cost);
        r.set(left);
        left
    });
    if left == 0 {
        EXCEEDED.with(|e| e.set(true));
        return Err(ExecutionError::function_error(TICK, COST_EXCEEDED));
    }
    Ok(())
}

/// Calls that cost O(1) and build no large value. They are not ticked one by one: outside a loop each
/// runs at most once per node of an expression of at most 10 KiB, and inside a loop the tick of each
/// iteration charges for them (see [`weight`]).
const CHEAP: &[&str] = &[
    operators::CONDITIONAL,
    operators::LOGICAL_AND,
    operators::LOGICAL_OR,
    operators::LOGICAL_NOT,
    operators::EQUALS,
    operators::NOT_EQUALS,
    operators::LESS,
    operators::LESS_EQUALS,
    operators::GREATER,
    operators::GREATER_EQUALS,
    operators::INDEX,
    operators::OPT_INDEX,
    operators::OPT_SELECT,
    operators::NEGATE,
    operators::NOT_STRICTLY_FALSE,
    "@in",
    "size",
    "int",
    "uint",
    "double",
    "bool",
    "type",
    "dyn",
    "quantity",
    "isQuantity",
    "sign",
    "semver",
    "isSemver",
    "compareTo",
    "isGreaterThan",
    "isLessThan",
    "asInteger",
    "isInteger",
    "asApproximateFloat",
    "major",
    "minor",
    "patch",
    "startsWith",
    "endsWith",
    "contains",
    "matches",
    "includes",
    "hasValue",
    "value",
    "orValue",
];

/// The rewritten expression and the constants its `@const<i>` identifiers stand for.
pub(crate) struct Instrumented {
    pub expr: IdedExpr,
    pub constants: Vec<Box<dyn Val>>,
}

struct Rewriter {
    next_id: u64,
    constants: Vec<Box<dyn Val>>,
}

/// Rewrites `expr` for the runtime budget (see the module documentation).
pub(crate) fn instrument(expr: IdedExpr) -> Instrumented {
    let mut rewriter = Rewriter {
        next_id: max_id(&expr) + 1,
        constants: Vec::new(),
    };
    let expr = rewriter.rewrite(expr);
    Instrumented {
        expr,
        constants: rewriter.constants,
    }
}

fn max_id(expr: &IdedExpr) -> u64 {
    let mut max = expr.id;
    super::check::for_each_child(expr, &mut |child| max = max.max(max_id(child)));
    max
}

impl Rewriter {
    fn node(&mut self, expr: Expr) -> IdedExpr {
        self.next_id += 1;
        IdedExpr {
            id: self.next_id,
            expr,
        }
    }

    /// `__tick(expr, weight)`: charges `weight` before `expr`'s value is used.
    fn weighted_tick(&mut self, expr: IdedExpr, weight: u64) -> IdedExpr {
        let weight = self.node(Expr::Literal(LiteralValue::Int(
            i64::try_from(weight).unwrap_or(i64::MAX).into(),
        )));
        self.node(Expr::Call(CallExpr {
            func_name: TICK.to_owned(),
            target: None,
            args: vec![expr, weight],
        }))
    }

    fn tick(&mut self, expr: IdedExpr) -> IdedExpr {
        if matches!(&expr.expr, Expr::Call(c) if c.func_name == TICK) {
            return expr;
        }
        self.node(Expr::Call(CallExpr {
            func_name: TICK.to_owned(),
            target: None,
            args: vec![expr],
        }))
    }

    /// `quantity("lit")`, `semver("lit")` or `semver("lit", bool)` that parse: their value.
    fn constant(call: &CallExpr) -> Option<Box<dyn Val>> {
        if call.target.is_some() {
            return None;
        }
        let text = match call.args.first().map(|a| &a.expr) {
            Some(Expr::Literal(LiteralValue::String(s))) => s.inner(),
            _ => return None,
        };
        match (call.func_name.as_str(), call.args.get(1).map(|a| &a.expr)) {
            ("quantity", None) => Quantity::parse(text)
                .ok()
                .map(|q| Box::new(QuantityVal(q)) as Box<dyn Val>),
            ("semver", None) => Semver::parse(text)
                .ok()
                .map(|v| Box::new(SemverVal(v)) as Box<dyn Val>),
            ("semver", Some(Expr::Literal(LiteralValue::Boolean(normalize)))) => {
                let parsed = if *normalize.inner() {
                    Semver::parse_normalized(text)
                } else {
                    Semver::parse(text)
                };
                parsed.ok().map(|v| Box::new(SemverVal(v)) as Box<dyn Val>)
            }
            _ => None,
        }
    }

    fn rewrite(&mut self, expr: IdedExpr) -> IdedExpr {
        let id = expr.id;
        let rewritten = match expr.expr {
            Expr::Call(call) => {
                if let Some(value) = Self::constant(&call) {
                    let name = format!("{CONST_PREFIX}{}", self.constants.len());
                    self.constants.push(value);
                    return IdedExpr {
                        id,
                        expr: Expr::Ident(name),
                    };
                }
                let cheap = CHEAP.contains(&call.func_name.as_str());
                let is_range = call.func_name == "range"
                    && matches!(call.target.as_deref().map(|t| &t.expr), Some(Expr::Ident(n)) if n == "lists");
                let mut call = CallExpr {
                    func_name: call.func_name,
                    target: call.target.map(|t| Box::new(self.rewrite(*t))),
                    args: call.args.into_iter().map(|a| self.rewrite(a)).collect(),
                };
                if is_range && call.args.len() == 1 {
                    let n = call.args.pop().unwrap_or_default();
                    let charged = self.node(Expr::Call(CallExpr {
                        func_name: CHARGE_SIZE.to_owned(),
                        target: None,
                        args: vec![n],
                    }));
                    call.args.push(charged);
                }
                let node = IdedExpr {
                    id,
                    expr: Expr::Call(call),
                };
                return if cheap { node } else { self.tick(node) };
            }
            Expr::Comprehension(c) => Expr::Comprehension(Box::new(self.comprehension(*c))),
            Expr::Select(mut select) => {
                let operand = std::mem::take(&mut *select.operand);
                *select.operand = self.rewrite(operand);
                Expr::Select(select)
            }
            Expr::List(mut list) => {
                list.elements = std::mem::take(&mut list.elements)
                    .into_iter()
                    .map(|e| self.rewrite(e))
                    .collect();
                Expr::List(list)
            }
            Expr::Map(mut map) => {
                for entry in &mut map.entries {
                    if let EntryExpr::MapEntry(e) = &mut entry.expr {
                        e.key = self.rewrite(std::mem::take(&mut e.key));
                        e.value = self.rewrite(std::mem::take(&mut e.value));
                    }
                }
                Expr::Map(map)
            }
            Expr::Struct(mut s) => {
                for entry in &mut s.entries {
                    if let EntryExpr::StructField(f) = &mut entry.expr {
                        f.value = self.rewrite(std::mem::take(&mut f.value));
                    }
                }
                Expr::Struct(s)
            }
            other => other,
        };
        IdedExpr {
            id,
            expr: rewritten,
        }
    }

    /// Keeps the shapes the interpreter recognises (an `all` / `exists` fold, a `map` / `filter`
    /// append) and charges every iteration before its body runs, so that a spent budget stops each
    /// loop at its next iteration.
    fn comprehension(&mut self, mut c: ComprehensionExpr) -> ComprehensionExpr {
        c.iter_range = self.rewrite(std::mem::take(&mut c.iter_range));
        c.accu_init = self.rewrite(std::mem::take(&mut c.accu_init));
        c.result = self.rewrite(std::mem::take(&mut c.result));
        let accu = c.accu_var.clone();
        let is_accu = |e: &IdedExpr| matches!(&e.expr, Expr::Ident(n) if *n == accu);
        let is_append = |e: &IdedExpr| {
            matches!(&e.expr, Expr::Call(call) if call.func_name == operators::ADD
                && call.args.len() == 2 && is_accu(&call.args[0])
                && matches!(call.args[1].expr, Expr::List(_)))
        };
        let append_shape = is_accu(&c.result)
            && matches!(c.loop_cond.expr, Expr::Literal(_))
            && match &c.loop_step.expr {
                Expr::Call(call)
                    if call.func_name == operators::CONDITIONAL && call.args.len() == 3 =>
                {
                    is_append(&call.args[1]) && is_accu(&call.args[2])
                }
                _ => is_append(&c.loop_step),
            };
        if append_shape {
            // map / filter: tick the guard and each appended element.
            let step = std::mem::take(&mut c.loop_step);
            c.loop_step = self.append_step(step);
            return c;
        }
        let per_iteration = weight(&c.loop_cond)
            .saturating_add(weight(&c.loop_step))
            .max(1);
        let cond = self.rewrite(std::mem::take(&mut c.loop_cond));
        c.loop_cond = self.weighted_tick(cond, per_iteration);
        let step = std::mem::take(&mut c.loop_step);
        c.loop_step = match step.expr {
            Expr::Call(mut call)
                if (call.func_name == operators::LOGICAL_AND
                    || call.func_name == operators::LOGICAL_OR)
                    && call.target.is_none()
                    && call.args.len() == 2
                    && is_accu(&call.args[0]) =>
            {
                let rhs = call.args.pop().unwrap_or_default();
                call.args.push(self.rewrite(rhs));
                IdedExpr {
                    id: step.id,
                    expr: Expr::Call(call),
                }
            }
            other => self.rewrite(IdedExpr {
                id: step.id,
                expr: other,
            }),
        };
        c
    }

    fn append_step(&mut self, step: IdedExpr) -> IdedExpr {
        let IdedExpr { id, expr } = step;
        let Expr::Call(mut call) = expr else {
            return IdedExpr { id, expr };
        };
        if call.func_name == operators::CONDITIONAL {
            let mut args = std::mem::take(&mut call.args).into_iter();
            let (guard, append, otherwise) = (
                args.next().unwrap_or_default(),
                args.next().unwrap_or_default(),
                args.next().unwrap_or_default(),
            );
            let guard_weight = weight(&guard).max(1);
            let guard = self.rewrite(guard);
            call.args = vec![
                self.weighted_tick(guard, guard_weight),
                self.append_step(append),
                otherwise,
            ];
        } else if let Some(Expr::List(list)) = call.args.get_mut(1).map(|a| &mut a.expr) {
            let elements = std::mem::take(&mut list.elements);
            let mut ticked = Vec::with_capacity(elements.len());
            for element in elements {
                // The element, the append and the accumulator it reads.
                let element_weight = weight(&element).saturating_add(2);
                let element = self.rewrite(element);
                ticked.push(self.weighted_tick(element, element_weight));
            }
            if let Some(Expr::List(list)) = call.args.get_mut(1).map(|a| &mut a.expr) {
                list.elements = ticked;
            }
        }
        IdedExpr {
            id,
            expr: Expr::Call(call),
        }
    }
}

/// What one evaluation of `expr` costs in cel-go's terms (1 per identifier, field selection and call)
/// for the parts that are not ticked on their own: calls outside [`CHEAP`] tick themselves, and the
/// steps of a nested comprehension are charged by its own ticks.
fn weight(expr: &IdedExpr) -> u64 {
    let own = match &expr.expr {
        Expr::Ident(_) | Expr::Select(_) => 1,
        Expr::Call(call) if CHEAP.contains(&call.func_name.as_str()) => 1,
        _ => 0,
    };
    let mut total: u64 = own;
    match &expr.expr {
        Expr::Comprehension(c) => {
            for part in [&c.iter_range, &c.accu_init, &c.result] {
                total = total.saturating_add(weight(part));
            }
        }
        _ => super::check::for_each_child(expr, &mut |child| {
            total = total.saturating_add(weight(child))
        }),
    }
    total
}
