//! The gradient all-reduce of a data-parallel candle job over NCCL, on candle's CUDA stream
//! (feature `candle-cuda`; cudarc's `nccl` bindings, the cudarc candle links).
//!
//! [`NcclGradSum::new`] makes one communicator per process: rank 0 asks NCCL for a unique id,
//! which travels to every rank over the job's [`Collective`] (MPI in `examples/candle_ddp.rs`),
//! and every rank joins with `ncclCommInitRankConfig` on its candle device, *non-blocking*
//! (`blocking = 0`). [`NcclGradSum::sum_scaled`] all-reduces a flat f32 gradient vector
//! ([`super::grad_sum::pack`]) in one `ncclAllReduce` (sum, inside `ncclGroupStart`/`End`) on
//! candle's stream, scales it as the host sum does ([`super::grad_sum::scale_as_host`]: f64,
//! rounded once) and waits for the stream. NCCL's all-reduce gives every rank the same bits,
//! and the scaling is elementwise, so the replicas stay bitwise identical; the summation order
//! is NCCL's, so the bits differ from the host sum's (`--grad-sum host`).
//!
//! Nothing waits blindly. A non-blocking communicator returns from every call at once
//! (`ncclInProgress`); the caller polls `ncclCommGetAsyncError`, which also reports a peer's
//! failure (`ncclRemoteError`) or a network error. Every NCCL call here is followed by such a
//! poll ([`super::grad_sum::watch`]) until the communicator is ready and, for the all-reduce,
//! until an event recorded after it on candle's stream has completed; an error, or no progress
//! within the timeout, calls `ncclCommAbort` (which also ends the kernels of the communicator
//! still running on the GPU) and returns the error, so a failing rank never leaves its peers
//! hanging in a collective: the program then ends the job (`MPI_Abort`). The communicator sits
//! in a slot (`Mutex<Option<_>>`) that the abort empties, so nothing uses it afterwards;
//! dropping an [`NcclGradSum`] that was not [`finish`](NcclGradSum::finish)ed aborts it.
//!
//! None of this has run on a GPU yet (the pure parts are tested on the CPU in `grad_sum.rs`;
//! `tests/candle_cuda.rs` has a one-rank check for the GPU machine).

use super::ddp::{gather_results, Collective, DdpError};
use super::grad_sum::{scale_as_host, watch, CommState};
use candle_core::backend::BackendStorage;
use candle_core::{CudaDevice, CudaStorage, CustomOp1, DType, Device, Layout, Shape, Tensor};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nccl::sys;
use std::ffi::{c_int, c_uint, CStr};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// `NCCL_CONFIG_INITIALIZER`'s magic.
const CONFIG_MAGIC: c_uint = 0xcafe_beef;
/// `NCCL_CONFIG_UNDEF_INT`: "NCCL's default" for an int field of the config.
const UNDEF_INT: c_int = c_int::MIN;
/// `NCCL_VERSION(2, 30, 0)`: the header cudarc's bindings (`nccl-02030`, the struct layout
/// below) were made from. A newer libnccl reads the fields this `size` covers.
const HEADER_VERSION: c_uint = 2 * 10000 + 30 * 100;

/// `NCCL_CONFIG_INITIALIZER` with `blocking = 0`: every other field NCCL's default.
fn nonblocking_config() -> sys::ncclConfig_t {
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: CONFIG_MAGIC,
        version: HEADER_VERSION,
        blocking: 0,
        cgaClusterSize: UNDEF_INT,
        minCTAs: UNDEF_INT,
        maxCTAs: UNDEF_INT,
        netName: std::ptr::null(),
        splitShare: UNDEF_INT,
        trafficClass: UNDEF_INT,
        commName: std::ptr::null(),
        collnetEnable: UNDEF_INT,
        CTAPolicy: UNDEF_INT,
        shrinkShare: UNDEF_INT,
        nvlsCTAs: UNDEF_INT,
        nChannelsPerNetPeer: UNDEF_INT,
        nvlinkCentricSched: UNDEF_INT,
        graphUsageMode: UNDEF_INT,
        numRmaCtx: UNDEF_INT,
        maxP2pPeers: UNDEF_INT,
    }
}

/// An NCCL communicator handle (a pointer NCCL owns; used from one thread at a time, under the
/// slot's mutex).
struct RawComm(sys::ncclComm_t);

// SAFETY: the handle is only passed to NCCL, whose communicator calls may come from any thread
// as long as they are not concurrent; the slot's mutex serialises them.
unsafe impl Send for RawComm {}

/// What NCCL says about `code`, and the communicator's last error when there is one.
fn describe(comm: Option<sys::ncclComm_t>, call: &str, code: sys::ncclResult_t) -> String {
    // SAFETY: ncclGetErrorString returns a static string (or null); ncclGetLastError takes a
    // live communicator (or null) and returns a string NCCL owns until its next call.
    let text = |p: *const std::ffi::c_char| {
        (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    };
    let general = text(unsafe { sys::ncclGetErrorString(code) }).unwrap_or_default();
    let last = comm
        .and_then(|c| text(unsafe { sys::ncclGetLastError(c) }))
        .filter(|s| !s.is_empty());
    match last {
        Some(last) => format!("{call}: {code:?} ({general}): {last}"),
        None => format!("{call}: {code:?} ({general})"),
    }
}

/// A call that started (`ncclSuccess`) or is still running (`ncclInProgress`: a non-blocking
/// communicator's answer); anything else is its error.
fn started(
    comm: Option<sys::ncclComm_t>,
    call: &str,
    code: sys::ncclResult_t,
) -> Result<(), String> {
    match code {
        sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress => Ok(()),
        other => Err(describe(comm, call, other)),
    }
}

/// The communicator's state (`ncclCommGetAsyncError`).
fn state(comm: sys::ncclComm_t) -> CommState {
    let mut async_error = sys::ncclResult_t::ncclSuccess;
    // SAFETY: a live communicator (the slot holds it) and a valid out-pointer.
    let code = unsafe { sys::ncclCommGetAsyncError(comm, &mut async_error) };
    if code != sys::ncclResult_t::ncclSuccess {
        return CommState::Failed(describe(Some(comm), "ncclCommGetAsyncError", code));
    }
    match async_error {
        sys::ncclResult_t::ncclSuccess => CommState::Ready,
        sys::ncclResult_t::ncclInProgress => CommState::InProgress,
        other => CommState::Failed(describe(Some(comm), "the communicator", other)),
    }
}

/// One process's NCCL communicator on candle's CUDA device, for gradient all-reduces.
pub struct NcclGradSum {
    /// The abort slot: `None` once aborted or finished.
    comm: Mutex<Option<RawComm>>,
    device: CudaDevice,
    stream: Arc<CudaStream>,
    rank: usize,
    size: usize,
    timeout: Duration,
}

impl std::fmt::Debug for NcclGradSum {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclGradSum")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

fn nccl_error(message: String) -> DdpError {
    DdpError::Collective(format!("NCCL: {message}"))
}

impl NcclGradSum {
    /// Joins every rank of `collective` in one NCCL communicator on `device` (candle's; its
    /// stream carries the all-reduces). Every rank calls it at the same point; `timeout`
    /// bounds each wait on NCCL (the first all-reduce's connection set-up included). An error
    /// on any rank reaches every rank that is not itself stuck waiting on NCCL (those abort at
    /// the timeout); the program then ends the job.
    pub fn new(
        collective: &mut dyn Collective,
        device: &CudaDevice,
        timeout: Duration,
    ) -> Result<NcclGradSum, DdpError> {
        let rank = collective.rank();
        let size = collective.size();
        // Rank 0 makes the unique id; a failure there reaches every rank in the gather.
        let mine = if rank == 0 {
            cudarc::nccl::result::get_uniqueid()
                .map(|id| id.internal.iter().map(|&c| c as u8).collect::<Vec<u8>>())
                .map_err(|e| nccl_error(describe(None, "ncclGetUniqueId", e.0)))
        } else {
            Ok(Vec::new())
        };
        let ids: Vec<Vec<u8>> = gather_results(collective, mine)?;
        let mut id = sys::ncclUniqueId { internal: [0; 128] };
        match ids.first() {
            Some(bytes) if bytes.len() == id.internal.len() => {
                for (to, &from) in id.internal.iter_mut().zip(bytes) {
                    *to = from as std::ffi::c_char;
                }
            }
            other => {
                return Err(nccl_error(format!(
                    "rank 0 sent a unique id of {} bytes, not 128",
                    other.map_or(0, Vec::len)
                )))
            }
        }

        let joined = Self::join(device, id, (rank, size), timeout);
        // Every rank joined, or every rank hears which did not.
        let joined_everywhere = gather_results(
            collective,
            joined
                .as_ref()
                .map(|_| ())
                .map_err(|e| DdpError::Collective(e.to_string())),
        );
        let made = joined?;
        joined_everywhere?;
        Ok(made)
    }

    /// `ncclCommInitRankConfig`, non-blocking, waited on.
    fn join(
        device: &CudaDevice,
        id: sys::ncclUniqueId,
        (rank, size): (usize, usize),
        timeout: Duration,
    ) -> Result<NcclGradSum, DdpError> {
        let ranks = c_int::try_from(size)
            .map_err(|_| nccl_error(format!("{size} ranks exceed NCCL's count")))?;
        let stream = device.cuda_stream();
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| nccl_error(format!("binding candle's CUDA context: {e}")))?;
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        let mut config = nonblocking_config();
        // SAFETY: valid out-pointers; the id is rank 0's; NCCL copies the config.
        let code = unsafe {
            sys::ncclCommInitRankConfig(&mut comm, ranks, id, rank as c_int, &mut config)
        };
        let made = NcclGradSum {
            comm: Mutex::new((!comm.is_null()).then_some(RawComm(comm))),
            device: device.clone(),
            stream,
            rank,
            size,
            timeout,
        };
        if let Err(e) = started(made.raw().ok(), "ncclCommInitRankConfig", code) {
            made.abort();
            return Err(nccl_error(e));
        }
        made.raw()?;
        made.wait("ncclCommInitRankConfig", || Ok(true))?;
        Ok(made)
    }

    /// This process's rank in the communicator.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The communicator's ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    fn slot(&self) -> MutexGuard<'_, Option<RawComm>> {
        self.comm
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The live communicator, or the error that it was aborted.
    fn raw(&self) -> Result<sys::ncclComm_t, DdpError> {
        self.slot()
            .as_ref()
            .map(|c| c.0)
            .ok_or_else(|| nccl_error("the communicator was aborted after an earlier error".into()))
    }

    /// `ncclCommAbort`, once: empties the slot.
    fn abort(&self) {
        if let Some(comm) = self.slot().take() {
            // SAFETY: a live communicator, taken out of the slot so nothing uses it again.
            unsafe {
                sys::ncclCommAbort(comm.0);
            }
        }
    }

    /// Polls the communicator (and `done`, once it is ready) until both are done; any failure
    /// or the timeout aborts the communicator and is the error.
    fn wait(
        &self,
        what: &str,
        mut done: impl FnMut() -> Result<bool, String>,
    ) -> Result<(), DdpError> {
        let comm = self.raw()?;
        let waited = watch(what, self.timeout, || {
            let now = state(comm);
            let finished = if now == CommState::Ready {
                done()?
            } else {
                false
            };
            Ok((now, finished))
        });
        waited.map_err(|reason| {
            self.abort();
            nccl_error(format!("{reason}; communicator aborted"))
        })
    }

    /// Queues the all-reduce (sum, in place of nothing: `src` into `dst`) of `count` f32 on
    /// candle's stream in one group, and waits until NCCL has queued it.
    fn enqueue(&self, src: u64, dst: u64, count: usize) -> Result<(), DdpError> {
        let comm = self.raw()?;
        let stream = self.stream.cu_stream() as sys::cudaStream_t;
        if let Err(e) = group_all_reduce(comm, src, dst, count, stream) {
            self.abort();
            return Err(nccl_error(format!("{e}; communicator aborted")));
        }
        self.wait("ncclAllReduce (queueing)", || Ok(true))
    }

    /// The sum over every rank of `flat` (an f32 vector on this communicator's device, the
    /// same length on every rank), times `scale` as the host sum scales (f64, rounded once),
    /// with the stream's work finished: every rank gets the same bits. Every rank calls it
    /// at the same point.
    pub fn sum_scaled(&self, flat: &Tensor, scale: f64) -> Result<Tensor, DdpError> {
        let candle = |e: candle_core::Error| nccl_error(e.to_string());
        if !flat
            .device()
            .same_device(&Device::Cuda(self.device.clone()))
        {
            return Err(nccl_error(format!(
                "a gradient on {:?}, not on the communicator's device",
                flat.device().location()
            )));
        }
        if flat.dtype() != DType::F32 || flat.rank() != 1 {
            return Err(nccl_error(format!(
                "a gradient vector of {:?} {:?}; a flat f32 vector expected",
                flat.dtype(),
                flat.dims()
            )));
        }
        let summed = flat
            .apply_op1_no_bwd(&AllReduce { nccl: self })
            .map_err(|e| {
                // The op's own error (NCCL's, already aborted) or candle's.
                nccl_error(e.to_string())
            })?;
        let scaled = scale_as_host(&summed, scale).map_err(candle)?;
        let event = self
            .stream
            .record_event(None)
            .map_err(|e| nccl_error(format!("recording an event on candle's stream: {e}")))?;
        self.wait("ncclAllReduce", || {
            event
                .try_is_complete()
                .map_err(|e| format!("querying the all-reduce's event: {e}"))
        })?;
        Ok(scaled)
    }

    /// Destroys the communicator in order (`ncclCommFinalize`, waited on, then
    /// `ncclCommDestroy`); on an error or the timeout, aborts it.
    pub fn finish(self) -> Result<(), DdpError> {
        let comm = self.raw()?;
        let code = unsafe { sys::ncclCommFinalize(comm) };
        if let Err(e) = started(Some(comm), "ncclCommFinalize", code) {
            self.abort();
            return Err(nccl_error(e));
        }
        self.wait("ncclCommFinalize", || Ok(true))?;
        if let Some(comm) = self.slot().take() {
            // SAFETY: a finalized communicator, out of the slot.
            let code = unsafe { sys::ncclCommDestroy(comm.0) };
            if code != sys::ncclResult_t::ncclSuccess {
                return Err(nccl_error(describe(None, "ncclCommDestroy", code)));
            }
        }
        Ok(())
    }
}

impl Drop for NcclGradSum {
    fn drop(&mut self) {
        // Not finished (an error on the way): abort, which never waits on a peer.
        self.abort();
    }
}

/// `ncclGroupStart`, the f32 sum `ncclAllReduce` of `count` elements from `src` into `dst` on
/// `stream`, `ncclGroupEnd` (whatever the all-reduce said): each may answer "in progress".
fn group_all_reduce(
    comm: sys::ncclComm_t,
    src: u64,
    dst: u64,
    count: usize,
    stream: sys::cudaStream_t,
) -> Result<(), String> {
    // SAFETY: no arguments.
    started(Some(comm), "ncclGroupStart", unsafe {
        sys::ncclGroupStart()
    })?;
    // SAFETY: `src` and `dst` are candle allocations of `count` f32 on the communicator's
    // device, alive until the stream has run the all-reduce (the caller waits for it); the
    // stream is candle's; the communicator is live (the caller took it from the slot).
    let reduce = unsafe {
        sys::ncclAllReduce(
            src as *const std::ffi::c_void,
            dst as *mut std::ffi::c_void,
            count,
            sys::ncclDataType_t::ncclFloat32,
            sys::ncclRedOp_t::ncclSum,
            comm,
            stream,
        )
    };
    // SAFETY: closes the group opened above.
    let end = unsafe { sys::ncclGroupEnd() };
    started(Some(comm), "ncclAllReduce", reduce)?;
    started(Some(comm), "ncclGroupEnd", end)
}

/// The all-reduce as a candle op: a new f32 vector from candle's allocator, on its stream.
struct AllReduce<'a> {
    nccl: &'a NcclGradSum,
}

impl CustomOp1 for AllReduce<'_> {
    fn name(&self) -> &'static str {
        "mucudnn-nccl-all-reduce"
    }

    fn cpu_fwd(
        &self,
        _storage: &candle_core::CpuStorage,
        _layout: &Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, Shape)> {
        Err(candle_core::Error::Msg(
            "the NCCL all-reduce runs on a CUDA device".into(),
        ))
    }

    fn cuda_fwd(
        &self,
        storage: &CudaStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let slice = storage.as_cuda_slice::<f32>()?;
        let (start, end) = layout.contiguous_offsets().ok_or_else(|| {
            candle_core::Error::Msg("the gradient vector is not contiguous".into())
        })?;
        let count = end - start;
        let input = slice.slice(start..end);
        let device = storage.device().clone();
        let stream = device.cuda_stream();
        let mut out = device.alloc_zeros::<f32>(count)?;
        {
            let (src, _src_guard) = input.device_ptr(&stream);
            let (dst, _dst_guard) = out.device_ptr_mut(&stream);
            self.nccl
                .enqueue(src, dst, count)
                .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        }
        Ok((
            CudaStorage::wrap_cuda_slice(out, device),
            Shape::from(count),
        ))
    }
}
