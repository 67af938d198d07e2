//! The geometry of splitting one convolution along its outermost spatial dimension:
//! which rows of each operand a chunk reads and writes, and the padding it runs with.
//!
//! A spatial plan splits the op's *output* along the split axis (`D` for a 3-D problem, `H`
//! for a 2-D one, `W` for a 1-D one, see [`split_axis`]) into consecutive chunks, as a batch
//! plan splits the batch into micro-batches:
//!
//! - **forward** and **backward-filter** chunk the rows of `y` / `dy` (`p` rows in all). Output
//!   rows `[a, b)` read input rows `[a*stride - pad, (b-1)*stride - pad + dilation*(filter-1)]`
//!   (the halo included), clipped to the tensor; the clipped part becomes the chunk's padding,
//!   so a chunk pads only where its slab meets the tensor's border (never more than the
//!   problem's padding). Backward-filter sums its chunks' filter gradients, like micro-batches.
//! - **backward-data** chunks the rows of `dx` (`h` rows in all): input-gradient rows `[a, b)`
//!   receive contributions from the `dy` rows `[p0, p1]` whose windows reach them; the chunk
//!   is the convolution of the `dx` slab with those `dy` rows, with padding on each side for
//!   the window parts that fall outside the slab (they belong to other chunks or to the real
//!   padding, and their contributions are dropped). Rows of the chunk that no window reaches
//!   (possible with `stride > dilation * (filter - 1) + 1`, or past the last window) are zero
//!   in the full op and are written as zeros by the executor ([`Chunk::zero_before`],
//!   [`Chunk::zero_after`]).
//!
//! Each element of a forward or backward-data output is computed by exactly one chunk, from the
//! same inputs and weights as in the unsplit op, which is why spatial chunks can reproduce the
//! unsplit result exactly. Everything here is one axis; the other dimensions are whole.

use crate::problem::ConvOp;
use crate::problem::ConvProblem;
use serde::{Deserialize, Serialize};
use std::fmt;

/// Which dimension a plan splits.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum SplitDim {
    /// Micro-batches of samples (µ-cuDNN's split).
    #[default]
    Batch,
    /// Chunks of the outermost spatial dimension of the op's output.
    Spatial,
}

impl SplitDim {
    pub const ALL: [SplitDim; 2] = [SplitDim::Batch, SplitDim::Spatial];

    /// `batch` or `spatial`, as serde and the cache write it.
    pub fn name(self) -> &'static str {
        match self {
            SplitDim::Batch => "batch",
            SplitDim::Spatial => "spatial",
        }
    }

    /// Whether this is the batch split (serde skips the field then).
    pub fn is_batch(&self) -> bool {
        *self == SplitDim::Batch
    }

    /// What the sizes of a split of `op` on `problem` sum to: `problem.n` for the batch; for a
    /// spatial split, the rows of the op's output along [`split_axis`]
    /// ([`AxisGeometry::extent`]).
    pub fn extent(self, problem: &ConvProblem, op: ConvOp) -> i64 {
        match self {
            SplitDim::Batch => problem.n,
            SplitDim::Spatial => AxisGeometry::of(problem, split_axis(problem)).extent(op),
        }
    }
}

impl fmt::Display for SplitDim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for SplitDim {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "batch" => Ok(SplitDim::Batch),
            "spatial" => Ok(SplitDim::Spatial),
            other => Err(format!(
                "unknown split dimension {other:?} (batch or spatial)"
            )),
        }
    }
}

/// A spatial axis of the problem key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Axis {
    D,
    H,
    W,
}

impl Axis {
    /// The axis's letter as people read it in plans (`d`, `h`, `w`).
    pub fn name(self) -> &'static str {
        match self {
            Axis::D => "d",
            Axis::H => "h",
            Axis::W => "w",
        }
    }
}

impl fmt::Display for Axis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The axis a spatial split runs along: `D` for a 3-D problem, `W` for a 1-D problem (a 2-D
/// one with `h = r = 1` and no height padding), else `H`.
pub fn split_axis(problem: &ConvProblem) -> Axis {
    if problem.is_3d() {
        Axis::D
    } else if problem.h == 1 && problem.r == 1 && problem.pad_h == 0 {
        Axis::W
    } else {
        Axis::H
    }
}

/// One axis of a convolution: `output = (input + 2*pad - dilation*(filter-1) - 1) / stride + 1`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AxisGeometry {
    pub input: i64,
    pub pad: i64,
    pub filter: i64,
    pub stride: i64,
    pub dilation: i64,
}

impl AxisGeometry {
    /// The geometry of `axis` in `problem`.
    pub fn of(problem: &ConvProblem, axis: Axis) -> Self {
        let p = problem;
        let (input, pad, filter, stride, dilation) = match axis {
            Axis::D => (p.d, p.pad_d, p.t, p.stride_d, p.dilation_d),
            Axis::H => (p.h, p.pad_h, p.r, p.stride_h, p.dilation_h),
            Axis::W => (p.w, p.pad_w, p.s, p.stride_w, p.dilation_w),
        };
        AxisGeometry {
            input,
            pad,
            filter,
            stride,
            dilation,
        }
    }

    /// The dilated filter's span, `dilation * (filter - 1) + 1`.
    pub fn span(&self) -> i64 {
        self.dilation * (self.filter - 1) + 1
    }

    /// Output rows (meaningful for a valid geometry: at least 1).
    pub fn output(&self) -> i64 {
        (self.input + 2 * self.pad - self.span()) / self.stride + 1
    }

    /// The rows an op's output has along this axis: `output()` for forward and
    /// backward-filter (`y`, `dy`), `input` for backward-data (`dx`): what chunk sizes sum to.
    pub fn extent(&self, op: ConvOp) -> i64 {
        match op {
            ConvOp::BackwardData => self.input,
            ConvOp::Forward | ConvOp::BackwardFilter => self.output(),
        }
    }
}

/// A range of rows `[first, first + len)` along the split axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rows {
    pub first: i64,
    pub len: i64,
}

impl Rows {
    pub fn end(&self) -> i64 {
        self.first + self.len
    }
}

/// One chunk of a spatial plan along one axis: the rows of the input-side tensor (`x` or `dx`)
/// and of the output-side tensor (`y` or `dy`) its call works on, and the padding of that
/// call. The call is the convolution of `input` rows (with `pad_before` and `pad_after`) to
/// `output` rows, which have exactly `output.len` rows:
/// `output.len = (input.len + pad_before + pad_after - span) / stride + 1`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunk {
    /// Rows of `x` (forward, backward-filter) or `dx` (backward-data) the call reads or writes.
    pub input: Rows,
    /// Rows of `y` (forward) or `dy` (backward-data, backward-filter).
    pub output: Rows,
    pub pad_before: i64,
    pub pad_after: i64,
    /// Rows at the start of the chunk's range of the op's output that the call does not
    /// write and that are zeros in the full op: backward-data rows no window reaches; the whole
    /// chunk when it has no call (a forward chunk whose windows all lie in the padding; such a
    /// backward-filter chunk adds nothing).
    pub zero_before: i64,
    /// Backward-data only: rows at the end of the chunk that no window reaches (zeros).
    pub zero_after: i64,
}

impl Chunk {
    /// Whether the chunk runs a convolution at all (see [`Chunk::zero_before`]).
    pub fn has_call(&self) -> bool {
        self.input.len > 0 && self.output.len > 0
    }
}

/// The chunk of `op` covering rows `[first, first + len)` of the op's output along the axis
/// (`y`/`dy` rows for forward and backward-filter, `dx` rows for backward-data). `None` when
/// the range is empty or outside the extent ([`AxisGeometry::extent`]).
pub fn chunk(geometry: &AxisGeometry, op: ConvOp, first: i64, len: i64) -> Option<Chunk> {
    let g = geometry;
    if len < 1 || first < 0 || first + len > g.extent(op) {
        return None;
    }
    Some(match op {
        ConvOp::Forward | ConvOp::BackwardFilter => output_chunk(g, first, len),
        ConvOp::BackwardData => input_chunk(g, first, len),
    })
}

/// Output rows `[a, b)`: the input slab they read, clipped to the tensor.
fn output_chunk(g: &AxisGeometry, a: i64, len: i64) -> Chunk {
    let b = a + len;
    let wanted_first = a * g.stride - g.pad;
    let wanted_last = (b - 1) * g.stride - g.pad + g.span() - 1;
    let first = wanted_first.max(0);
    let last = wanted_last.min(g.input - 1);
    if first > last {
        // Every window of the chunk lies in the padding: its rows are zeros, and it adds
        // nothing to a filter gradient.
        return Chunk {
            input: Rows { first: 0, len: 0 },
            output: Rows { first: a, len },
            pad_before: 0,
            pad_after: 0,
            zero_before: len,
            zero_after: 0,
        };
    }
    Chunk {
        input: Rows {
            first,
            len: last - first + 1,
        },
        output: Rows { first: a, len },
        pad_before: first - wanted_first,
        pad_after: wanted_last - last,
        zero_before: 0,
        zero_after: 0,
    }
}

/// Input-gradient rows `[a, b)`: the `dy` rows whose windows reach them, and the slab of those
/// rows that the windows cover.
fn input_chunk(g: &AxisGeometry, a: i64, len: i64) -> Chunk {
    let b = a + len;
    let p = g.output();
    // Window p covers rows p*stride - pad .. p*stride - pad + span - 1.
    let p0 = div_ceil(a + g.pad - (g.span() - 1), g.stride).max(0);
    let p1 = (b - 1 + g.pad).div_euclid(g.stride).min(p - 1);
    let zeros = |rows: i64| Chunk {
        input: Rows { first: a, len: 0 },
        output: Rows { first: 0, len: 0 },
        pad_before: 0,
        pad_after: 0,
        zero_before: rows,
        zero_after: 0,
    };
    if p0 > p1 {
        return zeros(len);
    }
    let covered_first = p0 * g.stride - g.pad;
    let covered_last = p1 * g.stride - g.pad + g.span() - 1;
    let first = a.max(covered_first);
    let last = (b - 1).min(covered_last);
    if first > last {
        return zeros(len);
    }
    Chunk {
        input: Rows {
            first,
            len: last - first + 1,
        },
        output: Rows {
            first: p0,
            len: p1 - p0 + 1,
        },
        pad_before: first - covered_first,
        pad_after: covered_last - last,
        zero_before: first - a,
        zero_after: b - 1 - last,
    }
}

fn div_ceil(a: i64, b: i64) -> i64 {
    -(-a).div_euclid(b)
}

/// The chunks of a spatial plan with chunk sizes `sizes` (in order), or `None` when they do not
/// sum to the op's extent along the axis or one is not positive.
pub fn chunks(geometry: &AxisGeometry, op: ConvOp, sizes: &[i64]) -> Option<Vec<Chunk>> {
    let mut first = 0;
    let mut out = Vec::with_capacity(sizes.len());
    for &size in sizes {
        out.push(chunk(geometry, op, first, size)?);
        first += size;
    }
    (first == geometry.extent(op)).then_some(out)
}

/// Where a chunk of `len` rows is timed (a boundary chunk and an interior chunk of one
/// size can differ): at the start of the axis (the padding before it), in the middle and at
/// the end (the padding after it), the distinct ones in that order. A measurement of the size
/// is the slowest of them, its workspace the largest, so a plan's time and workspace hold
/// wherever the chunk lands. Chunks without a call (all padding) are left out; empty when
/// `len` is outside `1..=extent` or no position has a call.
pub fn timing_chunks(geometry: &AxisGeometry, op: ConvOp, len: i64) -> Vec<Chunk> {
    let extent = geometry.extent(op);
    if len < 1 || len > extent {
        return Vec::new();
    }
    let mut firsts = vec![0, (extent - len) / 2, extent - len];
    firsts.dedup();
    firsts
        .into_iter()
        .filter_map(|first| chunk(geometry, op, first, len))
        .filter(Chunk::has_call)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    // One axis, one channel: integer-valued f64 data, so sums are exact in any order.
    fn forward(g: &AxisGeometry, x: &[f64], w: &[f64], pb: i64, pa: i64) -> Vec<f64> {
        let n = x.len() as i64;
        let out = (n + pb + pa - g.span()) / g.stride + 1;
        (0..out)
            .map(|p| {
                (0..g.filter)
                    .map(|j| {
                        let i = p * g.stride - pb + j * g.dilation;
                        if (0..n).contains(&i) {
                            x[i as usize] * w[j as usize]
                        } else {
                            0.0
                        }
                    })
                    .sum()
            })
            .collect()
    }

    fn backward_data(g: &AxisGeometry, n: i64, dy: &[f64], w: &[f64], pb: i64) -> Vec<f64> {
        let mut dx = vec![0.0; n as usize];
        for (p, &d) in dy.iter().enumerate() {
            for j in 0..g.filter {
                let i = p as i64 * g.stride - pb + j * g.dilation;
                if (0..n).contains(&i) {
                    dx[i as usize] += d * w[j as usize];
                }
            }
        }
        dx
    }

    fn backward_filter(g: &AxisGeometry, x: &[f64], dy: &[f64], pb: i64) -> Vec<f64> {
        let n = x.len() as i64;
        (0..g.filter)
            .map(|j| {
                dy.iter()
                    .enumerate()
                    .map(|(p, &d)| {
                        let i = p as i64 * g.stride - pb + j * g.dilation;
                        if (0..n).contains(&i) {
                            d * x[i as usize]
                        } else {
                            0.0
                        }
                    })
                    .sum()
            })
            .collect()
    }

    fn data(len: i64, seed: i64) -> Vec<f64> {
        (0..len)
            .map(|i| ((i * 7 + seed * 13) % 11 - 5) as f64)
            .collect()
    }

    /// Runs every op chunked and unsplit and compares.
    fn check(g: AxisGeometry, sizes_for: impl Fn(i64) -> Vec<i64>) {
        let x = data(g.input, 1);
        let w = data(g.filter, 2);
        let p = g.output();
        let dy = data(p, 3);
        let r = |v: &[f64], rows: Rows| v[rows.first as usize..rows.end() as usize].to_vec();

        let y = forward(&g, &x, &w, g.pad, g.pad);
        assert_eq!(y.len() as i64, p);
        let cs = chunks(&g, ConvOp::Forward, &sizes_for(p)).unwrap();
        let mut out = Vec::new();
        for c in &cs {
            assert!(c.pad_before <= g.pad && c.pad_after <= g.pad, "{c:?}");
            if !c.has_call() {
                assert_eq!(c.zero_before, c.output.len);
                out.extend(std::iter::repeat_n(0.0, c.zero_before as usize));
                continue;
            }
            let part = forward(&g, &r(&x, c.input), &w, c.pad_before, c.pad_after);
            assert_eq!(part.len() as i64, c.output.len, "{g:?} {c:?}");
            out.extend(part);
        }
        assert_eq!(out, y, "forward {g:?}");

        let dw = backward_filter(&g, &x, &dy, g.pad);
        let mut sum = vec![0.0; g.filter as usize];
        for c in chunks(&g, ConvOp::BackwardFilter, &sizes_for(p)).unwrap() {
            if !c.has_call() {
                continue;
            }
            let part = backward_filter(&g, &r(&x, c.input), &r(&dy, c.output), c.pad_before);
            sum.iter_mut().zip(part).for_each(|(s, v)| *s += v);
        }
        assert_eq!(sum, dw, "backward-filter {g:?}");

        let dx = backward_data(&g, g.input, &dy, &w, g.pad);
        let mut out = Vec::new();
        for c in chunks(&g, ConvOp::BackwardData, &sizes_for(g.input)).unwrap() {
            out.extend(std::iter::repeat_n(0.0, c.zero_before as usize));
            if c.has_call() {
                // The call's output rows are exactly the dy rows it was given.
                let n_out = (c.input.len + c.pad_before + c.pad_after - g.span()) / g.stride + 1;
                assert_eq!(n_out, c.output.len, "{g:?} {c:?}");
                out.extend(backward_data(
                    &g,
                    c.input.len,
                    &r(&dy, c.output),
                    &w,
                    c.pad_before,
                ));
            }
            out.extend(std::iter::repeat_n(0.0, c.zero_after as usize));
        }
        assert_eq!(out, dx, "backward-data {g:?}");
    }

    fn geometry(input: i64, pad: i64, filter: i64, stride: i64, dilation: i64) -> AxisGeometry {
        AxisGeometry {
            input,
            pad,
            filter,
            stride,
            dilation,
        }
    }

    #[test]
    fn uneven_chunks_reproduce_the_unsplit_op() {
        // stride 2 with odd sizes, dilation 2, kernel 1 (no halo), padding larger than a
        // chunk's halo, and a stride that skips rows.
        for g in [
            geometry(17, 1, 3, 2, 1),
            geometry(19, 2, 3, 1, 2),
            geometry(13, 0, 1, 1, 1),
            geometry(11, 5, 3, 1, 1),
            geometry(15, 1, 2, 4, 1),
            geometry(9, 0, 1, 3, 1),
        ] {
            for parts in [2, 3, 7] {
                check(g, |extent| {
                    // `parts` uneven chunks (fewer when the extent is smaller).
                    let parts = parts.min(extent);
                    let mut sizes: Vec<i64> = (0..parts).map(|i| 1 + i % 2).collect();
                    let rest = extent - sizes.iter().sum::<i64>();
                    if rest >= 0 {
                        sizes[0] += rest;
                        sizes
                    } else {
                        vec![extent]
                    }
                });
            }
        }
    }

    #[test]
    fn the_split_axis_is_the_outermost_spatial_dimension() {
        let p2 = ConvProblem::new(1, 3, 20, 30, 4, 3, 3);
        assert_eq!(split_axis(&p2), Axis::H);
        assert_eq!(split_axis(&ConvProblem::new_1d(1, 3, 100, 4, 5)), Axis::W);
        let p3 = ConvProblem::new_3d(1, 3, 9, 20, 30, 4, 3, 3, 3);
        assert_eq!(split_axis(&p3), Axis::D);
        let g = AxisGeometry::of(&p3, Axis::D);
        assert_eq!(g.output(), 7);
        assert_eq!(g.extent(ConvOp::BackwardData), 9);
        // Sizes must cover the extent exactly.
        assert!(chunks(&g, ConvOp::Forward, &[3, 3]).is_none());
        assert!(chunks(&g, ConvOp::Forward, &[3, 5]).is_none());
        assert!(chunks(&g, ConvOp::Forward, &[3, 0, 4]).is_none());
        assert_eq!(chunks(&g, ConvOp::Forward, &[3, 4]).unwrap().len(), 2);
    }

    #[test]
    fn interior_chunks_have_no_padding_and_border_chunks_the_real_one() {
        let g = geometry(32, 1, 3, 1, 1);
        let cs = chunks(&g, ConvOp::Forward, &[8, 8, 8, 8]).unwrap();
        assert_eq!((cs[0].pad_before, cs[0].pad_after), (1, 0));
        assert_eq!((cs[1].pad_before, cs[1].pad_after), (0, 0));
        assert_eq!(cs[1].input, Rows { first: 7, len: 10 });
        assert_eq!((cs[3].pad_before, cs[3].pad_after), (0, 1));
    }

    proptest! {
        #[test]
        fn random_geometries_and_chunkings(
            input in 1i64..40,
            pad in 0i64..5,
            filter in 1i64..6,
            stride in 1i64..5,
            dilation in 1i64..4,
            cuts in proptest::collection::vec(0.0f64..1.0, 0..8),
        ) {
            let g = geometry(input, pad, filter, stride, dilation);
            prop_assume!(input + 2 * pad >= g.span());
            check(g, |extent| {
                let mut points: Vec<i64> = cuts
                    .iter()
                    .map(|c| 1 + (c * (extent - 1) as f64) as i64)
                    .filter(|&p| p < extent)
                    .collect();
                points.sort_unstable();
                points.dedup();
                let mut sizes = Vec::new();
                let mut last = 0;
                for p in points.into_iter().chain([extent]) {
                    sizes.push(p - last);
                    last = p;
                }
                sizes
            });
        }
    }
}
