//! Comparing two convolution outputs on the GPU with cuDNN's own tensor operations: the part of
//! the wall verified tuning stands on.
//!
//! `difference = out - reference` is one `cudnnOpTensor` (ADD with `alpha2 = -1`), and the
//! largest magnitudes of the difference and of the reference are two `cudnnReduceTensor`
//! (AMAX, NaN propagated) into one-element tensors: no kernel of mucudnn's, and nothing of the
//! outputs is copied to the host, only the two maxima. The descriptors are made without a
//! handle ([`ComparisonDescriptors`]: the host tier builds them for every dtype and layout the
//! tuner uses); [`OutputComparison`] adds the device scratch (the difference, the two maxima,
//! the reduction's workspace) on one handle's stream.
//!
//! `cudnnOpTensor` and `cudnnReduceTensor` are legacy ("deprecated since 9.0") functions: their
//! own gate ([`compare_api`]) checks that the loaded cuDNN exports them, so a cuDNN without them
//! loses verification only (measurements are then not compared), never the convolutions.

use super::*;

/// Every cuDNN function this part calls, checked by its own gate.
pub(super) const COMPARE_SYMBOLS: &[&str] = &[
    "cudnnCreateOpTensorDescriptor",
    "cudnnSetOpTensorDescriptor",
    "cudnnGetOpTensorDescriptor",
    "cudnnDestroyOpTensorDescriptor",
    "cudnnOpTensor",
    "cudnnCreateReduceTensorDescriptor",
    "cudnnSetReduceTensorDescriptor",
    "cudnnGetReduceTensorDescriptor",
    "cudnnDestroyReduceTensorDescriptor",
    "cudnnGetReductionWorkspaceSize",
    "cudnnReduceTensor",
];

/// Gate for comparing outputs: the legacy gate, then [`COMPARE_SYMBOLS`]. Cached.
pub fn compare_api() -> Result<(), CudnnError> {
    static GATE: OnceLock<Result<(), CudnnError>> = OnceLock::new();
    GATE.get_or_init(|| {
        symbols_gate(COMPARE_SYMBOLS, |version, missing| {
            format!(
                "cuDNN {version} does not export {missing}: outputs cannot be compared on the \
                 GPU (measurements stay unverified)"
            )
        })
    })
    .clone()
}

/// `cudnnOpTensor`'s descriptor: element-wise ADD computed in fp32, NaN propagated.
struct OpTensorDescriptor {
    raw: dnn_sys::cudnnOpTensorDescriptor_t,
}

impl OpTensorDescriptor {
    fn add() -> Result<Self, CudnnError> {
        compare_api()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: the gate passed; `raw` is a local cuDNN writes the new descriptor to.
        unsafe { dnn_sys::cudnnCreateOpTensorDescriptor(&mut raw) }
            .result()
            .map_err(dnn_err("cudnnCreateOpTensorDescriptor"))?;
        let desc = OpTensorDescriptor { raw };
        // SAFETY: `desc.raw` is live and owned by `desc` (destroyed by its Drop).
        unsafe {
            dnn_sys::cudnnSetOpTensorDescriptor(
                desc.raw,
                dnn_sys::cudnnOpTensorOp_t::CUDNN_OP_TENSOR_ADD,
                dnn_sys::cudnnDataType_t::CUDNN_DATA_FLOAT,
                dnn_sys::cudnnNanPropagation_t::CUDNN_PROPAGATE_NAN,
            )
        }
        .result()
        .map_err(dnn_err("cudnnSetOpTensorDescriptor"))?;
        Ok(desc)
    }

    /// What cuDNN stored: (op, compute type, NaN option) as their enum numbers.
    fn read(&self) -> Result<[u32; 3], CudnnError> {
        let mut values = [u32::MAX; 3];
        let [op, compute, nan] = &mut values;
        // SAFETY: `self.raw` is live; cuDNN writes one enum (a `u32`-sized C enum) to each
        // pointer, read back as `u32` so that an unknown value is not undefined behaviour.
        unsafe {
            dnn_sys::cudnnGetOpTensorDescriptor(
                self.raw,
                (op as *mut u32).cast(),
                (compute as *mut u32).cast(),
                (nan as *mut u32).cast(),
            )
        }
        .result()
        .map_err(dnn_err("cudnnGetOpTensorDescriptor"))?;
        Ok(values)
    }
}

impl Drop for OpTensorDescriptor {
    fn drop(&mut self) {
        // SAFETY: created in `add`, destroyed exactly once, here.
        if let Err(e) = unsafe { dnn_sys::cudnnDestroyOpTensorDescriptor(self.raw) }.result() {
            warn_drop("cudnnDestroyOpTensorDescriptor", e.0);
        }
    }
}

/// `cudnnReduceTensor`'s descriptor: AMAX (the largest magnitude) computed in fp32, NaN
/// propagated (an output with NaN has a NaN maximum), no indices.
struct ReduceTensorDescriptor {
    raw: dnn_sys::cudnnReduceTensorDescriptor_t,
}

impl ReduceTensorDescriptor {
    fn amax() -> Result<Self, CudnnError> {
        compare_api()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: the gate passed; `raw` is a local cuDNN writes the new descriptor to.
        unsafe { dnn_sys::cudnnCreateReduceTensorDescriptor(&mut raw) }
            .result()
            .map_err(dnn_err("cudnnCreateReduceTensorDescriptor"))?;
        let desc = ReduceTensorDescriptor { raw };
        // SAFETY: `desc.raw` is live and owned by `desc` (destroyed by its Drop).
        unsafe {
            dnn_sys::cudnnSetReduceTensorDescriptor(
                desc.raw,
                dnn_sys::cudnnReduceTensorOp_t::CUDNN_REDUCE_TENSOR_AMAX,
                dnn_sys::cudnnDataType_t::CUDNN_DATA_FLOAT,
                dnn_sys::cudnnNanPropagation_t::CUDNN_PROPAGATE_NAN,
                dnn_sys::cudnnReduceTensorIndices_t::CUDNN_REDUCE_TENSOR_NO_INDICES,
                dnn_sys::cudnnIndicesType_t::CUDNN_32BIT_INDICES,
            )
        }
        .result()
        .map_err(dnn_err("cudnnSetReduceTensorDescriptor"))?;
        Ok(desc)
    }

    /// What cuDNN stored: (op, compute type, NaN option, indices, indices type) as numbers.
    fn read(&self) -> Result<[u32; 5], CudnnError> {
        let mut values = [u32::MAX; 5];
        let [op, compute, nan, indices, indices_type] = &mut values;
        // SAFETY: as in `OpTensorDescriptor::read`.
        unsafe {
            dnn_sys::cudnnGetReduceTensorDescriptor(
                self.raw,
                (op as *mut u32).cast(),
                (compute as *mut u32).cast(),
                (nan as *mut u32).cast(),
                (indices as *mut u32).cast(),
                (indices_type as *mut u32).cast(),
            )
        }
        .result()
        .map_err(dnn_err("cudnnGetReduceTensorDescriptor"))?;
        Ok(values)
    }
}

impl Drop for ReduceTensorDescriptor {
    fn drop(&mut self) {
        // SAFETY: created in `amax`, destroyed exactly once, here.
        if let Err(e) = unsafe { dnn_sys::cudnnDestroyReduceTensorDescriptor(self.raw) }.result() {
            warn_drop("cudnnDestroyReduceTensorDescriptor", e.0);
        }
    }
}

/// What cuDNN stored in a comparison's descriptors, for the host tier.
#[derive(Clone, Debug, PartialEq)]
pub struct ComparisonInfo {
    /// The output tensor, as cuDNN read it back.
    pub output: TensorDescriptorInfo,
    /// The one-element tensor each maximum goes to.
    pub scalar: TensorDescriptorInfo,
    /// Whether the op is ADD in fp32 with NaN propagated, and the reduction AMAX in fp32 with
    /// NaN propagated and no indices.
    pub add_in_fp32: bool,
    pub amax_in_fp32: bool,
}

/// The descriptors that compare two outputs of one op's output role: the output tensor (its
/// dims packed in the problem's layout), a one-element tensor of the same rank and dtype, the
/// subtraction and the maximum. Made without a handle.
pub struct ComparisonDescriptors {
    output: TensorDescriptor,
    scalar: TensorDescriptor,
    add: OpTensorDescriptor,
    amax: ReduceTensorDescriptor,
    dtype: DType,
    len: usize,
}

impl ComparisonDescriptors {
    /// For an output of `dtype` with `dims` (4 for a 2-D problem, 5 for a 3-D one) packed in
    /// `layout` (a filter's dims for backward-filter: KCRS in NCHW, KRSC in NHWC).
    pub fn new(dtype: DType, layout: Layout, dims: &[i32]) -> Result<Self, CudnnError> {
        compare_api()?;
        let output = TensorDescriptor::new(dtype, layout, dims)?;
        let ones = vec![1; dims.len()];
        let scalar = TensorDescriptor::new(dtype, layout, &ones)?;
        let len = dims.iter().map(|&d| d.max(0) as usize).product();
        Ok(ComparisonDescriptors {
            output,
            scalar,
            add: OpTensorDescriptor::add()?,
            amax: ReduceTensorDescriptor::amax()?,
            dtype,
            len,
        })
    }

    /// The output of `op` on `shapes` (its micro-batch): the role `op` writes.
    pub fn for_output(shapes: &ConvShapes, op: ConvOp) -> Result<Self, CudnnError> {
        let [_, _, out] = operand_roles(op);
        Self::new(shapes.dtype, shapes.layout, &shapes.dims(out))
    }

    /// Elements of the output compared.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// What cuDNN stored in the descriptors.
    pub fn info(&self) -> Result<ComparisonInfo, CudnnError> {
        use dnn_sys::cudnnDataType_t::CUDNN_DATA_FLOAT as FLOAT;
        use dnn_sys::cudnnNanPropagation_t::CUDNN_PROPAGATE_NAN as PROPAGATE;
        let add = self.add.read()?;
        let amax = self.amax.read()?;
        Ok(ComparisonInfo {
            output: self.output.info()?,
            scalar: self.scalar.info()?,
            add_in_fp32: add
                == [
                    dnn_sys::cudnnOpTensorOp_t::CUDNN_OP_TENSOR_ADD as u32,
                    FLOAT as u32,
                    PROPAGATE as u32,
                ],
            amax_in_fp32: amax
                == [
                    dnn_sys::cudnnReduceTensorOp_t::CUDNN_REDUCE_TENSOR_AMAX as u32,
                    FLOAT as u32,
                    PROPAGATE as u32,
                    dnn_sys::cudnnReduceTensorIndices_t::CUDNN_REDUCE_TENSOR_NO_INDICES as u32,
                    dnn_sys::cudnnIndicesType_t::CUDNN_32BIT_INDICES as u32,
                ],
        })
    }
}

/// [`ComparisonDescriptors`] with their device scratch on one handle's stream: the difference
/// (an output-sized buffer), the two maxima and the reduction's workspace.
pub struct OutputComparison {
    descriptors: ComparisonDescriptors,
    difference: DeviceBuffer,
    maxima: DeviceBuffer,
    workspace: Workspace,
}

impl OutputComparison {
    /// The comparison of outputs described by `descriptors`, its scratch allocated on `handle`.
    pub fn new(
        handle: &CudnnHandle,
        descriptors: ComparisonDescriptors,
    ) -> Result<Self, CudnnError> {
        const CALL: &str = "cudnnGetReductionWorkspaceSize";
        let difference = handle.alloc_zeroed(descriptors.dtype, descriptors.len.max(1))?;
        let maxima = handle.alloc_zeroed(descriptors.dtype, 2)?;
        handle.bind()?;
        let mut bytes = 0usize;
        // SAFETY: the handle is live and used by this thread alone (borrowed), its context
        // current; the descriptors are live (owned by `descriptors`); `bytes` is a local.
        unsafe {
            dnn_sys::cudnnGetReductionWorkspaceSize(
                handle.raw,
                descriptors.amax.raw,
                descriptors.output.raw,
                descriptors.scalar.raw,
                &mut bytes,
            )
        }
        .result()
        .map_err(dnn_err(CALL))?;
        let workspace = handle.alloc_workspace(bytes as u64)?;
        Ok(OutputComparison {
            descriptors,
            difference,
            maxima,
            workspace,
        })
    }

    /// Device bytes the scratch holds.
    pub fn bytes(&self) -> u64 {
        (self.difference.size_bytes() + self.maxima.size_bytes()) as u64 + self.workspace.bytes()
    }

    /// `(max |out - reference|, max |reference|)`, computed on `handle`'s stream (the
    /// handle this comparison was made on) and read back as two numbers (NaN when an output
    /// holds NaN). Both views must be of the handle's stream, of the comparison's dtype and
    /// length.
    pub fn max_differences(
        &mut self,
        handle: &CudnnHandle,
        out: &DeviceView<'_>,
        reference: &DeviceView<'_>,
    ) -> Result<(f64, f64), CudnnError> {
        const CALL: &str = "OutputComparison::max_differences";
        let d = &self.descriptors;
        for (name, view) in [("out", out), ("reference", reference)] {
            if view.dtype != d.dtype || view.len != d.len {
                return Err(invalid(
                    CALL,
                    format!(
                        "{name} has {} {} elements, the comparison {} {}",
                        view.len, view.dtype, d.len, d.dtype
                    ),
                ));
            }
            if view
                .origin
                .stream()
                .is_some_and(|stream| !handle.orders(stream))
            {
                return Err(invalid(
                    CALL,
                    format!("{name} was allocated on another stream or device"),
                ));
            }
        }
        if !handle.orders(&self.difference.stream) {
            return Err(invalid(
                CALL,
                "the comparison was made on another handle".into(),
            ));
        }
        let (one, minus_one, zero) = (1.0f32, -1.0f32, 0.0f32);
        let difference = self.difference.view_all_mut();
        let (maximum_of_difference, maximum_of_reference) = {
            let maxima = self.maxima.view_all_mut();
            (maxima.ptr, maxima.ptr + d.dtype.size_bytes() as u64)
        };
        let workspace = self.workspace.view();
        handle.bind()?;
        // SAFETY: the handle is live and used by this thread alone, its context current (bound
        // above) and its stream the one work goes to; `out` and `reference` are views of
        // buffers on that stream (checked) with the descriptor's dtype and element count
        // (checked), borrowed for the call, so their memory stays allocated until the queued
        // work has run (cudarc frees stream-ordered); `difference`, the maxima and the
        // workspace are this comparison's own buffers on that stream (mutably borrowed), of
        // the descriptor's size, two elements and the size cuDNN asked for; the scale factors
        // are host floats read during the calls (float scaling for float, half and bfloat16).
        unsafe {
            dnn_sys::cudnnOpTensor(
                handle.raw,
                d.add.raw,
                (&raw const one).cast(),
                d.output.raw,
                out.ptr as *const c_void,
                (&raw const minus_one).cast(),
                d.output.raw,
                reference.ptr as *const c_void,
                (&raw const zero).cast(),
                d.output.raw,
                difference.ptr as *mut c_void,
            )
            .result()
            .map_err(dnn_err("cudnnOpTensor"))?;
            for (input, maximum) in [
                (difference.ptr, maximum_of_difference),
                (reference.ptr, maximum_of_reference),
            ] {
                dnn_sys::cudnnReduceTensor(
                    handle.raw,
                    d.amax.raw,
                    std::ptr::null_mut(),
                    0,
                    workspace.raw_ptr(),
                    workspace.bytes as usize,
                    (&raw const one).cast(),
                    d.output.raw,
                    input as *const c_void,
                    (&raw const zero).cast(),
                    d.scalar.raw,
                    maximum as *mut c_void,
                )
                .result()
                .map_err(dnn_err("cudnnReduceTensor"))?;
            }
        }
        let maxima = self.maxima.download()?;
        Ok((f64::from(maxima[0]), f64::from(maxima[1])))
    }
}
