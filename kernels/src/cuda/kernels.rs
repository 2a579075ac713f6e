//! Loaded kernels and their typed launch wrappers.
//!
//! Buffers are cudarc views: bf16 tensors as `u16` bits, index arrays as `i32`, RoPE tables as
//! `f32`, all with the layouts of [`crate::layout`] (the same as the CPU references). Each
//! wrapper checks the buffer lengths against the shapes it is given, then enqueues on the
//! stream the kernels were loaded for; none allocates or synchronises, so every launch can be
//! captured into a CUDA graph.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use cudarc::driver::{
    CudaFunction, CudaStream, CudaView, CudaViewMut, DriverError, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::CompileError;

use super::nvrtc::{self, ComputeCapability};
use super::sources::{self, ATTENTION_WARPS};
use crate::layout::{AttentionConfig, KvCacheShape};
use crate::reference::RmsWeight;

#[derive(Debug)]
pub enum KernelError {
    NvrtcMissing(&'static str),
    Compile {
        source: &'static str,
        error: CompileError,
    },
    Driver(DriverError),
}

impl fmt::Display for KernelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KernelError::NvrtcMissing(why) => write!(f, "NVRTC unavailable: {why}"),
            KernelError::Compile { source, error } => write!(f, "compiling {source}.cu: {error}"),
            KernelError::Driver(e) => write!(f, "CUDA driver: {e}"),
        }
    }
}

impl std::error::Error for KernelError {}

impl From<DriverError> for KernelError {
    fn from(e: DriverError) -> Self {
        KernelError::Driver(e)
    }
}

/// One layer's paged K/V pools on the device.
pub struct DeviceKv<'a> {
    pub k_cache: CudaView<'a, u16>,
    pub v_cache: CudaView<'a, u16>,
    pub shape: KvCacheShape,
}

/// Block tables on the device, `[num_seqs, max_blocks_per_seq]`.
pub struct DeviceBlockTables<'a> {
    pub table: CudaView<'a, i32>,
    pub max_blocks_per_seq: usize,
}

/// The launch shapes, all decided here.
mod grid {
    use super::*;

    /// One block per row, threads striding over the row's `work` items: as many whole warps as
    /// there is work, up to 1024 (rows in these models are 1k–16k wide, so ≤ 16 strides).
    pub fn per_row(rows: usize, work: usize) -> LaunchConfig {
        let threads = work.div_ceil(32).clamp(1, 32) as u32 * 32;
        LaunchConfig {
            grid_dim: (dim(rows), 1, 1),
            block_dim: (threads, 1, 1),
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

    fn dim(n: usize) -> u32 {
        assert!(n > 0 && n < 65_536, "grid dimension {n} out of range");
        n as u32
    }
}

/// Kernel scalar arguments are C `int`s.
fn int(x: usize) -> i32 {
    i32::try_from(x).expect("kernel argument exceeds i32")
}

/// Kernels compiled for one device and bound to one stream.
pub struct Kernels {
    stream: Arc<CudaStream>,
    pub arch: ComputeCapability,
    /// head_dim -> (decode, prefill)
    attention: HashMap<usize, (CudaFunction, CudaFunction)>,
    reshape_and_cache: CudaFunction,
    rms_norm: CudaFunction,
    rope_neox: CudaFunction,
    silu_and_mul: CudaFunction,
    gelu_tanh_and_mul: CudaFunction,
}

impl Kernels {
    /// Compile every source with NVRTC for the stream's device and load it.
    pub fn load(stream: Arc<CudaStream>) -> Result<Self, KernelError> {
        nvrtc::ensure_loaded().map_err(KernelError::NvrtcMissing)?;
        let ctx = stream.context().clone();
        let (major, minor) = ctx.compute_capability()?;
        let arch = ComputeCapability {
            major: major as u32,
            minor: minor as u32,
        };
        let mut functions = HashMap::new();
        for source in sources::ALL {
            let ptx = nvrtc::compile(&source, arch).map_err(|error| KernelError::Compile {
                source: source.name,
                error,
            })?;
            let module = ctx.load_module(ptx)?;
            for &name in source.entry_points {
                functions.insert(name, module.load_function(name)?);
            }
        }
        let mut take = |name: &str| {
            functions
                .remove(name)
                .expect("entry point listed in sources")
        };
        let attention = sources::ATTENTION_HEAD_DIMS
            .iter()
            .map(|&d| {
                let (decode, prefill) = sources::attention_entry_points(d).unwrap();
                (d, (take(decode), take(prefill)))
            })
            .collect();
        let kernels = Self {
            arch,
            attention,
            reshape_and_cache: take("reshape_and_cache_bf16"),
            rms_norm: take("rms_norm_bf16"),
            rope_neox: take("rope_neox_bf16"),
            silu_and_mul: take("silu_and_mul_bf16"),
            gelu_tanh_and_mul: take("gelu_tanh_and_mul_bf16"),
            stream,
        };
        Ok(kernels)
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn attention_fns(&self, cfg: &AttentionConfig, kv: &DeviceKv) -> &(CudaFunction, CudaFunction) {
        assert_eq!(kv.shape.head_dim, cfg.head_dim);
        assert_eq!(kv.shape.num_kv_heads, cfg.num_kv_heads);
        assert_eq!(kv.k_cache.len(), kv.shape.len());
        assert_eq!(kv.v_cache.len(), kv.shape.len());
        self.attention.get(&cfg.head_dim).unwrap_or_else(|| {
            panic!(
                "head_dim {} not in {:?}",
                cfg.head_dim,
                sources::ATTENTION_HEAD_DIMS
            )
        })
    }

    /// Decode attention, see [`crate::reference::paged_attention_decode`].
    /// `q`, `out`: `[num_seqs, num_heads, head_dim]`; `seq_lens`: `[num_seqs]` (≤ 0: padding).
    pub fn paged_attention_decode(
        &self,
        out: &mut CudaViewMut<u16>,
        q: &CudaView<u16>,
        kv: &DeviceKv,
        tables: &DeviceBlockTables,
        seq_lens: &CudaView<i32>,
        cfg: &AttentionConfig,
    ) -> Result<(), DriverError> {
        let (decode, _) = self.attention_fns(cfg, kv);
        let num_seqs = seq_lens.len();
        assert_eq!(q.len(), num_seqs * cfg.num_heads * cfg.head_dim);
        assert_eq!(out.len(), q.len());
        assert!(tables.table.len() >= num_seqs * tables.max_blocks_per_seq);
        let (max_blocks, num_heads, num_kv_heads, block_size, window) = (
            int(tables.max_blocks_per_seq),
            int(cfg.num_heads),
            int(cfg.num_kv_heads),
            int(kv.shape.block_size),
            cfg.window_arg(),
        );
        let mut launch = self.stream.launch_builder(decode);
        launch
            .arg(out)
            .arg(q)
            .arg(&kv.k_cache)
            .arg(&kv.v_cache)
            .arg(&tables.table)
            .arg(seq_lens)
            .arg(&max_blocks)
            .arg(&num_heads)
            .arg(&num_kv_heads)
            .arg(&block_size)
            .arg(&cfg.scale)
            .arg(&window);
        // SAFETY: argument order and types match paged_attention_decode_bf16_d*; lengths checked.
        unsafe { launch.launch(grid::attention(cfg.num_heads, num_seqs)) }.map(drop)
    }

    /// Prefill attention, see [`crate::reference::paged_attention_prefill`].
    /// `q`, `out`: `[num_tokens, num_heads, head_dim]`; `cu_seqlens_q`: `[num_seqs + 1]`;
    /// `start_pos`: `[num_seqs]`. Tokens past `cu_seqlens_q[num_seqs]` are padding.
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention_prefill(
        &self,
        out: &mut CudaViewMut<u16>,
        q: &CudaView<u16>,
        kv: &DeviceKv,
        tables: &DeviceBlockTables,
        cu_seqlens_q: &CudaView<i32>,
        start_pos: &CudaView<i32>,
        cfg: &AttentionConfig,
    ) -> Result<(), DriverError> {
        let (_, prefill) = self.attention_fns(cfg, kv);
        let row = cfg.num_heads * cfg.head_dim;
        let num_seqs = start_pos.len();
        assert_eq!(cu_seqlens_q.len(), num_seqs + 1);
        assert_eq!(q.len() % row, 0);
        assert_eq!(out.len(), q.len());
        assert!(tables.table.len() >= num_seqs * tables.max_blocks_per_seq);
        let num_tokens = q.len() / row;
        let (seqs, max_blocks, num_heads, num_kv_heads, block_size, window) = (
            int(num_seqs),
            int(tables.max_blocks_per_seq),
            int(cfg.num_heads),
            int(cfg.num_kv_heads),
            int(kv.shape.block_size),
            cfg.window_arg(),
        );
        let mut launch = self.stream.launch_builder(prefill);
        launch
            .arg(out)
            .arg(q)
            .arg(&kv.k_cache)
            .arg(&kv.v_cache)
            .arg(&tables.table)
            .arg(cu_seqlens_q)
            .arg(start_pos)
            .arg(&seqs)
            .arg(&max_blocks)
            .arg(&num_heads)
            .arg(&num_kv_heads)
            .arg(&block_size)
            .arg(&cfg.scale)
            .arg(&window);
        // SAFETY: argument order and types match paged_attention_prefill_bf16_d*; lengths checked.
        unsafe { launch.launch(grid::attention(cfg.num_heads, num_tokens)) }.map(drop)
    }

    /// Write new K/V (`[num_tokens, num_kv_heads, head_dim]`) into the pool at `slot_mapping`.
    pub fn reshape_and_cache(
        &self,
        key: &CudaView<u16>,
        value: &CudaView<u16>,
        k_cache: &mut CudaViewMut<u16>,
        v_cache: &mut CudaViewMut<u16>,
        slot_mapping: &CudaView<i32>,
        shape: &KvCacheShape,
    ) -> Result<(), DriverError> {
        let token_len = shape.num_kv_heads * shape.head_dim;
        let num_tokens = slot_mapping.len();
        assert_eq!(key.len(), num_tokens * token_len);
        assert_eq!(value.len(), key.len());
        assert_eq!(k_cache.len(), shape.len());
        assert_eq!(v_cache.len(), shape.len());
        let token_len_arg = int(token_len);
        let mut launch = self.stream.launch_builder(&self.reshape_and_cache);
        launch
            .arg(key)
            .arg(value)
            .arg(k_cache)
            .arg(v_cache)
            .arg(slot_mapping)
            .arg(&token_len_arg);
        // SAFETY: matches reshape_and_cache_bf16; slots are the caller's (< num_slots).
        unsafe { launch.launch(grid::per_row(num_tokens, token_len)) }.map(drop)
    }

    /// RMSNorm of each `weight.len()`-wide row of `x` into `out`.
    pub fn rms_norm(
        &self,
        out: &mut CudaViewMut<u16>,
        x: &CudaView<u16>,
        weight: &CudaView<u16>,
        eps: f32,
        style: RmsWeight,
    ) -> Result<(), DriverError> {
        let hidden = weight.len();
        assert_eq!(x.len() % hidden, 0);
        assert_eq!(out.len(), x.len());
        let (hidden_arg, one_plus) = (int(hidden), (style == RmsWeight::OnePlus) as i32);
        let mut launch = self.stream.launch_builder(&self.rms_norm);
        launch
            .arg(out)
            .arg(x)
            .arg(weight)
            .arg(&hidden_arg)
            .arg(&eps)
            .arg(&one_plus);
        // SAFETY: matches rms_norm_bf16; block size is a multiple of 32 as block_sum requires.
        unsafe { launch.launch(grid::per_row(x.len() / hidden, hidden)) }.map(drop)
    }

    /// NeoX RoPE in place on `q` (`[num_tokens, num_heads, head_dim]`) and `k`
    /// (`[num_tokens, num_kv_heads, head_dim]`); `cos`, `sin`: `[max_positions, head_dim / 2]`.
    #[allow(clippy::too_many_arguments)]
    pub fn rope_neox(
        &self,
        q: &mut CudaViewMut<u16>,
        k: &mut CudaViewMut<u16>,
        positions: &CudaView<i32>,
        cos: &CudaView<f32>,
        sin: &CudaView<f32>,
        num_heads: usize,
        num_kv_heads: usize,
    ) -> Result<(), DriverError> {
        let num_tokens = positions.len();
        let head_dim = q.len() / (num_tokens * num_heads);
        assert_eq!(q.len(), num_tokens * num_heads * head_dim);
        assert_eq!(k.len(), num_tokens * num_kv_heads * head_dim);
        assert_eq!(cos.len() % (head_dim / 2), 0);
        assert_eq!(sin.len(), cos.len());
        let (heads, kv_heads, dim) = (int(num_heads), int(num_kv_heads), int(head_dim));
        let mut launch = self.stream.launch_builder(&self.rope_neox);
        launch
            .arg(q)
            .arg(k)
            .arg(positions)
            .arg(cos)
            .arg(sin)
            .arg(&heads)
            .arg(&kv_heads)
            .arg(&dim);
        let pairs = (num_heads + num_kv_heads) * head_dim / 2;
        // SAFETY: matches rope_neox_bf16; positions must be < max_positions (caller's contract).
        unsafe { launch.launch(grid::per_row(num_tokens, pairs)) }.map(drop)
    }

    /// `out = silu(gate) * up` for `gate_up` rows `[gate (inter) ++ up (inter)]`.
    pub fn silu_and_mul(
        &self,
        out: &mut CudaViewMut<u16>,
        gate_up: &CudaView<u16>,
        inter: usize,
    ) -> Result<(), DriverError> {
        self.gated(&self.silu_and_mul, out, gate_up, inter)
    }

    /// `out = gelu_tanh(gate) * up` (Gemma).
    pub fn gelu_tanh_and_mul(
        &self,
        out: &mut CudaViewMut<u16>,
        gate_up: &CudaView<u16>,
        inter: usize,
    ) -> Result<(), DriverError> {
        self.gated(&self.gelu_tanh_and_mul, out, gate_up, inter)
    }

    fn gated(
        &self,
        function: &CudaFunction,
        out: &mut CudaViewMut<u16>,
        gate_up: &CudaView<u16>,
        inter: usize,
    ) -> Result<(), DriverError> {
        assert_eq!(gate_up.len(), 2 * out.len());
        assert_eq!(out.len() % inter, 0);
        let (rows, inter_arg) = (out.len() / inter, int(inter));
        let mut launch = self.stream.launch_builder(function);
        launch.arg(out).arg(gate_up).arg(&inter_arg);
        // SAFETY: matches silu_and_mul_bf16 / gelu_tanh_and_mul_bf16.
        unsafe { launch.launch(grid::per_row(rows, inter)) }.map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::grid;

    #[test]
    fn row_blocks_are_whole_warps_up_to_1024() {
        assert_eq!(grid::per_row(3, 1).block_dim.0, 32);
        assert_eq!(grid::per_row(3, 100).block_dim.0, 128);
        assert_eq!(grid::per_row(3, 8192).block_dim.0, 1024);
        assert_eq!(grid::per_row(3, 8192).grid_dim, (3, 1, 1));
        assert_eq!(grid::attention(32, 8).grid_dim, (32, 8, 1));
    }
}
