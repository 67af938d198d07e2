//! `mucudnn::candle::Conv2d` on candle's CPU device (feature `candle`; in CI): the checks of
//! `tests/candle/checks.rs`.

#[path = "candle/checks.rs"]
mod checks;

use candle_core::Device;

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
