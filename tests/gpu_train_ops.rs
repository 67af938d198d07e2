//! GPU acceptance of the training building blocks, every test needs a GPU and is
//! `#[ignore]`d; the GPU acceptance (`scripts/gpu/accept.sh`) runs them with `--include-ignored`.
//!
//! Every op against its host reference on random data (fp32 and fp16, NCHW and NHWC, outputs
//! pre-filled with garbage so that `beta = 0` is checked too): ReLU, max-pool forward and
//! backward, softmax (probabilities and log), conv bias and its gradient, the linear layer
//! forward and backward, the SGD step, fp32 -> fp16 -> fp32 transforms; NCCL with world size
//! 1 (all-reduce mean and broadcast; a grouped sum on a communicator from ncclCommInitAll);
//! argument errors as values; and whole training steps of a tiny CNN whose convolution runs
//! through a micro-batched plan: the first forward pass matches the host, the loss falls.

use mucudnn::backend::cudnn::host::{quantize, random_values, reference_convolution};
use mucudnn::backend::cudnn::DeviceBuffer;
use mucudnn::exec::cudnn::PreparedPlan;
use mucudnn::solver::{ConvOp, ConvProblem, DType, Layout, MathMode, MicroBatch, Plan};
use mucudnn::train::gpu::*;

fn gpu_ops() -> GpuOps {
    GpuOps::new(0).expect("GpuOps on device 0")
}

fn upload(ops: &GpuOps, dtype: DType, values: &[f32]) -> DeviceBuffer {
    ops.cudnn().upload(dtype, values).expect("upload")
}

/// An output buffer full of garbage: ops with `beta = 0` must not read it.
fn garbage(ops: &GpuOps, dtype: DType, len: usize) -> DeviceBuffer {
    ops.cudnn().alloc_random(dtype, len, 4242).expect("alloc")
}

fn download(buffer: &DeviceBuffer) -> Vec<f32> {
    buffer.download().expect("download")
}

/// Random values rounded to `dtype`, scaled.
fn values(dtype: DType, len: usize, seed: u64, scale: f32) -> Vec<f32> {
    random_values(DType::Fp32, len, seed)
        .into_iter()
        .map(|v| quantize(dtype, v * scale))
        .collect()
}

/// Distinct values (no ties for max-pooling), exact in fp16 for up to 2048 elements.
fn distinct(len: usize, seed: u64) -> Vec<f32> {
    let mut v: Vec<f32> = (0..len)
        .map(|k| (k as f32 - len as f32 / 2.0) / 64.0)
        .collect();
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for i in (1..len).rev() {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        v.swap(i, (state % (i as u64 + 1)) as usize);
    }
    v
}

/// The largest `|got - want| / (1 + |want|)`.
fn max_error(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len(), "lengths");
    got.iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs() / (1.0 + w.abs()))
        .fold(0.0, f32::max)
}

fn check(what: &str, got: &[f32], want: &[f32], tolerance: f32) {
    let err = max_error(got, want);
    println!("{what}: max error {err:.2e} (tolerance {tolerance:.0e})");
    assert!(err <= tolerance, "{what}: error {err} > {tolerance}");
}

/// Output precision: fp32 ops are near exact; fp16 outputs are rounded to 11 bits.
fn tolerance(dtype: DType) -> f32 {
    match dtype {
        DType::Fp32 => 1e-5,
        DType::Fp16 => 2e-3,
        DType::Bf16 => 1.6e-2,
    }
}

const CASES: [(DType, Layout); 3] = [
    (DType::Fp32, Layout::Nchw),
    (DType::Fp32, Layout::Nhwc),
    (DType::Fp16, Layout::Nhwc),
];

#[test]
#[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
fn gpu_relu_matches_host() {
    let ops = gpu_ops();
    for (dtype, layout) in CASES {
        let shape = TensorShape::new([2, 3, 5, 7], dtype, layout);
        let n = shape.elements();
        let relu = Relu::new(shape).unwrap();
        let x_host = values(dtype, n, 1, 1.0);
        let dy_host = values(dtype, n, 2, 1.0);
        let x = upload(&ops, dtype, &x_host);
        let dy = upload(&ops, dtype, &dy_host);
        let mut y = garbage(&ops, dtype, n);
        let mut dx = garbage(&ops, dtype, n);
        relu.forward(&ops, &x, &mut y).unwrap();
        relu.backward(&ops, &x, &y, &dy, &mut dx).unwrap();
        let what = shape.describe();
        check(
            &format!("relu fwd {what}"),
            &download(&y),
            &relu_forward_host(&x_host),
            0.0,
        );
        check(
            &format!("relu bwd {what}"),
            &download(&dx),
            &relu_backward_host(&x_host, &dy_host),
            0.0,
        );
    }
}

#[test]
#[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
fn gpu_max_pool_matches_host() {
    let ops = gpu_ops();
    for (dtype, layout) in CASES {
        for (window, stride) in [([2, 2], [2, 2]), ([3, 3], [2, 2])] {
            let input = TensorShape::new([2, 3, 7, 6], dtype, layout);
            let pool = MaxPool2d::new(input, window, stride).unwrap();
            let output = pool.output_shape();
            assert_eq!(
                output.dims,
                pool_output_dims(input.dims, window, stride).unwrap()
            );
            let x_host = distinct(input.elements(), 3);
            let dy_host = values(dtype, output.elements(), 4, 1.0);
            let x = upload(&ops, dtype, &x_host);
            let dy = upload(&ops, dtype, &dy_host);
            let mut y = garbage(&ops, dtype, output.elements());
            let mut dx = garbage(&ops, dtype, input.elements());
            pool.forward(&ops, &x, &mut y).unwrap();
            pool.backward(&ops, &x, &y, &dy, &mut dx).unwrap();
            let what = format!("{} window {window:?} stride {stride:?}", input.describe());
            check(
                &format!("max-pool fwd {what}"),
                &download(&y),
                &max_pool_forward_host(input, window, stride, &x_host),
                0.0,
            );
            let want: Vec<f32> = max_pool_backward_host(input, window, stride, &x_host, &dy_host)
                .into_iter()
                .map(|v| quantize(dtype, v))
                .collect();
            check(
                &format!("max-pool bwd {what}"),
                &download(&dx),
                &want,
                tolerance(dtype),
            );
        }
    }
}

#[test]
#[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
fn gpu_softmax_matches_host() {
    let ops = gpu_ops();
    let (batch, classes) = (8, 10);
    for dtype in [DType::Fp32, DType::Fp16] {
        for kind in [SoftmaxKind::Probabilities, SoftmaxKind::LogProbabilities] {
            let softmax = Softmax::new(batch, classes, dtype, kind).unwrap();
            let logits_host = values(dtype, batch * classes, 5, 4.0);
            let logits = upload(&ops, dtype, &logits_host);
            let mut out = garbage(&ops, dtype, batch * classes);
            softmax.forward(&ops, &logits, &mut out).unwrap();
            let got = download(&out);
            check(
                &format!("softmax {kind:?} {dtype}"),
                &got,
                &softmax_host(kind, classes, &logits_host),
                tolerance(dtype) * 2.0,
            );
            // The host finishes the loss from what the device computed.
            let labels: Vec<usize> = (0..batch).map(|b| (b * 3) % classes).collect();
            let ce = cross_entropy_host(kind, classes, &got, &labels).unwrap();
            assert!(ce.loss.is_finite() && ce.loss > 0.0, "{ce:?}");
        }
    }
}

#[test]
#[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
fn gpu_bias_matches_host() {
    let ops = gpu_ops();
    for (dtype, layout) in CASES {
        let output = TensorShape::new([4, 6, 5, 5], dtype, layout);
        let bias = Bias::new(output).unwrap();
        let c = bias.bias_len();
        assert_eq!(c, 6);
        let y_host = values(dtype, output.elements(), 6, 1.0);
        let b_host = values(dtype, c, 7, 1.0);
        let mut y = upload(&ops, dtype, &y_host);
        let b = upload(&ops, dtype, &b_host);
        bias.forward(&ops, &b, &mut y).unwrap();
        let mut want = y_host.clone();
        bias_add_host(output, &mut want, &b_host);
        let want: Vec<f32> = want.into_iter().map(|v| quantize(dtype, v)).collect();
        let what = output.describe();
        check(
            &format!("bias add {what}"),
            &download(&y),
            &want,
            tolerance(dtype),
        );

        // The gradient sums 100 values per channel: compare relative to the channel's size.
        let dy_host = values(dtype, output.elements(), 8, 1.0);
        let dy = upload(&ops, dtype, &dy_host);
        let mut db = garbage(&ops, dtype, c);
        bias.backward(&ops, &dy, &mut db, false).unwrap();
        let sums = bias_grad_host(output, &dy_host);
        let scale = 100.0;
        let scaled = |v: Vec<f32>| v.into_iter().map(|x| x / scale).collect::<Vec<_>>();
        check(
            &format!("bias grad {what}"),
            &scaled(download(&db)),
            &scaled(sums.clone()),
            tolerance(dtype),
        );
        // Accumulating adds the sums again.
        bias.backward(&ops, &dy, &mut db, true).unwrap();
        let twice: Vec<f32> = sums.iter().map(|v| 2.0 * v).collect();
        check(
            &format!("bias grad accumulated {what}"),
            &scaled(download(&db)),
            &scaled(twice),
            tolerance(dtype) * 2.0,
        );
    }
}

#[test]
#[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
fn gpu_linear_matches_host() {
    println!("cuBLAS {:?}", cublas_version().unwrap());
    let ops = gpu_ops();
    let dims @ [batch, inputs, outputs] = [8, 50, 10];
    let linear = Linear::new(batch, inputs, outputs).unwrap();
    assert_eq!(linear.weight_len(), outputs * inputs);
    let x_host = values(DType::Fp32, batch * inputs, 9, 1.0);
    let w_host = values(DType::Fp32, outputs * inputs, 10, 0.2);
    let b_host = values(DType::Fp32, outputs, 11, 1.0);
    let dy_host = values(DType::Fp32, batch * outputs, 12, 1.0);
    let x = ops.upload_f32(&x_host).unwrap();
    let w = ops.upload_f32(&w_host).unwrap();
    let b = ops.upload_f32(&b_host).unwrap();
    let dy = ops.upload_f32(&dy_host).unwrap();
    let mut y = ops.upload_f32(&vec![7.0; batch * outputs]).unwrap();
    linear.forward(&ops, &x, &w, &b, &mut y).unwrap();
    check(
        "linear fwd",
        &ops.download_f32(&y).unwrap(),
        &linear_forward_host(dims, &x_host, &w_host, &b_host),
        1e-5,
    );
    let want = linear_backward_host(dims, &x_host, &w_host, &dy_host);
    let mut dx = ops.upload_f32(&vec![7.0; batch * inputs]).unwrap();
    let mut dw = ops.upload_f32(&vec![7.0; outputs * inputs]).unwrap();
    let mut db = ops.upload_f32(&vec![7.0; outputs]).unwrap();
    linear.backward_data(&ops, &dy, &w, &mut dx).unwrap();
    linear
        .backward_weights(&ops, &x, &dy, &mut dw, &mut db, false)
        .unwrap();
    check("linear dx", &ops.download_f32(&dx).unwrap(), &want.dx, 1e-5);
    check(
        "linear dW",
        &ops.download_f32(&dw).unwrap(),
        &want.dweight,
        1e-5,
    );
    check(
        "linear db",
        &ops.download_f32(&db).unwrap(),
        &want.dbias,
        1e-5,
    );
    linear
        .backward_weights(&ops, &x, &dy, &mut dw, &mut db, true)
        .unwrap();
    let doubled = |v: &[f32]| v.iter().map(|x| 2.0 * x).collect::<Vec<_>>();
    check(
        "linear dW accumulated",
        &ops.download_f32(&dw).unwrap(),
        &doubled(&want.dweight),
        1e-5,
    );
    check(
        "linear db accumulated",
        &ops.download_f32(&db).unwrap(),
        &doubled(&want.dbias),
        1e-5,
    );
}

#[test]
#[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
fn gpu_sgd_step_matches_host() {
    let ops = gpu_ops();
    let len = 1000;
    for config in [
        SgdConfig {
            learning_rate: 0.1,
            momentum: 0.9,
            weight_decay: 0.01,
        },
        SgdConfig {
            learning_rate: 0.05,
            momentum: 0.0,
            weight_decay: 0.0,
        },
    ] {
        let sgd = Sgd::new(config).unwrap();
        let mut w_host = values(DType::Fp32, len, 13, 1.0);
        let mut v_host = vec![0.0; len];
        let mut w = ops.upload_f32(&w_host).unwrap();
        let mut v = ops.zeros_f32(len).unwrap();
        for step in 0..3 {
            let g_host = values(DType::Fp32, len, 14 + step, 0.5);
            let g = ops.upload_f32(&g_host).unwrap();
            sgd.step(&ops, &mut w, &g, &mut v).unwrap();
            sgd_step_host(config, &mut w_host, &g_host, &mut v_host);
        }
        check(
            &format!("sgd weights {config:?}"),
            &ops.download_f32(&w).unwrap(),
            &w_host,
            1e-6,
        );
        check(
            &format!("sgd velocity {config:?}"),
            &ops.download_f32(&v).unwrap(),
            &v_host,
            1e-6,
        );
    }
}

#[test]
#[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
fn gpu_transform_fp32_fp16_fp32() {
    let ops = gpu_ops();
    // Activations: fp32 NCHW -> fp16 NHWC -> fp32 NCHW.
    let nchw = TensorShape::new([2, 3, 4, 5], DType::Fp32, Layout::Nchw);
    let nhwc16 = nchw.with_dtype(DType::Fp16).with_layout(Layout::Nhwc);
    let down = Transform::new(nchw, nhwc16).unwrap();
    let up = Transform::new(nhwc16, nchw).unwrap();
    let x_host: Vec<f32> = random_values(DType::Fp32, nchw.elements(), 15)
        .iter()
        .map(|v| v * 3.0)
        .collect();
    let x = upload(&ops, DType::Fp32, &x_host);
    let mut half = garbage(&ops, DType::Fp16, nchw.elements());
    let mut back = garbage(&ops, DType::Fp32, nchw.elements());
    down.run(&ops, &x, &mut half).unwrap();
    up.run(&ops, &half, &mut back).unwrap();
    // Down: rounded to fp16 (to nearest, which the host does; allow one fp16 ulp in case the
    // device rounds otherwise). Up: exact.
    let got_half = download(&half);
    let want_half = transform_host(nchw, nhwc16, &x_host);
    check(
        "transform fp32 nchw -> fp16 nhwc",
        &got_half,
        &want_half,
        tolerance(DType::Fp16),
    );
    let exact = got_half
        .iter()
        .zip(&want_half)
        .filter(|(g, w)| g == w)
        .count();
    println!(
        "  {exact} of {} rounded exactly as on the host",
        want_half.len()
    );
    let want_back = transform_host(nhwc16, nchw, &got_half);
    check(
        "transform fp16 nhwc -> fp32 nchw",
        &download(&back),
        &want_back,
        0.0,
    );
    assert!(max_error(&download(&back), &x_host) < 1e-3);

    // Master weights: a flat fp32 vector to fp16 and back.
    let len = 777;
    let vector32 = TensorShape::vector(len, DType::Fp32);
    let vector16 = TensorShape::vector(len, DType::Fp16);
    let to_half = Transform::new(vector32, vector16).unwrap();
    let to_single = Transform::new(vector16, vector32).unwrap();
    let w_host = values(DType::Fp32, len, 16, 0.1);
    let w = ops.upload_f32(&w_host).unwrap();
    let mut w16 = garbage(&ops, DType::Fp16, len);
    let mut w32 = ops.zeros_f32(len).unwrap();
    to_half.run(&ops, &w, &mut w16).unwrap();
    to_single.run(&ops, &w16, &mut w32).unwrap();
    let want: Vec<f32> = w_host.iter().map(|&v| quantize(DType::Fp16, v)).collect();
    check(
        "master weights fp32 -> fp16 -> fp32",
        &ops.download_f32(&w32).unwrap(),
        &want,
        tolerance(DType::Fp16),
    );
    check(
        "master weights fp16 copy",
        &download(&w16),
        &want,
        tolerance(DType::Fp16),
    );
}

#[test]
#[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
fn gpu_nccl_world_size_one() {
    let version = nccl_version().unwrap();
    println!("NCCL {version}");
    let ops = gpu_ops();
    let id = NcclUniqueId::new().unwrap();
    let comm = NcclComm::init_rank_on_stream(1, 0, &id, ops.stream().clone()).unwrap();
    println!("{comm:?}: ncclAvg {}", comm.averages_in_nccl());
    assert_eq!((comm.rank(), comm.world_size()), (0, 1));
    let host = values(DType::Fp32, 1000, 17, 1.0);
    let mut grads = ops.upload_f32(&host).unwrap();
    comm.all_reduce_mean_f32(&mut grads).unwrap();
    check(
        "all-reduce mean, world 1",
        &ops.download_f32(&grads).unwrap(),
        &host,
        0.0,
    );
    comm.broadcast_f32(&mut grads, 0).unwrap();
    check(
        "broadcast, world 1",
        &ops.download_f32(&grads).unwrap(),
        &host,
        0.0,
    );
    // The backend's buffers work too; other dtypes and roots are errors, not crashes.
    let mut buffer = upload(&ops, DType::Fp32, &host);
    comm.all_reduce_mean_f32(&mut buffer).unwrap();
    check(
        "all-reduce of a DeviceBuffer",
        &download(&buffer),
        &host,
        0.0,
    );
    let mut half = upload(&ops, DType::Fp16, &host);
    let e = comm.all_reduce_mean_f32(&mut half).unwrap_err();
    assert!(matches!(e, GpuTrainError::InvalidArgument { .. }), "{e:?}");
    assert!(comm.broadcast_f32(&mut grads, 1).is_err());
    // A buffer of another stream is refused.
    let other = gpu_ops();
    let mut foreign = other.upload_f32(&host).unwrap();
    let e = comm.all_reduce_mean_f32(&mut foreign).unwrap_err();
    assert!(e.to_string().contains("another stream"), "{e}");
    drop(comm);

    // Made by ncclCommInitAll (no unique id), on its own stream: grouped sums of one rank.
    let comm = NcclComm::init_all(&[0])
        .unwrap()
        .remove(0)
        .into_comm()
        .unwrap();
    let own = GpuOps::with_stream(comm.stream().clone()).unwrap();
    let mut bufs = vec![
        own.upload_f32(&host).unwrap(),
        own.upload_f32(&host).unwrap(),
    ];
    comm.all_reduce_sum_f32_grouped(&mut bufs).unwrap();
    for buf in &bufs {
        check(
            "grouped all-reduce via ncclCommInitAll",
            &own.download_f32(buf).unwrap(),
            &host,
            0.0,
        );
    }
    drop(comm);

    // A communicator that makes its own stream, with the ops built on it.
    let comm = NcclComm::init_rank(1, 0, &NcclUniqueId::new().unwrap(), 0).unwrap();
    let ops = GpuOps::with_stream(comm.stream().clone()).unwrap();
    let mut grads = ops.upload_f32(&host).unwrap();
    comm.all_reduce_mean_f32(&mut grads).unwrap();
    check(
        "all-reduce on the comm's stream",
        &ops.download_f32(&grads).unwrap(),
        &host,
        0.0,
    );
    comm.abort();
}

#[test]
#[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
fn gpu_argument_errors_are_values() {
    let ops = gpu_ops();
    let shape = TensorShape::new([2, 3, 4, 4], DType::Fp32, Layout::Nchw);
    let relu = Relu::new(shape).unwrap();
    let x = ops.zeros_f32(shape.elements()).unwrap();
    let mut short = ops.zeros_f32(shape.elements() - 1).unwrap();
    let e = relu.forward(&ops, &x, &mut short).unwrap_err();
    println!("{e}");
    assert!(
        e.to_string()
            .contains("has 95 elements but its tensor 2x3x4x4"),
        "{e}"
    );
    let mut half = ops
        .cudnn()
        .alloc_zeroed(DType::Fp16, shape.elements())
        .unwrap();
    let e = relu.forward(&ops, &x, &mut half).unwrap_err();
    assert!(e.to_string().contains("is fp16 but its tensor"), "{e}");
    let other = gpu_ops();
    let foreign = other.zeros_f32(shape.elements()).unwrap();
    let mut y = ops.zeros_f32(shape.elements()).unwrap();
    let e = relu.forward(&ops, &foreign, &mut y).unwrap_err();
    assert!(e.to_string().contains("another stream"), "{e}");
    let linear = Linear::new(2, 3, 4).unwrap();
    let (w, b) = (ops.zeros_f32(12).unwrap(), ops.zeros_f32(4).unwrap());
    let mut out = ops.zeros_f32(8).unwrap();
    let e = linear
        .forward(&ops, &ops.zeros_f32(5).unwrap(), &w, &b, &mut out)
        .unwrap_err();
    assert!(
        e.to_string().contains("x must be a 2 x 3 fp32 matrix"),
        "{e}"
    );
    let sgd = Sgd::new(SgdConfig {
        learning_rate: 0.1,
        momentum: 0.9,
        weight_decay: 0.0,
    })
    .unwrap();
    let mut w = ops.zeros_f32(10).unwrap();
    let mut v = ops.zeros_f32(10).unwrap();
    assert!(sgd
        .step(&ops, &mut w, &ops.zeros_f32(9).unwrap(), &mut v)
        .is_err());
}

/// The tiny CNN of the training step test: conv 3->8 3x3 (pad 1) + bias, ReLU, 2x2 max-pool,
/// linear 288 -> 4, log-softmax; batch 8.
struct TinyCnn {
    problem: ConvProblem,
    conv_forward: PreparedPlan,
    conv_filter: PreparedPlan,
    bias: Bias,
    relu: Relu,
    pool: MaxPool2d,
    linear: Linear,
    softmax: Softmax,
}

const BATCH: usize = 8;
const CLASSES: usize = 4;

impl TinyCnn {
    fn new(ops: &GpuOps) -> Self {
        let problem = ConvProblem {
            pad_h: 1,
            pad_w: 1,
            math: MathMode::Fma,
            ..ConvProblem::new(BATCH as i64, 3, 12, 12, 8, 3, 3)
        };
        // Two micro-batches of 4 with algorithm 0, as a tuned plan would split them.
        let plan = |op| Plan {
            layer: "tiny-conv".into(),
            problem,
            op,
            micro_batches: [4, 4]
                .map(|size| MicroBatch {
                    size,
                    algo: mucudnn::solver::Algo::Legacy(0),
                    workspace_bytes: 0,
                    time_ms: 1.0,
                })
                .to_vec(),
        };
        let conv_out = TensorShape::new([BATCH, 8, 12, 12], DType::Fp32, Layout::Nchw);
        let pool = MaxPool2d::two_by_two(conv_out).unwrap();
        let features = pool.output_shape().elements() / BATCH;
        TinyCnn {
            problem,
            conv_forward: PreparedPlan::new(ops.cudnn(), plan(ConvOp::Forward)).unwrap(),
            conv_filter: PreparedPlan::new(ops.cudnn(), plan(ConvOp::BackwardFilter)).unwrap(),
            bias: Bias::new(conv_out).unwrap(),
            relu: Relu::new(conv_out).unwrap(),
            pool,
            linear: Linear::new(BATCH, features, CLASSES).unwrap(),
            softmax: Softmax::new(BATCH, CLASSES, DType::Fp32, SoftmaxKind::LogProbabilities)
                .unwrap(),
        }
    }
}

/// The host forward pass of [`TinyCnn`]: log-probabilities.
fn tiny_cnn_host(
    net: &TinyCnn,
    x: &[f32],
    conv_w: &[f32],
    conv_b: &[f32],
    w: &[f32],
    b: &[f32],
) -> Vec<f32> {
    let conv_out = net.bias.output_shape();
    let mut y: Vec<f32> = reference_convolution(&net.problem, ConvOp::Forward, x, conv_w)
        .unwrap()
        .values
        .into_iter()
        .map(|v| v as f32)
        .collect();
    bias_add_host(conv_out, &mut y, conv_b);
    let a = relu_forward_host(&y);
    let p = max_pool_forward_host(conv_out, [2, 2], [2, 2], &a);
    let logits = linear_forward_host([BATCH, net.linear.in_features(), CLASSES], &p, w, b);
    softmax_host(SoftmaxKind::LogProbabilities, CLASSES, &logits)
}

#[test]
#[ignore = "needs a GPU: run on the GPU machine by scripts/gpu/accept.sh (--include-ignored)"]
fn gpu_tiny_cnn_training_steps_reduce_the_loss() {
    let ops = gpu_ops();
    let net = TinyCnn::new(&ops);
    let id = NcclUniqueId::new().unwrap();
    let comm = NcclComm::init_rank_on_stream(1, 0, &id, ops.stream().clone()).unwrap();
    let sgd = Sgd::new(SgdConfig {
        learning_rate: 0.05,
        momentum: 0.9,
        weight_decay: 1e-4,
    })
    .unwrap();
    let conv_out = net.bias.output_shape();
    let pooled = net.pool.output_shape();
    let features = net.linear.in_features();

    let x_host = values(DType::Fp32, BATCH * 3 * 12 * 12, 20, 1.0);
    let conv_w_host = values(DType::Fp32, 8 * 3 * 3 * 3, 21, 0.2);
    let conv_b_host = values(DType::Fp32, 8, 22, 0.1);
    let w_host = values(DType::Fp32, CLASSES * features, 23, 0.06);
    let b_host = vec![0.0; CLASSES];
    let labels: Vec<usize> = (0..BATCH).map(|i| i % CLASSES).collect();

    // Parameters (conv weights in a DeviceBuffer, as the plans take them), gradients,
    // velocities, activations.
    let x = upload(&ops, DType::Fp32, &x_host);
    let mut conv_w = upload(&ops, DType::Fp32, &conv_w_host);
    let mut conv_dw = garbage(&ops, DType::Fp32, conv_w_host.len());
    let mut conv_vw = ops
        .cudnn()
        .alloc_zeroed(DType::Fp32, conv_w_host.len())
        .unwrap();
    let mut conv_b = ops.upload_f32(&conv_b_host).unwrap();
    let mut conv_db = ops.zeros_f32(8).unwrap();
    let mut conv_vb = ops.zeros_f32(8).unwrap();
    let mut w = ops.upload_f32(&w_host).unwrap();
    let mut dw = ops.zeros_f32(w_host.len()).unwrap();
    let mut vw = ops.zeros_f32(w_host.len()).unwrap();
    let mut b = ops.upload_f32(&b_host).unwrap();
    let mut db = ops.zeros_f32(CLASSES).unwrap();
    let mut vb = ops.zeros_f32(CLASSES).unwrap();
    let mut y = garbage(&ops, DType::Fp32, conv_out.elements());
    let mut a = ops.zeros_f32(conv_out.elements()).unwrap();
    let mut p = ops.zeros_f32(pooled.elements()).unwrap();
    let mut logits = ops.zeros_f32(BATCH * CLASSES).unwrap();
    let mut log_p = ops.zeros_f32(BATCH * CLASSES).unwrap();
    let mut dp = ops.zeros_f32(pooled.elements()).unwrap();
    let mut da = ops.zeros_f32(conv_out.elements()).unwrap();
    let mut dy = garbage(&ops, DType::Fp32, conv_out.elements());
    let mut workspace = ops
        .cudnn()
        .alloc_workspace(
            net.conv_forward
                .workspace_bytes()
                .max(net.conv_filter.workspace_bytes()),
        )
        .unwrap();
    comm.broadcast_f32(&mut conv_w, 0).unwrap();

    let mut losses = Vec::new();
    for step in 0..30 {
        // Forward.
        net.conv_forward
            .execute(ops.cudnn(), 1.0, &x, &conv_w, 0.0, &mut y, &mut workspace)
            .unwrap();
        net.bias.forward(&ops, &conv_b, &mut y).unwrap();
        net.relu.forward(&ops, &y, &mut a).unwrap();
        net.pool.forward(&ops, &a, &mut p).unwrap();
        net.linear.forward(&ops, &p, &w, &b, &mut logits).unwrap();
        net.softmax.forward(&ops, &logits, &mut log_p).unwrap();
        let log_p_host = ops.download_f32(&log_p).unwrap();
        if step == 0 {
            let want = tiny_cnn_host(&net, &x_host, &conv_w_host, &conv_b_host, &w_host, &b_host);
            check("tiny CNN forward vs host", &log_p_host, &want, 1e-4);
        }
        let ce = cross_entropy_host(SoftmaxKind::LogProbabilities, CLASSES, &log_p_host, &labels)
            .unwrap();
        losses.push(ce.loss);
        let dlogits = ops.upload_f32(&ce.grad_logits).unwrap();

        // Backward.
        net.linear
            .backward_weights(&ops, &p, &dlogits, &mut dw, &mut db, false)
            .unwrap();
        net.linear
            .backward_data(&ops, &dlogits, &w, &mut dp)
            .unwrap();
        net.pool.backward(&ops, &a, &p, &dp, &mut da).unwrap();
        net.relu.backward(&ops, &y, &a, &da, &mut dy).unwrap();
        net.bias.backward(&ops, &dy, &mut conv_db, false).unwrap();
        net.conv_filter
            .execute(ops.cudnn(), 1.0, &x, &dy, 0.0, &mut conv_dw, &mut workspace)
            .unwrap();

        // Average over the (one) replica and update.
        comm.all_reduce_mean_f32(&mut conv_dw).unwrap();
        comm.all_reduce_mean_f32(&mut conv_db).unwrap();
        comm.all_reduce_mean_f32(&mut dw).unwrap();
        comm.all_reduce_mean_f32(&mut db).unwrap();
        sgd.step(&ops, &mut conv_w, &conv_dw, &mut conv_vw).unwrap();
        sgd.step(&ops, &mut conv_b, &conv_db, &mut conv_vb).unwrap();
        sgd.step(&ops, &mut w, &dw, &mut vw).unwrap();
        sgd.step(&ops, &mut b, &db, &mut vb).unwrap();
    }
    ops.synchronize().unwrap();
    println!("tiny CNN losses: {losses:?}");
    let (first, last) = (losses[0], *losses.last().unwrap());
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    assert!(last < 0.5 * first, "loss {first} -> {last}");
}
