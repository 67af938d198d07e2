//! The drop-ins beside [`Conv2d`](super::Conv2d), over the same core and custom ops:
//! [`Conv1d`], the 2-D problem with unit height, and [`ConvTranspose2d`], whose forward is the
//! backward-data of the convolution it transposes (see the module docs of `candle`).
//!
//! Each takes candle_nn's config type for its layer and loads candle_nn's variables; what
//! differs from [`Conv2d`](super::Conv2d) is only how an input's shape becomes the layer's
//! [`ConvProblem`] and which op its forward applies.

use super::{
    check_parameters, load_conv_bias, load_weight, named, operand, BackwardDataOp, ConvOptions,
    ForwardOp, LayerCore, LayerKind, ShapeKey,
};
use crate::solver::{ConvProblem, Plan};
use crate::tune::CacheStats;
use candle_core::{Module, Tensor};
use candle_nn::{Conv1dConfig, ConvTranspose2dConfig, VarBuilder};
use std::sync::Arc;

/// A 1-D convolution layer run by mucudnn: a drop-in for `candle_nn::Conv1d` (same weights,
/// same `forward`), NCL, in its weight's dtype (f32, f16 or bf16). It runs as the 2-D problem
/// with unit height (as cuDNN runs 1-D convolutions): an `n x c x l` input is the
/// `n x c x 1 x l` image, the filter `1 x s`.
#[derive(Clone)]
pub struct Conv1d {
    weight: Tensor,
    bias: Option<Tensor>,
    config: Conv1dConfig,
    core: Arc<LayerCore>,
}

layer_common!(Conv1d, Conv1dConfig);

impl Conv1d {
    /// A layer over `weight` (`out x in/groups x k`; f32, f16 or bf16) and an optional `bias`
    /// (`out`, the weight's dtype), as `candle_nn::Conv1d::new`. `cfg.cudnn_fwd_algo` is
    /// ignored: mucudnn chooses.
    pub fn new(
        weight: Tensor,
        bias: Option<Tensor>,
        cfg: Conv1dConfig,
        options: ConvOptions,
    ) -> candle_core::Result<Self> {
        let kind = LayerKind::Conv1d;
        let name = kind.layer_name(&options);
        let (dims, dtype) = check_parameters(kind, &name, &weight, 3, bias.as_ref(), 0)?;
        let [k, c_per_group, s] = [dims[0], dims[1], dims[2]].map(|d| d as i64);
        let groups = cfg.groups as i64;
        let mut template = ConvProblem::new_1d(1, c_per_group * groups, 1, k, s);
        template.dtype = dtype;
        template.pad_w = cfg.padding as i64;
        template.stride_w = cfg.stride as i64;
        template.dilation_w = cfg.dilation as i64;
        template.groups = groups;
        Ok(Conv1d {
            weight,
            bias,
            config: cfg,
            core: LayerCore::new(kind, template, options)?,
        })
    }

    /// The layer's convolution for an input of `n` sequences of length `l` (the 2-D problem
    /// with h = r = 1 that it tunes on first sight of that shape), checked.
    pub fn problem(&self, n: usize, l: usize) -> candle_core::Result<ConvProblem> {
        let c = self.core.template.c as usize;
        self.core.problem(&[n, c, 1, l])
    }

    /// The shapes tuned so far as `(n, 1, l)`, in the order first seen, with where each one's
    /// measurements came from (cached or measured). A shape is tuned once per device.
    pub fn tunings(&self) -> candle_core::Result<Vec<(ShapeKey, CacheStats)>> {
        self.core.tunings()
    }

    /// The host plans `[forward, backward-data, backward-filter]` tuned for an input of
    /// `n x l`, if that shape has been seen on the CPU.
    pub fn cpu_plans(&self, n: i64, l: i64) -> candle_core::Result<Option<[Plan; 3]>> {
        self.core.cpu_plans((n, 1, l))
    }
}

impl Module for Conv1d {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let core = &self.core;
        let (n, c, l) = x.dims3().map_err(|_| {
            core.error(format!(
                "the input must be 3-D (n, c, l), it has shape {:?}",
                x.shape()
            ))
        })?;
        core.check_dtype("input", x.dtype())?;
        let (k, c_per_group, s) = self.weight.dims3()?;
        // Unit height: reshapes of contiguous tensors are views (a strided input is copied
        // once, as `operand` would anyway).
        let x = operand(&x.reshape((n, c, 1, l))?)?;
        let weight = operand(&self.weight.reshape((k, c_per_group, 1, s))?)?;
        let y = x.apply_op2(&weight, ForwardOp { core: core.clone() })?;
        let (_, _, _, q) = y.dims4()?;
        let y = y.reshape((n, k, q))?;
        match &self.bias {
            None => Ok(y),
            Some(bias) => y.broadcast_add(&bias.reshape((1, k, 1))?),
        }
    }
}

/// A 2-D transposed convolution layer run by mucudnn: a drop-in for
/// `candle_nn::ConvTranspose2d` (same weights, same `forward`), NCHW, in its weight's dtype
/// (f32, f16 or bf16).
///
/// Its weight `in x out x kh x kw` is the filter of the convolution it transposes (`k = in`
/// filters over `c = out` channels), whose input has this layer's output size
/// `(h - 1) * stride - 2 * padding + dilation * (kh - 1) + output_padding + 1`. The forward
/// runs that convolution's backward-data plan, the input gradient its forward plan and the
/// weight gradient its backward-filter plan (with `x` and `dy` swapped): the plans and the
/// cached measurements are the convolution's. `output_padding` must be below the stride
/// (PyTorch also allows values below the dilation; candle does not check).
#[derive(Clone)]
pub struct ConvTranspose2d {
    weight: Tensor,
    bias: Option<Tensor>,
    config: ConvTranspose2dConfig,
    core: Arc<LayerCore>,
}

layer_common!(ConvTranspose2d, ConvTranspose2dConfig);

impl ConvTranspose2d {
    /// A layer over `weight` (`in x out x kh x kw`; f32, f16 or bf16) and an optional `bias`
    /// (`out`, the weight's dtype), as `candle_nn::ConvTranspose2d::new`.
    pub fn new(
        weight: Tensor,
        bias: Option<Tensor>,
        cfg: ConvTranspose2dConfig,
        options: ConvOptions,
    ) -> candle_core::Result<Self> {
        let kind = LayerKind::ConvTranspose2d;
        let name = kind.layer_name(&options);
        let (dims, dtype) = check_parameters(kind, &name, &weight, 4, bias.as_ref(), 1)?;
        let [c_in, c_out, r, s] = [dims[0], dims[1], dims[2], dims[3]].map(|d| d as i64);
        let [padding, stride, dilation] = [cfg.padding, cfg.stride, cfg.dilation].map(|v| v as i64);
        // The transposed convolution: its input is this layer's output.
        let mut template = ConvProblem::new(1, c_out, 1, 1, c_in, r, s);
        template.dtype = dtype;
        (template.pad_h, template.pad_w) = (padding, padding);
        (template.stride_h, template.stride_w) = (stride, stride);
        (template.dilation_h, template.dilation_w) = (dilation, dilation);
        let core = LayerCore::new(kind, template, options)?;
        if cfg.output_padding >= cfg.stride {
            // The convolution of the larger size would have a larger output than this
            // layer's input: the mapping onto its plans needs output_padding < stride.
            return Err(core.error(format!(
                "output_padding {} must be smaller than the stride {}",
                cfg.output_padding, cfg.stride
            )));
        }
        Ok(ConvTranspose2d {
            weight,
            bias,
            config: cfg,
            core,
        })
    }

    /// The input of the transposed convolution for this layer's input of `n` images of
    /// `h x w`: `n x out x` this layer's output size.
    fn conv_input(&self, n: usize, h: usize, w: usize) -> candle_core::Result<[usize; 4]> {
        let t = &self.core.template;
        let cfg = &self.config;
        let size = |input: usize, filter: i64| -> candle_core::Result<usize> {
            let full = input.saturating_sub(1) * cfg.stride
                + cfg.dilation * (filter as usize - 1)
                + cfg.output_padding
                + 1;
            match full.checked_sub(2 * cfg.padding) {
                Some(out) if out > 0 && input > 0 => Ok(out),
                _ => Err(self.core.error(format!(
                    "an input of {h}x{w} gives no output with padding {}",
                    cfg.padding
                ))),
            }
        };
        Ok([n, t.c as usize, size(h, t.r)?, size(w, t.s)?])
    }

    /// The convolution this layer transposes for an input of `n` images of `h x w` (its
    /// input is this layer's output; what the layer tunes on first sight of that shape),
    /// checked.
    pub fn problem(&self, n: usize, h: usize, w: usize) -> candle_core::Result<ConvProblem> {
        self.core.problem(&self.conv_input(n, h, w)?)
    }

    /// The shapes tuned so far as the transposed convolution's `(n, h, w)` (this layer's
    /// output size), in the order first seen, with where each one's measurements came from.
    pub fn tunings(&self) -> candle_core::Result<Vec<(ShapeKey, CacheStats)>> {
        self.core.tunings()
    }

    /// The host plans `[forward, backward-data, backward-filter]` of the transposed
    /// convolution, tuned for this layer's input of `n x h x w`, if that shape has been seen
    /// on the CPU. This layer's forward runs the backward-data plan.
    pub fn cpu_plans(&self, n: i64, h: i64, w: i64) -> candle_core::Result<Option<[Plan; 3]>> {
        let Ok([n, _, h, w]) = self.conv_input(n as usize, h as usize, w as usize) else {
            return Ok(None);
        };
        self.core.cpu_plans((n as i64, h as i64, w as i64))
    }
}

impl Module for ConvTranspose2d {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let core = &self.core;
        let (n, c, h, w) = x.dims4().map_err(|_| {
            core.error(format!(
                "the input must be 4-D (n, c, h, w), it has shape {:?}",
                x.shape()
            ))
        })?;
        let c_in = core.template.k as usize;
        if c != c_in {
            return Err(core.error(format!(
                "the input has {c} channels, the layer expects {c_in}"
            )));
        }
        core.check_dtype("input", x.dtype())?;
        let input = self.conv_input(n, h, w)?;
        // The transposed convolution's backward-data, with this layer's input as its `dy`.
        let y = operand(x)?.apply_op2(
            &operand(&self.weight)?,
            BackwardDataOp {
                core: core.clone(),
                input,
            },
        )?;
        match &self.bias {
            None => Ok(y),
            Some(bias) => {
                let c_out = bias.dims1()?;
                y.broadcast_add(&bias.reshape((1, c_out, 1, 1))?)
            }
        }
    }
}

/// As `candle_nn::conv1d`: `weight` (`out x in/groups x k`, Kaiming-normal) and `bias`
/// (`out`, uniform in `±1/sqrt(in)`) from `vb`, the layer run by mucudnn.
pub fn conv1d(
    in_channels: usize,
    out_channels: usize,
    kernel_size: usize,
    cfg: Conv1dConfig,
    options: ConvOptions,
    vb: VarBuilder,
) -> candle_core::Result<Conv1d> {
    let options = named(LayerKind::Conv1d, options, &vb);
    let weight = load_weight(
        LayerKind::Conv1d,
        in_channels,
        out_channels,
        cfg.groups,
        &[kernel_size],
        &options,
        &vb,
    )?;
    let bias = load_conv_bias(in_channels, out_channels, &vb)?;
    Conv1d::new(weight, Some(bias), cfg, options)
}

/// As `candle_nn::conv1d_no_bias`: only `weight` from `vb`.
pub fn conv1d_no_bias(
    in_channels: usize,
    out_channels: usize,
    kernel_size: usize,
    cfg: Conv1dConfig,
    options: ConvOptions,
    vb: VarBuilder,
) -> candle_core::Result<Conv1d> {
    let options = named(LayerKind::Conv1d, options, &vb);
    let weight = load_weight(
        LayerKind::Conv1d,
        in_channels,
        out_channels,
        cfg.groups,
        &[kernel_size],
        &options,
        &vb,
    )?;
    Conv1d::new(weight, None, cfg, options)
}

/// As `candle_nn::conv_transpose2d`: `weight` (`in x out x k x k`) and `bias` (`out`), both
/// uniform in `±1/(sqrt(out) k)`, from `vb`, the layer run by mucudnn.
pub fn conv_transpose2d(
    in_channels: usize,
    out_channels: usize,
    kernel_size: usize,
    cfg: ConvTranspose2dConfig,
    options: ConvOptions,
    vb: VarBuilder,
) -> candle_core::Result<ConvTranspose2d> {
    let options = named(LayerKind::ConvTranspose2d, options, &vb);
    let init = conv_transpose2d_init(out_channels, kernel_size);
    let weight = vb.get_with_hints(
        (in_channels, out_channels, kernel_size, kernel_size),
        "weight",
        init,
    )?;
    let bias = vb.get_with_hints(out_channels, "bias", init)?;
    ConvTranspose2d::new(weight, Some(bias), cfg, options)
}

/// As `candle_nn::conv_transpose2d_no_bias`: only `weight` from `vb`.
pub fn conv_transpose2d_no_bias(
    in_channels: usize,
    out_channels: usize,
    kernel_size: usize,
    cfg: ConvTranspose2dConfig,
    options: ConvOptions,
    vb: VarBuilder,
) -> candle_core::Result<ConvTranspose2d> {
    let options = named(LayerKind::ConvTranspose2d, options, &vb);
    let weight = vb.get_with_hints(
        (in_channels, out_channels, kernel_size, kernel_size),
        "weight",
        conv_transpose2d_init(out_channels, kernel_size),
    )?;
    ConvTranspose2d::new(weight, None, cfg, options)
}

/// candle_nn's initialisation of a transposed convolution's weight and bias.
fn conv_transpose2d_init(out_channels: usize, kernel_size: usize) -> candle_nn::Init {
    let bound = 1. / (out_channels as f64).sqrt() / kernel_size as f64;
    candle_nn::Init::Uniform {
        lo: -bound,
        up: bound,
    }
}
