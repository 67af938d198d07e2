//! Presenting a [`Solution`]: the `--json` document that scripts read (its shape is a public
//! contract, see docs/cli.md "JSON output") and the table people read.

pub use crate::solver::device::cudnn_version_string;
use crate::solver::units::format_bytes;
use crate::solver::{AlgoKind, Mode, Plan, Solution};
use serde::Serialize;
use std::collections::HashMap;
use std::fmt::Write as _;

/// The `--json` document.
#[derive(Debug, Serialize)]
pub struct SolutionJson {
    pub mode: &'static str,
    pub policy: &'static str,
    pub plans: Vec<PlanJson>,
    pub total_time_ms: f64,
    pub total_undivided_ms: Option<f64>,
    pub total_workspace_bytes: u64,
}

#[derive(Debug, Serialize)]
pub struct PlanJson {
    pub layer: String,
    pub dtype: &'static str,
    pub layout: &'static str,
    pub op: &'static str,
    pub n: i64,
    pub undivided_ms: Option<f64>,
    pub time_ms: f64,
    pub workspace_bytes: u64,
    pub micro_batches: Vec<MicroBatchJson>,
}

#[derive(Debug, Serialize)]
pub struct MicroBatchJson {
    pub size: i64,
    /// `legacy` or `engine`.
    pub kind: AlgoKind,
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
                        layout: plan.problem.layout.name(),
                        op: plan.op.name(),
                        n: plan.problem.n,
                        undivided_ms: solved.undivided.as_ref().map(Plan::time_ms),
                        time_ms: plan.time_ms(),
                        workspace_bytes: plan.workspace_bytes(),
                        micro_batches: plan
                            .micro_batches
                            .iter()
                            .map(|m| MicroBatchJson {
                                size: m.size,
                                kind: m.algo.kind(),
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
                    format!("{} (x{times})", plan.layer)
                } else {
                    plan.layer.clone()
                },
                plan.problem.dtype.to_string(),
                plan.problem.layout.to_string(),
                plan.op.to_string(),
                undivided.map_or("-".into(), ms),
                ms(plan.time_ms()),
                speedup(undivided, plan.time_ms()),
                format_bytes(plan.workspace_bytes()),
                plan.split_string(),
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
            solved.plan.problem.dtype, solved.plan.problem.layout
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
            if numeric(column) {
                let _ = write!(text, "{cell:>width$}");
            } else {
                let _ = write!(text, "{cell:<width$}");
            }
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
pub fn verification_json(
    solution: &Solution,
    measured: &[crate::exec::verify::Measured],
) -> serde_json::Value {
    let plans: Vec<serde_json::Value> = solution
        .problems
        .iter()
        .zip(measured)
        .map(|(solved, m)| {
            serde_json::json!({
                "layer": solved.plan.layer,
                "dtype": solved.plan.problem.dtype.name(),
                "layout": solved.plan.problem.layout.name(),
                "op": solved.plan.op.name(),
                "predicted_ms": solved.plan.time_ms(),
                "measured_ms": m.plan_ms,
                "predicted_undivided_ms": solved.undivided.as_ref().map(Plan::time_ms),
                "measured_undivided_ms": m.undivided_ms,
            })
        })
        .collect();
    let total: f64 = measured.iter().map(|m| m.plan_ms).sum();
    let undivided: Option<f64> = measured.iter().map(|m| m.undivided_ms).sum();
    serde_json::json!({"plans": plans, "total_measured_ms": total, "total_measured_undivided_ms": undivided})
}

/// The human table of `tune --verify`.
pub fn render_verification(
    solution: &Solution,
    measured: &[crate::exec::verify::Measured],
) -> String {
    let row = |layer: &str, op: &str, cells: [String; 5]| {
        format!(
            "{layer:<28} {op:<10} {:>12} {:>12} {:>14} {:>14} {:>8}\n",
            cells[0], cells[1], cells[2], cells[3], cells[4]
        )
    };
    let mut out = row(
        "layer",
        "op",
        [
            "predicted ms",
            "measured ms",
            "undivided pred",
            "undivided meas",
            "speedup",
        ]
        .map(String::from),
    );
    for (solved, m) in solution.problems.iter().zip(measured) {
        let label = format!("{} {}", solved.plan.layer, solved.plan.problem.dtype);
        out += &row(
            &label,
            solved.plan.op.name(),
            [
                ms(solved.plan.time_ms()),
                ms(m.plan_ms),
                solved
                    .undivided
                    .as_ref()
                    .map_or("-".into(), |u| ms(u.time_ms())),
                m.undivided_ms.map_or("-".into(), ms),
                speedup(m.undivided_ms, m.plan_ms),
            ],
        );
    }
    let total: f64 = measured.iter().map(|m| m.plan_ms).sum();
    let undivided: Option<f64> = measured.iter().map(|m| m.undivided_ms).sum();
    out += &row(
        "total",
        "",
        [
            ms(solution.total_time_ms()),
            ms(total),
            solution.total_undivided_ms().map_or("-".into(), ms),
            undivided.map_or("-".into(), ms),
            speedup(undivided, total),
        ],
    );
    out
}
