//! Legacy cuDNN descriptors owned by mucudnn: tensor, filter and convolution descriptors, and
//! the set of them one convolution problem needs ([`ConvDescriptors`]), made once per problem
//! and micro-batch size and destroyed on drop.

use super::*;

/// A 4-D tensor descriptor: logical dims `[n, c, h, w]`, packed in `layout`.
pub struct TensorDescriptor {
    pub(super) raw: dnn_sys::cudnnTensorDescriptor_t,
    dims: [i32; 4],
}

impl TensorDescriptor {
    pub fn new(dtype: DType, layout: Layout, dims: [i32; 4]) -> Result<Self, CudnnError> {
        cudnn()?;
        let raw =
            dnn::create_tensor_descriptor().map_err(dnn_err("cudnnCreateTensorDescriptor"))?;
        let desc = TensorDescriptor { raw, dims };
        // SAFETY: `raw` is a live descriptor owned by `desc` (destroyed by its Drop).
        unsafe {
            dnn::set_tensor4d_descriptor(desc.raw, tensor_format(layout), data_type(dtype), dims)
        }
        .map_err(dnn_err("cudnnSetTensor4dDescriptor"))?;
        Ok(desc)
    }

    pub fn dims(&self) -> [i32; 4] {
        self.dims
    }

    /// What cuDNN stored (`cudnnGetTensor4dDescriptor`): data type, dims and the strides it
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

/// A 4-D filter descriptor: logical dims `[k, c / groups, r, s]`, packed in `layout`
/// (NCHW: KCRS; NHWC: KRSC).
pub struct FilterDescriptor {
    pub(super) raw: dnn_sys::cudnnFilterDescriptor_t,
    dims: [i32; 4],
}

impl FilterDescriptor {
    pub fn new(dtype: DType, layout: Layout, dims: [i32; 4]) -> Result<Self, CudnnError> {
        cudnn()?;
        let raw =
            dnn::create_filter_descriptor().map_err(dnn_err("cudnnCreateFilterDescriptor"))?;
        let desc = FilterDescriptor { raw, dims };
        // SAFETY: `raw` is a live descriptor owned by `desc`. Note the argument order of
        // cudnnSetFilter4dDescriptor: data type before format.
        unsafe {
            dnn::set_filter4d_descriptor(desc.raw, data_type(dtype), tensor_format(layout), dims)
        }
        .map_err(dnn_err("cudnnSetFilter4dDescriptor"))?;
        Ok(desc)
    }

    pub fn dims(&self) -> [i32; 4] {
        self.dims
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

/// A 2-D cross-correlation descriptor (what deep learning calls convolution): padding,
/// stride, dilation, group count, fp32 compute, and the problem's math mode.
pub struct ConvolutionDescriptor {
    pub(super) raw: dnn_sys::cudnnConvolutionDescriptor_t,
}

impl ConvolutionDescriptor {
    pub fn new(shapes: &ConvShapes) -> Result<Self, CudnnError> {
        cudnn()?;
        let raw = dnn::create_convolution_descriptor()
            .map_err(dnn_err("cudnnCreateConvolutionDescriptor"))?;
        let desc = ConvolutionDescriptor { raw };
        let [pad_h, pad_w] = shapes.pad;
        let [u, v] = shapes.stride;
        let [dilation_h, dilation_w] = shapes.dilation;
        // SAFETY (three calls): `raw` is a live descriptor owned by `desc`.
        unsafe {
            dnn::set_convolution2d_descriptor(
                desc.raw,
                pad_h,
                pad_w,
                u,
                v,
                dilation_h,
                dilation_w,
                dnn_sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
                compute_type(shapes.dtype),
            )
        }
        .map_err(dnn_err("cudnnSetConvolution2dDescriptor"))?;
        unsafe { dnn::set_convolution_group_count(desc.raw, shapes.groups) }
            .map_err(dnn_err("cudnnSetConvolutionGroupCount"))?;
        unsafe { dnn::set_convolution_math_type(desc.raw, math_type(shapes.math)) }
            .map_err(dnn_err("cudnnSetConvolutionMathType"))?;
        Ok(desc)
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
    /// and checks that cuDNN computes the same output size.
    pub fn new(problem: &ConvProblem) -> Result<Self, CudnnError> {
        let shapes = ConvShapes::new(problem)?;
        cudnn()?;
        let input = TensorDescriptor::new(shapes.dtype, shapes.layout, shapes.input)?;
        let filter = FilterDescriptor::new(shapes.dtype, shapes.layout, shapes.filter)?;
        let output = TensorDescriptor::new(shapes.dtype, shapes.layout, shapes.output)?;
        let conv = ConvolutionDescriptor::new(&shapes)?;
        let mut dims = [0 as std::ffi::c_int; 4];
        let [n, c, h, w] = &mut dims;
        // SAFETY: the three descriptors are live and configured; the four outputs are
        // distinct live locals.
        unsafe {
            dnn_sys::cudnnGetConvolution2dForwardOutputDim(
                conv.raw, input.raw, filter.raw, n, c, h, w,
            )
        }
        .result()
        .map_err(dnn_err("cudnnGetConvolution2dForwardOutputDim"))?;
        if dims != shapes.output {
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

    pub fn input(&self) -> &TensorDescriptor {
        &self.input
    }

    pub fn filter(&self) -> &FilterDescriptor {
        &self.filter
    }

    pub fn output(&self) -> &TensorDescriptor {
        &self.output
    }
}
