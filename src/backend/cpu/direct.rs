//! Algorithm 0, `Direct`: the convolution sums evaluated in place, with no workspace.
//!
//! Every output element is *gathered* (backward data included: each `dx` element sums the
//! `dy` positions it contributed to) into a small fixed-size f32 stack accumulator and stored
//! once, so no scratch memory is needed; the only allocations are per-call index tables of a
//! few dozen entries (valid tap ranges), which keep integer divisions out of the inner loops.
//!
//! Loop orders keep the innermost loop on the contiguous dimension of the layout: output
//! rows (NCHW) or channels (NHWC). Depth and height are walked together as *rows* (see
//! [`Geom`]): a 3-D problem runs the same kernels as a 2-D one, with `(t, r)` filter rows in
//! place of `r` and `(depth, height)` input and output rows in place of heights. Two NHWC special cases: with one channel per group
//! (depthwise) the inner loop runs across filters instead of over a length-1 channel dot
//! product, and backward filter accumulates a block of filters per sweep over `x`.

use super::{
    axpy_gather, axpy_scatter, dot_strided, lin, store, store1, taps_of, valid_range, Element,
    Geom, RowMap, CHUNK,
};
use crate::solver::Layout;

/// `y = alpha * conv(x, w) + beta * y`.
pub(super) fn forward<T: Element>(g: &Geom, alpha: f32, x: &[T], w: &[T], beta: f32, y: &mut [T]) {
    match g.layout {
        Layout::Nchw => fast_forward_nchw(g, alpha, x, w, beta, y),
        Layout::Nhwc => fast_forward_nhwc(g, alpha, x, w, beta, y),
    }
}

/// `dx = alpha * conv_transpose(dy, w) + beta * dx`.
pub(super) fn backward_data<T: Element>(
    g: &Geom,
    alpha: f32,
    w: &[T],
    dy: &[T],
    beta: f32,
    dx: &mut [T],
) {
    match g.layout {
        // The gather kernel needs unit column stride (every input column then reads a
        // contiguous run of dy); strided layers keep the chunked scatter kernel.
        Layout::Nchw if g.sw == 1 => fast_backward_data_nchw_gather(g, alpha, w, dy, beta, dx),
        Layout::Nchw => fast_backward_data_nchw(g, alpha, w, dy, beta, dx),
        Layout::Nhwc => fast_backward_data_nhwc(g, alpha, w, dy, beta, dx),
    }
}

/// `dw = alpha * sum_n correlate(x, dy) + beta * dw`.
pub(super) fn backward_filter<T: Element>(
    g: &Geom,
    alpha: f32,
    x: &[T],
    dy: &[T],
    beta: f32,
    dw: &mut [T],
) {
    match g.layout {
        Layout::Nchw => fast_backward_filter_nchw(g, alpha, x, dy, beta, dw),
        Layout::Nhwc => fast_backward_filter_nhwc(g, alpha, x, dy, beta, dw),
    }
}

/// `$name` runs the kernel `$imp` compiled for AVX2 + FMA when the CPU has them (the crate's
/// baseline target is plain x86-64, i.e. 4-wide SSE2; the GEMM algorithms get the same from
/// matrixmultiply's run-time dispatch), else as compiled. The kernels are
/// `#[inline(always)]` so that they are generated inside the feature-enabled function, one
/// function per kernel so that LLVM optimises each on its own.
macro_rules! simd_dispatch {
    ($name:ident, $avx:ident, $imp:path) => {
        fn $name<T: Element>(g: &Geom, alpha: f32, a: &[T], b: &[T], beta: f32, out: &mut [T]) {
            #[cfg(target_arch = "x86_64")]
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                // SAFETY: the CPU supports the features the function is compiled for.
                return unsafe { $avx(g, alpha, a, b, beta, out) };
            }
            $imp(g, alpha, a, b, beta, out)
        }

        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn $avx<T: Element>(
            g: &Geom,
            alpha: f32,
            a: &[T],
            b: &[T],
            beta: f32,
            out: &mut [T],
        ) {
            $imp(g, alpha, a, b, beta, out)
        }
    };
}

simd_dispatch!(fast_forward_nchw, forward_nchw_avx2, forward_nchw_any);
simd_dispatch!(fast_forward_nhwc, forward_nhwc_avx2, forward_nhwc);
simd_dispatch!(
    fast_backward_data_nchw_gather,
    backward_data_nchw_gather_avx2,
    backward_data_nchw_gather
);
simd_dispatch!(
    fast_backward_data_nchw,
    backward_data_nchw_avx2,
    backward_data_nchw
);
simd_dispatch!(
    fast_backward_data_nhwc,
    backward_data_nhwc_avx2,
    backward_data_nhwc
);
simd_dispatch!(
    fast_backward_filter_nchw,
    backward_filter_nchw_avx2,
    backward_filter_nchw
);
simd_dispatch!(
    fast_backward_filter_nhwc,
    backward_filter_nhwc_avx2,
    backward_filter_nhwc
);

/// Forward NCHW with the register strip as wide as the rows allow.
#[inline(always)]
fn forward_nchw_any<T: Element>(g: &Geom, alpha: f32, x: &[T], w: &[T], beta: f32, y: &mut [T]) {
    match g.q {
        16.. => forward_nchw::<T, 16>(g, alpha, x, w, beta, y),
        8.. => forward_nchw::<T, 8>(g, alpha, x, w, beta, y),
        _ => forward_nchw::<T, 4>(g, alpha, x, w, beta, y),
    }
}

/// Backward data NCHW (unit column stride) with the register strip as wide as the rows allow.
#[inline(always)]
fn backward_data_nchw_gather<T: Element>(
    g: &Geom,
    alpha: f32,
    w: &[T],
    dy: &[T],
    beta: f32,
    dx: &mut [T],
) {
    match g.w {
        16.. => backward_data_nchw_blocked::<T, 16>(g, alpha, w, dy, beta, dx),
        8.. => backward_data_nchw_blocked::<T, 8>(g, alpha, w, dy, beta, dx),
        _ => backward_data_nchw_blocked::<T, 4>(g, alpha, w, dy, beta, dx),
    }
}

/// Register block: output channels (forward), input channels (backward data) or filters
/// (backward filter) computed together, so that every loaded activation is used `KB` times.
const KB: usize = 4;

/// A strip of `QB` consecutive output columns `q0..q0 + QB` held in registers. Strips tile
/// the row; when the row length is not a multiple of `QB` the last strip overlaps the one
/// before it (so it is still full width) and stores only its columns from `from` on.
#[derive(Clone, Copy)]
struct Strip {
    q0: usize,
    from: usize,
    len: usize,
}

fn strips(len: usize, qb: usize) -> Vec<Strip> {
    if len < qb {
        return vec![Strip {
            q0: 0,
            from: 0,
            len,
        }];
    }
    let mut out: Vec<Strip> = (0..len / qb)
        .map(|i| Strip {
            q0: i * qb,
            from: 0,
            len: qb,
        })
        .collect();
    if len % qb != 0 {
        out.push(Strip {
            q0: len - qb,
            from: qb - len % qb,
            len: qb,
        });
    }
    out
}

/// Per strip and column tap `s` (index `strip * s_len + s`): the lanes `lo..hi` whose source
/// column `q * stride + off(s)` lies in `0..src_len`, and the source column of lane `lo`.
fn strip_spans(
    strips: &[Strip],
    s_len: usize,
    src_len: usize,
    stride: usize,
    off: impl Fn(usize) -> isize,
) -> Vec<(usize, usize, usize)> {
    let mut spans = Vec::with_capacity(strips.len() * s_len);
    for st in strips {
        for s in 0..s_len {
            let qs = valid_range(st.q0 + st.len, 0, src_len as isize, stride, off(s));
            let (lo, hi) = (qs.start.max(st.q0), qs.end);
            spans.push(if lo < hi {
                (
                    lo - st.q0,
                    hi - st.q0,
                    ((lo * stride) as isize + off(s)) as usize,
                )
            } else {
                (0, 0, 0)
            });
        }
    }
    spans
}

/// The hot case of [`tile_tap`], unswitched on the stride (`UNIT`) so that nothing goes
/// through memory: full-width loads from `src[m * sstep..]` (lane 0's column), masked to the
/// lanes `lo..hi` (all of them but at the padding; a select, not a multiply, so that values
/// outside cannot leak in, not even as NaN).
#[inline(always)]
fn tile_tap_masked<T: Element, const QB: usize, const UNIT: bool>(
    acc: &mut [[f32; QB]; KB],
    n: usize,
    (w, wstep, jstep): (&[T], usize, usize),
    (src, sstep, stride): (&[T], usize, usize),
    count: usize,
    (lo, hi): (usize, usize),
) {
    let mut mask = [0u32; QB];
    mask[lo..hi].fill(!0);
    for m in 0..count {
        let wm = &w[m * wstep..];
        let mut wv = [0f32; KB];
        for (j, o) in wv.iter_mut().enumerate() {
            if j < n {
                *o = wm[j * jstep].to_f32();
            }
        }
        let mut xv = [0f32; QB];
        if UNIT {
            let xs: &[T; QB] = src[m * sstep..m * sstep + QB].try_into().unwrap();
            for i in 0..QB {
                xv[i] = f32::from_bits(xs[i].to_f32().to_bits() & mask[i]);
            }
        } else {
            let xs = &src[m * sstep..m * sstep + (QB - 1) * stride + 1];
            for i in 0..QB {
                xv[i] = f32::from_bits(xs[i * stride].to_f32().to_bits() & mask[i]);
            }
        }
        for (a, &wj) in acc.iter_mut().zip(&wv) {
            for (o, &xi) in a.iter_mut().zip(&xv) {
                *o += wj * xi;
            }
        }
    }
}

/// The reduction of one register tile over one tap: for `m` in `0..count`,
/// `acc[j][i] += w[wofs + m * wstep + j * jstep] * src[sofs + m * sstep + (i - lo) * stride]`
/// for lanes `i` in `lo..hi` (and `+= w * 0` for the other lanes, so that all strips run the
/// same constant-indexed code and `acc` stays in registers; like im2col + GEMM, this
/// multiplies weights by zeros of the padding). Rows `j >= n` get zero weights.
///
/// The weights and the source each come as (slice, offset, step per `m`, step per row `j` or
/// per lane `i`).
///
/// The loop runs over the longest reduction (channels or filters) with the tap fixed, so
/// each iteration is just `QB` source and `KB` weight loads and `KB * QB` multiply-adds.
#[inline(always)]
fn tile_tap<T: Element, const QB: usize>(
    acc: &mut [[f32; QB]; KB],
    n: usize,
    (w, wofs, wstep, jstep): (&[T], usize, usize, usize),
    (src, sofs, sstep, stride): (&[T], usize, usize, usize),
    count: usize,
    (lo, hi): (usize, usize),
) {
    if count == 0 || lo >= hi {
        return;
    }
    let w = &w[wofs..=wofs + (count - 1) * wstep + (n - 1) * jstep];
    let span = (QB - 1) * stride + 1;
    if sofs >= lo * stride && sofs - lo * stride + (count - 1) * sstep + span <= src.len() {
        let src = &src[sofs - lo * stride..];
        if stride == 1 {
            tile_tap_masked::<T, QB, true>(
                acc,
                n,
                (w, wstep, jstep),
                (src, sstep, 1),
                count,
                (lo, hi),
            );
        } else {
            tile_tap_masked::<T, QB, false>(
                acc,
                n,
                (w, wstep, jstep),
                (src, sstep, stride),
                count,
                (lo, hi),
            );
        }
        return;
    }
    // Bounds checked once here rather than per load.
    let src = &src[sofs..=sofs + (count - 1) * sstep + (hi - lo - 1) * stride];
    for m in 0..count {
        let mut wv = [0f32; KB];
        if n == KB {
            for (j, o) in wv.iter_mut().enumerate() {
                *o = w[m * wstep + j * jstep].to_f32();
            }
        } else {
            for (j, o) in wv[..n].iter_mut().enumerate() {
                *o = w[m * wstep + j * jstep].to_f32();
            }
        }
        let xs = &src[m * sstep..];
        let mut xv = [0f32; QB];
        if lo == 0 && hi == QB && stride == 1 {
            let xs: &[T; QB] = xs[..QB].try_into().unwrap();
            xv = xs.map(T::to_f32);
        } else if lo == 0 && hi == QB {
            for (i, o) in xv.iter_mut().enumerate() {
                *o = xs[i * stride].to_f32();
            }
        } else {
            for (o, v) in xv[lo..hi].iter_mut().zip(xs.iter().step_by(stride)) {
                *o = v.to_f32();
            }
        }
        for (a, &wj) in acc.iter_mut().zip(&wv) {
            for (o, &xi) in a.iter_mut().zip(&xv) {
                *o += wj * xi;
            }
        }
    }
}

/// Forward NCHW: for each image, group, output row and block of `KB` filters, a strip of
/// `QB` output columns x `KB` filters accumulates in registers over the taps (t, r, s) and,
/// innermost, the channels, then is stored once. Each output's sum runs over (t, r, s, c) in
/// that order whatever the batch, so micro-batches are bit-identical.
#[inline(always)]
fn forward_nchw<T: Element, const QB: usize>(
    g: &Geom,
    alpha: f32,
    x: &[T],
    w: &[T],
    beta: f32,
    y: &mut [T],
) {
    let (plane, opq, taps) = (g.in_plane(), g.out_plane(), g.taps());
    let strips = strips(g.q, QB);
    let spans = strip_spans(&strips, g.s, g.w, g.sw, |s| lin(s, g.dw, g.pw));
    let mut row_map = RowMap::read_by(g);
    for img in 0..g.n {
        for grp in 0..g.groups {
            let xg = &x[(img * g.c + grp * g.cg) * plane..][..g.cg * plane];
            // Output rows outside filter blocks: the input rows one output row reads then
            // stay in cache while every filter block uses them.
            for orow in 0..g.out_rows() {
                let rows = row_map.get(orow);
                for k0 in (grp * g.kg..(grp + 1) * g.kg).step_by(KB) {
                    let kn = KB.min((grp + 1) * g.kg - k0);
                    for (st, spans) in strips.iter().zip(spans.chunks_exact(g.s)) {
                        let mut acc = [[0f32; QB]; KB];
                        for &(frow, irow) in rows {
                            for (s, &(lo, hi, start)) in spans.iter().enumerate() {
                                tile_tap(
                                    &mut acc,
                                    kn,
                                    (w, k0 * g.cg * taps + frow * g.s + s, taps, g.cg * taps),
                                    (xg, irow * g.w + start, plane, g.sw),
                                    g.cg,
                                    (lo, hi),
                                );
                            }
                        }
                        for (j, a) in acc[..kn].iter().enumerate() {
                            let yrow = &mut y[(img * g.k + k0 + j) * opq + orow * g.q..][..g.q];
                            let out = &mut yrow[st.q0 + st.from..st.q0 + st.len];
                            store(out, &a[st.from..st.len], alpha, beta);
                        }
                    }
                }
            }
        }
    }
}

/// Backward data NCHW with unit column stride, as a gather: for each image, group, input row
/// and block of `KB` input channels, a strip of `QB` columns accumulates in registers over
/// the (filter row, output row) pairs that reach the row, the column taps s and, innermost,
/// the group's
/// filters, then is stored once. Input column `wc` reads `dy` column `wc + pw - s * dw`
/// through tap `s`.
#[inline(always)]
fn backward_data_nchw_blocked<T: Element, const QB: usize>(
    g: &Geom,
    alpha: f32,
    w: &[T],
    dy: &[T],
    beta: f32,
    dx: &mut [T],
) {
    debug_assert_eq!(g.sw, 1);
    let (plane, opq, taps) = (g.in_plane(), g.out_plane(), g.taps());
    let strips = strips(g.w, QB);
    let spans = strip_spans(&strips, g.s, g.q, 1, |s| -lin(s, g.dw, g.pw));
    let mut row_map = RowMap::reading(g);
    for img in 0..g.n {
        for grp in 0..g.groups {
            let dyg = &dy[(img * g.k + grp * g.kg) * opq..][..g.kg * opq];
            // Input rows outside channel blocks, so that the dy rows they read stay in cache.
            for irow in 0..g.in_rows() {
                let rows = row_map.get(irow);
                for c0 in (0..g.cg).step_by(KB) {
                    let cn = KB.min(g.cg - c0);
                    for (st, spans) in strips.iter().zip(spans.chunks_exact(g.s)) {
                        let mut acc = [[0f32; QB]; KB];
                        for &(frow, orow) in rows {
                            for (s, &(lo, hi, start)) in spans.iter().enumerate() {
                                tile_tap(
                                    &mut acc,
                                    cn,
                                    (
                                        w,
                                        (grp * g.kg * g.cg + c0) * taps + frow * g.s + s,
                                        g.cg * taps,
                                        taps,
                                    ),
                                    (dyg, orow * g.q + start, opq, 1),
                                    g.kg,
                                    (lo, hi),
                                );
                            }
                        }
                        for (j, a) in acc[..cn].iter().enumerate() {
                            let ci = grp * g.cg + c0 + j;
                            let dxrow = &mut dx[(img * g.c + ci) * plane + irow * g.w..][..g.w];
                            let out = &mut dxrow[st.q0 + st.from..st.q0 + st.len];
                            store(out, &a[st.from..st.len], alpha, beta);
                        }
                    }
                }
            }
        }
    }
}

/// Channels per backward-filter register tile.
const CB: usize = 2;

/// The hot case of [`tile_dot`], unswitched on the stride (`UNIT`) and with constant
/// indices so that `acc` stays in registers: full-width loads, masked to the lanes `..hi`
/// (a select, so that nothing leaks in, not even NaN).
#[inline(always)]
fn tile_dot_masked<T: Element, const UNIT: bool>(
    acc: &mut [[[f32; 8]; CB]; KB],
    (dy, dofs, dstep): (&[T], [usize; KB], usize),
    (x, xofs, xstep): (&[T], [usize; CB], usize),
    count: usize,
    hi: usize,
    stride: usize,
) {
    let mut mask = [0u32; 8];
    mask[..hi].fill(!0);
    for m in 0..count {
        // (Explicit loops: `array::map` closures are not always inlined.)
        let mut xv = [[0f32; 8]; CB];
        for (xt, &o) in xv.iter_mut().zip(&xofs) {
            if UNIT {
                let xs = <&[T; 8]>::try_from(&x[o + m * xstep..][..8]).unwrap();
                for i in 0..8 {
                    xt[i] = f32::from_bits(xs[i].to_f32().to_bits() & mask[i]);
                }
            } else {
                let xs = &x[o + m * xstep..][..7 * stride + 1];
                for i in 0..8 {
                    xt[i] = f32::from_bits(xs[i * stride].to_f32().to_bits() & mask[i]);
                }
            }
        }
        for (a, &o) in acc.iter_mut().zip(&dofs) {
            let ds = <&[T; 8]>::try_from(&dy[o + m * dstep..][..8]).unwrap();
            for (at, xt) in a.iter_mut().zip(&xv) {
                for i in 0..8 {
                    // Both operands masked: the lanes are summed in the end, so an Inf or
                    // NaN past the row must not reach them.
                    at[i] += f32::from_bits(ds[i].to_f32().to_bits() & mask[i]) * xt[i];
                }
            }
        }
    }
}

/// The register tile of backward filter: for `m` in `0..count`, `acc[j][t][i] +=
/// dy[dofs[j] + m * dstep + i] * x[xofs[t] + m * xstep + i * stride]` for lanes `i < hi`
/// (the other lanes read nothing, or are masked to zero). `KB` filters x `CB` channels, so
/// that each loaded vector serves several multiply-adds.
#[inline(always)]
fn tile_dot<T: Element>(
    acc: &mut [[[f32; 8]; CB]; KB],
    (dy, dofs, dstep): (&[T], [usize; KB], usize),
    (x, xofs, xstep): (&[T], [usize; CB], usize),
    count: usize,
    hi: usize,
    stride: usize,
) {
    if count == 0 || hi == 0 {
        return;
    }
    let fits = dofs
        .iter()
        .all(|&o| o + (count - 1) * dstep + 8 <= dy.len())
        && xofs
            .iter()
            .all(|&o| o + (count - 1) * xstep + 7 * stride < x.len());
    // The tile accumulates in a local copy, which LLVM keeps in registers over the loop
    // (the caller's `acc` lives across loops over images and rows, and stays in memory).
    if fits && stride == 1 {
        let mut tile = *acc;
        tile_dot_masked::<T, true>(&mut tile, (dy, dofs, dstep), (x, xofs, xstep), count, hi, 1);
        *acc = tile;
        return;
    } else if fits {
        let mut tile = *acc;
        tile_dot_masked::<T, false>(
            &mut tile,
            (dy, dofs, dstep),
            (x, xofs, xstep),
            count,
            hi,
            stride,
        );
        *acc = tile;
        return;
    }
    for m in 0..count {
        let mut xv = [[0f32; 8]; CB];
        for (xt, &o) in xv.iter_mut().zip(&xofs) {
            for (i, v) in xt[..hi].iter_mut().enumerate() {
                *v = x[o + m * xstep + i * stride].to_f32();
            }
        }
        for (a, &o) in acc.iter_mut().zip(&dofs) {
            let mut dv = [0f32; 8];
            for (d, v) in dv[..hi].iter_mut().zip(&dy[o + m * dstep..]) {
                *d = v.to_f32();
            }
            for (at, xt) in a.iter_mut().zip(&xv) {
                for i in 0..8 {
                    at[i] += dv[i] * xt[i];
                }
            }
        }
    }
}

/// Backward filter NCHW: for each block of `KB` filters, block of `CB` channels and tap, a
/// tile of `KB x CB` dot products x eight output columns accumulates in registers over the
/// the runs of output rows (one per output depth), the images and, innermost, the output
/// rows of a run, and is reduced once at the end. Rows of missing filters or channels in a short
/// block alias the first one's and are discarded.
#[inline(always)]
fn backward_filter_nchw<T: Element>(
    g: &Geom,
    alpha: f32,
    x: &[T],
    dy: &[T],
    beta: f32,
    dw: &mut [T],
) {
    let (plane, opq, taps) = (g.in_plane(), g.out_plane(), g.taps());
    let mut runs = Vec::with_capacity(g.o);
    for grp in 0..g.groups {
        for k0 in (grp * g.kg..(grp + 1) * g.kg).step_by(KB) {
            let kn = KB.min((grp + 1) * g.kg - k0);
            for c0 in (0..g.cg).step_by(CB) {
                let cn = CB.min(g.cg - c0);
                for frow in 0..g.filter_rows() {
                    g.row_runs(frow, &mut runs);
                    for s in 0..g.s {
                        let off = lin(s, g.dw, g.pw);
                        let qs = valid_range(g.q, 0, g.w as isize, g.sw, off);
                        let mut acc = [[[0f32; 8]; CB]; KB];
                        if !qs.is_empty() {
                            for &(orow0, irow0, len) in &runs {
                                for img in 0..g.n {
                                    let dofs = [0, 1, 2, 3].map(|j| {
                                        (img * g.k + k0 + j.min(kn - 1)) * opq + orow0 * g.q
                                    });
                                    let xofs = [0, 1].map(|t| {
                                        let ci = grp * g.cg + c0 + t.min(cn - 1);
                                        (img * g.c + ci) * plane + irow0 * g.w
                                    });
                                    for q0 in qs.clone().step_by(8) {
                                        let iw0 = ((q0 * g.sw) as isize + off) as usize;
                                        let mut d = dofs;
                                        d.iter_mut().for_each(|o| *o += q0);
                                        let mut xo = xofs;
                                        xo.iter_mut().for_each(|o| *o += iw0);
                                        tile_dot(
                                            &mut acc,
                                            (dy, d, g.q),
                                            (x, xo, g.sh * g.w),
                                            len,
                                            8.min(qs.end - q0),
                                            g.sw,
                                        );
                                    }
                                }
                            }
                        }
                        let tap = frow * g.s + s;
                        for (j, a) in acc[..kn].iter().enumerate() {
                            for (t, a) in a[..cn].iter().enumerate() {
                                let sum = ((a[0] + a[4]) + (a[1] + a[5]))
                                    + ((a[2] + a[6]) + (a[3] + a[7]));
                                let idx = ((k0 + j) * g.cg + c0 + t) * taps + tap;
                                store1(&mut dw[idx], sum, alpha, beta);
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Walks filters `k0..k0 + len` with their group, without a division per filter.
#[inline(always)]
fn for_filters(k0: usize, len: usize, kg: usize, mut f: impl FnMut(usize, usize, usize)) {
    let (mut grp, mut kl) = (k0 / kg, k0 % kg);
    for j in 0..len {
        f(j, k0 + j, grp);
        kl += 1;
        if kl == kg {
            kl = 0;
            grp += 1;
        }
    }
}

#[inline(always)]
fn forward_nhwc<T: Element>(g: &Geom, alpha: f32, x: &[T], w: &[T], beta: f32, y: &mut [T]) {
    let (taps, cg) = (g.taps(), g.cg);
    let (in_rows, out_rows) = (g.in_rows(), g.out_rows());
    let mut row_map = RowMap::read_by(g);
    let mut acc = [0f32; CHUNK];
    for img in 0..g.n {
        for orow in 0..out_rows {
            let rows = row_map.get(orow);
            for q in 0..g.q {
                let cols = valid_range(g.s, 0, g.w as isize, g.dw, lin(q, g.sw, g.pw));
                let ybase = ((img * out_rows + orow) * g.q + q) * g.k;
                for k0 in (0..g.k).step_by(CHUNK) {
                    let kn = CHUNK.min(g.k - k0);
                    let acc = &mut acc[..kn];
                    acc.fill(0.0);
                    for &(frow, irow) in rows {
                        for s in cols.clone() {
                            let iw = q * g.sw + s * g.dw - g.pw;
                            let xpix = &x[((img * in_rows + irow) * g.w + iw) * g.c..][..g.c];
                            let tap = frow * g.s + s;
                            if cg == 1 && g.kg == 1 {
                                // Depthwise: filter `kk` reads channel `kk`.
                                let xs = &xpix[k0..][..kn];
                                let ws = &w[k0 * taps + tap..];
                                for (j, (a, xv)) in acc.iter_mut().zip(xs).enumerate() {
                                    *a += xv.to_f32() * ws[j * taps].to_f32();
                                }
                            } else if cg == 1 {
                                // Depthwise-like: one multiply per filter, vectorised across
                                // filters instead of a dot product of length 1.
                                for_filters(
                                    k0,
                                    kn,
                                    g.kg,
                                    #[inline(always)]
                                    |j, kk, grp| {
                                        acc[j] += xpix[grp].to_f32() * w[kk * taps + tap].to_f32();
                                    },
                                );
                            } else {
                                for_filters(
                                    k0,
                                    kn,
                                    g.kg,
                                    #[inline(always)]
                                    |j, kk, grp| {
                                        let wv = &w[(kk * taps + tap) * cg..][..cg];
                                        acc[j] += dot_strided(&xpix[grp * cg..][..cg], wv, 1);
                                    },
                                );
                            }
                        }
                    }
                    store(&mut y[ybase + k0..][..kn], acc, alpha, beta);
                }
            }
        }
    }
}

#[inline(always)]
fn backward_data_nchw<T: Element>(
    g: &Geom,
    alpha: f32,
    w: &[T],
    dy: &[T],
    beta: f32,
    dx: &mut [T],
) {
    let (in_rows, opq, taps) = (g.in_rows(), g.out_plane(), g.taps());
    // Per chunk of input columns w0..w0 + wn and column tap s: the outputs qlo..qhi that read
    // inside the chunk through s, and the chunk-relative column the first of them reads.
    let mut spans = Vec::with_capacity(g.w.div_ceil(CHUNK) * g.s);
    for w0 in (0..g.w).step_by(CHUNK) {
        let wn = CHUNK.min(g.w - w0);
        for s in 0..g.s {
            let off = lin(s, g.dw, g.pw);
            let qs = valid_range(g.q, w0 as isize, (w0 + wn) as isize, g.sw, off);
            spans.push(if qs.is_empty() {
                (0, 0, 0)
            } else {
                (
                    qs.start,
                    qs.end,
                    ((qs.start * g.sw) as isize + off) as usize - w0,
                )
            });
        }
    }
    let mut row_map = RowMap::reading(g);
    let mut acc = [0f32; CHUNK];
    for img in 0..g.n {
        for ci in 0..g.c {
            let (grp, c) = (ci / g.cg, ci % g.cg);
            for irow in 0..in_rows {
                let rows = row_map.get(irow);
                let dxrow = &mut dx[((img * g.c + ci) * in_rows + irow) * g.w..][..g.w];
                for (chunk, w0) in (0..g.w).step_by(CHUNK).enumerate() {
                    let wn = CHUNK.min(g.w - w0);
                    let spans = &spans[chunk * g.s..][..g.s];
                    let acc = &mut acc[..wn];
                    acc.fill(0.0);
                    for kk in grp * g.kg..(grp + 1) * g.kg {
                        let dyk = &dy[(img * g.k + kk) * opq..][..opq];
                        let wkc = &w[(kk * g.cg + c) * taps..][..taps];
                        for &(frow, orow) in rows {
                            let dyrow = &dyk[orow * g.q..][..g.q];
                            for (&(qlo, qhi, start), &wv) in
                                spans.iter().zip(&wkc[frow * g.s..][..g.s])
                            {
                                if qlo < qhi {
                                    axpy_scatter(
                                        &mut acc[start..],
                                        g.sw,
                                        wv.to_f32(),
                                        &dyrow[qlo..qhi],
                                    );
                                }
                            }
                        }
                    }
                    store(&mut dxrow[w0..w0 + wn], acc, alpha, beta);
                }
            }
        }
    }
}

#[inline(always)]
fn backward_data_nhwc<T: Element>(
    g: &Geom,
    alpha: f32,
    w: &[T],
    dy: &[T],
    beta: f32,
    dx: &mut [T],
) {
    let (taps, in_rows, out_rows) = (g.taps(), g.in_rows(), g.out_rows());
    let (mut row_map, mut cols) = (RowMap::reading(g), Vec::with_capacity(g.s));
    let mut acc = [0f32; CHUNK];
    for img in 0..g.n {
        for irow in 0..in_rows {
            let rows = row_map.get(irow);
            for x in 0..g.w {
                cols.clear();
                cols.extend(taps_of(x, g.s, g.sw, g.dw, g.pw, g.q));
                let dxbase = ((img * in_rows + irow) * g.w + x) * g.c;
                if g.cg == 1 {
                    // Depthwise-like: vectorise across channels; channel `ci` is group `ci`.
                    for c0 in (0..g.c).step_by(CHUNK) {
                        let cn = CHUNK.min(g.c - c0);
                        let acc = &mut acc[..cn];
                        acc.fill(0.0);
                        for &(frow, orow) in rows {
                            for &(s, q) in &cols {
                                let dyv = &dy[((img * out_rows + orow) * g.q + q) * g.k..][..g.k];
                                let tap = frow * g.s + s;
                                if g.kg == 1 {
                                    // Depthwise: channel `ci` is read by filter `ci` alone.
                                    let ws = &w[c0 * taps + tap..];
                                    let ds = &dyv[c0..][..cn];
                                    for (j, (a, d)) in acc.iter_mut().zip(ds).enumerate() {
                                        *a += d.to_f32() * ws[j * taps].to_f32();
                                    }
                                    continue;
                                }
                                for (j, a) in acc.iter_mut().enumerate() {
                                    let grp = c0 + j;
                                    for kk in grp * g.kg..(grp + 1) * g.kg {
                                        *a += dyv[kk].to_f32() * w[kk * taps + tap].to_f32();
                                    }
                                }
                            }
                        }
                        store(&mut dx[dxbase + c0..][..cn], acc, alpha, beta);
                    }
                    continue;
                }
                for grp in 0..g.groups {
                    for c0 in (0..g.cg).step_by(CHUNK) {
                        let cn = CHUNK.min(g.cg - c0);
                        let acc = &mut acc[..cn];
                        acc.fill(0.0);
                        for &(frow, orow) in rows {
                            for &(s, q) in &cols {
                                let pix = (img * out_rows + orow) * g.q + q;
                                let dyv = &dy[pix * g.k + grp * g.kg..][..g.kg];
                                for (kl, d) in dyv.iter().enumerate() {
                                    let kk = grp * g.kg + kl;
                                    let wrow = &w[(kk * taps + frow * g.s + s) * g.cg + c0..][..cn];
                                    axpy_gather(acc, d.to_f32(), wrow, 1);
                                }
                            }
                        }
                        store(&mut dx[dxbase + grp * g.cg + c0..][..cn], acc, alpha, beta);
                    }
                }
            }
        }
    }
}

#[inline(always)]
fn backward_filter_nhwc<T: Element>(
    g: &Geom,
    alpha: f32,
    x: &[T],
    dy: &[T],
    beta: f32,
    dw: &mut [T],
) {
    let (taps, in_rows, out_rows) = (g.taps(), g.in_rows(), g.out_rows());
    // The (output row, input row) pairs of a filter row, from its runs.
    fn pairs(
        runs: &[(usize, usize, usize)],
        sh: usize,
    ) -> impl Iterator<Item = (usize, usize)> + '_ {
        runs.iter()
            .flat_map(move |&(orow, irow, len)| (0..len).map(move |i| (orow + i, irow + i * sh)))
    }
    let mut runs = Vec::with_capacity(g.o);
    // Each (tap, block of filters) sweeps all of x, so accumulate as many filters per sweep as
    // a few KiB of stack allow.
    let mut acc = [0f32; 4 * CHUNK];
    for frow in 0..g.filter_rows() {
        g.row_runs(frow, &mut runs);
        for s in 0..g.s {
            let qs = valid_range(g.q, 0, g.w as isize, g.sw, lin(s, g.dw, g.pw));
            let tap = frow * g.s + s;
            if g.cg == 1 {
                // Depthwise-like: one multiply per filter, vectorised across filters.
                for k0 in (0..g.k).step_by(acc.len()) {
                    let kn = acc.len().min(g.k - k0);
                    let acc = &mut acc[..kn];
                    acc.fill(0.0);
                    for img in 0..g.n {
                        for (orow, irow) in pairs(&runs, g.sh) {
                            for q in qs.clone() {
                                let iw = q * g.sw + s * g.dw - g.pw;
                                let pix = (img * out_rows + orow) * g.q + q;
                                let dyv = &dy[pix * g.k + k0..][..kn];
                                let xpix = &x[((img * in_rows + irow) * g.w + iw) * g.c..][..g.c];
                                for_filters(
                                    k0,
                                    kn,
                                    g.kg,
                                    #[inline(always)]
                                    |j, _, grp| {
                                        acc[j] += dyv[j].to_f32() * xpix[grp].to_f32();
                                    },
                                );
                            }
                        }
                    }
                    for (j, &v) in acc.iter().enumerate() {
                        store1(&mut dw[(k0 + j) * taps + tap], v, alpha, beta);
                    }
                }
                continue;
            }
            for grp in 0..g.groups {
                for c0 in (0..g.cg).step_by(CHUNK) {
                    let cn = CHUNK.min(g.cg - c0);
                    let kb = (acc.len() / cn).min(g.kg);
                    for k0 in (grp * g.kg..(grp + 1) * g.kg).step_by(kb) {
                        let kn = kb.min((grp + 1) * g.kg - k0);
                        // acc[j * cn + c]: filter k0 + j, channel c0 + c.
                        let acc = &mut acc[..kn * cn];
                        acc.fill(0.0);
                        for img in 0..g.n {
                            for (orow, irow) in pairs(&runs, g.sh) {
                                for q in qs.clone() {
                                    let iw = q * g.sw + s * g.dw - g.pw;
                                    let opix = (img * out_rows + orow) * g.q + q;
                                    let dyv = &dy[opix * g.k + k0..][..kn];
                                    let pix = ((img * in_rows + irow) * g.w + iw) * g.c;
                                    let xv = &x[pix + grp * g.cg + c0..][..cn];
                                    for (a, d) in acc.chunks_exact_mut(cn).zip(dyv) {
                                        axpy_gather(a, d.to_f32(), xv, 1);
                                    }
                                }
                            }
                        }
                        for (j, a) in acc.chunks_exact(cn).enumerate() {
                            let kk = k0 + j;
                            store(
                                &mut dw[(kk * taps + tap) * g.cg + c0..][..cn],
                                a,
                                alpha,
                                beta,
                            );
                        }
                    }
                }
            }
        }
    }
}
