//! The CUDA backend: bf16 weights, activations and KV on one GPU; GEMMs through cuBLAS,
//! everything else through the NVRTC kernels of `infer-kernels`; decode steps replayed from
//! CUDA graphs (one per batch-size bucket) when enabled.
//!
//! Everything runs on one stream, in order, so the backend needs no events or
//! synchronisation except when logits come back to the host. Activations live in a per-step
//! [`arena::Arena`] and are passed to kernels as raw [`Span`]s; weights, RoPE tables and the
//! KV pools are allocations the backend keeps for its lifetime.

mod arena;
mod graphs;
mod staging;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::sync::Mutex;

use anyhow::{anyhow, bail, ensure, Context, Result};
use candle_core::{DType, Tensor};
use infer_core::workload::KvCacheDtype;
use infer_kernels::cuda::cudarc::driver::{
    result as cu, CudaContext, CudaSlice, CudaStream, DriverError,
};
use infer_kernels::cuda::{
    DeviceBlockTables, DeviceKv, DeviceSampledRows, DeviceSamplingBatch, Gemm, Kernels, Span,
};
use infer_kernels::layout::{AttentionConfig, KvCacheShape, KvDtype};
use infer_kernels::reference::RmsWeight;
use infer_kernels::sampling::{RowsWords, SampledRows, SamplingBatch};

use super::step_inputs::{graph_bucket, is_decode_only, Padding, StepInputs};
use super::{
    cuda_error_is_sticky, Activation, AttnKind, Backend, DeviceLost, Heads, KvLayout, Logits, Role,
};
use crate::runtime::backend::gemv_choice::{self, GemvChoice, GemvMode, GemvTiming};
use crate::runtime::backend::graph_set::KvPoolId;
use crate::runtime::batch::ForwardBatch;
use arena::Arena;
use graphs::Graphs;
use staging::Staging;

// The engine's row limit for the skinny GEMM is the kernels'.
const _: () = assert!(gemv_choice::MAX_ROWS == infer_kernels::cuda::sources::GEMV_MAX_ROWS);

/// `[rows, cols]` bf16 in the step arena.
#[derive(Clone, Copy, Debug)]
pub struct CudaAct {
    span: Span<u16>,
    rows: usize,
    cols: usize,
    /// `span` and the rows after it up to [`Gemm::padded_rows`] when the arena reserved them
    /// (GEMMs run over them; every other kernel sees `span` only), else `span`.
    padded: Span<u16>,
}

impl CudaAct {
    /// The first `rows` rows of `padded` when it holds them, for a GEMM over `rows` rows.
    fn gemm_rows(&self, rows: usize) -> Option<Span<u16>> {
        (self.padded.len() >= rows * self.cols).then(|| self.padded.slice(0, rows * self.cols))
    }
}

/// A parameter on the device: `[rows, cols]` bf16 (vectors have one row).
pub struct CudaWeight {
    buf: CudaSlice<u16>,
    rows: usize,
    cols: usize,
    /// RMSNorm weights: how the kernel applies them.
    norm: RmsWeight,
}

impl CudaWeight {
    fn span(&self) -> Span<u16> {
        Span::of(&self.buf)
    }
}

/// A loaded weight a GEMM may read, `[n, k]`.
struct LoadedWeight {
    span: Span<u16>,
    n: usize,
    k: usize,
    /// An embedding table: a GEMM operand only as a tied model's LM head.
    embedding: bool,
}

pub struct CudaRope {
    cos: CudaSlice<f32>,
    sin: CudaSlice<f32>,
}

/// Per-layer K and V pools, `[num_blocks, block_size, kv_heads, head_dim]` each.
/// Per layer, the K and V pools as raw bytes: `layout`'s elements of `dtype` each.
pub struct CudaKv {
    k: Vec<CudaSlice<u8>>,
    v: Vec<CudaSlice<u8>>,
    dtype: KvDtype,
    layout: KvLayout,
}

impl CudaKv {
    fn shape(&self) -> KvCacheShape {
        KvCacheShape {
            num_blocks: self.layout.num_blocks,
            block_size: self.layout.block_size,
            num_kv_heads: self.layout.num_kv_heads,
            head_dim: self.layout.head_dim,
        }
    }

    /// What a graph captured on this pool freezes of it.
    fn pool_id(&self) -> KvPoolId {
        KvPoolId {
            addresses: self
                .k
                .iter()
                .zip(&self.v)
                .flat_map(|(k, v)| [Span::of(k).ptr(), Span::of(v).ptr()])
                .collect(),
            num_blocks: self.layout.num_blocks,
            block_size: self.layout.block_size,
        }
    }

    fn layer(&self, layer: usize) -> DeviceKv {
        DeviceKv::of(&self.k[layer], &self.v[layer], self.dtype, self.shape())
    }
}

/// One step: its inputs on the device and what the kernels need to read them.
pub struct CudaStep {
    inputs: StepInputs,
    /// `inputs.data` on the device.
    data: Span<i32>,
    kinds: Vec<KindStep>,
    /// The graph bucket this decode step replays in, when graphs are on, and the KV pool it
    /// runs on.
    bucket: Option<(usize, KvPoolId)>,
}

struct KindStep {
    window: Option<usize>,
    cos: Span<f32>,
    sin: Span<f32>,
}

impl CudaStep {
    fn array(&self, offset: usize, len: usize) -> Span<i32> {
        self.data.slice(offset, len)
    }
}

pub struct CudaBackend {
    ordinal: usize,
    stream: Arc<CudaStream>,
    kernels: Kernels,
    gemm: Gemm,
    arena: Mutex<Arena>,
    /// Step inputs of eager steps (grown as needed, reused).
    inputs: Mutex<Option<CudaSlice<i32>>>,
    /// Page-locked host buffers of the step's copies.
    staging: Mutex<Staging>,
    graphs: Mutex<Graphs>,
    /// Whether the engine samples here ([`Backend::sample`]) rather than on the host.
    device_sampling: AtomicBool,
    /// What KV pools made from now on store.
    kv_dtype: KvDtype,
    /// Every weight a GEMM may read, as loaded: what [`Self::choose_gemv`] times. The spans
    /// point into weights the model owns; `None` once the choice is made.
    loaded_linears: Mutex<Option<Vec<LoadedWeight>>>,
    /// Where decode batches' GEMMs run the skinny kernel instead of cuBLAS.
    gemv: Mutex<(GemvMode, GemvChoice)>,
}

impl CudaBackend {
    pub fn new(ordinal: usize) -> Result<Self> {
        let ctx =
            CudaContext::new(ordinal).with_context(|| format!("opening CUDA device {ordinal}"))?;
        // One stream, in-order: cudarc's per-allocation events would only add work (and
        // event records inside a graph capture).
        // SAFETY: called before any allocation of this context.
        unsafe { ctx.disable_event_tracking() };
        // Not the legacy default stream: it cannot be captured into a graph.
        let stream = ctx.new_stream()?;
        // Compiled once per machine: later starts load the cached code.
        let cache = crate::tools::builtin::cache_dir().join("kernels");
        let kernels =
            Kernels::load_cached(stream.clone(), Some(&cache)).map_err(|e| anyhow!("{e}"))?;
        let gemm = Gemm::new(stream.clone()).map_err(|e| anyhow!("{e}"))?;
        Ok(Self {
            ordinal,
            arena: Mutex::new(Arena::new(stream.clone())),
            inputs: Mutex::new(None),
            staging: Mutex::new(Staging::new(stream.context())?),
            graphs: Mutex::new(Graphs::default()),
            device_sampling: AtomicBool::new(false),
            kv_dtype: KvDtype::Bf16,
            loaded_linears: Mutex::new(Some(Vec::new())),
            gemv: Mutex::new((GemvMode::default(), GemvChoice::default())),
            stream,
            kernels,
            gemm,
        })
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// What KV pools made from now on store: bf16 (`auto`) or fp8 E4M3.
    pub fn set_kv_cache_dtype(&mut self, dtype: KvCacheDtype) {
        self.kv_dtype = match dtype {
            KvCacheDtype::Auto => KvDtype::Bf16,
            KvCacheDtype::Fp8 => KvDtype::Fp8E4m3,
        };
    }

    /// What KV pools made from now on store, as candle names it.
    pub fn kv_dtype(&self) -> DType {
        match self.kv_dtype {
            KvDtype::Bf16 => DType::BF16,
            KvDtype::Fp8E4m3 => DType::F8E4M3,
        }
    }

    /// Replay decode steps of up to `max_batch` sequences from CUDA graphs, one per bucket
    /// (0 turns graphs off). `max_context` bounds every sequence's length: block tables are
    /// padded to it so one graph serves every context length.
    pub fn set_cuda_graphs(&self, max_batch: usize, max_context: usize) {
        self.graphs
            .lock()
            .unwrap()
            .configure(max_batch, max_context);
    }

    /// The largest decode batch replayed from a graph; None: graphs off.
    pub fn cuda_graph_max_batch(&self) -> Option<usize> {
        self.graphs.lock().unwrap().max_batch()
    }

    pub fn set_device_sampling(&self, on: bool) {
        self.device_sampling.store(on, Ordering::Relaxed);
    }

    pub fn device_sampling(&self) -> bool {
        self.device_sampling.load(Ordering::Relaxed)
    }

    /// (free, total) bytes of device memory, once the stream's work (and so its
    /// asynchronous frees) has completed.
    pub fn memory(&self) -> Result<(usize, usize)> {
        self.stream.synchronize()?;
        Ok(self.stream.context().mem_get_info()?)
    }

    /// Bytes the step arena holds (activations of the largest step so far).
    pub fn activation_bytes(&self) -> usize {
        self.arena.lock().unwrap().bytes()
    }

    pub fn graph_count(&self) -> usize {
        self.graphs.lock().unwrap().len()
    }

    /// Times cuBLAS and the skinny GEMM kernel at 1..=[`gemv_choice::MAX_ROWS`] rows over
    /// every weight a GEMM reads, shape by shape, and keeps the kernel where it was clearly
    /// faster ([`GemvChoice`]); when the timing fails, cuBLAS everywhere, the failure named in
    /// the choice's description. Call once the model is loaded, before any graph is captured
    /// (a graph freezes the GEMMs it was captured with).
    pub fn choose_gemv(&self) {
        let weights = self
            .loaded_linears
            .lock()
            .unwrap()
            .take()
            .unwrap_or_default();
        let choice = match self.time_gemms(weights) {
            Ok(timings) => GemvChoice::from_timings(timings),
            Err(e) => GemvChoice::untimed(format!("timing failed: {e:#}")),
        };
        self.gemv.lock().unwrap().1 = choice;
    }

    /// Each shape's GEMM pass (all its weights in turn, as a step reads them) at each row
    /// count both ways. A pass is timed as a replayed graph, as graphed decode steps run
    /// (eager, the host's launch costs would be timed, and cuBLAS's are the larger), after a
    /// read of twice the L2 outside the timed span (in a step no weight is still cached: the
    /// layers stream past). Programmatic dependent launch stays as the engine runs it.
    fn time_gemms(&self, weights: Vec<LoadedWeight>) -> Result<Vec<GemvTiming>> {
        let mut shapes: std::collections::BTreeMap<(usize, usize), Vec<Span<u16>>> =
            Default::default();
        // An embedding table is a GEMM operand only as a tied model's LM head: where no
        // linear weight has its shape.
        let linear_shapes: std::collections::HashSet<(usize, usize)> = weights
            .iter()
            .filter(|w| !w.embedding)
            .map(|w| (w.n, w.k))
            .collect();
        for w in weights {
            if !w.embedding || !linear_shapes.contains(&(w.n, w.k)) {
                shapes.entry((w.n, w.k)).or_default().push(w.span);
            }
        }
        let rows = gemv_choice::MAX_ROWS;
        let (max_n, max_k) = shapes
            .keys()
            .fold((1, 1), |(a, b), &(n, k)| (a.max(n), b.max(k)));
        let x = driver(self.stream.alloc_zeros::<u16>(rows * max_k))?;
        let out = driver(self.stream.alloc_zeros::<u16>(rows * max_n))?;
        let l2 = driver(self.stream.context().attribute(
            infer_kernels::cuda::cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE,
        ))? as usize;
        let flush = driver(
            self.stream
                .alloc_zeros::<u8>((2 * l2).next_multiple_of(16).max(16)),
        )?;
        let sink = driver(
            self.stream
                .alloc_zeros::<u32>(Kernels::read_only_sink_len()),
        )?;
        let flush = || driver(self.kernels.read_only(Span::of(&flush), Span::of(&sink)));
        let mut timings = Vec::new();
        for (&(n, k), weights) in &shapes {
            for m in 1..=rows {
                let (xs, outs) = (Span::of(&x).slice(0, m * k), Span::of(&out).slice(0, m * n));
                if !weights.iter().all(|&w| Kernels::gemv_applies(xs, w, m, k)) {
                    continue;
                }
                let cublas_s = self.time_graph_s(&flush, || {
                    for &w in weights {
                        self.gemm
                            .matmul_bf16(outs, xs, w, m, n, k)
                            .map_err(|e| anyhow!("{e}"))?;
                    }
                    Ok(())
                })?;
                let gemv_s = self.time_graph_s(&flush, || {
                    for &w in weights {
                        driver(self.kernels.gemv_bf16(outs, xs, w, m, n, k))?;
                    }
                    Ok(())
                })?;
                timings.push(GemvTiming {
                    n,
                    k,
                    rows: m,
                    cublas_s,
                    gemv_s,
                });
            }
        }
        Ok(timings)
    }

    /// The skinny GEMM's choice, for the start-up log.
    pub fn gemv_choice(&self) -> GemvChoice {
        self.gemv.lock().unwrap().1.clone()
    }

    /// Launches with programmatic dependent launch from now on, where the device allows it
    /// (graphs captured before keep theirs).
    pub fn set_programmatic_launch(&self, on: bool) {
        self.kernels.set_programmatic_launch(on);
    }

    pub fn programmatic_launch(&self) -> bool {
        self.kernels.programmatic_launch()
    }

    /// Where decode batches' GEMMs run from now on (graphs captured before keep theirs).
    pub fn set_gemv_mode(&self, mode: GemvMode) {
        self.gemv.lock().unwrap().0 = mode;
    }

    /// The fastest of three replays of `work` captured as a graph, each after `flush` and
    /// between events (`work` runs eagerly once first: cuBLAS picks and loads its kernels
    /// outside the capture).
    fn time_graph_s(
        &self,
        flush: &dyn Fn() -> Result<()>,
        mut work: impl FnMut() -> Result<()>,
    ) -> Result<f64> {
        use infer_kernels::cuda::cudarc::driver::sys::{
            CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode,
        };
        work()?;
        driver(
            self.stream
                .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
        )?;
        let recorded = work();
        let graph = driver(self.stream.end_capture(CUgraphInstantiate_flags(0)));
        recorded?;
        let graph = graph?.ok_or_else(|| anyhow!("capturing a GEMM pass gave no graph"))?;
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            flush()?;
            let event = || {
                driver(
                    self.stream
                        .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)),
                )
            };
            let start = event()?;
            driver(graph.launch())?;
            let end = event()?;
            driver(end.synchronize())?;
            best = best.min(driver(start.elapsed_ms(&end))? as f64 * 1e-3);
        }
        Ok(best)
    }

    /// A step activation, with room for the GEMM row bucket after its rows.
    fn act(&self, rows: usize, cols: usize) -> Result<CudaAct> {
        let padded: Span<u16> = self
            .arena
            .lock()
            .unwrap()
            .alloc(Gemm::padded_rows(rows) * cols)?;
        Ok(CudaAct {
            span: padded.slice(0, rows * cols),
            rows,
            cols,
            padded,
        })
    }

    fn upload<T: infer_kernels::cuda::cudarc::driver::DeviceRepr>(
        &self,
        host: &[T],
    ) -> Result<CudaSlice<T>> {
        Ok(self.stream.clone_htod(host)?)
    }
}

/// Words `range` of `words` as an array of `T` (4 bytes each: f32, i32 or u32).
fn words_as<T>(words: Span<u32>, range: &std::ops::Range<usize>) -> Span<T> {
    assert_eq!(std::mem::size_of::<T>(), 4);
    let part = words.slice(range.start, range.len());
    // SAFETY: inside `words`, 4-byte aligned as `words` is; T is 4 bytes.
    unsafe { Span::from_raw(part.ptr(), part.len()) }
}

fn bf16_bits(t: &Tensor) -> Result<Vec<u16>> {
    let t = t.to_dtype(DType::BF16)?.flatten_all()?;
    Ok(t.to_vec1::<half::bf16>()?
        .into_iter()
        .map(|x| x.to_bits())
        .collect())
}

fn driver<T>(r: std::result::Result<T, DriverError>) -> Result<T> {
    r.map_err(|e| device_error(&e).unwrap_or_else(|| anyhow!("CUDA: {e}")))
}

/// [`DeviceLost`] when `e` leaves the CUDA context unusable.
fn device_error(e: &DriverError) -> Option<anyhow::Error> {
    cuda_error_is_sticky(e.0 as u32).then(|| DeviceLost(format!("{e}")).into())
}

/// A step's error as the engine must read it: [`DeviceLost`] when a driver error in its
/// chain left the context unusable (errors raised with `?` keep the driver's type).
pub fn classify_step_error(e: anyhow::Error) -> anyhow::Error {
    if DeviceLost::caused(&e) {
        return e;
    }
    let lost = e
        .chain()
        .find_map(|c| c.downcast_ref::<DriverError>().and_then(device_error));
    match lost {
        Some(lost) => lost.context(format!("{e:#}")),
        None => e,
    }
}

// The sticky codes, as the driver numbers them.
const _: () = {
    use infer_kernels::cuda::cudarc::driver::sys::CUresult as R;
    assert!(R::CUDA_ERROR_ECC_UNCORRECTABLE as u32 == 214);
    assert!(R::CUDA_ERROR_ILLEGAL_ADDRESS as u32 == 700);
    assert!(R::CUDA_ERROR_LAUNCH_TIMEOUT as u32 == 702);
    assert!(R::CUDA_ERROR_ASSERT as u32 == 710);
    assert!(R::CUDA_ERROR_HARDWARE_STACK_ERROR as u32 == 714);
    assert!(R::CUDA_ERROR_ILLEGAL_INSTRUCTION as u32 == 715);
    assert!(R::CUDA_ERROR_MISALIGNED_ADDRESS as u32 == 716);
    assert!(R::CUDA_ERROR_INVALID_ADDRESS_SPACE as u32 == 717);
    assert!(R::CUDA_ERROR_INVALID_PC as u32 == 718);
    assert!(R::CUDA_ERROR_LAUNCH_FAILED as u32 == 719);
};

impl Backend for CudaBackend {
    type Act = CudaAct;
    type Weight = CudaWeight;
    type Rope = CudaRope;
    type Kv = CudaKv;
    type Step = CudaStep;
    type ScratchMark = arena::Mark;

    // Every weight is the checkpoint's `[rows, cols]` in bf16, whatever its role.
    const EMBEDDING_IS_LINEAR: bool = true;

    fn weight(&self, t: Tensor, role: Role) -> Result<CudaWeight> {
        let (rows, cols) = match t.dims() {
            [n] => (1, *n),
            [r, c] => (*r, *c),
            d => bail!("a weight of shape {d:?}"),
        };
        let norm = match role {
            // The kernel adds the 1 in f32, as HF does: a bf16 `1 + w` would lose bits.
            Role::Norm { plus_one: true } => RmsWeight::OnePlus,
            _ => RmsWeight::Scale,
        };
        let weight = CudaWeight {
            buf: self.upload(&bf16_bits(&t)?)?,
            rows,
            cols,
            norm,
        };
        // An embedding table is a tied model's LM head.
        if let (Role::Linear | Role::Embedding, Some(loaded)) =
            (role, self.loaded_linears.lock().unwrap().as_mut())
        {
            loaded.push(LoadedWeight {
                span: weight.span(),
                n: rows,
                k: cols,
                embedding: role == Role::Embedding,
            });
        }
        Ok(weight)
    }

    fn weight_len(w: &CudaWeight) -> usize {
        w.rows * w.cols
    }

    fn rope(&self, inv_freq: &[f32], max_positions: usize, scale: f32) -> Result<CudaRope> {
        let (cos, sin) = super::rope_tables(inv_freq, max_positions, scale);
        Ok(CudaRope {
            cos: self.upload(&cos)?,
            sin: self.upload(&sin)?,
        })
    }

    fn new_kv(&self, layout: KvLayout) -> Result<CudaKv> {
        let len = layout.num_blocks * layout.block_size * layout.num_kv_heads * layout.head_dim;
        ensure!(
            i32::try_from(layout.num_blocks * layout.block_size).is_ok(),
            "{} KV slots do not fit the kernels' i32 slot ids",
            layout.num_blocks * layout.block_size
        );
        let bytes = len * self.kv_dtype.bytes();
        let zeros = || -> Result<CudaSlice<u8>> { Ok(self.stream.alloc_zeros::<u8>(bytes)?) };
        let k = (0..layout.num_layers)
            .map(|_| zeros())
            .collect::<Result<_>>()?;
        let v = (0..layout.num_layers)
            .map(|_| zeros())
            .collect::<Result<_>>()?;
        Ok(CudaKv {
            k,
            v,
            dtype: self.kv_dtype,
            layout,
        })
    }

    fn kv_layout(kv: &CudaKv) -> KvLayout {
        kv.layout
    }

    fn prepare(
        &self,
        batch: &ForwardBatch,
        kv: &CudaKv,
        kinds: &[AttnKind<'_, CudaRope>],
    ) -> Result<CudaStep> {
        let l = kv.layout;
        let mut graphs = self.graphs.lock().unwrap();
        let bucket = match graphs.max_batch() {
            Some(max) if is_decode_only(batch) => graph_bucket(batch.seqs.len(), max),
            _ => None,
        };
        let padding = bucket.map(|bucket| Padding {
            bucket,
            max_blocks: graphs.max_context().div_ceil(l.block_size),
        });
        let inputs = StepInputs::build(batch, l.block_size, l.num_blocks, padding)?;
        // A graph's inputs live at its own fixed address; eager steps share one buffer.
        let data = match bucket {
            Some(b) => Span::of(graphs.inputs(b, inputs.device_len(), &self.stream)?),
            None => {
                let mut slot = self.inputs.lock().unwrap();
                if slot.as_ref().is_none_or(|b| b.len() < inputs.device_len()) {
                    *slot = Some(driver(unsafe {
                        self.stream
                            .alloc::<i32>(inputs.device_len().next_power_of_two())
                    })?);
                }
                let buf = slot.as_ref().expect("allocated above");
                Span::of(buf).slice(0, inputs.device_len())
            }
        };
        // The arrays in one copy; tables narrower on the host than on the device (a graph's,
        // padded to its longest context) in a second that spreads their rows.
        let at = inputs.at.tables;
        self.staging
            .lock()
            .unwrap()
            .inputs
            .upload_with(&self.stream, &inputs.data, |buf| {
                if inputs.table_width == inputs.max_blocks {
                    // SAFETY: `data` is device_len() = buf.len() elements the backend keeps;
                    // `buf` is page-locked and kept until the copy has run.
                    return driver(unsafe {
                        cu::memcpy_htod_async(data.ptr(), buf, self.stream.cu_stream())
                    });
                }
                let (arrays, tables) = buf.split_at(at);
                // SAFETY: as above; the tables' rows land inside `data` (the asserts of
                // copy_rows_htod check it).
                unsafe {
                    driver(cu::memcpy_htod_async(
                        data.ptr(),
                        arrays,
                        self.stream.cu_stream(),
                    ))?;
                    staging::copy_rows_htod(
                        &self.stream,
                        data.slice(at, data.len() - at),
                        inputs.max_blocks,
                        tables,
                        inputs.table_width,
                        inputs.seqs,
                    )
                }
            })?;
        let kinds = kinds
            .iter()
            .map(|k| KindStep {
                window: k.window,
                cos: Span::of(&k.rope.cos),
                sin: Span::of(&k.rope.sin),
            })
            .collect();
        Ok(CudaStep {
            inputs,
            data,
            kinds,
            bucket: bucket.map(|b| (b, kv.pool_id())),
        })
    }

    fn execute(
        &self,
        step: &CudaStep,
        forward: &mut dyn FnMut() -> Result<Option<CudaAct>>,
    ) -> Result<Option<CudaAct>> {
        self.arena.lock().unwrap().reset();
        let Some((bucket, pool)) = &step.bucket else {
            return forward();
        };
        let real = step.inputs.real_sampled;
        let out = graphs::run(self, *bucket, pool, forward)?;
        // Only the real rows go back to the host.
        Ok(out.map(|x| {
            let span = x.span.slice(0, real * x.cols);
            CudaAct {
                span,
                rows: real,
                cols: x.cols,
                padded: span,
            }
        }))
    }

    fn embed(&self, table: &CudaWeight, step: &CudaStep, scale: Option<f32>) -> Result<CudaAct> {
        let s = &step.inputs;
        let out = self.act(s.tokens, table.cols)?;
        // HF multiplies by the scale rounded to the model dtype.
        let scale = scale.map_or(1.0, infer_kernels::bf16::round);
        driver(self.kernels.embedding(
            out.span,
            table.span(),
            step.array(s.at.ids, s.tokens),
            table.cols,
            scale,
        ))?;
        Ok(out)
    }

    fn linear(&self, x: &CudaAct, w: &CudaWeight, bias: Option<&CudaWeight>) -> Result<CudaAct> {
        ensure!(
            x.cols == w.cols,
            "linear: x has {} columns, W^T {}",
            x.cols,
            w.cols
        );
        let out = self.act(x.rows, w.rows)?;
        // Over the row bucket where both sides have it (the padding rows hold whatever the
        // arena had and their results are never read), else over exactly the rows.
        let bucket = Gemm::padded_rows(x.rows);
        let (m, xs, outs) = match (x.gemm_rows(bucket), out.gemm_rows(bucket)) {
            (Some(xs), Some(outs)) => (bucket, xs, outs),
            _ => (x.rows, x.span, out.span),
        };
        // Only decode batches can take the skinny kernel: prefill steps skip the lookup.
        let gemv = m <= gemv_choice::MAX_ROWS && {
            let (mode, choice) = &*self.gemv.lock().unwrap();
            let applies = Kernels::gemv_applies(xs, w.span(), m, w.cols);
            choice.uses_gemv(*mode, w.rows, w.cols, m, applies)
        };
        if gemv {
            driver(
                self.kernels
                    .gemv_bf16(outs, xs, w.span(), m, w.rows, w.cols),
            )?;
        } else {
            self.gemm
                .matmul_bf16(outs, xs, w.span(), m, w.rows, w.cols)
                .map_err(|e| anyhow!("{e}"))?;
        }
        if let Some(b) = bias {
            driver(self.kernels.bias_add(out.span, b.span()))?;
        }
        Ok(out)
    }

    fn rms_norm(&self, x: &CudaAct, w: &CudaWeight, eps: f32) -> Result<CudaAct> {
        let out = self.act(x.rows, x.cols)?;
        driver(
            self.kernels
                .rms_norm(out.span, x.span, w.span(), eps, w.norm),
        )?;
        Ok(out)
    }

    fn add_rms_norm(
        &self,
        residual: &mut CudaAct,
        x: &CudaAct,
        w: &CudaWeight,
        eps: f32,
        out: &mut CudaAct,
    ) -> Result<()> {
        ensure!(
            (out.rows, out.cols) == (residual.rows, residual.cols)
                && (x.rows, x.cols) == (residual.rows, residual.cols),
            "add_rms_norm: shapes differ"
        );
        // The kernel's output must not overlap the residual it updates.
        ensure!(
            out.span.ptr() != residual.span.ptr(),
            "add_rms_norm: out is the residual"
        );
        driver(self.kernels.fused_add_rms_norm(
            out.span,
            residual.span,
            x.span,
            w.span(),
            eps,
            w.norm,
        ))
    }

    fn scratch_mark(&self) -> arena::Mark {
        self.arena.lock().unwrap().mark()
    }

    fn release_scratch(&self, mark: arena::Mark) {
        self.arena.lock().unwrap().restore(mark);
    }

    fn add(&self, residual: &mut CudaAct, x: &CudaAct) -> Result<()> {
        driver(self.kernels.add(residual.span, x.span))
    }

    fn split(&self, x: &CudaAct, widths: &[usize]) -> Result<Vec<CudaAct>> {
        ensure!(
            widths.iter().sum::<usize>() == x.cols,
            "split widths do not add up"
        );
        let mut col0 = 0;
        widths
            .iter()
            .map(|&w| {
                let out = self.act(x.rows, w)?;
                driver(self.kernels.copy_columns(out.span, x.span, x.cols, col0))?;
                col0 += w;
                Ok(out)
            })
            .collect()
    }

    fn rope_and_write_kv(
        &self,
        q: &mut CudaAct,
        k: CudaAct,
        v: &CudaAct,
        kv: &mut CudaKv,
        layer: usize,
        heads: &Heads,
        step: &CudaStep,
        kind: usize,
    ) -> Result<()> {
        let s = &step.inputs;
        let ks = &step.kinds[kind];
        driver(self.kernels.rope_neox(
            q.span,
            k.span,
            step.array(s.at.positions, s.tokens),
            ks.cos,
            ks.sin,
            heads.q,
            heads.kv,
        ))?;
        driver(self.kernels.reshape_and_cache(
            k.span,
            v.span,
            &kv.layer(layer),
            step.array(s.at.slots, s.tokens),
        ))
    }

    fn qkv_rope_and_write_kv(
        &self,
        qkv: &CudaAct,
        kv: &mut CudaKv,
        layer: usize,
        heads: &Heads,
        step: &CudaStep,
        kind: usize,
    ) -> Result<CudaAct> {
        let (nq, nkv) = (heads.q * heads.dim, heads.kv * heads.dim);
        ensure!(
            qkv.cols == nq + 2 * nkv,
            "qkv has {} columns, the heads {}",
            qkv.cols,
            nq + 2 * nkv
        );
        let s = &step.inputs;
        let ks = &step.kinds[kind];
        let q = self.act(qkv.rows, nq)?;
        // One launch for what split, rope_neox and reshape_and_cache do in five.
        driver(self.kernels.qkv_rope_and_cache(
            q.span,
            qkv.span,
            &kv.layer(layer),
            step.array(s.at.positions, s.tokens),
            step.array(s.at.slots, s.tokens),
            ks.cos,
            ks.sin,
            heads.q,
        ))?;
        Ok(q)
    }

    fn attention(
        &self,
        q: &CudaAct,
        kv: &CudaKv,
        layer: usize,
        heads: &Heads,
        step: &CudaStep,
        kind: usize,
    ) -> Result<CudaAct> {
        let s = &step.inputs;
        let mut cfg = AttentionConfig::new(heads.q, heads.kv, heads.dim);
        cfg.scale = heads.scale;
        cfg.softcap = heads.softcap;
        cfg.sliding_window = step.kinds[kind].window;
        let out = self.act(q.rows, q.cols)?;
        let pools = kv.layer(layer);
        let tables = DeviceBlockTables {
            table: step.array(s.at.tables, s.seqs * s.max_blocks),
            max_blocks_per_seq: s.max_blocks,
        };
        if s.decode_only {
            // One grid row per sequence (a step error, not a panic in the launch wrapper).
            ensure!(
                s.seqs <= 65_535,
                "a decode step of {} sequences: the attention grid takes at most 65,535",
                s.seqs
            );
            let splits = self
                .kernels
                .decode_splits(s.seqs, &tables, &cfg, pools.shape.block_size);
            let scratch: Span<f32> = self
                .arena
                .lock()
                .unwrap()
                .alloc(Kernels::decode_scratch_len(s.seqs, &cfg, splits).max(1))?;
            driver(self.kernels.paged_attention_decode(
                out.span,
                q.span,
                &pools,
                &tables,
                step.array(s.at.seq_lens, s.seqs),
                &cfg,
                splits,
                scratch,
            ))?;
        } else {
            driver(self.kernels.paged_attention_prefill(
                out.span,
                q.span,
                &pools,
                &tables,
                step.array(s.at.cu_seqlens, s.seqs + 1),
                step.array(s.at.start_pos, s.seqs),
                &cfg,
            ))?;
        }
        Ok(out)
    }

    fn gated(&self, gate_up: &CudaAct, act: Activation) -> Result<CudaAct> {
        let inter = gate_up.cols / 2;
        let out = self.act(gate_up.rows, inter)?;
        let k = &self.kernels;
        driver(match act {
            Activation::Silu => k.silu_and_mul(out.span, gate_up.span, inter),
            Activation::GeluTanh => k.gelu_tanh_and_mul(out.span, gate_up.span, inter),
            Activation::GeluErf => k.gelu_erf_and_mul(out.span, gate_up.span, inter),
        })?;
        Ok(out)
    }

    fn sampled_rows(&self, x: &CudaAct, step: &CudaStep) -> Result<Option<CudaAct>> {
        let s = &step.inputs;
        if s.sampled == 0 {
            return Ok(None);
        }
        let out = self.act(s.sampled, x.cols)?;
        driver(self.kernels.gather_rows(
            out.span,
            x.span,
            step.array(s.at.sample_rows, s.sampled),
            x.cols,
        ))?;
        Ok(Some(out))
    }

    fn logits(&self, x: &CudaAct, softcap: Option<f32>) -> Result<Logits> {
        let n = x.rows * x.cols;
        let out: Span<f32> = self.arena.lock().unwrap().alloc(n)?;
        driver(self.kernels.logits_f32(out, x.span, softcap))?;
        let mut host = vec![0f32; n];
        // SAFETY: `out` is n f32s of the arena; the copy is ordered after the kernel on the
        // stream, and the synchronize below waits for it before `host` is read.
        driver(unsafe { cu::memcpy_dtoh_async(&mut host, out.ptr(), self.stream.cu_stream()) })?;
        driver(self.stream.synchronize())?;
        Ok(Logits::new(host, x.cols))
    }

    fn sample(
        &self,
        x: &CudaAct,
        softcap: Option<f32>,
        batch: &SamplingBatch,
    ) -> Result<Option<SampledRows>> {
        ensure!(
            batch.rows() == x.rows,
            "{} sampling rows for {} rows of logits",
            batch.rows(),
            x.rows
        );
        let rows = x.rows;
        let (words, at) = batch.to_words();
        let out_at = RowsWords::new(rows);
        let (logits, input, out, input_words, out_words) = {
            let mut arena = self.arena.lock().unwrap();
            let logits = arena.alloc::<f32>(rows * x.cols)?;
            // One buffer in, one out: a copy each way. Empty arrays still point inside
            // (one spare word): a kernel argument needs an address.
            let input_words: Span<u32> = arena.alloc(at.len + 1)?;
            let raw: Span<f32> = arena.alloc(batch.adjustments().max(1))?;
            let out_words: Span<u32> = arena.alloc(out_at.len)?;
            let input = DeviceSamplingBatch {
                floats: words_as(input_words, &at.floats),
                ints: words_as(input_words, &at.ints),
                adjust_start: words_as(input_words, &at.adjust_start),
                adjust_token: words_as(input_words, &at.adjust_token),
                adjust_values: words_as(input_words, &at.adjust_values),
                adjust_raw: raw.slice(0, batch.adjustments()),
                mask_start: words_as(input_words, &at.mask_start),
                mask_words: words_as(input_words, &at.mask_words),
            };
            let out = DeviceSampledRows {
                tokens: words_as(out_words, &out_at.tokens),
                logprobs: words_as(out_words, &out_at.logprobs),
                top_ids: words_as(out_words, &out_at.top_ids),
                top_logprobs: words_as(out_words, &out_at.top_logprobs),
            };
            (logits, input, out, input_words.slice(0, at.len), out_words)
        };
        driver(self.kernels.logits_f32(logits, x.span, softcap))?;
        let mut staging = self.staging.lock().unwrap();
        staging
            .sampling_in
            .upload(&self.stream, input_words, &words)?;
        driver(self.kernels.sample_rows(logits, x.cols, &input, &out))?;
        staging.sampling_out.download(&self.stream, out_words)?;
        driver(self.stream.synchronize())?;
        Ok(Some(SampledRows::from_words(
            rows,
            staging.sampling_out.read()?,
        )))
    }

    fn copy_block(&self, kv: &mut CudaKv, src: usize, dst: usize) -> Result<()> {
        let l = kv.layout;
        let block = l.block_size * l.num_kv_heads * l.head_dim * kv.dtype.bytes();
        for pool in kv.k.iter().chain(kv.v.iter()) {
            let all = Span::of(pool);
            let (from, to) = (all.slice(src * block, block), all.slice(dst * block, block));
            // SAFETY: two disjoint blocks (src != dst, checked by the model) of one pool.
            driver(unsafe {
                cu::memcpy_dtod_async(to.ptr(), from.ptr(), to.bytes(), self.stream.cu_stream())
            })?;
        }
        Ok(())
    }

    fn fill_pattern(&self, kv: &mut CudaKv) -> Result<()> {
        let n = kv.k.first().map_or(0, |p| p.len()) / kv.dtype.bytes();
        let value = |i: usize| 0.5 * (i as f32 * 0.618_034).sin();
        let pattern: Vec<u8> = match kv.dtype {
            KvDtype::Bf16 => (0..n)
                .flat_map(|i| half::bf16::from_f32(value(i)).to_bits().to_le_bytes())
                .collect(),
            KvDtype::Fp8E4m3 => (0..n)
                .map(|i| infer_kernels::fp8::from_f32(value(i)))
                .collect(),
        };
        for pool in kv.k.iter_mut().chain(kv.v.iter_mut()) {
            driver(self.stream.memcpy_htod(&pattern, pool))?;
        }
        driver(self.stream.synchronize())
    }

    fn kv_bytes(kv: &CudaKv) -> usize {
        kv.k.iter().chain(kv.v.iter()).map(|p| p.len()).sum()
    }
}
