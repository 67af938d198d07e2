//! Tuning: problem -> profile -> solve -> plans, for a whole network (`mucudnn tune`) or for
//! one layer on first use (the drop-in [`Conv2d`](crate::exec::conv2d::Conv2d)).

use crate::backend::{Backend, BackendError, TimingSettings};
use crate::profiler::{profile_job, Job, Progress};
use crate::solver::{solve_wr, ConvOp, ConvProblem, Plan, Policy, Profile, SolveError};

/// Why tuning failed.
#[derive(Debug, thiserror::Error)]
pub enum TuneError {
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    Solve(#[from] SolveError),
}

/// Measures every job on one backend into one profile, in job order.
pub fn profile_jobs(
    backend: &mut dyn Backend,
    jobs: &[Job],
    policy: Policy,
    timing: &TimingSettings,
    progress: &mut dyn FnMut(Progress<'_>),
) -> Result<Profile, BackendError> {
    let fingerprint = backend.fingerprint().clone();
    let mut profile = Profile {
        device: fingerprint.name.clone(),
        cudnn_version: fingerprint.cudnn_version,
        math: Some("as in each record's problem (default unless stated)".into()),
        timing: Some(format!(
            "median of {} loops of {} back-to-back calls after {} warm-up call(s); a call over {} ms timed once; \
             {} clock",
            timing.loops,
            timing.iterations,
            timing.warmup,
            timing.long_call_ms,
            match fingerprint.backend {
                crate::device::BackendKind::Cuda => "CUDA event",
                crate::device::BackendKind::Cpu => "host monotonic",
            }
        )),
        fingerprint: Some(fingerprint.clone()),
        entries: Vec::with_capacity(jobs.len()),
    };
    for job in jobs {
        profile
            .entries
            .push(profile_job(backend, job, policy, timing, progress)?);
    }
    Ok(profile)
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
    /// Profiles all three ops of `problem` and solves each: `[forward, backward-data,
    /// backward-filter]` plans.
    pub fn tune(
        &self,
        backend: &mut dyn Backend,
        layer: &str,
        problem: &ConvProblem,
    ) -> Result<[Plan; 3], TuneError> {
        let mut plans = Vec::with_capacity(3);
        for op in ConvOp::ALL {
            let job = Job {
                layer: layer.to_string(),
                problem: *problem,
                op,
            };
            let profile = profile_job(backend, &job, self.policy, &self.timing, &mut |_| {})?;
            plans.push(solve_wr(&profile, self.policy, self.workspace_limit_bytes)?);
        }
        Ok(plans.try_into().expect("three ops"))
    }
}
