//! The `mucudnn` command line: thin glue from arguments to the library, with errors reported
//! through anyhow and an exit status of 1 (2 for usage errors, from clap; 130 when interrupted).
//!
//! - `tune` (tune.rs): profile a network through the cache, solve, print, optionally verify.
//! - `solve` (here): solve a saved profile.
//! - `cache` (cache_cmd.rs): inspect, export, import and clear the tuning cache.
//! - `report`, `explain` (report_cmd.rs): report files from a saved profile; why a split won.

/// Prints to stdout like `print!`, but a closed stdout (`mucudnn cache list | head -1`) is not
/// a panic: printing stops and the command finishes its other work (see [`write_stdout`]).
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::write_stdout(format_args!($($arg)*))
    };
}

/// `println!` through [`out!`].
macro_rules! outln {
    () => {
        $crate::write_stdout(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::write_stdout(format_args!("{}\n", format_args!($($arg)*)))
    };
}

mod cache_cmd;
mod report_cmd;
mod tune;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use mucudnn::backend::{Backend, CpuBackend, CudnnBackend};
use mucudnn::report::{
    cudnn_version_string, describe_mode, optimality_warning, render_table, SolutionJson,
};
use mucudnn::solver::units::parse_size;
use mucudnn::solver::{interchange, CandidateSet, Mode, Policy, Profile, Solution, WdOptions};
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// Set once stdout's reader has gone (a broken pipe): later output is dropped.
static STDOUT_CLOSED: AtomicBool = AtomicBool::new(false);
/// The first other stdout error (a full disk behind a redirect): reported at exit.
static STDOUT_ERROR: Mutex<Option<String>> = Mutex::new(None);

/// Writes to stdout. A broken pipe means the reader has what it wanted (`| head`): output stops
/// quietly and the command goes on (its report files are still written) and exits 0. Any other
/// write error is kept and makes the command fail at exit.
pub(crate) fn write_stdout(args: std::fmt::Arguments<'_>) {
    if STDOUT_CLOSED.load(Ordering::Relaxed) {
        return;
    }
    let mut stdout = std::io::stdout().lock();
    if let Err(error) = stdout.write_fmt(args) {
        STDOUT_CLOSED.store(true, Ordering::Relaxed);
        if error.kind() != std::io::ErrorKind::BrokenPipe {
            if let Ok(mut slot) = STDOUT_ERROR.lock() {
                slot.get_or_insert_with(|| format!("cannot write to stdout: {error}"));
            }
        }
    }
}

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
    Tune(tune::TuneArgs),
    /// Solve a saved profile: the fastest micro-batching plan per (layer, op).
    Solve(SolveArgs),
    /// The tuning cache: where it is, what it holds; export, import, clear.
    Cache(cache_cmd::CacheArgs),
    /// Write report.md and SVG plots from a saved profile.
    Report(report_cmd::ReportArgs),
    /// Show, per micro-batch size, the best algorithm within each workspace limit.
    Explain(report_cmd::ExplainArgs),
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum DeviceChoice {
    /// The GPU when CUDA, cuDNN and a GPU are present, else the CPU.
    Auto,
    Cuda,
    Cpu,
}

/// A value parser over a fixed list of names: `--help` lists them (clap's possible values),
/// and the value is parsed with the type's own `FromStr`, so the names stay defined once.
pub(crate) fn one_of<T>(
    names: impl IntoIterator<Item = &'static str>,
) -> impl clap::builder::TypedValueParser<Value = T>
where
    T: std::str::FromStr<Err = String> + Clone + Send + Sync + 'static,
{
    use clap::builder::TypedValueParser as _;
    clap::builder::PossibleValuesParser::new(names).try_map(|text: String| text.parse::<T>())
}

/// The constraint and solver settings shared by every command that solves.
#[derive(Args)]
pub(crate) struct SolveSettings {
    /// Micro-batch sizes a plan may use: the whole mini-batch only, powers of two (and N),
    /// or every size.
    #[arg(long, default_value = "power-of-two", value_parser = one_of::<Policy>(Policy::ALL.map(Policy::name)))]
    pub policy: Policy,
    /// Per-layer workspace limit (workspace reuse). Bytes, or with KiB/MiB/GiB.
    #[arg(long, value_name = "SIZE", default_value = "64MiB", value_parser = parse_size, conflicts_with = "total_workspace", allow_hyphen_values = true)]
    pub workspace_limit: u64,
    /// One workspace budget shared by all layers (workspace division, solved as a MILP).
    #[arg(long, value_name = "SIZE", value_parser = parse_size, allow_hyphen_values = true)]
    pub total_workspace: Option<u64>,
    /// Time limit for the workspace-division MILP, in seconds (above 0, at most 1e6).
    #[arg(long, value_name = "SECS", default_value_t = 10.0, value_parser = parse_time_limit, allow_hyphen_values = true)]
    pub ilp_time_limit: f64,
    /// Print the result as JSON (see docs/cli.md) instead of a table.
    #[arg(long)]
    pub json: bool,
}

impl SolveSettings {
    pub fn mode(&self) -> Mode {
        match self.total_workspace {
            Some(total_workspace_bytes) => Mode::WorkspaceDivision {
                total_workspace_bytes,
            },
            None => Mode::WorkspaceReuse {
                workspace_limit_bytes: self.workspace_limit,
            },
        }
    }

    fn wd_options(&self) -> Result<WdOptions> {
        WdOptions::check_time_limit(self.ilp_time_limit)
            .map_err(|e| anyhow::anyhow!("--ilp-time-limit: {e}"))?;
        Ok(WdOptions {
            time_limit_s: self.ilp_time_limit,
            ..WdOptions::default()
        })
    }
}

#[derive(Args)]
struct SolveArgs {
    /// A profile in mucudnn-profile-v1 JSON (as written by `tune --save-profile`). Repeat to
    /// merge profiles of one device (e.g. legacy algorithms and engine configurations).
    #[arg(long, value_name = "FILE", required = true)]
    profile: Vec<PathBuf>,
    /// Solve with only these candidates from the profile: legacy, engines or all.
    #[arg(long, default_value = "all", value_parser = one_of::<CandidateSet>(CandidateSet::ALL.map(CandidateSet::name)))]
    candidates: CandidateSet,
    #[command(flatten)]
    settings: SolveSettings,
}

fn parse_time_limit(text: &str) -> Result<f64, String> {
    let seconds: f64 = text
        .parse()
        .map_err(|_| format!("`{text}` is not a number of seconds"))?;
    WdOptions::check_time_limit(seconds)
}

/// The backend a command measures on.
#[allow(clippy::large_enum_variant)] // one per process
pub(crate) enum Device {
    Cuda(CudnnBackend),
    Cpu(CpuBackend),
}

impl Device {
    pub fn backend(&mut self) -> &mut dyn Backend {
        match self {
            Device::Cuda(b) => b,
            Device::Cpu(b) => b,
        }
    }
}

/// Opens the backend the user asked for; `auto` falls back to the CPU and says why.
pub(crate) fn open_device(choice: DeviceChoice, quiet: bool) -> Result<Device> {
    match choice {
        DeviceChoice::Cuda => Ok(Device::Cuda(CudnnBackend::new(0).context("--device cuda")?)),
        DeviceChoice::Cpu => Ok(Device::Cpu(CpuBackend::new())),
        DeviceChoice::Auto => {
            match CudnnBackend::new(0) {
                Ok(backend) => Ok(Device::Cuda(backend)),
                Err(error) => {
                    if !quiet {
                        // The first clause says what is missing; `--device cuda` prints it all.
                        let text = error.to_string();
                        let short = text.split(": ").next().unwrap_or(&text);
                        eprintln!("no usable GPU ({short}); using the CPU backend (`--device cuda` says why)");
                    }
                    Ok(Device::Cpu(CpuBackend::new()))
                }
            }
        }
    }
}

pub(crate) fn read_profile(path: &Path) -> Result<Profile> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read profile {}", path.display()))?;
    interchange::from_json_str(&text)
        .with_context(|| format!("{} is not a usable profile", path.display()))
}

/// Solves and prints; shared by `solve` and `tune`. The JSON document is printed only when
/// `print_json` (a caller that adds to it prints it itself).
pub(crate) fn solve_and_print(
    profile: &Profile,
    settings: &SolveSettings,
    print_json: bool,
    multiplicity: Option<&HashMap<String, u32>>,
) -> Result<Solution> {
    // On cuDNN, a bf16 backward-filter plan has at most 4 micro-batches (the tune module's
    // `min_micro_batch`): the rule applies to every plan this prints.
    let solution = mucudnn::tune::solve_accurately(
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
            outln!(
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
        outln!("{}; measured on {device}\n", describe_mode(&solution));
        out!("{}", render_table(&solution, multiplicity));
    }
    Ok(solution)
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Tune(args) => tune::run(&args),
        Command::Solve(args) => {
            let mut profile = read_profile(&args.profile[0])?;
            for path in &args.profile[1..] {
                profile
                    .merge(&read_profile(path)?)
                    .with_context(|| format!("cannot merge {}", path.display()))?;
            }
            let profile = profile.only(args.candidates);
            anyhow::ensure!(
                !profile.entries.is_empty(),
                "the profile has no {} candidates",
                args.candidates
            );
            solve_and_print(&profile, &args.settings, true, None).map(drop)
        }
        Command::Cache(args) => cache_cmd::run(&args),
        Command::Report(args) => report_cmd::report(&args),
        Command::Explain(args) => report_cmd::explain_command(&args),
    }
}

/// An error and its causes on one line, each text once: many errors print their source in
/// their own message (`cannot read x: No such file or directory (os error 2)`), so a cause
/// whose text is already there is not repeated.
fn error_text(error: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in error.chain() {
        let cause = cause.to_string();
        if text.contains(&cause) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&cause);
    }
    text
}

fn main() -> ExitCode {
    let result = run(Cli::parse()).and_then(|()| {
        let _ = std::io::stdout().flush().map_err(|error| {
            if error.kind() != std::io::ErrorKind::BrokenPipe {
                if let Ok(mut slot) = STDOUT_ERROR.lock() {
                    slot.get_or_insert_with(|| format!("cannot write to stdout: {error}"));
                }
            }
        });
        match STDOUT_ERROR.lock().ok().and_then(|mut slot| slot.take()) {
            Some(message) => Err(anyhow::anyhow!(message)),
            None => Ok(()),
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            // Control characters (of a layer name, a path) are escaped: one line, no terminal
            // escape sequences from input files.
            eprintln!(
                "error: {}",
                mucudnn::report::escape_control(&error_text(&error))
            );
            let interrupted = error
                .downcast_ref::<mucudnn::tune::TuneError>()
                .is_some_and(|e| matches!(e, mucudnn::tune::TuneError::Interrupted { .. }));
            ExitCode::from(if interrupted { 130 } else { 1 })
        }
    }
}
