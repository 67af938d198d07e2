//! Data-parallel training on GPUs: which GPUs this process drives ([`select_gpus`]), joining
//! the job ([`GpuJob::join`]: TCP rendezvous between processes, NCCL ranks from
//! [`Rendezvous::gpu_layout`], NCCL's unique id from global rank 0) and training one thread
//! per GPU through the common loop ([`GpuJob::train`] over [`train_group`]).
//!
//! Every thread makes its own [`NcclComm`] (all ranks join at once: `ncclCommInitRank` blocks
//! until the whole world has called it), its [`GpuOps`] on the communicator's stream, and a
//! [`GpuReplica`] around its [`HostCollective`] handle; the loop gets a second handle. The
//! same binary scales out: one process per host driving all its GPUs (`--rank`,
//! `--world-size`, `--master-addr`, `--master-port`), or one process per GPU under a launcher
//! that sets `LOCAL_RANK` (torchrun).

#![forbid(unsafe_code)]

use super::{
    GpuLayout, GpuOps, GpuReplica, GpuSettings, HostCollective, NcclComm, NcclUniqueId, Rendezvous,
    RendezvousConfig,
};
use crate::backend::cudnn::{probe, SystemInfo};
use crate::train::{
    train_group, Collective, Dataset, NetSpec, TrainConfig, TrainError, TrainEvent, TrainReport,
};
use std::sync::Arc;
use std::time::Duration;

/// How long a process waits for the others to join, and in any one collective between
/// processes: long enough for rank 0 to tune every layer while the others wait at the
/// barrier behind it.
pub const JOB_TIMEOUT: Duration = Duration::from_secs(1800);

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
/// - under a launcher that starts one process per GPU (`launcher_local_rank`, from
///   `LOCAL_RANK`), GPU `LOCAL_RANK` alone (`requested` may only be 1);
/// - else the first `requested` GPUs, or every visible GPU.
pub fn select_gpus(
    visible: usize,
    requested: Option<usize>,
    launcher_local_rank: Option<usize>,
) -> Result<Vec<usize>, TrainError> {
    if visible == 0 {
        return Err(TrainError::Config("no GPU is visible".into()));
    }
    if requested == Some(0) {
        return Err(TrainError::Config(
            "--ranks must be at least 1 (GPUs in this process)".into(),
        ));
    }
    match (launcher_local_rank, requested) {
        (Some(local), requested) => {
            if requested.is_some_and(|r| r != 1) {
                return Err(TrainError::Config(format!(
                    "LOCAL_RANK={local} is set, so this process drives one GPU (a launcher \
                     starts one process per GPU): drop --ranks or pass --ranks 1"
                )));
            }
            if local >= visible {
                return Err(TrainError::Config(format!(
                    "LOCAL_RANK={local}, but only {visible} GPU(s) are visible"
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

/// This process's part of a joined GPU job: its GPUs, their NCCL ranks, NCCL's unique id,
/// and the rendezvous with the other processes.
#[derive(Debug)]
pub struct GpuJob {
    gpus: Vec<usize>,
    layout: GpuLayout,
    unique_id: NcclUniqueId,
    rendezvous: Rendezvous,
}

impl GpuJob {
    /// Joins the job: checks that cuBLAS and NCCL load, then the rendezvous (rank 0 listens,
    /// the others connect; a world of one process opens no socket), the NCCL ranks of this
    /// process's `gpus`, and NCCL's unique id (made by the process with rank 0). A missing
    /// library is an error here, before any thread starts.
    pub fn join(gpus: Vec<usize>, rendezvous: &RendezvousConfig) -> Result<Self, TrainError> {
        if gpus.is_empty() {
            return Err(TrainError::Config(
                "a GPU job needs at least one GPU".into(),
            ));
        }
        // Every process checks its libraries before it joins: one that lacks cuBLAS or NCCL
        // must not leave the others waiting for it inside NCCL's initialisation.
        super::cublas_version()?;
        super::nccl_version()?;
        let dist = |e: super::RendezvousError| TrainError::Dist(e.to_string());
        let mut rendezvous = Rendezvous::establish(rendezvous).map_err(dist)?;
        let layout = rendezvous.gpu_layout(gpus.len()).map_err(dist)?;
        let unique_id = NcclUniqueId::share(&mut rendezvous)?;
        Ok(GpuJob {
            gpus,
            layout,
            unique_id,
            rendezvous,
        })
    }

    /// One process with these GPUs.
    pub fn single_process(gpus: Vec<usize>) -> Result<Self, TrainError> {
        Self::join(gpus, &RendezvousConfig::single_process())
    }

    /// This process's GPUs (device ordinals), in local rank order.
    pub fn gpus(&self) -> &[usize] {
        &self.gpus
    }

    /// Where this process's ranks sit in the world (`world_gpus` ranks in all).
    pub fn layout(&self) -> GpuLayout {
        self.layout
    }

    /// This process's rank among the processes (0 prints the reports).
    pub fn process_rank(&self) -> usize {
        self.rendezvous.rank()
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
            unique_id,
            rendezvous,
        } = self;
        let group = HostCollective::group(rendezvous, layout)?
            .into_iter()
            .map(|collective| Ok((collective.try_clone()?, collective)))
            .collect::<Result<Vec<_>, TrainError>>()?;
        let make = |local: usize, collective: HostCollective| {
            let comm = NcclComm::init_rank(
                layout.world_gpus,
                collective.rank(),
                &unique_id,
                gpus[local],
            )?;
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
        assert!(error(2, None, Some(2)).contains("LOCAL_RANK=2"));
        assert!(error(4, Some(2), Some(1)).contains("--ranks 1"));
    }

    /// Without CUDA (CI), asking for GPUs is an error value; with a GPU (the GPU machine) the
    /// same calls succeed.
    #[test]
    fn no_gpu_is_an_error_not_a_panic() {
        match visible_gpus() {
            Ok(system) => assert!(!system.devices.is_empty()),
            Err(error) => {
                let text = error.to_string();
                assert!(!text.is_empty());
                if let TrainError::Gpu(gpu) = &error {
                    assert!(gpu.is_unavailable(), "{gpu}");
                }
            }
        }
        // Joining needs NCCL for the unique id.
        match GpuJob::single_process(vec![0]) {
            Ok(job) => {
                assert_eq!(job.layout().world_gpus, 1);
                assert_eq!(job.process_rank(), 0);
            }
            Err(TrainError::Gpu(error)) => assert!(error.is_unavailable(), "{error}"),
            Err(other) => panic!("unexpected error: {other}"),
        }
        assert!(GpuJob::single_process(Vec::new()).is_err());
    }
}
