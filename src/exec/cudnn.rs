//! Executing a plan with cuDNN: everything a micro-batch needs is built once, when the plan is
//! prepared (descriptors for a legacy algorithm; the execution plan for an engine
//! configuration), and shared by micro-batches of the same size and candidate. Execution is
//! then one cuDNN call per micro-batch on offset views of the caller's device buffers, all on
//! one stream, with no host synchronisation.
//!
//! An engine configuration's execution plan also has its tensors' byte alignment built in,
//! derived from the sample offset its micro-batch starts at (issue 17: 16 bytes at offset 0,
//! where an undivided plan and every first micro-batch run): kernels are keyed on (size,
//! candidate, alignment), so micro-batches at offsets of different alignment get plans of
//! their own.
//!
//! An engine configuration's execution plan has alpha and beta built in, so the plans for
//! `(alpha, beta) = (1, 0)` and, for backward-filter's accumulating micro-batches, `(1, 1)` are
//! built up front; a caller's other alpha or beta builds its plan on first use and keeps it.
//!
//! Teardown on a caller's stream (issue 21, item 9) is decided in [`super::teardown`]: a
//! prepared plan waits for the CUDA events of its last calls before its cuDNN objects are
//! destroyed, and one that ran under CUDA graph capture is parked until the process exits.

use super::teardown::{Disposal, Fence, Teardown};
use super::{check_batch_plan, ExecError};
use crate::backend::cudnn::{
    Alignments, ConvDescriptors, ConvShapes, CudnnError, CudnnHandle, DeviceBuffer, EngineConfig,
    EnginePlan, RawDeviceView, RawDeviceViewMut, RawWorkspace, StreamFence, StreamKey,
    StreamSession, Workspace,
};
use crate::solver::{operand_roles, steps, Algo, ConvOp, ConvProblem, Plan};
use std::cell::RefCell;
use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};

impl Fence for StreamFence {
    fn wait(&self) -> Result<(), String> {
        StreamFence::wait(self).map_err(|e| e.to_string())
    }
}

/// Prepared plans parked so far in this process (see [`PreparedPlan`]'s teardown).
static PARKED: AtomicUsize = AtomicUsize::new(0);

/// How many prepared plans this process has parked instead of destroying: plans that ran on a
/// stream being captured into a CUDA graph (or whose last work could not be waited for). Their
/// cuDNN objects live until the process exits.
pub fn parked_plans() -> usize {
    PARKED.load(Ordering::Relaxed)
}

/// What one distinct (micro-batch size, candidate) runs. A plan holds a few of them, made once,
/// so the legacy variant (descriptors of up to 5-D tensors, about twice an engine's fields)
/// stays inline.
#[allow(clippy::large_enum_variant)]
enum Kernel {
    Legacy {
        descriptors: ConvDescriptors,
        algo: u32,
    },
    Engine {
        /// The problem at the micro-batch size.
        problem: ConvProblem,
        config: EngineConfig,
        /// What its tensors declare: the alignment of its micro-batches' offset.
        alignments: Alignments,
        /// Built plans, one per (alpha, beta) used so far.
        plans: RefCell<Vec<EnginePlan>>,
    },
}

/// A plan ready to run on one cuDNN handle.
///
/// Teardown (issue 21, item 9): dropping it first waits for the work its calls queued on
/// callers' streams ([`Self::execute_on`] records a CUDA event per stream after each call), so
/// no descriptor or execution plan is destroyed under a queued kernel; a plan that ever ran on
/// a stream being captured into a CUDA graph is parked instead: never destroyed, since the
/// graph may replay it at any time ([`parked_plans`]). Work on the handle's own stream
/// ([`Self::execute`]) is waited for by the engine plans' own drop.
pub struct PreparedPlan {
    plan: Plan,
    /// Distinct (size, candidate, alignment) kernels (no alignment for a legacy algorithm),
    /// and the kernel of each micro-batch in plan order.
    kernels: Vec<(i64, Algo, Option<Alignments>, Kernel)>,
    kernel_of: Vec<usize>,
    workspace_bytes: u64,
    /// Fences of the caller streams it ran on, and whether it ran under capture (boxed: cold
    /// state, kept out of the plan's own size).
    teardown: Box<RefCell<Teardown<StreamKey, StreamFence>>>,
}

impl Drop for PreparedPlan {
    fn drop(&mut self) {
        if let Disposal::Park { reason } = self.teardown.get_mut().dispose() {
            // Never destroyed: the descriptors, execution plans and (through them) the cuDNN
            // handle stay alive until the process exits.
            std::mem::forget(std::mem::take(&mut self.kernels));
            PARKED.fetch_add(1, Ordering::Relaxed);
            if !reason.contains("CUDA graph") {
                let _ = writeln!(
                    std::io::stderr(),
                    "mucudnn: warning: {} {}: the prepared plan is kept until the process \
                     exits: {reason}",
                    self.plan.layer,
                    self.plan.op
                );
            }
        }
        // Otherwise every caller stream's work has finished: the fields drop (the kernels,
        // then the fences).
    }
}

impl PreparedPlan {
    /// Builds every micro-batch's descriptors or execution plans and checks that cuDNN
    /// supports each one's candidate at its size and, for an engine configuration, at the
    /// alignment of its offset. A candidate cuDNN declines is [`ExecError::Unsupported`]
    /// (the caller runs this convolution another way); other failures are
    /// [`ExecError::Cudnn`] or [`ExecError::InvalidPlan`].
    pub fn new(handle: &CudnnHandle, plan: Plan) -> Result<Self, ExecError> {
        check_batch_plan(&plan)?;
        let error = |source: CudnnError| ExecError::Cudnn {
            layer: plan.layer.clone(),
            op: plan.op,
            source,
        };
        let invalid = |what: String| ExecError::InvalidPlan {
            layer: plan.layer.clone(),
            op: plan.op,
            reason: what,
        };
        // cuDNN declining a micro-batch's candidate is its own error (a caller falls back);
        // any other failure stays a cuDNN error.
        let declined = |index: usize, first: usize| {
            let mb = &plan.micro_batches[index];
            let (layer, op) = (plan.layer.clone(), plan.op);
            move |source: CudnnError| {
                if source.is_not_supported() {
                    ExecError::Unsupported {
                        layer,
                        op,
                        index,
                        size: mb.size,
                        first,
                        algo: mb.algo,
                        reason: source.to_string(),
                    }
                } else {
                    ExecError::Cudnn { layer, op, source }
                }
            }
        };
        let mut kernels: Vec<(i64, Algo, Option<Alignments>, Kernel)> = Vec::new();
        let mut kernel_of = Vec::with_capacity(plan.micro_batches.len());
        let mut firsts = Vec::with_capacity(plan.micro_batches.len());
        let mut workspace_bytes = 0;
        let mut first = 0usize;
        for (index, mb) in plan.micro_batches.iter().enumerate() {
            let problem = plan.problem.with_batch(mb.size);
            let alignments = match mb.algo {
                Algo::Legacy(_) => None,
                Algo::Engine(_) => Some(Alignments::at_sample(
                    &ConvShapes::new(&problem).map_err(error)?,
                    first,
                )),
            };
            let this_first = first;
            firsts.push(first);
            first += usize::try_from(mb.size).unwrap_or(0);
            let known = kernels.iter().position(|(size, algo, aligned, _)| {
                *size == mb.size && *algo == mb.algo && *aligned == alignments
            });
            let k = match known {
                Some(k) => k,
                None => {
                    let kernel = match mb.algo {
                        Algo::Legacy(algo) => {
                            let d = ConvDescriptors::new(&problem).map_err(error)?;
                            let bytes = handle
                                .workspace_size(&d, plan.op, algo)
                                .map_err(error)?
                                .ok_or_else(|| ExecError::Unsupported {
                                    layer: plan.layer.clone(),
                                    op: plan.op,
                                    index,
                                    size: mb.size,
                                    first: this_first,
                                    algo: mb.algo,
                                    reason: format!(
                                        "cuDNN does not support legacy algorithm {algo} at \
                                         this size"
                                    ),
                                })?;
                            workspace_bytes = workspace_bytes.max(bytes);
                            Kernel::Legacy {
                                descriptors: d,
                                algo,
                            }
                        }
                        Algo::Engine(name) => {
                            let config = EngineConfig::from_name(name)
                                .map_err(|e| invalid(e.to_string()))?;
                            let alignments = alignments.unwrap_or(Alignments::MAX);
                            let build = |beta: f32| {
                                EnginePlan::with_alignments(
                                    handle, &problem, plan.op, &config, 1.0, beta, alignments,
                                )
                                .map_err(declined(index, this_first))
                            };
                            let built = build(0.0)?;
                            workspace_bytes = workspace_bytes.max(built.workspace_bytes());
                            Kernel::Engine {
                                problem,
                                config,
                                alignments,
                                plans: RefCell::new(vec![built]),
                            }
                        }
                    };
                    kernels.push((mb.size, mb.algo, alignments, kernel));
                    kernels.len() - 1
                }
            };
            kernel_of.push(k);
        }
        // A later backward-filter micro-batch of an already-seen kernel accumulates: make sure
        // its beta = 1 plan exists too.
        if plan.op == ConvOp::BackwardFilter {
            for (index, &k) in kernel_of.iter().enumerate().skip(1) {
                if let Kernel::Engine {
                    problem,
                    config,
                    alignments,
                    plans,
                } = &kernels[k].3
                {
                    if !plans.borrow().iter().any(|p| p.beta() == 1.0) {
                        let p = EnginePlan::with_alignments(
                            handle,
                            problem,
                            plan.op,
                            config,
                            1.0,
                            1.0,
                            *alignments,
                        )
                        .map_err(declined(index, firsts[index]))?;
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
            teardown: Box::default(),
        })
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Workspace bytes the plan needs (the largest micro-batch's, as cuDNN reports it here).
    pub fn workspace_bytes(&self) -> u64 {
        self.workspace_bytes
    }

    /// Whether dropping this plan will park it (it ran under capture, or lost track of work).
    pub fn will_park(&self) -> bool {
        self.teardown.borrow().is_parked()
    }

    /// Number of caller streams whose last work this plan will wait for when dropped.
    pub fn fenced_streams(&self) -> usize {
        self.teardown.borrow().fenced_streams()
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
        let op = self.plan.op;
        self.each_step(beta, |[ra, rb, ro], k, step_beta| {
            let a = a.view(ra.0, ra.1)?;
            let b = b.view(rb.0, rb.1)?;
            let mut out = out.view_mut(ro.0, ro.1)?;
            let mut workspace = workspace.view();
            match &self.kernels[k].3 {
                Kernel::Legacy { descriptors, algo } => handle.convolve(
                    descriptors,
                    op,
                    *algo,
                    alpha,
                    &a,
                    &b,
                    step_beta,
                    &mut out,
                    &mut workspace,
                ),
                Kernel::Engine { plans, .. } => {
                    let index = self.engine_plan(handle, k, alpha, step_beta)?;
                    let plans = plans.borrow();
                    plans[index].execute(handle, &a, &b, &mut out, &mut workspace)
                }
            }
        })
    }

    /// Runs `run(ranges, kernel, beta)` for every micro-batch in plan order, with the element
    /// ranges `(offset, len)` of its `[a, b, out]` operands (see [`crate::solver::steps`]); the
    /// first error stops it, tagged with the layer and op.
    fn each_step(
        &self,
        beta: f32,
        mut run: impl FnMut([(usize, usize); 3], usize, f32) -> Result<(), CudnnError>,
    ) -> Result<(), ExecError> {
        let plan = &self.plan;
        let roles = operand_roles(plan.op);
        let per_sample = roles.map(|role| role.elements_per_sample(&plan.problem));
        for (step, &k) in steps(plan, beta).zip(&self.kernel_of) {
            let ranges = [0, 1, 2].map(|i| step.range(roles[i], per_sample[i]));
            run(ranges, k, step.beta).map_err(|source| ExecError::Cudnn {
                layer: plan.layer.clone(),
                op: plan.op,
                source,
            })?;
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
            alignments,
            plans,
        } = &self.kernels[k].3
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
        let p = EnginePlan::with_alignments(
            handle,
            problem,
            self.plan.op,
            config,
            alpha,
            beta,
            *alignments,
        )?;
        plans.borrow_mut().push(p);
        Ok(plans.borrow().len() - 1)
    }

    /// As [`Self::execute`], on a caller's stream, device pointers and workspace: `session` is
    /// the handle the plan was prepared on, pointed at the caller's stream (the PyTorch path).
    /// Operands are the full mini-batch's; each micro-batch runs on offsets of them, all on
    /// one workspace of at least [`Self::workspace_bytes`].
    ///
    /// For teardown, the call asks whether the stream is being captured (then the plan is
    /// parked for good, before anything is queued) and otherwise records this stream's fence
    /// after the last micro-batch; it never waits.
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
        let tag = |source: CudnnError| ExecError::Cudnn {
            layer: self.plan.layer.clone(),
            op: self.plan.op,
            source,
        };
        let capturing = session.is_capturing().map_err(tag)?;
        if capturing {
            self.teardown.borrow_mut().captured();
        }
        let ran = self.run_steps_on(session, alpha, a, b, beta, out, workspace);
        if !capturing {
            // Even after a failed step: the steps before it are queued.
            let mut teardown = self.teardown.borrow_mut();
            let recorded = teardown
                .fence_for(session.key(), || session.new_fence())
                .and_then(|fence| session.record(fence));
            if let Err(e) = recorded {
                teardown.lost(&e.to_string());
                ran?;
                return Err(tag(e));
            }
        }
        ran
    }

    #[allow(clippy::too_many_arguments)]
    fn run_steps_on(
        &self,
        session: &StreamSession<'_>,
        alpha: f32,
        a: &RawDeviceView<'_>,
        b: &RawDeviceView<'_>,
        beta: f32,
        out: &mut RawDeviceViewMut<'_>,
        workspace: &mut RawWorkspace<'_>,
    ) -> Result<(), ExecError> {
        let op = self.plan.op;
        self.each_step(beta, |[ra, rb, ro], k, step_beta| {
            let a = a.slice(ra.0, ra.1)?;
            let b = b.slice(rb.0, rb.1)?;
            let mut out = out.slice_mut(ro.0, ro.1)?;
            match &self.kernels[k].3 {
                Kernel::Legacy { descriptors, algo } => session.convolve(
                    descriptors,
                    op,
                    *algo,
                    alpha,
                    &a,
                    &b,
                    step_beta,
                    &mut out,
                    workspace,
                ),
                Kernel::Engine { plans, .. } => {
                    let index = self.engine_plan(session.handle(), k, alpha, step_beta)?;
                    let plans = plans.borrow();
                    session.execute_engine(&plans[index], &a, &b, &mut out, workspace)
                }
            }
        })
    }
}
