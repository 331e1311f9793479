//! A keyed pseudo-random permutation of `0..n` that needs no table.
//!
//! A Feistel network over the smallest power of two `2^bits >= n`, with cycle walking:
//! apply the network until the value lands below `n`. Because the network is a bijection
//! on `0..2^bits` and `2^bits < 2n`, each position costs fewer than two network passes
//! on average, memory is O(1) whatever `n` is (a billion rows cost the same 80 bytes),
//! and any position is computed directly, which makes resumption and sharding free.

use crate::util::mix;

const ROUNDS: usize = 6;

/// A bijection of `0..n`, keyed by a 64-bit key (stokehold derives it from seed and epoch).
#[derive(Debug, Clone)]
pub struct Permutation {
    n: u64,
    bits: u32,
    /// Bits of the low half that feed the round function.
    low: u32,
    keys: [u64; ROUNDS],
}

impl Permutation {
    /// The permutation of `0..n` for `key`.
    pub fn new(n: u64, key: u64) -> Permutation {
        let bits = if n <= 1 {
            0
        } else {
            64 - (n - 1).leading_zeros()
        };
        let mut keys = [0u64; ROUNDS];
        let mut k = mix(key ^ 0x5045_524d_5554_4521);
        for slot in &mut keys {
            k = mix(k.wrapping_add(0x9e37_79b9_7f4a_7c15));
            *slot = k;
        }
        Permutation {
            n,
            bits,
            low: bits / 2,
            keys,
        }
    }

    /// The size of the domain.
    pub fn len(&self) -> u64 {
        self.n
    }

    /// Whether the domain is empty.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// The image of `x`.
    ///
    /// # Panics
    /// If `x >= len()` (an internal invariant: callers pass positions they computed).
    #[inline]
    pub fn apply(&self, x: u64) -> u64 {
        assert!(
            x < self.n,
            "position {x} outside a permutation of {}",
            self.n
        );
        let mut y = x;
        loop {
            y = self.encrypt(y);
            if y < self.n {
                return y;
            }
        }
    }

    /// The `x` whose image is `y`.
    ///
    /// # Panics
    /// If `y >= len()`.
    pub fn invert(&self, y: u64) -> u64 {
        assert!(y < self.n, "value {y} outside a permutation of {}", self.n);
        let mut x = y;
        loop {
            x = self.decrypt(x);
            if x < self.n {
                return x;
            }
        }
    }

    /// Replaces each position in `xs` by its image: the same values as
    /// [`apply`](Permutation::apply), several times faster on a batch because the first
    /// pass is branch-free and lets the CPU overlap the independent rounds of many
    /// positions; only the few that land at or past `len()` walk again.
    ///
    /// # Panics
    /// If a position is `>= len()`.
    pub fn apply_in_place(&self, xs: &mut [u64]) {
        assert!(
            xs.iter().all(|&x| x < self.n),
            "position outside a permutation of {}",
            self.n
        );
        for x in xs.iter_mut() {
            *x = self.encrypt(*x);
        }
        for x in xs.iter_mut() {
            while *x >= self.n {
                *x = self.encrypt(*x);
            }
        }
    }

    /// The round function: the top `high_bits` bits of a full-avalanche hash of the low
    /// part and the round key. (A single multiplication is nearly linear in a low part
    /// of a few bits: on 33 to 64 items its networks came out close to involutions,
    /// some leaving 20 of 48 items in place.)
    #[inline(always)]
    fn round(lo: u64, k: u64, high_bits: u32) -> u64 {
        mix(lo ^ k) >> (64 - high_bits)
    }

    /// One pass of the network on `bits`-bit values. Each round splits the value into
    /// a high part (`bits - low` bits) and a low part (`low` bits), and returns
    /// `low << (bits - low) | (high ^ F(low))`: invertible whatever the split sizes.
    #[inline]
    fn encrypt(&self, mut x: u64) -> u64 {
        if self.bits == 0 {
            return x;
        }
        let high_bits = self.bits - self.low;
        let low_mask = (1u64 << self.low) - 1;
        for &k in &self.keys {
            let lo = x & low_mask;
            let hi = x >> self.low;
            x = (lo << high_bits) | (hi ^ Self::round(lo, k, high_bits));
        }
        x
    }

    fn decrypt(&self, mut y: u64) -> u64 {
        if self.bits == 0 {
            return y;
        }
        let high_bits = self.bits - self.low;
        let high_mask = (1u64 << high_bits) - 1;
        for &k in self.keys.iter().rev() {
            let lo = y >> high_bits;
            let hi = (y & high_mask) ^ Self::round(lo, k, high_bits);
            y = (hi << self.low) | lo;
        }
        y
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn is_a_bijection_for_small_sizes() {
        for n in 0..300u64 {
            let p = Permutation::new(n, n * 31 + 7);
            let mut seen = vec![false; n as usize];
            for x in 0..n {
                let y = p.apply(x);
                assert!(!seen[y as usize], "n={n}: {y} twice");
                seen[y as usize] = true;
                assert_eq!(p.invert(y), x);
            }
        }
    }

    #[test]
    fn batched_application_matches_one_by_one() {
        for n in [1u64, 2, 3, 100, 1000, 200_000, 1 << 20, (1 << 20) + 1] {
            let p = Permutation::new(n, n ^ 77);
            let mut xs: Vec<u64> = (0..n.min(5000)).map(|i| (i * 7919) % n).collect();
            let one: Vec<u64> = xs.iter().map(|&x| p.apply(x)).collect();
            p.apply_in_place(&mut xs);
            assert_eq!(xs, one, "n={n}");
        }
    }

    #[test]
    fn positions_spread_uniformly() {
        // Where position 0 lands, over many keys: a chi-square test against uniform over
        // 16 buckets (15 degrees of freedom; 37.7 is the 0.1% critical value).
        let n = 1000u64;
        let mut buckets = [0f64; 16];
        let keys = 16_000u64;
        for k in 0..keys {
            buckets[(Permutation::new(n, k).apply(0) * 16 / n) as usize] += 1.0;
        }
        let expected = keys as f64 / 16.0;
        let chi2: f64 = buckets
            .iter()
            .map(|b| (b - expected).powi(2) / expected)
            .sum();
        assert!(chi2 < 37.7, "chi-square {chi2}: {buckets:?}");
    }

    #[test]
    fn small_domains_leave_as_few_items_in_place_as_a_random_shuffle() {
        // A uniform shuffle leaves one item in place on average, and 8 or more about once
        // in 100,000 shuffles; 33 to 64 items are where a weak round function showed.
        for n in [5u64, 12, 33, 40, 48, 56, 64, 100] {
            let keys = 2000u64;
            let mut fixed = 0u64;
            for k in 0..keys {
                let p = Permutation::new(n, k);
                let here = (0..n).filter(|&x| p.apply(x) == x).count() as u64;
                assert!(here < 8, "n={n}, key {k}: {here} items in place");
                fixed += here;
            }
            let mean = fixed as f64 / keys as f64;
            assert!(
                (0.85..1.15).contains(&mean),
                "n={n}: {mean} items in place on average"
            );
        }
    }

    #[test]
    fn keys_give_different_orders() {
        let a: Vec<u64> = (0..1000)
            .map(|x| Permutation::new(1000, 1).apply(x))
            .collect();
        let b: Vec<u64> = (0..1000)
            .map(|x| Permutation::new(1000, 2).apply(x))
            .collect();
        let same = a.iter().zip(&b).filter(|(a, b)| a == b).count();
        assert!(same < 20, "{same} fixed points between two keys");
    }

    #[test]
    fn looks_shuffled() {
        // Displacement of a uniform shuffle averages n/3; a weak permutation stays near x.
        let n = 100_000u64;
        let p = Permutation::new(n, 42);
        let mean = (0..n).map(|x| p.apply(x).abs_diff(x) as f64).sum::<f64>() / n as f64;
        assert!(
            (mean / n as f64 - 1.0 / 3.0).abs() < 0.02,
            "mean displacement {mean}"
        );
        // Neighbours land far apart.
        let near = (0..n - 1)
            .filter(|&x| p.apply(x).abs_diff(p.apply(x + 1)) < 100)
            .count();
        assert!(near < 500, "{near} neighbours stayed within 100");
    }

    #[test]
    fn huge_domains_need_no_table() {
        let p = Permutation::new(1_000_000_007, 9);
        for x in [0, 1, 999_999_999, 1_000_000_006] {
            let y = p.apply(x);
            assert!(y < 1_000_000_007);
            assert_eq!(p.invert(y), x);
        }
    }
}
