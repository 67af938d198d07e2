//! Solver benchmarks (criterion): the WR dynamic program at its largest everyday size, the
//! Pareto sweep, and the WD MILP at 100 (layer, op) pairs x 20 Pareto points.
//! Run: `cargo bench --bench solver`.

use criterion::{criterion_group, criterion_main, Criterion};
use mucudnn::solver::synthetic::{random_entry, random_fronts, Rng};
use mucudnn::solver::wd::choose;
use mucudnn::solver::{pareto_front, solve_wr, Policy, WdOptions};
use std::hint::black_box;

fn dp(c: &mut Criterion) {
    let entry = random_entry(&mut Rng(1), 1024, 10, Policy::All);
    c.bench_function("wr_dp n=1024 policy=all algos=10 limit=64MiB", |b| {
        b.iter(|| solve_wr(black_box(&entry), Policy::All, 64 << 20).unwrap())
    });
    let entry = random_entry(&mut Rng(4), 1024, 10, Policy::All);
    let mut group = c.benchmark_group("pareto_large");
    group.sample_size(10);
    group.bench_function("pareto_front n=1024 policy=all algos=10", |b| {
        b.iter(|| pareto_front(black_box(&entry), Policy::All).unwrap())
    });
    group.finish();
    let entry = random_entry(&mut Rng(2), 256, 10, Policy::PowerOfTwo);
    c.bench_function("pareto_front n=256 policy=power-of-two algos=10", |b| {
        b.iter(|| pareto_front(black_box(&entry), Policy::PowerOfTwo).unwrap())
    });
}

fn ilp(c: &mut Criterion) {
    let fronts = random_fronts(&mut Rng(3), 100, 20);
    // Half of what the fastest points would need: the MILP has real choices to make.
    let fastest: u64 = fronts
        .iter()
        .map(|f| f.last().unwrap().workspace_bytes)
        .sum();
    let budget = fastest / 2;
    let options = WdOptions::default();
    let check = choose(&fronts, budget, &options).unwrap();
    assert_eq!(
        check.method,
        options.backend.name(),
        "the benchmark must exercise the MILP"
    );
    eprintln!(
        "ilp 100x20: proven_optimal={} total={:.3} ms",
        check.proven_optimal, check.total_time_ms
    );
    let mut group = c.benchmark_group("wd");
    group.sample_size(20);
    group.bench_function("wd_milp pairs=100 points=20", |b| {
        b.iter(|| choose(black_box(&fronts), budget, &options).unwrap())
    });
    // Quantised times and workspaces: many ties, the case where microlp was seen to stall.
    let tied: Vec<Vec<_>> = fronts
        .iter()
        .map(|front| {
            let mut quantised: Vec<_> = front
                .iter()
                .map(|p| mucudnn::solver::wd::Point {
                    time_ms: (p.time_ms * 4.0).round() / 4.0,
                    workspace_bytes: (p.workspace_bytes >> 22) << 22,
                })
                .collect();
            quantised.dedup_by(|b, a| b.time_ms >= a.time_ms);
            quantised
        })
        .collect();
    let tied_fastest: u64 = tied.iter().map(|f| f.last().unwrap().workspace_bytes).sum();
    let check = choose(&tied, tied_fastest / 2, &options).unwrap();
    eprintln!(
        "ilp 100x20 tied: proven_optimal={} method={}",
        check.proven_optimal, check.method
    );
    group.bench_function("wd_milp pairs=100 points<=20 ties", |b| {
        b.iter(|| choose(black_box(&tied), tied_fastest / 2, &options).unwrap())
    });
    group.finish();
}

criterion_group!(benches, dp, ilp);
criterion_main!(benches);
