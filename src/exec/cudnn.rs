//! Executing a plan with cuDNN: everything a micro-batch needs is built once, when the plan is
//! prepared (descriptors for a legacy algorithm; the execution plan for an engine
//! configuration), and shared by micro-batches of the same size and candidate. Execution is
//! then one cuDNN call per micro-batch on offset views of the caller's device buffers, all on
//! one stream, with no host synchronisation.
//!
//! An engine configuration's execution plan also has its tensors' byte alignment built in,
//! derived from the sample offset its micro-batch starts at (16 bytes at offset 0,
//! where an undivided plan and every first micro-batch run): kernels are keyed on (size,
//! candidate, alignment), so micro-batches at offsets of different alignment get plans of
//! their own.
//!
//! An engine configuration's execution plan has alpha and beta built in, so the plans for
//! `(alpha, beta) = (1, 0)` and, for backward-filter's accumulating micro-batches, `(1, 1)` are
//! built up front; a caller's other alpha or beta builds its plan on first use and keeps it.
//!
//! A spatial plan runs its chunks the same way: each chunk's execution plan is built
//! once for its views of the full tensors (`ChunkShapes`: the chunk's rows, the full strides, a
//! pointer offset, the split axis padded only at the tensor's border), then one call per chunk.
//! Forward and backward-data chunks write their rows with the caller's `beta`; rows no call
//! writes get `beta * out` (`cudnnSetTensor` / `cudnnScaleTensor` on a strided view);
//! backward-filter's first call uses the caller's `beta`, later ones 1. Engine configurations
//! only: legacy descriptors pad both sides of an axis alike.
//!
//! Teardown on a caller's stream is decided in [`super::teardown`]: a
//! prepared plan waits for the CUDA events of its last calls before its cuDNN objects are
//! destroyed, and one that ran under CUDA graph capture is parked until the process exits.

use super::teardown::{Disposal, Fence, Teardown};
use super::{check_batch_plan, ExecError};
use crate::backend::cudnn::graph_params::{rows_view, split_dim_index, GraphParams};
use crate::backend::cudnn::{
    Alignments, ChunkShapes, ConvDescriptors, ConvOperands, ConvShapes, CudnnError, CudnnHandle,
    DeviceBuffer, DeviceOperands, EngineConfig, EnginePlan, Operand, Origin, StreamFence,
    StreamKey, StreamSession, Surface, Workspace,
};
use crate::solver::spatial::{chunks, split_axis, AxisGeometry, Chunk, Rows};
use crate::solver::{operand_roles, steps, Algo, ConvOp, Plan, SplitDim};
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
        /// The graph at alpha 1, beta 0: the problem at the micro-batch size (or a spatial
        /// chunk's views), its tensors declaring the alignment of the offset it runs at.
        params: GraphParams,
        config: EngineConfig,
        /// Built plans, one per (alpha, beta) used so far.
        plans: RefCell<Vec<EnginePlan>>,
    },
}

/// One chunk of a spatial plan: its call, if it has one, and the rows of the op's
/// output that no call writes (`beta * out` there: zeros in the full op).
struct ChunkStep {
    /// The chunk's views and the index of its kernel.
    call: Option<(ChunkShapes, usize)>,
    /// Rows of `y` (forward) or `dx` (backward-data) along the split axis that no call writes.
    blank: Vec<Rows>,
}

/// A spatial plan's chunks, in plan order.
struct SpatialSteps {
    /// The full problem's shapes and the split axis's index in the tensors' dims.
    full: ConvShapes,
    dim: usize,
    steps: Vec<ChunkStep>,
}

/// What a prepared plan runs, in order.
enum PlanSteps {
    /// A batch plan: the kernel of each micro-batch.
    Batch(Vec<usize>),
    /// A spatial plan's chunks (boxed: most plans split the batch).
    Spatial(Box<SpatialSteps>),
}

/// One cuDNN call of a plan's execution.
enum Action {
    /// Kernel `kernel` on the `[a, b, out]` element ranges `(offset, len)` with `beta`.
    Call {
        ranges: [(usize, usize); 3],
        kernel: usize,
        beta: f32,
    },
    /// `out = value * out` on a strided view of the output buffer (rows no call writes).
    Scale {
        range: (usize, usize),
        dims: crate::backend::cudnn::Nd<i64>,
        strides: crate::backend::cudnn::Nd<i64>,
        value: f32,
    },
}

/// A plan ready to run on one cuDNN handle.
///
/// Teardown: dropping it first waits for the work its calls queued on
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
    steps: PlanSteps,
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
        if plan.split == SplitDim::Spatial {
            return Self::new_spatial(handle, plan);
        }
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
                            let params = GraphParams::with_alignments(
                                &ConvShapes::new(&problem).map_err(error)?,
                                plan.op,
                                1.0,
                                0.0,
                                alignments.unwrap_or(Alignments::MAX),
                            );
                            let (kernel, bytes) = engine_kernel(handle, params, config)
                                .map_err(declined(index, this_first))?;
                            workspace_bytes = workspace_bytes.max(bytes);
                            kernel
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
                let bytes = accumulating_plan(handle, &kernels[k].3)
                    .map_err(declined(index, firsts[index]))?;
                workspace_bytes = workspace_bytes.max(bytes);
            }
        }
        warn_workspace_excess(&plan, workspace_bytes);
        Ok(PreparedPlan {
            plan,
            kernels,
            steps: PlanSteps::Batch(kernel_of),
            workspace_bytes,
            teardown: Box::default(),
        })
    }

    /// [`Self::new`] for a spatial plan: each chunk's execution plan is built once
    /// for its views of the full tensors ([`ChunkShapes`]: its rows, the full strides, its own
    /// padding along the split axis), its tensors declaring the alignment of the offsets it
    /// runs at; chunks with the same views, paddings, alignment and candidate share one.
    /// Engine configurations only: a legacy algorithm's descriptors pad both sides of an axis
    /// alike, so a chunk with a legacy algorithm is [`ExecError::Unsupported`].
    fn new_spatial(handle: &CudnnHandle, plan: Plan) -> Result<Self, ExecError> {
        let chunk_list = check_spatial_plan(&plan)?;
        let error = |source: CudnnError| ExecError::Cudnn {
            layer: plan.layer.clone(),
            op: plan.op,
            source,
        };
        let unsupported = |index: usize, first: i64, reason: String| {
            let mb = &plan.micro_batches[index];
            ExecError::Unsupported {
                layer: plan.layer.clone(),
                op: plan.op,
                index,
                size: mb.size,
                first: first as usize,
                algo: mb.algo,
                reason: format!(
                    "(a chunk of {} rows at row {first} along {}) {reason}",
                    mb.size,
                    split_axis(&plan.problem)
                ),
            }
        };
        let declined = |index: usize, first: i64| {
            move |source: CudnnError| {
                if source.is_not_supported() {
                    unsupported(index, first, source.to_string())
                } else {
                    error(source)
                }
            }
        };
        let full = ConvShapes::new(&plan.problem).map_err(error)?;
        let mut kernels: Vec<(i64, Algo, Option<Alignments>, Kernel)> = Vec::new();
        let mut chunk_steps = Vec::with_capacity(chunk_list.len());
        let mut workspace_bytes = 0;
        let dim = split_dim_index(&plan.problem);
        let mut calls = 0usize;
        let mut first = 0i64;
        for (index, (chunk, mb)) in chunk_list.iter().zip(&plan.micro_batches).enumerate() {
            let this_first = first;
            first += mb.size;
            let blank = blank_rows(plan.op, chunk, this_first, mb.size);
            if !chunk.has_call() {
                chunk_steps.push(ChunkStep { call: None, blank });
                continue;
            }
            let view = ChunkShapes::new(&plan.problem, chunk).map_err(error)?;
            let Algo::Engine(name) = &mb.algo else {
                return Err(unsupported(
                    index,
                    this_first,
                    "legacy algorithms do not run spatial chunks (their descriptors pad both \
                     sides of an axis alike); tune the spatial split with engine candidates"
                        .into(),
                ));
            };
            let params = GraphParams::for_chunk(&view, plan.op, 1.0, 0.0, view.alignments());
            let known = kernels.iter().position(|(_, algo, _, kernel)| {
                *algo == mb.algo
                    && matches!(kernel, Kernel::Engine { params: p, .. } if *p == params)
            });
            let k = match known {
                Some(k) => k,
                None => {
                    let config =
                        EngineConfig::from_name(*name).map_err(|e| ExecError::InvalidPlan {
                            layer: plan.layer.clone(),
                            op: plan.op,
                            reason: e.to_string(),
                        })?;
                    let alignments = params.alignments();
                    let (kernel, bytes) = engine_kernel(handle, params, config)
                        .map_err(declined(index, this_first))?;
                    workspace_bytes = workspace_bytes.max(bytes);
                    kernels.push((mb.size, mb.algo, Some(alignments), kernel));
                    kernels.len() - 1
                }
            };
            // Backward-filter's calls after the first accumulate (beta = 1).
            if plan.op == ConvOp::BackwardFilter && calls > 0 {
                let bytes = accumulating_plan(handle, &kernels[k].3)
                    .map_err(declined(index, this_first))?;
                workspace_bytes = workspace_bytes.max(bytes);
            }
            calls += 1;
            chunk_steps.push(ChunkStep {
                call: Some((view, k)),
                blank,
            });
        }
        warn_workspace_excess(&plan, workspace_bytes);
        Ok(PreparedPlan {
            plan,
            kernels,
            steps: PlanSteps::Spatial(Box::new(SpatialSteps {
                full,
                dim,
                steps: chunk_steps,
            })),
            workspace_bytes,
            teardown: Box::default(),
        })
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Workspace bytes the plan needs (the largest micro-batch's, as cuDNN reports it here).
    /// Can exceed what the plan was solved with ([`workspace_excess`]; reported when prepared):
    /// what runs needs this much, and the caller provides it.
    pub fn workspace_bytes(&self) -> u64 {
        self.workspace_bytes
    }

    /// How many bytes the prepared plan needs beyond the workspace it was solved with (0 when
    /// none): see [`workspace_excess`].
    pub fn workspace_excess_bytes(&self) -> u64 {
        workspace_excess(&self.plan, self.workspace_bytes).unwrap_or(0)
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
    /// `Surface::convolve`, at the full batch). Work is queued on the handle's stream.
    pub fn execute(
        &self,
        handle: &CudnnHandle,
        alpha: f32,
        beta: f32,
        ops: ConvOperands<&DeviceBuffer, &mut DeviceBuffer, &mut Workspace>,
    ) -> Result<(), ExecError> {
        let (a, b) = (ops.a.view_all(), ops.b.view_all());
        let mut out = ops.out.view_all_mut();
        let mut workspace = ops.workspace.view();
        let ops = ConvOperands {
            a: &a,
            b: &b,
            out: &mut out,
            workspace: &mut workspace,
        };
        self.run_steps(handle, (alpha, beta), ops)
    }

    /// Runs `run` on the calls of one execution in order, for a caller's `beta` (the first
    /// error stops it, tagged with the layer and op): per micro-batch (see
    /// [`crate::solver::steps`]) the element ranges `(offset, len)` of its `[a, b, out]`
    /// operands in the full buffers; for a spatial plan per chunk the `beta * out` of the rows
    /// no call writes, then its call on its views (backward-filter: the first call with the
    /// caller's `beta`, later ones 1, as micro-batches; no call at all scales `dw`). Nothing is
    /// allocated: the actions are made as they run.
    fn each_action(
        &self,
        beta: f32,
        mut run: impl FnMut(Action) -> Result<(), CudnnError>,
    ) -> Result<(), ExecError> {
        let mut run = |action| {
            run(action).map_err(|source| ExecError::Cudnn {
                layer: self.plan.layer.clone(),
                op: self.plan.op,
                source,
            })
        };
        let plan = &self.plan;
        let roles = operand_roles(plan.op);
        let spatial = match &self.steps {
            PlanSteps::Spatial(spatial) => spatial,
            PlanSteps::Batch(kernel_of) => {
                let per_sample = roles.map(|role| role.elements_per_sample(&plan.problem));
                for (step, &kernel) in steps(plan, beta).zip(kernel_of) {
                    run(Action::Call {
                        ranges: [0, 1, 2].map(|i| step.range(roles[i], per_sample[i])),
                        kernel,
                        beta: step.beta,
                    })?;
                }
                return Ok(());
            }
        };
        let mut calls = 0;
        for step in &spatial.steps {
            if beta != 1.0 {
                for &rows in &step.blank {
                    let (dims, strides, offset, span) =
                        rows_view(&spatial.full, roles[2], spatial.dim, rows);
                    run(Action::Scale {
                        range: (offset, span),
                        dims,
                        strides,
                        value: beta,
                    })?;
                }
            }
            if let Some((view, kernel)) = &step.call {
                let accumulate = plan.op == ConvOp::BackwardFilter && calls > 0;
                run(Action::Call {
                    ranges: roles.map(|role| view.range(role)),
                    kernel: *kernel,
                    beta: if accumulate { 1.0 } else { beta },
                })?;
                calls += 1;
            }
        }
        if calls == 0 && plan.op == ConvOp::BackwardFilter && beta != 1.0 {
            let dims = spatial.full.dims(Operand::Filter).map(i64::from);
            let strides =
                crate::backend::cudnn::graph_params::packed_strides(spatial.full.layout, &dims);
            run(Action::Scale {
                range: (0, spatial.full.elements(Operand::Filter)),
                dims,
                strides,
                value: beta,
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
            params,
            config,
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
        let p = EnginePlan::from_params(
            handle,
            &GraphParams {
                alpha,
                beta,
                ..*params
            },
            config,
        )?;
        plans.borrow_mut().push(p);
        Ok(plans.borrow().len() - 1)
    }

    /// As [`Self::execute`], on a caller's stream, device pointers and workspace: `session` is
    /// the handle the plan was prepared on, pointed at the caller's stream (the PyTorch and
    /// candle paths). Operands are the full mini-batch's; each micro-batch runs on offsets of
    /// them, all on one workspace of at least [`Self::workspace_bytes`].
    ///
    /// For teardown, the call asks whether the stream is being captured (then the plan is
    /// parked for good, before anything is queued) and otherwise records this stream's fence
    /// after the last micro-batch; it never waits.
    pub fn execute_on<O: Origin>(
        &self,
        session: &StreamSession<'_>,
        alpha: f32,
        beta: f32,
        ops: DeviceOperands<'_, '_, O>,
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
        let ran = self.run_steps(session, (alpha, beta), ops);
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

    /// Queues the plan's calls on `on` (mucudnn's handle, or a session on a caller's stream):
    /// each call on its ranges of the full operands, with the kernel prepared for it.
    fn run_steps<S: Surface, O: Origin>(
        &self,
        on: &S,
        (alpha, beta): (f32, f32),
        ops: DeviceOperands<'_, '_, O>,
    ) -> Result<(), ExecError> {
        let op = self.plan.op;
        let ConvOperands {
            a,
            b,
            out,
            workspace,
        } = ops;
        self.each_action(beta, |action| match action {
            Action::Scale {
                range,
                dims,
                strides,
                value,
            } => on.scale_view(
                &mut out.slice_mut(range.0, range.1)?,
                &dims,
                &strides,
                value,
            ),
            Action::Call {
                ranges: [ra, rb, ro],
                kernel,
                beta: step_beta,
            } => {
                let a = a.slice(ra.0, ra.1)?;
                let b = b.slice(rb.0, rb.1)?;
                let mut out = out.slice_mut(ro.0, ro.1)?;
                let mut workspace = workspace.reborrow();
                let ops = ConvOperands {
                    a: &a,
                    b: &b,
                    out: &mut out,
                    workspace: &mut workspace,
                };
                match &self.kernels[kernel].3 {
                    Kernel::Legacy { descriptors, algo } => {
                        on.convolve(descriptors, op, *algo, alpha, step_beta, ops)
                    }
                    Kernel::Engine { plans, .. } => {
                        let index = self.engine_plan(on.handle(), kernel, alpha, step_beta)?;
                        let plans = plans.borrow();
                        plans[index].execute(on, ops)
                    }
                }
            }
        })
    }
}

/// The bytes by which a prepared plan's workspace (`prepared`: the largest of its built
/// kernels, the beta-1 plans of backward-filter's later calls included) exceeds what `plan`
/// was solved with, which the limit bounds (`None` when it does not). A plan can need more
/// than was measured: its micro-batches' execution plans are rebuilt declaring the alignment
/// of their own offsets (the timed ones declared the least alignment of any offset), and a
/// measurement cached before the beta-1 workspace was counted has the beta-0 plan's only.
/// The excess is reported, not refused: the caller is told the real size (prepare's
/// workspace bytes) and the plan runs correctly with it; refusing would make the caller fall
/// back to another convolution for a few bytes over a limit.
pub fn workspace_excess(plan: &Plan, prepared: u64) -> Option<u64> {
    prepared
        .checked_sub(plan.workspace_bytes())
        .filter(|&excess| excess > 0)
}

/// Warns on stderr when a prepared plan needs more workspace than its plan was solved with.
fn warn_workspace_excess(plan: &Plan, prepared: u64) {
    if let Some(excess) = workspace_excess(plan, prepared) {
        let _ = writeln!(
            std::io::stderr(),
            "mucudnn: warning: {} {}: the prepared plan needs {prepared} workspace bytes, \
             {excess} more than the {} it was solved with (and measured within the limit)",
            plan.layer,
            plan.op,
            plan.workspace_bytes()
        );
    }
}

/// Makes sure engine kernel `kernel` has its accumulating (beta = 1) plan, for
/// backward-filter's later micro-batches or chunks; returns its workspace bytes (0 for a
/// legacy kernel, whose beta is a call argument).
fn accumulating_plan(handle: &CudnnHandle, kernel: &Kernel) -> Result<u64, CudnnError> {
    let Kernel::Engine {
        params,
        config,
        plans,
    } = kernel
    else {
        return Ok(0);
    };
    if let Some(p) = plans.borrow().iter().find(|p| p.beta() == 1.0) {
        return Ok(p.workspace_bytes());
    }
    let p = EnginePlan::from_params(
        handle,
        &GraphParams {
            beta: 1.0,
            ..*params
        },
        config,
    )?;
    let bytes = p.workspace_bytes();
    plans.borrow_mut().push(p);
    Ok(bytes)
}

/// The rows of the op's output, of a chunk covering rows `[first, first + size)` of it, that
/// its call does not write (zeros in the full op, `beta * out` in a plan's result): forward's
/// chunks without a call, backward-data's rows no window reaches. Backward-filter's output is
/// the filter: none.
fn blank_rows(op: ConvOp, chunk: &Chunk, first: i64, size: i64) -> Vec<Rows> {
    if op == ConvOp::BackwardFilter {
        return Vec::new();
    }
    [
        Rows {
            first,
            len: chunk.zero_before,
        },
        Rows {
            first: first + size - chunk.zero_after,
            len: chunk.zero_after,
        },
    ]
    .into_iter()
    .filter(|rows| rows.len > 0)
    .collect()
}

/// The kernel of engine configuration `config` on `params`, its execution plan for `params`
/// built now, and that plan's workspace.
fn engine_kernel(
    handle: &CudnnHandle,
    params: GraphParams,
    config: EngineConfig,
) -> Result<(Kernel, u64), CudnnError> {
    let built = EnginePlan::from_params(handle, &params, &config)?;
    let bytes = built.workspace_bytes();
    Ok((
        Kernel::Engine {
            params,
            config,
            plans: RefCell::new(vec![built]),
        },
        bytes,
    ))
}

/// The checks a spatial plan needs before the cuDNN executor prepares it: a spatial plan that
/// [`check_plan`](super::check_plan) accepts (a valid problem, positive chunk sizes adding up
/// to the op's extent along the split axis). Returns its chunks.
pub fn check_spatial_plan(plan: &Plan) -> Result<Vec<Chunk>, ExecError> {
    let invalid = |reason: String| ExecError::InvalidPlan {
        layer: plan.layer.clone(),
        op: plan.op,
        reason,
    };
    if plan.split != SplitDim::Spatial {
        return Err(invalid(format!(
            "a {} plan is not a spatial plan",
            plan.split
        )));
    }
    super::check_plan(plan)?;
    let geometry = AxisGeometry::of(&plan.problem, split_axis(&plan.problem));
    let sizes: Vec<i64> = plan.micro_batches.iter().map(|m| m.size).collect();
    chunks(&geometry, plan.op, &sizes)
        .ok_or_else(|| invalid(format!("chunk sizes {sizes:?} do not fit the problem")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::solver::{ConvProblem, MicroBatch};

    #[test]
    fn a_prepared_workspace_over_the_solved_one_is_an_excess() {
        let micro = |size, workspace_bytes| MicroBatch {
            size,
            algo: Algo::Legacy(0),
            workspace_bytes,
            time_ms: 1.0,
        };
        let plan = Plan {
            layer: "conv".into(),
            problem: ConvProblem::new(4, 3, 8, 8, 4, 3, 3),
            op: ConvOp::BackwardFilter,
            split: SplitDim::Batch,
            micro_batches: vec![micro(2, 1000), micro(2, 600)],
        };
        assert_eq!(workspace_excess(&plan, 900), None);
        assert_eq!(workspace_excess(&plan, 1000), None);
        assert_eq!(workspace_excess(&plan, 1024), Some(24));
    }

    /// What a spatial plan's calls and blank-row scalings write covers the op's output rows
    /// exactly once (forward and backward-data), so every element of the result is either one
    /// call's or `beta * out`; chunkings that do not add up are refused.
    #[test]
    fn chunk_calls_and_blank_rows_tile_the_output() {
        let problems = [
            ConvProblem {
                pad_h: 1,
                pad_w: 1,
                ..ConvProblem::new(1, 2, 23, 5, 3, 3, 3)
            },
            ConvProblem {
                stride_h: 3,
                ..ConvProblem::new(1, 2, 40, 4, 3, 1, 1)
            },
            ConvProblem {
                pad_h: 5,
                stride_h: 2,
                dilation_h: 2,
                ..ConvProblem::new(2, 2, 17, 4, 3, 3, 1)
            },
            ConvProblem {
                pad_d: 1,
                stride_d: 2,
                ..ConvProblem::new_3d(1, 2, 25, 3, 3, 2, 3, 1, 1)
            },
        ];
        let plan_of = |problem: ConvProblem, op, sizes: &[i64]| Plan {
            layer: "l".into(),
            problem,
            op,
            split: SplitDim::Spatial,
            micro_batches: sizes
                .iter()
                .map(|&size| MicroBatch {
                    size,
                    algo: Algo::Legacy(0),
                    workspace_bytes: 0,
                    time_ms: 1.0,
                })
                .collect(),
        };
        let mut blanks = 0;
        for problem in problems {
            for op in [ConvOp::Forward, ConvOp::BackwardData] {
                let extent = SplitDim::Spatial.extent(&problem, op);
                let mut seven = vec![1, 3, 2, 1, 2, 1];
                seven.push(extent - seven.iter().sum::<i64>());
                for sizes in [vec![extent], vec![extent / 3, extent - extent / 3], seven] {
                    let plan = plan_of(problem, op, &sizes);
                    let list = check_spatial_plan(&plan).unwrap();
                    let mut written = vec![0u32; extent as usize];
                    let mut first = 0;
                    for (chunk, &size) in list.iter().zip(&sizes) {
                        let mut mark = |rows: Rows| {
                            for r in rows.first..rows.end() {
                                written[r as usize] += 1;
                            }
                        };
                        for rows in blank_rows(op, chunk, first, size) {
                            blanks += 1;
                            mark(rows);
                        }
                        if chunk.has_call() {
                            let view = ChunkShapes::new(&problem, chunk).unwrap();
                            let role = operand_roles(op)[2];
                            let rows = Rows {
                                first: view.first_row(role),
                                len: i64::from(view.shapes.dims(role)[view.dim]),
                            };
                            // A call writes inside its own chunk's rows.
                            assert!(rows.first >= first && rows.end() <= first + size);
                            mark(rows);
                        }
                        first += size;
                    }
                    assert!(
                        written.iter().all(|&w| w == 1),
                        "{} {op} {sizes:?}: {written:?}",
                        problem.describe()
                    );
                }
                let mut wrong = plan_of(problem, op, &[extent - 1]);
                assert!(check_spatial_plan(&wrong).is_err());
                wrong.micro_batches[0].size = 0;
                assert!(check_spatial_plan(&wrong).is_err());
            }
        }
        // The 1x1 stride-3 backward-data leaves rows no window reaches.
        assert!(blanks > 0);
    }
}
