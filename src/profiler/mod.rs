//! The profiler: measure every algorithm of an op at every micro-batch size a policy allows,
//! producing the raw [`OpProfile`] that the cache stores and the solver reads.
//!
//! With several devices of one model, sizes are dealt out round-robin, one thread and one
//! backend per device (as µ-cuDNN's benchmark devices do); the results are merged in size order.

pub mod prune;

use crate::backend::{
    check_supported, Backend, BackendError, MeasureSettings, Measured, MemoryUse, TimingSettings,
};
use crate::device::DeviceFingerprint;
use crate::solver::{
    AlgoKind, ConvOp, ConvProblem, IndexError, IndexLimit, OpKey, OpProfile, Policy, SplitDim,
};

/// One tuning problem to measure.
#[derive(Clone, Debug, PartialEq)]
pub struct Job {
    pub layer: String,
    pub problem: ConvProblem,
    pub op: ConvOp,
    /// What the sizes split: micro-batches, or chunks along the split axis.
    pub split: SplitDim,
}

impl Job {
    /// A job that splits the batch.
    pub fn batch(layer: impl Into<String>, problem: ConvProblem, op: ConvOp) -> Job {
        Job {
            layer: layer.into(),
            problem,
            op,
            split: SplitDim::Batch,
        }
    }

    /// What the job measures: its problem, op and split.
    pub fn key(&self) -> OpKey {
        OpKey::new(self.problem, self.op, self.split)
    }

    /// The sizes `policy` allows whose calls fit `limit` (32-bit indexing, see
    /// [`IndexLimit::sizes`]): of the batch, or of the op's extent along the split axis. An
    /// error when no size fits. The problem is valid (every caller checks it first).
    pub fn sizes(&self, policy: Policy, limit: IndexLimit) -> Result<Vec<i64>, IndexError> {
        limit.sizes(policy, &self.problem, self.op, self.split)
    }

    /// [`Job::sizes`] under cuDNN's limit, an error naming the layer when none fits.
    fn sizes_or_invalid(&self, policy: Policy) -> Result<Vec<i64>, BackendError> {
        self.sizes(policy, IndexLimit::CUDNN)
            .map_err(|e| BackendError::Invalid(format!("{}: {e}", self.layer)))
    }
}

/// Reported after each measured micro-batch size.
#[derive(Clone, Copy, Debug)]
pub struct Progress<'a> {
    pub job: &'a Job,
    pub micro: i64,
    /// Sizes measured so far for this job, and in all.
    pub done: usize,
    pub total: usize,
}

/// Measures one job's legacy algorithms on one backend (every one, at every size), then
/// releases the backend's measuring state.
pub fn profile_job(
    backend: &mut dyn Backend,
    job: &Job,
    policy: Policy,
    timing: &TimingSettings,
    progress: &mut dyn FnMut(Progress<'_>),
) -> Result<OpProfile, BackendError> {
    job.problem
        .validate()
        .map_err(|e| BackendError::Invalid(format!("{}: {e}", job.layer)))?;
    let sizes = job.sizes_or_invalid(policy)?;
    let key = job.key().of_kind(AlgoKind::Legacy);
    let how = MeasureSettings::all(*timing);
    let mut measurements = Vec::new();
    for (index, &micro) in sizes.iter().enumerate() {
        let key = key.at(micro);
        let found = check_supported(backend, &key).and_then(|()| backend.measure(&key, &how));
        let found = match found {
            Ok(found) => found,
            Err(e) => {
                backend.release();
                return Err(e);
            }
        };
        measurements.extend(found.measurements);
        progress(Progress {
            job,
            micro,
            done: index + 1,
            total: sizes.len(),
        });
    }
    backend.release();
    Ok(OpProfile {
        layer: job.layer.clone(),
        problem: job.problem,
        op: job.op,
        split: job.split,
        measurements,
        skipped: Vec::new(),
        rejected: Vec::new(),
    })
}

/// Measures one job's legacy algorithms on several devices at once: device `d` takes sizes
/// `d, d + D, ...`.
/// `make(d)` opens the backend for device `d` inside its thread (cuDNN handles stay on the
/// thread that made them). All devices must have the same fingerprint name.
pub fn profile_job_parallel<B, F>(
    make: F,
    devices: usize,
    job: &Job,
    policy: Policy,
    timing: &TimingSettings,
) -> Result<(DeviceFingerprint, OpProfile), BackendError>
where
    B: Backend,
    F: Fn(usize) -> Result<B, BackendError> + Sync,
{
    job.problem
        .validate()
        .map_err(|e| BackendError::Invalid(format!("{}: {e}", job.layer)))?;
    let sizes = job.sizes_or_invalid(policy)?;
    let (fingerprint, by_size, _) =
        measure_sizes_parallel(&make, devices, job, AlgoKind::Legacy, &sizes, &|_| {
            MeasureSettings::all(*timing)
        })?;
    let measurements = by_size
        .into_iter()
        .flat_map(|(_, m)| m.measurements)
        .collect();
    Ok((
        fingerprint,
        OpProfile {
            layer: job.layer.clone(),
            problem: job.problem,
            op: job.op,
            split: job.split,
            measurements,
            skipped: Vec::new(),
            rejected: Vec::new(),
        },
    ))
}

/// Measurements per micro-batch size, in size order.
pub type BySize = Vec<(i64, Measured)>;

/// Measures `kind`'s candidates at `sizes` of one job (each as `how(size)` says: timing,
/// engine search, selection), dealt out round-robin over `devices` backends (one thread each,
/// made by `make(d)` in its thread and dropped at its end). Returns the common fingerprint,
/// the measurements per size, in size order, and the measuring memory the busiest device
/// held. Devices of different models are refused.
pub fn measure_sizes_parallel<B, F>(
    make: &F,
    devices: usize,
    job: &Job,
    kind: AlgoKind,
    sizes: &[i64],
    how: &(dyn Fn(i64) -> MeasureSettings + Sync),
) -> Result<(DeviceFingerprint, BySize, MemoryUse), BackendError>
where
    B: Backend,
    F: Fn(usize) -> Result<B, BackendError> + Sync,
{
    job.problem
        .validate()
        .map_err(|e| BackendError::Invalid(format!("{}: {e}", job.layer)))?;
    let key = job.key().of_kind(kind);
    let key = &key;
    let devices = devices.clamp(1, sizes.len().max(1));
    type Part = Result<(DeviceFingerprint, BySize, MemoryUse), BackendError>;
    let parts: Vec<Part> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..devices)
            .map(|device| {
                scope.spawn(move || -> Part {
                    let mut backend = make(device)?;
                    let mut measured = Vec::new();
                    for &micro in sizes.iter().skip(device).step_by(devices) {
                        let key = key.at(micro);
                        check_supported(&backend, &key)?;
                        let found = backend.measure(&key, &how(micro))?;
                        measured.push((micro, found));
                    }
                    Ok((backend.fingerprint().clone(), measured, backend.memory()))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(BackendError::Invalid("a profiling thread panicked".into()))
                })
            })
            .collect()
    });
    let mut fingerprint: Option<DeviceFingerprint> = None;
    let mut by_size = Vec::new();
    let mut memory = MemoryUse::default();
    for part in parts {
        let (device, measured, used) = part?;
        memory = memory.max(used);
        match &fingerprint {
            Some(first) if !same_model(first, &device) => {
                return Err(BackendError::MixedDevices {
                    first: first.to_string(),
                    other: device.to_string(),
                });
            }
            Some(_) => {}
            None => fingerprint = Some(device),
        }
        by_size.extend(measured);
    }
    by_size.sort_by_key(|(micro, _)| *micro);
    let fingerprint = fingerprint.ok_or_else(|| BackendError::Invalid("no device".into()))?;
    Ok((fingerprint, by_size, memory))
}

/// Whether two devices' measurements may be mixed in one profile.
pub fn same_model(a: &DeviceFingerprint, b: &DeviceFingerprint) -> bool {
    a.name == b.name && a.compute_capability == b.compute_capability
}
