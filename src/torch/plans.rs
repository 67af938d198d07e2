//! The plan table: per config and problem, the prepared plans (tuned through the cache on
//! first sight, by the C ABI's [`Tuner`], the one in-process tuner of language bindings) or
//! the reason PyTorch runs that problem; and the tuners, one per device and cache, shared by
//! every config that names them.
//!
//! Bounded: the table keeps at most [`DEFAULT_CAPACITY`] plan sets (settable), evicting the
//! least recently used; an evicted problem is prepared again from the cache, without
//! measuring. A host (CPU) tuner runs every plan over one workspace that grows to the largest
//! plan's (the C ABI tuner's own), not one per problem. A tuner is closed (its cache file with it) when no config and
//! no plan set uses it; a config's plan sets go with its last holder.
//!
//! A call takes its problem's slot (creating it), then the slot's lock: tuning a problem holds
//! that slot and the tuner, never the table, so other problems run meanwhile and two threads
//! that miss the same problem tune it once.

use super::call::{Device, Signature};
use super::registry::{CacheChoice, Config, Who};
use crate::c_abi::error::FfiError;
use crate::c_abi::mucudnnStatus_t;
use crate::c_abi::tuner::{parse_settings, Tuner, TunerDevice};
use crate::cache::Cache;
use crate::solver::{AlgoNames, ConvOp, ConvProblem, Plan};
use serde::Serialize;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Instant;

/// Plan sets kept at most, unless set otherwise (`MUCUDNN_TORCH_PLAN_SETS`, or
/// `mucudnn.torch.set_plan_capacity`).
pub const DEFAULT_CAPACITY: usize = 1024;

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

pub fn op_index(op: ConvOp) -> usize {
    match op {
        ConvOp::Forward => 0,
        ConvOp::BackwardData => 1,
        ConvOp::BackwardFilter => 2,
    }
}

/// What a plan set is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PlanKey {
    pub config: u64,
    /// With its batch size, layout, dtype and math mode.
    pub problem: ConvProblem,
    pub device: Device,
    /// Only deterministic candidates (PyTorch's determinism switches).
    pub deterministic: bool,
}

/// A tuner (on the CPU it runs every plan over one workspace of its own).
pub struct TunerState {
    pub tuner: Tuner,
}

pub struct TunerSlot {
    pub device: Device,
    state: Mutex<TunerState>,
}

impl TunerSlot {
    pub fn lock(&self) -> MutexGuard<'_, TunerState> {
        lock(&self.state)
    }
}

/// A problem's prepared plans (one to three ops), released from their tuner when the last call
/// holding them returns.
pub struct Ready {
    pub tuner: Arc<TunerSlot>,
    pub id: u64,
    pub plans: [Option<Plan>; 3],
    pub workspace: [u64; 3],
    pub report: Report,
}

impl Ready {
    pub fn has(&self, op: ConvOp) -> bool {
        self.plans[op_index(op)].is_some()
    }
}

impl Drop for Ready {
    fn drop(&mut self) {
        // A set that cannot be released is only memory.
        let _ = self.tuner.lock().tuner.release(self.id);
    }
}

/// What a problem's slot holds.
#[derive(Clone)]
pub enum Entry {
    Ready(Arc<Ready>),
    /// PyTorch runs this problem, for this reason (said once, when decided).
    Fallback(Arc<str>),
}

/// How one problem's plans came to be, as `plans` reports show it.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Report {
    /// The layer (or problem) whose call tuned it.
    pub name: String,
    pub problem: Option<ConvProblem>,
    /// The call's input and weight sizes as called, and what it returned.
    pub input: Vec<i64>,
    pub weight: Vec<i64>,
    pub output: Vec<i64>,
    pub transposed: bool,
    pub device: String,
    pub deterministic: bool,
    pub plans: Vec<Plan>,
    pub splits: Vec<String>,
    pub cached: usize,
    pub measured: usize,
    pub skipped: usize,
    pub peak_measuring_memory_bytes: u64,
    pub tuning_seconds: f64,
    pub fallback: Option<String>,
}

/// A problem's entry, locked while it is tuned (by one call; others wait for it).
type Cell = Arc<Mutex<Option<Entry>>>;

struct Slot {
    cell: Cell,
    used: u64,
    /// The signatures whose calls used it: layers of other signatures can share a problem (a
    /// transposed layer mirrors the convolution whose backward-data it runs), and each reports
    /// the plans it runs.
    signatures: Vec<Signature>,
}

#[derive(Default)]
struct Table {
    slots: HashMap<PlanKey, Slot>,
    clock: u64,
}

/// The plan table and the tuners.
pub struct Plans {
    table: Mutex<Table>,
    tuners: Mutex<HashMap<(Device, CacheChoice), Weak<TunerSlot>>>,
    capacity: AtomicUsize,
}

impl Default for Plans {
    fn default() -> Self {
        let capacity = std::env::var("MUCUDNN_TORCH_PLAN_SETS")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|&v| v > 0)
            .unwrap_or(DEFAULT_CAPACITY);
        Plans {
            table: Mutex::default(),
            tuners: Mutex::default(),
            capacity: AtomicUsize::new(capacity),
        }
    }
}

/// What a call asks of the table.
pub struct Request<'a> {
    pub who: &'a Who,
    pub key: PlanKey,
    pub signature: Signature,
    /// The ops the call runs now.
    pub needed: &'a [ConvOp],
    /// Tune all three ops on a miss (a backward may follow), not only `needed`.
    pub training: bool,
    /// Report fields of the call (sizes as called).
    pub input: &'a [i64],
    pub weight: &'a [i64],
    pub output: &'a [i64],
    pub transposed: bool,
    /// Say on stderr that a shape was tuned on first use (not under `tune()`).
    pub announce: bool,
    /// Asked before tuning (not on a hit): why tuning cannot happen now (a CUDA stream being
    /// captured into a graph), else `None` once the device is ready to measure on.
    pub before_tuning: Option<&'a dyn Fn() -> Option<String>>,
}

/// Why a request has no plans: PyTorch runs it (`fallback`), or an error for the caller.
pub enum Miss {
    Fallback(Arc<str>),
    Error(String),
}

impl Plans {
    pub fn capacity(&self) -> usize {
        self.capacity.load(Ordering::Relaxed)
    }

    /// Sets the most plan sets kept (at least 1), evicting beyond it now.
    pub fn set_capacity(&self, capacity: usize) {
        self.capacity.store(capacity.max(1), Ordering::Relaxed);
        let evicted = {
            let mut table = lock(&self.table);
            self.evict(&mut table)
        };
        drop(evicted);
    }

    /// The slots kept now.
    pub fn len(&self) -> usize {
        lock(&self.table).slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn evict(&self, table: &mut Table) -> Vec<Slot> {
        let capacity = self.capacity();
        let mut evicted = Vec::new();
        while table.slots.len() > capacity {
            let oldest = table
                .slots
                .iter()
                .min_by_key(|(_, slot)| slot.used)
                .map(|(key, _)| *key)
                .expect("non-empty");
            evicted.extend(table.slots.remove(&oldest));
        }
        evicted
    }

    fn slot(&self, key: &PlanKey, signature: Signature) -> Cell {
        let (cell, evicted) = {
            let mut table = lock(&self.table);
            table.clock += 1;
            let clock = table.clock;
            let slot = table.slots.entry(*key).or_insert_with(|| Slot {
                cell: Arc::default(),
                used: clock,
                signatures: Vec::new(),
            });
            slot.used = clock;
            if !slot.signatures.contains(&signature) {
                slot.signatures.push(signature);
            }
            let cell = slot.cell.clone();
            (cell, self.evict(&mut table))
        };
        // Released outside the table's lock (a release locks its tuner).
        drop(evicted);
        cell
    }

    /// Drops every slot of a config (its last holder went).
    pub fn forget_config(&self, config: u64) {
        let removed: Vec<Slot> = {
            let mut table = lock(&self.table);
            let keys: Vec<PlanKey> = table
                .slots
                .keys()
                .filter(|k| k.config == config)
                .copied()
                .collect();
            keys.iter().filter_map(|k| table.slots.remove(k)).collect()
        };
        drop(removed);
    }

    /// The reports of a config's problems of `signature` (a layer's `plans`), oldest first.
    pub fn reports(&self, config: u64, signature: Option<&Signature>) -> Vec<Report> {
        let mut slots: Vec<(u64, PlanKey, Cell)> = {
            let table = lock(&self.table);
            table
                .slots
                .iter()
                .filter(|(k, s)| {
                    k.config == config && signature.is_none_or(|sig| s.signatures.contains(sig))
                })
                .map(|(k, s)| (s.used, *k, s.cell.clone()))
                .collect()
        };
        slots.sort_by_key(|(used, _, _)| *used);
        // Each slot's lock outside the table's: a slot may be tuning.
        slots
            .iter()
            .filter_map(|(_, key, cell)| match &*lock(cell) {
                Some(Entry::Ready(ready)) => Some(ready.report.clone()),
                Some(Entry::Fallback(reason)) => Some(Report {
                    problem: Some(key.problem),
                    fallback: Some(reason.to_string()),
                    deterministic: key.deterministic,
                    ..Report::default()
                }),
                None => None,
            })
            .collect()
    }

    /// The tuner a config uses on `device` (kept by the config, so that an in-memory cache
    /// lives as long as its config; shared with every config of the same device and cache).
    pub fn tuner_for(&self, config: &Config, device: Device) -> Result<Arc<TunerSlot>, FfiError> {
        let mut held = lock(&config.tuners);
        if let Some(slot) = held.get(&device) {
            return Ok(slot.clone());
        }
        let slot = self.tuner(device, &config.cache, config.verbose)?;
        held.insert(device, slot.clone());
        Ok(slot)
    }

    /// The tuner of `device` and `cache` (made on first use; shared).
    fn tuner(
        &self,
        device: Device,
        cache: &CacheChoice,
        verbose: bool,
    ) -> Result<Arc<TunerSlot>, FfiError> {
        let mut tuners = lock(&self.tuners);
        // The default file as it resolves now (`MUCUDNN_CACHE` may have changed since).
        let cache = match cache {
            CacheChoice::Default => match crate::cache::default_path() {
                Some(path) => CacheChoice::Path(path),
                None => CacheChoice::Default,
            },
            other => other.clone(),
        };
        let cache = &cache;
        let key = (device, cache.clone());
        if let Some(slot) = tuners.get(&key).and_then(Weak::upgrade) {
            return Ok(slot);
        }
        tuners.retain(|_, weak| weak.strong_count() > 0);
        let tuner_device = match device {
            Device::Cpu => TunerDevice::Cpu,
            Device::Cuda(index) => TunerDevice::Cuda(usize::try_from(index).unwrap_or(0)),
            Device::Other => {
                return Err(FfiError::NotSupported(
                    "mucudnn runs CPU and CUDA tensors only".into(),
                ))
            }
        };
        let tuner = match cache {
            CacheChoice::Memory => Tuner::new(
                tuner_device,
                Some(Cache::in_memory().quiet()),
                None,
                verbose,
            ),
            CacheChoice::Default => Tuner::new(tuner_device, None, None, verbose),
            CacheChoice::Path(path) => Tuner::new(tuner_device, None, Some(path.clone()), verbose),
        }?;
        let slot = Arc::new(TunerSlot {
            device,
            state: Mutex::new(TunerState { tuner }),
        });
        tuners.insert(key, Arc::downgrade(&slot));
        Ok(slot)
    }

    /// The plans of a request: prepared before, or tuned now through the cache (the ops
    /// missing), or why PyTorch runs it.
    pub fn ready(&self, request: &Request<'_>) -> Result<Arc<Ready>, Miss> {
        let cell = self.slot(&request.key, request.signature);
        let mut entry = lock(&cell);
        let earlier = match &*entry {
            Some(Entry::Fallback(reason)) => return Err(Miss::Fallback(reason.clone())),
            Some(Entry::Ready(ready)) if request.needed.iter().all(|&op| ready.has(op)) => {
                return Ok(ready.clone())
            }
            Some(Entry::Ready(ready)) => Some(ready.clone()),
            None => None,
        };
        if let Some(why) = request.before_tuning.and_then(|check| check()) {
            return Err(Miss::Error(why));
        }
        let outcome = self.tune(request, earlier.as_deref());
        match outcome {
            Ok(ready) => {
                let ready = Arc::new(ready);
                let old = entry.replace(Entry::Ready(ready.clone()));
                drop(entry);
                drop(old);
                drop(earlier);
                Ok(ready)
            }
            Err(Miss::Fallback(reason)) => {
                *entry = Some(Entry::Fallback(reason.clone()));
                Err(Miss::Fallback(reason))
            }
            Err(error) => Err(error),
        }
    }

    /// Puts plans tuned elsewhere (another rank's) into a problem's slot.
    pub fn adopt(&self, request: &Request<'_>, plans: Vec<Plan>) -> Result<(), FfiError> {
        let config = &request.who.config;
        let slot = self.tuner_for(config, request.key.device)?;
        let cell = self.slot(&request.key, request.signature);
        let mut entry = lock(&cell);
        let names = {
            let mut state = slot.lock();
            AlgoNames::new(state.tuner.fingerprint()?.backend)
        };
        let splits = plans.iter().map(|p| p.split_string(names)).collect();
        let mut report = self.report(request, 0.0);
        report.plans = plans.clone();
        report.splits = splits;
        let ready = prepare(&slot, plans, report)?;
        let old = entry.replace(Entry::Ready(Arc::new(ready)));
        drop(entry);
        drop(old);
        Ok(())
    }

    fn report(&self, request: &Request<'_>, seconds: f64) -> Report {
        Report {
            name: request.who.name.to_string(),
            problem: Some(request.key.problem),
            input: request.input.to_vec(),
            weight: request.weight.to_vec(),
            output: request.output.to_vec(),
            transposed: request.transposed,
            device: match request.key.device {
                Device::Cpu => "cpu".into(),
                Device::Cuda(i) => format!("cuda:{i}"),
                Device::Other => "other".into(),
            },
            deterministic: request.key.deterministic,
            tuning_seconds: seconds,
            ..Report::default()
        }
    }

    fn tune(&self, request: &Request<'_>, earlier: Option<&Ready>) -> Result<Ready, Miss> {
        let who = request.who;
        let config: &Config = &who.config;
        let fallback_or = |e: FfiError| -> Miss {
            let falls_back = matches!(
                e.status(),
                mucudnnStatus_t::MUCUDNN_STATUS_NOT_SUPPORTED
                    | mucudnnStatus_t::MUCUDNN_STATUS_SOLVER_ERROR
                    | mucudnnStatus_t::MUCUDNN_STATUS_PLAN_NOT_SUPPORTED
            );
            if config.fallback && falls_back {
                let reason: Arc<str> = Arc::from(e.to_string());
                eprintln!(
                    "mucudnn: warning: {}: input shape {} runs PyTorch's convolution: {reason}",
                    who.name,
                    shape_text(request.input)
                );
                Miss::Fallback(reason)
            } else {
                Miss::Error(format!(
                    "{}: tuning input shape {} failed: {e}",
                    who.name,
                    shape_text(request.input)
                ))
            }
        };
        let started = Instant::now();
        let wanted: Vec<ConvOp> = ConvOp::ALL
            .into_iter()
            .filter(|&op| request.training || request.needed.contains(&op))
            .filter(|&op| earlier.is_none_or(|e| !e.has(op)))
            .collect();
        let slot = self
            .tuner_for(config, request.key.device)
            .map_err(|e| Miss::Error(format!("{}: {e}", who.name)))?;
        let device = match request.key.device {
            Device::Cuda(index) => TunerDevice::Cuda(usize::try_from(index).unwrap_or(0)),
            _ => TunerDevice::Cpu,
        };
        let mut settings = parse_settings(&config.settings, device)
            .map_err(|e| Miss::Error(format!("{}: {e}", who.name)))?;
        settings.ops = wanted;
        settings.tuning.engines.deterministic = request.key.deterministic;
        let result = {
            let mut state = slot.lock();
            state
                .tuner
                .tune(&who.name, &request.key.problem, &settings)
                .map_err(fallback_or)?
        };
        let mut report = self.report(request, started.elapsed().as_secs_f64());
        let mut plans = result.plans.clone();
        let mut splits = result.splits.clone();
        if let Some(earlier) = earlier {
            for (plan, split) in earlier.report.plans.iter().zip(&earlier.report.splits) {
                if !plans.iter().any(|p| p.op == plan.op) {
                    plans.push(plan.clone());
                    splits.push(split.clone());
                }
            }
            report.cached += earlier.report.cached;
            report.measured += earlier.report.measured;
            report.tuning_seconds += earlier.report.tuning_seconds;
        }
        // Plans in fwd, bwd_data, bwd_filter order, as reports show them.
        let mut order: Vec<usize> = (0..plans.len()).collect();
        order.sort_by_key(|&i| op_index(plans[i].op));
        report.plans = order.iter().map(|&i| plans[i].clone()).collect();
        report.splits = order.iter().map(|&i| splits[i].clone()).collect();
        report.cached += result.cached;
        report.measured += result.measured;
        report.skipped = result.skipped;
        report.peak_measuring_memory_bytes = result.peak_measuring_memory_bytes;
        let ready = prepare(&slot, report.plans.clone(), report).map_err(fallback_or)?;
        if request.announce && !quiet() {
            eprintln!(
                "mucudnn: {}: tuned input shape {} ({} {}) on first use in {:.2} s ({} \
                 measured, {} cached); call mucudnn.torch.tune(model, example_inputs) ahead of \
                 training to tune before the first step (MUCUDNN_QUIET=1 silences this)",
                who.name,
                shape_text(request.input),
                request.key.problem.dtype,
                request.key.problem.layout_name(),
                ready.report.tuning_seconds,
                result.measured,
                result.cached
            );
        }
        Ok(ready)
    }
}

/// Prepares `plans` (one per op) on a tuner.
fn prepare(slot: &Arc<TunerSlot>, plans: Vec<Plan>, report: Report) -> Result<Ready, FfiError> {
    let mut by_op: [Option<Plan>; 3] = [None, None, None];
    for plan in &plans {
        by_op[op_index(plan.op)] = Some(plan.clone());
    }
    let (id, workspace) = slot.lock().tuner.prepare(plans)?;
    Ok(Ready {
        tuner: slot.clone(),
        id,
        plans: by_op,
        workspace,
        report,
    })
}

/// Whether the user asked for quiet (`MUCUDNN_QUIET=1`): no line per lazily tuned shape.
pub fn quiet() -> bool {
    !matches!(
        std::env::var("MUCUDNN_QUIET")
            .unwrap_or_default()
            .trim()
            .to_ascii_lowercase()
            .as_str(),
        "" | "0" | "false" | "no"
    )
}

pub fn shape_text(sizes: &[i64]) -> String {
    let parts: Vec<String> = sizes.iter().map(i64::to_string).collect();
    parts.join("x")
}
