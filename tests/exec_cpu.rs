//! Execution on the CPU backend: a micro-batched plan gives the undivided result (bitwise
//! for forward and backward-data, 1e-6 relative for backward-filter), every algorithm matches a
//! float64 reference, alpha/beta are respected (backward-filter's beta goes to the first
//! micro-batch only), and bad input is an error, never a panic.

use mucudnn::backend::cpu::{self, reference, CpuAlgo};
use mucudnn::backend::cudnn::host::random_values;
use mucudnn::exec::{cpu_workspace_bytes, execute_cpu, ExecError};
use mucudnn::solver::{Algo, ConvOp, ConvProblem, DType, Layout, MicroBatch, Plan};

fn plan(problem: ConvProblem, op: ConvOp, sizes: &[(i64, CpuAlgo)]) -> Plan {
    Plan {
        layer: "test".into(),
        problem,
        op,
        split: mucudnn::solver::SplitDim::Batch,
        micro_batches: sizes
            .iter()
            .map(|&(size, algo)| MicroBatch {
                size,
                algo: Algo::Legacy(algo.id()),
                workspace_bytes: 0,
                time_ms: 1.0,
            })
            .collect(),
    }
}

/// Random operands `(a, b)` and a random initial `out` for `op` at the full batch.
fn operands(problem: &ConvProblem, op: ConvOp, seed: u64) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let [(_, a), (_, b), (_, out)] = cpu::buffer_lens(problem, op).unwrap();
    (
        random_values(DType::Fp32, a, seed),
        random_values(DType::Fp32, b, seed + 1),
        random_values(DType::Fp32, out, seed + 2),
    )
}

fn run(
    plan: &Plan,
    alpha: f32,
    a: &[f32],
    b: &[f32],
    beta: f32,
    out: &mut [f32],
) -> Result<(), ExecError> {
    let mut workspace = cpu::AlignedWorkspace::new(cpu_workspace_bytes(plan));
    execute_cpu(plan, alpha, a, b, beta, out, workspace.as_bytes_mut())
}

fn problems() -> Vec<ConvProblem> {
    let base = ConvProblem::new(5, 4, 7, 6, 6, 3, 2);
    vec![
        base,
        ConvProblem {
            pad_h: 1,
            pad_w: 2,
            stride_h: 2,
            stride_w: 1,
            ..base
        },
        ConvProblem {
            dilation_h: 2,
            dilation_w: 2,
            pad_h: 2,
            pad_w: 1,
            ..base
        },
        ConvProblem {
            groups: 2,
            pad_h: 1,
            pad_w: 1,
            ..base
        },
        ConvProblem {
            groups: 4,
            c: 4,
            k: 4,
            pad_h: 1,
            pad_w: 1,
            ..base
        }, // depthwise
        // Rows wider than the direct kernels' 16-column register strips, not a multiple of
        // them (the last strip overlaps), with padding at both ends, and strided.
        ConvProblem {
            pad_h: 1,
            pad_w: 1,
            w: 37,
            ..base
        },
        ConvProblem {
            pad_h: 2,
            pad_w: 2,
            w: 45,
            stride_w: 2,
            r: 5,
            s: 5,
            k: 5,
            ..base
        },
    ]
}

fn max_relative(got: &[f32], want: &[f64]) -> f64 {
    let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(1e-30);
    got.iter()
        .zip(want)
        .map(|(&g, &w)| (f64::from(g) - w).abs() / scale)
        .fold(0.0, f64::max)
}

/// 3-D (NCDHW / NDHWC) and 1-D (NCW / NWC) problems at batch 5: depth set apart from height
/// (`t != r`, `pad_d != pad_h`), stride 2 with odd sizes, dilation, groups, depthwise.
fn problems_3d_and_1d() -> Vec<ConvProblem> {
    let ncdhw = ConvProblem::new_3d;
    vec![
        ConvProblem {
            pad_d: 1,
            pad_w: 1,
            ..ncdhw(5, 3, 5, 4, 6, 4, 2, 3, 2)
        },
        ConvProblem {
            pad_d: 1,
            pad_h: 2,
            pad_w: 1,
            stride_d: 2,
            stride_h: 2,
            stride_w: 2,
            ..ncdhw(5, 2, 7, 5, 7, 3, 3, 3, 3)
        },
        ConvProblem {
            dilation_d: 2,
            pad_h: 1,
            ..ncdhw(5, 2, 7, 5, 6, 3, 2, 2, 2)
        },
        ConvProblem {
            groups: 2,
            pad_d: 1,
            pad_h: 1,
            stride_d: 2,
            ..ncdhw(5, 4, 6, 4, 5, 6, 3, 2, 2)
        },
        // depthwise
        ConvProblem {
            groups: 4,
            pad_d: 1,
            pad_h: 1,
            pad_w: 1,
            stride_d: 2,
            stride_w: 2,
            ..ncdhw(5, 4, 5, 5, 5, 4, 3, 3, 3)
        },
        ConvProblem {
            pad_w: 2,
            stride_w: 2,
            ..ConvProblem::new_1d(5, 3, 21, 4, 5)
        },
        ConvProblem {
            groups: 3,
            pad_w: 2,
            dilation_w: 2,
            ..ConvProblem::new_1d(5, 3, 15, 6, 3)
        },
    ]
}

#[test]
fn micro_batched_equals_undivided_and_the_reference_for_every_op_layout_and_algo() {
    check_micro_batched(problems());
}

/// A micro-batched 3-D (or 1-D) plan executes on the CPU as the undivided one does.
#[test]
fn micro_batched_3d_and_1d_plans_equal_undivided_and_the_reference() {
    for problem in problems_3d_and_1d() {
        let one_d = problem.h == 1 && problem.r == 1;
        assert!(problem.is_3d() || one_d, "{}", problem.describe());
    }
    check_micro_batched(problems_3d_and_1d());
}

fn check_micro_batched(problems: Vec<ConvProblem>) {
    for layout in [Layout::Nchw, Layout::Nhwc] {
        for (index, base) in problems.iter().copied().enumerate() {
            let problem = ConvProblem { layout, ..base };
            for op in ConvOp::ALL {
                let (a, b, _) = operands(&problem, op, 10 + index as u64);
                let wide = |v: &[f32]| v.iter().map(|&x| f64::from(x)).collect::<Vec<_>>();
                let want = reference::conv_f64(&problem, op, &wide(&a), &wide(&b)).unwrap();
                for algo in CpuAlgo::ALL {
                    let what = format!("{} {op} {}", problem.describe(), algo.name());
                    let undivided = plan(problem, op, &[(5, algo)]);
                    let split = plan(problem, op, &[(2, algo), (2, algo), (1, algo)]);
                    let mut whole = vec![f32::NAN; want.len()];
                    run(&undivided, 1.0, &a, &b, 0.0, &mut whole).unwrap();
                    let mut parts = vec![f32::NAN; want.len()];
                    run(&split, 1.0, &a, &b, 0.0, &mut parts).unwrap();
                    assert!(
                        max_relative(&whole, &want) < 1e-5,
                        "{what}: vs reference {}",
                        max_relative(&whole, &want)
                    );
                    if op == ConvOp::BackwardFilter {
                        // Relative to the gradient's largest magnitude: micro-batching only
                        // changes the order of the batch sum.
                        let diff = max_relative(&parts, &wide(&whole));
                        assert!(diff <= 1e-6, "{what}: split differs by {diff}");
                    } else {
                        let same = whole
                            .iter()
                            .zip(&parts)
                            .all(|(x, y)| x.to_bits() == y.to_bits());
                        assert!(same, "{what}: split is not bitwise equal");
                    }
                }
                // A plan that mixes algorithms is still right.
                let mixed = plan(
                    problem,
                    op,
                    &[
                        (3, CpuAlgo::Im2colGemm),
                        (1, CpuAlgo::Direct),
                        (1, CpuAlgo::Im2colGemmPerImage),
                    ],
                );
                let mut out = vec![f32::NAN; want.len()];
                run(&mixed, 1.0, &a, &b, 0.0, &mut out).unwrap();
                assert!(
                    max_relative(&out, &want) < 1e-5,
                    "{layout} {index} {op} mixed"
                );
            }
        }
    }
}

#[test]
fn alpha_and_beta_are_respected_and_backward_filter_keeps_every_gradient() {
    let problem = ConvProblem {
        pad_h: 1,
        pad_w: 1,
        ..ConvProblem::new(4, 3, 5, 5, 2, 3, 3)
    };
    for op in ConvOp::ALL {
        let (a, b, initial) = operands(&problem, op, 77);
        let wide = |v: &[f32]| v.iter().map(|&x| f64::from(x)).collect::<Vec<_>>();
        let conv = reference::conv_f64(&problem, op, &wide(&a), &wide(&b)).unwrap();
        let split = plan(
            problem,
            op,
            &[
                (1, CpuAlgo::Direct),
                (2, CpuAlgo::Im2colGemm),
                (1, CpuAlgo::Direct),
            ],
        );
        // beta = 0 over NaN: overwritten, and (for backward filter) all four images counted.
        let mut out = vec![f32::NAN; conv.len()];
        run(&split, 0.5, &a, &b, 0.0, &mut out).unwrap();
        let want: Vec<f64> = conv.iter().map(|v| 0.5 * v).collect();
        assert!(max_relative(&out, &want) < 1e-5, "{op} beta=0");
        // beta = 2: accumulates into the caller's output once.
        let mut out = initial.clone();
        run(&split, 1.5, &a, &b, 2.0, &mut out).unwrap();
        let want: Vec<f64> = conv
            .iter()
            .zip(&initial)
            .map(|(v, &i)| 1.5 * v + 2.0 * f64::from(i))
            .collect();
        assert!(max_relative(&out, &want) < 1e-5, "{op} beta=2");
    }
}

#[test]
fn bad_input_is_an_error_not_a_panic() {
    let problem = ConvProblem::new(2, 4, 6, 6, 4, 3, 3);
    let op = ConvOp::Forward;
    let (a, b, mut out) = operands(&problem, op, 5);
    let ok = plan(problem, op, &[(1, CpuAlgo::Direct), (1, CpuAlgo::Direct)]);
    run(&ok, 1.0, &a, &b, 0.0, &mut out).unwrap();
    let bad_shapes = [
        ConvProblem { n: -2, ..problem },
        ConvProblem {
            groups: 3,
            ..problem
        },
        ConvProblem { r: 9, ..problem },
        ConvProblem {
            stride_h: 0,
            ..problem
        },
    ];
    for bad in bad_shapes {
        let err = run(
            &plan(bad, op, &[(2, CpuAlgo::Direct)]),
            1.0,
            &a,
            &b,
            0.0,
            &mut out,
        )
        .unwrap_err();
        assert!(
            matches!(err, ExecError::InvalidPlan { .. }),
            "{bad:?}: {err}"
        );
    }
    let err = run(&ok, 1.0, &a[1..], &b, 0.0, &mut out).unwrap_err();
    assert!(err.to_string().contains("x"), "{err}");
    let err = run(&ok, 1.0, &a, &b, 0.0, &mut out[..3]).unwrap_err();
    assert!(err.to_string().contains("y"), "{err}");
    // The same sizes as a spatial plan must add up to the rows along the split axis.
    let spatial = Plan {
        split: mucudnn::solver::SplitDim::Spatial,
        ..ok.clone()
    };
    let err = run(&spatial, 1.0, &a, &b, 0.0, &mut out).unwrap_err();
    assert!(matches!(err, ExecError::InvalidPlan { .. }), "{err}");
    assert!(err.to_string().contains("rows along h"), "{err}");
    let short = plan(problem, op, &[(1, CpuAlgo::Direct)]);
    assert!(run(&short, 1.0, &a, &b, 0.0, &mut out)
        .unwrap_err()
        .to_string()
        .contains("add up to 1"));
    let unknown = Plan {
        micro_batches: vec![MicroBatch {
            size: 2,
            algo: Algo::Legacy(99),
            workspace_bytes: 0,
            time_ms: 1.0,
        }],
        ..ok.clone()
    };
    assert!(run(&unknown, 1.0, &a, &b, 0.0, &mut out)
        .unwrap_err()
        .to_string()
        .contains("algo 99"));
    let engine = Plan {
        micro_batches: vec![MicroBatch {
            algo: Algo::Engine("eng38_k2=8".parse().unwrap()),
            ..unknown.micro_batches[0]
        }],
        ..ok.clone()
    };
    let err = run(&engine, 1.0, &a, &b, 0.0, &mut out).unwrap_err();
    assert!(err.to_string().contains("eng38_k2=8"), "{err}");
    let needs = plan(problem, op, &[(2, CpuAlgo::Im2colGemm)]);
    let err = execute_cpu(&needs, 1.0, &a, &b, 0.0, &mut out, &mut []).unwrap_err();
    assert!(err.to_string().contains("workspace"), "{err}");
}
