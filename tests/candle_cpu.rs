//! `mucudnn::candle::Conv2d` on candle's CPU device (feature `candle`; in CI): the checks of
//! `tests/candle/checks.rs`.

#[path = "candle/checks.rs"]
mod checks;

use candle_core::Device;
use mucudnn::backend::cpu::{self, CpuAlgo};
use mucudnn::backend::{Backend, CpuBackend};
use mucudnn::candle::{ConvOptions, ShapeKey, SharedCache};
use mucudnn::solver::{
    Algo, AlgoKind, ConvOp, ConvProblem, MeasureKey, Measured, Measurement, Plan, Policy,
    SizeVerification,
};
use mucudnn::tune::CacheStats;

#[test]
fn forward_and_gradients_match_candle_conv2d() {
    checks::forward_and_gradients_match_candle_conv2d(&Device::Cpu);
}

/// Input 9x8, k = 3, stride 2, padding 1: candle's own backward gives a 9x7 input gradient.
#[test]
fn backward_matches_the_f64_reference_where_candle_gets_the_width_wrong() {
    checks::backward_matches_the_f64_reference_where_candle_gets_the_width_wrong(&Device::Cpu);
}

#[test]
fn each_shape_is_tuned_once_and_a_second_layer_reads_the_shared_cache() {
    checks::each_shape_is_tuned_once_and_a_second_layer_reads_the_shared_cache(&Device::Cpu);
}

#[test]
fn errors_are_values_that_name_the_layer() {
    checks::errors_are_values_that_name_the_layer(&Device::Cpu);
}

#[test]
fn a_small_cnn_trains_and_its_sgd_step_matches_candle_convs() {
    checks::a_small_cnn_trains_and_its_sgd_step_matches_candle_convs(&Device::Cpu);
}

// ---------------------------------------------------------------------------------------------
// Conv1d and ConvTranspose2d: the checks of `tests/candle/layers.rs`, and micro-batched plans.

#[path = "candle/layers.rs"]
mod layers;

#[test]
fn conv1d_forward_and_gradients_match_candle_conv1d() {
    layers::conv1d_matches_candle_conv1d(&Device::Cpu);
}

#[test]
fn conv_transpose2d_forward_and_gradients_match_candle_conv_transpose2d() {
    layers::conv_transpose2d_matches_candle_conv_transpose2d(&Device::Cpu);
}

#[test]
fn conv_transpose2d_shares_plans_with_its_convolution() {
    layers::conv_transpose2d_shares_plans_with_its_convolution(&Device::Cpu);
}

#[test]
fn conv1d_and_conv_transpose2d_load_candle_nn_variables_and_train_alike() {
    layers::var_builder_drop_ins_match_candle_nn(&Device::Cpu);
}

#[test]
fn conv1d_and_conv_transpose2d_errors_are_values_that_name_the_layer() {
    layers::errors_are_values_that_name_the_layer(&Device::Cpu);
}

/// candle 0.11.1's conv1d weight gradient for a batch (see `layers::PerSample`): printed.
#[test]
fn conv1d_weight_gradient_matches_the_reference_where_candle_batches_it_wrong() {
    layers::candle_conv1d_weight_gradient_of_a_batch(&Device::Cpu);
}

/// Seeds `cache` with measurements of `problem` on this CPU for all three ops at every size up
/// to its batch, where micro-batches of 2 and 3 are the fastest (1 + (m - 2)² ms; im2col at
/// even sizes, direct at odd ones), so that a layer under `Policy::All` reads them, measures
/// nothing and solves a split plan.
fn seed_split_measurements(cache: &SharedCache, problem: &ConvProblem) {
    let device = CpuBackend::new().fingerprint().clone();
    let cache = cache.lock().unwrap();
    for op in ConvOp::ALL {
        for m in 1..=problem.n {
            let algo = if m % 2 == 0 {
                CpuAlgo::Im2colGemm
            } else {
                CpuAlgo::Direct
            };
            let at = ConvProblem { n: m, ..*problem };
            let measurement = Measurement::new(
                m,
                Algo::Legacy(algo.id()),
                1.0 + ((m - 2) * (m - 2)) as f64,
                cpu::workspace_bytes(&at, op, algo),
            );
            // As a verifying tune stores a size (a tune would otherwise measure it again).
            let measured = Measured {
                measurements: vec![measurement],
                verification: SizeVerification::Verified,
                ..Measured::default()
            };
            cache.store_size(
                &device,
                "seeded",
                &MeasureKey::batch(*problem, op, m, AlgoKind::Legacy),
                &measured,
            );
        }
    }
}

/// Every plan splits the batch, and the layer measured nothing (it read the seeded cache).
fn assert_split(what: &str, plans: Option<[Plan; 3]>, tunings: &[(ShapeKey, CacheStats)]) {
    let plans = plans.expect("tuned");
    for plan in &plans {
        assert!(
            plan.micro_batches.len() > 1,
            "{what} {}: {:?}",
            plan.op,
            plan.micro_batches
        );
    }
    assert_eq!(tunings.len(), 1);
    assert_eq!(tunings[0].1.measured, 0, "{what}: {tunings:?}");
}

/// A micro-batched plan (2 + 3 samples, two algorithms) gives the undivided run's outputs and
/// gradients, for both layers and all three ops.
#[test]
fn micro_batched_plans_equal_the_undivided_run() {
    let dev = Device::Cpu;
    let undivided = || {
        ConvOptions::default()
            .with_policy(Policy::Undivided)
            .with_cache(checks::shared_cache())
    };
    let seeded = |problem: &ConvProblem| {
        let cache = checks::shared_cache();
        seed_split_measurements(&cache, problem);
        ConvOptions::default()
            .with_policy(Policy::All)
            .with_cache(cache)
    };

    let case = layers::Case1d {
        name: "split",
        n: 5,
        ..layers::CASES_1D[5]
    };
    let (split, layer) = case.run_ours(&dev, seeded(&case.problem()));
    assert_split(
        "conv1d",
        layer.cpu_plans(5, case.l as i64).unwrap(),
        &layer.tunings().unwrap(),
    );
    let (whole, layer) = case.run_ours(&dev, undivided());
    let plans = layer.cpu_plans(5, case.l as i64).unwrap().expect("tuned");
    assert!(plans.iter().all(|p| p.micro_batches.len() == 1));
    split.assert_within(&whole, "conv1d split vs undivided", 1e-6);
    split.assert_within(&case.run(&dev, None), "conv1d split vs candle", 1e-4);

    let case = layers::CaseT {
        name: "split",
        n: 5,
        ..layers::CASES_T[3]
    };
    let (split, layer) = case.run_ours(&dev, seeded(&case.problem()));
    let (n, h, w) = (5, case.h as i64, case.w as i64);
    assert_split(
        "conv_transpose2d",
        layer.cpu_plans(n, h, w).unwrap(),
        &layer.tunings().unwrap(),
    );
    let (whole, layer) = case.run_ours(&dev, undivided());
    let plans = layer.cpu_plans(n, h, w).unwrap().expect("tuned");
    assert!(plans.iter().all(|p| p.micro_batches.len() == 1));
    split.assert_within(&whole, "conv_transpose2d split vs undivided", 1e-6);
    split.assert_within(
        &case.run(&dev, None),
        "conv_transpose2d split vs candle",
        1e-4,
    );
}

// ---------------------------------------------------------------------------------------------
// f16 and bf16: the checks of `tests/candle/half.rs`, and a micro-batched bf16 weight gradient.

#[path = "candle/half.rs"]
mod half;

#[test]
fn conv2d_in_f16_and_bf16_matches_candle_conv2d_in_f32() {
    half::conv2d_half_matches_candle_conv2d_in_f32(&Device::Cpu);
}

#[test]
fn conv1d_and_conv_transpose2d_in_bf16_match_f32() {
    half::conv1d_and_conv_transpose2d_in_bf16_match_f32(&Device::Cpu);
}

#[test]
fn each_dtype_is_its_own_problem() {
    half::each_dtype_is_its_own_problem(&Device::Cpu);
}

#[test]
fn mixed_dtypes_are_errors_that_name_the_layer() {
    half::mixed_dtypes_are_errors_that_name_the_layer(&Device::Cpu);
}

/// A bf16 `Conv2d` whose plans split a batch of 6 as 2 + 2 + 2 (a seeded cache): each
/// micro-batch's weight gradient is written in bf16, the parts are summed in f32 and `dw` is
/// rounded once (the executor's `HalfSum`), not once per micro-batch through beta = 1. Checked
/// against both models computed here from the f64 parts: `dw` is the first wherever they
/// differ (and within rounding of the f32 parts everywhere).
#[test]
fn bf16_weight_gradient_of_a_split_plan_is_summed_in_f32() {
    use candle_core::{DType, Module, Tensor, Var};
    use mucudnn::backend::cpu::reference::conv_f64;
    use mucudnn::candle::Conv2d;

    let dev = Device::Cpu;
    let (n, c, h, w, k) = (6, 8, 6, 6, 4);
    let bf16 = |dims: &[usize], seed| {
        checks::tensor(dims, seed, &dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap()
    };
    let weight = Var::from_tensor(&bf16(&[k, c, 3, 3], 2)).unwrap();
    let cfg = candle_nn::Conv2dConfig {
        padding: 1,
        ..Default::default()
    };
    let cache = checks::shared_cache();
    let probe = Conv2d::new(
        weight.as_tensor().clone(),
        None,
        cfg,
        ConvOptions::default(),
    )
    .unwrap()
    .problem(n, h, w)
    .unwrap();
    assert_eq!(probe.dtype, mucudnn::solver::DType::Bf16);
    seed_split_measurements(&cache, &probe);
    let layer = Conv2d::new(
        weight.as_tensor().clone(),
        None,
        cfg,
        ConvOptions::default()
            .with_policy(Policy::All)
            .with_cache(cache),
    )
    .unwrap();
    let x = bf16(&[n, c, h, w], 1);
    let y = layer.forward(&x).unwrap();
    // The output gradient: r rounded to bf16 (exact through the f32 cast's backward).
    let r = bf16(y.dims(), 4).to_dtype(DType::F32).unwrap();
    let loss = (y.to_dtype(DType::F32).unwrap() * &r)
        .unwrap()
        .sum_all()
        .unwrap();
    let dw = loss.backward().unwrap();
    let dw = half::flat_f32(dw.get(weight.as_tensor()).expect("a weight gradient"));
    let plans = layer.cpu_plans(n as i64, h as i64, w as i64).unwrap();
    assert_split("bf16 conv2d", plans.clone(), &layer.tunings().unwrap());
    let filter_plan = &plans.expect("tuned")[2];
    assert_eq!(filter_plan.op, ConvOp::BackwardFilter);
    let micro: Vec<i64> = filter_plan.micro_batches.iter().map(|m| m.size).collect();
    assert_eq!(micro, [2, 2, 2]);

    // Each micro-batch's part in f64, rounded to bf16 as the kernels write it.
    let f64s = |t: &Tensor| -> Vec<f64> { half::flat_f32(t).into_iter().map(f64::from).collect() };
    let (xs, rs) = (f64s(&x), f64s(&r));
    let round = |v: f32| ::half::bf16::from_f32(v).to_f32();
    let (image, plane) = (c * h * w, k * h * w);
    let mut start = 0;
    let mut parts = Vec::new();
    for &m in &micro {
        let m = m as usize;
        let part = ConvProblem {
            n: m as i64,
            ..probe
        };
        let values = conv_f64(
            &part,
            ConvOp::BackwardFilter,
            &xs[start * image..(start + m) * image],
            &rs[start * plane..(start + m) * plane],
        )
        .unwrap();
        parts.push(
            values
                .into_iter()
                .map(|v| round(v as f32))
                .collect::<Vec<f32>>(),
        );
        start += m;
    }
    // Summed in f32, rounded once; and the running sum rounded after every micro-batch.
    let once: Vec<f32> = (0..dw.len())
        .map(|i| round(parts.iter().map(|p| p[i]).sum::<f32>()))
        .collect();
    let running: Vec<f32> = (0..dw.len())
        .map(|i| parts.iter().fold(0f32, |s, p| round(s + p[i])))
        .collect();
    let differing: Vec<usize> = (0..dw.len()).filter(|&i| once[i] != running[i]).collect();
    assert!(
        !differing.is_empty(),
        "the data do not tell the two summations apart"
    );
    for &i in &differing {
        assert_eq!(
            dw[i], once[i],
            "dw[{i}]: rounded once would be {}, once per micro-batch {}",
            once[i], running[i]
        );
    }
    // Elsewhere within a bf16 ulp of the model (its parts are f64 rounded, the kernels' f32).
    for (i, (&got, &want)) in dw.iter().zip(&once).enumerate() {
        let ulp = 2f32.powi(want.abs().max(1e-30).log2().floor() as i32 - 7);
        assert!(
            (got - want).abs() <= ulp,
            "dw[{i}] = {got}, the model {want}"
        );
    }
    eprintln!(
        "bf16 dw of 2 + 2 + 2: {} of {} elements tell the summations apart; dw agrees with \
         rounding once there, {} elements differ from it by an ulp elsewhere",
        differing.len(),
        dw.len(),
        dw.iter().zip(&once).filter(|(a, b)| a != b).count()
    );
}
