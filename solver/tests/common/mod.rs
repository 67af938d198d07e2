//! Shared helpers for the solver's integration tests: the recorded H100 profile, independent
//! reference solvers written differently from the library's, and random profiles.
#![allow(dead_code, unused_imports)]

pub use mucudnn_solver::synthetic::{random_entry, Rng};
use mucudnn_solver::{interchange, OpProfile, Policy, Profile};

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
