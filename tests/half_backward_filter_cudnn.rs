//! The cuDNN side of half-precision backward-filter accuracy: cuDNN adds
//! each micro-batch after the first into `dw` in the operands' dtype, so on a cuDNN device a
//! bf16 backward-filter plan has at most 4 micro-batches (docs/pytorch.md, "Half-precision
//! weight gradients"), and a plan cached before that rule is solved again. Run here through a
//! stand-in backend with a cuDNN fingerprint; the rule itself is plain Rust.

use mucudnn::backend::{Backend, BackendError, MeasureSettings, Measured, TimingSettings};
use mucudnn::cache::{Cache, PlanKey};
use mucudnn::device::{BackendKind, DeviceFingerprint};
use mucudnn::solver::{
    solve_wr, Algo, CandidateSet, ConvOp, ConvProblem, DType, MeasureKey, Measurement, OpProfile,
    Plan, Policy,
};
use mucudnn::tune::{EngineOptions, LayerTuning};

/// One candidate whose time per sample falls with the micro-batch size, so an unrestricted
/// solve splits into micro-batches of 1.
struct SmallIsFast(DeviceFingerprint);

fn time_ms(micro: i64) -> f64 {
    0.5 * micro as f64 + 0.01 * (micro * micro) as f64
}

impl Backend for SmallIsFast {
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
            measurements: vec![Measurement::new(micro, Algo::Legacy(0), time_ms(micro), 0)],
            verification: how.size_verification(),
            ..Measured::default()
        })
    }
}

const LIMIT: u64 = 64 << 20;

fn tuning() -> LayerTuning {
    LayerTuning {
        policy: Policy::All,
        workspace_limit_bytes: LIMIT,
        timing: TimingSettings {
            warmup: 0,
            loops: 1,
            iterations: 1,
            long_call_ms: 1.0,
        },
        candidates: CandidateSet::Legacy,
        engines: EngineOptions::default(),
        split: mucudnn::tune::SplitSetting::Batch,
        index_limit: mucudnn::solver::IndexLimit::CUDNN,
        verify: true,
    }
}

fn gpu(backend: BackendKind) -> SmallIsFast {
    SmallIsFast(DeviceFingerprint {
        backend,
        name: "NVIDIA H100 80GB HBM3".into(),
        compute_capability: Some((9, 0)),
        driver_version: Some(13000),
        cudnn_version: Some(91900),
    })
}

fn problem(dtype: DType) -> ConvProblem {
    let mut problem = ConvProblem::new(16, 4, 6, 6, 4, 3, 3);
    problem.dtype = dtype;
    problem
}

fn counts(plans: &[Plan; 3]) -> [usize; 3] {
    plans.each_ref().map(|p| p.micro_batches.len())
}

#[test]
fn bf16_backward_filter_splits_at_most_four_ways_on_cudnn() {
    let cache = Cache::in_memory();
    let mut cudnn = gpu(BackendKind::Cuda);
    let plans = tuning()
        .tune(&mut cudnn, &cache, "l", &problem(DType::Bf16))
        .unwrap();
    // fwd, bwd_data, bwd_filter: only the weight gradient is limited.
    assert_eq!(counts(&plans), [16, 16, 4]);
    assert!(plans[2].micro_batches.iter().all(|mb| mb.size == 4));
    // fp16 stays within PyTorch's error at every measured k: no limit.
    let plans = tuning()
        .tune(&mut cudnn, &cache, "l", &problem(DType::Fp16))
        .unwrap();
    assert_eq!(counts(&plans), [16, 16, 16]);
}

#[test]
fn the_cpu_backend_sums_in_fp32_and_keeps_every_split() {
    let cache = Cache::in_memory();
    let mut cpu = gpu(BackendKind::Cpu);
    let plans = tuning()
        .tune(&mut cpu, &cache, "l", &problem(DType::Bf16))
        .unwrap();
    assert_eq!(counts(&plans), [16, 16, 16]);
}

#[test]
fn a_bf16_backward_filter_plan_cached_before_the_rule_is_solved_again() {
    let cache = Cache::in_memory();
    let mut cudnn = gpu(BackendKind::Cuda);
    let problem = problem(DType::Bf16);
    tuning().tune(&mut cudnn, &cache, "l", &problem).unwrap();
    // What a tune before the rule stored: sixteen micro-batches of 1.
    let entry = OpProfile {
        layer: "l".into(),
        problem,
        op: ConvOp::BackwardFilter,
        split: mucudnn::solver::SplitDim::Batch,
        measurements: (1..=16)
            .map(|micro| Measurement {
                micro,
                algo: Algo::Legacy(0),
                time_ms: time_ms(micro),
                workspace_bytes: 0,
                verification: None,
            })
            .collect(),
        skipped: Vec::new(),
        rejected: Vec::new(),
    };
    let old = solve_wr(&entry, Policy::All, LIMIT).unwrap();
    assert_eq!(old.micro_batches.len(), 16);
    let mut key = PlanKey::reuse(Policy::All, CandidateSet::Legacy, LIMIT);
    key.context = tuning().plan_context(&problem);
    cache.store_plan(&cudnn.0, &old, &key);
    assert_eq!(
        cache.plan(&cudnn.0, &problem, ConvOp::BackwardFilter, &key),
        Some(old),
        "the old plan is in the cache"
    );
    let (plans, stats) = tuning()
        .tune_counted(&mut cudnn, &cache, "l", &problem)
        .unwrap();
    assert_eq!(counts(&plans), [16, 16, 4]);
    assert_eq!(stats.measured, 0, "the measurements are reused");
    assert!(stats.cached > 0, "the plans were solved again, not read");
    // The new plan replaced the old one: the next tune reads it.
    let (again, stats) = tuning()
        .tune_counted(&mut cudnn, &cache, "l", &problem)
        .unwrap();
    assert_eq!((stats.cached, stats.measured), (0, 0));
    assert_eq!(again, plans);
}
