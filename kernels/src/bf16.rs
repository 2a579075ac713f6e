//! bf16 <-> f32 conversion on raw bits.
//!
//! Tensors cross the host/device boundary as `u16` bf16 bits, so the crate needs no half-float
//! dependency and the CUDA sources need no `cuda_bf16.h` (NVRTC then compiles them without any
//! include path). The rounding here is the one the kernels use (`f32_to_bf16` in
//! `cuda/common.cuh`): round to nearest, ties to even, NaN kept NaN.

/// bf16 is the upper half of an f32, so widening is exact.
pub fn to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// Narrow an f32 to bf16, rounding to nearest even.
pub fn from_f32(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        // Keep the sign, force a quiet-NaN payload so the result cannot round to infinity.
        return ((bits >> 16) as u16) | 0x0040;
    }
    // Adding 0x7fff plus the lowest kept bit rounds half to even; overflow carries into the
    // exponent, which correctly rounds the largest finite values up to infinity.
    let round = 0x7fff + ((bits >> 16) & 1);
    ((bits + round) >> 16) as u16
}

/// Round an f32 through bf16 (what storing and reloading a value on the GPU does to it).
pub fn round(x: f32) -> f32 {
    to_f32(from_f32(x))
}

pub fn slice_from_f32(xs: &[f32]) -> Vec<u16> {
    xs.iter().copied().map(from_f32).collect()
}

pub fn slice_to_f32(xs: &[u16]) -> Vec<f32> {
    xs.iter().copied().map(to_f32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_values_round_trip() {
        for x in [0.0f32, -0.0, 1.0, -2.5, 0.15625, 65536.0, f32::INFINITY] {
            assert_eq!(round(x).to_bits(), x.to_bits(), "{x}");
        }
        assert_eq!(from_f32(1.0), 0x3f80);
        assert_eq!(to_f32(0xc020), -2.5);
    }

    #[test]
    fn rounds_to_nearest_even() {
        // 1 + 2^-8 is exactly halfway between bf16 1.0 and 1 + 2^-7: ties go to the even 1.0.
        assert_eq!(from_f32(1.0 + 1.0 / 256.0), 0x3f80);
        // 1 + 3*2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6: goes up to even.
        assert_eq!(from_f32(1.0 + 3.0 / 256.0), 0x3f82);
        // Just above halfway rounds up.
        assert_eq!(from_f32(f32::from_bits(0x3f80_8001)), 0x3f81);
        // Largest finite f32 overflows to +inf in bf16.
        assert_eq!(from_f32(f32::MAX), 0x7f80);
    }

    #[test]
    fn nan_stays_nan() {
        assert!(to_f32(from_f32(f32::NAN)).is_nan());
        // A NaN whose payload lives only in the low 16 bits must not become infinity.
        assert!(to_f32(from_f32(f32::from_bits(0x7f80_0001))).is_nan());
    }
}
