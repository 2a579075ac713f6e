//! Page-locked host buffers through which a step's small copies go: its inputs up, its
//! sampling rows up, the sampled tokens down.
//!
//! From pageable memory the driver first copies into a staging buffer of its own, and a copy
//! to pageable memory returns only once it has completed; from page-locked memory a copy is
//! one DMA queued on the stream. Each buffer is reused step after step, so before it is
//! rewritten the host waits on an event recorded after the last copy that used it (cudarc's
//! own tracking is off in this backend: see `CudaBackend::new`). That wait returns at once
//! after a step that brought tokens back (it synchronised its stream); after one that did not
//! (a prompt chunk that samples no row) it lasts until the GPU has reached that step, whose
//! inputs go up before its kernels run.

use std::sync::Arc;

use anyhow::Result;
use infer_kernels::cuda::cudarc::driver::{
    result as cu, sys, CudaContext, CudaEvent, CudaStream, DeviceRepr, PinnedHostSlice,
    ValidAsZeroBits,
};
use infer_kernels::cuda::Span;

use super::driver;

/// One page-locked buffer of `T`, grown to the largest copy asked of it.
pub struct Pinned<T> {
    host: Option<PinnedHostSlice<T>>,
    /// Recorded after the last copy into or out of `host`.
    done: CudaEvent,
    /// Elements the last download wrote.
    downloaded: usize,
}

impl<T: DeviceRepr + ValidAsZeroBits + Copy> Pinned<T> {
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self> {
        Ok(Self {
            host: None,
            done: driver(ctx.new_event(None))?,
            downloaded: 0,
        })
    }

    /// The buffer, at least `len` long, once no copy uses it any more.
    fn ready(&mut self, ctx: &Arc<CudaContext>, len: usize) -> Result<&mut [T]> {
        driver(self.done.synchronize())?;
        if self.host.as_ref().is_none_or(|h| h.len() < len) {
            // Write-combined memory is slow for the host to read back: plain page-locked.
            // SAFETY: elements are written before any is read (uploads copy in first,
            // downloads are read only after the copy completes).
            self.host = Some(driver(unsafe {
                ctx.alloc_pinned_with_flags::<T>(len.next_power_of_two(), 0)
            })?);
        }
        let host = self.host.as_mut().expect("allocated above");
        Ok(&mut driver(host.as_mut_slice())?[..len])
    }

    /// Queues a copy of `host` into `dst` through the buffer; returns once it is queued
    /// (`host` may be dropped then).
    pub fn upload(&mut self, stream: &Arc<CudaStream>, dst: Span<T>, host: &[T]) -> Result<()> {
        assert_eq!(dst.len(), host.len());
        self.upload_with(stream, host, |buf| {
            // SAFETY: `dst` is host.len() elements of device memory the caller keeps alive;
            // `buf` is page-locked and not rewritten before the copy has run.
            driver(unsafe { cu::memcpy_htod_async(dst.ptr(), buf, stream.cu_stream()) })
        })
    }

    /// Copies `host` into the buffer and has `queue` queue the copies out of it (it gets the
    /// buffer's copy of `host`, page-locked); returns once they are queued.
    pub fn upload_with(
        &mut self,
        stream: &Arc<CudaStream>,
        host: &[T],
        queue: impl FnOnce(&[T]) -> Result<()>,
    ) -> Result<()> {
        if host.is_empty() {
            return Ok(());
        }
        let buf = self.ready(stream.context(), host.len())?;
        buf.copy_from_slice(host);
        let queued = queue(buf);
        // Recorded even if only some copies were queued: the buffer waits for those.
        driver(self.done.record(stream))?;
        queued
    }

    /// Queues a copy of `src` into the buffer; [`Pinned::read`] it once the stream has
    /// synchronised (it waits for the copy in any case).
    pub fn download(&mut self, stream: &Arc<CudaStream>, src: Span<T>) -> Result<()> {
        let buf = self.ready(stream.context(), src.len())?;
        // SAFETY: `src` is src.len() elements written by work queued before on this stream;
        // the buffer is page-locked and read only after `done`.
        driver(unsafe { cu::memcpy_dtoh_async(buf, src.ptr(), stream.cu_stream()) })?;
        driver(self.done.record(stream))?;
        self.downloaded = src.len();
        Ok(())
    }

    /// What the last [`Pinned::download`] brought back.
    pub fn read(&mut self) -> Result<&[T]> {
        driver(self.done.synchronize())?;
        let n = self.downloaded;
        Ok(match self.host.as_mut() {
            Some(h) => &driver(h.as_mut_slice())?[..n],
            None => &[],
        })
    }
}

/// The backend's buffers, one per copy a step makes (so one never waits on another).
pub struct Staging {
    pub inputs: Pinned<i32>,
    pub sampling_in: Pinned<u32>,
    pub sampling_out: Pinned<u32>,
}

impl Staging {
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self> {
        Ok(Self {
            inputs: Pinned::new(ctx)?,
            sampling_in: Pinned::new(ctx)?,
            sampling_out: Pinned::new(ctx)?,
        })
    }
}

/// Queues a copy of `rows` rows of `width` elements, consecutive in `src`, into `dst`, whose
/// rows start `pitch` elements apart (the elements between keep what they held).
///
/// # Safety
/// `dst` is device memory kept alive until the copy has run; `src` is page-locked and not
/// rewritten before then.
pub unsafe fn copy_rows_htod<T>(
    stream: &CudaStream,
    dst: Span<T>,
    pitch: usize,
    src: &[T],
    width: usize,
    rows: usize,
) -> Result<()> {
    assert!(width <= pitch && src.len() == rows * width);
    if rows == 0 || width == 0 {
        return Ok(());
    }
    assert!(dst.len() >= (rows - 1) * pitch + width);
    let size = std::mem::size_of::<T>();
    let copy = sys::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_HOST,
        srcHost: src.as_ptr().cast(),
        srcDevice: 0,
        srcArray: std::ptr::null_mut(),
        srcPitch: width * size,
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        dstHost: std::ptr::null_mut(),
        dstDevice: dst.ptr(),
        dstArray: std::ptr::null_mut(),
        dstPitch: pitch * size,
        WidthInBytes: width * size,
        Height: rows,
    };
    driver(sys::cuMemcpy2DAsync_v2(&copy, stream.cu_stream()).result())
}
