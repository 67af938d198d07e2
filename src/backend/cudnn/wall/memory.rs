//! Device memory owned by mucudnn on a handle's stream: [`DeviceBuffer`] and its checked views
//! ([`super::view`]),
//! the algorithms' [`Workspace`], and [`GpuTimer`] (CUDA events) for timing on the stream.

use super::*;

pub(super) fn buffer_bytes(
    call: &'static str,
    dtype: DType,
    len: usize,
) -> Result<usize, CudnnError> {
    if len == 0 {
        return Err(invalid(
            call,
            "a device buffer needs at least one element".into(),
        ));
    }
    len.checked_mul(dtype.size_bytes())
        .ok_or_else(|| invalid(call, format!("{len} {dtype} elements overflow usize")))
}

/// A device array of `len` elements of one dtype, allocated on a handle's stream.
/// Freed (stream-ordered) on drop.
pub struct DeviceBuffer {
    pub(super) data: CudaSlice<u8>,
    pub(super) stream: Arc<CudaStream>,
    pub(super) dtype: DType,
    pub(super) len: usize,
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("dtype", &self.dtype)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl DeviceBuffer {
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: buffers have at least one element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn size_bytes(&self) -> usize {
        self.len * self.dtype.size_bytes()
    }

    fn check_range(
        &self,
        call: &'static str,
        offset: usize,
        len: usize,
    ) -> Result<u64, CudnnError> {
        match offset.checked_add(len) {
            Some(end) if len > 0 && end <= self.len => {
                Ok((offset * self.dtype.size_bytes()) as u64)
            }
            _ => Err(invalid(
                call,
                format!(
                    "elements [{offset}, {offset} + {len}) are not a non-empty range of a buffer \
                     of {} elements",
                    self.len
                ),
            )),
        }
    }

    /// Elements `[offset, offset + len)`, read-only.
    pub fn view(&self, offset: usize, len: usize) -> Result<DeviceView<'_>, CudnnError> {
        let byte_offset = self.check_range("DeviceBuffer::view", offset, len)?;
        let (base, sync) = self.data.device_ptr(&self.stream);
        Ok(DeviceView::with_origin(
            base + byte_offset,
            len,
            self.dtype,
            Tracked::new(&self.stream, sync),
        ))
    }

    /// The whole buffer, read-only.
    pub fn view_all(&self) -> DeviceView<'_> {
        let (base, sync) = self.data.device_ptr(&self.stream);
        DeviceView::with_origin(base, self.len, self.dtype, Tracked::new(&self.stream, sync))
    }

    /// Elements `[offset, offset + len)`, writable.
    pub fn view_mut(&mut self, offset: usize, len: usize) -> Result<DeviceViewMut<'_>, CudnnError> {
        let byte_offset = self.check_range("DeviceBuffer::view_mut", offset, len)?;
        let (base, sync) = self.data.device_ptr_mut(&self.stream);
        Ok(DeviceViewMut::with_origin(
            base + byte_offset,
            len,
            self.dtype,
            Tracked::new(&self.stream, sync),
        ))
    }

    /// The whole buffer, writable.
    pub fn view_all_mut(&mut self) -> DeviceViewMut<'_> {
        let (len, dtype) = (self.len, self.dtype);
        let (base, sync) = self.data.device_ptr_mut(&self.stream);
        DeviceViewMut::with_origin(base, len, dtype, Tracked::new(&self.stream, sync))
    }

    /// Copies the buffer to the host (waiting for the work issued before), as f32.
    pub fn download(&self) -> Result<Vec<f32>, CudnnError> {
        let bytes = self
            .stream
            .clone_dtoh(&self.data)
            .map_err(drv_err("cuMemcpyDtoHAsync"))?;
        self.stream
            .synchronize()
            .map_err(drv_err("cuStreamSynchronize"))?;
        host::decode(self.dtype, &bytes)
    }

    /// Overwrites the buffer with `values` converted to its dtype; `values.len()` must equal
    /// [`Self::len`].
    pub fn copy_from_host(&mut self, values: &[f32]) -> Result<(), CudnnError> {
        if values.len() != self.len {
            return Err(invalid(
                "DeviceBuffer::copy_from_host",
                format!("{} values for a buffer of {}", values.len(), self.len),
            ));
        }
        let bytes = host::encode(self.dtype, values);
        self.stream
            .memcpy_htod(&bytes, &mut self.data)
            .map_err(drv_err("cuMemcpyHtoDAsync"))
    }

    /// Overwrites the buffer with [`host::random_values`] (non-zero) from `seed`.
    pub fn fill_random(&mut self, seed: u64) -> Result<(), CudnnError> {
        let values = host::random_values(self.dtype, self.len, seed);
        self.copy_from_host(&values)
    }
}

/// Device scratch memory for cuDNN algorithms.
pub struct Workspace {
    pub(super) data: Option<CudaSlice<u8>>,
    pub(super) stream: Arc<CudaStream>,
    pub(super) bytes: u64,
}

impl std::fmt::Debug for Workspace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Workspace")
            .field("bytes", &self.bytes)
            .finish_non_exhaustive()
    }
}

impl Workspace {
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The whole workspace.
    pub fn view(&mut self) -> WorkspaceView<'_> {
        let bytes = self.bytes;
        match self.data.as_mut() {
            None => WorkspaceView::empty(),
            Some(data) => {
                let (ptr, sync) = data.device_ptr_mut(&self.stream);
                WorkspaceView::with_origin(ptr, bytes, Tracked::new(&self.stream, sync))
            }
        }
    }

    /// Bytes `[offset, offset + bytes)`: for sharing one allocation between layers
    /// (µ-cuDNN's workspace division). A 0-byte range is an empty view.
    pub fn view_range(&mut self, offset: u64, bytes: u64) -> Result<WorkspaceView<'_>, CudnnError> {
        match offset.checked_add(bytes) {
            Some(end) if end <= self.bytes => {}
            _ => {
                return Err(invalid(
                    "Workspace::view_range",
                    format!(
                        "bytes [{offset}, {offset} + {bytes}) are outside a workspace of {} bytes",
                        self.bytes
                    ),
                ))
            }
        }
        if bytes == 0 {
            return Ok(WorkspaceView::empty());
        }
        Ok(self.view().narrowed(offset, bytes))
    }
}

// Timing

/// Two CUDA events (with timing) on a handle's stream: `start()`, issue work, `stop()`,
/// `elapsed_ms()`. The time is GPU time between the two points of the stream.
pub struct GpuTimer {
    pub(super) start: CudaEvent,
    pub(super) end: CudaEvent,
    pub(super) stream: Arc<CudaStream>,
}

impl std::fmt::Debug for GpuTimer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuTimer").finish_non_exhaustive()
    }
}

impl GpuTimer {
    /// Records the start point on the stream.
    pub fn start(&self) -> Result<(), CudnnError> {
        self.start
            .record(&self.stream)
            .map_err(drv_err("cuEventRecord"))
    }

    /// Records the end point on the stream.
    pub fn stop(&self) -> Result<(), CudnnError> {
        self.end
            .record(&self.stream)
            .map_err(drv_err("cuEventRecord"))
    }

    /// Waits for the end point and returns the milliseconds between start and end.
    pub fn elapsed_ms(&self) -> Result<f32, CudnnError> {
        self.start
            .elapsed_ms(&self.end)
            .map_err(drv_err("cuEventElapsedTime"))
    }

    /// Times `work` (which issues work to the handle's stream): start, work, stop, wait.
    pub fn time<F>(&self, work: F) -> Result<f32, CudnnError>
    where
        F: FnOnce() -> Result<(), CudnnError>,
    {
        self.start()?;
        work()?;
        self.stop()?;
        self.elapsed_ms()
    }
}
