//! `mucudnn report` (report files from a saved profile) and `mucudnn explain` (why a split won).

use crate::tune::{DeviceArgs, LayerSource};
use crate::{one_of, read_profile, solve_and_print, SolveSettings};
use anyhow::{Context, Result};
use clap::Args;
use mucudnn::explain::{default_limits, explain, render_explanation, UNLIMITED};
use mucudnn::profiler::Job;
use mucudnn::report_files::{write_report, ReportInput};
use mucudnn::solver::units::parse_size;
use mucudnn::solver::{AlgoNames, ConvOp, OpProfile, Policy, Profile, SplitDim};
use mucudnn::tune::{profile_jobs, ProfileRun};
use std::path::PathBuf;

#[derive(Args)]
pub(crate) struct ReportArgs {
    /// A profile in mucudnn-profile-v1 JSON.
    #[arg(long, value_name = "FILE")]
    profile: PathBuf,
    /// Where to write report.md and the SVG plots.
    #[arg(long, value_name = "DIR", default_value = "mucudnn-report")]
    out: PathBuf,
    #[command(flatten)]
    settings: SolveSettings,
}

pub(crate) fn report(args: &ReportArgs) -> Result<()> {
    let profile = read_profile(&args.profile)?;
    let solution = solve_and_print(&profile, &args.settings, true, None)?;
    let device = match &profile.fingerprint {
        Some(fingerprint) => fingerprint.to_string(),
        None => profile.device.clone(),
    };
    let title = args.profile.display().to_string();
    let input = ReportInput {
        profile: &profile,
        solution: &solution,
        device: &device,
        cudnn_version: profile.cudnn_version,
        multiplicity: None,
        title: Some(&title),
    };
    let files = write_report(&args.out, &input)
        .with_context(|| format!("cannot write the report into {}", args.out.display()))?;
    eprintln!("report: {} files in {}", files.len(), args.out.display());
    Ok(())
}

#[derive(Args)]
pub(crate) struct ExplainArgs {
    /// The layer to explain (as named in the table).
    #[arg(long)]
    layer: String,
    /// The op: forward, backward-data or backward-filter.
    #[arg(long, value_parser = one_of::<ConvOp>(ConvOp::NAMES.iter().copied()))]
    op: ConvOp,
    /// Explain from a saved profile instead of measuring (through the cache).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["model", "network"])]
    profile: Option<PathBuf>,
    #[command(flatten)]
    source: LayerSource,
    #[command(flatten)]
    device: DeviceArgs,
    /// Workspace limits to compare, comma-separated (e.g. 8MiB,64MiB,unlimited). Default:
    /// the limits at which some micro-batch size's best algorithm changes.
    #[arg(long, value_name = "SIZES", value_delimiter = ',', value_parser = parse_limit)]
    limits: Vec<u64>,
    /// Micro-batch sizes a plan may use: the whole mini-batch only, powers of two (and N),
    /// or every size.
    #[arg(long, default_value = "power-of-two", value_parser = one_of::<Policy>(Policy::ALL.map(Policy::name)))]
    policy: Policy,
    /// Which split to explain: micro-batches of the batch, or chunks along the outermost
    /// spatial dimension of the op's output (d, h or w).
    #[arg(long, default_value = "batch", value_parser = one_of::<SplitDim>(SplitDim::ALL.map(SplitDim::name)))]
    split: SplitDim,
}

fn parse_limit(text: &str) -> Result<u64, String> {
    if text.trim().eq_ignore_ascii_case("unlimited") {
        Ok(UNLIMITED)
    } else {
        parse_size(text)
    }
}

/// The entry to explain, from the saved profile or measured (through the cache) now, and how
/// its algorithms are named.
fn entry(args: &ExplainArgs) -> Result<(OpProfile, AlgoNames, i64)> {
    // The (layer, dtype, layout, op) asked for: a profile may hold the layer in several.
    let (dtype, layout) = (args.source.dtype, args.source.layout);
    let find = |profile: Profile| -> Result<(OpProfile, AlgoNames, i64)> {
        let names = profile.algo_names();
        let device = profile.fingerprint.clone();
        // What the profile has instead: this layer's (dtype, layout, op)s, else its layers.
        let mut others: Vec<String> = profile
            .entries
            .iter()
            .filter(|e| e.layer == args.layer)
            .map(|e| {
                format!(
                    "{} {} {} {}",
                    e.problem.dtype, e.problem.layout, e.op, e.split
                )
            })
            .collect();
        if others.is_empty() {
            others = profile.entries.iter().map(|e| e.layer.clone()).collect();
            others.dedup();
        }
        profile
            .entries
            .into_iter()
            .find(|e| {
                e.layer == args.layer
                    && e.op == args.op
                    && e.problem.dtype == dtype
                    && e.problem.layout == layout
                    && e.split == args.split
            })
            .with_context(|| {
                format!(
                    "no {} {dtype} {layout} {} {} in the profile (it has: {})",
                    args.layer,
                    args.op,
                    args.split,
                    others.join(", ")
                )
            })
            .map(|entry| {
                // The accuracy rule of the device that measured it (none for a profile that
                // does not say: nothing says it came from cuDNN).
                let min = device.as_ref().map_or(1, |d| {
                    mucudnn::tune::min_split_size(d, &entry.problem, entry.op, entry.split)
                });
                (entry, names, min)
            })
    };
    if let Some(path) = &args.profile {
        return find(read_profile(path)?);
    }
    let (_, layers) = args.source.layers()?;
    let layer = layers
        .iter()
        .find(|l| l.name == args.layer)
        .with_context(|| {
            let names: Vec<&str> = layers.iter().map(|l| l.name.as_str()).collect();
            format!(
                "no layer {} (distinct layers: {})",
                args.layer,
                names.join(", ")
            )
        })?;
    let (mut device, cache, timing) = args.device.open(true)?;
    let job = Job {
        layer: layer.name.clone(),
        problem: layer.problem,
        op: args.op,
        split: args.split,
    };
    let (candidates, engines) = args.device.candidates();
    let run = ProfileRun {
        policy: args.policy,
        timing,
        cache: &cache,
        interrupt: None,
        candidates,
        engines,
        // The explanation reads every limit: time every candidate.
        workspace_limit_bytes: None,
        index_limit: mucudnn::solver::IndexLimit::CUDNN,
        verify: args.device.verify(),
    };
    let (profile, _) = profile_jobs(device.backend(), &[job], &run, &mut |_, _| {})?;
    find(profile)
}

pub(crate) fn explain_command(args: &ExplainArgs) -> Result<()> {
    let (entry, names, min_micro) = entry(args)?;
    let limits = if args.limits.is_empty() {
        default_limits(&entry, args.policy)
    } else {
        args.limits.clone()
    };
    let explanation = explain(&entry, args.policy, &limits, min_micro)?;
    out!("{}", render_explanation(&explanation, names));
    Ok(())
}
