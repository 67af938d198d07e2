//! Verified tuning on the CPU: a candidate that computes wrong numbers is never chosen.
//!
//! The test backend is the real CPU backend with one candidate made wrong at one size
//! ([`CpuBackend::with_fault`]: its output corrupted after it runs, as a broken kernel's would
//! be) and scripted times, so that the wrong candidate is by far the fastest there: without
//! verification the plan takes it; with verification (the default) it is rejected, the plan
//! uses the next fastest, the cache records why, and `explain` says so. A candidate that is
//! correct but rounds more is not rejected. The CPU backend's own candidates all verify on every
//! zoo model (its layers' geometry, at small sizes) in every dtype.

use mucudnn::backend::cpu::CpuAlgo;
use mucudnn::backend::verify::{Corruption, Fault};
use mucudnn::backend::{
    Backend, BackendError, CpuBackend, MeasureSettings, Measured, MemoryUse, TimingSettings,
};
use mucudnn::cache::Cache;
use mucudnn::device::DeviceFingerprint;
use mucudnn::explain::{explain, render_explanation};
use mucudnn::models::Model;
use mucudnn::profiler::Job;
use mucudnn::solver::{
    solve_wr, Algo, AlgoKind, CandidateSet, ConvOp, ConvProblem, DType, Layout, MeasureKey,
    Measurement, OpProfile, Plan, Policy, Profile, SizeVerification, SplitDim,
};
use mucudnn::tune::{profile_jobs, EngineOptions, LayerTuning, ProfileRun};

/// One call per candidate: the times are scripted below, and the zoo check only needs outputs.
const FAST: TimingSettings = TimingSettings {
    warmup: 0,
    loops: 1,
    iterations: 1,
    long_call_ms: 1.0,
};

const WRONG: CpuAlgo = CpuAlgo::Im2colGemm;
/// The size the wrong candidate is wrong (and fastest) at.
const WRONG_AT: i64 = 2;
const N: i64 = 4;

fn problem() -> ConvProblem {
    let mut p = ConvProblem::new(N, 6, 9, 9, 8, 3, 3);
    (p.pad_h, p.pad_w) = (1, 1);
    p
}

/// The CPU backend with `fault`, its times replaced by a script: `WRONG` at `WRONG_AT` takes
/// 0.01 ms per sample, every other (candidate, size) 1 ms per sample plus a little per
/// candidate number; so the fastest plan is `2x2@im2col-batched` when that candidate is
/// allowed, and a plan of `direct` (the next fastest) otherwise.
struct Scripted(CpuBackend);

impl Scripted {
    fn new(fault: Option<Fault>) -> Scripted {
        let backend = CpuBackend::new();
        Scripted(match fault {
            Some(fault) => backend.with_fault(fault),
            None => backend,
        })
    }
}

fn scripted_ms(m: &Measurement) -> f64 {
    let per_sample = if m.algo == Algo::Legacy(WRONG.id()) && m.micro == WRONG_AT {
        0.01
    } else {
        1.0 + f64::from(m.algo.legacy().unwrap_or(0)) * 0.01
    };
    per_sample * m.micro as f64
}

impl Backend for Scripted {
    fn fingerprint(&self) -> &DeviceFingerprint {
        self.0.fingerprint()
    }
    fn supports(&self, key: &MeasureKey) -> bool {
        self.0.supports(key)
    }
    fn measure(
        &mut self,
        key: &MeasureKey,
        how: &MeasureSettings,
    ) -> Result<Measured, BackendError> {
        let mut found = self.0.measure(key, how)?;
        for m in found.measurements.iter_mut().chain(&mut found.rejected) {
            m.time_ms = scripted_ms(m);
        }
        Ok(found)
    }
    fn release(&mut self) {
        self.0.release();
    }
    fn memory(&self) -> MemoryUse {
        self.0.memory()
    }
    fn has_candidate(&self, op: ConvOp, algo: &Algo) -> bool {
        self.0.has_candidate(op, algo)
    }
}

fn fault(corruption: Corruption) -> Fault {
    Fault {
        op: ConvOp::Forward,
        algo: WRONG.id(),
        size: WRONG_AT,
        corruption,
    }
}

fn run(cache: &Cache, verify: bool) -> ProfileRun<'_> {
    ProfileRun {
        policy: Policy::PowerOfTwo,
        timing: FAST,
        cache,
        interrupt: None,
        candidates: CandidateSet::All,
        engines: EngineOptions::default(),
        workspace_limit_bytes: None,
        index_limit: mucudnn::solver::IndexLimit::CUDNN,
        verify,
    }
}

/// The forward entry of one tune of `problem()` through `cache`, and how many sizes it measured.
fn tune_forward(backend: &mut Scripted, cache: &Cache, verify: bool) -> (OpProfile, usize) {
    let job = Job::batch("net.conv", problem(), ConvOp::Forward);
    let (profile, stats) =
        profile_jobs(backend, &[job], &run(cache, verify), &mut |_, _| {}).expect("the tune runs");
    (profile.entries[0].clone(), stats.measured)
}

fn uses(plan: &Plan, algo: CpuAlgo, size: i64) -> bool {
    plan.micro_batches
        .iter()
        .any(|mb| mb.algo == Algo::Legacy(algo.id()) && mb.size == size)
}

fn key_at(size: i64) -> MeasureKey {
    MeasureKey::batch(problem(), ConvOp::Forward, size, AlgoKind::Legacy)
}

/// Without verification a wrong candidate that is fastest is planned: what this guards
/// against. (The fault's output is wrong; nothing noticed.)
#[test]
fn without_verification_the_fastest_wrong_candidate_is_planned() {
    let cache = Cache::in_memory().quiet();
    let mut backend = Scripted::new(Some(fault(Corruption::Factor(2.0))));
    let (entry, _) = tune_forward(&mut backend, &cache, false);
    assert!(entry.rejected.is_empty());
    assert!(entry.measurements.iter().all(|m| m.verification.is_none()));
    let plan = solve_wr(&entry, Policy::PowerOfTwo, u64::MAX).unwrap();
    assert_eq!(plan.micro_batches.len(), 2);
    assert!(uses(&plan, WRONG, WRONG_AT), "{plan:?}");
}

/// Each kind of wrong output (off by a factor, NaN, one wrong element, a wrong row at the
/// micro-batch's boundary) is rejected: the plan uses the next fastest, the cache records the
/// rejection with its error, `explain` names it, and a second tune reads it from the cache.
#[test]
fn a_wrong_candidate_is_rejected_and_never_planned() {
    let dir = std::env::temp_dir().join(format!("mucudnn-verified-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (name, corruption) in [
        ("factor", Corruption::Factor(2.0)),
        ("nan", Corruption::Nan),
        ("one-element", Corruption::OneElement),
        ("last-row", Corruption::LastRow),
    ] {
        let path = dir.join(format!("{name}.sqlite"));
        let _ = std::fs::remove_file(&path);
        let cache = Cache::open(&path).unwrap().quiet();
        let mut backend = Scripted::new(Some(fault(corruption)));
        let (entry, measured) = tune_forward(&mut backend, &cache, true);
        assert_eq!(measured, 3, "{name}: sizes 1, 2 and 4 measured");

        // Rejected: with its time and error, not among the measurements.
        assert_eq!(entry.rejected.len(), 1, "{name}: {:?}", entry.rejected);
        let rejected = entry.rejected[0];
        assert_eq!(
            (rejected.algo, rejected.micro),
            (Algo::Legacy(WRONG.id()), WRONG_AT)
        );
        let verification = rejected.verification.expect("compared");
        assert!(!verification.passed(), "{name}: {verification:?}");
        assert!(
            verification.max_rel_error >= 0.1,
            "{name}: {verification:?}"
        );
        if corruption == Corruption::Nan {
            assert_eq!(verification.max_rel_error, f64::INFINITY);
        }
        assert!(entry
            .measurements
            .iter()
            .all(|m| m.verification.is_some_and(|v| v.passed())));
        assert!(!entry
            .measurements
            .iter()
            .any(|m| m.algo == rejected.algo && m.micro == WRONG_AT));
        // The same candidate is correct at the other sizes.
        assert!(entry
            .measurements
            .iter()
            .any(|m| m.algo == rejected.algo && m.micro == 1));

        // The plan: the next fastest, never the wrong candidate where it is wrong.
        let plan = solve_wr(&entry, Policy::PowerOfTwo, u64::MAX).unwrap();
        assert!(!uses(&plan, WRONG, WRONG_AT), "{name}: {plan:?}");
        let next_fastest: f64 = 4.0; // direct: 1 ms per sample, however split
        assert!(
            (plan.time_ms() - next_fastest).abs() < 1e-9,
            "{name}: {plan:?}"
        );

        // The cache records why.
        let cached = cache
            .measured(backend.fingerprint(), &key_at(WRONG_AT))
            .unwrap();
        assert_eq!(cached.verification, SizeVerification::Verified);
        assert_eq!(cached.rejected.len(), 1);
        assert_eq!(cached.rejected[0].verification, rejected.verification);
        assert!(cache
            .measurements(backend.fingerprint(), &key_at(WRONG_AT))
            .unwrap()
            .iter()
            .all(|m| m.algo != rejected.algo));

        // `explain` says so.
        let explanation = explain(&entry, Policy::PowerOfTwo, &[], 1).unwrap();
        let names = Profile {
            fingerprint: Some(backend.fingerprint().clone()),
            ..Profile::default()
        }
        .algo_names();
        let text = render_explanation(&explanation, names);
        let line = text
            .lines()
            .find(|l| l.contains("rejected: wrong results"))
            .unwrap_or_else(|| panic!("{name}: no rejection in\n{text}"));
        assert!(
            line.contains("im2col-batched at 2 samples"),
            "{name}: {line}"
        );
        if corruption == Corruption::Nan {
            assert!(line.contains("not finite"), "{line}");
        } else {
            assert!(line.contains("max relative error"), "{line}");
        }
        assert!(
            !text
                .lines()
                .filter(|l| l.trim_start().starts_with("2 "))
                .any(|l| l.contains("im2col-batched")),
            "{name}: the rejected candidate is in no cell:\n{text}"
        );

        // Reopened, the cache serves the same verdict without measuring.
        drop(cache);
        let cache = Cache::open(&path).unwrap().quiet();
        let mut clean = Scripted::new(None);
        let (again, measured) = tune_forward(&mut clean, &cache, true);
        assert_eq!(measured, 0, "{name}");
        assert_eq!(again.rejected, entry.rejected);
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A candidate that is right but rounds more than the reference (as a transform's rounding)
/// has a non-zero error within its tolerance: it is kept, and planned.
#[test]
fn a_correct_but_looser_candidate_is_not_rejected() {
    let cache = Cache::in_memory().quiet();
    let mut backend = Scripted::new(Some(fault(Corruption::Round { bits: 20 })));
    let (entry, _) = tune_forward(&mut backend, &cache, true);
    assert!(entry.rejected.is_empty(), "{:?}", entry.rejected);
    let looser = entry
        .measurements
        .iter()
        .find(|m| m.algo == Algo::Legacy(WRONG.id()) && m.micro == WRONG_AT)
        .unwrap()
        .verification
        .unwrap();
    let exact = entry
        .measurements
        .iter()
        .find(|m| m.algo == Algo::Legacy(WRONG.id()) && m.micro == 1)
        .unwrap()
        .verification
        .unwrap();
    assert!(
        looser.max_rel_error > exact.max_rel_error && looser.passed(),
        "{looser:?} vs {exact:?}"
    );
    let plan = solve_wr(&entry, Policy::PowerOfTwo, u64::MAX).unwrap();
    assert!(uses(&plan, WRONG, WRONG_AT), "{plan:?}");
}

/// A layer tuning itself (the path of the C ABI, PyTorch and candle) never plans the wrong
/// candidate; turned off, it does, and its plans are cached apart from the verified ones.
#[test]
fn a_layer_never_plans_a_wrong_candidate() {
    let tuning = |verify| LayerTuning {
        timing: FAST,
        candidates: CandidateSet::Legacy,
        policy: Policy::PowerOfTwo,
        split: mucudnn::tune::SplitSetting::Batch,
        verify,
        ..LayerTuning::new(FAST)
    };
    let cache = Cache::in_memory().quiet();
    let mut backend = Scripted::new(Some(fault(Corruption::OneElement)));
    let [forward, ..] = tuning(true)
        .tune(&mut backend, &cache, "net.conv", &problem())
        .unwrap();
    assert!(!uses(&forward, WRONG, WRONG_AT), "{forward:?}");
    // Unverified plans are solved from measurements taken without comparing outputs (the
    // verified size's rejection stays: what was found wrong is never planned).
    let [unverified, ..] = tuning(false)
        .tune(&mut backend, &cache, "net.conv", &problem())
        .unwrap();
    assert!(!uses(&unverified, WRONG, WRONG_AT), "{unverified:?}");
    let fresh = Cache::in_memory().quiet();
    let [unchecked, ..] = tuning(false)
        .tune(&mut backend, &fresh, "net.conv", &problem())
        .unwrap();
    assert!(uses(&unchecked, WRONG, WRONG_AT), "{unchecked:?}");
    assert_ne!(
        tuning(true).plan_context(&problem()),
        tuning(false).plan_context(&problem())
    );
}

/// Measurements cached before verification (or without it) are unverified: a verifying tune
/// measures them again and finds the wrong candidate; one that does not verify uses them.
#[test]
fn unverified_cached_sizes_are_verified_on_their_next_measurement() {
    let cache = Cache::in_memory().quiet();
    let mut backend = Scripted::new(Some(fault(Corruption::Factor(0.5))));
    let (unverified, measured) = tune_forward(&mut backend, &cache, false);
    assert_eq!(measured, 3);
    let device = backend.fingerprint().clone();
    let state = |cache: &Cache| {
        cache
            .measured(&device, &key_at(WRONG_AT))
            .unwrap()
            .verification
    };
    assert_eq!(state(&cache), SizeVerification::Unverified);
    let (_, measured) = tune_forward(&mut backend, &cache, false);
    assert_eq!(measured, 0, "used as they are without verification");
    let (verified, measured) = tune_forward(&mut backend, &cache, true);
    assert_eq!(measured, 3, "every unverified size measured again");
    assert_eq!(state(&cache), SizeVerification::Verified);
    assert!(unverified.rejected.is_empty());
    assert_eq!(verified.rejected.len(), 1);
}

/// Spatial chunks are verified chunk by chunk against the reference on the same chunk.
#[test]
fn a_wrong_candidate_on_spatial_chunks_is_rejected() {
    let mut p = ConvProblem::new(1, 4, 16, 10, 4, 3, 3);
    (p.pad_h, p.pad_w) = (1, 1);
    let job = Job {
        layer: "net.conv".into(),
        problem: p,
        op: ConvOp::BackwardData,
        split: SplitDim::Spatial,
    };
    let cache = Cache::in_memory().quiet();
    let mut backend = CpuBackend::new().with_fault(Fault {
        op: ConvOp::BackwardData,
        algo: CpuAlgo::Im2colGemmPerImage.id(),
        size: 4,
        corruption: Corruption::OneElement,
    });
    let (profile, _) =
        profile_jobs(&mut backend, &[job], &run(&cache, true), &mut |_, _| {}).unwrap();
    let entry = &profile.entries[0];
    let rejected: Vec<(i64, Algo)> = entry.rejected.iter().map(|m| (m.micro, m.algo)).collect();
    assert_eq!(
        rejected,
        [(4, Algo::Legacy(CpuAlgo::Im2colGemmPerImage.id()))]
    );
    assert!(entry
        .measurements
        .iter()
        .all(|m| m.verification.is_some_and(|v| v.passed())));
}

/// A zoo layer at a size the debug-built CPU backend measures in milliseconds, with its
/// geometry (kernel, stride, padding, dilation, groups, rank): at most 8 channels per group
/// side, spatial sizes just large enough for a few outputs.
fn small(problem: &ConvProblem) -> ConvProblem {
    let mut p = *problem;
    let groups = p.groups.max(1);
    let (c_per, k_per) = (p.c / groups, p.k / groups);
    if groups == 1 {
        (p.c, p.k) = (p.c.min(8), p.k.min(8));
    } else if c_per == 1 {
        // Depthwise: as many groups as channels.
        p.groups = groups.min(8);
        p.c = p.groups;
        p.k = p.groups * k_per.min(2);
    } else {
        p.groups = groups.min(2);
        p.c = p.groups * c_per.min(4);
        p.k = p.groups * k_per.min(4);
    }
    let fit = |input: i64, filter: i64, pad: i64, stride: i64, dilation: i64| {
        let span = dilation * (filter - 1) + 1;
        input.min((span - 2 * pad).max(1) + 2 * stride)
    };
    p.h = fit(p.h, p.r, p.pad_h, p.stride_h, p.dilation_h);
    p.w = fit(p.w, p.s, p.pad_w, p.stride_w, p.dilation_w);
    if p.is_3d() {
        p.d = fit(p.d, p.t, p.pad_d, p.stride_d, p.dilation_d);
    }
    p.n = 2;
    p
}

/// Every candidate of the CPU backend verifies (no rejection, every output compared) on every
/// distinct layer geometry of every zoo model, in fp32, fp16 and bf16, both layouts, every op.
#[test]
fn the_cpu_candidates_verify_on_every_zoo_model_and_dtype() {
    let mut layers: Vec<(String, ConvProblem)> = Vec::new();
    for model in Model::ALL {
        for layer in model.layers(1, DType::Fp32, Layout::Nchw) {
            let p = small(&layer.problem);
            p.validate()
                .unwrap_or_else(|e| panic!("{}: {e}: {}", layer.name, p.describe()));
            if !layers.iter().any(|(_, q)| *q == p) {
                layers.push((layer.name, p));
            }
        }
    }
    assert!(layers.len() > 20, "{} distinct geometries", layers.len());
    let mut checked = 0;
    for (dtype, layout) in [
        (DType::Fp32, Layout::Nchw),
        (DType::Fp16, Layout::Nhwc),
        (DType::Bf16, Layout::Nchw),
        (DType::Bf16, Layout::Nhwc),
    ] {
        let jobs: Vec<Job> = layers
            .iter()
            .flat_map(|(name, p)| {
                let p = ConvProblem {
                    dtype,
                    layout,
                    ..*p
                };
                ConvOp::ALL.map(|op| Job::batch(name.clone(), p, op))
            })
            .collect();
        let cache = Cache::in_memory().quiet();
        let mut backend = CpuBackend::new();
        let (profile, stats) =
            profile_jobs(&mut backend, &jobs, &run(&cache, true), &mut |_, _| {}).unwrap();
        assert_eq!(stats.rejected, 0);
        for entry in &profile.entries {
            assert!(
                entry.rejected.is_empty(),
                "{} {}: {:?}",
                entry.name(),
                entry.problem.describe(),
                entry.rejected
            );
            assert_eq!(entry.measurements.len(), 2 * CpuAlgo::ALL.len());
            for m in &entry.measurements {
                let v = m
                    .verification
                    .unwrap_or_else(|| panic!("{} {m:?}: not compared", entry.name()));
                assert!(v.passed(), "{} {m:?}", entry.name());
                checked += 1;
            }
        }
    }
    assert!(checked > 1000, "{checked}");
}

/// Long sums stay within their tolerance too (it grows with the square root of their length):
/// a forward and backward-data of 1152 products (128 channels, 3x3) and a backward-filter of
/// 16384 (4 images of 64x64), in every dtype; and the errors they do have are reported.
#[test]
fn long_sums_verify_in_every_dtype() {
    let mut wide = ConvProblem::new(2, 128, 4, 4, 128, 3, 3);
    (wide.pad_h, wide.pad_w) = (1, 1);
    let mut tall = ConvProblem::new(4, 4, 64, 64, 4, 3, 3);
    (tall.pad_h, tall.pad_w) = (1, 1);
    for dtype in [DType::Fp32, DType::Fp16, DType::Bf16] {
        let jobs: Vec<Job> = [(wide, ConvOp::Forward), (wide, ConvOp::BackwardData)]
            .into_iter()
            .chain([(tall, ConvOp::BackwardFilter)])
            .map(|(p, op)| Job::batch("long", ConvProblem { dtype, ..p }, op))
            .collect();
        let cache = Cache::in_memory().quiet();
        let (profile, _) = profile_jobs(
            &mut CpuBackend::new(),
            &jobs,
            &run(&cache, true),
            &mut |_, _| {},
        )
        .unwrap();
        for entry in &profile.entries {
            assert!(
                entry.rejected.is_empty(),
                "{}: {:?}",
                entry.name(),
                entry.rejected
            );
            let worst = entry
                .measurements
                .iter()
                .map(|m| m.verification.expect("compared"))
                .max_by(|a, b| a.max_rel_error.total_cmp(&b.max_rel_error))
                .unwrap();
            assert!(worst.passed(), "{} {worst:?}", entry.name());
        }
    }
}
