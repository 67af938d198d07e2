//! One candle layer's cuDNN state on one GPU (feature `candle-cuda`), and execution of its
//! prepared plans on candle's stream over candle's cudarc buffers, through the same
//! `StreamSession` as the PyTorch path (the executor's `PreparedPlan::execute_on`).
//!
//! Data in: cudarc `CudaSlice`/`CudaView`s (candle's storage) and candle's `CudaStream`. They
//! become the wall's views ([`DeviceView::from_cudarc`]): the device pointers come from
//! cudarc's `DevicePtr` on that stream, which also records the events cudarc uses to order
//! other streams' access to the same buffers; the views live as long as the borrows they came
//! from, which outlive the call, and the buffers are freed stream-ordered by cudarc, so the
//! queued work never outlives its memory. Data out: the operation queued on candle's stream,
//! no host synchronisation.

use crate::backend::cpu::Element;
use crate::backend::cudnn::{
    ConvOperands, CudnnError, CudnnHandle, DeviceOperands, DeviceView, DeviceViewMut, WorkspaceView,
};
use crate::backend::CudnnBackend;
use crate::exec::cudnn::PreparedPlan;
use crate::exec::ExecError;
use crate::local_tuner::LocalTuner;
use crate::solver::{ConvOp, Plan};
use crate::tune::CacheStats;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use std::ffi::c_void;

/// Key of a tuned input shape `(n, h, w)`.
pub type ShapeKey = (i64, i64, i64);

/// One layer's cuDNN state on one GPU: the handle its plans are prepared and run on and the
/// prepared `[forward, backward-data, backward-filter]` plans per input shape. It keeps no
/// measuring state (a tune makes its backend and drops it) and no workspace (each call takes
/// one from the caller's allocator), so its memory does not grow with the layers (no state
/// of a tune outlives it).
pub struct CandleLayerDevice {
    ordinal: usize,
    exec: CudnnHandle,
    plans: LocalTuner<ShapeKey, [PreparedPlan; 3]>,
}

// SAFETY: a `CandleLayerDevice` holds a cuDNN handle and plans prepared on it (engine plans
// keep `Rc` clones of the handle's owner), which are not `Send` because cuDNN forbids
// concurrent use of a handle. The layer keeps it behind its `Mutex`, so one thread at a time
// uses it; no method hands out the handle, a plan or an `Rc` (closures get only shared
// references for the duration of the call and must return `Send` values); and every call
// binds the handle's context to the calling thread first (`on_stream` and the backend's calls
// do), which is what cuDNN requires of a handle used by several threads one after another.
unsafe impl Send for CandleLayerDevice {}

impl std::fmt::Debug for CandleLayerDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CandleLayerDevice")
            .field("ordinal", &self.ordinal)
            .field(
                "shapes",
                &self.plans.tunings().map(|(key, _)| key).collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

impl CandleLayerDevice {
    /// The state on GPU `ordinal`: a cuDNN handle in its primary context (candle's context).
    pub fn new(ordinal: usize) -> Result<Self, CudnnError> {
        Ok(CandleLayerDevice {
            ordinal,
            exec: CudnnHandle::new(ordinal)?,
            plans: LocalTuner::new(),
        })
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    pub fn is_tuned(&self, key: ShapeKey) -> bool {
        self.plans.contains(&key)
    }

    /// Tunes shape `key` with `tune` (given a measuring backend on the GPU, made for this tune
    /// and dropped after it) and prepares its plans on the layer's handle.
    /// Returns the tune's cache statistics (`None`: the shape was tuned before).
    pub fn tune<E: From<ExecError> + From<crate::backend::BackendError>>(
        &mut self,
        key: ShapeKey,
        tune: impl FnOnce(&mut CudnnBackend) -> Result<([Plan; 3], CacheStats), E>,
    ) -> Result<Option<CacheStats>, E> {
        let (ordinal, exec) = (self.ordinal, &self.exec);
        let (_, stats) = self.plans.get_or_tune(&key, || -> Result<_, E> {
            let mut backend = CudnnBackend::new(ordinal)?;
            let tuned = tune(&mut backend);
            drop(backend);
            let ([f, d, w], stats) = tuned?;
            let prepared = [
                PreparedPlan::new(exec, f)?,
                PreparedPlan::new(exec, d)?,
                PreparedPlan::new(exec, w)?,
            ];
            Ok((prepared, stats))
        })?;
        Ok(stats)
    }

    /// The workspace bytes `op` of shape `key` needs (`None`: not tuned).
    pub fn workspace_bytes(&self, key: ShapeKey, op: ConvOp) -> Option<u64> {
        self.plans
            .peek(&key)
            .map(|plans| plans[op_index(op)].workspace_bytes())
    }

    /// `out = op(a, b)` for shape `key` (operands at the full mini-batch, roles as for
    /// `Surface::convolve`), queued on `stream`, which must belong to this GPU's primary
    /// context (candle's), with `workspace` from the caller's allocator for this call (at
    /// least [`CandleLayerDevice::workspace_bytes`]; `None` when that is 0). The elements `T`
    /// (f32, f16 or bf16) must be the plans' dtype. Checked: the stream's context, the dtype,
    /// every operand's element count and alignment, the workspace.
    pub fn execute<T, A>(
        &mut self,
        key: ShapeKey,
        op: ConvOp,
        stream: &CudaStream,
        operands: ConvOperands<&A, &mut CudaSlice<T>, Option<&mut CudaSlice<u8>>>,
    ) -> Result<(), ExecError>
    where
        T: Element,
        A: DevicePtr<T>,
    {
        const CALL: &str = "CandleLayerDevice::execute";
        let invalid = |detail: String| CudnnError::InvalidArgument { call: CALL, detail };
        let Some(plans) = self.plans.get(&key) else {
            return Err(ExecError::InvalidPlan {
                layer: "candle layer".into(),
                op,
                reason: format!("the input shape {key:?} has not been tuned"),
            });
        };
        let plan = &plans[op_index(op)];
        let error = |source: CudnnError| ExecError::Cudnn {
            layer: plan.plan().layer.clone(),
            op,
            source,
        };
        let dtype = T::DTYPE;
        if plan.plan().problem.dtype != dtype {
            return Err(error(invalid(format!(
                "the operands are {dtype}, the plans are for {}",
                plan.plan().problem.dtype
            ))));
        }
        let ours = self.exec.stream().context();
        if stream.context().cu_ctx() != ours.cu_ctx() {
            return Err(error(invalid(format!(
                "the stream is of device {}'s context, the layer's handle is of device {}'s \
                 primary context",
                stream.context().ordinal(),
                self.ordinal
            ))));
        }
        let needed = plan.workspace_bytes();
        let ConvOperands {
            a,
            b,
            out,
            workspace,
        } = operands;
        // SAFETY (the contract of `from_cudarc`): the work using the views is queued on
        // `stream`, on which their pointers are taken; each view borrows candle's buffer for
        // this whole function (so it stays allocated while we queue work), and cudarc frees
        // buffers stream-ordered, after the work queued on `stream`, whose events the views
        // record (candle's buffers live on that one stream). `out` and the workspace are
        // borrowed mutably, so nothing else writes or reads them meanwhile and they overlap
        // neither input. The stream's context is the handle's (checked above).
        let views = unsafe {
            (
                DeviceView::from_cudarc(a, stream),
                DeviceView::from_cudarc(b, stream),
                DeviceViewMut::from_cudarc(out, stream),
                match workspace {
                    Some(ws) if needed > 0 => WorkspaceView::from_cudarc(ws, stream),
                    _ => Ok(WorkspaceView::empty()),
                },
            )
        };
        let (a, b, mut out, mut workspace) = match views {
            (Ok(a), Ok(b), Ok(out), Ok(ws)) => (a, b, out, ws),
            (Err(e), ..) | (_, Err(e), ..) | (_, _, Err(e), _) | (.., Err(e)) => {
                return Err(error(e))
            }
        };
        if workspace.bytes() < needed {
            return Err(error(invalid(format!(
                "{op} needs {needed} workspace bytes, {} reserved",
                workspace.bytes()
            ))));
        }
        // SAFETY: the stream is live (borrowed) and of this handle's device's primary context
        // (checked above); the work queued on it finishes before cudarc frees anything it uses
        // (see above).
        let session =
            unsafe { self.exec.on_stream(stream.cu_stream() as *mut c_void) }.map_err(error)?;
        let operands = DeviceOperands::new(&a, &b, &mut out, &mut workspace);
        plan.execute_on(&session, 1.0, 0.0, operands)
    }
}

fn op_index(op: ConvOp) -> usize {
    match op {
        ConvOp::Forward => 0,
        ConvOp::BackwardData => 1,
        ConvOp::BackwardFilter => 2,
    }
}
