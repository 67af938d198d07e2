//! Naive `f64` reference convolution, the yardstick for every backend's tests.
//!
//! One seven-deep loop over (image, filter, output position, channel, tap) visits every
//! multiply of the convolution exactly once; the three operations differ only in which
//! tensor the product is added to. No tiling, no clever index ranges: obviously correct and
//! slow. Inputs and the result are in the problem's layout (see [`super`]).

use super::{CpuError, Geom};
use crate::solver::{ConvOp, ConvProblem, Layout};

/// `op(a, b)` in f64 with `alpha = 1, beta = 0`; `(a, b)` are as for [`super::run`]:
/// `(x, w)` for forward, `(w, dy)` for backward data, `(x, dy)` for backward filter.
/// Returns `y`, `dx` or `dw` respectively. The dtype of the problem is ignored.
pub fn conv_f64(
    problem: &ConvProblem,
    op: ConvOp,
    a: &[f64],
    b: &[f64],
) -> Result<Vec<f64>, CpuError> {
    let g = Geom::new(problem)?;
    let lens = super::buffer_lens(problem, op)?;
    for ((buffer, expected), actual) in lens.into_iter().zip([a.len(), b.len()]) {
        if expected != actual {
            return Err(CpuError::BufferLength {
                buffer,
                expected,
                actual,
            });
        }
    }
    let nhwc = g.layout == Layout::Nhwc;
    let xi = |n: usize, c: usize, h: usize, w: usize| {
        if nhwc {
            ((n * g.h + h) * g.w + w) * g.c + c
        } else {
            ((n * g.c + c) * g.h + h) * g.w + w
        }
    };
    let wi = |k: usize, c: usize, r: usize, s: usize| {
        if nhwc {
            ((k * g.r + r) * g.s + s) * g.cg + c
        } else {
            ((k * g.cg + c) * g.r + r) * g.s + s
        }
    };
    let yi = |n: usize, k: usize, p: usize, q: usize| {
        if nhwc {
            ((n * g.p + p) * g.q + q) * g.k + k
        } else {
            ((n * g.k + k) * g.p + p) * g.q + q
        }
    };
    let mut out = vec![0.0; lens[2].1];
    for n in 0..g.n {
        for k in 0..g.k {
            let grp = k / g.kg;
            for p in 0..g.p {
                for q in 0..g.q {
                    for cl in 0..g.cg {
                        let c = grp * g.cg + cl;
                        for r in 0..g.r {
                            for s in 0..g.s {
                                let ih = (p * g.sh + r * g.dh) as i64 - g.ph as i64;
                                let iw = (q * g.sw + s * g.dw) as i64 - g.pw as i64;
                                if ih < 0 || iw < 0 || ih >= g.h as i64 || iw >= g.w as i64 {
                                    continue;
                                }
                                let x = xi(n, c, ih as usize, iw as usize);
                                let w = wi(k, cl, r, s);
                                let y = yi(n, k, p, q);
                                match op {
                                    ConvOp::Forward => out[y] += a[x] * b[w],
                                    ConvOp::BackwardData => out[x] += a[w] * b[y],
                                    ConvOp::BackwardFilter => out[w] += a[x] * b[y],
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    Ok(out)
}
