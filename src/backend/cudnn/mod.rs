//! cuDNN backend: run and time cuDNN's convolutions on an NVIDIA GPU: the legacy algorithms
//! (`cudnnConvolution*` with an algorithm number) and the graph API's engine configurations
//! ([`engine_configs`], [`EnginePlan`]).
//!
//! # Layering
//!
//! ```text
//! cudarc::{driver, cudnn}::sys      raw bindings, loaded at run time (dynamic-loading)
//!         |                          (panic when a library or symbol is missing)
//! cudarc::{driver, cudnn}::result   thin Result-returning wrappers, still `unsafe`
//!         |
//! wall (this module's FFI wall)     the only code that names the two layers above and the
//!         |                          only `unsafe` code: availability gates, RAII handle and
//!         |                          descriptors, bounds-checked device views, workspace
//!         |                          queries, execution, timing. Exports safe items only.
//! mod  (re-exports), shape, host    pure helpers: cuDNN shapes of a problem, operand roles,
//!         |                          micro-batch ranges, random data, a host reference;
//!         |                          engine_name, engine_search, graph_params: the graph
//!         |                          API's names, search options and descriptor values
//!         v
//! profiler / executor (later)       measure every algorithm per micro-batch size, solve,
//!                                    run a plan's micro-batches
//! ```
//!
//! # Availability
//!
//! The crate builds and runs without CUDA: cudarc loads `libcuda` and `libcudnn` on first
//! use, and this backend checks for them first, so a missing library, an old driver (the
//! bindings are for CUDA 13.0), a cuDNN other than 9.x, or a machine without a visible GPU is
//! a [`CudnnError`] ([`CudnnError::is_unavailable`]), never a panic. [`probe`] reports what is
//! there.
//!
//! # Use
//!
//! ```no_run
//! use mucudnn::backend::cudnn::{
//!     ConvDescriptors, CudnnHandle, DeviceOperands, Operand, Surface, WorkspaceView,
//! };
//! use mucudnn::solver::{ConvOp, ConvProblem};
//!
//! # fn main() -> Result<(), mucudnn::backend::cudnn::CudnnError> {
//! let handle = CudnnHandle::new(0)?;
//! let problem = ConvProblem { pad_h: 1, pad_w: 1, ..ConvProblem::new(64, 32, 28, 28, 64, 3, 3) };
//! let full = ConvDescriptors::new(&problem)?;
//! let x = handle.alloc_random(problem.dtype, full.shapes().elements(Operand::Input), 1)?;
//! let w = handle.alloc_random(problem.dtype, full.shapes().elements(Operand::Filter), 2)?;
//! let mut y = handle.alloc_operand(&full, Operand::Output)?;
//!
//! // Forward in two micro-batches of 32, with algorithm 1.
//! let micro = ConvDescriptors::new(&problem.with_batch(32))?;
//! let bytes = handle.workspace_size(&micro, ConvOp::Forward, 1)?.expect("supported");
//! let mut workspace = handle.alloc_workspace(bytes)?;
//! for first in [0, 32] {
//!     let (xo, xl) = full.shapes().sample_range(Operand::Input, first, 32).unwrap();
//!     let (yo, yl) = full.shapes().sample_range(Operand::Output, first, 32).unwrap();
//!     let (xv, wv) = (x.view(xo, xl)?, w.view_all());
//!     let (mut yv, mut wsv) = (y.view_mut(yo, yl)?, workspace.view());
//!     let operands = DeviceOperands::new(&xv, &wv, &mut yv, &mut wsv);
//!     handle.convolve(&micro, ConvOp::Forward, 1, 1.0, 0.0, operands)?;
//! }
//! let y_host = y.download()?;
//! # let _: (Vec<f32>, WorkspaceView) = (y_host, WorkspaceView::empty());
//! # Ok(()) }
//! ```
//!
//! # Engine configurations (graph API)
//!
//! A second source of candidates: for a problem at one micro-batch size and one op,
//! [`engine_configs`] asks cuDNN's heuristics (and optionally sweeps every engine's knobs)
//! for [`EngineConfig`]s, named like the cuDNN frontend names plans (`eng38_k2=8_k13=1`); an
//! [`EnginePlan`] is one of them built for (problem at that size, op, alpha, beta), once, and
//! executed like `convolve` on micro-batch views. Backward-filter's accumulating micro-batches
//! need a second plan built with beta 1.
//!
//! ```no_run
//! use mucudnn::backend::cudnn::{
//!     engine_configs, CudnnHandle, DeviceOperands, EnginePlan, EngineSearch, Operand,
//! };
//! use mucudnn::backend::cudnn::ConvShapes;
//! use mucudnn::solver::{ConvOp, ConvProblem};
//!
//! # fn main() -> Result<(), mucudnn::backend::cudnn::CudnnError> {
//! let handle = CudnnHandle::new(0)?;
//! let problem = ConvProblem { pad_h: 1, pad_w: 1, ..ConvProblem::new(64, 32, 28, 28, 64, 3, 3) };
//! let full = ConvShapes::new(&problem)?;
//! let x = handle.alloc_random(problem.dtype, full.elements(Operand::Input), 1)?;
//! let w = handle.alloc_random(problem.dtype, full.elements(Operand::Filter), 2)?;
//! let mut y = handle.alloc_zeroed(problem.dtype, full.elements(Operand::Output))?;
//!
//! // Candidates for micro-batches of 32; build the first that cuDNN accepts, time it.
//! let micro = problem.with_batch(32);
//! let search = EngineSearch { max_candidates: 16, ..EngineSearch::default() };
//! let configs = engine_configs(&handle, &micro, ConvOp::Forward, &search)?;
//! let plan = configs
//!     .iter()
//!     .find_map(|c| EnginePlan::new(&handle, &micro, ConvOp::Forward, c, 1.0, 0.0).ok())
//!     .expect("a supported configuration");
//! let mut workspace = handle.alloc_workspace(plan.workspace_bytes())?;
//! let timer = handle.timer()?;
//! let ms = timer.time(|| {
//!     for first in [0, 32] {
//!         let (xo, xl) = full.sample_range(Operand::Input, first, 32).unwrap();
//!         let (yo, yl) = full.sample_range(Operand::Output, first, 32).unwrap();
//!         let (xv, wv) = (x.view(xo, xl)?, w.view_all());
//!         let (mut yv, mut wsv) = (y.view_mut(yo, yl)?, workspace.view());
//!         plan.execute(&handle, DeviceOperands::new(&xv, &wv, &mut yv, &mut wsv))?;
//!     }
//!     Ok(())
//! })?;
//! println!("{} ({} workspace bytes): {ms} ms for the mini-batch", plan.config(), plan.workspace_bytes());
//! # Ok(()) }
//! ```
//!
//! # Safety
//!
//! Apart from the C ABI's foreign objects (below), no function or method here is `unsafe` to
//! call. The contract that cuDNN's raw pointers need is enforced by construction and checked
//! at run time (see the `wall` module docs):
//! device pointers exist only inside views that borrow a live buffer and were bounds-checked;
//! every call ([`Surface::convolve`], [`EnginePlan::execute`]) checks dtype, exact element
//! count against the descriptor, stream, and workspace size before calling cuDNN; work is
//! stream-ordered with frees.
//! What remains the caller's business is *meaning*, not memory safety: which micro-batch
//! range goes with which descriptors, and `beta` (0 overwrites, 1 accumulates).
//!
//! The C ABI's foreign objects ([`ForeignHandle`], views of a caller's pointers
//! ([`RawDeviceView`], [`RawDeviceViewMut`], [`RawWorkspace`]) or of a framework's cudarc
//! buffers ([`DeviceView::from_cudarc`]), the `read_*_descriptor` functions) are the exception:
//! a caller's handle, descriptors and pointers can only be trusted, not proven, so their
//! constructors are `unsafe fn`s whose
//! `# Safety` sections are the contract `include/mucudnn.h` states. What can be checked is
//! checked: null pointers, one libcudnn per process, operand memory that CUDA knows on the
//! right GPU, overlapping outputs, element counts and workspace sizes.

mod engine_name;
mod engine_search;
mod error;
pub mod graph_params;
pub mod host;
pub mod known_bad;
pub mod shape;
mod wall;

pub use engine_name::{EngineConfig, EngineNameError};
pub use engine_search::{
    knob_combinations, legacy_deterministic, EngineNotes, EngineSearch, HeurMode, KnobRange,
    DEFAULT_MAX_CANDIDATES, MAX_VALUES_PER_KNOB,
};
pub use error::CudnnError;
pub use graph_params::{Alignments, ChunkShapes};
pub use shape::{operand_roles, ConvShapes, Nd, Operand};
pub use wall::{
    algo_count, algo_name, cudnn_version, library_status, probe, AlgoWorkspace, ConvDescriptors,
    ConvolutionDescriptor, CudnnHandle, DeviceBuffer, DeviceInfo, FilterDescriptor, FoundAlgorithm,
    GpuTimer, LibraryStatus, SystemInfo, TensorDescriptor, Workspace, CUDNN_MAJOR,
    MIN_DRIVER_VERSION,
};
#[doc(hidden)]
pub use wall::{
    broken_graph_on_device, heuristic_plan_workspaces, heuristic_plan_workspaces_on_device,
    time_variant_packs, BrokenGraph,
};
/// A C caller's cuDNN objects, for the C ABI ([`crate::c_abi`]): its handle and stream, its
/// descriptors, raw device pointers (`unsafe` constructors with a `# Safety` contract), and the
/// workspace mucudnn allocates for it.
pub use wall::{
    check_one_libcudnn, read_convolution_descriptor, read_filter_descriptor,
    read_tensor_descriptor, save_current_context, ConvolutionDescriptorInfo, CurrentContextGuard,
    DataTypeCode, DropInCallerContext, FilterDescriptorInfo, ForeignHandle, ForeignSession,
    ForeignWorkspace, TensorDescriptorInfo,
};
/// Two outputs compared on the GPU with cuDNN's tensor ops (verified tuning).
pub use wall::{compare_api, ComparisonDescriptors, ComparisonInfo, OutputComparison};
/// Convolution through cuDNN's graph (backend) API: engine configurations as a second
/// candidate source beside the legacy algorithms (see `wall/graph.rs` for the data flow).
pub use wall::{engine_configs, engine_configs_with_alignments, graph_api_status, EnginePlan};
/// One spatial chunk's call: configurations and plans on views of the full tensors.
pub use wall::{
    engine_configs_for_chunk, engine_configs_for_chunk_on_device, plan_for_chunk_on_device,
};
/// The graph API on a device description instead of a GPU (cuDNN >= 9.8): operation graphs,
/// heuristics and execution plans (which report their workspace but cannot run). The host
/// test tier (`tests/cudnn_host.rs`) uses it with the H100 description.
pub use wall::{
    engine_configs_on_device, plan_on_device, DeviceDescription, DevicePlan,
    DEVICE_DESCRIPTION_MIN_VERSION,
};
/// mucudnn's own handle on a caller's stream, pointers and workspace (the PyTorch path).
pub use wall::{stream_is_capturing, StreamFence, StreamKey, StreamSession};
/// One call surface ([`Surface`]: mucudnn's handle, or a session on a caller's stream), one
/// view type per access over every source of a pointer ([`Origin`]), and a call's operands by
/// role ([`ConvOperands`]).
pub use wall::{
    ConvOperands, DeviceOperands, DeviceView, DeviceViewMut, Origin, Raw, RawDeviceView,
    RawDeviceViewMut, RawWorkspace, Surface, Tracked, WorkspaceView,
};

#[cfg(test)]
mod tests {
    #![forbid(unsafe_code)]

    use super::*;
    use crate::solver::{ConvOp, ConvProblem, DType, Layout, MathMode};

    fn small_problem() -> ConvProblem {
        ConvProblem {
            pad_h: 1,
            pad_w: 1,
            ..ConvProblem::new(4, 8, 10, 9, 16, 3, 3)
        }
    }

    // ---- tests that run anywhere

    #[test]
    fn probe_without_gpu_is_a_clear_error_not_a_panic() {
        let libs = library_status();
        match probe() {
            Ok(info) => {
                // A GPU machine: the probe must describe at least one device.
                assert!(!info.devices.is_empty());
                println!("probe: {info:?}");
            }
            Err(e) => {
                let message = e.to_string();
                println!("probe error (expected without a GPU): {message}");
                assert!(e.is_unavailable(), "{e:?}");
                if !libs.libcuda {
                    assert!(
                        matches!(
                            e,
                            CudnnError::Unavailable {
                                what: "libcuda",
                                ..
                            }
                        ),
                        "{e:?}"
                    );
                    assert!(message.contains("libcuda.so"), "{message}");
                    assert!(message.contains("driver"), "{message}");
                } else if !libs.libcudnn {
                    assert!(message.contains("libcudnn"), "{message}");
                    assert!(message.contains("LD_LIBRARY_PATH"), "{message}");
                }
                // Asking again gives the same answer (cached, still no panic).
                assert_eq!(probe().unwrap_err(), e);
            }
        }
    }

    #[test]
    fn without_libraries_everything_is_an_error() {
        let libs = library_status();
        if !libs.libcudnn {
            let e = ConvDescriptors::new(&small_problem()).unwrap_err();
            assert!(
                matches!(
                    e,
                    CudnnError::Unavailable {
                        what: "libcudnn",
                        ..
                    }
                ),
                "{e:?}"
            );
            let message = e.to_string();
            assert!(message.contains("libcudnn.so not found"), "{message}");
            assert!(message.contains("LD_LIBRARY_PATH"), "{message}");
            assert!(message.contains("install cuDNN 9"), "{message}");
            let s = ConvShapes::new(&small_problem()).unwrap();
            assert!(TensorDescriptor::new(DType::Fp32, Layout::Nchw, &s.input).is_err());
            assert!(FilterDescriptor::new(DType::Fp32, Layout::Nchw, &s.filter).is_err());
            assert!(ConvolutionDescriptor::new(&s).is_err());
        }
        if !libs.libcuda || !libs.libcudnn {
            let e = CudnnHandle::new(0).unwrap_err();
            assert!(e.is_unavailable(), "{e:?}");
            assert!(CudnnHandle::new(7).is_err());
        }
    }

    #[test]
    fn invalid_problem_is_reported_before_any_library_is_needed() {
        let bad = ConvProblem {
            groups: 3,
            ..small_problem()
        };
        let e = ConvDescriptors::new(&bad).unwrap_err();
        assert!(matches!(e, CudnnError::Shape(_)), "{e:?}");
        assert!(e.to_string().starts_with("invalid convolution problem"));
        let negative = ConvProblem {
            n: -4,
            ..small_problem()
        };
        assert!(matches!(
            ConvDescriptors::new(&negative),
            Err(CudnnError::Shape(_))
        ));
    }

    // ---- tests that need a GPU: #[ignore = "needs a GPU: ..."], run on the GPU machine by
    // scripts/gpu/accept.sh (wall) with --include-ignored

    /// Host data for `problem`'s three tensors, rounded to its dtype.
    struct HostData {
        x: Vec<f32>,
        w: Vec<f32>,
        dy: Vec<f32>,
    }

    impl HostData {
        fn new(problem: &ConvProblem) -> Self {
            let s = ConvShapes::new(problem).unwrap();
            HostData {
                x: host::random_values(problem.dtype, s.elements(Operand::Input), 11),
                w: host::random_values(problem.dtype, s.elements(Operand::Filter), 12),
                dy: host::random_values(problem.dtype, s.elements(Operand::Output), 13),
            }
        }

        fn inputs(&self, op: ConvOp) -> (&[f32], &[f32]) {
            match op {
                ConvOp::Forward => (&self.x, &self.w),
                ConvOp::BackwardData => (&self.w, &self.dy),
                ConvOp::BackwardFilter => (&self.x, &self.dy),
            }
        }
    }

    /// Relative error allowed for `problem` (see [`host::Reference::max_relative_error`]).
    /// Loose on purpose: an indexing or layout bug gives errors of order 1.
    fn tolerance(problem: &ConvProblem) -> f64 {
        match (problem.dtype, problem.math) {
            // fp32 FMA: rounding only (FFT and Winograd transforms add a little).
            (DType::Fp32, MathMode::Fma) => 1e-4,
            // TF32 tensor cores: 10-bit mantissa inputs.
            (DType::Fp32, _) => 5e-3,
            // fp16 / bf16 outputs (2^-11 / 2^-8), and transforms in reduced precision.
            (DType::Fp16, _) => 2e-2,
            (DType::Bf16, _) => 3e-2,
        }
    }

    /// Runs every legacy algorithm of every op that cuDNN accepts and compares each result
    /// with the host reference (a mismatch fails the test). Returns how many algorithms ran
    /// per op (in `ConvOp::ALL` order). Workspace-query errors other than NOT_SUPPORTED are
    /// printed, not fatal: callers assert on the counts where every op must work.
    fn check_all_algorithms(handle: &CudnnHandle, problem: &ConvProblem) -> [usize; 3] {
        let d = ConvDescriptors::new(problem).unwrap();
        let data = HostData::new(problem);
        let mut ran = [0; 3];
        for (op_index, op) in ConvOp::ALL.into_iter().enumerate() {
            let [ra, rb, ro] = operand_roles(op);
            let (a_host, b_host) = data.inputs(op);
            let reference = host::reference_convolution(problem, op, a_host, b_host).unwrap();
            let a = handle.upload(problem.dtype, a_host).unwrap();
            let b = handle.upload(problem.dtype, b_host).unwrap();
            assert_eq!(a.len(), d.shapes().elements(ra));
            assert_eq!(b.len(), d.shapes().elements(rb));
            for algo in 0..algo_count(op) {
                let name = algo_name(op, algo).unwrap();
                let workspace_bytes = match handle.workspace_size(&d, op, algo) {
                    Ok(Some(bytes)) => bytes,
                    Ok(None) => {
                        println!("{} {op} {name}: not supported", problem.describe());
                        continue;
                    }
                    Err(e) => {
                        println!(
                            "{} {op} {name}: WORKSPACE QUERY ERROR {e}",
                            problem.describe()
                        );
                        continue;
                    }
                };
                let mut out = handle.alloc_operand(&d, ro).unwrap();
                out.fill_random(99).unwrap(); // beta = 0 must ignore it
                let mut ws = handle.alloc_workspace(workspace_bytes).unwrap();
                let result = handle.convolve(
                    &d,
                    op,
                    algo,
                    1.0,
                    0.0,
                    DeviceOperands::new(
                        &a.view_all(),
                        &b.view_all(),
                        &mut out.view_all_mut(),
                        &mut ws.view(),
                    ),
                );
                match result {
                    Ok(()) => {}
                    Err(e) if e.is_not_supported() => {
                        println!(
                            "{} {op} {name}: not supported at run time: {e}",
                            problem.describe()
                        );
                        continue;
                    }
                    Err(e) => panic!("{op} {name} on {}: {e}", problem.describe()),
                }
                let got = out.download().unwrap();
                let err = reference.max_relative_error(&got);
                println!(
                    "{} {op} {name} ws {workspace_bytes}: max rel err {err:.2e}",
                    problem.describe()
                );
                assert!(
                    err <= tolerance(problem),
                    "{op} {name} on {}: relative error {err}",
                    problem.describe()
                );
                ran[op_index] += 1;
            }
        }
        ran
    }

    #[test]
    #[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
    fn gpu_probe_describes_devices() {
        let info = probe().unwrap();
        println!("{info:#?}");
        assert!(info.driver_version >= MIN_DRIVER_VERSION);
        assert_eq!(info.cudnn_version / 10_000, CUDNN_MAJOR);
        assert!(!info.devices[0].name.is_empty());
        assert!(info.devices[0].compute_capability.0 >= 5);
        assert!(info.devices[0].total_memory_bytes > 0);
    }

    #[test]
    #[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
    fn gpu_forward_algo0_matches_host() {
        let handle = CudnnHandle::new(0).unwrap();
        let problem = ConvProblem {
            math: MathMode::Fma,
            ..small_problem()
        };
        let d = ConvDescriptors::new(&problem).unwrap();
        let algos = handle.supported_algorithms(&d, ConvOp::Forward).unwrap();
        println!("forward algorithms: {algos:?}");
        assert_eq!(algos.first().map(|a| a.algo), Some(0));
        let data = HostData::new(&problem);
        let x = handle.upload(problem.dtype, &data.x).unwrap();
        let w = handle.upload(problem.dtype, &data.w).unwrap();
        let mut y = handle.alloc_operand(&d, Operand::Output).unwrap();
        let bytes = handle
            .workspace_size(&d, ConvOp::Forward, 0)
            .unwrap()
            .unwrap();
        let mut ws = handle.alloc_workspace(bytes).unwrap();
        handle
            .convolve(
                &d,
                ConvOp::Forward,
                0,
                1.0,
                0.0,
                DeviceOperands::new(
                    &x.view_all(),
                    &w.view_all(),
                    &mut y.view_all_mut(),
                    &mut ws.view(),
                ),
            )
            .unwrap();
        let reference =
            host::reference_convolution(&problem, ConvOp::Forward, &data.x, &data.w).unwrap();
        let err = reference.max_relative_error(&y.download().unwrap());
        assert!(err < 1e-5, "relative error {err}");
        // x and w have the right lengths but are swapped: rejected before cuDNN sees them.
        let swapped = handle.convolve(
            &d,
            ConvOp::Forward,
            0,
            1.0,
            0.0,
            DeviceOperands::new(
                &w.view_all(),
                &x.view_all(),
                &mut y.view_all_mut(),
                &mut ws.view(),
            ),
        );
        assert!(matches!(swapped, Err(CudnnError::InvalidArgument { .. })));
    }

    #[test]
    #[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
    fn gpu_all_ops_and_algorithms_match_host() {
        let handle = CudnnHandle::new(0).unwrap();
        let base = small_problem();
        let strided_grouped = ConvProblem {
            stride_h: 2,
            stride_w: 1,
            dilation_h: 1,
            dilation_w: 2,
            pad_h: 2,
            pad_w: 1,
            groups: 2,
            ..base
        };
        // The fp32 NCHW problems must run every op (cuDNN supports them all); the others must
        // be right wherever cuDNN accepts them.
        for (problem, every_op_required) in [
            (
                ConvProblem {
                    math: MathMode::Fma,
                    ..base
                },
                true,
            ),
            (base, true),
            (
                ConvProblem {
                    math: MathMode::Fma,
                    ..strided_grouped
                },
                true,
            ),
            (
                ConvProblem {
                    layout: Layout::Nhwc,
                    math: MathMode::Fma,
                    ..base
                },
                false,
            ),
            (
                ConvProblem {
                    dtype: DType::Fp16,
                    layout: Layout::Nhwc,
                    ..base
                },
                false,
            ),
            (
                ConvProblem {
                    dtype: DType::Bf16,
                    ..base
                },
                false,
            ),
        ] {
            let ran = check_all_algorithms(&handle, &problem);
            println!("{}: algorithms run per op {ran:?}", problem.describe());
            if every_op_required {
                assert!(
                    ran.iter().all(|&n| n > 0),
                    "{}: {ran:?}",
                    problem.describe()
                );
            }
        }
    }

    #[test]
    #[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
    fn gpu_micro_batches_match_the_whole_batch() {
        let handle = CudnnHandle::new(0).unwrap();
        let problem = ConvProblem {
            math: MathMode::Fma,
            ..small_problem()
        };
        let full = ConvDescriptors::new(&problem).unwrap();
        let data = HostData::new(&problem);
        let x = handle.upload(problem.dtype, &data.x).unwrap();
        let w = handle.upload(problem.dtype, &data.w).unwrap();
        let dy = handle.upload(problem.dtype, &data.dy).unwrap();
        let mut y = handle.alloc_operand(&full, Operand::Output).unwrap();
        let mut dw = handle.alloc_operand(&full, Operand::Filter).unwrap();
        let shapes = *full.shapes();
        // Split 4 = 1 + 3, algorithm 0 (always available) for both ops.
        for (i, (first, count)) in [(0usize, 1usize), (1, 3)].into_iter().enumerate() {
            let micro = ConvDescriptors::new(&problem.with_batch(count as i64)).unwrap();
            let (xo, xl) = shapes.sample_range(Operand::Input, first, count).unwrap();
            let (yo, yl) = shapes.sample_range(Operand::Output, first, count).unwrap();
            for op in [ConvOp::Forward, ConvOp::BackwardFilter] {
                let bytes = handle.workspace_size(&micro, op, 0).unwrap().unwrap();
                let mut ws = handle.alloc_workspace(bytes).unwrap();
                let x_view = x.view(xo, xl).unwrap();
                match op {
                    ConvOp::Forward => handle.convolve(
                        &micro,
                        op,
                        0,
                        1.0,
                        0.0,
                        DeviceOperands::new(
                            &x_view,
                            &w.view_all(),
                            &mut y.view_mut(yo, yl).unwrap(),
                            &mut ws.view(),
                        ),
                    ),
                    // dw accumulates over micro-batches: beta = 0 first, then 1.
                    _ => handle.convolve(
                        &micro,
                        op,
                        0,
                        1.0,
                        if i == 0 { 0.0 } else { 1.0 },
                        DeviceOperands::new(
                            &x_view,
                            &dy.view(yo, yl).unwrap(),
                            &mut dw.view_all_mut(),
                            &mut ws.view(),
                        ),
                    ),
                }
                .unwrap();
            }
        }
        let y_ref =
            host::reference_convolution(&problem, ConvOp::Forward, &data.x, &data.w).unwrap();
        let dw_ref =
            host::reference_convolution(&problem, ConvOp::BackwardFilter, &data.x, &data.dy)
                .unwrap();
        assert!(y_ref.max_relative_error(&y.download().unwrap()) < 1e-5);
        assert!(dw_ref.max_relative_error(&dw.download().unwrap()) < 1e-5);
        // A micro-batch view must match the micro-batch descriptors exactly.
        let micro = ConvDescriptors::new(&problem.with_batch(2)).unwrap();
        let wrong = handle.convolve(
            &micro,
            ConvOp::Forward,
            0,
            1.0,
            0.0,
            DeviceOperands::new(
                &x.view(0, shapes.elements_per_sample(Operand::Input) * 3)
                    .unwrap(),
                &w.view_all(),
                &mut y
                    .view_mut(0, shapes.elements_per_sample(Operand::Output) * 2)
                    .unwrap(),
                &mut WorkspaceView::empty(),
            ),
        );
        assert!(matches!(wrong, Err(CudnnError::InvalidArgument { .. })));
        assert!(x.view(1, x.len()).is_err());
    }

    /// The device fill the profiler times on holds exactly the host's tiled pattern (so never
    /// zeros), for lengths that do and do not fill the last copy.
    #[test]
    #[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
    fn gpu_tiled_fill_matches_the_host_pattern() {
        let handle = CudnnHandle::new(0).unwrap();
        for dtype in [DType::Fp32, DType::Fp16, DType::Bf16] {
            for len in [5, host::FILL_PERIOD, 3 * host::FILL_PERIOD + 17, 1 << 22] {
                let buffer = handle.alloc_tiled(dtype, len, 4).unwrap();
                let got = buffer.download().unwrap();
                assert_eq!(got, host::tiled_values(dtype, len, 4), "{dtype} {len}");
            }
        }
    }

    #[test]
    #[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
    fn gpu_timer_and_find() {
        let handle = CudnnHandle::new(0).unwrap();
        let problem = ConvProblem {
            pad_h: 1,
            pad_w: 1,
            ..ConvProblem::new(32, 64, 56, 56, 64, 3, 3)
        };
        let d = ConvDescriptors::new(&problem).unwrap();
        let s = d.shapes();
        let x = handle
            .alloc_random(problem.dtype, s.elements(Operand::Input), 1)
            .unwrap();
        let w = handle
            .alloc_random(problem.dtype, s.elements(Operand::Filter), 2)
            .unwrap();
        let mut y = handle.alloc_operand(&d, Operand::Output).unwrap();
        let bytes = handle
            .workspace_size(&d, ConvOp::Forward, 1)
            .unwrap()
            .unwrap();
        let mut ws = handle.alloc_workspace(bytes).unwrap();
        let timer = handle.timer().unwrap();
        let (xv, wv) = (x.view_all(), w.view_all());
        let mut yv = y.view_all_mut();
        let mut wsv = ws.view();
        let ms = timer
            .time(|| {
                for _ in 0..5 {
                    handle.convolve(
                        &d,
                        ConvOp::Forward,
                        1,
                        1.0,
                        0.0,
                        DeviceOperands::new(&xv, &wv, &mut yv, &mut wsv),
                    )?;
                }
                Ok(())
            })
            .unwrap();
        println!("5 x forward algo 1: {ms:.3} ms");
        assert!(ms > 0.0 && ms < 10_000.0);
        drop((yv, wsv));
        let mut big = handle.alloc_workspace(256 << 20).unwrap();
        let found = handle
            .find_algorithms(
                &d,
                ConvOp::Forward,
                DeviceOperands::new(&xv, &wv, &mut y.view_all_mut(), &mut big.view()),
            )
            .unwrap();
        println!("{found:#?}");
        assert!(found.iter().any(|f| f.succeeded() && f.time_ms > 0.0));
        assert!(found.iter().all(|f| f.algo < algo_count(ConvOp::Forward)));
    }
}
