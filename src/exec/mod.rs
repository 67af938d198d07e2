//! Executing plans: run a [`Plan`]'s micro-batches one after another over the caller's
//! buffers, each with its own algorithm, on one workspace.
//!
//! A micro-batch is a contiguous slice of every batched tensor (the batch is the outermost
//! dimension in NCHW and NHWC, and in their 3-D and 1-D forms NCDHW / NDHWC / NCW / NWC), so
//! execution is pointer (or slice) offsets, never copies; a 3-D plan executes like a 2-D one.
//! Forward and backward-data write disjoint slices of their output, so every micro-batch uses
//! the caller's `beta`. Backward-filter sums over the batch into one filter gradient: the first
//! micro-batch uses the caller's `beta`, the later ones `beta = 1` (µ-cuDNN passed the caller's
//! beta to every micro-batch, which loses gradients when beta = 0). On the CPU a fp16/bf16
//! backward-filter split sums its micro-batches in fp32 instead and rounds `dw` once.
//!
//! That stepping ([`steps`](crate::solver::steps), with the operand roles, in the pure solver
//! crate so that the backends use it too) is shared by the CPU executor here and the cuDNN
//! executor in [`cudnn`]; the per-micro-batch loops allocate nothing and never synchronise
//! with the host.

pub mod cudnn;
pub mod spatial;
pub mod teardown;
pub mod verify;

use crate::backend::cpu::{self, CpuAlgo, CpuError, Element};
use crate::backend::ConvOperands;
use crate::solver::{operand_roles, steps, Algo, ConvOp, DType, IndexLimit, Plan, SplitDim};

/// Why a plan could not be executed.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error("invalid plan for {layer} {op}: {reason}")]
    InvalidPlan {
        layer: String,
        op: ConvOp,
        reason: String,
    },
    #[error("{layer} {op}: {source}")]
    Cpu {
        layer: String,
        op: ConvOp,
        source: CpuError,
    },
    #[error("{layer} {op}: {source}")]
    Cudnn {
        layer: String,
        op: ConvOp,
        source: crate::backend::cudnn::CudnnError,
    },
    /// cuDNN will not build one micro-batch's candidate here: an engine configuration at the
    /// byte alignment of the micro-batch's offset, or a legacy algorithm at its size
    /// (`CUDNN_STATUS_NOT_SUPPORTED*`). The plan cannot be prepared; the caller should run
    /// this convolution another way (the PyTorch package falls back to PyTorch's, with a
    /// warning). Measurements are taken where this cannot happen (see
    /// `solver::timing_offset`), so it means a plan from elsewhere (another cuDNN, another
    /// device, a hand-made plan) or a cuDNN that declines what it offered.
    #[error(
        "{layer} {op}: micro-batch {index} ({size} samples at sample {first}, {algo}) cannot \
         be prepared: {reason}"
    )]
    Unsupported {
        layer: String,
        op: ConvOp,
        /// The micro-batch's index in the plan.
        index: usize,
        size: i64,
        /// The sample it starts at (its offset).
        first: usize,
        algo: Algo,
        reason: String,
    },
}

/// Checks that a plan can be executed at all: a valid problem, positive sizes that add up to
/// the mini-batch (a batch plan) or to the op's extent along the split axis (a spatial plan).
pub fn check_plan(plan: &Plan) -> Result<(), ExecError> {
    let invalid = |reason: String| ExecError::InvalidPlan {
        layer: plan.layer.clone(),
        op: plan.op,
        reason,
    };
    plan.problem
        .validate()
        .map_err(|e| invalid(e.to_string()))?;
    if plan.micro_batches.is_empty() {
        return Err(invalid("no micro-batches".into()));
    }
    if let Some(mb) = plan.micro_batches.iter().find(|m| m.size < 1) {
        return Err(invalid(format!("micro-batch size {}", mb.size)));
    }
    let extent = plan.extent();
    if plan.batch() != extent {
        return Err(invalid(match plan.split {
            SplitDim::Batch => format!(
                "micro-batches add up to {}, not the mini-batch {}",
                plan.batch(),
                plan.problem.n
            ),
            SplitDim::Spatial => format!(
                "chunks add up to {} rows, not the {extent} rows along {}",
                plan.batch(),
                crate::solver::spatial::split_axis(&plan.problem)
            ),
        }));
    }
    // Every call within 32-bit indexing, as tuning makes plans: cuDNN cannot index more.
    let limit = IndexLimit::CUDNN;
    if let Some(mb) = plan
        .micro_batches
        .iter()
        .find(|mb| !limit.fits(&plan.problem, plan.op, plan.split, mb.size))
    {
        return Err(invalid(format!(
            "a {} of {} reaches more than the {limit} elements a call can index (32-bit \
             indexing); the tuner splits such a problem into sizes that fit",
            match plan.split {
                SplitDim::Batch => "micro-batch",
                SplitDim::Spatial => "chunk",
            },
            mb.size
        )));
    }
    Ok(())
}

/// [`check_plan`] for an executor that runs batch plans only (the cuDNN executors until they
/// run spatial chunks): a spatial plan is refused, naming its axis.
pub fn check_batch_plan(plan: &Plan) -> Result<(), ExecError> {
    if plan.split != SplitDim::Batch {
        return Err(ExecError::InvalidPlan {
            layer: plan.layer.clone(),
            op: plan.op,
            reason: format!(
                "it splits along {} (a spatial plan), which this executor does not run",
                crate::solver::spatial::split_axis(&plan.problem)
            ),
        });
    }
    check_plan(plan)
}

/// The workspace the CPU backend needs to run `plan`: the largest micro-batch's (or chunk's;
/// 0 for a plan that cannot run).
pub fn cpu_workspace_bytes(plan: &Plan) -> u64 {
    if plan.split == SplitDim::Spatial {
        return spatial_steps(plan)
            .ok()
            .and_then(|steps| {
                spatial::spatial_cpu_workspace_bytes(&plan.problem, plan.op, &steps).ok()
            })
            .unwrap_or(0);
    }
    steps(plan, 0.0)
        .filter_map(|s| {
            s.algo.legacy().and_then(CpuAlgo::from_id).map(|algo| {
                cpu::workspace_bytes(&plan.problem.with_batch(s.size as i64), plan.op, algo)
            })
        })
        .max()
        .unwrap_or(0)
}

/// A spatial plan's chunks as [`spatial::execute_spatial_cpu`] takes them (CPU algorithms).
fn spatial_steps(plan: &Plan) -> Result<Vec<spatial::SpatialStep>, ExecError> {
    plan.micro_batches
        .iter()
        .map(|mb| {
            let algo = mb.algo.legacy().and_then(CpuAlgo::from_id).ok_or_else(|| {
                ExecError::InvalidPlan {
                    layer: plan.layer.clone(),
                    op: plan.op,
                    reason: format!("algo {} is not a CPU algorithm", mb.algo),
                }
            })?;
            Ok(spatial::SpatialStep {
                size: mb.size,
                algo,
            })
        })
        .collect()
}

/// Runs `plan` on the CPU: `out = alpha * op(a, b) + beta * out` over the whole mini-batch,
/// micro-batch by micro-batch, or chunk by chunk along the split axis for a spatial plan
/// ([`spatial::execute_spatial_cpu`]). Buffers are as for [`cpu::run`] at the full batch;
/// `workspace` holds at least [`cpu_workspace_bytes`], 4-byte aligned.
pub fn execute_cpu<T: Element>(
    plan: &Plan,
    alpha: f32,
    a: &[T],
    b: &[T],
    beta: f32,
    out: &mut [T],
    workspace: &mut [u8],
) -> Result<(), ExecError> {
    check_plan(plan)?;
    if plan.split == SplitDim::Spatial {
        let steps = spatial_steps(plan)?;
        return spatial::execute_spatial_cpu(
            &plan.problem,
            plan.op,
            &steps,
            (alpha, beta),
            ConvOperands {
                a,
                b,
                out,
                workspace,
            },
        )
        .map_err(|e| match e {
            // Name the plan's layer, as the batch path does.
            ExecError::InvalidPlan { op, reason, .. } => ExecError::InvalidPlan {
                layer: plan.layer.clone(),
                op,
                reason,
            },
            ExecError::Cpu { op, source, .. } => ExecError::Cpu {
                layer: plan.layer.clone(),
                op,
                source,
            },
            other => other,
        });
    }
    let cpu_error = |source| ExecError::Cpu {
        layer: plan.layer.clone(),
        op: plan.op,
        source,
    };
    let expected = cpu::buffer_lens(&plan.problem, plan.op).map_err(cpu_error)?;
    for ((name, len), actual) in expected.into_iter().zip([a.len(), b.len(), out.len()]) {
        if len != actual {
            return Err(cpu_error(CpuError::BufferLength {
                buffer: name,
                expected: len,
                actual,
            }));
        }
    }
    // Everything that can fail is checked before the first micro-batch writes anything.
    let invalid = |reason: String| ExecError::InvalidPlan {
        layer: plan.layer.clone(),
        op: plan.op,
        reason,
    };
    if let Some(mb) = plan
        .micro_batches
        .iter()
        .find(|mb| mb.algo.legacy().and_then(CpuAlgo::from_id).is_none())
    {
        return Err(invalid(format!("algo {} is not a CPU algorithm", mb.algo)));
    }
    let needed = cpu_workspace_bytes(plan);
    if (workspace.len() as u64) < needed {
        return Err(cpu_error(CpuError::WorkspaceTooSmall {
            needed,
            provided: workspace.len() as u64,
        }));
    }
    let roles = operand_roles(plan.op);
    let per_sample = roles.map(|role| role.elements_per_sample(&plan.problem));
    // Half-precision backward-filter over several micro-batches: summed in fp32 ([`HalfSum`]).
    let mut half_sum = (plan.op == ConvOp::BackwardFilter && plan.micro_batches.len() > 1)
        .then(|| HalfSum::new(out, beta))
        .flatten();
    for step in steps(plan, beta) {
        let algo = step
            .algo
            .legacy()
            .and_then(CpuAlgo::from_id)
            .ok_or_else(|| invalid(format!("algo {}", step.algo)))?;
        let slice = |i: usize| {
            let (offset, len) = step.range(roles[i], per_sample[i]);
            offset..offset + len
        };
        let micro = plan.problem.with_batch(step.size as i64);
        let (ra, rb, ro) = (slice(0), slice(1), slice(2));
        if let Some(half) = &mut half_sum {
            cpu::run(
                &micro,
                plan.op,
                algo,
                alpha,
                &a[ra],
                &b[rb],
                0.0,
                &mut half.partial,
                workspace,
            )
            .map_err(cpu_error)?;
            half.accumulate();
            continue;
        }
        cpu::run(
            &micro,
            plan.op,
            algo,
            alpha,
            &a[ra],
            &b[rb],
            step.beta,
            &mut out[ro],
            workspace,
        )
        .map_err(cpu_error)?;
    }
    if let Some(half) = half_sum {
        half.finish(out);
    }
    Ok(())
}

/// A half-precision backward-filter run as several calls (micro-batches or spatial chunks):
/// each call writes its gradient once in the dtype (beta = 0) into `partial`, the partials are
/// summed in fp32 (starting from `beta * out`), and `dw` is rounded once at the end, instead of
/// rounding the running sum once per call through beta = 1 (docs/pytorch.md
/// has the measured errors). Both buffers are made before the calls, which allocate nothing.
pub(crate) struct HalfSum<T> {
    sum: Vec<f32>,
    pub(crate) partial: Vec<T>,
}

impl<T: Element> HalfSum<T> {
    /// `None` for fp32, which accumulates in place through beta = 1.
    pub(crate) fn new(out: &[T], beta: f32) -> Option<Self> {
        (T::DTYPE != DType::Fp32).then(|| HalfSum {
            sum: if beta == 0.0 {
                vec![0.0; out.len()]
            } else {
                out.iter().map(|v| beta * v.to_f32()).collect()
            },
            partial: vec![T::from_f32(0.0); out.len()],
        })
    }

    /// Adds the last call's `partial` to the fp32 sum.
    pub(crate) fn accumulate(&mut self) {
        for (s, p) in self.sum.iter_mut().zip(&self.partial) {
            *s += p.to_f32();
        }
    }

    /// Rounds the sum into `out`, once.
    pub(crate) fn finish(self, out: &mut [T]) {
        for (o, s) in out.iter_mut().zip(self.sum) {
            *o = T::from_f32(s);
        }
    }
}
