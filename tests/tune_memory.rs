//! Measuring memory on the CPU backend: measuring never allocates more workspace than a
//! plan could use, records what it skipped, a larger limit later times exactly those, and no
//! measuring state outlives a tune.

use mucudnn::backend::cpu::{self, CpuAlgo};
use mucudnn::backend::{
    Backend, BackendError, CpuBackend, MeasureSettings, Measured, MemoryUse, TimingSettings,
};
use mucudnn::cache::Cache;
use mucudnn::device::DeviceFingerprint;
use mucudnn::solver::{
    Algo, AlgoKind, CandidateSet, ConvOp, ConvProblem, MeasureKey, Plan, Policy, SizesKey,
};
use mucudnn::tune::{EngineOptions, LayerTuning};
use std::collections::BTreeSet;

const MIB: u64 = 1 << 20;

/// Times as few calls as possible: the times are replaced below anyway.
const FAST: TimingSettings = TimingSettings {
    warmup: 0,
    loops: 1,
    iterations: 1,
    long_call_ms: 1.0,
};

/// A CPU layer whose batched im2col needs 14 MiB at 8 images (7 MiB at 4): over 8 MiB,
/// within 64 MiB. One output channel keeps the arithmetic small.
fn problem() -> ConvProblem {
    let mut p = ConvProblem::new(8, 16, 24, 24, 1, 7, 7);
    (p.pad_h, p.pad_w) = (3, 3);
    p
}

/// The real CPU backend (its real workspaces and allocations), with each timed candidate
/// recorded and its time replaced by a deterministic one (less time for more workspace), so
/// that two tunes can be compared plan for plan without the host clock's noise.
struct Recording {
    inner: CpuBackend,
    timed: BTreeSet<(ConvOp, i64, Algo)>,
    /// The largest workspace the backend allocated, read after every measurement.
    largest_workspace_bytes: u64,
}

impl Recording {
    fn new() -> Self {
        Recording {
            inner: CpuBackend::new(),
            timed: BTreeSet::new(),
            largest_workspace_bytes: 0,
        }
    }
}

impl Backend for Recording {
    fn fingerprint(&self) -> &DeviceFingerprint {
        self.inner.fingerprint()
    }

    fn measure(
        &mut self,
        key: &MeasureKey,
        how: &MeasureSettings,
    ) -> Result<Measured, BackendError> {
        let op = key.op;
        let mut found = self.inner.measure(key, how)?;
        self.largest_workspace_bytes = self
            .largest_workspace_bytes
            .max(self.inner.memory().largest_workspace_bytes);
        for m in &mut found.measurements {
            self.timed.insert((op, m.micro, m.algo));
            m.time_ms = m.micro as f64 / (1.0 + m.workspace_bytes as f64 / MIB as f64)
                + f64::from(m.algo.legacy().unwrap_or(0)) * 1e-3;
        }
        Ok(found)
    }

    fn release(&mut self) {
        self.inner.release();
    }

    fn memory(&self) -> MemoryUse {
        self.inner.memory()
    }
}

fn tuning(limit: u64) -> LayerTuning {
    LayerTuning {
        policy: Policy::PowerOfTwo,
        workspace_limit_bytes: limit,
        timing: FAST,
        candidates: CandidateSet::All,
        engines: EngineOptions::default(),
        split: Default::default(),
        index_limit: mucudnn::solver::IndexLimit::CUDNN,
        verify: true,
    }
}

/// Every skipped candidate in `cache` for the layer, as (op, micro, algo).
fn skipped_in(cache: &Cache, backend: &dyn Backend) -> BTreeSet<(ConvOp, i64, Algo)> {
    let p = problem();
    let mut out = BTreeSet::new();
    for op in ConvOp::ALL {
        for micro in Policy::PowerOfTwo.sizes(p.n) {
            let skipped = cache
                .measured(
                    backend.fingerprint(),
                    &MeasureKey::batch(p, op, micro, AlgoKind::Legacy),
                )
                .expect("every size measured")
                .skipped;
            out.extend(skipped.iter().map(|s| (op, s.micro, s.algo)));
        }
    }
    out
}

#[test]
fn a_larger_limit_times_exactly_what_a_smaller_one_skipped() {
    let p = problem();
    // The layer has candidates over 8 MiB that fit 64 MiB, at some sizes only.
    let over_8: BTreeSet<(ConvOp, i64, Algo)> = ConvOp::ALL
        .into_iter()
        .flat_map(|op| {
            Policy::PowerOfTwo
                .sizes(p.n)
                .into_iter()
                .flat_map(move |micro| CpuAlgo::ALL.map(|algo| (op, micro, algo)))
        })
        .filter(|&(op, micro, algo)| {
            let bytes = cpu::workspace_bytes(&p.with_batch(micro), op, algo);
            assert!(bytes <= 64 * MIB, "{op} {micro} {algo:?}: {bytes}");
            bytes > 8 * MIB
        })
        .map(|(op, micro, algo)| (op, micro, Algo::Legacy(algo.id())))
        .collect();
    assert!(!over_8.is_empty());

    let cache = Cache::in_memory().quiet();
    let mut small = Recording::new();
    let (plans_8, stats) = tuning(8 * MIB)
        .tune_counted(&mut small, &cache, "wide", &p)
        .unwrap();
    // Nothing above 8 MiB was allocated, by the backend's own counter and the tune's report.
    assert!(small.largest_workspace_bytes <= 8 * MIB);
    assert!(small.largest_workspace_bytes > 0);
    assert_eq!(
        stats.memory.largest_workspace_bytes,
        small.largest_workspace_bytes
    );
    assert!(stats.memory.peak_bytes >= stats.memory.largest_workspace_bytes);
    // What was over the limit was recorded as skipped, not timed.
    assert_eq!(skipped_in(&cache, &small), over_8);
    assert_eq!(stats.skipped, over_8.len());
    assert!(small.timed.is_disjoint(&over_8));
    // Nothing measuring made is held after the tune.
    assert_eq!(small.memory(), MemoryUse::default());

    // 64 MiB through the same cache times exactly the skipped candidates.
    let mut large = Recording::new();
    let (plans_64, stats) = tuning(64 * MIB)
        .tune_counted(&mut large, &cache, "wide", &p)
        .unwrap();
    assert_eq!(large.timed, over_8);
    assert!(large.largest_workspace_bytes > 8 * MIB);
    assert!(large.largest_workspace_bytes <= 64 * MIB);
    assert_eq!(stats.skipped, 0);
    assert!(skipped_in(&cache, &large).is_empty());
    assert_eq!(large.memory(), MemoryUse::default());

    // ... and its plans are those of a fresh tune at 64 MiB.
    let fresh_cache = Cache::in_memory().quiet();
    let mut fresh = Recording::new();
    let (plans_fresh, _) = tuning(64 * MIB)
        .tune_counted(&mut fresh, &fresh_cache, "wide", &p)
        .unwrap();
    assert_eq!(plans_64, plans_fresh);
    assert_eq!(fresh.timed, small.timed.union(&over_8).copied().collect());
    // The larger limit changes some plan, so the comparison means something.
    assert_ne!(plans_8, plans_64);
    let within = |plans: &[Plan; 3], limit: u64| {
        plans.iter().all(|plan| {
            plan.micro_batches
                .iter()
                .all(|mb| mb.workspace_bytes <= limit)
        })
    };
    assert!(within(&plans_8, 8 * MIB));
    assert!(within(&plans_64, 64 * MIB));

    // Back at 8 MiB: the cached plans, nothing measured.
    let (again, stats) = tuning(8 * MIB)
        .tune_counted(&mut Recording::new(), &cache, "wide", &p)
        .unwrap();
    assert_eq!(again, plans_8);
    assert_eq!(stats.measured, 0);
}

/// A skipped candidate is never reused as if timed: a cache holding only an 8 MiB tune has no
/// measurement over 8 MiB, and a tune at 64 MiB through it must measure.
#[test]
fn a_skipped_candidate_is_never_a_measurement() {
    let p = problem();
    let cache = Cache::in_memory().quiet();
    tuning(8 * MIB)
        .tune_counted(&mut Recording::new(), &cache, "wide", &p)
        .unwrap();
    let device = CpuBackend::new().fingerprint().clone();
    for op in ConvOp::ALL {
        for micro in Policy::PowerOfTwo.sizes(p.n) {
            let timed = cache
                .measurements(&device, &MeasureKey::batch(p, op, micro, AlgoKind::Legacy))
                .unwrap();
            assert!(timed.iter().all(|m| m.workspace_bytes <= 8 * MIB));
        }
        let missing = cache.missing_sizes_within(
            &device,
            &SizesKey::batch(p, op, AlgoKind::Legacy),
            &Policy::PowerOfTwo.sizes(p.n),
            Some(64 * MIB),
        );
        let complete_at_8 = cache.missing_sizes_within(
            &device,
            &SizesKey::batch(p, op, AlgoKind::Legacy),
            &Policy::PowerOfTwo.sizes(p.n),
            Some(8 * MIB),
        );
        assert!(complete_at_8.is_empty(), "{op}: {complete_at_8:?}");
        assert!(!missing.is_empty(), "{op}");
    }
}
