//! What a `mucudnnTuner_t` is: one device (the CPU backend, or one GPU), the tuning cache, and
//! the plan sets prepared so far; the layer API that language bindings (the PyTorch package,
//! `python/mucudnn`) stand on.
//!
//! Unlike a `mucudnnHandle_t`, a tuner takes no cuDNN descriptors: a convolution is a
//! [`ConvProblem`] (JSON), so the caller needs no cuDNN of its own. Data flows as everywhere:
//!
//! - **tune** one layer's problem through the cache (profile what is missing, solve the three
//!   ops under a per-layer limit), returning the plans and how many measurements were cached or
//!   measured;
//! - or, to deal the measuring out over the ranks of a distributed job: list the **missing**
//!   tasks of a set of layers, **measure** a share of them, and **store** the measurements
//!   other ranks (of the same device fingerprint) took; tuning then finds everything cached;
//! - **prepare** the three plans of one input shape for execution (an id, and the workspace
//!   each op needs), then **execute** them: on the CPU over host pointers, on a GPU over
//!   device pointers on the caller's stream with the caller's workspace (mucudnn allocates
//!   nothing on that path and never synchronises with the host).
//!
//! A tuner is shared by threads: each call locks it (a second thread waits, unlike a
//! `mucudnnHandle_t`, which refuses it), so a framework may call forward on one thread and
//! backward on another.

use super::error::{cache_error, echo, invalid, FfiError};
use super::handle::RawOperands;
use super::json::{self, parse_document, Document, Size};
use super::registry::Shared;
use crate::backend::cpu::{self, AlignedWorkspace};
use crate::backend::cudnn::{
    check_one_libcudnn, save_current_context, CudnnHandle, CurrentContextGuard, DeviceOperands,
    DropInCallerContext, RawDeviceView, RawDeviceViewMut, RawWorkspace,
};
use crate::backend::{Backend, BackendError, CpuBackend, CudnnBackend, TimingSettings};
use crate::exec::cudnn::PreparedPlan;
use crate::exec::{check_plan, cpu_workspace_bytes, execute_cpu, ExecError};
use crate::local_tuner::LocalTuner;
use crate::solver::{
    operand_roles, AlgoNames, CandidateSet, ConvOp, ConvProblem, DType, DeviceFingerprint, Plan,
    Policy,
};
use crate::tune::{
    measure_task, missing_tasks, store_measured, CacheStats, LayerTuning, MeasureTask,
    MeasuredTask, SplitSetting, TuneError,
};
use mucudnn_cache::Cache;
use serde::{Deserialize, Serialize};
use std::ffi::c_void;
use std::path::PathBuf;

/// Which device a tuner measures and runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TunerDevice {
    Cpu,
    /// A GPU by CUDA ordinal.
    Cuda(usize),
}

/// How a tuner tunes one layer: a JSON object with any of `policy` (`"undivided"`,
/// `"power-of-two"`, `"all"`), `workspace_limit` (bytes, `"64MiB"`, or `null` for none),
/// `candidates` (`"legacy"`, `"engines"`, `"all"`), `max_candidates` (a number or `null`),
/// `prune_margin` (a factor > 1, or `null` to time every configuration), `deterministic`
/// (`true`: plans from deterministic candidates only, cached apart) and `ops` (the ops to
/// tune, measure and return: a non-empty array of `"fwd"`, `"bwd_data"`, `"bwd_filter"`; e.g.
/// `["fwd"]` for inference) and `split` (what a plan splits: `"batch"`, micro-batches only;
/// `"spatial"`, chunks along the outermost spatial dimension only; `"auto"`, micro-batches and,
/// for a batch of at most 4 under workspace pressure, chunks too, the faster plan kept), and
/// `runtime_compiled` (`true`: also time engine configurations that compile kernels at run
/// time, NVRTC, seconds per plan build; default false; on the CPU it changes nothing), and
/// `verify` (`false`: do not compare candidates' outputs with the reference candidate's while
/// measuring; default true, so a candidate that computes wrong numbers is never planned).
/// Missing keys take the defaults of `mucudnn tune` (power-of-two, 64 MiB, all, no bound, 1.5,
/// false, auto, verified) and all three ops; unknown keys are errors.
pub fn parse_settings(text: &str, device: TunerDevice) -> Result<Settings, FfiError> {
    let document: SettingsDocument = parse_document(
        text,
        &Document {
            name: "settings",
            not_json: "settings are not JSON",
            not_object: "settings must be a JSON object, not",
        },
    )?;
    let mut tuning = LayerTuning {
        workspace_limit_bytes: super::MUCUDNN_DEFAULT_WORKSPACE_LIMIT,
        ..LayerTuning::new(match device {
            TunerDevice::Cpu => TimingSettings::CPU,
            TunerDevice::Cuda(_) => TimingSettings::GPU,
        })
    };
    if let Some(policy) = document.policy {
        tuning.policy = json::choice(
            "settings: policy",
            "policy",
            &policy,
            &Policy::ALL,
            Policy::name,
        )?;
    }
    if let Some(split) = document.split {
        tuning.split = json::choice(
            "settings: split",
            "split",
            &split,
            &SplitSetting::ALL,
            SplitSetting::name,
        )?;
    }
    if let Some(candidates) = document.candidates {
        tuning.candidates = json::choice(
            "settings: candidates",
            "candidate set",
            &candidates,
            &CandidateSet::ALL,
            CandidateSet::name,
        )?;
    }
    match document.workspace_limit {
        None => {}
        Some(None) => tuning.workspace_limit_bytes = u64::MAX,
        Some(Some(Size(bytes))) => tuning.workspace_limit_bytes = bytes,
    }
    if let Some(bound) = document.max_candidates {
        if bound < 1 {
            return Err(invalid(format!(
                "settings: max_candidates is {bound}; give a whole number >= 1, or null"
            )));
        }
        tuning.engines.max_candidates = Some(usize::try_from(bound).unwrap_or(usize::MAX));
    }
    match document.prune_margin {
        None => {}
        Some(None) => tuning.engines.prune_margin = None,
        Some(Some(margin)) => {
            if !(margin.is_finite() && margin > 1.0) {
                return Err(invalid(format!(
                    "settings: prune_margin is {margin}; give a factor > 1, or null for no \
                     pruning"
                )));
            }
            tuning.engines.prune_margin = Some(margin);
        }
    }
    if let Some(flag) = document.deterministic {
        tuning.engines.deterministic = flag;
    }
    if let Some(flag) = document.verify {
        tuning.verify = flag;
    }
    let ops = match document.ops {
        None => ConvOp::ALL.to_vec(),
        Some(OpNames(names)) => parse_ops(&names)?,
    };
    Ok(Settings {
        tuning,
        ops,
        runtime_compiled: document.runtime_compiled.unwrap_or(false),
    })
}

/// The settings JSON of [`parse_settings`] as given: a key left out is `None`; `policy`,
/// `split` and `candidates` may not be `null`, and `null` is no limit for `workspace_limit`
/// and no pruning for `prune_margin`, the default for the rest.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SettingsDocument {
    #[serde(default, deserialize_with = "json::some")]
    policy: Option<String>,
    #[serde(default, deserialize_with = "json::present")]
    workspace_limit: Option<Option<Size>>,
    #[serde(default, deserialize_with = "json::some")]
    candidates: Option<String>,
    max_candidates: Option<u64>,
    #[serde(default, deserialize_with = "json::present")]
    prune_margin: Option<Option<f64>>,
    deterministic: Option<bool>,
    ops: Option<OpNames>,
    #[serde(default, deserialize_with = "json::some")]
    split: Option<String>,
    runtime_compiled: Option<bool>,
    verify: Option<bool>,
}

/// The `ops` of a settings object as given: an array of strings (checked by [`parse_ops`]).
#[derive(Debug)]
struct OpNames(Vec<String>);

impl<'de> Deserialize<'de> for OpNames {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct NamesVisitor;
        impl<'de> serde::de::Visitor<'de> for NamesVisitor {
            type Value = OpNames;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                write!(f, "an array of op names ({})", ConvOp::NAMES.join(", "))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<OpNames, A::Error> {
                let mut names = Vec::new();
                // Each item as JSON, so that a message shows the one that is not a name.
                while let Some(item) = seq.next_element::<serde_json::Value>()? {
                    match item {
                        serde_json::Value::String(name) => names.push(name),
                        other => {
                            return Err(serde::de::Error::custom(format!(
                                "{} is not an op name ({})",
                                echo(&other.to_string()),
                                ConvOp::NAMES.join(", ")
                            )))
                        }
                    }
                }
                Ok(OpNames(names))
            }
        }
        deserializer.deserialize_seq(NamesVisitor)
    }
}

/// The `ops` of a settings object: a non-empty array of op names, each once (a name given
/// twice is refused: it says nothing the first did not, and may be a typo for another op),
/// kept in `fwd`, `bwd_data`, `bwd_filter` order.
fn parse_ops(given: &[String]) -> Result<Vec<ConvOp>, FfiError> {
    let names = ConvOp::NAMES.join(", ");
    if given.is_empty() {
        return Err(invalid(format!(
            "settings: ops is empty; give at least one of {names} (or leave ops out for all three)"
        )));
    }
    let mut wanted = [false; 3];
    for name in given {
        // Exactly as written in the docs: the solver's parser also takes other cases, which
        // a settings document does not (an unknown name is an error, and `FWD` is unknown).
        let op = json::choice("settings: ops", "op", name, &ConvOp::ALL, ConvOp::name)?;
        if std::mem::replace(&mut wanted[op_index(op)], true) {
            return Err(invalid(format!(
                "settings: ops: `{op}` is given twice (give each op once: {names})"
            )));
        }
    }
    Ok(ConvOp::ALL
        .into_iter()
        .filter(|&op| wanted[op_index(op)])
        .collect())
}

/// What `mucudnnTunerCreate`'s options JSON says: `cache` (a file path; `null`: the default
/// location), `no_cache` (measurements in memory only) and `verbose`; unknown keys are errors.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TunerOptions {
    pub cache: Option<String>,
    pub no_cache: Option<bool>,
    pub verbose: Option<bool>,
}

impl TunerOptions {
    pub fn parse(text: &str) -> Result<Self, FfiError> {
        let options: TunerOptions = parse_document(
            text,
            &Document {
                name: "options_json",
                not_json: "options_json is not JSON",
                not_object: "options_json must be an object, not",
            },
        )?;
        if options.cache.as_deref() == Some("") {
            return Err(invalid(
                "options_json: cache is \"\"; give a file path, or null for the default",
            ));
        }
        if options.no_cache == Some(true) && options.cache.is_some() {
            return Err(invalid(
                "options_json: no_cache is true and cache names a file: give one of them (no \
                 cache keeps measurements in memory, a cache path keeps them in that file)",
            ));
        }
        Ok(options)
    }

    /// The cache file asked for (`None`: the default location).
    pub fn cache_path(&self) -> Option<PathBuf> {
        self.cache.as_ref().map(PathBuf::from)
    }
}

/// What a tuning call's settings JSON says ([`parse_settings`]): how each op tunes, and which
/// ops to tune.
#[derive(Clone, Debug, PartialEq)]
pub struct Settings {
    pub tuning: LayerTuning,
    /// The ops to tune, measure and return, in [`ConvOp::ALL`] order (never empty).
    pub ops: Vec<ConvOp>,
    /// Time engine configurations that compile kernels at run time (a GPU tuner's measuring
    /// backend: [`CudnnBackend::set_runtime_compiled`]).
    pub runtime_compiled: bool,
}

/// A layer to tune, by name: one entry of `mucudnnTunerMissing`'s document.
#[derive(Clone, Debug, Deserialize)]
pub struct NamedProblem {
    pub layer: String,
    pub problem: ConvProblem,
}

/// What `mucudnnTunerTune` returns.
#[derive(Clone, Debug, Serialize)]
pub struct TuneResult {
    /// The plans of the settings' ops, in `[forward, backward-data, backward-filter]` order
    /// (all three unless the settings name fewer).
    pub plans: Vec<Plan>,
    /// Each plan's micro-batches as `COUNTxSIZE@ALGO` runs with the algorithms' names
    /// (`4x8@im2col-batched`, `1x64@IMPLICIT_PRECOMP_GEMM`; [`Plan::split_string`]), in the
    /// order of `plans`.
    pub splits: Vec<String>,
    /// (size, candidate kind) measurements read from the cache and measured by this call
    /// (both 0 when the solved plans themselves were cached).
    pub cached: usize,
    pub measured: usize,
    /// (size, candidate) timings this call skipped because the candidate's workspace exceeded
    /// the workspace limit (recorded in the cache; a larger limit times them).
    pub skipped: usize,
    /// The most memory this call's measuring held at once: full-batch operands plus workspace,
    /// device memory on a GPU (outside the framework's allocator; cuDNN's own allocations are
    /// not counted), host memory on the CPU. All of it is freed before the call returns.
    pub peak_measuring_memory_bytes: u64,
    /// The largest workspace this call's measuring allocated (at most the limit).
    pub largest_workspace_bytes: u64,
    /// (size, candidate) outputs this call compared with the reference candidate's, and of
    /// those the candidates rejected for wrong results (never planned; 0 and 0 with
    /// `"verify": false`).
    pub verified: usize,
    pub rejected: usize,
}

/// The plans of one input shape, ready to run: each op's, or `None` for an op not prepared
/// (a set prepared for inference holds only the forward's).
enum PreparedSet {
    Cpu { plans: [Option<Plan>; 3] },
    Cuda { plans: [Option<PreparedPlan>; 3] },
}

impl PreparedSet {
    fn plan(&self, op: ConvOp) -> Option<&Plan> {
        let index = op_index(op);
        match self {
            PreparedSet::Cpu { plans } => plans[index].as_ref(),
            PreparedSet::Cuda { plans } => plans[index].as_ref().map(PreparedPlan::plan),
        }
    }
}

fn op_index(op: ConvOp) -> usize {
    ConvOp::ALL
        .iter()
        .position(|&o| o == op)
        .expect("ConvOp::ALL holds every op")
}

/// A GPU's tuning backend (made when a call measures, dropped at the end of each tune or
/// measure call) and the handle plans are prepared and run on.
struct CudaState {
    ordinal: usize,
    /// What measurements are stored under, read once when the tuner is made: asking a
    /// measuring backend for it would make a cuDNN handle and stream after every tune.
    fingerprint: DeviceFingerprint,
    tuning: Option<CudnnBackend>,
    /// The last tune or measure call's `runtime_compiled` setting, for its measuring backend.
    runtime_compiled: bool,
    exec: CudnnHandle,
}

// SAFETY: a `CudaState` holds cuDNN handles (and, through prepared plans in the same tuner, `Rc`
// clones of their owners) that are not `Send` because cuDNN forbids concurrent use of a handle.
// A tuner is reachable only through its `Mutex` (`TUNERS`, a `Shared` registry), so one thread at a time uses the
// state, every `Rc` clone lives inside the same tuner and is never handed out, and each call
// binds the handle's context to the calling thread before using it (`CudnnHandle::bind`), which
// is what cuDNN requires of a handle used by several threads one after another.
unsafe impl Send for CudaState {}

// One per tuner: the size of a variant does not matter.
#[allow(clippy::large_enum_variant)]
enum DeviceState {
    Cpu {
        backend: CpuBackend,
        /// The workspace of executions given none (a null workspace of 0 bytes): one buffer
        /// for every plan set, grown to the largest such plan's.
        workspace: AlignedWorkspace,
    },
    /// Its handles bind the GPU's context to be destroyed; the caller's is restored after.
    Cuda(DropInCallerContext<Box<CudaState>>),
}

/// What a `mucudnnTuner_t` refers to.
pub struct Tuner {
    state: DeviceState,
    cache: Cache,
    verbose: bool,
    /// Prepared sets by id (the caller tunes, through `tune`, and keeps which id holds which
    /// shape's plans).
    prepared: LocalTuner<u64, PreparedSet>,
    /// The id of the next set prepared (ids are not reused).
    next_id: u64,
}

// SAFETY: `PreparedSet::Cuda` holds prepared plans whose engine plans keep `Rc` owners of the
// tuner's own cuDNN handle; see `CudaState`: the whole tuner is used by one thread at a time,
// under its mutex, and none of those `Rc`s leaves it.
unsafe impl Send for PreparedSet {}

fn tune_error(e: TuneError) -> FfiError {
    match e {
        TuneError::Backend(e) => FfiError::from(e),
        TuneError::Solve(e) => FfiError::from(e),
        // No plan can run it: a caller runs this convolution another way (the PyTorch package
        // falls back to PyTorch's, saying why).
        e @ TuneError::Indexing { .. } => FfiError::NotSupported(e.to_string()),
        other => FfiError::Internal(other.to_string()),
    }
}

fn exec_error(e: ExecError) -> FfiError {
    match e {
        ExecError::Cudnn {
            layer, op, source, ..
        } => FfiError::from(source).context(format!("{layer} {op}")),
        ExecError::Unsupported { .. } => FfiError::PlanNotSupported(e.to_string()),
        ExecError::Cpu { .. } | ExecError::InvalidPlan { .. } => invalid(e.to_string()),
    }
}

impl Tuner {
    /// A tuner on `device` with `cache`, else the cache at `cache_path` (`None`: the default
    /// location; a cache of ours that cannot be opened falls back to memory with a warning, a
    /// file that is not a mucudnn cache is an error and left untouched, and so is a process
    /// out of file descriptors). A GPU is checked at
    /// once: no CUDA, no cuDNN or no such GPU is an error.
    pub fn new(
        device: TunerDevice,
        cache: Option<Cache>,
        cache_path: Option<PathBuf>,
        verbose: bool,
    ) -> Result<Self, FfiError> {
        let state = match device {
            TunerDevice::Cpu => DeviceState::Cpu {
                backend: CpuBackend::new(),
                workspace: AlignedWorkspace::default(),
            },
            TunerDevice::Cuda(ordinal) => {
                // Plans made by one libcudnn must never run on another's objects.
                check_one_libcudnn()?;
                let _context = save_current_context()?;
                let exec = CudnnHandle::new(ordinal)?;
                let (fingerprint, _) = CudnnBackend::describe(ordinal)?;
                DeviceState::Cuda(DropInCallerContext::new(Box::new(CudaState {
                    ordinal,
                    fingerprint,
                    tuning: None,
                    runtime_compiled: false,
                    exec,
                })))
            }
        };
        let cache = match cache {
            Some(cache) => cache,
            None => Cache::open_default(cache_path.as_deref())
                .map_err(|e| cache_error("options_json cache", e))?,
        };
        Ok(Tuner {
            state,
            cache,
            verbose,
            // The caller keeps the ids and releases the sets: none is dropped behind its back.
            prepared: LocalTuner::unbounded(),
            next_id: 0,
        })
    }

    /// Runs `f` with this tuner's measuring backend (a GPU's is made on first use, in the
    /// device's primary context; the caller's current context is restored afterwards).
    fn with_backend<T>(
        &mut self,
        f: impl FnOnce(&mut dyn Backend, &Cache) -> Result<T, FfiError>,
    ) -> Result<T, FfiError> {
        match &mut self.state {
            DeviceState::Cpu { backend, .. } => f(backend, &self.cache),
            DeviceState::Cuda(cuda) => {
                let _context = save_current_context()?;
                if cuda.tuning.is_none() {
                    cuda.tuning = Some(CudnnBackend::new(cuda.ordinal)?);
                }
                let runtime_compiled = cuda.runtime_compiled;
                let backend = cuda.tuning.as_mut().expect("made above");
                backend.set_runtime_compiled(runtime_compiled);
                backend.log_plan_builds(self.verbose);
                f(backend, &self.cache)
            }
        }
    }

    /// Keeps what of `settings` the measuring backend reads (made or not yet).
    fn use_settings(&mut self, settings: &Settings) {
        if let DeviceState::Cuda(cuda) = &mut self.state {
            cuda.runtime_compiled = settings.runtime_compiled;
        }
    }

    /// The device fingerprint measurements are stored under (ranks compare it before sharing).
    pub fn fingerprint(&mut self) -> Result<DeviceFingerprint, FfiError> {
        match &self.state {
            DeviceState::Cpu { backend, .. } => Ok(backend.fingerprint().clone()),
            DeviceState::Cuda(cuda) => Ok(cuda.fingerprint.clone()),
        }
    }

    /// Whether a GPU's measuring backend (a cuDNN handle and stream) is alive: false between
    /// tune and measure calls.
    #[cfg(test)]
    pub fn holds_measuring_backend(&self) -> bool {
        matches!(&self.state, DeviceState::Cuda(cuda) if cuda.tuning.is_some())
    }

    /// Tunes one layer's problem through the cache: the settings' ops only.
    pub fn tune(
        &mut self,
        layer: &str,
        problem: &ConvProblem,
        settings: &Settings,
    ) -> Result<TuneResult, FfiError> {
        problem
            .validate()
            .map_err(|e| invalid(format!("{}: {e}", echo(layer))))?;
        let verbose = self.verbose;
        self.use_settings(settings);
        let tuned = self.with_backend(|backend, cache| {
            settings
                .tuning
                .tune_ops_counted(backend, cache, layer, problem, &settings.ops)
                .map_err(tune_error)
        });
        self.end_measuring();
        let (plans, stats): (Vec<Plan>, CacheStats) = tuned?;
        if verbose {
            let ops: Vec<&str> = settings.ops.iter().map(|op| op.name()).collect();
            eprintln!(
                "mucudnn: tuned {layer} {} ({} measurement(s) cached, {} measured)",
                ops.join("+"),
                stats.cached,
                stats.measured
            );
        }
        let names = AlgoNames::new(self.fingerprint()?.backend);
        Ok(TuneResult {
            splits: plans.iter().map(|plan| plan.split_string(names)).collect(),
            plans,
            cached: stats.cached,
            measured: stats.measured,
            skipped: stats.skipped,
            peak_measuring_memory_bytes: stats.memory.peak_bytes,
            largest_workspace_bytes: stats.memory.largest_workspace_bytes,
            verified: stats.verified,
            rejected: stats.rejected,
        })
    }

    /// The tasks the cache lacks to tune the settings' ops of `layers`, anchors first (see
    /// [`missing_tasks`]).
    pub fn missing(
        &mut self,
        layers: Vec<NamedProblem>,
        settings: &Settings,
    ) -> Result<Vec<MeasureTask>, FfiError> {
        self.with_backend(|backend, cache| {
            let jobs: Vec<_> = layers
                .iter()
                .flat_map(|l| {
                    settings.tuning.jobs(
                        cache,
                        backend.fingerprint(),
                        backend.kinds(),
                        &l.layer,
                        &l.problem,
                        &settings.ops,
                    )
                })
                .collect();
            let run = settings.tuning.profile_run(cache);
            missing_tasks(&jobs, &run, backend.fingerprint(), backend.kinds()).map_err(tune_error)
        })
    }

    /// Drops a GPU's measuring backend (its cuDNN handle and stream too) at the end of a tune
    /// or measure call, in the device's context, keeping the caller's current context, so no
    /// measuring state outlives the call. The CPU backend holds nothing once released.
    fn end_measuring(&mut self) {
        if let DeviceState::Cuda(cuda) = &mut self.state {
            if cuda.tuning.is_some() {
                let _context = save_current_context();
                cuda.tuning = None;
            }
        }
    }

    /// Measures `tasks` of the settings' ops in order (a task of another op is left out, not
    /// measured nor returned), storing each in the cache; returns the measurements.
    pub fn measure(
        &mut self,
        tasks: &[MeasureTask],
        settings: &Settings,
    ) -> Result<Vec<MeasuredTask>, FfiError> {
        let verbose = self.verbose;
        let tasks: Vec<&MeasureTask> = tasks
            .iter()
            .filter(|task| settings.ops.contains(&task.op))
            .collect();
        self.use_settings(settings);
        let measured = self.with_backend(|backend, cache| {
            let run = settings.tuning.profile_run(cache);
            let mut out = Vec::with_capacity(tasks.len());
            for (index, task) in tasks.iter().enumerate() {
                let measured = measure_task(backend, task, &run).map_err(tune_error);
                let measured = match measured {
                    Ok(measured) => measured,
                    Err(e) => {
                        backend.release();
                        return Err(e);
                    }
                };
                if verbose {
                    eprintln!(
                        "mucudnn: measured {} {} micro-batch {} {} ({}/{})",
                        task.layer,
                        task.op,
                        task.micro,
                        task.kind,
                        index + 1,
                        tasks.len()
                    );
                }
                out.push(measured);
            }
            // Nothing measuring made outlives the call.
            backend.release();
            Ok(out)
        });
        self.end_measuring();
        measured
    }

    #[cfg(test)]
    /// The memory this tuner's measuring state holds now (0 between calls: every tune and
    /// measure call releases it). A GPU tuner that never measured holds nothing.
    pub fn measuring_memory(&self) -> crate::backend::MemoryUse {
        match &self.state {
            DeviceState::Cpu { backend, .. } => backend.memory(),
            DeviceState::Cuda(cuda) => cuda
                .tuning
                .as_ref()
                .map(Backend::memory)
                .unwrap_or_default(),
        }
    }

    /// Stores measurements taken on another device of this tuner's fingerprint: all or
    /// nothing, every record checked first ([`store_measured`]); a bad one is refused with its
    /// index.
    pub fn store(
        &mut self,
        fingerprint: &DeviceFingerprint,
        measured: &[MeasuredTask],
    ) -> Result<usize, FfiError> {
        self.with_backend(|backend, cache| {
            store_measured(cache, backend, fingerprint, measured).map_err(tune_error)
        })
    }

    /// Prepares the plans of one input shape for execution: one plan per op for one, two or
    /// all three of forward, backward-data and backward-filter (in any order; an inference
    /// caller prepares the forward's alone). Returns the id and the workspace bytes each op
    /// needs, in `[forward, backward-data, backward-filter]` order (0 for an op not prepared).
    pub fn prepare(&mut self, plans: Vec<Plan>) -> Result<(u64, [u64; 3]), FfiError> {
        let mut by_op: [Option<Plan>; 3] = [None, None, None];
        for plan in plans {
            check_plan(&plan).map_err(exec_error)?;
            let slot = &mut by_op[op_index(plan.op)];
            if slot.is_some() {
                return Err(invalid(format!("two plans for {} {}", plan.layer, plan.op)));
            }
            *slot = Some(plan);
        }
        let given: Vec<&Plan> = by_op.iter().flatten().collect();
        let Some(first) = given.first() else {
            return Err(invalid(
                "prepare takes one plan per op to prepare (fwd, bwd_data, bwd_filter), not none",
            ));
        };
        if given.iter().any(|p| p.problem != first.problem) {
            return Err(invalid("the plans are for different problems"));
        }
        let (set, workspace) = match &mut self.state {
            DeviceState::Cpu { .. } => {
                for plan in by_op.iter().flatten() {
                    if let Some(mb) = plan
                        .micro_batches
                        .iter()
                        .find(|mb| mb.algo.legacy().and_then(cpu::CpuAlgo::from_id).is_none())
                    {
                        return Err(invalid(format!(
                            "{} {}: {} is not a CPU algorithm (a plan tuned on a GPU?)",
                            plan.layer, plan.op, mb.algo
                        )));
                    }
                }
                let workspace = by_op
                    .each_ref()
                    .map(|plan| plan.as_ref().map_or(0, cpu_workspace_bytes));
                (PreparedSet::Cpu { plans: by_op }, workspace)
            }
            DeviceState::Cuda(cuda) => {
                let exec = &cuda.exec;
                let _context = save_current_context()?;
                let mut prepared: [Option<PreparedPlan>; 3] = [None, None, None];
                for (slot, plan) in prepared.iter_mut().zip(by_op) {
                    if let Some(plan) = plan {
                        *slot = Some(PreparedPlan::new(exec, plan).map_err(exec_error)?);
                    }
                }
                let workspace = prepared
                    .each_ref()
                    .map(|plan| plan.as_ref().map_or(0, PreparedPlan::workspace_bytes));
                (PreparedSet::Cuda { plans: prepared }, workspace)
            }
        };
        let id = self.next_id;
        self.next_id += 1;
        // Prepared from plans the caller tuned: no measurements of its own.
        self.prepared.insert(id, set, CacheStats::default());
        Ok((id, workspace))
    }

    /// On a GPU, the caller's current context, restored when the guard drops (destroying plans
    /// and handles binds the GPU's own); `None` on the CPU or without a driver.
    fn caller_context(&self) -> Option<CurrentContextGuard> {
        match self.state {
            DeviceState::Cpu { .. } => None,
            DeviceState::Cuda(_) => save_current_context().ok(),
        }
    }

    /// Frees a prepared set (its id is not reused).
    pub fn release(&mut self, id: u64) -> Result<(), FfiError> {
        let _context = self.caller_context();
        self.prepared
            .remove(&id)
            .map(drop)
            .ok_or_else(|| invalid(format!("plan set {id} is not prepared (or was released)")))
    }

    /// `out = alpha * op(a, b) + beta * out` with the plan of `op` in set `id`, over the whole
    /// mini-batch (operands in the order of [`crate::solver::operand_roles`], packed in the
    /// problem's layout and dtype). `operands` says what the caller's buffers are (each one's
    /// dims and extent); they are checked against the plan's problem before any pointer is
    /// read ([`check_operands`]), so a plan never runs over a tensor of another shape or a
    /// buffer too small for its role.
    ///
    /// # Safety
    ///
    /// - On the CPU: `a`, `b` and `out` point to host memory holding the problem's element
    ///   counts of their roles in its dtype, readable (`out` writable, overlapping neither
    ///   input), and `workspace` is null with `workspace_bytes == 0` (the tuner's own shared
    ///   workspace is used) or points to `workspace_bytes` writable host bytes; `stream` is
    ///   ignored.
    /// - On a GPU: the same in device memory of the tuner's GPU, each valid until the work
    ///   queued on `stream` has finished with it, and `stream` is null (the legacy default
    ///   stream) or a live stream of that GPU's primary context.
    pub unsafe fn execute(
        &mut self,
        id: u64,
        op: ConvOp,
        data: RawOperands,
        operands: &[OperandExtent; 3],
        workspace: CallerWorkspace,
        stream: *mut c_void,
    ) -> Result<(), FfiError> {
        let RawOperands {
            alpha,
            a,
            b,
            beta,
            out,
        } = data;
        let CallerWorkspace {
            pointer: workspace,
            bytes: workspace_bytes,
        } = workspace;
        let set = self
            .prepared
            .get(&id)
            .ok_or_else(|| invalid(format!("plan set {id} is not prepared (or was released)")))?;
        let plan = set.plan(op).ok_or_else(|| {
            invalid(format!(
                "plan set {id} holds no {op} plan (it was prepared without that op; tune and \
                 prepare {op} too)"
            ))
        })?;
        let problem = plan.problem;
        if !alpha.is_finite() || !beta.is_finite() {
            return Err(invalid(format!(
                "alpha ({alpha}) and beta ({beta}) must be finite"
            )));
        }
        let lens = cpu::buffer_lens(&problem, op)
            .map_err(|e| invalid(format!("{} {op}: {e}", plan.layer)))?;
        check_operands(plan, operands)?;
        for ((name, _), pointer) in lens.iter().zip([a, b, out.cast_const()]) {
            if pointer.is_null() {
                return Err(invalid(format!("{} {op}: {name} is NULL", plan.layer)));
            }
        }
        if workspace.is_null() && workspace_bytes > 0 {
            return Err(invalid(format!(
                "{} {op}: the workspace is NULL but workspace_bytes is {workspace_bytes}",
                plan.layer
            )));
        }
        match (set, &mut self.state) {
            (
                PreparedSet::Cpu { plans },
                DeviceState::Cpu {
                    workspace: shared, ..
                },
            ) => {
                let plan = plans[op_index(op)].as_ref().expect("checked above");
                let workspace = if workspace.is_null() {
                    // None given: the tuner's own, grown to this plan's.
                    let needed = cpu_workspace_bytes(plan);
                    if (shared.len() as u64) < needed {
                        *shared = AlignedWorkspace::try_new(needed).ok_or_else(|| {
                            FfiError::Backend(BackendError::OutOfMemory(format!(
                                "{} {op}: the tuner's host workspace of {needed} bytes cannot be \
                                 allocated",
                                plan.layer
                            )))
                        })?;
                    }
                    shared.as_bytes_mut()
                } else {
                    // SAFETY: this function's contract: `workspace_bytes` writable bytes.
                    unsafe { caller_workspace(plan, workspace, workspace_bytes) }?
                };
                // SAFETY: this function's contract for the CPU.
                unsafe { execute_host(plan, lens.map(|(_, len)| len), data, workspace) }
            }
            (PreparedSet::Cuda { plans }, DeviceState::Cuda(cuda)) => {
                let prepared = plans[op_index(op)].as_ref().expect("checked above");
                let exec = &cuda.exec;
                let dtype = problem.dtype;
                let layer = &prepared.plan().layer;
                let context = |e: crate::backend::cudnn::CudnnError| {
                    FfiError::from(e).context(format!("{layer} {op}"))
                };
                // SAFETY: this function's contract for a GPU: device memory of the tuner's GPU
                // with the roles' element counts in the problem's dtype, valid until the work
                // queued on `stream` finishes; `out` overlaps no input; `stream` is live and of
                // the GPU's primary context (on which `exec` was made).
                unsafe {
                    let a = RawDeviceView::new(a, lens[0].1, dtype).map_err(context)?;
                    let b = RawDeviceView::new(b, lens[1].1, dtype).map_err(context)?;
                    let mut out = RawDeviceViewMut::new(out, lens[2].1, dtype).map_err(context)?;
                    let mut workspace =
                        RawWorkspace::new(workspace, workspace_bytes).map_err(context)?;
                    let session = exec.on_stream(stream).map_err(context)?;
                    prepared
                        .execute_on(
                            &session,
                            alpha,
                            beta,
                            DeviceOperands::new(&a, &b, &mut out, &mut workspace),
                        )
                        .map_err(exec_error)
                }
            }
            _ => Err(FfiError::Internal(
                "a prepared set does not match its tuner's device".into(),
            )),
        }
    }

    pub fn device(&self) -> TunerDevice {
        match &self.state {
            DeviceState::Cpu { .. } => TunerDevice::Cpu,
            DeviceState::Cuda(cuda) => TunerDevice::Cuda(cuda.ordinal),
        }
    }
}

impl Drop for Tuner {
    fn drop(&mut self) {
        // The plans first, in the caller's context; the GPU state restores it itself.
        let _context = self.caller_context();
        self.prepared.clear();
    }
}

/// The caller's workspace of one [`Tuner::execute`] call: `bytes` at `pointer` (null with 0
/// bytes when the plan needs none).
#[derive(Clone, Copy, Debug)]
pub struct CallerWorkspace {
    pub pointer: *mut c_void,
    pub bytes: u64,
}

/// What the caller says one operand of [`Tuner::execute`] is: its dims in NCDHW order
/// (`n, c, d, h, w`; a filter `k, c/groups, t, r, s`; `d = t = 1` for a 2-D problem),
/// whatever its layout, and the bytes its buffer holds from the pointer on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OperandExtent {
    pub dims: [i64; 5],
    pub bytes: u64,
}

/// Checks the caller's operands against `plan`: each one's dims are exactly its role's in the
/// plan's problem, and its buffer holds at least the role's elements in the problem's dtype
/// (more is fine: a buffer may be a prefix of a larger allocation). A mismatch is
/// INVALID_ARGUMENT naming the layer, the op, the operand and both shapes.
pub fn check_operands(plan: &Plan, operands: &[OperandExtent; 3]) -> Result<(), FfiError> {
    let problem = &plan.problem;
    let names = match plan.op {
        ConvOp::Forward => ["x", "w", "y"],
        ConvOp::BackwardData => ["w", "dy", "dx"],
        ConvOp::BackwardFilter => ["x", "dy", "dw"],
    };
    let element = problem.dtype.size_bytes() as u64;
    for ((role, name), given) in operand_roles(plan.op).into_iter().zip(names).zip(operands) {
        let expected = role.dims(problem);
        if given.dims != expected {
            return Err(invalid(format!(
                "{} {}: {name} is {:?} but the plan is for {:?} (a plan runs only over the \
                 shapes it was tuned for)",
                plan.layer, plan.op, given.dims, expected
            )));
        }
        let needed = expected
            .iter()
            .try_fold(element, |acc, &d| acc.checked_mul(u64::try_from(d).ok()?))
            .ok_or_else(|| invalid(format!("{} {}: {name} is too large", plan.layer, plan.op)))?;
        if given.bytes < needed {
            return Err(invalid(format!(
                "{} {}: {name} holds {} bytes, its {:?} {} elements need {needed}",
                plan.layer, plan.op, given.bytes, expected, problem.dtype
            )));
        }
    }
    Ok(())
}

/// A caller's host workspace of `bytes` bytes at `pointer` (non-null), checked for alignment.
///
/// # Safety
///
/// `pointer` points to `bytes` writable host bytes that nothing else uses during the call.
unsafe fn caller_workspace<'a>(
    plan: &Plan,
    pointer: *mut c_void,
    bytes: u64,
) -> Result<&'a mut [u8], FfiError> {
    let len =
        usize::try_from(bytes).map_err(|_| invalid("workspace_bytes exceeds the address space"))?;
    if len == 0 {
        return Ok(&mut []);
    }
    if (pointer as usize) % 4 != 0 {
        return Err(invalid(format!(
            "{} {}: the workspace must be 4-byte aligned",
            plan.layer, plan.op
        )));
    }
    // SAFETY: this function's contract; non-null and aligned (checked).
    Ok(unsafe { std::slice::from_raw_parts_mut(pointer.cast::<u8>(), len) })
}

/// Runs a CPU plan over host pointers, on `workspace`.
///
/// # Safety
///
/// As for [`Tuner::execute`] on the CPU, with `lens` the element counts of `[a, b, out]`.
unsafe fn execute_host(
    plan: &Plan,
    lens: [usize; 3],
    data: RawOperands,
    workspace: &mut [u8],
) -> Result<(), FfiError> {
    let inputs = [data.a, data.b];
    let out = data.out;
    let element = plan.problem.dtype.size_bytes();
    for ((pointer, name), len) in inputs
        .iter()
        .map(|p| *p as usize)
        .chain([out as usize])
        .zip(["a", "b", "out"])
        .zip(lens)
    {
        if pointer % element != 0 {
            return Err(invalid(format!(
                "{} {}: {name} is not aligned to its {element}-byte elements",
                plan.layer, plan.op
            )));
        }
        let bytes = len.checked_mul(element);
        if bytes.and_then(|b| pointer.checked_add(b)).is_none() {
            return Err(invalid(format!(
                "{} {}: {name} wraps around",
                plan.layer, plan.op
            )));
        }
    }
    let (out_start, out_end) = (out as usize, out as usize + lens[2] * element);
    for (input, len) in inputs.iter().zip(lens) {
        let (start, end) = (*input as usize, *input as usize + len * element);
        if start < out_end && out_start < end {
            return Err(invalid(format!(
                "{} {}: the output overlaps an input",
                plan.layer, plan.op
            )));
        }
    }
    /// # Safety: as for `execute_host`, for element type `T` of the problem's dtype.
    unsafe fn typed<T: cpu::Element>(
        plan: &Plan,
        lens: [usize; 3],
        data: RawOperands,
        workspace: &mut [u8],
    ) -> Result<(), ExecError> {
        // SAFETY: the caller's contract: host memory of these lengths in dtype `T`, aligned
        // (checked), `out` writable and overlapping no input (checked).
        let (a, b, out) = unsafe {
            (
                std::slice::from_raw_parts(data.a.cast::<T>(), lens[0]),
                std::slice::from_raw_parts(data.b.cast::<T>(), lens[1]),
                std::slice::from_raw_parts_mut(data.out.cast::<T>(), lens[2]),
            )
        };
        execute_cpu(plan, data.alpha, a, b, data.beta, out, workspace)
    }
    // SAFETY: the caller's contract, with the element type of the problem's dtype.
    let result = unsafe {
        match plan.problem.dtype {
            DType::Fp32 => typed::<f32>(plan, lens, data, workspace),
            DType::Fp16 => typed::<half::f16>(plan, lens, data, workspace),
            DType::Bf16 => typed::<half::bf16>(plan, lens, data, workspace),
        }
    };
    result.map_err(exec_error)
}

// ---------------------------------------------------------------------------------------------
// The registry of live tuners

/// The live tuners by the token C holds (see [`Shared`]).
static TUNERS: Shared<Tuner> = Shared::new("tuner");

/// Registers `tuner`; the returned token is what C holds (never dereferenced).
pub fn register(tuner: Tuner) -> usize {
    TUNERS.insert(tuner)
}

/// The tuner of `token`, locked for this call.
pub fn with_tuner<T>(
    token: usize,
    f: impl FnOnce(&mut Tuner) -> Result<T, FfiError>,
) -> Result<T, FfiError> {
    TUNERS.with(token, "tuner", f)
}

/// Unregisters the tuner of `token`; it is dropped once no call uses it.
pub fn unregister(token: usize) -> Result<(), FfiError> {
    TUNERS.remove(token, "tuner")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runtime_compiled_engines_are_opt_in() {
        let parse = |text| parse_settings(text, TunerDevice::Cuda(0));
        assert!(!parse("{}").unwrap().runtime_compiled);
        assert!(
            !parse(r#"{"runtime_compiled": null}"#)
                .unwrap()
                .runtime_compiled
        );
        assert!(
            parse(r#"{"runtime_compiled": true}"#)
                .unwrap()
                .runtime_compiled
        );
        let wrong = parse(r#"{"runtime_compiled": "yes"}"#)
            .unwrap_err()
            .to_string();
        assert!(wrong.contains("runtime_compiled"), "{wrong}");
        // The backend's search leaves them out unless asked.
        assert!(crate::backend::cudnn::EngineSearch::default().skip_runtime_compiled);
    }

    #[test]
    fn verification_is_on_unless_turned_off() {
        let parse = |text| parse_settings(text, TunerDevice::Cpu);
        assert!(parse("{}").unwrap().tuning.verify);
        assert!(parse(r#"{"verify": true}"#).unwrap().tuning.verify);
        assert!(!parse(r#"{"verify": false}"#).unwrap().tuning.verify);
        let wrong = parse(r#"{"verify": 0}"#).unwrap_err().to_string();
        assert_eq!(wrong, "settings: verify is 0; give a boolean");
    }

    /// After a tune, nothing of the measuring backend is alive: the tune drops it, and the
    /// fingerprint its result names comes from the tuner, not from a new backend.
    #[test]
    #[ignore = "needs a GPU: a CUDA tuner's tune must leave no measuring handle behind"]
    fn gpu_tune_leaves_no_measuring_backend() {
        let mut tuner = Tuner::new(
            TunerDevice::Cuda(0),
            Some(Cache::in_memory().quiet()),
            None,
            false,
        )
        .unwrap();
        let settings = parse_settings(
            r#"{"workspace_limit": "8MiB", "ops": ["fwd"], "candidates": "legacy"}"#,
            TunerDevice::Cuda(0),
        )
        .unwrap();
        let mut problem = ConvProblem::new(4, 8, 8, 8, 8, 3, 3);
        (problem.pad_h, problem.pad_w) = (1, 1);
        let result = tuner.tune("gpu", &problem, &settings).unwrap();
        assert!(result.measured > 0);
        assert!(!tuner.holds_measuring_backend());
        assert_eq!(
            tuner.fingerprint().unwrap(),
            CudnnBackend::describe(0).unwrap().0
        );
        assert!(!tuner.holds_measuring_backend());
    }
}
