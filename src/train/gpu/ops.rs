//! The layers of a small CNN besides convolution, on one GPU: ReLU, max-pooling, softmax,
//! bias (conv outputs), a linear layer, dtype/layout transforms and the SGD update. Each has
//! a host reference implementation here, which the GPU tests compare against and which
//! documents exactly what the device computes.
//!
//! # Data flow
//!
//! A [`GpuOps`] is one replica's cuDNN handle plus a cuBLAS handle, both on one stream; the
//! convolutions run through the micro-batched plans on the same handle
//! (`crate::exec::cudnn::PreparedPlan::execute(ops.cudnn(), ..)`). A layer object (e.g.
//! [`MaxPool2d`]) is built once per shape: its constructor validates the shape (an
//! [`GpuTrainError::InvalidArgument`], before any library is needed), checks that cuDNN
//! exports what it calls, and builds its descriptors; its `forward`/`backward` methods then
//! queue work on the stream without synchronising. Buffers are anything [`DeviceData`]:
//! `CudaSlice<f32 | f16 | bf16>`, views of one, or the backend's `DeviceBuffer`; each must
//! have exactly the dtype and element count of its role and live on the ops' stream, or the
//! call is an error value.
//!
//! Layouts: activations are NCHW or NHWC ([`TensorShape`]); the linear layer takes its input
//! as a row-major `batch x features` matrix, which is an NCHW activation as it lies in memory
//! (for NHWC the features are just in another, equally valid, order).
//!
//! # Precision
//!
//! The cuDNN ops take fp32, fp16 (and where cuDNN has it bf16) data with fp32 scaling. The
//! linear layer and SGD are fp32 (cuBLAS `Sgemm`/`Saxpy`/`Sscal`): fp16 training keeps fp32
//! master weights and gradients, with [`Transform`] converting between them (and between
//! NCHW and NHWC).
//!
//! # Loss
//!
//! Softmax runs on the device ([`Softmax`]); the cross-entropy loss and its gradient are
//! finished on the host ([`cross_entropy_host`]): the logits are tiny (batch x classes), so
//! one download and one upload per step cost less than a kernel launch would save.

#![forbid(unsafe_code)]

use super::error::{invalid, GpuTrainError};
use super::ffi::blas::{BlasHandle, Gemm};
use super::ffi::dnn::{
    self, ActivationDescriptor, Backward, BackwardOperands, PoolingDescriptor, SoftmaxAlgorithm,
    Tensor, TensorOps, Unary,
};
use super::ffi::{DeviceData, DeviceDataMut};
use crate::backend::cudnn::{driver_error, CudnnHandle, DeviceBuffer};
use crate::solver::{DType, Layout};
use cudarc::driver::{CudaSlice, CudaStream};
use std::sync::Arc;

// ---------------------------------------------------------------------------------------------
// Handles

/// One replica's GPU handles: the cuDNN handle (shared with the convolution plans) and a cuBLAS
/// handle, both issuing work to one stream. Not `Send`: make it on the thread that drives the
/// GPU.
pub struct GpuOps {
    cudnn: CudnnHandle,
    blas: BlasHandle,
}

impl std::fmt::Debug for GpuOps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuOps")
            .field("device", &self.ordinal())
            .finish_non_exhaustive()
    }
}

impl GpuOps {
    /// Handles on GPU `ordinal`, with a new stream.
    pub fn new(ordinal: usize) -> Result<Self, GpuTrainError> {
        Self::with_handle(CudnnHandle::new(ordinal)?)
    }

    /// Handles whose work goes to `stream` (e.g. an [`super::NcclComm`]'s).
    pub fn with_stream(stream: Arc<CudaStream>) -> Result<Self, GpuTrainError> {
        Self::with_handle(CudnnHandle::with_stream(stream)?)
    }

    /// Adds a cuBLAS handle on `cudnn`'s stream.
    pub fn with_handle(cudnn: CudnnHandle) -> Result<Self, GpuTrainError> {
        let blas = BlasHandle::new(cudnn.stream().clone())?;
        Ok(GpuOps { cudnn, blas })
    }

    /// The cuDNN handle: run convolution plans and allocate `DeviceBuffer`s with it.
    pub fn cudnn(&self) -> &CudnnHandle {
        &self.cudnn
    }

    /// The stream all of this replica's work goes to.
    pub fn stream(&self) -> &Arc<CudaStream> {
        self.cudnn.stream()
    }

    pub fn ordinal(&self) -> usize {
        self.cudnn.ordinal()
    }

    /// Waits for everything queued on the stream.
    pub fn synchronize(&self) -> Result<(), GpuTrainError> {
        Ok(self.cudnn.synchronize()?)
    }

    /// The sum of `|x|` over fp32 buffers on the stream, in f64 on the host (waits for the
    /// stream): inf or NaN when any value is (the fp16 loss scaler's check).
    pub fn sum_abs_f32<'a>(
        &self,
        buffers: impl IntoIterator<Item = &'a DeviceBuffer>,
    ) -> Result<f64, GpuTrainError> {
        let mut total = 0.0f64;
        for buffer in buffers {
            total += f64::from(self.blas.asum("GpuOps::sum_abs_f32", buffer)?);
        }
        Ok(total)
    }

    /// An fp32 buffer holding `values`, on the stream.
    pub fn upload_f32(&self, values: &[f32]) -> Result<CudaSlice<f32>, GpuTrainError> {
        if values.is_empty() {
            return Err(invalid("GpuOps::upload_f32", "no values"));
        }
        self.stream()
            .clone_htod(values)
            .map_err(|e| driver_error("cuMemcpyHtoDAsync", e).into())
    }

    /// A zero-filled fp32 buffer of `len` elements, on the stream.
    pub fn zeros_f32(&self, len: usize) -> Result<CudaSlice<f32>, GpuTrainError> {
        if len == 0 {
            return Err(invalid("GpuOps::zeros_f32", "zero elements"));
        }
        self.stream()
            .alloc_zeros::<f32>(len)
            .map_err(|e| driver_error("cuMemAlloc", e).into())
    }

    /// Copies an fp32 buffer to the host, after the work queued before.
    pub fn download_f32(&self, data: &CudaSlice<f32>) -> Result<Vec<f32>, GpuTrainError> {
        let values = self
            .stream()
            .clone_dtoh(data)
            .map_err(|e| driver_error("cuMemcpyDtoHAsync", e))?;
        self.synchronize()?;
        Ok(values)
    }
}

/// The cuBLAS this process loads, `(major, minor, patch)`: its gate (driver, libcublas, every
/// symbol the ops call).
pub fn cublas_version() -> Result<(i32, i32, i32), GpuTrainError> {
    super::ffi::blas::cublas()
}

// ---------------------------------------------------------------------------------------------
// Shapes

/// A 4-D activation: dims `[n, c, h, w]`, element type and memory layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TensorShape {
    pub dims: [usize; 4],
    pub dtype: DType,
    pub layout: Layout,
}

impl TensorShape {
    pub fn new(dims: [usize; 4], dtype: DType, layout: Layout) -> Self {
        TensorShape {
            dims,
            dtype,
            layout,
        }
    }

    /// A flat vector of `len` elements (`[len, 1, 1, 1]`): parameters and their gradients.
    pub fn vector(len: usize, dtype: DType) -> Self {
        TensorShape::new([len, 1, 1, 1], dtype, Layout::Nchw)
    }

    pub fn with_dtype(self, dtype: DType) -> Self {
        TensorShape { dtype, ..self }
    }

    pub fn with_layout(self, layout: Layout) -> Self {
        TensorShape { layout, ..self }
    }

    /// `n * c * h * w` (saturating; constructors reject what does not fit).
    pub fn elements(&self) -> usize {
        self.dims.iter().fold(1usize, |a, &d| a.saturating_mul(d))
    }

    /// The offset of element `[n, c, h, w]` in this layout.
    pub fn offset(&self, [n, c, h, w]: [usize; 4]) -> usize {
        let [_, cs, hs, ws] = self.dims;
        match self.layout {
            Layout::Nchw => ((n * cs + c) * hs + h) * ws + w,
            Layout::Nhwc => ((n * hs + h) * ws + w) * cs + c,
        }
    }

    /// E.g. `8x16x28x28 fp16 nhwc`.
    pub fn describe(&self) -> String {
        let [n, c, h, w] = self.dims;
        let layout = match self.layout {
            Layout::Nchw => "nchw",
            Layout::Nhwc => "nhwc",
        };
        format!("{n}x{c}x{h}x{w} {} {layout}", self.dtype)
    }

    fn descriptor(&self, call: &'static str) -> Result<Tensor, GpuTrainError> {
        Tensor::new(call, self.dtype, self.layout, self.dims)
    }

    /// Every `[n, c, h, w]` index, in NCHW order.
    fn indices(&self) -> impl Iterator<Item = [usize; 4]> {
        let [n, c, h, w] = self.dims;
        (0..n).flat_map(move |ni| {
            (0..c).flat_map(move |ci| {
                (0..h).flat_map(move |hi| (0..w).map(move |wi| [ni, ci, hi, wi]))
            })
        })
    }
}

/// Checks a buffer the wall does not see whole (the linear layer's and SGD's): exact length
/// and dtype.
fn check_len<D: DeviceData + ?Sized>(
    call: &'static str,
    name: &str,
    data: &D,
    dtype: DType,
    len: usize,
) -> Result<(), GpuTrainError> {
    if data.dtype() != dtype || data.elements() != len {
        return Err(invalid(
            call,
            format!(
                "{name} is {} {} elements, expected {dtype} {len}",
                data.elements(),
                data.dtype()
            ),
        ));
    }
    Ok(())
}

/// `product` of `factors` if it is at least 1 and fits cuDNN's and cuBLAS's `int`.
fn int_product(call: &'static str, what: &str, factors: &[usize]) -> Result<usize, GpuTrainError> {
    factors
        .iter()
        .try_fold(1usize, |a, &f| a.checked_mul(f))
        .filter(|&p| p >= 1 && p <= i32::MAX as usize)
        .ok_or_else(|| {
            invalid(
                call,
                format!(
                    "{what} {factors:?} must be at least 1 each and multiply to at most 2^31-1"
                ),
            )
        })
}

// ---------------------------------------------------------------------------------------------
// ReLU

/// ReLU over one activation shape (`cudnnActivationForward/Backward`, `CUDNN_ACTIVATION_RELU`).
pub struct Relu {
    shape: TensorShape,
    desc: Tensor,
    activation: ActivationDescriptor,
}

impl Relu {
    pub fn new(shape: TensorShape) -> Result<Self, GpuTrainError> {
        let desc = shape.descriptor("Relu::new")?;
        let activation = ActivationDescriptor::relu()?;
        Ok(Relu {
            shape,
            desc,
            activation,
        })
    }

    pub fn shape(&self) -> TensorShape {
        self.shape
    }

    /// `y = max(x, 0)`.
    pub fn forward(
        &self,
        ops: &GpuOps,
        x: &impl DeviceData,
        y: &mut impl DeviceDataMut,
    ) -> Result<(), GpuTrainError> {
        dnn::unary(
            &ops.cudnn,
            "Relu::forward",
            Unary::Activation(&self.activation),
            1.0,
            &self.desc,
            x,
            0.0,
            &self.desc,
            y,
        )
    }

    /// `dx = dy` where `x > 0`, else 0 (`y` is the forward output, which cuDNN also reads).
    pub fn backward(
        &self,
        ops: &GpuOps,
        x: &impl DeviceData,
        y: &impl DeviceData,
        dy: &impl DeviceData,
        dx: &mut impl DeviceDataMut,
    ) -> Result<(), GpuTrainError> {
        dnn::backward(
            &ops.cudnn,
            "Relu::backward",
            Backward::Activation(&self.activation),
            1.0,
            BackwardOperands {
                x_desc: &self.desc,
                x,
                y_desc: &self.desc,
                y,
                dy,
            },
            0.0,
            dx,
        )
    }
}

/// Host reference of [`Relu::forward`].
pub fn relu_forward_host(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| v.max(0.0)).collect()
}

/// Host reference of [`Relu::backward`].
pub fn relu_backward_host(x: &[f32], dy: &[f32]) -> Vec<f32> {
    x.iter()
        .zip(dy)
        .map(|(&x, &g)| if x > 0.0 { g } else { 0.0 })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Max pooling

/// The output dims of a `window` max-pool with `stride` and no padding:
/// `(in - window) / stride + 1` per spatial dim; `None` when a window or stride is 0 or the
/// window is larger than the input.
pub fn pool_output_dims(
    input: [usize; 4],
    window: [usize; 2],
    stride: [usize; 2],
) -> Option<[usize; 4]> {
    let [n, c, h, w] = input;
    let out = |size: usize, win: usize, step: usize| {
        (win > 0 && step > 0 && size >= win).then(|| (size - win) / step + 1)
    };
    Some([
        n,
        c,
        out(h, window[0], stride[0])?,
        out(w, window[1], stride[1])?,
    ])
}

/// Max-pooling without padding (`cudnnPoolingForward/Backward`,
/// `CUDNN_POOLING_MAX_DETERMINISTIC`); the output has the input's dtype and layout.
pub struct MaxPool2d {
    input: TensorShape,
    output: TensorShape,
    window: [usize; 2],
    stride: [usize; 2],
    x: Tensor,
    y: Tensor,
    pooling: PoolingDescriptor,
}

impl MaxPool2d {
    /// `window` and `stride` are `[h, w]`.
    pub fn new(
        input: TensorShape,
        window: [usize; 2],
        stride: [usize; 2],
    ) -> Result<Self, GpuTrainError> {
        const CALL: &str = "MaxPool2d::new";
        let out_dims = pool_output_dims(input.dims, window, stride).ok_or_else(|| {
            invalid(
                CALL,
                format!(
                    "a {window:?} window with stride {stride:?} does not fit input {}",
                    input.describe()
                ),
            )
        })?;
        let output = TensorShape {
            dims: out_dims,
            ..input
        };
        let x = input.descriptor(CALL)?;
        let y = output.descriptor(CALL)?;
        let pooling = PoolingDescriptor::max(window, stride)?;
        let cudnn_dims = pooling.output_dims(&x)?;
        if cudnn_dims != out_dims {
            return Err(invalid(
                CALL,
                format!(
                    "cuDNN computes output dims {cudnn_dims:?} for {}, mucudnn {out_dims:?}",
                    input.describe()
                ),
            ));
        }
        Ok(MaxPool2d {
            input,
            output,
            window,
            stride,
            x,
            y,
            pooling,
        })
    }

    /// The usual 2x2 window with stride 2 (odd trailing rows and columns are dropped).
    pub fn two_by_two(input: TensorShape) -> Result<Self, GpuTrainError> {
        Self::new(input, [2, 2], [2, 2])
    }

    pub fn input_shape(&self) -> TensorShape {
        self.input
    }

    pub fn output_shape(&self) -> TensorShape {
        self.output
    }

    pub fn window(&self) -> [usize; 2] {
        self.window
    }

    pub fn stride(&self) -> [usize; 2] {
        self.stride
    }

    /// `y[n, c, i, j] = max` of `x` over the window at `(i * stride, j * stride)`.
    pub fn forward(
        &self,
        ops: &GpuOps,
        x: &impl DeviceData,
        y: &mut impl DeviceDataMut,
    ) -> Result<(), GpuTrainError> {
        dnn::unary(
            &ops.cudnn,
            "MaxPool2d::forward",
            Unary::Pooling(&self.pooling),
            1.0,
            &self.x,
            x,
            0.0,
            &self.y,
            y,
        )
    }

    /// `dx` (overwritten): each output's `dy` added at its window's maximum in `x`, 0 elsewhere.
    pub fn backward(
        &self,
        ops: &GpuOps,
        x: &impl DeviceData,
        y: &impl DeviceData,
        dy: &impl DeviceData,
        dx: &mut impl DeviceDataMut,
    ) -> Result<(), GpuTrainError> {
        dnn::backward(
            &ops.cudnn,
            "MaxPool2d::backward",
            Backward::Pooling(&self.pooling),
            1.0,
            BackwardOperands {
                x_desc: &self.x,
                x,
                y_desc: &self.y,
                y,
                dy,
            },
            0.0,
            dx,
        )
    }
}

/// For each output element (in NCHW index order): its offset in `y` and the offset in `x` of its
/// window's maximum (the first one in row-major window order on ties).
fn pool_argmax(
    input: TensorShape,
    window: [usize; 2],
    stride: [usize; 2],
    x: &[f32],
) -> Vec<(usize, usize)> {
    let out_dims = pool_output_dims(input.dims, window, stride).expect("pooling fits the input");
    let output = TensorShape {
        dims: out_dims,
        ..input
    };
    output
        .indices()
        .map(|[n, c, i, j]| {
            let mut best = input.offset([n, c, i * stride[0], j * stride[1]]);
            for wi in 0..window[0] {
                for wj in 0..window[1] {
                    let at = input.offset([n, c, i * stride[0] + wi, j * stride[1] + wj]);
                    if x[at] > x[best] {
                        best = at;
                    }
                }
            }
            (output.offset([n, c, i, j]), best)
        })
        .collect()
}

/// Host reference of [`MaxPool2d::forward`] (`x` in `input`'s layout; the result in the same
/// layout).
pub fn max_pool_forward_host(
    input: TensorShape,
    window: [usize; 2],
    stride: [usize; 2],
    x: &[f32],
) -> Vec<f32> {
    let argmax = pool_argmax(input, window, stride, x);
    let mut y = vec![0.0; argmax.len()];
    for (out, at) in argmax {
        y[out] = x[at];
    }
    y
}

/// Host reference of [`MaxPool2d::backward`].
pub fn max_pool_backward_host(
    input: TensorShape,
    window: [usize; 2],
    stride: [usize; 2],
    x: &[f32],
    dy: &[f32],
) -> Vec<f32> {
    let mut dx = vec![0.0; x.len()];
    for (out, at) in pool_argmax(input, window, stride, x) {
        dx[at] += dy[out];
    }
    dx
}

// ---------------------------------------------------------------------------------------------
// Softmax and the loss

/// What [`Softmax`] outputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SoftmaxKind {
    /// Probabilities (`CUDNN_SOFTMAX_ACCURATE`: the maximum is subtracted first).
    Probabilities,
    /// Log-probabilities (`CUDNN_SOFTMAX_LOG`): a loss without `log(0)`.
    LogProbabilities,
}

/// Softmax over the classes of `batch x classes` logits (`cudnnSoftmaxForward`, channel mode
/// on a `batch x classes x 1 x 1` tensor).
pub struct Softmax {
    batch: usize,
    classes: usize,
    kind: SoftmaxKind,
    desc: Tensor,
    tensor_ops: TensorOps,
}

impl Softmax {
    pub fn new(
        batch: usize,
        classes: usize,
        dtype: DType,
        kind: SoftmaxKind,
    ) -> Result<Self, GpuTrainError> {
        let desc = TensorShape::new([batch, classes, 1, 1], dtype, Layout::Nchw)
            .descriptor("Softmax::new")?;
        let tensor_ops = TensorOps::new()?;
        Ok(Softmax {
            batch,
            classes,
            kind,
            desc,
            tensor_ops,
        })
    }

    pub fn batch(&self) -> usize {
        self.batch
    }

    pub fn classes(&self) -> usize {
        self.classes
    }

    pub fn kind(&self) -> SoftmaxKind {
        self.kind
    }

    /// `out[b, k] = exp(logits[b, k]) / sum_j exp(logits[b, j])` (or its log).
    pub fn forward(
        &self,
        ops: &GpuOps,
        logits: &impl DeviceData,
        out: &mut impl DeviceDataMut,
    ) -> Result<(), GpuTrainError> {
        let algorithm = match self.kind {
            SoftmaxKind::Probabilities => SoftmaxAlgorithm::Accurate,
            SoftmaxKind::LogProbabilities => SoftmaxAlgorithm::Log,
        };
        dnn::unary(
            &ops.cudnn,
            "Softmax::forward",
            Unary::Softmax(algorithm, self.tensor_ops),
            1.0,
            &self.desc,
            logits,
            0.0,
            &self.desc,
            out,
        )
    }
}

/// Host reference of [`Softmax::forward`] on row-major `batch x classes` logits.
pub fn softmax_host(kind: SoftmaxKind, classes: usize, logits: &[f32]) -> Vec<f32> {
    let mut out = Vec::with_capacity(logits.len());
    for row in logits.chunks(classes.max(1)) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let sum: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
        out.extend(row.iter().map(|&v| {
            let shifted = v as f64 - max;
            (match kind {
                SoftmaxKind::Probabilities => shifted.exp() / sum,
                SoftmaxKind::LogProbabilities => shifted - sum.ln(),
            }) as f32
        }));
    }
    out
}

/// The mean softmax cross-entropy of one batch and its gradient.
#[derive(Clone, Debug, PartialEq)]
pub struct CrossEntropy {
    /// `-mean_b log p[b, label_b]`.
    pub loss: f32,
    /// `d loss / d logits = (p - onehot(label)) / batch`, row-major `batch x classes`: upload it
    /// as the linear layer's `dy`.
    pub grad_logits: Vec<f32>,
    /// How many rows have their label as the most probable class.
    pub correct: usize,
}

/// The loss and its gradient from [`Softmax`]'s output (downloaded), finished on the host:
/// `softmax_out` holds `kind` values for `labels.len() x classes`. Probabilities below the
/// smallest normal f32 are clamped there before the log.
pub fn cross_entropy_host(
    kind: SoftmaxKind,
    classes: usize,
    softmax_out: &[f32],
    labels: &[usize],
) -> Result<CrossEntropy, GpuTrainError> {
    const CALL: &str = "cross_entropy_host";
    let batch = labels.len();
    if classes == 0 || batch == 0 || softmax_out.len() != batch * classes {
        return Err(invalid(
            CALL,
            format!(
                "{} softmax values for {batch} labels of {classes} classes",
                softmax_out.len()
            ),
        ));
    }
    if let Some((row, label)) = labels.iter().enumerate().find(|(_, &l)| l >= classes) {
        return Err(invalid(
            CALL,
            format!("label {label} of row {row} is not one of {classes} classes"),
        ));
    }
    let mut loss = 0.0f64;
    let mut grad_logits = Vec::with_capacity(softmax_out.len());
    let mut correct = 0;
    for (row, &label) in softmax_out.chunks(classes).zip(labels) {
        let (log_p, probabilities): (f64, Vec<f64>) = match kind {
            SoftmaxKind::Probabilities => (
                (row[label].max(f32::MIN_POSITIVE) as f64).ln(),
                row.iter().map(|&p| p as f64).collect(),
            ),
            SoftmaxKind::LogProbabilities => (
                row[label] as f64,
                row.iter().map(|&l| (l as f64).exp()).collect(),
            ),
        };
        loss -= log_p;
        let best = (0..classes)
            .max_by(|&a, &b| probabilities[a].total_cmp(&probabilities[b]))
            .expect("at least one class");
        correct += usize::from(best == label);
        grad_logits.extend(probabilities.iter().enumerate().map(|(k, &p)| {
            let target = if k == label { 1.0 } else { 0.0 };
            ((p - target) / batch as f64) as f32
        }));
    }
    Ok(CrossEntropy {
        loss: (loss / batch as f64) as f32,
        grad_logits,
        correct,
    })
}

// ---------------------------------------------------------------------------------------------
// Bias

/// The per-channel bias of a convolution output: `y += b` (`cudnnAddTensor`) and
/// `db = sum over n, h, w of dy` (`cudnnConvolutionBackwardBias`). The bias has `c` elements of
/// the output's dtype.
pub struct Bias {
    output: TensorShape,
    y: Tensor,
    b: Tensor,
    tensor_ops: TensorOps,
}

impl Bias {
    pub fn new(output: TensorShape) -> Result<Self, GpuTrainError> {
        const CALL: &str = "Bias::new";
        let y = output.descriptor(CALL)?;
        // 1 x C x 1 x 1 is the same memory in either layout; the same layout keeps cuDNN's
        // broadcasting rules simple.
        let b = TensorShape {
            dims: [1, output.dims[1], 1, 1],
            ..output
        }
        .descriptor(CALL)?;
        let tensor_ops = TensorOps::new()?;
        Ok(Bias {
            output,
            y,
            b,
            tensor_ops,
        })
    }

    pub fn output_shape(&self) -> TensorShape {
        self.output
    }

    /// The bias's element count (the output's channels).
    pub fn bias_len(&self) -> usize {
        self.output.dims[1]
    }

    /// `y[n, c, h, w] += bias[c]`, in place.
    pub fn forward(
        &self,
        ops: &GpuOps,
        bias: &impl DeviceData,
        y: &mut impl DeviceDataMut,
    ) -> Result<(), GpuTrainError> {
        dnn::unary(
            &ops.cudnn,
            "Bias::forward",
            Unary::AddTensor(self.tensor_ops),
            1.0,
            &self.b,
            bias,
            1.0,
            &self.y,
            y,
        )
    }

    /// `db[c] = sum over n, h, w of dy[n, c, h, w]`; with `accumulate` added to `db` instead
    /// (micro-batches, several losses).
    pub fn backward(
        &self,
        ops: &GpuOps,
        dy: &impl DeviceData,
        db: &mut impl DeviceDataMut,
        accumulate: bool,
    ) -> Result<(), GpuTrainError> {
        dnn::unary(
            &ops.cudnn,
            "Bias::backward",
            Unary::BiasGradient(self.tensor_ops),
            1.0,
            &self.y,
            dy,
            if accumulate { 1.0 } else { 0.0 },
            &self.b,
            db,
        )
    }
}

/// Host reference of [`Bias::forward`].
pub fn bias_add_host(output: TensorShape, y: &mut [f32], bias: &[f32]) {
    for index in output.indices() {
        y[output.offset(index)] += bias[index[1]];
    }
}

/// Host reference of [`Bias::backward`] (without accumulation).
pub fn bias_grad_host(output: TensorShape, dy: &[f32]) -> Vec<f32> {
    let mut db = vec![0.0f64; output.dims[1]];
    for index in output.indices() {
        db[index[1]] += dy[output.offset(index)] as f64;
    }
    db.into_iter().map(|v| v as f32).collect()
}

// ---------------------------------------------------------------------------------------------
// Linear

/// The linear layer's three GEMMs as cuBLAS (column-major) sees them: a row-major `r x c`
/// matrix is the column-major `c x r` matrix (its transpose) with leading dimension `c`.
/// `[forward, backward_data, backward_weights]`:
/// - forward: `y^T (o x b) = W (o x i; stored as W^T, i x o, so transposed) * x^T (i x b)`;
/// - backward data: `dx^T (i x b) = W^T (i x o; W's storage) * dy^T (o x b; dy's storage)`;
/// - backward weights: `dW^T (i x o) = x^T (i x b; x's storage) * dy (b x o; dy's storage
///   transposed)`.
fn linear_gemms(batch: usize, inputs: usize, outputs: usize) -> [Gemm; 3] {
    let (b, i, o) = (batch, inputs, outputs);
    [
        Gemm {
            transpose_a: true,
            transpose_b: false,
            m: o,
            n: b,
            k: i,
            lda: i,
            ldb: i,
            ldc: o,
        },
        Gemm {
            transpose_a: false,
            transpose_b: false,
            m: i,
            n: b,
            k: o,
            lda: i,
            ldb: o,
            ldc: i,
        },
        Gemm {
            transpose_a: false,
            transpose_b: true,
            m: i,
            n: o,
            k: b,
            lda: i,
            ldb: o,
            ldc: i,
        },
    ]
}

/// A fully connected fp32 layer, row-major as PyTorch's `nn.Linear`: `x` is
/// `batch x in_features`, the weight `out_features x in_features`, the bias `out_features`,
/// `y` is `batch x out_features`. GEMMs by cuBLAS (`cublasSgemm_v2`, fp32 math); the bias by
/// cuDNN on a `batch x out x 1 x 1` view.
pub struct Linear {
    batch: usize,
    in_features: usize,
    out_features: usize,
    y: Tensor,
    b: Tensor,
    tensor_ops: TensorOps,
}

impl Linear {
    pub fn new(
        batch: usize,
        in_features: usize,
        out_features: usize,
    ) -> Result<Self, GpuTrainError> {
        const CALL: &str = "Linear::new";
        int_product(CALL, "batch x in_features", &[batch, in_features])?;
        int_product(
            CALL,
            "out_features x in_features",
            &[out_features, in_features],
        )?;
        let y = TensorShape::new([batch, out_features, 1, 1], DType::Fp32, Layout::Nchw)
            .descriptor(CALL)?;
        let b = TensorShape::new([1, out_features, 1, 1], DType::Fp32, Layout::Nchw)
            .descriptor(CALL)?;
        let tensor_ops = TensorOps::new()?;
        Ok(Linear {
            batch,
            in_features,
            out_features,
            y,
            b,
            tensor_ops,
        })
    }

    pub fn batch(&self) -> usize {
        self.batch
    }

    pub fn in_features(&self) -> usize {
        self.in_features
    }

    pub fn out_features(&self) -> usize {
        self.out_features
    }

    /// `out_features * in_features`.
    pub fn weight_len(&self) -> usize {
        self.out_features * self.in_features
    }

    fn check_operand<D: DeviceData + ?Sized>(
        &self,
        call: &'static str,
        name: &str,
        data: &D,
        [rows, cols]: [usize; 2],
    ) -> Result<(), GpuTrainError> {
        check_len(call, name, data, DType::Fp32, rows * cols).map_err(|_| {
            invalid(
                call,
                format!(
                    "{name} must be a {rows} x {cols} fp32 matrix ({} elements), got {} {} \
                     elements",
                    rows * cols,
                    data.elements(),
                    data.dtype()
                ),
            )
        })
    }

    /// `y = x W^T + b`.
    pub fn forward(
        &self,
        ops: &GpuOps,
        x: &impl DeviceData,
        weight: &impl DeviceData,
        bias: &impl DeviceData,
        y: &mut impl DeviceDataMut,
    ) -> Result<(), GpuTrainError> {
        const CALL: &str = "Linear::forward";
        let (b, i, o) = (self.batch, self.in_features, self.out_features);
        self.check_operand(CALL, "x", x, [b, i])?;
        self.check_operand(CALL, "weight", weight, [o, i])?;
        self.check_operand(CALL, "bias", bias, [1, o])?;
        self.check_operand(CALL, "y", y, [b, o])?;
        let [gemm, _, _] = linear_gemms(b, i, o);
        ops.blas.gemm(CALL, gemm, 1.0, weight, x, 0.0, &mut *y)?;
        dnn::unary(
            &ops.cudnn,
            CALL,
            Unary::AddTensor(self.tensor_ops),
            1.0,
            &self.b,
            bias,
            1.0,
            &self.y,
            y,
        )
    }

    /// `dx = dy W` (the gradient for the layer below).
    pub fn backward_data(
        &self,
        ops: &GpuOps,
        dy: &impl DeviceData,
        weight: &impl DeviceData,
        dx: &mut impl DeviceDataMut,
    ) -> Result<(), GpuTrainError> {
        const CALL: &str = "Linear::backward_data";
        let (b, i, o) = (self.batch, self.in_features, self.out_features);
        self.check_operand(CALL, "dy", dy, [b, o])?;
        self.check_operand(CALL, "weight", weight, [o, i])?;
        self.check_operand(CALL, "dx", dx, [b, i])?;
        let [_, gemm, _] = linear_gemms(b, i, o);
        ops.blas.gemm(CALL, gemm, 1.0, weight, dy, 0.0, dx)
    }

    /// `dW = dy^T x` and `db = sum over the batch of dy`; with `accumulate` both are added
    /// to instead of overwritten.
    pub fn backward_weights(
        &self,
        ops: &GpuOps,
        x: &impl DeviceData,
        dy: &impl DeviceData,
        dweight: &mut impl DeviceDataMut,
        dbias: &mut impl DeviceDataMut,
        accumulate: bool,
    ) -> Result<(), GpuTrainError> {
        const CALL: &str = "Linear::backward_weights";
        let (b, i, o) = (self.batch, self.in_features, self.out_features);
        self.check_operand(CALL, "x", x, [b, i])?;
        self.check_operand(CALL, "dy", dy, [b, o])?;
        self.check_operand(CALL, "dweight", dweight, [o, i])?;
        self.check_operand(CALL, "dbias", dbias, [1, o])?;
        let beta = if accumulate { 1.0 } else { 0.0 };
        let [_, _, gemm] = linear_gemms(b, i, o);
        ops.blas.gemm(CALL, gemm, 1.0, x, dy, beta, dweight)?;
        dnn::unary(
            &ops.cudnn,
            CALL,
            Unary::BiasGradient(self.tensor_ops),
            1.0,
            &self.y,
            dy,
            beta,
            &self.b,
            dbias,
        )
    }
}

/// Host reference of [`Linear::forward`] (f64 accumulation).
pub fn linear_forward_host(
    [batch, in_features, out_features]: [usize; 3],
    x: &[f32],
    weight: &[f32],
    bias: &[f32],
) -> Vec<f32> {
    let mut y = Vec::with_capacity(batch * out_features);
    for row in x.chunks(in_features).take(batch) {
        for (o, w_row) in weight.chunks(in_features).take(out_features).enumerate() {
            let dot: f64 = row
                .iter()
                .zip(w_row)
                .map(|(&a, &w)| a as f64 * w as f64)
                .sum();
            y.push((dot + bias[o] as f64) as f32);
        }
    }
    y
}

/// The gradients of a linear layer.
#[derive(Clone, Debug, PartialEq)]
pub struct LinearGrads {
    /// `batch x in_features`.
    pub dx: Vec<f32>,
    /// `out_features x in_features`.
    pub dweight: Vec<f32>,
    /// `out_features`.
    pub dbias: Vec<f32>,
}

/// Host reference of [`Linear::backward_data`] and [`Linear::backward_weights`].
pub fn linear_backward_host(
    [batch, in_features, out_features]: [usize; 3],
    x: &[f32],
    weight: &[f32],
    dy: &[f32],
) -> LinearGrads {
    let (b, i, o) = (batch, in_features, out_features);
    let mut dx = vec![0.0f64; b * i];
    let mut dweight = vec![0.0f64; o * i];
    let mut dbias = vec![0.0f64; o];
    for n in 0..b {
        for k in 0..o {
            let g = dy[n * o + k] as f64;
            dbias[k] += g;
            for j in 0..i {
                dx[n * i + j] += g * weight[k * i + j] as f64;
                dweight[k * i + j] += g * x[n * i + j] as f64;
            }
        }
    }
    let to_f32 = |v: Vec<f64>| v.into_iter().map(|v| v as f32).collect();
    LinearGrads {
        dx: to_f32(dx),
        dweight: to_f32(dweight),
        dbias: to_f32(dbias),
    }
}

// ---------------------------------------------------------------------------------------------
// Transform

/// Copies a tensor into another dtype and/or layout (`cudnnTransformTensor`): fp32 master
/// weights to fp16 and fp16 gradients to fp32 (as flat [`TensorShape::vector`]s), activations
/// between NCHW and NHWC.
pub struct Transform {
    from: TensorShape,
    to: TensorShape,
    x: Tensor,
    y: Tensor,
    tensor_ops: TensorOps,
}

impl Transform {
    /// `from` and `to` must have the same dims.
    pub fn new(from: TensorShape, to: TensorShape) -> Result<Self, GpuTrainError> {
        const CALL: &str = "Transform::new";
        if from.dims != to.dims {
            return Err(invalid(
                CALL,
                format!(
                    "dims differ: {} to {} (a transform changes dtype and layout only)",
                    from.describe(),
                    to.describe()
                ),
            ));
        }
        let x = from.descriptor(CALL)?;
        let y = to.descriptor(CALL)?;
        let tensor_ops = TensorOps::new()?;
        Ok(Transform {
            from,
            to,
            x,
            y,
            tensor_ops,
        })
    }

    pub fn from_shape(&self) -> TensorShape {
        self.from
    }

    pub fn to_shape(&self) -> TensorShape {
        self.to
    }

    /// `y = x` converted (round to nearest) and rearranged.
    pub fn run(
        &self,
        ops: &GpuOps,
        x: &impl DeviceData,
        y: &mut impl DeviceDataMut,
    ) -> Result<(), GpuTrainError> {
        self.run_scaled(ops, 1.0, x, y)
    }

    /// `y = alpha * x` converted and rearranged (the scale is applied in fp32 before the
    /// rounding to `y`'s dtype): loss scaling into and out of fp16.
    pub fn run_scaled(
        &self,
        ops: &GpuOps,
        alpha: f32,
        x: &impl DeviceData,
        y: &mut impl DeviceDataMut,
    ) -> Result<(), GpuTrainError> {
        if !alpha.is_finite() {
            return Err(invalid(
                "Transform::run_scaled",
                format!("the scale {alpha} is not finite"),
            ));
        }
        dnn::unary(
            &ops.cudnn,
            "Transform::run",
            Unary::Transform(self.tensor_ops),
            alpha,
            &self.x,
            x,
            0.0,
            &self.y,
            y,
        )
    }
}

/// Host reference of [`Transform::run`]: `x` in `from`'s layout, the result in `to`'s layout,
/// rounded to `to.dtype`.
pub fn transform_host(from: TensorShape, to: TensorShape, x: &[f32]) -> Vec<f32> {
    let mut y = vec![0.0; to.elements()];
    for index in from.indices() {
        y[to.offset(index)] =
            crate::backend::cudnn::host::quantize(to.dtype, x[from.offset(index)]);
    }
    y
}

// ---------------------------------------------------------------------------------------------
// SGD

/// SGD hyper-parameters, with PyTorch's semantics (`torch.optim.SGD`, no dampening, no
/// Nesterov): `v = momentum * v + (g + weight_decay * w)`, `w -= learning_rate * v`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdConfig {
    pub learning_rate: f32,
    pub momentum: f32,
    pub weight_decay: f32,
}

impl SgdConfig {
    /// Every value finite and non-negative.
    pub fn validate(&self) -> Result<(), GpuTrainError> {
        for (name, value) in [
            ("learning rate", self.learning_rate),
            ("momentum", self.momentum),
            ("weight decay", self.weight_decay),
        ] {
            if !value.is_finite() || value < 0.0 {
                return Err(invalid(
                    "SgdConfig::validate",
                    format!("the {name} is {value}; it must be finite and at least 0"),
                ));
            }
        }
        Ok(())
    }
}

/// The SGD update on the device, over one parameter tensor at a time (fp32): cuBLAS `scal`
/// and `axpy` on the ops' stream. The velocity starts at zero, which makes the first step
/// PyTorch's (its momentum buffer starts as the first gradient).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sgd {
    config: SgdConfig,
}

impl Sgd {
    pub fn new(config: SgdConfig) -> Result<Self, GpuTrainError> {
        config.validate()?;
        Ok(Sgd { config })
    }

    pub fn config(&self) -> SgdConfig {
        self.config
    }

    /// One update of `weights` from `grads` (already averaged over the replicas) and the
    /// parameter's `velocity` buffer; all three fp32 of one length.
    pub fn step(
        &self,
        ops: &GpuOps,
        weights: &mut impl DeviceDataMut,
        grads: &impl DeviceData,
        velocity: &mut impl DeviceDataMut,
    ) -> Result<(), GpuTrainError> {
        const CALL: &str = "Sgd::step";
        let len = weights.elements();
        check_len(CALL, "weights", weights, DType::Fp32, len)?;
        check_len(CALL, "grads", grads, DType::Fp32, len)?;
        check_len(CALL, "velocity", velocity, DType::Fp32, len)?;
        let SgdConfig {
            learning_rate,
            momentum,
            weight_decay,
        } = self.config;
        // v = momentum * v + g + weight_decay * w; w = w - learning_rate * v
        ops.blas.scal(CALL, momentum, &mut *velocity)?;
        ops.blas.axpy(CALL, 1.0, grads, &mut *velocity)?;
        if weight_decay != 0.0 {
            ops.blas
                .axpy(CALL, weight_decay, &*weights, &mut *velocity)?;
        }
        ops.blas.axpy(CALL, -learning_rate, &*velocity, weights)
    }
}

/// Host reference of [`Sgd::step`], in the same order of operations.
pub fn sgd_step_host(config: SgdConfig, weights: &mut [f32], grads: &[f32], velocity: &mut [f32]) {
    for ((w, &g), v) in weights.iter_mut().zip(grads).zip(velocity.iter_mut()) {
        *v *= config.momentum;
        *v += g;
        *v += config.weight_decay * *w;
        *w += -config.learning_rate * *v;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cudnn::host::{quantize, XorShift};
    use crate::train::gpu::ffi::blas::matrix_span;

    fn shape(dims: [usize; 4], layout: Layout) -> TensorShape {
        TensorShape::new(dims, DType::Fp32, layout)
    }

    /// Distinct values (no ties for max-pooling), exact in fp16: a shuffled `k / 64`.
    fn distinct_values(len: usize, seed: u64) -> Vec<f32> {
        let mut values: Vec<f32> = (0..len)
            .map(|k| (k as f32 - len as f32 / 2.0) / 64.0)
            .collect();
        let mut rng = XorShift::new(seed);
        for i in (1..len).rev() {
            let j = (rng.next_u64() % (i as u64 + 1)) as usize;
            values.swap(i, j);
        }
        values
    }

    fn close(a: &[f32], b: &[f32], tolerance: f32) -> bool {
        a.len() == b.len()
            && a.iter()
                .zip(b)
                .all(|(x, y)| (x - y).abs() <= tolerance * (1.0 + x.abs().max(y.abs())))
    }

    #[test]
    fn tensor_shape_offsets_and_descriptions() {
        let s = TensorShape::new([2, 3, 4, 5], DType::Fp16, Layout::Nhwc);
        assert_eq!(s.elements(), 120);
        assert_eq!(s.describe(), "2x3x4x5 fp16 nhwc");
        // NHWC: channels innermost.
        assert_eq!(s.offset([0, 1, 0, 0]), 1);
        assert_eq!(s.offset([0, 0, 0, 1]), 3);
        assert_eq!(s.offset([1, 2, 3, 4]), 119);
        let nchw = s.with_layout(Layout::Nchw);
        assert_eq!(nchw.offset([0, 0, 0, 1]), 1);
        assert_eq!(nchw.offset([0, 1, 0, 0]), 20);
        let mut seen: Vec<usize> = s.indices().map(|i| s.offset(i)).collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..120).collect::<Vec<_>>());
        assert_eq!(TensorShape::vector(7, DType::Fp32).elements(), 7);
    }

    #[test]
    fn relu_reference() {
        assert_eq!(relu_forward_host(&[-1.0, 0.0, 2.5]), vec![0.0, 0.0, 2.5]);
        assert_eq!(
            relu_backward_host(&[-1.0, 0.0, 2.5], &[3.0, 4.0, 5.0]),
            vec![0.0, 0.0, 5.0]
        );
    }

    #[test]
    fn pool_reference_by_hand() {
        assert_eq!(
            pool_output_dims([1, 1, 5, 4], [2, 2], [2, 2]),
            Some([1, 1, 2, 2])
        );
        assert_eq!(
            pool_output_dims([1, 1, 7, 7], [3, 3], [2, 2]),
            Some([1, 1, 3, 3])
        );
        assert_eq!(pool_output_dims([1, 1, 1, 4], [2, 2], [2, 2]), None);
        assert_eq!(pool_output_dims([1, 1, 4, 4], [0, 2], [2, 2]), None);
        let input = shape([1, 1, 4, 4], Layout::Nchw);
        #[rustfmt::skip]
        let x = [
            1.0, 2.0,   5.0, 0.0,
            3.0, 4.0,  -1.0, 6.0,
            0.0, 9.0,   2.0, 2.5,
            8.0, 7.0,   3.0, 1.0,
        ];
        let y = max_pool_forward_host(input, [2, 2], [2, 2], &x);
        assert_eq!(y, vec![4.0, 6.0, 9.0, 3.0]);
        let dx = max_pool_backward_host(input, [2, 2], [2, 2], &x, &[10.0, 20.0, 30.0, 40.0]);
        #[rustfmt::skip]
        let expected = vec![
            0.0, 0.0,   0.0, 0.0,
            0.0, 10.0,  0.0, 20.0,
            0.0, 30.0,  0.0, 0.0,
            0.0, 0.0,  40.0, 0.0,
        ];
        assert_eq!(dx, expected);
    }

    #[test]
    fn pool_reference_agrees_across_layouts_and_overlaps_accumulate() {
        let nchw = shape([2, 3, 7, 6], Layout::Nchw);
        let nhwc = nchw.with_layout(Layout::Nhwc);
        let x = distinct_values(nchw.elements(), 1);
        let x_nhwc = transform_host(nchw, nhwc, &x);
        for (window, stride) in [([2, 2], [2, 2]), ([3, 3], [2, 2]), ([2, 3], [1, 2])] {
            let out = TensorShape {
                dims: pool_output_dims(nchw.dims, window, stride).unwrap(),
                ..nchw
            };
            let y = max_pool_forward_host(nchw, window, stride, &x);
            let y_nhwc = max_pool_forward_host(nhwc, window, stride, &x_nhwc);
            assert_eq!(
                transform_host(out, out.with_layout(Layout::Nhwc), &y),
                y_nhwc
            );
            // Backward is the adjoint of "pick the maximum": sum(dy * y) = sum(dx * x).
            let dy = distinct_values(out.elements(), 2);
            let dx = max_pool_backward_host(nchw, window, stride, &x, &dy);
            let lhs: f64 = dy.iter().zip(&y).map(|(&a, &b)| a as f64 * b as f64).sum();
            let rhs: f64 = dx.iter().zip(&x).map(|(&a, &b)| a as f64 * b as f64).sum();
            assert!(
                (lhs - rhs).abs() < 1e-6 * (1.0 + lhs.abs()),
                "{lhs} vs {rhs}"
            );
            let total_dy: f64 = dy.iter().map(|&v| v as f64).sum();
            let total_dx: f64 = dx.iter().map(|&v| v as f64).sum();
            assert!(
                (total_dy - total_dx).abs() < 1e-6,
                "{total_dy} vs {total_dx}"
            );
        }
    }

    #[test]
    fn softmax_reference() {
        let logits = [1.0, 2.0, 3.0, 1000.0, 1000.0, 1000.0];
        let p = softmax_host(SoftmaxKind::Probabilities, 3, &logits);
        assert!((p[0..3].iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(close(&p[3..], &[1.0 / 3.0; 3], 1e-6));
        assert!(p[2] > p[1] && p[1] > p[0]);
        let log_p = softmax_host(SoftmaxKind::LogProbabilities, 3, &logits);
        for (l, p) in log_p.iter().zip(&p) {
            assert!((l.exp() - p).abs() < 1e-6);
        }
        // Shift invariance.
        let shifted: Vec<f32> = logits.iter().map(|v| v - 7.0).collect();
        assert!(close(
            &softmax_host(SoftmaxKind::Probabilities, 3, &shifted),
            &p,
            1e-6
        ));
    }

    #[test]
    fn cross_entropy_gradient_matches_finite_differences() {
        let (batch, classes) = (3, 5);
        let logits: Vec<f32> = distinct_values(batch * classes, 3)
            .iter()
            .map(|v| v * 8.0)
            .collect();
        let labels = [4, 0, 2];
        for kind in [SoftmaxKind::Probabilities, SoftmaxKind::LogProbabilities] {
            let loss_of = |l: &[f32]| {
                cross_entropy_host(kind, classes, &softmax_host(kind, classes, l), &labels)
                    .unwrap()
                    .loss as f64
            };
            let ce = cross_entropy_host(
                kind,
                classes,
                &softmax_host(kind, classes, &logits),
                &labels,
            )
            .unwrap();
            assert!(ce.correct <= batch);
            for i in 0..logits.len() {
                let h = 1e-2f32;
                let (mut up, mut down) = (logits.clone(), logits.clone());
                up[i] += h;
                down[i] -= h;
                let numeric = (loss_of(&up) - loss_of(&down)) / (2.0 * h as f64);
                assert!(
                    (numeric - ce.grad_logits[i] as f64).abs() < 2e-3,
                    "{kind:?} logit {i}: numeric {numeric}, analytic {}",
                    ce.grad_logits[i]
                );
            }
        }
        // Uniform logits: loss ln(classes), nothing correct beyond ties resolved to the last.
        let uniform = softmax_host(SoftmaxKind::Probabilities, 4, &[0.0; 8]);
        let ce = cross_entropy_host(SoftmaxKind::Probabilities, 4, &uniform, &[0, 1]).unwrap();
        assert!((ce.loss - 4f32.ln()).abs() < 1e-6);
        // A perfect prediction is counted correct.
        let sure = cross_entropy_host(SoftmaxKind::Probabilities, 2, &[0.0, 1.0], &[1]).unwrap();
        assert_eq!((sure.loss, sure.correct), (0.0, 1));
    }

    #[test]
    fn cross_entropy_rejects_bad_inputs() {
        let p = [0.5, 0.5];
        let e = cross_entropy_host(SoftmaxKind::Probabilities, 2, &p, &[2]).unwrap_err();
        assert!(
            e.to_string()
                .contains("label 2 of row 0 is not one of 2 classes"),
            "{e}"
        );
        assert!(cross_entropy_host(SoftmaxKind::Probabilities, 2, &p, &[0, 1]).is_err());
        assert!(cross_entropy_host(SoftmaxKind::Probabilities, 0, &[], &[]).is_err());
        // A probability of exactly 0 gives a large but finite loss.
        let zero = cross_entropy_host(SoftmaxKind::Probabilities, 2, &[1.0, 0.0], &[1]).unwrap();
        assert!(zero.loss.is_finite() && zero.loss > 80.0);
    }

    #[test]
    fn bias_reference() {
        for layout in [Layout::Nchw, Layout::Nhwc] {
            let out = shape([2, 3, 2, 2], layout);
            let mut y = vec![0.0; out.elements()];
            bias_add_host(out, &mut y, &[1.0, 2.0, 3.0]);
            for index in out.indices() {
                assert_eq!(y[out.offset(index)], [1.0, 2.0, 3.0][index[1]]);
            }
            // Every channel has n * h * w = 8 elements.
            assert_eq!(bias_grad_host(out, &y), vec![8.0, 16.0, 24.0]);
        }
    }

    #[test]
    fn linear_reference_by_hand_and_by_finite_differences() {
        // x = [[1, 2]], W = [[1, 0], [0, 1], [1, 1]], b = [0.5, 0, -1]
        let y = linear_forward_host(
            [1, 2, 3],
            &[1.0, 2.0],
            &[1.0, 0.0, 0.0, 1.0, 1.0, 1.0],
            &[0.5, 0.0, -1.0],
        );
        assert_eq!(y, vec![1.5, 2.0, 2.0]);
        let dims @ [b, i, o] = [3, 4, 2];
        let x = distinct_values(b * i, 5);
        let w = distinct_values(o * i, 6);
        let bias = distinct_values(o, 7);
        let dy = distinct_values(b * o, 8);
        let grads = linear_backward_host(dims, &x, &w, &dy);
        // L = sum(dy * y) is linear in each argument: its derivative is the gradient.
        let objective = |x: &[f32], w: &[f32], bias: &[f32]| -> f64 {
            linear_forward_host(dims, x, w, bias)
                .iter()
                .zip(&dy)
                .map(|(&y, &g)| y as f64 * g as f64)
                .sum()
        };
        // Central differences of the objective in one argument (0: x, 1: W, 2: bias).
        let h = 0.25f32;
        let check = |argument: usize, grad: &[f32], name: &str| {
            for k in 0..grad.len() {
                let at = |e: f32| {
                    let mut args = [x.clone(), w.clone(), bias.clone()];
                    args[argument][k] += e;
                    objective(&args[0], &args[1], &args[2])
                };
                let d = (at(h) - at(-h)) / (2.0 * h as f64);
                assert!((d - grad[k] as f64).abs() < 1e-4, "{name}[{k}]");
            }
        };
        check(0, &grads.dx, "dx");
        check(1, &grads.dweight, "dW");
        check(2, &grads.dbias, "db");
    }

    /// cuBLAS's `sgemm` as the BLAS standard defines it (column-major, leading dimensions).
    fn sgemm_host(g: Gemm, a: &[f32], b: &[f32], beta: f32, c: &mut [f32]) {
        for j in 0..g.n {
            for i in 0..g.m {
                let mut acc = 0.0f64;
                for l in 0..g.k {
                    let av = if g.transpose_a {
                        a[l + i * g.lda]
                    } else {
                        a[i + l * g.lda]
                    };
                    let bv = if g.transpose_b {
                        b[j + l * g.ldb]
                    } else {
                        b[l + j * g.ldb]
                    };
                    acc += av as f64 * bv as f64;
                }
                let at = i + j * g.ldc;
                c[at] = (acc + beta as f64 * c[at] as f64) as f32;
            }
        }
    }

    #[test]
    fn linear_gemms_compute_the_row_major_layer() {
        let dims @ [b, i, o] = [3, 5, 4];
        let x = distinct_values(b * i, 11);
        let w = distinct_values(o * i, 12);
        let bias = distinct_values(o, 13);
        let dy = distinct_values(b * o, 14);
        let [forward, data, weights] = linear_gemms(b, i, o);
        // Exact buffers are exactly the spans the wall checks.
        for (g, [a_len, b_len, c_len]) in [
            (forward, [o * i, b * i, b * o]),
            (data, [o * i, b * o, b * i]),
            (weights, [b * i, b * o, o * i]),
        ] {
            let (ar, ac) = if g.transpose_a {
                (g.k, g.m)
            } else {
                (g.m, g.k)
            };
            let (br, bc) = if g.transpose_b {
                (g.n, g.k)
            } else {
                (g.k, g.n)
            };
            assert_eq!(matrix_span("t", "A", ar, ac, g.lda).unwrap(), a_len);
            assert_eq!(matrix_span("t", "B", br, bc, g.ldb).unwrap(), b_len);
            assert_eq!(matrix_span("t", "C", g.m, g.n, g.ldc).unwrap(), c_len);
        }
        let mut y = vec![0.0; b * o];
        sgemm_host(forward, &w, &x, 0.0, &mut y);
        let tensor = shape([b, o, 1, 1], Layout::Nchw);
        bias_add_host(tensor, &mut y, &bias);
        assert!(close(&y, &linear_forward_host(dims, &x, &w, &bias), 1e-6));
        let want = linear_backward_host(dims, &x, &w, &dy);
        let mut dx = vec![0.0; b * i];
        sgemm_host(data, &w, &dy, 0.0, &mut dx);
        assert!(close(&dx, &want.dx, 1e-6));
        let mut dw = vec![1.0; o * i];
        sgemm_host(weights, &x, &dy, 0.0, &mut dw);
        assert!(close(&dw, &want.dweight, 1e-6));
        sgemm_host(weights, &x, &dy, 1.0, &mut dw);
        let doubled: Vec<f32> = want.dweight.iter().map(|v| 2.0 * v).collect();
        assert!(close(&dw, &doubled, 1e-6));
        assert!(close(&bias_grad_host(tensor, &dy), &want.dbias, 1e-6));
    }

    #[test]
    fn transform_reference() {
        let nchw = shape([2, 3, 2, 5], Layout::Nchw);
        let nhwc = nchw.with_layout(Layout::Nhwc).with_dtype(DType::Fp16);
        let x: Vec<f32> = (0..nchw.elements()).map(|v| v as f32 / 3.0).collect();
        let y = transform_host(nchw, nhwc, &x);
        for index in nchw.indices() {
            assert_eq!(
                y[nhwc.offset(index)],
                quantize(DType::Fp16, x[nchw.offset(index)])
            );
        }
        let back = transform_host(nhwc, nchw, &y);
        assert!(close(&back, &x, 1e-3));
        assert_ne!(back, x, "fp16 rounding must show");
    }

    #[test]
    fn sgd_reference_follows_pytorch() {
        // torch.optim.SGD([w], lr=0.1, momentum=0.9, weight_decay=0.01), w = 1, grads 0.5, 0.25:
        // step 1: buf = 0.5 + 0.01 = 0.51; w = 1 - 0.051 = 0.949
        // step 2: d = 0.25 + 0.00949 = 0.25949; buf = 0.9 * 0.51 + d = 0.71849; w = 0.877151
        let config = SgdConfig {
            learning_rate: 0.1,
            momentum: 0.9,
            weight_decay: 0.01,
        };
        let (mut w, mut v) = (vec![1.0f32], vec![0.0f32]);
        sgd_step_host(config, &mut w, &[0.5], &mut v);
        assert!((w[0] - 0.949).abs() < 1e-6 && (v[0] - 0.51).abs() < 1e-6);
        sgd_step_host(config, &mut w, &[0.25], &mut v);
        assert!((v[0] - 0.71849).abs() < 1e-6, "{}", v[0]);
        assert!((w[0] - 0.877151).abs() < 1e-6, "{}", w[0]);
        // No momentum, no decay: plain gradient descent.
        let plain = SgdConfig {
            learning_rate: 0.5,
            momentum: 0.0,
            weight_decay: 0.0,
        };
        let (mut w, mut v) = (vec![2.0f32, -1.0], vec![0.0; 2]);
        sgd_step_host(plain, &mut w, &[1.0, -2.0], &mut v);
        assert_eq!(w, vec![1.5, 0.0]);
    }

    #[test]
    fn sgd_config_is_validated() {
        let good = SgdConfig {
            learning_rate: 0.01,
            momentum: 0.9,
            weight_decay: 5e-4,
        };
        assert!(Sgd::new(good).is_ok());
        for bad in [
            SgdConfig {
                learning_rate: -0.1,
                ..good
            },
            SgdConfig {
                momentum: f32::NAN,
                ..good
            },
            SgdConfig {
                weight_decay: f32::INFINITY,
                ..good
            },
        ] {
            let e = Sgd::new(bad).unwrap_err();
            assert!(
                e.to_string().contains("must be finite and at least 0"),
                "{e}"
            );
        }
    }

    #[test]
    fn shapes_are_checked_before_any_library_is_needed() {
        let e = Relu::new(shape([0, 3, 4, 4], Layout::Nchw)).err().unwrap();
        assert!(matches!(e, GpuTrainError::InvalidArgument { .. }), "{e:?}");
        let e = MaxPool2d::two_by_two(shape([1, 3, 1, 4], Layout::Nchw))
            .err()
            .unwrap();
        assert!(
            e.to_string()
                .contains("does not fit input 1x3x1x4 fp32 nchw"),
            "{e}"
        );
        let e = Linear::new(4, 0, 10).err().unwrap();
        assert!(matches!(e, GpuTrainError::InvalidArgument { .. }), "{e:?}");
        let e = Linear::new(1 << 20, 1 << 12, 10).err().unwrap();
        assert!(e.to_string().contains("2^31-1"), "{e}");
        let e = Transform::new(
            shape([1, 2, 3, 4], Layout::Nchw),
            shape([1, 2, 4, 3], Layout::Nhwc),
        )
        .err()
        .unwrap();
        assert!(e.to_string().contains("dims differ"), "{e}");
        let e = Softmax::new(4, 1 << 31, DType::Fp32, SoftmaxKind::Probabilities)
            .err()
            .unwrap();
        assert!(matches!(e, GpuTrainError::InvalidArgument { .. }), "{e:?}");
    }

    #[test]
    fn without_a_gpu_the_constructors_are_errors_not_panics() {
        let libs = crate::backend::cudnn::library_status();
        if libs.libcuda && libs.libcudnn {
            println!("libraries present: constructors not expected to fail");
            return;
        }
        let e = GpuOps::new(0).unwrap_err();
        assert!(e.is_unavailable(), "{e:?}");
        let valid = shape([2, 3, 4, 4], Layout::Nchw);
        if !libs.libcudnn {
            for e in [
                Relu::new(valid).err(),
                MaxPool2d::two_by_two(valid).err(),
                Bias::new(valid).err(),
                Linear::new(2, 3, 4).err(),
                Softmax::new(2, 3, DType::Fp32, SoftmaxKind::Probabilities).err(),
                Transform::new(valid, valid.with_dtype(DType::Fp16)).err(),
            ] {
                let e = e.expect("an error without libcudnn");
                assert!(e.is_unavailable(), "{e:?}");
                assert!(e.to_string().contains("libcudnn"), "{e}");
            }
        }
    }
}
