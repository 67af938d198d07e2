//! [`GpuTrainError`]: every failure of the GPU training building blocks, with the call and the
//! status that failed, or the argument that did not fit.
//!
//! Nothing here names cudarc: the FFI wall ([`super::ffi`]) converts cuBLAS and NCCL statuses
//! into these variants, keeping the status *name* and *number*; CUDA driver and cuDNN failures
//! keep the backend's own type ([`CudnnError`]), so that both walls report them alike.

#![forbid(unsafe_code)]

use crate::backend::cudnn::CudnnError;

/// Why a GPU training operation failed.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum GpuTrainError {
    /// The CUDA driver or cuDNN is missing or failed, or no GPU is visible: the same error the
    /// convolution backend gives (`libcuda`/`libcudnn` unavailable, a driver call, a cuDNN call
    /// with its `cudnnStatus_t` name and number).
    #[error(transparent)]
    Cudnn(#[from] CudnnError),

    /// A library only training needs is missing or unusable: `what` is `"libcublas"` or
    /// `"libnccl"`, and `detail` says what to install or where to point `LD_LIBRARY_PATH`.
    #[error("{what} unavailable: {detail}")]
    Unavailable { what: &'static str, detail: String },

    /// A cuBLAS call returned an error status.
    #[error("{call} failed with {status} ({code}) in {op}")]
    Cublas {
        /// The cuBLAS function, e.g. `cublasSgemm_v2`.
        call: &'static str,
        /// The `cublasStatus_t` name, e.g. `CUBLAS_STATUS_INVALID_VALUE`.
        status: String,
        /// The `cublasStatus_t` number.
        code: u32,
        /// The mucudnn operation the call was part of, e.g. `Linear::forward`.
        op: &'static str,
    },

    /// An NCCL call returned an error status.
    #[error("{call} failed with {status} ({code}): {detail}")]
    Nccl {
        /// The NCCL function, e.g. `ncclAllReduce`.
        call: &'static str,
        /// The `ncclResult_t` name, e.g. `ncclInvalidUsage`.
        status: String,
        /// The `ncclResult_t` number.
        code: u32,
        /// NCCL's description of the status and, where there is one, its last error message
        /// (plus what mucudnn knows: rank, world size, device).
        detail: String,
    },

    /// Arguments that do not fit together: a buffer of the wrong length, dtype or stream, a
    /// shape with a zero or too large dimension, an out-of-range rank, a bad hyper-parameter.
    #[error("invalid argument to {call}: {detail}")]
    InvalidArgument { call: &'static str, detail: String },
}

impl GpuTrainError {
    /// Training cannot run on this machine (a missing library, an old driver, no GPU): callers
    /// fall back to the CPU replica or report and stop.
    pub fn is_unavailable(&self) -> bool {
        match self {
            GpuTrainError::Cudnn(e) => e.is_unavailable(),
            GpuTrainError::Unavailable { .. } => true,
            _ => false,
        }
    }

    /// cuDNN said the configuration is not supported (e.g. an op in a dtype it lacks).
    pub fn is_not_supported(&self) -> bool {
        matches!(self, GpuTrainError::Cudnn(e) if e.is_not_supported())
    }
}

/// Shorthand for [`GpuTrainError::InvalidArgument`].
pub(crate) fn invalid(call: &'static str, detail: impl Into<String>) -> GpuTrainError {
    GpuTrainError::InvalidArgument {
        call,
        detail: detail.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_the_call_status_and_number() {
        let e = GpuTrainError::Cublas {
            call: "cublasSgemm_v2",
            status: "CUBLAS_STATUS_INVALID_VALUE".into(),
            code: 7,
            op: "Linear::forward",
        };
        assert_eq!(
            e.to_string(),
            "cublasSgemm_v2 failed with CUBLAS_STATUS_INVALID_VALUE (7) in Linear::forward"
        );
        assert!(!e.is_unavailable());
        let n = GpuTrainError::Nccl {
            call: "ncclAllReduce",
            status: "ncclInvalidUsage".into(),
            code: 5,
            detail: "invalid usage (rank 0 of 1 on device 0)".into(),
        };
        assert_eq!(
            n.to_string(),
            "ncclAllReduce failed with ncclInvalidUsage (5): invalid usage (rank 0 of 1 on device 0)"
        );
        let bad = invalid("Relu::forward", "x has 3 elements, the shape 4");
        assert_eq!(
            bad.to_string(),
            "invalid argument to Relu::forward: x has 3 elements, the shape 4"
        );
    }

    #[test]
    fn classification_follows_the_backend() {
        let missing = GpuTrainError::from(CudnnError::Unavailable {
            what: "libcudnn",
            detail: "not found".into(),
        });
        assert!(missing.is_unavailable());
        assert_eq!(missing.to_string(), "libcudnn unavailable: not found");
        let nccl = GpuTrainError::Unavailable {
            what: "libnccl",
            detail: "not found".into(),
        };
        assert!(nccl.is_unavailable());
        let unsupported = GpuTrainError::from(CudnnError::Cudnn {
            call: "cudnnPoolingForward",
            status: "CUDNN_STATUS_NOT_SUPPORTED".into(),
            code: 3000,
            op: None,
            algo: None,
        });
        assert!(unsupported.is_not_supported());
        assert!(!unsupported.is_unavailable());
    }
}
