//! The `mucudnn` command line: thin glue from arguments to the library, with errors reported
//! through anyhow and an exit status of 1 (2 for usage errors, from clap).

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use mucudnn::report::{
    cudnn_version_string, describe_mode, optimality_warning, render_table, SolutionJson,
};
use mucudnn::solver::units::parse_size;
use mucudnn::solver::{interchange, solve_profile, Mode, Policy, Profile, WdOptions};
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
    /// Solve a saved profile: the fastest micro-batching plan per (layer, op).
    Solve(SolveArgs),
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

fn read_profile(path: &Path) -> Result<Profile> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read profile {}", path.display()))?;
    interchange::from_json_str(&text)
        .with_context(|| format!("{} is not a usable profile", path.display()))
}

/// Solves and prints; shared by `solve` and (later) `tune`.
fn solve_and_print(profile: &Profile, settings: &SolveSettings) -> Result<()> {
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
        println!(
            "{}",
            serde_json::to_string_pretty(&SolutionJson::new(&solution))?
        );
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
    Ok(())
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Solve(args) => {
            let profile = read_profile(&args.profile)?;
            solve_and_print(&profile, &args.settings)
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
