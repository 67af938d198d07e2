//! Issue 7, the GPU half: the GPU replica in the common training loop. Every test needs a GPU
//! and is `#[ignore]`d; the GPU acceptance (`scripts/gpu/accept.sh`) runs them with
//! `--include-ignored`.
//!
//! World size 1 over NCCL (the all-reduce is still called): a few epochs of fp32 and of fp16
//! training make the loss fall and the held-out accuracy rise far above chance, with the sync
//! check on and two batch sizes (the held-out split ends in a partial batch); the GPU
//! replica's first-step loss and its parameters after one step match the CPU replica's
//! (fp32, FMA math: no TF32); an empty batch updates nothing; bad batches are errors.

use mucudnn::solver::{CandidateSet, MathMode, Policy};
use mucudnn::train::gpu::*;
use mucudnn::train::{
    CacheChoice, ConvSettings, CpuReplica, Dataset, DatasetSpec, Hyper, NetSpec, Replica, Split,
    TempCache, ThreadCollective, TrainConfig, TrainError, TrainEvent, TrainReport,
};
use std::sync::{Arc, OnceLock};

/// The CI network of the CPU tests with three input channels (fp16 NHWC convolutions of a
/// single channel are a corner of cuDNN's support): 3x16x16 -> conv 8 -> conv 16 -> linear
/// 10. On the CPU replica this configuration (seed 0, 4 epochs of batch 16) goes from 10.5%
/// to 90% held-out accuracy, its training loss from 2.30 to 0.33.
fn net() -> NetSpec {
    NetSpec {
        in_channels: 3,
        image_size: 16,
        classes: 10,
        block_channels: vec![8, 16],
    }
}

fn data(split: Split, len: usize) -> Arc<Dataset> {
    let spec = DatasetSpec {
        image_size: 16,
        channels: 3,
        classes: 10,
        noise: 0.3,
        seed: 0,
    };
    Arc::new(spec.generate(split, len).unwrap())
}

fn hyper() -> Hyper {
    Hyper {
        lr: 0.05,
        momentum: 0.9,
        weight_decay: 5e-4,
    }
}

/// One tuning cache for every test of this binary (they run one after another), so each
/// (precision, math) is tuned once: a file in the temporary directory, left there.
fn shared_cache() -> CacheChoice {
    static CACHE: OnceLock<TempCache> = OnceLock::new();
    CACHE
        .get_or_init(|| TempCache::new().expect("a temporary cache"))
        .choice()
}

/// Legacy algorithms and engine configurations, at most 8 configurations per (op, size) to
/// keep tuning short.
fn settings(precision: Precision) -> GpuSettings {
    let mut settings = GpuSettings::new(Policy::PowerOfTwo, 64 << 20, shared_cache(), precision);
    settings.tuning.engines.max_candidates = Some(8);
    settings
}

/// Trains `epochs` epochs on GPU 0 with world size 1, through NCCL and the common loop.
fn train_on_gpu(precision: Precision, epochs: usize) -> TrainReport {
    let job = GpuJob::single_process(vec![0]).expect("join a one-GPU job");
    assert_eq!(job.layout().world_ranks, 1);
    let config = TrainConfig {
        epochs,
        batch_per_rank: 16,
        hyper: hyper(),
        seed: 0,
        prefetch: 2,
        check_sync: true,
    };
    let mut losses = Vec::new();
    let report = job
        .train(
            &net(),
            0,
            &settings(precision),
            &data(Split::Train, 400),
            &data(Split::Test, 200),
            &config,
            &mut |event| {
                if let TrainEvent::Epoch(epoch) = event {
                    losses.push(epoch.train_loss);
                }
            },
        )
        .unwrap_or_else(|e| panic!("{precision} training: {e}"));
    println!("{precision}: training losses {losses:?}");
    for epoch in &report.epochs {
        println!(
            "{precision} epoch {}: train loss {:.4}, held-out accuracy {:.3}, {:.0} images/s, \
             {:.3} ms/step, conv share {:.2}",
            epoch.epoch,
            epoch.train_loss,
            epoch.test_accuracy,
            epoch.images_per_s,
            epoch.ms_per_step,
            epoch.conv_share
        );
    }
    report
}

/// Loss falls, held-out accuracy ends far above chance (10%), statistics are sane.
fn check_learning(precision: Precision, report: &TrainReport, min_accuracy: f64) {
    let losses: Vec<f64> = report.epochs.iter().map(|e| e.train_loss).collect();
    let accuracy: Vec<f64> = report.epochs.iter().map(|e| e.test_accuracy).collect();
    assert!(report.initial.accuracy < 0.25, "{:?}", report.initial);
    assert!(
        losses.iter().all(|l| l.is_finite()) && *losses.last().unwrap() < 0.5 * losses[0],
        "{precision}: training loss did not fall: {losses:?}"
    );
    assert!(
        *accuracy.last().unwrap() > min_accuracy,
        "{precision}: held-out accuracy {accuracy:?}"
    );
    assert_eq!(report.initial.samples, 200);
    // Training: 400 / 16 = 25 batches of 16; held-out: 12 of 16 and one of 8.
    assert_eq!(report.tuned_batch_sizes, [8, 16]);
    for epoch in &report.epochs {
        assert_eq!(epoch.steps, 25);
        assert_eq!(epoch.train_samples, 400);
        assert!(epoch.images_per_s > 0.0 && epoch.ms_per_step > 0.0);
        assert!(
            epoch.conv_share > 0.0 && epoch.conv_share < 1.0,
            "{epoch:?}"
        );
    }
    assert_eq!(report.parameters.len(), net().parameter_count());
    assert!(report.parameters.iter().all(|p| p.is_finite()));
    // Two layers x three ops, for the largest per-rank batch.
    assert_eq!(report.conv_plans.len(), 6);
    assert!(report.conv_plans.iter().all(|p| p.batch() == 16));
}

#[test]
#[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
fn gpu_fp32_world_one_loss_falls_and_accuracy_rises() {
    let report = train_on_gpu(Precision::Fp32, 4);
    check_learning(Precision::Fp32, &report, 0.6);
}

#[test]
#[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
fn gpu_fp16_world_one_loss_falls_and_accuracy_rises() {
    let report = train_on_gpu(Precision::Fp16, 4);
    check_learning(Precision::Fp16, &report, 0.5);
}

/// A GPU replica on GPU 0 with world size 1 over NCCL.
fn gpu_replica(settings: &GpuSettings, seed: u64) -> GpuReplica<ThreadCollective> {
    let id = NcclUniqueId::new().expect("NCCL unique id");
    let comm = NcclComm::init_rank(1, 0, &id, 0).expect("NCCL world of one");
    let ops = GpuOps::with_stream(comm.stream().clone()).expect("GPU ops");
    let collective = ThreadCollective::group(1).unwrap().remove(0);
    GpuReplica::new(&net(), seed, settings, ops, comm, collective).expect("GPU replica")
}

/// `||a - b|| / ||b||`.
fn relative_distance(a: &[f32], b: &[f32]) -> f64 {
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (&x, &y) in a.iter().zip(b) {
        diff += (f64::from(x) - f64::from(y)).powi(2);
        norm += f64::from(y).powi(2);
    }
    (diff / norm.max(f64::MIN_POSITIVE)).sqrt()
}

#[test]
#[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
fn gpu_first_step_matches_the_cpu_replica() {
    let seed = 3;
    // One batch: a generated set of 16 images.
    let batch = data(Split::Train, 16);
    let (images, labels) = (batch.images.clone(), batch.labels.clone());
    // fp32 with FMA math: no TF32 in the convolutions (cuBLAS Sgemm does not use TF32 by
    // default), so the GPU computes what the CPU does up to summation order.
    let mut gpu_settings = settings(Precision::Fp32);
    gpu_settings.math = MathMode::Fma;
    gpu_settings.tuning.candidates = CandidateSet::Legacy;
    let mut gpu = gpu_replica(&gpu_settings, seed);
    let cpu_settings = ConvSettings::new(Policy::PowerOfTwo, 64 << 20, CacheChoice::Memory);
    let mut cpu = CpuReplica::new(
        &net(),
        seed,
        &cpu_settings,
        ThreadCollective::group(1).unwrap().remove(0),
    )
    .unwrap();

    let before = gpu.parameters().unwrap();
    assert_eq!(
        before,
        cpu.parameters().unwrap(),
        "identical initial weights"
    );
    gpu.prepare(&[16]).unwrap();
    assert_eq!(gpu.conv_plans(16).len(), 6);

    let gpu_eval = gpu.evaluate(&images, &labels).unwrap();
    let cpu_eval = cpu.evaluate(&images, &labels).unwrap();
    println!(
        "evaluate: GPU loss sum {:.6} ({} correct), CPU {:.6} ({} correct)",
        gpu_eval.loss_sum, gpu_eval.correct, cpu_eval.loss_sum, cpu_eval.correct
    );
    assert!(
        (gpu_eval.loss_sum - cpu_eval.loss_sum).abs() <= 1e-4 * cpu_eval.loss_sum.abs(),
        "{gpu_eval:?} vs {cpu_eval:?}"
    );
    assert_eq!(gpu_eval.samples, 16);

    let gpu_step = gpu.train_step(&images, &labels, &hyper()).unwrap();
    let cpu_step = cpu.train_step(&images, &labels, &hyper()).unwrap();
    assert!(
        (gpu_step.loss_sum - cpu_step.loss_sum).abs() <= 1e-4 * cpu_step.loss_sum.abs(),
        "first-step loss: {gpu_step:?} vs {cpu_step:?}"
    );
    assert!(
        gpu_step.conv_ms > 0.0 && gpu_step.step_ms >= gpu_step.conv_ms,
        "{gpu_step:?}"
    );
    let gpu_after = gpu.parameters().unwrap();
    let cpu_after = cpu.parameters().unwrap();
    let delta =
        |after: &[f32]| -> Vec<f32> { after.iter().zip(&before).map(|(a, b)| a - b).collect() };
    let (gpu_update, cpu_update) = (delta(&gpu_after), delta(&cpu_after));
    let update_error = relative_distance(&gpu_update, &cpu_update);
    let mut worst = 0.0f32;
    for (g, c) in gpu_after.iter().zip(&cpu_after) {
        worst = worst.max((g - c).abs() / (1e-3 + c.abs()));
    }
    println!(
        "after one step: update differs by {update_error:.2e} (relative norm), parameters by \
         {worst:.2e} at most (relative)"
    );
    assert!(update_error < 1e-3, "update error {update_error}");
    assert!(worst < 1e-3, "parameter error {worst}");

    // An empty batch (a rank's share of a short last batch): no samples anywhere, no update.
    let empty = gpu.train_step(&[], &[], &hyper()).unwrap();
    assert_eq!((empty.samples, empty.correct, empty.loss_sum), (0, 0, 0.0));
    let unchanged = gpu.parameters().unwrap();
    assert!(unchanged
        .iter()
        .zip(&gpu_after)
        .all(|(a, b)| a.to_bits() == b.to_bits()));

    // A batch that does not fit the network is an error value.
    assert!(matches!(
        gpu.train_step(&images[1..], &labels, &hyper()),
        Err(TrainError::Batch(_))
    ));
}

#[test]
#[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
fn gpu_fp16_first_step_is_close_to_fp32() {
    let b = data(Split::Train, 16);
    let mut losses = Vec::new();
    let mut updates = Vec::new();
    for precision in Precision::ALL {
        let mut replica = gpu_replica(&settings(precision), 5);
        replica.prepare(&[16]).unwrap();
        let before = replica.parameters().unwrap();
        let step = replica.train_step(&b.images, &b.labels, &hyper()).unwrap();
        let after = replica.parameters().unwrap();
        losses.push(step.loss_sum);
        updates.push(
            after
                .iter()
                .zip(&before)
                .map(|(a, w)| a - w)
                .collect::<Vec<f32>>(),
        );
    }
    let update_error = relative_distance(&updates[1], &updates[0]);
    println!(
        "fp16 vs fp32: first-step loss sums {:?}, update differs by {update_error:.2e}",
        losses
    );
    assert!(
        (losses[1] - losses[0]).abs() < 1e-2 * losses[0].abs(),
        "{losses:?}"
    );
    assert!(update_error < 5e-2, "update error {update_error}");
}
