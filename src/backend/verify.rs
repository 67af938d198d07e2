//! Verified tuning: the arithmetic of comparing a candidate's output with the reference
//! candidate's.
//!
//! While a backend measures one size, it keeps the output of its most trusted candidate (the
//! **reference**: the CPU's `direct`; on cuDNN the legacy implicit GEMM with FMA math, no tensor
//! cores, no FFT or Winograd) and compares every other candidate's output, on the same operands,
//! with it: the largest absolute difference relative to the largest magnitude of the reference
//! ([`relative_error`]). A candidate whose error is over its [`tolerance`] computes wrong
//! numbers and is rejected ([`Verification::passed`]); the solver never sees it.
//!
//! The tolerance follows the candidate's arithmetic ([`Arithmetic`]) and the length of the sums
//! it rounds ([`reduction_length`]); see [`tolerance`] for the model. The backends measure; this
//! module only holds what they share: the tolerance, the host comparison the CPU backend uses,
//! and the [`Fault`]s with which tests make a candidate compute wrong numbers.

use super::cpu::Element;
use crate::solver::{ConvOp, ConvProblem, DType, Layout, Verification};

/// How a candidate computes, for its tolerance.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arithmetic {
    /// Products and sums in fp32 (FMA), the output rounded once to its dtype: the reference's
    /// arithmetic, and the CPU algorithms'.
    Fma,
    /// fp32 data on tensor cores: inputs rounded to TF32's 10-bit mantissa before they are
    /// multiplied, sums in fp32.
    Tf32,
    /// Through FFT or Winograd transforms: the transforms round more than a direct sum does.
    Transform,
}

impl Arithmetic {
    /// The rounding of an input before it is multiplied, relative to its magnitude: none for
    /// FMA; TF32's 2^-11 for fp32 data on tensor cores (fp16/bf16 products are exact in fp32);
    /// for transforms 2^-16 in fp32 (their transformed tiles lose a few bits, the library's own
    /// tests allow about ten times fp32's error) and the data type's own unit in fp16/bf16
    /// (transformed in that precision).
    fn input_unit(self, dtype: DType) -> f64 {
        match (self, dtype) {
            (Arithmetic::Fma, _) | (Arithmetic::Tf32, DType::Fp16 | DType::Bf16) => 0.0,
            (Arithmetic::Tf32, DType::Fp32) => 2f64.powi(-11),
            (Arithmetic::Transform, DType::Fp32) => 2f64.powi(-16),
            (Arithmetic::Transform, dtype) => unit_roundoff(dtype),
        }
    }
}

/// The unit roundoff of a data type: half a unit in the last place, relative.
pub fn unit_roundoff(dtype: DType) -> f64 {
    match dtype {
        DType::Fp32 => 2f64.powi(-24),
        DType::Fp16 => 2f64.powi(-11),
        DType::Bf16 => 2f64.powi(-8),
    }
}

/// Units of roundoff a correct candidate may differ from the reference by (both round; the
/// bound below is for a typical sum, not the worst order).
pub const TOLERANCE_UNITS: f64 = 8.0;

/// How many products one output element of `op` sums at `size` (a micro-batch size, or for a
/// spatial split the problem's batch): the filter's taps per group for forward, the output
/// channels' taps per group for backward-data (an upper bound: a stride leaves some out), and
/// every sample's output position for backward-filter.
pub fn reduction_length(problem: &ConvProblem, op: ConvOp, size: i64) -> u64 {
    let groups = problem.groups.max(1);
    let taps = (problem.t * problem.r * problem.s).max(1);
    let length = match op {
        ConvOp::Forward => (problem.c / groups) * taps,
        ConvOp::BackwardData => (problem.k / groups) * taps,
        ConvOp::BackwardFilter => {
            let (o, p, q) = problem.output_dhw();
            size * o * p * q
        }
    };
    length.max(1) as u64
}

/// The largest relative error ([`relative_error`]) a correct candidate of `arithmetic` may
/// have on `op` at `size`:
///
/// `TOLERANCE_UNITS * (input unit + 2^-24 * sqrt(reduction length) + the dtype's unit)`
///
/// Each term is one source of rounding, relative to the largest output: the inputs' rounding
/// before they are multiplied ([`Arithmetic`]); the fp32 sum of `K` products, whose rounding
/// errors add up like a random walk (for operands of random signs, about `2^-24 * sqrt(K) / 6`
/// of the largest output in any summation order; `2^-24 * sqrt(K)` bounds it); and the
/// output's rounding to its dtype, which reference and candidate each do once. With fp32, `K = 576`: 8 * (24 + 1) * 2^-24 = 1.2e-5; TF32 adds 8 * 2^-11 =
/// 3.9e-3; fp16 outputs 8 * 2^-11, bf16 8 * 2^-8 = 3.1e-2. A candidate that is wrong (an
/// indexing bug, a lost row, a broken kernel) is off by a sizeable fraction of the output, or
/// NaN: errors of 1e-1 and more.
pub fn tolerance(problem: &ConvProblem, op: ConvOp, size: i64, arithmetic: Arithmetic) -> f64 {
    let sums = (reduction_length(problem, op, size) as f64).sqrt() * unit_roundoff(DType::Fp32);
    TOLERANCE_UNITS * (arithmetic.input_unit(problem.dtype) + sums + unit_roundoff(problem.dtype))
}

/// `max |out - reference| / max |reference|` from the two maxima; 0 when both are 0, infinite
/// when only the difference is (or the difference is not a number: an output with NaN).
pub fn relative_error(max_abs_difference: f64, max_abs_reference: f64) -> f64 {
    if max_abs_difference.is_nan() {
        f64::INFINITY
    } else if max_abs_difference == 0.0 {
        0.0
    } else if max_abs_reference > 0.0 {
        max_abs_difference / max_abs_reference
    } else {
        f64::INFINITY
    }
}

/// The verification of a candidate with error `max_rel_error` held to `tolerance`.
pub fn verification(max_rel_error: f64, tolerance: f64) -> Verification {
    Verification {
        max_rel_error,
        tolerance,
    }
}

/// A reference output kept on the host (the CPU backend's), as f32 (exact for every dtype),
/// with its largest magnitude; `None` from [`HostReference::new`] when it is not finite (then
/// nothing can be compared with it).
#[derive(Clone, Debug)]
pub struct HostReference {
    values: Vec<f32>,
    max_abs: f64,
}

impl HostReference {
    /// The reference `out`, or `None` when one of its values is NaN or infinite.
    pub fn new<T: Element>(out: &[T]) -> Option<HostReference> {
        let mut values = vec![0.0f32; out.len()];
        T::load_slice(out, &mut values);
        let (max_abs, finite) = max_abs_difference(&values, None);
        finite.then_some(HostReference {
            values,
            max_abs: f64::from(max_abs),
        })
    }

    /// The relative error of `out` against this reference ([`relative_error`]); infinite when
    /// the lengths differ or `out` is not finite where the reference is.
    pub fn relative_error<T: Element>(&self, out: &[T]) -> f64 {
        if out.len() != self.values.len() {
            return f64::INFINITY;
        }
        let (largest, finite) = match T::as_f32_slice(out) {
            Some(out) => max_abs_difference(out, Some(&self.values)),
            None => {
                // Widened a block at a time (the dtype's vectorised conversion).
                let mut block = [0.0f32; BLOCK];
                let mut largest = 0.0f32;
                let mut finite = true;
                for (got, want) in out.chunks(BLOCK).zip(self.values.chunks(BLOCK)) {
                    let block = &mut block[..got.len()];
                    T::load_slice(got, block);
                    let (m, f) = max_abs_difference(block, Some(want));
                    largest = largest.max(m);
                    finite &= f;
                }
                (largest, finite)
            }
        };
        if finite {
            relative_error(f64::from(largest), self.max_abs)
        } else {
            f64::INFINITY
        }
    }
}

/// Elements widened at once when an output is not f32.
const BLOCK: usize = 4096;

/// Lanes the comparison keeps apart, so that the compiler vectorises it.
const LANES: usize = 16;

/// `max |a - b|` over the elements (`max |a|` without `b`), and whether every difference is
/// finite: one pass without branches, in [`LANES`] independent maxima. A NaN or infinite
/// difference turns its lane's `difference * 0` sum into NaN, which says "not finite" (a NaN
/// is never greater than a maximum, so the maxima alone would miss it).
fn max_abs_difference(a: &[f32], b: Option<&[f32]>) -> (f32, bool) {
    let mut maxima = [0.0f32; LANES];
    let mut poison = [0.0f32; LANES];
    let mut lane = |i: usize, d: f32| {
        maxima[i] = if d > maxima[i] { d } else { maxima[i] };
        poison[i] += d * 0.0;
    };
    match b {
        Some(b) => {
            let (a_chunks, b_chunks) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
            let (a_rest, b_rest) = (a_chunks.remainder(), b_chunks.remainder());
            for (x, y) in a_chunks.zip(b_chunks) {
                for i in 0..LANES {
                    lane(i, (x[i] - y[i]).abs());
                }
            }
            for (i, (x, y)) in a_rest.iter().zip(b_rest).enumerate() {
                lane(i, (x - y).abs());
            }
        }
        None => {
            let chunks = a.chunks_exact(LANES);
            let rest = chunks.remainder();
            for x in chunks {
                for (i, v) in x.iter().enumerate() {
                    lane(i, v.abs());
                }
            }
            for (i, x) in rest.iter().enumerate() {
                lane(i, x.abs());
            }
        }
    }
    let largest = maxima.iter().fold(0.0f32, |m, &v| m.max(v));
    (largest, poison.iter().all(|p| *p == 0.0))
}

/// A wrong result, as a test backend makes one: how the output of one candidate is corrupted.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Corruption {
    /// Every element multiplied by this factor (a wrong scale, a missed `alpha`).
    Factor(f32),
    /// One element NaN.
    Nan,
    /// One element (in the middle) off by the output's largest magnitude.
    OneElement,
    /// The last row of the last sample zeroed: a micro-batch boundary handled wrongly.
    LastRow,
    /// Every element rounded to this many significant bits: a correct but looser candidate
    /// (as a transform's rounding), not wrong.
    Round { bits: u32 },
}

/// Makes one candidate of one op compute wrong numbers at one size, in a test: applied to its
/// output after it ran, before the output is compared with the reference (what a broken kernel
/// would have written).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fault {
    pub op: ConvOp,
    /// The candidate's number (the CPU backend's legacy algorithm).
    pub algo: u32,
    /// The micro-batch (or chunk) size it is wrong at.
    pub size: i64,
    pub corruption: Corruption,
}

impl Fault {
    /// Whether this fault hits `algo` of `op` at `size`.
    pub fn hits(&self, op: ConvOp, algo: u32, size: i64) -> bool {
        self.op == op && self.algo == algo && self.size == size
    }

    /// Corrupts `out`, the output of `op` on `problem` at its micro-batch (`out` holds whole
    /// samples in `problem`'s layout; a backward-filter output has none, its last row is the
    /// last filter row).
    pub fn corrupt<T: Element>(&self, problem: &ConvProblem, out: &mut [T]) {
        if out.is_empty() {
            return;
        }
        match self.corruption {
            Corruption::Factor(factor) => {
                for v in out.iter_mut() {
                    *v = T::from_f32(v.to_f32() * factor);
                }
            }
            Corruption::Nan => out[out.len() / 2] = T::from_f32(f32::NAN),
            Corruption::OneElement => {
                let largest = out.iter().fold(0.0f32, |m, v| m.max(v.to_f32().abs()));
                let middle = out.len() / 2;
                out[middle] = T::from_f32(out[middle].to_f32() + largest.max(1.0));
            }
            Corruption::LastRow => {
                let row = self.row_length(problem).min(out.len());
                let start = out.len() - row;
                for v in &mut out[start..] {
                    *v = T::from_f32(0.0);
                }
            }
            Corruption::Round { bits } => {
                let drop = 24u32.saturating_sub(bits.clamp(1, 24));
                let mask = !((1u32 << drop) - 1);
                for v in out.iter_mut() {
                    let x = v.to_f32();
                    // Round half up in magnitude on the kept bits.
                    let half = if drop > 0 { 1u32 << (drop - 1) } else { 0 };
                    let rounded = f32::from_bits((x.to_bits().wrapping_add(half)) & mask);
                    *v = T::from_f32(if x.is_finite() { rounded } else { x });
                }
            }
        }
    }

    /// Elements of one row of the op's output: its innermost spatial extent, times the
    /// channels in a channels-last layout.
    fn row_length(&self, problem: &ConvProblem) -> usize {
        let dims = match self.op {
            ConvOp::Forward => problem.output_dims(),
            ConvOp::BackwardData => problem.input_dims(),
            ConvOp::BackwardFilter => problem.filter_dims(),
        };
        let [_, channels, _, _, width] = dims;
        let row = match problem.layout {
            Layout::Nchw => width,
            Layout::Nhwc => width * channels,
        };
        row.max(1) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::solver::MathMode;

    #[test]
    fn tolerances_follow_precision_and_reduction_length() {
        let problem = ConvProblem::new(8, 64, 14, 14, 64, 3, 3);
        assert_eq!(reduction_length(&problem, ConvOp::Forward, 8), 576);
        assert_eq!(reduction_length(&problem, ConvOp::BackwardData, 8), 576);
        assert_eq!(
            reduction_length(&problem, ConvOp::BackwardFilter, 2),
            2 * 12 * 12
        );
        let grouped = ConvProblem {
            groups: 64,
            ..problem
        };
        assert_eq!(reduction_length(&grouped, ConvOp::Forward, 8), 9);
        let fma = tolerance(&problem, ConvOp::Forward, 8, Arithmetic::Fma);
        assert!((fma - 8.0 * 25.0 * 2f64.powi(-24)).abs() < 1e-12, "{fma}");
        // Longer sums, TF32 and transforms are looser; half types looser still.
        assert!(tolerance(&problem, ConvOp::BackwardFilter, 8, Arithmetic::Fma) > fma);
        let tf32 = tolerance(&problem, ConvOp::Forward, 8, Arithmetic::Tf32);
        let transform = tolerance(&problem, ConvOp::Forward, 8, Arithmetic::Transform);
        assert!(
            tf32 > transform && transform > 10.0 * fma,
            "{tf32} {transform}"
        );
        for (dtype, at_least) in [(DType::Fp16, 3.9e-3), (DType::Bf16, 3.1e-2)] {
            let half = ConvProblem { dtype, ..problem };
            let t = tolerance(&half, ConvOp::Forward, 8, Arithmetic::Fma);
            assert!(t >= at_least && t < 2.0 * at_least, "{dtype} {t}");
            // fp16/bf16 products are exact in fp32: tensor cores add nothing.
            assert_eq!(tolerance(&half, ConvOp::Forward, 8, Arithmetic::Tf32), t);
        }
        // A Winograd-like error (2^-14 of the largest output) passes a transform's tolerance,
        // not an exact sum's; a wrong result (1e-1) passes none.
        let winograd_like = 2f64.powi(-14);
        assert!(winograd_like <= transform && winograd_like > fma);
        for arithmetic in [Arithmetic::Fma, Arithmetic::Tf32, Arithmetic::Transform] {
            let bf16 = ConvProblem {
                dtype: DType::Bf16,
                math: MathMode::Default,
                ..problem
            };
            assert!(tolerance(&bf16, ConvOp::BackwardFilter, 256, arithmetic) < 0.1);
        }
    }

    #[test]
    fn relative_errors_of_odd_outputs() {
        assert_eq!(relative_error(0.0, 0.0), 0.0);
        assert_eq!(relative_error(1.0, 0.0), f64::INFINITY);
        assert_eq!(relative_error(f64::NAN, 4.0), f64::INFINITY);
        assert_eq!(relative_error(1.0, 4.0), 0.25);
        let reference = HostReference::new(&[1.0f32, -4.0, 2.0]).unwrap();
        assert_eq!(reference.relative_error(&[1.0f32, -4.0, 2.0]), 0.0);
        assert_eq!(reference.relative_error(&[1.0f32, -3.0, 2.0]), 0.25);
        assert_eq!(
            reference.relative_error(&[1.0f32, f32::NAN, 2.0]),
            f64::INFINITY
        );
        assert_eq!(reference.relative_error(&[1.0f32]), f64::INFINITY);
        assert!(HostReference::new(&[1.0f32, f32::INFINITY]).is_none());
        let half = HostReference::new(&[half::f16::from_f32(2.0)]).unwrap();
        assert_eq!(half.relative_error(&[half::f16::from_f32(1.0)]), 0.5);
        // Long outputs (lanes, a remainder, blocks of the widened dtypes): one bad element
        // anywhere is found.
        for len in [1, 15, 16, 17, 4095, 4096, 4097, 10_000] {
            let values: Vec<f32> = (0..len).map(|i| ((i % 97) as f32 - 48.0) / 8.0).collect();
            let largest = 6.0;
            let reference = HostReference::new(&values).unwrap();
            let halves: Vec<half::bf16> = values.iter().map(|&v| half::bf16::from_f32(v)).collect();
            let bf16_reference = HostReference::new(&halves).unwrap();
            for at in [0, len / 2, len - 1] {
                let mut off = values.clone();
                off[at] += 3.0;
                assert_eq!(reference.relative_error(&off), 3.0 / largest, "{len} {at}");
                let mut nan = values.clone();
                nan[at] = f32::NAN;
                assert_eq!(reference.relative_error(&nan), f64::INFINITY, "{len} {at}");
                let mut inf = halves.clone();
                inf[at] = half::bf16::INFINITY;
                assert_eq!(bf16_reference.relative_error(&inf), f64::INFINITY);
                let mut off = halves.clone();
                off[at] = half::bf16::from_f32(off[at].to_f32() - 3.0);
                assert_eq!(bf16_reference.relative_error(&off), 3.0 / largest);
            }
            assert_eq!(reference.relative_error(&values), 0.0);
            let mut inf = values.clone();
            inf[len - 1] = f32::NEG_INFINITY;
            assert!(HostReference::new(&inf).is_none());
        }
    }

    /// Each corruption is what it says: the wrong ones far over any tolerance, the rounding
    /// within an exact sum's.
    #[test]
    fn corruptions() {
        let problem = ConvProblem::new(2, 3, 5, 6, 4, 3, 3); // output 2x4x3x4, rows of 4
        let out: Vec<f32> = (0..96).map(|i| (i as f32 - 47.5) / 10.0).collect();
        let reference = HostReference::new(&out).unwrap();
        let fault = |corruption| Fault {
            op: ConvOp::Forward,
            algo: 1,
            size: 2,
            corruption,
        };
        let corrupted = |corruption| {
            let mut copy = out.clone();
            fault(corruption).corrupt(&problem, &mut copy);
            (reference.relative_error(&copy), copy)
        };
        assert!((corrupted(Corruption::Factor(1.5)).0 - 0.5).abs() < 1e-6);
        assert_eq!(corrupted(Corruption::Nan).0, f64::INFINITY);
        assert!(corrupted(Corruption::OneElement).0 >= 1.0);
        let (error, rows) = corrupted(Corruption::LastRow);
        assert!(rows[92..].iter().all(|&v| v == 0.0) && rows[91] != 0.0);
        assert!(error > 0.9, "{error}");
        let (error, _) = corrupted(Corruption::Round { bits: 20 });
        assert!(error > 0.0 && error <= 2f64.powi(-20), "{error}");
        assert!(fault(Corruption::Nan).hits(ConvOp::Forward, 1, 2));
        assert!(!fault(Corruption::Nan).hits(ConvOp::Forward, 1, 4));
        // Channels last: a row is the width times the channels.
        let nhwc = ConvProblem {
            layout: Layout::Nhwc,
            ..problem
        };
        assert_eq!(fault(Corruption::LastRow).row_length(&nhwc), 16);
    }
}
