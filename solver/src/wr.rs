//! Workspace reuse (WR): the fastest plan for one tuning problem under a per-layer workspace
//! limit, by dynamic programming over the mini-batch, and the Pareto front of such plans.
//!
//! For a limit `L`, let `best[m]` be the fastest algorithm at micro-batch size `m` whose
//! workspace fits in `L`. Then `T(0) = 0` and `T(i) = min over allowed m <= i of T(i - m) +
//! best[m].time`, and the plan for `N` is read back from the choices. Ties in time go to the
//! plan with fewer micro-batches, then to the smaller workspace at each size.
//!
//! `N` is a number in the profile (a mini-batch, or a spatial extent of rows), not the size of
//! the profile, so the DP runs only over the sums that can lead to it: the multiples of the
//! measured sizes' greatest common divisor, or, when those are more than [`MAX_DP_SUMS`], the
//! sums the sizes reach. Cost: `O(sums * |sizes|)` per limit, at most `MAX_DP_SUMS` sums held
//! (allocated fallibly); more is [`SolveError::TooLarge`], naming the problem.
//!
//! The Pareto front sweeps the limit over every distinct workspace value in the profile; the
//! DP is re-run only where some `best[m]` improves, which is the only place the optimum can.

use crate::algo::Algo;
use crate::plan::{MicroBatch, Plan};
use crate::profile::{OpProfile, Policy, ProblemName, ProfileError};
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

/// The most partial sums a DP visits (an extent of 2^24 rows, each a sum, and 0), and so what
/// its tables may hold (16 bytes each: 256 MiB at most). A profile is small, but its extent is a number in it: without a bound a few
/// hundred bytes asking for an extent of 2^30 made tables of 16 GiB, and an infallible
/// allocation aborted the process, the C ABI's caller with it.
pub const MAX_DP_SUMS: usize = (1 << 24) + 1;

/// The most reachable sums a sparse DP collects before giving up. Collecting them costs a
/// hash set besides the list, so the bound is lower than the dense one.
const MAX_SPARSE_SUMS: usize = 1 << 20;

/// The partial sums of micro-batch sizes the DP solves for: the sums that can lead to the
/// extent are all multiples of the sizes' greatest common divisor, so the DP runs over those
/// multiples (the old DP over every row, when the divisor is 1); when there are too many, over
/// only the sums the sizes can reach, which are few when the sizes are few and large. Either
/// way a sum's optimum is computed from the same predecessors in the same order as a DP over
/// every row, so plans are the same.
enum Sums {
    /// Every multiple of `step` from 0 to the extent.
    Dense { step: i64, len: usize },
    /// The reachable sums, ascending, 0 first.
    Sparse(Vec<i64>),
}

impl Sums {
    /// The sums for making up `n` from `sizes` (each in `1..=n`).
    fn new(name: impl Fn() -> ProblemName, sizes: &[i64], n: i64) -> Result<Self, SolveError> {
        let step = sizes.iter().fold(0, |g, &s| gcd(g, s)).max(1);
        let multiples = (n / step) as u64 + 1;
        if multiples <= dense_max() {
            return Ok(Sums::Dense {
                step,
                len: multiples as usize,
            });
        }
        let too_large = || SolveError::TooLarge {
            name: name(),
            n,
            max_sums: MAX_SPARSE_SUMS,
        };
        // Breadth first from 0, smallest sum first, so the list comes out ascending.
        let mut seen = std::collections::HashSet::new();
        let mut queue = std::collections::BinaryHeap::new();
        let mut sums = Vec::new();
        queue.push(std::cmp::Reverse(0i64));
        seen.insert(0i64);
        while let Some(std::cmp::Reverse(sum)) = queue.pop() {
            if sums.len() == MAX_SPARSE_SUMS {
                return Err(too_large());
            }
            sums.push(sum);
            for &size in sizes {
                match sum.checked_add(size) {
                    Some(next) if next <= n && seen.insert(next) => {
                        queue.push(std::cmp::Reverse(next))
                    }
                    _ => {}
                }
            }
        }
        Ok(Sums::Sparse(sums))
    }

    fn len(&self) -> usize {
        match self {
            Sums::Dense { len, .. } => *len,
            Sums::Sparse(sums) => sums.len(),
        }
    }

    fn sum(&self, index: usize) -> i64 {
        match self {
            Sums::Dense { step, .. } => index as i64 * step,
            Sums::Sparse(sums) => sums[index],
        }
    }

    /// The index of `sum`, or `None` when no sizes make it up.
    fn index(&self, sum: i64) -> Option<usize> {
        match self {
            Sums::Dense { step, len } => {
                let index = (sum % step == 0).then_some((sum / step) as usize)?;
                (index < *len).then_some(index)
            }
            Sums::Sparse(sums) => sums.binary_search(&sum).ok(),
        }
    }

    /// Tables of `len` entries, allocated fallibly: refused with `too_large` when the memory
    /// is not there.
    fn table<T: Clone>(
        &self,
        value: T,
        too_large: &dyn Fn() -> SolveError,
    ) -> Result<Vec<T>, SolveError> {
        let mut table = Vec::new();
        table
            .try_reserve_exact(self.len())
            .map_err(|_| too_large())?;
        table.resize(self.len(), value);
        Ok(table)
    }
}

/// The most multiples the DP runs over densely; tests lower it to run the sparse DP.
#[cfg(not(test))]
fn dense_max() -> u64 {
    MAX_DP_SUMS as u64
}

#[cfg(test)]
thread_local! {
    static DENSE_MAX: std::cell::Cell<u64> = const { std::cell::Cell::new(MAX_DP_SUMS as u64) };
}

#[cfg(test)]
fn dense_max() -> u64 {
    DENSE_MAX.with(|max| max.get())
}

fn gcd(mut a: i64, mut b: i64) -> i64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a.abs()
}

/// Reusable DP tables over the partial sums, so the Pareto sweep does not allocate per limit.
struct Dp {
    sums: Sums,
    /// The index of the extent among the sums, if the sizes can make it up at all.
    target: Option<usize>,
    time: Vec<f64>,
    count: Vec<u32>,
    /// Index into `Candidates::by_size` of the last micro-batch of the optimum for a sum.
    choice: Vec<u32>,
}

impl Dp {
    fn new(profile: &OpProfile, cands: &Candidates) -> Result<Self, SolveError> {
        let sizes: Vec<i64> = cands.by_size.iter().map(|(size, _)| *size).collect();
        let name = || profile.name();
        let sums = Sums::new(name, &sizes, cands.n)?;
        let too_large = || SolveError::TooLarge {
            name: profile.name(),
            n: cands.n,
            max_sums: MAX_DP_SUMS,
        };
        Ok(Dp {
            target: sums.index(cands.n),
            time: sums.table(f64::INFINITY, &too_large)?,
            count: sums.table(0, &too_large)?,
            choice: sums.table(u32::MAX, &too_large)?,
            sums,
        })
    }

    /// The optimum's time for exactly `sum` items in the last run (infinite if none).
    fn time_of(&self, sum: i64) -> f64 {
        self.sums
            .index(sum)
            .map_or(f64::INFINITY, |index| self.time[index])
    }

    /// Fills the tables for the given best candidate per size. Returns whether `n` is reachable.
    fn run(&mut self, cands: &Candidates, best: &[Option<Cand>]) -> bool {
        let Some(target) = self.target else {
            return false;
        };
        self.time[0] = 0.0;
        self.count[0] = 0;
        // Sizes that have a candidate within the limit, as (size, index, time).
        let usable: Vec<(i64, u32, f64)> = cands
            .by_size
            .iter()
            .zip(best)
            .enumerate()
            .filter_map(|(index, ((size, _), cand))| cand.map(|c| (*size, index as u32, c.time_ms)))
            .collect();
        for i in 1..=target {
            let sum = self.sums.sum(i);
            let (mut best_time, mut best_count, mut best_choice) =
                (f64::INFINITY, u32::MAX, u32::MAX);
            for &(size, index, time) in &usable {
                if size > sum {
                    break; // `usable` is in ascending size order.
                }
                let from = match &self.sums {
                    // The common case (a size 1 was measured): index and sum are one, with no
                    // division in the hot loop.
                    Sums::Dense { step: 1, .. } => i - size as usize,
                    _ => match self.sums.index(sum - size) {
                        Some(from) => from,
                        None => continue, // no sizes make up what is left
                    },
                };
                let prev = self.time[from];
                if prev.is_infinite() {
                    continue;
                }
                let t = prev + time;
                let count = self.count[from] + 1;
                if t < best_time || (t == best_time && count < best_count) {
                    (best_time, best_count, best_choice) = (t, count, index);
                }
            }
            self.time[i] = best_time;
            self.count[i] = best_count;
            self.choice[i] = best_choice;
        }
        self.time[target].is_finite()
    }

    /// Reads the plan for `n` back from the tables; micro-batches in descending size order.
    fn plan(&self, profile: &OpProfile, cands: &Candidates, best: &[Option<Cand>]) -> Plan {
        let mut micro_batches = Vec::new();
        let mut sum = cands.n;
        while sum > 0 {
            let at = self
                .sums
                .index(sum)
                .expect("the DP only leaves through reachable sums");
            let index = self.choice[at] as usize;
            let size = cands.by_size[index].0;
            let c = best[index].expect("the DP only chooses sizes with a candidate");
            micro_batches.push(MicroBatch {
                size,
                algo: c.algo,
                workspace_bytes: c.workspace_bytes,
                time_ms: c.time_ms,
            });
            sum -= size;
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
                min_workspace_bytes: smallest_limit_with_skipped(profile, policy)?,
            })
        }
        other => other,
    }
}

/// The smallest limit at which the sizes `policy` allows can make up the mini-batch, counting
/// the workspaces of measured and skipped candidates alike.
fn smallest_limit_with_skipped(
    profile: &OpProfile,
    policy: Policy,
) -> Result<Option<u64>, SolveError> {
    let n = profile.extent();
    let largest = profile.largest_indexable();
    let mut least: std::collections::BTreeMap<i64, u64> = std::collections::BTreeMap::new();
    let workspaces = profile
        .measurements
        .iter()
        .map(|m| (m.micro, m.workspace_bytes))
        .chain(profile.skipped.iter().map(|s| (s.micro, s.workspace_bytes)));
    for (micro, bytes) in
        workspaces.filter(|&(micro, _)| policy.allows(micro, n) && micro <= largest)
    {
        let entry = least.entry(micro).or_insert(bytes);
        *entry = (*entry).min(bytes);
    }
    let all_sizes: Vec<i64> = least.keys().copied().collect();
    let sums = Sums::new(|| profile.name(), &all_sizes, n)?;
    let Some(target) = sums.index(n) else {
        return Ok(None);
    };
    let too_large = || SolveError::TooLarge {
        name: profile.name(),
        n,
        max_sums: MAX_DP_SUMS,
    };
    let mut reachable = sums.table(false, &too_large)?;
    let mut feasible = |limit: u64| {
        let sizes: Vec<i64> = least
            .iter()
            .filter(|&(_, &bytes)| bytes <= limit)
            .map(|(&micro, _)| micro)
            .collect();
        reachable[0] = true;
        for i in 1..=target {
            let sum = sums.sum(i);
            reachable[i] = sizes
                .iter()
                .any(|&m| m <= sum && sums.index(sum - m).is_some_and(|from| reachable[from]));
        }
        reachable[target]
    };
    let mut values: Vec<u64> = least.values().copied().collect();
    values.sort_unstable();
    values.dedup();
    let Some(&last) = values.last() else {
        return Ok(None);
    };
    if !feasible(last) {
        return Ok(None);
    }
    Ok(values
        .get(values.partition_point(|&limit| !feasible(limit)))
        .copied())
}

/// [`solve_wr`] on the measurements alone.
fn solve_measured(
    profile: &OpProfile,
    policy: Policy,
    workspace_limit_bytes: u64,
) -> Result<Plan, SolveError> {
    let cands = Candidates::new(profile, policy)?;
    let best = cands.best_within(workspace_limit_bytes);
    let mut dp = Dp::new(profile, &cands)?;
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
    let mut dp = Dp::new(profile, &cands)?;
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
            let size = cands.by_size[index].0;
            changed |= !feasible || best[index].is_none() || cand.time_ms < dp.time_of(size);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synthetic::{random_entry, Rng};

    /// Runs `f` with the DP forced onto its sparse sums.
    fn sparse<T>(f: impl FnOnce() -> T) -> T {
        DENSE_MAX.with(|max| max.set(0));
        let result = f();
        DENSE_MAX.with(|max| max.set(MAX_DP_SUMS as u64));
        result
    }

    /// The sparse sums give the very plans (and errors) the DP over every row gives.
    #[test]
    fn sparse_sums_give_the_same_plans_and_fronts() {
        let mut rng = Rng(77);
        for case in 0..200 {
            let policy = Policy::ALL[case % 3];
            let n = 1 + rng.below(60) as i64;
            let algos = 1 + rng.below(4) as u32;
            let mut entry = random_entry(&mut rng, n, algos, policy);
            // Sizes with a common divisor, as a coarse measuring grid leaves.
            if case % 4 == 0 {
                entry
                    .measurements
                    .retain(|m| m.micro % 3 == 0 || m.micro == n);
            }
            let limit = rng.below(4 << 20);
            let dense_plan = solve_wr(&entry, policy, limit);
            assert_eq!(
                sparse(|| solve_wr(&entry, policy, limit)),
                dense_plan,
                "case {case}"
            );
            let dense_front = pareto_front(&entry, policy);
            assert_eq!(
                sparse(|| pareto_front(&entry, policy)),
                dense_front,
                "case {case}"
            );
        }
    }

    fn huge_entry(sizes: &[i64]) -> OpProfile {
        let n = 1 << 30;
        let mut entry = random_entry(&mut Rng(5), 1, 1, Policy::All);
        entry.layer = "huge".into();
        entry.problem = crate::ConvProblem::new(n, 1, 1, 1, 1, 1, 1);
        entry.measurements = sizes
            .iter()
            .map(|&micro| crate::Measurement {
                micro,
                algo: Algo::Legacy(0),
                time_ms: micro as f64 * 1e-3 + 1.0,
                workspace_bytes: 0,
                verification: None,
            })
            .collect();
        entry
    }

    /// An extent of 2^30 costs nothing when its sizes are few and share a divisor or reach
    /// few sums; when they reach too many sums it is refused by name, never allocated.
    #[test]
    fn a_huge_extent_is_solved_over_its_sizes_or_refused_by_name() {
        let n: i64 = 1 << 30;
        let plan = solve_wr(&huge_entry(&[n / 2, n]), Policy::All, 0).unwrap();
        assert_eq!(plan.batch(), n);
        assert_eq!(plan.micro_batches.len(), 1, "{plan:?}");
        let plan = solve_wr(&huge_entry(&[n - 1, 1]), Policy::All, 0);
        assert!(matches!(plan, Err(SolveError::TooLarge { .. })), "{plan:?}");
        // Few large sizes without a common divisor: the sparse sums.
        let plan = solve_wr(&huge_entry(&[n / 3, n / 3 + 1, n / 3 + 2]), Policy::All, 0).unwrap();
        assert_eq!(plan.batch(), n);
        assert_eq!(plan.micro_batches.len(), 3, "{plan:?}");
        let error = solve_wr(&huge_entry(&[1, n]), Policy::PowerOfTwo, 0)
            .unwrap_err()
            .to_string();
        assert!(
            error.starts_with("huge fp32 nchw fwd: an extent of 1073741824 is too large"),
            "{error}"
        );
        assert!(matches!(
            pareto_front(&huge_entry(&[1, n]), Policy::All),
            Err(SolveError::TooLarge { .. })
        ));
    }
}
