//! The training loop's [`Collective`] for GPU ranks, on the host: the ranks of this process
//! are threads joined by a [`ThreadCollective`], and the processes of a multi-process job are
//! joined by the TCP [`Rendezvous`] that already exchanged NCCL's unique id.
//!
//! Why not NCCL: what goes through this collective is small and host-side (per-step sample
//! counts, per-epoch loss and accuracy sums, barriers around tuning, the `--check-sync`
//! parameter broadcast), it needs f64 and exact, reproducible sums, and the rendezvous is
//! pure Rust, so the whole path is tested in CI without a GPU. The gradients, the only large
//! traffic, go through NCCL on the replica's stream ([`super::NcclComm`]).
//!
//! # How an operation runs
//!
//! Ranks `first_rank..first_rank + local_ranks` live in this process. A sum is taken over the
//! local ranks first (in local rank order, in f64), then local rank 0 of every process
//! exchanges the partial sums over the rendezvous (an all-gather) and adds them in process
//! order, and hands the result to its local ranks. Every rank of the job therefore gets the
//! same bits, whatever the thread timing; f32 data is summed in f64 and rounded once, as
//! [`ThreadCollective`] does. A broadcast goes from the root to its process's local rank 0,
//! over the rendezvous to every process, then to each process's ranks.
//!
//! With one process nothing touches the network, and the result equals a
//! [`ThreadCollective`]'s. A failing rank aborts its process's thread group; the other
//! processes see its connection close when the process exits (or the rendezvous timeout).

#![forbid(unsafe_code)]

use super::rendezvous::{GpuLayout, Rendezvous};
use crate::train::{Collective, ThreadCollective, TrainError};
use std::sync::{Arc, Mutex};

/// One rank's handle on the host collective of a (possibly multi-process) GPU job. Make a
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
    /// The rendezvous with the other processes: held by local rank 0's handles when there is
    /// more than one process (used by one thread only, so the lock never waits).
    network: Option<Arc<Mutex<Rendezvous>>>,
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
        .map(|chunk| f64::from_le_bytes(chunk.try_into().expect("8 bytes")))
        .collect()
}

impl HostCollective {
    /// This process's handles, in local rank order, for the ranks `layout` gives it
    /// (global ranks `layout.first_rank + i`, world `layout.world_gpus`); `rendezvous` joins
    /// the processes (a world of one process opens no socket).
    pub fn group(
        rendezvous: Rendezvous,
        layout: GpuLayout,
    ) -> Result<Vec<HostCollective>, TrainError> {
        let processes = rendezvous.world_size();
        let GpuLayout {
            first_rank,
            local_gpus,
            world_gpus,
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
        let network = (processes > 1).then(|| Arc::new(Mutex::new(rendezvous)));
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
            })
            .collect())
    }

    /// A group of `ranks` threads of this process and no other process.
    pub fn single_process(ranks: usize) -> Result<Vec<HostCollective>, TrainError> {
        let rendezvous = Rendezvous::establish(&super::RendezvousConfig::single_process())
            .map_err(|e| TrainError::Dist(e.to_string()))?;
        Self::group(
            rendezvous,
            GpuLayout {
                first_rank: 0,
                local_gpus: ranks,
                world_gpus: ranks,
            },
        )
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

    /// How many processes the job has.
    pub fn processes(&self) -> usize {
        self.processes
    }

    /// Every process's bytes, in process order (local rank 0 only, several processes).
    fn gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, TrainError> {
        let network = self.network.as_ref().ok_or_else(|| {
            TrainError::Collective("only local rank 0 talks to the other processes".into())
        })?;
        let mut rendezvous = network.lock().map_err(|_| {
            TrainError::Collective("a rank panicked while using the rendezvous".into())
        })?;
        rendezvous
            .all_gather_bytes(mine)
            .map_err(|e| TrainError::Collective(format!("between processes: {e}")))
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
                *out = f32::from_le_bytes(chunk.try_into().expect("4 bytes"));
            }
        }
        self.local.broadcast(data, 0).map_err(|e| self.global(e))
    }

    fn abort(&mut self, reason: &str) {
        // The other processes notice when this one exits and its connections close.
        self.local.abort(reason);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::gpu::{RendezvousConfig, RendezvousListener};
    use std::time::Duration;

    /// Every rank's handle of a job of `processes` processes (threads here) with `local`
    /// ranks each, joined over a rendezvous on localhost; global rank order.
    fn job(processes: usize, local: usize) -> Vec<HostCollective> {
        if processes == 1 {
            return HostCollective::single_process(local).unwrap();
        }
        let timeout = Duration::from_secs(20);
        let master = RendezvousConfig::new(0, processes, "127.0.0.1", 0)
            .unwrap()
            .with_timeout(timeout);
        let listener = RendezvousListener::bind(&master).unwrap();
        let port = listener.local_addr().port();
        let members: Vec<_> = (1..processes)
            .map(|rank| {
                std::thread::spawn(move || {
                    let config = RendezvousConfig::new(rank, processes, "127.0.0.1", port)
                        .unwrap()
                        .with_timeout(timeout);
                    Rendezvous::connect(&config).unwrap()
                })
            })
            .collect();
        let mut rendezvous = vec![listener.accept().unwrap()];
        rendezvous.extend(members.into_iter().map(|m| m.join().unwrap()));
        // The layouts are an all-gather: every process at once.
        let layouts: Vec<_> = rendezvous
            .into_iter()
            .map(|mut rv| {
                std::thread::spawn(move || {
                    let layout = rv.gpu_layout(local).unwrap();
                    (rv, layout)
                })
            })
            .collect();
        layouts
            .into_iter()
            .flat_map(|t| {
                let (rv, layout) = t.join().unwrap();
                HostCollective::group(rv, layout).unwrap()
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
        // process 1 over the rendezvous; its local rank 0 failed too, so they get an error
        // when its connection closes (the test threads end) instead of hanging.
        assert!(
            matches!(&results[3], Err(TrainError::PeerFailed { rank: 2, .. })),
            "{:?}",
            results[3]
        );
        assert!(results[0].is_err() && results[1].is_err(), "{results:?}");

        let rendezvous = Rendezvous::establish(&RendezvousConfig::single_process()).unwrap();
        let bad = GpuLayout {
            first_rank: 1,
            local_gpus: 1,
            world_gpus: 2,
        };
        assert!(HostCollective::group(rendezvous, bad).is_err());
    }
}
