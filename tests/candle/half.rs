//! The layers in f16 and bf16 on one candle device, shared by `tests/candle_cpu.rs` (candle's
//! CPU, in CI) and `tests/candle_cuda.rs` (a GPU): forward and gradients against candle's own
//! convolution in f32 on the same values (the half operands upcast exactly), within a
//! tolerance of half precision relative to the largest magnitude; `Conv1d` and
//! `ConvTranspose2d` in bf16 against the f32 mucudnn layers (which the f32 checks compare with
//! candle_nn's and the f64 reference); problems, plans and cache records per dtype; errors for
//! mixed dtypes.

#![allow(dead_code)]

use super::checks::{assert_close, shared_cache, tensor};
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{Conv1dConfig, Conv2dConfig, ConvTranspose2dConfig};
use mucudnn::candle::{Conv1d, Conv2d, ConvOptions, ConvTranspose2d, SharedCache};
use mucudnn::solver;

/// The half types under test with their tolerance (relative to the largest magnitude of the
/// f32 result): 8 and 11 significant bits, operands rounded, results rounded once.
pub const HALF_TYPES: [(DType, f32); 2] = [(DType::BF16, 1e-2), (DType::F16, 2e-3)];

pub fn flat_f32(t: &Tensor) -> Vec<f32> {
    t.flatten_all()
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}

/// A tensor of `dims` with the checks' seeded values rounded to `dtype`: `(half, f32)`, the
/// second the first upcast (exactly).
fn pair(dims: &[usize], seed: u64, dtype: DType, dev: &Device) -> (Tensor, Tensor) {
    let half = tensor(dims, seed, dev).unwrap().to_dtype(dtype).unwrap();
    let upcast = half.to_dtype(DType::F32).unwrap();
    (half, upcast)
}

/// `y` and the gradients of `x`, `weight` and `bias` of `sum(forward(x) * r)` (the sum in f32,
/// `r` rounded to the inputs' dtype, so the output gradient is exact in it).
struct Run {
    y: Tensor,
    dx: Tensor,
    dw: Tensor,
    db: Tensor,
}

fn run(
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    forward: impl Fn(&Tensor, &Tensor, &Tensor) -> candle_core::Result<Tensor>,
) -> Run {
    let (x, w, b) = (
        Var::from_tensor(x).unwrap(),
        Var::from_tensor(w).unwrap(),
        Var::from_tensor(b).unwrap(),
    );
    let y = forward(x.as_tensor(), w.as_tensor(), b.as_tensor()).unwrap();
    let r = tensor(y.dims(), 9, y.device())
        .unwrap()
        .to_dtype(y.dtype())
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    let loss = (y.to_dtype(DType::F32).unwrap() * r)
        .unwrap()
        .sum_all()
        .unwrap();
    let grads = loss.backward().unwrap();
    let grad = |v: &Var| grads.get(v.as_tensor()).expect("a gradient").clone();
    Run {
        dx: grad(&x),
        dw: grad(&w),
        db: grad(&b),
        y,
    }
}

/// The outputs and gradients of `ours` (in `dtype`) against `theirs` (f32) within `tol` of
/// the largest magnitude. The bias gradient is candle's own sum of the output gradient over
/// the batch and positions, which candle accumulates in the half type (not mucudnn's code):
/// it is held to 4 x `tol`.
fn compare(what: &str, ours: &Run, theirs: &Run, dtype: DType, tol: f32) {
    for (name, a, b, tol) in [
        ("y", &ours.y, &theirs.y, tol),
        ("dx", &ours.dx, &theirs.dx, tol),
        ("dw", &ours.dw, &theirs.dw, tol),
        ("db", &ours.db, &theirs.db, 4.0 * tol),
    ] {
        assert_eq!(a.dtype(), dtype, "{what} {name}: dtype");
        assert_eq!(a.dims(), b.dims(), "{what} {name}: shape");
        assert_close(
            &format!("{what} {name} ({dtype:?})"),
            &flat_f32(a),
            &flat_f32(b),
            tol,
        );
    }
}

/// (name, n, c, h, w, k, kernel, padding, stride, dilation, groups)
type Case2d = (
    &'static str,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
);

const CASES_2D: [Case2d; 4] = [
    ("plain", 2, 3, 8, 8, 4, 3, 1, 1, 1, 1),
    ("groups_stride2", 2, 4, 9, 9, 6, 3, 1, 2, 1, 2),
    ("dilation", 2, 3, 9, 9, 4, 3, 2, 1, 2, 1),
    ("wide", 2, 16, 6, 6, 8, 3, 1, 1, 1, 1),
];

/// Conv2d in f16 and bf16: y, dx, dw, db against candle's conv2d in f32 on the same values.
pub fn conv2d_half_matches_candle_conv2d_in_f32(dev: &Device) {
    let cache = shared_cache();
    for (dtype, tol) in HALF_TYPES {
        for (name, n, c, h, w, k, kernel, padding, stride, dilation, groups) in CASES_2D {
            let cfg = Conv2dConfig {
                padding,
                stride,
                dilation,
                groups,
                cudnn_fwd_algo: None,
            };
            let (x, x32) = pair(&[n, c, h, w], 1, dtype, dev);
            let (wt, w32) = pair(&[k, c / groups, kernel, kernel], 2, dtype, dev);
            let (b, b32) = pair(&[k], 3, dtype, dev);
            let options = ConvOptions::default()
                .with_name(format!("half.{name}"))
                .with_cache(cache.clone());
            let ours = run(&x, &wt, &b, |x, w, b| {
                let layer = Conv2d::new(w.clone(), Some(b.clone()), cfg, options.clone())?;
                let problem = layer.problem(n, h, w_of(x))?;
                assert_eq!(problem.dtype, solver_dtype(dtype), "{name}: problem dtype");
                layer.forward(x)
            });
            let theirs = run(&x32, &w32, &b32, |x, w, b| {
                x.conv2d(w, padding, stride, dilation, groups)?
                    .broadcast_add(&b.reshape((1, k, 1, 1))?)
            });
            compare(&format!("conv2d {name}"), &ours, &theirs, dtype, tol);
        }
    }
}

fn w_of(x: &Tensor) -> usize {
    x.dims()[3]
}

fn solver_dtype(dtype: DType) -> solver::DType {
    match dtype {
        DType::F32 => solver::DType::Fp32,
        DType::F16 => solver::DType::Fp16,
        DType::BF16 => solver::DType::Bf16,
        other => panic!("no problem dtype for {other:?}"),
    }
}

/// Conv1d and ConvTranspose2d in bf16 against the same layers in f32 on the same values.
pub fn conv1d_and_conv_transpose2d_in_bf16_match_f32(dev: &Device) {
    let dtype = DType::BF16;
    let tol = 1e-2;
    let cache = shared_cache();
    let options = |name: &str| {
        ConvOptions::default()
            .with_name(name)
            .with_cache(cache.clone())
    };
    // Conv1d: stride 2, dilation 2, groups 2.
    let cfg = Conv1dConfig {
        padding: 2,
        stride: 2,
        dilation: 2,
        groups: 2,
        cudnn_fwd_algo: None,
    };
    let (x, x32) = pair(&[3, 4, 21], 11, dtype, dev);
    let (w, w32) = pair(&[6, 2, 3], 12, dtype, dev);
    let (b, b32) = pair(&[6], 13, dtype, dev);
    let conv1d = |options: ConvOptions| {
        move |x: &Tensor, w: &Tensor, b: &Tensor| {
            Conv1d::new(w.clone(), Some(b.clone()), cfg, options.clone())?.forward(x)
        }
    };
    let ours = run(&x, &w, &b, conv1d(options("half.conv1d")));
    let theirs = run(&x32, &w32, &b32, conv1d(options("half.conv1d")));
    compare("conv1d", &ours, &theirs, dtype, tol);

    // ConvTranspose2d: the k 4, stride 2, padding 1 upsampler on a non-square input, and
    // stride 2 with output_padding 1.
    for (name, output_padding, kernel) in [("up", 0, 4), ("output_padding", 1, 3)] {
        let cfg = ConvTranspose2dConfig {
            padding: 1,
            output_padding,
            stride: 2,
            dilation: 1,
        };
        let (x, x32) = pair(&[2, 6, 5, 7], 21, dtype, dev);
        let (w, w32) = pair(&[6, 4, kernel, kernel], 22, dtype, dev);
        let (b, b32) = pair(&[4], 23, dtype, dev);
        let transposed = |options: ConvOptions| {
            move |x: &Tensor, w: &Tensor, b: &Tensor| {
                ConvTranspose2d::new(w.clone(), Some(b.clone()), cfg, options.clone())?.forward(x)
            }
        };
        let layer = format!("half.conv_transpose2d.{name}");
        let ours = run(&x, &w, &b, transposed(options(&layer)));
        let theirs = run(&x32, &w32, &b32, transposed(options(&layer)));
        compare(
            &format!("conv_transpose2d {name}"),
            &ours,
            &theirs,
            dtype,
            tol,
        );
    }
}

/// One layer name, one shape, three dtypes on one cache: each dtype is its own problem, tuned
/// (measured) once, and a second layer of that dtype reads the cache.
pub fn each_dtype_is_its_own_problem(dev: &Device) {
    let cache: SharedCache = shared_cache();
    let cfg = Conv2dConfig {
        padding: 1,
        ..Default::default()
    };
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let layer = || {
            let w = tensor(&[4, 3, 3, 3], 2, dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            Conv2d::new(
                w,
                None,
                cfg,
                ConvOptions::default()
                    .with_name("half.dtypes")
                    .with_cache(cache.clone()),
            )
            .unwrap()
        };
        let x = tensor(&[2, 3, 6, 6], 1, dev)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let first = layer();
        let y = first.forward(&x).unwrap();
        assert_eq!(y.dtype(), dtype);
        let tuned = first.tunings().unwrap();
        assert_eq!(tuned.len(), 1, "{dtype:?}: {tuned:?}");
        assert!(
            tuned[0].1.measured > 0,
            "{dtype:?}: a new dtype measures its own problem: {tuned:?}"
        );
        let second = layer();
        second.forward(&x).unwrap();
        let again = second.tunings().unwrap();
        assert_eq!(
            (again[0].1.measured, again[0].1.cached),
            (0, 0),
            "{dtype:?}: the second layer finds the solved plans: {again:?}"
        );
        if dev.is_cpu() {
            let plans = second.cpu_plans(2, 6, 6).unwrap().expect("tuned");
            for plan in &plans {
                assert_eq!(plan.problem.dtype, solver_dtype(dtype));
            }
        }
    }
}

/// Mixed dtypes are errors naming the layer: an input that is not the weight's dtype (all
/// three layers), a bias that is not, a weight in an unsupported dtype.
pub fn mixed_dtypes_are_errors_that_name_the_layer(dev: &Device) {
    let bf16 = |dims: &[usize]| tensor(dims, 5, dev).unwrap().to_dtype(DType::BF16).unwrap();
    let f32s = |dims: &[usize]| tensor(dims, 6, dev).unwrap();
    let named = |name: &str| {
        ConvOptions::default()
            .with_name(name)
            .with_cache(shared_cache())
    };
    let expect = |what: &str, result: candle_core::Result<Tensor>, prefix: &str, words: &[&str]| {
        let message = result.expect_err(what).to_string();
        assert!(message.starts_with(prefix), "{what}: {message}");
        for word in words {
            assert!(message.contains(word), "{what}: {message} lacks {word:?}");
        }
    };

    let conv = Conv2d::new(
        bf16(&[4, 3, 3, 3]),
        Some(bf16(&[4])),
        Conv2dConfig::default(),
        named("model.mixed"),
    )
    .unwrap();
    expect(
        "conv2d, f32 input",
        conv.forward(&f32s(&[1, 3, 5, 5])),
        "mucudnn conv2d model.mixed:",
        &["input is f32", "weight bf16"],
    );
    let f16_input = f32s(&[1, 3, 5, 5]).to_dtype(DType::F16).unwrap();
    expect(
        "conv2d, f16 input",
        conv.forward(&f16_input),
        "mucudnn conv2d model.mixed:",
        &["input is f16", "weight bf16"],
    );
    let bias = Conv2d::new(
        bf16(&[4, 3, 3, 3]),
        Some(f32s(&[4])),
        Conv2dConfig::default(),
        named("model.bias"),
    );
    let message = bias.expect_err("an f32 bias on a bf16 weight").to_string();
    assert!(
        message.starts_with("mucudnn conv2d model.bias:") && message.contains("bias is f32"),
        "{message}"
    );
    let f64_weight = f32s(&[4, 3, 3, 3]).to_dtype(DType::F64).unwrap();
    let message = Conv2d::new(
        f64_weight,
        None,
        Conv2dConfig::default(),
        named("model.f64"),
    )
    .expect_err("an f64 weight")
    .to_string();
    assert!(
        message.starts_with("mucudnn conv2d model.f64:")
            && message.contains("f64")
            && message.contains("f32, f16 and bf16"),
        "{message}"
    );

    let conv1d = Conv1d::new(
        f32s(&[4, 3, 3]),
        None,
        Conv1dConfig::default(),
        named("model.mixed1d"),
    )
    .unwrap();
    expect(
        "conv1d, bf16 input",
        conv1d.forward(&bf16(&[1, 3, 9])),
        "mucudnn conv1d model.mixed1d:",
        &["input is bf16", "weight f32"],
    );
    let transposed = ConvTranspose2d::new(
        bf16(&[3, 4, 3, 3]),
        None,
        ConvTranspose2dConfig::default(),
        named("model.mixed_t"),
    )
    .unwrap();
    expect(
        "conv_transpose2d, f32 input",
        transposed.forward(&f32s(&[1, 3, 5, 5])),
        "mucudnn conv_transpose2d model.mixed_t:",
        &["input is f32", "weight bf16"],
    );
}
