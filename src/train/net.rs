//! The network's architecture ([`NetSpec`]) and its deterministic initial parameters, the same
//! on every rank and device.
//!
//! Each block is conv 3x3 (stride 1, padding 1, with bias) -> ReLU -> max-pool 2x2 (stride 2,
//! odd sizes rounded down, as in PyTorch); the blocks are followed by one linear layer over the
//! flattened NCHW features and softmax cross-entropy. Parameters come in this order:
//! `block0.conv.weight` (`k x c x 3 x 3`), `block0.conv.bias` (`k`), ..., `linear.weight`
//! (`classes x features`, row-major), `linear.bias` (`classes`). The flattened parameter vector
//! of a replica ([`super::Replica::parameters`]) concatenates them in the same order.

use super::rng::Rng;
use super::TrainError;

/// Conv kernel size of every block.
pub const KERNEL: usize = 3;

/// The CNN: `blocks.len()` conv-ReLU-pool blocks, then a linear layer.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct NetSpec {
    pub in_channels: usize,
    /// Input images are `image_size x image_size`.
    pub image_size: usize,
    pub classes: usize,
    /// Output channels of each block's convolution.
    pub block_channels: Vec<usize>,
}

/// One parameter tensor's name and dimensions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamShape {
    pub name: String,
    pub dims: Vec<usize>,
}

impl ParamShape {
    pub fn len(&self) -> usize {
        self.dims.iter().product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl NetSpec {
    pub fn validate(&self) -> Result<(), TrainError> {
        let fail = |message: String| Err(TrainError::Config(message));
        if self.in_channels == 0 {
            return fail("the network needs at least one input channel".into());
        }
        if self.classes < 2 {
            return fail(format!("need at least 2 classes, not {}", self.classes));
        }
        if self.block_channels.is_empty() {
            return fail("the network needs at least one conv block".into());
        }
        if let Some(block) = self.block_channels.iter().position(|&k| k == 0) {
            return fail(format!("block {block} has no output channels"));
        }
        let blocks = self.block_channels.len() as u32;
        if blocks >= usize::BITS || self.image_size >> blocks == 0 {
            return fail(format!(
                "{}x{} images are too small for {blocks} blocks of 2x2 pooling (need at least {})",
                self.image_size,
                self.image_size,
                1u64.checked_shl(blocks).unwrap_or(u64::MAX)
            ));
        }
        if self.image_size > 4096 {
            return fail(format!("{0}x{0} images are too large", self.image_size));
        }
        Ok(())
    }

    /// Input channels of block `index`.
    pub fn block_input_channels(&self, index: usize) -> usize {
        if index == 0 {
            self.in_channels
        } else {
            self.block_channels[index - 1]
        }
    }

    /// Height (= width) of block `index`'s input.
    pub fn block_input_size(&self, index: usize) -> usize {
        self.image_size >> index
    }

    /// Checks that a batch fits the network: `labels.len()` NCHW images of
    /// `in_channels x image_size x image_size`, every label below `classes`.
    pub fn check_batch(&self, images: &[f32], labels: &[u32]) -> Result<(), TrainError> {
        let image_len = self.in_channels * self.image_size * self.image_size;
        if images.len() != labels.len() * image_len {
            return Err(TrainError::Batch(format!(
                "{} image values for {} labels; the network takes {}x{}x{} images ({image_len} values each)",
                images.len(),
                labels.len(),
                self.in_channels,
                self.image_size,
                self.image_size
            )));
        }
        if let Some((index, label)) = labels
            .iter()
            .enumerate()
            .find(|(_, &l)| l as usize >= self.classes)
        {
            return Err(TrainError::Batch(format!(
                "label {label} of sample {index} is not below the {} classes",
                self.classes
            )));
        }
        Ok(())
    }

    /// Features the linear layer sees: last channels x the last pooled size squared.
    pub fn feature_count(&self) -> usize {
        let side = self.image_size >> self.block_channels.len();
        self.block_channels.last().copied().unwrap_or(0) * side * side
    }

    /// Every parameter tensor, in the fixed order.
    pub fn parameter_shapes(&self) -> Vec<ParamShape> {
        let mut shapes = Vec::with_capacity(2 * self.block_channels.len() + 2);
        for (index, &out) in self.block_channels.iter().enumerate() {
            let input = self.block_input_channels(index);
            shapes.push(ParamShape {
                name: format!("block{index}.conv.weight"),
                dims: vec![out, input, KERNEL, KERNEL],
            });
            shapes.push(ParamShape {
                name: format!("block{index}.conv.bias"),
                dims: vec![out],
            });
        }
        shapes.push(ParamShape {
            name: "linear.weight".into(),
            dims: vec![self.classes, self.feature_count()],
        });
        shapes.push(ParamShape {
            name: "linear.bias".into(),
            dims: vec![self.classes],
        });
        shapes
    }

    /// Total number of parameters.
    pub fn parameter_count(&self) -> usize {
        self.parameter_shapes().iter().map(ParamShape::len).sum()
    }

    /// Initial parameters, one vector per [`NetSpec::parameter_shapes`] entry: conv weights
    /// He-uniform (`±sqrt(6 / fan_in)`, suited to ReLU), linear weights uniform in
    /// `±1/sqrt(features)` (PyTorch's default), biases zero. A pure function of `seed`.
    pub fn init_parameters(&self, seed: u64) -> Vec<Vec<f32>> {
        self.parameter_shapes()
            .iter()
            .enumerate()
            .map(|(index, shape)| {
                let bound = match shape.dims.as_slice() {
                    [_, c, r, s] => (6.0 / (c * r * s) as f64).sqrt(),
                    [_, features] => 1.0 / (*features as f64).sqrt(),
                    _ => 0.0, // biases
                };
                let mut rng = Rng::derive(seed, &[4, index as u64]);
                (0..shape.len())
                    .map(|_| rng.uniform(-bound, bound) as f32)
                    .collect()
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> NetSpec {
        NetSpec {
            in_channels: 3,
            image_size: 16,
            classes: 10,
            block_channels: vec![8, 16],
        }
    }

    #[test]
    fn shapes_counts_and_features() {
        let spec = spec();
        spec.validate().unwrap();
        assert_eq!(spec.feature_count(), 16 * 4 * 4);
        let shapes = spec.parameter_shapes();
        let dims: Vec<Vec<usize>> = shapes.iter().map(|s| s.dims.clone()).collect();
        assert_eq!(
            dims,
            [
                vec![8, 3, 3, 3],
                vec![8],
                vec![16, 8, 3, 3],
                vec![16],
                vec![10, 256],
                vec![10]
            ]
        );
        assert_eq!(spec.parameter_count(), 216 + 8 + 1152 + 16 + 2560 + 10);
        assert_eq!(spec.block_input_size(1), 8);
    }

    #[test]
    fn init_is_deterministic_bounded_and_seeded() {
        let spec = spec();
        let a = spec.init_parameters(1);
        assert_eq!(a, spec.init_parameters(1));
        assert_ne!(a, spec.init_parameters(2));
        let bound = (6.0f32 / 27.0).sqrt();
        assert!(a[0].iter().all(|w| w.abs() <= bound));
        assert!(a[0].iter().any(|w| w.abs() > bound / 2.0));
        assert!(a[1].iter().all(|&b| b == 0.0));
        assert!(a[4].iter().all(|w| w.abs() <= 1.0 / 16.0));
        for (values, shape) in a.iter().zip(spec.parameter_shapes()) {
            assert_eq!(values.len(), shape.len(), "{}", shape.name);
        }
    }

    #[test]
    fn unusable_specs_are_errors() {
        for bad in [
            NetSpec {
                image_size: 3,
                ..spec()
            },
            NetSpec {
                block_channels: vec![],
                ..spec()
            },
            NetSpec {
                block_channels: vec![8, 0],
                ..spec()
            },
            NetSpec {
                classes: 1,
                ..spec()
            },
            NetSpec {
                in_channels: 0,
                ..spec()
            },
            NetSpec {
                block_channels: vec![1; 70],
                ..spec()
            },
        ] {
            assert!(
                matches!(bad.validate(), Err(TrainError::Config(_))),
                "{bad:?}"
            );
        }
    }
}
