//! Every tuner call that binds the GPU's context gives the caller's current
//! context back (create, tune, prepare, execute, release, destroy), as a C caller or PyTorch
//! (its current device is the current context) expects. The guard's logic is tested on the CPU
//! in `src/backend/cudnn/wall/context.rs`; these need a GPU.
//!
//! PyTorch's case is a forward on `cuda:1` while `cuda:0` is current, which needs two GPUs
//! (`the_callers_device_stays_current_across_gpus`). With one GPU the same restore is checked
//! with no context current at all: afterwards there must still be none, not the GPU's primary
//! context.
//!
//! The tests call the driver themselves (to set and read the current context), so they call
//! `cuInit` first, as the driver requires of every process: cudarc's raw `result` layer does
//! not, and the driver answers CUDA_ERROR_NOT_INITIALIZED before it. The cuDNN host tier
//! (`MUCUDNN_CUDNN_HOST_TESTS=1`, docs/cudnn_host.md) runs the one-GPU tests against its stub
//! libcuda, which keeps that state machine: there `cuInit` finds no device, and each test runs
//! its driver calls up to the tuner's creation, which must fail for want of a device (not for a
//! call out of order) and leave the caller's context (none) current.

use cudarc::driver::result::{ctx, device, primary_ctx};
use cudarc::driver::sys::CUresult;
use cudarc::driver::{CudaContext, DevicePtr, DevicePtrMut};
use mucudnn::backend::cudnn::host::{random_values, reference_convolution};
use mucudnn::c_abi::*;
use mucudnn::solver::ConvOp;
use std::ffi::{c_char, c_void, CStr, CString};
use std::ptr::null_mut;

fn c(text: &str) -> CString {
    CString::new(text).unwrap()
}

/// `Ok` for MUCUDNN_STATUS_SUCCESS, else the status and mucudnn's last error.
fn status(status: mucudnnStatus_t) -> Result<(), String> {
    if status == mucudnnStatus_t::MUCUDNN_STATUS_SUCCESS {
        return Ok(());
    }
    let message = mucudnnGetLastError();
    let text = if message.is_null() {
        String::new()
    } else {
        // SAFETY: mucudnn's last error is a NUL-terminated string.
        unsafe { CStr::from_ptr(message) }
            .to_string_lossy()
            .into_owned()
    };
    Err(format!("{status:?}: {text}"))
}

fn check(result: mucudnnStatus_t) {
    if let Err(e) = status(result) {
        panic!("{e}");
    }
}

/// What the GPU tests run against.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Driver {
    /// A driver with a GPU.
    Gpu,
    /// The cuDNN host tier's stub libcuda: initialised, no device.
    Stub,
}

/// Initialises the CUDA driver, which every process must do before any other driver call
/// (cudarc's `result` layer does not do it for us). On the host tier's stub the driver finds
/// no device; anywhere else a failure fails the test, naming what it needs.
fn init_driver() -> Driver {
    match cudarc::driver::result::init() {
        Ok(()) => Driver::Gpu,
        Err(e)
            if e.0 == CUresult::CUDA_ERROR_NO_DEVICE
                && std::env::var("MUCUDNN_CUDNN_HOST_TESTS").as_deref() == Ok("1") =>
        {
            Driver::Stub
        }
        Err(e) => panic!(
            "cuInit failed ({e:?}): this test needs a GPU, or the cuDNN host tier's stub libcuda \
             with MUCUDNN_CUDNN_HOST_TESTS=1 (docs/cudnn_host.md)"
        ),
    }
}

fn take(text: *mut c_char) -> String {
    // SAFETY: a live string from mucudnn, freed once right after.
    let copy = unsafe { CStr::from_ptr(text) }
        .to_string_lossy()
        .into_owned();
    // SAFETY: as above.
    unsafe { mucudnnFreeString(text) };
    copy
}

/// The current context (None: no context is current).
fn current() -> Option<usize> {
    ctx::get_current().unwrap().map(|c| c as usize)
}

/// The small problem every test here tunes, and its host data (non-zero, so a result of zeros
/// or of the wrong operands shows).
const PROBLEM: &str = r#"{"n": 4, "c": 8, "h": 8, "w": 8, "k": 8, "r": 3, "s": 3, "pad_h": 1, "pad_w": 1,
    "stride_h": 1, "stride_w": 1, "dilation_h": 1, "dilation_w": 1, "groups": 1,
    "dtype": "fp32", "layout": "nchw", "math": "fma"}"#;

fn problem() -> mucudnn::solver::ConvProblem {
    use mucudnn::solver::{ConvProblem, MathMode};
    ConvProblem {
        pad_h: 1,
        pad_w: 1,
        math: MathMode::Fma,
        ..ConvProblem::new(4, 8, 8, 8, 8, 3, 3)
    }
}

/// Host operands of the forward op: x, w (random, non-zero) and y's length.
fn host_operands() -> (Vec<f32>, Vec<f32>, usize) {
    let p = problem();
    let x = random_values(p.dtype, (p.n * p.c * p.h * p.w) as usize, 1);
    let w = random_values(p.dtype, (p.k * p.c * p.r * p.s) as usize, 2);
    (x, w, (p.n * p.k * p.h * p.w) as usize)
}

/// Fails unless `y` is the forward of `x` and `w` (fp32 FMA: rounding only).
fn check_forward(x: &[f32], w: &[f32], y: &[f32]) {
    let reference = reference_convolution(&problem(), ConvOp::Forward, x, w).unwrap();
    let err = reference.max_relative_error(y);
    assert!(
        err < 1e-4,
        "forward through the C ABI: relative error {err}"
    );
}

/// The forward's `operand_dims` and `operand_bytes` as ABI v2's `mucudnnTunerExecute` reads
/// them: N, C, D, H, W of x, of w (K, C, T, R, S) and of y; D = T = 1 for a 2-D problem. The
/// CPU twin and the GPU tests share this, so a change of the ABI that the GPU-only tests would
/// miss fails the twin in CI.
fn forward_operands() -> ([i64; 15], [u64; 3]) {
    let p = problem();
    let dims = [
        p.n, p.c, 1, p.h, p.w, // x
        p.k, p.c, 1, p.r, p.s, // w
        p.n, p.k, 1, p.h, p.w, // y (stride 1, "same" padding)
    ];
    let elements = |d: &[i64]| d.iter().product::<i64>() as u64;
    let bytes = [
        elements(&dims[0..5]) * 4,
        elements(&dims[5..10]) * 4,
        elements(&dims[10..15]) * 4,
    ];
    (dims, bytes)
}

/// Makes a tuner on `device` (`around` runs before and after the call, as in [`tuned`]).
fn create(device: i32, around: &dyn Fn(Option<&str>)) -> Result<mucudnnTuner_t, String> {
    let mut tuner: mucudnnTuner_t = null_mut();
    around(None);
    // SAFETY: valid out pointer and options string.
    let created = status(unsafe {
        mucudnnTunerCreate(&mut tuner, device, c(r#"{"no_cache": true}"#).as_ptr())
    });
    around(Some("mucudnnTunerCreate"));
    created.map(|()| tuner)
}

/// `tuner` with the problem tuned (the forward alone, one undivided plan of at most 8 engine
/// configurations: two fresh processes tune, and the step that runs them has a cap) and its
/// forward prepared: the plan set and its forward workspace bytes. `around(what)` runs before
/// and after every call (`what` is the call just made, `None` before it).
fn tuned(tuner: mucudnnTuner_t, candidates: &str, around: &dyn Fn(Option<&str>)) -> (u64, u64) {
    let mut out: *mut c_char = null_mut();
    around(None);
    // SAFETY: a live tuner, valid strings and out pointer.
    check(unsafe {
        mucudnnTunerTune(
            tuner,
            c("ctx").as_ptr(),
            c(PROBLEM).as_ptr(),
            c(&format!(
                r#"{{"workspace_limit": "8MiB", "ops": ["fwd"], "candidates": "{candidates}",
                    "policy": "undivided", "max_candidates": 8}}"#
            ))
            .as_ptr(),
            &mut out,
        )
    });
    around(Some("mucudnnTunerTune"));
    let tuned: serde_json::Value = serde_json::from_str(&take(out)).unwrap();
    let plans = tuned["plans"].to_string();
    let (mut id, mut workspace) = (0u64, [0u64; 3]);
    around(None);
    // SAFETY: as above; `workspace` holds three u64s.
    check(unsafe {
        mucudnnTunerPrepare(tuner, c(&plans).as_ptr(), &mut id, workspace.as_mut_ptr())
    });
    around(Some("mucudnnTunerPrepare"));
    (id, workspace[0])
}

/// The forward of the prepared set `id` over `x`, `w` and `y` (host or device pointers, as
/// the tuner's device has them), with `forward_operands`' dims and bytes.
///
/// # Safety
///
/// The pointers hold the problem's operands on the tuner's device (`workspace` at least
/// `workspace_bytes`, or NULL with 0), and `stream` is NULL or a live stream of the tuner's
/// GPU; they stay valid until the work queued has finished.
unsafe fn execute_forward(
    tuner: mucudnnTuner_t,
    id: u64,
    [x, w, y]: [*mut c_void; 3],
    workspace: *mut c_void,
    workspace_bytes: u64,
    stream: mucudnnStream_t,
) -> mucudnnStatus_t {
    let (dims, bytes) = forward_operands();
    // SAFETY: this function's contract; `dims` holds 15 values and `bytes` 3, as the ABI reads.
    unsafe {
        mucudnnTunerExecute(
            tuner,
            id,
            MUCUDNN_OP_FORWARD,
            1.0,
            x,
            w,
            0.0,
            y,
            dims.as_ptr(),
            bytes.as_ptr(),
            workspace,
            workspace_bytes,
            stream,
        )
    }
}

/// Tunes a small conv on `ordinal` and runs its forward with `caller` current before each
/// call, asserting that `caller` is current after each, and that the result is right.
/// `candidates` as the settings name them ("all", "legacy", "engines"): with "engines" the
/// plans hold graph-API execution plans, whose destruction binds the GPU's context. On the
/// host tier's stub (`driver`), the tuner's creation must fail for want of a device.
fn run_with_current(
    driver: Driver,
    ordinal: usize,
    caller: cudarc::driver::sys::CUcontext,
    candidates: &str,
) {
    let set = |context| {
        // SAFETY: `context` is null (unbind) or a live context.
        unsafe { ctx::set_current(context) }.unwrap()
    };
    let around = |what: Option<&str>| match what {
        None => set(caller),
        Some(what) => {
            let want = if caller.is_null() {
                None
            } else {
                Some(caller as usize)
            };
            assert_eq!(
                current(),
                want,
                "after {what}, the caller's context is not current"
            );
        }
    };
    let tuner = match (driver, create(ordinal as i32, &around)) {
        (Driver::Gpu, Ok(tuner)) => tuner,
        (Driver::Gpu, Err(e)) => panic!("mucudnnTunerCreate: {e}"),
        (Driver::Stub, Err(e)) => {
            assert!(
                e.contains("CUDA_ERROR_NO_DEVICE"),
                "on the stub libcuda a tuner fails for want of a device, not with: {e}"
            );
            println!("the stub libcuda: driver calls in order; mucudnnTunerCreate: {e}");
            return;
        }
        (Driver::Stub, Ok(_)) => panic!("a CUDA tuner was made on the stub libcuda"),
    };
    let (id, workspace_bytes) = tuned(tuner, candidates, &around);

    let gpu = CudaContext::new(ordinal).unwrap();
    let stream = gpu.new_stream().unwrap();
    let (x_host, w_host, y_len) = host_operands();
    let x = stream.clone_htod(&x_host).unwrap();
    let w = stream.clone_htod(&w_host).unwrap();
    let mut y = stream.alloc_zeros::<f32>(y_len).unwrap();
    let mut space = stream
        .alloc_zeros::<u8>(workspace_bytes.max(1) as usize)
        .unwrap();
    {
        let (xp, _a) = x.device_ptr(&stream);
        let (wp, _b) = w.device_ptr(&stream);
        let (yp, _c) = y.device_ptr_mut(&stream);
        let (sp, _d) = space.device_ptr_mut(&stream);
        set(caller);
        // SAFETY: device buffers of the tuner's GPU with the problem's element counts, live
        // until the stream is synchronised below; a live stream of the primary context.
        check(unsafe {
            execute_forward(
                tuner,
                id,
                [xp as *mut c_void, wp as *mut c_void, yp as *mut c_void],
                sp as *mut c_void,
                workspace_bytes,
                stream.cu_stream() as *mut _,
            )
        });
        around(Some("mucudnnTunerExecute"));
    }
    let y_host = stream.clone_dtoh(&y).unwrap();
    stream.synchronize().unwrap();
    check_forward(&x_host, &w_host, &y_host);
    set(caller);
    check(mucudnnTunerRelease(tuner, id));
    around(Some("mucudnnTunerRelease"));
    set(caller);
    check(mucudnnTunerDestroy(tuner));
    around(Some("mucudnnTunerDestroy"));
}

/// The GPU tests' C ABI calls on the CPU backend (device -1, host pointers): the same problem,
/// settings, dims and bytes, so CI runs what the GPU-only tests pass to the ABI.
#[test]
fn cpu_twin_of_the_context_tests_runs_the_same_calls() {
    let tuner = create(MUCUDNN_DEVICE_CPU, &|_| {}).unwrap();
    let (id, workspace_bytes) = tuned(tuner, "all", &|_| {});
    let (mut x, mut w, y_len) = host_operands();
    let mut y = vec![f32::NAN; y_len];
    // Host workspace: 4-byte aligned, as the ABI asks of a CPU tuner's.
    let mut space = vec![0f32; (workspace_bytes as usize).div_ceil(4).max(1)];
    // SAFETY: host buffers with the problem's element counts and the prepared workspace,
    // live across the (synchronous, on the CPU) call.
    check(unsafe {
        execute_forward(
            tuner,
            id,
            [
                x.as_mut_ptr().cast(),
                w.as_mut_ptr().cast(),
                y.as_mut_ptr().cast(),
            ],
            space.as_mut_ptr().cast(),
            workspace_bytes,
            null_mut(),
        )
    });
    check_forward(&x, &w, &y);
    // One dim off is refused (the ABI checks the operands against the plan).
    let (mut dims, bytes) = forward_operands();
    dims[14] += 1;
    // SAFETY: as above; 15 dims and 3 byte counts.
    let refused = unsafe {
        mucudnnTunerExecute(
            tuner,
            id,
            MUCUDNN_OP_FORWARD,
            1.0,
            x.as_ptr().cast(),
            w.as_ptr().cast(),
            0.0,
            y.as_mut_ptr().cast(),
            dims.as_ptr(),
            bytes.as_ptr(),
            space.as_mut_ptr().cast(),
            workspace_bytes,
            null_mut(),
        )
    };
    assert_ne!(refused, mucudnnStatus_t::MUCUDNN_STATUS_SUCCESS);
    check(mucudnnTunerRelease(tuner, id));
    check(mucudnnTunerDestroy(tuner));
}

#[test]
#[ignore = "needs a GPU: a CUDA tuner binds device 0's context and must unbind it again"]
fn no_current_context_stays_none() {
    run_with_current(init_driver(), 0, null_mut(), "all");
}

#[test]
#[ignore = "needs a GPU: engine plans bind device 0's context to be destroyed and must unbind it"]
fn engine_plans_are_destroyed_in_the_callers_context() {
    run_with_current(init_driver(), 0, null_mut(), "engines");
}

#[test]
#[ignore = "needs two GPUs: a forward on device 1 while device 0's context is current"]
fn the_callers_device_stays_current_across_gpus() {
    let driver = init_driver();
    let count = device::get_count().unwrap();
    assert!(count >= 2, "this test needs two GPUs, found {count}");
    let zero = device::get(0).unwrap();
    // SAFETY: a valid device; the retained primary context is released below.
    let caller = unsafe { primary_ctx::retain(zero) }.unwrap();
    run_with_current(driver, 1, caller, "all");
    // SAFETY: retained above.
    unsafe { primary_ctx::release(zero) }.unwrap();
}
