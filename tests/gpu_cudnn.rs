//! GPU acceptance on cuDNN. Every test needs a GPU and is `#[ignore = "needs a GPU: ..."]`; the GPU acceptance
//! (`scripts/gpu/accept.sh`) runs them with `--include-ignored`. Executing a micro-batched plan gives the undivided
//! result within a few units of the precision it computes in, scaled by each element's
//! magnitude (cuDNN picks kernels by size, so a split may round differently: an ulp apart is
//! right; how many elements are bitwise equal is reported), every algorithm matches a float64
//! host reference, and, when
//! `MUCUDNN_TORCH_DIR` holds cases written by `scripts/gpu/torch_cases.py`, PyTorch's
//! `conv2d` and its gradients on the same data. 3-D problems (5-D descriptors) and 1-D ones
//! (unit height) run the same checks, through the legacy algorithms and the engines.

use mucudnn::backend::cudnn::host::{reference_convolution, Reference};
use mucudnn::backend::cudnn::{ConvDescriptors, ConvOperands, CudnnHandle, DeviceBuffer};
use mucudnn::exec::cudnn::PreparedPlan;
use mucudnn::solver::{operand_roles, Operand};
use mucudnn::solver::{Algo, ConvOp, ConvProblem, DType, Layout, MathMode, MicroBatch, Plan};

#[path = "spatial/cases.rs"]
mod spatial;

fn plan(problem: ConvProblem, op: ConvOp, sizes: &[i64], algo: u32) -> Plan {
    Plan {
        layer: "gpu-test".into(),
        problem,
        op,
        split: mucudnn::solver::SplitDim::Batch,
        micro_batches: sizes
            .iter()
            .map(|&size| MicroBatch {
                size,
                algo: mucudnn::solver::Algo::Legacy(algo),
                workspace_bytes: 0,
                time_ms: 1.0,
            })
            .collect(),
    }
}

/// cuDNN's non-deterministic legacy algorithms (atomics): compared by tolerance, not bits.
fn deterministic(op: ConvOp, algo: u32) -> bool {
    !matches!(
        (op, algo),
        (ConvOp::BackwardData, 0) | (ConvOp::BackwardFilter, 0) | (ConvOp::BackwardFilter, 3)
    )
}

/// Runs `plan` on `(a, b)` into a fresh output (beta = 0 over garbage) and downloads it; `None`
/// when cuDNN does not support the plan's algorithm at one of its sizes.
fn run(
    handle: &CudnnHandle,
    plan: &Plan,
    a: &DeviceBuffer,
    b: &DeviceBuffer,
    out_len: usize,
) -> Option<Vec<f32>> {
    let prepared = match PreparedPlan::new(handle, plan.clone()) {
        Ok(p) => p,
        Err(e) => {
            println!(
                "    {} algo {} sizes {:?}: not run: {e}",
                plan.op,
                plan.micro_batches[0].algo,
                plan.micro_batches
                    .iter()
                    .map(|m| m.size)
                    .collect::<Vec<_>>()
            );
            return None;
        }
    };
    let mut out = handle
        .alloc_random(plan.problem.dtype, out_len, 99)
        .expect("alloc");
    let mut workspace = handle
        .alloc_workspace(prepared.workspace_bytes())
        .expect("workspace");
    match prepared.execute(
        handle,
        1.0,
        0.0,
        ConvOperands {
            a,
            b,
            out: &mut out,
            workspace: &mut workspace,
        },
    ) {
        Ok(()) => Some(out.download().expect("download")),
        Err(e) => {
            println!(
                "    {} algo {}: execution failed: {e}",
                plan.op, plan.micro_batches[0].algo
            );
            None
        }
    }
}

/// cuDNN's FFT and Winograd legacy algorithms: their transforms round more than a direct sum.
fn transform_algo(op: ConvOp, algo: u32) -> bool {
    match op {
        // FFT, FFT_TILING, WINOGRAD, WINOGRAD_NONFUSED.
        ConvOp::Forward => (4..=7).contains(&algo),
        // FFT, FFT_TILING, WINOGRAD, WINOGRAD_NONFUSED.
        ConvOp::BackwardData => (2..=5).contains(&algo),
        // FFT, WINOGRAD, WINOGRAD_NONFUSED, FFT_TILING.
        ConvOp::BackwardFilter => matches!(algo, 2 | 4 | 5 | 6),
    }
}

/// Relative error allowed against the float64 reference (scaled by each element's magnitude)
/// for `problem`, `transform` when the algorithm or engine computes through FFT or Winograd
/// transforms (as the library's own tests allow).
fn tolerance(problem: &ConvProblem, transform: bool) -> f64 {
    match (problem.dtype, problem.math) {
        (DType::Fp32, MathMode::Fma) if transform => 1e-4,
        (DType::Fp32, MathMode::Fma) => 1e-5,
        (DType::Fp32, _) => 5e-3, // TF32 allowed
        (DType::Fp16, _) => 2e-2,
        (DType::Bf16, _) => 3e-2,
    }
}

/// Units of [`split_precision`] a split result may differ from the undivided one by, per
/// element and relative to the element's magnitude (the sum of |products|, which bounds what
/// rounding in a different order or kernel can change).
const SPLIT_ULPS: f64 = 8.0;

/// The unit roundoff a result of `problem` is computed to: fp32 FMA 2^-24 (transforms keep
/// about 2^-18), TF32 2^-11 (a split may run a tensor-core kernel where the whole does not),
/// fp16 outputs 2^-11, bf16 2^-8.
fn split_precision(problem: &ConvProblem, transform: bool) -> f64 {
    match (problem.dtype, problem.math) {
        (DType::Fp32, MathMode::Fma) if transform => 2f64.powi(-18),
        (DType::Fp32, MathMode::Fma) => 2f64.powi(-24),
        (DType::Fp32, _) | (DType::Fp16, _) => 2f64.powi(-11),
        (DType::Bf16, _) => 2f64.powi(-8),
    }
}

/// A split run against the undivided one.
struct SplitComparison {
    /// Elements with the same bits.
    bitwise: usize,
    len: usize,
    /// The largest difference, in units of the precision times the element's magnitude.
    worst_ulps: f64,
}

impl SplitComparison {
    fn new(whole: &[f32], parts: &[f32], reference: &Reference, precision: f64) -> Self {
        assert_eq!(whole.len(), parts.len());
        let bitwise = whole
            .iter()
            .zip(parts)
            .filter(|(x, y)| x.to_bits() == y.to_bits())
            .count();
        let worst_ulps = whole
            .iter()
            .zip(parts)
            .zip(&reference.magnitude)
            .map(|((&x, &y), &m)| (f64::from(x) - f64::from(y)).abs() / (precision * m + 1e-30))
            .fold(0.0, f64::max);
        SplitComparison {
            bitwise,
            len: whole.len(),
            worst_ulps,
        }
    }

    fn within(&self) -> bool {
        self.worst_ulps <= SPLIT_ULPS
    }
}

impl std::fmt::Display for SplitComparison {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}/{} bitwise, worst {:.2} ulps of magnitude",
            self.bitwise, self.len, self.worst_ulps
        )
    }
}

/// Checks every supported algorithm of every op of `problem`: split == undivided, and both
/// against `expected(op)` (values plus an error scale). Returns table rows.
fn check_problem(
    handle: &CudnnHandle,
    label: &str,
    problem: ConvProblem,
    inputs: [&DeviceBuffer; 3],
    expected: &dyn Fn(ConvOp) -> Reference,
) -> Vec<String> {
    let d = ConvDescriptors::new(&problem).expect("descriptors");
    let n = problem.n;
    let split = [n / 2, n / 4, n - n / 2 - n / 4];
    let mut rows = Vec::new();
    for op in ConvOp::ALL {
        let roles = operand_roles(op);
        let pick = |role: Operand| match role {
            Operand::Input => inputs[0],
            Operand::Filter => inputs[1],
            Operand::Output => inputs[2],
        };
        let out_len = d.shapes().elements(roles[2]);
        let want = expected(op);
        for supported in handle.supported_algorithms(&d, op).expect("algorithms") {
            let algo = supported.algo;
            let whole = run(
                handle,
                &plan(problem, op, &[n], algo),
                pick(roles[0]),
                pick(roles[1]),
                out_len,
            );
            let parts = run(
                handle,
                &plan(problem, op, &split, algo),
                pick(roles[0]),
                pick(roles[1]),
                out_len,
            );
            let (Some(whole), Some(parts)) = (whole, parts) else {
                continue;
            };
            let transform = transform_algo(op, algo);
            let error = want.max_relative_error(&whole);
            assert!(
                error <= tolerance(&problem, transform),
                "{label} {op} algo {algo}: error {error:.2e} against the reference"
            );
            let split_error = want.max_relative_error(&parts);
            assert!(
                split_error <= tolerance(&problem, transform),
                "{label} {op} algo {algo} split: error {split_error:.2e}"
            );
            let split =
                SplitComparison::new(&whole, &parts, &want, split_precision(&problem, transform));
            // Atomics sum in any order: those are held to the reference alone. Backward-filter
            // adds its micro-batches' partial sums (beta = 1), another order of one sum: a
            // half-precision dw is rounded once per micro-batch, so only fp32 is compared.
            let compared = deterministic(op, algo)
                && (op != ConvOp::BackwardFilter || problem.dtype == DType::Fp32);
            if compared {
                assert!(
                    split.within(),
                    "{label} {op} algo {algo}: split vs undivided: {split} (at most {SPLIT_ULPS})"
                );
            }
            rows.push(format!(
                "{label:<34} {:<10} algo {algo}  err {error:.1e}  split err {split_error:.1e}  \
                 split vs whole: {split}{}",
                op.name(),
                if compared { "" } else { " (not compared)" }
            ));
        }
    }
    rows
}

#[test]
#[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
fn cudnn_plans_equal_undivided_and_the_host_reference() {
    let handle = CudnnHandle::new(0).expect("a GPU");
    let base = ConvProblem {
        pad_h: 1,
        pad_w: 1,
        ..ConvProblem::new(8, 16, 14, 14, 32, 3, 3)
    };
    let cases = [
        (
            "fp32 nchw fma 3x3",
            ConvProblem {
                math: MathMode::Fma,
                ..base
            },
        ),
        (
            "fp32 nchw fma stride2 dil2 g2",
            ConvProblem {
                math: MathMode::Fma,
                stride_h: 2,
                stride_w: 2,
                dilation_h: 2,
                dilation_w: 2,
                pad_h: 2,
                pad_w: 2,
                groups: 2,
                ..base
            },
        ),
        (
            "fp32 nhwc fma 3x3",
            ConvProblem {
                math: MathMode::Fma,
                layout: Layout::Nhwc,
                ..base
            },
        ),
        ("fp32 nchw default (tf32)", base),
        (
            "fp16 nhwc tensor-op",
            ConvProblem {
                dtype: DType::Fp16,
                layout: Layout::Nhwc,
                math: MathMode::TensorOp,
                ..base
            },
        ),
        (
            "fp16 nchw",
            ConvProblem {
                dtype: DType::Fp16,
                ..base
            },
        ),
    ];
    let rows = check_against_reference(&handle, &cases);
    println!("\n{}", rows.join("\n"));
    // mucudnn ran every op of every case (cuDNN's legacy API has an algorithm for each of
    // these 2-D problems): nothing was left to another convolution.
    assert_every_op_ran(&rows, cases.iter().map(|(label, _)| *label));
}

/// Fails unless `rows` (of [`check_problem`]) hold a run of every op for each of `labels`.
fn assert_every_op_ran<'a>(rows: &[String], labels: impl IntoIterator<Item = &'a str>) {
    for label in labels {
        for op in ConvOp::ALL {
            assert!(
                rows.iter().any(|r| r.starts_with(label)
                    && r[label.len()..].trim_start().starts_with(op.name())),
                "{label} {op}: no algorithm ran"
            );
        }
    }
}

/// [`check_problem`] for each `(label, problem)` on random data, against the float64 host
/// reference.
fn check_against_reference(handle: &CudnnHandle, cases: &[(&str, ConvProblem)]) -> Vec<String> {
    let mut rows = Vec::new();
    for &(label, problem) in cases {
        let d = ConvDescriptors::new(&problem).expect("descriptors");
        let len = |role| d.shapes().elements(role);
        let x = handle
            .alloc_random(problem.dtype, len(Operand::Input), 1)
            .unwrap();
        let w = handle
            .alloc_random(problem.dtype, len(Operand::Filter), 2)
            .unwrap();
        let dy = handle
            .alloc_random(problem.dtype, len(Operand::Output), 3)
            .unwrap();
        let host = [
            x.download().unwrap(),
            w.download().unwrap(),
            dy.download().unwrap(),
        ];
        let expected = |op: ConvOp| {
            let (a, b) = match op {
                ConvOp::Forward => (&host[0], &host[1]),
                ConvOp::BackwardData => (&host[1], &host[2]),
                ConvOp::BackwardFilter => (&host[0], &host[2]),
            };
            reference_convolution(&problem, op, a, b).expect("reference")
        };
        rows.extend(check_problem(
            handle,
            label,
            problem,
            [&x, &w, &dy],
            &expected,
        ));
    }
    rows
}

/// 3-D convolutions (5-D descriptors, 3 spatial dims) and 1-D ones (unit height)
/// through the legacy algorithms. Every algorithm cuDNN offers, split [4, 2, 2] against the
/// undivided run (bitwise where deterministic) and both against the float64 reference, in
/// fp32 NCDHW / NDHWC, with strides, dilation and groups in depth, and fp16 NDHWC; 1-D in fp32
/// NCW and fp16 NWC. Small shapes: the reference is a naive loop on the host.
#[test]
#[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
fn cudnn_3d_and_1d_plans_equal_undivided_and_the_host_reference() {
    let handle = CudnnHandle::new(0).expect("a GPU");
    let base = ConvProblem {
        pad_d: 1,
        pad_h: 1,
        pad_w: 1,
        ..ConvProblem::new_3d(8, 8, 5, 8, 8, 16, 3, 3, 3)
    };
    let speech = ConvProblem {
        stride_w: 2,
        ..ConvProblem::new_1d(8, 16, 61, 32, 3)
    };
    let cases = [
        (
            "3d fp32 ncdhw fma 3x3x3",
            ConvProblem {
                math: MathMode::Fma,
                ..base
            },
        ),
        (
            "3d fp32 ncdhw fma s(2,1,2) d(2,1,1) g2",
            ConvProblem {
                math: MathMode::Fma,
                stride_d: 2,
                stride_w: 2,
                dilation_d: 2,
                pad_d: 2,
                groups: 2,
                ..base
            },
        ),
        (
            "3d fp32 ndhwc fma 3x3x3",
            ConvProblem {
                math: MathMode::Fma,
                layout: Layout::Nhwc,
                ..base
            },
        ),
        (
            "3d fp32 ncdhw causal (pad_d 0)",
            ConvProblem { pad_d: 0, ..base },
        ),
        (
            "3d fp16 ndhwc tensor-op",
            ConvProblem {
                dtype: DType::Fp16,
                layout: Layout::Nhwc,
                math: MathMode::TensorOp,
                ..base
            },
        ),
        (
            "1d fp32 ncw fma k3 s2",
            ConvProblem {
                math: MathMode::Fma,
                ..speech
            },
        ),
        (
            "1d fp16 nwc tensor-op k3 s2",
            ConvProblem {
                dtype: DType::Fp16,
                layout: Layout::Nhwc,
                math: MathMode::TensorOp,
                ..speech
            },
        ),
    ];
    for (label, problem) in &cases {
        let three = label.starts_with("3d");
        assert_eq!(problem.is_3d(), three, "{label}");
        let rank = ConvDescriptors::new(problem).unwrap().input().dims().len();
        assert_eq!(rank, if three { 5 } else { 4 }, "{label}");
    }
    let rows = check_against_reference(&handle, &cases);
    // Every fp32 NCDHW and 1-D case ran some algorithm of every op (channels-last 3-D may
    // have no legacy algorithm in an op: the graph API's engines cover it, below).
    assert_every_op_ran(
        &rows,
        cases
            .iter()
            .map(|(label, _)| *label)
            .filter(|label| label.contains("ncdhw") || label.starts_with("1d")),
    );
    println!("\n{}", rows.join("\n"));
}

/// One PyTorch case: shapes and file names in `cases.json` of `MUCUDNN_TORCH_DIR`.
#[derive(serde::Deserialize)]
struct TorchCase {
    name: String,
    problem: ConvProblem,
    /// Raw little-endian f32 files in the problem's layout: x, w, dy, y, dx, dw.
    files: std::collections::BTreeMap<String, String>,
}

#[test]
#[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
fn cudnn_plans_match_pytorch() {
    let dir = std::env::var("MUCUDNN_TORCH_DIR").expect(
        "MUCUDNN_TORCH_DIR: the folder of PyTorch's cases (written by scripts/gpu/torch_cases.py)",
    );
    let dir = std::path::PathBuf::from(dir);
    let cases: Vec<TorchCase> =
        serde_json::from_str(&std::fs::read_to_string(dir.join("cases.json")).unwrap()).unwrap();
    let handle = CudnnHandle::new(0).expect("a GPU");
    let mut rows = Vec::new();
    for case in cases {
        let read = |key: &str| -> Vec<f32> {
            let bytes = std::fs::read(dir.join(&case.files[key])).unwrap();
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        };
        let problem = case.problem;
        let upload = |values: &[f32]| handle.upload(problem.dtype, values).unwrap();
        let (x, w, dy) = (upload(&read("x")), upload(&read("w")), upload(&read("dy")));
        let torch = [read("y"), read("dx"), read("dw")];
        // PyTorch's results are the expected values; the error scale is the float64 reference's
        // (sum of |products|), which PyTorch does not give.
        let host = [read("x"), read("w"), read("dy")];
        let expected = |op: ConvOp| {
            let (a, b, index) = match op {
                ConvOp::Forward => (&host[0], &host[1], 0),
                ConvOp::BackwardData => (&host[1], &host[2], 1),
                ConvOp::BackwardFilter => (&host[0], &host[2], 2),
            };
            let mut reference = reference_convolution(&problem, op, a, b).expect("reference");
            reference.values = torch[index].iter().map(|&v| f64::from(v)).collect();
            reference
        };
        let label = format!("torch {}", case.name);
        let checked = check_problem(&handle, &label, problem, [&x, &w, &dy], &expected);
        // Every op of PyTorch's case ran through mucudnn's plans.
        assert_every_op_ran(&checked, [label.as_str()]);
        rows.extend(checked);
    }
    assert!(!rows.is_empty(), "no PyTorch case in cases.json");
    println!("\n{}", rows.join("\n"));
}

/// The profiler's engine candidates run through the executor: for each op, the engine
/// configurations `CudnnBackend::measure_engines` times at micro-batch 4 of 8 execute as a
/// split plan [4, 4] (offset views; backward-filter accumulating with beta = 1) and match the
/// float64 reference, and a plan mixing a legacy algorithm and an engine does too.
#[test]
#[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
fn engine_candidates_from_the_profiler_execute_as_plans() {
    let base = ConvProblem {
        pad_h: 1,
        pad_w: 1,
        ..ConvProblem::new(8, 16, 14, 14, 32, 3, 3)
    };
    let cases = [
        ("fp32 nchw default", base),
        (
            "fp16 nhwc tensor-op",
            ConvProblem {
                dtype: DType::Fp16,
                layout: Layout::Nhwc,
                math: MathMode::TensorOp,
                ..base
            },
        ),
    ];
    println!("\n{}", check_engine_candidates(&cases).join("\n"));
}

/// The same for 3-D problems (5-D graph tensors, 3 spatial dims) in fp32 NCDHW and
/// fp16 NDHWC, and a 1-D one: engine configurations timed at micro-batch 4 run as [4, 4]
/// plans at their offsets (backward-filter accumulating) and match the float64 reference.
#[test]
#[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
fn engine_candidates_execute_as_3d_and_1d_plans() {
    let base = ConvProblem {
        pad_d: 1,
        pad_h: 1,
        pad_w: 1,
        stride_d: 2,
        ..ConvProblem::new_3d(8, 8, 5, 8, 8, 16, 3, 3, 3)
    };
    let cases = [
        ("3d fp32 ncdhw default", base),
        (
            "3d fp16 ndhwc tensor-op",
            ConvProblem {
                dtype: DType::Fp16,
                layout: Layout::Nhwc,
                math: MathMode::TensorOp,
                ..base
            },
        ),
        (
            "1d fp16 nwc tensor-op",
            ConvProblem {
                dtype: DType::Fp16,
                layout: Layout::Nhwc,
                math: MathMode::TensorOp,
                stride_w: 2,
                ..ConvProblem::new_1d(8, 16, 61, 32, 3)
            },
        ),
    ];
    println!("\n{}", check_engine_candidates(&cases).join("\n"));
}

/// The body of the engine-candidate tests: for each case and op, the configurations the
/// profiler times at micro-batch 4 of 8 run as a [4, 4] plan, alone and mixed with a legacy
/// algorithm, against the float64 reference.
fn check_engine_candidates(cases: &[(&str, ConvProblem)]) -> Vec<String> {
    use mucudnn::backend::{Backend, CudnnBackend, EngineSearch, Selection, TimingSettings};
    use mucudnn::solver::{Algo, AlgoKind};
    let mut backend = CudnnBackend::new(0).expect("a GPU");
    assert!(
        backend.kinds().contains(&AlgoKind::Engine),
        "the loaded cuDNN has no graph API"
    );
    let quick = TimingSettings {
        warmup: 1,
        loops: 1,
        iterations: 1,
        long_call_ms: 1000.0,
    };
    let mut rows = Vec::new();
    for &(label, problem) in cases {
        let d = ConvDescriptors::new(&problem).expect("descriptors");
        let len = |role| d.shapes().elements(role);
        let handle = backend.handle();
        let inputs = [
            handle
                .alloc_random(problem.dtype, len(Operand::Input), 1)
                .unwrap(),
            handle
                .alloc_random(problem.dtype, len(Operand::Filter), 2)
                .unwrap(),
            handle
                .alloc_random(problem.dtype, len(Operand::Output), 3)
                .unwrap(),
        ];
        let host: Vec<Vec<f32>> = inputs.iter().map(|b| b.download().unwrap()).collect();
        for op in ConvOp::ALL {
            let search = EngineSearch {
                max_candidates: Some(6),
                ..Default::default()
            };
            let measured = backend
                .measure(
                    &mucudnn::solver::MeasureKey::batch(
                        problem,
                        op,
                        4,
                        mucudnn::solver::AlgoKind::Engine,
                    ),
                    &mucudnn::backend::MeasureSettings {
                        timing: quick,
                        search,
                        select: Selection::ALL,
                        verify: true,
                    },
                )
                .expect("engines measured")
                .measurements;
            assert!(!measured.is_empty(), "{label} {op}: no engine ran");
            let roles = operand_roles(op);
            let pick = |role: Operand| match role {
                Operand::Input => 0,
                Operand::Filter => 1,
                Operand::Output => 2,
            };
            let (ia, ib) = (pick(roles[0]), pick(roles[1]));
            let want = reference_convolution(&problem, op, &host[ia], &host[ib]).expect("ref");
            let handle = backend.handle();
            for m in &measured {
                assert!(matches!(m.algo, Algo::Engine(_)) && m.micro == 4 && m.time_ms > 0.0);
                let mut split = plan(problem, op, &[4, 4], 0);
                for mb in &mut split.micro_batches {
                    mb.algo = m.algo;
                }
                let mut mixed = split.clone();
                mixed.micro_batches[0].algo = Algo::Legacy(0);
                for (kind, p) in [("engine", &split), ("legacy+engine", &mixed)] {
                    let Some(got) = run(handle, p, &inputs[ia], &inputs[ib], len(roles[2])) else {
                        panic!("{label} {op} {kind} {}: did not run", m.algo);
                    };
                    let error = want.max_relative_error(&got);
                    let transform = engine_transforms(handle, &problem, op, m.algo)
                        || (kind == "legacy+engine" && transform_algo(op, 0));
                    assert!(
                        error <= tolerance(&problem, transform),
                        "{label} {op} {kind} {}: error {error:.2e}",
                        m.algo
                    );
                    rows.push(format!(
                        "{label} {op} {kind} {}: {:.4} ms, {} B, error {error:.1e}",
                        m.algo, m.time_ms, m.workspace_bytes
                    ));
                }
            }
        }
    }
    rows
}

/// Whether engine configuration `algo` computes through FFT or Winograd transforms (its notes,
/// from a plan of the undivided problem; false when that plan does not build).
fn engine_transforms(handle: &CudnnHandle, problem: &ConvProblem, op: ConvOp, algo: Algo) -> bool {
    use mucudnn::backend::cudnn::{EngineConfig, EnginePlan};
    let Algo::Engine(name) = algo else {
        return false;
    };
    EngineConfig::from_name(name)
        .ok()
        .and_then(|config| EnginePlan::new(handle, problem, op, &config, 1.0, 0.0).ok())
        .is_some_and(|plan| plan.notes().fft || plan.notes().winograd)
}

/// A spatial plan: chunks of `sizes` rows along the split axis, all with `algo`.
fn spatial_plan(problem: ConvProblem, op: ConvOp, sizes: &[i64], algo: Algo) -> Plan {
    Plan {
        split: mucudnn::solver::SplitDim::Spatial,
        micro_batches: sizes
            .iter()
            .map(|&size| MicroBatch {
                size,
                algo,
                workspace_bytes: 0,
                time_ms: 1.0,
            })
            .collect(),
        ..plan(problem, op, &[problem.n], 0)
    }
}

/// Spatial splits on the GPU: plans of equal chunks of a measured chunk size, and of 2, 3 and 7
/// uneven chunks (views of the full tensors at pointer offsets, one-sided padding at the
/// borders), match the float64 host reference in every op (backward-filter sums its chunks
/// with beta = 1) and the undivided run of the same engine configuration within a few ulps of
/// each element's magnitude where cuDNN's notes call the engine deterministic (how many
/// elements are bitwise equal is reported). The configurations are those
/// `CudnnBackend::measure_spatial` times at that chunk size (at its start, middle and end
/// positions, one-sided padding included), so the plan of equal chunks must run; a
/// configuration need not build at the other chunk shapes, nor undivided. Cases:
/// 2-D fp16 NHWC 3x3 pad 1, 3-D fp16 NDHWC 3x3x3 pad 1 stride 2, 2-D fp32 NCHW dilation 2
/// stride 2 with padding larger than the halo, and a 1x1 stride-3 layer whose backward-data
/// leaves rows no window reaches (written as zeros over the garbage the output starts with)
/// (tests/spatial/cases.rs). The two fp32 NCHW cases' chunks are strided views of the rows:
/// where no engine takes them at the chunk size, that is reported, not asserted (the host tier
/// builds those views first and reports what cuDNN takes).
#[test]
#[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
fn spatial_plans_equal_undivided_and_the_host_reference() {
    use mucudnn::backend::cudnn::{ChunkShapes, EngineConfig, EnginePlan};
    use mucudnn::backend::{Backend, CudnnBackend, EngineSearch, Selection, TimingSettings};
    use mucudnn::solver::spatial::{split_axis, timing_chunks, AxisGeometry, SplitDim};
    use mucudnn::solver::AlgoKind;
    let mut backend = CudnnBackend::new(0).expect("a GPU");
    assert!(
        backend.kinds().contains(&AlgoKind::Engine),
        "the loaded cuDNN has no graph API"
    );
    let quick = TimingSettings {
        warmup: 1,
        loops: 1,
        iterations: 1,
        long_call_ms: 1000.0,
    };
    let search = EngineSearch {
        max_candidates: Some(3),
        ..Default::default()
    };
    let mut rows = Vec::new();
    for case in spatial::cases() {
        let (label, problem) = (case.label, case.problem);
        let d = ConvDescriptors::new(&problem).expect("descriptors");
        let len = |role| d.shapes().elements(role);
        let handle = backend.handle();
        let inputs = [Operand::Input, Operand::Filter, Operand::Output]
            .map(|role| handle.alloc_random(problem.dtype, len(role), 7).unwrap());
        let host: Vec<Vec<f32>> = inputs.iter().map(|b| b.download().unwrap()).collect();
        for op in ConvOp::ALL {
            let extent = SplitDim::Spatial.extent(&problem, op);
            let size = spatial::even_chunk(extent);
            let measured = backend
                .measure(
                    &mucudnn::solver::MeasureKey::new(
                        problem,
                        op,
                        SplitDim::Spatial,
                        size,
                        AlgoKind::Engine,
                    ),
                    &mucudnn::backend::MeasureSettings {
                        timing: quick,
                        search: search.clone(),
                        select: Selection::ALL,
                        verify: true,
                    },
                )
                .expect("spatial measurement of a chunk size")
                .measurements;
            if measured.is_empty() && case.strided_rows {
                // Strided chunk views (NCHW rows): cuDNN need not take them, and the host
                // tier (`spatial_chunks_of_the_gpu_test_build`) reports which it does.
                rows.push(format!(
                    "{label} {op}: no engine configuration ran at chunk size {size} of \
                     {extent} (strided NCHW chunk views; reported, not a failure)"
                ));
                continue;
            }
            assert!(
                !measured.is_empty(),
                "{label} {op}: no engine ran at chunk size {size} of {extent}"
            );
            assert!(measured.iter().all(|m| m.micro == size), "{label} {op}");
            let roles = operand_roles(op);
            let index = |role: Operand| match role {
                Operand::Input => 0,
                Operand::Filter => 1,
                Operand::Output => 2,
            };
            let (ia, ib) = (index(roles[0]), index(roles[1]));
            let want = reference_convolution(&problem, op, &host[ia], &host[ib]).expect("ref");
            let handle = backend.handle();
            for m in &measured {
                let Algo::Engine(name) = m.algo else {
                    panic!("{label} {op}: {} is not an engine", m.algo)
                };
                let config = EngineConfig::from_name(name).unwrap();
                // Notes from the plan of the chunk size's first chunk as measured (the
                // undivided plan need not build).
                let geometry = AxisGeometry::of(&problem, split_axis(&problem));
                let notes = timing_chunks(&geometry, op, size)
                    .first()
                    .and_then(|chunk| {
                        let view = ChunkShapes::new(&problem, chunk).ok()?;
                        let alignments = view.any_row_alignments();
                        EnginePlan::for_chunk(handle, &view, op, &config, 1.0, 0.0, alignments).ok()
                    })
                    .map(|plan| plan.notes());
                let deterministic = notes.is_some_and(|n| !n.nondeterministic);
                let transform = notes.is_some_and(|n| n.fft || n.winograd);
                let tolerance = tolerance(&problem, transform);
                let whole_plan = spatial_plan(problem, op, &[extent], m.algo);
                let whole = run(handle, &whole_plan, &inputs[ia], &inputs[ib], len(roles[2]));
                if let Some(whole) = &whole {
                    let error = want.max_relative_error(whole);
                    assert!(
                        error <= tolerance,
                        "{label} {op} {}: whole error {error:.2e}",
                        m.algo
                    );
                }
                let even = vec![size; (extent / size) as usize];
                let mut chunkings = vec![even.clone()];
                chunkings.extend(spatial::uneven_chunkings(extent));
                for sizes in chunkings {
                    let p = spatial_plan(problem, op, &sizes, m.algo);
                    // A configuration need not build at every chunk shape (`run` says so),
                    // except at the size it was measured at.
                    let Some(parts) = run(handle, &p, &inputs[ia], &inputs[ib], len(roles[2]))
                    else {
                        assert!(
                            sizes != even,
                            "{label} {op} {}: chunks of the measured size {size} did not run",
                            m.algo
                        );
                        continue;
                    };
                    let split_error = want.max_relative_error(&parts);
                    assert!(
                        split_error <= tolerance,
                        "{label} {op} {} {sizes:?}: error {split_error:.2e}",
                        m.algo
                    );
                    let split = whole.as_ref().map(|whole| {
                        SplitComparison::new(
                            whole,
                            &parts,
                            &want,
                            split_precision(&problem, transform),
                        )
                    });
                    if let Some(split) = &split {
                        if deterministic
                            && (op != ConvOp::BackwardFilter || problem.dtype == DType::Fp32)
                        {
                            assert!(
                                split.within(),
                                "{label} {op} {} {sizes:?}: split vs undivided: {split}",
                                m.algo
                            );
                        }
                    }
                    rows.push(format!(
                        "{label} {op} {} {sizes:?}: error {split_error:.1e}, split vs whole: {}",
                        m.algo,
                        split.map_or("the undivided plan did not build".to_string(), |s| s
                            .to_string())
                    ));
                }
            }
        }
    }
    println!("\n{}", rows.join("\n"));
}

/// Verified tuning's comparison on the GPU (`cudnnOpTensor` and `cudnnReduceTensor` AMAX):
/// against known differences, in every dtype and layout the tuner uses (2-D and 3-D): an
/// output 1.5 times the reference differs by half its largest magnitude, an equal one by 0, one
/// with a NaN by NaN; the maxima match the host's within the dtype's rounding.
#[test]
#[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
fn gpu_output_comparison_measures_known_differences() {
    use mucudnn::backend::cudnn::{ComparisonDescriptors, ConvShapes, OutputComparison};
    let handle = CudnnHandle::new(0).expect("a GPU");
    let mut two_d = ConvProblem::new(4, 8, 12, 12, 16, 3, 3);
    (two_d.pad_h, two_d.pad_w) = (1, 1);
    let three_d = ConvProblem::new_3d(2, 4, 6, 10, 10, 8, 3, 3, 3);
    for problem in [two_d, three_d] {
        for dtype in [DType::Fp32, DType::Fp16, DType::Bf16] {
            for layout in [Layout::Nchw, Layout::Nhwc] {
                let p = ConvProblem {
                    dtype,
                    layout,
                    ..problem
                };
                let shapes = ConvShapes::new(&p).unwrap();
                for op in ConvOp::ALL {
                    let what = format!("{} {op}", p.describe());
                    let descriptors = ComparisonDescriptors::for_output(&shapes, op).unwrap();
                    let len = descriptors.len();
                    let mut comparison = OutputComparison::new(&handle, descriptors).unwrap();
                    let values = mucudnn::backend::cudnn::host::random_values(dtype, len, 5);
                    let largest = values.iter().fold(0.0f64, |m, v| m.max(f64::from(v.abs())));
                    let reference = handle.upload(dtype, &values).unwrap();
                    let scaled: Vec<f32> = values.iter().map(|v| v * 1.5).collect();
                    let mut with_nan = values.clone();
                    with_nan[len / 2] = f32::NAN;
                    let rounding = 4.0 * mucudnn::backend::verify::unit_roundoff(dtype);
                    for (case, out, want) in [
                        ("equal", values.clone(), 0.0),
                        ("1.5 times", scaled, 0.5),
                        ("NaN", with_nan, f64::NAN),
                    ] {
                        let out = handle.upload(dtype, &out).unwrap();
                        let (difference, reference_max) = comparison
                            .max_differences(&handle, &out.view_all(), &reference.view_all())
                            .unwrap_or_else(|e| panic!("{what} {case}: {e}"));
                        assert!(
                            (reference_max - largest).abs() <= rounding * largest,
                            "{what} {case}: max |reference| {reference_max}, host {largest}"
                        );
                        let relative = difference / reference_max;
                        if want.is_nan() {
                            assert!(difference.is_nan(), "{what} {case}: {difference}");
                        } else {
                            assert!(
                                (relative - want).abs() <= rounding,
                                "{what} {case}: relative difference {relative}, want {want}"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// Verified measuring on a GPU: every legacy algorithm and engine configuration cuDNN runs at a
/// size is compared with the reference (implicit GEMM, FMA math), in fp32 (TF32 allowed), fp16
/// and bf16, 2-D and 3-D; the table of each candidate's error is printed (the GPU acceptance's
/// `verify` part prints the same from `tune --json`). A correct cuDNN rejects nothing at fp32
/// with FMA math, where every candidate is an exact sum.
#[test]
#[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
fn gpu_verified_measuring_compares_every_candidate() {
    use mucudnn::backend::{Backend, CudnnBackend, EngineSearch, MeasureSettings, Selection};
    use mucudnn::solver::{AlgoKind, MeasureKey};
    let mut backend = CudnnBackend::new(0).expect("a GPU");
    let mut two_d = ConvProblem::new(8, 32, 14, 14, 32, 3, 3);
    (two_d.pad_h, two_d.pad_w) = (1, 1);
    let cases = [
        (
            "2-D fp32 FMA",
            ConvProblem {
                math: MathMode::Fma,
                ..two_d
            },
        ),
        ("2-D fp32 (TF32 allowed)", two_d),
        (
            "2-D fp16 NHWC",
            ConvProblem {
                dtype: DType::Fp16,
                layout: Layout::Nhwc,
                ..two_d
            },
        ),
        (
            "2-D bf16 NHWC",
            ConvProblem {
                dtype: DType::Bf16,
                layout: Layout::Nhwc,
                ..two_d
            },
        ),
        ("3-D fp32", ConvProblem::new_3d(2, 8, 6, 12, 12, 8, 3, 3, 3)),
    ];
    let how = MeasureSettings {
        search: EngineSearch {
            max_candidates: Some(8),
            ..Default::default()
        },
        select: Selection::ALL,
        ..MeasureSettings::all(mucudnn::backend::TimingSettings {
            warmup: 1,
            loops: 1,
            iterations: 1,
            long_call_ms: 100.0,
        })
    };
    println!(
        "{:<24} {:<10} {:<5} {:<44} {:>9} {:>9}  status",
        "case", "op", "size", "candidate", "error", "tolerance"
    );
    for (label, problem) in cases {
        for op in ConvOp::ALL {
            let mut compared = 0;
            let mut timed = 0;
            for kind in backend.kinds().to_vec() {
                let found = backend
                    .measure(&MeasureKey::batch(problem, op, 4, kind), &how)
                    .unwrap_or_else(|e| panic!("{label} {op} {kind}: {e}"));
                for m in found.measurements.iter().chain(&found.rejected) {
                    timed += 1;
                    let names = mucudnn::solver::AlgoNames::new(mucudnn::device::BackendKind::Cuda);
                    let (error, tolerance, status) = match m.verification {
                        Some(v) => {
                            compared += 1;
                            (
                                format!("{:.1e}", v.max_rel_error),
                                format!("{:.1e}", v.tolerance),
                                if v.passed() { "ok" } else { "REJECTED" },
                            )
                        }
                        None => ("-".into(), "-".into(), "not compared"),
                    };
                    println!(
                        "{label:<24} {op:<10} {:<5} {:<44} {error:>9} {tolerance:>9}  {status}",
                        m.micro,
                        names.name(op, m.algo)
                    );
                }
                if label == "2-D fp32 FMA" && kind == AlgoKind::Legacy {
                    assert!(
                        found.rejected.is_empty(),
                        "{label} {op}: {:?}",
                        found.rejected
                    );
                }
            }
            assert!(timed > 0, "{label} {op}: nothing ran");
            assert!(
                compared * 10 >= timed * 9,
                "{label} {op}: {compared} of {timed} compared"
            );
        }
    }
    backend.release();
}
