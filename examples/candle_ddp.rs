//! Data-parallel training of a small ResNet with candle, every convolution a
//! `mucudnn::candle::Conv2d` (docs/training.md).
//!
//!     cargo run --release --no-default-features --features candle --example candle_ddp
//!     mpirun -np 2 target/release/examples/candle_ddp --cache /tmp/ddp.sqlite  # --features candle,mpi
//!     mpirun -np 2 target/release/examples/candle_ddp --device cuda   # --features candle-cuda,mpi
//!
//! One process per rank (one per GPU with `--device cuda`), joined by MPI (feature `mpi`); or
//! one process computing `--local-ranks K` shards in turn, which gives the same bits as K
//! processes. Each step every rank takes its shard of the global batch, computes the gradient
//! of its summed cross-entropy, packs the gradients into one vector ([`grad_sum::pack`]) and
//! the ranks sum it, scaled by 1 / global batch: on the host in f64 in rank order
//! ([`ddp::sum_in_rank_order`], `--grad-sum host`, the CPU's), or with one NCCL all-reduce on
//! candle's CUDA stream (`mucudnn::candle::nccl`, `--grad-sum nccl`, the default with
//! `--device cuda`). Either way every rank gets the same bits and applies the same
//! SGD-with-momentum update, so the replicas stay bitwise identical (checked at the end:
//! every rank's parameter hash is gathered).
//!
//! Before the first step the ranks deal the layers' tuning out ([`ddp::deal`]): each measures
//! a share of what the caches lack, the measurements are shared, and every rank stores rank
//! 0's plans, which the layers then find on first sight of each shape.
//!
//! `--conv candle` runs the same model with candle's own `conv2d` (the GPU comparison).
//!
//! `--dtype bf16|f16` trains in mixed precision: the optimizer keeps f32 master weights, the
//! model's variables are a half copy (set from the masters after every update), the forward
//! and backward run in the half type and the loss in f32. f16 uses dynamic loss scaling (see
//! [`LossScaler`]), bf16 none. The gradients are summed as in f32 (on the host, in f64, in
//! rank order), unscaled in that sum.
//!
//! `MUCUDNN_TRAIN_FAIL_AT=RANK:STEP` makes that rank fail before that step (the MPI test's
//! hook); under MPI a failing rank prints its message and ends the job (`MPI_Abort`).

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Module, Tensor, Var, D};
use candle_nn::{Conv2dConfig, GroupNorm, Linear, Optimizer, VarBuilder, VarMap};
use mucudnn::backend::{Backend, CpuBackend, TimingSettings};
use mucudnn::cache::Cache;
use mucudnn::candle::ddp::{self, Collective, SingleProcess, TuningShare, TuningWork};
use mucudnn::candle::grad_sum::{self, GradSum};
use mucudnn::candle::{Conv2d, Conv2dOptions, SharedCache};
use mucudnn::tune::jobs_for;
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};
use std::f64::consts::PI;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

// ---------------------------------------------------------------------------------------------
// Settings

#[derive(Clone, Debug, Serialize)]
struct Settings {
    device: String,
    /// `mucudnn` (the default) or `candle`: whose convolutions the model runs.
    conv: String,
    /// `f32` (the default), `bf16` or `f16`: the type the model computes in.
    dtype: String,
    /// Samples per step over all ranks.
    batch: usize,
    train_size: usize,
    test_size: usize,
    image_size: usize,
    channels: usize,
    classes: usize,
    width: usize,
    noise: f32,
    lr: f64,
    momentum: f64,
    epochs: usize,
    seed: u64,
    local_ranks: usize,
    /// `host` or `nccl`: where the gradients are summed (resolved: [`GradSum::resolve`]).
    grad_sum: String,
    /// Seconds any wait on NCCL may take before the communicator is aborted.
    nccl_timeout: f64,
    #[serde(skip)]
    cache: Option<PathBuf>,
    #[serde(skip)]
    json: bool,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            device: "cpu".into(),
            conv: "mucudnn".into(),
            dtype: "f32".into(),
            batch: 32,
            train_size: 512,
            test_size: 256,
            image_size: 16,
            channels: 1,
            classes: 4,
            width: 8,
            noise: 0.1,
            lr: 0.05,
            momentum: 0.9,
            epochs: 3,
            seed: 1,
            local_ranks: 1,
            grad_sum: "host".into(),
            nccl_timeout: 120.0,
            cache: None,
            json: false,
        }
    }
}

const USAGE: &str = "candle_ddp [--device cpu|cuda] [--conv mucudnn|candle] [--dtype f32|bf16|f16]
  [--batch N] [--train-size N] [--test-size N]
  [--image-size N] [--channels N] [--classes N] [--width N] [--noise X] [--lr X]
  [--momentum X] [--epochs N] [--seed N] [--local-ranks K] [--grad-sum host|nccl]
  [--nccl-timeout SECONDS] [--cache FILE] [--json]
--grad-sum: nccl (an NCCL all-reduce on candle's CUDA stream) by default with --device cuda
  and one rank per process in a candle-cuda build, else host (f64 sums over MPI)";

fn parse_args(args: impl Iterator<Item = String>) -> Result<Settings, String> {
    fn number<T: std::str::FromStr>(flag: &str, value: Option<String>) -> Result<T, String> {
        let value = value.ok_or_else(|| format!("{flag} needs a value"))?;
        value
            .parse()
            .map_err(|_| format!("{flag}: cannot read {value:?}"))
    }
    let mut s = Settings::default();
    let mut grad_sum = None;
    let mut args = args.peekable();
    while let Some(flag) = args.next() {
        match flag.as_str() {
            "--device" => s.device = args.next().ok_or("--device needs cpu or cuda")?,
            "--conv" => s.conv = args.next().ok_or("--conv needs mucudnn or candle")?,
            "--dtype" => s.dtype = args.next().ok_or("--dtype needs f32, bf16 or f16")?,
            "--batch" => s.batch = number(&flag, args.next())?,
            "--train-size" => s.train_size = number(&flag, args.next())?,
            "--test-size" => s.test_size = number(&flag, args.next())?,
            "--image-size" => s.image_size = number(&flag, args.next())?,
            "--channels" => s.channels = number(&flag, args.next())?,
            "--classes" => s.classes = number(&flag, args.next())?,
            "--width" => s.width = number(&flag, args.next())?,
            "--noise" => s.noise = number(&flag, args.next())?,
            "--lr" => s.lr = number(&flag, args.next())?,
            "--momentum" => s.momentum = number(&flag, args.next())?,
            "--epochs" => s.epochs = number(&flag, args.next())?,
            "--seed" => s.seed = number(&flag, args.next())?,
            "--local-ranks" => s.local_ranks = number(&flag, args.next())?,
            "--grad-sum" => {
                grad_sum = Some(GradSum::parse(
                    &args.next().ok_or("--grad-sum needs host or nccl")?,
                )?)
            }
            "--nccl-timeout" => s.nccl_timeout = number(&flag, args.next())?,
            "--cache" => s.cache = Some(args.next().ok_or("--cache needs a file")?.into()),
            "--json" => s.json = true,
            "--help" | "-h" => return Err(USAGE.into()),
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    if !(2..=10).contains(&s.classes) {
        return Err(format!("--classes: 2 to 10, not {}", s.classes));
    }
    if s.image_size < 8 || s.channels == 0 || s.width < 4 || s.width % 4 != 0 {
        return Err("images are at least 8x8 with a channel; --width is a multiple of 4".into());
    }
    if !(s.noise.is_finite() && s.noise >= 0.0 && s.lr.is_finite() && s.lr > 0.0) {
        return Err("--noise >= 0 and --lr > 0".into());
    }
    if !(s.momentum.is_finite() && (0.0..1.0).contains(&s.momentum)) {
        return Err("--momentum is in [0, 1)".into());
    }
    if s.local_ranks == 0 || s.epochs == 0 {
        return Err("--local-ranks and --epochs are at least 1".into());
    }
    if s.conv != "mucudnn" && s.conv != "candle" {
        return Err(format!("--conv mucudnn or candle, not {:?}", s.conv));
    }
    if s.device != "cpu" && s.device != "cuda" {
        return Err(format!("--device cpu or cuda, not {:?}", s.device));
    }
    s.model_dtype()?;
    if !(s.nccl_timeout.is_finite() && s.nccl_timeout > 0.0) {
        return Err("--nccl-timeout > 0".into());
    }
    let nccl_built = cfg!(feature = "candle-cuda");
    s.grad_sum = GradSum::resolve(grad_sum, s.device == "cuda", nccl_built, s.local_ranks)?
        .name()
        .into();
    Ok(s)
}

impl Settings {
    /// The dtype the model computes in (`--dtype`).
    fn model_dtype(&self) -> Result<DType, String> {
        match self.dtype.as_str() {
            "f32" => Ok(DType::F32),
            "bf16" => Ok(DType::BF16),
            "f16" => Ok(DType::F16),
            other => Err(format!("--dtype f32, bf16 or f16, not {other:?}")),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Data: generated Gabor patches. Class k has orientation (k mod 5) * 36 degrees and one of two
// spatial frequencies; each image has a random phase, envelope, contrast, position jitter,
// per-channel gains and Gaussian noise. Sample i of a split is a pure function of (seed, split,
// i): the same on every rank and machine.

/// SplitMix64.
#[derive(Clone)]
struct Rng(u64);

impl Rng {
    fn derive(seed: u64, tags: &[u64]) -> Rng {
        let mut state = Rng(seed ^ 0x6a09_e667_f3bc_c908);
        for &tag in tags {
            let mixed = state.next_u64() ^ tag.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            state = Rng(mixed);
            state.next_u64();
        }
        state
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    fn uniform(&mut self, low: f64, high: f64) -> f64 {
        low + (high - low) * self.unit()
    }

    fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.unit();
        let u2 = self.unit();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = ((u128::from(self.next_u64()) * (i as u128 + 1)) >> 64) as usize;
            items.swap(i, j);
        }
    }
}

struct Dataset {
    images: Vec<f32>,
    labels: Vec<u32>,
    image_len: usize,
}

fn generate(s: &Settings, split: u64, len: usize) -> Dataset {
    let size = s.image_size;
    let image_len = s.channels * size * size;
    let mut images = vec![0f32; len * image_len];
    let mut labels = Vec::with_capacity(len);
    for (index, image) in images.chunks_exact_mut(image_len).enumerate() {
        let label = index % s.classes;
        labels.push(label as u32);
        let mut rng = Rng::derive(s.seed, &[split, index as u64]);
        let sz = size as f64;
        let orientation = (label % 5) as f64 * PI / 5.0 + rng.uniform(-PI / 36.0, PI / 36.0);
        let period = if label < 5 { sz / 4.0 } else { sz / 2.0 } * rng.uniform(0.9, 1.1);
        let phase = rng.uniform(0.0, 2.0 * PI);
        let sigma = sz / 4.0 * rng.uniform(0.8, 1.2);
        let jitter = sz / 8.0;
        let center_x = (sz - 1.0) / 2.0 + rng.uniform(-jitter, jitter);
        let center_y = (sz - 1.0) / 2.0 + rng.uniform(-jitter, jitter);
        let contrast = rng.uniform(0.6, 1.0);
        let gains: Vec<f64> = (0..s.channels).map(|_| rng.uniform(0.5, 1.0)).collect();
        let (sin, cos) = orientation.sin_cos();
        let frequency = 2.0 * PI / period;
        for y in 0..size {
            for x in 0..size {
                let dx = x as f64 - center_x;
                let dy = y as f64 - center_y;
                let envelope = (-(dx * dx + dy * dy) / (2.0 * sigma * sigma)).exp();
                let patch = contrast * envelope * (frequency * (dx * cos + dy * sin) + phase).cos();
                for (channel, gain) in gains.iter().enumerate() {
                    let noise = f64::from(s.noise) * rng.normal();
                    image[channel * size * size + y * size + x] = (gain * patch + noise) as f32;
                }
            }
        }
    }
    Dataset {
        images,
        labels,
        image_len,
    }
}

impl Dataset {
    fn batch(
        &self,
        indices: &[usize],
        s: &Settings,
        device: &Device,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let mut images = Vec::with_capacity(indices.len() * self.image_len);
        for &i in indices {
            images.extend_from_slice(&self.images[i * self.image_len..(i + 1) * self.image_len]);
        }
        let labels: Vec<u32> = indices.iter().map(|&i| self.labels[i]).collect();
        let n = indices.len();
        Ok((
            Tensor::from_vec(images, (n, s.channels, s.image_size, s.image_size), device)?,
            Tensor::from_vec(labels, n, device)?,
        ))
    }
}

/// How many samples rank `rank` takes of a global batch of `len`.
fn shard_len(len: usize, rank: usize, ranks: usize) -> usize {
    len * (rank + 1) / ranks - len * rank / ranks
}

/// Rank `rank`'s contiguous shard of a global batch (as even as can be; maybe empty).
fn shard<T>(batch: &[T], rank: usize, ranks: usize) -> &[T] {
    &batch[batch.len() * rank / ranks..batch.len() * (rank + 1) / ranks]
}

/// The training steps of an epoch: full global batches of a shuffled order (the rest is
/// dropped, so every step has `batch` samples).
fn epoch_order(s: &Settings, epoch: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..s.train_size).collect();
    Rng::derive(s.seed, &[3, epoch as u64]).shuffle(&mut order);
    order.truncate(s.train_size / s.batch * s.batch);
    order
}

/// A convolution: mucudnn's (tuned, from its plans) or, for comparison, candle's own.
enum Conv {
    Mucudnn(Conv2d),
    Candle(candle_nn::Conv2d),
}

impl Conv {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Conv::Mucudnn(conv) => conv.forward(x),
            Conv::Candle(conv) => conv.forward(x),
        }
    }
}

/// Makes the model's convolutions (both kinds load `weight` from the same `VarBuilder` path).
struct ConvMaker<'a> {
    candle: bool,
    cache: &'a SharedCache,
}

impl ConvMaker<'_> {
    fn make(
        &self,
        (c, k, cfg): (usize, usize, Conv2dConfig),
        name: &str,
        vb: &VarBuilder,
    ) -> candle_core::Result<Conv> {
        if self.candle {
            return candle_nn::conv2d_no_bias(c, k, 3, cfg, vb.pp(name)).map(Conv::Candle);
        }
        let options = Conv2dOptions::default()
            .with_cache(self.cache.clone())
            .with_name(name);
        mucudnn::candle::conv2d_no_bias(c, k, 3, cfg, options, vb.pp(name)).map(Conv::Mucudnn)
    }
}

// ---------------------------------------------------------------------------------------------
// The model: a ResNet in miniature. Stem conv, a residual block, a strided conv, a second
// residual block, global average pooling, a linear head; group norm (per sample: a rank's
// shard size does not change the normalisation), ReLU.

struct Residual {
    conv1: Conv,
    norm1: GroupNorm,
    conv2: Conv,
    norm2: GroupNorm,
}

impl Residual {
    fn new(
        width: usize,
        name: &str,
        convs: &ConvMaker,
        vb: &VarBuilder,
    ) -> candle_core::Result<Self> {
        let cfg = Conv2dConfig {
            padding: 1,
            ..Default::default()
        };
        let conv = |which: &str| convs.make((width, width, cfg), &format!("{name}.{which}"), vb);
        Ok(Residual {
            conv1: conv("conv1")?,
            norm1: candle_nn::group_norm(4, width, 1e-5, vb.pp(format!("{name}.norm1")))?,
            conv2: conv("conv2")?,
            norm2: candle_nn::group_norm(4, width, 1e-5, vb.pp(format!("{name}.norm2")))?,
        })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = self.norm1.forward(&self.conv1.forward(x)?)?.relu()?;
        let h = self.norm2.forward(&self.conv2.forward(&h)?)?;
        (h + x)?.relu()
    }
}

struct Net {
    stem: Conv,
    stem_norm: GroupNorm,
    block1: Residual,
    down: Conv,
    down_norm: GroupNorm,
    block2: Residual,
    head: Linear,
}

impl Net {
    fn new(s: &Settings, cache: &SharedCache, vb: VarBuilder) -> candle_core::Result<Self> {
        let convs = ConvMaker {
            candle: s.conv == "candle",
            cache,
        };
        let w = s.width;
        let same = Conv2dConfig {
            padding: 1,
            ..Default::default()
        };
        let strided = Conv2dConfig {
            padding: 1,
            stride: 2,
            ..Default::default()
        };
        Ok(Net {
            stem: convs.make((s.channels, w, same), "stem", &vb)?,
            stem_norm: candle_nn::group_norm(4, w, 1e-5, vb.pp("stem_norm"))?,
            block1: Residual::new(w, "block1", &convs, &vb)?,
            down: convs.make((w, 2 * w, strided), "down", &vb)?,
            down_norm: candle_nn::group_norm(4, 2 * w, 1e-5, vb.pp("down_norm"))?,
            block2: Residual::new(2 * w, "block2", &convs, &vb)?,
            head: candle_nn::linear(2 * w, s.classes, vb.pp("head"))?,
        })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = self.stem_norm.forward(&self.stem.forward(x)?)?.relu()?;
        let h = self.block1.forward(&h)?;
        let h = self.down_norm.forward(&self.down.forward(&h)?)?.relu()?;
        let h = self.block2.forward(&h)?;
        self.head.forward(&h.mean((2, 3))?)
    }

    /// Every mucudnn convolution with the input size it sees (none with candle's).
    fn convs(&self, s: &Settings) -> Vec<(&Conv2d, usize)> {
        let full = s.image_size;
        let half = full.div_ceil(2);
        [
            (&self.stem, full),
            (&self.block1.conv1, full),
            (&self.block1.conv2, full),
            (&self.down, full),
            (&self.block2.conv1, half),
            (&self.block2.conv2, half),
        ]
        .into_iter()
        .filter_map(|(conv, size)| match conv {
            Conv::Mucudnn(conv) => Some((conv, size)),
            Conv::Candle(_) => None,
        })
        .collect()
    }
}

/// The summed cross-entropy of a batch (in f32 whatever the logits' dtype), and how many it
/// classified right.
fn loss_and_correct(logits: &Tensor, labels: &Tensor) -> candle_core::Result<(Tensor, usize)> {
    let log_probs = candle_nn::ops::log_softmax(&logits.to_dtype(DType::F32)?, D::Minus1)?;
    let picked = log_probs.gather(&labels.unsqueeze(1)?, 1)?;
    let loss = picked.sum_all()?.neg()?;
    let predicted = logits.argmax(D::Minus1)?;
    let correct = predicted
        .eq(labels)?
        .to_dtype(DType::F32)?
        .sum_all()?
        .to_scalar::<f32>()? as usize;
    Ok((loss, correct))
}

// ---------------------------------------------------------------------------------------------
// SGD with momentum as PyTorch's (candle_nn's SGD has none): buf = momentum * buf + grad,
// param -= lr * buf; elementwise, so equal gradients give equal parameters on every rank.

struct SgdMomentum {
    vars: Vec<(Var, Option<Tensor>)>,
    lr: f64,
    momentum: f64,
}

impl Optimizer for SgdMomentum {
    type Config = (f64, f64);

    fn new(vars: Vec<Var>, (lr, momentum): (f64, f64)) -> candle_core::Result<Self> {
        let vars = vars
            .into_iter()
            .filter(|v| v.dtype().is_float())
            .map(|v| (v, None))
            .collect();
        Ok(SgdMomentum { vars, lr, momentum })
    }

    fn step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        for (var, buffer) in &mut self.vars {
            let Some(grad) = grads.get(var) else { continue };
            let next = match buffer.take() {
                Some(previous) => ((previous * self.momentum)? + grad)?,
                None => grad.clone(),
            };
            var.set(&var.sub(&(&next * self.lr)?)?)?;
            *buffer = Some(next);
        }
        Ok(())
    }

    fn learning_rate(&self) -> f64 {
        self.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.lr = lr;
    }
}

// ---------------------------------------------------------------------------------------------
// Dynamic loss scaling (f16): the loss is multiplied by `scale` before the backward pass, so
// that small gradients do not flush to zero in f16, and the summed gradient is divided by it.
// A step whose summed gradient has an inf or a NaN is skipped (no update, momentum untouched)
// and the scale halved; after `GROWTH_INTERVAL` good steps in a row it doubles. The decision
// is taken on the summed gradient, which every rank has bit for bit, so every rank skips the
// same steps and the replicas stay identical. The scale is a power of two, so scaling and
// unscaling are exact.

struct LossScaler {
    /// Whether the scale is dynamic (f16); else it stays 1 and every step is applied.
    dynamic: bool,
    scale: f64,
    good_steps: usize,
    skipped: usize,
}

impl LossScaler {
    /// The initial scale of f16 training (PyTorch's GradScaler's): 2^16.
    const INITIAL_SCALE: f64 = 65536.0;
    /// Good steps in a row before the scale doubles (PyTorch's default).
    const GROWTH_INTERVAL: usize = 2000;

    /// Dynamic scaling when `enabled` (f16), else a constant scale of 1 (f32, bf16).
    fn new(dynamic: bool) -> Self {
        LossScaler {
            dynamic,
            scale: if dynamic { Self::INITIAL_SCALE } else { 1.0 },
            good_steps: 0,
            skipped: 0,
        }
    }

    /// After the gradient sum: whether to apply this step (its gradient is finite), updating
    /// the scale. Without dynamic scaling every step is applied (as in f32), and the sum (on
    /// the GPU under NCCL) is not read.
    fn update(&mut self, summed: &Tensor) -> Result<bool, String> {
        if !self.dynamic {
            return Ok(true);
        }
        let summed = summed.to_vec1::<f32>().map_err(msg)?;
        Ok(if summed.iter().all(|g| g.is_finite()) {
            self.good_steps += 1;
            if self.good_steps == Self::GROWTH_INTERVAL {
                self.scale *= 2.0;
                self.good_steps = 0;
            }
            true
        } else {
            self.scale /= 2.0;
            self.good_steps = 0;
            self.skipped += 1;
            false
        })
    }
}

// ---------------------------------------------------------------------------------------------
// The job

/// The processes of the job: MPI's with feature `mpi`, else this one.
trait Job: Collective {
    /// Ends the job after a failure on this process (MPI: `MPI_Abort`).
    fn fail(&self, message: &str) -> !;
    /// An identity of `path` that ranks sharing the file have in common.
    fn cache_identity(&self, path: &std::path::Path) -> String;
    /// This process's device ordinal (its rank among its host's processes).
    fn local_device(&self) -> usize;
}

impl Job for SingleProcess {
    fn fail(&self, message: &str) -> ! {
        eprintln!("rank 0 failed: {message}");
        std::process::exit(1)
    }

    fn cache_identity(&self, path: &std::path::Path) -> String {
        path.display().to_string()
    }

    fn local_device(&self) -> usize {
        0
    }
}

#[cfg(feature = "mpi")]
impl Job for mucudnn::candle::mpi::Mpi {
    fn fail(&self, message: &str) -> ! {
        self.abort(message)
    }

    fn cache_identity(&self, path: &std::path::Path) -> String {
        let path = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
        format!("{}:{}", self.host_name(), path.display())
    }

    fn local_device(&self) -> usize {
        self.node_local().0
    }
}

#[derive(Debug, Serialize)]
struct EpochReport {
    epoch: usize,
    train_loss: f64,
    test_loss: f64,
    test_accuracy: f64,
    /// The epoch's wall time, evaluation included.
    seconds: f64,
    /// Training images per second over all ranks (the steps alone, evaluation excluded).
    images_per_s: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    settings: Settings,
    ranks: usize,
    processes: usize,
    initial_test_loss: f64,
    epochs: Vec<EpochReport>,
    /// Every step's training loss (mean over the global batch).
    step_losses: Vec<f64>,
    /// FNV-1a of the final parameters (the f32 master weights; every rank's, checked equal).
    parameters_fnv1a: String,
    /// The model's dtype (`--dtype`).
    dtype: String,
    /// f16: the loss scale at the end, and how many steps were skipped for inf/NaN gradients.
    loss_scale: f64,
    skipped_steps: usize,
    tuning: TuningShare,
}

fn failure(rank: usize) -> Result<Option<usize>, String> {
    let Ok(text) = std::env::var("MUCUDNN_TRAIN_FAIL_AT") else {
        return Ok(None);
    };
    let parsed = text
        .split_once(':')
        .and_then(|(r, s)| Some((r.trim().parse::<usize>().ok()?, s.trim().parse().ok()?)));
    match parsed {
        Some((r, step)) => Ok((r == rank).then_some(step)),
        None => Err(format!(
            "MUCUDNN_TRAIN_FAIL_AT={text:?}: expected RANK:STEP"
        )),
    }
}

/// The variables in name order, for broadcasting and hashing.
fn sorted_vars(varmap: &VarMap) -> Result<Vec<(String, Var)>, String> {
    let data = varmap
        .data()
        .lock()
        .map_err(|_| "the variable map is poisoned".to_string())?;
    let sorted: BTreeMap<String, Var> = data.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    Ok(sorted.into_iter().collect())
}

/// One process's NCCL communicator (feature `candle-cuda`), else nothing.
#[cfg(feature = "candle-cuda")]
type Nccl = mucudnn::candle::nccl::NcclGradSum;
#[cfg(not(feature = "candle-cuda"))]
type Nccl = std::convert::Infallible;

/// The communicator of `--grad-sum nccl` (every rank calls this at the same point).
#[cfg(feature = "candle-cuda")]
fn nccl_join(job: &mut dyn Job, s: &Settings, device: &Device) -> Result<Option<Nccl>, String> {
    match device {
        Device::Cuda(cuda) if s.grad_sum == GradSum::Nccl.name() => {
            let timeout = std::time::Duration::from_secs_f64(s.nccl_timeout);
            Nccl::new(job, cuda, timeout).map(Some).map_err(msg)
        }
        _ => Ok(None),
    }
}

#[cfg(not(feature = "candle-cuda"))]
fn nccl_join(_: &mut dyn Job, _: &Settings, _: &Device) -> Result<Option<Nccl>, String> {
    Ok(None)
}

/// The summed gradient vector, scaled, on `device`: NCCL's all-reduce, else the host sum of
/// the local ranks' vectors.
fn sum_gradients(
    job: &mut dyn Job,
    nccl: Option<&Nccl>,
    local: Vec<Tensor>,
    scale: f64,
    device: &Device,
) -> Result<Tensor, String> {
    #[cfg(feature = "candle-cuda")]
    if let Some(nccl) = nccl {
        let [mine] = <[Tensor; 1]>::try_from(local)
            .map_err(|_| "--grad-sum nccl takes one rank per process".to_string())?;
        return nccl.sum_scaled(&mine, scale).map_err(msg);
    }
    #[cfg(not(feature = "candle-cuda"))]
    let _ = nccl; // always None: there is no NCCL in this build
    let len = local.first().map_or(0, Tensor::elem_count);
    let parts = local
        .iter()
        .map(|t| t.to_vec1::<f32>())
        .collect::<candle_core::Result<Vec<_>>>()
        .map_err(msg)?;
    let summed = ddp::sum_in_rank_order(job, &parts, len, scale).map_err(msg)?;
    Tensor::from_vec(summed, len, device).map_err(msg)
}

fn flatten(tensors: &[Tensor]) -> candle_core::Result<Vec<f32>> {
    let mut flat = Vec::new();
    for t in tensors {
        flat.extend(t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?);
    }
    Ok(flat)
}

/// Sets every variable from a flat vector (in `vars` order), rounded to its dtype.
fn assign(vars: &[(String, Var)], flat: &[f32]) -> candle_core::Result<()> {
    let mut at = 0;
    for (_, var) in vars {
        let n = var.elem_count();
        let values = flat
            .get(at..at + n)
            .ok_or_else(|| candle_core::Error::Msg("a parameter vector is too short".into()))?;
        let values = Tensor::from_slice(values, var.shape(), var.device())?;
        var.set(&values.to_dtype(var.dtype())?)?;
        at += n;
    }
    Ok(())
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn msg(e: impl std::fmt::Display) -> String {
    e.to_string()
}

fn train(job: &mut dyn Job, s: &Settings) -> Result<Option<Report>, String> {
    let processes = job.size();
    let process = job.rank();
    let local = s.local_ranks;
    let ranks = processes * local;
    if s.batch < ranks {
        return Err(format!(
            "--batch {} is smaller than the {ranks} ranks",
            s.batch
        ));
    }
    if s.train_size < s.batch {
        return Err(format!(
            "--train-size {} is below one batch of {}",
            s.train_size, s.batch
        ));
    }
    let fail_at: Vec<Option<usize>> = (0..local)
        .map(|l| failure(process * local + l))
        .collect::<Result<_, _>>()?;
    let device = match s.device.as_str() {
        "cuda" => Device::new_cuda(job.local_device()).map_err(msg)?,
        _ => Device::Cpu,
    };

    // The tuning cache: a file (shared by the ranks naming it on one host), else in memory.
    let cache = match &s.cache {
        Some(path) => Cache::open(path).map_err(msg)?,
        None => Cache::in_memory(),
    };
    let cache: SharedCache = Arc::new(Mutex::new(cache));

    // Same weights everywhere: candle's initialisation, then rank 0's values broadcast. The
    // model's variables are in the model's dtype; with a half type the optimizer keeps f32
    // masters of them (below).
    let dtype = s.model_dtype()?;
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, dtype, &device);
    let net = Net::new(s, &cache, vb).map_err(msg)?;
    let vars = sorted_vars(&varmap)?;
    let tensors: Vec<Tensor> = vars.iter().map(|(_, v)| v.as_tensor().clone()).collect();
    let mut init = vec![0f32; tensors.iter().map(Tensor::elem_count).sum()];
    let mut rng = Rng::derive(s.seed, &[4]);
    {
        // A seeded start (rather than candle's thread-local generator), so that runs with
        // different process counts start alike: conv and linear weights uniform in
        // +-sqrt(3 / fan_in), norm weights 1, biases 0.
        let mut at = 0;
        for ((name, var), tensor) in vars.iter().zip(&tensors) {
            let n = tensor.elem_count();
            let dims = var.dims();
            let fan_in: usize = dims.iter().skip(1).product();
            let fill = if dims.len() >= 2 {
                let bound = (3.0 / fan_in.max(1) as f64).sqrt();
                (0..n).map(|_| rng.uniform(-bound, bound) as f32).collect()
            } else if name.ends_with("weight") {
                vec![1.0; n]
            } else {
                vec![0.0; n]
            };
            init[at..at + n].copy_from_slice(&fill);
            at += n;
        }
    }
    let from_rank0 = ddp::broadcast_bytes(job, &f32_bytes(&init), 0).map_err(msg)?;
    let init: Vec<f32> = from_rank0
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    assign(&vars, &init).map_err(msg)?;
    let parameter_count = init.len();
    // The f32 master weights the optimizer updates: the model's variables themselves in f32,
    // else f32 copies (of the broadcast values, not of their rounded half copy).
    let masters: Vec<Var> = if dtype == DType::F32 {
        vars.iter().map(|(_, v)| v.clone()).collect()
    } else {
        let mut at = 0;
        let mut masters = Vec::with_capacity(vars.len());
        for (_, var) in &vars {
            let n = var.elem_count();
            masters.push(Var::from_slice(&init[at..at + n], var.shape(), &device).map_err(msg)?);
            at += n;
        }
        masters
    };

    // Tuning dealt out over the processes: every per-rank batch size the run will use.
    let mut sizes = BTreeSet::new();
    for r in 0..ranks {
        sizes.insert(shard_len(s.batch, r, ranks));
        for start in (0..s.test_size).step_by(s.batch) {
            let end = (start + s.batch).min(s.test_size);
            sizes.insert(shard_len(end - start, r, ranks));
        }
    }
    sizes.remove(&0);
    let mut layers = Vec::new();
    for &n in &sizes {
        for (conv, hw) in net.convs(s) {
            layers.push((
                conv.name().to_string(),
                conv.problem(n, hw, hw).map_err(msg)?,
            ));
        }
    }
    let timing = if device.is_cuda() {
        TimingSettings::GPU
    } else {
        TimingSettings::CPU
    };
    let tuning = Conv2dOptions::default().tuning(timing);
    let mut backend: Box<dyn Backend> = if device.is_cuda() {
        Box::new(mucudnn::backend::CudnnBackend::new(job.local_device()).map_err(msg)?)
    } else {
        Box::new(CpuBackend::new())
    };
    let share = {
        let guard = cache
            .lock()
            .map_err(|_| "the cache's mutex is poisoned".to_string())?;
        let mut work = TuningWork {
            backend: backend.as_mut(),
            cache: &guard,
            cache_identity: s.cache.as_deref().map(|p| job.cache_identity(p)),
            tuning,
            jobs: jobs_for(layers),
        };
        let mut share = ddp::deal(job, Ok(&mut work)).map_err(msg)?;
        ddp::share_plans(job, &mut share, &mut work).map_err(msg)?;
        share
    };
    drop(backend);

    let train_set = generate(s, 1, s.train_size);
    let test_set = generate(s, 2, s.test_size);
    let mut optimizer = SgdMomentum::new(masters.clone(), (s.lr, s.momentum)).map_err(msg)?;
    let grad_tensors: Vec<Tensor> = vars.iter().map(|(_, v)| v.as_tensor().clone()).collect();
    let master_tensors: Vec<Tensor> = masters.iter().map(|v| v.as_tensor().clone()).collect();
    let mut scaler = LossScaler::new(dtype == DType::F16);
    let nccl = nccl_join(job, s, &device)?;

    // Held-out loss and accuracy, each rank its shard of every test batch, summed over ranks.
    let evaluate = |job: &mut dyn Job| -> Result<(f64, f64), String> {
        let mut sums = [0f64; 2];
        for start in (0..s.test_size).step_by(s.batch) {
            let indices: Vec<usize> = (start..(start + s.batch).min(s.test_size)).collect();
            let mut mine = Vec::new();
            for l in 0..local {
                let part = shard(&indices, process * local + l, ranks);
                if part.is_empty() {
                    mine.push([0.0, 0.0]);
                    continue;
                }
                let (x, y) = test_set.batch(part, s, &device).map_err(msg)?;
                let x = x.to_dtype(dtype).map_err(msg)?;
                let (loss, correct) =
                    loss_and_correct(&net.forward(&x).map_err(msg)?, &y).map_err(msg)?;
                mine.push([
                    f64::from(loss.to_scalar::<f32>().map_err(msg)?),
                    correct as f64,
                ]);
            }
            for theirs in ddp::gather_results(job, Ok(mine)).map_err(msg)? {
                for pair in theirs {
                    sums[0] += pair[0];
                    sums[1] += pair[1];
                }
            }
        }
        let n = s.test_size.max(1) as f64;
        Ok((sums[0] / n, sums[1] / n))
    };

    let (initial_test_loss, initial_accuracy) = evaluate(job)?;
    let print = process == 0;
    if print {
        eprintln!(
            "{ranks} ranks ({processes} processes), {parameter_count} parameters, {}, gradients \
             summed on the {}; before training: test loss {initial_test_loss:.4}, accuracy {:.1}%",
            s.dtype,
            if s.grad_sum == "nccl" {
                "GPU (NCCL)"
            } else {
                "host"
            },
            100.0 * initial_accuracy
        );
    }
    let mut epochs = Vec::new();
    let mut step_losses = Vec::new();
    let mut step = 0usize;
    for epoch in 1..=s.epochs {
        let started = Instant::now();
        let order = epoch_order(s, epoch);
        let mut loss_sum = 0f64;
        let mut step_seconds = 0f64;
        for batch in order.chunks(s.batch) {
            let step_started = Instant::now();
            step += 1;
            let mut grads_local = Vec::with_capacity(local);
            let mut losses = Vec::with_capacity(local);
            let mut store: Option<GradStore> = None;
            for (l, fail) in fail_at.iter().enumerate() {
                if *fail == Some(step) {
                    let rank = process * local + l;
                    let which = if local > 1 {
                        format!(" (rank {rank})")
                    } else {
                        String::new()
                    };
                    return Err(format!("injected failure before step {step}{which}"));
                }
                let part = shard(batch, process * local + l, ranks);
                let (x, y) = train_set.batch(part, s, &device).map_err(msg)?;
                let x = x.to_dtype(dtype).map_err(msg)?;
                let (loss, _) =
                    loss_and_correct(&net.forward(&x).map_err(msg)?, &y).map_err(msg)?;
                let grads = if scaler.scale == 1.0 {
                    loss.backward()
                } else {
                    (&loss * scaler.scale).and_then(|scaled| scaled.backward())
                }
                .map_err(msg)?;
                grads_local.push(grad_sum::pack(&grad_tensors, |t| grads.get(t)).map_err(msg)?);
                losses.push(f64::from(loss.to_scalar::<f32>().map_err(msg)?));
                store = Some(grads);
            }
            let scale = 1.0 / batch.len() as f64;
            // The mean gradient, unscaled in the same sum (the loss scale is a power of two).
            let summed = sum_gradients(
                job,
                nccl.as_ref(),
                grads_local,
                scale / scaler.scale,
                &device,
            )?;
            let step_loss: f64 = ddp::gather_results(job, Ok(losses))
                .map_err(msg)?
                .into_iter()
                .flatten()
                .sum::<f64>()
                * scale;
            let mut store = store.ok_or("a rank had no samples")?;
            if scaler.update(&summed)? {
                // The summed gradient is f32 and goes to the f32 masters; a half model's
                // variables are then set to the masters rounded to its dtype.
                let parts = grad_sum::unpack(&summed, &master_tensors).map_err(msg)?;
                for (t, g) in master_tensors.iter().zip(parts) {
                    store.insert(t, g);
                }
                optimizer.step(&store).map_err(msg)?;
                if dtype != DType::F32 {
                    for ((_, var), master) in vars.iter().zip(&masters) {
                        var.set(&master.to_dtype(dtype).map_err(msg)?)
                            .map_err(msg)?;
                    }
                }
            }
            device.synchronize().map_err(msg)?;
            step_seconds += step_started.elapsed().as_secs_f64();
            loss_sum += step_loss;
            step_losses.push(step_loss);
        }
        let steps = (order.len() / s.batch).max(1);
        let (test_loss, test_accuracy) = evaluate(job)?;
        let report = EpochReport {
            epoch,
            train_loss: loss_sum / steps as f64,
            test_loss,
            test_accuracy,
            seconds: started.elapsed().as_secs_f64(),
            images_per_s: order.len() as f64 / step_seconds.max(1e-9),
        };
        if print {
            eprintln!(
                "epoch {epoch}: train loss {:.4}, test loss {:.4}, held-out accuracy {:.1}% \
                 (chance {:.1}%), {:.0} images/s, {:.1} s",
                report.train_loss,
                report.test_loss,
                100.0 * report.test_accuracy,
                100.0 / s.classes as f64,
                report.images_per_s,
                report.seconds
            );
            if scaler.dynamic {
                eprintln!(
                    "  loss scale {}, {} steps skipped so far",
                    scaler.scale, scaler.skipped
                );
            }
        }
        epochs.push(report);
    }

    #[cfg(feature = "candle-cuda")]
    if let Some(nccl) = nccl {
        nccl.finish().map_err(msg)?;
    }
    #[cfg(not(feature = "candle-cuda"))]
    let _ = nccl;

    // The replicas must have stayed bitwise identical.
    let finals = flatten(&master_tensors).map_err(msg)?;
    let hash = ddp::fnv1a(&f32_bytes(&finals));
    let hashes: Vec<String> = ddp::gather_results(job, Ok(hash.clone())).map_err(msg)?;
    if hashes.iter().any(|h| *h != hash) {
        return Err(format!("the replicas' parameters differ: {hashes:?}"));
    }
    Ok(print.then(|| Report {
        settings: s.clone(),
        ranks,
        processes,
        initial_test_loss,
        epochs,
        step_losses,
        parameters_fnv1a: hash,
        dtype: s.dtype.clone(),
        loss_scale: scaler.scale,
        skipped_steps: scaler.skipped,
        tuning: share,
    }))
}

fn run(job: &mut dyn Job, settings: &Settings) {
    match train(job, settings) {
        Ok(Some(report)) if settings.json => match serde_json::to_string_pretty(&report) {
            Ok(json) => println!("{json}"),
            Err(e) => job.fail(&format!("cannot write the report: {e}")),
        },
        Ok(_) => {}
        Err(message) => job.fail(&message),
    }
}

fn main() {
    let settings = match parse_args(std::env::args().skip(1)) {
        Ok(settings) => settings,
        Err(message) => {
            eprintln!("{message}");
            std::process::exit(2)
        }
    };
    #[cfg(feature = "mpi")]
    {
        match mucudnn::candle::mpi::Mpi::init() {
            Ok(mut mpi) => run(&mut mpi, &settings),
            Err(e) => {
                eprintln!("{e}");
                std::process::exit(1)
            }
        }
    }
    #[cfg(not(feature = "mpi"))]
    run(&mut SingleProcess, &settings);
}
