//! A small candle CNN whose convolutions are mucudnn's (feature `candle`): the model is written
//! as with candle_nn, except that `mucudnn::candle::conv2d` replaces `candle_nn::conv2d`.
//!
//!     cargo run --release --features candle --example candle_cnn
//!     cargo run --release --features candle-cuda --example candle_cnn -- --cuda
//!
//! Each layer tunes itself on its first input shape through the shared tuning cache (here a
//! file under the system's temporary folder, so a second run measures nothing) and then only
//! executes its plans. The task: tell whether an image's left half is brighter than its right.

use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{Conv2dConfig, Optimizer, VarBuilder, VarMap};
use mucudnn::cache::Cache;
use mucudnn::candle::{conv2d, Conv2d, Conv2dOptions, SharedCache};
use std::sync::{Arc, Mutex};

struct Net {
    conv1: Conv2d,
    conv2: Conv2d,
    conv3: Conv2d,
    head: candle_nn::Linear,
}

impl Net {
    fn new(vb: VarBuilder, cache: &SharedCache) -> candle_core::Result<Self> {
        let options = || Conv2dOptions::default().with_cache(cache.clone());
        let cfg = |padding, stride, groups| Conv2dConfig {
            padding,
            stride,
            groups,
            ..Default::default()
        };
        Ok(Net {
            conv1: conv2d(3, 16, 3, cfg(1, 1, 1), options(), vb.pp("conv1"))?,
            conv2: conv2d(16, 16, 3, cfg(1, 2, 4), options(), vb.pp("conv2"))?,
            conv3: conv2d(16, 8, 1, cfg(0, 1, 1), options(), vb.pp("conv3"))?,
            head: candle_nn::linear(8, 2, vb.pp("head"))?,
        })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = self.conv1.forward(x)?.relu()?;
        let h = self.conv2.forward(&h)?.relu()?;
        let h = self.conv3.forward(&h)?.relu()?;
        self.head.forward(&h.mean((2, 3))?)
    }
}

/// `n` images (3 x 16 x 16) and their labels: class 1 when the left half is brighter.
fn batch(n: usize, step: u64, device: &Device) -> candle_core::Result<(Tensor, Tensor)> {
    let mut state = step.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut noise = || {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    };
    let (c, h, w) = (3, 16, 16);
    let mut data = Vec::with_capacity(n * c * h * w);
    let mut labels = Vec::with_capacity(n);
    for i in 0..n {
        let class = (i % 2) as u32;
        labels.push(class);
        for _ in 0..c * h {
            for x in 0..w {
                let brighter = (x < w / 2) == (class == 1);
                data.push(noise() + if brighter { 0.5 } else { -0.5 });
            }
        }
    }
    Ok((
        Tensor::from_vec(data, (n, c, h, w), device)?,
        Tensor::from_vec(labels, n, device)?,
    ))
}

fn main() -> candle_core::Result<()> {
    let device = if std::env::args().any(|a| a == "--cuda") {
        Device::new_cuda(0)?
    } else {
        Device::Cpu
    };
    let cache_path = std::env::temp_dir().join("mucudnn-candle-example.sqlite");
    let cache: SharedCache = Arc::new(Mutex::new(
        Cache::open(&cache_path).map_err(|e| candle_core::Error::Msg(e.to_string()))?,
    ));
    let varmap = VarMap::new();
    let net = Net::new(
        VarBuilder::from_varmap(&varmap, DType::F32, &device),
        &cache,
    )?;
    let mut sgd = candle_nn::SGD::new(varmap.all_vars(), 0.1)?;
    for step in 0..40 {
        let (x, labels) = batch(32, step, &device)?;
        let logits = net.forward(&x)?;
        let loss = candle_nn::loss::cross_entropy(&logits, &labels)?;
        sgd.backward_step(&loss)?;
        if step % 10 == 0 || step == 39 {
            let accuracy = logits
                .argmax(D::Minus1)?
                .eq(&labels)?
                .to_dtype(DType::F32)?
                .mean_all()?
                .to_scalar::<f32>()?;
            println!(
                "step {step:2}: loss {:.4}, accuracy {accuracy:.2}",
                loss.to_scalar::<f32>()?
            );
        }
    }
    for layer in [&net.conv1, &net.conv2, &net.conv3] {
        for ((n, h, w), stats) in layer.tunings()? {
            let source = if stats.measured + stats.cached == 0 {
                "plans read from the cache".to_string()
            } else {
                format!(
                    "{} sizes measured, {} read from the cache",
                    stats.measured, stats.cached
                )
            };
            println!(
                "{}: input {n}x{h}x{w}: {source} ({})",
                layer.name(),
                cache_path.display()
            );
        }
    }
    Ok(())
}
