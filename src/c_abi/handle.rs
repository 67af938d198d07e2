//! What a `mucudnnHandle_t` is: the caller's cuDNN handle and stream, the tuning settings, one
//! prepared plan per (problem, op) seen so far, and the one workspace they share (C holds a
//! handle as a token of [`super::registry::Registry`]).
//!
//! A convolution call reads the caller's descriptors into a [`ConvProblem`], tunes on first
//! sight of the (problem, op) (profile every algorithm at every micro-batch size the policy
//! allows, on the same GPU, then solve under the workspace limit), prepares the plan once
//! (descriptors per micro-batch size, workspace sizes), and executes it on the caller's handle
//! and stream: one cuDNN call per micro-batch on pointer offsets of the caller's tensors,
//! stepped by [`crate::solver::steps`].

use super::descriptors::{descriptor_names, problem_from_descriptors};
use super::error::{invalid, FfiError};
use crate::backend::cudnn::{
    read_convolution_descriptor, read_filter_descriptor, read_tensor_descriptor,
    save_current_context, ConvDescriptors, DeviceOperands, ForeignHandle, ForeignWorkspace,
    RawDeviceView, RawDeviceViewMut,
};
use crate::backend::CudnnBackend;
use crate::exec::check_batch_plan;
use crate::local_tuner::LocalTuner;
use crate::profiler::Job;
use crate::report::SolutionJson;
use crate::solver::{operand_roles, steps, AlgoNames, BackendKind, Operand};
use crate::solver::{ConvOp, ConvProblem, Mode, Profile, Solution, SolvedProblem, WdOptions};
use crate::tune::{profile_jobs, solve_accurately, CacheStats, LayerTuning, TuneError};
use mucudnn_cache::Cache;
use std::ffi::c_void;
use std::path::PathBuf;

/// How a handle tunes.
#[derive(Clone, Debug, PartialEq)]
pub struct Settings {
    /// Policy, timing, and the workspace limit every plan is solved under: the smaller of the
    /// per-layer limit and the total budget (see [`Settings::effective_limit`]).
    pub tuning: LayerTuning,
    /// The per-layer limit asked for (`None`: no per-layer limit).
    pub workspace_limit_bytes: Option<u64>,
    /// The total budget asked for (`None`: no total budget).
    pub total_workspace_bytes: Option<u64>,
    /// The tuning cache file; stored, and consulted once the cache is wired in (see
    /// [`Handle::tune`]).
    pub cache_path: Option<PathBuf>,
    /// Print one line per tuned (problem, op) and micro-batch size to stderr.
    pub verbose: bool,
}

impl Settings {
    /// The limit each plan is solved under. The handle runs one convolution at a time on its
    /// one workspace buffer, so that buffer is the largest plan's workspace: a total budget is
    /// met exactly by solving every plan within it (workspace reuse), and a per-layer limit by
    /// definition. With both, the smaller one binds; with neither, plans are unlimited.
    pub fn effective_limit(
        workspace_limit_bytes: Option<u64>,
        total_workspace_bytes: Option<u64>,
    ) -> u64 {
        workspace_limit_bytes
            .unwrap_or(u64::MAX)
            .min(total_workspace_bytes.unwrap_or(u64::MAX))
    }
}

/// A plan ready to run: the solved plan and its baseline, the profile it came from, and
/// cuDNN descriptors per distinct micro-batch size.
struct Prepared {
    solved: SolvedProblem,
    /// The raw measurements and the device they were taken on (kept for the cache and for
    /// workspace division across layers).
    #[allow(dead_code)]
    profile: Profile,
    /// One descriptor set per distinct micro-batch size.
    descriptors: Vec<ConvDescriptors>,
    /// For each micro-batch of the plan, its index in `descriptors`.
    descriptor_of: Vec<usize>,
    /// What cuDNN asks for the plan (the largest micro-batch's), on the caller's handle.
    workspace_bytes: u64,
}

/// Raw descriptor pointers of one call in forward roles `[input, filter, convolution, output]`
/// (x or dx, w or dw, conv, y or dy).
#[derive(Clone, Copy, Debug)]
pub struct RawDescriptors {
    pub input: *mut c_void,
    pub filter: *mut c_void,
    pub conv: *mut c_void,
    pub output: *mut c_void,
}

/// The data of one call: `out = alpha * op(a, b) + beta * out`, operands in the order of
/// [`operand_roles`]; the scalars as values (`f32`) or, as C passes them to the handle's
/// calls, as pointers to them.
#[derive(Clone, Copy, Debug)]
pub struct RawOperands<Scalar = f32> {
    pub alpha: Scalar,
    pub a: *const c_void,
    pub b: *const c_void,
    pub beta: Scalar,
    pub out: *mut c_void,
}

/// The names of an op's operands `[a, b, out]` in messages (cuDNN's argument names).
fn operand_names(op: ConvOp) -> [&'static str; 3] {
    match op {
        ConvOp::Forward => ["x", "w", "y"],
        ConvOp::BackwardData => ["w", "dy", "dx"],
        ConvOp::BackwardFilter => ["x", "dy", "dw"],
    }
}

/// A mucudnn handle (what `mucudnnHandle_t` points to, inside its registry cell).
pub struct Handle {
    foreign: ForeignHandle,
    settings: Settings,
    /// Opened at `settings.cache_path`, else the default location (fails only for a file that
    /// is not a mucudnn cache: see `mucudnn_cache::Cache::open`).
    cache: Cache,
    /// The prepared plans by (problem, op), in the order they were tuned.
    prepared: LocalTuner<(ConvProblem, ConvOp), Prepared>,
    workspace: Option<ForeignWorkspace>,
}

impl std::fmt::Debug for Handle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handle")
            .field("foreign", &self.foreign)
            .field("settings", &self.settings)
            .field("plans", &self.prepared.len())
            .finish_non_exhaustive()
    }
}

impl Handle {
    /// Fails (an invalid argument) when the cache path names a file that is not a mucudnn
    /// cache; that file is left untouched.
    pub fn new(foreign: ForeignHandle, settings: Settings) -> Result<Self, FfiError> {
        let cache = Cache::open_default(settings.cache_path.as_deref())
            .map_err(|e| super::error::cache_error("options cache_path", e))?;
        Ok(Handle {
            foreign,
            cache,
            settings,
            prepared: LocalTuner::new(),
            workspace: None,
        })
    }

    /// Sends later work to `stream`.
    ///
    /// # Safety
    ///
    /// As for the stream of [`ForeignHandle::new`].
    pub unsafe fn set_stream(&mut self, stream: *mut c_void) -> Result<(), FfiError> {
        // SAFETY: this function's contract.
        unsafe { self.foreign.set_stream(stream) }.map_err(FfiError::from)
    }

    /// The problem a call's descriptors describe.
    ///
    /// # Safety
    ///
    /// Each descriptor is null (an error) or a live descriptor of its kind, as for
    /// [`read_tensor_descriptor`].
    unsafe fn problem(op: ConvOp, d: RawDescriptors) -> Result<ConvProblem, FfiError> {
        let [input_name, filter_name, conv_name, output_name] = descriptor_names(op);
        let named = |name: &'static str| move |e| FfiError::from(e).context(name);
        // SAFETY: this function's contract.
        let (input, filter, conv, output) = unsafe {
            (
                read_tensor_descriptor(d.input).map_err(named(input_name))?,
                read_filter_descriptor(d.filter).map_err(named(filter_name))?,
                read_convolution_descriptor(d.conv).map_err(named(conv_name))?,
                read_tensor_descriptor(d.output).map_err(named(output_name))?,
            )
        };
        problem_from_descriptors(op, &input, &filter, &conv, &output)
    }

    fn layer_name(layer: Option<i64>) -> String {
        match layer {
            Some(id) => format!("layer{id}"),
            None => "unnamed".to_string(),
        }
    }

    fn context(layer: Option<i64>, problem: &ConvProblem, op: ConvOp) -> String {
        format!("{} ({}) {op}", Self::layer_name(layer), problem.describe())
    }

    /// Profiles `op` of `problem` on the handle's GPU (`foreign`'s) through `cache` and solves
    /// it under the handle's limit.
    fn tune(
        foreign: &ForeignHandle,
        settings: &Settings,
        cache: &Cache,
        layer: &str,
        problem: &ConvProblem,
        op: ConvOp,
    ) -> Result<(SolvedProblem, Profile, CacheStats), FfiError> {
        let tuning = &settings.tuning;
        // Quiet the GPU first: the caller's queued work would be timed with ours.
        foreign.synchronize()?;
        let (profile, stats) = {
            // The backend binds the device's primary context to this thread; the caller's
            // thread gets its own context back when the guard drops.
            let _context = save_current_context()?;
            let mut backend = CudnnBackend::new(foreign.ordinal())?;
            let job = Job::batch(layer, *problem, op);
            let verbose = settings.verbose;
            // Through the cache: sizes measured before (by any process, on this device) are
            // read, the others measured and stored at once.
            let run = tuning.profile_run(cache);
            let (profile, stats) = profile_jobs(&mut backend, &[job], &run, &mut |p, cached| {
                if verbose {
                    eprintln!(
                        "mucudnn: tuning {} {}: micro-batch {} {} ({}/{})",
                        p.job.layer,
                        p.job.op,
                        p.micro,
                        if cached { "from the cache" } else { "measured" },
                        p.done,
                        p.total
                    );
                }
            })
            .map_err(|e| match e {
                TuneError::Backend(e) => FfiError::from(e),
                e @ TuneError::Indexing { .. } => FfiError::NotSupported(e.to_string()),
                other => FfiError::Internal(other.to_string()),
            })?;
            if verbose && stats.measured == 0 {
                eprintln!("mucudnn: {layer} {op}: every measurement came from the cache");
            }
            (profile, stats)
            // The backend (its cuDNN handle and random operands) is freed here, then the
            // caller's context is made current again.
        };
        let mode = Mode::WorkspaceReuse {
            workspace_limit_bytes: tuning.workspace_limit_bytes,
        };
        // The sizes a bf16 backward-filter plan may not use on cuDNN are left out of the
        // solve only: the profile returned keeps every measurement.
        let mut solution = solve_accurately(&profile, tuning.policy, mode, &WdOptions::default())?;
        let solved = solution
            .problems
            .pop()
            .ok_or_else(|| FfiError::Internal("the solver returned no plan".into()))?;
        Ok((solved, profile, stats))
    }

    /// The prepared plan for `(problem, op)`, tuning and preparing it on first sight.
    fn prepare(
        &mut self,
        layer: Option<i64>,
        problem: ConvProblem,
        op: ConvOp,
    ) -> Result<&Prepared, FfiError> {
        let Handle {
            foreign,
            settings,
            cache,
            prepared,
            ..
        } = self;
        let (prepared, _) = prepared.get_or_tune(&(problem, op), || {
            let context = Self::context(layer, &problem, op);
            let (solved, profile, stats) = Self::tune(
                foreign,
                settings,
                cache,
                &Self::layer_name(layer),
                &problem,
                op,
            )
            .map_err(|e| e.context(format!("{context}: tuning")))?;
            let prepared = Self::prepare_plan(foreign, solved, profile)
                .map_err(|e| e.context(format!("{context}: preparing the plan")))?;
            if settings.verbose {
                eprintln!(
                    "mucudnn: {context}: {} in {:.3} ms predicted (undivided {}), workspace {} bytes",
                    prepared
                        .solved
                        .plan
                        .split_string(AlgoNames::new(BackendKind::Cuda)),
                    prepared.solved.plan.time_ms(),
                    prepared
                        .solved
                        .undivided
                        .as_ref()
                        .map_or("-".to_string(), |u| format!("{:.3} ms", u.time_ms())),
                    prepared.workspace_bytes
                );
            }
            Ok::<_, FfiError>((prepared, stats))
        })?;
        Ok(prepared)
    }

    /// Descriptors per micro-batch size, and the workspace cuDNN asks for on the caller's handle.
    fn prepare_plan(
        foreign: &ForeignHandle,
        solved: SolvedProblem,
        profile: Profile,
    ) -> Result<Prepared, FfiError> {
        let plan = &solved.plan;
        check_batch_plan(plan).map_err(|e| FfiError::Internal(e.to_string()))?;
        let session = foreign.activate()?;
        let mut descriptors: Vec<ConvDescriptors> = Vec::new();
        let mut sizes: Vec<i64> = Vec::new();
        let mut descriptor_of = Vec::with_capacity(plan.micro_batches.len());
        let mut workspace_bytes = 0;
        for mb in &plan.micro_batches {
            let index = match sizes.iter().position(|&size| size == mb.size) {
                Some(index) => index,
                None => {
                    descriptors.push(ConvDescriptors::new(&plan.problem.with_batch(mb.size))?);
                    sizes.push(mb.size);
                    sizes.len() - 1
                }
            };
            // Plans for the C ABI come from legacy algorithms only (see `Settings`).
            let algo = mb.algo.legacy().ok_or_else(|| {
                invalid(format!(
                    "engine configuration {} cannot run through the C ABI",
                    mb.algo
                ))
            })?;
            let bytes = session
                .workspace_size(&descriptors[index], plan.op, algo)?
                .ok_or_else(|| {
                    FfiError::Cudnn(crate::backend::cudnn::CudnnError::InvalidArgument {
                        call: "mucudnn plan",
                        detail: format!(
                            "cuDNN does not support algorithm {} at micro-batch {} on this handle",
                            mb.algo, mb.size
                        ),
                    })
                })?;
            workspace_bytes = workspace_bytes.max(bytes);
            descriptor_of.push(index);
        }
        drop(session);
        Ok(Prepared {
            solved,
            profile,
            descriptors,
            descriptor_of,
            workspace_bytes,
        })
    }

    /// The workspace a layer's plan for `op` needs (tuning it if needed).
    ///
    /// # Safety
    ///
    /// As for [`Self::problem`]: the descriptors are null or live.
    pub unsafe fn workspace_size(
        &mut self,
        op: ConvOp,
        d: RawDescriptors,
    ) -> Result<u64, FfiError> {
        // SAFETY: this function's contract.
        let problem = unsafe { Self::problem(op, d) }?;
        Ok(self.prepare(None, problem, op)?.workspace_bytes)
    }

    /// Grows the one workspace to at least `bytes` (the old one is freed after the GPU has
    /// finished with it).
    fn ensure_workspace(&mut self, bytes: u64) -> Result<(), FfiError> {
        if self.workspace.as_ref().is_none_or(|w| w.bytes() < bytes) {
            self.workspace = None;
            self.workspace = Some(self.foreign.alloc_workspace(bytes)?);
        }
        Ok(())
    }

    /// `out = alpha * op(a, b) + beta * out` over the whole mini-batch the descriptors
    /// describe, run as the (problem, op)'s plan on the caller's handle and stream.
    ///
    /// # Safety
    ///
    /// - the descriptors are as for [`Self::problem`];
    /// - `a`, `b` and `out` are the device addresses of the tensors the descriptors describe for
    ///   roles `[a, b, out]` of `op` (x/w/y, w/dy/dx, x/dy/dw), readable (and writable for
    ///   `out`) by the handle's GPU, packed as described, allocated until the queued work has
    ///   finished, and not written by anyone else meanwhile; `out` overlaps neither input.
    pub unsafe fn convolve(
        &mut self,
        op: ConvOp,
        layer: Option<i64>,
        d: RawDescriptors,
        operands: RawOperands,
    ) -> Result<(), FfiError> {
        // SAFETY: this function's contract.
        let problem = unsafe { Self::problem(op, d) }?;
        let context = Self::context(layer, &problem, op);
        let workspace_bytes = self.prepare(layer, problem, op)?.workspace_bytes;
        self.ensure_workspace(workspace_bytes).map_err(|e| {
            e.context(format!(
                "{context}: allocating {workspace_bytes} workspace bytes"
            ))
        })?;
        // SAFETY: this function's contract (the operands).
        unsafe { self.run(op, problem, operands) }.map_err(|e| e.context(context))
    }

    /// Executes the prepared plan of `(problem, op)`.
    ///
    /// # Safety
    ///
    /// As for the operands of [`Self::convolve`].
    unsafe fn run(
        &mut self,
        op: ConvOp,
        problem: ConvProblem,
        operands: RawOperands,
    ) -> Result<(), FfiError> {
        let Handle {
            foreign,
            prepared,
            workspace,
            ..
        } = self;
        let prepared = prepared
            .get(&(problem, op))
            .ok_or_else(|| FfiError::Internal("running a plan that was not prepared".into()))?;
        let workspace = workspace
            .as_mut()
            .ok_or_else(|| FfiError::Internal("no workspace".into()))?;
        let plan = &prepared.solved.plan;
        let roles = operand_roles(op);
        let per_sample = roles.map(|role| role.elements_per_sample(&problem));
        let n = usize::try_from(problem.n).map_err(|_| invalid("negative batch"))?;
        let whole = |i: usize| match roles[i] {
            Operand::Filter => per_sample[i],
            Operand::Input | Operand::Output => per_sample[i] * n,
        };
        let names = operand_names(op);
        let dtype = problem.dtype;
        let named = |i: usize| move |e| FfiError::from(e).context(names[i]);
        // SAFETY: the operands are the caller's tensors as this function's contract says, with
        // exactly the element counts the (validated) problem gives their roles; they stay valid
        // for this call and the work it queues, which is all the views are used for.
        let (a, b, mut out) = unsafe {
            (
                RawDeviceView::new(operands.a, whole(0), dtype).map_err(named(0))?,
                RawDeviceView::new(operands.b, whole(1), dtype).map_err(named(1))?,
                RawDeviceViewMut::new(operands.out, whole(2), dtype).map_err(named(2))?,
            )
        };
        let session = foreign.activate()?;
        // Kernels captured into a CUDA graph use the workspace whenever the graph replays.
        if session.is_capturing()? {
            workspace.captured();
        }
        let mut workspace = session.workspace(workspace)?;
        session.check_memory(
            "mucudnn",
            [(names[0], &a), (names[1], &b)],
            (names[2], &out),
        )?;
        for (step, &index) in steps(plan, operands.beta).zip(&prepared.descriptor_of) {
            let range = |i: usize| step.range(roles[i], per_sample[i]);
            let (ra, rb, ro) = (range(0), range(1), range(2));
            let a = a.slice(ra.0, ra.1)?;
            let b = b.slice(rb.0, rb.1)?;
            let mut out = out.slice_mut(ro.0, ro.1)?;
            let algo = step.algo.legacy().ok_or_else(|| {
                invalid(format!(
                    "engine configuration {} cannot run through the C ABI",
                    step.algo
                ))
            })?;
            session
                .convolve(
                    &prepared.descriptors[index],
                    op,
                    algo,
                    operands.alpha,
                    step.beta,
                    DeviceOperands::new(&a, &b, &mut out, &mut workspace.reborrow()),
                )
                .map_err(|e| {
                    FfiError::from(e).context(format!(
                        "micro-batch [{}, {}) with algorithm {}",
                        step.first,
                        step.first + step.size,
                        step.algo
                    ))
                })?;
        }
        Ok(())
    }

    /// The plans tuned so far, in tuning order, as the `mucudnn solve --json` document
    /// (workspace-reuse mode under the handle's effective limit; the total workspace is the
    /// largest plan's, the size of the handle's one buffer).
    pub fn plans_json(&self) -> Result<String, FfiError> {
        let solution = Solution {
            mode: Mode::WorkspaceReuse {
                workspace_limit_bytes: self.settings.tuning.workspace_limit_bytes,
            },
            policy: self.settings.tuning.policy,
            problems: self.prepared.in_order().map(|p| p.solved.clone()).collect(),
            proven_optimal: true,
            method: "dp",
            names: AlgoNames::new(BackendKind::Cuda),
        };
        serde_json::to_string_pretty(&SolutionJson::new(&solution))
            .map_err(|e| FfiError::Internal(format!("writing the plan document: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn effective_limit() {
        assert_eq!(Settings::effective_limit(Some(64 << 20), None), 64 << 20);
        assert_eq!(Settings::effective_limit(None, Some(1 << 30)), 1 << 30);
        assert_eq!(Settings::effective_limit(Some(64), Some(32)), 32);
        assert_eq!(Settings::effective_limit(None, None), u64::MAX);
    }

    #[test]
    fn operand_names_follow_cudnn() {
        assert_eq!(operand_names(ConvOp::BackwardData), ["w", "dy", "dx"]);
        assert_eq!(operand_names(ConvOp::BackwardFilter), ["x", "dy", "dw"]);
    }
}
