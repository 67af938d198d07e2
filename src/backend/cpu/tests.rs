//! Tests of the CPU backend against the f64 reference. Shapes are tiny because the backend is
//! compiled at opt-level 0 in test builds.

use super::reference::conv_f64;
use super::*;
use crate::solver::{ConvOp, ConvProblem, DType, Layout};
use half::{bf16, f16};

/// xorshift64*: deterministic, never all zeros.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// Uniform in [-1, 1).
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let bits = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40; // 24 bits
        bits as f32 / (1u64 << 23) as f32 - 1.0
    }

    fn vec<T: Element>(&mut self, len: usize) -> Vec<T> {
        (0..len).map(|_| T::from_f32(self.next())).collect()
    }
}

fn nchw(n: i64, c: i64, h: i64, w: i64, k: i64, r: i64, s: i64) -> ConvProblem {
    ConvProblem::new(n, c, h, w, k, r, s)
}

/// Shapes covering padding, stride, dilation, groups, depthwise, 1x1, asymmetric h/w and r/s,
/// out-of-image taps, uncovered inputs (stride > filter) and a reduction longer than
/// matrixmultiply's kc block (256). All NCHW fp32; tests vary the layout and dtype.
fn shapes() -> Vec<ConvProblem> {
    vec![
        nchw(2, 3, 5, 7, 4, 3, 2),
        ConvProblem {
            pad_h: 1,
            pad_w: 2,
            stride_h: 2,
            stride_w: 2,
            ..nchw(3, 4, 7, 9, 6, 3, 3)
        },
        ConvProblem {
            pad_h: 2,
            pad_w: 1,
            dilation_h: 2,
            dilation_w: 2,
            ..nchw(2, 2, 9, 8, 3, 3, 2)
        },
        ConvProblem {
            groups: 2,
            pad_h: 1,
            pad_w: 1,
            stride_h: 2,
            stride_w: 1,
            ..nchw(2, 4, 6, 5, 6, 2, 3)
        },
        // depthwise
        ConvProblem {
            groups: 4,
            pad_h: 1,
            pad_w: 1,
            stride_h: 2,
            stride_w: 2,
            ..nchw(2, 4, 7, 6, 4, 3, 3)
        },
        nchw(4, 8, 3, 4, 5, 1, 1),
        ConvProblem {
            groups: 2,
            pad_h: 2,
            pad_w: 1,
            stride_h: 2,
            stride_w: 3,
            dilation_h: 2,
            dilation_w: 1,
            ..nchw(2, 4, 9, 8, 4, 2, 3)
        },
        // filter larger than the image, stride larger than the filter
        ConvProblem {
            pad_h: 2,
            pad_w: 2,
            stride_h: 3,
            stride_w: 5,
            ..nchw(1, 2, 3, 4, 3, 5, 2)
        },
        // channel multiplier: c/g = 1 with 8 filters per group, k beyond the stack chunks
        ConvProblem {
            groups: 3,
            pad_h: 1,
            pad_w: 1,
            stride_w: 2,
            ..nchw(2, 3, 5, 6, 24, 3, 2)
        },
        // c/g * r * s = 280 > 256
        ConvProblem {
            pad_h: 2,
            pad_w: 3,
            ..nchw(2, 8, 9, 9, 3, 5, 7)
        },
    ]
}

/// 3-D shapes (NCDHW fp32; tests vary the layout and dtype) covering what [`shapes`] covers
/// for 2-D, with depth and height set apart (`t != r`, `pad_d != pad_h`, different strides and
/// dilations) so that mixing up the two axes cannot pass.
fn shapes_3d() -> Vec<ConvProblem> {
    let ncdhw = ConvProblem::new_3d;
    vec![
        ConvProblem {
            pad_d: 1,
            pad_w: 1,
            ..ncdhw(2, 3, 5, 4, 6, 4, 2, 3, 2)
        },
        // stride 2 everywhere, odd sizes
        ConvProblem {
            pad_d: 1,
            pad_h: 2,
            pad_w: 1,
            stride_d: 2,
            stride_h: 2,
            stride_w: 2,
            ..ncdhw(3, 2, 7, 5, 9, 3, 3, 3, 3)
        },
        // dilation 2 in depth and width, not height
        ConvProblem {
            pad_d: 2,
            pad_h: 1,
            dilation_d: 2,
            dilation_w: 2,
            ..ncdhw(2, 2, 7, 5, 8, 3, 3, 2, 2)
        },
        // groups, stride in depth only
        ConvProblem {
            groups: 2,
            pad_d: 1,
            pad_h: 1,
            pad_w: 1,
            stride_d: 2,
            ..ncdhw(2, 4, 6, 5, 5, 6, 2, 2, 3)
        },
        // depthwise, stride 2 in height and width
        ConvProblem {
            groups: 4,
            pad_d: 1,
            pad_h: 1,
            pad_w: 1,
            stride_h: 2,
            stride_w: 2,
            ..ncdhw(2, 4, 5, 7, 6, 4, 3, 3, 3)
        },
        // 1x1x1
        ncdhw(4, 8, 3, 2, 4, 5, 1, 1, 1),
        // filter deeper than the input, depth stride larger than the filter
        ConvProblem {
            pad_d: 2,
            pad_h: 1,
            stride_d: 3,
            stride_w: 2,
            dilation_h: 2,
            ..ncdhw(1, 2, 3, 5, 5, 3, 5, 2, 2)
        },
        // channel multiplier: c/g = 1 with 4 filters per group, k beyond the stack chunks
        ConvProblem {
            groups: 3,
            pad_d: 1,
            pad_w: 1,
            stride_d: 2,
            ..ncdhw(2, 3, 5, 3, 4, 12, 3, 2, 2)
        },
        // c/g * t * r * s = 288 > 256
        ConvProblem {
            pad_d: 1,
            pad_h: 1,
            pad_w: 2,
            ..ncdhw(2, 8, 3, 3, 5, 2, 3, 3, 4)
        },
    ]
}

/// 1-D shapes (`h = r = 1`, NCW fp32): padding, stride 2 with odd length, dilation, groups,
/// depthwise.
fn shapes_1d() -> Vec<ConvProblem> {
    let ncw = ConvProblem::new_1d;
    vec![
        ConvProblem {
            pad_w: 1,
            ..ncw(2, 3, 11, 4, 3)
        },
        ConvProblem {
            pad_w: 2,
            stride_w: 2,
            dilation_w: 2,
            ..ncw(3, 4, 13, 6, 3)
        },
        ConvProblem {
            groups: 2,
            stride_w: 3,
            ..ncw(2, 4, 17, 6, 4)
        },
        ConvProblem {
            groups: 5,
            pad_w: 3,
            ..ncw(2, 5, 9, 10, 7)
        },
    ]
}

fn with(problem: ConvProblem, layout: Layout, dtype: DType) -> ConvProblem {
    ConvProblem {
        layout,
        dtype,
        ..problem
    }
}

/// Runs with a freshly allocated workspace of exactly `workspace_bytes`.
fn run_exact<T: Element>(
    problem: &ConvProblem,
    op: ConvOp,
    algo: CpuAlgo,
    operands: Operands<'_, T>,
) -> Result<(), CpuError> {
    let Operands {
        alpha,
        a,
        b,
        beta,
        out,
    } = operands;
    let mut ws = AlignedWorkspace::new(workspace_bytes(problem, op, algo));
    run(problem, op, algo, alpha, a, b, beta, out, ws.as_bytes_mut())
}

/// `out = alpha * op(a, b) + beta * out` as [`Operands`].
fn operands<'a, T>(
    (alpha, beta): (f32, f32),
    a: &'a [T],
    b: &'a [T],
    out: &'a mut [T],
) -> Operands<'a, T> {
    Operands {
        alpha,
        a,
        b,
        beta,
        out,
    }
}

fn lens(problem: &ConvProblem, op: ConvOp) -> [usize; 3] {
    buffer_lens(problem, op).unwrap().map(|(_, len)| len)
}

fn widen<T: Element>(v: &[T]) -> Vec<f64> {
    v.iter().map(|x| f64::from(x.to_f32())).collect()
}

/// `alpha * op(a, b) + beta * out0`, treating `beta == 0` as "ignore out0".
fn expected<T: Element>(
    problem: &ConvProblem,
    op: ConvOp,
    alpha: f32,
    a: &[T],
    b: &[T],
    beta: f32,
    out0: &[T],
) -> Vec<f64> {
    let conv = conv_f64(problem, op, &widen(a), &widen(b)).unwrap();
    conv.iter()
        .zip(out0)
        .map(|(&v, o)| {
            let prior = if beta == 0.0 {
                0.0
            } else {
                f64::from(beta) * f64::from(o.to_f32())
            };
            f64::from(alpha) * v + prior
        })
        .collect()
}

fn assert_close<T: Element>(got: &[T], want: &[f64], rel: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, &w)) in got.iter().zip(want).enumerate() {
        let g = f64::from(g.to_f32());
        let tol = rel * w.abs().max(1.0);
        assert!(
            (g - w).abs() <= tol,
            "{what}: element {i}: got {g}, want {w} (tolerance {tol})"
        );
    }
}

/// Every op x algo x layout on every shape against the reference, with three alpha/beta
/// settings: overwrite (out NaN-filled), scale-and-blend, accumulate.
fn check_against_reference<T: Element>(dtype: DType, rel: f64, shapes: &[ConvProblem]) {
    let mut rng = Rng::new(7);
    for base in shapes {
        for layout in [Layout::Nchw, Layout::Nhwc] {
            let problem = with(*base, layout, dtype);
            for op in ConvOp::ALL {
                let [la, lb, lo] = lens(&problem, op);
                let a: Vec<T> = rng.vec(la);
                let b: Vec<T> = rng.vec(lb);
                let prior: Vec<T> = rng.vec(lo);
                let nan = vec![T::from_f32(f32::NAN); lo];
                for algo in CpuAlgo::ALL {
                    for (alpha, beta, out0) in
                        [(1.0, 0.0, &nan), (0.75, -0.5, &prior), (1.0, 1.0, &prior)]
                    {
                        let what = format!(
                            "{} {op} {algo} alpha {alpha} beta {beta}",
                            problem.describe()
                        );
                        let mut out = out0.clone();
                        run_exact(
                            &problem,
                            op,
                            algo,
                            operands((alpha, beta), &a, &b, &mut out),
                        )
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                        let want = expected(&problem, op, alpha, &a, &b, beta, out0);
                        assert_close(&out, &want, rel, &what);
                    }
                }
            }
        }
    }
}

#[test]
fn fp32_matches_reference_for_every_op_algo_and_layout() {
    check_against_reference::<f32>(DType::Fp32, 1e-5, &shapes());
}

#[test]
fn fp16_and_bf16_roughly_match_reference() {
    // Inputs are already rounded to the storage type, so the only errors are the f32
    // accumulation and the final rounding of the output (2^-11 for fp16, 2^-8 for bf16).
    let shapes = &shapes()[..5];
    check_against_reference::<f16>(DType::Fp16, 2e-3, shapes);
    check_against_reference::<bf16>(DType::Bf16, 1.6e-2, shapes);
}

#[test]
fn fp32_3d_matches_reference_for_every_op_algo_and_layout() {
    check_against_reference::<f32>(DType::Fp32, 1e-5, &shapes_3d());
}

#[test]
fn fp16_and_bf16_3d_roughly_match_reference() {
    let shapes = &shapes_3d()[..5];
    check_against_reference::<f16>(DType::Fp16, 2e-3, shapes);
    check_against_reference::<bf16>(DType::Bf16, 1.6e-2, shapes);
}

#[test]
fn conv1d_matches_reference_in_every_dtype() {
    let shapes = shapes_1d();
    check_against_reference::<f32>(DType::Fp32, 1e-5, &shapes);
    check_against_reference::<f16>(DType::Fp16, 2e-3, &shapes);
    check_against_reference::<bf16>(DType::Bf16, 1.6e-2, &shapes);
}

/// A convolution along depth alone (`h = w = r = s = 1`) is the 1-D convolution along width
/// of the same data: NCDHW with unit height and width has the memory order of NCW, and NDHWC
/// that of NWC. Checks the kernels' depth arithmetic (and the reference's) against their
/// width arithmetic, which the 2-D tests pin down.
#[test]
fn depth_alone_is_a_1d_convolution() {
    let mut rng = Rng::new(5);
    let one_d = ConvProblem {
        groups: 2,
        pad_w: 2,
        stride_w: 2,
        dilation_w: 2,
        ..ConvProblem::new_1d(2, 4, 9, 6, 3)
    };
    let depth = ConvProblem {
        groups: 2,
        pad_d: 2,
        stride_d: 2,
        dilation_d: 2,
        ..ConvProblem::new_3d(2, 4, 9, 1, 1, 6, 3, 1, 1)
    };
    for layout in [Layout::Nchw, Layout::Nhwc] {
        let (one_d, depth) = (
            with(one_d, layout, DType::Fp32),
            with(depth, layout, DType::Fp32),
        );
        for op in ConvOp::ALL {
            assert_eq!(lens(&one_d, op), lens(&depth, op));
            let [la, lb, lo] = lens(&depth, op);
            let (a, b): (Vec<f32>, Vec<f32>) = (rng.vec(la), rng.vec(lb));
            let want = conv_f64(&one_d, op, &widen(&a), &widen(&b)).unwrap();
            assert_eq!(conv_f64(&depth, op, &widen(&a), &widen(&b)).unwrap(), want);
            for algo in CpuAlgo::ALL {
                let mut out = vec![f32::NAN; lo];
                run_exact(&depth, op, algo, operands((1.0, 0.0), &a, &b, &mut out)).unwrap();
                let what = format!("{} {op} {algo}", depth.describe());
                assert_close(&out, &want, 1e-5, &what);
            }
        }
    }
}

/// Runs `op` on micro-batches of the given sizes, slicing the batched tensors as an executor
/// would; for backward filter the first micro-batch uses `beta` and the rest accumulate.
/// The result is written into `whole.out`.
fn run_split<T: Element>(
    problem: &ConvProblem,
    op: ConvOp,
    algo: CpuAlgo,
    whole: Operands<'_, T>,
    splits: &[i64],
) {
    let Operands {
        alpha,
        a,
        b,
        beta,
        out,
    } = whole;
    assert_eq!(splits.iter().sum::<i64>(), problem.n);
    let [lx, _, ly] = lens(problem, ConvOp::Forward);
    let (x_img, y_img) = (lx / problem.n as usize, ly / problem.n as usize);
    let mut i0 = 0;
    for (idx, &m) in splits.iter().enumerate() {
        let sub = problem.with_batch(m);
        let (lo, hi) = (i0, i0 + m as usize);
        let micro = match op {
            ConvOp::Forward => operands(
                (alpha, beta),
                &a[lo * x_img..hi * x_img],
                b,
                &mut out[lo * y_img..hi * y_img],
            ),
            ConvOp::BackwardData => operands(
                (alpha, beta),
                a,
                &b[lo * y_img..hi * y_img],
                &mut out[lo * x_img..hi * x_img],
            ),
            ConvOp::BackwardFilter => operands(
                (alpha, if idx == 0 { beta } else { 1.0 }),
                &a[lo * x_img..hi * x_img],
                &b[lo * y_img..hi * y_img],
                &mut *out,
            ),
        };
        run_exact(&sub, op, algo, micro).unwrap();
        i0 = hi;
    }
}

#[test]
fn micro_batches_reproduce_the_whole_batch() {
    let mut rng = Rng::new(11);
    let mut cases: Vec<ConvProblem> = [0usize, 1, 2, 3, 4, 6, 8, 9]
        .map(|i| shapes()[i].with_batch(4))
        .to_vec();
    // GEMM dimensions past matrixmultiply's 8x8 micro-tile and 256-long k block, so that
    // micro-batching moves elements between its edge and interior tiles.
    cases.push(ConvProblem {
        pad_h: 2,
        pad_w: 3,
        ..nchw(4, 8, 5, 4, 16, 5, 7)
    });
    // 3-D and 1-D: every depth/height/width feature of their shape lists.
    cases.extend([0usize, 1, 2, 3, 4, 7, 8].map(|i| shapes_3d()[i].with_batch(4)));
    cases.extend([1usize, 3].map(|i| shapes_1d()[i].with_batch(4)));
    for base in cases {
        for layout in [Layout::Nchw, Layout::Nhwc] {
            let problem = with(base, layout, DType::Fp32);
            for op in ConvOp::ALL {
                let [la, lb, lo] = lens(&problem, op);
                let a: Vec<f32> = rng.vec(la);
                let b: Vec<f32> = rng.vec(lb);
                let prior: Vec<f32> = rng.vec(lo);
                for algo in CpuAlgo::ALL {
                    for (alpha, beta) in [(1.0, 0.0), (0.75, 0.5)] {
                        let mut whole = prior.clone();
                        run_exact(
                            &problem,
                            op,
                            algo,
                            operands((alpha, beta), &a, &b, &mut whole),
                        )
                        .unwrap();
                        for splits in [&[2, 1, 1][..], &[1, 3][..]] {
                            let what = format!(
                                "{} {op} {algo} alpha {alpha} beta {beta} split {splits:?}",
                                problem.describe()
                            );
                            let mut parts = prior.clone();
                            let micro = operands((alpha, beta), &a, &b, &mut parts);
                            run_split(&problem, op, algo, micro, splits);
                            if op == ConvOp::BackwardFilter {
                                // Only the summation order over the batch differs: compare
                                // relative to the magnitude of the summed terms, sum |x * dy|
                                // (the result itself may be small through cancellation).
                                let abs = |v: &[f32]| {
                                    v.iter().map(|x| f64::from(x.abs())).collect::<Vec<_>>()
                                };
                                let mag = conv_f64(&problem, op, &abs(&a), &abs(&b)).unwrap();
                                for (i, ((&got, &want), &m)) in
                                    parts.iter().zip(&whole).zip(&mag).enumerate()
                                {
                                    let scale = f64::from(alpha) * m
                                        + f64::from(beta) * f64::from(prior[i].abs());
                                    let err = (f64::from(got) - f64::from(want)).abs();
                                    assert!(
                                        err <= 1e-6 * scale,
                                        "{what}: element {i}: {got} vs {want}"
                                    );
                                }
                            } else {
                                let diff = parts
                                    .iter()
                                    .zip(&whole)
                                    .position(|(x, y)| x.to_bits() != y.to_bits());
                                if let Some(i) = diff {
                                    panic!(
                                        "{what}: not bitwise equal at {i}: {} vs {}",
                                        parts[i], whole[i]
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn workspace_sizes_follow_the_algorithm() {
    for base in shapes().into_iter().chain(shapes_3d()).chain(shapes_1d()) {
        for layout in [Layout::Nchw, Layout::Nhwc] {
            for dtype in [DType::Fp32, DType::Fp16] {
                let p = with(base, layout, dtype);
                for op in ConvOp::ALL {
                    let ws = |algo, n| workspace_bytes(&p.with_batch(n), op, algo);
                    assert_eq!(ws(CpuAlgo::Direct, 3), 0);
                    // Im2colGemm: affine in n with a positive slope.
                    let (w1, w2, w5) = (
                        ws(CpuAlgo::Im2colGemm, 1),
                        ws(CpuAlgo::Im2colGemm, 2),
                        ws(CpuAlgo::Im2colGemm, 5),
                    );
                    assert!(w2 > w1, "{} {op}", p.describe());
                    assert_eq!(w5 - w1, 4 * (w2 - w1), "{} {op}", p.describe());
                    assert_eq!(w1 % 4, 0);
                    // Per image: independent of n, and equal to the whole-batch one at n = 1
                    // except for NCHW, where the whole-batch path repacks dy.
                    let per = ws(CpuAlgo::Im2colGemmPerImage, 1);
                    assert!(per > 0);
                    assert_eq!(ws(CpuAlgo::Im2colGemmPerImage, 7), per);
                    assert!(per <= w1);
                }
            }
        }
    }
    // A known value: fp32 NCHW forward of 2x3x5x7 * 4x3x3x2 -> 2x4x3x6 (pq = 18, crs = 18):
    // col n*pq*crs + out n*pq*k = 2*18*18 + 2*18*4 floats.
    let p = shapes()[0];
    assert_eq!(
        workspace_bytes(&p, ConvOp::Forward, CpuAlgo::Im2colGemm),
        4 * (2 * 18 * 18 + 2 * 18 * 4)
    );
    assert_eq!(
        workspace_bytes(&p, ConvOp::Forward, CpuAlgo::Im2colGemmPerImage),
        4 * (18 * 18 + 18 * 4)
    );
    // 3-D: fp32 NCDHW forward of 2x3x5x4x6 * 4x3x2x3x2 (pad_d = pad_w = 1) -> 2x4x6x2x7
    // (opq = 84, crs = 36): the depth is in both the rows and the columns of the im2col matrix.
    let p3 = shapes_3d()[0];
    assert_eq!(p3.output_dims(), [2, 4, 6, 2, 7]);
    assert_eq!(
        workspace_bytes(&p3, ConvOp::Forward, CpuAlgo::Im2colGemm),
        4 * (2 * 84 * 36 + 2 * 84 * 4)
    );
    assert_eq!(
        workspace_bytes(&p3, ConvOp::Forward, CpuAlgo::Im2colGemmPerImage),
        4 * (84 * 36 + 84 * 4)
    );
    assert_eq!(
        workspace_bytes(
            &ConvProblem { groups: 5, ..p },
            ConvOp::Forward,
            CpuAlgo::Im2colGemm
        ),
        0,
        "invalid problems need no workspace"
    );
}

#[test]
fn workspace_must_be_large_enough_and_aligned() {
    let p = shapes()[1];
    let op = ConvOp::BackwardFilter;
    let [la, lb, lo] = lens(&p, op);
    let mut rng = Rng::new(3);
    let (a, b): (Vec<f32>, Vec<f32>) = (rng.vec(la), rng.vec(lb));
    let mut out = vec![0.0f32; lo];
    let need = workspace_bytes(&p, op, CpuAlgo::Im2colGemm);
    let mut ws = AlignedWorkspace::new(need + 4);
    let bytes = ws.as_bytes_mut();
    let err = run(
        &p,
        op,
        CpuAlgo::Im2colGemm,
        1.0,
        &a,
        &b,
        0.0,
        &mut out,
        &mut bytes[..need as usize - 1],
    )
    .unwrap_err();
    assert_eq!(
        err,
        CpuError::WorkspaceTooSmall {
            needed: need,
            provided: need - 1
        }
    );
    let err = run(
        &p,
        op,
        CpuAlgo::Im2colGemm,
        1.0,
        &a,
        &b,
        0.0,
        &mut out,
        &mut bytes[1..need as usize + 1],
    )
    .unwrap_err();
    assert!(matches!(err, CpuError::WorkspaceMisaligned { .. }), "{err}");
    // A misaligned buffer with room to skip to an aligned start works.
    run(
        &p,
        op,
        CpuAlgo::Im2colGemm,
        1.0,
        &a,
        &b,
        0.0,
        &mut out,
        &mut bytes[1..],
    )
    .unwrap();
    let want = conv_f64(&p, op, &widen(&a), &widen(&b)).unwrap();
    assert_close(&out, &want, 1e-5, "misaligned start");
    // Direct needs nothing.
    run(&p, op, CpuAlgo::Direct, 1.0, &a, &b, 0.0, &mut out, &mut []).unwrap();
}

#[test]
fn bad_inputs_are_errors_not_panics() {
    let p = shapes()[3];
    let mut ws = AlignedWorkspace::new(1 << 16);
    for op in ConvOp::ALL {
        let [la, lb, lo] = lens(&p, op);
        let names = buffer_lens(&p, op).unwrap().map(|(name, _)| name);
        let (a, b, mut out) = (vec![0.5f32; la], vec![0.5f32; lb], vec![0f32; lo]);
        for algo in CpuAlgo::ALL {
            let mut go = |p: &ConvProblem, a: &[f32], b: &[f32], out: &mut [f32]| {
                run(p, op, algo, 1.0, a, b, 0.0, out, ws.as_bytes_mut())
            };
            assert_eq!(
                go(&p, &a[1..], &b, &mut out),
                Err(CpuError::BufferLength {
                    buffer: names[0],
                    expected: la,
                    actual: la - 1
                })
            );
            assert_eq!(
                go(&p, &a, &[b.as_slice(), &[0.0]].concat(), &mut out),
                Err(CpuError::BufferLength {
                    buffer: names[1],
                    expected: lb,
                    actual: lb + 1
                })
            );
            assert_eq!(
                go(&p, &a, &b, &mut out[..lo - 1]),
                Err(CpuError::BufferLength {
                    buffer: names[2],
                    expected: lo,
                    actual: lo - 1
                })
            );
            let bad = ConvProblem { groups: 3, ..p };
            assert!(matches!(
                go(&bad, &a, &b, &mut out),
                Err(CpuError::Shape(_))
            ));
            let bad = ConvProblem { r: 20, ..p };
            assert!(matches!(
                go(&bad, &a, &b, &mut out),
                Err(CpuError::Shape(_))
            ));
            let bad = ConvProblem { n: -2, ..p };
            assert!(matches!(
                go(&bad, &a, &b, &mut out),
                Err(CpuError::Shape(_))
            ));
            let bad = ConvProblem {
                pad_h: 1 << 40,
                stride_h: 1 << 42,
                ..p
            };
            // Past a C int: refused by the shape check itself (ConvProblem::validate).
            assert!(matches!(
                go(&bad, &a, &b, &mut out),
                Err(CpuError::Shape(
                    crate::solver::ShapeError::FieldTooLarge { .. }
                ))
            ));
            let half = ConvProblem {
                dtype: DType::Fp16,
                ..p
            };
            assert_eq!(
                go(&half, &a, &b, &mut out),
                Err(CpuError::DTypeMismatch {
                    problem: DType::Fp16,
                    buffer: DType::Fp32
                })
            );
        }
    }
    // Names in buffer_lens match the documented roles.
    assert_eq!(
        buffer_lens(&p, ConvOp::BackwardData)
            .unwrap()
            .map(|(n, _)| n),
        ["w", "dy", "dx"]
    );
    let msg = CpuError::BufferLength {
        buffer: "dy",
        expected: 4,
        actual: 3,
    }
    .to_string();
    assert!(
        msg.contains("`dy`") && msg.contains('4') && msg.contains('3'),
        "{msg}"
    );
}

#[test]
fn algo_ids_are_stable() {
    for (i, algo) in CpuAlgo::ALL.into_iter().enumerate() {
        assert_eq!(algo.id(), i as u32);
        assert_eq!(CpuAlgo::from_id(algo.id()), Some(algo));
    }
    assert_eq!(CpuAlgo::from_id(3), None);
    // The names reports print, for every op; the solver's table has exactly these ids.
    let names: Vec<&str> = CpuAlgo::ALL.iter().map(|a| a.name()).collect();
    assert_eq!(names, ["direct", "im2col-batched", "im2col-per-image"]);
    assert_eq!(CpuAlgo::Direct.to_string(), "direct");
    for op in ConvOp::ALL {
        for id in 0..4 {
            let algo = crate::solver::Algo::Legacy(id);
            assert_eq!(
                algo.belongs_to(crate::solver::BackendKind::Cpu, op),
                CpuAlgo::from_id(id).is_some()
            );
        }
    }
}

#[test]
fn valid_range_matches_brute_force() {
    for o_len in 0..6usize {
        for stride in 1..4usize {
            for off in -5isize..5 {
                for (lo, hi) in [(0isize, 4isize), (2, 7), (-3, 1), (3, 3)] {
                    let want: Vec<usize> = (0..o_len)
                        .filter(|&o| (lo..hi).contains(&(o as isize * stride as isize + off)))
                        .collect();
                    let got: Vec<usize> = valid_range(o_len, lo, hi, stride, off).collect();
                    assert_eq!(
                        got, want,
                        "o_len {o_len} stride {stride} off {off} {lo}..{hi}"
                    );
                }
            }
        }
    }
}

#[test]
fn reference_is_a_convolution() {
    // 1 image, 1 channel, 3x3 input, 2x2 filter of ones: each output is a 2x2 window sum.
    let p = nchw(1, 1, 3, 3, 1, 2, 2);
    let x: Vec<f64> = (1..=9).map(f64::from).collect();
    let y = conv_f64(&p, ConvOp::Forward, &x, &[1.0; 4]).unwrap();
    assert_eq!(y, [12.0, 16.0, 24.0, 28.0]);
    // Backward data spreads each dy over its window; with dy = 1 this counts the windows.
    let dx = conv_f64(&p, ConvOp::BackwardData, &[1.0; 4], &[1.0; 4]).unwrap();
    assert_eq!(dx, [1.0, 2.0, 1.0, 2.0, 4.0, 2.0, 1.0, 2.0, 1.0]);
    // Backward filter with dy = 1 sums each tap's window of x.
    let dw = conv_f64(&p, ConvOp::BackwardFilter, &x, &[1.0; 4]).unwrap();
    assert_eq!(dw, [12.0, 16.0, 24.0, 28.0]);
}

#[test]
fn reference_is_a_3d_convolution() {
    // 1 image, 1 channel, 3x2x2 input, 2x2x2 filter of ones, depth padding 1: each output is
    // the sum of a 2x2x2 window, of which the padding contributes nothing.
    let p = ConvProblem {
        pad_d: 1,
        ..ConvProblem::new_3d(1, 1, 3, 2, 2, 1, 2, 2, 2)
    };
    assert_eq!(p.output_dims(), [1, 1, 4, 1, 1]);
    let x: Vec<f64> = (1..=12).map(f64::from).collect();
    let y = conv_f64(&p, ConvOp::Forward, &x, &[1.0; 8]).unwrap();
    // Depth slices sum to 10, 26 and 42.
    assert_eq!(y, [10.0, 36.0, 68.0, 42.0]);
    // Every input lies in two windows (the depth padding makes each slice read twice).
    let dx = conv_f64(&p, ConvOp::BackwardData, &[1.0; 8], &[1.0; 4]).unwrap();
    assert_eq!(dx, [2.0; 12]);
    // Tap (t, r, s) sums x at height r and width s over the depths it reads: all three
    // slices for both t (t = 0 reads -1..=2, t = 1 reads 0..=3).
    let dw = conv_f64(&p, ConvOp::BackwardFilter, &x, &[1.0; 4]).unwrap();
    assert_eq!(dw, [15.0, 18.0, 21.0, 24.0, 15.0, 18.0, 21.0, 24.0]);
}

#[test]
fn fp16_widening_is_exact_for_every_bit_pattern() {
    for bits in 0..=u16::MAX {
        let want = f16::from_bits(bits).to_f32(); // half's own conversion
        let got = <f16 as Element>::to_f32(f16::from_bits(bits));
        if want.is_nan() {
            assert!(got.is_nan(), "{bits:#06x}");
        } else {
            assert_eq!(got.to_bits(), want.to_bits(), "{bits:#06x}");
        }
    }
}
