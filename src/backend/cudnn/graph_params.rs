//! The values of the graph-API descriptors for one convolution: tensor unique ids, dimensions,
//! strides and byte alignments, and the convolution's paddings, strides and dilations.
//!
//! Pure arithmetic on a [`ConvShapes`] (no cuDNN), so that CI tests exactly what the FFI wall
//! (`wall/graph.rs`) will set with `cudnnBackendSetAttribute`.
//!
//! # The graph of one op
//!
//! Every op has the same three tensors, `x` (`[n, c, h, w]`), `w` (`[k, c / groups, r, s]`) and
//! `y` (`[n, k, p, q]`), 5-D for a 3-D problem (`[n, c, d, h, w]`, `[k, c / groups, t, r, s]`,
//! `[n, k, o, p, q]`, with a convolution of 3 spatial dims); the op decides which one is
//! written (see
//! [`operand_roles`](super::operand_roles)): forward writes `y`, backward-data writes `x`
//! (dx from dy = `y`), backward-filter writes `w` (dw from `x` and dy = `y`).
//! Groups are not an attribute of the backend API: cuDNN infers the group count from
//! `x.c / w.c` (NVIDIA's answer in cudnn-frontend issue #114; PyTorch's graph-API path relies
//! on it too). A graph or engine that cannot do a grouped problem answers
//! `CUDNN_STATUS_NOT_SUPPORTED*`, which reaches callers as a typed
//! [`CudnnError::Backend`](super::CudnnError::Backend) with `is_not_supported()`.
//!
//! # Byte alignment
//!
//! Each tensor declares `CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT`, a promise about every pointer it
//! will be executed with; engines may use vector loads that rely on it, and cuDNN offers no
//! engine needing more than a tensor declares (below 16 bytes, most tensor-core engines are
//! lost). A micro-batch runs on a view that starts `first` samples into a
//! full-batch buffer, `first * sample_bytes` bytes past an allocation that is 256-byte
//! aligned. So the alignment is derived from the offset the plan actually runs at, as
//! PyTorch's `Conv_v8.cpp` derives it from the data pointer ([`Alignments::at_sample`]): 16
//! (the frontend's default and most) at offset 0, else the largest power of two dividing
//! `first * sample_bytes`, capped at 16; `w` (never offset) declares 16. Plans are keyed on
//! it (`exec/cudnn.rs` keeps one per distinct alignment). Where the offset is not known,
//! [`Alignments::any_sample`] holds at every offset (the per-sample bytes' power of two).
//! The plan checks the pointers against its declaration again at execution.

#![forbid(unsafe_code)]

use super::error::CudnnError;
use super::shape::{operand_roles, ConvShapes, Nd, Operand};
use crate::solver::spatial::{split_axis, Axis, AxisGeometry, Chunk, Rows};
use crate::solver::{ConvOp, ConvProblem, DType, Layout};

/// `CUDNN_ATTR_TENSOR_UNIQUE_ID` of the input `x` (dx in backward-data).
pub const UID_X: i64 = 1;
/// `CUDNN_ATTR_TENSOR_UNIQUE_ID` of the filter `w` (dw in backward-filter).
pub const UID_W: i64 = 2;
/// `CUDNN_ATTR_TENSOR_UNIQUE_ID` of the output `y` (dy in both backward ops).
pub const UID_Y: i64 = 3;

/// The largest byte alignment a tensor declares (the frontend's default, and what 128-bit
/// vector loads need).
pub const MAX_DECLARED_ALIGNMENT: u64 = 16;

/// The alignment an execution plan requires of a non-empty workspace pointer. cuDNN documents
/// none; every caller it was tested with passes a fresh `cudaMalloc` (256-byte aligned), so
/// the plan asks for the same rather than find out on a GPU. Sub-ranges of a shared workspace
/// (workspace division) must start at multiples of this.
pub const WORKSPACE_ALIGNMENT: u64 = 256;

/// One `CUDNN_BACKEND_TENSOR_DESCRIPTOR`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TensorParams {
    /// `CUDNN_ATTR_TENSOR_UNIQUE_ID`: the key of its pointer in the variant pack.
    pub uid: i64,
    /// `CUDNN_ATTR_TENSOR_DIMENSIONS`, in cuDNN's logical order (`[n, c, h, w]` /
    /// `[k, c / groups, r, s]`, 5-D with the depth for a 3-D problem) whatever the layout.
    pub dims: Nd<i64>,
    /// `CUDNN_ATTR_TENSOR_STRIDES` (in elements), packed in the problem's layout.
    pub strides: Nd<i64>,
    /// `CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT`.
    pub alignment: u64,
}

/// One `CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR` (cross-correlation, fp32 compute); its
/// `CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS` is the length of each array (2, or 3 with the depth
/// first).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConvParams {
    /// `CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS` `[pad_h, pad_w]` / `[pad_d, pad_h, pad_w]`.
    pub pre_paddings: Nd<i64>,
    /// `CUDNN_ATTR_CONVOLUTION_POST_PADDINGS`: symmetric padding, as the legacy API.
    pub post_paddings: Nd<i64>,
    /// `CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES` `[stride_h, stride_w]` (depth first for 3-D).
    pub filter_strides: Nd<i64>,
    /// `CUDNN_ATTR_CONVOLUTION_DILATIONS` `[dilation_h, dilation_w]` (depth first for 3-D).
    pub dilations: Nd<i64>,
}

impl ConvParams {
    /// `CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS`: 2 or 3.
    pub fn spatial_dims(&self) -> usize {
        self.pre_paddings.len()
    }
}

/// Everything the operation graph of one (problem at one batch size, op, alpha, beta) sets.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GraphParams {
    pub shapes: ConvShapes,
    pub op: ConvOp,
    pub x: TensorParams,
    pub w: TensorParams,
    pub y: TensorParams,
    pub conv: ConvParams,
    /// `CUDNN_ATTR_OPERATION_CONVOLUTION_*_ALPHA` (`CUDNN_TYPE_FLOAT`).
    pub alpha: f32,
    /// `CUDNN_ATTR_OPERATION_CONVOLUTION_*_BETA`: 0 overwrites, 1 accumulates.
    pub beta: f32,
}

/// Packed strides (in elements) of logical dims `[n, c, spatial...]` (`[n, c, h, w]` or
/// `[n, c, d, h, w]`) in `layout`: NCHW / NCDHW keeps `w` fastest, NHWC / NDHWC keeps `c`
/// fastest (filters: KCRS / KRSC, KCTRS / KTRSC). Fewer than 2 dims have no layout: packed
/// from the last.
pub fn packed_strides(layout: Layout, dims: &[i64]) -> Nd<i64> {
    let rank = dims.len();
    // Dimension indices from the fastest to the slowest.
    let order: Vec<usize> = match layout {
        Layout::Nhwc if rank > 2 => std::iter::once(1)
            .chain((2..rank).rev())
            .chain(std::iter::once(0))
            .collect(),
        _ => (0..rank).rev().collect(),
    };
    let mut strides = vec![0i64; rank];
    let mut next = 1i64;
    for i in order {
        strides[i] = next;
        next = next.saturating_mul(dims[i]);
    }
    Nd::from_slice(&strides)
}

/// The largest power of two that divides `bytes`, capped at [`MAX_DECLARED_ALIGNMENT`].
pub fn alignment_of_bytes(bytes: u64) -> u64 {
    if bytes == 0 {
        MAX_DECLARED_ALIGNMENT
    } else {
        (1u64 << bytes.trailing_zeros()).min(MAX_DECLARED_ALIGNMENT)
    }
}

/// The alignment every pointer to `role` is guaranteed when views start at a whole sample of
/// a buffer allocated by CUDA, whatever the sample (see the module docs).
pub fn declared_alignment(shapes: &ConvShapes, role: Operand) -> u64 {
    if role.is_batched() {
        let sample_bytes = shapes.elements_per_sample(role) * shapes.dtype.size_bytes();
        alignment_of_bytes(sample_bytes as u64)
    } else {
        MAX_DECLARED_ALIGNMENT
    }
}

/// The alignment of a pointer to `role` in a view that starts `first` samples into a buffer
/// allocated by CUDA (16 at offset 0; the filter is never offset).
pub fn alignment_at_sample(shapes: &ConvShapes, role: Operand, first: usize) -> u64 {
    if role.is_batched() {
        let sample_bytes = (shapes.elements_per_sample(role) * shapes.dtype.size_bytes()) as u64;
        alignment_of_bytes((first as u64).saturating_mul(sample_bytes))
    } else {
        MAX_DECLARED_ALIGNMENT
    }
}

/// The byte alignments the three tensors of a graph declare (`CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT`):
/// part of what an execution plan is built for, so plans are keyed on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Alignments {
    /// `x` (dx in backward-data).
    pub x: u64,
    /// `w` (dw in backward-filter).
    pub w: u64,
    /// `y` (dy in both backward ops).
    pub y: u64,
}

impl Alignments {
    /// 16 bytes for every tensor: a view at sample 0 of a CUDA allocation.
    pub const MAX: Alignments = Alignments {
        x: MAX_DECLARED_ALIGNMENT,
        w: MAX_DECLARED_ALIGNMENT,
        y: MAX_DECLARED_ALIGNMENT,
    };

    /// The alignments of views that start `first` samples into buffers allocated by CUDA:
    /// what a micro-batch at that offset can declare.
    pub fn at_sample(shapes: &ConvShapes, first: usize) -> Self {
        Alignments {
            x: alignment_at_sample(shapes, Operand::Input, first),
            w: MAX_DECLARED_ALIGNMENT,
            y: alignment_at_sample(shapes, Operand::Output, first),
        }
    }

    /// Alignments that hold at every sample offset (the least of [`Self::at_sample`] over all
    /// `first`): for a plan whose offsets are not known when it is built.
    pub fn any_sample(shapes: &ConvShapes) -> Self {
        Alignments {
            x: declared_alignment(shapes, Operand::Input),
            w: MAX_DECLARED_ALIGNMENT,
            y: declared_alignment(shapes, Operand::Output),
        }
    }

    /// The alignment of `role`'s tensor.
    pub fn of(&self, role: Operand) -> u64 {
        match role {
            Operand::Input => self.x,
            Operand::Filter => self.w,
            Operand::Output => self.y,
        }
    }
}

/// Whether `address` is a multiple of `alignment` (a power of two).
pub fn is_aligned(address: u64, alignment: u64) -> bool {
    alignment <= 1 || address % alignment == 0
}

/// The tensor's unique id for `role`.
pub fn uid(role: Operand) -> i64 {
    match role {
        Operand::Input => UID_X,
        Operand::Filter => UID_W,
        Operand::Output => UID_Y,
    }
}

/// The unique ids of `op`'s operands in `[a, b, out]` order (the order of
/// [`operand_roles`] and of `EnginePlan::execute`'s arguments).
pub fn operand_uids(op: ConvOp) -> [i64; 3] {
    operand_roles(op).map(uid)
}

impl GraphParams {
    /// The descriptor values for `shapes` (the problem at the micro-batch size the plan runs),
    /// `op`, and the scaling `out = alpha * op(a, b) + beta * out`, for views at any sample
    /// offset ([`Alignments::any_sample`]).
    pub fn new(shapes: &ConvShapes, op: ConvOp, alpha: f32, beta: f32) -> Self {
        Self::with_alignments(shapes, op, alpha, beta, Alignments::any_sample(shapes))
    }

    /// As [`Self::new`], with the tensors declaring `alignments`.
    pub fn with_alignments(
        shapes: &ConvShapes,
        op: ConvOp,
        alpha: f32,
        beta: f32,
        alignments: Alignments,
    ) -> Self {
        let tensor = |role: Operand| {
            let dims = shapes.dims(role).map(i64::from);
            TensorParams {
                uid: uid(role),
                dims,
                strides: packed_strides(shapes.layout, &dims),
                alignment: alignments.of(role),
            }
        };
        let pad = shapes.pad.map(i64::from);
        GraphParams {
            shapes: *shapes,
            op,
            x: tensor(Operand::Input),
            w: tensor(Operand::Filter),
            y: tensor(Operand::Output),
            conv: ConvParams {
                pre_paddings: pad,
                post_paddings: pad,
                filter_strides: shapes.stride.map(i64::from),
                dilations: shapes.dilation.map(i64::from),
            },
            alpha,
            beta,
        }
    }

    /// The descriptor values of a spatial chunk's call ([`ChunkShapes`]): `x` and `y` as views
    /// (the chunk's rows, the full tensors' strides), the split axis padded by the chunk's
    /// `pad_before` / `pad_after`, the tensors declaring `alignments` (e.g.
    /// [`ChunkShapes::alignments`] where the chunk runs).
    pub fn for_chunk(
        chunk: &ChunkShapes,
        op: ConvOp,
        alpha: f32,
        beta: f32,
        alignments: Alignments,
    ) -> Self {
        let mut params = Self::with_alignments(&chunk.shapes, op, alpha, beta, alignments);
        for role in [Operand::Input, Operand::Output] {
            let t = match role {
                Operand::Input => &mut params.x,
                _ => &mut params.y,
            };
            t.strides = chunk.strides(role);
        }
        params.conv.pre_paddings = chunk.pre_paddings();
        params.conv.post_paddings = chunk.post_paddings();
        params
    }

    /// Elements each of `op`'s `[a, b, out]` views must span (a chunk's views: more than its
    /// element count, see [`span_of`]).
    pub fn operand_spans(&self) -> [usize; 3] {
        operand_roles(self.op).map(|role| self.tensor(role).span())
    }

    /// The tensor that plays `role`.
    pub fn tensor(&self, role: Operand) -> &TensorParams {
        match role {
            Operand::Input => &self.x,
            Operand::Filter => &self.w,
            Operand::Output => &self.y,
        }
    }

    /// The data type of all three tensors.
    pub fn dtype(&self) -> DType {
        self.shapes.dtype
    }

    /// The alignments the three tensors declare.
    pub fn alignments(&self) -> Alignments {
        Alignments {
            x: self.x.alignment,
            w: self.w.alignment,
            y: self.y.alignment,
        }
    }

    /// The declared alignments of `op`'s operands in `[a, b, out]` order.
    pub fn operand_alignments(&self) -> [u64; 3] {
        operand_roles(self.op).map(|role| self.tensor(role).alignment)
    }
}

/// Elements a strided view must cover, from its first element to its last one inclusive:
/// `1 + sum((dims[i] - 1) * strides[i])` (0 for an empty tensor). Equal to the element count for
/// packed strides; for a chunk of a larger tensor (its dims, the tensor's strides) it is what
/// the view of the tensor's buffer spans.
pub fn span_of(dims: &[i64], strides: &[i64]) -> usize {
    if dims.iter().any(|&d| d <= 0) {
        return 0;
    }
    let last: i64 = dims
        .iter()
        .zip(strides)
        .map(|(&d, &s)| (d - 1).saturating_mul(s))
        .fold(0i64, i64::saturating_add);
    usize::try_from(last.saturating_add(1)).unwrap_or(usize::MAX)
}

impl TensorParams {
    /// Elements a view of this tensor covers ([`span_of`] its dims and strides).
    pub fn span(&self) -> usize {
        span_of(&self.dims, &self.strides)
    }
}

/// One spatial chunk ([`crate::solver::spatial`]) as cuDNN runs it: *views* of the
/// full tensors, no copies. `x` and `y` (dx and dy in backward-data) have the chunk's rows along
/// the split axis and the full tensor's strides, and start at a pointer offset (`x` at row
/// `chunk.input.first`, `y` at row `chunk.output.first`); the filter is whole. The convolution
/// pads the split axis by `chunk.pad_before` / `chunk.pad_after` and the other axes as the
/// problem does.
///
/// Pure arithmetic, so the values the FFI wall sets for a chunk are tested without cuDNN.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkShapes {
    /// The whole problem (batch and other axes whole).
    pub full: ConvShapes,
    /// The chunk as cuDNN's sizes: `x` and `y` with the chunk's rows along the split axis, the
    /// split axis's `pad` = `chunk.pad_before` (a legacy descriptor's symmetric padding, right
    /// only when [`Self::is_symmetric`]).
    pub shapes: ConvShapes,
    /// The split axis's index in the tensors' dims (`[n, c, spatial...]`: 2 for `D` of a 3-D
    /// problem or `H` of a 2-D one, 3 for `W` of a 1-D one).
    pub dim: usize,
    pub chunk: Chunk,
}

impl ChunkShapes {
    /// The views of `chunk` (of `op` on `problem`, from [`crate::solver::spatial::chunks`]).
    /// Errors: an invalid problem, a chunk without a call ([`Chunk::has_call`]: nothing for
    /// cuDNN to run) or whose rows leave the tensors or do not make a convolution.
    pub fn new(problem: &ConvProblem, chunk: &Chunk) -> Result<Self, CudnnError> {
        let full = ConvShapes::new(problem)?;
        let bad = |detail: String| CudnnError::InvalidArgument {
            call: "ChunkShapes::new",
            detail,
        };
        let axis = split_axis(problem);
        let dim = split_dim_index(problem);
        let index = dim - 2;
        let geometry = AxisGeometry::of(problem, axis);
        let (x_rows, y_rows) = (i64::from(full.input[dim]), i64::from(full.output[dim]));
        let (input, output) = (chunk.input, chunk.output);
        if !chunk.has_call()
            || input.first < 0
            || input.end() > x_rows
            || output.first < 0
            || output.end() > y_rows
            || chunk.pad_before < 0
            || chunk.pad_after < 0
        {
            return Err(bad(format!(
                "{chunk:?} is not a chunk of {}",
                problem.describe()
            )));
        }
        let rows = input.len + chunk.pad_before + chunk.pad_after - geometry.span();
        if rows < 0 || rows / geometry.stride + 1 != output.len {
            return Err(bad(format!(
                "{chunk:?}: {} input rows padded {}+{} do not make {} output rows along {axis}",
                input.len, chunk.pad_before, chunk.pad_after, output.len
            )));
        }
        let mut shapes = full;
        // Both fit: they are at most the full tensor's rows.
        shapes.input[dim] = input.len as i32;
        shapes.output[dim] = output.len as i32;
        shapes.pad[index] = chunk.pad_before as i32;
        Ok(ChunkShapes {
            full,
            shapes,
            dim,
            chunk: *chunk,
        })
    }

    /// Whether a legacy descriptor (one padding per axis) describes the chunk exactly.
    pub fn is_symmetric(&self) -> bool {
        self.chunk.pad_before == self.chunk.pad_after
    }

    /// The view's dims of `role` in cuDNN's logical order (the filter whole).
    pub fn dims(&self, role: Operand) -> Nd<i64> {
        self.shapes.dims(role).map(i64::from)
    }

    /// The full tensor's packed strides (in elements) of `role`.
    pub fn strides(&self, role: Operand) -> Nd<i64> {
        packed_strides(self.full.layout, &self.full.dims(role).map(i64::from))
    }

    /// The first row of `role` the view starts at (0 for the filter).
    pub fn first_row(&self, role: Operand) -> i64 {
        match role {
            Operand::Input => self.chunk.input.first,
            Operand::Output => self.chunk.output.first,
            Operand::Filter => 0,
        }
    }

    /// The element offset of the view of `role` in the full tensor's buffer.
    pub fn offset(&self, role: Operand) -> usize {
        (self.first_row(role) * self.strides(role)[self.dim]) as usize
    }

    /// Elements the view of `role` spans from its offset ([`span_of`]).
    pub fn span(&self, role: Operand) -> usize {
        span_of(&self.dims(role), &self.strides(role))
    }

    /// `(offset, span)` in elements: the range of the full tensor's buffer the view of `role`
    /// covers (what `DeviceBuffer::view` takes).
    pub fn range(&self, role: Operand) -> (usize, usize) {
        (self.offset(role), self.span(role))
    }

    /// The view's byte offset into the full tensor of `role`.
    pub fn byte_offset(&self, role: Operand) -> u64 {
        self.offset(role) as u64 * self.full.dtype.size_bytes() as u64
    }

    /// The alignments of the views at their offsets in buffers allocated by CUDA (16 at
    /// offset 0): what a plan running this chunk where it lies can declare.
    pub fn alignments(&self) -> Alignments {
        Alignments {
            x: alignment_of_bytes(self.byte_offset(Operand::Input)),
            w: MAX_DECLARED_ALIGNMENT,
            y: alignment_of_bytes(self.byte_offset(Operand::Output)),
        }
    }

    /// Alignments that hold at every row offset (a row's bytes' power of two, the least of
    /// [`Self::alignments`] over all positions): what a measurement declares, since a plan
    /// may put a chunk of its size at any row.
    pub fn any_row_alignments(&self) -> Alignments {
        let row_bytes = |role: Operand| {
            self.strides(role)[self.dim] as u64 * self.full.dtype.size_bytes() as u64
        };
        Alignments {
            x: alignment_of_bytes(row_bytes(Operand::Input)),
            w: MAX_DECLARED_ALIGNMENT,
            y: alignment_of_bytes(row_bytes(Operand::Output)),
        }
    }

    /// `CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS`: the problem's, with `pad_before` on the split
    /// axis.
    pub fn pre_paddings(&self) -> Nd<i64> {
        let mut pad = self.full.pad.map(i64::from);
        pad[self.dim - 2] = self.chunk.pad_before;
        pad
    }

    /// `CUDNN_ATTR_CONVOLUTION_POST_PADDINGS`: the problem's, with `pad_after` on the split
    /// axis.
    pub fn post_paddings(&self) -> Nd<i64> {
        let mut pad = self.full.pad.map(i64::from);
        pad[self.dim - 2] = self.chunk.pad_after;
        pad
    }
}

/// The index of the split axis ([`split_axis`]) in the tensors' dims `[n, c, spatial...]`: 2
/// for `D` of a 3-D problem or `H` of a 2-D one, 3 for `W` of a 1-D one (4-D tensors).
pub fn split_dim_index(problem: &ConvProblem) -> usize {
    let spatial = problem.spatial_dims();
    2 + match split_axis(problem) {
        Axis::D => 0,
        Axis::H => spatial - 2,
        Axis::W => spatial - 1,
    }
}

/// The rows `rows` of the op's output tensor `role` (`y` for forward, `dx` for backward-data)
/// as a view of the full tensor: `(dims, strides, offset, span)` in elements. What the executor
/// scales by `beta` where no chunk's call writes ([`Chunk::zero_before`]).
pub fn rows_view(
    full: &ConvShapes,
    role: Operand,
    dim: usize,
    rows: Rows,
) -> (Nd<i64>, Nd<i64>, usize, usize) {
    let mut dims = full.dims(role).map(i64::from);
    let strides = packed_strides(full.layout, &dims);
    dims[dim] = rows.len;
    let offset = (rows.first * strides[dim]) as usize;
    (dims, strides, offset, span_of(&dims, &strides))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::solver::ConvProblem;

    fn problem() -> ConvProblem {
        ConvProblem {
            pad_h: 1,
            pad_w: 2,
            stride_h: 2,
            stride_w: 1,
            dilation_h: 1,
            dilation_w: 2,
            groups: 2,
            ..ConvProblem::new(8, 6, 9, 10, 4, 3, 3)
        }
    }

    #[test]
    fn strides_for_nchw_and_nhwc() {
        assert_eq!(
            packed_strides(Layout::Nchw, &[8, 6, 9, 10]),
            [540, 90, 10, 1]
        );
        assert_eq!(
            packed_strides(Layout::Nhwc, &[8, 6, 9, 10]),
            [540, 1, 60, 6]
        );
        // Filters: KCRS and KRSC.
        assert_eq!(packed_strides(Layout::Nchw, &[4, 3, 3, 3]), [27, 9, 3, 1]);
        assert_eq!(packed_strides(Layout::Nhwc, &[4, 3, 3, 3]), [27, 1, 9, 3]);
        // The batch stride is the per-sample element count in both layouts (micro-batches are
        // contiguous ranges), and the strides address every element exactly once.
        for layout in [Layout::Nchw, Layout::Nhwc] {
            let dims = [2, 3, 4, 5];
            let strides = packed_strides(layout, &dims);
            assert_eq!(strides[0], 60);
            let mut seen = [false; 120];
            for n in 0..2 {
                for c in 0..3 {
                    for h in 0..4 {
                        for w in 0..5 {
                            let at =
                                n * strides[0] + c * strides[1] + h * strides[2] + w * strides[3];
                            assert!(!seen[at as usize]);
                            seen[at as usize] = true;
                        }
                    }
                }
            }
            assert!(seen.iter().all(|&s| s));
        }
    }

    #[test]
    fn tensors_uids_and_dims_per_op() {
        for layout in [Layout::Nchw, Layout::Nhwc] {
            let p = ConvProblem {
                layout,
                ..problem()
            };
            let shapes = ConvShapes::new(&p.with_batch(3)).unwrap();
            for op in ConvOp::ALL {
                let g = GraphParams::new(&shapes, op, 1.0, 0.0);
                assert_eq!(g.x.dims, [3, 6, 9, 10]);
                assert_eq!(g.w.dims, [4, 3, 3, 3]); // c / groups
                assert_eq!(g.y.dims, [3, 4, 5, 10]);
                assert_eq!((g.x.uid, g.w.uid, g.y.uid), (UID_X, UID_W, UID_Y));
                assert_eq!(g.x.strides, packed_strides(layout, &g.x.dims));
                assert_eq!(g.w.strides, packed_strides(layout, &g.w.dims));
                assert_eq!(g.y.strides, packed_strides(layout, &g.y.dims));
                assert_eq!(g.conv.pre_paddings, [1, 2]);
                assert_eq!(g.conv.post_paddings, [1, 2]);
                assert_eq!(g.conv.filter_strides, [2, 1]);
                assert_eq!(g.conv.dilations, [1, 2]);
                for role in operand_roles(op) {
                    assert_eq!(g.tensor(role).uid, uid(role));
                }
            }
        }
        assert_eq!(operand_uids(ConvOp::Forward), [UID_X, UID_W, UID_Y]);
        assert_eq!(operand_uids(ConvOp::BackwardData), [UID_W, UID_Y, UID_X]);
        assert_eq!(operand_uids(ConvOp::BackwardFilter), [UID_X, UID_Y, UID_W]);
        // Unique ids are distinct and non-zero.
        const { assert!(UID_X != UID_W && UID_W != UID_Y && UID_X != UID_Y) };
        const { assert!(UID_X > 0 && UID_W > 0 && UID_Y > 0) };
    }

    #[test]
    fn five_d_strides_for_ncdhw_and_ndhwc() {
        // [n, c, d, h, w] = [2, 3, 4, 5, 6]: 360 elements per sample.
        assert_eq!(
            packed_strides(Layout::Nchw, &[2, 3, 4, 5, 6]),
            [360, 120, 30, 6, 1]
        );
        assert_eq!(
            packed_strides(Layout::Nhwc, &[2, 3, 4, 5, 6]),
            [360, 1, 90, 18, 3]
        );
        // Filters: KCTRS and KTRSC.
        assert_eq!(
            packed_strides(Layout::Nhwc, &[8, 3, 2, 3, 3]),
            [54, 1, 27, 9, 3]
        );
        // Every element addressed exactly once, the batch stride a whole sample.
        for layout in [Layout::Nchw, Layout::Nhwc] {
            let dims = [2i64, 3, 4, 5, 6];
            let strides = packed_strides(layout, &dims);
            assert_eq!(strides.len(), 5);
            assert_eq!(strides[0], 360);
            let mut seen = vec![false; 720];
            for n in 0..2 {
                for c in 0..3 {
                    for d in 0..4 {
                        for h in 0..5 {
                            for w in 0..6 {
                                let at = [n, c, d, h, w]
                                    .iter()
                                    .zip(strides.iter())
                                    .map(|(i, s)| i * s)
                                    .sum::<i64>();
                                assert!(!seen[at as usize]);
                                seen[at as usize] = true;
                            }
                        }
                    }
                }
            }
            assert!(seen.iter().all(|&s| s));
        }
    }

    #[test]
    fn three_d_graphs_have_5d_tensors_and_3_spatial_dims() {
        // r3d_18's stem at batch 2: 3 x 16 x 112 x 112, 64 filters of 3 x 7 x 7, pad (1, 3, 3),
        // stride (1, 2, 2): output 64 x 16 x 56 x 56.
        let stem = ConvProblem {
            pad_d: 1,
            pad_h: 3,
            pad_w: 3,
            stride_h: 2,
            stride_w: 2,
            dtype: DType::Fp16,
            layout: Layout::Nhwc,
            ..ConvProblem::new_3d(2, 3, 16, 112, 112, 64, 3, 7, 7)
        };
        let shapes = ConvShapes::new(&stem).unwrap();
        assert_eq!(shapes.spatial_dims(), 3);
        for op in ConvOp::ALL {
            let g = GraphParams::new(&shapes, op, 1.0, 0.0);
            assert_eq!(g.x.dims, [2, 3, 16, 112, 112]);
            assert_eq!(g.w.dims, [64, 3, 3, 7, 7]);
            assert_eq!(g.y.dims, [2, 64, 16, 56, 56]);
            assert_eq!(
                g.x.strides,
                [3 * 16 * 112 * 112, 1, 112 * 112 * 3, 112 * 3, 3]
            );
            assert_eq!(g.w.strides, [147 * 3, 1, 49 * 3, 7 * 3, 3]);
            assert_eq!(g.conv.spatial_dims(), 3);
            assert_eq!(g.conv.pre_paddings, [1, 3, 3]);
            assert_eq!(g.conv.post_paddings, [1, 3, 3]);
            assert_eq!(g.conv.filter_strides, [1, 2, 2]);
            assert_eq!(g.conv.dilations, [1, 1, 1]);
            // 3 x 16 x 112 x 112 halves: 1204224 bytes a sample, 16-aligned at every offset.
            assert_eq!(g.alignments(), Alignments::MAX);
        }
        // A 1-D problem is the 2-D one with unit height: 4-D tensors, 2 spatial dims.
        let speech = ConvProblem {
            stride_w: 5,
            ..ConvProblem::new_1d(4, 1, 16000, 512, 10)
        };
        let g = GraphParams::new(
            &ConvShapes::new(&speech).unwrap(),
            ConvOp::Forward,
            1.0,
            0.0,
        );
        assert_eq!(g.x.dims, [4, 1, 1, 16000]);
        assert_eq!(g.y.dims, [4, 512, 1, 3199]);
        assert_eq!(g.conv.spatial_dims(), 2);
        assert_eq!(g.conv.filter_strides, [1, 5]);
    }

    #[test]
    fn alignment_holds_at_every_sample_offset() {
        assert_eq!(alignment_of_bytes(1), 1);
        assert_eq!(alignment_of_bytes(6), 2);
        assert_eq!(alignment_of_bytes(12), 4);
        assert_eq!(alignment_of_bytes(24), 8);
        assert_eq!(alignment_of_bytes(48), 16);
        assert_eq!(alignment_of_bytes(1 << 20), 16);
        // fp16, 6 x 9 x 10 = 540 elements = 1080 bytes per sample: 8-byte aligned offsets.
        let fp16 = ConvProblem {
            dtype: DType::Fp16,
            ..problem()
        };
        let s = ConvShapes::new(&fp16).unwrap();
        assert_eq!(declared_alignment(&s, Operand::Input), 8);
        // y: 4 x 5 x 10 = 200 elements = 400 bytes: 16.
        assert_eq!(declared_alignment(&s, Operand::Output), 16);
        assert_eq!(declared_alignment(&s, Operand::Filter), 16);
        // An odd per-sample count in fp16: only 2-byte alignment is certain.
        let odd = ConvProblem {
            dtype: DType::Fp16,
            ..ConvProblem::new(4, 3, 5, 5, 2, 3, 3)
        };
        let s = ConvShapes::new(&odd).unwrap();
        assert_eq!(declared_alignment(&s, Operand::Input), 2);
        // Property: every sample offset of a 256-aligned buffer satisfies the declaration.
        for problem in [problem(), fp16, odd] {
            let s = ConvShapes::new(&problem).unwrap();
            for role in [Operand::Input, Operand::Output] {
                let align = declared_alignment(&s, role);
                let sample_bytes = (s.elements_per_sample(role) * s.dtype.size_bytes()) as u64;
                for first in 0..s.batch() as u64 {
                    assert!(is_aligned(0x7f00_0000_0000 + first * sample_bytes, align));
                }
            }
        }
        assert!(is_aligned(0x1002, 2));
        assert!(!is_aligned(0x1002, 4));
        assert!(is_aligned(0x1003, 1));
        let g = GraphParams::new(
            &ConvShapes::new(&odd).unwrap(),
            ConvOp::BackwardData,
            1.0,
            0.0,
        );
        // [w, dy, dx]: filter 16; y = 2 x 3 x 3 = 18 elements = 36 bytes: 4; x: 2.
        assert_eq!(g.operand_alignments(), [16, 4, 2]);
    }

    #[test]
    fn alignment_from_the_offset_the_plan_runs_at() {
        // An odd-sized stem: 3 x 299 x 299 fp16 = 536406 bytes per sample (2-aligned).
        let stem = ConvProblem {
            dtype: DType::Fp16,
            layout: Layout::Nhwc,
            stride_h: 2,
            stride_w: 2,
            ..ConvProblem::new(8, 3, 299, 299, 32, 3, 3)
        };
        let s = ConvShapes::new(&stem).unwrap();
        assert_eq!(Alignments::any_sample(&s).x, 2);
        // At sample 0 (an undivided plan, or the first micro-batch) everything is 16.
        assert_eq!(Alignments::at_sample(&s, 0), Alignments::MAX);
        // Odd samples are 2-aligned, sample 2 is 4-, sample 4 8-, sample 8 16-aligned.
        assert_eq!(Alignments::at_sample(&s, 1).x, 2);
        assert_eq!(Alignments::at_sample(&s, 2).x, 4);
        assert_eq!(Alignments::at_sample(&s, 4).x, 8);
        assert_eq!(Alignments::at_sample(&s, 8).x, 16);
        assert_eq!(Alignments::at_sample(&s, 3).w, 16);
        // Property: the declaration holds for the pointer at that offset, and never falls
        // below the any-offset one.
        for first in 0..64usize {
            let a = Alignments::at_sample(&s, first);
            for role in [Operand::Input, Operand::Output] {
                let sample_bytes = (s.elements_per_sample(role) * 2) as u64;
                assert!(is_aligned(
                    0x7f00_0000_0000 + first as u64 * sample_bytes,
                    a.of(role)
                ));
                assert!(a.of(role) >= declared_alignment(&s, role));
            }
        }
        let g = GraphParams::with_alignments(&s, ConvOp::BackwardFilter, 1.0, 0.0, Alignments::MAX);
        assert_eq!(g.alignments(), Alignments::MAX);
        assert_eq!(g.operand_alignments(), [16, 16, 16]);
        assert_eq!(
            GraphParams::new(&s, ConvOp::Forward, 1.0, 0.0).alignments(),
            Alignments::any_sample(&s)
        );
    }

    /// What the profiler declares when it times a size (the alignment of
    /// every offset, `any_sample`) holds at every offset any plan runs that size at, for every
    /// mini-batch the measurement may serve; the pointer it times at (`timing_offset`) has
    /// exactly that alignment whenever the plan splits. The old rule, the alignment of sample
    /// `N - m`, is the negative control.
    #[test]
    fn a_size_is_timed_at_an_alignment_every_offset_has() {
        use crate::solver::{steps, timing_offset, Algo, MicroBatch, Plan};
        // AlexNet's conv1 in fp16 NHWC with 3 channels (3 x 227 x 227 x 2 bytes: 2-aligned),
        // an odd-sized 3 x 299 x 299 stem, and a layer whose samples are all 16-aligned.
        let problems = [
            ConvProblem {
                stride_h: 4,
                stride_w: 4,
                dtype: DType::Fp16,
                layout: Layout::Nhwc,
                ..ConvProblem::new(12, 3, 227, 227, 96, 11, 11)
            },
            ConvProblem {
                dtype: DType::Bf16,
                layout: Layout::Nhwc,
                ..ConvProblem::new(12, 3, 299, 299, 32, 3, 3)
            },
            ConvProblem::new(12, 64, 56, 56, 64, 3, 3),
        ];
        // Every ordered split of `n` samples.
        fn splits(n: i64) -> Vec<Vec<i64>> {
            if n == 0 {
                return vec![vec![]];
            }
            (1..=n)
                .flat_map(|first| {
                    splits(n - first).into_iter().map(move |mut rest| {
                        rest.insert(0, first);
                        rest
                    })
                })
                .collect()
        }
        let at_least = |run: Alignments, timed: Alignments| {
            run.x >= timed.x && run.w >= timed.w && run.y >= timed.y
        };
        let mut old_rule_misses = 0;
        for problem in problems {
            for n in 1..=problem.n {
                for sizes in splits(n) {
                    let plan = Plan {
                        layer: "l".into(),
                        problem: problem.with_batch(n),
                        op: ConvOp::Forward,
                        split: crate::solver::SplitDim::Batch,
                        micro_batches: sizes
                            .iter()
                            .map(|&size| MicroBatch {
                                size,
                                algo: Algo::Legacy(0),
                                workspace_bytes: 0,
                                time_ms: 1.0,
                            })
                            .collect(),
                    };
                    for step in steps(&plan, 0.0) {
                        let shapes =
                            ConvShapes::new(&problem.with_batch(step.size as i64)).unwrap();
                        let timed = Alignments::any_sample(&shapes);
                        let run = Alignments::at_sample(&shapes, step.first);
                        assert!(at_least(run, timed), "{sizes:?} {step:?}");
                        // A measurement serves every mini-batch of the shape, larger ones too.
                        for larger in n..=problem.n {
                            let offset = timing_offset(larger as usize, step.size);
                            if offset > 0 {
                                assert_eq!(Alignments::at_sample(&shapes, offset), timed);
                            }
                        }
                        let old = Alignments::at_sample(&shapes, n as usize - step.size);
                        if !at_least(run, old) {
                            old_rule_misses += 1;
                        }
                    }
                }
            }
        }
        // The old rule promised more than some runs have (4+4+4 of 12: sample 4 vs sample 8).
        assert!(old_rule_misses > 0);
        let conv1 = ConvShapes::new(&problems[0].with_batch(4)).unwrap();
        assert_eq!(Alignments::at_sample(&conv1, 8).x, 16);
        assert_eq!(Alignments::at_sample(&conv1, 4).x, 8);
        assert_eq!(Alignments::any_sample(&conv1).x, 2);
    }

    /// A spatial chunk's descriptor values: views of the full tensors (the chunk's
    /// rows, the full strides, a pointer offset), the split axis padded only at the border.
    #[test]
    fn chunk_views_of_a_2d_nhwc_problem() {
        use crate::solver::spatial::{chunks, split_axis, AxisGeometry};
        // 2 x 8 x 12 x 10 fp16 NHWC, 16 filters 3x3 pad 1: y is 2 x 16 x 12 x 10.
        let p = ConvProblem {
            pad_h: 1,
            pad_w: 1,
            dtype: DType::Fp16,
            layout: Layout::Nhwc,
            ..ConvProblem::new(2, 8, 12, 10, 16, 3, 3)
        };
        let g = AxisGeometry::of(&p, split_axis(&p));
        let parts = chunks(&g, ConvOp::Forward, &[3, 4, 5]).unwrap();
        let views: Vec<ChunkShapes> = parts
            .iter()
            .map(|c| ChunkShapes::new(&p, c).unwrap())
            .collect();
        let [first, middle, last] = [views[0], views[1], views[2]];
        assert_eq!(first.dim, 2);
        // Rows [0, 3) of y read x rows [0, 4): padded before only.
        assert_eq!(first.dims(Operand::Input), [2, 8, 4, 10]);
        assert_eq!(first.dims(Operand::Output), [2, 16, 3, 10]);
        assert_eq!(first.dims(Operand::Filter), [16, 8, 3, 3]);
        assert_eq!(first.pre_paddings(), [1, 1]);
        assert_eq!(first.post_paddings(), [0, 1]);
        assert!(!first.is_symmetric());
        // The full tensors' NHWC strides: [h*w*c, 1, w*c, c].
        assert_eq!(first.strides(Operand::Input), [960, 1, 80, 8]);
        assert_eq!(first.strides(Operand::Output), [1920, 1, 160, 16]);
        assert_eq!(
            (first.offset(Operand::Input), first.offset(Operand::Output)),
            (0, 0)
        );
        // Rows [3, 7) of y read x rows [2, 8): no padding, offsets of 2 and 3 rows.
        assert_eq!(middle.dims(Operand::Input), [2, 8, 6, 10]);
        assert_eq!(middle.pre_paddings(), [0, 1]);
        assert_eq!(middle.post_paddings(), [0, 1]);
        assert!(middle.is_symmetric());
        assert_eq!(middle.offset(Operand::Input), 2 * 80);
        assert_eq!(middle.offset(Operand::Output), 3 * 160);
        assert_eq!(middle.byte_offset(Operand::Input), 320);
        assert_eq!(middle.byte_offset(Operand::Output), 960);
        // Span: one sample's whole stride plus the rows of the last sample.
        assert_eq!(middle.span(Operand::Input), 960 + 6 * 80);
        assert_eq!(middle.span(Operand::Filter), 16 * 8 * 9);
        // Rows [7, 12) read x rows [6, 12): padded after only.
        assert_eq!(last.pre_paddings(), [0, 1]);
        assert_eq!(last.post_paddings(), [1, 1]);
        assert_eq!(last.range(Operand::Output), (7 * 160, 1920 + 5 * 160));
        for v in &views {
            let full = v.full;
            for role in [Operand::Input, Operand::Output, Operand::Filter] {
                // A view never leaves its tensor, and its span is the brute-force reach.
                let (offset, span) = v.range(role);
                assert!(offset + span <= full.elements(role), "{role:?} {v:?}");
                let dims = v.dims(role);
                let strides = v.strides(role);
                let mut reach = 0i64;
                for (d, s) in dims.iter().zip(strides.iter()) {
                    reach += (d - 1) * s;
                }
                assert_eq!(span as i64, reach + 1);
            }
            let g = GraphParams::for_chunk(v, ConvOp::Forward, 1.0, 0.0, v.alignments());
            assert_eq!(g.x.dims, v.dims(Operand::Input));
            assert_eq!(g.x.strides, v.strides(Operand::Input));
            assert_eq!(g.y.strides, v.strides(Operand::Output));
            assert_eq!(g.w.strides, packed_strides(Layout::Nhwc, &g.w.dims));
            assert_eq!(g.conv.pre_paddings, v.pre_paddings());
            assert_eq!(g.conv.post_paddings, v.post_paddings());
            assert_eq!(
                g.operand_spans(),
                [
                    v.span(Operand::Input),
                    v.span(Operand::Filter),
                    v.span(Operand::Output)
                ]
            );
        }
        // Alignment from the byte offset: x at 2 rows = 320 bytes (16), y at 3 rows = 960 (16);
        // any row: 160 and 320 bytes a row, both 16.
        assert_eq!(middle.alignments(), Alignments::MAX);
        assert_eq!(middle.any_row_alignments(), Alignments::MAX);
        // A row of 3 channels x 5 columns in fp16 is 30 bytes: 2-aligned at odd rows.
        let odd = ConvProblem { c: 3, w: 5, ..p };
        let g = AxisGeometry::of(&odd, split_axis(&odd));
        let c = chunks(&g, ConvOp::Forward, &[3, 4, 5]).unwrap();
        let v = ChunkShapes::new(&odd, &c[1]).unwrap();
        assert_eq!(v.byte_offset(Operand::Input), 2 * 30);
        assert_eq!(v.alignments().x, 4);
        assert_eq!(v.any_row_alignments().x, 2);
        // A packed chunk is the whole tensor: span = elements.
        let whole = chunks(
            &AxisGeometry::of(&p, split_axis(&p)),
            ConvOp::Forward,
            &[12],
        )
        .unwrap();
        let v = ChunkShapes::new(&p, &whole[0]).unwrap();
        assert_eq!(v.shapes, ConvShapes::new(&p).unwrap());
        assert_eq!(v.span(Operand::Input), v.full.elements(Operand::Input));
        assert_eq!(
            GraphParams::for_chunk(&v, ConvOp::Forward, 1.0, 0.0, Alignments::MAX),
            GraphParams::with_alignments(&v.full, ConvOp::Forward, 1.0, 0.0, Alignments::MAX)
        );
    }

    #[test]
    fn chunk_views_of_3d_1d_and_backward_data() {
        use crate::solver::spatial::{chunks, split_axis, AxisGeometry};
        // 3-D, NDHWC, 3x3x3 pad 1 stride 2: D = 9 -> 5 output frames, split along D (dim 2).
        let p3 = ConvProblem {
            pad_d: 1,
            pad_h: 1,
            pad_w: 1,
            stride_d: 2,
            stride_h: 2,
            stride_w: 2,
            dtype: DType::Fp16,
            layout: Layout::Nhwc,
            ..ConvProblem::new_3d(1, 4, 9, 6, 6, 8, 3, 3, 3)
        };
        let g = AxisGeometry::of(&p3, split_axis(&p3));
        let c = chunks(&g, ConvOp::Forward, &[2, 3]).unwrap();
        let v = ChunkShapes::new(&p3, &c[1]).unwrap();
        assert_eq!(v.dim, 2);
        // Output frames [2, 5) read input frames 3..=8, padded after by 1.
        assert_eq!(v.dims(Operand::Input), [1, 4, 6, 6, 6]);
        assert_eq!(v.dims(Operand::Output), [1, 8, 3, 3, 3]);
        assert_eq!(v.pre_paddings(), [0, 1, 1]);
        assert_eq!(v.post_paddings(), [1, 1, 1]);
        assert_eq!(v.strides(Operand::Input), [4 * 9 * 36, 1, 144, 24, 4]);
        assert_eq!(v.offset(Operand::Input), 3 * 144);
        assert_eq!(v.offset(Operand::Output), 2 * 72);
        // Backward-data chunks dx rows: the view of dx is chunk.input, of dy chunk.output.
        let bd = chunks(&g, ConvOp::BackwardData, &[4, 5]).unwrap();
        let v = ChunkShapes::new(&p3, &bd[1]).unwrap();
        assert_eq!(v.first_row(Operand::Input), bd[1].input.first);
        assert_eq!(v.first_row(Operand::Output), bd[1].output.first);
        assert_eq!(v.dims(Operand::Input)[2], bd[1].input.len);
        assert_eq!(v.dims(Operand::Output)[2], bd[1].output.len);
        let params = GraphParams::for_chunk(&v, ConvOp::BackwardData, 1.0, 0.0, v.alignments());
        assert_eq!(params.conv.pre_paddings[0], bd[1].pad_before);
        assert_eq!(params.conv.post_paddings[0], bd[1].pad_after);
        // 1-D: the split runs along W, the last dim.
        let p1 = ConvProblem {
            pad_w: 2,
            ..ConvProblem::new_1d(2, 3, 40, 5, 5)
        };
        let g = AxisGeometry::of(&p1, split_axis(&p1));
        let c = chunks(&g, ConvOp::Forward, &[7, 13, 20]).unwrap();
        let v = ChunkShapes::new(&p1, &c[1]).unwrap();
        assert_eq!(v.dim, 3);
        assert_eq!(v.dims(Operand::Input), [2, 3, 1, 17]);
        assert_eq!(v.offset(Operand::Input), 5);
        assert_eq!(v.pre_paddings(), [0, 0]);
        assert_eq!(v.post_paddings(), [0, 0]);
        // Not chunks: no call, rows outside the tensor, rows that do not make the output.
        let mut bad = c[1];
        bad.output.len += 1;
        assert!(ChunkShapes::new(&p1, &bad).is_err());
        let mut bad = c[2];
        bad.input.len += 1;
        assert!(ChunkShapes::new(&p1, &bad).is_err());
        let mut none = c[0];
        none.input.len = 0;
        assert!(ChunkShapes::new(&p1, &none).is_err());
    }

    #[test]
    fn rows_views_tile_the_output() {
        // NCHW 2 x 3 x 5 x 4: rows [1, 3) of H are two 4-element runs per channel.
        let s = ConvShapes::new(&ConvProblem::new(2, 3, 5, 4, 6, 1, 1)).unwrap();
        let (dims, strides, offset, span) =
            rows_view(&s, Operand::Output, 2, Rows { first: 1, len: 2 });
        assert_eq!(dims, [2, 6, 2, 4]);
        assert_eq!(strides, [120, 20, 4, 1]);
        assert_eq!(offset, 4);
        assert_eq!(span, 120 + 5 * 20 + 2 * 4);
        assert_eq!(span_of(&[2, 0, 3], &[1, 1, 1]), 0);
    }
}
