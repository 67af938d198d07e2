//! `mucudnn::candle::Conv2d` on candle's CPU device (feature `candle`; in CI): the checks of
//! `tests/candle/checks.rs`.

#[path = "candle/checks.rs"]
mod checks;

use candle_core::Device;
use mucudnn::backend::cpu::{self, CpuAlgo};
use mucudnn::backend::{Backend, CpuBackend};
use mucudnn::candle::{ConvOptions, ShapeKey, SharedCache};
use mucudnn::solver::{Algo, AlgoKind, ConvOp, ConvProblem, Measurement, Plan, Policy};
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
            let measurement = Measurement {
                micro: m,
                algo: Algo::Legacy(algo.id()),
                time_ms: 1.0 + ((m - 2) * (m - 2)) as f64,
                workspace_bytes: cpu::workspace_bytes(&at, op, algo),
            };
            cache.store_measurements(
                &device,
                "seeded",
                problem,
                op,
                m,
                AlgoKind::Legacy,
                &[measurement],
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
