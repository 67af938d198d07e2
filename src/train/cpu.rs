//! The CPU replica: the network of a [`NetSpec`] on host tensors, its convolutions run by
//! mucudnn's drop-in [`Conv2d`] (tuned on first sight of each shape through the tuning cache
//! and executed as micro-batched plans on the CPU backend), the other layers by [`super::ops`].
//!
//! [`CpuNet`] is one network: forward and hand-written backward of the summed loss.
//! [`CpuReplica`] adds the rank's side of data parallelism: it all-reduces the gradients and
//! the sample count through a [`Collective`], divides, and applies [`Sgd`].

use super::ops::{
    linear, linear_backward, max_pool2x2, max_pool2x2_backward, relu, relu_backward,
    softmax_cross_entropy,
};
use super::{CacheChoice, Collective, Hyper, NetSpec, Replica, Sgd, StepStats, TrainError};
use crate::backend::TimingSettings;
use crate::exec::conv2d::{Conv2d, Tensor};
use crate::solver::{Layout, Plan, Policy};
use crate::tune::LayerTuning;
use std::time::Instant;

/// How the conv layers tune themselves, and where they keep it.
#[derive(Clone, Debug, PartialEq)]
pub struct ConvSettings {
    /// Policy (`Undivided` for the best single algorithm per layer), per-layer workspace
    /// limit, timing.
    pub tuning: LayerTuning,
    pub cache: CacheChoice,
}

impl ConvSettings {
    /// CPU timing settings with the given policy and per-layer workspace limit.
    pub fn new(policy: Policy, workspace_limit_bytes: u64, cache: CacheChoice) -> Self {
        ConvSettings {
            tuning: LayerTuning {
                policy,
                workspace_limit_bytes,
                timing: TimingSettings::CPU,
                candidates: crate::solver::CandidateSet::All,
                engines: crate::tune::EngineOptions::default(),
            },
            cache,
        }
    }
}

/// What one forward (and backward) pass over a batch gave.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Pass {
    /// Summed per-sample loss.
    pub loss_sum: f64,
    pub correct: usize,
    pub samples: usize,
    /// Time in the conv layers (tuning included if a shape was new).
    pub conv_ms: f64,
}

/// What a block keeps from the forward pass for the backward pass.
struct Saved {
    /// The conv's input.
    input: Tensor,
    /// The ReLU's output (the pool's input).
    activation: Tensor,
    argmax: Vec<u32>,
}

/// The network of a [`NetSpec`] on the host.
pub struct CpuNet {
    spec: NetSpec,
    convs: Vec<Conv2d>,
    linear_weight: Vec<f32>,
    linear_bias: Vec<f32>,
}

fn elapsed_ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

impl CpuNet {
    /// The network with `parameters` (as from [`NetSpec::init_parameters`]); every conv layer
    /// opens its own connection to `settings.cache`.
    pub fn new(
        spec: &NetSpec,
        parameters: &[Vec<f32>],
        settings: &ConvSettings,
    ) -> Result<Self, TrainError> {
        spec.validate()?;
        let shapes = spec.parameter_shapes();
        if parameters.len() != shapes.len() {
            return Err(TrainError::Config(format!(
                "the network has {} parameter tensors, {} were given",
                shapes.len(),
                parameters.len()
            )));
        }
        for (values, shape) in parameters.iter().zip(&shapes) {
            if values.len() != shape.len() {
                return Err(TrainError::Config(format!(
                    "{} has {} values, expected {} ({:?})",
                    shape.name,
                    values.len(),
                    shape.len(),
                    shape.dims
                )));
            }
        }
        let mut convs = Vec::with_capacity(spec.block_channels.len());
        for (index, &out) in spec.block_channels.iter().enumerate() {
            let mut conv = Conv2d::new(
                &format!("train.block{index}.conv"),
                spec.block_input_channels(index) as i64,
                out as i64,
                super::net::KERNEL as i64,
            )
            .with_padding(1)
            .with_layout(Layout::Nchw)
            .with_tuning(settings.tuning)
            .with_cache(settings.cache.open()?);
            conv.weight = parameters[2 * index].clone();
            conv.bias = Some(parameters[2 * index + 1].clone());
            convs.push(conv);
        }
        let blocks = convs.len();
        Ok(CpuNet {
            spec: spec.clone(),
            convs,
            linear_weight: parameters[2 * blocks].clone(),
            linear_bias: parameters[2 * blocks + 1].clone(),
        })
    }

    pub fn spec(&self) -> &NetSpec {
        &self.spec
    }

    /// The `[forward, backward-data, backward-filter]` plans block `block`'s conv uses for a
    /// per-rank batch of `n`, once tuned.
    pub fn plans(&self, block: usize, n: usize) -> Option<&[Plan; 3]> {
        let size = self.spec.block_input_size(block) as i64;
        self.convs.get(block)?.plans(n as i64, size, size)
    }

    /// All parameters, flattened in [`NetSpec::parameter_shapes`] order.
    pub fn parameters(&self) -> Vec<f32> {
        let mut flat = Vec::with_capacity(self.spec.parameter_count());
        for conv in &self.convs {
            flat.extend_from_slice(&conv.weight);
            flat.extend_from_slice(conv.bias.as_deref().unwrap_or_default());
        }
        flat.extend_from_slice(&self.linear_weight);
        flat.extend_from_slice(&self.linear_bias);
        flat
    }

    /// Replaces all parameters from a flat vector in [`NetSpec::parameter_shapes`] order.
    pub fn set_parameters(&mut self, flat: &[f32]) -> Result<(), TrainError> {
        let expected = self.spec.parameter_count();
        if flat.len() != expected {
            return Err(TrainError::Config(format!(
                "the network has {expected} parameters, {} were given",
                flat.len()
            )));
        }
        let mut rest = flat;
        let mut take = |len: usize| {
            let (head, tail) = rest.split_at(len);
            rest = tail;
            head
        };
        for conv in &mut self.convs {
            let weight_len = conv.weight.len();
            conv.weight.copy_from_slice(take(weight_len));
            if let Some(bias) = &mut conv.bias {
                let bias_len = bias.len();
                bias.copy_from_slice(take(bias_len));
            }
        }
        let weight_len = self.linear_weight.len();
        self.linear_weight.copy_from_slice(take(weight_len));
        let bias_len = self.linear_bias.len();
        self.linear_bias.copy_from_slice(take(bias_len));
        Ok(())
    }

    /// Tunes every conv layer for these per-rank batch sizes (one forward on zeros each; a
    /// layer tunes all three ops on first sight of a shape).
    pub fn prepare(&mut self, batch_sizes: &[usize]) -> Result<(), TrainError> {
        for &n in batch_sizes.iter().filter(|&&n| n > 0) {
            for (index, conv) in self.convs.iter_mut().enumerate() {
                let size = self.spec.block_input_size(index);
                let channels = self.spec.block_input_channels(index);
                conv.forward(&Tensor::zeros([n, channels, size, size], Layout::Nchw))?;
            }
        }
        Ok(())
    }

    /// Forward over a batch (NCHW images, one label each); with `gradients`, also the backward
    /// pass, writing the gradient of the *summed* loss into it (flattened in parameter order).
    pub fn forward_backward(
        &mut self,
        images: &[f32],
        labels: &[u32],
        gradients: Option<&mut [f32]>,
    ) -> Result<Pass, TrainError> {
        self.spec.check_batch(images, labels)?;
        if let Some(gradients) = &gradients {
            if gradients.len() != self.spec.parameter_count() {
                return Err(TrainError::Config(format!(
                    "gradient buffer of {} for {} parameters",
                    gradients.len(),
                    self.spec.parameter_count()
                )));
            }
        }
        let n = labels.len();
        if n == 0 {
            if let Some(gradients) = gradients {
                gradients.fill(0.0);
            }
            return Ok(Pass::default());
        }
        let want_gradients = gradients.is_some();
        let mut conv_ms = 0.0;
        let size = self.spec.image_size;
        let mut x = Tensor {
            dims: [n, self.spec.in_channels, size, size],
            layout: Layout::Nchw,
            data: images.to_vec(),
        };
        let mut saved = Vec::with_capacity(self.convs.len());
        for conv in &mut self.convs {
            let started = Instant::now();
            let mut y = conv.forward(&x)?;
            conv_ms += elapsed_ms(started);
            relu(&mut y.data);
            let (pooled, argmax) = max_pool2x2(&y.data, y.dims);
            let [_, k, h, w] = y.dims;
            let next = Tensor {
                dims: [n, k, h / 2, w / 2],
                layout: Layout::Nchw,
                data: pooled,
            };
            if want_gradients {
                saved.push(Saved {
                    input: x,
                    activation: y,
                    argmax,
                });
            }
            x = next;
        }
        let logits = linear(&x.data, &self.linear_weight, &self.linear_bias, n);
        let (loss_sum, correct, d_logits) =
            softmax_cross_entropy(&logits, labels, self.spec.classes);

        if let Some(gradients) = gradients {
            let (d_features, d_weight, d_bias) =
                linear_backward(&x.data, &self.linear_weight, &d_logits, n);
            let linear_start = gradients.len() - d_weight.len() - d_bias.len();
            gradients[linear_start..linear_start + d_weight.len()].copy_from_slice(&d_weight);
            gradients[linear_start + d_weight.len()..].copy_from_slice(&d_bias);
            // Offsets of each conv's weight in the flat vector (bias follows it).
            let mut offsets = Vec::with_capacity(self.convs.len());
            let mut offset = 0;
            for conv in &self.convs {
                offsets.push(offset);
                offset += conv.weight.len() + conv.bias.as_ref().map_or(0, Vec::len);
            }
            let mut d_out = d_features;
            for (index, block) in saved.into_iter().enumerate().rev() {
                let mut d_activation =
                    max_pool2x2_backward(&d_out, &block.argmax, block.activation.data.len());
                relu_backward(&block.activation.data, &mut d_activation);
                let dy = Tensor {
                    dims: block.activation.dims,
                    layout: Layout::Nchw,
                    data: d_activation,
                };
                let conv = &mut self.convs[index];
                let started = Instant::now();
                let grads = conv.backward(&block.input, &dy)?;
                conv_ms += elapsed_ms(started);
                let start = offsets[index];
                let weight_end = start + grads.weight.len();
                gradients[start..weight_end].copy_from_slice(&grads.weight);
                if let Some(d_bias) = &grads.bias {
                    gradients[weight_end..weight_end + d_bias.len()].copy_from_slice(d_bias);
                }
                d_out = grads.input.data;
            }
        }
        Ok(Pass {
            loss_sum,
            correct,
            samples: n,
            conv_ms,
        })
    }
}

/// One rank's CPU replica: a [`CpuNet`], its optimizer state, and its handle on the collective
/// the gradients are all-reduced through.
pub struct CpuReplica<C: Collective> {
    net: CpuNet,
    collective: C,
    sgd: Sgd,
    gradients: Vec<f32>,
}

impl<C: Collective> CpuReplica<C> {
    /// A replica initialised from `seed` ([`NetSpec::init_parameters`]), so every rank given
    /// the same seed starts identical.
    pub fn new(
        spec: &NetSpec,
        seed: u64,
        settings: &ConvSettings,
        collective: C,
    ) -> Result<Self, TrainError> {
        let net = CpuNet::new(spec, &spec.init_parameters(seed), settings)?;
        let count = spec.parameter_count();
        Ok(CpuReplica {
            net,
            collective,
            sgd: Sgd::new(count),
            gradients: vec![0.0; count],
        })
    }

    pub fn net(&self) -> &CpuNet {
        &self.net
    }

    pub fn collective(&self) -> &C {
        &self.collective
    }
}

impl<C: Collective> Replica for CpuReplica<C> {
    fn train_step(
        &mut self,
        images: &[f32],
        labels: &[u32],
        hyper: &Hyper,
    ) -> Result<StepStats, TrainError> {
        hyper.validate()?;
        let started = Instant::now();
        let pass = self
            .net
            .forward_backward(images, labels, Some(&mut self.gradients))?;
        // Sum the gradients of the summed losses and the sample counts over ranks, then divide:
        // the gradient of the mean loss over the global batch, the same bits on every rank.
        let mut count = [pass.samples as f64];
        self.collective.all_reduce_sum_f64(&mut count)?;
        self.collective.all_reduce_sum(&mut self.gradients)?;
        if count[0] > 0.0 {
            let global = count[0] as f32;
            for g in &mut self.gradients {
                *g /= global;
            }
            let mut parameters = self.net.parameters();
            self.sgd.step(&mut parameters, &self.gradients, hyper)?;
            self.net.set_parameters(&parameters)?;
        }
        Ok(StepStats {
            loss_sum: pass.loss_sum,
            correct: pass.correct,
            samples: pass.samples,
            conv_ms: pass.conv_ms,
            step_ms: elapsed_ms(started),
        })
    }

    fn evaluate(&mut self, images: &[f32], labels: &[u32]) -> Result<StepStats, TrainError> {
        let started = Instant::now();
        let pass = self.net.forward_backward(images, labels, None)?;
        Ok(StepStats {
            loss_sum: pass.loss_sum,
            correct: pass.correct,
            samples: pass.samples,
            conv_ms: pass.conv_ms,
            step_ms: elapsed_ms(started),
        })
    }

    fn parameters(&self) -> Result<Vec<f32>, TrainError> {
        Ok(self.net.parameters())
    }

    fn prepare(&mut self, batch_sizes: &[usize]) -> Result<(), TrainError> {
        self.net.prepare(batch_sizes)
    }

    fn conv_plans(&self, batch: usize) -> Vec<Plan> {
        (0..self.net.spec.block_channels.len())
            .filter_map(|block| self.net.plans(block, batch))
            .flat_map(|plans| plans.iter().cloned())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::ThreadCollective;

    fn settings() -> ConvSettings {
        ConvSettings::new(Policy::Undivided, 64 << 20, CacheChoice::Memory)
    }

    /// A net small enough to check every parameter by finite differences: 6x6 input with two
    /// channels, blocks of 3 and 4 channels (6 -> 3 -> 1), 3 classes.
    fn tiny() -> NetSpec {
        NetSpec {
            in_channels: 2,
            image_size: 6,
            classes: 3,
            block_channels: vec![3, 4],
        }
    }

    fn batch(spec: &NetSpec, n: usize, seed: u64) -> (Vec<f32>, Vec<u32>) {
        let mut rng = super::super::rng::Rng::new(seed);
        let len = n * spec.in_channels * spec.image_size * spec.image_size;
        let images = (0..len).map(|_| rng.uniform(-1.0, 1.0) as f32).collect();
        let labels = (0..n).map(|i| (i % spec.classes) as u32).collect();
        (images, labels)
    }

    #[test]
    fn backward_matches_finite_differences() {
        let spec = tiny();
        let mut parameters = spec.init_parameters(11);
        // Non-zero biases, so their gradients are exercised away from zero too.
        for (index, values) in parameters.iter_mut().enumerate() {
            if index % 2 == 1 {
                for (k, v) in values.iter_mut().enumerate() {
                    *v = 0.05 * (k as f32 + 1.0) * if k % 2 == 0 { 1.0 } else { -1.0 };
                }
            }
        }
        let mut net = CpuNet::new(&spec, &parameters, &settings()).unwrap();
        let (images, labels) = batch(&spec, 3, 5);
        let mut analytic = vec![0.0; spec.parameter_count()];
        let pass = net
            .forward_backward(&images, &labels, Some(&mut analytic))
            .unwrap();
        assert_eq!(pass.samples, 3);
        let base = net.parameters();
        // Small enough that no ReLU or pooling decision flips for this seed (1e-2 flips one),
        // large enough that f32 rounding of the loss stays well below the tolerance.
        let eps = 1e-3f32;
        let mut worst = (0.0f64, 0usize);
        for index in 0..base.len() {
            let loss_at = |net: &mut CpuNet, delta: f32| {
                let mut moved = base.clone();
                moved[index] += delta;
                net.set_parameters(&moved).unwrap();
                net.forward_backward(&images, &labels, None)
                    .unwrap()
                    .loss_sum
            };
            let numeric =
                (loss_at(&mut net, eps) - loss_at(&mut net, -eps)) / (2.0 * f64::from(eps));
            let error = (numeric - f64::from(analytic[index])).abs()
                / (1e-2 + numeric.abs().max(f64::from(analytic[index]).abs()));
            if error > worst.0 {
                worst = (error, index);
            }
        }
        let shapes = spec.parameter_shapes();
        assert!(
            worst.0 < 2e-2,
            "parameter {} (of {} in {:?}) differs by {:.3e} relative",
            worst.1,
            base.len(),
            shapes.iter().map(|s| &s.name).collect::<Vec<_>>(),
            worst.0
        );
        // The check is not vacuous: the gradient is far from zero everywhere it matters.
        assert!(analytic.iter().filter(|g| g.abs() > 1e-3).count() > base.len() / 2);
    }

    #[test]
    fn parameters_round_trip_and_bad_batches_are_errors() {
        let spec = tiny();
        let mut net = CpuNet::new(&spec, &spec.init_parameters(1), &settings()).unwrap();
        let flat = net.parameters();
        assert_eq!(flat.len(), spec.parameter_count());
        assert_eq!(flat, spec.init_parameters(1).concat());
        let doubled: Vec<f32> = flat.iter().map(|v| v * 2.0).collect();
        net.set_parameters(&doubled).unwrap();
        assert_eq!(net.parameters(), doubled);
        assert!(net.set_parameters(&flat[1..]).is_err());

        let (images, mut labels) = batch(&spec, 2, 1);
        assert!(matches!(
            net.forward_backward(&images[1..], &labels, None),
            Err(TrainError::Batch(_))
        ));
        labels[1] = 3;
        assert!(matches!(
            net.forward_backward(&images, &labels, None),
            Err(TrainError::Batch(m)) if m.contains("label 3")
        ));
        assert!(CpuNet::new(&spec, &spec.init_parameters(1)[1..], &settings()).is_err());
        let empty = net.forward_backward(&[], &[], None).unwrap();
        assert_eq!(empty, Pass::default());
    }

    #[test]
    fn one_step_on_one_rank_is_sgd_on_the_mean_gradient() {
        let spec = tiny();
        let hyper = Hyper {
            lr: 0.1,
            momentum: 0.9,
            weight_decay: 1e-3,
        };
        let (images, labels) = batch(&spec, 4, 2);
        let mut net = CpuNet::new(&spec, &spec.init_parameters(3), &settings()).unwrap();
        let mut gradient = vec![0.0; spec.parameter_count()];
        net.forward_backward(&images, &labels, Some(&mut gradient))
            .unwrap();
        let before = net.parameters();
        let expected: Vec<f32> = before
            .iter()
            .zip(&gradient)
            .map(|(w, g)| w - 0.1 * (g / 4.0 + 1e-3 * w))
            .collect();

        let collective = ThreadCollective::group(1).unwrap().remove(0);
        let mut replica = CpuReplica::new(&spec, 3, &settings(), collective).unwrap();
        let stats = replica.train_step(&images, &labels, &hyper).unwrap();
        assert_eq!(stats.samples, 4);
        assert!(stats.step_ms >= stats.conv_ms && stats.conv_ms > 0.0);
        let after = replica.parameters().unwrap();
        for (a, e) in after.iter().zip(&expected) {
            assert!((a - e).abs() <= 1e-6 * (1.0 + e.abs()), "{a} vs {e}");
        }
        assert!(replica.net().plans(0, 4).is_some());
        let plans = replica.conv_plans(4);
        assert_eq!(plans.len(), 6); // 2 layers x 3 ops
        assert!(plans.iter().all(|p| p.batch() == 4));
        assert!(replica.conv_plans(5).is_empty());
    }
}
