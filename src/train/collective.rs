//! Collectives between ranks: the [`Collective`] trait (all-reduce, broadcast, barrier) and
//! [`ThreadCollective`], its in-process implementation for ranks that are threads.
//!
//! Every rank calls the same collectives in the same order. `ThreadCollective` sums the
//! ranks' contributions in rank order 0, 1, ..., R-1 (in f64, rounded once), once, and hands
//! every rank the same result, so all ranks get bitwise-identical sums whatever the thread
//! timing. A rank that fails calls [`Collective::abort`] (or drops its handle, or panics) and
//! the others get an error instead of waiting forever.

use super::TrainError;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// Collective operations over the ranks of one training job.
pub trait Collective {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Replaces `data` on every rank by the elementwise sum over ranks (identical bits on
    /// every rank).
    fn all_reduce_sum(&mut self, data: &mut [f32]) -> Result<(), TrainError>;
    /// [`Collective::all_reduce_sum`] for f64 (statistics, sample counts).
    fn all_reduce_sum_f64(&mut self, data: &mut [f64]) -> Result<(), TrainError>;
    /// Replaces `data` on every rank by rank `root`'s.
    fn broadcast(&mut self, data: &mut [f32], root: usize) -> Result<(), TrainError>;
    /// Returns once every rank has called it.
    fn barrier(&mut self) -> Result<(), TrainError> {
        self.all_reduce_sum_f64(&mut [])
    }
    /// Tells the other ranks that this one has failed, so they stop with an error instead of
    /// waiting for it. The default does nothing (a collective whose transport notices a dead
    /// peer by itself).
    fn abort(&mut self, reason: &str) {
        let _ = reason;
    }
    /// Every rank's bytes, in rank order (lengths may differ), on every rank: for small,
    /// rare messages (tuning tasks and plans), not for data. The default goes through two
    /// f64 sums (the lengths, then every rank's bytes in its own segment, six bytes per f64:
    /// whole numbers below 2^48 added to zeros, so the sums are exact).
    fn all_gather_bytes(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>, TrainError> {
        let (rank, world) = (self.rank(), self.world_size());
        let mut lengths = vec![0.0f64; world];
        lengths[rank] = mine.len() as f64;
        self.all_reduce_sum_f64(&mut lengths)?;
        let words = |len: f64| (len as usize).div_ceil(BYTES_PER_WORD);
        let offsets: Vec<usize> = lengths
            .iter()
            .scan(0, |at, &len| {
                let start = *at;
                *at += words(len);
                Some(start)
            })
            .collect();
        let total: usize = lengths.iter().map(|&len| words(len)).sum();
        let mut packed = vec![0.0f64; total];
        for (word, chunk) in packed[offsets[rank]..]
            .iter_mut()
            .zip(mine.chunks(BYTES_PER_WORD))
        {
            let mut bytes = [0u8; 8];
            bytes[..chunk.len()].copy_from_slice(chunk);
            *word = u64::from_le_bytes(bytes) as f64;
        }
        self.all_reduce_sum_f64(&mut packed)?;
        Ok(lengths
            .iter()
            .zip(&offsets)
            .map(|(&len, &offset)| {
                let len = len as usize;
                packed[offset..offset + words(len as f64)]
                    .iter()
                    .flat_map(|&word| {
                        let bytes = (word as u64).to_le_bytes();
                        bytes[..BYTES_PER_WORD].to_vec()
                    })
                    .take(len)
                    .collect()
            })
            .collect())
    }
}

/// Bytes carried by one f64 in [`Collective::all_gather_bytes`]: 48 bits, exact in an f64.
const BYTES_PER_WORD: usize = 6;

/// Every rank says whether it is fine before a section that no rank may enter alone (an NCCL
/// collective: a rank inside one waits on the device for every other rank, where no host
/// abort reaches it). Returns `mine` when every rank is fine; this rank's own error when it
/// failed; else [`TrainError::PeerFailed`] naming the lowest failed rank. One host all-reduce
/// of one flag per rank; every rank must call it at the same point.
pub fn agree_ok<T>(
    collective: &mut dyn Collective,
    mine: Result<T, TrainError>,
) -> Result<T, TrainError> {
    let mut failed = vec![0.0f64; collective.world_size()];
    if mine.is_err() {
        failed[collective.rank()] = 1.0;
    }
    let agreed = collective.all_reduce_sum_f64(&mut failed);
    let value = mine?;
    agreed?;
    match failed.iter().position(|&flag| flag != 0.0) {
        None => Ok(value),
        Some(rank) => Err(TrainError::PeerFailed {
            rank,
            reason: "failed before a section every rank must enter (see its error)".into(),
        }),
    }
}

/// What an operation is, so ranks that disagree are told instead of mixing data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum OpKind {
    SumF32,
    SumF64,
    Broadcast { root: usize },
}

impl std::fmt::Display for OpKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OpKind::SumF32 => write!(f, "all-reduce (f32)"),
            OpKind::SumF64 => write!(f, "all-reduce (f64)"),
            OpKind::Broadcast { root } => write!(f, "broadcast from rank {root}"),
        }
    }
}

struct State {
    /// The operation being gathered (kind, length), set by its first caller.
    pending: Option<(OpKind, usize)>,
    /// Each rank's contribution to the pending operation.
    inputs: Vec<Option<Vec<f64>>>,
    arrived: usize,
    /// Completed operations; a waiting rank knows its result is ready when this moves.
    generation: u64,
    /// The last completed operation's result and how many ranks have yet to copy it.
    result: Vec<f64>,
    readers_left: usize,
    /// Live handles per rank; a rank with none has left the group.
    handles: Vec<usize>,
    failure: Option<(usize, String)>,
}

struct Shared {
    world: usize,
    state: Mutex<State>,
    changed: Condvar,
    /// Run once, by the thread that records the group's first failure.
    on_failure: Mutex<Vec<FailureHook>>,
}

/// What to do when a rank of the group fails, besides waking the ranks waiting on the host:
/// e.g. abort a communicator whose owner may be waiting on the device (see
/// [`ThreadCollective::on_failure`]). Called with the failure's reason.
pub type FailureHook = Box<dyn FnOnce(&str) + Send>;

impl Shared {
    /// Records `rank`'s failure unless one is recorded; if this is the first, runs every hook
    /// (outside the state lock, so hooks may take their time).
    fn fail(&self, rank: usize, reason: &str) {
        let first = {
            let mut state = self
                .state
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let first = state.failure.is_none();
            if first {
                state.failure = Some((rank, reason.to_string()));
            }
            self.changed.notify_all();
            first
        };
        if first {
            let hooks = std::mem::take(
                &mut *self
                    .on_failure
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner),
            );
            for hook in hooks {
                hook(reason);
            }
        }
    }
}

/// One rank's handle on an in-process group of ranks (threads). Make the group with
/// [`ThreadCollective::group`] and move one handle into each rank's thread; a rank may hold
/// several handles ([`ThreadCollective::try_clone`]) as long as it uses them one at a time.
pub struct ThreadCollective {
    rank: usize,
    shared: Arc<Shared>,
}

impl ThreadCollective {
    /// Handles for ranks `0..world`, in rank order.
    pub fn group(world: usize) -> Result<Vec<ThreadCollective>, TrainError> {
        if world == 0 {
            return Err(TrainError::Config("a group needs at least one rank".into()));
        }
        let shared = Arc::new(Shared {
            world,
            state: Mutex::new(State {
                pending: None,
                inputs: vec![None; world],
                arrived: 0,
                generation: 0,
                result: Vec::new(),
                readers_left: 0,
                handles: vec![1; world],
                failure: None,
            }),
            changed: Condvar::new(),
            on_failure: Mutex::new(Vec::new()),
        });
        Ok((0..world)
            .map(|rank| ThreadCollective {
                rank,
                shared: shared.clone(),
            })
            .collect())
    }

    /// A second handle for the same rank (e.g. one for the replica's gradients and one for the
    /// loop's statistics). The rank must use its handles one at a time, in the same order on
    /// every rank.
    pub fn try_clone(&self) -> Result<ThreadCollective, TrainError> {
        let mut state = self.lock()?;
        state.handles[self.rank] += 1;
        drop(state);
        Ok(ThreadCollective {
            rank: self.rank,
            shared: self.shared.clone(),
        })
    }

    /// Runs `hook` when a rank of this group fails (aborts or panics), once, on the failing
    /// rank's thread, before that rank returns: a failing thread aborts every local NCCL
    /// communicator this way, so that peers waiting on the device are released, not only those
    /// waiting on the host. Runs it at once if the group has already failed.
    pub fn on_failure(&self, hook: FailureHook) {
        let failed = self.lock().map_or_else(
            |_| Some("a rank panicked".to_string()),
            |state| state.failure.as_ref().map(|(_, reason)| reason.clone()),
        );
        match failed {
            Some(reason) => hook(&reason),
            None => self
                .shared
                .on_failure
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(hook),
        }
    }

    /// Whether a rank of this group has failed (aborted, panicked or disagreed).
    pub fn has_failed(&self) -> bool {
        self.shared
            .state
            .lock()
            .map_or(true, |state| state.failure.is_some())
    }

    /// [`Collective::broadcast`] for f64 (exact: values are copied, not summed).
    pub fn broadcast_f64(&mut self, data: &mut [f64], root: usize) -> Result<(), TrainError> {
        self.check_root(root)?;
        let result = self.exchange(OpKind::Broadcast { root }, data.to_vec())?;
        data.copy_from_slice(&result);
        Ok(())
    }

    fn check_root(&self, root: usize) -> Result<(), TrainError> {
        if root >= self.shared.world {
            return Err(TrainError::Collective(format!(
                "broadcast from rank {root} in a group of {}",
                self.shared.world
            )));
        }
        Ok(())
    }

    fn lock(&self) -> Result<MutexGuard<'_, State>, TrainError> {
        self.shared
            .state
            .lock()
            .map_err(|_| TrainError::Collective("a rank panicked inside the collective".into()))
    }

    fn wait<'a>(&self, guard: MutexGuard<'a, State>) -> Result<MutexGuard<'a, State>, TrainError> {
        self.shared
            .changed
            .wait(guard)
            .map_err(|_| TrainError::Collective("a rank panicked inside the collective".into()))
    }

    /// The error for a failed group, or `None` if every rank that has not contributed to the
    /// pending operation can still do so.
    fn failed(&self, state: &State) -> Option<TrainError> {
        if let Some((rank, reason)) = &state.failure {
            return Some(TrainError::PeerFailed {
                rank: *rank,
                reason: reason.clone(),
            });
        }
        (0..self.shared.world)
            .find(|&r| state.handles[r] == 0 && state.inputs[r].is_none())
            .map(|r| {
                TrainError::Collective(format!(
                    "rank {r} left the group before this operation completed"
                ))
            })
    }

    /// Contributes `values` to an operation of `kind` and returns its result.
    fn exchange(&self, kind: OpKind, values: Vec<f64>) -> Result<Vec<f64>, TrainError> {
        let world = self.shared.world;
        let mut state = self.lock()?;
        // The previous result must be copied out by every rank before it is overwritten.
        while state.readers_left > 0 {
            if let Some(error) = self.failed(&state) {
                return Err(error);
            }
            state = self.wait(state)?;
        }
        if let Some(error) = self.failed(&state) {
            return Err(error);
        }
        match state.pending {
            None => state.pending = Some((kind, values.len())),
            Some((other, len)) if other != kind || len != values.len() => {
                let message = format!(
                    "rank {} called {kind} of {} values while another rank called {other} of {len}",
                    self.rank,
                    values.len()
                );
                state.failure = Some((self.rank, message.clone()));
                self.shared.changed.notify_all();
                return Err(TrainError::Collective(message));
            }
            Some(_) => {}
        }
        state.inputs[self.rank] = Some(values);
        state.arrived += 1;
        let generation = state.generation;
        if state.arrived == world {
            let inputs: Vec<Vec<f64>> = state
                .inputs
                .iter_mut()
                .map(|slot| slot.take().unwrap_or_default())
                .collect();
            state.result = combine(kind, inputs);
            state.pending = None;
            state.arrived = 0;
            state.readers_left = world;
            state.generation += 1;
            self.shared.changed.notify_all();
        } else {
            while state.generation == generation {
                if let Some(error) = self.failed(&state) {
                    return Err(error);
                }
                state = self.wait(state)?;
            }
        }
        let result = state.result.clone();
        state.readers_left -= 1;
        if state.readers_left == 0 {
            self.shared.changed.notify_all();
        }
        Ok(result)
    }
}

/// The result of an operation from every rank's input, in rank order.
fn combine(kind: OpKind, inputs: Vec<Vec<f64>>) -> Vec<f64> {
    match kind {
        OpKind::Broadcast { root } => inputs.into_iter().nth(root).unwrap_or_default(),
        OpKind::SumF32 | OpKind::SumF64 => {
            let mut ranks = inputs.into_iter();
            let mut sum = ranks.next().unwrap_or_default();
            for input in ranks {
                for (total, value) in sum.iter_mut().zip(input) {
                    *total += value;
                }
            }
            if kind == OpKind::SumF32 {
                // Round once, here, so every rank reads the same f32 bits.
                for total in &mut sum {
                    *total = f64::from(*total as f32);
                }
            }
            sum
        }
    }
}

impl Collective for ThreadCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world
    }

    fn all_reduce_sum(&mut self, data: &mut [f32]) -> Result<(), TrainError> {
        let values = data.iter().map(|&v| f64::from(v)).collect();
        let result = self.exchange(OpKind::SumF32, values)?;
        for (out, value) in data.iter_mut().zip(result) {
            *out = value as f32;
        }
        Ok(())
    }

    fn all_reduce_sum_f64(&mut self, data: &mut [f64]) -> Result<(), TrainError> {
        let result = self.exchange(OpKind::SumF64, data.to_vec())?;
        data.copy_from_slice(&result);
        Ok(())
    }

    fn broadcast(&mut self, data: &mut [f32], root: usize) -> Result<(), TrainError> {
        self.check_root(root)?;
        let values = data.iter().map(|&v| f64::from(v)).collect();
        let result = self.exchange(OpKind::Broadcast { root }, values)?;
        for (out, value) in data.iter_mut().zip(result) {
            *out = value as f32;
        }
        Ok(())
    }

    fn abort(&mut self, reason: &str) {
        // A poisoned lock still holds consistent data here: record the failure regardless.
        self.shared.fail(self.rank, reason);
    }
}

impl Drop for ThreadCollective {
    fn drop(&mut self) {
        let mut state = self
            .shared
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        state.handles[self.rank] = state.handles[self.rank].saturating_sub(1);
        self.shared.changed.notify_all();
        drop(state);
        if std::thread::panicking() {
            self.shared.fail(self.rank, "panicked");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `body` on every rank of a fresh group, one thread each; results in rank order.
    fn on_ranks<T: Send>(world: usize, body: impl Fn(&mut ThreadCollective) -> T + Sync) -> Vec<T> {
        let group = ThreadCollective::group(world).unwrap();
        std::thread::scope(|scope| {
            let handles: Vec<_> = group
                .into_iter()
                .map(|mut c| {
                    let body = &body;
                    scope.spawn(move || body(&mut c))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn all_reduce_sums_in_rank_order_and_every_rank_gets_the_same_bits() {
        // Values whose f32 sum depends on the order: every rank must still see one answer.
        let results = on_ranks(4, |c| {
            let mut out = Vec::new();
            for round in 0..50u32 {
                let r = c.rank() as f32;
                let mut data = vec![1e8 * (r - 1.5), 1.0 + r * 1e-7, round as f32 + r];
                c.all_reduce_sum(&mut data).unwrap();
                out.push(data.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
            }
            out
        });
        for rank in &results[1..] {
            assert_eq!(rank, &results[0]);
        }
        let expected_third = (0..4).map(|r| r as f64).sum::<f64>() as f32;
        assert_eq!(f32::from_bits(results[0][0][2]), expected_third);
    }

    #[test]
    fn broadcast_and_f64_sum() {
        let results = on_ranks(3, |c| {
            let mut data = vec![c.rank() as f32 + 0.5; 4];
            c.broadcast(&mut data, 2).unwrap();
            let mut stats = [c.rank() as f64, 1.0];
            c.all_reduce_sum_f64(&mut stats).unwrap();
            c.barrier().unwrap();
            (data, stats)
        });
        for (data, stats) in results {
            assert_eq!(data, vec![2.5; 4]);
            assert_eq!(stats, [3.0, 3.0]);
        }
    }

    #[test]
    fn bytes_of_every_length_are_gathered_exactly() {
        let results = on_ranks(3, |c| {
            // Rank r sends 0, 7 or 14 bytes, every value 0..=255 among them.
            let mine: Vec<u8> = (0..7 * c.rank()).map(|i| (i * 37 + 255) as u8).collect();
            c.all_gather_bytes(&mine).unwrap()
        });
        let expected: Vec<Vec<u8>> = (0..3)
            .map(|r| (0..7 * r).map(|i| (i * 37 + 255) as u8).collect())
            .collect();
        for gathered in results {
            assert_eq!(gathered, expected);
        }
        let everything: Vec<u8> = (0..=255).collect();
        let results = on_ranks(2, |c| c.all_gather_bytes(&everything).unwrap());
        assert!(results.iter().flatten().all(|part| part == &everything));
    }

    /// Issue 18, the host logic of "a failing thread stops the others" on the CPU: every rank
    /// registers a hook (on the GPU path: abort its NCCL communicator) and then waits where no
    /// host collective reaches it (on the GPU: a stream synchronisation behind an NCCL
    /// all-reduce), until its hook ran. One rank fails: it runs every hook, once, and every
    /// peer is released.
    #[test]
    fn a_failing_rank_runs_every_failure_hook_once_and_releases_device_waiters() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::mpsc;
        let world = 3;
        let group = ThreadCollective::group(world).unwrap();
        let runs = Arc::new(AtomicUsize::new(0));
        let mut released = Vec::new();
        for collective in &group {
            let (release, wait) = mpsc::channel::<String>();
            let runs = runs.clone();
            collective.on_failure(Box::new(move |reason| {
                runs.fetch_add(1, Ordering::SeqCst);
                let _ = release.send(reason.to_string());
            }));
            released.push(wait);
        }
        let results: Vec<Result<String, String>> = std::thread::scope(|scope| {
            let threads: Vec<_> = group
                .into_iter()
                .zip(released)
                .map(|(mut c, wait)| {
                    scope.spawn(move || {
                        if c.rank() == 1 {
                            c.abort("device 1 failed");
                            return Err("failed".to_string());
                        }
                        // "Inside NCCL": no host collective, only the hook releases it.
                        wait.recv_timeout(std::time::Duration::from_secs(10))
                            .map_err(|e| e.to_string())
                    })
                })
                .collect();
            threads.into_iter().map(|t| t.join().unwrap()).collect()
        });
        assert_eq!(runs.load(Ordering::SeqCst), world);
        assert_eq!(results[0].as_deref(), Ok("device 1 failed"));
        assert_eq!(results[2].as_deref(), Ok("device 1 failed"));
        assert!(results[1].is_err());
    }

    #[test]
    fn a_hook_registered_after_a_failure_runs_at_once_and_a_panic_runs_the_hooks() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let runs = Arc::new(AtomicUsize::new(0));
        let counting = |runs: &Arc<AtomicUsize>| -> FailureHook {
            let runs = runs.clone();
            Box::new(move |_| {
                runs.fetch_add(1, Ordering::SeqCst);
            })
        };
        let mut group = ThreadCollective::group(2).unwrap();
        group[0].on_failure(counting(&runs));
        let panicking = group.pop().unwrap();
        let _ = std::thread::spawn(move || {
            let _held = panicking;
            panic!("rank 1 panics");
        })
        .join();
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        assert!(group[0].has_failed());
        group[0].on_failure(counting(&runs));
        assert_eq!(runs.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn a_failed_rank_releases_the_others() {
        let results = on_ranks(3, |c| {
            if c.rank() == 1 {
                c.abort("out of memory");
                return Err(TrainError::Config("rank 1 gave up".into()));
            }
            let mut data = [1.0f32];
            c.all_reduce_sum(&mut data)
        });
        assert!(matches!(
            &results[0],
            Err(TrainError::PeerFailed { rank: 1, reason }) if reason == "out of memory"
        ));
        assert!(matches!(
            &results[2],
            Err(TrainError::PeerFailed { rank: 1, .. })
        ));
    }

    #[test]
    fn a_rank_that_leaves_or_disagrees_is_an_error_not_a_hang() {
        // Rank 1 drops its handle without calling anything.
        let results = on_ranks(2, |c| {
            if c.rank() == 1 {
                return Ok(());
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
            c.barrier()
        });
        assert!(matches!(&results[0], Err(TrainError::Collective(m)) if m.contains("left")));

        let results = on_ranks(2, |c| {
            let mut data = vec![0.0f32; 2 + c.rank()];
            c.all_reduce_sum(&mut data)
        });
        assert!(results.iter().all(|r| r.is_err()), "{results:?}");
    }

    #[test]
    fn ranks_agree_before_a_section_and_a_failed_rank_keeps_everyone_out() {
        let results = on_ranks(3, |c| {
            let rank = c.rank();
            let fine = agree_ok(c, Ok(rank));
            let mine = if c.rank() == 2 {
                Err(TrainError::Batch("rank 2 ran out of memory".into()))
            } else {
                Ok(())
            };
            (fine, agree_ok(c, mine), c.has_failed())
        });
        for (rank, (fine, second, failed)) in results.into_iter().enumerate() {
            assert_eq!(fine.unwrap(), rank);
            match second {
                Err(TrainError::Batch(m)) => assert!(rank == 2 && m.contains("memory")),
                Err(TrainError::PeerFailed { rank: 2, .. }) => assert!(rank != 2),
                other => panic!("rank {rank}: {other:?}"),
            }
            // Agreeing is not failing: the group is still usable.
            assert!(!failed);
        }
    }

    #[test]
    fn a_single_rank_is_its_own_sum_and_clones_share_the_group() {
        let mut group = ThreadCollective::group(1).unwrap();
        let mut c = group.remove(0);
        let mut data = [1.5f32, -2.0];
        c.all_reduce_sum(&mut data).unwrap();
        assert_eq!(data, [1.5, -2.0]);
        let mut clone = c.try_clone().unwrap();
        clone.barrier().unwrap();
        drop(clone);
        c.barrier().unwrap();
        assert!(ThreadCollective::group(0).is_err());
    }
}
