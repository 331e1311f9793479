//! Property tests of the parsers and permutations on arbitrary input.

use proptest::prelude::*;
use stokehold::{DType, NpyHeader, Order, Permutation, Shard, Shuffle};

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
    fn headers_as_numpy_writes_them_parse_back(
        d in 0usize..DType::ALL.len(),
        shape in proptest::collection::vec(1u64..1000, 1..6),
        keys in 0usize..6,
        version2: bool,
    ) {
        // Any order of the three keys, format 1.0 or 2.0 (a four-byte length), padded
        // to 64 bytes with a newline, as NumPy pads.
        let dtype = DType::ALL[d];
        let dims: Vec<String> = shape.iter().map(u64::to_string).collect();
        let tuple = match dims.len() {
            1 => format!("({},)", dims[0]),
            _ => format!("({})", dims.join(", ")),
        };
        let mut entries = [
            format!("'descr': '{}'", dtype.descr()),
            "'fortran_order': False".to_string(),
            format!("'shape': {tuple}"),
        ];
        entries.rotate_left(keys % 3);
        if keys >= 3 {
            entries.swap(0, 1);
        }
        let dict = format!("{{{}, }}", entries.join(", "));
        let prefix = if version2 { 12 } else { 10 };
        let total = (prefix + dict.len() + 1).next_multiple_of(64);
        let mut h = b"\x93NUMPY".to_vec();
        h.extend_from_slice(if version2 { &[2, 0] } else { &[1, 0] });
        let len = total - prefix;
        match version2 {
            true => h.extend_from_slice(&(len as u32).to_le_bytes()),
            false => h.extend_from_slice(&(len as u16).to_le_bytes()),
        }
        h.extend_from_slice(dict.as_bytes());
        h.resize(total - 1, b' ');
        h.push(b'\n');
        let parsed = NpyHeader::parse(&h).map_err(|e| TestCaseError::fail(format!("{dict}: {e}")))?;
        prop_assert_eq!(parsed.dtype, dtype);
        prop_assert_eq!(&parsed.shape, &shape);
        prop_assert_eq!(parsed.data_offset, total as u64);
        prop_assert_eq!(parsed.version, (if version2 { 2 } else { 1 }, 0));
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
