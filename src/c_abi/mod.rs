//! The C ABI (`include/mucudnn.h`, generated from this module by cbindgen; see docs/C_ABI.md).
//!
//! Two halves:
//!
//! - a pure solver entry point, `mucudnnSolveProfile`: a profile in the interchange format and
//!   JSON options in, the `mucudnn solve --json` document out; it needs no GPU;
//! - a handle over the caller's own cuDNN handle and CUDA stream (`mucudnnCreate`), with drop-in
//!   `mucudnnConvolutionForward` / `BackwardData` / `BackwardFilter` that take cuDNN's arguments
//!   in cuDNN's order. A call reads the caller's descriptors, tunes on first sight of a
//!   (problem, op) and runs the plan as one cuDNN call per micro-batch on the caller's handle,
//!   stream and device pointers ([`handle`]).
//!
//! Every entry point returns a [`mucudnnStatus_t`] and leaves a message for
//! `mucudnnGetLastError`; its body runs under [`error::guard`], so no panic crosses into C
//! (a panic is `MUCUDNN_STATUS_INTERNAL_ERROR`). Raw pointers are checked for null, strings
//! for UTF-8, enum-like integers for range, handles against a registry of live handles (a
//! handle is a token, never an address: [`registry`]); what
//! cannot be checked (that a non-null pointer really is what the header says) is the C
//! caller's side of the contract, stated on each function. This module names no cudarc item:
//! it reaches cuDNN only through the FFI wall (`crate::backend::cudnn`).
//!
//! The doc comments below are C documentation: cbindgen copies them into the header.

#![allow(non_camel_case_types, non_snake_case)]

mod descriptors;
pub(crate) mod error;
pub(crate) mod handle;
mod json;
mod registry;
mod solve;
mod torch;
pub(crate) mod tuner;

/// The caller's descriptors (as the FFI wall reads them) to a problem: for the cuDNN host tier,
/// which reads mucudnn's own legacy descriptors back through it.
#[doc(hidden)]
pub use descriptors::problem_from_descriptors;

use crate::backend::cudnn::{library_status, probe, ForeignHandle};
use crate::backend::TimingSettings;
use crate::solver::{
    CandidateSet, ConvOp, ConvProblem, DeviceFingerprint, IndexLimit, Plan, Policy,
};
use crate::tune::{EngineOptions, LayerTuning, MeasureTask, MeasuredTask, SplitSetting};
use error::{
    guard, invalid, last_error_ptr, optional_str_arg, out_arg, owned_c_string, set_last_error,
    str_arg, FfiError,
};
use handle::{Handle, RawDescriptors, RawOperands, Settings};
use registry::Registry;
use std::ffi::{c_char, c_void, CStr, CString};
use std::path::PathBuf;
use std::sync::OnceLock;

// ---------------------------------------------------------------------------------------------
// Types

/// What every mucudnn function that can fail returns. On anything but
/// MUCUDNN_STATUS_SUCCESS, mucudnnGetLastError() says what happened, naming the function, the
/// argument or layer, and the cause.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum mucudnnStatus_t {
    MUCUDNN_STATUS_SUCCESS = 0,
    /// A NULL pointer, an out-of-range value, invalid UTF-8, bad options, a stale handle, a
    /// handle in use by another thread, descriptors that do not make one convolution, memory
    /// that is not device memory of the handle's GPU.
    MUCUDNN_STATUS_INVALID_ARGUMENT = 1,
    /// No NVIDIA driver (libcuda), no cuDNN 9 (libcudnn), no usable GPU, a driver older than
    /// CUDA 13, or two different libcudnn loaded in one process; or the tuning cache cannot be
    /// opened because the process is out of file descriptors (never a quiet in-memory cache).
    MUCUDNN_STATUS_NOT_AVAILABLE = 2,
    /// A convolution cuDNN could run but mucudnn does not: not fully packed NCHW/NHWC, double
    /// or integer data, CUDNN_CONVOLUTION mode, a non-float compute type.
    MUCUDNN_STATUS_NOT_SUPPORTED = 3,
    /// A cuDNN call failed (the message has the cuDNN status name and number).
    MUCUDNN_STATUS_CUDNN_ERROR = 4,
    /// A CUDA driver call failed (the message has the CUresult name and number).
    MUCUDNN_STATUS_CUDA_ERROR = 5,
    /// Device memory ran out (for the workspace, or while tuning).
    MUCUDNN_STATUS_OUT_OF_MEMORY = 6,
    /// No plan exists: no micro-batching fits the workspace limit (the message names the
    /// smallest limit that works), or a workspace-division budget is too small.
    MUCUDNN_STATUS_SOLVER_ERROR = 7,
    /// The profile JSON is malformed or inconsistent (the message names the record and field).
    MUCUDNN_STATUS_BAD_PROFILE = 8,
    /// A bug in mucudnn, a panic included; please report the message.
    MUCUDNN_STATUS_INTERNAL_ERROR = 9,
    /// mucudnnTunerPrepare: cuDNN will not build one micro-batch of a plan here (an engine
    /// configuration at the byte alignment of the micro-batch's offset, or a legacy algorithm
    /// at its size). Nothing was prepared; run this convolution another way (the PyTorch
    /// package falls back to PyTorch's convolution with a warning).
    MUCUDNN_STATUS_PLAN_NOT_SUPPORTED = 10,
}

/// The three convolution operations: one of the MUCUDNN_OP_* values.
pub type mucudnnConvOp_t = i32;
/// y = conv(x, w) (cudnnConvolutionForward).
pub const MUCUDNN_OP_FORWARD: mucudnnConvOp_t = 0;
/// dx = conv_transpose(dy, w) (cudnnConvolutionBackwardData).
pub const MUCUDNN_OP_BACKWARD_DATA: mucudnnConvOp_t = 1;
/// dw = sum over the batch of correlate(x, dy) (cudnnConvolutionBackwardFilter).
pub const MUCUDNN_OP_BACKWARD_FILTER: mucudnnConvOp_t = 2;

/// Which micro-batch sizes a plan may use: one of the MUCUDNN_POLICY_* values.
pub type mucudnnPolicy_t = i32;
/// Only the whole mini-batch: the best single algorithm within the limit.
pub const MUCUDNN_POLICY_UNDIVIDED: mucudnnPolicy_t = 0;
/// 1, 2, 4, ... and the mini-batch size itself (the default).
pub const MUCUDNN_POLICY_POWER_OF_TWO: mucudnnPolicy_t = 1;
/// Every size from 1 to the mini-batch size (slowest to tune).
pub const MUCUDNN_POLICY_ALL: mucudnnPolicy_t = 2;

/// The version of this header: 10000 * major + 100 * minor + patch of mucudnn's one version
/// (the crate's, the Python package's: Cargo.toml's `[workspace.package] version`; compare
/// with mucudnnGetVersion()).
pub const MUCUDNN_VERSION: u32 = 100;

/// The version of the C ABI this header describes: raised when a function's signature or a
/// struct's layout changes incompatibly, or functions a binding needs are added (3: the
/// mucudnnTorch* functions), independent of the package version (compare with
/// mucudnnGetAbiVersion()).
pub const MUCUDNN_ABI_VERSION: u32 = 3;

/// The mucudnnOptions_t layout this header describes.
pub const MUCUDNN_OPTIONS_VERSION: u32 = 1;

/// A workspace size meaning "no limit".
pub const MUCUDNN_NO_LIMIT: u64 = u64::MAX;

/// The default per-layer workspace limit (mucudnnOptionsInit, mucudnnSolveProfile): 64 MiB,
/// as `mucudnn solve`.
pub const MUCUDNN_DEFAULT_WORKSPACE_LIMIT: u64 = 67_108_864;

/// How a handle tunes. Fill it with mucudnnOptionsInit(), then change fields; a NULL options
/// pointer means the defaults.
///
/// Forward compatibility: `size` and `version` say which layout the caller compiled against.
/// A later library reads a struct from an earlier header by its size (fields it lacks get
/// their defaults); a struct from a newer header than the library is refused.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct mucudnnOptions_t {
    /// sizeof(mucudnnOptions_t) as the caller compiled it.
    pub size: u32,
    /// MUCUDNN_OPTIONS_VERSION as the caller compiled it.
    pub version: u32,
    /// The tuning cache file (UTF-8 path), or NULL for the default location ($MUCUDNN_CACHE,
    /// else $XDG_CACHE_HOME/mucudnn/cache.sqlite, else ~/.cache/mucudnn/cache.sqlite). Copied
    /// by mucudnnCreate. Measurements are read from and stored into it, so a (problem, op)
    /// seen before on this device (by any process) is not profiled again. A cache that cannot
    /// be opened or written never fails a call: it warns on stderr and works in memory; but a
    /// process out of file descriptors is MUCUDNN_STATUS_NOT_AVAILABLE (not a cache in
    /// memory that would quietly keep nothing), and a file that is not a mucudnn cache is
    /// MUCUDNN_STATUS_INVALID_ARGUMENT (left untouched).
    pub cache_path: *const c_char,
    /// A MUCUDNN_POLICY_* value (default MUCUDNN_POLICY_POWER_OF_TWO).
    pub policy: mucudnnPolicy_t,
    /// Non-zero: print one line to stderr per micro-batch size measured and per plan made.
    pub verbose: i32,
    /// The workspace each (layer, op) plan may use, in bytes (default
    /// MUCUDNN_DEFAULT_WORKSPACE_LIMIT; MUCUDNN_NO_LIMIT for none).
    pub workspace_limit_bytes: u64,
    /// A budget for the handle's whole workspace, in bytes (default MUCUDNN_NO_LIMIT). The
    /// handle runs one convolution at a time on one workspace buffer, sized to its largest
    /// plan, so the budget is met by solving every plan within it: plans are solved under
    /// min(workspace_limit_bytes, total_workspace_bytes). Workspace division (layers holding
    /// separate workspaces that share a budget, `mucudnn solve --total-workspace`) is not done
    /// by a handle.
    pub total_workspace_bytes: u64,
}

impl Default for mucudnnOptions_t {
    fn default() -> Self {
        mucudnnOptions_t {
            size: std::mem::size_of::<mucudnnOptions_t>() as u32,
            version: MUCUDNN_OPTIONS_VERSION,
            cache_path: std::ptr::null(),
            policy: MUCUDNN_POLICY_POWER_OF_TWO,
            verbose: 0,
            workspace_limit_bytes: MUCUDNN_DEFAULT_WORKSPACE_LIMIT,
            total_workspace_bytes: MUCUDNN_NO_LIMIT,
        }
    }
}

/// What a mucudnnHandle_t points to (opaque).
pub struct mucudnnContext {
    handle: Handle,
}

/// A mucudnn handle: the caller's cuDNN handle and stream, the plans tuned so far, and one
/// workspace. Made by mucudnnCreate, freed by mucudnnDestroy. Used by one thread at a time
/// (a second thread's concurrent call fails with MUCUDNN_STATUS_INVALID_ARGUMENT); it may move
/// between threads. The value is an opaque token, not an address: never reused in a process,
/// so a destroyed handle (even when a new one is made after it) or a made-up value is
/// MUCUDNN_STATUS_INVALID_ARGUMENT, never another handle.
pub type mucudnnHandle_t = *mut mucudnnContext;

/// cuDNN's handle struct (opaque; declared so that this header does not need cudnn.h).
pub struct cudnnContext {
    _opaque: [u8; 0],
}
/// cuDNN's tensor descriptor struct (opaque).
pub struct cudnnTensorStruct {
    _opaque: [u8; 0],
}
/// cuDNN's filter descriptor struct (opaque).
pub struct cudnnFilterStruct {
    _opaque: [u8; 0],
}
/// cuDNN's convolution descriptor struct (opaque).
pub struct cudnnConvolutionStruct {
    _opaque: [u8; 0],
}
/// CUDA's stream struct (opaque).
pub struct CUstream_st {
    _opaque: [u8; 0],
}

/// The same type as cuDNN's cudnnHandle_t (struct cudnnContext *): pass a cudnnHandle_t as is.
pub type mucudnnCudnnHandle_t = *mut cudnnContext;
/// The same type as cudnnTensorDescriptor_t (struct cudnnTensorStruct *).
pub type mucudnnTensorDescriptor_t = *mut cudnnTensorStruct;
/// The same type as cudnnFilterDescriptor_t (struct cudnnFilterStruct *).
pub type mucudnnFilterDescriptor_t = *mut cudnnFilterStruct;
/// The same type as cudnnConvolutionDescriptor_t (struct cudnnConvolutionStruct *).
pub type mucudnnConvolutionDescriptor_t = *mut cudnnConvolutionStruct;
/// The same type as cudaStream_t and CUstream (struct CUstream_st *); NULL is the legacy
/// default stream.
pub type mucudnnStream_t = *mut CUstream_st;

/// The live handles.
static HANDLES: Registry<mucudnnContext> = Registry::new("handle");

// ---------------------------------------------------------------------------------------------
// Argument helpers

fn conv_op_arg(op: mucudnnConvOp_t) -> Result<ConvOp, FfiError> {
    match op {
        MUCUDNN_OP_FORWARD => Ok(ConvOp::Forward),
        MUCUDNN_OP_BACKWARD_DATA => Ok(ConvOp::BackwardData),
        MUCUDNN_OP_BACKWARD_FILTER => Ok(ConvOp::BackwardFilter),
        other => Err(invalid(format!(
            "op is {other}; expected MUCUDNN_OP_FORWARD (0), MUCUDNN_OP_BACKWARD_DATA (1) or \
             MUCUDNN_OP_BACKWARD_FILTER (2)"
        ))),
    }
}

fn policy_arg(policy: mucudnnPolicy_t) -> Result<Policy, FfiError> {
    match policy {
        MUCUDNN_POLICY_UNDIVIDED => Ok(Policy::Undivided),
        MUCUDNN_POLICY_POWER_OF_TWO => Ok(Policy::PowerOfTwo),
        MUCUDNN_POLICY_ALL => Ok(Policy::All),
        other => Err(invalid(format!(
            "options->policy is {other}; expected MUCUDNN_POLICY_UNDIVIDED (0), \
             MUCUDNN_POLICY_POWER_OF_TWO (1) or MUCUDNN_POLICY_ALL (2)"
        ))),
    }
}

fn layer_arg(layer_id: i64) -> Result<Option<i64>, FfiError> {
    match layer_id {
        -1 => Ok(None),
        id if id >= 0 => Ok(Some(id)),
        other => Err(invalid(format!(
            "layer_id is {other}; give a layer number >= 0, or -1 for none"
        ))),
    }
}

/// A host scaling factor (`alpha` or `beta`): a float, as cuDNN takes for float, half and
/// bfloat16 data.
///
/// # Safety
///
/// `ptr` is null (an error) or points to a readable `float`.
unsafe fn scalar_arg(ptr: *const c_void, name: &str) -> Result<f32, FfiError> {
    if ptr.is_null() {
        return Err(invalid(format!(
            "{name} is NULL (it points to a host float, as in cuDNN)"
        )));
    }
    // SAFETY: non-null and pointing to a float (this function's contract); an unaligned read
    // tolerates any address.
    Ok(unsafe { ptr.cast::<f32>().read_unaligned() })
}

/// The settings a handle is made with, from a caller's options (NULL: the defaults).
///
/// # Safety
///
/// `options` is null or points to a `mucudnnOptions_t` of at least `options->size` bytes whose
/// `cache_path` is null or a NUL-terminated string.
unsafe fn settings_arg(options: *const mucudnnOptions_t) -> Result<Settings, FfiError> {
    let options = if options.is_null() {
        mucudnnOptions_t::default()
    } else {
        // SAFETY: `options` points to at least the `size` field (this function's contract).
        let size = unsafe { options.cast::<u32>().read_unaligned() } as usize;
        let ours = std::mem::size_of::<mucudnnOptions_t>();
        if size < ours {
            return Err(invalid(format!(
                "options->size is {size}, but this library's mucudnnOptions_t has {ours} bytes: \
                 fill the options with mucudnnOptionsInit()"
            )));
        }
        // SAFETY: the struct has at least `size >= ours` readable bytes (the contract).
        let options = unsafe { options.read_unaligned() };
        if options.version == 0 || options.version > MUCUDNN_OPTIONS_VERSION {
            return Err(invalid(format!(
                "options->version is {}, but this library reads mucudnnOptions_t versions 1 to \
                 {MUCUDNN_OPTIONS_VERSION}: fill the options with mucudnnOptionsInit()",
                options.version
            )));
        }
        options
    };
    let policy = policy_arg(options.policy)?;
    // SAFETY: `cache_path` is null or NUL-terminated (the contract); it is copied at once.
    let cache_path = unsafe { optional_str_arg(options.cache_path, "options->cache_path") }?;
    if cache_path == Some("") {
        return Err(invalid(
            "options->cache_path is empty; pass NULL for the default cache location",
        ));
    }
    let size = |bytes: u64| (bytes != MUCUDNN_NO_LIMIT).then_some(bytes);
    let workspace_limit_bytes = size(options.workspace_limit_bytes);
    let total_workspace_bytes = size(options.total_workspace_bytes);
    Ok(Settings {
        tuning: LayerTuning {
            policy,
            workspace_limit_bytes: Settings::effective_limit(
                workspace_limit_bytes,
                total_workspace_bytes,
            ),
            timing: TimingSettings::GPU,
            // Plans run on the caller's cuDNN handle through the legacy API; engine
            // configurations are not offered through the C ABI yet.
            candidates: CandidateSet::Legacy,
            engines: EngineOptions::default(),
            // The handle executes batch plans only (no spatial chunks on a caller's handle).
            split: SplitSetting::Batch,
            index_limit: IndexLimit::CUDNN,
            verify: true,
        },
        workspace_limit_bytes,
        total_workspace_bytes,
        cache_path: cache_path.map(PathBuf::from),
        verbose: options.verbose != 0,
    })
}

/// Hands `text` to the caller's `out` slot as an owned string.
fn give_string(out: &mut *mut c_char, text: &str) {
    *out = owned_c_string(text);
}

// ---------------------------------------------------------------------------------------------
// Library information and errors

/// The library's version: 10000 * major + 100 * minor + patch (MUCUDNN_VERSION of the header it
/// was built with), the same version as the crate's and the Python package's (0.1.0 is 100).
/// Thread-safe; never fails.
#[no_mangle]
pub extern "C" fn mucudnnGetVersion() -> u32 {
    const fn parse(text: &str) -> u32 {
        let bytes = text.as_bytes();
        let mut value = 0;
        let mut i = 0;
        while i < bytes.len() {
            value = value * 10 + (bytes[i] - b'0') as u32;
            i += 1;
        }
        value
    }
    const VERSION: u32 = parse(env!("CARGO_PKG_VERSION_MAJOR")) * 10_000
        + parse(env!("CARGO_PKG_VERSION_MINOR")) * 100
        + parse(env!("CARGO_PKG_VERSION_PATCH"));
    VERSION
}

/// The version of the C ABI the library implements (MUCUDNN_ABI_VERSION of the header it was
/// built with); a program built against another ABI version should not call it. Thread-safe;
/// never fails.
#[no_mangle]
pub extern "C" fn mucudnnGetAbiVersion() -> u32 {
    MUCUDNN_ABI_VERSION
}

/// What this build is, as one line of text: crate version, cargo features, the CUDA/cuDNN
/// bindings (cudarc, CUDA 13.0 driver API, cuDNN 9 loaded at run time), target and profile.
/// A static string: do not free it. Thread-safe; never fails.
#[no_mangle]
pub extern "C" fn mucudnnGetBuildInfo() -> *const c_char {
    static INFO: OnceLock<CString> = OnceLock::new();
    INFO.get_or_init(|| {
        error::c_string_lossless(&format!(
            "mucudnn {} (features: highs={}; bindings: cudarc 0.19, CUDA 13.0 driver API \
             (cuda-13000), cuDNN 9 legacy convolution API, libcuda and libcudnn loaded at run \
             time; target {}-{}; {} build)",
            env!("CARGO_PKG_VERSION"),
            if cfg!(feature = "highs") { "on" } else { "off" },
            std::env::consts::ARCH,
            std::env::consts::OS,
            if cfg!(debug_assertions) {
                "debug"
            } else {
                "release"
            },
        ))
    })
    .as_ptr()
}

/// The name of a status, e.g. "MUCUDNN_STATUS_NOT_AVAILABLE"
/// ("MUCUDNN_STATUS_UNKNOWN" for a value that is none). A static string: do not free it.
/// Thread-safe; never fails.
#[no_mangle]
pub extern "C" fn mucudnnGetStatusString(status: i32) -> *const c_char {
    let name: &'static CStr = match status {
        0 => c"MUCUDNN_STATUS_SUCCESS",
        1 => c"MUCUDNN_STATUS_INVALID_ARGUMENT",
        2 => c"MUCUDNN_STATUS_NOT_AVAILABLE",
        3 => c"MUCUDNN_STATUS_NOT_SUPPORTED",
        4 => c"MUCUDNN_STATUS_CUDNN_ERROR",
        5 => c"MUCUDNN_STATUS_CUDA_ERROR",
        6 => c"MUCUDNN_STATUS_OUT_OF_MEMORY",
        7 => c"MUCUDNN_STATUS_SOLVER_ERROR",
        8 => c"MUCUDNN_STATUS_BAD_PROFILE",
        9 => c"MUCUDNN_STATUS_INTERNAL_ERROR",
        10 => c"MUCUDNN_STATUS_PLAN_NOT_SUPPORTED",
        _ => c"MUCUDNN_STATUS_UNKNOWN",
    };
    name.as_ptr()
}

/// The message of the last mucudnn call on this thread: empty after a success (except for a
/// warning that mucudnnSolveProfile may leave), the reason after a failure. Never NULL.
/// The string belongs to mucudnn and stays valid until the next mucudnn call on the same
/// thread (other than this one and the static-string functions); copy it to keep it.
/// Each thread has its own message.
#[no_mangle]
pub extern "C" fn mucudnnGetLastError() -> *const c_char {
    last_error_ptr()
}

/// Frees a string that mucudnn returned through a `char**` argument (mucudnnSolveProfile,
/// mucudnnProbe, mucudnnGetPlansJson). NULL is ignored.
///
/// # Safety
///
/// `text` is NULL or a string returned that way and not yet freed; never a string from
/// anywhere else (not the static strings, not mucudnnGetLastError()).
#[no_mangle]
pub unsafe extern "C" fn mucudnnFreeString(text: *mut c_char) {
    if text.is_null() {
        return;
    }
    let free = move || {
        // SAFETY: `text` came from `CString::into_raw` in `owned_c_string` and is freed once
        // (this function's contract).
        drop(unsafe { CString::from_raw(text) });
    };
    // Freeing cannot panic; if it ever did, the panic must still not reach C.
    let _ = std::panic::catch_unwind(free);
}

/// Describes the CUDA driver, cuDNN and the GPUs mucudnn can use, as JSON:
/// {"driver_version": 13000, "cudnn_version": 91900, "cudnn_cudart_version": ...,
///  "devices": [{"ordinal": 0, "name": ..., "compute_capability": [9, 0], ...}],
///  "libraries": {"libcuda": true, "libcudnn": true}}.
/// On success `*info_json_out` is a string to free with mucudnnFreeString(); otherwise it is
/// NULL and the status is MUCUDNN_STATUS_NOT_AVAILABLE (with what is missing, and what to
/// install, in mucudnnGetLastError()). Thread-safe.
///
/// # Safety
///
/// `info_json_out` is NULL (an error) or valid for writing one pointer.
#[no_mangle]
pub unsafe extern "C" fn mucudnnProbe(info_json_out: *mut *mut c_char) -> mucudnnStatus_t {
    guard("mucudnnProbe", || {
        // SAFETY: this function's contract.
        let out = unsafe { out_arg(info_json_out, "info_json_out", std::ptr::null_mut()) }?;
        let info = probe()?;
        let mut doc = serde_json::to_value(&info)
            .map_err(|e| FfiError::Internal(format!("writing the probe: {e}")))?;
        doc["libraries"] = serde_json::to_value(library_status())
            .map_err(|e| FfiError::Internal(format!("writing the probe: {e}")))?;
        give_string(out, &doc.to_string());
        Ok(())
    })
}

/// A byte size from text, as the CLI and mucudnnSolveProfile read it: a number of bytes or a
/// number with `KiB`, `MiB`, `GiB`, `TiB` (or `K`, `M`, `G`, `T`; powers of 1024). Decimal
/// suffixes (`MB`) are refused as ambiguous. Thread-safe.
///
/// # Safety
///
/// `text` is NULL (an error) or NUL-terminated; `bytes_out` is NULL (an error) or valid for
/// writing one uint64_t.
#[no_mangle]
pub unsafe extern "C" fn mucudnnParseSize(
    text: *const c_char,
    bytes_out: *mut u64,
) -> mucudnnStatus_t {
    guard("mucudnnParseSize", || {
        // SAFETY: this function's contract.
        let out = unsafe { out_arg(bytes_out, "bytes_out", 0) }?;
        // SAFETY: this function's contract.
        let text = unsafe { str_arg(text, "text") }?;
        *out = crate::solver::units::parse_size(text).map_err(invalid)?;
        Ok(())
    })
}

/// The version of the libcudnn mucudnn uses (cudnnGetVersion(), e.g. 92600 for 9.26.0),
/// loading it if it is not loaded yet; needs no GPU and no libcuda. mucudnn looks for
/// `libcudnn.so`, then `libcudnn.so.9`, through the dynamic loader's search (LD_LIBRARY_PATH,
/// the library's RUNPATH, the system's folders); a libcudnn already loaded under the same file
/// is shared. MUCUDNN_STATUS_NOT_AVAILABLE when none is found or it is not cuDNN 9.
///
/// # Safety
///
/// `version_out` is NULL (an error) or valid for writing one uint64_t.
#[no_mangle]
pub unsafe extern "C" fn mucudnnGetCudnnVersion(version_out: *mut u64) -> mucudnnStatus_t {
    guard("mucudnnGetCudnnVersion", || {
        // SAFETY: this function's contract.
        let out = unsafe { out_arg(version_out, "version_out", 0) }?;
        *out = crate::backend::cudnn::cudnn_version()?;
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------------
// The pure solver

/// Solves a profile, without a GPU: the same plans, and the same JSON document, as
/// `mucudnn solve --profile FILE --json`.
///
/// `profile_json`: measurements in the mucudnn-profile-v1 interchange format (as written by
/// `mucudnn tune --save-profile`; see docs/PROFILE_FORMAT.md). UTF-8.
///
/// `options_json`: NULL for the defaults, or a JSON object with any of
///   "policy": "undivided" | "power-of-two" (default) | "all",
///   "workspace_limit": bytes or a string like "64MiB" (workspace reuse: a per-layer limit;
///                      the default is 64 MiB),
///   "total_workspace": bytes or "1GiB" (workspace division: one budget for all layers;
///                      not together with workspace_limit),
///   "ilp_time_limit": seconds for the workspace-division MILP (default 10).
/// Sizes accept B, KiB, MiB, GiB, TiB (and K, M, G, T, all powers of 1024); "MB" and friends
/// are refused as ambiguous. Unknown keys are errors.
///
/// On success `*plan_json_out` is the document (free it with mucudnnFreeString()); if the
/// workspace-division solver stopped at its time limit, mucudnnGetLastError() holds a warning
/// that the answer is feasible but not proven optimal. On failure `*plan_json_out` is NULL:
/// MUCUDNN_STATUS_BAD_PROFILE for a malformed profile, MUCUDNN_STATUS_INVALID_ARGUMENT for bad
/// options, NULL pointers or invalid UTF-8, MUCUDNN_STATUS_SOLVER_ERROR when no plan fits.
/// Thread-safe.
///
/// # Safety
///
/// `profile_json` and `options_json` are NULL or NUL-terminated strings; `plan_json_out` is
/// NULL (an error) or valid for writing one pointer.
#[no_mangle]
pub unsafe extern "C" fn mucudnnSolveProfile(
    profile_json: *const c_char,
    options_json: *const c_char,
    plan_json_out: *mut *mut c_char,
) -> mucudnnStatus_t {
    let mut warning = None;
    let status = guard("mucudnnSolveProfile", || {
        // SAFETY (three calls): this function's contract.
        let out = unsafe { out_arg(plan_json_out, "plan_json_out", std::ptr::null_mut()) }?;
        let profile = unsafe { str_arg(profile_json, "profile_json") }?;
        let options = unsafe { optional_str_arg(options_json, "options_json") }?;
        let solved = solve::solve_profile_json(profile, options)?;
        give_string(out, &solved.json);
        warning = solved.warning;
        Ok(())
    });
    if let Some(warning) = warning {
        set_last_error(&format!("mucudnnSolveProfile: {warning}"));
    }
    status
}

// ---------------------------------------------------------------------------------------------
// Handles

/// Fills `*options` with the defaults: size and version of this header, the default cache,
/// MUCUDNN_POLICY_POWER_OF_TWO, not verbose, a 64 MiB per-layer workspace limit, no total
/// budget. Thread-safe.
///
/// # Safety
///
/// `options` is NULL (an error) or valid for writing one mucudnnOptions_t.
#[no_mangle]
pub unsafe extern "C" fn mucudnnOptionsInit(options: *mut mucudnnOptions_t) -> mucudnnStatus_t {
    guard("mucudnnOptionsInit", || {
        // SAFETY: this function's contract.
        unsafe { out_arg(options, "options", mucudnnOptions_t::default()) }?;
        Ok(())
    })
}

/// Makes a mucudnn handle over the caller's cuDNN handle and CUDA stream. mucudnn never
/// destroys either: destroy the mucudnn handle first, then them.
///
/// `cudnn`: a cudnnHandle_t, made by the same libcudnn that mucudnn loads (mucudnn looks for
/// libcudnn.so, then libcudnn.so.9, ... on the library path; two different libcudnn in one
/// process are refused with MUCUDNN_STATUS_NOT_AVAILABLE). `stream`: where the work goes
/// (NULL: the legacy default stream, with the device current on the calling thread). Every
/// convolution call sets this stream on the cuDNN handle and puts the handle's previous
/// stream back before returning. `options`: NULL for the defaults (see mucudnnOptionsInit).
///
/// The handle's GPU is the stream's. Without a CUDA driver, cuDNN 9 or a GPU this returns
/// MUCUDNN_STATUS_NOT_AVAILABLE (the message says what is missing) without touching `cudnn`
/// or `stream`. On failure `*handle_out` is NULL.
///
/// # Safety
///
/// `handle_out` is NULL (an error) or valid for writing one pointer; `cudnn` is NULL (an
/// error) or a live cudnnHandle_t as described, used by no other thread during mucudnn's
/// calls; `stream` is NULL or a live stream of the same GPU that outlives the handle (or
/// until mucudnnSetStream replaces it); `options` is NULL or a mucudnnOptions_t as described
/// there, with `cache_path` NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn mucudnnCreate(
    handle_out: *mut mucudnnHandle_t,
    cudnn: mucudnnCudnnHandle_t,
    stream: mucudnnStream_t,
    options: *const mucudnnOptions_t,
) -> mucudnnStatus_t {
    guard("mucudnnCreate", || {
        // SAFETY (three calls): this function's contract.
        let out = unsafe { out_arg(handle_out, "handle_out", std::ptr::null_mut()) }?;
        let settings = unsafe { settings_arg(options) }?;
        let foreign = unsafe { ForeignHandle::new(cudnn.cast(), stream.cast()) }?;
        *out = HANDLES.insert(mucudnnContext {
            handle: Handle::new(foreign, settings)?,
        });
        Ok(())
    })
}

/// Destroys a handle: frees its workspace (after the GPU has finished with it) and its plans.
/// A NULL, already destroyed or unknown handle is MUCUDNN_STATUS_INVALID_ARGUMENT, and so is a
/// handle in use by another thread at that moment.
///
/// # Safety
///
/// The cuDNN handle, stream and CUDA context the handle was made with are still alive.
#[no_mangle]
pub unsafe extern "C" fn mucudnnDestroy(handle: mucudnnHandle_t) -> mucudnnStatus_t {
    guard("mucudnnDestroy", || HANDLES.remove(handle, "handle"))
}

/// Sends the handle's later work to `stream` (NULL: the legacy default stream), which must be
/// on the handle's GPU.
///
/// # Safety
///
/// `stream` is as for mucudnnCreate.
#[no_mangle]
pub unsafe extern "C" fn mucudnnSetStream(
    handle: mucudnnHandle_t,
    stream: mucudnnStream_t,
) -> mucudnnStatus_t {
    guard("mucudnnSetStream", || {
        let mut entered = HANDLES.enter(handle, "handle")?;
        // SAFETY: this function's contract.
        unsafe { entered.handle.set_stream(stream.cast()) }
    })
}

/// The shared body of the three convolution calls.
///
/// # Safety
///
/// As for the three calls.
unsafe fn convolution(
    handle: mucudnnHandle_t,
    op: ConvOp,
    layer_id: i64,
    descriptors: RawDescriptors,
    data: RawOperands<*const c_void>,
) -> Result<(), FfiError> {
    let mut entered = HANDLES.enter(handle, "handle")?;
    let layer = layer_arg(layer_id)?;
    // SAFETY (three calls): the contract of the three calls.
    let alpha = unsafe { scalar_arg(data.alpha, "alpha") }?;
    let beta = unsafe { scalar_arg(data.beta, "beta") }?;
    let operands = RawOperands {
        alpha,
        a: data.a,
        b: data.b,
        beta,
        out: data.out,
    };
    unsafe { entered.handle.convolve(op, layer, descriptors, operands) }
}

/// y = alpha * conv(x, w) + beta * y, like cudnnConvolutionForward (same arguments, in the
/// same order, without the algorithm and workspace: mucudnn chooses them). On first sight of a
/// (problem, op) the call tunes (profiles every cuDNN algorithm at every micro-batch size the
/// policy allows, on the handle's GPU, synchronising the stream first; this takes from
/// milliseconds to seconds) and keeps the plan; later calls only run it: one cuDNN call per
/// micro-batch on the handle's stream, asynchronously, with no host synchronisation.
///
/// `alpha`, `beta`: host floats (float, half and bfloat16 data, as in cuDNN). Data: float,
/// half or bfloat16, fully packed NCHW or NHWC tensors, the filter in the same layout; the
/// convolution descriptor in CUDNN_CROSS_CORRELATION mode with a float compute type; any
/// padding, stride, dilation, group count and math type. `layer_id`: a number >= 0 that names
/// the layer in plans and messages, or -1; layers with the same problem share one plan.
///
/// mucudnn checks that the descriptors make one convolution, and that the first and last byte
/// of each tensor is device memory of the handle's GPU and that y overlaps neither input.
///
/// # Safety
///
/// `handle` is any value (NULL, destroyed and made-up handles are refused); `alpha` and
/// `beta` are NULL (an error) or point to floats; each descriptor is NULL (an error) or a live
/// descriptor of its kind made by the same libcudnn (a garbage descriptor is undefined
/// behaviour, as in cuDNN); `x`, `w` and `y` are the device addresses of the tensors the
/// descriptors describe, readable (and `y` writable) by the handle's GPU, allocated until the
/// work queued on the stream has finished, and not written by anyone else meanwhile.
#[no_mangle]
pub unsafe extern "C" fn mucudnnConvolutionForward(
    handle: mucudnnHandle_t,
    alpha: *const c_void,
    x_desc: mucudnnTensorDescriptor_t,
    x: *const c_void,
    w_desc: mucudnnFilterDescriptor_t,
    w: *const c_void,
    conv_desc: mucudnnConvolutionDescriptor_t,
    beta: *const c_void,
    y_desc: mucudnnTensorDescriptor_t,
    y: *mut c_void,
    layer_id: i64,
) -> mucudnnStatus_t {
    guard("mucudnnConvolutionForward", || {
        let descriptors = RawDescriptors {
            input: x_desc.cast(),
            filter: w_desc.cast(),
            conv: conv_desc.cast(),
            output: y_desc.cast(),
        };
        // SAFETY: this function's contract.
        unsafe {
            convolution(
                handle,
                ConvOp::Forward,
                layer_id,
                descriptors,
                RawOperands {
                    alpha,
                    a: x,
                    b: w,
                    beta,
                    out: y,
                },
            )
        }
    })
}

/// dx = alpha * conv_transpose(dy, w) + beta * dx, like cudnnConvolutionBackwardData (same
/// arguments and order, without algorithm and workspace). Tuning, data and checks as for
/// mucudnnConvolutionForward.
///
/// # Safety
///
/// As for mucudnnConvolutionForward, with `w` and `dy` read and `dx` written.
#[no_mangle]
pub unsafe extern "C" fn mucudnnConvolutionBackwardData(
    handle: mucudnnHandle_t,
    alpha: *const c_void,
    w_desc: mucudnnFilterDescriptor_t,
    w: *const c_void,
    dy_desc: mucudnnTensorDescriptor_t,
    dy: *const c_void,
    conv_desc: mucudnnConvolutionDescriptor_t,
    beta: *const c_void,
    dx_desc: mucudnnTensorDescriptor_t,
    dx: *mut c_void,
    layer_id: i64,
) -> mucudnnStatus_t {
    guard("mucudnnConvolutionBackwardData", || {
        let descriptors = RawDescriptors {
            input: dx_desc.cast(),
            filter: w_desc.cast(),
            conv: conv_desc.cast(),
            output: dy_desc.cast(),
        };
        // SAFETY: this function's contract.
        unsafe {
            convolution(
                handle,
                ConvOp::BackwardData,
                layer_id,
                descriptors,
                RawOperands {
                    alpha,
                    a: w,
                    b: dy,
                    beta,
                    out: dx,
                },
            )
        }
    })
}

/// dw = alpha * (sum over the batch of correlate(x, dy)) + beta * dw, like
/// cudnnConvolutionBackwardFilter (same arguments and order, without algorithm and
/// workspace). The first micro-batch uses the caller's beta and later ones beta = 1, so the
/// gradient sums over the whole mini-batch. Tuning, data and checks as for
/// mucudnnConvolutionForward.
///
/// # Safety
///
/// As for mucudnnConvolutionForward, with `x` and `dy` read and `dw` written.
#[no_mangle]
pub unsafe extern "C" fn mucudnnConvolutionBackwardFilter(
    handle: mucudnnHandle_t,
    alpha: *const c_void,
    x_desc: mucudnnTensorDescriptor_t,
    x: *const c_void,
    dy_desc: mucudnnTensorDescriptor_t,
    dy: *const c_void,
    conv_desc: mucudnnConvolutionDescriptor_t,
    beta: *const c_void,
    dw_desc: mucudnnFilterDescriptor_t,
    dw: *mut c_void,
    layer_id: i64,
) -> mucudnnStatus_t {
    guard("mucudnnConvolutionBackwardFilter", || {
        let descriptors = RawDescriptors {
            input: x_desc.cast(),
            filter: dw_desc.cast(),
            conv: conv_desc.cast(),
            output: dy_desc.cast(),
        };
        // SAFETY: this function's contract.
        unsafe {
            convolution(
                handle,
                ConvOp::BackwardFilter,
                layer_id,
                descriptors,
                RawOperands {
                    alpha,
                    a: x,
                    b: dy,
                    beta,
                    out: dw,
                },
            )
        }
    })
}

/// The workspace the handle needs for `op` of the layer these descriptors describe, in bytes
/// (tuning the (problem, op) now if it has not been seen). Descriptors in forward roles for
/// every op: x (dx), w (dw), conv, y (dy). The handle allocates its one workspace itself, sized
/// to the largest plan so far; this is for the caller's memory planning.
///
/// # Safety
///
/// `handle` and the descriptors as for mucudnnConvolutionForward; `size_out` is NULL (an
/// error) or valid for writing one size_t.
#[no_mangle]
pub unsafe extern "C" fn mucudnnGetWorkspaceSize(
    handle: mucudnnHandle_t,
    op: mucudnnConvOp_t,
    x_desc: mucudnnTensorDescriptor_t,
    w_desc: mucudnnFilterDescriptor_t,
    conv_desc: mucudnnConvolutionDescriptor_t,
    y_desc: mucudnnTensorDescriptor_t,
    size_out: *mut usize,
) -> mucudnnStatus_t {
    guard("mucudnnGetWorkspaceSize", || {
        // SAFETY: this function's contract.
        let out = unsafe { out_arg(size_out, "size_out", 0) }?;
        let mut entered = HANDLES.enter(handle, "handle")?;
        let op = conv_op_arg(op)?;
        let descriptors = RawDescriptors {
            input: x_desc.cast(),
            filter: w_desc.cast(),
            conv: conv_desc.cast(),
            output: y_desc.cast(),
        };
        // SAFETY: this function's contract.
        let bytes = unsafe { entered.handle.workspace_size(op, descriptors) }?;
        *out = usize::try_from(bytes)
            .map_err(|_| FfiError::Internal(format!("{bytes} workspace bytes overflow size_t")))?;
        Ok(())
    })
}

/// The plans the handle has tuned so far, in the order it tuned them, as the
/// `mucudnn solve --json` document (mode "wr" under the handle's effective workspace limit;
/// layers are named "layer<id>", or "unnamed"). `*json_out` is a string to free with
/// mucudnnFreeString(), NULL on failure.
///
/// # Safety
///
/// `handle` as for mucudnnConvolutionForward; `json_out` is NULL (an error) or valid for
/// writing one pointer.
#[no_mangle]
pub unsafe extern "C" fn mucudnnGetPlansJson(
    handle: mucudnnHandle_t,
    json_out: *mut *mut c_char,
) -> mucudnnStatus_t {
    guard("mucudnnGetPlansJson", || {
        // SAFETY: this function's contract.
        let out = unsafe { out_arg(json_out, "json_out", std::ptr::null_mut()) }?;
        let entered = HANDLES.enter(handle, "handle")?;
        let json = entered.handle.plans_json()?;
        give_string(out, &json);
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------------
// Tuners: the layer API for language bindings (no cuDNN descriptors; host or device pointers)

/// What a mucudnnTuner_t points to (opaque).
pub struct mucudnnTunerContext {
    _opaque: [u8; 0],
}

/// A tuner: one device (the CPU backend, or one GPU), the tuning cache, and the plan sets
/// prepared so far. Made by mucudnnTunerCreate, freed by mucudnnTunerDestroy. Convolutions are
/// described as JSON problems, so no cuDNN of the caller's is needed; this is what the PyTorch
/// package (`mucudnn.torch`) uses. Thread-safe: concurrent calls on one tuner run one after
/// another. Like a mucudnnHandle_t, the value is an opaque token, never reused: a destroyed
/// or made-up tuner is MUCUDNN_STATUS_INVALID_ARGUMENT, never another tuner.
pub type mucudnnTuner_t = *mut mucudnnTunerContext;

/// The device argument of mucudnnTunerCreate for the CPU backend (a GPU is its CUDA ordinal).
pub const MUCUDNN_DEVICE_CPU: i32 = -1;

/// The tuner a C caller holds, locked for one call.
fn with_tuner<T>(
    tuner: mucudnnTuner_t,
    f: impl FnOnce(&mut tuner::Tuner) -> Result<T, FfiError>,
) -> Result<T, FfiError> {
    tuner::with_tuner(tuner as usize, f)
}

/// A JSON argument `name` parsed as `T`.
///
/// # Safety
///
/// `ptr` is null (an error) or a NUL-terminated string.
unsafe fn json_arg<T: serde::de::DeserializeOwned>(
    ptr: *const c_char,
    name: &str,
) -> Result<T, FfiError> {
    // SAFETY: this function's contract.
    let text = unsafe { str_arg(ptr, name) }?;
    json::parse_argument(text, name)
}

fn to_json(value: &impl serde::Serialize) -> Result<String, FfiError> {
    serde_json::to_string(value).map_err(|e| FfiError::Internal(format!("writing JSON: {e}")))
}

/// Settings of one tuning call (see mucudnnTunerTune).
///
/// # Safety
///
/// `ptr` is null (the defaults) or a NUL-terminated string.
unsafe fn settings_json_arg(
    tuner: &tuner::Tuner,
    ptr: *const c_char,
) -> Result<tuner::Settings, FfiError> {
    // SAFETY: this function's contract.
    let text = unsafe { optional_str_arg(ptr, "settings_json") }?.unwrap_or("{}");
    tuner::parse_settings(text, tuner.device())
}

/// Makes a tuner on `device`: MUCUDNN_DEVICE_CPU for the CPU backend, or a CUDA ordinal
/// (0, 1, ...) for a GPU, whose CUDA, cuDNN and context are checked now
/// (MUCUDNN_STATUS_NOT_AVAILABLE with the reason when missing).
///
/// `options_json`: NULL for the defaults, or a JSON object with any of
///   "cache": the tuning cache file (a path; absent or null: $MUCUDNN_CACHE, else
///            $XDG_CACHE_HOME/mucudnn/cache.sqlite, else ~/.cache/mucudnn/cache.sqlite),
///   "no_cache": true to keep measurements in memory only (not with a "cache" path),
///   "verbose": true to print a line per measurement and per tuned layer on stderr.
///
/// A tuner with a cache file holds three file descriptors (SQLite's database, WAL and
/// shared-memory index) until it is destroyed; one with "no_cache" holds none. A cache that
/// cannot be opened because the process is out of file descriptors is
/// MUCUDNN_STATUS_NOT_AVAILABLE, a file that is not a mucudnn cache
/// MUCUDNN_STATUS_INVALID_ARGUMENT; a damaged, unwritable or unusable cache of ours warns and
/// works in memory (read-only, or moved aside and salvaged), as for the CLI.
///
/// # Safety
///
/// `tuner_out` is NULL (an error) or valid for writing one pointer; `options_json` is NULL or
/// a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn mucudnnTunerCreate(
    tuner_out: *mut mucudnnTuner_t,
    device: i32,
    options_json: *const c_char,
) -> mucudnnStatus_t {
    guard("mucudnnTunerCreate", || {
        // SAFETY: this function's contract.
        let out = unsafe { out_arg(tuner_out, "tuner_out", std::ptr::null_mut()) }?;
        let device = match device {
            MUCUDNN_DEVICE_CPU => tuner::TunerDevice::Cpu,
            ordinal if ordinal >= 0 => tuner::TunerDevice::Cuda(ordinal as usize),
            other => {
                return Err(invalid(format!(
                    "device is {other}; give MUCUDNN_DEVICE_CPU (-1) or a CUDA ordinal >= 0"
                )))
            }
        };
        // SAFETY: this function's contract.
        let text = unsafe { optional_str_arg(options_json, "options_json") }?.unwrap_or("{}");
        let options = tuner::TunerOptions::parse(text)?;
        let cache = options
            .no_cache
            .unwrap_or(false)
            .then(mucudnn_cache::Cache::in_memory);
        let verbose = options.verbose.unwrap_or(false);
        let made = tuner::Tuner::new(device, cache, options.cache_path(), verbose)?;
        *out = tuner::register(made) as mucudnnTuner_t;
        Ok(())
    })
}

/// Destroys a tuner and every plan set prepared on it (a call still running on another thread
/// finishes first). NULL, a destroyed or a made-up tuner is MUCUDNN_STATUS_INVALID_ARGUMENT.
#[no_mangle]
pub extern "C" fn mucudnnTunerDestroy(tuner: mucudnnTuner_t) -> mucudnnStatus_t {
    guard("mucudnnTunerDestroy", || tuner::unregister(tuner as usize))
}

/// The device fingerprint the tuner's measurements are stored under, as JSON (backend, name,
/// compute_capability, driver_version, cudnn_version): ranks of a distributed job share
/// measurements only with ranks of an identical fingerprint. Free with mucudnnFreeString().
///
/// # Safety
///
/// `json_out` is NULL (an error) or valid for writing one pointer.
#[no_mangle]
pub unsafe extern "C" fn mucudnnTunerGetFingerprint(
    tuner: mucudnnTuner_t,
    json_out: *mut *mut c_char,
) -> mucudnnStatus_t {
    guard("mucudnnTunerGetFingerprint", || {
        // SAFETY: this function's contract.
        let out = unsafe { out_arg(json_out, "json_out", std::ptr::null_mut()) }?;
        let fingerprint = with_tuner(tuner, |t| t.fingerprint())?;
        give_string(out, &to_json(&fingerprint)?);
        Ok(())
    })
}

/// Tunes one layer through the cache: measures what the cache lacks (every candidate at every
/// micro-batch size the policy allows, for the three ops, or the settings' "ops") and solves
/// each op under the per-layer workspace limit. A candidate whose workspace at a size exceeds the limit is not
/// timed (nor its workspace allocated), only recorded in the cache as skipped; a later tune
/// under a larger limit times exactly those. Everything measuring allocated is freed before the
/// call returns. `*result_json_out` gets {"plans": [fwd, bwd_data, bwd_filter] (those of the
/// settings' "ops", in this order), "splits":
/// [...], "cached": N, "measured": N, "skipped": N, "peak_measuring_memory_bytes": N,
/// "largest_workspace_bytes": N} (skipped: candidate timings not taken for their workspace;
/// the peak: the most operand and workspace memory measuring held at once, device memory on a
/// GPU, not counting cuDNN's own), each plan as {"layer", "problem", "op",
/// "micro_batches": [{"size", "algo", "workspace_bytes", "time_ms"}]} (what
/// mucudnnTunerPrepare takes) and each split its micro-batches as `COUNTxSIZE@algo` runs.
///
/// `problem_json`: the convolution at the mini-batch size, as in the interchange format's
/// "problem" (docs/PROFILE_FORMAT.md), e.g. {"n": 32, "c": 3, "h": 32, "w": 32, "k": 16,
/// "r": 3, "s": 3, "pad_h": 1, "pad_w": 1, "stride_h": 1, "stride_w": 1, "dilation_h": 1,
/// "dilation_w": 1, "groups": 1, "dtype": "fp32", "layout": "nchw", "math": "default"}.
///
/// `settings_json`: NULL for the defaults, or an object with any of "policy" ("undivided",
/// "power-of-two" (default), "all"), "workspace_limit" (bytes or "64MiB"; default 64 MiB;
/// null for none), "candidates" ("legacy", "engines", "all" (default); the CPU has only its
/// own algorithms), "max_candidates" (engine configurations timed per size; null for all),
/// "prune_margin" (default 1.5; null to time every configuration at every size),
/// "deterministic" (true: deterministic candidates only) and "ops" (the ops to tune: a
/// non-empty array of "fwd", "bwd_data", "bwd_filter"; absent or null: all three; e.g.
/// ["fwd"] for inference, which measures and solves nothing for the backward ops; an empty
/// array or an unknown name is MUCUDNN_STATUS_INVALID_ARGUMENT) and "split" ("batch",
/// "spatial", "auto" (default): what a plan splits, the mini-batch or the rows of the
/// outermost spatial dimension of the op's output; auto also tunes chunks for a batch of at
/// most 4 whose batch sizes skipped a candidate over the limit and keeps the faster plan; a
/// spatial plan has "split": "spatial" and its split string ends "along h" (d, w); on cuDNN
/// spatial plans use engine configurations only) and "runtime_compiled" (true: also time
/// engine configurations that compile kernels at run time, NVRTC, seconds per plan build;
/// default false) and "verify" (false: do not compare each candidate's output with the
/// reference candidate's while measuring; default true: a candidate that computes wrong
/// numbers is rejected and never planned; the result's "verified" and "rejected" count them).
///
/// # Safety
///
/// The strings are NULL (an error, except `settings_json`) or NUL-terminated;
/// `result_json_out` is NULL (an error) or valid for writing one pointer.
#[no_mangle]
pub unsafe extern "C" fn mucudnnTunerTune(
    tuner: mucudnnTuner_t,
    layer: *const c_char,
    problem_json: *const c_char,
    settings_json: *const c_char,
    result_json_out: *mut *mut c_char,
) -> mucudnnStatus_t {
    guard("mucudnnTunerTune", || {
        // SAFETY: this function's contract.
        let out = unsafe { out_arg(result_json_out, "result_json_out", std::ptr::null_mut()) }?;
        // SAFETY: this function's contract.
        let layer = unsafe { str_arg(layer, "layer") }?;
        // SAFETY: this function's contract.
        let problem: ConvProblem = unsafe { json_arg(problem_json, "problem_json") }?;
        let result = with_tuner(tuner, |t| {
            // SAFETY: this function's contract.
            let settings = unsafe { settings_json_arg(t, settings_json) }?;
            t.tune(layer, &problem, &settings)
        })?;
        give_string(out, &to_json(&result)?);
        Ok(())
    })
}

/// The measuring tasks the cache lacks to tune some layers: `layers_json` is an array of
/// {"layer": NAME, "problem": PROBLEM}; `*tasks_json_out` gets an array of tasks {"layer",
/// "problem", "op", "micro", "kind", "between"}, the anchor sizes of every layer first, then
/// the sizes between them ("between" names their anchors). Deal the tasks out over the ranks
/// of a job, measure each share (anchors before the sizes between), share the results with
/// mucudnnTunerStore, and tuning then measures nothing. Settings as for mucudnnTunerTune:
/// only the tasks of its "ops" are listed.
///
/// # Safety
///
/// As for mucudnnTunerTune.
#[no_mangle]
pub unsafe extern "C" fn mucudnnTunerMissing(
    tuner: mucudnnTuner_t,
    layers_json: *const c_char,
    settings_json: *const c_char,
    tasks_json_out: *mut *mut c_char,
) -> mucudnnStatus_t {
    guard("mucudnnTunerMissing", || {
        // SAFETY: this function's contract.
        let out = unsafe { out_arg(tasks_json_out, "tasks_json_out", std::ptr::null_mut()) }?;
        // SAFETY: this function's contract.
        let layers: Vec<tuner::NamedProblem> = unsafe { json_arg(layers_json, "layers_json") }?;
        let tasks = with_tuner(tuner, |t| {
            // SAFETY: this function's contract.
            let settings = unsafe { settings_json_arg(t, settings_json) }?;
            t.missing(layers, &settings)
        })?;
        give_string(out, &to_json(&tasks)?);
        Ok(())
    })
}

/// Measures tasks (an array as mucudnnTunerMissing returns, or a share of it), in order,
/// storing each in the tuner's cache. `*measured_json_out` gets {"fingerprint": FINGERPRINT,
/// "measured": [{"task": TASK, "measurements": [{"micro", "algo" or "engine", "time_ms",
/// "workspace_bytes"}], "skipped": [{"micro", "algo", "workspace_bytes"}]}]}, the document
/// mucudnnTunerStore takes on another rank ("skipped", present when not empty: candidates over
/// the workspace limit, not timed). Settings as for mucudnnTunerTune (they decide timing,
/// pruning, the engine bound and the workspace limit measuring stays within; a task of an op
/// not in its "ops" is left out: not measured, not returned).
///
/// # Safety
///
/// As for mucudnnTunerTune.
#[no_mangle]
pub unsafe extern "C" fn mucudnnTunerMeasure(
    tuner: mucudnnTuner_t,
    tasks_json: *const c_char,
    settings_json: *const c_char,
    measured_json_out: *mut *mut c_char,
) -> mucudnnStatus_t {
    guard("mucudnnTunerMeasure", || {
        // SAFETY: this function's contract.
        let out = unsafe { out_arg(measured_json_out, "measured_json_out", std::ptr::null_mut()) }?;
        // SAFETY: this function's contract.
        let tasks: Vec<MeasureTask> = unsafe { json_arg(tasks_json, "tasks_json") }?;
        let doc = with_tuner(tuner, |t| {
            // SAFETY: this function's contract.
            let settings = unsafe { settings_json_arg(t, settings_json) }?;
            let measured = t.measure(&tasks, &settings)?;
            Ok(serde_json::json!({"fingerprint": t.fingerprint()?, "measured": measured}))
        })?;
        give_string(out, &to_json(&doc)?);
        Ok(())
    })
}

/// Stores measurements another tuner took (the document of mucudnnTunerMeasure, e.g. from
/// another rank) in this tuner's cache. All or nothing: refused unless its fingerprint equals
/// this tuner's, and every record is checked before anything is stored (the task's size and
/// candidate kind, a candidate this tuner's backend has, a positive finite time, a workspace
/// within the device's memory); the first bad one is MUCUDNN_STATUS_INVALID_ARGUMENT, named by
/// its index in the last error. `*stored_out` gets the number of (task) records stored.
///
/// # Safety
///
/// `measured_json` is NULL (an error) or NUL-terminated; `stored_out` is NULL (an error) or
/// valid for writing one uint64_t.
#[no_mangle]
pub unsafe extern "C" fn mucudnnTunerStore(
    tuner: mucudnnTuner_t,
    measured_json: *const c_char,
    stored_out: *mut u64,
) -> mucudnnStatus_t {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Doc {
        fingerprint: DeviceFingerprint,
        measured: Vec<MeasuredTask>,
    }
    guard("mucudnnTunerStore", || {
        // SAFETY: this function's contract.
        let out = unsafe { out_arg(stored_out, "stored_out", 0) }?;
        // SAFETY: this function's contract.
        let doc: Doc = unsafe { json_arg(measured_json, "measured_json") }?;
        let stored = with_tuner(tuner, |t| t.store(&doc.fingerprint, &doc.measured))?;
        *out = stored as u64;
        Ok(())
    })
}

/// Prepares the plans of one input shape for execution: `plans_json` is the array of
/// mucudnnTunerTune's "plans" (at most one plan per op, at least one, all of one problem; a
/// set prepared with fewer than three runs only those ops, and executing another is
/// MUCUDNN_STATUS_INVALID_ARGUMENT). On a GPU this builds the descriptors and engine execution
/// plans once. `*plan_set_out` gets the set's id (for mucudnnTunerExecute and
/// mucudnnTunerRelease) and `workspace_bytes_out[0..3]` the workspace bytes each op needs, in
/// MUCUDNN_OP_* order (0 for an op not prepared; the caller provides that workspace).
/// MUCUDNN_STATUS_PLAN_NOT_SUPPORTED when cuDNN will not build one of the micro-batches here
/// (nothing is prepared; the message names the op, the micro-batch, its offset and candidate):
/// a caller falls back to another convolution for this shape rather than fail.
///
/// # Safety
///
/// `plans_json` is NULL (an error) or NUL-terminated; `plan_set_out` is NULL (an error) or
/// valid for writing one uint64_t; `workspace_bytes_out` is NULL (an error) or valid for
/// writing three uint64_t.
#[no_mangle]
pub unsafe extern "C" fn mucudnnTunerPrepare(
    tuner: mucudnnTuner_t,
    plans_json: *const c_char,
    plan_set_out: *mut u64,
    workspace_bytes_out: *mut u64,
) -> mucudnnStatus_t {
    guard("mucudnnTunerPrepare", || {
        // SAFETY: this function's contract.
        let id_out = unsafe { out_arg(plan_set_out, "plan_set_out", u64::MAX) }?;
        if workspace_bytes_out.is_null() {
            return Err(invalid("workspace_bytes_out is NULL"));
        }
        // SAFETY: this function's contract.
        let plans: Vec<Plan> = unsafe { json_arg(plans_json, "plans_json") }?;
        let (id, workspace) = with_tuner(tuner, |t| t.prepare(plans))?;
        // SAFETY: non-null and valid for three writes (this function's contract).
        unsafe {
            workspace_bytes_out
                .cast::<[u64; 3]>()
                .write_unaligned(workspace)
        };
        *id_out = id;
        Ok(())
    })
}

/// Frees a prepared plan set.
#[no_mangle]
pub extern "C" fn mucudnnTunerRelease(tuner: mucudnnTuner_t, plan_set: u64) -> mucudnnStatus_t {
    guard("mucudnnTunerRelease", || {
        with_tuner(tuner, |t| t.release(plan_set))
    })
}

/// Runs one op of a prepared plan set over the whole mini-batch:
/// `out = alpha * op(a, b) + beta * out`, micro-batch by micro-batch, with operands in cuDNN's
/// order for the op (forward: a = x, b = w, out = y; backward-data: a = w, b = dy, out = dx;
/// backward-filter: a = x, b = dy, out = dw), each packed in the problem's layout (NCHW or
/// NHWC; the filter in the same layout) and dtype.
///
/// On a CPU tuner the pointers are host memory and `stream` is ignored; the workspace is host
/// memory (4-byte aligned), or NULL with 0 bytes: the tuner's own host workspace, one buffer
/// per tuner shared by all its plan sets and grown to the largest plan run on it (so a caller
/// needs no buffer per shape). On a GPU tuner they are device memory of the tuner's GPU, the work
/// is queued on `stream` (NULL: the legacy default stream) through the tuner's own cuDNN
/// handle, asynchronously, with no host synchronisation; the workspace is the caller's device
/// memory (e.g. from a framework's caching allocator), at least mucudnnTunerPrepare's
/// workspace_bytes_out[op] bytes, 16-byte aligned (NULL with 0 bytes when none is needed).
///
/// `operand_dims` (15 values) gives the dims of `a`, `b` and `out` in that order, each as
/// N, C, D, H, W (a filter as K, C/groups, T, R, S; D = T = 1 for a 2-D problem, and a 1-D one
/// is 2-D with H = R = 1) whatever the layout, and `operand_bytes` (3
/// values) the bytes each buffer holds from its pointer on. They are checked against the
/// plan's problem before any pointer is read: dims other than the roles' in the prepared
/// problem, or a buffer smaller than its role's elements in the problem's dtype, is
/// MUCUDNN_STATUS_INVALID_ARGUMENT naming the operand and both shapes (so a plan tuned for
/// one shape never runs over tensors of another).
///
/// # Safety
///
/// `a`, `b` and `out` point to at least `operand_bytes[i]` bytes each (host memory on a CPU
/// tuner, device memory of its GPU otherwise), readable, `out` writable and overlapping
/// neither input; `operand_dims` is NULL (an error) or points to 15 readable int64_t and
/// `operand_bytes` is NULL (an error) or points to 3 readable uint64_t; `workspace` is NULL
/// with `workspace_bytes` 0, or `workspace_bytes` writable bytes of the same kind of memory;
/// on a GPU all of it stays allocated until the work queued on `stream` has finished, and
/// `stream` is a live stream of the GPU's primary context.
#[no_mangle]
pub unsafe extern "C" fn mucudnnTunerExecute(
    tuner: mucudnnTuner_t,
    plan_set: u64,
    op: mucudnnConvOp_t,
    alpha: f32,
    a: *const c_void,
    b: *const c_void,
    beta: f32,
    out: *mut c_void,
    operand_dims: *const i64,
    operand_bytes: *const u64,
    workspace: *mut c_void,
    workspace_bytes: u64,
    stream: mucudnnStream_t,
) -> mucudnnStatus_t {
    guard("mucudnnTunerExecute", || {
        let op = conv_op_arg(op)?;
        if operand_dims.is_null() {
            return Err(invalid("operand_dims is NULL"));
        }
        if operand_bytes.is_null() {
            return Err(invalid("operand_bytes is NULL"));
        }
        // SAFETY: non-null, and 15 and 3 readable values (this function's contract).
        let (dims, bytes) = unsafe {
            (
                operand_dims.cast::<[i64; 15]>().read_unaligned(),
                operand_bytes.cast::<[u64; 3]>().read_unaligned(),
            )
        };
        let operands: [tuner::OperandExtent; 3] = std::array::from_fn(|i| tuner::OperandExtent {
            dims: std::array::from_fn(|j| dims[5 * i + j]),
            bytes: bytes[i],
        });
        with_tuner(tuner, |t| {
            // SAFETY: this function's contract.
            unsafe {
                t.execute(
                    plan_set,
                    op,
                    RawOperands {
                        alpha,
                        a,
                        b,
                        beta,
                        out,
                    },
                    &operands,
                    tuner::CallerWorkspace {
                        pointer: workspace,
                        bytes: workspace_bytes,
                    },
                    stream.cast(),
                )
            }
        })
    })
}

#[cfg(test)]
mod tests;
