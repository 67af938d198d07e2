//! Tuning: problem -> profile -> (cache) -> solve -> plans, for a whole network (`mucudnn
//! tune`) or for one layer on first use (the drop-in [`Conv2d`](crate::exec::conv2d::Conv2d)).
//!
//! The cache sits between profile and solve: a (shape, op, micro-batch size) already measured
//! on this device is read, not measured; each newly measured size is stored at once, so an
//! interrupted run keeps its work. A layer's solved plans are cached too.

use crate::backend::{Backend, BackendError, TimingSettings};
use crate::profiler::{measure_sizes_parallel, same_model, Job, Progress};
use crate::solver::{
    solve_wr, ConvOp, ConvProblem, DeviceFingerprint, Measurement, OpProfile, Plan, Policy,
    Profile, SolveError,
};
use mucudnn_cache::{Cache, PlanKey};
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
}

/// Where a profile's measurements came from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// (job, micro-batch size) pairs read from the cache.
    pub cached: usize,
    /// (job, micro-batch size) pairs measured by the backend in this run.
    pub measured: usize,
}

/// Everything a profiling run needs besides the backend and the jobs.
pub struct ProfileRun<'a> {
    pub policy: Policy,
    pub timing: TimingSettings,
    pub cache: &'a Cache,
    /// Set (e.g. by Ctrl-C) to stop after the current micro-batch size.
    pub interrupt: Option<&'a AtomicBool>,
}

/// Measures one job, reading what the cache has and storing what it measures.
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
    let sizes = run.policy.sizes(job.problem.n);
    let mut measurements: Vec<Measurement> = Vec::new();
    for (index, &micro) in sizes.iter().enumerate() {
        let cached = run.cache.measurements(&device, &job.problem, job.op, micro);
        let from_cache = cached.is_some();
        let found = match cached {
            Some(found) => {
                stats.cached += 1;
                found
            }
            None => {
                if run
                    .interrupt
                    .is_some_and(|flag| flag.load(Ordering::Relaxed))
                {
                    return Err(TuneError::Interrupted {
                        measured: stats.measured,
                    });
                }
                let found = backend.measure(&job.problem, job.op, micro, &run.timing)?;
                run.cache.store_measurements(
                    &device,
                    &job.layer,
                    &job.problem,
                    job.op,
                    micro,
                    &found,
                );
                stats.measured += 1;
                found
            }
        };
        measurements.extend(found);
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
        measurements,
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
    for job in jobs {
        profile
            .entries
            .push(profile_job_cached(backend, job, run, &mut stats, progress)?);
    }
    Ok((profile, stats))
}

/// Like [`profile_jobs`] on several devices of one model: for each job, the sizes the cache
/// lacks are dealt out over `devices` backends, one thread each, made by `make(d)` inside
/// its thread (cuDNN handles stay on the thread that made them). Measurements are stored
/// under `fingerprint`, which must be the devices' model. Progress is reported per job.
pub fn profile_jobs_parallel<B, F>(
    make: F,
    devices: usize,
    fingerprint: &DeviceFingerprint,
    jobs: &[Job],
    run: &ProfileRun<'_>,
    progress: &mut dyn FnMut(Progress<'_>, bool),
) -> Result<(Profile, CacheStats), TuneError>
where
    B: Backend,
    F: Fn(usize) -> Result<B, BackendError> + Sync,
{
    let mut stats = CacheStats::default();
    let mut entries = Vec::with_capacity(jobs.len());
    for job in jobs {
        let sizes = run.policy.sizes(job.problem.n);
        let mut by_size: Vec<(i64, Vec<Measurement>)> = Vec::with_capacity(sizes.len());
        let mut missing = Vec::new();
        for &micro in &sizes {
            match run
                .cache
                .measurements(fingerprint, &job.problem, job.op, micro)
            {
                Some(found) => by_size.push((micro, found)),
                None => missing.push(micro),
            }
        }
        stats.cached += by_size.len();
        if !missing.is_empty() {
            if run
                .interrupt
                .is_some_and(|flag| flag.load(Ordering::Relaxed))
            {
                return Err(TuneError::Interrupted {
                    measured: stats.measured,
                });
            }
            let (device, measured) =
                measure_sizes_parallel(&make, devices, job, &missing, &run.timing)?;
            if !same_model(&device, fingerprint) {
                return Err(BackendError::MixedDevices {
                    first: fingerprint.to_string(),
                    other: device.to_string(),
                }
                .into());
            }
            for (micro, found) in measured {
                run.cache.store_measurements(
                    fingerprint,
                    &job.layer,
                    &job.problem,
                    job.op,
                    micro,
                    &found,
                );
                stats.measured += 1;
                by_size.push((micro, found));
            }
        }
        by_size.sort_by_key(|(micro, _)| *micro);
        for (index, &micro) in sizes.iter().enumerate() {
            progress(
                Progress {
                    job,
                    micro,
                    done: index + 1,
                    total: sizes.len(),
                },
                !missing.contains(&micro),
            );
        }
        let measurements = by_size.into_iter().flat_map(|(_, m)| m).collect();
        entries.push(OpProfile {
            layer: job.layer.clone(),
            problem: job.problem,
            op: job.op,
            measurements,
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
        .flat_map(|(layer, problem)| {
            ConvOp::ALL.map(|op| Job {
                layer: layer.clone(),
                problem,
                op,
            })
        })
        .collect()
}

/// How a single layer tunes itself: per-layer workspace limit (WR), since it sees only itself.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerTuning {
    pub policy: Policy,
    pub workspace_limit_bytes: u64,
    pub timing: TimingSettings,
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
        let device: DeviceFingerprint = backend.fingerprint().clone();
        let key = PlanKey::reuse(self.policy, self.workspace_limit_bytes);
        let cached: Vec<Plan> = ConvOp::ALL
            .iter()
            .filter_map(|&op| cache.plan(&device, problem, op, &key))
            .collect();
        if let Ok(plans) = <[Plan; 3]>::try_from(cached) {
            return Ok(plans.map(|plan| Plan {
                layer: layer.to_string(),
                ..plan
            }));
        }
        let run = ProfileRun {
            policy: self.policy,
            timing: self.timing,
            cache,
            interrupt: None,
        };
        let mut stats = CacheStats::default();
        let mut plans = Vec::with_capacity(3);
        for op in ConvOp::ALL {
            let job = Job {
                layer: layer.to_string(),
                problem: *problem,
                op,
            };
            let profile = profile_job_cached(backend, &job, &run, &mut stats, &mut |_, _| {})?;
            let plan = solve_wr(&profile, self.policy, self.workspace_limit_bytes)?;
            cache.store_plan(&device, &plan, &key);
            plans.push(plan);
        }
        Ok(plans.try_into().expect("three ops"))
    }
}
