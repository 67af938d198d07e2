//! Executing a plan with cuDNN: everything a micro-batch needs is built once, when the plan is
//! prepared (descriptors for a legacy algorithm; the execution plan for an engine
//! configuration), and shared by micro-batches of the same size and candidate. Execution is
//! then one cuDNN call per micro-batch on offset views of the caller's device buffers, all on
//! one stream, with no host synchronisation.
//!
//! An engine configuration's execution plan has alpha and beta built in, so the plans for
//! `(alpha, beta) = (1, 0)` and, for backward-filter's accumulating micro-batches, `(1, 1)` are
//! built up front; a caller's other alpha or beta builds its plan on first use and keeps it.

use super::{check_plan, ExecError};
use crate::backend::cudnn::{
    ConvDescriptors, CudnnError, CudnnHandle, DeviceBuffer, EngineConfig, EnginePlan,
    RawDeviceView, RawDeviceViewMut, RawWorkspace, StreamSession, Workspace,
};
use crate::solver::{operand_roles, steps, Algo, ConvOp, ConvProblem, Plan};
use std::cell::RefCell;

/// What one distinct (micro-batch size, candidate) runs.
enum Kernel {
    Legacy {
        descriptors: ConvDescriptors,
        algo: u32,
    },
    Engine {
        /// The problem at the micro-batch size.
        problem: ConvProblem,
        config: EngineConfig,
        /// Built plans, one per (alpha, beta) used so far.
        plans: RefCell<Vec<EnginePlan>>,
    },
}

/// A plan ready to run on one cuDNN handle.
pub struct PreparedPlan {
    plan: Plan,
    /// Distinct (size, candidate) kernels, and the kernel of each micro-batch in plan order.
    kernels: Vec<(i64, Algo, Kernel)>,
    kernel_of: Vec<usize>,
    workspace_bytes: u64,
}

impl PreparedPlan {
    /// Builds every micro-batch's descriptors or execution plans and checks that cuDNN
    /// supports each one's candidate at its size.
    pub fn new(handle: &CudnnHandle, plan: Plan) -> Result<Self, ExecError> {
        check_plan(&plan)?;
        let error = |source: CudnnError| ExecError::Cudnn {
            layer: plan.layer.clone(),
            op: plan.op,
            source,
        };
        let unsupported = |what: String| ExecError::InvalidPlan {
            layer: plan.layer.clone(),
            op: plan.op,
            reason: what,
        };
        let mut kernels: Vec<(i64, Algo, Kernel)> = Vec::new();
        let mut kernel_of = Vec::with_capacity(plan.micro_batches.len());
        let mut workspace_bytes = 0;
        for mb in &plan.micro_batches {
            let known = kernels
                .iter()
                .position(|(size, algo, _)| *size == mb.size && *algo == mb.algo);
            let k = match known {
                Some(k) => k,
                None => {
                    let problem = plan.problem.with_batch(mb.size);
                    let kernel = match mb.algo {
                        Algo::Legacy(algo) => {
                            let d = ConvDescriptors::new(&problem).map_err(error)?;
                            let bytes = handle
                                .workspace_size(&d, plan.op, algo)
                                .map_err(error)?
                                .ok_or_else(|| {
                                    unsupported(format!(
                                        "cuDNN does not support algo {algo} at micro-batch {}",
                                        mb.size
                                    ))
                                })?;
                            workspace_bytes = workspace_bytes.max(bytes);
                            Kernel::Legacy {
                                descriptors: d,
                                algo,
                            }
                        }
                        Algo::Engine(name) => {
                            let config = EngineConfig::from_name(name)
                                .map_err(|e| unsupported(e.to_string()))?;
                            let build = |beta: f32| {
                                EnginePlan::new(handle, &problem, plan.op, &config, 1.0, beta)
                                    .map_err(error)
                            };
                            let first = build(0.0)?;
                            workspace_bytes = workspace_bytes.max(first.workspace_bytes());
                            Kernel::Engine {
                                problem,
                                config,
                                plans: RefCell::new(vec![first]),
                            }
                        }
                    };
                    kernels.push((mb.size, mb.algo, kernel));
                    kernels.len() - 1
                }
            };
            kernel_of.push(k);
        }
        // A later backward-filter micro-batch of an already-seen kernel accumulates: make sure
        // its beta = 1 plan exists too.
        if plan.op == ConvOp::BackwardFilter {
            for &k in kernel_of.iter().skip(1) {
                if let Kernel::Engine {
                    problem,
                    config,
                    plans,
                } = &kernels[k].2
                {
                    if !plans.borrow().iter().any(|p| p.beta() == 1.0) {
                        let p = EnginePlan::new(handle, problem, plan.op, config, 1.0, 1.0)
                            .map_err(error)?;
                        workspace_bytes = workspace_bytes.max(p.workspace_bytes());
                        plans.borrow_mut().push(p);
                    }
                }
            }
        }
        Ok(PreparedPlan {
            plan,
            kernels,
            kernel_of,
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
        for (step, &k) in steps(plan, beta).zip(&self.kernel_of) {
            let range = |i: usize| step.range(roles[i], per_sample[i]);
            let (ra, rb, ro) = (range(0), range(1), range(2));
            let a = a.view(ra.0, ra.1).map_err(error)?;
            let b = b.view(rb.0, rb.1).map_err(error)?;
            let mut out = out.view_mut(ro.0, ro.1).map_err(error)?;
            let mut workspace = workspace.view();
            match &self.kernels[k].2 {
                Kernel::Legacy { descriptors, algo } => handle
                    .convolve(
                        descriptors,
                        plan.op,
                        *algo,
                        alpha,
                        &a,
                        &b,
                        step.beta,
                        &mut out,
                        &mut workspace,
                    )
                    .map_err(error)?,
                Kernel::Engine { plans, .. } => {
                    let index = self
                        .engine_plan(handle, k, alpha, step.beta)
                        .map_err(error)?;
                    plans.borrow()[index]
                        .execute(handle, &a, &b, &mut out, &mut workspace)
                        .map_err(error)?;
                }
            }
        }
        Ok(())
    }

    /// The index, in kernel `k`'s built plans, of the engine plan for `(alpha, beta)`, built
    /// on first use. `k` must be an engine kernel.
    fn engine_plan(
        &self,
        handle: &CudnnHandle,
        k: usize,
        alpha: f32,
        beta: f32,
    ) -> Result<usize, CudnnError> {
        let Kernel::Engine {
            problem,
            config,
            plans,
        } = &self.kernels[k].2
        else {
            unreachable!("engine_plan is called for engine kernels only");
        };
        let found = plans
            .borrow()
            .iter()
            .position(|p| p.alpha() == alpha && p.beta() == beta);
        if let Some(index) = found {
            return Ok(index);
        }
        let p = EnginePlan::new(handle, problem, self.plan.op, config, alpha, beta)?;
        plans.borrow_mut().push(p);
        Ok(plans.borrow().len() - 1)
    }

    /// As [`Self::execute`], on a caller's stream, device pointers and workspace: `session` is
    /// the handle the plan was prepared on, pointed at the caller's stream (the PyTorch path).
    /// Operands are the full mini-batch's; each micro-batch runs on offsets of them, all on
    /// one workspace of at least [`Self::workspace_bytes`].
    #[allow(clippy::too_many_arguments)]
    pub fn execute_on(
        &self,
        session: &StreamSession<'_>,
        alpha: f32,
        a: &RawDeviceView<'_>,
        b: &RawDeviceView<'_>,
        beta: f32,
        out: &mut RawDeviceViewMut<'_>,
        workspace: &mut RawWorkspace<'_>,
    ) -> Result<(), ExecError> {
        let plan = &self.plan;
        let error = |source: CudnnError| ExecError::Cudnn {
            layer: plan.layer.clone(),
            op: plan.op,
            source,
        };
        let roles = operand_roles(plan.op);
        let per_sample = roles.map(|role| role.elements_per_sample(&plan.problem));
        for (step, &k) in steps(plan, beta).zip(&self.kernel_of) {
            let range = |i: usize| step.range(roles[i], per_sample[i]);
            let (ra, rb, ro) = (range(0), range(1), range(2));
            let a = a.slice(ra.0, ra.1).map_err(error)?;
            let b = b.slice(rb.0, rb.1).map_err(error)?;
            let mut out = out.slice_mut(ro.0, ro.1).map_err(error)?;
            match &self.kernels[k].2 {
                Kernel::Legacy { descriptors, algo } => session
                    .convolve(
                        descriptors,
                        plan.op,
                        *algo,
                        alpha,
                        &a,
                        &b,
                        step.beta,
                        &mut out,
                        workspace,
                    )
                    .map_err(error)?,
                Kernel::Engine { plans, .. } => {
                    let index = self
                        .engine_plan(session.handle(), k, alpha, step.beta)
                        .map_err(error)?;
                    session
                        .execute_engine(&plans.borrow()[index], &a, &b, &mut out, workspace)
                        .map_err(error)?;
                }
            }
        }
        Ok(())
    }
}
