//! Errors at the C boundary: [`FfiError`] (what went wrong, with context) becomes a
//! [`mucudnnStatus_t`] and a thread-local message ([`set_last_error`]); [`guard`] runs every
//! entry point's body so that no panic unwinds into C.

use super::mucudnnStatus_t;
use crate::backend::cudnn::CudnnError;
use crate::backend::BackendError;
use crate::solver::interchange::InterchangeError;
use crate::solver::SolveError;
use std::cell::RefCell;
use std::ffi::{c_char, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Why a C ABI call failed.
#[derive(Debug, thiserror::Error)]
pub enum FfiError {
    /// A null pointer, an out-of-range enum value, invalid UTF-8, bad options, descriptors that
    /// do not make a convolution.
    #[error("{0}")]
    InvalidArgument(String),
    /// Valid for cuDNN, but outside what mucudnn models (strided tensors, double data,
    /// `CUDNN_CONVOLUTION` mode, ...).
    #[error("{0}")]
    NotSupported(String),
    /// Something the call needs cannot be had now (the process cannot open the cache file:
    /// out of file descriptors).
    #[error("{0}")]
    NotAvailable(String),
    /// cuDNN will not build one micro-batch of a plan being prepared
    /// ([`crate::exec::ExecError::Unsupported`]): the caller falls back.
    #[error("{0}")]
    PlanNotSupported(String),
    #[error(transparent)]
    Cudnn(#[from] CudnnError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    Solve(#[from] SolveError),
    #[error("bad profile: {0}")]
    Profile(#[from] InterchangeError),
    /// A bug in mucudnn (a broken invariant); panics are reported as this too.
    #[error("internal error: {0}")]
    Internal(String),
    /// `source` with where it happened (a layer, an op, a phase).
    #[error("{context}: {source}")]
    Context {
        context: String,
        #[source]
        source: Box<FfiError>,
    },
}

impl FfiError {
    /// Wraps the error with `context` (e.g. `layer 3 fwd: tuning`).
    pub fn context(self, context: impl Into<String>) -> Self {
        FfiError::Context {
            context: context.into(),
            source: Box::new(self),
        }
    }

    /// The status a C caller sees.
    pub fn status(&self) -> mucudnnStatus_t {
        match self {
            FfiError::InvalidArgument(_) => mucudnnStatus_t::MUCUDNN_STATUS_INVALID_ARGUMENT,
            FfiError::NotSupported(_) => mucudnnStatus_t::MUCUDNN_STATUS_NOT_SUPPORTED,
            FfiError::NotAvailable(_) => mucudnnStatus_t::MUCUDNN_STATUS_NOT_AVAILABLE,
            FfiError::PlanNotSupported(_) => mucudnnStatus_t::MUCUDNN_STATUS_PLAN_NOT_SUPPORTED,
            FfiError::Cudnn(e) => cudnn_status(e),
            FfiError::Backend(BackendError::Cudnn(e)) => cudnn_status(e),
            // The CPU backend's errors are all about its inputs (shapes, buffers, workspace).
            FfiError::Backend(BackendError::Invalid(_) | BackendError::Cpu(_)) => {
                mucudnnStatus_t::MUCUDNN_STATUS_INVALID_ARGUMENT
            }
            FfiError::Backend(BackendError::OutOfMemory(_)) => {
                mucudnnStatus_t::MUCUDNN_STATUS_OUT_OF_MEMORY
            }
            FfiError::Backend(BackendError::NoEngines { .. }) => {
                mucudnnStatus_t::MUCUDNN_STATUS_INVALID_ARGUMENT
            }
            FfiError::Backend(_) => mucudnnStatus_t::MUCUDNN_STATUS_INTERNAL_ERROR,
            FfiError::Solve(SolveError::Profile(_)) => mucudnnStatus_t::MUCUDNN_STATUS_BAD_PROFILE,
            FfiError::Solve(_) => mucudnnStatus_t::MUCUDNN_STATUS_SOLVER_ERROR,
            FfiError::Profile(_) => mucudnnStatus_t::MUCUDNN_STATUS_BAD_PROFILE,
            FfiError::Internal(_) => mucudnnStatus_t::MUCUDNN_STATUS_INTERNAL_ERROR,
            FfiError::Context { source, .. } => source.status(),
        }
    }
}

fn cudnn_status(e: &CudnnError) -> mucudnnStatus_t {
    if e.is_unavailable() {
        return mucudnnStatus_t::MUCUDNN_STATUS_NOT_AVAILABLE;
    }
    if e.is_out_of_memory() {
        return mucudnnStatus_t::MUCUDNN_STATUS_OUT_OF_MEMORY;
    }
    match e {
        CudnnError::Cudnn { .. }
        | CudnnError::Backend { .. }
        | CudnnError::EngineNotSupported { .. } => mucudnnStatus_t::MUCUDNN_STATUS_CUDNN_ERROR,
        CudnnError::Driver { .. } => mucudnnStatus_t::MUCUDNN_STATUS_CUDA_ERROR,
        CudnnError::Shape(_)
        | CudnnError::InvalidArgument { .. }
        | CudnnError::Misaligned { .. } => mucudnnStatus_t::MUCUDNN_STATUS_INVALID_ARGUMENT,
        CudnnError::Unavailable { .. } | CudnnError::NoDevice { .. } => {
            mucudnnStatus_t::MUCUDNN_STATUS_NOT_AVAILABLE
        }
    }
}

/// Why a cache could not be opened, as the C caller sees it: a file that is not a mucudnn
/// cache is an invalid argument (`what` names it), a process out of file descriptors is
/// NOT_AVAILABLE (never a quiet in-memory stand-in).
pub fn cache_error(what: &str, error: mucudnn_cache::OpenFailure) -> FfiError {
    match error {
        mucudnn_cache::OpenFailure::NotACache(e) => invalid(format!("{what}: {e}")),
        mucudnn_cache::OpenFailure::OutOfResources(e) => {
            FfiError::NotAvailable(format!("{what}: {e}"))
        }
    }
}

/// Shorthand for an [`FfiError::InvalidArgument`].
pub fn invalid(message: impl Into<String>) -> FfiError {
    FfiError::InvalidArgument(message.into())
}

// ---------------------------------------------------------------------------------------------
// Bounded messages

/// The most characters of a caller's value a message shows ([`echo`]).
pub const ECHO_CHARS: usize = 200;

/// The most characters a last-error message holds ([`bounded`]); a message that echoes
/// callers' values through [`echo`] stays far below it.
pub const MAX_MESSAGE_CHARS: usize = 4096;

/// A caller's value as a message shows it: whole when it has at most [`ECHO_CHARS`]
/// characters, else its first [`ECHO_CHARS`] and its length (`"aaaa…" (10000000 characters)`
/// is not quoted: the caller's quotes stay as given).
pub fn echo(value: &str) -> String {
    match value.char_indices().nth(ECHO_CHARS) {
        None => value.to_string(),
        Some((end, _)) => format!("{}… ({} characters)", &value[..end], value.chars().count()),
    }
}

/// `text` cut to at most `max` characters (about): whole when it fits, else its start and end
/// with what was left out counted between them, so a message keeps its subject and its
/// conclusion (serde's `expected ...`, a position).
pub fn bounded(text: &str, max: usize) -> String {
    let total = text.chars().count();
    if total <= max {
        return text.to_string();
    }
    let keep = max / 2;
    let head_end = text.char_indices().nth(keep).map_or(text.len(), |(i, _)| i);
    let tail_start = text
        .char_indices()
        .nth(total - keep)
        .map_or(text.len(), |(i, _)| i);
    format!(
        "{} … ({} characters left out) … {}",
        &text[..head_end],
        total - 2 * keep,
        &text[tail_start..]
    )
}

// ---------------------------------------------------------------------------------------------
// The thread-local last error

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// A C string of `text`, with any interior NUL shown as `\0` (a message is never lost).
pub fn c_string_lossless(text: &str) -> CString {
    CString::new(text.replace('\0', "\\0")).unwrap_or_default()
}

/// Replaces this thread's last-error message, cut to [`MAX_MESSAGE_CHARS`] ([`bounded`]): a
/// caller's huge value never makes a huge message.
pub fn set_last_error(message: &str) {
    let message = c_string_lossless(&bounded(message, MAX_MESSAGE_CHARS));
    // A thread being torn down has no last error to keep; ignoring that cannot panic.
    let _ = LAST_ERROR.try_with(|slot| {
        if let Ok(mut slot) = slot.try_borrow_mut() {
            *slot = message;
        }
    });
}

/// Clears this thread's last-error message (an empty string).
pub fn clear_last_error() {
    set_last_error("");
}

/// This thread's last-error message; valid until the next mucudnn call on this thread.
pub fn last_error_ptr() -> *const c_char {
    static EMPTY: &CStr = c"";
    LAST_ERROR
        .try_with(|slot| match slot.try_borrow() {
            Ok(message) => message.as_ptr(),
            Err(_) => EMPTY.as_ptr(),
        })
        .unwrap_or(EMPTY.as_ptr())
}

/// This thread's last-error message as Rust text (for tests).
#[cfg(test)]
pub fn last_error() -> String {
    LAST_ERROR
        .try_with(|slot| {
            slot.try_borrow()
                .map(|m| m.to_string_lossy().into_owned())
                .unwrap_or_default()
        })
        .unwrap_or_default()
}

// ---------------------------------------------------------------------------------------------
// The boundary

/// The text of a panic payload (`&str` or `String` payloads; anything else is named as such).
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(text) = payload.downcast_ref::<&str>() {
        (*text).to_string()
    } else if let Some(text) = payload.downcast_ref::<String>() {
        text.clone()
    } else {
        "a panic with a non-text payload".to_string()
    }
}

/// Runs the body of the C entry point `function`: clears the last error, catches panics, and
/// turns the outcome into a status. An error's message becomes the last error, prefixed with
/// `function`; a panic becomes `MUCUDNN_STATUS_INTERNAL_ERROR` with the panic's message.
pub fn guard(function: &str, body: impl FnOnce() -> Result<(), FfiError>) -> mucudnnStatus_t {
    clear_last_error();
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => mucudnnStatus_t::MUCUDNN_STATUS_SUCCESS,
        Ok(Err(error)) => {
            set_last_error(&format!("{function}: {error}"));
            error.status()
        }
        Err(payload) => {
            set_last_error(&format!(
                "{function}: internal error (a bug in mucudnn; please report it): panic: {}",
                panic_message(payload.as_ref())
            ));
            // Dropping a payload runs foreign code that could itself panic: never let that
            // unwind into C (leak it instead).
            if let Err(again) = catch_unwind(AssertUnwindSafe(move || drop(payload))) {
                std::mem::forget(again);
            }
            mucudnnStatus_t::MUCUDNN_STATUS_INTERNAL_ERROR
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Strings across the boundary

/// The UTF-8 text of a required C string argument `name`.
///
/// # Safety
///
/// `ptr` is null (an error) or points to a NUL-terminated string that stays valid and
/// unmodified for `'a`.
pub unsafe fn str_arg<'a>(ptr: *const c_char, name: &str) -> Result<&'a str, FfiError> {
    if ptr.is_null() {
        return Err(invalid(format!("{name} is NULL")));
    }
    // SAFETY: non-null and NUL-terminated, valid for 'a (this function's contract).
    let text = unsafe { CStr::from_ptr(ptr) };
    text.to_str()
        .map_err(|e| invalid(format!("{name} is not valid UTF-8: {e}")))
}

/// Like [`str_arg`], but null is `None`.
///
/// # Safety
///
/// As for [`str_arg`].
pub unsafe fn optional_str_arg<'a>(
    ptr: *const c_char,
    name: &str,
) -> Result<Option<&'a str>, FfiError> {
    if ptr.is_null() {
        Ok(None)
    } else {
        // SAFETY: as this function's contract.
        unsafe { str_arg(ptr, name) }.map(Some)
    }
}

/// An output slot `name` of the caller's: null is an error; otherwise it is set to `empty`
/// first, so that the caller sees a defined value whatever happens next.
///
/// # Safety
///
/// `ptr` is null or valid for writing one `T`.
pub unsafe fn out_arg<'a, T>(ptr: *mut T, name: &str, empty: T) -> Result<&'a mut T, FfiError> {
    if ptr.is_null() {
        return Err(invalid(format!("{name} is NULL")));
    }
    // SAFETY: non-null and valid for one write (this function's contract); `write` does not
    // read (or drop) whatever was there.
    unsafe {
        ptr.write(empty);
        Ok(&mut *ptr)
    }
}

/// Hands `text` to C as a `char*` that [`super::mucudnnFreeString`] frees.
pub fn owned_c_string(text: &str) -> *mut c_char {
    c_string_lossless(text).into_raw()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_follow_the_error_kind() {
        use mucudnnStatus_t as S;
        assert_eq!(invalid("x").status(), S::MUCUDNN_STATUS_INVALID_ARGUMENT);
        let unavailable = FfiError::from(CudnnError::Unavailable {
            what: "libcudnn",
            detail: "missing".into(),
        });
        assert_eq!(unavailable.status(), S::MUCUDNN_STATUS_NOT_AVAILABLE);
        let oom = FfiError::from(BackendError::Cudnn(CudnnError::Driver {
            call: "cuMemAlloc",
            name: "CUDA_ERROR_OUT_OF_MEMORY".into(),
            code: 2,
            message: "out of memory".into(),
        }));
        assert_eq!(oom.status(), S::MUCUDNN_STATUS_OUT_OF_MEMORY);
        let cudnn = FfiError::from(CudnnError::Cudnn {
            call: "cudnnConvolutionForward",
            status: "CUDNN_STATUS_BAD_PARAM".into(),
            code: 2000,
            op: None,
            algo: None,
        });
        assert_eq!(cudnn.status(), S::MUCUDNN_STATUS_CUDNN_ERROR);
        let wrapped = cudnn.context("layer 3 fwd");
        assert_eq!(wrapped.status(), S::MUCUDNN_STATUS_CUDNN_ERROR);
        assert!(wrapped.to_string().starts_with(
            "layer 3 fwd: cudnnConvolutionForward failed with CUDNN_STATUS_BAD_PARAM"
        ));
        let declined = FfiError::PlanNotSupported("l fwd: micro-batch 1".into()).context("prepare");
        assert_eq!(declined.status(), S::MUCUDNN_STATUS_PLAN_NOT_SUPPORTED);
        // A cache the process cannot open for lack of descriptors is NOT_AVAILABLE; a file
        // that is not a cache, an invalid argument.
        let out_of = mucudnn_cache::OutOfResources {
            path: "/c.sqlite".into(),
            reason: "Too many open files (os error 24)".into(),
        };
        let error = cache_error("options_json cache", out_of.into());
        assert_eq!(error.status(), S::MUCUDNN_STATUS_NOT_AVAILABLE);
        assert!(error
            .to_string()
            .starts_with("options_json cache: cannot open cache /c.sqlite"));
        let foreign = mucudnn_cache::NotACache {
            path: "/c.sqlite".into(),
            why: "it is not an SQLite database".into(),
        };
        let error = cache_error("options_json cache", foreign.into());
        assert_eq!(error.status(), S::MUCUDNN_STATUS_INVALID_ARGUMENT);
        let solver = FfiError::from(SolveError::NothingToDivide);
        assert_eq!(solver.status(), S::MUCUDNN_STATUS_SOLVER_ERROR);
        assert_eq!(
            FfiError::Internal("x".into()).status(),
            S::MUCUDNN_STATUS_INTERNAL_ERROR
        );
    }

    #[test]
    fn guard_maps_results_and_panics() {
        set_last_error("stale");
        assert_eq!(
            guard("mucudnnTest", || Ok(())),
            mucudnnStatus_t::MUCUDNN_STATUS_SUCCESS
        );
        assert_eq!(last_error(), "");
        assert_eq!(
            guard("mucudnnTest", || Err(invalid("x is NULL"))),
            mucudnnStatus_t::MUCUDNN_STATUS_INVALID_ARGUMENT
        );
        assert_eq!(last_error(), "mucudnnTest: x is NULL");
        let status = guard("mucudnnTest", || panic!("boom {}", 42));
        assert_eq!(status, mucudnnStatus_t::MUCUDNN_STATUS_INTERNAL_ERROR);
        let message = last_error();
        assert!(
            message.starts_with("mucudnnTest: internal error"),
            "{message}"
        );
        assert!(message.ends_with("panic: boom 42"), "{message}");
        let status = guard("mucudnnTest", || std::panic::panic_any(7u8));
        assert_eq!(status, mucudnnStatus_t::MUCUDNN_STATUS_INTERNAL_ERROR);
        assert!(last_error().contains("non-text payload"));
    }

    #[test]
    fn echoed_values_and_messages_are_bounded() {
        assert_eq!(echo("fwd"), "fwd");
        let exact = "é".repeat(ECHO_CHARS);
        assert_eq!(echo(&exact), exact);
        let huge = "é".repeat(10_000_000);
        let shown = echo(&huge);
        assert!(
            shown.ends_with("… (10000000 characters)"),
            "{}",
            &shown[shown.len() - 40..]
        );
        assert_eq!(
            shown.chars().count(),
            ECHO_CHARS + "… (10000000 characters)".chars().count()
        );
        assert_eq!(bounded("short", 10), "short");
        let long = format!("start {} end", "x".repeat(1000));
        let cut = bounded(&long, 100);
        assert!(cut.starts_with("start ") && cut.ends_with(" end"), "{cut}");
        assert!(cut.contains("(910 characters left out)"), "{cut}");
        assert!(cut.chars().count() < 150);
        // The last error holds at most MAX_MESSAGE_CHARS characters of any message.
        set_last_error(&format!("mucudnnTest: policy: {}", "p".repeat(10_000_000)));
        let kept = last_error();
        assert!(
            kept.chars().count() < MAX_MESSAGE_CHARS + 100,
            "{}",
            kept.len()
        );
        assert!(kept.starts_with("mucudnnTest: policy: ppp"));
    }

    #[test]
    fn last_error_is_per_thread_and_keeps_nul_bytes_visible() {
        set_last_error("main thread");
        std::thread::spawn(|| {
            assert_eq!(last_error(), "");
            set_last_error("other\0thread");
            assert_eq!(last_error(), "other\\0thread");
        })
        .join()
        .unwrap();
        assert_eq!(last_error(), "main thread");
        // SAFETY: the pointer is this thread's message, read before any other mucudnn call.
        let text = unsafe { CStr::from_ptr(last_error_ptr()) };
        assert_eq!(text.to_str().unwrap(), "main thread");
    }

    #[test]
    fn string_arguments() {
        // SAFETY (all calls): the pointers are null or NUL-terminated literals.
        unsafe {
            assert_eq!(str_arg(c"abc".as_ptr(), "s").unwrap(), "abc");
            assert_eq!(
                str_arg(std::ptr::null(), "profile_json")
                    .unwrap_err()
                    .to_string(),
                "profile_json is NULL"
            );
            let bad = c"\xff\xfe";
            let err = str_arg(bad.as_ptr(), "options_json").unwrap_err();
            assert!(err
                .to_string()
                .starts_with("options_json is not valid UTF-8"));
            assert_eq!(optional_str_arg(std::ptr::null(), "o").unwrap(), None);
            let mut slot: *mut c_char = 7 as *mut c_char;
            out_arg(&mut slot, "out", std::ptr::null_mut()).unwrap();
            assert!(slot.is_null());
            assert!(out_arg::<u8>(std::ptr::null_mut(), "out", 0).is_err());
        }
    }
}
