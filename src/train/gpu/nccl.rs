//! Data parallelism over NCCL: one communicator per GPU (one rank each), gradients averaged
//! with an in-place all-reduce, parameters broadcast from one rank.
//!
//! # Bootstrapping
//!
//! NCCL's ranks find each other through a 128-byte unique id that one rank creates
//! ([`NcclUniqueId::new`]) and every rank passes to [`NcclComm::init_rank`]. Inside one
//! process (one thread per GPU) the id is simply shared in memory; across processes and
//! hosts it travels over the TCP rendezvous ([`super::rendezvous`]):
//! [`NcclComm::init_with_rendezvous`] does that for one GPU per process, and
//! [`Rendezvous::gpu_layout`] gives the ranks when a process drives several GPUs.
//!
//! `init_rank` blocks until all ranks have called it, so each rank calls it from its own
//! thread (or process). Every collective is queued on the communicator's stream, which must be
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
use super::ffi::DeviceDataMut;
use super::rendezvous::Rendezvous;
use crate::backend::cudnn::{driver_error, require_driver};
use crate::solver::DType;
use cudarc::driver::{CudaContext, CudaStream};
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

    /// The id of a multi-process job: rendezvous rank 0 creates it and sends it to every
    /// process (an empty message if it could not, so that the others fail at once instead of
    /// timing out); every process returns the same id.
    pub fn share(rendezvous: &mut Rendezvous) -> Result<Self, GpuTrainError> {
        if rendezvous.rank() == 0 {
            match NcclUniqueId::new() {
                Ok(id) => {
                    rendezvous.broadcast_bytes(Some(id.as_bytes()))?;
                    Ok(id)
                }
                Err(e) => {
                    let _ = rendezvous.broadcast_bytes(Some(&[]));
                    Err(e)
                }
            }
        } else {
            let bytes = rendezvous.broadcast_bytes(None)?;
            if bytes.is_empty() {
                return Err(invalid(
                    "NcclUniqueId::share",
                    "rank 0 could not create NCCL's unique id (see its error)",
                ));
            }
            NcclUniqueId::from_bytes(&bytes)
        }
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
        let stream = CudaContext::new(device)
            .and_then(|ctx| ctx.new_stream())
            .map_err(|e| driver_error("cuDevicePrimaryCtxRetain/cuStreamCreate", e))?;
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
        let version = nccl_version()?;
        let scaler = if version.has_average() {
            None
        } else {
            Some(BlasHandle::new(stream.clone())?)
        };
        let comm = Communicator::init_rank(world_size, rank, unique_id.as_bytes(), stream)?;
        Ok(NcclComm {
            comm,
            scaler,
            version,
        })
    }

    /// One GPU per process: the process's rendezvous rank is its NCCL rank. Rank 0 creates the
    /// unique id and sends it over the rendezvous (an empty message if it could not, so that
    /// the other ranks fail at once instead of timing out); everyone then joins.
    pub fn init_with_rendezvous(
        rendezvous: &mut Rendezvous,
        stream: Arc<CudaStream>,
    ) -> Result<Self, GpuTrainError> {
        let id = NcclUniqueId::share(rendezvous)?;
        Self::init_rank_on_stream(rendezvous.world_size(), rendezvous.rank(), &id, stream)
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
