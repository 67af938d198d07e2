//! Presenting a [`Solution`]: the `--json` document that scripts read (its shape is a public
//! contract, see docs/cli.md "JSON output") and the table people read.

use crate::models::ModelLayer;
pub use crate::solver::device::cudnn_version_string;
use crate::solver::spatial::split_axis;
use crate::solver::units::format_bytes;
use crate::solver::{
    AlgoKind, AlgoNames, ConvOp, ConvProblem, Measurement, Mode, Plan, Profile, Solution, SplitDim,
};
use serde::Serialize;
use std::collections::HashMap;

/// The `--json` document.
#[derive(Debug, Serialize)]
pub struct SolutionJson {
    pub mode: &'static str,
    pub policy: &'static str,
    pub plans: Vec<PlanJson>,
    #[serde(serialize_with = "finite")]
    pub total_time_ms: f64,
    #[serde(serialize_with = "finite_or_null")]
    pub total_undivided_ms: Option<f64>,
    pub total_workspace_bytes: u64,
}

/// A sum of finite times can pass f64's range (times near 1e308, in a forged profile): JSON has
/// no infinity, and serde_json writes `null`, which reads as "no value". Such a sum is written
/// as the largest f64 instead, a number that says "at least this".
fn finite<S: serde::Serializer>(value: &f64, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_f64(if value.is_infinite() && *value > 0.0 {
        f64::MAX
    } else {
        *value
    })
}

/// [`finite`] for a value that may be absent (`null`: none).
fn finite_or_null<S: serde::Serializer>(
    value: &Option<f64>,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    match value {
        Some(value) => finite(value, serializer),
        None => serializer.serialize_none(),
    }
}

#[derive(Debug, Serialize)]
pub struct PlanJson {
    pub layer: String,
    pub dtype: &'static str,
    pub layout: &'static str,
    pub op: &'static str,
    pub n: i64,
    /// How many layers of the network share this shape (`tune` only): the weighted total is
    /// the sum of `time_ms * multiplicity`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub multiplicity: Option<u32>,
    #[serde(serialize_with = "finite_or_null")]
    pub undivided_ms: Option<f64>,
    #[serde(serialize_with = "finite")]
    pub time_ms: f64,
    pub workspace_bytes: u64,
    /// `batch` (the sizes are micro-batches) or `spatial` (the sizes are chunks of
    /// rows along `axis`).
    pub split: SplitDim,
    /// The split axis (`d`, `h`, `w`) of a spatial plan; absent for a batch plan.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub axis: Option<&'static str>,
    pub micro_batches: Vec<MicroBatchJson>,
}

#[derive(Debug, Serialize)]
pub struct MicroBatchJson {
    pub size: i64,
    /// `legacy` or `engine`.
    pub kind: AlgoKind,
    /// The algorithm's name for people: `IMPLICIT_PRECOMP_GEMM`, `im2col-batched`, the engine
    /// configuration's name (`algo<N>` when the profile's backend is unknown).
    pub name: String,
    /// The legacy algorithm number; absent for an engine configuration.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub algo: Option<u32>,
    /// The engine configuration's name; absent for a legacy algorithm.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub engine: Option<String>,
    pub workspace_bytes: u64,
    pub time_ms: f64,
}

impl SolutionJson {
    pub fn new(solution: &Solution) -> Self {
        SolutionJson {
            mode: solution.mode.short_name(),
            policy: solution.policy.name(),
            plans: solution
                .problems
                .iter()
                .map(|solved| {
                    let plan = &solved.plan;
                    PlanJson {
                        layer: plan.layer.clone(),
                        dtype: plan.problem.dtype.name(),
                        layout: plan.problem.layout_name(),
                        op: plan.op.name(),
                        n: plan.problem.n,
                        multiplicity: None,
                        undivided_ms: solved.undivided.as_ref().map(Plan::time_ms),
                        time_ms: plan.time_ms(),
                        workspace_bytes: plan.workspace_bytes(),
                        split: plan.split,
                        axis: (plan.split == SplitDim::Spatial)
                            .then(|| split_axis(&plan.problem).name()),
                        micro_batches: plan
                            .micro_batches
                            .iter()
                            .map(|m| MicroBatchJson {
                                size: m.size,
                                kind: m.algo.kind(),
                                name: solution.names.name(plan.op, m.algo).into_owned(),
                                algo: m.algo.legacy(),
                                engine: m.algo.engine().map(|e| e.to_string()),
                                workspace_bytes: m.workspace_bytes,
                                time_ms: m.time_ms,
                            })
                            .collect(),
                    }
                })
                .collect(),
            total_time_ms: solution.total_time_ms(),
            total_undivided_ms: solution.total_undivided_ms(),
            total_workspace_bytes: solution.total_workspace_bytes(),
        }
    }
}

impl SolutionJson {
    /// Adds each plan's multiplicity (layer name -> count; absent names count once).
    pub fn with_multiplicity(mut self, multiplicity: &HashMap<String, u32>) -> Self {
        for plan in &mut self.plans {
            plan.multiplicity = Some(multiplicity.get(&plan.layer).copied().unwrap_or(1));
        }
        self
    }
}

/// The `--json` document of `tune`: the solution's keys in `solve --json`'s order, then
/// `tuning`, then `verification` (every candidate's output against the reference's), then
/// `measured` (with `--verify`).
#[derive(Debug, Serialize)]
pub struct TuneJson {
    #[serde(flatten)]
    pub solution: SolutionJson,
    pub tuning: TuningJson,
    pub verification: Vec<EntryCandidatesJson>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub measured: Option<VerificationJson>,
}

/// One profile entry's candidates as verification saw them: `tune --json`'s `verification`.
#[derive(Debug, Serialize)]
pub struct EntryCandidatesJson {
    pub layer: String,
    pub dtype: &'static str,
    pub layout: &'static str,
    pub op: &'static str,
    pub split: SplitDim,
    pub candidates: Vec<CandidateJson>,
}

/// One candidate at one size: its time, and how its output compared with the reference's.
#[derive(Debug, Serialize)]
pub struct CandidateJson {
    /// The micro-batch size (a chunk's rows for a spatial entry).
    pub size: i64,
    pub kind: AlgoKind,
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub algo: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub engine: Option<String>,
    pub time_ms: f64,
    pub workspace_bytes: u64,
    /// `max |out - reference| / max |reference|`; `null` when the output was not compared
    /// (measured without verification, or no reference output there) or, for a rejected
    /// candidate, when it was not finite where the reference was (NaN, infinity).
    #[serde(serialize_with = "finite_or_null_error")]
    pub max_rel_error: Option<f64>,
    /// The error allowed for this candidate's arithmetic here; `null` when not compared.
    pub tolerance: Option<f64>,
    /// Over its tolerance: computes wrong numbers, never planned.
    pub rejected: bool,
}

/// An error that is infinite (a non-finite output) is written `null`, as JSON has no infinity.
fn finite_or_null_error<S: serde::Serializer>(
    value: &Option<f64>,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    match value {
        Some(value) if value.is_finite() => serializer.serialize_f64(*value),
        _ => serializer.serialize_none(),
    }
}

impl CandidateJson {
    fn new(m: &Measurement, op: ConvOp, names: AlgoNames) -> CandidateJson {
        CandidateJson {
            size: m.micro,
            kind: m.algo.kind(),
            name: names.name(op, m.algo).into_owned(),
            algo: m.algo.legacy(),
            engine: m.algo.engine().map(|e| e.to_string()),
            time_ms: m.time_ms,
            workspace_bytes: m.workspace_bytes,
            max_rel_error: m.verification.map(|v| v.max_rel_error),
            tolerance: m.verification.map(|v| v.tolerance),
            rejected: m.is_rejected(),
        }
    }
}

/// Every candidate of every entry of `profile`, rejected ones included, by size then name.
pub fn candidates_json(profile: &Profile) -> Vec<EntryCandidatesJson> {
    let names = profile.algo_names();
    profile
        .entries
        .iter()
        .map(|entry| {
            let mut candidates: Vec<CandidateJson> = entry
                .measurements
                .iter()
                .chain(&entry.rejected)
                .map(|m| CandidateJson::new(m, entry.op, names))
                .collect();
            candidates.sort_by(|a, b| a.size.cmp(&b.size).then_with(|| a.name.cmp(&b.name)));
            EntryCandidatesJson {
                layer: entry.layer.clone(),
                dtype: entry.problem.dtype.name(),
                layout: entry.problem.layout_name(),
                op: entry.op.name(),
                split: entry.split,
                candidates,
            }
        })
        .collect()
}

/// What verification found in a profile: candidate outputs compared, rejected, and timed
/// without a comparison.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct VerifiedCounts {
    /// (size, candidate) timings whose output was compared with the reference's.
    pub compared: usize,
    /// Of those, the candidates rejected for wrong results.
    pub rejected: usize,
    /// (size, candidate) timings never compared (verification off, measured before mucudnn
    /// verified, imported without errors, or no reference output there).
    pub unverified: usize,
}

impl VerifiedCounts {
    pub fn of(profile: &Profile) -> VerifiedCounts {
        let mut counts = VerifiedCounts::default();
        for entry in &profile.entries {
            for m in &entry.measurements {
                if m.verification.is_some() {
                    counts.compared += 1;
                } else {
                    counts.unverified += 1;
                }
            }
            counts.compared += entry.rejected.len();
            counts.rejected += entry.rejected.len();
        }
        counts
    }
}

/// One line per rejected candidate of `profile` (at most `limit`, then how many more):
/// `rejected: alexnet.conv2 fp32 nchw fwd at 8 samples: im2col-batched: wrong results, max
/// relative error 3.1e-1 (tolerance 1.2e-5)`.
pub fn render_rejected(profile: &Profile, limit: usize) -> String {
    let names = profile.algo_names();
    let mut lines = Vec::new();
    for entry in &profile.entries {
        for r in &entry.rejected {
            lines.push(format!(
                "rejected: {} {} {} {} at {}: {}: {}",
                escape_control(&entry.layer),
                entry.problem.dtype,
                entry.problem.layout_name(),
                entry.op,
                size_words(entry.split, r.micro),
                names.name(entry.op, r.algo),
                rejection_reason(r)
            ));
        }
    }
    let more = lines.len().saturating_sub(limit);
    lines.truncate(limit);
    if more > 0 {
        lines.push(format!("... and {more} more (tune --json lists every one)"));
    }
    lines.iter().map(|l| format!("{l}\n")).collect()
}

/// `8 samples` (a micro-batch) or `8 rows` (a spatial chunk).
pub fn size_words(split: SplitDim, size: i64) -> String {
    match (split, size) {
        (SplitDim::Batch, 1) => "1 sample".into(),
        (SplitDim::Batch, n) => format!("{n} samples"),
        (SplitDim::Spatial, 1) => "1 row".into(),
        (SplitDim::Spatial, n) => format!("{n} rows"),
    }
}

/// Why a rejected candidate was rejected: `wrong results, max relative error 3.1e-1
/// (tolerance 1.2e-5)`, or `wrong results, output not finite (NaN or infinity) where the
/// reference's is`.
pub fn rejection_reason(m: &Measurement) -> String {
    match m.verification {
        Some(v) if v.max_rel_error.is_finite() => format!(
            "wrong results, max relative error {:.1e} (tolerance {:.1e})",
            v.max_rel_error, v.tolerance
        ),
        _ => "wrong results, output not finite (NaN or infinity) where the reference's is"
            .to_string(),
    }
}

/// How the measurements of a `tune` run were obtained.
#[derive(Debug, Serialize)]
pub struct TuningJson {
    pub seconds: f64,
    /// The candidates tuning measured: `legacy`, `engines` or `all`.
    pub candidates: &'static str,
    pub sizes_measured: usize,
    pub sizes_cached: usize,
    pub engine_timings_pruned: usize,
    /// The largest workspace measuring allowed itself: the per-layer limit or the total budget.
    pub measuring_limit_bytes: Option<u64>,
    /// (size, candidate) timings skipped because the candidate's workspace exceeded that limit.
    pub timings_skipped_over_limit: usize,
    /// The most memory measuring held at once (full-batch operands plus workspace; device
    /// memory on a GPU, host memory on the CPU). cuDNN's own allocations are not counted.
    pub peak_measuring_memory_bytes: u64,
    /// The largest workspace measuring allocated.
    pub largest_workspace_bytes: u64,
    /// Whether this run verified what it measured (`--no-verify` turns it off).
    pub verify: bool,
    /// Candidate outputs compared with the reference's in this run.
    pub candidates_verified_now: usize,
    /// In the whole profile (measured now or cached): outputs compared, candidates rejected
    /// for wrong results, and timings never compared.
    pub candidates_compared: usize,
    pub candidates_rejected: usize,
    pub candidates_unverified: usize,
}

/// One line describing the constraint, e.g. `workspace reuse: at most 64 MiB per layer`.
pub fn describe_mode(solution: &Solution) -> String {
    let constraint = match solution.mode {
        Mode::WorkspaceReuse {
            workspace_limit_bytes,
        } => {
            format!(
                "workspace reuse (per-layer limit {})",
                format_bytes(workspace_limit_bytes)
            )
        }
        Mode::WorkspaceDivision {
            total_workspace_bytes,
        } => {
            format!(
                "workspace division (total budget {})",
                format_bytes(total_workspace_bytes)
            )
        }
    };
    format!("{constraint}, policy {}", solution.policy)
}

/// A warning to show when the WD optimum was not proven, else `None`.
pub fn optimality_warning(solution: &Solution) -> Option<String> {
    (!solution.proven_optimal).then(|| {
        format!(
            "warning: the MILP solver stopped at its time limit; this assignment ({}) is feasible but not proven optimal \
             (raise --ilp-time-limit, or build with --features highs)",
            solution.method
        )
    })
}

/// Milliseconds as tables show them.
pub(crate) fn ms(value: f64) -> String {
    format!("{value:.3}")
}

/// `undivided / time` as `3.75x`, or `-` without a baseline.
pub(crate) fn speedup(undivided: Option<f64>, time: f64) -> String {
    match undivided {
        Some(u) if time > 0.0 => format!("{:.2}x", u / time),
        _ => "-".into(),
    }
}

/// The human table: one row per (layer, dtype, layout, op), then totals (per dtype and layout
/// when the profile has several).
///
/// With `multiplicity` (layer name -> how many layers of the network share the shape), layers
/// that occur more than once are marked `(xN)` and a total weighted by multiplicity follows:
/// the conv time of one training iteration.
pub fn render_table(solution: &Solution, multiplicity: Option<&HashMap<String, u32>>) -> String {
    let count = |layer: &str| {
        multiplicity
            .and_then(|m| m.get(layer))
            .copied()
            .unwrap_or(1)
    };
    let header = [
        "layer",
        "dtype",
        "layout",
        "op",
        "undivided ms",
        "micro ms",
        "speedup",
        "workspace",
        "split",
    ];
    let rows: Vec<[String; 9]> = solution
        .problems
        .iter()
        .map(|solved| {
            let plan = &solved.plan;
            let undivided = solved.undivided.as_ref().map(Plan::time_ms);
            let times = count(&plan.layer);
            [
                if times > 1 {
                    format!("{} (x{times})", escape_control(&plan.layer))
                } else {
                    escape_control(&plan.layer).into_owned()
                },
                plan.problem.dtype.to_string(),
                plan.problem.layout_name().to_string(),
                plan.op.to_string(),
                undivided.map_or("-".into(), ms),
                ms(plan.time_ms()),
                speedup(undivided, plan.time_ms()),
                format_bytes(plan.workspace_bytes()),
                plan.split_string(solution.names),
            ]
        })
        .collect();
    let total_workspace_label = match solution.mode {
        Mode::WorkspaceReuse { .. } => "max",
        Mode::WorkspaceDivision { .. } => "sum",
    };
    let total_row = |label: String, undivided: Option<f64>, time: f64, workspace: String| {
        [
            label,
            String::new(),
            String::new(),
            String::new(),
            undivided.map_or("-".into(), ms),
            ms(time),
            speedup(undivided, time),
            workspace,
            String::new(),
        ]
    };
    // Subtotals per (dtype, layout) when a profile mixes them: their speedups differ a lot.
    let mut groups: Vec<(String, Vec<&crate::solver::SolvedProblem>)> = Vec::new();
    for solved in &solution.problems {
        let key = format!(
            "{} {}",
            solved.plan.problem.dtype,
            solved.plan.problem.layout_name()
        );
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, members)) => members.push(solved),
            None => groups.push((key, vec![solved])),
        }
    }
    let mut totals = Vec::new();
    if groups.len() > 1 {
        for (key, members) in &groups {
            let undivided: Option<f64> = members
                .iter()
                .map(|s| s.undivided.as_ref().map(Plan::time_ms))
                .sum();
            let time: f64 = members.iter().map(|s| s.plan.time_ms()).sum();
            totals.push(total_row(
                format!("total {key}"),
                undivided,
                time,
                String::new(),
            ));
        }
    }
    totals.push(total_row(
        "total".into(),
        solution.total_undivided_ms(),
        solution.total_time_ms(),
        format!(
            "{} ({total_workspace_label})",
            format_bytes(solution.total_workspace_bytes())
        ),
    ));
    if solution.problems.iter().any(|s| count(&s.plan.layer) > 1) {
        let weight = |s: &crate::solver::SolvedProblem| f64::from(count(&s.plan.layer));
        let undivided: Option<f64> = solution
            .problems
            .iter()
            .map(|s| s.undivided.as_ref().map(|u| u.time_ms() * weight(s)))
            .sum();
        let time: f64 = solution
            .problems
            .iter()
            .map(|s| s.plan.time_ms() * weight(s))
            .sum();
        totals.push(total_row(
            "total x multiplicity".into(),
            undivided,
            time,
            String::new(),
        ));
    }
    let mut widths = header.map(str::len);
    for row in rows.iter().chain(&totals) {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let numeric = |column: usize| (4..=7).contains(&column);
    let mut out = String::new();
    let mut line = |cells: &[String]| {
        let mut text = String::new();
        for (column, cell) in cells.iter().enumerate() {
            let width = widths[column];
            if column > 0 {
                text.push_str("  ");
            }
            pad(&mut text, cell, width, numeric(column));
        }
        out.push_str(text.trim_end());
        out.push('\n');
    };
    line(&header.map(String::from));
    let rule: Vec<String> = widths.iter().map(|&w| "-".repeat(w)).collect();
    line(&rule);
    for row in &rows {
        line(row);
    }
    line(&rule);
    for row in &totals {
        line(row);
    }
    if let Some(summary) = kind_summary(solution) {
        out.push('\n');
        out.push_str(&summary);
        out.push('\n');
    }
    out
}

/// Which kind of candidate won, when engine configurations took part: micro-batches and
/// predicted time per kind over all plans. `None` when every micro-batch is a legacy one.
pub fn kind_summary(solution: &Solution) -> Option<String> {
    let mut engine = (0usize, 0.0f64);
    let mut legacy = (0usize, 0.0f64);
    for solved in &solution.problems {
        for mb in &solved.plan.micro_batches {
            let slot = match mb.algo.kind() {
                AlgoKind::Engine => &mut engine,
                AlgoKind::Legacy => &mut legacy,
            };
            slot.0 += 1;
            slot.1 += mb.time_ms;
        }
    }
    if engine.0 == 0 {
        return None;
    }
    let total = (engine.1 + legacy.1).max(f64::MIN_POSITIVE);
    Some(format!(
        "winners: engine configurations run {} micro-batches ({:.0}% of the time), legacy algorithms {} ({:.0}%)",
        engine.0,
        100.0 * engine.1 / total,
        legacy.0,
        100.0 * legacy.1 / total
    ))
}

/// The `measured` section of `tune --verify --json`: per plan the predicted and measured
/// times of the plan and of its undivided baseline, then totals.
#[derive(Debug, Serialize)]
pub struct VerificationJson {
    pub plans: Vec<VerifiedPlanJson>,
    pub total_measured_ms: f64,
    pub total_measured_undivided_ms: Option<f64>,
}

#[derive(Debug, Serialize)]
pub struct VerifiedPlanJson {
    pub layer: String,
    pub dtype: &'static str,
    pub layout: &'static str,
    pub op: &'static str,
    pub predicted_ms: f64,
    pub measured_ms: f64,
    pub predicted_undivided_ms: Option<f64>,
    pub measured_undivided_ms: Option<f64>,
}

/// The `measured` section of `tune --verify --json`.
pub fn verification_json(
    solution: &Solution,
    measured: &[crate::exec::verify::Measured],
) -> VerificationJson {
    let plans = solution
        .problems
        .iter()
        .zip(measured)
        .map(|(solved, m)| VerifiedPlanJson {
            layer: solved.plan.layer.clone(),
            dtype: solved.plan.problem.dtype.name(),
            layout: solved.plan.problem.layout_name(),
            op: solved.plan.op.name(),
            predicted_ms: solved.plan.time_ms(),
            measured_ms: m.plan_ms,
            predicted_undivided_ms: solved.undivided.as_ref().map(Plan::time_ms),
            measured_undivided_ms: m.undivided_ms,
        })
        .collect();
    VerificationJson {
        plans,
        total_measured_ms: measured.iter().map(|m| m.plan_ms).sum(),
        total_measured_undivided_ms: measured.iter().map(|m| m.undivided_ms).sum(),
    }
}

/// The human table of `tune --verify`: columns as wide as their widest cell, two spaces apart.
pub fn render_verification(
    solution: &Solution,
    measured: &[crate::exec::verify::Measured],
) -> String {
    let mut rows: Vec<Vec<String>> = vec![[
        "layer",
        "op",
        "predicted ms",
        "measured ms",
        "undivided pred",
        "undivided meas",
        "speedup",
    ]
    .map(String::from)
    .to_vec()];
    for (solved, m) in solution.problems.iter().zip(measured) {
        rows.push(vec![
            format!(
                "{} {}",
                escape_control(&solved.plan.layer),
                solved.plan.problem.dtype
            ),
            solved.plan.op.name().to_string(),
            ms(solved.plan.time_ms()),
            ms(m.plan_ms),
            solved
                .undivided
                .as_ref()
                .map_or("-".into(), |u| ms(u.time_ms())),
            m.undivided_ms.map_or("-".into(), ms),
            speedup(m.undivided_ms, m.plan_ms),
        ]);
    }
    let total: f64 = measured.iter().map(|m| m.plan_ms).sum();
    let undivided: Option<f64> = measured.iter().map(|m| m.undivided_ms).sum();
    rows.push(vec![
        "total".into(),
        String::new(),
        ms(solution.total_time_ms()),
        ms(total),
        solution.total_undivided_ms().map_or("-".into(), ms),
        undivided.map_or("-".into(), ms),
        speedup(undivided, total),
    ]);
    let mut widths = vec![0; rows[0].len()];
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    for row in &rows {
        let mut line = String::new();
        for (column, (cell, &width)) in row.iter().zip(&widths).enumerate() {
            if column > 0 {
                line.push_str("  ");
            }
            pad(&mut line, cell, width, column >= 2);
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// `tune --list --json`: a network's distinct layers, nothing measured.
#[derive(Debug, Serialize)]
pub struct LayerListJson<'a> {
    pub network: &'a str,
    /// Convolutions in the network, counting multiplicity.
    pub convolutions: u64,
    pub layers: Vec<LayerJson<'a>>,
}

#[derive(Debug, Serialize)]
pub struct LayerJson<'a> {
    pub layer: &'a str,
    /// How many layers of the network share this shape.
    pub count: u32,
    /// The layout's name at the layer's rank (`ndhwc`).
    pub layout: &'static str,
    /// [`ConvProblem::describe`].
    pub shape: String,
    /// The problem as in profiles (depth fields only for a 3-D problem).
    pub problem: &'a ConvProblem,
}

/// The `--list` document of a network's layers.
pub fn layer_list_json<'a>(network: &'a str, layers: &'a [ModelLayer]) -> LayerListJson<'a> {
    LayerListJson {
        network,
        convolutions: layers.iter().map(|l| u64::from(l.count)).sum(),
        layers: layers
            .iter()
            .map(|l| LayerJson {
                layer: &l.name,
                count: l.count,
                layout: l.problem.layout_name(),
                shape: l.problem.describe(),
                problem: &l.problem,
            })
            .collect(),
    }
}

/// The `--list` table: one row per distinct layer (name, count, shape), then the totals.
pub fn render_layer_list(layers: &[ModelLayer]) -> String {
    let mut rows = vec![["layer".to_string(), "count".into(), "shape".into()]];
    rows.extend(layers.iter().map(|l| {
        [
            escape_control(&l.name).into_owned(),
            l.count.to_string(),
            l.problem.describe(),
        ]
    }));
    let mut widths = [0; 3];
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    for row in &rows {
        let mut line = String::new();
        for (column, (cell, &width)) in row.iter().zip(&widths).enumerate() {
            if column > 0 {
                line.push_str("  ");
            }
            pad(&mut line, cell, width, column == 1);
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    let total: u64 = layers.iter().map(|l| u64::from(l.count)).sum();
    out.push_str(&format!(
        "{} distinct shapes of {total} convolutions\n",
        layers.len()
    ));
    out
}

/// Writes `cell` padded with spaces to `width` characters, right-aligned when `right`. By hand,
/// not with `format!`'s `{:width$}`: a width past 65,535 (a very long layer name) panics there.
pub(crate) fn pad(out: &mut String, cell: &str, width: usize, right: bool) {
    let fill = width.saturating_sub(cell.chars().count());
    if right {
        out.extend(std::iter::repeat_n(' ', fill));
        out.push_str(cell);
    } else {
        out.push_str(cell);
        out.extend(std::iter::repeat_n(' ', fill));
    }
}

/// A name as one table cell on one line: control characters (a newline, a tab) are written
/// as escapes (`\n`, `\t`, `\u{1b}`), so a layer name from a profile cannot break a row.
pub fn escape_control(text: &str) -> std::borrow::Cow<'_, str> {
    if text.chars().any(char::is_control) {
        text.chars()
            .map(|c| {
                if c.is_control() {
                    c.escape_default().to_string()
                } else {
                    c.to_string()
                }
            })
            .collect::<String>()
            .into()
    } else {
        text.into()
    }
}
