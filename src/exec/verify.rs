//! Measuring what a solution really costs: execute every plan and its undivided baseline end
//! to end (all micro-batches, one workspace) and time them, so that predicted speedups can be
//! checked against measured ones. Used by `mucudnn tune --verify`.

use super::cudnn::PreparedPlan;
use super::{cpu_workspace_bytes, execute_cpu, ExecError};
use crate::backend::cpu::AlignedWorkspace;
use crate::backend::cudnn::{ConvDescriptors, ConvOperands, CudnnError, CudnnHandle, DeviceBuffer};
use crate::backend::{median_time, TimingSettings};
use crate::solver::Operand;
use crate::solver::{DType, Plan, Solution};
use std::time::Instant;

/// Measured time of one plan and of its undivided baseline, in milliseconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Measured {
    pub plan_ms: f64,
    pub undivided_ms: Option<f64>,
}

/// Random full-batch operands for a plan's problem, as (x, w, y) host vectors.
fn host_operands(plan: &Plan) -> [Vec<f32>; 3] {
    let p = &plan.problem;
    let len = |role: Operand| {
        role.elements_per_sample(p) * if role.is_batched() { p.n as usize } else { 1 }
    };
    let values =
        |role, seed| crate::backend::cudnn::host::random_values(DType::Fp32, len(role), seed);
    [
        values(Operand::Input, 11),
        values(Operand::Filter, 12),
        values(Operand::Output, 13),
    ]
}

/// Executes `plan` on the CPU per `timing` and returns the median milliseconds.
pub fn time_plan_cpu(plan: &Plan, timing: &TimingSettings) -> Result<f64, ExecError> {
    if plan.problem.dtype != DType::Fp32 {
        return Err(ExecError::InvalidPlan {
            layer: plan.layer.clone(),
            op: plan.op,
            reason: "CPU verification runs fp32 plans only".into(),
        });
    }
    let [mut x, mut w, mut y] = host_operands(plan);
    let mut workspace = AlignedWorkspace::new(cpu_workspace_bytes(plan));
    let ws = workspace.as_bytes_mut();
    median_time(timing, |iterations| {
        let start = Instant::now();
        for _ in 0..iterations {
            match plan.op {
                crate::solver::ConvOp::Forward => execute_cpu(plan, 1.0, &x, &w, 0.0, &mut y, ws)?,
                crate::solver::ConvOp::BackwardData => {
                    execute_cpu(plan, 1.0, &w, &y, 0.0, &mut x, ws)?
                }
                crate::solver::ConvOp::BackwardFilter => {
                    execute_cpu(plan, 1.0, &x, &y, 0.0, &mut w, ws)?
                }
            }
        }
        Ok(start.elapsed().as_secs_f64() * 1e3)
    })
}

/// Executes `plan` with cuDNN on random device data per `timing` (CUDA events); median ms.
pub fn time_plan_cuda(
    handle: &CudnnHandle,
    plan: &Plan,
    timing: &TimingSettings,
) -> Result<f64, ExecError> {
    let error = |source: CudnnError| ExecError::Cudnn {
        layer: plan.layer.clone(),
        op: plan.op,
        source,
    };
    let prepared = PreparedPlan::new(handle, plan.clone())?;
    let d = ConvDescriptors::new(&plan.problem).map_err(error)?;
    let alloc = |role: Operand, seed| -> Result<DeviceBuffer, ExecError> {
        handle
            .alloc_random(plan.problem.dtype, d.shapes().elements(role), seed)
            .map_err(error)
    };
    let (mut x, mut w, mut y) = (
        alloc(Operand::Input, 11)?,
        alloc(Operand::Filter, 12)?,
        alloc(Operand::Output, 13)?,
    );
    let mut workspace = handle
        .alloc_workspace(prepared.workspace_bytes())
        .map_err(error)?;
    let timer = handle.timer().map_err(error)?;
    median_time(timing, |iterations| {
        timer.start().map_err(error)?;
        for _ in 0..iterations {
            match plan.op {
                crate::solver::ConvOp::Forward => prepared.execute(
                    handle,
                    1.0,
                    0.0,
                    ConvOperands {
                        a: &x,
                        b: &w,
                        out: &mut y,
                        workspace: &mut workspace,
                    },
                )?,
                crate::solver::ConvOp::BackwardData => prepared.execute(
                    handle,
                    1.0,
                    0.0,
                    ConvOperands {
                        a: &w,
                        b: &y,
                        out: &mut x,
                        workspace: &mut workspace,
                    },
                )?,
                crate::solver::ConvOp::BackwardFilter => prepared.execute(
                    handle,
                    1.0,
                    0.0,
                    ConvOperands {
                        a: &x,
                        b: &y,
                        out: &mut w,
                        workspace: &mut workspace,
                    },
                )?,
            }
        }
        timer.stop().map_err(error)?;
        Ok(f64::from(timer.elapsed_ms().map_err(error)?))
    })
}

/// Times every plan of a solution and its undivided baseline with `time_plan`.
pub fn measure_solution(
    solution: &Solution,
    mut time_plan: impl FnMut(&Plan) -> Result<f64, ExecError>,
    mut progress: impl FnMut(&Plan),
) -> Result<Vec<Measured>, ExecError> {
    solution
        .problems
        .iter()
        .map(|solved| {
            progress(&solved.plan);
            Ok(Measured {
                plan_ms: time_plan(&solved.plan)?,
                undivided_ms: solved.undivided.as_ref().map(&mut time_plan).transpose()?,
            })
        })
        .collect()
}
