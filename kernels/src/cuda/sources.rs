//! The CUDA C sources, embedded in the binary and compiled at run time.

/// Warps per block of the attention kernels. Injected into the source as `ATTN_WARPS` so the
/// kernel's shared-memory layout and the launch's block size come from this one constant.
pub const ATTENTION_WARPS: u32 = 8;

/// Most query heads per KV head the grouped decode kernel serves in one block (its
/// per-head registers are sized by it): injected as `DECODE_MAX_GROUP`. Wider groups run the
/// per-head decode.
pub const DECODE_MAX_GROUP: usize = 8;

/// Warps per block of the tensor-core prefill attention (`flash_prefill.cu`), 16 query rows
/// each: injected as `FLASH_WARPS`, as [`ATTENTION_WARPS`] is.
pub const FLASH_WARPS: u32 = 4;

/// Warps per block of the skinny GEMMs (`gemv.cu`), `k_split` of them to a group of
/// [`gemv_columns`] output columns: injected as `GEMV_WARPS`.
pub const GEMV_WARPS: u32 = 4;

/// Most rows (decode batch) the skinny GEMMs of `gemv.cu` take: one entry point per row count
/// up to it (each lane holds `gemv_columns(rows) × rows` partial sums in registers).
pub const GEMV_MAX_ROWS: usize = 8;

/// Output columns each warp of the skinny GEMM computes at `rows` rows (injected as
/// `GEMV_COLUMNS_<rows>`): every x word a warp reads serves this many weight words, so wider
/// batches (whose x reads from L1 would otherwise outrun the weight stream) take more.
pub const fn gemv_columns(rows: usize) -> usize {
    match rows {
        0..=2 => 1,
        3..=4 => 2,
        _ => 4,
    }
}

use crate::layout::KvDtype;
use crate::sampling::MAX_TOP_LOGPROBS;

/// Head dimensions the attention kernels are instantiated for.
pub const ATTENTION_HEAD_DIMS: [usize; 4] = [64, 96, 128, 256];

/// Shared by every kernel: fp8 conversion (plain C, also compiled on the host by a test), then
/// bf16 conversion, KV element access and reductions.
pub const FP8: &str = include_str!("fp8.cuh");
const COMMON: &str = include_str!("common.cuh");

/// One `.cu` file: compiled as one NVRTC program and loaded as one module.
#[derive(Clone, Copy, Debug)]
pub struct KernelSource {
    pub name: &'static str,
    source: &'static str,
    pub entry_points: &'static [&'static str],
}

impl KernelSource {
    /// The text handed to NVRTC: host-side constants, the common prelude, then the file.
    pub fn program(&self) -> String {
        let gemv_columns: String = (1..=GEMV_MAX_ROWS)
            .map(|m| format!("#define GEMV_COLUMNS_{m} {}\n", gemv_columns(m)))
            .collect();
        format!(
            "{gemv_columns}#define ATTN_WARPS {ATTENTION_WARPS}\n#define FLASH_WARPS {FLASH_WARPS}\n#define GEMV_WARPS {GEMV_WARPS}\n#define DECODE_MAX_GROUP {DECODE_MAX_GROUP}\n#define SAMPLE_MAX_TOP {MAX_TOP_LOGPROBS}\n{FP8}\n{COMMON}\n// ---- {}.cu ----\n{}",
            self.name, self.source
        )
    }
}

pub const PAGED_ATTENTION: KernelSource = KernelSource {
    name: "paged_attention",
    source: include_str!("paged_attention.cu"),
    entry_points: &[
        "paged_attention_decode_bf16_d64",
        "paged_attention_decode_bf16_d96",
        "paged_attention_decode_bf16_d128",
        "paged_attention_decode_bf16_d256",
        "paged_attention_prefill_bf16_d64",
        "paged_attention_prefill_bf16_d96",
        "paged_attention_prefill_bf16_d128",
        "paged_attention_prefill_bf16_d256",
        "paged_attention_decode_grouped_bf16_d64",
        "paged_attention_decode_grouped_bf16_d96",
        "paged_attention_decode_grouped_bf16_d128",
        "paged_attention_decode_grouped_bf16_d256",
        "paged_attention_decode_bf16_kvfp8_d64",
        "paged_attention_decode_bf16_kvfp8_d96",
        "paged_attention_decode_bf16_kvfp8_d128",
        "paged_attention_decode_bf16_kvfp8_d256",
        "paged_attention_prefill_bf16_kvfp8_d64",
        "paged_attention_prefill_bf16_kvfp8_d96",
        "paged_attention_prefill_bf16_kvfp8_d128",
        "paged_attention_prefill_bf16_kvfp8_d256",
        "paged_attention_decode_grouped_bf16_kvfp8_d64",
        "paged_attention_decode_grouped_bf16_kvfp8_d96",
        "paged_attention_decode_grouped_bf16_kvfp8_d128",
        "paged_attention_decode_grouped_bf16_kvfp8_d256",
    ],
};

pub const FLASH_PREFILL: KernelSource = KernelSource {
    name: "flash_prefill",
    source: include_str!("flash_prefill.cu"),
    entry_points: &[
        "flash_prefill_bf16_d64",
        "flash_prefill_bf16_d96",
        "flash_prefill_bf16_d128",
        "flash_prefill_bf16_d256",
        "flash_prefill_bf16_kvfp8_d64",
        "flash_prefill_bf16_kvfp8_d96",
        "flash_prefill_bf16_kvfp8_d128",
        "flash_prefill_bf16_kvfp8_d256",
    ],
};

pub const KV_CACHE: KernelSource = KernelSource {
    name: "kv_cache",
    source: include_str!("kv_cache.cu"),
    entry_points: &[
        "reshape_and_cache_bf16",
        "qkv_rope_cache_bf16",
        "reshape_and_cache_bf16_kvfp8",
        "qkv_rope_cache_bf16_kvfp8",
    ],
};

pub const RMS_NORM: KernelSource = KernelSource {
    name: "rms_norm",
    source: include_str!("rms_norm.cu"),
    entry_points: &["rms_norm_bf16", "fused_add_rms_norm_bf16"],
};

pub const ROPE: KernelSource = KernelSource {
    name: "rope",
    source: include_str!("rope.cu"),
    entry_points: &["rope_neox_bf16"],
};

pub const ACTIVATION: KernelSource = KernelSource {
    name: "activation",
    source: include_str!("activation.cu"),
    entry_points: &[
        "silu_and_mul_bf16",
        "gelu_tanh_and_mul_bf16",
        "gelu_erf_and_mul_bf16",
    ],
};

pub const GATHER: KernelSource = KernelSource {
    name: "gather",
    source: include_str!("gather.cu"),
    entry_points: &["embedding_bf16", "gather_rows_bf16", "copy_columns_bf16"],
};

pub const ELEMENTWISE: KernelSource = KernelSource {
    name: "elementwise",
    source: include_str!("elementwise.cu"),
    entry_points: &["add_bf16", "logits_f32", "bias_add_bf16", "read_only_u128"],
};

pub const SAMPLING: KernelSource = KernelSource {
    name: "sampling",
    source: include_str!("sampling.cu"),
    entry_points: &["sample_rows_f32"],
};

pub const GEMV: KernelSource = KernelSource {
    name: "gemv",
    source: include_str!("gemv.cu"),
    entry_points: &[
        "gemv_bf16_m1",
        "gemv_bf16_m2",
        "gemv_bf16_m3",
        "gemv_bf16_m4",
        "gemv_bf16_m5",
        "gemv_bf16_m6",
        "gemv_bf16_m7",
        "gemv_bf16_m8",
    ],
};

pub const ALL: [KernelSource; 10] = [
    PAGED_ATTENTION,
    FLASH_PREFILL,
    KV_CACHE,
    RMS_NORM,
    ROPE,
    ACTIVATION,
    GATHER,
    ELEMENTWISE,
    SAMPLING,
    GEMV,
];

/// The skinny GEMM's entry point for `rows` rows (1..=[`GEMV_MAX_ROWS`]).
pub fn gemv_entry_point(rows: usize) -> Option<&'static str> {
    (1..=GEMV_MAX_ROWS)
        .contains(&rows)
        .then(|| GEMV.entry_points[rows - 1])
}

/// The tensor-core prefill attention's entry point for one head dimension and pool element.
pub fn flash_prefill_entry_point(head_dim: usize, kv: KvDtype) -> Option<&'static str> {
    let i = ATTENTION_HEAD_DIMS.iter().position(|&d| d == head_dim)?;
    let n = ATTENTION_HEAD_DIMS.len();
    Some(FLASH_PREFILL.entry_points[kv_index(kv) * n + i])
}

/// The KV cache writers' entry points for one pool element: (reshape_and_cache,
/// qkv_rope_cache).
pub fn kv_cache_entry_points(kv: KvDtype) -> (&'static str, &'static str) {
    let names = KV_CACHE.entry_points;
    (names[2 * kv_index(kv)], names[2 * kv_index(kv) + 1])
}

/// Which of each kernel's element variants, in the entry-point lists' order.
fn kv_index(kv: KvDtype) -> usize {
    match kv {
        KvDtype::Bf16 => 0,
        KvDtype::Fp8E4m3 => 1,
    }
}

/// Entry-point names of `paged_attention.cu`'s kernels for one head dimension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionNames {
    pub decode: &'static str,
    pub prefill: &'static str,
    pub decode_grouped: &'static str,
}

/// Entry-point names of the attention kernels for one head dimension and pool element.
pub fn attention_entry_points(head_dim: usize, kv: KvDtype) -> Option<AttentionNames> {
    let i = ATTENTION_HEAD_DIMS.iter().position(|&d| d == head_dim)?;
    let n = ATTENTION_HEAD_DIMS.len();
    let names = &PAGED_ATTENTION.entry_points[kv_index(kv) * 3 * n..];
    Some(AttentionNames {
        decode: names[i],
        prefill: names[i + n],
        decode_grouped: names[i + 2 * n],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every declared entry point is defined in its source (the attention ones through the
    /// `DEFINE_PAGED_ATTENTION(D)` macro), so loading by name cannot miss.
    #[test]
    fn entry_points_exist_in_sources() {
        for src in ALL {
            for name in src.entry_points {
                // Per head_dim through DEFINE_PAGED_ATTENTION(D) / DEFINE_FLASH_PREFILL(D),
                // per pool element through DEFINE_KV_CACHE (each defines both elements).
                let dim = name.rsplit_once("_d").map(|(_, d)| d);
                let defined = match dim.filter(|d| d.parse::<usize>().is_ok()) {
                    Some(dim) => ["DEFINE_PAGED_ATTENTION", "DEFINE_FLASH_PREFILL"]
                        .iter()
                        .any(|m| src.source.contains(&format!("{m}({dim})"))),
                    None if name.contains("cache_bf16") => {
                        src.source.contains("DEFINE_KV_CACHE(fp8_e4m3, _kvfp8)")
                            && src.source.contains("DEFINE_KV_CACHE(bf16, )")
                    }
                    None => src.source.lines().any(|line| {
                        line.starts_with("extern \"C\" __global__ void")
                            && line.contains(&format!(" {name}("))
                    }),
                };
                assert!(defined, "{name} not defined in {}.cu", src.name);
            }
        }
    }

    /// Every kernel may be launched with programmatic dependent launch, which lets it start
    /// before the kernel ahead of it has finished: each entry point must begin with
    /// `pdl_begin()` (the wait), before anything reads or writes memory.
    #[test]
    fn every_entry_point_begins_with_the_pdl_wait() {
        let mut entry_points = 0;
        for src in ALL {
            let mut rest = src.source;
            while let Some(at) = rest.find("extern \"C\" __global__") {
                rest = &rest[at + 1..];
                let body = &rest[rest.find('{').expect("a body") + 1..];
                // Skip the whitespace and the line continuations of macro-defined ones.
                let first = body.trim_start_matches(|c: char| c.is_whitespace() || c == '\\');
                let name: String = rest.lines().take(3).collect();
                assert!(
                    first.starts_with("pdl_begin();"),
                    "{}.cu: an entry point does not begin with pdl_begin(): {name}",
                    src.name
                );
                entry_points += 1;
            }
        }
        assert!(entry_points >= 28, "{entry_points} entry points found");
        assert!(COMMON.contains("griddepcontrol.wait"));
    }

    #[test]
    fn attention_names_by_head_dim() {
        assert_eq!(
            attention_entry_points(128, KvDtype::Bf16),
            Some(AttentionNames {
                decode: "paged_attention_decode_bf16_d128",
                prefill: "paged_attention_prefill_bf16_d128",
                decode_grouped: "paged_attention_decode_grouped_bf16_d128",
            })
        );
        assert_eq!(
            attention_entry_points(96, KvDtype::Fp8E4m3),
            Some(AttentionNames {
                decode: "paged_attention_decode_bf16_kvfp8_d96",
                prefill: "paged_attention_prefill_bf16_kvfp8_d96",
                decode_grouped: "paged_attention_decode_grouped_bf16_kvfp8_d96",
            })
        );
        assert_eq!(attention_entry_points(80, KvDtype::Bf16), None);
        assert_eq!(
            flash_prefill_entry_point(64, KvDtype::Bf16),
            Some("flash_prefill_bf16_d64")
        );
        assert_eq!(
            flash_prefill_entry_point(256, KvDtype::Fp8E4m3),
            Some("flash_prefill_bf16_kvfp8_d256")
        );
        assert_eq!(flash_prefill_entry_point(80, KvDtype::Fp8E4m3), None);
        assert_eq!(GEMV.entry_points.len(), GEMV_MAX_ROWS);
        for rows in 1..=GEMV_MAX_ROWS {
            assert_eq!(gemv_entry_point(rows), Some(&*format!("gemv_bf16_m{rows}")));
        }
        assert_eq!(gemv_entry_point(0), None);
        // A lane per (column, row) sum of a warp.
        for rows in 1..=GEMV_MAX_ROWS {
            assert!(gemv_columns(rows) * rows <= 32, "{rows} rows");
            assert!(GEMV.program().contains(&format!(
                "#define GEMV_COLUMNS_{rows} {}\n",
                gemv_columns(rows)
            )));
        }
        assert_eq!(gemv_entry_point(GEMV_MAX_ROWS + 1), None);
        assert_eq!(
            kv_cache_entry_points(KvDtype::Fp8E4m3),
            ("reshape_and_cache_bf16_kvfp8", "qkv_rope_cache_bf16_kvfp8")
        );
    }
}
