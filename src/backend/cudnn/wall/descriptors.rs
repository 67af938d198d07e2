//! Legacy cuDNN descriptors owned by mucudnn: tensor, filter and convolution descriptors, and
//! the set of them one convolution problem needs ([`ConvDescriptors`]), made once per problem
//! and micro-batch size and destroyed on drop.
//!
//! A 2-D (or 1-D) problem gets 4-D tensors and filters and a 2-D convolution
//! (`cudnnSetTensor4dDescriptor`, `cudnnSetFilter4dDescriptor`,
//! `cudnnSetConvolution2dDescriptor`), as it always has; a 3-D problem gets 5-D ones and a
//! convolution of 3 spatial dims (`cudnnSetTensorNdDescriptorEx`, `cudnnSetFilterNdDescriptor`,
//! `cudnnSetConvolutionNdDescriptor`). In both, cuDNN derives the strides from the layout's
//! format (`CUDNN_TENSOR_NCHW`: NCDHW; `CUDNN_TENSOR_NHWC`: NDHWC, channels last), and the host
//! tier checks them against `graph_params`'.

use super::*;

/// The dims as cuDNN's `int` array, with their count.
fn nb_dims(call: &'static str, dims: &[i32]) -> Result<std::ffi::c_int, CudnnError> {
    match dims.len() {
        4 | 5 => Ok(dims.len() as std::ffi::c_int),
        n => Err(invalid(
            call,
            format!("{n} dims {dims:?}: a convolution's tensors have 4 (2-D) or 5 (3-D)"),
        )),
    }
}

/// A 4-D (2-D problem) or 5-D (3-D problem) tensor descriptor: logical dims `[n, c, h, w]` or
/// `[n, c, d, h, w]`, packed in `layout`.
pub struct TensorDescriptor {
    pub(super) raw: dnn_sys::cudnnTensorDescriptor_t,
    dims: Nd<i32>,
}

impl TensorDescriptor {
    /// `dims` has 4 or 5 entries (else an error).
    pub fn new(dtype: DType, layout: Layout, dims: &[i32]) -> Result<Self, CudnnError> {
        let count = nb_dims("TensorDescriptor::new", dims)?;
        cudnn()?;
        let raw =
            dnn::create_tensor_descriptor().map_err(dnn_err("cudnnCreateTensorDescriptor"))?;
        let desc = TensorDescriptor {
            raw,
            dims: Nd::from_slice(dims),
        };
        if let &[n, c, h, w] = dims {
            // SAFETY: `raw` is a live descriptor owned by `desc` (destroyed by its Drop).
            unsafe {
                dnn::set_tensor4d_descriptor(
                    desc.raw,
                    tensor_format(layout),
                    data_type(dtype),
                    [n, c, h, w],
                )
            }
            .map_err(dnn_err("cudnnSetTensor4dDescriptor"))?;
        } else {
            // SAFETY: `raw` is a live descriptor owned by `desc`; `dims` holds `count` ints
            // and outlives the call, which copies them.
            unsafe {
                dnn_sys::cudnnSetTensorNdDescriptorEx(
                    desc.raw,
                    tensor_format(layout),
                    data_type(dtype),
                    count,
                    dims.as_ptr(),
                )
            }
            .result()
            .map_err(dnn_err("cudnnSetTensorNdDescriptorEx"))?;
        }
        Ok(desc)
    }

    /// A strided view's descriptor (`cudnnSetTensorNdDescriptor`): `dims` (4 or 5) with
    /// explicit `strides` in elements, e.g. a spatial chunk's rows of a full tensor.
    pub fn strided(dtype: DType, dims: &[i64], strides: &[i64]) -> Result<Self, CudnnError> {
        const CALL: &str = "TensorDescriptor::strided";
        let ints = |values: &[i64]| -> Result<Vec<i32>, CudnnError> {
            values
                .iter()
                .map(|&v| {
                    i32::try_from(v)
                        .map_err(|_| invalid(CALL, format!("{v} does not fit cuDNN's int")))
                })
                .collect()
        };
        let (dims, strides) = (ints(dims)?, ints(strides)?);
        let count = nb_dims(CALL, &dims)?;
        if strides.len() != dims.len() {
            return Err(invalid(
                CALL,
                format!("{} strides for {} dims", strides.len(), dims.len()),
            ));
        }
        cudnn()?;
        let raw =
            dnn::create_tensor_descriptor().map_err(dnn_err("cudnnCreateTensorDescriptor"))?;
        let desc = TensorDescriptor {
            raw,
            dims: Nd::from_slice(&dims),
        };
        // SAFETY: `raw` is a live descriptor owned by `desc`; `dims` and `strides` hold
        // `count` ints each and outlive the call, which copies them.
        unsafe {
            dnn_sys::cudnnSetTensorNdDescriptor(
                desc.raw,
                data_type(dtype),
                count,
                dims.as_ptr(),
                strides.as_ptr(),
            )
        }
        .result()
        .map_err(dnn_err("cudnnSetTensorNdDescriptor"))?;
        Ok(desc)
    }

    pub fn dims(&self) -> &[i32] {
        &self.dims
    }

    /// What cuDNN stored (`cudnnGetTensorNdDescriptor`): data type, dims and the strides it
    /// derived from the layout, to compare with the wall's own (`graph_params`).
    pub fn info(&self) -> Result<TensorDescriptorInfo, CudnnError> {
        // SAFETY: `self.raw` is a live tensor descriptor owned by `self`, created after the
        // cuDNN gate passed; `read_tensor_descriptor` only reads it.
        unsafe { foreign::read_tensor_descriptor(self.raw.cast()) }
    }
}

impl Drop for TensorDescriptor {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed exactly once, here.
        if let Err(e) = unsafe { dnn::destroy_tensor_descriptor(self.raw) } {
            warn_drop("cudnnDestroyTensorDescriptor", e.0);
        }
    }
}

/// A 4-D or 5-D filter descriptor: logical dims `[k, c / groups, r, s]` or
/// `[k, c / groups, t, r, s]`, packed in `layout` (NCHW: KCRS / KCTRS; NHWC: KRSC / KTRSC).
pub struct FilterDescriptor {
    pub(super) raw: dnn_sys::cudnnFilterDescriptor_t,
    dims: Nd<i32>,
}

impl FilterDescriptor {
    /// `dims` has 4 or 5 entries (else an error).
    pub fn new(dtype: DType, layout: Layout, dims: &[i32]) -> Result<Self, CudnnError> {
        let count = nb_dims("FilterDescriptor::new", dims)?;
        cudnn()?;
        let raw =
            dnn::create_filter_descriptor().map_err(dnn_err("cudnnCreateFilterDescriptor"))?;
        let desc = FilterDescriptor {
            raw,
            dims: Nd::from_slice(dims),
        };
        if let &[k, c, r, s] = dims {
            // SAFETY: `raw` is a live descriptor owned by `desc`. Note the argument order of
            // cudnnSetFilter4dDescriptor: data type before format.
            unsafe {
                dnn::set_filter4d_descriptor(
                    desc.raw,
                    data_type(dtype),
                    tensor_format(layout),
                    [k, c, r, s],
                )
            }
            .map_err(dnn_err("cudnnSetFilter4dDescriptor"))?;
        } else {
            // SAFETY: `raw` is a live descriptor owned by `desc`; `dims` holds `count` ints and
            // outlives the call, which copies them.
            unsafe {
                dnn::set_filternd_descriptor(
                    desc.raw,
                    data_type(dtype),
                    tensor_format(layout),
                    count,
                    dims.as_ptr(),
                )
            }
            .map_err(dnn_err("cudnnSetFilterNdDescriptor"))?;
        }
        Ok(desc)
    }

    pub fn dims(&self) -> &[i32] {
        &self.dims
    }

    /// What cuDNN stored (`cudnnGetFilterNdDescriptor`): data type, format and dims.
    pub fn info(&self) -> Result<FilterDescriptorInfo, CudnnError> {
        // SAFETY: `self.raw` is a live filter descriptor owned by `self`, created after the
        // cuDNN gate passed; `read_filter_descriptor` only reads it.
        unsafe { foreign::read_filter_descriptor(self.raw.cast()) }
    }
}

impl Drop for FilterDescriptor {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed exactly once, here.
        if let Err(e) = unsafe { dnn::destroy_filter_descriptor(self.raw) } {
            warn_drop("cudnnDestroyFilterDescriptor", e.0);
        }
    }
}

/// A 2-D or 3-D cross-correlation descriptor (what deep learning calls convolution): padding,
/// stride, dilation (depth first for 3-D), group count, fp32 compute, and the problem's math
/// mode.
pub struct ConvolutionDescriptor {
    pub(super) raw: dnn_sys::cudnnConvolutionDescriptor_t,
}

impl ConvolutionDescriptor {
    pub fn new(shapes: &ConvShapes) -> Result<Self, CudnnError> {
        cudnn()?;
        let raw = dnn::create_convolution_descriptor()
            .map_err(dnn_err("cudnnCreateConvolutionDescriptor"))?;
        let desc = ConvolutionDescriptor { raw };
        let mode = dnn_sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION;
        match (&*shapes.pad, &*shapes.stride, &*shapes.dilation) {
            (&[pad_h, pad_w], &[u, v], &[dilation_h, dilation_w]) => {
                // SAFETY: `raw` is a live descriptor owned by `desc`.
                unsafe {
                    dnn::set_convolution2d_descriptor(
                        desc.raw,
                        pad_h,
                        pad_w,
                        u,
                        v,
                        dilation_h,
                        dilation_w,
                        mode,
                        compute_type(shapes.dtype),
                    )
                }
                .map_err(dnn_err("cudnnSetConvolution2dDescriptor"))?;
            }
            (pad, stride, dilation)
                if pad.len() == 3 && stride.len() == 3 && dilation.len() == 3 =>
            {
                // SAFETY: `raw` is a live descriptor owned by `desc`; the three arrays hold 3
                // ints each and outlive the call, which copies them.
                unsafe {
                    dnn::set_convolutionnd_descriptor(
                        desc.raw,
                        3,
                        pad.as_ptr(),
                        stride.as_ptr(),
                        dilation.as_ptr(),
                        mode,
                        compute_type(shapes.dtype),
                    )
                }
                .map_err(dnn_err("cudnnSetConvolutionNdDescriptor"))?;
            }
            (pad, stride, dilation) => {
                return Err(invalid(
                    "ConvolutionDescriptor::new",
                    format!(
                        "padding {pad:?}, stride {stride:?}, dilation {dilation:?}: a \
                         convolution has 2 or 3 spatial dims, the same for all three"
                    ),
                ))
            }
        }
        // SAFETY (two calls): `raw` is a live descriptor owned by `desc`.
        unsafe { dnn::set_convolution_group_count(desc.raw, shapes.groups) }
            .map_err(dnn_err("cudnnSetConvolutionGroupCount"))?;
        // The problem's math mode, unless the known-bad list rules out tensor cores for it on
        // the loaded cuDNN: then timing and running alike use fma kernels.
        let math = crate::backend::cudnn::known_bad::effective_math(
            super::cudnn_version()?,
            shapes.dtype,
            shapes.pad.len(),
            shapes.math,
        );
        unsafe { dnn::set_convolution_math_type(desc.raw, math_type(math)) }
            .map_err(dnn_err("cudnnSetConvolutionMathType"))?;
        Ok(desc)
    }

    /// What cuDNN stored (`cudnnGetConvolutionNdDescriptor`, group count, math type).
    pub fn info(&self) -> Result<ConvolutionDescriptorInfo, CudnnError> {
        // SAFETY: `self.raw` is a live convolution descriptor owned by `self`, created after
        // the cuDNN gate passed; `read_convolution_descriptor` only reads it.
        unsafe { foreign::read_convolution_descriptor(self.raw.cast()) }
    }
}

impl Drop for ConvolutionDescriptor {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed exactly once, here.
        if let Err(e) = unsafe { dnn::destroy_convolution_descriptor(self.raw) } {
            warn_drop("cudnnDestroyConvolutionDescriptor", e.0);
        }
    }
}

/// All descriptors of one [`ConvProblem`] at one batch size: input, filter, output and
/// convolution. Build one per micro-batch size (`problem.with_batch(m)`). Descriptors are not
/// tied to a handle or device.
pub struct ConvDescriptors {
    pub(super) id: u64,
    problem: ConvProblem,
    pub(super) shapes: ConvShapes,
    pub(super) input: TensorDescriptor,
    pub(super) filter: FilterDescriptor,
    pub(super) output: TensorDescriptor,
    pub(super) conv: ConvolutionDescriptor,
}

impl std::fmt::Debug for ConvDescriptors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConvDescriptors")
            .field("problem", &self.problem.describe())
            .finish_non_exhaustive()
    }
}

impl ConvDescriptors {
    /// Validates `problem` (an error, not a panic, when invalid), then builds its descriptors
    /// (4-D for a 2-D or 1-D problem, 5-D for a 3-D one) and checks that cuDNN computes the
    /// same output size.
    pub fn new(problem: &ConvProblem) -> Result<Self, CudnnError> {
        let shapes = ConvShapes::new(problem)?;
        cudnn()?;
        let input = TensorDescriptor::new(shapes.dtype, shapes.layout, &shapes.input)?;
        let filter = FilterDescriptor::new(shapes.dtype, shapes.layout, &shapes.filter)?;
        let output = TensorDescriptor::new(shapes.dtype, shapes.layout, &shapes.output)?;
        let conv = ConvolutionDescriptor::new(&shapes)?;
        let rank = shapes.output.len();
        let mut out = [0 as std::ffi::c_int; 5];
        if rank == 4 {
            let [n, c, h, w, _] = &mut out;
            // SAFETY: the three descriptors are live and configured; the four outputs are
            // distinct live locals.
            unsafe {
                dnn_sys::cudnnGetConvolution2dForwardOutputDim(
                    conv.raw, input.raw, filter.raw, n, c, h, w,
                )
            }
            .result()
            .map_err(dnn_err("cudnnGetConvolution2dForwardOutputDim"))?;
        } else {
            // SAFETY: the three descriptors are live and configured; `out` has room for the
            // `rank` (5) ints cuDNN writes.
            unsafe {
                dnn_sys::cudnnGetConvolutionNdForwardOutputDim(
                    conv.raw,
                    input.raw,
                    filter.raw,
                    rank as std::ffi::c_int,
                    out.as_mut_ptr(),
                )
            }
            .result()
            .map_err(dnn_err("cudnnGetConvolutionNdForwardOutputDim"))?;
        }
        let dims = &out[..rank];
        if dims != &*shapes.output {
            return Err(invalid(
                "ConvDescriptors::new",
                format!(
                    "cuDNN computes output dims {dims:?} for {}, mucudnn {:?}",
                    problem.describe(),
                    shapes.output
                ),
            ));
        }
        Ok(ConvDescriptors {
            id: next_id(),
            problem: *problem,
            shapes,
            input,
            filter,
            output,
            conv,
        })
    }

    pub fn problem(&self) -> &ConvProblem {
        &self.problem
    }

    pub fn shapes(&self) -> &ConvShapes {
        &self.shapes
    }

    /// Elements each of `op`'s `[a, b, out]` views must hold (the descriptors' element counts).
    pub fn operand_spans(&self, op: ConvOp) -> [usize; 3] {
        operand_roles(op).map(|role| self.shapes.elements(role))
    }

    pub fn input(&self) -> &TensorDescriptor {
        &self.input
    }

    pub fn filter(&self) -> &FilterDescriptor {
        &self.filter
    }

    pub fn output(&self) -> &TensorDescriptor {
        &self.output
    }

    pub fn convolution(&self) -> &ConvolutionDescriptor {
        &self.conv
    }
}
