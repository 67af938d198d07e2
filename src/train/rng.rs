//! A small deterministic random generator (SplitMix64) for data generation, shuffling and
//! parameter initialisation: the same seed gives the same numbers on every machine and rank.

/// SplitMix64 (Steele, Lea, Flood 2014): tiny, fast, and good enough for data and init.
#[derive(Clone, Debug)]
pub(crate) struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    /// An independent stream for `(seed, tags...)`, e.g. `(seed, [split, sample index])`.
    pub fn derive(seed: u64, tags: &[u64]) -> Self {
        let mut state = Rng::new(seed ^ 0x6a09_e667_f3bc_c908);
        for &tag in tags {
            let mixed = state.next_u64() ^ tag.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            state = Rng(mixed);
            state.next_u64();
        }
        state
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `[low, high)`.
    pub fn uniform(&mut self, low: f64, high: f64) -> f64 {
        low + (high - low) * self.unit()
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.unit(); // (0, 1]: ln is finite
        let u2 = self.unit();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// Uniform in `0..n` (`n > 0`), without modulo bias worth noticing (Lemire's multiply).
    pub fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }

    /// Fisher-Yates.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i + 1);
            items.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_deterministic_and_distinct() {
        let a: Vec<u64> = (0..4).map(|_| Rng::derive(7, &[1, 2]).next_u64()).collect();
        assert!(a.windows(2).all(|w| w[0] == w[1]));
        let mut x = Rng::derive(7, &[1, 2]);
        let mut y = Rng::derive(7, &[2, 1]);
        assert_ne!(x.next_u64(), y.next_u64());
    }

    #[test]
    fn unit_and_below_stay_in_range() {
        let mut rng = Rng::new(3);
        for _ in 0..10_000 {
            let u = rng.unit();
            assert!((0.0..1.0).contains(&u));
            assert!(rng.below(7) < 7);
        }
        let mean: f64 = (0..20_000).map(|_| rng.normal()).sum::<f64>() / 20_000.0;
        assert!(mean.abs() < 0.05, "{mean}");
    }
}
