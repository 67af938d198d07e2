//! Measuring work as plain data: the (layer, [`MeasureKey`]) units the cache lacks, dealt out
//! over processes (ranks of a distributed job, the C ABI's tuner), measured where they land,
//! and their results shared so that every rank stores the same measurements.

use super::run::{CacheStats, ProfileRun, TuneError};
use super::through_cache::size_through_cache;
use crate::backend::{Backend, BackendError};
use crate::profiler::{prune, Job};
use crate::solver::{
    AlgoKind, ConvOp, ConvProblem, DeviceFingerprint, MeasureKey, Measured, Measurement,
    RecordCheck, SizeVerification, Skipped, SplitDim,
};
use mucudnn_cache::Cache;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// One unit of measuring work that the cache lacks: a layer's [`MeasureKey`] (its fields kept
/// flat, as the task API's JSON has them). Tasks are plain data so that they can be dealt out over processes (ranks of
/// a distributed job) and their results shared ([`MeasuredTask`]): every rank then stores the
/// same measurements and solves the same plans.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MeasureTask {
    pub layer: String,
    /// The problem at the full mini-batch size.
    pub problem: ConvProblem,
    pub op: ConvOp,
    /// What `micro` splits: a micro-batch size, or a chunk's rows along the split axis
    /// (a spatial split). Batch when absent (tasks from before the split).
    #[serde(default, skip_serializing_if = "SplitDim::is_batch")]
    pub split: SplitDim,
    pub micro: i64,
    pub kind: AlgoKind,
    /// For a size between two anchors (see [`prune::measure_order`]): the anchors, whose
    /// measurements decide which engine configurations are skipped. Measure every anchor task
    /// (and store the results) before the tasks between them, as [`missing_tasks`] orders them.
    pub between: Option<(i64, i64)>,
}

impl MeasureTask {
    /// What the task measures.
    pub fn key(&self) -> MeasureKey {
        MeasureKey::new(self.problem, self.op, self.split, self.micro, self.kind)
    }
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
    /// Candidates timed whose output was over their tolerance: stored as rejected.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rejected: Vec<Measurement>,
    /// Whether the size was measured with verification (unverified when absent).
    #[serde(default)]
    pub verification: SizeVerification,
}

impl MeasuredTask {
    /// What the task's size holds, as the cache stores it.
    pub fn measured(&self) -> Measured {
        Measured {
            measurements: self.measurements.clone(),
            skipped: self.skipped.clone(),
            rejected: self.rejected.clone(),
            verification: self.verification,
        }
    }
}

/// The tasks the cache lacks for `jobs` on `fingerprint` (a backend offering `offered`),
/// anchors of every job first, then the sizes between them; deterministic for the same cache
/// contents. A verifying run also lacks the sizes measured without verification. Errors as
/// [`ProfileRun`] does for candidate kinds the backend lacks.
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
        let sizes = run.sizes(job)?;
        let missing: BTreeMap<AlgoKind, Vec<i64>> = kinds
            .iter()
            .map(|&kind| {
                let key = job.key().of_kind(kind);
                let mut missing = run.cache.missing_sizes_within(
                    fingerprint,
                    &key,
                    &sizes,
                    run.workspace_limit_bytes,
                );
                if run.verify {
                    missing.extend(run.cache.unverified_sizes(fingerprint, &key, &sizes));
                }
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
    let key = task.key();
    if !backend.supports(&key) {
        return Err(BackendError::unsupported(backend, &key).into());
    }
    let mut by_size: BTreeMap<i64, Vec<Measurement>> = BTreeMap::new();
    if let Some((lower, upper)) = task.between {
        for size in [lower, upper] {
            if let Some(found) = run.cache.measurements(&device, &key.sizes().at(size)) {
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
        &key,
        search,
        &mut CacheStats::default(),
    )?;
    Ok(MeasuredTask {
        task: task.clone(),
        measurements: found.measurements,
        skipped: found.skipped,
        rejected: found.rejected,
        verification: found.verification,
    })
}

/// Stores tasks measured elsewhere (another rank's device of the same fingerprint, `from`) in
/// `cache`, under `backend`'s fingerprint. Returns how many tasks were stored.
///
/// All or nothing: first every record passes [`RecordCheck::batch`], the check every record
/// entering the cache passes (`from` must be `backend`'s fingerprint, a candidate the backend
/// has, a positive finite time, a workspace within [`Backend::memory_bytes`], a well-formed
/// verification), and each measurement (or rejected candidate) must be of its task's
/// micro-batch size and candidate kind, with a verification that agrees with its list
/// ([`RecordCheck::verdict`]). The first bad record refuses the whole batch, named by its
/// index among all the batch's measurements and rejected candidates (and its task's); nothing
/// is stored then.
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
        let timed = m.measurements.iter().chain(&m.rejected);
        if let Some(x) = timed.clone().find(|x| x.micro != t.micro) {
            return Err(bad(format!("a measurement is at micro-batch {}", x.micro)));
        }
        if let Some(x) = timed.clone().find(|x| x.algo.kind() != t.kind) {
            return Err(bad(format!(
                "a measurement of {} is not {}",
                x.algo, t.kind
            )));
        }
        let verdicts = m
            .measurements
            .iter()
            .map(|x| (x, false))
            .chain(m.rejected.iter().map(|x| (x, true)));
        for (x, rejected) in verdicts {
            check.verdict(x, rejected).map_err(|e| bad(e.to_string()))?;
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
        m.measurements.iter().chain(&m.rejected).map(move |x| {
            let t = &m.task;
            (t.layer.as_str(), &t.problem, t.op, t.split, x)
        })
    });
    check
        .batch_split(records)
        .map_err(|refused| invalid(format!("measurement {refused}")))?;
    for m in measured {
        let t = &m.task;
        cache.store_size(check.device, &t.layer, &t.key(), &m.measured());
    }
    Ok(measured.len())
}
