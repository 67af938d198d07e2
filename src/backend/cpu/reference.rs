//! Naive `f64` reference convolution, the yardstick for every backend's tests (the cuDNN
//! host tier's reference, [`crate::backend::cudnn::host::reference_convolution`], walks the
//! same [`for_each_product`]).
//!
//! One loop nest over (image, filter, output position, channel, tap), positions and taps
//! having depth, height and width (depth 1 in 2-D), visits every multiply of the convolution
//! exactly once; the three operations differ only in which
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
    let mut out = vec![0.0; lens[2].1];
    for_each_product(problem, |x, w, y| match op {
        ConvOp::Forward => out[y] += a[x] * b[w],
        ConvOp::BackwardData => out[x] += a[w] * b[y],
        ConvOp::BackwardFilter => out[w] += a[x] * b[y],
    })?;
    Ok(out)
}

/// Calls `visit(x, w, y)` with the element indices, in the problem's layout, of every product
/// `x[x] * w[w]` that the convolution adds to `y[y]` (cuDNN's `CUDNN_CROSS_CORRELATION`),
/// skipping taps in the padding. The three operations are this one loop nest with the product
/// added to another tensor: forward to `y`, backward data (`w * dy`) to `x`, backward filter
/// (`x * dy`) to `w`. Visits in the order (image, filter, output position, channel, tap), so
/// each output of a forward sum is accumulated in a fixed order.
pub fn for_each_product(
    problem: &ConvProblem,
    mut visit: impl FnMut(usize, usize, usize),
) -> Result<(), CpuError> {
    let g = Geom::new(problem)?;
    let nhwc = g.layout == Layout::Nhwc;
    // Element index of (image, channel, depth, height, width) in a tensor of `ch` channels and
    // spatial size `sp`: NCDHW or NDHWC (NCHW / NHWC when the depth is 1).
    let index = |sp: [usize; 3], ch: usize, [n, c, d, h, w]: [usize; 5]| {
        if nhwc {
            (((n * sp[0] + d) * sp[1] + h) * sp[2] + w) * ch + c
        } else {
            (((n * ch + c) * sp[0] + d) * sp[1] + h) * sp[2] + w
        }
    };
    let (xs, fs, ys) = ([g.d, g.h, g.w], [g.t, g.r, g.s], [g.o, g.p, g.q]);
    for n in 0..g.n {
        for k in 0..g.k {
            let grp = k / g.kg;
            for (o, p, q) in grid(ys) {
                for cl in 0..g.cg {
                    let c = grp * g.cg + cl;
                    for (t, r, s) in grid(fs) {
                        let id = (o * g.sd + t * g.dd) as i64 - g.pd as i64;
                        let ih = (p * g.sh + r * g.dh) as i64 - g.ph as i64;
                        let iw = (q * g.sw + s * g.dw) as i64 - g.pw as i64;
                        if [(id, g.d), (ih, g.h), (iw, g.w)]
                            .iter()
                            .any(|&(i, len)| i < 0 || i >= len as i64)
                        {
                            continue;
                        }
                        let (id, ih, iw) = (id as usize, ih as usize, iw as usize);
                        let x = index(xs, g.c, [n, c, id, ih, iw]);
                        let w = index(fs, g.cg, [k, cl, t, r, s]);
                        let y = index(ys, g.k, [n, k, o, p, q]);
                        visit(x, w, y);
                    }
                }
            }
        }
    }
    Ok(())
}

/// Every `(i, j, l)` below `dims`, in row-major order.
fn grid(dims: [usize; 3]) -> impl Iterator<Item = (usize, usize, usize)> {
    (0..dims[0])
        .flat_map(move |i| (0..dims[1]).flat_map(move |j| (0..dims[2]).map(move |l| (i, j, l))))
}
