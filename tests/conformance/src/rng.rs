//! SplitMix64: small and seedable; the same seed gives the same shapes and values everywhere.

pub struct Rng(u64);

impl Rng {
    /// A generator for one case: `seed` mixed with the case's name, so that each case's draws
    /// do not depend on which cases ran before it.
    pub fn for_case(seed: u64, name: &str) -> Rng {
        let mut h = 0xcbf2_9ce4_8422_2325u64; // FNV-1a
        for b in name.bytes() {
            h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
        }
        Rng(seed ^ h)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u32, hi: u32) -> u32 {
        lo + (self.next_u64() % (hi as u64 - lo as u64 + 1)) as u32
    }

    /// Uniform in `[lo, hi)`.
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        let u = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        lo + (hi - lo) * u
    }

    /// `n` values uniform in `[-1, 1)`.
    pub fn vector(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.uniform(-1.0, 1.0)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_stay_in_range_and_repeat_with_the_seed() {
        let mut a = Rng::for_case(7, "x");
        let mut b = Rng::for_case(7, "x");
        for _ in 0..1000 {
            let r = a.range(3, 9);
            assert!((3..=9).contains(&r));
            assert_eq!(r, b.range(3, 9));
            let u = a.uniform(-1.0, 1.0);
            assert!((-1.0..1.0).contains(&u));
            assert_eq!(u, b.uniform(-1.0, 1.0));
        }
        assert_ne!(Rng::for_case(7, "x").next_u64(), Rng::for_case(7, "y").next_u64());
    }
}
