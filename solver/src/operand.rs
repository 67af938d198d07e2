//! The operands of a convolution op and the steps a plan runs: which tensor plays which role
//! in `out = alpha * op(a, b) + beta * out`, and which samples, candidate and `beta` each
//! micro-batch uses.
//!
//! Pure functions of a [`Plan`], shared by everything that executes or measures a plan: the
//! CPU and cuDNN executors (`mucudnn::exec`) and the backends that time candidates at a
//! micro-batch offset. A micro-batch is a contiguous slice of every batched tensor (the batch is
//! the outermost dimension in NCHW and NHWC). Forward and backward-data write disjoint slices
//! of their output, so every micro-batch uses the caller's `beta`; backward-filter sums over the
//! batch into one filter gradient, so its first micro-batch uses the caller's `beta` and the
//! later ones `beta = 1`.

use crate::algo::Algo;
use crate::plan::Plan;
use crate::problem::{ConvOp, ConvProblem};

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
