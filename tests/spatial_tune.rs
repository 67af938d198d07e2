//! Splits on the CPU backend: the tuner's `split` setting (`batch`, `spatial`, `auto`), spatial
//! plans solved from chunk measurements and executed by `execute_cpu`, equal to the unsplit op.

use mucudnn::backend::cpu::{self, AlignedWorkspace, CpuAlgo};
use mucudnn::backend::{
    Backend, BackendError, CpuBackend, MeasureSettings, Measured, MemoryUse, TimingSettings,
};
use mucudnn::cache::Cache;
use mucudnn::device::DeviceFingerprint;
use mucudnn::exec::{cpu_workspace_bytes, execute_cpu};
use mucudnn::solver::{
    CandidateSet, ConvOp, ConvProblem, IndexLimit, Layout, MeasureKey, Plan, Policy, SplitDim,
};
use mucudnn::tune::{EngineOptions, LayerTuning, SplitSetting};

const FAST: TimingSettings = TimingSettings {
    warmup: 0,
    loops: 1,
    iterations: 1,
    long_call_ms: 1.0,
};

/// Batch 1, 3x3 with padding 1: the batched im2col of the whole image needs 20,736 bytes
/// (4 channels x 9 taps x 144 outputs x 4 bytes), 1,728 per output row.
fn problem(n: i64) -> ConvProblem {
    let mut p = ConvProblem::new(n, 4, 12, 12, 4, 3, 3);
    (p.pad_h, p.pad_w) = (1, 1);
    p
}

/// Room for the im2col of 4 output rows, not of the whole image.
const LIMIT: u64 = 4 * 1728;

/// The real CPU backend (real workspaces, real chunks) with each time replaced by a
/// deterministic one: the share of the op's work the size does, faster with more workspace,
/// plus a fixed cost per call. So splitting pays exactly when it buys a faster algorithm.
struct Scripted {
    inner: CpuBackend,
    spatial_calls: usize,
}

impl Scripted {
    fn new() -> Self {
        Scripted {
            inner: CpuBackend::new(),
            spatial_calls: 0,
        }
    }

    fn script(found: &mut Measured, share: impl Fn(i64) -> f64) {
        for m in &mut found.measurements {
            m.time_ms = share(m.micro) / (1.0 + m.workspace_bytes as f64 / 1024.0) + 0.01;
        }
    }
}

impl Backend for Scripted {
    fn fingerprint(&self) -> &DeviceFingerprint {
        self.inner.fingerprint()
    }

    fn supports(&self, key: &MeasureKey) -> bool {
        self.inner.supports(key)
    }

    fn measure(
        &mut self,
        key: &MeasureKey,
        how: &MeasureSettings,
    ) -> Result<Measured, BackendError> {
        if key.split == SplitDim::Spatial {
            self.spatial_calls += 1;
        }
        let mut found = self.inner.measure(key, how)?;
        let extent = key.extent() as f64;
        Self::script(&mut found, |s| s as f64 / extent);
        Ok(found)
    }

    fn release(&mut self) {
        self.inner.release();
    }

    fn memory(&self) -> MemoryUse {
        self.inner.memory()
    }
}

fn tuning(split: SplitSetting, limit: u64) -> LayerTuning {
    LayerTuning {
        policy: Policy::All,
        workspace_limit_bytes: limit,
        timing: FAST,
        candidates: CandidateSet::Legacy,
        engines: EngineOptions::default(),
        split,
        index_limit: IndexLimit::CUDNN,
        verify: true,
    }
}

fn data(len: usize, seed: u32) -> Vec<f32> {
    (0..len)
        .map(|i| {
            let v = (i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8;
            (v % 2001) as f32 / 1000.0 - 1.0
        })
        .collect()
}

/// `plan` executed by `execute_cpu` against the unsplit op run with each of the plan's
/// algorithms, with `beta = 0.5` over a non-zero output: for forward and backward-data every
/// element equals bit for bit the unsplit op of one of the plan's algorithms (the chunk's);
/// backward-filter (a sum over chunks) within rounding of each.
fn check_against_unsplit(plan: &Plan) {
    let p = &plan.problem;
    let [(_, la), (_, lb), (_, lo)] = cpu::buffer_lens(p, plan.op).unwrap();
    let (a, b) = (data(la, 1), data(lb, 2));
    let start = data(lo, 3);
    let mut got = start.clone();
    let mut ws = AlignedWorkspace::new(cpu_workspace_bytes(plan));
    execute_cpu(plan, 1.0, &a, &b, 0.5, &mut got, ws.as_bytes_mut()).unwrap();
    let mut algos: Vec<CpuAlgo> = plan
        .micro_batches
        .iter()
        .map(|mb| CpuAlgo::from_id(mb.algo.legacy().unwrap()).unwrap())
        .collect();
    algos.dedup();
    let unsplit: Vec<Vec<f32>> = algos
        .iter()
        .map(|&algo| {
            let mut out = start.clone();
            let mut ws = AlignedWorkspace::new(cpu::workspace_bytes(p, plan.op, algo));
            cpu::run(
                p,
                plan.op,
                algo,
                1.0,
                &a,
                &b,
                0.5,
                &mut out,
                ws.as_bytes_mut(),
            )
            .unwrap();
            out
        })
        .collect();
    for (i, g) in got.iter().enumerate() {
        let matches = unsplit.iter().any(|e| {
            if plan.op == ConvOp::BackwardFilter {
                (g - e[i]).abs() <= 1e-4 * (1.0 + e[i].abs())
            } else {
                g.to_bits() == e[i].to_bits()
            }
        });
        assert!(
            matches,
            "{} [{i}]: {g} vs {:?}",
            plan.op,
            unsplit.iter().map(|e| e[i]).collect::<Vec<_>>()
        );
    }
}

#[test]
fn forced_spatial_plans_fit_the_limit_and_equal_the_unsplit_op() {
    let problem = problem(1);
    let cache = Cache::in_memory();
    // Scripted times (im2col faster than direct): the chunks must be small to fit.
    let plans = tuning(SplitSetting::Spatial, LIMIT)
        .tune(&mut Scripted::new(), &cache, "toy", &problem)
        .unwrap();
    for plan in &plans {
        assert_eq!(plan.split, SplitDim::Spatial, "{}", plan.op);
        assert!(plan.micro_batches.len() >= 3, "{plan:?}");
        assert_eq!(plan.extent(), 12, "{}", plan.op);
        assert!(plan.workspace_bytes() <= LIMIT, "{}", plan.op);
        check_against_unsplit(plan);
    }
}

#[test]
fn auto_splits_along_h_at_batch_1_when_the_limit_excludes_the_faster_algorithm() {
    let problem = problem(1);
    let cache = Cache::in_memory();
    let mut backend = Scripted::new();
    let plans = tuning(SplitSetting::Auto, LIMIT)
        .tune(&mut backend, &cache, "toy", &problem)
        .unwrap();
    assert!(backend.spatial_calls > 0);
    let forward = &plans[0];
    assert_eq!(forward.split, SplitDim::Spatial, "{forward:?}");
    assert!(forward.micro_batches.len() >= 3, "{forward:?}");
    assert!(forward.workspace_bytes() <= LIMIT);
    let names = mucudnn::solver::AlgoNames::new(mucudnn::solver::BackendKind::Cpu);
    assert!(
        forward.split_string(names).ends_with("along h"),
        "{}",
        forward.split_string(names)
    );
    for plan in &plans {
        check_against_unsplit(plan);
    }
    // The same tuning again: the plans come from the cache, nothing is measured.
    let mut again = Scripted::new();
    let (cached, stats) = tuning(SplitSetting::Auto, LIMIT)
        .tune_counted(&mut again, &cache, "toy", &problem)
        .unwrap();
    assert_eq!(cached, plans);
    assert_eq!((stats.measured, again.spatial_calls), (0, 0));
    // `batch` is keyed apart: it gets a batch plan, not the cached spatial one.
    let batch = tuning(SplitSetting::Batch, LIMIT)
        .tune(&mut Scripted::new(), &cache, "toy", &problem)
        .unwrap();
    assert!(batch.iter().all(|p| p.split == SplitDim::Batch));
}

#[test]
fn auto_does_not_measure_chunks_without_workspace_pressure_or_at_a_large_batch() {
    // Every candidate fits: nothing to gain from chunks.
    let mut backend = Scripted::new();
    let plans = tuning(SplitSetting::Auto, 1 << 30)
        .tune(&mut backend, &Cache::in_memory(), "toy", &problem(1))
        .unwrap();
    assert_eq!(backend.spatial_calls, 0);
    assert!(plans.iter().all(|p| p.split == SplitDim::Batch));
    // Batch 8 under the same pressure: micro-batches only.
    let mut backend = Scripted::new();
    let plans = tuning(SplitSetting::Auto, LIMIT)
        .tune(&mut backend, &Cache::in_memory(), "toy", &problem(8))
        .unwrap();
    assert_eq!(backend.spatial_calls, 0);
    assert!(plans.iter().all(|p| p.split == SplitDim::Batch));
}

/// A backend that cannot time chunks: `auto` keeps its batch plans, `spatial` says why.
struct BatchOnly(CpuBackend);

impl Backend for BatchOnly {
    fn fingerprint(&self) -> &DeviceFingerprint {
        self.0.fingerprint()
    }

    fn measure(
        &mut self,
        key: &MeasureKey,
        how: &MeasureSettings,
    ) -> Result<Measured, BackendError> {
        self.0.measure(key, how)
    }
}

#[test]
fn a_backend_without_chunks_leaves_auto_with_batch_plans_and_refuses_spatial() {
    let problem = problem(1);
    let plans = tuning(SplitSetting::Auto, LIMIT)
        .tune(
            &mut BatchOnly(CpuBackend::new()),
            &Cache::in_memory(),
            "toy",
            &problem,
        )
        .unwrap();
    assert!(plans.iter().all(|p| p.split == SplitDim::Batch));
    let error = tuning(SplitSetting::Spatial, LIMIT)
        .tune(
            &mut BatchOnly(CpuBackend::new()),
            &Cache::in_memory(),
            "toy",
            &problem,
        )
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("cannot time legacy candidates on spatial chunks"),
        "{error}"
    );
}

#[test]
fn split_settings_parse_and_name_themselves() {
    for setting in SplitSetting::ALL {
        assert_eq!(setting.name().parse::<SplitSetting>(), Ok(setting));
    }
    assert_eq!(SplitSetting::default(), SplitSetting::Auto);
    let error = "sideways".parse::<SplitSetting>().unwrap_err();
    assert!(error.contains("batch, spatial or auto"), "{error}");
}

/// The Rust drop-in layer with `split = spatial` (real CPU timings, so however many chunks win):
/// its plans at batch 1 are chunks along `h`,
/// and its forward and backward equal the same layer's with batch plans (each output element
/// of forward and backward-data is one call's, in both; the weight gradient within rounding).
#[test]
fn the_rust_layer_runs_spatial_plans() {
    use mucudnn::layer::{Conv2d, Tensor};
    let layer = |split| {
        Conv2d::new("toy.conv", 4, 4, 3)
            .with_padding(1)
            .with_stride(2)
            .with_tuning(LayerTuning {
                policy: Policy::All,
                ..tuning(split, LIMIT)
            })
            .with_cache(Cache::in_memory())
    };
    let mut x = Tensor::zeros([1, 4, 13, 11], Layout::Nchw);
    x.data = data(x.data.len(), 5);
    let mut spatial = layer(SplitSetting::Spatial);
    let mut batch = layer(SplitSetting::Batch);
    let y = spatial.forward(&x).unwrap();
    let y_batch = batch.forward(&x).unwrap();
    let plans = spatial.plans(1, 13, 11).unwrap();
    assert!(plans.iter().all(|p| p.split == SplitDim::Spatial));
    assert!(batch
        .plans(1, 13, 11)
        .unwrap()
        .iter()
        .all(|p| p.split == SplitDim::Batch));
    let close = |a: &[f32], b: &[f32], what: &str| {
        assert_eq!(a.len(), b.len());
        for (i, (u, v)) in a.iter().zip(b).enumerate() {
            assert!(
                (u - v).abs() <= 1e-5 * (1.0 + v.abs()),
                "{what}[{i}]: {u} vs {v}"
            );
        }
    };
    close(&y.data, &y_batch.data, "y");
    let mut dy = y.clone();
    dy.data = data(dy.data.len(), 6);
    let g = spatial.backward(&x, &dy).unwrap();
    let g_batch = batch.backward(&x, &dy).unwrap();
    close(&g.input.data, &g_batch.input.data, "dx");
    close(&g.weight, &g_batch.weight, "dw");
}

/// A tuning whose calls may reach at most `elements` elements: cuDNN's 2^31 - 1 scaled down to
/// a toy problem, so that plans split it as they split a tensor past 2^31 elements.
fn under(elements: i64, split: SplitSetting) -> LayerTuning {
    LayerTuning {
        policy: Policy::PowerOfTwo,
        index_limit: IndexLimit::new(elements).unwrap(),
        ..tuning(split, 1 << 30)
    }
}

/// Each call of `plan` reaches at most `limit` elements, wherever its chunks lie.
fn assert_within(plan: &Plan, limit: IndexLimit) {
    for mb in &plan.micro_batches {
        assert!(
            limit.fits(&plan.problem, plan.op, plan.split, mb.size),
            "{} {:?}",
            plan.op,
            plan.micro_batches
        );
    }
}

/// More than a call may hold: at batch 5 (576 elements of x and y a sample) under a limit of
/// 1,200 the plans take at most 2 samples a call, and compute what the unsplit op does.
#[test]
fn a_batch_past_the_index_limit_runs_as_micro_batches_that_fit() {
    let limit = IndexLimit::new(1200).unwrap();
    for split in [SplitSetting::Batch, SplitSetting::Auto] {
        let plans = under(1200, split)
            .tune(
                &mut CpuBackend::new(),
                &Cache::in_memory(),
                "big",
                &problem(5),
            )
            .unwrap();
        for plan in &plans {
            assert_eq!(plan.split, SplitDim::Batch);
            assert_eq!(plan.extent(), 5);
            assert!(plan.micro_batches.iter().all(|mb| mb.size <= 2), "{plan:?}");
            assert_within(plan, limit);
            check_against_unsplit(plan);
        }
    }
    // Policy undivided cannot: it says so, naming the most that fits.
    let error = LayerTuning {
        policy: Policy::Undivided,
        ..under(1200, SplitSetting::Batch)
    }
    .tune(
        &mut CpuBackend::new(),
        &Cache::in_memory(),
        "big",
        &problem(5),
    )
    .unwrap_err()
    .to_string();
    assert!(
        error.starts_with("big: fwd batch split: policy undivided"),
        "{error}"
    );
    assert!(error.contains("at most 2 fit in one call"), "{error}");
}

/// One sample past the limit at batch 1: channels-last, `auto` splits its rows (a row of
/// x is 48 elements; a chunk of 4 output rows reads 6, 288 elements) and the chunks compute
/// what the unsplit op does; channels-first a chunk's view spans every channel, so nothing
/// fits and the error says why.
#[test]
fn a_sample_past_the_index_limit_runs_as_chunks_channels_last_and_is_refused_channels_first() {
    let limit = IndexLimit::new(300).unwrap();
    let last = ConvProblem {
        layout: Layout::Nhwc,
        ..problem(1)
    };
    for split in [SplitSetting::Auto, SplitSetting::Spatial] {
        let plans = under(300, split)
            .tune(&mut CpuBackend::new(), &Cache::in_memory(), "wide", &last)
            .unwrap();
        for plan in &plans {
            assert_eq!(plan.split, SplitDim::Spatial, "{}", plan.op);
            assert!(plan.micro_batches.iter().all(|mb| mb.size <= 4), "{plan:?}");
            assert_within(plan, limit);
            check_against_unsplit(plan);
        }
    }
    let error = under(300, SplitSetting::Batch)
        .tune(&mut CpuBackend::new(), &Cache::in_memory(), "wide", &last)
        .unwrap_err()
        .to_string();
    assert!(error.contains("a spatial split"), "{error}");
    let error = under(300, SplitSetting::Auto)
        .tune(
            &mut CpuBackend::new(),
            &Cache::in_memory(),
            "wide",
            &problem(1),
        )
        .unwrap_err();
    assert!(
        matches!(error, mucudnn::tune::TuneError::Indexing { .. }),
        "{error}"
    );
    let error = error.to_string();
    assert!(error.starts_with("wide: fwd spatial split"), "{error}");
    assert!(error.contains("channels-last"), "{error}");
}

/// The Rust layer under a lowered limit: its forward and backward run split plans and equal
/// the same layer's with cuDNN's limit (whole-batch calls).
#[test]
fn the_rust_layer_splits_a_batch_past_the_index_limit() {
    use mucudnn::layer::{Conv2d, Tensor};
    let layer = |tuning: LayerTuning| {
        Conv2d::new("big.conv", 4, 4, 3)
            .with_padding(1)
            .with_tuning(tuning)
            .with_cache(Cache::in_memory())
    };
    let mut split = layer(under(1200, SplitSetting::Auto));
    let mut whole = layer(tuning(SplitSetting::Batch, 1 << 30));
    let mut x = Tensor::zeros([5, 4, 12, 12], Layout::Nchw);
    x.data = data(x.data.len(), 7);
    let y = split.forward(&x).unwrap();
    let y_whole = whole.forward(&x).unwrap();
    let plans = split.plans(5, 12, 12).unwrap();
    assert!(plans
        .iter()
        .all(|p| p.micro_batches.iter().all(|mb| mb.size <= 2)));
    assert_eq!(y.data, y_whole.data);
    let mut dy = y.clone();
    dy.data = data(dy.data.len(), 8);
    let g = split.backward(&x, &dy).unwrap();
    let g_whole = whole.backward(&x, &dy).unwrap();
    assert_eq!(g.input.data, g_whole.input.data);
    for (u, v) in g.weight.iter().zip(&g_whole.weight) {
        assert!((u - v).abs() <= 1e-4 * (1.0 + v.abs()), "{u} vs {v}");
    }
}
