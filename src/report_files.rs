//! Report files: a tuning result written to a directory as Markdown and SVG charts, for people
//! to read and share (`mucudnn tune ... --report DIR`).
//!
//! Data enters as a [`ReportInput`]: the raw [`Profile`], the [`Solution`] solved from it,
//! what ran it (device, cuDNN version) and, optionally, how many layers of the network each
//! distinct layer stands for. [`write_report`] writes, and returns the paths of:
//!
//! - `report.md`: the settings, the plan table (one row per (layer, dtype, layout, op)),
//!   totals per dtype/layout and overall (and weighted by multiplicity when it is known), and
//!   the charts below, linked.
//! - `speedup.svg`: a bar per (layer, op): the undivided time over the micro-batched time.
//! - `pareto/LAYER.DTYPE.LAYOUT.OP.svg`: per tuning problem, the time/workspace Pareto front of
//!   micro-batched plans under the solution's policy (from [`pareto_front`]), the chosen plan
//!   (an element with `class="chosen"`), the undivided baseline (`class="undivided"`) and, in
//!   WR mode, the per-layer limit.
//!
//! Charts are drawn with plotters' SVG backend, which writes text as SVG `<text>` elements, so
//! captions and labels need no font feature. Plotters has no way to tag an element, so the two
//! markers a reader (or a test) must find are appended as SVG of our own at the pixel
//! positions plotters maps their data to.
//!
//! The x axis of a Pareto chart is workspace on a log scale shifted by 1 KiB
//! (`log2(1 + bytes / 1 KiB)`), so that zero workspace (common: algorithm 0) sits at the left
//! edge while MiB and GiB values stay apart; ticks are labelled in bytes.

use crate::report::cudnn_version_string;
use crate::solver::units::format_bytes;
use crate::solver::{
    pareto_front, Mode, OpProfile, Plan, ProblemName, Profile, Solution, SolveError, SolvedProblem,
};
use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint, Ranged};
use plotters::prelude::*;
use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::ops::Range;
use std::path::{Path, PathBuf};

/// What a report is made of.
#[derive(Clone, Copy, Debug)]
pub struct ReportInput<'a> {
    /// The measurements the solution was solved from.
    pub profile: &'a Profile,
    pub solution: &'a Solution,
    /// What measured, in words (e.g. a `DeviceFingerprint`'s description, or `profile.device`).
    pub device: &'a str,
    /// cuDNN's version number (91900), when cuDNN measured.
    pub cudnn_version: Option<u64>,
    /// Layer name -> how many layers of the network have its shape
    /// (`crate::models::multiplicities`). Layers missing from the map count once.
    pub multiplicity: Option<&'a HashMap<String, u32>>,
    /// The report's title; `mucudnn tuning report` when `None`.
    pub title: Option<&'a str>,
}

/// Why a report could not be written.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("cannot write {}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot draw {}: {message}", path.display())]
    Plot { path: PathBuf, message: String },
    #[error("{name}: the solution has a plan for it but the profile has no measurements of it")]
    MissingEntry { name: ProblemName },
    #[error(transparent)]
    Solve(#[from] SolveError),
}

/// Writes `report.md`, `speedup.svg` and one Pareto chart per (layer, dtype, layout, op) into
/// `dir` (created if needed; existing files of the same names are replaced). Returns the paths
/// written, `report.md` first.
pub fn write_report(dir: &Path, input: &ReportInput<'_>) -> Result<Vec<PathBuf>, ReportError> {
    let pareto_dir = dir.join("pareto");
    std::fs::create_dir_all(&pareto_dir).map_err(|source| ReportError::Io {
        path: pareto_dir.clone(),
        source,
    })?;
    let mut written = vec![dir.join("report.md"), dir.join("speedup.svg")];
    let mut used_names = HashSet::new();
    let mut charts = Vec::with_capacity(input.solution.problems.len());
    for solved in &input.solution.problems {
        let name = problem_name(&solved.plan);
        let entry = input
            .profile
            .entries
            .iter()
            .find(|e| e.name() == name)
            .ok_or_else(|| ReportError::MissingEntry { name: name.clone() })?;
        let file_name = unique_file_name(&name, &mut used_names);
        let path = pareto_dir.join(&file_name);
        let svg = pareto_svg(entry, solved, input.solution).map_err(|err| match err {
            ChartError::Solve(err) => ReportError::Solve(err),
            ChartError::Draw(message) => ReportError::Plot {
                path: path.clone(),
                message,
            },
        })?;
        write(&path, &svg)?;
        charts.push((name, format!("pareto/{file_name}")));
        written.push(path);
    }
    let speedup_path = dir.join("speedup.svg");
    let svg = speedup_svg(input.solution).map_err(|message| ReportError::Plot {
        path: speedup_path.clone(),
        message,
    })?;
    write(&speedup_path, &svg)?;
    write(&dir.join("report.md"), &render_markdown(input, &charts))?;
    Ok(written)
}

fn write(path: &Path, text: &str) -> Result<(), ReportError> {
    std::fs::write(path, text).map_err(|source| ReportError::Io {
        path: path.to_path_buf(),
        source,
    })
}

fn problem_name(plan: &Plan) -> ProblemName {
    ProblemName {
        layer: plan.layer.clone(),
        dtype: plan.problem.dtype,
        layout: plan.problem.layout,
        op: plan.op,
    }
}

/// `LAYER.DTYPE.LAYOUT.OP.svg` with only `[A-Za-z0-9._-]` in it (others become `_`), no
/// leading dot, and a `-2`, `-3`... suffix where two layer names sanitise alike.
fn unique_file_name(name: &ProblemName, used: &mut HashSet<String>) -> String {
    let layer: String = name
        .layer
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .take(120)
        .collect();
    let layer = layer.trim_start_matches('.');
    let layer = if layer.is_empty() { "layer" } else { layer };
    let stem = format!("{layer}.{}.{}.{}", name.dtype, name.layout, name.op);
    let mut candidate = format!("{stem}.svg");
    let mut suffix = 2;
    // Case-insensitive file systems would merge names differing only in case.
    while !used.insert(candidate.to_ascii_lowercase()) {
        candidate = format!("{stem}-{suffix}.svg");
        suffix += 1;
    }
    candidate
}

// ---------------------------------------------------------------------------------------
// report.md

use crate::report::{ms, speedup as speedup_text};

/// Markdown table cells: a `|` would end the cell, a newline the row.
fn md(text: &str) -> String {
    crate::report::escape_control(text).replace('|', "\\|")
}

fn describe_constraint(mode: Mode) -> String {
    match mode {
        Mode::WorkspaceReuse {
            workspace_limit_bytes,
        } => format!(
            "workspace reuse (WR): at most {} per (layer, op), one buffer reused",
            format_bytes(workspace_limit_bytes)
        ),
        Mode::WorkspaceDivision {
            total_workspace_bytes,
        } => format!(
            "workspace division (WD): {} in total, divided among all (layer, op) pairs",
            format_bytes(total_workspace_bytes)
        ),
    }
}

/// Sums over a set of problems, each weighted by `weight`.
struct Totals {
    undivided_ms: Option<f64>,
    time_ms: f64,
}

fn totals<'a>(
    problems: impl Iterator<Item = &'a SolvedProblem>,
    weight: impl Fn(&SolvedProblem) -> f64,
) -> Totals {
    let mut undivided_ms = Some(0.0);
    let mut time_ms = 0.0;
    for solved in problems {
        let w = weight(solved);
        time_ms += w * solved.plan.time_ms();
        undivided_ms = match (undivided_ms, &solved.undivided) {
            (Some(sum), Some(plan)) => Some(sum + w * plan.time_ms()),
            _ => None,
        };
    }
    Totals {
        undivided_ms,
        time_ms,
    }
}

fn render_markdown(input: &ReportInput<'_>, charts: &[(ProblemName, String)]) -> String {
    let solution = input.solution;
    let mut out = String::new();
    let title = input.title.unwrap_or("mucudnn tuning report");
    let _ = writeln!(out, "# {title}\n");
    let _ = writeln!(out, "| setting | value |\n|---|---|");
    let _ = writeln!(out, "| device | {} |", md(input.device));
    let cudnn = input
        .cudnn_version
        .map_or_else(|| "not used".to_string(), cudnn_version_string);
    let _ = writeln!(out, "| cuDNN | {cudnn} |");
    let _ = writeln!(
        out,
        "| mode | {} |",
        md(&describe_constraint(solution.mode))
    );
    let _ = writeln!(
        out,
        "| policy | {} (the micro-batch sizes a plan may use) |",
        solution.policy
    );
    let optimality = if solution.proven_optimal {
        "optimal"
    } else {
        "feasible, not proven optimal (the MILP stopped at its time limit)"
    };
    let _ = writeln!(out, "| solver | {}, {optimality} |", solution.method);
    if let Some(timing) = &input.profile.timing {
        let _ = writeln!(out, "| timing | {} |", md(timing));
    }
    if let Some(math) = &input.profile.math {
        let _ = writeln!(out, "| math | {} |", md(math));
    }
    out.push('\n');

    // The plan table.
    let multiplicity = input.multiplicity;
    let count_of = |layer: &str| -> u32 {
        multiplicity
            .and_then(|m| m.get(layer))
            .copied()
            .unwrap_or(1)
    };
    let _ = writeln!(out, "## Plans\n");
    let _ = writeln!(
        out,
        "One row per (layer, dtype, layout, op). *Undivided*: the best single algorithm on the \
         whole mini-batch under the same constraint; *micro-batched*: the chosen plan; *split*: \
         `COUNTxSIZE@algoA` runs of micro-batches. Times are predicted from the measurements.\n"
    );
    let mut header = vec!["layer", "dtype", "layout", "op", "n"];
    if multiplicity.is_some() {
        header.push("layers");
    }
    header.extend([
        "undivided ms",
        "micro-batched ms",
        "speedup",
        "workspace",
        "split",
        "chart",
    ]);
    let _ = writeln!(out, "| {} |", header.join(" | "));
    let align: Vec<&str> = header
        .iter()
        .map(|h| {
            if matches!(
                *h,
                "n" | "layers" | "undivided ms" | "micro-batched ms" | "speedup" | "workspace"
            ) {
                "---:"
            } else {
                "---"
            }
        })
        .collect();
    let _ = writeln!(out, "|{}|", align.join("|"));
    for (solved, (_, chart)) in solution.problems.iter().zip(charts) {
        let plan = &solved.plan;
        let undivided = solved.undivided.as_ref().map(Plan::time_ms);
        let mut cells = vec![
            md(&plan.layer),
            plan.problem.dtype.to_string(),
            plan.problem.layout.to_string(),
            plan.op.to_string(),
            plan.problem.n.to_string(),
        ];
        if multiplicity.is_some() {
            cells.push(count_of(&plan.layer).to_string());
        }
        cells.extend([
            undivided.map_or("-".into(), ms),
            ms(plan.time_ms()),
            speedup_text(undivided, plan.time_ms()),
            format_bytes(plan.workspace_bytes()),
            format!("`{}`", plan.split_string()),
            format!("[svg]({chart})"),
        ]);
        let _ = writeln!(out, "| {} |", cells.join(" | "));
    }
    out.push('\n');

    // Totals: per (dtype, layout) when the profile mixes them, then overall.
    let mut groups: Vec<(String, Vec<&SolvedProblem>)> = Vec::new();
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
    let (workspace_rule, combine): (&str, fn(u64, u64) -> u64) = match solution.mode {
        Mode::WorkspaceReuse { .. } => (
            "the largest plan's, since the (layer, op) pairs run one at a time and reuse one buffer",
            u64::max,
        ),
        Mode::WorkspaceDivision { .. } => (
            "the sum, since every (layer, op) pair keeps its own share",
            u64::saturating_add,
        ),
    };
    let workspace_of = |members: &[&SolvedProblem]| {
        members
            .iter()
            .map(|s| s.plan.workspace_bytes())
            .fold(0, combine)
    };
    let total_table =
        |out: &mut String, weight: &dyn Fn(&SolvedProblem) -> f64, with_workspace: bool| {
            let _ = writeln!(
                out,
                "| scope | undivided ms | micro-batched ms | speedup |{}",
                if with_workspace { " workspace |" } else { "" }
            );
            let _ = writeln!(
                out,
                "|---|---:|---:|---:|{}",
                if with_workspace { "---:|" } else { "" }
            );
            let mut rows: Vec<(String, Vec<&SolvedProblem>)> = Vec::new();
            if groups.len() > 1 {
                rows.extend(groups.iter().cloned());
            }
            rows.push(("**all**".into(), solution.problems.iter().collect()));
            for (label, members) in rows {
                let sums = totals(members.iter().copied(), weight);
                let workspace = if with_workspace {
                    format!(" {} |", format_bytes(workspace_of(&members)))
                } else {
                    String::new()
                };
                let _ = writeln!(
                    out,
                    "| {label} | {} | {} | {} |{workspace}",
                    sums.undivided_ms.map_or("-".into(), ms),
                    ms(sums.time_ms),
                    speedup_text(sums.undivided_ms, sums.time_ms),
                );
            }
            out.push('\n');
        };
    let _ = writeln!(out, "## Totals\n");
    let _ = writeln!(
        out,
        "Each distinct (layer, op) counted once. Workspace: {workspace_rule}. The undivided \
         total is `-` when some (layer, op) has no single algorithm that fits.\n"
    );
    total_table(&mut out, &|_| 1.0, true);
    if multiplicity.is_some() {
        let _ = writeln!(out, "### Totals weighted by multiplicity\n");
        let _ = writeln!(
            out,
            "Each distinct (layer, op) counted as many times as the network has layers of its \
             shape (the `layers` column): the predicted convolution time of the whole network, for \
             the ops profiled.\n"
        );
        total_table(&mut out, &|s| f64::from(count_of(&s.plan.layer)), false);
    }

    if let Some(summary) = crate::report::kind_summary(input.solution) {
        let _ = writeln!(out, "### Which candidates won\n");
        let _ = writeln!(
            out,
            "Engine configurations of cuDNN's graph API and legacy algorithms competed at every \
             micro-batch size; {}.\n",
            summary.trim_start_matches("winners: ")
        );
    }

    let _ = writeln!(out, "## Speedup\n");
    let _ = writeln!(
        out,
        "![speedup per layer and op: undivided time / micro-batched time](speedup.svg)\n"
    );
    let _ = writeln!(out, "## Pareto fronts\n");
    let _ = writeln!(
        out,
        "Per (layer, op): the fastest plan within each workspace limit (policy {}), the chosen \
         plan (red dot), the undivided baseline (black square){}.\n",
        solution.policy,
        match solution.mode {
            Mode::WorkspaceReuse { .. } => " and the per-layer limit (dashed)",
            Mode::WorkspaceDivision { .. } => "",
        }
    );
    for (name, chart) in charts {
        let _ = writeln!(
            out,
            "### {}\n\n![{}]({chart})\n",
            md(&name.to_string()),
            md(&name.to_string())
        );
    }
    out
}

// ---------------------------------------------------------------------------------------
// Charts

enum ChartError {
    Solve(SolveError),
    Draw(String),
}

fn draw_error<E: std::fmt::Debug>(err: E) -> String {
    format!("{err:?}")
}

const CHOSEN: RGBColor = RGBColor(214, 39, 40);
const FRONT: RGBColor = RGBColor(31, 119, 180);
const LIMIT: RGBColor = RGBColor(127, 127, 127);
const FASTER: RGBColor = RGBColor(44, 160, 44);
const SAME: RGBColor = RGBColor(160, 160, 160);
const SLOWER: RGBColor = RGBColor(255, 127, 14);

/// A linear axis with exactly the given ticks. (plotters' own `with_key_points` does the same
/// but, in 0.3.7, cannot take a label formatter.)
struct TickedAxis {
    range: Range<f64>,
    ticks: Vec<f64>,
}

impl Ranged for TickedAxis {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        let span = self.range.end - self.range.start;
        let ratio = if span > 0.0 {
            (value - self.range.start) / span
        } else {
            0.0
        };
        limit.0 + (ratio * f64::from(limit.1 - limit.0)).round() as i32
    }

    fn key_points<Hint: KeyPointHint>(&self, _hint: Hint) -> Vec<f64> {
        self.ticks.clone()
    }

    fn range(&self) -> Range<f64> {
        self.range.clone()
    }
}

/// The x position of a workspace size: `log2(1 + bytes / 1 KiB)`, 0 at 0 bytes.
fn workspace_x(bytes: u64) -> f64 {
    (1.0 + bytes as f64 / 1024.0).log2()
}

fn workspace_from_x(x: f64) -> u64 {
    let bytes = ((2f64.powf(x) - 1.0) * 1024.0).round();
    if bytes.is_finite() && bytes > 0.0 {
        bytes as u64
    } else {
        0
    }
}

/// Ticks at 0 and at powers of two from 1 KiB, spaced so that there are at most 7.
fn workspace_ticks(max_x: f64) -> Vec<f64> {
    let exponents: Vec<u32> = (10..=50)
        .take_while(|&e| workspace_x(1u64 << e) <= max_x)
        .collect();
    let step = [1, 2, 5, 10]
        .into_iter()
        .find(|&step| exponents.iter().filter(|e| *e % step == 0).count() < 7)
        .unwrap_or(10);
    std::iter::once(0.0)
        .chain(
            exponents
                .into_iter()
                .filter(|e| e % step == 0)
                .map(|e| workspace_x(1u64 << e)),
        )
        .collect()
}

fn xml_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c if c.is_control() => out.push(' '),
            c => out.push(c),
        }
    }
    out
}

/// Inserts our own elements just before the closing `</svg>`.
fn append_to_svg(svg: &mut String, elements: &str) {
    let at = svg.rfind("</svg>").unwrap_or(svg.len());
    svg.insert_str(at, elements);
}

/// One tuning problem's Pareto chart.
fn pareto_svg(
    entry: &OpProfile,
    solved: &SolvedProblem,
    solution: &Solution,
) -> Result<String, ChartError> {
    let front = pareto_front(entry, solution.policy).map_err(ChartError::Solve)?;
    let plan = &solved.plan;
    let chosen = (plan.workspace_bytes(), plan.time_ms());
    let undivided = solved
        .undivided
        .as_ref()
        .map(|u| (u.workspace_bytes(), u.time_ms(), u.split_string()));
    let limit = match solution.mode {
        Mode::WorkspaceReuse {
            workspace_limit_bytes,
        } => Some(workspace_limit_bytes),
        Mode::WorkspaceDivision { .. } => None,
    };
    let points: Vec<(f64, f64)> = front
        .iter()
        .map(|p| (workspace_x(p.workspace_bytes), p.time_ms))
        .collect();
    let mut max_x = points
        .iter()
        .map(|p| p.0)
        .chain([workspace_x(chosen.0)])
        .chain(undivided.iter().map(|u| workspace_x(u.0)))
        .fold(workspace_x(1024), f64::max);
    // Draw the limit unless it is so far right that it would squash the front (the legend
    // still names it).
    let limit_drawn = limit.filter(|&l| workspace_x(l) <= max_x + 4.0);
    if let Some(l) = limit_drawn {
        max_x = max_x.max(workspace_x(l));
    }
    let max_y = points
        .iter()
        .map(|p| p.1)
        .chain([chosen.1])
        .chain(undivided.iter().map(|u| u.1))
        .fold(0.0, f64::max)
        * 1.15;
    let max_y = if max_y > 0.0 { max_y } else { 1.0 };
    // Enough decimals to tell the ticks apart, no more.
    let decimals = match max_y {
        y if y >= 100.0 => 0,
        y if y >= 10.0 => 1,
        y if y >= 1.0 => 2,
        _ => 3,
    };
    let pad = max_x * 0.04;
    let x_range = TickedAxis {
        range: -pad..max_x + pad,
        ticks: workspace_ticks(max_x + pad),
    };

    let mut svg = String::new();
    let mut markers = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (760, 480)).into_drawing_area();
        root.fill(&WHITE)
            .map_err(draw_error)
            .map_err(ChartError::Draw)?;
        let caption = format!(
            "{} {} {} {}",
            entry.layer, entry.problem.dtype, entry.problem.layout, entry.op
        );
        let mut chart = ChartBuilder::on(&root)
            .caption(caption, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(44)
            .y_label_area_size(64)
            .build_cartesian_2d(x_range, 0f64..max_y)
            .map_err(draw_error)
            .map_err(ChartError::Draw)?;
        chart
            .configure_mesh()
            .x_desc("workspace (log scale, 0 at the left)")
            .y_desc("time (ms)")
            .x_label_formatter(&|x| format_bytes(workspace_from_x(*x)))
            .y_label_formatter(&|y| format!("{y:.decimals$}"))
            .light_line_style(WHITE)
            .draw()
            .map_err(draw_error)
            .map_err(ChartError::Draw)?;
        // The front as a staircase: a plan's time holds until the next point's workspace.
        let mut stairs = Vec::with_capacity(points.len() * 2 + 1);
        for (i, &(x, y)) in points.iter().enumerate() {
            stairs.push((x, y));
            let next_x = points.get(i + 1).map_or(max_x + pad, |p| p.0);
            stairs.push((next_x, y));
        }
        chart
            .draw_series(LineSeries::new(stairs, FRONT.stroke_width(2)))
            .map_err(draw_error)
            .map_err(ChartError::Draw)?
            .label(format!(
                "Pareto front, policy {} ({} points)",
                solution.policy,
                points.len()
            ))
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], FRONT.stroke_width(2)));
        chart
            .draw_series(points.iter().map(|&p| Circle::new(p, 3, FRONT.filled())))
            .map_err(draw_error)
            .map_err(ChartError::Draw)?;
        match (limit, limit_drawn) {
            (Some(l), Some(_)) => {
                let x = workspace_x(l);
                chart
                    .draw_series(DashedLineSeries::new(
                        vec![(x, 0.0), (x, max_y)],
                        6,
                        4,
                        LIMIT.stroke_width(1),
                    ))
                    .map_err(draw_error)
                    .map_err(ChartError::Draw)?
                    .label(format!("limit {}", format_bytes(l)))
                    .legend(|(x, y)| {
                        // Two dashes, like the line.
                        EmptyElement::at((x, y))
                            + PathElement::new(vec![(0, 0), (8, 0)], LIMIT.stroke_width(1))
                            + PathElement::new(vec![(12, 0), (20, 0)], LIMIT.stroke_width(1))
                    });
            }
            (Some(l), None) => {
                chart
                    .draw_series(std::iter::empty::<PathElement<(f64, f64)>>())
                    .map_err(draw_error)
                    .map_err(ChartError::Draw)?
                    .label(format!("limit {} (far to the right)", format_bytes(l)));
            }
            _ => {}
        }
        // The markers themselves are appended below; these empty series only add legend rows.
        let chosen_label = format!(
            "chosen: {} ({} ms, {})",
            plan.split_string(),
            ms(chosen.1),
            format_bytes(chosen.0)
        );
        chart
            .draw_series(std::iter::empty::<Circle<(f64, f64), i32>>())
            .map_err(draw_error)
            .map_err(ChartError::Draw)?
            .label(chosen_label.clone())
            .legend(|(x, y)| Circle::new((x + 10, y), 6, CHOSEN.filled()));
        let (cx, cy) = chart.backend_coord(&(workspace_x(chosen.0), chosen.1));
        if let Some((ws, time, split)) = &undivided {
            let label = format!(
                "undivided: {split} ({} ms, {})",
                ms(*time),
                format_bytes(*ws)
            );
            chart
                .draw_series(std::iter::empty::<Rectangle<(f64, f64)>>())
                .map_err(draw_error)
                .map_err(ChartError::Draw)?
                .label(label.clone())
                .legend(|(x, y)| {
                    Rectangle::new([(x + 5, y - 5), (x + 15, y + 5)], BLACK.stroke_width(2))
                });
            let (ux, uy) = chart.backend_coord(&(workspace_x(*ws), *time));
            let _ = writeln!(
                markers,
                "<rect class=\"undivided\" x=\"{}\" y=\"{}\" width=\"12\" height=\"12\" fill=\"none\" stroke=\"#000000\" stroke-width=\"2\"><title>{}</title></rect>",
                ux - 6,
                uy - 6,
                xml_escape(&label)
            );
        }
        let RGBColor(red, green, blue) = CHOSEN;
        let _ = writeln!(
            markers,
            "<circle class=\"chosen\" cx=\"{cx}\" cy=\"{cy}\" r=\"6\" fill=\"#{red:02X}{green:02X}{blue:02X}\" stroke=\"#000000\" stroke-width=\"1\"><title>{}</title></circle>",
            xml_escape(&chosen_label)
        );
        chart
            .configure_series_labels()
            // The front falls from the top left to the bottom right: the lower left is free.
            .position(SeriesLabelPosition::LowerLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 13))
            .draw()
            .map_err(draw_error)
            .map_err(ChartError::Draw)?;
        root.present()
            .map_err(draw_error)
            .map_err(ChartError::Draw)?;
    }
    append_to_svg(&mut svg, &markers);
    Ok(svg)
}

/// Horizontal bars, one per (layer, dtype, layout, op), top to bottom in solution order.
fn speedup_svg(solution: &Solution) -> Result<String, String> {
    let mixed = solution.problems.iter().any(|s| {
        let first = &solution.problems[0].plan.problem;
        (s.plan.problem.dtype, s.plan.problem.layout) != (first.dtype, first.layout)
    });
    let bars: Vec<(String, Option<f64>)> = solution
        .problems
        .iter()
        .map(|s| {
            let p = &s.plan;
            let label = if mixed {
                format!(
                    "{} {} {} {}",
                    p.layer, p.problem.dtype, p.problem.layout, p.op
                )
            } else {
                format!("{} {}", p.layer, p.op)
            };
            let speedup = s
                .undivided
                .as_ref()
                .map(|u| u.time_ms() / p.time_ms())
                .filter(|s| s.is_finite());
            (label, speedup)
        })
        .collect();
    let rows = bars.len().max(1);
    // Log scale: speedups are ratios, and one large outlier would flatten a linear axis. Bars
    // start at 1x. In WD mode a single (layer, op) can be slower than its undivided baseline
    // (the budget goes where it helps the total most), so the axis extends below 1x then.
    let max_speedup = bars.iter().filter_map(|b| b.1).fold(2.0, f64::max);
    let min_speedup = bars.iter().filter_map(|b| b.1).fold(1.0, f64::min);
    let max_x = max_speedup.log10() * 1.12;
    let min_x = min_speedup.log10() * 1.12 - if min_speedup < 1.0 { 0.03 } else { 0.0 };
    let x_ticks: Vec<f64> = (-8..8)
        .flat_map(|decade| [1.0, 2.0, 5.0].map(|m| m * 10f64.powi(decade)))
        .filter(|&t| t >= min_speedup / 1.05 && t <= max_speedup * 1.05)
        .map(f64::log10)
        .collect();
    let longest = bars.iter().map(|b| b.0.chars().count()).max().unwrap_or(0);
    let label_width = (longest as u32 * 7 + 16).clamp(80, 480);
    let height = 110 + 22 * rows as u32;
    // Row i is drawn at y = rows - 1 - i, so that the first row is at the top.
    let y_of = |i: usize| (rows - 1 - i) as f64;
    let key_points: Vec<f64> = (0..bars.len()).map(y_of).collect();
    let labels: HashMap<i64, String> = bars
        .iter()
        .enumerate()
        .map(|(i, b)| (y_of(i) as i64, b.0.clone()))
        .collect();
    let mut svg = String::new();
    {
        let root =
            SVGBackend::with_string(&mut svg, (label_width + 520, height)).into_drawing_area();
        root.fill(&WHITE).map_err(draw_error)?;
        let title = match solution.mode {
            Mode::WorkspaceReuse {
                workspace_limit_bytes,
            } => format!(
                "Speedup over the best single algorithm (WR, {} per layer, {})",
                format_bytes(workspace_limit_bytes),
                solution.policy
            ),
            Mode::WorkspaceDivision {
                total_workspace_bytes,
            } => format!(
                "Speedup over the best undivided assignment (WD, {} in total, {})",
                format_bytes(total_workspace_bytes),
                solution.policy
            ),
        };
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 17))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(label_width)
            .build_cartesian_2d(
                TickedAxis {
                    range: min_x..max_x,
                    ticks: x_ticks,
                },
                TickedAxis {
                    range: -0.5..rows as f64 - 0.5,
                    ticks: key_points,
                },
            )
            .map_err(draw_error)?;
        chart
            .configure_mesh()
            .disable_y_mesh()
            .light_line_style(WHITE)
            .x_desc("speedup: undivided ms / micro-batched ms (log scale)")
            .y_label_formatter(&|y| labels.get(&(y.round() as i64)).cloned().unwrap_or_default())
            .x_label_formatter(&|x| format!("{}x", 10f64.powf(*x) as f32))
            .draw()
            .map_err(draw_error)?;
        chart
            .draw_series(bars.iter().enumerate().filter_map(|(i, (_, speedup))| {
                let s = (*speedup)?;
                let y = y_of(i);
                let color = match s {
                    s if s > 1.0 + 1e-9 => FASTER,
                    s if s < 1.0 - 1e-9 => SLOWER,
                    _ => SAME,
                };
                Some(Rectangle::new(
                    [(0.0, y - 0.35), (s.log10(), y + 0.35)],
                    color.filled(),
                ))
            }))
            .map_err(draw_error)?;
        // The 1x line, which is not the axis when some bar goes left of it.
        chart
            .draw_series(LineSeries::new(
                vec![(0.0, -0.5), (0.0, rows as f64 - 0.5)],
                BLACK.stroke_width(1),
            ))
            .map_err(draw_error)?;
        let value_style = ("sans-serif", 12).into_font().color(&BLACK).pos(
            plotters::style::text_anchor::Pos::new(
                plotters::style::text_anchor::HPos::Left,
                plotters::style::text_anchor::VPos::Center,
            ),
        );
        chart
            .draw_series(bars.iter().enumerate().map(|(i, (_, speedup))| {
                let (x, text) = match speedup {
                    Some(s) => (s.log10().max(0.0), format!(" {s:.2}x")),
                    None => (0.0, " no single algorithm fits".to_string()),
                };
                Text::new(text, (x, y_of(i)), value_style.clone())
            }))
            .map_err(draw_error)?;
        root.present().map_err(draw_error)?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::solver::interchange::from_json_str;
    use crate::solver::{solve_profile, DType, Policy, WdOptions};

    fn fixture() -> Profile {
        from_json_str(include_str!("../tests/fixtures/h100-alexnet-profile.json")).unwrap()
    }

    fn temp_dir(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("mucudnn-report-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    /// A small XML well-formedness check (no crate for it in the lock file): one root element,
    /// tags nest and match, attributes are quoted, `&` only starts a known entity, and `<`
    /// never appears in text or attribute values.
    fn check_xml(text: &str) -> Result<(), String> {
        fn entity_ok(rest: &str) -> bool {
            let Some(end) = rest.find(';') else {
                return false;
            };
            let name = &rest[1..end];
            matches!(name, "amp" | "lt" | "gt" | "quot" | "apos")
                || name
                    .strip_prefix("#x")
                    .is_some_and(|h| !h.is_empty() && h.chars().all(|c| c.is_ascii_hexdigit()))
                || name
                    .strip_prefix('#')
                    .is_some_and(|d| !d.is_empty() && d.chars().all(|c| c.is_ascii_digit()))
        }
        fn check_text(text: &str) -> Result<(), String> {
            for (i, _) in text.match_indices('&') {
                if !entity_ok(&text[i..]) {
                    return Err(format!(
                        "bad entity near {:?}",
                        &text[i..text.len().min(i + 12)]
                    ));
                }
            }
            Ok(())
        }
        let is_name = |s: &str| {
            !s.is_empty()
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | ':' | '.'))
        };
        let mut stack: Vec<&str> = Vec::new();
        let mut roots = 0;
        let mut rest = text;
        while let Some(open) = rest.find('<') {
            let before = &rest[..open];
            if stack.is_empty() && !before.trim().is_empty() {
                return Err(format!("text outside the root: {before:?}"));
            }
            check_text(before)?;
            rest = &rest[open..];
            if let Some(body) = rest.strip_prefix("<?") {
                let end = body.find("?>").ok_or("unterminated <?")?;
                rest = &body[end + 2..];
                continue;
            }
            if let Some(body) = rest.strip_prefix("<!--") {
                let end = body.find("-->").ok_or("unterminated comment")?;
                rest = &body[end + 3..];
                continue;
            }
            let close = rest.find('>').ok_or("unterminated tag")?;
            let tag = &rest[1..close];
            rest = &rest[close + 1..];
            if tag.contains('<') {
                return Err(format!("`<` inside tag {tag:?}"));
            }
            if let Some(name) = tag.strip_prefix('/') {
                match stack.pop() {
                    Some(open_name) if open_name == name.trim() => continue,
                    other => return Err(format!("</{name}> closes {other:?}")),
                }
            }
            let self_closing = tag.ends_with('/');
            let tag = tag.trim_end_matches('/');
            let (name, mut attrs) = tag.split_once(char::is_whitespace).unwrap_or((tag, ""));
            if !is_name(name) {
                return Err(format!("bad element name {name:?}"));
            }
            let mut seen = HashSet::new();
            loop {
                attrs = attrs.trim_start();
                if attrs.is_empty() {
                    break;
                }
                let eq = attrs
                    .find('=')
                    .ok_or_else(|| format!("attribute without value in {tag:?}"))?;
                let attr = attrs[..eq].trim();
                if !is_name(attr) || !seen.insert(attr) {
                    return Err(format!("bad or repeated attribute {attr:?} in {tag:?}"));
                }
                let value = attrs[eq + 1..].trim_start();
                let quote = value.chars().next().filter(|q| *q == '"' || *q == '\'');
                let quote = quote.ok_or_else(|| format!("unquoted attribute {attr:?}"))?;
                let end = value[1..].find(quote).ok_or("unterminated attribute")?;
                check_text(&value[1..1 + end])?;
                attrs = &value[end + 2..];
            }
            if stack.is_empty() {
                roots += 1;
            }
            if !self_closing {
                stack.push(name);
            }
        }
        if !rest.trim().is_empty() {
            return Err(format!("text after the root: {rest:?}"));
        }
        match (stack.is_empty(), roots) {
            (true, 1) => Ok(()),
            (false, _) => Err(format!("unclosed elements {stack:?}")),
            (_, roots) => Err(format!("{roots} root elements")),
        }
    }

    #[test]
    fn xml_checker_catches_mistakes() {
        assert_eq!(
            check_xml("<?xml version=\"1.0\"?>\n<svg a=\"1\"><g><t>x &amp; y</t></g><c/></svg>\n"),
            Ok(())
        );
        for bad in [
            "<svg><g></svg>",
            "<svg></svg><svg></svg>",
            "<svg a=1></svg>",
            "<svg>a & b</svg>",
            "<svg a=\"1\" a=\"2\"></svg>",
            "<svg><text>1 < 2</text></svg>",
            "<svg>",
        ] {
            assert!(check_xml(bad).is_err(), "{bad}");
        }
    }

    fn read(path: &Path) -> String {
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    #[test]
    fn wr_report_on_alexnet() {
        let profile = fixture();
        let mode = Mode::WorkspaceReuse {
            workspace_limit_bytes: 64 << 20,
        };
        let solution =
            solve_profile(&profile, Policy::PowerOfTwo, mode, &WdOptions::default()).unwrap();
        let models =
            crate::models::Model::AlexNet.layers(256, DType::Fp32, crate::solver::Layout::Nchw);
        let mut multiplicity = crate::models::multiplicities(&models);
        // Pretend conv4's shape appears twice, to see the weighting.
        multiplicity.insert("alexnet.conv4".into(), 2);
        let dir = temp_dir("wr");
        let input = ReportInput {
            profile: &profile,
            solution: &solution,
            device: "NVIDIA H100 80GB HBM3 | test",
            cudnn_version: profile.cudnn_version,
            multiplicity: Some(&multiplicity),
            title: Some("AlexNet on an H100"),
        };
        let paths = write_report(&dir, &input).unwrap();
        // report.md, speedup.svg, one chart per (layer, dtype, layout, op).
        assert_eq!(paths.len(), 2 + solution.problems.len());
        assert_eq!(paths[0], dir.join("report.md"));
        let distinct: HashSet<&PathBuf> = paths.iter().collect();
        assert_eq!(distinct.len(), paths.len());
        for path in &paths {
            assert!(path.starts_with(&dir), "{}", path.display());
            let text = read(path);
            if path.extension().is_some_and(|e| e == "svg") {
                check_xml(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                assert!(text.contains("<text"), "{}: no text", path.display());
            }
        }
        for (solved, path) in solution.problems.iter().zip(&paths[2..]) {
            let svg = read(path);
            assert_eq!(
                svg.matches("class=\"chosen\"").count(),
                1,
                "{}",
                path.display()
            );
            assert_eq!(
                svg.matches("class=\"undivided\"").count(),
                usize::from(solved.undivided.is_some())
            );
            let name = path.file_name().unwrap().to_str().unwrap();
            assert_eq!(
                name,
                format!(
                    "{}.{}.{}.{}.svg",
                    solved.plan.layer,
                    solved.plan.problem.dtype,
                    solved.plan.problem.layout,
                    solved.plan.op
                )
            );
            // The caption names the problem; the legend names the split.
            assert!(svg.contains(&format!(
                "{} {}",
                solved.plan.layer, solved.plan.problem.dtype
            )));
            assert!(svg.contains(&xml_escape(&solved.plan.split_string())));
            assert!(svg.contains("limit 64 MiB"));
        }
        let speedup = read(&dir.join("speedup.svg"));
        // One label per (layer, op) with dtype and layout, since the profile mixes them.
        assert!(speedup.contains("alexnet.conv2 fp16 nhwc bwd_filter"));
        let md = read(&dir.join("report.md"));
        for part in [
            "# AlexNet on an H100",
            "| device | NVIDIA H100 80GB HBM3 \\| test |",
            "| cuDNN | 9.19.0 |",
            "at most 64 MiB per (layer, op)",
            "| policy | power-of-two",
            "| layer | dtype | layout | op | n | layers | undivided ms | micro-batched ms | speedup | workspace | split | chart |",
            "| alexnet.conv2 | fp32 | nchw | fwd | 256 | 1 | 10.081 | 1.229 | 8.20x | 41.2 MiB | `8x32@algo1` | [svg](pareto/alexnet.conv2.fp32.nchw.fwd.svg) |",
            "## Totals",
            "| fp32 nchw |",
            "| fp16 nhwc |",
            "### Totals weighted by multiplicity",
            "![speedup per layer and op",
            "![alexnet.conv5 fp16 nhwc bwd_filter](pareto/alexnet.conv5.fp16.nhwc.bwd_filter.svg)",
        ] {
            assert!(md.contains(part), "`{part}` not in report.md:\n{md}");
        }
        // The overall totals agree with the solution's.
        let all_row = md.lines().find(|l| l.starts_with("| **all** |")).unwrap();
        assert!(all_row.contains(&ms(solution.total_time_ms())), "{all_row}");
        assert!(
            all_row.contains(&format_bytes(solution.total_workspace_bytes())),
            "{all_row}"
        );
        // Weighted: conv4 counted twice.
        let conv4: f64 = solution
            .problems
            .iter()
            .filter(|s| s.plan.layer == "alexnet.conv4")
            .map(|s| s.plan.time_ms())
            .sum();
        let weighted_all = md
            .lines()
            .filter(|l| l.starts_with("| **all** |"))
            .nth(1)
            .unwrap();
        assert!(
            weighted_all.contains(&ms(solution.total_time_ms() + conv4)),
            "{weighted_all}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn wd_report_without_multiplicity_and_odd_names() {
        let mut profile = fixture();
        // Keep the fp32 forward problems, one renamed into something unsafe for a file name.
        profile
            .entries
            .retain(|e| e.problem.dtype == DType::Fp32 && e.op == crate::solver::ConvOp::Forward);
        profile.entries[0].layer = "../evil name|<x>".into();
        profile.entries[1].layer = "..\\evil name|<x>".into();
        let mode = Mode::WorkspaceDivision {
            total_workspace_bytes: 128 << 20,
        };
        let solution =
            solve_profile(&profile, Policy::PowerOfTwo, mode, &WdOptions::default()).unwrap();
        let dir = temp_dir("wd");
        let input = ReportInput {
            profile: &profile,
            solution: &solution,
            device: "cpu",
            cudnn_version: None,
            multiplicity: None,
            title: None,
        };
        let paths = write_report(&dir, &input).unwrap();
        let names: Vec<String> = paths[2..]
            .iter()
            .map(|p| p.file_name().unwrap().to_str().unwrap().to_string())
            .collect();
        assert_eq!(names[0], "_evil_name__x_.fp32.nchw.fwd.svg");
        assert_eq!(names[1], "_evil_name__x_.fp32.nchw.fwd-2.svg");
        for path in &paths[2..] {
            assert_eq!(
                path.parent().unwrap(),
                dir.join("pareto"),
                "{}",
                path.display()
            );
        }
        for path in &paths {
            let text = read(path);
            if path.extension().is_some_and(|e| e == "svg") {
                check_xml(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            }
        }
        for path in &paths[2..] {
            let svg = read(path);
            assert_eq!(svg.matches("class=\"chosen\"").count(), 1);
            assert!(!svg.contains("limit "), "WD has no per-layer limit");
        }
        assert!(read(&paths[2]).contains("../evil name|&lt;x&gt;"));
        let md = read(&dir.join("report.md"));
        for part in [
            "# mucudnn tuning report",
            "| cuDNN | not used |",
            "workspace division (WD): 128 MiB in total",
            "../evil name\\|<x>",
        ] {
            assert!(md.contains(part), "`{part}` not in report.md:\n{md}");
        }
        assert!(!md.contains("weighted"));
        assert!(!md.contains("| layers |"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn errors_are_values() {
        let profile = fixture();
        let mode = Mode::WorkspaceReuse {
            workspace_limit_bytes: 64 << 20,
        };
        let solution =
            solve_profile(&profile, Policy::PowerOfTwo, mode, &WdOptions::default()).unwrap();
        // A profile that lacks a solved problem.
        let mut partial = profile.clone();
        partial.entries.pop();
        let input = ReportInput {
            profile: &partial,
            solution: &solution,
            device: "d",
            cudnn_version: None,
            multiplicity: None,
            title: None,
        };
        let dir = temp_dir("errors");
        assert!(matches!(
            write_report(&dir, &input),
            Err(ReportError::MissingEntry { .. })
        ));
        // A directory that cannot be created (a file is in the way).
        std::fs::create_dir_all(&dir).unwrap();
        let blocker = dir.join("file");
        std::fs::write(&blocker, "x").unwrap();
        let input = ReportInput {
            profile: &profile,
            ..input
        };
        let err = write_report(&blocker, &input).unwrap_err();
        assert!(matches!(err, ReportError::Io { .. }), "{err}");
        assert!(err.to_string().contains("file"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn workspace_axis() {
        assert_eq!(workspace_x(0), 0.0);
        for bytes in [0u64, 1024, 4392300, 64 << 20, 1 << 40] {
            assert_eq!(workspace_from_x(workspace_x(bytes)), bytes);
        }
        for max in [0.5, 5.0, 12.0, 25.0, 40.0] {
            let ticks = workspace_ticks(max);
            assert_eq!(ticks[0], 0.0);
            assert!(
                ticks.len() <= 7 && ticks.iter().all(|&t| t <= max),
                "{max}: {ticks:?}"
            );
        }
        let labels: Vec<String> = workspace_ticks(workspace_x(1 << 30))
            .iter()
            .map(|&t| format_bytes(workspace_from_x(t)))
            .collect();
        assert_eq!(
            labels,
            ["0 B", "1 KiB", "32 KiB", "1 MiB", "32 MiB", "1 GiB"]
        );
    }
}
