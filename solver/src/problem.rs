//! The convolution problem key: everything that determines which algorithms exist and how
//! fast they run, and nothing else (no buffers, no device).
//!
//! A [`ConvProblem`] plus a [`ConvOp`] is one tuning problem. The key is shared by the
//! profiler (what to measure), the cache (what a row belongs to) and the solver (what a plan
//! is for). [`ConvProblem::validate`] is the one place that decides whether a shape makes sense.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// Element type of tensors and filters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    Fp32,
    Fp16,
    Bf16,
}

/// Memory layout of activations and filters (filters use the same layout as activations).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Layout {
    Nchw,
    Nhwc,
}

/// cuDNN math mode (`cudnnMathType_t`).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(rename_all = "kebab-case")]
pub enum MathMode {
    /// `CUDNN_DEFAULT_MATH`: tensor cores where the dtype allows (TF32 for fp32 by default).
    #[default]
    Default,
    /// `CUDNN_TENSOR_OP_MATH`.
    TensorOp,
    /// `CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION`.
    TensorOpAllowConversion,
    /// `CUDNN_FMA_MATH`: no tensor cores.
    Fma,
}

/// The three convolution operations of training.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum ConvOp {
    /// y = conv(x, w)
    #[serde(rename = "fwd")]
    Forward,
    /// dx = conv_transpose(dy, w)
    #[serde(rename = "bwd_data")]
    BackwardData,
    /// dw = sum over the batch of correlate(x, dy)
    #[serde(rename = "bwd_filter")]
    BackwardFilter,
}

impl ConvOp {
    pub const ALL: [ConvOp; 3] = [
        ConvOp::Forward,
        ConvOp::BackwardData,
        ConvOp::BackwardFilter,
    ];
}

macro_rules! names {
    ($ty:ty, $what:literal, $( $variant:path => $name:literal ),+ $(,)?) => {
        impl $ty {
            /// Every name, in declaration order (the command line's allowed values).
            pub const NAMES: &'static [&'static str] = &[$( $name ),+];

            /// The name used in the interchange format and on the command line.
            pub fn name(self) -> &'static str {
                match self { $( $variant => $name ),+ }
            }
        }
        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.name())
            }
        }
        impl FromStr for $ty {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, String> {
                match s.to_ascii_lowercase().as_str() {
                    $( $name => Ok($variant), )+
                    _ => Err(format!(
                        concat!("unknown ", $what, " `{}` (expected one of: {})"),
                        s,
                        [$( $name ),+].join(", ")
                    )),
                }
            }
        }
    };
}

names!(DType, "dtype", DType::Fp32 => "fp32", DType::Fp16 => "fp16", DType::Bf16 => "bf16");
names!(Layout, "layout", Layout::Nchw => "nchw", Layout::Nhwc => "nhwc");
names!(MathMode, "math mode",
    MathMode::Default => "default",
    MathMode::TensorOp => "tensor-op",
    MathMode::TensorOpAllowConversion => "tensor-op-allow-conversion",
    MathMode::Fma => "fma");
names!(ConvOp, "op",
    ConvOp::Forward => "fwd",
    ConvOp::BackwardData => "bwd_data",
    ConvOp::BackwardFilter => "bwd_filter");

impl DType {
    pub fn size_bytes(self) -> usize {
        match self {
            DType::Fp32 => 4,
            DType::Fp16 | DType::Bf16 => 2,
        }
    }
}

/// A 2-D convolution: input `n x c x h x w`, `k` filters of `c/groups x r x s`.
///
/// Sizes are `i64` so that a negative value read from a file or a C caller is reported by
/// [`ConvProblem::validate`] instead of wrapping around.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ConvProblem {
    pub n: i64,
    pub c: i64,
    pub h: i64,
    pub w: i64,
    pub k: i64,
    pub r: i64,
    pub s: i64,
    pub pad_h: i64,
    pub pad_w: i64,
    pub stride_h: i64,
    pub stride_w: i64,
    pub dilation_h: i64,
    pub dilation_w: i64,
    pub groups: i64,
    pub dtype: DType,
    pub layout: Layout,
    #[serde(default)]
    pub math: MathMode,
}

/// Why a [`ConvProblem`] is not a valid convolution.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ShapeError {
    #[error("{field} must be positive, got {value}")]
    NotPositive { field: &'static str, value: i64 },
    #[error("{field} must not be negative, got {value}")]
    Negative { field: &'static str, value: i64 },
    #[error(
        "channels ({channels}) and filters ({filters}) must both be divisible by groups ({groups})"
    )]
    Groups {
        channels: i64,
        filters: i64,
        groups: i64,
    },
    #[error(
        "output {axis} size is {size}: input {input} with padding {pad} is smaller than the dilated filter {dilated}"
    )]
    EmptyOutput {
        axis: &'static str,
        size: i64,
        input: i64,
        pad: i64,
        dilated: i64,
    },
    #[error("tensor too large: {what} has more than 2^31 elements")]
    TooLarge { what: &'static str },
    /// Every field is a C `int` to cuDNN and an index to the CPU backend.
    #[error("{field} = {value} is more than 2^31 - 1")]
    FieldTooLarge { field: &'static str, value: i64 },
}

impl ConvProblem {
    /// A stride-1, unpadded, undilated, ungrouped fp32 NCHW convolution; adjust fields from there.
    pub fn new(n: i64, c: i64, h: i64, w: i64, k: i64, r: i64, s: i64) -> Self {
        ConvProblem {
            n,
            c,
            h,
            w,
            k,
            r,
            s,
            pad_h: 0,
            pad_w: 0,
            stride_h: 1,
            stride_w: 1,
            dilation_h: 1,
            dilation_w: 1,
            groups: 1,
            dtype: DType::Fp32,
            layout: Layout::Nchw,
            math: MathMode::Default,
        }
    }

    /// Checks every field; the output sizes of a valid problem are at least 1.
    pub fn validate(&self) -> Result<(), ShapeError> {
        let positive = [
            ("n", self.n),
            ("c", self.c),
            ("h", self.h),
            ("w", self.w),
            ("k", self.k),
            ("r", self.r),
            ("s", self.s),
            ("stride_h", self.stride_h),
            ("stride_w", self.stride_w),
            ("dilation_h", self.dilation_h),
            ("dilation_w", self.dilation_w),
            ("groups", self.groups),
        ];
        for (field, value) in positive {
            if value <= 0 {
                return Err(ShapeError::NotPositive { field, value });
            }
        }
        for (field, value) in [("pad_h", self.pad_h), ("pad_w", self.pad_w)] {
            if value < 0 {
                return Err(ShapeError::Negative { field, value });
            }
        }
        let padding = [("pad_h", self.pad_h), ("pad_w", self.pad_w)];
        for (field, value) in positive.into_iter().chain(padding) {
            if value > i64::from(i32::MAX) {
                return Err(ShapeError::FieldTooLarge { field, value });
            }
        }
        if self.c % self.groups != 0 || self.k % self.groups != 0 {
            return Err(ShapeError::Groups {
                channels: self.c,
                filters: self.k,
                groups: self.groups,
            });
        }
        for (axis, input, pad, filter, stride, dilation) in [
            (
                "height",
                self.h,
                self.pad_h,
                self.r,
                self.stride_h,
                self.dilation_h,
            ),
            (
                "width",
                self.w,
                self.pad_w,
                self.s,
                self.stride_w,
                self.dilation_w,
            ),
        ] {
            let dilated = dilation.saturating_mul(filter - 1).saturating_add(1);
            let span = input.saturating_add(pad.saturating_mul(2)) - dilated;
            if span < 0 {
                let size = span.div_euclid(stride) + 1;
                return Err(ShapeError::EmptyOutput {
                    axis,
                    size,
                    input,
                    pad,
                    dilated,
                });
            }
        }
        let limit = 1i64 << 31;
        let elements = |dims: &[i64]| dims.iter().try_fold(1i64, |acc, &d| acc.checked_mul(d));
        let (p, q) = self.output_hw();
        for (what, dims) in [
            ("input", [self.n, self.c, self.h, self.w]),
            ("filter", [self.k, self.c / self.groups, self.r, self.s]),
            ("output", [self.n, self.k, p, q]),
        ] {
            if elements(&dims).is_none_or(|e| e >= limit) {
                return Err(ShapeError::TooLarge { what });
            }
        }
        Ok(())
    }

    /// Output height and width (`p`, `q`). Meaningful only for a validated problem.
    pub fn output_hw(&self) -> (i64, i64) {
        let out = |input: i64, pad: i64, filter: i64, stride: i64, dilation: i64| {
            (input + 2 * pad - dilation * (filter - 1) - 1) / stride.max(1) + 1
        };
        (
            out(self.h, self.pad_h, self.r, self.stride_h, self.dilation_h),
            out(self.w, self.pad_w, self.s, self.stride_w, self.dilation_w),
        )
    }

    /// The same problem at another batch size (a micro-batch of this one).
    pub fn with_batch(&self, n: i64) -> Self {
        ConvProblem { n, ..*self }
    }

    /// Compact human description, e.g. `256x96x27x27 * 256x96x5x5 pad 2 stride 1 fp32 nchw`.
    pub fn describe(&self) -> String {
        let mut text = format!(
            "{}x{}x{}x{} * {}x{}x{}x{}",
            self.n,
            self.c,
            self.h,
            self.w,
            self.k,
            self.c / self.groups.max(1),
            self.r,
            self.s
        );
        let pair = |a: i64, b: i64| {
            if a == b {
                a.to_string()
            } else {
                format!("{a},{b}")
            }
        };
        if self.pad_h != 0 || self.pad_w != 0 {
            text += &format!(" pad {}", pair(self.pad_h, self.pad_w));
        }
        if self.stride_h != 1 || self.stride_w != 1 {
            text += &format!(" stride {}", pair(self.stride_h, self.stride_w));
        }
        if self.dilation_h != 1 || self.dilation_w != 1 {
            text += &format!(" dilation {}", pair(self.dilation_h, self.dilation_w));
        }
        if self.groups != 1 {
            text += &format!(" groups {}", self.groups);
        }
        text += &format!(" {} {}", self.dtype, self.layout);
        if self.math != MathMode::Default {
            text += &format!(" {}", self.math);
        }
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alexnet_conv1() -> ConvProblem {
        ConvProblem {
            stride_h: 4,
            stride_w: 4,
            ..ConvProblem::new(256, 3, 227, 227, 96, 11, 11)
        }
    }

    #[test]
    fn output_size_matches_caffe_alexnet() {
        let p = alexnet_conv1();
        p.validate().unwrap();
        assert_eq!(p.output_hw(), (55, 55));
        let conv2 = ConvProblem {
            pad_h: 2,
            pad_w: 2,
            ..ConvProblem::new(256, 96, 27, 27, 256, 5, 5)
        };
        assert_eq!(conv2.output_hw(), (27, 27));
    }

    #[test]
    fn dilation_and_stride_output_size() {
        let p = ConvProblem {
            pad_h: 2,
            pad_w: 2,
            dilation_h: 2,
            dilation_w: 2,
            stride_h: 2,
            stride_w: 2,
            ..ConvProblem::new(1, 4, 9, 9, 4, 3, 3)
        };
        p.validate().unwrap();
        // (9 + 4 - 5) / 2 + 1 = 5
        assert_eq!(p.output_hw(), (5, 5));
    }

    #[test]
    fn bad_shapes_are_errors() {
        let base = ConvProblem::new(2, 4, 8, 8, 4, 3, 3);
        assert!(matches!(
            ConvProblem { n: -1, ..base }.validate(),
            Err(ShapeError::NotPositive {
                field: "n",
                value: -1
            })
        ));
        assert!(matches!(
            ConvProblem { pad_w: -1, ..base }.validate(),
            Err(ShapeError::Negative { .. })
        ));
        assert!(matches!(
            ConvProblem { groups: 3, ..base }.validate(),
            Err(ShapeError::Groups { .. })
        ));
        assert!(matches!(
            ConvProblem { r: 9, ..base }.validate(),
            Err(ShapeError::EmptyOutput { axis: "height", .. })
        ));
        assert!(matches!(
            ConvProblem { s: 0, ..base }.validate(),
            Err(ShapeError::NotPositive { field: "s", .. })
        ));
        assert!(matches!(
            ConvProblem {
                n: 1 << 20,
                c: 1 << 20,
                ..base
            }
            .validate(),
            Err(ShapeError::TooLarge { .. })
        ));
        // A stride (or padding) past a C int is refused before any backend converts it.
        assert_eq!(
            ConvProblem {
                stride_h: 1 << 62,
                ..base
            }
            .validate(),
            Err(ShapeError::FieldTooLarge {
                field: "stride_h",
                value: 1 << 62
            })
        );
        assert!(matches!(
            ConvProblem {
                pad_w: 1 << 31,
                ..base
            }
            .validate(),
            Err(ShapeError::FieldTooLarge { field: "pad_w", .. })
        ));
    }

    #[test]
    fn names_round_trip() {
        for op in ConvOp::ALL {
            assert_eq!(op.name().parse::<ConvOp>().unwrap(), op);
        }
        assert_eq!("NHWC".parse::<Layout>().unwrap(), Layout::Nhwc);
        let err = "fp64".parse::<DType>().unwrap_err();
        assert!(err.contains("fp32, fp16, bf16"), "{err}");
        assert_eq!(
            serde_json::to_string(&ConvOp::BackwardData).unwrap(),
            "\"bwd_data\""
        );
    }
}
