//! Tuning: problem -> profile -> (cache) -> solve -> plans, for a whole network (`mucudnn
//! tune`) or for one layer on first use (the drop-in [`Conv2d`](crate::layer::Conv2d)).
//!
//! The cache sits between profile and solve: a [`MeasureKey`](crate::solver::MeasureKey)
//! (shape, op, split, size, candidate kind) already measured on this device is read, not
//! measured; each newly measured size is stored at once, so an interrupted run keeps its work.
//! A layer's solved plans are cached too.
//!
//! - [`run`]: a profiling run's settings ([`ProfileRun`], [`EngineOptions`]), what it reports
//!   ([`CacheStats`]) and how it fails ([`TuneError`]).
//! - [`through_cache`]: measuring jobs through the cache on one backend ([`profile_jobs`]).
//! - [`parallel`]: the same over several devices of one model ([`profile_jobs_parallel`]).
//! - [`tasks`]: measuring work as plain data, dealt out over processes ([`MeasureTask`]).
//! - [`rules`]: what plans may use: deterministic candidates, and the bf16 accuracy rule.
//! - [`split`]: which dimension a layer's plans may split ([`SplitSetting`]).
//! - [`LayerTuning`], here: how one layer tunes itself, the type every integration holds.

pub mod parallel;
pub mod rules;
pub mod run;
pub mod split;
pub mod tasks;
pub mod through_cache;

pub use crate::device::BackendKind;
pub use parallel::profile_jobs_parallel;
pub use rules::{
    keep_accurate_sizes, keep_accurate_sizes_in, keep_deterministic, min_micro_batch,
    min_split_size, plan_obeys_accuracy_rule, solve_accurately,
    BF16_BACKWARD_FILTER_MAX_MICRO_BATCHES, DETERMINISTIC_CONTEXT,
};
pub use run::{CacheStats, EngineOptions, ProfileRun, TuneError};
pub use split::{SplitSetting, SPATIAL_AUTO_MAX_BATCH};
pub use tasks::{measure_task, missing_tasks, store_measured, MeasureTask, MeasuredTask};
pub use through_cache::{jobs_for, profile_jobs};

use crate::backend::{Backend, TimingSettings};
use crate::profiler::Job;
use crate::solver::{
    solve_wr, AlgoKind, CandidateSet, ConvOp, ConvProblem, DeviceFingerprint, IndexLimit,
    MeasureKey, OpKey, OpProfile, Plan, Policy, SplitDim,
};
use mucudnn_cache::{Cache, PlanKey};
use through_cache::{profile_job_cached, with_release};

/// The per-layer workspace limit of [`LayerTuning::new`] (64 MiB, as the C ABI's default).
pub const DEFAULT_WORKSPACE_LIMIT_BYTES: u64 = 64 << 20;

/// The plan-cache context of plans solved from verified measurements: a plan solved before
/// verification (or without it) is never served to a tune that verifies.
pub const VERIFIED_CONTEXT: &str = "verified";

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
    /// What one call's operand may reach: cuDNN's 32-bit indexing ([`IndexLimit::CUDNN`],
    /// the default), lowered only by tests to split small tensors as huge ones are split.
    /// Sizes whose calls exceed it are neither measured nor offered; a problem none of whose
    /// sizes fit is [`TuneError::Indexing`].
    pub index_limit: IndexLimit,
    /// Verify candidates' outputs against the reference candidate's and never plan with a
    /// wrong one (default on; see [`ProfileRun::verify`]).
    pub verify: bool,
}

impl LayerTuning {
    /// The defaults every integration starts from, timed as `timing` says: micro-batch sizes
    /// that are powers of two, a [`DEFAULT_WORKSPACE_LIMIT_BYTES`] limit, every candidate kind,
    /// the default engine search, the `auto` split, and verification.
    pub fn new(timing: TimingSettings) -> LayerTuning {
        LayerTuning {
            policy: Policy::PowerOfTwo,
            workspace_limit_bytes: DEFAULT_WORKSPACE_LIMIT_BYTES,
            timing,
            candidates: CandidateSet::All,
            engines: EngineOptions::default(),
            split: SplitSetting::Auto,
            index_limit: IndexLimit::CUDNN,
            verify: true,
        }
    }

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
            index_limit: self.index_limit,
            verify: self.verify,
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
                    let batch = job(op, SplitDim::Batch);
                    if self
                        .index_limit
                        .largest_size(problem, op, SplitDim::Batch)
                        .is_err()
                        && SplitSetting::auto_looks_at(problem)
                    {
                        // No micro-batch fits 32-bit indexing: only chunks can.
                        jobs.push(job(op, SplitDim::Spatial));
                        continue;
                    }
                    jobs.push(batch);
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
        let Ok(sizes) = run.sizes(&Job::batch("", *problem, op)) else {
            return false;
        };
        let mut skipped = Vec::new();
        for kind in run.offered_kinds(offered) {
            for &micro in &sizes {
                match cache.measured(device, &MeasureKey::batch(*problem, op, micro, kind)) {
                    None => return false,
                    Some(at_size) if at_size.verification.needs_measuring(self.verify) => {
                        return false
                    }
                    Some(at_size) => skipped.extend(at_size.skipped),
                }
            }
        }
        SplitSetting::auto_wants_chunks(problem, &skipped, self.workspace_limit_bytes)
    }

    /// The plan-cache context of this tuning's plans of `problem`: determinism, the split
    /// setting ([`SplitSetting::context`]) and verification ([`VERIFIED_CONTEXT`]),
    /// `;`-separated; empty for plain batch plans solved without verification.
    pub fn plan_context(&self, problem: &ConvProblem) -> String {
        // Plans under a lowered index limit (tests) are not cuDNN's plans: cached apart.
        let index_limit = if self.index_limit == IndexLimit::CUDNN {
            String::new()
        } else {
            format!("index_limit={}", self.index_limit.max_elements())
        };
        let parts = [
            if self.engines.deterministic {
                DETERMINISTIC_CONTEXT
            } else {
                ""
            },
            self.split.context(problem),
            &index_limit,
            if self.verify { VERIFIED_CONTEXT } else { "" },
        ];
        parts
            .into_iter()
            .filter(|p| !p.is_empty())
            .collect::<Vec<_>>()
            .join(";")
    }

    /// Whether `backend` can measure chunks of `op` on `problem` of every kind `run`
    /// measures (a spatial `auto` otherwise keeps the batch outcome, measuring nothing).
    fn measures_chunks(
        run: &ProfileRun<'_>,
        backend: &dyn Backend,
        problem: &ConvProblem,
        op: ConvOp,
    ) -> bool {
        let chunks = OpKey::new(*problem, op, SplitDim::Spatial);
        run.offered_kinds(backend.kinds())
            .into_iter()
            .all(|kind| backend.supports(&chunks.of_kind(kind).at(1)))
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
                    // No micro-batch plan fits the workspace limit, or 32-bit indexing.
                    Err(TuneError::Solve(_) | TuneError::Indexing { .. }) => {
                        SplitSetting::auto_looks_at(problem)
                    }
                    Err(_) => false,
                };
                if !chunks || !Self::measures_chunks(run, backend, problem, op) {
                    return batch.map(|(_, plan)| plan);
                }
                let spatial = self.solve_split(backend, run, &job(SplitDim::Spatial), stats);
                match (batch, spatial) {
                    (Ok((_, b)), Ok((_, s))) => Ok(if s.replaces(&b) { s } else { b }),
                    (Err(_), Ok((_, s))) => Ok(s),
                    // Ctrl-C while measuring chunks stops the tune, as it stops a batch one.
                    (_, Err(interrupted @ TuneError::Interrupted { .. })) => Err(interrupted),
                    // Neither micro-batches nor chunks fit 32-bit indexing: the chunks' reason
                    // says the more (the batch's only points at them).
                    (Err(TuneError::Indexing { .. }), Err(chunks @ TuneError::Indexing { .. })) => {
                        Err(chunks)
                    }
                    // The chunks do not fit: the batch outcome.
                    (batch, Err(_)) => batch.map(|(_, plan)| plan),
                }
            }
        }
    }
}
