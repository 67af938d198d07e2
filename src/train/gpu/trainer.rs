//! Data-parallel training on GPUs: which GPUs this process drives ([`select_gpus`]), making
//! the job ([`GpuJob::single_process`]: every GPU of this process in one `ncclCommInitAll`,
//! no network; [`GpuJob::join`]: processes joined by a [`ProcessGroup`], MPI under `mpirun` or
//! `srun`, NCCL ranks in process order, NCCL's unique id broadcast from process 0) and
//! training one thread per GPU through the common loop ([`GpuJob::train`] over
//! [`train_group`]).
//!
//! Every thread gets its [`NcclComm`] (from `ncclCommInitAll`, or its own `ncclCommInitRank`
//! after every rank of the job said it is ready: `init_rank` blocks until the whole world has
//! called it, so a rank that failed before must keep the others out), its [`GpuOps`] on the
//! communicator's stream, and a [`GpuReplica`] around its [`HostCollective`] handle; the loop
//! gets a second handle. Each communicator's abort is registered with the host collective
//! ([`HostCollective::on_failure`]): the first thread of this process to fail aborts every
//! local communicator (`ncclCommAbort`), so peers waiting on the device behind an NCCL call
//! are released too, not only those waiting on the host.

#![forbid(unsafe_code)]

use super::{GpuOps, GpuReplica, GpuSettings, NcclComm, NcclUniqueId, PendingComm};
use crate::backend::cudnn::{probe, SystemInfo};
use crate::train::{
    agree_ok, rank_layout, train_group, Collective, Dataset, HostCollective, NetSpec, ProcessGroup,
    RankLayout, SingleProcess, TrainConfig, TrainError, TrainEvent, TrainReport,
};
use std::sync::{Arc, Mutex};

/// The driver, cuDNN and the visible GPUs, or why there are none (CUDA or cuDNN missing, no
/// GPU): an error value, never a panic.
pub fn visible_gpus() -> Result<SystemInfo, TrainError> {
    let system = probe().map_err(|e| TrainError::Gpu(e.into()))?;
    if system.devices.is_empty() {
        return Err(TrainError::Config("no GPU is visible".into()));
    }
    Ok(system)
}

/// The GPUs (device ordinals) this process drives, one rank each, out of `visible`:
/// - when several processes share this host (MPI: `node_local_rank` is this process's rank
///   among them), GPU `node_local_rank` alone (`requested` may only be 1);
/// - else the first `requested` GPUs, or every visible GPU.
pub fn select_gpus(
    visible: usize,
    requested: Option<usize>,
    node_local_rank: Option<usize>,
) -> Result<Vec<usize>, TrainError> {
    if visible == 0 {
        return Err(TrainError::Config("no GPU is visible".into()));
    }
    if requested == Some(0) {
        return Err(TrainError::Config(
            "--ranks must be at least 1 (GPUs in this process)".into(),
        ));
    }
    match (node_local_rank, requested) {
        (Some(local), requested) => {
            if requested.is_some_and(|r| r != 1) {
                return Err(TrainError::Config(format!(
                    "this is process {local} of several on this host, so it drives one GPU: \
                     drop --ranks or pass --ranks 1"
                )));
            }
            if local >= visible {
                return Err(TrainError::Config(format!(
                    "process {local} on this host, but only {visible} GPU(s) are visible"
                )));
            }
            Ok(vec![local])
        }
        (None, Some(ranks)) if ranks > visible => Err(TrainError::Config(format!(
            "--ranks {ranks}: only {visible} GPU(s) are visible"
        ))),
        (None, requested) => Ok((0..requested.unwrap_or(visible)).collect()),
    }
}

/// How this process's ranks get their communicators.
enum Nccl {
    /// One process: made at once by `ncclCommInitAll`, one per GPU, taken by their threads.
    All(Vec<Mutex<Option<PendingComm>>>),
    /// Several processes: each thread joins with `ncclCommInitRank` and the shared id.
    Rank(NcclUniqueId),
}

/// This process's part of a GPU job: its GPUs, their ranks, how NCCL is made, and the other
/// processes.
pub struct GpuJob {
    gpus: Vec<usize>,
    layout: RankLayout,
    nccl: Nccl,
    processes: Box<dyn ProcessGroup>,
}

impl std::fmt::Debug for GpuJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuJob")
            .field("gpus", &self.gpus)
            .field("layout", &self.layout)
            .field("process", &self.processes.rank())
            .field("processes", &self.processes.size())
            .finish()
    }
}

impl GpuJob {
    /// One process with these GPUs: checks that cuBLAS and NCCL load, then makes every
    /// communicator with `ncclCommInitAll` (no network). `processes` is a
    /// [`SingleProcess`] (its aborter is called when a rank fails).
    pub fn single_process_with(
        gpus: Vec<usize>,
        processes: SingleProcess,
    ) -> Result<Self, TrainError> {
        if gpus.is_empty() {
            return Err(TrainError::Config(
                "a GPU job needs at least one GPU".into(),
            ));
        }
        super::cublas_version()?;
        let comms = NcclComm::init_all(&gpus)?;
        Ok(GpuJob {
            layout: RankLayout::single(gpus.len()),
            gpus,
            nccl: Nccl::All(comms.into_iter().map(|c| Mutex::new(Some(c))).collect()),
            processes: Box::new(processes),
        })
    }

    /// [`GpuJob::single_process_with`] a plain [`SingleProcess`].
    pub fn single_process(gpus: Vec<usize>) -> Result<Self, TrainError> {
        Self::single_process_with(gpus, SingleProcess::new())
    }

    /// Joins a job of several processes (every process calls this at once): every process
    /// checks its libraries and says whether it is ready (one that lacks cuBLAS or NCCL must
    /// not leave the others waiting inside NCCL's initialisation), the NCCL ranks of this
    /// process's `gpus` follow in process order, and process 0's NCCL unique id reaches
    /// everyone.
    pub fn join(
        gpus: Vec<usize>,
        mut processes: Box<dyn ProcessGroup>,
    ) -> Result<Self, TrainError> {
        let ready = if gpus.is_empty() {
            Err(TrainError::Config(
                "a GPU job needs at least one GPU".into(),
            ))
        } else {
            super::cublas_version()
                .and_then(|_| super::nccl_version())
                .map(|_| ())
                .map_err(TrainError::from)
        };
        // One flag per process, summed over the processes.
        let mut flags = vec![0u8; 1];
        flags[0] = u8::from(ready.is_err());
        let all = processes.all_gather_bytes(&flags)?;
        ready?;
        if let Some(process) = all.iter().position(|f| f.first() != Some(&0)) {
            return Err(TrainError::PeerFailed {
                rank: process,
                reason: "process could not load its GPU libraries (see its error)".into(),
            });
        }
        let layout = rank_layout(processes.as_mut(), gpus.len())?;
        let unique_id = NcclUniqueId::share(processes.as_mut())?;
        Ok(GpuJob {
            gpus,
            layout,
            nccl: Nccl::Rank(unique_id),
            processes,
        })
    }

    /// This process's GPUs (device ordinals), in local rank order.
    pub fn gpus(&self) -> &[usize] {
        &self.gpus
    }

    /// Where this process's ranks sit in the world (`world_ranks` GPUs in all).
    pub fn layout(&self) -> RankLayout {
        self.layout
    }

    /// This process's rank among the processes (0 prints the reports).
    pub fn process_rank(&self) -> usize {
        self.processes.rank()
    }

    /// Trains one replica per GPU of this process, each on its own thread, with the other
    /// processes doing the same. Returns local rank 0's report (the statistics are global).
    #[allow(clippy::too_many_arguments)]
    pub fn train(
        self,
        spec: &NetSpec,
        seed: u64,
        settings: &GpuSettings,
        train: &Arc<Dataset>,
        test: &Arc<Dataset>,
        config: &TrainConfig,
        events: &mut (dyn FnMut(TrainEvent<'_>) + Send),
    ) -> Result<TrainReport, TrainError> {
        spec.validate()?;
        settings.validate()?;
        let GpuJob {
            gpus,
            layout,
            nccl,
            processes,
        } = self;
        let group = HostCollective::group(processes, layout)?
            .into_iter()
            .map(|collective| Ok((collective.try_clone()?, collective)))
            .collect::<Result<Vec<_>, TrainError>>()?;
        let make = |local: usize, mut collective: HostCollective| {
            let comm = match &nccl {
                Nccl::All(pending) => {
                    let taken = pending
                        .get(local)
                        .and_then(|slot| slot.lock().ok().and_then(|mut slot| slot.take()))
                        .ok_or_else(|| {
                            TrainError::Config(format!("no communicator for local rank {local}"))
                        })?;
                    taken.into_comm()?
                }
                Nccl::Rank(unique_id) => {
                    // Every rank must be ready before any enters ncclCommInitRank.
                    let stream = super::ffi::single_stream(gpus[local]).map_err(TrainError::from);
                    let stream = agree_ok(&mut collective, stream)?;
                    NcclComm::init_rank_on_stream(
                        layout.world_ranks,
                        collective.rank(),
                        unique_id,
                        stream,
                    )?
                }
            };
            // A failing thread of this process aborts every local communicator.
            collective.on_failure(comm.abort_on_failure());
            let ops = GpuOps::with_stream(comm.stream().clone())?;
            GpuReplica::new(spec, seed, settings, ops, comm, collective)
        };
        train_group(group, make, train, test, config, events)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_selection_rules() {
        assert_eq!(select_gpus(4, None, None).unwrap(), [0, 1, 2, 3]);
        assert_eq!(select_gpus(4, Some(2), None).unwrap(), [0, 1]);
        assert_eq!(select_gpus(4, None, Some(3)).unwrap(), [3]);
        assert_eq!(select_gpus(4, Some(1), Some(2)).unwrap(), [2]);
        let error = |visible, requested, local| {
            select_gpus(visible, requested, local)
                .unwrap_err()
                .to_string()
        };
        assert!(error(0, None, None).contains("no GPU"));
        assert!(error(2, Some(3), None).contains("only 2 GPU(s)"));
        assert!(error(2, Some(0), None).contains("at least 1"));
        assert!(error(2, None, Some(2)).contains("process 2"));
        assert!(error(4, Some(2), Some(1)).contains("--ranks 1"));
    }

    #[test]
    fn without_a_gpu_jobs_are_errors_not_panics() {
        if let Err(e) = visible_gpus() {
            println!("no GPU (expected in CI): {e}");
            assert!(GpuJob::single_process(vec![0]).is_err());
            assert!(GpuJob::single_process(Vec::new()).is_err());
            let error = GpuJob::join(vec![0], Box::new(SingleProcess::new())).unwrap_err();
            assert!(!error.to_string().is_empty());
        }
    }
}
