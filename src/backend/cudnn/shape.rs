//! The shapes cuDNN sees for a [`ConvProblem`], and which tensor plays which part in each op.
//!
//! Pure arithmetic (no cuDNN): it decides the descriptor dimensions, the element counts the
//! FFI wall checks buffers against, and the element offsets of micro-batches.
//!
//! Dimensions are always listed in cuDNN's logical order whatever the layout: tensors
//! `[n, c, h, w]`, filters `[k, c / groups, r, s]` for a 2-D (or 1-D, unit-height) problem, and
//! `[n, c, d, h, w]`, `[k, c / groups, t, r, s]` for a 3-D one ([`ConvProblem::spatial_dims`]),
//! as cuDNN's Nd descriptors take them. The layout only changes the strides (NCHW / NCDHW: `w`
//! fastest; NHWC / NDHWC: `c` fastest; filters follow the activations). In both layouts the
//! batch is the outermost dimension, so the samples `[first, first + count)` of a tensor are
//! the contiguous elements `[first * per_sample, (first + count) * per_sample)`.

#![forbid(unsafe_code)]

use super::error::CudnnError;
use crate::solver::{ConvProblem, DType, Layout, MathMode};

pub use crate::solver::{operand_roles, Operand};

/// The most dimensions a cuDNN tensor descriptor has (`CUDNN_DIM_MAX`).
pub const MAX_DIMS: usize = 8;

/// A short list of values, at most [`MAX_DIMS`], used as a slice: a tensor's dims or strides
/// (4 for a 2-D problem, 5 for a 3-D one) or a convolution's per-spatial-dimension values
/// (2 or 3). `Copy`, so descriptor values stay plain data.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Nd<T> {
    len: u8,
    values: [T; MAX_DIMS],
}

impl<T: Copy + Default> Nd<T> {
    /// The first [`MAX_DIMS`] of `values` (callers never pass more; cuDNN never reports more).
    pub fn from_slice(values: &[T]) -> Self {
        let len = values.len().min(MAX_DIMS);
        let mut all = [T::default(); MAX_DIMS];
        all[..len].copy_from_slice(&values[..len]);
        Nd {
            len: len as u8,
            values: all,
        }
    }

    /// Each value through `f`.
    pub fn map<U: Copy + Default>(&self, f: impl FnMut(T) -> U) -> Nd<U> {
        let mapped: Vec<U> = self.iter().copied().map(f).collect();
        Nd::from_slice(&mapped)
    }
}

impl<T> std::ops::Deref for Nd<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.values[..usize::from(self.len)]
    }
}

impl<T> std::ops::DerefMut for Nd<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.values[..usize::from(self.len)]
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for Nd<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl<T: PartialEq, const N: usize> PartialEq<[T; N]> for Nd<T> {
    fn eq(&self, other: &[T; N]) -> bool {
        **self == other[..]
    }
}

impl<T: Copy + Default, const N: usize> From<[T; N]> for Nd<T> {
    fn from(values: [T; N]) -> Self {
        Nd::from_slice(&values)
    }
}

/// A validated problem in cuDNN's `int` terms.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConvShapes {
    /// `[n, c, h, w]`, or `[n, c, d, h, w]` for a 3-D problem.
    pub input: Nd<i32>,
    /// `[k, c / groups, r, s]`, or `[k, c / groups, t, r, s]`.
    pub filter: Nd<i32>,
    /// `[n, k, p, q]`, or `[n, k, o, p, q]`.
    pub output: Nd<i32>,
    /// `[pad_h, pad_w]`, or `[pad_d, pad_h, pad_w]`.
    pub pad: Nd<i32>,
    /// `[stride_h, stride_w]`, or `[stride_d, stride_h, stride_w]`.
    pub stride: Nd<i32>,
    /// `[dilation_h, dilation_w]`, or `[dilation_d, dilation_h, dilation_w]`.
    pub dilation: Nd<i32>,
    pub groups: i32,
    pub dtype: DType,
    pub layout: Layout,
    pub math: MathMode,
}

fn to_int(field: &'static str, value: i64) -> Result<i32, CudnnError> {
    i32::try_from(value).map_err(|_| CudnnError::InvalidArgument {
        call: "ConvShapes::new",
        detail: format!("{field} = {value} does not fit cuDNN's 32-bit int"),
    })
}

/// `leading` values, then the `spatial` ones (named per `[depth, height, width]`) as cuDNN
/// ints, the depth left out of a 2-D problem.
fn ints<const L: usize>(
    spatial_dims: usize,
    leading: [(&'static str, i64); L],
    spatial: [(&'static str, i64); 3],
) -> Result<Nd<i32>, CudnnError> {
    let skip = 3 - spatial_dims;
    let mut out = Vec::with_capacity(2 + spatial_dims);
    for (field, value) in leading.into_iter().chain(spatial.into_iter().skip(skip)) {
        out.push(to_int(field, value)?);
    }
    Ok(Nd::from_slice(&out))
}

impl ConvShapes {
    /// Validates `problem` ([`ConvProblem::validate`]) and converts it to cuDNN's sizes: 4-D
    /// tensors and 2 spatial values for a 2-D (or 1-D) problem, 5-D and 3 for a 3-D one.
    pub fn new(problem: &ConvProblem) -> Result<Self, CudnnError> {
        problem.validate()?;
        let p = problem;
        let spatial_dims = p.spatial_dims();
        let (o, pp, q) = p.output_dhw();
        Ok(ConvShapes {
            input: ints(
                spatial_dims,
                [("n", p.n), ("c", p.c)],
                [("d", p.d), ("h", p.h), ("w", p.w)],
            )?,
            filter: ints(
                spatial_dims,
                [("k", p.k), ("c / groups", p.c / p.groups)],
                [("t", p.t), ("r", p.r), ("s", p.s)],
            )?,
            output: ints(
                spatial_dims,
                [("n", p.n), ("k", p.k)],
                [("o", o), ("p", pp), ("q", q)],
            )?,
            pad: ints(
                spatial_dims,
                [],
                [("pad_d", p.pad_d), ("pad_h", p.pad_h), ("pad_w", p.pad_w)],
            )?,
            stride: ints(
                spatial_dims,
                [],
                [
                    ("stride_d", p.stride_d),
                    ("stride_h", p.stride_h),
                    ("stride_w", p.stride_w),
                ],
            )?,
            dilation: ints(
                spatial_dims,
                [],
                [
                    ("dilation_d", p.dilation_d),
                    ("dilation_h", p.dilation_h),
                    ("dilation_w", p.dilation_w),
                ],
            )?,
            groups: to_int("groups", p.groups)?,
            dtype: p.dtype,
            layout: p.layout,
            math: p.math,
        })
    }

    /// 2 or 3: the convolution descriptor's array length (tensors have two more dims).
    pub fn spatial_dims(&self) -> usize {
        self.pad.len()
    }

    /// The dimensions of `role` in cuDNN's logical order.
    pub fn dims(&self, role: Operand) -> Nd<i32> {
        match role {
            Operand::Input => self.input,
            Operand::Filter => self.filter,
            Operand::Output => self.output,
        }
    }

    /// Number of elements of `role` (validation keeps it below 2^31).
    pub fn elements(&self, role: Operand) -> usize {
        self.dims(role).iter().map(|&d| d as usize).product()
    }

    /// Elements of one sample of `role` (`c*h*w` / `c*d*h*w`, or `k*p*q` / `k*o*p*q`); the
    /// whole filter for `Filter`.
    pub fn elements_per_sample(&self, role: Operand) -> usize {
        let dims = self.dims(role);
        if role.is_batched() {
            dims[1..].iter().map(|&d| d as usize).product()
        } else {
            self.elements(role)
        }
    }

    /// Batch size of the batched tensors.
    pub fn batch(&self) -> usize {
        self.input[0] as usize
    }

    /// The element range `(offset, len)` that samples `[first, first + count)` of `role`
    /// occupy in a tensor of this problem's full batch, or `None` when the range leaves it.
    /// For `Filter` (no batch dimension) it is always the whole filter.
    pub fn sample_range(
        &self,
        role: Operand,
        first: usize,
        count: usize,
    ) -> Option<(usize, usize)> {
        if !role.is_batched() {
            return Some((0, self.elements(role)));
        }
        let end = first.checked_add(count)?;
        if end > self.batch() {
            return None;
        }
        let per = self.elements_per_sample(role);
        Some((first * per, count * per))
    }

    /// Bytes of `role`.
    pub fn bytes(&self, role: Operand) -> usize {
        self.elements(role) * self.dtype.size_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::solver::ConvOp;

    fn grouped() -> ConvProblem {
        ConvProblem {
            pad_h: 1,
            pad_w: 2,
            stride_h: 2,
            stride_w: 1,
            dilation_h: 1,
            dilation_w: 2,
            groups: 2,
            layout: Layout::Nhwc,
            dtype: DType::Fp16,
            ..ConvProblem::new(8, 6, 9, 10, 4, 3, 3)
        }
    }

    #[test]
    fn dims_follow_cudnn_logical_order() {
        let s = ConvShapes::new(&grouped()).unwrap();
        assert_eq!(s.input, [8, 6, 9, 10]);
        assert_eq!(s.filter, [4, 3, 3, 3]);
        // p = (9 + 2 - 3) / 2 + 1 = 5; q = (10 + 4 - 5) / 1 + 1 = 10
        assert_eq!(s.output, [8, 4, 5, 10]);
        assert_eq!(s.pad, [1, 2]);
        assert_eq!(s.stride, [2, 1]);
        assert_eq!(s.dilation, [1, 2]);
        assert_eq!(s.groups, 2);
        assert_eq!(s.elements(Operand::Input), 8 * 6 * 9 * 10);
        assert_eq!(s.elements(Operand::Filter), 4 * 3 * 3 * 3);
        assert_eq!(s.bytes(Operand::Output), 8 * 4 * 5 * 10 * 2);
    }

    #[test]
    fn micro_batch_ranges() {
        let s = ConvShapes::new(&grouped()).unwrap();
        assert_eq!(s.elements_per_sample(Operand::Input), 6 * 9 * 10);
        assert_eq!(
            s.sample_range(Operand::Input, 3, 2),
            Some((3 * 540, 2 * 540))
        );
        assert_eq!(
            s.sample_range(Operand::Output, 6, 2),
            Some((6 * 200, 2 * 200))
        );
        assert_eq!(s.sample_range(Operand::Output, 7, 2), None);
        assert_eq!(s.sample_range(Operand::Output, usize::MAX, 2), None);
        assert_eq!(s.sample_range(Operand::Filter, 5, 1), Some((0, 108)));
        // The micro-batches of a split tile the tensor exactly.
        let mut next = 0;
        for (first, count) in [(0, 3), (3, 4), (7, 1)] {
            let (offset, len) = s.sample_range(Operand::Input, first, count).unwrap();
            assert_eq!(offset, next);
            next = offset + len;
        }
        assert_eq!(next, s.elements(Operand::Input));
    }

    #[test]
    fn three_d_problems_have_5d_dims_and_3_spatial_values() {
        // The Wan 2.1 VAE decoder's 384-channel conv: depth padded outside (causal), so pad_d 0.
        let vae = ConvProblem {
            pad_h: 1,
            pad_w: 1,
            dtype: DType::Fp16,
            layout: Layout::Nhwc,
            ..ConvProblem::new_3d(1, 384, 7, 60, 104, 384, 3, 3, 3)
        };
        let s = ConvShapes::new(&vae).unwrap();
        assert_eq!(s.spatial_dims(), 3);
        assert_eq!(s.input, [1, 384, 7, 60, 104]);
        assert_eq!(s.filter, [384, 384, 3, 3, 3]);
        assert_eq!(s.output, [1, 384, 5, 60, 104]);
        assert_eq!(s.pad, [0, 1, 1]);
        assert_eq!(s.stride, [1, 1, 1]);
        assert_eq!(s.dilation, [1, 1, 1]);
        // A strided, grouped 3-D problem: micro-batch ranges count the depth.
        let p = ConvProblem {
            pad_d: 1,
            stride_d: 2,
            dilation_h: 2,
            groups: 2,
            ..ConvProblem::new_3d(6, 4, 5, 7, 8, 6, 3, 2, 3)
        };
        let s = ConvShapes::new(&p).unwrap();
        // o = (5 + 2 - 3) / 2 + 1 = 3; p = 7 - 2 = 5; q = 8 - 2 = 6
        assert_eq!(s.output, [6, 6, 3, 5, 6]);
        assert_eq!(s.filter, [6, 2, 3, 2, 3]);
        assert_eq!(s.elements_per_sample(Operand::Input), 4 * 5 * 7 * 8);
        assert_eq!(s.elements_per_sample(Operand::Output), 6 * 3 * 5 * 6);
        for role in [Operand::Input, Operand::Output, Operand::Filter] {
            assert_eq!(
                s.elements(role),
                role.dims(&p).iter().product::<i64>() as usize
            );
            assert_eq!(s.elements_per_sample(role), role.elements_per_sample(&p));
        }
        assert_eq!(
            s.sample_range(Operand::Output, 2, 3),
            Some((2 * 540, 3 * 540))
        );
        // A 3-D problem with the 2-D defaults in depth is the 2-D problem: 4-D shapes.
        let flat = ConvProblem::new_3d(2, 3, 1, 9, 9, 4, 1, 3, 3);
        let s = ConvShapes::new(&flat).unwrap();
        assert_eq!(s.spatial_dims(), 2);
        assert_eq!(s.input, [2, 3, 9, 9]);
        // 1-D: unit height.
        let s = ConvShapes::new(&ConvProblem::new_1d(2, 3, 50, 4, 5)).unwrap();
        assert_eq!(
            (s.input, s.output),
            ([2, 3, 1, 50].into(), [2, 4, 1, 46].into())
        );
    }

    #[test]
    fn nd_is_a_short_slice() {
        let mut v: Nd<i32> = [1, 2, 3].into();
        assert_eq!(v.len(), 3);
        assert_eq!(v, [1, 2, 3]);
        v[1] = 7;
        assert_eq!(format!("{v:?}"), "[1, 7, 3]");
        assert_eq!(v.map(i64::from), [1i64, 7, 3]);
        assert_ne!(v, Nd::from_slice(&[1, 7]));
        assert_eq!(Nd::from_slice(&[0; 12]).len(), MAX_DIMS);
    }

    #[test]
    fn roles_per_op() {
        assert_eq!(
            operand_roles(ConvOp::Forward),
            [Operand::Input, Operand::Filter, Operand::Output]
        );
        assert_eq!(
            operand_roles(ConvOp::BackwardData),
            [Operand::Filter, Operand::Output, Operand::Input]
        );
        assert_eq!(
            operand_roles(ConvOp::BackwardFilter),
            [Operand::Input, Operand::Output, Operand::Filter]
        );
    }

    #[test]
    fn invalid_and_oversized_problems_are_errors() {
        let bad = ConvProblem {
            groups: 4,
            ..grouped()
        };
        assert!(matches!(
            ConvShapes::new(&bad),
            Err(CudnnError::Shape(crate::solver::ShapeError::Groups { .. }))
        ));
        // A padding past cuDNN's int (output 2x2): refused by the shape check itself.
        let huge_pad = ConvProblem {
            pad_h: 1 << 40,
            pad_w: 1 << 40,
            stride_h: 1 << 41,
            stride_w: 1 << 41,
            ..ConvProblem::new(1, 1, 4, 4, 1, 1, 1)
        };
        assert!(huge_pad.validate().is_err());
        let err = ConvShapes::new(&huge_pad).unwrap_err();
        assert!(err.to_string().contains("is more than 2^31 - 1"), "{err}");
    }
}
