//! Convolution through cuDNN's graph (backend) API: the engine configurations beside the
//! legacy algorithms (part of the FFI wall).
//!
//! # Data flow
//!
//! ```text
//! ConvProblem at a micro-batch size + ConvOp (+ alpha, beta)
//!   -> GraphParams (pure, graph_params.rs)
//!   -> OperationGraph: three TENSOR descriptors (x, w, y), a CONVOLUTION descriptor, one
//!      OPERATION_CONVOLUTION_{FORWARD, BACKWARD_DATA, BACKWARD_FILTER} node, the OPERATIONGRAPH
//!   -> engine_configs(): ENGINEHEUR results (modes A, B, FALLBACK) and, optionally, every
//!      ENGINE with KNOB_INFO sweeps -> Vec<EngineConfig> (names like eng38_k2=8_k13=1)
//!   -> EnginePlan::new(): ENGINE + KNOB_CHOICEs + ENGINECFG from the name, EXECUTION_PLAN,
//!      its workspace size; built once per (problem, micro-batch size, op, config, beta)
//!   -> EnginePlan::execute(): a VARIANT_PACK of the views' device pointers (cheap, per call)
//!      and cudnnBackendExecute on the handle's stream
//! ```
//!
//! # How the calls are kept sound
//!
//! - **Gate.** The graph API's six symbols are checked (after the legacy gate, `cudnn()`)
//!   before any is called: a library without them makes [`engine_configs`] and
//!   [`EnginePlan::new`] return [`CudnnError::Unavailable`]; the legacy algorithms are not
//!   affected. Only the gate makes the [`GraphApi`] token that creating a descriptor needs.
//! - **Attributes.** `cudnnBackendSetAttribute`/`GetAttribute` take an untyped element array
//!   plus a type tag. Each tag is used by exactly one helper of [`Descriptor`], whose Rust
//!   element type is the C type of that tag (`INT64` = `i64`, `FLOAT` = `f32`, enums = 4-byte
//!   C `int`s, `BACKEND_DESCRIPTOR` = descriptor pointers, `HANDLE` = the handle, `VOID_PTR` =
//!   `void *`), and the element count passed is the slice's length. Enum values that cuDNN
//!   writes (notes, knob types) are read into `u32`s, never into Rust enums, so an unknown
//!   value is data rather than undefined behaviour.
//! - **Lifetimes.** cuDNN keeps references between descriptors (an operation refers to its
//!   tensors, an engine to its graph, a plan to its configuration and handle). Every
//!   descriptor is an RAII [`Descriptor`] destroyed exactly once, and the structs that hold
//!   them list dependents before what they depend on, so Rust drops referrers first. An
//!   [`EnginePlan`] keeps its whole chain and a share of the handle's owner, so the handle
//!   outlives the plan; before destroying its descriptors it waits for the stream, so no queued
//!   kernel outlives the plan's resources.
//! - **Execution.** [`EnginePlan::execute`] applies the checks of `Surface::convolve`
//!   (dtype and exact element count of every view against the plan's problem, every buffer on
//!   the handle's stream, workspace at least the plan's size, the same handle as the plan),
//!   plus alignment: each pointer must be aligned as its tensor descriptor declared
//!   ([`CudnnError::Misaligned`] otherwise) and the workspace to [`WORKSPACE_ALIGNMENT`].

use super::{
    check_operands, compute_type, cudnn, data_type, invalid, symbols_gate, warn_drop, CudnnError,
    CudnnHandle, DeviceOperands, HandleOwner, Origin, RestoreAfterFields, Surface,
};
use crate::backend::cudnn::engine_name::EngineConfig;
use crate::backend::cudnn::engine_search::{
    knob_combinations, EngineNotes, EngineSearch, HeurMode, KnobRange,
};
use crate::backend::cudnn::graph_params::{
    is_aligned, operand_uids, Alignments, ChunkShapes, GraphParams, TensorParams,
    WORKSPACE_ALIGNMENT,
};
use crate::backend::cudnn::known_bad::effective_math;
use crate::backend::cudnn::shape::ConvShapes;
use crate::solver::{ConvOp, ConvProblem, MathMode};
use cudarc::cudnn::sys as dnn_sys;
use std::collections::HashSet;
use std::ffi::c_void;
use std::io::Write;
use std::rc::Rc;
use std::sync::{Mutex, OnceLock};

use dnn_sys::cudnnBackendAttributeName_t as Attr;
use dnn_sys::cudnnBackendAttributeType_t as AttrType;
use dnn_sys::cudnnBackendDescriptorType_t as Kind;

/// Every graph-API symbol this module calls.
pub(super) const GRAPH_SYMBOLS: &[&str] = &[
    "cudnnBackendCreateDescriptor",
    "cudnnBackendDestroyDescriptor",
    "cudnnBackendSetAttribute",
    "cudnnBackendGetAttribute",
    "cudnnBackendFinalize",
    "cudnnBackendExecute",
];

/// The first cuDNN whose operation graphs and execution plans finalize without a handle, with
/// a device description (`CUDNN_BACKEND_DEVICEPROP_DESCRIPTOR`) for heuristics and plans
/// (cuDNN's "deviceless ahead-of-time compilation"). Older versions need the deprecated
/// `CUDNN_ATTR_OPERATIONGRAPH_HANDLE` and `CUDNN_ATTR_EXECUTION_PLAN_HANDLE`.
pub const DEVICE_DESCRIPTION_MIN_VERSION: u64 = 90800;

/// Whether the loaded cuDNN (`cudnnGetVersion()`) needs the deprecated handle attributes on
/// operation graphs and execution plans (set them only there).
pub(crate) fn needs_handle_attributes(version: u64) -> bool {
    version < DEVICE_DESCRIPTION_MIN_VERSION
}

/// Mode-B heuristics are not thread-safe inside cuDNN: cudnn-frontend finalizes them under a
/// process-wide mutex, and so does this module. Profiling runs one thread
/// per GPU, so several threads can ask at once.
static MODE_B_HEURISTICS: Mutex<()> = Mutex::new(());

/// Room for knob descriptors read back from cuDNN (cuDNN 9.21 has 44 knob types).
const KNOB_CAPACITY: usize = 64;
/// Room for numerical or behaviour notes read back from cuDNN (9.21 has 10 and 5).
const NOTE_CAPACITY: usize = 32;
/// Engine configurations accepted from one heuristics query (cuDNN returns a few dozen).
const HEURISTIC_CAPACITY: usize = 1024;
/// Engine indices looked at in a sweep (cuDNN 9 has fewer than 100 convolution engines).
const MAX_ENGINES: i64 = 4096;
/// A sweep tries at most this many configurations per candidate it may return.
const SWEEP_TRIES_PER_CANDIDATE: usize = 8;
/// Configurations one engine may try per turn of a sweep before the next engine's turn.
const SWEEP_TRIES_PER_TURN: usize = 4;

// ---------------------------------------------------------------------------------------------
// Gate

/// Proof that the graph-API gate passed: creating a [`Descriptor`] needs one.
#[derive(Clone, Copy, Debug)]
struct GraphApi {
    _private: (),
}

/// Whether the graph API can be used: cuDNN 9 is loaded and exports it (an error says why not).
pub fn graph_api_status() -> Result<(), CudnnError> {
    graph_api().map(|_| ())
}

/// Gate for the graph API: the legacy gate (`cudnn()`: libcudnn 9.x present with its legacy
/// symbols) and then [`GRAPH_SYMBOLS`]. Cached.
fn graph_api() -> Result<GraphApi, CudnnError> {
    static GATE: OnceLock<Result<(), CudnnError>> = OnceLock::new();
    GATE.get_or_init(|| {
        symbols_gate(GRAPH_SYMBOLS, |version, missing| {
            format!(
                "cuDNN {version} does not export the graph API ({missing}): engine \
                 configurations cannot be used (the legacy algorithms can)"
            )
        })
    })
    .clone()
    .map(|()| GraphApi { _private: () })
}

// ---------------------------------------------------------------------------------------------
// Descriptors

fn kind_name(kind: Kind) -> &'static str {
    match kind {
        Kind::CUDNN_BACKEND_TENSOR_DESCRIPTOR => "CUDNN_BACKEND_TENSOR_DESCRIPTOR",
        Kind::CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR => "CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR",
        Kind::CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR => {
            "CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR"
        }
        Kind::CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR => {
            "CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR"
        }
        Kind::CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR => {
            "CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR"
        }
        Kind::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR => "CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR",
        Kind::CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR => "CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR",
        Kind::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR => "CUDNN_BACKEND_ENGINECFG_DESCRIPTOR",
        Kind::CUDNN_BACKEND_ENGINE_DESCRIPTOR => "CUDNN_BACKEND_ENGINE_DESCRIPTOR",
        Kind::CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR => "CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR",
        Kind::CUDNN_BACKEND_KNOB_INFO_DESCRIPTOR => "CUDNN_BACKEND_KNOB_INFO_DESCRIPTOR",
        Kind::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR => "CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR",
        Kind::CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR => "CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR",
        Kind::CUDNN_BACKEND_DEVICEPROP_DESCRIPTOR => "CUDNN_BACKEND_DEVICEPROP_DESCRIPTOR",
        _ => "CUDNN_BACKEND_DESCRIPTOR",
    }
}

fn backend_error(call: &'static str, kind: Kind, status: dnn_sys::cudnnStatus_t) -> CudnnError {
    CudnnError::Backend {
        call,
        descriptor: kind_name(kind),
        status: format!("{status:?}"),
        code: status as u32,
        op: None,
        engine: None,
    }
}

/// One `cudnnBackendDescriptor_t` of one type, destroyed exactly once when dropped.
struct Descriptor {
    raw: dnn_sys::cudnnBackendDescriptor_t,
    kind: Kind,
}

impl std::fmt::Debug for Descriptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(kind_name(self.kind))
    }
}

impl Descriptor {
    fn new(_api: GraphApi, kind: Kind) -> Result<Self, CudnnError> {
        let mut raw: dnn_sys::cudnnBackendDescriptor_t = std::ptr::null_mut();
        // SAFETY: the gate passed (the token), so the symbol exists; the call writes one
        // pointer to a live local.
        unsafe { dnn_sys::cudnnBackendCreateDescriptor(kind, &mut raw) }
            .result()
            .map_err(|e| backend_error("cudnnBackendCreateDescriptor", kind, e.0))?;
        if raw.is_null() {
            return Err(invalid(
                "cudnnBackendCreateDescriptor",
                format!("cuDNN returned success but no {}", kind_name(kind)),
            ));
        }
        Ok(Descriptor { raw, kind })
    }

    fn error(
        &self,
        call: &'static str,
    ) -> impl FnOnce(cudarc::cudnn::result::CudnnError) -> CudnnError {
        let kind = self.kind;
        move |e| backend_error(call, kind, e.0)
    }

    /// `cudnnBackendSetAttribute(self, attr, ty, count, elements)`.
    ///
    /// # Safety
    ///
    /// `elements` points to `count` initialised values of the C type that `ty` names, readable
    /// for the duration of the call. Descriptor values must stay alive as long as `self`
    /// (cuDNN may keep references to them).
    unsafe fn set_raw(
        &self,
        attr: Attr,
        ty: AttrType,
        count: usize,
        elements: *const c_void,
    ) -> Result<(), CudnnError> {
        let count = i64::try_from(count)
            .map_err(|_| invalid("cudnnBackendSetAttribute", "too many elements".into()))?;
        // SAFETY: `self.raw` is a live descriptor (owned); the rest is the caller's contract.
        unsafe { dnn_sys::cudnnBackendSetAttribute(self.raw, attr, ty, count, elements) }
            .result()
            .map_err(self.error("cudnnBackendSetAttribute"))
    }

    fn set_i64s(&self, attr: Attr, values: &[i64]) -> Result<(), CudnnError> {
        // SAFETY: `values` holds `len` i64s, the C type of CUDNN_TYPE_INT64.
        unsafe {
            self.set_raw(
                attr,
                AttrType::CUDNN_TYPE_INT64,
                values.len(),
                values.as_ptr().cast(),
            )
        }
    }

    fn set_f32(&self, attr: Attr, value: f32) -> Result<(), CudnnError> {
        // SAFETY: one f32, the C type of CUDNN_TYPE_FLOAT.
        unsafe {
            self.set_raw(
                attr,
                AttrType::CUDNN_TYPE_FLOAT,
                1,
                (&value as *const f32).cast(),
            )
        }
    }

    fn set_data_type(&self, attr: Attr, value: dnn_sys::cudnnDataType_t) -> Result<(), CudnnError> {
        // SAFETY: one cudnnDataType_t (a C enum, `repr(u32)` here), for CUDNN_TYPE_DATA_TYPE.
        unsafe {
            self.set_raw(
                attr,
                AttrType::CUDNN_TYPE_DATA_TYPE,
                1,
                (&value as *const dnn_sys::cudnnDataType_t).cast(),
            )
        }
    }

    fn set_conv_mode(
        &self,
        attr: Attr,
        value: dnn_sys::cudnnConvolutionMode_t,
    ) -> Result<(), CudnnError> {
        // SAFETY: one cudnnConvolutionMode_t, for CUDNN_TYPE_CONVOLUTION_MODE.
        unsafe {
            self.set_raw(
                attr,
                AttrType::CUDNN_TYPE_CONVOLUTION_MODE,
                1,
                (&value as *const dnn_sys::cudnnConvolutionMode_t).cast(),
            )
        }
    }

    fn set_heur_mode(
        &self,
        attr: Attr,
        value: dnn_sys::cudnnBackendHeurMode_t,
    ) -> Result<(), CudnnError> {
        // SAFETY: one cudnnBackendHeurMode_t, for CUDNN_TYPE_HEUR_MODE.
        unsafe {
            self.set_raw(
                attr,
                AttrType::CUDNN_TYPE_HEUR_MODE,
                1,
                (&value as *const dnn_sys::cudnnBackendHeurMode_t).cast(),
            )
        }
    }

    /// A knob type as the raw value of the C enum `cudnnBackendKnobType_t` (a name may carry
    /// a knob type this build's bindings do not list).
    fn set_knob_type(&self, attr: Attr, value: u32) -> Result<(), CudnnError> {
        // SAFETY: one 4-byte value, the size of the C enum behind CUDNN_TYPE_KNOB_TYPE.
        unsafe {
            self.set_raw(
                attr,
                AttrType::CUDNN_TYPE_KNOB_TYPE,
                1,
                (&value as *const u32).cast(),
            )
        }
    }

    /// Descriptor-valued attribute. The `others` must outlive `self` (callers keep them in
    /// the same struct, declared after `self`).
    fn set_descriptors(&self, attr: Attr, others: &[&Descriptor]) -> Result<(), CudnnError> {
        let raws: Vec<dnn_sys::cudnnBackendDescriptor_t> = others.iter().map(|d| d.raw).collect();
        // SAFETY: `raws` holds `len` live descriptors, the C type of
        // CUDNN_TYPE_BACKEND_DESCRIPTOR; their lifetime is the caller's contract above.
        unsafe {
            self.set_raw(
                attr,
                AttrType::CUDNN_TYPE_BACKEND_DESCRIPTOR,
                raws.len(),
                raws.as_ptr().cast(),
            )
        }
    }

    /// The cuDNN handle (`CUDNN_TYPE_HANDLE`): it must outlive `self` (an [`EnginePlan`] holds
    /// the handle's owner).
    fn set_handle(&self, attr: Attr, handle: dnn_sys::cudnnHandle_t) -> Result<(), CudnnError> {
        // SAFETY: one cudnnHandle_t, the C type of CUDNN_TYPE_HANDLE.
        unsafe {
            self.set_raw(
                attr,
                AttrType::CUDNN_TYPE_HANDLE,
                1,
                (&handle as *const dnn_sys::cudnnHandle_t).cast(),
            )
        }
    }

    /// A string (`CUDNN_TYPE_CHAR`): its bytes, without a terminating NUL.
    fn set_chars(&self, attr: Attr, text: &str) -> Result<(), CudnnError> {
        // SAFETY: `text` holds `len` bytes, the C type (`char`) of CUDNN_TYPE_CHAR, readable
        // for the call; cuDNN copies them.
        unsafe {
            self.set_raw(
                attr,
                AttrType::CUDNN_TYPE_CHAR,
                text.len(),
                text.as_ptr().cast(),
            )
        }
    }

    /// Device addresses (`CUDNN_TYPE_VOID_PTR`). Storing them is harmless; what they point to
    /// matters only at `cudnnBackendExecute`, whose caller checks it.
    fn set_pointers(&self, attr: Attr, pointers: &[*mut c_void]) -> Result<(), CudnnError> {
        // SAFETY: `pointers` holds `len` `void *`, the C type of CUDNN_TYPE_VOID_PTR.
        unsafe {
            self.set_raw(
                attr,
                AttrType::CUDNN_TYPE_VOID_PTR,
                pointers.len(),
                pointers.as_ptr().cast(),
            )
        }
    }

    fn finalize(&self) -> Result<(), CudnnError> {
        // SAFETY: `self.raw` is a live descriptor (owned).
        unsafe { dnn_sys::cudnnBackendFinalize(self.raw) }
            .result()
            .map_err(self.error("cudnnBackendFinalize"))
    }

    /// `cudnnBackendGetAttribute(self, attr, ty, capacity, &count, elements)`; returns how
    /// many elements the attribute has (which may exceed `capacity`: only `capacity` were
    /// written).
    ///
    /// # Safety
    ///
    /// `elements` is null with `capacity == 0`, or points to `capacity` writable values of the
    /// C type that `ty` names (for descriptors: live, created descriptors of the right type).
    unsafe fn get_raw(
        &self,
        attr: Attr,
        ty: AttrType,
        capacity: usize,
        elements: *mut c_void,
    ) -> Result<usize, CudnnError> {
        let requested = i64::try_from(capacity)
            .map_err(|_| invalid("cudnnBackendGetAttribute", "too many elements".into()))?;
        let mut count: i64 = 0;
        // SAFETY: `self.raw` is live; `count` is a live local; the rest is the caller's
        // contract.
        unsafe {
            dnn_sys::cudnnBackendGetAttribute(self.raw, attr, ty, requested, &mut count, elements)
        }
        .result()
        .map_err(self.error("cudnnBackendGetAttribute"))?;
        Ok(usize::try_from(count).unwrap_or(0))
    }

    fn get_i64(&self, attr: Attr) -> Result<i64, CudnnError> {
        let mut value: i64 = 0;
        // SAFETY: room for one i64, the C type of CUDNN_TYPE_INT64.
        let count = unsafe {
            self.get_raw(
                attr,
                AttrType::CUDNN_TYPE_INT64,
                1,
                (&mut value as *mut i64).cast(),
            )
        }?;
        if count < 1 {
            return Err(invalid(
                "cudnnBackendGetAttribute",
                format!("{:?} of {self:?} has no value", attr),
            ));
        }
        Ok(value)
    }

    /// Up to `capacity` values of an enum-typed attribute, as their raw numbers.
    fn get_enums(&self, attr: Attr, ty: AttrType, capacity: usize) -> Result<Vec<u32>, CudnnError> {
        let mut values = vec![0u32; capacity];
        // SAFETY: room for `capacity` 4-byte values: cuDNN's enums are C `int`s.
        let count = unsafe { self.get_raw(attr, ty, capacity, values.as_mut_ptr().cast()) }?;
        values.truncate(count.min(capacity));
        Ok(values)
    }

    /// A descriptor-valued attribute, read into fresh descriptors of `kind`: `capacity` of
    /// them, or (with `None`) as many as cuDNN says the attribute has (a count query first,
    /// as the cuDNN frontend does for heuristics results), at most `limit`.
    fn get_descriptors(
        &self,
        api: GraphApi,
        attr: Attr,
        kind: Kind,
        capacity: Option<usize>,
        limit: usize,
    ) -> Result<Vec<Descriptor>, CudnnError> {
        let capacity = match capacity {
            Some(capacity) => capacity,
            // SAFETY: a null array with capacity 0 (a count query).
            None => unsafe {
                self.get_raw(
                    attr,
                    AttrType::CUDNN_TYPE_BACKEND_DESCRIPTOR,
                    0,
                    std::ptr::null_mut(),
                )
            }?,
        }
        .min(limit);
        if capacity == 0 {
            return Ok(Vec::new());
        }
        let mut children = (0..capacity)
            .map(|_| Descriptor::new(api, kind))
            .collect::<Result<Vec<_>, _>>()?;
        let mut raws: Vec<dnn_sys::cudnnBackendDescriptor_t> =
            children.iter().map(|d| d.raw).collect();
        // SAFETY: `raws` holds `capacity` live descriptors of the type the attribute holds;
        // cuDNN fills them in.
        let count = unsafe {
            self.get_raw(
                attr,
                AttrType::CUDNN_TYPE_BACKEND_DESCRIPTOR,
                capacity,
                raws.as_mut_ptr().cast(),
            )
        }?;
        if raws
            .iter()
            .zip(&children)
            .any(|(raw, child)| *raw != child.raw)
        {
            // cuDNN fills the descriptors it is given; a replaced pointer would not be ours to
            // destroy. Forget the array's contents (a leak at worst) and report.
            return Err(invalid(
                "cudnnBackendGetAttribute",
                format!(
                    "cuDNN replaced the {} it was given for {attr:?}",
                    kind_name(kind)
                ),
            ));
        }
        children.truncate(count.min(capacity));
        Ok(children)
    }

    /// A single descriptor-valued attribute (e.g. an engine configuration's engine).
    fn get_descriptor(
        &self,
        api: GraphApi,
        attr: Attr,
        kind: Kind,
    ) -> Result<Descriptor, CudnnError> {
        self.get_descriptors(api, attr, kind, Some(1), 1)?
            .pop()
            .ok_or_else(|| {
                invalid(
                    "cudnnBackendGetAttribute",
                    format!("{attr:?} of {self:?} is empty"),
                )
            })
    }
}

impl Drop for Descriptor {
    fn drop(&mut self) {
        // SAFETY: created in `new` (a token proves the gate passed), destroyed exactly once,
        // here; descriptors that refer to this one were dropped before it (field order).
        let status = unsafe { dnn_sys::cudnnBackendDestroyDescriptor(self.raw) };
        if status != dnn_sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
            warn_drop("cudnnBackendDestroyDescriptor", status);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Device descriptions and what a graph is built for

/// A GPU described without the GPU: a finalized `CUDNN_BACKEND_DEVICEPROP_DESCRIPTOR` read
/// from the JSON that cuDNN serializes a device into (e.g.
/// `../shared/data/h100-device-description.json`). Operation graphs, heuristics (modes A, B
/// and fallback) and execution plans can be built on it with the `*_on_device` functions on
/// a machine without a GPU (cuDNN >= 9.8 and a libcuda that loads; CI uses a stub). Plans
/// built this way report their workspace but cannot run.
///
/// Not `Send`/`Sync`, like every descriptor here.
pub struct DeviceDescription {
    prop: Rc<Descriptor>,
    json: String,
}

impl std::fmt::Debug for DeviceDescription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceDescription")
            .field("json", &self.json)
            .finish_non_exhaustive()
    }
}

impl DeviceDescription {
    /// Parses `json` (`CUDNN_ATTR_DEVICEPROP_JSON_REPRESENTATION`) and finalizes the
    /// descriptor. Errors: the graph API missing or a cuDNN older than 9.8
    /// ([`CudnnError::Unavailable`]); a description cuDNN rejects ([`CudnnError::Backend`]).
    pub fn from_json(json: &str) -> Result<Self, CudnnError> {
        let api = graph_api()?;
        let version = cudnn()?;
        if needs_handle_attributes(version) {
            return Err(CudnnError::Unavailable {
                what: "libcudnn",
                detail: format!(
                    "cuDNN {version} cannot build graphs on a device description (needs \
                     {DEVICE_DESCRIPTION_MIN_VERSION} or newer)"
                ),
            });
        }
        let json = json.trim();
        let prop = Descriptor::new(api, Kind::CUDNN_BACKEND_DEVICEPROP_DESCRIPTOR)?;
        prop.set_chars(Attr::CUDNN_ATTR_DEVICEPROP_JSON_REPRESENTATION, json)?;
        prop.finalize()?;
        Ok(DeviceDescription {
            prop: Rc::new(prop),
            json: json.to_string(),
        })
    }

    /// The JSON it was made from (trimmed).
    pub fn json(&self) -> &str {
        &self.json
    }
}

/// What a graph, its heuristics and its plans are built for.
#[derive(Clone, Copy)]
enum Target<'a> {
    /// A live handle (a GPU): plans can run.
    Handle(&'a CudnnHandle),
    /// A device description: plans report their workspace, nothing runs.
    Device(&'a DeviceDescription),
}

/// How the loaded cuDNN learns the device: the deprecated handle attributes (cuDNN < 9.8), or
/// a device description on heuristics and plans. Kept by the graph, so it outlives every
/// heuristics descriptor and plan built from it.
enum DeviceBinding {
    Handle(dnn_sys::cudnnHandle_t),
    Prop(Rc<Descriptor>),
}

impl DeviceBinding {
    fn new(api: GraphApi, target: Target<'_>) -> Result<Self, CudnnError> {
        let version = cudnn()?;
        match target {
            Target::Handle(handle) if needs_handle_attributes(version) => {
                Ok(DeviceBinding::Handle(handle.raw))
            }
            Target::Handle(handle) => {
                let prop = Descriptor::new(api, Kind::CUDNN_BACKEND_DEVICEPROP_DESCRIPTOR)?;
                prop.set_handle(Attr::CUDNN_ATTR_DEVICEPROP_HANDLE, handle.raw)?;
                prop.finalize()?;
                Ok(DeviceBinding::Prop(Rc::new(prop)))
            }
            Target::Device(device) => Ok(DeviceBinding::Prop(device.prop.clone())),
        }
    }

    /// On the operation graph: the handle where cuDNN needs it.
    fn bind_graph(&self, graph: &Descriptor) -> Result<(), CudnnError> {
        match self {
            DeviceBinding::Handle(raw) => {
                graph.set_handle(Attr::CUDNN_ATTR_OPERATIONGRAPH_HANDLE, *raw)
            }
            DeviceBinding::Prop(_) => Ok(()),
        }
    }

    /// On a heuristics descriptor: the device description, where there is one.
    fn bind_heuristics(&self, heur: &Descriptor) -> Result<(), CudnnError> {
        match self {
            DeviceBinding::Handle(_) => Ok(()),
            DeviceBinding::Prop(prop) => {
                heur.set_descriptors(Attr::CUDNN_ATTR_ENGINEHEUR_DEVICEPROP, &[prop])
            }
        }
    }

    /// On an engine made from its index: the device description, where there is one
    /// (without it cuDNN answers CUDNN_STATUS_NOT_SUPPORTED_ARCH_MISMATCH).
    fn bind_engine(&self, engine: &Descriptor) -> Result<(), CudnnError> {
        match self {
            DeviceBinding::Handle(_) => Ok(()),
            DeviceBinding::Prop(prop) => {
                engine.set_descriptors(Attr::CUDNN_ATTR_ENGINE_DEVICEPROP, &[prop])
            }
        }
    }

    /// On an execution plan: the handle (old cuDNN) or the device description.
    fn bind_plan(&self, plan: &Descriptor) -> Result<(), CudnnError> {
        match self {
            DeviceBinding::Handle(raw) => {
                plan.set_handle(Attr::CUDNN_ATTR_EXECUTION_PLAN_HANDLE, *raw)
            }
            DeviceBinding::Prop(prop) => {
                plan.set_descriptors(Attr::CUDNN_ATTR_EXECUTION_PLAN_DEVICEPROP, &[prop])
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The operation graph

/// The attribute names of one op's operation descriptor.
#[derive(Clone, Copy, Debug)]
struct OpAttributes {
    kind: Kind,
    x: Attr,
    w: Attr,
    y: Attr,
    conv: Attr,
    alpha: Attr,
    beta: Attr,
}

/// Forward reads x and w and writes y; backward-data reads w and dy (`y`) and writes dx (`x`);
/// backward-filter reads x and dy (`y`) and writes dw (`w`).
fn op_attributes(op: ConvOp) -> OpAttributes {
    match op {
        ConvOp::Forward => OpAttributes {
            kind: Kind::CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR,
            x: Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X,
            w: Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W,
            y: Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y,
            conv: Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC,
            alpha: Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA,
            beta: Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA,
        },
        ConvOp::BackwardData => OpAttributes {
            kind: Kind::CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR,
            x: Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DX,
            w: Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_W,
            y: Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DY,
            conv: Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC,
            alpha: Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_ALPHA,
            beta: Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_BETA,
        },
        ConvOp::BackwardFilter => OpAttributes {
            kind: Kind::CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR,
            x: Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_X,
            w: Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DW,
            y: Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DY,
            conv: Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC,
            alpha: Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_ALPHA,
            beta: Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_BETA,
        },
    }
}

/// A finalised operation graph of one convolution op, with the descriptors it refers to.
/// Fields are in drop order: referrers first.
struct OperationGraph {
    graph: Descriptor,
    #[expect(dead_code, reason = "kept alive for the descriptors that refer to it")]
    operation: Descriptor,
    #[expect(dead_code, reason = "kept alive for the descriptors that refer to it")]
    conv: Descriptor,
    #[expect(dead_code, reason = "kept alive for the descriptors that refer to it")]
    x: Descriptor,
    #[expect(dead_code, reason = "kept alive for the descriptors that refer to it")]
    w: Descriptor,
    #[expect(dead_code, reason = "kept alive for the descriptors that refer to it")]
    y: Descriptor,
    /// The device, as heuristics and plans built from this graph are told it.
    device: DeviceBinding,
    params: GraphParams,
}

impl OperationGraph {
    /// Builds and finalises the graph of `params` for `target` (a handle must outlive the
    /// graph and have its CUDA context current).
    fn new(api: GraphApi, target: Target<'_>, params: &GraphParams) -> Result<Self, CudnnError> {
        if let Target::Handle(handle) = target {
            handle.bind()?;
        }
        let device = DeviceBinding::new(api, target)?;
        let tensor = |t: &TensorParams| -> Result<Descriptor, CudnnError> {
            let d = Descriptor::new(api, Kind::CUDNN_BACKEND_TENSOR_DESCRIPTOR)?;
            d.set_data_type(Attr::CUDNN_ATTR_TENSOR_DATA_TYPE, data_type(params.dtype()))?;
            d.set_i64s(Attr::CUDNN_ATTR_TENSOR_DIMENSIONS, &t.dims)?;
            d.set_i64s(Attr::CUDNN_ATTR_TENSOR_STRIDES, &t.strides)?;
            d.set_i64s(Attr::CUDNN_ATTR_TENSOR_UNIQUE_ID, &[t.uid])?;
            // At most 16 (graph_params), so the conversion is exact.
            d.set_i64s(
                Attr::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT,
                &[t.alignment as i64],
            )?;
            d.finalize()?;
            Ok(d)
        };
        let x = tensor(&params.x)?;
        let w = tensor(&params.w)?;
        let y = tensor(&params.y)?;

        let conv = Descriptor::new(api, Kind::CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR)?;
        conv.set_data_type(
            Attr::CUDNN_ATTR_CONVOLUTION_COMP_TYPE,
            compute_type(params.dtype()),
        )?;
        conv.set_conv_mode(
            Attr::CUDNN_ATTR_CONVOLUTION_CONV_MODE,
            dnn_sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
        )?;
        let spatial_dims = params.conv.pre_paddings.len() as i64;
        conv.set_i64s(Attr::CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, &[spatial_dims])?;
        conv.set_i64s(
            Attr::CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS,
            &params.conv.pre_paddings,
        )?;
        conv.set_i64s(
            Attr::CUDNN_ATTR_CONVOLUTION_POST_PADDINGS,
            &params.conv.post_paddings,
        )?;
        conv.set_i64s(
            Attr::CUDNN_ATTR_CONVOLUTION_DILATIONS,
            &params.conv.dilations,
        )?;
        conv.set_i64s(
            Attr::CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES,
            &params.conv.filter_strides,
        )?;
        conv.finalize()?;

        let names = op_attributes(params.op);
        let operation = Descriptor::new(api, names.kind)?;
        operation.set_descriptors(names.x, &[&x])?;
        operation.set_descriptors(names.w, &[&w])?;
        operation.set_descriptors(names.y, &[&y])?;
        operation.set_descriptors(names.conv, &[&conv])?;
        // Float scaling for float, half and bfloat16 data (double only for double compute).
        operation.set_f32(names.alpha, params.alpha)?;
        operation.set_f32(names.beta, params.beta)?;
        operation.finalize()?;

        let graph = Descriptor::new(api, Kind::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR)?;
        graph.set_descriptors(Attr::CUDNN_ATTR_OPERATIONGRAPH_OPS, &[&operation])?;
        device.bind_graph(&graph)?;
        graph.finalize()?;
        Ok(OperationGraph {
            graph,
            operation,
            conv,
            x,
            w,
            y,
            device,
            params: *params,
        })
    }

    fn op(&self) -> ConvOp {
        self.params.op
    }

    /// The problem's math mode as the loaded cuDNN runs it (see [`judged_math`]): a plan of
    /// an engine the known-bad list rules out is declined, even one named by a cache.
    fn math(&self) -> MathMode {
        let shapes = &self.params.shapes;
        // The graph exists, so cuDNN is loaded and its version known.
        let version = super::cudnn_version().unwrap_or(0);
        effective_math(version, shapes.dtype, shapes.pad.len(), shapes.math)
    }
}

// ---------------------------------------------------------------------------------------------
// Engines and their configurations

fn read_notes(engine: &Descriptor) -> Result<EngineNotes, CudnnError> {
    let numerical = engine.get_enums(
        Attr::CUDNN_ATTR_ENGINE_NUMERICAL_NOTE,
        AttrType::CUDNN_TYPE_NUMERICAL_NOTE,
        NOTE_CAPACITY,
    )?;
    let behavior = engine.get_enums(
        Attr::CUDNN_ATTR_ENGINE_BEHAVIOR_NOTE,
        AttrType::CUDNN_TYPE_BEHAVIOR_NOTE,
        NOTE_CAPACITY,
    )?;
    Ok(EngineNotes::from_codes(&numerical, &behavior))
}

/// The finalised engine `index` of `graph` (`CUDNN_STATUS_NOT_SUPPORTED*` when the engine
/// does not apply to the graph).
fn engine_descriptor(
    api: GraphApi,
    graph: &OperationGraph,
    index: i64,
) -> Result<Descriptor, CudnnError> {
    let engine = Descriptor::new(api, Kind::CUDNN_BACKEND_ENGINE_DESCRIPTOR)?;
    engine.set_descriptors(Attr::CUDNN_ATTR_ENGINE_OPERATION_GRAPH, &[&graph.graph])?;
    engine.set_i64s(Attr::CUDNN_ATTR_ENGINE_GLOBAL_INDEX, &[index])?;
    graph.device.bind_engine(&engine)?;
    engine.finalize()?;
    Ok(engine)
}

fn knob_ranges(api: GraphApi, engine: &Descriptor) -> Result<Vec<KnobRange>, CudnnError> {
    let infos = engine.get_descriptors(
        api,
        Attr::CUDNN_ATTR_ENGINE_KNOB_INFO,
        Kind::CUDNN_BACKEND_KNOB_INFO_DESCRIPTOR,
        Some(KNOB_CAPACITY),
        KNOB_CAPACITY,
    )?;
    infos
        .iter()
        .map(|info| {
            let knob_type = info.get_enums(
                Attr::CUDNN_ATTR_KNOB_INFO_TYPE,
                AttrType::CUDNN_TYPE_KNOB_TYPE,
                1,
            )?;
            let knob_type = knob_type.first().copied().ok_or_else(|| {
                invalid("cudnnBackendGetAttribute", "a knob without a type".into())
            })?;
            Ok(KnobRange {
                knob_type: i64::from(knob_type),
                min: info.get_i64(Attr::CUDNN_ATTR_KNOB_INFO_MINIMUM_VALUE)?,
                max: info.get_i64(Attr::CUDNN_ATTR_KNOB_INFO_MAXIMUM_VALUE)?,
                stride: info.get_i64(Attr::CUDNN_ATTR_KNOB_INFO_STRIDE)?,
            })
        })
        .collect()
}

/// A finalised engine configuration built from an [`EngineConfig`], with what it refers to.
/// Fields in drop order.
struct ConfiguredEngine {
    cfg: Descriptor,
    #[expect(dead_code, reason = "kept alive for the descriptors that refer to it")]
    knobs: Vec<Descriptor>,
    #[expect(dead_code, reason = "kept alive for the descriptors that refer to it")]
    engine: Descriptor,
    notes: EngineNotes,
}

/// Builds `config` on `graph`: ENGINE (graph + global index), one KNOB_CHOICE per knob, and
/// the ENGINECFG. The problem's math mode is checked against the engine's notes before the
/// knobs are set: a conflict is [`CudnnError::EngineNotSupported`].
fn configure(
    api: GraphApi,
    graph: &OperationGraph,
    config: &EngineConfig,
) -> Result<ConfiguredEngine, CudnnError> {
    let declined = |reason: String| CudnnError::EngineNotSupported {
        op: graph.op(),
        engine: config.to_string(),
        reason,
    };
    let engine = engine_descriptor(api, graph, config.engine())?;
    let notes = read_notes(&engine)?;
    if let Some(conflict) = notes.math_conflict(graph.math()) {
        return Err(declined(format!("{conflict} (math mode {})", graph.math())));
    }
    let knobs = config
        .knobs()
        .iter()
        .map(|&(knob_type, value)| {
            // A C enum value: non-negative and within `int`.
            let raw_type = i32::try_from(knob_type)
                .ok()
                .and_then(|t| u32::try_from(t).ok())
                .ok_or_else(|| declined(format!("knob type {knob_type} is out of range")))?;
            let choice = Descriptor::new(api, Kind::CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR)?;
            choice.set_knob_type(Attr::CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE, raw_type)?;
            choice.set_i64s(Attr::CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE, &[value])?;
            choice.finalize()?;
            Ok(choice)
        })
        .collect::<Result<Vec<_>, CudnnError>>()?;
    let cfg = Descriptor::new(api, Kind::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR)?;
    cfg.set_descriptors(Attr::CUDNN_ATTR_ENGINECFG_ENGINE, &[&engine])?;
    if !knobs.is_empty() {
        let choices: Vec<&Descriptor> = knobs.iter().collect();
        cfg.set_descriptors(Attr::CUDNN_ATTR_ENGINECFG_KNOB_CHOICES, &choices)?;
    }
    cfg.finalize()?;
    Ok(ConfiguredEngine {
        cfg,
        knobs,
        engine,
        notes,
    })
}

/// The name and notes of an engine configuration cuDNN made (a heuristics result).
fn describe_config(
    api: GraphApi,
    cfg: &Descriptor,
) -> Result<(EngineConfig, EngineNotes), CudnnError> {
    let engine = cfg.get_descriptor(
        api,
        Attr::CUDNN_ATTR_ENGINECFG_ENGINE,
        Kind::CUDNN_BACKEND_ENGINE_DESCRIPTOR,
    )?;
    let index = engine.get_i64(Attr::CUDNN_ATTR_ENGINE_GLOBAL_INDEX)?;
    let notes = read_notes(&engine)?;
    let choices = cfg.get_descriptors(
        api,
        Attr::CUDNN_ATTR_ENGINECFG_KNOB_CHOICES,
        Kind::CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR,
        Some(KNOB_CAPACITY),
        KNOB_CAPACITY,
    )?;
    let knobs = choices
        .iter()
        .map(|choice| {
            let knob_type = choice
                .get_enums(
                    Attr::CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE,
                    AttrType::CUDNN_TYPE_KNOB_TYPE,
                    1,
                )?
                .first()
                .copied()
                .ok_or_else(|| {
                    invalid(
                        "cudnnBackendGetAttribute",
                        "a knob choice without a type".into(),
                    )
                })?;
            let value = choice.get_i64(Attr::CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE)?;
            Ok((i64::from(knob_type), value))
        })
        .collect::<Result<Vec<_>, CudnnError>>()?;
    let config =
        EngineConfig::new(index, knobs).map_err(|e| invalid("describe_config", e.to_string()))?;
    Ok((config, notes))
}

fn heur_mode(mode: HeurMode) -> dnn_sys::cudnnBackendHeurMode_t {
    match mode {
        HeurMode::A => dnn_sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A,
        HeurMode::B => dnn_sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_B,
        HeurMode::Fallback => dnn_sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_FALLBACK,
    }
}

/// The heuristics descriptor of `graph` in `mode` and its result configurations (in cuDNN's
/// ranking). Mode B is finalized and read under [`MODE_B_HEURISTICS`].
fn heuristic_results(
    api: GraphApi,
    graph: &OperationGraph,
    mode: HeurMode,
) -> Result<(Descriptor, Vec<Descriptor>), CudnnError> {
    let _serial = match mode {
        // A poisoned lock only means another thread panicked while holding it; the guard
        // protects cuDNN's state, not data of ours.
        HeurMode::B => Some(
            MODE_B_HEURISTICS
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()),
        ),
        HeurMode::A | HeurMode::Fallback => None,
    };
    let heur = Descriptor::new(api, Kind::CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR)?;
    heur.set_descriptors(Attr::CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, &[&graph.graph])?;
    heur.set_heur_mode(Attr::CUDNN_ATTR_ENGINEHEUR_MODE, heur_mode(mode))?;
    graph.device.bind_heuristics(&heur)?;
    heur.finalize()?;
    let results = heur.get_descriptors(
        api,
        Attr::CUDNN_ATTR_ENGINEHEUR_RESULTS,
        Kind::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR,
        None,
        HEURISTIC_CAPACITY,
    )?;
    Ok((heur, results))
}

/// cuDNN's heuristics results for `graph` in `mode`, in its ranking, each described while the
/// heuristics descriptor is alive (a result that cannot be read is an `Err` in the list).
#[allow(clippy::type_complexity)]
fn heuristic_configs(
    api: GraphApi,
    graph: &OperationGraph,
    mode: HeurMode,
) -> Result<Vec<Result<(EngineConfig, EngineNotes), CudnnError>>, CudnnError> {
    // Results before the heuristics descriptor (drop order).
    let (heur, results) = heuristic_results(api, graph, mode)?;
    let described = results
        .iter()
        .map(|cfg| describe_config(api, cfg))
        .collect();
    // Referrers first: the results, then the heuristics descriptor.
    drop(results);
    drop(heur);
    Ok(described)
}

/// The configurations found so far: deduplicated, capped, and the first error seen (reported
/// only if nothing at all is found).
struct Found {
    list: Vec<EngineConfig>,
    seen: HashSet<EngineConfig>,
    cap: usize,
    first_error: Option<CudnnError>,
}

impl Found {
    fn full(&self) -> bool {
        self.list.len() >= self.cap
    }

    fn push(&mut self, config: EngineConfig) {
        if !self.full() && self.seen.insert(config.clone()) {
            self.list.push(config);
        }
    }

    fn note_error(&mut self, e: CudnnError) {
        if self.first_error.is_none() {
            self.first_error = Some(e);
        }
    }
}

/// The math mode engines are judged by for `shapes`: theirs, or `fma` where the known-bad list
/// rules out tensor cores on the cuDNN version `search` names (the loaded one by default).
fn judged_math(search: &EngineSearch, shapes: &ConvShapes) -> Result<MathMode, CudnnError> {
    let version = match search.known_bad_version {
        Some(version) => version,
        None => super::cudnn_version()?,
    };
    Ok(effective_math(
        version,
        shapes.dtype,
        shapes.pad.len(),
        shapes.math,
    ))
}

/// Whether `search` keeps an engine with `notes` for a problem in `math` (as
/// [`judged_math`] gives it).
fn admitted(search: &EngineSearch, math: MathMode, notes: &EngineNotes) -> bool {
    notes.math_conflict(math).is_none()
        && !(search.skip_runtime_compiled && notes.runtime_compilation)
}

/// One engine in a sweep: its default configuration, then its knob combinations.
struct EngineSweep {
    index: i64,
    queue: Box<dyn Iterator<Item = Vec<(i64, i64)>>>,
}

/// Every engine of `graph` that applies and that `search` admits, taking turns: each turn
/// tries a few configurations of one engine (an ENGINECFG finalize each) and keeps the first
/// that cuDNN accepts.
fn sweep(
    api: GraphApi,
    graph: &OperationGraph,
    search: &EngineSearch,
    math: MathMode,
    found: &mut Found,
) {
    let count = match graph
        .graph
        .get_i64(Attr::CUDNN_ATTR_OPERATIONGRAPH_ENGINE_GLOBAL_COUNT)
    {
        Ok(count) => count.clamp(0, MAX_ENGINES),
        Err(e) => return found.note_error(e),
    };
    let mut engines = Vec::new();
    for index in 0..count {
        let engine = match engine_descriptor(api, graph, index) {
            Ok(engine) => engine,
            Err(e) if e.is_not_supported() => continue,
            Err(e) => {
                found.note_error(e);
                continue;
            }
        };
        match read_notes(&engine) {
            Ok(notes) if admitted(search, math, &notes) => {}
            Ok(_) => continue,
            Err(e) => {
                found.note_error(e);
                continue;
            }
        }
        let ranges = knob_ranges(api, &engine).unwrap_or_else(|e| {
            found.note_error(e);
            Vec::new()
        });
        let default = std::iter::once(Vec::new());
        let queue: Box<dyn Iterator<Item = Vec<(i64, i64)>>> = if ranges.is_empty() {
            Box::new(default)
        } else {
            Box::new(default.chain(knob_combinations(&ranges)))
        };
        engines.push(EngineSweep { index, queue });
    }
    let mut tries_left = search
        .max_candidates
        .saturating_mul(SWEEP_TRIES_PER_CANDIDATE);
    loop {
        let mut progressed = false;
        for engine in &mut engines {
            for _ in 0..SWEEP_TRIES_PER_TURN {
                if found.full() || tries_left == 0 {
                    return;
                }
                let Some(knobs) = engine.queue.next() else {
                    break;
                };
                progressed = true;
                tries_left -= 1;
                let Ok(config) = EngineConfig::new(engine.index, knobs) else {
                    continue;
                };
                if found.seen.contains(&config) {
                    continue;
                }
                match configure(api, graph, &config) {
                    Ok(_) => {
                        found.push(config);
                        break;
                    }
                    Err(e) if e.is_not_supported() => {}
                    Err(e) => found.note_error(e),
                }
            }
        }
        if !progressed {
            return;
        }
    }
}

/// The engine configurations to try for `problem` (at the micro-batch size it will run) and
/// `op`, in a stable order: the heuristics modes of `search` in order (each in cuDNN's
/// ranking), then, with `search.every_engine`, a sweep of every engine; duplicates dropped,
/// engines whose notes the problem's math mode excludes left out (see
/// [`EngineNotes::math_conflict`]), at most `search.max_candidates`.
///
/// The graph is built with alpha 1 and beta 0, its tensors declaring alignments that hold at
/// any sample offset ([`Alignments::any_sample`]; [`engine_configs_with_alignments`] takes
/// the alignment of the offset the plan will run at, which can offer more engines). A
/// configuration listed here may still fail to become a plan ([`EnginePlan::new`] answers
/// `CUDNN_STATUS_NOT_SUPPORTED*`, e.g. for beta 1 or a knob combination the engine rejects
/// late): a profiler skips those ([`CudnnError::is_not_supported`]). A heuristics mode that
/// fails is skipped; an error is returned only if nothing was found and something failed (or
/// the graph itself cannot be built: then [`CudnnError::is_not_supported`] means the graph
/// API cannot do this problem).
pub fn engine_configs(
    handle: &CudnnHandle,
    problem: &ConvProblem,
    op: ConvOp,
    search: &EngineSearch,
) -> Result<Vec<EngineConfig>, CudnnError> {
    let shapes = ConvShapes::new(problem)?;
    configs_for(
        Target::Handle(handle),
        &shapes,
        op,
        search,
        Alignments::any_sample(&shapes),
    )
}

/// As [`engine_configs`], for tensors that declare `alignments` (e.g.
/// [`Alignments::at_sample`] of the offset the plan will run at).
pub fn engine_configs_with_alignments(
    handle: &CudnnHandle,
    problem: &ConvProblem,
    op: ConvOp,
    search: &EngineSearch,
    alignments: Alignments,
) -> Result<Vec<EngineConfig>, CudnnError> {
    let shapes = ConvShapes::new(problem)?;
    configs_for(Target::Handle(handle), &shapes, op, search, alignments)
}

/// As [`engine_configs_with_alignments`], on a device description instead of a GPU.
pub fn engine_configs_on_device(
    device: &DeviceDescription,
    problem: &ConvProblem,
    op: ConvOp,
    search: &EngineSearch,
    alignments: Alignments,
) -> Result<Vec<EngineConfig>, CudnnError> {
    let shapes = ConvShapes::new(problem)?;
    configs_for(Target::Device(device), &shapes, op, search, alignments)
}

fn configs_for(
    target: Target<'_>,
    shapes: &ConvShapes,
    op: ConvOp,
    search: &EngineSearch,
    alignments: Alignments,
) -> Result<Vec<EngineConfig>, CudnnError> {
    let params = GraphParams::with_alignments(shapes, op, 1.0, 0.0, alignments);
    configs_of(target, &params, search)
}

/// As [`engine_configs_with_alignments`], for one spatial chunk's call: the views
/// and paddings of `chunk` ([`GraphParams::for_chunk`]), tensors declaring `alignments`.
pub fn engine_configs_for_chunk(
    handle: &CudnnHandle,
    chunk: &ChunkShapes,
    op: ConvOp,
    search: &EngineSearch,
    alignments: Alignments,
) -> Result<Vec<EngineConfig>, CudnnError> {
    let params = GraphParams::for_chunk(chunk, op, 1.0, 0.0, alignments);
    configs_of(Target::Handle(handle), &params, search)
}

/// As [`engine_configs_for_chunk`], on a device description instead of a GPU.
pub fn engine_configs_for_chunk_on_device(
    device: &DeviceDescription,
    chunk: &ChunkShapes,
    op: ConvOp,
    search: &EngineSearch,
    alignments: Alignments,
) -> Result<Vec<EngineConfig>, CudnnError> {
    let params = GraphParams::for_chunk(chunk, op, 1.0, 0.0, alignments);
    configs_of(Target::Device(device), &params, search)
}

/// The configurations of the graph `params` describes (see [`engine_configs`]).
fn configs_of(
    target: Target<'_>,
    params: &GraphParams,
    search: &EngineSearch,
) -> Result<Vec<EngineConfig>, CudnnError> {
    let api = graph_api()?;
    if search.max_candidates == 0 {
        return Ok(Vec::new());
    }
    let (op, shapes) = (params.op, &params.shapes);
    let math = judged_math(search, shapes)?;
    let graph = OperationGraph::new(api, target, params).map_err(|e| e.for_engine(op, None))?;
    let mut found = Found {
        list: Vec::new(),
        seen: HashSet::new(),
        cap: search.max_candidates,
        first_error: None,
    };
    for &mode in &search.heuristics {
        if found.full() {
            break;
        }
        match heuristic_configs(api, &graph, mode) {
            Ok(results) => {
                for result in results {
                    match result {
                        Ok((config, notes)) => {
                            if admitted(search, math, &notes) {
                                found.push(config);
                            }
                        }
                        Err(e) => found.note_error(e),
                    }
                }
            }
            Err(e) => found.note_error(e),
        }
    }
    if search.every_engine && !found.full() {
        sweep(api, &graph, search, math, &mut found);
    }
    match found.first_error {
        Some(e) if found.list.is_empty() => Err(e.for_engine(op, None)),
        _ => Ok(found.list),
    }
}

/// Diagnostic for the GPU tests: for each heuristics result of `mode` (in cuDNN's ranking),
/// its name and the workspace of an execution plan finalised from cuDNN's own configuration
/// descriptor (`None` when that plan cannot be built). [`EnginePlan::new`] rebuilds
/// configurations from their names; equal workspaces are the evidence that a name captures
/// the configuration. Not meant for profiling (it builds every plan).
#[doc(hidden)]
pub fn heuristic_plan_workspaces(
    handle: &CudnnHandle,
    problem: &ConvProblem,
    op: ConvOp,
    mode: HeurMode,
) -> Result<Vec<(EngineConfig, Option<u64>)>, CudnnError> {
    let shapes = ConvShapes::new(problem)?;
    plan_workspaces_for(
        Target::Handle(handle),
        &shapes,
        op,
        mode,
        Alignments::any_sample(&shapes),
    )
}

/// As [`heuristic_plan_workspaces`], on a device description, for tensors declaring
/// `alignments` (the host test tier's check of rebuild-from-name).
#[doc(hidden)]
pub fn heuristic_plan_workspaces_on_device(
    device: &DeviceDescription,
    problem: &ConvProblem,
    op: ConvOp,
    mode: HeurMode,
    alignments: Alignments,
) -> Result<Vec<(EngineConfig, Option<u64>)>, CudnnError> {
    let shapes = ConvShapes::new(problem)?;
    plan_workspaces_for(Target::Device(device), &shapes, op, mode, alignments)
}

fn plan_workspaces_for(
    target: Target<'_>,
    shapes: &ConvShapes,
    op: ConvOp,
    mode: HeurMode,
    alignments: Alignments,
) -> Result<Vec<(EngineConfig, Option<u64>)>, CudnnError> {
    let api = graph_api()?;
    let params = GraphParams::with_alignments(shapes, op, 1.0, 0.0, alignments);
    let graph = OperationGraph::new(api, target, &params).map_err(|e| e.for_engine(op, None))?;
    let (heur, results) = heuristic_results(api, &graph, mode)?;
    let mut out = Vec::new();
    for cfg in &results {
        let (config, _) = describe_config(api, cfg)?;
        let workspace = finalize_plan(api, &graph, cfg).ok().map(|(_, bytes)| bytes);
        out.push((config, workspace));
    }
    drop(results);
    drop(heur);
    Ok(out)
}

/// An execution plan of `cfg` on `graph`'s device, finalised, and its workspace bytes.
fn finalize_plan(
    api: GraphApi,
    graph: &OperationGraph,
    cfg: &Descriptor,
) -> Result<(Descriptor, u64), CudnnError> {
    let plan = Descriptor::new(api, Kind::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR)?;
    graph.device.bind_plan(&plan)?;
    plan.set_descriptors(Attr::CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, &[cfg])?;
    plan.finalize()?;
    let bytes = plan.get_i64(Attr::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE)?;
    let bytes = u64::try_from(bytes).map_err(|_| {
        invalid(
            "cudnnBackendGetAttribute",
            format!("cuDNN reports a workspace of {bytes} bytes"),
        )
    })?;
    Ok((plan, bytes))
}

/// A deliberately wrong operation graph, for the host tier's negative controls (a test that
/// cannot fail proves nothing).
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BrokenGraph {
    /// The output tensor one larger in its first spatial dim than the convolution produces
    /// (one row taller; one frame deeper in 3-D).
    WrongOutputSize,
    /// The input and output tensors swapped (dx and dy exchanged in backward-data).
    SwappedTensors,
}

/// Builds the operation graph of `problem` and `op` on `device`, broken as `broken` says, and
/// returns what cuDNN answered (an error is the expected outcome).
#[doc(hidden)]
pub fn broken_graph_on_device(
    device: &DeviceDescription,
    problem: &ConvProblem,
    op: ConvOp,
    broken: BrokenGraph,
) -> Result<(), CudnnError> {
    let shapes = ConvShapes::new(problem)?;
    let api = graph_api()?;
    let mut params = GraphParams::with_alignments(&shapes, op, 1.0, 0.0, Alignments::MAX);
    match broken {
        BrokenGraph::WrongOutputSize => params.y.dims[2] += 1,
        BrokenGraph::SwappedTensors => std::mem::swap(&mut params.x, &mut params.y),
    }
    OperationGraph::new(api, Target::Device(device), &params).map(|_| ())
}

/// What an execution plan built on a device description reports (it cannot run).
#[derive(Clone, Debug, PartialEq)]
pub struct DevicePlan {
    pub config: EngineConfig,
    /// `CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE`.
    pub workspace_bytes: u64,
    pub notes: EngineNotes,
    /// The alignments its tensors declared.
    pub alignments: Alignments,
}

/// Builds the execution plan of `config` (rebuilt from its name, as [`EnginePlan::new`]
/// does) for `problem` and `op` on a device description, and reports its workspace. Errors
/// as [`EnginePlan::new`].
pub fn plan_on_device(
    device: &DeviceDescription,
    problem: &ConvProblem,
    op: ConvOp,
    config: &EngineConfig,
    beta: f32,
    alignments: Alignments,
) -> Result<DevicePlan, CudnnError> {
    let shapes = ConvShapes::new(problem)?;
    let params = GraphParams::with_alignments(&shapes, op, 1.0, beta, alignments);
    let built = build_plan(Target::Device(device), &params, config)?;
    Ok(DevicePlan {
        config: config.clone(),
        workspace_bytes: built.workspace_bytes,
        notes: built.engine.notes,
        alignments,
    })
}

/// As [`plan_on_device`], for one spatial chunk's call ([`GraphParams::for_chunk`]).
pub fn plan_for_chunk_on_device(
    device: &DeviceDescription,
    chunk: &ChunkShapes,
    op: ConvOp,
    config: &EngineConfig,
    beta: f32,
    alignments: Alignments,
) -> Result<DevicePlan, CudnnError> {
    let params = GraphParams::for_chunk(chunk, op, 1.0, beta, alignments);
    let built = build_plan(Target::Device(device), &params, config)?;
    Ok(DevicePlan {
        config: config.clone(),
        workspace_bytes: built.workspace_bytes,
        notes: built.engine.notes,
        alignments,
    })
}

/// An execution plan and everything it refers to (fields in drop order).
struct BuiltPlan {
    plan: Descriptor,
    engine: ConfiguredEngine,
    graph: OperationGraph,
    workspace_bytes: u64,
}

fn build_plan(
    target: Target<'_>,
    params: &GraphParams,
    config: &EngineConfig,
) -> Result<BuiltPlan, CudnnError> {
    let (op, alpha, beta) = (params.op, params.alpha, params.beta);
    if !alpha.is_finite() || !beta.is_finite() {
        return Err(invalid(
            "EnginePlan::new",
            format!("alpha ({alpha}) and beta ({beta}) must be finite"),
        ));
    }
    let api = graph_api()?;
    let name = config.to_string();
    let tag = |e: CudnnError| e.for_engine(op, Some(&name));
    let graph = OperationGraph::new(api, target, params).map_err(tag)?;
    let engine = configure(api, &graph, config).map_err(tag)?;
    let (plan, workspace_bytes) = finalize_plan(api, &graph, &engine.cfg).map_err(tag)?;
    Ok(BuiltPlan {
        plan,
        engine,
        graph,
        workspace_bytes,
    })
}

// ---------------------------------------------------------------------------------------------
// Execution plans

/// A finalised execution plan: one [`EngineConfig`] for one problem at one batch size, one op,
/// and fixed `alpha`/`beta` (graph attributes: backward-filter's accumulating micro-batches
/// need a second plan with beta 1). Build it once and reuse it; building means operation
/// graph, engine, knobs, and plan finalisation (which may compile kernels).
///
/// Not `Send`/`Sync` (cuDNN handles and descriptors are used by one thread at a time). Drop
/// waits for the handle's stream before destroying the descriptors.
pub struct EnginePlan {
    // Drop order: the plan, then its configuration, then the graph, then the handle.
    plan: Descriptor,
    engine: ConfiguredEngine,
    graph: OperationGraph,
    owner: Rc<HandleOwner>,
    config: EngineConfig,
    workspace_bytes: u64,
    /// The caller's context, made current again after the fields above, which bind the
    /// plan's (last).
    caller_context: RestoreAfterFields,
}

impl std::fmt::Debug for EnginePlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EnginePlan")
            .field("config", &self.config.to_string())
            .field("op", &self.graph.params.op)
            .field("batch", &self.batch())
            .field("beta", &self.graph.params.beta)
            .field("workspace_bytes", &self.workspace_bytes)
            .finish_non_exhaustive()
    }
}

impl EnginePlan {
    /// Builds the execution plan of `config` for `problem` (at the batch size the plan will
    /// run: `problem.with_batch(micro)`) and `op`, computing `out = alpha * op(a, b) + beta *
    /// out`, on `handle`. Errors: an invalid problem ([`CudnnError::Shape`]); the graph API
    /// missing ([`CudnnError::Unavailable`]); a configuration that does not apply or that the
    /// math mode excludes ([`CudnnError::is_not_supported`]: a [`CudnnError::Backend`] with a
    /// NOT_SUPPORTED status, or [`CudnnError::EngineNotSupported`]); other cuDNN failures
    /// ([`CudnnError::Backend`], tagged with the op and the configuration's name).
    pub fn new(
        handle: &CudnnHandle,
        problem: &ConvProblem,
        op: ConvOp,
        config: &EngineConfig,
        alpha: f32,
        beta: f32,
    ) -> Result<Self, CudnnError> {
        let shapes = ConvShapes::new(problem)?;
        let alignments = Alignments::any_sample(&shapes);
        Self::with_alignments(handle, problem, op, config, alpha, beta, alignments)
    }

    /// As [`Self::new`], with the tensors declaring `alignments`: e.g.
    /// [`Alignments::at_sample`] of the one offset the plan runs at, which can admit engines
    /// (tensor cores above all) that the any-offset alignment excludes. Execution checks
    /// every pointer against it.
    pub fn with_alignments(
        handle: &CudnnHandle,
        problem: &ConvProblem,
        op: ConvOp,
        config: &EngineConfig,
        alpha: f32,
        beta: f32,
        alignments: Alignments,
    ) -> Result<Self, CudnnError> {
        let shapes = ConvShapes::new(problem)?;
        let params = GraphParams::with_alignments(&shapes, op, alpha, beta, alignments);
        Self::from_params(handle, &params, config)
    }

    /// The execution plan of `config` for one spatial chunk's call: `x` and `y`
    /// are views of the full tensors ([`ChunkShapes`]: the chunk's rows, the full strides),
    /// the split axis padded by the chunk's own paddings, the tensors declaring `alignments`
    /// (at least what holds where the chunk runs: [`ChunkShapes::alignments`]). Executed on
    /// views of [`ChunkShapes::range`]. Errors as [`Self::new`].
    pub fn for_chunk(
        handle: &CudnnHandle,
        chunk: &ChunkShapes,
        op: ConvOp,
        config: &EngineConfig,
        alpha: f32,
        beta: f32,
        alignments: Alignments,
    ) -> Result<Self, CudnnError> {
        let params = GraphParams::for_chunk(chunk, op, alpha, beta, alignments);
        Self::from_params(handle, &params, config)
    }

    /// The plan of `config` for the graph `params` describes.
    pub fn from_params(
        handle: &CudnnHandle,
        params: &GraphParams,
        config: &EngineConfig,
    ) -> Result<Self, CudnnError> {
        let built = build_plan(Target::Handle(handle), params, config)?;
        Ok(EnginePlan {
            plan: built.plan,
            engine: built.engine,
            graph: built.graph,
            owner: handle.owner.clone(),
            config: config.clone(),
            workspace_bytes: built.workspace_bytes,
            caller_context: RestoreAfterFields::default(),
        })
    }

    /// The configuration this plan runs.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    pub fn op(&self) -> ConvOp {
        self.graph.params.op
    }

    /// The problem's shapes at the plan's batch size (a chunk's: its rows along the split
    /// axis).
    pub fn shapes(&self) -> &ConvShapes {
        &self.graph.params.shapes
    }

    /// The descriptor values the plan was built from.
    pub fn params(&self) -> &GraphParams {
        &self.graph.params
    }

    /// Elements each `[a, b, out]` view must span: the element counts at the plan's batch
    /// size, or a chunk's view spans ([`GraphParams::operand_spans`]).
    pub fn operand_spans(&self) -> [usize; 3] {
        self.graph.params.operand_spans()
    }

    /// The batch size the plan runs (its micro-batch size).
    pub fn batch(&self) -> usize {
        self.graph.params.shapes.batch()
    }

    pub fn alpha(&self) -> f32 {
        self.graph.params.alpha
    }

    pub fn beta(&self) -> f32 {
        self.graph.params.beta
    }

    /// Workspace bytes the plan needs (`CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE`).
    pub fn workspace_bytes(&self) -> u64 {
        self.workspace_bytes
    }

    /// The engine's numerical and behaviour notes.
    pub fn notes(&self) -> EngineNotes {
        self.engine.notes
    }

    /// The byte alignment the plan requires of the `[a, b, out]` pointers (see
    /// `graph_params`); a non-empty workspace must be aligned to [`WORKSPACE_ALIGNMENT`].
    pub fn operand_alignments(&self) -> [u64; 3] {
        self.graph.params.operand_alignments()
    }

    /// The alignments the plan's tensors declare (part of what it is keyed on).
    pub fn alignments(&self) -> Alignments {
        self.graph.params.alignments()
    }

    /// Queues the plan on `on`'s stream (asynchronously: mucudnn's handle on its own stream, or
    /// a [`super::StreamSession`] on a caller's): `out = alpha * op(a, b) + beta * out` with the
    /// plan's alpha and beta, operands as for `Surface::convolve`:
    ///
    /// | op | a | b | out |
    /// |---|---|---|---|
    /// | forward | x | w | y |
    /// | backward-data | w | dy | dx |
    /// | backward-filter | x | dy | dw |
    ///
    /// Views may be micro-batch ranges of full-batch buffers (`sample_range`). Checked first,
    /// as `Surface::convolve` does: `on`'s handle is the one the plan was built on, every
    /// view has the problem's dtype and exactly the element count of its role at the plan's
    /// batch size, every pointer whose stream is known was taken on the stream the work goes
    /// to, the workspace holds at least [`Self::workspace_bytes`]; and every pointer is aligned
    /// as the plan declared ([`CudnnError::Misaligned`]). The variant pack is built per call
    /// (cheap).
    pub fn execute<S: Surface, O: Origin>(
        &self,
        on: &S,
        ops: DeviceOperands<'_, '_, O>,
    ) -> Result<(), CudnnError> {
        let call = S::EXECUTE;
        let op = self.op();
        if !on.built(self) {
            return Err(invalid(
                call,
                format!("the plan {} was built on another cuDNN handle", self.config),
            ));
        }
        check_operands(on, call, (self.shapes(), self.operand_spans()), op, &ops)?;
        if ops.workspace.bytes < self.workspace_bytes {
            return Err(invalid(
                call,
                format!(
                    "{op} engine {} needs {} workspace bytes, the workspace view has {}",
                    self.config, self.workspace_bytes, ops.workspace.bytes
                ),
            ));
        }
        let addresses = [ops.a.ptr, ops.b.ptr, ops.out.ptr];
        let workspace_ptr = ops.workspace.raw_ptr();
        self.check_alignment(call, addresses, workspace_ptr)?;
        on.enter()?;
        // SAFETY (the contract of `launch`): the handle is live (this plan holds its owner)
        // and is the plan's handle (checked), used by this thread alone (the surface is
        // borrowed), its context current (`enter`) and its stream the one the work goes to.
        // The views are device memory that stays allocated until the queued work has finished
        // (borrowed cudarc buffers taken on that stream, checked, which cudarc frees
        // stream-ordered, or a caller's pointers under the promise of their `unsafe`
        // constructors), holding exactly the plan's element counts and dtype in the roles
        // `operand_uids(op)` gives them (checked), aligned as declared (checked); `out` is
        // borrowed mutably, so it aliases no input. The workspace view covers at least the
        // plan's workspace bytes (checked), or is null when the plan needs none.
        unsafe { self.launch(addresses, workspace_ptr) }
    }

    /// Checks that `[a, b, out]` are aligned as the plan declared and a non-empty workspace to
    /// [`WORKSPACE_ALIGNMENT`].
    pub(super) fn check_alignment(
        &self,
        call: &'static str,
        addresses: [u64; 3],
        workspace_ptr: *mut c_void,
    ) -> Result<(), CudnnError> {
        for ((operand, address), required) in ["a", "b", "out"]
            .into_iter()
            .zip(addresses)
            .zip(self.operand_alignments())
        {
            if !is_aligned(address, required) {
                return Err(CudnnError::Misaligned {
                    call,
                    operand,
                    address,
                    required,
                });
            }
        }
        if self.workspace_bytes > 0 && !is_aligned(workspace_ptr as u64, WORKSPACE_ALIGNMENT) {
            return Err(CudnnError::Misaligned {
                call,
                operand: "workspace",
                address: workspace_ptr as u64,
                required: WORKSPACE_ALIGNMENT,
            });
        }
        Ok(())
    }

    /// Whether this plan was built on the handle that `owner` keeps alive.
    pub(super) fn built_on(&self, owner: &Rc<HandleOwner>) -> bool {
        Rc::ptr_eq(&self.owner, owner)
    }

    /// Builds the variant pack for `addresses` (`[a, b, out]`) and the workspace, and queues
    /// the plan on its handle's current stream.
    ///
    /// # Safety
    ///
    /// - the plan's handle is used by this thread alone during the call, with its device's
    ///   context current, and its stream is the one the memory below is used on;
    /// - `addresses` point to device memory holding exactly the elements of roles
    ///   `operand_uids(self.op())` at the plan's batch size, in the problem's dtype, aligned as
    ///   [`Self::operand_alignments`] declares; `out` is writable and overlaps neither input
    ///   nor the workspace;
    /// - `workspace_ptr` is null when the plan needs no workspace, else points to at least
    ///   [`Self::workspace_bytes`] writable device bytes aligned to [`WORKSPACE_ALIGNMENT`];
    /// - all of it stays allocated until the queued work has finished.
    pub(super) unsafe fn launch(
        &self,
        addresses: [u64; 3],
        workspace_ptr: *mut c_void,
    ) -> Result<(), CudnnError> {
        let op = self.op();
        let api = graph_api()?;
        // The name only on the error path: a call allocates nothing.
        let tag = |e: CudnnError| e.for_engine(op, Some(&self.config.to_string()));
        let pack = variant_pack(api, op, addresses, workspace_ptr).map_err(tag)?;
        // SAFETY: this function's contract; the variant pack is only read during the call.
        unsafe { dnn_sys::cudnnBackendExecute(self.owner.raw, self.plan.raw, pack.raw) }
            .result()
            .map_err(|e| {
                tag(backend_error(
                    "cudnnBackendExecute",
                    Kind::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR,
                    e.0,
                ))
            })
    }
}

/// A finalized VARIANT_PACK of `addresses` (`[a, b, out]` in `op`'s roles) and the workspace:
/// what one call of an execution plan needs besides the plan. A finalized descriptor takes no
/// new pointers, so each call makes its own (as cuDNN's frontend does): a host-side object,
/// made and destroyed in well under the 2 microseconds a call may cost
/// (`tests/cudnn_host.rs` measures it against the real library).
fn variant_pack(
    api: GraphApi,
    op: ConvOp,
    addresses: [u64; 3],
    workspace_ptr: *mut c_void,
) -> Result<Descriptor, CudnnError> {
    let pack = Descriptor::new(api, Kind::CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR)?;
    let pointers = addresses.map(|address| address as *mut c_void);
    pack.set_pointers(Attr::CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, &pointers)?;
    pack.set_i64s(Attr::CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, &operand_uids(op))?;
    pack.set_pointers(Attr::CUDNN_ATTR_VARIANT_PACK_WORKSPACE, &[workspace_ptr])?;
    pack.finalize()?;
    Ok(pack)
}

/// Makes and destroys `count` variant packs (as `count` calls of an execution plan would) and
/// returns the seconds that took: the per-call cost of the graph API's call path on the host,
/// for the host tier (no device: the pointers are never dereferenced).
#[doc(hidden)]
pub fn time_variant_packs(count: usize) -> Result<f64, CudnnError> {
    let api = graph_api()?;
    let started = std::time::Instant::now();
    for i in 0..count {
        let base = 0x7f00_0000_0000u64 + (i as u64 % 64) * 4096;
        let pack = variant_pack(
            api,
            ConvOp::Forward,
            [base, base + 1024, base + 2048],
            std::ptr::null_mut(),
        )?;
        drop(pack);
    }
    Ok(started.elapsed().as_secs_f64())
}

impl Drop for EnginePlan {
    fn drop(&mut self) {
        // Kernels queued from this plan on the handle's own stream may still run: wait before
        // its descriptors (and any kernels they loaded) are destroyed. A failure is reported by
        // cudarc's next call. Work on a caller's stream is waited for (or the plan parked,
        // under CUDA graph capture) by the `PreparedPlan` holding it, before this runs.
        self.caller_context.save();
        let _ = self.owner.stream.context().bind_to_thread();
        if let Err(e) = self.owner.stream.synchronize() {
            let _ = writeln!(
                std::io::stderr(),
                "mucudnn: warning: cuStreamSynchronize failed while dropping an engine plan: {e:?}"
            );
        }
        // Fields drop next, in declaration order: plan, configuration, graph, handle owner,
        // and last the caller's context is made current again.
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cudnn::engine_search::note_codes;
    use crate::backend::cudnn::library_status;

    #[test]
    fn note_numbers_match_the_bindings() {
        use dnn_sys::cudnnBackendBehaviorNote_t as B;
        use dnn_sys::cudnnBackendNumericalNote_t as N;
        assert_eq!(
            N::CUDNN_NUMERICAL_NOTE_TENSOR_CORE as u32,
            note_codes::TENSOR_CORE
        );
        assert_eq!(
            N::CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS as u32,
            note_codes::DOWN_CONVERT_INPUTS
        );
        assert_eq!(
            N::CUDNN_NUMERICAL_NOTE_REDUCED_PRECISION_REDUCTION as u32,
            note_codes::REDUCED_PRECISION_REDUCTION
        );
        assert_eq!(N::CUDNN_NUMERICAL_NOTE_FFT as u32, note_codes::FFT);
        assert_eq!(
            N::CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC as u32,
            note_codes::NONDETERMINISTIC
        );
        assert_eq!(
            N::CUDNN_NUMERICAL_NOTE_WINOGRAD as u32,
            note_codes::WINOGRAD
        );
        assert_eq!(
            N::CUDNN_NUMERICAL_NOTE_WINOGRAD_TILE_4x4 as u32,
            note_codes::WINOGRAD_TILE_4X4
        );
        assert_eq!(
            N::CUDNN_NUMERICAL_NOTE_WINOGRAD_TILE_6x6 as u32,
            note_codes::WINOGRAD_TILE_6X6
        );
        assert_eq!(
            N::CUDNN_NUMERICAL_NOTE_WINOGRAD_TILE_13x13 as u32,
            note_codes::WINOGRAD_TILE_13X13
        );
        assert_eq!(
            B::CUDNN_BEHAVIOR_NOTE_RUNTIME_COMPILATION as u32,
            note_codes::RUNTIME_COMPILATION
        );
    }

    #[test]
    fn op_attributes_pair_each_tensor_with_its_role() {
        for op in ConvOp::ALL {
            let a = op_attributes(op);
            let names = [a.x, a.w, a.y, a.conv, a.alpha, a.beta].map(|n| format!("{n:?}"));
            let prefix = match op {
                ConvOp::Forward => "CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_",
                ConvOp::BackwardData => "CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_",
                ConvOp::BackwardFilter => "CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_",
            };
            let suffixes: Vec<&str> = names
                .iter()
                .map(|n| {
                    n.strip_prefix(prefix)
                        .expect("attribute of the op's descriptor")
                })
                .collect();
            let expected = match op {
                ConvOp::Forward => ["X", "W", "Y", "CONV_DESC", "ALPHA", "BETA"],
                ConvOp::BackwardData => ["DX", "W", "DY", "CONV_DESC", "ALPHA", "BETA"],
                ConvOp::BackwardFilter => ["X", "DW", "DY", "CONV_DESC", "ALPHA", "BETA"],
            };
            assert_eq!(suffixes, expected, "{op}");
            assert!(kind_name(a.kind).contains(match op {
                ConvOp::Forward => "FORWARD",
                ConvOp::BackwardData => "BACKWARD_DATA",
                ConvOp::BackwardFilter => "BACKWARD_FILTER",
            }));
        }
        assert_eq!(
            heur_mode(HeurMode::A),
            dnn_sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A
        );
        assert_eq!(
            heur_mode(HeurMode::Fallback) as u32,
            2,
            "CUDNN_HEUR_MODE_FALLBACK"
        );
    }

    #[test]
    fn attribute_and_type_numbers_are_cudnn_9s() {
        // Spot checks of the numbers the bindings send (cudnn_graph.h of cuDNN 9).
        assert_eq!(Attr::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT as u32, 900);
        assert_eq!(Attr::CUDNN_ATTR_TENSOR_UNIQUE_ID as u32, 906);
        assert_eq!(Attr::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE as u32, 402);
        assert_eq!(Attr::CUDNN_ATTR_VARIANT_PACK_WORKSPACE as u32, 1003);
        assert_eq!(Attr::CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE as u32, 601);
        assert_eq!(
            Attr::CUDNN_ATTR_OPERATIONGRAPH_ENGINE_GLOBAL_COUNT as u32,
            802
        );
        assert_eq!(AttrType::CUDNN_TYPE_INT64 as u32, 3);
        assert_eq!(AttrType::CUDNN_TYPE_BACKEND_DESCRIPTOR as u32, 15);
        assert_eq!(AttrType::CUDNN_TYPE_KNOB_TYPE as u32, 9);
        assert_eq!(Kind::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR as u32, 5);
        assert_eq!(Kind::CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR as u32, 16);
        // C enums are 4 bytes: the size `get_enums` reads and `set_knob_type` writes.
        assert_eq!(std::mem::size_of::<dnn_sys::cudnnBackendKnobType_t>(), 4);
        assert_eq!(std::mem::size_of::<dnn_sys::cudnnDataType_t>(), 4);
    }

    #[test]
    fn without_libcudnn_the_graph_api_is_unavailable_not_a_panic() {
        if library_status().libcudnn {
            return;
        }
        let e = graph_api().unwrap_err();
        assert!(e.is_unavailable(), "{e:?}");
    }
}
