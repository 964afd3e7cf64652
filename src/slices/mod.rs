//! ResourceSlices: the planner splits the node's devices into slices within the API limits (pure), the
//! publisher keeps the API server's slices of this driver and node equal to the plan with as few writes
//! as it can.

pub mod kept_fields;
pub mod planner;
pub mod publisher;
mod reconcile;

pub use kept_fields::{GatedField, KeptFields};
pub use planner::{plan, PlannedSlice, ServerVersion};
pub use publisher::{desired_slices, PublishError, Publisher, SyncStats};
