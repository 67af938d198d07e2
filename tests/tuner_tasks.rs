//! Tuning dealt out over processes, on the CPU backend: the tasks a cache lacks, measured in
//! shares by two "ranks" and exchanged, leave nothing missing, and both ranks then solve the
//! same plans without measuring. Stored records from elsewhere are checked first.

use mucudnn::backend::{Backend, CpuBackend, TimingSettings};
use mucudnn::cache::Cache;
use mucudnn::profiler::Job;
use mucudnn::solver::{AlgoKind, CandidateSet, ConvOp, ConvProblem, Policy};
use mucudnn::tune::{
    jobs_for, measure_task, missing_tasks, store_measured, EngineOptions, LayerTuning,
    MeasuredTask, ProfileRun,
};

const FAST: TimingSettings = TimingSettings {
    warmup: 0,
    loops: 1,
    iterations: 1,
    long_call_ms: 1.0,
};

fn run(cache: &Cache) -> ProfileRun<'_> {
    ProfileRun {
        policy: Policy::PowerOfTwo,
        timing: FAST,
        cache,
        interrupt: None,
        candidates: CandidateSet::All,
        engines: EngineOptions::default(),
        workspace_limit_bytes: None,
    }
}

fn jobs() -> Vec<Job> {
    let mut a = ConvProblem::new(8, 3, 6, 6, 4, 3, 3);
    (a.pad_h, a.pad_w) = (1, 1);
    let b = ConvProblem::new(8, 4, 6, 6, 4, 1, 1);
    // `c` repeats `a` under another name: its tasks are the same measurements.
    jobs_for([
        ("a".to_string(), a),
        ("b".to_string(), b),
        ("c".to_string(), a),
    ])
}

#[test]
fn shares_measured_by_two_ranks_complete_both_caches() {
    let (cache0, cache1) = (Cache::in_memory(), Cache::in_memory());
    let (mut rank0, mut rank1) = (CpuBackend::new(), CpuBackend::new());
    let jobs = jobs();
    let fingerprint = rank0.fingerprint().clone();
    let tasks = missing_tasks(&jobs, &run(&cache0), &fingerprint, &[AlgoKind::Legacy]).unwrap();
    // 3 layers x 3 ops x sizes 1, 2, 4, 8: anchors (1, 4, 8) of every layer before any size
    // between (2).
    assert_eq!(tasks.len(), 3 * 3 * 4);
    let first_between = tasks.iter().position(|t| t.between.is_some()).unwrap();
    assert_eq!(first_between, 3 * 3 * 3);
    assert!(tasks[first_between..]
        .iter()
        .all(|t| t.between == Some((1, 4))));
    let mut shares: [Vec<MeasuredTask>; 2] = [Vec::new(), Vec::new()];
    for between in [false, true] {
        let round: Vec<_> = tasks
            .iter()
            .filter(|t| t.between.is_some() == between)
            .collect();
        for (i, task) in round.iter().enumerate() {
            let (backend, cache, share) = if i % 2 == 0 {
                (&mut rank0, &cache0, 0)
            } else {
                (&mut rank1, &cache1, 1)
            };
            shares[share].push(measure_task(backend, task, &run(cache)).unwrap());
        }
        // Exchange this round's results before the next round (whose pruning reads them).
        store_measured(&cache0, &fingerprint, &shares[1]).unwrap();
        store_measured(&cache1, &fingerprint, &shares[0]).unwrap();
    }
    assert_eq!(shares[0].len() + shares[1].len(), tasks.len());
    for cache in [&cache0, &cache1] {
        assert!(
            missing_tasks(&jobs, &run(cache), &fingerprint, &[AlgoKind::Legacy])
                .unwrap()
                .is_empty()
        );
    }
    let tuning = LayerTuning {
        policy: Policy::PowerOfTwo,
        workspace_limit_bytes: 1 << 20,
        timing: FAST,
        candidates: CandidateSet::All,
        engines: EngineOptions::default(),
    };
    let problem = jobs[0].problem;
    let (plans0, stats0) = tuning
        .tune_counted(&mut rank0, &cache0, "a", &problem)
        .unwrap();
    let (plans1, stats1) = tuning
        .tune_counted(&mut rank1, &cache1, "a", &problem)
        .unwrap();
    assert_eq!(stats0.measured + stats1.measured, 0);
    assert_eq!(stats0.cached, 3 * 4);
    assert_eq!(plans0, plans1);
    assert_eq!(plans0.map(|p| p.op), ConvOp::ALL);
}

#[test]
fn stored_records_are_checked_before_anything_is_stored() {
    let cache = Cache::in_memory();
    let mut backend = CpuBackend::new();
    let fingerprint = backend.fingerprint().clone();
    let jobs = jobs();
    let tasks = missing_tasks(&jobs, &run(&cache), &fingerprint, &[AlgoKind::Legacy]).unwrap();
    let scratch = Cache::in_memory();
    let good = measure_task(&mut backend, &tasks[0], &run(&scratch)).unwrap();
    assert!(!good.measurements.is_empty());
    let mut wrong_size = good.clone();
    wrong_size.measurements[0].micro += 1;
    let mut not_finite = good.clone();
    not_finite.measurements[0].time_ms = f64::NAN;
    for bad in [wrong_size, not_finite] {
        let error = store_measured(&cache, &fingerprint, &[good.clone(), bad]).unwrap_err();
        assert!(error.to_string().contains("a.fwd") || error.to_string().contains("a fwd"));
        // Nothing of the batch was stored, the good record included.
        assert_eq!(
            missing_tasks(&jobs, &run(&cache), &fingerprint, &[AlgoKind::Legacy])
                .unwrap()
                .len(),
            tasks.len()
        );
    }
    assert_eq!(store_measured(&cache, &fingerprint, &[good]).unwrap(), 1);
}
