//! Explaining one (layer, op): why the solver splits the mini-batch the way it does.
//!
//! Data enters as one [`OpProfile`] (raw measurements), a [`Policy`] and a few workspace
//! limits, and leaves as an [`Explanation`]: for every micro-batch size the policy allows (and
//! the profile measured), the fastest algorithm within each limit, next to the WR plan the
//! dynamic program builds from those choices at that limit. [`render_explanation`] prints it as
//! a table. Seeing the per-size winners side by side shows the mechanism: under a tight limit
//! the fast algorithms only fit at small micro-batch sizes, so the plan runs several of those.
//!
//! Nothing here decides anything new: the cells are what `wr` reads, and the plans are
//! [`solve_wr`]'s.

use crate::solver::spatial::split_axis;
use crate::solver::units::format_bytes;
use crate::solver::{
    solve_wr, Algo, AlgoNames, ConvProblem, Measurement, OpProfile, Plan, Policy, ProblemName,
    SolveError, SplitDim,
};
use std::fmt::Write as _;

/// The limit meaning "no limit".
pub const UNLIMITED: u64 = u64::MAX;

/// At most this many limits when the caller gives none (the last is [`UNLIMITED`]).
pub const DEFAULT_COLUMNS: usize = 6;

/// The fastest algorithm at one micro-batch size within one limit.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AlgoChoice {
    pub algo: Algo,
    /// Time of one call at this micro-batch size.
    pub time_ms: f64,
    pub workspace_bytes: u64,
}

/// One micro-batch size: its best algorithm within each limit (`None`: nothing fits).
#[derive(Clone, Debug, PartialEq)]
pub struct MicroRow {
    pub micro: i64,
    /// One per [`Explanation::limits`], in that order.
    pub best: Vec<Option<AlgoChoice>>,
}

/// The WR plan at one limit.
#[derive(Clone, Debug, PartialEq)]
pub struct LimitPlan {
    pub limit_bytes: u64,
    /// `None` when no plan fits.
    pub plan: Option<Plan>,
    /// When no plan fits: the smallest limit that works, if any does.
    pub min_workspace_bytes: Option<u64>,
    /// The best single algorithm on the whole mini-batch within the limit, if one fits.
    pub undivided_ms: Option<f64>,
}

/// Everything [`render_explanation`] prints.
#[derive(Clone, Debug, PartialEq)]
pub struct Explanation {
    pub name: ProblemName,
    /// The problem at the mini-batch size (its rank names the layout: `ndhwc` in 3-D).
    pub problem: ConvProblem,
    /// What the sizes split: the mini-batch size, or for a spatial entry the op's
    /// rows along the split axis ([`OpProfile::extent`]).
    pub n: i64,
    pub policy: Policy,
    /// Ascending and distinct; [`UNLIMITED`] means no limit.
    pub limits: Vec<u64>,
    /// Ascending micro-batch size: those the policy allows and the profile measured.
    pub rows: Vec<MicroRow>,
    /// One per limit.
    pub plans: Vec<LimitPlan>,
    /// The smallest micro-batch size a plan may use (`crate::tune::min_micro_batch`: above 1
    /// for a bf16 backward-filter on cuDNN); the rows show every size, the plans obey it.
    pub min_micro: i64,
    /// Candidates rejected for wrong results at the sizes shown (never in a cell or a plan),
    /// by size.
    pub rejected: Vec<Measurement>,
    /// Timings at the sizes shown whose output was compared with the reference's, and those
    /// never compared.
    pub compared: usize,
    pub unverified: usize,
}

/// Explains `entry` under `policy` at each limit (sorted, duplicates dropped); with no limits,
/// at [`default_limits`]. The plans use no micro-batch below `min_micro`
/// (`crate::tune::min_micro_batch` of the device that measured the entry; 1 for none), as
/// tuning's plans do.
///
/// Errors: an invalid profile entry, or one with no micro-batch size the policy allows.
pub fn explain(
    entry: &OpProfile,
    policy: Policy,
    limits: &[u64],
    min_micro: i64,
) -> Result<Explanation, SolveError> {
    entry.validate()?;
    let mut accurate = entry.clone();
    accurate.measurements.retain(|m| m.micro >= min_micro);
    let allowed: Vec<&Measurement> = entry.allowed(policy).collect();
    if allowed.is_empty() {
        return Err(SolveError::NoSizes {
            name: entry.name(),
            policy,
            n: entry.n(),
        });
    }
    let mut limits = if limits.is_empty() {
        default_limits(entry, policy)
    } else {
        limits.to_vec()
    };
    limits.sort_unstable();
    limits.dedup();
    let mut sizes: Vec<i64> = allowed.iter().map(|m| m.micro).collect();
    sizes.sort_unstable();
    sizes.dedup();
    let rows: Vec<MicroRow> = sizes
        .iter()
        .map(|&micro| MicroRow {
            micro,
            best: limits
                .iter()
                .map(|&limit| best_within(&allowed, micro, limit))
                .collect(),
        })
        .collect();
    let plans = limits
        .iter()
        .map(|&limit_bytes| {
            let undivided_ms =
                best_within(&allowed, entry.extent(), limit_bytes).map(|c| c.time_ms);
            match solve_wr(&accurate, policy, limit_bytes) {
                Ok(plan) => Ok(LimitPlan {
                    limit_bytes,
                    plan: Some(plan),
                    min_workspace_bytes: None,
                    undivided_ms,
                }),
                Err(SolveError::Infeasible {
                    min_workspace_bytes,
                    ..
                }) => Ok(LimitPlan {
                    limit_bytes,
                    plan: None,
                    min_workspace_bytes,
                    undivided_ms,
                }),
                Err(other) => Err(other),
            }
        })
        .collect::<Result<Vec<_>, SolveError>>()?;
    let shown = |m: &&Measurement| sizes.binary_search(&m.micro).is_ok();
    let mut rejected: Vec<Measurement> = entry.rejected.iter().filter(shown).copied().collect();
    rejected.sort_by_key(|m| (m.micro, m.algo));
    let (compared, unverified) =
        allowed
            .iter()
            .fold((rejected.len(), 0), |(yes, no), m| match m.verification {
                Some(_) => (yes + 1, no),
                None => (yes, no + 1),
            });
    Ok(Explanation {
        name: entry.name(),
        problem: entry.problem,
        n: entry.extent(),
        policy,
        limits,
        rows,
        plans,
        min_micro,
        rejected,
        compared,
        unverified,
    })
}

/// The fastest allowed measurement at `micro` within `limit`; ties go to the smaller workspace
/// (as in the WR solver), then the lower algorithm number.
fn best_within(allowed: &[&Measurement], micro: i64, limit: u64) -> Option<AlgoChoice> {
    allowed
        .iter()
        .filter(|m| m.micro == micro && m.workspace_bytes <= limit)
        .min_by(|a, b| {
            a.time_ms
                .total_cmp(&b.time_ms)
                .then(a.workspace_bytes.cmp(&b.workspace_bytes))
                .then(a.algo.cmp(&b.algo))
        })
        .map(|m| AlgoChoice {
            algo: m.algo,
            time_ms: m.time_ms,
            workspace_bytes: m.workspace_bytes,
        })
}

/// Limits worth a column: the workspace values at which some micro-batch size's best
/// algorithm changes (below the first, nothing fits anywhere), thinned evenly to at most
/// [`DEFAULT_COLUMNS`] - 1, then [`UNLIMITED`]. The last change is left out: from there on the
/// choices are the unlimited ones.
pub fn default_limits(entry: &OpProfile, policy: Policy) -> Vec<u64> {
    let allowed: Vec<&Measurement> = entry.allowed(policy).collect();
    let mut values: Vec<u64> = allowed.iter().map(|m| m.workspace_bytes).collect();
    values.sort_unstable();
    values.dedup();
    let mut sizes: Vec<i64> = allowed.iter().map(|m| m.micro).collect();
    sizes.sort_unstable();
    sizes.dedup();
    let choices = |limit: u64| -> Vec<Option<Algo>> {
        sizes
            .iter()
            .map(|&micro| best_within(&allowed, micro, limit).map(|c| c.algo))
            .collect()
    };
    let mut changes = Vec::new();
    // Below the smallest value nothing fits at any size.
    let mut previous: Vec<Option<Algo>> = vec![None; sizes.len()];
    for &value in &values {
        let current = choices(value);
        if current != previous {
            changes.push(value);
            previous = current;
        }
    }
    changes.pop();
    let keep = DEFAULT_COLUMNS - 1;
    let mut limits: Vec<u64> = if changes.len() <= keep {
        changes
    } else {
        // Evenly by index, keeping the first (least workspace) and the last.
        let last = changes.len() - 1;
        (0..keep).map(|i| changes[i * last / (keep - 1)]).collect()
    };
    limits.push(UNLIMITED);
    limits
}

fn limit_label(limit: u64) -> String {
    if limit == UNLIMITED {
        "unlimited".into()
    } else {
        format!("<= {}", format_bytes(limit))
    }
}

/// `41.2MiB`: the unit without a space keeps table cells in one piece.
fn compact_bytes(bytes: u64) -> String {
    format_bytes(bytes).replace(' ', "")
}

/// The table of per-size winners (rows: micro-batch sizes, columns: limits; `-` where nothing
/// fits), then the plan at each limit; algorithms as `names` calls them (the profile's
/// backend, [`Profile::algo_names`](crate::solver::Profile::algo_names)).
pub fn render_explanation(explanation: &Explanation, names: AlgoNames) -> String {
    let op = explanation.name.op;
    let mut out = String::new();
    let name = &explanation.name;
    let spatial = name.split == SplitDim::Spatial;
    let axis = split_axis(&explanation.problem);
    let _ = writeln!(
        out,
        "{} {} {} {}: {}, policy {}",
        crate::report::escape_control(&name.layer),
        name.dtype,
        explanation.problem.layout_name(),
        name.op,
        if spatial {
            format!(
                "split along {axis} ({} rows of the op's output, batch {})",
                explanation.n, explanation.problem.n
            )
        } else {
            format!("mini-batch {}", explanation.n)
        },
        explanation.policy
    );
    let _ = writeln!(out, "shape: {}", explanation.problem.describe());
    if explanation.min_micro > 1 {
        let _ = writeln!(
            out,
            "plans use micro-batches of at least {} (bf16 backward-filter on cuDNN: at most 4 \
             partial sums of the weight gradient)",
            explanation.min_micro
        );
    }
    let _ = writeln!(
        out,
        "Fastest algorithm per {} within each workspace limit (time per call{}):",
        if spatial {
            "chunk size"
        } else {
            "micro-batch size"
        },
        if spatial {
            ", the slowest of a chunk at the start, middle and end of the axis"
        } else {
            ""
        }
    );
    out.push('\n');
    let mut header = vec![if spatial {
        format!("rows ({axis})")
    } else {
        "micro".to_string()
    }];
    header.extend(explanation.limits.iter().map(|&l| limit_label(l)));
    let mut table = vec![header];
    for row in &explanation.rows {
        let mut cells = vec![row.micro.to_string()];
        cells.extend(row.best.iter().map(|cell| match cell {
            Some(c) => format!(
                "{} {:.3}ms {}",
                names.name(op, c.algo),
                c.time_ms,
                compact_bytes(c.workspace_bytes)
            ),
            None => "-".into(),
        }));
        table.push(cells);
    }
    push_table(&mut out, &table, &[0]);
    out.push('\n');
    render_verification(&mut out, explanation, names);
    let _ = writeln!(out, "Workspace-reuse plan at each limit:");
    out.push('\n');
    let mut table = vec![[
        "limit",
        "time ms",
        "undivided ms",
        "speedup",
        "workspace",
        "split",
    ]
    .map(String::from)
    .to_vec()];
    for limit_plan in &explanation.plans {
        let undivided = limit_plan
            .undivided_ms
            .map_or("-".into(), |u| format!("{u:.3}"));
        let row = match &limit_plan.plan {
            Some(plan) => vec![
                limit_label(limit_plan.limit_bytes),
                format!("{:.3}", plan.time_ms()),
                undivided,
                limit_plan
                    .undivided_ms
                    .map_or("-".into(), |u| format!("{:.2}x", u / plan.time_ms())),
                format_bytes(plan.workspace_bytes()),
                plan.split_string(names),
            ],
            None => vec![
                limit_label(limit_plan.limit_bytes),
                "-".into(),
                undivided,
                "-".into(),
                "-".into(),
                match limit_plan.min_workspace_bytes {
                    Some(min) => format!("infeasible (needs {})", format_bytes(min)),
                    None => "infeasible at any limit".into(),
                },
            ],
        };
        table.push(row);
    }
    push_table(&mut out, &table, &[1, 2, 3, 4]);
    out
}

/// What verification found at the sizes shown: how many outputs were compared, and each
/// rejected candidate with its error (they are in no cell and no plan above or below).
fn render_verification(out: &mut String, explanation: &Explanation, names: AlgoNames) {
    let op = explanation.name.op;
    let split = explanation.name.split;
    if explanation.compared == 0 {
        let _ = writeln!(
            out,
            "Outputs not verified: these timings were measured without comparing outputs with \
             the reference candidate's (tune without --no-verify, or clear the cache, to \
             verify them).\n"
        );
        return;
    }
    let _ = write!(
        out,
        "Outputs verified against the reference candidate's: {} timing(s) compared, {} rejected",
        explanation.compared,
        explanation.rejected.len()
    );
    if explanation.unverified > 0 {
        let _ = write!(out, ", {} not compared", explanation.unverified);
    }
    let _ = writeln!(out, ".");
    for r in &explanation.rejected {
        let _ = writeln!(
            out,
            "  {} at {} ({:.3}ms {}): rejected: {}",
            names.name(op, r.algo),
            crate::report::size_words(split, r.micro),
            r.time_ms,
            compact_bytes(r.workspace_bytes),
            crate::report::rejection_reason(r)
        );
    }
    out.push('\n');
}

/// Aligned columns, two spaces apart; `right` lists the right-aligned (numeric) columns.
fn push_table(out: &mut String, rows: &[Vec<String>], right: &[usize]) {
    let columns = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..columns)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|cell| cell.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    for row in rows {
        let mut line = String::new();
        for (c, cell) in row.iter().enumerate() {
            if c > 0 {
                line.push_str("  ");
            }
            let width = widths[c];
            crate::report::pad(&mut line, cell, width, right.contains(&c));
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::solver::interchange::from_json_str;
    use crate::solver::{ConvOp, ConvProblem, DType, Profile};

    fn fixture() -> Profile {
        let text = include_str!("../tests/fixtures/h100-alexnet-profile.json");
        from_json_str(text).unwrap()
    }

    fn entry<'a>(profile: &'a Profile, layer: &str, dtype: DType, op: ConvOp) -> &'a OpProfile {
        profile
            .entries
            .iter()
            .find(|e| e.layer == layer && e.problem.dtype == dtype && e.op == op)
            .unwrap()
    }

    /// Every cell is the brute-force fastest within its limit, and every plan is the solver's.
    fn check_consistent(entry: &OpProfile, explanation: &Explanation) {
        assert_eq!(explanation.plans.len(), explanation.limits.len());
        for row in &explanation.rows {
            assert!(explanation.policy.allows(row.micro, entry.n()));
            for (&limit, cell) in explanation.limits.iter().zip(&row.best) {
                let fitting: Vec<&Measurement> = entry
                    .measurements
                    .iter()
                    .filter(|m| m.micro == row.micro && m.workspace_bytes <= limit)
                    .collect();
                match cell {
                    None => assert!(fitting.is_empty()),
                    Some(choice) => {
                        assert!(choice.workspace_bytes <= limit);
                        assert!(fitting.iter().all(|m| m.time_ms >= choice.time_ms));
                        assert!(fitting.iter().any(|m| m.algo == choice.algo
                            && m.time_ms == choice.time_ms
                            && m.workspace_bytes == choice.workspace_bytes));
                    }
                }
            }
        }
        for limit_plan in &explanation.plans {
            let solved = solve_wr(entry, explanation.policy, limit_plan.limit_bytes).ok();
            assert_eq!(limit_plan.plan, solved);
            let undivided = crate::solver::wr::undivided(entry, limit_plan.limit_bytes).unwrap();
            assert_eq!(
                limit_plan.undivided_ms,
                undivided.as_ref().map(Plan::time_ms)
            );
        }
    }

    #[test]
    fn explicit_limits_on_alexnet() {
        let profile = fixture();
        let conv2 = entry(&profile, "alexnet.conv2", DType::Fp32, ConvOp::Forward);
        let limits = [UNLIMITED, 64 << 20, 0, 64 << 20];
        let explanation = explain(conv2, Policy::PowerOfTwo, &limits, 1).unwrap();
        assert_eq!(explanation.limits, [0, 64 << 20, UNLIMITED]);
        let sizes: Vec<i64> = explanation.rows.iter().map(|r| r.micro).collect();
        assert_eq!(sizes, [1, 2, 4, 8, 16, 32, 64, 128, 256]);
        check_consistent(conv2, &explanation);
        // At 64 MiB the plan is the one the whole-profile solver picks, and it beats the
        // undivided algorithm (the recorded profile's point).
        let at_64 = &explanation.plans[1];
        let plan = at_64.plan.as_ref().unwrap();
        assert!(plan.workspace_bytes() <= 64 << 20);
        assert!(plan.time_ms() < at_64.undivided_ms.unwrap());
        let names = profile.algo_names();
        let text = render_explanation(&explanation, names);
        assert!(
            text.starts_with("alexnet.conv2 fp32 nchw fwd: mini-batch 256, policy power-of-two")
        );
        for part in [
            "<= 0 B",
            "<= 64 MiB",
            "unlimited",
            &plan.split_string(names),
        ] {
            assert!(text.contains(part), "`{part}` not in:\n{text}");
        }
        // One table line per micro-batch size, each with one cell per limit, named by
        // cuDNN's forward algorithm names (the fixture is a cuDNN profile).
        let line_256 = text
            .lines()
            .find(|l| l.trim_start().starts_with("256 "))
            .unwrap();
        assert_eq!(line_256.matches("ms ").count(), 3, "{line_256}");
        assert!(
            !(0..10).any(|d| text.contains(&format!("algo{d}"))),
            "no numbered algorithms: {text}"
        );
        assert!(text.contains("IMPLICIT_PRECOMP_GEMM"), "{text}");
    }

    #[test]
    fn default_limits_on_alexnet() {
        let profile = fixture();
        for entry in &profile.entries {
            for policy in [Policy::PowerOfTwo, Policy::Undivided] {
                let limits = default_limits(entry, policy);
                assert!(!limits.is_empty() && limits.len() <= DEFAULT_COLUMNS);
                assert_eq!(limits.last(), Some(&UNLIMITED));
                assert!(limits.windows(2).all(|w| w[0] < w[1]), "{limits:?}");
                // Each finite limit is where some size's best algorithm changes.
                let allowed: Vec<&Measurement> = entry.allowed(policy).collect();
                for &limit in &limits[..limits.len() - 1] {
                    let changes = allowed.iter().any(|m| {
                        let below = limit
                            .checked_sub(1)
                            .map(|b| best_within(&allowed, m.micro, b));
                        below.flatten() != best_within(&allowed, m.micro, limit)
                    });
                    assert!(changes, "{} {limit}", entry.name());
                }
                let explanation = explain(entry, policy, &[], 1).unwrap();
                assert_eq!(explanation.limits, limits);
                check_consistent(entry, &explanation);
            }
        }
        // conv2 forward's algorithms change at many workspace values: thinned to 6 columns.
        let conv2 = entry(&profile, "alexnet.conv2", DType::Fp32, ConvOp::Forward);
        assert_eq!(
            default_limits(conv2, Policy::PowerOfTwo).len(),
            DEFAULT_COLUMNS
        );
        let first = default_limits(conv2, Policy::PowerOfTwo)[0];
        assert_eq!(first, 0, "algo 0 needs no workspace");
    }

    fn measurement(micro: i64, algo: u32, time_ms: f64, workspace_bytes: u64) -> Measurement {
        Measurement {
            micro,
            algo: Algo::Legacy(algo),
            time_ms,
            workspace_bytes,
            verification: None,
        }
    }

    #[test]
    fn nothing_fits_below_the_smallest_workspace() {
        // Workspace grows with the micro-batch: under 300 bytes only micro-batches of 1 fit.
        let entry = OpProfile {
            layer: "toy".into(),
            problem: ConvProblem::new(4, 2, 5, 5, 2, 3, 3),
            op: ConvOp::BackwardFilter,
            split: crate::solver::SplitDim::Batch,
            measurements: vec![
                measurement(1, 0, 1.0, 100),
                measurement(2, 0, 1.5, 200),
                measurement(4, 0, 2.0, 400),
                measurement(4, 1, 5.0, 300),
            ],
            skipped: Vec::new(),
            rejected: Vec::new(),
        };
        let explanation = explain(&entry, Policy::PowerOfTwo, &[50, 100, 300], 1).unwrap();
        check_consistent(&entry, &explanation);
        assert_eq!(
            explanation.rows[0].best,
            [
                None,
                Some(AlgoChoice {
                    algo: Algo::Legacy(0),
                    time_ms: 1.0,
                    workspace_bytes: 100
                }),
                Some(AlgoChoice {
                    algo: Algo::Legacy(0),
                    time_ms: 1.0,
                    workspace_bytes: 100
                })
            ]
        );
        assert_eq!(explanation.plans[0].plan, None);
        assert_eq!(explanation.plans[0].min_workspace_bytes, Some(100));
        let four_ones = explanation.plans[1].plan.as_ref().unwrap();
        let cpu = AlgoNames::new(crate::solver::BackendKind::Cpu);
        assert_eq!(four_ones.split_string(cpu), "4x1@direct");
        assert_eq!(explanation.plans[1].undivided_ms, None);
        let text = render_explanation(&explanation, cpu);
        assert!(text.contains("infeasible (needs 100 B)"), "{text}");
        let line_4 = text
            .lines()
            .find(|l| l.trim_start().starts_with("4 "))
            .unwrap();
        assert!(
            line_4.contains(" -  ") && line_4.contains("im2col-batched 5.000ms 300B"),
            "{line_4}"
        );
        assert_eq!(
            default_limits(&entry, Policy::PowerOfTwo),
            [100, 200, 300, UNLIMITED]
        );

        // Under the bf16 rule (micro-batches of at least 2 here) the rows still show size 1,
        // and the plans use none: at 100 B nothing fits, at 300 B two micro-batches of 2.
        let ruled = explain(&entry, Policy::PowerOfTwo, &[100, 300], 2).unwrap();
        assert_eq!(ruled.rows[0].micro, 1);
        assert_eq!(ruled.plans[0].plan, None);
        assert_eq!(ruled.plans[0].min_workspace_bytes, Some(200));
        let plan = ruled.plans[1].plan.as_ref().unwrap();
        assert_eq!(plan.split_string(cpu), "2x2@direct");
        let text = render_explanation(&ruled, cpu);
        assert!(text.contains("micro-batches of at least 2"), "{text}");
        assert!(!render_explanation(&explanation, cpu).contains("at least"));
    }

    #[test]
    fn bad_input_is_an_error() {
        let mut entry = OpProfile {
            layer: "toy".into(),
            problem: ConvProblem::new(4, 2, 5, 5, 2, 3, 3),
            op: ConvOp::Forward,
            split: crate::solver::SplitDim::Batch,
            measurements: vec![],
            skipped: Vec::new(),
            rejected: Vec::new(),
        };
        assert!(matches!(
            explain(&entry, Policy::All, &[], 1),
            Err(SolveError::Profile(_))
        ));
        // Only a size the policy does not allow.
        entry.measurements.push(measurement(3, 0, 1.0, 0));
        assert!(matches!(
            explain(&entry, Policy::PowerOfTwo, &[], 1),
            Err(SolveError::NoSizes { .. })
        ));
        assert!(explain(&entry, Policy::All, &[], 1).is_ok());
    }
}
