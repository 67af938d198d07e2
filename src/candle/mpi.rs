//! The job's processes under MPI (feature `mpi`, rsmpi): a program started by `mpirun -np P`
//! or `srun` runs one process per rank (one per GPU with `candle-cuda`), joined by
//! `MPI_COMM_WORLD`.
//!
//! [`Mpi::init`] initialises MPI (`MPI_Init_thread`, asking for `MPI_THREAD_FUNNELED`: one
//! thread talks to MPI). [`Mpi`] is a [`Collective`]: byte all-gathers (`MPI_Allgather` of
//! the lengths, then `MPI_Allgatherv`) in rank order, so [`super::ddp::sum_in_rank_order`]
//! gives every process the same bits. A failing rank calls [`Mpi::abort`]: it prints its
//! message and calls `MPI_Abort`, which ends every process of the job with a non-zero status,
//! so no rank waits forever for a peer that has gone. MPI is finalised when the [`Mpi`] is
//! dropped.

use super::ddp::{Collective, DdpError};
use mpi::datatype::PartitionMut;
use mpi::environment::Universe;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use mpi::Threading;
use std::io::Write;

/// The exit status of a job ended by a failing rank.
pub const ABORT_STATUS: i32 = 1;

/// This process's MPI runtime and `MPI_COMM_WORLD`. Dropping it finalises MPI.
pub struct Mpi {
    universe: Universe,
    world: SimpleCommunicator,
}

impl std::fmt::Debug for Mpi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mpi")
            .field("rank", &self.world.rank())
            .field("size", &self.world.size())
            .finish_non_exhaustive()
    }
}

impl Mpi {
    /// Initialises MPI (once per process; a second call is an error).
    pub fn init() -> Result<Mpi, DdpError> {
        let (universe, _threading) = mpi::initialize_with_threading(Threading::Funneled)
            .ok_or_else(|| {
                DdpError::Collective("MPI could not be initialised (or was already)".into())
            })?;
        let world = universe.world();
        Ok(Mpi { universe, world })
    }

    /// This process's rank among the processes of its host, and how many there are
    /// (`MPI_Comm_split_type` with `MPI_COMM_TYPE_SHARED`): which GPU to take.
    pub fn node_local(&self) -> (usize, usize) {
        let node = self.world.split_shared(self.world.rank());
        (node.rank() as usize, node.size() as usize)
    }

    /// This host's name as MPI knows it (ranks on one host may share a cache file).
    pub fn host_name(&self) -> String {
        mpi::environment::processor_name().unwrap_or_else(|_| "?".into())
    }

    /// Prints `message` as this rank's and ends the whole job (`MPI_Abort`).
    pub fn abort(&self, message: &str) -> ! {
        let mut stderr = std::io::stderr().lock();
        let _ = writeln!(stderr, "rank {} failed: {message}", self.world.rank());
        let _ = stderr.flush();
        let _ = &self.universe;
        self.world.abort(ABORT_STATUS)
    }
}

fn count(len: usize) -> Result<mpi::Count, DdpError> {
    mpi::Count::try_from(len)
        .map_err(|_| DdpError::Collective(format!("{len} bytes exceed MPI's count")))
}

impl Collective for Mpi {
    fn rank(&self) -> usize {
        self.world.rank() as usize
    }

    fn size(&self) -> usize {
        self.world.size() as usize
    }

    fn all_gather_bytes(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>, DdpError> {
        // Every buffer handed to MPI carries one padding byte, so that none is empty: an empty
        // Vec's dangling address is 0x1, which is Open MPI's MPI_IN_PLACE.
        let size = self.size();
        let mut padded = Vec::with_capacity(mine.len() + 1);
        padded.extend_from_slice(mine);
        padded.push(0);
        let my_len = padded.len() as u64;
        let mut lengths = vec![0u64; size];
        self.world.all_gather_into(&my_len, &mut lengths[..]);
        let counts = lengths
            .iter()
            .map(|&len| count(len as usize))
            .collect::<Result<Vec<_>, _>>()?;
        let mut displs = Vec::with_capacity(size);
        let mut total: usize = 0;
        for &len in &lengths {
            displs.push(count(total)?);
            total += len as usize;
        }
        count(total)?;
        let mut buffer = vec![0u8; total];
        {
            let mut partition = PartitionMut::new(&mut buffer[..], &counts[..], &displs[..]);
            self.world
                .all_gather_varcount_into(&padded[..], &mut partition);
        }
        let mut parts = Vec::with_capacity(size);
        let mut offset = 0;
        for &len in &lengths {
            let len = len as usize;
            parts.push(buffer[offset..offset + len.saturating_sub(1)].to_vec());
            offset += len;
        }
        Ok(parts)
    }
}
