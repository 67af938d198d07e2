//! Multi-process training under MPI (feature `mpi`, rsmpi): a binary started by `mpirun -np P`
//! or `srun` runs one process per rank (or per host, driving its GPUs), joined by MPI.
//!
//! [`Mpi::init`] initialises MPI (`MPI_Init_thread`, asking for `MPI_THREAD_MULTIPLE`: the
//! ranks of a process are threads, and the one that talks to the other processes is not the
//! main thread; at least `MPI_THREAD_SERIALIZED` is required, which the host collective's
//! lock provides). [`MpiProcesses`] is the [`ProcessGroup`] over `MPI_COMM_WORLD`: byte
//! all-gathers (`MPI_Allgather` of the lengths, then `MPI_Allgatherv`) and broadcasts
//! (`MPI_Bcast`), in process order, so the host collective's sums are the same bits as the
//! threads'; NCCL's unique id is an `MPI_Bcast` from process 0. A failing rank calls
//! [`ProcessGroup::aborter`]: it prints its message and calls `MPI_Abort`, which ends every
//! process of the job with a non-zero status.
//!
//! MPI is finalised when the last handle on the [`Mpi`] runtime goes (the processes' group
//! holds one), after every collective that uses it.

use super::process::{JobAbort, ProcessGroup};
use super::TrainError;
use mpi::datatype::PartitionMut;
use mpi::environment::Universe;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use mpi::Threading;
use std::io::Write;
use std::sync::Arc;

/// The exit status of a job ended by a failing rank.
pub const ABORT_STATUS: i32 = 1;

/// This process's MPI runtime. Dropping the last handle finalises MPI.
#[derive(Clone)]
pub struct Mpi {
    universe: Arc<Universe>,
    threading: Threading,
}

impl std::fmt::Debug for Mpi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mpi")
            .field("rank", &self.rank())
            .field("size", &self.size())
            .field("threading", &self.threading)
            .finish()
    }
}

impl Mpi {
    /// Initialises MPI (once per process).
    pub fn init() -> Result<Mpi, TrainError> {
        let (universe, threading) = mpi::initialize_with_threading(Threading::Multiple)
            .ok_or_else(|| {
                TrainError::Dist("MPI could not be initialised (or was already)".into())
            })?;
        if threading < Threading::Serialized {
            return Err(TrainError::Dist(format!(
                "this MPI provides thread support {threading:?}; training needs at least \
                 Serialized (one thread at a time, not only the main one)"
            )));
        }
        Ok(Mpi {
            universe: Arc::new(universe),
            threading,
        })
    }

    fn world(&self) -> SimpleCommunicator {
        self.universe.world()
    }

    /// This process's rank in `MPI_COMM_WORLD`.
    pub fn rank(&self) -> usize {
        self.world().rank() as usize
    }

    /// How many processes the job has.
    pub fn size(&self) -> usize {
        self.world().size() as usize
    }

    /// This process's rank among the processes of its host, and how many there are
    /// (`MPI_Comm_split_type` with `MPI_COMM_TYPE_SHARED`): which GPU to take.
    pub fn node_local(&self) -> (usize, usize) {
        let node = self.world().split_shared(self.world().rank());
        (node.rank() as usize, node.size() as usize)
    }

    /// This host's name as MPI knows it.
    pub fn host_name(&self) -> String {
        mpi::environment::processor_name().unwrap_or_else(|_| "?".into())
    }

    /// The processes of the job, for the host collective and NCCL's unique id.
    pub fn processes(&self) -> MpiProcesses {
        MpiProcesses { mpi: self.clone() }
    }

    /// Prints `message` as process `rank`'s and ends the whole job (`MPI_Abort`).
    pub fn abort(&self, message: &str) -> ! {
        abort_job(self.rank(), message)
    }
}

fn abort_job(rank: usize, message: &str) -> ! {
    let mut stderr = std::io::stderr().lock();
    let _ = writeln!(stderr, "mucudnn: rank {rank} failed: {message}");
    let _ = stderr.flush();
    SimpleCommunicator::world().abort(ABORT_STATUS)
}

fn count(len: usize) -> Result<mpi::Count, TrainError> {
    mpi::Count::try_from(len)
        .map_err(|_| TrainError::Collective(format!("{len} bytes exceed MPI's count")))
}

/// `MPI_COMM_WORLD` as a [`ProcessGroup`] (see the module docs). It holds the runtime, so MPI
/// stays initialised while any handle lives.
#[derive(Clone, Debug)]
pub struct MpiProcesses {
    mpi: Mpi,
}

impl ProcessGroup for MpiProcesses {
    fn rank(&self) -> usize {
        self.mpi.rank()
    }

    fn size(&self) -> usize {
        self.mpi.size()
    }

    fn all_gather_bytes(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>, TrainError> {
        // Every buffer handed to MPI carries one padding byte, so that none is empty: an empty
        // Vec's dangling address is 0x1, which is Open MPI's MPI_IN_PLACE.
        let world = self.mpi.world();
        let size = self.size();
        let mut padded = Vec::with_capacity(mine.len() + 1);
        padded.extend_from_slice(mine);
        padded.push(0);
        let my_len = padded.len() as u64;
        let mut lengths = vec![0u64; size];
        world.all_gather_into(&my_len, &mut lengths[..]);
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
            world.all_gather_varcount_into(&padded[..], &mut partition);
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

    fn broadcast_bytes(&mut self, mine: &[u8], root: usize) -> Result<Vec<u8>, TrainError> {
        let size = self.size();
        if root >= size {
            return Err(TrainError::Collective(format!(
                "broadcast from process {root} of {size}"
            )));
        }
        let world = self.mpi.world();
        let root_process = world.process_at_rank(count(root)?);
        let is_root = self.rank() == root;
        let mut len = if is_root { mine.len() as u64 } else { 0 };
        root_process.broadcast_into(&mut len);
        let mut bytes = if is_root {
            mine.to_vec()
        } else {
            vec![0u8; len as usize]
        };
        if len > 0 {
            count(len as usize)?;
            root_process.broadcast_into(&mut bytes[..]);
        }
        Ok(bytes)
    }

    fn aborter(&self) -> JobAbort {
        Arc::new(|rank, reason| abort_job(rank, reason))
    }
}
