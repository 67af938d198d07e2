//! Tuning: problem -> profile -> (cache) -> solve -> plans, for a whole network (`mucudnn
//! tune`) or for one layer on first use (the drop-in [`Conv2d`](crate::exec::conv2d::Conv2d)).
//!
//! The cache sits between profile and solve: a (shape, op, micro-batch size) already measured
//! on this device is read, not measured; each newly measured size is stored at once, so an
//! interrupted run keeps its work. A layer's solved plans are cached too.

use crate::backend::{
    measure_split, Backend, BackendError, EngineSearch, Measured, MemoryUse, Selection,
    TimingSettings,
};
use crate::profiler::{measure_sizes_parallel, prune, same_model, Job, Progress};
use crate::solver::{
    solve_wr, Algo, AlgoKind, CandidateSet, ConvOp, ConvProblem, DType, DeviceFingerprint,
    Measurement, OpProfile, Plan, Policy, Profile, RecordCheck, Skipped, SolveError, SplitDim,
};
use mucudnn_cache::{Cache, PlanKey};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};

pub use crate::device::BackendKind;

/// Why tuning failed.
#[derive(Debug, thiserror::Error)]
pub enum TuneError {
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    Solve(#[from] SolveError),
    #[error("interrupted: {measured} micro-batch size(s) measured this run are kept in the cache")]
    Interrupted { measured: usize },
    /// The cache path names a file that is not a mucudnn cache (left untouched).
    #[error(transparent)]
    Cache(#[from] mucudnn_cache::NotACache),
}

/// Where a profile's measurements came from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// (job, micro-batch size, candidate kind) triples read from the cache.
    pub cached: usize,
    /// (job, micro-batch size, candidate kind) triples measured by the backend in this run.
    pub measured: usize,
    /// Engine configurations (size, configuration) not timed because pruning dropped them.
    pub pruned: usize,
    /// Candidates (size, candidate) not timed because their workspace exceeded the measuring
    /// limit (recorded as skipped; a tune under a larger limit times them).
    pub skipped: usize,
    /// The memory measuring held (operands and workspace; device memory on a GPU) in this run.
    pub memory: MemoryUse,
}

impl CacheStats {
    /// Two runs' statistics together (the larger memory of the two).
    pub fn and(self, other: CacheStats) -> CacheStats {
        CacheStats {
            cached: self.cached + other.cached,
            measured: self.measured + other.measured,
            pruned: self.pruned + other.pruned,
            skipped: self.skipped + other.skipped,
            memory: self.memory.max(other.memory),
        }
    }
}

/// How engine configurations are searched: a bound and pruning (see [`prune`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EngineOptions {
    /// At most this many configurations per (op, micro-batch size); `None`: all found.
    pub max_candidates: Option<usize>,
    /// Drop a configuration at larger sizes once a candidate needing no more workspace is
    /// faster by more than this factor; `None`: time every configuration at every size.
    pub prune_margin: Option<f64>,
    /// Solve plans from deterministic candidates only ([`Backend::is_deterministic`], of
    /// either kind), as PyTorch's `torch.backends.cudnn.deterministic` asks. Measuring is
    /// unchanged (the cache keeps every candidate); the plans are cached under their own key.
    pub deterministic: bool,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            max_candidates: None,
            prune_margin: Some(prune::DEFAULT_MARGIN),
            deterministic: false,
        }
    }
}

/// The plan-cache context of plans solved from deterministic candidates only (plain plans
/// have none), so the two never stand in for each other.
pub const DETERMINISTIC_CONTEXT: &str = "deterministic";

/// Drops the measurements of candidates `backend` does not mark deterministic.
pub fn keep_deterministic(backend: &dyn Backend, profile: &mut OpProfile) {
    let op = profile.op;
    profile
        .measurements
        .retain(|m| backend.is_deterministic(op, &m.algo));
}

/// The most micro-batches a bf16 backward-filter plan may have on cuDNN. cuDNN adds each
/// micro-batch after the first into `dw` in the operands' dtype (beta = 1): k roundings where
/// PyTorch has one. Measured (docs/pytorch.md, "Half-precision weight gradients"), bf16's error
/// is 1.6x PyTorch's at k = 4 and 2.1x at k = 8, past the 2x the project allows; fp16 stays
/// below PyTorch's at every k up to 16, so it has no limit. The CPU executor sums in fp32 and
/// needs none either.
pub const BF16_BACKWARD_FILTER_MAX_MICRO_BATCHES: i64 = 4;

/// The smallest micro-batch size a plan of `op` on `problem` may use on `device`: 1, except for
/// a bf16 backward-filter on a cuDNN device, where it is `ceil(N / 4)`. A plan whose sizes are
/// all at least `ceil(N / 4)` has at most 4 micro-batches under every policy (they sum to N),
/// and the undivided size N always stays, so the rule only removes candidates: it never makes
/// a plan slower than the best undivided one.
pub fn min_micro_batch(device: &DeviceFingerprint, problem: &ConvProblem, op: ConvOp) -> i64 {
    min_split_size(device, problem, op, SplitDim::Batch)
}

/// [`min_micro_batch`] for a split: a spatial bf16 backward-filter on cuDNN sums its chunks in
/// `dw` as micro-batches do, so its chunks are at least a quarter of the extent along the axis.
pub fn min_split_size(
    device: &DeviceFingerprint,
    problem: &ConvProblem,
    op: ConvOp,
    split: SplitDim,
) -> i64 {
    let restricted = device.backend == BackendKind::Cuda
        && problem.dtype == DType::Bf16
        && op == ConvOp::BackwardFilter;
    if restricted {
        let extent = split.extent(problem, op);
        (extent + BF16_BACKWARD_FILTER_MAX_MICRO_BATCHES - 1)
            / BF16_BACKWARD_FILTER_MAX_MICRO_BATCHES
    } else {
        1
    }
}

/// Drops the measurements at sizes below [`min_micro_batch`], so the solver (which stays
/// unaware of devices) picks only plans that keep `dw`'s error within the rule; a workspace
/// limit it then calls infeasible names the smallest limit that works under the rule.
pub fn keep_accurate_sizes(device: &DeviceFingerprint, profile: &mut OpProfile) {
    let min = min_split_size(device, &profile.problem, profile.op, profile.split);
    profile.measurements.retain(|m| m.micro >= min);
}

/// [`keep_accurate_sizes`] for every entry of a profile measured on the device its fingerprint
/// names (a profile without one is solved as it is: nothing says it came from cuDNN).
pub fn keep_accurate_sizes_in(profile: &mut Profile) {
    if let Some(device) = profile.fingerprint.clone() {
        for entry in &mut profile.entries {
            keep_accurate_sizes(&device, entry);
        }
    }
}

/// [`crate::solver::solve_profile`] under the rule: the profile's entries restricted by
/// [`keep_accurate_sizes_in`] (on a copy, so the caller's profile keeps every measurement).
/// Every path that solves a whole profile (the CLI, the C ABI's solve and its handle) goes
/// through here.
pub fn solve_accurately(
    profile: &Profile,
    policy: Policy,
    mode: crate::solver::Mode,
    wd: &crate::solver::WdOptions,
) -> Result<crate::solver::Solution, SolveError> {
    let mut accurate = profile.clone();
    keep_accurate_sizes_in(&mut accurate);
    crate::solver::solve_profile(&accurate, policy, mode, wd)
}

/// Whether `plan` obeys [`min_micro_batch`] on `device`. Plans cached before the rule existed
/// may not: such a plan is a cache miss, and the layer is solved again.
pub fn plan_obeys_accuracy_rule(device: &DeviceFingerprint, plan: &Plan) -> bool {
    let min = min_split_size(device, &plan.problem, plan.op, plan.split);
    plan.micro_batches.iter().all(|mb| mb.size >= min)
}

/// Everything a profiling run needs besides the backend and the jobs.
pub struct ProfileRun<'a> {
    pub policy: Policy,
    pub timing: TimingSettings,
    pub cache: &'a Cache,
    /// Set (e.g. by Ctrl-C) to stop after the current micro-batch size.
    pub interrupt: Option<&'a AtomicBool>,
    /// Which candidates to measure. Kinds the backend lacks are left out when the set has
    /// another kind (`all` on the CPU measures its algorithms); a set of only those is an error.
    pub candidates: CandidateSet,
    pub engines: EngineOptions,
    /// The largest workspace any plan solved from this run may use (a per-layer limit, or a
    /// total budget): a candidate needing more at a size is not timed, only recorded as
    /// skipped (issue 21, item 2). `None`: time every candidate.
    pub workspace_limit_bytes: Option<u64>,
}

impl ProfileRun<'_> {
    /// The kinds to measure on a backend that offers `offered`.
    /// The candidate kinds of the run that a backend offering `offered` has, in set order.
    fn offered_kinds(&self, offered: &[AlgoKind]) -> Vec<AlgoKind> {
        self.candidates
            .kinds()
            .iter()
            .copied()
            .filter(|kind| offered.contains(kind))
            .collect()
    }

    /// The kinds to measure on a backend that offers `offered`.
    fn kinds(&self, offered: &[AlgoKind], backend: &str) -> Result<Vec<AlgoKind>, BackendError> {
        let kinds = self.offered_kinds(offered);
        if kinds.is_empty() {
            return Err(BackendError::NoEngines {
                backend: backend.to_string(),
            });
        }
        Ok(kinds)
    }

    fn interrupted(&self) -> bool {
        self.interrupt
            .is_some_and(|flag| flag.load(Ordering::Relaxed))
    }

    /// The engine search at one step: the bound, and for a size between two anchors the
    /// configurations dominated at both (from what `by_size` holds for them).
    fn engine_search(
        &self,
        kind: AlgoKind,
        step: prune::Step,
        by_size: &BTreeMap<i64, Vec<Measurement>>,
    ) -> EngineSearch {
        let skip = match (kind, step.between, self.engines.prune_margin) {
            (AlgoKind::Engine, Some((lower, upper)), Some(margin)) => {
                match (by_size.get(&lower), by_size.get(&upper)) {
                    (Some(lower), Some(upper)) => prune::skip_between(lower, upper, margin),
                    _ => BTreeSet::new(),
                }
            }
            _ => BTreeSet::new(),
        };
        EngineSearch {
            max_candidates: self.engines.max_candidates,
            skip,
        }
    }

    /// The candidates to time at one size: every one, or, when `cached` holds what a smaller
    /// limit measured there, only those it skipped that fit this run's limit. `None`: the
    /// cached measurements serve this run as they are.
    fn selection(&self, cached: Option<&(Vec<Measurement>, Vec<Skipped>)>) -> Option<Selection> {
        let limit = self.workspace_limit_bytes;
        match cached {
            None => Some(Selection {
                workspace_limit_bytes: limit,
                only: None,
            }),
            Some((_, skipped)) => {
                let only: BTreeSet<Algo> = skipped
                    .iter()
                    .filter(|s| limit.is_none_or(|l| s.workspace_bytes <= l))
                    .map(|s| s.algo)
                    .collect();
                (!only.is_empty()).then_some(Selection {
                    workspace_limit_bytes: limit,
                    only: Some(only),
                })
            }
        }
    }

    /// The candidate set actually measured on a backend that offers `offered` (the plan key).
    pub fn effective_candidates(&self, offered: &[AlgoKind]) -> CandidateSet {
        CandidateSet::from_kinds(&self.offered_kinds(offered)).unwrap_or(self.candidates)
    }
}

/// What a size holds after measuring `found` with `select` over what the cache had: the cached
/// timings, the new ones, and the skipped candidates that are still not timed.
fn merge_measured(
    cached: Option<(Vec<Measurement>, Vec<Skipped>)>,
    select: &Selection,
    found: Measured,
) -> Measured {
    let Some((mut measurements, skipped)) = cached else {
        return found;
    };
    measurements.extend(found.measurements);
    let mut skipped: Vec<Skipped> = skipped
        .into_iter()
        .filter(|s| !select.wants(&s.algo))
        .collect();
    skipped.extend(found.skipped);
    Measured {
        measurements,
        skipped,
    }
}

/// One (size, kind) through the cache: what the cache holds when it serves the run's limit
/// (`true`), else measured (everything, or what a smaller limit skipped), stored merged with
/// what was cached, and returned (`false`).
#[allow(clippy::too_many_arguments)]
fn size_through_cache(
    backend: &mut dyn Backend,
    run: &ProfileRun<'_>,
    layer: &str,
    problem: &ConvProblem,
    op: ConvOp,
    split: SplitDim,
    micro: i64,
    kind: AlgoKind,
    search: &EngineSearch,
    stats: &mut CacheStats,
) -> Result<(Measured, bool), TuneError> {
    let device = backend.fingerprint().clone();
    let cached = run
        .cache
        .measured_along(&device, problem, op, split, micro, kind);
    let Some(select) = run.selection(cached.as_ref()) else {
        let (measurements, skipped) = cached.unwrap_or_default();
        stats.cached += 1;
        return Ok((
            Measured {
                measurements,
                skipped,
            },
            true,
        ));
    };
    if run.interrupted() {
        return Err(TuneError::Interrupted {
            measured: stats.measured,
        });
    }
    let found = measure_split(
        backend,
        split,
        kind,
        problem,
        op,
        micro,
        &run.timing,
        search,
        &select,
    )?;
    stats.pruned += search.skip.len();
    stats.skipped += found.skipped.len();
    let merged = merge_measured(cached, &select, found);
    run.cache.store_measured_along(
        &device,
        layer,
        problem,
        op,
        split,
        micro,
        kind,
        &merged.measurements,
        &merged.skipped,
    );
    stats.measured += 1;
    Ok((merged, false))
}

/// Measures one job, reading what the cache has and storing what it measures. Sizes go in
/// [`prune::measure_order`]: anchors first, then the sizes between them, where engine
/// configurations dominated at both neighbouring anchors are not timed.
fn profile_job_cached(
    backend: &mut dyn Backend,
    job: &Job,
    run: &ProfileRun<'_>,
    stats: &mut CacheStats,
    progress: &mut dyn FnMut(Progress<'_>, bool),
) -> Result<OpProfile, TuneError> {
    job.problem
        .validate()
        .map_err(|e| BackendError::Invalid(format!("{}: {e}", job.layer)))?;
    let device = backend.fingerprint().clone();
    let kinds = run.kinds(backend.kinds(), &device.name)?;
    let sizes = job.sizes(run.policy);
    let mut by_size: BTreeMap<i64, Vec<Measurement>> = BTreeMap::new();
    let mut skipped = Vec::new();
    for (index, step) in prune::measure_order(&sizes).into_iter().enumerate() {
        let micro = step.micro;
        let mut from_cache = true;
        for &kind in &kinds {
            let search = run.engine_search(kind, step, &by_size);
            let (found, cached) = size_through_cache(
                backend,
                run,
                &job.layer,
                &job.problem,
                job.op,
                job.split,
                micro,
                kind,
                &search,
                stats,
            )?;
            from_cache &= cached;
            by_size.entry(micro).or_default().extend(found.measurements);
            skipped.extend(found.skipped);
        }
        progress(
            Progress {
                job,
                micro,
                done: index + 1,
                total: sizes.len(),
            },
            from_cache,
        );
    }
    Ok(OpProfile {
        layer: job.layer.clone(),
        problem: job.problem,
        op: job.op,
        split: job.split,
        measurements: by_size.into_values().flatten().collect(),
        skipped,
    })
}

/// An empty profile that says where and how its measurements were taken.
fn profile_header(fingerprint: &DeviceFingerprint, timing: &TimingSettings) -> Profile {
    Profile {
        device: fingerprint.name.clone(),
        cudnn_version: fingerprint.cudnn_version,
        math: Some("as in each record's problem (default unless stated)".into()),
        timing: Some(format!(
            "median of {} loops of {} back-to-back calls after {} warm-up call(s); a call over {} ms timed once; {} clock",
            timing.loops,
            timing.iterations,
            timing.warmup,
            timing.long_call_ms,
            match fingerprint.backend {
                BackendKind::Cuda => "CUDA event",
                BackendKind::Cpu => "host monotonic",
            }
        )),
        fingerprint: Some(fingerprint.clone()),
        entries: Vec::new(),
    }
}

/// Measures every job into one profile, in job order, through the cache. `progress` is told
/// after each micro-batch size whether it came from the cache.
pub fn profile_jobs(
    backend: &mut dyn Backend,
    jobs: &[Job],
    run: &ProfileRun<'_>,
    progress: &mut dyn FnMut(Progress<'_>, bool),
) -> Result<(Profile, CacheStats), TuneError> {
    let mut profile = profile_header(backend.fingerprint(), &run.timing);
    profile.entries.reserve(jobs.len());
    let mut stats = CacheStats::default();
    let measured = with_release(backend, &mut stats, |backend, stats| {
        for job in jobs {
            profile
                .entries
                .push(profile_job_cached(backend, job, run, stats, progress)?);
        }
        Ok(())
    });
    measured.map(|()| (profile, stats))
}

/// Runs `f`, then releases the backend's measuring state (also on error), recording in `stats`
/// the memory it held at most.
fn with_release<T>(
    backend: &mut dyn Backend,
    stats: &mut CacheStats,
    f: impl FnOnce(&mut dyn Backend, &mut CacheStats) -> Result<T, TuneError>,
) -> Result<T, TuneError> {
    let result = f(backend, stats);
    stats.memory = stats.memory.max(backend.memory());
    backend.release();
    result
}

/// Like [`profile_jobs`] on several devices of one model: for each job and candidate kind,
/// the sizes the cache lacks are dealt out over `devices` backends, one thread each, made by
/// `make(d)` inside its thread (cuDNN handles stay on the thread that made them). The anchor
/// sizes are dealt out first, then the sizes between them, so pruning still applies. Measurements are stored under `fingerprint`, which must be the
/// devices' model, whose backends offer the candidate kinds `offered`. Progress is reported
/// per job.
#[allow(clippy::too_many_arguments)]
pub fn profile_jobs_parallel<B, F>(
    make: F,
    devices: usize,
    fingerprint: &DeviceFingerprint,
    offered: &[AlgoKind],
    jobs: &[Job],
    run: &ProfileRun<'_>,
    progress: &mut dyn FnMut(Progress<'_>, bool),
) -> Result<(Profile, CacheStats), TuneError>
where
    B: Backend,
    F: Fn(usize) -> Result<B, BackendError> + Sync,
{
    let kinds = run.kinds(offered, &fingerprint.name)?;
    let devices = devices.max(1);
    let mut stats = CacheStats::default();
    let mut entries = Vec::with_capacity(jobs.len());
    for job in jobs {
        let sizes = job.sizes(run.policy);
        let mut by_size: BTreeMap<i64, Vec<Measurement>> = BTreeMap::new();
        let mut measured_sizes: BTreeSet<i64> = BTreeSet::new();
        let mut skipped = Vec::new();
        for &kind in &kinds {
            let mut missing = Vec::new();
            // What the cache has at the sizes still to measure (a smaller limit's), and what
            // to time there.
            let mut partial: BTreeMap<i64, (Vec<Measurement>, Vec<Skipped>)> = BTreeMap::new();
            let mut selections: BTreeMap<i64, Selection> = BTreeMap::new();
            for &micro in &sizes {
                let cached = run.cache.measured_along(
                    fingerprint,
                    &job.problem,
                    job.op,
                    job.split,
                    micro,
                    kind,
                );
                match run.selection(cached.as_ref()) {
                    None => {
                        let (found, skips) = cached.unwrap_or_default();
                        stats.cached += 1;
                        by_size.entry(micro).or_default().extend(found);
                        skipped.extend(skips);
                    }
                    Some(select) => {
                        missing.push(micro);
                        selections.insert(micro, select);
                        if let Some(cached) = cached {
                            partial.insert(micro, cached);
                        }
                    }
                }
            }
            // Anchors first, then the sizes between them (see `prune`); each pass is dealt
            // out over the devices.
            let order = prune::measure_order(&missing);
            let passes = [
                order
                    .iter()
                    .filter(|s| s.between.is_none())
                    .copied()
                    .collect::<Vec<_>>(),
                order
                    .iter()
                    .filter(|s| s.between.is_some())
                    .copied()
                    .collect(),
            ];
            for pass in passes.iter().filter(|p| !p.is_empty()) {
                if run.interrupted() {
                    return Err(TuneError::Interrupted {
                        measured: stats.measured,
                    });
                }
                let searches: BTreeMap<i64, EngineSearch> = pass
                    .iter()
                    .map(|&step| (step.micro, run.engine_search(kind, step, &by_size)))
                    .collect();
                let micros: Vec<i64> = pass.iter().map(|s| s.micro).collect();
                let (device, measured, memory) = measure_sizes_parallel(
                    &make,
                    devices,
                    job,
                    &micros,
                    &run.timing,
                    kind,
                    &|micro| searches.get(&micro).cloned().unwrap_or_default(),
                    &|micro| selections.get(&micro).cloned().unwrap_or_default(),
                )?;
                stats.memory = stats.memory.max(memory);
                if !same_model(&device, fingerprint) {
                    return Err(BackendError::MixedDevices {
                        first: fingerprint.to_string(),
                        other: device.to_string(),
                    }
                    .into());
                }
                for (micro, found) in measured {
                    stats.skipped += found.skipped.len();
                    let select = selections.get(&micro).cloned().unwrap_or_default();
                    let found = merge_measured(partial.remove(&micro), &select, found);
                    run.cache.store_measured_along(
                        fingerprint,
                        &job.layer,
                        &job.problem,
                        job.op,
                        job.split,
                        micro,
                        kind,
                        &found.measurements,
                        &found.skipped,
                    );
                    stats.measured += 1;
                    stats.pruned += searches.get(&micro).map_or(0, |s| s.skip.len());
                    measured_sizes.insert(micro);
                    by_size.entry(micro).or_default().extend(found.measurements);
                    skipped.extend(found.skipped);
                }
            }
        }
        for (index, &micro) in sizes.iter().enumerate() {
            progress(
                Progress {
                    job,
                    micro,
                    done: index + 1,
                    total: sizes.len(),
                },
                !measured_sizes.contains(&micro),
            );
        }
        let measurements = by_size.into_values().flatten().collect();
        entries.push(OpProfile {
            layer: job.layer.clone(),
            problem: job.problem,
            op: job.op,
            split: job.split,
            measurements,
            skipped,
        });
    }
    let mut profile = profile_header(fingerprint, &run.timing);
    profile.entries = entries;
    Ok((profile, stats))
}

/// The jobs of a set of named problems: every op of every problem.
pub fn jobs_for(layers: impl IntoIterator<Item = (String, ConvProblem)>) -> Vec<Job> {
    layers
        .into_iter()
        .flat_map(|(layer, problem)| ConvOp::ALL.map(|op| Job::batch(layer.clone(), problem, op)))
        .collect()
}

/// One unit of measuring work that the cache lacks: a (layer problem, op, micro-batch size,
/// candidate kind). Tasks are plain data so that they can be dealt out over processes (ranks of
/// a distributed job) and their results shared ([`MeasuredTask`]): every rank then stores the
/// same measurements and solves the same plans.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MeasureTask {
    pub layer: String,
    /// The problem at the full mini-batch size.
    pub problem: ConvProblem,
    pub op: ConvOp,
    /// What `micro` splits: a micro-batch size, or a chunk's rows along the split axis
    /// (issue 24). Batch when absent (tasks from before the split).
    #[serde(default, skip_serializing_if = "SplitDim::is_batch")]
    pub split: SplitDim,
    pub micro: i64,
    pub kind: AlgoKind,
    /// For a size between two anchors (see [`prune::measure_order`]): the anchors, whose
    /// measurements decide which engine configurations are skipped. Measure every anchor task
    /// (and store the results) before the tasks between them, as [`missing_tasks`] orders them.
    pub between: Option<(i64, i64)>,
}

/// A task's measurements (possibly none: "measured, nothing supported"), with what is cached
/// of the size already merged in, so every rank stores the same size.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MeasuredTask {
    pub task: MeasureTask,
    pub measurements: Vec<Measurement>,
    /// Candidates not timed because their workspace exceeded the measuring limit.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skipped: Vec<Skipped>,
}

/// The tasks the cache lacks for `jobs` on `fingerprint` (a backend offering `offered`),
/// anchors of every job first, then the sizes between them; deterministic for the same cache
/// contents. Errors as [`ProfileRun`] does for candidate kinds the backend lacks.
pub fn missing_tasks(
    jobs: &[Job],
    run: &ProfileRun<'_>,
    fingerprint: &DeviceFingerprint,
    offered: &[AlgoKind],
) -> Result<Vec<MeasureTask>, TuneError> {
    let kinds = run.kinds(offered, &fingerprint.name)?;
    let mut anchors = Vec::new();
    let mut between = Vec::new();
    for job in jobs {
        job.problem
            .validate()
            .map_err(|e| BackendError::Invalid(format!("{}: {e}", job.layer)))?;
        let sizes = job.sizes(run.policy);
        let missing: BTreeMap<AlgoKind, Vec<i64>> = kinds
            .iter()
            .map(|&kind| {
                let missing = run.cache.missing_sizes_within_along(
                    fingerprint,
                    &job.problem,
                    job.op,
                    job.split,
                    kind,
                    &sizes,
                    run.workspace_limit_bytes,
                );
                (kind, missing)
            })
            .collect();
        for step in prune::measure_order(&sizes) {
            for &kind in &kinds {
                if !missing[&kind].contains(&step.micro) {
                    continue;
                }
                let task = MeasureTask {
                    layer: job.layer.clone(),
                    problem: job.problem,
                    op: job.op,
                    split: job.split,
                    micro: step.micro,
                    kind,
                    between: step.between,
                };
                if step.between.is_some() {
                    between.push(task);
                } else {
                    anchors.push(task);
                }
            }
        }
    }
    anchors.extend(between);
    Ok(anchors)
}

/// Measures one task on `backend` and stores the result in the run's cache. A task between two
/// anchors skips the engine configurations the cached anchor measurements show dominated. A
/// size measured under a smaller limit times only the candidates that limit skipped. The
/// caller releases the backend's measuring state when its tasks are done.
pub fn measure_task(
    backend: &mut dyn Backend,
    task: &MeasureTask,
    run: &ProfileRun<'_>,
) -> Result<MeasuredTask, TuneError> {
    task.problem
        .validate()
        .map_err(|e| BackendError::Invalid(format!("{}: {e}", task.layer)))?;
    let device = backend.fingerprint().clone();
    run.kinds(backend.kinds(), &device.name)?;
    if !backend.kinds().contains(&task.kind) {
        return Err(BackendError::NoEngines {
            backend: device.name.clone(),
        }
        .into());
    }
    let mut by_size: BTreeMap<i64, Vec<Measurement>> = BTreeMap::new();
    if let Some((lower, upper)) = task.between {
        for size in [lower, upper] {
            if let Some(found) = run.cache.measurements_along(
                &device,
                &task.problem,
                task.op,
                task.split,
                size,
                task.kind,
            ) {
                by_size.insert(size, found);
            }
        }
    }
    let step = prune::Step {
        micro: task.micro,
        between: task.between,
    };
    let search = run.engine_search(task.kind, step, &by_size);
    let (found, _) = size_through_cache(
        backend,
        run,
        &task.layer,
        &task.problem,
        task.op,
        task.split,
        task.micro,
        task.kind,
        &search,
        &mut CacheStats::default(),
    )?;
    Ok(MeasuredTask {
        task: task.clone(),
        measurements: found.measurements,
        skipped: found.skipped,
    })
}

/// Stores tasks measured elsewhere (another rank's device of the same fingerprint, `from`) in
/// `cache`, under `backend`'s fingerprint. Returns how many tasks were stored.
///
/// All or nothing: first every record passes [`RecordCheck::batch`], the check every record
/// entering the cache passes (`from` must be `backend`'s fingerprint, a candidate the backend
/// has, a positive finite time, a workspace within [`Backend::memory_bytes`]), and each
/// measurement must be of its task's micro-batch size and candidate kind. The first bad record
/// refuses the whole batch, named by its index among all the batch's measurements (and its
/// task's); nothing is stored then.
pub fn store_measured(
    cache: &Cache,
    backend: &dyn Backend,
    from: &DeviceFingerprint,
    measured: &[MeasuredTask],
) -> Result<usize, TuneError> {
    let check = RecordCheck {
        device: backend.fingerprint(),
        memory_bytes: backend.memory_bytes(),
    };
    let invalid = |why: String| TuneError::Backend(BackendError::Invalid(why));
    check
        .fingerprint(from)
        .map_err(|e| invalid(e.to_string()))?;
    for (index, m) in measured.iter().enumerate() {
        let t = &m.task;
        let bad = |why: String| {
            invalid(format!(
                "task {index} ({} {} micro-batch {}): {why}",
                t.layer.chars().take(200).collect::<String>(),
                t.op,
                t.micro
            ))
        };
        t.problem.validate().map_err(|e| bad(e.to_string()))?;
        let extent = t.split.extent(&t.problem, t.op);
        if t.micro < 1 || t.micro > extent {
            return Err(bad(format!("outside 1..={extent} ({} split)", t.split)));
        }
        if let Some(x) = m.measurements.iter().find(|x| x.micro != t.micro) {
            return Err(bad(format!("a measurement is at micro-batch {}", x.micro)));
        }
        if let Some(x) = m.measurements.iter().find(|x| x.algo.kind() != t.kind) {
            return Err(bad(format!(
                "a measurement of {} is not {}",
                x.algo, t.kind
            )));
        }
        for x in &m.skipped {
            if x.micro != t.micro || x.algo.kind() != t.kind {
                return Err(bad(format!(
                    "a skipped candidate {} at micro-batch {} is not of this task",
                    x.algo, x.micro
                )));
            }
        }
    }
    let records = measured.iter().flat_map(|m| {
        m.measurements.iter().map(move |x| {
            let t = &m.task;
            (t.layer.as_str(), &t.problem, t.op, t.split, x)
        })
    });
    check
        .batch_split(records)
        .map_err(|refused| invalid(format!("measurement {refused}")))?;
    for m in measured {
        let t = &m.task;
        cache.store_measured_along(
            check.device,
            &t.layer,
            &t.problem,
            t.op,
            t.split,
            t.micro,
            t.kind,
            &m.measurements,
            &m.skipped,
        );
    }
    Ok(measured.len())
}

/// Which dimension a layer's plans may split (issue 24).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SplitSetting {
    /// Micro-batches only (µ-cuDNN).
    Batch,
    /// Chunks along the outermost spatial dimension only.
    Spatial,
    /// Micro-batches, and also chunks where [`SplitSetting::considers_spatial`] predicts a
    /// gain; the faster plan under the limit is kept.
    #[default]
    Auto,
}

/// `auto` considers a spatial split only up to this batch size: above it, micro-batches
/// already give the solver sizes to choose from.
pub const SPATIAL_AUTO_MAX_BATCH: i64 = 4;

impl SplitSetting {
    pub const ALL: [SplitSetting; 3] = [
        SplitSetting::Batch,
        SplitSetting::Spatial,
        SplitSetting::Auto,
    ];

    pub fn name(self) -> &'static str {
        match self {
            SplitSetting::Batch => "batch",
            SplitSetting::Spatial => "spatial",
            SplitSetting::Auto => "auto",
        }
    }

    /// Whether `auto` looks at a spatial split of `problem` at all: a batch of at most
    /// [`SPATIAL_AUTO_MAX_BATCH`] and at least two rows along the split axis. It then tunes the
    /// spatial split only when the batch profile shows workspace pressure (a candidate
    /// skipped for its workspace at the limit): without it, splitting can only add calls.
    pub fn auto_looks_at(problem: &ConvProblem) -> bool {
        problem.n <= SPATIAL_AUTO_MAX_BATCH
            && ConvOp::ALL
                .iter()
                .all(|&op| SplitDim::Spatial.extent(problem, op) >= 2)
    }

    /// Whether `auto` tunes chunks of `problem` after its batch sizes: it
    /// [looks at](Self::auto_looks_at) the problem, and the batch sizes skipped a candidate
    /// (`skipped`) for a workspace over `limit_bytes`. The one rule the tuner, the task API and
    /// the CLI apply.
    pub fn auto_wants_chunks<'s>(
        problem: &ConvProblem,
        skipped: impl IntoIterator<Item = &'s Skipped>,
        limit_bytes: u64,
    ) -> bool {
        Self::auto_looks_at(problem) && skipped.into_iter().any(|s| s.workspace_bytes > limit_bytes)
    }

    /// The plan-cache context part of this setting for `problem`: empty where the plans are
    /// those of `batch` (so plans cached before the setting existed still serve), else
    /// `split=<name>`.
    pub fn context(self, problem: &ConvProblem) -> &'static str {
        match self {
            SplitSetting::Batch => "",
            SplitSetting::Auto if !Self::auto_looks_at(problem) => "",
            SplitSetting::Auto => "split=auto",
            SplitSetting::Spatial => "split=spatial",
        }
    }
}

impl std::fmt::Display for SplitSetting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for SplitSetting {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        SplitSetting::ALL
            .into_iter()
            .find(|v| v.name() == s)
            .ok_or_else(|| format!("unknown split {s:?} (batch, spatial or auto)"))
    }
}

/// How a single layer tunes itself: per-layer workspace limit (WR), since it sees only itself.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerTuning {
    pub policy: Policy,
    pub workspace_limit_bytes: u64,
    pub timing: TimingSettings,
    pub candidates: CandidateSet,
    pub engines: EngineOptions,
    /// Which dimension plans may split (default `auto`).
    pub split: SplitSetting,
}

impl LayerTuning {
    /// The `[forward, backward-data, backward-filter]` plans of `problem`: cached plans when the
    /// cache has all three, else profile (through the cache), solve and store them.
    pub fn tune(
        &self,
        backend: &mut dyn Backend,
        cache: &Cache,
        layer: &str,
        problem: &ConvProblem,
    ) -> Result<[Plan; 3], TuneError> {
        self.tune_counted(backend, cache, layer, problem)
            .map(|(plans, _)| plans)
    }

    /// A profiling run through `cache` with these settings (no interrupt; measuring within
    /// the per-layer limit).
    pub fn profile_run<'a>(&self, cache: &'a Cache) -> ProfileRun<'a> {
        ProfileRun {
            policy: self.policy,
            timing: self.timing,
            cache,
            interrupt: None,
            candidates: self.candidates,
            engines: self.engines,
            workspace_limit_bytes: Some(self.workspace_limit_bytes),
        }
    }

    /// As [`LayerTuning::tune`], also saying how many (size, kind) measurements came from the
    /// cache and how many were measured (both 0 when the solved plans were cached).
    pub fn tune_counted(
        &self,
        backend: &mut dyn Backend,
        cache: &Cache,
        layer: &str,
        problem: &ConvProblem,
    ) -> Result<([Plan; 3], CacheStats), TuneError> {
        let (plans, stats) = self.tune_ops_counted(backend, cache, layer, problem, &ConvOp::ALL)?;
        let plans: [Plan; 3] = plans.try_into().expect("three ops");
        Ok((plans, stats))
    }

    /// As [`LayerTuning::tune_counted`] for `ops` only (e.g. just the forward, for inference):
    /// the plans of those ops in that order, nothing measured or solved for the others. Cached
    /// plans are returned when the cache has every op asked for.
    pub fn tune_ops_counted(
        &self,
        backend: &mut dyn Backend,
        cache: &Cache,
        layer: &str,
        problem: &ConvProblem,
        ops: &[ConvOp],
    ) -> Result<(Vec<Plan>, CacheStats), TuneError> {
        let device: DeviceFingerprint = backend.fingerprint().clone();
        let run = self.profile_run(cache);
        let mut key = PlanKey::reuse(
            self.policy,
            run.effective_candidates(backend.kinds()),
            self.workspace_limit_bytes,
        );
        key.context = self.plan_context(problem);
        let cached: Vec<Plan> = ops
            .iter()
            .filter_map(|&op| cache.plan(&device, problem, op, &key))
            .filter(|plan| plan_obeys_accuracy_rule(&device, plan))
            .collect();
        if cached.len() == ops.len() {
            let plans = cached
                .into_iter()
                .map(|plan| Plan {
                    layer: layer.to_string(),
                    ..plan
                })
                .collect();
            return Ok((plans, CacheStats::default()));
        }
        let mut stats = CacheStats::default();
        let mut plans = Vec::with_capacity(ops.len());
        // The ops share the operands; nothing measuring made outlives the tune.
        with_release(backend, &mut stats, |backend, stats| {
            for &op in ops {
                let plan = self.tune_op(backend, &run, layer, problem, op, stats)?;
                cache.store_plan(&device, &plan, &key);
                plans.push(plan);
            }
            Ok(())
        })?;
        Ok((plans, stats))
    }

    /// The jobs this tuning needs measured for `ops` of `problem` on `device` (a backend
    /// offering `offered`), for the tuner task API, which deals them out before tuning: the
    /// batch split's, or the spatial split's; for `auto` the batch split's, and the spatial
    /// split's of an op whose batch sizes are all in the cache and show workspace pressure
    /// there (as [`LayerTuning::tune`] decides), so asking again after the batch tasks are
    /// stored deals out the chunks too.
    pub fn jobs(
        &self,
        cache: &Cache,
        device: &DeviceFingerprint,
        offered: &[AlgoKind],
        layer: &str,
        problem: &ConvProblem,
        ops: &[ConvOp],
    ) -> Vec<Job> {
        let job = |op, split| Job {
            layer: layer.to_string(),
            problem: *problem,
            op,
            split,
        };
        let mut jobs = Vec::new();
        for &op in ops {
            match self.split {
                SplitSetting::Batch => jobs.push(job(op, SplitDim::Batch)),
                SplitSetting::Spatial => jobs.push(job(op, SplitDim::Spatial)),
                SplitSetting::Auto => {
                    jobs.push(job(op, SplitDim::Batch));
                    if self.cached_pressure(cache, device, offered, problem, op) {
                        jobs.push(job(op, SplitDim::Spatial));
                    }
                }
            }
        }
        jobs
    }

    /// Whether the cache holds every batch size of `op` on `problem` this tuning measures,
    /// and what they skipped makes `auto` tune chunks ([`SplitSetting::auto_wants_chunks`]).
    fn cached_pressure(
        &self,
        cache: &Cache,
        device: &DeviceFingerprint,
        offered: &[AlgoKind],
        problem: &ConvProblem,
        op: ConvOp,
    ) -> bool {
        let run = self.profile_run(cache);
        let mut skipped = Vec::new();
        for kind in run.offered_kinds(offered) {
            for micro in self.policy.sizes(problem.n) {
                match cache.measured_along(device, problem, op, SplitDim::Batch, micro, kind) {
                    None => return false,
                    Some((_, at_size)) => skipped.extend(at_size),
                }
            }
        }
        SplitSetting::auto_wants_chunks(problem, &skipped, self.workspace_limit_bytes)
    }

    /// The plan-cache context of this tuning's plans of `problem`: determinism and the split
    /// setting ([`SplitSetting::context`]), `;`-separated; empty for plain batch plans.
    pub fn plan_context(&self, problem: &ConvProblem) -> String {
        let parts = [
            if self.engines.deterministic {
                DETERMINISTIC_CONTEXT
            } else {
                ""
            },
            self.split.context(problem),
        ];
        parts
            .into_iter()
            .filter(|p| !p.is_empty())
            .collect::<Vec<_>>()
            .join(";")
    }

    /// One split's profile of `op` through the cache, restricted as plans must be
    /// (deterministic candidates, the accuracy rule), and its plan at the limit.
    fn solve_split(
        &self,
        backend: &mut dyn Backend,
        run: &ProfileRun<'_>,
        job: &Job,
        stats: &mut CacheStats,
    ) -> Result<(OpProfile, Plan), TuneError> {
        let device = backend.fingerprint().clone();
        let mut profile = profile_job_cached(backend, job, run, stats, &mut |_, _| {})?;
        if self.engines.deterministic {
            keep_deterministic(backend, &mut profile);
        }
        keep_accurate_sizes(&device, &mut profile);
        let plan = solve_wr(&profile, self.policy, self.workspace_limit_bytes)?;
        Ok((profile, plan))
    }

    /// The plan of one op under [`LayerTuning::split`]: `batch` and `spatial` solve that split;
    /// `auto` solves the batch split, and where [`SplitSetting::auto_looks_at`] the problem and
    /// the batch profile skipped a candidate for its workspace (or no batch plan fits the
    /// limit), also the spatial split, keeping the faster plan. A spatial split the backend
    /// cannot measure, or that does not fit either, leaves `auto` with the batch outcome.
    fn tune_op(
        &self,
        backend: &mut dyn Backend,
        run: &ProfileRun<'_>,
        layer: &str,
        problem: &ConvProblem,
        op: ConvOp,
        stats: &mut CacheStats,
    ) -> Result<Plan, TuneError> {
        let job = |split| Job {
            layer: layer.to_string(),
            problem: *problem,
            op,
            split,
        };
        match self.split {
            SplitSetting::Batch => Ok(self
                .solve_split(backend, run, &job(SplitDim::Batch), stats)?
                .1),
            SplitSetting::Spatial => Ok(self
                .solve_split(backend, run, &job(SplitDim::Spatial), stats)?
                .1),
            SplitSetting::Auto => {
                let batch = self.solve_split(backend, run, &job(SplitDim::Batch), stats);
                let chunks = match &batch {
                    Ok((profile, _)) => SplitSetting::auto_wants_chunks(
                        problem,
                        &profile.skipped,
                        self.workspace_limit_bytes,
                    ),
                    Err(TuneError::Solve(_)) => SplitSetting::auto_looks_at(problem),
                    Err(_) => false,
                };
                if !chunks {
                    return batch.map(|(_, plan)| plan);
                }
                let spatial = self.solve_split(backend, run, &job(SplitDim::Spatial), stats);
                match (batch, spatial) {
                    (Ok((_, b)), Ok((_, s))) => Ok(if s.replaces(&b) { s } else { b }),
                    (Err(_), Ok((_, s))) => Ok(s),
                    // Ctrl-C while measuring chunks stops the tune, as it stops a batch one.
                    (_, Err(interrupted @ TuneError::Interrupted { .. })) => Err(interrupted),
                    // The chunks cannot be measured (NoSpatial) or do not fit: the batch outcome.
                    (batch, Err(_)) => batch.map(|(_, plan)| plan),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device(backend: BackendKind) -> DeviceFingerprint {
        DeviceFingerprint {
            backend,
            name: "NVIDIA H100 80GB HBM3".into(),
            compute_capability: Some((9, 0)),
            driver_version: Some(13000),
            cudnn_version: Some(91900),
        }
    }

    /// A profile where smaller micro-batches are faster per sample (the solver's favourite
    /// kind of split) and need less workspace: size m takes 0.5 m + 0.01 m² ms and 1 KiB x m.
    fn profile(n: i64, dtype: DType, op: ConvOp) -> OpProfile {
        let mut problem = ConvProblem::new(n, 64, 14, 14, 64, 3, 3);
        problem.dtype = dtype;
        problem.pad_h = 1;
        problem.pad_w = 1;
        OpProfile {
            layer: "resnet50.layer1.0.conv2".into(),
            problem,
            op,
            split: crate::solver::SplitDim::Batch,
            measurements: (1..=n)
                .map(|m| Measurement {
                    micro: m,
                    algo: Algo::Legacy(1),
                    time_ms: 0.5 * m as f64 + 0.01 * (m * m) as f64,
                    workspace_bytes: 1024 * m as u64,
                })
                .collect(),
            skipped: Vec::new(),
        }
    }

    fn solve(device: &DeviceFingerprint, entry: &OpProfile, policy: Policy, limit: u64) -> Plan {
        let mut entry = entry.clone();
        keep_accurate_sizes(device, &mut entry);
        solve_wr(&entry, policy, limit).unwrap()
    }

    #[test]
    fn bf16_backward_filter_on_cudnn_has_at_most_four_micro_batches() {
        let cudnn = device(BackendKind::Cuda);
        for n in [1, 2, 3, 5, 7, 10, 16, 17, 31, 64] {
            let entry = profile(n, DType::Bf16, ConvOp::BackwardFilter);
            assert_eq!(
                min_micro_batch(&cudnn, &entry.problem, entry.op),
                (n + 3) / 4
            );
            let undivided = solve_wr(&entry, Policy::Undivided, u64::MAX).unwrap();
            for policy in Policy::ALL {
                let plan = solve(&cudnn, &entry, policy, u64::MAX);
                let sizes: Vec<i64> = plan.micro_batches.iter().map(|mb| mb.size).collect();
                assert!(sizes.len() <= 4, "n {n} {policy}: {sizes:?}");
                assert_eq!(sizes.iter().sum::<i64>(), n, "n {n} {policy}: {sizes:?}");
                assert!(plan_obeys_accuracy_rule(&cudnn, &plan));
                assert!(
                    plan.time_ms() <= undivided.time_ms(),
                    "n {n} {policy}: {} > {}",
                    plan.time_ms(),
                    undivided.time_ms()
                );
            }
        }
    }

    #[test]
    fn the_rule_spares_fp16_other_ops_and_the_cpu() {
        let n = 16;
        let cases = [
            (
                device(BackendKind::Cuda),
                DType::Fp16,
                ConvOp::BackwardFilter,
            ),
            (
                device(BackendKind::Cuda),
                DType::Fp32,
                ConvOp::BackwardFilter,
            ),
            (device(BackendKind::Cuda), DType::Bf16, ConvOp::Forward),
            (device(BackendKind::Cuda), DType::Bf16, ConvOp::BackwardData),
            (
                device(BackendKind::Cpu),
                DType::Bf16,
                ConvOp::BackwardFilter,
            ),
        ];
        for (device, dtype, op) in cases {
            let entry = profile(n, dtype, op);
            assert_eq!(min_micro_batch(&device, &entry.problem, op), 1);
            let plan = solve(&device, &entry, Policy::All, u64::MAX);
            // Unrestricted, this profile splits into micro-batches of 1.
            assert_eq!(plan.micro_batches.len(), n as usize, "{dtype:?} {op}");
        }
    }

    #[test]
    fn an_infeasible_limit_names_the_smallest_limit_under_the_rule() {
        let cudnn = device(BackendKind::Cuda);
        let mut entry = profile(16, DType::Bf16, ConvOp::BackwardFilter);
        keep_accurate_sizes(&cudnn, &mut entry);
        // Size 1 would fit 1 KiB, but sizes below 4 are gone: the smallest limit is 4 KiB.
        for policy in [Policy::PowerOfTwo, Policy::All] {
            match solve_wr(&entry, policy, 1024) {
                Err(SolveError::Infeasible {
                    min_workspace_bytes,
                    ..
                }) => assert_eq!(min_workspace_bytes, Some(4096), "{policy}"),
                other => panic!("{policy}: {other:?}"),
            }
            let plan = solve_wr(&entry, policy, 4096).unwrap();
            assert_eq!(plan.micro_batches.len(), 4, "{policy}");
        }
    }

    #[test]
    fn a_profile_is_restricted_by_its_own_fingerprint() {
        let entry = profile(16, DType::Bf16, ConvOp::BackwardFilter);
        let mut whole = Profile {
            entries: vec![entry.clone(), profile(16, DType::Bf16, ConvOp::Forward)],
            ..Profile::default()
        };
        // No fingerprint: nothing says the measurements are cuDNN's.
        keep_accurate_sizes_in(&mut whole);
        assert_eq!(whole.entries[0], entry);
        whole.fingerprint = Some(device(BackendKind::Cuda));
        keep_accurate_sizes_in(&mut whole);
        let sizes = |e: &OpProfile| e.measurements.iter().map(|m| m.micro).collect::<Vec<_>>();
        assert_eq!(sizes(&whole.entries[0]), (4..=16).collect::<Vec<_>>());
        assert_eq!(sizes(&whole.entries[1]), (1..=16).collect::<Vec<_>>());
    }

    #[test]
    fn a_plan_cached_before_the_rule_is_refused() {
        let cudnn = device(BackendKind::Cuda);
        let entry = profile(16, DType::Bf16, ConvOp::BackwardFilter);
        let old = solve_wr(&entry, Policy::All, u64::MAX).unwrap();
        assert_eq!(old.micro_batches.len(), 16);
        assert!(!plan_obeys_accuracy_rule(&cudnn, &old));
        assert!(plan_obeys_accuracy_rule(&device(BackendKind::Cpu), &old));
    }
}
