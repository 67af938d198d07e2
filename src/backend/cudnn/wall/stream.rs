//! mucudnn's own cuDNN handle working on a caller's CUDA stream, device pointers and workspace:
//! the part of the FFI wall that the PyTorch path stands on.
//!
//! A framework such as PyTorch owns the stream its work is ordered on and the memory (tensors
//! and the workspace, from its caching allocator). mucudnn keeps its own [`CudnnHandle`] per
//! GPU, on which it builds descriptors and engine execution plans once (the executor's
//! prepared plans); for each call, a [`StreamSession`] points that
//! handle at the caller's stream (`cudnnSetStream`) and puts the handle's own stream back when
//! dropped. Execution is asynchronous on the caller's stream, with no host synchronisation.
//!
//! What can be checked is checked: dtype and exact element count of every operand against the
//! problem, the workspace size against what cuDNN asks for, pointer alignment for engine
//! plans, and that an engine plan was built on this handle. That the pointers are device memory
//! of the handle's GPU holding those elements, and that the stream belongs to that GPU's primary
//! context, is the caller's promise (`unsafe` constructors with `# Safety` contracts): PyTorch
//! checks tensor devices before calling, and checking every pointer with the driver would cost
//! more than the call.
//!
//! Teardown: a plan's kernels may still be queued on the caller's stream when its plan set is
//! released, or captured in a CUDA graph. [`StreamSession::is_capturing`], [`StreamFence`]
//! (a CUDA event recorded on the caller's stream after a call) and [`StreamKey`] are what
//! `PreparedPlan` needs to wait for that work, or to park a plan that a graph may replay; the
//! decision itself is plain Rust in `exec/teardown.rs`.

use super::{
    dnn_err, dnn_sys, invalid, save_current_context, ConvDescriptors, CudaStream, CudnnError,
    CudnnHandle, CurrentContextGuard, EnginePlan, RestoreAfterFields, Site, Surface,
};
use super::{drv, drv_err, drv_sys, Arc, CudaContext};
use crate::solver::ConvOp;
use cudarc::cudnn::result as dnn;
use std::ffi::c_void;
use std::io::Write;

/// A [`CudnnHandle`] whose work goes to a caller's stream until the session is dropped. Made by
/// [`CudnnHandle::on_stream`]; borrows the handle, so nothing else uses it meanwhile.
pub struct StreamSession<'h> {
    handle: &'h CudnnHandle,
    /// The caller's stream (null: the legacy default stream).
    stream: drv_sys::CUstream,
    /// The caller's current context, made current again after the session (declared last:
    /// dropped after `Drop::drop` has put the handle's own stream back).
    _caller_context: CurrentContextGuard,
}

/// `CU_STREAM_PER_THREAD`: a handle that names a different stream on every thread.
const PER_THREAD_STREAM: usize = 0x2;

/// Which stream a session's work goes to, as far as fences are concerned: the stream's handle,
/// and the thread for the per-thread default stream (`CU_STREAM_PER_THREAD` names each
/// thread's own stream).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamKey {
    stream: usize,
    thread: Option<std::thread::ThreadId>,
}

/// A CUDA event (without timing) that marks the end of a call's work on a caller's stream:
/// made by [`StreamSession::new_fence`], recorded by [`StreamSession::record`], waited for at
/// teardown ([`Self::wait`]; `exec/teardown.rs` decides when). Destroyed on drop (an event may
/// be destroyed while its work is pending).
pub struct StreamFence {
    event: drv_sys::CUevent,
    context: Arc<CudaContext>,
    /// The caller's context, restored after the event and the context are released (last).
    caller_context: RestoreAfterFields,
}

impl std::fmt::Debug for StreamFence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamFence").finish_non_exhaustive()
    }
}

impl StreamFence {
    /// Blocks the host until the work queued before the last [`StreamSession::record`] of
    /// this fence has finished (at once if it was never recorded).
    pub fn wait(&self) -> Result<(), CudnnError> {
        let _caller_context = save_current_context()?;
        self.context
            .bind_to_thread()
            .map_err(drv_err("cuCtxSetCurrent"))?;
        // SAFETY: `event` was created by `new_fence` and is destroyed only on drop.
        unsafe { drv::event::synchronize(self.event) }.map_err(drv_err("cuEventSynchronize"))
    }
}

impl Drop for StreamFence {
    fn drop(&mut self) {
        self.caller_context.save();
        let _ = self.context.bind_to_thread();
        // SAFETY: created by `new_fence`, destroyed exactly once, here.
        if let Err(e) = unsafe { drv::event::destroy(self.event) } {
            let _ = writeln!(
                std::io::stderr(),
                "mucudnn: warning: cuEventDestroy failed while dropping a stream fence: {e:?}"
            );
        }
    }
}

impl std::fmt::Debug for StreamSession<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamSession")
            .field("device", &self.handle.ordinal())
            .finish_non_exhaustive()
    }
}

impl CudnnHandle {
    /// Points this handle at `stream` (binding the handle's context to this thread) until the
    /// returned session is dropped, which makes the caller's current context current again.
    ///
    /// # Safety
    ///
    /// `stream` is null (the legacy default stream) or a live `CUstream`/`cudaStream_t` of this
    /// handle's device's primary context (what PyTorch's streams are), and it stays alive until
    /// the work queued through the session has finished.
    pub unsafe fn on_stream(&self, stream: *mut c_void) -> Result<StreamSession<'_>, CudnnError> {
        let caller_context = save_current_context()?;
        self.bind()?;
        // SAFETY: the handle is live and used by this thread alone (the type is not `Sync`,
        // and the session borrows it); the stream is live and of this context (this
        // function's contract). The cast only renames the opaque stream type between cudarc's
        // driver and cuDNN bindings.
        unsafe { dnn::set_stream(self.raw, stream.cast()) }.map_err(dnn_err("cudnnSetStream"))?;
        Ok(StreamSession {
            handle: self,
            stream: stream.cast(),
            _caller_context: caller_context,
        })
    }
}

impl Drop for StreamSession<'_> {
    fn drop(&mut self) {
        // SAFETY: the handle is live; its own stream outlives it (it holds an Arc to it).
        let restored =
            unsafe { dnn::set_stream(self.handle.raw, self.handle.stream.cu_stream() as *mut _) };
        if let Err(e) = restored {
            super::warn_drop("cudnnSetStream", e.0);
        }
    }
}

impl StreamSession<'_> {
    /// Whether the caller's stream is being captured into a CUDA graph
    /// (`cuStreamIsCapturing`: active, or invalidated and not yet ended). Work queued now goes
    /// into the graph, which may replay it at any time.
    pub fn is_capturing(&self) -> Result<bool, CudnnError> {
        let mut status = drv_sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: the stream is live and of the bound context (`on_stream`'s contract); the
        // status is written to a local.
        unsafe { drv_sys::cuStreamIsCapturing(self.stream, &mut status) }
            .result()
            .map_err(drv_err("cuStreamIsCapturing"))?;
        Ok(status != drv_sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// The caller's stream, as fences tell streams apart.
    pub fn key(&self) -> StreamKey {
        let stream = self.stream as usize;
        StreamKey {
            stream,
            thread: (stream == PER_THREAD_STREAM).then(|| std::thread::current().id()),
        }
    }

    /// A new fence in the handle's context (not yet recorded).
    pub fn new_fence(&self) -> Result<StreamFence, CudnnError> {
        let event = drv::event::create(drv_sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(drv_err("cuEventCreate"))?;
        Ok(StreamFence {
            event,
            context: self.handle.stream.context().clone(),
            caller_context: RestoreAfterFields::default(),
        })
    }

    /// Records `fence` on the caller's stream: it now marks the work queued there so far.
    /// Not for a stream being captured (the event would become a graph node).
    pub fn record(&self, fence: &mut StreamFence) -> Result<(), CudnnError> {
        if !Arc::ptr_eq(&fence.context, self.handle.stream.context()) {
            return Err(invalid(
                "StreamSession::record",
                "the fence was made in another context".into(),
            ));
        }
        // SAFETY: the event is live (owned by `fence`) and of the bound context (checked);
        // the stream is live and of that context (`on_stream`'s contract).
        unsafe { drv::event::record(fence.event, self.stream) }.map_err(drv_err("cuEventRecord"))
    }
}

/// Whether a caller's `stream` is being captured into a CUDA graph (`cuStreamIsCapturing`),
/// without a handle: the PyTorch path asks before it would tune (tuning synchronises, which a
/// capture forbids). An error when the driver is not there.
///
/// # Safety
///
/// `stream` is null (the legacy default stream) or a live `CUstream`/`cudaStream_t`.
pub unsafe fn stream_is_capturing(stream: *mut c_void) -> Result<bool, CudnnError> {
    super::gates::driver()?;
    let mut status = drv_sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: the driver is initialised (above); the stream is live (this function's
    // contract); the status is written to a local.
    unsafe { drv_sys::cuStreamIsCapturing(stream.cast(), &mut status) }
        .result()
        .map_err(drv_err("cuStreamIsCapturing"))?;
    Ok(status != drv_sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

impl Site for StreamSession<'_> {
    const CONVOLVE: &'static str = "StreamSession::convolve";
    const EXECUTE: &'static str = "StreamSession::execute_engine";
    const SCALE: &'static str = "StreamSession::scale_view";

    fn raw(&self) -> dnn_sys::cudnnHandle_t {
        self.handle.raw
    }

    fn orders(&self, stream: &CudaStream) -> bool {
        stream.cu_stream() == self.stream
    }

    fn enter(&self) -> Result<(), CudnnError> {
        // `on_stream` bound the handle's context and set the caller's stream.
        Ok(())
    }

    fn required_workspace(
        &self,
        d: &ConvDescriptors,
        op: ConvOp,
        algo: u32,
    ) -> Result<u64, CudnnError> {
        self.handle.workspace_size(d, op, algo)?.ok_or_else(|| {
            invalid(
                Self::CONVOLVE,
                format!("cuDNN does not support {op} algorithm {algo} for this problem"),
            )
        })
    }

    fn built(&self, plan: &EnginePlan) -> bool {
        plan.built_on(&self.handle.owner)
    }
}

/// Legacy convolutions, fills and engine plans ([`EnginePlan::execute`]) queued on the caller's
/// stream, with no host synchronisation.
impl Surface for StreamSession<'_> {
    fn handle(&self) -> &CudnnHandle {
        self.handle
    }
}
