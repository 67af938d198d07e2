//! The cuDNN backend as the profiler sees it: times every legacy algorithm with CUDA events on
//! random device data (a random block tiled on the device: `CudnnHandle::alloc_tiled`), at a micro-batch offset inside a full-batch buffer: the least-aligned
//! offset the executor can run that size at ([`timing_offset`]), and engine configurations
//! declare the alignment that holds at every offset, so what is timed can run wherever a plan
//! puts it. Spatial chunks ([`CudnnBackend::measure_spatial`]) are
//! timed the same way: engine configurations on views of the full operands at the start,
//! middle and end of the split axis, declaring the alignment of every row offset.

use super::cudnn::{
    algo_count, engine_configs_for_chunk, engine_configs_with_alignments, graph_api_status,
    known_bad::effective_math, legacy_deterministic, probe, Alignments, ChunkShapes,
    ComparisonDescriptors, ConvDescriptors, ConvShapes, CudnnError, CudnnHandle, DeviceBuffer,
    DeviceOperands, EngineConfig, EngineNotes, EnginePlan, OutputComparison, Surface, Workspace,
};
use super::verify::{self, Arithmetic};
use super::{
    check_chunk_args, check_key, check_measure_args, median_time, Backend, BackendError, Decision,
    MeasureSettings, Measured, MemoryUse, Selection, TimingSettings,
};
use crate::device::{BackendKind, DeviceFingerprint};
use crate::solver::spatial::{split_axis, timing_chunks, AxisGeometry};
use crate::solver::{operand_roles, timing_offset, Operand, Step};
use crate::solver::{
    Algo, AlgoKind, ConvOp, ConvProblem, DType, EngineName, MathMode, MeasureKey, Measurement,
    Skipped, SplitDim, Verification,
};

/// Full-batch random operands of one problem, indexed by [`Operand`].
struct Operands {
    problem: ConvProblem,
    input: DeviceBuffer,
    filter: DeviceBuffer,
    output: DeviceBuffer,
}

impl Operands {
    fn bytes(&self) -> u64 {
        [&self.input, &self.filter, &self.output]
            .iter()
            .map(|b| b.size_bytes() as u64)
            .sum()
    }

    /// `(a, b, out)` for `op`.
    fn for_op(&mut self, op: ConvOp) -> (&DeviceBuffer, &DeviceBuffer, &mut DeviceBuffer) {
        match op {
            ConvOp::Forward => (&self.input, &self.filter, &mut self.output),
            ConvOp::BackwardData => (&self.filter, &self.output, &mut self.input),
            ConvOp::BackwardFilter => (&self.input, &self.output, &mut self.filter),
        }
    }
}

/// The legacy algorithms verification trusts, per op, in the order they are tried (the first
/// cuDNN runs there is the reference), always with FMA math (no tensor cores, so no TF32):
/// forward's implicit GEMM, the deterministic backward algorithm 1 (no atomics, no FFT or
/// Winograd), then their precomputed-index or atomic variants where those are declined.
pub fn reference_algos(op: ConvOp) -> &'static [u32] {
    match op {
        ConvOp::Forward => &[0, 1],
        ConvOp::BackwardData => &[1, 0],
        ConvOp::BackwardFilter => &[1, 0, 3],
    }
}

/// Whether legacy algorithm `algo` of `op` computes through FFT or Winograd transforms (FFT,
/// FFT_TILING, WINOGRAD, WINOGRAD_NONFUSED), whose rounding is looser than a direct sum's.
pub fn legacy_transform(op: ConvOp, algo: u32) -> bool {
    match op {
        ConvOp::Forward => (4..=7).contains(&algo),
        ConvOp::BackwardData => (2..=5).contains(&algo),
        ConvOp::BackwardFilter => matches!(algo, 2 | 4 | 5 | 6),
    }
}

/// The arithmetic a cuDNN candidate's tolerance assumes: transforms for FFT and Winograd
/// algorithms and engines (and engines that reduce in less than fp32); TF32 for fp32 data
/// whose math mode (after the known-bad list) admits tensor cores; FMA otherwise. `notes` are
/// an engine configuration's (`None`: a legacy algorithm `algo`).
pub fn candidate_arithmetic(
    problem: &ConvProblem,
    math: MathMode,
    op: ConvOp,
    algo: &Algo,
    notes: Option<EngineNotes>,
) -> Arithmetic {
    let transform = match (algo, notes) {
        (Algo::Legacy(number), _) => legacy_transform(op, *number),
        (Algo::Engine(_), Some(notes)) => {
            notes.fft || notes.winograd || notes.reduced_precision_reduction
        }
        (Algo::Engine(_), None) => true,
    };
    let tensor_cores = match notes {
        Some(notes) => notes.tensor_core || notes.down_convert_inputs,
        None => true,
    };
    if transform {
        Arithmetic::Transform
    } else if problem.dtype == DType::Fp32 && math != MathMode::Fma && tensor_cores {
        Arithmetic::Tf32
    } else {
        Arithmetic::Fma
    }
}

/// The reference output of one (problem, op, micro-batch size) and the comparison of the
/// candidates' outputs with it, kept while that size is measured.
struct Reference {
    problem: ConvProblem,
    op: ConvOp,
    micro: i64,
    /// `None` when no reference algorithm runs here, or cuDNN cannot compare these outputs:
    /// the candidates are then not compared.
    output: Option<(DeviceBuffer, OutputComparison)>,
}

impl Reference {
    fn bytes(&self) -> u64 {
        self.output.as_ref().map_or(0, |(buffer, comparison)| {
            buffer.size_bytes() as u64 + comparison.bytes()
        })
    }
}

/// Times cuDNN's algorithms on one GPU: the legacy algorithms and, where the loaded cuDNN
/// exports the graph API, its engine configurations.
pub struct CudnnBackend {
    handle: CudnnHandle,
    fingerprint: DeviceFingerprint,
    operands: Option<Operands>,
    workspace: Option<Workspace>,
    /// Verification's reference output at the size being measured.
    reference: Option<Reference>,
    kinds: &'static [AlgoKind],
    /// The GPU's memory, as CUDA reports it.
    memory_bytes: u64,
    /// What the operands and the workspace hold (device memory).
    memory: MemoryUse,
    /// Time engine configurations that compile kernels at run time (NVRTC): off by default.
    runtime_compiled: bool,
    /// Print every plan build's time (slow ones are printed anyway).
    log_plan_builds: bool,
    /// Every execution-plan build of this backend's life, in order.
    plan_builds: Vec<PlanBuild>,
}

/// One execution-plan build while measuring: which configuration, for what, how long.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanBuild {
    pub op: ConvOp,
    /// The micro-batch size (or, for a spatial split, the chunk size).
    pub size: i64,
    pub config: EngineName,
    /// The plans built for it (backward-filter also builds its beta-1 plan; a spatial size
    /// one or two per timing chunk) and the seconds they took together.
    pub plans: usize,
    pub seconds: f64,
    /// Whether cuDNN built them all.
    pub built: bool,
}

/// A configuration whose plans take longer than this to build is printed even without
/// [`CudnnBackend::log_plan_builds`]: what eats a GPU window's minutes should show.
const SLOW_PLAN_BUILD_SECONDS: f64 = 1.0;

/// One engine configuration at one micro-batch size.
enum EngineOutcome {
    /// cuDNN cannot build or run it here.
    Unsupported,
    /// Its workspace exceeds the measuring limit: not allocated, not timed.
    Skipped(u64),
    /// Time (ms), workspace bytes and the engine's notes.
    Timed(f64, u64, EngineNotes),
}

impl CudnnBackend {
    /// The fingerprint and memory of GPU `ordinal`, from the (cached) probe: no handle, no
    /// stream, nothing allocated.
    pub fn describe(ordinal: usize) -> Result<(DeviceFingerprint, u64), BackendError> {
        let system = probe()?;
        let device = system.devices.get(ordinal).ok_or_else(|| {
            BackendError::Invalid(format!(
                "no GPU {ordinal}: {} visible",
                system.devices.len()
            ))
        })?;
        let fingerprint = DeviceFingerprint {
            backend: BackendKind::Cuda,
            name: device.name.clone(),
            compute_capability: Some((
                device.compute_capability.0 as u32,
                device.compute_capability.1 as u32,
            )),
            driver_version: Some(system.driver_version as u32),
            cudnn_version: Some(system.cudnn_version),
        };
        Ok((fingerprint, device.total_memory_bytes))
    }

    /// Opens GPU `ordinal`; an error (never a panic) when CUDA, cuDNN or the GPU is missing.
    pub fn new(ordinal: usize) -> Result<Self, BackendError> {
        let (fingerprint, memory_bytes) = Self::describe(ordinal)?;
        Ok(CudnnBackend {
            handle: CudnnHandle::new(ordinal)?,
            fingerprint,
            operands: None,
            workspace: None,
            reference: None,
            memory_bytes,
            memory: MemoryUse::default(),
            runtime_compiled: false,
            log_plan_builds: false,
            plan_builds: Vec::new(),
            kinds: if graph_api_status().is_ok() {
                &[AlgoKind::Legacy, AlgoKind::Engine]
            } else {
                &[AlgoKind::Legacy]
            },
        })
    }

    /// Number of visible GPUs (0 with an error when CUDA or cuDNN is missing).
    pub fn device_count() -> Result<usize, BackendError> {
        Ok(probe()?.devices.len())
    }

    pub fn handle(&self) -> &CudnnHandle {
        &self.handle
    }

    /// Whether engine configurations that compile kernels at run time
    /// (`CUDNN_BEHAVIOR_NOTE_RUNTIME_COMPILATION`, NVRTC: seconds per plan build) are timed.
    /// Off by default: they are left out of the search. Measurements already cached without
    /// them stay as they are (a size counts as measured), so turn it on before the first tune
    /// of a problem, or use a fresh cache.
    pub fn set_runtime_compiled(&mut self, on: bool) {
        self.runtime_compiled = on;
    }

    /// Prints every plan build's time to stderr (`mucudnn: plan build ...`); builds slower
    /// than a second are printed anyway.
    pub fn log_plan_builds(&mut self, on: bool) {
        self.log_plan_builds = on;
    }

    /// The plan builds measuring has made so far.
    pub fn plan_builds(&self) -> &[PlanBuild] {
        &self.plan_builds
    }

    /// The engine search cuDNN is asked with, capped at `max_candidates`.
    fn heuristics(&self, max_candidates: Option<usize>) -> super::cudnn::EngineSearch {
        super::cudnn::EngineSearch {
            max_candidates: max_candidates.unwrap_or(usize::MAX),
            skip_runtime_compiled: !self.runtime_compiled,
            ..Default::default()
        }
    }

    /// Records (and maybe prints) the plan builds of one configuration at one size.
    fn record_build(&mut self, build: PlanBuild) {
        if self.log_plan_builds || build.seconds >= SLOW_PLAN_BUILD_SECONDS {
            eprintln!(
                "mucudnn: plan build {} {} size {}: {} plan(s) in {:.3} s{}",
                build.op,
                build.config,
                build.size,
                build.plans,
                build.seconds,
                if build.built { "" } else { " (not supported)" }
            );
        }
        self.plan_builds.push(build);
    }

    fn ensure_operands(&mut self, problem: &ConvProblem) -> Result<(), CudnnError> {
        if self
            .operands
            .as_ref()
            .is_some_and(|o| o.problem == *problem)
        {
            return Ok(());
        }
        self.operands = None; // free before allocating the next problem's buffers
        self.account();
        let d = ConvDescriptors::new(problem)?;
        let len = |role| d.shapes().elements(role);
        let dtype = problem.dtype;
        self.operands = Some(Operands {
            problem: *problem,
            input: self.handle.alloc_tiled(dtype, len(Operand::Input), 1)?,
            filter: self.handle.alloc_tiled(dtype, len(Operand::Filter), 2)?,
            output: self.handle.alloc_tiled(dtype, len(Operand::Output), 3)?,
        });
        self.account();
        Ok(())
    }

    fn ensure_workspace(&mut self, bytes: u64) -> Result<(), CudnnError> {
        if self.workspace.as_ref().is_none_or(|w| w.bytes() < bytes) {
            self.workspace = None;
            self.account();
            self.workspace = Some(self.handle.alloc_workspace(bytes)?);
            self.memory.largest_workspace_bytes = self.memory.largest_workspace_bytes.max(bytes);
            self.account();
        }
        Ok(())
    }

    /// Records what the operands, the workspace and the reference output hold now.
    fn account(&mut self) {
        let operands = self.operands.as_ref().map_or(0, Operands::bytes);
        let workspace = self.workspace.as_ref().map_or(0, Workspace::bytes);
        let reference = self.reference.as_ref().map_or(0, Reference::bytes);
        self.memory.hold(operands + workspace + reference);
    }

    /// Makes the reference output of `op` at micro-batch `micro` of `problem` (at sample
    /// `first` of the full-batch operands, where the candidates run), unless it is made
    /// already: the first of [`reference_algos`] cuDNN runs, with FMA math. Where none runs,
    /// or outputs cannot be compared on this GPU, the reference has no output and the
    /// candidates are not compared.
    fn ensure_reference(
        &mut self,
        problem: &ConvProblem,
        op: ConvOp,
        micro: i64,
        first: usize,
    ) -> Result<(), CudnnError> {
        if self
            .reference
            .as_ref()
            .is_some_and(|r| r.problem == *problem && r.op == op && r.micro == micro)
        {
            return Ok(());
        }
        self.reference = None;
        self.account();
        let output = match self.make_reference(problem, op, micro, first) {
            Ok(output) => output,
            Err(e) if e.is_not_supported() || e.is_out_of_memory() => None,
            // No comparison here (cuDNN without the tensor ops, or refusing these
            // descriptors): the candidates are measured, not compared.
            Err(e @ (CudnnError::Unavailable { .. } | CudnnError::Cudnn { .. })) => {
                warn_uncompared(&e);
                None
            }
            Err(e) => return Err(e),
        };
        self.reference = Some(Reference {
            problem: *problem,
            op,
            micro,
            output,
        });
        self.account();
        Ok(())
    }

    fn make_reference(
        &mut self,
        problem: &ConvProblem,
        op: ConvOp,
        micro: i64,
        first: usize,
    ) -> Result<Option<(DeviceBuffer, OutputComparison)>, CudnnError> {
        let fma = ConvProblem {
            math: MathMode::Fma,
            ..problem.with_batch(micro)
        };
        let d = ConvDescriptors::new(&fma)?;
        let [_, _, out_role] = operand_roles(op);
        let comparison = OutputComparison::new(
            &self.handle,
            ComparisonDescriptors::for_output(d.shapes(), op)?,
        )?;
        let mut output = self
            .handle
            .alloc_zeroed(problem.dtype, d.shapes().elements(out_role))?;
        for &algo in reference_algos(op) {
            let Some(bytes) = self.handle.workspace_size(&d, op, algo)? else {
                continue;
            };
            self.ensure_workspace(bytes)?;
            let full = self.operands.as_ref().expect("ensured").problem;
            let step = Step {
                first,
                size: micro as usize,
                algo: Algo::Legacy(algo),
                beta: 0.0,
            };
            let [ra, rb, _] =
                operand_roles(op).map(|role| step.range(role, role.elements_per_sample(&full)));
            let ran = {
                let (a, b, _) = self.operands.as_mut().expect("ensured").for_op(op);
                let (a, b) = (a.view(ra.0, ra.1)?, b.view(rb.0, rb.1)?);
                let mut out = output.view_all_mut();
                let mut workspace = self.workspace.as_mut().expect("ensured").view();
                self.handle.convolve(
                    &d,
                    op,
                    algo,
                    1.0,
                    0.0,
                    DeviceOperands::new(&a, &b, &mut out, &mut workspace),
                )
            };
            match ran {
                Ok(()) => return Ok(Some((output, comparison))),
                Err(e) if e.is_not_supported() => continue,
                Err(e) => return Err(e),
            }
        }
        Ok(None)
    }

    /// The verification of a candidate just timed at `micro` (its output compared with the
    /// reference's), or `None` when this tune does not verify.
    #[allow(clippy::too_many_arguments)]
    fn verify_timed(
        &mut self,
        verify: bool,
        problem: &ConvProblem,
        op: ConvOp,
        algo: &Algo,
        notes: Option<EngineNotes>,
        micro: i64,
        first: usize,
    ) -> Result<Option<Verification>, CudnnError> {
        if !verify {
            return Ok(None);
        }
        let arithmetic = self.arithmetic(problem, op, algo, notes);
        self.compare_output(op, micro, first, arithmetic)
    }

    /// How the output of the candidate just timed (`op` at micro-batch `micro`, sample
    /// `first`) compares with the reference's, held to `arithmetic`'s tolerance; `None` when
    /// there is no reference output to compare with, or cuDNN cannot compare them here.
    fn compare_output(
        &mut self,
        op: ConvOp,
        micro: i64,
        first: usize,
        arithmetic: Arithmetic,
    ) -> Result<Option<Verification>, CudnnError> {
        let full = self.operands.as_ref().expect("ensured").problem;
        let Some(Reference {
            output: Some((reference, comparison)),
            ..
        }) = self.reference.as_mut()
        else {
            return Ok(None);
        };
        let step = Step {
            first,
            size: micro as usize,
            algo: Algo::Legacy(0),
            beta: 0.0,
        };
        let [_, _, ro] =
            operand_roles(op).map(|role| step.range(role, role.elements_per_sample(&full)));
        let (_, _, out) = self.operands.as_mut().expect("ensured").for_op(op);
        let out = out.view(ro.0, ro.1)?;
        let compared = comparison.max_differences(&self.handle, &out, &reference.view_all());
        let (difference, largest) = match compared {
            Ok(maxima) => maxima,
            Err(e) if e.is_not_supported() || matches!(e, CudnnError::Cudnn { .. }) => {
                // This dtype or layout cannot be compared by this cuDNN: no comparisons at
                // this size rather than a failed tune.
                warn_uncompared(&e);
                if let Some(r) = self.reference.as_mut() {
                    r.output = None;
                }
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        if !largest.is_finite() {
            return Ok(None);
        }
        let tolerance = verify::tolerance(&full, op, micro, arithmetic);
        Ok(Some(verify::verification(
            verify::relative_error(difference, largest),
            tolerance,
        )))
    }

    /// The arithmetic of `algo` (with an engine's `notes`) on `problem`, as the backend runs
    /// it (the known-bad list may have turned tensor cores off).
    fn arithmetic(
        &self,
        problem: &ConvProblem,
        op: ConvOp,
        algo: &Algo,
        notes: Option<EngineNotes>,
    ) -> Arithmetic {
        let math = effective_math(
            self.fingerprint.cudnn_version.unwrap_or(0),
            problem.dtype,
            problem.spatial_dims(),
            problem.math,
        );
        candidate_arithmetic(problem, math, op, algo, notes)
    }

    /// Runs `run` on the `(a, b, out)` views of one micro-batch at sample `first` of the
    /// full-batch operands (the offset the executor would use) and the workspace. Views are
    /// made once, outside the timed loops (making one records stream events).
    fn time_views<R>(
        &mut self,
        op: ConvOp,
        micro: usize,
        first: usize,
        run: impl for<'v> FnOnce(
            &CudnnHandle,
            &super::cudnn::DeviceView<'v>,
            &super::cudnn::DeviceView<'v>,
            &mut super::cudnn::DeviceViewMut<'v>,
            &mut super::cudnn::WorkspaceView<'v>,
        ) -> Result<R, CudnnError>,
    ) -> Result<R, CudnnError> {
        let full = self.operands.as_ref().expect("ensured").problem;
        let step = Step {
            first,
            size: micro,
            algo: Algo::Legacy(0),
            beta: 0.0,
        };
        let ranges =
            operand_roles(op).map(|role| step.range(role, role.elements_per_sample(&full)));
        self.views_at(op, ranges, run)
    }

    /// Runs `run` on the `(a, b, out)` views at `ranges` (offset, length in elements, in the
    /// op's operand order) of the full operands, and the workspace.
    fn views_at<R>(
        &mut self,
        op: ConvOp,
        [ra, rb, ro]: [(usize, usize); 3],
        run: impl for<'v> FnOnce(
            &CudnnHandle,
            &super::cudnn::DeviceView<'v>,
            &super::cudnn::DeviceView<'v>,
            &mut super::cudnn::DeviceViewMut<'v>,
            &mut super::cudnn::WorkspaceView<'v>,
        ) -> Result<R, CudnnError>,
    ) -> Result<R, CudnnError> {
        let handle = &self.handle;
        let (a, b, out) = self.operands.as_mut().expect("ensured").for_op(op);
        let (a, b, mut out) = (
            a.view(ra.0, ra.1)?,
            b.view(rb.0, rb.1)?,
            out.view_mut(ro.0, ro.1)?,
        );
        let mut workspace = self.workspace.as_mut().expect("ensured").view();
        run(handle, &a, &b, &mut out, &mut workspace)
    }

    /// Times one engine configuration at one micro-batch: `None` when cuDNN cannot build it
    /// (or, for backward-filter, its accumulating variant that later micro-batches need).
    fn time_engine(
        &mut self,
        micro_problem: &ConvProblem,
        op: ConvOp,
        config: &EngineConfig,
        first: usize,
        timing: &TimingSettings,
        select: &Selection,
    ) -> Result<EngineOutcome, CudnnError> {
        let skip = |e: &CudnnError| e.is_not_supported() || e.is_out_of_memory();
        // What holds at every offset this size can run at, in every mini-batch the
        // measurement serves (`solver::timing_offset`): a plan's micro-batch
        // declares at least as much at its own offset, so what is timed here builds there.
        let alignments = Alignments::any_sample(&ConvShapes::new(micro_problem)?);
        let started = std::time::Instant::now();
        let built = self.build_engine_plans(micro_problem, op, config, alignments);
        self.record_build(PlanBuild {
            op,
            size: micro_problem.n,
            config: config.name(),
            plans: if op == ConvOp::BackwardFilter { 2 } else { 1 },
            seconds: started.elapsed().as_secs_f64(),
            built: built.is_ok(),
        });
        let (plan, accumulating_bytes) = match built {
            Ok(built) => built,
            Err(e) if skip(&e) => return Ok(EngineOutcome::Unsupported),
            Err(e) => return Err(e),
        };
        // A plan's backward-filter micro-batches after the first run the beta-1 plan, in the
        // same workspace: the larger of the two is what running needs.
        let bytes = plan.workspace_bytes().max(accumulating_bytes);
        if select.decide(&Algo::Engine(config.name()), bytes) == Decision::Skip {
            return Ok(EngineOutcome::Skipped(bytes));
        }
        match self.ensure_workspace(bytes) {
            Ok(()) => {}
            Err(e) if e.is_out_of_memory() => return Ok(EngineOutcome::Unsupported),
            Err(e) => return Err(e),
        }
        let micro = micro_problem.n as usize;
        let timed = self.time_views(op, micro, first, |handle, a, b, out, workspace| {
            time_calls(handle, timing, || {
                plan.execute(handle, DeviceOperands::new(a, b, out, workspace))
            })
        });
        match timed {
            Ok(ms) => Ok(EngineOutcome::Timed(ms, bytes, plan.notes())),
            Err(e) if skip(&e) => Ok(EngineOutcome::Unsupported),
            Err(e) => Err(e),
        }
    }

    /// The beta-0 plan of `config` for `micro_problem` and `op`, and for backward-filter the
    /// workspace of its beta-1 plan too (later micro-batches accumulate; 0 otherwise).
    fn build_engine_plans(
        &self,
        micro_problem: &ConvProblem,
        op: ConvOp,
        config: &EngineConfig,
        alignments: Alignments,
    ) -> Result<(EnginePlan, u64), CudnnError> {
        let plan = EnginePlan::with_alignments(
            &self.handle,
            micro_problem,
            op,
            config,
            1.0,
            0.0,
            alignments,
        )?;
        let accumulating_bytes = if op == ConvOp::BackwardFilter {
            EnginePlan::with_alignments(
                &self.handle,
                micro_problem,
                op,
                config,
                1.0,
                1.0,
                alignments,
            )?
            .workspace_bytes()
        } else {
            0
        };
        Ok((plan, accumulating_bytes))
    }

    fn time_algo(
        &mut self,
        d: &ConvDescriptors,
        op: ConvOp,
        algo: u32,
        first: usize,
        timing: &TimingSettings,
    ) -> Result<f64, CudnnError> {
        let micro = d.problem().n as usize;
        self.time_views(op, micro, first, |handle, a, b, out, workspace| {
            time_calls(handle, timing, || {
                // beta = 0: outputs are overwritten, so repeated calls stay finite.
                handle.convolve(
                    d,
                    op,
                    algo,
                    1.0,
                    0.0,
                    DeviceOperands::new(a, b, out, workspace),
                )
            })
        })
    }
}

impl CudnnBackend {
    /// Runs `run` on the `(a, b, out)` views of one spatial chunk of the full operands, at the
    /// offsets the chunk runs at (see [`ChunkShapes::range`]), and the workspace.
    fn time_chunk_views<R>(
        &mut self,
        op: ConvOp,
        chunk: &ChunkShapes,
        run: impl for<'v> FnOnce(
            &CudnnHandle,
            &super::cudnn::DeviceView<'v>,
            &super::cudnn::DeviceView<'v>,
            &mut super::cudnn::DeviceViewMut<'v>,
            &mut super::cudnn::WorkspaceView<'v>,
        ) -> Result<R, CudnnError>,
    ) -> Result<R, CudnnError> {
        self.views_at(op, operand_roles(op).map(|role| chunk.range(role)), run)
    }

    /// Times one engine configuration on the timing chunks of a spatial size: every chunk's
    /// plan is built first (declaring `alignments`, and for backward-filter also with beta 1,
    /// which later chunks use), so a configuration that cannot run at one position is
    /// unsupported for the size; then each is timed at its own offsets. The time is the
    /// slowest chunk's, the workspace the largest.
    fn time_engine_chunks(
        &mut self,
        op: ConvOp,
        size: i64,
        chunks: &[ChunkShapes],
        config: &EngineConfig,
        alignments: Alignments,
        how: &MeasureSettings,
    ) -> Result<EngineOutcome, CudnnError> {
        let (timing, select) = (&how.timing, &how.select);
        let skip = |e: &CudnnError| e.is_not_supported() || e.is_out_of_memory();
        let started = std::time::Instant::now();
        let built = self.build_chunk_plans(op, chunks, config, alignments);
        self.record_build(PlanBuild {
            op,
            size,
            config: config.name(),
            plans: chunks.len() * if op == ConvOp::BackwardFilter { 2 } else { 1 },
            seconds: started.elapsed().as_secs_f64(),
            built: built.is_ok(),
        });
        let (plans, bytes) = match built {
            Ok(built) => built,
            Err(e) if skip(&e) => return Ok(EngineOutcome::Unsupported),
            Err(e) => return Err(e),
        };
        if select.decide(&Algo::Engine(config.name()), bytes) == Decision::Skip {
            return Ok(EngineOutcome::Skipped(bytes));
        }
        match self.ensure_workspace(bytes) {
            Ok(()) => {}
            Err(e) if e.is_out_of_memory() => return Ok(EngineOutcome::Unsupported),
            Err(e) => return Err(e),
        }
        let mut slowest = 0.0f64;
        for (chunk, plan) in chunks.iter().zip(&plans) {
            let timed = self.time_chunk_views(op, chunk, |handle, a, b, out, workspace| {
                time_calls(handle, timing, || {
                    plan.execute(handle, DeviceOperands::new(a, b, out, workspace))
                })
            });
            match timed {
                Ok(ms) => slowest = slowest.max(ms),
                Err(e) if skip(&e) => return Ok(EngineOutcome::Unsupported),
                Err(e) => return Err(e),
            }
        }
        let notes = plans.first().map(EnginePlan::notes).unwrap_or_default();
        Ok(EngineOutcome::Timed(slowest, bytes, notes))
    }

    /// Every timing chunk's beta-0 plan of `config` (and for backward-filter its beta-1 plan,
    /// which later chunks use, for its workspace), declaring `alignments`; the largest
    /// workspace of them all.
    fn build_chunk_plans(
        &self,
        op: ConvOp,
        chunks: &[ChunkShapes],
        config: &EngineConfig,
        alignments: Alignments,
    ) -> Result<(Vec<EnginePlan>, u64), CudnnError> {
        let betas: &[f32] = if op == ConvOp::BackwardFilter {
            &[0.0, 1.0]
        } else {
            &[0.0]
        };
        let mut plans = Vec::with_capacity(chunks.len());
        let mut bytes = 0;
        for chunk in chunks {
            for &beta in betas {
                let plan =
                    EnginePlan::for_chunk(&self.handle, chunk, op, config, 1.0, beta, alignments)?;
                bytes = bytes.max(plan.workspace_bytes());
                if beta == 0.0 {
                    plans.push(plan);
                }
            }
        }
        Ok((plans, bytes))
    }
}

/// Says once per process that outputs were left uncompared, and why.
fn warn_uncompared(e: &CudnnError) {
    static WARNED: std::sync::Once = std::sync::Once::new();
    WARNED.call_once(|| {
        eprintln!(
            "mucudnn: warning: candidates' outputs cannot be compared on this GPU ({e}); \
             their measurements stay unverified"
        )
    });
}

/// Files a timed candidate as a measurement, or as rejected when its output was over its
/// tolerance.
fn file(found: &mut Measured, measurement: Measurement) {
    if measurement.is_rejected() {
        found.rejected.push(measurement);
    } else {
        found.measurements.push(measurement);
    }
}

/// The median time of one `call` per [`TimingSettings`], with CUDA events on `handle`'s stream.
fn time_calls(
    handle: &CudnnHandle,
    timing: &TimingSettings,
    mut call: impl FnMut() -> Result<(), CudnnError>,
) -> Result<f64, CudnnError> {
    let timer = handle.timer()?;
    median_time(timing, |iterations| {
        let ms = timer.time(|| {
            for _ in 0..iterations {
                call()?;
            }
            Ok(())
        })?;
        Ok(f64::from(ms))
    })
}

impl Backend for CudnnBackend {
    fn fingerprint(&self) -> &DeviceFingerprint {
        &self.fingerprint
    }

    /// The GPU's global memory.
    fn memory_bytes(&self) -> Option<u64> {
        Some(self.memory_bytes)
    }

    fn kinds(&self) -> &'static [AlgoKind] {
        self.kinds
    }

    /// The full-batch operands live on the GPU and must fit before anything is allocated
    /// (cudaMalloc failures are errors already). The host stages one small block per operand
    /// ([`CudnnHandle::alloc_tiled`]), never a whole tensor.
    fn check_fits(&self, problem: &ConvProblem) -> Result<(), BackendError> {
        let device = super::operand_bytes(problem);
        if device > u128::from(self.memory_bytes) {
            return Err(super::out_of_memory(
                &format!("{}: the full-batch tensors", problem.describe()),
                u64::try_from(device).unwrap_or(u64::MAX),
                self.memory_bytes,
                "is the GPU's memory",
            ));
        }
        Ok(())
    }

    fn has_candidate(&self, op: ConvOp, algo: &Algo) -> bool {
        match algo {
            Algo::Legacy(number) => *number < algo_count(op),
            Algo::Engine(_) => self.kinds.contains(&AlgoKind::Engine),
        }
    }

    /// Legacy algorithms by cuDNN's documented determinism (what its perf results report);
    /// engine configurations never: their numerical notes are not kept with measurements,
    /// so one measured earlier cannot be vouched for (see [`legacy_deterministic`]).
    fn is_deterministic(&self, op: ConvOp, algo: &Algo) -> bool {
        match algo {
            Algo::Legacy(number) => legacy_deterministic(op, *number),
            Algo::Engine(_) => false,
        }
    }

    /// Legacy algorithms and engine configurations at a micro-batch size; engine
    /// configurations only on spatial chunks (see [`CudnnBackend::measure_spatial`]).
    fn supports(&self, key: &MeasureKey) -> bool {
        self.kinds.contains(&key.kind) && (key.split.is_batch() || key.kind == AlgoKind::Engine)
    }

    fn measure(
        &mut self,
        key: &MeasureKey,
        how: &MeasureSettings,
    ) -> Result<Measured, BackendError> {
        check_key(self, key)?;
        match (key.split, key.kind) {
            (SplitDim::Batch, AlgoKind::Legacy) => self.measure_legacy(key, how),
            (SplitDim::Batch, AlgoKind::Engine) => self.measure_engines(key, how),
            (SplitDim::Spatial, _) => self.measure_spatial(key, how),
        }
    }

    fn release(&mut self) {
        self.operands = None;
        self.workspace = None;
        self.reference = None;
        self.memory = MemoryUse::default();
    }

    fn memory(&self) -> MemoryUse {
        self.memory
    }
}

impl CudnnBackend {
    /// Enumerates configurations with cuDNN's heuristics (modes A, B and the fallback list, in
    /// that ranking, at most `search.max_candidates`), builds each one's execution plan for
    /// the micro-batch, and times it like a legacy algorithm (same offsets, same clock).
    /// Configurations cuDNN cannot build or run here are left out.
    fn measure_engines(
        &mut self,
        key: &MeasureKey,
        how: &MeasureSettings,
    ) -> Result<Measured, BackendError> {
        let (problem, op, micro) = (&key.problem, key.op, key.size);
        let MeasureSettings {
            timing,
            search,
            select,
            verify,
        } = how;
        check_measure_args(problem, micro)?;
        graph_api_status()?;
        if self.operands.as_ref().is_none_or(|o| o.problem != *problem) {
            self.check_fits(problem)?;
        }
        self.ensure_operands(problem)?;
        let micro_problem = problem.with_batch(micro);
        let heuristics = self.heuristics(search.max_candidates);
        let first = timing_offset(problem.n as usize, micro as usize);
        let alignments = Alignments::any_sample(&ConvShapes::new(&micro_problem)?);
        let configs = engine_configs_with_alignments(
            &self.handle,
            &micro_problem,
            op,
            &heuristics,
            alignments,
        )?;
        let mut found = Measured {
            verification: how.size_verification(),
            ..Measured::default()
        };
        if *verify {
            self.ensure_reference(problem, op, micro, first)?;
        }
        for config in configs {
            let name = config.name();
            if search.skip.contains(&name) || !select.wants(&Algo::Engine(name)) {
                continue;
            }
            match self.time_engine(&micro_problem, op, &config, first, timing, select)? {
                EngineOutcome::Unsupported => {}
                EngineOutcome::Skipped(workspace_bytes) => found.skipped.push(Skipped {
                    micro,
                    algo: Algo::Engine(name),
                    workspace_bytes,
                }),
                EngineOutcome::Timed(time_ms, workspace_bytes, notes) => {
                    let algo = Algo::Engine(name);
                    let verification =
                        self.verify_timed(*verify, problem, op, &algo, Some(notes), micro, first)?;
                    file(
                        &mut found,
                        Measurement {
                            micro,
                            algo,
                            time_ms: time_ms.max(1e-6),
                            workspace_bytes,
                            verification,
                        },
                    )
                }
            }
        }
        Ok(found)
    }

    /// Engine configurations only: each chunk of
    /// [`timing_chunks`] runs as views of the full operands at its real offsets, with its own
    /// pre/post padding along the split axis ([`ChunkShapes`]); the tensors declare what
    /// holds at every row offset ([`ChunkShapes::any_row_alignments`]), so what is timed
    /// builds wherever a plan puts the chunk. Configurations come from cuDNN's heuristics at
    /// each timing position (their union, in that order, capped at `search.max_candidates`).
    /// Legacy algorithms are [`BackendError::NoSpatial`]: a legacy descriptor pads both sides
    /// of an axis alike, and a chunk at the border of a padded axis pads one side only, so
    /// they are left out of spatial plans (see docs/gpu.md).
    fn measure_spatial(
        &mut self,
        key: &MeasureKey,
        how: &MeasureSettings,
    ) -> Result<Measured, BackendError> {
        let (problem, op, size, kind) = (&key.problem, key.op, key.size, key.kind);
        let MeasureSettings { search, select, .. } = how;
        check_chunk_args(problem, op, size)?;
        if kind == AlgoKind::Legacy {
            return Err(BackendError::NoSpatial {
                backend: self.fingerprint.name.clone(),
                kind,
            });
        }
        graph_api_status()?;
        if self.operands.as_ref().is_none_or(|o| o.problem != *problem) {
            self.check_fits(problem)?;
        }
        self.ensure_operands(problem)?;
        let geometry = AxisGeometry::of(problem, split_axis(problem));
        let chunks = timing_chunks(&geometry, op, size)
            .iter()
            .map(|chunk| ChunkShapes::new(problem, chunk))
            .collect::<Result<Vec<_>, _>>()?;
        // Chunks are not compared on the GPU (a chunk's reference would be rows of a whole
        // reference output): the size counts as measured with verification, its candidates
        // carry none.
        let Some(first) = chunks.first() else {
            return Ok(Measured {
                verification: how.size_verification(),
                ..Measured::default()
            });
        };
        // The least alignment of any row offset (every position of a size has the same).
        let alignments = first.any_row_alignments();
        let heuristics = self.heuristics(search.max_candidates);
        let mut names: Vec<EngineName> = Vec::new();
        let mut configs: Vec<EngineConfig> = Vec::new();
        for chunk in &chunks {
            let found =
                match engine_configs_for_chunk(&self.handle, chunk, op, &heuristics, alignments) {
                    Ok(found) => found,
                    Err(e) if e.is_not_supported() => Vec::new(),
                    Err(e) => return Err(e.into()),
                };
            for config in found {
                let name = config.name();
                if configs.len() < heuristics.max_candidates && !names.contains(&name) {
                    names.push(name);
                    configs.push(config);
                }
            }
        }
        let mut found = Measured {
            verification: how.size_verification(),
            ..Measured::default()
        };
        for (config, name) in configs.iter().zip(names) {
            if search.skip.contains(&name) || !select.wants(&Algo::Engine(name)) {
                continue;
            }
            match self.time_engine_chunks(op, size, &chunks, config, alignments, how)? {
                EngineOutcome::Unsupported => {}
                EngineOutcome::Skipped(workspace_bytes) => found.skipped.push(Skipped {
                    micro: size,
                    algo: Algo::Engine(name),
                    workspace_bytes,
                }),
                EngineOutcome::Timed(time_ms, workspace_bytes, _) => {
                    found.measurements.push(Measurement {
                        micro: size,
                        algo: Algo::Engine(name),
                        time_ms: time_ms.max(1e-6),
                        workspace_bytes,
                        verification: None,
                    })
                }
            }
        }
        Ok(found)
    }

    /// Every legacy algorithm of `key.op` at micro-batch size `key.size`.
    fn measure_legacy(
        &mut self,
        key: &MeasureKey,
        how: &MeasureSettings,
    ) -> Result<Measured, BackendError> {
        let (problem, op, micro) = (&key.problem, key.op, key.size);
        let MeasureSettings {
            timing,
            select,
            verify,
            ..
        } = how;
        check_measure_args(problem, micro)?;
        if self.operands.as_ref().is_none_or(|o| o.problem != *problem) {
            self.check_fits(problem)?;
        }
        self.ensure_operands(problem)?;
        let d = ConvDescriptors::new(&problem.with_batch(micro))?;
        // Sample 1 whenever the plan splits the batch: the least-aligned offset a micro-batch
        // of this size can run at (`solver::timing_offset`).
        let first = timing_offset(problem.n as usize, micro as usize);
        let mut found = Measured {
            verification: how.size_verification(),
            ..Measured::default()
        };
        if *verify {
            self.ensure_reference(problem, op, micro, first)?;
        }
        for algo in 0..algo_count(op) {
            if !select.wants(&Algo::Legacy(algo)) {
                continue;
            }
            let Some(workspace_bytes) = self.handle.workspace_size(&d, op, algo)? else {
                continue;
            };
            if select.decide(&Algo::Legacy(algo), workspace_bytes) == Decision::Skip {
                found.skipped.push(Skipped {
                    micro,
                    algo: Algo::Legacy(algo),
                    workspace_bytes,
                });
                continue;
            }
            match self
                .ensure_workspace(workspace_bytes)
                .and_then(|()| self.time_algo(&d, op, algo, first, timing))
            {
                Ok(time_ms) => {
                    let algo = Algo::Legacy(algo);
                    let verification =
                        self.verify_timed(*verify, problem, op, &algo, None, micro, first)?;
                    file(
                        &mut found,
                        Measurement {
                            micro,
                            algo,
                            time_ms: time_ms.max(1e-6),
                            workspace_bytes,
                            verification,
                        },
                    )
                }
                // Unsupported when run, or its workspace does not fit in memory: leave it out.
                Err(e) if e.is_not_supported() || e.is_out_of_memory() => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(found)
    }
}
