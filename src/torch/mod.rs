//! mucudnn inside PyTorch's dispatcher: the native side of the PyTorch package (torch >= 2.10).
//!
//! Data flow per call, with no Python: PyTorch dispatches `aten::convolution` (or its
//! backward) to mucudnn's kernel at the CPU or CUDA key ([`kernels`]); the kernel reads the
//! call's metadata, finds who the call runs for (a converted layer or the process-wide switch,
//! [`registry`]), maps it to a convolution problem ([`call`]), finds or tunes the problem's
//! plans through the cache ([`plans`]), runs them over PyTorch's tensors and stream, and counts
//! what ran ([`account`]). A call nobody claimed, or one mucudnn does not run, goes to PyTorch's
//! own kernel for the device, unchanged.
//!
//! The Python package drives this through the C ABI's `mucudnnTorch*` functions
//! (`src/c_abi/torch.rs`): it loads the runtime with the paths of the libtorch libraries it
//! imported ([`init`]), registers converted layers, turns the switch on and off, reads the
//! account and the plan reports, and runs the discovery pass of `tune()`. The libtorch
//! functions are resolved at run time from the process ([`api`]); the crate links no torch and
//! loads where none is.

pub mod account;
pub mod api;
pub mod call;
pub mod context;
pub mod kernels;
pub mod logged;
pub mod plans;
pub mod registry;

use self::account::Account;
use self::api::{TorchApi, EXTENSION_VERSION};
use self::call::{Device, Mapped};
use self::context::Context;
use self::plans::{PlanKey, Plans};
use self::registry::{Registry, Who};
use crate::solver::ConvProblem;
use serde::Serialize;
use std::ffi::{c_void, CString};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};

/// The process's runtime: the libtorch interface and everything the kernels share.
pub struct Runtime {
    pub api: TorchApi,
    pub context: Context,
    pub registry: Registry,
    pub plans: Plans,
    pub account: Account,
    registration: Mutex<Option<Registration>>,
    discovering: AtomicBool,
    discovered: Mutex<Vec<Discovered>>,
}

static RUNTIME: OnceLock<Runtime> = OnceLock::new();

/// The runtime, once [`init`] made it.
pub fn runtime() -> Option<&'static Runtime> {
    RUNTIME.get()
}

/// Runs `f` with the runtime when there is one (a config dropping its plans).
pub(crate) fn runtime_if_loaded(f: impl FnOnce(&Runtime)) {
    if let Some(runtime) = RUNTIME.get() {
        f(runtime);
    }
}

/// Loads the runtime from the libtorch libraries this process imported (once; a second call
/// with the same libraries is a no-op).
///
/// # Safety
///
/// The paths are those of the `libtorch_cpu.so` (and `libtorch_cuda.so`) PyTorch loaded in
/// this process, of version 2.10 or newer (see [`TorchApi::load`]).
pub unsafe fn init(cpu_path: &str, cuda_path: Option<&str>) -> Result<&'static Runtime, String> {
    if let Some(runtime) = RUNTIME.get() {
        return Ok(runtime);
    }
    // SAFETY: the caller's contract.
    let api = unsafe { TorchApi::load(cpu_path, cuda_path)? };
    // SAFETY: libtorch_cpu's live handle.
    let context = unsafe { Context::resolve(api.library) };
    let runtime = Runtime {
        api,
        context,
        registry: Registry::default(),
        plans: Plans::default(),
        account: Account::default(),
        registration: Mutex::new(None),
        discovering: AtomicBool::new(false),
        discovered: Mutex::new(Vec::new()),
    };
    // Two threads may race here; the first one's runtime stays.
    let _ = RUNTIME.set(runtime);
    Ok(RUNTIME.get().expect("set above"))
}

/// The kernels' registrations (a `torch::Library` per dispatch key); dropping them restores
/// PyTorch's kernels.
struct Registration {
    libraries: Vec<*mut c_void>,
}

// SAFETY: library handles are only created and deleted under the runtime's mutex.
unsafe impl Send for Registration {}

impl Runtime {
    /// Registers the kernels (once; kept until [`Runtime::unregister`]).
    pub fn register(&self) -> Result<(), String> {
        let mut registration = self
            .registration
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if registration.is_some() {
            return Ok(());
        }
        let mut keys = vec!["CPU"];
        if self.api.cuda.is_some() {
            keys.push("CUDA");
        }
        let mut libraries = Vec::new();
        let made = (|| {
            for key in keys {
                let key = CString::new(key).expect("no NUL");
                let mut library: *mut c_void = std::ptr::null_mut();
                // SAFETY: NUL-terminated strings; the handle is written to a local.
                let code = unsafe {
                    (self.api.cpu.library_init_impl)(
                        c"aten".as_ptr(),
                        key.as_ptr(),
                        c"mucudnn/src/torch/mod.rs".as_ptr(),
                        line!(),
                        &mut library,
                    )
                };
                if code != 0 {
                    return Err(self.failure("registering mucudnn's kernels"));
                }
                libraries.push(library);
                for (op, kernel) in [
                    (c"convolution", kernels::convolution as api::BoxedKernel),
                    (c"convolution_backward", kernels::convolution_backward),
                ] {
                    // SAFETY: a live library handle; the kernels take the op's boxed stack.
                    let code = unsafe {
                        (self.api.cpu.library_impl)(library, op.as_ptr(), kernel, EXTENSION_VERSION)
                    };
                    if code != 0 {
                        return Err(self.failure("registering mucudnn's kernels"));
                    }
                }
            }
            Ok(())
        })();
        if let Err(e) = made {
            for library in libraries {
                // SAFETY: made above, deleted once.
                unsafe { (self.api.cpu.delete_library)(library) };
            }
            return Err(e);
        }
        *registration = Some(Registration { libraries });
        Ok(())
    }

    /// Restores PyTorch's kernels. Not while another thread is inside a convolution (as for
    /// any change of PyTorch's dispatcher).
    pub fn unregister(&self) {
        let taken = self
            .registration
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(registration) = taken {
            for library in registration.libraries {
                // SAFETY: made by `register`, deleted once.
                unsafe { (self.api.cpu.delete_library)(library) };
            }
        }
    }

    pub fn is_registered(&self) -> bool {
        self.registration
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
    }

    fn failure(&self, what: &str) -> String {
        match self.api.last_exception() {
            Some(message) => format!("{what}: {message}"),
            None => format!("{what} failed"),
        }
    }

    /// Starts (or ends) the discovery pass of `tune()`: while on, claimed calls are recorded
    /// and run by PyTorch.
    pub fn set_discovery(&self, on: bool) {
        self.discovering.store(on, Ordering::SeqCst);
    }

    /// The calls discovered so far (taken).
    pub fn take_discovered(&self) -> Vec<Discovered> {
        std::mem::take(
            &mut *self
                .discovered
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        )
    }

    /// Records `call` when discovering; whether it did.
    /// Whether tune()'s discovery pass is on (PyTorch's kernels run every call).
    fn discovering(&self) -> bool {
        self.discovering.load(Ordering::Relaxed)
    }

    fn discover(&self, call: Discovered) -> bool {
        if !self.discovering.load(Ordering::Relaxed) {
            return false;
        }
        self.discovered
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(call);
        true
    }
}

/// A call the discovery pass saw: who it runs for and its problem.
#[derive(Clone, Debug, Serialize)]
pub struct Discovered {
    pub name: String,
    /// The options' text (the config it runs under).
    pub options: String,
    pub problem: ConvProblem,
    pub device: String,
    pub deterministic: bool,
    /// Gradients were on (a backward may follow) or it was a backward call.
    pub training: bool,
    pub transposed: bool,
    pub input: Vec<i64>,
    pub weight: Vec<i64>,
    pub output: Vec<i64>,
    pub signature: serde_json::Value,
}

impl Discovered {
    fn of(who: &Who, key: &PlanKey, mapped: &Mapped, training: bool) -> Discovered {
        let signature = &mapped.signature;
        Discovered {
            name: who.name.to_string(),
            options: who.config.text.clone(),
            problem: key.problem,
            device: match key.device {
                Device::Cpu => "cpu".into(),
                Device::Cuda(i) => format!("cuda:{i}"),
                Device::Other => "other".into(),
            },
            deterministic: key.deterministic,
            training,
            transposed: mapped.transposed,
            input: mapped.input.as_slice().to_vec(),
            weight: mapped.weight.as_slice().to_vec(),
            output: mapped.output.as_slice().to_vec(),
            signature: serde_json::json!({
                "transposed": signature.transposed,
                "weight": signature.weight.as_slice(),
                "stride": signature.stride.as_slice(),
                "dilation": signature.dilation.as_slice(),
                "groups": signature.groups,
            }),
        }
    }
}
