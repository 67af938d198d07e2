//! The shapes cuDNN sees for a [`ConvProblem`], and which tensor plays which part in each op.
//!
//! Pure arithmetic (no cuDNN): it decides the descriptor dimensions, the element counts the
//! FFI wall checks buffers against, and the element offsets of micro-batches.
//!
//! Dimensions are always listed in cuDNN's logical order whatever the layout: tensors
//! `[n, c, h, w]`, filters `[k, c / groups, r, s]`. The layout only changes the strides
//! (NCHW: `w` fastest; NHWC: `c` fastest; filters follow the activations). In both layouts
//! the batch is the outermost dimension, so the samples `[first, first + count)` of a tensor
//! are the contiguous elements `[first * per_sample, (first + count) * per_sample)`.

#![forbid(unsafe_code)]

use super::error::CudnnError;
use crate::solver::{ConvProblem, DType, Layout, MathMode};

pub use crate::solver::{operand_roles, Operand};

/// A validated problem in cuDNN's `int` terms.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConvShapes {
    /// `[n, c, h, w]`.
    pub input: [i32; 4],
    /// `[k, c / groups, r, s]`.
    pub filter: [i32; 4],
    /// `[n, k, p, q]`.
    pub output: [i32; 4],
    /// `[pad_h, pad_w]`.
    pub pad: [i32; 2],
    /// `[stride_h, stride_w]`.
    pub stride: [i32; 2],
    /// `[dilation_h, dilation_w]`.
    pub dilation: [i32; 2],
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

impl ConvShapes {
    /// Validates `problem` ([`ConvProblem::validate`]) and converts it to cuDNN's sizes.
    pub fn new(problem: &ConvProblem) -> Result<Self, CudnnError> {
        problem.validate()?;
        let (p, q) = problem.output_hw();
        Ok(ConvShapes {
            input: [
                to_int("n", problem.n)?,
                to_int("c", problem.c)?,
                to_int("h", problem.h)?,
                to_int("w", problem.w)?,
            ],
            filter: [
                to_int("k", problem.k)?,
                to_int("c / groups", problem.c / problem.groups)?,
                to_int("r", problem.r)?,
                to_int("s", problem.s)?,
            ],
            output: [
                to_int("n", problem.n)?,
                to_int("k", problem.k)?,
                to_int("p", p)?,
                to_int("q", q)?,
            ],
            pad: [
                to_int("pad_h", problem.pad_h)?,
                to_int("pad_w", problem.pad_w)?,
            ],
            stride: [
                to_int("stride_h", problem.stride_h)?,
                to_int("stride_w", problem.stride_w)?,
            ],
            dilation: [
                to_int("dilation_h", problem.dilation_h)?,
                to_int("dilation_w", problem.dilation_w)?,
            ],
            groups: to_int("groups", problem.groups)?,
            dtype: problem.dtype,
            layout: problem.layout,
            math: problem.math,
        })
    }

    /// The dimensions of `role` in cuDNN's logical order.
    pub fn dims(&self, role: Operand) -> [i32; 4] {
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

    /// Elements of one sample of `role` (`c*h*w` or `k*p*q`); the whole filter for `Filter`.
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
