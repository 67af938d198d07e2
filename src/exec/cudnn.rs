//! Executing a plan with cuDNN: descriptors for each micro-batch size are built once, when the
//! plan is prepared; execution is then one `cudnnConvolution*` call per micro-batch on offset
//! views of the caller's device buffers, all on one stream, with no host synchronisation.

use super::{check_plan, operand_roles, steps, ExecError};
use crate::backend::cudnn::{ConvDescriptors, CudnnError, CudnnHandle, DeviceBuffer, Workspace};
use crate::solver::Plan;

/// A plan ready to run on one cuDNN handle.
pub struct PreparedPlan {
    plan: Plan,
    /// Descriptors per micro-batch, in plan order (sizes that repeat share nothing mutable, so
    /// duplicates are cheap: a descriptor set is a few small host structs).
    descriptors: Vec<ConvDescriptors>,
    workspace_bytes: u64,
}

impl PreparedPlan {
    /// Builds the descriptors and checks that cuDNN supports every micro-batch's algorithm.
    pub fn new(handle: &CudnnHandle, plan: Plan) -> Result<Self, ExecError> {
        check_plan(&plan)?;
        let error = |source: CudnnError| ExecError::Cudnn {
            layer: plan.layer.clone(),
            op: plan.op,
            source,
        };
        let mut descriptors = Vec::with_capacity(plan.micro_batches.len());
        let mut workspace_bytes = 0;
        for mb in &plan.micro_batches {
            let d = ConvDescriptors::new(&plan.problem.with_batch(mb.size)).map_err(error)?;
            let Some(algo) = mb.algo.legacy() else {
                return Err(ExecError::InvalidPlan {
                    layer: plan.layer.clone(),
                    op: plan.op,
                    reason: format!("engine configuration {} is not executable yet", mb.algo),
                });
            };
            match handle.workspace_size(&d, plan.op, algo).map_err(error)? {
                Some(bytes) => workspace_bytes = workspace_bytes.max(bytes),
                None => {
                    return Err(ExecError::InvalidPlan {
                        layer: plan.layer.clone(),
                        op: plan.op,
                        reason: format!(
                            "cuDNN does not support algo {} at micro-batch {}",
                            mb.algo, mb.size
                        ),
                    })
                }
            }
            descriptors.push(d);
        }
        Ok(PreparedPlan {
            plan,
            descriptors,
            workspace_bytes,
        })
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Workspace bytes the plan needs (the largest micro-batch's, as cuDNN reports it here).
    pub fn workspace_bytes(&self) -> u64 {
        self.workspace_bytes
    }

    /// `out = alpha * op(a, b) + beta * out` over the whole mini-batch (operands as for
    /// `CudnnHandle::convolve`, at the full batch). Work is queued on the handle's stream.
    #[allow(clippy::too_many_arguments)]
    pub fn execute(
        &self,
        handle: &CudnnHandle,
        alpha: f32,
        a: &DeviceBuffer,
        b: &DeviceBuffer,
        beta: f32,
        out: &mut DeviceBuffer,
        workspace: &mut Workspace,
    ) -> Result<(), ExecError> {
        let plan = &self.plan;
        let error = |source: CudnnError| ExecError::Cudnn {
            layer: plan.layer.clone(),
            op: plan.op,
            source,
        };
        let roles = operand_roles(plan.op);
        let per_sample = roles.map(|role| role.elements_per_sample(&plan.problem));
        for ((step, d), mb) in steps(plan, beta)
            .zip(&self.descriptors)
            .zip(&plan.micro_batches)
        {
            let range = |i: usize| step.range(roles[i], per_sample[i]);
            let (ra, rb, ro) = (range(0), range(1), range(2));
            let a = a.view(ra.0, ra.1).map_err(error)?;
            let b = b.view(rb.0, rb.1).map_err(error)?;
            let mut out = out.view_mut(ro.0, ro.1).map_err(error)?;
            let mut workspace = workspace.view();
            handle
                .convolve(
                    d,
                    plan.op,
                    mb.algo.legacy().unwrap_or_default(),
                    alpha,
                    &a,
                    &b,
                    step.beta,
                    &mut out,
                    &mut workspace,
                )
                .map_err(error)?;
        }
        Ok(())
    }
}
