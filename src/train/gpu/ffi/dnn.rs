//! cuDNN beyond convolution: activation, pooling, softmax, tensor add, bias gradient and
//! transform, on the backend's handle and tensor descriptors.
//!
//! Each op needs a proof that its symbols are exported: an [`ActivationDescriptor`], a
//! [`PoolingDescriptor`] or a [`TensorOps`] token, each made only by a constructor that checked
//! its symbols. Every call then checks each buffer against its own descriptor (dtype and exact
//! element count) and against the handle's stream.

use super::{check_extent, check_stream, DeviceData, DeviceDataMut};
use crate::backend::cudnn::{
    require_cudnn, status_error, warn_drop, CudnnError, CudnnHandle, TensorDescriptor,
};
use crate::solver::{DType, Layout};
use crate::train::gpu::error::{invalid, GpuTrainError};
use cudarc::cudnn::sys as dnn_sys;
use std::ffi::{c_int, c_void};

const ACTIVATION_SYMBOLS: &[&str] = &[
    "cudnnCreateActivationDescriptor",
    "cudnnSetActivationDescriptor",
    "cudnnDestroyActivationDescriptor",
    "cudnnActivationForward",
    "cudnnActivationBackward",
];

const POOLING_SYMBOLS: &[&str] = &[
    "cudnnCreatePoolingDescriptor",
    "cudnnSetPooling2dDescriptor",
    "cudnnGetPooling2dForwardOutputDim",
    "cudnnDestroyPoolingDescriptor",
    "cudnnPoolingForward",
    "cudnnPoolingBackward",
];

const TENSOR_OP_SYMBOLS: &[&str] = &[
    "cudnnSoftmaxForward",
    "cudnnAddTensor",
    "cudnnConvolutionBackwardBias",
    "cudnnTransformTensor",
];

/// The cuDNN gate plus: every symbol in `names` is exported (checked on each call: only
/// constructors call this, once per layer).
fn require_symbols(names: &[&str]) -> Result<(), GpuTrainError> {
    let version = require_cudnn()?;
    // SAFETY: the gate passed, so libcudnn is present and `culib` loads it without panicking.
    #[cfg(not(feature = "cudarc-linked"))]
    let lib = unsafe { dnn_sys::culib() };
    // Linked mode: linked at build time, every symbol is there.
    #[cfg(feature = "cudarc-linked")]
    let missing: Vec<&str> = names.iter().copied().filter(|_| false).collect();
    #[cfg(not(feature = "cudarc-linked"))]
    let missing: Vec<&str> = names
        .iter()
        .copied()
        // SAFETY: looking a symbol up does not call it; the type parameter is only the type the
        // (unused) symbol would be read as.
        .filter(|name| unsafe { lib.get::<unsafe extern "C" fn()>(name.as_bytes()) }.is_err())
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(CudnnError::Unavailable {
            what: "libcudnn",
            detail: format!(
                "cuDNN {version} does not export {} (the legacy ops library libcudnn_ops.so.9 \
                 missing, or a partial install?)",
                missing.join(", ")
            ),
        }
        .into())
    }
}

fn dnn_call(call: &'static str, status: dnn_sys::cudnnStatus_t) -> Result<(), GpuTrainError> {
    match status {
        dnn_sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS => Ok(()),
        other => Err(status_error(call, other).into()),
    }
}

// ---------------------------------------------------------------------------------------------
// Tensors

/// A packed 4-D tensor descriptor with what the checks need: dtype, layout, dims, elements.
pub(crate) struct Tensor {
    desc: TensorDescriptor,
    dtype: DType,
    layout: Layout,
    dims: [usize; 4],
    elements: usize,
}

impl Tensor {
    /// Dims `[n, c, h, w]`, each at least 1, whose product fits cuDNN's `int` strides.
    pub(crate) fn new(
        call: &'static str,
        dtype: DType,
        layout: Layout,
        dims: [usize; 4],
    ) -> Result<Self, GpuTrainError> {
        let elements = dims
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .filter(|&e| e > 0 && e <= i32::MAX as usize)
            .ok_or_else(|| {
                invalid(
                    call,
                    format!(
                        "tensor dims {dims:?} must be at least 1 each and hold at most {} \
                         elements (cuDNN's int strides)",
                        i32::MAX
                    ),
                )
            })?;
        let desc = TensorDescriptor::new(dtype, layout, dims.map(|d| d as i32))?;
        Ok(Tensor {
            desc,
            dtype,
            layout,
            dims,
            elements,
        })
    }

    fn describe(&self) -> String {
        let [n, c, h, w] = self.dims;
        format!(
            "its tensor {n}x{c}x{h}x{w} {} {}",
            self.dtype,
            match self.layout {
                Layout::Nchw => "nchw",
                Layout::Nhwc => "nhwc",
            }
        )
    }

    /// Checks `data` (called `name`) against this descriptor and `stream`.
    fn check<D: DeviceData + ?Sized>(
        &self,
        call: &'static str,
        name: &str,
        data: &D,
        handle: &CudnnHandle,
    ) -> Result<(), GpuTrainError> {
        check_extent(call, name, data, self.dtype, self.elements, &|| {
            self.describe()
        })?;
        check_stream(call, name, data, handle.stream())
    }

    fn raw(&self) -> dnn_sys::cudnnTensorDescriptor_t {
        self.desc.raw()
    }
}

// ---------------------------------------------------------------------------------------------
// Op descriptors and tokens

/// A ReLU activation descriptor (`CUDNN_ACTIVATION_RELU`, NaN not propagated).
pub(crate) struct ActivationDescriptor {
    raw: dnn_sys::cudnnActivationDescriptor_t,
}

impl ActivationDescriptor {
    pub(crate) fn relu() -> Result<Self, GpuTrainError> {
        require_symbols(ACTIVATION_SYMBOLS)?;
        let mut raw: dnn_sys::cudnnActivationDescriptor_t = std::ptr::null_mut();
        // SAFETY: the symbols exist (checked); the call writes one pointer to a live local.
        dnn_call("cudnnCreateActivationDescriptor", unsafe {
            dnn_sys::cudnnCreateActivationDescriptor(&mut raw)
        })?;
        // From here on, Drop destroys `raw`.
        let desc = ActivationDescriptor { raw };
        // SAFETY: `desc.raw` is a live descriptor owned by `desc`; `coef` is unused for ReLU.
        dnn_call("cudnnSetActivationDescriptor", unsafe {
            dnn_sys::cudnnSetActivationDescriptor(
                desc.raw,
                dnn_sys::cudnnActivationMode_t::CUDNN_ACTIVATION_RELU,
                dnn_sys::cudnnNanPropagation_t::CUDNN_NOT_PROPAGATE_NAN,
                0.0,
            )
        })?;
        Ok(desc)
    }
}

impl Drop for ActivationDescriptor {
    fn drop(&mut self) {
        // SAFETY: created in `relu`, destroyed exactly once, here.
        let status = unsafe { dnn_sys::cudnnDestroyActivationDescriptor(self.raw) };
        if status != dnn_sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
            warn_drop("cudnnDestroyActivationDescriptor", status);
        }
    }
}

/// A 2-D max-pooling descriptor (`CUDNN_POOLING_MAX_DETERMINISTIC`, no padding).
pub(crate) struct PoolingDescriptor {
    raw: dnn_sys::cudnnPoolingDescriptor_t,
}

impl PoolingDescriptor {
    /// Window and stride `[h, w]`, each in `1..=i32::MAX`.
    pub(crate) fn max(window: [usize; 2], stride: [usize; 2]) -> Result<Self, GpuTrainError> {
        const CALL: &str = "MaxPool2d::new";
        let to_int = |v: usize, what: &str| {
            c_int::try_from(v)
                .ok()
                .filter(|&v| v > 0)
                .ok_or_else(|| invalid(CALL, format!("pooling {what} {v} must be in 1..=2^31-1")))
        };
        let (wh, ww) = (to_int(window[0], "window")?, to_int(window[1], "window")?);
        let (sh, sw) = (to_int(stride[0], "stride")?, to_int(stride[1], "stride")?);
        require_symbols(POOLING_SYMBOLS)?;
        let mut raw: dnn_sys::cudnnPoolingDescriptor_t = std::ptr::null_mut();
        // SAFETY: the symbols exist (checked); the call writes one pointer to a live local.
        dnn_call("cudnnCreatePoolingDescriptor", unsafe {
            dnn_sys::cudnnCreatePoolingDescriptor(&mut raw)
        })?;
        let desc = PoolingDescriptor { raw };
        // SAFETY: `desc.raw` is a live descriptor owned by `desc`.
        dnn_call("cudnnSetPooling2dDescriptor", unsafe {
            dnn_sys::cudnnSetPooling2dDescriptor(
                desc.raw,
                dnn_sys::cudnnPoolingMode_t::CUDNN_POOLING_MAX_DETERMINISTIC,
                dnn_sys::cudnnNanPropagation_t::CUDNN_NOT_PROPAGATE_NAN,
                wh,
                ww,
                0,
                0,
                sh,
                sw,
            )
        })?;
        Ok(desc)
    }

    /// The output dims cuDNN computes for input `x`.
    pub(crate) fn output_dims(&self, x: &Tensor) -> Result<[usize; 4], GpuTrainError> {
        let mut dims = [0 as c_int; 4];
        let [n, c, h, w] = &mut dims;
        // SAFETY: both descriptors are live and configured; the four outputs are distinct
        // live locals.
        dnn_call("cudnnGetPooling2dForwardOutputDim", unsafe {
            dnn_sys::cudnnGetPooling2dForwardOutputDim(self.raw, x.raw(), n, c, h, w)
        })?;
        Ok(dims.map(|d| d.max(0) as usize))
    }
}

impl Drop for PoolingDescriptor {
    fn drop(&mut self) {
        // SAFETY: created in `max`, destroyed exactly once, here.
        let status = unsafe { dnn_sys::cudnnDestroyPoolingDescriptor(self.raw) };
        if status != dnn_sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
            warn_drop("cudnnDestroyPoolingDescriptor", status);
        }
    }
}

/// Proof that the descriptor-free tensor ops (softmax, add, bias gradient, transform) are
/// exported.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TensorOps {
    _checked: (),
}

impl TensorOps {
    pub(crate) fn new() -> Result<Self, GpuTrainError> {
        require_symbols(TENSOR_OP_SYMBOLS)?;
        Ok(TensorOps { _checked: () })
    }
}

/// cuDNN's softmax algorithms that the ops use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SoftmaxAlgorithm {
    /// `CUDNN_SOFTMAX_ACCURATE`: `exp(x - max) / sum`.
    Accurate,
    /// `CUDNN_SOFTMAX_LOG`: `x - max - log(sum(exp(x - max)))`.
    Log,
}

/// An op of the shape `y = alpha * f(x) + beta * y` (one input, one output, each with its own
/// descriptor).
pub(crate) enum Unary<'a> {
    /// `cudnnActivationForward`.
    Activation(&'a ActivationDescriptor),
    /// `cudnnPoolingForward`.
    Pooling(&'a PoolingDescriptor),
    /// `cudnnSoftmaxForward` in channel mode.
    Softmax(SoftmaxAlgorithm, TensorOps),
    /// `cudnnAddTensor`: `x` is the (broadcast) bias, `y` the tensor it is added to.
    AddTensor(TensorOps),
    /// `cudnnConvolutionBackwardBias`: `x` is dy, `y` is db (`1 x C x 1 x 1`).
    BiasGradient(TensorOps),
    /// `cudnnTransformTensor`: same dims, any dtype and layout on each side.
    Transform(TensorOps),
}

/// `y = alpha * op(x) + beta * y` on the handle's stream (asynchronously).
#[allow(clippy::too_many_arguments)]
pub(crate) fn unary(
    handle: &CudnnHandle,
    call: &'static str,
    op: Unary<'_>,
    alpha: f32,
    x_desc: &Tensor,
    x: &dyn DeviceData,
    beta: f32,
    y_desc: &Tensor,
    y: &mut dyn DeviceDataMut,
) -> Result<(), GpuTrainError> {
    x_desc.check(call, "the input", x, handle)?;
    y_desc.check(call, "the output", y, handle)?;
    handle.bind()?;
    let stream: &cudarc::driver::CudaStream = handle.stream();
    let (x_ptr, _x_sync) = x.raw_read(stream);
    let (y_ptr, _y_sync) = y.raw_write(stream);
    let (x_ptr, y_ptr) = (x_ptr as *const c_void, y_ptr as *mut c_void);
    let alpha_ptr = (&alpha as *const f32).cast::<c_void>();
    let beta_ptr = (&beta as *const f32).cast::<c_void>();
    let raw = handle.raw();
    let (x_raw, y_raw) = (x_desc.raw(), y_desc.raw());
    // SAFETY (every arm):
    // - `raw` is the live handle of `handle` (not `Sync`, so used by this thread alone), bound
    //   to its context, with its stream set to `handle.stream()`;
    // - the op's symbols exist: its descriptor or token was made by a constructor that checked
    //   them;
    // - `x` and `y` point into live allocations (borrowed for the call) on the handle's stream
    //   with exactly the dtype and element count of their descriptors (checked above), so cuDNN
    //   reads and writes only inside them; `y` is borrowed mutably, so it aliases nothing;
    // - alpha and beta point to host f32 locals, cuDNN's scaling type for float, half and
    //   bfloat16 data; cuDNN copies what it needs before returning and frees are stream-ordered
    //   after the guards record this use.
    let (name, status) = unsafe {
        match op {
            Unary::Activation(act) => (
                "cudnnActivationForward",
                dnn_sys::cudnnActivationForward(
                    raw, act.raw, alpha_ptr, x_raw, x_ptr, beta_ptr, y_raw, y_ptr,
                ),
            ),
            Unary::Pooling(pool) => (
                "cudnnPoolingForward",
                dnn_sys::cudnnPoolingForward(
                    raw, pool.raw, alpha_ptr, x_raw, x_ptr, beta_ptr, y_raw, y_ptr,
                ),
            ),
            Unary::Softmax(algorithm, _) => (
                "cudnnSoftmaxForward",
                dnn_sys::cudnnSoftmaxForward(
                    raw,
                    match algorithm {
                        SoftmaxAlgorithm::Accurate => {
                            dnn_sys::cudnnSoftmaxAlgorithm_t::CUDNN_SOFTMAX_ACCURATE
                        }
                        SoftmaxAlgorithm::Log => {
                            dnn_sys::cudnnSoftmaxAlgorithm_t::CUDNN_SOFTMAX_LOG
                        }
                    },
                    dnn_sys::cudnnSoftmaxMode_t::CUDNN_SOFTMAX_MODE_CHANNEL,
                    alpha_ptr,
                    x_raw,
                    x_ptr,
                    beta_ptr,
                    y_raw,
                    y_ptr,
                ),
            ),
            Unary::AddTensor(_) => (
                "cudnnAddTensor",
                dnn_sys::cudnnAddTensor(raw, alpha_ptr, x_raw, x_ptr, beta_ptr, y_raw, y_ptr),
            ),
            Unary::BiasGradient(_) => (
                "cudnnConvolutionBackwardBias",
                dnn_sys::cudnnConvolutionBackwardBias(
                    raw, alpha_ptr, x_raw, x_ptr, beta_ptr, y_raw, y_ptr,
                ),
            ),
            Unary::Transform(_) => (
                "cudnnTransformTensor",
                dnn_sys::cudnnTransformTensor(raw, alpha_ptr, x_raw, x_ptr, beta_ptr, y_raw, y_ptr),
            ),
        }
    };
    dnn_call(name, status)
}

/// The backward ops with cuDNN's `(y, dy, x) -> dx` signature.
pub(crate) enum Backward<'a> {
    /// `cudnnActivationBackward`.
    Activation(&'a ActivationDescriptor),
    /// `cudnnPoolingBackward`.
    Pooling(&'a PoolingDescriptor),
}

/// The tensors of a backward op: `y` and `dy` share the output descriptor, `x` and `dx` the
/// input descriptor.
pub(crate) struct BackwardOperands<'a> {
    pub(crate) x_desc: &'a Tensor,
    pub(crate) x: &'a dyn DeviceData,
    pub(crate) y_desc: &'a Tensor,
    pub(crate) y: &'a dyn DeviceData,
    pub(crate) dy: &'a dyn DeviceData,
}

/// `dx = alpha * op'(y, dy, x) + beta * dx` on the handle's stream (asynchronously).
pub(crate) fn backward(
    handle: &CudnnHandle,
    call: &'static str,
    op: Backward<'_>,
    alpha: f32,
    operands: BackwardOperands<'_>,
    beta: f32,
    dx: &mut dyn DeviceDataMut,
) -> Result<(), GpuTrainError> {
    let BackwardOperands {
        x_desc,
        x,
        y_desc,
        y,
        dy,
    } = operands;
    x_desc.check(call, "x", x, handle)?;
    y_desc.check(call, "y", y, handle)?;
    y_desc.check(call, "dy", dy, handle)?;
    x_desc.check(call, "dx", dx, handle)?;
    handle.bind()?;
    let stream: &cudarc::driver::CudaStream = handle.stream();
    let (x_ptr, _x_sync) = x.raw_read(stream);
    let (y_ptr, _y_sync) = y.raw_read(stream);
    let (dy_ptr, _dy_sync) = dy.raw_read(stream);
    let (dx_ptr, _dx_sync) = dx.raw_write(stream);
    let (x_ptr, y_ptr, dy_ptr) = (
        x_ptr as *const c_void,
        y_ptr as *const c_void,
        dy_ptr as *const c_void,
    );
    let dx_ptr = dx_ptr as *mut c_void;
    let alpha_ptr = (&alpha as *const f32).cast::<c_void>();
    let beta_ptr = (&beta as *const f32).cast::<c_void>();
    let raw = handle.raw();
    let (x_raw, y_raw) = (x_desc.raw(), y_desc.raw());
    // SAFETY (both arms): as in `unary`: live bound handle used by this thread alone, symbols
    // checked by the descriptor's constructor, every buffer checked against its descriptor
    // (y and dy: the output's; x and dx: the input's) and the handle's stream, `dx` exclusive,
    // alpha/beta host f32 locals. Argument order is cuDNN's: desc, alpha, yDesc, y, dyDesc,
    // dy, xDesc, x, beta, dxDesc, dx.
    let (name, status) = unsafe {
        match op {
            Backward::Activation(act) => (
                "cudnnActivationBackward",
                dnn_sys::cudnnActivationBackward(
                    raw, act.raw, alpha_ptr, y_raw, y_ptr, y_raw, dy_ptr, x_raw, x_ptr, beta_ptr,
                    x_raw, dx_ptr,
                ),
            ),
            Backward::Pooling(pool) => (
                "cudnnPoolingBackward",
                dnn_sys::cudnnPoolingBackward(
                    raw, pool.raw, alpha_ptr, y_raw, y_ptr, y_raw, dy_ptr, x_raw, x_ptr, beta_ptr,
                    x_raw, dx_ptr,
                ),
            ),
        }
    };
    dnn_call(name, status)
}
