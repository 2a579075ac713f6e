//! One kernel launch, optionally with programmatic dependent launch (PDL).
//!
//! cudarc's launch builder calls `cuLaunchKernel`, which takes no launch attributes; PDL needs
//! `cuLaunchKernelEx` with `CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`. This builder
//! collects the arguments as cudarc's does (the address of each value, which outlives the
//! launch) and launches through either. With PDL a kernel may be scheduled while the one
//! ahead of it finishes; every kernel begins by waiting for it (`pdl_begin` in `common.cuh`),
//! so only the launch latency and block scheduling overlap, never a read of unwritten data.

use std::ffi::c_void;
use std::marker::PhantomData;

use cudarc::driver::sys;
use cudarc::driver::{result, CudaFunction, CudaStream, DriverError, LaunchConfig};

use super::span::Span;

/// A value passed to a kernel by its address, as the C parameter of the same size.
///
/// # Safety
/// `addr` points at a value of exactly the size of the kernel parameter it stands for, alive
/// as long as `self`.
pub unsafe trait KernelArg {
    fn addr(&self) -> *mut c_void;
}

macro_rules! scalar_arg {
    ($($t:ty),*) => {
        // SAFETY: the value itself, of the C type's size (int, unsigned, float, long long).
        $(unsafe impl KernelArg for $t {
            fn addr(&self) -> *mut c_void {
                self as *const $t as *mut c_void
            }
        })*
    };
}

scalar_arg!(i32, u32, f32, i64, u64);

/// A span is passed as its device address: a 64-bit value, the ABI of a `T*` parameter.
// SAFETY: the span's own u64 field, alive as long as the span.
unsafe impl<T> KernelArg for Span<T> {
    fn addr(&self) -> *mut c_void {
        self.address() as *const u64 as *mut c_void
    }
}

pub struct Launch<'a> {
    stream: &'a CudaStream,
    func: &'a CudaFunction,
    programmatic: bool,
    args: Vec<*mut c_void>,
    _values: PhantomData<&'a ()>,
}

impl<'a> Launch<'a> {
    /// `func` on `stream`; `programmatic`: with PDL (only where the code waits for it: see
    /// [`crate::compat::programmatic_launch`]).
    pub fn new(stream: &'a CudaStream, func: &'a CudaFunction, programmatic: bool) -> Self {
        Self {
            stream,
            func,
            programmatic,
            args: Vec::new(),
            _values: PhantomData,
        }
    }

    /// The next parameter. `value` must live until the launch (the borrow says so).
    pub fn arg(&mut self, value: &'a impl KernelArg) -> &mut Self {
        self.args.push(value.addr());
        self
    }

    /// # Safety
    /// The arguments match the kernel's parameters in number, order and size, and `cfg`'s grid
    /// addresses only what they hold, as for cudarc's `LaunchArgs::launch`.
    pub unsafe fn launch(&mut self, cfg: LaunchConfig) -> Result<(), DriverError> {
        self.stream.context().bind_to_thread()?;
        if !self.programmatic {
            return result::launch_kernel(
                self.func.cu_function(),
                cfg.grid_dim,
                cfg.block_dim,
                cfg.shared_mem_bytes,
                self.stream.cu_stream(),
                &mut self.args,
            );
        }
        // SAFETY: a plain C union; zero is a valid value for every member.
        let mut value: sys::CUlaunchAttributeValue = std::mem::zeroed();
        value.programmaticStreamSerializationAllowed = 1;
        let mut attr = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value,
        };
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        sys::cuLaunchKernelEx(
            &config,
            self.func.cu_function(),
            self.args.as_mut_ptr(),
            std::ptr::null_mut(),
        )
        .result()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_are_the_addresses_of_their_values() {
        let (n, scale) = (7i32, 0.5f32);
        // SAFETY: never dereferenced.
        let span = unsafe { Span::<u16>::from_raw(0x1234_5678, 4) };
        for (addr, want) in [
            (n.addr(), &n as *const i32 as usize),
            (scale.addr(), &scale as *const f32 as usize),
        ] {
            assert_eq!(addr as usize, want);
        }
        // A span passes its device address: the 8 bytes at its argument's address.
        let bytes = unsafe { *(span.addr() as *const u64) };
        assert_eq!(bytes, 0x1234_5678);
    }
}
