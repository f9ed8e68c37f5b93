//! A tiny lock-free source of randomness for sampling.
//!
//! Each `sample` call draws one stream index from an atomic counter and seeds a
//! SplitMix64 generator from `(store seed, stream index)`. No generator state is
//! shared between threads, so sampling never takes a lock; with a fixed seed a
//! single-threaded sequence of calls is reproducible.

/// SplitMix64 (Steele, Lea, Flood 2014): 64-bit state, passes BigCrush, tiny.
pub(crate) struct SplitMix64(u64);

impl SplitMix64 {
    pub(crate) fn for_stream(seed: u64, stream: u64) -> Self {
        let mut r = SplitMix64(seed ^ stream.wrapping_mul(0xD1B5_4A32_D192_ED03));
        r.next_u64();
        r
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform integer in `0..n` (`n > 0`), by multiply-shift (bias < n / 2^64).
    pub(crate) fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }

    /// Uniform float in `[0, 1)` with 53 random bits.
    pub(crate) fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// A seed from the clock and an address, for stores built without a seed.
pub(crate) fn entropy_seed() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let local = 0u8;
    let addr = &local as *const u8 as u64;
    SplitMix64::for_stream(nanos, addr).next_u64()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_reproducible_and_in_range() {
        let mut a = SplitMix64::for_stream(7, 3);
        let mut b = SplitMix64::for_stream(7, 3);
        for _ in 0..100 {
            assert_eq!(a.next_u64(), b.next_u64());
            let x = a.below(10);
            assert!(x < 10);
            let u = a.unit();
            assert!((0.0..1.0).contains(&u));
            b.below(10);
            b.unit();
        }
        let mut c = SplitMix64::for_stream(7, 4);
        assert_ne!(SplitMix64::for_stream(7, 3).next_u64(), c.next_u64());
    }
}
