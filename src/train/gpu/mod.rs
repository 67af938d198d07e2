//! Data-parallel training on GPUs: the building blocks (device ops for the layers around the
//! micro-batched convolutions, [`ops`]; NCCL collectives, [`nccl`]) and what is built from
//! them: the GPU replica ([`GpuReplica`], [`replica`]; its fp16 loss scaling, [`scaler`]) and
//! the job runner ([`GpuJob`], [`trainer`]) behind `mucudnn train --device cuda`. The loop's
//! host-side collective is [`crate::train::HostCollective`]; processes join through MPI
//! (`mpirun`/`srun`, feature `mpi`).
//!
//! # Layering
//!
//! ```text
//! cudarc::{cudnn, cublas, nccl}::sys   raw bindings, loaded at run time (dynamic-loading)
//!         |                             (panic when a library or symbol is missing)
//! ffi  (the training FFI wall)         the only code here naming those layers and the only
//!         |                             `unsafe`: gates, descriptors, handles, checked calls;
//!         |                             shares the convolution backend's gates and handle
//! ops, nccl                            safe layers: shapes, validation, host references
//! replica, trainer                     the replica and the job, from ops, nccl and the
//!                                      convolution plans (no unsafe)
//! scaler                               pure: the fp16 loss scale's decisions
//! ```
//!
//! CUDA, cuDNN, cuBLAS and NCCL are loaded when first needed: on a machine without them
//! every constructor returns an error ([`GpuTrainError::is_unavailable`]), never panics, and
//! everything that does not need a GPU (shape validation, host references, the loss scaler,
//! the host protocol of a step) runs and is tested anywhere.
//!
//! # One training step on one replica
//!
//! [`GpuReplica`] does this for a whole [`crate::train::NetSpec`] network (see its module for
//! the averaging and the fp16 details); by hand, with one conv layer, it looks like this.
//! Every replica (one thread per GPU, or one process per GPU) owns a [`GpuOps`] and an
//! [`NcclComm`] on the same stream, its layer objects, and its buffers (activations, fp32
//! parameters, gradients, velocities), all allocated on that stream. With one GPU:
//!
//! ```no_run
//! use mucudnn::train::gpu::*;
//! use mucudnn::solver::{DType, Layout};
//!
//! # fn main() -> Result<(), GpuTrainError> {
//! // One communicator per GPU of this process (ncclCommInitAll), each on its own stream.
//! let comm = NcclComm::init_all(&[0])?.remove(0).into_comm()?;
//! let ops = GpuOps::with_stream(comm.stream().clone())?;
//!
//! // Layers, built once: conv (a PreparedPlan per op, on ops.cudnn()) -> bias -> ReLU ->
//! // 2x2 max-pool -> linear -> softmax.
//! let conv_out = TensorShape::new([32, 16, 28, 28], DType::Fp32, Layout::Nchw);
//! let bias = Bias::new(conv_out)?;
//! let relu = Relu::new(conv_out)?;
//! let pool = MaxPool2d::two_by_two(conv_out)?;
//! let features = pool.output_shape().elements() / 32;
//! let linear = Linear::new(32, features, 10)?;
//! let softmax = Softmax::new(32, 10, DType::Fp32, SoftmaxKind::LogProbabilities)?;
//! let sgd = Sgd::new(SgdConfig { learning_rate: 0.01, momentum: 0.9, weight_decay: 5e-4 })?;
//!
//! let zeros = |n| ops.zeros_f32(n);
//! let (conv_b, mut conv_db, mut conv_vb) = (zeros(16)?, zeros(16)?, zeros(16)?);
//! let (mut w, mut dw, mut vw) = (zeros(linear.weight_len())?, zeros(linear.weight_len())?, zeros(linear.weight_len())?);
//! let (mut b, mut db, mut vb) = (zeros(10)?, zeros(10)?, zeros(10)?);
//! let mut y = zeros(conv_out.elements())?; // conv output (a PreparedPlan writes it)
//! let (mut a, mut p) = (zeros(conv_out.elements())?, zeros(pool.output_shape().elements())?);
//! let (mut logits, mut out) = (zeros(320)?, zeros(320)?);
//! let (mut dp, mut da, mut dy) = (zeros(p.len())?, zeros(a.len())?, zeros(y.len())?);
//! let labels = vec![0usize; 32];
//! // Every replica starts from rank 0's parameters.
//! comm.broadcast_f32(&mut w, 0)?;
//!
//! // Forward.
//! // conv_forward.execute(ops.cudnn(), 1.0, &x, &conv_w, 0.0, &mut y, &mut workspace)?;
//! bias.forward(&ops, &conv_b, &mut y)?;
//! relu.forward(&ops, &y, &mut a)?;
//! pool.forward(&ops, &a, &mut p)?;
//! linear.forward(&ops, &p, &w, &b, &mut logits)?;
//! softmax.forward(&ops, &logits, &mut out)?;
//! // Loss on the host (batch x classes values).
//! let ce = cross_entropy_host(SoftmaxKind::LogProbabilities, 10, &ops.download_f32(&out)?, &labels)?;
//! let dlogits = ops.upload_f32(&ce.grad_logits)?;
//!
//! // Backward.
//! linear.backward_weights(&ops, &p, &dlogits, &mut dw, &mut db, false)?;
//! linear.backward_data(&ops, &dlogits, &w, &mut dp)?;
//! pool.backward(&ops, &a, &p, &dp, &mut da)?;
//! relu.backward(&ops, &y, &a, &da, &mut dy)?;
//! bias.backward(&ops, &dy, &mut conv_db, false)?;
//! // conv_backward_filter.execute(ops.cudnn(), 1.0, &x, &dy, 0.0, &mut conv_dw, &mut workspace)?;
//!
//! // Average the gradients over the replicas, then update, all queued on the one stream.
//! for grad in [&mut dw, &mut db, &mut conv_db] {
//!     comm.all_reduce_mean_f32(grad)?;
//! }
//! sgd.step(&ops, &mut w, &dw, &mut vw)?;
//! sgd.step(&ops, &mut b, &db, &mut vb)?;
//! # let mut conv_b = conv_b;
//! sgd.step(&ops, &mut conv_b, &conv_db, &mut conv_vb)?;
//! # Ok(()) }
//! ```
//!
//! Several GPUs per process: one thread per GPU, each taking its communicator from
//! [`NcclComm::init_all`]. Several processes (MPI): NCCL ranks in process order
//! ([`crate::train::rank_layout`]), one [`NcclUniqueId`] made by process 0 and broadcast
//! ([`NcclUniqueId::share`]), then [`NcclComm::init_rank`] on each thread, whose stream the
//! thread's [`GpuOps`] then uses ([`GpuOps::with_stream`]).
//!
//! fp16 training: activations and conv weights in fp16 (`TensorShape::dtype`), fp32 master
//! weights and gradients; [`Transform`] converts fp16 gradients to fp32 before the all-reduce
//! and the updated fp32 weights to fp16 after the step.

mod error;
mod ffi;
pub mod nccl;
pub mod ops;
pub mod replica;
pub mod scaler;
mod slot;
pub mod trainer;

pub use error::GpuTrainError;
pub use ffi::{DeviceData, DeviceDataMut};
pub use nccl::{nccl_library, nccl_version, NcclComm, NcclUniqueId, NcclVersion, PendingComm};
pub use ops::{
    bias_add_host, bias_grad_host, cross_entropy_host, cublas_version, linear_backward_host,
    linear_forward_host, max_pool_backward_host, max_pool_forward_host, pool_output_dims,
    relu_backward_host, relu_forward_host, sgd_step_host, softmax_host, transform_host, Bias,
    CrossEntropy, GpuOps, Linear, LinearGrads, MaxPool2d, Relu, Sgd, SgdConfig, Softmax,
    SoftmaxKind, TensorShape, Transform,
};
pub use replica::{
    cross_entropy_from_log_probs, mean_gradient_scale, GpuReplica, GpuSettings, HostLoss,
    Precision, DEFAULT_LOSS_SCALE,
};
pub use scaler::{LossScaler, ScaleDecision};
pub use trainer::{select_gpus, visible_gpus, GpuJob};

/// `MUCUDNN_GPU_TESTS=1`: a GPU is present (see [`crate::backend::cudnn::GPU_TESTS_ENV`]).
pub use crate::backend::cudnn::GPU_TESTS_ENV;
