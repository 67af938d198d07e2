//! Workspace reuse (WR): the fastest plan for one tuning problem under a per-layer workspace
//! limit, by dynamic programming over the mini-batch, and the Pareto front of such plans.
//!
//! For a limit `L`, let `best[m]` be the fastest algorithm at micro-batch size `m` whose
//! workspace fits in `L`. Then `T(0) = 0` and `T(i) = min over allowed m <= i of T(i - m) +
//! best[m].time`, and the plan for `N` is read back from the choices. Ties in time go to the
//! plan with fewer micro-batches, then to the smaller workspace at each size. Cost:
//! `O(N * |sizes|)` per limit.
//!
//! The Pareto front sweeps the limit over every distinct workspace value in the profile; the
//! DP is re-run only where some `best[m]` improves, which is the only place the optimum can.

use crate::algo::Algo;
use crate::plan::{MicroBatch, Plan};
use crate::profile::{OpProfile, Policy, ProfileError};
use crate::SolveError;

/// One point of a Pareto front: the fastest plan whose workspace is at most `workspace_bytes`,
/// and no faster plan needs less.
#[derive(Clone, Debug, PartialEq)]
pub struct ParetoPoint {
    pub time_ms: f64,
    pub workspace_bytes: u64,
    pub plan: Plan,
}

/// The algorithms a policy may use, per micro-batch size, sorted by workspace so that the best
/// algorithm within any limit is a prefix minimum.
struct Candidates {
    n: i64,
    /// (size, algorithms at that size sorted by workspace then time).
    by_size: Vec<(i64, Vec<Cand>)>,
}

#[derive(Clone, Copy, Debug)]
struct Cand {
    algo: Algo,
    workspace_bytes: u64,
    time_ms: f64,
}

impl Candidates {
    fn new(profile: &OpProfile, policy: Policy) -> Result<Self, SolveError> {
        profile.validate()?;
        let n = profile.extent();
        let mut by_size: Vec<(i64, Vec<Cand>)> = Vec::new();
        let mut measurements: Vec<_> = profile.allowed(policy).collect();
        measurements.sort_by(|a, b| {
            (a.micro, a.workspace_bytes)
                .cmp(&(b.micro, b.workspace_bytes))
                .then(a.time_ms.total_cmp(&b.time_ms))
        });
        for m in measurements {
            let cand = Cand {
                algo: m.algo,
                workspace_bytes: m.workspace_bytes,
                time_ms: m.time_ms,
            };
            match by_size.last_mut() {
                Some((size, list)) if *size == m.micro => list.push(cand),
                _ => by_size.push((m.micro, vec![cand])),
            }
        }
        if by_size.is_empty() {
            return Err(SolveError::NoSizes {
                name: profile.name(),
                policy,
                n,
            });
        }
        Ok(Candidates { n, by_size })
    }

    /// The fastest candidate per size within `limit` (index into `by_size`), if any.
    fn best_within(&self, limit: u64) -> Vec<Option<Cand>> {
        self.by_size
            .iter()
            .map(|(_, list)| {
                list.iter().take_while(|c| c.workspace_bytes <= limit).fold(
                    None,
                    |best: Option<Cand>, c| match best {
                        Some(b) if b.time_ms <= c.time_ms => Some(b),
                        _ => Some(*c),
                    },
                )
            })
            .collect()
    }

    /// Every distinct workspace value, ascending.
    fn workspace_values(&self) -> Vec<u64> {
        let mut values: Vec<u64> = self
            .by_size
            .iter()
            .flat_map(|(_, list)| list.iter().map(|c| c.workspace_bytes))
            .collect();
        values.sort_unstable();
        values.dedup();
        values
    }
}

/// Reusable DP tables, so the Pareto sweep does not allocate per limit.
struct Dp {
    time: Vec<f64>,
    count: Vec<u32>,
    /// Index into `Candidates::by_size` of the last micro-batch of the optimum for `i`.
    choice: Vec<u32>,
}

impl Dp {
    fn new(n: i64) -> Self {
        let len = n as usize + 1;
        Dp {
            time: vec![f64::INFINITY; len],
            count: vec![0; len],
            choice: vec![u32::MAX; len],
        }
    }

    /// Fills the tables for the given best candidate per size. Returns whether `n` is reachable.
    fn run(&mut self, cands: &Candidates, best: &[Option<Cand>]) -> bool {
        let n = cands.n as usize;
        self.time[0] = 0.0;
        self.count[0] = 0;
        // Sizes that have a candidate within the limit, as (size, index, time).
        let usable: Vec<(usize, u32, f64)> = cands
            .by_size
            .iter()
            .zip(best)
            .enumerate()
            .filter_map(|(index, ((size, _), cand))| {
                cand.map(|c| (*size as usize, index as u32, c.time_ms))
            })
            .collect();
        for i in 1..=n {
            let (mut best_time, mut best_count, mut best_choice) =
                (f64::INFINITY, u32::MAX, u32::MAX);
            for &(size, index, time) in &usable {
                if size > i {
                    break; // `usable` is in ascending size order.
                }
                let prev = self.time[i - size];
                if prev.is_infinite() {
                    continue;
                }
                let t = prev + time;
                let count = self.count[i - size] + 1;
                if t < best_time || (t == best_time && count < best_count) {
                    (best_time, best_count, best_choice) = (t, count, index);
                }
            }
            self.time[i] = best_time;
            self.count[i] = best_count;
            self.choice[i] = best_choice;
        }
        self.time[n].is_finite()
    }

    /// Reads the plan for `n` back from the tables; micro-batches in descending size order.
    fn plan(&self, profile: &OpProfile, cands: &Candidates, best: &[Option<Cand>]) -> Plan {
        let mut micro_batches = Vec::new();
        let mut i = cands.n as usize;
        while i > 0 {
            let index = self.choice[i] as usize;
            let size = cands.by_size[index].0;
            let c = best[index].expect("the DP only chooses sizes with a candidate");
            micro_batches.push(MicroBatch {
                size,
                algo: c.algo,
                workspace_bytes: c.workspace_bytes,
                time_ms: c.time_ms,
            });
            i -= size as usize;
        }
        micro_batches.sort_by(|a, b| b.size.cmp(&a.size).then(a.algo.cmp(&b.algo)));
        Plan {
            layer: profile.layer.clone(),
            problem: profile.problem,
            op: profile.op,
            split: profile.split,
            micro_batches,
        }
    }
}

/// The fastest plan whose every micro-batch needs at most `workspace_limit_bytes`.
///
/// Errors: an invalid profile; no measured size allowed by the policy; or
/// [`SolveError::Infeasible`] naming the smallest limit that would work.
///
/// Only measurements make plans. When measuring skipped candidates for their workspace
/// ([`OpProfile::skipped`]) and no plan fits, the error's smallest limit counts their
/// workspaces too (feasibility does not depend on times), so it still names a limit that works.
pub fn solve_wr(
    profile: &OpProfile,
    policy: Policy,
    workspace_limit_bytes: u64,
) -> Result<Plan, SolveError> {
    match solve_measured(profile, policy, workspace_limit_bytes) {
        Err(
            SolveError::Infeasible { .. }
            | SolveError::NoSizes { .. }
            | SolveError::Profile(ProfileError::NoMeasurements { .. }),
        ) if !profile.skipped.is_empty() && profile.problem.validate().is_ok() => {
            Err(SolveError::Infeasible {
                name: profile.name(),
                policy,
                workspace_limit_bytes,
                min_workspace_bytes: smallest_limit_with_skipped(profile, policy),
            })
        }
        other => other,
    }
}

/// The smallest limit at which the sizes `policy` allows can make up the mini-batch, counting
/// the workspaces of measured and skipped candidates alike.
fn smallest_limit_with_skipped(profile: &OpProfile, policy: Policy) -> Option<u64> {
    let n = profile.extent();
    let mut least: std::collections::BTreeMap<i64, u64> = std::collections::BTreeMap::new();
    let workspaces = profile
        .measurements
        .iter()
        .map(|m| (m.micro, m.workspace_bytes))
        .chain(profile.skipped.iter().map(|s| (s.micro, s.workspace_bytes)));
    for (micro, bytes) in workspaces.filter(|&(micro, _)| policy.allows(micro, n)) {
        let entry = least.entry(micro).or_insert(bytes);
        *entry = (*entry).min(bytes);
    }
    let feasible = |limit: u64| {
        let sizes: Vec<usize> = least
            .iter()
            .filter(|&(_, &bytes)| bytes <= limit)
            .map(|(&micro, _)| micro as usize)
            .collect();
        let mut reachable = vec![false; n as usize + 1];
        reachable[0] = true;
        for i in 1..=n as usize {
            reachable[i] = sizes.iter().any(|&m| m <= i && reachable[i - m]);
        }
        reachable[n as usize]
    };
    let mut values: Vec<u64> = least.values().copied().collect();
    values.sort_unstable();
    values.dedup();
    let last = *values.last()?;
    if !feasible(last) {
        return None;
    }
    values
        .get(values.partition_point(|&limit| !feasible(limit)))
        .copied()
}

/// [`solve_wr`] on the measurements alone.
fn solve_measured(
    profile: &OpProfile,
    policy: Policy,
    workspace_limit_bytes: u64,
) -> Result<Plan, SolveError> {
    let cands = Candidates::new(profile, policy)?;
    let best = cands.best_within(workspace_limit_bytes);
    let mut dp = Dp::new(cands.n);
    if dp.run(&cands, &best) {
        return Ok(dp.plan(profile, &cands, &best));
    }
    Err(SolveError::Infeasible {
        name: profile.name(),
        policy,
        workspace_limit_bytes,
        min_workspace_bytes: smallest_feasible_limit(&cands, &mut dp),
    })
}

/// The best single algorithm on the whole mini-batch within the limit, if one fits.
pub fn undivided(
    profile: &OpProfile,
    workspace_limit_bytes: u64,
) -> Result<Option<Plan>, SolveError> {
    match solve_wr(profile, Policy::Undivided, workspace_limit_bytes) {
        Ok(plan) => Ok(Some(plan)),
        Err(SolveError::Infeasible { .. } | SolveError::NoSizes { .. }) => Ok(None),
        Err(other) => Err(other),
    }
}

/// Feasibility is monotone in the limit: the first workspace value at which the DP reaches N.
fn smallest_feasible_limit(cands: &Candidates, dp: &mut Dp) -> Option<u64> {
    let values = cands.workspace_values();
    let feasible = |dp: &mut Dp, limit: u64| dp.run(cands, &cands.best_within(limit));
    let last = *values.last()?;
    if !feasible(dp, last) {
        return None;
    }
    let first_ok = values.partition_point(|&limit| !feasible(dp, limit));
    values.get(first_ok).copied()
}

/// Every plan on the time/workspace Pareto front, by ascending workspace (and so descending
/// time). The last point is the unlimited optimum; the first needs the least workspace.
pub fn pareto_front(profile: &OpProfile, policy: Policy) -> Result<Vec<ParetoPoint>, SolveError> {
    let cands = Candidates::new(profile, policy)?;
    let mut dp = Dp::new(cands.n);
    // Every candidate in ascending workspace order: raising the limit admits them one by one.
    let mut events: Vec<(u64, usize, Cand)> = cands
        .by_size
        .iter()
        .enumerate()
        .flat_map(|(index, (_, list))| list.iter().map(move |c| (c.workspace_bytes, index, *c)))
        .collect();
    events.sort_by_key(|&(workspace, _, _)| workspace);
    let mut best: Vec<Option<Cand>> = vec![None; cands.by_size.len()];
    let mut feasible = false;
    let mut front: Vec<ParetoPoint> = Vec::new();
    let mut start = 0;
    while start < events.len() {
        let limit = events[start].0;
        let end = start + events[start..].iter().take_while(|e| e.0 == limit).count();
        // A new candidate at size m changes the optimum somewhere only if it is faster than
        // the current optimum for exactly m items (else any plan using it can swap it for
        // that optimum's micro-batches); until the first feasible limit, any new size counts.
        let mut changed = false;
        for &(_, index, cand) in &events[start..end] {
            if best[index].is_some_and(|b| b.time_ms <= cand.time_ms) {
                continue;
            }
            let size = cands.by_size[index].0 as usize;
            changed |= !feasible || best[index].is_none() || cand.time_ms < dp.time[size];
            best[index] = Some(cand);
        }
        start = end;
        if !changed {
            continue;
        }
        feasible = dp.run(&cands, &best);
        if !feasible {
            continue;
        }
        let plan = dp.plan(profile, &cands, &best);
        let time_ms = plan.time_ms();
        if front.last().is_none_or(|last| time_ms < last.time_ms) {
            front.push(ParetoPoint {
                time_ms,
                workspace_bytes: plan.workspace_bytes(),
                plan,
            });
        }
    }
    if front.is_empty() {
        return Err(SolveError::Infeasible {
            name: profile.name(),
            policy,
            workspace_limit_bytes: u64::MAX,
            min_workspace_bytes: None,
        });
    }
    Ok(front)
}
