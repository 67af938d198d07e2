//! The seam between the training loop and a device: one [`Replica`] per rank holds the whole
//! network, runs a step on its shard of the batch, and takes part in the gradient all-reduce.

use super::{Hyper, TrainError, TuningWork};
use crate::solver::Plan;

/// Per-step numbers a replica reports (this rank only).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepStats {
    /// Sum (not mean) of the per-sample cross-entropy losses of this rank's batch.
    pub loss_sum: f64,
    /// Samples whose arg-max logit is the label.
    pub correct: usize,
    pub samples: usize,
    /// Time spent in convolutions (forward, backward-data, backward-filter).
    pub conv_ms: f64,
    /// Wall time of the whole call, gradient all-reduce and update included.
    pub step_ms: f64,
    /// Steps whose update was skipped because a gradient was not finite (fp16 dynamic loss
    /// scaling; the same on every rank, so not summed over ranks).
    pub skipped: usize,
}

impl StepStats {
    /// Adds `other` into `self` (sums every field).
    pub fn accumulate(&mut self, other: &StepStats) {
        self.loss_sum += other.loss_sum;
        self.correct += other.correct;
        self.samples += other.samples;
        self.conv_ms += other.conv_ms;
        self.step_ms += other.step_ms;
        self.skipped += other.skipped;
    }
}

/// One rank's copy of the network on some device.
pub trait Replica {
    /// One SGD step on this rank's batch (NCHW f32 images `[n, c, h, w]`, labels), with the
    /// gradients averaged over all ranks before the update.
    ///
    /// Every rank must call this the same number of times (a rank with no samples in the
    /// last, partial global batch passes empty slices). The average is over samples: the
    /// summed gradients are divided by the global sample count, which with equal shards is
    /// the mean of the ranks' mean gradients (PyTorch DDP's average).
    fn train_step(
        &mut self,
        images: &[f32],
        labels: &[u32],
        hyper: &Hyper,
    ) -> Result<StepStats, TrainError>;

    /// Loss and accuracy on a batch, no update.
    fn evaluate(&mut self, images: &[f32], labels: &[u32]) -> Result<StepStats, TrainError>;

    /// All parameters, flattened on the host in a fixed order (sync checks, checkpoints).
    fn parameters(&self) -> Result<Vec<f32>, TrainError>;

    /// Gets ready for these per-rank batch sizes before anything is timed: a replica whose
    /// layers tune themselves on first sight of a shape tunes them here. The driver calls it
    /// on rank 0 first and on the other ranks after a barrier, so they find rank 0's plans in
    /// a shared tuning cache. The default does nothing.
    fn prepare(&mut self, batch_sizes: &[usize]) -> Result<(), TrainError> {
        let _ = batch_sizes;
        Ok(())
    }

    /// What [`Replica::prepare`] would tune for these batch sizes (a backend of this
    /// replica's device, a connection to its cache, the jobs), so that the loop can deal the
    /// measuring out over the ranks first ([`super::deal`]). The default, `None`: this replica
    /// tunes alone.
    fn tuning_work(&self, batch_sizes: &[usize]) -> Result<Option<TuningWork>, TrainError> {
        let _ = batch_sizes;
        Ok(None)
    }

    /// The convolution plans this replica runs for a per-rank batch of `batch` (every layer,
    /// forward, backward-data, backward-filter), for reports. The default reports none.
    fn conv_plans(&self, batch: usize) -> Vec<Plan> {
        let _ = batch;
        Vec::new()
    }
}
