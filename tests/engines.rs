//! Engine configurations (cuDNN's graph API) as candidates, on recorded H100 data: the solver
//! reproduces the probe's published totals, joining them with the legacy algorithms never
//! makes a plan slower, the Pareto-trimmed fixture solves exactly like the full probe, and
//! pruning dominated configurations while tuning skips most timings at (almost) no cost.

use mucudnn::profiler::prune::{simulate, DEFAULT_MARGIN};
use mucudnn::solver::{
    interchange, solve_profile, Algo, AlgoKind, CandidateSet, ConvOp, DType, Layout, Measurement,
    Mode, OpProfile, Policy, Profile, Solution, WdOptions,
};
use std::path::Path;

const MIB: u64 = 1 << 20;

fn fixture(name: &str) -> Profile {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    interchange::from_json_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn engines() -> Profile {
    fixture("h100-engines-3layers-pareto.json")
}

fn wr(profile: &Profile, policy: Policy, limit: u64) -> Solution {
    let mode = Mode::WorkspaceReuse {
        workspace_limit_bytes: limit,
    };
    solve_profile(profile, policy, mode, &WdOptions::default()).unwrap()
}

/// Totals per dtype: (undivided, micro-batched).
fn totals(solution: &Solution, dtype: DType) -> (f64, f64) {
    let of = |dt| {
        solution
            .problems
            .iter()
            .filter(move |s| s.plan.problem.dtype == dt)
    };
    let undivided = of(dtype)
        .map(|s| s.undivided.as_ref().map_or(f64::INFINITY, |u| u.time_ms()))
        .sum();
    let planned = of(dtype).map(|s| s.plan.time_ms()).sum();
    (undivided, planned)
}

/// The probe's published table, rounded to what it printed: fwd+bwd of the three
/// layers, engines only, powers of two.
#[test]
fn the_probe_totals_are_reproduced() {
    let profile = engines();
    assert_eq!(profile.entries.len(), 18);
    assert!(profile
        .entries
        .iter()
        .flat_map(|e| &e.measurements)
        .all(|m| m.algo.kind() == AlgoKind::Engine));
    let close = |got: f64, want: f64, digits: i32| {
        let unit = 10f64.powi(-digits);
        assert!((got - want).abs() <= unit / 2.0 + 1e-9, "{got} vs {want}");
    };
    let at = |limit| wr(&profile, Policy::PowerOfTwo, limit);
    let (undivided_8, micro_8) = totals(&at(8 * MIB), DType::Fp32);
    close(undivided_8, 29.6, 1);
    close(micro_8, 16.0, 1);
    let (undivided_64, micro_64) = totals(&at(64 * MIB), DType::Fp32);
    close(undivided_64, 27.7, 1);
    close(micro_64, 5.86, 2);
    close(totals(&at(8 * MIB), DType::Fp16).1, 1.77, 2);
    close(totals(&at(64 * MIB), DType::Fp16).1, 1.70, 2);
    // Every micro-batch of a plan names a configuration that was measured at its size.
    for solved in &at(8 * MIB).problems {
        let entry = profile
            .entries
            .iter()
            .find(|e| {
                e.layer == solved.plan.layer
                    && e.op == solved.plan.op
                    && e.problem == solved.plan.problem
            })
            .unwrap();
        for mb in &solved.plan.micro_batches {
            assert!(matches!(mb.algo, Algo::Engine(_)));
            assert!(entry
                .measurements
                .iter()
                .any(|m| m.micro == mb.size && m.algo == mb.algo));
        }
    }
}

/// Legacy algorithms and engine configurations of AlexNet conv2 and conv3 in one profile: the
/// best of both is never slower than either alone, and at 64 MiB in fp32 it is faster than
/// the legacy plans by a wide margin.
#[test]
fn the_solver_takes_the_best_of_both_kinds() {
    let legacy = fixture("h100-alexnet-profile.json");
    let mut all = legacy.clone();
    all.merge(&engines()).unwrap();
    let both_kinds = |p: &Profile| -> Profile {
        Profile {
            entries: p
                .entries
                .iter()
                .filter(|e| e.layer == "alexnet.conv2" || e.layer == "alexnet.conv3")
                .cloned()
                .collect(),
            ..p.clone()
        }
    };
    let all = both_kinds(&all);
    for limit in [8 * MIB, 64 * MIB, 256 * MIB] {
        let solve = |set| wr(&all.only(set), Policy::PowerOfTwo, limit);
        let (l, e, a) = (
            solve(CandidateSet::Legacy),
            solve(CandidateSet::Engines),
            solve(CandidateSet::All),
        );
        for ((l, e), a) in l.problems.iter().zip(&e.problems).zip(&a.problems) {
            assert!(a.plan.time_ms() <= l.plan.time_ms().min(e.plan.time_ms()) + 1e-12);
            assert!(a.plan.workspace_bytes() <= limit);
        }
        if limit == 64 * MIB {
            let legacy_fp32 = totals(&l, DType::Fp32).1;
            let all_fp32 = totals(&a, DType::Fp32).1;
            assert!(all_fp32 < 0.9 * legacy_fp32, "{all_fp32} vs {legacy_fp32}");
        }
    }
    // A merge of the same profile twice is refused (a candidate measured twice).
    let mut twice = engines();
    assert!(twice.merge(&engines()).is_err());
    // So is a merge across devices.
    let mut other = engines();
    other.device = "another GPU".into();
    assert!(other
        .merge(&legacy)
        .unwrap_err()
        .to_string()
        .contains("different devices"));
}

/// The full probe from ../shared (skipped, saying so, when it is not there).
fn full_probe() -> Option<Profile> {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/data/h100-engines-3layers.json");
    let Ok(text) = std::fs::read_to_string(&path) else {
        eprintln!("skipped: {} is not here", path.display());
        return None;
    };
    let raw: Vec<serde_json::Value> = serde_json::from_str(&text).unwrap();
    // The trimmed fixture has every (layer, dtype, op) with its full shape: reuse them.
    let mut profile = engines();
    for entry in &mut profile.entries {
        entry.measurements.clear();
    }
    for r in &raw {
        let dtype: DType = r["dtype"].as_str().unwrap().parse().unwrap();
        let layout = if dtype == DType::Fp32 {
            Layout::Nchw
        } else {
            Layout::Nhwc
        };
        let op: ConvOp = r["op"].as_str().unwrap().parse().unwrap();
        let layer = r["layer"].as_str().unwrap();
        let entry = profile
            .entries
            .iter_mut()
            .find(|e| {
                e.layer == layer
                    && e.op == op
                    && e.problem.dtype == dtype
                    && e.problem.layout == layout
            })
            .unwrap();
        entry.measurements.push(Measurement {
            micro: r["micro"].as_i64().unwrap(),
            algo: Algo::Engine(r["plan"].as_str().unwrap().parse().unwrap()),
            time_ms: r["ms"].as_f64().unwrap(),
            workspace_bytes: r["ws"].as_u64().unwrap(),
            verification: None,
        });
    }
    profile.validate().unwrap();
    Some(profile)
}

const LIMITS: [u64; 5] = [MIB, 8 * MIB, 64 * MIB, 256 * MIB, 1 << 40];

#[test]
fn the_trimmed_fixture_solves_like_the_full_probe() {
    let Some(full) = full_probe() else { return };
    let trimmed = engines();
    for limit in LIMITS {
        for policy in [Policy::Undivided, Policy::PowerOfTwo] {
            let (a, b) = (wr(&full, policy, limit), wr(&trimmed, policy, limit));
            for (a, b) in a.problems.iter().zip(&b.problems) {
                assert_eq!(
                    a.plan.time_ms(),
                    b.plan.time_ms(),
                    "{} {limit}",
                    a.plan.layer
                );
            }
        }
    }
}

/// Replays tuning with pruning on the full probe (every configuration timed at every size):
/// how many timings pruning skips, and what it costs at several limits. Prints the table
/// (`cargo test --test engines -- --nocapture`).
#[test]
fn pruning_skips_dominated_timings_and_keeps_the_plans() {
    let Some(full) = full_probe() else { return };
    println!("margin  timed  skipped  skipped%  kernel time skipped%  worst plan loss (1, 8, 64, 256 MiB, unlimited)");
    for margin in [1.2, DEFAULT_MARGIN, 2.0, 4.0] {
        let mut pruned = full.clone();
        let (mut timed, mut skipped) = (0, 0);
        let (mut timed_ms, mut skipped_ms) = (0.0, 0.0);
        pruned.entries = full
            .entries
            .iter()
            .map(|entry: &OpProfile| {
                let sim = simulate(entry, Policy::PowerOfTwo, margin);
                timed += sim.timed;
                skipped += sim.skipped;
                timed_ms += sim.timed_ms;
                skipped_ms += sim.skipped_ms;
                sim.kept
            })
            .collect();
        let mut losses = Vec::new();
        for limit in LIMITS {
            let (a, b) = (
                wr(&full, Policy::PowerOfTwo, limit),
                wr(&pruned, Policy::PowerOfTwo, limit),
            );
            let worst = a
                .problems
                .iter()
                .zip(&b.problems)
                .map(|(a, b)| b.plan.time_ms() / a.plan.time_ms() - 1.0)
                .fold(0.0f64, f64::max);
            losses.push(worst);
        }
        let share = skipped as f64 / (timed + skipped) as f64;
        println!(
            "{margin:>6}  {timed:>5}  {skipped:>7}  {:>7.1}%  {:>19.1}%  {}",
            100.0 * share,
            100.0 * skipped_ms / (timed_ms + skipped_ms),
            losses
                .iter()
                .map(|l| format!("{:.2}%", 100.0 * l))
                .collect::<Vec<_>>()
                .join(", ")
        );
        if margin == DEFAULT_MARGIN {
            // Measured: 15.7% of the timings, no plan slower at any limit.
            assert!(share > 0.1, "the default prunes only {:.1}%", 100.0 * share);
            let worst = losses.iter().copied().fold(0.0, f64::max);
            assert!(worst < 0.005, "the default loses {:.2}%", 100.0 * worst);
        }
    }
}
