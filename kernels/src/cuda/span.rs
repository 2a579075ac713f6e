//! Raw device-address spans: what every launch wrapper takes.
//!
//! A [`Span`] is a device address plus an element count, with no lifetime and no cudarc
//! bookkeeping. That lets one big allocation (an activation arena, the KV pool, the weights) be
//! cut into disjoint inputs and outputs, and keeps the addresses a CUDA graph captures stable
//! across steps. The price: the borrow checker no longer sees the memory, so the owner of the
//! allocation must keep it alive for as long as launches using its spans may run, and cudarc's
//! per-slice stream-synchronisation events are bypassed (order work on one stream, or
//! synchronise explicitly).

use std::fmt;
use std::marker::PhantomData;
use std::mem::size_of;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaSlice, DevicePtr};

/// `len` elements of `T` at device address `ptr`.
///
/// bf16 tensors are `Span<u16>`, index arrays `Span<i32>`, f32 tables and logits `Span<f32>`.
pub struct Span<T> {
    ptr: CUdeviceptr,
    len: usize,
    _t: PhantomData<fn() -> T>,
}

impl<T> Span<T> {
    /// # Safety
    /// `ptr .. ptr + len * size_of::<T>()` is a live device allocation (of the context the
    /// kernels run in) for as long as the span is used, suitably aligned for `T`.
    pub unsafe fn from_raw(ptr: u64, len: usize) -> Self {
        Self {
            ptr,
            len,
            _t: PhantomData,
        }
    }

    /// The whole of `slice`. The span does not keep the slice alive: drop the slice only after
    /// the work using the span has finished.
    pub fn of(slice: &CudaSlice<T>) -> Self {
        // Dropping the guard records a read on the slice's stream when cudarc's event tracking
        // is on; spans do no tracking of their own.
        let (ptr, _guard) = slice.device_ptr(slice.stream());
        Self {
            ptr,
            len: slice.len(),
            _t: PhantomData,
        }
    }

    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Where the span keeps its device address: what a kernel launch passes for it.
    pub(crate) fn address(&self) -> &u64 {
        &self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Elements `start .. start + len`. Panics when that is not inside the span.
    pub fn slice(self, start: usize, len: usize) -> Self {
        assert!(
            start.checked_add(len).is_some_and(|end| end <= self.len),
            "span slice {start}..{start}+{len} out of range for length {}",
            self.len
        );
        Self {
            ptr: self.ptr + (start * size_of::<T>()) as u64,
            len,
            _t: PhantomData,
        }
    }

    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.len * size_of::<T>()
    }
}

// Written out rather than derived: derives would require `T: Clone` / `T: Eq` / ..., and
// `Span<f32>` must be `Eq` (it compares addresses, not floats).
impl<T> Clone for Span<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Span<T> {}

impl<T> PartialEq for Span<T> {
    fn eq(&self, other: &Self) -> bool {
        (self.ptr, self.len) == (other.ptr, other.len)
    }
}

impl<T> Eq for Span<T> {}

impl<T> fmt::Debug for Span<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Span<{}>({:#x}, {})",
            std::any::type_name::<T>(),
            self.ptr,
            self.len
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_offset_by_elements() {
        // SAFETY: never dereferenced.
        let span = unsafe { Span::<u16>::from_raw(0x1000, 100) };
        assert_eq!(span.bytes(), 200);
        let s = span.slice(10, 20);
        assert_eq!((s.ptr(), s.len()), (0x1000 + 20, 20));
        assert_eq!(s.slice(20, 0).ptr(), 0x1000 + 60);
        assert!(span.slice(100, 0).is_empty());
        let f = unsafe { Span::<f32>::from_raw(0x1000, 4) };
        assert_eq!(f.slice(1, 3).ptr(), 0x1004);
        assert_eq!(f, f.slice(0, 4));
    }

    #[test]
    #[should_panic(expected = "out of range")]
    fn slice_past_the_end_panics() {
        let span = unsafe { Span::<i32>::from_raw(0x1000, 10) };
        let _ = span.slice(5, 6);
    }
}
