//! The FFI wall: the only module of the backend that names cudarc's raw layers
//! (`cudarc::cudnn::{sys, result}`, `cudarc::driver::{sys, result}`) and the only one with
//! `unsafe` code. Everything it exports is a safe function or a type with safe methods, except
//! the C ABI's view of a caller's objects ([`foreign`]), whose constructors are `unsafe fn`s
//! with a `# Safety` contract (a C caller's pointers can be checked only so far).
//!
//! # How the wall keeps the unsafe calls sound
//!
//! - **Libraries.** cudarc loads `libcuda` and `libcudnn` on first use and *panics* when one is
//!   missing (and when a symbol is missing). Every entry point first passes a gate
//!   (`driver()`, `cudnn()`), which checks presence with cudarc's `is_culib_present`, checks
//!   the versions (driver API >= 13.0, cuDNN 9.x), checks that every cuDNN symbol this module
//!   calls exists, and turns each failure into [`CudnnError::Unavailable`] or
//!   [`CudnnError::NoDevice`]. A value of any type below exists only if its gate passed.
//! - **Handles and descriptors** are RAII types: created and configured in one constructor,
//!   destroyed exactly once in `Drop`, which never panics (a failed destroy is written to
//!   stderr and otherwise ignored). They hold raw pointers, so they are neither `Send` nor
//!   `Sync`, matching cuDNN's rule that a handle is used by one thread at a time.
//! - **Device pointers** never cross the wall as integers. A [`DeviceView`] /
//!   [`DeviceViewMut`] / [`WorkspaceView`] ([`view`]) is made safely only from a buffer
//!   allocated through a [`CudnnHandle`] plus an element range that is bounds-checked against
//!   it, and it borrows the buffer, so the memory outlives the view; a caller's raw pointer or
//!   a framework's cudarc buffer becomes one only through an `unsafe` constructor. Every call
//!   ([`Surface::convolve`], [`EnginePlan::execute`], [`ForeignSession::convolve`]) goes through
//!   one path that checks that every view has the dtype and exact element count its descriptor
//!   describes, was taken on the stream the work goes to (where that is known), and that the
//!   workspace is at least what cuDNN asks for the algorithm.
//!   Kernels run asynchronously on that stream; buffers are freed stream-ordered by cudarc
//!   (after a stream wait on their events, with `cuMemFreeAsync` on the same stream, or after a
//!   stream synchronize), so memory is never released under a running kernel.
//! - **The graph API** ([`graph`]: engine configurations and execution plans) follows the same
//!   rules with its own gate for the six `cudnnBackend*` symbols, RAII backend descriptors
//!   dropped referrers-first, typed attribute setters, and `EnginePlan::execute` checks that add
//!   pointer alignment; its module docs say how.
//! - **Status values.** cuDNN statuses arrive as cudarc's `cudnnStatus_t` enum (generated for
//!   cuDNN 9.21, a superset of earlier 9.x codes); the results of `cudnnFind*AlgorithmEx` are
//!   read field by field as `u32`, so an unknown enum value there cannot be undefined behaviour.

use super::error::CudnnError;
use super::host;
use super::shape::{operand_roles, ConvShapes, Nd, Operand};
use crate::solver::{ConvOp, ConvProblem, DType, Layout, MathMode};
use cudarc::cudnn::{result as dnn, sys as dnn_sys};
use cudarc::driver::{
    result as drv, sys as drv_sys, CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr,
    DevicePtrMut, DriverError, SyncOnDrop,
};
use serde::{Deserialize, Serialize};
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::io::Write;
use std::mem::MaybeUninit;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

mod compare;
mod context;
mod descriptors;
mod foreign;
mod gates;
mod graph;
mod memory;
mod stream;
mod view;

pub use compare::{compare_api, ComparisonDescriptors, ComparisonInfo, OutputComparison};
pub use context::{
    save_current_context, CurrentContextGuard, DropInCallerContext, RestoreAfterFields,
};
pub use descriptors::{ConvDescriptors, ConvolutionDescriptor, FilterDescriptor, TensorDescriptor};
pub use foreign::{
    check_one_libcudnn, read_convolution_descriptor, read_filter_descriptor,
    read_tensor_descriptor, ConvolutionDescriptorInfo, DataTypeCode, FilterDescriptorInfo,
    ForeignHandle, ForeignSession, ForeignWorkspace, TensorDescriptorInfo,
};
use gates::*;
pub(crate) use gates::{cudnn, driver};
pub use gates::{cudnn_version, library_status, probe, DeviceInfo, LibraryStatus, SystemInfo};
pub use graph::{
    broken_graph_on_device, engine_configs, engine_configs_for_chunk,
    engine_configs_for_chunk_on_device, engine_configs_on_device, engine_configs_with_alignments,
    graph_api_status, heuristic_plan_workspaces, heuristic_plan_workspaces_on_device,
    plan_for_chunk_on_device, plan_on_device, time_variant_packs, BrokenGraph, DeviceDescription,
    DevicePlan, EnginePlan, DEVICE_DESCRIPTION_MIN_VERSION,
};
use memory::buffer_bytes;
pub use memory::{DeviceBuffer, GpuTimer, Workspace};
pub use stream::{stream_is_capturing, StreamFence, StreamKey, StreamSession};
pub use view::{
    ConvOperands, DeviceOperands, DeviceView, DeviceViewMut, Origin, Raw, RawDeviceView,
    RawDeviceViewMut, RawWorkspace, Tracked, WorkspaceView,
};

/// The oldest driver API this build may call: cudarc is compiled with `cuda-13000`, whose
/// bindings use CUDA 13.0 entry points (`cuEventElapsedTime_v2`, ...). Driver 580 reports 13000.
pub const MIN_DRIVER_VERSION: i32 = 13000;

/// The cuDNN major version this build's bindings describe (cudarc feature `cudnn` = 9.21
/// headers; the legacy convolution API is ABI-stable across 9.x).
pub const CUDNN_MAJOR: u64 = 9;

/// Every cuDNN symbol this module calls: checked up front so that cudarc's lazy loader never
/// panics on a missing one.
const CUDNN_SYMBOLS: &[&str] = &[
    "cudnnGetVersion",
    "cudnnGetCudartVersion",
    "cudnnCreate",
    "cudnnDestroy",
    "cudnnSetStream",
    "cudnnCreateTensorDescriptor",
    "cudnnSetTensor4dDescriptor",
    "cudnnSetTensorNdDescriptorEx",
    "cudnnSetTensorNdDescriptor",
    "cudnnSetTensor",
    "cudnnScaleTensor",
    "cudnnDestroyTensorDescriptor",
    "cudnnCreateFilterDescriptor",
    "cudnnSetFilter4dDescriptor",
    "cudnnSetFilterNdDescriptor",
    "cudnnDestroyFilterDescriptor",
    "cudnnCreateConvolutionDescriptor",
    "cudnnSetConvolution2dDescriptor",
    "cudnnSetConvolutionNdDescriptor",
    "cudnnSetConvolutionGroupCount",
    "cudnnSetConvolutionMathType",
    "cudnnDestroyConvolutionDescriptor",
    "cudnnGetConvolution2dForwardOutputDim",
    "cudnnGetConvolutionNdForwardOutputDim",
    "cudnnGetConvolutionForwardWorkspaceSize",
    "cudnnGetConvolutionBackwardDataWorkspaceSize",
    "cudnnGetConvolutionBackwardFilterWorkspaceSize",
    "cudnnConvolutionForward",
    "cudnnConvolutionBackwardData",
    "cudnnConvolutionBackwardFilter",
    "cudnnFindConvolutionForwardAlgorithmEx",
    "cudnnFindConvolutionBackwardDataAlgorithmEx",
    "cudnnFindConvolutionBackwardFilterAlgorithmEx",
    // Reading a C caller's handle and descriptors (`foreign`).
    "cudnnGetStream",
    "cudnnGetTensorNdDescriptor",
    "cudnnGetFilterNdDescriptor",
    "cudnnGetConvolutionNdDescriptor",
    "cudnnGetConvolutionGroupCount",
    "cudnnGetConvolutionMathType",
    // The sub-library checks of the gate.
    "cudnnOpsVersionCheck",
    "cudnnCnnVersionCheck",
    "cudnnGraphVersionCheck",
];

// ---------------------------------------------------------------------------------------------
// Errors

pub(crate) fn status_error(call: &'static str, status: dnn_sys::cudnnStatus_t) -> CudnnError {
    CudnnError::Cudnn {
        call,
        status: format!("{status:?}"),
        code: status as u32,
        op: None,
        algo: None,
    }
}

fn dnn_err(call: &'static str) -> impl FnOnce(dnn::CudnnError) -> CudnnError {
    move |e| status_error(call, e.0)
}

/// The `CUresult` name and description of `e`. cudarc's `error_name`/`error_string` panic
/// when the loaded libcuda lacks `cuGetErrorName`/`cuGetErrorString` (a partial or stub
/// driver), so the symbols are looked up first; without them the name is
/// the enum's and the description says so.
fn describe_driver_error(e: &DriverError) -> (String, String) {
    let (has_name, has_string) = driver_error_symbols();
    let name = if has_name {
        e.error_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|_| format!("{:?}", e.0))
    } else {
        format!("{:?}", e.0)
    };
    let message = if has_string {
        e.error_string()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|_| "no description".to_string())
    } else {
        "no description (the loaded libcuda does not export cuGetErrorString)".to_string()
    };
    (name, message)
}

/// Whether the loaded libcuda exports `cuGetErrorName` and `cuGetErrorString` (cached).
fn driver_error_symbols() -> (bool, bool) {
    static FOUND: OnceLock<(bool, bool)> = OnceLock::new();
    *FOUND.get_or_init(|| {
        if !libcuda_present() {
            return (false, false);
        }
        // Linked mode: the program would not have started without both.
        #[cfg(feature = "cudarc-linked")]
        return (true, true);
        // SAFETY: libcuda is present, so `culib` loads it rather than panicking; looking a
        // symbol up does not call it (the type parameter is only what it would be read as).
        #[cfg(not(feature = "cudarc-linked"))]
        {
            let lib = unsafe { drv_sys::culib() };
            let has = |name: &[u8]| unsafe { lib.get::<unsafe extern "C" fn()>(name) }.is_ok();
            (has(b"cuGetErrorName"), has(b"cuGetErrorString"))
        }
    })
}

pub(crate) fn driver_error(call: &'static str, e: DriverError) -> CudnnError {
    let (name, message) = describe_driver_error(&e);
    CudnnError::Driver {
        call,
        name,
        code: e.0 as u32,
        message,
    }
}

fn drv_err(call: &'static str) -> impl FnOnce(DriverError) -> CudnnError {
    move |e| driver_error(call, e)
}

fn invalid(call: &'static str, detail: String) -> CudnnError {
    CudnnError::InvalidArgument { call, detail }
}

/// Reports a failed destroy from a `Drop` impl without panicking (not even on a closed stderr).
pub(crate) fn warn_drop(call: &str, status: dnn_sys::cudnnStatus_t) {
    let _ = writeln!(
        std::io::stderr(),
        "mucudnn: warning: {call} failed while dropping: {status:?} ({})",
        status as u32
    );
}

// ---------------------------------------------------------------------------------------------
// Enum mappings

fn data_type(dtype: DType) -> dnn_sys::cudnnDataType_t {
    match dtype {
        DType::Fp32 => dnn_sys::cudnnDataType_t::CUDNN_DATA_FLOAT,
        DType::Fp16 => dnn_sys::cudnnDataType_t::CUDNN_DATA_HALF,
        DType::Bf16 => dnn_sys::cudnnDataType_t::CUDNN_DATA_BFLOAT16,
    }
}

/// Compute (accumulation) type: fp32 for all three data types, as PyTorch does; cuDNN calls
/// fp16/bf16 data with fp32 compute PSEUDO_HALF_CONFIG / PSEUDO_BFLOAT16_CONFIG.
fn compute_type(_dtype: DType) -> dnn_sys::cudnnDataType_t {
    dnn_sys::cudnnDataType_t::CUDNN_DATA_FLOAT
}

fn tensor_format(layout: Layout) -> dnn_sys::cudnnTensorFormat_t {
    match layout {
        Layout::Nchw => dnn_sys::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW,
        Layout::Nhwc => dnn_sys::cudnnTensorFormat_t::CUDNN_TENSOR_NHWC,
    }
}

fn math_type(math: MathMode) -> dnn_sys::cudnnMathType_t {
    match math {
        MathMode::Default => dnn_sys::cudnnMathType_t::CUDNN_DEFAULT_MATH,
        MathMode::TensorOp => dnn_sys::cudnnMathType_t::CUDNN_TENSOR_OP_MATH,
        MathMode::TensorOpAllowConversion => {
            dnn_sys::cudnnMathType_t::CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION
        }
        MathMode::Fma => dnn_sys::cudnnMathType_t::CUDNN_FMA_MATH,
    }
}

fn math_mode_from_raw(raw: u32) -> Option<MathMode> {
    use dnn_sys::cudnnMathType_t as M;
    [
        (M::CUDNN_DEFAULT_MATH, MathMode::Default),
        (M::CUDNN_TENSOR_OP_MATH, MathMode::TensorOp),
        (
            M::CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION,
            MathMode::TensorOpAllowConversion,
        ),
        (M::CUDNN_FMA_MATH, MathMode::Fma),
    ]
    .into_iter()
    .find(|&(m, _)| m as u32 == raw)
    .map(|(_, mode)| mode)
}

use dnn_sys::cudnnConvolutionBwdDataAlgo_t as BwdDataAlgo;
use dnn_sys::cudnnConvolutionBwdFilterAlgo_t as BwdFilterAlgo;
use dnn_sys::cudnnConvolutionFwdAlgo_t as FwdAlgo;

/// The legacy forward algorithms, indexed by their number.
const FWD_ALGOS: [FwdAlgo; FwdAlgo::CUDNN_CONVOLUTION_FWD_ALGO_COUNT as usize] = [
    FwdAlgo::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM,
    FwdAlgo::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM,
    FwdAlgo::CUDNN_CONVOLUTION_FWD_ALGO_GEMM,
    FwdAlgo::CUDNN_CONVOLUTION_FWD_ALGO_DIRECT,
    FwdAlgo::CUDNN_CONVOLUTION_FWD_ALGO_FFT,
    FwdAlgo::CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING,
    FwdAlgo::CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD,
    FwdAlgo::CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED,
];

/// The legacy backward-data algorithms, indexed by their number.
const BWD_DATA_ALGOS: [BwdDataAlgo; BwdDataAlgo::CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT as usize] = [
    BwdDataAlgo::CUDNN_CONVOLUTION_BWD_DATA_ALGO_0,
    BwdDataAlgo::CUDNN_CONVOLUTION_BWD_DATA_ALGO_1,
    BwdDataAlgo::CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT,
    BwdDataAlgo::CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT_TILING,
    BwdDataAlgo::CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD,
    BwdDataAlgo::CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED,
];

/// The legacy backward-filter algorithms, indexed by their number.
const BWD_FILTER_ALGOS: [BwdFilterAlgo;
    BwdFilterAlgo::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT as usize] = [
    BwdFilterAlgo::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0,
    BwdFilterAlgo::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1,
    BwdFilterAlgo::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT,
    BwdFilterAlgo::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3,
    BwdFilterAlgo::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD,
    BwdFilterAlgo::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED,
    BwdFilterAlgo::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING,
];

/// Number of legacy algorithms of `op` (`CUDNN_CONVOLUTION_*_ALGO_COUNT`: 8, 6, 7); the
/// algorithms are numbered `0..algo_count(op)`.
pub fn algo_count(op: ConvOp) -> u32 {
    match op {
        ConvOp::Forward => FwdAlgo::CUDNN_CONVOLUTION_FWD_ALGO_COUNT as u32,
        ConvOp::BackwardData => BwdDataAlgo::CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT as u32,
        ConvOp::BackwardFilter => BwdFilterAlgo::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT as u32,
    }
}

/// cuDNN's name of algorithm `algo` of `op` without the `CUDNN_CONVOLUTION_` prefix, e.g.
/// `FWD_ALGO_IMPLICIT_PRECOMP_GEMM`, `BWD_DATA_ALGO_1`; `None` when out of range.
pub fn algo_name(op: ConvOp, algo: u32) -> Option<String> {
    let name = match Algo::new(op, algo)? {
        Algo::Fwd(a) => format!("{a:?}"),
        Algo::BwdData(a) => format!("{a:?}"),
        Algo::BwdFilter(a) => format!("{a:?}"),
    };
    Some(
        name.strip_prefix("CUDNN_CONVOLUTION_")
            .map(str::to_string)
            .unwrap_or(name),
    )
}

#[derive(Clone, Copy, Debug)]
enum Algo {
    Fwd(FwdAlgo),
    BwdData(BwdDataAlgo),
    BwdFilter(BwdFilterAlgo),
}

impl Algo {
    fn new(op: ConvOp, algo: u32) -> Option<Algo> {
        let i = algo as usize;
        match op {
            ConvOp::Forward => FWD_ALGOS.get(i).copied().map(Algo::Fwd),
            ConvOp::BackwardData => BWD_DATA_ALGOS.get(i).copied().map(Algo::BwdData),
            ConvOp::BackwardFilter => BWD_FILTER_ALGOS.get(i).copied().map(Algo::BwdFilter),
        }
    }

    /// The op and algorithm number, for errors.
    fn op_number(self) -> (ConvOp, u32) {
        match self {
            Algo::Fwd(a) => (ConvOp::Forward, a as u32),
            Algo::BwdData(a) => (ConvOp::BackwardData, a as u32),
            Algo::BwdFilter(a) => (ConvOp::BackwardFilter, a as u32),
        }
    }

    fn checked(call: &'static str, op: ConvOp, algo: u32) -> Result<Algo, CudnnError> {
        Algo::new(op, algo).ok_or_else(|| {
            invalid(
                call,
                format!(
                    "{op} has legacy algorithms 0..{}, not {algo}",
                    algo_count(op)
                ),
            )
        })
    }
}

fn workspace_call(op: ConvOp) -> &'static str {
    match op {
        ConvOp::Forward => "cudnnGetConvolutionForwardWorkspaceSize",
        ConvOp::BackwardData => "cudnnGetConvolutionBackwardDataWorkspaceSize",
        ConvOp::BackwardFilter => "cudnnGetConvolutionBackwardFilterWorkspaceSize",
    }
}

fn execute_call(op: ConvOp) -> &'static str {
    match op {
        ConvOp::Forward => "cudnnConvolutionForward",
        ConvOp::BackwardData => "cudnnConvolutionBackwardData",
        ConvOp::BackwardFilter => "cudnnConvolutionBackwardFilter",
    }
}

fn find_call(op: ConvOp) -> &'static str {
    match op {
        ConvOp::Forward => "cudnnFindConvolutionForwardAlgorithmEx",
        ConvOp::BackwardData => "cudnnFindConvolutionBackwardDataAlgorithmEx",
        ConvOp::BackwardFilter => "cudnnFindConvolutionBackwardFilterAlgorithmEx",
    }
}

// ---------------------------------------------------------------------------------------------
// Raw calls, shared by the owned handle ([`CudnnHandle`]) and a caller's ([`ForeignHandle`])

/// Workspace bytes that `which` (algorithm `algo` of `op`) needs for `d`: one
/// `cudnnGetConvolution*WorkspaceSize` call.
///
/// # Safety
///
/// `raw` is a live cuDNN handle created by the libcudnn that cudarc loaded (the `cudnn()` gate
/// has passed), and no other thread uses it during the call.
unsafe fn raw_workspace_size(
    raw: dnn_sys::cudnnHandle_t,
    d: &ConvDescriptors,
    op: ConvOp,
    algo: u32,
    which: Algo,
) -> Result<u64, CudnnError> {
    // SAFETY: `raw` is live and unshared (the caller's contract); the four descriptors are
    // alive (borrowed) for the call, configured, and in the tensor roles each function expects
    // (x, w, conv, y / w, dy, conv, dx / x, dy, conv, dw); cudarc's wrapper passes a pointer to
    // a local for the size.
    let result = unsafe {
        match which {
            Algo::Fwd(a) => dnn::get_convolution_forward_workspace_size(
                raw,
                d.input.raw,
                d.filter.raw,
                d.conv.raw,
                d.output.raw,
                a,
            ),
            Algo::BwdData(a) => dnn::get_convolution_backward_data_workspace_size(
                raw,
                d.filter.raw,
                d.output.raw,
                d.conv.raw,
                d.input.raw,
                a,
            ),
            Algo::BwdFilter(a) => dnn::get_convolution_backward_filter_workspace_size(
                raw,
                d.input.raw,
                d.output.raw,
                d.conv.raw,
                d.filter.raw,
                a,
            ),
        }
    };
    result
        .map(|bytes| bytes as u64)
        .map_err(|e| status_error(workspace_call(op), e.0).for_op_algo(op, Some(algo)))
}

/// Checks that the operands `[a, b, out]` of `op`, given as (name, dtype, element count), have
/// `shapes`' dtype and exactly the `expected` element counts (in `[a, b, out]` order): the
/// descriptors' element counts, or what a spatial chunk's views span.
fn check_operand_spans(
    call: &'static str,
    shapes: &ConvShapes,
    expected: [usize; 3],
    op: ConvOp,
    operands: [(&'static str, DType, usize); 3],
) -> Result<(), CudnnError> {
    for (((name, dtype, len), role), expected) in
        operands.into_iter().zip(operand_roles(op)).zip(expected)
    {
        if dtype != shapes.dtype {
            return Err(invalid(
                call,
                format!(
                    "{op} operand {name} ({role:?}) is {dtype} but the problem is {}",
                    shapes.dtype
                ),
            ));
        }
        if len != expected {
            return Err(invalid(
                call,
                format!(
                    "{op} operand {name} ({role:?}) has {len} elements, the descriptor {expected} \
                     (dims {:?})",
                    shapes.dims(role)
                ),
            ));
        }
    }
    Ok(())
}

/// The device addresses of one convolution call: operands in `[a, b, out]` order (see
/// [`operand_roles`]) and the workspace.
#[derive(Clone, Copy, Debug)]
struct CallPointers {
    a: u64,
    b: u64,
    out: u64,
    /// Null exactly when `workspace_bytes` is 0.
    workspace: *mut c_void,
    workspace_bytes: usize,
}

/// `out = alpha * op(a, b) + beta * out` with `which` (a legacy algorithm of an op): one
/// `cudnnConvolution*` call, queued on the handle's stream.
///
/// # Safety
///
/// - `raw` is as for [`raw_workspace_size`];
/// - `pointers.a` and `pointers.b` point to device memory that the handle's device can read,
///   holding exactly the elements that `d` describes for roles `a` and `b` of the op, in `d`'s
///   dtype; `pointers.out` likewise for `out`, and writable, overlapping neither the inputs nor
///   the workspace;
/// - `pointers.workspace` is null with `workspace_bytes == 0`, or points to `workspace_bytes`
///   writable device bytes, at least what cuDNN requires for `which` on `d`;
/// - all of this memory stays allocated until the work queued on the handle's stream has
///   finished with it.
unsafe fn raw_convolve(
    raw: dnn_sys::cudnnHandle_t,
    d: &ConvDescriptors,
    which: Algo,
    (alpha, beta): (f32, f32),
    pointers: CallPointers,
) -> Result<(), CudnnError> {
    let (op, algo) = which.op_number();
    let alpha_ptr = (&alpha as *const f32).cast::<c_void>();
    let beta_ptr = (&beta as *const f32).cast::<c_void>();
    let (a_ptr, b_ptr) = (pointers.a as *const c_void, pointers.b as *const c_void);
    let out_ptr = pointers.out as *mut c_void;
    let (ws_ptr, workspace_bytes) = (pointers.workspace, pointers.workspace_bytes);
    // SAFETY: the handle, memory and workspace are as the caller's contract says; the
    // descriptors are alive (borrowed) for the call and cuDNN copies what it needs from them
    // before returning; alpha/beta point to host f32 locals, the scaling type for
    // float/half/bf16 data.
    let result = unsafe {
        match which {
            Algo::Fwd(algo_raw) => dnn::convolution_forward(
                raw,
                alpha_ptr,
                d.input.raw,
                a_ptr,
                d.filter.raw,
                b_ptr,
                d.conv.raw,
                algo_raw,
                ws_ptr,
                workspace_bytes,
                beta_ptr,
                d.output.raw,
                out_ptr,
            ),
            Algo::BwdData(algo_raw) => dnn::convolution_backward_data(
                raw,
                alpha_ptr,
                d.filter.raw,
                a_ptr,
                d.output.raw,
                b_ptr,
                d.conv.raw,
                algo_raw,
                ws_ptr,
                workspace_bytes,
                beta_ptr,
                d.input.raw,
                out_ptr,
            ),
            Algo::BwdFilter(algo_raw) => dnn::convolution_backward_filter(
                raw,
                alpha_ptr,
                d.input.raw,
                a_ptr,
                d.output.raw,
                b_ptr,
                d.conv.raw,
                algo_raw,
                ws_ptr,
                workspace_bytes,
                beta_ptr,
                d.filter.raw,
                out_ptr,
            ),
        }
    };
    result.map_err(|e| status_error(execute_call(op), e.0).for_op_algo(op, Some(algo)))
}

/// Checks a strided view (`dims`, `strides`, in elements) of `len` elements of `dtype` for
/// [`raw_fill`]: the view spans exactly what the descriptor reaches. Returns its descriptor.
fn fill_descriptor(
    call: &'static str,
    dtype: DType,
    len: usize,
    dims: &[i64],
    strides: &[i64],
) -> Result<TensorDescriptor, CudnnError> {
    let span = crate::backend::cudnn::graph_params::span_of(dims, strides);
    if len != span {
        return Err(invalid(
            call,
            format!("the view has {len} elements, dims {dims:?} strides {strides:?} span {span}"),
        ));
    }
    TensorDescriptor::strided(dtype, dims, strides)
}

/// `out = value * out` over the strided view `desc` describes (`cudnnScaleTensor`), or
/// `out = 0` when `value` is 0 (`cudnnSetTensor`: what cuDNN's `beta = 0` means, the old
/// values not read, so NaN never survives), queued on the handle's stream.
///
/// # Safety
///
/// `raw` is a live handle used by this thread alone with its device's context current; `out`
/// points to device memory of that device, writable, holding every element `desc` reaches,
/// allocated until the queued work has finished.
unsafe fn raw_fill(
    raw: dnn_sys::cudnnHandle_t,
    desc: &TensorDescriptor,
    out: u64,
    value: f32,
) -> Result<(), CudnnError> {
    let out = out as *mut c_void;
    if value == 0.0 {
        // Zero bits are zero in every data type; 8 bytes cover the largest element.
        let zero = 0u64;
        // SAFETY: this function's contract; `zero` outlives the call, which reads it.
        unsafe { dnn_sys::cudnnSetTensor(raw, desc.raw, out, (&raw const zero).cast()) }
            .result()
            .map_err(|e| status_error("cudnnSetTensor", e.0))
    } else {
        // SAFETY: this function's contract; the scale is a host float (float, half, bfloat16
        // data), read during the call.
        unsafe { dnn_sys::cudnnScaleTensor(raw, desc.raw, out, (&raw const value).cast()) }
            .result()
            .map_err(|e| status_error("cudnnScaleTensor", e.0))
    }
}

// ---------------------------------------------------------------------------------------------
// The one call path

/// A workspace query's answer, with cuDNN's `CUDNN_STATUS_NOT_SUPPORTED*` (the configuration is
/// declined: skip the algorithm) as `None`; other failures stay errors.
pub(crate) fn declined_as_none(answer: Result<u64, CudnnError>) -> Result<Option<u64>, CudnnError> {
    match answer {
        Ok(bytes) => Ok(Some(bytes)),
        Err(e) if e.is_not_supported() => Ok(None),
        Err(e) => Err(e),
    }
}

mod site {
    use super::*;

    /// What the call path needs of a call surface: a cuDNN handle whose stream is the one work
    /// goes to (mucudnn's handle on its own stream, a [`StreamSession`], a
    /// [`ForeignSession`]), and how that surface answers the questions that differ.
    pub trait Site {
        /// The call names in errors.
        const CONVOLVE: &'static str;
        const EXECUTE: &'static str;
        const SCALE: &'static str;

        /// The raw handle, used by this thread alone while `self` is borrowed.
        fn raw(&self) -> dnn_sys::cudnnHandle_t;

        /// Whether work queued here may use memory whose pointer was taken on `stream`.
        fn orders(&self, stream: &CudaStream) -> bool;

        /// Makes the handle usable by this thread for a call (mucudnn's handle binds its
        /// context; a session made its context current when it began).
        fn enter(&self) -> Result<(), CudnnError>;

        /// Workspace bytes legacy algorithm `algo` of `op` needs for `d`; an algorithm cuDNN
        /// declines is an error (as this surface reports it).
        fn required_workspace(
            &self,
            d: &ConvDescriptors,
            op: ConvOp,
            algo: u32,
        ) -> Result<u64, CudnnError>;

        /// Whether `plan` was built on this surface's handle.
        fn built(&self, plan: &EnginePlan) -> bool;
    }
}
pub(crate) use site::Site;

/// A cuDNN handle ready to queue work on a stream: mucudnn's own handle on its stream
/// ([`CudnnHandle`]) or pointed at a caller's ([`StreamSession`]). An engine plan runs on
/// either with [`EnginePlan::execute`]; a prepared plan's steps go through these calls.
pub trait Surface: Site {
    /// The handle, e.g. for building descriptors and plans on it.
    fn handle(&self) -> &CudnnHandle;

    /// Runs legacy algorithm `algo` of `op` on this surface's stream (asynchronously):
    /// `out = alpha * op(a, b) + beta * out`, with operands as in [`operand_roles`]
    /// ([`ConvOperands`]).
    ///
    /// `alpha` and `beta` are host f32 for fp32, fp16 and bf16 data (cuDNN's rule: float
    /// scaling parameters for all but double data). With `beta = 0` the output is not read;
    /// `beta = 1` accumulates (backward-filter over micro-batches).
    ///
    /// Each view must have the problem's dtype and exactly the element count of its role in
    /// `d` (so a micro-batch is a view of `d.shapes().sample_range(..)` of a full-batch buffer,
    /// with `d` built for the micro-batch size), and, where its stream is known, have been taken
    /// on the stream the work goes to; the workspace must hold at least what cuDNN asks for the
    /// algorithm (an empty view where that is 0). Violations are
    /// [`CudnnError::InvalidArgument`]; an algorithm cuDNN cannot run here is a
    /// [`CudnnError::Cudnn`] with [`CudnnError::is_not_supported`] (on a [`StreamSession`]: an
    /// invalid argument).
    fn convolve<O: Origin>(
        &self,
        d: &ConvDescriptors,
        op: ConvOp,
        algo: u32,
        alpha: f32,
        beta: f32,
        operands: DeviceOperands<'_, '_, O>,
    ) -> Result<(), CudnnError> {
        convolve_on(self, d, (op, algo), (alpha, beta), operands)
    }

    /// `out = value * out` over a strided view of `out`'s buffer (`dims` and `strides` in
    /// elements; `out` spans exactly what they reach), on this surface's stream: the rows of a
    /// spatial plan that no chunk writes get `beta * out` this way (`value = 0` writes zeros).
    fn scale_view<O: Origin>(
        &self,
        out: &mut DeviceViewMut<'_, O>,
        dims: &[i64],
        strides: &[i64],
        value: f32,
    ) -> Result<(), CudnnError> {
        let call = Self::SCALE;
        if let Some(stream) = out.origin.stream() {
            if !self.orders(stream) {
                return Err(invalid(
                    call,
                    "the view was allocated on another stream or device".to_string(),
                ));
            }
        }
        let desc = fill_descriptor(call, out.dtype, out.len, dims, strides)?;
        self.enter()?;
        // SAFETY (the contract of `raw_fill`): the handle is live, used by this thread alone
        // (the surface is borrowed), its context current (`enter`) and its stream the one work
        // goes to; the view is device memory that stays allocated until the queued work has
        // finished (a borrowed buffer on that stream, checked, or the promise of an `unsafe`
        // constructor), writable and aliased by nothing (borrowed mutably), spanning exactly
        // what the descriptor reaches (checked).
        unsafe { raw_fill(self.raw(), &desc, out.ptr, value) }
    }
}

/// Checks a call's operands: the problem's dtype and exactly the `expected` element counts (in
/// `[a, b, out]` order), and that every pointer whose stream is known was taken on the stream
/// the work goes to.
fn check_operands<S: Site + ?Sized, O: Origin>(
    site: &S,
    call: &'static str,
    (shapes, expected): (&ConvShapes, [usize; 3]),
    op: ConvOp,
    ops: &DeviceOperands<'_, '_, O>,
) -> Result<(), CudnnError> {
    check_operand_spans(
        call,
        shapes,
        expected,
        op,
        [
            ("a", ops.a.dtype, ops.a.len),
            ("b", ops.b.dtype, ops.b.len),
            ("out", ops.out.dtype, ops.out.len),
        ],
    )?;
    let streams = [
        ("a", ops.a.origin.stream()),
        ("b", ops.b.origin.stream()),
        ("out", ops.out.origin.stream()),
    ];
    for (name, stream) in streams {
        if stream.is_some_and(|stream| !site.orders(stream)) {
            return Err(invalid(
                call,
                format!("{op} operand {name} was allocated on another stream or device"),
            ));
        }
    }
    let workspace_stream = ops.workspace.origin.as_ref().and_then(|o| o.stream());
    if workspace_stream.is_some_and(|stream| !site.orders(stream)) {
        return Err(invalid(
            call,
            "the workspace was allocated on another stream or device".to_string(),
        ));
    }
    Ok(())
}

/// The one path of a legacy convolution, whoever owns the handle: the operands checked
/// ([`check_operands`]), the algorithm number, the workspace against what cuDNN requires, then
/// one `cudnnConvolution*` call.
fn convolve_on<S: Site + ?Sized, O: Origin>(
    site: &S,
    d: &ConvDescriptors,
    (op, algo): (ConvOp, u32),
    scale: (f32, f32),
    ops: DeviceOperands<'_, '_, O>,
) -> Result<(), CudnnError> {
    let call = S::CONVOLVE;
    check_operands(site, call, (&d.shapes, d.operand_spans(op)), op, &ops)?;
    let required = site.required_workspace(d, op, algo)?;
    let which = Algo::checked(call, op, algo)?;
    let workspace_bytes =
        checked_workspace_bytes(call, op, algo, required, ops.workspace.bytes, "workspace")?;
    let pointers = CallPointers {
        a: ops.a.ptr,
        b: ops.b.ptr,
        out: ops.out.ptr,
        workspace: ops.workspace.raw_ptr(),
        workspace_bytes,
    };
    site.enter()?;
    // SAFETY (the contract of `raw_convolve`):
    // - the handle is live and used by this thread alone (the surface is borrowed), its context
    //   current (`enter`) and its stream the one work goes to;
    // - `a`, `b` and `out` are device memory that stays allocated until the queued work has
    //   finished: views borrowing mucudnn's or a framework's cudarc buffers, taken on that
    //   stream (checked), which cudarc frees stream-ordered, or a caller's pointers under the
    //   promise of their `unsafe` constructors; sub-views are bounds-checked; their element
    //   counts and dtype match the descriptors (checked); `out` is borrowed mutably, so it
    //   aliases no input (for a caller's pointers: that promise);
    // - the workspace view covers `workspace_bytes` bytes of such memory (null exactly when
    //   that is 0), at least what cuDNN requires for this algorithm (checked).
    unsafe { raw_convolve(site.raw(), d, which, scale, pointers) }
}

// ---------------------------------------------------------------------------------------------
// Handle

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn next_id() -> u64 {
    NEXT_ID.fetch_add(1, Ordering::Relaxed)
}

type WorkspaceKey = (u64, ConvOp, u32);

/// A cuDNN handle bound to one CUDA stream of one device. All work it issues (convolutions,
/// copies into its buffers, timer events) goes to that stream, in order.
///
/// Not `Send`/`Sync`: cuDNN handles must not be used by two threads at once; make one handle
/// per thread.
pub struct CudnnHandle {
    /// `owner.raw`, for brevity.
    raw: dnn_sys::cudnnHandle_t,
    stream: Arc<CudaStream>,
    /// Destroys the handle once this value and every execution plan built on it are gone
    /// (a plan stores the handle, `CUDNN_ATTR_EXECUTION_PLAN_HANDLE`).
    owner: Rc<HandleOwner>,
    /// Workspace sizes by (descriptor id, op, algo): `Ok` sizes and NOT_SUPPORTED answers.
    workspace_cache: RefCell<HashMap<WorkspaceKey, Result<u64, CudnnError>>>,
}

impl std::fmt::Debug for CudnnHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudnnHandle")
            .field("device", &self.ordinal())
            .finish_non_exhaustive()
    }
}

impl CudnnHandle {
    /// A handle on device `ordinal`, with a new non-blocking stream in the device's primary
    /// context.
    pub fn new(ordinal: usize) -> Result<Self, CudnnError> {
        let count = device_count()?;
        cudnn()?;
        if ordinal >= count {
            return Err(CudnnError::NoDevice {
                detail: format!("device {ordinal} requested, but only {count} visible"),
            });
        }
        let ctx = CudaContext::new(ordinal).map_err(drv_err("cuDevicePrimaryCtxRetain"))?;
        let stream = ctx.new_stream().map_err(drv_err("cuStreamCreate"))?;
        Self::with_stream(stream)
    }

    /// A handle that issues its work to `stream` (e.g. one shared with other cudarc code).
    pub fn with_stream(stream: Arc<CudaStream>) -> Result<Self, CudnnError> {
        driver()?;
        cudnn()?;
        stream
            .context()
            .bind_to_thread()
            .map_err(drv_err("cuCtxSetCurrent"))?;
        let raw = dnn::create_handle().map_err(dnn_err("cudnnCreate"))?;
        // From here on, the owner's Drop destroys `raw`.
        let owner = Rc::new(HandleOwner {
            raw,
            stream: stream.clone(),
            caller_context: RestoreAfterFields::default(),
        });
        let handle = CudnnHandle {
            raw,
            stream,
            owner,
            workspace_cache: RefCell::new(HashMap::new()),
        };
        // SAFETY: `raw` is a live handle; the stream belongs to the current context and
        // outlives the handle (the handle holds an Arc to it). The cast only renames the
        // opaque `CUstream_st` type between cudarc's driver and cuDNN bindings.
        unsafe { dnn::set_stream(handle.raw, handle.stream.cu_stream() as *mut _) }
            .map_err(dnn_err("cudnnSetStream"))?;
        Ok(handle)
    }

    /// The stream this handle's work goes to.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.stream.context().ordinal()
    }

    /// Waits until all work issued on the handle's stream has finished.
    pub fn synchronize(&self) -> Result<(), CudnnError> {
        self.stream
            .synchronize()
            .map_err(drv_err("cuStreamSynchronize"))
    }

    /// Makes the handle's context current on this thread (before any cuDNN call).
    pub(crate) fn bind(&self) -> Result<(), CudnnError> {
        self.stream.context().bind_to_thread().map_err(drv_err(
            "cuCtxSetCurrent (or an earlier deferred CUDA error)",
        ))
    }

    fn query_workspace(
        &self,
        d: &ConvDescriptors,
        op: ConvOp,
        algo: u32,
    ) -> Result<u64, CudnnError> {
        let key = (d.id, op, algo);
        if let Some(hit) = self.workspace_cache.borrow().get(&key) {
            return hit.clone();
        }
        let which = Algo::checked("CudnnHandle::workspace_size", op, algo)?;
        self.bind()?;
        // SAFETY: `self.raw` is a live handle made by cudnnCreate after the `cudnn()` gate
        // passed, and the type is not `Sync`, so no other thread uses it meanwhile.
        let result = unsafe { raw_workspace_size(self.raw, d, op, algo, which) };
        if result
            .as_ref()
            .map_or_else(CudnnError::is_not_supported, |_| true)
        {
            self.workspace_cache
                .borrow_mut()
                .insert(key, result.clone());
        }
        result
    }

    /// Workspace bytes that legacy algorithm `algo` of `op` needs for `d`, or `None` when
    /// cuDNN answers `CUDNN_STATUS_NOT_SUPPORTED*` for this configuration (skip the algorithm).
    /// Other failures, and `algo >= algo_count(op)`, are errors. Answers are cached per
    /// (descriptors, op, algo).
    pub fn workspace_size(
        &self,
        d: &ConvDescriptors,
        op: ConvOp,
        algo: u32,
    ) -> Result<Option<u64>, CudnnError> {
        declined_as_none(self.query_workspace(d, op, algo))
    }

    /// Every legacy algorithm of `op` that cuDNN reports a workspace size for, in algorithm
    /// order. A listed algorithm may still fail with NOT_SUPPORTED when run (cuDNN decides some
    /// limits only then): see [`CudnnError::is_not_supported`].
    pub fn supported_algorithms(
        &self,
        d: &ConvDescriptors,
        op: ConvOp,
    ) -> Result<Vec<AlgoWorkspace>, CudnnError> {
        let mut found = Vec::new();
        for algo in 0..algo_count(op) {
            if let Some(workspace_bytes) = self.workspace_size(d, op, algo)? {
                found.push(AlgoWorkspace {
                    algo,
                    workspace_bytes,
                });
            }
        }
        Ok(found)
    }

    /// cuDNN's own benchmark of every legacy algorithm of `op` (`cudnnFind*AlgorithmEx`),
    /// fastest first. It runs each algorithm on the given buffers (overwriting `out`) and
    /// blocks until done; algorithms that need more than the workspace view are reported
    /// with a failure status. Operand rules as for [`Surface::convolve`].
    pub fn find_algorithms<'v>(
        &self,
        d: &ConvDescriptors,
        op: ConvOp,
        ops: DeviceOperands<'_, 'v, Tracked<'v>>,
    ) -> Result<Vec<FoundAlgorithm>, CudnnError> {
        const CALL: &str = "CudnnHandle::find_algorithms";
        check_operands(self, CALL, (&d.shapes, d.operand_spans(op)), op, &ops)?;
        let ConvOperands {
            a,
            b,
            out,
            workspace,
        } = ops;
        let workspace_bytes = usize::try_from(workspace.bytes)
            .map_err(|_| invalid(CALL, "workspace larger than the address space".into()))?;
        self.bind()?;
        let requested = algo_count(op) as usize;
        let mut returned: std::ffi::c_int = 0;
        let (a_ptr, b_ptr) = (a.ptr as *const c_void, b.ptr as *const c_void);
        let out_ptr = out.ptr as *mut c_void;
        let ws_ptr = workspace.raw_ptr();

        /// Reads one perf entry field by field; enum fields as their `u32` representation.
        macro_rules! read_perf {
            ($entry:expr) => {{
                let p = $entry.as_ptr();
                // SAFETY: `p` points to an initialised entry (zeroed, then possibly written by
                // cuDNN); every field is read with its own plain type, enums as u32 (they are
                // `repr(u32)`), so an unknown value is not undefined behaviour.
                unsafe {
                    FoundAlgorithm {
                        algo: std::ptr::addr_of!((*p).algo).cast::<u32>().read(),
                        status_code: std::ptr::addr_of!((*p).status).cast::<u32>().read(),
                        time_ms: std::ptr::addr_of!((*p).time).read(),
                        workspace_bytes: std::ptr::addr_of!((*p).memory).read() as u64,
                        deterministic: std::ptr::addr_of!((*p).determinism).cast::<u32>().read()
                            == dnn_sys::cudnnDeterminism_t::CUDNN_DETERMINISTIC as u32,
                        math: math_mode_from_raw(
                            std::ptr::addr_of!((*p).mathType).cast::<u32>().read(),
                        ),
                    }
                }
            }};
        }

        // SAFETY (all three arms): as for `convolve` (live handle and descriptors, operands
        // checked against the descriptors and on the handle's stream, workspace pointer and
        // size describing one live allocation or null/0); in addition, `perf` holds
        // `requested` zero-initialised entries for cuDNN to fill and `returned` is a live
        // local. The Find functions synchronise before returning.
        let found: Vec<FoundAlgorithm> = match op {
            ConvOp::Forward => {
                let mut perf = vec![
                    MaybeUninit::<dnn_sys::cudnnConvolutionFwdAlgoPerf_t>::zeroed();
                    requested
                ];
                unsafe {
                    dnn_sys::cudnnFindConvolutionForwardAlgorithmEx(
                        self.raw,
                        d.input.raw,
                        a_ptr,
                        d.filter.raw,
                        b_ptr,
                        d.conv.raw,
                        d.output.raw,
                        out_ptr,
                        requested as std::ffi::c_int,
                        &mut returned,
                        perf.as_mut_ptr().cast(),
                        ws_ptr,
                        workspace_bytes,
                    )
                }
                .result()
                .map_err(|e| status_error(find_call(op), e.0).for_op_algo(op, None))?;
                let n = (returned.max(0) as usize).min(requested);
                perf[..n].iter().map(|e| read_perf!(e)).collect()
            }
            ConvOp::BackwardData => {
                let mut perf = vec![
                    MaybeUninit::<dnn_sys::cudnnConvolutionBwdDataAlgoPerf_t>::zeroed();
                    requested
                ];
                unsafe {
                    dnn_sys::cudnnFindConvolutionBackwardDataAlgorithmEx(
                        self.raw,
                        d.filter.raw,
                        a_ptr,
                        d.output.raw,
                        b_ptr,
                        d.conv.raw,
                        d.input.raw,
                        out_ptr,
                        requested as std::ffi::c_int,
                        &mut returned,
                        perf.as_mut_ptr().cast(),
                        ws_ptr,
                        workspace_bytes,
                    )
                }
                .result()
                .map_err(|e| status_error(find_call(op), e.0).for_op_algo(op, None))?;
                let n = (returned.max(0) as usize).min(requested);
                perf[..n].iter().map(|e| read_perf!(e)).collect()
            }
            ConvOp::BackwardFilter => {
                let mut perf = vec![
                    MaybeUninit::<dnn_sys::cudnnConvolutionBwdFilterAlgoPerf_t>::zeroed();
                    requested
                ];
                unsafe {
                    dnn_sys::cudnnFindConvolutionBackwardFilterAlgorithmEx(
                        self.raw,
                        d.input.raw,
                        a_ptr,
                        d.output.raw,
                        b_ptr,
                        d.conv.raw,
                        d.filter.raw,
                        out_ptr,
                        requested as std::ffi::c_int,
                        &mut returned,
                        perf.as_mut_ptr().cast(),
                        ws_ptr,
                        workspace_bytes,
                    )
                }
                .result()
                .map_err(|e| status_error(find_call(op), e.0).for_op_algo(op, None))?;
                let n = (returned.max(0) as usize).min(requested);
                perf[..n].iter().map(|e| read_perf!(e)).collect()
            }
        };
        Ok(found)
    }

    // ---- memory

    /// A zero-filled buffer of `len` elements of `dtype` on this handle's stream.
    pub fn alloc_zeroed(&self, dtype: DType, len: usize) -> Result<DeviceBuffer, CudnnError> {
        let bytes = buffer_bytes("CudnnHandle::alloc_zeroed", dtype, len)?;
        let data = self
            .stream
            .alloc_zeros::<u8>(bytes)
            .map_err(drv_err("cuMemAlloc"))?;
        Ok(DeviceBuffer {
            data,
            stream: self.stream.clone(),
            dtype,
            len,
        })
    }

    /// A buffer holding `values` converted to `dtype` (rounded to nearest).
    pub fn upload(&self, dtype: DType, values: &[f32]) -> Result<DeviceBuffer, CudnnError> {
        buffer_bytes("CudnnHandle::upload", dtype, values.len())?;
        let data = self
            .stream
            .clone_htod(&host::encode(dtype, values))
            .map_err(drv_err("cuMemcpyHtoDAsync"))?;
        Ok(DeviceBuffer {
            data,
            stream: self.stream.clone(),
            dtype,
            len: values.len(),
        })
    }

    /// A buffer of `len` random non-zero values ([`host::random_values`] with `seed`).
    pub fn alloc_random(
        &self,
        dtype: DType,
        len: usize,
        seed: u64,
    ) -> Result<DeviceBuffer, CudnnError> {
        self.upload(dtype, &host::random_values(dtype, len, seed))
    }

    /// A buffer of `len` non-zero random values that repeat every [`host::FILL_PERIOD`]
    /// elements ([`host::tiled_values`]): one block made and uploaded, the rest copied on the
    /// device, doubling ([`host::doubling_copies`]). Operands to time on: a GiB-sized tensor
    /// costs a few device copies instead of a single-threaded pass over every value on the
    /// host and a transfer of all of them.
    pub fn alloc_tiled(
        &self,
        dtype: DType,
        len: usize,
        seed: u64,
    ) -> Result<DeviceBuffer, CudnnError> {
        let bytes = buffer_bytes("CudnnHandle::alloc_tiled", dtype, len)?;
        let block = host::encode(
            dtype,
            &host::random_values(dtype, len.min(host::FILL_PERIOD), seed),
        );
        // SAFETY: uninitialised bytes (any value is valid for u8); every byte is written
        // below, by the upload of the block and the copies that tile it, before the buffer is
        // handed out.
        let mut data = unsafe { self.stream.alloc::<u8>(bytes) }.map_err(drv_err("cuMemAlloc"))?;
        self.stream
            .memcpy_htod(&block, &mut data.slice_mut(0..block.len()))
            .map_err(drv_err("cuMemcpyHtoDAsync"))?;
        for (count, offset) in host::doubling_copies(block.len(), bytes) {
            // [0, offset) is filled and count <= offset: the two views do not overlap.
            let (filled, mut rest) = data.split_at_mut(offset);
            self.stream
                .memcpy_dtod(&filled.slice(0..count), &mut rest.slice_mut(0..count))
                .map_err(drv_err("cuMemcpyDtoDAsync"))?;
        }
        Ok(DeviceBuffer {
            data,
            stream: self.stream.clone(),
            dtype,
            len,
        })
    }

    /// A zero-filled buffer for `role` of `d` (its full batch).
    pub fn alloc_operand(
        &self,
        d: &ConvDescriptors,
        role: Operand,
    ) -> Result<DeviceBuffer, CudnnError> {
        self.alloc_zeroed(d.shapes.dtype, d.shapes.elements(role))
    }

    /// A workspace of `bytes` bytes (no allocation for 0).
    pub fn alloc_workspace(&self, bytes: u64) -> Result<Workspace, CudnnError> {
        let data = if bytes == 0 {
            None
        } else {
            let len = usize::try_from(bytes).map_err(|_| {
                invalid(
                    "CudnnHandle::alloc_workspace",
                    format!("{bytes} bytes exceed the address space"),
                )
            })?;
            Some(
                self.stream
                    .alloc_zeros::<u8>(len)
                    .map_err(drv_err("cuMemAlloc"))?,
            )
        };
        Ok(Workspace {
            data,
            stream: self.stream.clone(),
            bytes,
        })
    }

    /// A pair of timing events on this handle's stream.
    pub fn timer(&self) -> Result<GpuTimer, CudnnError> {
        let ctx = self.stream.context();
        let event = || {
            ctx.new_event(Some(drv_sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(drv_err("cuEventCreate"))
        };
        Ok(GpuTimer {
            start: event()?,
            end: event()?,
            stream: self.stream.clone(),
        })
    }
}

/// The owner of a [`CudnnHandle`]'s raw handle, shared (not across threads) with the execution
/// plans built on it, so the handle outlives them.
struct HandleOwner {
    raw: dnn_sys::cudnnHandle_t,
    stream: Arc<CudaStream>,
    /// The caller's context, made current again after the stream (which binds its context
    /// to be destroyed) is released (last).
    caller_context: RestoreAfterFields,
}

impl Drop for HandleOwner {
    fn drop(&mut self) {
        self.caller_context.save();
        // A failure to bind is recorded by cudarc in the context; the destroy is tried anyway.
        let _ = self.stream.context().bind_to_thread();
        // SAFETY: `raw` was created by cudnnCreate in `CudnnHandle::with_stream` and is
        // destroyed exactly once, here, after the handle and every plan holding this owner
        // are gone.
        if let Err(e) = unsafe { dnn::destroy_handle(self.raw) } {
            warn_drop("cudnnDestroy", e.0);
        }
    }
}

impl Site for CudnnHandle {
    const CONVOLVE: &'static str = "CudnnHandle::convolve";
    const EXECUTE: &'static str = "EnginePlan::execute";
    const SCALE: &'static str = "CudnnHandle::scale_view";

    fn raw(&self) -> dnn_sys::cudnnHandle_t {
        self.raw
    }

    fn orders(&self, stream: &CudaStream) -> bool {
        *stream == *self.stream
    }

    fn enter(&self) -> Result<(), CudnnError> {
        self.bind()
    }

    fn required_workspace(
        &self,
        d: &ConvDescriptors,
        op: ConvOp,
        algo: u32,
    ) -> Result<u64, CudnnError> {
        self.query_workspace(d, op, algo)
    }

    fn built(&self, plan: &EnginePlan) -> bool {
        plan.built_on(&self.owner)
    }
}

impl Surface for CudnnHandle {
    fn handle(&self) -> &CudnnHandle {
        self
    }
}

/// A legacy algorithm and the workspace it needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AlgoWorkspace {
    pub algo: u32,
    pub workspace_bytes: u64,
}

/// One result of [`CudnnHandle::find_algorithms`].
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct FoundAlgorithm {
    pub algo: u32,
    /// cuDNN's status for this algorithm: 0 when it ran.
    pub status_code: u32,
    pub time_ms: f32,
    pub workspace_bytes: u64,
    pub deterministic: bool,
    /// The math mode cuDNN used (`None` for a value this build does not know).
    pub math: Option<MathMode>,
}

impl FoundAlgorithm {
    pub fn succeeded(&self) -> bool {
        self.status_code == dnn_sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS as u32
    }
}

/// Checks that a workspace of `have` bytes (called `what` in the message) holds the `required`
/// bytes of `op`'s algorithm `algo`, and returns its size as cuDNN takes it.
fn checked_workspace_bytes(
    call: &'static str,
    op: ConvOp,
    algo: u32,
    required: u64,
    have: u64,
    what: &str,
) -> Result<usize, CudnnError> {
    if have < required {
        return Err(invalid(
            call,
            format!(
                "{op} algorithm {algo} needs {required} workspace bytes, the {what} has {have}"
            ),
        ));
    }
    usize::try_from(have)
        .map_err(|_| invalid(call, "workspace larger than the address space".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn algorithm_tables_match_cudnn_numbering() {
        assert_eq!(algo_count(ConvOp::Forward), 8);
        assert_eq!(algo_count(ConvOp::BackwardData), 6);
        assert_eq!(algo_count(ConvOp::BackwardFilter), 7);
        for (i, a) in FWD_ALGOS.iter().enumerate() {
            assert_eq!(*a as usize, i);
        }
        for (i, a) in BWD_DATA_ALGOS.iter().enumerate() {
            assert_eq!(*a as usize, i);
        }
        for (i, a) in BWD_FILTER_ALGOS.iter().enumerate() {
            assert_eq!(*a as usize, i);
        }
        assert_eq!(
            algo_name(ConvOp::Forward, 1).as_deref(),
            Some("FWD_ALGO_IMPLICIT_PRECOMP_GEMM")
        );
        assert_eq!(
            algo_name(ConvOp::BackwardData, 0).as_deref(),
            Some("BWD_DATA_ALGO_0")
        );
        assert_eq!(
            algo_name(ConvOp::BackwardFilter, 6).as_deref(),
            Some("BWD_FILTER_ALGO_FFT_TILING")
        );
        assert_eq!(algo_name(ConvOp::Forward, 8), None);
        assert!(Algo::checked("t", ConvOp::BackwardData, 6).is_err());
        // The solver's names table (what reports print) is cuDNN's enums, number for number.
        for op in ConvOp::ALL {
            let prefix = match op {
                ConvOp::Forward => "FWD_ALGO_",
                ConvOp::BackwardData => "BWD_DATA_ALGO_",
                ConvOp::BackwardFilter => "BWD_FILTER_ALGO_",
            };
            for number in 0..=algo_count(op) {
                let ours = crate::solver::legacy_name(crate::solver::BackendKind::Cuda, op, number);
                let cudnn = algo_name(op, number);
                // `BWD_DATA_ALGO_0` reads `ALGO_0`, `BWD_DATA_ALGO_FFT` reads `FFT`.
                let theirs = cudnn.as_deref().map(|name| {
                    let rest = name.strip_prefix(prefix).unwrap();
                    if rest.bytes().all(|b| b.is_ascii_digit()) {
                        format!("ALGO_{rest}")
                    } else {
                        rest.to_string()
                    }
                });
                assert_eq!(ours, theirs.as_deref(), "{op} {number}");
                // Tuning's idea of a candidate agrees with the solver's.
                let algo = crate::solver::Algo::Legacy(number);
                assert_eq!(
                    algo.belongs_to(crate::solver::BackendKind::Cuda, op),
                    number < algo_count(op)
                );
            }
        }
    }

    #[test]
    fn enum_mappings() {
        assert_eq!(data_type(DType::Bf16) as u32, 9);
        assert_eq!(data_type(DType::Fp16) as u32, 2);
        assert_eq!(compute_type(DType::Fp16) as u32, 0);
        assert_eq!(tensor_format(Layout::Nhwc) as u32, 1);
        for m in [
            MathMode::Default,
            MathMode::TensorOp,
            MathMode::TensorOpAllowConversion,
            MathMode::Fma,
        ] {
            assert_eq!(math_mode_from_raw(math_type(m) as u32), Some(m));
        }
        assert_eq!(math_mode_from_raw(99), None);
    }

    #[test]
    fn status_conversion_keeps_name_and_number() {
        let e = status_error(
            "cudnnConvolutionForward",
            dnn_sys::cudnnStatus_t::CUDNN_STATUS_NOT_SUPPORTED,
        );
        assert!(e.is_not_supported());
        assert_eq!(
            e.to_string(),
            "cudnnConvolutionForward failed with CUDNN_STATUS_NOT_SUPPORTED (3000)"
        );
        let bad = status_error("x", dnn_sys::cudnnStatus_t::CUDNN_STATUS_BAD_PARAM);
        assert!(!bad.is_not_supported());
        let oom = status_error(
            "x",
            dnn_sys::cudnnStatus_t::CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED,
        );
        assert!(oom.is_out_of_memory());
    }
}
