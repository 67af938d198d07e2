//! Workspace reuse: the DP against independent solvers, its invariants, and the acceptance
//! numbers on the recorded H100 AlexNet profile.

mod common;

use common::*;
use mucudnn_solver::{pareto_front, solve_profile, solve_wr, Mode, Policy, SolveError, WdOptions};
use proptest::prelude::*;

const MIB: u64 = 1 << 20;

fn close(a: f64, b: f64, rel: f64) -> bool {
    (a - b).abs() <= rel * a.abs().max(b.abs())
}

#[test]
fn alexnet_64mib_power_of_two_matches_independent_dp_and_speedup() {
    let profile = alexnet_profile();
    assert_eq!(profile.entries.len(), 30, "5 layers x 3 ops x 2 dtypes");
    let mode = Mode::WorkspaceReuse {
        workspace_limit_bytes: 64 * MIB,
    };
    let solution =
        solve_profile(&profile, Policy::PowerOfTwo, mode, &WdOptions::default()).unwrap();
    let mut totals = std::collections::BTreeMap::<String, (f64, f64, f64)>::new();
    for (solved, entry) in solution.problems.iter().zip(&profile.entries) {
        let expected = reference_wr(entry, Policy::PowerOfTwo, 64 * MIB).unwrap();
        let got = solved.plan.time_ms();
        assert!(
            close(got, expected, 1e-9),
            "{}: {got} vs {expected}",
            entry.name()
        );
        assert_eq!(solved.plan.batch(), 256);
        assert!(solved.plan.workspace_bytes() <= 64 * MIB);
        let undivided = solved.undivided.as_ref().unwrap().time_ms();
        assert!(got <= undivided);
        let t = totals.entry(entry.problem.dtype.to_string()).or_default();
        t.0 += got;
        t.1 += expected;
        t.2 += undivided;
    }
    let (fp32, fp32_ref, fp32_und) = totals["fp32"];
    let (fp16, _, fp16_und) = totals["fp16"];
    assert!(close(fp32, fp32_ref, 1e-6));
    let speedup32 = fp32_und / fp32;
    let speedup16 = fp16_und / fp16;
    // Recorded: 17.496 ms micro-batched against 65.558 ms undivided (3.75x); fp16 62x.
    assert!((3.6..3.9).contains(&speedup32), "fp32 speedup {speedup32}");
    assert!(speedup16 > 10.0, "fp16 speedup {speedup16}");
}

#[test]
fn undivided_policy_is_the_best_single_algorithm() {
    let profile = alexnet_profile();
    for entry in &profile.entries {
        let plan = solve_wr(entry, Policy::Undivided, 64 * MIB).unwrap();
        assert_eq!(plan.micro_batches.len(), 1);
        let best = entry
            .measurements
            .iter()
            .filter(|m| m.micro == 256 && m.workspace_bytes <= 64 * MIB)
            .map(|m| m.time_ms)
            .fold(f64::INFINITY, f64::min);
        assert_eq!(plan.time_ms(), best);
    }
}

#[test]
fn infeasible_limit_names_the_problem_and_the_smallest_limit() {
    // Every recorded problem has a zero-workspace algorithm; drop those so that a 0-byte
    // limit admits nothing.
    let mut entry = alexnet_profile().entries.remove(4);
    entry.measurements.retain(|m| m.workspace_bytes > 0);
    let entry = &entry;
    let err = solve_wr(entry, Policy::PowerOfTwo, 0).unwrap_err();
    let min = match &err {
        SolveError::Infeasible {
            name,
            min_workspace_bytes: Some(min),
            ..
        } => {
            assert_eq!(name.layer, entry.layer);
            *min
        }
        other => panic!("unexpected {other:?}"),
    };
    assert!(err.to_string().contains(&entry.layer), "{err}");
    assert!(
        err.to_string().contains("smallest limit that works"),
        "{err}"
    );
    // The named limit works and one byte less does not.
    assert!(solve_wr(entry, Policy::PowerOfTwo, min).is_ok());
    assert!(solve_wr(entry, Policy::PowerOfTwo, min - 1).is_err());
}

#[test]
fn missing_sizes_are_reported() {
    let mut entry = alexnet_profile().entries.remove(0);
    entry.measurements.retain(|m| m.micro != 256);
    assert!(matches!(
        solve_wr(&entry, Policy::Undivided, u64::MAX),
        Err(SolveError::NoSizes { .. })
    ));
    // Power-of-two still composes 256 from 128s.
    assert_eq!(
        solve_wr(&entry, Policy::PowerOfTwo, u64::MAX)
            .unwrap()
            .batch(),
        256
    );
}

#[test]
fn pareto_front_is_monotone_and_each_point_is_the_optimum_at_its_workspace() {
    let profile = alexnet_profile();
    for entry in &profile.entries {
        let front = pareto_front(entry, Policy::PowerOfTwo).unwrap();
        for pair in front.windows(2) {
            assert!(pair[0].workspace_bytes < pair[1].workspace_bytes);
            assert!(pair[0].time_ms > pair[1].time_ms);
        }
        for point in &front {
            assert_eq!(point.plan.workspace_bytes(), point.workspace_bytes);
            let optimum = reference_wr(entry, Policy::PowerOfTwo, point.workspace_bytes).unwrap();
            assert!(close(point.time_ms, optimum, 1e-12), "{}", entry.name());
        }
        // The last point is the unlimited optimum.
        let unlimited = reference_wr(entry, Policy::PowerOfTwo, u64::MAX).unwrap();
        assert!(close(front.last().unwrap().time_ms, unlimited, 1e-12));
    }
}

#[test]
fn dp_matches_brute_force_on_small_random_profiles() {
    let mut rng = Rng(42);
    for case in 0..300 {
        let n = 1 + rng.below(12) as i64;
        let policy = Policy::ALL[case % 3];
        let algos = 1 + rng.below(4) as u32;
        let entry = random_entry(&mut rng, n, algos, policy);
        let limit = rng.below(8 << 20);
        let expected = brute_force_wr(&entry, policy, limit);
        match (solve_wr(&entry, policy, limit), expected) {
            (Ok(plan), Some(t)) => assert!(close(plan.time_ms(), t, 1e-9), "case {case}"),
            (Err(SolveError::Infeasible { .. } | SolveError::NoSizes { .. }), None) => {}
            (got, want) => panic!("case {case}: {got:?} vs {want:?}"),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Sizes sum to N, workspace within the limit, never slower than the best feasible
    /// undivided algorithm, and every micro-batch uses a measured (size, algo) pair.
    #[test]
    fn plan_invariants(seed in any::<u64>(), n in 1i64..200, algos in 1u32..6, limit in 0u64..(64 << 20), policy_index in 0usize..3) {
        let policy = Policy::ALL[policy_index];
        let mut rng = Rng(seed | 1);
        let entry = random_entry(&mut rng, n, algos, policy);
        let undivided = mucudnn_solver::wr::undivided(&entry, limit).unwrap();
        match solve_wr(&entry, policy, limit) {
            Ok(plan) => {
                prop_assert_eq!(plan.batch(), n);
                prop_assert!(plan.workspace_bytes() <= limit);
                for mb in &plan.micro_batches {
                    prop_assert!(policy.allows(mb.size, n));
                    prop_assert!(entry.measurements.iter().any(|m| m.micro == mb.size && m.algo == mb.algo
                        && m.time_ms == mb.time_ms && m.workspace_bytes == mb.workspace_bytes));
                }
                if let Some(u) = undivided {
                    prop_assert!(plan.time_ms() <= u.time_ms() * (1.0 + 1e-12));
                }
                let reference = reference_wr(&entry, policy, limit).unwrap();
                prop_assert!(close(plan.time_ms(), reference, 1e-9));
            }
            Err(SolveError::Infeasible { min_workspace_bytes, .. }) => {
                prop_assert!(reference_wr(&entry, policy, limit).is_none());
                prop_assert!(undivided.is_none());
                if let Some(min) = min_workspace_bytes {
                    prop_assert!(min > limit);
                    prop_assert!(reference_wr(&entry, policy, min).is_some());
                }
            }
            Err(SolveError::NoSizes { .. }) => prop_assert!(entry.allowed(policy).next().is_none()),
            Err(other) => prop_assert!(false, "unexpected error {}", other),
        }
    }
}

/// The front is complete: at every limit, the best front point within it is the optimum.
#[test]
fn pareto_front_is_complete_on_random_profiles() {
    let mut rng = Rng(1234);
    for case in 0..60 {
        let policy = Policy::ALL[case % 3];
        let n = 1 + rng.below(40) as i64;
        let algos = 1 + rng.below(6) as u32;
        let entry = random_entry(&mut rng, n, algos, policy);
        let front = match pareto_front(&entry, policy) {
            Ok(front) => front,
            Err(_) => {
                assert!(
                    reference_wr(&entry, policy, u64::MAX).is_none(),
                    "case {case}"
                );
                continue;
            }
        };
        let mut limits: Vec<u64> = entry
            .measurements
            .iter()
            .map(|m| m.workspace_bytes)
            .collect();
        limits.sort_unstable();
        limits.dedup();
        for limit in limits {
            let from_front = front
                .iter()
                .take_while(|p| p.workspace_bytes <= limit)
                .last()
                .map(|p| p.time_ms);
            let optimum = reference_wr(&entry, policy, limit);
            match (from_front, optimum) {
                (Some(a), Some(b)) => {
                    assert!(close(a, b, 1e-12), "case {case} limit {limit}: {a} vs {b}")
                }
                (None, None) => {}
                other => panic!("case {case} limit {limit}: {other:?}"),
            }
        }
    }
}

/// A profile measured under a limit that skipped every candidate at some
/// sizes still names the smallest limit that works, counting the skipped workspaces, and never
/// plans with a skipped candidate.
#[test]
fn skipped_candidates_name_the_smallest_limit_but_never_make_a_plan() {
    use mucudnn_solver::{
        Algo, ConvOp, ConvProblem, Measurement, OpProfile, ProfileError, Skipped,
    };
    let m = |micro: i64, algo: u32, workspace_bytes: u64| Measurement {
        micro,
        algo: Algo::Legacy(algo),
        time_ms: micro as f64,
        workspace_bytes,
        verification: None,
    };
    let s = |micro: i64, algo: u32, workspace_bytes: u64| Skipped {
        micro,
        algo: Algo::Legacy(algo),
        workspace_bytes,
    };
    let mut entry = OpProfile {
        layer: "l".into(),
        problem: ConvProblem::new(4, 2, 5, 5, 2, 3, 3),
        op: ConvOp::Forward,
        split: mucudnn_solver::SplitDim::Batch,
        measurements: vec![m(1, 0, 10)],
        skipped: vec![s(2, 1, 300), s(4, 1, 200), s(4, 2, 900)],
        rejected: Vec::new(),
    };
    // Measured under 100 bytes: size 1 alone makes up 4.
    let plan = solve_wr(&entry, Policy::PowerOfTwo, 100).unwrap();
    assert!(plan
        .micro_batches
        .iter()
        .all(|mb| mb.algo == Algo::Legacy(0)));
    // A limit below every workspace names the smallest one that works: 10 bytes.
    let err = solve_wr(&entry, Policy::PowerOfTwo, 5).unwrap_err();
    assert!(
        matches!(
            err,
            SolveError::Infeasible {
                min_workspace_bytes: Some(10),
                ..
            }
        ),
        "{err}"
    );
    // Nothing timed at all: the skipped workspaces alone name it (200: size 4 undivided).
    entry.measurements.clear();
    let err = solve_wr(&entry, Policy::PowerOfTwo, 100).unwrap_err();
    assert!(
        matches!(
            err,
            SolveError::Infeasible {
                min_workspace_bytes: Some(200),
                ..
            }
        ),
        "{err}"
    );
    // Without skipped candidates an empty profile stays a profile error.
    entry.skipped.clear();
    assert!(matches!(
        solve_wr(&entry, Policy::PowerOfTwo, 100),
        Err(SolveError::Profile(ProfileError::NoMeasurements { .. }))
    ));
}
