//! fp8 E4M3 on the host, for the references and the tests of the fp8 KV pools: the float8
//! crate's conversions (round to nearest even, saturated at ±448), which the CPU backend's fp8
//! cache uses too. `tests/fp8_host.rs` compiles the CUDA kernels' own conversions
//! (`cuda/fp8.cuh`) on the host and checks they give the same bits.

use float8::F8E4M3;

/// `x` as an E4M3 byte.
pub fn from_f32(x: f32) -> u8 {
    F8E4M3::from_f32(x).to_bits()
}

/// An E4M3 byte's value (exact).
pub fn to_f32(byte: u8) -> f32 {
    F8E4M3::from_bits(byte).to_f32()
}

/// What an fp8 pool holds of `x`.
pub fn round(x: f32) -> f32 {
    to_f32(from_f32(x))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_to_nearest_even_and_saturates() {
        assert_eq!(round(0.3), 0.3125);
        assert_eq!(round(17.0), 16.0); // a tie: to the even mantissa
        assert_eq!(round(19.0), 20.0); // a tie: to the even mantissa, upwards
        assert_eq!(round(1000.0), 448.0);
        assert_eq!(round(-f32::INFINITY), -448.0);
        assert_eq!(round(0.001953125), 0.001953125); // the smallest subnormal, 2^-9
        assert_eq!(round(0.0009765625), 0.0); // half of it: a tie, to even (0)
        assert!(round(f32::NAN).is_nan());
    }
}
