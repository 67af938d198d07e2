//! mucudnn's pure core: the convolution problem model, measurements and their interchange
//! format, and the solvers that turn measurements into micro-batching plans.
//!
//! Data enters as a [`Profile`] (measured by a backend, read from JSON or from the cache) and
//! leaves as [`Plan`]s. Nothing here touches CUDA, files or the clock: every function is a
//! deterministic function of its arguments (the MILP's time limit is the one exception, and the
//! result says when it was hit).
//!
//! - [`algo`]: [`Algo`], a candidate: a legacy algorithm number or an engine configuration.
//! - [`problem`]: [`ConvProblem`], [`ConvOp`], dtype, layout, math mode.
//! - [`profile`]: [`Measurement`], [`OpProfile`], [`Profile`], [`Policy`].
//! - [`key`]: the tuning key ([`MeasureKey`], [`SizesKey`], [`OpKey`]): what a measurement is
//!   of, and what the cache finds it by.
//! - [`interchange`]: the `mucudnn-profile-v1`/`-v2`/`-v3` JSON format.
//! - [`operand`]: operand roles of each op, and the steps (micro-batches) a [`Plan`] runs.
//! - [`wr`]: workspace reuse, dynamic programming per (layer, op), and Pareto fronts.
//! - [`wd`]: workspace division, a MILP over all (layer, op) pairs.
//! - [`solve`]: a whole profile under one mode, with the undivided baseline.
//! - [`spatial`]: the geometry of splitting one convolution along its outermost spatial
//!   dimension (chunks, halos, border padding).
//! - [`indexing`]: 32-bit indexing: the micro-batch and chunk sizes whose calls cuDNN can
//!   index ([`IndexLimit`]).

pub mod algo;
pub mod device;
pub mod indexing;
pub mod interchange;
pub mod key;
pub mod operand;
pub mod plan;
pub mod problem;
pub mod profile;
pub mod solve;
pub mod spatial;
pub mod synthetic;
pub mod units;
pub mod wd;
pub mod wr;

pub use algo::{legacy_name, Algo, AlgoKind, AlgoNames, CandidateSet, EngineName, EngineNameError};
pub use device::{BackendKind, DeviceFingerprint};
pub use indexing::{IndexError, IndexLimit};
pub use key::{MeasureKey, OpKey, SizesKey};
pub use operand::{operand_roles, steps, timing_offset, Operand, Step};
pub use plan::{MicroBatch, Plan};
pub use problem::{ConvOp, ConvProblem, DType, Layout, MathMode, ShapeError};
pub use profile::{
    Measured, Measurement, OpProfile, Policy, ProblemName, Profile, ProfileError, RecordCheck,
    RecordError, RefusedRecord, SizeVerification, Skipped, Verification,
};
pub use solve::{solve_profile, Mode, Solution, SolvedProblem};
pub use spatial::SplitDim;
pub use wd::{solve_wd, solve_wd_by, WdChoice, WdOptions, MAX_TIME_LIMIT_S};
pub use wr::{pareto_front, solve_wr, ParetoPoint};

use units::format_bytes;

/// Why no plan could be made.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum SolveError {
    #[error(transparent)]
    Profile(#[from] ProfileError),
    #[error("{name}: the profile has no micro-batch size that policy {policy} allows for a mini-batch of {n}")]
    NoSizes {
        name: ProblemName,
        policy: Policy,
        n: i64,
    },
    #[error("{name}: no plan fits a workspace limit of {} with policy {policy}; {}",
        format_bytes(*.workspace_limit_bytes),
        match .min_workspace_bytes {
            Some(min) => format!("the smallest limit that works is {} ({min} bytes)", format_bytes(*min)),
            None => "the measured sizes cannot make up the mini-batch at any limit".to_string(),
        })]
    Infeasible {
        name: ProblemName,
        policy: Policy,
        workspace_limit_bytes: u64,
        min_workspace_bytes: Option<u64>,
    },
    #[error(
        "a total workspace of {} cannot hold every layer's smallest plan; {}",
        format_bytes(*.total_workspace_bytes),
        smallest_total(*.min_total_workspace_bytes)
    )]
    BudgetTooSmall {
        total_workspace_bytes: u64,
        /// The sum of every layer's smallest workspace; `None` when it passes 2^64 - 1 bytes,
        /// so that no budget holds it.
        min_total_workspace_bytes: Option<u64>,
    },
    /// The extent is too large for the sizes measured: the DP would visit more partial sums
    /// than it may hold ([`wr::MAX_DP_SUMS`]), or their tables could not be allocated.
    #[error("{name}: an extent of {n} is too large to solve with the micro-batch sizes measured: they make up more than {max_sums} partial sums, the most the solver holds, or its tables do not fit in memory")]
    TooLarge {
        name: ProblemName,
        n: i64,
        max_sums: usize,
    },
    #[error("workspace division needs at least one (layer, op) to divide among")]
    NothingToDivide,
    #[error("workspace division: point set {index} is empty")]
    EmptyFront { index: usize },
    #[error("workspace division: point set {index} has a time of {time_ms} ms")]
    BadPoint { index: usize, time_ms: f64 },
}

/// The end of [`SolveError::BudgetTooSmall`]'s message.
fn smallest_total(min_total_workspace_bytes: Option<u64>) -> String {
    match min_total_workspace_bytes {
        Some(bytes) => format!(
            "the smallest total that works is {} ({bytes} bytes)",
            format_bytes(bytes)
        ),
        None => {
            "their smallest workspaces add up to more than 2^64 - 1 bytes, so no total works".into()
        }
    }
}
