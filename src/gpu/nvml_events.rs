//! The event loop of the NVML backend: registers every GPU for the health events it supports (XID,
//! ECC, MIG changes), waits on the event set, and polls what NVML has no events for (pending memory
//! retirement or row remapping, lost GPUs). Safe code only; the raw calls live in `nvml.rs`.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::MutexGuard;
use std::time::Duration;

use nvml_wrapper::error::{nvml_try, NvmlError};
use nvml_wrapper::EventSet;

use super::nvml::{
    handle_key, register_events, remapped_rows, wait_raw, Failed, Named, NvmlBackend,
};
use super::nvml_support::{self as support, event_bits};
use super::{GpuError, GpuEvent, GpuEventKind};

#[derive(Default)]
pub(super) struct EventState {
    started: bool,
    set: Option<EventSet<'static>>,
    /// Registered GPUs: NVML device handle (as an address) → UUID.
    monitored: HashMap<usize, String>,
    /// GPUs whose events could not be registered, with the reason.
    unmonitored: Vec<(String, String)>,
    pending: VecDeque<GpuEvent>,
    lost: BTreeSet<String>,
    /// Memory health per GPU as last polled: (retirement or remap pending, remap failed).
    memory: HashMap<String, (bool, bool)>,
    last_memory_poll: Option<std::time::Instant>,
}

/// How often memory health (pending retirement, row remapping) and lost GPUs are polled: NVML has no
/// events for them.
const MEMORY_POLL: Duration = Duration::from_secs(10);

impl NvmlBackend {
    /// GPUs whose health events are not watched, with the reason (known after the first
    /// `wait_event`), so that the health side can mark them unmonitored.
    pub fn unmonitored_gpus(&self) -> Vec<(String, String)> {
        match self.unmonitored.lock() {
            Ok(list) => list.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    fn lock_events(&self) -> MutexGuard<'_, EventState> {
        // A panic while waiting leaves the state usable (the set is still registered).
        self.events
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Creates the event set and registers every GPU for the health events it supports.
    fn start_events(&self, state: &mut EventState) -> Result<(), GpuError> {
        state.unmonitored.clear();
        let mut candidates = Vec::new();
        for index in 0..self.nvml.device_count().named("nvmlDeviceGetCount_v2")? {
            let device = self
                .nvml
                .device_by_index(index)
                .named("nvmlDeviceGetHandleByIndex_v2")?;
            let uuid = device.uuid().named("nvmlDeviceGetUUID")?;
            match device.supported_event_types() {
                Ok(types) if types.bits() & event_bits::HEALTH != 0 => {
                    candidates.push((device, uuid, types.bits() & event_bits::HEALTH))
                }
                Ok(_) => state
                    .unmonitored
                    .push((uuid, "supports no XID, ECC or MIG event".into())),
                Err(e) => state
                    .unmonitored
                    .push((uuid, support::describe_nvml_error(&e))),
            }
        }
        // NVML leaves a set undefined after an UNKNOWN registration error: start again without
        // that GPU.
        'sets: loop {
            let set = self.nvml.create_event_set().named("nvmlEventSetCreate")?;
            state.monitored.clear();
            for (device, uuid, bits) in &candidates {
                if state.unmonitored.iter().any(|(u, _)| u == uuid) {
                    continue;
                }
                match register_events(device, *bits, &set) {
                    Ok(()) => {
                        state.monitored.insert(handle_key(device), uuid.clone());
                    }
                    Err(f) => {
                        state
                            .unmonitored
                            .push((uuid.clone(), support::describe_nvml_error(&f.error)));
                        if matches!(f.error, NvmlError::Unknown) {
                            continue 'sets;
                        }
                    }
                }
            }
            state.set = Some(set);
            return Ok(());
        }
    }

    /// Lost-GPU events: the device NVML named, else every watched GPU that now answers "lost",
    /// else (NVML could not tell which) every watched GPU, as NVIDIA's own plugin does.
    /// Queues events for memory health changes: retirement or row remapping newly pending, a failed
    /// remap, and `Recovered` when pending work cleared without failure (the GPU was reset) or a lost
    /// GPU answers again.
    fn poll_memory_health(&self, state: &mut EventState) {
        let uuids: Vec<String> = state.monitored.values().cloned().collect();
        for uuid in uuids {
            let Ok(device) = self.nvml.device_by_uuid(uuid.as_str()) else {
                continue;
            };
            if state.lost.contains(&uuid) {
                if device.memory_info().is_ok() {
                    state.lost.remove(&uuid);
                    state
                        .pending
                        .push_back(event(&uuid, GpuEventKind::Recovered));
                }
                continue;
            }
            let (pending, failed) = match remapped_rows(&device) {
                Ok(rows) => rows,
                // Before Ampere: page retirement instead of row remapping.
                Err(_) => match device.are_pages_pending_retired() {
                    Ok(pending) => (pending, false),
                    Err(_) => continue,
                },
            };
            let before = state.memory.insert(uuid.clone(), (pending, failed));
            let (was_pending, was_failed) = before.unwrap_or((false, false));
            if failed && !was_failed {
                state
                    .pending
                    .push_back(event(&uuid, GpuEventKind::RowRemapFailure));
            } else if pending && !was_pending {
                state
                    .pending
                    .push_back(event(&uuid, GpuEventKind::RetirementPending));
            } else if was_pending && !pending && !failed {
                state
                    .pending
                    .push_back(event(&uuid, GpuEventKind::Recovered));
            }
        }
    }

    fn queue_lost(&self, state: &mut EventState, device_key: usize) {
        let answers_lost = |uuid: &&String| {
            let device = self.nvml.device_by_uuid(uuid.as_str());
            matches!(
                device.and_then(|d| d.memory_info()),
                Err(NvmlError::GpuLost)
            )
        };
        let lost: Vec<String> = match state.monitored.get(&device_key) {
            Some(uuid) => vec![uuid.clone()],
            None => {
                let found: Vec<String> = state
                    .monitored
                    .values()
                    .filter(answers_lost)
                    .cloned()
                    .collect();
                if found.is_empty() {
                    state.monitored.values().cloned().collect()
                } else {
                    found
                }
            }
        };
        for uuid in lost {
            if state.lost.insert(uuid.clone()) {
                state.pending.push_back(GpuEvent {
                    gpu_uuid: uuid,
                    gpu_instance_id: None,
                    compute_instance_id: None,
                    kind: GpuEventKind::Lost,
                });
            }
        }
    }

    /// `GpuBackend::wait_event`: a queued event, else a memory-health poll when due, else a wait on
    /// the event set.
    pub(super) fn next_event(&self, timeout: Duration) -> Result<Option<GpuEvent>, GpuError> {
        let mut state = self.lock_events();
        if let Some(event) = state.pending.pop_front() {
            return Ok(Some(event));
        }
        if !state.started {
            if let Err(e) = self.start_events(&mut state) {
                // Retried on the next call; the sleep keeps a caller's loop from spinning.
                drop(state);
                std::thread::sleep(timeout);
                return Err(e);
            }
            state.started = true;
            if let Ok(mut list) = self.unmonitored.lock() {
                list.clone_from(&state.unmonitored);
            }
            // Reported once; afterwards the GPUs that did register are watched.
            if !state.unmonitored.is_empty() {
                let list: Vec<String> = state
                    .unmonitored
                    .iter()
                    .map(|(uuid, why)| format!("{uuid}: {why}"))
                    .collect();
                return Err(GpuError::Nvml {
                    call: "nvmlDeviceRegisterEvents".to_string(),
                    reason: format!("health events are not watched on {}", list.join("; ")),
                });
            }
        }
        let due = state
            .last_memory_poll
            .is_none_or(|at| at.elapsed() >= MEMORY_POLL);
        if due {
            state.last_memory_poll = Some(std::time::Instant::now());
            self.poll_memory_health(&mut state);
            if let Some(event) = state.pending.pop_front() {
                return Ok(Some(event));
            }
        }
        let ms = timeout.as_millis().min(u128::from(u32::MAX)) as u32;
        let outcome = match &state.set {
            Some(set) if !state.monitored.is_empty() => Some(wait_raw(set, ms)?),
            _ => None,
        };
        let (code, data) = match outcome {
            Some(outcome) => outcome,
            None => {
                drop(state);
                std::thread::sleep(timeout);
                return Ok(None);
            }
        };
        let key = data.device as usize;
        match nvml_try(code) {
            Ok(()) => Ok(Some(GpuEvent {
                gpu_uuid: match state.monitored.get(&key) {
                    Some(uuid) => uuid.clone(),
                    None => format!("unknown GPU (NVML handle {key:#x})"),
                },
                gpu_instance_id: support::instance_id(data.gpuInstanceId),
                compute_instance_id: support::instance_id(data.computeInstanceId),
                kind: support::event_kind(data.eventType, data.eventData),
            })),
            Err(NvmlError::Timeout) => Ok(None),
            Err(NvmlError::GpuLost) => {
                self.queue_lost(&mut state, key);
                if let Some(event) = state.pending.pop_front() {
                    return Ok(Some(event));
                }
                // Every loss is reported already and NVML keeps answering "lost".
                drop(state);
                std::thread::sleep(timeout);
                Ok(None)
            }
            Err(e) => Err(Failed {
                call: "nvmlEventSetWait_v2",
                error: e,
            }
            .into()),
        }
    }
}

fn event(uuid: &str, kind: GpuEventKind) -> GpuEvent {
    GpuEvent {
        gpu_uuid: uuid.to_string(),
        gpu_instance_id: None,
        compute_instance_id: None,
        kind,
    }
}
