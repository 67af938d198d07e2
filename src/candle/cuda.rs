//! The layer on candle's CUDA device (feature `candle-cuda`): tune a new input shape on the
//! GPU through the shared cache (cuDNN legacy algorithms and engine configurations, as the
//! options say), with candle's stream drained first so that its queued kernels do not run
//! beside the timed ones; prepare its plans once on the layer's cuDNN handle, then run them on
//! candle's stream over candle's buffers, with the output and each call's workspace allocated
//! from candle's device, in the layer's dtype (f32, f16 or bf16: cuDNN problems of that dtype;
//! the tuner's accuracy rule for bf16 backward-filter micro-batches applies as everywhere).
//! Operands start at aligned addresses (the layer copies views that do
//! not, `operand` in mod.rs; checked again here). Everything unsafe (candle's buffers as the
//! wall's views, the stream) is in `device.rs` (`CandleLayerDevice`).

use super::device::CandleLayerDevice;
use super::LayerCore;
use crate::backend::cpu::{self, Element};
use crate::backend::cudnn::{ConvOperands, DropInCallerContext};
use crate::backend::TimingSettings;
use crate::solver::{ConvOp, ConvProblem, DType};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::CudaDType;
use candle_core::{CudaStorage, Layout};
use cudarc::driver::{CudaView, DeviceRepr};

/// Dropped with the layer (or its state) in the caller's current context: destroying plans,
/// handles and streams binds the GPU's context, which is then made current again.
pub(super) type DeviceState = DropInCallerContext<CandleLayerDevice>;

/// The `T` elements of a candle CUDA tensor (contiguous: the layer makes its operands so),
/// which must have the layer's dtype.
fn view<'a, T: CudaDType>(
    core: &LayerCore,
    what: &str,
    storage: &'a CudaStorage,
    layout: &Layout,
) -> candle_core::Result<CudaView<'a, T>> {
    core.check_dtype(what, storage.dtype())?;
    let slice = storage.as_cuda_slice::<T>()?;
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or_else(|| core.error(format!("the {what} is not contiguous")))?;
    // candle's allocations are aligned; an offset into one must keep the base alignment the
    // plans were built for (the layer copies views that do not).
    if super::needs_aligned_copy(true, start, std::mem::size_of::<T>()) {
        return Err(core.error(format!(
            "the {what} starts {start} elements into its storage, not at a {}-byte aligned \
             address",
            super::GPU_BASE_ALIGNMENT
        )));
    }
    Ok(slice.slice(start..end))
}

/// `op(a, b)` of `problem` on candle's device and stream; `a` and `b` as for the op's plan:
/// `(x, w)`, `(w, dy)` or `(x, dy)`, in the problem's dtype (the layer's).
pub(super) fn run(
    core: &LayerCore,
    problem: &ConvProblem,
    op: ConvOp,
    a: (&CudaStorage, &Layout),
    b: (&CudaStorage, &Layout),
) -> candle_core::Result<CudaStorage> {
    match problem.dtype {
        DType::Fp32 => run_typed::<f32>(core, problem, op, a, b),
        DType::Fp16 => run_typed::<half::f16>(core, problem, op, a, b),
        DType::Bf16 => run_typed::<half::bf16>(core, problem, op, a, b),
    }
}

/// [`run`] with the problem dtype's element type `T`.
fn run_typed<T>(
    core: &LayerCore,
    problem: &ConvProblem,
    op: ConvOp,
    (a, a_layout): (&CudaStorage, &Layout),
    (b, b_layout): (&CudaStorage, &Layout),
) -> candle_core::Result<CudaStorage>
where
    T: Element + CudaDType + DeviceRepr,
{
    let device = a.device().clone();
    let stream = device.cuda_stream();
    let ordinal = stream.context().ordinal();
    let a = view::<T>(core, "first operand", a, a_layout)?;
    let b = view::<T>(core, "second operand", b, b_layout)?;
    let out_len = cpu::buffer_lens(problem, op).map_err(|e| core.error(e))?[2].1;
    // Uninitialised: every plan's first call on each part of the output has beta 0, which
    // cuDNN documents as not reading the output (NaN or garbage there is never used), and the
    // micro-batches or chunks cover the whole output; a memset would cost a pass over it.
    // SAFETY: the elements are written by the plan (above) before anything reads them; `T`
    // is a plain number type (f32, f16, bf16), valid for any bits cuDNN writes.
    let mut out = unsafe { device.alloc::<T>(out_len) }?;
    let key = (problem.n, problem.h, problem.w);

    let mut state = core.lock()?;
    let state = &mut *state;
    let index = match state.cuda.iter().position(|d| d.ordinal() == ordinal) {
        Some(index) => index,
        None => {
            let made = CandleLayerDevice::new(ordinal).map_err(|e| core.error(e))?;
            state.cuda.push(DropInCallerContext::new(made));
            state.cuda.len() - 1
        }
    };
    let gpu = &mut state.cuda[index];
    if !gpu.is_tuned(key) {
        let cache = core.cache()?;
        let cache = cache
            .lock()
            .map_err(|_| core.error("the tuning cache's mutex is poisoned"))?;
        let tuning = core.options.tuning(TimingSettings::GPU);
        // Measure on an idle GPU: candle's queued kernels would inflate the timings, which
        // the cache then keeps.
        stream.synchronize().map_err(|e| {
            core.error(format!(
                "synchronising candle's stream before measuring: {e}"
            ))
        })?;
        let tuned = gpu
            .tune(key, |backend| {
                tuning
                    .tune_counted(backend, &cache, &core.name, problem)
                    .map_err(|e| LayerMessage(e.to_string()))
            })
            .map_err(|e| core.error(e.0))?;
        if let Some(stats) = tuned {
            super::record_tuning(&mut state.tunings, key, stats);
        }
    }
    let gpu = &mut state.cuda[index];
    let needed = gpu
        .workspace_bytes(key, op)
        .ok_or_else(|| core.error("the plans were not prepared"))?;
    // This call's workspace, from candle's allocator (freed stream-ordered after the work
    // queued on its stream): no layer keeps one. Uninitialised: cuDNN's workspace is scratch
    // that its kernels write before they read.
    let mut workspace = match needed {
        0 => None,
        // SAFETY: bytes (any value is valid) that only cuDNN uses, as scratch.
        bytes => Some(unsafe { device.alloc::<u8>(bytes as usize) }?),
    };
    let operands = ConvOperands {
        a: &a,
        b: &b,
        out: &mut out,
        workspace: workspace.as_mut(),
    };
    gpu.execute(key, op, &stream, operands)
        .map_err(|e| core.error(e))?;
    Ok(CudaStorage::wrap_cuda_slice(out, device))
}

/// A tuning or preparing failure, as text for the layer's error.
struct LayerMessage(String);

impl From<crate::exec::ExecError> for LayerMessage {
    fn from(e: crate::exec::ExecError) -> Self {
        LayerMessage(e.to_string())
    }
}

impl From<crate::backend::BackendError> for LayerMessage {
    fn from(e: crate::backend::BackendError) -> Self {
        LayerMessage(e.to_string())
    }
}
