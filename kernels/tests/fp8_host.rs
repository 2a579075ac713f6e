//! The CUDA kernels' fp8 conversions (`src/cuda/fp8.cuh`, plain C) compiled with the host's
//! C++ compiler and checked against the float8 crate's (`infer_kernels::fp8`, which the CPU
//! backend and the GPU tests' references use): every E4M3 code decoded, and the encoding of
//! every f32 whose low 12 bits are zero (each exponent, each rounding decision, the ties) plus
//! a million pseudo-random f32 bit patterns (the sticky bits below the ties). Needs `c++`
//! (g++ or clang), as building the project's C dependencies does.

use std::process::Command;

const HARNESS: &str = r#"
#include <cstdio>
#include <cstring>
static inline unsigned int fp8_float_bits(float x) { unsigned int u; memcpy(&u, &x, 4); return u; }
static inline float fp8_bits_float(unsigned int u) { float x; memcpy(&x, &u, 4); return x; }
#define FP8_FN static inline
#include "fp8.cuh"
static unsigned int next(unsigned long long* s) {
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return (unsigned int)(*s >> 32);
}
int main() {
    for (int c = 0; c < 256; ++c) {
        const unsigned int u = fp8_float_bits(fp8_e4m3_to_f32((fp8_e4m3)c));
        fwrite(&u, 4, 1, stdout);
    }
    for (unsigned int hi = 0; hi < (1u << 20); ++hi) {
        const unsigned char c = f32_to_fp8_e4m3(fp8_bits_float(hi << 12));
        fwrite(&c, 1, 1, stdout);
    }
    unsigned long long s = 42;
    for (int i = 0; i < (1 << 20); ++i) {
        const unsigned char c = f32_to_fp8_e4m3(fp8_bits_float(next(&s)));
        fwrite(&c, 1, 1, stdout);
    }
    return 0;
}
"#;

/// The same sequence as the harness's `next`.
fn lcg(state: &mut u64) -> u32 {
    *state = state
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (*state >> 32) as u32
}

/// Same bits, or both NaN (of either sign's NaN code).
fn same(got: u8, input: f32) -> bool {
    let want = infer_kernels::fp8::from_f32(input);
    if input.is_nan() {
        got & 0x7f == 0x7f && want & 0x7f == 0x7f
    } else {
        got == want
    }
}

#[test]
fn cuda_fp8_conversions_match_the_host_reference_bit_for_bit() {
    let dir = std::env::temp_dir().join(format!("infer-fp8-host-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = concat!(env!("CARGO_MANIFEST_DIR"), "/src/cuda");
    std::fs::write(dir.join("harness.cpp"), HARNESS).unwrap();
    let exe = dir.join("harness");
    let built = Command::new("c++")
        .args(["-O1", "-I", src, "-o"])
        .arg(&exe)
        .arg(dir.join("harness.cpp"))
        .status()
        .expect("c++ (a host C++ compiler) is needed to compile fp8.cuh on the host");
    assert!(built.success(), "fp8.cuh did not compile on the host");
    let out = Command::new(&exe).output().unwrap();
    assert!(out.status.success());
    let bytes = out.stdout;
    assert_eq!(bytes.len(), 256 * 4 + 2 * (1 << 20));
    std::fs::remove_dir_all(&dir).ok();

    for code in 0..256usize {
        let got = f32::from_bits(u32::from_le_bytes(
            bytes[code * 4..code * 4 + 4].try_into().unwrap(),
        ));
        let want = infer_kernels::fp8::to_f32(code as u8);
        assert!(
            got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
            "decode {code:#04x}: {got} vs {want}"
        );
    }
    let encoded = &bytes[256 * 4..];
    let mut mismatches = Vec::new();
    for hi in 0..1u32 << 20 {
        let x = f32::from_bits(hi << 12);
        if !same(encoded[hi as usize], x) {
            mismatches.push(x);
        }
    }
    let mut state = 42u64;
    for &got in &encoded[1 << 20..] {
        let x = f32::from_bits(lcg(&mut state));
        if !same(got, x) {
            mismatches.push(x);
        }
    }
    assert!(
        mismatches.is_empty(),
        "{} encodings differ, first {:?}",
        mismatches.len(),
        &mismatches[..mismatches.len().min(8)]
    );
}
