//! Executing plans: run a [`Plan`]'s micro-batches one after another over the caller's
//! buffers, each with its own algorithm, on one workspace.
//!
//! A micro-batch is a contiguous slice of every batched tensor (the batch is the outermost
//! dimension in NCHW and NHWC), so execution is pointer (or slice) offsets, never copies.
//! Forward and backward-data write disjoint slices of their output, so every micro-batch uses
//! the caller's `beta`. Backward-filter sums over the batch into one filter gradient: the first
//! micro-batch uses the caller's `beta`, the later ones `beta = 1` (µ-cuDNN passed the caller's
//! beta to every micro-batch, which loses gradients when beta = 0).
//!
//! [`steps`] is that logic, shared by the CPU executor here and the cuDNN executor in
//! [`cudnn`]; the per-micro-batch loops allocate nothing and never synchronise with the host.

pub mod conv2d;
pub mod cudnn;
pub mod verify;

use crate::backend::cpu::{self, CpuAlgo, CpuError, Element};
use crate::solver::{Algo, ConvOp, ConvProblem, Plan};

/// One of the three tensors of a convolution, named by its forward role.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Operand {
    /// `x` (forward, backward-filter) or `dx` (backward-data): `n x c x h x w`.
    Input,
    /// `w` (forward, backward-data) or `dw` (backward-filter): `k x c/groups x r x s`.
    Filter,
    /// `y` (forward) or `dy` (backward-data, backward-filter): `n x k x p x q`.
    Output,
}

impl Operand {
    /// Whether the tensor has a batch dimension (the filter does not).
    pub fn is_batched(self) -> bool {
        !matches!(self, Operand::Filter)
    }

    /// Elements of one sample (`c*h*w` or `k*p*q`), or of the whole filter. Meaningful for a
    /// validated problem.
    pub fn elements_per_sample(self, problem: &ConvProblem) -> usize {
        let (p, q) = problem.output_hw();
        let dims = match self {
            Operand::Input => [problem.c, problem.h, problem.w],
            Operand::Output => [problem.k, p, q],
            Operand::Filter => [
                problem.k,
                problem.c / problem.groups.max(1),
                problem.r * problem.s,
            ],
        };
        dims.iter().map(|&d| d.max(0) as usize).product()
    }
}

/// The operands of `op` in call order `[a, b, out]`, where `out = alpha * op(a, b) + beta * out`.
///
/// | op | a | b | out |
/// |---|---|---|---|
/// | forward | x (`Input`) | w (`Filter`) | y (`Output`) |
/// | backward-data | w (`Filter`) | dy (`Output`) | dx (`Input`) |
/// | backward-filter | x (`Input`) | dy (`Output`) | dw (`Filter`) |
pub fn operand_roles(op: ConvOp) -> [Operand; 3] {
    match op {
        ConvOp::Forward => [Operand::Input, Operand::Filter, Operand::Output],
        ConvOp::BackwardData => [Operand::Filter, Operand::Output, Operand::Input],
        ConvOp::BackwardFilter => [Operand::Input, Operand::Output, Operand::Filter],
    }
}

/// One micro-batch: samples `[first, first + size)`, its algorithm and its `beta`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Step {
    pub first: usize,
    pub size: usize,
    pub algo: Algo,
    pub beta: f32,
}

impl Step {
    /// The element range `(offset, len)` of `role` that this step reads or writes, for a
    /// problem whose per-sample sizes are `per_sample` (the whole filter when not batched).
    pub fn range(&self, role: Operand, per_sample: usize) -> (usize, usize) {
        if role.is_batched() {
            (self.first * per_sample, self.size * per_sample)
        } else {
            (0, per_sample)
        }
    }
}

/// The steps of a plan, in order, for a caller's `beta` (see the module docs).
pub fn steps(plan: &Plan, beta: f32) -> impl Iterator<Item = Step> + '_ {
    let accumulate = plan.op == ConvOp::BackwardFilter;
    plan.micro_batches
        .iter()
        .enumerate()
        .scan(0usize, move |first, (index, mb)| {
            let step = Step {
                first: *first,
                size: mb.size.max(0) as usize,
                algo: mb.algo,
                beta: if accumulate && index > 0 { 1.0 } else { beta },
            };
            *first += step.size;
            Some(step)
        })
}

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
}

/// Checks that a plan can be executed at all: a valid problem, positive micro-batch sizes
/// that add up to the mini-batch.
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
    if plan.batch() != plan.problem.n {
        return Err(invalid(format!(
            "micro-batches add up to {}, not the mini-batch {}",
            plan.batch(),
            plan.problem.n
        )));
    }
    Ok(())
}

/// The workspace the CPU backend needs to run `plan`: the largest micro-batch's.
pub fn cpu_workspace_bytes(plan: &Plan) -> u64 {
    steps(plan, 0.0)
        .filter_map(|s| {
            s.algo.legacy().and_then(CpuAlgo::from_id).map(|algo| {
                cpu::workspace_bytes(&plan.problem.with_batch(s.size as i64), plan.op, algo)
            })
        })
        .max()
        .unwrap_or(0)
}

/// Runs `plan` on the CPU: `out = alpha * op(a, b) + beta * out` over the whole mini-batch,
/// micro-batch by micro-batch. Buffers are as for [`cpu::run`] at the full batch; `workspace`
/// holds at least [`cpu_workspace_bytes`], 4-byte aligned.
#[allow(clippy::too_many_arguments)]
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
    Ok(())
}
