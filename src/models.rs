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
//!
//! The 3-D and 1-D models (`r3d_18`, `wan21_vae_decoder`, `wav2vec2_fe`) and the 2-D
//! `sdxl_vae_decoder` also take a [`ModelSize`] ([`Model::layers_sized`]): another input
//! (frames and pixels, samples) and a channel divisor, so that the same structure runs small on
//! a CPU.

use crate::solver::{ConvProblem, DType, Layout, ShapeError};
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
    /// torchvision's video ResNet-18 (`torchvision.models.video.r3d_18`, `VideoResNet` with
    /// `BasicStem`, `BasicBlock` and `Conv3DSimple`): the stem Conv3d 3 -> 64, kernel (3, 7, 7),
    /// stride (1, 2, 2), padding (1, 3, 3); four stages of two basic blocks (64, 128, 256, 512
    /// channels) whose 3x3x3 convolutions have padding 1, a stage's first block striding 2 in
    /// time, height and width on its first 3x3x3, and a 1x1x1 stride-2 `downsample.0` where the
    /// shape changes (stages 2-4). Default clip 16 x 112 x 112: 20 convolutions, 11 distinct.
    R3d18,
    /// The decoder of Wan 2.1's causal video VAE (diffusers' `AutoencoderKLWan`, base_dim 96,
    /// z_dim 16, dim_mult (1, 2, 4, 4), num_res_blocks 2, temporal downsampling
    /// (False, True, True)) as `AutoencoderKLWan.decode` runs it: `post_quant_conv` over the
    /// whole latent, then the decoder once per latent frame ("chunk") with a feature cache.
    /// Default video 17 frames of 480 x 832 (latent 5 x 60 x 104). See [`wan_vae_decoder`]
    /// for the derivation.
    WanVaeDecoder,
    /// The decoder of Stable Diffusion's and SDXL's image VAE (diffusers' `AutoencoderKL`:
    /// `block_out_channels` (128, 256, 512, 512), `layers_per_block` 2, 4 latent channels) as
    /// `AutoencoderKL.decode` runs it untiled: `post_quant_conv`, then the `Decoder`. Default
    /// image 2048 x 2048 (latent 256 x 256): 36 Conv2d, 13 distinct. See [`sdxl_vae_decoder`]
    /// for the derivation.
    SdxlVaeDecoder,
    /// The feature encoder of wav2vec 2.0 (fairseq / transformers' `Wav2Vec2FeatureEncoder`,
    /// `conv_layers.N.conv`): seven Conv1d layers of 512 channels, kernels 10, 3, 3, 3, 3, 2, 2,
    /// strides 5, 2, 2, 2, 2, 2, 2, no padding, on one channel of raw audio; default 1 s at
    /// 16 kHz (16000 samples). 1-D problems: 2-D with unit height.
    Wav2Vec2Fe,
}

/// The input and width of a zoo model where the caller may choose them
/// ([`Model::layers_sized`]; the CLI's `--input` and `--channel-divisor`). Only the 3-D and
/// 1-D models and `sdxl_vae_decoder` take them; the other 2-D models keep their reference
/// input.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelSize {
    /// The input's extents in the model's own terms ([`Model::input_form`]): `[D, H, W]` for
    /// `r3d_18`, `[frames, height, width]` of the decoded video for `wan21_vae_decoder`,
    /// `[height, width]` of the decoded image for `sdxl_vae_decoder`, `[samples]` for `wav2vec2_fe`. `None`: the model's default ([`Model::default_input`]).
    pub input: Option<Vec<i64>>,
    /// Every channel count inside the network is divided by this (the network's input and
    /// output channels stay: 3 colours, 16 or 4 latent channels, 1 audio channel). It must divide
    /// the model's base width exactly. 1: the reference width.
    pub channel_divisor: i64,
}

impl Default for ModelSize {
    fn default() -> Self {
        ModelSize {
            input: None,
            channel_divisor: 1,
        }
    }
}

/// Why a [`ModelSize`] does not make the model.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    #[error(
        "{model} has a fixed input and width: --input and --channel-divisor apply to {}",
        sized_models()
    )]
    FixedSize { model: Model },
    #[error("--input for {model}: {message} (expected {form}; default {default})")]
    Input {
        model: Model,
        message: String,
        form: &'static str,
        default: String,
    },
    #[error("--channel-divisor {divisor} for {model}: it must be a positive divisor of the base width {base}")]
    Divisor {
        model: Model,
        divisor: i64,
        base: i64,
    },
    #[error("{layer}: {source}")]
    Shape { layer: String, source: ShapeError },
}

fn sized_models() -> String {
    Model::ALL
        .iter()
        .filter(|m| m.default_input().is_some())
        .map(|m| m.name())
        .collect::<Vec<_>>()
        .join(", ")
}

impl Model {
    pub const ALL: [Model; 11] = [
        Model::AlexNet,
        Model::ResNet50,
        Model::Vgg16,
        Model::ResNet18,
        Model::DenseNet121,
        Model::MobileNetV2,
        Model::DeepBench,
        Model::R3d18,
        Model::WanVaeDecoder,
        Model::SdxlVaeDecoder,
        Model::Wav2Vec2Fe,
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
            Model::R3d18 => "r3d_18",
            Model::WanVaeDecoder => "wan21_vae_decoder",
            Model::SdxlVaeDecoder => "sdxl_vae_decoder",
            Model::Wav2Vec2Fe => "wav2vec2_fe",
        }
    }

    /// The model's default input where [`ModelSize::input`] may change it (`None`: the input
    /// is fixed).
    pub fn default_input(self) -> Option<&'static [i64]> {
        match self {
            Model::R3d18 => Some(&[16, 112, 112]),
            Model::WanVaeDecoder => Some(&[17, 480, 832]),
            Model::SdxlVaeDecoder => Some(&[2048, 2048]),
            Model::Wav2Vec2Fe => Some(&[16000]),
            _ => None,
        }
    }

    /// How [`ModelSize::input`] is written for this model (for messages and help).
    pub fn input_form(self) -> &'static str {
        match self {
            Model::R3d18 => "DEPTHxHEIGHTxWIDTH of the clip",
            Model::WanVaeDecoder => {
                "FRAMESxHEIGHTxWIDTH of the decoded video: frames 1 + 4k, height and width multiples of 8"
            }
            Model::SdxlVaeDecoder => {
                "HEIGHTxWIDTH of the decoded image: multiples of 8"
            }
            Model::Wav2Vec2Fe => "SAMPLES of audio",
            _ => "nothing: the input is fixed",
        }
    }

    /// The width [`ModelSize::channel_divisor`] divides (the narrowest base channel count).
    fn base_width(self) -> i64 {
        match self {
            Model::R3d18 => 64,
            Model::WanVaeDecoder => 96,
            Model::SdxlVaeDecoder => 128,
            Model::Wav2Vec2Fe => 512,
            _ => 1,
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
            Model::R3d18 => {
                "torchvision video ResNet-18 (R3D), 20 Conv3d (11 distinct), 16x112x112 clip"
            }
            Model::WanVaeDecoder => {
                "Wan 2.1 causal video VAE decoder (diffusers AutoencoderKLWan), chunked decode, 17x480x832"
            }
            Model::SdxlVaeDecoder => {
                "SD/SDXL image VAE decoder (diffusers AutoencoderKL), 36 Conv2d (13 distinct), 2048x2048"
            }
            Model::Wav2Vec2Fe => {
                "wav2vec 2.0 feature encoder, 7 Conv1d (512 channels), 16000 samples"
            }
        }
    }

    /// Whether the model's problems carry their own batch sizes, so that [`Model::layers`]
    /// ignores its `n` (DeepBench). A CLI should say so when the user passed a batch size.
    pub fn fixed_batch(self) -> bool {
        self == Model::DeepBench
    }

    /// The distinct conv layers at batch `n`, in network order (for [`Model::DeepBench`] `n` is
    /// ignored: every problem keeps DeepBench's batch size), at the model's default input.
    pub fn layers(self, n: i64, dtype: DType, layout: Layout) -> Vec<ModelLayer> {
        // The default size is valid for every model (`every_model_is_valid_and_distinct`).
        self.layers_sized(n, dtype, layout, &ModelSize::default())
            .expect("a zoo model at its default size is valid")
    }

    /// [`Model::layers`] at another input and width ([`ModelSize`]). Every problem is validated
    /// at batch size 1, so an input too small for the network is an error naming the layer; a
    /// tensor too large at batch `n` is left to the caller's [`ConvProblem::validate`], as for
    /// [`Model::layers`]. A 2-D model takes only the default size.
    pub fn layers_sized(
        self,
        n: i64,
        dtype: DType,
        layout: Layout,
        size: &ModelSize,
    ) -> Result<Vec<ModelLayer>, ModelError> {
        let Some(default_input) = self.default_input() else {
            if *size != ModelSize::default() {
                return Err(ModelError::FixedSize { model: self });
            }
            return Ok(self.layers_2d(n, dtype, layout));
        };
        let input = size.input.as_deref().unwrap_or(default_input);
        let bad_input = |message: String| ModelError::Input {
            model: self,
            message,
            form: self.input_form(),
            default: default_input
                .iter()
                .map(i64::to_string)
                .collect::<Vec<_>>()
                .join("x"),
        };
        if input.len() != default_input.len() {
            return Err(bad_input(format!(
                "{} values given, {} wanted",
                input.len(),
                default_input.len()
            )));
        }
        if let Some(&v) = input.iter().find(|&&v| v < 1) {
            return Err(bad_input(format!("{v} is not a positive size")));
        }
        let divisor = size.channel_divisor;
        let base = self.base_width();
        if divisor < 1 || base % divisor != 0 {
            return Err(ModelError::Divisor {
                model: self,
                divisor,
                base,
            });
        }
        let mut layers = match self {
            Model::R3d18 => r3d_18(n, [input[0], input[1], input[2]], base / divisor),
            Model::WanVaeDecoder => {
                let [frames, height, width] = [input[0], input[1], input[2]];
                if frames % 4 != 1 {
                    return Err(bad_input(format!(
                        "{frames} frames: the decoder makes 1 + 4k frames from 1 + k latent frames"
                    )));
                }
                if height % 8 != 0 || width % 8 != 0 {
                    return Err(bad_input(format!(
                        "{height}x{width}: the latent is 8 times smaller, so both must be multiples of 8"
                    )));
                }
                wan_vae_decoder(n, 1 + frames / 4, height / 8, width / 8, base / divisor)
            }
            Model::SdxlVaeDecoder => {
                let [height, width] = [input[0], input[1]];
                if height % 8 != 0 || width % 8 != 0 {
                    return Err(bad_input(format!(
                        "{height}x{width}: the latent is 8 times smaller, so both must be multiples of 8"
                    )));
                }
                sdxl_vae_decoder(n, height / 8, width / 8, base / divisor)
            }
            Model::Wav2Vec2Fe => wav2vec2_feature_encoder(n, input[0], base / divisor),
            _ => unreachable!("2-D models return above"),
        };
        for layer in &mut layers {
            layer.name = format!("{}.{}", self.name(), layer.name);
            layer.problem.dtype = dtype;
            layer.problem.layout = layout;
        }
        dedup(&mut layers);
        validate(&layers)?;
        Ok(layers)
    }

    /// The 2-D models at their reference input.
    fn layers_2d(self, n: i64, dtype: DType, layout: Layout) -> Vec<ModelLayer> {
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
            Model::R3d18 | Model::WanVaeDecoder | Model::SdxlVaeDecoder | Model::Wav2Vec2Fe => {
                Vec::new()
            }
        };
        dedup(&mut layers);
        layers
    }
}

fn validate(layers: &[ModelLayer]) -> Result<(), ModelError> {
    for layer in layers {
        layer
            .problem
            .validate()
            .map_err(|source| ModelError::Shape {
                layer: layer.name.clone(),
                source,
            })?;
    }
    Ok(())
}

/// The filters of a 3-D layer: `k` of them, `[t, r, s]` taps each, applied with `stride` and
/// `pad` (each `[depth, height, width]`).
struct Filters3d {
    k: i64,
    taps: [i64; 3],
    stride: [i64; 3],
    pad: [i64; 3],
}

/// A 3-D layer over `n` inputs of `c` channels and `[d, h, w]` elements.
fn conv3d(
    name: String,
    n: i64,
    c: i64,
    [d, h, w]: [i64; 3],
    filters: Filters3d,
    count: u32,
) -> ModelLayer {
    let Filters3d {
        k,
        taps: [t, r, s],
        stride: [stride_d, stride_h, stride_w],
        pad: [pad_d, pad_h, pad_w],
    } = filters;
    ModelLayer {
        name,
        problem: ConvProblem {
            pad_d,
            pad_h,
            pad_w,
            stride_d,
            stride_h,
            stride_w,
            ..ConvProblem::new_3d(n, c, d, h, w, k, t, r, s)
        },
        count,
    }
}

/// torchvision's `r3d_18` (`torchvision/models/video/resnet.py`): `VideoResNet(BasicBlock,
/// [Conv3DSimple] * 4, [2, 2, 2, 2], BasicStem)`. `width` is the stem's output channels (64).
/// Layer names are torchvision's module paths (`stem.0`, `layer2.0.conv1.0`,
/// `layer2.0.downsample.0`). Output sizes follow from each problem, so any clip works.
fn r3d_18(n: i64, clip: [i64; 3], width: i64) -> Vec<ModelLayer> {
    let stem = conv3d(
        "stem.0".into(),
        n,
        3,
        clip,
        Filters3d {
            k: width,
            taps: [3, 7, 7],
            stride: [1, 2, 2],
            pad: [1, 3, 3],
        },
        1,
    );
    let out = |layer: &ModelLayer| {
        let (o, p, q) = layer.problem.output_dhw();
        [o, p, q]
    };
    let mut size = out(&stem);
    let mut all = vec![stem];
    let mut in_channels = width;
    for (stage, multiple) in [(1, 1), (2, 2), (3, 4), (4, 8)] {
        let planes = width * multiple;
        let stride = if stage == 1 { 1 } else { 2 };
        for block in 0..2 {
            let prefix = format!("layer{stage}.{block}");
            let block_stride = if block == 0 { stride } else { 1 };
            let block_in = if block == 0 { in_channels } else { planes };
            // Conv3DSimple: kernel (3, 3, 3), padding 1, the block's stride on all three axes.
            let conv1 = conv3d(
                format!("{prefix}.conv1.0"),
                n,
                block_in,
                size,
                Filters3d {
                    k: planes,
                    taps: [3; 3],
                    stride: [block_stride; 3],
                    pad: [1; 3],
                },
                1,
            );
            let block_out = out(&conv1);
            all.push(conv1);
            all.push(conv3d(
                format!("{prefix}.conv2.0"),
                n,
                planes,
                block_out,
                Filters3d {
                    k: planes,
                    taps: [3; 3],
                    stride: [1; 3],
                    pad: [1; 3],
                },
                1,
            ));
            // torchvision adds the projection where the stride or the channels change.
            if block == 0 && (stride != 1 || in_channels != planes) {
                all.push(conv3d(
                    format!("{prefix}.downsample.0"),
                    n,
                    in_channels,
                    size,
                    Filters3d {
                        k: planes,
                        taps: [1; 3],
                        stride: [stride; 3],
                        pad: [0; 3],
                    },
                    1,
                ));
            }
            size = block_out;
        }
        in_channels = planes;
    }
    all
}

/// The decoder of Wan 2.1's VAE as diffusers runs it, at `latent_frames` x `latent_h` x
/// `latent_w` (the video is `1 + 4 (latent_frames - 1)` frames of 8x the size), with base width
/// `base_dim` (96).
///
/// Derived from diffusers' `src/diffusers/models/autoencoders/autoencoder_kl_wan.py`
/// (`AutoencoderKLWan`, `WanDecoder3d`, `WanUpBlock`, `WanResidualBlock`, `WanResample`,
/// `WanMidBlock`, `WanAttentionBlock`, `WanCausalConv3d`; huggingface/diffusers at commit
/// 022e259c), Wan 2.1's configuration (`base_dim = 96`, `z_dim = 16`, `dim_mult = [1, 2, 4, 4]`,
/// `num_res_blocks = 2`, `attn_scales = []`, `temperal_downsample = [False, True, True]`, so the
/// decoder's `temperal_upsample = [True, True, False]`; `is_residual = False`):
///
/// - `WanCausalConv3d(kernel 3, padding 1)` pads height and width by 1 on both sides and time
///   by 2 frames *before* the input only (`_padding = (1, 1, 1, 1, 2, 0)`; Conv3d's own padding
///   is 0). `_decode` runs `post_quant_conv` (1x1x1, z_dim -> z_dim) over the whole latent and
///   then the decoder on one latent frame at a time, with a feature cache: each causal conv's
///   input is its current `T` frames behind the cached last two frames of the previous chunk
///   (zeros in the first chunk), so it is always `T + 2` frames with no padding. That is how the
///   problems here are written: depth `T + 2`, `pad_d = 0`, kernel depth 3, output depth `T`.
/// - Channels: `dims = [384, 384, 384, 192, 96]` (`base_dim * [4] + dim_mult[::-1]`).
///   `conv_in` z_dim -> 384; the mid block: residual block, attention (`to_qkv` 1x1 Conv2d
///   384 -> 1152, `proj` 1x1 Conv2d 384 -> 384, over the `b * T` frames), residual block. Up
///   block `i` has `num_res_blocks + 1 = 3` residual blocks (conv1, conv2: 3x3x3; a 1x1x1
///   `conv_shortcut` where channels change), the input of blocks 1-3 being half of `dims[i]`
///   (the upsampler before halved it): 384 -> 384, 192 -> 384, 192 -> 192, 96 -> 96. Blocks 0
///   and 1 end in `upsample3d`, block 2 in `upsample2d`: a nearest 2x upsample and a 3x3 Conv2d
///   `dim -> dim / 2` over the `b * T` frames; `upsample3d` first runs `time_conv`, a causal
///   (3, 1, 1) conv `dim -> 2 dim` whose output is read as twice the frames, except in the first
///   chunk (`feat_cache` holds "Rep": no time conv, one frame stays one). `conv_out` 96 -> 3.
/// - Frames per chunk: the first chunk has `T = 1` throughout (it decodes to 1 frame); every
///   later chunk has `T = 1` at the latent size, 2 after the first `upsample3d`, 4 after the
///   second (4 frames per latent frame: 1 + 4 (L - 1) frames in all).
///
/// Layers are named by their module paths under `decoder.`; a shape that occurs only in the
/// first chunk is named `...@chunk0`. Counts are per decode: the later chunks' layers occur
/// `L - 1` times each.
fn wan_vae_decoder(
    n: i64,
    latent_frames: i64,
    latent_h: i64,
    latent_w: i64,
    base_dim: i64,
) -> Vec<ModelLayer> {
    const Z_DIM: i64 = 16;
    const OUT_CHANNELS: i64 = 3;
    let dims = [4, 4, 4, 2, 1].map(|m| base_dim * m);
    let later_chunks = u32::try_from(latent_frames - 1).unwrap_or(u32::MAX);
    let mut all = vec![conv3d(
        "post_quant_conv".into(),
        n,
        Z_DIM,
        [latent_frames, latent_h, latent_w],
        Filters3d {
            k: Z_DIM,
            taps: [1; 3],
            stride: [1; 3],
            pad: [0; 3],
        },
        1,
    )];
    // One decoder call on a chunk: `first` is the first chunk (no temporal upsampling).
    let chunk = |first: bool, count: u32| {
        let suffix = if first { "@chunk0" } else { "" };
        let mut layers = Vec::new();
        // A causal 3x3x3 (or (3, 1, 1)) conv over `frames` frames behind two cached ones.
        let causal = |layers: &mut Vec<ModelLayer>,
                      name: &str,
                      c,
                      k,
                      frames,
                      hw: [i64; 2],
                      kernel_hw: i64| {
            let pad = kernel_hw / 2;
            layers.push(conv3d(
                format!("decoder.{name}{suffix}"),
                n,
                c,
                [frames + 2, hw[0], hw[1]],
                Filters3d {
                    k,
                    taps: [3, kernel_hw, kernel_hw],
                    stride: [1; 3],
                    pad: [0, pad, pad],
                },
                count,
            ));
        };
        // A 2-D conv over the chunk's frames folded into the batch.
        let per_frame =
            |layers: &mut Vec<ModelLayer>, name: &str, c, k, frames: i64, hw: [i64; 2], rs: i64| {
                layers.push(ModelLayer {
                    name: format!("decoder.{name}{suffix}"),
                    problem: ConvProblem {
                        pad_h: rs / 2,
                        pad_w: rs / 2,
                        ..ConvProblem::new(n * frames, c, hw[0], hw[1], k, rs, rs)
                    },
                    count,
                });
            };
        let residual = |layers: &mut Vec<ModelLayer>, prefix: &str, c_in, c_out, frames, hw| {
            causal(
                layers,
                &format!("{prefix}.conv1"),
                c_in,
                c_out,
                frames,
                hw,
                3,
            );
            causal(
                layers,
                &format!("{prefix}.conv2"),
                c_out,
                c_out,
                frames,
                hw,
                3,
            );
            if c_in != c_out {
                // WanCausalConv3d(in, out, 1): no padding, so the chunk's own frames only.
                layers.push(conv3d(
                    format!("decoder.{prefix}.conv_shortcut{suffix}"),
                    n,
                    c_in,
                    [frames, hw[0], hw[1]],
                    Filters3d {
                        k: c_out,
                        taps: [1; 3],
                        stride: [1; 3],
                        pad: [0; 3],
                    },
                    count,
                ));
            }
        };
        let mut hw = [latent_h, latent_w];
        let mut frames = 1;
        causal(&mut layers, "conv_in", Z_DIM, dims[0], frames, hw, 3);
        residual(
            &mut layers,
            "mid_block.resnets.0",
            dims[0],
            dims[0],
            frames,
            hw,
        );
        per_frame(
            &mut layers,
            "mid_block.attentions.0.to_qkv",
            dims[0],
            3 * dims[0],
            frames,
            hw,
            1,
        );
        per_frame(
            &mut layers,
            "mid_block.attentions.0.proj",
            dims[0],
            dims[0],
            frames,
            hw,
            1,
        );
        residual(
            &mut layers,
            "mid_block.resnets.1",
            dims[0],
            dims[0],
            frames,
            hw,
        );
        // (up block, temporal upsampling) for the three upsampling blocks; block 3 has none.
        let temporal = [true, true, false];
        for block in 0..4 {
            let in_dim = if block == 0 { dims[0] } else { dims[block] / 2 };
            let out_dim = dims[block + 1];
            let mut c = in_dim;
            for resnet in 0..3 {
                let prefix = format!("up_blocks.{block}.resnets.{resnet}");
                residual(&mut layers, &prefix, c, out_dim, frames, hw);
                c = out_dim;
            }
            if block < 3 {
                let prefix = format!("up_blocks.{block}.upsamplers.0");
                if temporal[block] && !first {
                    causal(
                        &mut layers,
                        &format!("{prefix}.time_conv"),
                        out_dim,
                        2 * out_dim,
                        frames,
                        hw,
                        1,
                    );
                    frames *= 2;
                }
                hw = [hw[0] * 2, hw[1] * 2];
                per_frame(
                    &mut layers,
                    &format!("{prefix}.resample.1"),
                    out_dim,
                    out_dim / 2,
                    frames,
                    hw,
                    3,
                );
            }
        }
        causal(
            &mut layers,
            "conv_out",
            dims[4],
            OUT_CHANNELS,
            frames,
            hw,
            3,
        );
        layers
    };
    // The later chunks first, so that shapes shared with the first chunk keep the plain name.
    if later_chunks > 0 {
        all.extend(chunk(false, later_chunks));
    }
    all.extend(chunk(true, 1));
    all
}

/// The decoder of Stable Diffusion's and SDXL's VAE as diffusers runs it untiled, on a
/// `latent_h` x `latent_w` latent (the image is 8 times larger), with base width `width` (128).
///
/// Derived from diffusers' `src/diffusers/models/autoencoders/vae.py` (`Decoder`;
/// huggingface/diffusers at commit 04957c20) with the blocks it builds
/// (`unet_2d_blocks.py`: `UNetMidBlock2D`, `UpDecoderBlock2D`; `resnet.py`: `ResnetBlock2D`;
/// `upsampling.py`: `Upsample2D`) and `autoencoder_kl.py` (`AutoencoderKL`, whose `_decode` runs
/// `post_quant_conv` then the decoder), in SD 1.x's and SDXL's configuration:
/// `latent_channels = 4`, `block_out_channels = (128, 256, 512, 512)`, `layers_per_block = 2`,
/// `up_block_types = ("UpDecoderBlock2D",) * 4`, `use_post_quant_conv = True`:
///
/// - `post_quant_conv`: 1x1, 4 -> 4, on the latent. `Decoder.conv_in`: 3x3 padding 1, 4 -> 512.
/// - `mid_block` (`UNetMidBlock2D`): two `ResnetBlock2D` 512 -> 512 around one attention whose
///   projections are `nn.Linear` (no convolutions).
/// - Up blocks over the reversed channels (512, 512, 256, 128): block `i` has
///   `layers_per_block + 1 = 3` resnets, the first from the previous block's channels; each
///   `ResnetBlock2D` is `conv1` (3x3, in -> out), `conv2` (3x3, out -> out) and a 1x1
///   `conv_shortcut` where in != out (blocks 2 and 3: 512 -> 256, 256 -> 128). Blocks 0-2 end
///   in `upsamplers.0` (`Upsample2D(use_conv=True)`): nearest 2x, then `conv` 3x3, out -> out.
/// - `conv_out`: 3x3, 128 -> 3 at the image's size.
///
/// All 3x3 convolutions have stride 1 and padding 1. Layers are named by their module paths
/// (`decoder.up_blocks.2.resnets.0.conv1`); a shape is named after its first layer in
/// `Decoder.forward`'s order. Counts are per decode.
fn sdxl_vae_decoder(n: i64, latent_h: i64, latent_w: i64, width: i64) -> Vec<ModelLayer> {
    const LATENT: i64 = 4;
    const OUT_CHANNELS: i64 = 3;
    let conv = |name: String, c, hw: [i64; 2], k, rs: i64| ModelLayer {
        name,
        problem: ConvProblem {
            pad_h: rs / 2,
            pad_w: rs / 2,
            ..ConvProblem::new(n, c, hw[0], hw[1], k, rs, rs)
        },
        count: 1,
    };
    let resnet = |all: &mut Vec<ModelLayer>, prefix: &str, c_in, c_out, hw| {
        all.push(conv(format!("decoder.{prefix}.conv1"), c_in, hw, c_out, 3));
        all.push(conv(format!("decoder.{prefix}.conv2"), c_out, hw, c_out, 3));
        if c_in != c_out {
            all.push(conv(
                format!("decoder.{prefix}.conv_shortcut"),
                c_in,
                hw,
                c_out,
                1,
            ));
        }
    };
    let top = 4 * width;
    let mut hw = [latent_h, latent_w];
    let mut all = vec![
        conv("post_quant_conv".into(), LATENT, hw, LATENT, 1),
        conv("decoder.conv_in".into(), LATENT, hw, top, 3),
    ];
    resnet(&mut all, "mid_block.resnets.0", top, top, hw);
    resnet(&mut all, "mid_block.resnets.1", top, top, hw);
    // reversed(block_out_channels)
    let channels = [top, top, 2 * width, width];
    let mut c = top;
    for (block, out) in channels.into_iter().enumerate() {
        for index in 0..3 {
            resnet(
                &mut all,
                &format!("up_blocks.{block}.resnets.{index}"),
                c,
                out,
                hw,
            );
            c = out;
        }
        if block < 3 {
            hw = [hw[0] * 2, hw[1] * 2];
            all.push(conv(
                format!("decoder.up_blocks.{block}.upsamplers.0.conv"),
                out,
                hw,
                out,
                3,
            ));
        }
    }
    all.push(conv("decoder.conv_out".into(), width, hw, OUT_CHANNELS, 3));
    all
}

/// wav2vec 2.0's feature encoder (fairseq's `ConvFeatureExtractionModel`, transformers'
/// `Wav2Vec2FeatureEncoder` with `conv_dim = (512,) * 7`, `conv_kernel = (10, 3, 3, 3, 3, 2,
/// 2)`, `conv_stride = (5, 2, 2, 2, 2, 2, 2)`, no padding) over `samples` samples of one
/// channel; `width` is 512. Names are transformers' `feature_extractor.conv_layers.N.conv`.
fn wav2vec2_feature_encoder(n: i64, samples: i64, width: i64) -> Vec<ModelLayer> {
    let mut all = Vec::new();
    let (mut channels, mut length) = (1, samples);
    for (index, (kernel, stride)) in [(10, 5), (3, 2), (3, 2), (3, 2), (3, 2), (2, 2), (2, 2)]
        .into_iter()
        .enumerate()
    {
        let problem = ConvProblem {
            stride_w: stride,
            ..ConvProblem::new_1d(n, channels, length, width, kernel)
        };
        // Shorter than the kernel: validate() names the layer; stop deriving lengths there.
        let next = (length - kernel) / stride + 1;
        all.push(ModelLayer {
            name: format!("feature_extractor.conv_layers.{index}.conv"),
            problem,
            count: 1,
        });
        if next < 1 {
            break;
        }
        (channels, length) = (width, next);
    }
    all
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
                // The decoder's 480p tensors exceed 2^31 elements from batch 3 on, the image
                // decoder's 2048x2048 ones (256 x 2048 x 2048 per sample) from batch 2.
                let n = match model {
                    Model::WanVaeDecoder => n.min(2),
                    Model::SdxlVaeDecoder => 1,
                    _ => n,
                };
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
                    if model == Model::WanVaeDecoder {
                        // Per-frame Conv2d layers fold the chunk's frames into the batch.
                        assert_eq!(layer.problem.n % n, 0, "{}", layer.name);
                    } else if !model.fixed_batch() {
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
            (Model::R3d18, 20, 11),
            // 1 + 4 later chunks x 38 convolutions + the first chunk's 36 (no time_conv).
            (Model::WanVaeDecoder, 189, 25),
            // 1 + 1 + 4 (mid block) + 24 resnet convs + 2 shortcuts + 3 upsamplers + 1.
            (Model::SdxlVaeDecoder, 36, 13),
            (Model::Wav2Vec2Fe, 7, 7),
        ] {
            let layers = model.layers(1, DType::Fp32, Layout::Nchw);
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

    /// (c, d, h, w, k, t, r, s, stride d/h/w, pad d/h/w) of a 3-D layer.
    fn shape3(layer: &ModelLayer) -> [i64; 14] {
        let p = &layer.problem;
        [
            p.c, p.d, p.h, p.w, p.k, p.t, p.r, p.s, p.stride_d, p.stride_h, p.stride_w, p.pad_d,
            p.pad_h, p.pad_w,
        ]
    }

    /// torchvision's r3d_18: 20 Conv3d (stem, 16 in the basic blocks, 3 downsamples), 11
    /// distinct at the 16x112x112 clip.
    #[test]
    fn r3d_18_shapes() {
        let layers = Model::R3d18.layers(2, DType::Fp16, Layout::Nhwc);
        let stem = find(&layers, "r3d_18.stem.0");
        assert_eq!(
            shape3(stem),
            [3, 16, 112, 112, 64, 3, 7, 7, 1, 2, 2, 1, 3, 3]
        );
        assert_eq!(stem.problem.output_dhw(), (16, 56, 56));
        assert_eq!(stem.problem.layout_name(), "ndhwc");
        // layer1's four 3x3x3 convolutions share one shape; no downsample in layer1.
        let layer1 = find(&layers, "r3d_18.layer1.0.conv1.0");
        assert_eq!(
            (shape3(layer1), layer1.count),
            ([64, 16, 56, 56, 64, 3, 3, 3, 1, 1, 1, 1, 1, 1], 4)
        );
        assert!(!layers
            .iter()
            .any(|l| l.name.contains("layer1.0.downsample")));
        // Conv3DSimple strides all three axes; the downsample is 1x1x1 with stride 2.
        let strided = find(&layers, "r3d_18.layer2.0.conv1.0");
        assert_eq!(
            shape3(strided),
            [64, 16, 56, 56, 128, 3, 3, 3, 2, 2, 2, 1, 1, 1]
        );
        assert_eq!(strided.problem.output_dhw(), (8, 28, 28));
        assert_eq!(find(&layers, "r3d_18.layer2.0.conv2.0").count, 3);
        let projection = find(&layers, "r3d_18.layer4.0.downsample.0");
        assert_eq!(
            shape3(projection),
            [256, 4, 14, 14, 512, 1, 1, 1, 2, 2, 2, 0, 0, 0]
        );
        assert_eq!(projection.problem.output_dhw(), (2, 7, 7));
        let convs = layers.iter().filter(|l| l.problem.is_3d()).count();
        assert_eq!(convs, layers.len());
    }

    /// The decoder's table at 480p x 17 frames (the derivation is on `wan_vae_decoder`).
    #[test]
    fn wan_vae_decoder_shapes() {
        let layers = Model::WanVaeDecoder.layers(1, DType::Fp16, Layout::Nhwc);
        let check = |name: &str, c, dhw: [i64; 3], k, kernel: [i64; 3], count| {
            let layer = find(&layers, &format!("wan21_vae_decoder.{name}"));
            let p = &layer.problem;
            let pad = kernel[1] / 2;
            assert_eq!(
                (p.c, [p.d, p.h, p.w], p.k, [p.t, p.r, p.s], layer.count),
                (c, dhw, k, kernel, count),
                "{name}"
            );
            // Causal in time: never padded there; height and width keep their size.
            assert_eq!((p.pad_d, p.pad_h, p.pad_w), (0, pad, pad), "{name}");
            assert_eq!(
                (p.stride_d, p.stride_h, p.stride_w, p.groups),
                (1, 1, 1, 1),
                "{name}"
            );
            let (o, q, r) = p.output_dhw();
            assert_eq!((q, r), (dhw[1], dhw[2]), "{name}");
            o
        };
        assert_eq!(
            check("post_quant_conv", 16, [5, 60, 104], 16, [1, 1, 1], 1),
            5
        );
        // Every chunk: one latent frame behind two cached (or zero) frames.
        assert_eq!(
            check("decoder.conv_in", 16, [3, 60, 104], 384, [3, 3, 3], 5),
            1
        );
        check(
            "decoder.mid_block.resnets.0.conv1",
            384,
            [3, 60, 104],
            384,
            [3, 3, 3],
            50,
        );
        check(
            "decoder.up_blocks.0.upsamplers.0.time_conv",
            384,
            [3, 60, 104],
            768,
            [3, 1, 1],
            4,
        );
        check(
            "decoder.up_blocks.1.resnets.0.conv1",
            192,
            [4, 120, 208],
            384,
            [3, 3, 3],
            4,
        );
        check(
            "decoder.up_blocks.1.resnets.0.conv1@chunk0",
            192,
            [3, 120, 208],
            384,
            [3, 3, 3],
            1,
        );
        check(
            "decoder.up_blocks.1.resnets.0.conv_shortcut",
            192,
            [2, 120, 208],
            384,
            [1, 1, 1],
            4,
        );
        check(
            "decoder.up_blocks.1.resnets.0.conv2",
            384,
            [4, 120, 208],
            384,
            [3, 3, 3],
            20,
        );
        check(
            "decoder.up_blocks.1.upsamplers.0.time_conv",
            384,
            [4, 120, 208],
            768,
            [3, 1, 1],
            4,
        );
        check(
            "decoder.up_blocks.2.resnets.0.conv1",
            192,
            [6, 240, 416],
            192,
            [3, 3, 3],
            24,
        );
        check(
            "decoder.up_blocks.3.resnets.0.conv1",
            96,
            [6, 480, 832],
            96,
            [3, 3, 3],
            24,
        );
        check(
            "decoder.up_blocks.3.resnets.0.conv1@chunk0",
            96,
            [3, 480, 832],
            96,
            [3, 3, 3],
            6,
        );
        assert_eq!(
            check("decoder.conv_out", 96, [6, 480, 832], 3, [3, 3, 3], 4),
            4
        );
        check(
            "decoder.conv_out@chunk0",
            96,
            [3, 480, 832],
            3,
            [3, 3, 3],
            1,
        );
        // The first chunk's shortcut sees one frame: a 2-D problem.
        let first = find(
            &layers,
            "wan21_vae_decoder.decoder.up_blocks.1.resnets.0.conv_shortcut@chunk0",
        );
        assert!(!first.problem.is_3d());
        // Per-frame Conv2d: the chunk's frames are the batch.
        let to_qkv = find(
            &layers,
            "wan21_vae_decoder.decoder.mid_block.attentions.0.to_qkv",
        );
        assert_eq!(
            (to_qkv.problem.n, shape(to_qkv), to_qkv.count),
            (1, [384, 60, 104, 1152, 1, 1, 1, 0, 1], 5)
        );
        let resample = find(
            &layers,
            "wan21_vae_decoder.decoder.up_blocks.2.upsamplers.0.resample.1",
        );
        assert_eq!(
            (resample.problem.n, shape(resample), resample.count),
            (4, [192, 480, 832, 96, 3, 3, 1, 1, 1], 4)
        );
        // 17 frames out: 1 from the first chunk, 4 from each later one (conv_out's depth).
        let frames: i64 = layers
            .iter()
            .filter(|l| l.name.starts_with("wan21_vae_decoder.decoder.conv_out"))
            .map(|l| l.problem.output_dhw().0 * i64::from(l.count))
            .sum();
        assert_eq!(frames, 17);
    }

    #[test]
    fn sdxl_vae_decoder_shapes() {
        let layers = Model::SdxlVaeDecoder.layers(1, DType::Fp16, Layout::Nhwc);
        let by = |name: &str| {
            let layer = find(&layers, &format!("sdxl_vae_decoder.{name}"));
            (shape(layer), layer.count)
        };
        // [c, h, w, k, r, s, stride, pad, groups], count; latent 256x256, image 2048x2048.
        for (name, expected, count) in [
            ("post_quant_conv", [4, 256, 256, 4, 1, 1, 1, 0, 1], 1),
            ("decoder.conv_in", [4, 256, 256, 512, 3, 3, 1, 1, 1], 1),
            // The mid block's 4 and up block 0's 6 resnet convolutions.
            (
                "decoder.mid_block.resnets.0.conv1",
                [512, 256, 256, 512, 3, 3, 1, 1, 1],
                10,
            ),
            // Up block 0's upsampler conv at 512x512, and up block 1's 6 resnet convolutions.
            (
                "decoder.up_blocks.0.upsamplers.0.conv",
                [512, 512, 512, 512, 3, 3, 1, 1, 1],
                7,
            ),
            (
                "decoder.up_blocks.1.upsamplers.0.conv",
                [512, 1024, 1024, 512, 3, 3, 1, 1, 1],
                1,
            ),
            (
                "decoder.up_blocks.2.resnets.0.conv1",
                [512, 1024, 1024, 256, 3, 3, 1, 1, 1],
                1,
            ),
            (
                "decoder.up_blocks.2.resnets.0.conv2",
                [256, 1024, 1024, 256, 3, 3, 1, 1, 1],
                5,
            ),
            (
                "decoder.up_blocks.2.resnets.0.conv_shortcut",
                [512, 1024, 1024, 256, 1, 1, 1, 0, 1],
                1,
            ),
            (
                "decoder.up_blocks.2.upsamplers.0.conv",
                [256, 2048, 2048, 256, 3, 3, 1, 1, 1],
                1,
            ),
            (
                "decoder.up_blocks.3.resnets.0.conv1",
                [256, 2048, 2048, 128, 3, 3, 1, 1, 1],
                1,
            ),
            (
                "decoder.up_blocks.3.resnets.0.conv2",
                [128, 2048, 2048, 128, 3, 3, 1, 1, 1],
                5,
            ),
            (
                "decoder.up_blocks.3.resnets.0.conv_shortcut",
                [256, 2048, 2048, 128, 1, 1, 1, 0, 1],
                1,
            ),
            ("decoder.conv_out", [128, 2048, 2048, 3, 3, 3, 1, 1, 1], 1),
        ] {
            assert_eq!(by(name), (expected, count), "{name}");
        }
        assert!(layers.iter().all(|l| l.problem.n == 1
            && l.problem.dtype == DType::Fp16
            && l.problem.layout == Layout::Nhwc
            && l.problem.output_hw() == (l.problem.h, l.problem.w)));
        // No layer of the up blocks' later resnets or of block 3 upsamples (the last block).
        assert!(!layers
            .iter()
            .any(|l| l.name.contains("up_blocks.3.upsamplers")));

        // Another image and width: 1024x768 (latent 128x96), channels / 4 (128, 64, 32).
        let small = Model::SdxlVaeDecoder
            .layers_sized(
                1,
                DType::Fp32,
                Layout::Nchw,
                &ModelSize {
                    input: Some(vec![1024, 768]),
                    channel_divisor: 4,
                },
            )
            .unwrap();
        assert_eq!(small.iter().map(|l| l.count).sum::<u32>(), 36);
        assert_eq!(small.len(), 13);
        let conv_in = find(&small, "sdxl_vae_decoder.decoder.conv_in");
        assert_eq!(shape(conv_in), [4, 128, 96, 128, 3, 3, 1, 1, 1]);
        let out = find(&small, "sdxl_vae_decoder.decoder.conv_out");
        assert_eq!(shape(out), [32, 1024, 768, 3, 3, 3, 1, 1, 1]);
        let err = |input: Vec<i64>, divisor| {
            Model::SdxlVaeDecoder
                .layers_sized(
                    1,
                    DType::Fp32,
                    Layout::Nchw,
                    &ModelSize {
                        input: Some(input),
                        channel_divisor: divisor,
                    },
                )
                .unwrap_err()
                .to_string()
        };
        let message = err(vec![1000, 1020], 1);
        assert!(
            message.contains("multiples of 8") && message.contains("default 2048x2048"),
            "{message}"
        );
        assert!(err(vec![17, 512, 512], 1).contains("3 values given, 2 wanted"));
        assert!(err(vec![512, 512], 3).contains("base width 128"));
    }

    #[test]
    fn wav2vec2_feature_encoder_shapes() {
        let layers = Model::Wav2Vec2Fe.layers(4, DType::Fp32, Layout::Nchw);
        let lengths: Vec<(i64, i64, i64, i64)> = layers
            .iter()
            .map(|l| {
                let p = &l.problem;
                assert_eq!((p.h, p.r, p.pad_w, p.k), (1, 1, 0, 512), "{}", l.name);
                (p.c, p.w, p.s, p.stride_w)
            })
            .collect();
        assert_eq!(
            lengths,
            [
                (1, 16000, 10, 5),
                (512, 3199, 3, 2),
                (512, 1599, 3, 2),
                (512, 799, 3, 2),
                (512, 399, 3, 2),
                (512, 199, 2, 2),
                (512, 99, 2, 2)
            ]
        );
        assert_eq!(layers[6].problem.output_hw(), (1, 49));
        assert_eq!(
            layers[0].name,
            "wav2vec2_fe.feature_extractor.conv_layers.0.conv"
        );
    }

    /// Reduced sizes: the structure stays, the numbers shrink; bad sizes are errors.
    #[test]
    fn sized_models() {
        let size = |input: &[i64], divisor| ModelSize {
            input: Some(input.to_vec()),
            channel_divisor: divisor,
        };
        let small = Model::WanVaeDecoder
            .layers_sized(1, DType::Fp32, Layout::Nchw, &size(&[5, 16, 16], 24))
            .unwrap();
        // Two latent frames of 2x2: one later chunk; base width 4 (dims 16, 16, 16, 8, 4).
        assert_eq!(small.iter().map(|l| l.count).sum::<u32>(), 1 + 38 + 36);
        // At 16 channels conv_in (16 -> 16) has the mid block's shape: merged, 24 distinct.
        assert_eq!(small.len(), 24);
        assert_eq!(
            find(&small, "wan21_vae_decoder.decoder.conv_in").count,
            2 + 20
        );
        let conv_in = find(&small, "wan21_vae_decoder.decoder.conv_in");
        assert_eq!(shape3(conv_in)[..5], [16, 3, 2, 2, 16]);
        let out = find(&small, "wan21_vae_decoder.decoder.conv_out");
        assert_eq!(shape3(out)[..5], [4, 6, 16, 16, 3]);
        // One frame: the first chunk only.
        let one = Model::WanVaeDecoder
            .layers_sized(1, DType::Fp32, Layout::Nchw, &size(&[1, 8, 8], 96))
            .unwrap();
        assert!(one
            .iter()
            .all(|l| l.count == 1 || l.name.ends_with("@chunk0")));
        assert_eq!(one.iter().map(|l| l.count).sum::<u32>(), 1 + 36);
        let r3d = Model::R3d18
            .layers_sized(2, DType::Fp32, Layout::Nchw, &size(&[4, 16, 16], 16))
            .unwrap();
        assert_eq!(r3d.iter().map(|l| l.count).sum::<u32>(), 20);
        let last = find(&r3d, "r3d_18.layer4.0.conv1.0");
        assert_eq!(shape3(last)[..5], [16, 1, 2, 2, 32]);
        let wav = Model::Wav2Vec2Fe
            .layers_sized(1, DType::Fp32, Layout::Nchw, &size(&[400], 64))
            .unwrap();
        assert_eq!(wav[6].problem.output_hw(), (1, 1));
        assert_eq!(wav[1].problem.c, 8);

        let err = |model: Model, size: ModelSize| {
            model
                .layers_sized(1, DType::Fp32, Layout::Nchw, &size)
                .unwrap_err()
                .to_string()
        };
        let message = err(Model::WanVaeDecoder, size(&[16, 480, 832], 1));
        assert!(
            message.contains("16 frames") && message.contains("default 17x480x832"),
            "{message}"
        );
        let message = err(Model::WanVaeDecoder, size(&[17, 100, 832], 1));
        assert!(message.contains("multiples of 8"), "{message}");
        let message = err(Model::R3d18, size(&[16, 112], 1));
        assert!(message.contains("2 values given, 3 wanted"), "{message}");
        let message = err(Model::R3d18, size(&[0, 112, 112], 1));
        assert!(message.contains("0 is not a positive size"), "{message}");
        let message = err(Model::R3d18, size(&[16, 112, 112], 3));
        assert!(message.contains("base width 64"), "{message}");
        let message = err(Model::Wav2Vec2Fe, size(&[100], 1));
        assert!(
            message.contains("conv_layers.4.conv") && message.contains("output width"),
            "{message}"
        );
        let message = err(Model::ResNet50, size(&[224, 224], 1));
        assert!(
            message.contains("resnet50 has a fixed input")
                && message.contains("r3d_18, wan21_vae_decoder, sdxl_vae_decoder, wav2vec2_fe"),
            "{message}"
        );
        // The default size is accepted by every model (at batch 1 for the 2048x2048 image
        // decoder, whose tensors exceed 2^31 elements from batch 2).
        for model in Model::ALL {
            let n = if model == Model::SdxlVaeDecoder { 1 } else { 2 };
            assert!(model
                .layers_sized(n, DType::Fp32, Layout::Nchw, &ModelSize::default())
                .is_ok());
        }
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
