//! Half-precision backward-filter split into k micro-batches. Each later
//! micro-batch accumulates into `dw` (beta = 1); stored in fp16/bf16, that is k roundings of the
//! running sum where PyTorch has one. The CPU executor sums the micro-batches in fp32 and
//! rounds once, so a split `dw` stays within 2x of the undivided one's error against float64
//! (docs/pytorch.md, "Half-precision weight gradients", has the measured table).
//!
//! `MUCUDNN_HALF_DW_LAYER=C,K,H,W,N` measures another 3x3 layer (the table used
//! `64,64,14,14,16`, in release); the test prints its table either way.

use mucudnn::backend::cpu::{self, reference, AlignedWorkspace, CpuAlgo};
use mucudnn::backend::cudnn::host::random_values;
use mucudnn::exec::{cpu_workspace_bytes, execute_cpu};
use mucudnn::solver::{Algo, ConvOp, ConvProblem, DType, Layout, MicroBatch, Plan};

fn layer() -> ConvProblem {
    let dims: Vec<i64> = std::env::var("MUCUDNN_HALF_DW_LAYER")
        .ok()
        .map(|text| {
            text.split(',')
                .filter_map(|v| v.trim().parse().ok())
                .collect()
        })
        .filter(|dims: &Vec<i64>| dims.len() == 5)
        .unwrap_or_else(|| vec![16, 16, 8, 8, 16]);
    let (c, k, h, w, n) = (dims[0], dims[1], dims[2], dims[3], dims[4]);
    ConvProblem {
        pad_h: 1,
        pad_w: 1,
        ..ConvProblem::new(n, c, h, w, k, 3, 3)
    }
}

/// `k` equal micro-batches of `algo`.
fn plan(problem: ConvProblem, k: i64, algo: CpuAlgo) -> Plan {
    Plan {
        layer: "half-dw".into(),
        problem,
        op: ConvOp::BackwardFilter,
        split: mucudnn::solver::SplitDim::Batch,
        micro_batches: (0..k)
            .map(|_| MicroBatch {
                size: problem.n / k,
                algo: Algo::Legacy(algo.id()),
                workspace_bytes: 0,
                time_ms: 1.0,
            })
            .collect(),
    }
}

fn relative_error(got: &[f32], want: &[f64]) -> f64 {
    let (mut diff, mut norm) = (0.0, 0.0);
    for (&g, &w) in got.iter().zip(want) {
        diff += (g as f64 - w) * (g as f64 - w);
        norm += w * w;
    }
    (diff / norm).sqrt()
}

/// dw of `problem` in `T` with `k` micro-batches, and its relative (Frobenius) error against
/// the float64 result of the same (already rounded) operands.
fn dw_error<T: cpu::Element>(problem: ConvProblem, k: i64, algo: CpuAlgo) -> f64 {
    let [(_, x_len), (_, dy_len), _] = cpu::buffer_lens(&problem, ConvOp::BackwardFilter).unwrap();
    let x = random_values(T::DTYPE, x_len, 1);
    let dy = random_values(T::DTYPE, dy_len, 2);
    let want = reference::conv_f64(
        &problem,
        ConvOp::BackwardFilter,
        &x.iter().map(|&v| v as f64).collect::<Vec<_>>(),
        &dy.iter().map(|&v| v as f64).collect::<Vec<_>>(),
    )
    .unwrap();
    let x: Vec<T> = x.into_iter().map(T::from_f32).collect();
    let dy: Vec<T> = dy.into_iter().map(T::from_f32).collect();
    let mut dw = vec![T::from_f32(0.0); want.len()];
    let plan = plan(problem, k, algo);
    let mut workspace = AlignedWorkspace::new(cpu_workspace_bytes(&plan));
    execute_cpu(&plan, 1.0, &x, &dy, 0.0, &mut dw, workspace.as_bytes_mut()).unwrap();
    let got: Vec<f32> = dw.iter().map(|v| v.to_f32()).collect();
    relative_error(&got, &want)
}

fn errors<T: cpu::Element>(problem: ConvProblem, algo: CpuAlgo) -> Vec<(i64, f64)> {
    [1, 2, 4, 8, 16]
        .into_iter()
        .filter(|k| problem.n % k == 0)
        .map(|k| (k, dw_error::<T>(problem, k, algo)))
        .collect()
}

#[test]
fn a_split_half_precision_weight_gradient_stays_within_2x_of_the_undivided_error() {
    let base = layer();
    for dtype in [DType::Bf16, DType::Fp16] {
        for layout in [Layout::Nchw, Layout::Nhwc] {
            // Both algorithms sum each micro-batch in f32 and store once: one suffices per
            // layout, the other is run once.
            let algos: &[CpuAlgo] = if dtype == DType::Bf16 && layout == Layout::Nchw {
                &[CpuAlgo::Direct, CpuAlgo::Im2colGemm]
            } else {
                &[CpuAlgo::Direct]
            };
            for &algo in algos {
                let problem = ConvProblem {
                    dtype,
                    layout,
                    ..base
                };
                let table = match dtype {
                    DType::Bf16 => errors::<half::bf16>(problem, algo),
                    _ => errors::<half::f16>(problem, algo),
                };
                let undivided = table[0].1;
                let row: Vec<String> = table
                    .iter()
                    .map(|(k, e)| format!("k={k}: {e:.3e} ({:.2}x)", e / undivided))
                    .collect();
                println!("{dtype:?} {layout:?} {algo:?}: {}", row.join(", "));
                assert!(undivided > 0.0 && undivided < 1e-2, "{row:?}");
                for (k, error) in &table[1..] {
                    assert!(
                        *error <= 2.0 * undivided,
                        "{dtype:?} {layout:?} {algo:?}: k = {k} gives {error:.3e}, more than \
                         twice the undivided {undivided:.3e}: {row:?}"
                    );
                }
            }
        }
    }
}

/// fp32 is summed in place (beta = 1 in fp32 costs nothing measurable): still close.
#[test]
fn fp32_splits_match_the_undivided_weight_gradient() {
    let problem = layer();
    for (k, error) in errors::<f32>(problem, CpuAlgo::Direct) {
        assert!(error < 1e-6, "k = {k}: {error:.3e}");
    }
}
