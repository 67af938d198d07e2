//! A plan: how to run one tuning problem as a sequence of micro-batches. Plain serde data that
//! can be printed, stored in the cache and executed again without the solver.

use crate::algo::{Algo, AlgoNames};
use crate::problem::{ConvOp, ConvProblem};
use crate::spatial::{split_axis, SplitDim};
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;

/// One micro-batch of a plan.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct MicroBatch {
    pub size: i64,
    pub algo: Algo,
    pub workspace_bytes: u64,
    pub time_ms: f64,
}

/// Micro-batches run one after another on one workspace buffer, in this order.
///
/// A batch plan's micro-batches are sample counts; a spatial plan's ([`Plan::split`] is
/// [`SplitDim::Spatial`]) are chunks of rows along the op's output's outermost spatial axis
/// ([`split_axis`]), run by `exec::spatial`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub layer: String,
    pub problem: ConvProblem,
    pub op: ConvOp,
    /// What the micro-batches split. Absent in JSON written before spatial plans existed (and
    /// never written for a batch plan): batch.
    #[serde(default, skip_serializing_if = "SplitDim::is_batch")]
    pub split: SplitDim,
    pub micro_batches: Vec<MicroBatch>,
}

impl Plan {
    /// Predicted time: the sum over micro-batches.
    pub fn time_ms(&self) -> f64 {
        self.micro_batches.iter().map(|m| m.time_ms).sum()
    }

    /// Workspace needed: the largest micro-batch's, since they share one buffer.
    pub fn workspace_bytes(&self) -> u64 {
        self.micro_batches
            .iter()
            .map(|m| m.workspace_bytes)
            .max()
            .unwrap_or(0)
    }

    /// Sum of micro-batch sizes: equals [`Plan::extent`] for a plan the solver made
    /// (`problem.n` for a batch plan; for a spatial plan, the rows of the op's output along
    /// the split axis).
    pub fn batch(&self) -> i64 {
        self.micro_batches.iter().map(|m| m.size).sum()
    }

    /// Whether this plan should replace `other`, a plan of the same tuning problem along the
    /// other split: it is faster, unless it is a spatial plan of one chunk, which is
    /// the unsplit op (as a batch plan of one micro-batch is): then only a batch plan that
    /// does not fit (none) makes way for it, never timing noise between two runs of one call.
    pub fn replaces(&self, other: &Plan) -> bool {
        let unsplit = self.split == SplitDim::Spatial && self.micro_batches.len() == 1;
        !unsplit && self.time_ms() < other.time_ms()
    }

    /// What the micro-batch sizes of a valid plan sum to: see [`SplitDim::extent`].
    pub fn extent(&self) -> i64 {
        self.split.extent(&self.problem, self.op)
    }

    /// Compact split for people: runs of equal (size, algo) as `COUNTxSIZE@ALGO`, joined by
    /// `+`: `2x128@IMPLICIT_PRECOMP_GEMM` (two micro-batches of 128 samples), `4x8@direct`,
    /// `1x64@eng38_k2=8`; the algorithm as `names` calls it ([`AlgoNames`]; `algo1` when the
    /// backend is unknown). A spatial plan names its axis: `4x120@direct along h`. Programs
    /// read the micro-batches' numbers, never this string.
    pub fn split_string(&self, names: AlgoNames) -> String {
        let mut out = String::new();
        let mut i = 0;
        while i < self.micro_batches.len() {
            let m = self.micro_batches[i];
            let run = self.micro_batches[i..]
                .iter()
                .take_while(|x| x.size == m.size && x.algo == m.algo)
                .count();
            if !out.is_empty() {
                out.push('+');
            }
            let _ = write!(out, "{run}x{}@{}", m.size, names.name(self.op, m.algo));
            i += run;
        }
        if self.split == SplitDim::Spatial {
            let _ = write!(out, " along {}", split_axis(&self.problem));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_string_groups_runs() {
        let mb = |size, algo| MicroBatch {
            size,
            algo: Algo::Legacy(algo),
            workspace_bytes: size as u64,
            time_ms: 1.0,
        };
        let plan = Plan {
            layer: "l".into(),
            problem: ConvProblem::new(7, 1, 3, 3, 1, 1, 1),
            op: ConvOp::Forward,
            split: SplitDim::Batch,
            micro_batches: vec![mb(2, 1), mb(2, 1), mb(2, 0), mb(1, 0)],
        };
        let unknown = AlgoNames::default();
        assert_eq!(plan.split_string(unknown), "2x2@algo1+1x2@algo0+1x1@algo0");
        let cuda = AlgoNames::new(crate::BackendKind::Cuda);
        assert_eq!(
            plan.split_string(cuda),
            "2x2@IMPLICIT_PRECOMP_GEMM+1x2@IMPLICIT_GEMM+1x1@IMPLICIT_GEMM"
        );
        let cpu = AlgoNames::new(crate::BackendKind::Cpu);
        assert_eq!(
            plan.split_string(cpu),
            "2x2@im2col-batched+1x2@direct+1x1@direct"
        );
        let mut engines = plan.clone();
        engines.micro_batches[2].algo = Algo::Engine("eng3_k2=1".parse().unwrap());
        assert_eq!(
            engines.split_string(cuda),
            "2x2@IMPLICIT_PRECOMP_GEMM+1x2@eng3_k2=1+1x1@IMPLICIT_GEMM"
        );
        assert_eq!(plan.batch(), 7);
        assert_eq!(plan.workspace_bytes(), 2);
        assert_eq!(plan.time_ms(), 4.0);
        assert_eq!(plan.extent(), 7);
    }

    #[test]
    fn spatial_plans_name_their_axis_and_batch_json_is_unchanged() {
        let mb = |size| MicroBatch {
            size,
            algo: Algo::Legacy(0),
            workspace_bytes: 0,
            time_ms: 1.0,
        };
        // 1 x 1 x 9 x 5 input, 3x3 filter, no padding: 7 output rows along h, 9 input rows.
        let mut plan = Plan {
            layer: "l".into(),
            problem: ConvProblem::new(1, 1, 9, 5, 1, 3, 3),
            op: ConvOp::Forward,
            split: SplitDim::Batch,
            micro_batches: vec![mb(4), mb(3)],
        };
        let json = serde_json::to_string(&plan).unwrap();
        assert!(!json.contains("split"), "{json}");
        let back: Plan = serde_json::from_str(&json).unwrap();
        assert_eq!(back, plan);
        assert_eq!(plan.extent(), 1);

        plan.split = SplitDim::Spatial;
        let cpu = AlgoNames::new(crate::BackendKind::Cpu);
        assert_eq!(plan.split_string(cpu), "1x4@direct+1x3@direct along h");
        assert_eq!(plan.extent(), 7);
        assert_eq!(plan.batch(), plan.extent());
        plan.op = ConvOp::BackwardData;
        assert_eq!(plan.extent(), 9);
        let json = serde_json::to_string(&plan).unwrap();
        assert!(json.contains(r#""split":"spatial""#), "{json}");
        let back: Plan = serde_json::from_str(&json).unwrap();
        assert_eq!(back, plan);

        let three_d = Plan {
            problem: ConvProblem::new_3d(1, 1, 6, 4, 4, 1, 3, 1, 1),
            op: ConvOp::Forward,
            ..plan.clone()
        };
        assert_eq!(three_d.split_string(cpu), "1x4@direct+1x3@direct along d");
        assert_eq!(three_d.extent(), 4);
    }
}
