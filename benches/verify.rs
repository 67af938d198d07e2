//! What verified tuning costs on the CPU: tuning the zoo's AlexNet (batch 2) and ResNet-50's
//! distinct layers (batch 1) from an empty cache, every op and CPU algorithm, with and without
//! comparing each candidate's output with the reference candidate's. The goal: verification
//! adds at most 5% to tuning time. Run: `cargo bench --bench verify` (docs/cli.md, "Verified
//! tuning", has the measured numbers).
//!
//! Each sample is one whole tune (`profile_jobs` on a fresh in-memory cache, the CPU's own
//! timing settings), so the cost counted is everything verification adds: keeping the
//! reference's output, one comparison per candidate and size, and the cache rows' extra
//! columns. A tune takes seconds and varies by several percent from run to run on a shared
//! machine, more than verification adds; the second group times the verification work of one
//! tune alone (the same comparisons on output-sized buffers), to set against a tune's time.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, SamplingMode};
use mucudnn::backend::cpu::CpuAlgo;
use mucudnn::backend::cudnn::host::random_values;
use mucudnn::backend::verify::HostReference;
use mucudnn::backend::{CpuBackend, TimingSettings};
use mucudnn::cache::Cache;
use mucudnn::models::Model;
use mucudnn::profiler::Job;
use mucudnn::solver::operand_roles;
use mucudnn::solver::{CandidateSet, DType, IndexLimit, Layout, Policy};
use mucudnn::tune::{jobs_for, profile_jobs, EngineOptions, ProfileRun};
use std::time::Duration;

fn jobs(model: Model, batch: i64) -> Vec<Job> {
    let layers = model.layers(batch, DType::Fp32, Layout::Nchw);
    jobs_for(layers.into_iter().map(|l| (l.name, l.problem)))
}

/// One tune of `jobs` from an empty cache; the number of candidate outputs compared.
fn tune(jobs: &[Job], verify: bool) -> usize {
    let cache = Cache::in_memory().quiet();
    let run = ProfileRun {
        policy: Policy::PowerOfTwo,
        timing: TimingSettings::CPU,
        cache: &cache,
        interrupt: None,
        candidates: CandidateSet::All,
        engines: EngineOptions::default(),
        workspace_limit_bytes: None,
        index_limit: IndexLimit::CUDNN,
        verify,
    };
    let mut backend = CpuBackend::new();
    let (_, stats) = profile_jobs(&mut backend, jobs, &run, &mut |_, _| {}).expect("the tune");
    assert_eq!(stats.verified > 0, verify);
    stats.verified
}

fn verified_tuning(c: &mut Criterion) {
    let mut group = c.benchmark_group("tune from an empty cache (CPU)");
    // Each sample is one tune of seconds: ten samples of one iteration each.
    group
        .sampling_mode(SamplingMode::Flat)
        .sample_size(10)
        .warm_up_time(Duration::from_millis(1))
        .measurement_time(Duration::from_secs(1));
    for (name, jobs) in [
        ("alexnet batch 2", jobs(Model::AlexNet, 2)),
        ("resnet50 layers batch 1", jobs(Model::ResNet50, 1)),
    ] {
        for verify in [false, true] {
            let label = if verify { "verified" } else { "unverified" };
            group.bench_with_input(BenchmarkId::new(name, label), &jobs, |b, jobs| {
                b.iter(|| tune(jobs, verify))
            });
        }
    }
    group.finish();
}

/// The verification work of one tune of `jobs`, alone: per (op, size), the reference's output
/// kept ([`HostReference::new`]) and the CPU's two other candidates' outputs compared with it,
/// on output-sized buffers (the backend's `Check` does exactly this).
fn verification_work(jobs: &[Job], reference: &[f32], out: &[f32]) -> f64 {
    let mut sum = 0.0;
    for job in jobs {
        for size in job
            .sizes(Policy::PowerOfTwo, IndexLimit::CUDNN)
            .expect("the zoo's layers fit 32-bit indexing")
        {
            let [_, _, role] = operand_roles(job.op);
            let samples = if role.is_batched() { size } else { 1 };
            let len = role.elements_per_sample(&job.problem) * samples as usize;
            let kept = HostReference::new(&reference[..len]).expect("finite");
            for _ in 1..CpuAlgo::ALL.len() {
                sum += kept.relative_error(&out[..len]);
            }
        }
    }
    sum
}

fn verification_alone(c: &mut Criterion) {
    let mut group = c.benchmark_group("verification work of one tune, alone (CPU)");
    group.sample_size(10);
    for (name, jobs) in [
        ("alexnet batch 2", jobs(Model::AlexNet, 2)),
        ("resnet50 layers batch 1", jobs(Model::ResNet50, 1)),
    ] {
        let largest = jobs
            .iter()
            .map(|job| {
                let [_, _, role] = operand_roles(job.op);
                let samples = if role.is_batched() { job.problem.n } else { 1 };
                role.elements_per_sample(&job.problem) * samples as usize
            })
            .max()
            .unwrap();
        let reference = random_values(DType::Fp32, largest, 1);
        let out: Vec<f32> = reference.iter().map(|v| v * (1.0 + 1e-7)).collect();
        group.bench_function(name, |b| {
            b.iter(|| verification_work(&jobs, &reference, &out))
        });
    }
    group.finish();
}

criterion_group!(benches, verified_tuning, verification_alone);
criterion_main!(benches);
