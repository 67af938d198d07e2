//! mucudnn's kernels for `aten::convolution` and `aten::convolution_backward`, registered at
//! PyTorch's CPU and CUDA dispatch keys: below autograd, autocast, functorch, tensor subclasses
//! and dispatch modes, which all see PyTorch's own op first.
//!
//! A call is claimed by a converted layer or the switch ([`super::registry`]), mapped to its
//! convolution problem ([`super::call`]) and run with its prepared plans ([`super::plans`]):
//! outputs allocated by PyTorch (`aoti_torch_empty_strided`), operands packed in the problem's
//! layout (copied by PyTorch where they are not), workspace from the host tuner's one buffer
//! or PyTorch's CUDA caching allocator, on PyTorch's current stream. Everything else runs
//! PyTorch's own kernel for the device through its C shim
//! (`aoti_torch_{cpu,cuda}_convolution{,_backward}`, which calls that kernel directly, not
//! the dispatcher), so its numbers and errors are exactly PyTorch's; a call a layer or the
//! switch claimed is counted with the reason.
//!
//! PyTorch's derivative formulas apply unchanged: autograd's backward of a convolution calls
//! `convolution_backward` (here again), forward-mode AD and double backward call
//! `convolution` (here again), `vmap` turns batches into calls of these ops. No Python runs
//! per call.
//!
//! Errors: a kernel's body runs under `catch_unwind`; its error (or panic) is raised after
//! every handle of the call is freed, through `aoti_torch_check`, which throws PyTorch's
//! exception (a `RuntimeError` naming the layer and the problem). That exception unwinds
//! through two frames of this library only, neither with a personality routine (the kernel's
//! entry, `extern "C-unwind"`, holding nothing, and the function that throws): this library may
//! carry an unwinder other than the C++ runtime's (see "Raising PyTorch's exception").

use super::api::{Ath, Siv, TorchApi, TorchError};
use super::call::{
    self, Device, Dims, Fallback, Geometry, GradientJob, Mapped, Operand, OutputMask, TensorMeta,
};
use super::context::Switches;
use super::plans::{op_index, Miss, PlanKey, Ready, Request};
use super::registry::{CallWeight, Who};
use super::{logged, Discovered, Runtime};
use crate::backend::cpu::Element;
use crate::c_abi::handle::RawOperands;
use crate::c_abi::tuner::{CallerWorkspace, OperandExtent};
use crate::solver::{operand_roles, ConvOp, ConvProblem, DType, Layout, MathMode};
use std::cell::RefCell;
use std::ffi::{c_char, c_void, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

/// The base alignment the GPU path asks of every operand: engine plans declare the alignment
/// of the offsets they run at, relative to an aligned base (PyTorch's caching allocator hands
/// out 512-byte aligned blocks; a view into one may start anywhere, and is copied).
const GPU_BASE_ALIGNMENT: usize = 256;

// ---------------------------------------------------------------------------------------------
// Handles

/// A tensor handle the kernel owns (deleted on drop).
pub(super) struct Owned<'a> {
    api: &'a TorchApi,
    handle: Ath,
}

impl<'a> Owned<'a> {
    fn new(api: &'a TorchApi, handle: Ath) -> Self {
        Owned { api, handle }
    }

    fn get(&self) -> Ath {
        self.handle
    }

    /// Hands the handle over (to the dispatcher, as a return).
    fn into_raw(self) -> Ath {
        let handle = self.handle;
        std::mem::forget(self);
        handle
    }
}

impl Drop for Owned<'_> {
    fn drop(&mut self) {
        if !self.handle.is_null() {
            // SAFETY: an owning handle, deleted once.
            unsafe { (self.api.cpu.delete_tensor)(self.handle) };
        }
    }
}

fn status(code: TorchError, api: &TorchApi, what: &str) -> Result<(), String> {
    if code == 0 {
        Ok(())
    } else {
        Err(api
            .last_exception()
            .unwrap_or_else(|| format!("PyTorch's {what} failed")))
    }
}

fn take_tensor(api: &TorchApi, value: Siv) -> Owned<'_> {
    Owned::new(api, value as usize as Ath)
}

/// An optional tensor argument: `None` for None, and for an undefined tensor (what C++
/// callers such as `at::conv2d` pass for a missing bias).
fn take_optional_tensor(api: &TorchApi, value: Siv) -> Option<Owned<'_>> {
    if value == 0 {
        return None;
    }
    let boxed = value as usize as *mut Siv;
    // SAFETY: a box the dispatcher made for this call, read and freed once.
    let tensor = take_tensor(api, unsafe { *boxed });
    unsafe { api.free_box(boxed) };
    let mut defined = false;
    // SAFETY: a live handle; written to a local.
    let ok = unsafe { (api.cpu.is_defined)(tensor.get(), &mut defined) } == 0;
    (ok && defined).then_some(tensor)
}

/// A list argument's values (the list freed). An unreadable list reads as empty, which no
/// convolution accepts: PyTorch's kernel then raises.
fn take_list(api: &TorchApi, value: Siv) -> Vec<i64> {
    let list = value as usize as *mut c_void;
    let mut values = Vec::new();
    let mut len = 0usize;
    // SAFETY: a list the dispatcher made for this call, read then freed once.
    unsafe {
        if (api.cpu.list_size)(list, &mut len) == 0 {
            values.reserve(len);
            for index in 0..len {
                let mut item: Siv = 0;
                if (api.cpu.list_get)(list, index, &mut item) != 0 {
                    values.clear();
                    break;
                }
                values.push(item as i64);
            }
        }
        (api.cpu.delete_list)(list);
    }
    values
}

fn take_optional_list(api: &TorchApi, value: Siv) -> Option<Vec<i64>> {
    if value == 0 {
        return None;
    }
    let boxed = value as usize as *mut Siv;
    // SAFETY: as for `take_optional_tensor`.
    let list = unsafe { *boxed };
    unsafe { api.free_box(boxed) };
    Some(take_list(api, list))
}

fn take_bool(value: Siv) -> bool {
    value & 0xff != 0
}

fn dtype_of(api: &TorchApi, code: i32) -> Option<DType> {
    let codes = &api.codes;
    if code == codes.float32 {
        Some(DType::Fp32)
    } else if code == codes.float16 {
        Some(DType::Fp16)
    } else if code == codes.bfloat16 {
        Some(DType::Bf16)
    } else {
        None
    }
}

fn dtype_code(api: &TorchApi, dtype: DType) -> i32 {
    match dtype {
        DType::Fp32 => api.codes.float32,
        DType::Fp16 => api.codes.float16,
        DType::Bf16 => api.codes.bfloat16,
    }
}

/// A tensor's metadata (`None`: more than 5 dims, or unreadable: PyTorch's to run).
fn meta(api: &TorchApi, tensor: Ath) -> Option<TensorMeta> {
    let mut dim = 0i64;
    let mut sizes: *mut i64 = std::ptr::null_mut();
    let mut strides: *mut i64 = std::ptr::null_mut();
    let (mut dtype, mut device_type, mut device_index, mut layout) = (0i32, 0i32, 0i32, 0i32);
    // SAFETY: a live handle; the size and stride arrays are borrowed from the tensor, read at
    // once.
    unsafe {
        let ok = (api.cpu.get_dim)(tensor, &mut dim) == 0
            && (api.cpu.get_sizes)(tensor, &mut sizes) == 0
            && (api.cpu.get_strides)(tensor, &mut strides) == 0
            && (api.cpu.get_dtype)(tensor, &mut dtype) == 0
            && (api.cpu.get_device_type)(tensor, &mut device_type) == 0
            && (api.cpu.get_device_index)(tensor, &mut device_index) == 0
            && (api.cpu.get_layout)(tensor, &mut layout) == 0;
        if !ok || !(0..=5).contains(&dim) {
            return None;
        }
        let dim = dim as usize;
        let sizes = if dim == 0 {
            &[][..]
        } else {
            std::slice::from_raw_parts(sizes, dim)
        };
        let strides = if dim == 0 {
            &[][..]
        } else {
            std::slice::from_raw_parts(strides, dim)
        };
        let device = if device_type == api.codes.cpu {
            Device::Cpu
        } else if device_type == api.codes.cuda {
            Device::Cuda(device_index.max(0))
        } else {
            Device::Other
        };
        Some(TensorMeta {
            sizes: Dims::new(sizes)?,
            strides: Dims::new(strides)?,
            dtype: dtype_of(api, dtype),
            device,
            strided: layout == api.codes.strided,
        })
    }
}

fn data_ptr(api: &TorchApi, tensor: Ath) -> Result<*mut c_void, String> {
    let mut pointer: *mut c_void = std::ptr::null_mut();
    // SAFETY: a live handle; the pointer is written to a local.
    status(
        unsafe { (api.cpu.get_data_ptr)(tensor, &mut pointer) },
        api,
        "data_ptr",
    )?;
    Ok(pointer)
}

/// The address of a tensor's `TensorImpl`: an `AtenTensorHandle` points to an `at::Tensor`,
/// whose one field is the pointer to its `TensorImpl` (what Python's `Tensor._cdata` gives).
fn identity(tensor: Ath) -> usize {
    // SAFETY: a live handle points to an `at::Tensor`, an `intrusive_ptr` of one pointer.
    unsafe { *(tensor as *const usize) }
}

fn empty<'a>(
    api: &'a TorchApi,
    sizes: &Dims,
    strides: &Dims,
    dtype: DType,
    device: Device,
) -> Result<Owned<'a>, String> {
    let (device_type, index) = match device {
        Device::Cuda(index) => (api.codes.cuda, index),
        _ => (api.codes.cpu, 0),
    };
    let mut out: Ath = std::ptr::null_mut();
    // SAFETY: arrays of `len` values; the handle is written to a local.
    let code = unsafe {
        (api.cpu.empty_strided)(
            sizes.len() as i64,
            sizes.as_slice().as_ptr(),
            strides.as_slice().as_ptr(),
            dtype_code(api, dtype),
            device_type,
            index,
            &mut out,
        )
    };
    status(code, api, "empty_strided")?;
    Ok(Owned::new(api, out))
}

fn undefined(api: &TorchApi) -> Result<Owned<'_>, String> {
    let mut out: Ath = std::ptr::null_mut();
    // SAFETY: the handle is written to a local.
    status(
        unsafe { (api.cpu.new_uninitialized)(&mut out) },
        api,
        "an undefined tensor",
    )?;
    Ok(Owned::new(api, out))
}

/// An operand as a plan reads it: the caller's tensor when it is packed in the layout (and
/// aligned, on a GPU), else a packed copy made by PyTorch.
struct Packed<'a> {
    _copy: Option<Owned<'a>>,
    pointer: *mut c_void,
}

fn packed<'a>(
    api: &'a TorchApi,
    tensor: Ath,
    meta: &TensorMeta,
    layout: Layout,
) -> Result<Packed<'a>, String> {
    let pointer = data_ptr(api, tensor)?;
    let aligned =
        !matches!(meta.device, Device::Cuda(_)) || (pointer as usize) % GPU_BASE_ALIGNMENT == 0;
    if aligned && meta.is_packed(layout) {
        return Ok(Packed {
            _copy: None,
            pointer,
        });
    }
    let dtype = meta.dtype.ok_or("an operand of an unsupported dtype")?;
    let strides = call::packed_strides(&meta.sizes, layout);
    let copy = empty(api, &meta.sizes, &strides, dtype, meta.device)?;
    // SAFETY: two live handles of equal sizes, dtype and device.
    status(
        unsafe { (api.cpu.copy_)(copy.get(), tensor, 0) },
        api,
        "copy_",
    )?;
    let pointer = data_ptr(api, copy.get())?;
    Ok(Packed {
        _copy: Some(copy),
        pointer,
    })
}

// ---------------------------------------------------------------------------------------------
// Raising PyTorch's exception
//
// `aoti_torch_check(false, ...)` throws a C++ exception from libtorch, unwound by the C++
// runtime's unwinder (libgcc_s) through the frames between it and the dispatcher: `throw_check`
// and the kernel's entry function. Those two frames must have no personality routine: this
// library may carry an unwinder of its own (the wheel, linked by zig, has LLVM's libunwind
// statically), and Rust's personality routine would then be handed a context of another
// unwinder (a segmentation fault). So the body runs to completion in `run_kernel` (its own
// frame, never inlined, which catches panics), the entry function holds nothing that needs
// dropping (no landing pad, so no personality), and `throw_check` only makes the call.

thread_local! {
    /// The message of the exception being raised (alive while PyTorch copies it).
    static RAISED: RefCell<CString> = RefCell::new(CString::default());
}

type CheckFn = unsafe extern "C-unwind" fn(bool, *const c_char, *const c_char, u32, *const c_char);

/// An exception to raise once the kernel's body has returned: PyTorch's check function and the
/// message (in `RAISED`). Plain values, nothing to drop.
#[derive(Clone, Copy)]
#[repr(C)]
struct Pending {
    check: CheckFn,
    message: *const c_char,
}

fn pending(api: &TorchApi, message: &str) -> Pending {
    let message = RAISED.with(|slot| {
        *slot.borrow_mut() = crate::c_abi::error::c_string_lossless(message);
        slot.borrow().as_ptr()
    });
    Pending {
        check: api.cpu.check,
        message,
    }
}

/// Throws PyTorch's exception; returns only if it did not (never, with the interface this was
/// resolved from).
///
/// # Safety
///
/// `pending` was made by [`pending`] on this thread (its message still in `RAISED`).
#[inline(never)]
unsafe extern "C-unwind" fn throw_check(pending: Pending) {
    // SAFETY: NUL-terminated strings: the message lives in thread-local storage, the others
    // are static.
    unsafe {
        (pending.check)(
            false,
            c"mucudnn".as_ptr(),
            c"mucudnn/src/torch/kernels.rs".as_ptr(),
            line!(),
            pending.message,
        )
    };
}

fn panic_text(payload: Box<dyn std::any::Any + Send>) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".into())
}

/// Runs a kernel body to completion (every handle it took freed) and says what to raise, if
/// anything. Never inlined: its frame, which catches panics, is gone before anything throws.
#[inline(never)]
fn run_kernel(
    body: impl FnOnce(&'static Runtime, Switches) -> Result<(), String>,
) -> Option<Pending> {
    let Some(runtime) = super::runtime() else {
        // Registered only by an initialised runtime: unreachable; no exception to raise with.
        eprintln!("mucudnn: a kernel ran without its runtime");
        std::process::abort();
    };
    let switches = runtime.context.read();
    let outcome = catch_unwind(AssertUnwindSafe(|| body(runtime, switches)));
    let message = match outcome {
        Ok(Ok(())) => return None,
        Ok(Err(message)) => message,
        Err(payload) => format!("mucudnn: internal error: {}", panic_text(payload)),
    };
    Some(pending(&runtime.api, &message))
}

/// `aten::convolution`'s kernel.
///
/// # Safety
///
/// Called by PyTorch's dispatcher with the op's boxed stack (9 arguments, room for 1 return),
/// as `torch_library_impl` registered it.
pub unsafe extern "C-unwind" fn convolution(stack: *mut Siv, _args: u64, _returns: u64) {
    let raised = run_kernel(|runtime, switches| {
        // SAFETY: the dispatcher's stack of this op's 9 arguments (1 return).
        let stack = unsafe { std::slice::from_raw_parts_mut(stack, 9) };
        let api = &runtime.api;
        let call = ForwardCall {
            input: take_tensor(api, stack[0]),
            weight: take_tensor(api, stack[1]),
            bias: take_optional_tensor(api, stack[2]),
            stride: take_list(api, stack[3]),
            padding: take_list(api, stack[4]),
            dilation: take_list(api, stack[5]),
            transposed: take_bool(stack[6]),
            output_padding: take_list(api, stack[7]),
            groups: stack[8] as i64,
        };
        let output = forward(runtime, &call, switches)?;
        stack[0] = output.into_raw() as usize as Siv;
        Ok(())
    });
    if let Some(pending) = raised {
        // SAFETY: made by `pending` on this thread just now.
        unsafe { throw_check(pending) };
    }
}

/// `aten::convolution_backward`'s kernel.
///
/// # Safety
///
/// Called by PyTorch's dispatcher with the op's boxed stack (11 arguments, room for 3
/// returns), as `torch_library_impl` registered it.
pub unsafe extern "C-unwind" fn convolution_backward(stack: *mut Siv, _args: u64, _returns: u64) {
    let raised = run_kernel(|runtime, switches| {
        // SAFETY: the dispatcher's stack of this op's 11 arguments (3 returns).
        let stack = unsafe { std::slice::from_raw_parts_mut(stack, 11) };
        let api = &runtime.api;
        let mask = take_list(api, stack[10]);
        let call = BackwardCall {
            grad_output: take_tensor(api, stack[0]),
            forward: ForwardCall {
                input: take_tensor(api, stack[1]),
                weight: take_tensor(api, stack[2]),
                bias: None,
                stride: take_list(api, stack[4]),
                padding: take_list(api, stack[5]),
                dilation: take_list(api, stack[6]),
                transposed: take_bool(stack[7]),
                output_padding: take_list(api, stack[8]),
                groups: stack[9] as i64,
            },
            bias_sizes: take_optional_list(api, stack[3]),
            mask: [0, 1, 2].map(|i| mask.get(i).is_some_and(|&v| v & 0xff != 0)),
        };
        let [grad_input, grad_weight, grad_bias] = backward(runtime, &call, switches)?;
        stack[0] = grad_input.into_raw() as usize as Siv;
        stack[1] = grad_weight.into_raw() as usize as Siv;
        stack[2] = grad_bias.into_raw() as usize as Siv;
        Ok(())
    });
    if let Some(pending) = raised {
        // SAFETY: made by `pending` on this thread just now.
        unsafe { throw_check(pending) };
    }
}

// ---------------------------------------------------------------------------------------------
// The calls

/// `aten::convolution`'s arguments, owned.
struct ForwardCall<'a> {
    input: Owned<'a>,
    weight: Owned<'a>,
    bias: Option<Owned<'a>>,
    stride: Vec<i64>,
    padding: Vec<i64>,
    dilation: Vec<i64>,
    transposed: bool,
    output_padding: Vec<i64>,
    groups: i64,
}

impl ForwardCall<'_> {
    fn geometry(&self) -> Option<Geometry> {
        Some(Geometry {
            stride: Dims::new(&self.stride)?,
            padding: Dims::new(&self.padding)?,
            dilation: Dims::new(&self.dilation)?,
            transposed: self.transposed,
            output_padding: Dims::new(&self.output_padding)?,
            groups: self.groups,
        })
    }

    /// The op of the problem this call's forward runs.
    fn forward_op(&self) -> ConvOp {
        if self.transposed {
            ConvOp::BackwardData
        } else {
            ConvOp::Forward
        }
    }
}

struct BackwardCall<'a> {
    grad_output: Owned<'a>,
    forward: ForwardCall<'a>,
    bias_sizes: Option<Vec<i64>>,
    mask: [bool; 3],
}

impl BackwardCall<'_> {
    /// The ops of the problem the asked gradients are (for counting a fallback).
    fn ops(&self) -> Vec<ConvOp> {
        let mut ops = Vec::new();
        if self.mask[0] {
            ops.push(if self.forward.transposed {
                ConvOp::Forward
            } else {
                ConvOp::BackwardData
            });
        }
        if self.mask[1] {
            ops.push(ConvOp::BackwardFilter);
        }
        ops
    }
}

/// Who a call runs for: the layer its weight or signature names, else the switch's options
/// named by the problem; `None`: nobody asked mucudnn to run it.
fn claim(runtime: &Runtime, call: &ForwardCall<'_>, weight: &TensorMeta) -> Option<Arc<Who>> {
    let geometry = call.geometry()?;
    let signature = call::signature_of(weight, &geometry)?;
    let handle = call.weight.get();
    let mut weight = CallWeight {
        identity: identity(handle),
        dtype: -1,
        data: 0,
    };
    // SAFETY: a live handle; written to locals.
    unsafe { (runtime.api.cpu.get_dtype)(handle, &mut weight.dtype) };
    weight.data = data_ptr(&runtime.api, handle).map_or(0, |p| p as usize);
    runtime.registry.claim(&weight, &signature).or_else(|| {
        let switch = runtime.registry.switch()?;
        Some(switch.who(&runtime.account, &signature, &geometry.padding))
    })
}

fn key_of(who: &Who, mapped: &Mapped, switches: Switches) -> PlanKey {
    let device = mapped.device;
    let mut problem = mapped.problem;
    if problem.dtype == DType::Fp32 && matches!(device, Device::Cuda(_)) && !switches.allow_tf32 {
        problem.math = MathMode::Fma;
    }
    PlanKey {
        config: who.config.id,
        problem,
        device,
        deterministic: switches.deterministic,
    }
}

/// Before tuning on a GPU: why it cannot happen now (the stream is being captured into a CUDA
/// graph, which a measurement's synchronisation would break), else waits for the work PyTorch
/// queued (measure on a quiet GPU).
fn before_tuning(runtime: &Runtime, who: &Who, device: Device, input: &Dims) -> Option<String> {
    let Device::Cuda(index) = device else {
        return None;
    };
    let stream = current_stream(runtime, index).ok()?;
    // SAFETY: PyTorch's current stream of that device.
    let capturing = unsafe { crate::backend::cudnn::stream_is_capturing(stream) }.unwrap_or(false);
    if capturing {
        return Some(format!(
            "{}: input shape {input} was not tuned before CUDA graph capture; run the model once \
             (a training step, to capture one) or mucudnn.torch.tune(model, example) before \
             capturing",
            who.name
        ));
    }
    if let Some(cuda) = &runtime.api.cuda {
        // SAFETY: PyTorch's current stream of that device. A failure only makes the
        // measurements noisier.
        unsafe { (cuda.synchronize)(stream, index) };
    }
    None
}

fn current_stream(runtime: &Runtime, index: i32) -> Result<*mut c_void, String> {
    let cuda = runtime.api.cuda.as_ref().ok_or("this torch has no CUDA")?;
    let mut stream: *mut c_void = std::ptr::null_mut();
    // SAFETY: the stream is written to a local.
    status(
        unsafe { (cuda.current_stream)(index, &mut stream) },
        &runtime.api,
        "current CUDA stream",
    )?;
    Ok(stream)
}

fn forward<'a>(
    runtime: &'a Runtime,
    call: &ForwardCall<'a>,
    switches: Switches,
) -> Result<Owned<'a>, String> {
    let api = &runtime.api;
    let input = meta(api, call.input.get());
    let weight = meta(api, call.weight.get());
    let who = weight.as_ref().and_then(|w| claim(runtime, call, w));
    let Some(who) = who else {
        return pytorch_forward(runtime, call);
    };
    let op = call.forward_op();
    if api.is_tracing() {
        leave_to_pytorch(runtime, &who, &[op], &Fallback::Tracing, input.as_ref())?;
        return pytorch_forward(runtime, call);
    }
    let bias = call.bias.as_ref().map(|b| meta(api, b.get()));
    let mapped = match (input, weight, call.geometry(), bias) {
        (Some(x), Some(w), Some(g), None) => call::map_forward(&x, &w, None, &g),
        (Some(x), Some(w), Some(g), Some(Some(b))) => call::map_forward(&x, &w, Some(&b), &g),
        _ => Err(Fallback::Rejected),
    };
    let mapped = match mapped {
        Ok(mapped) => mapped,
        Err(reason) => {
            leave_to_pytorch(runtime, &who, &[op], &reason, input.as_ref())?;
            return pytorch_forward(runtime, call);
        }
    };
    let key = key_of(&who, &mapped, switches);
    // SAFETY: a read of PyTorch's thread-local grad mode.
    let training = unsafe { (api.cpu.grad_mode_is_enabled)() };
    if runtime.discover(Discovered::of(&who, &key, &mapped, training)) {
        return pytorch_forward(runtime, call);
    }
    let ready = match plans_for(runtime, &who, &key, &mapped, &[op], training)? {
        Planned::Run(ready) => ready,
        Planned::PyTorch(reason) => {
            who.counters.fell_back(op, &reason);
            return pytorch_forward(runtime, call);
        }
    };
    let x_meta = input.expect("mapped");
    let w_meta = weight.expect("mapped");
    let x = packed(api, call.input.get(), &x_meta, mapped.layout)?;
    let w = packed(api, call.weight.get(), &w_meta, mapped.layout)?;
    let y = empty(
        api,
        &mapped.output,
        &mapped.output_strides,
        mapped.problem.dtype,
        key.device,
    )?;
    let (a, b) = if mapped.transposed {
        (w.pointer, x.pointer)
    } else {
        (x.pointer, w.pointer)
    };
    let out = data_ptr(api, y.get())?;
    execute(
        runtime,
        &who,
        &ready,
        op,
        &key.problem,
        key.device,
        [a, b],
        out,
    )?;
    let y = match &call.bias {
        Some(bias) => add_bias(runtime, y, bias.get(), &mapped)?,
        None => y,
    };
    who.counters.executed(op);
    Ok(y)
}

/// A claimed call mucudnn does not run: counted for `ops` with the reason, and said once per
/// name and reason on stderr where PyTorch then computes something mucudnn was asked to (not
/// where PyTorch raises its own error, nor for an empty tensor, whose trivial answer is
/// PyTorch's anyway). A problem outside what mucudnn's plans hold is an error instead under
/// `fallback=False`, as a shape no plan fits is. Under tune()'s discovery pass, where
/// PyTorch runs every call, nothing is counted or said.
fn leave_to_pytorch(
    runtime: &Runtime,
    who: &Who,
    ops: &[ConvOp],
    reason: &Fallback,
    input: Option<&TensorMeta>,
) -> Result<(), String> {
    if runtime.discovering() {
        return Ok(());
    }
    let text = reason.to_string();
    let shape = input.map_or_else(|| "?".to_string(), |m| m.sizes.to_string());
    if matches!(reason, Fallback::Unsupported(_)) && !who.config.fallback {
        return Err(format!(
            "mucudnn: {}: input shape {shape}: {text} (fallback=False: PyTorch's convolution \
             does not run in its place)",
            who.name
        ));
    }
    for &op in ops {
        who.counters.fell_back(op, &text);
    }
    let computed_by_pytorch = matches!(
        reason,
        Fallback::DType
            | Fallback::NotStrided
            | Fallback::OutputPadding
            | Fallback::Unsupported(_)
            | Fallback::Tracing
    );
    if computed_by_pytorch && who.counters.first_warning(&text) {
        eprintln!(
            "mucudnn: warning: {}: input shape {shape} runs PyTorch's convolution: {text}",
            who.name
        );
    }
    Ok(())
}

/// What the table answers a call: plans to run, or the reason PyTorch runs it.
enum Planned {
    Run(Arc<Ready>),
    PyTorch(String),
}

/// The plans of a call's ops (tuned on a miss); an error is the caller's.
fn plans_for(
    runtime: &Runtime,
    who: &Who,
    key: &PlanKey,
    mapped: &Mapped,
    needed: &[ConvOp],
    training: bool,
) -> Result<Planned, String> {
    let check = || before_tuning(runtime, who, key.device, &mapped.input);
    let request = Request {
        who,
        key: *key,
        signature: mapped.signature,
        needed,
        training,
        input: mapped.input.as_slice(),
        weight: mapped.weight.as_slice(),
        output: mapped.output.as_slice(),
        transposed: mapped.transposed,
        announce: true,
        before_tuning: Some(&check),
    };
    match runtime.plans.ready(&request) {
        Ok(ready) => Ok(Planned::Run(ready)),
        Err(Miss::Fallback(reason)) => Ok(Planned::PyTorch(reason.to_string())),
        Err(Miss::Error(message)) => Err(format!("mucudnn: {message}")),
    }
}

fn backward<'a>(
    runtime: &'a Runtime,
    call: &BackwardCall<'a>,
    switches: Switches,
) -> Result<[Owned<'a>; 3], String> {
    let api = &runtime.api;
    let forward = &call.forward;
    let input = meta(api, forward.input.get());
    let weight = meta(api, forward.weight.get());
    let grad_output = meta(api, call.grad_output.get());
    let Some(who) = weight.as_ref().and_then(|w| claim(runtime, forward, w)) else {
        return pytorch_backward(runtime, call);
    };
    if api.is_tracing() {
        leave_to_pytorch(
            runtime,
            &who,
            &call.ops(),
            &Fallback::Tracing,
            input.as_ref(),
        )?;
        return pytorch_backward(runtime, call);
    }
    let mask = OutputMask {
        input: call.mask[0],
        weight: call.mask[1],
        bias: call.mask[2],
    };
    let mapped = match (grad_output, input, weight, forward.geometry()) {
        (Some(dy), Some(x), Some(w), Some(g)) => call::map_backward(&dy, &x, &w, &g, mask),
        _ => Err(Fallback::Rejected),
    };
    let fall_back = |reason: &str| {
        for op in call.ops() {
            who.counters.fell_back(op, reason);
        }
        pytorch_backward(runtime, call)
    };
    let (mapped, jobs) = match mapped {
        Ok(mapped) => mapped,
        Err(reason) => {
            leave_to_pytorch(runtime, &who, &call.ops(), &reason, input.as_ref())?;
            return pytorch_backward(runtime, call);
        }
    };
    if mask.bias && call.bias_sizes.as_deref() != Some(&[mapped.output[1]][..]) {
        return fall_back(&Fallback::Rejected.to_string());
    }
    let key = key_of(&who, &mapped, switches);
    let needed: Vec<ConvOp> = jobs.iter().map(|job| job.op).collect();
    if runtime.discover(Discovered::of(&who, &key, &mapped, true)) {
        return pytorch_backward(runtime, call);
    }
    let ready = if needed.is_empty() {
        None
    } else {
        match plans_for(runtime, &who, &key, &mapped, &needed, true)? {
            Planned::Run(ready) => Some(ready),
            Planned::PyTorch(reason) => return fall_back(&reason),
        }
    };
    let metas = |operand: Operand| match operand {
        Operand::GradOutput => (call.grad_output.get(), grad_output.expect("mapped")),
        Operand::Input => (forward.input.get(), input.expect("mapped")),
        Operand::Weight => (forward.weight.get(), weight.expect("mapped")),
    };
    let mut outputs: [Option<Owned<'a>>; 3] = [None, None, None];
    for job in &jobs {
        let ready = ready.as_ref().expect("jobs have plans");
        let GradientJob { op, a, b, output } = *job;
        let (a_tensor, a_meta) = metas(a);
        let (b_tensor, b_meta) = metas(b);
        let a = packed(api, a_tensor, &a_meta, mapped.layout)?;
        let b = packed(api, b_tensor, &b_meta, mapped.layout)?;
        let (_, out_meta) = metas(output);
        let strides = call::packed_strides(&out_meta.sizes, mapped.layout);
        let out = empty(
            api,
            &out_meta.sizes,
            &strides,
            mapped.problem.dtype,
            key.device,
        )?;
        let pointer = data_ptr(api, out.get())?;
        execute(
            runtime,
            &who,
            ready,
            op,
            &key.problem,
            key.device,
            [a.pointer, b.pointer],
            pointer,
        )?;
        who.counters.executed(op);
        let slot = if output == Operand::Input { 0 } else { 1 };
        outputs[slot] = Some(out);
    }
    if mask.bias {
        outputs[2] = Some(bias_gradient(
            runtime,
            call.grad_output.get(),
            &mapped,
            &grad_output.expect("mapped"),
        )?);
    }
    let [gi, gw, gb] = outputs;
    Ok([
        gi.map_or_else(|| undefined(api), Ok)?,
        gw.map_or_else(|| undefined(api), Ok)?,
        gb.map_or_else(|| undefined(api), Ok)?,
    ])
}

// ---------------------------------------------------------------------------------------------
// Running plans

/// The caller's operand extents of `op` (each role's dims and bytes), which the tuner checks
/// against the plan before it reads a pointer.
fn extents(problem: &ConvProblem, op: ConvOp) -> [OperandExtent; 3] {
    let element = problem.dtype.size_bytes() as u64;
    operand_roles(op).map(|role| {
        let dims = role.dims(problem);
        let elements = dims.iter().product::<i64>().max(0) as u64;
        OperandExtent {
            dims,
            bytes: elements * element,
        }
    })
}

#[allow(clippy::too_many_arguments)]
fn execute(
    runtime: &Runtime,
    who: &Who,
    ready: &Ready,
    op: ConvOp,
    problem: &ConvProblem,
    device: Device,
    [a, b]: [*mut c_void; 2],
    out: *mut c_void,
) -> Result<(), String> {
    let extents = extents(problem, op);
    let operands = RawOperands {
        alpha: 1.0,
        a: a.cast_const(),
        b: b.cast_const(),
        beta: 0.0,
        out,
    };
    let needed = ready.workspace[op_index(op)];
    let context = |e: crate::c_abi::error::FfiError| {
        format!("mucudnn: {}: {} {op}: {e}", who.name, problem.describe())
    };
    match device {
        Device::Cuda(index) => {
            let cuda = runtime.api.cuda.as_ref().ok_or("this torch has no CUDA")?;
            let guard = CudaGuard::new(&runtime.api, index)?;
            let stream = current_stream(runtime, index)?;
            let mut workspace: *mut c_void = std::ptr::null_mut();
            if needed > 0 {
                // SAFETY: the pointer is written to a local; freed below.
                status(
                    unsafe { (cuda.raw_alloc)(needed, &mut workspace) },
                    &runtime.api,
                    "workspace allocation",
                )?;
            }
            let result = {
                let mut state = ready.tuner.lock();
                // SAFETY: device pointers of the call's tensors (packed, of the plan's problem,
                // alive until the call returns and kept by PyTorch's allocator until the
                // stream's work is done), the workspace from PyTorch's allocator on this
                // stream, and PyTorch's current stream of this device.
                unsafe {
                    state.tuner.execute(
                        ready.id,
                        op,
                        operands,
                        &extents,
                        CallerWorkspace {
                            pointer: workspace,
                            bytes: needed,
                        },
                        stream,
                    )
                }
            };
            if !workspace.is_null() {
                // Freed to the allocator's cache of this stream: reused only by later work.
                // SAFETY: allocated above.
                unsafe { (cuda.raw_delete)(workspace) };
            }
            drop(guard);
            result.map_err(context)
        }
        _ => {
            let mut state = ready.tuner.lock();
            // SAFETY: host pointers of the call's packed tensors, of the plan's problem
            // (checked against `extents`), the output distinct from the inputs (a new
            // tensor); no workspace given: the tuner runs on its own one, grown to its largest
            // plan's.
            unsafe {
                state.tuner.execute(
                    ready.id,
                    op,
                    operands,
                    &extents,
                    CallerWorkspace {
                        pointer: std::ptr::null_mut(),
                        bytes: 0,
                    },
                    std::ptr::null_mut(),
                )
            }
            .map_err(context)
        }
    }
}

/// PyTorch's current CUDA device set to `index` for the call (restored on drop).
struct CudaGuard<'a> {
    api: &'a TorchApi,
    guard: *mut c_void,
}

impl<'a> CudaGuard<'a> {
    fn new(api: &'a TorchApi, index: i32) -> Result<Self, String> {
        let cuda = api.cuda.as_ref().ok_or("this torch has no CUDA")?;
        let mut guard: *mut c_void = std::ptr::null_mut();
        // SAFETY: the guard is written to a local, deleted on drop.
        status(
            unsafe { (cuda.create_guard)(index, &mut guard) },
            api,
            "CUDA device guard",
        )?;
        Ok(CudaGuard { api, guard })
    }
}

impl Drop for CudaGuard<'_> {
    fn drop(&mut self) {
        if let Some(cuda) = &self.api.cuda {
            // SAFETY: made by `new`, deleted once.
            unsafe { (cuda.delete_guard)(self.guard) };
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Bias

/// `y + bias` over the channels (in place on the CPU; a new tensor from PyTorch on a GPU).
fn add_bias<'a>(
    runtime: &'a Runtime,
    y: Owned<'a>,
    bias: Ath,
    mapped: &Mapped,
) -> Result<Owned<'a>, String> {
    let api = &runtime.api;
    let channels = mapped.output[1];
    match mapped.device {
        Device::Cuda(_) => {
            let cuda = api.cuda.as_ref().ok_or("this torch has no CUDA")?;
            let view = channel_view(api, bias, mapped.output.len())?;
            let mut sum: Ath = std::ptr::null_mut();
            // SAFETY: two live tensors that broadcast; the result is written to a local.
            status(
                unsafe { (cuda.add)(y.get(), view.get(), 1.0, &mut sum) },
                api,
                "add",
            )?;
            Ok(Owned::new(api, sum))
        }
        _ => {
            let bias_meta = meta(api, bias).ok_or("an unreadable bias")?;
            let b = packed(api, bias, &bias_meta, Layout::Nchw)?;
            let out = data_ptr(api, y.get())?;
            let pixels: i64 = mapped.output.as_slice()[2..].iter().product();
            let shape = BiasShape {
                batch: mapped.output[0] as usize,
                channels: channels as usize,
                pixels: pixels as usize,
                channels_last: mapped.layout == Layout::Nhwc,
            };
            // SAFETY: `out` holds the packed output (n x k x pixels elements of the dtype,
            // written by the plan), `b` the packed bias of k elements.
            unsafe {
                match mapped.problem.dtype {
                    DType::Fp32 => shape.add::<f32>(out, b.pointer),
                    DType::Fp16 => shape.add::<half::f16>(out, b.pointer),
                    DType::Bf16 => shape.add::<half::bf16>(out, b.pointer),
                }
            }
            Ok(y)
        }
    }
}

/// A view of a 1-D per-channel tensor as `1 x k x 1 ...` of `rank` dims.
fn channel_view<'a>(api: &'a TorchApi, bias: Ath, rank: usize) -> Result<Owned<'a>, String> {
    let bias_meta = meta(api, bias).ok_or("an unreadable bias")?;
    let mut offset = 0i64;
    // SAFETY: a live handle; written to a local.
    status(
        unsafe { (api.cpu.get_storage_offset)(bias, &mut offset) },
        api,
        "storage_offset",
    )?;
    let mut sizes = [1i64; 5];
    let mut strides = [0i64; 5];
    sizes[1] = bias_meta.sizes[0];
    strides[1] = bias_meta.strides[0];
    let mut view: Ath = std::ptr::null_mut();
    // SAFETY: a view within the bias's storage (its own elements); written to a local.
    let code = unsafe {
        (api.cpu.reinterpret)(
            bias,
            rank as i64,
            sizes.as_ptr(),
            strides.as_ptr(),
            offset,
            &mut view,
        )
    };
    status(code, api, "a view of the bias")?;
    Ok(Owned::new(api, view))
}

/// The layout of a packed output for the per-channel bias and its gradient.
struct BiasShape {
    batch: usize,
    channels: usize,
    pixels: usize,
    channels_last: bool,
}

impl BiasShape {
    /// The flat index of (sample, channel, pixel).
    fn index(&self, n: usize, c: usize, p: usize) -> usize {
        if self.channels_last {
            (n * self.pixels + p) * self.channels + c
        } else {
            (n * self.channels + c) * self.pixels + p
        }
    }

    /// # Safety
    ///
    /// `out` holds `batch * channels * pixels` elements of `T` in this layout, `bias`
    /// `channels` elements.
    unsafe fn add<T: Element>(&self, out: *mut c_void, bias: *mut c_void) {
        let total = self.batch * self.channels * self.pixels;
        // SAFETY: the caller's contract.
        let (out, bias) = unsafe {
            (
                std::slice::from_raw_parts_mut(out.cast::<T>(), total),
                std::slice::from_raw_parts(bias.cast::<T>(), self.channels),
            )
        };
        for n in 0..self.batch {
            for (c, b) in bias.iter().enumerate() {
                let b = b.to_f32();
                for p in 0..self.pixels {
                    let i = self.index(n, c, p);
                    out[i] = T::from_f32(out[i].to_f32() + b);
                }
            }
        }
    }

    /// Per channel, the sum over samples and pixels (in f64, rounded once).
    ///
    /// # Safety
    ///
    /// As for `add`, with `sums` holding `channels` elements.
    unsafe fn sum<T: Element>(&self, dy: *mut c_void, sums: *mut c_void) {
        let total = self.batch * self.channels * self.pixels;
        // SAFETY: the caller's contract.
        let (dy, sums) = unsafe {
            (
                std::slice::from_raw_parts(dy.cast::<T>(), total),
                std::slice::from_raw_parts_mut(sums.cast::<T>(), self.channels),
            )
        };
        for (c, sum) in sums.iter_mut().enumerate() {
            let mut total = 0f64;
            for n in 0..self.batch {
                for p in 0..self.pixels {
                    total += f64::from(dy[self.index(n, c, p)].to_f32());
                }
            }
            *sum = T::from_f32(total as f32);
        }
    }
}

/// The bias gradient: `grad_output` summed over every dim but the channels'.
fn bias_gradient<'a>(
    runtime: &'a Runtime,
    grad_output: Ath,
    mapped: &Mapped,
    dy_meta: &TensorMeta,
) -> Result<Owned<'a>, String> {
    let api = &runtime.api;
    let channels = mapped.output[1];
    let dtype = mapped.problem.dtype;
    match mapped.device {
        Device::Cuda(_) => dispatch_sum(api, grad_output, mapped.output.len()),
        _ => {
            let dy = packed(api, grad_output, dy_meta, mapped.layout)?;
            let sizes = Dims::new(&[channels]).expect("one dim");
            let strides = Dims::new(&[1]).expect("one dim");
            let out = empty(api, &sizes, &strides, dtype, Device::Cpu)?;
            let pixels: i64 = mapped.output.as_slice()[2..].iter().product();
            let shape = BiasShape {
                batch: mapped.output[0] as usize,
                channels: channels as usize,
                pixels: pixels as usize,
                channels_last: mapped.layout == Layout::Nhwc,
            };
            let sums = data_ptr(api, out.get())?;
            // SAFETY: the packed dy of the output's sizes, and a new tensor of k elements.
            unsafe {
                match dtype {
                    DType::Fp32 => shape.sum::<f32>(dy.pointer, sums),
                    DType::Fp16 => shape.sum::<half::f16>(dy.pointer, sums),
                    DType::Bf16 => shape.sum::<half::bf16>(dy.pointer, sums),
                }
            }
            Ok(out)
        }
    }
}

/// `aten::sum(t, dims, keepdim=False)` over every dim but 1, through the dispatcher (on a
/// GPU: PyTorch's reduction on its current stream).
fn dispatch_sum<'a>(api: &'a TorchApi, tensor: Ath, rank: usize) -> Result<Owned<'a>, String> {
    let mut handle: Ath = std::ptr::null_mut();
    // SAFETY: a new handle of a live tensor, handed to the dispatcher below.
    status(
        unsafe { (api.cpu.new_tensor_handle)(tensor, &mut handle) },
        api,
        "a tensor handle",
    )?;
    let mut list: *mut c_void = std::ptr::null_mut();
    // SAFETY: a new list, handed to the dispatcher (which frees it).
    unsafe {
        status((api.cpu.new_list)(rank - 1, &mut list), api, "a list")?;
        for dim in std::iter::once(0).chain(2..rank) {
            (api.cpu.list_push)(list, dim as Siv);
        }
    }
    let boxed = api
        .new_box(list as usize as Siv)
        .ok_or("cannot box an argument")?;
    let mut stack: [Siv; 4] = [handle as usize as Siv, boxed as usize as Siv, 0, 0];
    // SAFETY: `aten::sum.dim_IntList(Tensor self, int[1]? dim, bool keepdim, *, ScalarType?
    // dtype)`: four values, the handle, list and box consumed by the call; one return.
    let code = unsafe {
        (api.cpu.call_dispatcher)(
            c"aten::sum".as_ptr(),
            c"dim_IntList".as_ptr(),
            stack.as_mut_ptr(),
            super::api::EXTENSION_VERSION,
        )
    };
    status(code, api, "sum")?;
    Ok(Owned::new(api, stack[0] as usize as Ath))
}

// ---------------------------------------------------------------------------------------------
// PyTorch's own kernels

fn pytorch_forward<'a>(runtime: &'a Runtime, call: &ForwardCall<'a>) -> Result<Owned<'a>, String> {
    let api = &runtime.api;
    let device = meta(api, call.input.get()).map(|m| m.device);
    let kernel = match device {
        Some(Device::Cuda(_)) => api
            .cuda
            .as_ref()
            .map(|c| c.convolution)
            .ok_or("this torch has no CUDA")?,
        _ => api.cpu.cpu_convolution,
    };
    let mut bias = call.bias.as_ref().map(Owned::get);
    let bias_pointer = bias
        .as_mut()
        .map_or(std::ptr::null_mut(), |b| b as *mut Ath);
    let run = || {
        let mut out: Ath = std::ptr::null_mut();
        // SAFETY: the call's own arguments, borrowed; the result is written to a local.
        let code = unsafe {
            kernel(
                call.input.get(),
                call.weight.get(),
                bias_pointer,
                call.stride.as_ptr(),
                call.stride.len() as i64,
                call.padding.as_ptr(),
                call.padding.len() as i64,
                call.dilation.as_ptr(),
                call.dilation.len() as i64,
                i32::from(call.transposed),
                call.output_padding.as_ptr(),
                call.output_padding.len() as i64,
                call.groups,
                &mut out,
            )
        };
        (code, Owned::new(api, out))
    };
    pytorch_call(api, "convolution", run)
}

/// Runs one of PyTorch's own kernels through its C shim (`run` gives the shim's code and what
/// it wrote) and gives its results, or PyTorch's message: read from the interface where this
/// torch keeps it, else from what its shim logged during a second call ([`logged`]).
fn pytorch_call<T>(
    api: &TorchApi,
    what: &str,
    run: impl Fn() -> (TorchError, T),
) -> Result<T, String> {
    let (code, out) = run();
    if code == 0 || api.exception_message.is_some() {
        status(code, api, what)?;
        return Ok(out);
    }
    drop(out);
    let ((code, out), logged) = logged::capture(run);
    if code != 0 {
        return Err(logged.unwrap_or_else(|| format!("PyTorch's {what} failed")));
    }
    Ok(out)
}

fn pytorch_backward<'a>(
    runtime: &'a Runtime,
    call: &BackwardCall<'a>,
) -> Result<[Owned<'a>; 3], String> {
    let api = &runtime.api;
    let forward = &call.forward;
    let device = meta(api, forward.input.get()).map(|m| m.device);
    let kernel = match device {
        Some(Device::Cuda(_)) => api
            .cuda
            .as_ref()
            .map(|c| c.convolution_backward)
            .ok_or("this torch has no CUDA")?,
        _ => api.cpu.cpu_convolution_backward,
    };
    let bias_sizes = call.bias_sizes.as_ref().map(|v| v.as_ptr());
    let bias_pointer = bias_sizes
        .as_ref()
        .map_or(std::ptr::null(), |p| p as *const *const i64);
    let mask = call.mask.map(i32::from);
    let run = || {
        let mut outs: [Ath; 3] = [std::ptr::null_mut(); 3];
        let [o0, o1, o2] = &mut outs;
        // SAFETY: the call's own arguments, borrowed; the results are written to locals.
        let code = unsafe {
            kernel(
                call.grad_output.get(),
                forward.input.get(),
                forward.weight.get(),
                bias_pointer,
                call.bias_sizes.as_ref().map_or(0, |v| v.len() as i64),
                forward.stride.as_ptr(),
                forward.stride.len() as i64,
                forward.padding.as_ptr(),
                forward.padding.len() as i64,
                forward.dilation.as_ptr(),
                forward.dilation.len() as i64,
                i32::from(forward.transposed),
                forward.output_padding.as_ptr(),
                forward.output_padding.len() as i64,
                forward.groups,
                mask.as_ptr(),
                3,
                o0,
                o1,
                o2,
            )
        };
        (code, outs.map(|h| Owned::new(api, h)))
    };
    let [a, b, c] = pytorch_call(api, "convolution_backward", run)?;
    let fix = |o: Owned<'a>| {
        if o.get().is_null() {
            undefined(api)
        } else {
            Ok(o)
        }
    };
    Ok([fix(a)?, fix(b)?, fix(c)?])
}
