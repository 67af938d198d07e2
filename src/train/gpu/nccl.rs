//! Data parallelism over NCCL: one communicator per GPU (one rank each), gradients averaged
//! with an in-place all-reduce, parameters broadcast from one rank.
//!
//! # Bootstrapping
//!
//! One process with several GPUs makes every communicator at once with
//! [`NcclComm::init_all`] (`ncclCommInitAll`: no unique id, no network) and hands one to each
//! GPU's thread. Across processes (MPI), NCCL's ranks find each other through a 128-byte
//! unique id that process 0 creates ([`NcclUniqueId::new`]) and MPI broadcasts
//! ([`NcclUniqueId::share`]); every rank passes it to [`NcclComm::init_rank`], which blocks
//! until all ranks have called it, so each rank calls it from its own thread (or process),
//! and only after every rank said it is ready ([`crate::train::agree_ok`]). Every collective is queued on the communicator's stream, which must be
//! the stream the gradients were computed on (the replica's [`super::GpuOps`] stream): no
//! event or host synchronisation is needed between backward, all-reduce and the SGD step.
//!
//! # Averaging
//!
//! [`NcclComm::all_reduce_mean_f32`] uses `ncclAvg` where the library has it (NCCL 2.10+);
//! with an older NCCL it sums and then scales by `1 / world_size` with cuBLAS on the same
//! stream. A world size of 1 still calls NCCL (so a one-GPU run exercises the same path).

#![forbid(unsafe_code)]

use super::error::{invalid, GpuTrainError};
use super::ffi::blas::BlasHandle;
use super::ffi::nccl::{self as raw, Communicator, Reduce, UNIQUE_ID_BYTES};
use super::ffi::{single_stream, DeviceDataMut};
use crate::backend::cudnn::require_driver;
use crate::solver::DType;
use crate::train::{ProcessGroup, TrainError};
use cudarc::driver::CudaStream;
use std::sync::Arc;

/// NCCL's unique id: the 128 bytes every rank of one communicator must share.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclUniqueId([u8; UNIQUE_ID_BYTES]);

impl std::fmt::Debug for NcclUniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The id embeds the bootstrap address; a short fingerprint is enough to compare ids.
        let fingerprint = self.0.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
            (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
        });
        write!(f, "NcclUniqueId({fingerprint:016x})")
    }
}

impl NcclUniqueId {
    /// The size of the id in bytes.
    pub const BYTES: usize = UNIQUE_ID_BYTES;

    /// A fresh id (`ncclGetUniqueId`); it also starts NCCL's bootstrap listener in this
    /// process, so the rank that makes it must stay alive until every rank has joined.
    pub fn new() -> Result<Self, GpuTrainError> {
        raw::unique_id().map(NcclUniqueId)
    }

    /// An id received from another rank; exactly [`Self::BYTES`] bytes.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, GpuTrainError> {
        <[u8; UNIQUE_ID_BYTES]>::try_from(bytes)
            .map(NcclUniqueId)
            .map_err(|_| {
                invalid(
                    "NcclUniqueId::from_bytes",
                    format!(
                        "{} bytes, but an NCCL unique id has {UNIQUE_ID_BYTES}",
                        bytes.len()
                    ),
                )
            })
    }

    pub fn as_bytes(&self) -> &[u8; UNIQUE_ID_BYTES] {
        &self.0
    }

    /// The id of a multi-process job: process 0 creates it and broadcasts it (an empty
    /// message if it could not, so that the others fail at once instead of waiting in
    /// `ncclCommInitRank`); every process returns the same id.
    pub fn share(processes: &mut dyn ProcessGroup) -> Result<Self, TrainError> {
        let made = if processes.rank() == 0 {
            Some(NcclUniqueId::new())
        } else {
            None
        };
        let mine: &[u8] = match &made {
            Some(Ok(id)) => id.as_bytes(),
            _ => &[],
        };
        let bytes = processes.broadcast_bytes(mine, 0)?;
        if let Some(made) = made {
            return Ok(made?);
        }
        if bytes.is_empty() {
            return Err(invalid(
                "NcclUniqueId::share",
                "process 0 could not create NCCL's unique id (see its error)",
            )
            .into());
        }
        Ok(NcclUniqueId::from_bytes(&bytes)?)
    }
}

/// An NCCL version, decoded from `ncclGetVersion`'s code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct NcclVersion {
    pub major: u32,
    pub minor: u32,
    pub patch: u32,
}

impl NcclVersion {
    /// Decodes `NCCL_VERSION_CODE`: `1000 * major + 100 * minor + patch` before 2.9,
    /// `10000 * major + 100 * minor + patch` since.
    pub fn from_code(code: i32) -> Self {
        let code = code.max(0) as u32;
        if code >= 10_000 {
            NcclVersion {
                major: code / 10_000,
                minor: code / 100 % 100,
                patch: code % 100,
            }
        } else {
            NcclVersion {
                major: code / 1000,
                minor: code / 100 % 10,
                patch: code % 100,
            }
        }
    }

    /// Whether `ncclAvg` exists (NCCL 2.10+).
    pub fn has_average(&self) -> bool {
        (self.major, self.minor) >= (2, 10)
    }
}

impl std::fmt::Display for NcclVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// The NCCL this process loads (its gate: driver, libnccl 2.x, symbols).
pub fn nccl_version() -> Result<NcclVersion, GpuTrainError> {
    raw::nccl().map(NcclVersion::from_code)
}

/// The file name libnccl was loaded from (`libnccl.so`, or `libnccl.so.2` as pip wheels and
/// Debian's `libnccl2` ship it), once the gate passed.
pub fn nccl_library() -> Result<&'static str, GpuTrainError> {
    raw::library_name()
}

/// One rank's NCCL communicator, bound to one stream of one GPU. Not `Send`: create it on the
/// thread that drives its GPU. Dropping it waits for its queued collectives and destroys it
/// (`ncclCommDestroy`); [`Self::abort`] tears it down without waiting for the others.
pub struct NcclComm {
    comm: Communicator,
    /// With an NCCL older than 2.10: the cuBLAS handle that scales a sum into a mean.
    scaler: Option<BlasHandle>,
    version: NcclVersion,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.comm.rank())
            .field("world_size", &self.comm.world_size())
            .field("device", &self.comm.stream().context().ordinal())
            .field("nccl", &self.version.to_string())
            .finish()
    }
}

impl NcclComm {
    /// Rank `rank` of `world_size` on GPU `device`, with a new stream there. Build the
    /// replica's ops on [`Self::stream`] (`GpuOps::with_stream`) so that gradients and
    /// collectives share it. Blocks until every rank has joined.
    pub fn init_rank(
        world_size: usize,
        rank: usize,
        unique_id: &NcclUniqueId,
        device: usize,
    ) -> Result<Self, GpuTrainError> {
        const CALL: &str = "NcclComm::init_rank";
        raw::check_rank(CALL, world_size, rank)?;
        require_driver()?;
        let stream = single_stream(device)?;
        Self::init_rank_on_stream(world_size, rank, unique_id, stream)
    }

    /// Rank `rank` of `world_size` whose collectives go to `stream` (the replica's existing
    /// stream, e.g. `GpuOps::stream`). Blocks until every rank has joined.
    pub fn init_rank_on_stream(
        world_size: usize,
        rank: usize,
        unique_id: &NcclUniqueId,
        stream: Arc<CudaStream>,
    ) -> Result<Self, GpuTrainError> {
        nccl_version()?;
        let comm = Communicator::init_rank(world_size, rank, unique_id.as_bytes(), stream)?;
        Self::from_communicator(comm)
    }

    /// Every GPU of this process in one world (`ncclCommInitAll`: no unique id, no network):
    /// rank `i` on `devices[i]`, each on a new stream of its own (see
    /// [`super::ffi::single_stream`]). Hand each [`PendingComm`] to its GPU's thread and finish
    /// it there ([`PendingComm::into_comm`]).
    pub fn init_all(devices: &[usize]) -> Result<Vec<PendingComm>, GpuTrainError> {
        require_driver()?;
        nccl_version()?;
        let streams = devices
            .iter()
            .map(|&device| single_stream(device))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Communicator::init_all(streams)?
            .into_iter()
            .map(PendingComm)
            .collect())
    }

    fn from_communicator(comm: Communicator) -> Result<Self, GpuTrainError> {
        let version = nccl_version()?;
        let scaler = if version.has_average() {
            None
        } else {
            Some(BlasHandle::new(comm.stream().clone())?)
        };
        Ok(NcclComm {
            comm,
            scaler,
            version,
        })
    }

    /// Queues the all-reduces (sums) of every buffer as one NCCL group: one fused launch per
    /// step instead of one per tensor. Every rank must pass the same lengths in the same order.
    pub fn all_reduce_sum_f32_grouped<B: DeviceDataMut>(
        &self,
        bufs: &mut [B],
    ) -> Result<(), GpuTrainError> {
        const CALL: &str = "NcclComm::all_reduce_sum_f32_grouped";
        for buf in bufs.iter() {
            check_f32(CALL, buf.dtype())?;
        }
        raw::grouped(|| {
            for buf in bufs.iter_mut() {
                self.comm.all_reduce(CALL, buf, Reduce::Sum)?;
            }
            Ok(())
        })
    }

    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    pub fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    /// The stream every collective is queued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        self.comm.stream()
    }

    /// The NCCL version in use.
    pub fn version(&self) -> NcclVersion {
        self.version
    }

    /// Whether the mean is NCCL's own `ncclAvg` (else a sum scaled by cuBLAS).
    pub fn averages_in_nccl(&self) -> bool {
        self.scaler.is_none()
    }

    /// Replaces `buf` (fp32, on [`Self::stream`]) by its element-wise mean over all ranks, in
    /// place, queued on the stream. Every rank must call it with the same length.
    pub fn all_reduce_mean_f32(&self, buf: &mut impl DeviceDataMut) -> Result<(), GpuTrainError> {
        const CALL: &str = "NcclComm::all_reduce_mean_f32";
        check_f32(CALL, buf.dtype())?;
        match &self.scaler {
            None => self.comm.all_reduce(CALL, &mut *buf, Reduce::Average),
            Some(blas) => {
                self.comm.all_reduce(CALL, &mut *buf, Reduce::Sum)?;
                blas.scal(CALL, 1.0 / self.world_size() as f32, &mut *buf)
            }
        }
    }

    /// Replaces `buf` (fp32, on [`Self::stream`]) by its element-wise sum over all ranks, in
    /// place, queued on the stream (`ncclSum`; every rank receives the same bits). Every rank
    /// must call it with the same length.
    pub fn all_reduce_sum_f32(&self, buf: &mut impl DeviceDataMut) -> Result<(), GpuTrainError> {
        const CALL: &str = "NcclComm::all_reduce_sum_f32";
        check_f32(CALL, buf.dtype())?;
        self.comm.all_reduce(CALL, &mut *buf, Reduce::Sum)
    }

    /// Replaces `buf` (fp32, on [`Self::stream`]) on every rank by rank `root`'s, in place,
    /// queued on the stream (initial parameters: every replica starts from rank 0's).
    pub fn broadcast_f32(
        &self,
        buf: &mut impl DeviceDataMut,
        root: usize,
    ) -> Result<(), GpuTrainError> {
        const CALL: &str = "NcclComm::broadcast_f32";
        check_f32(CALL, buf.dtype())?;
        self.comm.broadcast(CALL, buf, root)
    }

    /// Tears the communicator down at once (`ncclCommAbort`), without waiting for queued work
    /// or the other ranks: for error paths where a peer may be gone.
    pub fn abort(self) {
        self.comm.abort();
    }

    /// What aborts this communicator from another thread: register it with the rank's host
    /// collective ([`crate::train::HostCollective::on_failure`]) so that a failing thread
    /// aborts every communicator of its process and the ranks waiting on the device behind
    /// an NCCL call are released. The communicator's own later calls are then errors.
    pub fn abort_on_failure(&self) -> crate::train::FailureHook {
        let handle = self.comm.abort_handle();
        Box::new(move |_reason: &str| {
            handle.abort();
        })
    }
}

/// A communicator made by [`NcclComm::init_all`] on another thread, on its way to its GPU's
/// thread (where [`PendingComm::into_comm`] finishes it). Dropping it destroys the
/// communicator.
pub struct PendingComm(Communicator);

impl std::fmt::Debug for PendingComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingComm")
            .field("rank", &self.0.rank())
            .field("world_size", &self.0.world_size())
            .finish()
    }
}

impl PendingComm {
    pub fn rank(&self) -> usize {
        self.0.rank()
    }

    /// The communicator, on this thread.
    pub fn into_comm(self) -> Result<NcclComm, GpuTrainError> {
        NcclComm::from_communicator(self.0)
    }
}

fn check_f32(call: &'static str, dtype: DType) -> Result<(), GpuTrainError> {
    if dtype == DType::Fp32 {
        Ok(())
    } else {
        Err(invalid(
            call,
            format!("the buffer is {dtype}; gradients and parameters are reduced in fp32 (master copies)"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_id_bytes_are_checked() {
        let bytes: Vec<u8> = (0..128).map(|i| i as u8).collect();
        let id = NcclUniqueId::from_bytes(&bytes).unwrap();
        assert_eq!(id.as_bytes().as_slice(), bytes.as_slice());
        assert_eq!(NcclUniqueId::from_bytes(&bytes).unwrap(), id);
        let e = NcclUniqueId::from_bytes(&bytes[..127]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid argument to NcclUniqueId::from_bytes: 127 bytes, but an NCCL unique id has 128"
        );
        assert!(NcclUniqueId::from_bytes(&[0; 129]).is_err());
        let debug = format!("{id:?}");
        assert!(
            debug.starts_with("NcclUniqueId(") && debug.len() < 40,
            "{debug}"
        );
    }

    #[test]
    fn version_codes_decode_both_schemes() {
        let v = NcclVersion::from_code(22703);
        assert_eq!((v.major, v.minor, v.patch), (2, 27, 3));
        assert_eq!(v.to_string(), "2.27.3");
        assert!(v.has_average());
        let old = NcclVersion::from_code(2804);
        assert_eq!((old.major, old.minor, old.patch), (2, 8, 4));
        assert!(!old.has_average());
        assert!(NcclVersion::from_code(21003).has_average());
        assert!(!NcclVersion::from_code(20906).has_average());
    }

    #[test]
    fn bad_ranks_are_errors_before_any_library_is_needed() {
        let id = NcclUniqueId::from_bytes(&[7; 128]).unwrap();
        let e = NcclComm::init_rank(2, 2, &id, 0).unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid argument to NcclComm::init_rank: rank 2 is not below the world size 2"
        );
        assert!(NcclComm::init_rank(0, 0, &id, 0).is_err());
        assert!(check_f32("t", DType::Fp16).is_err());
        assert!(check_f32("t", DType::Fp32).is_ok());
    }

    #[test]
    fn without_a_gpu_the_constructors_are_errors_not_panics() {
        let id = NcclUniqueId::from_bytes(&[7; 128]).unwrap();
        match NcclUniqueId::new() {
            Ok(fresh) => println!("NCCL present: {fresh:?}"),
            Err(e) => {
                println!("NcclUniqueId::new (expected without a GPU): {e}");
                assert!(e.is_unavailable(), "{e:?}");
                // Without the library nothing else can work either: every path is an error.
                assert!(nccl_version().is_err());
                let e = NcclComm::init_rank(1, 0, &id, 0).unwrap_err();
                assert!(e.is_unavailable(), "{e:?}");
                let e = NcclComm::init_rank(1, 0, &id, 9).unwrap_err();
                assert!(e.is_unavailable(), "{e:?}");
            }
        }
    }
}
