//! Configurations that given cuDNN versions compute wrongly, kept as data: the candidates they
//! rule out are never enumerated, so never timed, cached or planned (legacy algorithms get a
//! math type without the bad kernels; engine configurations with the bad notes are left out).
//!
//! Data in: the loaded cuDNN's version (`cudnnGetVersion`: major * 10000 + minor * 100 +
//! patch, e.g. 91002 for 9.10.2) and a problem's dtype, spatial rank and math mode. Data out:
//! the math mode cuDNN is asked for ([`effective_math`]), which the legacy descriptors set and
//! the engine filter (`EngineNotes::math_conflict`) applies. Pure: tested without cuDNN, and
//! on the host tier against the real library's engine notes (`tests/cudnn_host.rs`).
//!
//! Verified tuning (`backend::verify`) compares every candidate's output with the reference's
//! (implicit GEMM with FMA math) and rejects one off by more than TF32's tolerance (about 4e-3
//! of the largest output): it would have rejected the one entry's broken TF32 3-D kernel
//! wherever that kernel computes wrong numbers at a size tuning measures (the shape's full
//! batch and its micro-batches, on random data), on any cuDNN version, without this list. The
//! list stays: it keeps the kernel from being built and timed at all, and covers what
//! verification cannot see (a wrong result that shows only on other data or at sizes never
//! measured, or an output that is wrong by less than the tolerance).

#![forbid(unsafe_code)]

use crate::solver::{DType, MathMode};

/// What a known-bad entry rules out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exclusion {
    /// Tensor-core kernels (TF32 for fp32 data): the problem runs as math mode `fma`.
    TensorCores,
}

/// One known-bad configuration: cuDNN versions `first..=last`, problems of `dtype` with
/// `spatial_dims` spatial dimensions (3: a 3-D convolution; 1-D problems run as 2-D ones).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KnownBad {
    pub first: u64,
    pub last: u64,
    pub dtype: DType,
    pub spatial_dims: usize,
    pub excludes: Exclusion,
    /// Why, with the source, for the log and the docs.
    pub why: &'static str,
}

impl KnownBad {
    /// Whether this entry applies to a problem of `dtype` and `spatial_dims` on `version`.
    pub fn applies(&self, version: u64, dtype: DType, spatial_dims: usize) -> bool {
        (self.first..=self.last).contains(&version)
            && dtype == self.dtype
            && spatial_dims == self.spatial_dims
    }
}

/// The list. cuDNN's team reported a broken TF32 kernel for 3-D convolutions "without clearly
/// defined constraints", known to affect 9.10.2 to 9.15, so PyTorch turned TF32 off for every
/// cuDNN 3-D convolution (pytorch/pytorch#167024); mucudnn does the same on those versions.
pub const KNOWN_BAD: &[KnownBad] = &[KnownBad {
    first: 9_10_02,
    last: 9_15_99,
    dtype: DType::Fp32,
    spatial_dims: 3,
    excludes: Exclusion::TensorCores,
    why: "cuDNN 9.10.2-9.15 has a broken TF32 kernel for 3-D convolutions \
          (https://github.com/pytorch/pytorch/pull/167024)",
}];

/// The entries of [`KNOWN_BAD`] that apply to a problem of `dtype` and `spatial_dims` on
/// cuDNN `version`.
pub fn known_bad(
    version: u64,
    dtype: DType,
    spatial_dims: usize,
) -> impl Iterator<Item = &'static KnownBad> {
    KNOWN_BAD
        .iter()
        .filter(move |bad| bad.applies(version, dtype, spatial_dims))
}

/// The math mode to ask cuDNN for: `math`, or `fma` where a known-bad entry rules out tensor
/// cores on this version (`fma` already excludes them; the other modes allow them).
pub fn effective_math(version: u64, dtype: DType, spatial_dims: usize, math: MathMode) -> MathMode {
    let no_tensor_cores =
        known_bad(version, dtype, spatial_dims).any(|bad| bad.excludes == Exclusion::TensorCores);
    if no_tensor_cores {
        MathMode::Fma
    } else {
        math
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tf32_3d_entry_covers_9_10_2_to_9_15_only() {
        let fp32_3d = |version| effective_math(version, DType::Fp32, 3, MathMode::Default);
        for version in [
            9_10_02, 9_10_99, 9_11_00, 9_14_00, 9_15_00, 9_15_01, 9_15_99,
        ] {
            assert_eq!(fp32_3d(version), MathMode::Fma, "{version}");
        }
        for version in [
            9_08_00, 9_10_00, 9_10_01, 9_16_00, 9_19_00, 9_28_01, 8_09_07,
        ] {
            assert_eq!(fp32_3d(version), MathMode::Default, "{version}");
        }
    }

    #[test]
    fn other_dtypes_ranks_and_modes_are_left_alone() {
        let version = 9_14_00; // the GPU machine's system cuDNN
        for dtype in [DType::Fp16, DType::Bf16] {
            assert_eq!(
                effective_math(version, dtype, 3, MathMode::Default),
                MathMode::Default
            );
        }
        assert_eq!(
            effective_math(version, DType::Fp32, 2, MathMode::TensorOp),
            MathMode::TensorOp
        );
        for math in [
            MathMode::Default,
            MathMode::TensorOp,
            MathMode::TensorOpAllowConversion,
            MathMode::Fma,
        ] {
            assert_eq!(effective_math(version, DType::Fp32, 3, math), MathMode::Fma);
        }
        assert_eq!(known_bad(version, DType::Fp32, 3).count(), 1);
        assert_eq!(known_bad(version, DType::Fp32, 2).count(), 0);
    }

    #[test]
    fn entries_are_well_formed() {
        for bad in KNOWN_BAD {
            assert!(bad.first <= bad.last, "{bad:?}");
            assert!((2..=3).contains(&bad.spatial_dims), "{bad:?}");
            assert!(bad.why.contains("https://"), "{bad:?}");
        }
    }
}
