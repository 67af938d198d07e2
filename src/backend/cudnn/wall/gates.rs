//! The gates in front of every CUDA and cuDNN call: the driver and libcudnn present, new enough
//! and complete (sub-libraries, cuBLASLt, every symbol the wall calls), cached after the first
//! check; and the probe that describes the machine. A missing library is an error value, never
//! a panic or an abort.

use super::*;

/// Whether the two libraries can be found by the dynamic loader. Checking loads nothing for
/// good and never panics.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LibraryStatus {
    pub libcuda: bool,
    pub libcudnn: bool,
}

/// Which of `libcuda` and `libcudnn` the dynamic loader can find (cached after the first call).
pub fn library_status() -> LibraryStatus {
    LibraryStatus {
        libcuda: libcuda_present(),
        libcudnn: libcudnn_present(),
    }
}

#[cfg(not(feature = "cudarc-linked"))]
pub(super) fn libcuda_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: `is_culib_present` dlopen()s libcuda under each candidate name and closes it again;
    // running the NVIDIA driver library's initialisers is what cudarc does on first use anyway.
    *PRESENT.get_or_init(|| unsafe { drv_sys::is_culib_present() })
}

#[cfg(not(feature = "cudarc-linked"))]
pub(super) fn libcudnn_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: as for libcuda: a dlopen()/dlclose() of libcudnn under its candidate names.
    *PRESENT.get_or_init(|| unsafe { dnn_sys::is_culib_present() })
}

// Linked mode (`cudarc-linked`: cudarc resolved with `dynamic-linking`, e.g. beside candle's
// `cuda`): the libraries were linked into the program, so they are present by construction and
// export every symbol the bindings name; there is nothing to probe, load or look up.
#[cfg(feature = "cudarc-linked")]
pub(super) fn libcuda_present() -> bool {
    true
}

#[cfg(feature = "cudarc-linked")]
pub(super) fn libcudnn_present() -> bool {
    true
}

#[cfg(feature = "cudarc-linked")]
pub(crate) fn candidates(lib: &str) -> String {
    format!("lib{lib} (linked at build time)")
}

/// The file names cudarc tries for `lib`, without repeats.
#[cfg(not(feature = "cudarc-linked"))]
pub(crate) fn candidates(lib: &str) -> String {
    let mut names: Vec<String> = Vec::new();
    for name in cudarc::get_lib_name_candidates(lib) {
        if !names.contains(&name) {
            names.push(name);
        }
    }
    names.join(", ")
}

/// Gate for everything that touches the driver: libcuda present, driver API new enough,
/// cuInit succeeded. Returns the driver version (e.g. 13000). Cached.
pub(crate) fn driver() -> Result<i32, CudnnError> {
    static DRIVER: OnceLock<Result<i32, CudnnError>> = OnceLock::new();
    DRIVER.get_or_init(init_driver).clone()
}

pub(super) fn init_driver() -> Result<i32, CudnnError> {
    if !libcuda_present() {
        return Err(CudnnError::Unavailable {
            what: "libcuda",
            detail: format!(
                "the NVIDIA driver library (libcuda.so.1) was not found: this machine has no \
                 NVIDIA driver, or this process cannot see it (a container needs the NVIDIA \
                 runtime, e.g. `--gpus all`; otherwise put the driver's lib folder on \
                 LD_LIBRARY_PATH). The cuDNN backend needs an NVIDIA GPU with driver 580 or \
                 newer (CUDA 13). Searched: {}",
                candidates("cuda")
            ),
        });
    }
    let mut version: std::ffi::c_int = 0;
    // SAFETY: libcuda is present (checked above), so cudarc's loader finds it; the call writes
    // one int through a pointer to a live local. It needs no prior cuInit.
    unsafe { drv_sys::cuDriverGetVersion(&mut version) }
        .result()
        .map_err(drv_err("cuDriverGetVersion"))?;
    if version < MIN_DRIVER_VERSION {
        return Err(CudnnError::Unavailable {
            what: "CUDA driver",
            detail: format!(
                "the installed driver supports CUDA {}.{} ({version}), but this build calls the \
                 CUDA {}.{} driver API (cudarc feature cuda-13000): install NVIDIA driver 580 \
                 or newer",
                version / 1000,
                version % 1000 / 10,
                MIN_DRIVER_VERSION / 1000,
                MIN_DRIVER_VERSION % 1000 / 10,
            ),
        });
    }
    drv::init().map_err(|e| {
        let (name, message) = describe_driver_error(&e);
        CudnnError::NoDevice {
            detail: format!(
                "cuInit failed with {name} ({}): {message} (is a GPU visible to this process? \
                 check nvidia-smi and CUDA_VISIBLE_DEVICES)",
                e.0 as u32
            ),
        }
    })?;
    Ok(version)
}

pub(super) fn device_count() -> Result<usize, CudnnError> {
    driver()?;
    let count = drv::device::get_count().map_err(drv_err("cuDeviceGetCount"))?;
    if count <= 0 {
        return Err(CudnnError::NoDevice {
            detail: "the CUDA driver sees no GPU (cuDeviceGetCount = 0; is CUDA_VISIBLE_DEVICES \
                     empty or wrong?)"
                .to_string(),
        });
    }
    Ok(count as usize)
}

/// Gate for everything that touches cuDNN: libcudnn present, major version 9, every symbol
/// this module calls exported. Returns `cudnnGetVersion()` (e.g. 91400). Cached.
pub(crate) fn cudnn() -> Result<u64, CudnnError> {
    static CUDNN: OnceLock<Result<u64, CudnnError>> = OnceLock::new();
    CUDNN.get_or_init(init_cudnn).clone()
}

pub(super) fn init_cudnn() -> Result<u64, CudnnError> {
    if !libcudnn_present() {
        return Err(CudnnError::Unavailable {
            what: "libcudnn",
            detail: format!(
                "libcudnn.so not found: install cuDNN 9 or put its lib folder on \
                 LD_LIBRARY_PATH (PyTorch ships one: python -c \"import nvidia.cudnn as m; \
                 print(m.__path__[0] + '/lib')\"). Searched: {}",
                candidates("cudnn")
            ),
        });
    }
    // libcudnn.so.9 is a shim that forwards even cudnnGetVersion to libcudnn_graph.so.9 and
    // aborts the process when it cannot load it: look for the sub-libraries first.
    check_sub_library_files()?;
    // cudnnGetVersion exists in every cuDNN; check the major version before anything else.
    let version = dnn::get_version() as u64;
    let major = if version >= 10_000 {
        version / 10_000
    } else {
        version / 1_000
    };
    if major != CUDNN_MAJOR {
        return Err(CudnnError::Unavailable {
            what: "libcudnn",
            detail: format!(
                "found cuDNN {version} (major version {major}), but this build uses the cuDNN \
                 {CUDNN_MAJOR} API: install cuDNN {CUDNN_MAJOR}.x or put it first on \
                 LD_LIBRARY_PATH"
            ),
        });
    }
    let missing = missing_cudnn_symbols(CUDNN_SYMBOLS);
    if !missing.is_empty() {
        return Err(CudnnError::Unavailable {
            what: "libcudnn",
            detail: format!(
                "cuDNN {version} does not export {} (a partial or mismatched install?)",
                missing.join(", ")
            ),
        });
    }
    check_sub_libraries(version)?;
    check_cublas_lt()?;
    Ok(version)
}

/// cuDNN 9 is split into sub-libraries that `libcudnn.so.9` loads on demand; a missing one
/// otherwise shows up much later as CUDNN_STATUS_SUBLIBRARY_LOADING_FAILED or as a silent
/// CUDNN_STATUS_NOT_SUPPORTED_SUBLIBRARY_UNAVAILABLE. Each version check
/// loads its sub-library and compares versions.
pub(super) fn check_sub_libraries(version: u64) -> Result<(), CudnnError> {
    type Check = unsafe fn() -> dnn_sys::cudnnStatus_t;
    let checks: [(&str, &str, Check); 3] = [
        (
            "cudnnGraphVersionCheck",
            "libcudnn_graph.so.9",
            dnn_sys::cudnnGraphVersionCheck,
        ),
        (
            "cudnnOpsVersionCheck",
            "libcudnn_ops.so.9",
            dnn_sys::cudnnOpsVersionCheck,
        ),
        (
            "cudnnCnnVersionCheck",
            "libcudnn_cnn.so.9",
            dnn_sys::cudnnCnnVersionCheck,
        ),
    ];
    for (call, library, check) in checks {
        // SAFETY: the symbol exists (checked with CUDNN_SYMBOLS before this is called); the
        // check takes no arguments and only loads and queries its sub-library.
        let status = unsafe { check() };
        if status != dnn_sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
            return Err(CudnnError::Unavailable {
                what: "libcudnn",
                detail: format!(
                    "cuDNN {version}'s sub-library {library} is missing or of another version: \
                     {call} returned {status:?} ({}); install the whole cuDNN package, or put \
                     the folder with all its libcudnn_*.so.9 first on LD_LIBRARY_PATH",
                    status as u32
                ),
            });
        }
    }
    Ok(())
}

/// The sub-libraries `libcudnn.so.9` loads from its own folder (its RPATH is `$ORIGIN`).
pub(super) const CUDNN_SUB_LIBRARIES: [&str; 3] = [
    "libcudnn_graph.so.9",
    "libcudnn_ops.so.9",
    "libcudnn_cnn.so.9",
];

/// The folder of the libcudnn that cudarc loaded, from the address of one of its symbols.
pub(super) fn libcudnn_folder() -> Option<std::path::PathBuf> {
    // SAFETY: called after `libcudnn_present()`, so `culib` loads the library rather than
    // panicking; the symbol is looked up, not called.
    #[cfg(not(feature = "cudarc-linked"))]
    let address = {
        let lib = unsafe { dnn_sys::culib() };
        let symbol = unsafe { lib.get::<unsafe extern "C" fn()>(b"cudnnGetVersion") }.ok()?;
        *symbol as *const c_void
    };
    // Linked mode: the binding is the library's own symbol.
    #[cfg(feature = "cudarc-linked")]
    let address = dnn_sys::cudnnGetVersion as *const c_void;
    let mut info = dl::DlInfo {
        dli_fname: std::ptr::null(),
        dli_fbase: std::ptr::null_mut(),
        dli_sname: std::ptr::null(),
        dli_saddr: std::ptr::null_mut(),
    };
    // SAFETY: `info` is a live, writable Dl_info; dladdr only reads the loader's tables.
    if unsafe { dl::dladdr(address, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dladdr set `dli_fname` to the loader's NUL-terminated path of the object,
    // which stays valid while the library is loaded (cudarc keeps it loaded).
    let path = unsafe { std::ffi::CStr::from_ptr(info.dli_fname) };
    let path = std::path::PathBuf::from(path.to_string_lossy().into_owned());
    path.parent().map(|dir| dir.to_path_buf())
}

/// Each sub-library file exists beside libcudnn (a missing one otherwise
/// aborts the process or yields silently empty results).
pub(super) fn check_sub_library_files() -> Result<(), CudnnError> {
    let Some(folder) = libcudnn_folder() else {
        return Ok(()); // Cannot tell where it is: the version checks below still run.
    };
    for library in CUDNN_SUB_LIBRARIES {
        if !folder.join(library).exists() {
            return Err(CudnnError::Unavailable {
                what: "libcudnn",
                detail: format!(
                    "the cuDNN sub-library {library} is missing from {} (a partial install?): \
                     install the whole cuDNN package, or put a folder with all its \
                     libcudnn_*.so.9 first on LD_LIBRARY_PATH",
                    folder.display()
                ),
            });
        }
    }
    Ok(())
}

pub(super) mod dl {
    //! The libc functions the library gates need (glibc exports them from libc.so.6, which
    //! every Rust program on Linux links).
    use std::ffi::{c_char, c_int, c_void};
    pub const RTLD_LAZY: c_int = 0x0001;
    /// `Dl_info` of `<dlfcn.h>`.
    #[repr(C)]
    pub struct DlInfo {
        pub dli_fname: *const c_char,
        pub dli_fbase: *mut c_void,
        pub dli_sname: *const c_char,
        pub dli_saddr: *mut c_void,
    }
    extern "C" {
        pub fn dlopen(filename: *const c_char, flags: c_int) -> *mut c_void;
        pub fn dlclose(handle: *mut c_void) -> c_int;
        pub fn dladdr(address: *const c_void, info: *mut DlInfo) -> c_int;
    }
}

/// Whether the dynamic loader finds `name` (a file name, searched as `dlopen` does).
pub(super) fn loadable(name: &str) -> bool {
    let Ok(c_name) = std::ffi::CString::new(name) else {
        return false;
    };
    // SAFETY: `c_name` is a NUL-terminated string alive for the call. Loading runs the
    // library's initialisers, as cuDNN's own dlopen of it would; the handle is closed again
    // at once and nothing from it is used.
    let handle = unsafe { dl::dlopen(c_name.as_ptr(), dl::RTLD_LAZY) };
    if handle.is_null() {
        return false;
    }
    // SAFETY: `handle` came from dlopen above and is closed exactly once.
    unsafe { dl::dlclose(handle) };
    true
}

/// The cuBLASLt library cuDNN loads for its matmul-based engines: `libcublasLt.so.<major>`,
/// the major version of the CUDA runtime cuDNN was built against.
pub(crate) fn cublas_lt_name() -> String {
    let cudart = dnn::get_cudart_version() as u64;
    format!("libcublasLt.so.{}", cudart / 1000)
}

/// cuDNN aborts the process (SIGABRT, "Cannot load symbol cublasLtCreate") when it finalizes
/// an engine that needs cuBLASLt and cannot load it: refuse the backend up
/// front instead, naming the library.
pub(super) fn check_cublas_lt() -> Result<(), CudnnError> {
    let name = cublas_lt_name();
    if loadable(&name) {
        Ok(())
    } else {
        Err(CudnnError::Unavailable {
            what: "libcublasLt",
            detail: format!(
                "{name} was not found: cuDNN needs the cuBLASLt of its CUDA runtime (CUDA {}) \
                 and aborts the process without it. Install cuBLAS (e.g. the nvidia-cublas \
                 wheel, or PyTorch's nvidia/cu13/lib) and put its lib folder on LD_LIBRARY_PATH",
                dnn::get_cudart_version() / 1000
            ),
        })
    }
}

#[cfg(not(feature = "cudarc-linked"))]
/// The names in `symbols` that the loaded libcudnn does not export. Call only after
/// `libcudnn_present()` (so that `culib` loads the library instead of panicking).
pub(super) fn missing_cudnn_symbols(symbols: &[&'static str]) -> Vec<&'static str> {
    // SAFETY: the caller checked that libcudnn is present, so `culib` loads it rather than
    // panicking.
    let lib = unsafe { dnn_sys::culib() };
    symbols
        .iter()
        .copied()
        // SAFETY: looking a symbol up does not call it; the type parameter is only the type
        // the (unused) symbol would be read as.
        .filter(|name| unsafe { lib.get::<unsafe extern "C" fn()>(name.as_bytes()) }.is_err())
        .collect()
}

/// Linked mode: the program would not have started without every symbol.
#[cfg(feature = "cudarc-linked")]
pub(super) fn missing_cudnn_symbols(_symbols: &[&'static str]) -> Vec<&'static str> {
    Vec::new()
}

/// A gate over the legacy one: `cudnn()`, then every name in `symbols` exported; else
/// `Unavailable`, its detail from `unavailable(version, the missing names joined)`. Callers cache
/// the result (each in its own `OnceLock`).
pub(super) fn symbols_gate(
    symbols: &[&'static str],
    unavailable: impl FnOnce(&str, &str) -> String,
) -> Result<(), CudnnError> {
    let version = cudnn()?;
    let missing = missing_cudnn_symbols(symbols);
    if missing.is_empty() {
        Ok(())
    } else {
        Err(CudnnError::Unavailable {
            what: "libcudnn",
            detail: unavailable(&version.to_string(), &missing.join(", ")),
        })
    }
}

/// The version of the libcudnn this process uses (`cudnnGetVersion`, e.g. 91400 for 9.14.0),
/// after the availability checks. Engine configurations are only meaningful within one
/// version: it belongs in the key of anything cached about them.
pub fn cudnn_version() -> Result<u64, CudnnError> {
    cudnn()
}

/// One GPU as the driver describes it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceInfo {
    pub ordinal: usize,
    /// E.g. `NVIDIA H100 80GB HBM3`.
    pub name: String,
    /// `(major, minor)`, e.g. `(9, 0)` for an H100.
    pub compute_capability: (i32, i32),
    pub total_memory_bytes: u64,
    pub multiprocessors: i32,
}

/// What [`probe`] found.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SystemInfo {
    /// `cuDriverGetVersion`: 1000 * major + 10 * minor (13000 is CUDA 13.0).
    pub driver_version: i32,
    /// `cudnnGetVersion`: 10000 * major + 100 * minor + patch (91400 is 9.14.0).
    pub cudnn_version: u64,
    /// `cudnnGetCudartVersion`: the CUDA runtime cuDNN was built against (e.g. 12080).
    pub cudnn_cudart_version: u64,
    pub devices: Vec<DeviceInfo>,
}

impl SystemInfo {
    /// E.g. `13.0`.
    pub fn driver_version_string(&self) -> String {
        format!(
            "{}.{}",
            self.driver_version / 1000,
            self.driver_version % 1000 / 10
        )
    }

    /// E.g. `9.14.0`.
    pub fn cudnn_version_string(&self) -> String {
        let v = self.cudnn_version;
        format!("{}.{}.{}", v / 10_000, v % 10_000 / 100, v % 100)
    }
}

/// Checks that the backend can run here and describes the machine: driver version, cuDNN
/// version, and every visible GPU. Errors (never panics) when libcuda or libcudnn is missing
/// or too old, when cuInit fails, or when no GPU is visible.
pub fn probe() -> Result<SystemInfo, CudnnError> {
    let driver_version = driver()?;
    let count = device_count()?;
    let cudnn_version = cudnn()?;
    let cudnn_cudart_version = dnn::get_cudart_version() as u64;
    let devices = (0..count).map(device_info).collect::<Result<Vec<_>, _>>()?;
    Ok(SystemInfo {
        driver_version,
        cudnn_version,
        cudnn_cudart_version,
        devices,
    })
}

pub(super) fn device_info(ordinal: usize) -> Result<DeviceInfo, CudnnError> {
    let ordinal_int = std::ffi::c_int::try_from(ordinal).map_err(|_| {
        invalid(
            "device_info",
            format!("device ordinal {ordinal} is too large"),
        )
    })?;
    let dev = drv::device::get(ordinal_int).map_err(drv_err("cuDeviceGet"))?;
    let name = drv::device::get_name(dev).map_err(drv_err("cuDeviceGetName"))?;
    let attribute = |attr: drv_sys::CUdevice_attribute| {
        // SAFETY: `dev` was returned by cuDeviceGet after cuInit succeeded.
        unsafe { drv::device::get_attribute(dev, attr) }.map_err(drv_err("cuDeviceGetAttribute"))
    };
    use drv_sys::CUdevice_attribute as A;
    let major = attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    let multiprocessors = attribute(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
    // SAFETY: as above.
    let total = unsafe { drv::device::total_mem(dev) }.map_err(drv_err("cuDeviceTotalMem"))?;
    Ok(DeviceInfo {
        ordinal,
        name,
        compute_capability: (major, minor),
        total_memory_bytes: total as u64,
        multiprocessors,
    })
}

/// The gate's symbol lists against the wall's source: every cuDNN function that code under
/// `src/backend/cudnn/` calls, directly through cudarc's `sys` bindings or through its `result`
/// wrappers, is in `CUDNN_SYMBOLS` or `GRAPH_SYMBOLS`, so that a library without it is refused
/// up front instead of failing (or aborting, under dynamic loading) on first use. The files are
/// found by walking the folder, so new ones are covered without editing this test.
#[cfg(test)]
mod symbol_list_tests {
    use super::super::compare::COMPARE_SYMBOLS;
    use super::super::graph::GRAPH_SYMBOLS;
    use super::CUDNN_SYMBOLS;
    use std::collections::BTreeSet;
    use std::path::{Path, PathBuf};

    /// cudarc's `cudnn::result` wrappers and the one cuDNN function each calls. A wrapper the
    /// wall calls that is missing here fails the test: add it with its function.
    const RESULT_SYMBOLS: &[(&str, &str)] = &[
        ("get_version", "cudnnGetVersion"),
        ("get_cudart_version", "cudnnGetCudartVersion"),
        ("create_handle", "cudnnCreate"),
        ("destroy_handle", "cudnnDestroy"),
        ("set_stream", "cudnnSetStream"),
        ("create_tensor_descriptor", "cudnnCreateTensorDescriptor"),
        ("set_tensor4d_descriptor", "cudnnSetTensor4dDescriptor"),
        ("set_tensor4d_descriptor_ex", "cudnnSetTensor4dDescriptorEx"),
        ("set_tensornd_descriptor", "cudnnSetTensorNdDescriptor"),
        ("destroy_tensor_descriptor", "cudnnDestroyTensorDescriptor"),
        ("create_filter_descriptor", "cudnnCreateFilterDescriptor"),
        ("set_filter4d_descriptor", "cudnnSetFilter4dDescriptor"),
        ("set_filternd_descriptor", "cudnnSetFilterNdDescriptor"),
        ("destroy_filter_descriptor", "cudnnDestroyFilterDescriptor"),
        (
            "create_convolution_descriptor",
            "cudnnCreateConvolutionDescriptor",
        ),
        (
            "set_convolution2d_descriptor",
            "cudnnSetConvolution2dDescriptor",
        ),
        (
            "set_convolutionnd_descriptor",
            "cudnnSetConvolutionNdDescriptor",
        ),
        ("set_convolution_math_type", "cudnnSetConvolutionMathType"),
        (
            "set_convolution_group_count",
            "cudnnSetConvolutionGroupCount",
        ),
        (
            "destroy_convolution_descriptor",
            "cudnnDestroyConvolutionDescriptor",
        ),
        (
            "get_convolution_forward_workspace_size",
            "cudnnGetConvolutionForwardWorkspaceSize",
        ),
        (
            "get_convolution_backward_data_workspace_size",
            "cudnnGetConvolutionBackwardDataWorkspaceSize",
        ),
        (
            "get_convolution_backward_filter_workspace_size",
            "cudnnGetConvolutionBackwardFilterWorkspaceSize",
        ),
        ("convolution_forward", "cudnnConvolutionForward"),
        ("convolution_backward_data", "cudnnConvolutionBackwardData"),
        (
            "convolution_backward_filter",
            "cudnnConvolutionBackwardFilter",
        ),
    ];

    /// `source` with comments and string and character literals blanked out (so that names in
    /// docs, error messages and the symbol lists themselves are not mistaken for calls).
    fn code_only(source: &str) -> String {
        let chars: Vec<char> = source.chars().collect();
        let mut out = String::with_capacity(source.len());
        let mut i = 0;
        let ident = |c: char| c.is_alphanumeric() || c == '_';
        while i < chars.len() {
            let c = chars[i];
            let next = chars.get(i + 1).copied();
            let after_ident = i > 0 && ident(chars[i - 1]);
            if c == '/' && next == Some('/') {
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
            } else if c == '/' && next == Some('*') {
                let mut depth = 0;
                while i < chars.len() {
                    if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                        depth += 1;
                        i += 2;
                    } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                        depth -= 1;
                        i += 2;
                        if depth == 0 {
                            break;
                        }
                    } else {
                        i += 1;
                    }
                }
                out.push(' ');
            } else if c == 'r' && !after_ident && matches!(next, Some('"' | '#')) {
                // A raw string r"..." or r#"..."#.
                let mut j = i + 1;
                while chars.get(j) == Some(&'#') {
                    j += 1;
                }
                if chars.get(j) != Some(&'"') {
                    out.push(c);
                    i += 1;
                    continue;
                }
                let hashes = j - i - 1;
                i = j + 1;
                while i < chars.len() {
                    if chars[i] == '"' && (1..=hashes).all(|h| chars.get(i + h) == Some(&'#')) {
                        i += 1 + hashes;
                        break;
                    }
                    i += 1;
                }
                out.push_str("\"\"");
            } else if c == '"' {
                i += 1;
                while i < chars.len() && chars[i] != '"' {
                    i += if chars[i] == '\\' { 2 } else { 1 };
                }
                i += 1;
                out.push_str("\"\"");
            } else if c == '\'' && (next == Some('\\') || chars.get(i + 2) == Some(&'\'')) {
                // A character literal (not a lifetime).
                i += 1;
                while i < chars.len() && chars[i] != '\'' {
                    i += if chars[i] == '\\' { 2 } else { 1 };
                }
                i += 1;
                out.push_str("' '");
            } else {
                out.push(c);
                i += 1;
            }
        }
        out
    }

    /// The cuDNN functions `source` calls: `cudnnXxx` names in code (cuDNN's functions are
    /// camel case; its types end in `_t`), and calls of cudarc's `cudnn::result` wrappers
    /// (through an alias `use cudarc::cudnn::{result as ...}` or the full path), mapped with
    /// [`RESULT_SYMBOLS`]; a wrapper without an entry comes back as `result::<name>`.
    fn cudnn_calls(source: &str) -> BTreeSet<String> {
        let code = code_only(source);
        let words: Vec<(usize, &str)> = code
            .match_indices(|c: char| !(c.is_alphanumeric() || c == '_'))
            .scan(0, |start, (at, sep)| {
                let word = (*start, &code[*start..at]);
                *start = at + sep.len();
                Some(word)
            })
            .filter(|(_, w)| !w.is_empty())
            .collect();
        let mut calls = BTreeSet::new();
        for &(_, word) in &words {
            if let Some(rest) = word.strip_prefix("cudnn") {
                if rest.starts_with(|c: char| c.is_ascii_uppercase()) && !rest.contains('_') {
                    calls.insert(word.to_string());
                }
            }
        }
        // The names `cudarc::cudnn::result` goes by in this file: `result` right after
        // `cudnn` (`cudnn::result::f`, `cudnn::result as x`, `cudnn::{result as x, ..}`), and
        // its `as` aliases. (`driver::result` is not cuDNN.)
        let of_cudnn = |i: usize| {
            let before = words[..i].iter().rev().map(|&(_, w)| w);
            let owner = before
                .take(8)
                .find(|w| matches!(*w, "cudnn" | "driver" | "use"));
            words[i].1 == "result" && owner == Some("cudnn")
        };
        let mut aliases = Vec::new();
        for i in 0..words.len().saturating_sub(2) {
            if of_cudnn(i) && words[i + 1].1 == "as" {
                aliases.push(words[i + 2].1);
            }
        }
        for i in 0..words.len().saturating_sub(1) {
            let ((at, path), (_, name)) = (words[i], words[i + 1]);
            let via_result = (of_cudnn(i) || aliases.contains(&path))
                && code[at + path.len()..].starts_with("::")
                && name.starts_with(|c: char| c.is_ascii_lowercase());
            if via_result {
                match RESULT_SYMBOLS.iter().find(|(wrapper, _)| *wrapper == name) {
                    Some((_, symbol)) => calls.insert(symbol.to_string()),
                    None => calls.insert(format!("result::{name}")),
                };
            }
        }
        calls
    }

    fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                rust_files(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }

    /// What the files call that the lists lack, as `file: name`.
    fn missing(files: &[(String, String)]) -> Vec<String> {
        let listed: BTreeSet<&str> = CUDNN_SYMBOLS
            .iter()
            .chain(GRAPH_SYMBOLS)
            .chain(COMPARE_SYMBOLS)
            .copied()
            .collect();
        let mut missing = Vec::new();
        for (file, source) in files {
            for call in cudnn_calls(source) {
                if !listed.contains(call.as_str()) {
                    missing.push(format!("{file}: {call}"));
                }
            }
        }
        missing
    }

    #[test]
    fn the_gate_checks_every_cudnn_function_the_wall_calls() {
        let wall = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/backend/cudnn");
        let mut paths = Vec::new();
        rust_files(&wall, &mut paths);
        paths.sort();
        assert!(paths.len() > 5, "found only {paths:?} under {wall:?}");
        let files: Vec<(String, String)> = paths
            .iter()
            .map(|p| (p.display().to_string(), std::fs::read_to_string(p).unwrap()))
            .collect();
        // The scan sees the calls it must see (a scan that finds nothing would pass vacuously).
        let seen: BTreeSet<String> = files.iter().flat_map(|(_, s)| cudnn_calls(s)).collect();
        for expected in [
            "cudnnCreate",
            "cudnnBackendExecute",
            "cudnnGetConvolutionNdDescriptor",
        ] {
            assert!(seen.contains(expected), "{expected} not found in {seen:?}");
        }
        let missing = missing(&files);
        assert!(
            missing.is_empty(),
            "cuDNN functions the wall calls but the gate does not check (add them to \
             CUDNN_SYMBOLS in wall.rs, GRAPH_SYMBOLS in wall/graph.rs or COMPARE_SYMBOLS in \
             wall/compare.rs): {missing:?}"
        );
    }

    /// The check fails for a call the lists lack, whichever way it is made, and ignores names
    /// in comments and strings.
    #[test]
    fn an_unlisted_call_is_reported() {
        let source = r#"
            use cudarc::cudnn::{result as dnn, sys as dnn_sys};
            use cudarc::driver::{result as drv, sys as drv_sys};
            // dnn_sys::cudnnInComment(x)
            /* cudnnInBlock() */
            fn f() {
                let _ = "cudnnInString()";
                unsafe { dnn_sys::cudnnDeriveBNTensorDescriptor(a, b) };
                let p = dnn_sys::cudnnGraphVersionCheck;
                dnn::create_handle();
                dnn::reduce_tensor(h);
                drv::init();
                cudarc::driver::result::device::get(0);
                cudarc::cudnn::result::destroy_handle(h);
                let _: dnn_sys::cudnnStatus_t = status;
            }
        "#;
        let calls = cudnn_calls(source);
        let expected = [
            "cudnnCreate",
            "cudnnDeriveBNTensorDescriptor",
            "cudnnDestroy",
            "cudnnGraphVersionCheck",
            "result::reduce_tensor",
        ];
        assert_eq!(calls, expected.iter().map(|s| s.to_string()).collect());
        let missing = missing(&[("f.rs".to_string(), source.to_string())]);
        assert_eq!(
            missing,
            [
                "f.rs: cudnnDeriveBNTensorDescriptor",
                "f.rs: result::reduce_tensor"
            ]
        );
    }
}
