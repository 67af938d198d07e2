//! 32-bit indexing: the most elements one call's operand may reach, and the micro-batch and
//! chunk sizes that stay within it.
//!
//! cuDNN indexes a tensor with 32-bit ints, so a call whose operand reaches more than
//! 2^31 - 1 elements from its first one cannot run (PyTorch splits such calls for the same
//! reason). A problem's tensors may be larger than that: a plan then splits them, so that
//! every call stays within the limit. What a call's operand reaches (its *span*) is the view
//! cuDNN is given:
//!
//! - a micro-batch of `m` samples is `m` whole samples, packed: `m` times a sample's elements;
//! - a spatial chunk is a view of the whole tensor along the split axis, with the tensor's own
//!   strides: every sample and channel of its rows. Channels-last (NHWC, NDHWC, NWC), a
//!   chunk of one sample's rows is contiguous; channels-first (NCHW), the rows of each channel
//!   lie a whole channel apart, so the view reaches from the first channel's first row to the
//!   last channel's last row (`span_of` in the cuDNN backend's graph parameters);
//! - the filter is whole in every call.
//!
//! A chunk's rows on the other side of the op (the input rows a forward chunk of output rows
//! reads, with its halo; the `dy` rows a backward-data chunk of `dx` rows takes) are counted
//! at their most, wherever the chunk lies ([`chunk_rows`]). Spans only grow with the size, so
//! the sizes that fit are `1..=` [`IndexLimit::largest_size`]; sizes above it are neither
//! measured nor offered to the solver ([`IndexLimit::sizes`]), as a size whose workspace
//! exceeds the limit is not timed. When not even a size of 1 fits (one sample's rows, the
//! filter), there is no plan: [`IndexError`] says why.
//!
//! The limit is a value ([`IndexLimit`]): cuDNN's ([`IndexLimit::CUDNN`]) everywhere, except
//! in tests, which lower it to run split plans on small tensors.

use crate::operand::{operand_roles, Operand};
use crate::problem::{ConvOp, ConvProblem, Layout};
use crate::profile::Policy;
use crate::spatial::{split_axis, Axis, AxisGeometry, SplitDim};
use std::fmt;

/// The most elements one call's operand may reach (its span, see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct IndexLimit(i64);

impl Default for IndexLimit {
    fn default() -> Self {
        IndexLimit::CUDNN
    }
}

impl fmt::Display for IndexLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if *self == IndexLimit::CUDNN {
            f.write_str("2^31 - 1")
        } else {
            write!(f, "{}", self.0)
        }
    }
}

impl IndexLimit {
    /// cuDNN's: 2^31 - 1 elements, a C `int`'s range.
    pub const CUDNN: IndexLimit = IndexLimit(i32::MAX as i64);

    /// A limit of `max_elements` (at least 1).
    pub fn new(max_elements: i64) -> Option<IndexLimit> {
        (max_elements >= 1).then_some(IndexLimit(max_elements))
    }

    pub fn max_elements(self) -> i64 {
        self.0
    }

    /// Whether every operand of a call of `op` on `problem` at `size` (samples of the batch,
    /// or rows of a spatial chunk) reaches at most this many elements. `problem` is valid.
    pub fn fits(self, problem: &ConvProblem, op: ConvOp, split: SplitDim, size: i64) -> bool {
        spans(problem, op, split, size)
            .iter()
            .all(|&(_, span)| span <= self.0)
    }

    /// The largest size of `split` (at most its extent) whose calls fit; an error when not
    /// even a size of 1 does. `problem` is valid.
    pub fn largest_size(
        self,
        problem: &ConvProblem,
        op: ConvOp,
        split: SplitDim,
    ) -> Result<i64, IndexError> {
        let extent = split.extent(problem, op);
        if let Some((operand, span)) = spans(problem, op, split, 1)
            .into_iter()
            .find(|&(_, span)| span > self.0)
        {
            return Err(IndexError::NoSizeFits {
                op,
                split,
                operand: operand_name(op, operand),
                span,
                limit: self,
                hint: no_fit_hint(problem, split, operand),
            });
        }
        // Spans grow with the size: the last size that fits, by bisection.
        let (mut fits, mut too_large) = (1, extent + 1);
        while too_large - fits > 1 {
            let mid = fits + (too_large - fits) / 2;
            if self.fits(problem, op, split, mid) {
                fits = mid;
            } else {
                too_large = mid;
            }
        }
        Ok(fits)
    }

    /// The sizes `policy` allows for `split` of `op` on `problem` that fit, ascending: those of
    /// [`Policy::sizes`] up to [`IndexLimit::largest_size`]. An error when none does (no size
    /// fits, or `undivided` and the whole extent does not). `problem` is valid.
    pub fn sizes(
        self,
        policy: Policy,
        problem: &ConvProblem,
        op: ConvOp,
        split: SplitDim,
    ) -> Result<Vec<i64>, IndexError> {
        let largest = self.largest_size(problem, op, split)?;
        let extent = split.extent(problem, op);
        let sizes: Vec<i64> = policy
            .sizes(extent)
            .into_iter()
            .filter(|&size| size <= largest)
            .collect();
        if sizes.is_empty() {
            let (operand, span) = spans(problem, op, split, extent)
                .into_iter()
                .find(|&(_, span)| span > self.0)
                .expect("the extent is above the largest size that fits");
            return Err(IndexError::Undivided {
                op,
                split,
                operand: operand_name(op, operand),
                span,
                limit: self,
                extent,
                largest,
            });
        }
        Ok(sizes)
    }
}

/// The rows of the input-side tensor (`x`, `dx`) and of the output-side tensor (`y`, `dy`) a
/// chunk of `len` rows of `op`'s output along the axis works on, at most, wherever it lies:
/// forward and backward-filter chunk `y`/`dy` rows and read `(len - 1) * stride + span` rows of
/// `x` (the halo included); backward-data chunks `dx` rows and takes the `dy` rows whose
/// windows reach them, `(len + span - 2) / stride + 1` at most. Each is at most its tensor's.
pub fn chunk_rows(geometry: &AxisGeometry, op: ConvOp, len: i64) -> (i64, i64) {
    let g = geometry;
    match op {
        ConvOp::Forward | ConvOp::BackwardFilter => {
            let input = (len - 1).saturating_mul(g.stride).saturating_add(g.span());
            (input.min(g.input), len)
        }
        ConvOp::BackwardData => {
            let output = (len + g.span() - 2) / g.stride + 1;
            (len, output.min(g.output()))
        }
    }
}

/// What each operand of `op` reaches in a call at `size` of `split` (in [`operand_roles`]
/// order): see the module docs. `i64::MAX` stands for "more than an `i64` holds".
pub fn spans(problem: &ConvProblem, op: ConvOp, split: SplitDim, size: i64) -> [(Operand, i64); 3] {
    let rows = match split {
        SplitDim::Batch => None,
        SplitDim::Spatial => {
            let axis = split_axis(problem);
            Some((axis, chunk_rows(&AxisGeometry::of(problem, axis), op, size)))
        }
    };
    operand_roles(op).map(|role| {
        let mut dims = role.dims(problem);
        let span = match (role, rows) {
            (Operand::Filter, _) => product(&dims),
            (_, None) => {
                dims[0] = size;
                product(&dims)
            }
            (_, Some((axis, (input_rows, output_rows)))) => {
                dims[axis_index(axis)] = match role {
                    Operand::Input => input_rows,
                    _ => output_rows,
                };
                view_span(&role.dims(problem), &dims, problem.layout)
            }
        };
        (role, span)
    })
}

fn product(dims: &[i64]) -> i64 {
    dims.iter()
        .try_fold(1i64, |acc, &d| acc.checked_mul(d))
        .unwrap_or(i64::MAX)
}

/// Where an axis sits in `[n, c, d, h, w]`.
fn axis_index(axis: Axis) -> usize {
    match axis {
        Axis::D => 2,
        Axis::H => 3,
        Axis::W => 4,
    }
}

/// What a view of dims `view` (`[n, c, d, h, w]`) reaches in a packed tensor of dims `full`
/// in `layout`: `1 + sum of (view[i] - 1) * stride[i]`.
fn view_span(full: &[i64; 5], view: &[i64; 5], layout: Layout) -> i64 {
    let [_, c, d, h, w] = *full;
    let strides = match layout {
        Layout::Nchw => [c * d * h * w, d * h * w, h * w, w, 1],
        Layout::Nhwc => [d * h * w * c, 1, h * w * c, w * c, c],
    };
    view.iter()
        .zip(strides)
        .try_fold(1i64, |acc, (&dim, stride)| {
            (dim - 1)
                .checked_mul(stride)
                .and_then(|x| acc.checked_add(x))
        })
        .unwrap_or(i64::MAX)
}

/// `x`, `w`, `y` as the op calls them (`dx`, `dy`, `dw` for the gradients).
fn operand_name(op: ConvOp, role: Operand) -> &'static str {
    match (op, role) {
        (ConvOp::Forward, Operand::Input) => "x",
        (ConvOp::Forward, Operand::Output) => "y",
        (ConvOp::Forward | ConvOp::BackwardData, Operand::Filter) => "w",
        (ConvOp::BackwardData, Operand::Input) => "dx",
        (ConvOp::BackwardData | ConvOp::BackwardFilter, Operand::Output) => "dy",
        (ConvOp::BackwardFilter, Operand::Input) => "x",
        (ConvOp::BackwardFilter, Operand::Filter) => "dw",
    }
}

/// What could make a call fit when a size of 1 does not.
fn no_fit_hint(problem: &ConvProblem, split: SplitDim, operand: Operand) -> &'static str {
    match (split, operand) {
        (_, Operand::Filter) => "; the filter is whole in every call, so no split makes it smaller",
        (SplitDim::Batch, _) if problem.n == 1 => {
            "; a spatial split (split \"spatial\", or \"auto\") chunks the rows of the sample"
        }
        (SplitDim::Batch, _) => "; one sample is more than a call holds",
        (SplitDim::Spatial, _) if problem.n > 1 => {
            "; a chunk's view spans every sample of the batch: at a batch of 1 it spans one"
        }
        (SplitDim::Spatial, _) if problem.layout == Layout::Nchw => {
            "; in a channels-first layout a chunk's view spans every channel, from the first \
             channel's first row to the last channel's last: channels-last (nhwc) chunks span \
             only their rows"
        }
        (SplitDim::Spatial, _) => "; one row of the sample is more than a call holds",
    }
}

/// Why no plan can split a problem so that its calls fit 32-bit indexing.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum IndexError {
    /// Not even a size of 1 fits.
    #[error(
        "{op} {split} split: a call of one {} reaches {span} elements of {operand}, \
         more than the {limit} a call can index (cuDNN's 32-bit indexing){hint}",
        unit(*.split)
    )]
    NoSizeFits {
        op: ConvOp,
        split: SplitDim,
        operand: &'static str,
        span: i64,
        limit: IndexLimit,
        hint: &'static str,
    },
    /// Policy `undivided` runs the whole extent in one call, which does not fit.
    #[error(
        "{op} {split} split: policy undivided runs all {extent} {}s in one call, which \
         reaches {span} elements of {operand}, more than the {limit} a call can index (cuDNN's \
         32-bit indexing); at most {largest} fit in one call: policy power-of-two or all \
         splits it",
        unit(*.split)
    )]
    Undivided {
        op: ConvOp,
        split: SplitDim,
        operand: &'static str,
        span: i64,
        limit: IndexLimit,
        extent: i64,
        largest: i64,
    },
}

fn unit(split: SplitDim) -> &'static str {
    match split {
        SplitDim::Batch => "sample",
        SplitDim::Spatial => "row",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spatial::{chunks, timing_chunks};

    /// One fp16 NCDHW video tensor past 2^31 elements: 1 x 128 x 81 x 480 x 832 (a late
    /// layer of a long video VAE decode) is 4,140,564,480 elements.
    fn video(layout: Layout) -> ConvProblem {
        ConvProblem {
            pad_d: 1,
            pad_h: 1,
            pad_w: 1,
            layout,
            dtype: crate::problem::DType::Fp16,
            ..ConvProblem::new_3d(1, 128, 81, 480, 832, 128, 3, 3, 3)
        }
    }

    #[test]
    fn batch_spans_are_whole_samples_and_the_real_limit_is_2_pow_31_minus_1() {
        // 8 x 3 x 4096 x 4096 at fp32: one sample is 50,331,648 elements, so 42 samples fit
        // (2,113,929,216) and 43 do not (2,164,260,864 > 2,147,483,647).
        let p = ConvProblem {
            pad_h: 1,
            pad_w: 1,
            ..ConvProblem::new(64, 3, 4096, 4096, 3, 3, 3)
        };
        p.validate().unwrap();
        let limit = IndexLimit::CUDNN;
        assert_eq!(limit.max_elements(), 2_147_483_647);
        let [x, w, y] = spans(&p, ConvOp::Forward, SplitDim::Batch, 42);
        assert_eq!((x.1, w.1, y.1), (2_113_929_216, 81, 2_113_929_216));
        assert!(limit.fits(&p, ConvOp::Forward, SplitDim::Batch, 42));
        assert!(!limit.fits(&p, ConvOp::Forward, SplitDim::Batch, 43));
        for op in ConvOp::ALL {
            assert_eq!(limit.largest_size(&p, op, SplitDim::Batch), Ok(42));
        }
        assert_eq!(
            limit.sizes(Policy::PowerOfTwo, &p, ConvOp::Forward, SplitDim::Batch),
            Ok(vec![1, 2, 4, 8, 16, 32])
        );
        assert_eq!(
            limit.sizes(Policy::All, &p, ConvOp::Forward, SplitDim::Batch),
            Ok((1..=42).collect())
        );
        let undivided = limit
            .sizes(Policy::Undivided, &p, ConvOp::Forward, SplitDim::Batch)
            .unwrap_err();
        assert!(
            matches!(
                undivided,
                IndexError::Undivided {
                    largest: 42,
                    extent: 64,
                    ..
                }
            ),
            "{undivided}"
        );
        assert!(undivided.to_string().contains("power-of-two or all"));
        // Within the limit nothing changes: the whole batch is a size.
        let small = ConvProblem::new(42, 3, 4096, 4096, 3, 3, 3);
        assert_eq!(
            limit.sizes(Policy::PowerOfTwo, &small, ConvOp::Forward, SplitDim::Batch),
            Ok(vec![1, 2, 4, 8, 16, 32, 42])
        );
    }

    #[test]
    fn a_long_fp16_video_splits_its_rows_channels_last_and_says_why_not_channels_first() {
        let limit = IndexLimit::CUDNN;
        let last = video(Layout::Nhwc);
        last.validate().unwrap();
        assert_eq!(product(&last.input_dims()), 4_140_564_480);
        // Batch: one sample is the whole tensor, too large; a spatial split is suggested.
        let batch = limit
            .largest_size(&last, ConvOp::Forward, SplitDim::Batch)
            .unwrap_err();
        assert!(batch.to_string().contains("a spatial split"), "{batch}");
        // Channels-last: a depth row is 480 x 832 x 128 = 51,118,080 elements; a chunk of
        // `len` output rows reads len + 2 input rows, so 40 rows (42 x 51,118,080 =
        // 2,146,959,360) fit and 41 do not.
        for op in [
            ConvOp::Forward,
            ConvOp::BackwardFilter,
            ConvOp::BackwardData,
        ] {
            assert_eq!(
                limit.largest_size(&last, op, SplitDim::Spatial),
                Ok(40),
                "{op}"
            );
        }
        let sizes = limit
            .sizes(
                Policy::PowerOfTwo,
                &last,
                ConvOp::Forward,
                SplitDim::Spatial,
            )
            .unwrap();
        assert_eq!(sizes, [1, 2, 4, 8, 16, 32]);
        // Channels-first: a chunk of one output row reads 3 input rows of every channel, a
        // view from the first channel's first row to the last channel's third:
        // 127 x 81 x 399,360 + 3 x 399,360 = 4,109,414,400 elements.
        let first = video(Layout::Nchw);
        let spatial = limit
            .largest_size(&first, ConvOp::Forward, SplitDim::Spatial)
            .unwrap_err();
        let text = spatial.to_string();
        assert!(text.contains("reaches 4109414400 elements of x"), "{text}");
        assert!(text.contains("channels-last"), "{text}");
    }

    /// The spans of a chunk are what its views reach wherever it lies: the most of the exact
    /// views of `spatial::chunks` at every position, and equal to it at an interior one.
    #[test]
    fn chunk_spans_bound_the_views_of_every_chunk() {
        for layout in [Layout::Nchw, Layout::Nhwc] {
            for (stride, dilation, pad, filter) in [(1, 1, 1, 3), (2, 1, 0, 3), (3, 2, 2, 2)] {
                let p = ConvProblem {
                    pad_h: pad,
                    pad_w: pad,
                    stride_h: stride,
                    stride_w: stride,
                    dilation_h: dilation,
                    dilation_w: dilation,
                    layout,
                    ..ConvProblem::new(2, 3, 29, 7, 5, filter, filter)
                };
                p.validate().unwrap();
                let g = AxisGeometry::of(&p, Axis::H);
                for op in ConvOp::ALL {
                    let extent = g.extent(op);
                    for len in 1..=extent {
                        let bound = spans(&p, op, SplitDim::Spatial, len);
                        let mut most = [0i64; 3];
                        for first in 0..=extent - len {
                            let c = crate::spatial::chunk(&g, op, first, len).unwrap();
                            if !c.has_call() {
                                continue;
                            }
                            for (i, role) in operand_roles(op).into_iter().enumerate() {
                                let full = role.dims(&p);
                                let mut view = full;
                                match role {
                                    Operand::Filter => {}
                                    Operand::Input => view[3] = c.input.len,
                                    Operand::Output => view[3] = c.output.len,
                                }
                                let span = if role == Operand::Filter {
                                    product(&full)
                                } else {
                                    view_span(&full, &view, layout)
                                };
                                assert!(span <= bound[i].1, "{op} {len} at {first}: {role:?}");
                                most[i] = most[i].max(span);
                            }
                        }
                        if timing_chunks(&g, op, len).len() == 3 && 3 * len < extent {
                            assert_eq!(most, bound.map(|(_, s)| s), "{op} {len} {p:?}");
                        }
                    }
                }
                // Sizes that fit cover the extent as chunks.
                let limit = IndexLimit::new(300).unwrap();
                if let Ok(largest) = limit.largest_size(&p, ConvOp::Forward, SplitDim::Spatial) {
                    let extent = g.extent(ConvOp::Forward);
                    let mut sizes = vec![largest; (extent / largest) as usize];
                    if extent % largest > 0 {
                        sizes.push(extent % largest);
                    }
                    assert!(chunks(&g, ConvOp::Forward, &sizes).is_some());
                }
            }
        }
    }

    #[test]
    fn a_lowered_limit_and_its_errors() {
        let p = ConvProblem {
            pad_h: 1,
            pad_w: 1,
            ..ConvProblem::new(5, 2, 6, 6, 3, 3, 3)
        };
        // x is 72 elements a sample, y 108: 2 samples of y fit in 250.
        let limit = IndexLimit::new(250).unwrap();
        assert_eq!(limit.to_string(), "250");
        assert_eq!(IndexLimit::CUDNN.to_string(), "2^31 - 1");
        assert_eq!(IndexLimit::new(0), None);
        assert_eq!(
            limit.largest_size(&p, ConvOp::Forward, SplitDim::Batch),
            Ok(2)
        );
        assert_eq!(
            limit.sizes(
                Policy::PowerOfTwo,
                &p,
                ConvOp::BackwardData,
                SplitDim::Batch
            ),
            Ok(vec![1, 2])
        );
        // The filter (54 elements) is whole in every call.
        let tiny = IndexLimit::new(50).unwrap();
        let e = tiny
            .largest_size(&p, ConvOp::BackwardFilter, SplitDim::Batch)
            .unwrap_err();
        assert!(
            matches!(e, IndexError::NoSizeFits { operand: "x", .. }),
            "{e}"
        );
        let e = IndexLimit::new(53)
            .unwrap()
            .largest_size(
                &ConvProblem::new(1, 2, 3, 3, 3, 3, 3),
                ConvOp::BackwardFilter,
                SplitDim::Batch,
            )
            .unwrap_err();
        assert!(
            matches!(e, IndexError::NoSizeFits { operand: "dw", .. }),
            "{e}"
        );
        assert!(e.to_string().contains("no split makes it smaller"), "{e}");
    }
}
