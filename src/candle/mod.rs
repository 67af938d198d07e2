//! mucudnn inside candle (feature `candle`): [`Conv2d`], [`Conv1d`] and [`ConvTranspose2d`],
//! drop-ins for candle_nn's layers of those names whose convolution is tuned by mucudnn and
//! run from its plans.
//!
//! A model swaps its convolutions by changing one call: [`conv2d`], [`conv1d`] and
//! [`conv_transpose2d`] (and their `_no_bias` forms) take the same arguments as candle_nn's
//! functions plus [`ConvOptions`], and load the same variables (`weight`, `bias`) from the
//! `VarBuilder`, so checkpoints and optimizers see the same model.
//!
//! Every layer is one 2-D convolution problem ([`ConvProblem`]) whose three ops run through
//! three candle `CustomOp2`s over 4-D operands: forward on `(x, weight)`, backward-data on
//! `(dy, weight)`, backward-filter on `(x, dy)`. On first sight of a problem's `(n, h, w)` a
//! layer tunes the three ops through the shared SQLite cache ([`LayerTuning`]) and keeps the
//! plans; later calls only execute them. [`Conv2d`] applies the forward op and its `bwd` the
//! other two. [`Conv1d`] is the problem with unit height: its `N x C x L` input and
//! `K x C/g x S` weight are viewed as `N x C x 1 x L` and `K x C/g x 1 x S` (reshapes of
//! contiguous tensors, no copies). [`ConvTranspose2d`] is the problem whose input is the
//! transposed layer's output (`layers.rs`): its forward applies the backward-data op with the
//! layer's input as `dy`, and that op's `bwd` gives the input gradient as the forward op on the
//! output gradient and the weight gradient as the backward-filter op with `x` and `dy`
//! swapped, so it shares plans and measurements with the convolution it transposes. The input
//! gradient of a convolution always has the input's shape: it is computed from the layer's
//! problem, not re-derived from the output's shape (candle's own conv2d backward gets the
//! width wrong when `W + 2p - dilation * (k - 1) - 1` is not a multiple of the stride).
//!
//! Devices: on candle's CPU device the plans run on mucudnn's CPU backend
//! ([`execute_cpu`]); with `candle-cuda`, on candle's CUDA device they run as cuDNN plans on
//! candle's stream over candle's buffers, with workspace allocated from candle's device
//! (`cuda.rs`), for all three layers alike.
//!
//! Dtypes: f32, f16 and bf16. A layer's dtype is its weight's (the bias must agree); its
//! problem has that dtype, so its plans and cache records are that dtype's, and the input (and
//! on the way back the output gradient) must have it too, else the op is an error naming the
//! layer. The CPU backend loads half elements as f32, accumulates in f32 and rounds once per
//! output (a backward-filter split into micro-batches sums their parts in f32 and rounds once);
//! cuDNN runs the half problems as tuned. Anything else is an error naming the layer. candle
//! has no 3-D convolution layer, so there is no `Conv3d` here.

/// The parts every layer type (fields `weight`, `bias`, `config`, `core`) shares: its `Debug`
/// and the accessors `weight`, `bias`, `config`, `options` and `name`.
macro_rules! layer_common {
    ($layer:ident, $config:ty) => {
        impl std::fmt::Debug for $layer {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($layer))
                    .field("name", &self.core.name)
                    .field("weight", &self.weight.shape())
                    .field("bias", &self.bias.as_ref().map(|b| b.shape().clone()))
                    .field("config", &self.config)
                    .field("options", &self.core.options)
                    .finish()
            }
        }

        impl $layer {
            pub fn weight(&self) -> &Tensor {
                &self.weight
            }

            pub fn bias(&self) -> Option<&Tensor> {
                self.bias.as_ref()
            }

            pub fn config(&self) -> &$config {
                &self.config
            }

            pub fn options(&self) -> &ConvOptions {
                &self.core.options
            }

            pub fn name(&self) -> &str {
                &self.core.name
            }
        }
    };
}

#[cfg(feature = "candle-cuda")]
mod cuda;
pub mod ddp;
#[cfg(feature = "candle-cuda")]
mod device;
pub mod grad_sum;
mod layers;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "candle-cuda")]
pub mod nccl;

use crate::backend::cpu::{self, Element};
use crate::backend::TimingSettings;
use crate::exec::execute_cpu;
use crate::local_tuner::HostPlans;
use crate::solver::{self, CandidateSet, ConvOp, ConvProblem, Plan, Policy};
use crate::tune::{CacheStats, EngineOptions, LayerTuning, SplitSetting};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Module, Shape, Tensor, WithDType};
use candle_nn::{Conv2dConfig, VarBuilder};
use mucudnn_cache::Cache;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

pub use layers::{
    conv1d, conv1d_no_bias, conv_transpose2d, conv_transpose2d_no_bias, Conv1d, ConvTranspose2d,
};

/// A tuning cache shared by layers (and threads): every layer of a model should use one.
pub type SharedCache = Arc<Mutex<Cache>>;

/// mucudnn's settings for a layer, beside candle's config ([`Conv2dConfig`],
/// `Conv1dConfig`, `ConvTranspose2dConfig`).
#[derive(Clone)]
pub struct ConvOptions {
    /// The layer's name in messages and in the cache's plan records; `None`: the
    /// `VarBuilder`'s prefix (e.g. `model.conv1`), else the layer kind (`conv2d`, `conv1d`,
    /// `conv_transpose2d`).
    pub name: Option<String>,
    /// The workspace a plan may use (per layer: micro-batches share one buffer).
    pub workspace_limit_bytes: u64,
    /// Which micro-batch sizes a plan may use.
    pub policy: Policy,
    /// Which candidates are measured (legacy algorithms, engine configurations, both).
    pub candidates: CandidateSet,
    /// How engine configurations are searched on a GPU.
    pub engines: EngineOptions,
    /// Which dimension plans may split: the batch, the outermost spatial dimension, or `auto`
    /// (the default: spatial chunks at a batch of at most 4 under workspace pressure).
    pub split: SplitSetting,
    /// Compare every candidate's output with the reference candidate's while tuning and never
    /// plan one that computes wrong numbers (the default; see `tune::LayerTuning::verify`).
    pub verify: bool,
    /// The cache tuning reads and fills; `None`: the user's cache file
    /// (`mucudnn_cache::default_path`), opened once per process.
    pub cache: Option<SharedCache>,
}

/// The options' name from before there were other layers than [`Conv2d`].
pub type Conv2dOptions = ConvOptions;

impl Default for ConvOptions {
    fn default() -> Self {
        ConvOptions {
            name: None,
            workspace_limit_bytes: 64 << 20,
            policy: Policy::PowerOfTwo,
            candidates: CandidateSet::All,
            engines: EngineOptions::default(),
            split: SplitSetting::Auto,
            verify: true,
            cache: None,
        }
    }
}

impl std::fmt::Debug for ConvOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConvOptions")
            .field("name", &self.name)
            .field("workspace_limit_bytes", &self.workspace_limit_bytes)
            .field("policy", &self.policy)
            .field("candidates", &self.candidates)
            .field("engines", &self.engines)
            .field("split", &self.split)
            .field("verify", &self.verify)
            .field("cache", &self.cache.as_ref().map(|_| "shared"))
            .finish()
    }
}

impl ConvOptions {
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    pub fn with_workspace_limit(mut self, bytes: u64) -> Self {
        self.workspace_limit_bytes = bytes;
        self
    }

    pub fn with_policy(mut self, policy: Policy) -> Self {
        self.policy = policy;
        self
    }

    pub fn with_candidates(mut self, candidates: CandidateSet) -> Self {
        self.candidates = candidates;
        self
    }

    pub fn with_engines(mut self, engines: EngineOptions) -> Self {
        self.engines = engines;
        self
    }

    pub fn with_split(mut self, split: SplitSetting) -> Self {
        self.split = split;
        self
    }

    /// Whether tuning verifies candidates' outputs (`false` skips the comparison).
    pub fn with_verify(mut self, verify: bool) -> Self {
        self.verify = verify;
        self
    }

    /// Tune through `cache` (clone the `Arc` into every layer of a model).
    pub fn with_cache(mut self, cache: SharedCache) -> Self {
        self.cache = Some(cache);
        self
    }

    /// How the layer tunes, with `timing` (`TimingSettings::CPU` or `::GPU`).
    pub fn tuning(&self, timing: TimingSettings) -> LayerTuning {
        LayerTuning {
            policy: self.policy,
            workspace_limit_bytes: self.workspace_limit_bytes,
            candidates: self.candidates,
            engines: self.engines,
            split: self.split,
            verify: self.verify,
            ..LayerTuning::new(timing)
        }
    }
}

/// The user's cache file, opened once per process for layers given no cache.
fn default_cache() -> Result<SharedCache, String> {
    static DEFAULT: OnceLock<Result<SharedCache, String>> = OnceLock::new();
    DEFAULT
        .get_or_init(|| {
            Cache::open_default(None)
                .map(|cache| Arc::new(Mutex::new(cache)))
                .map_err(|e| e.to_string())
        })
        .clone()
}

/// Key of a tuned shape: the input's `(n, h, w)` (the rest is the layer's).
pub type ShapeKey = (i64, i64, i64);

/// Mutable state of a layer, behind its mutex: shared by the forward op and the two backward
/// ops of every call.
struct State {
    /// The host side: its measuring backend, plans per input shape, and their workspace.
    cpu: Option<HostPlans<ShapeKey>>,
    /// How each shape was tuned, in the order first seen: measurements read from the cache
    /// and measured (both 0 when the solved plans were cached); the last
    /// [`DEFAULT_CAPACITY`](crate::local_tuner::DEFAULT_CAPACITY) tunings, as many as the
    /// plans kept, so that ever new shapes do not grow it.
    tunings: Vec<(ShapeKey, CacheStats)>,
    #[cfg(feature = "candle-cuda")]
    cuda: Vec<cuda::DeviceState>,
}

/// Records in a layer's `tunings` that shape `key` was tuned with `stats`, forgetting the
/// oldest record past the bound.
fn record_tuning(tunings: &mut Vec<(ShapeKey, CacheStats)>, key: ShapeKey, stats: CacheStats) {
    tunings.push((key, stats));
    let excess = tunings
        .len()
        .saturating_sub(crate::local_tuner::DEFAULT_CAPACITY);
    tunings.drain(..excess);
}

/// Which candle layer a core serves: its kind in messages and its default name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LayerKind {
    Conv1d,
    Conv2d,
    ConvTranspose2d,
}

impl LayerKind {
    fn name(self) -> &'static str {
        match self {
            LayerKind::Conv1d => "conv1d",
            LayerKind::Conv2d => "conv2d",
            LayerKind::ConvTranspose2d => "conv_transpose2d",
        }
    }

    /// The name of a layer given `options`: theirs, else the kind's.
    fn layer_name(self, options: &ConvOptions) -> String {
        options
            .name
            .clone()
            .unwrap_or_else(|| self.name().to_string())
    }

    /// An error of the layer named `layer`: `mucudnn <kind> <layer>: <message>`.
    fn error(self, layer: &str, message: impl std::fmt::Display) -> candle_core::Error {
        candle_core::Error::Msg(format!("mucudnn {} {layer}: {message}", self.name()))
    }
}

/// The immutable part of a layer, and its state.
struct LayerCore {
    kind: LayerKind,
    name: String,
    /// The problem at n = h = w = 1; an input shape fills those in.
    template: ConvProblem,
    options: ConvOptions,
    state: Mutex<State>,
}

impl LayerCore {
    /// The core of a `kind` layer running the convolution `template` (n = h = w = 1), checked
    /// for everything but the spatial size (with an input just large enough for the filter).
    fn new(
        kind: LayerKind,
        template: ConvProblem,
        options: ConvOptions,
    ) -> candle_core::Result<Arc<Self>> {
        let name = kind.layer_name(&options);
        let reach = |filter: i64, dilation: i64| dilation * (filter - 1) + 1;
        ConvProblem {
            h: reach(template.r, template.dilation_h),
            w: reach(template.s, template.dilation_w),
            ..template
        }
        .validate()
        .map_err(|e| kind.error(&name, e))?;
        Ok(Arc::new(LayerCore {
            kind,
            name,
            template,
            options,
            state: Mutex::new(State {
                cpu: None,
                tunings: Vec::new(),
                #[cfg(feature = "candle-cuda")]
                cuda: Vec::new(),
            }),
        }))
    }

    fn error(&self, message: impl std::fmt::Display) -> candle_core::Error {
        self.kind.error(&self.name, message)
    }

    fn lock(&self) -> candle_core::Result<MutexGuard<'_, State>> {
        self.state
            .lock()
            .map_err(|_| self.error("the layer's state is poisoned (a call panicked)"))
    }

    fn cache(&self) -> candle_core::Result<SharedCache> {
        match &self.options.cache {
            Some(cache) => Ok(cache.clone()),
            None => default_cache().map_err(|e| self.error(format!("the tuning cache: {e}"))),
        }
    }

    /// The filter dims `(k, c / groups, r, s)`.
    fn weight_dims(&self) -> [usize; 4] {
        let t = &self.template;
        [t.k, t.c / t.groups.max(1), t.r, t.s].map(|d| d as usize)
    }

    /// The problem for an input of `dims`, checked against the layer.
    fn problem(&self, input: &[usize]) -> candle_core::Result<ConvProblem> {
        let &[n, c, h, w] = input else {
            return Err(self.error(format!(
                "the input must be 4-D (n, c, h, w), it has shape {input:?}"
            )));
        };
        if c as i64 != self.template.c {
            return Err(self.error(format!(
                "the input has {c} channels, the layer expects {}",
                self.template.c
            )));
        }
        let problem = ConvProblem {
            n: n as i64,
            h: h as i64,
            w: w as i64,
            ..self.template
        };
        problem.validate().map_err(|e| self.error(e))?;
        Ok(problem)
    }

    fn check_weight(&self, weight: &[usize]) -> candle_core::Result<()> {
        let expected = self.weight_dims();
        if weight != expected {
            return Err(self.error(format!(
                "the weight has shape {weight:?}, the layer expects {expected:?}"
            )));
        }
        Ok(())
    }

    fn check_output_grad(&self, problem: &ConvProblem, dy: &[usize]) -> candle_core::Result<()> {
        let expected = output_dims(problem);
        if dy != expected {
            return Err(self.error(format!(
                "the output gradient has shape {dy:?}, expected {expected:?}"
            )));
        }
        Ok(())
    }

    /// `op` of `problem` on the host: tunes the shape on first sight, then runs its plan.
    fn run_cpu<T: Element>(
        &self,
        problem: &ConvProblem,
        op: ConvOp,
        a: &[T],
        b: &[T],
    ) -> candle_core::Result<Vec<T>> {
        let mut state = self.lock()?;
        let state = &mut *state;
        let key = (problem.n, problem.h, problem.w);
        let State { cpu, tunings, .. } = state;
        let cpu = cpu.get_or_insert_with(HostPlans::new);
        let (plans, workspace, tuned) = cpu.get_or_tune(&key, |backend| {
            let cache = self.cache()?;
            let cache = cache
                .lock()
                .map_err(|_| self.error("the tuning cache's mutex is poisoned"))?;
            self.options
                .tuning(TimingSettings::CPU)
                .tune_counted(backend, &cache, &self.name, problem)
                .map_err(|e| self.error(e))
        })?;
        if let Some(stats) = tuned {
            record_tuning(tunings, key, stats);
        }
        let plan = &plans[op_index(op)];
        let out_len = cpu::buffer_lens(problem, op).map_err(|e| self.error(e))?[2].1;
        let mut out = vec![T::from_f32(0.0); out_len];
        execute_cpu(plan, 1.0, a, b, 0.0, &mut out, workspace).map_err(|e| self.error(e))?;
        Ok(out)
    }

    /// `op` of `problem` on the host over `a` and `b` (named `what` in errors), in the
    /// problem's dtype: both operands must have it.
    fn run_host(
        &self,
        problem: &ConvProblem,
        op: ConvOp,
        a: (&str, &CpuStorage, &Layout),
        b: (&str, &CpuStorage, &Layout),
    ) -> candle_core::Result<CpuStorage> {
        Ok(match problem.dtype {
            solver::DType::Fp32 => {
                CpuStorage::F32(self.run_cpu(problem, op, host(self, a)?, host(self, b)?)?)
            }
            solver::DType::Fp16 => {
                CpuStorage::F16(self.run_cpu(problem, op, host(self, a)?, host(self, b)?)?)
            }
            solver::DType::Bf16 => {
                CpuStorage::BF16(self.run_cpu(problem, op, host(self, a)?, host(self, b)?)?)
            }
        })
    }

    /// That an operand (`what`) of candle dtype `dtype` has the layer's dtype.
    fn check_dtype(&self, what: &str, dtype: DType) -> candle_core::Result<()> {
        let expected = candle_dtype(self.template.dtype);
        if dtype != expected {
            return Err(self.error(format!(
                "the {what} is {}, the layer's weight {}: input, weight and bias must have one \
                 dtype",
                dtype.as_str(),
                expected.as_str()
            )));
        }
        Ok(())
    }
}

fn op_index(op: ConvOp) -> usize {
    match op {
        ConvOp::Forward => 0,
        ConvOp::BackwardData => 1,
        ConvOp::BackwardFilter => 2,
    }
}

fn output_dims(problem: &ConvProblem) -> [usize; 4] {
    let (p, q) = problem.output_hw();
    [problem.n, problem.k, p, q].map(|d| d as usize)
}

/// The problem dtype of a candle dtype: f32, f16 and bf16; `None` for the rest.
fn problem_dtype(dtype: DType) -> Option<solver::DType> {
    match dtype {
        DType::F32 => Some(solver::DType::Fp32),
        DType::F16 => Some(solver::DType::Fp16),
        DType::BF16 => Some(solver::DType::Bf16),
        _ => None,
    }
}

/// The candle dtype of a problem dtype.
fn candle_dtype(dtype: solver::DType) -> DType {
    match dtype {
        solver::DType::Fp32 => DType::F32,
        solver::DType::Fp16 => DType::F16,
        solver::DType::Bf16 => DType::BF16,
    }
}

/// The `T` elements of a contiguous host tensor (`what` in errors), which must have the
/// layer's dtype.
fn host<'a, T: WithDType>(
    core: &LayerCore,
    (what, storage, layout): (&str, &'a CpuStorage, &Layout),
) -> candle_core::Result<&'a [T]> {
    core.check_dtype(what, storage.dtype())?;
    let data = storage.as_slice::<T>()?;
    // The layer makes its operands contiguous before applying its ops.
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or_else(|| core.error(format!("the {what} is not contiguous")))?;
    data.get(start..end)
        .ok_or_else(|| core.error(format!("the {what}'s layout exceeds its storage")))
}

/// The forward convolution, applied to `(x, weight)`.
struct ForwardOp {
    core: Arc<LayerCore>,
}

/// The input gradient, applied to `(dy, weight)`; the input's dims are given, not derived.
struct BackwardDataOp {
    core: Arc<LayerCore>,
    input: [usize; 4],
}

/// The weight gradient, applied to `(x, dy)`.
struct BackwardFilterOp {
    core: Arc<LayerCore>,
}

impl CustomOp2 for ForwardOp {
    fn name(&self) -> &'static str {
        "mucudnn-conv2d"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let core = &self.core;
        let problem = core.problem(l1.dims())?;
        core.check_weight(l2.dims())?;
        let y = core.run_host(
            &problem,
            ConvOp::Forward,
            ("input", s1, l1),
            ("weight", s2, l2),
        )?;
        Ok((y, Shape::from(output_dims(&problem).to_vec())))
    }

    #[cfg(feature = "candle-cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let core = &self.core;
        let problem = core.problem(l1.dims())?;
        core.check_weight(l2.dims())?;
        let out = cuda::run(core, &problem, ConvOp::Forward, (s1, l1), (s2, l2))?;
        Ok((out, Shape::from(output_dims(&problem).to_vec())))
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let core = &self.core;
        let (n, c, h, w) = x.dims4()?;
        let dy = operand(dy)?;
        let dx = dy.apply_op2_no_bwd(
            &operand(weight)?,
            &BackwardDataOp {
                core: core.clone(),
                input: [n, c, h, w],
            },
        )?;
        let dw = operand(x)?.apply_op2_no_bwd(&dy, &BackwardFilterOp { core: core.clone() })?;
        Ok((Some(dx), Some(dw)))
    }
}

impl CustomOp2 for BackwardDataOp {
    fn name(&self) -> &'static str {
        "mucudnn-conv2d-backward-data"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let core = &self.core;
        let problem = core.problem(&self.input)?;
        core.check_output_grad(&problem, l1.dims())?;
        core.check_weight(l2.dims())?;
        // The backward-data plan's operands are (weight, dy).
        let dx = core.run_host(
            &problem,
            ConvOp::BackwardData,
            ("weight", s2, l2),
            ("output gradient", s1, l1),
        )?;
        Ok((dx, Shape::from(self.input.to_vec())))
    }

    #[cfg(feature = "candle-cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let core = &self.core;
        let problem = core.problem(&self.input)?;
        core.check_output_grad(&problem, l1.dims())?;
        core.check_weight(l2.dims())?;
        let out = cuda::run(core, &problem, ConvOp::BackwardData, (s2, l2), (s1, l1))?;
        Ok((out, Shape::from(self.input.to_vec())))
    }

    /// Applied with gradients, this op is a transposed convolution's forward
    /// ([`ConvTranspose2d`]): the gradient wrt `dy` (the transposed layer's input) is the
    /// forward op on `grad`, and the gradient wrt `weight` the backward-filter op with `grad`
    /// as the input and `dy` as the output gradient.
    fn bwd(
        &self,
        dy: &Tensor,
        weight: &Tensor,
        _dx: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let core = &self.core;
        let grad = operand(grad)?;
        let d_dy = grad.apply_op2_no_bwd(&operand(weight)?, &ForwardOp { core: core.clone() })?;
        let d_weight =
            grad.apply_op2_no_bwd(&operand(dy)?, &BackwardFilterOp { core: core.clone() })?;
        Ok((Some(d_dy), Some(d_weight)))
    }
}

impl CustomOp2 for BackwardFilterOp {
    fn name(&self) -> &'static str {
        "mucudnn-conv2d-backward-filter"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let core = &self.core;
        let problem = core.problem(l1.dims())?;
        core.check_output_grad(&problem, l2.dims())?;
        let dw = core.run_host(
            &problem,
            ConvOp::BackwardFilter,
            ("input", s1, l1),
            ("output gradient", s2, l2),
        )?;
        Ok((dw, Shape::from(core.weight_dims().to_vec())))
    }

    #[cfg(feature = "candle-cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let core = &self.core;
        let problem = core.problem(l1.dims())?;
        core.check_output_grad(&problem, l2.dims())?;
        let out = cuda::run(core, &problem, ConvOp::BackwardFilter, (s1, l1), (s2, l2))?;
        Ok((out, Shape::from(core.weight_dims().to_vec())))
    }
}

/// A 2-D convolution layer run by mucudnn: a drop-in for `candle_nn::Conv2d` (same weights,
/// same `forward`), NCHW, in its weight's dtype (f32, f16 or bf16).
#[derive(Clone)]
pub struct Conv2d {
    weight: Tensor,
    bias: Option<Tensor>,
    config: Conv2dConfig,
    core: Arc<LayerCore>,
}

layer_common!(Conv2d, Conv2dConfig);

impl Conv2d {
    /// A layer over `weight` (`out x in/groups x kh x kw`; f32, f16 or bf16) and an optional
    /// `bias` (`out`, the weight's dtype), as `candle_nn::Conv2d::new`. `cfg.cudnn_fwd_algo`
    /// is ignored: mucudnn chooses.
    pub fn new(
        weight: Tensor,
        bias: Option<Tensor>,
        cfg: Conv2dConfig,
        options: ConvOptions,
    ) -> candle_core::Result<Self> {
        let kind = LayerKind::Conv2d;
        let name = kind.layer_name(&options);
        let (dims, dtype) = check_parameters(kind, &name, &weight, 4, bias.as_ref(), 0)?;
        let [k, c_per_group, r, s] = [dims[0], dims[1], dims[2], dims[3]].map(|d| d as i64);
        let [padding, stride, dilation, groups] =
            [cfg.padding, cfg.stride, cfg.dilation, cfg.groups].map(|v| v as i64);
        let mut template = ConvProblem::new(1, c_per_group * groups, 1, 1, k, r, s);
        template.dtype = dtype;
        (template.pad_h, template.pad_w) = (padding, padding);
        (template.stride_h, template.stride_w) = (stride, stride);
        (template.dilation_h, template.dilation_w) = (dilation, dilation);
        template.groups = groups;
        Ok(Conv2d {
            weight,
            bias,
            config: cfg,
            core: LayerCore::new(kind, template, options)?,
        })
    }

    /// The layer's convolution for an input of `n` images of `h x w` (what it tunes on
    /// first sight of that shape), checked.
    pub fn problem(&self, n: usize, h: usize, w: usize) -> candle_core::Result<ConvProblem> {
        let c = self.core.template.c as usize;
        self.core.problem(&[n, c, h, w])
    }

    /// The input shapes `(n, h, w)` tuned so far, in the order first seen, with where each
    /// one's measurements came from (cached or measured). A shape is tuned once per device.
    pub fn tunings(&self) -> candle_core::Result<Vec<(ShapeKey, CacheStats)>> {
        self.core.tunings()
    }

    /// The host plans `[forward, backward-data, backward-filter]` tuned for an input of
    /// `n x h x w`, if that shape has been seen on the CPU.
    pub fn cpu_plans(&self, n: i64, h: i64, w: i64) -> candle_core::Result<Option<[Plan; 3]>> {
        self.core.cpu_plans((n, h, w))
    }
}

impl LayerCore {
    /// The problem shapes `(n, h, w)` tuned so far, with where their measurements came from.
    fn tunings(&self) -> candle_core::Result<Vec<(ShapeKey, CacheStats)>> {
        Ok(self.lock()?.tunings.clone())
    }

    /// The host plans of the problem shape `key`, if it has been seen on the CPU.
    fn cpu_plans(&self, key: ShapeKey) -> candle_core::Result<Option<[Plan; 3]>> {
        let state = self.lock()?;
        Ok(state.cpu.as_ref().and_then(|cpu| cpu.get(&key).cloned()))
    }
}

/// The dims and dtype of a layer's `weight` (`rank`-D; f32, f16 or bf16), and its `bias`
/// checked (the weight's dtype, one value per weight dimension `bias_dim`'s entry), before the
/// layer exists.
fn check_parameters(
    kind: LayerKind,
    name: &str,
    weight: &Tensor,
    rank: usize,
    bias: Option<&Tensor>,
    bias_dim: usize,
) -> candle_core::Result<(Vec<usize>, solver::DType)> {
    let dims = weight.dims().to_vec();
    if dims.len() != rank {
        return Err(kind.error(
            name,
            format!("the weight must be {rank}-D, it is {:?}", weight.shape()),
        ));
    }
    let dtype = problem_dtype(weight.dtype()).ok_or_else(|| {
        kind.error(
            name,
            format!(
                "the weight is {}; only f32, f16 and bf16 are supported",
                weight.dtype().as_str()
            ),
        )
    })?;
    if let Some(bias) = bias {
        let len = dims[bias_dim];
        if bias.dims() != [len] || bias.dtype() != weight.dtype() {
            return Err(kind.error(
                name,
                format!(
                    "the bias is {} {:?}, expected {} [{len}] (the weight's dtype)",
                    bias.dtype().as_str(),
                    bias.dims(),
                    weight.dtype().as_str()
                ),
            ));
        }
    }
    Ok((dims, dtype))
}

/// The base alignment, in bytes, the GPU path asks of every operand, as the PyTorch path does
/// (`GPU_BASE_ALIGNMENT` in python/mucudnn/torch/_runtime.py): engine plans declare the
/// alignment of the micro-batch offsets they run at relative to an aligned base, and a view
/// into a tensor (`narrow`, `chunk`) may start anywhere in its storage.
const GPU_BASE_ALIGNMENT: usize = 256;

/// Whether an operand starting `start_offset` elements of `element_bytes` into its storage
/// must be copied to an aligned one first: on a GPU, when that offset breaks the alignment.
fn needs_aligned_copy(on_gpu: bool, start_offset: usize, element_bytes: usize) -> bool {
    on_gpu && (start_offset * element_bytes) % GPU_BASE_ALIGNMENT != 0
}

/// `t` as an op operand: contiguous and, on a GPU, starting at an aligned address (a fresh
/// copy, whose storage candle's allocator aligns, when the view's offset is not).
fn operand(t: &Tensor) -> candle_core::Result<Tensor> {
    let t = t.contiguous()?;
    let copy = needs_aligned_copy(
        t.device().is_cuda(),
        t.layout().start_offset(),
        t.dtype().size_in_bytes(),
    );
    if copy {
        t.force_contiguous()
    } else {
        Ok(t)
    }
}

impl Module for Conv2d {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.core.check_dtype("input", x.dtype())?;
        let y = operand(x)?.apply_op2(
            &operand(&self.weight)?,
            ForwardOp {
                core: self.core.clone(),
            },
        )?;
        match &self.bias {
            None => Ok(y),
            Some(bias) => {
                let k = bias.dims1()?;
                y.broadcast_add(&bias.reshape((1, k, 1, 1))?)
            }
        }
    }
}

/// The layer's name: the options', else the `VarBuilder`'s prefix, else the kind's.
fn named(kind: LayerKind, options: ConvOptions, vb: &VarBuilder) -> ConvOptions {
    if options.name.is_some() {
        return options;
    }
    let prefix = vb.prefix();
    let name = if prefix.is_empty() {
        kind.name().to_string()
    } else {
        prefix
    };
    options.with_name(name)
}

/// That `in_channels` and `out_channels` divide into `groups`, before loading a weight.
fn check_groups(
    kind: LayerKind,
    options: &ConvOptions,
    in_channels: usize,
    out_channels: usize,
    groups: usize,
) -> candle_core::Result<()> {
    if groups == 0 || in_channels % groups != 0 || out_channels % groups != 0 {
        return Err(kind.error(
            &kind.layer_name(options),
            format!(
                "{in_channels} input and {out_channels} output channels do not divide into \
                 {groups} groups"
            ),
        ));
    }
    Ok(())
}

/// candle_nn's bias of a convolution: `out` values uniform in `±1/sqrt(in)`.
fn load_conv_bias(
    in_channels: usize,
    out_channels: usize,
    vb: &VarBuilder,
) -> candle_core::Result<Tensor> {
    let bound = 1. / (in_channels as f64).sqrt();
    vb.get_with_hints(
        out_channels,
        "bias",
        candle_nn::Init::Uniform {
            lo: -bound,
            up: bound,
        },
    )
}

/// As `candle_nn::conv2d`: `weight` (`out x in/groups x k x k`, Kaiming-normal) and `bias`
/// (`out`, uniform in `±1/sqrt(in)`) from `vb`, the layer run by mucudnn.
pub fn conv2d(
    in_channels: usize,
    out_channels: usize,
    kernel_size: usize,
    cfg: Conv2dConfig,
    options: ConvOptions,
    vb: VarBuilder,
) -> candle_core::Result<Conv2d> {
    let options = named(LayerKind::Conv2d, options, &vb);
    let weight = load_weight(
        LayerKind::Conv2d,
        in_channels,
        out_channels,
        cfg.groups,
        &[kernel_size, kernel_size],
        &options,
        &vb,
    )?;
    let bias = load_conv_bias(in_channels, out_channels, &vb)?;
    Conv2d::new(weight, Some(bias), cfg, options)
}

/// As `candle_nn::conv2d_no_bias`: only `weight` from `vb`.
pub fn conv2d_no_bias(
    in_channels: usize,
    out_channels: usize,
    kernel_size: usize,
    cfg: Conv2dConfig,
    options: ConvOptions,
    vb: VarBuilder,
) -> candle_core::Result<Conv2d> {
    let options = named(LayerKind::Conv2d, options, &vb);
    let weight = load_weight(
        LayerKind::Conv2d,
        in_channels,
        out_channels,
        cfg.groups,
        &[kernel_size, kernel_size],
        &options,
        &vb,
    )?;
    Conv2d::new(weight, None, cfg, options)
}

/// A convolution's `weight` (`out x in/groups x kernel...`, Kaiming-normal) from `vb`, after
/// checking the channels against `groups`: candle_nn's loading for every rank.
fn load_weight(
    kind: LayerKind,
    in_channels: usize,
    out_channels: usize,
    groups: usize,
    kernel: &[usize],
    options: &ConvOptions,
    vb: &VarBuilder,
) -> candle_core::Result<Tensor> {
    check_groups(kind, options, in_channels, out_channels, groups)?;
    let mut dims = vec![out_channels, in_channels / groups];
    dims.extend_from_slice(kernel);
    vb.get_with_hints(dims, "weight", candle_nn::init::DEFAULT_KAIMING_NORMAL)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An operand viewed at an offset that breaks the GPU base alignment is
    /// copied first; aligned offsets and host tensors are not. The copy itself runs on a GPU.
    #[test]
    fn unaligned_gpu_views_are_copied() {
        assert!(!needs_aligned_copy(true, 0, 4));
        assert!(!needs_aligned_copy(true, 64, 4));
        assert!(needs_aligned_copy(true, 1, 4));
        assert!(needs_aligned_copy(true, 32, 4));
        assert!(!needs_aligned_copy(true, 128, 2));
        assert!(needs_aligned_copy(true, 64, 2));
        assert!(!needs_aligned_copy(false, 1, 4));
        // On the host an offset view is used in place (contiguous, same values).
        let whole = Tensor::arange(0f32, 8.0, &candle_core::Device::Cpu).unwrap();
        let view = whole.narrow(0, 1, 4).unwrap();
        let used = operand(&view).unwrap();
        assert_eq!(used.layout().start_offset(), 1);
        assert_eq!(used.to_vec1::<f32>().unwrap(), [1.0, 2.0, 3.0, 4.0]);
    }
}
