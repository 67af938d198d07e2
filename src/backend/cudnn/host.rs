//! Host-side data for the device buffers: deterministic random values, their encoding as
//! fp32/fp16/bf16 bytes, and a naive reference convolution to check cuDNN's results against.
//!
//! Pure Rust, no CUDA: everything here is tested on any machine.

#![forbid(unsafe_code)]

use super::error::CudnnError;
use super::shape::ConvShapes;
use crate::backend::cpu::reference::for_each_product;
use crate::solver::{ConvOp, ConvProblem, DType};
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

/// Elements of the random block a device fill repeats ([`tiled_values`]): a prime, so that
/// the period lines up with no tensor stride, and small to make and upload (at most 256 KiB).
pub const FILL_PERIOD: usize = 65_521;

/// What a device fill of `len` elements holds: [`random_values`] of one block of
/// [`FILL_PERIOD`] (fewer when `len` is smaller) repeated; non-zero like them. The device
/// uploads the block and copies it ([`doubling_copies`]) instead of staging every value.
pub fn tiled_values(dtype: DType, len: usize, seed: u64) -> Vec<f32> {
    let block = random_values(dtype, len.min(FILL_PERIOD), seed);
    block.iter().copied().cycle().take(len).collect()
}

/// The copies that tile `total` bytes from their first `block` bytes (`0 < block <= total`),
/// doubling what is filled each time: copy `(len, offset)` copies bytes `[0, len)` to
/// `[offset, offset + len)`, after the copies before it, where `[0, offset)` is filled and
/// `offset` is a multiple of `block`. About log2(total / block) copies, none overlapping.
pub fn doubling_copies(block: usize, total: usize) -> Vec<(usize, usize)> {
    let mut copies = Vec::new();
    let mut filled = block.min(total);
    while block > 0 && filled < total {
        let len = filled.min(total - filled);
        copies.push((len, filled));
        filled += len;
    }
    copies
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

/// Naive reference for `op` on host data in the problem's layout: `a` and `b` are the inputs in
/// the order of [`super::shape::operand_roles`] (forward: x, w; backward-data: w, dy;
/// backward-filter: x, dy), 2-D or 3-D. Cost is `n*k*o*p*q*c/g*t*r*s`: for small test
/// problems only.
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
    // The CPU backend's reference loop: one definition of which products a convolution sums.
    for_each_product(problem, |xi, wi, yi| match op {
        // a = x, b = w, out = y
        ConvOp::Forward => add(yi, a[xi], b[wi]),
        // a = w, b = dy, out = dx
        ConvOp::BackwardData => add(xi, a[wi], b[yi]),
        // a = x, b = dy, out = dw
        ConvOp::BackwardFilter => add(wi, a[xi], b[yi]),
    })
    .map_err(|e| CudnnError::InvalidArgument {
        call: "reference_convolution",
        detail: e.to_string(),
    })?;
    Ok(Reference { values, magnitude })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cudnn::shape::Operand;
    use crate::solver::Layout;

    /// `dims` as `[n, c, d, h, w]` (a 4-D `[n, c, h, w]` gets depth 1).
    fn five(dims: &[i32]) -> [usize; 5] {
        let d = |i: usize| dims[i] as usize;
        if dims.len() == 5 {
            [d(0), d(1), d(2), d(3), d(4)]
        } else {
            [d(0), d(1), 1, d(2), d(3)]
        }
    }

    /// The copies, applied to a buffer that holds one encoded block, make the tiled values,
    /// for lengths below, at and around powers of two of the period, and block sizes that do
    /// not divide the total.
    #[test]
    fn doubling_copies_tile_the_block_over_the_buffer() {
        for dtype in [DType::Fp32, DType::Fp16, DType::Bf16] {
            let size = dtype.size_bytes();
            for len in [
                1,
                7,
                FILL_PERIOD - 1,
                FILL_PERIOD,
                FILL_PERIOD + 1,
                2 * FILL_PERIOD,
                5 * FILL_PERIOD + 3,
                (1 << 20) + 11,
            ] {
                let want = encode(dtype, &tiled_values(dtype, len, 3));
                let block = encode(dtype, &random_values(dtype, len.min(FILL_PERIOD), 3));
                let mut bytes = vec![0u8; len * size];
                bytes[..block.len()].copy_from_slice(&block);
                let copies = doubling_copies(block.len(), bytes.len());
                for &(count, offset) in &copies {
                    assert!(count <= offset, "a copy reads only what is filled");
                    assert_eq!(offset % block.len(), 0);
                    bytes.copy_within(0..count, offset);
                }
                assert_eq!(bytes, want, "{dtype} {len}");
                let doublings = (len.div_ceil(FILL_PERIOD) as f64).log2().ceil() as usize;
                assert_eq!(copies.len(), doublings, "{dtype} {len}");
            }
        }
        assert!(doubling_copies(8, 8).is_empty());
        assert!(tiled_values(DType::Fp16, 3 * FILL_PERIOD, 1)
            .iter()
            .all(|&v| v != 0.0));
    }

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
            // 3-D: strided, padded, dilated and grouped in depth too, both layouts.
            ConvProblem {
                pad_d: 1,
                pad_h: 1,
                stride_d: 2,
                dilation_w: 2,
                groups: 2,
                ..ConvProblem::new_3d(2, 4, 5, 6, 7, 6, 3, 2, 2)
            },
            ConvProblem {
                pad_d: 2,
                dilation_d: 2,
                stride_h: 2,
                layout: Layout::Nhwc,
                ..ConvProblem::new_3d(1, 3, 6, 5, 4, 2, 2, 3, 1)
            },
            // 1-D (unit height).
            ConvProblem {
                pad_w: 2,
                stride_w: 3,
                layout: Layout::Nhwc,
                ..ConvProblem::new_1d(2, 3, 17, 4, 5)
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

    /// A 3-D convolution with a depth-1 filter (no depth padding, stride or dilation) is the
    /// 2-D convolution of each depth slice: the depth axis of the 3-D reference, checked
    /// against the 2-D one.
    #[test]
    fn three_d_reference_with_unit_filter_depth_is_2d_per_slice() {
        let (n, c, d, h, w, k) = (2, 3, 4, 5, 6, 2);
        let three_d = ConvProblem {
            pad_h: 1,
            stride_w: 2,
            ..ConvProblem::new_3d(n, c, d, h, w, k, 1, 3, 2)
        };
        let two_d = ConvProblem {
            pad_h: 1,
            stride_w: 2,
            ..ConvProblem::new(n, c, h, w, k, 3, 2)
        };
        let s3 = ConvShapes::new(&three_d).unwrap();
        let s2 = ConvShapes::new(&two_d).unwrap();
        assert_eq!(s3.input, [2, 3, 4, 5, 6]);
        assert_eq!(s3.output.len(), 5);
        let x = random_values(DType::Fp32, s3.elements(Operand::Input), 5);
        let wt = random_values(DType::Fp32, s3.elements(Operand::Filter), 6);
        let y = reference_convolution(&three_d, ConvOp::Forward, &x, &wt).unwrap();
        let [_, _, o, p, q] = five(&s3.output);
        assert_eq!(o, d as usize);
        let (d, h, w, c, k) = (d as usize, h as usize, w as usize, c as usize, k as usize);
        for slice in 0..d {
            // NCDHW: depth slice `slice` of sample `ni`, channel `ci` is h*w contiguous values.
            let mut x2 = Vec::new();
            for ni in 0..n as usize {
                for ci in 0..c {
                    let at = ((ni * c + ci) * d + slice) * h * w;
                    x2.extend_from_slice(&x[at..at + h * w]);
                }
            }
            let y2 = reference_convolution(&two_d, ConvOp::Forward, &x2, &wt).unwrap();
            assert_eq!(y2.values.len(), s2.elements(Operand::Output));
            for ni in 0..n as usize {
                for ki in 0..k {
                    let at3 = ((ni * k + ki) * o + slice) * p * q;
                    let at2 = (ni * k + ki) * p * q;
                    assert_eq!(y.values[at3..at3 + p * q], y2.values[at2..at2 + p * q]);
                }
            }
        }
    }

    #[test]
    fn reference_3d_by_hand() {
        // 1x1x2x2x2 input 1..8, one 2x1x1 filter of ones: sums over depth pairs.
        let p = ConvProblem::new_3d(1, 1, 2, 2, 2, 1, 2, 1, 1);
        let x: Vec<f32> = (1..=8).map(|v| v as f32).collect();
        let y = reference_convolution(&p, ConvOp::Forward, &x, &[1.0, 1.0]).unwrap();
        assert_eq!(y.values, vec![6.0, 8.0, 10.0, 12.0]);
        // Depth padding 1 adds two output slices that see one input slice each.
        let padded = ConvProblem { pad_d: 1, ..p };
        let y = reference_convolution(&padded, ConvOp::Forward, &x, &[1.0, 1.0]).unwrap();
        assert_eq!(
            y.values,
            vec![1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 10.0, 12.0, 5.0, 6.0, 7.0, 8.0]
        );
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
