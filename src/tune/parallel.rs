//! Measuring jobs through the cache on several devices of one model at once: the sizes the
//! cache lacks are dealt out over the devices, one thread and one backend each.

use super::run::{CacheStats, ProfileRun, TuneError};
use super::through_cache::{merge_measured, profile_header};
use crate::backend::{Backend, BackendError, EngineSearch, MeasureSettings, Selection};
use crate::profiler::{measure_sizes_parallel, prune, same_model, Job, Progress};
use crate::solver::{AlgoKind, DeviceFingerprint, Measured, Measurement, OpProfile, Profile};
use std::collections::{BTreeMap, BTreeSet};

/// Like [`profile_jobs`](super::profile_jobs) on several devices of one model: for each job and candidate kind,
/// the sizes the cache lacks are dealt out over `devices` backends, one thread each, made by
/// `make(d)` inside its thread (cuDNN handles stay on the thread that made them). The anchor
/// sizes are dealt out first, then the sizes between them, so pruning still applies.
/// Measurements are stored under `fingerprint`, which must be the devices' model, whose
/// backends offer the candidate kinds `offered`. Progress is reported per job.
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
        job.problem
            .validate()
            .map_err(|e| BackendError::Invalid(format!("{}: {e}", job.layer)))?;
        let sizes = run.sizes(job)?;
        let mut by_size: BTreeMap<i64, Vec<Measurement>> = BTreeMap::new();
        let mut measured_sizes: BTreeSet<i64> = BTreeSet::new();
        let mut skipped = Vec::new();
        let mut rejected = Vec::new();
        for &kind in &kinds {
            let key = job.key().of_kind(kind);
            let mut missing = Vec::new();
            // What the cache has at the sizes still to measure (a smaller limit's), and what
            // to time there.
            let mut partial: BTreeMap<i64, Measured> = BTreeMap::new();
            let mut selections: BTreeMap<i64, Selection> = BTreeMap::new();
            for &micro in &sizes {
                let cached = run.cache.measured(fingerprint, &key.at(micro));
                match run.selection(cached.as_ref()) {
                    None => {
                        let found = cached.unwrap_or_default();
                        stats.cached += 1;
                        by_size.entry(micro).or_default().extend(found.measurements);
                        skipped.extend(found.skipped);
                        rejected.extend(found.rejected);
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
                // The run holds the cache, which stays on this thread.
                let (timing, verify) = (run.timing, run.verify);
                let (device, measured, memory) =
                    measure_sizes_parallel(&make, devices, job, kind, &micros, &|micro| {
                        MeasureSettings {
                            timing,
                            search: searches.get(&micro).cloned().unwrap_or_default(),
                            select: selections.get(&micro).cloned().unwrap_or_default(),
                            verify,
                        }
                    })?;
                stats.memory = stats.memory.max(memory);
                if !same_model(&device, fingerprint) {
                    return Err(BackendError::MixedDevices {
                        first: fingerprint.to_string(),
                        other: device.to_string(),
                    }
                    .into());
                }
                for (micro, found) in measured {
                    stats.count(&found);
                    let select = selections.get(&micro).cloned().unwrap_or_default();
                    let found = merge_measured(partial.remove(&micro), &select, found);
                    run.cache
                        .store_size(fingerprint, &job.layer, &key.at(micro), &found);
                    stats.measured += 1;
                    stats.pruned += searches.get(&micro).map_or(0, |s| s.skip.len());
                    measured_sizes.insert(micro);
                    by_size.entry(micro).or_default().extend(found.measurements);
                    skipped.extend(found.skipped);
                    rejected.extend(found.rejected);
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
            rejected,
        });
    }
    let mut profile = profile_header(fingerprint, &run.timing);
    profile.entries = entries;
    Ok((profile, stats))
}
