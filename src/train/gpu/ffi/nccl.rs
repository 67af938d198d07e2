//! NCCL: the unique id, one rank's communicator bound to a stream, in-place all-reduce and
//! broadcast.
//!
//! The gate checks that libnccl loads, that it is NCCL 2.x, and that every symbol this module
//! calls is exported (`ncclGetLastError`, NCCL 2.13+, is used only where present). A
//! communicator exists only if `ncclCommInitRank` succeeded, and is destroyed exactly once.

use super::{c_string, check_stream, DeviceDataMut};
#[cfg(not(feature = "cudarc-linked"))]
use crate::backend::cudnn::candidates;
use crate::backend::cudnn::{driver_error, require_driver};
use crate::solver::DType;
use crate::train::gpu::error::{invalid, GpuTrainError};
use cudarc::driver::CudaStream;
use cudarc::nccl::sys as nccl_sys;
use std::ffi::{c_char, c_int, c_void};
use std::io::Write;
use std::sync::{Arc, OnceLock};

/// Every NCCL symbol this module calls unconditionally.
const NCCL_SYMBOLS: &[&str] = &[
    "ncclGetVersion",
    "ncclGetErrorString",
    "ncclGetUniqueId",
    "ncclCommInitRank",
    "ncclCommDestroy",
    "ncclCommAbort",
    "ncclAllReduce",
    "ncclBroadcast",
];

/// The bytes of an `ncclUniqueId`.
pub(crate) const UNIQUE_ID_BYTES: usize = 128;

#[derive(Clone, Debug)]
struct Library {
    /// `ncclGetVersion`, e.g. 22703 for 2.27.3.
    version: i32,
    /// `ncclGetLastError` is exported (NCCL 2.13+).
    has_last_error: bool,
}

fn library() -> Result<&'static Library, GpuTrainError> {
    static LIBRARY: OnceLock<Result<Library, GpuTrainError>> = OnceLock::new();
    LIBRARY
        .get_or_init(init_library)
        .as_ref()
        .map_err(Clone::clone)
}

/// Gate for everything that touches NCCL: the driver gate, libnccl present, NCCL 2.x, every
/// symbol exported. Returns `ncclGetVersion()`. Cached.
pub(crate) fn nccl() -> Result<i32, GpuTrainError> {
    library().map(|lib| lib.version)
}

fn init_library() -> Result<Library, GpuTrainError> {
    require_driver()?;
    // SAFETY: `is_culib_present` dlopen()s libnccl under each candidate name and closes it.
    #[cfg(not(feature = "cudarc-linked"))]
    if !unsafe { nccl_sys::is_culib_present() } {
        return Err(GpuTrainError::Unavailable {
            what: "libnccl",
            detail: format!(
                "libnccl.so not found: install NCCL 2 (the libnccl2 and libnccl-dev packages, \
                 or PyTorch's nvidia-nccl wheel) or put its lib folder on LD_LIBRARY_PATH; note \
                 that the plain name libnccl.so is needed, libnccl.so.2 alone is not searched. \
                 Searched: {}",
                candidates("nccl")
            ),
        });
    }
    // SAFETY: present (checked above), so `culib` loads it rather than panicking.
    #[cfg(not(feature = "cudarc-linked"))]
    let lib = unsafe { nccl_sys::culib() };
    // SAFETY (both lookups): looking a symbol up does not call it.
    // Linked mode: linked at build time, every symbol is there.
    #[cfg(feature = "cudarc-linked")]
    let exported = |_name: &str| true;
    #[cfg(not(feature = "cudarc-linked"))]
    let exported =
        |name: &str| unsafe { lib.get::<unsafe extern "C" fn()>(name.as_bytes()) }.is_ok();
    let missing: Vec<&str> = NCCL_SYMBOLS
        .iter()
        .copied()
        .filter(|name| !exported(name))
        .collect();
    if !missing.is_empty() {
        return Err(GpuTrainError::Unavailable {
            what: "libnccl",
            detail: format!(
                "the libnccl found does not export {} (a partial or mismatched install?)",
                missing.join(", ")
            ),
        });
    }
    let mut version: c_int = 0;
    // SAFETY: the symbol exists (checked); the call writes one int to a live local.
    let status = unsafe { nccl_sys::ncclGetVersion(&mut version) };
    if status != nccl_sys::ncclResult_t::ncclSuccess {
        return Err(GpuTrainError::Unavailable {
            what: "libnccl",
            detail: format!("ncclGetVersion failed with {status:?} ({})", status as u32),
        });
    }
    // Codes are 1000 * major + ... before 2.9 and 10000 * major + ... since.
    let major = if version >= 10_000 {
        version / 10_000
    } else {
        version / 1000
    };
    if major != 2 {
        return Err(GpuTrainError::Unavailable {
            what: "libnccl",
            detail: format!(
                "found NCCL version code {version} (major {major}); this build needs NCCL 2.x"
            ),
        });
    }
    Ok(Library {
        version,
        has_last_error: exported("ncclGetLastError"),
    })
}

/// An error for `call`'s `status`, with NCCL's description, its last error message where
/// NCCL has one, and `context`.
fn nccl_error(
    call: &'static str,
    status: nccl_sys::ncclResult_t,
    comm: nccl_sys::ncclComm_t,
    context: &str,
) -> GpuTrainError {
    let mut detail = String::new();
    // SAFETY: statuses only come from gated calls; ncclGetErrorString returns a static string
    // for any value.
    if let Some(text) = unsafe { c_string(nccl_sys::ncclGetErrorString(status)) } {
        detail.push_str(&text);
    }
    if library().is_ok_and(|lib| lib.has_last_error) {
        // SAFETY: the symbol exists (checked by the gate); `comm` is a live communicator or
        // null, which ncclGetLastError accepts; the string is copied at once.
        if let Some(last) = unsafe { c_string(nccl_sys::ncclGetLastError(comm)) } {
            if !last.is_empty() {
                detail.push_str(": ");
                detail.push_str(&last);
            }
        }
    }
    detail.push_str(&format!(" ({context})"));
    GpuTrainError::Nccl {
        call,
        status: format!("{status:?}"),
        code: status as u32,
        detail,
    }
}

/// A fresh NCCL unique id (`ncclGetUniqueId`): made once, by the rank that bootstraps the
/// communicator, and shared with every rank.
pub(crate) fn unique_id() -> Result<[u8; UNIQUE_ID_BYTES], GpuTrainError> {
    library()?;
    let mut id = nccl_sys::ncclUniqueId {
        internal: [0; UNIQUE_ID_BYTES],
    };
    // SAFETY: the gate passed; the call fills the 128-byte struct, a live local.
    let status = unsafe { nccl_sys::ncclGetUniqueId(&mut id) };
    if status != nccl_sys::ncclResult_t::ncclSuccess {
        return Err(nccl_error(
            "ncclGetUniqueId",
            status,
            std::ptr::null_mut(),
            "creating the unique id",
        ));
    }
    Ok(id.internal.map(|c| c as u8))
}

/// The reductions the communicator offers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reduce {
    Sum,
    /// `ncclAvg` (NCCL 2.10+).
    Average,
}

fn nccl_type(dtype: DType) -> nccl_sys::ncclDataType_t {
    match dtype {
        DType::Fp32 => nccl_sys::ncclDataType_t::ncclFloat32,
        DType::Fp16 => nccl_sys::ncclDataType_t::ncclFloat16,
        DType::Bf16 => nccl_sys::ncclDataType_t::ncclBfloat16,
    }
}

/// One rank's NCCL communicator; its collectives are queued on `stream`.
pub(crate) struct Communicator {
    raw: nccl_sys::ncclComm_t,
    stream: Arc<CudaStream>,
    rank: usize,
    world_size: usize,
    /// Release with `ncclCommAbort` instead of waiting for the stream and destroying.
    abort_on_drop: bool,
}

impl Communicator {
    /// `ncclCommInitRank` on the stream's device. Blocks until every rank of the world has
    /// called it with the same id (NCCL's rule: call it from one thread or process per rank).
    pub(crate) fn init_rank(
        world_size: usize,
        rank: usize,
        id: &[u8; UNIQUE_ID_BYTES],
        stream: Arc<CudaStream>,
    ) -> Result<Self, GpuTrainError> {
        const CALL: &str = "NcclComm::init_rank";
        let (nranks, rank_int) = check_rank(CALL, world_size, rank)?;
        library()?;
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| driver_error("cuCtxSetCurrent", e))?;
        let unique_id = nccl_sys::ncclUniqueId {
            internal: id.map(|b| b as c_char),
        };
        let mut raw: nccl_sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: the gate passed; the stream's context is current (NCCL binds the communicator
        // to the current device); the call writes one pointer to a live local and takes the id
        // by value.
        let status = unsafe { nccl_sys::ncclCommInitRank(&mut raw, nranks, unique_id, rank_int) };
        if status != nccl_sys::ncclResult_t::ncclSuccess {
            return Err(nccl_error(
                "ncclCommInitRank",
                status,
                std::ptr::null_mut(),
                &format!(
                    "rank {rank} of {world_size} on device {}",
                    stream.context().ordinal()
                ),
            ));
        }
        Ok(Communicator {
            raw,
            stream,
            rank,
            world_size,
            abort_on_drop: false,
        })
    }

    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    pub(crate) fn world_size(&self) -> usize {
        self.world_size
    }

    fn context(&self) -> String {
        format!(
            "rank {} of {} on device {}",
            self.rank,
            self.world_size,
            self.stream.context().ordinal()
        )
    }

    /// Checks `buf` and returns its element count and NCCL type.
    fn prepare<D: DeviceDataMut + ?Sized>(
        &self,
        op: &'static str,
        buf: &D,
    ) -> Result<(usize, nccl_sys::ncclDataType_t), GpuTrainError> {
        if buf.elements() == 0 {
            return Err(invalid(op, "an empty buffer"));
        }
        check_stream(op, "the buffer", buf, &self.stream)?;
        self.stream
            .context()
            .bind_to_thread()
            .map_err(|e| driver_error("cuCtxSetCurrent (or an earlier deferred CUDA error)", e))?;
        Ok((buf.elements(), nccl_type(buf.dtype())))
    }

    /// In-place all-reduce of `buf` over every rank, queued on the stream.
    pub(crate) fn all_reduce(
        &self,
        op: &'static str,
        buf: &mut dyn DeviceDataMut,
        reduce: Reduce,
    ) -> Result<(), GpuTrainError> {
        let (count, datatype) = self.prepare(op, buf)?;
        let (ptr, _sync) = buf.raw_write(&self.stream);
        let reduce_op = match reduce {
            Reduce::Sum => nccl_sys::ncclRedOp_t::ncclSum,
            Reduce::Average => nccl_sys::ncclRedOp_t::ncclAvg,
        };
        // SAFETY: `raw` is a live communicator (not `Sync`: this thread alone), its device's
        // context current; `ptr` addresses `count` elements of `datatype` in a live allocation
        // on the communicator's stream (checked), borrowed exclusively; in place (send ==
        // receive) is allowed; frees are stream-ordered after the guard records this use.
        let status = unsafe {
            nccl_sys::ncclAllReduce(
                ptr as *const c_void,
                ptr as *mut c_void,
                count,
                datatype,
                reduce_op,
                self.raw,
                self.stream.cu_stream() as _,
            )
        };
        match status {
            nccl_sys::ncclResult_t::ncclSuccess => Ok(()),
            other => Err(nccl_error(
                "ncclAllReduce",
                other,
                self.raw,
                &self.context(),
            )),
        }
    }

    /// In-place broadcast of `buf` from rank `root` to every rank, queued on the stream.
    pub(crate) fn broadcast(
        &self,
        op: &'static str,
        buf: &mut dyn DeviceDataMut,
        root: usize,
    ) -> Result<(), GpuTrainError> {
        if root >= self.world_size {
            return Err(invalid(
                op,
                format!(
                    "root {root} is not a rank of world size {}",
                    self.world_size
                ),
            ));
        }
        let (count, datatype) = self.prepare(op, buf)?;
        let (ptr, _sync) = buf.raw_write(&self.stream);
        // SAFETY: as for `all_reduce`; `root` is a rank of this communicator (checked, and it
        // fits int because the world size does).
        let status = unsafe {
            nccl_sys::ncclBroadcast(
                ptr as *const c_void,
                ptr as *mut c_void,
                count,
                datatype,
                root as c_int,
                self.raw,
                self.stream.cu_stream() as _,
            )
        };
        match status {
            nccl_sys::ncclResult_t::ncclSuccess => Ok(()),
            other => Err(nccl_error(
                "ncclBroadcast",
                other,
                self.raw,
                &self.context(),
            )),
        }
    }

    /// Tears the communicator down without waiting for the other ranks (`ncclCommAbort`):
    /// for error paths, where a peer may be gone and a destroy could wait for it.
    pub(crate) fn abort(mut self) {
        self.abort_on_drop = true;
    }
}

/// Validates `(world_size, rank)` and returns them as NCCL's ints.
pub(crate) fn check_rank(
    call: &'static str,
    world_size: usize,
    rank: usize,
) -> Result<(c_int, c_int), GpuTrainError> {
    if world_size == 0 {
        return Err(invalid(
            call,
            "world size 0: an NCCL world has at least one rank",
        ));
    }
    if rank >= world_size {
        return Err(invalid(
            call,
            format!("rank {rank} is not below the world size {world_size}"),
        ));
    }
    let nranks = c_int::try_from(world_size)
        .map_err(|_| invalid(call, format!("world size {world_size} exceeds NCCL's int")))?;
    Ok((nranks, rank as c_int))
}

impl Drop for Communicator {
    fn drop(&mut self) {
        let _ = self.stream.context().bind_to_thread();
        let (call, status) = if self.abort_on_drop {
            // SAFETY: `raw` was created by ncclCommInitRank in `init_rank` and is released
            // exactly once, here.
            ("ncclCommAbort", unsafe {
                nccl_sys::ncclCommAbort(self.raw)
            })
        } else {
            // Let queued collectives finish before their communicator goes.
            let _ = self.stream.synchronize();
            // SAFETY: as above.
            ("ncclCommDestroy", unsafe {
                nccl_sys::ncclCommDestroy(self.raw)
            })
        };
        if status != nccl_sys::ncclResult_t::ncclSuccess {
            let _ = writeln!(
                std::io::stderr(),
                "mucudnn: warning: {call} failed while dropping: {status:?} ({})",
                status as u32
            );
        }
    }
}
