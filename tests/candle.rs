//! Batches as candle tensors (feature `candle`): shapes, types, values, and example 07
//! trained end to end.
#![cfg(feature = "candle")]

mod common;

use candle_core::{DType as CDType, Device};
use stokehold::interop::candle::{column, tensors};
use stokehold::{Loader, NpyDataset, Shuffle};

const DIGITS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/datasets/digits");

#[test]
fn columns_become_tensors_of_the_same_values() {
    let ds = NpyDataset::open(DIGITS).unwrap();
    let mut loader = Loader::builder(ds)
        .batch_size(100)
        .shuffle(Shuffle::Full { seed: 1 })
        .build()
        .unwrap();
    let batch = loader.epoch(0).unwrap().next().unwrap().unwrap();
    let t = tensors(&batch, &Device::Cpu).unwrap();
    assert_eq!(t.len(), 2);
    assert_eq!((t[0].dims(), t[0].dtype()), (&[100, 8, 8][..], CDType::U8));
    assert_eq!((t[1].dims(), t[1].dtype()), (&[100][..], CDType::I64));
    let x: Vec<u8> = t[0].flatten_all().unwrap().to_vec1().unwrap();
    assert_eq!(x, batch.column::<u8>(0).unwrap());
    let y: Vec<i64> = t[1].to_vec1().unwrap();
    assert_eq!(y, batch.column::<i64>(1).unwrap());
}

#[test]
fn a_batch_of_indices_only_is_refused() {
    let ds = NpyDataset::open(DIGITS).unwrap();
    let mut loader = Loader::builder(ds).batch_size(100).build().unwrap();
    let batch = loader.epoch_indices(0).unwrap().next().unwrap().unwrap();
    let err = tensors(&batch, &Device::Cpu).unwrap_err();
    assert!(err.to_string().contains("indices only"), "{err}");
}

#[test]
fn token_ids_widen_to_u32() {
    // candle has no u16: token windows arrive as u32, same values.
    let batch = common::llmc_tokens(4);
    let t = column(&batch, 0, &Device::Cpu).unwrap();
    assert_eq!((t.dims(), t.dtype()), (&[4, 9][..], CDType::U32));
    let ids: Vec<u32> = t.flatten_all().unwrap().to_vec1().unwrap();
    let want: Vec<u32> = batch
        .column::<u16>(0)
        .unwrap()
        .iter()
        .map(|&v| v as u32)
        .collect();
    assert_eq!(ids, want);
    assert_eq!(&ids[..9], &[0, 1, 2, 3, 4, 5, 6, 7, 8]);
}

#[test]
fn example_07_trains_a_candle_model_as_well_as_the_built_in_step() {
    let last = common::example_accuracy("07_candle", "candle");
    // The built-in step reaches 92.9% in 10 epochs on the same data and settings.
    assert!(last >= 0.90, "accuracy {last} after 10 epochs");
}
