//! A C caller's cuDNN objects, used without owning them: the part of the FFI wall that the C
//! ABI ([`crate::c_abi`]) stands on.
//!
//! A C program hands mucudnn its own `cudnnHandle_t`, CUDA stream, tensor, filter and
//! convolution descriptors, and raw device pointers. None of that can be fully checked, so the
//! entry points that take such a pointer are `unsafe fn`s whose `# Safety` sections are exactly
//! the contract that `include/mucudnn.h` states for C callers. Everything that *can* be checked
//! is checked at run time, and failures are [`CudnnError`]s:
//!
//! - null pointers, and descriptors that cuDNN refuses to describe (`cudnnGet*Descriptor`);
//! - that only one libcudnn is loaded in the process (a handle made by one copy of cuDNN must
//!   never reach another copy: see [`ForeignHandle::new`]);
//! - that every operand's first and last byte is device memory CUDA knows, on the handle's
//!   GPU, and that the output overlaps no input ([`ForeignSession::check_memory`]);
//! - dtype and exact element count of every operand against the descriptors mucudnn runs
//!   with, and the workspace size against cuDNN's query ([`ForeignSession::convolve`], through
//!   the wall's one call path), and that the workspace is of the stream's context
//!   ([`ForeignSession::workspace`]).
//!
//! Work runs on the caller's stream and handle: a [`ForeignSession`] makes the stream's CUDA
//! context current and sets the stream on the caller's cuDNN handle for its lifetime, and puts
//! both back when dropped. The one allocation mucudnn makes for the caller, the workspace
//! ([`ForeignWorkspace`]), lives in the stream's context.

use super::{
    convolve_on, cudnn, driver, drv_err, invalid, math_mode_from_raw, raw_workspace_size, Algo,
    ConvDescriptors, CudnnError, DeviceOperands, Nd, Origin, Raw, RawDeviceView, RawDeviceViewMut,
    RawWorkspace, Site,
};
use crate::backend::cudnn::shape::MAX_DIMS;
use crate::solver::{ConvOp, DType, Layout, MathMode};
use cudarc::cudnn::sys as dnn_sys;
use cudarc::driver::sys as drv_sys;
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::io::Write;
use std::ptr;

/// Reports a failed clean-up from a `Drop` impl without panicking.
fn warn_cleanup(what: &str, detail: &dyn std::fmt::Display) {
    let _ = writeln!(
        std::io::stderr(),
        "mucudnn: warning: {what} failed while cleaning up: {detail}"
    );
}

// ---------------------------------------------------------------------------------------------
// Descriptors

/// A `cudnnDataType_t` as a caller's descriptor holds it (kept as a number, so that a value this
/// build does not know is data, not undefined behaviour).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DataTypeCode(pub u32);

/// The data types cuDNN 9 has had since 9.0, for names in messages.
const KNOWN_DATA_TYPES: [dnn_sys::cudnnDataType_t; 15] = {
    use dnn_sys::cudnnDataType_t as T;
    [
        T::CUDNN_DATA_FLOAT,
        T::CUDNN_DATA_DOUBLE,
        T::CUDNN_DATA_HALF,
        T::CUDNN_DATA_INT8,
        T::CUDNN_DATA_INT32,
        T::CUDNN_DATA_INT8x4,
        T::CUDNN_DATA_UINT8,
        T::CUDNN_DATA_UINT8x4,
        T::CUDNN_DATA_INT8x32,
        T::CUDNN_DATA_BFLOAT16,
        T::CUDNN_DATA_INT64,
        T::CUDNN_DATA_BOOLEAN,
        T::CUDNN_DATA_FP8_E4M3,
        T::CUDNN_DATA_FP8_E5M2,
        T::CUDNN_DATA_FAST_FLOAT_FOR_FP8,
    ]
};

impl DataTypeCode {
    /// The code of `dtype` (`CUDNN_DATA_FLOAT`, `_HALF`, `_BFLOAT16`).
    pub fn of(dtype: DType) -> Self {
        DataTypeCode(super::data_type(dtype) as u32)
    }

    /// The mucudnn dtype, for the three that mucudnn runs.
    pub fn dtype(self) -> Option<DType> {
        [DType::Fp32, DType::Fp16, DType::Bf16]
            .into_iter()
            .find(|&dtype| Self::of(dtype) == self)
    }
}

impl std::fmt::Display for DataTypeCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match KNOWN_DATA_TYPES.iter().find(|&&t| t as u32 == self.0) {
            Some(t) => write!(f, "{t:?} ({})", self.0),
            None => write!(f, "cudnnDataType_t {}", self.0),
        }
    }
}

/// What a caller's tensor descriptor says (`cudnnGetTensorNdDescriptor`): 4 dims for a 2-D
/// convolution, 5 for a 3-D one (any count cuDNN reports, up to `CUDNN_DIM_MAX`, is kept for
/// the C ABI's checks to judge).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorDescriptorInfo {
    pub data_type: DataTypeCode,
    /// `[n, c, h, w]` or `[n, c, d, h, w]`.
    pub dims: Nd<i32>,
    /// Element strides of the dims.
    pub strides: Nd<i32>,
}

/// What a caller's filter descriptor says (`cudnnGetFilterNdDescriptor`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FilterDescriptorInfo {
    pub data_type: DataTypeCode,
    /// `CUDNN_TENSOR_NCHW` (KCRS / KCTRS) or `CUDNN_TENSOR_NHWC` (KRSC / KTRSC); `None` for
    /// another format.
    pub layout: Option<Layout>,
    /// The `cudnnTensorFormat_t` number (2 is `CUDNN_TENSOR_NCHW_VECT_C`).
    pub format_code: u32,
    /// `[k, c / groups, r, s]` or `[k, c / groups, t, r, s]`.
    pub dims: Nd<i32>,
}

/// What a caller's convolution descriptor says (`cudnnGetConvolutionNdDescriptor`, group
/// count, math type): 2 spatial dims, or 3 (depth first).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvolutionDescriptorInfo {
    /// `[pad_h, pad_w]` or `[pad_d, pad_h, pad_w]`.
    pub pad: Nd<i32>,
    /// `[stride_h, stride_w]` or `[stride_d, stride_h, stride_w]`.
    pub stride: Nd<i32>,
    /// `[dilation_h, dilation_w]` or `[dilation_d, dilation_h, dilation_w]`.
    pub dilation: Nd<i32>,
    /// `CUDNN_CROSS_CORRELATION` (what deep learning calls convolution); false for
    /// `CUDNN_CONVOLUTION`, which flips the filter.
    pub cross_correlation: bool,
    pub compute_type: DataTypeCode,
    pub groups: i32,
    /// `None` for a math type this build does not know.
    pub math: Option<MathMode>,
    /// The `cudnnMathType_t` number.
    pub math_code: u32,
}

fn null_descriptor(call: &'static str, what: &str) -> CudnnError {
    invalid(call, format!("the {what} descriptor is NULL"))
}

/// The first `count` of `values`, or an error when cuDNN reports a count outside
/// `[0, values.len()]` (it never should: it was asked for at most that many).
fn reported(
    call: &'static str,
    count: std::ffi::c_int,
    values: &[std::ffi::c_int],
) -> Result<Nd<i32>, CudnnError> {
    match usize::try_from(count) {
        Ok(n) if n <= values.len() => Ok(Nd::from_slice(&values[..n])),
        _ => Err(invalid(
            call,
            format!(
                "cuDNN reported {count} dims, at most {} expected",
                values.len()
            ),
        )),
    }
}

/// Reads a caller's tensor descriptor (4-D or 5-D; the count cuDNN reports is kept).
///
/// # Safety
///
/// `desc` is null (an error) or a `cudnnTensorDescriptor_t` created by `cudnnCreateTensorDescriptor`
/// of the libcudnn this process loaded, not yet destroyed, and not being modified by another
/// thread during the call. (cuDNN cannot tell a garbage pointer from a descriptor: reading one
/// is undefined behaviour, as it is in cuDNN itself.)
pub unsafe fn read_tensor_descriptor(
    desc: *mut c_void,
) -> Result<TensorDescriptorInfo, CudnnError> {
    const CALL: &str = "cudnnGetTensorNdDescriptor";
    if desc.is_null() {
        return Err(null_descriptor(CALL, "tensor"));
    }
    cudnn()?;
    let mut data_type = u32::MAX;
    let mut count: std::ffi::c_int = 0;
    let (mut dims, mut strides) = (
        [0 as std::ffi::c_int; MAX_DIMS],
        [0 as std::ffi::c_int; MAX_DIMS],
    );
    // SAFETY: `desc` is a live tensor descriptor (the caller's contract) and the cuDNN gate has
    // passed. cuDNN writes at most `MAX_DIMS` (the requested count) dims and strides into the
    // two arrays; the other outputs are distinct live locals, and the data type is written as
    // the C enum's 4 bytes into a u32, so an unknown value is just a number.
    unsafe {
        dnn_sys::cudnnGetTensorNdDescriptor(
            desc.cast(),
            MAX_DIMS as std::ffi::c_int,
            ptr::from_mut(&mut data_type).cast(),
            &mut count,
            dims.as_mut_ptr(),
            strides.as_mut_ptr(),
        )
    }
    .result()
    .map_err(|e| super::status_error(CALL, e.0))?;
    Ok(TensorDescriptorInfo {
        data_type: DataTypeCode(data_type),
        dims: reported(CALL, count, &dims)?,
        strides: reported(CALL, count, &strides)?,
    })
}

/// Reads a caller's filter descriptor (4-D or 5-D; the count cuDNN reports is kept).
///
/// # Safety
///
/// As for [`read_tensor_descriptor`], for a `cudnnFilterDescriptor_t`.
pub unsafe fn read_filter_descriptor(
    desc: *mut c_void,
) -> Result<FilterDescriptorInfo, CudnnError> {
    const CALL: &str = "cudnnGetFilterNdDescriptor";
    if desc.is_null() {
        return Err(null_descriptor(CALL, "filter"));
    }
    cudnn()?;
    let (mut data_type, mut format) = (u32::MAX, u32::MAX);
    let mut count: std::ffi::c_int = 0;
    let mut dims = [0 as std::ffi::c_int; MAX_DIMS];
    // SAFETY: as in `read_tensor_descriptor`; at most `MAX_DIMS` dims are written into `dims`,
    // and both enums are written into u32 locals.
    unsafe {
        dnn_sys::cudnnGetFilterNdDescriptor(
            desc.cast(),
            MAX_DIMS as std::ffi::c_int,
            ptr::from_mut(&mut data_type).cast(),
            ptr::from_mut(&mut format).cast(),
            &mut count,
            dims.as_mut_ptr(),
        )
    }
    .result()
    .map_err(|e| super::status_error(CALL, e.0))?;
    let layout = [Layout::Nchw, Layout::Nhwc]
        .into_iter()
        .find(|&layout| super::tensor_format(layout) as u32 == format);
    Ok(FilterDescriptorInfo {
        data_type: DataTypeCode(data_type),
        layout,
        format_code: format,
        dims: reported(CALL, count, &dims)?,
    })
}

/// Reads a caller's convolution descriptor (2 or 3 spatial dims; the count cuDNN reports is
/// kept).
///
/// # Safety
///
/// As for [`read_tensor_descriptor`], for a `cudnnConvolutionDescriptor_t`.
pub unsafe fn read_convolution_descriptor(
    desc: *mut c_void,
) -> Result<ConvolutionDescriptorInfo, CudnnError> {
    const CALL: &str = "cudnnGetConvolutionNdDescriptor";
    /// `CUDNN_DIM_MAX - 2`: the most spatial dims a convolution descriptor has.
    const MAX_SPATIAL: usize = MAX_DIMS - 2;
    if desc.is_null() {
        return Err(null_descriptor(CALL, "convolution"));
    }
    cudnn()?;
    let desc: dnn_sys::cudnnConvolutionDescriptor_t = desc.cast();
    let mut count: std::ffi::c_int = 0;
    let (mut pad, mut stride, mut dilation) = (
        [0 as std::ffi::c_int; MAX_SPATIAL],
        [0 as std::ffi::c_int; MAX_SPATIAL],
        [0 as std::ffi::c_int; MAX_SPATIAL],
    );
    let (mut mode, mut compute_type) = (u32::MAX, u32::MAX);
    // SAFETY: as in `read_tensor_descriptor`; at most `MAX_SPATIAL` (the requested length)
    // values are written into each array, and both enums are written into u32 locals.
    unsafe {
        dnn_sys::cudnnGetConvolutionNdDescriptor(
            desc,
            MAX_SPATIAL as std::ffi::c_int,
            &mut count,
            pad.as_mut_ptr(),
            stride.as_mut_ptr(),
            dilation.as_mut_ptr(),
            ptr::from_mut(&mut mode).cast(),
            ptr::from_mut(&mut compute_type).cast(),
        )
    }
    .result()
    .map_err(|e| super::status_error(CALL, e.0))?;
    let (pad, stride, dilation) = (
        reported(CALL, count, &pad)?,
        reported(CALL, count, &stride)?,
        reported(CALL, count, &dilation)?,
    );
    let mut groups: std::ffi::c_int = 0;
    // SAFETY: as above; one int output.
    unsafe { dnn_sys::cudnnGetConvolutionGroupCount(desc, &mut groups) }
        .result()
        .map_err(|e| super::status_error("cudnnGetConvolutionGroupCount", e.0))?;
    let mut math = u32::MAX;
    // SAFETY: as above; the enum is written into a u32 local.
    unsafe { dnn_sys::cudnnGetConvolutionMathType(desc, ptr::from_mut(&mut math).cast()) }
        .result()
        .map_err(|e| super::status_error("cudnnGetConvolutionMathType", e.0))?;
    Ok(ConvolutionDescriptorInfo {
        pad,
        stride,
        dilation,
        cross_correlation: mode == dnn_sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION as u32,
        compute_type: DataTypeCode(compute_type),
        groups,
        math: math_mode_from_raw(math),
        math_code: math,
    })
}

// ---------------------------------------------------------------------------------------------
// One libcudnn per process

/// The distinct `libcudnn.so*` files mapped into this process (`/proc/self/maps`), as
/// `(device:inode, path)`; empty where there is no `/proc`.
fn loaded_libcudnn_files() -> Vec<(String, String)> {
    match std::fs::read_to_string("/proc/self/maps") {
        Ok(maps) => libcudnn_files_in(&maps),
        Err(_) => Vec::new(),
    }
}

/// The distinct `libcudnn.so*` files in a `/proc/<pid>/maps` text, as `(device:inode, path)`:
/// one file mapped under two paths (a link) is one file.
fn libcudnn_files_in(maps: &str) -> Vec<(String, String)> {
    let mut found: Vec<(String, String)> = Vec::new();
    for line in maps.lines() {
        // address perms offset dev inode path
        let mut fields = line.split_whitespace();
        let (Some(_), Some(_), Some(_), Some(dev), Some(inode)) = (
            fields.next(),
            fields.next(),
            fields.next(),
            fields.next(),
            fields.next(),
        ) else {
            continue;
        };
        let path = fields.collect::<Vec<_>>().join(" ");
        let name = path.rsplit('/').next().unwrap_or(&path);
        if name == "libcudnn.so" || name.starts_with("libcudnn.so.") {
            let id = format!("{dev}:{inode}");
            if !found.iter().any(|(seen, _)| *seen == id) {
                found.push((id, path.to_string()));
            }
        }
    }
    found
}

/// Errors when more than one libcudnn is loaded: a handle made by one copy of cuDNN would be
/// read as garbage by the other. (mucudnn loads libcudnn through cudarc, which tries
/// `libcudnn.so` before `libcudnn.so.9`; a framework's own copy is usually found by its soname.)
/// Every path that hands mucudnn's cuDNN objects to a caller's stream or handle checks it: a
/// caller's handle ([`ForeignHandle::new`]) and a GPU tuner (`crate::c_abi::tuner`).
/// Loads mucudnn's own libcudnn first (the cuDNN gate), so that it is among those counted.
pub fn check_one_libcudnn() -> Result<(), CudnnError> {
    cudnn()?;
    let files = loaded_libcudnn_files();
    if files.len() > 1 {
        let paths: Vec<&str> = files.iter().map(|(_, path)| path.as_str()).collect();
        return Err(CudnnError::Unavailable {
            what: "libcudnn",
            detail: format!(
                "{} different libcudnn libraries are loaded in this process ({}); a cuDNN \
                 handle made by one cannot be used by another. Make mucudnn load the one your \
                 program uses: put a directory holding a `libcudnn.so` link to it first on \
                 LD_LIBRARY_PATH (mucudnn looks for libcudnn.so before libcudnn.so.9)",
                files.len(),
                paths.join(", ")
            ),
        });
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Contexts (the caller's current context is saved and restored by `super::context`)

/// The context of `stream` (the current context for the null stream) and its device ordinal.
///
/// # Safety
///
/// `stream` is null or a live `CUstream` (= `cudaStream_t`); the driver gate has passed.
unsafe fn stream_device(
    stream: drv_sys::CUstream,
) -> Result<(drv_sys::CUcontext, usize), CudnnError> {
    let mut context = ptr::null_mut();
    // SAFETY: `stream` is null or live (the caller's contract); one output to a live local.
    unsafe { drv_sys::cuStreamGetCtx(stream, &mut context) }
        .result()
        .map_err(|e| {
            let error = super::driver_error("cuStreamGetCtx", e);
            if stream.is_null() {
                CudnnError::NoDevice {
                    detail: format!(
                        "the stream is the default stream and no CUDA context is current on \
                         this thread ({error}): make the device current first (cudaSetDevice)"
                    ),
                }
            } else {
                error
            }
        })?;
    if context.is_null() {
        return Err(CudnnError::NoDevice {
            detail: "the stream is the default stream and no CUDA context is current on this \
                     thread: make the device current first (cudaSetDevice)"
                .into(),
        });
    }
    let mut device: drv_sys::CUdevice = 0;
    // SAFETY: `context` is a live context (the stream's, or current); it is made current for
    // one query (cuCtxGetDevice, available in every driver) and popped again at once; the
    // output is a live local.
    unsafe {
        drv_sys::cuCtxPushCurrent_v2(context)
            .result()
            .map_err(drv_err("cuCtxPushCurrent"))?;
        let got = drv_sys::cuCtxGetDevice(&mut device).result();
        let mut popped = ptr::null_mut();
        let pop = drv_sys::cuCtxPopCurrent_v2(&mut popped).result();
        got.map_err(drv_err("cuCtxGetDevice"))?;
        pop.map_err(drv_err("cuCtxPopCurrent"))?;
    }
    let count = super::device_count()?;
    for ordinal in 0..count {
        let candidate = cudarc::driver::result::device::get(ordinal as std::ffi::c_int)
            .map_err(drv_err("cuDeviceGet"))?;
        if candidate == device {
            return Ok((context, ordinal));
        }
    }
    Err(CudnnError::NoDevice {
        detail: format!("the stream's device ({device}) is not among the {count} visible GPUs"),
    })
}

// ---------------------------------------------------------------------------------------------
// Device memory

/// Device scratch memory that mucudnn allocates for a caller's handle, in the context of the
/// handle's stream. Dropping it waits for that context's work (the workspace may still be in
/// use on any stream the handle has had) and frees it, unless work using it was captured into
/// a CUDA graph ([`Self::captured`]): a graph may replay that work at any time, so such a
/// workspace is never freed (it stays allocated until the process exits).
pub struct ForeignWorkspace {
    ptr: drv_sys::CUdeviceptr,
    bytes: u64,
    context: drv_sys::CUcontext,
    captured: bool,
}

impl std::fmt::Debug for ForeignWorkspace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ForeignWorkspace")
            .field("bytes", &self.bytes)
            .finish_non_exhaustive()
    }
}

impl ForeignWorkspace {
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Work using this workspace is being captured into a CUDA graph: never free it.
    pub fn captured(&mut self) {
        self.captured = true;
    }
}

impl Drop for ForeignWorkspace {
    fn drop(&mut self) {
        if self.ptr == 0 || self.captured {
            return;
        }
        // SAFETY: `context` is the live context the memory was allocated in (a handle's user
        // destroys the mucudnn handle before the context, as the C ABI documents); push and
        // pop are paired; `ptr` came from cuMemAlloc and is freed exactly once, after every
        // stream of the context has finished with it.
        unsafe {
            if let Err(e) = drv_sys::cuCtxPushCurrent_v2(self.context).result() {
                warn_cleanup(
                    "freeing the mucudnn workspace (cuCtxPushCurrent)",
                    &super::driver_error("cuCtxPushCurrent", e),
                );
                return;
            }
            if let Err(e) = drv_sys::cuCtxSynchronize().result() {
                warn_cleanup(
                    "cuCtxSynchronize",
                    &super::driver_error("cuCtxSynchronize", e),
                );
            } else if let Err(e) = drv_sys::cuMemFree_v2(self.ptr).result() {
                warn_cleanup("cuMemFree", &super::driver_error("cuMemFree", e));
            }
            let mut popped = ptr::null_mut();
            if let Err(e) = drv_sys::cuCtxPopCurrent_v2(&mut popped).result() {
                warn_cleanup(
                    "cuCtxPopCurrent",
                    &super::driver_error("cuCtxPopCurrent", e),
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The caller's handle

type ForeignWorkspaceKey = (u64, ConvOp, u32);

/// A caller's cuDNN handle and CUDA stream, borrowed: mucudnn never destroys either. All work
/// goes to the stream, through the caller's handle, inside a [`ForeignSession`].
///
/// Holds raw pointers, so it is neither `Send` nor `Sync`; the C ABI moves it between threads
/// under its own rule (one thread at a time), which is also cuDNN's rule for the handle.
pub struct ForeignHandle {
    cudnn: dnn_sys::cudnnHandle_t,
    stream: drv_sys::CUstream,
    context: drv_sys::CUcontext,
    ordinal: usize,
    /// Workspace sizes by (descriptor id, op, algo).
    workspace_cache: RefCell<HashMap<ForeignWorkspaceKey, u64>>,
}

impl std::fmt::Debug for ForeignHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ForeignHandle")
            .field("device", &self.ordinal)
            .finish_non_exhaustive()
    }
}

impl ForeignHandle {
    /// Wraps a caller's cuDNN handle and stream. Errors, before touching either, when the CUDA
    /// driver, libcudnn or a GPU is missing ([`CudnnError::is_unavailable`]), when more than
    /// one libcudnn is loaded in the process, and for a null handle; then reads the stream's
    /// context and device and asks cuDNN for the handle's stream (a first sign of life).
    ///
    /// # Safety
    ///
    /// - `cudnn` is a `cudnnHandle_t` made by `cudnnCreate` of the libcudnn this process has
    ///   loaded (the check above refuses a second copy), for the stream's GPU, and it stays
    ///   alive, and unused by other threads during mucudnn's calls, for as long as the returned
    ///   value is used;
    /// - `stream` is null (the legacy default stream, with the device's context current on the
    ///   calling thread) or a `cudaStream_t`/`CUstream` that stays alive as long as the returned
    ///   value is used.
    pub unsafe fn new(cudnn_handle: *mut c_void, stream: *mut c_void) -> Result<Self, CudnnError> {
        const CALL: &str = "ForeignHandle::new";
        if cudnn_handle.is_null() {
            return Err(invalid(CALL, "the cuDNN handle is NULL".into()));
        }
        driver()?;
        cudnn()?;
        check_one_libcudnn()?;
        let stream: drv_sys::CUstream = stream.cast();
        // SAFETY: `stream` is null or live (this function's contract); the gate has passed.
        let (context, ordinal) = unsafe { stream_device(stream) }?;
        let handle = ForeignHandle {
            cudnn: cudnn_handle.cast(),
            stream,
            context,
            ordinal,
            workspace_cache: RefCell::new(HashMap::new()),
        };
        let mut current = ptr::null_mut();
        // SAFETY: `handle.cudnn` is a live handle of the loaded libcudnn (this function's
        // contract); one output pointer to a live local.
        unsafe { dnn_sys::cudnnGetStream(handle.cudnn, &mut current) }
            .result()
            .map_err(|e| super::status_error("cudnnGetStream", e.0))?;
        Ok(handle)
    }

    /// Sends later work to `stream` instead (which must be on the same GPU).
    ///
    /// # Safety
    ///
    /// As for the `stream` argument of [`ForeignHandle::new`].
    pub unsafe fn set_stream(&mut self, stream: *mut c_void) -> Result<(), CudnnError> {
        let stream: drv_sys::CUstream = stream.cast();
        // SAFETY: `stream` is null or live (this function's contract); the gates passed in `new`.
        let (context, ordinal) = unsafe { stream_device(stream) }?;
        if ordinal != self.ordinal {
            return Err(invalid(
                "ForeignHandle::set_stream",
                format!(
                    "the new stream is on GPU {ordinal}, the handle's on GPU {}: make a handle per GPU",
                    self.ordinal
                ),
            ));
        }
        self.stream = stream;
        self.context = context;
        Ok(())
    }

    /// The GPU's ordinal (as `cuDeviceGet` and [`super::CudnnHandle::new`] number them).
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Makes the stream's context current and sets the stream on the caller's cuDNN handle,
    /// until the session is dropped.
    pub fn activate(&self) -> Result<ForeignSession<'_>, CudnnError> {
        // SAFETY: `context` is the live context of the handle's stream (the contract of `new`).
        unsafe { drv_sys::cuCtxPushCurrent_v2(self.context) }
            .result()
            .map_err(drv_err("cuCtxPushCurrent"))?;
        // From here on, the session's Drop pops the context.
        let mut session = ForeignSession {
            handle: self,
            previous_stream: None,
        };
        let mut previous = ptr::null_mut();
        // SAFETY: `cudnn` is live and used by this thread alone (the contract of `new`); one
        // output pointer to a live local.
        unsafe { dnn_sys::cudnnGetStream(self.cudnn, &mut previous) }
            .result()
            .map_err(|e| super::status_error("cudnnGetStream", e.0))?;
        // SAFETY: as above; the stream is live and on the handle's GPU (the contract of `new`);
        // the cast only renames the opaque `CUstream_st` between cudarc's two bindings.
        unsafe { dnn_sys::cudnnSetStream(self.cudnn, self.stream.cast()) }
            .result()
            .map_err(|e| super::status_error("cudnnSetStream", e.0))?;
        session.previous_stream = Some(previous);
        Ok(session)
    }

    /// A workspace of `bytes` bytes in the stream's context (no allocation for 0).
    pub fn alloc_workspace(&self, bytes: u64) -> Result<ForeignWorkspace, CudnnError> {
        let mut workspace = ForeignWorkspace {
            ptr: 0,
            bytes: 0,
            context: self.context,
            captured: false,
        };
        if bytes == 0 {
            return Ok(workspace);
        }
        let len = usize::try_from(bytes).map_err(|_| {
            invalid(
                "ForeignHandle::alloc_workspace",
                format!("{bytes} bytes exceed the address space"),
            )
        })?;
        let _session = self.activate()?;
        let mut ptr: drv_sys::CUdeviceptr = 0;
        // SAFETY: the stream's context is current (the session); one output to a live local.
        unsafe { drv_sys::cuMemAlloc_v2(&mut ptr, len) }
            .result()
            .map_err(drv_err("cuMemAlloc"))?;
        workspace.ptr = ptr;
        workspace.bytes = bytes;
        Ok(workspace)
    }

    /// Waits for the work queued on the stream.
    pub fn synchronize(&self) -> Result<(), CudnnError> {
        let _session = self.activate()?;
        // SAFETY: the stream is live (the contract of `new`), its context current.
        unsafe { drv_sys::cuStreamSynchronize(self.stream) }
            .result()
            .map_err(drv_err("cuStreamSynchronize"))
    }
}

/// The caller's stream's context made current and the stream set on the caller's cuDNN handle;
/// both are put back on drop. Made by [`ForeignHandle::activate`].
pub struct ForeignSession<'a> {
    handle: &'a ForeignHandle,
    /// The cuDNN handle's stream before the session, once it has been replaced.
    previous_stream: Option<dnn_sys::cudaStream_t>,
}

impl std::fmt::Debug for ForeignSession<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ForeignSession").finish_non_exhaustive()
    }
}

impl Drop for ForeignSession<'_> {
    fn drop(&mut self) {
        if let Some(previous) = self.previous_stream {
            // SAFETY: the handle is live (the contract of `ForeignHandle::new`); `previous` is
            // the stream it had when the session began.
            if let Err(e) = unsafe { dnn_sys::cudnnSetStream(self.handle.cudnn, previous) }.result()
            {
                warn_cleanup(
                    "restoring the cuDNN handle's stream",
                    &super::status_error("cudnnSetStream", e.0),
                );
            }
        }
        let mut popped = ptr::null_mut();
        // SAFETY: pairs with the push in `ForeignHandle::activate`.
        if let Err(e) = unsafe { drv_sys::cuCtxPopCurrent_v2(&mut popped) }.result() {
            warn_cleanup(
                "cuCtxPopCurrent",
                &super::driver_error("cuCtxPopCurrent", e),
            );
        }
    }
}

/// `CU_POINTER_ATTRIBUTE_*` of one address, as a 4-byte integer.
fn pointer_attribute(
    attribute: drv_sys::CUpointer_attribute,
    address: u64,
) -> Result<u32, cudarc::driver::DriverError> {
    let mut value: u32 = 0;
    // SAFETY: a query only; for MEMORY_TYPE (an unsigned enum) and DEVICE_ORDINAL (an int) the
    // driver writes 4 bytes into the live local. Any address may be asked about.
    unsafe { drv_sys::cuPointerGetAttribute(ptr::from_mut(&mut value).cast(), attribute, address) }
        .result()?;
    Ok(value)
}

impl ForeignSession<'_> {
    /// Whether the caller's stream is being captured into a CUDA graph
    /// (`cuStreamIsCapturing`: active, or invalidated and not yet ended).
    pub fn is_capturing(&self) -> Result<bool, CudnnError> {
        let mut status = drv_sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: the stream is live (the contract of `ForeignHandle::new`), its context
        // current (the session); the status is written to a local.
        unsafe { drv_sys::cuStreamIsCapturing(self.handle.stream, &mut status) }
            .result()
            .map_err(drv_err("cuStreamIsCapturing"))?;
        Ok(status != drv_sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// Checks what can be checked of a caller's memory: the output overlaps neither input, and
    /// the first and last byte of every operand is device (or managed) memory CUDA knows,
    /// device memory on the handle's GPU. (Whether the bytes in between belong to the
    /// tensor the caller meant cannot be known.)
    pub fn check_memory(
        &self,
        call: &'static str,
        inputs: [(&str, &RawDeviceView<'_>); 2],
        output: (&str, &RawDeviceViewMut<'_>),
    ) -> Result<(), CudnnError> {
        use drv_sys::CUmemorytype as M;
        use drv_sys::CUpointer_attribute as A;
        let operands = [
            (inputs[0].0, inputs[0].1.byte_range()),
            (inputs[1].0, inputs[1].1.byte_range()),
            (output.0, output.1.byte_range()),
        ];
        // Overlaps first: pure arithmetic, and an overlapping output may run past every
        // allocation, which the queries below would report less clearly.
        let (out_start, out_end) = operands[2].1;
        for (name, (start, end)) in &operands[..2] {
            if *start < out_end && out_start < *end {
                return Err(invalid(
                    call,
                    format!(
                        "{} overlaps {name}: cuDNN needs a separate output",
                        output.0
                    ),
                ));
            }
        }
        for (name, (start, end)) in operands {
            for address in [start, end - 1] {
                let kind = pointer_attribute(A::CU_POINTER_ATTRIBUTE_MEMORY_TYPE, address)
                    .map_err(|e| {
                        invalid(
                            call,
                            format!(
                                "{name}: address {address:#x} (of [{start:#x}, {end:#x})) is not \
                                 memory that CUDA knows ({}): pass device memory holding the \
                                 whole tensor",
                                super::describe_driver_error(&e).0
                            ),
                        )
                    })?;
                if kind == M::CU_MEMORYTYPE_HOST as u32 {
                    return Err(invalid(
                        call,
                        format!(
                            "{name}: {address:#x} is pinned host memory: pass device memory \
                             holding the whole tensor"
                        ),
                    ));
                }
                if kind == M::CU_MEMORYTYPE_DEVICE as u32 {
                    let ordinal =
                        pointer_attribute(A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, address)
                            .map_err(drv_err("cuPointerGetAttribute"))?;
                    if ordinal as usize != self.handle.ordinal {
                        return Err(invalid(
                            call,
                            format!(
                                "{name}: {address:#x} is memory of GPU {ordinal}, the handle's \
                                 stream is on GPU {}",
                                self.handle.ordinal
                            ),
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// Workspace bytes that legacy algorithm `algo` of `op` needs for `d`, or `None` when cuDNN
    /// answers `CUDNN_STATUS_NOT_SUPPORTED*`. Cached per (descriptors, op, algo).
    pub fn workspace_size(
        &self,
        d: &ConvDescriptors,
        op: ConvOp,
        algo: u32,
    ) -> Result<Option<u64>, CudnnError> {
        super::declined_as_none(self.query_workspace(d, op, algo))
    }

    fn query_workspace(
        &self,
        d: &ConvDescriptors,
        op: ConvOp,
        algo: u32,
    ) -> Result<u64, CudnnError> {
        let key = (d.id, op, algo);
        if let Some(&bytes) = self.handle.workspace_cache.borrow().get(&key) {
            return Ok(bytes);
        }
        let which = Algo::checked("ForeignSession::workspace_size", op, algo)?;
        // SAFETY: the caller's handle is live and used by this thread alone (the contract of
        // `ForeignHandle::new`); the cuDNN gate passed there.
        let bytes = unsafe { raw_workspace_size(self.handle.cudnn, d, op, algo, which) }?;
        self.handle.workspace_cache.borrow_mut().insert(key, bytes);
        Ok(bytes)
    }

    /// Runs legacy algorithm `algo` of `op` on the caller's handle and stream (asynchronously):
    /// `out = alpha * op(a, b) + beta * out`, operands as for [`super::Surface::convolve`],
    /// each with exactly the dtype and element count `d` describes for its role, and the
    /// workspace at least what cuDNN asks for (checked; violations are
    /// [`CudnnError::InvalidArgument`]).
    pub fn convolve<O: Origin>(
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

    /// `workspace` as the workspace of this session's calls: it must have been allocated in the
    /// context of the handle's stream (checked).
    pub fn workspace<'w>(
        &self,
        workspace: &'w mut ForeignWorkspace,
    ) -> Result<RawWorkspace<'w>, CudnnError> {
        if workspace.ptr == 0 {
            return Ok(RawWorkspace::empty());
        }
        if workspace.context != self.handle.context {
            return Err(invalid(
                Self::CONVOLVE,
                "the workspace belongs to another CUDA context".into(),
            ));
        }
        // The allocation lives as long as `workspace` (freed on drop after its context's work
        // has finished), which the view borrows mutably.
        Ok(RawWorkspace::with_origin(
            workspace.ptr,
            workspace.bytes,
            Raw,
        ))
    }
}

impl Site for ForeignSession<'_> {
    const CONVOLVE: &'static str = "ForeignSession::convolve";
    const EXECUTE: &'static str = "ForeignSession::execute_engine";
    const SCALE: &'static str = "ForeignSession::scale_view";

    fn raw(&self) -> dnn_sys::cudnnHandle_t {
        self.handle.cudnn
    }

    fn orders(&self, stream: &cudarc::driver::CudaStream) -> bool {
        stream.cu_stream() == self.handle.stream
    }

    fn enter(&self) -> Result<(), CudnnError> {
        // `activate` made the stream's context current and set the stream on the handle.
        Ok(())
    }

    fn required_workspace(
        &self,
        d: &ConvDescriptors,
        op: ConvOp,
        algo: u32,
    ) -> Result<u64, CudnnError> {
        self.query_workspace(d, op, algo)
    }

    fn built(&self, _plan: &super::EnginePlan) -> bool {
        // Engine plans are built on mucudnn's own handles only.
        false
    }
}

#[cfg(test)]
mod tests {
    use super::libcudnn_files_in;

    const LINE: &str = "7f0000000000-7f0000001000 r-xp 00000000 08:01";

    fn maps(entries: &[(&str, &str)]) -> String {
        entries
            .iter()
            .map(|(inode, path)| format!("{LINE} {inode}                    {path}\n"))
            .collect()
    }

    #[test]
    fn one_file_mapped_several_times_is_one_copy() {
        let text = maps(&[
            ("11", "/venv/nvidia/cudnn/lib/libcudnn.so.9"),
            ("11", "/venv/nvidia/cudnn/lib/libcudnn.so.9"),
            ("12", "/venv/nvidia/cudnn/lib/libcudnn_graph.so.9"),
            ("13", "/usr/lib/libc.so.6"),
        ]);
        let files = libcudnn_files_in(&text);
        assert_eq!(files.len(), 1, "{files:?}");
        assert_eq!(files[0].1, "/venv/nvidia/cudnn/lib/libcudnn.so.9");
    }

    #[test]
    fn two_files_are_two_copies_whatever_their_names() {
        let text = maps(&[
            ("11", "/venv/nvidia/cudnn/lib/libcudnn.so.9"),
            ("21", "/usr/lib/x86_64-linux-gnu/libcudnn.so.9.14.0"),
            ("22", "/opt/my cudnn/libcudnn.so"),
        ]);
        let files = libcudnn_files_in(&text);
        let paths: Vec<&str> = files.iter().map(|(_, p)| p.as_str()).collect();
        assert_eq!(
            paths,
            [
                "/venv/nvidia/cudnn/lib/libcudnn.so.9",
                "/usr/lib/x86_64-linux-gnu/libcudnn.so.9.14.0",
                "/opt/my cudnn/libcudnn.so"
            ]
        );
    }

    #[test]
    fn anonymous_and_other_mappings_are_not_cudnn() {
        let text = format!(
            "{LINE} 0\n{}",
            maps(&[("5", "/lib/libcudnnx.so"), ("6", "[heap]")])
        );
        assert!(libcudnn_files_in(&text).is_empty());
    }
}
