//! Pruning engine configurations while tuning. The graph API offers hundreds of engine
//! configurations per op; timing all of them at every micro-batch size takes minutes.
//!
//! The rule: a configuration is not timed at size `b` when, at both neighbouring
//! sizes (`b/2` and `2b` for powers of two), some candidate that needs no more workspace is
//! faster by more than a margin. So sizes are measured in two passes: the *anchors* (every
//! other size of the ascending list, plus the last) with every configuration, then each size
//! between two anchors with the configurations that were not dominated at both.
//!
//! A one-sided rule (dominated at `b/2` only) is not safe: on the recorded H100 probe a
//! configuration 4.3x slower than the best at one size is the best at twice that size, and
//! pruning on that makes plans up to 7x slower. Dominance on both sides is: no configuration that is
//! Pareto-optimal at a size was more than 1.36x off at both neighbours (tests/engines.rs
//! replays the rule on the full probe).
//!
//! Dominance is judged without a workspace limit, so the measurements kept still serve any
//! limit solved later (the cache keeps raw measurements, not decisions).

use crate::solver::{EngineName, Measurement, OpProfile, Policy};
use std::collections::BTreeSet;

/// The default margin: a configuration more than this many times slower than one that needs
/// no more workspace, at both neighbouring sizes, is not timed in between.
pub const DEFAULT_MARGIN: f64 = 1.5;

/// One size to measure, in order, with the anchors whose measurements decide what to skip.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    pub micro: i64,
    /// `(lower, upper)` anchors for a size between two; `None` for an anchor.
    pub between: Option<(i64, i64)>,
}

/// The measuring order of `sizes` (ascending): anchors first, then the sizes between them.
pub fn measure_order(sizes: &[i64]) -> Vec<Step> {
    let last = sizes.len().saturating_sub(1);
    let between = |i: usize| i % 2 == 1 && i < last;
    let anchors = (0..sizes.len()).filter(|&i| !between(i)).map(|i| Step {
        micro: sizes[i],
        between: None,
    });
    let middles = (0..sizes.len()).filter(|&i| between(i)).map(|i| Step {
        micro: sizes[i],
        between: Some((sizes[i - 1], sizes[i + 1])),
    });
    anchors.chain(middles).collect()
}

/// The engine configurations not to time between two anchors: dominated at both.
pub fn skip_between(
    lower: &[Measurement],
    upper: &[Measurement],
    margin: f64,
) -> BTreeSet<EngineName> {
    let upper = dominated(upper, margin);
    dominated(lower, margin)
        .into_iter()
        .filter(|name| upper.contains(name))
        .collect()
}

/// The engine configurations among `measurements` (all at one micro-batch size) that are
/// dominated: some candidate (of either kind) needs no more workspace and is faster by more
/// than `margin` times.
pub fn dominated(measurements: &[Measurement], margin: f64) -> BTreeSet<EngineName> {
    let mut by_workspace: Vec<&Measurement> = measurements.iter().collect();
    by_workspace.sort_by(|a, b| {
        a.workspace_bytes
            .cmp(&b.workspace_bytes)
            .then(a.time_ms.total_cmp(&b.time_ms))
    });
    let mut out = BTreeSet::new();
    // The fastest time among candidates with at most the current workspace. Candidates of
    // equal workspace count as fitting each other.
    let mut best = f64::INFINITY;
    let mut i = 0;
    while i < by_workspace.len() {
        let workspace = by_workspace[i].workspace_bytes;
        let group_end = by_workspace[i..]
            .iter()
            .position(|m| m.workspace_bytes != workspace)
            .map_or(by_workspace.len(), |p| i + p);
        let group = &by_workspace[i..group_end];
        best = group.iter().map(|m| m.time_ms).fold(best, f64::min);
        for m in group {
            if let Some(name) = m.algo.engine() {
                if m.time_ms > margin * best {
                    out.insert(name);
                }
            }
        }
        i = group_end;
    }
    out
}

/// What [`simulate`] kept and skipped.
#[derive(Clone, Debug, PartialEq)]
pub struct Simulated {
    /// The measurements tuning with pruning would have taken.
    pub kept: OpProfile,
    /// Engine measurements (size, configuration) not taken.
    pub skipped: usize,
    /// Engine measurements taken.
    pub timed: usize,
    /// The kernel time (one call each) of the engine measurements skipped and taken: the
    /// share of timing work saved, since timing a candidate costs a fixed number of calls.
    pub skipped_ms: f64,
    pub timed_ms: f64,
}

/// Replays pruning on a complete recorded profile: anchors with every configuration, then
/// each size between two anchors without the configurations dominated at both.
pub fn simulate(entry: &OpProfile, policy: Policy, margin: f64) -> Simulated {
    let sizes: Vec<i64> = entry
        .allowed(policy)
        .map(|m| m.micro)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let at = |micro: i64| -> Vec<Measurement> {
        entry
            .measurements
            .iter()
            .filter(|m| m.micro == micro)
            .copied()
            .collect()
    };
    let mut kept = Vec::new();
    let (mut skipped, mut timed) = (0, 0);
    let (mut skipped_ms, mut timed_ms) = (0.0, 0.0);
    for step in measure_order(&sizes) {
        let skip = step
            .between
            .map(|(lower, upper)| skip_between(&at(lower), &at(upper), margin))
            .unwrap_or_default();
        for m in at(step.micro) {
            match m.algo.engine() {
                Some(name) if skip.contains(&name) => {
                    skipped += 1;
                    skipped_ms += m.time_ms;
                }
                Some(_) => {
                    timed += 1;
                    timed_ms += m.time_ms;
                    kept.push(m);
                }
                None => kept.push(m),
            }
        }
    }
    Simulated {
        kept: OpProfile {
            measurements: kept,
            ..entry.clone()
        },
        skipped,
        timed,
        skipped_ms,
        timed_ms,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::solver::Algo;

    fn m(algo: Algo, workspace_bytes: u64, time_ms: f64) -> Measurement {
        Measurement {
            micro: 4,
            algo,
            time_ms,
            workspace_bytes,
            verification: None,
        }
    }

    fn engine(name: &str) -> Algo {
        Algo::Engine(name.parse().unwrap())
    }

    #[test]
    fn dominated_needs_a_faster_candidate_within_the_same_workspace() {
        let set = [
            m(Algo::Legacy(0), 0, 1.0),
            // 1.6x slower than a no-workspace legacy algorithm: dominated.
            m(engine("eng1"), 0, 1.6),
            // Slower, but within the margin: kept.
            m(engine("eng2"), 10, 1.4),
            // Needs more workspace and is much faster: kept.
            m(engine("eng3"), 100, 0.1),
            // More workspace than eng3 and 2x slower: dominated.
            m(engine("eng4"), 200, 0.2),
            // A slow legacy algorithm is never pruned (there are few).
            m(Algo::Legacy(1), 300, 9.0),
        ];
        let names: Vec<&str> = dominated(&set, 1.5).iter().map(|n| n.as_str()).collect();
        assert_eq!(names, ["eng1", "eng4"]);
        assert!(dominated(&set, 100.0).is_empty());
    }

    #[test]
    fn anchors_come_first_then_the_sizes_between() {
        let order = measure_order(&[1, 2, 4, 8, 16]);
        let micro: Vec<i64> = order.iter().map(|s| s.micro).collect();
        assert_eq!(micro, [1, 4, 16, 2, 8]);
        assert_eq!(order[3].between, Some((1, 4)));
        assert_eq!(order[4].between, Some((4, 16)));
        // An even count: the last size is an anchor too.
        let micro: Vec<i64> = measure_order(&[1, 2, 4, 6])
            .iter()
            .map(|s| s.micro)
            .collect();
        assert_eq!(micro, [1, 4, 6, 2]);
        assert_eq!(
            measure_order(&[7]),
            [Step {
                micro: 7,
                between: None
            }]
        );
        assert!(measure_order(&[]).is_empty());
    }

    #[test]
    fn skipped_between_only_when_dominated_on_both_sides() {
        let lower = [
            m(Algo::Legacy(0), 0, 1.0),
            m(engine("eng1"), 0, 2.0),
            m(engine("eng2"), 0, 2.0),
        ];
        let upper = [
            m(Algo::Legacy(0), 0, 1.0),
            m(engine("eng1"), 0, 2.0),
            m(engine("eng2"), 0, 1.1),
        ];
        let names: Vec<&str> = skip_between(&lower, &upper, 1.5)
            .iter()
            .map(|n| n.as_str())
            .collect();
        assert_eq!(names, ["eng1"]);
    }

    #[test]
    fn equal_workspace_candidates_compete() {
        let set = [m(engine("eng1"), 64, 1.0), m(engine("eng2"), 64, 3.0)];
        let names: Vec<&str> = dominated(&set, 1.5).iter().map(|n| n.as_str()).collect();
        assert_eq!(names, ["eng2"]);
    }
}
