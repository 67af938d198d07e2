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
use crate::solver::{Mode, Plan, ProblemName, Profile, Solution, SolveError, SolvedProblem};
use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

mod charts;

use charts::{pareto_svg, speedup_svg, ChartError};
#[cfg(test)]
use charts::{workspace_from_x, workspace_ticks, workspace_x, xml_escape};

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
        split: plan.split,
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
         `COUNTxSIZE@ALGO` runs of micro-batches (`8x32@IMPLICIT_PRECOMP_GEMM`: eight \
         micro-batches of 32 samples, each with that algorithm). Times are predicted from the \
         measurements.\n"
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
            plan.problem.layout_name().to_string(),
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
            format!("`{}`", plan.split_string(solution.names)),
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
            solved.plan.problem.dtype,
            solved.plan.problem.layout_name()
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::solver::interchange::from_json_str;
    use crate::solver::{solve_profile, DType, Policy, WdOptions};

    fn fixture() -> Profile {
        from_json_str(include_str!(
            "../../tests/fixtures/h100-alexnet-profile.json"
        ))
        .unwrap()
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
            assert!(svg.contains(&xml_escape(&solved.plan.split_string(solution.names))));
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
            "| alexnet.conv2 | fp32 | nchw | fwd | 256 | 1 | 10.081 | 1.229 | 8.20x | 41.2 MiB | `8x32@IMPLICIT_PRECOMP_GEMM` | [svg](pareto/alexnet.conv2.fp32.nchw.fwd.svg) |",
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
