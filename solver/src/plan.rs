//! A plan: how to run one tuning problem as a sequence of micro-batches. Plain serde data that
//! can be printed, stored in the cache and executed again without the solver.

use crate::algo::{Algo, AlgoNames};
use crate::problem::{ConvOp, ConvProblem};
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
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub layer: String,
    pub problem: ConvProblem,
    pub op: ConvOp,
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

    /// Sum of micro-batch sizes (equals `problem.n` for a plan the solver made).
    pub fn batch(&self) -> i64 {
        self.micro_batches.iter().map(|m| m.size).sum()
    }

    /// Compact split for people: runs of equal (size, algo) as `COUNTxSIZE@ALGO`, joined by
    /// `+`: `2x128@IMPLICIT_PRECOMP_GEMM` (two micro-batches of 128 samples), `4x8@direct`,
    /// `1x64@eng38_k2=8`; the algorithm as `names` calls it ([`AlgoNames`]; `algo1` when the
    /// backend is unknown). Programs read the micro-batches' numbers, never this string.
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
    }
}
