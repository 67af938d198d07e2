//! The processes of a training job, and the loop's host [`Collective`] over them.
//!
//! A job is one or more processes (started by `mpirun` or `srun` and joined by MPI, see
//! `super::mpi` behind the `mpi` feature), each running one or more ranks as threads (one per
//! GPU; on the CPU one per process under MPI, or `--ranks` threads in one process).
//! [`ProcessGroup`] is what the host collective needs from the processes: a byte all-gather in
//! process order and a job-wide abort. [`SingleProcess`] is a job of one process;
//! [`ThreadProcesses`] simulates several processes with threads of this one, so that the
//! multi-process logic is tested in CI without MPI.
//!
//! Why not NCCL for [`HostCollective`]: what goes through it is small and host-side (per-step
//! sample counts and ok flags, per-epoch loss and accuracy sums, barriers around tuning, the
//! `--check-sync` parameter broadcast; on the CPU, the gradients too), it needs f64 and exact,
//! reproducible sums, and it runs without a GPU. The GPU gradients go through NCCL on the
//! replica's stream (`super::gpu::NcclComm`).
//!
//! # How an operation runs
//!
//! Ranks `first_rank..first_rank + local_ranks` live in this process. A sum is taken over the
//! local ranks first (in local rank order, in f64), then local rank 0 of every process
//! exchanges the partial sums with the other processes (an all-gather) and adds them in
//! process order, and hands the result to its local ranks. Every rank of the job therefore
//! gets the same bits, whatever the thread timing; f32 data is summed in f64 and rounded once,
//! as [`ThreadCollective`] does. With one rank per process this is exactly the thread
//! collective's order (rank 0, 1, ...), so an MPI job of P processes gets the bits of P
//! threads. A broadcast goes from the root to its process's local rank 0, to every process,
//! then to each process's ranks.
//!
//! A failing rank aborts its process's thread group and, through [`ProcessGroup::aborter`],
//! the job: under MPI that is `MPI_Abort`, which ends every process.

#![forbid(unsafe_code)]

use super::{Collective, ThreadCollective, TrainError};
use std::sync::{Arc, Mutex};

/// Ends the whole job after a rank failed: called with the global rank and its error. Under
/// MPI it prints the message and calls `MPI_Abort` (it does not return); a single process may
/// install one that stops the process if its threads do not finish (the CLI does).
pub type JobAbort = Arc<dyn Fn(usize, &str) + Send + Sync>;

/// An aborter that does nothing (the thread group's own abort releases the local ranks).
pub fn no_abort() -> JobAbort {
    Arc::new(|_, _| {})
}

/// The processes of a job, as the host collective sees them. Every process calls the same
/// operations in the same order.
pub trait ProcessGroup: Send {
    /// This process's rank among the processes.
    fn rank(&self) -> usize;
    /// How many processes the job has.
    fn size(&self) -> usize;
    /// Every process's bytes, in process order (lengths may differ).
    fn all_gather_bytes(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>, TrainError>;
    /// Process `root`'s bytes on every process (`mine` is read on the root only).
    fn broadcast_bytes(&mut self, mine: &[u8], root: usize) -> Result<Vec<u8>, TrainError> {
        if root >= self.size() {
            return Err(TrainError::Collective(format!(
                "broadcast from process {root} of {}",
                self.size()
            )));
        }
        let sent: &[u8] = if self.rank() == root { mine } else { &[] };
        let mut parts = self.all_gather_bytes(sent)?;
        Ok(std::mem::take(&mut parts[root]))
    }
    /// What ends the whole job when a rank fails.
    fn aborter(&self) -> JobAbort;
}

/// A job of one process.
pub struct SingleProcess {
    abort: JobAbort,
}

impl SingleProcess {
    /// One process whose failures only abort its thread group.
    pub fn new() -> Self {
        SingleProcess { abort: no_abort() }
    }

    /// One process that also calls `abort` when a rank fails.
    pub fn with_aborter(abort: JobAbort) -> Self {
        SingleProcess { abort }
    }
}

impl Default for SingleProcess {
    fn default() -> Self {
        Self::new()
    }
}

impl ProcessGroup for SingleProcess {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn all_gather_bytes(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>, TrainError> {
        Ok(vec![mine.to_vec()])
    }
    fn aborter(&self) -> JobAbort {
        self.abort.clone()
    }
}

/// Several "processes" that are threads of this one, joined by a [`ThreadCollective`]: what
/// MPI does between processes, for tests. Make them with [`ThreadProcesses::group`] and move
/// each into its own thread (or thread group).
pub struct ThreadProcesses {
    link: ThreadCollective,
    /// A second handle on the link, for aborting while another thread uses the first.
    abort_link: Arc<Mutex<ThreadCollective>>,
}

impl ThreadProcesses {
    /// Processes `0..size`, in rank order.
    pub fn group(size: usize) -> Result<Vec<ThreadProcesses>, TrainError> {
        ThreadCollective::group(size)?
            .into_iter()
            .map(|link| {
                Ok(ThreadProcesses {
                    abort_link: Arc::new(Mutex::new(link.try_clone()?)),
                    link,
                })
            })
            .collect()
    }
}

impl ProcessGroup for ThreadProcesses {
    fn rank(&self) -> usize {
        self.link.rank()
    }
    fn size(&self) -> usize {
        self.link.world_size()
    }
    fn all_gather_bytes(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>, TrainError> {
        // Lengths first (a sum with one non-zero slot each), then one exact f64 broadcast per
        // process: bytes are small integers, copied exactly.
        let (rank, size) = (self.rank(), self.size());
        let mut lengths = vec![0.0f64; size];
        lengths[rank] = mine.len() as f64;
        self.link.all_reduce_sum_f64(&mut lengths)?;
        let mut parts = Vec::with_capacity(size);
        for (root, &length) in lengths.iter().enumerate() {
            let mut values: Vec<f64> = if root == rank {
                mine.iter().map(|&b| f64::from(b)).collect()
            } else {
                vec![0.0; length as usize]
            };
            self.link.broadcast_f64(&mut values, root)?;
            parts.push(values.into_iter().map(|v| v as u8).collect());
        }
        Ok(parts)
    }
    fn aborter(&self) -> JobAbort {
        let link = self.abort_link.clone();
        Arc::new(move |rank, reason| {
            let mut link = link
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            link.abort(&format!("rank {rank} failed: {reason}"));
        })
    }
}

/// How many processes an MPI launcher started, from this process's environment (`env(NAME)`):
/// Open MPI's `mpirun` (`OMPI_COMM_WORLD_SIZE`), MPICH/Hydra and Slurm's PMI
/// (`PMI_SIZE`), MVAPICH (`MV2_COMM_WORLD_SIZE`), or `srun` (`SLURM_STEP_NUM_TASKS` with
/// `SLURM_PROCID`). `None` when no launcher is seen.
pub fn mpi_launch_size(env: impl Fn(&str) -> Option<String>) -> Option<usize> {
    let number = |name: &str| env(name).and_then(|text| text.trim().parse::<usize>().ok());
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE"]
        .into_iter()
        .find_map(number)
        .or_else(|| {
            env("SLURM_PROCID")
                .is_some()
                .then(|| number("SLURM_STEP_NUM_TASKS"))
                .flatten()
        })
}

/// Where one process's ranks sit among every process's ranks ([`rank_layout`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankLayout {
    /// The global rank of this process's first rank (its local rank `i` is `first_rank + i`).
    pub first_rank: usize,
    /// How many ranks (threads; GPUs) this process runs.
    pub local_ranks: usize,
    /// Every process's ranks.
    pub world_ranks: usize,
}

impl RankLayout {
    /// One process with all `ranks`.
    pub fn single(ranks: usize) -> Self {
        RankLayout {
            first_rank: 0,
            local_ranks: ranks,
            world_ranks: ranks,
        }
    }
}

/// Every process says how many ranks it runs (at least one); ranks are numbered in process
/// order.
pub fn rank_layout(
    processes: &mut dyn ProcessGroup,
    local_ranks: usize,
) -> Result<RankLayout, TrainError> {
    if local_ranks == 0 {
        return Err(TrainError::Config(format!(
            "process {} runs no rank: every process needs at least one",
            processes.rank()
        )));
    }
    let parts = processes.all_gather_bytes(&(local_ranks as u64).to_le_bytes())?;
    let mut counts = Vec::with_capacity(parts.len());
    for (process, part) in parts.iter().enumerate() {
        let bytes: [u8; 8] = part.as_slice().try_into().map_err(|_| {
            TrainError::Collective(format!(
                "process {process} sent a rank count of {} bytes",
                part.len()
            ))
        })?;
        counts.push(u64::from_le_bytes(bytes) as usize);
    }
    Ok(RankLayout {
        first_rank: counts[..processes.rank()].iter().sum(),
        local_ranks,
        world_ranks: counts.iter().sum(),
    })
}

/// One rank's handle on the host collective of a (possibly multi-process) job. Make a
/// process's handles with [`HostCollective::group`] and move one into each rank's thread; a
/// rank may hold a second handle ([`HostCollective::try_clone`]) as long as it uses its
/// handles one at a time, in the same order on every rank.
pub struct HostCollective {
    /// Global rank and world size.
    rank: usize,
    world: usize,
    /// This process's ranks.
    local: ThreadCollective,
    first_rank: usize,
    local_ranks: usize,
    /// How many processes take part.
    processes: usize,
    /// The other processes: held by local rank 0's handles when there is more than one
    /// process (used by one thread only, so the lock never waits).
    network: Option<Arc<Mutex<Box<dyn ProcessGroup>>>>,
    abort: JobAbort,
}

impl std::fmt::Debug for HostCollective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostCollective")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("processes", &self.processes)
            .finish_non_exhaustive()
    }
}

fn encode_f64(values: &[f64]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn decode_f64(bytes: &[u8]) -> Vec<f64> {
    bytes
        .chunks_exact(8)
        .map(|chunk| {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            f64::from_le_bytes(word)
        })
        .collect()
}

impl HostCollective {
    /// This process's handles, in local rank order, for the ranks `layout` gives it
    /// (global ranks `layout.first_rank + i`, world `layout.world_ranks`; see
    /// [`rank_layout`]); `processes` joins the processes.
    pub fn group(
        processes: Box<dyn ProcessGroup>,
        layout: RankLayout,
    ) -> Result<Vec<HostCollective>, TrainError> {
        let abort = processes.aborter();
        let group = processes;
        let processes = group.size();
        let RankLayout {
            first_rank,
            local_ranks: local_gpus,
            world_ranks: world_gpus,
        } = layout;
        let fits = local_gpus >= 1
            && first_rank
                .checked_add(local_gpus)
                .is_some_and(|end| end <= world_gpus)
            && (processes > 1 || (first_rank == 0 && local_gpus == world_gpus));
        if !fits {
            return Err(TrainError::Config(format!(
                "ranks {first_rank}..{} of a world of {world_gpus} do not fit a job of \
                 {processes} process(es)",
                first_rank.saturating_add(local_gpus)
            )));
        }
        let network = (processes > 1).then(|| Arc::new(Mutex::new(group)));
        Ok(ThreadCollective::group(local_gpus)?
            .into_iter()
            .enumerate()
            .map(|(index, local)| HostCollective {
                rank: first_rank + index,
                world: world_gpus,
                local,
                first_rank,
                local_ranks: local_gpus,
                processes,
                network: if index == 0 { network.clone() } else { None },
                abort: abort.clone(),
            })
            .collect())
    }

    /// A group of `ranks` threads of this process and no other process.
    pub fn single_process(ranks: usize) -> Result<Vec<HostCollective>, TrainError> {
        Self::group(Box::new(SingleProcess::new()), RankLayout::single(ranks))
    }

    /// A second handle for the same rank (see the type's docs).
    pub fn try_clone(&self) -> Result<HostCollective, TrainError> {
        Ok(HostCollective {
            rank: self.rank,
            world: self.world,
            local: self.local.try_clone()?,
            first_rank: self.first_rank,
            local_ranks: self.local_ranks,
            processes: self.processes,
            network: self.network.clone(),
            abort: self.abort.clone(),
        })
    }

    /// Names a failed peer of this process by its global rank (the thread group counts
    /// from 0).
    fn global(&self, error: TrainError) -> TrainError {
        match error {
            TrainError::PeerFailed { rank, reason } => TrainError::PeerFailed {
                rank: self.first_rank + rank,
                reason,
            },
            other => other,
        }
    }

    /// Runs `hook` when a rank of this process fails (see [`ThreadCollective::on_failure`]).
    /// Under MPI a failure ends every process (`MPI_Abort`) before the hooks would run.
    pub fn on_failure(&self, hook: super::collective::FailureHook) {
        self.local.on_failure(hook);
    }

    /// How many processes the job has.
    pub fn processes(&self) -> usize {
        self.processes
    }

    /// Every process's bytes, in process order (local rank 0 only, several processes).
    fn gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, TrainError> {
        let network = self.network.as_ref().ok_or_else(|| {
            TrainError::Collective("only local rank 0 talks to the other processes".into())
        })?;
        let mut processes = network.lock().map_err(|_| {
            TrainError::Collective("a rank panicked while talking to the other processes".into())
        })?;
        processes.all_gather_bytes(mine)
    }

    /// The elementwise f64 sum over every rank of the job, on every rank.
    fn sum_f64(&mut self, data: &mut [f64]) -> Result<(), TrainError> {
        self.local
            .all_reduce_sum_f64(data)
            .map_err(|e| self.global(e))?;
        if self.processes == 1 {
            return Ok(());
        }
        if self.network.is_some() {
            let parts = self.gather(&encode_f64(data))?;
            let mut sums = Vec::new();
            for (process, part) in parts.iter().enumerate() {
                let values = decode_f64(part);
                if values.len() != data.len() || part.len() % 8 != 0 {
                    return Err(TrainError::Collective(format!(
                        "process {process} summed {} bytes, this one {} values",
                        part.len(),
                        data.len()
                    )));
                }
                if process == 0 {
                    sums = values;
                } else {
                    for (sum, value) in sums.iter_mut().zip(values) {
                        *sum += value;
                    }
                }
            }
            data.copy_from_slice(&sums);
        }
        self.local
            .broadcast_f64(data, 0)
            .map_err(|e| self.global(e))
    }
}

impl Collective for HostCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&mut self, data: &mut [f32]) -> Result<(), TrainError> {
        let mut wide: Vec<f64> = data.iter().map(|&v| f64::from(v)).collect();
        self.sum_f64(&mut wide)?;
        // Rounded once, here, from the same f64 on every rank.
        for (out, value) in data.iter_mut().zip(wide) {
            *out = value as f32;
        }
        Ok(())
    }

    fn all_reduce_sum_f64(&mut self, data: &mut [f64]) -> Result<(), TrainError> {
        self.sum_f64(data)
    }

    fn broadcast(&mut self, data: &mut [f32], root: usize) -> Result<(), TrainError> {
        if root >= self.world {
            return Err(TrainError::Collective(format!(
                "broadcast from rank {root} in a world of {}",
                self.world
            )));
        }
        let here = (self.first_rank..self.first_rank + self.local_ranks).contains(&root);
        if here {
            self.local
                .broadcast(data, root - self.first_rank)
                .map_err(|e| self.global(e))?;
        }
        if self.processes == 1 {
            return Ok(());
        }
        if self.network.is_some() {
            // A flag byte says which process holds the root's data.
            let mine: Vec<u8> = if here {
                std::iter::once(1u8)
                    .chain(data.iter().flat_map(|v| v.to_le_bytes()))
                    .collect()
            } else {
                vec![0]
            };
            let parts = self.gather(&mine)?;
            let theirs = parts
                .iter()
                .find(|part| part.first() == Some(&1))
                .ok_or_else(|| TrainError::Collective(format!("no process holds rank {root}")))?;
            let values = &theirs[1..];
            if values.len() != 4 * data.len() {
                return Err(TrainError::Collective(format!(
                    "rank {root} broadcast {} bytes, this rank expects {} values",
                    values.len(),
                    data.len()
                )));
            }
            for (out, chunk) in data.iter_mut().zip(values.chunks_exact(4)) {
                *out = f32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
            }
        }
        self.local.broadcast(data, 0).map_err(|e| self.global(e))
    }

    fn abort(&mut self, reason: &str) {
        // The first failure of this process ends the job (a rank that only echoes a local
        // peer's failure does not abort again); then release the local ranks.
        if !self.local.has_failed() {
            (self.abort)(self.rank, reason);
        }
        self.local.abort(reason);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every rank's handle of a job of `processes` simulated processes (thread groups joined
    /// by [`ThreadProcesses`]) with `local` ranks each; global rank order.
    fn job(processes: usize, local: usize) -> Vec<HostCollective> {
        if processes == 1 {
            return HostCollective::single_process(local).unwrap();
        }
        // The layouts are an all-gather: every process at once.
        let layouts: Vec<_> = ThreadProcesses::group(processes)
            .unwrap()
            .into_iter()
            .map(|mut group| {
                std::thread::spawn(move || {
                    let layout = rank_layout(&mut group, local).unwrap();
                    (group, layout)
                })
            })
            .collect();
        layouts
            .into_iter()
            .flat_map(|t| {
                let (group, layout) = t.join().unwrap();
                HostCollective::group(Box::new(group), layout).unwrap()
            })
            .collect()
    }

    /// Runs `body` on every rank (a thread each); results in rank order.
    fn on_ranks<T: Send>(
        group: Vec<HostCollective>,
        body: impl Fn(&mut HostCollective) -> T + Sync,
    ) -> Vec<T> {
        std::thread::scope(|scope| {
            let threads: Vec<_> = group
                .into_iter()
                .map(|mut c| {
                    let body = &body;
                    scope.spawn(move || body(&mut c))
                })
                .collect();
            threads.into_iter().map(|t| t.join().unwrap()).collect()
        })
    }

    #[test]
    fn two_processes_of_two_ranks_sum_broadcast_and_agree_bit_for_bit() {
        let group = job(2, 2);
        assert_eq!(group.len(), 4);
        let ranks: Vec<_> = group.iter().map(|c| (c.rank(), c.world_size())).collect();
        assert_eq!(ranks, [(0, 4), (1, 4), (2, 4), (3, 4)]);
        let results = on_ranks(group, |c| {
            let r = c.rank() as f32;
            let mut out = Vec::new();
            for round in 0..20u32 {
                let mut data = vec![1e8 * (r - 1.5), 1.0 + r * 1e-7, round as f32 + r];
                c.all_reduce_sum(&mut data).unwrap();
                out.push(data.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
            }
            let mut stats = [c.rank() as f64, 1.0];
            c.all_reduce_sum_f64(&mut stats).unwrap();
            let mut from_three = vec![c.rank() as f32 + 0.25; 3];
            c.broadcast(&mut from_three, 3).unwrap();
            let mut from_zero = vec![c.rank() as f32 - 7.0; 2];
            c.broadcast(&mut from_zero, 0).unwrap();
            c.barrier().unwrap();
            let mut empty: [f64; 0] = [];
            c.all_reduce_sum_f64(&mut empty).unwrap();
            (out, stats, from_three, from_zero)
        });
        for result in &results[1..] {
            assert_eq!(result.0, results[0].0);
        }
        for (_, stats, from_three, from_zero) in &results {
            assert_eq!(stats, &[6.0, 4.0]);
            assert_eq!(from_three, &[3.25; 3]);
            assert_eq!(from_zero, &[-7.0; 2]);
        }
        assert_eq!(f32::from_bits(results[0].0[5][2]), 5.0 * 4.0 + 6.0);
    }

    #[test]
    fn mpi_launchers_are_seen_in_the_environment() {
        let size = |pairs: &[(&str, &str)]| {
            let pairs: Vec<(String, String)> = pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            mpi_launch_size(move |name| {
                pairs
                    .iter()
                    .find(|(k, _)| k == name)
                    .map(|(_, v)| v.clone())
            })
        };
        assert_eq!(size(&[]), None);
        assert_eq!(size(&[("OMPI_COMM_WORLD_SIZE", "2")]), Some(2));
        assert_eq!(size(&[("PMI_SIZE", " 4 ")]), Some(4));
        assert_eq!(size(&[("MV2_COMM_WORLD_SIZE", "8")]), Some(8));
        // A batch script's allocation is not a launch; srun's step is.
        assert_eq!(size(&[("SLURM_STEP_NUM_TASKS", "3")]), None);
        assert_eq!(
            size(&[("SLURM_STEP_NUM_TASKS", "3"), ("SLURM_PROCID", "1")]),
            Some(3)
        );
        // torchrun's variables are not MPI.
        assert_eq!(size(&[("WORLD_SIZE", "2"), ("RANK", "0")]), None);
    }

    #[test]
    fn one_process_matches_a_thread_collective() {
        let values = |rank: usize| vec![0.1f32 * (rank as f32 + 1.0), 3e7 + rank as f32];
        let host = on_ranks(HostCollective::single_process(3).unwrap(), |c| {
            let mut data = values(c.rank());
            c.all_reduce_sum(&mut data).unwrap();
            data
        });
        let threads = std::thread::scope(|scope| {
            let handles: Vec<_> = ThreadCollective::group(3)
                .unwrap()
                .into_iter()
                .map(|mut c| {
                    scope.spawn(move || {
                        let mut data = values(c.rank());
                        c.all_reduce_sum(&mut data).unwrap();
                        data
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        });
        assert_eq!(host, threads);
        assert_eq!(HostCollective::single_process(1).unwrap()[0].processes(), 1);
        assert!(HostCollective::single_process(0).is_err());
    }

    #[test]
    fn a_failed_rank_releases_its_process_and_bad_layouts_are_errors() {
        let results = on_ranks(job(2, 2), |c| {
            if c.rank() == 2 {
                c.abort("out of memory");
                return Err(TrainError::Config("rank 2 gave up".into()));
            }
            let mut data = [1.0f32];
            c.all_reduce_sum(&mut data)
        });
        // Rank 3 shares rank 2's process: released by the abort. Ranks 0 and 1 wait for
        // process 1; the job-wide abort releases them.
        assert!(
            matches!(&results[3], Err(TrainError::PeerFailed { rank: 2, .. })),
            "{:?}",
            results[3]
        );
        assert!(results[0].is_err() && results[1].is_err(), "{results:?}");

        let bad = RankLayout {
            first_rank: 1,
            local_ranks: 1,
            world_ranks: 2,
        };
        assert!(HostCollective::group(Box::new(SingleProcess::new()), bad).is_err());
        assert!(rank_layout(&mut SingleProcess::new(), 0).is_err());
    }
}
