//! The checks of `mucudnn::candle::Conv1d` and `ConvTranspose2d` on one candle device, shared
//! by `tests/candle_cpu.rs` (candle's CPU, in CI) and `tests/candle_cuda.rs` (a GPU): outputs
//! and gradients (candle's backprop) against candle_nn's own layers and mucudnn's f64
//! reference of the convolution problem each runs, candle_nn's variables from a
//! `VarBuilder`, plans shared through the transposed mapping, and errors that name the layer.

#![allow(dead_code)]

use crate::checks::{flat, shared_cache, tensor, values};
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{Conv1dConfig, Conv2dConfig, ConvTranspose2dConfig, Optimizer, VarBuilder, VarMap};
use mucudnn::backend::cpu::reference::conv_f64;
use mucudnn::candle::{Conv1d, Conv2d, ConvOptions, ConvTranspose2d, SharedCache};
use mucudnn::solver::{ConvOp, ConvProblem};

type Result<T> = candle_core::Result<T>;

/// Max |a - b| within `tol` times the largest magnitude of `expected`.
pub fn assert_within(what: &str, actual: &[f32], expected: &[f32], tol: f32) {
    assert_eq!(actual.len(), expected.len(), "{what}: lengths");
    let scale = expected
        .iter()
        .fold(f32::MIN_POSITIVE, |m, v| m.max(v.abs()));
    let worst = actual
        .iter()
        .zip(expected)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(
        worst <= tol * scale,
        "{what}: max difference {worst} exceeds {tol} x {scale}"
    );
}

fn assert_within_f64(what: &str, actual: &[f32], expected: &[f64], tol: f32) {
    let expected: Vec<f32> = expected.iter().map(|&v| v as f32).collect();
    assert_within(what, actual, &expected, tol);
}

/// y and the gradients of `sum(y * r)` (a weighted sum, so every output element gets its own
/// gradient) wrt x, the weight and the bias.
pub struct Outputs {
    pub y: Tensor,
    pub dx: Tensor,
    pub dw: Tensor,
    pub db: Option<Tensor>,
}

impl Outputs {
    fn named(&self) -> Vec<(&'static str, &Tensor)> {
        let mut all = vec![("y", &self.y), ("dx", &self.dx), ("dw", &self.dw)];
        if let Some(db) = &self.db {
            all.push(("db", db));
        }
        all
    }

    /// Each output within `tol` of `theirs`'s (same shapes).
    pub fn assert_within(&self, theirs: &Outputs, what: &str, tol: f32) {
        for ((name, a), (_, b)) in self.named().into_iter().zip(theirs.named()) {
            assert_eq!(a.dims(), b.dims(), "{what} {name} shape");
            assert_within(&format!("{what} {name}"), &flat(a), &flat(b), tol);
        }
    }
}

/// Runs `layer(x, weight, bias)` on inputs of `x_dims`, a weight of `w_dims` and (if
/// `bias_len`) a bias, all deterministic, and back-propagates.
pub fn run_layer(
    dev: &Device,
    x_dims: &[usize],
    w_dims: &[usize],
    bias_len: Option<usize>,
    layer: impl Fn(&Tensor, &Tensor, Option<&Tensor>) -> Result<Tensor>,
) -> Outputs {
    let x = Var::from_tensor(&tensor(x_dims, 1, dev).unwrap()).unwrap();
    let w = Var::from_tensor(&tensor(w_dims, 2, dev).unwrap()).unwrap();
    let b = bias_len.map(|len| Var::from_tensor(&tensor(&[len], 3, dev).unwrap()).unwrap());
    let y = layer(
        x.as_tensor(),
        w.as_tensor(),
        b.as_ref().map(|b| b.as_tensor()),
    )
    .unwrap();
    let r = tensor(y.dims(), 4, dev).unwrap();
    let grads = (&y * &r).unwrap().sum_all().unwrap().backward().unwrap();
    let grad = |v: &Var| grads.get(v.as_tensor()).expect("a gradient").clone();
    Outputs {
        dx: grad(&x),
        dw: grad(&w),
        db: b.as_ref().map(grad),
        y,
    }
}

fn f64s(len: usize, seed: u64) -> Vec<f64> {
    values(len, seed).into_iter().map(f64::from).collect()
}

/// Adds the bias (seed 3) to `y` of `n x k x plane` and returns the bias's gradient for the
/// weights `r`.
fn add_bias_reference(y: &mut [f64], r: &[f64], n: usize, k: usize) -> Vec<f64> {
    let b = f64s(k, 3);
    let plane = y.len() / (n * k);
    let channel = |i: usize| (i / plane) % k;
    for (i, v) in y.iter_mut().enumerate() {
        *v += b[channel(i)];
    }
    (0..k)
        .map(|c| {
            r.iter()
                .enumerate()
                .filter(|(i, _)| channel(*i) == c)
                .map(|(_, v)| v)
                .sum()
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Conv1d

/// A 1-D convolution: input `n x c x l`, `k` filters of width `kernel`.
#[derive(Clone, Copy, Debug)]
pub struct Case1d {
    pub name: &'static str,
    pub n: usize,
    pub c: usize,
    pub l: usize,
    pub k: usize,
    pub kernel: usize,
    pub padding: usize,
    pub stride: usize,
    pub dilation: usize,
    pub groups: usize,
    pub bias: bool,
}

impl Case1d {
    pub fn config(&self) -> Conv1dConfig {
        Conv1dConfig {
            padding: self.padding,
            stride: self.stride,
            dilation: self.dilation,
            groups: self.groups,
            cudnn_fwd_algo: None,
        }
    }

    /// The 2-D problem with unit height, built here from the case (not by the layer).
    pub fn problem(&self) -> ConvProblem {
        let mut p = ConvProblem::new_1d(
            self.n as i64,
            self.c as i64,
            self.l as i64,
            self.k as i64,
            self.kernel as i64,
        );
        p.pad_w = self.padding as i64;
        p.stride_w = self.stride as i64;
        p.dilation_w = self.dilation as i64;
        p.groups = self.groups as i64;
        p
    }

    fn x_dims(&self) -> [usize; 3] {
        [self.n, self.c, self.l]
    }

    fn w_dims(&self) -> [usize; 3] {
        [self.k, self.c / self.groups, self.kernel]
    }

    /// mucudnn's layer with `options` (`None`: candle_nn's), run as [`run_layer`] does.
    pub fn run(&self, dev: &Device, options: Option<ConvOptions>) -> Outputs {
        match options {
            Some(options) => self.run_ours(dev, options).0,
            None => run_layer(
                dev,
                &self.x_dims(),
                &self.w_dims(),
                self.bias_len(),
                |x, w, b| {
                    PerSample(candle_nn::Conv1d::new(w.clone(), b.cloned(), self.config()))
                        .forward(x)
                },
            ),
        }
    }

    fn bias_len(&self) -> Option<usize> {
        self.bias.then_some(self.k)
    }

    /// mucudnn's layer run as [`run_layer`] does, and the layer.
    pub fn run_ours(&self, dev: &Device, options: ConvOptions) -> (Outputs, Conv1d) {
        let made = std::cell::RefCell::new(None);
        let outputs = run_layer(
            dev,
            &self.x_dims(),
            &self.w_dims(),
            self.bias_len(),
            |x, w, b| {
                let layer = Conv1d::new(w.clone(), b.cloned(), self.config(), options.clone())?;
                assert_eq!(layer.problem(self.n, self.l).unwrap(), self.problem());
                let y = layer.forward(x);
                *made.borrow_mut() = Some(layer);
                y
            },
        );
        (outputs, made.into_inner().expect("the layer"))
    }

    /// Ours against the f64 reference of the problem.
    fn check_reference(&self, ours: &Outputs) {
        let problem = self.problem();
        let x = f64s(self.x_dims().iter().product(), 1);
        let w = f64s(self.w_dims().iter().product(), 2);
        let r = f64s(ours.y.elem_count(), 4);
        let mut y = conv_f64(&problem, ConvOp::Forward, &x, &w).unwrap();
        let db = self
            .bias
            .then(|| add_bias_reference(&mut y, &r, self.n, self.k));
        let dx = conv_f64(&problem, ConvOp::BackwardData, &w, &r).unwrap();
        let dw = conv_f64(&problem, ConvOp::BackwardFilter, &x, &r).unwrap();
        let tag = |what: &str| format!("conv1d {} {what} vs f64 reference", self.name);
        assert_eq!(ours.dx.dims(), self.x_dims(), "{}", tag("dx shape"));
        assert_within_f64(&tag("y"), &flat(&ours.y), &y, 1e-5);
        assert_within_f64(&tag("dx"), &flat(&ours.dx), &dx, 1e-5);
        assert_within_f64(&tag("dw"), &flat(&ours.dw), &dw, 1e-5);
        if let (Some(ours), Some(db)) = (&ours.db, db) {
            assert_within_f64(&tag("db"), &flat(ours), &db, 1e-5);
        }
    }
}

/// candle_nn's `Conv1d` applied sample by sample (the outputs concatenated). candle 0.11.1's
/// CPU conv1d reads a kernel that is not contiguous as if it were (`cpu_backend` copies it
/// into `kernel_c`, then multiplies by the original), and its conv1d backward passes the
/// output gradient transposed to `c x n x l` as the kernel, so its weight gradient is wrong
/// for a batch of more than one; for one sample that transpose is contiguous. Forward, input
/// and bias gradients are the same either way.
pub struct PerSample(pub candle_nn::Conv1d);

impl Module for PerSample {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let samples = (0..x.dim(0)?)
            .map(|i| self.0.forward(&x.narrow(0, i, 1)?))
            .collect::<Result<Vec<_>>>()?;
        Tensor::cat(&samples, 0)
    }
}

pub const CASES_1D: [Case1d; 6] = [
    Case1d {
        name: "plain",
        n: 2,
        c: 3,
        l: 10,
        k: 4,
        kernel: 3,
        padding: 1,
        stride: 1,
        dilation: 1,
        groups: 1,
        bias: true,
    },
    // (11 + 2 - 4) is odd: the last input column reaches no output.
    Case1d {
        name: "stride2_odd",
        n: 2,
        c: 3,
        l: 11,
        k: 4,
        kernel: 4,
        padding: 1,
        stride: 2,
        dilation: 1,
        groups: 1,
        bias: true,
    },
    Case1d {
        name: "dilation",
        n: 2,
        c: 3,
        l: 13,
        k: 4,
        kernel: 3,
        padding: 2,
        stride: 1,
        dilation: 2,
        groups: 1,
        bias: true,
    },
    Case1d {
        name: "groups",
        n: 2,
        c: 4,
        l: 9,
        k: 6,
        kernel: 3,
        padding: 1,
        stride: 1,
        dilation: 1,
        groups: 2,
        bias: true,
    },
    Case1d {
        name: "depthwise_no_bias",
        n: 3,
        c: 4,
        l: 9,
        k: 4,
        kernel: 3,
        padding: 1,
        stride: 1,
        dilation: 1,
        groups: 4,
        bias: false,
    },
    Case1d {
        name: "strided_dilated_grouped",
        n: 2,
        c: 6,
        l: 17,
        k: 4,
        kernel: 3,
        padding: 3,
        stride: 2,
        dilation: 3,
        groups: 2,
        bias: true,
    },
];

pub fn conv1d_matches_candle_conv1d(dev: &Device) {
    let cache = shared_cache();
    for case in &CASES_1D {
        let options = ConvOptions::default()
            .with_name(format!("test.conv1d.{}", case.name))
            .with_cache(cache.clone());
        let ours = case.run(dev, Some(options));
        let theirs = case.run(dev, None);
        ours.assert_within(&theirs, &format!("conv1d {} vs candle", case.name), 1e-4);
        case.check_reference(&ours);
    }
}

/// What candle's own conv1d backward gives for a whole batch (printed, not required: a fixed
/// candle would match); mucudnn's layer matches the f64 reference there.
pub fn candle_conv1d_weight_gradient_of_a_batch(dev: &Device) {
    let case = CASES_1D[0];
    let ours = case.run(dev, Some(ConvOptions::default().with_cache(shared_cache())));
    case.check_reference(&ours);
    let whole = run_layer(dev, &case.x_dims(), &case.w_dims(), None, |x, w, _| {
        candle_nn::Conv1d::new(w.clone(), None, case.config()).forward(x)
    });
    let (a, b) = (flat(&whole.dw), flat(&ours.dw));
    let worst = a
        .iter()
        .zip(&b)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    eprintln!("candle's batch conv1d weight gradient differs from the reference by {worst}");
}

// ---------------------------------------------------------------------------------------------
// ConvTranspose2d

/// A 2-D transposed convolution: input `n x c_in x h x w`, weight `c_in x c_out x k x k`.
#[derive(Clone, Copy, Debug)]
pub struct CaseT {
    pub name: &'static str,
    pub n: usize,
    pub c_in: usize,
    pub h: usize,
    pub w: usize,
    pub c_out: usize,
    pub kernel: usize,
    pub padding: usize,
    pub output_padding: usize,
    pub stride: usize,
    pub dilation: usize,
    pub bias: bool,
}

impl CaseT {
    pub fn config(&self) -> ConvTranspose2dConfig {
        ConvTranspose2dConfig {
            padding: self.padding,
            output_padding: self.output_padding,
            stride: self.stride,
            dilation: self.dilation,
        }
    }

    /// The output size along an input size, as PyTorch documents it.
    fn out(&self, input: usize) -> usize {
        (input - 1) * self.stride + self.dilation * (self.kernel - 1) + self.output_padding + 1
            - 2 * self.padding
    }

    /// The convolution it transposes, built here from the case: its input is the output.
    pub fn problem(&self) -> ConvProblem {
        let k = self.kernel as i64;
        let mut p = ConvProblem::new(
            self.n as i64,
            self.c_out as i64,
            self.out(self.h) as i64,
            self.out(self.w) as i64,
            self.c_in as i64,
            k,
            k,
        );
        (p.pad_h, p.pad_w) = (self.padding as i64, self.padding as i64);
        (p.stride_h, p.stride_w) = (self.stride as i64, self.stride as i64);
        (p.dilation_h, p.dilation_w) = (self.dilation as i64, self.dilation as i64);
        p
    }

    fn x_dims(&self) -> [usize; 4] {
        [self.n, self.c_in, self.h, self.w]
    }

    fn w_dims(&self) -> [usize; 4] {
        [self.c_in, self.c_out, self.kernel, self.kernel]
    }

    pub fn layer(&self, w: &Tensor, b: Option<&Tensor>, options: ConvOptions) -> ConvTranspose2d {
        ConvTranspose2d::new(w.clone(), b.cloned(), self.config(), options).unwrap()
    }

    /// mucudnn's layer with `options` (`None`: candle_nn's), run as [`run_layer`] does.
    pub fn run(&self, dev: &Device, options: Option<ConvOptions>) -> Outputs {
        match options {
            Some(options) => self.run_ours(dev, options).0,
            None => run_layer(
                dev,
                &self.x_dims(),
                &self.w_dims(),
                self.bias_len(),
                |x, w, b| {
                    candle_nn::ConvTranspose2d::new(w.clone(), b.cloned(), self.config()).forward(x)
                },
            ),
        }
    }

    fn bias_len(&self) -> Option<usize> {
        self.bias.then_some(self.c_out)
    }

    /// mucudnn's layer run as [`run_layer`] does, and the layer.
    pub fn run_ours(&self, dev: &Device, options: ConvOptions) -> (Outputs, ConvTranspose2d) {
        let made = std::cell::RefCell::new(None);
        let outputs = run_layer(
            dev,
            &self.x_dims(),
            &self.w_dims(),
            self.bias_len(),
            |x, w, b| {
                let layer = self.layer(w, b, options.clone());
                assert_eq!(
                    layer.problem(self.n, self.h, self.w).unwrap(),
                    self.problem()
                );
                let y = layer.forward(x);
                *made.borrow_mut() = Some(layer);
                y
            },
        );
        (outputs, made.into_inner().expect("the layer"))
    }

    /// Ours against the f64 reference through the mapping: y = the convolution's
    /// backward-data of x, dx = its forward of r, dw = its backward-filter of (r, x).
    fn check_reference(&self, ours: &Outputs) {
        let problem = self.problem();
        let x = f64s(self.x_dims().iter().product(), 1);
        let w = f64s(self.w_dims().iter().product(), 2);
        let r = f64s(ours.y.elem_count(), 4);
        let mut y = conv_f64(&problem, ConvOp::BackwardData, &w, &x).unwrap();
        let db = self
            .bias
            .then(|| add_bias_reference(&mut y, &r, self.n, self.c_out));
        let dx = conv_f64(&problem, ConvOp::Forward, &r, &w).unwrap();
        let dw = conv_f64(&problem, ConvOp::BackwardFilter, &r, &x).unwrap();
        let tag = |what: &str| format!("conv_transpose2d {} {what} vs f64 reference", self.name);
        assert_eq!(
            ours.y.dims(),
            [self.n, self.c_out, self.out(self.h), self.out(self.w)],
            "{}",
            tag("y shape")
        );
        assert_within_f64(&tag("y"), &flat(&ours.y), &y, 1e-5);
        assert_within_f64(&tag("dx"), &flat(&ours.dx), &dx, 1e-5);
        assert_within_f64(&tag("dw"), &flat(&ours.dw), &dw, 1e-5);
        if let (Some(ours), Some(db)) = (&ours.db, db) {
            assert_within_f64(&tag("db"), &flat(ours), &db, 1e-5);
        }
    }
}

/// candle's ConvTranspose2dConfig has no groups (candle-nn 0.11.1: "TODO: support groups").
pub const CASES_T: [CaseT; 5] = [
    CaseT {
        name: "plain",
        n: 2,
        c_in: 3,
        h: 5,
        w: 5,
        c_out: 4,
        kernel: 3,
        padding: 0,
        output_padding: 0,
        stride: 1,
        dilation: 1,
        bias: true,
    },
    // The usual 2x upsampler (k 4, stride 2, padding 1), non-square.
    CaseT {
        name: "upsample",
        n: 2,
        c_in: 4,
        h: 4,
        w: 5,
        c_out: 3,
        kernel: 4,
        padding: 1,
        output_padding: 0,
        stride: 2,
        dilation: 1,
        bias: true,
    },
    // Odd sizes, stride 2, output_padding 1: the output's last row and column get no input
    // at stride offsets of their own.
    CaseT {
        name: "stride2_output_padding",
        n: 2,
        c_in: 3,
        h: 5,
        w: 4,
        c_out: 2,
        kernel: 3,
        padding: 1,
        output_padding: 1,
        stride: 2,
        dilation: 1,
        bias: true,
    },
    CaseT {
        name: "dilation",
        n: 2,
        c_in: 3,
        h: 4,
        w: 5,
        c_out: 4,
        kernel: 3,
        padding: 2,
        output_padding: 1,
        stride: 2,
        dilation: 2,
        bias: true,
    },
    CaseT {
        name: "stride3_no_bias",
        n: 1,
        c_in: 2,
        h: 3,
        w: 4,
        c_out: 3,
        kernel: 2,
        padding: 0,
        output_padding: 2,
        stride: 3,
        dilation: 1,
        bias: false,
    },
];

pub fn conv_transpose2d_matches_candle_conv_transpose2d(dev: &Device) {
    let cache = shared_cache();
    for case in &CASES_T {
        let options = ConvOptions::default()
            .with_name(format!("test.conv_transpose2d.{}", case.name))
            .with_cache(cache.clone());
        let ours = case.run(dev, Some(options));
        let theirs = case.run(dev, None);
        ours.assert_within(
            &theirs,
            &format!("conv_transpose2d {} vs candle", case.name),
            1e-4,
        );
        case.check_reference(&ours);
    }
}

/// A transposed layer and the convolution it transposes share one problem, so the second of
/// them measures nothing: its plans come from the cache.
pub fn conv_transpose2d_shares_plans_with_its_convolution(dev: &Device) {
    let cache = shared_cache();
    let case = CASES_T[2];
    let options = |name: &str| {
        ConvOptions::default()
            .with_name(name)
            .with_cache(cache.clone())
    };
    let weight = tensor(&[case.c_in, case.c_out, case.kernel, case.kernel], 2, dev).unwrap();
    let transposed = case.layer(&weight, None, options("decoder.up"));
    let x = tensor(&[case.n, case.c_in, case.h, case.w], 1, dev).unwrap();
    let y = transposed.forward(&x).unwrap();
    let tunings = transposed.tunings().unwrap();
    let (out_h, out_w) = (case.out(case.h), case.out(case.w));
    assert_eq!(
        tunings.iter().map(|(key, _)| *key).collect::<Vec<_>>(),
        [(case.n as i64, out_h as i64, out_w as i64)]
    );
    assert!(tunings[0].1.measured > 0, "{tunings:?}");

    // The convolution: same weight (c_in filters over c_out channels), input of y's shape.
    let conv = Conv2d::new(
        weight.clone(),
        None,
        Conv2dConfig {
            padding: case.padding,
            stride: case.stride,
            dilation: case.dilation,
            groups: 1,
            cudnn_fwd_algo: None,
        },
        options("encoder.down"),
    )
    .unwrap();
    assert_eq!(
        conv.problem(case.n, out_h, out_w).unwrap(),
        transposed.problem(case.n, case.h, case.w).unwrap()
    );
    let back = conv.forward(&y).unwrap();
    assert_eq!(back.dims(), x.dims());
    let tunings = conv.tunings().unwrap();
    assert_eq!(tunings.len(), 1);
    assert_eq!(tunings[0].1.measured, 0, "{tunings:?}");
    if dev.is_cpu() {
        let ours = transposed
            .cpu_plans(case.n as i64, case.h as i64, case.w as i64)
            .unwrap()
            .expect("tuned");
        let theirs = conv
            .cpu_plans(case.n as i64, out_h as i64, out_w as i64)
            .unwrap()
            .expect("tuned");
        for (a, b) in ours.iter().zip(&theirs) {
            assert_eq!((&a.micro_batches, a.op), (&b.micro_batches, b.op));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// VarBuilder drop-ins and errors

fn sorted_vars(vm: &VarMap) -> Vec<(String, Var)> {
    let mut vars: Vec<(String, Var)> = vm
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    vars
}

/// A tiny model over (n, 4, 12) sequences: conv1d 4->6 (k 3, stride 2, pad 1), ReLU,
/// conv1d 6->6 (k 3, groups 3, dilation 2, pad 2, no bias), viewed as (n, 6, 2, 3) images,
/// conv_transpose2d 6->2 (k 3, stride 2, pad 1, output_padding 1), ReLU,
/// conv_transpose2d 2->1 (k 2, no bias); the loss is the mean square against a target.
pub struct Tiny {
    layers: Vec<Box<dyn Module>>,
}

impl Tiny {
    pub fn new(vb: VarBuilder, ours: Option<&SharedCache>) -> Result<Self> {
        let c1 = |padding, stride, dilation, groups| Conv1dConfig {
            padding,
            stride,
            dilation,
            groups,
            cudnn_fwd_algo: None,
        };
        let ct = |padding, output_padding, stride| ConvTranspose2dConfig {
            padding,
            output_padding,
            stride,
            dilation: 1,
        };
        let layers: Vec<Box<dyn Module>> = match ours {
            Some(cache) => {
                let options = || ConvOptions::default().with_cache(cache.clone());
                vec![
                    Box::new(mucudnn::candle::conv1d(
                        4,
                        6,
                        3,
                        c1(1, 2, 1, 1),
                        options(),
                        vb.pp("enc1"),
                    )?),
                    Box::new(mucudnn::candle::conv1d_no_bias(
                        6,
                        6,
                        3,
                        c1(2, 1, 2, 3),
                        options(),
                        vb.pp("enc2"),
                    )?),
                    Box::new(mucudnn::candle::conv_transpose2d(
                        6,
                        2,
                        3,
                        ct(1, 1, 2),
                        options(),
                        vb.pp("dec1"),
                    )?),
                    Box::new(mucudnn::candle::conv_transpose2d_no_bias(
                        2,
                        1,
                        2,
                        ct(0, 0, 1),
                        options(),
                        vb.pp("dec2"),
                    )?),
                ]
            }
            // Sample by sample: see `PerSample`.
            None => vec![
                Box::new(PerSample(candle_nn::conv1d(
                    4,
                    6,
                    3,
                    c1(1, 2, 1, 1),
                    vb.pp("enc1"),
                )?)),
                Box::new(PerSample(candle_nn::conv1d_no_bias(
                    6,
                    6,
                    3,
                    c1(2, 1, 2, 3),
                    vb.pp("enc2"),
                )?)),
                Box::new(candle_nn::conv_transpose2d(
                    6,
                    2,
                    3,
                    ct(1, 1, 2),
                    vb.pp("dec1"),
                )?),
                Box::new(candle_nn::conv_transpose2d_no_bias(
                    2,
                    1,
                    2,
                    ct(0, 0, 1),
                    vb.pp("dec2"),
                )?),
            ],
        };
        Ok(Tiny { layers })
    }

    pub fn loss(&self, x: &Tensor, target: &Tensor) -> Result<Tensor> {
        let h = self.layers[0].forward(x)?.relu()?;
        let h = self.layers[1].forward(&h)?;
        let n = h.dim(0)?;
        let h = h.reshape((n, 6, 2, 3))?;
        let h = self.layers[2].forward(&h)?.relu()?;
        let y = self.layers[3].forward(&h)?;
        (y - target)?.sqr()?.mean_all()
    }
}

/// `conv1d`, `conv1d_no_bias`, `conv_transpose2d` and `conv_transpose2d_no_bias` load the
/// variables candle_nn's functions load (names, shapes); from the same values the model's
/// loss and its parameters after one SGD step match.
pub fn var_builder_drop_ins_match_candle_nn(dev: &Device) {
    let cache = shared_cache();
    let theirs_vm = VarMap::new();
    let theirs = Tiny::new(VarBuilder::from_varmap(&theirs_vm, DType::F32, dev), None).unwrap();
    let ours_vm = VarMap::new();
    let ours = Tiny::new(
        VarBuilder::from_varmap(&ours_vm, DType::F32, dev),
        Some(&cache),
    )
    .unwrap();
    let (theirs_vars, ours_vars) = (sorted_vars(&theirs_vm), sorted_vars(&ours_vm));
    let shapes = |vars: &[(String, Var)]| {
        vars.iter()
            .map(|(k, v)| (k.clone(), v.dims().to_vec()))
            .collect::<Vec<_>>()
    };
    assert_eq!(shapes(&ours_vars), shapes(&theirs_vars));
    assert_eq!(ours_vars.len(), 6, "{:?}", shapes(&ours_vars));
    for ((_, t), (_, o)) in theirs_vars.iter().zip(&ours_vars) {
        o.set(t.as_tensor()).unwrap();
    }
    // (2, 6, 2, 3) -> (2, 2, 4, 6) -> (2, 1, 5, 7).
    let x = tensor(&[2, 4, 12], 11, dev).unwrap();
    let target = tensor(&[2, 1, 5, 7], 12, dev).unwrap();
    let mut theirs_sgd = candle_nn::SGD::new(theirs_vm.all_vars(), 0.1).unwrap();
    let mut ours_sgd = candle_nn::SGD::new(ours_vm.all_vars(), 0.1).unwrap();
    let theirs_loss = theirs.loss(&x, &target).unwrap();
    let ours_loss = ours.loss(&x, &target).unwrap();
    assert_within(
        "loss",
        &[ours_loss.to_scalar::<f32>().unwrap()],
        &[theirs_loss.to_scalar::<f32>().unwrap()],
        1e-5,
    );
    theirs_sgd.backward_step(&theirs_loss).unwrap();
    ours_sgd.backward_step(&ours_loss).unwrap();
    for ((name, t), (_, o)) in theirs_vars.iter().zip(&ours_vars) {
        assert_within(
            &format!("{name} after one SGD step"),
            &flat(o.as_tensor()),
            &flat(t.as_tensor()),
            1e-5,
        );
    }
}

pub fn errors_are_values_that_name_the_layer(dev: &Device) {
    let cache = shared_cache();
    let options = |name: &str| {
        ConvOptions::default()
            .with_name(name)
            .with_cache(cache.clone())
    };
    let message = |r: Result<Tensor>| r.expect_err("an error").to_string();
    let expect = |text: String, parts: &[&str]| {
        assert!(parts.iter().all(|p| text.contains(p)), "{text}");
    };

    let conv1d = Conv1d::new(
        tensor(&[4, 3, 3], 2, dev).unwrap(),
        None,
        Conv1dConfig::default(),
        options("net.c1"),
    )
    .unwrap();
    let input = |dims: &[usize]| tensor(dims, 1, dev).unwrap();
    expect(
        message(conv1d.forward(&input(&[1, 3, 1, 8]))),
        &["conv1d net.c1", "3-D"],
    );
    expect(
        message(conv1d.forward(&input(&[1, 2, 8]))),
        &["net.c1", "2 channels"],
    );
    expect(message(conv1d.forward(&input(&[1, 3, 2]))), &["net.c1"]);
    expect(
        message(conv1d.forward(&input(&[1, 3, 8]).to_dtype(DType::F64).unwrap())),
        &["net.c1", "f32"],
    );
    let flat_weight = Conv1d::new(
        tensor(&[4, 3, 3, 1], 2, dev).unwrap(),
        None,
        Conv1dConfig::default(),
        options("net.c1w"),
    );
    expect(
        message(flat_weight.map(|l| l.weight().clone())),
        &["net.c1w", "3-D"],
    );
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F32, dev);
    let bad_groups = mucudnn::candle::conv1d(
        3,
        4,
        3,
        Conv1dConfig {
            groups: 2,
            ..Default::default()
        },
        ConvOptions::default().with_cache(cache.clone()),
        vb.pp("net").pp("grouped"),
    );
    expect(
        message(bad_groups.map(|l| l.weight().clone())),
        &["conv1d net.grouped", "groups"],
    );

    let weight = tensor(&[3, 2, 3, 3], 2, dev).unwrap();
    let transposed = |cfg: ConvTranspose2dConfig, name: &str| {
        ConvTranspose2d::new(weight.clone(), None, cfg, options(name))
    };
    let output_padding_too_large = transposed(
        ConvTranspose2dConfig {
            output_padding: 2,
            stride: 2,
            ..Default::default()
        },
        "net.t1",
    );
    expect(
        message(output_padding_too_large.map(|l| l.weight().clone())),
        &["conv_transpose2d net.t1", "output_padding", "stride"],
    );
    let layer = transposed(
        ConvTranspose2dConfig {
            padding: 2,
            ..Default::default()
        },
        "net.t2",
    )
    .unwrap();
    expect(
        message(layer.forward(&input(&[3, 4, 4]))),
        &["conv_transpose2d net.t2", "4-D"],
    );
    expect(
        message(layer.forward(&input(&[1, 2, 4, 4]))),
        &["net.t2", "2 channels"],
    );
    // 1x1 in, k 3, padding 2: (0 + 2 + 1) - 4 < 1, no output.
    expect(
        message(layer.forward(&input(&[1, 3, 1, 1]))),
        &["net.t2", "no output"],
    );
    expect(
        message(layer.forward(&input(&[1, 3, 4, 4]).to_dtype(DType::F64).unwrap())),
        &["net.t2", "f32"],
    );
    let bad_bias = ConvTranspose2d::new(
        weight.clone(),
        Some(tensor(&[3], 3, dev).unwrap()),
        ConvTranspose2dConfig::default(),
        options("net.t3"),
    );
    expect(
        message(bad_bias.map(|l| l.weight().clone())),
        &["net.t3", "bias", "[2]"],
    );
}
