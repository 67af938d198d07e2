//! The `mucudnn` command line: thin glue from arguments to the library, with errors reported
//! through anyhow and an exit status of 1 (2 for usage errors, from clap).

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use mucudnn::backend::{Backend, CpuBackend, CudnnBackend, TimingSettings};
use mucudnn::device::BackendKind;
use mucudnn::exec::verify::{measure_solution, time_plan_cpu, time_plan_cuda};
use mucudnn::models::Model;
use mucudnn::report::{
    cudnn_version_string, describe_mode, optimality_warning, render_table, render_verification,
    verification_json, SolutionJson,
};
use mucudnn::solver::units::parse_size;
use mucudnn::solver::{
    interchange, solve_profile, Mode, Plan, Policy, Profile, Solution, WdOptions,
};
use mucudnn::solver::{DType, Layout};
use mucudnn::tune::{jobs_for, profile_jobs};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "mucudnn",
    version,
    about = "Micro-batching convolution autotuner (after µ-cuDNN)"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Profile every conv layer of a model (all three ops), then solve and print the plans.
    Tune(TuneArgs),
    /// Solve a saved profile: the fastest micro-batching plan per (layer, op).
    Solve(SolveArgs),
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum DeviceChoice {
    /// The GPU when CUDA, cuDNN and a GPU are present, else the CPU.
    Auto,
    Cuda,
    Cpu,
}

#[derive(Args)]
struct TuneArgs {
    /// The network whose conv layers to tune.
    #[arg(long, value_parser = parse_model)]
    model: Model,
    /// Mini-batch size.
    #[arg(long, value_name = "N")]
    batch: i64,
    #[arg(long, default_value = "fp32", value_parser = parse_dtype)]
    dtype: DType,
    #[arg(long, default_value = "nchw", value_parser = parse_layout)]
    layout: Layout,
    /// Where to measure.
    #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
    device: DeviceChoice,
    /// Write the measurements in interchange format (for `mucudnn solve`).
    #[arg(long, value_name = "FILE")]
    save_profile: Option<PathBuf>,
    /// After solving, execute every plan and its undivided baseline end to end and report
    /// measured times next to the predicted ones.
    #[arg(long)]
    verify: bool,
    /// No progress lines.
    #[arg(long)]
    quiet: bool,
    #[command(flatten)]
    settings: SolveSettings,
}

/// The constraint and solver settings shared by every command that solves.
#[derive(Args)]
struct SolveSettings {
    /// Micro-batch sizes a plan may use: undivided, power-of-two or all.
    #[arg(long, default_value = "power-of-two", value_parser = parse_policy)]
    policy: Policy,
    /// Per-layer workspace limit (workspace reuse). Bytes, or with KiB/MiB/GiB.
    #[arg(long, value_name = "SIZE", value_parser = parse_size, conflicts_with = "total_workspace")]
    workspace_limit: Option<u64>,
    /// One workspace budget shared by all layers (workspace division, solved as a MILP).
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    total_workspace: Option<u64>,
    /// Time limit for the workspace-division MILP, in seconds.
    #[arg(long, value_name = "SECS", default_value_t = 10.0)]
    ilp_time_limit: f64,
    /// Print the result as JSON (see README) instead of a table.
    #[arg(long)]
    json: bool,
}

const DEFAULT_WORKSPACE_LIMIT: u64 = 64 << 20;

impl SolveSettings {
    fn mode(&self) -> Mode {
        match self.total_workspace {
            Some(total_workspace_bytes) => Mode::WorkspaceDivision {
                total_workspace_bytes,
            },
            None => Mode::WorkspaceReuse {
                workspace_limit_bytes: self.workspace_limit.unwrap_or(DEFAULT_WORKSPACE_LIMIT),
            },
        }
    }

    fn wd_options(&self) -> Result<WdOptions> {
        anyhow::ensure!(
            self.ilp_time_limit.is_finite() && self.ilp_time_limit > 0.0,
            "--ilp-time-limit must be a positive number of seconds, got {}",
            self.ilp_time_limit
        );
        Ok(WdOptions {
            time_limit_s: self.ilp_time_limit,
            ..WdOptions::default()
        })
    }
}

#[derive(Args)]
struct SolveArgs {
    /// A profile in mucudnn-profile-v1 JSON (as written by `tune --save-profile`).
    #[arg(long, value_name = "FILE")]
    profile: PathBuf,
    #[command(flatten)]
    settings: SolveSettings,
}

fn parse_policy(text: &str) -> Result<Policy, String> {
    text.parse()
}

fn parse_model(text: &str) -> Result<Model, String> {
    text.parse()
}

fn parse_dtype(text: &str) -> Result<DType, String> {
    text.parse()
}

fn parse_layout(text: &str) -> Result<Layout, String> {
    text.parse()
}

/// The backend a command measures on.
#[allow(clippy::large_enum_variant)] // one per process
enum Device {
    Cuda(CudnnBackend),
    Cpu(CpuBackend),
}

impl Device {
    fn backend(&mut self) -> &mut dyn Backend {
        match self {
            Device::Cuda(b) => b,
            Device::Cpu(b) => b,
        }
    }
}

/// Opens the backend the user asked for; `auto` falls back to the CPU and says why.
fn open_device(choice: DeviceChoice, quiet: bool) -> Result<Device> {
    match choice {
        DeviceChoice::Cuda => Ok(Device::Cuda(CudnnBackend::new(0).context("--device cuda")?)),
        DeviceChoice::Cpu => Ok(Device::Cpu(CpuBackend::new())),
        DeviceChoice::Auto => match CudnnBackend::new(0) {
            Ok(backend) => Ok(Device::Cuda(backend)),
            Err(error) => {
                if !quiet {
                    eprintln!("no usable GPU ({error}); using the CPU backend");
                }
                Ok(Device::Cpu(CpuBackend::new()))
            }
        },
    }
}

/// Executes the solution's plans and baselines and prints measured against predicted times.
fn verify(
    device: &Device,
    solution: &Solution,
    json: bool,
    quiet: bool,
) -> Result<serde_json::Value> {
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
        println!("\nmeasured end to end ({clock}, median of timed loops):\n");
        print!("{}", render_verification(solution, &measured));
    }
    Ok(report)
}

fn tune(args: &TuneArgs) -> Result<()> {
    anyhow::ensure!(
        args.batch >= 1,
        "--batch must be at least 1, got {}",
        args.batch
    );
    let mut device = open_device(args.device, args.quiet)?;
    let backend = device.backend();
    let fingerprint = backend.fingerprint().clone();
    let timing = match fingerprint.backend {
        BackendKind::Cuda => TimingSettings::GPU,
        BackendKind::Cpu => TimingSettings::CPU,
    };
    let layers = args.model.layers(args.batch, args.dtype, args.layout);
    for layer in &layers {
        layer
            .problem
            .validate()
            .with_context(|| layer.name.clone())?;
    }
    let jobs = jobs_for(layers.iter().map(|l| (l.name.clone(), l.problem)));
    let policy = args.settings.policy;
    let total_sizes: usize = jobs.len() * policy.sizes(args.batch).len();
    if !args.quiet {
        eprintln!(
            "tuning {} ({} distinct conv layers, batch {}, {} {}) on {fingerprint}: {} ops x {} micro-batch sizes",
            args.model,
            layers.len(),
            args.batch,
            args.dtype,
            args.layout,
            jobs.len(),
            policy.sizes(args.batch).len()
        );
    }
    let started = std::time::Instant::now();
    let mut done = 0usize;
    let quiet = args.quiet;
    let profile = profile_jobs(backend, &jobs, policy, &timing, &mut |p| {
        done += 1;
        if !quiet && p.done == p.total {
            eprintln!(
                "[{done:>4}/{total_sizes}] {} {} measured ({:.1} s)",
                p.job.layer,
                p.job.op,
                started.elapsed().as_secs_f64()
            );
        }
    })?;
    if !quiet {
        eprintln!("profiled in {:.1} s", started.elapsed().as_secs_f64());
    }
    if let Some(path) = &args.save_profile {
        std::fs::write(path, interchange::to_json_string(&profile))
            .with_context(|| format!("cannot write profile {}", path.display()))?;
        if !quiet {
            eprintln!("profile written to {}", path.display());
        }
    }
    let solution = solve_and_print(&profile, &args.settings, !args.verify)?;
    if args.verify {
        let measured = verify(&device, &solution, args.settings.json, args.quiet)?;
        if args.settings.json {
            let mut doc = serde_json::to_value(SolutionJson::new(&solution))?;
            doc["measured"] = measured;
            println!("{}", serde_json::to_string_pretty(&doc)?);
        }
    }
    Ok(())
}

fn read_profile(path: &Path) -> Result<Profile> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read profile {}", path.display()))?;
    interchange::from_json_str(&text)
        .with_context(|| format!("{} is not a usable profile", path.display()))
}

/// Solves and prints; shared by `solve` and `tune`. The JSON document is printed only when
/// `print_json` (a caller that adds to it prints it itself).
fn solve_and_print(
    profile: &Profile,
    settings: &SolveSettings,
    print_json: bool,
) -> Result<Solution> {
    let solution = solve_profile(
        profile,
        settings.policy,
        settings.mode(),
        &settings.wd_options()?,
    )?;
    if let Some(warning) = optimality_warning(&solution) {
        eprintln!("{warning}");
    }
    if settings.json {
        if print_json {
            println!(
                "{}",
                serde_json::to_string_pretty(&SolutionJson::new(&solution))?
            );
        }
    } else {
        let device = match profile.cudnn_version {
            Some(version) => format!(
                "{} (cuDNN {})",
                profile.device,
                cudnn_version_string(version)
            ),
            None => profile.device.clone(),
        };
        println!("{}; measured on {device}\n", describe_mode(&solution));
        print!("{}", render_table(&solution));
    }
    Ok(solution)
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Tune(args) => tune(&args),
        Command::Solve(args) => {
            let profile = read_profile(&args.profile)?;
            solve_and_print(&profile, &args.settings, true).map(drop)
        }
    }
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}
