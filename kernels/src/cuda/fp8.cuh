// fp8 E4M3 ("fn": no infinities, NaN = S.1111.111, largest finite 448), the KV cache's
// one-byte element (`--kv-cache-dtype fp8`), as vLLM's unscaled fp8 cache stores it. Converted
// in software on every architecture: sm_80 has no fp8 instructions, and a decode step's cost
// is its memory reads, not these few integer operations.
//
// Written in plain C so that kernels/tests/fp8_host.rs can compile this file with the host's
// C++ compiler (FP8_FN, fp8_float_bits and fp8_bits_float defined there) and compare every
// conversion with the float8 crate's, which the CPU backend uses.

#ifndef FP8_FN
#define FP8_FN __device__ __forceinline__
#define fp8_float_bits(x) __float_as_uint(x)
#define fp8_bits_float(x) __uint_as_float(x)
#endif

typedef unsigned char fp8_e4m3;

// Exact: every E4M3 value is an f32 (and a bf16).
FP8_FN float fp8_e4m3_to_f32(fp8_e4m3 x) {
    const unsigned int sign = (unsigned int)(x & 0x80u) << 24;
    const unsigned int exponent = (x >> 3) & 0xfu;
    const unsigned int mantissa = x & 0x7u;
    if (exponent == 0xfu && mantissa == 0x7u) {
        return fp8_bits_float(sign | 0x7fc00000u);
    }
    if (exponent == 0) {  // zero or subnormal: mantissa * 2^-9
        return fp8_bits_float(sign | fp8_float_bits((float)mantissa * 0.001953125f));
    }
    return fp8_bits_float(sign | ((exponent + 120u) << 23) | (mantissa << 20));
}

// Round to nearest, ties to even; saturated at ±448 (CUDA's __NV_SATFINITE); NaN stays NaN.
FP8_FN fp8_e4m3 f32_to_fp8_e4m3(float x) {
    const unsigned int bits = fp8_float_bits(x);
    const unsigned int sign = (bits >> 24) & 0x80u;
    const unsigned int magnitude = bits & 0x7fffffffu;
    if (magnitude > 0x7f800000u) {
        return (fp8_e4m3)(sign | 0x7fu);
    }
    if (magnitude >= 0x43e00000u) {  // 448 and up (infinity too)
        return (fp8_e4m3)(sign | 0x7eu);
    }
    if (magnitude < 0x3c800000u) {
        // Below 2^-6, E4M3's subnormals: m * 2^-9 for m in 0..7. Scaling by 2^9 is exact and
        // leaves m + fraction; 8 rounds up into the smallest normal, whose code is 0x08.
        const float scaled = fp8_bits_float(magnitude) * 512.0f;
        unsigned int m = (unsigned int)scaled;
        const float rest = scaled - (float)m;
        if (rest > 0.5f || (rest == 0.5f && (m & 1u))) {
            m += 1;
        }
        return (fp8_e4m3)(sign | m);
    }
    // Normal: keep 3 of the 23 mantissa bits, rounding the 20 dropped ones to nearest even. A
    // carry out of the mantissa moves into the exponent, as the encoding is monotonic; below
    // 448 it never reaches the NaN code.
    unsigned int code = (((magnitude >> 23) - 120u) << 3) | ((magnitude >> 20) & 0x7u);
    const unsigned int dropped = magnitude & 0xfffffu;
    if (dropped > 0x80000u || (dropped == 0x80000u && (code & 1u))) {
        code += 1;
    }
    return (fp8_e4m3)(sign | code);
}
