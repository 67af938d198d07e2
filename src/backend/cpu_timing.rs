//! The CPU backend as the profiler sees it: times [`cpu`](super::cpu)'s algorithms on random
//! data with the host clock.

use super::cpu::{self, AlignedWorkspace, CpuAlgo, Element};
use super::{check_measure_args, median_time, Backend, BackendError, TimingSettings};
use crate::backend::cudnn::host::random_values;
use crate::device::DeviceFingerprint;
use crate::solver::Operand;
use crate::solver::{Algo, ConvOp, ConvProblem, DType, Measurement};
use half::{bf16, f16};
use std::time::Instant;

/// Random operands for one full-batch problem, in its dtype.
enum Operands {
    F32([Vec<f32>; 3]),
    F16([Vec<f16>; 3]),
    Bf16([Vec<bf16>; 3]),
}

/// Times the CPU algorithms. Operand buffers are made once per problem and reused.
pub struct CpuBackend {
    fingerprint: DeviceFingerprint,
    operands: Option<(ConvProblem, Operands)>,
    workspace: AlignedWorkspace,
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuBackend {
    pub fn new() -> Self {
        CpuBackend {
            fingerprint: crate::device::cpu_fingerprint(),
            operands: None,
            workspace: AlignedWorkspace::default(),
        }
    }

    fn operands(&mut self, problem: &ConvProblem) -> &mut Operands {
        let stale = self.operands.as_ref().is_none_or(|(p, _)| p != problem);
        if stale {
            // Input, filter and output tensors of the full batch, indexed by `Operand`.
            let len = |role: Operand| {
                role.elements_per_sample(problem)
                    * if role.is_batched() {
                        problem.n as usize
                    } else {
                        1
                    }
            };
            let values = |role: Operand, seed| random_values(problem.dtype, len(role), seed);
            let (x, w, y) = (
                values(Operand::Input, 1),
                values(Operand::Filter, 2),
                values(Operand::Output, 3),
            );
            fn convert<T: Element>(v: Vec<f32>) -> Vec<T> {
                v.into_iter().map(T::from_f32).collect()
            }
            let operands = match problem.dtype {
                DType::Fp32 => Operands::F32([x, w, y]),
                DType::Fp16 => Operands::F16([convert(x), convert(w), convert(y)]),
                DType::Bf16 => Operands::Bf16([convert(x), convert(w), convert(y)]),
            };
            self.operands = Some((*problem, operands));
        }
        &mut self.operands.as_mut().expect("just set").1
    }
}

/// Times one algorithm at one micro-batch, on the last `micro` samples of the full buffers.
#[allow(clippy::too_many_arguments)]
fn time_algo<T: Element>(
    problem: &ConvProblem,
    op: ConvOp,
    micro: i64,
    algo: CpuAlgo,
    buffers: &mut [Vec<T>; 3],
    workspace: &mut [u8],
    timing: &TimingSettings,
) -> Result<f64, BackendError> {
    let micro_problem = problem.with_batch(micro);
    let first = (problem.n - micro) as usize;
    let [x, w, y] = buffers;
    let range = |role: Operand| {
        let step = crate::solver::Step {
            first,
            size: micro as usize,
            algo: Algo::Legacy(algo.id()),
            beta: 0.0,
        };
        let (offset, len) = step.range(role, role.elements_per_sample(problem));
        offset..offset + len
    };
    let (rx, rw, ry) = (
        range(Operand::Input),
        range(Operand::Filter),
        range(Operand::Output),
    );
    let (a, b, out): (&[T], &[T], &mut [T]) = match op {
        ConvOp::Forward => (&x[rx], &w[rw], &mut y[ry]),
        ConvOp::BackwardData => (&w[rw], &y[ry], &mut x[rx]),
        ConvOp::BackwardFilter => (&x[rx], &y[ry], &mut w[rw]),
    };
    median_time(timing, |iterations| -> Result<f64, BackendError> {
        let start = Instant::now();
        for _ in 0..iterations {
            // beta = 0: outputs are overwritten, so repeated calls stay finite.
            cpu::run(&micro_problem, op, algo, 1.0, a, b, 0.0, out, workspace)?;
        }
        Ok(start.elapsed().as_secs_f64() * 1e3)
    })
}

impl Backend for CpuBackend {
    fn fingerprint(&self) -> &DeviceFingerprint {
        &self.fingerprint
    }

    fn measure(
        &mut self,
        problem: &ConvProblem,
        op: ConvOp,
        micro: i64,
        timing: &TimingSettings,
    ) -> Result<Vec<Measurement>, BackendError> {
        check_measure_args(problem, micro)?;
        let mut measurements = Vec::with_capacity(CpuAlgo::ALL.len());
        for algo in CpuAlgo::ALL {
            let workspace_bytes = cpu::workspace_bytes(&problem.with_batch(micro), op, algo);
            if (self.workspace.len() as u64) < workspace_bytes {
                self.workspace = AlignedWorkspace::new(workspace_bytes);
            }
            let mut workspace = std::mem::take(&mut self.workspace);
            let time_ms = match self.operands(problem) {
                Operands::F32(b) => time_algo(
                    problem,
                    op,
                    micro,
                    algo,
                    b,
                    workspace.as_bytes_mut(),
                    timing,
                ),
                Operands::F16(b) => time_algo(
                    problem,
                    op,
                    micro,
                    algo,
                    b,
                    workspace.as_bytes_mut(),
                    timing,
                ),
                Operands::Bf16(b) => time_algo(
                    problem,
                    op,
                    micro,
                    algo,
                    b,
                    workspace.as_bytes_mut(),
                    timing,
                ),
            };
            self.workspace = workspace;
            measurements.push(Measurement {
                micro,
                algo: Algo::Legacy(algo.id()),
                time_ms: time_ms?.max(1e-6),
                workspace_bytes,
            });
        }
        Ok(measurements)
    }
}
