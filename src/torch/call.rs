//! What an `aten::convolution` or `aten::convolution_backward` call is in mucudnn's terms, from
//! the call's metadata alone (sizes, strides, dtypes, devices, geometry): the convolution
//! problem and its layout, what each requested output is (which op of that problem, over which
//! operands), or why PyTorch's own kernel runs the call instead. Pure: no torch, no pointers;
//! [`super::kernels`] reads the metadata and acts on the answer.
//!
//! The mapping, as aten's arguments mean it:
//! - a convolution (`transposed = false`) of input `N x C x *spatial` and weight
//!   `K x C/g x *kernel` is the problem with those sizes; its forward runs `fwd`, its input
//!   gradient `bwd_data` and its weight gradient `bwd_filter`;
//! - a transposed convolution of input `N x Cin x *spatial` and weight `Cin x Cout/g x
//!   *kernel` is the backward-data of the convolution problem whose input is the transposed
//!   call's output (`c = Cout`, `k = Cin`): its forward runs that problem's `bwd_data`, its
//!   input gradient the `fwd`, its weight gradient the `bwd_filter` with the roles of the
//!   activations swapped; so the three passes share one problem's plans;
//! - a 1-D call (3-D tensors) is the 2-D problem with unit height (views of the same memory);
//! - the layout is channels-last (NHWC, NDHWC) when the input or the weight is channels-last,
//!   as PyTorch decides its own convolutions' memory format; operands not packed in that
//!   layout are copied into it by the kernel, as PyTorch's kernels do.
//!
//! A call PyTorch would reject (mismatched channels, a non-positive stride, a list of the
//! wrong length) is left to PyTorch, so that its own error reaches the user.

use crate::solver::{ConvOp, ConvProblem, DType, Layout};
use std::fmt;

/// At most 5 dims (N, C and 3 spatial), as small fixed arrays: nothing here allocates.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Dims {
    len: usize,
    values: [i64; 5],
}

impl Dims {
    /// `None` for more than 5 values.
    pub fn new(values: &[i64]) -> Option<Self> {
        if values.len() > 5 {
            return None;
        }
        let mut dims = Dims {
            len: values.len(),
            values: [0; 5],
        };
        dims.values[..values.len()].copy_from_slice(values);
        Some(dims)
    }

    pub fn as_slice(&self) -> &[i64] {
        &self.values[..self.len]
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The product of the values (`None` on overflow).
    pub fn product(&self) -> Option<i64> {
        self.as_slice()
            .iter()
            .try_fold(1i64, |acc, &v| acc.checked_mul(v))
    }
}

impl std::ops::Index<usize> for Dims {
    type Output = i64;
    fn index(&self, index: usize) -> &i64 {
        &self.as_slice()[index]
    }
}

impl fmt::Debug for Dims {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.as_slice()).finish()
    }
}

impl fmt::Display for Dims {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text: Vec<String> = self.as_slice().iter().map(i64::to_string).collect();
        f.write_str(&text.join("x"))
    }
}

/// Where a tensor lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    Cpu,
    Cuda(i32),
    Other,
}

/// One tensor argument, as read from libtorch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TensorMeta {
    pub sizes: Dims,
    pub strides: Dims,
    /// `None`: a dtype mucudnn has no plans for (float64, complex, integers).
    pub dtype: Option<DType>,
    pub device: Device,
    /// A plain strided tensor (not sparse or mkldnn).
    pub strided: bool,
}

impl TensorMeta {
    pub fn dim(&self) -> usize {
        self.sizes.len()
    }

    /// Whether the strides are `layout`'s packed ones for these sizes (a dim of size 1 may
    /// have any stride: it is never stepped over), so the data pointer addresses the packed
    /// tensor mucudnn reads.
    pub fn is_packed(&self, layout: Layout) -> bool {
        let packed = packed_strides(&self.sizes, layout);
        self.sizes
            .as_slice()
            .iter()
            .zip(self.strides.as_slice())
            .zip(packed.as_slice())
            .all(|((&size, &stride), &want)| size == 1 || stride == want)
    }

    /// PyTorch's `is_contiguous(memory_format=channels_last)` and not `is_contiguous()` (for a
    /// 1-D tensor, of its unit-height 2-D view, as PyTorch's convolution sees it): a tensor
    /// that is both (one channel, one pixel) runs as NCHW.
    pub fn is_channels_last(&self) -> bool {
        matches!(self.dim(), 3..=5) && self.is_packed(Layout::Nhwc) && !self.is_packed(Layout::Nchw)
    }
}

/// The packed strides of `sizes` (N, C, spatial...) in `layout`; NHWC orders C last.
pub fn packed_strides(sizes: &Dims, layout: Layout) -> Dims {
    let dims = sizes.as_slice();
    let rank = dims.len();
    let mut order: Vec<usize> = (0..rank).collect(); // outermost first
    if layout == Layout::Nhwc && rank >= 3 {
        order = std::iter::once(0)
            .chain(2..rank)
            .chain(std::iter::once(1))
            .collect();
    }
    let mut strides = [0i64; 5];
    let mut step = 1i64;
    for &axis in order.iter().rev() {
        strides[axis] = step;
        step = step.saturating_mul(dims[axis].max(1));
    }
    Dims::new(&strides[..rank]).expect("rank <= 5")
}

/// The geometry arguments of the call, as given (lists of 1 or `spatial` values).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub stride: Dims,
    pub padding: Dims,
    pub dilation: Dims,
    pub transposed: bool,
    pub output_padding: Dims,
    pub groups: i64,
}

/// Why a call runs PyTorch's own kernel (counted per reason in the account).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fallback {
    /// A dtype mucudnn has no plans for (`torch.float64`, complex, integers).
    DType,
    /// The operands' dtypes differ (PyTorch raises, or casts under autocast before this).
    MixedDTypes,
    /// Operands on different devices, or not a CPU or CUDA tensor.
    Devices,
    /// Not a strided tensor (sparse, mkldnn).
    NotStrided,
    /// An empty tensor (no samples, channels or output elements).
    Empty,
    /// A transposed convolution whose `output_padding` is not below its stride: its output
    /// has rows no convolution of the problem reaches.
    OutputPadding,
    /// Arguments PyTorch itself rejects: its error is the user's.
    Rejected,
    /// Valid for PyTorch but outside what mucudnn's problems hold (the message says what).
    Unsupported(String),
    /// `torch.jit.trace` is recording: PyTorch's kernel runs, so that the trace holds its
    /// convolution (`aten::_convolution`) rather than the operations of mucudnn's kernel.
    Tracing,
}

impl fmt::Display for Fallback {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fallback::DType => f.write_str("dtype: mucudnn's plans are fp32, fp16 and bf16"),
            Fallback::MixedDTypes => f.write_str("operands of different dtypes"),
            Fallback::Devices => f.write_str("operands not all on one CPU or CUDA device"),
            Fallback::NotStrided => f.write_str("not a strided tensor"),
            Fallback::Empty => f.write_str("an empty tensor"),
            Fallback::OutputPadding => f.write_str("output_padding is not below the stride"),
            Fallback::Rejected => f.write_str("arguments PyTorch rejects (its error is raised)"),
            Fallback::Unsupported(why) => f.write_str(why),
            Fallback::Tracing => f.write_str(
                "torch.jit.trace is recording: the trace holds PyTorch's convolution, which runs \
                 PyTorch's kernels (torch.compile and torch.export keep mucudnn's)",
            ),
        }
    }
}

/// What identifies a convolution module's calls: its weight's shape and the geometry that does
/// not change between calls (padding may: a module can pad its input itself).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Signature {
    pub transposed: bool,
    /// The weight's sizes as the module holds it (3-D for a 1-D module).
    pub weight: Dims,
    pub stride: Dims,
    pub dilation: Dims,
    pub groups: i64,
}

/// A call mucudnn runs: its convolution problem, and what the forward call returns.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Mapped {
    /// The convolution problem (for a transposed call, the one whose backward-data it is),
    /// with its batch size; `math` is the default (the caller applies PyTorch's TF32 switch).
    pub problem: ConvProblem,
    pub transposed: bool,
    /// Spatial dims as called (1, 2 or 3).
    pub spatial: usize,
    pub layout: Layout,
    pub device: Device,
    pub signature: Signature,
    /// The call's input and weight sizes as called.
    pub input: Dims,
    pub weight: Dims,
    /// What the forward call returns: its sizes as PyTorch returns them (3-D for 1-D) and its
    /// packed strides in `layout`.
    pub output: Dims,
    pub output_strides: Dims,
}

impl Mapped {
    /// The op of the problem that the forward call runs.
    pub fn forward_op(&self) -> ConvOp {
        if self.transposed {
            ConvOp::BackwardData
        } else {
            ConvOp::Forward
        }
    }
}

/// A geometry list as `spatial` values: aten takes one value for every dim, or one per dim.
fn expand(values: &Dims, spatial: usize) -> Result<[i64; 3], Fallback> {
    let mut out = [0i64; 3];
    match values.len() {
        1 => out[..spatial].fill(values[0]),
        n if n == spatial => out[..spatial].copy_from_slice(values.as_slice()),
        _ => return Err(Fallback::Rejected),
    }
    Ok(out)
}

/// The signature of a call from its weight and geometry alone (so that a call PyTorch runs,
/// float64 say, is still counted under its layer); `None` when the lists do not fit the
/// weight's rank.
pub fn signature_of(weight: &TensorMeta, geometry: &Geometry) -> Option<Signature> {
    let spatial = weight
        .dim()
        .checked_sub(2)
        .filter(|s| (1..=3).contains(s))?;
    let stride = expand(&geometry.stride, spatial).ok()?;
    let dilation = expand(&geometry.dilation, spatial).ok()?;
    Some(Signature {
        transposed: geometry.transposed,
        weight: weight.sizes,
        stride: Dims::new(&stride[..spatial])?,
        dilation: Dims::new(&dilation[..spatial])?,
        groups: geometry.groups,
    })
}

/// The forward call `aten::convolution(input, weight, bias, geometry)`.
pub fn map_forward(
    input: &TensorMeta,
    weight: &TensorMeta,
    bias: Option<&TensorMeta>,
    geometry: &Geometry,
) -> Result<Mapped, Fallback> {
    check_operands(&[Some(input), Some(weight), bias])?;
    let mapped = map_problem(input, weight, geometry)?;
    if let Some(bias) = bias {
        let channels = mapped.output[1];
        if bias.dim() != 1 || bias.sizes[0] != channels {
            return Err(Fallback::Rejected);
        }
    }
    Ok(mapped)
}

/// The dtypes and devices of a call's operands (absent ones skipped).
fn check_operands(operands: &[Option<&TensorMeta>]) -> Result<(), Fallback> {
    let present: Vec<&TensorMeta> = operands.iter().flatten().copied().collect();
    let first = present[0];
    if present.iter().any(|t| !t.strided) {
        return Err(Fallback::NotStrided);
    }
    if present.iter().any(|t| t.device != first.device) || first.device == Device::Other {
        return Err(Fallback::Devices);
    }
    if present.iter().any(|t| t.dtype.is_none()) {
        return Err(Fallback::DType);
    }
    if present.iter().any(|t| t.dtype != first.dtype) {
        return Err(Fallback::MixedDTypes);
    }
    Ok(())
}

/// The problem of a call's input, weight and geometry (the operands' dtypes and devices
/// checked by the caller).
fn map_problem(
    input: &TensorMeta,
    weight: &TensorMeta,
    geometry: &Geometry,
) -> Result<Mapped, Fallback> {
    let rank = input.dim();
    if !(3..=5).contains(&rank) || weight.dim() != rank {
        return Err(Fallback::Rejected);
    }
    let spatial = rank - 2;
    let stride = expand(&geometry.stride, spatial)?;
    let padding = expand(&geometry.padding, spatial)?;
    let dilation = expand(&geometry.dilation, spatial)?;
    let output_padding = if geometry.transposed {
        expand(&geometry.output_padding, spatial)?
    } else {
        [0; 3]
    };
    let groups = geometry.groups;
    let bad = |values: &[i64; 3], minimum: i64| values[..spatial].iter().any(|&v| v < minimum);
    if groups < 1
        || bad(&stride, 1)
        || bad(&dilation, 1)
        || bad(&padding, 0)
        || bad(&output_padding, 0)
    {
        return Err(Fallback::Rejected);
    }
    let x = input.sizes;
    let w = weight.sizes;
    let kernel = &w.as_slice()[2..];
    let in_spatial = &x.as_slice()[2..];
    if x.as_slice().contains(&0) || w.as_slice().contains(&0) {
        // PyTorch has its own answers for empty batches and channels (or raises).
        return Err(Fallback::Empty);
    }
    // The problem's input channels and spatial sizes, filters, and the call's output sizes.
    let (c, k, problem_spatial, out_channels, out_spatial): (i64, i64, [i64; 3], i64, [i64; 3]) =
        if geometry.transposed {
            // Input channels are the weight's first dim; output channels w[1] * groups.
            if x[1] != w[0] || w[0] % groups != 0 {
                return Err(Fallback::Rejected);
            }
            let mut out = [0i64; 3];
            for i in 0..spatial {
                out[i] = (in_spatial[i] - 1) * stride[i] - 2 * padding[i]
                    + dilation[i] * (kernel[i] - 1)
                    + output_padding[i]
                    + 1;
                if out[i] <= 0 {
                    return Err(Fallback::Rejected);
                }
                if output_padding[i] >= stride[i] {
                    // PyTorch allows it below the dilation too; then the mapping does not hold.
                    return Err(if output_padding[i] < dilation[i] {
                        Fallback::OutputPadding
                    } else {
                        Fallback::Rejected
                    });
                }
            }
            let channels = w[1].checked_mul(groups).ok_or(Fallback::Rejected)?;
            (channels, w[0], out, channels, out)
        } else {
            if x[1] != w[1].checked_mul(groups).ok_or(Fallback::Rejected)? || w[0] % groups != 0 {
                return Err(Fallback::Rejected);
            }
            let mut sp = [0i64; 3];
            let mut out = [0i64; 3];
            for i in 0..spatial {
                sp[i] = in_spatial[i];
                let dilated = dilation[i] * (kernel[i] - 1) + 1;
                let span = in_spatial[i] + 2 * padding[i] - dilated;
                if span < 0 {
                    return Err(Fallback::Rejected);
                }
                out[i] = span / stride[i] + 1;
            }
            (x[1], w[0], sp, w[0], out)
        };
    let layout = if input.is_channels_last() || weight.is_channels_last() {
        Layout::Nhwc
    } else {
        Layout::Nchw
    };
    let dtype = input.dtype.expect("checked by the caller");
    // 1-D: height 1; 2-D: depth 1. Index the last three spatial slots (d, h, w).
    let lift = |values: &[i64; 3], unit: i64| -> [i64; 3] {
        match spatial {
            1 => [unit, unit, values[0]],
            2 => [unit, values[0], values[1]],
            _ => *values,
        }
    };
    let [d, h, wd] = lift(&problem_spatial, 1);
    let mut kernel3 = [1i64; 3];
    kernel3[..spatial].copy_from_slice(kernel);
    let [t, r, s] = lift(&kernel3, 1);
    let [pad_d, pad_h, pad_w] = lift(&padding, 0);
    let [stride_d, stride_h, stride_w] = lift(&stride, 1);
    let [dilation_d, dilation_h, dilation_w] = lift(&dilation, 1);
    let problem = ConvProblem {
        n: x[0],
        c,
        d,
        h,
        w: wd,
        k,
        t,
        r,
        s,
        pad_d,
        pad_h,
        pad_w,
        stride_d,
        stride_h,
        stride_w,
        dilation_d,
        dilation_h,
        dilation_w,
        groups,
        dtype,
        layout,
        ..ConvProblem::new(1, 1, 1, 1, 1, 1, 1)
    };
    problem
        .validate()
        .map_err(|e| Fallback::Unsupported(e.to_string()))?;
    let mut output = [x[0], out_channels, 0, 0, 0];
    output[2..2 + spatial].copy_from_slice(&out_spatial[..spatial]);
    let output = Dims::new(&output[..rank]).expect("rank <= 5");
    let signature = Signature {
        transposed: geometry.transposed,
        weight: w,
        stride: Dims::new(&stride[..spatial]).expect("<= 3"),
        dilation: Dims::new(&dilation[..spatial]).expect("<= 3"),
        groups,
    };
    Ok(Mapped {
        problem,
        transposed: geometry.transposed,
        spatial,
        layout,
        device: input.device,
        signature,
        input: x,
        weight: w,
        output,
        output_strides: packed_strides(&output, layout),
    })
}

/// Which of `aten::convolution_backward`'s three outputs a call asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OutputMask {
    pub input: bool,
    pub weight: bool,
    pub bias: bool,
}

/// One gradient a backward call computes with a plan: `out = op(a, b)`, each operand one of
/// the call's tensors (its role in the problem given by the op).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GradientJob {
    pub op: ConvOp,
    pub a: Operand,
    pub b: Operand,
    /// The gradient's sizes as returned (the input's or the weight's).
    pub output: Operand,
}

/// The tensors of a backward call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Operand {
    GradOutput,
    Input,
    Weight,
}

/// The backward call `aten::convolution_backward(grad_output, input, weight, ...)`: the
/// problem and the plan ops that compute the asked gradients (the bias gradient, a sum of
/// `grad_output`, is the kernel's own).
pub fn map_backward(
    grad_output: &TensorMeta,
    input: &TensorMeta,
    weight: &TensorMeta,
    geometry: &Geometry,
    mask: OutputMask,
) -> Result<(Mapped, Vec<GradientJob>), Fallback> {
    check_operands(&[Some(grad_output), Some(input), Some(weight)])?;
    let mapped = map_problem(input, weight, geometry)?;
    if grad_output.sizes != mapped.output {
        return Err(Fallback::Rejected);
    }
    let mut jobs = Vec::with_capacity(2);
    if mask.input {
        jobs.push(if mapped.transposed {
            // The transposed call's input gradient: the problem's forward of dy (the
            // problem's input) with the weight.
            GradientJob {
                op: ConvOp::Forward,
                a: Operand::GradOutput,
                b: Operand::Weight,
                output: Operand::Input,
            }
        } else {
            GradientJob {
                op: ConvOp::BackwardData,
                a: Operand::Weight,
                b: Operand::GradOutput,
                output: Operand::Input,
            }
        });
    }
    if mask.weight {
        jobs.push(if mapped.transposed {
            // x of the problem is the call's dy, dy of the problem the call's input.
            GradientJob {
                op: ConvOp::BackwardFilter,
                a: Operand::GradOutput,
                b: Operand::Input,
                output: Operand::Weight,
            }
        } else {
            GradientJob {
                op: ConvOp::BackwardFilter,
                a: Operand::Input,
                b: Operand::GradOutput,
                output: Operand::Weight,
            }
        });
    }
    Ok((mapped, jobs))
}

/// A module's [`Signature`] from its attributes (never its weight, which a parametrization or
/// hook may compute): `weight` is the shape the module's convolution receives.
pub fn module_signature(
    transposed: bool,
    weight: &[i64],
    stride: &[i64],
    dilation: &[i64],
    groups: i64,
) -> Option<Signature> {
    let spatial = weight.len().checked_sub(2)?;
    if !(1..=3).contains(&spatial) || stride.len() != spatial || dilation.len() != spatial {
        return None;
    }
    Some(Signature {
        transposed,
        weight: Dims::new(weight)?,
        stride: Dims::new(stride)?,
        dilation: Dims::new(dilation)?,
        groups,
    })
}

/// A name for a convolution no module names, from its signature and padding as called: its
/// kind, weight shape and geometry (`conv2d_64x32x3x3_s1x1_p1x1_d1x1`,
/// `conv_transpose1d_..._g4`).
pub fn problem_name(signature: &Signature, padding: &Dims) -> String {
    let spatial = signature.weight.len().saturating_sub(2);
    let kind = if signature.transposed {
        format!("conv_transpose{spatial}d")
    } else {
        format!("conv{spatial}d")
    };
    let expanded = |d: &Dims| -> String {
        let values: Vec<String> = if d.len() == 1 {
            vec![d[0].to_string(); spatial]
        } else {
            d.as_slice().iter().map(i64::to_string).collect()
        };
        values.join("x")
    };
    let mut name = format!(
        "{kind}_{}_s{}_p{}_d{}",
        signature.weight,
        expanded(&signature.stride),
        expanded(padding),
        expanded(&signature.dilation)
    );
    if signature.groups != 1 {
        name.push_str(&format!("_g{}", signature.groups));
    }
    name
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dims(values: &[i64]) -> Dims {
        Dims::new(values).unwrap()
    }

    fn tensor(sizes: &[i64], layout: Layout) -> TensorMeta {
        let sizes = dims(sizes);
        TensorMeta {
            sizes,
            strides: packed_strides(&sizes, layout),
            dtype: Some(DType::Fp32),
            device: Device::Cpu,
            strided: true,
        }
    }

    fn geometry(spatial: usize, transposed: bool) -> Geometry {
        let ones = dims(&vec![1; spatial]);
        let zeros = dims(&vec![0; spatial]);
        Geometry {
            stride: ones,
            padding: zeros,
            dilation: ones,
            transposed,
            output_padding: zeros,
            groups: 1,
        }
    }

    #[test]
    fn packed_strides_by_layout() {
        assert_eq!(
            packed_strides(&dims(&[2, 3, 4, 5]), Layout::Nchw),
            dims(&[60, 20, 5, 1])
        );
        assert_eq!(
            packed_strides(&dims(&[2, 3, 4, 5]), Layout::Nhwc),
            dims(&[60, 1, 15, 3])
        );
        assert_eq!(
            packed_strides(&dims(&[2, 3, 4, 5, 6]), Layout::Nhwc),
            dims(&[360, 1, 90, 18, 3])
        );
        // A size-1 dim's stride is never stepped over.
        let mut t = tensor(&[2, 1, 4, 5], Layout::Nchw);
        t.strides = dims(&[20, 999, 5, 1]);
        assert!(t.is_packed(Layout::Nchw));
        // One channel: packed both ways, so not channels-last.
        assert!(!tensor(&[2, 1, 4, 5], Layout::Nhwc).is_channels_last());
        assert!(tensor(&[2, 3, 4, 5], Layout::Nhwc).is_channels_last());
    }

    #[test]
    fn a_2d_convolution_is_its_problem() {
        let mut g = geometry(2, false);
        g.padding = dims(&[1]); // one value for every dim, as aten expands it
        g.stride = dims(&[2, 1]);
        let m = map_forward(
            &tensor(&[8, 6, 10, 12], Layout::Nchw),
            &tensor(&[4, 3, 3, 3], Layout::Nchw),
            None,
            &Geometry { groups: 2, ..g },
        )
        .unwrap();
        let p = m.problem;
        assert_eq!((p.n, p.c, p.h, p.w, p.k, p.r, p.s), (8, 6, 10, 12, 4, 3, 3));
        assert_eq!(
            (p.pad_h, p.pad_w, p.stride_h, p.stride_w, p.groups),
            (1, 1, 2, 1, 2)
        );
        assert_eq!(m.output, dims(&[8, 4, 5, 12]));
        assert_eq!(m.forward_op(), ConvOp::Forward);
        assert_eq!(m.layout, Layout::Nchw);
    }

    #[test]
    fn channels_last_input_or_weight_makes_an_nhwc_problem() {
        let g = geometry(2, false);
        let x = tensor(&[2, 3, 8, 8], Layout::Nhwc);
        let w = tensor(&[4, 3, 3, 3], Layout::Nchw);
        let m = map_forward(&x, &w, None, &g).unwrap();
        assert_eq!(m.layout, Layout::Nhwc);
        assert_eq!(
            m.output_strides,
            packed_strides(&dims(&[2, 4, 6, 6]), Layout::Nhwc)
        );
        let m = map_forward(
            &tensor(&[2, 3, 8, 8], Layout::Nchw),
            &tensor(&[4, 3, 3, 3], Layout::Nhwc),
            None,
            &g,
        )
        .unwrap();
        assert_eq!(m.layout, Layout::Nhwc);
    }

    #[test]
    fn a_1d_convolution_is_2d_with_unit_height() {
        let mut g = geometry(1, false);
        g.padding = dims(&[2]);
        g.dilation = dims(&[2]);
        let m = map_forward(
            &tensor(&[2, 3, 50], Layout::Nchw),
            &tensor(&[5, 3, 3], Layout::Nchw),
            None,
            &g,
        )
        .unwrap();
        let p = m.problem;
        assert_eq!(
            (p.h, p.r, p.pad_h, p.w, p.s, p.pad_w, p.dilation_w),
            (1, 1, 0, 50, 3, 2, 2)
        );
        assert!(p.is_1d());
        assert_eq!(m.output, dims(&[2, 5, 50]));
    }

    #[test]
    fn a_1d_convolution_of_length_last_tensors_is_nwc() {
        let g = geometry(1, false);
        let x = tensor(&[2, 3, 50], Layout::Nhwc);
        assert_eq!(x.strides, dims(&[150, 1, 3]));
        let m = map_forward(&x, &tensor(&[5, 3, 3], Layout::Nchw), None, &g).unwrap();
        assert_eq!(m.layout, Layout::Nhwc);
        assert_eq!(m.output_strides, dims(&[240, 1, 5]));
    }

    #[test]
    fn a_3d_convolution_keeps_its_depth() {
        let g = geometry(3, false);
        let m = map_forward(
            &tensor(&[1, 2, 5, 6, 7], Layout::Nchw),
            &tensor(&[3, 2, 3, 1, 2], Layout::Nchw),
            None,
            &g,
        )
        .unwrap();
        let p = m.problem;
        assert_eq!((p.d, p.h, p.w, p.t, p.r, p.s), (5, 6, 7, 3, 1, 2));
        assert_eq!(m.output, dims(&[1, 3, 3, 6, 6]));
    }

    #[test]
    fn a_transposed_convolution_is_its_problems_backward_data() {
        let mut g = geometry(2, true);
        g.stride = dims(&[2, 2]);
        g.padding = dims(&[1, 1]);
        g.output_padding = dims(&[1, 0]);
        g.groups = 2;
        // input 4 channels -> weight 4 x (6/2) x 3 x 3 -> 6 output channels.
        let m = map_forward(
            &tensor(&[2, 4, 5, 5], Layout::Nchw),
            &tensor(&[4, 3, 3, 3], Layout::Nchw),
            None,
            &g,
        )
        .unwrap();
        assert_eq!(m.forward_op(), ConvOp::BackwardData);
        assert_eq!(m.output, dims(&[2, 6, 10, 9]));
        let p = m.problem;
        assert_eq!((p.n, p.c, p.h, p.w, p.k, p.groups), (2, 6, 10, 9, 4, 2));
        // The problem's output is the call's input.
        assert_eq!(p.output_dims(), [2, 4, 1, 5, 5]);
    }

    #[test]
    fn output_padding_at_the_stride_is_pytorchs() {
        let mut g = geometry(1, true);
        g.stride = dims(&[2]);
        g.dilation = dims(&[3]);
        g.output_padding = dims(&[2]);
        let result = map_forward(
            &tensor(&[1, 2, 5], Layout::Nchw),
            &tensor(&[2, 2, 3], Layout::Nchw),
            None,
            &g,
        );
        assert_eq!(result.unwrap_err(), Fallback::OutputPadding);
    }

    #[test]
    fn what_pytorch_rejects_or_mucudnn_has_no_plans_for_falls_back() {
        let g = geometry(2, false);
        let x = tensor(&[2, 3, 8, 8], Layout::Nchw);
        let w = tensor(&[4, 3, 3, 3], Layout::Nchw);
        // Channels that do not match: PyTorch's error.
        let bad_w = tensor(&[4, 2, 3, 3], Layout::Nchw);
        assert_eq!(
            map_forward(&x, &bad_w, None, &g).unwrap_err(),
            Fallback::Rejected
        );
        // A stride of 0, a list of the wrong length.
        let zero = Geometry {
            stride: dims(&[0, 1]),
            ..g
        };
        assert_eq!(
            map_forward(&x, &w, None, &zero).unwrap_err(),
            Fallback::Rejected
        );
        let three = Geometry {
            padding: dims(&[0, 0, 0]),
            ..g
        };
        assert_eq!(
            map_forward(&x, &w, None, &three).unwrap_err(),
            Fallback::Rejected
        );
        // float64, mixed dtypes, devices, empty batches.
        let f64x = TensorMeta { dtype: None, ..x };
        assert_eq!(
            map_forward(&f64x, &w, None, &g).unwrap_err(),
            Fallback::DType
        );
        let half_w = TensorMeta {
            dtype: Some(DType::Fp16),
            ..w
        };
        assert_eq!(
            map_forward(&x, &half_w, None, &g).unwrap_err(),
            Fallback::MixedDTypes
        );
        let cuda_w = TensorMeta {
            device: Device::Cuda(0),
            ..w
        };
        assert_eq!(
            map_forward(&x, &cuda_w, None, &g).unwrap_err(),
            Fallback::Devices
        );
        let empty = tensor(&[0, 3, 8, 8], Layout::Nchw);
        assert_eq!(
            map_forward(&empty, &w, None, &g).unwrap_err(),
            Fallback::Empty
        );
        // A bias of the wrong length.
        let bias = tensor(&[3], Layout::Nchw);
        assert_eq!(
            map_forward(&x, &w, Some(&bias), &g).unwrap_err(),
            Fallback::Rejected
        );
        // An output that would be empty.
        let tiny = tensor(&[2, 3, 2, 2], Layout::Nchw);
        assert_eq!(
            map_forward(&tiny, &w, None, &g).unwrap_err(),
            Fallback::Rejected
        );
    }

    #[test]
    fn backward_jobs_by_mask_and_kind() {
        let g = geometry(2, false);
        let x = tensor(&[2, 3, 8, 8], Layout::Nchw);
        let w = tensor(&[4, 3, 3, 3], Layout::Nchw);
        let dy = tensor(&[2, 4, 6, 6], Layout::Nchw);
        let all = OutputMask {
            input: true,
            weight: true,
            bias: true,
        };
        let (_, jobs) = map_backward(&dy, &x, &w, &g, all).unwrap();
        assert_eq!(
            jobs.iter().map(|j| j.op).collect::<Vec<_>>(),
            [ConvOp::BackwardData, ConvOp::BackwardFilter]
        );
        let only_weight = OutputMask {
            input: false,
            weight: true,
            bias: false,
        };
        let (_, jobs) = map_backward(&dy, &x, &w, &g, only_weight).unwrap();
        assert_eq!(jobs.len(), 1);
        // A grad_output of the wrong shape is PyTorch's to reject.
        let wrong = tensor(&[2, 4, 5, 6], Layout::Nchw);
        assert_eq!(
            map_backward(&wrong, &x, &w, &g, all).unwrap_err(),
            Fallback::Rejected
        );
        // Transposed: input gradient is the problem's forward, weight gradient swaps roles.
        let t = geometry(2, true);
        let xt = tensor(&[2, 4, 6, 6], Layout::Nchw);
        let wt = tensor(&[4, 3, 3, 3], Layout::Nchw);
        let dyt = tensor(&[2, 3, 8, 8], Layout::Nchw);
        let (m, jobs) = map_backward(&dyt, &xt, &wt, &t, all).unwrap();
        assert_eq!(m.problem.input_dims(), [2, 3, 1, 8, 8]);
        assert_eq!(jobs[0].op, ConvOp::Forward);
        assert_eq!(
            (jobs[0].a, jobs[0].b),
            (Operand::GradOutput, Operand::Weight)
        );
        assert_eq!(
            (jobs[1].a, jobs[1].b),
            (Operand::GradOutput, Operand::Input)
        );
    }

    #[test]
    fn module_signatures_match_calls() {
        let g = geometry(2, false);
        let m = map_forward(
            &tensor(&[2, 3, 8, 8], Layout::Nchw),
            &tensor(&[4, 3, 3, 3], Layout::Nchw),
            None,
            &g,
        )
        .unwrap();
        let s = module_signature(false, &[4, 3, 3, 3], &[1, 1], &[1, 1], 1).unwrap();
        assert_eq!(m.signature, s);
        assert!(module_signature(false, &[4, 3], &[], &[], 1).is_none());
        assert_eq!(
            problem_name(&m.signature, &dims(&[1])),
            "conv2d_4x3x3x3_s1x1_p1x1_d1x1"
        );
        let weight = tensor(&[4, 3, 3, 3], Layout::Nchw);
        assert_eq!(signature_of(&weight, &g), Some(s));
        assert_eq!(
            signature_of(
                &weight,
                &Geometry {
                    stride: dims(&[1, 1, 1]),
                    ..g
                }
            ),
            None
        );
    }
}
