//! Issue 21, item 6: every tuner call that binds the GPU's context gives the caller's current
//! context back (create, tune, prepare, execute, release, destroy), as a C caller or PyTorch
//! (its current device is the current context) expects. The guard's logic is tested on the CPU
//! in `src/backend/cudnn/ffi/context.rs`; these need a GPU.
//!
//! PyTorch's case is a forward on `cuda:1` while `cuda:0` is current, which needs two GPUs
//! (`the_callers_device_stays_current_across_gpus`). With one GPU the same restore is checked
//! with no context current at all: afterwards there must still be none, not the GPU's primary
//! context.

use cudarc::driver::result::{ctx, device, primary_ctx};
use cudarc::driver::{CudaContext, DevicePtr, DevicePtrMut};
use mucudnn::ffi::*;
use std::ffi::{c_char, c_void, CStr, CString};
use std::ptr::null_mut;

fn c(text: &str) -> CString {
    CString::new(text).unwrap()
}

fn check(status: mucudnnStatus_t) {
    if status != mucudnnStatus_t::MUCUDNN_STATUS_SUCCESS {
        // SAFETY: mucudnn's last error is a NUL-terminated string (or NULL).
        let message = mucudnnGetLastError();
        let text = if message.is_null() {
            String::new()
        } else {
            // SAFETY: as above.
            unsafe { CStr::from_ptr(message) }
                .to_string_lossy()
                .into_owned()
        };
        panic!("{status:?}: {text}");
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

/// Tunes a small conv on `ordinal` and runs its three ops with `caller` current before each
/// call, asserting that `caller` is current after each.
fn run_with_current(ordinal: usize, caller: cudarc::driver::sys::CUcontext) {
    let set = |context| {
        // SAFETY: `context` is null (unbind) or a live context.
        unsafe { ctx::set_current(context) }.unwrap()
    };
    let expect = |what: &str| {
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
    };
    set(caller);
    let mut tuner: mucudnnTuner_t = null_mut();
    // SAFETY: valid out pointer and options string.
    check(unsafe {
        mucudnnTunerCreate(
            &mut tuner,
            ordinal as i32,
            c(r#"{"no_cache": true}"#).as_ptr(),
        )
    });
    expect("mucudnnTunerCreate");
    let problem = r#"{"n": 4, "c": 8, "h": 8, "w": 8, "k": 8, "r": 3, "s": 3, "pad_h": 1, "pad_w": 1,
        "stride_h": 1, "stride_w": 1, "dilation_h": 1, "dilation_w": 1, "groups": 1,
        "dtype": "fp32", "layout": "nchw"}"#;
    let mut out: *mut c_char = null_mut();
    set(caller);
    // SAFETY: a live tuner, valid strings and out pointer.
    check(unsafe {
        mucudnnTunerTune(
            tuner,
            c("ctx").as_ptr(),
            c(problem).as_ptr(),
            c(r#"{"workspace_limit": "8MiB"}"#).as_ptr(),
            &mut out,
        )
    });
    expect("mucudnnTunerTune");
    let tuned: serde_json::Value = serde_json::from_str(&take(out)).unwrap();
    let plans = tuned["plans"].to_string();
    let (mut id, mut workspace) = (0u64, [0u64; 3]);
    set(caller);
    // SAFETY: as above; `workspace` holds three u64s.
    check(unsafe {
        mucudnnTunerPrepare(tuner, c(&plans).as_ptr(), &mut id, workspace.as_mut_ptr())
    });
    expect("mucudnnTunerPrepare");

    let gpu = CudaContext::new(ordinal).unwrap();
    let stream = gpu.new_stream().unwrap();
    let x = stream.alloc_zeros::<f32>(4 * 8 * 8 * 8).unwrap();
    let w = stream.alloc_zeros::<f32>(8 * 8 * 3 * 3).unwrap();
    let mut y = stream.alloc_zeros::<f32>(4 * 8 * 8 * 8).unwrap();
    let mut space = stream
        .alloc_zeros::<u8>(workspace.iter().copied().max().unwrap().max(1) as usize)
        .unwrap();
    {
        let (xp, _a) = x.device_ptr(&stream);
        let (wp, _b) = w.device_ptr(&stream);
        let (yp, _c) = y.device_ptr_mut(&stream);
        let (sp, _d) = space.device_ptr_mut(&stream);
        // x, w and y in NCHW order, and their bytes (f32).
        let dims: [i64; 12] = [4, 8, 8, 8, 8, 8, 3, 3, 4, 8, 8, 8];
        let bytes: [u64; 3] = [4 * 8 * 8 * 8 * 4, 8 * 8 * 3 * 3 * 4, 4 * 8 * 8 * 8 * 4];
        set(caller);
        // SAFETY: device buffers of the tuner's GPU with the problem's element counts, live
        // until the stream is synchronised below; a live stream of the primary context.
        check(unsafe {
            mucudnnTunerExecute(
                tuner,
                id,
                MUCUDNN_OP_FORWARD,
                1.0,
                xp as *const c_void,
                wp as *const c_void,
                0.0,
                yp as *mut c_void,
                dims.as_ptr(),
                bytes.as_ptr(),
                sp as *mut c_void,
                workspace[0],
                stream.cu_stream() as *mut _,
            )
        });
        expect("mucudnnTunerExecute");
    }
    stream.synchronize().unwrap();
    set(caller);
    check(mucudnnTunerRelease(tuner, id));
    expect("mucudnnTunerRelease");
    set(caller);
    check(mucudnnTunerDestroy(tuner));
    expect("mucudnnTunerDestroy");
}

#[test]
#[ignore = "needs a GPU: a CUDA tuner binds device 0's context and must unbind it again"]
fn no_current_context_stays_none() {
    run_with_current(0, null_mut());
}

#[test]
#[ignore = "needs two GPUs: a forward on device 1 while device 0's context is current"]
fn the_callers_device_stays_current_across_gpus() {
    cudarc::driver::result::init().unwrap();
    let count = device::get_count().unwrap();
    assert!(count >= 2, "this test needs two GPUs, found {count}");
    let zero = device::get(0).unwrap();
    // SAFETY: a valid device; the retained primary context is released below.
    let caller = unsafe { primary_ctx::retain(zero) }.unwrap();
    run_with_current(1, caller);
    // SAFETY: retained above.
    unsafe { primary_ctx::release(zero) }.unwrap();
}
