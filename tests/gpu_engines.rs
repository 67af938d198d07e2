//! GPU acceptance of the graph-API path (engine configurations). Every test needs a GPU and is
//! `#[ignore = "needs a GPU: ..."]`; the GPU acceptance (`scripts/gpu/accept.sh`) runs them with `--include-ignored`:
//!
//! - every enumerated configuration of every op that builds a plan computes the float64 host
//!   reference's result, and the problem's math mode is honoured (no tensor cores under fma);
//! - micro-batches on offset views of full-batch buffers give the whole batch's result,
//!   backward-filter accumulating its later micro-batches with a beta = 1 plan;
//! - beta = 1 adds to what the output held, beta = 0 ignores it;
//! - a configuration rebuilt from its name is the configuration cuDNN's heuristics made (the
//!   same workspace), and building twice gives the same plan;
//! - the sweep of every engine finds configurations beyond the heuristics;
//! - `EnginePlan::execute` refuses views of the wrong size, a small workspace, another
//!   handle, and pointers less aligned than the plan declared.

use mucudnn::backend::cudnn::host::{reference_convolution, Reference};
use mucudnn::backend::cudnn::{
    engine_configs, heuristic_plan_workspaces, ConvShapes, CudnnError, CudnnHandle, DeviceBuffer,
    DeviceOperands, EngineConfig, EnginePlan, EngineSearch, HeurMode, WorkspaceView,
};
use mucudnn::solver::{operand_roles, Operand};
use mucudnn::solver::{ConvOp, ConvProblem, DType, Layout, MathMode};

fn base() -> ConvProblem {
    ConvProblem {
        pad_h: 1,
        pad_w: 1,
        ..ConvProblem::new(8, 16, 14, 14, 32, 3, 3)
    }
}

fn cases() -> Vec<(&'static str, ConvProblem)> {
    vec![
        (
            "fp32 nchw fma",
            ConvProblem {
                math: MathMode::Fma,
                ..base()
            },
        ),
        (
            "fp32 nhwc default (tf32)",
            ConvProblem {
                layout: Layout::Nhwc,
                ..base()
            },
        ),
        (
            "fp16 nhwc default",
            ConvProblem {
                dtype: DType::Fp16,
                layout: Layout::Nhwc,
                ..base()
            },
        ),
        (
            "bf16 nchw stride 2",
            ConvProblem {
                dtype: DType::Bf16,
                stride_h: 2,
                stride_w: 2,
                ..base()
            },
        ),
    ]
}

/// A grouped, dilated problem: the graph API may or may not support it (reported, not fatal).
fn grouped() -> ConvProblem {
    ConvProblem {
        math: MathMode::Fma,
        groups: 2,
        dilation_h: 2,
        dilation_w: 2,
        pad_h: 2,
        pad_w: 2,
        ..base()
    }
}

fn tolerance(problem: &ConvProblem) -> f64 {
    match (problem.dtype, problem.math) {
        // fp32 FMA: rounding only (FFT and Winograd transforms add a little).
        (DType::Fp32, MathMode::Fma) => 1e-4,
        (DType::Fp32, _) => 5e-3, // TF32
        (DType::Fp16, _) => 2e-2,
        (DType::Bf16, _) => 3e-2,
    }
}

fn search(max_candidates: usize) -> EngineSearch {
    EngineSearch {
        max_candidates,
        ..EngineSearch::default()
    }
}

/// Device inputs of `problem` (full batch) and their host copies, rounded to the dtype.
struct Data {
    x: DeviceBuffer,
    w: DeviceBuffer,
    dy: DeviceBuffer,
    host: [Vec<f32>; 3],
}

impl Data {
    fn new(handle: &CudnnHandle, problem: &ConvProblem) -> Data {
        let s = ConvShapes::new(problem).unwrap();
        let x = handle
            .alloc_random(problem.dtype, s.elements(Operand::Input), 1)
            .unwrap();
        let w = handle
            .alloc_random(problem.dtype, s.elements(Operand::Filter), 2)
            .unwrap();
        let dy = handle
            .alloc_random(problem.dtype, s.elements(Operand::Output), 3)
            .unwrap();
        let host = [
            x.download().unwrap(),
            w.download().unwrap(),
            dy.download().unwrap(),
        ];
        Data { x, w, dy, host }
    }

    fn device(&self, role: Operand) -> &DeviceBuffer {
        match role {
            Operand::Input => &self.x,
            Operand::Filter => &self.w,
            Operand::Output => &self.dy,
        }
    }

    fn host(&self, role: Operand) -> &[f32] {
        match role {
            Operand::Input => &self.host[0],
            Operand::Filter => &self.host[1],
            Operand::Output => &self.host[2],
        }
    }

    /// The inputs `(a, b)` of `op` on the device.
    fn inputs(&self, op: ConvOp) -> (&DeviceBuffer, &DeviceBuffer) {
        let [a, b, _] = operand_roles(op);
        (self.device(a), self.device(b))
    }

    fn reference(&self, problem: &ConvProblem, op: ConvOp) -> Reference {
        let [a, b, _] = operand_roles(op);
        reference_convolution(problem, op, self.host(a), self.host(b)).unwrap()
    }
}

/// Runs `plan` over the whole buffers into `out` (beta as built).
fn run_whole(
    handle: &CudnnHandle,
    plan: &EnginePlan,
    data: &Data,
    out: &mut DeviceBuffer,
) -> Result<(), CudnnError> {
    let (a, b) = data.inputs(plan.op());
    let mut workspace = handle.alloc_workspace(plan.workspace_bytes())?;
    let result = plan.execute(
        handle,
        DeviceOperands::new(
            &a.view_all(),
            &b.view_all(),
            &mut out.view_all_mut(),
            &mut workspace.view(),
        ),
    );
    result
}

#[test]
#[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
fn engines_match_the_host_reference_for_every_op() {
    let handle = CudnnHandle::new(0).expect("a GPU");
    let mut rows = Vec::new();
    let mut all_cases = cases();
    all_cases.push(("fp32 nchw fma groups 2 dilation 2", grouped()));
    for (label, problem) in all_cases {
        let must_work = problem.groups == 1;
        let data = Data::new(&handle, &problem);
        let s = ConvShapes::new(&problem).unwrap();
        for op in ConvOp::ALL {
            let reference = data.reference(&problem, op);
            let configs = match engine_configs(&handle, &problem, op, &search(16)) {
                Ok(configs) => configs,
                Err(e) if !must_work => {
                    rows.push(format!("{label:<34} {op:<10} no configurations: {e}"));
                    continue;
                }
                Err(e) => panic!("{label} {op}: enumeration failed: {e}"),
            };
            assert!(
                !configs.is_empty() || !must_work,
                "{label} {op}: no configurations"
            );
            let mut ran = 0;
            for config in &configs {
                let plan = match EnginePlan::new(&handle, &problem, op, config, 1.0, 0.0) {
                    Ok(plan) => plan,
                    Err(e) if e.is_not_supported() => {
                        println!("{label} {op} {config}: not supported: {e}");
                        continue;
                    }
                    Err(e) => panic!("{label} {op} {config}: plan failed: {e}"),
                };
                if problem.math == MathMode::Fma {
                    assert!(
                        !plan.notes().tensor_core,
                        "{label} {op} {config}: tensor cores under fma"
                    );
                }
                assert!(!plan.notes().down_convert_inputs, "{label} {op} {config}");
                let [_, _, out_role] = operand_roles(op);
                // beta = 0 must ignore what the output held.
                let mut out = handle
                    .alloc_random(problem.dtype, s.elements(out_role), 99)
                    .unwrap();
                match run_whole(&handle, &plan, &data, &mut out) {
                    Ok(()) => {}
                    Err(e) if e.is_not_supported() => {
                        println!("{label} {op} {config}: not supported at run time: {e}");
                        continue;
                    }
                    Err(e) => panic!("{label} {op} {config}: execution failed: {e}"),
                }
                let error = reference.max_relative_error(&out.download().unwrap());
                assert!(
                    error <= tolerance(&problem),
                    "{label} {op} {config}: relative error {error:.2e}"
                );
                rows.push(format!(
                    "{label:<34} {op:<10} {config:<50} ws {:>9}  err {error:.1e}  {:?}",
                    plan.workspace_bytes(),
                    plan.notes()
                ));
                ran += 1;
            }
            assert!(ran > 0 || !must_work, "{label} {op}: no configuration ran");
        }
    }
    println!("\n{}", rows.join("\n"));
}

/// Runs `op` over the whole batch in micro-batches of `sizes` on offset views, one plan per
/// (size, beta) built once, and returns the output.
fn run_micro_batched(
    handle: &CudnnHandle,
    problem: &ConvProblem,
    op: ConvOp,
    config: &EngineConfig,
    data: &Data,
    sizes: &[i64],
) -> Result<Vec<f32>, CudnnError> {
    let full = ConvShapes::new(problem)?;
    let roles = operand_roles(op);
    let (a, b) = data.inputs(op);
    let mut out = handle.alloc_random(problem.dtype, full.elements(roles[2]), 7)?;
    // Plans first (built once), then the loop that only executes.
    let mut plans = Vec::new();
    for (i, &size) in sizes.iter().enumerate() {
        let beta = if op == ConvOp::BackwardFilter && i > 0 {
            1.0
        } else {
            0.0
        };
        plans.push(EnginePlan::new(
            handle,
            &problem.with_batch(size),
            op,
            config,
            1.0,
            beta,
        )?);
    }
    let workspace_bytes = plans.iter().map(|p| p.workspace_bytes()).max().unwrap_or(0);
    let mut workspace = handle.alloc_workspace(workspace_bytes)?;
    let mut first = 0usize;
    for (plan, &size) in plans.iter().zip(sizes) {
        let count = size as usize;
        let range = |role: Operand| full.sample_range(role, first, count).unwrap();
        let (ao, al) = range(roles[0]);
        let (bo, bl) = range(roles[1]);
        let (oo, ol) = range(roles[2]);
        plan.execute(
            handle,
            DeviceOperands::new(
                &a.view(ao, al)?,
                &b.view(bo, bl)?,
                &mut out.view_mut(oo, ol)?,
                &mut workspace.view(),
            ),
        )?;
        first += count;
    }
    assert_eq!(first as i64, problem.n);
    out.download()
}

#[test]
#[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
fn offset_micro_batches_match_the_whole_batch() {
    let handle = CudnnHandle::new(0).expect("a GPU");
    let mut rows = Vec::new();
    // 8 = 3 + 5 (odd offsets) and 1 + 2 + 5.
    let splits: [&[i64]; 2] = [&[3, 5], &[1, 2, 5]];
    for (label, problem) in cases() {
        let data = Data::new(&handle, &problem);
        for op in ConvOp::ALL {
            let reference = data.reference(&problem, op);
            // Candidates of the smallest micro-batch size: those are the ones a profiler times.
            let configs = engine_configs(&handle, &problem.with_batch(1), op, &search(6))
                .unwrap_or_else(|e| panic!("{label} {op}: {e}"));
            let mut ran = 0;
            for config in &configs {
                for sizes in splits {
                    match run_micro_batched(&handle, &problem, op, config, &data, sizes) {
                        Ok(got) => {
                            let error = reference.max_relative_error(&got);
                            assert!(
                                error <= tolerance(&problem),
                                "{label} {op} {config} {sizes:?}: relative error {error:.2e}"
                            );
                            rows.push(format!(
                                "{label:<26} {op:<10} {config:<50} {sizes:?}: err {error:.1e}"
                            ));
                            ran += 1;
                        }
                        Err(e) if e.is_not_supported() => {
                            println!("{label} {op} {config} {sizes:?}: not supported: {e}");
                        }
                        Err(e) => panic!("{label} {op} {config} {sizes:?}: {e}"),
                    }
                }
            }
            assert!(ran > 0, "{label} {op}: no configuration ran micro-batched");
        }
    }
    println!("\n{}", rows.join("\n"));
}

#[test]
#[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
fn beta_one_accumulates_and_beta_zero_overwrites() {
    let handle = CudnnHandle::new(0).expect("a GPU");
    let problem = ConvProblem {
        math: MathMode::Fma,
        ..base()
    };
    let data = Data::new(&handle, &problem);
    let s = ConvShapes::new(&problem).unwrap();
    for op in ConvOp::ALL {
        let reference = data.reference(&problem, op);
        let out_role = operand_roles(op)[2];
        let prior =
            mucudnn::backend::cudnn::host::random_values(problem.dtype, s.elements(out_role), 42);
        let configs = engine_configs(&handle, &problem, op, &search(8)).unwrap();
        let mut checked = 0;
        for config in &configs {
            let Ok(plan) = EnginePlan::new(&handle, &problem, op, config, 1.0, 1.0) else {
                continue;
            };
            assert_eq!(plan.beta(), 1.0);
            let mut out = handle.upload(problem.dtype, &prior).unwrap();
            if let Err(e) = run_whole(&handle, &plan, &data, &mut out) {
                assert!(e.is_not_supported(), "{op} {config}: {e}");
                continue;
            }
            // Expected: prior + op(a, b), with the prior's magnitude added to the error scale.
            let mut expected = reference.clone();
            for (i, &p) in prior.iter().enumerate() {
                expected.values[i] += f64::from(p);
                expected.magnitude[i] += f64::from(p).abs();
            }
            let error = expected.max_relative_error(&out.download().unwrap());
            assert!(
                error <= 1e-4,
                "{op} {config} beta 1: relative error {error:.2e}"
            );
            checked += 1;
        }
        assert!(checked > 0, "{op}: no configuration supports beta = 1");
        println!("{op}: beta = 1 checked on {checked} configurations");
    }
}

#[test]
#[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
fn configurations_rebuilt_from_their_names_are_cudnns() {
    let handle = CudnnHandle::new(0).expect("a GPU");
    let mut compared = 0;
    for (label, problem) in cases() {
        for op in ConvOp::ALL {
            for mode in [HeurMode::A, HeurMode::Fallback] {
                let list = match heuristic_plan_workspaces(&handle, &problem, op, mode) {
                    Ok(list) => list,
                    Err(e) => {
                        println!("{label} {op} mode {}: {e}", mode.name());
                        continue;
                    }
                };
                for (config, workspace) in list.into_iter().take(12) {
                    let name = config.to_string();
                    let parsed: EngineConfig = name.parse().unwrap();
                    assert_eq!(parsed, config, "{name}");
                    let Some(expected) = workspace else {
                        continue;
                    };
                    let plan = match EnginePlan::new(&handle, &problem, op, &parsed, 1.0, 0.0) {
                        Ok(plan) => plan,
                        Err(e) if e.is_not_supported() && e.to_string().contains("math mode") => {
                            continue; // heuristics do not filter by math mode; we do
                        }
                        Err(e) => panic!("{label} {op} {name}: rebuilt plan failed: {e}"),
                    };
                    assert_eq!(
                        plan.workspace_bytes(),
                        expected,
                        "{label} {op} {name}: workspace differs from cuDNN's own configuration"
                    );
                    let again = EnginePlan::new(&handle, &problem, op, &parsed, 1.0, 0.0).unwrap();
                    assert_eq!(again.workspace_bytes(), expected);
                    assert_eq!(again.config(), &config);
                    compared += 1;
                }
            }
        }
    }
    assert!(compared > 0, "nothing compared");
    println!("{compared} configurations rebuilt from their names with cuDNN's workspace");
}

#[test]
#[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
fn the_sweep_reaches_beyond_the_heuristics() {
    let handle = CudnnHandle::new(0).expect("a GPU");
    let problem = ConvProblem {
        layout: Layout::Nhwc,
        dtype: DType::Fp16,
        ..base()
    };
    let data = Data::new(&handle, &problem);
    let s = ConvShapes::new(&problem).unwrap();
    let sweep_only = EngineSearch {
        heuristics: Vec::new(),
        every_engine: true,
        max_candidates: 24,
        skip_runtime_compiled: true,
        known_bad_version: None,
    };
    for op in ConvOp::ALL {
        let start = std::time::Instant::now();
        let swept = engine_configs(&handle, &problem, op, &sweep_only).unwrap();
        let heuristic = engine_configs(&handle, &problem, op, &search(64)).unwrap();
        println!(
            "{op}: sweep {} configurations in {:.2?}: {}",
            swept.len(),
            start.elapsed(),
            swept
                .iter()
                .map(|c| c.to_string())
                .collect::<Vec<_>>()
                .join(" ")
        );
        assert!(!swept.is_empty(), "{op}: the sweep found nothing");
        assert!(swept.len() <= 24);
        // Stable: the same search gives the same list.
        assert_eq!(
            engine_configs(&handle, &problem, op, &sweep_only).unwrap(),
            swept
        );
        let new = swept.iter().filter(|c| !heuristic.contains(c)).count();
        println!("{op}: {new} swept configurations are not among the heuristics' results");
        let reference = data.reference(&problem, op);
        let mut ran = 0;
        for config in &swept {
            let Ok(plan) = EnginePlan::new(&handle, &problem, op, config, 1.0, 0.0) else {
                continue;
            };
            let mut out = handle
                .alloc_zeroed(problem.dtype, s.elements(operand_roles(op)[2]))
                .unwrap();
            if run_whole(&handle, &plan, &data, &mut out).is_err() {
                continue;
            }
            let error = reference.max_relative_error(&out.download().unwrap());
            assert!(
                error <= tolerance(&problem),
                "{op} {config}: error {error:.2e}"
            );
            ran += 1;
        }
        assert!(ran > 0, "{op}: no swept configuration ran");
    }
}

#[test]
#[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
fn execute_checks_its_arguments() {
    let handle = CudnnHandle::new(0).expect("a GPU");
    let problem = ConvProblem {
        math: MathMode::Fma,
        ..base()
    };
    let op = ConvOp::Forward;
    let s = ConvShapes::new(&problem).unwrap();
    let data = Data::new(&handle, &problem);
    let configs = engine_configs(&handle, &problem, op, &search(16)).unwrap();
    // A configuration with a workspace, to test the workspace checks.
    let plans: Vec<EnginePlan> = configs
        .iter()
        .filter_map(|c| EnginePlan::new(&handle, &problem, op, c, 1.0, 0.0).ok())
        .collect();
    let plan = plans
        .iter()
        .max_by_key(|p| p.workspace_bytes())
        .expect("a plan");
    assert_eq!(plan.operand_alignments(), [16, 16, 16]);
    let mut out = handle
        .alloc_zeroed(problem.dtype, s.elements(Operand::Output))
        .unwrap();
    let mut workspace = handle.alloc_workspace(plan.workspace_bytes()).unwrap();

    // Wrong element count: the micro-batch plan's views must have exactly its size.
    let e = plan
        .execute(
            &handle,
            DeviceOperands::new(
                &data
                    .x
                    .view(0, s.elements_per_sample(Operand::Input))
                    .unwrap(),
                &data.w.view_all(),
                &mut out.view_all_mut(),
                &mut workspace.view(),
            ),
        )
        .unwrap_err();
    assert!(matches!(e, CudnnError::InvalidArgument { .. }), "{e}");

    // Too small a workspace.
    if plan.workspace_bytes() > 0 {
        let e = plan
            .execute(
                &handle,
                DeviceOperands::new(
                    &data.x.view_all(),
                    &data.w.view_all(),
                    &mut out.view_all_mut(),
                    &mut WorkspaceView::empty(),
                ),
            )
            .unwrap_err();
        assert!(e.to_string().contains("workspace"), "{e}");
        // A workspace sub-range that is not 256-byte aligned.
        let mut bigger = handle.alloc_workspace(plan.workspace_bytes() + 16).unwrap();
        let e = plan
            .execute(
                &handle,
                DeviceOperands::new(
                    &data.x.view_all(),
                    &data.w.view_all(),
                    &mut out.view_all_mut(),
                    &mut bigger.view_range(16, plan.workspace_bytes()).unwrap(),
                ),
            )
            .unwrap_err();
        assert!(
            matches!(
                e,
                CudnnError::Misaligned {
                    operand: "workspace",
                    ..
                }
            ),
            "{e}"
        );
    }

    // An input one element (4 bytes) past a 16-byte boundary.
    let len = s.elements(Operand::Input);
    let shifted = handle.alloc_random(problem.dtype, len + 1, 5).unwrap();
    let e = plan
        .execute(
            &handle,
            DeviceOperands::new(
                &shifted.view(1, len).unwrap(),
                &data.w.view_all(),
                &mut out.view_all_mut(),
                &mut workspace.view(),
            ),
        )
        .unwrap_err();
    assert!(
        matches!(
            e,
            CudnnError::Misaligned {
                operand: "a",
                required: 16,
                ..
            }
        ),
        "{e}"
    );

    // Another handle.
    let other = CudnnHandle::new(0).unwrap();
    let x2 = other
        .upload(problem.dtype, data.host(Operand::Input))
        .unwrap();
    let w2 = other
        .upload(problem.dtype, data.host(Operand::Filter))
        .unwrap();
    let mut y2 = other
        .alloc_zeroed(problem.dtype, s.elements(Operand::Output))
        .unwrap();
    let mut ws2 = other.alloc_workspace(plan.workspace_bytes()).unwrap();
    let e = plan
        .execute(
            &other,
            DeviceOperands::new(
                &x2.view_all(),
                &w2.view_all(),
                &mut y2.view_all_mut(),
                &mut ws2.view(),
            ),
        )
        .unwrap_err();
    assert!(e.to_string().contains("another cuDNN handle"), "{e}");

    // And the correct call works.
    plan.execute(
        &handle,
        DeviceOperands::new(
            &data.x.view_all(),
            &data.w.view_all(),
            &mut out.view_all_mut(),
            &mut workspace.view(),
        ),
    )
    .unwrap();
    let error = data
        .reference(&problem, op)
        .max_relative_error(&out.download().unwrap());
    assert!(error <= tolerance(&problem), "{error:.2e}");

    // A name that is not an engine of this graph is an error, not a crash.
    let bogus: EngineConfig = "eng100000".parse().unwrap();
    assert!(EnginePlan::new(&handle, &problem, op, &bogus, 1.0, 0.0).is_err());
    // A knob type that does not exist.
    let first = &configs[0];
    let odd = EngineConfig::new(first.engine(), [(4000, 1)]).unwrap();
    if let Err(e) = EnginePlan::new(&handle, &problem, op, &odd, 1.0, 0.0) {
        println!("unknown knob type: {e}");
    }
}

#[test]
#[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
fn odd_sample_sizes_declare_a_smaller_alignment() {
    let handle = CudnnHandle::new(0).expect("a GPU");
    // fp16 with 3 x 7 x 7 = 147 elements per sample: offsets are only 2-byte aligned.
    let problem = ConvProblem {
        dtype: DType::Fp16,
        pad_h: 1,
        pad_w: 1,
        ..ConvProblem::new(4, 3, 7, 7, 8, 3, 3)
    };
    let data = Data::new(&handle, &problem);
    let op = ConvOp::Forward;
    let reference = data.reference(&problem, op);
    let configs = engine_configs(&handle, &problem.with_batch(1), op, &search(16)).unwrap();
    let mut ran = 0;
    for config in &configs {
        match run_micro_batched(&handle, &problem, op, config, &data, &[1, 3]) {
            Ok(got) => {
                let error = reference.max_relative_error(&got);
                assert!(error <= tolerance(&problem), "{config}: {error:.2e}");
                ran += 1;
            }
            Err(e) => println!("{config}: {e}"),
        }
    }
    println!(
        "{ran} of {} configurations ran at 2-byte alignment",
        configs.len()
    );
    let plan = configs
        .iter()
        .find_map(|c| EnginePlan::new(&handle, &problem.with_batch(3), op, c, 1.0, 0.0).ok());
    if let Some(plan) = plan {
        assert_eq!(plan.operand_alignments()[0], 2);
    }
}
