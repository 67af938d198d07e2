//! The model zoo: the convolution layers of known networks at a chosen batch size, dtype and
//! layout. Identical shapes within a network are listed once, with their multiplicity, since
//! they are tuned once.
//!
//! Data enters as a [`Model`] (parsed from `--model`) plus the batch size, dtype and layout the
//! caller chose, and leaves as [`ModelLayer`]s: a name, a [`ConvProblem`] and a count. Network
//! files (`crate::network`) produce the same type, so everything downstream (profiling,
//! reports) treats a zoo model and a file alike.
//!
//! Shapes follow the reference implementations named on each variant; names are the module
//! paths of those implementations (torchvision's `layer1.0.conv1`), prefixed with the model name.

use crate::solver::{ConvProblem, DType, Layout};
use std::collections::HashMap;
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

/// Networks that `mucudnn tune --model` knows. Apart from AlexNet's padded first layer, shapes
/// are the reference ones in every dtype and layout (3 input channels stay 3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Model {
    /// The five conv layers of Caffe's AlexNet (227x227 input, no groups), as in the recorded
    /// H100 profile. In fp16/bf16 NHWC the first layer's 3 input channels are padded to 4, as
    /// tensor-core kernels need (and as the recorded profile did).
    AlexNet,
    /// torchvision's ResNet-50 (v1.5: stride on the 3x3 convolution), 224x224 input.
    ResNet50,
    /// torchvision's VGG-16 (configuration D, no batch norm), 224x224 input: 13 convolutions,
    /// all 3x3 with padding 1, named Caffe-style `vgg16.conv1_1` ... `vgg16.conv5_3`
    /// (torchvision's `features.0` ... `features.28`). 9 distinct shapes.
    Vgg16,
    /// torchvision's ResNet-18 (basic blocks; a stage's first block has the stride on its first
    /// 3x3 and a 1x1 stride-2 `downsample.0`), 224x224 input: 20 convolutions, 11 distinct.
    ResNet18,
    /// torchvision's DenseNet-121 (growth 32, bn_size 4, blocks 6, 12, 24, 16), 224x224 input:
    /// the 7x7 stem `features.conv0`, per dense layer a 1x1 bottleneck (`conv1`, C_in -> 128)
    /// and a 3x3 (`conv2`, 128 -> 32), and the 1x1 `features.transitionN.conv` that halves the
    /// channels before each 2x2 average pool: 120 convolutions, 66 distinct.
    DenseNet121,
    /// torchvision's MobileNet-V2 (width 1.0), 224x224 input: the 3x3 stride-2 stem, 17
    /// inverted residual blocks (1x1 expansion unless t = 1, 3x3 depthwise with groups =
    /// channels, 1x1 projection), and the last 1x1 to 1280 channels: 52 convolutions.
    MobileNetV2,
    /// The training set of Baidu's DeepBench convolution benchmark (`kernels/conv_problems.h`,
    /// `training_set`): 94 problems from DeepSpeech, OCR, face recognition, vision (VGG,
    /// GoogLeNet, ResNet) and speaker ID, named `deepbench.train.0` ... `deepbench.train.93`
    /// after their index in that list (the 4 exact repeats are merged, leaving 90).
    ///
    /// DeepBench fixes the batch size of every problem (4 to 32), and the list sweeps it: the
    /// same shape appears at several batch sizes. Each problem keeps its own N, so **the batch
    /// argument of [`Model::layers`] is ignored** (see [`Model::fixed_batch`]); replacing it
    /// would merge those sweeps into one shape and no longer be DeepBench.
    DeepBench,
}

impl Model {
    pub const ALL: [Model; 7] = [
        Model::AlexNet,
        Model::ResNet50,
        Model::Vgg16,
        Model::ResNet18,
        Model::DenseNet121,
        Model::MobileNetV2,
        Model::DeepBench,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Model::AlexNet => "alexnet",
            Model::ResNet50 => "resnet50",
            Model::Vgg16 => "vgg16",
            Model::ResNet18 => "resnet18",
            Model::DenseNet121 => "densenet121",
            Model::MobileNetV2 => "mobilenet_v2",
            Model::DeepBench => "deepbench",
        }
    }

    /// One line for help texts and reports.
    pub fn description(self) -> &'static str {
        match self {
            Model::AlexNet => "Caffe AlexNet, 5 conv layers, 227x227",
            Model::ResNet50 => "torchvision ResNet-50 v1.5, 53 convs (23 distinct), 224x224",
            Model::Vgg16 => "torchvision VGG-16, 13 convs (9 distinct), 224x224",
            Model::ResNet18 => "torchvision ResNet-18, 20 convs (11 distinct), 224x224",
            Model::DenseNet121 => "torchvision DenseNet-121, 120 convs (66 distinct), 224x224",
            Model::MobileNetV2 => {
                "torchvision MobileNet-V2 1.0, 52 convs (30 distinct, 17 depthwise), 224x224"
            }
            Model::DeepBench => {
                "DeepBench conv training set, 94 problems (90 distinct), their own batch sizes"
            }
        }
    }

    /// Whether the model's problems carry their own batch sizes, so that [`Model::layers`]
    /// ignores its `n` (DeepBench). A CLI should say so when the user passed a batch size.
    pub fn fixed_batch(self) -> bool {
        self == Model::DeepBench
    }

    /// The distinct conv layers at batch `n`, in network order (for [`Model::DeepBench`] `n` is
    /// ignored: every problem keeps DeepBench's batch size).
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
        // Depthwise and other grouped convolutions (MobileNet-V2).
        let grouped = |name: &str, c, hw, k, rs, stride, pad, groups| {
            let mut layer = spec(name, c, hw, k, rs, stride, pad);
            layer.problem.groups = groups;
            layer
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
            Model::Vgg16 => {
                let mut all = Vec::new();
                let (mut channels, mut hw) = (3, 224);
                // (stage, convolutions, width); a 2x2 max pool halves the size after each stage.
                for (stage, convs, width) in [
                    (1, 2, 64),
                    (2, 2, 128),
                    (3, 3, 256),
                    (4, 3, 512),
                    (5, 3, 512),
                ] {
                    for index in 1..=convs {
                        all.push(spec(
                            &format!("conv{stage}_{index}"),
                            channels,
                            hw,
                            width,
                            3,
                            1,
                            1,
                        ));
                        channels = width;
                    }
                    hw /= 2;
                }
                all
            }
            Model::ResNet18 => {
                let mut all = vec![spec("conv1", 3, 224, 64, 7, 2, 3)];
                // (stage, width, input size of the stage's first block); two blocks per stage.
                let mut in_channels = 64;
                for (stage, width, input_hw) in
                    [(1, 64, 56), (2, 128, 56), (3, 256, 28), (4, 512, 14)]
                {
                    let stride = if stage == 1 { 1 } else { 2 };
                    let out_hw = input_hw / stride;
                    for block in 0..2 {
                        let prefix = format!("layer{stage}.{block}");
                        let (block_stride, block_in_hw, block_in_channels) = if block == 0 {
                            (stride, input_hw, in_channels)
                        } else {
                            (1, out_hw, width)
                        };
                        all.push(spec(
                            &format!("{prefix}.conv1"),
                            block_in_channels,
                            block_in_hw,
                            width,
                            3,
                            block_stride,
                            1,
                        ));
                        all.push(spec(
                            &format!("{prefix}.conv2"),
                            width,
                            out_hw,
                            width,
                            3,
                            1,
                            1,
                        ));
                        // torchvision adds a projection only where the shape changes.
                        if block == 0 && (stride != 1 || in_channels != width) {
                            let name = format!("{prefix}.downsample.0");
                            all.push(spec(&name, in_channels, input_hw, width, 1, stride, 0));
                        }
                    }
                    in_channels = width;
                }
                all
            }
            Model::DenseNet121 => {
                const GROWTH: i64 = 32;
                const BOTTLENECK: i64 = 4 * GROWTH; // bn_size * growth_rate
                let mut all = vec![spec("features.conv0", 3, 224, 64, 7, 2, 3)];
                // After the stem (112x112) a 3x3 stride-2 max pool: 56x56.
                let (mut channels, mut hw) = (64, 56);
                for (block, dense_layers) in [(1, 6), (2, 12), (3, 24), (4, 16)] {
                    for layer in 1..=dense_layers {
                        let prefix = format!("features.denseblock{block}.denselayer{layer}");
                        all.push(spec(
                            &format!("{prefix}.conv1"),
                            channels,
                            hw,
                            BOTTLENECK,
                            1,
                            1,
                            0,
                        ));
                        all.push(spec(
                            &format!("{prefix}.conv2"),
                            BOTTLENECK,
                            hw,
                            GROWTH,
                            3,
                            1,
                            1,
                        ));
                        // Each layer's output is concatenated onto its input.
                        channels += GROWTH;
                    }
                    if block < 4 {
                        let name = format!("features.transition{block}.conv");
                        all.push(spec(&name, channels, hw, channels / 2, 1, 1, 0));
                        channels /= 2;
                        hw /= 2; // 2x2 average pool
                    }
                }
                all
            }
            Model::MobileNetV2 => {
                let mut all = vec![spec("features.0.0", 3, 224, 32, 3, 2, 1)];
                let (mut in_channels, mut hw, mut index) = (32, 112, 1);
                // (expand ratio t, output channels c, repeats n, first stride s)
                let settings = [
                    (1, 16, 1, 1),
                    (6, 24, 2, 2),
                    (6, 32, 3, 2),
                    (6, 64, 4, 2),
                    (6, 96, 3, 1),
                    (6, 160, 3, 2),
                    (6, 320, 1, 1),
                ];
                for (expand, out_channels, repeats, first_stride) in settings {
                    for repeat in 0..repeats {
                        let stride = if repeat == 0 { first_stride } else { 1 };
                        let hidden = in_channels * expand;
                        let prefix = format!("features.{index}.conv");
                        // Without expansion the depthwise conv is the block's first module.
                        let mut module = 0;
                        if expand != 1 {
                            all.push(spec(
                                &format!("{prefix}.0.0"),
                                in_channels,
                                hw,
                                hidden,
                                1,
                                1,
                                0,
                            ));
                            module = 1;
                        }
                        let name = format!("{prefix}.{module}.0");
                        all.push(grouped(&name, hidden, hw, hidden, 3, stride, 1, hidden));
                        let out_hw = (hw + 2 - 3) / stride + 1;
                        let name = format!("{prefix}.{}", module + 1);
                        all.push(spec(&name, hidden, out_hw, out_channels, 1, 1, 0));
                        (in_channels, hw, index) = (out_channels, out_hw, index + 1);
                    }
                }
                all.push(spec(
                    &format!("features.{index}.0"),
                    in_channels,
                    hw,
                    1280,
                    1,
                    1,
                    0,
                ));
                all
            }
            Model::DeepBench => DEEPBENCH_TRAINING
                .iter()
                .enumerate()
                .map(
                    |(index, &[w, h, c, n, k, s, r, pad_w, pad_h, stride_w, stride_h])| {
                        ModelLayer {
                            name: format!("deepbench.train.{index}"),
                            problem: ConvProblem {
                                pad_h,
                                pad_w,
                                stride_h,
                                stride_w,
                                dtype,
                                layout,
                                ..ConvProblem::new(n, c, h, w, k, r, s)
                            },
                            count: 1,
                        }
                    },
                )
                .collect(),
        };
        dedup(&mut layers);
        layers
    }
}

/// DeepBench's `training_set` (baidu-research/DeepBench, `code/kernels/conv_problems.h`),
/// transcribed in its order and its field order: W, H, C, N, K, S (filter width),
/// R (filter height), pad_w, pad_h, wstride, hstride.
#[rustfmt::skip]
const DEEPBENCH_TRAINING: [[i64; 11]; 94] = [
    [700, 161, 1, 4, 32, 20, 5, 0, 0, 2, 2],
    [700, 161, 1, 8, 32, 20, 5, 0, 0, 2, 2],
    [700, 161, 1, 16, 32, 20, 5, 0, 0, 2, 2],
    [700, 161, 1, 32, 32, 20, 5, 0, 0, 2, 2],
    [341, 79, 32, 4, 32, 10, 5, 0, 0, 2, 2],
    [341, 79, 32, 8, 32, 10, 5, 0, 0, 2, 2],
    [341, 79, 32, 16, 32, 10, 5, 0, 0, 2, 2],
    [341, 79, 32, 32, 32, 10, 5, 0, 0, 2, 2],
    [480, 48, 1, 16, 16, 3, 3, 1, 1, 1, 1],
    [240, 24, 16, 16, 32, 3, 3, 1, 1, 1, 1],
    [120, 12, 32, 16, 64, 3, 3, 1, 1, 1, 1],
    [60, 6, 64, 16, 128, 3, 3, 1, 1, 1, 1],
    [108, 108, 3, 8, 64, 3, 3, 1, 1, 2, 2],
    [54, 54, 64, 8, 64, 3, 3, 1, 1, 1, 1],
    [27, 27, 128, 8, 128, 3, 3, 1, 1, 1, 1],
    [14, 14, 128, 8, 256, 3, 3, 1, 1, 1, 1],
    [7, 7, 256, 8, 512, 3, 3, 1, 1, 1, 1],
    [224, 224, 3, 8, 64, 3, 3, 1, 1, 1, 1],
    [112, 112, 64, 8, 128, 3, 3, 1, 1, 1, 1],
    [56, 56, 128, 8, 256, 3, 3, 1, 1, 1, 1],
    [28, 28, 256, 8, 512, 3, 3, 1, 1, 1, 1],
    [14, 14, 512, 8, 512, 3, 3, 1, 1, 1, 1],
    [7, 7, 512, 8, 512, 3, 3, 1, 1, 1, 1],
    [224, 224, 3, 16, 64, 3, 3, 1, 1, 1, 1],
    [112, 112, 64, 16, 128, 3, 3, 1, 1, 1, 1],
    [56, 56, 128, 16, 256, 3, 3, 1, 1, 1, 1],
    [28, 28, 256, 16, 512, 3, 3, 1, 1, 1, 1],
    [14, 14, 512, 16, 512, 3, 3, 1, 1, 1, 1],
    [7, 7, 512, 16, 512, 3, 3, 1, 1, 1, 1],
    [224, 224, 3, 16, 64, 7, 7, 3, 3, 2, 2],
    [28, 28, 192, 16, 32, 5, 5, 2, 2, 1, 1],
    [28, 28, 192, 16, 64, 1, 1, 0, 0, 1, 1],
    [14, 14, 512, 16, 48, 5, 5, 2, 2, 1, 1],
    [14, 14, 512, 16, 192, 1, 1, 0, 0, 1, 1],
    [7, 7, 832, 16, 256, 1, 1, 0, 0, 1, 1],
    [7, 7, 832, 16, 128, 5, 5, 2, 2, 1, 1],
    [56, 56, 64, 8, 64, 3, 3, 1, 1, 1, 1],
    [56, 56, 64, 8, 256, 1, 1, 0, 0, 2, 2],
    [28, 28, 128, 8, 128, 3, 3, 1, 1, 1, 1],
    [28, 28, 128, 8, 512, 1, 1, 0, 0, 2, 2],
    [14, 14, 256, 8, 256, 1, 1, 0, 0, 1, 1],
    [14, 14, 256, 8, 256, 3, 3, 1, 1, 1, 1],
    [14, 14, 256, 8, 1024, 1, 1, 0, 0, 2, 2],
    [7, 7, 512, 8, 512, 1, 1, 0, 0, 1, 1],
    [7, 7, 2048, 8, 512, 1, 1, 3, 3, 2, 2],
    [56, 56, 64, 16, 64, 3, 3, 1, 1, 1, 1],
    [56, 56, 64, 16, 256, 1, 1, 0, 0, 2, 2],
    [28, 28, 128, 16, 128, 3, 3, 1, 1, 1, 1],
    [28, 28, 128, 16, 512, 1, 1, 0, 0, 2, 2],
    [14, 14, 256, 16, 256, 1, 1, 0, 0, 1, 1],
    [14, 14, 256, 16, 256, 3, 3, 1, 1, 1, 1],
    [14, 14, 256, 16, 1024, 1, 1, 0, 0, 2, 2],
    [7, 7, 512, 16, 512, 1, 1, 0, 0, 1, 1],
    [7, 7, 2048, 16, 512, 1, 1, 3, 3, 2, 2],
    [700, 161, 1, 16, 64, 5, 5, 1, 1, 2, 2],
    [350, 80, 64, 16, 64, 3, 3, 1, 1, 1, 1],
    [350, 80, 64, 16, 128, 5, 5, 1, 1, 2, 2],
    [175, 40, 128, 16, 128, 3, 3, 1, 1, 1, 1],
    [175, 40, 128, 16, 256, 5, 5, 1, 1, 2, 2],
    [84, 20, 256, 16, 256, 3, 3, 1, 1, 1, 1],
    [84, 20, 256, 16, 512, 5, 5, 1, 1, 2, 2],
    [42, 10, 512, 16, 512, 3, 3, 1, 1, 1, 1],
    [112, 112, 64, 8, 64, 1, 1, 0, 0, 1, 1],
    [56, 56, 64, 8, 256, 1, 1, 0, 0, 1, 1],
    [56, 56, 256, 8, 64, 1, 1, 0, 0, 1, 1],
    [56, 56, 256, 8, 128, 1, 1, 0, 0, 2, 2],
    [28, 28, 128, 8, 512, 1, 1, 0, 0, 1, 1],
    [28, 28, 512, 8, 128, 1, 1, 0, 0, 1, 1],
    [28, 28, 512, 8, 256, 1, 1, 0, 0, 2, 2],
    [14, 14, 256, 8, 1024, 1, 1, 0, 0, 1, 1],
    [28, 28, 512, 8, 1024, 1, 1, 0, 0, 2, 2],
    [14, 14, 1024, 8, 256, 1, 1, 0, 0, 1, 1],
    [14, 14, 256, 8, 1024, 1, 1, 0, 0, 1, 1],
    [14, 14, 1024, 8, 512, 1, 1, 0, 0, 2, 2],
    [7, 7, 512, 8, 512, 3, 3, 1, 1, 1, 1],
    [7, 7, 512, 8, 2048, 1, 1, 0, 0, 1, 1],
    [14, 14, 1024, 8, 2048, 1, 1, 0, 0, 2, 2],
    [7, 7, 2048, 8, 512, 1, 1, 0, 0, 1, 1],
    [112, 112, 64, 16, 64, 1, 1, 0, 0, 1, 1],
    [56, 56, 64, 16, 256, 1, 1, 0, 0, 1, 1],
    [56, 56, 256, 16, 64, 1, 1, 0, 0, 1, 1],
    [56, 56, 256, 16, 128, 1, 1, 0, 0, 2, 2],
    [28, 28, 128, 16, 512, 1, 1, 0, 0, 1, 1],
    [28, 28, 512, 16, 128, 1, 1, 0, 0, 1, 1],
    [28, 28, 512, 16, 256, 1, 1, 0, 0, 2, 2],
    [14, 14, 256, 16, 1024, 1, 1, 0, 0, 1, 1],
    [28, 28, 512, 16, 1024, 1, 1, 0, 0, 2, 2],
    [14, 14, 1024, 16, 256, 1, 1, 0, 0, 1, 1],
    [14, 14, 256, 16, 1024, 1, 1, 0, 0, 1, 1],
    [14, 14, 1024, 16, 512, 1, 1, 0, 0, 2, 2],
    [7, 7, 512, 16, 512, 3, 3, 1, 1, 1, 1],
    [7, 7, 512, 16, 2048, 1, 1, 0, 0, 1, 1],
    [14, 14, 1024, 16, 2048, 1, 1, 0, 0, 2, 2],
    [7, 7, 2048, 16, 512, 1, 1, 0, 0, 1, 1],
];

/// Merges layers of identical shape into the first, adding up their counts.
pub fn dedup(layers: &mut Vec<ModelLayer>) {
    let mut distinct: Vec<ModelLayer> = Vec::with_capacity(layers.len());
    for layer in layers.drain(..) {
        match distinct.iter_mut().find(|d| d.problem == layer.problem) {
            Some(existing) => existing.count = existing.count.saturating_add(layer.count),
            None => distinct.push(layer),
        }
    }
    *layers = distinct;
}

/// How many layers of the network each distinct layer stands for, by layer name (what
/// `report_files::ReportInput::multiplicity` takes).
pub fn multiplicities(layers: &[ModelLayer]) -> HashMap<String, u32> {
    layers
        .iter()
        .map(|layer| (layer.name.clone(), layer.count))
        .collect()
}

impl fmt::Display for Model {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Model {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        // `mobilenet-v2` and `mobilenet_v2` alike.
        let wanted = s.to_ascii_lowercase().replace('-', "_");
        Model::ALL
            .into_iter()
            .find(|m| m.name() == wanted)
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

    fn find<'a>(layers: &'a [ModelLayer], name: &str) -> &'a ModelLayer {
        layers
            .iter()
            .find(|l| l.name == name)
            .unwrap_or_else(|| panic!("{name} missing"))
    }

    /// (c, h, w, k, r, s, stride, pad, groups) of a layer, for compact spot checks.
    fn shape(layer: &ModelLayer) -> [i64; 9] {
        let p = &layer.problem;
        assert_eq!(
            (p.stride_h, p.pad_h),
            (p.stride_w, p.pad_w),
            "{}",
            layer.name
        );
        [p.c, p.h, p.w, p.k, p.r, p.s, p.stride_h, p.pad_h, p.groups]
    }

    /// Every model at a couple of settings: shapes validate, the batch, dtype and layout are
    /// applied, names are unique and prefixed, and distinct shapes really are distinct.
    #[test]
    fn every_model_is_valid_and_distinct() {
        for model in Model::ALL {
            for (n, dtype, layout) in [
                (8, DType::Fp32, Layout::Nchw),
                (3, DType::Bf16, Layout::Nhwc),
            ] {
                let layers = model.layers(n, dtype, layout);
                assert!(!layers.is_empty(), "{model}");
                let mut names = std::collections::HashSet::new();
                for (i, layer) in layers.iter().enumerate() {
                    layer
                        .problem
                        .validate()
                        .unwrap_or_else(|e| panic!("{}: {e}", layer.name));
                    assert!(layer.name.starts_with(&format!("{}.", model.name())));
                    assert!(names.insert(&layer.name), "{} twice", layer.name);
                    assert!(layer.count >= 1);
                    assert_eq!((layer.problem.dtype, layer.problem.layout), (dtype, layout));
                    if !model.fixed_batch() {
                        assert_eq!(layer.problem.n, n, "{}", layer.name);
                    }
                    assert!(
                        layers[..i]
                            .iter()
                            .all(|other| other.problem != layer.problem),
                        "{} repeats an earlier shape",
                        layer.name
                    );
                }
            }
            assert_eq!(model.name().parse::<Model>().unwrap(), model);
            assert!(!model.description().is_empty());
        }
        assert_eq!("MobileNet-V2".parse::<Model>().unwrap(), Model::MobileNetV2);
    }

    /// (model, convolutions, distinct shapes) at 224x224.
    #[test]
    fn known_counts() {
        for (model, convolutions, distinct) in [
            (Model::AlexNet, 5, 5),
            (Model::ResNet50, 53, 23),
            (Model::Vgg16, 13, 9),
            (Model::ResNet18, 20, 11),
            (Model::DenseNet121, 120, 66),
            (Model::MobileNetV2, 52, 30),
            (Model::DeepBench, 94, 90),
        ] {
            let layers = model.layers(32, DType::Fp32, Layout::Nchw);
            let total: u32 = layers.iter().map(|l| l.count).sum();
            assert_eq!((total, layers.len()), (convolutions, distinct), "{model}");
            let counts = multiplicities(&layers);
            assert_eq!(counts.values().sum::<u32>(), convolutions);
        }
    }

    #[test]
    fn vgg16_shapes() {
        let layers = Model::Vgg16.layers(16, DType::Fp32, Layout::Nchw);
        let names: Vec<&str> = layers.iter().map(|l| l.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "vgg16.conv1_1",
                "vgg16.conv1_2",
                "vgg16.conv2_1",
                "vgg16.conv2_2",
                "vgg16.conv3_1",
                "vgg16.conv3_2",
                "vgg16.conv4_1",
                "vgg16.conv4_2",
                "vgg16.conv5_1"
            ]
        );
        assert_eq!(shape(&layers[0]), [3, 224, 224, 64, 3, 3, 1, 1, 1]);
        assert_eq!(find(&layers, "vgg16.conv3_2").count, 2);
        assert_eq!(find(&layers, "vgg16.conv4_1").problem.output_hw(), (28, 28));
        let last = find(&layers, "vgg16.conv5_1");
        assert_eq!(
            (shape(last), last.count),
            ([512, 14, 14, 512, 3, 3, 1, 1, 1], 3)
        );
    }

    #[test]
    fn resnet18_shapes() {
        let layers = Model::ResNet18.layers(16, DType::Fp32, Layout::Nchw);
        assert_eq!(shape(&layers[0]), [3, 224, 224, 64, 7, 7, 2, 3, 1]);
        assert_eq!(find(&layers, "resnet18.layer1.0.conv1").count, 4);
        let downsamples: Vec<&ModelLayer> = layers
            .iter()
            .filter(|l| l.name.ends_with("downsample.0"))
            .collect();
        assert_eq!(downsamples.len(), 3);
        assert!(!layers
            .iter()
            .any(|l| l.name.starts_with("resnet18.layer1.0.downsample")));
        // The stride is on the first 3x3 of a stage's first block; its second 3x3 and the next
        // block's two share a shape.
        let first = find(&layers, "resnet18.layer3.0.conv1");
        assert_eq!(shape(first), [128, 28, 28, 256, 3, 3, 2, 1, 1]);
        assert_eq!(first.problem.output_hw(), (14, 14));
        assert_eq!(find(&layers, "resnet18.layer3.0.conv2").count, 3);
        let projection = find(&layers, "resnet18.layer4.0.downsample.0");
        assert_eq!(shape(projection), [256, 14, 14, 512, 1, 1, 2, 0, 1]);
        assert_eq!(projection.problem.output_hw(), (7, 7));
    }

    #[test]
    fn densenet121_shapes() {
        let layers = Model::DenseNet121.layers(8, DType::Fp32, Layout::Nchw);
        let stem = find(&layers, "densenet121.features.conv0");
        assert_eq!(shape(stem), [3, 224, 224, 64, 7, 7, 2, 3, 1]);
        let first = find(
            &layers,
            "densenet121.features.denseblock1.denselayer1.conv1",
        );
        assert_eq!(shape(first), [64, 56, 56, 128, 1, 1, 1, 0, 1]);
        // The 3x3 of every dense layer in a block shares one shape.
        let growth = find(
            &layers,
            "densenet121.features.denseblock3.denselayer1.conv2",
        );
        assert_eq!(
            (shape(growth), growth.count),
            ([128, 14, 14, 32, 3, 3, 1, 1, 1], 24)
        );
        let last = find(
            &layers,
            "densenet121.features.denseblock4.denselayer16.conv1",
        );
        assert_eq!(shape(last), [512 + 15 * 32, 7, 7, 128, 1, 1, 1, 0, 1]);
        let transitions: Vec<[i64; 9]> = (1..=3)
            .map(|t| {
                shape(find(
                    &layers,
                    &format!("densenet121.features.transition{t}.conv"),
                ))
            })
            .collect();
        assert_eq!(
            transitions,
            [
                [256, 56, 56, 128, 1, 1, 1, 0, 1],
                [512, 28, 28, 256, 1, 1, 1, 0, 1],
                [1024, 14, 14, 512, 1, 1, 1, 0, 1]
            ]
        );
    }

    #[test]
    fn mobilenet_v2_shapes() {
        let layers = Model::MobileNetV2.layers(8, DType::Fp16, Layout::Nhwc);
        assert_eq!(shape(&layers[0]), [3, 224, 224, 32, 3, 3, 2, 1, 1]);
        // Without expansion the first block starts with the depthwise conv.
        let dw = find(&layers, "mobilenet_v2.features.1.conv.0.0");
        assert_eq!(shape(dw), [32, 112, 112, 32, 3, 3, 1, 1, 32]);
        assert_eq!(
            shape(find(&layers, "mobilenet_v2.features.1.conv.1")),
            [32, 112, 112, 16, 1, 1, 1, 0, 1]
        );
        let expand = find(&layers, "mobilenet_v2.features.2.conv.0.0");
        assert_eq!(shape(expand), [16, 112, 112, 96, 1, 1, 1, 0, 1]);
        let strided = find(&layers, "mobilenet_v2.features.2.conv.1.0");
        assert_eq!(shape(strided), [96, 112, 112, 96, 3, 3, 2, 1, 96]);
        assert_eq!(strided.problem.output_hw(), (56, 56));
        let project = find(&layers, "mobilenet_v2.features.17.conv.2");
        assert_eq!(shape(project), [960, 7, 7, 320, 1, 1, 1, 0, 1]);
        assert_eq!(
            shape(find(&layers, "mobilenet_v2.features.18.0")),
            [320, 7, 7, 1280, 1, 1, 1, 0, 1]
        );
        // Every depthwise conv: 3x3, groups == input == output channels; 17 of them.
        let depthwise: Vec<&ModelLayer> = layers.iter().filter(|l| l.problem.groups > 1).collect();
        assert_eq!(depthwise.iter().map(|l| l.count).sum::<u32>(), 17);
        for layer in depthwise {
            let p = &layer.problem;
            assert_eq!(
                (p.groups, p.k, p.r, p.s),
                (p.c, p.c, 3, 3),
                "{}",
                layer.name
            );
        }
    }

    #[test]
    fn deepbench_keeps_its_batch_sizes() {
        assert!(Model::DeepBench.fixed_batch() && !Model::Vgg16.fixed_batch());
        let layers = Model::DeepBench.layers(999, DType::Fp32, Layout::Nchw);
        // The first entry: W 700, H 161, C 1, N 4, K 32, S 20, R 5, no padding, stride 2.
        let first = find(&layers, "deepbench.train.0");
        let p = &first.problem;
        assert_eq!(
            (p.n, p.c, p.h, p.w, p.k, p.r, p.s),
            (4, 1, 161, 700, 32, 5, 20)
        );
        assert_eq!((p.pad_h, p.pad_w, p.stride_h, p.stride_w), (0, 0, 2, 2));
        assert_eq!(p.output_hw(), (79, 341));
        // Entry 29: the 7x7 stride-2 stem at N 16.
        let stem = find(&layers, "deepbench.train.29");
        assert_eq!(
            (stem.problem.n, shape(stem)),
            (16, [3, 224, 224, 64, 7, 7, 2, 3, 1])
        );
        // Entry 44: a 1x1 with padding 3 and stride 2, transcribed as it is.
        let odd = find(&layers, "deepbench.train.44");
        assert_eq!(
            (odd.problem.n, shape(odd)),
            (8, [2048, 7, 7, 512, 1, 1, 2, 3, 1])
        );
        // Entry 72 repeats entry 69 (14x14x256 -> 1024, N 8): merged into the first.
        assert_eq!(find(&layers, "deepbench.train.69").count, 2);
        assert!(!layers.iter().any(|l| l.name == "deepbench.train.72"));
        let last = find(&layers, "deepbench.train.93");
        assert_eq!(
            (last.problem.n, shape(last)),
            (16, [2048, 7, 7, 512, 1, 1, 1, 0, 1])
        );
        let batches: std::collections::BTreeSet<i64> = layers.iter().map(|l| l.problem.n).collect();
        assert_eq!(batches.into_iter().collect::<Vec<_>>(), [4, 8, 16, 32]);
    }

    #[test]
    fn dedup_adds_counts() {
        let layer = |name: &str, c, count| ModelLayer {
            name: name.into(),
            problem: ConvProblem::new(1, c, 4, 4, 2, 1, 1),
            count,
        };
        let mut layers = vec![layer("a", 1, 2), layer("b", 2, 1), layer("c", 1, 3)];
        dedup(&mut layers);
        assert_eq!(layers, vec![layer("a", 1, 5), layer("b", 2, 1)]);
    }
}
