//! The libtorch functions the kernels call, resolved at run time from the libraries PyTorch
//! has already loaded into the process (`dlopen` with `RTLD_NOLOAD`: nothing is loaded here).
//!
//! They are PyTorch's stable C interface (`aoti_torch_*`, `torch_*`; torch >= 2.10), plus the
//! generated C shims of two kernels per device (`aoti_torch_{cpu,cuda}_convolution` and
//! `..._convolution_backward`, which call PyTorch's own kernels for that device directly, not
//! through the dispatcher: the exact fallback), plus a few optional symbols: the C++
//! `operator new`/`delete` that torch < 2.13 boxes optional arguments with, and the getters of
//! PyTorch's global switches (determinism, TF32) in [`super::context`]. Nothing here is
//! declared by a header at build time: the library links no torch and loads where no torch is
//! (the C ABI's clients, the CLI, candle); [`TorchApi::load`] fails with the first missing name.

use std::ffi::{c_char, c_void, CStr, CString};

/// `AtenTensorHandle`: a pointer to a heap `at::Tensor` (owning where the interface says so).
pub type Ath = *mut c_void;
/// `StableIValue`: one argument or return of a boxed kernel, as 64 bits.
pub type Siv = u64;
/// `AOTITorchError`: 0 is success.
pub type TorchError = i32;
/// A boxed kernel: the stack of arguments (then returns), their count and the returns'.
pub type BoxedKernel = unsafe extern "C-unwind" fn(*mut Siv, u64, u64);

/// The stable interface's version of an extension built against torch 2.10 (what the boxed
/// values of the kernels mean: `(major << 56) | (minor << 48)`).
pub const EXTENSION_VERSION: u64 = (2 << 56) | (10 << 48);

macro_rules! api {
    ($(#[$sdoc:meta])* $api:ident {
        $( $(#[$doc:meta])* $field:ident : $name:literal => fn($($arg:ty),*) $(-> $ret:ty)?; )*
    }) => {
        $(#[$sdoc])*
        #[allow(clippy::type_complexity)]
        pub struct $api {
            $( $(#[$doc])* pub $field: unsafe extern "C-unwind" fn($($arg),*) $(-> $ret)?, )*
        }

        impl $api {
            /// # Safety
            ///
            /// `library` is a live `dlopen` handle of the libtorch library these functions are
            /// in, whose symbols of these names have these C signatures (torch >= 2.10's stable
            /// interface and C shims).
            unsafe fn resolve(library: *mut c_void) -> Result<Self, String> {
                Ok($api {
                    $( $field: {
                        let address = symbol(library, $name)?;
                        // SAFETY: the caller's contract: the symbol has this signature.
                        unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C-unwind" fn($($arg),*) $(-> $ret)?>(address) }
                    }, )*
                })
            }
        }
    };
}

api! {
    /// The required functions of libtorch_cpu (see the module docs).
    CpuApi {
    get_dim: "aoti_torch_get_dim" => fn(Ath, *mut i64) -> TorchError;
    get_sizes: "aoti_torch_get_sizes" => fn(Ath, *mut *mut i64) -> TorchError;
    get_strides: "aoti_torch_get_strides" => fn(Ath, *mut *mut i64) -> TorchError;
    get_dtype: "aoti_torch_get_dtype" => fn(Ath, *mut i32) -> TorchError;
    get_device_type: "aoti_torch_get_device_type" => fn(Ath, *mut i32) -> TorchError;
    get_device_index: "aoti_torch_get_device_index" => fn(Ath, *mut i32) -> TorchError;
    get_layout: "aoti_torch_get_layout" => fn(Ath, *mut i32) -> TorchError;
    get_data_ptr: "aoti_torch_get_data_ptr" => fn(Ath, *mut *mut c_void) -> TorchError;
    get_storage_offset: "aoti_torch_get_storage_offset" => fn(Ath, *mut i64) -> TorchError;
    /// Another owning handle of the same tensor.
    new_tensor_handle: "aoti_torch_new_tensor_handle" => fn(Ath, *mut Ath) -> TorchError;
    is_defined: "aoti_torch_is_defined" => fn(Ath, *mut bool) -> TorchError;
    empty_strided: "aoti_torch_empty_strided" =>
        fn(i64, *const i64, *const i64, i32, i32, i32, *mut Ath) -> TorchError;
    /// A view of a tensor's storage with other sizes, strides and offset (as_strided).
    reinterpret: "aoti_torch__reinterpret_tensor" =>
        fn(Ath, i64, *const i64, *const i64, i64, *mut Ath) -> TorchError;
    /// `self.copy_(src)`.
    copy_: "aoti_torch_copy_" => fn(Ath, Ath, i32) -> TorchError;
    new_uninitialized: "aoti_torch_new_uninitialized_tensor" => fn(*mut Ath) -> TorchError;
    delete_tensor: "aoti_torch_delete_tensor_object" => fn(Ath) -> TorchError;
    grad_mode_is_enabled: "aoti_torch_grad_mode_is_enabled" => fn() -> bool;
    dtype_float32: "aoti_torch_dtype_float32" => fn() -> i32;
    dtype_float16: "aoti_torch_dtype_float16" => fn() -> i32;
    dtype_bfloat16: "aoti_torch_dtype_bfloat16" => fn() -> i32;
    device_type_cpu: "aoti_torch_device_type_cpu" => fn() -> i32;
    device_type_cuda: "aoti_torch_device_type_cuda" => fn() -> i32;
    layout_strided: "aoti_torch_layout_strided" => fn() -> i32;
    list_size: "torch_list_size" => fn(*mut c_void, *mut usize) -> TorchError;
    list_get: "torch_list_get_item" => fn(*mut c_void, usize, *mut Siv) -> TorchError;
    delete_list: "torch_delete_list" => fn(*mut c_void) -> TorchError;
    new_list: "torch_new_list_reserve_size" => fn(usize, *mut *mut c_void) -> TorchError;
    list_push: "torch_list_push_back" => fn(*mut c_void, Siv) -> TorchError;
    call_dispatcher: "torch_call_dispatcher" =>
        fn(*const c_char, *const c_char, *mut Siv, u64) -> TorchError;
    library_init_impl: "aoti_torch_library_init_impl" =>
        fn(*const c_char, *const c_char, *const c_char, u32, *mut *mut c_void) -> TorchError;
    library_impl: "torch_library_impl" =>
        fn(*mut c_void, *const c_char, BoxedKernel, u64) -> TorchError;
    delete_library: "aoti_torch_delete_library_object" => fn(*mut c_void) -> TorchError;
    /// Throws PyTorch's exception (a `RuntimeError` in Python) when `cond` is false.
    check: "aoti_torch_check" => fn(bool, *const c_char, *const c_char, u32, *const c_char);
    cpu_convolution: "aoti_torch_cpu_convolution" => fn(
        Ath, Ath, *mut Ath, *const i64, i64, *const i64, i64, *const i64, i64, i32,
        *const i64, i64, i64, *mut Ath
    ) -> TorchError;
    cpu_convolution_backward: "aoti_torch_cpu_convolution_backward" => fn(
        Ath, Ath, Ath, *const *const i64, i64, *const i64, i64, *const i64, i64, *const i64,
        i64, i32, *const i64, i64, i64, *const i32, i64, *mut Ath, *mut Ath, *mut Ath
    ) -> TorchError;
    }
}

api! {
    /// The functions of libtorch_cuda (a CUDA build of PyTorch).
    CudaApi {
    convolution: "aoti_torch_cuda_convolution" => fn(
        Ath, Ath, *mut Ath, *const i64, i64, *const i64, i64, *const i64, i64, i32,
        *const i64, i64, i64, *mut Ath
    ) -> TorchError;
    convolution_backward: "aoti_torch_cuda_convolution_backward" => fn(
        Ath, Ath, Ath, *const *const i64, i64, *const i64, i64, *const i64, i64, *const i64,
        i64, i32, *const i64, i64, i64, *const i32, i64, *mut Ath, *mut Ath, *mut Ath
    ) -> TorchError;
    /// The current stream of a device (`cudaStream_t`).
    current_stream: "aoti_torch_get_current_cuda_stream" => fn(i32, *mut *mut c_void) -> TorchError;
    /// PyTorch's caching allocator on the current device and stream.
    raw_alloc: "aoti_torch_cuda_caching_allocator_raw_alloc" => fn(u64, *mut *mut c_void) -> TorchError;
    raw_delete: "aoti_torch_cuda_caching_allocator_raw_delete" => fn(*mut c_void) -> TorchError;
    /// `self + alpha * other` (a new tensor).
    add: "aoti_torch_cuda_add_Tensor" => fn(Ath, Ath, f64, *mut Ath) -> TorchError;
    create_guard: "aoti_torch_create_cuda_guard" => fn(i32, *mut *mut c_void) -> TorchError;
    delete_guard: "aoti_torch_delete_cuda_guard" => fn(*mut c_void) -> TorchError;
    /// Waits for the work queued on a stream (before tuning: measure on a quiet GPU).
    synchronize: "torch_cuda_stream_synchronize" => fn(*mut c_void, i32) -> TorchError;
    }
}

/// How torch boxes an optional argument: torch >= 2.13 makes and frees the box with
/// `torch_new_stable_ivalue` / `torch_delete_stable_ivalue`, earlier versions with C++ `new`
/// and `delete` (found through libtorch's own dependencies, libstdc++).
pub struct Boxes {
    delete: Option<unsafe extern "C-unwind" fn(*mut Siv) -> TorchError>,
    new: Option<unsafe extern "C-unwind" fn(*mut *mut Siv) -> TorchError>,
    cxx_delete: Option<unsafe extern "C-unwind" fn(*mut c_void)>,
    cxx_new: Option<unsafe extern "C-unwind" fn(usize) -> *mut c_void>,
}

/// Everything resolved, and the codes PyTorch gives dtypes and devices.
pub struct TorchApi {
    pub cpu: CpuApi,
    pub cuda: Option<CudaApi>,
    pub boxes: Boxes,
    /// `torch_exception_get_what_without_backtrace` (torch >= 2.13): the message of the
    /// exception a fallback kernel raised, so that it reaches the caller as PyTorch's.
    pub exception_message: Option<unsafe extern "C-unwind" fn() -> *const c_char>,
    /// `torch::jit::tracer::getTracingState()`: a reference to this thread's
    /// `std::shared_ptr<TracingState>`, whose first word is null unless `torch.jit.trace` is
    /// recording (libtorch's C++ ABI; absent, no call is seen as traced).
    tracing_state: Option<unsafe extern "C-unwind" fn() -> *const *const c_void>,
    pub codes: Codes,
    /// libtorch_cpu's handle (kept open for the process: its symbols are in use).
    pub(crate) library: *mut c_void,
}

// SAFETY: the handle and function pointers are immutable after loading and refer to code that
// libtorch keeps loaded for the process's life.
unsafe impl Send for TorchApi {}
unsafe impl Sync for TorchApi {}

/// PyTorch's numbers for the dtypes, devices and layout mucudnn reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Codes {
    pub float32: i32,
    pub float16: i32,
    pub bfloat16: i32,
    pub cpu: i32,
    pub cuda: i32,
    pub strided: i32,
}

fn symbol(library: *mut c_void, name: &str) -> Result<*mut c_void, String> {
    let c_name = CString::new(name).expect("symbol names have no NUL");
    // SAFETY: `library` is a live handle (callers' contract) and the name is NUL-terminated.
    let address = unsafe { libc::dlsym(library, c_name.as_ptr()) };
    if address.is_null() {
        Err(format!(
            "libtorch has no `{name}` (mucudnn's native kernels need PyTorch 2.10 or newer)"
        ))
    } else {
        Ok(address)
    }
}

fn optional_symbol(library: *mut c_void, name: &str) -> Option<*mut c_void> {
    symbol(library, name).ok()
}

/// The already loaded library at `path` (`RTLD_NOLOAD`: it is not loaded if it is not).
fn loaded(path: &str) -> Result<*mut c_void, String> {
    let c_path = CString::new(path).map_err(|_| format!("{path:?} holds a NUL byte"))?;
    // SAFETY: a NUL-terminated path; RTLD_NOLOAD only returns a handle to a loaded library.
    let handle = unsafe { libc::dlopen(c_path.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    if handle.is_null() {
        // SAFETY: dlerror returns null or a NUL-terminated message owned by libc.
        let reason = unsafe {
            let message = libc::dlerror();
            if message.is_null() {
                "unknown reason".to_string()
            } else {
                CStr::from_ptr(message).to_string_lossy().into_owned()
            }
        };
        return Err(format!(
            "{path} is not loaded in this process (import torch first): {reason}"
        ));
    }
    Ok(handle)
}

impl TorchApi {
    /// Resolves the interface from the loaded `libtorch_cpu` (and `libtorch_cuda`, when its
    /// path is given and it is loaded).
    ///
    /// # Safety
    ///
    /// The libraries at these paths are PyTorch's own, of a version whose stable interface
    /// has the signatures declared here (torch >= 2.10; the Python package checks the version
    /// before it calls this).
    pub unsafe fn load(cpu_path: &str, cuda_path: Option<&str>) -> Result<Self, String> {
        let library = loaded(cpu_path)?;
        // SAFETY: the caller's contract.
        let cpu = unsafe { CpuApi::resolve(library)? };
        let cuda = match cuda_path {
            None => None,
            // SAFETY: the caller's contract.
            Some(path) => Some(unsafe { CudaApi::resolve(loaded(path)?)? }),
        };
        // SAFETY (the transmutes): the stable interface's signatures of these names, and the
        // Itanium C++ ABI's of `operator delete(void*)` and `operator new(size_t)`.
        type Delete = unsafe extern "C-unwind" fn(*mut Siv) -> TorchError;
        type New = unsafe extern "C-unwind" fn(*mut *mut Siv) -> TorchError;
        type CxxDelete = unsafe extern "C-unwind" fn(*mut c_void);
        type CxxNew = unsafe extern "C-unwind" fn(usize) -> *mut c_void;
        let boxes = Boxes {
            delete: optional_symbol(library, "torch_delete_stable_ivalue")
                .map(|a| unsafe { std::mem::transmute::<*mut c_void, Delete>(a) }),
            new: optional_symbol(library, "torch_new_stable_ivalue")
                .map(|a| unsafe { std::mem::transmute::<*mut c_void, New>(a) }),
            cxx_delete: optional_symbol(library, "_ZdlPv")
                .map(|a| unsafe { std::mem::transmute::<*mut c_void, CxxDelete>(a) }),
            cxx_new: optional_symbol(library, "_Znwm")
                .map(|a| unsafe { std::mem::transmute::<*mut c_void, CxxNew>(a) }),
        };
        if (boxes.delete.is_none() && boxes.cxx_delete.is_none())
            || (boxes.new.is_none() && boxes.cxx_new.is_none())
        {
            return Err(
                "libtorch has neither torch_{new,delete}_stable_ivalue nor C++ new/delete".into(),
            );
        }
        type Message = unsafe extern "C-unwind" fn() -> *const c_char;
        let exception_message =
            optional_symbol(library, "torch_exception_get_what_without_backtrace")
                // SAFETY: the stable interface's signature of this name.
                .map(|a| unsafe { std::mem::transmute::<*mut c_void, Message>(a) });
        type TracingState = unsafe extern "C-unwind" fn() -> *const *const c_void;
        let tracing_state = optional_symbol(library, "_ZN5torch3jit6tracer15getTracingStateEv")
            // SAFETY: `const std::shared_ptr<TracingState>& getTracingState()`: no arguments,
            // returns the address of the thread's shared_ptr (checked in the library: it
            // returns the thread-local's address, with no hidden result argument).
            .map(|a| unsafe { std::mem::transmute::<*mut c_void, TracingState>(a) });
        // SAFETY: getters without arguments.
        let codes = unsafe {
            Codes {
                float32: (cpu.dtype_float32)(),
                float16: (cpu.dtype_float16)(),
                bfloat16: (cpu.dtype_bfloat16)(),
                cpu: (cpu.device_type_cpu)(),
                cuda: (cpu.device_type_cuda)(),
                strided: (cpu.layout_strided)(),
            }
        };
        Ok(TorchApi {
            cpu,
            cuda,
            boxes,
            exception_message,
            tracing_state,
            codes,
            library,
        })
    }

    /// Frees the box of an optional argument a kernel received.
    ///
    /// # Safety
    ///
    /// `boxed` is a box the dispatcher handed to a kernel, not freed before.
    pub unsafe fn free_box(&self, boxed: *mut Siv) {
        // SAFETY: the caller's contract; one of the two exists (checked at loading), and the
        // one that exists is how this torch made the box.
        unsafe {
            if let Some(delete) = self.boxes.delete {
                delete(boxed);
            } else if let Some(delete) = self.boxes.cxx_delete {
                delete(boxed.cast());
            }
        }
    }

    /// A new box holding `value` (for an optional argument of a dispatcher call, which frees
    /// it); `None` when it cannot be made.
    pub fn new_box(&self, value: Siv) -> Option<*mut Siv> {
        let mut boxed: *mut Siv = std::ptr::null_mut();
        // SAFETY: the out-pointer is a local; `operator new` of 8 bytes throws rather than
        // return null (an allocation failure aborts, as any of this crate's does).
        unsafe {
            if let Some(new) = self.boxes.new {
                if new(&mut boxed) != 0 {
                    return None;
                }
            } else if let Some(new) = self.boxes.cxx_new {
                boxed = new(std::mem::size_of::<Siv>()).cast();
            }
        }
        if boxed.is_null() {
            return None;
        }
        // SAFETY: a fresh, writable 8-byte box.
        unsafe { *boxed = value };
        Some(boxed)
    }

    /// Whether `torch.jit.trace` is recording on this thread.
    pub fn is_tracing(&self) -> bool {
        let Some(get) = self.tracing_state else {
            return false;
        };
        // SAFETY: the getter returns the address of a live thread-local shared_ptr, whose
        // first word is its element pointer.
        unsafe {
            let state = get();
            !state.is_null() && !(*state).is_null()
        }
    }

    /// The message of the exception the last failing interface call caught on this thread, if
    /// this torch keeps it.
    pub fn last_exception(&self) -> Option<String> {
        let get = self.exception_message?;
        // SAFETY: a getter returning null or a NUL-terminated string owned by libtorch.
        let message = unsafe { get() };
        if message.is_null() {
            return None;
        }
        // SAFETY: as above; copied before any other call can replace it.
        let text = unsafe { CStr::from_ptr(message) }
            .to_string_lossy()
            .into_owned();
        (!text.is_empty()).then_some(text)
    }
}
