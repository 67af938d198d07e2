//! `mucudnn::candle::Conv2d`, `Conv1d` and `ConvTranspose2d` on candle's CUDA device (feature
//! `candle-cuda`): the checks of `tests/candle/checks.rs` and `tests/candle/layers.rs` on GPU
//! 0, and the training step time of a small CNN against the same CNN with candle's own
//! convolution (cuDNN when candle-core's `cudnn` feature is on, as
//! `scripts/gpu/candle_check.sh` builds it). Every test needs a GPU and is
//! `#[ignore = "needs a GPU: ..."]`; the GPU acceptance (`accept.sh candle`) runs them with
//! `--include-ignored`.

#[path = "candle/checks.rs"]
mod checks;
#[path = "candle/half.rs"]
mod half;
#[path = "candle/layers.rs"]
mod layers;

use candle_core::{DType, Device};
use candle_nn::{Optimizer, VarBuilder, VarMap};
use std::time::Instant;

/// GPU 0 (the tests are ignored unless asked for, so this runs only where a GPU is).
fn gpu() -> Device {
    Device::new_cuda(0).expect("CUDA device 0")
}

#[test]
#[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
fn cuda_forward_and_gradients_match_candle_conv2d() {
    checks::forward_and_gradients_match_candle_conv2d(&gpu());
}

#[test]
#[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
fn cuda_backward_matches_the_f64_reference_where_candle_gets_the_width_wrong() {
    checks::backward_matches_the_f64_reference_where_candle_gets_the_width_wrong(&gpu());
}

#[test]
#[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
fn cuda_each_shape_is_tuned_once_and_a_second_layer_reads_the_shared_cache() {
    checks::each_shape_is_tuned_once_and_a_second_layer_reads_the_shared_cache(&gpu());
}

#[test]
#[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
fn cuda_errors_are_values_that_name_the_layer() {
    checks::errors_are_values_that_name_the_layer(&gpu());
}

#[test]
#[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
fn cuda_a_small_cnn_trains_and_its_sgd_step_matches_candle_convs() {
    checks::a_small_cnn_trains_and_its_sgd_step_matches_candle_convs(&gpu());
}

#[test]
#[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
fn cuda_conv1d_forward_and_gradients_match_candle_conv1d() {
    layers::conv1d_matches_candle_conv1d(&gpu());
}

#[test]
#[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
fn cuda_conv_transpose2d_forward_and_gradients_match_candle_conv_transpose2d() {
    layers::conv_transpose2d_matches_candle_conv_transpose2d(&gpu());
}

#[test]
#[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
fn cuda_conv_transpose2d_shares_plans_with_its_convolution() {
    layers::conv_transpose2d_shares_plans_with_its_convolution(&gpu());
}

#[test]
#[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
fn cuda_conv1d_and_conv_transpose2d_load_candle_nn_variables_and_train_alike() {
    layers::var_builder_drop_ins_match_candle_nn(&gpu());
}

#[test]
#[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
fn cuda_conv1d_and_conv_transpose2d_errors_are_values_that_name_the_layer() {
    layers::errors_are_values_that_name_the_layer(&gpu());
}

/// Median training-step time (forward, backward, SGD) of the checks' CNN, mucudnn's layers
/// against candle's, on the same batch; printed, not asserted (timings vary by GPU).
#[test]
#[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
fn cuda_step_time_against_candle_conv() {
    let dev = gpu();
    let cache = checks::shared_cache();
    let mut report = Vec::new();
    for (label, ours) in [("candle conv2d", None), ("mucudnn conv2d", Some(&cache))] {
        let vm = VarMap::new();
        let net = checks::Cnn::new(VarBuilder::from_varmap(&vm, DType::F32, &dev), ours).unwrap();
        let mut sgd = candle_nn::SGD::new(vm.all_vars(), 0.01).unwrap();
        let (x, labels) = checks::batch(7, &dev).unwrap();
        let mut times = Vec::new();
        for step in 0..25 {
            dev.synchronize().unwrap();
            let start = Instant::now();
            let loss = net.loss(&x, &labels).unwrap();
            sgd.backward_step(&loss).unwrap();
            dev.synchronize().unwrap();
            // The first steps tune (mucudnn) or warm up (both).
            if step >= 5 {
                times.push(start.elapsed().as_secs_f64() * 1e3);
            }
        }
        times.sort_by(f64::total_cmp);
        report.push(format!(
            "{label}: median step {:.3} ms",
            times[times.len() / 2]
        ));
    }
    eprintln!(
        "step time, checks' CNN (8 x 3 x 9 x 9): {}",
        report.join("; ")
    );
}

#[test]
#[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
fn cuda_conv2d_in_f16_and_bf16_matches_candle_conv2d_in_f32() {
    half::conv2d_half_matches_candle_conv2d_in_f32(&gpu());
}

#[test]
#[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
fn cuda_conv1d_and_conv_transpose2d_in_bf16_match_f32() {
    half::conv1d_and_conv_transpose2d_in_bf16_match_f32(&gpu());
}

#[test]
#[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
fn cuda_each_dtype_is_its_own_problem() {
    half::each_dtype_is_its_own_problem(&gpu());
}

#[test]
#[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
fn cuda_mixed_dtypes_are_errors_that_name_the_layer() {
    half::mixed_dtypes_are_errors_that_name_the_layer(&gpu());
}

/// `mucudnn::candle::nccl` with one rank (the GPU machine may have one GPU; the job's several
/// ranks are `scripts/gpu/candle_ddp_check.sh`'s): the all-reduce runs on candle's stream
/// and its result, scaled, has the host sum's bits; a tensor on another device is refused.
#[test]
#[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
fn cuda_nccl_sum_of_one_rank_is_its_vector_scaled_as_the_host_does() {
    use candle_core::Tensor;
    use mucudnn::candle::ddp::{sum_in_rank_order, SingleProcess};
    use mucudnn::candle::nccl::NcclGradSum;
    let device = gpu();
    let Device::Cuda(cuda) = &device else {
        unreachable!("Device::new_cuda gave another device")
    };
    let timeout = std::time::Duration::from_secs(60);
    let nccl = NcclGradSum::new(&mut SingleProcess, cuda, timeout).expect("one-rank NCCL");
    assert_eq!((nccl.rank(), nccl.size()), (0, 1));
    let values: Vec<f32> = (0..4099).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
    let scale = 1.0 / 96.0;
    let expected = sum_in_rank_order(
        &mut SingleProcess,
        std::slice::from_ref(&values),
        values.len(),
        scale,
    )
    .unwrap();
    for _ in 0..3 {
        let flat = Tensor::new(values.as_slice(), &device).unwrap();
        let summed = nccl.sum_scaled(&flat, scale).unwrap();
        assert!(summed.device().is_cuda());
        let summed = summed.to_vec1::<f32>().unwrap();
        assert_eq!(
            summed.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            expected.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
    }
    let on_cpu = Tensor::new(values.as_slice(), &Device::Cpu).unwrap();
    assert!(nccl.sum_scaled(&on_cpu, scale).is_err());
    nccl.finish().expect("finalize and destroy");
}
