//! Teardown of plans run on a caller's stream, on a GPU: releasing a
//! prepared plan waits for the work it queued on the caller's stream, and a plan captured into
//! a CUDA graph is parked, so the graph still replays correctly after the plan is released.
//!
//! The decisions themselves (when to wait, when to park) are tested on the CPU in
//! `src/exec/teardown.rs`; these tests check the CUDA side. Run on a GPU machine with
//! `cargo test --test gpu_teardown -- --include-ignored`.

use cudarc::driver::{sys, CudaContext, CudaSlice, CudaStream, DevicePtr};
use mucudnn::backend::cudnn::{
    engine_configs, CudnnHandle, DeviceOperands, EngineSearch, RawDeviceView, RawDeviceViewMut,
    RawWorkspace,
};
use mucudnn::exec::cudnn::{parked_plans, PreparedPlan};
use mucudnn::solver::{Algo, ConvOp, ConvProblem, DType, MathMode, MicroBatch, Plan};
use std::sync::Arc;

/// A forward convolution heavy enough that 20 calls are still running when the host returns,
/// on any GPU: about 59 GFLOP a call in fp32 with FMA math (TF32 tensor cores would run it in
/// well under a millisecond on an H100 or H200, while queueing a call's four micro-batches
/// costs the host tens of microseconds), split in four micro-batches: two legacy
/// IMPLICIT_GEMM (no workspace) and, where the graph API is there, two of an engine
/// configuration without workspace.
fn plan(handle: &CudnnHandle) -> Plan {
    let problem = control_problem();
    let micro = problem.with_batch(16);
    let engine = engine_configs(handle, &micro, ConvOp::Forward, &EngineSearch::default())
        .ok()
        .and_then(|configs| {
            configs.into_iter().find(|c| {
                mucudnn::backend::cudnn::EnginePlan::new(
                    handle,
                    &micro,
                    ConvOp::Forward,
                    c,
                    1.0,
                    0.0,
                )
                .is_ok_and(|p| p.workspace_bytes() == 0)
            })
        });
    let algo = |i: usize| match (&engine, i) {
        (Some(config), 2 | 3) => Algo::Engine(config.name()),
        _ => Algo::Legacy(0),
    };
    Plan {
        layer: "teardown".into(),
        problem,
        op: ConvOp::Forward,
        split: mucudnn::solver::SplitDim::Batch,
        micro_batches: (0..4)
            .map(|i| MicroBatch {
                size: 16,
                algo: algo(i),
                workspace_bytes: 0,
                time_ms: 1.0,
            })
            .collect(),
    }
}

/// The convolution `plan` splits (see there).
fn control_problem() -> ConvProblem {
    ConvProblem {
        pad_h: 1,
        pad_w: 1,
        math: MathMode::Fma,
        ..ConvProblem::new(64, 128, 56, 56, 128, 3, 3)
    }
}

/// A forward problem's work in GFLOP (two per multiply-add).
fn gflop(p: &ConvProblem) -> f64 {
    let (out_h, out_w) = p.output_hw();
    2.0 * (p.n * p.k * out_h * out_w * p.c / p.groups * p.r * p.s) as f64 / 1e9
}

/// On the CPU, what the GPU test's control stands on: no TF32, and work enough that a call
/// takes about a millisecond even at the FP32 rate of an H200 (about 60 TFLOP/s).
#[test]
fn the_control_problem_is_heavy_and_has_no_tf32() {
    let problem = control_problem();
    assert_eq!(problem.math, MathMode::Fma);
    assert!(gflop(&problem) > 50.0, "{}", gflop(&problem));
}

struct Operands {
    x: CudaSlice<f32>,
    w: CudaSlice<f32>,
    y: CudaSlice<f32>,
}

impl Operands {
    fn new(stream: &Arc<CudaStream>, problem: &ConvProblem) -> Self {
        let (p, q) = problem.output_hw();
        let len = |dims: [i64; 4]| dims.iter().map(|&d| d as usize).product::<usize>();
        let pattern = |n: usize, scale: f32| {
            (0..n)
                .map(|i| ((i * 7919) % 1013) as f32 * scale - 0.5)
                .collect::<Vec<f32>>()
        };
        Operands {
            x: stream
                .clone_htod(&pattern(
                    len([problem.n, problem.c, problem.h, problem.w]),
                    1e-3,
                ))
                .unwrap(),
            w: stream
                .clone_htod(&pattern(
                    len([problem.k, problem.c, problem.r, problem.s]),
                    1e-4,
                ))
                .unwrap(),
            y: stream
                .alloc_zeros(len([problem.n, problem.k, p, q]))
                .unwrap(),
        }
    }

    /// `(address, elements)` of x, w and y, taken outside any capture (cudarc records its
    /// own events when a pointer is taken).
    fn raw(&self, stream: &Arc<CudaStream>) -> [(u64, usize); 3] {
        let at = |s: &CudaSlice<f32>| {
            let (ptr, _guard) = s.device_ptr(stream);
            (ptr, s.len())
        };
        [at(&self.x), at(&self.w), at(&self.y)]
    }
}

/// Queues `calls` forward executions of `prepared` on `stream` over the operands at `raw`.
fn run(
    handle: &CudnnHandle,
    prepared: &PreparedPlan,
    stream: &CudaStream,
    raw: [(u64, usize); 3],
    calls: usize,
) {
    let [(x, xl), (w, wl), (y, yl)] = raw;
    // SAFETY: the three buffers are live device memory of GPU 0 with those element counts in
    // fp32 (`Operands::raw`), `y` overlaps neither input, and they outlive the work (the test
    // synchronises, or the plan's teardown waits, before they are freed); the stream is a live
    // stream of GPU 0's primary context, the handle's.
    unsafe {
        let a = RawDeviceView::new(x as *const _, xl, DType::Fp32).unwrap();
        let b = RawDeviceView::new(w as *const _, wl, DType::Fp32).unwrap();
        let mut out = RawDeviceViewMut::new(y as *mut _, yl, DType::Fp32).unwrap();
        let session = handle.on_stream(stream.cu_stream() as *mut _).unwrap();
        for _ in 0..calls {
            prepared
                .execute_on(
                    &session,
                    1.0,
                    0.0,
                    DeviceOperands::new(&a, &b, &mut out, &mut RawWorkspace::empty()),
                )
                .unwrap();
        }
    }
}

fn stream_done(stream: &CudaStream) -> bool {
    // SAFETY: a live stream.
    let status = unsafe { sys::cuStreamQuery(stream.cu_stream()) };
    match status {
        sys::CUresult::CUDA_SUCCESS => true,
        sys::CUresult::CUDA_ERROR_NOT_READY => false,
        other => panic!("cuStreamQuery: {other:?}"),
    }
}

#[test]
#[ignore = "needs a GPU: releasing a plan waits for its work on the caller's stream"]
fn releasing_a_plan_waits_for_the_callers_stream() {
    let handle = CudnnHandle::new(0).unwrap();
    let context = CudaContext::new(0).unwrap();
    let stream = context.new_stream().unwrap();
    let plan = plan(&handle);
    let o = Operands::new(&stream, &plan.problem);
    let raw = o.raw(&stream);
    stream.synchronize().unwrap();
    let prepared = PreparedPlan::new(&handle, plan.clone()).unwrap();
    run(&handle, &prepared, &stream, raw, 20);
    assert_eq!(prepared.fenced_streams(), 1);
    assert!(!prepared.will_park());
    // The control: the work is still queued when the calls return (nothing waited).
    assert!(
        !stream_done(&stream),
        "20 calls of {:.0} GFLOP finished before the host returned: make the problem larger",
        gflop(&plan.problem)
    );
    let parked = parked_plans();
    drop(prepared);
    // Releasing waited for the caller's stream: nothing of the plan is left to run.
    assert!(stream_done(&stream));
    assert_eq!(parked_plans(), parked);
}

#[test]
#[ignore = "needs a GPU: a plan captured in a CUDA graph is parked and the graph replays"]
fn a_captured_plan_is_parked_and_the_graph_replays() {
    let handle = CudnnHandle::new(0).unwrap();
    let context = CudaContext::new(0).unwrap();
    let stream = context.new_stream().unwrap();
    let plan = plan(&handle);
    let mut o = Operands::new(&stream, &plan.problem);
    let raw = o.raw(&stream);
    // The reference: an eager run.
    let eager = PreparedPlan::new(&handle, plan.clone()).unwrap();
    run(&handle, &eager, &stream, raw, 1);
    stream.synchronize().unwrap();
    let expected = stream.clone_dtoh(&o.y).unwrap();
    drop(eager);
    // Capture one call, then release the plan before replaying the graph.
    let captured = PreparedPlan::new(&handle, plan).unwrap();
    stream.memset_zeros(&mut o.y).unwrap();
    stream.synchronize().unwrap();
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
    run(&handle, &captured, &stream, raw, 1);
    let graph = stream
        .end_capture(sys::CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("a captured graph");
    assert!(captured.will_park());
    assert_eq!(captured.fenced_streams(), 0);
    let parked = parked_plans();
    drop(captured);
    assert_eq!(parked_plans(), parked + 1);
    for _ in 0..3 {
        graph.launch().unwrap();
    }
    stream.synchronize().unwrap();
    let replayed = stream.clone_dtoh(&o.y).unwrap();
    assert_eq!(replayed.len(), expected.len());
    let worst = replayed
        .iter()
        .zip(&expected)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(worst <= 1e-3, "the replayed graph differs by {worst}");
}
