//! Which dimension a layer's plans may split ([`SplitSetting`]), and the rule by which `auto`
//! decides to tune spatial chunks besides micro-batches.

use crate::solver::{ConvOp, ConvProblem, Skipped, SplitDim};
use serde::{Deserialize, Serialize};

/// Which dimension a layer's plans may split.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SplitSetting {
    /// Micro-batches only (µ-cuDNN).
    Batch,
    /// Chunks along the outermost spatial dimension only.
    Spatial,
    /// Micro-batches, and also chunks where [`SplitSetting::auto_wants_chunks`] predicts a
    /// gain; the faster plan under the limit is kept.
    #[default]
    Auto,
}

/// `auto` considers a spatial split only up to this batch size: above it, micro-batches
/// already give the solver sizes to choose from.
pub const SPATIAL_AUTO_MAX_BATCH: i64 = 4;

impl SplitSetting {
    pub const ALL: [SplitSetting; 3] = [
        SplitSetting::Batch,
        SplitSetting::Spatial,
        SplitSetting::Auto,
    ];

    pub fn name(self) -> &'static str {
        match self {
            SplitSetting::Batch => "batch",
            SplitSetting::Spatial => "spatial",
            SplitSetting::Auto => "auto",
        }
    }

    /// Whether `auto` looks at a spatial split of `problem` at all: a batch of at most
    /// [`SPATIAL_AUTO_MAX_BATCH`] and at least two rows along the split axis. It then tunes the
    /// spatial split only when the batch profile shows workspace pressure (a candidate
    /// skipped for its workspace at the limit): without it, splitting can only add calls.
    pub fn auto_looks_at(problem: &ConvProblem) -> bool {
        problem.n <= SPATIAL_AUTO_MAX_BATCH
            && ConvOp::ALL
                .iter()
                .all(|&op| SplitDim::Spatial.extent(problem, op) >= 2)
    }

    /// Whether `auto` tunes chunks of `problem` after its batch sizes: it
    /// [looks at](Self::auto_looks_at) the problem, and the batch sizes skipped a candidate
    /// (`skipped`) for a workspace over `limit_bytes`. The one rule the tuner, the task API and
    /// the CLI apply.
    pub fn auto_wants_chunks<'s>(
        problem: &ConvProblem,
        skipped: impl IntoIterator<Item = &'s Skipped>,
        limit_bytes: u64,
    ) -> bool {
        Self::auto_looks_at(problem) && skipped.into_iter().any(|s| s.workspace_bytes > limit_bytes)
    }

    /// The plan-cache context part of this setting for `problem`: empty where the plans are
    /// those of `batch` (so plans cached before the setting existed still serve), else
    /// `split=<name>`.
    pub fn context(self, problem: &ConvProblem) -> &'static str {
        match self {
            SplitSetting::Batch => "",
            SplitSetting::Auto if !Self::auto_looks_at(problem) => "",
            SplitSetting::Auto => "split=auto",
            SplitSetting::Spatial => "split=spatial",
        }
    }
}

impl std::fmt::Display for SplitSetting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for SplitSetting {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        SplitSetting::ALL
            .into_iter()
            .find(|v| v.name() == s)
            .ok_or_else(|| format!("unknown split {s:?} (batch, spatial or auto)"))
    }
}
