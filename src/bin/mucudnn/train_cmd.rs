//! `mucudnn train`: settings -> generated data -> one replica per rank (threads on the CPU)
//! -> the training loop, with per-epoch rows on stdout (or one JSON document) and progress on
//! stderr. Started by `mpirun`/`srun` (a binary built with the `mpi` feature), every process
//! joins the job through MPI and a failing one ends it (`MPI_Abort`).

use crate::{one_of, DeviceChoice};
use anyhow::{Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use mucudnn::device::cpu_fingerprint;
use mucudnn::solver::units::parse_size;
use mucudnn::solver::{AlgoNames, BackendKind, CandidateSet, Policy};
use mucudnn::train::gpu::{select_gpus, visible_gpus, GpuJob, GpuSettings, Precision};
use mucudnn::train::process::mpi_launch_size;
use mucudnn::train::report::{
    render_epoch_header, render_epoch_row, render_header, render_initial, render_plans,
    render_summary, RunInfo, TrainJson,
};
use mucudnn::train::{
    rank_layout, train_group, train_threads, CacheChoice, ConvSettings, CpuReplica, DatasetSpec,
    HostCollective, Hyper, JobAbort, NetSpec, ProcessGroup, SingleProcess, Split, TempCache,
    TrainConfig, TrainError, TrainEvent,
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
    /// Data-parallel ranks in this process, one thread each. CPU: default 1 (under MPI, one
    /// per process). GPU: one rank per GPU, default every visible GPU (under MPI with several
    /// processes on a host, the GPU of this process's rank on the host).
    #[arg(long, value_name = "R")]
    ranks: Option<usize>,
    /// GPU: fp32 (NCHW) or fp16 (NHWC convolutions with fp32 master weights, dynamic loss
    /// scaling). The CPU trainer is fp32.
    #[arg(long, default_value = "fp32", value_parser = one_of::<Precision>(Precision::ALL.map(Precision::name)))]
    dtype: Precision,
    /// fp16: the initial dynamic loss scale, a power of two from 1 to 2^24 (default 65536,
    /// `torch.amp.GradScaler`'s); it halves on every step skipped for a non-finite gradient.
    #[arg(long, value_name = "S")]
    loss_scale: Option<f32>,
    /// Which candidates the conv layers are tuned over: cuDNN's legacy algorithms, its
    /// graph-API engine configurations, or both (the CPU has its own algorithms only).
    #[arg(long, default_value = "all", value_parser = one_of::<CandidateSet>(CandidateSet::ALL.map(CandidateSet::name)))]
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

/// The other processes of an MPI job (`mpirun`/`srun`), or none.
struct Launch {
    #[cfg(feature = "mpi")]
    mpi: Option<mucudnn::train::mpi::Mpi>,
}

impl Launch {
    /// MPI when a launcher started several processes (its environment says so); an error when
    /// this binary cannot join them.
    fn detect() -> Result<Launch> {
        let size = mpi_launch_size(|name| std::env::var(name).ok());
        #[cfg(feature = "mpi")]
        {
            let mpi = match size {
                Some(size) if size > 1 => Some(mucudnn::train::mpi::Mpi::init()?),
                _ => None,
            };
            Ok(Launch { mpi })
        }
        #[cfg(not(feature = "mpi"))]
        {
            if let Some(size) = size.filter(|&size| size > 1) {
                anyhow::bail!(
                    "started by an MPI launcher as one of {size} processes, but this mucudnn \
                     was built without MPI: build with `cargo build --release --features mpi` \
                     (see docs/training.md)"
                );
            }
            Ok(Launch {})
        }
    }

    fn process_rank(&self) -> usize {
        #[cfg(feature = "mpi")]
        if let Some(mpi) = &self.mpi {
            return mpi.rank();
        }
        0
    }

    fn processes(&self) -> usize {
        #[cfg(feature = "mpi")]
        if let Some(mpi) = &self.mpi {
            return mpi.size();
        }
        1
    }

    /// The processes as the host collective sees them.
    fn group(&self) -> Box<dyn ProcessGroup> {
        #[cfg(feature = "mpi")]
        if let Some(mpi) = &self.mpi {
            return Box::new(mpi.processes());
        }
        Box::new(SingleProcess::with_aborter(stop_if_stuck()))
    }

    /// Under MPI with several processes on this host: this process's rank among them.
    fn node_local_rank(&self) -> Option<usize> {
        #[cfg(feature = "mpi")]
        if let Some(mpi) = &self.mpi {
            let (rank, size) = mpi.node_local();
            return (size > 1).then_some(rank);
        }
        None
    }

    /// Ends the job after this process failed (every process of an MPI job); returns in a
    /// single process, whose `main` reports the error.
    fn fail(&self, error: &anyhow::Error) {
        #[cfg(feature = "mpi")]
        if let Some(mpi) = &self.mpi {
            mpi.abort(&format!("{error:#}"));
        }
        let _ = error;
    }
}

/// How long a failed single process waits for its other ranks before it stops itself.
const STUCK_AFTER: std::time::Duration = std::time::Duration::from_secs(10);

/// What a single process does when a rank fails: its thread group is aborted (the other
/// ranks stop at their next host collective), and if some rank is still inside a device
/// collective no host abort reaches (NCCL) after [`STUCK_AFTER`], the process prints the
/// first rank's error and exits with status 1.
fn stop_if_stuck() -> JobAbort {
    std::sync::Arc::new(|rank, reason| {
        let reason = reason.to_string();
        let _ = std::thread::Builder::new()
            .name("train-watchdog".into())
            .spawn(move || {
                std::thread::sleep(STUCK_AFTER);
                eprintln!(
                    "error: training: rank {rank}: {reason} (the other ranks did not stop \
                     within {} s; exiting)",
                    STUCK_AFTER.as_secs()
                );
                std::process::exit(1);
            });
    })
}

/// Where the run trains, decided before anything is generated or tuned.
#[allow(clippy::large_enum_variant)] // one per process
enum Target {
    /// `ranks` threads in this process (one under MPI).
    Cpu { ranks: usize },
    /// This process's GPUs, joined to the job; `device` describes them.
    Gpu { job: GpuJob, device: String },
}

/// `--device`: the CPU, the GPUs (an error saying why when there are none), or for `auto`
/// the GPUs when there are some.
fn choose_target(args: &TrainArgs, launch: &Launch, quiet: bool) -> Result<Target> {
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
        let processes = launch.processes();
        anyhow::ensure!(
            processes == 1 || args.ranks.unwrap_or(1) == 1,
            "--ranks {}: under MPI the CPU trainer runs one rank per process (start more \
             processes instead)",
            args.ranks.unwrap_or(1)
        );
        let ranks = args.ranks.unwrap_or(1);
        anyhow::ensure!(ranks >= 1, "--ranks must be at least 1");
        return Ok(Target::Cpu { ranks });
    };
    let gpus = select_gpus(system.devices.len(), args.ranks, launch.node_local_rank())?;
    let job = if launch.processes() > 1 {
        GpuJob::join(gpus, launch.group()).context("joining the GPU job")?
    } else {
        GpuJob::single_process_with(gpus, SingleProcess::with_aborter(stop_if_stuck()))
            .context("setting up the GPUs")?
    };
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
    if launch.processes() > 1 {
        device.push_str(&format!(
            " in process {} of {}",
            job.process_rank(),
            launch.processes()
        ));
    }
    Ok(Target::Gpu { job, device })
}

pub(crate) fn run(args: &TrainArgs) -> Result<()> {
    let launch = Launch::detect()?;
    let result = run_in(args, &launch);
    if let Err(error) = &result {
        launch.fail(error);
    }
    result
}

fn run_in(args: &TrainArgs, launch: &Launch) -> Result<()> {
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

    let target = choose_target(args, launch, args.quiet)?;
    // In a multi-process job only the process with rank 0 reports.
    let reporting = launch.process_rank() == 0;
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
        Target::Cpu { ranks } => (cpu_fingerprint().to_string(), *ranks * launch.processes()),
        Target::Gpu { job, device } => (device.clone(), job.layout().world_ranks),
    };
    let mut gpu_settings =
        GpuSettings::new(policy, args.workspace_limit, cache.clone(), args.dtype);
    if let Some(scale) = args.loss_scale {
        anyhow::ensure!(
            args.dtype == Precision::Fp16,
            "--loss-scale applies to --dtype fp16 only"
        );
        gpu_settings.loss_scale = scale;
        gpu_settings.validate()?;
    }
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
    let names = AlgoNames::new(match &target {
        Target::Cpu { .. } => BackendKind::Cpu,
        Target::Gpu { .. } => BackendKind::Cuda,
    });
    let report = match target {
        Target::Cpu { ranks } => {
            let mut settings = ConvSettings::new(policy, args.workspace_limit, cache);
            // The CPU has its own algorithms only: `all` means those, `engines` is an error.
            settings.tuning.candidates = args.candidates;
            if launch.processes() > 1 {
                // One rank per process; the ranks meet in the host collective over MPI.
                let mut processes = launch.group();
                let layout = rank_layout(processes.as_mut(), ranks)?;
                let group = HostCollective::group(processes, layout)?
                    .into_iter()
                    .map(|c| Ok((c.try_clone()?, c)))
                    .collect::<Result<Vec<_>, TrainError>>()?;
                train_group(
                    group,
                    |_local, collective| CpuReplica::new(&net, args.seed, &settings, collective),
                    &train,
                    &test,
                    &config,
                    &mut on_event,
                )
            } else {
                train_threads(
                    ranks,
                    |_rank, collective| CpuReplica::new(&net, args.seed, &settings, collective),
                    &train,
                    &test,
                    &config,
                    &mut on_event,
                )
            }
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
            serde_json::to_string_pretty(&TrainJson::new(&info, &report, names))?
        );
    } else if table {
        out!("{}", render_plans(&report.conv_plans, names));
        out!("{}", render_summary(&report));
    }
    Ok(())
}
