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
    /// `x` (forward, backward-filter) or `dx` (backward-data): `n x c x (d x) h x w`.
    Input,
    /// `w` (forward, backward-data) or `dw` (backward-filter): `k x c/groups x (t x) r x s`.
    Filter,
    /// `y` (forward) or `dy` (backward-data, backward-filter): `n x k x (o x) p x q`.
    Output,
}

impl Operand {
    /// Whether the tensor has a batch dimension (the filter does not).
    pub fn is_batched(self) -> bool {
        !matches!(self, Operand::Filter)
    }

    /// The tensor's dims `[n, c, d, h, w]` (a filter's `[k, c/groups, t, r, s]`; `d = t = 1`
    /// for a 2-D problem). Meaningful for a validated problem.
    pub fn dims(self, problem: &ConvProblem) -> [i64; 5] {
        match self {
            Operand::Input => problem.input_dims(),
            Operand::Output => problem.output_dims(),
            Operand::Filter => problem.filter_dims(),
        }
    }

    /// Elements of one sample (`c*d*h*w` or `k*o*p*q`), or of the whole filter. Meaningful for
    /// a validated problem.
    pub fn elements_per_sample(self, problem: &ConvProblem) -> usize {
        let dims = self.dims(problem);
        let skip = usize::from(self.is_batched());
        dims[skip..].iter().map(|&d| d.max(0) as usize).product()
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

/// The sample offset at which a backend times a micro-batch of `micro` samples inside a
/// mini-batch buffer of `batch` samples: the least-aligned offset that micro-batch can run at.
///
/// A micro-batch starts at the sum of the sizes before it, and the solver orders sizes without
/// regard to offsets, so a micro-batch of `micro < batch` samples can start at any sample
/// `1..=batch - micro`, odd ones included; and a measurement is keyed by the shape without the
/// batch size, so it serves every mini-batch, larger ones too. An odd offset `f` is the least
/// aligned there is: `f * sample_bytes` has exactly the power of two of `sample_bytes`. So a
/// size is timed at sample 1 whenever the buffer has room (`micro < batch`), and at sample 0
/// only when it is the whole buffer. (Engine configurations are also *declared* at the
/// least alignment of any offset, whatever the size, because of the mini-batches a
/// measurement serves: `Alignments::any_sample` in the cuDNN backend.) Why: timing
/// at sample `batch - micro` measured, e.g., 4 of 12 samples at sample 8 (16-byte aligned in
/// fp16 3 x 227 x 227) while a 4+4+4 plan runs it at sample 4 (8-byte aligned).
pub fn timing_offset(batch: usize, micro: usize) -> usize {
    usize::from(micro < batch)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::MicroBatch;

    /// Every ordered split of `batch` into positive sizes (a plan's micro-batches in order).
    fn compositions(batch: usize) -> Vec<Vec<usize>> {
        if batch == 0 {
            return vec![vec![]];
        }
        (1..=batch)
            .flat_map(|first| {
                compositions(batch - first)
                    .into_iter()
                    .map(move |mut rest| {
                        rest.insert(0, first);
                        rest
                    })
            })
            .collect()
    }

    fn plan_of(sizes: &[usize]) -> Plan {
        let batch: usize = sizes.iter().sum();
        Plan {
            layer: "l".into(),
            problem: ConvProblem::new(batch as i64, 3, 8, 8, 4, 3, 3),
            op: ConvOp::Forward,
            split: crate::SplitDim::Batch,
            micro_batches: sizes
                .iter()
                .map(|&size| MicroBatch {
                    size: size as i64,
                    algo: Algo::Legacy(0),
                    workspace_bytes: 0,
                    time_ms: 1.0,
                })
                .collect(),
        }
    }

    /// The power of two of a byte offset's alignment, as far as a sample offset decides it
    /// (`None`: offset 0, aligned to anything).
    fn twos(first: usize) -> Option<u32> {
        (first > 0).then(|| first.trailing_zeros())
    }

    #[test]
    fn a_size_is_timed_at_its_least_aligned_offset() {
        assert_eq!(timing_offset(12, 4), 1);
        assert_eq!(timing_offset(12, 11), 1);
        assert_eq!(timing_offset(12, 12), 0);
        assert_eq!(timing_offset(1, 1), 0);
        // Property, over every plan of up to 10 samples: every micro-batch runs at an offset
        // at least as aligned as the one its size is timed at, and the timing offset fits in
        // the buffer.
        for batch in 1..=10usize {
            for sizes in compositions(batch) {
                for step in steps(&plan_of(&sizes), 0.0) {
                    let timed = timing_offset(batch, step.size);
                    assert!(timed + step.size <= batch);
                    match (twos(step.first), twos(timed)) {
                        (_, None) => assert_eq!(step.first, 0, "{sizes:?}"),
                        (None, Some(_)) => {}
                        (Some(run), Some(t)) => assert!(run >= t, "{sizes:?} {step:?}"),
                    }
                }
            }
        }
    }

    #[test]
    fn timing_at_the_end_of_the_buffer_was_more_aligned_than_the_run() {
        // Negative control, the old rule (sample `batch - micro`): 4+4+4 of 12 timed size 4 at
        // sample 8 and ran it at sample 4, which is less aligned.
        let plan = plan_of(&[4, 4, 4]);
        let old = |step: &Step| plan.problem.n as usize - step.size;
        let less_aligned = steps(&plan, 0.0)
            .filter(|s| s.first > 0 && s.first.trailing_zeros() < old(s).trailing_zeros())
            .map(|s| s.first)
            .collect::<Vec<_>>();
        assert_eq!(less_aligned, vec![4]);
    }
}
