//! Shared helpers for the solver's integration tests: the recorded H100 profile, independent
//! reference solvers written differently from the library's, and random profiles.
#![allow(dead_code)]

use mucudnn_solver::{interchange, ConvOp, ConvProblem, Measurement, OpProfile, Policy, Profile};

pub fn alexnet_profile() -> Profile {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/h100-alexnet-profile.json"
    );
    let text = std::fs::read_to_string(path).expect("fixture present");
    interchange::from_json_str(&text).expect("fixture parses")
}

/// Independent WR optimum: forward relaxation ("push") over batch prefixes, with the best
/// algorithm per size found by a plain scan. Returns None when nothing composes N.
pub fn reference_wr(entry: &OpProfile, policy: Policy, limit: u64) -> Option<f64> {
    let n = entry.problem.n as usize;
    let mut best_per_size = vec![f64::INFINITY; n + 1];
    for m in &entry.measurements {
        if policy.allows(m.micro, entry.problem.n) && m.workspace_bytes <= limit {
            let slot = &mut best_per_size[m.micro as usize];
            *slot = slot.min(m.time_ms);
        }
    }
    let mut reach = vec![f64::INFINITY; n + 1];
    reach[0] = 0.0;
    for done in 0..n {
        if reach[done].is_infinite() {
            continue;
        }
        for size in 1..=n - done {
            let t = best_per_size[size];
            if t.is_finite() && reach[done] + t < reach[done + size] {
                reach[done + size] = reach[done] + t;
            }
        }
    }
    reach[n].is_finite().then_some(reach[n])
}

/// Exhaustive WR optimum for small N: every multiset of sizes summing to N.
pub fn brute_force_wr(entry: &OpProfile, policy: Policy, limit: u64) -> Option<f64> {
    fn go(remaining: i64, max_size: i64, best: &dyn Fn(i64) -> Option<f64>) -> Option<f64> {
        if remaining == 0 {
            return Some(0.0);
        }
        let mut result: Option<f64> = None;
        for size in (1..=max_size.min(remaining)).rev() {
            if let (Some(t), Some(rest)) = (best(size), go(remaining - size, size, best)) {
                result = Some(result.map_or(t + rest, |r: f64| r.min(t + rest)));
            }
        }
        result
    }
    let best = |size: i64| {
        entry
            .measurements
            .iter()
            .filter(|m| {
                m.micro == size
                    && policy.allows(size, entry.problem.n)
                    && m.workspace_bytes <= limit
            })
            .map(|m| m.time_ms)
            .reduce(f64::min)
    };
    go(entry.problem.n, entry.problem.n, &best)
}

/// A tiny deterministic generator (xorshift64*).
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, bound: u64) -> u64 {
        self.next() % bound.max(1)
    }
    pub fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// A synthetic profile shaped like real ones: per algorithm a fixed cost plus a per-image cost,
/// and a workspace that grows with the micro-batch; some (size, algo) pairs missing. Times are
/// rounded to a coarse grid so that ties occur.
pub fn random_entry(rng: &mut Rng, n: i64, algos: u32, policy: Policy) -> OpProfile {
    let mut measurements = Vec::new();
    for algo in 0..algos {
        let fixed = 0.01 + rng.unit() * 0.2;
        let per_image = 0.001 + rng.unit() * 0.05;
        let ws_per_image = if algo == 0 { 0 } else { rng.below(1 << 20) };
        for micro in policy.sizes(n) {
            if algo != 0 && rng.below(10) == 0 {
                continue; // unsupported at this size
            }
            let time = fixed + per_image * micro as f64 * (0.8 + 0.4 * rng.unit());
            measurements.push(Measurement {
                micro,
                algo,
                time_ms: (time * 1000.0).round() / 1000.0 + 0.001,
                workspace_bytes: ws_per_image * micro as u64 + rng.below(4096),
            });
        }
    }
    OpProfile {
        layer: format!("synthetic{}", rng.below(1000)),
        problem: ConvProblem::new(n, 8, 8, 8, 8, 3, 3),
        op: ConvOp::Forward,
        measurements,
    }
}
