//! `mucudnn tune`: model -> jobs -> profile (through the cache, with progress and Ctrl-C) ->
//! solve -> print, then optionally execute the plans to verify them.

use crate::{one_of, open_device, solve_and_print, Device, DeviceChoice, SolveSettings};
use anyhow::{Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use mucudnn::backend::CudnnBackend;
use mucudnn::backend::TimingSettings;
use mucudnn::cache::Cache;
use mucudnn::device::BackendKind;
use mucudnn::exec::verify::{measure_solution, time_plan_cpu, time_plan_cuda};
use mucudnn::models::{multiplicities, Model, ModelLayer, ModelSize};
use mucudnn::network::read_network;
use mucudnn::profiler::prune::DEFAULT_MARGIN;
use mucudnn::profiler::Job;
use mucudnn::profiler::Progress;
use mucudnn::report::{
    candidates_json, layer_list_json, render_layer_list, render_rejected, render_verification,
    verification_json, SolutionJson, TuneJson, TuningJson, VerificationJson, VerifiedCounts,
};
use mucudnn::report_files::{write_report, ReportInput};
use mucudnn::solver::CandidateSet;
use mucudnn::solver::{interchange, DType, Layout, Mode, Plan, Solution};
use mucudnn::solver::{IndexLimit, Profile, SplitDim};
use mucudnn::tune::{
    jobs_for, profile_jobs, profile_jobs_parallel, EngineOptions, ProfileRun, SplitSetting,
};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Which conv layers: a zoo model or a network file, at a batch size, dtype and layout.
#[derive(Args)]
pub(crate) struct LayerSource {
    /// A network from the zoo: alexnet, resnet18, resnet50, vgg16, densenet121, mobilenet_v2,
    /// deepbench, sdxl_vae_decoder (2-D); r3d_18, wan21_vae_decoder (3-D); wav2vec2_fe (1-D).
    #[arg(long, value_parser = one_of::<Model>(Model::ALL.map(Model::name)), conflicts_with = "network")]
    model: Option<Model>,
    /// The input of a sized zoo model: r3d_18's clip DxHxW (16x112x112),
    /// wan21_vae_decoder's video FRAMESxHxW (17x480x832), sdxl_vae_decoder's image HxW
    /// (2048x2048), wav2vec2_fe's SAMPLES (16000).
    #[arg(long, value_name = "DIMS", value_parser = parse_dims, conflicts_with = "network", allow_hyphen_values = true)]
    input: Option<InputDims>,
    /// Divide the channels inside a sized zoo model by N (a quick, small run of the same
    /// structure; N divides the base width: 64 for r3d_18, 96 for wan21_vae_decoder, 128 for
    /// sdxl_vae_decoder, 512 for wav2vec2_fe).
    #[arg(
        long,
        value_name = "N",
        default_value_t = 1,
        conflicts_with = "network",
        allow_hyphen_values = true
    )]
    channel_divisor: i64,
    /// A network file: a TOML list of conv layers (docs/NETWORK_FORMAT.md).
    #[arg(long, value_name = "FILE.toml")]
    network: Option<PathBuf>,
    /// Mini-batch size (not used by deepbench, whose entries fix their own).
    #[arg(long, value_name = "N", allow_hyphen_values = true)]
    batch: Option<i64>,
    /// Element type of activations and filters.
    #[arg(long, default_value = "fp32", value_parser = one_of::<DType>(DType::NAMES.iter().copied()))]
    pub(crate) dtype: DType,
    /// Memory layout of activations and filters: channels first (nchw; ncdhw and ncw are its
    /// 3-D and 1-D names) or last (nhwc; ndhwc, nwc).
    #[arg(long, default_value = "nchw", value_parser = one_of::<Layout>(Layout::ALL_NAMES.iter().copied()))]
    pub(crate) layout: Layout,
}

/// `--input`'s sizes (one value to clap, which would read a bare `Vec` as many).
#[derive(Clone, Debug)]
pub(crate) struct InputDims(Vec<i64>);

/// `16x112x112`, `17x480x832`, `16000`: sizes separated by `x`. Whether they are positive and
/// as many as the model's input is the model's check, whose message shows that model's form
/// and default (this parser does not know the model).
fn parse_dims(text: &str) -> Result<InputDims, String> {
    text.split(['x', 'X'])
        .map(|part| {
            part.trim().parse::<i64>().map_err(|_| {
                format!(
                    "`{text}`: expected sizes separated by `x` (16x112x112 for r3d_18, 16000 \
                     for wav2vec2_fe)"
                )
            })
        })
        .collect::<Result<Vec<i64>, String>>()
        .map(InputDims)
}

impl LayerSource {
    /// The network's name and its distinct layers (with multiplicity), validated.
    pub fn layers(&self) -> Result<(String, Vec<ModelLayer>)> {
        let batch = |what: &str| -> Result<i64> {
            let batch = self
                .batch
                .with_context(|| format!("--batch is required for {what}"))?;
            anyhow::ensure!(batch >= 1, "--batch must be at least 1, got {batch}");
            Ok(batch)
        };
        let size = ModelSize {
            input: self.input.as_ref().map(|dims| dims.0.clone()),
            channel_divisor: self.channel_divisor,
        };
        let (name, layers) = match (&self.model, &self.network) {
            (Some(model), None) if model.fixed_batch() => {
                if self.batch.is_some() {
                    eprintln!("note: {model} fixes each layer's batch size; --batch is ignored");
                }
                (
                    model.to_string(),
                    model.layers_sized(1, self.dtype, self.layout, &size)?,
                )
            }
            (Some(model), None) => (
                model.to_string(),
                model.layers_sized(batch(model.name())?, self.dtype, self.layout, &size)?,
            ),
            (None, Some(path)) => {
                let network =
                    read_network(path, batch("a network file")?, self.dtype, self.layout)?;
                (
                    network
                        .name
                        .clone()
                        .unwrap_or_else(|| path.display().to_string()),
                    network.layers,
                )
            }
            _ => anyhow::bail!("give --model NAME or --network FILE.toml"),
        };
        for layer in &layers {
            layer
                .problem
                .validate()
                .with_context(|| layer.name.clone())?;
        }
        Ok((name, layers))
    }
}

#[derive(Args)]
pub(crate) struct TuneArgs {
    #[command(flatten)]
    source: LayerSource,
    #[command(flatten)]
    device: DeviceArgs,
    /// Print the network's distinct layers (name, count, shape; as JSON with --json) and
    /// exit: nothing is measured, no device or cache is opened.
    #[arg(long)]
    list: bool,
    /// Write the measurements in interchange format (for `mucudnn solve`).
    #[arg(long, value_name = "FILE")]
    save_profile: Option<PathBuf>,
    /// Write report.md and SVG plots (Pareto front per layer, speedups) into DIR.
    #[arg(long, value_name = "DIR")]
    report: Option<PathBuf>,
    /// After solving, execute every plan and its undivided baseline end to end and report
    /// measured times next to the predicted ones. (Checking each candidate's output against
    /// the reference while measuring is on by default; --no-verify turns that off.)
    #[arg(long)]
    verify: bool,
    /// No progress output.
    #[arg(long)]
    quiet: bool,
    /// Which dimension plans split: the batch (micro-batches), the outermost spatial dimension
    /// of each convolution's output (chunks along d, h or w), or auto: the batch, and also
    /// chunks for a layer of batch at most 4 whose batch sizes skipped a candidate for its
    /// workspace (the faster plan is kept).
    #[arg(long, default_value = "auto", value_parser = one_of::<SplitSetting>(SplitSetting::ALL.map(SplitSetting::name)))]
    split: SplitSetting,
    #[command(flatten)]
    settings: SolveSettings,
}

/// Where to measure and which cache to use.
#[derive(Args)]
pub(crate) struct DeviceArgs {
    /// Where to measure.
    #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
    device: DeviceChoice,
    /// The tuning cache file (default: $MUCUDNN_CACHE, else the user's cache directory).
    #[arg(long, value_name = "PATH", conflicts_with = "no_cache")]
    cache: Option<PathBuf>,
    /// Measure everything again and keep nothing.
    #[arg(long)]
    no_cache: bool,
    /// Which candidates to time: cuDNN's legacy algorithms, its graph-API engine
    /// configurations, or both (the solver takes the best of either). The CPU has legacy
    /// algorithms only.
    #[arg(long, default_value = "all", value_parser = one_of::<CandidateSet>(CandidateSet::ALL.map(CandidateSet::name)))]
    candidates: CandidateSet,
    /// Time at most N engine configurations per (op, micro-batch size), in cuDNN's
    /// heuristics order (default: every one found).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    max_candidates: Option<u64>,
    /// Stop timing an engine configuration at larger micro-batch sizes once a candidate
    /// needing no more workspace is faster by more than this factor.
    #[arg(long, value_name = "FACTOR", default_value_t = DEFAULT_MARGIN, value_parser = parse_margin, conflicts_with = "no_prune")]
    prune_margin: f64,
    /// Time every engine configuration at every size.
    #[arg(long)]
    no_prune: bool,
    /// Do not compare each candidate's output with the reference candidate's while measuring
    /// (saves one comparison per candidate and size). By default a candidate that computes
    /// wrong numbers is rejected, never planned; candidates already rejected stay rejected.
    #[arg(long)]
    no_verify: bool,
}

impl DeviceArgs {
    pub fn open(&self, quiet: bool) -> Result<(Device, Cache, TimingSettings)> {
        self.open_checked(quiet, |_| Ok(()))
    }

    /// Opens the device, runs `check` on it, and only then opens (perhaps creates) the cache.
    pub fn open_checked(
        &self,
        quiet: bool,
        check: impl FnOnce(&mut Device) -> Result<()>,
    ) -> Result<(Device, Cache, TimingSettings)> {
        let mut device = open_device(self.device, quiet)?;
        check(&mut device)?;
        let timing = match device.backend().fingerprint().backend {
            BackendKind::Cuda => TimingSettings::GPU,
            BackendKind::Cpu => TimingSettings::CPU,
        };
        let cache = if self.no_cache {
            Cache::in_memory()
        } else {
            Cache::open_default(self.cache.as_deref())?
        };
        Ok((device, cache, timing))
    }

    /// Whether measuring verifies candidates' outputs (not `--no-verify`).
    pub fn verify(&self) -> bool {
        !self.no_verify
    }

    /// The candidate set and the engine search bounds.
    pub fn candidates(&self) -> (CandidateSet, EngineOptions) {
        (
            self.candidates,
            EngineOptions {
                max_candidates: self.max_candidates.map(|n| n as usize),
                prune_margin: (!self.no_prune).then_some(self.prune_margin),
                deterministic: false,
            },
        )
    }
}

/// The largest workspace a plan of this run may use: the per-layer limit, or the total budget.
/// Measuring times nothing that needs more.
fn measuring_limit(settings: &SolveSettings) -> u64 {
    match settings.mode() {
        Mode::WorkspaceReuse {
            workspace_limit_bytes,
        } => workspace_limit_bytes,
        Mode::WorkspaceDivision {
            total_workspace_bytes,
        } => total_workspace_bytes,
    }
}

fn parse_margin(text: &str) -> Result<f64, String> {
    let margin: f64 = text
        .parse()
        .map_err(|_| format!("`{text}` is not a number"))?;
    if margin.is_finite() && margin >= 1.0 {
        Ok(margin)
    } else {
        Err(format!(
            "the margin must be a finite number >= 1, got {text}"
        ))
    }
}

/// Shows progress: a bar with ETA on a terminal, one line per (layer, op) otherwise.
struct Reporter {
    bar: Option<ProgressBar>,
    lines: bool,
    started: Instant,
    done: u64,
    total: u64,
}

impl Reporter {
    fn new(total: u64, quiet: bool) -> Self {
        let terminal = std::io::stderr().is_terminal();
        let bar = (!quiet && terminal).then(|| {
            let bar = ProgressBar::new(total);
            let style = ProgressStyle::with_template(
                "{spinner} [{bar:30}] {pos}/{len} sizes  {elapsed} elapsed, ETA {eta}  {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> ");
            bar.set_style(style);
            bar
        });
        Reporter {
            bar,
            lines: !quiet && !terminal,
            started: Instant::now(),
            done: 0,
            total,
        }
    }

    fn step(&mut self, layer: &str, op: &str, finished_job: bool, from_cache: bool) {
        self.done += 1;
        if let Some(bar) = &self.bar {
            bar.set_message(format!(
                "{layer} {op}{}",
                if from_cache { " (cached)" } else { "" }
            ));
            bar.inc(1);
        }
        if self.lines && finished_job {
            eprintln!(
                "[{:>4}/{}] {layer} {op} done ({:.1} s)",
                self.done,
                self.total,
                self.started.elapsed().as_secs_f64()
            );
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

/// Refuses, before anything is measured, what would fail only after profiling:
/// candidates the backend does not have, and verifying plans it cannot execute.
fn check_before_measuring(args: &TuneArgs, device: &mut Device) -> Result<()> {
    args.settings.wd_options()?;
    let offered = device.backend().kinds();
    let backend = device.backend().fingerprint().backend;
    anyhow::ensure!(
        args.device
            .candidates
            .kinds()
            .iter()
            .any(|kind| offered.contains(kind)),
        "--candidates {}: the {backend} backend has no graph-API engine configurations (it offers {} candidates); nothing was measured",
        args.device.candidates,
        offered
            .iter()
            .map(|kind| kind.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    if args.verify && matches!(device, Device::Cpu(_)) {
        anyhow::ensure!(
            args.source.dtype == DType::Fp32,
            "--verify: the CPU executor runs fp32 only, not {}; nothing was measured",
            args.source.dtype
        );
    }
    // The output paths too: a tune of hours used to fail only at the end, writing them.
    if let Some(path) = &args.save_profile {
        check_writable_file(path).map_err(|e| {
            anyhow::anyhow!(
                "--save-profile {}: {e:#}; nothing was measured",
                path.display()
            )
        })?;
    }
    if let Some(dir) = &args.report {
        // The report's own folders, made now (the report makes them anyway).
        std::fs::create_dir_all(dir.join("pareto")).map_err(|e| {
            anyhow::anyhow!(
                "--report {}: cannot make the report folder: {e}; nothing was measured",
                dir.display()
            )
        })?;
    }
    Ok(())
}

/// Whether `path` can be written as a file, without changing what is there: an existing file
/// is opened for writing (not truncated); a new one is made and removed again.
fn check_writable_file(path: &std::path::Path) -> Result<()> {
    use std::fs::OpenOptions;
    if path.is_dir() {
        anyhow::bail!("it is a directory, not a file");
    }
    if path.exists() {
        OpenOptions::new()
            .write(true)
            .open(path)
            .context("cannot open it for writing")?;
        return Ok(());
    }
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .context("cannot create it")?;
    std::fs::remove_file(path).context("cannot create it")?;
    Ok(())
}

pub(crate) fn run(args: &TuneArgs) -> Result<()> {
    let (network, layers) = args.source.layers()?;
    if args.list {
        if args.settings.json {
            let doc = layer_list_json(&network, &layers);
            outln!("{}", serde_json::to_string_pretty(&doc)?);
        } else {
            out!("{}", render_layer_list(&layers));
        }
        return Ok(());
    }
    args.settings.wd_options()?;
    let mut jobs = jobs_for(layers.iter().map(|l| (l.name.clone(), l.problem)));
    for job in &mut jobs {
        // `auto` chunks a layer whose micro-batches cannot fit 32-bit indexing at all (a huge
        // sample at a small batch), as a layer's own tuning does.
        let chunks_only = args.split == SplitSetting::Auto
            && SplitSetting::auto_looks_at(&job.problem)
            && IndexLimit::CUDNN
                .largest_size(&job.problem, job.op, SplitDim::Batch)
                .is_err();
        if args.split == SplitSetting::Spatial || chunks_only {
            job.split = SplitDim::Spatial;
        }
    }
    let policy = args.settings.policy;
    // A layer no plan can split into calls that fit 32-bit indexing is refused before the
    // device or the cache is opened.
    for job in &jobs {
        job.problem
            .validate()
            .map_err(|e| anyhow::anyhow!("{}: {e}", job.layer))?;
        job.sizes(policy, IndexLimit::CUDNN)
            .map_err(|e| anyhow::anyhow!("{}: {e}", job.layer))?;
    }
    let (mut device, cache, timing) = args
        .device
        .open_checked(args.quiet, |device| check_before_measuring(args, device))?;
    let fingerprint = device.backend().fingerprint().clone();
    let count = |job: &Job| job.sizes(policy, IndexLimit::CUDNN).map_or(0, |s| s.len());
    let total_sizes: usize = jobs.iter().map(count).sum();
    if !args.quiet {
        let convolutions: u32 = layers.iter().map(|l| l.count).sum();
        eprintln!(
            "tuning {network} ({} distinct conv shapes of {convolutions} layers, {}, {} {}) on {fingerprint}: \
             {} (layer, op) x {} sizes = {total_sizes} measurements; cache: {}",
            layers.len(),
            args.source.batch.map_or("own batch sizes".to_string(), |b| format!("batch {b}")),
            args.source.dtype,
            distinct(layers.iter().map(|l| l.problem.layout_name())),
            jobs.len(),
            match args.split {
                SplitSetting::Spatial => "chunk",
                _ => "micro-batch",
            },
            cache.location()
        );
    }

    // The first Ctrl-C stops after the current measurement (what was measured stays in the
    // cache); a second one exits at once.
    let interrupt = Arc::new(AtomicBool::new(false));
    let flag = interrupt.clone();
    let _ = ctrlc::set_handler(move || {
        if flag.swap(true, Ordering::SeqCst) {
            std::process::exit(130);
        }
        eprintln!("\ninterrupted: finishing the current measurement (Ctrl-C again to quit now)");
    });

    let mut reporter = Reporter::new(total_sizes as u64, args.quiet);
    let (candidates, engines) = args.device.candidates();
    let run = ProfileRun {
        policy,
        timing,
        cache: &cache,
        interrupt: Some(&interrupt),
        candidates,
        engines,
        workspace_limit_bytes: Some(measuring_limit(&args.settings)),
        index_limit: IndexLimit::CUDNN,
        verify: args.device.verify(),
    };
    let mut step = |p: Progress<'_>, from_cache: bool| {
        reporter.step(&p.job.layer, p.job.op.name(), p.done == p.total, from_cache);
    };
    // Several GPUs: deal each job's sizes out over all of them (one thread and handle each).
    let gpus = match &device {
        Device::Cuda(_) => CudnnBackend::device_count().unwrap_or(1),
        Device::Cpu(_) => 1,
    };
    if gpus > 1 && !args.quiet {
        eprintln!("profiling on {gpus} GPUs in parallel");
    }
    let mut profile_these = |jobs: &[Job], step: &mut dyn FnMut(Progress<'_>, bool)| {
        if gpus > 1 {
            profile_jobs_parallel(
                CudnnBackend::new,
                gpus,
                &fingerprint,
                device.backend().kinds(),
                jobs,
                &run,
                step,
            )
        } else {
            profile_jobs(device.backend(), jobs, &run, step)
        }
    };
    let result = profile_these(&jobs, &mut step);
    reporter.finish();
    let (mut profile, mut stats) = result?;
    // `auto`: chunks for the small-batch layers whose batch sizes felt the limit.
    let spatial_jobs = spatial_candidates(args.split, &profile, measuring_limit(&args.settings));
    if !spatial_jobs.is_empty() {
        let sizes: usize = spatial_jobs.iter().map(count).sum();
        if !args.quiet {
            eprintln!(
                "{} (layer, op) of batch <= {} skipped candidates over the limit: also profiling chunks along {} ({sizes} sizes)",
                spatial_jobs.len(),
                mucudnn::tune::SPATIAL_AUTO_MAX_BATCH,
                distinct(
                    spatial_jobs
                        .iter()
                        .map(|job| mucudnn::solver::spatial::split_axis(&job.problem).name())
                )
            );
        }
        let mut chunks = Reporter::new(sizes as u64, args.quiet);
        let mut step = |p: Progress<'_>, from_cache: bool| {
            chunks.step(&p.job.layer, p.job.op.name(), p.done == p.total, from_cache);
        };
        let result = profile_these(&spatial_jobs, &mut step);
        chunks.finish();
        let (more, more_stats) = result?;
        profile.entries.extend(more.entries);
        stats = stats.and(more_stats);
    }
    let tuning_seconds = reporter.started.elapsed().as_secs_f64();
    let counts = VerifiedCounts::of(&profile);
    if !args.quiet {
        if stats.measured == 0 {
            eprintln!(
                "all {} measurements came from the cache: no benchmark was run",
                stats.cached
            );
        } else {
            eprintln!(
                "profiled in {tuning_seconds:.1} s ({} sizes measured, {} from the cache{}{})",
                stats.measured,
                stats.cached,
                if stats.pruned > 0 {
                    format!("; {} engine timings pruned", stats.pruned)
                } else {
                    String::new()
                },
                if stats.skipped > 0 {
                    format!(
                        "; {} candidates over the {} limit not timed",
                        stats.skipped,
                        mucudnn::solver::units::format_bytes(measuring_limit(&args.settings))
                    )
                } else {
                    String::new()
                }
            );
        }
        eprintln!("{}", verification_summary(run.verify, &stats, &counts));
        eprint!("{}", render_rejected(&profile, 10));
    }
    let tuning_json = TuningJson {
        seconds: tuning_seconds,
        candidates: run.effective_candidates(device.backend().kinds()).name(),
        sizes_measured: stats.measured,
        sizes_cached: stats.cached,
        engine_timings_pruned: stats.pruned,
        measuring_limit_bytes: run.workspace_limit_bytes,
        timings_skipped_over_limit: stats.skipped,
        peak_measuring_memory_bytes: stats.memory.peak_bytes,
        largest_workspace_bytes: stats.memory.largest_workspace_bytes,
        verify: run.verify,
        candidates_verified_now: stats.verified,
        candidates_compared: counts.compared,
        candidates_rejected: counts.rejected,
        candidates_unverified: counts.unverified,
    };
    if let Some(path) = &args.save_profile {
        std::fs::write(path, interchange::to_json_string(&profile))
            .with_context(|| format!("cannot write profile {}", path.display()))?;
        if !args.quiet {
            eprintln!("profile written to {}", path.display());
        }
    }
    let multiplicity = multiplicities(&layers);
    let solution = solve_and_print(&profile, &args.settings, false, Some(&multiplicity))?;
    if let Some(dir) = &args.report {
        let input = ReportInput {
            profile: &profile,
            solution: &solution,
            device: &fingerprint.to_string(),
            cudnn_version: fingerprint.cudnn_version,
            multiplicity: Some(&multiplicity),
            title: Some(&network),
        };
        let files = write_report(dir, &input)
            .with_context(|| format!("cannot write the report into {}", dir.display()))?;
        if !args.quiet {
            eprintln!("report: {} files in {}", files.len(), dir.display());
        }
    }
    let measured = if args.verify {
        Some(verify(&device, &solution, args.settings.json, args.quiet)?)
    } else {
        None
    };
    if args.settings.json {
        let doc = TuneJson {
            solution: SolutionJson::new(&solution).with_multiplicity(&multiplicity),
            tuning: tuning_json,
            verification: candidates_json(&profile),
            measured,
        };
        outln!("{}", serde_json::to_string_pretty(&doc)?);
    }
    Ok(())
}

/// The summary line of verification: what this run compared and rejected, and what the
/// profile holds unverified.
fn verification_summary(
    verify: bool,
    stats: &mucudnn::tune::CacheStats,
    counts: &VerifiedCounts,
) -> String {
    let mut line = if verify {
        format!(
            "verified {} candidate output(s) against the reference this run",
            stats.verified
        )
    } else {
        "verification off (--no-verify): outputs measured now were not compared".to_string()
    };
    if counts.rejected > 0 {
        line += &format!(
            "; {} candidate timing(s) rejected for wrong results, never planned (listed below; \
             `mucudnn explain` shows each layer's)",
            counts.rejected
        );
    } else {
        line += "; none rejected";
    }
    if counts.unverified > 0 {
        line += &format!(
            "; {} timing(s) not compared{}",
            counts.unverified,
            if verify {
                " (imported, or no reference output there)"
            } else {
                ""
            }
        );
    }
    line
}

/// The spatial jobs `auto` adds after the batch profile: each (layer, op) whose batch sizes
/// make it tune chunks ([`SplitSetting::auto_wants_chunks`]) at the measuring limit.
fn spatial_candidates(split: SplitSetting, profile: &Profile, limit_bytes: u64) -> Vec<Job> {
    if split != SplitSetting::Auto {
        return Vec::new();
    }
    profile
        .entries
        .iter()
        .filter(|e| {
            e.split == SplitDim::Batch
                && SplitSetting::auto_wants_chunks(&e.problem, &e.skipped, limit_bytes)
        })
        .map(|e| Job {
            layer: e.layer.clone(),
            problem: e.problem,
            op: e.op,
            split: SplitDim::Spatial,
        })
        .collect()
}

/// The distinct names among `names`, in first-seen order, joined by `/` (`nhwc/ndhwc`, `d/h`).
fn distinct(names: impl IntoIterator<Item = &'static str>) -> String {
    let mut seen: Vec<&str> = Vec::new();
    for name in names {
        if !seen.contains(&name) {
            seen.push(name);
        }
    }
    seen.join("/")
}

/// Executes the solution's plans and baselines and prints measured against predicted times.
fn verify(
    device: &Device,
    solution: &Solution,
    json: bool,
    quiet: bool,
) -> Result<VerificationJson> {
    let progress = |plan: &Plan| {
        if !quiet {
            eprintln!(
                "executing {} {} and its undivided baseline",
                plan.layer, plan.op
            );
        }
    };
    let (measured, clock) = match device {
        Device::Cuda(backend) => {
            let timing = TimingSettings::GPU;
            let handle = backend.handle();
            (
                measure_solution(
                    solution,
                    |plan| time_plan_cuda(handle, plan, &timing),
                    progress,
                )?,
                "CUDA events",
            )
        }
        Device::Cpu(_) => {
            let timing = TimingSettings::CPU;
            (
                measure_solution(solution, |plan| time_plan_cpu(plan, &timing), progress)?,
                "host clock",
            )
        }
    };
    let report = verification_json(solution, &measured);
    if !json {
        outln!("\nmeasured end to end ({clock}, median of timed loops):\n");
        out!("{}", render_verification(solution, &measured));
    }
    Ok(report)
}
