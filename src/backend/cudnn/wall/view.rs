//! Views of device memory, one type for every place a pointer comes from, and the operands of
//! one call grouped by role.
//!
//! A view is `len` elements of one dtype at a device address (a workspace view: bytes), plus
//! its [`Origin`]: where the pointer came from and what that keeps alive while the view lives,
//! as cudarc's `DevicePtr`/`DevicePtrMut` give a pointer together with a `SyncOnDrop` guard.
//! Two origins cover the three sources:
//!
//! - [`Tracked`]: a cudarc allocation, mucudnn's own ([`super::DeviceBuffer`],
//!   [`super::Workspace`]) or a framework's (candle's `CudaSlice`): the view knows the stream
//!   the pointer was taken on, every call checks that it is the stream the work goes to, and the
//!   guard records the buffer's event once the work is queued (when the view drops);
//! - [`Raw`]: a caller's raw pointer (the C ABI, PyTorch), valid by the promise made to an
//!   `unsafe` constructor; nothing is known of its stream.
//!
//! A sub-view ([`DeviceView::slice`], [`DeviceViewMut::slice_mut`],
//! [`WorkspaceView::reborrow`]) borrows its parent and has the origin `&O`: the parent keeps
//! the memory and its guard. Writable views are not `Clone` and sub-views borrow them mutably,
//! so two writable views of one range never coexist.

use super::*;
pub use crate::backend::operands::ConvOperands;
use std::marker::PhantomData;

mod sealed {
    pub trait Sealed {}
}

/// Where a view's device pointer came from: [`Tracked`] (a cudarc allocation) or [`Raw`] (a
/// caller's pointer), or a parent view's origin (`&O`, for a sub-view).
pub trait Origin: sealed::Sealed {
    /// The stream the pointer was taken on, where it is known: a call checks that its work
    /// goes to this stream.
    fn stream(&self) -> Option<&CudaStream>;
}

/// A cudarc allocation (mucudnn's buffers, candle's slices): the stream the pointer was taken
/// on, and cudarc's guard, which records the buffer's event on that stream when dropped (after
/// the work using the view is queued).
pub struct Tracked<'a> {
    stream: &'a CudaStream,
    _sync: SyncOnDrop<'a>,
}

impl<'a> Tracked<'a> {
    pub(super) fn new(stream: &'a CudaStream, sync: SyncOnDrop<'a>) -> Self {
        Tracked {
            stream,
            _sync: sync,
        }
    }
}

/// A caller's raw device pointer, valid by the promise made to its `unsafe` constructor.
#[derive(Clone, Copy, Debug)]
pub struct Raw;

impl sealed::Sealed for Tracked<'_> {}
impl sealed::Sealed for Raw {}
impl<O: Origin> sealed::Sealed for &O {}

impl Origin for Tracked<'_> {
    fn stream(&self) -> Option<&CudaStream> {
        Some(self.stream)
    }
}

impl Origin for Raw {
    fn stream(&self) -> Option<&CudaStream> {
        None
    }
}

impl<O: Origin> Origin for &O {
    fn stream(&self) -> Option<&CudaStream> {
        (**self).stream()
    }
}

/// Read-only device memory: `len` (> 0) elements of `dtype` at a device address, kept alive
/// for `'a` by its origin `O`. Made by [`super::DeviceBuffer::view`], [`RawDeviceView::new`],
/// [`DeviceView::from_cudarc`] or [`Self::slice`].
pub struct DeviceView<'a, O: Origin = Tracked<'a>> {
    pub(super) ptr: u64,
    pub(super) len: usize,
    pub(super) dtype: DType,
    pub(super) origin: O,
    _memory: PhantomData<&'a [u8]>,
}

/// Writable device memory; see [`DeviceView`]. Nothing else reads or writes it while the view
/// lives (the borrow of a buffer, or the promise made to [`RawDeviceViewMut::new`]).
pub struct DeviceViewMut<'a, O: Origin = Tracked<'a>> {
    pub(super) ptr: u64,
    pub(super) len: usize,
    pub(super) dtype: DType,
    pub(super) origin: O,
    _memory: PhantomData<&'a mut [u8]>,
}

/// Writable device scratch bytes for one call, or none (null, 0 bytes). Micro-batches of one
/// call share it ([`Self::reborrow`]).
pub struct WorkspaceView<'a, O: Origin = Tracked<'a>> {
    ptr: u64,
    pub(super) bytes: u64,
    /// `None` for no workspace.
    pub(super) origin: Option<O>,
    _memory: PhantomData<&'a mut [u8]>,
}

/// A caller's device memory, read-only (the C ABI, PyTorch).
pub type RawDeviceView<'a> = DeviceView<'a, Raw>;
/// A caller's device memory, writable.
pub type RawDeviceViewMut<'a> = DeviceViewMut<'a, Raw>;
/// A caller's device scratch memory, borrowed for a call.
pub type RawWorkspace<'a> = WorkspaceView<'a, Raw>;

/// The operands of one call at the FFI wall: views of one origin.
pub type DeviceOperands<'r, 'a, O> =
    ConvOperands<&'r DeviceView<'a, O>, &'r mut DeviceViewMut<'a, O>, &'r mut WorkspaceView<'a, O>>;

impl<'r, 'a, O: Origin> DeviceOperands<'r, 'a, O> {
    /// The operands `[a, b, out]` in the op's roles and the workspace (reborrowed, so views can
    /// be used for one call after another).
    pub fn new(
        a: &'r DeviceView<'a, O>,
        b: &'r DeviceView<'a, O>,
        out: &'r mut DeviceViewMut<'a, O>,
        workspace: &'r mut WorkspaceView<'a, O>,
    ) -> Self {
        ConvOperands {
            a,
            b,
            out,
            workspace,
        }
    }
}

fn check_raw(call: &'static str, ptr: u64, len: usize, dtype: DType) -> Result<(), CudnnError> {
    if ptr == 0 {
        return Err(invalid(call, "the device pointer is NULL".into()));
    }
    let bytes = len
        .checked_mul(dtype.size_bytes())
        .filter(|&bytes| bytes > 0)
        .ok_or_else(|| invalid(call, format!("{len} {dtype} elements is not a valid size")))?;
    ptr.checked_add(bytes as u64).ok_or_else(|| {
        invalid(
            call,
            format!("{len} {dtype} elements at {ptr:#x} wrap around"),
        )
    })?;
    Ok(())
}

fn check_slice(
    call: &'static str,
    whole: usize,
    offset: usize,
    len: usize,
) -> Result<(), CudnnError> {
    match offset.checked_add(len) {
        Some(end) if len > 0 && end <= whole => Ok(()),
        _ => Err(invalid(
            call,
            format!(
                "elements [{offset}, {offset} + {len}) are not a non-empty range of a view of \
                 {whole} elements"
            ),
        )),
    }
}

/// The accessors a view of elements has, whichever way it may be written: its length, dtype,
/// address and the bytes it spans.
macro_rules! element_span_accessors {
    () => {
        pub fn len(&self) -> usize {
            self.len
        }

        /// Always false: views have at least one element.
        pub fn is_empty(&self) -> bool {
            self.len == 0
        }

        pub fn dtype(&self) -> DType {
            self.dtype
        }

        /// The device address, for messages.
        pub fn address(&self) -> u64 {
            self.ptr
        }

        pub(super) fn byte_range(&self) -> (u64, u64) {
            (
                self.ptr,
                self.ptr + (self.len * self.dtype.size_bytes()) as u64,
            )
        }
    };
}

impl<'a, O: Origin> DeviceView<'a, O> {
    pub(super) fn with_origin(ptr: u64, len: usize, dtype: DType, origin: O) -> Self {
        DeviceView {
            ptr,
            len,
            dtype,
            origin,
            _memory: PhantomData,
        }
    }

    /// Elements `[offset, offset + len)`, borrowing this view.
    pub fn slice(&self, offset: usize, len: usize) -> Result<DeviceView<'_, &O>, CudnnError> {
        check_slice("DeviceView::slice", self.len, offset, len)?;
        Ok(DeviceView::with_origin(
            self.ptr + (offset * self.dtype.size_bytes()) as u64,
            len,
            self.dtype,
            &self.origin,
        ))
    }

    element_span_accessors!();
}

impl<'a, O: Origin> DeviceViewMut<'a, O> {
    pub(super) fn with_origin(ptr: u64, len: usize, dtype: DType, origin: O) -> Self {
        DeviceViewMut {
            ptr,
            len,
            dtype,
            origin,
            _memory: PhantomData,
        }
    }

    /// Elements `[offset, offset + len)`, borrowing this view mutably.
    pub fn slice_mut(
        &mut self,
        offset: usize,
        len: usize,
    ) -> Result<DeviceViewMut<'_, &O>, CudnnError> {
        check_slice("DeviceViewMut::slice_mut", self.len, offset, len)?;
        Ok(DeviceViewMut::with_origin(
            self.ptr + (offset * self.dtype.size_bytes()) as u64,
            len,
            self.dtype,
            &self.origin,
        ))
    }

    element_span_accessors!();
}

impl<'a, O: Origin> WorkspaceView<'a, O> {
    /// No workspace: for algorithms that need 0 bytes.
    pub fn empty() -> Self {
        WorkspaceView {
            ptr: 0,
            bytes: 0,
            origin: None,
            _memory: PhantomData,
        }
    }

    /// `bytes` (> 0) bytes at `ptr` (checked by the constructors).
    pub(super) fn with_origin(ptr: u64, bytes: u64, origin: O) -> Self {
        WorkspaceView {
            ptr,
            bytes,
            origin: Some(origin),
            _memory: PhantomData,
        }
    }

    /// The same bytes, borrowing this view mutably: one call's micro-batches share it.
    pub fn reborrow(&mut self) -> WorkspaceView<'_, &O> {
        WorkspaceView {
            ptr: self.ptr,
            bytes: self.bytes,
            origin: self.origin.as_ref(),
            _memory: PhantomData,
        }
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Null exactly for no workspace.
    pub(super) fn raw_ptr(&self) -> *mut c_void {
        if self.bytes == 0 {
            std::ptr::null_mut()
        } else {
            self.ptr as *mut c_void
        }
    }

    /// Bytes `[offset, offset + bytes)` of this view (the caller has checked the range and
    /// that `bytes > 0`).
    pub(super) fn narrowed(mut self, offset: u64, bytes: u64) -> Self {
        self.ptr += offset;
        self.bytes = bytes;
        self
    }
}

impl<'a> DeviceView<'a, Raw> {
    /// A view of `len` elements of `dtype` at `ptr`. A null pointer or an empty or overflowing
    /// size is an error.
    ///
    /// # Safety
    ///
    /// For all of `'a`: `ptr` is the address of `len` consecutive `dtype` elements of device
    /// memory that the GPU of the handle the view is used with can read (cudaMalloc or
    /// cuMemAlloc memory, a block of a caching allocator, managed or mapped memory); it stays
    /// allocated until the work queued with the view has finished, and nothing writes to it
    /// while that work runs.
    pub unsafe fn new(ptr: *const c_void, len: usize, dtype: DType) -> Result<Self, CudnnError> {
        let address = ptr as u64;
        check_raw("RawDeviceView::new", address, len, dtype)?;
        Ok(DeviceView::with_origin(address, len, dtype, Raw))
    }
}

impl<'a> DeviceViewMut<'a, Raw> {
    /// A writable view of `len` elements of `dtype` at `ptr`. A null pointer or an empty or
    /// overflowing size is an error.
    ///
    /// # Safety
    ///
    /// As for [`RawDeviceView::new`], and in addition: the memory is writable by the GPU, and
    /// for all of `'a` nothing else reads or writes it while work queued with the view runs
    /// (in particular, no other view given to the same call overlaps it).
    pub unsafe fn new(ptr: *mut c_void, len: usize, dtype: DType) -> Result<Self, CudnnError> {
        let address = ptr as u64;
        check_raw("RawDeviceViewMut::new", address, len, dtype)?;
        Ok(DeviceViewMut::with_origin(address, len, dtype, Raw))
    }
}

impl<'a> WorkspaceView<'a, Raw> {
    /// `bytes` bytes at `ptr`. Null with a non-zero size, or a range that wraps around, is an
    /// error.
    ///
    /// # Safety
    ///
    /// When `bytes > 0`: for all of `'a`, `ptr` is the address of `bytes` bytes of device
    /// memory that the GPU of the session's handle can write, that nothing else uses while the
    /// work queued with it runs, and that stays allocated until that work has finished.
    pub unsafe fn new(ptr: *mut c_void, bytes: u64) -> Result<Self, CudnnError> {
        let address = ptr as u64;
        if bytes > 0 && (address == 0 || address.checked_add(bytes).is_none()) {
            return Err(invalid(
                "RawWorkspace::new",
                format!("{bytes} workspace bytes at {address:#x} are not a valid range"),
            ));
        }
        Ok(if bytes == 0 {
            WorkspaceView::empty()
        } else {
            WorkspaceView::with_origin(address, bytes, Raw)
        })
    }
}

impl<'a> DeviceView<'a, Tracked<'a>> {
    /// A view of a cudarc buffer (candle's storage), its pointer taken on `stream` (the stream
    /// waits for the buffer's last write; the buffer's read event is recorded there when the
    /// view drops). `T` is f32, f16 or bf16 (`Element` is sealed to them), whose sizes are
    /// their dtypes'. A null pointer or an empty or overflowing size is an error.
    ///
    /// # Safety
    ///
    /// `stream` is the stream the work using the view is queued on, and the buffer is freed only
    /// after that work has finished: cudarc frees stream-ordered, after the events this view
    /// records when the context tracks events, and otherwise on the buffer's own stream, which
    /// must then be `stream`.
    pub unsafe fn from_cudarc<T: crate::backend::cpu::Element>(
        buffer: &'a impl DevicePtr<T>,
        stream: &'a CudaStream,
    ) -> Result<Self, CudnnError> {
        let len = buffer.len();
        let (ptr, sync) = buffer.device_ptr(stream);
        check_raw("DeviceView::from_cudarc", ptr, len, T::DTYPE)?;
        Ok(DeviceView::with_origin(
            ptr,
            len,
            T::DTYPE,
            Tracked::new(stream, sync),
        ))
    }
}

impl<'a> DeviceViewMut<'a, Tracked<'a>> {
    /// A writable view of a cudarc buffer (candle's storage); see [`DeviceView::from_cudarc`].
    ///
    /// # Safety
    ///
    /// As for [`DeviceView::from_cudarc`].
    pub unsafe fn from_cudarc<T: crate::backend::cpu::Element>(
        buffer: &'a mut impl DevicePtrMut<T>,
        stream: &'a CudaStream,
    ) -> Result<Self, CudnnError> {
        let len = buffer.len();
        let (ptr, sync) = buffer.device_ptr_mut(stream);
        check_raw("DeviceViewMut::from_cudarc", ptr, len, T::DTYPE)?;
        Ok(DeviceViewMut::with_origin(
            ptr,
            len,
            T::DTYPE,
            Tracked::new(stream, sync),
        ))
    }
}

impl<'a> WorkspaceView<'a, Tracked<'a>> {
    /// A cudarc byte buffer (from candle's allocator) as a workspace; see
    /// [`DeviceView::from_cudarc`]. An empty buffer is no workspace.
    ///
    /// # Safety
    ///
    /// As for [`DeviceView::from_cudarc`].
    pub unsafe fn from_cudarc(
        buffer: &'a mut CudaSlice<u8>,
        stream: &'a CudaStream,
    ) -> Result<Self, CudnnError> {
        let bytes = buffer.len() as u64;
        if bytes == 0 {
            return Ok(WorkspaceView::empty());
        }
        let (ptr, sync) = buffer.device_ptr_mut(stream);
        if ptr == 0 || ptr.checked_add(bytes).is_none() {
            return Err(invalid(
                "WorkspaceView::from_cudarc",
                format!("{bytes} workspace bytes at {ptr:#x} are not a valid range"),
            ));
        }
        Ok(WorkspaceView::with_origin(
            ptr,
            bytes,
            Tracked::new(stream, sync),
        ))
    }
}

impl<O: Origin> std::fmt::Debug for DeviceView<'_, O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceView")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("dtype", &self.dtype)
            .finish_non_exhaustive()
    }
}

impl<O: Origin> std::fmt::Debug for DeviceViewMut<'_, O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceViewMut")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("dtype", &self.dtype)
            .finish_non_exhaustive()
    }
}

impl<O: Origin> std::fmt::Debug for WorkspaceView<'_, O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkspaceView")
            .field("bytes", &self.bytes)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_views_check_their_ranges() {
        // SAFETY: the views are never used for a call; only their bounds are checked.
        unsafe {
            assert!(RawDeviceView::new(std::ptr::null(), 4, DType::Fp32).is_err());
            assert!(RawDeviceView::new(0x1000 as *const c_void, 0, DType::Fp32).is_err());
            assert!(RawDeviceView::new(u64::MAX as *const c_void, 2, DType::Fp32).is_err());
            assert!(RawWorkspace::new(std::ptr::null_mut(), 8).is_err());
            assert_eq!(
                RawWorkspace::new(std::ptr::null_mut(), 0).unwrap().bytes(),
                0
            );
            let view = RawDeviceView::new(0x1000 as *const c_void, 8, DType::Fp16).unwrap();
            let part = view.slice(2, 4).unwrap();
            assert_eq!((part.address(), part.len()), (0x1004, 4));
            assert!(view.slice(6, 4).is_err());
            assert!(view.slice(0, 0).is_err());
            let mut out = RawDeviceViewMut::new(0x2000 as *mut c_void, 8, DType::Fp32).unwrap();
            assert_eq!(out.slice_mut(7, 1).unwrap().address(), 0x201c);
            assert!(out.slice_mut(7, 2).is_err());
            let mut ws = RawWorkspace::new(0x3000 as *mut c_void, 64).unwrap();
            assert_eq!(ws.reborrow().bytes(), 64);
            assert!(ws.reborrow().origin.is_some());
        }
    }
}
