//! The model zoo: the convolution layers of known networks at a chosen batch size, dtype and
//! layout. Identical shapes within a network are listed once, with their multiplicity, since
//! they are tuned once.

use crate::solver::{ConvProblem, DType, Layout};
use std::fmt;
use std::str::FromStr;

/// A distinct convolution of a network.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelLayer {
    /// The first layer with this shape, in the style `alexnet.conv2`, `resnet50.layer1.0.conv1`.
    pub name: String,
    pub problem: ConvProblem,
    /// How many layers of the network share this shape.
    pub count: u32,
}

/// Networks that `mucudnn tune --model` knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Model {
    /// The five conv layers of Caffe's AlexNet (227x227 input, no groups), as in the recorded
    /// H100 profile. In fp16/bf16 NHWC the first layer's 3 input channels are padded to 4, as
    /// tensor-core kernels need (and as the recorded profile did).
    AlexNet,
    /// torchvision's ResNet-50 (v1.5: stride on the 3x3 convolution), 224x224 input.
    ResNet50,
}

impl Model {
    pub const ALL: [Model; 2] = [Model::AlexNet, Model::ResNet50];

    pub fn name(self) -> &'static str {
        match self {
            Model::AlexNet => "alexnet",
            Model::ResNet50 => "resnet50",
        }
    }

    /// The distinct conv layers at batch `n`, in network order.
    pub fn layers(self, n: i64, dtype: DType, layout: Layout) -> Vec<ModelLayer> {
        let spec = |name: &str, c, hw, k, rs, stride, pad| ModelLayer {
            name: format!("{}.{name}", self.name()),
            problem: ConvProblem {
                pad_h: pad,
                pad_w: pad,
                stride_h: stride,
                stride_w: stride,
                dtype,
                layout,
                ..ConvProblem::new(n, c, hw, hw, k, rs, rs)
            },
            count: 1,
        };
        let mut layers = match self {
            Model::AlexNet => {
                let first_channels = if dtype != DType::Fp32 && layout == Layout::Nhwc {
                    4
                } else {
                    3
                };
                vec![
                    spec("conv1", first_channels, 227, 96, 11, 4, 0),
                    spec("conv2", 96, 27, 256, 5, 1, 2),
                    spec("conv3", 256, 13, 384, 3, 1, 1),
                    spec("conv4", 384, 13, 384, 3, 1, 1),
                    spec("conv5", 384, 13, 256, 3, 1, 1),
                ]
            }
            Model::ResNet50 => {
                let mut all = vec![spec("conv1", 3, 224, 64, 7, 2, 3)];
                // (stage, blocks, width, input size of the stage's first block)
                let stages = [
                    (1, 3, 64, 56),
                    (2, 4, 128, 56),
                    (3, 6, 256, 28),
                    (4, 3, 512, 14),
                ];
                let mut in_channels = 64;
                for (stage, blocks, width, input_hw) in stages {
                    let stride = if stage == 1 { 1 } else { 2 };
                    let out_hw = input_hw / stride;
                    for block in 0..blocks {
                        let prefix = format!("layer{stage}.{block}");
                        let (block_stride, block_in_hw) = if block == 0 {
                            (stride, input_hw)
                        } else {
                            (1, out_hw)
                        };
                        all.push(spec(
                            &format!("{prefix}.conv1"),
                            in_channels,
                            block_in_hw,
                            width,
                            1,
                            1,
                            0,
                        ));
                        all.push(spec(
                            &format!("{prefix}.conv2"),
                            width,
                            block_in_hw,
                            width,
                            3,
                            block_stride,
                            1,
                        ));
                        all.push(spec(
                            &format!("{prefix}.conv3"),
                            width,
                            out_hw,
                            width * 4,
                            1,
                            1,
                            0,
                        ));
                        if block == 0 {
                            let name = format!("{prefix}.downsample.0");
                            all.push(spec(&name, in_channels, input_hw, width * 4, 1, stride, 0));
                        }
                        in_channels = width * 4;
                    }
                }
                all
            }
        };
        dedup(&mut layers);
        layers
    }
}

/// Merges layers of identical shape into the first, counting them.
fn dedup(layers: &mut Vec<ModelLayer>) {
    let mut distinct: Vec<ModelLayer> = Vec::with_capacity(layers.len());
    for layer in layers.drain(..) {
        match distinct.iter_mut().find(|d| d.problem == layer.problem) {
            Some(existing) => existing.count += 1,
            None => distinct.push(layer),
        }
    }
    *layers = distinct;
}

impl fmt::Display for Model {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Model {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Model::ALL
            .into_iter()
            .find(|m| m.name() == s.to_ascii_lowercase())
            .ok_or_else(|| {
                let known: Vec<&str> = Model::ALL.iter().map(|m| m.name()).collect();
                format!("unknown model `{s}` (known: {})", known.join(", "))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::solver::interchange;

    #[test]
    fn alexnet_matches_the_recorded_profile() {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/h100-alexnet-profile.json"
        ))
        .unwrap();
        let profile = interchange::from_json_str(&text).unwrap();
        for (dtype, layout) in [(DType::Fp32, Layout::Nchw), (DType::Fp16, Layout::Nhwc)] {
            let layers = Model::AlexNet.layers(256, dtype, layout);
            assert_eq!(layers.len(), 5);
            for layer in layers {
                let recorded = profile
                    .entries
                    .iter()
                    .find(|e| e.layer == layer.name && e.problem.dtype == dtype)
                    .unwrap_or_else(|| panic!("{} missing", layer.name));
                assert_eq!(recorded.problem, layer.problem, "{}", layer.name);
            }
        }
    }

    #[test]
    fn resnet50_has_23_distinct_shapes_of_53_convolutions() {
        let layers = Model::ResNet50.layers(64, DType::Fp32, Layout::Nchw);
        for layer in &layers {
            layer.problem.validate().unwrap();
        }
        assert_eq!(layers.iter().map(|l| l.count).sum::<u32>(), 53);
        assert_eq!(layers.len(), 23);
        // v1.5: the stride is on the 3x3 of a stage's first block.
        let conv2 = layers
            .iter()
            .find(|l| l.name == "resnet50.layer2.0.conv2")
            .unwrap();
        assert_eq!(
            (
                conv2.problem.h,
                conv2.problem.stride_h,
                conv2.problem.output_hw()
            ),
            (56, 2, (28, 28))
        );
        let last = layers
            .iter()
            .find(|l| l.name == "resnet50.layer4.1.conv1")
            .unwrap();
        assert_eq!(
            (last.problem.c, last.problem.h, last.problem.k),
            (2048, 7, 512)
        );
        let stem = &layers[0];
        assert_eq!(stem.problem.output_hw(), (112, 112));
        assert_eq!("ResNet50".parse::<Model>().unwrap(), Model::ResNet50);
        assert!("vgg"
            .parse::<Model>()
            .unwrap_err()
            .contains("alexnet, resnet50"));
    }
}
