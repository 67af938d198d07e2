//! Determinism (`torch.backends.cudnn.deterministic`): a layer tuned with
//! `EngineOptions::deterministic` solves its plans from the candidates its backend marks
//! deterministic only, and those plans are cached apart from the plain ones, so neither kind
//! stands in for the other.

use mucudnn::backend::{
    Backend, BackendError, CpuBackend, MeasureSettings, Measured, TimingSettings,
};
use mucudnn::cache::Cache;
use mucudnn::device::DeviceFingerprint;
use mucudnn::solver::{
    Algo, CandidateSet, ConvOp, ConvProblem, MeasureKey, Measurement, Plan, Policy,
};
use mucudnn::tune::{EngineOptions, LayerTuning};

/// Two candidates per op: 0 fast but not deterministic (atomics), 1 slower and deterministic.
struct Atomics(DeviceFingerprint);

impl Backend for Atomics {
    fn fingerprint(&self) -> &DeviceFingerprint {
        &self.0
    }
    fn measure(
        &mut self,
        key: &MeasureKey,
        how: &MeasureSettings,
    ) -> Result<Measured, BackendError> {
        let micro = key.size;
        Ok(Measured {
            measurements: [(0, 1.0), (1, 2.0)]
                .into_iter()
                .map(|(algo, ms)| Measurement::new(micro, Algo::Legacy(algo), ms * micro as f64, 0))
                .collect(),
            verification: how.size_verification(),
            ..Measured::default()
        })
    }
    fn is_deterministic(&self, _: ConvOp, algo: &Algo) -> bool {
        *algo != Algo::Legacy(0)
    }
}

fn tuning(deterministic: bool) -> LayerTuning {
    LayerTuning {
        policy: Policy::PowerOfTwo,
        workspace_limit_bytes: 64 << 20,
        timing: TimingSettings {
            warmup: 0,
            loops: 1,
            iterations: 1,
            long_call_ms: 1.0,
        },
        candidates: CandidateSet::Legacy,
        engines: EngineOptions {
            deterministic,
            ..EngineOptions::default()
        },
        split: mucudnn::tune::SplitSetting::Batch,
        index_limit: mucudnn::solver::IndexLimit::CUDNN,
        verify: true,
    }
}

fn algos(plans: &[Plan; 3]) -> Vec<Algo> {
    plans
        .iter()
        .flat_map(|p| p.micro_batches.iter().map(|m| m.algo))
        .collect()
}

#[test]
fn deterministic_plans_use_only_deterministic_candidates_and_are_cached_apart() {
    let cache = Cache::in_memory();
    let mut fingerprint = mucudnn::device::cpu_fingerprint();
    fingerprint.name = "atomics".into();
    let mut backend = Atomics(fingerprint);
    let problem = ConvProblem::new(4, 2, 5, 5, 2, 3, 3);
    let plain = tuning(false)
        .tune(&mut backend, &cache, "l", &problem)
        .unwrap();
    assert!(algos(&plain).iter().all(|&a| a == Algo::Legacy(0)));
    // Same cache, determinism asked: the cached plain plans are not taken, the measurements
    // are (nothing measured again), and only the deterministic candidate runs.
    let (strict, stats) = tuning(true)
        .tune_counted(&mut backend, &cache, "l", &problem)
        .unwrap();
    assert_eq!(stats.measured, 0, "measurements are shared");
    assert!(stats.cached > 0, "the plans were solved again, not read");
    assert!(algos(&strict).iter().all(|&a| a == Algo::Legacy(1)));
    // Each kind of plan comes back from the cache under its own key.
    let (again, stats) = tuning(false)
        .tune_counted(&mut backend, &cache, "l", &problem)
        .unwrap();
    assert_eq!(
        (stats.cached, stats.measured),
        (0, 0),
        "plans read from the cache"
    );
    assert_eq!(again, plain);
    let (again, stats) = tuning(true)
        .tune_counted(&mut backend, &cache, "l", &problem)
        .unwrap();
    assert_eq!(
        (stats.cached, stats.measured),
        (0, 0),
        "plans read from the cache"
    );
    assert_eq!(again, strict);
}

#[test]
fn every_cpu_algorithm_is_deterministic() {
    let backend = CpuBackend::new();
    for op in ConvOp::ALL {
        for algo in 0..3 {
            assert!(backend.is_deterministic(op, &Algo::Legacy(algo)));
        }
    }
    // So determinism changes no CPU plan.
    let cache = Cache::in_memory();
    let mut backend = CpuBackend::new();
    let problem = ConvProblem::new(2, 2, 4, 4, 2, 3, 3);
    let plain = tuning(false)
        .tune(&mut backend, &cache, "l", &problem)
        .unwrap();
    let strict = tuning(true)
        .tune(&mut backend, &cache, "l", &problem)
        .unwrap();
    assert_eq!(plain, strict);
}
