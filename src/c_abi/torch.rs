//! The functions the PyTorch package calls to drive mucudnn's kernels inside PyTorch's
//! dispatcher (`crate::torch`): meaningful only in a process that imported torch >= 2.10.
//! Layers, the switch and the plan table live in the library; these calls change them, none
//! runs per convolution.

use super::error::{guard, invalid, optional_str_arg, out_arg, str_arg, FfiError};
use super::{give_string, mucudnnStatus_t, to_json};
use crate::solver::{ConvOp, ConvProblem, Plan};
use crate::torch::call::{module_signature, Device, Dims, Signature};
use crate::torch::plans::{PlanKey, Request};
use crate::torch::{self as native, Runtime};
use serde::Deserialize;
use std::ffi::c_char;

fn runtime() -> Result<&'static Runtime, FfiError> {
    native::runtime().ok_or_else(|| {
        invalid("mucudnn's PyTorch runtime is not loaded (mucudnnTorchInit was not called)")
    })
}

/// What the package says of a module's calls (see mucudnnTorchAddLayer).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SignatureDocument {
    transposed: bool,
    weight: Vec<i64>,
    stride: Vec<i64>,
    dilation: Vec<i64>,
    groups: i64,
    /// The module computes the weight its convolution receives (a layer's document only).
    #[serde(default)]
    computes_weight: bool,
}

impl SignatureDocument {
    fn signature(&self) -> Result<Signature, FfiError> {
        module_signature(
            self.transposed,
            &self.weight,
            &self.stride,
            &self.dilation,
            self.groups,
        )
        .ok_or_else(|| {
            invalid("signature_json: weight must have 3 to 5 dims, stride and dilation one value per spatial dim")
        })
    }
}

/// Loads mucudnn's PyTorch runtime from the libtorch libraries the calling process imported
/// (`libtorch_cpu`, and `libtorch_cuda` or NULL), resolving PyTorch's stable C interface
/// (torch 2.10 or newer) at run time. Idempotent.
///
/// # Safety
///
/// The strings are NULL (an error for `libtorch_cpu`) or NUL-terminated paths of the libtorch
/// libraries loaded in this process, of torch 2.10 or newer.
#[no_mangle]
pub unsafe extern "C" fn mucudnnTorchInit(
    libtorch_cpu: *const c_char,
    libtorch_cuda: *const c_char,
) -> mucudnnStatus_t {
    guard("mucudnnTorchInit", || {
        // SAFETY: this function's contract.
        let cpu = unsafe { str_arg(libtorch_cpu, "libtorch_cpu") }?;
        // SAFETY: this function's contract.
        let cuda = unsafe { optional_str_arg(libtorch_cuda, "libtorch_cuda") }?;
        // SAFETY: this function's contract.
        unsafe { native::init(cpu, cuda) }
            .map(drop)
            .map_err(FfiError::NotSupported)
    })
}

/// Turns the process-wide switch on with the layer options `options_json` (every convolution
/// PyTorch runs, in any thread, goes through mucudnn where it can), or off with NULL. Turning
/// it on registers mucudnn's kernels with PyTorch's dispatcher; turning it off restores
/// PyTorch's kernels when no converted layer is left.
///
/// # Safety
///
/// `options_json` is NULL or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn mucudnnTorchSetSwitch(options_json: *const c_char) -> mucudnnStatus_t {
    guard("mucudnnTorchSetSwitch", || {
        let runtime = runtime()?;
        // SAFETY: this function's contract.
        match unsafe { optional_str_arg(options_json, "options_json") }? {
            Some(text) => {
                let config = runtime.registry.config(text)?;
                runtime.register().map_err(FfiError::Internal)?;
                runtime.registry.set_switch(Some(config));
            }
            None => {
                runtime.registry.set_switch(None);
                if runtime.registry.layer_count() == 0 {
                    runtime.unregister();
                }
            }
        }
        Ok(())
    })
}

/// Registers a converted layer: its name, options, what identifies its calls
/// (`signature_json`: {"transposed", "weight", "stride", "dilation", "groups",
/// "computes_weight"}, the weight's shape as its convolution receives it, and whether the
/// module computes that weight per call), and its weight parameter: `weight` an owning
/// `AtenTensorHandle` of it (the layer takes it over; 0: none), else `identity` the address of
/// its `TensorImpl` (`Tensor._cdata`; 0: none). `*id_out` gets its id.
///
/// # Safety
///
/// Strings NUL-terminated; `weight` 0 or an owning `AtenTensorHandle` of this process's
/// libtorch; `id_out` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn mucudnnTorchAddLayer(
    name: *const c_char,
    options_json: *const c_char,
    signature_json: *const c_char,
    weight: u64,
    identity: u64,
    id_out: *mut u64,
) -> mucudnnStatus_t {
    guard("mucudnnTorchAddLayer", || {
        let runtime = runtime()?;
        let weight = usize::try_from(weight).unwrap_or(0);
        let added = (|| {
            // SAFETY: this function's contract.
            let out = unsafe { out_arg(id_out, "id_out", 0) }?;
            // SAFETY: this function's contract.
            let name = unsafe { str_arg(name, "name") }?;
            // SAFETY: this function's contract.
            let options = unsafe { str_arg(options_json, "options_json") }?;
            // SAFETY: this function's contract.
            let signature: SignatureDocument =
                unsafe { super::json_arg(signature_json, "signature_json") }?;
            // The handle's `at::Tensor` holds one pointer, its `TensorImpl`'s.
            let identity = if weight != 0 {
                // SAFETY: this function's contract: a live handle.
                unsafe { *(weight as *const usize) }
            } else {
                usize::try_from(identity).unwrap_or(0)
            };
            let config = runtime.registry.config(options)?;
            let computes_weight = signature.computes_weight;
            let signature = signature.signature()?;
            runtime.register().map_err(FfiError::Internal)?;
            *out = runtime.registry.add_layer(
                &runtime.account,
                name,
                config,
                signature,
                identity,
                weight,
                computes_weight,
            );
            Ok(())
        })();
        if added.is_err() && weight != 0 {
            // SAFETY: the handle given over and not kept: deleted once.
            unsafe { (runtime.api.cpu.delete_tensor)(weight as *mut std::ffi::c_void) };
        }
        added
    })
}

/// Unregisters a converted layer (its module was collected, or reconverted). PyTorch's kernels
/// stay registered until the switch is turned off with no layer left.
#[no_mangle]
pub extern "C" fn mucudnnTorchRemoveLayer(id: u64) -> mucudnnStatus_t {
    guard("mucudnnTorchRemoveLayer", || {
        let runtime = runtime()?;
        if runtime.registry.remove_layer(&runtime.account, id) {
            Ok(())
        } else {
            Err(invalid(format!("layer {id} is not registered")))
        }
    })
}

/// The account of what ran: `*json_out` gets {NAME: {OP: {"mucudnn": calls, "pytorch":
/// {REASON: calls}}}} for every name and op that counted anything.
///
/// # Safety
///
/// `json_out` valid for writing; free the string with mucudnnFreeString.
#[no_mangle]
pub unsafe extern "C" fn mucudnnTorchGetAccount(json_out: *mut *mut c_char) -> mucudnnStatus_t {
    guard("mucudnnTorchGetAccount", || {
        // SAFETY: this function's contract.
        let out = unsafe { out_arg(json_out, "json_out", std::ptr::null_mut()) }?;
        give_string(out, &to_json(&runtime()?.account.read())?);
        Ok(())
    })
}

/// Zeroes the account.
#[no_mangle]
pub extern "C" fn mucudnnTorchResetAccount() -> mucudnnStatus_t {
    guard("mucudnnTorchResetAccount", || {
        runtime()?.account.reset();
        Ok(())
    })
}

/// The reports of the plans prepared now for options `options_json` (and `signature_json`, a
/// layer's, or NULL for all): `*json_out` gets an array of reports (the problem, the call's
/// shapes, the plans and their splits, where they came from, or the reason PyTorch runs it).
///
/// # Safety
///
/// Strings NUL-terminated (`signature_json` may be NULL); `json_out` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn mucudnnTorchGetReports(
    options_json: *const c_char,
    signature_json: *const c_char,
    json_out: *mut *mut c_char,
) -> mucudnnStatus_t {
    guard("mucudnnTorchGetReports", || {
        // SAFETY: this function's contract.
        let out = unsafe { out_arg(json_out, "json_out", std::ptr::null_mut()) }?;
        // SAFETY: this function's contract.
        let options = unsafe { str_arg(options_json, "options_json") }?;
        let signature = if signature_json.is_null() {
            None
        } else {
            // SAFETY: this function's contract.
            let doc: SignatureDocument =
                unsafe { super::json_arg(signature_json, "signature_json") }?;
            Some(doc.signature()?)
        };
        let runtime = runtime()?;
        let config = runtime.registry.config(options)?;
        let reports = runtime.plans.reports(config.id, signature.as_ref());
        give_string(out, &to_json(&reports)?);
        Ok(())
    })
}

/// Sets the most plan sets kept (least recently used evicted; an evicted problem is prepared
/// again from the cache, without measuring).
#[no_mangle]
pub extern "C" fn mucudnnTorchSetPlanCapacity(capacity: u64) -> mucudnnStatus_t {
    guard("mucudnnTorchSetPlanCapacity", || {
        if capacity == 0 {
            return Err(invalid("capacity must be at least 1"));
        }
        runtime()?
            .plans
            .set_capacity(usize::try_from(capacity).unwrap_or(usize::MAX));
        Ok(())
    })
}

/// The runtime's state, for tests and diagnostics: `*json_out` gets {"registered", "layers",
/// "switch", "plan_sets", "plan_capacity", "switches": {"allow_tf32", "deterministic",
/// "resolved"}}.
///
/// # Safety
///
/// `json_out` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn mucudnnTorchGetState(json_out: *mut *mut c_char) -> mucudnnStatus_t {
    guard("mucudnnTorchGetState", || {
        // SAFETY: this function's contract.
        let out = unsafe { out_arg(json_out, "json_out", std::ptr::null_mut()) }?;
        let runtime = runtime()?;
        let switches = runtime.context.read();
        let state = serde_json::json!({
            "registered": runtime.is_registered(),
            "layers": runtime.registry.layer_count(),
            "switch": runtime.registry.switch().is_some(),
            "plan_sets": runtime.plans.len(),
            "plan_capacity": runtime.plans.capacity(),
            "switches": {
                "allow_tf32": switches.allow_tf32,
                "deterministic": switches.deterministic,
                "resolved": runtime.context.is_resolved(),
            },
        });
        give_string(out, &state.to_string());
        Ok(())
    })
}

/// Starts (non-zero) or ends the discovery pass of `tune()`: while on, every claimed
/// convolution is recorded (see mucudnnTorchTakeDiscovered) and run by PyTorch.
#[no_mangle]
pub extern "C" fn mucudnnTorchSetDiscovery(on: i32) -> mucudnnStatus_t {
    guard("mucudnnTorchSetDiscovery", || {
        runtime()?.set_discovery(on != 0);
        Ok(())
    })
}

/// The calls recorded by the discovery pass so far (taken): an array of {"name", "options",
/// "problem", "device", "deterministic", "training", "transposed", "input", "weight",
/// "output", "signature"}.
///
/// # Safety
///
/// `json_out` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn mucudnnTorchTakeDiscovered(json_out: *mut *mut c_char) -> mucudnnStatus_t {
    guard("mucudnnTorchTakeDiscovered", || {
        // SAFETY: this function's contract.
        let out = unsafe { out_arg(json_out, "json_out", std::ptr::null_mut()) }?;
        give_string(out, &to_json(&runtime()?.take_discovered())?);
        Ok(())
    })
}

/// A discovered call, as `mucudnnTorchPrepare` takes it back.
#[derive(Deserialize)]
struct CallDocument {
    name: String,
    options: String,
    problem: ConvProblem,
    device: String,
    deterministic: bool,
    training: bool,
    transposed: bool,
    input: Vec<i64>,
    weight: Vec<i64>,
    output: Vec<i64>,
    signature: SignatureDocument,
}

fn device_of(text: &str) -> Result<Device, FfiError> {
    if text == "cpu" {
        return Ok(Device::Cpu);
    }
    text.strip_prefix("cuda:")
        .and_then(|index| index.parse::<i32>().ok())
        .map(Device::Cuda)
        .ok_or_else(|| invalid(format!("device {text:?} is neither cpu nor cuda:N")))
}

/// Prepares the plans of a discovered call now (`tune()`): tuned through the cache (all three
/// ops when it trains, else the forward's), or, with `plans_json` (an array of plans, another
/// rank's), those plans. `*report_json_out` gets the report, or null when PyTorch runs the
/// problem (the reason is then in the account and the reports).
///
/// # Safety
///
/// Strings NUL-terminated (`plans_json` may be NULL); `report_json_out` valid for writing.
#[no_mangle]
pub unsafe extern "C" fn mucudnnTorchPrepare(
    call_json: *const c_char,
    plans_json: *const c_char,
    report_json_out: *mut *mut c_char,
) -> mucudnnStatus_t {
    guard("mucudnnTorchPrepare", || {
        // SAFETY: this function's contract.
        let out = unsafe { out_arg(report_json_out, "report_json_out", std::ptr::null_mut()) }?;
        // SAFETY: this function's contract.
        let call: CallDocument = unsafe { super::json_arg(call_json, "call_json") }?;
        // SAFETY: this function's contract.
        let plans: Option<Vec<Plan>> = if plans_json.is_null() {
            None
        } else {
            Some(unsafe { super::json_arg(plans_json, "plans_json") }?)
        };
        let runtime = runtime()?;
        let config = runtime.registry.config(&call.options)?;
        let signature = call.signature.signature()?;
        let name: std::sync::Arc<str> = std::sync::Arc::from(call.name.as_str());
        let who = native::registry::Who {
            counters: runtime.account.counters(&name),
            name,
            config,
        };
        let dims = |v: &[i64]| Dims::new(v).ok_or_else(|| invalid("a shape of more than 5 dims"));
        let (input, weight, output) =
            (dims(&call.input)?, dims(&call.weight)?, dims(&call.output)?);
        let forward = if call.transposed {
            ConvOp::BackwardData
        } else {
            ConvOp::Forward
        };
        let needed = if call.training {
            ConvOp::ALL.to_vec()
        } else {
            vec![forward]
        };
        let request = Request {
            who: &who,
            key: PlanKey {
                config: who.config.id,
                problem: call.problem,
                device: device_of(&call.device)?,
                deterministic: call.deterministic,
            },
            signature,
            needed: &needed,
            training: call.training,
            input: input.as_slice(),
            weight: weight.as_slice(),
            output: output.as_slice(),
            transposed: call.transposed,
            announce: false,
            before_tuning: None,
        };
        match plans {
            Some(plans) => {
                runtime.plans.adopt(&request, plans)?;
                let reports = runtime.plans.reports(who.config.id, Some(&signature));
                let report = reports
                    .into_iter()
                    .rev()
                    .find(|r| r.problem == Some(call.problem));
                give_string(out, &to_json(&report)?);
            }
            None => match runtime.plans.ready(&request) {
                Ok(ready) => give_string(out, &to_json(&Some(&ready.report))?),
                Err(native::plans::Miss::Fallback(_)) => {
                    give_string(out, "null");
                }
                Err(native::plans::Miss::Error(message)) => {
                    return Err(FfiError::NotSupported(message))
                }
            },
        }
        Ok(())
    })
}
