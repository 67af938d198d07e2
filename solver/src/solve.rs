//! Whole-profile solving: every tuning problem of a [`Profile`] under one mode, with the
//! undivided baseline each plan is compared against. This is what `mucudnn solve`, `tune` and
//! the C ABI's pure solver entry point call.

use crate::algo::AlgoNames;
use crate::plan::Plan;
use crate::profile::{OpProfile, Policy, Profile};
use crate::wd::{self, solve_wd_by, WdOptions};
use crate::wr::{pareto_front, solve_wr, undivided};
use crate::SolveError;
use serde::{Deserialize, Serialize};
use std::time::Instant;

/// Per-layer limit (workspace reuse) or one shared budget (workspace division).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Mode {
    /// Every (layer, op) gets its own buffer of at most this size (they run one at a time, so
    /// one buffer of this size serves them all).
    WorkspaceReuse { workspace_limit_bytes: u64 },
    /// The workspaces of all (layer, op) pairs together fit in this many bytes.
    WorkspaceDivision { total_workspace_bytes: u64 },
}

impl Mode {
    /// `wr` or `wd`.
    pub fn short_name(&self) -> &'static str {
        match self {
            Mode::WorkspaceReuse { .. } => "wr",
            Mode::WorkspaceDivision { .. } => "wd",
        }
    }
}

/// A plan and what it is compared against.
#[derive(Clone, Debug, PartialEq)]
pub struct SolvedProblem {
    pub plan: Plan,
    /// The best single algorithm on the whole mini-batch under the same constraint: within the
    /// per-layer limit (WR), or the WD optimum restricted to undivided plans (WD). `None` when no
    /// single algorithm fits.
    pub undivided: Option<Plan>,
}

/// The solution of a whole profile.
#[derive(Clone, Debug, PartialEq)]
pub struct Solution {
    pub mode: Mode,
    pub policy: Policy,
    /// One per tuning problem (layer, problem, op), in profile order of its first entry; a
    /// problem profiled along both the batch and a spatial axis has one plan, of either split.
    pub problems: Vec<SolvedProblem>,
    /// False only in WD mode when the MILP solver stopped before proving optimality.
    pub proven_optimal: bool,
    /// How the WD assignment was found (`trivial`, `microlp`, `highs`, `greedy`); `dp` for WR.
    pub method: &'static str,
    /// How the plans' algorithms are named for people (the profile's backend).
    pub names: AlgoNames,
}

impl Solution {
    pub fn total_time_ms(&self) -> f64 {
        self.problems.iter().map(|p| p.plan.time_ms()).sum()
    }

    /// Sum of undivided times, or `None` if some problem has no undivided plan.
    pub fn total_undivided_ms(&self) -> Option<f64> {
        self.problems
            .iter()
            .map(|p| p.undivided.as_ref().map(Plan::time_ms))
            .sum()
    }

    /// The workspace to allocate: the largest plan's in WR mode, the sum in WD mode.
    pub fn total_workspace_bytes(&self) -> u64 {
        let sizes = self.problems.iter().map(|p| p.plan.workspace_bytes());
        match self.mode {
            Mode::WorkspaceReuse { .. } => sizes.max().unwrap_or(0),
            // Within the budget, a u64, once solved; saturating for hand-built solutions.
            Mode::WorkspaceDivision { .. } => sizes.fold(0u64, u64::saturating_add),
        }
    }
}

/// Solves every problem of a profile.
pub fn solve_profile(
    profile: &Profile,
    policy: Policy,
    mode: Mode,
    wd_options: &WdOptions,
) -> Result<Solution, SolveError> {
    profile.validate()?;
    match mode {
        Mode::WorkspaceReuse {
            workspace_limit_bytes,
        } => {
            let problems = groups(profile)
                .into_iter()
                .map(|group| {
                    // The faster split's plan; an infeasible split gives way to the other.
                    let mut best: Option<Plan> = None;
                    let mut first_error = None;
                    for entry in &group {
                        match solve_wr(entry, policy, workspace_limit_bytes) {
                            Ok(plan) => {
                                if best.as_ref().is_none_or(|b| plan.replaces(b)) {
                                    best = Some(plan);
                                }
                            }
                            Err(e) => {
                                first_error.get_or_insert(e);
                            }
                        }
                    }
                    let plan = match (best, first_error) {
                        (Some(plan), _) => plan,
                        (None, Some(e)) => return Err(e),
                        (None, None) => unreachable!("a group has an entry"),
                    };
                    Ok(SolvedProblem {
                        plan,
                        undivided: undivided(group[0], workspace_limit_bytes)?,
                    })
                })
                .collect::<Result<Vec<_>, SolveError>>()?;
            Ok(Solution {
                mode,
                policy,
                problems,
                proven_optimal: true,
                method: "dp",
                names: profile.algo_names(),
            })
        }
        Mode::WorkspaceDivision {
            total_workspace_bytes,
        } => {
            // One time limit for the whole solve: the undivided baseline first (a small MILP,
            // given at most a quarter of the limit), then the fronts and the MILP, which gets
            // whatever is left.
            let started = Instant::now();
            let deadline = wd::deadline(started, wd_options);
            let baseline = undivided_wd(
                profile,
                total_workspace_bytes,
                wd_options,
                started + (deadline - started) / 4,
            )?;
            // One front per tuning problem: the points of its splits together.
            let fronts = groups(profile)
                .into_iter()
                .map(|group| {
                    let mut points = Vec::new();
                    let mut first_error = None;
                    for entry in group {
                        match pareto_front(entry, policy) {
                            Ok(front) => points.extend(front),
                            Err(e) => {
                                first_error.get_or_insert(e);
                            }
                        }
                    }
                    match first_error {
                        Some(e) if points.is_empty() => Err(e),
                        _ => Ok(points),
                    }
                })
                .collect::<Result<Vec<_>, SolveError>>()?;
            let choice = solve_wd_by(&fronts, total_workspace_bytes, wd_options, deadline)?;
            let problems = fronts
                .into_iter()
                .zip(&choice.choices)
                .enumerate()
                .map(|(index, (mut front, &j))| SolvedProblem {
                    plan: front.swap_remove(j).plan,
                    undivided: baseline.as_ref().map(|plans| plans[index].clone()),
                })
                .collect();
            Ok(Solution {
                mode,
                policy,
                problems,
                proven_optimal: choice.proven_optimal,
                method: choice.method,
                names: profile.algo_names(),
            })
        }
    }
}

/// The profile's entries by tuning problem (layer, problem, op), in the order of each one's
/// first entry: a problem tuned along both dimensions has a batch and a spatial
/// entry, solved as one problem whose plans are those of either split. The batch entry comes
/// first (the undivided baseline is taken from it: the whole mini-batch in one call).
fn groups(profile: &Profile) -> Vec<Vec<&OpProfile>> {
    let mut groups: Vec<Vec<&OpProfile>> = Vec::new();
    for entry in &profile.entries {
        let same = |other: &&OpProfile| {
            other.layer == entry.layer && other.problem == entry.problem && other.op == entry.op
        };
        match groups.iter_mut().find(|g| same(&g[0])) {
            Some(group) => group.push(entry),
            None => groups.push(vec![entry]),
        }
    }
    for group in &mut groups {
        group.sort_by_key(|e| e.split);
    }
    groups
}

/// The WD optimum over undivided plans only, or `None` if some problem has no measurement at
/// the full mini-batch or the budget cannot hold any undivided assignment.
fn undivided_wd(
    profile: &Profile,
    budget: u64,
    options: &WdOptions,
    deadline: Instant,
) -> Result<Option<Vec<Plan>>, SolveError> {
    let mut fronts = Vec::with_capacity(profile.entries.len());
    for group in groups(profile) {
        match pareto_front(group[0], Policy::Undivided) {
            Ok(front) => fronts.push(front),
            Err(SolveError::NoSizes { .. } | SolveError::Infeasible { .. }) => return Ok(None),
            Err(other) => return Err(other),
        }
    }
    match solve_wd_by(&fronts, budget, options, deadline) {
        Ok(choice) => Ok(Some(
            fronts
                .into_iter()
                .zip(&choice.choices)
                .map(|(mut front, &j)| front.swap_remove(j).plan)
                .collect(),
        )),
        Err(SolveError::BudgetTooSmall { .. }) => Ok(None),
        Err(other) => Err(other),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Algo, ConvOp, ConvProblem, Measurement, SplitDim};

    /// One (layer, op) along the batch (batch 2) and along `h` (8 rows): the batch split's
    /// fast algorithm needs 100 bytes at every size, the chunks' needs 10 bytes a row.
    fn profile() -> Profile {
        let mut problem = ConvProblem::new(2, 4, 8, 8, 4, 3, 3);
        (problem.pad_h, problem.pad_w) = (1, 1);
        let m = |micro, algo, time_ms, workspace_bytes| Measurement {
            micro,
            algo: Algo::Legacy(algo),
            time_ms,
            workspace_bytes,
            verification: None,
        };
        let batch = OpProfile {
            layer: "l".into(),
            problem,
            op: ConvOp::Forward,
            split: SplitDim::Batch,
            measurements: vec![
                m(1, 0, 5.0, 0),
                m(1, 1, 1.0, 100),
                m(2, 0, 10.0, 0),
                m(2, 1, 2.0, 100),
            ],
            skipped: Vec::new(),
            rejected: Vec::new(),
        };
        let spatial = OpProfile {
            split: SplitDim::Spatial,
            measurements: [1, 2, 4, 8]
                .into_iter()
                .flat_map(|rows| {
                    let share = rows as f64 / 8.0;
                    [
                        m(rows, 0, 10.0 * share + 0.01, 0),
                        m(rows, 1, 2.0 * share + 0.01, 10 * rows as u64),
                    ]
                })
                .collect(),
            ..batch.clone()
        };
        // The spatial entry first: the order of the entries does not matter.
        Profile {
            device: "test".into(),
            cudnn_version: None,
            math: None,
            timing: None,
            fingerprint: None,
            entries: vec![spatial, batch],
        }
    }

    #[test]
    fn a_problem_profiled_along_both_splits_is_solved_once_with_the_faster_split() {
        let profile = profile();
        let wr = |limit| {
            solve_profile(
                &profile,
                Policy::PowerOfTwo,
                Mode::WorkspaceReuse {
                    workspace_limit_bytes: limit,
                },
                &WdOptions::default(),
            )
            .unwrap()
        };
        // 100 bytes: the batch split's fast algorithm fits, undivided (2 ms); the chunks'
        // whole image needs 80 bytes and takes 2.01 ms.
        let roomy = wr(100);
        assert_eq!(roomy.problems.len(), 1);
        assert_eq!(roomy.problems[0].plan.split, SplitDim::Batch);
        assert_eq!(roomy.problems[0].plan.time_ms(), 2.0);
        // 40 bytes: only chunks of up to 4 rows run the fast algorithm (2 x 1.01 ms).
        let tight = wr(40);
        assert_eq!(tight.problems.len(), 1);
        let plan = &tight.problems[0].plan;
        assert_eq!(plan.split, SplitDim::Spatial);
        assert_eq!(plan.micro_batches.iter().map(|m| m.size).sum::<i64>(), 8);
        assert!((plan.time_ms() - 2.02).abs() < 1e-9, "{plan:?}");
        // The baseline is the batch entry's undivided plan within the limit: 10 ms.
        assert_eq!(
            tight.problems[0].undivided.as_ref().unwrap().time_ms(),
            10.0
        );
        // Workspace division over one front holding both splits' points.
        let wd = solve_profile(
            &profile,
            Policy::PowerOfTwo,
            Mode::WorkspaceDivision {
                total_workspace_bytes: 40,
            },
            &WdOptions::default(),
        )
        .unwrap();
        assert_eq!(wd.problems.len(), 1);
        assert_eq!(wd.problems[0].plan.split, SplitDim::Spatial);
        assert!((wd.problems[0].plan.time_ms() - 2.02).abs() < 1e-9);
    }

    #[test]
    fn one_chunk_never_replaces_a_batch_plan_that_fits() {
        // The whole image as one chunk is the unsplit op: 1.999 ms against the batch
        // split's 2 ms is timing noise between two runs of one call.
        let mut profile = profile();
        let spatial = &mut profile.entries[0];
        spatial
            .measurements
            .retain(|m| m.micro == 8 && m.algo == Algo::Legacy(1));
        spatial.measurements[0].time_ms = 1.999;
        let solved = |profile: &Profile, limit| {
            solve_profile(
                profile,
                Policy::PowerOfTwo,
                Mode::WorkspaceReuse {
                    workspace_limit_bytes: limit,
                },
                &WdOptions::default(),
            )
        };
        let plan = solved(&profile, 100).unwrap().problems[0].plan.clone();
        assert_eq!(plan.split, SplitDim::Batch);
        assert_eq!(plan.time_ms(), 2.0);
        // Where the batch split has no plan at all, the one chunk is the answer.
        profile.entries[1]
            .measurements
            .retain(|m| m.algo == Algo::Legacy(1));
        let plan = solved(&profile, 90).unwrap().problems[0].plan.clone();
        assert_eq!(
            (plan.split, plan.micro_batches.len()),
            (SplitDim::Spatial, 1)
        );
    }
}
