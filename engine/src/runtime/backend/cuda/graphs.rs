//! CUDA graphs for decode steps: one graph per batch-size bucket, captured the first time a
//! decode step of that bucket runs, replayed after.
//!
//! What makes a replay cheap and right (the benchmark log's Phase 9 lost 35–42% of batch-1
//! throughput to graphs that replayed slowly):
//! - no allocation inside a capture: the step runs eagerly once first, which grows the
//!   activation arena to this shape; the capture then gets the same addresses;
//! - no host synchronisation inside: logits leave the graph through a kernel and a copy
//!   that run after it;
//! - no per-launch tuning: cuBLAS has its workspace and picks its kernels in the eager run;
//! - fixed inputs: each bucket reads its token ids, positions, slots, sequence lengths and
//!   block tables (padded to the longest context) from its own buffer, rewritten in place
//!   before each replay;
//! - one KV pool: a graph replays only on the pool it was captured against
//!   (`graph_set::GraphSet` refuses any other).

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::{anyhow, ensure, Result};
use infer_kernels::cuda::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use infer_kernels::cuda::cudarc::driver::{CudaGraph, CudaSlice, CudaStream};

use super::arena::Mark;
use super::{driver, CudaAct, CudaBackend};
use crate::runtime::backend::graph_set::{GraphSet, KvPoolId};

/// A graph owned by one backend. CUDA graph objects must not be used from two threads at
/// once; the backend is not `Sync` and uses its graphs from whichever one thread owns it, so
/// moving them between threads is sound.
struct OwnedGraph(CudaGraph);

// SAFETY: see above — ownership moves, access never happens concurrently.
unsafe impl Send for OwnedGraph {}

struct Captured {
    graph: OwnedGraph,
    /// The head's output, where the graph writes it.
    out: Option<CudaAct>,
    /// The arena after the captured step.
    end: Mark,
}

#[derive(Default)]
pub struct Graphs {
    /// Largest decode batch replayed from a graph; 0: graphs off.
    max_batch: usize,
    /// Longest sequence a graph must serve (block tables are padded to it).
    max_context: usize,
    captured: GraphSet<Captured>,
    inputs: HashMap<usize, CudaSlice<i32>>,
}

impl Graphs {
    pub fn configure(&mut self, max_batch: usize, max_context: usize) {
        self.max_batch = max_batch;
        self.max_context = max_context;
        self.captured.clear();
        self.inputs.clear();
    }

    pub fn max_batch(&self) -> Option<usize> {
        (self.max_batch > 0).then_some(self.max_batch)
    }

    pub fn max_context(&self) -> usize {
        self.max_context
    }

    pub fn len(&self) -> usize {
        self.captured.len()
    }

    /// The input buffer of `bucket`: `len` i32s at an address fixed for the graph's life.
    pub fn inputs(
        &mut self,
        bucket: usize,
        len: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<&mut CudaSlice<i32>> {
        let buf = match self.inputs.entry(bucket) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(driver(stream.alloc_zeros::<i32>(len))?)
            }
        };
        ensure!(
            buf.len() == len,
            "graph inputs of bucket {bucket} changed size"
        );
        Ok(buf)
    }
}

/// Runs the decode step of `bucket` (its inputs already in the bucket's buffer): replays its
/// graph, or runs it eagerly and captures it for the next time.
/// `pool`: the KV pool the step runs on (a graph captured on another is refused).
pub fn run(
    backend: &CudaBackend,
    bucket: usize,
    pool: &KvPoolId,
    forward: &mut dyn FnMut() -> Result<Option<CudaAct>>,
) -> Result<Option<CudaAct>> {
    if let Some(c) = backend
        .graphs
        .lock()
        .unwrap()
        .captured
        .replay(bucket, pool)?
    {
        driver(c.graph.0.launch())?;
        backend.arena.lock().unwrap().restore(c.end);
        return Ok(c.out);
    }
    // This step's result: computed eagerly, which also grows the arena for the capture.
    let eager = forward()?;
    let end = backend.arena.lock().unwrap().mark();
    backend.arena.lock().unwrap().reset();
    let stream = &backend.stream;
    driver(stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))?;
    // Capturing records the kernels without running them: the eager results stay.
    let recorded = forward();
    let graph = driver(stream.end_capture(CUgraphInstantiate_flags(0)));
    let out = recorded?;
    let graph = graph?
        .ok_or_else(|| anyhow!("capturing the bucket-{bucket} decode graph gave no graph"))?;
    let arena = backend.arena.lock().unwrap();
    ensure!(
        !arena.grew() && arena.mark() == end,
        "the captured decode step allocated differently from its eager run"
    );
    ensure!(
        out.map(|o| o.span) == eager.map(|e| e.span),
        "the captured decode step writes its output elsewhere than its eager run"
    );
    drop(arena);
    backend.graphs.lock().unwrap().captured.insert(
        bucket,
        pool.clone(),
        Captured {
            graph: OwnedGraph(graph),
            out,
            end,
        },
    );
    Ok(eager)
}
