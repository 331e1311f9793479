use super::*;

fn column(name: &str, dtype: DType, shape: &[u64]) -> Column {
    let elems: u64 = shape.iter().product();
    Column {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
        row_bytes: elems as usize * dtype.size(),
    }
}

/// Pixel `(ch, y, x)` of an augmented image, straight from the definition.
fn reference(a: &Augmenter, src: &[u8], d: Draw, ch: usize, y: usize, x: usize) -> u8 {
    let (c, h, w) = a.geometry();
    let sy = y as i64 + i64::from(d.dy);
    let sx = match d.flip {
        true => (w - 1 - x) as i64,
        false => x as i64,
    } + i64::from(d.dx);
    if !(0..h as i64).contains(&sy) || !(0..w as i64).contains(&sx) {
        return a.fill();
    }
    let (sy, sx) = (sy as usize, sx as usize);
    match a.channels_last() {
        false => src[(ch * h + sy) * w + sx],
        true => src[(sy * w + sx) * c + ch],
    }
}

fn at(a: &Augmenter, ch: usize, y: usize, x: usize) -> usize {
    let (c, h, w) = a.geometry();
    match a.channels_last() {
        false => (ch * h + y) * w + x,
        true => (y * w + x) * c + ch,
    }
}

/// Applies `augment` to `n` samples of pseudo-random images of `shape`, with a label
/// column beside them, and checks every pixel and label against [`reference`].
fn check(augment: Augment, shape: &[u64], n: usize, epoch: u64) {
    let columns = [column("y", DType::I64, &[]), column("x", DType::U8, shape)];
    let a = augment.bind(&columns).unwrap();
    let image: usize = shape.iter().product::<u64>() as usize;
    let pixels: Vec<u8> = (0..n * image)
        .map(|i| (crate::util::mix(i as u64) >> 3) as u8)
        .collect();
    let labels: Vec<u8> = (0..n as i64).flat_map(|v| (v * 3).to_ne_bytes()).collect();
    let indices: Vec<u64> = (0..n as u64).map(|i| i * 7 + 1).collect();
    let out_row = a.columns()[1].row_bytes;
    let (mut y, mut x) = (vec![0u8; n * 8], vec![0u8; n * out_row + 4]);
    // Offset by one byte where the output is float32: the unaligned path, then aligned.
    for shift in [0usize, 1] {
        let shift = shift * usize::from(a.table().is_some());
        let xs = &mut x[shift..shift + n * out_row];
        a.apply(epoch, &indices, &[&labels, &pixels], &mut [&mut y, xs])
            .unwrap();
        assert_eq!(y, labels);
        let (c, h, w) = a.geometry();
        for (k, &i) in indices.iter().enumerate() {
            let d = augment.draw(epoch, i);
            let src = &pixels[k * image..][..image];
            for (ch, yy, xx) in
                (0..c).flat_map(|ch| (0..h).flat_map(move |yy| (0..w).map(move |xx| (ch, yy, xx))))
            {
                let want = reference(&a, src, d, ch, yy, xx);
                let j = at(&a, ch, yy, xx);
                match a.table() {
                    None => assert_eq!(
                        xs[k * image + j],
                        want,
                        "sample {k} pixel {ch},{yy},{xx} {d:?}"
                    ),
                    Some(t) => {
                        let b = &xs[(k * image + j) * 4..][..4];
                        let got = f32::from_ne_bytes(b.try_into().unwrap());
                        assert_eq!(got.to_bits(), t[ch * 256 + want as usize].to_bits());
                    }
                }
            }
        }
    }
}

#[test]
fn augmented_pixels_match_the_definition() {
    check(Augment::new("x", 1).crop(4).flip(true), &[3, 32, 32], 9, 0);
    check(
        Augment::new("x", 2).crop(3).flip(true).fill(17),
        &[2, 5, 7],
        40,
        3,
    );
    check(Augment::new("x", 3).flip(true), &[6, 4], 20, 1);
    check(Augment::new("x", 4).crop(9), &[1, 3, 4], 30, 2);
    check(
        Augment::new("x", 5).crop(2).flip(true).channels_last(true),
        &[5, 6, 3],
        25,
        4,
    );
    check(
        Augment::new("x", 6)
            .crop(4)
            .flip(true)
            .normalize(&[0.5, 0.4, 0.3], &[0.2, 0.25, 0.3]),
        &[3, 8, 8],
        16,
        5,
    );
    check(
        Augment::new("x", 7)
            .crop(1)
            .flip(true)
            .normalize(&[0.5], &[0.5])
            .channels_last(true),
        &[4, 4, 3],
        16,
        0,
    );
    check(Augment::new("x", 8), &[2, 3, 3], 4, 0);
}

#[test]
fn a_known_draw_moves_the_image() {
    // One 3x3 image, its pixels 1..=9; find a draw of dy = 1, dx = -1, flipped.
    let columns = [column("x", DType::U8, &[3, 3])];
    let (epoch, sample) = (0..)
        .flat_map(|e| (0..64u64).map(move |s| (e, s)))
        .find(|&(e, s)| {
            Augment::new("x", 0).crop(1).flip(true).draw(e, s)
                == Draw {
                    dy: 1,
                    dx: -1,
                    flip: true,
                }
        })
        .unwrap();
    let a = Augment::new("x", 0).crop(1).flip(true).fill(0);
    let b = a.bind(&columns).unwrap();
    let src: Vec<u8> = (1..=9).collect();
    let mut out = vec![0u8; 9];
    b.apply(epoch, &[sample], &[&src], &mut [&mut out]).unwrap();
    // Row y reads input row y + 1; column x reads input column (2 - x) - 1.
    assert_eq!(out, [5, 4, 0, 8, 7, 0, 0, 0, 0]);
}

#[test]
fn draws_cover_the_offsets_and_flip_half_the_time() {
    let a = Augment::new("x", 11).crop(2).flip(true);
    let mut seen = [[0u32; 5]; 5];
    let mut flips = 0;
    for i in 0..10_000 {
        let d = a.draw(3, i);
        seen[(d.dy + 2) as usize][(d.dx + 2) as usize] += 1;
        flips += u32::from(d.flip);
    }
    // 400 expected in each of the 25 cells.
    assert!(
        seen.iter().flatten().all(|&k| (300..500).contains(&k)),
        "{seen:?}"
    );
    assert!((4_700..5_300).contains(&flips), "{flips}");
    let draws = |seed, epoch| -> Vec<Draw> {
        let a = Augment::new("x", seed).crop(2).flip(true);
        (0..200).map(|i| a.draw(epoch, i)).collect()
    };
    assert_eq!(draws(1, 0), draws(1, 0));
    assert_ne!(draws(1, 0), draws(1, 1));
    assert_ne!(draws(1, 0), draws(2, 0));
    let none = Augment::new("x", 1);
    assert!((0..100).all(|i| none.draw(0, i)
        == Draw {
            dy: 0,
            dx: 0,
            flip: false
        }));
}

#[test]
fn columns_that_are_not_images_are_refused() {
    let cols = [
        column("x", DType::U8, &[3, 8, 8]),
        column("y", DType::I64, &[]),
        column("f", DType::F32, &[3, 8, 8]),
        column("v", DType::U8, &[64]),
    ];
    let err = |a: Augment| a.bind(&cols).unwrap_err().to_string();
    assert!(err(Augment::new("z", 0)).contains("no such column"));
    assert!(err(Augment::new("f", 0)).contains("uint8"));
    assert!(err(Augment::new("v", 0)).contains("(64,)"));
    assert!(err(Augment::new("y", 0)).contains("int64"));
    assert!(err(Augment::new("x", 0).crop(MAX_PAD + 1)).contains("at most"));
    assert!(err(Augment::new("x", 0).normalize(&[0.5, 0.5], &[0.2])).contains("2 values of mean"));
    assert!(err(Augment::new("x", 0).normalize(&[0.5], &[0.0])).contains("positive"));
    assert!(err(Augment::new("x", 0).normalize(&[f32::NAN], &[1.0])).contains("not a number"));
    let ok = Augment::new("x", 0)
        .normalize(&[0.5], &[0.5])
        .bind(&cols)
        .unwrap();
    assert_eq!(ok.columns()[0].dtype, DType::F32);
    assert_eq!(ok.columns()[0].row_bytes, 3 * 64 * 4);
    assert_eq!(ok.columns()[1], cols[1]);
    assert_eq!(ok.table().unwrap()[255], 1.0);
    assert_eq!(ok.table().unwrap()[0], -1.0);
}
