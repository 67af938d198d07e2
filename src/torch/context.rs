//! PyTorch's global switches that choose a convolution's plans, read at each call as
//! PyTorch's own convolution reads them: whether cuDNN may use TF32 for fp32 convolutions
//! (`torch.backends.cudnn.allow_tf32`, or `torch.backends.cudnn.conv.fp32_precision`), and
//! whether only deterministic algorithms may run (`torch.backends.cudnn.deterministic`,
//! `torch.use_deterministic_algorithms`).
//!
//! PyTorch's stable C interface has no getter for them, so they are read from `at::Context`
//! through its exported C++ methods (`at::globalContext()`, `Context::deterministicCuDNN()`,
//! `Context::deterministicAlgorithms()`, `Context::allowTF32CuDNN(optional<Float32Op>)`),
//! called with the Itanium C++ ABI: a `const` method is a function of the object's address,
//! and `std::optional<Float32Op>` (an `int` enum and a flag, 8 trivially copyable bytes) one
//! integer register. These are the one place mucudnn depends on libtorch's C++ ABI; a torch
//! whose symbols differ resolves none of them, and the switches then read as PyTorch's
//! defaults (no determinism, TF32 allowed) with one warning. The Python tests flip each switch
//! and check what is read here.

use std::ffi::{c_void, CString};
use std::sync::Once;

type Getter = unsafe extern "C-unwind" fn(*const c_void) -> bool;
type Tf32Getter = unsafe extern "C-unwind" fn(*const c_void, u64) -> bool;

/// `Float32Op::CONV` in an engaged `std::optional<Float32Op>`.
const CONV_OP: u64 = 1 | (1 << 32);

/// The switches as read for one call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Switches {
    pub allow_tf32: bool,
    pub deterministic: bool,
}

impl Switches {
    /// PyTorch's defaults.
    pub const DEFAULT: Switches = Switches {
        allow_tf32: true,
        deterministic: false,
    };
}

/// The getters, resolved once.
pub struct Context {
    getters: Option<Getters>,
}

struct Getters {
    context: *const c_void,
    deterministic_cudnn: Getter,
    deterministic_algorithms: Getter,
    allow_tf32_cudnn: Tf32Getter,
}

// SAFETY: the context pointer is PyTorch's process-wide `at::Context` (a static object), read
// through its thread-safe const getters.
unsafe impl Send for Context {}
unsafe impl Sync for Context {}

fn symbol(library: *mut c_void, name: &str) -> Option<*mut c_void> {
    let name = CString::new(name).ok()?;
    // SAFETY: a live handle and a NUL-terminated name.
    let address = unsafe { libc::dlsym(library, name.as_ptr()) };
    (!address.is_null()).then_some(address)
}

impl Context {
    /// Resolves the getters from libtorch_cpu's handle.
    ///
    /// # Safety
    ///
    /// `library` is a live handle of PyTorch's libtorch_cpu.
    pub unsafe fn resolve(library: *mut c_void) -> Context {
        let getters = (|| {
            let global = symbol(library, "_ZN2at13globalContextEv")?;
            // SAFETY: `at::Context& at::globalContext()`: no arguments, returns the address.
            let global: unsafe extern "C-unwind" fn() -> *const c_void =
                unsafe { std::mem::transmute(global) };
            // SAFETY: the Itanium ABI's form of these const methods (see the module docs).
            unsafe {
                Some(Getters {
                    context: global(),
                    deterministic_cudnn: std::mem::transmute::<*mut c_void, Getter>(symbol(
                        library,
                        "_ZNK2at7Context18deterministicCuDNNEv",
                    )?),
                    deterministic_algorithms: std::mem::transmute::<*mut c_void, Getter>(symbol(
                        library,
                        "_ZNK2at7Context23deterministicAlgorithmsEv",
                    )?),
                    allow_tf32_cudnn: std::mem::transmute::<*mut c_void, Tf32Getter>(symbol(
                        library,
                        "_ZNK2at7Context14allowTF32CuDNNESt8optionalINS_9Float32OpEE",
                    )?),
                })
            }
        })();
        Context { getters }
    }

    /// Whether the switches are read from PyTorch (else they are its defaults).
    pub fn is_resolved(&self) -> bool {
        self.getters.is_some()
    }

    /// The switches now.
    pub fn read(&self) -> Switches {
        match &self.getters {
            Some(g) => {
                // SAFETY: const getters of the live global context (see `resolve`).
                unsafe {
                    Switches {
                        allow_tf32: (g.allow_tf32_cudnn)(g.context, CONV_OP),
                        deterministic: (g.deterministic_cudnn)(g.context)
                            || (g.deterministic_algorithms)(g.context),
                    }
                }
            }
            None => {
                static WARNED: Once = Once::new();
                WARNED.call_once(|| {
                    eprintln!(
                        "mucudnn: warning: this torch's determinism and TF32 switches cannot be \
                         read; mucudnn plans as PyTorch's defaults (TF32 allowed, any \
                         algorithm)"
                    )
                });
                Switches::DEFAULT
            }
        }
    }
}
