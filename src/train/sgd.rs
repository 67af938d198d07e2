//! Stochastic gradient descent with momentum and weight decay, with PyTorch's semantics
//! (`torch.optim.SGD`, no dampening, not Nesterov):
//!
//! ```text
//! g = grad + weight_decay * w
//! v = momentum * v + g        (v starts at 0, so the first step has v = g)
//! w = w - lr * v
//! ```
//!
//! Weight decay applies to every parameter, biases included, as in a single PyTorch parameter
//! group. The update is elementwise and deterministic, so ranks that feed it the same
//! all-reduced gradients stay bitwise identical.

use super::TrainError;

/// SGD hyper-parameters.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct Hyper {
    pub lr: f32,
    pub momentum: f32,
    pub weight_decay: f32,
}

impl Hyper {
    /// Checks the values are usable: `lr > 0`, `0 <= momentum < 1`, `weight_decay >= 0`, all
    /// finite.
    pub fn validate(&self) -> Result<(), TrainError> {
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(TrainError::Config(format!(
                "the learning rate must be a positive number, got {}",
                self.lr
            )));
        }
        if !(self.momentum.is_finite() && (0.0..1.0).contains(&self.momentum)) {
            return Err(TrainError::Config(format!(
                "momentum must be in [0, 1), got {}",
                self.momentum
            )));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return Err(TrainError::Config(format!(
                "weight decay must be a non-negative number, got {}",
                self.weight_decay
            )));
        }
        Ok(())
    }
}

/// The optimizer state: one momentum buffer over the flattened parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct Sgd {
    velocity: Vec<f32>,
}

impl Sgd {
    pub fn new(parameter_count: usize) -> Self {
        Sgd {
            velocity: vec![0.0; parameter_count],
        }
    }

    /// The momentum buffer.
    pub fn velocity(&self) -> &[f32] {
        &self.velocity
    }

    /// One update of `parameters` with `gradients` (already averaged over the batch).
    pub fn step(
        &mut self,
        parameters: &mut [f32],
        gradients: &[f32],
        hyper: &Hyper,
    ) -> Result<(), TrainError> {
        if parameters.len() != self.velocity.len() || gradients.len() != self.velocity.len() {
            return Err(TrainError::Config(format!(
                "SGD holds {} parameters but was given {} parameters and {} gradients",
                self.velocity.len(),
                parameters.len(),
                gradients.len()
            )));
        }
        for ((w, &g), v) in parameters
            .iter_mut()
            .zip(gradients)
            .zip(self.velocity.iter_mut())
        {
            let g = g + hyper.weight_decay * *w;
            *v = hyper.momentum * *v + g;
            *w -= hyper.lr * *v;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn momentum_and_weight_decay_match_a_hand_computation() {
        let hyper = Hyper {
            lr: 0.1,
            momentum: 0.9,
            weight_decay: 0.01,
        };
        let mut sgd = Sgd::new(2);
        let mut w = [1.0f32, -2.0];
        // Step 1: g = grad + 0.01 w = [0.5 + 0.01, 0.25 - 0.02] = [0.51, 0.23]; v = g;
        // w = [1 - 0.051, -2 - 0.023] = [0.949, -2.023].
        sgd.step(&mut w, &[0.5, 0.25], &hyper).unwrap();
        assert!(
            (w[0] - 0.949).abs() < 1e-6 && (w[1] + 2.023).abs() < 1e-6,
            "{w:?}"
        );
        // Step 2: g = [-1 + 0.00949, 0 - 0.02023] = [-0.99051, -0.02023];
        // v = 0.9 [0.51, 0.23] + g = [-0.53151, 0.18677];
        // w = [0.949 + 0.053151, -2.023 - 0.018677] = [1.002151, -2.041677].
        sgd.step(&mut w, &[-1.0, 0.0], &hyper).unwrap();
        assert!(
            (sgd.velocity()[0] + 0.53151).abs() < 1e-6,
            "{:?}",
            sgd.velocity()
        );
        assert!(
            (sgd.velocity()[1] - 0.18677).abs() < 1e-6,
            "{:?}",
            sgd.velocity()
        );
        assert!(
            (w[0] - 1.002151).abs() < 1e-6 && (w[1] + 2.041677).abs() < 1e-6,
            "{w:?}"
        );
    }

    #[test]
    fn plain_sgd_without_momentum_or_decay() {
        let hyper = Hyper {
            lr: 0.5,
            momentum: 0.0,
            weight_decay: 0.0,
        };
        let mut sgd = Sgd::new(1);
        let mut w = [3.0f32];
        sgd.step(&mut w, &[2.0], &hyper).unwrap();
        sgd.step(&mut w, &[2.0], &hyper).unwrap();
        assert_eq!(w, [1.0]);
    }

    #[test]
    fn bad_hyper_parameters_and_lengths_are_errors() {
        let good = Hyper {
            lr: 0.1,
            momentum: 0.9,
            weight_decay: 0.0,
        };
        assert!(good.validate().is_ok());
        for bad in [
            Hyper { lr: 0.0, ..good },
            Hyper {
                lr: f32::NAN,
                ..good
            },
            Hyper {
                momentum: 1.0,
                ..good
            },
            Hyper {
                weight_decay: -1.0,
                ..good
            },
        ] {
            assert!(
                matches!(bad.validate(), Err(TrainError::Config(_))),
                "{bad:?}"
            );
        }
        let mut sgd = Sgd::new(2);
        assert!(sgd.step(&mut [0.0; 3], &[0.0; 3], &good).is_err());
    }
}
