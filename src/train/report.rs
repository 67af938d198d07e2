//! Presenting a training run: the `mucudnn train --json` document (see docs/training.md) and
//! the lines people read (a header, one row per epoch, a summary).

use super::{DatasetSpec, EpochReport, EvalReport, Hyper, NetSpec, TrainReport, TuningShare};
use crate::solver::units::format_bytes;
use crate::solver::{AlgoNames, Plan, Policy};
use serde::Serialize;
use std::fmt::Write as _;

/// The settings of a run, as the report shows them.
#[derive(Clone, Debug, Serialize)]
pub struct RunInfo {
    /// The device in words (backend and model).
    pub device: String,
    pub ranks: usize,
    pub batch_per_rank: usize,
    pub global_batch: usize,
    /// The layers' numeric format, e.g. `fp32 NCHW`.
    pub precision: String,
    /// The conv layers' micro-batch policy (`undivided` with `--no-microbatch`).
    pub policy: &'static str,
    pub workspace_limit_bytes: u64,
    /// Where the tuning cache is.
    pub cache: String,
    pub net: NetSpec,
    pub parameters: usize,
    pub data: DatasetSpec,
    pub train_size: usize,
    pub test_size: usize,
    pub hyper: Hyper,
    pub seed: u64,
}

impl RunInfo {
    pub fn microbatching(&self) -> bool {
        self.policy != Policy::Undivided.name()
    }
}

/// Over all epochs.
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    pub final_test_loss: f64,
    pub final_test_accuracy: f64,
    pub images_per_s: f64,
    pub ms_per_step: f64,
    pub conv_share: f64,
    pub tuning_s: f64,
    pub wall_s: f64,
    /// Steps skipped by fp16 loss scaling (a gradient was not finite).
    pub skipped_steps: usize,
    /// FNV-1a (64-bit, hex) of the final parameters' f32 bits in parameter order: equal
    /// checksums mean bit-identical parameters (runs on different launchers compare with it).
    pub parameters_fnv1a: String,
}

/// FNV-1a over the bits of `values` (little-endian bytes), as 16 hex digits.
pub fn parameters_checksum(values: &[f32]) -> String {
    let hash = values
        .iter()
        .flat_map(|v| v.to_bits().to_le_bytes())
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
    format!("{hash:016x}")
}

/// One conv plan the replicas run.
#[derive(Clone, Debug, Serialize)]
pub struct PlanRow {
    pub layer: String,
    pub op: &'static str,
    /// The per-rank batch the plan is for.
    pub n: i64,
    /// Runs of equal (micro-batch size, algorithm), e.g. `4x8@im2col-batched`.
    pub split: String,
    /// The solver's prediction from the measurements.
    pub predicted_ms: f64,
    pub workspace_bytes: u64,
}

impl PlanRow {
    pub fn new(plan: &Plan, names: AlgoNames) -> Self {
        PlanRow {
            layer: plan.layer.clone(),
            op: plan.op.name(),
            n: plan.batch(),
            split: plan.split_string(names),
            predicted_ms: plan.time_ms(),
            workspace_bytes: plan.workspace_bytes(),
        }
    }
}

/// The `--json` document.
#[derive(Clone, Debug, Serialize)]
pub struct TrainJson<'a> {
    pub settings: &'a RunInfo,
    /// Rank 0's conv plans for the largest per-rank batch.
    pub conv_plans: Vec<PlanRow>,
    /// Held-out loss and accuracy before training.
    pub initial: EvalReport,
    pub tuned_batch_sizes: &'a [usize],
    /// How the measuring was dealt out over the ranks (tasks, each rank's share) and every
    /// rank's plans' checksum (all equal: every rank runs identical plans).
    pub tuning: &'a TuningShare,
    pub epochs: &'a [EpochReport],
    pub summary: Summary,
}

impl<'a> TrainJson<'a> {
    pub fn new(settings: &'a RunInfo, report: &'a TrainReport, names: AlgoNames) -> Self {
        TrainJson {
            settings,
            conv_plans: report
                .conv_plans
                .iter()
                .map(|plan| PlanRow::new(plan, names))
                .collect(),
            initial: report.initial,
            tuned_batch_sizes: &report.tuned_batch_sizes,
            tuning: &report.tuning,
            epochs: &report.epochs,
            summary: summary(report),
        }
    }
}

pub fn summary(report: &TrainReport) -> Summary {
    let last = report.final_test();
    Summary {
        final_test_loss: last.loss,
        final_test_accuracy: last.accuracy,
        images_per_s: report.images_per_s(),
        ms_per_step: report.ms_per_step(),
        conv_share: report.conv_share(),
        tuning_s: report.tuning_s,
        wall_s: report.wall_s,
        skipped_steps: report.skipped_steps(),
        parameters_fnv1a: parameters_checksum(&report.parameters),
    }
}

/// What is trained, where and how: a few lines.
pub fn render_header(info: &RunInfo) -> String {
    let net = &info.net;
    let mut layers = format!("{}x{}x{}", net.in_channels, net.image_size, net.image_size);
    for channels in &net.block_channels {
        let _ = write!(layers, " -> [conv3x3 {channels}, relu, pool2]");
    }
    let _ = write!(layers, " -> linear {}", net.classes);
    format!(
        "training on {}: {} rank(s) x batch {} (global batch {}), conv plans {} within {} per layer\n\
         net: {layers} ({} parameters), {}\n\
         data: {} training / {} held-out generated images, {} classes, noise {}; \
         SGD lr {} momentum {} weight decay {}; seed {}\n\
         tuning cache: {}\n",
        info.device,
        info.ranks,
        info.batch_per_rank,
        info.global_batch,
        if info.microbatching() {
            format!("micro-batched ({})", info.policy)
        } else {
            "undivided (best single algorithm)".to_string()
        },
        format_bytes(info.workspace_limit_bytes),
        info.parameters,
        info.precision,
        info.train_size,
        info.test_size,
        info.data.classes,
        info.data.noise,
        info.hyper.lr,
        info.hyper.momentum,
        info.hyper.weight_decay,
        info.seed,
        info.cache,
    )
}

pub fn render_epoch_header() -> String {
    format!(
        "{:>5}  {:>10}  {:>9}  {:>9}  {:>8}  {:>9}  {:>8}  {:>10}\n",
        "epoch",
        "train loss",
        "train acc",
        "test loss",
        "test acc",
        "images/s",
        "ms/step",
        "conv share"
    )
}

fn percent(fraction: f64) -> String {
    format!("{:.1}%", 100.0 * fraction)
}

pub fn render_epoch_row(epoch: &EpochReport) -> String {
    format!(
        "{:>5}  {:>10.4}  {:>9}  {:>9.4}  {:>8}  {:>9.1}  {:>8.2}  {:>10}\n",
        epoch.epoch,
        epoch.train_loss,
        percent(epoch.train_accuracy),
        epoch.test_loss,
        percent(epoch.test_accuracy),
        epoch.images_per_s,
        epoch.ms_per_step,
        percent(epoch.conv_share)
    )
}

/// Before training: the held-out numbers at initialisation.
pub fn render_initial(initial: &EvalReport) -> String {
    format!(
        "{:>5}  {:>10}  {:>9}  {:>9.4}  {:>8}\n",
        0,
        "-",
        "-",
        initial.loss,
        percent(initial.accuracy)
    )
}

/// The conv plans, one line per (layer, op).
pub fn render_plans(plans: &[Plan], names: AlgoNames) -> String {
    let Some(first) = plans.first() else {
        return String::new();
    };
    let mut out = format!("\nconv plans for a per-rank batch of {}:\n", first.batch());
    let width = plans.iter().map(|p| p.layer.len()).max().unwrap_or(0);
    for plan in plans {
        let row = PlanRow::new(plan, names);
        let mut layer = String::from("  ");
        crate::report::pad(&mut layer, &row.layer, width, false);
        let _ = writeln!(
            out,
            "{layer}  {:<10}  {:<24}  predicted {:>8.3} ms  workspace {}",
            row.op,
            row.split,
            row.predicted_ms,
            format_bytes(row.workspace_bytes)
        );
    }
    out
}

pub fn render_summary(report: &TrainReport) -> String {
    let s = summary(report);
    format!(
        "\nheld-out accuracy {} (loss {:.4}, from {} before training); {:.1} images/s, \
         {:.2} ms/step, convolutions {} of step time; wall {:.1} s (tuning {:.1} s)\n",
        percent(s.final_test_accuracy),
        s.final_test_loss,
        percent(report.initial.accuracy),
        s.images_per_s,
        s.ms_per_step,
        percent(s.conv_share),
        s.wall_s,
        s.tuning_s
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> RunInfo {
        RunInfo {
            device: "cpu".into(),
            ranks: 2,
            batch_per_rank: 8,
            global_batch: 16,
            precision: "fp32 NCHW".into(),
            policy: "undivided",
            workspace_limit_bytes: 8 << 20,
            cache: "memory".into(),
            net: NetSpec {
                in_channels: 1,
                image_size: 16,
                classes: 10,
                block_channels: vec![8, 16],
            },
            parameters: 100,
            data: DatasetSpec {
                image_size: 16,
                channels: 1,
                classes: 10,
                noise: 0.3,
                seed: 0,
            },
            train_size: 10,
            test_size: 5,
            hyper: Hyper {
                lr: 0.1,
                momentum: 0.9,
                weight_decay: 0.0,
            },
            seed: 0,
        }
    }

    #[test]
    fn json_has_the_documented_keys_and_rows_line_up() {
        let report = TrainReport {
            ranks: 2,
            epochs: vec![EpochReport {
                epoch: 1,
                steps: 2,
                train_accuracy: 0.5,
                train_samples: 10,
                train_s: 0.5,
                step_ms_total: 40.0,
                conv_ms_total: 30.0,
                ..EpochReport::default()
            }],
            ..TrainReport::default()
        };
        let info = info();
        let doc =
            serde_json::to_value(TrainJson::new(&info, &report, AlgoNames::default())).unwrap();
        let mut keys: Vec<_> = doc.as_object().unwrap().keys().cloned().collect();
        keys.sort();
        assert_eq!(
            keys,
            [
                "conv_plans",
                "epochs",
                "initial",
                "settings",
                "summary",
                "tuned_batch_sizes",
                "tuning"
            ]
        );
        let mut tuning: Vec<_> = doc["tuning"].as_object().unwrap().keys().cloned().collect();
        tuning.sort();
        assert_eq!(tuning, ["measured_by_rank", "plans_fnv1a", "tasks"]);
        assert_eq!(doc["summary"]["images_per_s"], 20.0);
        assert_eq!(doc["summary"]["ms_per_step"], 10.0);
        assert_eq!(doc["summary"]["conv_share"], 0.75);
        assert!(doc["epochs"][0].get("conv_ms_total").is_none());
        assert!(!info.microbatching());
        assert!(render_header(&info).contains("undivided"));
        let header = render_epoch_header();
        let row = render_epoch_row(&report.epochs[0]);
        assert_eq!(header.len(), row.len(), "{header}{row}");
        assert!(render_summary(&report).contains("75.0%"));
    }
}
