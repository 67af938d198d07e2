//! Data-parallel training whose convolutions run through mucudnn's layer (issue 7).
//!
//! A small CNN ([`NetSpec`]: blocks of conv 3x3 pad 1 -> ReLU -> max-pool 2x2, then a linear
//! layer and softmax cross-entropy) is trained with SGD + momentum and weight decay on a
//! generated, learnable data set ([`data`]). Every rank holds a [`Replica`] of the network with
//! identical initial weights ([`NetSpec::init_parameters`]); each step it computes gradients on
//! its shard of the global batch, the gradients are summed over ranks by a [`Collective`] and
//! divided by the global sample count, and every rank applies the same update, so the replicas
//! stay bitwise identical.
//!
//! Data enters as a [`Dataset`] (generated from a seed) read by a [`ShardedLoader`] (seeded
//! shuffle per epoch, per-rank shards, batches assembled and prefetched on a thread). It leaves
//! as per-step [`StepStats`] and per-epoch [`EpochReport`]s (loss, accuracy, images/s, ms per
//! step, share of the step spent in convolutions), formatted by [`report`].
//!
//! The CPU replica ([`CpuReplica`]) runs its convolutions through the drop-in
//! [`Conv2d`](crate::exec::conv2d::Conv2d) layer, which tunes itself through the tuning cache on
//! first sight of a shape; ranks are threads joined by a [`ThreadCollective`]. Rank 0 tunes
//! first and the others then read its plans from the same cache file
//! ([`CacheChoice`]), as data-parallel processes would. The loop ([`driver`]) is generic over
//! [`Replica`] and [`Collective`], so the GPU replica ([`gpu::GpuReplica`]: cuDNN, cuBLAS,
//! NCCL; ranks are threads per GPU and processes joined by a TCP rendezvous, see
//! [`gpu::GpuJob`]) runs in the same loop and averages the same way.

mod collective;
mod cpu;
pub mod data;
pub mod dist;
pub mod driver;
pub mod gpu;
mod net;
pub mod ops;
mod replica;
pub mod report;
mod rng;
mod sgd;
mod tuning_cache;

pub use collective::{Collective, ThreadCollective};
pub use cpu::{ConvSettings, CpuNet, CpuReplica, Pass};
pub use data::{Batch, Dataset, DatasetSpec, LoaderConfig, ShardedLoader, Split};
pub use dist::DistConfig;
pub use driver::{
    run_rank, train_group, train_threads, EpochReport, EvalReport, TrainConfig, TrainEvent,
    TrainReport,
};
pub use net::{NetSpec, ParamShape};
pub use replica::{Replica, StepStats};
pub use sgd::{Hyper, Sgd};
pub use tuning_cache::{CacheChoice, TempCache};

use crate::exec::conv2d::LayerError;

/// Why training (or setting it up) failed.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A setting that cannot work (zero batch, image too small for the blocks, ...).
    #[error("invalid training configuration: {0}")]
    Config(String),
    /// A batch handed to a replica does not fit the network (length, label range).
    #[error("bad batch: {0}")]
    Batch(String),
    /// A convolution layer failed (tuning or execution).
    #[error(transparent)]
    Layer(#[from] LayerError),
    /// The tuning cache path names a file that is not a mucudnn cache (left untouched).
    #[error(transparent)]
    Cache(#[from] mucudnn_cache::NotACache),
    /// The ranks called the collective inconsistently, or a rank left the group.
    #[error("collective: {0}")]
    Collective(String),
    /// Another rank failed; this one stopped instead of waiting for it forever.
    #[error("rank {rank} failed: {reason}")]
    PeerFailed { rank: usize, reason: String },
    /// After an update this rank's parameters differ from rank 0's.
    #[error(
        "rank {rank} is out of sync with rank 0 after epoch {epoch} step {step}: parameter \
         {index} is {ours:e} here and {theirs:e} on rank 0"
    )]
    OutOfSync {
        rank: usize,
        epoch: usize,
        step: usize,
        index: usize,
        ours: f32,
        theirs: f32,
    },
    /// The loss became NaN or infinite.
    #[error(
        "training diverged at epoch {epoch} step {step} (loss {loss}); try a lower learning rate"
    )]
    Diverged {
        epoch: usize,
        step: usize,
        loss: f64,
    },
    /// A GPU call failed, or CUDA, cuDNN, cuBLAS, NCCL or a GPU is missing
    /// ([`gpu::GpuTrainError::is_unavailable`]).
    #[error(transparent)]
    Gpu(#[from] gpu::GpuTrainError),
    /// The input pipeline's thread stopped early.
    #[error("data loader: {0}")]
    Loader(String),
    /// Rank/world/rendezvous settings (flags or RANK, WORLD_SIZE, ...) are unusable.
    #[error("distributed settings: {0}")]
    Dist(String),
    /// An error on one rank of several.
    #[error("rank {rank}: {source}")]
    Rank {
        rank: usize,
        #[source]
        source: Box<TrainError>,
    },
}
