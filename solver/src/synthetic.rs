//! Deterministic synthetic profiles and point sets shaped like real measurements, for tests and
//! benchmarks (never for tuning decisions).

use crate::algo::Algo;
use crate::problem::{ConvOp, ConvProblem};
use crate::profile::{Measurement, OpProfile, Policy};
use crate::wd::Point;

/// A tiny deterministic generator (xorshift64*). Seed must be non-zero.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `0..bound` (0 when bound is 0).
    pub fn below(&mut self, bound: u64) -> u64 {
        self.next_u64() % bound.max(1)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// A profile for one problem of mini-batch `n`: per algorithm a fixed cost plus a per-image
/// cost, and a workspace that grows with the micro-batch (algorithm 0 needs none); about one
/// in ten (size, algorithm) pairs is missing, as unsupported ones are. Times are rounded to
/// microseconds, so ties occur.
pub fn random_entry(rng: &mut Rng, n: i64, algos: u32, policy: Policy) -> OpProfile {
    let mut measurements = Vec::new();
    for algo in 0..algos {
        let fixed = 0.01 + rng.unit() * 0.2;
        let per_image = 0.001 + rng.unit() * 0.05;
        let ws_per_image = if algo == 0 { 0 } else { rng.below(1 << 20) };
        for micro in policy.sizes(n) {
            if algo != 0 && rng.below(10) == 0 {
                continue;
            }
            let time = fixed + per_image * micro as f64 * (0.8 + 0.4 * rng.unit());
            measurements.push(Measurement {
                micro,
                algo: Algo::Legacy(algo),
                time_ms: (time * 1000.0).round() / 1000.0 + 0.001,
                workspace_bytes: ws_per_image * micro as u64 + rng.below(4096),
                verification: None,
            });
        }
    }
    OpProfile {
        layer: format!("synthetic{}", rng.below(1000)),
        problem: ConvProblem::new(n, 8, 8, 8, 8, 3, 3),
        op: ConvOp::Forward,
        split: crate::SplitDim::Batch,
        measurements,
        skipped: Vec::new(),
        rejected: Vec::new(),
    }
}

/// `sets` Pareto fronts of `points` points each: workspace rising, time falling with
/// diminishing returns, as micro-batching fronts do.
pub fn random_fronts(rng: &mut Rng, sets: usize, points: usize) -> Vec<Vec<Point>> {
    (0..sets)
        .map(|_| {
            let slow = 1.0 + rng.unit() * 9.0;
            let fast = slow * (0.1 + 0.5 * rng.unit());
            let scale = 1 + rng.below(64 << 20);
            let mut workspace = 0u64;
            (0..points)
                .map(|j| {
                    let progress = j as f64 / (points.max(2) - 1) as f64;
                    let point = Point {
                        time_ms: slow - (slow - fast) * progress.sqrt(),
                        workspace_bytes: workspace,
                    };
                    workspace += 1 + rng.below(scale / points as u64 + 1);
                    point
                })
                .collect()
        })
        .collect()
}
