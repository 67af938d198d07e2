//! [`CudnnError`]: every failure of the cuDNN backend, with enough context to act on.
//!
//! Nothing here names cudarc: the FFI wall ([`super::wall`]) converts cudarc's status and
//! driver errors into these variants, keeping the status *name* (e.g.
//! `CUDNN_STATUS_NOT_SUPPORTED`) and *number* so that messages are searchable and callers can
//! classify failures ([`CudnnError::is_not_supported`], [`CudnnError::is_out_of_memory`]).

#![forbid(unsafe_code)]

use crate::solver::{ConvOp, ShapeError};

/// Why a cuDNN-backend operation failed.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum CudnnError {
    /// A library this backend needs is missing, too old, or unusable: `what` is `"libcuda"`,
    /// `"libcudnn"` or `"CUDA driver"`, and `detail` says what to install or where to point
    /// `LD_LIBRARY_PATH`.
    #[error("{what} unavailable: {detail}")]
    Unavailable { what: &'static str, detail: String },

    /// The driver loaded, but no GPU can be used (cuInit failed, no device is visible, or the
    /// requested ordinal does not exist).
    #[error("no usable CUDA device: {detail}")]
    NoDevice { detail: String },

    /// A cuDNN call returned an error status.
    #[error("{call} failed with {status} ({code}){}", op_algo_suffix(.op, .algo))]
    Cudnn {
        /// The cuDNN function, e.g. `cudnnConvolutionForward`.
        call: &'static str,
        /// The `cudnnStatus_t` name, e.g. `CUDNN_STATUS_NOT_SUPPORTED`.
        status: String,
        /// The `cudnnStatus_t` number (cuDNN 9 numbering: 3000 is NOT_SUPPORTED).
        code: u32,
        /// The convolution op the call was for, where there is one.
        op: Option<ConvOp>,
        /// The legacy algorithm number the call was for, where there is one.
        algo: Option<u32>,
    },

    /// A CUDA driver call failed.
    #[error("{call} failed with {name} ({code}): {message}")]
    Driver {
        /// The driver function or cudarc operation, e.g. `cuMemAlloc`.
        call: &'static str,
        /// The `CUresult` name, e.g. `CUDA_ERROR_OUT_OF_MEMORY`.
        name: String,
        /// The `CUresult` number.
        code: u32,
        /// The driver's description of the error.
        message: String,
    },

    /// The convolution problem itself is invalid.
    #[error("invalid convolution problem: {0}")]
    Shape(#[from] ShapeError),

    /// Arguments that do not fit together (a view of the wrong length or dtype, an algorithm
    /// number out of range, a buffer from another stream, a workspace that is too small, ...).
    #[error("invalid argument to {call}: {detail}")]
    InvalidArgument { call: &'static str, detail: String },

    /// A call of cuDNN's graph (backend) API failed: `call` on a descriptor of type
    /// `descriptor`, e.g. `cudnnBackendFinalize` on `CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR`.
    /// A `CUDNN_STATUS_NOT_SUPPORTED*` status means this engine configuration (or, when the
    /// operation graph itself fails, the whole problem) cannot run through the graph API here:
    /// see [`CudnnError::is_not_supported`].
    #[error(
        "{call} on {descriptor} failed with {status} ({code}){}",
        op_engine_suffix(.op, .engine)
    )]
    Backend {
        /// The backend function, e.g. `cudnnBackendFinalize`.
        call: &'static str,
        /// The `cudnnBackendDescriptorType_t` name, e.g. `CUDNN_BACKEND_ENGINE_DESCRIPTOR`.
        descriptor: &'static str,
        /// The `cudnnStatus_t` name.
        status: String,
        /// The `cudnnStatus_t` number.
        code: u32,
        /// The convolution op the graph was for, where known.
        op: Option<ConvOp>,
        /// The engine configuration's name (`eng38_k2=8_...`), where there is one.
        engine: Option<String>,
    },

    /// mucudnn declines an engine configuration before asking cuDNN: the problem's math mode
    /// excludes the engine's numerics (e.g. tensor cores under `fma`), or the configuration
    /// cannot be expressed (a knob type out of range). A profiler skips it like a
    /// `CUDNN_STATUS_NOT_SUPPORTED` ([`CudnnError::is_not_supported`] is true).
    #[error("engine {engine} is not used for {op}: {reason}")]
    EngineNotSupported {
        op: ConvOp,
        engine: String,
        reason: String,
    },

    /// A device pointer handed to an execution plan is less aligned than the byte alignment
    /// the plan's tensor descriptors declared (cuDNN may then use vector loads that fault).
    #[error(
        "misaligned operand in {call}: {operand} at address {address:#x} is not a multiple of \
         the {required}-byte alignment the execution plan declares"
    )]
    Misaligned {
        call: &'static str,
        /// `a`, `b`, `out` (see `operand_roles`) or `workspace`.
        operand: &'static str,
        address: u64,
        required: u64,
    },
}

/// `cudnnStatus_t` numbers of cuDNN 9 (`CUDNN_STATUS_NOT_SUPPORTED` and its sub-codes
/// `CUDNN_STATUS_NOT_SUPPORTED_*` occupy 3000..=3999).
const NOT_SUPPORTED_CODES: std::ops::RangeInclusive<u32> = 3000..=3999;
/// `CUDNN_STATUS_NOT_SUPPORTED_SUBLIBRARY_UNAVAILABLE`: in the NOT_SUPPORTED range, but it
/// means a broken install (a sub-library could not be loaded), not a configuration to skip
/// here: it is an error, so that a profile is never silently empty.
pub const SUBLIBRARY_UNAVAILABLE: u32 = 3009;
/// `CUDA_ERROR_OUT_OF_MEMORY`.
const CUDA_ERROR_OUT_OF_MEMORY: u32 = 2;
/// cuDNN 9's `CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED` and
/// `CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED`.
const CUDNN_ALLOCATION_FAILED_CODES: [u32; 2] = [4003, 4004];

fn op_algo_suffix(op: &Option<ConvOp>, algo: &Option<u32>) -> String {
    match (op, algo) {
        (Some(op), Some(algo)) => format!(" for {op} algorithm {algo}"),
        (Some(op), None) => format!(" for {op}"),
        (None, Some(algo)) => format!(" for algorithm {algo}"),
        (None, None) => String::new(),
    }
}

fn op_engine_suffix(op: &Option<ConvOp>, engine: &Option<String>) -> String {
    match (op, engine) {
        (Some(op), Some(engine)) => format!(" for {op} engine {engine}"),
        (Some(op), None) => format!(" for {op}"),
        (None, Some(engine)) => format!(" for engine {engine}"),
        (None, None) => String::new(),
    }
}

impl CudnnError {
    /// cuDNN said the configuration is not supported (`CUDNN_STATUS_NOT_SUPPORTED*`, from the
    /// legacy or the graph API), or mucudnn declined an engine configuration
    /// ([`CudnnError::EngineNotSupported`]): a profiler skips the candidate instead of failing.
    pub fn is_not_supported(&self) -> bool {
        match self {
            CudnnError::Cudnn { code, .. } | CudnnError::Backend { code, .. } => {
                NOT_SUPPORTED_CODES.contains(code) && *code != SUBLIBRARY_UNAVAILABLE
            }
            CudnnError::EngineNotSupported { .. } => true,
            _ => false,
        }
    }

    /// Device memory ran out (a driver allocation or a cuDNN-internal one).
    pub fn is_out_of_memory(&self) -> bool {
        match self {
            CudnnError::Driver { code, .. } => *code == CUDA_ERROR_OUT_OF_MEMORY,
            CudnnError::Cudnn { code, .. } | CudnnError::Backend { code, .. } => {
                CUDNN_ALLOCATION_FAILED_CODES.contains(code)
            }
            _ => false,
        }
    }

    /// Attaches the op and engine configuration a graph-API failure belongs to (other variants
    /// are unchanged; an op or engine already recorded is kept).
    pub fn for_engine(self, for_op: ConvOp, for_engine: Option<&str>) -> Self {
        match self {
            CudnnError::Backend {
                call,
                descriptor,
                status,
                code,
                op,
                engine,
            } => CudnnError::Backend {
                call,
                descriptor,
                status,
                code,
                op: op.or(Some(for_op)),
                engine: engine.or_else(|| for_engine.map(str::to_string)),
            },
            other => other,
        }
    }

    /// The backend cannot run on this machine at all (missing library or sub-library, old
    /// driver, no GPU): callers fall back to another backend or report and stop.
    pub fn is_unavailable(&self) -> bool {
        match self {
            CudnnError::Unavailable { .. } | CudnnError::NoDevice { .. } => true,
            CudnnError::Cudnn { code, .. } | CudnnError::Backend { code, .. } => {
                *code == SUBLIBRARY_UNAVAILABLE
            }
            _ => false,
        }
    }

    /// Attaches the op and algorithm a cuDNN failure belongs to (other variants are unchanged).
    pub fn for_op_algo(self, for_op: ConvOp, for_algo: Option<u32>) -> Self {
        match self {
            CudnnError::Cudnn {
                call, status, code, ..
            } => CudnnError::Cudnn {
                call,
                status,
                code,
                op: Some(for_op),
                algo: for_algo,
            },
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cudnn_error_message_names_call_status_code_op_and_algo() {
        let e = CudnnError::Cudnn {
            call: "cudnnConvolutionForward",
            status: "CUDNN_STATUS_NOT_SUPPORTED".into(),
            code: 3000,
            op: Some(ConvOp::Forward),
            algo: Some(4),
        };
        assert_eq!(
            e.to_string(),
            "cudnnConvolutionForward failed with CUDNN_STATUS_NOT_SUPPORTED (3000) for fwd algorithm 4"
        );
        assert!(e.is_not_supported());
        assert!(!e.is_out_of_memory());
        let bare = CudnnError::Cudnn {
            call: "cudnnCreate",
            status: "CUDNN_STATUS_NOT_INITIALIZED".into(),
            code: 1001,
            op: None,
            algo: None,
        };
        assert_eq!(
            bare.to_string(),
            "cudnnCreate failed with CUDNN_STATUS_NOT_INITIALIZED (1001)"
        );
        let tagged = bare.for_op_algo(ConvOp::BackwardFilter, Some(3));
        assert!(tagged.to_string().ends_with("for bwd_filter algorithm 3"));
        assert!(!tagged.is_not_supported());
    }

    #[test]
    fn classification() {
        let oom = CudnnError::Driver {
            call: "cuMemAlloc",
            name: "CUDA_ERROR_OUT_OF_MEMORY".into(),
            code: 2,
            message: "out of memory".into(),
        };
        assert!(oom.is_out_of_memory());
        assert!(!oom.is_unavailable());
        assert!(oom.to_string().contains("CUDA_ERROR_OUT_OF_MEMORY (2)"));
        let missing = CudnnError::Unavailable {
            what: "libcudnn",
            detail: "not found".into(),
        };
        assert!(missing.is_unavailable());
        assert_eq!(missing.to_string(), "libcudnn unavailable: not found");
        let sub = CudnnError::Cudnn {
            call: "cudnnGetConvolutionForwardWorkspaceSize",
            status: "CUDNN_STATUS_NOT_SUPPORTED_SHAPE".into(),
            code: 3002,
            op: None,
            algo: None,
        };
        assert!(sub.is_not_supported());
    }

    #[test]
    fn graph_api_errors() {
        let e = CudnnError::Backend {
            call: "cudnnBackendFinalize",
            descriptor: "CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR",
            status: "CUDNN_STATUS_NOT_SUPPORTED_SHAPE".into(),
            code: 3002,
            op: None,
            engine: None,
        };
        assert!(e.is_not_supported());
        assert!(!e.is_out_of_memory());
        assert_eq!(
            e.to_string(),
            "cudnnBackendFinalize on CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR failed with \
             CUDNN_STATUS_NOT_SUPPORTED_SHAPE (3002)"
        );
        let tagged = e.for_engine(ConvOp::BackwardFilter, Some("eng0"));
        assert!(tagged
            .to_string()
            .ends_with("(3002) for bwd_filter engine eng0"));
        // Already-recorded context wins.
        let again = tagged.clone().for_engine(ConvOp::Forward, Some("eng1"));
        assert_eq!(again, tagged);
        let bad = CudnnError::Backend {
            call: "cudnnBackendSetAttribute",
            descriptor: "CUDNN_BACKEND_TENSOR_DESCRIPTOR",
            status: "CUDNN_STATUS_BAD_PARAM".into(),
            code: 2000,
            op: Some(ConvOp::Forward),
            engine: None,
        };
        assert!(!bad.is_not_supported());
        assert!(bad.to_string().ends_with("(2000) for fwd"));
        let oom = CudnnError::Backend {
            call: "cudnnBackendExecute",
            descriptor: "CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR",
            status: "CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED".into(),
            code: 4004,
            op: None,
            engine: None,
        };
        assert!(oom.is_out_of_memory());
        let declined = CudnnError::EngineNotSupported {
            op: ConvOp::Forward,
            engine: "eng1_k2=3".into(),
            reason: "math mode fma excludes tensor cores".into(),
        };
        assert!(declined.is_not_supported());
        assert_eq!(
            declined.to_string(),
            "engine eng1_k2=3 is not used for fwd: math mode fma excludes tensor cores"
        );
        let misaligned = CudnnError::Misaligned {
            call: "EnginePlan::execute",
            operand: "a",
            address: 0x7f00_0002,
            required: 16,
        };
        assert!(!misaligned.is_not_supported());
        assert!(misaligned.to_string().contains("a at address 0x7f000002"));
        assert!(misaligned.to_string().contains("16-byte alignment"));
    }

    #[test]
    fn a_missing_sub_library_is_an_error_not_a_skip() {
        let e = CudnnError::Backend {
            call: "cudnnBackendFinalize",
            descriptor: "CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR",
            status: "CUDNN_STATUS_NOT_SUPPORTED_SUBLIBRARY_UNAVAILABLE".into(),
            code: SUBLIBRARY_UNAVAILABLE,
            op: None,
            engine: None,
        };
        assert!(!e.is_not_supported());
        assert!(e.is_unavailable());
        let legacy = CudnnError::Cudnn {
            call: "cudnnGetConvolutionForwardWorkspaceSize",
            status: "CUDNN_STATUS_NOT_SUPPORTED_SUBLIBRARY_UNAVAILABLE".into(),
            code: 3009,
            op: None,
            algo: None,
        };
        assert!(!legacy.is_not_supported());
        // Its neighbours are still skips.
        for code in [3000, 3008, 3010] {
            let e = CudnnError::Cudnn {
                call: "x",
                status: "CUDNN_STATUS_NOT_SUPPORTED".into(),
                code,
                op: None,
                algo: None,
            };
            assert!(e.is_not_supported() && !e.is_unavailable(), "{code}");
        }
    }
}
