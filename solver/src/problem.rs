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

/// Memory layout of activations and filters (filters use the same layout as activations):
/// channels before the spatial dimensions (`nchw`; for 3-D problems NCDHW, for 1-D NCW) or
/// last (`nhwc`; NDHWC, NWC). The names by rank (`ncdhw`, `ndhwc`, `ncw`, `nwc`) parse to the
/// same two layouts; [`ConvProblem::layout_name`] prints the one that fits a problem's rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Layout {
    #[serde(alias = "ncdhw", alias = "ncw")]
    Nchw,
    #[serde(alias = "ndhwc", alias = "nwc")]
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
impl Layout {
    /// Every name a layout is written with, the rank-specific ones included (the command line's
    /// and network files' allowed values).
    pub const ALL_NAMES: &'static [&'static str] =
        &["nchw", "nhwc", "ncdhw", "ndhwc", "ncw", "nwc"];

    /// The 2-D name (`nchw`, `nhwc`): the one stored in caches and profiles.
    pub fn name(self) -> &'static str {
        match self {
            Layout::Nchw => "nchw",
            Layout::Nhwc => "nhwc",
        }
    }

    /// The layout's name for a problem of `spatial_dims` spatial dimensions (1, 2 or 3).
    pub fn name_for_rank(self, spatial_dims: usize) -> &'static str {
        match (self, spatial_dims) {
            (Layout::Nchw, 1) => "ncw",
            (Layout::Nhwc, 1) => "nwc",
            (Layout::Nchw, 3) => "ncdhw",
            (Layout::Nhwc, 3) => "ndhwc",
            (layout, _) => layout.name(),
        }
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Parses a layout name of any rank (`ncdhw` is [`Layout::Nchw`], `nwc` is [`Layout::Nhwc`]).
impl FromStr for Layout {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "nchw" | "ncdhw" | "ncw" => Ok(Layout::Nchw),
            "nhwc" | "ndhwc" | "nwc" => Ok(Layout::Nhwc),
            _ => Err(format!(
                "unknown layout `{s}` (expected one of: {})",
                Layout::ALL_NAMES.join(", ")
            )),
        }
    }
}
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

/// A convolution of 1, 2 or 3 spatial dimensions: input `n x c x d x h x w`, `k` filters of
/// `c/groups x t x r x s`.
///
/// A 2-D problem has the depth fields at their defaults (`d = t = 1`, `pad_d = 0`,
/// `stride_d = dilation_d = 1`), and a 3-D problem with those values *is* that 2-D problem (the
/// same arithmetic over the same memory); [`ConvProblem::spatial_dims`] is 3 exactly when a
/// depth field differs. A 1-D problem (input `n x c x w`) is the 2-D problem with `h = r = 1`
/// and `pad_h = 0`, which is how cuDNN runs it too. The depth fields are left out of the JSON
/// form of a 2-D problem, so files written before they existed read back as 2-D.
///
/// Sizes are `i64` so that a negative value read from a file or a C caller is reported by
/// [`ConvProblem::validate`] instead of wrapping around.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ConvProblem {
    pub n: i64,
    pub c: i64,
    /// Input depth (3-D only; 1 otherwise).
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub d: i64,
    pub h: i64,
    pub w: i64,
    pub k: i64,
    /// Filter depth (3-D only; 1 otherwise).
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub t: i64,
    pub r: i64,
    pub s: i64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub pad_d: i64,
    pub pad_h: i64,
    pub pad_w: i64,
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub stride_d: i64,
    pub stride_h: i64,
    pub stride_w: i64,
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub dilation_d: i64,
    pub dilation_h: i64,
    pub dilation_w: i64,
    pub groups: i64,
    pub dtype: DType,
    pub layout: Layout,
    #[serde(default)]
    pub math: MathMode,
}

fn one() -> i64 {
    1
}

fn is_one(v: &i64) -> bool {
    *v == 1
}

fn is_zero(v: &i64) -> bool {
    *v == 0
}

/// The most elements a problem's input or output may have: 2^60, so that its bytes (8 at
/// most an element) and every offset into it fit an `i64`. A call's operands are bounded far
/// lower, by 32-bit indexing ([`crate::indexing`]).
pub const MAX_TENSOR_ELEMENTS: i64 = 1 << 60;

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
    /// The filter is whole in every call, so it must fit 32-bit indexing; the input and output
    /// may be larger (a plan splits them: [`crate::indexing`]) as long as their byte counts
    /// fit 64 bits.
    #[error("tensor too large: {what} has more than {limit} elements")]
    TooLarge {
        what: &'static str,
        limit: &'static str,
    },
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
            d: 1,
            h,
            w,
            k,
            t: 1,
            r,
            s,
            pad_d: 0,
            pad_h: 0,
            pad_w: 0,
            stride_d: 1,
            stride_h: 1,
            stride_w: 1,
            dilation_d: 1,
            dilation_h: 1,
            dilation_w: 1,
            groups: 1,
            dtype: DType::Fp32,
            layout: Layout::Nchw,
            math: MathMode::Default,
        }
    }

    /// A stride-1, unpadded, undilated, ungrouped fp32 NCDHW convolution: input
    /// `n x c x d x h x w`, `k` filters of `c x t x r x s`.
    #[allow(clippy::too_many_arguments)]
    pub fn new_3d(n: i64, c: i64, d: i64, h: i64, w: i64, k: i64, t: i64, r: i64, s: i64) -> Self {
        ConvProblem {
            d,
            t,
            ..ConvProblem::new(n, c, h, w, k, r, s)
        }
    }

    /// A stride-1, unpadded, undilated, ungrouped fp32 NCW convolution: input `n x c x w`, `k`
    /// filters of `c x s` (the 2-D problem with unit height).
    pub fn new_1d(n: i64, c: i64, w: i64, k: i64, s: i64) -> Self {
        ConvProblem::new(n, c, 1, w, k, 1, s)
    }

    /// 3 when any depth field differs from its 2-D value, else 2 (a 1-D problem is a 2-D one
    /// with unit height; see the type's docs).
    pub fn spatial_dims(&self) -> usize {
        if self.d != 1
            || self.t != 1
            || self.pad_d != 0
            || self.stride_d != 1
            || self.dilation_d != 1
        {
            3
        } else {
            2
        }
    }

    /// Whether this is a 3-D problem ([`ConvProblem::spatial_dims`] is 3).
    pub fn is_3d(&self) -> bool {
        self.spatial_dims() == 3
    }

    /// Whether this reads as a 1-D problem: 2-D with unit height, unit filter height and no
    /// height padding (the key does not tell it apart from such a 2-D problem, which is the
    /// same convolution; only names differ).
    pub fn is_1d(&self) -> bool {
        !self.is_3d() && self.h == 1 && self.r == 1 && self.pad_h == 0
    }

    /// The layout's name at this problem's rank (`ncdhw` for a 3-D NCHW-family problem, `nwc`
    /// for a 1-D channels-last one).
    pub fn layout_name(&self) -> &'static str {
        let rank = if self.is_1d() { 1 } else { self.spatial_dims() };
        self.layout.name_for_rank(rank)
    }

    /// Input dims `[n, c, d, h, w]`.
    pub fn input_dims(&self) -> [i64; 5] {
        [self.n, self.c, self.d, self.h, self.w]
    }

    /// Filter dims `[k, c/groups, t, r, s]`.
    pub fn filter_dims(&self) -> [i64; 5] {
        [self.k, self.c / self.groups.max(1), self.t, self.r, self.s]
    }

    /// Output dims `[n, k, o, p, q]`. Meaningful only for a validated problem.
    pub fn output_dims(&self) -> [i64; 5] {
        let (o, p, q) = self.output_dhw();
        [self.n, self.k, o, p, q]
    }

    /// Checks every field; the output sizes of a valid problem are at least 1.
    pub fn validate(&self) -> Result<(), ShapeError> {
        let positive = [
            ("n", self.n),
            ("c", self.c),
            ("d", self.d),
            ("h", self.h),
            ("w", self.w),
            ("k", self.k),
            ("t", self.t),
            ("r", self.r),
            ("s", self.s),
            ("stride_d", self.stride_d),
            ("stride_h", self.stride_h),
            ("stride_w", self.stride_w),
            ("dilation_d", self.dilation_d),
            ("dilation_h", self.dilation_h),
            ("dilation_w", self.dilation_w),
            ("groups", self.groups),
        ];
        for (field, value) in positive {
            if value <= 0 {
                return Err(ShapeError::NotPositive { field, value });
            }
        }
        let padding = [
            ("pad_d", self.pad_d),
            ("pad_h", self.pad_h),
            ("pad_w", self.pad_w),
        ];
        for (field, value) in padding {
            if value < 0 {
                return Err(ShapeError::Negative { field, value });
            }
        }
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
                "depth",
                self.d,
                self.pad_d,
                self.t,
                self.stride_d,
                self.dilation_d,
            ),
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
        // The filter is in every call whole: 32-bit indexing bounds it. The input and output
        // are split by plans (`crate::indexing`): their element counts need only leave room
        // for byte counts and offsets in 64 bits.
        let elements = |dims: &[i64]| dims.iter().try_fold(1i64, |acc, &d| acc.checked_mul(d));
        for (what, dims, limit, name) in [
            ("input", self.input_dims(), MAX_TENSOR_ELEMENTS, "2^60"),
            (
                "filter",
                self.filter_dims(),
                i64::from(i32::MAX),
                "2^31 - 1",
            ),
            ("output", self.output_dims(), MAX_TENSOR_ELEMENTS, "2^60"),
        ] {
            if elements(&dims).is_none_or(|e| e > limit) {
                return Err(ShapeError::TooLarge { what, limit: name });
            }
        }
        Ok(())
    }

    /// Output height and width (`p`, `q`). Meaningful only for a validated problem.
    pub fn output_hw(&self) -> (i64, i64) {
        let (_, p, q) = self.output_dhw();
        (p, q)
    }

    /// Output depth, height and width (`o`, `p`, `q`; `o = 1` for a 2-D problem). Meaningful
    /// only for a validated problem.
    pub fn output_dhw(&self) -> (i64, i64, i64) {
        let out = |input: i64, pad: i64, filter: i64, stride: i64, dilation: i64| {
            (input + 2 * pad - dilation * (filter - 1) - 1) / stride.max(1) + 1
        };
        (
            out(self.d, self.pad_d, self.t, self.stride_d, self.dilation_d),
            out(self.h, self.pad_h, self.r, self.stride_h, self.dilation_h),
            out(self.w, self.pad_w, self.s, self.stride_w, self.dilation_w),
        )
    }

    /// The same problem at another batch size (a micro-batch of this one).
    pub fn with_batch(&self, n: i64) -> Self {
        ConvProblem { n, ..*self }
    }

    /// Compact human description, e.g. `256x96x27x27 * 256x96x5x5 pad 2 stride 1 fp32 nchw`;
    /// a 3-D problem shows its depths (`2x64x8x56x56 * 64x64x3x3x3 pad 1 fp16 ndhwc`).
    pub fn describe(&self) -> String {
        let dims = |v: &[i64]| v.iter().map(i64::to_string).collect::<Vec<_>>().join("x");
        let three = self.is_3d();
        let one = self.is_1d();
        let pick = |a: [i64; 5]| {
            if one {
                vec![a[0], a[1], a[4]]
            } else if three {
                a.to_vec()
            } else {
                vec![a[0], a[1], a[3], a[4]]
            }
        };
        let mut text = format!(
            "{} * {}",
            dims(&pick(self.input_dims())),
            dims(&pick(self.filter_dims()))
        );
        let tuple = |d: i64, h: i64, w: i64, neutral: i64| {
            let all: Vec<i64> = if one {
                vec![w]
            } else if three {
                vec![d, h, w]
            } else {
                vec![h, w]
            };
            if all.iter().all(|&v| v == neutral) {
                None
            } else if all.iter().all(|&v| v == all[0]) {
                Some(all[0].to_string())
            } else {
                Some(all.iter().map(i64::to_string).collect::<Vec<_>>().join(","))
            }
        };
        if let Some(pad) = tuple(self.pad_d, self.pad_h, self.pad_w, 0) {
            text += &format!(" pad {pad}");
        }
        if let Some(stride) = tuple(self.stride_d, self.stride_h, self.stride_w, 1) {
            text += &format!(" stride {stride}");
        }
        if let Some(dilation) = tuple(self.dilation_d, self.dilation_h, self.dilation_w, 1) {
            text += &format!(" dilation {dilation}");
        }
        if self.groups != 1 {
            text += &format!(" groups {}", self.groups);
        }
        text += &format!(" {} {}", self.dtype, self.layout_name());
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
        // Past 2^31 elements is a problem to split; past 2^60, no problem at all.
        ConvProblem {
            n: 1 << 20,
            c: 1 << 10,
            ..base
        }
        .validate()
        .unwrap();
        assert!(matches!(
            ConvProblem {
                n: 1 << 30,
                c: 1 << 30,
                ..base
            }
            .validate(),
            Err(ShapeError::TooLarge { what: "input", .. })
        ));
        // A filter is whole in every call: 2^31 elements of it are too many.
        let wide = ConvProblem {
            c: 1 << 16,
            k: 1 << 15,
            ..base
        };
        assert_eq!(
            wide.validate(),
            Err(ShapeError::TooLarge {
                what: "filter",
                limit: "2^31 - 1"
            })
        );
        assert_eq!(
            wide.validate().unwrap_err().to_string(),
            "tensor too large: filter has more than 2^31 - 1 elements"
        );
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
    fn three_d_output_sizes_and_rank() {
        let p = ConvProblem {
            pad_d: 1,
            pad_h: 1,
            pad_w: 1,
            stride_d: 2,
            stride_h: 2,
            stride_w: 2,
            ..ConvProblem::new_3d(2, 3, 17, 60, 104, 8, 3, 3, 3)
        };
        p.validate().unwrap();
        assert_eq!(p.spatial_dims(), 3);
        // (17 + 2 - 3) / 2 + 1 = 9; (60 + 2 - 3) / 2 + 1 = 30; (104 + 2 - 3) / 2 + 1 = 52
        assert_eq!(p.output_dims(), [2, 8, 9, 30, 52]);
        assert_eq!(
            p.describe(),
            "2x3x17x60x104 * 8x3x3x3x3 pad 1 stride 2 fp32 ncdhw"
        );
        assert!(matches!(
            ConvProblem { t: 40, ..p }.validate(),
            Err(ShapeError::EmptyOutput { axis: "depth", .. })
        ));
        assert!(matches!(
            ConvProblem { pad_d: -1, ..p }.validate(),
            Err(ShapeError::Negative { field: "pad_d", .. })
        ));
        // 1-D is 2-D with unit height; 2-D is 3-D with unit depth.
        let one = ConvProblem {
            stride_w: 5,
            layout: Layout::Nhwc,
            ..ConvProblem::new_1d(4, 512, 16000, 512, 10)
        };
        assert_eq!(one.spatial_dims(), 2);
        assert!(one.is_1d());
        assert_eq!(one.describe(), "4x512x16000 * 512x512x10 stride 5 fp32 nwc");
        let one = ConvProblem::new_1d(4, 512, 16000, 512, 10);
        assert_eq!(one.output_dims(), [4, 512, 1, 1, 15991]);
        let flat = ConvProblem::new_3d(2, 3, 1, 8, 8, 4, 1, 3, 3);
        assert_eq!(flat, ConvProblem::new(2, 3, 8, 8, 4, 3, 3));
        assert_eq!(flat.spatial_dims(), 2);
    }

    #[test]
    fn json_of_a_2d_problem_has_no_depth_fields_and_old_json_reads_as_2d() {
        let p = ConvProblem::new(2, 3, 8, 8, 4, 3, 3);
        let json = serde_json::to_string(&p).unwrap();
        for field in ["\"d\"", "\"t\"", "pad_d", "stride_d", "dilation_d"] {
            assert!(!json.contains(field), "{json}");
        }
        assert_eq!(serde_json::from_str::<ConvProblem>(&json).unwrap(), p);
        let q = ConvProblem {
            pad_d: 1,
            ..ConvProblem::new_3d(1, 2, 5, 6, 7, 3, 3, 3, 3)
        };
        let json = serde_json::to_string(&q).unwrap();
        assert!(json.contains("\"pad_d\":1"), "{json}");
        assert_eq!(serde_json::from_str::<ConvProblem>(&json).unwrap(), q);
    }

    #[test]
    fn names_round_trip() {
        for op in ConvOp::ALL {
            assert_eq!(op.name().parse::<ConvOp>().unwrap(), op);
        }
        assert_eq!("NHWC".parse::<Layout>().unwrap(), Layout::Nhwc);
        assert_eq!("NDHWC".parse::<Layout>().unwrap(), Layout::Nhwc);
        assert_eq!("ncw".parse::<Layout>().unwrap(), Layout::Nchw);
        assert!("nchwc".parse::<Layout>().unwrap_err().contains("ncdhw"));
        assert_eq!(
            serde_json::from_str::<Layout>("\"ndhwc\"").unwrap(),
            Layout::Nhwc
        );
        let err = "fp64".parse::<DType>().unwrap_err();
        assert!(err.contains("fp32, fp16, bf16"), "{err}");
        assert_eq!(
            serde_json::to_string(&ConvOp::BackwardData).unwrap(),
            "\"bwd_data\""
        );
    }
}
