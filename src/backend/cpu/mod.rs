//! CPU convolution backend: real forward, backward-data and backward-filter kernels.
//!
//! This is the backend that `mucudnn` measures and runs when there is no GPU (its
//! [`reference`] module is the yardstick other backends are checked against). It mirrors the
//! parts of cuDNN the tuner depends on:
//!
//! - several algorithms per operation ([`CpuAlgo`]) with different speed and a different
//!   workspace requirement, so that dividing a mini-batch into micro-batches is a real
//!   time/memory trade-off;
//! - [`workspace_bytes`], the exact scratch size an algorithm needs for a given problem (the
//!   micro-batch size is `problem.n`), like `cudnnGetConvolution*WorkspaceSize`;
//! - [`run`], which computes `out = alpha * op(a, b) + beta * out` using a caller-provided
//!   raw-byte workspace, like `cudnnConvolution*`.
//!
//! Data enters as plain slices of storage elements ([`Element`]: `f32`, [`half::f16`],
//! [`half::bf16`]) in the problem's layout and leaves by being written into the `out` slice;
//! the workspace is only scratch. Arithmetic is always in `f32`.
//!
//! Tensor layouts (the batch dimension is outermost in both, so a micro-batch is a contiguous
//! sub-slice of the batch):
//!
//! | layout | activations `x`, `y` | filters `w` |
//! |--------|----------------------|-------------|
//! | NCHW   | `n x c x h x w`      | `k x c/g x r x s` |
//! | NHWC   | `n x h x w x c`      | `k x r x s x c/g` |
//! | NCDHW (`Layout::Nchw`, 3-D) | `n x c x d x h x w` | `k x c/g x t x r x s` |
//! | NDHWC (`Layout::Nhwc`, 3-D) | `n x d x h x w x c` | `k x t x r x s x c/g` |
//!
//! Every algorithm runs 1-, 2- and 3-D problems: a 2-D problem is the 3-D one of depth 1
//! (`d = t = 1`), a 1-D one the 2-D one of height 1 (NCW / NWC), and the kernels walk depth
//! and height together as rows (see `Geom`), so there is one code path for all three.
//!
//! Determinism: every algorithm computes each image independently for the forward and
//! backward-data passes (and with a fixed summation order), so running a batch in
//! micro-batches with the same algorithm gives bit-identical results. Backward filter sums
//! over the batch, so micro-batching only changes the summation order.
//!
//! [`reference`] holds a naive `f64` implementation for tests.
//!
//! ```
//! use mucudnn::backend::cpu::{self, AlignedWorkspace, CpuAlgo};
//! use mucudnn::solver::{ConvOp, ConvProblem};
//!
//! let problem = ConvProblem { pad_h: 1, pad_w: 1, ..ConvProblem::new(2, 3, 8, 8, 4, 3, 3) };
//! let [(_, x_len), (_, w_len), (_, y_len)] = cpu::buffer_lens(&problem, ConvOp::Forward)?;
//! let (x, w) = (vec![1.0f32; x_len], vec![0.5f32; w_len]);
//! let mut y = vec![0.0f32; y_len];
//! let algo = CpuAlgo::Im2colGemm;
//! let mut ws = AlignedWorkspace::new(cpu::workspace_bytes(&problem, ConvOp::Forward, algo));
//! cpu::run(&problem, ConvOp::Forward, algo, 1.0, &x, &w, 0.0, &mut y, ws.as_bytes_mut())?;
//! assert_eq!(y[1 * 8 + 1], 3.0 * 9.0 * 0.5); // an interior output sees 3 x 3 x 3 taps
//! # Ok::<(), cpu::CpuError>(())
//! ```

mod direct;
mod gemm;
pub mod reference;
#[cfg(test)]
mod tests;

use crate::solver::spatial::{split_axis, Axis, AxisGeometry, Chunk};
use crate::solver::{ConvOp, ConvProblem, DType, Layout, ShapeError};
use std::fmt;

/// Convolution algorithms of the CPU backend. The numeric ids are stable (they are stored in
/// profiles and plans).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CpuAlgo {
    /// Direct loops over the convolution sum. No workspace.
    Direct,
    /// im2col (col2im for backward data) of the whole micro-batch, then one GEMM per group.
    /// Fastest on large batches; workspace grows linearly with the micro-batch size.
    Im2colGemm,
    /// im2col + GEMM one image at a time. Workspace independent of the micro-batch size.
    Im2colGemmPerImage,
}

impl CpuAlgo {
    /// Every algorithm, in id order.
    pub const ALL: [CpuAlgo; 3] = [
        CpuAlgo::Direct,
        CpuAlgo::Im2colGemm,
        CpuAlgo::Im2colGemmPerImage,
    ];

    /// Stable numeric id (0, 1, 2).
    pub fn id(self) -> u32 {
        match self {
            CpuAlgo::Direct => 0,
            CpuAlgo::Im2colGemm => 1,
            CpuAlgo::Im2colGemmPerImage => 2,
        }
    }

    /// Inverse of [`CpuAlgo::id`].
    pub fn from_id(id: u32) -> Option<Self> {
        CpuAlgo::ALL.into_iter().find(|a| a.id() == id)
    }

    /// The name tables and reports use: `direct`, `im2col-batched`, `im2col-per-image` (the
    /// solver's names table, [`crate::solver::legacy_name`], which every report reads).
    pub fn name(self) -> &'static str {
        crate::solver::legacy_name(crate::solver::BackendKind::Cpu, ConvOp::Forward, self.id())
            .unwrap_or("unknown")
    }
}

impl fmt::Display for CpuAlgo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// A tensor storage type: `f32`, [`half::f16`] or [`half::bf16`] (sealed: the GEMM path relies
/// on `as_f32_slice` being `Some` exactly for fp32). Kernels load elements as `f32`,
/// accumulate in `f32` and round once when storing.
pub trait Element: sealed::Sealed + Copy + Send + Sync + fmt::Debug + 'static {
    /// The problem dtype this type stores.
    const DTYPE: DType;
    /// Widen to `f32` (exact for all three types).
    fn to_f32(self) -> f32;
    /// Round from `f32` (round-to-nearest-even).
    fn from_f32(value: f32) -> Self;
    /// The same slice as `f32`, when `Self` is `f32`: lets the GEMM path read fp32 operands in
    /// place instead of converting them into the workspace.
    fn as_f32_slice(slice: &[Self]) -> Option<&[f32]> {
        let _ = slice;
        None
    }
    /// Widen `src` into `dst` (same length).
    fn load_slice(src: &[Self], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = s.to_f32();
        }
    }
}

impl Element for f32 {
    const DTYPE: DType = DType::Fp32;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(value: f32) -> Self {
        value
    }
    fn as_f32_slice(slice: &[Self]) -> Option<&[f32]> {
        Some(slice)
    }
    fn load_slice(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
}

impl Element for half::f16 {
    const DTYPE: DType = DType::Fp16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16_bits_to_f32(self.to_bits())
    }
    #[inline(always)]
    fn from_f32(value: f32) -> Self {
        half::f16::from_f32(value)
    }
    fn load_slice(src: &[Self], dst: &mut [f32]) {
        half::slice::HalfFloatSliceExt::convert_to_f32_slice(src, dst);
    }
}

impl Element for half::bf16 {
    const DTYPE: DType = DType::Bf16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        half::bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(value: f32) -> Self {
        half::bf16::from_f32(value)
    }
    fn load_slice(src: &[Self], dst: &mut [f32]) {
        half::slice::HalfFloatSliceExt::convert_to_f32_slice(src, dst);
    }
}

/// Exact fp16 -> fp32 widening with integer operations only.
///
/// `half::f16::to_f32` checks for the F16C instruction at run time and calls a non-inlined
/// intrinsic on every element, which made fp16 direct kernels 20x slower than fp32; this
/// branch-light version inlines and vectorises. (After F. Giesen's `half_to_float`.)
#[inline(always)]
fn f16_bits_to_f32(h: u16) -> f32 {
    const SHIFTED_EXP: u32 = 0x7c00 << 13; // fp16 exponent mask, in fp32 position
    let h = u32::from(h);
    let mut o = (h & 0x7fff) << 13; // exponent and mantissa
    let exp = o & SHIFTED_EXP;
    o += (127 - 15) << 23; // rebias the exponent
    if exp == SHIFTED_EXP {
        o += (128 - 16) << 23; // Inf / NaN: maximal exponent
    } else if exp == 0 {
        // Zero / subnormal: renormalise through a float subtraction (exact).
        o += 1 << 23;
        o = (f32::from_bits(o) - f32::from_bits(113 << 23)).to_bits();
    }
    f32::from_bits(o | ((h & 0x8000) << 16))
}

/// Why [`run`] refused to compute. Nothing is written to `out` when an error is returned.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CpuError {
    #[error("invalid convolution: {0}")]
    Shape(#[from] ShapeError),
    #[error("{field} = {value} is too large for the CPU backend (limit 2^31 - 1)")]
    FieldTooLarge { field: &'static str, value: i64 },
    #[error("buffer `{buffer}` has {actual} elements, expected {expected}")]
    BufferLength {
        buffer: &'static str,
        expected: usize,
        actual: usize,
    },
    #[error("workspace too small: {needed} bytes needed, {provided} provided")]
    WorkspaceTooSmall { needed: u64, provided: u64 },
    #[error(
        "workspace of {provided} bytes is not 4-byte aligned and too short to skip to an aligned \
         start ({needed} aligned bytes needed); allocate it with `AlignedWorkspace`"
    )]
    WorkspaceMisaligned { needed: u64, provided: u64 },
    #[error("not a spatial chunk of this problem: {0}")]
    BadChunk(String),
    #[error("element type is {buffer} but the problem's dtype is {problem}")]
    DTypeMismatch { problem: DType, buffer: DType },
    /// One call holds at most what 32-bit indexing reaches (the kernels' index arithmetic
    /// relies on it, as cuDNN's does): a larger problem runs as a plan that splits it.
    #[error(
        "buffer `{buffer}` of one call has {elements} elements, more than the 2^31 - 1 a call \
         holds: run the problem through a plan, which splits it (mucudnn::exec::execute_cpu)"
    )]
    CallTooLarge {
        buffer: &'static str,
        elements: usize,
    },
}

/// Validated problem sizes as `usize`, plus derived quantities.
///
/// The kernels work on *rows*: a row is a run of `w` input (or `q` output) elements along the
/// width, and the rows of one image and channel are its depth x height positions, `d * h` of
/// them in the input (`o * p` in the output, `t * r` in a filter), numbered depth-major
/// (`id * h + ih`). Width keeps its own loops and index ranges; how the rows of the three
/// tensors meet (through depth and height padding, stride and dilation) is answered by
/// [`Geom::rows_read_by`], [`Geom::rows_reading`] (tabulated by [`RowMap`]) and
/// [`Geom::row_runs`]. A 2-D problem is
/// the 3-D one with `d = t = o = 1`, where these are its rows of height.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Geom {
    pub n: usize,
    pub c: usize,
    pub d: usize,
    pub h: usize,
    pub w: usize,
    pub k: usize,
    pub t: usize,
    pub r: usize,
    pub s: usize,
    pub pd: usize,
    pub ph: usize,
    pub pw: usize,
    pub sd: usize,
    pub sh: usize,
    pub sw: usize,
    pub dd: usize,
    pub dh: usize,
    pub dw: usize,
    pub groups: usize,
    /// Channels per group.
    pub cg: usize,
    /// Filters per group.
    pub kg: usize,
    /// Output depth.
    pub o: usize,
    /// Output height.
    pub p: usize,
    /// Output width.
    pub q: usize,
    pub layout: Layout,
}

impl Geom {
    pub fn new(problem: &ConvProblem) -> Result<Geom, CpuError> {
        problem.validate()?;
        let (o, p, q) = problem.output_dhw();
        // Bounding every field by 2^31 keeps all index arithmetic (at most sums of two products
        // of two fields, or of a field and a call's tensor's element count, which `run_geom`
        // bounds by 2^31) inside isize/usize on 64-bit targets, even for absurd paddings or
        // strides that `validate` accepts.
        let fields = [
            ("n", problem.n),
            ("c", problem.c),
            ("d", problem.d),
            ("h", problem.h),
            ("w", problem.w),
            ("k", problem.k),
            ("t", problem.t),
            ("r", problem.r),
            ("s", problem.s),
            ("pad_d", problem.pad_d),
            ("pad_h", problem.pad_h),
            ("pad_w", problem.pad_w),
            ("stride_d", problem.stride_d),
            ("stride_h", problem.stride_h),
            ("stride_w", problem.stride_w),
            ("dilation_d", problem.dilation_d),
            ("dilation_h", problem.dilation_h),
            ("dilation_w", problem.dilation_w),
            ("groups", problem.groups),
        ];
        let mut v = [0usize; 19];
        for (slot, (field, value)) in v.iter_mut().zip(fields) {
            // (On targets with a narrower usize every problem is refused.)
            if value > i64::from(i32::MAX) || usize::BITS < 64 {
                return Err(CpuError::FieldTooLarge { field, value });
            }
            *slot = value as usize;
        }
        let [n, c, d, h, w, k, t, r, s, pd, ph, pw, sd, sh, sw, dd, dh, dw, groups] = v;
        Ok(Geom {
            n,
            c,
            d,
            h,
            w,
            k,
            t,
            r,
            s,
            pd,
            ph,
            pw,
            sd,
            sh,
            sw,
            dd,
            dh,
            dw,
            groups,
            cg: c / groups,
            kg: k / groups,
            o: o as usize,
            p: p as usize,
            q: q as usize,
            layout: problem.layout,
        })
    }

    /// Rows of one input image and channel: `d * h`.
    pub fn in_rows(&self) -> usize {
        self.d * self.h
    }

    /// Rows of one output image and filter: `o * p`.
    pub fn out_rows(&self) -> usize {
        self.o * self.p
    }

    /// Rows of one filter and channel: `t * r`.
    pub fn filter_rows(&self) -> usize {
        self.t * self.r
    }

    /// Elements of one input image and channel: `d * h * w`.
    pub fn in_plane(&self) -> usize {
        self.in_rows() * self.w
    }

    /// Elements of one output image and filter: `o * p * q`.
    pub fn out_plane(&self) -> usize {
        self.out_rows() * self.q
    }

    /// Taps of one filter and channel: `t * r * s`.
    pub fn taps(&self) -> usize {
        self.filter_rows() * self.s
    }

    /// The rows output row `orow` reads: `(filter row, input row)` for every filter row whose
    /// input row lies inside the input (not in the padding), in filter-row order.
    pub fn rows_read_by(&self, orow: usize, out: &mut Vec<(usize, usize)>) {
        out.clear();
        let (o, p) = (orow / self.p, orow % self.p);
        let depths = valid_range(
            self.t,
            0,
            self.d as isize,
            self.dd,
            lin(o, self.sd, self.pd),
        );
        let heights = valid_range(
            self.r,
            0,
            self.h as isize,
            self.dh,
            lin(p, self.sh, self.ph),
        );
        for t in depths {
            let id = o * self.sd + t * self.dd - self.pd;
            for r in heights.clone() {
                let ih = p * self.sh + r * self.dh - self.ph;
                out.push((t * self.r + r, id * self.h + ih));
            }
        }
    }

    /// The rows that read input row `irow`: `(filter row, output row)` for every filter row
    /// through which an output row reads it, in filter-row order.
    pub fn rows_reading(&self, irow: usize, out: &mut Vec<(usize, usize)>) {
        out.clear();
        let (id, ih) = (irow / self.h, irow % self.h);
        for t in taps_of(id, self.t, self.sd, self.dd, self.pd, self.o) {
            for r in taps_of(ih, self.r, self.sh, self.dh, self.ph, self.p) {
                out.push((t.0 * self.r + r.0, t.1 * self.p + r.1));
            }
        }
    }

    /// The output rows that read inside the input through filter row `frow`, as runs
    /// `(first output row, its input row, length)`: along a run the output row goes up by 1
    /// and the input row by `sh` (one run per output depth).
    pub fn row_runs(&self, frow: usize, out: &mut Vec<(usize, usize, usize)>) {
        out.clear();
        let (t, r) = (frow / self.r, frow % self.r);
        let ps = valid_range(
            self.p,
            0,
            self.h as isize,
            self.sh,
            lin(r, self.dh, self.ph),
        );
        if ps.is_empty() {
            return;
        }
        for o in valid_range(
            self.o,
            0,
            self.d as isize,
            self.sd,
            lin(t, self.dd, self.pd),
        ) {
            let id = o * self.sd + t * self.dd - self.pd;
            let ih = ps.start * self.sh + r * self.dh - self.ph;
            out.push((o * self.p + ps.start, id * self.h + ih, ps.len()));
        }
    }

    /// The three buffers' lengths for `op`, in [`run`]'s argument order, with their names.
    pub fn buffer_lens(&self, op: ConvOp) -> [(&'static str, usize); 3] {
        let (x, w, y) = (self.x_len(), self.w_len(), self.y_len());
        match op {
            ConvOp::Forward => [("x", x), ("w", w), ("y", y)],
            ConvOp::BackwardData => [("w", w), ("dy", y), ("dx", x)],
            ConvOp::BackwardFilter => [("x", x), ("dy", y), ("dw", w)],
        }
    }

    /// Elements of the input activation tensor (`x` / `dx`).
    pub fn x_len(&self) -> usize {
        self.n * self.c * self.in_plane()
    }

    /// Elements of the filter tensor (`w` / `dw`).
    pub fn w_len(&self) -> usize {
        self.k * self.cg * self.taps()
    }

    /// Elements of the output activation tensor (`y` / `dy`).
    pub fn y_len(&self) -> usize {
        self.n * self.k * self.out_plane()
    }
}

/// Pairs of rows that meet, per row of one tensor: [`Geom::rows_read_by`] per output row
/// ([`RowMap::read_by`]) or [`Geom::rows_reading`] per input row ([`RowMap::reading`]).
/// Tabulated once per call when the table is small (it holds one pair per output row and
/// filter row that reads inside the input: a few thousand for real layers), so that kernels
/// which revisit a row for every image, group or channel do not recompute it; past
/// [`RowMap::LIMIT`] pairs each row is computed when asked for.
pub(crate) struct RowMap<'a> {
    geom: &'a Geom,
    reading: bool,
    /// Row `i`'s pairs are `pairs[starts[i]..starts[i + 1]]`; empty when not tabulated.
    starts: Vec<usize>,
    /// The table, or the last row computed.
    pairs: Vec<(usize, usize)>,
}

impl<'a> RowMap<'a> {
    /// Most pairs tabulated (small under test, so that both paths run).
    const LIMIT: usize = if cfg!(test) { 40 } else { 1 << 16 };

    /// `(filter row, input row)` pairs per output row.
    pub fn read_by(geom: &'a Geom) -> Self {
        Self::new(geom, false)
    }

    /// `(filter row, output row)` pairs per input row.
    pub fn reading(geom: &'a Geom) -> Self {
        Self::new(geom, true)
    }

    fn new(geom: &'a Geom, reading: bool) -> Self {
        let mut map = RowMap {
            geom,
            reading,
            starts: Vec::new(),
            pairs: Vec::new(),
        };
        let rows = if reading {
            geom.in_rows()
        } else {
            geom.out_rows()
        };
        let mut row_pairs = Vec::with_capacity(geom.filter_rows());
        map.starts.push(0);
        for row in 0..rows {
            map.compute(row, &mut row_pairs);
            if map.pairs.len() + row_pairs.len() > Self::LIMIT {
                map.starts = Vec::new();
                map.pairs = row_pairs;
                return map;
            }
            map.pairs.extend_from_slice(&row_pairs);
            map.starts.push(map.pairs.len());
        }
        map
    }

    fn compute(&self, row: usize, out: &mut Vec<(usize, usize)>) {
        if self.reading {
            self.geom.rows_reading(row, out);
        } else {
            self.geom.rows_read_by(row, out);
        }
    }

    /// The pairs of row `row`.
    pub fn get(&mut self, row: usize) -> &[(usize, usize)] {
        if self.starts.is_empty() {
            let mut pairs = std::mem::take(&mut self.pairs);
            self.compute(row, &mut pairs);
            self.pairs = pairs;
            &self.pairs
        } else {
            &self.pairs[self.starts[row]..self.starts[row + 1]]
        }
    }
}

/// `i * step - pad`: the input offset of tap `i` (step = dilation) for output 0, or of output
/// `i` (step = stride) for tap 0.
#[inline]
pub(crate) fn lin(i: usize, step: usize, pad: usize) -> isize {
    (i * step) as isize - pad as isize
}

/// The taps `(f, o)` of one dimension through which input position `i` is read, `o` being the
/// output position (`i = o * stride + f * dilation - pad`), in tap order.
pub(crate) fn taps_of(
    i: usize,
    f_len: usize,
    stride: usize,
    dilation: usize,
    pad: usize,
    o_len: usize,
) -> impl Iterator<Item = (usize, usize)> + Clone {
    (0..f_len)
        .map_while(move |f| {
            // `i + pad - f * dilation` only decreases with f: stop at the first negative.
            let u = (i + pad) as isize - (f * dilation) as isize;
            (u >= 0).then_some((f, u as usize))
        })
        .filter(move |&(_, u)| u % stride == 0 && u / stride < o_len)
        .map(move |(f, u)| (f, u / stride))
}

/// Expected lengths (in elements) of the three buffers of [`run`] for `op`, in argument order
/// `(a, b, out)`, with their names as used in error messages.
pub fn buffer_lens(
    problem: &ConvProblem,
    op: ConvOp,
) -> Result<[(&'static str, usize); 3], CpuError> {
    Ok(Geom::new(problem)?.buffer_lens(op))
}

/// The sizes of one call of a spatial split: `problem` with the split axis's input
/// extent `chunk.input.len`, padding `chunk.pad_before` before it and `chunk.pad_after` after
/// it, and `chunk.output.len` output rows. [`CpuError::BadChunk`] when the chunk does not fit
/// `problem` (not a chunk of [`crate::solver::spatial::chunks`] for it) or has no call.
fn chunk_geom(problem: &ConvProblem, chunk: &Chunk) -> Result<Geom, CpuError> {
    let axis = split_axis(problem);
    let geometry = AxisGeometry::of(problem, axis);
    let (rows, before, after) = (chunk.input.len, chunk.pad_before, chunk.pad_after);
    let consistent = chunk.has_call()
        && before >= 0
        && after >= 0
        && chunk.input.first >= 0
        && chunk.input.end() <= geometry.input
        && (rows + before + after - geometry.span()).div_euclid(geometry.stride) + 1
            == chunk.output.len;
    if !consistent {
        return Err(CpuError::BadChunk(format!("{chunk:?}")));
    }
    // A problem with symmetric padding max(before, after) validates the other sizes and has
    // at least the chunk's output rows; then the axis gets the chunk's own padding before it
    // and output extent (the kernels find a window's end from the output extent, so the
    // padding after needs no field of its own).
    let pad = before.max(after);
    let mut sub = *problem;
    match axis {
        Axis::D => (sub.d, sub.pad_d) = (rows, pad),
        Axis::H => (sub.h, sub.pad_h) = (rows, pad),
        Axis::W => (sub.w, sub.pad_w) = (rows, pad),
    }
    let mut g = Geom::new(&sub)?;
    let (before, out) = (before as usize, chunk.output.len as usize);
    match axis {
        Axis::D => (g.pd, g.o) = (before, out),
        Axis::H => (g.ph, g.p) = (before, out),
        Axis::W => (g.pw, g.q) = (before, out),
    }
    Ok(g)
}

/// Expected lengths of the three buffers of [`run_chunk`]: as [`buffer_lens`] for the chunk's
/// slabs (`chunk.input.len` rows of `x`/`dx`, `chunk.output.len` rows of `y`/`dy` along the
/// split axis, packed in the problem's layout).
pub fn chunk_buffer_lens(
    problem: &ConvProblem,
    op: ConvOp,
    chunk: &Chunk,
) -> Result<[(&'static str, usize); 3], CpuError> {
    Ok(chunk_geom(problem, chunk)?.buffer_lens(op))
}

/// The workspace [`run_chunk`] needs for `algo` on one chunk (0 for a chunk without a call).
pub fn chunk_workspace_bytes(
    problem: &ConvProblem,
    op: ConvOp,
    algo: CpuAlgo,
    chunk: &Chunk,
) -> u64 {
    match chunk_geom(problem, chunk) {
        Ok(g) => workspace_floats(&g, problem.dtype, op, algo).saturating_mul(4),
        Err(_) => 0,
    }
}

/// Runs one chunk of a spatial split of `problem` along
/// [`split_axis`]`(problem)`: the convolution of the chunk's slabs, with the chunk's
/// asymmetric padding along the axis (the other axes as in `problem`). The buffers are packed
/// slabs ([`chunk_buffer_lens`]): the `chunk.input` rows of `x`/`dx` and the `chunk.output`
/// rows of `y`/`dy`; the filter is whole. Otherwise as [`run`]. Each output element is the sum
/// of the same products in the same order as in the unsplit op, so forward and backward-data
/// chunks reproduce it bit for bit.
#[allow(clippy::too_many_arguments)]
pub fn run_chunk<T: Element>(
    problem: &ConvProblem,
    op: ConvOp,
    algo: CpuAlgo,
    chunk: &Chunk,
    alpha: f32,
    a: &[T],
    b: &[T],
    beta: f32,
    out: &mut [T],
    workspace: &mut [u8],
) -> Result<(), CpuError> {
    let g = chunk_geom(problem, chunk)?;
    let operands = Operands {
        alpha,
        a,
        b,
        beta,
        out,
    };
    run_geom(&g, problem.dtype, op, algo, operands, workspace)
}

/// Exact workspace, in bytes, that [`run`] needs for `algo` on `problem` (whose `n` is the
/// micro-batch size). Zero for [`CpuAlgo::Direct`]; linear in `n` for
/// [`CpuAlgo::Im2colGemm`]; independent of `n` for [`CpuAlgo::Im2colGemmPerImage`].
/// The buffer must be 4-byte aligned (see [`AlignedWorkspace`]).
///
/// Returns 0 for a problem that [`run`] would reject anyway, and saturates at `u64::MAX`.
pub fn workspace_bytes(problem: &ConvProblem, op: ConvOp, algo: CpuAlgo) -> u64 {
    match Geom::new(problem) {
        Ok(g) => workspace_floats(&g, problem.dtype, op, algo).saturating_mul(4),
        Err(_) => 0,
    }
}

/// Workspace in `f32` elements: the sum of the parts the GEMM path carves out of it.
fn workspace_floats(g: &Geom, dtype: DType, op: ConvOp, algo: CpuAlgo) -> u64 {
    match algo {
        CpuAlgo::Direct => 0,
        CpuAlgo::Im2colGemm | CpuAlgo::Im2colGemmPerImage => {
            gemm::Parts::new(g, dtype, op, algo == CpuAlgo::Im2colGemmPerImage).total()
        }
    }
}

/// Runs one convolution operation on the CPU:
///
/// | `op`             | `a` | `b`  | `out` | computes |
/// |------------------|-----|------|-------|----------|
/// | `Forward`        | `x` | `w`  | `y`   | `y = alpha * conv(x, w) + beta * y` |
/// | `BackwardData`   | `w` | `dy` | `dx`  | `dx = alpha * conv_transpose(dy, w) + beta * dx` |
/// | `BackwardFilter` | `x` | `dy` | `dw`  | `dw = alpha * sum_n correlate(x, dy) + beta * dw` |
///
/// All buffers hold exactly `problem.n` images (see [`buffer_lens`]) in `problem.layout`.
/// To run a micro-batch, pass `problem.with_batch(m)` and the corresponding sub-slices of the
/// batched tensors; for backward filter pass the caller's `beta` for the first micro-batch and
/// `1.0` for the following ones so that the filter gradients add up.
///
/// When `beta == 0` the previous content of `out` is not read (it may be NaN), as in cuDNN.
///
/// `workspace` is raw scratch memory of at least [`workspace_bytes`] bytes, 4-byte aligned
/// (when it is not, the kernels skip to the first aligned byte, which needs up to 3 extra
/// bytes; [`AlignedWorkspace`] always gives an aligned buffer). Its content on entry is
/// irrelevant and on exit unspecified. `problem.math` is ignored (the CPU always computes in
/// fp32). `T` must match `problem.dtype`.
///
/// Note: the GEMM algorithms additionally use `matrixmultiply`'s internal packing buffers
/// (a few hundred KiB at most, independent of the problem size), which are not counted as
/// workspace, just as cuDNN does not count its own small internal allocations.
#[allow(clippy::too_many_arguments)]
pub fn run<T: Element>(
    problem: &ConvProblem,
    op: ConvOp,
    algo: CpuAlgo,
    alpha: f32,
    a: &[T],
    b: &[T],
    beta: f32,
    out: &mut [T],
    workspace: &mut [u8],
) -> Result<(), CpuError> {
    let g = Geom::new(problem)?;
    let operands = Operands {
        alpha,
        a,
        b,
        beta,
        out,
    };
    run_geom(&g, problem.dtype, op, algo, operands, workspace)
}

/// A call's tensors and scaling, by role: `out = alpha * op(a, b) + beta * out`, with `a`,
/// `b` and `out` as in [`run`]'s table.
pub(crate) struct Operands<'a, T> {
    pub alpha: f32,
    pub a: &'a [T],
    pub b: &'a [T],
    pub beta: f32,
    pub out: &'a mut [T],
}

/// [`run`] on validated sizes (the whole problem's, or a spatial chunk's from
/// [`chunk_geom`]).
fn run_geom<T: Element>(
    g: &Geom,
    dtype: DType,
    op: ConvOp,
    algo: CpuAlgo,
    operands: Operands<'_, T>,
    workspace: &mut [u8],
) -> Result<(), CpuError> {
    let Operands {
        alpha,
        a,
        b,
        beta,
        out,
    } = operands;
    if T::DTYPE != dtype {
        return Err(CpuError::DTypeMismatch {
            problem: dtype,
            buffer: T::DTYPE,
        });
    }
    let lens = g.buffer_lens(op);
    for ((buffer, expected), actual) in lens.into_iter().zip([a.len(), b.len(), out.len()]) {
        if expected != actual {
            return Err(CpuError::BufferLength {
                buffer,
                expected,
                actual,
            });
        }
        if expected > i32::MAX as usize {
            return Err(CpuError::CallTooLarge {
                buffer,
                elements: expected,
            });
        }
    }
    let floats = workspace_floats(g, dtype, op, algo);
    let needed = floats.saturating_mul(4);
    let provided = workspace.len() as u64;
    if provided < needed {
        return Err(CpuError::WorkspaceTooSmall { needed, provided });
    }
    let ws = aligned_f32(workspace);
    let floats = usize::try_from(floats).unwrap_or(usize::MAX);
    if ws.len() < floats {
        return Err(CpuError::WorkspaceMisaligned { needed, provided });
    }
    let ws = &mut ws[..floats];

    match (algo, op) {
        (CpuAlgo::Direct, ConvOp::Forward) => direct::forward(g, alpha, a, b, beta, out),
        (CpuAlgo::Direct, ConvOp::BackwardData) => direct::backward_data(g, alpha, a, b, beta, out),
        (CpuAlgo::Direct, ConvOp::BackwardFilter) => {
            direct::backward_filter(g, alpha, a, b, beta, out)
        }
        (CpuAlgo::Im2colGemm | CpuAlgo::Im2colGemmPerImage, _) => {
            let per_image = algo == CpuAlgo::Im2colGemmPerImage;
            let parts = gemm::Parts::new(g, dtype, op, per_image);
            let operands = Operands {
                alpha,
                a,
                b,
                beta,
                out,
            };
            gemm::run(g, &parts, op, per_image, operands, ws)
        }
    }
    Ok(())
}

/// The 4-byte-aligned middle of a byte buffer, as `f32`s.
fn aligned_f32(bytes: &mut [u8]) -> &mut [f32] {
    // SAFETY: every bit pattern is a valid f32 and every f32 is valid as bytes, so viewing the
    // aligned middle of a byte slice as f32s cannot create an invalid value; `align_to_mut`
    // handles alignment and length, and the returned slice borrows `bytes` exclusively.
    let (_, middle, _) = unsafe { bytes.align_to_mut::<f32>() };
    middle
}

/// An owned, 4-byte-aligned workspace buffer for [`run`].
#[derive(Clone, Debug, Default)]
pub struct AlignedWorkspace {
    storage: Vec<f32>,
    bytes: usize,
}

impl AlignedWorkspace {
    /// A zeroed workspace of `bytes` bytes (e.g. the result of [`workspace_bytes`]).
    ///
    /// # Panics
    /// If `bytes` does not fit in memory (like `Vec::with_capacity`).
    pub fn new(bytes: u64) -> Self {
        let bytes = usize::try_from(bytes).expect("workspace larger than the address space");
        AlignedWorkspace {
            storage: vec![0.0; bytes.div_ceil(4)],
            bytes,
        }
    }

    /// A zeroed workspace of `bytes` bytes, or `None` when it cannot be allocated (the
    /// allocation failure is a value, not an abort).
    pub fn try_new(bytes: u64) -> Option<Self> {
        let bytes = usize::try_from(bytes).ok()?;
        let mut storage = Vec::new();
        storage.try_reserve_exact(bytes.div_ceil(4)).ok()?;
        storage.resize(bytes.div_ceil(4), 0.0);
        Some(AlignedWorkspace { storage, bytes })
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// Whether the workspace is empty.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// The buffer as raw bytes, as [`run`] takes it.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        let ptr = self.storage.as_mut_ptr().cast::<u8>();
        // SAFETY: `storage` owns `4 * storage.len() >= bytes` initialised bytes starting at
        // `ptr` (an f32 has no padding and any byte pattern is a valid f32, so writes through
        // the byte view cannot make `storage` invalid); u8 has alignment 1; the slice borrows
        // `self` mutably, so nothing else can access `storage` while it lives.
        unsafe { std::slice::from_raw_parts_mut(ptr, self.bytes) }
    }
}

/// Chunk length for stack accumulators: large enough to amortise loop overhead, small enough
/// to stay in L1. Tiny under test so that the chunking logic is exercised by small shapes.
pub(crate) const CHUNK: usize = if cfg!(test) { 5 } else { 256 };

/// Output positions `o` in `0..o_len` whose input position `o * stride + off` lies in
/// `lo..hi`: the taps of a convolution that fall inside the image (or inside a chunk of it).
#[inline]
pub(crate) fn valid_range(
    o_len: usize,
    lo: isize,
    hi: isize,
    stride: usize,
    off: isize,
) -> std::ops::Range<usize> {
    let st = stride as isize;
    // ceil((lo - off) / st) and floor((hi - 1 - off) / st) + 1, for any sign.
    let first = (lo - off + st - 1).div_euclid(st).max(0);
    let last = ((hi - 1 - off).div_euclid(st) + 1).min(o_len as isize);
    if last <= first {
        0..0
    } else {
        first as usize..last as usize
    }
}

/// `out[i] = alpha * acc[i] + beta * out[i]`, not reading `out` when `beta == 0`.
#[inline]
pub(crate) fn store<T: Element>(out: &mut [T], acc: &[f32], alpha: f32, beta: f32) {
    debug_assert_eq!(out.len(), acc.len());
    if beta == 0.0 {
        for (o, &v) in out.iter_mut().zip(acc) {
            *o = T::from_f32(alpha * v);
        }
    } else {
        for (o, &v) in out.iter_mut().zip(acc) {
            *o = T::from_f32(alpha * v + beta * o.to_f32());
        }
    }
}

/// Single-element [`store`].
#[inline]
pub(crate) fn store1<T: Element>(out: &mut T, acc: f32, alpha: f32, beta: f32) {
    *out = if beta == 0.0 {
        T::from_f32(alpha * acc)
    } else {
        T::from_f32(alpha * acc + beta * out.to_f32())
    };
}

/// `acc[i] += a * src[i * stride]`.
#[inline]
pub(crate) fn axpy_gather<T: Element>(acc: &mut [f32], a: f32, src: &[T], stride: usize) {
    if stride == 1 {
        for (o, s) in acc.iter_mut().zip(src) {
            *o += a * s.to_f32();
        }
    } else {
        for (o, s) in acc.iter_mut().zip(src.iter().step_by(stride)) {
            *o += a * s.to_f32();
        }
    }
}

/// `acc[i * stride] += a * src[i]`.
#[inline]
pub(crate) fn axpy_scatter<T: Element>(acc: &mut [f32], stride: usize, a: f32, src: &[T]) {
    if stride == 1 {
        for (o, s) in acc.iter_mut().zip(src) {
            *o += a * s.to_f32();
        }
    } else {
        for (o, s) in acc.iter_mut().step_by(stride).zip(src) {
            *o += a * s.to_f32();
        }
    }
}

/// Dot product of `a[i]` and `b[i * stride]` over `a`, in `f32` with a fixed summation order
/// (eight interleaved partial sums, so that the unit-stride case vectorises).
#[inline]
pub(crate) fn dot_strided<T: Element>(a: &[T], b: &[T], stride: usize) -> f32 {
    if stride == 1 {
        let b = &b[..a.len()];
        let mut lanes = [0f32; 8];
        let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
        let (ar, br) = (ac.remainder(), bc.remainder());
        for (x, y) in ac.zip(bc) {
            for i in 0..8 {
                lanes[i] += x[i].to_f32() * y[i].to_f32();
            }
        }
        let mut tail = 0f32;
        for (x, y) in ar.iter().zip(br) {
            tail += x.to_f32() * y.to_f32();
        }
        ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5]))
            + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]))
            + tail
    } else {
        let mut sum = 0f32;
        for (x, y) in a.iter().zip(b.iter().step_by(stride)) {
            sum += x.to_f32() * y.to_f32();
        }
        sum
    }
}
