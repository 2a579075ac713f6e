//! One step's activation memory: a bump allocator over device chunks, reset at each step.
//!
//! A step asks for the same sizes in the same order as the last step of the same shape, so
//! it gets the same addresses: a CUDA graph captured over a step reads and writes its
//! activations where the replayed step expects them, and no step allocates device memory
//! once the arena has grown to the largest step (no allocator call can land inside a
//! capture or stall a step). Chunks are never freed while the backend lives.

use anyhow::Result;
use infer_kernels::cuda::cudarc::driver::{CudaSlice, CudaStream};
use infer_kernels::cuda::Span;
use std::sync::Arc;

/// Alignment of every allocation: what cuBLAS and vectorised kernels like.
const ALIGN: usize = 256;
/// Smallest chunk: one step of a small model fits in one.
const MIN_CHUNK: usize = 64 << 20;

/// A position in the arena (see [`Arena::mark`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mark {
    chunk: usize,
    used: usize,
}

pub struct Arena {
    stream: Arc<CudaStream>,
    chunks: Vec<CudaSlice<u8>>,
    /// Chunk being filled and the bytes of it used.
    chunk: usize,
    used: usize,
    /// Whether a chunk was added since the last [`Arena::reset`].
    grew: bool,
}

impl Arena {
    pub fn new(stream: Arc<CudaStream>) -> Self {
        Self {
            stream,
            chunks: Vec::new(),
            chunk: 0,
            used: 0,
            grew: false,
        }
    }

    /// Starts a step: every earlier span is dead from here on.
    pub fn reset(&mut self) {
        self.chunk = 0;
        self.used = 0;
        self.grew = false;
    }

    /// Where the next allocation would go.
    pub fn mark(&self) -> Mark {
        Mark {
            chunk: self.chunk,
            used: self.used,
        }
    }

    /// Continues from `mark`: after replaying a graph, the step's later allocations (the
    /// logits) must not overlap what the graph's kernels wrote.
    pub fn restore(&mut self, mark: Mark) {
        self.chunk = mark.chunk;
        self.used = mark.used;
    }

    /// Whether this step needed a new chunk (a capture must not: it is redone after).
    pub fn grew(&self) -> bool {
        self.grew
    }

    pub fn bytes(&self) -> usize {
        self.chunks.iter().map(|c| c.len()).sum()
    }

    /// `len` elements of `T`, uninitialised.
    pub fn alloc<T>(&mut self, len: usize) -> Result<Span<T>> {
        let bytes = (len * std::mem::size_of::<T>())
            .max(1)
            .next_multiple_of(ALIGN);
        loop {
            if let Some(chunk) = self.chunks.get(self.chunk) {
                if self.used + bytes <= chunk.len() {
                    let base = Span::of(chunk).ptr();
                    let ptr = base + self.used as u64;
                    self.used += bytes;
                    // SAFETY: inside a live chunk the arena owns; aligned to ALIGN.
                    return Ok(unsafe { Span::from_raw(ptr, len) });
                }
                self.chunk += 1;
                self.used = 0;
                continue;
            }
            let size = bytes.max(MIN_CHUNK);
            // SAFETY: bytes only, written before they are read by the step's kernels.
            let chunk = unsafe { self.stream.alloc::<u8>(size) }?;
            self.chunks.push(chunk);
            self.chunk = self.chunks.len() - 1;
            self.used = 0;
            self.grew = true;
        }
    }
}
