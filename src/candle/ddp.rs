//! Data-parallel training's host side for candle programs (feature `candle`): what every rank
//! of a job must agree on, over a [`Collective`] of processes (MPI in
//! `examples/candle_ddp.rs`, feature `mpi`: [`super::mpi`]).
//!
//! - [`sum_in_rank_order`]: the gradient all-reduce on the host. Every rank contributes one
//!   or more f32 vectors (its local ranks'); every rank gets the same bits back, because the
//!   sum is taken in f64, in rank order, once, and scaled in f64 before rounding to f32.
//!   So `P` processes of one rank each and one process that computes `P` shards in turn get
//!   bitwise identical results.
//! - [`deal`], [`share_plans`], [`plan_checksums`]: tuning dealt out over the ranks, so every
//!   rank runs identical plans even when each has its own tuning cache (a file per host), and
//!   no measurement is taken twice. The protocol of the PyTorch path
//!   (`python/mucudnn/torch/_tune.py`), in JSON messages:
//!   1. [`deal`]: every rank lists the measuring tasks ([`MeasureTask`]) its cache lacks for
//!      the jobs of its [`TuningWork`] and the ranks all-gather their device fingerprints,
//!      lists and cache identities. Ranks naming the same cache (same host, same file) form
//!      one *unit*: only its lowest rank measures. Ranks with another fingerprint form another
//!      group and never share.
//!   2. The union of the group's missing tasks (deduplicated) is dealt out round-robin over
//!      the group's units, anchors first, then the sizes between them (whose engine pruning
//!      reads the anchors), as two rounds; after each round the ranks all-gather the
//!      measurements (not plans) and store the other units'.
//!   3. [`share_plans`]: the group's lowest rank (its *leader*) tunes from its now complete
//!      cache, and every other rank stores the leader's plans in its own cache, where the
//!      layers' tuning on first sight of a shape finds them.
//!
//! An error on any rank travels in the gathered message, so every rank stops with it (or
//! with [`DdpError::PeerFailed`]) instead of waiting for a peer that will never come.

use crate::backend::Backend;
use crate::exec::check_plan;
use crate::profiler::Job;
use crate::solver::{ConvOp, DeviceFingerprint, Plan};
use crate::tune::{
    measure_task, missing_tasks, store_measured, LayerTuning, MeasureTask, MeasuredTask, ProfileRun,
};
use mucudnn_cache::{Cache, PlanKey};
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;

/// What goes wrong in a data-parallel job's host protocol.
#[derive(Debug, thiserror::Error)]
pub enum DdpError {
    /// The collective itself failed (a bad message, a size MPI cannot count).
    #[error("collective: {0}")]
    Collective(String),
    /// Another rank failed; its own message.
    #[error("rank {rank} failed: {reason}")]
    PeerFailed { rank: usize, reason: String },
    /// Listing, measuring or solving the tuning work failed on this rank.
    #[error("tuning: {0}")]
    Tune(String),
}

/// The processes of a job as the host protocol sees them: a rank, a size, and an all-gather
/// of bytes in rank order (every rank gets every rank's bytes).
pub trait Collective {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    fn all_gather_bytes(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>, DdpError>;
}

/// A job of one process: the collective of one rank.
#[derive(Clone, Copy, Debug, Default)]
pub struct SingleProcess;

impl Collective for SingleProcess {
    fn rank(&self) -> usize {
        0
    }

    fn size(&self) -> usize {
        1
    }

    fn all_gather_bytes(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>, DdpError> {
        Ok(vec![mine.to_vec()])
    }
}

/// The elementwise sum of every rank's `parts` (each rank's local ranks' vectors, in order,
/// all of `len` elements), times `scale`, in f64 in rank order, rounded to f32 once: every
/// rank gets the same bits. An empty `parts` contributes nothing.
pub fn sum_in_rank_order(
    collective: &mut dyn Collective,
    parts: &[Vec<f32>],
    len: usize,
    scale: f64,
) -> Result<Vec<f32>, DdpError> {
    let mut bytes = Vec::with_capacity(parts.len() * len * 4);
    for part in parts {
        if part.len() != len {
            return Err(DdpError::Collective(format!(
                "a vector of {} elements in a sum of {len}",
                part.len()
            )));
        }
        bytes.extend(part.iter().flat_map(|x| x.to_le_bytes()));
    }
    let gathered = collective.all_gather_bytes(&bytes)?;
    let mut sum = vec![0f64; len];
    for (rank, theirs) in gathered.iter().enumerate() {
        if len == 0 || theirs.len() % (len * 4) != 0 {
            if theirs.is_empty() || len == 0 {
                continue;
            }
            return Err(DdpError::Collective(format!(
                "rank {rank} sent {} bytes for vectors of {len} f32",
                theirs.len()
            )));
        }
        for vector in theirs.chunks_exact(len * 4) {
            for (total, x) in sum.iter_mut().zip(vector.chunks_exact(4)) {
                *total += f64::from(f32::from_le_bytes([x[0], x[1], x[2], x[3]]));
            }
        }
    }
    Ok(sum.into_iter().map(|x| (x * scale) as f32).collect())
}

/// Rank `root`'s bytes on every rank (an all-gather: the host protocol moves little).
pub fn broadcast_bytes(
    collective: &mut dyn Collective,
    mine: &[u8],
    root: usize,
) -> Result<Vec<u8>, DdpError> {
    let size = collective.size();
    let sent = if collective.rank() == root { mine } else { &[] };
    collective
        .all_gather_bytes(sent)?
        .into_iter()
        .nth(root)
        .ok_or_else(|| DdpError::Collective(format!("broadcast from rank {root} of {size}")))
}

/// What a rank's layers would tune: a backend of its device to measure on, its cache, an
/// identity of that cache (ranks with equal identities share one: the host and the file),
/// the layers' tuning settings, and every (layer, problem, op).
pub struct TuningWork<'a> {
    pub backend: &'a mut dyn Backend,
    pub cache: &'a Cache,
    /// `None`: a cache no other rank can share (in memory).
    pub cache_identity: Option<String>,
    pub tuning: LayerTuning,
    pub jobs: Vec<Job>,
}

impl TuningWork<'_> {
    fn run(&self) -> ProfileRun<'_> {
        self.tuning.profile_run(self.cache)
    }

    fn missing(&self) -> Result<Vec<MeasureTask>, DdpError> {
        missing_tasks(
            &self.jobs,
            &self.run(),
            self.backend.fingerprint(),
            self.backend.kinds(),
        )
        .map_err(tune_error)
    }

    fn measure(&mut self, tasks: &[&MeasureTask]) -> Result<Vec<MeasuredTask>, DdpError> {
        let run = self.tuning.profile_run(self.cache);
        tasks
            .iter()
            .map(|task| measure_task(&mut *self.backend, task, &run).map_err(tune_error))
            .collect()
    }

    /// The plans of every job, tuned from the cache (the leader's, after [`deal`]; on
    /// another rank, after [`share_plans`], the leader's again, read back from the cache).
    pub fn plans(&mut self) -> Result<Vec<Plan>, DdpError> {
        let mut layers: Vec<(&str, crate::solver::ConvProblem)> = Vec::new();
        for job in &self.jobs {
            if job.op == ConvOp::Forward {
                layers.push((&job.layer, job.problem));
            }
        }
        let mut plans = Vec::with_capacity(layers.len() * 3);
        for (layer, problem) in layers {
            let tuned = self
                .tuning
                .tune(&mut *self.backend, self.cache, layer, &problem)
                .map_err(tune_error)?;
            plans.extend(tuned);
        }
        Ok(plans)
    }

    /// Stores the leader's plans in this rank's cache, each checked first: executable
    /// ([`check_plan`]), for one of this rank's jobs, within its workspace limit. A bad plan
    /// stores nothing and is this rank's error.
    fn store_plans(&self, plans: &[Plan]) -> Result<(), DdpError> {
        for plan in plans {
            let refuse = |why: &str| {
                DdpError::Tune(format!(
                    "the leader's plan for {} {} {why}",
                    plan.layer, plan.op
                ))
            };
            check_plan(plan).map_err(|e| refuse(&format!("is not executable: {e}")))?;
            if !self
                .jobs
                .iter()
                .any(|job| job.problem == plan.problem && job.op == plan.op)
            {
                return Err(refuse("is for a problem this rank does not tune"));
            }
            if plan.workspace_bytes() > self.tuning.workspace_limit_bytes {
                return Err(refuse("exceeds the workspace limit"));
            }
        }
        let key = PlanKey::reuse(
            self.tuning.policy,
            self.run().effective_candidates(self.backend.kinds()),
            self.tuning.workspace_limit_bytes,
        );
        for plan in plans {
            self.cache
                .store_plan(self.backend.fingerprint(), plan, &key);
        }
        Ok(())
    }
}

fn tune_error(error: crate::tune::TuneError) -> DdpError {
    DdpError::Tune(error.to_string())
}

/// What each rank says in step 1.
#[derive(Debug, Serialize, Deserialize)]
struct Intro {
    fingerprint: DeviceFingerprint,
    unit: Option<String>,
    missing: Vec<MeasureTask>,
}

/// How the tuning was dealt out, for reports and for [`share_plans`].
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct TuningShare {
    /// Measuring tasks missing in rank 0's group (deduplicated over its ranks).
    pub tasks: usize,
    /// How many tasks each rank measured.
    pub measured_by_rank: Vec<usize>,
    /// Each rank's plans, hashed ([`plan_checksums`]): equal hashes, identical plans.
    pub plans_fnv1a: Vec<String>,
    /// Each rank's leader: the lowest rank with its fingerprint, whose plans it adopts.
    #[serde(skip)]
    leaders: Vec<usize>,
}

fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, DdpError> {
    serde_json::to_vec(value)
        .map_err(|e| DdpError::Collective(format!("cannot encode a message: {e}")))
}

/// Every rank's value of one gather; this rank's own error, or the first failed peer's.
pub fn gather_results<T>(
    collective: &mut dyn Collective,
    mine: Result<T, DdpError>,
) -> Result<Vec<T>, DdpError>
where
    T: Serialize + for<'de> Deserialize<'de>,
{
    let rank = collective.rank();
    let message: Result<&T, String> = mine.as_ref().map_err(|e| e.to_string());
    let parts = collective.all_gather_bytes(&encode(&message)?)?;
    let mine = mine?;
    let mut values = Vec::with_capacity(parts.len());
    for (peer, part) in parts.iter().enumerate() {
        if peer == rank {
            values.push(None);
            continue;
        }
        let theirs: Result<T, String> = serde_json::from_slice(part)
            .map_err(|e| DdpError::Collective(format!("rank {peer} sent a bad message: {e}")))?;
        match theirs {
            Ok(value) => values.push(Some(value)),
            Err(reason) => return Err(DdpError::PeerFailed { rank: peer, reason }),
        }
    }
    if rank >= values.len() {
        return Err(DdpError::Collective(format!(
            "rank {rank} of a gather of {}",
            values.len()
        )));
    }
    values[rank] = Some(mine);
    Ok(values.into_iter().flatten().collect())
}

/// The identity of a task for deduplication (the layer name aside).
fn task_key(task: &MeasureTask) -> String {
    serde_json::to_string(&(&task.problem, task.op, task.micro, task.kind)).unwrap_or_default()
}

/// Steps 1 and 2 of the module docs; every rank calls it at the same point (`Err`: this rank
/// failed, and every rank stops). Measures this rank's share into its cache and stores the
/// others' there.
pub fn deal(
    collective: &mut dyn Collective,
    work: Result<&mut TuningWork<'_>, DdpError>,
) -> Result<TuningShare, DdpError> {
    let rank = collective.rank();
    let (intro, mut work) = match work {
        Err(error) => (Err(error), None),
        Ok(work) => (
            work.missing().map(|missing| Intro {
                fingerprint: work.backend.fingerprint().clone(),
                unit: work.cache_identity.clone(),
                missing,
            }),
            Some(work),
        ),
    };
    let intros: Vec<Intro> = gather_results(collective, intro)?;
    let world = intros.len();
    let leaders: Vec<usize> = intros
        .iter()
        .map(|intro| {
            intros
                .iter()
                .position(|other| other.fingerprint == intro.fingerprint)
                .unwrap_or(0)
        })
        .collect();
    let same_unit = |a: usize, b: usize| {
        a == b || (intros[a].unit.is_some() && intros[a].unit == intros[b].unit)
    };
    // The ranks that measure: the lowest rank of each unit.
    let measures = |r: usize| (0..r).all(|other| !same_unit(other, r));
    let group = |r: usize| -> Vec<usize> {
        (0..world)
            .filter(|&q| intros[q].fingerprint == intros[r].fingerprint && measures(q))
            .collect()
    };
    let union = |members: &[usize]| -> Vec<&MeasureTask> {
        let mut seen = BTreeSet::new();
        members
            .iter()
            .flat_map(|&q| &intros[q].missing)
            .filter(|task| seen.insert(task_key(task)))
            .collect()
    };
    let mut share = TuningShare {
        tasks: union(&group(0)).len(),
        measured_by_rank: vec![0; world],
        plans_fnv1a: Vec::new(),
        leaders,
    };
    if intros.iter().all(|intro| intro.missing.is_empty()) {
        return Ok(share);
    }
    let members = group(rank);
    let tasks = union(&members);
    let position = members.iter().position(|&q| q == rank);
    for between in [false, true] {
        let round: Vec<&MeasureTask> = tasks
            .iter()
            .copied()
            .filter(|task| task.between.is_some() == between)
            .collect();
        let mine: Vec<&MeasureTask> = match position {
            Some(at) => round
                .iter()
                .copied()
                .skip(at)
                .step_by(members.len())
                .collect(),
            None => Vec::new(),
        };
        let measured = match &mut work {
            Some(work) if !mine.is_empty() => work.measure(&mine),
            _ => Ok(Vec::new()),
        };
        let everyone: Vec<Vec<MeasuredTask>> = gather_results(collective, measured)?;
        for (peer, theirs) in everyone.iter().enumerate() {
            share.measured_by_rank[peer] += theirs.len();
        }
        if let Some(work) = &work {
            for &peer in &members {
                if same_unit(peer, rank) || everyone[peer].is_empty() {
                    continue;
                }
                let backend: &dyn Backend = &*work.backend;
                store_measured(work.cache, backend, backend.fingerprint(), &everyone[peer])
                    .map_err(tune_error)?;
            }
        }
    }
    Ok(share)
}

/// Step 3 of the module docs, after [`deal`]: the leaders tune their jobs from their caches
/// and every other rank stores its leader's plans in its cache. Then every rank hashes the
/// plans its cache gives it ([`plan_checksums`], into the share).
pub fn share_plans(
    collective: &mut dyn Collective,
    share: &mut TuningShare,
    work: &mut TuningWork<'_>,
) -> Result<(), DdpError> {
    let rank = collective.rank();
    let leader = share.leaders.get(rank).copied().unwrap_or(0);
    let plans = if leader == rank {
        work.plans()
    } else {
        Ok(Vec::new())
    };
    let everyone: Vec<Vec<Plan>> = gather_results(collective, plans)?;
    if leader != rank {
        if let Some(plans) = everyone.get(leader) {
            work.store_plans(plans)?;
        }
    }
    let mine = work.plans();
    share.plans_fnv1a = plan_checksums(collective, mine)?;
    Ok(())
}

/// FNV-1a of bytes, as 16 hex digits.
pub fn fnv1a(bytes: &[u8]) -> String {
    let hash = bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    format!("{hash:016x}")
}

/// Every rank's checksum of its plans (FNV-1a of their JSON, layer names aside: a plan is
/// the same plan under another rank's name for the layer), in rank order.
pub fn plan_checksums(
    collective: &mut dyn Collective,
    plans: Result<Vec<Plan>, DdpError>,
) -> Result<Vec<String>, DdpError> {
    let hash = plans.and_then(|plans| {
        let unnamed: Vec<Plan> = plans
            .into_iter()
            .map(|plan| Plan {
                layer: String::new(),
                ..plan
            })
            .collect();
        encode(&unnamed).map(|json| fnv1a(&json))
    });
    gather_results(collective, hash)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{CpuBackend, TimingSettings};
    use crate::solver::{CandidateSet, ConvProblem, Policy};
    use crate::tune::{jobs_for, EngineOptions};
    use std::sync::{Arc, Barrier, Mutex};

    /// Ranks as threads of a test: an all-gather through a shared table and a barrier.
    struct Threads {
        rank: usize,
        table: Arc<Mutex<Vec<Vec<u8>>>>,
        barrier: Arc<Barrier>,
    }

    impl Collective for Threads {
        fn rank(&self) -> usize {
            self.rank
        }

        fn size(&self) -> usize {
            self.table.lock().unwrap().len()
        }

        fn all_gather_bytes(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>, DdpError> {
            self.table.lock().unwrap()[self.rank] = mine.to_vec();
            self.barrier.wait();
            let all = self.table.lock().unwrap().clone();
            self.barrier.wait();
            Ok(all)
        }
    }

    fn threads<T: Send + 'static>(
        size: usize,
        body: impl Fn(Threads) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        let table = Arc::new(Mutex::new(vec![Vec::new(); size]));
        let barrier = Arc::new(Barrier::new(size));
        let body = Arc::new(body);
        let handles: Vec<_> = (0..size)
            .map(|rank| {
                let (table, barrier, body) = (table.clone(), barrier.clone(), body.clone());
                std::thread::spawn(move || {
                    body(Threads {
                        rank,
                        table,
                        barrier,
                    })
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn sums_are_in_rank_order_and_the_same_as_shards_in_one_process() {
        let vectors: Vec<Vec<f32>> = vec![vec![1e8, 1.0, -3.5], vec![1.0, 1e-8, 2.25]];
        let alone = sum_in_rank_order(&mut SingleProcess, &vectors, 3, 0.5).unwrap();
        let expected: Vec<f32> = (0..3)
            .map(|i| ((f64::from(vectors[0][i]) + f64::from(vectors[1][i])) * 0.5) as f32)
            .collect();
        assert_eq!(alone, expected);
        let shared = Arc::new(vectors);
        let results = threads(2, move |mut c| {
            let mine = vec![shared[c.rank].clone()];
            sum_in_rank_order(&mut c, &mine, 3, 0.5).unwrap()
        });
        for result in results {
            assert_eq!(
                result.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                alone.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            );
        }
        assert!(sum_in_rank_order(&mut SingleProcess, &[vec![1.0]], 2, 1.0).is_err());
    }

    #[test]
    fn a_failing_rank_stops_every_rank_with_its_message() {
        let results = threads(2, |mut c| {
            let mine = if c.rank == 1 {
                Err(DdpError::Tune("boom".into()))
            } else {
                Ok(7u32)
            };
            gather_results(&mut c, mine).map_err(|e| e.to_string())
        });
        assert_eq!(results[0], Err("rank 1 failed: tuning: boom".to_string()));
        assert_eq!(results[1], Err("tuning: boom".to_string()));
    }

    /// One layer's tuning on the CPU backend, timed once per candidate, within 1 MiB.
    fn cpu_work<'a>(
        backend: &'a mut CpuBackend,
        cache: &'a Cache,
        problem: ConvProblem,
    ) -> TuningWork<'a> {
        TuningWork {
            backend,
            cache,
            cache_identity: None,
            tuning: LayerTuning {
                policy: Policy::PowerOfTwo,
                workspace_limit_bytes: 1 << 20,
                timing: TimingSettings {
                    warmup: 0,
                    loops: 1,
                    ..TimingSettings::CPU
                },
                candidates: CandidateSet::All,
                engines: EngineOptions::default(),
                split: crate::tune::SplitSetting::Batch,
                index_limit: crate::solver::IndexLimit::CUDNN,
                verify: true,
            },
            jobs: jobs_for([("conv".to_string(), problem)]),
        }
    }

    #[test]
    fn tuning_is_dealt_out_and_every_rank_runs_the_leaders_plans() {
        let results = threads(2, |mut c| {
            let cache = Cache::in_memory();
            let mut backend = CpuBackend::new();
            let mut problem = ConvProblem::new(4, 2, 6, 6, 3, 3, 3);
            problem.pad_h = 1;
            problem.pad_w = 1;
            let mut work = cpu_work(&mut backend, &cache, problem);
            let mut share = deal(&mut c, Ok(&mut work)).unwrap();
            share_plans(&mut c, &mut share, &mut work).unwrap();
            share
        });
        let first = &results[0];
        assert!(first.tasks > 0);
        assert_eq!(results[1].measured_by_rank, first.measured_by_rank);
        assert!(first.measured_by_rank.iter().all(|&n| n > 0), "{first:?}");
        assert_eq!(first.measured_by_rank.iter().sum::<usize>(), first.tasks);
        assert_eq!(first.plans_fnv1a.len(), 2);
        assert_eq!(first.plans_fnv1a[0], first.plans_fnv1a[1]);
    }

    #[test]
    fn a_bad_plan_from_the_leader_is_refused() {
        let cache = Cache::in_memory();
        let mut backend = CpuBackend::new();
        let problem = ConvProblem::new(4, 2, 6, 6, 3, 3, 3);
        let mut work = cpu_work(&mut backend, &cache, problem);
        let good = work.plans().unwrap();
        assert!(work.store_plans(&good).is_ok());
        let mut short = good[0].clone();
        short.micro_batches[0].size -= 1;
        assert!(work.store_plans(&[short]).is_err());
        let mut foreign = good[0].clone();
        foreign.problem.k += 1;
        assert!(work.store_plans(&[foreign]).is_err());
    }
}
