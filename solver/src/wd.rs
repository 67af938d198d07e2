//! Workspace division (WD): one workspace budget shared by all layers. Each tuning problem picks
//! one point of its Pareto front; the sum of their workspaces must fit in the budget; the sum
//! of their times is minimised. This is a multiple-choice knapsack, solved as an integer
//! linear program through good_lp:
//!
//! ```text
//! minimise   sum_p sum_j t[p][j] x[p][j]
//! subject to sum_j x[p][j] = 1                      for every problem p
//!            sum_p sum_j w[p][j] x[p][j] <= budget
//!            x binary
//! ```
//!
//! The default backend, microlp, is pure Rust but can stall on instances with many ties, so the
//! solve always runs under a time limit and starts from a greedy incumbent; the result says
//! whether optimality was proven. The chosen assignment is re-checked in exact integer bytes.

use crate::wr::ParetoPoint;
use crate::SolveError;
use good_lp::{
    variable, Expression, ProblemVariables, ResolutionError, Solution, SolutionStatus, SolverModel,
};
use good_lp::{Variable, WithInitialSolution, WithTimeLimit};

/// The longest MILP time limit accepted, in seconds (about 11.6 days): far beyond any useful
/// solve, and far from where the MILP solvers' clock arithmetic overflows (`1e19` panics).
pub const MAX_TIME_LIMIT_S: f64 = 1e6;

/// How to run the MILP.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WdOptions {
    /// Wall-clock limit for the MILP solver, in seconds. On expiry the best assignment found so
    /// far (never worse than the greedy one) is returned, marked as not proven optimal.
    pub time_limit_s: f64,
    pub backend: Backend,
}

impl WdOptions {
    /// Checks a time limit given by a user: a finite number of seconds in
    /// (0, [`MAX_TIME_LIMIT_S`]]. The error says what was wrong, without naming the option.
    pub fn check_time_limit(seconds: f64) -> Result<f64, String> {
        if seconds.is_finite() && seconds > 0.0 && seconds <= MAX_TIME_LIMIT_S {
            Ok(seconds)
        } else {
            Err(format!(
                "{seconds} is not a time limit: expected a number of seconds above 0 and at most {MAX_TIME_LIMIT_S:e}"
            ))
        }
    }
}

impl Default for WdOptions {
    fn default() -> Self {
        WdOptions {
            time_limit_s: 10.0,
            backend: Backend::default(),
        }
    }
}

/// The MILP solver behind good_lp. The default is HiGHS when built with the `highs` feature,
/// else microlp.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// Pure Rust; builds from crates alone.
    Microlp,
    /// HiGHS (cargo feature `highs`; needs cmake and libclang to build).
    #[cfg(feature = "highs")]
    Highs,
}

impl Default for Backend {
    fn default() -> Self {
        #[cfg(feature = "highs")]
        return Backend::Highs;
        #[cfg(not(feature = "highs"))]
        return Backend::Microlp;
    }
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::Microlp => "microlp",
            #[cfg(feature = "highs")]
            Backend::Highs => "highs",
        }
    }
}

/// The assignment: for each problem, the index of its chosen point.
#[derive(Clone, Debug, PartialEq)]
pub struct WdChoice {
    pub choices: Vec<usize>,
    pub total_time_ms: f64,
    pub total_workspace_bytes: u64,
    /// The optimum was proven (by the MILP solver, or trivially because the fastest point of
    /// every problem fits together).
    pub proven_optimal: bool,
    /// What produced the answer: `trivial`, the backend's name, or `greedy` when the MILP solver
    /// failed or ran out of time without improving on it.
    pub method: &'static str,
}

/// A point as WD sees it: (time, workspace).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Point {
    pub time_ms: f64,
    pub workspace_bytes: u64,
}

impl From<&ParetoPoint> for Point {
    fn from(p: &ParetoPoint) -> Self {
        Point {
            time_ms: p.time_ms,
            workspace_bytes: p.workspace_bytes,
        }
    }
}

/// Workspace division over Pareto fronts; `names` of errors come from the fronts' plans.
pub fn solve_wd(
    fronts: &[Vec<ParetoPoint>],
    total_workspace_bytes: u64,
    options: &WdOptions,
) -> Result<WdChoice, SolveError> {
    let points: Vec<Vec<Point>> = fronts
        .iter()
        .map(|f| f.iter().map(Point::from).collect())
        .collect();
    choose(&points, total_workspace_bytes, options)
}

/// Workspace division over any sets of (time, workspace) points (they need not be Pareto
/// fronts). Each set must be non-empty.
pub fn choose(
    points: &[Vec<Point>],
    budget: u64,
    options: &WdOptions,
) -> Result<WdChoice, SolveError> {
    if points.is_empty() {
        return Err(SolveError::NothingToDivide);
    }
    for (index, set) in points.iter().enumerate() {
        if set.is_empty() {
            return Err(SolveError::EmptyFront { index });
        }
        if let Some(p) = set
            .iter()
            .find(|p| !(p.time_ms.is_finite() && p.time_ms >= 0.0))
        {
            return Err(SolveError::BadPoint {
                index,
                time_ms: p.time_ms,
            });
        }
    }
    let min_ws: Vec<u64> = points
        .iter()
        .map(|set| set.iter().map(|p| p.workspace_bytes).min().unwrap_or(0))
        .collect();
    let min_total = min_ws.iter().fold(0u64, |a, &b| a.saturating_add(b));
    if min_total > budget {
        return Err(SolveError::BudgetTooSmall {
            total_workspace_bytes: budget,
            min_total_workspace_bytes: min_total,
        });
    }
    // A point can be chosen only if the others can still take their smallest points.
    let slack = budget - min_total;
    let usable: Vec<Vec<usize>> = points
        .iter()
        .zip(&min_ws)
        .map(|(set, &min)| {
            (0..set.len())
                .filter(|&j| set[j].workspace_bytes - min <= slack)
                .collect()
        })
        .collect();

    let fastest: Vec<usize> = usable
        .iter()
        .zip(points)
        .map(|(idx, set)| argmin_time(set, idx))
        .collect();
    let fastest_total = total(points, &fastest);
    if fastest_total.1 <= budget {
        return Ok(finish(points, fastest, true, "trivial"));
    }

    let incumbent = greedy(points, &usable, budget);
    let milp = match options.backend {
        Backend::Microlp => run_milp(
            points,
            &usable,
            budget,
            &incumbent,
            options,
            good_lp::microlp,
        ),
        #[cfg(feature = "highs")]
        Backend::Highs => run_milp(points, &usable, budget, &incumbent, options, good_lp::highs),
    };
    let (incumbent_time, _) = total(points, &incumbent);
    Ok(match milp {
        Some((choices, proven)) if total(points, &choices).1 <= budget => {
            if total(points, &choices).0 <= incumbent_time || proven {
                finish(points, choices, proven, options.backend.name())
            } else {
                finish(points, incumbent, false, "greedy")
            }
        }
        // The solver failed, or its answer broke the budget in exact bytes (LP tolerance).
        _ => finish(points, incumbent, false, "greedy"),
    })
}

fn argmin_time(set: &[Point], idx: &[usize]) -> usize {
    *idx.iter()
        .min_by(|&&a, &&b| {
            set[a]
                .time_ms
                .total_cmp(&set[b].time_ms)
                .then(set[a].workspace_bytes.cmp(&set[b].workspace_bytes))
        })
        .expect("the smallest point of every set is usable")
}

fn total(points: &[Vec<Point>], choices: &[usize]) -> (f64, u64) {
    choices
        .iter()
        .zip(points)
        .fold((0.0, 0u64), |(t, w), (&j, set)| {
            (t + set[j].time_ms, w.saturating_add(set[j].workspace_bytes))
        })
}

fn finish(
    points: &[Vec<Point>],
    choices: Vec<usize>,
    proven_optimal: bool,
    method: &'static str,
) -> WdChoice {
    let (total_time_ms, total_workspace_bytes) = total(points, &choices);
    WdChoice {
        choices,
        total_time_ms,
        total_workspace_bytes,
        proven_optimal,
        method,
    }
}

/// Start from the smallest point of every set and repeatedly take the change of one set's point
/// that saves the most time per extra byte among those that still fit.
fn greedy(points: &[Vec<Point>], usable: &[Vec<usize>], budget: u64) -> Vec<usize> {
    let mut choice: Vec<usize> = usable
        .iter()
        .zip(points)
        .map(|(idx, set)| {
            *idx.iter()
                .min_by(|&&a, &&b| {
                    set[a]
                        .workspace_bytes
                        .cmp(&set[b].workspace_bytes)
                        .then(set[a].time_ms.total_cmp(&set[b].time_ms))
                })
                .expect("non-empty")
        })
        .collect();
    let mut used = total(points, &choice).1;
    loop {
        let mut best: Option<(f64, usize, usize)> = None;
        for (p, (set, idx)) in points.iter().zip(usable).enumerate() {
            let current = set[choice[p]];
            for &j in idx {
                let candidate = set[j];
                let saved = current.time_ms - candidate.time_ms;
                if saved <= 0.0 {
                    continue;
                }
                let extra = candidate
                    .workspace_bytes
                    .saturating_sub(current.workspace_bytes);
                let fits = used - current.workspace_bytes + candidate.workspace_bytes <= budget;
                if !fits {
                    continue;
                }
                let ratio = if extra == 0 {
                    f64::INFINITY
                } else {
                    saved / extra as f64
                };
                if best.is_none_or(|(r, _, _)| ratio > r) {
                    best = Some((ratio, p, j));
                }
            }
        }
        match best {
            Some((_, p, j)) => {
                used = used - points[p][choice[p]].workspace_bytes + points[p][j].workspace_bytes;
                choice[p] = j;
            }
            None => return choice,
        }
    }
}

/// Builds and solves the MILP; `None` when the backend fails. Returns the choices and whether
/// the backend proved them optimal.
fn run_milp<M, S>(
    points: &[Vec<Point>],
    usable: &[Vec<usize>],
    budget: u64,
    incumbent: &[usize],
    options: &WdOptions,
    solver: S,
) -> Option<(Vec<usize>, bool)>
where
    S: FnMut(good_lp::variable::UnsolvedProblem) -> M,
    M: SolverModel<Error = ResolutionError> + WithTimeLimit + WithInitialSolution,
{
    // Workspace in MiB keeps coefficients near 1 while a byte is still far above tolerances;
    // times are shifted by each set's fastest usable time, which changes no decision.
    const MIB: f64 = 1024.0 * 1024.0;
    let mut vars = ProblemVariables::new();
    let x: Vec<Vec<(usize, Variable)>> = usable
        .iter()
        .enumerate()
        .map(|(p, idx)| {
            idx.iter()
                .map(|&j| {
                    (
                        j,
                        vars.add(variable().binary().initial(f64::from(incumbent[p] == j))),
                    )
                })
                .collect()
        })
        .collect();
    let mut objective = Expression::from(0.0);
    let mut workspace = Expression::from(0.0);
    for (p, row) in x.iter().enumerate() {
        let floor = row
            .iter()
            .map(|&(j, _)| points[p][j].time_ms)
            .fold(f64::INFINITY, f64::min);
        for &(j, v) in row {
            objective += (points[p][j].time_ms - floor) * v;
            workspace += (points[p][j].workspace_bytes as f64 / MIB) * v;
        }
    }
    let mut model = vars
        .minimise(objective)
        .using(solver)
        // Out-of-range limits are refused by the front ends; never hand one on to panic.
        .with_time_limit(WdOptions::check_time_limit(options.time_limit_s).map_or(
            if options.time_limit_s > 0.0 {
                MAX_TIME_LIMIT_S
            } else {
                0.001
            },
            |s| s.max(0.001),
        ));
    for row in &x {
        let one: Expression = row.iter().map(|&(_, v)| v).sum();
        model.add_constraint(one.eq(1.0));
    }
    model.add_constraint(workspace.leq(budget as f64 / MIB));
    let solution = model.solve().ok()?;
    let proven = matches!(solution.status(), SolutionStatus::Optimal);
    let mut choices = Vec::with_capacity(x.len());
    for row in &x {
        let chosen: Vec<usize> = row
            .iter()
            .filter(|&&(_, v)| solution.value(v) > 0.5)
            .map(|&(j, _)| j)
            .collect();
        match chosen.as_slice() {
            [j] => choices.push(*j),
            _ => return None,
        }
    }
    Some((choices, proven))
}
