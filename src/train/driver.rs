//! The training loop: epochs of steps over one rank's shard ([`run_rank`], generic over the
//! [`Replica`] and the [`Collective`]), and [`train_threads`], which runs every rank as a
//! thread of this process with a [`ThreadCollective`].
//!
//! Per rank: tune (the measuring dealt out over the ranks, then rank 0's plans adopted by
//! every rank: [`super::deal`]), evaluate the held-out
//! split once, then per epoch train on every batch of the shuffled shard, optionally check that
//! every rank's parameters equal rank 0's after every step, evaluate, and all-reduce the
//! epoch's statistics so every rank reports the same global numbers. Timing covers the
//! training part of each epoch only; tuning is timed on its own.

use super::{
    deal, Collective, Dataset, Hyper, LoaderConfig, Replica, ShardedLoader, StepStats,
    ThreadCollective, TrainError, TuningShare, TuningWork,
};
use crate::solver::Plan;
use serde::Serialize;
use std::sync::Arc;
use std::time::Instant;

/// What a training run does, besides the network and the data.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TrainConfig {
    pub epochs: usize,
    /// Samples per rank per step (PyTorch DDP's convention); the global batch is
    /// `ranks x batch_per_rank`.
    pub batch_per_rank: usize,
    pub hyper: Hyper,
    /// Seeds the per-epoch shuffle (the same on every rank).
    pub seed: u64,
    /// Batches the input pipeline assembles ahead.
    pub prefetch: usize,
    /// After every step, compare every rank's parameters bitwise with rank 0's and stop with
    /// [`TrainError::OutOfSync`] on the first difference (costs a broadcast per step).
    pub check_sync: bool,
}

impl TrainConfig {
    pub fn validate(&self) -> Result<(), TrainError> {
        if self.epochs == 0 {
            return Err(TrainError::Config("train for at least one epoch".into()));
        }
        if self.batch_per_rank == 0 {
            return Err(TrainError::Config(
                "the batch size must be at least 1".into(),
            ));
        }
        self.hyper.validate()
    }
}

/// Loss and accuracy over a whole split, summed over ranks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct EvalReport {
    /// Mean per-sample cross-entropy.
    pub loss: f64,
    pub accuracy: f64,
    pub samples: usize,
}

/// One epoch, over all ranks.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct EpochReport {
    /// 1-based.
    pub epoch: usize,
    /// Global steps (each rank took this many).
    pub steps: usize,
    pub train_loss: f64,
    pub train_accuracy: f64,
    pub test_loss: f64,
    pub test_accuracy: f64,
    /// Training samples of all ranks over the wall time of the epoch's training part
    /// (input pipeline waits included, evaluation excluded).
    pub images_per_s: f64,
    /// Mean wall time of one `train_step` (all-reduce and update included).
    pub ms_per_step: f64,
    /// Time in convolutions over the time in `train_step`, summed over ranks.
    pub conv_share: f64,
    /// Steps whose update was skipped (fp16 loss scaling found a non-finite gradient).
    pub skipped_steps: usize,
    /// Wall time of the epoch's training part, then of its evaluation.
    pub train_s: f64,
    pub eval_s: f64,
    #[serde(skip)]
    pub train_samples: usize,
    /// Sums over every rank's steps.
    #[serde(skip)]
    pub conv_ms_total: f64,
    #[serde(skip)]
    pub step_ms_total: f64,
}

/// A whole run, as rank 0 saw it (the statistics are global).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct TrainReport {
    pub ranks: usize,
    pub batch_per_rank: usize,
    /// Wall time of tuning every conv layer for every batch size (before any epoch).
    pub tuning_s: f64,
    /// The per-rank batch sizes tuned for.
    pub tuned_batch_sizes: Vec<usize>,
    /// How the measuring was dealt out over the ranks, and every rank's plans' checksum.
    pub tuning: TuningShare,
    /// Rank 0's conv plans for the largest per-rank batch (see [`Replica::conv_plans`]).
    #[serde(skip)]
    pub conv_plans: Vec<Plan>,
    /// The held-out split before training.
    pub initial: EvalReport,
    pub epochs: Vec<EpochReport>,
    /// Wall time of the whole run, tuning included.
    pub wall_s: f64,
    /// This rank's final parameters (identical on every rank).
    #[serde(skip)]
    pub parameters: Vec<f32>,
}

impl TrainReport {
    /// Training images per second over all epochs.
    pub fn images_per_s(&self) -> f64 {
        let samples: usize = self.epochs.iter().map(|e| e.train_samples).sum();
        let seconds: f64 = self.epochs.iter().map(|e| e.train_s).sum();
        ratio(samples as f64, seconds)
    }

    /// Mean `train_step` wall time over all epochs and ranks.
    pub fn ms_per_step(&self) -> f64 {
        let steps: usize = self.epochs.iter().map(|e| e.steps).sum();
        let total: f64 = self.epochs.iter().map(|e| e.step_ms_total).sum();
        ratio(total, (steps * self.ranks) as f64)
    }

    /// Conv time over step time, all epochs and ranks.
    pub fn conv_share(&self) -> f64 {
        let conv: f64 = self.epochs.iter().map(|e| e.conv_ms_total).sum();
        let step: f64 = self.epochs.iter().map(|e| e.step_ms_total).sum();
        ratio(conv, step)
    }

    /// Steps skipped over all epochs (fp16 loss scaling).
    pub fn skipped_steps(&self) -> usize {
        self.epochs.iter().map(|e| e.skipped_steps).sum()
    }

    /// The last epoch's held-out numbers (the initial ones if no epoch ran).
    pub fn final_test(&self) -> EvalReport {
        self.epochs.last().map_or(self.initial, |e| EvalReport {
            loss: e.test_loss,
            accuracy: e.test_accuracy,
            samples: self.initial.samples,
        })
    }
}

fn ratio(numerator: f64, denominator: f64) -> f64 {
    if denominator > 0.0 {
        numerator / denominator
    } else {
        0.0
    }
}

/// What the loop tells its caller as it goes (rank 0's view in [`train_threads`]).
#[derive(Clone, Copy, Debug)]
pub enum TrainEvent<'a> {
    /// Tuning is done.
    Tuned {
        seconds: f64,
        batch_sizes: &'a [usize],
    },
    /// The held-out split before training.
    Initial(&'a EvalReport),
    /// A step finished (1-based step of `steps`), with this rank's mean batch loss.
    Step {
        epoch: usize,
        step: usize,
        steps: usize,
        loss: f64,
    },
    Epoch(&'a EpochReport),
}

/// The fault-injection hook (hidden, for tests): `MUCUDNN_TRAIN_FAIL_AT=RANK:STEP` makes global
/// rank `RANK` fail with [`TrainError::Injected`] just before its `STEP`-th training step
/// (1-based, counted over the whole run), as a rank whose device failed would.
pub const FAIL_AT_ENV: &str = "MUCUDNN_TRAIN_FAIL_AT";

/// Where [`FAIL_AT_ENV`] injects a failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FailAt {
    pub rank: usize,
    pub step: usize,
}

/// Parses `RANK:STEP` (STEP from 1).
pub fn parse_fail_at(text: &str) -> Result<FailAt, TrainError> {
    let bad = || {
        TrainError::Config(format!(
            "{FAIL_AT_ENV}={text:?} is not RANK:STEP (STEP from 1)"
        ))
    };
    let (rank, step) = text.trim().split_once(':').ok_or_else(bad)?;
    let rank = rank.trim().parse().map_err(|_| bad())?;
    let step = step.trim().parse().map_err(|_| bad())?;
    if step == 0 {
        return Err(bad());
    }
    Ok(FailAt { rank, step })
}

fn fail_at_from_env() -> Result<Option<FailAt>, TrainError> {
    match std::env::var(FAIL_AT_ENV) {
        Ok(text) if !text.trim().is_empty() => parse_fail_at(&text).map(Some),
        _ => Ok(None),
    }
}

/// Evaluates this rank's shard of the held-out split; returns this rank's sums. A loss that is
/// not finite is an error ([`TrainError::Diverged`], step 0: held-out).
fn evaluate_shard<R: Replica + ?Sized>(
    replica: &mut R,
    test: &ShardedLoader,
    epoch: usize,
) -> Result<StepStats, TrainError> {
    let total = evaluate_shard_sums(replica, test)?;
    if !total.loss_sum.is_finite() {
        return Err(TrainError::Diverged {
            epoch,
            step: 0,
            loss: total.loss_sum,
        });
    }
    Ok(total)
}

/// Evaluates this rank's shard of the held-out split; returns this rank's sums.
fn evaluate_shard_sums<R: Replica + ?Sized>(
    replica: &mut R,
    test: &ShardedLoader,
) -> Result<StepStats, TrainError> {
    let mut total = StepStats::default();
    for batch in test.epoch(0)? {
        let batch = batch?;
        total.accumulate(&replica.evaluate(&batch.images, &batch.labels)?);
    }
    Ok(total)
}

fn eval_report(loss_sum: f64, correct: f64, samples: f64) -> EvalReport {
    EvalReport {
        loss: ratio(loss_sum, samples),
        accuracy: ratio(correct, samples),
        samples: samples as usize,
    }
}

/// Fails with [`TrainError::OutOfSync`] unless this rank's parameters equal rank 0's bitwise.
fn check_in_sync<R: Replica + ?Sized>(
    replica: &R,
    collective: &mut dyn Collective,
    epoch: usize,
    step: usize,
) -> Result<(), TrainError> {
    let ours = replica.parameters()?;
    let mut theirs = ours.clone();
    collective.broadcast(&mut theirs, 0)?;
    match ours
        .iter()
        .zip(&theirs)
        .position(|(a, b)| a.to_bits() != b.to_bits())
    {
        None => Ok(()),
        Some(index) => Err(TrainError::OutOfSync {
            rank: collective.rank(),
            epoch,
            step,
            index,
            ours: ours[index],
            theirs: theirs[index],
        }),
    }
}

/// Trains one rank: `train` and `test` are this rank's loaders (same rank and rank count as
/// `collective`). Every rank of the job must call this with the same configuration; each
/// returns the same global statistics and its own (identical) final parameters.
pub fn run_rank<R: Replica + ?Sized>(
    replica: &mut R,
    collective: &mut dyn Collective,
    train: &ShardedLoader,
    test: &ShardedLoader,
    config: &TrainConfig,
    events: &mut dyn FnMut(TrainEvent<'_>),
) -> Result<TrainReport, TrainError> {
    config.validate()?;
    let fail_at = fail_at_from_env()?;
    let started = Instant::now();
    let rank = collective.rank();
    let ranks = collective.world_size();
    for (name, loader) in [("training", train), ("held-out", test)] {
        let loader = loader.config();
        if loader.rank != rank || loader.ranks != ranks {
            return Err(TrainError::Config(format!(
                "the {name} loader is for rank {} of {}, the collective for rank {rank} of {ranks}",
                loader.rank, loader.ranks
            )));
        }
    }

    // Tune: the measuring dealt out over the ranks, then rank 0 (each group's leader) tunes
    // from its cache and the others adopt its plans (see `deal`).
    let mut sizes = train.batch_sizes_all_ranks();
    sizes.extend(test.batch_sizes_all_ranks());
    let sizes: Vec<usize> = sizes.into_iter().collect();
    let all_plans =
        |replica: &R| -> Vec<Plan> { sizes.iter().flat_map(|&n| replica.conv_plans(n)).collect() };
    let (mut work, failed) = match replica.tuning_work(&sizes) {
        Ok(work) => (work, None),
        Err(error) => (None, Some(error)),
    };
    let mut share = deal::deal(
        collective,
        match failed {
            Some(error) => Err(error),
            None => Ok(work.as_mut()),
        },
    )?;
    let store = work.map(TuningWork::into_plan_store);
    let leader = share.is_leader(rank);
    let prepared = if leader {
        replica.prepare(&sizes).map(|()| all_plans(replica))
    } else {
        Ok(Vec::new())
    };
    deal::share_plans(collective, &share, store.as_ref(), prepared)?;
    drop(store);
    let prepared = if leader {
        Ok(all_plans(replica))
    } else {
        replica.prepare(&sizes).map(|()| all_plans(replica))
    };
    share.plans_fnv1a = deal::plan_checksums(collective, prepared)?;
    let tuning_s = started.elapsed().as_secs_f64();
    let conv_plans = sizes
        .last()
        .map_or_else(Vec::new, |&largest| replica.conv_plans(largest));
    events(TrainEvent::Tuned {
        seconds: tuning_s,
        batch_sizes: &sizes,
    });

    let initial = evaluate_shard(replica, test, 0)?;
    let mut sums = [
        initial.loss_sum,
        initial.correct as f64,
        initial.samples as f64,
    ];
    collective.all_reduce_sum_f64(&mut sums)?;
    let initial_report = eval_report(sums[0], sums[1], sums[2]);
    events(TrainEvent::Initial(&initial_report));

    let mut epochs = Vec::with_capacity(config.epochs);
    let mut run_step = 0;
    for epoch in 1..=config.epochs {
        let epoch_started = Instant::now();
        let mut local = StepStats::default();
        let batches = train.epoch(epoch)?;
        let steps = batches.remaining();
        for (index, batch) in batches.enumerate() {
            let batch = batch?;
            run_step += 1;
            if fail_at.is_some_and(|f| f.rank == rank && f.step == run_step) {
                return Err(TrainError::Injected { step: run_step });
            }
            let stats = replica.train_step(&batch.images, &batch.labels, &config.hyper)?;
            if !stats.loss_sum.is_finite() {
                return Err(TrainError::Diverged {
                    epoch,
                    step: index + 1,
                    loss: stats.loss_sum,
                });
            }
            local.accumulate(&stats);
            if config.check_sync {
                check_in_sync(replica, collective, epoch, index + 1)?;
            }
            events(TrainEvent::Step {
                epoch,
                step: index + 1,
                steps,
                loss: ratio(stats.loss_sum, stats.samples as f64),
            });
        }
        let train_s = epoch_started.elapsed().as_secs_f64();
        let eval_started = Instant::now();
        let held_out = evaluate_shard(replica, test, epoch)?;
        let eval_s = eval_started.elapsed().as_secs_f64();

        let mut sums = [
            local.loss_sum,
            local.correct as f64,
            local.samples as f64,
            local.conv_ms,
            local.step_ms,
            held_out.loss_sum,
            held_out.correct as f64,
            held_out.samples as f64,
        ];
        collective.all_reduce_sum_f64(&mut sums)?;
        let [loss, correct, samples, conv_ms, step_ms, test_loss, test_correct, test_samples] =
            sums;
        let test_report = eval_report(test_loss, test_correct, test_samples);
        let report = EpochReport {
            epoch,
            steps,
            train_loss: ratio(loss, samples),
            train_accuracy: ratio(correct, samples),
            test_loss: test_report.loss,
            test_accuracy: test_report.accuracy,
            images_per_s: ratio(samples, train_s),
            ms_per_step: ratio(step_ms, (steps * ranks) as f64),
            conv_share: ratio(conv_ms, step_ms),
            skipped_steps: local.skipped,
            train_s,
            eval_s,
            train_samples: samples as usize,
            conv_ms_total: conv_ms,
            step_ms_total: step_ms,
        };
        events(TrainEvent::Epoch(&report));
        epochs.push(report);
    }
    Ok(TrainReport {
        ranks,
        batch_per_rank: config.batch_per_rank,
        tuning_s,
        tuned_batch_sizes: sizes,
        tuning: share,
        conv_plans,
        initial: initial_report,
        epochs,
        wall_s: started.elapsed().as_secs_f64(),
        parameters: replica.parameters()?,
    })
}

/// Whether an error only says that another rank failed (so the other rank's error is the one
/// to report).
fn is_echo(error: &TrainError) -> bool {
    matches!(error, TrainError::PeerFailed { .. })
        || matches!(error, TrainError::Collective(m) if m.contains("left the group"))
}

/// Trains with `ranks` ranks as threads of this process. `make(rank, collective)` builds each
/// rank's replica inside its thread, around that rank's handle for the gradient all-reduce;
/// the loop keeps a second handle for its statistics. `events` sees rank 0's progress.
/// Returns rank 0's report; on failure, the error of the rank that failed first (not the
/// others' "rank r failed").
pub fn train_threads<R, F>(
    ranks: usize,
    make: F,
    train: &Arc<Dataset>,
    test: &Arc<Dataset>,
    config: &TrainConfig,
    events: &mut (dyn FnMut(TrainEvent<'_>) + Send),
) -> Result<TrainReport, TrainError>
where
    R: Replica,
    F: Fn(usize, ThreadCollective) -> Result<R, TrainError> + Sync,
{
    config.validate()?;
    let group = ThreadCollective::group(ranks)?
        .into_iter()
        .map(|collective| Ok((collective.try_clone()?, collective)))
        .collect::<Result<Vec<_>, TrainError>>()?;
    train_group(group, make, train, test, config, events)
}

/// Trains this process's ranks, one thread each: `group[i]` is local rank `i`'s pair of
/// handles, the loop's [`Collective`] (whose rank and world size are global: they pick the
/// rank's shard) and what `make(i, ..)` builds the replica around inside the thread (its own
/// handle for the gradient all-reduce; for a GPU replica, also what joins NCCL). Ranks of
/// other processes run the same call there. `events` sees local rank 0's progress. Returns
/// local rank 0's report (the statistics are global); on failure, the error of the rank that
/// failed first (not the others' "rank r failed"), named by its global rank when the world
/// has more than one.
pub fn train_group<C, D, R, F>(
    group: Vec<(C, D)>,
    make: F,
    train: &Arc<Dataset>,
    test: &Arc<Dataset>,
    config: &TrainConfig,
    events: &mut (dyn FnMut(TrainEvent<'_>) + Send),
) -> Result<TrainReport, TrainError>
where
    C: Collective + Send,
    D: Send,
    R: Replica,
    F: Fn(usize, D) -> Result<R, TrainError> + Sync,
{
    config.validate()?;
    if train.is_empty() || test.is_empty() {
        return Err(TrainError::Config(format!(
            "need training and held-out samples, got {} and {}",
            train.len(),
            test.len()
        )));
    }
    let Some(world) = group.first().map(|(collective, _)| collective.world_size()) else {
        return Err(TrainError::Config("a group needs at least one rank".into()));
    };
    let loader = |data: &Arc<Dataset>, rank: usize, ranks: usize, shuffle: bool| {
        ShardedLoader::new(
            data.clone(),
            LoaderConfig {
                batch_per_rank: config.batch_per_rank,
                ranks,
                rank,
                shuffle,
                seed: config.seed,
                prefetch: config.prefetch,
            },
        )
    };
    let make = &make;
    let mut events = Some(events);
    let results: Vec<(usize, Result<TrainReport, TrainError>)> = std::thread::scope(|scope| {
        let threads: Vec<_> = group
            .into_iter()
            .enumerate()
            .map(|(local, (mut collective, handle))| {
                let rank = collective.rank();
                let ranks = collective.world_size();
                let rank_events = if local == 0 { events.take() } else { None };
                let train_loader = loader(train, rank, ranks, true);
                let test_loader = loader(test, rank, ranks, false);
                let thread = std::thread::Builder::new()
                    .name(format!("train-rank{rank}"))
                    .spawn_scoped(scope, move || {
                        let mut ignore = |_: TrainEvent<'_>| {};
                        let events: &mut dyn FnMut(TrainEvent<'_>) = match rank_events {
                            Some(events) => events,
                            None => &mut ignore,
                        };
                        let result = (|| {
                            let mut replica = make(local, handle)?;
                            run_rank(
                                &mut replica,
                                &mut collective,
                                &train_loader?,
                                &test_loader?,
                                config,
                                events,
                            )
                        })();
                        if let Err(error) = &result {
                            collective.abort(&error.to_string());
                        }
                        result
                    });
                (rank, thread)
            })
            .collect();
        threads
            .into_iter()
            .map(|(rank, thread)| {
                let result = match thread {
                    Err(e) => Err(TrainError::Config(format!(
                        "cannot start the thread of rank {rank}: {e}"
                    ))),
                    Ok(handle) => handle.join().unwrap_or_else(|_| {
                        Err(TrainError::Collective(format!("rank {rank} panicked")))
                    }),
                };
                (rank, result)
            })
            .collect()
    });
    let mut first_error = None;
    let mut report = None;
    for (local, (rank, result)) in results.into_iter().enumerate() {
        match result {
            Ok(r) if local == 0 => report = Some(r),
            Ok(_) => {}
            Err(error) => {
                let replace = match &first_error {
                    None => true,
                    Some((_, current)) => is_echo(current) && !is_echo(&error),
                };
                if replace {
                    first_error = Some((rank, error));
                }
            }
        }
    }
    match (first_error, report) {
        (Some((rank, error)), _) if world > 1 => Err(TrainError::Rank {
            rank,
            source: Box::new(error),
        }),
        (Some((_, error)), _) => Err(error),
        (None, Some(report)) => Ok(report),
        (None, None) => Err(TrainError::Collective(
            "local rank 0 returned no report".into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::{DatasetSpec, Split};

    /// A replica whose "parameters" are a counter of samples seen; rank `bad` drifts.
    struct Fake<C: Collective> {
        collective: C,
        value: f32,
        drift_rank: Option<usize>,
        fail_rank: Option<usize>,
    }

    impl<C: Collective> Replica for Fake<C> {
        fn train_step(
            &mut self,
            _images: &[f32],
            labels: &[u32],
            _hyper: &Hyper,
        ) -> Result<StepStats, TrainError> {
            if self.fail_rank == Some(self.collective.rank()) {
                return Err(TrainError::Batch("this rank's batch is bad".into()));
            }
            let mut seen = [labels.len() as f32];
            self.collective.all_reduce_sum(&mut seen)?;
            self.value += seen[0];
            if self.drift_rank == Some(self.collective.rank()) {
                self.value += 1e-3;
            }
            Ok(StepStats {
                loss_sum: labels.len() as f64,
                correct: labels.len(),
                samples: labels.len(),
                conv_ms: 1.0,
                step_ms: 4.0,
                ..StepStats::default()
            })
        }

        fn evaluate(&mut self, _: &[f32], labels: &[u32]) -> Result<StepStats, TrainError> {
            Ok(StepStats {
                loss_sum: 2.0 * labels.len() as f64,
                correct: labels.len() / 2,
                samples: labels.len(),
                ..StepStats::default()
            })
        }

        fn parameters(&self) -> Result<Vec<f32>, TrainError> {
            Ok(vec![self.value])
        }
    }

    fn data(len: usize) -> Arc<Dataset> {
        let spec = DatasetSpec {
            image_size: 8,
            channels: 1,
            classes: 4,
            noise: 0.0,
            seed: 1,
        };
        Arc::new(spec.generate(Split::Train, len).unwrap())
    }

    fn config() -> TrainConfig {
        TrainConfig {
            epochs: 2,
            batch_per_rank: 4,
            hyper: Hyper {
                lr: 0.1,
                momentum: 0.0,
                weight_decay: 0.0,
            },
            seed: 0,
            prefetch: 2,
            check_sync: true,
        }
    }

    fn run(
        ranks: usize,
        drift_rank: Option<usize>,
        fail_rank: Option<usize>,
    ) -> Result<TrainReport, TrainError> {
        let mut events = Vec::new();
        let result = train_threads(
            ranks,
            |_, collective| {
                Ok(Fake {
                    collective,
                    value: 0.0,
                    drift_rank,
                    fail_rank,
                })
            },
            &data(30),
            &data(10),
            &config(),
            &mut |event| {
                if let TrainEvent::Epoch(report) = event {
                    events.push(report.epoch);
                }
            },
        );
        if result.is_ok() {
            assert_eq!(events, [1, 2]);
        }
        result
    }

    #[test]
    fn statistics_are_global_and_parameters_shared() {
        let report = run(3, None, None).unwrap();
        assert_eq!(report.ranks, 3);
        assert_eq!(report.epochs.len(), 2);
        let epoch = &report.epochs[0];
        assert_eq!(epoch.steps, 3); // 30 samples / (3 ranks x 4)
        assert_eq!(epoch.train_samples, 30);
        assert_eq!((epoch.train_loss, epoch.train_accuracy), (1.0, 1.0));
        assert_eq!(epoch.test_loss, 2.0);
        assert_eq!(epoch.ms_per_step, 4.0);
        assert_eq!(epoch.conv_share, 0.25);
        assert_eq!(report.initial.samples, 10);
        // Every step adds the global batch: two epochs of 30 samples.
        assert_eq!(report.parameters, [60.0]);
        // Training: 12 + 12 + 6 (2 each); held-out: 10 = 4 + 3 + 3.
        assert_eq!(report.tuned_batch_sizes, [2, 3, 4]);
        assert!(report.images_per_s() > 0.0);
    }

    #[test]
    fn a_rank_out_of_sync_is_caught_at_its_first_step() {
        let error = run(4, Some(2), None).unwrap_err();
        assert!(
            matches!(
                &error,
                TrainError::Rank { rank: 2, source }
                    if matches!(**source, TrainError::OutOfSync { rank: 2, epoch: 1, step: 1, .. })
            ),
            "{error}"
        );
    }

    #[test]
    fn the_failing_rank_is_reported_and_nobody_hangs() {
        let error = run(3, None, Some(1)).unwrap_err();
        assert!(
            matches!(&error, TrainError::Rank { rank: 1, source } if matches!(**source, TrainError::Batch(_))),
            "{error}"
        );
        let message = error.to_string();
        assert!(
            message.contains("rank 1") && message.contains("bad"),
            "{message}"
        );
    }

    #[test]
    fn bad_configurations_are_errors() {
        let make = |_: usize, collective: ThreadCollective| {
            Ok(Fake {
                collective,
                value: 0.0,
                drift_rank: None,
                fail_rank: None,
            })
        };
        let mut ignore = |_: TrainEvent<'_>| {};
        for bad in [
            TrainConfig {
                epochs: 0,
                ..config()
            },
            TrainConfig {
                batch_per_rank: 0,
                ..config()
            },
        ] {
            assert!(train_threads(1, make, &data(8), &data(8), &bad, &mut ignore).is_err());
        }
        assert!(train_threads(0, make, &data(8), &data(8), &config(), &mut ignore).is_err());
        assert!(train_threads(1, make, &data(8), &data(0), &config(), &mut ignore).is_err());
    }
}
