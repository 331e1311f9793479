//! Property tests of the parsers and permutations on arbitrary input.

use proptest::prelude::*;
use stokehold::{NpyHeader, Order, Permutation, Shard, Shuffle};

fn valid_header() -> Vec<u8> {
    stokehold::gen::npy_header(stokehold::DType::F32, &[5, 3])
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn npy_header_parsing_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
        let _ = NpyHeader::parse(&bytes);
        let mut prefixed = b"\x93NUMPY\x01\x00".to_vec();
        prefixed.extend_from_slice(&bytes);
        let _ = NpyHeader::parse(&prefixed);
    }

    #[test]
    fn mutated_headers_never_panic(edits in proptest::collection::vec((0usize..128, any::<u8>()), 1..6)) {
        let mut h = valid_header();
        for (at, b) in edits {
            let at = at % h.len();
            h[at] = b;
        }
        if let Ok(parsed) = NpyHeader::parse(&h) {
            // Whatever parses is self-consistent.
            prop_assert!(!parsed.shape.is_empty());
            prop_assert!(parsed.data_offset as usize <= h.len());
        }
    }

    #[test]
    fn block_shuffle_is_a_bijection(len in 1u64..3000, rows in 1u64..400, window in 1u64..40, seed: u64, epoch in 0u64..100) {
        let s = Shuffle::Block { seed, block_rows: rows, window };
        let o = Order::new(len, s, Shard::single(), 1, false).unwrap();
        let e = o.epoch(epoch);
        let mut seen = vec![false; len as usize];
        for p in 0..len {
            let i = e.global(p);
            prop_assert!(i < len);
            prop_assert!(!seen[i as usize], "{} twice", i);
            seen[i as usize] = true;
        }
    }

    #[test]
    fn permutation_inverts(n in 1u64..u64::MAX / 2, key: u64, xs in proptest::collection::vec(any::<u64>(), 1..20)) {
        let p = Permutation::new(n, key);
        for x in xs {
            let x = x % n;
            let y = p.apply(x);
            prop_assert!(y < n);
            prop_assert_eq!(p.invert(y), x);
        }
    }
}
