//! How engine configurations are looked for, and which ones a problem admits: the pure part
//! of enumerating graph-API candidates (the FFI wall, `wall/graph.rs`, asks cuDNN).
//!
//! - [`EngineSearch`]: which heuristics modes to ask, whether to sweep every engine's knobs,
//!   and the cap on candidates (the profiler's time budget: each candidate costs a plan build
//!   and a timing per micro-batch size).
//! - [`EngineNotes`]: an engine's numerical and behaviour notes, and whether the problem's
//!   [`MathMode`] admits them ([`EngineNotes::math_conflict`]).
//! - [`KnobRange`] and [`knob_combinations`]: an engine's knob space and a deterministic order
//!   that spreads a capped sweep over it.

#![forbid(unsafe_code)]

use crate::solver::{ConvOp, MathMode};
use serde::{Deserialize, Serialize};

/// A `cudnnBackendHeurMode_t` worth asking.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum HeurMode {
    /// `CUDNN_HEUR_MODE_A` (the fast heuristic; `INSTANT` is the same mode).
    A,
    /// `CUDNN_HEUR_MODE_B` (slower to query, often better ranked).
    B,
    /// `CUDNN_HEUR_MODE_FALLBACK` (engines that work everywhere, without tuning).
    Fallback,
}

impl HeurMode {
    pub const ALL: [HeurMode; 3] = [HeurMode::A, HeurMode::B, HeurMode::Fallback];

    pub fn name(self) -> &'static str {
        match self {
            HeurMode::A => "a",
            HeurMode::B => "b",
            HeurMode::Fallback => "fallback",
        }
    }
}

/// The default cap on engine candidates per (problem, op, micro-batch size).
pub const DEFAULT_MAX_CANDIDATES: usize = 32;

/// At most this many values of one knob are tried in a sweep (spread over its range).
pub const MAX_VALUES_PER_KNOB: usize = 64;

/// What to enumerate for one (problem, op, micro-batch size).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineSearch {
    /// Heuristics modes, asked in this order; their results come first, in cuDNN's ranking,
    /// duplicates dropped.
    pub heuristics: Vec<HeurMode>,
    /// Then every engine of the graph (`CUDNN_ATTR_OPERATIONGRAPH_ENGINE_GLOBAL_COUNT`):
    /// its default knobs, then knob combinations, engines taking turns.
    pub every_engine: bool,
    /// Stop at this many configurations (0 gives none).
    pub max_candidates: usize,
    /// Leave out engines that compile kernels at run time
    /// (`CUDNN_BEHAVIOR_NOTE_RUNTIME_COMPILATION`): each plan build runs NVRTC, seconds per
    /// configuration, so they are left out unless asked for (on by default).
    pub skip_runtime_compiled: bool,
    /// The cuDNN version the known-bad list ([`super::known_bad`]) is read for: `None`, the
    /// loaded library's (what every caller wants); a test names a version in a bad range to
    /// check the list against a library outside it.
    #[serde(default)]
    pub known_bad_version: Option<u64>,
}

impl Default for EngineSearch {
    fn default() -> Self {
        EngineSearch {
            heuristics: HeurMode::ALL.to_vec(),
            every_engine: false,
            max_candidates: DEFAULT_MAX_CANDIDATES,
            skip_runtime_compiled: true,
            known_bad_version: None,
        }
    }
}

/// `cudnnBackendNumericalNote_t` numbers (stable across cuDNN 9; the wall's tests check them
/// against the bindings).
pub(crate) mod note_codes {
    pub const TENSOR_CORE: u32 = 0;
    pub const DOWN_CONVERT_INPUTS: u32 = 1;
    pub const REDUCED_PRECISION_REDUCTION: u32 = 2;
    pub const FFT: u32 = 3;
    pub const NONDETERMINISTIC: u32 = 4;
    pub const WINOGRAD: u32 = 5;
    pub const WINOGRAD_TILE_4X4: u32 = 6;
    pub const WINOGRAD_TILE_6X6: u32 = 7;
    pub const WINOGRAD_TILE_13X13: u32 = 8;
    /// `cudnnBackendBehaviorNote_t`.
    pub const RUNTIME_COMPILATION: u32 = 0;
}

/// What cuDNN says about an engine's numerics and behaviour
/// (`CUDNN_ATTR_ENGINE_NUMERICAL_NOTE`, `CUDNN_ATTR_ENGINE_BEHAVIOR_NOTE`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct EngineNotes {
    /// Uses tensor cores (for fp32 data: TF32).
    pub tensor_core: bool,
    /// Converts inputs to a lower precision than their data type (e.g. fp32 to fp16).
    pub down_convert_inputs: bool,
    /// Accumulates in less than the fp32 compute type.
    pub reduced_precision_reduction: bool,
    pub fft: bool,
    pub winograd: bool,
    /// Results may differ between runs (atomics).
    pub nondeterministic: bool,
    /// Kernels are compiled when the plan is built (NVRTC).
    pub runtime_compilation: bool,
}

impl EngineNotes {
    /// Notes from the raw enum values cuDNN returned (unknown values are ignored).
    pub fn from_codes(numerical: &[u32], behavior: &[u32]) -> Self {
        use note_codes::*;
        let has = |code: u32| numerical.contains(&code);
        EngineNotes {
            tensor_core: has(TENSOR_CORE),
            down_convert_inputs: has(DOWN_CONVERT_INPUTS),
            reduced_precision_reduction: has(REDUCED_PRECISION_REDUCTION),
            fft: has(FFT),
            winograd: [
                WINOGRAD,
                WINOGRAD_TILE_4X4,
                WINOGRAD_TILE_6X6,
                WINOGRAD_TILE_13X13,
            ]
            .into_iter()
            .any(has),
            nondeterministic: has(NONDETERMINISTIC),
            runtime_compilation: behavior.contains(&RUNTIME_COMPILATION),
        }
    }

    /// Why `math` excludes an engine with these notes, or `None` when it is admitted. The
    /// legacy API's meaning of each mode, as the graph API can express it (it has no math-type
    /// attribute; engines carry notes instead):
    ///
    /// | math mode | tensor cores (TF32 for fp32) | down-converted inputs | reduced-precision accumulation |
    /// |---|---|---|---|
    /// | `default`, `tensor-op` | yes | no | no |
    /// | `tensor-op-allow-conversion` | yes | yes | yes |
    /// | `fma` | no | no | no |
    ///
    /// (PyTorch's graph-API path likewise always drops down-converting engines, and drops
    /// tensor-core engines for fp32 when TF32 is off.)
    pub fn math_conflict(&self, math: MathMode) -> Option<&'static str> {
        let strict = math != MathMode::TensorOpAllowConversion;
        if math == MathMode::Fma && self.tensor_core {
            Some("math mode fma excludes tensor-core engines")
        } else if strict && self.down_convert_inputs {
            Some(
                "the engine down-converts its inputs, which only tensor-op-allow-conversion allows",
            )
        } else if strict && self.reduced_precision_reduction {
            Some(
                "the engine accumulates in reduced precision, which only \
                 tensor-op-allow-conversion allows",
            )
        } else {
            None
        }
    }
}

/// Whether cuDNN's legacy algorithm `algo` of `op` is deterministic, as cuDNN documents it
/// and its perf results (`cudnnConvolution*AlgoPerf_t::determinism`) report: every forward
/// algorithm is; backward-data `ALGO_0` and backward-filter `ALGO_0` and `ALGO_3` sum with
/// atomics and are not. An algorithm number cuDNN does not have is not.
pub fn legacy_deterministic(op: ConvOp, algo: u32) -> bool {
    match op {
        // IMPLICIT_GEMM .. WINOGRAD_NONFUSED.
        ConvOp::Forward => algo < 8,
        // ALGO_1, FFT, FFT_TILING, WINOGRAD, WINOGRAD_NONFUSED.
        ConvOp::BackwardData => (1..6).contains(&algo),
        // ALGO_1, FFT, WINOGRAD (not implemented), WINOGRAD_NONFUSED, FFT_TILING.
        ConvOp::BackwardFilter => matches!(algo, 1 | 2 | 4 | 5 | 6),
    }
}

/// One knob of an engine (`CUDNN_BACKEND_KNOB_INFO_DESCRIPTOR`): values `min, min + stride, ..
/// ..= max`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KnobRange {
    pub knob_type: i64,
    pub min: i64,
    pub max: i64,
    pub stride: i64,
}

impl KnobRange {
    /// The values to try, ascending: all of them when there are at most
    /// [`MAX_VALUES_PER_KNOB`], else that many spread evenly over the range. A range with
    /// `max < min` or a non-positive stride is just `min`.
    pub fn values(&self) -> Vec<i64> {
        if self.stride <= 0 || self.max <= self.min {
            return vec![self.min];
        }
        // At most 2^64 - 1 steps: exact in u128, like every product below.
        let steps =
            ((i128::from(self.max) - i128::from(self.min)) / i128::from(self.stride)) as u128;
        let take = (steps + 1).min(MAX_VALUES_PER_KNOB as u128);
        (0..take)
            .map(|i| {
                // Index i of `take` evenly spaced step indices in 0..=steps (both ends included).
                let index = if take == 1 { 0 } else { i * steps / (take - 1) };
                (i128::from(self.min) + index as i128 * i128::from(self.stride)) as i64
            })
            .collect()
    }
}

fn gcd(mut a: u128, mut b: u128) -> u128 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// Every combination of the knobs' [`KnobRange::values`], each exactly once, as (knob type,
/// value) lists sorted by knob type, in a deterministic order that spreads over the whole
/// space (index `j` visits combination `j * step mod total` with `step` coprime to `total`,
/// near `total / golden ratio`), so a sweep cut off after a few candidates has varied every
/// knob rather than only the last. The first combination is every knob at its minimum.
pub fn knob_combinations(ranges: &[KnobRange]) -> impl Iterator<Item = Vec<(i64, i64)>> {
    let mut ranges = ranges.to_vec();
    ranges.sort_by_key(|r| r.knob_type);
    ranges.dedup_by_key(|r| r.knob_type);
    let values: Vec<(i64, Vec<i64>)> = ranges.iter().map(|r| (r.knob_type, r.values())).collect();
    let total: u128 = values
        .iter()
        .try_fold(1u128, |acc, (_, v)| acc.checked_mul(v.len() as u128))
        .unwrap_or(u128::MAX)
        .min(u128::from(u64::MAX));
    let mut step = ((total as f64) * 0.618_033_988_75) as u128;
    step = step.clamp(1, total.max(1));
    while gcd(step, total) != 1 {
        step += 1;
    }
    (0..total).map(move |j| {
        // j < total <= u64::MAX and step <= total, so the product fits u128.
        let mut index = j * step % total;
        values
            .iter()
            .map(|(knob_type, choices)| {
                let len = choices.len() as u128;
                let value = choices[(index % len) as usize];
                index /= len;
                (*knob_type, value)
            })
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn legacy_determinism_follows_cudnn() {
        use crate::backend::cudnn::{algo_count, algo_name};
        use crate::solver::ConvOp::*;
        let deterministic = |op| {
            (0..8)
                .filter(|&a| legacy_deterministic(op, a))
                .collect::<Vec<_>>()
        };
        assert_eq!(deterministic(Forward), [0, 1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(deterministic(BackwardData), [1, 2, 3, 4, 5]);
        assert_eq!(deterministic(BackwardFilter), [1, 2, 4, 5, 6]);
        // By cuDNN's names (the bindings' numbering): the ones that sum with atomics.
        for op in crate::solver::ConvOp::ALL {
            for algo in 0..algo_count(op) {
                let name = algo_name(op, algo).unwrap();
                let atomics = matches!(
                    name.as_str(),
                    "BWD_DATA_ALGO_0" | "BWD_FILTER_ALGO_0" | "BWD_FILTER_ALGO_3"
                );
                assert_eq!(legacy_deterministic(op, algo), !atomics, "{name}");
            }
            assert!(
                !legacy_deterministic(op, algo_count(op)),
                "no such algorithm"
            );
        }
    }

    #[test]
    fn notes_from_codes() {
        let notes = EngineNotes::from_codes(&[0, 4, 7, 99], &[0]);
        assert!(notes.tensor_core && notes.nondeterministic && notes.winograd);
        assert!(notes.runtime_compilation);
        assert!(!notes.fft && !notes.down_convert_inputs && !notes.reduced_precision_reduction);
        assert_eq!(EngineNotes::from_codes(&[], &[]), EngineNotes::default());
        assert!(EngineNotes::from_codes(&[3], &[3]).fft);
        assert!(!EngineNotes::from_codes(&[3], &[3]).runtime_compilation);
    }

    #[test]
    fn math_modes_admit_what_the_legacy_modes_mean() {
        let plain = EngineNotes::default();
        let tensor = EngineNotes {
            tensor_core: true,
            ..plain
        };
        let convert = EngineNotes {
            tensor_core: true,
            down_convert_inputs: true,
            ..plain
        };
        let reduced = EngineNotes {
            reduced_precision_reduction: true,
            ..plain
        };
        let others = EngineNotes {
            fft: true,
            winograd: true,
            nondeterministic: true,
            runtime_compilation: true,
            ..plain
        };
        use MathMode::*;
        for math in [Default, TensorOp, TensorOpAllowConversion, Fma] {
            assert_eq!(plain.math_conflict(math), None);
            assert_eq!(others.math_conflict(math), None);
        }
        assert_eq!(tensor.math_conflict(Default), None);
        assert_eq!(tensor.math_conflict(TensorOp), None);
        assert_eq!(tensor.math_conflict(TensorOpAllowConversion), None);
        assert!(tensor.math_conflict(Fma).unwrap().contains("fma"));
        for math in [Default, TensorOp, Fma] {
            assert!(convert.math_conflict(math).is_some());
            assert!(reduced.math_conflict(math).is_some());
        }
        assert_eq!(convert.math_conflict(TensorOpAllowConversion), None);
        assert_eq!(reduced.math_conflict(TensorOpAllowConversion), None);
    }

    #[test]
    fn knob_values() {
        let r = |min, max, stride| KnobRange {
            knob_type: 2,
            min,
            max,
            stride,
        };
        assert_eq!(r(0, 4, 1).values(), [0, 1, 2, 3, 4]);
        assert_eq!(r(-1, 5, 2).values(), [-1, 1, 3, 5]);
        assert_eq!(r(0, 5, 2).values(), [0, 2, 4]);
        assert_eq!(r(3, 3, 1).values(), [3]);
        assert_eq!(r(3, 1, 1).values(), [3]);
        assert_eq!(r(3, 9, 0).values(), [3]);
        let wide = r(0, 1 << 40, 1).values();
        assert_eq!(wide.len(), MAX_VALUES_PER_KNOB);
        assert_eq!((wide[0], *wide.last().unwrap()), (0, 1 << 40));
        assert!(wide.windows(2).all(|w| w[0] < w[1]));
        let extreme = r(i64::MIN, i64::MAX, 1).values();
        assert_eq!((extreme[0], *extreme.last().unwrap()), (i64::MIN, i64::MAX));
    }

    #[test]
    fn knob_combinations_visit_everything_once_in_a_spread_order() {
        let ranges = [
            KnobRange {
                knob_type: 13,
                min: 0,
                max: 1,
                stride: 1,
            },
            KnobRange {
                knob_type: 2,
                min: 0,
                max: 4,
                stride: 1,
            },
            KnobRange {
                knob_type: 18,
                min: -1,
                max: 1,
                stride: 2,
            },
        ];
        let all: Vec<Vec<(i64, i64)>> = knob_combinations(&ranges).collect();
        assert_eq!(all.len(), 2 * 5 * 2);
        let distinct: HashSet<_> = all.iter().cloned().collect();
        assert_eq!(distinct.len(), all.len());
        assert_eq!(all[0], [(2, 0), (13, 0), (18, -1)]);
        for combination in &all {
            let types: Vec<i64> = combination.iter().map(|&(t, _)| t).collect();
            assert_eq!(types, [2, 13, 18]);
        }
        // The first few already vary every knob.
        for knob in 0..3 {
            let first: HashSet<i64> = all[..6].iter().map(|c| c[knob].1).collect();
            assert!(first.len() > 1, "knob {knob} constant in {:?}", &all[..6]);
        }
        // Deterministic.
        assert_eq!(knob_combinations(&ranges).collect::<Vec<_>>(), all);
        // No knobs: one empty combination.
        assert_eq!(knob_combinations(&[]).collect::<Vec<_>>(), [vec![]]);
    }

    #[test]
    fn huge_knob_spaces_stay_lazy() {
        let ranges: Vec<KnobRange> = (0..20)
            .map(|knob_type| KnobRange {
                knob_type,
                min: 0,
                max: 1000,
                stride: 1,
            })
            .collect();
        let first: Vec<_> = knob_combinations(&ranges).take(3).collect();
        assert_eq!(first.len(), 3);
        assert_eq!(first[0].len(), 20);
        assert!(first[0] != first[1] && first[1] != first[2]);
    }

    #[test]
    fn default_search() {
        let s = EngineSearch::default();
        assert_eq!(s.heuristics, [HeurMode::A, HeurMode::B, HeurMode::Fallback]);
        assert!(!s.every_engine);
        assert_eq!(s.max_candidates, DEFAULT_MAX_CANDIDATES);
        assert_eq!(HeurMode::Fallback.name(), "fallback");
    }
}
