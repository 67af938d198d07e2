//! Whole-profile solving: every tuning problem of a [`Profile`] under one mode, with the
//! undivided baseline each plan is compared against. This is what `mucudnn solve`, `tune` and
//! the C ABI's pure solver entry point call.

use crate::algo::AlgoNames;
use crate::plan::Plan;
use crate::profile::{Policy, Profile};
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
    /// In profile order.
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
            let problems = profile
                .entries
                .iter()
                .map(|entry| {
                    Ok(SolvedProblem {
                        plan: solve_wr(entry, policy, workspace_limit_bytes)?,
                        undivided: undivided(entry, workspace_limit_bytes)?,
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
            let fronts = profile
                .entries
                .iter()
                .map(|entry| pareto_front(entry, policy))
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

/// The WD optimum over undivided plans only, or `None` if some problem has no measurement at
/// the full mini-batch or the budget cannot hold any undivided assignment.
fn undivided_wd(
    profile: &Profile,
    budget: u64,
    options: &WdOptions,
    deadline: Instant,
) -> Result<Option<Vec<Plan>>, SolveError> {
    let mut fronts = Vec::with_capacity(profile.entries.len());
    for entry in &profile.entries {
        match pareto_front(entry, Policy::Undivided) {
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
