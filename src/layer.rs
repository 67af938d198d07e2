//! The drop-in convolution layer: weights, an optional bias, `forward` and `backward`. The
//! first time it sees an input shape it tunes itself (profile -> solve, per-layer workspace
//! limit) and from then on only executes the stored plans.
//!
//! This layer works on host tensors with the CPU backend, so it runs anywhere. On a GPU the
//! same pieces are used directly: [`CudnnBackend`](crate::backend::CudnnBackend) with
//! [`LayerTuning`] to tune, and [`PreparedPlan`](crate::exec::cudnn::PreparedPlan) to execute
//! over device buffers. Its plans per input shape are kept by a [`HostPlans`], the in-process
//! tuner of every host layer.
//!
//! ```
//! use mucudnn::cache::Cache;
//! use mucudnn::layer::{Conv2d, Tensor};
//! use mucudnn::solver::Layout;
//!
//! # fn main() -> Result<(), mucudnn::layer::LayerError> {
//! // Without `with_cache`, the layer uses the user's cache file.
//! let mut conv = Conv2d::new("net.conv1", 3, 4, 3).with_padding(1).with_cache(Cache::in_memory());
//! let x = Tensor { dims: [2, 3, 8, 8], layout: Layout::Nchw, data: vec![0.5; 2 * 3 * 8 * 8] };
//! let y = conv.forward(&x)?; // tunes on first sight of this shape, then executes
//! assert_eq!(y.dims, [2, 4, 8, 8]);
//! let grads = conv.backward(&x, &y)?; // dx, dw, db with the tuned plans
//! assert_eq!(grads.input.dims, x.dims);
//! assert!(conv.plans(2, 8, 8).is_some());
//! # Ok(()) }
//! ```

use crate::backend::TimingSettings;
use crate::exec::{execute_cpu, ExecError};
use crate::local_tuner::HostPlans;
use crate::solver::{ConvOp, ConvProblem, Layout, Plan, ShapeError};
use crate::tune::{LayerTuning, TuneError};
use mucudnn_cache::Cache;

/// A 4-D host tensor. `dims` are logical `[n, c, h, w]` whatever the layout.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub dims: [usize; 4],
    pub layout: Layout,
    pub data: Vec<f32>,
}

impl Tensor {
    pub fn zeros(dims: [usize; 4], layout: Layout) -> Self {
        Tensor {
            dims,
            layout,
            data: vec![0.0; dims.iter().product()],
        }
    }

    /// Element index of logical `(n, c, h, w)`.
    pub fn index(&self, n: usize, c: usize, h: usize, w: usize) -> usize {
        let [_, cs, hs, ws] = self.dims;
        match self.layout {
            Layout::Nchw => ((n * cs + c) * hs + h) * ws + w,
            Layout::Nhwc => ((n * hs + h) * ws + w) * cs + c,
        }
    }
}

/// Gradients of a [`Conv2d::backward`] call.
#[derive(Clone, Debug, PartialEq)]
pub struct Gradients {
    pub input: Tensor,
    /// Same shape and layout as [`Conv2d::weight`].
    pub weight: Vec<f32>,
    pub bias: Option<Vec<f32>>,
}

/// Why a layer call failed.
#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    #[error("{layer}: {message}")]
    Input { layer: String, message: String },
    #[error("{layer}: {source}")]
    Shape { layer: String, source: ShapeError },
    #[error(transparent)]
    Tune(#[from] TuneError),
    #[error(transparent)]
    Exec(#[from] ExecError),
}

/// The f64 sum of `values`, with four independent accumulators so the adds overlap.
fn sum_f64(values: &[f32]) -> f64 {
    let mut lanes = [0.0f64; 4];
    let mut chunks = values.chunks_exact(4);
    for chunk in &mut chunks {
        for (lane, &v) in lanes.iter_mut().zip(chunk) {
            *lane += f64::from(v);
        }
    }
    let tail: f64 = chunks.remainder().iter().map(|&v| f64::from(v)).sum();
    (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]) + tail
}

/// A 2-D convolution layer (fp32), cross-correlation as in cuDNN and PyTorch. Its problems
/// are 2-D by construction (4-D tensors, no depth settings); 1-D is height 1. For a 3-D
/// convolution on the CPU, tune with [`LayerTuning`] and run the plans with
/// [`execute_cpu`], which take NCDHW / NDHWC problems.
pub struct Conv2d {
    name: String,
    /// The problem at batch 1 and height/width 1; the input shape fills those in.
    template: ConvProblem,
    /// Filters: `k x c/g x r x s` (NCHW) or `k x r x s x c/g` (NHWC).
    pub weight: Vec<f32>,
    pub bias: Option<Vec<f32>>,
    tuner: ShapeTuner,
}

/// How a [`Conv2d`] tunes, and what it has tuned.
struct ShapeTuner {
    tuning: LayerTuning,
    /// Opened on first tuning (the user's cache file) unless given with [`Conv2d::with_cache`].
    cache: Option<Cache>,
    /// The plans by input `(n, h, w)`, the backend they are measured with, their workspace.
    plans: HostPlans<(i64, i64, i64)>,
}

impl ShapeTuner {
    /// The plans of `problem` and their workspace, tuned on first sight of its shape.
    fn plans(
        &mut self,
        layer: &str,
        problem: &ConvProblem,
    ) -> Result<(&[Plan; 3], &mut [u8]), LayerError> {
        let ShapeTuner {
            tuning,
            cache,
            plans,
        } = self;
        let key = (problem.n, problem.h, problem.w);
        let (plans, workspace, _) = plans.get_or_tune(&key, |backend| {
            let cache = match cache {
                Some(cache) => cache,
                slot => slot.insert(Cache::open_default(None).map_err(TuneError::from)?),
            };
            tuning.tune_counted(backend, cache, layer, problem)
        })?;
        Ok((plans, workspace))
    }
}

impl Conv2d {
    /// A layer with `kernel x kernel` filters, stride 1, no padding, NCHW, a bias, and weights
    /// drawn uniformly from `±1/sqrt(fan_in)` (deterministic from the name).
    pub fn new(name: &str, in_channels: i64, out_channels: i64, kernel: i64) -> Self {
        let template =
            ConvProblem::new(1, in_channels, kernel, kernel, out_channels, kernel, kernel);
        let mut layer = Conv2d {
            name: name.to_string(),
            template,
            weight: Vec::new(),
            bias: Some(vec![0.0; out_channels.max(0) as usize]),
            tuner: ShapeTuner {
                tuning: LayerTuning::new(TimingSettings::CPU),
                cache: None,
                plans: HostPlans::new(),
            },
        };
        layer.reset_weights();
        layer
    }

    fn reset_weights(&mut self) {
        let t = &self.template;
        let fan_in = (t.c / t.groups.max(1)) * t.r * t.s;
        let len = (t.k * fan_in).max(0) as usize;
        let bound = 1.0 / (fan_in.max(1) as f32).sqrt();
        let seed = self.name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        });
        let values =
            crate::backend::cudnn::host::random_values(crate::solver::DType::Fp32, len, seed);
        self.weight = values.into_iter().map(|v| v * bound).collect();
        self.tuner.plans.clear();
    }

    pub fn with_stride(mut self, stride: i64) -> Self {
        (self.template.stride_h, self.template.stride_w) = (stride, stride);
        self.tuner.plans.clear();
        self
    }

    pub fn with_padding(mut self, padding: i64) -> Self {
        (self.template.pad_h, self.template.pad_w) = (padding, padding);
        self.tuner.plans.clear();
        self
    }

    pub fn with_dilation(mut self, dilation: i64) -> Self {
        (self.template.dilation_h, self.template.dilation_w) = (dilation, dilation);
        self.tuner.plans.clear();
        self
    }

    /// Grouped convolution (weights are re-drawn for the new shape).
    pub fn with_groups(mut self, groups: i64) -> Self {
        self.template.groups = groups;
        self.reset_weights();
        self
    }

    pub fn with_layout(mut self, layout: Layout) -> Self {
        self.template.layout = layout;
        self.tuner.plans.clear();
        self
    }

    pub fn without_bias(mut self) -> Self {
        self.bias = None;
        self
    }

    /// Tuning settings (policy, per-layer workspace limit, timing). Clears tuned plans.
    pub fn with_tuning(mut self, tuning: LayerTuning) -> Self {
        self.tuner.tuning = tuning;
        self.tuner.plans.clear();
        self
    }

    /// The tuning cache to read and fill (default: the user's cache file, see
    /// `mucudnn_cache::default_path`).
    pub fn with_cache(mut self, cache: Cache) -> Self {
        self.tuner.cache = Some(cache);
        self
    }

    /// Keeps the plans of at most `shapes` input shapes (default
    /// [`DEFAULT_CAPACITY`](crate::local_tuner::DEFAULT_CAPACITY)), the least recently used
    /// dropped first; a dropped shape seen again is prepared from the cache.
    pub fn with_max_shapes(mut self, shapes: std::num::NonZeroUsize) -> Self {
        self.tuner.plans.set_capacity(Some(shapes));
        self
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The plans tuned for an input of `n x h x w`, if that shape has been seen:
    /// `[forward, backward-data, backward-filter]`.
    pub fn plans(&self, n: i64, h: i64, w: i64) -> Option<&[Plan; 3]> {
        self.tuner.plans.get(&(n, h, w))
    }

    /// The problem this layer tunes for an input of `n x h x w` (unchecked).
    pub fn problem(&self, n: i64, h: i64, w: i64) -> ConvProblem {
        ConvProblem {
            n,
            h,
            w,
            ..self.template
        }
    }

    /// Its tuning settings.
    pub fn tuning(&self) -> &LayerTuning {
        &self.tuner.tuning
    }

    fn input_error(&self, message: String) -> LayerError {
        LayerError::Input {
            layer: self.name.clone(),
            message,
        }
    }

    /// The problem for input `x`, checked against the layer.
    fn problem_for(&self, x: &Tensor) -> Result<ConvProblem, LayerError> {
        let [n, c, h, w] = x.dims.map(|d| d as i64);
        if x.layout != self.template.layout {
            return Err(self.input_error(format!(
                "input is {}, the layer is {}",
                x.layout, self.template.layout
            )));
        }
        if c != self.template.c {
            return Err(self.input_error(format!(
                "input has {c} channels, the layer expects {}",
                self.template.c
            )));
        }
        if x.data.len() != x.dims.iter().product::<usize>() {
            return Err(self.input_error(format!(
                "input data has {} elements for dims {:?}",
                x.data.len(),
                x.dims
            )));
        }
        let expected_weights = (self.template.k
            * (self.template.c / self.template.groups.max(1))
            * self.template.r
            * self.template.s)
            .max(0);
        if self.weight.len() != expected_weights as usize {
            return Err(self.input_error(format!(
                "weight has {} elements, expected {expected_weights}",
                self.weight.len()
            )));
        }
        let problem = ConvProblem {
            n,
            h,
            w,
            ..self.template
        };
        problem.validate().map_err(|source| LayerError::Shape {
            layer: self.name.clone(),
            source,
        })?;
        Ok(problem)
    }

    fn output_tensor(problem: &ConvProblem) -> Tensor {
        let (p, q) = problem.output_hw();
        Tensor::zeros(
            [
                problem.n as usize,
                problem.k as usize,
                p as usize,
                q as usize,
            ],
            problem.layout,
        )
    }

    /// `y = conv(x, weight) + bias`.
    pub fn forward(&mut self, x: &Tensor) -> Result<Tensor, LayerError> {
        let problem = self.problem_for(x)?;
        let (plans, workspace) = self.tuner.plans(&self.name, &problem)?;
        let mut y = Self::output_tensor(&problem);
        execute_cpu(
            &plans[0],
            1.0,
            &x.data,
            &self.weight,
            0.0,
            &mut y.data,
            workspace,
        )?;
        if let Some(bias) = &self.bias {
            // One pass over contiguous data: a plane per channel (NCHW), channels innermost
            // (NHWC).
            let [_, k, p, q] = y.dims;
            if k > 0 && p * q > 0 {
                match y.layout {
                    Layout::Nchw => {
                        for (plane, values) in y.data.chunks_exact_mut(p * q).enumerate() {
                            let b = bias[plane % k];
                            values.iter_mut().for_each(|v| *v += b);
                        }
                    }
                    Layout::Nhwc => {
                        for pixel in y.data.chunks_exact_mut(k) {
                            pixel.iter_mut().zip(bias).for_each(|(v, &b)| *v += b);
                        }
                    }
                }
            }
        }
        Ok(y)
    }

    /// Gradients of the loss with respect to the input, the weights and the bias, given the
    /// input `x` of the forward pass and the output gradient `dy`.
    pub fn backward(&mut self, x: &Tensor, dy: &Tensor) -> Result<Gradients, LayerError> {
        let problem = self.problem_for(x)?;
        let expected = Self::output_tensor(&problem);
        if dy.dims != expected.dims
            || dy.layout != expected.layout
            || dy.data.len() != expected.data.len()
        {
            return Err(self.input_error(format!(
                "output gradient has dims {:?} ({}), expected {:?} ({})",
                dy.dims, dy.layout, expected.dims, expected.layout
            )));
        }
        let (plans, workspace) = self.tuner.plans(&self.name, &problem)?;
        let mut dx = Tensor::zeros(x.dims, x.layout);
        let mut dw = vec![0.0; self.weight.len()];
        execute_cpu(
            &plans[1],
            1.0,
            &self.weight,
            &dy.data,
            0.0,
            &mut dx.data,
            workspace,
        )?;
        execute_cpu(&plans[2], 1.0, &x.data, &dy.data, 0.0, &mut dw, workspace)?;
        let bias = self.bias.as_ref().map(|bias| {
            // Summed in f64 over contiguous data (see the forward's bias add).
            let [_, k, p, q] = dy.dims;
            let mut db = vec![0.0f64; bias.len()];
            if k > 0 && p * q > 0 {
                match dy.layout {
                    Layout::Nchw => {
                        for (plane, values) in dy.data.chunks_exact(p * q).enumerate() {
                            db[plane % k] += sum_f64(values);
                        }
                    }
                    Layout::Nhwc => {
                        for pixel in dy.data.chunks_exact(k) {
                            for (sum, &v) in db.iter_mut().zip(pixel) {
                                *sum += f64::from(v);
                            }
                        }
                    }
                }
            }
            db.into_iter().map(|v| v as f32).collect()
        });
        Ok(Gradients {
            input: dx,
            weight: dw,
            bias,
        })
    }

    /// The op each tuned plan is for, in the order [`Conv2d::plans`] returns them.
    pub const PLAN_OPS: [ConvOp; 3] = ConvOp::ALL;
}
