//! The training FFI wall: the only code of [`crate::train`] that names cudarc's raw layers
//! (`cudarc::{cudnn, cublas, nccl}::{sys, result}`) and the only `unsafe` code there. It
//! follows the convolution backend's wall (`crate::backend::cudnn`), shares its driver and
//! cuDNN gates and its handle, and adds the cuDNN ops a CNN needs besides convolution
//! ([`dnn`]), cuBLAS ([`blas`]) and NCCL ([`nccl`]). Everything it exports is safe.
//!
//! # How the wall keeps the unsafe calls sound
//!
//! - **Libraries.** cudarc loads each library on first use and *panics* when it or a symbol
//!   is missing. Every value below exists only if its gate passed: the backend's driver and
//!   cuDNN gates, plus a check that every extra cuDNN symbol an op calls is exported
//!   ([`dnn`]: each descriptor or op token checks its own symbols), a cuBLAS gate
//!   ([`blas`]) and an NCCL gate ([`nccl`]). A missing library is
//!   [`GpuTrainError::Unavailable`] (cuBLAS, NCCL) or the backend's `CudnnError::Unavailable`
//!   (driver, cuDNN), never a panic.
//! - **Device memory** arrives as [`DeviceData`] / [`DeviceDataMut`]: sealed traits,
//!   implemented only for cudarc's `CudaSlice`, `CudaView` and `CudaViewMut` of `f32`,
//!   `half::f16` and `half::bf16`, and for the backend's `DeviceBuffer`. Each knows its dtype,
//!   its element count and its stream; a device pointer is taken (through cudarc's
//!   `DevicePtr`, which records the access for stream-ordered frees) only inside the wall,
//!   right before the call, and only after the wall has checked that the buffer has the
//!   dtype and exact element count its descriptor (cuDNN) or its matrix extent (cuBLAS)
//!   needs, and lives on the stream the call is queued on. Shared and exclusive borrows make
//!   an output distinct from every input.
//! - **Handles and descriptors** are RAII types: created and configured in one constructor,
//!   destroyed exactly once in `Drop`, which never panics (a failed destroy is written to
//!   stderr). They hold raw pointers, so they are neither `Send` nor `Sync`: one thread per
//!   GPU, as with the backend's handle.
//! - **Status values** arrive as cudarc's enums (cuDNN 9.21, cuBLAS 13, NCCL 2.30 headers,
//!   supersets of the statuses the libraries return) and are kept by name and number.

use super::error::{invalid, GpuTrainError};
use crate::backend::cudnn::DeviceBuffer;
use crate::solver::DType;
use cudarc::driver::{
    CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop,
};
use std::sync::Arc;

/// A new stream on `device` for a replica that queues all its work on that one stream, in a
/// context with cudarc's event tracking off: cudarc would otherwise (once a context has a
/// second stream) record an event after, and wait on one before, every use of every buffer,
/// which on a single stream orders nothing that the stream does not already order.
pub(crate) fn single_stream(device: usize) -> Result<Arc<CudaStream>, GpuTrainError> {
    crate::backend::cudnn::require_driver()?;
    let context = cudarc::driver::CudaContext::new(device)
        .map_err(|e| crate::backend::cudnn::driver_error("cuDevicePrimaryCtxRetain", e))?;
    // SAFETY: cudarc's contract is that slices made after this call are synchronised by the
    // user between streams. Every buffer of a replica is allocated on, and only used on, the
    // stream made below (the training wall checks each buffer's stream before every call,
    // `check_stream`), frees are ordered on that stream, and the host reads them only after a
    // synchronisation of it; the tuning backend makes its own context object, whose tracking
    // this does not change.
    unsafe { context.disable_event_tracking() };
    context
        .new_stream()
        .map_err(|e| crate::backend::cudnn::driver_error("cuStreamCreate", e).into())
}

pub(crate) mod blas;
pub(crate) mod dnn;
pub(crate) mod nccl;

mod sealed {
    use cudarc::driver::{CudaStream, SyncOnDrop};

    /// Device-pointer access, for the wall only: this trait cannot be named outside it.
    pub trait Raw {
        /// The device address for reading on `stream`; drop the guard after queuing the read.
        fn raw_read<'a>(&'a self, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>);
    }

    /// Device-pointer access for writing, for the wall only.
    pub trait RawMut: Raw {
        /// The device address for writing on `stream`; drop the guard after queuing the write.
        fn raw_write<'a>(&'a mut self, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>);
    }
}

/// Device memory that a training op reads: a whole `CudaSlice<T>` or a `CudaView<T>` /
/// `CudaViewMut<T>` window of one (`T` = `f32`, `half::f16`, `half::bf16`), or a backend
/// `DeviceBuffer` (what the micro-batched convolution plans read and write). Sealed: the ops
/// trust what it says about the memory.
pub trait DeviceData: sealed::Raw {
    /// The element type.
    fn dtype(&self) -> DType;
    /// The number of elements.
    fn elements(&self) -> usize;
    /// The stream the memory was allocated on; ops require their own stream.
    fn device_stream(&self) -> &Arc<CudaStream>;
}

/// Device memory that a training op writes (a `CudaSlice`, a `CudaViewMut`, a `DeviceBuffer`).
pub trait DeviceDataMut: DeviceData + sealed::RawMut {}

macro_rules! impl_device_data {
    ($t:ty, $dtype:expr) => {
        impl sealed::Raw for CudaSlice<$t> {
            fn raw_read<'a>(&'a self, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
                DevicePtr::device_ptr(self, stream)
            }
        }
        impl sealed::RawMut for CudaSlice<$t> {
            fn raw_write<'a>(&'a mut self, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
                DevicePtrMut::device_ptr_mut(self, stream)
            }
        }
        impl DeviceData for CudaSlice<$t> {
            fn dtype(&self) -> DType {
                $dtype
            }
            fn elements(&self) -> usize {
                DeviceSlice::len(self)
            }
            fn device_stream(&self) -> &Arc<CudaStream> {
                DeviceSlice::stream(self)
            }
        }
        impl DeviceDataMut for CudaSlice<$t> {}

        impl sealed::Raw for CudaView<'_, $t> {
            fn raw_read<'a>(&'a self, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
                DevicePtr::device_ptr(self, stream)
            }
        }
        impl DeviceData for CudaView<'_, $t> {
            fn dtype(&self) -> DType {
                $dtype
            }
            fn elements(&self) -> usize {
                DeviceSlice::len(self)
            }
            fn device_stream(&self) -> &Arc<CudaStream> {
                DeviceSlice::stream(self)
            }
        }

        impl sealed::Raw for CudaViewMut<'_, $t> {
            fn raw_read<'a>(&'a self, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
                DevicePtr::device_ptr(self, stream)
            }
        }
        impl sealed::RawMut for CudaViewMut<'_, $t> {
            fn raw_write<'a>(&'a mut self, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
                DevicePtrMut::device_ptr_mut(self, stream)
            }
        }
        impl DeviceData for CudaViewMut<'_, $t> {
            fn dtype(&self) -> DType {
                $dtype
            }
            fn elements(&self) -> usize {
                DeviceSlice::len(self)
            }
            fn device_stream(&self) -> &Arc<CudaStream> {
                DeviceSlice::stream(self)
            }
        }
        impl DeviceDataMut for CudaViewMut<'_, $t> {}
    };
}

impl_device_data!(f32, DType::Fp32);
impl_device_data!(half::f16, DType::Fp16);
impl_device_data!(half::bf16, DType::Bf16);

// The backend's buffer: its bytes are `len * dtype size`, allocated on its handle's stream.
impl sealed::Raw for DeviceBuffer {
    fn raw_read<'a>(&'a self, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        DevicePtr::device_ptr(self.cuda_bytes(), stream)
    }
}
impl sealed::RawMut for DeviceBuffer {
    fn raw_write<'a>(&'a mut self, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        DevicePtrMut::device_ptr_mut(self.cuda_bytes_mut(), stream)
    }
}
impl DeviceData for DeviceBuffer {
    fn dtype(&self) -> DType {
        DeviceBuffer::dtype(self)
    }
    fn elements(&self) -> usize {
        self.len()
    }
    fn device_stream(&self) -> &Arc<CudaStream> {
        self.cuda_bytes().stream()
    }
}
impl DeviceDataMut for DeviceBuffer {}

/// Checks that `data` (called `name` in messages) lives on `stream`.
fn check_stream<D: DeviceData + ?Sized>(
    call: &'static str,
    name: &str,
    data: &D,
    stream: &CudaStream,
) -> Result<(), GpuTrainError> {
    if **data.device_stream() != *stream {
        return Err(invalid(
            call,
            format!(
                "{name} was allocated on another stream or device than the one this op runs on \
                 (allocate every buffer of a replica on its GpuOps stream)"
            ),
        ));
    }
    Ok(())
}

/// Checks that `data` holds `dtype` elements and exactly `elements` of them.
fn check_extent<D: DeviceData + ?Sized>(
    call: &'static str,
    name: &str,
    data: &D,
    dtype: DType,
    elements: usize,
    what: &dyn Fn() -> String,
) -> Result<(), GpuTrainError> {
    if data.dtype() != dtype {
        return Err(invalid(
            call,
            format!("{name} is {} but {} is {dtype}", data.dtype(), what()),
        ));
    }
    if data.elements() != elements {
        return Err(invalid(
            call,
            format!(
                "{name} has {} elements but {} has {elements}",
                data.elements(),
                what()
            ),
        ));
    }
    Ok(())
}

/// Reads a C string a library returned (null: `None`).
///
/// # Safety
///
/// `ptr` is null or points to a NUL-terminated string that stays valid during the call.
unsafe fn c_string(ptr: *const std::ffi::c_char) -> Option<String> {
    if ptr.is_null() {
        None
    } else {
        // SAFETY: non-null and NUL-terminated (the caller's contract).
        Some(
            unsafe { std::ffi::CStr::from_ptr(ptr) }
                .to_string_lossy()
                .into_owned(),
        )
    }
}
