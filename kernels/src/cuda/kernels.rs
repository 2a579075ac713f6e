//! Loaded kernels and their typed launch wrappers.
//!
//! Buffers are [`Span`]s (raw device addresses with a length): bf16 tensors as `Span<u16>`,
//! index arrays as `Span<i32>`, RoPE tables and logits as `Span<f32>`, all with the layouts of
//! [`crate::layout`] (the same as the CPU references). Each wrapper checks the span lengths
//! against the shapes it is given, then enqueues on the stream the kernels were loaded for.
//! Grids depend only on shapes, never on device data, and no wrapper allocates or
//! synchronises, so every launch can be captured into a CUDA graph and replayed with new data
//! written in place.
//!
//! Spans carry no mutability: a wrapper's doc says which spans it writes. Outputs must not
//! overlap inputs unless the wrapper says they may.

use std::collections::HashMap;
use std::fmt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use cudarc::cublas::result::CublasError;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DriverError, LaunchConfig};
use cudarc::nvrtc::Ptx;

use super::launch::Launch;
use super::nvrtc::{self, ComputeCapability};
use super::sources::{
    self, ATTENTION_WARPS, DECODE_MAX_GROUP, FLASH_WARPS, GEMV_MAX_ROWS, GEMV_WARPS,
};
use super::span::Span;
use crate::compat::{self, CodeTarget, Version};
use crate::decode_split;
use crate::layout::{AttentionConfig, KvCacheShape, KvDtype};
use crate::reference::RmsWeight;
use crate::sampling::MAX_TOP_LOGPROBS;

#[derive(Debug)]
pub enum KernelError {
    NvrtcMissing(&'static str),
    /// This machine cannot run the kernels on this GPU: what to install.
    Unsupported(String),
    Compile {
        source: &'static str,
        log: String,
    },
    Driver(DriverError),
    /// libcublas could not be loaded.
    CublasMissing,
    Cublas(CublasError),
}

impl fmt::Display for KernelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KernelError::NvrtcMissing(why) => write!(f, "NVRTC unavailable: {why}"),
            KernelError::Unsupported(why) => write!(f, "{why}"),
            KernelError::Compile { source, log } => write!(f, "compiling {source}.cu: {log}"),
            KernelError::Driver(e) => write!(f, "CUDA driver: {e}"),
            KernelError::CublasMissing => write!(f, "cuBLAS unavailable: libcublas not found"),
            KernelError::Cublas(e) => write!(f, "cuBLAS: {e}"),
        }
    }
}

impl std::error::Error for KernelError {}

impl From<DriverError> for KernelError {
    fn from(e: DriverError) -> Self {
        KernelError::Driver(e)
    }
}

impl From<CublasError> for KernelError {
    fn from(e: CublasError) -> Self {
        KernelError::Cublas(e)
    }
}

/// One layer's paged K/V pools on the device, each `shape.len()` elements of `dtype`, as raw
/// bytes (the kernels are picked by `dtype`).
#[derive(Clone, Copy, Debug)]
pub struct DeviceKv {
    pub k_cache: Span<u8>,
    pub v_cache: Span<u8>,
    pub dtype: KvDtype,
    pub shape: KvCacheShape,
}

impl DeviceKv {
    /// Pools of `dtype` allocated as bytes (the whole of each slice). The spans do not keep
    /// the slices alive (see [`Span::of`]).
    pub fn of(
        k_cache: &CudaSlice<u8>,
        v_cache: &CudaSlice<u8>,
        dtype: KvDtype,
        shape: KvCacheShape,
    ) -> Self {
        Self {
            k_cache: Span::of(k_cache),
            v_cache: Span::of(v_cache),
            dtype,
            shape,
        }
    }

    /// Panics unless both pools hold exactly `shape.len()` elements of `dtype`.
    fn check_len(&self) {
        let bytes = self.shape.len() * self.dtype.bytes();
        assert_eq!(self.k_cache.len(), bytes, "K pool bytes");
        assert_eq!(self.v_cache.len(), bytes, "V pool bytes");
    }
}

/// Block tables on the device, `[num_seqs, max_blocks_per_seq]`.
#[derive(Clone, Copy, Debug)]
pub struct DeviceBlockTables {
    pub table: Span<i32>,
    pub max_blocks_per_seq: usize,
}

/// The launch shapes, all decided here.
mod grid {
    use super::*;

    /// One block per row, threads striding over the row's `work` items: as many whole warps as
    /// there is work, up to 1024 (rows in these models are 1k–16k wide, so ≤ 16 strides).
    pub fn per_row(rows: usize, work: usize) -> LaunchConfig {
        let threads = work.div_ceil(32).clamp(1, 32) as u32 * 32;
        // The x dimension of a grid may be up to 2^31 - 1 blocks.
        assert!(
            rows > 0 && rows <= i32::MAX as usize,
            "{rows} rows out of range"
        );
        LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// Skinny GEMMs over `n` output columns, `per_warp` to a warp and `k_split` warps to a
    /// column group: [`GEMV_WARPS`] warps to a block.
    pub fn gemv(n: usize, per_warp: usize, k_split: usize) -> LaunchConfig {
        let groups_per_block = GEMV_WARPS as usize / k_split;
        let blocks = n.div_ceil(per_warp).div_ceil(groups_per_block);
        assert!(
            blocks > 0 && blocks <= i32::MAX as usize,
            "{n} columns out of range"
        );
        LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (GEMV_WARPS * 32, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// See [`Kernels::gemv_k_split`]: half of `sm_count` SMs' 64 warp slots.
    pub fn gemv_k_split(sm_count: usize, m: usize, n: usize, k: usize) -> usize {
        let groups = n.div_ceil(sources::gemv_columns(m)).max(1);
        let want = (sm_count * 32).div_ceil(groups).next_power_of_two();
        // Whole 32-word strides of a weight row, rounded down to a power of two.
        let strides = 1 << (k / 8 / 32).max(1).ilog2();
        want.min(GEMV_WARPS as usize).min(strides)
    }

    /// Threads per block of the flat element-wise kernels.
    pub const FLAT_THREADS: u32 = 256;
    /// At most this many blocks for flat kernels; they stride over the rest (4096 × 256 threads
    /// is several times what an H100 keeps resident).
    pub const FLAT_MAX_BLOCKS: usize = 4096;

    /// Flat element-wise kernels over `n` elements, grid-stride loops.
    pub fn flat(n: usize) -> LaunchConfig {
        let blocks = n.div_ceil(FLAT_THREADS as usize).clamp(1, FLAT_MAX_BLOCKS);
        LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (FLAT_THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// Attention: one block of `ATTENTION_WARPS` warps per (head, query token).
    pub fn attention(num_heads: usize, tokens: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (dim(num_heads), dim(tokens), 1),
            block_dim: (ATTENTION_WARPS * 32, 1, 1),
            shared_mem_bytes: 0, // the kernels' shared memory is static
        }
    }

    /// Query rows of one tensor-core prefill block (`FLASH_BLOCK_M` in `flash_prefill.cu`).
    pub const FLASH_BLOCK_M: usize = FLASH_WARPS as usize * 16;

    /// Tensor-core prefill: x over the query tiles (each sequence's tokens cut into tiles of
    /// [`FLASH_BLOCK_M`], at most `num_seqs` more than whole tiles of all tokens) plus at least
    /// one block that zeroes the padding rows; y over the heads.
    pub fn flash_prefill(num_heads: usize, num_tokens: usize, num_seqs: usize) -> LaunchConfig {
        let blocks = flash_prefill_blocks(num_tokens, num_seqs);
        assert!(blocks <= i32::MAX as usize, "{num_tokens} tokens");
        LaunchConfig {
            grid_dim: (blocks as u32, dim(num_heads), 1),
            block_dim: (FLASH_WARPS * 32, 1, 1),
            shared_mem_bytes: 0, // static
        }
    }

    /// Blocks along x of [`flash_prefill`]: enough for every sequence's tiles, and one more.
    pub fn flash_prefill_blocks(num_tokens: usize, num_seqs: usize) -> usize {
        num_tokens.div_ceil(FLASH_BLOCK_M) + num_seqs + 1
    }

    /// The largest y (or z) dimension of a grid.
    pub const MAX_Y: usize = 65_535;

    /// A y (or, for symmetry, x) grid dimension: at most [`MAX_Y`].
    fn dim(n: usize) -> u32 {
        assert!(n > 0 && n <= MAX_Y, "grid dimension {n} out of range");
        n as u32
    }
}

/// Kernel scalar arguments are C `int`s.
fn int(x: usize) -> i32 {
    i32::try_from(x).expect("kernel argument exceeds i32")
}

/// `len / width` for a span holding whole rows of `width`.
fn rows_of(len: usize, width: usize, what: &str) -> usize {
    assert!(width > 0, "{what}: zero row width");
    assert_eq!(
        len % width,
        0,
        "{what}: {len} elements is not whole rows of {width}"
    );
    len / width
}

/// Which kernel computes prefill attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillKernel {
    /// FlashAttention-2 style on the tensor cores (`flash_prefill.cu`): sm_80 and newer.
    Flash,
    /// One block per (head, query token) on the CUDA cores (`paged_attention.cu`): any GPU.
    Rows,
}

/// Which kernel computes decode attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeKernel {
    /// A block per (KV head, sequence, split) serving the KV head's whole query-head group:
    /// each K/V row read once per step. Groups of 2 to `DECODE_MAX_GROUP` heads.
    Grouped,
    /// A block per (query head, sequence, split): K/V rows read once per query head.
    PerHead,
}

impl DecodeKernel {
    /// Blocks per sequence and split: the pairs the split count has to fill the GPU with.
    fn blocks_per_seq(self, cfg: &AttentionConfig) -> usize {
        match self {
            DecodeKernel::Grouped => cfg.num_kv_heads,
            DecodeKernel::PerHead => cfg.num_heads,
        }
    }
}

/// The attention kernels of one head dimension.
struct AttentionFns {
    decode: CudaFunction,
    decode_grouped: CudaFunction,
    prefill: CudaFunction,
    /// The tensor-core prefill, where the device has bf16 `mma.sync` (sm_80+).
    flash_prefill: Option<CudaFunction>,
}

/// Every pool element the kernels are compiled for.
const KV_DTYPES: [KvDtype; 2] = [KvDtype::Bf16, KvDtype::Fp8E4m3];

// A split's fewest keys are one tile for each warp of an attention block.
const _: () = assert!(decode_split::MIN_SPLIT_KEYS == ATTENTION_WARPS as usize * 32);

/// Kernels compiled for one device and bound to one stream.
pub struct Kernels {
    stream: Arc<CudaStream>,
    pub arch: ComputeCapability,
    /// (head_dim, pool element) -> its attention kernels.
    attention: HashMap<(usize, KvDtype), AttentionFns>,
    /// Streaming multiprocessors: how many blocks fill the device (decode splits).
    sm_count: usize,
    /// The fused split merge's arrival counters ([`decode_split::SPLIT_COUNTERS`]), zero
    /// between launches (each launch's merging blocks reset theirs); one allocation for the
    /// kernels' life, so a captured graph keeps its address.
    split_counts: CudaSlice<i32>,
    /// Per pool element: the KV writers.
    reshape_and_cache: HashMap<KvDtype, CudaFunction>,
    qkv_rope_cache: HashMap<KvDtype, CudaFunction>,
    rms_norm: CudaFunction,
    fused_add_rms_norm: CudaFunction,
    rope_neox: CudaFunction,
    silu_and_mul: CudaFunction,
    gelu_tanh_and_mul: CudaFunction,
    gelu_erf_and_mul: CudaFunction,
    embedding: CudaFunction,
    gather_rows: CudaFunction,
    copy_columns: CudaFunction,
    add: CudaFunction,
    bias_add: CudaFunction,
    logits_f32: CudaFunction,
    read_only: CudaFunction,
    sample_rows: CudaFunction,
    /// The skinny GEMMs, by row count - 1.
    gemv: Vec<CudaFunction>,
    /// Whether launches use programmatic dependent launch ([`Self::set_programmatic_launch`]).
    programmatic: AtomicBool,
    /// Whether the loaded code and the driver allow it ([`compat::programmatic_launch`]).
    programmatic_supported: bool,
}

impl Kernels {
    /// Compile every source with NVRTC for the stream's device and load it (no cache).
    pub fn load(stream: Arc<CudaStream>) -> Result<Self, KernelError> {
        Self::load_cached(stream, None)
    }

    /// [`Self::load`], keeping what NVRTC produced in `cache` (a directory) and reusing it:
    /// a cubin for the device's architecture when NVRTC knows it, else PTX for the newest it
    /// knows below (the driver compiles that); the driver's and NVRTC's versions are checked
    /// first ([`compat::choose_target`]).
    pub fn load_cached(stream: Arc<CudaStream>, cache: Option<&Path>) -> Result<Self, KernelError> {
        nvrtc::ensure_loaded().map_err(KernelError::NvrtcMissing)?;
        let ctx = stream.context().clone();
        let (major, minor) = ctx.compute_capability()?;
        let arch = ComputeCapability {
            major: major as u32,
            minor: minor as u32,
        };
        let (nv_major, nv_minor) = nvrtc::nvrtc_version();
        let target = compat::choose_target(
            compat::arch_code(arch.major, arch.minor),
            Version(nv_major, nv_minor),
            &nvrtc::supported_archs(),
            nvrtc::driver_version()?,
        )
        .map_err(KernelError::Unsupported)?;
        let mut functions = HashMap::new();
        for source in sources::ALL {
            let code = nvrtc::compile_cached(&source, target, cache).map_err(|log| {
                KernelError::Compile {
                    source: source.name,
                    log,
                }
            })?;
            let module = ctx.load_module(match target {
                CodeTarget::Cubin(_) => Ptx::from_binary(code),
                CodeTarget::Ptx(_) => Ptx::from_src(String::from_utf8_lossy(&code)),
            })?;
            for &name in source.entry_points {
                functions.insert(name, module.load_function(name)?);
            }
        }
        let mut take = |name: &str| {
            functions
                .remove(name)
                .expect("entry point listed in sources")
        };
        let mut attention = HashMap::new();
        for &d in &sources::ATTENTION_HEAD_DIMS {
            for kv in KV_DTYPES {
                let names = sources::attention_entry_points(d, kv).unwrap();
                let flash = take(sources::flash_prefill_entry_point(d, kv).unwrap());
                let fns = AttentionFns {
                    decode: take(names.decode),
                    decode_grouped: take(names.decode_grouped),
                    prefill: take(names.prefill),
                    // The kernel's tensor-core body is compiled only for sm_80+ targets (a PTX
                    // fallback for an older virtual architecture gets a trap).
                    flash_prefill: (target.arch() >= 80).then_some(flash),
                };
                attention.insert((d, kv), fns);
            }
        }
        let (mut reshape_and_cache, mut qkv_rope_cache) = (HashMap::new(), HashMap::new());
        for kv in KV_DTYPES {
            let (reshape, fused) = sources::kv_cache_entry_points(kv);
            reshape_and_cache.insert(kv, take(reshape));
            qkv_rope_cache.insert(kv, take(fused));
        }
        let sm_count = ctx.attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )? as usize;
        let split_counts = stream.alloc_zeros::<i32>(decode_split::SPLIT_COUNTERS)?;
        let programmatic_supported =
            compat::programmatic_launch(target.arch(), nvrtc::driver_version()?)
                && std::env::var("INFER_PDL").map_or(true, |v| v != "0");
        let mut kernels = Self {
            arch,
            attention,
            sm_count,
            split_counts,
            reshape_and_cache,
            qkv_rope_cache,
            rms_norm: take("rms_norm_bf16"),
            fused_add_rms_norm: take("fused_add_rms_norm_bf16"),
            rope_neox: take("rope_neox_bf16"),
            silu_and_mul: take("silu_and_mul_bf16"),
            gelu_tanh_and_mul: take("gelu_tanh_and_mul_bf16"),
            gelu_erf_and_mul: take("gelu_erf_and_mul_bf16"),
            embedding: take("embedding_bf16"),
            gather_rows: take("gather_rows_bf16"),
            copy_columns: take("copy_columns_bf16"),
            add: take("add_bf16"),
            bias_add: take("bias_add_bf16"),
            logits_f32: take("logits_f32"),
            read_only: take("read_only_u128"),
            sample_rows: take("sample_rows_f32"),
            gemv: (1..=GEMV_MAX_ROWS)
                .map(|rows| take(sources::gemv_entry_point(rows).unwrap()))
                .collect(),
            programmatic: AtomicBool::new(programmatic_supported),
            programmatic_supported,
            stream,
        };
        if kernels.programmatic_supported && !kernels.programmatic_launch_works() {
            kernels.programmatic_supported = false;
            kernels.set_programmatic_launch(false);
        }
        Ok(kernels)
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Launches from now on with programmatic dependent launch, or not; only where the code
    /// and the driver allow it (sm_90+ code, a CUDA 12.3+ driver that ran a probe launch at
    /// load, `INFER_PDL` not `0`), which is the default. Graphs captured before keep how they were launched.
    pub fn set_programmatic_launch(&self, on: bool) {
        self.programmatic
            .store(on && self.programmatic_supported, Ordering::Relaxed);
    }

    /// Whether launches use programmatic dependent launch.
    pub fn programmatic_launch(&self) -> bool {
        self.programmatic.load(Ordering::Relaxed)
    }

    /// Whether launches with programmatic dependent launch really run here, eagerly and
    /// captured into a graph: the versions may allow what a setup (MPS, a virtual GPU)
    /// refuses. A one-element add, launched twice, then once in a throwaway graph.
    fn programmatic_launch_works(&self) -> bool {
        let probe = || -> Result<(), DriverError> {
            let x = self.stream.alloc_zeros::<u16>(1)?;
            let span = Span::of(&x);
            self.add(span, span)?;
            self.add(span, span)?;
            self.stream.synchronize()?;
            self.stream.begin_capture(
                cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )?;
            let launched = self.add(span, span);
            let graph = self
                .stream
                .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0));
            launched?;
            if let Some(graph) = graph? {
                graph.launch()?;
            }
            self.stream.synchronize()
        };
        probe().is_ok()
    }

    fn launch<'a>(&'a self, func: &'a CudaFunction) -> Launch<'a> {
        Launch::new(&self.stream, func, self.programmatic_launch())
    }

    fn attention_fns(&self, cfg: &AttentionConfig, kv: &DeviceKv) -> &AttentionFns {
        assert_eq!(kv.shape.head_dim, cfg.head_dim);
        assert_eq!(kv.shape.num_kv_heads, cfg.num_kv_heads);
        kv.check_len();
        // The kernels read key rows with 16-byte loads (8-byte from fp8 pools).
        assert!(
            kv.k_cache.ptr().is_multiple_of(16) && kv.v_cache.ptr().is_multiple_of(16),
            "KV pools must be 16-byte aligned"
        );
        self.attention
            .get(&(cfg.head_dim, kv.dtype))
            .unwrap_or_else(|| {
                panic!(
                    "head_dim {} not in {:?}",
                    cfg.head_dim,
                    sources::ATTENTION_HEAD_DIMS
                )
            })
    }

    /// The decode kernel [`Self::paged_attention_decode`] runs for `cfg`: the grouped one
    /// where query heads share KV heads in groups it serves, else one block per query head.
    pub fn decode_kernel(cfg: &AttentionConfig) -> DecodeKernel {
        let group = cfg.num_heads / cfg.num_kv_heads;
        if (2..=DECODE_MAX_GROUP).contains(&group) {
            DecodeKernel::Grouped
        } else {
            DecodeKernel::PerHead
        }
    }

    /// How many splits a decode step of `num_seqs` sequences over `tables` runs in on this
    /// device with [`Self::decode_kernel`] ([`crate::decode_split::split_count`]): depends
    /// only on the shapes, so a captured graph keeps its grid; the kernel cuts each split's
    /// keys from the real context.
    pub fn decode_splits(
        &self,
        num_seqs: usize,
        tables: &DeviceBlockTables,
        cfg: &AttentionConfig,
        block_size: usize,
    ) -> usize {
        self.decode_splits_with(Self::decode_kernel(cfg), num_seqs, tables, cfg, block_size)
    }

    /// [`Self::decode_splits`] for the kernel named.
    pub fn decode_splits_with(
        &self,
        kernel: DecodeKernel,
        num_seqs: usize,
        tables: &DeviceBlockTables,
        cfg: &AttentionConfig,
        block_size: usize,
    ) -> usize {
        let max_keys = tables.max_blocks_per_seq * block_size;
        decode_split::split_count(
            self.sm_count,
            kernel.blocks_per_seq(cfg),
            num_seqs,
            max_keys,
        )
    }

    /// f32s of scratch [`Self::paged_attention_decode`] needs for `splits` (0 for one split).
    pub fn decode_scratch_len(num_seqs: usize, cfg: &AttentionConfig, splits: usize) -> usize {
        if splits <= 1 {
            0
        } else {
            num_seqs * cfg.num_heads * splits * (cfg.head_dim + 2)
        }
    }

    /// Decode attention, see [`crate::reference::paged_attention_decode`], with
    /// [`Self::decode_kernel`].
    /// Writes `out`; `q`, `out`: `[num_seqs, num_heads, head_dim]`; `seq_lens`: `[num_seqs]`
    /// (≤ 0: padding, its `out` row is zeros). Block ids outside the pool are skipped.
    /// `splits` from [`Self::decode_splits`]; `scratch` holds at least
    /// [`Self::decode_scratch_len`] f32s (any span when `splits` is 1).
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention_decode(
        &self,
        out: Span<u16>,
        q: Span<u16>,
        kv: &DeviceKv,
        tables: &DeviceBlockTables,
        seq_lens: Span<i32>,
        cfg: &AttentionConfig,
        splits: usize,
        scratch: Span<f32>,
    ) -> Result<(), DriverError> {
        let kernel = Self::decode_kernel(cfg);
        self.paged_attention_decode_with(kernel, out, q, kv, tables, seq_lens, cfg, splits, scratch)
    }

    /// [`Self::paged_attention_decode`] with the kernel named (`splits` from
    /// [`Self::decode_splits_with`] for it): tests and benchmarks compare the two. Panics if
    /// `kernel` is [`DecodeKernel::Grouped`] and the group is wider than it serves.
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention_decode_with(
        &self,
        kernel: DecodeKernel,
        out: Span<u16>,
        q: Span<u16>,
        kv: &DeviceKv,
        tables: &DeviceBlockTables,
        seq_lens: Span<i32>,
        cfg: &AttentionConfig,
        splits: usize,
        scratch: Span<f32>,
    ) -> Result<(), DriverError> {
        let fns = self.attention_fns(cfg, kv);
        if kernel == DecodeKernel::Grouped {
            assert!(
                cfg.num_heads / cfg.num_kv_heads <= DECODE_MAX_GROUP,
                "grouped decode serves at most {DECODE_MAX_GROUP} query heads per KV head"
            );
        }
        let num_seqs = seq_lens.len();
        assert_eq!(q.len(), num_seqs * cfg.num_heads * cfg.head_dim);
        assert_eq!(out.len(), q.len());
        assert!(tables.table.len() >= num_seqs * tables.max_blocks_per_seq);
        assert!(
            (1..=decode_split::MAX_SPLITS).contains(&splits),
            "decode splits {splits}"
        );
        assert!(scratch.len() >= Self::decode_scratch_len(num_seqs, cfg, splits));
        let counts = Span::of(&self.split_counts);
        assert!(
            splits == 1 || num_seqs * kernel.blocks_per_seq(cfg) <= counts.len(),
            "a split decode of {num_seqs} sequences has more pairs than merge counters"
        );
        let (max_blocks, num_blocks, num_heads, num_kv_heads, block_size) = (
            int(tables.max_blocks_per_seq),
            int(kv.shape.num_blocks),
            int(cfg.num_heads),
            int(cfg.num_kv_heads),
            int(kv.shape.block_size),
        );
        let (window, softcap) = (cfg.window_arg(), cfg.softcap_arg());
        let mut launch = self.launch(match kernel {
            DecodeKernel::Grouped => &fns.decode_grouped,
            DecodeKernel::PerHead => &fns.decode,
        });
        launch
            .arg(&out)
            .arg(&scratch)
            .arg(&counts)
            .arg(&q)
            .arg(&kv.k_cache)
            .arg(&kv.v_cache)
            .arg(&tables.table)
            .arg(&seq_lens)
            .arg(&max_blocks)
            .arg(&num_blocks)
            .arg(&num_heads)
            .arg(&num_kv_heads)
            .arg(&block_size)
            .arg(&cfg.scale)
            .arg(&window)
            .arg(&softcap);
        let mut grid = grid::attention(kernel.blocks_per_seq(cfg), num_seqs);
        grid.grid_dim.2 = splits as u32;
        // SAFETY: argument order and types match paged_attention_decode_bf16[_kvfp8]_d* and
        // paged_attention_decode_grouped_bf16[_kvfp8]_d* (the same parameters; the pools'
        // element picked the functions, attention_fns); lengths checked (the
        // scratch holds every split's state of every query head, the counters one per
        // (sequence, block column) of a split launch), and the kernels bound every
        // device-side index (block ids, table row).
        unsafe { launch.launch(grid) }?;
        Ok(())
    }

    /// The prefill kernel [`Self::paged_attention_prefill`] runs on this device: the
    /// tensor-core one where there is one.
    pub fn prefill_kernel(&self) -> PrefillKernel {
        let any = self.attention.values().next();
        if any.is_some_and(|fns| fns.flash_prefill.is_some()) {
            PrefillKernel::Flash
        } else {
            PrefillKernel::Rows
        }
    }

    /// Prefill attention, see [`crate::reference::paged_attention_prefill`], with
    /// [`Self::prefill_kernel`].
    /// Writes `out`; `q`, `out`: `[num_tokens, num_heads, head_dim]`; `cu_seqlens_q`:
    /// `[num_seqs + 1]`; `start_pos`: `[num_seqs]`. Tokens past `cu_seqlens_q[num_seqs]` are
    /// padding (their `out` rows are zeros).
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention_prefill(
        &self,
        out: Span<u16>,
        q: Span<u16>,
        kv: &DeviceKv,
        tables: &DeviceBlockTables,
        cu_seqlens_q: Span<i32>,
        start_pos: Span<i32>,
        cfg: &AttentionConfig,
    ) -> Result<(), DriverError> {
        let kernel = self.prefill_kernel();
        self.paged_attention_prefill_with(kernel, out, q, kv, tables, cu_seqlens_q, start_pos, cfg)
    }

    /// [`Self::paged_attention_prefill`] with the kernel named: tests and benchmarks compare the
    /// two. Panics if `kernel` is [`PrefillKernel::Flash`] on a device older than sm_80.
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention_prefill_with(
        &self,
        kernel: PrefillKernel,
        out: Span<u16>,
        q: Span<u16>,
        kv: &DeviceKv,
        tables: &DeviceBlockTables,
        cu_seqlens_q: Span<i32>,
        start_pos: Span<i32>,
        cfg: &AttentionConfig,
    ) -> Result<(), DriverError> {
        let fns = self.attention_fns(cfg, kv);
        let prefill = match kernel {
            PrefillKernel::Rows => &fns.prefill,
            PrefillKernel::Flash => fns
                .flash_prefill
                .as_ref()
                .expect("the tensor-core prefill needs sm_80 or newer"),
        };
        let row = cfg.num_heads * cfg.head_dim;
        let num_seqs = start_pos.len();
        assert!(num_seqs > 0, "prefill needs at least one sequence");
        assert_eq!(cu_seqlens_q.len(), num_seqs + 1);
        let num_tokens = rows_of(q.len(), row, "prefill q");
        assert_eq!(out.len(), q.len());
        assert!(tables.table.len() >= num_seqs * tables.max_blocks_per_seq);
        let (seqs, tokens, max_blocks, num_blocks, num_heads, num_kv_heads, block_size) = (
            int(num_seqs),
            int(num_tokens),
            int(tables.max_blocks_per_seq),
            int(kv.shape.num_blocks),
            int(cfg.num_heads),
            int(cfg.num_kv_heads),
            int(kv.shape.block_size),
        );
        let (window, softcap) = (cfg.window_arg(), cfg.softcap_arg());
        let mut launch = self.launch(prefill);
        launch
            .arg(&out)
            .arg(&q)
            .arg(&kv.k_cache)
            .arg(&kv.v_cache)
            .arg(&tables.table)
            .arg(&cu_seqlens_q)
            .arg(&start_pos)
            .arg(&seqs)
            .arg(&tokens)
            .arg(&max_blocks)
            .arg(&num_blocks)
            .arg(&num_heads)
            .arg(&num_kv_heads)
            .arg(&block_size)
            .arg(&cfg.scale)
            .arg(&window)
            .arg(&softcap);
        let grid = match kernel {
            // Blocks stride over the tokens past the grid's y limit.
            PrefillKernel::Rows => grid::attention(cfg.num_heads, num_tokens.min(grid::MAX_Y)),
            PrefillKernel::Flash => {
                // Q and out are read and written as bf16 pairs.
                assert!(
                    q.ptr().is_multiple_of(4) && out.ptr().is_multiple_of(4),
                    "prefill q and out must be 4-byte aligned"
                );
                grid::flash_prefill(cfg.num_heads, num_tokens, num_seqs)
            }
        };
        // SAFETY: argument order and types match paged_attention_prefill_bf16[_kvfp8]_d* and
        // flash_prefill_bf16[_kvfp8]_d* (the same parameters; the pools' element picked the
        // functions); lengths checked, and the kernels bound
        // every device-side index (block ids, table row).
        unsafe { launch.launch(grid) }.map(drop)
    }

    /// Write new K/V (`[num_tokens, num_kv_heads, head_dim]`, bf16) into the pools of `kv`
    /// (written; an fp8 pool rounds each value) at `slot_mapping` (`[num_tokens]`). A slot
    /// outside `[0, shape.num_slots())` (padding: -1) is skipped.
    pub fn reshape_and_cache(
        &self,
        key: Span<u16>,
        value: Span<u16>,
        kv: &DeviceKv,
        slot_mapping: Span<i32>,
    ) -> Result<(), DriverError> {
        let shape = &kv.shape;
        let token_len = shape.num_kv_heads * shape.head_dim;
        let num_tokens = slot_mapping.len();
        assert_eq!(key.len(), num_tokens * token_len);
        assert_eq!(value.len(), key.len());
        kv.check_len();
        let (token_len_arg, num_slots) = (int(token_len), int(shape.num_slots()));
        let mut launch = self.launch(&self.reshape_and_cache[&kv.dtype]);
        launch
            .arg(&key)
            .arg(&value)
            .arg(&kv.k_cache)
            .arg(&kv.v_cache)
            .arg(&slot_mapping)
            .arg(&token_len_arg)
            .arg(&num_slots);
        // SAFETY: matches reshape_and_cache_bf16[_kvfp8] (the pools' element is kv.dtype, their
        // lengths checked); the kernel skips slots outside the pool.
        unsafe { launch.launch(grid::per_row(num_tokens, token_len)) }.map(drop)
    }

    /// A fused QKV product's parts as attention takes them, in one launch (see
    /// [`crate::reference::qkv_rope_and_cache`]): `q_out` (written, `[tokens, num_heads *
    /// head_dim]`) is Q rotated at `positions`, and K rotated and V are written into the pools
    /// at `slot_mapping` (slots outside the pool skipped; an fp8 pool rounds each value).
    /// `qkv`: `[tokens, (num_heads + 2 * num_kv_heads) * head_dim]`; `cos`, `sin`:
    /// `[max_positions, head_dim / 2]`.
    #[allow(clippy::too_many_arguments)]
    pub fn qkv_rope_and_cache(
        &self,
        q_out: Span<u16>,
        qkv: Span<u16>,
        kv: &DeviceKv,
        positions: Span<i32>,
        slot_mapping: Span<i32>,
        cos: Span<f32>,
        sin: Span<f32>,
        num_heads: usize,
    ) -> Result<(), DriverError> {
        let shape = &kv.shape;
        let (d, num_tokens) = (shape.head_dim, positions.len());
        let (nq, nkv) = (num_heads * d, shape.num_kv_heads * d);
        assert_eq!(qkv.len(), num_tokens * (nq + 2 * nkv));
        assert_eq!(q_out.len(), num_tokens * nq);
        assert_eq!(slot_mapping.len(), num_tokens);
        kv.check_len();
        let max_positions = rows_of(cos.len(), d / 2, "rope cos");
        assert_eq!(sin.len(), cos.len());
        let (heads, kv_heads, dim, positions_arg, num_slots) = (
            int(num_heads),
            int(shape.num_kv_heads),
            int(d),
            int(max_positions),
            int(shape.num_slots()),
        );
        let mut launch = self.launch(&self.qkv_rope_cache[&kv.dtype]);
        launch
            .arg(&qkv)
            .arg(&q_out)
            .arg(&kv.k_cache)
            .arg(&kv.v_cache)
            .arg(&positions)
            .arg(&slot_mapping)
            .arg(&cos)
            .arg(&sin)
            .arg(&heads)
            .arg(&kv_heads)
            .arg(&dim)
            .arg(&positions_arg)
            .arg(&num_slots);
        let pairs = (num_heads + shape.num_kv_heads) * d / 2;
        // SAFETY: matches qkv_rope_cache_bf16[_kvfp8] (the pools' element is kv.dtype); lengths
        // checked, and the kernel bounds the positions and the slots.
        unsafe { launch.launch(grid::per_row(num_tokens, pairs)) }.map(drop)
    }

    /// RMSNorm of each `weight.len()`-wide row of `x` into `out` (written).
    pub fn rms_norm(
        &self,
        out: Span<u16>,
        x: Span<u16>,
        weight: Span<u16>,
        eps: f32,
        style: RmsWeight,
    ) -> Result<(), DriverError> {
        let hidden = weight.len();
        let rows = rows_of(x.len(), hidden, "rms_norm x");
        assert_eq!(out.len(), x.len());
        let (hidden_arg, one_plus) = (int(hidden), (style == RmsWeight::OnePlus) as i32);
        let mut launch = self.launch(&self.rms_norm);
        launch
            .arg(&out)
            .arg(&x)
            .arg(&weight)
            .arg(&hidden_arg)
            .arg(&eps)
            .arg(&one_plus);
        // SAFETY: matches rms_norm_bf16; block size is a multiple of 32 as block_sum requires.
        unsafe { launch.launch(grid::per_row(rows, hidden)) }.map(drop)
    }

    /// `residual = bf16(residual + x)` (written), then `out = rms_norm(residual)` (written), see
    /// [`crate::reference::fused_add_rms_norm`]. All `[rows, weight.len()]`. `out` may be `x`;
    /// it must not overlap `residual`.
    pub fn fused_add_rms_norm(
        &self,
        out: Span<u16>,
        residual: Span<u16>,
        x: Span<u16>,
        weight: Span<u16>,
        eps: f32,
        style: RmsWeight,
    ) -> Result<(), DriverError> {
        let hidden = weight.len();
        let rows = rows_of(x.len(), hidden, "fused_add_rms_norm x");
        assert_eq!(residual.len(), x.len());
        assert_eq!(out.len(), x.len());
        let (hidden_arg, one_plus) = (int(hidden), (style == RmsWeight::OnePlus) as i32);
        let mut launch = self.launch(&self.fused_add_rms_norm);
        launch
            .arg(&out)
            .arg(&residual)
            .arg(&x)
            .arg(&weight)
            .arg(&hidden_arg)
            .arg(&eps)
            .arg(&one_plus);
        // SAFETY: matches fused_add_rms_norm_bf16; block size is a multiple of 32.
        unsafe { launch.launch(grid::per_row(rows, hidden)) }.map(drop)
    }

    /// NeoX RoPE in place on `q` (`[num_tokens, num_heads, head_dim]`) and `k`
    /// (`[num_tokens, num_kv_heads, head_dim]`), both written; `cos`, `sin`:
    /// `[max_positions, head_dim / 2]`. A position outside `[0, max_positions)` leaves its
    /// token unchanged.
    #[allow(clippy::too_many_arguments)]
    pub fn rope_neox(
        &self,
        q: Span<u16>,
        k: Span<u16>,
        positions: Span<i32>,
        cos: Span<f32>,
        sin: Span<f32>,
        num_heads: usize,
        num_kv_heads: usize,
    ) -> Result<(), DriverError> {
        let num_tokens = positions.len();
        let head_dim = q.len() / (num_tokens * num_heads);
        assert_eq!(q.len(), num_tokens * num_heads * head_dim);
        assert_eq!(k.len(), num_tokens * num_kv_heads * head_dim);
        let max_positions = rows_of(cos.len(), head_dim / 2, "rope cos");
        assert_eq!(sin.len(), cos.len());
        let (heads, kv_heads, dim, positions_arg) = (
            int(num_heads),
            int(num_kv_heads),
            int(head_dim),
            int(max_positions),
        );
        let mut launch = self.launch(&self.rope_neox);
        launch
            .arg(&q)
            .arg(&k)
            .arg(&positions)
            .arg(&cos)
            .arg(&sin)
            .arg(&heads)
            .arg(&kv_heads)
            .arg(&dim)
            .arg(&positions_arg);
        let pairs = (num_heads + num_kv_heads) * head_dim / 2;
        // SAFETY: matches rope_neox_bf16; the kernel bounds the positions.
        unsafe { launch.launch(grid::per_row(num_tokens, pairs)) }.map(drop)
    }

    /// `out = silu(gate) * up` (written, `[rows, inter]`) for `gate_up` rows
    /// `[gate (inter) ++ up (inter)]`.
    pub fn silu_and_mul(
        &self,
        out: Span<u16>,
        gate_up: Span<u16>,
        inter: usize,
    ) -> Result<(), DriverError> {
        self.gated(&self.silu_and_mul, out, gate_up, inter)
    }

    /// `out = gelu_tanh(gate) * up` (Gemma's `gelu_pytorch_tanh`).
    pub fn gelu_tanh_and_mul(
        &self,
        out: Span<u16>,
        gate_up: Span<u16>,
        inter: usize,
    ) -> Result<(), DriverError> {
        self.gated(&self.gelu_tanh_and_mul, out, gate_up, inter)
    }

    /// `out = gelu_erf(gate) * up` (exact GELU).
    pub fn gelu_erf_and_mul(
        &self,
        out: Span<u16>,
        gate_up: Span<u16>,
        inter: usize,
    ) -> Result<(), DriverError> {
        self.gated(&self.gelu_erf_and_mul, out, gate_up, inter)
    }

    fn gated(
        &self,
        function: &CudaFunction,
        out: Span<u16>,
        gate_up: Span<u16>,
        inter: usize,
    ) -> Result<(), DriverError> {
        assert_eq!(gate_up.len(), 2 * out.len());
        let (rows, inter_arg) = (rows_of(out.len(), inter, "gated out"), int(inter));
        let mut launch = self.launch(function);
        launch.arg(&out).arg(&gate_up).arg(&inter_arg);
        // SAFETY: matches silu_and_mul_bf16 / gelu_{tanh,erf}_and_mul_bf16.
        unsafe { launch.launch(grid::per_row(rows, inter)) }.map(drop)
    }

    /// Token embedding into `out` (written, `[ids.len(), hidden]`): row `i` is
    /// `table[ids[i]] * scale` (`table`: `[vocab, hidden]`), zeros for an id outside
    /// `[0, vocab)`. See [`crate::reference::embedding`].
    pub fn embedding(
        &self,
        out: Span<u16>,
        table: Span<u16>,
        ids: Span<i32>,
        hidden: usize,
        scale: f32,
    ) -> Result<(), DriverError> {
        let n = ids.len();
        assert_eq!(out.len(), n * hidden);
        let vocab = rows_of(table.len(), hidden, "embedding table");
        let (n_arg, hidden_arg, vocab_arg) = (int(n), int(hidden), int(vocab));
        let mut launch = self.launch(&self.embedding);
        launch
            .arg(&out)
            .arg(&table)
            .arg(&ids)
            .arg(&n_arg)
            .arg(&hidden_arg)
            .arg(&vocab_arg)
            .arg(&scale);
        // SAFETY: matches embedding_bf16; the kernel bounds the ids.
        unsafe { launch.launch(grid::per_row(n, hidden)) }.map(drop)
    }

    /// Residual add: `x = bf16(x + y)` (`x` written), same length.
    pub fn add(&self, x: Span<u16>, y: Span<u16>) -> Result<(), DriverError> {
        assert_eq!(x.len(), y.len());
        let n = int(x.len());
        let mut launch = self.launch(&self.add);
        launch.arg(&x).arg(&y).arg(&n);
        // SAFETY: matches add_bf16 (a grid-stride loop bounded by n).
        unsafe { launch.launch(grid::flat(x.len())) }.map(drop)
    }

    /// Reads every byte of `src` (a whole number of 16-byte words, 16-byte aligned) once and
    /// writes a word per warp to `sink` ([`Self::read_only_sink_len`] words): what a
    /// read-only kernel reaches is the bandwidth ceiling of a decode step.
    pub fn read_only(&self, src: Span<u8>, sink: Span<u32>) -> Result<(), DriverError> {
        assert!(
            src.len().is_multiple_of(16) && src.ptr().is_multiple_of(16),
            "16-byte words"
        );
        assert!(sink.len() >= Self::read_only_sink_len());
        let words = src.len() as i64 / 16;
        let mut launch = self.launch(&self.read_only);
        launch.arg(&src).arg(&words).arg(&sink);
        // SAFETY: matches read_only_u128 (a grid-stride loop bounded by the word count; one
        // sink word per warp of the fixed grid).
        unsafe { launch.launch(grid::flat(usize::MAX)) }.map(drop)
    }

    /// Whether [`Self::gemv_bf16`] takes `x[m, k] @ w^T`: 1..=[`GEMV_MAX_ROWS`] rows, `k` a
    /// multiple of 8 and both operands 16-byte aligned (the kernel reads 16-byte words).
    pub fn gemv_applies(x: Span<u16>, w: Span<u16>, m: usize, k: usize) -> bool {
        (1..=GEMV_MAX_ROWS).contains(&m)
            && k.is_multiple_of(8)
            && x.ptr().is_multiple_of(16)
            && w.ptr().is_multiple_of(16)
    }

    /// `out[m, n] = x[m, k] @ w[n, k]^T` (row-major, `out` written), bf16 in and out, f32
    /// accumulation, for the few rows of a decode batch ([`Self::gemv_applies`]): warps
    /// streaming their output columns' weight rows, where cuBLAS may stay below the bandwidth
    /// a read-only kernel reaches; each column's k split over [`Self::gemv_k_split`] warps.
    /// See [`crate::reference::matmul_xwt`].
    pub fn gemv_bf16(
        &self,
        out: Span<u16>,
        x: Span<u16>,
        w: Span<u16>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<(), DriverError> {
        let k_split = self.gemv_k_split(m, n, k);
        self.gemv_bf16_split(out, x, w, m, n, k, k_split)
    }

    /// Warps sharing each column group of [`Self::gemv_bf16`]: enough for the matrix to keep
    /// about half of every SM's warp slots busy (a narrow one has too few column groups to),
    /// a power of two up to [`GEMV_WARPS`], and no more than k has 32-word strides for.
    pub fn gemv_k_split(&self, m: usize, n: usize, k: usize) -> usize {
        grid::gemv_k_split(self.sm_count, m, n, k)
    }

    /// [`Self::gemv_bf16`] with `k_split` warps per column group (a power of two up to
    /// [`GEMV_WARPS`]).
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_bf16_split(
        &self,
        out: Span<u16>,
        x: Span<u16>,
        w: Span<u16>,
        m: usize,
        n: usize,
        k: usize,
        k_split: usize,
    ) -> Result<(), DriverError> {
        assert!(
            k_split.is_power_of_two() && k_split <= GEMV_WARPS as usize,
            "k_split {k_split}"
        );
        assert!(
            Self::gemv_applies(x, w, m, k),
            "gemv of {m} rows, k = {k}: needs 1..={GEMV_MAX_ROWS} rows, k % 8 == 0, aligned"
        );
        super::gemm::check_xwt_shapes(out, x, w, m, n, k);
        let (n_arg, k_arg, split_arg) = (int(n), int(k), int(k_split));
        let mut launch = self.launch(&self.gemv[m - 1]);
        launch
            .arg(&out)
            .arg(&w)
            .arg(&x)
            .arg(&n_arg)
            .arg(&k_arg)
            .arg(&split_arg);
        // SAFETY: matches gemv_bf16_m{m}: the spans hold the [m, k], [n, k] and [m, n] the
        // kernel addresses (checked above); columns past n - 1 read row n - 1 and write
        // nothing; k_split divides the block's warps.
        unsafe { launch.launch(grid::gemv(n, sources::gemv_columns(m), k_split)) }.map(drop)
    }

    /// Words of the sink [`Self::read_only`] writes.
    pub const fn read_only_sink_len() -> usize {
        grid::FLAT_MAX_BLOCKS * grid::FLAT_THREADS as usize / 32
    }

    /// `x[r, c] = bf16(x[r, c] + bias[c])` (`x` written, `[rows, bias.len()]`).
    pub fn bias_add(&self, x: Span<u16>, bias: Span<u16>) -> Result<(), DriverError> {
        let cols = bias.len();
        let rows = rows_of(x.len(), cols, "bias_add x");
        let (rows_arg, cols_arg) = (int(rows), int(cols));
        let mut launch = self.launch(&self.bias_add);
        launch.arg(&x).arg(&bias).arg(&rows_arg).arg(&cols_arg);
        // SAFETY: matches bias_add_bf16.
        unsafe { launch.launch(grid::per_row(rows, cols)) }.map(drop)
    }

    /// `out = x[:, col0 .. col0 + width]` (written, `[rows, width]`) for `x`: `[rows, cols]`;
    /// `width = out.len() / rows`. Splits a fused QKV or gate/up product.
    pub fn copy_columns(
        &self,
        out: Span<u16>,
        x: Span<u16>,
        cols: usize,
        col0: usize,
    ) -> Result<(), DriverError> {
        let rows = rows_of(x.len(), cols, "copy_columns x");
        let width = rows_of(out.len(), rows, "copy_columns out");
        assert!(
            col0 + width <= cols,
            "columns {col0}..{} of {cols}",
            col0 + width
        );
        let (rows_arg, cols_arg, col0_arg, width_arg) =
            (int(rows), int(cols), int(col0), int(width));
        let mut launch = self.launch(&self.copy_columns);
        launch
            .arg(&out)
            .arg(&x)
            .arg(&rows_arg)
            .arg(&cols_arg)
            .arg(&col0_arg)
            .arg(&width_arg);
        // SAFETY: matches copy_columns_bf16; col0 + width <= cols checked.
        unsafe { launch.launch(grid::per_row(rows, width)) }.map(drop)
    }

    /// `out[i] = x[idx[i]]` (written, `[idx.len(), cols]`) for `x`: `[rows, cols]`; an index
    /// outside `[0, rows)` gives a row of zeros.
    pub fn gather_rows(
        &self,
        out: Span<u16>,
        x: Span<u16>,
        idx: Span<i32>,
        cols: usize,
    ) -> Result<(), DriverError> {
        let n = idx.len();
        assert_eq!(out.len(), n * cols);
        let rows = rows_of(x.len(), cols, "gather_rows x");
        let (n_arg, cols_arg, rows_arg) = (int(n), int(cols), int(rows));
        let mut launch = self.launch(&self.gather_rows);
        launch
            .arg(&out)
            .arg(&x)
            .arg(&idx)
            .arg(&n_arg)
            .arg(&cols_arg)
            .arg(&rows_arg);
        // SAFETY: matches gather_rows_bf16; the kernel bounds the indices.
        unsafe { launch.launch(grid::per_row(n, cols)) }.map(drop)
    }

    /// Logits for the sampler: `out = f32(x)` (written), soft-capped when `softcap` is set:
    /// `cap * tanh(x / cap)`. Same length. See [`crate::reference::logits`].
    pub fn logits_f32(
        &self,
        out: Span<f32>,
        x: Span<u16>,
        softcap: Option<f32>,
    ) -> Result<(), DriverError> {
        assert_eq!(out.len(), x.len());
        let (n, cap) = (int(x.len()), softcap.unwrap_or(0.0));
        let mut launch = self.launch(&self.logits_f32);
        launch.arg(&out).arg(&x).arg(&n).arg(&cap);
        // SAFETY: matches logits_f32 (a grid-stride loop bounded by n).
        unsafe { launch.launch(grid::flat(x.len())) }.map(drop)
    }

    /// Samples each row of `logits` (`[rows, vocab]`, adjusted in place) as `input` says
    /// (a [`crate::sampling::SamplingBatch`] uploaded) into `out`. See
    /// [`crate::reference::sample_rows`]. Not for graph capture: the adjustment count is a
    /// launch argument.
    pub fn sample_rows(
        &self,
        logits: Span<f32>,
        vocab: usize,
        input: &DeviceSamplingBatch,
        out: &DeviceSampledRows,
    ) -> Result<(), DriverError> {
        let rows = rows_of(logits.len(), vocab, "sample_rows logits");
        if rows == 0 {
            return Ok(());
        }
        let n = input.adjust_token.len();
        assert_eq!(input.floats.len(), rows * 4);
        assert_eq!(input.ints.len(), rows * 2);
        assert_eq!(input.adjust_start.len(), rows + 1);
        assert_eq!(input.adjust_values.len(), n * 3);
        assert_eq!(input.adjust_raw.len(), n);
        assert_eq!(input.mask_start.len(), rows + 1);
        assert_eq!(out.tokens.len(), rows);
        assert_eq!(out.logprobs.len(), rows);
        assert_eq!(out.top_ids.len(), rows * MAX_TOP_LOGPROBS);
        assert_eq!(out.top_logprobs.len(), rows * MAX_TOP_LOGPROBS);
        let (vocab_arg, n_arg) = (int(vocab), int(n));
        let n_mask_arg = int(input.mask_words.len());
        let mut launch = self.launch(&self.sample_rows);
        launch
            .arg(&logits)
            .arg(&vocab_arg)
            .arg(&input.floats)
            .arg(&input.ints)
            .arg(&input.adjust_start)
            .arg(&input.adjust_token)
            .arg(&input.adjust_values)
            .arg(&input.adjust_raw)
            .arg(&n_arg)
            .arg(&input.mask_start)
            .arg(&input.mask_words)
            .arg(&n_mask_arg)
            .arg(&out.tokens)
            .arg(&out.logprobs)
            .arg(&out.top_ids)
            .arg(&out.top_logprobs);
        // SAFETY: matches sample_rows_f32; lengths checked above, the kernel clamps the
        // adjustment and mask ranges to their arrays and skips tokens outside the vocabulary.
        unsafe { launch.launch(grid::per_row(rows, vocab)) }.map(drop)
    }
}

/// A [`crate::sampling::SamplingBatch`] on the device (same arrays), plus `adjust_raw`
/// (`[adjustments]`, written: the logits the adjustments replaced).
#[derive(Clone, Copy, Debug)]
pub struct DeviceSamplingBatch {
    pub floats: Span<f32>,
    pub ints: Span<i32>,
    pub adjust_start: Span<i32>,
    pub adjust_token: Span<i32>,
    pub adjust_values: Span<f32>,
    pub adjust_raw: Span<f32>,
    pub mask_start: Span<i32>,
    pub mask_words: Span<u32>,
}

/// Where [`Kernels::sample_rows`] writes a [`crate::sampling::SampledRows`].
#[derive(Clone, Copy, Debug)]
pub struct DeviceSampledRows {
    pub tokens: Span<i32>,
    pub logprobs: Span<f32>,
    pub top_ids: Span<i32>,
    pub top_logprobs: Span<f32>,
}

#[cfg(test)]
mod tests {
    use super::{grid, Kernels, Span, GEMV_MAX_ROWS, GEMV_WARPS};

    #[test]
    fn gemv_grid_covers_every_column() {
        let w = GEMV_WARPS as usize;
        assert_eq!(grid::gemv(1, 1, 1).grid_dim, (1, 1, 1));
        assert_eq!(grid::gemv(w, 1, 1).grid_dim, (1, 1, 1));
        assert_eq!(grid::gemv(w + 1, 1, 1).grid_dim, (2, 1, 1));
        // Llama 3's 128,256-token vocabulary as the LM head's columns.
        assert_eq!(grid::gemv(128_256, 1, 1).grid_dim.0 as usize * w, 128_256);
        assert_eq!(grid::gemv(5, 1, 1).block_dim, (GEMV_WARPS * 32, 1, 1));
        // Every (columns per warp, k split): blocks × column groups per block × columns per
        // group reach n, and one block fewer would not.
        for n in [1, 3, 5, 1001, 2048, 128_256] {
            for per_warp in [1, 2, 4] {
                for k_split in [1, 2, 4] {
                    let blocks = grid::gemv(n, per_warp, k_split).grid_dim.0 as usize;
                    let per_block = w / k_split * per_warp;
                    assert!(blocks * per_block >= n && (blocks - 1) * per_block < n);
                }
            }
        }
    }

    #[test]
    fn gemv_splits_k_only_for_narrow_matrices() {
        let h100 = 132;
        // Llama-3.2-1B's shapes at batch 1: the LM head and gate/up have columns enough.
        assert_eq!(grid::gemv_k_split(h100, 1, 128_256, 2048), 1);
        assert_eq!(grid::gemv_k_split(h100, 1, 16_384, 2048), 1);
        // o_proj (2,048 columns) and down (2,048 over k = 8,192) get more warps each.
        assert_eq!(grid::gemv_k_split(h100, 1, 2048, 2048), 4);
        assert_eq!(grid::gemv_k_split(h100, 1, 2048, 8192), 4);
        // Never more warps than k has 32-word strides, nor than a block has.
        assert_eq!(grid::gemv_k_split(h100, 8, 3, 24), 1);
        assert_eq!(grid::gemv_k_split(h100, 1, 3, 512), 2);
        for n in [1, 7, 2048, 1 << 20] {
            for k in [8, 256, 4096, 65_536] {
                for m in 1..=GEMV_MAX_ROWS {
                    let s = grid::gemv_k_split(h100, m, n, k);
                    assert!(s.is_power_of_two() && s <= GEMV_WARPS as usize, "{s}");
                }
            }
        }
    }

    #[test]
    fn gemv_takes_few_rows_whole_words_and_aligned_operands() {
        // SAFETY: spans only compared, never dereferenced.
        let at = |ptr: u64| unsafe { Span::<u16>::from_raw(ptr, 1) };
        let (x, w) = (at(0x1000), at(0x2000));
        for m in 1..=GEMV_MAX_ROWS {
            assert!(Kernels::gemv_applies(x, w, m, 2048));
        }
        assert!(!Kernels::gemv_applies(x, w, 0, 2048));
        assert!(!Kernels::gemv_applies(x, w, GEMV_MAX_ROWS + 1, 2048));
        assert!(
            !Kernels::gemv_applies(x, w, 1, 2044),
            "k not whole 16-byte words"
        );
        assert!(
            !Kernels::gemv_applies(at(0x1008), w, 1, 2048),
            "x misaligned"
        );
        assert!(
            !Kernels::gemv_applies(x, at(0x2002), 1, 2048),
            "w misaligned"
        );
    }

    #[test]
    fn row_blocks_are_whole_warps_up_to_1024() {
        assert_eq!(grid::per_row(3, 1).block_dim.0, 32);
        assert_eq!(grid::per_row(3, 100).block_dim.0, 128);
        assert_eq!(grid::per_row(3, 8192).block_dim.0, 1024);
        assert_eq!(grid::per_row(3, 8192).grid_dim, (3, 1, 1));
        assert_eq!(grid::per_row(100_000, 64).grid_dim, (100_000, 1, 1));
        assert_eq!(grid::attention(32, 8).grid_dim, (32, 8, 1));
    }

    #[test]
    fn flat_grid_is_capped() {
        assert_eq!(grid::flat(0).grid_dim, (1, 1, 1));
        assert_eq!(grid::flat(257).grid_dim, (2, 1, 1));
        assert_eq!(
            grid::flat(1 << 30).grid_dim.0 as usize,
            grid::FLAT_MAX_BLOCKS
        );
        assert_eq!(grid::flat(5).block_dim.0, grid::FLAT_THREADS);
    }

    /// The tensor-core prefill numbers each sequence's tiles of `FLASH_BLOCK_M` query rows and
    /// gives the blocks past them the padding rows: for any lengths that fit the step there is
    /// a block for every tile and at least one left for the padding.
    #[test]
    fn flash_prefill_grid_covers_every_tile_and_the_padding() {
        let m = grid::FLASH_BLOCK_M;
        let mut state = 0x9e37_79b9_u64;
        let mut next = |n: usize| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1);
            (state >> 33) as usize % n
        };
        for _ in 0..10_000 {
            let num_seqs = 1 + next(64);
            let lens: Vec<usize> = (0..num_seqs)
                .map(|_| match next(4) {
                    0 => 0,
                    1 => 1 + next(m),
                    _ => next(5 * m),
                })
                .collect();
            let real: usize = lens.iter().sum();
            let num_tokens = real + next(2 * m);
            if num_tokens == 0 {
                continue;
            }
            let tiles: usize = lens.iter().map(|l| l.div_ceil(m)).sum();
            let cfg = grid::flash_prefill(32, num_tokens, num_seqs);
            assert!(cfg.grid_dim.0 as usize > tiles, "{lens:?} + {num_tokens}");
            assert_eq!(cfg.grid_dim.1, 32);
        }
        assert_eq!(grid::flash_prefill_blocks(2048, 1), 2048 / m + 2);
    }
}
