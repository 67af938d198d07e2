//! NCCL: the unique id, one rank's communicator bound to a stream, in-place all-reduce and
//! broadcast.
//!
//! The gate opens libnccl itself (as `libnccl.so`, else `libnccl.so.2`, else cudarc's other
//! names: [`library_names`]), resolves every function this module calls from it, and checks
//! that it is NCCL 2.x (`ncclGetLastError`, NCCL 2.13+, is used only where present); calls go
//! through those pointers, never through cudarc's NCCL loader. A communicator exists only if
//! `ncclCommInitRank` (or `ncclCommInitAll`) succeeded, and is released exactly once.

use super::{c_string, check_stream, DeviceDataMut};
use crate::backend::cudnn::{driver_error, require_driver};
use crate::solver::DType;
use crate::train::gpu::error::{invalid, GpuTrainError};
use crate::train::gpu::slot::{AbortSlot, Busy};
use cudarc::driver::CudaStream;
use cudarc::nccl::sys as nccl_sys;
use std::ffi::{c_char, c_int, c_void};
use std::io::Write;
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

/// The bytes of an `ncclUniqueId`.
pub(crate) const UNIQUE_ID_BYTES: usize = 128;

type Status = nccl_sys::ncclResult_t;
type Comm = nccl_sys::ncclComm_t;

/// The NCCL entry points this wall calls, resolved from the library it opened itself (see
/// [`library_names`]): cudarc's `culib` searches names that lack `libnccl.so.2`, the only name
/// pip wheels and Debian's `libnccl2` ship, and the dynamic loader matches a requested name
/// against sonames, so neither preloading nor a cudarc call can reach it. cudarc's NCCL
/// bindings are used for their types only.
#[derive(Debug)]
struct Library {
    /// The file name that loaded.
    name: String,
    /// `ncclGetVersion`, e.g. 22703 for 2.27.3.
    version: i32,
    get_error_string: unsafe extern "C" fn(Status) -> *const c_char,
    /// NCCL 2.13+.
    get_last_error: Option<unsafe extern "C" fn(Comm) -> *const c_char>,
    get_unique_id: unsafe extern "C" fn(*mut nccl_sys::ncclUniqueId) -> Status,
    comm_init_rank: unsafe extern "C" fn(*mut Comm, c_int, nccl_sys::ncclUniqueId, c_int) -> Status,
    comm_init_all: unsafe extern "C" fn(*mut Comm, c_int, *const c_int) -> Status,
    group_start: unsafe extern "C" fn() -> Status,
    group_end: unsafe extern "C" fn() -> Status,
    comm_destroy: unsafe extern "C" fn(Comm) -> Status,
    comm_abort: unsafe extern "C" fn(Comm) -> Status,
    #[allow(clippy::type_complexity)]
    all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        nccl_sys::ncclDataType_t,
        nccl_sys::ncclRedOp_t,
        Comm,
        nccl_sys::cudaStream_t,
    ) -> Status,
    #[allow(clippy::type_complexity)]
    broadcast: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        nccl_sys::ncclDataType_t,
        c_int,
        Comm,
        nccl_sys::cudaStream_t,
    ) -> Status,
    /// Keeps the function pointers above valid: held in a static, never unloaded.
    _library: libloading::Library,
}

fn library() -> Result<&'static Library, GpuTrainError> {
    static LIBRARY: OnceLock<Result<Library, GpuTrainError>> = OnceLock::new();
    LIBRARY
        .get_or_init(init_library)
        .as_ref()
        .map_err(Clone::clone)
}

/// Gate for everything that touches NCCL: the driver gate, libnccl present, NCCL 2.x, every
/// symbol exported. Returns `ncclGetVersion()`. Cached.
pub(crate) fn nccl() -> Result<i32, GpuTrainError> {
    library().map(|lib| lib.version)
}

/// The file names tried for libnccl, in order: cudarc's plain name, then `libnccl.so.2` (the
/// soname of every NCCL 2 release, all that pip wheels and Debian's `libnccl2` install), then
/// cudarc's other candidates.
pub(crate) fn library_names() -> Vec<String> {
    #[allow(unused_mut)]
    let mut names = vec!["libnccl.so".to_string(), "libnccl.so.2".to_string()];
    // (cudarc linked at build time has no candidate list: libnccl is already loaded then.)
    #[cfg(not(feature = "cudarc-linked"))]
    for name in cudarc::get_lib_name_candidates("nccl") {
        if !names.contains(&name) {
            names.push(name);
        }
    }
    names
}

/// The first of `names` that the dynamic loader opens, and its name.
fn open_first(names: &[String]) -> Option<(String, libloading::Library)> {
    names.iter().find_map(|name| {
        // SAFETY: loading a shared library runs its initialisers; NCCL's (like any library
        // the process would link) have no preconditions on the caller.
        unsafe { libloading::Library::new(name) }
            .ok()
            .map(|library| (name.clone(), library))
    })
}

/// Resolves `name` in `library` as a function pointer of type `F`, which must be the
/// symbol's C signature.
///
/// # Safety
/// `F` must be an `unsafe extern "C" fn` type matching the exported function's declaration in
/// nccl.h, and the pointer must not be called after `library` is unloaded.
unsafe fn symbol<F: Copy>(library: &libloading::Library, name: &str) -> Option<F> {
    // SAFETY: the caller's contract: `F` is the symbol's true type; copying the pointer out
    // of the `Symbol` is fine while the library stays loaded (the caller keeps it).
    unsafe { library.get::<F>(name.as_bytes()) }
        .ok()
        .map(|symbol| *symbol)
}

fn init_library() -> Result<Library, GpuTrainError> {
    require_driver()?;
    let names = library_names();
    let Some((name, lib)) = open_first(&names) else {
        return Err(GpuTrainError::Unavailable {
            what: "libnccl",
            detail: format!(
                "libnccl not found: install NCCL 2 (Debian's libnccl2, or PyTorch's \
                 nvidia-nccl wheel) or put its lib folder on LD_LIBRARY_PATH. Searched: {}",
                names.join(", ")
            ),
        });
    };
    let mut missing = Vec::new();
    macro_rules! resolve {
        ($name:literal) => {{
            // SAFETY: the type is inferred from the `Library` field it fills, each declared
            // with nccl.h's signature of `$name` (as cudarc's bindings declare it); `lib` is
            // kept in the same `Library`, so the pointer never outlives it.
            let found = unsafe { symbol(&lib, $name) };
            if found.is_none() {
                missing.push($name);
            }
            found
        }};
    }
    let get_version: Option<unsafe extern "C" fn(*mut c_int) -> Status> =
        resolve!("ncclGetVersion");
    let get_error_string = resolve!("ncclGetErrorString");
    let get_unique_id = resolve!("ncclGetUniqueId");
    let comm_init_rank = resolve!("ncclCommInitRank");
    let comm_init_all = resolve!("ncclCommInitAll");
    let group_start = resolve!("ncclGroupStart");
    let group_end = resolve!("ncclGroupEnd");
    let comm_destroy = resolve!("ncclCommDestroy");
    let comm_abort = resolve!("ncclCommAbort");
    let all_reduce = resolve!("ncclAllReduce");
    let broadcast = resolve!("ncclBroadcast");
    // SAFETY: as in `resolve!`: the field's type is ncclGetLastError's signature.
    let get_last_error = unsafe { symbol(&lib, "ncclGetLastError") };
    let (
        Some(get_version),
        Some(get_error_string),
        Some(get_unique_id),
        Some(comm_init_rank),
        Some(comm_init_all),
        Some(group_start),
        Some(group_end),
        Some(comm_destroy),
        Some(comm_abort),
        Some(all_reduce),
        Some(broadcast),
    ) = (
        get_version,
        get_error_string,
        get_unique_id,
        comm_init_rank,
        comm_init_all,
        group_start,
        group_end,
        comm_destroy,
        comm_abort,
        all_reduce,
        broadcast,
    )
    else {
        return Err(GpuTrainError::Unavailable {
            what: "libnccl",
            detail: format!(
                "{name} does not export {} (a partial or mismatched install?)",
                missing.join(", ")
            ),
        });
    };
    let mut version: c_int = 0;
    // SAFETY: resolved above with its signature; the call writes one int to a live local.
    let status = unsafe { get_version(&mut version) };
    if status != nccl_sys::ncclResult_t::ncclSuccess {
        return Err(GpuTrainError::Unavailable {
            what: "libnccl",
            detail: format!("ncclGetVersion failed with {status:?} ({})", status as u32),
        });
    }
    // Codes are 1000 * major + ... before 2.9 and 10000 * major + ... since.
    let major = if version >= 10_000 {
        version / 10_000
    } else {
        version / 1000
    };
    if major != 2 {
        return Err(GpuTrainError::Unavailable {
            what: "libnccl",
            detail: format!(
                "{name}: NCCL version code {version} (major {major}); this build needs NCCL 2.x"
            ),
        });
    }
    Ok(Library {
        name,
        version,
        get_error_string,
        get_last_error,
        get_unique_id,
        comm_init_rank,
        comm_init_all,
        group_start,
        group_end,
        comm_destroy,
        comm_abort,
        all_reduce,
        broadcast,
        _library: lib,
    })
}

/// The file name libnccl was loaded from, once the gate passed.
pub(crate) fn library_name() -> Result<&'static str, GpuTrainError> {
    library().map(|lib| lib.name.as_str())
}

/// An error for `call`'s `status`, with NCCL's description, its last error message where
/// NCCL has one, and `context`.
fn nccl_error(
    call: &'static str,
    status: nccl_sys::ncclResult_t,
    comm: nccl_sys::ncclComm_t,
    context: &str,
) -> GpuTrainError {
    let mut detail = String::new();
    let lib = library().ok();
    // SAFETY: statuses only come from gated calls; ncclGetErrorString returns a static string
    // for any value.
    if let Some(text) = lib.and_then(|lib| unsafe { c_string((lib.get_error_string)(status)) }) {
        detail.push_str(&text);
    }
    if let Some(get_last_error) = lib.and_then(|lib| lib.get_last_error) {
        // SAFETY: the symbol exists (resolved by the gate); `comm` is a live communicator or
        // null, which ncclGetLastError accepts; the string is copied at once.
        if let Some(last) = unsafe { c_string(get_last_error(comm)) } {
            if !last.is_empty() {
                detail.push_str(": ");
                detail.push_str(&last);
            }
        }
    }
    detail.push_str(&format!(" ({context})"));
    GpuTrainError::Nccl {
        call,
        status: format!("{status:?}"),
        code: status as u32,
        detail,
    }
}

/// A fresh NCCL unique id (`ncclGetUniqueId`): made once, by the rank that bootstraps the
/// communicator, and shared with every rank.
pub(crate) fn unique_id() -> Result<[u8; UNIQUE_ID_BYTES], GpuTrainError> {
    let lib = library()?;
    let mut id = nccl_sys::ncclUniqueId {
        internal: [0; UNIQUE_ID_BYTES],
    };
    // SAFETY: the gate passed; the call fills the 128-byte struct, a live local.
    let status = unsafe { (lib.get_unique_id)(&mut id) };
    if status != nccl_sys::ncclResult_t::ncclSuccess {
        return Err(nccl_error(
            "ncclGetUniqueId",
            status,
            std::ptr::null_mut(),
            "creating the unique id",
        ));
    }
    Ok(id.internal.map(|c| c as u8))
}

/// The reductions the communicator offers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reduce {
    Sum,
    /// `ncclAvg` (NCCL 2.10+).
    Average,
}

fn nccl_type(dtype: DType) -> nccl_sys::ncclDataType_t {
    match dtype {
        DType::Fp32 => nccl_sys::ncclDataType_t::ncclFloat32,
        DType::Fp16 => nccl_sys::ncclDataType_t::ncclFloat16,
        DType::Bf16 => nccl_sys::ncclDataType_t::ncclBfloat16,
    }
}

/// A communicator handle as NCCL returns it.
#[derive(Debug)]
struct RawComm(nccl_sys::ncclComm_t);

// SAFETY: an NCCL communicator is a handle that any thread may use as long as no two threads
// call into it at once (NCCL's thread-safety rule). A `RawComm` lives only in an
// [`AbortSlot`], whose lock every call on it holds ([`Communicator`]'s collectives, its
// release, a [`CommAbort`] from another thread), so no two threads ever use it at once.
unsafe impl Send for RawComm {}

/// How long an abort from another thread waits for a call in progress on the communicator
/// (a call only queues work, so it returns within this unless NCCL itself hangs).
const ABORT_WAIT: Duration = Duration::from_secs(2);

/// One rank's NCCL communicator; its collectives are queued on `stream`. The handle sits in
/// an [`AbortSlot`] shared with [`CommAbort`]s, so a failing thread can abort it
/// (`ncclCommAbort`) while its owner waits on the device; the owner's later calls are then
/// errors.
pub(crate) struct Communicator {
    raw: Arc<AbortSlot<RawComm>>,
    stream: Arc<CudaStream>,
    rank: usize,
    world_size: usize,
    /// Release with `ncclCommAbort` instead of waiting for the stream and destroying.
    abort_on_drop: bool,
}

/// Aborts one communicator from any thread (`ncclCommAbort`), once: for a failing rank, which
/// aborts every communicator of its process so that peers waiting on the device are released.
/// Holds no communicator alive.
#[derive(Clone, Debug)]
pub(crate) struct CommAbort {
    raw: Weak<AbortSlot<RawComm>>,
    stream: Arc<CudaStream>,
    rank: usize,
}

impl CommAbort {
    /// Aborts the communicator unless it is gone already; waits at most [`ABORT_WAIT`] for a
    /// call on it in another thread. Returns whether this call aborted it. Never panics.
    pub(crate) fn abort(&self) -> bool {
        let Some(slot) = self.raw.upgrade() else {
            return false;
        };
        match slot.take_within(ABORT_WAIT) {
            Ok(Some(raw)) => {
                release(&self.stream, raw, true);
                true
            }
            Ok(None) => false,
            Err(Busy) => {
                let _ = writeln!(
                    std::io::stderr(),
                    "mucudnn: warning: NCCL communicator of rank {} still in a call after {:?}; \
                     not aborted",
                    self.rank,
                    ABORT_WAIT
                );
                false
            }
        }
    }
}

/// Releases a communicator taken out of its slot: `ncclCommAbort` (no waiting for peers), or
/// after the stream's queued work `ncclCommDestroy`. Warns on failure; never panics.
fn release(stream: &CudaStream, raw: RawComm, abort: bool) {
    // A communicator exists only after the gate passed.
    let Ok(lib) = library() else {
        return;
    };
    let _ = stream.context().bind_to_thread();
    let (call, status) = if abort {
        // SAFETY: `raw` was created by ncclCommInitRank/ncclCommInitAll and taken out of its
        // slot, under the slot's lock, by this caller alone: it is released exactly once, and
        // no call on it is running or can start (later calls find the slot empty).
        ("ncclCommAbort", unsafe { (lib.comm_abort)(raw.0) })
    } else {
        // Let queued collectives finish before their communicator goes.
        let _ = stream.synchronize();
        // SAFETY: as above.
        ("ncclCommDestroy", unsafe { (lib.comm_destroy)(raw.0) })
    };
    if status != nccl_sys::ncclResult_t::ncclSuccess {
        let _ = writeln!(
            std::io::stderr(),
            "mucudnn: warning: {call} failed while releasing a communicator: {status:?} ({})",
            status as u32
        );
    }
}

/// Queues the collectives issued by `body` as one NCCL group (`ncclGroupStart` ...
/// `ncclGroupEnd`): NCCL fuses them into one launch, the cost of one all-reduce for many
/// tensors. `ncclGroupEnd` is called even when `body` fails, so the group is always closed.
pub(crate) fn grouped<T>(
    body: impl FnOnce() -> Result<T, GpuTrainError>,
) -> Result<T, GpuTrainError> {
    let lib = library()?;
    // SAFETY: the gate passed; group calls take no arguments and only nest NCCL's state.
    let status = unsafe { (lib.group_start)() };
    if status != nccl_sys::ncclResult_t::ncclSuccess {
        return Err(nccl_error(
            "ncclGroupStart",
            status,
            std::ptr::null_mut(),
            "grouping",
        ));
    }
    let result = body();
    // SAFETY: as above; closes the group opened here.
    let status = unsafe { (lib.group_end)() };
    let value = result?;
    if status != nccl_sys::ncclResult_t::ncclSuccess {
        return Err(nccl_error(
            "ncclGroupEnd",
            status,
            std::ptr::null_mut(),
            "grouped collectives",
        ));
    }
    Ok(value)
}

impl Communicator {
    /// One communicator per stream, all in this process (`ncclCommInitAll`, no network and no
    /// unique id): rank `i` runs on `streams[i]`'s device. Each device must appear once.
    pub(crate) fn init_all(streams: Vec<Arc<CudaStream>>) -> Result<Vec<Self>, GpuTrainError> {
        const CALL: &str = "NcclComm::init_all";
        let world_size = streams.len();
        let (nranks, _) = check_rank(CALL, world_size, 0)?;
        let lib = library()?;
        let devices: Vec<c_int> = streams
            .iter()
            .map(|stream| stream.context().ordinal() as c_int)
            .collect();
        let mut unique = devices.clone();
        unique.sort_unstable();
        unique.dedup();
        if unique.len() != devices.len() {
            return Err(invalid(CALL, format!("devices {devices:?} repeat a GPU")));
        }
        let mut raws: Vec<nccl_sys::ncclComm_t> = vec![std::ptr::null_mut(); world_size];
        // SAFETY: the gate passed; `raws` has room for `nranks` communicators and `devices`
        // holds `nranks` distinct, valid device ordinals (each stream's context exists); NCCL
        // sets each device itself.
        let status = unsafe { (lib.comm_init_all)(raws.as_mut_ptr(), nranks, devices.as_ptr()) };
        if status != nccl_sys::ncclResult_t::ncclSuccess {
            return Err(nccl_error(
                "ncclCommInitAll",
                status,
                std::ptr::null_mut(),
                &format!("{world_size} GPU(s): devices {devices:?}"),
            ));
        }
        Ok(raws
            .into_iter()
            .zip(streams)
            .enumerate()
            .map(|(rank, (raw, stream))| Communicator {
                raw: AbortSlot::new(RawComm(raw)),
                stream,
                rank,
                world_size,
                abort_on_drop: false,
            })
            .collect())
    }

    /// `ncclCommInitRank` on the stream's device. Blocks until every rank of the world has
    /// called it with the same id (NCCL's rule: call it from one thread or process per rank).
    pub(crate) fn init_rank(
        world_size: usize,
        rank: usize,
        id: &[u8; UNIQUE_ID_BYTES],
        stream: Arc<CudaStream>,
    ) -> Result<Self, GpuTrainError> {
        const CALL: &str = "NcclComm::init_rank";
        let (nranks, rank_int) = check_rank(CALL, world_size, rank)?;
        let lib = library()?;
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| driver_error("cuCtxSetCurrent", e))?;
        let unique_id = nccl_sys::ncclUniqueId {
            internal: id.map(|b| b as c_char),
        };
        let mut raw: nccl_sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: the gate passed; the stream's context is current (NCCL binds the communicator
        // to the current device); the call writes one pointer to a live local and takes the id
        // by value.
        let status = unsafe { (lib.comm_init_rank)(&mut raw, nranks, unique_id, rank_int) };
        if status != nccl_sys::ncclResult_t::ncclSuccess {
            return Err(nccl_error(
                "ncclCommInitRank",
                status,
                std::ptr::null_mut(),
                &format!(
                    "rank {rank} of {world_size} on device {}",
                    stream.context().ordinal()
                ),
            ));
        }
        Ok(Communicator {
            raw: AbortSlot::new(RawComm(raw)),
            stream,
            rank,
            world_size,
            abort_on_drop: false,
        })
    }

    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// A handle that aborts this communicator from any thread (see [`CommAbort`]).
    pub(crate) fn abort_handle(&self) -> CommAbort {
        CommAbort {
            raw: Arc::downgrade(&self.raw),
            stream: self.stream.clone(),
            rank: self.rank,
        }
    }

    /// Runs `call` with the raw handle under the slot's lock; an error when the communicator
    /// was aborted (another rank failed).
    fn with_raw(
        &self,
        op: &'static str,
        call: impl FnOnce(nccl_sys::ncclComm_t) -> Result<(), GpuTrainError>,
    ) -> Result<(), GpuTrainError> {
        self.raw.with(|raw| call(raw.0)).unwrap_or_else(|| {
            Err(invalid(
                op,
                format!(
                    "the NCCL communicator of {} was aborted (a rank failed)",
                    self.context()
                ),
            ))
        })
    }

    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    pub(crate) fn world_size(&self) -> usize {
        self.world_size
    }

    fn context(&self) -> String {
        format!(
            "rank {} of {} on device {}",
            self.rank,
            self.world_size,
            self.stream.context().ordinal()
        )
    }

    /// Checks `buf` and returns its element count and NCCL type.
    fn prepare<D: DeviceDataMut + ?Sized>(
        &self,
        op: &'static str,
        buf: &D,
    ) -> Result<(usize, nccl_sys::ncclDataType_t), GpuTrainError> {
        if buf.elements() == 0 {
            return Err(invalid(op, "an empty buffer"));
        }
        check_stream(op, "the buffer", buf, &self.stream)?;
        self.stream
            .context()
            .bind_to_thread()
            .map_err(|e| driver_error("cuCtxSetCurrent (or an earlier deferred CUDA error)", e))?;
        Ok((buf.elements(), nccl_type(buf.dtype())))
    }

    /// In-place all-reduce of `buf` over every rank, queued on the stream.
    pub(crate) fn all_reduce(
        &self,
        op: &'static str,
        buf: &mut dyn DeviceDataMut,
        reduce: Reduce,
    ) -> Result<(), GpuTrainError> {
        let (count, datatype) = self.prepare(op, buf)?;
        let lib = library()?;
        let (ptr, _sync) = buf.raw_write(&self.stream);
        let reduce_op = match reduce {
            Reduce::Sum => nccl_sys::ncclRedOp_t::ncclSum,
            Reduce::Average => nccl_sys::ncclRedOp_t::ncclAvg,
        };
        self.with_raw(op, |raw| {
            // SAFETY: `raw` is a live communicator (in its slot, whose lock this call holds:
            // no other thread uses or releases it meanwhile), its device's context current;
            // `ptr` addresses `count` elements of `datatype` in a live allocation on the
            // communicator's stream (checked), borrowed exclusively; in place (send ==
            // receive) is allowed; frees are stream-ordered after the guard records this use.
            let status = unsafe {
                (lib.all_reduce)(
                    ptr as *const c_void,
                    ptr as *mut c_void,
                    count,
                    datatype,
                    reduce_op,
                    raw,
                    self.stream.cu_stream() as _,
                )
            };
            match status {
                nccl_sys::ncclResult_t::ncclSuccess => Ok(()),
                other => Err(nccl_error("ncclAllReduce", other, raw, &self.context())),
            }
        })
    }

    /// In-place broadcast of `buf` from rank `root` to every rank, queued on the stream.
    pub(crate) fn broadcast(
        &self,
        op: &'static str,
        buf: &mut dyn DeviceDataMut,
        root: usize,
    ) -> Result<(), GpuTrainError> {
        if root >= self.world_size {
            return Err(invalid(
                op,
                format!(
                    "root {root} is not a rank of world size {}",
                    self.world_size
                ),
            ));
        }
        let (count, datatype) = self.prepare(op, buf)?;
        let lib = library()?;
        let (ptr, _sync) = buf.raw_write(&self.stream);
        self.with_raw(op, |raw| {
            // SAFETY: as for `all_reduce`; `root` is a rank of this communicator (checked, and
            // it fits int because the world size does).
            let status = unsafe {
                (lib.broadcast)(
                    ptr as *const c_void,
                    ptr as *mut c_void,
                    count,
                    datatype,
                    root as c_int,
                    raw,
                    self.stream.cu_stream() as _,
                )
            };
            match status {
                nccl_sys::ncclResult_t::ncclSuccess => Ok(()),
                other => Err(nccl_error("ncclBroadcast", other, raw, &self.context())),
            }
        })
    }

    /// Tears the communicator down without waiting for the other ranks (`ncclCommAbort`):
    /// for error paths, where a peer may be gone and a destroy could wait for it.
    pub(crate) fn abort(mut self) {
        self.abort_on_drop = true;
    }
}

/// Validates `(world_size, rank)` and returns them as NCCL's ints.
pub(crate) fn check_rank(
    call: &'static str,
    world_size: usize,
    rank: usize,
) -> Result<(c_int, c_int), GpuTrainError> {
    if world_size == 0 {
        return Err(invalid(
            call,
            "world size 0: an NCCL world has at least one rank",
        ));
    }
    if rank >= world_size {
        return Err(invalid(
            call,
            format!("rank {rank} is not below the world size {world_size}"),
        ));
    }
    let nranks = c_int::try_from(world_size)
        .map_err(|_| invalid(call, format!("world size {world_size} exceeds NCCL's int")))?;
    Ok((nranks, rank as c_int))
}

impl Drop for Communicator {
    fn drop(&mut self) {
        // Already gone when a failing rank aborted it (see `CommAbort`).
        if let Some(raw) = self.raw.take() {
            release(&self.stream, raw, self.abort_on_drop);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libnccl_so_2_is_searched_right_after_the_plain_name() {
        let names = library_names();
        assert_eq!(names[..2], ["libnccl.so", "libnccl.so.2"]);
        // cudarc's own candidates follow, without repeats.
        for name in cudarc::get_lib_name_candidates("nccl") {
            assert_eq!(names.iter().filter(|n| **n == name).count(), 1, "{name}");
        }
    }

    #[test]
    fn the_first_name_that_loads_is_taken_and_symbols_resolve_from_it() {
        // The loader's mechanics on a library every Linux machine has (libnccl is not here).
        let names = [
            "libmucudnn-absent.so.7".to_string(),
            "libc.so.6".to_string(),
        ];
        let (name, library) = open_first(&names).expect("libc loads");
        assert_eq!(name, "libc.so.6");
        // SAFETY: `getpid` is `pid_t getpid(void)`; the pointer is called while `library`
        // lives.
        let getpid = unsafe { symbol::<unsafe extern "C" fn() -> c_int>(&library, "getpid") }
            .expect("libc exports getpid");
        // SAFETY: getpid has no preconditions.
        assert_eq!(unsafe { getpid() } as u32, std::process::id());
        // SAFETY: never called.
        let absent = unsafe { symbol::<unsafe extern "C" fn()>(&library, "ncclGetVersion") };
        assert!(absent.is_none());
        assert!(open_first(&names[..1]).is_none());
    }
}
