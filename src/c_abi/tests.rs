//! The C entry points called from Rust, as a C program would call them, without a GPU.

use super::*;
use crate::backend::cudnn::library_status;
use error::last_error;
use std::ptr::{null, null_mut};

const H100: &str = include_str!("../../tests/fixtures/h100-alexnet-profile.json");

fn c(text: &str) -> CString {
    CString::new(text).unwrap()
}

/// Takes a string mucudnn returned, copies it, and frees it.
fn take(text: *mut c_char) -> String {
    assert!(!text.is_null());
    // SAFETY: a live string from mucudnn, freed once right after.
    let copy = unsafe { CStr::from_ptr(text) }
        .to_str()
        .unwrap()
        .to_string();
    // SAFETY: as above.
    unsafe { mucudnnFreeString(text) };
    copy
}

/// Whether this machine lacks the libraries, so that a fake cuDNN handle is never touched.
fn no_gpu_libraries() -> bool {
    let libs = library_status();
    !(libs.libcuda && libs.libcudnn)
}

#[test]
fn version_and_build_info() {
    assert_eq!(mucudnnGetVersion(), MUCUDNN_VERSION);
    let [major, minor, patch] = [
        env!("CARGO_PKG_VERSION_MAJOR"),
        env!("CARGO_PKG_VERSION_MINOR"),
        env!("CARGO_PKG_VERSION_PATCH"),
    ]
    .map(|v| v.parse::<u32>().unwrap());
    assert_eq!(MUCUDNN_VERSION, major * 10_000 + minor * 100 + patch);
    assert_eq!(mucudnnGetAbiVersion(), MUCUDNN_ABI_VERSION);
    // SAFETY: a static NUL-terminated string.
    let info = unsafe { CStr::from_ptr(mucudnnGetBuildInfo()) }
        .to_str()
        .unwrap();
    assert!(
        info.starts_with(&format!("mucudnn {} (", env!("CARGO_PKG_VERSION"))),
        "{info}"
    );
    assert!(info.contains("highs="), "{info}");
    assert!(info.contains("cudarc 0.19"), "{info}");
    // The build info names the cudarc line the lock file has.
    let lock = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.lock")).unwrap();
    let cudarc = lock
        .split("[[package]]")
        .find(|p| p.contains("name = \"cudarc\""))
        .unwrap();
    assert!(cudarc.contains("version = \"0.19."), "{cudarc}");
}

#[test]
fn status_strings() {
    // SAFETY (all): static NUL-terminated strings.
    let name = |s: i32| {
        unsafe { CStr::from_ptr(mucudnnGetStatusString(s)) }
            .to_str()
            .unwrap()
    };
    assert_eq!(
        name(mucudnnStatus_t::MUCUDNN_STATUS_SUCCESS as i32),
        "MUCUDNN_STATUS_SUCCESS"
    );
    assert_eq!(
        name(mucudnnStatus_t::MUCUDNN_STATUS_NOT_AVAILABLE as i32),
        "MUCUDNN_STATUS_NOT_AVAILABLE"
    );
    assert_eq!(
        name(mucudnnStatus_t::MUCUDNN_STATUS_INTERNAL_ERROR as i32),
        "MUCUDNN_STATUS_INTERNAL_ERROR"
    );
    assert_eq!(
        name(mucudnnStatus_t::MUCUDNN_STATUS_PLAN_NOT_SUPPORTED as i32),
        "MUCUDNN_STATUS_PLAN_NOT_SUPPORTED"
    );
    assert_eq!(name(11), "MUCUDNN_STATUS_UNKNOWN");
    assert_eq!(name(-1), "MUCUDNN_STATUS_UNKNOWN");
}

#[test]
fn solve_profile() {
    let profile = c(H100);
    let options = c(r#"{"policy": "power-of-two", "workspace_limit": "64MiB"}"#);
    let mut out: *mut c_char = std::ptr::dangling_mut::<c_char>();
    // SAFETY: valid strings and output slot.
    let status = unsafe { mucudnnSolveProfile(profile.as_ptr(), options.as_ptr(), &mut out) };
    assert_eq!(
        status,
        mucudnnStatus_t::MUCUDNN_STATUS_SUCCESS,
        "{}",
        last_error()
    );
    assert_eq!(last_error(), "");
    let doc: serde_json::Value = serde_json::from_str(&take(out)).unwrap();
    assert_eq!(doc["mode"], "wr");
    assert_eq!(doc["plans"].as_array().unwrap().len(), 30);
    // NULL options are the defaults (the same limit here).
    let mut defaults: *mut c_char = null_mut();
    // SAFETY: as above.
    let status = unsafe { mucudnnSolveProfile(profile.as_ptr(), null(), &mut defaults) };
    assert_eq!(status, mucudnnStatus_t::MUCUDNN_STATUS_SUCCESS);
    let defaults: serde_json::Value = serde_json::from_str(&take(defaults)).unwrap();
    assert_eq!(defaults, doc);
    // Workspace division.
    let wd = c(r#"{"total_workspace": "1GiB", "ilp_time_limit": 5}"#);
    let mut out = null_mut();
    // SAFETY: as above.
    let status = unsafe { mucudnnSolveProfile(profile.as_ptr(), wd.as_ptr(), &mut out) };
    assert_eq!(
        status,
        mucudnnStatus_t::MUCUDNN_STATUS_SUCCESS,
        "{}",
        last_error()
    );
    let doc: serde_json::Value = serde_json::from_str(&take(out)).unwrap();
    assert_eq!(doc["mode"], "wd");
}

#[test]
fn solve_profile_errors() {
    use mucudnnStatus_t as S;
    let profile = c(H100);
    let solve = |profile: *const c_char, options: *const c_char| {
        let mut out: *mut c_char = std::ptr::dangling_mut::<c_char>();
        // SAFETY: the pointers are null or valid strings, and `out` a live slot.
        let status = unsafe { mucudnnSolveProfile(profile, options, &mut out) };
        assert!(out.is_null(), "the output is NULL after a failure");
        (status, last_error())
    };
    let (status, message) = solve(null(), null());
    assert_eq!(status, S::MUCUDNN_STATUS_INVALID_ARGUMENT);
    assert_eq!(message, "mucudnnSolveProfile: profile_json is NULL");
    let bad_json = c("{\"format\": ");
    let (status, message) = solve(bad_json.as_ptr(), null());
    assert_eq!(status, S::MUCUDNN_STATUS_BAD_PROFILE);
    assert!(
        message.starts_with("mucudnnSolveProfile: bad profile: not valid JSON"),
        "{message}"
    );
    let wrong_format = c(&H100.replace("mucudnn-profile-v1", "mucudnn-profile-v7"));
    let (status, message) = solve(wrong_format.as_ptr(), null());
    assert_eq!(status, S::MUCUDNN_STATUS_BAD_PROFILE);
    assert!(message.contains("mucudnn-profile-v7"), "{message}");
    let bad_options = c(r#"{"workspace_limit": "64MB"}"#);
    let (status, message) = solve(profile.as_ptr(), bad_options.as_ptr());
    assert_eq!(status, S::MUCUDNN_STATUS_INVALID_ARGUMENT);
    assert!(
        message.contains("decimal suffixes are ambiguous"),
        "{message}"
    );
    let invalid_utf8 = [0xffu8, 0xfe, 0];
    let (status, message) = solve(invalid_utf8.as_ptr().cast(), null());
    assert_eq!(status, S::MUCUDNN_STATUS_INVALID_ARGUMENT);
    assert!(
        message.contains("profile_json is not valid UTF-8"),
        "{message}"
    );
    let needs_1000 = c(solve::tests::NEEDS_1000_BYTES);
    let tiny = c(r#"{"total_workspace": 10}"#);
    let (status, message) = solve(needs_1000.as_ptr(), tiny.as_ptr());
    assert_eq!(status, S::MUCUDNN_STATUS_SOLVER_ERROR, "{message}");
    assert!(
        message.contains("the smallest total that works"),
        "{message}"
    );
    // A NULL output slot.
    // SAFETY: valid strings; the NULL output is refused, not written.
    let status = unsafe { mucudnnSolveProfile(profile.as_ptr(), null(), null_mut()) };
    assert_eq!(status, S::MUCUDNN_STATUS_INVALID_ARGUMENT);
    assert_eq!(last_error(), "mucudnnSolveProfile: plan_json_out is NULL");
    // SAFETY: NULL is ignored.
    unsafe { mucudnnFreeString(null_mut()) };
}

#[test]
fn options_init_and_validation() {
    let mut options = std::mem::MaybeUninit::<mucudnnOptions_t>::uninit();
    // SAFETY: a writable slot for one options struct.
    let status = unsafe { mucudnnOptionsInit(options.as_mut_ptr()) };
    assert_eq!(status, mucudnnStatus_t::MUCUDNN_STATUS_SUCCESS);
    // SAFETY: initialised by mucudnnOptionsInit.
    let options = unsafe { options.assume_init() };
    assert_eq!(
        options.size as usize,
        std::mem::size_of::<mucudnnOptions_t>()
    );
    assert_eq!(
        std::mem::size_of::<mucudnnOptions_t>(),
        40,
        "the C layout of version 1"
    );
    assert_eq!(options.version, MUCUDNN_OPTIONS_VERSION);
    assert_eq!(options.policy, MUCUDNN_POLICY_POWER_OF_TWO);
    assert_eq!(options.workspace_limit_bytes, 64 << 20);
    assert_eq!(options.total_workspace_bytes, MUCUDNN_NO_LIMIT);
    // SAFETY: NULL is refused.
    let status = unsafe { mucudnnOptionsInit(null_mut()) };
    assert_eq!(status, mucudnnStatus_t::MUCUDNN_STATUS_INVALID_ARGUMENT);

    // SAFETY (all below): pointers to live options whose cache path is NULL or a C string.
    let settings = unsafe { settings_arg(&options) }.unwrap();
    assert_eq!(settings.tuning.workspace_limit_bytes, 64 << 20);
    assert_eq!(settings.tuning.policy, Policy::PowerOfTwo);
    assert_eq!(settings.cache_path, None);
    assert_eq!(unsafe { settings_arg(null()) }.unwrap(), settings);
    let path = c("/tmp/mucudnn-cache.sqlite");
    let budget = mucudnnOptions_t {
        cache_path: path.as_ptr(),
        policy: MUCUDNN_POLICY_ALL,
        verbose: 1,
        workspace_limit_bytes: MUCUDNN_NO_LIMIT,
        total_workspace_bytes: 8 << 20,
        ..options
    };
    let settings = unsafe { settings_arg(&budget) }.unwrap();
    assert_eq!(settings.tuning.workspace_limit_bytes, 8 << 20);
    assert_eq!(settings.tuning.policy, Policy::All);
    assert_eq!(
        settings.cache_path,
        Some(PathBuf::from("/tmp/mucudnn-cache.sqlite"))
    );
    assert!(settings.verbose);
    let error = |o: &mucudnnOptions_t| unsafe { settings_arg(o) }.unwrap_err().to_string();
    assert!(error(&mucudnnOptions_t { size: 8, ..options }).contains("options->size is 8"));
    assert!(error(&mucudnnOptions_t {
        version: 2,
        ..options
    })
    .contains("options->version is 2"));
    assert!(error(&mucudnnOptions_t {
        policy: 3,
        ..options
    })
    .contains("options->policy is 3"));
    let empty = c("");
    let message = error(&mucudnnOptions_t {
        cache_path: empty.as_ptr(),
        ..options
    });
    assert!(message.contains("cache_path is empty"), "{message}");
    let bad = [b'/', 0xff, 0];
    let message = error(&mucudnnOptions_t {
        cache_path: bad.as_ptr().cast(),
        ..options
    });
    assert!(
        message.contains("cache_path is not valid UTF-8"),
        "{message}"
    );
}

#[test]
fn create_checks_arguments_then_availability() {
    use mucudnnStatus_t as S;
    let fake_cudnn = 0x10 as mucudnnCudnnHandle_t;
    let mut handle: mucudnnHandle_t = 1 as mucudnnHandle_t;
    // SAFETY: NULL outputs and handles are refused before anything is touched.
    unsafe {
        assert_eq!(
            mucudnnCreate(null_mut(), fake_cudnn, null_mut(), null()),
            S::MUCUDNN_STATUS_INVALID_ARGUMENT
        );
        assert_eq!(last_error(), "mucudnnCreate: handle_out is NULL");
        assert_eq!(
            mucudnnCreate(&mut handle, null_mut(), null_mut(), null()),
            S::MUCUDNN_STATUS_INVALID_ARGUMENT
        );
        assert!(handle.is_null());
        assert!(
            last_error().contains("the cuDNN handle is NULL"),
            "{}",
            last_error()
        );
        let bad = mucudnnOptions_t {
            policy: 7,
            ..Default::default()
        };
        assert_eq!(
            mucudnnCreate(&mut handle, fake_cudnn, null_mut(), &bad),
            S::MUCUDNN_STATUS_INVALID_ARGUMENT
        );
        assert!(last_error().contains("options->policy is 7"));
    }
    if no_gpu_libraries() {
        // SAFETY: without libcuda or libcudnn the fake handle is never dereferenced.
        let status = unsafe { mucudnnCreate(&mut handle, fake_cudnn, null_mut(), null()) };
        assert_eq!(status, S::MUCUDNN_STATUS_NOT_AVAILABLE);
        assert!(handle.is_null());
        let message = last_error();
        // "libcuda unavailable: ...", "libcudnn unavailable: ..." or "no usable CUDA device".
        assert!(message.starts_with("mucudnnCreate: "), "{message}");
        assert!(
            message.contains("unavailable") || message.contains("no usable"),
            "{message}"
        );
        println!("without a GPU: {message}");
    } else {
        println!("CUDA and cuDNN are present: the fake-handle case is left to the C client");
    }
}

#[test]
fn probe_reports_what_is_missing() {
    let mut out: *mut c_char = std::ptr::dangling_mut::<c_char>();
    // SAFETY: a live output slot.
    let status = unsafe { mucudnnProbe(&mut out) };
    if no_gpu_libraries() {
        assert_eq!(status, mucudnnStatus_t::MUCUDNN_STATUS_NOT_AVAILABLE);
        assert!(out.is_null());
        assert!(
            last_error().starts_with("mucudnnProbe: "),
            "{}",
            last_error()
        );
    } else if status == mucudnnStatus_t::MUCUDNN_STATUS_SUCCESS {
        let doc: serde_json::Value = serde_json::from_str(&take(out)).unwrap();
        assert_eq!(doc["libraries"]["libcudnn"], true);
    }
}

#[test]
fn handle_calls_refuse_null_stale_and_foreign_handles() {
    use mucudnnStatus_t as S;
    let garbage = 0x1234usize as *mut c_void;
    let one = 1.0f32;
    let zero = 0.0f32;
    for handle in [null_mut(), 0x40 as mucudnnHandle_t] {
        // SAFETY: the handle is refused (NULL, or not registered) before any other argument,
        // the garbage descriptors and pointers included, is touched.
        unsafe {
            let status = mucudnnConvolutionForward(
                handle,
                (&one as *const f32).cast(),
                garbage.cast(),
                garbage,
                garbage.cast(),
                garbage,
                garbage.cast(),
                (&zero as *const f32).cast(),
                garbage.cast(),
                garbage,
                -1,
            );
            assert_eq!(status, S::MUCUDNN_STATUS_INVALID_ARGUMENT);
            let message = last_error();
            assert!(
                message.starts_with("mucudnnConvolutionForward: handle is"),
                "{message}"
            );
            assert_eq!(
                mucudnnConvolutionBackwardData(
                    handle,
                    null(),
                    null_mut(),
                    null(),
                    null_mut(),
                    null(),
                    null_mut(),
                    null(),
                    null_mut(),
                    null_mut(),
                    0,
                ),
                S::MUCUDNN_STATUS_INVALID_ARGUMENT
            );
            assert_eq!(
                mucudnnConvolutionBackwardFilter(
                    handle,
                    null(),
                    garbage.cast(),
                    null(),
                    garbage.cast(),
                    null(),
                    garbage.cast(),
                    null(),
                    garbage.cast(),
                    null_mut(),
                    5,
                ),
                S::MUCUDNN_STATUS_INVALID_ARGUMENT
            );
            let mut size = 7usize;
            assert_eq!(
                mucudnnGetWorkspaceSize(
                    handle,
                    MUCUDNN_OP_FORWARD,
                    garbage.cast(),
                    garbage.cast(),
                    garbage.cast(),
                    garbage.cast(),
                    &mut size,
                ),
                S::MUCUDNN_STATUS_INVALID_ARGUMENT
            );
            assert_eq!(size, 0);
            let mut json: *mut c_char = std::ptr::dangling_mut::<c_char>();
            assert_eq!(
                mucudnnGetPlansJson(handle, &mut json),
                S::MUCUDNN_STATUS_INVALID_ARGUMENT
            );
            assert!(json.is_null());
            assert_eq!(
                mucudnnSetStream(handle, null_mut()),
                S::MUCUDNN_STATUS_INVALID_ARGUMENT
            );
            assert_eq!(mucudnnDestroy(handle), S::MUCUDNN_STATUS_INVALID_ARGUMENT);
            let message = last_error();
            assert!(
                message == "mucudnnDestroy: handle is NULL"
                    || message.contains("is not a live mucudnn handle"),
                "{message}"
            );
        }
    }
}

#[test]
fn argument_conversions() {
    assert_eq!(
        conv_op_arg(MUCUDNN_OP_BACKWARD_FILTER).unwrap(),
        ConvOp::BackwardFilter
    );
    assert!(conv_op_arg(3).unwrap_err().to_string().contains("op is 3"));
    assert_eq!(
        policy_arg(MUCUDNN_POLICY_UNDIVIDED).unwrap(),
        Policy::Undivided
    );
    assert_eq!(layer_arg(-1).unwrap(), None);
    assert_eq!(layer_arg(12).unwrap(), Some(12));
    assert!(layer_arg(-2)
        .unwrap_err()
        .to_string()
        .contains("layer_id is -2"));
    let half = 0.5f32;
    // SAFETY: a live float, then NULL (refused).
    unsafe {
        assert_eq!(
            scalar_arg((&half as *const f32).cast(), "alpha").unwrap(),
            0.5
        );
        assert!(scalar_arg(null(), "beta")
            .unwrap_err()
            .to_string()
            .starts_with("beta is NULL"));
    }
}

/// A CPU tuner with a tiny 1x1 problem (2 x 2 x 3 x 3 input, 2 filters) prepared: the tuner,
/// the plan set's id and the forward workspace bytes.
fn prepared_tiny_tuner() -> (mucudnnTuner_t, u64, u64) {
    prepared_tuner(&ConvProblem::new(2, 2, 3, 3, 2, 1, 1))
}

/// A CPU tuner with `problem` tuned (as the layer "tiny") and prepared: the tuner, the plan
/// set's id and the forward workspace bytes.
fn prepared_tuner(problem: &ConvProblem) -> (mucudnnTuner_t, u64, u64) {
    let mut tuner: mucudnnTuner_t = null_mut();
    let options = c(r#"{"no_cache": true}"#);
    let problem = serde_json::to_string(problem).unwrap();
    let problem = c(&problem);
    let mut result: *mut c_char = null_mut();
    let (mut set, mut workspace) = (0u64, [0u64; 3]);
    // SAFETY: live outputs and NUL-terminated strings.
    unsafe {
        assert_eq!(
            mucudnnTunerCreate(&mut tuner, MUCUDNN_DEVICE_CPU, options.as_ptr()),
            mucudnnStatus_t::MUCUDNN_STATUS_SUCCESS,
            "{}",
            last_error()
        );
        assert_eq!(
            mucudnnTunerTune(
                tuner,
                c("tiny").as_ptr(),
                problem.as_ptr(),
                null(),
                &mut result
            ),
            mucudnnStatus_t::MUCUDNN_STATUS_SUCCESS,
            "{}",
            last_error()
        );
        let doc: serde_json::Value = serde_json::from_str(&take(result)).unwrap();
        let plans = c(&doc["plans"].to_string());
        assert_eq!(
            mucudnnTunerPrepare(tuner, plans.as_ptr(), &mut set, workspace.as_mut_ptr()),
            mucudnnStatus_t::MUCUDNN_STATUS_SUCCESS,
            "{}",
            last_error()
        );
    }
    (tuner, set, workspace[0])
}

/// A CPU tuner made through the C ABI, its measurements in memory.
fn cpu_tuner() -> mucudnnTuner_t {
    let mut tuner: mucudnnTuner_t = null_mut();
    let options = c(r#"{"no_cache": true}"#);
    // SAFETY: a live output and a NUL-terminated string.
    let status = unsafe { mucudnnTunerCreate(&mut tuner, MUCUDNN_DEVICE_CPU, options.as_ptr()) };
    assert_eq!(
        status,
        mucudnnStatus_t::MUCUDNN_STATUS_SUCCESS,
        "{}",
        last_error()
    );
    tuner
}

/// mucudnnTunerTune of `problem` (JSON) as layer `layer` with `settings` (`None`: NULL): its
/// status and, on success, its result document.
fn tune_through_c(
    tuner: mucudnnTuner_t,
    layer: &str,
    problem: &str,
    settings: Option<&str>,
) -> (mucudnnStatus_t, Option<serde_json::Value>) {
    let (layer, problem) = (c(layer), c(problem));
    let settings = settings.map(c);
    let mut result: *mut c_char = null_mut();
    // SAFETY: NUL-terminated strings (or NULL settings) and a live output.
    let status = unsafe {
        mucudnnTunerTune(
            tuner,
            layer.as_ptr(),
            problem.as_ptr(),
            settings.as_ref().map_or(null(), |s| s.as_ptr()),
            &mut result,
        )
    };
    let doc = (!result.is_null()).then(|| serde_json::from_str(&take(result)).unwrap());
    (status, doc)
}

#[test]
fn tuner_execute_checks_operands_against_the_plan() {
    use mucudnnStatus_t as S;
    let (tuner, set, workspace_bytes) = prepared_tiny_tuner();
    // 4-byte aligned, as the CPU tuner asks.
    let mut workspace = vec![0u32; (workspace_bytes as usize).div_ceil(4)];
    let x: Vec<f32> = (0..36).map(|i| i as f32).collect();
    let w: Vec<f32> = vec![1.0, 0.0, 0.5, 2.0]; // y0 = x0, y1 = 0.5 x0 + 2 x1
    let mut y = vec![f32::NAN; 36];
    // N, C, D, H, W per operand (a filter K, C/groups, T, R, S); D = T = 1 in 2-D.
    let dims: [i64; 15] = [2, 2, 1, 3, 3, 2, 2, 1, 1, 1, 2, 2, 1, 3, 3];
    let bytes: [u64; 3] = [36 * 4, 4 * 4, 36 * 4];
    let mut execute = |y: &mut Vec<f32>, dims: &[i64; 15], bytes: &[u64; 3]| {
        // SAFETY: x, w and y hold the byte counts `bytes` claims or more (the wrong-shape
        // calls below claim less or other dims, and must be refused before reading).
        unsafe {
            mucudnnTunerExecute(
                tuner,
                set,
                MUCUDNN_OP_FORWARD,
                1.0,
                x.as_ptr().cast(),
                w.as_ptr().cast(),
                0.0,
                y.as_mut_ptr().cast(),
                dims.as_ptr(),
                bytes.as_ptr(),
                workspace.as_mut_ptr().cast(),
                workspace_bytes,
                null_mut(),
            )
        }
    };
    assert_eq!(execute(&mut y, &dims, &bytes), S::MUCUDNN_STATUS_SUCCESS);
    for n in 0..2 {
        for pixel in 0..9 {
            let x0 = x[n * 18 + pixel];
            let x1 = x[n * 18 + 9 + pixel];
            assert_eq!(y[n * 18 + pixel], x0);
            assert_eq!(y[n * 18 + 9 + pixel], 0.5 * x0 + 2.0 * x1);
        }
    }
    // A weight of another shape (pruned to one filter), an input with a larger batch, an
    // output of another size, a buffer too small for its role: refused, nothing written.
    let mut cases: Vec<([i64; 15], [u64; 3], &str)> = Vec::new();
    let mut pruned = dims;
    pruned[5] = 1;
    cases.push((
        pruned,
        bytes,
        "w is [1, 2, 1, 1, 1] but the plan is for [2, 2, 1, 1, 1]",
    ));
    let mut bigger = dims;
    bigger[0] = 4;
    cases.push((bigger, bytes, "x is [4, 2, 1, 3, 3]"));
    let mut strided = dims;
    (strided[13], strided[14]) = (2, 2);
    cases.push((strided, bytes, "y is [2, 2, 1, 2, 2]"));
    // The same numbers as a 3-D operand (depth 3, unit height): another shape.
    let mut deep = dims;
    (deep[2], deep[3]) = (3, 1);
    cases.push((deep, bytes, "x is [2, 2, 3, 1, 3]"));
    cases.push((dims, [36 * 2, 16, 36 * 4], "x holds 72 bytes"));
    cases.push((dims, [36 * 4, 16, 35 * 4], "y holds 140 bytes"));
    for (dims, bytes, message) in cases {
        y.fill(-7.0);
        assert_eq!(
            execute(&mut y, &dims, &bytes),
            S::MUCUDNN_STATUS_INVALID_ARGUMENT,
            "{message}"
        );
        assert!(last_error().contains(message), "{}", last_error());
        assert!(last_error().contains("tiny fwd"), "{}", last_error());
        assert!(y.iter().all(|&v| v == -7.0), "nothing written");
    }
    // SAFETY: NULL dims or bytes are refused before any pointer is read.
    unsafe {
        let status = mucudnnTunerExecute(
            tuner,
            set,
            MUCUDNN_OP_FORWARD,
            1.0,
            x.as_ptr().cast(),
            w.as_ptr().cast(),
            0.0,
            y.as_mut_ptr().cast(),
            null(),
            bytes.as_ptr(),
            null_mut(),
            0,
            null_mut(),
        );
        assert_eq!(status, S::MUCUDNN_STATUS_INVALID_ARGUMENT);
        assert!(last_error().contains("operand_dims is NULL"));
        assert_eq!(mucudnnTunerDestroy(tuner), S::MUCUDNN_STATUS_SUCCESS);
    }
}

/// A 3-D problem through the C ABI: tuned from JSON with its depth fields, executed over
/// NCDHW host buffers with 15 dims (depth included), and refused when the same numbers are
/// given as the 2-D reading (D = T = 1).
#[test]
fn tuner_executes_a_3d_problem_with_its_depth_dims() {
    use mucudnnStatus_t as S;
    // 1 x 1 x 3 x 2 x 2 input, one 2 x 1 x 1 filter: y[o, h, w] = w0 x[o] + w1 x[o + 1].
    let problem = ConvProblem::new_3d(1, 1, 3, 2, 2, 1, 2, 1, 1);
    let (tuner, set, workspace_bytes) = prepared_tuner(&problem);
    let mut workspace = vec![0u32; (workspace_bytes as usize).div_ceil(4)];
    let x: Vec<f32> = (0..12).map(|i| i as f32).collect();
    let w: Vec<f32> = vec![2.0, -1.0];
    let mut y = vec![f32::NAN; 8];
    let dims: [i64; 15] = [1, 1, 3, 2, 2, 1, 1, 2, 1, 1, 1, 1, 2, 2, 2];
    let bytes: [u64; 3] = [12 * 4, 2 * 4, 8 * 4];
    let mut execute = |y: &mut Vec<f32>, dims: &[i64; 15]| {
        // SAFETY: x, w and y hold `bytes`; the refused call is refused before reading.
        unsafe {
            mucudnnTunerExecute(
                tuner,
                set,
                MUCUDNN_OP_FORWARD,
                1.0,
                x.as_ptr().cast(),
                w.as_ptr().cast(),
                0.0,
                y.as_mut_ptr().cast(),
                dims.as_ptr(),
                bytes.as_ptr(),
                workspace.as_mut_ptr().cast(),
                workspace_bytes,
                null_mut(),
            )
        }
    };
    assert_eq!(
        execute(&mut y, &dims),
        S::MUCUDNN_STATUS_SUCCESS,
        "{}",
        last_error()
    );
    let expected: Vec<f32> = (0..8).map(|i| 2.0 * x[i] - x[i + 4]).collect();
    assert_eq!(y, expected);
    // The 2-D reading of the filter (T = 1): another shape, refused.
    let mut flat = dims;
    flat[7] = 1;
    y.fill(-7.0);
    assert_eq!(execute(&mut y, &flat), S::MUCUDNN_STATUS_INVALID_ARGUMENT);
    assert!(
        last_error().contains("w is [1, 1, 1, 1, 1] but the plan is for [1, 1, 2, 1, 1]"),
        "{}",
        last_error()
    );
    assert!(y.iter().all(|&v| v == -7.0));
    assert_eq!(mucudnnTunerDestroy(tuner), S::MUCUDNN_STATUS_SUCCESS);
}

/// A 3-D problem's operands are checked in all five dims, per op and role: depth (D) and
/// filter depth (T) count, the 2-D reading of the same numbers (D = T = 1) is refused, and the
/// byte count includes the depth.
#[test]
fn check_operands_reads_the_depth_of_a_3d_problem() {
    use crate::solver::{Algo, MicroBatch, Plan};
    // 2 x 3 x 5 x 6 x 7 input, 4 filters of 3 x 3 x 2 x 2, depth padded and strided:
    // output depth (5 + 2 - 3) / 2 + 1 = 3, height 6 - 2 + 1 = 5, width 7 - 2 + 1 = 6.
    let mut problem = ConvProblem::new_3d(2, 3, 5, 6, 7, 4, 3, 2, 2);
    (problem.pad_d, problem.stride_d) = (1, 2);
    problem.validate().unwrap();
    assert_eq!(problem.output_dims(), [2, 4, 3, 5, 6]);
    let x = [2, 3, 5, 6, 7];
    let w = [4, 3, 3, 2, 2];
    let y = [2, 4, 3, 5, 6];
    let bytes = |dims: [i64; 5]| dims.iter().product::<i64>() as u64 * 4;
    let extent = |dims: [i64; 5]| tuner::OperandExtent {
        dims,
        bytes: bytes(dims),
    };
    for (op, roles) in [
        (ConvOp::Forward, [x, w, y]),
        (ConvOp::BackwardData, [w, y, x]),
        (ConvOp::BackwardFilter, [x, y, w]),
    ] {
        let plan = Plan {
            layer: "deep".into(),
            problem,
            op,
            split: crate::solver::SplitDim::Batch,
            micro_batches: vec![MicroBatch {
                size: 2,
                algo: Algo::Legacy(0),
                workspace_bytes: 0,
                time_ms: 1.0,
            }],
        };
        let operands = roles.map(extent);
        tuner::check_operands(&plan, &operands).unwrap();
        for role in 0..3 {
            // The 2-D reading (depths folded to 1) of each operand, then a buffer one element
            // short of its depth-including size: refused, naming the operand.
            let mut flat = operands;
            flat[role].dims[2] = 1;
            let error = tuner::check_operands(&plan, &flat).unwrap_err().to_string();
            assert!(error.contains("but the plan is for"), "{op}: {error}");
            assert!(error.contains(&format!("{:?}", roles[role])), "{error}");
            let mut short = operands;
            short[role].bytes -= 4;
            let error = tuner::check_operands(&plan, &short)
                .unwrap_err()
                .to_string();
            assert!(
                error.contains(&format!("holds {} bytes", bytes(roles[role]) - 4)),
                "{error}"
            );
        }
    }
}

/// A tuner holds no measuring state between calls, and its tune result says
/// how much measuring held at most (never a workspace above the limit).
#[test]
fn a_tuner_releases_its_measuring_state_after_each_tune() {
    let mut tuner = tuner::Tuner::new(
        tuner::TunerDevice::Cpu,
        Some(mucudnn_cache::Cache::in_memory().quiet()),
        None,
        false,
    )
    .unwrap();
    let settings = tuner::parse_settings(
        r#"{"policy": "power-of-two", "workspace_limit": "64KiB"}"#,
        tuner::TunerDevice::Cpu,
    )
    .unwrap();
    let mut problem = crate::solver::ConvProblem::new(4, 3, 12, 12, 4, 3, 3);
    (problem.pad_h, problem.pad_w) = (1, 1);
    let result = tuner.tune("tiny", &problem, &settings).unwrap();
    assert!(result.measured > 0);
    assert!(result.peak_measuring_memory_bytes > 0);
    assert!(result.largest_workspace_bytes <= 64 << 10);
    assert!(result.peak_measuring_memory_bytes >= result.largest_workspace_bytes);
    assert_eq!(
        tuner.measuring_memory(),
        crate::backend::MemoryUse::default()
    );
    let json = serde_json::to_value(&result).unwrap();
    assert!(json["peak_measuring_memory_bytes"].as_u64().unwrap() > 0);
    // The distributed path releases too.
    let tasks = tuner
        .missing(
            vec![tuner::NamedProblem {
                layer: "other".into(),
                problem: crate::solver::ConvProblem { k: 5, ..problem },
            }],
            &settings,
        )
        .unwrap();
    assert!(!tasks.is_empty());
    tuner.measure(&tasks, &settings).unwrap();
    assert_eq!(
        tuner.measuring_memory(),
        crate::backend::MemoryUse::default()
    );
}

/// A CPU tuner over an in-memory cache, for the settings' `ops` tests.
fn memory_tuner() -> tuner::Tuner {
    tuner::Tuner::new(
        tuner::TunerDevice::Cpu,
        Some(mucudnn_cache::Cache::in_memory().quiet()),
        None,
        false,
    )
    .unwrap()
}

fn settings(text: &str) -> tuner::Settings {
    tuner::parse_settings(text, tuner::TunerDevice::Cpu).unwrap()
}

/// Inference tuning: `"ops": ["fwd"]` measures, solves and returns the forward alone; the
/// backward ops stay missing until asked for, and all three are then cached plans.
#[test]
fn tuner_settings_ops_tune_only_those_ops() {
    let mut tuner = memory_tuner();
    let problem = ConvProblem::new(2, 2, 3, 3, 2, 1, 1);
    let named = |layer: &str| {
        vec![tuner::NamedProblem {
            layer: layer.into(),
            problem,
        }]
    };
    // Old settings (no `ops`) mean all three.
    assert_eq!(settings("{}").ops, ConvOp::ALL.to_vec());
    assert_eq!(settings(r#"{"ops": null}"#).ops, ConvOp::ALL.to_vec());
    let fwd = settings(r#"{"ops": ["fwd"]}"#);
    let all = settings("{}");
    let before = tuner.missing(named("tiny"), &all).unwrap();
    assert!(ConvOp::ALL
        .iter()
        .all(|op| before.iter().any(|t| t.op == *op)));
    let result = tuner.tune("tiny", &problem, &fwd).unwrap();
    assert_eq!(result.plans.len(), 1);
    assert_eq!(result.plans[0].op, ConvOp::Forward);
    assert_eq!(result.splits.len(), 1);
    assert!(result.measured > 0);
    // Nothing of the backward ops was measured: they are all still missing, the forward not.
    let after = tuner.missing(named("tiny"), &all).unwrap();
    assert!(after.iter().all(|t| t.op != ConvOp::Forward));
    let backward: Vec<_> = before
        .iter()
        .filter(|t| t.op != ConvOp::Forward)
        .cloned()
        .collect();
    assert_eq!(after, backward);
    assert!(tuner.missing(named("tiny"), &fwd).unwrap().is_empty());
    // The forward again: its plan is cached.
    let again = tuner.tune("tiny", &problem, &fwd).unwrap();
    assert_eq!((again.cached, again.measured), (0, 0));
    assert_eq!(again.plans, result.plans);
    // The backward ops, named in any order, come in op order; the forward is not re-measured.
    let backward = settings(r#"{"ops": ["bwd_filter", "bwd_data"]}"#);
    let result = tuner.tune("tiny", &problem, &backward).unwrap();
    let ops: Vec<ConvOp> = result.plans.iter().map(|p| p.op).collect();
    assert_eq!(ops, vec![ConvOp::BackwardData, ConvOp::BackwardFilter]);
    assert!(result.measured > 0);
    // Now all three plans are cached.
    let full = tuner.tune("tiny", &problem, &all).unwrap();
    assert_eq!((full.cached, full.measured), (0, 0));
    assert_eq!(full.plans.len(), 3);
    assert!(tuner.missing(named("tiny"), &all).unwrap().is_empty());
}

/// `mucudnnTunerMeasure` measures only the tasks of the settings' ops; the others are left
/// out of its result and stay missing.
#[test]
fn tuner_measure_leaves_out_tasks_of_other_ops() {
    let mut tuner = memory_tuner();
    let problem = ConvProblem::new(2, 2, 3, 3, 2, 1, 1);
    let layers = vec![tuner::NamedProblem {
        layer: "tiny".into(),
        problem,
    }];
    let all = settings("{}");
    let tasks = tuner.missing(layers.clone(), &all).unwrap();
    let data = settings(r#"{"ops": ["bwd_data"]}"#);
    let measured = tuner.measure(&tasks, &data).unwrap();
    assert!(!measured.is_empty());
    assert!(measured.iter().all(|m| m.task.op == ConvOp::BackwardData));
    assert_eq!(
        measured.len(),
        tasks
            .iter()
            .filter(|t| t.op == ConvOp::BackwardData)
            .count()
    );
    let left = tuner.missing(layers, &all).unwrap();
    assert!(left.iter().all(|t| t.op != ConvOp::BackwardData));
    assert!(left.iter().any(|t| t.op == ConvOp::Forward));
    assert!(left.iter().any(|t| t.op == ConvOp::BackwardFilter));
}

/// Bad `ops`: an empty array, an unknown name, a non-array, a non-string: INVALID_ARGUMENT
/// through the C ABI, with a message that says what to give.
#[test]
fn tuner_settings_ops_errors() {
    use mucudnnStatus_t as S;
    let mut tuner: mucudnnTuner_t = null_mut();
    let problem = c(&serde_json::to_string(&ConvProblem::new(2, 2, 3, 3, 2, 1, 1)).unwrap());
    // SAFETY: live outputs and NUL-terminated strings.
    unsafe {
        assert_eq!(
            mucudnnTunerCreate(
                &mut tuner,
                MUCUDNN_DEVICE_CPU,
                c(r#"{"no_cache": true}"#).as_ptr()
            ),
            S::MUCUDNN_STATUS_SUCCESS
        );
        for (text, message) in [
            (r#"{"ops": []}"#, "settings: ops is empty"),
            (r#"{"ops": ["fwd", "bwd"]}"#, "unknown op `bwd`"),
            (r#"{"ops": ["FWD"]}"#, "unknown op `FWD`"),
            (r#"{"ops": "fwd"}"#, "give an array of op names"),
            (r#"{"ops": [1]}"#, "1 is not an op name"),
        ] {
            let mut result: *mut c_char = null_mut();
            let status = mucudnnTunerTune(
                tuner,
                c("tiny").as_ptr(),
                problem.as_ptr(),
                c(text).as_ptr(),
                &mut result,
            );
            assert_eq!(status, S::MUCUDNN_STATUS_INVALID_ARGUMENT, "{text}");
            assert!(last_error().contains(message), "{text}: {}", last_error());
            assert!(
                last_error().contains("fwd, bwd_data, bwd_filter"),
                "{}",
                last_error()
            );
            let mut tasks: *mut c_char = null_mut();
            let layers = c(r#"[]"#);
            let status = mucudnnTunerMissing(tuner, layers.as_ptr(), c(text).as_ptr(), &mut tasks);
            assert_eq!(status, S::MUCUDNN_STATUS_INVALID_ARGUMENT, "{text}");
            let status = mucudnnTunerMeasure(tuner, layers.as_ptr(), c(text).as_ptr(), &mut tasks);
            assert_eq!(status, S::MUCUDNN_STATUS_INVALID_ARGUMENT, "{text}");
        }
        // An op named twice is refused (it was merged silently before).
        let problem = problem.to_str().unwrap();
        let (status, doc) = tune_through_c(
            tuner,
            "tiny",
            problem,
            Some(r#"{"ops": ["fwd", "bwd_data", "fwd"]}"#),
        );
        assert_eq!(status, S::MUCUDNN_STATUS_INVALID_ARGUMENT);
        assert!(
            last_error().contains("settings: ops: `fwd` is given twice"),
            "{}",
            last_error()
        );
        assert!(doc.is_none());
        let (status, doc) = tune_through_c(
            tuner,
            "tiny",
            problem,
            Some(r#"{"ops": ["bwd_data", "fwd"]}"#),
        );
        assert_eq!(status, S::MUCUDNN_STATUS_SUCCESS, "{}", last_error());
        assert_eq!(doc.unwrap()["plans"].as_array().unwrap().len(), 2);
        assert_eq!(mucudnnTunerDestroy(tuner), S::MUCUDNN_STATUS_SUCCESS);
    }
}

/// A plan set prepared from the forward plan alone runs the forward; the other ops are
/// refused (no workspace reported for them), and an empty plan list is refused.
#[test]
fn tuner_prepares_and_runs_a_forward_only_set() {
    use mucudnnStatus_t as S;
    let mut tuner: mucudnnTuner_t = null_mut();
    let problem = c(&serde_json::to_string(&ConvProblem::new(2, 2, 3, 3, 2, 1, 1)).unwrap());
    let (mut set, mut workspace) = (0u64, [7u64; 3]);
    // SAFETY: live outputs, NUL-terminated strings, and x, w, y of the dims and bytes given.
    unsafe {
        assert_eq!(
            mucudnnTunerCreate(
                &mut tuner,
                MUCUDNN_DEVICE_CPU,
                c(r#"{"no_cache": true}"#).as_ptr()
            ),
            S::MUCUDNN_STATUS_SUCCESS
        );
        let mut result: *mut c_char = null_mut();
        let status = mucudnnTunerTune(
            tuner,
            c("tiny").as_ptr(),
            problem.as_ptr(),
            c(r#"{"ops": ["fwd"]}"#).as_ptr(),
            &mut result,
        );
        assert_eq!(status, S::MUCUDNN_STATUS_SUCCESS, "{}", last_error());
        let doc: serde_json::Value = serde_json::from_str(&take(result)).unwrap();
        let status = mucudnnTunerPrepare(tuner, c("[]").as_ptr(), &mut set, workspace.as_mut_ptr());
        assert_eq!(status, S::MUCUDNN_STATUS_INVALID_ARGUMENT);
        assert!(last_error().contains("not none"), "{}", last_error());
        let plans = c(&doc["plans"].to_string());
        let status = mucudnnTunerPrepare(tuner, plans.as_ptr(), &mut set, workspace.as_mut_ptr());
        assert_eq!(status, S::MUCUDNN_STATUS_SUCCESS, "{}", last_error());
        assert_eq!((workspace[1], workspace[2]), (0, 0));
        let mut host = vec![0u32; (workspace[0] as usize).div_ceil(4)];
        let x: Vec<f32> = (0..36).map(|i| i as f32).collect();
        let w: Vec<f32> = vec![1.0, 0.0, 0.5, 2.0];
        let mut y = vec![f32::NAN; 36];
        let dims: [i64; 15] = [2, 2, 1, 3, 3, 2, 2, 1, 1, 1, 2, 2, 1, 3, 3];
        let bytes: [u64; 3] = [36 * 4, 4 * 4, 36 * 4];
        let status = mucudnnTunerExecute(
            tuner,
            set,
            MUCUDNN_OP_FORWARD,
            1.0,
            x.as_ptr().cast(),
            w.as_ptr().cast(),
            0.0,
            y.as_mut_ptr().cast(),
            dims.as_ptr(),
            bytes.as_ptr(),
            host.as_mut_ptr().cast(),
            workspace[0],
            null_mut(),
        );
        assert_eq!(status, S::MUCUDNN_STATUS_SUCCESS, "{}", last_error());
        assert_eq!(y[9], 0.5 * x[0] + 2.0 * x[9]);
        // Backward-data: w, dy -> dx (same dims reordered); refused, nothing written.
        let data_dims: [i64; 15] = [2, 2, 1, 1, 1, 2, 2, 1, 3, 3, 2, 2, 1, 3, 3];
        let data_bytes: [u64; 3] = [16, 36 * 4, 36 * 4];
        let mut dx = vec![-7.0f32; 36];
        let status = mucudnnTunerExecute(
            tuner,
            set,
            MUCUDNN_OP_BACKWARD_DATA,
            1.0,
            w.as_ptr().cast(),
            y.as_ptr().cast(),
            0.0,
            dx.as_mut_ptr().cast(),
            data_dims.as_ptr(),
            data_bytes.as_ptr(),
            null_mut(),
            0,
            null_mut(),
        );
        assert_eq!(status, S::MUCUDNN_STATUS_INVALID_ARGUMENT);
        assert!(
            last_error().contains(&format!("plan set {set} holds no bwd_data plan")),
            "{}",
            last_error()
        );
        assert!(dx.iter().all(|&v| v == -7.0));
        assert_eq!(mucudnnTunerDestroy(tuner), S::MUCUDNN_STATUS_SUCCESS);
    }
}

/// The message a tuner call with these settings fails with (INVALID_ARGUMENT).
fn settings_error(text: &str) -> String {
    match tuner::parse_settings(text, tuner::TunerDevice::Cpu) {
        Ok(_) => panic!("{text}: accepted"),
        Err(e) => {
            assert_eq!(
                e.status(),
                mucudnnStatus_t::MUCUDNN_STATUS_INVALID_ARGUMENT,
                "{text}"
            );
            e.to_string()
        }
    }
}

/// Every enumerated value of a settings or options document is taken exactly as documented
/// (lowercase), and an unknown one lists the accepted values.
#[test]
fn enumerated_settings_take_one_case_rule() {
    for (key, good, wrong, accepted) in [
        (
            "policy",
            "power-of-two",
            "Power-Of-Two",
            "undivided, power-of-two, all",
        ),
        ("policy", "all", "ALL", "undivided, power-of-two, all"),
        ("candidates", "engines", "Engines", "legacy, engines, all"),
        ("split", "spatial", "SPATIAL", "batch, spatial, auto"),
    ] {
        settings(&format!(r#"{{"{key}": "{good}"}}"#));
        let message = settings_error(&format!(r#"{{"{key}": "{wrong}"}}"#));
        assert!(
            message.starts_with(&format!("settings: {key}: unknown ")),
            "{message}"
        );
        assert!(message.contains(&format!("`{wrong}`")), "{message}");
        assert!(message.contains(accepted), "{message}");
    }
    let message = settings_error(r#"{"ops": ["Fwd"]}"#);
    assert!(message.contains("unknown op `Fwd`"), "{message}");
    let message = solve::parse_options(Some(r#"{"policy": "All"}"#))
        .unwrap_err()
        .to_string();
    assert!(
        message.contains("options: policy: unknown policy `All`"),
        "{message}"
    );
}

/// A document that says two things is refused: a key given twice (serde_json kept the last),
/// and no_cache with a cache path (the path was ignored).
#[test]
fn contradictory_documents_are_refused() {
    for text in [
        r#"{"policy": "all", "policy": "undivided"}"#,
        r#"{"deterministic": true, "deterministic": true}"#,
        r#"{"ops": ["fwd"], "split": "batch", "ops": ["bwd_data"]}"#,
    ] {
        let message = settings_error(text);
        assert!(message.contains("is given twice"), "{text}: {message}");
    }
    let options = |text: &str| tuner::TunerOptions::parse(text).map(|_| ());
    let message = options(r#"{"no_cache": true, "cache": "/tmp/x.sqlite"}"#)
        .unwrap_err()
        .to_string();
    assert!(
        message.contains("no_cache is true and cache names a file"),
        "{message}"
    );
    let message = options(r#"{"verbose": false, "verbose": true}"#)
        .unwrap_err()
        .to_string();
    assert!(
        message.starts_with("options_json: key `verbose` is given twice"),
        "{message}"
    );
    // Not contradictions: no_cache false with a path, no_cache with the default location.
    options(r#"{"no_cache": false, "cache": "/tmp/x.sqlite"}"#).unwrap();
    options(r#"{"no_cache": true, "cache": null}"#).unwrap();
    let message = solve::parse_options(Some(r#"{"workspace_limit": 1, "workspace_limit": 2}"#))
        .unwrap_err()
        .to_string();
    assert!(message.contains("is given twice"), "{message}");
    // JSON arguments too: a problem with `n` twice.
    let problem = r#"{"n": 2, "c": 2, "h": 3, "w": 3, "k": 2, "r": 1, "s": 1, "pad_h": 0,
        "pad_w": 0, "stride_h": 1, "stride_w": 1, "dilation_h": 1, "dilation_w": 1,
        "groups": 1, "dtype": "fp32", "layout": "nchw", "n": 4}"#;
    let tuner = cpu_tuner();
    let (status, _) = tune_through_c(tuner, "l", problem, None);
    assert_eq!(status, mucudnnStatus_t::MUCUDNN_STATUS_INVALID_ARGUMENT);
    // SAFETY: a live output and NUL-terminated strings.
    unsafe {
        assert!(last_error().contains("problem_json"), "{}", last_error());
        assert!(last_error().contains("`n`"), "{}", last_error());
        let mut other: mucudnnTuner_t = null_mut();
        let status = mucudnnTunerCreate(
            &mut other,
            MUCUDNN_DEVICE_CPU,
            c(r#"{"no_cache": true, "cache": "/tmp/mucudnn-never.sqlite"}"#).as_ptr(),
        );
        assert_eq!(status, mucudnnStatus_t::MUCUDNN_STATUS_INVALID_ARGUMENT);
        assert!(other.is_null());
        assert_eq!(
            mucudnnTunerDestroy(tuner),
            mucudnnStatus_t::MUCUDNN_STATUS_SUCCESS
        );
    }
}

/// A huge value (a 10 MB policy, a 2-million-element array) makes a short message: every
/// echoed value is bounded, and so is every last error.
#[test]
fn errors_echo_bounded_values() {
    // The reported cases (a 10 MB policy, a 2-million-element array), and the other keys with
    // values of 100 KB: longer only costs the test time.
    let huge = "p".repeat(10_000_000);
    let array = format!("[{}]", vec!["1"; 2_000_000].join(","));
    let long = "p".repeat(100_000);
    let long_array = format!("[{}]", vec!["1"; 50_000].join(","));
    let tuner = cpu_tuner();
    let problem = serde_json::to_string(&ConvProblem::new(2, 2, 3, 3, 2, 1, 1)).unwrap();
    // SAFETY: live outputs and NUL-terminated strings.
    unsafe {
        for settings in [
            format!(r#"{{"policy": "{huge}"}}"#),
            format!(r#"{{"ops": {array}}}"#),
            format!(r#"{{"split": "{long}"}}"#),
            format!(r#"{{"candidates": "{long}"}}"#),
            format!(r#"{{"ops": ["{long}"]}}"#),
            format!(r#"{{"ops": [{{"{long}": 1}}]}}"#),
            format!(r#"{{"workspace_limit": "{long}"}}"#),
            format!(r#"{{"{long}": 1}}"#),
            format!(r#"{{"policy": {long_array}}}"#),
            long_array.clone(),
        ] {
            let (status, _) = tune_through_c(tuner, "l", &problem, Some(&settings));
            assert_eq!(status, mucudnnStatus_t::MUCUDNN_STATUS_INVALID_ARGUMENT);
            let message = last_error();
            assert!(
                message.len() <= 1000,
                "{} bytes: {}",
                message.len(),
                &message[..300]
            );
        }
        let message = settings_error(&format!(r#"{{"policy": "{long}"}}"#));
        assert!(
            message.contains("… (100000 characters)"),
            "{}",
            &message[..300]
        );
        // JSON arguments and a long layer name: the last error is bounded whatever it quotes.
        tune_through_c(tuner, "l", &format!(r#"{{"n": "{long}"}}"#), None);
        assert!(last_error().len() <= 1000, "{}", last_error().len());
        let bad = serde_json::to_string(&ConvProblem::new(-2, 2, 3, 3, 2, 1, 1)).unwrap();
        tune_through_c(tuner, &long, &bad, None);
        assert!(
            last_error().contains("n must be positive"),
            "{}",
            &last_error()[..300]
        );
        assert!(
            last_error().len() <= error::MAX_MESSAGE_CHARS + 100,
            "{}",
            last_error().len()
        );
        let options = c(&format!(r#"{{"cache": {long_array}}}"#));
        let mut other: mucudnnTuner_t = null_mut();
        mucudnnTunerCreate(&mut other, MUCUDNN_DEVICE_CPU, options.as_ptr());
        assert!(last_error().len() <= 1000, "{}", last_error().len());
        assert_eq!(
            mucudnnTunerDestroy(tuner),
            mucudnnStatus_t::MUCUDNN_STATUS_SUCCESS
        );
    }
}

/// A CPU tuner runs plan sets given no workspace (NULL, 0 bytes) on one host workspace of its
/// own, grown to the largest plan's, with the results of a caller's workspace: a caller needs
/// no buffer per shape.
#[test]
fn cpu_tuner_executes_on_its_own_shared_workspace() {
    use mucudnnStatus_t as S;
    let tuner = cpu_tuner();
    // SAFETY: live outputs, NUL-terminated strings, and x, w, y of the dims and bytes given.
    unsafe {
        for (h, w) in [(8, 8), (12, 6), (8, 8)] {
            let problem = ConvProblem {
                pad_h: 1,
                pad_w: 1,
                ..ConvProblem::new(2, 3, h, w, 4, 3, 3)
            };
            let text = serde_json::to_string(&problem).unwrap();
            let (status, doc) = tune_through_c(tuner, "shared", &text, Some(r#"{"ops": ["fwd"]}"#));
            assert_eq!(status, S::MUCUDNN_STATUS_SUCCESS, "{}", last_error());
            let mut doc = doc.unwrap();
            // im2col over whole micro-batches: a plan that needs a workspace.
            for mb in doc["plans"][0]["micro_batches"].as_array_mut().unwrap() {
                mb["algo"] = serde_json::json!(1);
            }
            let plans = c(&doc["plans"].to_string());
            let (mut set, mut workspace) = (0u64, [0u64; 3]);
            let status =
                mucudnnTunerPrepare(tuner, plans.as_ptr(), &mut set, workspace.as_mut_ptr());
            assert_eq!(status, S::MUCUDNN_STATUS_SUCCESS, "{}", last_error());
            assert!(workspace[0] > 0);
            let [x_len, w_len, y_len] = [
                problem.input_dims(),
                problem.filter_dims(),
                problem.output_dims(),
            ]
            .map(|d| d.iter().product::<i64>() as usize);
            let x: Vec<f32> = (0..x_len).map(|i| (i % 7) as f32 - 3.0).collect();
            let wt: Vec<f32> = (0..w_len).map(|i| (i % 5) as f32 * 0.25).collect();
            let dims: Vec<i64> = [
                problem.input_dims(),
                problem.filter_dims(),
                problem.output_dims(),
            ]
            .concat();
            let bytes = [x_len, w_len, y_len].map(|n| 4 * n as u64);
            let run = |workspace_ptr: *mut c_void, workspace_bytes: u64| {
                let mut y = vec![f32::NAN; y_len];
                let status = mucudnnTunerExecute(
                    tuner,
                    set,
                    MUCUDNN_OP_FORWARD,
                    1.0,
                    x.as_ptr().cast(),
                    wt.as_ptr().cast(),
                    0.0,
                    y.as_mut_ptr().cast(),
                    dims.as_ptr(),
                    bytes.as_ptr(),
                    workspace_ptr,
                    workspace_bytes,
                    null_mut(),
                );
                (status, y)
            };
            let mut own = vec![0u32; (workspace[0] as usize).div_ceil(4)];
            let (status, with_callers) = run(own.as_mut_ptr().cast(), workspace[0]);
            assert_eq!(status, S::MUCUDNN_STATUS_SUCCESS, "{}", last_error());
            let (status, with_tuners) = run(null_mut(), 0);
            assert_eq!(status, S::MUCUDNN_STATUS_SUCCESS, "{}", last_error());
            assert_eq!(with_callers, with_tuners);
            assert!(with_tuners.iter().all(|v| v.is_finite()));
            // A NULL workspace said to have bytes is still refused.
            assert_eq!(run(null_mut(), 8).0, S::MUCUDNN_STATUS_INVALID_ARGUMENT);
        }
        assert_eq!(mucudnnTunerDestroy(tuner), S::MUCUDNN_STATUS_SUCCESS);
    }
}

/// A tensor past 2^31 elements is mucudnn's to split, not an invalid argument: a long fp16
/// video (1 x 128 x 81 x 480 x 832, 4,140,564,480 elements) whose calls cannot fit 32-bit
/// indexing in NCDHW (a chunk's view spans every channel) is NOT_SUPPORTED, saying why, at
/// once (nothing is allocated), so a caller falls back; a plan that takes it whole is
/// refused before it runs.
#[test]
fn a_tensor_past_2_pow_31_elements_is_split_or_not_supported_with_the_reason() {
    let video = ConvProblem {
        pad_d: 1,
        pad_h: 1,
        pad_w: 1,
        dtype: crate::solver::DType::Fp16,
        ..ConvProblem::new_3d(1, 128, 81, 480, 832, 128, 3, 3, 3)
    };
    video.validate().unwrap();
    let mut tuner = memory_tuner();
    for (split, reason) in [
        ("auto", "channels-last (nhwc) chunks span only their rows"),
        (
            "spatial",
            "channels-last (nhwc) chunks span only their rows",
        ),
        ("batch", "a spatial split"),
    ] {
        let settings = settings(&format!(r#"{{"split": "{split}", "ops": ["fwd"]}}"#));
        let started = std::time::Instant::now();
        let error = tuner.tune("video", &video, &settings).unwrap_err();
        assert_eq!(
            error.status(),
            mucudnnStatus_t::MUCUDNN_STATUS_NOT_SUPPORTED,
            "{split}: {error}"
        );
        let message = error.to_string();
        assert!(message.starts_with("video: fwd "), "{message}");
        assert!(message.contains("32-bit indexing"), "{message}");
        assert!(message.contains(reason), "{split}: {message}");
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
    }
    // A plan running the whole video in one call (as a hand-made plan might) is refused.
    let whole = crate::solver::Plan {
        layer: "video".into(),
        problem: video,
        op: ConvOp::Forward,
        split: crate::solver::SplitDim::Batch,
        micro_batches: vec![crate::solver::MicroBatch {
            size: 1,
            algo: crate::solver::Algo::Legacy(0),
            workspace_bytes: 0,
            time_ms: 1.0,
        }],
    };
    let error = tuner.prepare(vec![whole]).unwrap_err().to_string();
    assert!(error.contains("32-bit indexing"), "{error}");
}
