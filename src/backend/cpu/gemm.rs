//! Algorithms 1 and 2: im2col/col2im + GEMM through `matrixmultiply::sgemm`.
//!
//! Both process the batch in chunks of `nb` images: the whole micro-batch
//! (`Im2colGemm`, one large GEMM per group) or one image (`Im2colGemmPerImage`, `n` small
//! GEMMs per group). Everything that does not fit the GEMM's strided-matrix model is staged
//! in the workspace as `f32`, carved out as described by [`Parts`]:
//!
//! - `col`: the im2col matrix of a chunk for one group (`crs x nb*pq` for NCHW,
//!   `nb*pq x crs` for NHWC; `crs = c/g * t * r * s` and `pq = o * p * q`, the output
//!   positions of an image, depth included), or for backward data the GEMM result that
//!   col2im gathers from;
//! - `dy`: `dy` of a chunk and group repacked (and widened to f32) when it cannot be read in
//!   place: for fp16/bf16, and for NCHW with more than one image per chunk (the batch stride
//!   breaks the matrix view);
//! - `filt`: one group's filters widened to f32 (fp16/bf16 forward and backward data only);
//! - `out`: the GEMM result before `alpha`/`beta` are applied (forward: `nb*pq x k/g`;
//!   backward filter: the `k/g x crs` accumulator over the chunks).
//!
//! The GEMM itself is always called with `alpha = 1` and `beta` 0 or 1, and the caller's
//! `alpha`/`beta` are applied when storing. That keeps results independent of where an element
//! falls in matrixmultiply's tiling (its edge tiles and interior tiles round `alpha * ab + beta
//! * c` differently), which is what makes micro-batched results bit-identical.

use super::{axpy_gather, store, valid_range, Element, Geom, Operands, RowMap, CHUNK};
use crate::solver::{ConvOp, DType, Layout};

/// Sizes, in f32 elements, of the workspace parts (see the module docs). The single source of
/// truth for both [`super::workspace_bytes`] and the kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Parts {
    col: u64,
    dy: u64,
    filt: u64,
    out: u64,
}

impl Parts {
    pub fn new(g: &Geom, dtype: DType, op: ConvOp, per_image: bool) -> Parts {
        let u = |v: usize| v as u64;
        let mul = |a: u64, b: u64| a.saturating_mul(b);
        let nb = if per_image { 1 } else { u(g.n) };
        let rows = mul(nb, u(g.out_plane()));
        let crs = mul(u(g.cg), u(g.taps()));
        let kg = u(g.kg);
        let widen = dtype != DType::Fp32;
        let pack_dy = widen || (g.layout == Layout::Nchw && !per_image);
        let col = mul(rows, crs);
        let filt = if widen { mul(kg, crs) } else { 0 };
        let dy = if pack_dy { mul(rows, kg) } else { 0 };
        match op {
            ConvOp::Forward => Parts {
                col,
                dy: 0,
                filt,
                out: mul(rows, kg),
            },
            ConvOp::BackwardData => Parts {
                col,
                dy,
                filt,
                out: 0,
            },
            // No filter operand: the filter gradient is the output, accumulated in `out`.
            ConvOp::BackwardFilter => Parts {
                col,
                dy,
                filt: 0,
                out: mul(kg, crs),
            },
        }
    }

    pub fn total(&self) -> u64 {
        self.col
            .saturating_add(self.dy)
            .saturating_add(self.filt)
            .saturating_add(self.out)
    }
}

/// A read-only strided f32 matrix for [`gemm`]: element `(i, j)` is `data[i * rs + j * cs]`.
#[derive(Clone, Copy)]
struct Mat<'a> {
    data: &'a [f32],
    rs: usize,
    cs: usize,
}

impl<'a> Mat<'a> {
    fn new(data: &'a [f32], rs: usize, cs: usize) -> Self {
        Mat { data, rs, cs }
    }

    /// The transposed view.
    fn t(self) -> Self {
        Mat {
            data: self.data,
            rs: self.cs,
            cs: self.rs,
        }
    }

    /// Whether a `rows x cols` matrix with these strides lies inside `data`.
    fn fits(&self, rows: usize, cols: usize) -> bool {
        (rows - 1) * self.rs + (cols - 1) * self.cs < self.data.len()
    }
}

/// The result matrix of [`gemm`]: row-major f32, element `(i, j)` at `data[i * rs + j]`.
struct MatMut<'a> {
    data: &'a mut [f32],
    rs: usize,
}

impl<'a> MatMut<'a> {
    fn new(data: &'a mut [f32], rs: usize) -> Self {
        MatMut { data, rs }
    }
}

/// `c = a * b` (`accumulate == false`) or `c += a * b`, with `(m, kd, n)` the sizes:
/// `a: m x kd`, `b: kd x n`, `c: m x n`.
///
/// # Panics
/// If a matrix does not lie inside its slice: a bug in this module, never a consequence of
/// user input (buffer sizes are checked by [`super::run`]).
fn gemm((m, kd, n): (usize, usize, usize), a: Mat, b: Mat, c: MatMut, accumulate: bool) {
    let MatMut { data: c, rs: rsc } = c;
    assert!(m > 0 && kd > 0 && n > 0, "empty GEMM");
    assert!(a.fits(m, kd) && b.fits(kd, n), "GEMM operand out of bounds");
    assert!(
        (m - 1) * rsc + n <= c.len() && (m == 1 || rsc >= n),
        "GEMM output out of bounds"
    );
    let beta = if accumulate { 1.0 } else { 0.0 };
    // SAFETY: the asserts above guarantee that every element sgemm reads through
    // (a.ptr, a.rs, a.cs) for m x kd, (b.ptr, b.rs, b.cs) for kd x n, and writes through
    // (c.ptr, rsc, 1) for m x n lies inside the corresponding slice; distinct (i, j) of C map
    // to distinct addresses since rsc >= n (or m == 1) with column stride 1; `c` is a unique
    // borrow, so it aliases neither `a` nor `b`; all strides are below the slice lengths and
    // hence fit in isize. With beta == 0, sgemm does not read C, so its content is irrelevant.
    unsafe {
        matrixmultiply::sgemm(
            m,
            kd,
            n,
            1.0,
            a.data.as_ptr(),
            a.rs as isize,
            a.cs as isize,
            b.data.as_ptr(),
            b.rs as isize,
            b.cs as isize,
            beta,
            c.as_mut_ptr(),
            rsc as isize,
            1,
        );
    }
}

/// Entry point for both GEMM algorithms; `parts` must come from [`Parts::new`] with the same
/// arguments and `ws` must hold at least `parts.total()` elements.
pub(super) fn run<T: Element>(
    g: &Geom,
    parts: &Parts,
    op: ConvOp,
    per_image: bool,
    operands: Operands<'_, T>,
    ws: &mut [f32],
) {
    // Each part is at most `ws.len()` elements here, so it fits usize.
    let (col, rest) = ws.split_at_mut(parts.col as usize);
    let (dyp, rest) = rest.split_at_mut(parts.dy as usize);
    let (filt, rest) = rest.split_at_mut(parts.filt as usize);
    let scratch = &mut rest[..parts.out as usize];
    let s = Scratch {
        col,
        dyp,
        filt,
        out: scratch,
    };
    let nb = if per_image { 1 } else { g.n };
    match op {
        ConvOp::Forward => forward(g, nb, operands, s),
        ConvOp::BackwardData => backward_data(g, nb, operands, s),
        ConvOp::BackwardFilter => backward_filter(g, nb, operands, s),
    }
}

/// Where a chunk lies: images `i0..i0 + nb` of the batch, channels and filters of group `grp`.
#[derive(Clone, Copy)]
struct Block {
    i0: usize,
    nb: usize,
    grp: usize,
}

struct Scratch<'a> {
    col: &'a mut [f32],
    dyp: &'a mut [f32],
    filt: &'a mut [f32],
    out: &'a mut [f32],
}

/// The filters of group `grp` as an f32 `k/g x crs` row-major block: in place for fp32,
/// widened into `filt` otherwise.
fn filter_group<'a, T: Element>(
    g: &Geom,
    w: &'a [T],
    grp: usize,
    filt: &'a mut [f32],
) -> &'a [f32] {
    let len = g.kg * g.cg * g.taps();
    let src = &w[grp * len..][..len];
    match T::as_f32_slice(src) {
        Some(f) => f,
        None => {
            T::load_slice(src, filt);
            filt
        }
    }
}

/// `dy` of the block's images and group as a matrix: `k/g x nb*pq` for NCHW,
/// `nb*pq x k/g` for NHWC. Read in place when [`Parts`] reserved no `dy` space (fp32 and a
/// layout/chunk that is a strided matrix), otherwise widened/repacked into `dyp`.
fn dy_operand<'a, T: Element>(g: &Geom, dy: &'a [T], at: Block, dyp: &'a mut [f32]) -> Mat<'a> {
    let Block { i0, nb, grp } = at;
    let pq = g.out_plane();
    let m = nb * pq;
    let in_place = if dyp.is_empty() {
        T::as_f32_slice(dy)
    } else {
        None
    };
    match (g.layout, in_place) {
        (Layout::Nchw, Some(d)) => {
            debug_assert_eq!(nb, 1);
            Mat::new(&d[(i0 * g.k + grp * g.kg) * pq..], pq, 1)
        }
        (Layout::Nhwc, Some(d)) => Mat::new(&d[i0 * pq * g.k + grp * g.kg..], g.k, 1),
        (Layout::Nchw, None) => {
            for kl in 0..g.kg {
                for il in 0..nb {
                    let src = &dy[((i0 + il) * g.k + grp * g.kg + kl) * pq..][..pq];
                    T::load_slice(src, &mut dyp[kl * m + il * pq..][..pq]);
                }
            }
            Mat::new(dyp, m, 1)
        }
        (Layout::Nhwc, None) => {
            for j in 0..m {
                let src = &dy[(i0 * pq + j) * g.k + grp * g.kg..][..g.kg];
                T::load_slice(src, &mut dyp[j * g.kg..][..g.kg]);
            }
            Mat::new(dyp, g.kg, 1)
        }
    }
}

fn forward<T: Element>(g: &Geom, nb: usize, operands: Operands<'_, T>, s: Scratch) {
    let Operands {
        alpha,
        a: x,
        b: w,
        beta,
        out: y,
    } = operands;
    let (pq, crs, kg) = (g.out_plane(), g.cg * g.taps(), g.kg);
    let m = nb * pq;
    let Scratch { col, filt, out, .. } = s;
    for grp in 0..g.groups {
        let wg = filter_group(g, w, grp, &mut *filt);
        for i0 in (0..g.n).step_by(nb) {
            let at = Block { i0, nb, grp };
            match g.layout {
                Layout::Nchw => {
                    im2col_nchw(g, x, at, col);
                    // out[kg x m] = W_g[kg x crs] * col[crs x m]
                    gemm(
                        (kg, crs, m),
                        Mat::new(wg, crs, 1),
                        Mat::new(col, m, 1),
                        MatMut::new(out, m),
                        false,
                    );
                    for kl in 0..kg {
                        for il in 0..nb {
                            let dst = &mut y[((i0 + il) * g.k + grp * kg + kl) * pq..][..pq];
                            store(dst, &out[kl * m + il * pq..][..pq], alpha, beta);
                        }
                    }
                }
                Layout::Nhwc => {
                    im2col_nhwc(g, x, at, col);
                    // out[m x kg] = col[m x crs] * W_g^T[crs x kg]
                    gemm(
                        (m, crs, kg),
                        Mat::new(col, crs, 1),
                        Mat::new(wg, 1, crs),
                        MatMut::new(out, kg),
                        false,
                    );
                    for j in 0..m {
                        let dst = &mut y[(i0 * pq + j) * g.k + grp * kg..][..kg];
                        store(dst, &out[j * kg..][..kg], alpha, beta);
                    }
                }
            }
        }
    }
}

fn backward_data<T: Element>(g: &Geom, nb: usize, operands: Operands<'_, T>, s: Scratch) {
    let Operands {
        alpha,
        a: w,
        b: dy,
        beta,
        out: dx,
    } = operands;
    let (crs, kg) = (g.cg * g.taps(), g.kg);
    let m = nb * g.out_plane();
    let Scratch { col, dyp, filt, .. } = s;
    for grp in 0..g.groups {
        let wg = filter_group(g, w, grp, &mut *filt);
        for i0 in (0..g.n).step_by(nb) {
            let at = Block { i0, nb, grp };
            let dyg = dy_operand(g, dy, at, &mut *dyp);
            match g.layout {
                Layout::Nchw => {
                    // col[crs x m] = W_g^T[crs x kg] * dy_g[kg x m]
                    let wt = Mat::new(wg, 1, crs);
                    gemm((crs, kg, m), wt, dyg, MatMut::new(col, m), false);
                    col2im_nchw(g, col, at, (alpha, beta), dx);
                }
                Layout::Nhwc => {
                    // col[m x crs] = dy_g[m x kg] * W_g[kg x crs]
                    let w = Mat::new(wg, crs, 1);
                    gemm((m, kg, crs), dyg, w, MatMut::new(col, crs), false);
                    col2im_nhwc(g, col, at, (alpha, beta), dx);
                }
            }
        }
    }
}

fn backward_filter<T: Element>(g: &Geom, nb: usize, operands: Operands<'_, T>, s: Scratch) {
    let Operands {
        alpha,
        a: x,
        b: dy,
        beta,
        out: dw,
    } = operands;
    let (crs, kg) = (g.cg * g.taps(), g.kg);
    let m = nb * g.out_plane();
    let Scratch {
        col, dyp, out: acc, ..
    } = s;
    for grp in 0..g.groups {
        for (chunk, i0) in (0..g.n).step_by(nb).enumerate() {
            let at = Block { i0, nb, grp };
            let dyg = dy_operand(g, dy, at, &mut *dyp);
            let accumulate = chunk > 0;
            let acc = MatMut::new(&mut *acc, crs);
            match g.layout {
                Layout::Nchw => {
                    im2col_nchw(g, x, at, col);
                    // acc[kg x crs] (+)= dy_g[kg x m] * col^T[m x crs]
                    gemm((kg, m, crs), dyg, Mat::new(col, 1, m), acc, accumulate);
                }
                Layout::Nhwc => {
                    im2col_nhwc(g, x, at, col);
                    // acc[kg x crs] (+)= dy_g^T[kg x m] * col[m x crs]
                    gemm(
                        (kg, m, crs),
                        dyg.t(),
                        Mat::new(col, crs, 1),
                        acc,
                        accumulate,
                    );
                }
            }
        }
        // NCHW filters are k x (c/g, t, r, s) and NHWC filters k x (t, r, s, c/g): in both, the
        // group's block is contiguous and its columns are ordered like the im2col rows.
        store(&mut dw[grp * kg * crs..][..kg * crs], acc, alpha, beta);
    }
}

/// NCHW im2col of the block's images and group: `col[(c, t, r, s)][(image, o, p, q)]`.
fn im2col_nchw<T: Element>(g: &Geom, x: &[T], at: Block, col: &mut [f32]) {
    let Block { i0, nb, grp } = at;
    let (plane, pq) = (g.in_plane(), g.out_plane());
    let ld = nb * pq;
    for c in 0..g.cg {
        for frow in 0..g.filter_rows() {
            let (t, r) = (frow / g.r, frow % g.r);
            for s in 0..g.s {
                let row = &mut col[((c * g.filter_rows() + frow) * g.s + s) * ld..][..ld];
                let off = (s * g.dw) as isize - g.pw as isize;
                let qs = valid_range(g.q, 0, g.w as isize, g.sw, off);
                for il in 0..nb {
                    let xp = &x[((i0 + il) * g.c + grp * g.cg + c) * plane..][..plane];
                    for o in 0..g.o {
                        let id = (o * g.sd + t * g.dd) as isize - g.pd as isize;
                        let depth_in = (0..g.d as isize).contains(&id);
                        for p in 0..g.p {
                            let dst = &mut row[il * pq + (o * g.p + p) * g.q..][..g.q];
                            let ih = (p * g.sh + r * g.dh) as isize - g.ph as isize;
                            if !depth_in || ih < 0 || ih >= g.h as isize || qs.is_empty() {
                                dst.fill(0.0);
                                continue;
                            }
                            let irow = id as usize * g.h + ih as usize;
                            let xrow = &xp[irow * g.w..][..g.w];
                            dst[..qs.start].fill(0.0);
                            dst[qs.end..].fill(0.0);
                            let start = ((qs.start * g.sw) as isize + off) as usize;
                            let dst = &mut dst[qs.clone()];
                            if g.sw == 1 {
                                T::load_slice(&xrow[start..start + dst.len()], dst);
                            } else {
                                for (d, v) in dst.iter_mut().zip(xrow[start..].iter().step_by(g.sw))
                                {
                                    *d = v.to_f32();
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// NHWC im2col of the block's images and group: `col[(image, o, p, q)][(t, r, s, c)]`.
fn im2col_nhwc<T: Element>(g: &Geom, x: &[T], at: Block, col: &mut [f32]) {
    let Block { i0, nb, grp } = at;
    let (cg, crs) = (g.cg, g.cg * g.taps());
    let in_rows = g.in_rows();
    for il in 0..nb {
        for o in 0..g.o {
            for p in 0..g.p {
                for q in 0..g.q {
                    let row = &mut col[(((il * g.o + o) * g.p + p) * g.q + q) * crs..][..crs];
                    for (t, row) in row.chunks_exact_mut(g.r * g.s * cg).enumerate() {
                        let id = (o * g.sd + t * g.dd) as isize - g.pd as isize;
                        if id < 0 || id >= g.d as isize {
                            row.fill(0.0);
                            continue;
                        }
                        for (r, seg) in row.chunks_exact_mut(g.s * cg).enumerate() {
                            let ih = (p * g.sh + r * g.dh) as isize - g.ph as isize;
                            if ih < 0 || ih >= g.h as isize {
                                seg.fill(0.0);
                                continue;
                            }
                            let irow = id as usize * g.h + ih as usize;
                            for (s, dst) in seg.chunks_exact_mut(cg).enumerate() {
                                let iw = (q * g.sw + s * g.dw) as isize - g.pw as isize;
                                if iw < 0 || iw >= g.w as isize {
                                    dst.fill(0.0);
                                    continue;
                                }
                                let pix = ((i0 + il) * in_rows + irow) * g.w + iw as usize;
                                let src = &x[pix * g.c + grp * cg..][..cg];
                                if cg == 1 {
                                    // (Depthwise: no call to a slice copy per element.)
                                    dst[0] = src[0].to_f32();
                                } else {
                                    T::load_slice(src, dst);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// NCHW col2im of the block's images and group as a gather (`dx[c][h][w]` sums every
/// `col[(c, r, s)][(p, q)]` that maps to it), so each `dx` element is accumulated in f32 and
/// stored once with `alpha`/`beta`.
fn col2im_nchw<T: Element>(
    g: &Geom,
    col: &[f32],
    at: Block,
    (alpha, beta): (f32, f32),
    dx: &mut [T],
) {
    let Block { i0, nb, grp } = at;
    let (pq, in_rows, filter_rows) = (g.out_plane(), g.in_rows(), g.filter_rows());
    let ld = nb * pq;
    let mut row_map = RowMap::reading(g);
    let mut acc = [0f32; CHUNK];
    for il in 0..nb {
        for c in 0..g.cg {
            for irow in 0..in_rows {
                let rows = row_map.get(irow);
                let plane = ((i0 + il) * g.c + grp * g.cg + c) * in_rows;
                let dxrow = &mut dx[(plane + irow) * g.w..][..g.w];
                for w0 in (0..g.w).step_by(CHUNK) {
                    let wn = CHUNK.min(g.w - w0);
                    let acc = &mut acc[..wn];
                    acc.fill(0.0);
                    for &(frow, orow) in rows {
                        for s in 0..g.s {
                            let off = (s * g.dw) as isize - g.pw as isize;
                            let qs = valid_range(g.q, w0 as isize, (w0 + wn) as isize, g.sw, off);
                            if qs.is_empty() {
                                continue;
                            }
                            let src = &col[((c * filter_rows + frow) * g.s + s) * ld
                                + il * pq
                                + orow * g.q..][..g.q];
                            let start = ((qs.start * g.sw) as isize + off) as usize - w0;
                            super::axpy_scatter(&mut acc[start..], g.sw, 1.0, &src[qs]);
                        }
                    }
                    store(&mut dxrow[w0..w0 + wn], acc, alpha, beta);
                }
            }
        }
    }
}

/// NHWC col2im as a gather, like [`col2im_nchw`].
fn col2im_nhwc<T: Element>(
    g: &Geom,
    col: &[f32],
    at: Block,
    (alpha, beta): (f32, f32),
    dx: &mut [T],
) {
    let Block { i0, nb, grp } = at;
    let crs = g.cg * g.taps();
    let (in_rows, out_rows) = (g.in_rows(), g.out_rows());
    let mut row_map = RowMap::reading(g);
    let mut acc = [0f32; CHUNK];
    for il in 0..nb {
        for irow in 0..in_rows {
            let rows = row_map.get(irow);
            for x in 0..g.w {
                let base = (((i0 + il) * in_rows + irow) * g.w + x) * g.c + grp * g.cg;
                for c0 in (0..g.cg).step_by(CHUNK) {
                    let cn = CHUNK.min(g.cg - c0);
                    let acc = &mut acc[..cn];
                    acc.fill(0.0);
                    for &(frow, orow) in rows {
                        for s in 0..g.s {
                            let u = (x + g.pw) as isize - (s * g.dw) as isize;
                            if u < 0 || u as usize % g.sw != 0 || u as usize / g.sw >= g.q {
                                continue;
                            }
                            let q = u as usize / g.sw;
                            let src = &col[((il * out_rows + orow) * g.q + q) * crs
                                + (frow * g.s + s) * g.cg
                                + c0..][..cn];
                            axpy_gather(acc, 1.0, src, 1);
                        }
                    }
                    store(&mut dx[base + c0..][..cn], acc, alpha, beta);
                }
            }
        }
    }
}
