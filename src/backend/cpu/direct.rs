//! Algorithm 0, `Direct`: the convolution sums evaluated in place, with no workspace.
//!
//! Every output element is *gathered* (backward data included: each `dx` element sums the
//! `dy` positions it contributed to) into a small fixed-size f32 stack accumulator and stored
//! once, so no scratch memory is needed; the only allocations are per-call index tables of a
//! few dozen entries (valid tap ranges), which keep integer divisions out of the inner loops.
//!
//! Loop orders keep the innermost loop on the contiguous dimension of the layout: output
//! rows (NCHW) or channels (NHWC). Two NHWC special cases: with one channel per group
//! (depthwise) the inner loop runs across filters instead of over a length-1 channel dot
//! product, and backward filter accumulates a block of filters per sweep over `x`.

use super::{
    axpy_gather, axpy_scatter, dot_strided, store, store1, valid_range, Element, Geom, CHUNK,
};
use crate::solver::Layout;

/// `y = alpha * conv(x, w) + beta * y`.
pub(super) fn forward<T: Element>(g: &Geom, alpha: f32, x: &[T], w: &[T], beta: f32, y: &mut [T]) {
    match g.layout {
        Layout::Nchw => forward_nchw(g, alpha, x, w, beta, y),
        Layout::Nhwc => forward_nhwc(g, alpha, x, w, beta, y),
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
        Layout::Nchw => backward_data_nchw(g, alpha, w, dy, beta, dx),
        Layout::Nhwc => backward_data_nhwc(g, alpha, w, dy, beta, dx),
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
        Layout::Nchw => backward_filter_nchw(g, alpha, x, dy, beta, dw),
        Layout::Nhwc => backward_filter_nhwc(g, alpha, x, dy, beta, dw),
    }
}

/// `i * step - pad`: the input offset of tap `i` (step = dilation) for output 0, or of output
/// `i` (step = stride) for tap 0.
#[inline]
fn lin(i: usize, step: usize, pad: usize) -> isize {
    (i * step) as isize - pad as isize
}

/// Per chunk of `CHUNK` output columns `q0..q0 + qn` and column tap `s` (index
/// `chunk * s_len + s`): the outputs `q0 + lo..q0 + hi` whose tap lands inside the input row,
/// and the input column `start` the first of them reads. Precomputed once per call because
/// the two divisions in [`valid_range`] would otherwise dominate short rows.
fn forward_column_spans(g: &Geom) -> Vec<(usize, usize, usize)> {
    let mut spans = Vec::with_capacity(g.q.div_ceil(CHUNK) * g.s);
    for q0 in (0..g.q).step_by(CHUNK) {
        let qn = CHUNK.min(g.q - q0);
        for s in 0..g.s {
            let off = lin(s, g.dw, g.pw);
            let qs = valid_range(g.q, 0, g.w as isize, g.sw, off);
            let (lo, hi) = (qs.start.max(q0), qs.end.min(q0 + qn));
            spans.push(if lo < hi {
                (lo - q0, hi - q0, ((lo * g.sw) as isize + off) as usize)
            } else {
                (0, 0, 0)
            });
        }
    }
    spans
}

fn forward_nchw<T: Element>(g: &Geom, alpha: f32, x: &[T], w: &[T], beta: f32, y: &mut [T]) {
    let (hw, pq, rs) = (g.h * g.w, g.p * g.q, g.r * g.s);
    let spans = forward_column_spans(g);
    let mut acc = [0f32; CHUNK];
    for img in 0..g.n {
        for kk in 0..g.k {
            let grp = kk / g.kg;
            let wk = &w[kk * g.cg * rs..][..g.cg * rs];
            let xg = &x[(img * g.c + grp * g.cg) * hw..][..g.cg * hw];
            let yk = &mut y[(img * g.k + kk) * pq..][..pq];
            for p in 0..g.p {
                let rows = valid_range(g.r, 0, g.h as isize, g.dh, lin(p, g.sh, g.ph));
                for (chunk, q0) in (0..g.q).step_by(CHUNK).enumerate() {
                    let qn = CHUNK.min(g.q - q0);
                    let spans = &spans[chunk * g.s..][..g.s];
                    let acc = &mut acc[..qn];
                    acc.fill(0.0);
                    for c in 0..g.cg {
                        let wc = &wk[c * rs..][..rs];
                        for r in rows.clone() {
                            let ih = p * g.sh + r * g.dh - g.ph;
                            let xrow = &xg[(c * g.h + ih) * g.w..][..g.w];
                            for (&(lo, hi, start), &wv) in spans.iter().zip(&wc[r * g.s..][..g.s]) {
                                if lo < hi {
                                    axpy_gather(
                                        &mut acc[lo..hi],
                                        wv.to_f32(),
                                        &xrow[start..],
                                        g.sw,
                                    );
                                }
                            }
                        }
                    }
                    store(&mut yk[p * g.q + q0..][..qn], acc, alpha, beta);
                }
            }
        }
    }
}

/// Walks filters `k0..k0 + len` with their group, without a division per filter.
#[inline]
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

fn forward_nhwc<T: Element>(g: &Geom, alpha: f32, x: &[T], w: &[T], beta: f32, y: &mut [T]) {
    let (rs, cg) = (g.r * g.s, g.cg);
    let mut acc = [0f32; CHUNK];
    for img in 0..g.n {
        for p in 0..g.p {
            let rows = valid_range(g.r, 0, g.h as isize, g.dh, lin(p, g.sh, g.ph));
            for q in 0..g.q {
                let cols = valid_range(g.s, 0, g.w as isize, g.dw, lin(q, g.sw, g.pw));
                let ybase = ((img * g.p + p) * g.q + q) * g.k;
                for k0 in (0..g.k).step_by(CHUNK) {
                    let kn = CHUNK.min(g.k - k0);
                    let acc = &mut acc[..kn];
                    acc.fill(0.0);
                    for r in rows.clone() {
                        let ih = p * g.sh + r * g.dh - g.ph;
                        for s in cols.clone() {
                            let iw = q * g.sw + s * g.dw - g.pw;
                            let xpix = &x[((img * g.h + ih) * g.w + iw) * g.c..][..g.c];
                            let tap = r * g.s + s;
                            if cg == 1 {
                                // Depthwise-like: one multiply per filter, vectorised across
                                // filters instead of a dot product of length 1.
                                for_filters(k0, kn, g.kg, |j, kk, grp| {
                                    acc[j] += xpix[grp].to_f32() * w[kk * rs + tap].to_f32();
                                });
                            } else {
                                for_filters(k0, kn, g.kg, |j, kk, grp| {
                                    let wv = &w[(kk * rs + tap) * cg..][..cg];
                                    acc[j] += dot_strided(&xpix[grp * cg..][..cg], wv, 1);
                                });
                            }
                        }
                    }
                    store(&mut y[ybase + k0..][..kn], acc, alpha, beta);
                }
            }
        }
    }
}

/// The taps `(r, o)` through which input position `i` is read, `o` being the output position
/// (`i = o * stride + r * dilation - pad`), written into `taps`.
fn taps_of(
    i: usize,
    f_len: usize,
    stride: usize,
    dilation: usize,
    pad: usize,
    o_len: usize,
    taps: &mut Vec<(usize, usize)>,
) {
    taps.clear();
    for f in 0..f_len {
        let t = (i + pad) as isize - (f * dilation) as isize;
        if t < 0 {
            break; // t only decreases with f
        }
        let t = t as usize;
        if t % stride == 0 && t / stride < o_len {
            taps.push((f, t / stride));
        }
    }
}

fn backward_data_nchw<T: Element>(
    g: &Geom,
    alpha: f32,
    w: &[T],
    dy: &[T],
    beta: f32,
    dx: &mut [T],
) {
    let (pq, rs) = (g.p * g.q, g.r * g.s);
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
    let mut rows = Vec::with_capacity(g.r);
    let mut acc = [0f32; CHUNK];
    for img in 0..g.n {
        for ci in 0..g.c {
            let (grp, c) = (ci / g.cg, ci % g.cg);
            for h in 0..g.h {
                taps_of(h, g.r, g.sh, g.dh, g.ph, g.p, &mut rows);
                let dxrow = &mut dx[((img * g.c + ci) * g.h + h) * g.w..][..g.w];
                for (chunk, w0) in (0..g.w).step_by(CHUNK).enumerate() {
                    let wn = CHUNK.min(g.w - w0);
                    let spans = &spans[chunk * g.s..][..g.s];
                    let acc = &mut acc[..wn];
                    acc.fill(0.0);
                    for kk in grp * g.kg..(grp + 1) * g.kg {
                        let dyk = &dy[(img * g.k + kk) * pq..][..pq];
                        let wkc = &w[(kk * g.cg + c) * rs..][..rs];
                        for &(r, p) in &rows {
                            let dyrow = &dyk[p * g.q..][..g.q];
                            for (&(qlo, qhi, start), &wv) in
                                spans.iter().zip(&wkc[r * g.s..][..g.s])
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

fn backward_data_nhwc<T: Element>(
    g: &Geom,
    alpha: f32,
    w: &[T],
    dy: &[T],
    beta: f32,
    dx: &mut [T],
) {
    let rs = g.r * g.s;
    let (mut rows, mut cols) = (Vec::with_capacity(g.r), Vec::with_capacity(g.s));
    let mut acc = [0f32; CHUNK];
    for img in 0..g.n {
        for h in 0..g.h {
            taps_of(h, g.r, g.sh, g.dh, g.ph, g.p, &mut rows);
            for x in 0..g.w {
                taps_of(x, g.s, g.sw, g.dw, g.pw, g.q, &mut cols);
                let dxbase = ((img * g.h + h) * g.w + x) * g.c;
                if g.cg == 1 {
                    // Depthwise-like: vectorise across channels; channel `ci` is group `ci`.
                    for c0 in (0..g.c).step_by(CHUNK) {
                        let cn = CHUNK.min(g.c - c0);
                        let acc = &mut acc[..cn];
                        acc.fill(0.0);
                        for &(r, p) in &rows {
                            for &(s, q) in &cols {
                                let dyv = &dy[((img * g.p + p) * g.q + q) * g.k..][..g.k];
                                let tap = r * g.s + s;
                                for (j, a) in acc.iter_mut().enumerate() {
                                    let grp = c0 + j;
                                    for kk in grp * g.kg..(grp + 1) * g.kg {
                                        *a += dyv[kk].to_f32() * w[kk * rs + tap].to_f32();
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
                        for &(r, p) in &rows {
                            for &(s, q) in &cols {
                                let dyv =
                                    &dy[((img * g.p + p) * g.q + q) * g.k + grp * g.kg..][..g.kg];
                                for (kl, d) in dyv.iter().enumerate() {
                                    let kk = grp * g.kg + kl;
                                    let wrow = &w[((kk * g.r + r) * g.s + s) * g.cg + c0..][..cn];
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

fn backward_filter_nchw<T: Element>(
    g: &Geom,
    alpha: f32,
    x: &[T],
    dy: &[T],
    beta: f32,
    dw: &mut [T],
) {
    let (hw, pq, rs) = (g.h * g.w, g.p * g.q, g.r * g.s);
    let mut acc = [0f32; CHUNK];
    for kk in 0..g.k {
        let grp = kk / g.kg;
        for c in 0..g.cg {
            let ci = grp * g.cg + c;
            // All taps of one (filter, channel) pair at once, so that the x and dy planes of an
            // image are read from cache for every tap.
            for t0 in (0..rs).step_by(CHUNK) {
                let tn = CHUNK.min(rs - t0);
                let acc = &mut acc[..tn];
                acc.fill(0.0);
                for img in 0..g.n {
                    let xp = &x[(img * g.c + ci) * hw..][..hw];
                    let dyp = &dy[(img * g.k + kk) * pq..][..pq];
                    for (slot, tap) in acc.iter_mut().zip(t0..t0 + tn) {
                        let (r, s) = (tap / g.s, tap % g.s);
                        let ps = valid_range(g.p, 0, g.h as isize, g.sh, lin(r, g.dh, g.ph));
                        let qs = valid_range(g.q, 0, g.w as isize, g.sw, lin(s, g.dw, g.pw));
                        if ps.is_empty() || qs.is_empty() {
                            continue;
                        }
                        let start = qs.start * g.sw + s * g.dw - g.pw;
                        let mut sum = 0f32;
                        for p in ps {
                            let ih = p * g.sh + r * g.dh - g.ph;
                            let xrow = &xp[ih * g.w..][..g.w];
                            let dyrow = &dyp[p * g.q..][..g.q];
                            sum += dot_strided(&dyrow[qs.clone()], &xrow[start..], g.sw);
                        }
                        *slot += sum;
                    }
                }
                store(&mut dw[(kk * g.cg + c) * rs + t0..][..tn], acc, alpha, beta);
            }
        }
    }
}

fn backward_filter_nhwc<T: Element>(
    g: &Geom,
    alpha: f32,
    x: &[T],
    dy: &[T],
    beta: f32,
    dw: &mut [T],
) {
    let rs = g.r * g.s;
    // Each (tap, block of filters) sweeps all of x, so accumulate as many filters per sweep as
    // a few KiB of stack allow.
    let mut acc = [0f32; 4 * CHUNK];
    for r in 0..g.r {
        let ps = valid_range(g.p, 0, g.h as isize, g.sh, lin(r, g.dh, g.ph));
        for s in 0..g.s {
            let qs = valid_range(g.q, 0, g.w as isize, g.sw, lin(s, g.dw, g.pw));
            let tap = r * g.s + s;
            if g.cg == 1 {
                // Depthwise-like: one multiply per filter, vectorised across filters.
                for k0 in (0..g.k).step_by(acc.len()) {
                    let kn = acc.len().min(g.k - k0);
                    let acc = &mut acc[..kn];
                    acc.fill(0.0);
                    for img in 0..g.n {
                        for p in ps.clone() {
                            let ih = p * g.sh + r * g.dh - g.ph;
                            for q in qs.clone() {
                                let iw = q * g.sw + s * g.dw - g.pw;
                                let dyv = &dy[((img * g.p + p) * g.q + q) * g.k + k0..][..kn];
                                let xpix = &x[((img * g.h + ih) * g.w + iw) * g.c..][..g.c];
                                for_filters(k0, kn, g.kg, |j, _, grp| {
                                    acc[j] += dyv[j].to_f32() * xpix[grp].to_f32();
                                });
                            }
                        }
                    }
                    for (j, &v) in acc.iter().enumerate() {
                        store1(&mut dw[(k0 + j) * rs + tap], v, alpha, beta);
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
                            for p in ps.clone() {
                                let ih = p * g.sh + r * g.dh - g.ph;
                                for q in qs.clone() {
                                    let iw = q * g.sw + s * g.dw - g.pw;
                                    let dyv = &dy[((img * g.p + p) * g.q + q) * g.k + k0..][..kn];
                                    let pix = ((img * g.h + ih) * g.w + iw) * g.c;
                                    let xv = &x[pix + grp * g.cg + c0..][..cn];
                                    for (a, d) in acc.chunks_exact_mut(cn).zip(dyv) {
                                        axpy_gather(a, d.to_f32(), xv, 1);
                                    }
                                }
                            }
                        }
                        for (j, a) in acc.chunks_exact(cn).enumerate() {
                            let kk = k0 + j;
                            store(&mut dw[(kk * rs + tap) * g.cg + c0..][..cn], a, alpha, beta);
                        }
                    }
                }
            }
        }
    }
}
