//! The host side of running a model on the CPU: memory and threads.
//!
//! Memory: keep freed host memory for reuse instead of handing it back to the OS.
//! A CPU forward allocates large temporaries every step (gathered K/V, score matrices,
//! activations): tens of MB at long contexts. glibc serves blocks above its mmap threshold
//! (at most 32 MB) with a fresh `mmap` and unmaps them on free, so every step page-faults
//! them in again — measured here, a 24-sequence decode at 49k context tokens took 140 ms
//! instead of 54 ms and a 2,048-token prefill 1.15 s instead of 0.53 s, a cliff in step
//! time no cost model should have to learn. GPU servers avoid the same cost with a caching
//! allocator (PyTorch's keeps freed device blocks); this is the host equivalent: no mmap for
//! allocations, no trimming of the heap, one arena so that the engine thread and candle's
//! worker threads reuse the same memory. The price is that resident memory stays at its
//! high-water mark.

/// Configure the allocator; idempotent, best effort (a no-op off glibc). A process-wide
/// setting, so programs call it — the `engine` binary first thing in `main`, before any
/// thread starts — and library code does not.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            // SAFETY: mallopt only sets allocator parameters; these take effect for later
            // allocations and are safe to change while others run.
            unsafe {
                libc::mallopt(libc::M_MMAP_MAX, 0);
                libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
                libc::mallopt(libc::M_ARENA_MAX, 1);
            }
        });
    }
}

/// Run `f` on a worker of a rayon pool with one thread per core, and return its result.
///
/// The model's parallel ops (candle's softmax and norms, gemm, the decode attention) use
/// rayon. Called from a thread outside the pool, every one of them is handed to a pool
/// thread and the caller sleeps until it is done: two thread wake-ups per op, dozens of
/// ops per step — measured here, a 2-sequence decode step took 2.3 ms instead of ~0.8.
/// Called from a worker, an op starts on the spot and the other workers steal its pieces.
pub fn run_in_compute_pool<R: Send>(
    name: &str,
    f: impl FnOnce() -> R + Send,
) -> std::io::Result<R> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let prefix = name.to_string();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(move |i| format!("{prefix}-{i}"))
        .build()
        .map_err(std::io::Error::other)?;
    Ok(pool.install(f))
}

/// Host memory available to a new allocation (`MemAvailable`, Linux), in bytes.
pub fn available_memory() -> Option<usize> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_mem_available(&text)
}

fn parse_mem_available(meminfo: &str) -> Option<usize> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

#[cfg(test)]
mod tests {
    #[test]
    fn mem_available_is_read_in_bytes() {
        let text = "MemTotal:       24576000 kB\nMemFree: 1 kB\nMemAvailable:   20480000 kB\n";
        assert_eq!(super::parse_mem_available(text), Some(20480000 * 1024));
        assert_eq!(super::parse_mem_available("MemTotal: 5 kB\n"), None);
    }
}
