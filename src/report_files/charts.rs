//! The report's SVG charts, drawn with plotters' SVG backend: per tuning problem the
//! time/workspace Pareto front with the chosen plan and the undivided baseline marked, and the
//! speedup bars (what they show, and why markers are appended by hand: the parent module).

use crate::report::ms;
use crate::solver::units::format_bytes;
use crate::solver::{pareto_front, Mode, OpProfile, Solution, SolveError, SolvedProblem};
use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint, Ranged};
use plotters::prelude::*;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::ops::Range;

pub(super) enum ChartError {
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
pub(super) fn workspace_x(bytes: u64) -> f64 {
    (1.0 + bytes as f64 / 1024.0).log2()
}

pub(super) fn workspace_from_x(x: f64) -> u64 {
    let bytes = ((2f64.powf(x) - 1.0) * 1024.0).round();
    if bytes.is_finite() && bytes > 0.0 {
        bytes as u64
    } else {
        0
    }
}

/// Ticks at 0 and at powers of two from 1 KiB, spaced so that there are at most 7.
pub(super) fn workspace_ticks(max_x: f64) -> Vec<f64> {
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

pub(super) fn xml_escape(text: &str) -> String {
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
pub(super) fn pareto_svg(
    entry: &OpProfile,
    solved: &SolvedProblem,
    solution: &Solution,
) -> Result<String, ChartError> {
    let front = pareto_front(entry, solution.policy).map_err(ChartError::Solve)?;
    let plan = &solved.plan;
    let chosen = (plan.workspace_bytes(), plan.time_ms());
    let undivided = solved.undivided.as_ref().map(|u| {
        (
            u.workspace_bytes(),
            u.time_ms(),
            u.split_string(solution.names),
        )
    });
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
            entry.layer,
            entry.problem.dtype,
            entry.problem.layout_name(),
            entry.op
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
            plan.split_string(solution.names),
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
pub(super) fn speedup_svg(solution: &Solution) -> Result<String, String> {
    let mixed = solution.problems.iter().any(|s| {
        let first = &solution.problems[0].plan.problem;
        (s.plan.problem.dtype, s.plan.problem.layout_name()) != (first.dtype, first.layout_name())
    });
    let bars: Vec<(String, Option<f64>)> = solution
        .problems
        .iter()
        .map(|s| {
            let p = &s.plan;
            let label = if mixed {
                format!(
                    "{} {} {} {}",
                    p.layer,
                    p.problem.dtype,
                    p.problem.layout_name(),
                    p.op
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
