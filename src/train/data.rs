//! The training data: a generated image-classification set that needs no download, and the
//! input pipeline that feeds one rank.
//!
//! [`DatasetSpec::generate`] draws oriented Gabor patches: class `k` has orientation
//! `(k mod 5) * 36°` and one of two spatial frequencies (`k < 5`: a period of a quarter of the
//! image, else half of it). Each image has a random phase, envelope width, contrast, position
//! jitter, a small orientation and frequency jitter, per-channel gains and Gaussian pixel noise,
//! so a classifier must find orientation and frequency wherever the patch is. Sample `i` of a
//! split is a pure function of `(seed, split, i)`: the training and held-out splits are
//! independent draws, and the same on every machine and rank.
//!
//! [`ShardedLoader`] serves one rank: each epoch it shuffles the sample indices with a
//! generator seeded by `(seed, epoch)` (so every rank shuffles identically), cuts the order
//! into global batches of `ranks x batch_per_rank`, and gives this rank its contiguous slice
//! of each (the last, partial global batch is split as evenly as possible, so a rank may get
//! fewer samples or none). Every rank therefore takes the same number of steps and every
//! sample is seen exactly once per epoch. Batches are assembled on a thread and handed over
//! through a bounded channel (`prefetch` batches ahead).

use super::rng::Rng;
use super::TrainError;
use std::collections::BTreeSet;
use std::f64::consts::PI;
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;
use std::thread::JoinHandle;

/// The most classes the generator knows: 5 orientations x 2 frequencies.
pub const MAX_CLASSES: usize = 10;

/// Which split a sample belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Split {
    Train,
    Test,
}

/// How to generate a data set.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct DatasetSpec {
    /// Images are `image_size x image_size`.
    pub image_size: usize,
    pub channels: usize,
    /// 2 to [`MAX_CLASSES`].
    pub classes: usize,
    /// Standard deviation of the Gaussian pixel noise (the patch's peak amplitude is at most 1).
    pub noise: f32,
    pub seed: u64,
}

/// A generated split held in memory: images NCHW, one label per image.
#[derive(Clone, Debug, PartialEq)]
pub struct Dataset {
    pub images: Vec<f32>,
    pub labels: Vec<u32>,
    pub channels: usize,
    pub image_size: usize,
    pub classes: usize,
}

impl DatasetSpec {
    pub fn validate(&self) -> Result<(), TrainError> {
        if !(2..=MAX_CLASSES).contains(&self.classes) {
            return Err(TrainError::Config(format!(
                "the generated data set has 2 to {MAX_CLASSES} classes, not {}",
                self.classes
            )));
        }
        if self.image_size < 8 {
            return Err(TrainError::Config(format!(
                "generated images are at least 8x8, not {0}x{0}",
                self.image_size
            )));
        }
        if self.channels == 0 {
            return Err(TrainError::Config(
                "images need at least one channel".into(),
            ));
        }
        if !(self.noise.is_finite() && self.noise >= 0.0) {
            return Err(TrainError::Config(format!(
                "noise must be a non-negative number, got {}",
                self.noise
            )));
        }
        Ok(())
    }

    /// `len` samples of `split`; labels cycle through the classes, so classes are balanced.
    pub fn generate(&self, split: Split, len: usize) -> Result<Dataset, TrainError> {
        self.validate()?;
        let image_len = self.channels * self.image_size * self.image_size;
        let mut images = vec![0.0f32; len * image_len];
        let mut labels = Vec::with_capacity(len);
        for (index, image) in images.chunks_exact_mut(image_len.max(1)).enumerate() {
            let label = index % self.classes;
            labels.push(label as u32);
            self.draw(split, index, label, image);
        }
        Ok(Dataset {
            images,
            labels,
            channels: self.channels,
            image_size: self.image_size,
            classes: self.classes,
        })
    }

    /// Draws sample `index` of `split` (of class `label`) into `image` (`c x s x s`).
    fn draw(&self, split: Split, index: usize, label: usize, image: &mut [f32]) {
        let split_tag = match split {
            Split::Train => 1,
            Split::Test => 2,
        };
        let mut rng = Rng::derive(self.seed, &[split_tag, index as u64]);
        let size = self.image_size as f64;
        let orientation = (label % 5) as f64 * PI / 5.0 + rng.uniform(-PI / 36.0, PI / 36.0);
        let period = if label < 5 { size / 4.0 } else { size / 2.0 } * rng.uniform(0.9, 1.1);
        let phase = rng.uniform(0.0, 2.0 * PI);
        let sigma = size / 4.0 * rng.uniform(0.8, 1.2);
        let jitter = size / 8.0;
        let center_x = (size - 1.0) / 2.0 + rng.uniform(-jitter, jitter);
        let center_y = (size - 1.0) / 2.0 + rng.uniform(-jitter, jitter);
        let contrast = rng.uniform(0.6, 1.0);
        let gains: Vec<f64> = (0..self.channels).map(|_| rng.uniform(0.5, 1.0)).collect();
        let (sin, cos) = orientation.sin_cos();
        let frequency = 2.0 * PI / period;
        let plane = self.image_size * self.image_size;
        for y in 0..self.image_size {
            for x in 0..self.image_size {
                let dx = x as f64 - center_x;
                let dy = y as f64 - center_y;
                let envelope = (-(dx * dx + dy * dy) / (2.0 * sigma * sigma)).exp();
                let wave = (frequency * (dx * cos + dy * sin) + phase).cos();
                let patch = contrast * envelope * wave;
                for (channel, gain) in gains.iter().enumerate() {
                    let noise = f64::from(self.noise) * rng.normal();
                    image[channel * plane + y * self.image_size + x] =
                        (gain * patch + noise) as f32;
                }
            }
        }
    }
}

impl Dataset {
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Elements per image: `channels x image_size x image_size`.
    pub fn image_len(&self) -> usize {
        self.channels * self.image_size * self.image_size
    }

    /// Image `index`, `c x s x s`.
    pub fn image(&self, index: usize) -> &[f32] {
        let len = self.image_len();
        &self.images[index * len..(index + 1) * len]
    }
}

/// How a loader cuts and orders its data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoaderConfig {
    /// Samples per rank per step (the global batch is `ranks x batch_per_rank`).
    pub batch_per_rank: usize,
    pub ranks: usize,
    pub rank: usize,
    /// Shuffle every epoch (training) or keep the data set's order (evaluation).
    pub shuffle: bool,
    pub seed: u64,
    /// Batches assembled ahead of the consumer (at least 1).
    pub prefetch: usize,
}

/// One rank's batch: images NCHW `[n, c, s, s]` and labels, and which samples they are.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    pub images: Vec<f32>,
    pub labels: Vec<u32>,
    /// Sample indices into the data set, in batch order.
    pub indices: Vec<usize>,
    /// `[n, c, s, s]`.
    pub dims: [usize; 4],
}

/// One rank's input pipeline over a shared data set.
#[derive(Clone, Debug)]
pub struct ShardedLoader {
    data: Arc<Dataset>,
    config: LoaderConfig,
}

impl ShardedLoader {
    pub fn new(data: Arc<Dataset>, config: LoaderConfig) -> Result<Self, TrainError> {
        if config.batch_per_rank == 0 {
            return Err(TrainError::Config(
                "the batch size must be at least 1".into(),
            ));
        }
        if config.ranks == 0 || config.rank >= config.ranks {
            return Err(TrainError::Config(format!(
                "rank {} of {} ranks",
                config.rank, config.ranks
            )));
        }
        Ok(ShardedLoader { data, config })
    }

    pub fn config(&self) -> &LoaderConfig {
        &self.config
    }

    /// Global steps per epoch (the same on every rank).
    pub fn steps_per_epoch(&self) -> usize {
        self.data
            .len()
            .div_ceil(self.config.ranks * self.config.batch_per_rank)
    }

    /// This rank's slice `[start, end)` of the epoch order at global step `step`.
    fn shard(&self, step: usize) -> (usize, usize) {
        let global = self.config.ranks * self.config.batch_per_rank;
        let begin = step * global;
        let available = self.data.len().saturating_sub(begin).min(global);
        // Split `available` as evenly as possible: the first `extra` ranks get one more.
        let base = available / self.config.ranks;
        let extra = available % self.config.ranks;
        let rank = self.config.rank;
        let start = begin + rank * base + rank.min(extra);
        let len = base + usize::from(rank < extra);
        (start, start + len)
    }

    /// The per-rank batch sizes any rank will see in an epoch (to tune for them up front).
    pub fn batch_sizes_all_ranks(&self) -> BTreeSet<usize> {
        (0..self.config.ranks)
            .flat_map(|rank| {
                let loader = ShardedLoader {
                    data: self.data.clone(),
                    config: LoaderConfig {
                        rank,
                        ..self.config
                    },
                };
                (0..loader.steps_per_epoch())
                    .map(move |step| {
                        let (start, end) = loader.shard(step);
                        end - start
                    })
                    .collect::<Vec<_>>()
            })
            .filter(|&n| n > 0)
            .collect()
    }

    /// The order of sample indices in `epoch` (identical on every rank).
    pub fn epoch_order(&self, epoch: usize) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.data.len()).collect();
        if self.config.shuffle {
            Rng::derive(self.config.seed, &[3, epoch as u64]).shuffle(&mut order);
        }
        order
    }

    /// This rank's batches of `epoch`, assembled on a thread ahead of use.
    pub fn epoch(&self, epoch: usize) -> Result<EpochBatches, TrainError> {
        let order = self.epoch_order(epoch);
        let steps = self.steps_per_epoch();
        let shards: Vec<(usize, usize)> = (0..steps).map(|step| self.shard(step)).collect();
        let data = self.data.clone();
        let (sender, receiver) = sync_channel(self.config.prefetch.max(1));
        let producer = std::thread::Builder::new()
            .name(format!("loader-rank{}", self.config.rank))
            .spawn(move || {
                for (start, end) in shards {
                    let indices = order[start..end].to_vec();
                    if sender.send(assemble(&data, indices)).is_err() {
                        return; // the consumer stopped early
                    }
                }
            })
            .map_err(|e| TrainError::Loader(format!("cannot start the loader thread: {e}")))?;
        Ok(EpochBatches {
            receiver: Some(receiver),
            producer: Some(producer),
            remaining: steps,
        })
    }
}

/// Copies the samples `indices` into one batch.
fn assemble(data: &Dataset, indices: Vec<usize>) -> Batch {
    let image_len = data.image_len();
    let mut images = Vec::with_capacity(indices.len() * image_len);
    let mut labels = Vec::with_capacity(indices.len());
    for &index in &indices {
        images.extend_from_slice(data.image(index));
        labels.push(data.labels[index]);
    }
    Batch {
        images,
        labels,
        dims: [
            indices.len(),
            data.channels,
            data.image_size,
            data.image_size,
        ],
        indices,
    }
}

/// One epoch of one rank's batches, in step order.
pub struct EpochBatches {
    receiver: Option<Receiver<Batch>>,
    producer: Option<JoinHandle<()>>,
    remaining: usize,
}

impl EpochBatches {
    /// Steps left in this epoch.
    pub fn remaining(&self) -> usize {
        self.remaining
    }
}

impl Iterator for EpochBatches {
    type Item = Result<Batch, TrainError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.remaining == 0 {
            return None;
        }
        let received = self.receiver.as_ref().map(Receiver::recv);
        match received {
            Some(Ok(batch)) => {
                self.remaining -= 1;
                Some(Ok(batch))
            }
            _ => {
                self.remaining = 0;
                Some(Err(TrainError::Loader(
                    "the loader thread stopped before the end of the epoch".into(),
                )))
            }
        }
    }
}

impl Drop for EpochBatches {
    fn drop(&mut self) {
        // Closing the channel first unblocks a producer waiting to send.
        drop(self.receiver.take());
        if let Some(producer) = self.producer.take() {
            let _ = producer.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> DatasetSpec {
        DatasetSpec {
            image_size: 12,
            channels: 2,
            classes: 10,
            noise: 0.2,
            seed: 5,
        }
    }

    fn loader(data: &Arc<Dataset>, ranks: usize, rank: usize, batch: usize) -> ShardedLoader {
        ShardedLoader::new(
            data.clone(),
            LoaderConfig {
                batch_per_rank: batch,
                ranks,
                rank,
                shuffle: true,
                seed: 9,
                prefetch: 2,
            },
        )
        .unwrap()
    }

    #[test]
    fn generation_is_deterministic_balanced_and_splits_differ() {
        let a = spec().generate(Split::Train, 40).unwrap();
        let b = spec().generate(Split::Train, 40).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.images.len(), 40 * 2 * 12 * 12);
        for class in 0..10u32 {
            assert_eq!(a.labels.iter().filter(|&&l| l == class).count(), 4);
        }
        assert!(a.images.iter().all(|v| v.is_finite()));
        let test = spec().generate(Split::Test, 40).unwrap();
        for i in 0..40 {
            for j in 0..40 {
                assert_ne!(a.image(i), test.image(j), "train {i} equals test {j}");
            }
        }
        let other_seed = DatasetSpec { seed: 6, ..spec() }
            .generate(Split::Train, 1)
            .unwrap();
        assert_ne!(other_seed.image(0), a.image(0));
    }

    #[test]
    fn bad_specs_are_errors() {
        for bad in [
            DatasetSpec {
                classes: 11,
                ..spec()
            },
            DatasetSpec {
                classes: 1,
                ..spec()
            },
            DatasetSpec {
                image_size: 4,
                ..spec()
            },
            DatasetSpec {
                channels: 0,
                ..spec()
            },
            DatasetSpec {
                noise: f32::NAN,
                ..spec()
            },
        ] {
            assert!(bad.generate(Split::Train, 3).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn every_sample_once_per_epoch_across_ranks_and_reshuffled() {
        // 103 samples, 4 ranks x 8: 4 steps, the last global batch has 7 samples.
        let data = Arc::new(spec().generate(Split::Train, 103).unwrap());
        let ranks = 4;
        let mut orders = Vec::new();
        for epoch in 0..3 {
            let mut seen = vec![0usize; data.len()];
            let mut order = Vec::new();
            let mut steps = Vec::new();
            for rank in 0..ranks {
                let loader = loader(&data, ranks, rank, 8);
                assert_eq!(loader.steps_per_epoch(), 4);
                let batches: Vec<Batch> = loader
                    .epoch(epoch)
                    .unwrap()
                    .collect::<Result<_, _>>()
                    .unwrap();
                steps.push(batches.len());
                for batch in &batches {
                    assert_eq!(batch.dims[0], batch.labels.len());
                    assert_eq!(batch.images.len(), batch.labels.len() * data.image_len());
                    for (k, &index) in batch.indices.iter().enumerate() {
                        seen[index] += 1;
                        assert_eq!(batch.labels[k], data.labels[index]);
                        let image_len = data.image_len();
                        assert_eq!(
                            &batch.images[k * image_len..(k + 1) * image_len],
                            data.image(index)
                        );
                    }
                    order.extend_from_slice(&batch.indices);
                }
                let last = batches.last().unwrap().labels.len();
                assert_eq!(last, if rank < 3 { 2 } else { 1 }, "rank {rank}");
            }
            assert!(steps.iter().all(|&s| s == 4), "{steps:?}");
            assert!(seen.iter().all(|&n| n == 1), "epoch {epoch}: {seen:?}");
            orders.push(order);
        }
        assert_ne!(orders[0], orders[1]);
        assert_ne!(orders[1], orders[2]);
        let sizes = loader(&data, ranks, 0, 8).batch_sizes_all_ranks();
        assert_eq!(sizes.into_iter().collect::<Vec<_>>(), [1, 2, 8]);
    }

    #[test]
    fn more_ranks_than_samples_gives_empty_batches_not_errors() {
        let data = Arc::new(spec().generate(Split::Test, 3).unwrap());
        let mut total = 0;
        for rank in 0..5 {
            let batches: Vec<Batch> = loader(&data, 5, rank, 4)
                .epoch(0)
                .unwrap()
                .collect::<Result<_, _>>()
                .unwrap();
            assert_eq!(batches.len(), 1);
            total += batches[0].labels.len();
        }
        assert_eq!(total, 3);
        assert!(ShardedLoader::new(
            data.clone(),
            LoaderConfig {
                batch_per_rank: 0,
                ranks: 1,
                rank: 0,
                shuffle: false,
                seed: 0,
                prefetch: 1
            }
        )
        .is_err());
    }

    #[test]
    fn stopping_early_does_not_hang() {
        let data = Arc::new(spec().generate(Split::Train, 64).unwrap());
        let mut batches = loader(&data, 1, 0, 1).epoch(0).unwrap();
        assert!(batches.next().unwrap().is_ok());
        assert_eq!(batches.remaining(), 63);
        drop(batches); // the producer is blocked on a full channel; dropping must free it
    }
}
