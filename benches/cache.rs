//! The warm path of `mucudnn tune`: a 50-layer network whose every measurement is cached
//! (3 ops x 9 micro-batch sizes x 8 algorithms each, in an SQLite file), looked up through
//! the cache and solved. Run: `cargo bench --bench cache`.

use criterion::{criterion_group, criterion_main, Criterion};
use mucudnn::backend::{Backend, BackendError, MeasureSettings, Measured, TimingSettings};
use mucudnn::cache::Cache;
use mucudnn::solver::synthetic::{random_entry, Rng};
use mucudnn::solver::{
    solve_profile, ConvOp, ConvProblem, DeviceFingerprint, Measurement, Mode, Policy, WdOptions,
};
use mucudnn::solver::{AlgoKind, CandidateSet, MeasureKey, SizeVerification};
use mucudnn::tune::{jobs_for, profile_jobs, EngineOptions, ProfileRun};

/// A backend that must never be asked to measure: everything is cached.
struct NoMeasuring(DeviceFingerprint);

impl Backend for NoMeasuring {
    fn fingerprint(&self) -> &DeviceFingerprint {
        &self.0
    }
    fn measure(&mut self, _: &MeasureKey, _: &MeasureSettings) -> Result<Measured, BackendError> {
        Err(BackendError::Invalid(
            "the warm path measured something".into(),
        ))
    }
}

fn warm_tune(c: &mut Criterion) {
    let dir = std::env::temp_dir().join(format!("mucudnn-bench-cache-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("cache.sqlite");
    let _ = std::fs::remove_file(&path);
    let cache = Cache::open(&path).expect("a fresh cache file");
    let device = mucudnn::device::cpu_fingerprint();
    let mut rng = Rng(7);
    let layers: Vec<(String, ConvProblem)> = (0..50)
        .map(|i| {
            (
                format!("net.conv{i}"),
                ConvProblem {
                    pad_h: 1,
                    pad_w: 1,
                    ..ConvProblem::new(256, 16 + i, 28, 28, 64, 3, 3)
                },
            )
        })
        .collect();
    for (name, problem) in &layers {
        for op in ConvOp::ALL {
            let entry = random_entry(&mut rng, 256, 8, Policy::PowerOfTwo);
            for micro in Policy::PowerOfTwo.sizes(256) {
                let at: Vec<Measurement> = entry
                    .measurements
                    .iter()
                    .filter(|m| m.micro == micro)
                    .copied()
                    .collect();
                // As a verifying tune stores them.
                let measured = Measured {
                    measurements: at,
                    verification: SizeVerification::Verified,
                    ..Measured::default()
                };
                cache.store_size(
                    &device,
                    name,
                    &MeasureKey::batch(*problem, op, micro, AlgoKind::Legacy),
                    &measured,
                );
            }
        }
    }
    let jobs = jobs_for(layers.clone());
    let run = ProfileRun {
        policy: Policy::PowerOfTwo,
        timing: TimingSettings::CPU,
        cache: &cache,
        interrupt: None,
        candidates: CandidateSet::All,
        engines: EngineOptions::default(),
        workspace_limit_bytes: None,
        index_limit: mucudnn::solver::IndexLimit::CUDNN,
        verify: true,
    };
    let mut backend = NoMeasuring(device);
    let mode = Mode::WorkspaceReuse {
        workspace_limit_bytes: 64 << 20,
    };
    c.bench_function(
        "warm tune: 50 layers x 3 ops, cached lookup + WR solve",
        |b| {
            b.iter(|| {
                let (profile, stats) =
                    profile_jobs(&mut backend, &jobs, &run, &mut |_, _| {}).unwrap();
                assert_eq!(stats.measured, 0);
                solve_profile(&profile, Policy::PowerOfTwo, mode, &WdOptions::default()).unwrap()
            })
        },
    );
    drop(cache);
    std::fs::remove_dir_all(dir).ok();
}

criterion_group!(benches, warm_tune);
criterion_main!(benches);
