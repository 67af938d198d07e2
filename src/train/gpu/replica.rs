//! The GPU replica: the network of a [`NetSpec`] on one GPU, a [`Replica`] for the common
//! training loop ([`crate::train::driver`]).
//!
//! # Data flow of a step
//!
//! Everything is queued on one stream, the replica's [`GpuOps`] stream, which its
//! [`NcclComm`] shares:
//!
//! ```text
//! images (host, NCHW f32) --upload--> [fp16: Transform to NHWC fp16]
//!   per block: conv (PreparedPlan, micro-batched) -> Bias -> Relu -> MaxPool2d
//!   [fp16: Transform the last pool output to NCHW fp32] -> Linear (fp32) -> Softmax (log)
//! host: sample count all-reduced over the ranks (HostCollective; overlaps the GPU work),
//!       log-probabilities downloaded (the step's one mid-step sync), loss and
//!       d logits = (softmax - onehot) / global count, uploaded
//! backward: Linear -> [fp16: Transform x loss scale] -> per block, last first:
//!   MaxPool2d, Relu, Bias gradient, conv backward-filter, conv backward-data (not for
//!   block 0: the images need no gradient) [fp16: gradients Transformed to fp32 / loss scale]
//! every fp32 gradient all-reduced (NCCL sum) -> Sgd per tensor -> sync at the step's end
//! ```
//!
//! # Averaging, as the CPU replica does it
//!
//! The loop's convention ([`Replica::train_step`]): the gradient used for the update is the
//! sum over every rank's samples of the per-sample loss gradients, divided by the global
//! sample count; ranks may hold uneven or empty shards; a step with no samples anywhere
//! updates nothing. The CPU replica sums the gradients of the summed losses and divides after
//! the all-reduce. Here the division comes first: the rank all-reduces its sample count on
//! the host while the forward pass runs, so the host scales `softmax - onehot` by
//! `1 / global count` ([`mean_gradient_scale`]) before the backward pass, and NCCL then
//! *sums* the gradients (`ncclSum`, the same bits on every rank). Backward is linear in
//! `d logits`, so the all-reduced gradient is the gradient of the mean loss over the global
//! batch, and a rank with no samples contributes zeros. The update is elementwise (cuBLAS
//! `scal`/`axpy`), so the replicas stay bitwise identical, which `--check-sync` checks.
//!
//! # Precision
//!
//! [`Precision::Fp32`]: fp32 NCHW throughout; the conv math mode is
//! [`GpuSettings::math`] (`Default` lets cuDNN use TF32 tensor cores; `Fma` forbids them, for
//! comparisons with the CPU). [`Precision::Fp16`]: the convolutions, bias, ReLU and pooling run
//! in fp16 NHWC (tensor cores), from fp16 copies of the fp32 master weights made after every
//! update; the linear layer, the loss, the gradients, the all-reduce and the update stay
//! fp32. The backward pass through the fp16 layers is scaled by a static loss scale
//! ([`GpuSettings::loss_scale`], a power of two, so scaling is exact) to keep small
//! activation gradients out of fp16's subnormal range; the scale is removed when the fp16
//! weight and bias gradients are converted to fp32. A gradient beyond fp16's range (65504
//! times the scale's inverse) overflows to infinity, the weights follow, and the next loss is
//! not finite: the loop then stops with [`TrainError::Diverged`]. There is no dynamic scaling.
//!
//! # Tuning
//!
//! [`Replica::prepare`] tunes every conv layer (forward, backward-data, backward-filter) for
//! each per-rank batch size with [`LayerTuning::tune`] on a [`CudnnBackend`] of this GPU,
//! through the tuning cache file every rank opens: the loop calls it on rank 0 first, so the
//! other ranks read rank 0's plans instead of measuring (ranks on another GPU model, or on
//! another host with its own file, tune for themselves). The plans then run as
//! [`PreparedPlan`]s on the replica's own handle, sharing one workspace buffer as large as the
//! largest plan's. Block 0's backward-data plan is tuned (and reported) but not run.

#![forbid(unsafe_code)]

use super::{
    Bias, GpuOps, GpuTrainError, Linear, MaxPool2d, NcclComm, Relu, Sgd, SgdConfig, Softmax,
    SoftmaxKind, TensorShape, Transform,
};
use crate::backend::cudnn::{DeviceBuffer, GpuTimer, Workspace};
use crate::backend::{CudnnBackend, TimingSettings};
use crate::exec::conv2d::LayerError;
use crate::exec::cudnn::PreparedPlan;
use crate::exec::ExecError;
use crate::solver::{CandidateSet, ConvProblem, DType, Layout, MathMode, Plan, Policy};
use crate::train::{CacheChoice, Collective, Hyper, NetSpec, Replica, StepStats, TrainError};
use crate::tune::{EngineOptions, LayerTuning, TuneError};
use mucudnn_cache::Cache;
use std::collections::BTreeMap;
use std::time::Instant;

/// The numeric format of the layers around the convolutions on the GPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// fp32 activations and weights, NCHW.
    #[default]
    Fp32,
    /// fp16 activations and conv weights, NHWC; fp32 master weights, gradients, linear layer
    /// and update; a static loss scale.
    Fp16,
}

impl Precision {
    pub const ALL: [Precision; 2] = [Precision::Fp32, Precision::Fp16];

    /// `fp32` or `fp16` (the `--dtype` values).
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Fp16 => "fp16",
        }
    }

    /// The dtype of the activations and conv weights.
    pub fn dtype(self) -> DType {
        match self {
            Precision::Fp32 => DType::Fp32,
            Precision::Fp16 => DType::Fp16,
        }
    }

    /// The activations' layout: fp16 runs NHWC, the tensor cores' native layout.
    pub fn layout(self) -> Layout {
        match self {
            Precision::Fp32 => Layout::Nchw,
            Precision::Fp16 => Layout::Nhwc,
        }
    }

    /// E.g. `fp16 NHWC (fp32 master weights, loss scale 1024)`.
    pub fn describe(self, loss_scale: f32) -> String {
        match self {
            Precision::Fp32 => "fp32 NCHW".into(),
            Precision::Fp16 => {
                format!("fp16 NHWC (fp32 master weights and linear layer, loss scale {loss_scale})")
            }
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Precision {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        Precision::ALL
            .into_iter()
            .find(|p| p.name() == text.to_ascii_lowercase())
            .ok_or_else(|| format!("`{text}` is not a precision: fp32 or fp16"))
    }
}

/// The static loss scale of fp16 training (see the module docs).
pub const DEFAULT_LOSS_SCALE: f32 = 1024.0;

/// How a GPU replica tunes and runs its layers.
#[derive(Clone, Debug, PartialEq)]
pub struct GpuSettings {
    /// Policy (`Undivided` for the best single algorithm per layer), per-layer workspace
    /// limit, timing, candidates (legacy algorithms, engine configurations or both).
    pub tuning: LayerTuning,
    /// The tuning cache every rank opens.
    pub cache: CacheChoice,
    pub precision: Precision,
    /// The convolutions' math mode (part of the tuned problem).
    pub math: MathMode,
    /// fp16 only: the static loss scale, a power of two.
    pub loss_scale: f32,
}

impl GpuSettings {
    /// GPU timing, every candidate kind, default engine search, default math, fp16's
    /// default loss scale.
    pub fn new(
        policy: Policy,
        workspace_limit_bytes: u64,
        cache: CacheChoice,
        precision: Precision,
    ) -> Self {
        GpuSettings {
            tuning: LayerTuning {
                policy,
                workspace_limit_bytes,
                timing: TimingSettings::GPU,
                candidates: CandidateSet::All,
                engines: EngineOptions::default(),
            },
            cache,
            precision,
            math: MathMode::Default,
            loss_scale: DEFAULT_LOSS_SCALE,
        }
    }

    pub fn validate(&self) -> Result<(), TrainError> {
        let scale = self.loss_scale;
        let power_of_two = (1.0..=65536.0).contains(&scale)
            && (scale as u32).is_power_of_two()
            && scale.fract() == 0.0;
        if !power_of_two {
            return Err(TrainError::Config(format!(
                "the loss scale must be a power of two from 1 to 65536, not {scale}"
            )));
        }
        Ok(())
    }

    /// Block `block`'s convolution at a per-rank batch of `n` (3x3, padding 1, stride 1).
    pub fn problem(&self, spec: &NetSpec, block: usize, n: usize) -> ConvProblem {
        let size = spec.block_input_size(block) as i64;
        let kernel = super::super::net::KERNEL as i64;
        ConvProblem {
            pad_h: 1,
            pad_w: 1,
            dtype: self.precision.dtype(),
            layout: self.precision.layout(),
            math: self.math,
            ..ConvProblem::new(
                n as i64,
                spec.block_input_channels(block) as i64,
                size,
                size,
                spec.block_channels[block] as i64,
                kernel,
                kernel,
            )
        }
    }
}

/// The factor the host applies to `softmax - onehot` before the backward pass, so that the
/// *sum* over ranks of the gradients is the gradient of the mean loss over the global batch:
/// `1 / global_samples`, and 0 when the global batch is empty (nothing to average; the step
/// then updates nothing, as on the CPU).
pub fn mean_gradient_scale(global_samples: f64) -> f64 {
    if global_samples > 0.0 {
        1.0 / global_samples
    } else {
        0.0
    }
}

/// What the host makes of one batch's log-probabilities.
#[derive(Clone, Debug, PartialEq)]
pub struct HostLoss {
    /// Sum (not mean) of the per-sample cross-entropies, in f64.
    pub loss_sum: f64,
    /// Rows whose most probable class (the first on ties) is the label.
    pub correct: usize,
    /// `scale * (softmax - onehot)`, row-major `batch x classes` (empty without a scale).
    pub grad_logits: Vec<f32>,
}

/// Finishes softmax cross-entropy on the host from [`Softmax`]'s log-probabilities
/// (`labels.len() x classes`, row-major), as the CPU replica's loss does from logits; with
/// `grad_scale`, also the scaled gradient with respect to the logits, computed in f64 and
/// rounded once. Lengths and labels must fit (the replica checks the batch first).
pub fn cross_entropy_from_log_probs(
    log_probs: &[f32],
    labels: &[u32],
    classes: usize,
    grad_scale: Option<f64>,
) -> HostLoss {
    let mut loss_sum = 0.0f64;
    let mut correct = 0;
    let mut grad_logits = Vec::with_capacity(grad_scale.map_or(0, |_| log_probs.len()));
    for (row, &label) in log_probs.chunks_exact(classes.max(1)).zip(labels) {
        let label = label as usize;
        let mut best = 0;
        for (k, &value) in row.iter().enumerate() {
            if value > row[best] {
                best = k;
            }
        }
        correct += usize::from(best == label);
        loss_sum -= f64::from(row[label]);
        if let Some(scale) = grad_scale {
            grad_logits.extend(row.iter().enumerate().map(|(k, &value)| {
                let target = if k == label { 1.0 } else { 0.0 };
                ((f64::from(value).exp() - target) * scale) as f32
            }));
        }
    }
    HostLoss {
        loss_sum,
        correct,
        grad_logits,
    }
}

fn gpu_error(error: impl Into<GpuTrainError>) -> TrainError {
    TrainError::Gpu(error.into())
}

fn exec_error(error: ExecError) -> TrainError {
    TrainError::Layer(LayerError::from(error))
}

/// Times `run` (convolutions queued on the timer's stream) with CUDA events; the time is read
/// after the step's final sync.
fn timed(timer: &GpuTimer, run: impl FnOnce() -> Result<(), ExecError>) -> Result<(), TrainError> {
    timer.start().map_err(gpu_error)?;
    run().map_err(exec_error)?;
    timer.stop().map_err(gpu_error)
}

/// fp32 master weights, gradients and momentum: one buffer per [`NetSpec::parameter_shapes`]
/// tensor, in that order (conv weights KCRS as NetSpec has them).
struct Parameters {
    weights: Vec<DeviceBuffer>,
    grads: Vec<DeviceBuffer>,
    velocity: Vec<DeviceBuffer>,
}

/// fp16 copies of one conv block's parameters and gradients (weights KRSC: NHWC filters).
struct HalfBlock {
    weight: DeviceBuffer,
    bias: DeviceBuffer,
    d_weight: DeviceBuffer,
    d_bias: DeviceBuffer,
    /// fp32 KCRS -> fp16 KRSC, and back.
    weight_in: Transform,
    weight_out: Transform,
    /// fp32 -> fp16 vector, and back.
    bias_in: Transform,
    bias_out: Transform,
}

/// One conv block's layers at one batch size.
struct BlockPass {
    forward: PreparedPlan,
    /// `None` for block 0 (its input needs no gradient).
    backward_data: Option<PreparedPlan>,
    backward_filter: PreparedPlan,
    bias: Bias,
    relu: Relu,
    pool: MaxPool2d,
}

/// Gradient buffers of one batch size, made on its first training step.
struct PassGrads {
    d_logits: DeviceBuffer,
    /// fp16: the linear layer's input gradient in fp32 NCHW, and its conversion (times the
    /// loss scale) into `d_inputs[blocks]`.
    d_features: Option<(DeviceBuffer, Transform)>,
    /// `d_inputs[i]`: the gradient of block `i`'s input; `None` for the images.
    d_inputs: Vec<Option<DeviceBuffer>>,
    d_conv_out: Vec<DeviceBuffer>,
    d_relu_out: Vec<DeviceBuffer>,
}

/// Everything one per-rank batch size needs: plans, layers, activations.
struct Pass {
    /// `[forward, backward-data, backward-filter]` of every block, for reports.
    plans: Vec<Plan>,
    blocks: Vec<BlockPass>,
    /// `inputs[i]`: block `i`'s input (the images in the conv format for `i = 0`);
    /// `inputs[blocks]`: the last pool output.
    inputs: Vec<DeviceBuffer>,
    /// Conv plus bias (ReLU's input), and ReLU's output (the pool's input).
    conv_out: Vec<DeviceBuffer>,
    relu_out: Vec<DeviceBuffer>,
    /// fp16: the uploaded images (fp32 NCHW) and their conversion into `inputs[0]`.
    images: Option<(DeviceBuffer, Transform)>,
    /// fp16: the last pool output as the linear layer takes it (fp32 NCHW), and the
    /// conversion.
    features: Option<(DeviceBuffer, Transform)>,
    linear: Linear,
    softmax: Softmax,
    logits: DeviceBuffer,
    log_probs: DeviceBuffer,
    grads: Option<PassGrads>,
}

/// One rank's replica on one GPU: its handles, the network's parameters and optimizer state
/// on the device, the tuned plans per batch size, and its handles on NCCL (gradients) and on
/// the host collective (sample counts).
pub struct GpuReplica<C: Collective> {
    spec: NetSpec,
    settings: GpuSettings,
    ops: GpuOps,
    /// Taken only when dropping after a failure (aborted instead of destroyed).
    comm: Option<NcclComm>,
    collective: C,
    cache: Cache,
    params: Parameters,
    /// fp16 only, one per block.
    half: Vec<HalfBlock>,
    /// Whether the fp16 weight copies predate the last update.
    half_stale: bool,
    passes: BTreeMap<usize, Pass>,
    workspace: Workspace,
    /// Event pairs around the convolutions of one call (`3 x blocks`).
    timers: Vec<GpuTimer>,
    /// A call failed: on drop, abort the communicator instead of waiting for peers.
    failed: bool,
}

impl<C: Collective> GpuReplica<C> {
    /// A replica on `ops`'s GPU, initialised from `seed` ([`NetSpec::init_parameters`]) and
    /// then, for safety, broadcast from rank 0 over NCCL. `comm` must run on `ops`'s stream
    /// (make `ops` with `GpuOps::with_stream(comm.stream().clone())`) and have the
    /// `collective`'s rank and world size.
    pub fn new(
        spec: &NetSpec,
        seed: u64,
        settings: &GpuSettings,
        ops: GpuOps,
        comm: NcclComm,
        collective: C,
    ) -> Result<Self, TrainError> {
        spec.validate()?;
        settings.validate()?;
        if **comm.stream() != **ops.stream() {
            return Err(TrainError::Config(
                "the NCCL communicator and the GPU ops must share one stream (make the ops \
                 with GpuOps::with_stream(comm.stream().clone()))"
                    .into(),
            ));
        }
        if comm.rank() != collective.rank() || comm.world_size() != collective.world_size() {
            return Err(TrainError::Config(format!(
                "NCCL rank {} of {} but collective rank {} of {}",
                comm.rank(),
                comm.world_size(),
                collective.rank(),
                collective.world_size()
            )));
        }
        let cudnn = ops.cudnn();
        let zeros = |len: usize| cudnn.alloc_zeroed(DType::Fp32, len).map_err(gpu_error);
        let mut params = Parameters {
            weights: Vec::new(),
            grads: Vec::new(),
            velocity: Vec::new(),
        };
        for values in spec.init_parameters(seed) {
            params
                .weights
                .push(cudnn.upload(DType::Fp32, &values).map_err(gpu_error)?);
            params.grads.push(zeros(values.len())?);
            params.velocity.push(zeros(values.len())?);
        }
        for weights in &mut params.weights {
            comm.broadcast_f32(weights, 0)?;
        }
        let half = match settings.precision {
            Precision::Fp32 => Vec::new(),
            Precision::Fp16 => (0..spec.block_channels.len())
                .map(|block| half_block(&ops, spec, block))
                .collect::<Result<_, _>>()?,
        };
        let timers = (0..3 * spec.block_channels.len())
            .map(|_| cudnn.timer().map_err(gpu_error))
            .collect::<Result<_, _>>()?;
        let workspace = cudnn.alloc_workspace(0).map_err(gpu_error)?;
        ops.synchronize()?;
        Ok(GpuReplica {
            spec: spec.clone(),
            settings: settings.clone(),
            cache: settings.cache.open()?,
            ops,
            comm: Some(comm),
            collective,
            params,
            half,
            half_stale: true,
            passes: BTreeMap::new(),
            workspace,
            timers,
            failed: false,
        })
    }

    pub fn spec(&self) -> &NetSpec {
        &self.spec
    }

    pub fn settings(&self) -> &GpuSettings {
        &self.settings
    }

    /// The GPU's ordinal.
    pub fn device(&self) -> usize {
        self.ops.ordinal()
    }

    pub fn collective(&self) -> &C {
        &self.collective
    }

    /// Tunes every block for batch `n` and builds its plans, layers and activations.
    fn build_pass(&self, backend: &mut CudnnBackend, n: usize) -> Result<Pass, TrainError> {
        let spec = &self.spec;
        let precision = self.settings.precision;
        let (dtype, layout) = (precision.dtype(), precision.layout());
        let cudnn = self.ops.cudnn();
        let alloc = |dtype: DType, len: usize| cudnn.alloc_zeroed(dtype, len).map_err(gpu_error);
        let blocks = spec.block_channels.len();
        let image_shape = TensorShape::new(
            [n, spec.in_channels, spec.image_size, spec.image_size],
            dtype,
            layout,
        );
        let mut plans = Vec::with_capacity(3 * blocks);
        let mut block_passes = Vec::with_capacity(blocks);
        let mut inputs = vec![alloc(dtype, image_shape.elements())?];
        let (mut conv_out, mut relu_out) = (Vec::new(), Vec::new());
        let mut last_pool = image_shape;
        for block in 0..blocks {
            let problem = self.settings.problem(spec, block, n);
            let layer = format!("train.block{block}.conv");
            let tuned = self
                .settings
                .tuning
                .tune(backend, &self.cache, &layer, &problem)
                .map_err(|e: TuneError| TrainError::Layer(e.into()))?;
            plans.extend(tuned.iter().cloned());
            let [forward, backward_data, backward_filter] = tuned;
            let prepare = |plan: Plan| PreparedPlan::new(cudnn, plan).map_err(exec_error);
            let size = spec.block_input_size(block);
            let out_shape =
                TensorShape::new([n, spec.block_channels[block], size, size], dtype, layout);
            let pool = MaxPool2d::two_by_two(out_shape)?;
            let pooled = pool.output_shape();
            if pooled.dims != [n, spec.block_channels[block], size / 2, size / 2] {
                return Err(TrainError::Config(format!(
                    "block {block} pools to {}",
                    pooled.describe()
                )));
            }
            block_passes.push(BlockPass {
                forward: prepare(forward)?,
                backward_data: if block > 0 {
                    Some(prepare(backward_data)?)
                } else {
                    None
                },
                backward_filter: prepare(backward_filter)?,
                bias: Bias::new(out_shape)?,
                relu: Relu::new(out_shape)?,
                pool,
            });
            conv_out.push(alloc(dtype, out_shape.elements())?);
            relu_out.push(alloc(dtype, out_shape.elements())?);
            inputs.push(alloc(dtype, pooled.elements())?);
            last_pool = pooled;
        }
        let features = spec.feature_count();
        if last_pool.elements() != n * features {
            return Err(TrainError::Config(format!(
                "the last block gives {} values per batch, the linear layer takes {n} x {features}",
                last_pool.elements()
            )));
        }
        let fp32_nchw =
            |shape: TensorShape| shape.with_dtype(DType::Fp32).with_layout(Layout::Nchw);
        let (images, features_fp32) = match precision {
            Precision::Fp32 => (None, None),
            Precision::Fp16 => (
                Some((
                    alloc(DType::Fp32, image_shape.elements())?,
                    Transform::new(fp32_nchw(image_shape), image_shape)?,
                )),
                Some((
                    alloc(DType::Fp32, last_pool.elements())?,
                    Transform::new(last_pool, fp32_nchw(last_pool))?,
                )),
            ),
        };
        let classes = spec.classes;
        Ok(Pass {
            plans,
            blocks: block_passes,
            inputs,
            conv_out,
            relu_out,
            images,
            features: features_fp32,
            linear: Linear::new(n, features, classes)?,
            softmax: Softmax::new(n, classes, DType::Fp32, SoftmaxKind::LogProbabilities)?,
            logits: alloc(DType::Fp32, n * classes)?,
            log_probs: alloc(DType::Fp32, n * classes)?,
            grads: None,
        })
    }

    /// Makes pass `n`'s gradient buffers if it has none yet.
    fn ensure_grads(&mut self, n: usize) -> Result<(), TrainError> {
        let cudnn = self.ops.cudnn();
        let precision = self.settings.precision;
        let pass = self
            .passes
            .get_mut(&n)
            .ok_or_else(|| TrainError::Config(format!("batch size {n} was not prepared")))?;
        if pass.grads.is_some() {
            return Ok(());
        }
        let alloc = |dtype: DType, len: usize| cudnn.alloc_zeroed(dtype, len).map_err(gpu_error);
        let dtype = precision.dtype();
        let blocks = pass.blocks.len();
        let mut d_inputs = vec![None];
        for input in &pass.inputs[1..] {
            d_inputs.push(Some(alloc(dtype, input.len())?));
        }
        let d_features = match precision {
            Precision::Fp32 => None,
            Precision::Fp16 => {
                let last = pass.blocks[blocks - 1].pool.output_shape();
                let fp32 = last.with_dtype(DType::Fp32).with_layout(Layout::Nchw);
                Some((
                    alloc(DType::Fp32, last.elements())?,
                    Transform::new(fp32, last)?,
                ))
            }
        };
        let mut d_conv_out = Vec::with_capacity(blocks);
        let mut d_relu_out = Vec::with_capacity(blocks);
        for out in &pass.conv_out {
            d_conv_out.push(alloc(dtype, out.len())?);
            d_relu_out.push(alloc(dtype, out.len())?);
        }
        pass.grads = Some(PassGrads {
            d_logits: alloc(DType::Fp32, pass.logits.len())?,
            d_features,
            d_inputs,
            d_conv_out,
            d_relu_out,
        });
        Ok(())
    }

    /// Queues the forward pass of `images` (batch `n`, prepared) up to the log-probabilities;
    /// returns how many conv timers it used.
    fn forward(&mut self, n: usize, images: &[f32]) -> Result<usize, TrainError> {
        let GpuReplica {
            ops,
            params,
            half,
            half_stale,
            passes,
            workspace,
            timers,
            ..
        } = self;
        if !half.is_empty() && *half_stale {
            for (block, h) in half.iter_mut().enumerate() {
                h.weight_in
                    .run(ops, &params.weights[2 * block], &mut h.weight)?;
                h.bias_in
                    .run(ops, &params.weights[2 * block + 1], &mut h.bias)?;
            }
            *half_stale = false;
        }
        let pass = passes
            .get_mut(&n)
            .ok_or_else(|| TrainError::Config(format!("batch size {n} was not prepared")))?;
        let Pass {
            blocks,
            inputs,
            conv_out,
            relu_out,
            images: staged,
            features,
            linear,
            softmax,
            logits,
            log_probs,
            ..
        } = pass;
        match staged {
            Some((upload, to_half)) => {
                upload.copy_from_host(images).map_err(gpu_error)?;
                to_half.run(ops, upload, &mut inputs[0])?;
            }
            None => inputs[0].copy_from_host(images).map_err(gpu_error)?,
        }
        let cudnn = ops.cudnn();
        let mut used = 0;
        for (index, block) in blocks.iter().enumerate() {
            let (weight, bias) = match half.get(index) {
                Some(h) => (&h.weight, &h.bias),
                None => (&params.weights[2 * index], &params.weights[2 * index + 1]),
            };
            let (before, after) = inputs.split_at_mut(index + 1);
            let (x, pooled) = (&before[index], &mut after[0]);
            let y = &mut conv_out[index];
            timed(&timers[used], || {
                block
                    .forward
                    .execute(cudnn, 1.0, x, weight, 0.0, y, workspace)
            })?;
            used += 1;
            block.bias.forward(ops, bias, y)?;
            block.relu.forward(ops, y, &mut relu_out[index])?;
            block.pool.forward(ops, &relu_out[index], pooled)?;
        }
        let last = &inputs[blocks.len()];
        let features: &DeviceBuffer = match features {
            Some((fp32, to_float)) => {
                to_float.run(ops, last, fp32)?;
                fp32
            }
            None => last,
        };
        let count = params.weights.len();
        linear.forward(
            ops,
            features,
            &params.weights[count - 2],
            &params.weights[count - 1],
            logits,
        )?;
        softmax.forward(ops, logits, log_probs)?;
        Ok(used)
    }

    /// Queues the backward pass of batch `n` from `d logits` (already on the device) into
    /// the fp32 gradient buffers; returns how many conv timers it used, counting from `used`.
    fn backward(&mut self, n: usize, mut used: usize) -> Result<usize, TrainError> {
        let loss_scale = self.settings.loss_scale;
        let GpuReplica {
            ops,
            params,
            half,
            passes,
            workspace,
            timers,
            ..
        } = self;
        let pass = passes
            .get_mut(&n)
            .ok_or_else(|| TrainError::Config(format!("batch size {n} was not prepared")))?;
        let Pass {
            blocks,
            inputs,
            conv_out,
            relu_out,
            features,
            linear,
            grads,
            ..
        } = pass;
        let grads = grads
            .as_mut()
            .ok_or_else(|| TrainError::Config(format!("batch size {n} has no gradients")))?;
        let PassGrads {
            d_logits,
            d_features,
            d_inputs,
            d_conv_out,
            d_relu_out,
        } = grads;
        let Parameters {
            weights,
            grads: param_grads,
            ..
        } = params;
        let count = weights.len();
        let blocks_len = blocks.len();
        let features_in: &DeviceBuffer = match features {
            Some((fp32, _)) => fp32,
            None => &inputs[blocks_len],
        };
        let (conv_grads, linear_grads) = param_grads.split_at_mut(count - 2);
        let (d_linear_weight, d_linear_bias) = linear_grads.split_at_mut(1);
        linear.backward_weights(
            ops,
            features_in,
            d_logits,
            &mut d_linear_weight[0],
            &mut d_linear_bias[0],
            false,
        )?;
        let d_last = d_inputs[blocks_len]
            .as_mut()
            .ok_or_else(|| TrainError::Config("no gradient buffer for the last block".into()))?;
        match d_features {
            Some((fp32, to_half)) => {
                linear.backward_data(ops, d_logits, &weights[count - 2], fp32)?;
                to_half.run_scaled(ops, loss_scale, fp32, d_last)?;
            }
            None => linear.backward_data(ops, d_logits, &weights[count - 2], d_last)?,
        }
        let cudnn = ops.cudnn();
        for (index, block) in blocks.iter().enumerate().rev() {
            let d_next = d_inputs[index + 1].as_ref().ok_or_else(|| {
                TrainError::Config(format!("no gradient for block {index}'s output"))
            })?;
            block.pool.backward(
                ops,
                &relu_out[index],
                &inputs[index + 1],
                d_next,
                &mut d_relu_out[index],
            )?;
            block.relu.backward(
                ops,
                &conv_out[index],
                &relu_out[index],
                &d_relu_out[index],
                &mut d_conv_out[index],
            )?;
            let dy = &d_conv_out[index];
            let x = &inputs[index];
            let (d_weight_fp32, d_bias_fp32) = conv_grads[2 * index..2 * index + 2].split_at_mut(1);
            let (d_weight_fp32, d_bias_fp32) = (&mut d_weight_fp32[0], &mut d_bias_fp32[0]);
            match half.get_mut(index) {
                Some(h) => {
                    block.bias.backward(ops, dy, &mut h.d_bias, false)?;
                    h.bias_out
                        .run_scaled(ops, 1.0 / loss_scale, &h.d_bias, d_bias_fp32)?;
                    let d_weight = &mut h.d_weight;
                    timed(&timers[used], || {
                        block
                            .backward_filter
                            .execute(cudnn, 1.0, x, dy, 0.0, d_weight, workspace)
                    })?;
                    h.weight_out
                        .run_scaled(ops, 1.0 / loss_scale, &h.d_weight, d_weight_fp32)?;
                }
                None => {
                    block.bias.backward(ops, dy, d_bias_fp32, false)?;
                    timed(&timers[used], || {
                        block.backward_filter.execute(
                            cudnn,
                            1.0,
                            x,
                            dy,
                            0.0,
                            d_weight_fp32,
                            workspace,
                        )
                    })?;
                }
            }
            used += 1;
            if let Some(plan) = &block.backward_data {
                let weight = match half.get(index) {
                    Some(h) => &h.weight,
                    None => &weights[2 * index],
                };
                let dx = d_inputs[index].as_mut().ok_or_else(|| {
                    TrainError::Config(format!("no gradient buffer for block {index}'s input"))
                })?;
                timed(&timers[used], || {
                    plan.execute(cudnn, 1.0, weight, dy, 0.0, dx, workspace)
                })?;
                used += 1;
            }
        }
        Ok(used)
    }

    /// The milliseconds between the first `used` timers' events (after a sync).
    fn conv_ms(&self, used: usize) -> Result<f64, TrainError> {
        self.timers[..used].iter().try_fold(0.0, |total, timer| {
            Ok(total + f64::from(timer.elapsed_ms().map_err(gpu_error)?))
        })
    }

    fn train_step_inner(
        &mut self,
        images: &[f32],
        labels: &[u32],
        hyper: &Hyper,
    ) -> Result<StepStats, TrainError> {
        hyper.validate()?;
        self.spec.check_batch(images, labels)?;
        let started = Instant::now();
        let n = labels.len();
        let mut used = 0;
        let mut loss = HostLoss {
            loss_sum: 0.0,
            correct: 0,
            grad_logits: Vec::new(),
        };
        if n > 0 {
            if !self.passes.contains_key(&n) {
                self.prepare(&[n])?;
            }
            self.ensure_grads(n)?;
            used = self.forward(n, images)?;
        }
        // The global sample count, on the host while the GPU runs the forward pass.
        let mut count = [n as f64];
        self.collective.all_reduce_sum_f64(&mut count)?;
        let global = count[0];
        if n > 0 {
            let classes = self.spec.classes;
            let pass = self.passes.get_mut(&n).expect("prepared above");
            let log_probs = pass.log_probs.download().map_err(gpu_error)?;
            loss = cross_entropy_from_log_probs(
                &log_probs,
                labels,
                classes,
                Some(mean_gradient_scale(global)),
            );
            pass.grads
                .as_mut()
                .expect("ensured above")
                .d_logits
                .copy_from_host(&loss.grad_logits)
                .map_err(gpu_error)?;
            used = self.backward(n, used)?;
        } else {
            for grad in &mut self.params.grads {
                grad.copy_from_host(&vec![0.0; grad.len()])
                    .map_err(gpu_error)?;
            }
        }
        let comm = self
            .comm
            .as_ref()
            .ok_or_else(|| TrainError::Collective("the NCCL communicator was aborted".into()))?;
        for grad in &mut self.params.grads {
            comm.all_reduce_sum_f32(grad)?;
        }
        if global > 0.0 {
            let sgd = Sgd::new(SgdConfig {
                learning_rate: hyper.lr,
                momentum: hyper.momentum,
                weight_decay: hyper.weight_decay,
            })?;
            let Parameters {
                weights,
                grads,
                velocity,
            } = &mut self.params;
            for ((w, g), v) in weights
                .iter_mut()
                .zip(grads.iter())
                .zip(velocity.iter_mut())
            {
                sgd.step(&self.ops, w, g, v)?;
            }
            self.half_stale = true;
        }
        self.ops.synchronize()?;
        Ok(StepStats {
            loss_sum: loss.loss_sum,
            correct: loss.correct,
            samples: n,
            conv_ms: self.conv_ms(used)?,
            step_ms: started.elapsed().as_secs_f64() * 1e3,
        })
    }

    fn evaluate_inner(&mut self, images: &[f32], labels: &[u32]) -> Result<StepStats, TrainError> {
        self.spec.check_batch(images, labels)?;
        let started = Instant::now();
        let n = labels.len();
        if n == 0 {
            return Ok(StepStats::default());
        }
        if !self.passes.contains_key(&n) {
            self.prepare(&[n])?;
        }
        let used = self.forward(n, images)?;
        let log_probs = self.passes[&n].log_probs.download().map_err(gpu_error)?;
        let loss = cross_entropy_from_log_probs(&log_probs, labels, self.spec.classes, None);
        Ok(StepStats {
            loss_sum: loss.loss_sum,
            correct: loss.correct,
            samples: n,
            conv_ms: self.conv_ms(used)?,
            step_ms: started.elapsed().as_secs_f64() * 1e3,
        })
    }

    fn prepare_inner(&mut self, batch_sizes: &[usize]) -> Result<(), TrainError> {
        let mut missing: Vec<usize> = batch_sizes
            .iter()
            .copied()
            .filter(|&n| n > 0 && !self.passes.contains_key(&n))
            .collect();
        missing.sort_unstable();
        missing.dedup();
        if missing.is_empty() {
            return Ok(());
        }
        // A backend of this GPU for measuring; its buffers are freed when tuning is done.
        let mut backend = CudnnBackend::new(self.ops.ordinal())
            .map_err(|e| TrainError::Layer(TuneError::from(e).into()))?;
        for n in missing {
            let pass = self.build_pass(&mut backend, n)?;
            self.passes.insert(n, pass);
        }
        drop(backend);
        let needed = self
            .passes
            .values()
            .flat_map(|pass| &pass.blocks)
            .flat_map(|block| {
                [
                    Some(&block.forward),
                    block.backward_data.as_ref(),
                    Some(&block.backward_filter),
                ]
            })
            .flatten()
            .map(PreparedPlan::workspace_bytes)
            .max()
            .unwrap_or(0);
        if needed > self.workspace.bytes() {
            // Free the old one first: the two need not fit together.
            self.workspace = self.ops.cudnn().alloc_workspace(0).map_err(gpu_error)?;
            self.workspace = self
                .ops
                .cudnn()
                .alloc_workspace(needed)
                .map_err(gpu_error)?;
        }
        Ok(())
    }

    /// Runs `body`, remembering a failure (see [`Drop`]).
    fn guard<T>(
        &mut self,
        body: impl FnOnce(&mut Self) -> Result<T, TrainError>,
    ) -> Result<T, TrainError> {
        let result = body(self);
        if result.is_err() {
            self.failed = true;
        }
        result
    }
}

/// The fp16 copies of block `block`'s parameters and their conversions.
fn half_block(ops: &GpuOps, spec: &NetSpec, block: usize) -> Result<HalfBlock, TrainError> {
    let k = spec.block_channels[block];
    let c = spec.block_input_channels(block);
    let kernel = super::super::net::KERNEL;
    // A filter [k, c, r, s] as a tensor: NCHW strides are KCRS (NetSpec's order), NHWC
    // strides are KRSC (cuDNN's NHWC filter layout).
    let master = TensorShape::new([k, c, kernel, kernel], DType::Fp32, Layout::Nchw);
    let copy = TensorShape::new([k, c, kernel, kernel], DType::Fp16, Layout::Nhwc);
    let bias_master = TensorShape::vector(k, DType::Fp32);
    let bias_copy = TensorShape::vector(k, DType::Fp16);
    let alloc = |len: usize| {
        ops.cudnn()
            .alloc_zeroed(DType::Fp16, len)
            .map_err(gpu_error)
    };
    Ok(HalfBlock {
        weight: alloc(copy.elements())?,
        bias: alloc(k)?,
        d_weight: alloc(copy.elements())?,
        d_bias: alloc(k)?,
        weight_in: Transform::new(master, copy)?,
        weight_out: Transform::new(copy, master)?,
        bias_in: Transform::new(bias_master, bias_copy)?,
        bias_out: Transform::new(bias_copy, bias_master)?,
    })
}

impl<C: Collective> Replica for GpuReplica<C> {
    fn train_step(
        &mut self,
        images: &[f32],
        labels: &[u32],
        hyper: &Hyper,
    ) -> Result<StepStats, TrainError> {
        self.guard(|replica| replica.train_step_inner(images, labels, hyper))
    }

    fn evaluate(&mut self, images: &[f32], labels: &[u32]) -> Result<StepStats, TrainError> {
        self.guard(|replica| replica.evaluate_inner(images, labels))
    }

    /// The fp32 master weights, downloaded, in [`NetSpec::parameter_shapes`] order (conv
    /// weights KCRS whatever the precision).
    fn parameters(&self) -> Result<Vec<f32>, TrainError> {
        let mut flat = Vec::with_capacity(self.spec.parameter_count());
        for weights in &self.params.weights {
            flat.extend(weights.download().map_err(gpu_error)?);
        }
        Ok(flat)
    }

    fn prepare(&mut self, batch_sizes: &[usize]) -> Result<(), TrainError> {
        self.guard(|replica| replica.prepare_inner(batch_sizes))
    }

    fn conv_plans(&self, batch: usize) -> Vec<Plan> {
        self.passes
            .get(&batch)
            .map(|pass| pass.plans.clone())
            .unwrap_or_default()
    }
}

impl<C: Collective> Drop for GpuReplica<C> {
    fn drop(&mut self) {
        // After a failure a peer may be gone or stuck: tear NCCL down without waiting for it.
        if self.failed {
            if let Some(comm) = self.comm.take() {
                comm.abort();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::ops::softmax_cross_entropy;

    #[test]
    fn host_loss_matches_the_cpu_replica_and_scales_the_gradient() {
        let classes = 4;
        let logits = [
            0.5f32, -1.0, 2.0, 0.0, 3.0, 3.0, -2.0, 1.0, -0.5, 0.25, 0.0, 0.125,
        ];
        let labels = [2u32, 0, 3];
        let log_probs: Vec<f32> = logits
            .chunks(classes)
            .flat_map(|row| {
                let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
                let sum: f64 = row.iter().map(|&z| (z as f64 - max).exp()).sum();
                row.iter()
                    .map(move |&z| (z as f64 - max - sum.ln()) as f32)
                    .collect::<Vec<_>>()
            })
            .collect();
        let (cpu_loss, cpu_correct, cpu_grad) = softmax_cross_entropy(&logits, &labels, classes);
        let host = cross_entropy_from_log_probs(&log_probs, &labels, classes, Some(1.0));
        assert!(
            (host.loss_sum - cpu_loss).abs() < 1e-6,
            "{host:?} vs {cpu_loss}"
        );
        // Row 1 ties classes 0 and 1: the first wins on both sides.
        assert_eq!(host.correct, cpu_correct);
        assert_eq!(host.correct, 2);
        for (a, b) in host.grad_logits.iter().zip(&cpu_grad) {
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        }
        let scaled = cross_entropy_from_log_probs(&log_probs, &labels, classes, Some(0.25));
        for (a, b) in scaled.grad_logits.iter().zip(&cpu_grad) {
            assert!((a - b / 4.0).abs() < 1e-7, "{a} vs {b}");
        }
        let none = cross_entropy_from_log_probs(&log_probs, &labels, classes, None);
        assert!(none.grad_logits.is_empty());
        assert_eq!(none.loss_sum, host.loss_sum);
    }

    /// The averaging convention: with the host scaling by 1 / global count before a sum over
    /// ranks, uneven and empty shards give the CPU replica's gradient (sum, then divide).
    #[test]
    fn scaling_before_the_sum_is_the_cpu_replicas_mean() {
        // Per-sample gradients of one parameter, dealt out unevenly: 3, 0 and 2 samples.
        let shards: [&[f64]; 3] = [&[0.5, -1.0, 2.0], &[], &[4.0, 0.25]];
        let global = shards.iter().map(|s| s.len()).sum::<usize>() as f64;
        let cpu: f64 = shards.iter().flat_map(|s| s.iter()).sum::<f64>() / global;
        let scale = mean_gradient_scale(global);
        let gpu: f64 = shards
            .iter()
            .map(|s| s.iter().map(|g| g * scale).sum::<f64>())
            .sum();
        assert!((cpu - gpu).abs() < 1e-12, "{cpu} vs {gpu}");
        assert_eq!(mean_gradient_scale(0.0), 0.0);
    }

    #[test]
    fn precision_names_problems_and_settings() {
        assert_eq!("FP16".parse::<Precision>(), Ok(Precision::Fp16));
        assert_eq!("fp32".parse::<Precision>(), Ok(Precision::Fp32));
        assert!("bf16"
            .parse::<Precision>()
            .unwrap_err()
            .contains("fp32 or fp16"));
        assert_eq!(Precision::Fp16.layout(), Layout::Nhwc);
        assert!(Precision::Fp16.describe(1024.0).contains("loss scale 1024"));
        let spec = NetSpec {
            in_channels: 3,
            image_size: 16,
            classes: 10,
            block_channels: vec![8, 16],
        };
        let mut settings = GpuSettings::new(
            Policy::PowerOfTwo,
            8 << 20,
            CacheChoice::Memory,
            Precision::Fp16,
        );
        settings.validate().unwrap();
        let problem = settings.problem(&spec, 1, 32);
        assert_eq!(
            (
                problem.n,
                problem.c,
                problem.h,
                problem.k,
                problem.r,
                problem.pad_h
            ),
            (32, 8, 8, 16, 3, 1)
        );
        assert_eq!((problem.dtype, problem.layout), (DType::Fp16, Layout::Nhwc));
        problem.validate().unwrap();
        assert_eq!(problem.output_hw(), (8, 8));
        for bad in [0.0, 3.0, 0.5, f32::INFINITY, 131072.0] {
            settings.loss_scale = bad;
            assert!(settings.validate().is_err(), "{bad}");
        }
    }
}
