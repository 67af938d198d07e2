//! cuBLAS: a handle bound to one stream, and the three fp32 routines training needs — GEMM
//! (the linear layer), AXPY and SCAL (the SGD update, and NCCL averaging without `ncclAvg`).
//!
//! cuBLAS is column-major: the matrices are described as cuBLAS sees them ([`Gemm`]); the
//! row-major bookkeeping of the linear layer is in `ops.rs`. Before each call the wall checks
//! that every buffer is fp32, on the handle's stream, and long enough for the extent its
//! dimensions and leading dimension imply (`ld * (cols - 1) + rows` elements).

use super::{c_string, check_stream, DeviceData, DeviceDataMut};
#[cfg(not(feature = "cudarc-linked"))]
use crate::backend::cudnn::candidates;
use crate::backend::cudnn::{driver_error, require_driver};
use crate::solver::DType;
use crate::train::gpu::error::{invalid, GpuTrainError};
use cudarc::cublas::sys as blas_sys;
use cudarc::driver::CudaStream;
use std::ffi::c_int;
use std::io::Write;
use std::sync::{Arc, OnceLock};

/// Every cuBLAS symbol this module calls.
const CUBLAS_SYMBOLS: &[&str] = &[
    "cublasCreate_v2",
    "cublasDestroy_v2",
    "cublasSetStream_v2",
    "cublasSetPointerMode_v2",
    "cublasGetProperty",
    "cublasGetStatusString",
    "cublasSgemm_v2",
    "cublasSaxpy_v2",
    "cublasSscal_v2",
    "cublasSasum_v2",
];

/// Gate for everything that touches cuBLAS: the driver gate, libcublas present, every symbol
/// this module calls exported. Returns the cuBLAS version `(major, minor, patch)`. Cached.
pub(crate) fn cublas() -> Result<(i32, i32, i32), GpuTrainError> {
    static CUBLAS: OnceLock<Result<(i32, i32, i32), GpuTrainError>> = OnceLock::new();
    CUBLAS.get_or_init(init_cublas).clone()
}

fn init_cublas() -> Result<(i32, i32, i32), GpuTrainError> {
    require_driver()?;
    // SAFETY: `is_culib_present` dlopen()s libcublas under each candidate name and closes it.
    #[cfg(not(feature = "cudarc-linked"))]
    if !unsafe { blas_sys::is_culib_present() } {
        return Err(GpuTrainError::Unavailable {
            what: "libcublas",
            detail: format!(
                "libcublas.so not found: install cuBLAS (the CUDA toolkit's, or PyTorch's \
                 nvidia-cublas wheel) or put its lib folder on LD_LIBRARY_PATH. Searched: {}",
                candidates("cublas")
            ),
        });
    }
    // SAFETY: present (checked above), so `culib` loads it rather than panicking.
    #[cfg(not(feature = "cudarc-linked"))]
    let lib = unsafe { blas_sys::culib() };
    // Linked mode: linked at build time, every symbol is there.
    #[cfg(feature = "cudarc-linked")]
    let missing: Vec<&str> = CUBLAS_SYMBOLS.iter().copied().filter(|_| false).collect();
    #[cfg(not(feature = "cudarc-linked"))]
    let missing: Vec<&str> = CUBLAS_SYMBOLS
        .iter()
        .copied()
        // SAFETY: looking a symbol up does not call it.
        .filter(|name| unsafe { lib.get::<unsafe extern "C" fn()>(name.as_bytes()) }.is_err())
        .collect();
    if !missing.is_empty() {
        return Err(GpuTrainError::Unavailable {
            what: "libcublas",
            detail: format!(
                "the libcublas found does not export {} (a partial or mismatched install?)",
                missing.join(", ")
            ),
        });
    }
    let property = |which: blas_sys::libraryPropertyType| {
        let mut value: c_int = 0;
        // SAFETY: the symbol exists (checked); the call writes one int to a live local.
        let status = unsafe { blas_sys::cublasGetProperty(which, &mut value) };
        blas_status("cublasGetProperty", "cuBLAS gate", status).map(|()| value)
    };
    use blas_sys::libraryPropertyType as P;
    Ok((
        property(P::MAJOR_VERSION)?,
        property(P::MINOR_VERSION)?,
        property(P::PATCH_LEVEL)?,
    ))
}

fn blas_status(
    call: &'static str,
    op: &'static str,
    status: blas_sys::cublasStatus_t,
) -> Result<(), GpuTrainError> {
    if status == blas_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        return Ok(());
    }
    // SAFETY: only reached after the gate (every status comes from a gated call);
    // cublasGetStatusString returns a static string (or null) for any value.
    let text = unsafe { c_string(blas_sys::cublasGetStatusString(status)) };
    Err(GpuTrainError::Cublas {
        call,
        status: match text {
            Some(text) => format!("{status:?} \"{text}\""),
            None => format!("{status:?}"),
        },
        code: status as u32,
        op,
    })
}

/// A GEMM as cuBLAS sees it (column-major): `C (m x n) = alpha * op(A) op(B) + beta * C`,
/// `op(A)` is `m x k`, `op(B)` is `k x n`; A is stored `lda`-strided as `m x k` (or `k x m`
/// when `transpose_a`), B as `k x n` (or `n x k`), C as `m x n` with `ldc`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Gemm {
    pub(crate) transpose_a: bool,
    pub(crate) transpose_b: bool,
    pub(crate) m: usize,
    pub(crate) n: usize,
    pub(crate) k: usize,
    pub(crate) lda: usize,
    pub(crate) ldb: usize,
    pub(crate) ldc: usize,
}

/// Elements a column-major `rows x cols` matrix with leading dimension `ld` spans, or an error
/// when `ld < rows` or a size overflows cuBLAS's `int`.
pub(crate) fn matrix_span(
    op: &'static str,
    name: &str,
    rows: usize,
    cols: usize,
    ld: usize,
) -> Result<usize, GpuTrainError> {
    if rows == 0 || cols == 0 {
        return Err(invalid(op, format!("matrix {name} is {rows} x {cols}")));
    }
    if ld < rows {
        return Err(invalid(
            op,
            format!("matrix {name}: leading dimension {ld} is below its {rows} rows"),
        ));
    }
    ld.checked_mul(cols - 1)
        .and_then(|s| s.checked_add(rows))
        .filter(|_| [rows, cols, ld].iter().all(|&v| v <= i32::MAX as usize))
        .ok_or_else(|| {
            invalid(
                op,
                format!("matrix {name} ({rows} x {cols}, ld {ld}) overflows cuBLAS's int sizes"),
            )
        })
}

/// Checks that `data` (called `name`) is fp32, on `stream`, and spans at least `needed`
/// elements.
fn check_f32<D: DeviceData + ?Sized>(
    op: &'static str,
    name: &str,
    data: &D,
    needed: usize,
    stream: &CudaStream,
) -> Result<(), GpuTrainError> {
    if data.dtype() != DType::Fp32 {
        return Err(invalid(
            op,
            format!("{name} is {}; cuBLAS ops here take fp32", data.dtype()),
        ));
    }
    if data.elements() < needed {
        return Err(invalid(
            op,
            format!(
                "{name} has {} elements, its extent needs {needed}",
                data.elements()
            ),
        ));
    }
    check_stream(op, name, data, stream)
}

/// A cuBLAS handle whose work goes to one stream, with host pointer mode (alpha and beta are
/// host values).
pub(crate) struct BlasHandle {
    raw: blas_sys::cublasHandle_t,
    stream: Arc<CudaStream>,
}

impl BlasHandle {
    pub(crate) fn new(stream: Arc<CudaStream>) -> Result<Self, GpuTrainError> {
        cublas()?;
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| driver_error("cuCtxSetCurrent", e))?;
        let mut raw: blas_sys::cublasHandle_t = std::ptr::null_mut();
        // SAFETY: the gate passed; the call writes one pointer to a live local, in the current
        // (the stream's) context.
        blas_status("cublasCreate_v2", "BlasHandle::new", unsafe {
            blas_sys::cublasCreate_v2(&mut raw)
        })?;
        // From here on, Drop destroys `raw`.
        let handle = BlasHandle { raw, stream };
        // SAFETY: `raw` is live; the stream belongs to the current context and outlives the
        // handle (held by the Arc). The cast only renames the opaque stream type between
        // cudarc's driver and cuBLAS bindings.
        blas_status("cublasSetStream_v2", "BlasHandle::new", unsafe {
            blas_sys::cublasSetStream_v2(handle.raw, handle.stream.cu_stream() as _)
        })?;
        // SAFETY: `raw` is live.
        blas_status("cublasSetPointerMode_v2", "BlasHandle::new", unsafe {
            blas_sys::cublasSetPointerMode_v2(
                handle.raw,
                blas_sys::cublasPointerMode_t::CUBLAS_POINTER_MODE_HOST,
            )
        })?;
        Ok(handle)
    }

    fn bind(&self) -> Result<(), GpuTrainError> {
        self.stream.context().bind_to_thread().map_err(|e| {
            driver_error("cuCtxSetCurrent (or an earlier deferred CUDA error)", e).into()
        })
    }

    /// `c = alpha * op(a) op(b) + beta * c` (`cublasSgemm_v2`), queued on the stream.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemm(
        &self,
        op: &'static str,
        g: Gemm,
        alpha: f32,
        a: &dyn DeviceData,
        b: &dyn DeviceData,
        beta: f32,
        c: &mut dyn DeviceDataMut,
    ) -> Result<(), GpuTrainError> {
        let (a_rows, a_cols) = if g.transpose_a {
            (g.k, g.m)
        } else {
            (g.m, g.k)
        };
        let (b_rows, b_cols) = if g.transpose_b {
            (g.n, g.k)
        } else {
            (g.k, g.n)
        };
        check_f32(
            op,
            "A",
            a,
            matrix_span(op, "A", a_rows, a_cols, g.lda)?,
            &self.stream,
        )?;
        check_f32(
            op,
            "B",
            b,
            matrix_span(op, "B", b_rows, b_cols, g.ldb)?,
            &self.stream,
        )?;
        check_f32(
            op,
            "C",
            c,
            matrix_span(op, "C", g.m, g.n, g.ldc)?,
            &self.stream,
        )?;
        self.bind()?;
        let (a_ptr, _a_sync) = a.raw_read(&self.stream);
        let (b_ptr, _b_sync) = b.raw_read(&self.stream);
        let (c_ptr, _c_sync) = c.raw_write(&self.stream);
        let transpose = |t: bool| {
            if t {
                blas_sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                blas_sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        // Every size fits `int` (checked by `matrix_span`).
        let int = |v: usize| v as c_int;
        // SAFETY: `raw` is live, bound to the stream's (current) context and stream, host
        // pointer mode (alpha/beta are host locals); A, B and C are fp32 buffers on that stream
        // that hold at least the extents cuBLAS reads (A, B) and writes (C) for these sizes
        // and leading dimensions (checked), alive and borrowed for the call (C exclusively, so
        // it aliases neither input); frees are stream-ordered after the guards record this use.
        let status = unsafe {
            blas_sys::cublasSgemm_v2(
                self.raw,
                transpose(g.transpose_a),
                transpose(g.transpose_b),
                int(g.m),
                int(g.n),
                int(g.k),
                &alpha,
                a_ptr as *const f32,
                int(g.lda),
                b_ptr as *const f32,
                int(g.ldb),
                &beta,
                c_ptr as *mut f32,
                int(g.ldc),
            )
        };
        blas_status("cublasSgemm_v2", op, status)
    }

    /// `y = alpha * x + y` (`cublasSaxpy_v2`) over whole buffers of equal length.
    pub(crate) fn axpy(
        &self,
        op: &'static str,
        alpha: f32,
        x: &dyn DeviceData,
        y: &mut dyn DeviceDataMut,
    ) -> Result<(), GpuTrainError> {
        let n = vector_len(op, y.elements())?;
        if x.elements() != y.elements() {
            return Err(invalid(
                op,
                format!(
                    "x has {} elements, y {}: they must match",
                    x.elements(),
                    y.elements()
                ),
            ));
        }
        check_f32(op, "x", x, y.elements(), &self.stream)?;
        check_f32(op, "y", y, y.elements(), &self.stream)?;
        self.bind()?;
        let (x_ptr, _x_sync) = x.raw_read(&self.stream);
        let (y_ptr, _y_sync) = y.raw_write(&self.stream);
        // SAFETY: live bound handle in host pointer mode; x and y are fp32 buffers of exactly
        // `n` elements on the handle's stream (checked), y exclusive; unit strides.
        let status = unsafe {
            blas_sys::cublasSaxpy_v2(
                self.raw,
                n,
                &alpha,
                x_ptr as *const f32,
                1,
                y_ptr as *mut f32,
                1,
            )
        };
        blas_status("cublasSaxpy_v2", op, status)
    }

    /// `x = alpha * x` (`cublasSscal_v2`) over a whole buffer.
    pub(crate) fn scal(
        &self,
        op: &'static str,
        alpha: f32,
        x: &mut dyn DeviceDataMut,
    ) -> Result<(), GpuTrainError> {
        let n = vector_len(op, x.elements())?;
        check_f32(op, "x", x, x.elements(), &self.stream)?;
        self.bind()?;
        let (x_ptr, _x_sync) = x.raw_write(&self.stream);
        // SAFETY: live bound handle in host pointer mode; x is an fp32 buffer of exactly `n`
        // elements on the handle's stream (checked), borrowed exclusively; unit stride.
        let status = unsafe { blas_sys::cublasSscal_v2(self.raw, n, &alpha, x_ptr as *mut f32, 1) };
        blas_status("cublasSscal_v2", op, status)
    }
}

impl BlasHandle {
    /// The sum of `|x|` over a whole buffer (`cublasSasum_v2`), returned to the host: the call
    /// waits for the stream's queued work (host pointer mode). inf or NaN anywhere in `x`
    /// makes it inf or NaN (the fp16 loss scaler's finiteness check).
    pub(crate) fn asum(&self, op: &'static str, x: &dyn DeviceData) -> Result<f32, GpuTrainError> {
        let n = vector_len(op, x.elements())?;
        check_f32(op, "x", x, x.elements(), &self.stream)?;
        self.bind()?;
        let (x_ptr, _x_sync) = x.raw_read(&self.stream);
        let mut result = 0.0f32;
        // SAFETY: live bound handle in host pointer mode, so the result is written to the
        // live local `result` before the call returns; x is an fp32 buffer of exactly `n`
        // elements on the handle's stream (checked); unit stride.
        let status =
            unsafe { blas_sys::cublasSasum_v2(self.raw, n, x_ptr as *const f32, 1, &mut result) };
        blas_status("cublasSasum_v2", op, status)?;
        Ok(result)
    }
}

fn vector_len(op: &'static str, len: usize) -> Result<c_int, GpuTrainError> {
    c_int::try_from(len).ok().filter(|&n| n > 0).ok_or_else(|| {
        invalid(
            op,
            format!("a vector of {len} elements (cuBLAS takes 1..=2^31-1)"),
        )
    })
}

impl Drop for BlasHandle {
    fn drop(&mut self) {
        // A failure to bind is recorded by cudarc in the context; the destroy is tried anyway.
        let _ = self.stream.context().bind_to_thread();
        // SAFETY: `raw` was created by cublasCreate_v2 in `new` and is destroyed exactly once,
        // here. cublasDestroy synchronizes with the work it queued.
        let status = unsafe { blas_sys::cublasDestroy_v2(self.raw) };
        if status != blas_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            let _ = writeln!(
                std::io::stderr(),
                "mucudnn: warning: cublasDestroy_v2 failed while dropping: {status:?} ({})",
                status as u32
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matrix_spans() {
        assert_eq!(matrix_span("t", "A", 3, 4, 3).unwrap(), 12);
        // A 3 x 4 block of a matrix with 5 rows: the last column ends at 5 * 3 + 3.
        assert_eq!(matrix_span("t", "A", 3, 4, 5).unwrap(), 18);
        assert!(matrix_span("t", "A", 3, 4, 2)
            .unwrap_err()
            .to_string()
            .contains("leading dimension 2 is below its 3 rows"));
        assert!(matrix_span("t", "A", 0, 4, 2).is_err());
        assert!(matrix_span("t", "A", 1 << 31, 1, 1 << 31).is_err());
        assert!(vector_len("t", 0).is_err());
        assert!(vector_len("t", 1 << 31).is_err());
        assert_eq!(vector_len("t", 7).unwrap(), 7);
    }

    #[test]
    fn without_cublas_the_gate_is_an_error() {
        match cublas() {
            Ok(version) => println!("cuBLAS {version:?}"),
            Err(e) => {
                println!("cuBLAS gate (expected without a GPU): {e}");
                assert!(e.is_unavailable(), "{e:?}");
            }
        }
    }
}
