//! Backends that measure and run convolutions: [`cudnn`] on NVIDIA GPUs, [`cpu`] everywhere.
//!
//! The profiler sees a backend only through [`Backend`]: give it a [`MeasureKey`] (a problem,
//! an op, a split, a size and a candidate kind) and [`MeasureSettings`] (how to time, search and
//! select), get back the time and workspace of every candidate that works there.
//! Execution is backend-specific (device pointers or host slices, grouped by role in
//! [`ConvOperands`]) but shares the micro-batch stepping of [`crate::solver::steps`].

pub mod cpu;
pub mod cpu_timing;
pub mod cudnn;
pub mod cudnn_timing;
mod operands;
pub mod verify;

use crate::device::DeviceFingerprint;
use crate::solver::units::format_bytes;
use crate::solver::{
    Algo, AlgoKind, ConvOp, ConvProblem, EngineName, IndexLimit, MeasureKey, Operand, SplitDim,
};
use std::collections::BTreeSet;

pub use crate::solver::Measured;
pub use cpu_timing::CpuBackend;
pub use cudnn_timing::CudnnBackend;
pub use operands::ConvOperands;

/// How carefully to time one (micro-batch size, algorithm).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TimingSettings {
    /// Untimed calls first (caches, clocks, lazy initialisation).
    pub warmup: u32,
    /// Timed loops; the reported time is the median loop's time per call.
    pub loops: u32,
    /// Back-to-back calls per timed loop.
    pub iterations: u32,
    /// A single call slower than this many milliseconds is timed once, without warm-up or
    /// further loops (a CPU convolution of a large micro-batch can take seconds).
    pub long_call_ms: f64,
}

impl TimingSettings {
    /// GPU: one warm-up, median of 3 loops of 5 back-to-back calls.
    pub const GPU: TimingSettings = TimingSettings {
        warmup: 1,
        loops: 3,
        iterations: 5,
        long_call_ms: 1000.0,
    };
    /// CPU: one warm-up, median of 3 single calls; calls over 50 ms are timed once.
    pub const CPU: TimingSettings = TimingSettings {
        warmup: 1,
        loops: 3,
        iterations: 1,
        long_call_ms: 50.0,
    };
}

/// How to measure one [`MeasureKey`]: the timing, the engine search, the selection of
/// candidates and whether their outputs are verified, grouped as one argument.
#[derive(Clone, Debug, PartialEq)]
pub struct MeasureSettings {
    pub timing: TimingSettings,
    /// Bounds and prunes engine configurations (legacy algorithms ignore it).
    pub search: EngineSearch,
    pub select: Selection,
    /// Compare every candidate's output with the reference candidate's on the same operands
    /// and reject those over their tolerance ([`verify`]); the size is then
    /// [`SizeVerification::Verified`](crate::solver::SizeVerification::Verified).
    pub verify: bool,
}

impl MeasureSettings {
    /// What a size measured with these settings is: verified when they verify (the candidates
    /// that could be compared then carry their verification).
    pub fn size_verification(&self) -> crate::solver::SizeVerification {
        if self.verify {
            crate::solver::SizeVerification::Verified
        } else {
            crate::solver::SizeVerification::Unverified
        }
    }

    /// Every candidate, no bound, timed as `timing` says, verified.
    pub fn all(timing: TimingSettings) -> MeasureSettings {
        MeasureSettings {
            timing,
            search: EngineSearch::default(),
            select: Selection::ALL,
            verify: true,
        }
    }
}

/// Why a backend could not measure or run.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error(transparent)]
    Cpu(#[from] cpu::CpuError),
    #[error(transparent)]
    Cudnn(#[from] cudnn::CudnnError),
    #[error("cannot profile on a mix of devices: {first} and {other} (select GPUs of one model with CUDA_VISIBLE_DEVICES)")]
    MixedDevices { first: String, other: String },
    #[error("{backend} has no graph-API engine configurations; tune with --candidates legacy (or all, which then measures the legacy algorithms only)")]
    NoEngines { backend: String },
    /// The backend cannot time or run spatial chunks of this kind of candidate.
    #[error("{backend} cannot time {kind} candidates on spatial chunks")]
    NoSpatial { backend: String, kind: AlgoKind },
    #[error("{0}")]
    Invalid(String),
    /// The buffers a problem needs cannot fit: refused before anything is allocated, or an
    /// allocation that failed (made by [`out_of_memory`]).
    #[error("{0}")]
    OutOfMemory(String),
}

impl BackendError {
    /// The error for a key that `backend` does not [support](Backend::supports): of a kind it
    /// lacks ([`BackendError::NoEngines`]), or of a kind it has on a split it cannot time
    /// ([`BackendError::NoSpatial`]).
    pub fn unsupported(backend: &dyn Backend, key: &MeasureKey) -> BackendError {
        let name = backend.fingerprint().name.clone();
        if key.split == SplitDim::Spatial && backend.kinds().contains(&key.kind) {
            BackendError::NoSpatial {
                backend: name,
                kind: key.kind,
            }
        } else {
            BackendError::NoEngines { backend: name }
        }
    }
}

/// [`BackendError::OutOfMemory`]: `what` needs `needed` bytes, but `available` bytes `where_`
/// (e.g. "of host memory is available").
pub(crate) fn out_of_memory(what: &str, needed: u64, available: u64, where_: &str) -> BackendError {
    BackendError::OutOfMemory(format!(
        "{what} need {}, but {} {where_} (tune a smaller --batch)",
        format_bytes(needed),
        format_bytes(available)
    ))
}

/// Bytes of a problem's full-batch input, filter and output tensors in its dtype (exact: u128).
pub(crate) fn operand_bytes(problem: &ConvProblem) -> u128 {
    [Operand::Input, Operand::Filter, Operand::Output]
        .into_iter()
        .map(|role| operand_elements(problem, role) * problem.dtype.size_bytes() as u128)
        .sum()
}

/// Elements of one full-batch operand (exact: u128).
pub(crate) fn operand_elements(problem: &ConvProblem, role: Operand) -> u128 {
    let samples = if role.is_batched() {
        problem.n.max(0) as u128
    } else {
        1
    };
    role.elements_per_sample(problem) as u128 * samples
}

/// Host memory this process may still allocate, when the system says: the kernel's estimate of
/// available memory (`MemAvailable`), a cgroup v2 memory limit less its usage, and the address
/// space limit (`ulimit -v`) less the process's size, whichever is least. `None` off Linux.
pub(crate) fn available_host_memory() -> Option<u64> {
    let read = |path: &str| std::fs::read_to_string(path).ok();
    // "Key:   123 kB" lines.
    let kib = |text: &str, key: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with(key))?;
        line[key.len()..]
            .split_whitespace()
            .next()?
            .parse::<u64>()
            .ok()
    };
    let mut limits: Vec<u64> = Vec::new();
    if let Some(kb) = read("/proc/meminfo").and_then(|t| kib(&t, "MemAvailable:")) {
        limits.push(kb.saturating_mul(1024));
    }
    let number = |path: &str| read(path).and_then(|t| t.trim().parse::<u64>().ok());
    if let (Some(max), Some(current)) = (
        number("/sys/fs/cgroup/memory.max"),
        number("/sys/fs/cgroup/memory.current"),
    ) {
        limits.push(max.saturating_sub(current));
    }
    // "Max address space   <soft>   <hard>   bytes"; "unlimited" parses as no limit.
    let address_space = read("/proc/self/limits").and_then(|t| {
        let line = t.lines().find(|l| l.starts_with("Max address space"))?;
        line["Max address space".len()..]
            .split_whitespace()
            .next()?
            .parse::<u64>()
            .ok()
    });
    if let Some(limit) = address_space {
        let used = read("/proc/self/status")
            .and_then(|t| kib(&t, "VmSize:"))
            .unwrap_or(0)
            .saturating_mul(1024);
        limits.push(limit.saturating_sub(used));
    }
    limits.into_iter().min()
}

/// The machine's physical memory (`MemTotal`), when the system says: no CPU workspace can be
/// larger. `None` off Linux.
pub(crate) fn total_host_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line["MemTotal:".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kib.saturating_mul(1024))
}

/// How to search engine configurations at one micro-batch size.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EngineSearch {
    /// At most this many configurations are built and timed (heuristics order first);
    /// `None`: every one found.
    pub max_candidates: Option<usize>,
    /// Configurations not to time (pruned at a smaller size).
    pub skip: BTreeSet<EngineName>,
}

/// Which candidates to time at one micro-batch size: measuring never
/// allocates more workspace than a plan could use.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Selection {
    /// A candidate whose workspace at this size exceeds this many bytes cannot appear in a plan
    /// under the limit (or total budget) being tuned for: it is not timed and its workspace is
    /// not allocated; it is reported as [`Skipped`]. `None`: time every candidate.
    pub workspace_limit_bytes: Option<u64>,
    /// Time only these candidates (those a smaller limit skipped); `None`: every one.
    pub only: Option<BTreeSet<Algo>>,
}

/// What to do with one candidate, by [`Selection::decide`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Not asked for: leave it out of the result.
    Leave,
    /// Over the workspace limit: report it skipped, time nothing.
    Skip,
    Time,
}

impl Selection {
    /// Every candidate, no limit.
    pub const ALL: Selection = Selection {
        workspace_limit_bytes: None,
        only: None,
    };

    /// Whether `algo` is asked for at all (before its workspace is known).
    pub fn wants(&self, algo: &Algo) -> bool {
        self.only.as_ref().is_none_or(|only| only.contains(algo))
    }

    /// What to do with `algo`, whose workspace at this size is `workspace_bytes`.
    pub fn decide(&self, algo: &Algo, workspace_bytes: u64) -> Decision {
        if !self.wants(algo) {
            Decision::Leave
        } else if self
            .workspace_limit_bytes
            .is_some_and(|limit| workspace_bytes > limit)
        {
            Decision::Skip
        } else {
            Decision::Time
        }
    }
}

/// Memory a backend's measuring state holds (its full-batch operands and workspace: device
/// memory on a GPU, host memory on the CPU), since it was made or last [released].
///
/// [released]: Backend::release
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct MemoryUse {
    /// Bytes held now.
    pub held_bytes: u64,
    /// The most bytes held at once.
    pub peak_bytes: u64,
    /// The largest workspace allocated.
    pub largest_workspace_bytes: u64,
}

impl MemoryUse {
    /// Records that `bytes` are held now.
    pub(crate) fn hold(&mut self, bytes: u64) {
        self.held_bytes = bytes;
        self.peak_bytes = self.peak_bytes.max(bytes);
    }

    /// The larger of each field (two devices, or two runs).
    pub fn max(self, other: MemoryUse) -> MemoryUse {
        MemoryUse {
            held_bytes: self.held_bytes.max(other.held_bytes),
            peak_bytes: self.peak_bytes.max(other.peak_bytes),
            largest_workspace_bytes: self
                .largest_workspace_bytes
                .max(other.largest_workspace_bytes),
        }
    }
}

/// A device that can time convolution algorithms.
pub trait Backend {
    /// The device the measurements belong to.
    fn fingerprint(&self) -> &DeviceFingerprint;

    /// Whether this backend can measure `key`'s kind of candidate along its split (the shape
    /// and size are checked when measuring). The default: the batch split, of the kinds the
    /// backend [has](Backend::kinds).
    fn supports(&self, key: &MeasureKey) -> bool {
        key.split.is_batch() && self.kinds().contains(&key.kind)
    }

    /// Times `key`'s candidates that `how.select` asks for: legacy algorithms, or engine
    /// configurations as `how.search` bounds them, at a micro-batch size (`key.problem.n` is
    /// the full mini-batch) or on chunks of `key.size` rows of a spatial split. Unsupported
    /// candidates are left out; those over the selection's workspace limit are skipped,
    /// unallocated. A key the backend does not [support](Backend::supports) is an error
    /// ([`BackendError::unsupported`]).
    ///
    /// With `how.verify`, each timed candidate's output is compared with the reference
    /// candidate's on the same operands ([`verify`]; the reference runs even when it is not
    /// asked for): the measurement carries its [`Verification`](crate::solver::Verification),
    /// one over its tolerance goes to [`Measured::rejected`] instead, and the result is
    /// [verified](crate::solver::SizeVerification::Verified). A candidate that could not be
    /// compared (no reference output there) carries none.
    ///
    /// A spatial size is rows along [`split_axis`](crate::solver::spatial::split_axis) of the
    /// op's output (`dx` for backward-data). Each candidate is timed on the chunks
    /// [`timing_chunks`](crate::solver::spatial::timing_chunks) gives (at the start, middle and
    /// end of the axis, with the offsets and padding a plan runs them with); its time is the
    /// slowest, its workspace the largest. Measurements carry the size as their `micro`.
    fn measure(
        &mut self,
        key: &MeasureKey,
        how: &MeasureSettings,
    ) -> Result<Measured, BackendError>;

    /// Frees what measuring holds (full-batch operands, workspace) and resets
    /// [`Backend::memory`]; the next measurement makes them again. Tuning calls it at the end
    /// of every tune, so no measuring state outlives it.
    fn release(&mut self) {}

    /// What measuring holds now and held at most since the last [`Backend::release`].
    fn memory(&self) -> MemoryUse {
        MemoryUse::default()
    }

    /// The kinds of candidate this backend can measure.
    fn kinds(&self) -> &'static [AlgoKind] {
        &[AlgoKind::Legacy]
    }

    /// Refuses a problem whose buffers cannot fit this device's memory, before anything is
    /// allocated or measured. The profiler calls it for every job first.
    fn check_fits(&self, problem: &ConvProblem) -> Result<(), BackendError> {
        let _ = problem;
        Ok(())
    }

    /// The device's memory in bytes, when known: no measured workspace can be larger (records
    /// entering the cache are checked against it, see [`RecordCheck`](crate::solver::RecordCheck)).
    fn memory_bytes(&self) -> Option<u64> {
        None
    }

    /// Whether `algo` is a candidate of `op` that this backend has (an imported profile's
    /// algorithm numbers are checked against it). The default knows the kinds, not numbers.
    fn has_candidate(&self, op: ConvOp, algo: &Algo) -> bool {
        let _ = op;
        self.kinds().contains(&algo.kind())
    }

    /// Whether `algo` gives bitwise the same result on every run of `op` (no atomics), which
    /// is what determinism (`torch.backends.cudnn.deterministic`) admits. The default: every
    /// candidate is (the CPU backend computes each output element in a fixed order).
    fn is_deterministic(&self, op: ConvOp, algo: &Algo) -> bool {
        let _ = (op, algo);
        true
    }
}

/// Refuses a key `backend` does not [support](Backend::supports), before anything is measured
/// ([`BackendError::unsupported`]). Callers check, as a backend that wraps another may pass
/// on to it keys that it does not support itself.
pub fn check_supported(backend: &dyn Backend, key: &MeasureKey) -> Result<(), BackendError> {
    if backend.supports(key) {
        Ok(())
    } else {
        Err(BackendError::unsupported(backend, key))
    }
}

/// The checks every [`Backend::measure`] makes first: `backend` supports the key (see
/// [`BackendError::unsupported`]), the problem is valid, `1 <= size <=` the split's extent,
/// and a call at that size fits 32-bit indexing (tuning never asks for more: a key from
/// elsewhere, another rank's task, is refused before any buffer is made).
pub(crate) fn check_key(backend: &dyn Backend, key: &MeasureKey) -> Result<(), BackendError> {
    match key.split {
        SplitDim::Batch => {
            check_supported(backend, key)?;
            check_measure_args(&key.problem, key.size)?;
        }
        SplitDim::Spatial => {
            check_chunk_args(&key.problem, key.op, key.size)?;
            check_supported(backend, key)?;
        }
    }
    if !IndexLimit::CUDNN.fits(&key.problem, key.op, key.split, key.size) {
        return Err(BackendError::Invalid(format!(
            "{} {} of {}: a call of {} reaches more than the {} elements 32-bit indexing \
             allows",
            key.op,
            key.split,
            key.problem.describe(),
            key.size,
            IndexLimit::CUDNN
        )));
    }
    Ok(())
}

/// The checks every spatial [`Backend::measure`] needs first: a valid problem and
/// `1 <= size <=` the op's extent along the split axis.
pub(crate) fn check_chunk_args(
    problem: &ConvProblem,
    op: ConvOp,
    size: i64,
) -> Result<(), BackendError> {
    problem
        .validate()
        .map_err(|e| BackendError::Invalid(e.to_string()))?;
    let extent = SplitDim::Spatial.extent(problem, op);
    if size < 1 || size > extent {
        return Err(BackendError::Invalid(format!(
            "chunk of {size} rows outside 1..={extent} along {}",
            crate::solver::spatial::split_axis(problem)
        )));
    }
    Ok(())
}

/// The checks every batch [`Backend::measure`] makes first: a valid problem and
/// `1 <= micro <= n`.
pub(crate) fn check_measure_args(problem: &ConvProblem, micro: i64) -> Result<(), BackendError> {
    problem
        .validate()
        .map_err(|e| BackendError::Invalid(e.to_string()))?;
    if micro < 1 || micro > problem.n {
        return Err(BackendError::Invalid(format!(
            "micro-batch {micro} outside 1..={}",
            problem.n
        )));
    }
    Ok(())
}

/// Milliseconds rounded to whole nanoseconds, the resolution of the clocks that take them (the
/// host clock counts nanoseconds; CUDA events resolve about half a microsecond). Digits below
/// it are float noise from dividing a loop's total by its calls (`4.250659000000001`); rounded,
/// a profile writes `4.250659`.
pub(crate) fn round_to_ns(ms: f64) -> f64 {
    (ms * 1e6).round() / 1e6
}

/// The time of one call per [`TimingSettings`], rounded to the nanosecond ([`round_to_ns`]):
/// `time_loop(k)` runs `k` back-to-back calls and returns their total milliseconds on the
/// backend's clock. The first single call is the warm-up, or the answer when it is a long call.
/// Shared by the CPU and GPU backends.
pub(crate) fn median_time<E>(
    timing: &TimingSettings,
    mut time_loop: impl FnMut(u32) -> Result<f64, E>,
) -> Result<f64, E> {
    // The first call tells whether this is a long call; it doubles as the warm-up.
    let first = time_loop(1)?;
    if first >= timing.long_call_ms {
        return Ok(round_to_ns(first));
    }
    for _ in 1..timing.warmup {
        time_loop(1)?;
    }
    let iterations = timing.iterations.max(1);
    let mut samples = Vec::with_capacity(timing.loops.max(1) as usize);
    for _ in 0..timing.loops.max(1) {
        samples.push(time_loop(iterations)? / f64::from(iterations));
    }
    samples.sort_by(f64::total_cmp);
    Ok(round_to_ns(samples[samples.len() / 2]))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Times come out at the clock's nanosecond resolution, without the
    /// float noise of a loop's total divided by its calls, and a profile prints them short.
    #[test]
    fn median_times_are_whole_nanoseconds() {
        let timing = TimingSettings {
            iterations: 5,
            ..TimingSettings::CPU
        };
        // A loop's total as a clock gives it (whole nanoseconds); divided by its 5 calls it
        // is 4.250659000000001 in f64.
        let time = median_time(&timing, |calls| -> Result<f64, ()> {
            Ok(if calls == 5 { 21.253295 } else { 4.25 })
        })
        .unwrap();
        assert_eq!(time.to_string(), "4.250659");
        for noisy in [
            4.250659000000001,
            0.1 + 0.2,
            13.618241999999999,
            2.1058980000000003,
        ] {
            let rounded = round_to_ns(noisy);
            let text = serde_json::to_string(&rounded).unwrap();
            let decimals = text.split('.').nth(1).map_or(0, str::len);
            assert!(decimals <= 6, "{noisy} -> {text}");
            assert!((rounded - noisy).abs() <= 5e-7, "{noisy} -> {rounded}");
        }
    }
}
