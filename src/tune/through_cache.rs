//! Measuring jobs through the cache on one backend: each (size, kind) the cache holds for the
//! run's limit is read, every other one measured and stored at once, so an interrupted run
//! keeps its work.

use super::run::{CacheStats, ProfileRun, TuneError};
use crate::backend::{
    check_supported, Backend, BackendError, EngineSearch, Measured, Selection, TimingSettings,
};
use crate::device::BackendKind;
use crate::profiler::{prune, Job, Progress};
use crate::solver::{
    ConvOp, ConvProblem, DeviceFingerprint, MeasureKey, Measurement, OpProfile, Profile,
};
use std::collections::BTreeMap;

/// What a size holds after measuring `found` with `select` over what the cache had: the cached
/// timings and rejections with the new ones, the skipped candidates that are still not timed,
/// and the size verified only when both parts were. A selection of every candidate replaces
/// what was cached.
pub(super) fn merge_measured(
    cached: Option<Measured>,
    select: &Selection,
    found: Measured,
) -> Measured {
    let Some(cached) = cached.filter(|_| select.only.is_some()) else {
        return found;
    };
    let mut merged = cached;
    merged.measurements.extend(found.measurements);
    merged.rejected.extend(found.rejected);
    merged.skipped.retain(|s| !select.wants(&s.algo));
    merged.skipped.extend(found.skipped);
    merged.verification = merged.verification.and(found.verification);
    merged
}

/// One key (a size of one kind) through the cache: what the cache holds when it serves the
/// run's limit (`true`), else measured (everything, or what a smaller limit skipped; engine
/// configurations as `search` says), stored merged with what was cached under `layer`, and
/// returned (`false`).
pub(super) fn size_through_cache(
    backend: &mut dyn Backend,
    run: &ProfileRun<'_>,
    layer: &str,
    key: &MeasureKey,
    search: EngineSearch,
    stats: &mut CacheStats,
) -> Result<(Measured, bool), TuneError> {
    let device = backend.fingerprint().clone();
    let cached = run.cache.measured(&device, key);
    let Some(select) = run.selection(cached.as_ref()) else {
        stats.cached += 1;
        return Ok((cached.unwrap_or_default(), true));
    };
    if run.interrupted() {
        return Err(TuneError::Interrupted {
            measured: stats.measured,
        });
    }
    check_supported(backend, key)?;
    let pruned = search.skip.len();
    let how = run.how(search, select);
    let found = backend.measure(key, &how)?;
    stats.pruned += pruned;
    stats.count(&found);
    let merged = merge_measured(cached, &how.select, found);
    run.cache.store_size(&device, layer, key, &merged);
    stats.measured += 1;
    Ok((merged, false))
}

/// Measures one job, reading what the cache has and storing what it measures. Sizes go in
/// [`prune::measure_order`]: anchors first, then the sizes between them, where engine
/// configurations dominated at both neighbouring anchors are not timed.
pub(super) fn profile_job_cached(
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
    let sizes = run.sizes(job)?;
    let key = job.key();
    let mut by_size: BTreeMap<i64, Vec<Measurement>> = BTreeMap::new();
    let mut skipped = Vec::new();
    let mut rejected = Vec::new();
    for (index, step) in prune::measure_order(&sizes).into_iter().enumerate() {
        let micro = step.micro;
        let mut from_cache = true;
        for &kind in &kinds {
            let search = run.engine_search(kind, step, &by_size);
            let (found, cached) = size_through_cache(
                backend,
                run,
                &job.layer,
                &key.of_kind(kind).at(micro),
                search,
                stats,
            )?;
            from_cache &= cached;
            by_size.entry(micro).or_default().extend(found.measurements);
            skipped.extend(found.skipped);
            rejected.extend(found.rejected);
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
        rejected,
    })
}

/// An empty profile that says where and how its measurements were taken.
pub(super) fn profile_header(fingerprint: &DeviceFingerprint, timing: &TimingSettings) -> Profile {
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
pub(super) fn with_release<T>(
    backend: &mut dyn Backend,
    stats: &mut CacheStats,
    f: impl FnOnce(&mut dyn Backend, &mut CacheStats) -> Result<T, TuneError>,
) -> Result<T, TuneError> {
    let result = f(backend, stats);
    stats.memory = stats.memory.max(backend.memory());
    backend.release();
    result
}

/// The jobs of a set of named problems: every op of every problem.
pub fn jobs_for(layers: impl IntoIterator<Item = (String, ConvProblem)>) -> Vec<Job> {
    layers
        .into_iter()
        .flat_map(|(layer, problem)| ConvOp::ALL.map(|op| Job::batch(layer.clone(), problem, op)))
        .collect()
}
