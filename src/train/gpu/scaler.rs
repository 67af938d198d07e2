//! fp16 dynamic loss scaling with the semantics of `torch.amp.GradScaler`: the decisions only,
//! pure and tested on the host. The replica does the device part: it scales the fp16 part of
//! the backward pass by [`LossScaler::scale`], unscales the gradients into fp32, all-reduces
//! them, checks on the device that they are finite (one reduction of the flat gradient, read
//! on the host), and asks [`LossScaler::update`] whether to apply the step.
//!
//! - A step whose gradients hold an inf or a NaN is skipped (no update, momentum untouched)
//!   and the scale is halved (`backoff_factor` 0.5).
//! - After `growth_interval` (2000) clean steps in a row the scale doubles (`growth_factor`
//!   2), unless that would overflow f32.
//! - The initial scale is 2^16, as GradScaler's.
//!
//! Every rank sees the same all-reduced gradients, so every rank makes the same decision and
//! the replicas stay identical without exchanging anything.

#![forbid(unsafe_code)]

/// What to do with one step's gradients.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleDecision {
    /// The gradients are finite: update the weights.
    Apply,
    /// A gradient is inf or NaN: skip the update (the scale was halved).
    Skip,
}

/// The loss scale and its history (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossScaler {
    scale: f32,
    growth_factor: f32,
    backoff_factor: f32,
    growth_interval: u32,
    /// Clean steps since the scale last changed.
    clean_steps: u32,
    skipped: usize,
}

impl LossScaler {
    /// `torch.amp.GradScaler`'s defaults: initial scale 2^16.
    pub const INITIAL_SCALE: f32 = 65536.0;
    /// Clean steps before the scale doubles.
    pub const GROWTH_INTERVAL: u32 = 2000;

    /// GradScaler's defaults with `initial_scale` (a positive, finite number).
    pub fn new(initial_scale: f32) -> Result<Self, String> {
        Self::with_schedule(initial_scale, 2.0, 0.5, Self::GROWTH_INTERVAL)
    }

    /// Any schedule: growth factor above 1, backoff factor in (0, 1), interval of at least 1.
    pub fn with_schedule(
        initial_scale: f32,
        growth_factor: f32,
        backoff_factor: f32,
        growth_interval: u32,
    ) -> Result<Self, String> {
        if !(initial_scale.is_finite() && initial_scale > 0.0) {
            return Err(format!(
                "the initial loss scale must be positive and finite, not {initial_scale}"
            ));
        }
        if !(growth_factor.is_finite() && growth_factor > 1.0) {
            return Err(format!(
                "the growth factor must be above 1, not {growth_factor}"
            ));
        }
        if !(backoff_factor > 0.0 && backoff_factor < 1.0) {
            return Err(format!(
                "the backoff factor must be in (0, 1), not {backoff_factor}"
            ));
        }
        if growth_interval == 0 {
            return Err("the growth interval must be at least 1 step".into());
        }
        Ok(LossScaler {
            scale: initial_scale,
            growth_factor,
            backoff_factor,
            growth_interval,
            clean_steps: 0,
            skipped: 0,
        })
    }

    /// The scale for the next step's backward pass.
    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// Steps skipped so far.
    pub fn skipped(&self) -> usize {
        self.skipped
    }

    /// After a step's gradients were checked: whether to apply them, and the next scale.
    pub fn update(&mut self, gradients_finite: bool) -> ScaleDecision {
        if !gradients_finite {
            self.scale *= self.backoff_factor;
            self.clean_steps = 0;
            self.skipped += 1;
            return ScaleDecision::Skip;
        }
        self.clean_steps += 1;
        if self.clean_steps == self.growth_interval {
            let grown = self.scale * self.growth_factor;
            if grown.is_finite() {
                self.scale = grown;
            }
            self.clean_steps = 0;
        }
        ScaleDecision::Apply
    }
}

/// Whether a reduction of every gradient value (a sum of absolute values) says they are all
/// finite: an inf or a NaN anywhere makes the sum inf or NaN.
pub fn all_finite(sum_of_abs: f64) -> bool {
    sum_of_abs.is_finite()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overflow_skips_and_halves_clean_steps_double_after_the_interval() {
        let mut scaler = LossScaler::new(LossScaler::INITIAL_SCALE).unwrap();
        assert_eq!(scaler.scale(), 65536.0);
        assert_eq!(scaler.update(false), ScaleDecision::Skip);
        assert_eq!(scaler.scale(), 32768.0);
        assert_eq!(scaler.update(false), ScaleDecision::Skip);
        assert_eq!(scaler.scale(), 16384.0);
        assert_eq!(scaler.skipped(), 2);
        // 1999 clean steps: no growth yet; the 2000th doubles.
        for _ in 0..1999 {
            assert_eq!(scaler.update(true), ScaleDecision::Apply);
        }
        assert_eq!(scaler.scale(), 16384.0);
        assert_eq!(scaler.update(true), ScaleDecision::Apply);
        assert_eq!(scaler.scale(), 32768.0);
        // An overflow resets the count of clean steps.
        for _ in 0..1500 {
            scaler.update(true);
        }
        scaler.update(false);
        assert_eq!(scaler.scale(), 16384.0);
        for _ in 0..1999 {
            scaler.update(true);
        }
        assert_eq!(scaler.scale(), 16384.0);
        scaler.update(true);
        assert_eq!(scaler.scale(), 32768.0);
        assert_eq!(scaler.skipped(), 3);
    }

    #[test]
    fn growth_never_overflows_and_bad_schedules_are_errors() {
        let mut scaler = LossScaler::with_schedule(f32::MAX / 1.5, 2.0, 0.5, 1).unwrap();
        scaler.update(true);
        assert_eq!(scaler.scale(), f32::MAX / 1.5);
        let mut small = LossScaler::with_schedule(1.0, 2.0, 0.5, 3).unwrap();
        for expected in [1.0, 1.0, 2.0, 2.0, 2.0, 4.0] {
            small.update(true);
            assert_eq!(small.scale(), expected);
        }
        for (scale, growth, backoff, interval) in [
            (0.0, 2.0, 0.5, 1),
            (f32::INFINITY, 2.0, 0.5, 1),
            (f32::NAN, 2.0, 0.5, 1),
            (1.0, 1.0, 0.5, 1),
            (1.0, 2.0, 1.0, 1),
            (1.0, 2.0, 0.0, 1),
            (1.0, 2.0, 0.5, 0),
        ] {
            assert!(LossScaler::with_schedule(scale, growth, backoff, interval).is_err());
        }
    }

    #[test]
    fn finiteness_from_a_sum_of_absolute_values() {
        assert!(all_finite(0.0));
        assert!(all_finite(1e30));
        assert!(!all_finite(f64::INFINITY));
        assert!(!all_finite(f64::NAN));
        // What the device reduction returns for gradients holding an inf or a NaN.
        let sum = |values: &[f32]| values.iter().map(|v| f64::from(v.abs())).sum::<f64>();
        assert!(all_finite(sum(&[1.0, -2.0, 3.5])));
        assert!(!all_finite(sum(&[1.0, f32::INFINITY])));
        assert!(!all_finite(sum(&[f32::NAN, 0.0])));
        assert!(!all_finite(sum(&[-f32::INFINITY, f32::INFINITY])));
    }
}
