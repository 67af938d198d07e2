//! Host-side data for the device buffers: deterministic random values, their encoding as
//! fp32/fp16/bf16 bytes, and a naive reference convolution to check cuDNN's results against.
//!
//! Pure Rust, no CUDA: everything here is tested on any machine.

#![forbid(unsafe_code)]

use super::error::CudnnError;
use super::shape::ConvShapes;
use crate::solver::{ConvOp, ConvProblem, DType, Layout};
use half::{bf16, f16};

/// A xorshift64* generator: small, deterministic, good enough for test data.
#[derive(Clone, Debug)]
pub struct XorShift(u64);

impl XorShift {
    pub fn new(seed: u64) -> Self {
        // Any non-zero state works; mix the seed so that 0, 1, 2... give unrelated streams.
        let state = (seed ^ 0x9E37_79B9_7F4A_7C15).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        XorShift(if state == 0 {
            0x2545_F491_4F6C_DD1D
        } else {
            state
        })
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `[0, 1)` with 24 random bits.
    pub fn next_unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// `v` rounded to the nearest value of `dtype` (round-to-nearest-even), as f32.
pub fn quantize(dtype: DType, v: f32) -> f32 {
    match dtype {
        DType::Fp32 => v,
        DType::Fp16 => f16::from_f32(v).to_f32(),
        DType::Bf16 => bf16::from_f32(v).to_f32(),
    }
}

/// `len` random values, never zero: magnitudes in `[0.125, 1)` with random signs, already
/// rounded to `dtype` (normal numbers in all three types, so no value rounds to zero).
/// The same `(dtype, len, seed)` always gives the same values.
pub fn random_values(dtype: DType, len: usize, seed: u64) -> Vec<f32> {
    let mut rng = XorShift::new(seed);
    (0..len)
        .map(|_| {
            let magnitude = 0.125 + 0.875 * rng.next_unit();
            let v = if rng.next_u64() & 1 == 0 {
                magnitude
            } else {
                -magnitude
            };
            quantize(dtype, v)
        })
        .collect()
}

/// Encodes `values` as little-endian `dtype` elements (rounding to nearest).
pub fn encode(dtype: DType, values: &[f32]) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(values.len() * dtype.size_bytes());
    for &v in values {
        match dtype {
            DType::Fp32 => bytes.extend_from_slice(&v.to_le_bytes()),
            DType::Fp16 => bytes.extend_from_slice(&f16::from_f32(v).to_le_bytes()),
            DType::Bf16 => bytes.extend_from_slice(&bf16::from_f32(v).to_le_bytes()),
        }
    }
    bytes
}

/// Decodes little-endian `dtype` elements; a trailing partial element is an error.
pub fn decode(dtype: DType, bytes: &[u8]) -> Result<Vec<f32>, CudnnError> {
    let size = dtype.size_bytes();
    if bytes.len() % size != 0 {
        return Err(CudnnError::InvalidArgument {
            call: "host::decode",
            detail: format!(
                "{} bytes is not a whole number of {dtype} elements",
                bytes.len()
            ),
        });
    }
    Ok(bytes
        .chunks_exact(size)
        .map(|c| match dtype {
            DType::Fp32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]),
            DType::Fp16 => f16::from_le_bytes([c[0], c[1]]).to_f32(),
            DType::Bf16 => bf16::from_le_bytes([c[0], c[1]]).to_f32(),
        })
        .collect())
}

/// The exact result of an op, computed in f64, with a per-element error scale.
#[derive(Clone, Debug)]
pub struct Reference {
    /// The result `op(a, b)` in the problem's layout.
    pub values: Vec<f64>,
    /// Per element, the sum of the absolute values of the products that made it: a rounding
    /// error of `eps * magnitude` is what an accumulation in precision `eps` may leave.
    pub magnitude: Vec<f64>,
}

impl Reference {
    /// The largest `|got - value| / (magnitude + tiny)`: compare with the unit round-off of
    /// the computation (about 1e-6 for fp32 FMA math, 1e-3 for TF32, 1e-2 for bf16 outputs).
    pub fn max_relative_error(&self, got: &[f32]) -> f64 {
        assert_eq!(got.len(), self.values.len(), "result length");
        got.iter()
            .zip(self.values.iter().zip(&self.magnitude))
            .map(|(&g, (&v, &m))| (g as f64 - v).abs() / (m + 1e-30))
            .fold(0.0, f64::max)
    }
}

fn act_index(layout: Layout, [_, c, h, w]: [usize; 4], [ni, ci, hi, wi]: [usize; 4]) -> usize {
    match layout {
        Layout::Nchw => ((ni * c + ci) * h + hi) * w + wi,
        Layout::Nhwc => ((ni * h + hi) * w + wi) * c + ci,
    }
}

fn filter_index(layout: Layout, [_, c, r, s]: [usize; 4], [ki, ci, ri, si]: [usize; 4]) -> usize {
    match layout {
        Layout::Nchw => ((ki * c + ci) * r + ri) * s + si,
        Layout::Nhwc => ((ki * r + ri) * s + si) * c + ci,
    }
}

/// Calls `visit(x_index, w_index, y_index)` for every product of a cross-correlation
/// (cuDNN's `CUDNN_CROSS_CORRELATION`): `y[n,k,p,q] += x[n, g*C/G + c, p*u - pad_h + r*dh,
/// q*v - pad_w + s*dw] * w[k, c, r, s]` with `g = k / (K/G)`, skipping padding.
fn for_each_product(shapes: &ConvShapes, mut visit: impl FnMut(usize, usize, usize)) {
    let dims = |d: [i32; 4]| d.map(|v| v as usize);
    let (xd, wd, yd) = (dims(shapes.input), dims(shapes.filter), dims(shapes.output));
    let [n, _, h, w] = xd;
    let [k, cg, r, s] = wd;
    let [_, _, p, q] = yd;
    let groups = shapes.groups as usize;
    let k_per_group = k / groups;
    let [pad_h, pad_w] = shapes.pad.map(|v| v as i64);
    let [u, v] = shapes.stride.map(|v| v as i64);
    let [dh, dw] = shapes.dilation.map(|v| v as i64);
    let layout = shapes.layout;
    for ni in 0..n {
        for ki in 0..k {
            let c0 = (ki / k_per_group) * cg;
            for pi in 0..p {
                for qi in 0..q {
                    let yi = act_index(layout, yd, [ni, ki, pi, qi]);
                    for ci in 0..cg {
                        for ri in 0..r {
                            let hi = pi as i64 * u - pad_h + ri as i64 * dh;
                            if hi < 0 || hi >= h as i64 {
                                continue;
                            }
                            for si in 0..s {
                                let wi = qi as i64 * v - pad_w + si as i64 * dw;
                                if wi < 0 || wi >= w as i64 {
                                    continue;
                                }
                                let xi =
                                    act_index(layout, xd, [ni, c0 + ci, hi as usize, wi as usize]);
                                let fi = filter_index(layout, wd, [ki, ci, ri, si]);
                                visit(xi, fi, yi);
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Naive reference for `op` on host data in the problem's layout: `a` and `b` are the inputs in
/// the order of [`super::shape::operand_roles`] (forward: x, w; backward-data: w, dy;
/// backward-filter: x, dy). Cost is `n*k*p*q*c/g*r*s`: for small test problems only.
pub fn reference_convolution(
    problem: &ConvProblem,
    op: ConvOp,
    a: &[f32],
    b: &[f32],
) -> Result<Reference, CudnnError> {
    let shapes = ConvShapes::new(problem)?;
    let [ra, rb, rout] = super::shape::operand_roles(op);
    for (name, data, role) in [("a", a, ra), ("b", b, rb)] {
        if data.len() != shapes.elements(role) {
            return Err(CudnnError::InvalidArgument {
                call: "reference_convolution",
                detail: format!(
                    "{op} operand {name} ({role:?}) has {} elements, expected {}",
                    data.len(),
                    shapes.elements(role)
                ),
            });
        }
    }
    let out_len = shapes.elements(rout);
    let mut values = vec![0.0f64; out_len];
    let mut magnitude = vec![0.0f64; out_len];
    let mut add = |target: usize, x: f32, y: f32| {
        let prod = x as f64 * y as f64;
        values[target] += prod;
        magnitude[target] += prod.abs();
    };
    match op {
        // a = x, b = w, out = y
        ConvOp::Forward => for_each_product(&shapes, |xi, wi, yi| add(yi, a[xi], b[wi])),
        // a = w, b = dy, out = dx
        ConvOp::BackwardData => for_each_product(&shapes, |xi, wi, yi| add(xi, a[wi], b[yi])),
        // a = x, b = dy, out = dw
        ConvOp::BackwardFilter => for_each_product(&shapes, |xi, wi, yi| add(wi, a[xi], b[yi])),
    }
    Ok(Reference { values, magnitude })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cudnn::shape::Operand;

    #[test]
    fn random_values_are_deterministic_nonzero_and_representable() {
        for dtype in [DType::Fp32, DType::Fp16, DType::Bf16] {
            let v = random_values(dtype, 10_000, 7);
            assert_eq!(v, random_values(dtype, 10_000, 7));
            assert_ne!(v, random_values(dtype, 10_000, 8));
            assert!(v
                .iter()
                .all(|&x| x != 0.0 && x.abs() <= 1.0 && x.is_finite()));
            assert!(v.iter().any(|&x| x < 0.0) && v.iter().any(|&x| x > 0.0));
            // Already rounded: encoding loses nothing.
            assert_eq!(decode(dtype, &encode(dtype, &v)).unwrap(), v);
            assert_eq!(encode(dtype, &v).len(), v.len() * dtype.size_bytes());
        }
    }

    #[test]
    fn encode_decode_known_bits() {
        assert_eq!(encode(DType::Fp16, &[1.0]), vec![0x00, 0x3c]);
        assert_eq!(encode(DType::Bf16, &[1.0]), vec![0x80, 0x3f]);
        assert_eq!(encode(DType::Fp32, &[1.0]), 1.0f32.to_le_bytes().to_vec());
        assert!(decode(DType::Fp16, &[0, 0, 0]).is_err());
    }

    fn problems() -> Vec<ConvProblem> {
        let base = ConvProblem::new(2, 4, 7, 6, 6, 3, 2);
        vec![
            base,
            ConvProblem {
                layout: Layout::Nhwc,
                ..base
            },
            ConvProblem {
                pad_h: 1,
                pad_w: 2,
                stride_h: 2,
                stride_w: 3,
                dilation_h: 2,
                dilation_w: 1,
                groups: 2,
                ..base
            },
            ConvProblem {
                pad_h: 1,
                pad_w: 1,
                groups: 2,
                layout: Layout::Nhwc,
                ..base
            },
        ]
    }

    fn dot(a: &[f32], b: &[f64]) -> f64 {
        a.iter().zip(b).map(|(&x, &y)| x as f64 * y).sum()
    }

    /// <conv(x, w), dy> = <x, bwd_data(w, dy)> = <w, bwd_filter(x, dy)>: the three references
    /// are adjoint, which pins down the index arithmetic they share.
    #[test]
    fn references_are_adjoint() {
        for problem in problems() {
            let s = ConvShapes::new(&problem).unwrap();
            let x = random_values(DType::Fp32, s.elements(Operand::Input), 1);
            let w = random_values(DType::Fp32, s.elements(Operand::Filter), 2);
            let dy = random_values(DType::Fp32, s.elements(Operand::Output), 3);
            let y = reference_convolution(&problem, ConvOp::Forward, &x, &w).unwrap();
            let dx = reference_convolution(&problem, ConvOp::BackwardData, &w, &dy).unwrap();
            let dw = reference_convolution(&problem, ConvOp::BackwardFilter, &x, &dy).unwrap();
            let (a, b, c) = (
                dot(&dy, &y.values),
                dot(&x, &dx.values),
                dot(&w, &dw.values),
            );
            assert!(
                (a - b).abs() < 1e-9 * a.abs().max(1.0),
                "{problem:?}: {a} {b}"
            );
            assert!(
                (a - c).abs() < 1e-9 * a.abs().max(1.0),
                "{problem:?}: {a} {c}"
            );
            let rounded: Vec<f32> = y.values.iter().map(|&v| v as f32).collect();
            assert!(y.max_relative_error(&rounded) < 1e-6);
        }
    }

    #[test]
    fn reference_forward_by_hand() {
        // 1x1x3x3 input, one 2x2 filter of ones, stride 1: sums of 2x2 windows.
        let p = ConvProblem::new(1, 1, 3, 3, 1, 2, 2);
        let x: Vec<f32> = (1..=9).map(|v| v as f32).collect();
        let y = reference_convolution(&p, ConvOp::Forward, &x, &[1.0; 4]).unwrap();
        assert_eq!(y.values, vec![12.0, 16.0, 24.0, 28.0]);
        // The layouts differ once channels > 1: NHWC interleaves them.
        let p2 = ConvProblem {
            layout: Layout::Nhwc,
            ..ConvProblem::new(1, 2, 1, 2, 1, 1, 1)
        };
        // x[c=0] = [1, 2], x[c=1] = [10, 20] stored as (w0: c0 c1), (w1: c0 c1).
        let y2 = reference_convolution(&p2, ConvOp::Forward, &[1.0, 10.0, 2.0, 20.0], &[1.0, 1.0])
            .unwrap();
        assert_eq!(y2.values, vec![11.0, 22.0]);
        assert!(reference_convolution(&p2, ConvOp::Forward, &[1.0], &[1.0, 1.0]).is_err());
    }
}
