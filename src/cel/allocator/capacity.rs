//! Consumable capacity (`DRAConsumableCapacity`) in the allocator, as the scheduler's experimental
//! allocator has it (`structured/internal/experimental/consumable_capacity.go`, 1.36 semantics): a device
//! with `allowMultipleAllocations` goes to several claims, and to several requests of one claim, while its
//! capacities last. What a request consumes of each capacity follows the capacity's `requestPolicy`:
//! the request's `capacity.requests` rounded up to `validRange.min + n × step` or to the next of
//! `validValues`, the policy's `default` (else the whole capacity) when the request names none. A
//! request that breaks the policy, names a capacity the device lacks or does not fit what is left does
//! not get the device. Devices without `allowMultipleAllocations` are checked the same way but stay
//! exclusive, and their results carry neither `consumedCapacity` nor `shareID`.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1::{
    CapacityRequirements, Device, DeviceCapacity, DeviceRequestAllocationResult,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity as ApiQuantity;

use super::search::{Plan, State};
use super::Candidate;
use crate::quantity::Quantity;

/// What other claims hold, from their allocation results (see [`in_use`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct InUse {
    /// Devices held whole: results without a `shareID`. No other claim gets them.
    pub devices: BTreeSet<Candidate>,
    /// Devices held in shares (results with a `shareID`), with the capacity the shares consume summed
    /// per device (empty where they consume none). Other claims may still get shares of them.
    pub shares: BTreeMap<Candidate, BTreeMap<String, Quantity>>,
    /// How many shares (allocation results with a `shareID`) hold each device of `shares`.
    pub share_holders: BTreeMap<Candidate, usize>,
}

impl From<BTreeSet<Candidate>> for InUse {
    /// Devices held whole.
    fn from(devices: BTreeSet<Candidate>) -> InUse {
        InUse {
            devices,
            ..InUse::default()
        }
    }
}

impl InUse {
    /// Records one share of `device` that consumes `consumed`.
    pub fn add_share(&mut self, device: Candidate, consumed: BTreeMap<String, Quantity>) {
        *self.share_holders.entry(device.clone()).or_default() += 1;
        let total = self.shares.entry(device).or_default();
        for (name, amount) in consumed {
            let sum = total.entry(name).or_insert_with(Quantity::zero);
            *sum = sum.add(&amount);
        }
    }
}

/// What allocation results hold, as the scheduler gathers it: admin-access results hold nothing; a
/// result with a `shareID` holds a share and its `consumedCapacity`; any other result holds the device
/// whole. A share whose `consumedCapacity` is not a quantity (which the API server never stores) is
/// taken as holding the device whole rather than as holding nothing.
pub fn in_use<'a>(results: impl IntoIterator<Item = &'a DeviceRequestAllocationResult>) -> InUse {
    let mut held = InUse::default();
    for result in results {
        if result.admin_access == Some(true) {
            continue;
        }
        let device = Candidate::of_result(result);
        if result.share_id.is_none() {
            held.devices.insert(device);
            continue;
        }
        let consumed: Result<BTreeMap<String, Quantity>, _> = result
            .consumed_capacity
            .iter()
            .flatten()
            .map(|(name, q)| Quantity::parse(&q.0).map(|q| (name.clone(), q)))
            .collect();
        match consumed {
            Ok(consumed) => held.add_share(device, consumed),
            Err(_) => {
                held.devices.insert(device);
            }
        }
    }
    held
}

/// An amount of a capacity with the text it is written as in a result.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Amount {
    pub(super) value: Quantity,
    text: String,
}

impl Amount {
    fn parse(text: &str) -> Result<Amount, String> {
        Ok(Amount {
            value: Quantity::parse(text).map_err(|e| format!("{text:?}: {e}"))?,
            text: text.to_string(),
        })
    }

    /// A computed amount, written with a binary suffix where that is exact.
    fn computed(value: Quantity) -> Amount {
        Amount {
            text: show(&value),
            value,
        }
    }

    pub(super) fn to_api(&self) -> ApiQuantity {
        ApiQuantity(self.text.clone())
    }
}

/// A quantity for people: whole numbers with the largest exact binary suffix (`20Gi`), others plainly.
pub(super) fn show(value: &Quantity) -> String {
    let Some(mut mantissa) = value.as_integer().filter(|v| *v > 0) else {
        return value.to_string();
    };
    let mut suffix = "";
    for next in ["Ki", "Mi", "Gi", "Ti", "Pi", "Ei"] {
        if mantissa % 1024 != 0 {
            break;
        }
        mantissa /= 1024;
        suffix = next;
    }
    format!("{mantissa}{suffix}")
}

/// A request's `capacity.requests`, parsed.
pub(super) type Requests = BTreeMap<String, Amount>;

pub(super) fn requests(capacity: Option<&CapacityRequirements>) -> Result<Requests, String> {
    capacity
        .and_then(|c| c.requests.as_ref())
        .into_iter()
        .flatten()
        .map(|(name, q)| {
            Amount::parse(&q.0)
                .map(|a| (name.clone(), a))
                .map_err(|e| format!("capacity.requests[{name}]: {e}"))
        })
        .collect()
}

/// A device's capacities and request policies, parsed once.
#[derive(Debug, Clone, Default)]
pub(super) struct Capacities {
    /// `allowMultipleAllocations`.
    pub(super) multiple: bool,
    by_name: BTreeMap<String, Capacity>,
}

#[derive(Debug, Clone)]
struct Capacity {
    value: Amount,
    default: Option<Amount>,
    valid_values: Vec<Amount>,
    range: Option<Range>,
}

#[derive(Debug, Clone)]
struct Range {
    min: Amount,
    max: Option<Amount>,
    step: Option<Amount>,
}

impl Capacities {
    /// Parsed from `device`; an unreadable quantity is the reason the device cannot be allocated.
    pub(super) fn of(device: &Device) -> Result<Capacities, String> {
        let mut by_name = BTreeMap::new();
        for (name, capacity) in device.capacity.iter().flatten() {
            let parsed =
                Capacity::of(capacity).map_err(|e| format!("has capacity {name} with {e}"))?;
            by_name.insert(name.clone(), parsed);
        }
        Ok(Capacities {
            multiple: device.allow_multiple_allocations == Some(true),
            by_name,
        })
    }

    /// What a request with `requests` consumes of each capacity of the device, or why it cannot have
    /// the device at all (`CmpRequestOverCapacity` before the comparison with what is left).
    pub(super) fn demand(&self, requests: &Requests) -> Result<BTreeMap<String, Amount>, String> {
        if let Some(name) = requests.keys().find(|n| !self.by_name.contains_key(*n)) {
            return Err(format!("has no capacity {name}"));
        }
        let mut demand = BTreeMap::new();
        for (name, capacity) in &self.by_name {
            let consumed = capacity.consumed(requests.get(name));
            if let Some(why) = capacity.violation(&consumed.value) {
                return Err(format!(
                    "cannot give {} of capacity {name}: {why}",
                    consumed.text
                ));
            }
            demand.insert(name.clone(), consumed);
        }
        Ok(demand)
    }

    /// The first capacity where `demand` on top of `used` exceeds the device's value, described.
    pub(super) fn shortage(
        &self,
        used: &BTreeMap<String, Quantity>,
        demand: &BTreeMap<String, Amount>,
    ) -> Option<String> {
        demand.iter().find_map(|(name, amount)| {
            let total = &self.by_name.get(name)?.value.value;
            let taken = used.get(name).cloned().unwrap_or_default();
            (taken.add(&amount.value) > *total).then(|| {
                format!(
                    "needs {} of capacity {name}, which has {} left",
                    amount.text,
                    show(&total.sub(&taken))
                )
            })
        })
    }
}

impl Capacity {
    fn of(capacity: &DeviceCapacity) -> Result<Capacity, String> {
        let policy = capacity.request_policy.as_ref();
        let optional = |q: Option<&ApiQuantity>| q.map(|q| Amount::parse(&q.0)).transpose();
        let range = match policy.and_then(|p| p.valid_range.as_ref()) {
            Some(range) => Some(Range {
                min: Amount::parse(&range.min.0)?,
                max: optional(range.max.as_ref())?,
                step: optional(range.step.as_ref())?,
            }),
            None => None,
        };
        Ok(Capacity {
            value: Amount::parse(&capacity.value.0)?,
            default: optional(policy.and_then(|p| p.default.as_ref()))?,
            valid_values: policy
                .and_then(|p| p.valid_values.as_ref())
                .into_iter()
                .flatten()
                .map(|q| Amount::parse(&q.0))
                .collect::<Result<_, _>>()?,
            range,
        })
    }

    fn has_policy(&self) -> bool {
        self.default.is_some() || !self.valid_values.is_empty() || self.range.is_some()
    }

    /// `calculateConsumedCapacity`: the policy's default (else the whole value) without a request;
    /// with one, rounded up to the range (from `min` in `step`s) or to the next valid value.
    fn consumed(&self, requested: Option<&Amount>) -> Amount {
        let Some(requested) = requested else {
            return self.default.clone().unwrap_or_else(|| self.value.clone());
        };
        if let Some(range) = &self.range {
            if requested.value < range.min.value {
                return range.min.clone();
            }
            let Some(step) = &range.step else {
                return requested.clone();
            };
            // Whole numbers as upstream's int64 arithmetic; a value beyond int64 is left as asked,
            // and the capacity comparison refuses it.
            let ints = (
                requested.value.ceil_integer(),
                range.min.value.ceil_integer(),
                step.value.ceil_integer(),
            );
            let (Some(asked), Some(min), Some(step)) = ints else {
                return requested.clone();
            };
            if step <= 0 {
                return requested.clone();
            }
            let steps = (asked - min).div_euclid(step) + i64::from((asked - min) % step != 0);
            return match steps.checked_mul(step).and_then(|s| s.checked_add(min)) {
                Some(value) if value == asked && requested.value.is_integer() => requested.clone(),
                Some(value) => Amount::computed(Quantity::from_int(value)),
                None => requested.clone(),
            };
        }
        if !self.valid_values.is_empty() {
            if let Some(next) = self
                .valid_values
                .iter()
                .find(|v| requested.value <= v.value)
            {
                return next.clone();
            }
        }
        requested.clone()
    }

    /// `violatesPolicy`: why `consumed` is not a value the policy allows, if it is not.
    fn violation(&self, consumed: &Quantity) -> Option<String> {
        if !self.has_policy() || self.default.as_ref().is_some_and(|d| d.value == *consumed) {
            return None;
        }
        if let Some(range) = &self.range {
            if let Some(max) = range.max.as_ref().filter(|max| *consumed > max.value) {
                return Some(format!("more than the request policy's max {}", max.text));
            }
            let step = range.step.as_ref()?;
            let ints = (
                consumed.ceil_integer(),
                range.min.value.ceil_integer(),
                step.value.ceil_integer(),
            );
            let off_step = match ints {
                (Some(v), Some(min), Some(s)) if s != 0 => (v - min) % s != 0,
                _ => true,
            };
            return off_step.then(|| {
                format!(
                    "not the request policy's min {} plus a multiple of its step {}",
                    range.min.text, step.text
                )
            });
        }
        if !self.valid_values.is_empty() && !self.valid_values.iter().any(|v| v.value == *consumed)
        {
            let values: Vec<&str> = self.valid_values.iter().map(|v| v.text.as_str()).collect();
            return Some(format!(
                "not one of the request policy's valid values {}",
                values.join(", ")
            ));
        }
        None
    }
}

/// What the claim being allocated holds of shared devices, on top of other claims' shares: the
/// capacity consumed per device entry, and how many shares hold it (other claims' count as one), so
/// that its shared counters are taken once.
#[derive(Debug, Clone)]
pub(super) struct Shares {
    pub(super) used: Vec<BTreeMap<String, Quantity>>,
    holders: Vec<u32>,
}

impl Shares {
    pub(super) fn new<'a>(devices: impl Iterator<Item = &'a Candidate>, in_use: &InUse) -> Shares {
        let mut shares = Shares {
            used: Vec::new(),
            holders: Vec::new(),
        };
        for device in devices {
            let used = in_use.shares.get(device).cloned();
            shares.holders.push(u32::from(used.is_some()));
            shares.used.push(used.unwrap_or_default());
        }
        shares
    }

    /// Whether some share holds the device already (its counters are taken).
    pub(super) fn held(&self, entry: usize) -> bool {
        self.holders[entry] > 0
    }

    /// Adds a share that consumes `consumed`; `holds` (not admin access) makes it hold the counters.
    pub(super) fn add(&mut self, entry: usize, consumed: &BTreeMap<String, Amount>, holds: bool) {
        self.holders[entry] += u32::from(holds);
        for (name, amount) in consumed {
            let sum = self.used[entry]
                .entry(name.clone())
                .or_insert_with(Quantity::zero);
            *sum = sum.add(&amount.value);
        }
    }

    /// Undoes [`Shares::add`].
    pub(super) fn remove(
        &mut self,
        entry: usize,
        consumed: &BTreeMap<String, Amount>,
        holds: bool,
    ) {
        self.holders[entry] = self.holders[entry].saturating_sub(u32::from(holds));
        for (name, amount) in consumed {
            if let Some(sum) = self.used[entry].get_mut(name) {
                *sum = sum.sub(&amount.value);
            }
        }
    }
}

/// What alternative `a` of request `r` would consume of the capacities of device `entry` now, or why
/// the device cannot serve it: its capacities are unreadable, its request policy refuses the request,
/// or too little is left after the shares already taken.
pub(super) fn demand(
    plan: &Plan<'_>,
    state: &State,
    r: usize,
    a: usize,
    entry: usize,
) -> Result<BTreeMap<String, Amount>, String> {
    let alternative = &plan.requests[r].alternatives[a];
    let capacities = plan.pools.entries[entry].capacities.as_ref()?;
    let demand = capacities.demand(&alternative.capacity)?;
    match capacities.shortage(&state.shares.used[entry], &demand) {
        Some(why) => Err(why),
        None => Ok(demand),
    }
}

/// Why a request with `capacity` does not get `device` for what its capacities have left after
/// the shares that hold it (`used`, consumed by `holders` shares), in an operator's words, as the
/// allocator decides it (`None` when it fits, or when the device's capacities cannot be read: the
/// allocator's message says that): `memory 40Gi requested, 9Gi left of 79Gi (2 claims hold 70Gi)`,
/// `shares: 4 of 4 taken`, or the request policy the request breaks.
pub fn share_shortfall(
    device: &Device,
    capacity: Option<&CapacityRequirements>,
    used: Option<&BTreeMap<String, Quantity>>,
    holders: usize,
) -> Option<String> {
    let capacities = Capacities::of(device).ok()?;
    let requests = requests(capacity).ok()?;
    let demand = match capacities.demand(&requests) {
        Ok(demand) => demand,
        Err(why) => return Some(why),
    };
    let empty = BTreeMap::new();
    let used = used.unwrap_or(&empty);
    demand.iter().find_map(|(name, amount)| {
        let total = &capacities.by_name.get(name)?.value.value;
        let taken = used.get(name).cloned().unwrap_or_default();
        if taken.add(&amount.value) <= *total {
            return None;
        }
        let claims = if holders == 1 {
            "claim holds"
        } else {
            "claims hold"
        };
        if name == "shares" {
            return Some(format!("shares: {} of {} taken", show(&taken), show(total)));
        }
        Some(format!(
            "{name} {} requested, {} left of {} ({holders} {claims} {})",
            amount.text,
            show(&total.sub(&taken)),
            show(total),
            show(&taken)
        ))
    })
}

/// A new share ID: a random UUID, as the scheduler makes (the API requires RFC 4122 form).
pub(super) fn new_share_id() -> String {
    uuid::Uuid::new_v4().to_string()
}

#[cfg(test)]
#[path = "capacity_tests.rs"]
mod tests;
