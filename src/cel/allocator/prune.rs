//! Pruning: branches of the search that cannot lead to an allocation, cut without changing what the
//! search finds. Upstream's search has none of this and runs into the scheduler's filter timeout on a
//! claim such as two requests of 16 devices among 31 (kubernetes/kubernetes#131730).
//!
//! A branch is judged by counting: the devices still free that the selectors match must be enough
//! for the rest of this request and for every request after it, and all of that must fit in one
//! allocation. Counters, capacity, taints and constraints are left out, so the count is an upper
//! bound and a branch it cuts has no solution. Two things keep the cut from changing an error into
//! "not allocated": a branch with a device whose selectors fail (a CEL error, which the search would
//! report on reaching it) is not cut, and the count stops before the next request with an `All`
//! alternative (a constraint that all-mode devices cannot meet is an error too).

use super::search::{match_state, Match, Plan, State};
use super::MAX_RESULTS;

/// Whether slot `k` of alternative `a` of request `r`, filled from device `start` on, cannot be
/// completed together with the requests after `r`.
pub(super) fn hopeless(
    plan: &Plan<'_>,
    state: &mut State,
    r: usize,
    a: usize,
    k: usize,
    start: usize,
) -> bool {
    let devices = plan.pools.entries.len();
    let alternative = &plan.requests[r].alternatives[a];
    // Devices some remaining slot may take.
    let mut usable = vec![false; devices];
    let Some(here) = matching(plan, state, r, a, start, &mut usable) else {
        return false;
    };
    let mut needed = alternative.wanted() - k;
    if here < needed {
        return true;
    }
    let end = plan.next_all[r + 1];
    for later in r + 1..end {
        // The fewest devices the request can take with an alternative that has enough.
        let mut least: Option<usize> = None;
        for (la, other) in plan.requests[later].alternatives.iter().enumerate() {
            let mut these = vec![false; devices];
            let Some(count) = matching(plan, state, later, la, 0, &mut these) else {
                return false;
            };
            if count >= other.wanted() {
                least = Some(least.map_or(other.wanted(), |l| l.min(other.wanted())));
                for (u, t) in usable.iter_mut().zip(these) {
                    *u |= t;
                }
            }
        }
        match least {
            Some(least) => needed = needed.saturating_add(least),
            None => return true,
        }
    }
    if state.picked.len().saturating_add(needed) > MAX_RESULTS {
        return true;
    }
    // A device is taken once per claim, except one that allows multiple allocations: once per request.
    let requests = end - r;
    let capacity: usize = usable
        .iter()
        .enumerate()
        .filter(|(_, u)| **u)
        .map(|(entry, _)| {
            if plan.pools.entries[entry].multiple() {
                requests
            } else {
                1
            }
        })
        .sum();
    needed > capacity
}

/// How many devices from `start` on are free for alternative `a` of request `r` and matched by its
/// selectors, marking them in `usable`; `None` when a selector fails on one of them.
fn matching(
    plan: &Plan<'_>,
    state: &mut State,
    r: usize,
    a: usize,
    start: usize,
    usable: &mut [bool],
) -> Option<usize> {
    let admin = plan.requests[r].alternatives[a].admin;
    let mut count = 0;
    for (entry, mark) in usable.iter_mut().enumerate().skip(start) {
        if state.in_claim[entry] || (!admin && state.in_use[entry]) {
            continue;
        }
        match match_state(plan, state, r, a, entry) {
            Match::Yes => {
                count += 1;
                *mark = true;
            }
            Match::No => {}
            Match::Error | Match::Unknown => return None,
        }
    }
    Some(count)
}
