//! Tuning dealt out over the ranks, so that every rank runs identical plans even when each
//! has its own tuning cache (a file per host under MPI), and no measurement is taken twice.
//!
//! The same protocol as the PyTorch path (`python/mucudnn/torch/_tune.py`), over the loop's
//! [`Collective`] ([`Collective::all_gather_bytes`], JSON messages):
//!
//! 1. [`deal`]: every rank lists the measuring tasks ([`MeasureTask`]: problem, op,
//!    micro-batch size, candidate kind) its cache lacks for the jobs of its
//!    [`TuningWork`], and the ranks all-gather their device fingerprints, lists and which
//!    cache they use. Ranks of one process that open the same cache file form one *unit*:
//!    only the unit's lowest rank measures (threads sharing a cache deal nothing among
//!    themselves). Ranks with another fingerprint form another group and never share.
//! 2. The union of the group's missing tasks (deduplicated by problem, op, micro-batch size
//!    and kind) is dealt out round-robin over the group's units, anchors first, then the
//!    sizes between them (whose engine pruning reads the anchors), as two rounds. After each
//!    round the ranks all-gather the measurements (not plans) and store the other units'.
//! 3. [`share_plans`]: the group's lowest rank (its *leader*; rank 0 for the first group)
//!    tunes from its now complete cache, and every other rank stores the leader's plans in
//!    its own cache, where its tuning then finds them: every rank adopts the leader's plans,
//!    even where its cache held other, older measurements.
//!
//! An error on any rank (listing, measuring, the leader's tuning) travels in the gathered
//! message, so every rank stops with it (or with [`TrainError::PeerFailed`]) instead of
//! waiting. A replica without [`TuningWork`] (an in-memory cache per layer) takes part in
//! the collectives with nothing to deal; its ranks tune alone, the leader first.

use super::{Collective, TrainError};
use crate::backend::Backend;
use crate::profiler::Job;
use crate::solver::{DeviceFingerprint, Plan};
use crate::tune::{
    measure_task, missing_tasks, store_measured, LayerTuning, MeasureTask, MeasuredTask, ProfileRun,
};
use mucudnn_cache::{Cache, PlanKey};
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::OnceLock;

/// What a replica's [`Replica::prepare`](super::Replica::prepare) would tune, as a backend
/// to measure on, a connection to the replica's cache, and the jobs.
pub struct TuningWork {
    /// A backend of the replica's device (measures this rank's share).
    pub backend: Box<dyn Backend>,
    /// A connection to the cache the replica's layers tune from.
    pub cache: Cache,
    /// The cache file (ranks of one process naming the same file share it).
    pub cache_path: PathBuf,
    /// The replica's tuning settings (policy, limit, timing, candidates).
    pub tuning: LayerTuning,
    /// Every (layer, problem, op) the replica tunes for the batch sizes asked.
    pub jobs: Vec<Job>,
}

impl std::fmt::Debug for TuningWork {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TuningWork")
            .field("device", &self.backend.fingerprint().name)
            .field("cache_path", &self.cache_path)
            .field("jobs", &self.jobs.len())
            .finish_non_exhaustive()
    }
}

impl TuningWork {
    fn run(&self) -> ProfileRun<'_> {
        ProfileRun {
            policy: self.tuning.policy,
            timing: self.tuning.timing,
            cache: &self.cache,
            interrupt: None,
            candidates: self.tuning.candidates,
            engines: self.tuning.engines,
            workspace_limit_bytes: Some(self.tuning.workspace_limit_bytes),
        }
    }

    fn missing(&self) -> Result<Vec<MeasureTask>, TrainError> {
        missing_tasks(
            &self.jobs,
            &self.run(),
            self.backend.fingerprint(),
            self.backend.kinds(),
        )
        .map_err(layer_error)
    }

    fn measure(&mut self, tasks: &[&MeasureTask]) -> Result<Vec<MeasuredTask>, TrainError> {
        let mut measured = Vec::with_capacity(tasks.len());
        for task in tasks {
            let run = ProfileRun {
                policy: self.tuning.policy,
                timing: self.tuning.timing,
                cache: &self.cache,
                interrupt: None,
                candidates: self.tuning.candidates,
                engines: self.tuning.engines,
                workspace_limit_bytes: Some(self.tuning.workspace_limit_bytes),
            };
            measured.push(measure_task(self.backend.as_mut(), task, &run).map_err(layer_error)?);
        }
        Ok(measured)
    }

    /// What [`share_plans`] needs once the measuring is done: the backend (and its device
    /// buffers) goes.
    pub fn into_plan_store(self) -> PlanStore {
        let key = PlanKey::reuse(
            self.tuning.policy,
            self.run().effective_candidates(self.backend.kinds()),
            self.tuning.workspace_limit_bytes,
        );
        PlanStore {
            fingerprint: self.backend.fingerprint().clone(),
            key,
            cache: self.cache,
        }
    }
}

/// Where a rank stores its leader's plans: its cache, under the key its tuning reads.
pub struct PlanStore {
    cache: Cache,
    fingerprint: DeviceFingerprint,
    key: PlanKey,
}

impl PlanStore {
    fn store(&self, plans: &[Plan]) {
        for plan in plans {
            self.cache.store_plan(&self.fingerprint, plan, &self.key);
        }
    }
}

fn layer_error(error: crate::tune::TuneError) -> TrainError {
    TrainError::Layer(error.into())
}

/// Identifies this process among the job's (ranks with the same token are threads of one
/// process): the process id and the time of first use, hashed.
fn process_token() -> u64 {
    static TOKEN: OnceLock<u64> = OnceLock::new();
    *TOKEN.get_or_init(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        format!("{}:{nanos}", std::process::id())
            .bytes()
            .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
            })
    })
}

/// What each rank says in step 1.
#[derive(Debug, Serialize, Deserialize)]
struct Intro {
    /// `None`: no [`TuningWork`] (this rank tunes alone).
    fingerprint: Option<DeviceFingerprint>,
    /// (process token, cache file): ranks with the same unit share one cache.
    unit: Option<(u64, PathBuf)>,
    missing: Result<Vec<MeasureTask>, String>,
}

/// How the tuning was dealt out: for reports and for [`share_plans`].
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct TuningShare {
    /// Measuring tasks missing in rank 0's group (deduplicated over its ranks).
    pub tasks: usize,
    /// How many tasks each rank measured (0 for a rank whose process measured for it).
    pub measured_by_rank: Vec<usize>,
    /// Each rank's plans, hashed (FNV-1a of their JSON) after tuning: equal hashes, identical
    /// plans. Filled by [`plan_checksums`].
    pub plans_fnv1a: Vec<String>,
    /// Each rank's leader: the lowest rank with its fingerprint, whose plans it adopts.
    #[serde(skip)]
    leaders: Vec<usize>,
}

impl TuningShare {
    /// Whether `rank` tunes first and hands its plans to the others of its group.
    pub fn is_leader(&self, rank: usize) -> bool {
        self.leaders.get(rank) == Some(&rank)
    }
}

fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, TrainError> {
    serde_json::to_vec(value)
        .map_err(|e| TrainError::Collective(format!("cannot encode a tuning message: {e}")))
}

fn decode<T: for<'de> Deserialize<'de>>(rank: usize, bytes: &[u8]) -> Result<T, TrainError> {
    serde_json::from_slice(bytes)
        .map_err(|e| TrainError::Collective(format!("rank {rank} sent a bad tuning message: {e}")))
}

/// Every rank's message of one gather, or this rank's own error, or the first failed peer's.
fn gather_results<T>(
    collective: &mut dyn Collective,
    mine: Result<T, TrainError>,
) -> Result<Vec<T>, TrainError>
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
        match decode::<Result<T, String>>(peer, part)? {
            Ok(value) => values.push(Some(value)),
            Err(reason) => return Err(TrainError::PeerFailed { rank: peer, reason }),
        }
    }
    values[rank] = Some(mine);
    Ok(values.into_iter().flatten().collect())
}

/// The identity of a task for deduplication (the layer name aside).
fn task_key(task: &MeasureTask) -> String {
    serde_json::to_string(&(&task.problem, task.op, task.micro, task.kind)).unwrap_or_default()
}

/// Steps 1 and 2 of the module docs; every rank calls it at the same point with its work
/// (`Ok(None)`: nothing to deal; `Err`: this rank failed and every rank stops). Measures this
/// rank's share into its cache and stores the others' there.
pub fn deal(
    collective: &mut dyn Collective,
    work: Result<Option<&mut TuningWork>, TrainError>,
) -> Result<TuningShare, TrainError> {
    let rank = collective.rank();
    let (intro, work) = match work {
        Err(error) => (Err(error), None),
        Ok(None) => (
            Ok(Intro {
                fingerprint: None,
                unit: None,
                missing: Ok(Vec::new()),
            }),
            None,
        ),
        Ok(Some(work)) => (
            work.missing().map(|missing| Intro {
                fingerprint: Some(work.backend.fingerprint().clone()),
                unit: Some((process_token(), work.cache_path.clone())),
                missing: Ok(missing),
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
    // The ranks that measure: the lowest rank of each unit, with a fingerprint.
    let measures = |r: usize| {
        intros[r].fingerprint.is_some()
            && intros[..r].iter().all(|other| other.unit != intros[r].unit)
    };
    let group = |r: usize| -> Vec<usize> {
        (0..world)
            .filter(|&q| intros[q].fingerprint == intros[r].fingerprint && measures(q))
            .collect()
    };
    let union = |members: &[usize]| -> Vec<&MeasureTask> {
        let mut seen = BTreeSet::new();
        members
            .iter()
            .flat_map(|&q| intros[q].missing.as_ref().map_or(&[][..], |m| &m[..]))
            .filter(|task| seen.insert(task_key(task)))
            .collect()
    };
    let mut share = TuningShare {
        tasks: if intros[0].fingerprint.is_some() {
            union(&group(0)).len()
        } else {
            0
        },
        measured_by_rank: vec![0; world],
        plans_fnv1a: Vec::new(),
        leaders,
    };
    let nothing_missing = intros
        .iter()
        .all(|intro| intro.missing.as_ref().is_ok_and(Vec::is_empty));
    if nothing_missing {
        return Ok(share);
    }
    let members = group(rank);
    let tasks = union(&members);
    let position = members.iter().position(|&q| q == rank);
    let mut work = work;
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
        let measured = match (&mut work, mine.is_empty()) {
            (Some(work), false) => work.measure(&mine),
            _ => Ok(Vec::new()),
        };
        let everyone: Vec<Vec<MeasuredTask>> = gather_results(collective, measured)?;
        for (peer, theirs) in everyone.iter().enumerate() {
            share.measured_by_rank[peer] += theirs.len();
        }
        if let Some(work) = &work {
            for &peer in &members {
                if intros[peer].unit == intros[rank].unit || everyone[peer].is_empty() {
                    continue;
                }
                let backend = work.backend.as_ref();
                store_measured(&work.cache, backend, backend.fingerprint(), &everyone[peer])
                    .map_err(layer_error)?;
            }
        }
    }
    Ok(share)
}

/// Step 3 of the module docs, after [`deal`]: the leaders pass `Ok(plans)` (every plan they
/// tuned), the others `Ok(vec![])`; every rank that is not a leader stores its leader's plans
/// in its cache (through `store`, from [`TuningWork::into_plan_store`]), where its own tuning then finds them. An `Err` stops every
/// rank.
pub fn share_plans(
    collective: &mut dyn Collective,
    share: &TuningShare,
    store: Option<&PlanStore>,
    plans: Result<Vec<Plan>, TrainError>,
) -> Result<(), TrainError> {
    let rank = collective.rank();
    let everyone: Vec<Vec<Plan>> = gather_results(collective, plans)?;
    let leader = share.leaders.get(rank).copied().unwrap_or(0);
    if let (Some(store), false) = (store, leader == rank) {
        if let Some(plans) = everyone.get(leader) {
            store.store(plans);
        }
    }
    Ok(())
}

/// Every rank's checksum of its plans after tuning (FNV-1a of their JSON), in rank order;
/// an `Err` (this rank's tuning failed) stops every rank.
pub fn plan_checksums(
    collective: &mut dyn Collective,
    plans: Result<Vec<Plan>, TrainError>,
) -> Result<Vec<String>, TrainError> {
    let hash = plans.and_then(|plans| encode(&plans)).map(|json| {
        let hash = json.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
        format!("{hash:016x}")
    });
    gather_results(collective, hash)
}
