//! `mucudnn train`: settings -> generated data -> one replica per rank (threads on the CPU)
//! -> the training loop, with per-epoch rows on stdout (or one JSON document) and progress on
//! stderr.

use crate::DeviceChoice;
use anyhow::{Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use mucudnn::device::cpu_fingerprint;
use mucudnn::solver::units::parse_size;
use mucudnn::solver::{CandidateSet, Policy};
use mucudnn::train::dist::DistFlags;
use mucudnn::train::gpu::{
    select_gpus, visible_gpus, GpuJob, GpuSettings, Precision, RendezvousConfig, JOB_TIMEOUT,
};
use mucudnn::train::report::{
    render_epoch_header, render_epoch_row, render_header, render_initial, render_plans,
    render_summary, RunInfo, TrainJson,
};
use mucudnn::train::{
    train_threads, CacheChoice, ConvSettings, CpuReplica, DatasetSpec, DistConfig, Hyper, NetSpec,
    Split, TempCache, TrainConfig, TrainEvent,
};
use mucudnn::tune::EngineOptions;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Args)]
pub(crate) struct TrainArgs {
    /// Passes over the training set.
    #[arg(long, default_value_t = 5)]
    epochs: usize,
    /// Samples per rank per step, as in PyTorch DDP: the global batch is ranks x N.
    #[arg(long, value_name = "N", default_value_t = 32)]
    batch: usize,
    /// Per-layer workspace limit of the conv layers' plans. Bytes, or with KiB/MiB/GiB.
    #[arg(long, value_name = "SIZE", value_parser = parse_size, default_value = "64MiB")]
    workspace_limit: u64,
    /// Run every conv layer with its best single algorithm for the whole batch (policy
    /// undivided) instead of micro-batched plans, for comparison.
    #[arg(long)]
    no_microbatch: bool,
    /// Where to train: auto takes the GPUs when CUDA, cuDNN and a GPU are present.
    #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
    device: DeviceChoice,
    /// Data-parallel ranks in this process, one thread each. CPU: default 1. GPU: one rank
    /// per GPU, default every visible GPU (under a launcher that sets LOCAL_RANK, that GPU).
    #[arg(long, value_name = "R")]
    ranks: Option<usize>,
    /// GPU: fp32 (NCHW) or fp16 (NHWC convolutions with fp32 master weights, a static loss
    /// scale). The CPU trainer is fp32.
    #[arg(long, default_value = "fp32", value_parser = parse_precision)]
    dtype: Precision,
    /// Which candidates the conv layers are tuned over: cuDNN's legacy algorithms, its
    /// graph-API engine configurations, or both (the CPU has its own algorithms only).
    #[arg(long, default_value = "all", value_parser = parse_candidates)]
    candidates: CandidateSet,
    /// GPU: time at most N engine configurations per (op, micro-batch size) while tuning.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    max_candidates: Option<u64>,
    /// Learning rate.
    #[arg(long, default_value_t = 0.01)]
    lr: f32,
    #[arg(long, default_value_t = 0.9)]
    momentum: f32,
    #[arg(long, default_value_t = 5e-4)]
    weight_decay: f32,
    /// Seeds the data, the initial weights and the shuffle.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Generated training images.
    #[arg(long, value_name = "N", default_value_t = 5000)]
    train_size: usize,
    /// Generated held-out images.
    #[arg(long, value_name = "N", default_value_t = 1000)]
    test_size: usize,
    /// Images are SIZE x SIZE.
    #[arg(long, value_name = "SIZE", default_value_t = 32)]
    image_size: usize,
    /// Image channels.
    #[arg(long, default_value_t = 3)]
    channels: usize,
    /// Classes (2 to 10).
    #[arg(long, default_value_t = 10)]
    classes: usize,
    /// Output channels of each conv block (one block per entry).
    #[arg(
        long,
        value_name = "K,K,...",
        value_delimiter = ',',
        default_value = "16,32"
    )]
    block_channels: Vec<usize>,
    /// Standard deviation of the pixel noise (a patch's peak amplitude is at most 1).
    #[arg(long, default_value_t = 1.0)]
    noise: f32,
    /// After every step, check that every rank's parameters equal rank 0's, bit for bit.
    #[arg(long)]
    check_sync: bool,
    /// The tuning cache file (default: $MUCUDNN_CACHE, else the user's cache directory).
    #[arg(long, value_name = "PATH", conflicts_with = "no_cache")]
    cache: Option<PathBuf>,
    /// Tune everything again and keep nothing (the ranks share a private file for the run).
    #[arg(long)]
    no_cache: bool,
    /// Print one JSON document (see docs/training.md) instead of the table.
    #[arg(long)]
    json: bool,
    /// No progress output.
    #[arg(long)]
    quiet: bool,
    /// Multi-process: this process's rank (else $RANK).
    #[arg(long)]
    rank: Option<usize>,
    /// Multi-process: the number of processes (else $WORLD_SIZE, else 1).
    #[arg(long)]
    world_size: Option<usize>,
    /// Multi-process: rank 0's address for the rendezvous (else $MASTER_ADDR).
    #[arg(long, value_name = "ADDR")]
    master_addr: Option<String>,
    /// Multi-process: rank 0's port for the rendezvous (else $MASTER_PORT, else 29500).
    #[arg(long, value_name = "PORT")]
    master_port: Option<u16>,
}

/// Progress on stderr: a bar per epoch when stderr is a terminal; with `--json` (no rows on
/// stdout) also one line per epoch.
struct Progress {
    bar: Option<ProgressBar>,
    lines: bool,
    quiet: bool,
}

impl Progress {
    fn new(quiet: bool, json: bool) -> Self {
        let terminal = std::io::stderr().is_terminal();
        Progress {
            bar: None,
            lines: !quiet && json,
            quiet: quiet || !terminal,
        }
    }

    fn step(&mut self, epoch: usize, step: usize, steps: usize, loss: f64) {
        if self.quiet {
            return;
        }
        let bar = self.bar.get_or_insert_with(|| {
            let bar = ProgressBar::new(steps as u64);
            if let Ok(style) = ProgressStyle::with_template(
                "epoch {prefix} [{bar:30}] {pos}/{len} steps  {elapsed}, ETA {eta}  {msg}",
            ) {
                bar.set_style(style.progress_chars("=> "));
            }
            bar.set_prefix(epoch.to_string());
            bar
        });
        bar.set_position(step as u64);
        bar.set_message(format!("loss {loss:.3}"));
    }

    fn end_epoch(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
    }
}

fn parse_precision(text: &str) -> Result<Precision, String> {
    text.parse()
}

fn parse_candidates(text: &str) -> Result<CandidateSet, String> {
    text.parse()
}

/// Where the run trains, decided before anything is generated or tuned.
#[allow(clippy::large_enum_variant)] // one per process
enum Target {
    Cpu {
        ranks: usize,
    },
    /// This process's GPUs, joined to the job; `device` describes them.
    Gpu {
        job: GpuJob,
        device: String,
    },
}

/// `--device`: the CPU, the GPUs (an error saying why when there are none), or for `auto`
/// the GPUs when there are some.
fn choose_target(args: &TrainArgs, dist: &DistConfig, quiet: bool) -> Result<Target> {
    let system = match args.device {
        DeviceChoice::Cpu => None,
        DeviceChoice::Cuda => Some(visible_gpus().context(
            "--device cuda: no usable GPU (the GPU trainer needs the CUDA driver, cuDNN 9, cuBLAS \
             and NCCL, and a visible GPU); use --device cpu",
        )?),
        DeviceChoice::Auto => match visible_gpus() {
            Ok(system) => Some(system),
            Err(error) => {
                if !quiet {
                    let text = error.to_string();
                    let short = text.split(": ").next().unwrap_or(&text);
                    eprintln!(
                        "no usable GPU ({short}); training on the CPU (`--device cuda` says why)"
                    );
                }
                None
            }
        },
    };
    let Some(system) = system else {
        anyhow::ensure!(
            args.dtype == Precision::Fp32,
            "--dtype {}: the CPU trainer is fp32 only (fp16 needs --device cuda)",
            args.dtype
        );
        anyhow::ensure!(
            !dist.is_multi_process(),
            "a world of {} processes (--world-size or WORLD_SIZE): the CPU trainer does not \
             span processes; run its ranks as threads of one process with --ranks {}",
            dist.world_size,
            dist.world_size
        );
        let ranks = args.ranks.unwrap_or(1);
        anyhow::ensure!(ranks >= 1, "--ranks must be at least 1");
        return Ok(Target::Cpu { ranks });
    };
    // Under a launcher (torchrun sets LOCAL_RANK) one process drives one GPU.
    let launcher_local_rank = match std::env::var("LOCAL_RANK") {
        Ok(text) if !text.trim().is_empty() => Some(
            text.trim()
                .parse::<usize>()
                .with_context(|| format!("LOCAL_RANK={text:?} is not a GPU index"))?,
        ),
        _ => None,
    };
    let gpus = select_gpus(system.devices.len(), args.ranks, launcher_local_rank)?;
    let rendezvous = RendezvousConfig::new(
        dist.rank,
        dist.world_size,
        dist.master_addr.clone(),
        dist.master_port,
    )
    .map_err(|e| anyhow::anyhow!("{e}"))?
    .with_local_rank(dist.local_rank)
    .with_timeout(JOB_TIMEOUT);
    if !quiet && dist.is_multi_process() {
        eprintln!(
            "process {} of {}: joining the job at {}",
            dist.rank,
            dist.world_size,
            dist.master_endpoint()
        );
    }
    let job = GpuJob::join(gpus, &rendezvous).context("joining the GPU job")?;
    let names: Vec<&str> = job
        .gpus()
        .iter()
        .filter_map(|&g| system.devices.get(g).map(|d| d.name.as_str()))
        .collect();
    let mut device = format!(
        "cuda: {} x{} (cuDNN {}, driver {})",
        names.first().copied().unwrap_or("GPU"),
        names.len(),
        system.cudnn_version_string(),
        system.driver_version_string()
    );
    if names.iter().any(|name| Some(name) != names.first()) {
        device = format!(
            "cuda: {} (cuDNN {})",
            names.join(", "),
            system.cudnn_version_string()
        );
    }
    if dist.is_multi_process() {
        device.push_str(&format!(
            " in process {} of {}",
            job.process_rank(),
            dist.world_size
        ));
    }
    Ok(Target::Gpu { job, device })
}

pub(crate) fn run(args: &TrainArgs) -> Result<()> {
    let dist = DistConfig::from_flags_and_env(&DistFlags {
        rank: args.rank,
        world_size: args.world_size,
        local_rank: None,
        master_addr: args.master_addr.clone(),
        master_port: args.master_port,
    })?;
    anyhow::ensure!(args.batch >= 1, "--batch must be at least 1");
    anyhow::ensure!(args.epochs >= 1, "--epochs must be at least 1");
    anyhow::ensure!(args.train_size >= 1, "--train-size must be at least 1");
    anyhow::ensure!(args.test_size >= 1, "--test-size must be at least 1");
    anyhow::ensure!(args.ranks != Some(0), "--ranks must be at least 1");

    let net = NetSpec {
        in_channels: args.channels,
        image_size: args.image_size,
        classes: args.classes,
        block_channels: args.block_channels.clone(),
    };
    net.validate()
        .context("--channels, --image-size, --classes, --block-channels")?;
    let data = DatasetSpec {
        image_size: args.image_size,
        channels: args.channels,
        classes: args.classes,
        noise: args.noise,
        seed: args.seed,
    };
    data.validate()
        .context("--channels, --image-size, --classes, --noise")?;
    let hyper = Hyper {
        lr: args.lr,
        momentum: args.momentum,
        weight_decay: args.weight_decay,
    };
    hyper
        .validate()
        .context("--lr, --momentum, --weight-decay")?;
    let policy = if args.no_microbatch {
        Policy::Undivided
    } else {
        Policy::PowerOfTwo
    };

    let target = choose_target(args, &dist, args.quiet)?;
    // In a multi-process job only the process with rank 0 reports.
    let reporting = dist.rank == 0;
    let quiet = args.quiet || !reporting;
    let json = args.json && reporting;
    let table = !args.json && reporting;

    // Every conv layer of every rank opens the same cache file; a private one for --no-cache.
    let mut temp = None;
    let cache = match (&args.cache, args.no_cache) {
        (Some(path), _) => CacheChoice::File(path.clone()),
        (None, false) => match CacheChoice::user_default() {
            Some(choice) => choice,
            None => {
                if !quiet {
                    eprintln!("no cache location (set MUCUDNN_CACHE or HOME); tuning into a private file for this run");
                }
                CacheChoice::File(temp.insert(TempCache::new()?).path())
            }
        },
        (None, true) => CacheChoice::File(temp.insert(TempCache::new()?).path()),
    };
    let cache_text = match (&cache, &temp) {
        (_, Some(_)) => "private to this run (removed at the end)".to_string(),
        (CacheChoice::File(path), None) => path.display().to_string(),
        (CacheChoice::Memory, None) => "in memory".to_string(),
    };

    let (device, ranks) = match &target {
        Target::Cpu { ranks } => (cpu_fingerprint().to_string(), *ranks),
        Target::Gpu { job, device } => (device.clone(), job.layout().world_gpus),
    };
    let mut gpu_settings =
        GpuSettings::new(policy, args.workspace_limit, cache.clone(), args.dtype);
    gpu_settings.tuning.candidates = args.candidates;
    gpu_settings.tuning.engines = EngineOptions {
        max_candidates: args.max_candidates.map(|n| n as usize),
        ..EngineOptions::default()
    };
    let precision = match &target {
        Target::Cpu { .. } => Precision::Fp32.describe(gpu_settings.loss_scale),
        Target::Gpu { .. } => args.dtype.describe(gpu_settings.loss_scale),
    };
    let info = RunInfo {
        device,
        ranks,
        batch_per_rank: args.batch,
        global_batch: ranks * args.batch,
        precision,
        policy: policy.name(),
        workspace_limit_bytes: args.workspace_limit,
        cache: cache_text,
        parameters: net.parameter_count(),
        net: net.clone(),
        data,
        train_size: args.train_size,
        test_size: args.test_size,
        hyper,
        seed: args.seed,
    };
    if table {
        out!("{}", render_header(&info));
    }
    if !quiet {
        eprintln!(
            "generating {} + {} images; then tuning the conv layers (rank 0 first)",
            args.train_size, args.test_size
        );
    }
    let train = Arc::new(
        data.generate(Split::Train, args.train_size)
            .context("generating the training set")?,
    );
    let test = Arc::new(
        data.generate(Split::Test, args.test_size)
            .context("generating the held-out set")?,
    );
    let config = TrainConfig {
        epochs: args.epochs,
        batch_per_rank: args.batch,
        hyper,
        seed: args.seed,
        prefetch: 4,
        check_sync: args.check_sync,
    };

    let mut progress = Progress::new(quiet, json);
    let epochs = args.epochs;
    let mut on_event = |event: TrainEvent<'_>| match event {
        TrainEvent::Tuned {
            seconds,
            batch_sizes,
        } => {
            if !quiet {
                eprintln!("tuned in {seconds:.1} s (per-rank batch sizes {batch_sizes:?})");
            }
        }
        TrainEvent::Initial(initial) => {
            if table {
                out!("\n{}{}", render_epoch_header(), render_initial(initial));
                let _ = std::io::stdout().flush();
            }
        }
        TrainEvent::Step {
            epoch,
            step,
            steps,
            loss,
        } => progress.step(epoch, step, steps, loss),
        TrainEvent::Epoch(report) => {
            progress.end_epoch();
            if table {
                out!("{}", render_epoch_row(report));
                let _ = std::io::stdout().flush();
            }
            if progress.lines {
                eprintln!(
                    "epoch {}/{epochs}: train loss {:.4}, held-out accuracy {:.1}%, {:.1} images/s",
                    report.epoch,
                    report.train_loss,
                    100.0 * report.test_accuracy,
                    report.images_per_s
                );
            }
        }
    };
    let report = match target {
        Target::Cpu { ranks } => {
            let mut settings = ConvSettings::new(policy, args.workspace_limit, cache);
            // The CPU has its own algorithms only: `all` means those, `engines` is an error.
            settings.tuning.candidates = args.candidates;
            train_threads(
                ranks,
                |_rank, collective| CpuReplica::new(&net, args.seed, &settings, collective),
                &train,
                &test,
                &config,
                &mut on_event,
            )
        }
        Target::Gpu { job, .. } => job.train(
            &net,
            args.seed,
            &gpu_settings,
            &train,
            &test,
            &config,
            &mut on_event,
        ),
    }
    .context("training")?;
    drop(temp);

    if json {
        outln!(
            "{}",
            serde_json::to_string_pretty(&TrainJson::new(&info, &report))?
        );
    } else if table {
        out!("{}", render_plans(&report.conv_plans));
        out!("{}", render_summary(&report));
    }
    Ok(())
}
