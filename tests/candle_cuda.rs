//! candle on CUDA (feature `candle-cuda`): the tensors `CudaTensors` hands candle hold
//! the host batches' values, read back after the loader has reused the host buffers.
//!
//! The binary links libcuda (candle asks cudarc for `dynamic-linking`), so it runs only
//! where CUDA is installed: `bash .ci/candle-cuda --link` builds it for the GPU machines
//! and `.ci/gpu/correctness.sh` runs it there. Without a device it says so and passes,
//! unless `STOKEHOLD_REQUIRE_GPU=1`.
#![cfg(feature = "candle-cuda")]

use std::sync::Arc;

use candle_core::{CudaDevice, DType as CDType, Device};
use stokehold::cuda::{PinnedAlloc, PinnedKind};
use stokehold::interop::candle_cuda::CudaTensors;
use stokehold::{DType, Dataset, Loader, NpyDataset, Shuffle, TokenDataset, Windows};

const DIGITS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/datasets/digits");

/// candle's CUDA device 0, or `None` (a skip) where there is none.
fn cuda() -> Option<CudaDevice> {
    match Device::new_cuda(0) {
        Ok(Device::Cuda(dev)) => Some(dev),
        other => {
            let why = format!("no CUDA device for candle: {other:?}");
            assert!(
                std::env::var("STOKEHOLD_REQUIRE_GPU").as_deref() != Ok("1"),
                "{why}"
            );
            eprintln!("skipped: {why}");
            None
        }
    }
}

/// The digits in batches of 100, fully shuffled with `seed`, into page-locked buffers.
fn digits(dev: &CudaDevice, seed: u64) -> Loader {
    let ds = NpyDataset::open(DIGITS).unwrap();
    pinned(ds, 100, Shuffle::Full { seed }, dev)
}

/// A digits batch's images and labels, copied from its host buffer.
fn host_xy(batch: &stokehold::HostBatch) -> (Vec<u8>, Vec<i64>) {
    let x = batch.column::<u8>(0).unwrap().to_vec();
    let y = batch.column::<i64>(1).unwrap().to_vec();
    (x, y)
}

/// A loader over `ds` gathering into page-locked buffers in candle's context.
fn pinned<D: Dataset + 'static>(ds: D, batch: usize, shuffle: Shuffle, dev: &CudaDevice) -> Loader {
    Loader::builder(ds)
        .batch_size(batch)
        .shuffle(shuffle)
        .workers(2)
        .allocator(Arc::new(PinnedAlloc::new(
            dev.cuda_stream().context().clone(),
            PinnedKind::Plain,
        )))
        .build()
        .unwrap()
}

#[test]
fn device_tensors_hold_the_host_batches_values() {
    let Some(dev) = cuda() else { return };
    let mut loader = digits(&dev, 1);
    let mut feed = CudaTensors::new(&dev).unwrap();
    // Two epochs' tensors kept alive: every host buffer is reused many times before the
    // first tensor is read back.
    let mut kept = Vec::new();
    for epoch in 0..2 {
        for batch in loader.epoch(epoch).unwrap() {
            let batch = batch.unwrap();
            let (x, y) = host_xy(&batch);
            let n = batch.len();
            let t = feed.tensors(batch).unwrap();
            assert_eq!((t[0].dims(), t[0].dtype()), (&[n, 8, 8][..], CDType::U8));
            assert_eq!((t[1].dims(), t[1].dtype()), (&[n][..], CDType::I64));
            assert!(t[0].device().is_cuda());
            kept.push((t, x, y));
        }
    }
    assert!(kept.len() > 30);
    for (t, x, y) in kept {
        assert_eq!(t[0].flatten_all().unwrap().to_vec1::<u8>().unwrap(), x);
        assert_eq!(t[1].to_vec1::<i64>().unwrap(), y);
    }
}

#[test]
fn token_ids_are_widened_on_the_device() {
    let Some(dev) = cuda() else { return };
    // Ids over the whole u16 range, high bytes included (a headerless nanoGPT file).
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokens.bin");
    let ids: Vec<u16> = (0..4096u32).map(|i| (i * 4099 % 65536) as u16).collect();
    let bytes: Vec<u8> = ids.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(&path, bytes).unwrap();
    let ds = TokenDataset::open_bin(&path, DType::U16, 16, Windows::Consecutive).unwrap();
    let mut loader = pinned(ds, 8, Shuffle::Full { seed: 3 }, &dev);
    let mut feed = CudaTensors::new(&dev).unwrap();
    let mut seen = 0;
    for batch in loader.epoch(0).unwrap() {
        let batch = batch.unwrap();
        let want: Vec<u32> = batch
            .column::<u16>(0)
            .unwrap()
            .iter()
            .map(|&v| u32::from(v))
            .collect();
        let n = batch.len();
        let t = feed.tensors(batch).unwrap();
        assert_eq!((t[0].dims(), t[0].dtype()), (&[n, 17][..], CDType::U32));
        assert_eq!(t[0].flatten_all().unwrap().to_vec1::<u32>().unwrap(), want);
        seen += n;
    }
    assert!(seen > 200);
}

#[test]
fn tensors_dropped_at_once_are_read_before_their_memory_is_reused() {
    // Only what candle derives is kept; the tensors stokehold made are dropped at once,
    // while candle's stream is held back behind a product: their memory must not go to
    // the next batch's copy before candle's kernels (`to_dtype`, which takes its input
    // on the slice's own stream, as the widening of token ids does) have read it.
    let Some(dev) = cuda() else { return };
    let device = Device::Cuda(dev.clone());
    let big = candle_core::Tensor::ones((2048, 2048), CDType::F32, &device).unwrap();
    let mut loader = digits(&dev, 4);
    let mut feed = CudaTensors::new(&dev).unwrap();
    let mut kept = Vec::new();
    for epoch in 0..2 {
        for batch in loader.epoch(epoch).unwrap() {
            let batch = batch.unwrap();
            let (x, y) = host_xy(&batch);
            let _busy = big.matmul(&big).unwrap();
            let t = feed.tensors(batch).unwrap();
            let xf = t[0].to_dtype(CDType::F32).unwrap();
            let yu = t[1].to_dtype(CDType::U32).unwrap();
            drop(t);
            kept.push((xf, yu, x, y));
        }
    }
    for (xf, yu, x, y) in kept {
        let want: Vec<f32> = x.iter().map(|&v| f32::from(v)).collect();
        assert_eq!(xf.flatten_all().unwrap().to_vec1::<f32>().unwrap(), want);
        let want: Vec<u32> = y.iter().map(|&v| v as u32).collect();
        assert_eq!(yu.to_vec1::<u32>().unwrap(), want);
    }
}

#[test]
fn indices_only_batches_are_refused() {
    let Some(dev) = cuda() else { return };
    let mut loader = digits(&dev, 1);
    let mut feed = CudaTensors::new(&dev).unwrap();
    let batch = loader.epoch_indices(0).unwrap().next().unwrap().unwrap();
    let err = feed.tensors(batch).unwrap_err();
    assert!(err.to_string().contains("indices only"), "{err}");
}

#[test]
fn candles_own_copy_from_a_pinned_batch_is_done_before_the_batch_goes_back() {
    use stokehold::interop::candle::tensors;
    let Some(dev) = cuda() else { return };
    let device = Device::Cuda(dev.clone());
    let mut loader = digits(&dev, 2);
    // A product queued on candle's stream before each copy holds the copy back, so a
    // copy that read the buffer late would read the batch the workers put there next.
    let big = candle_core::Tensor::ones((2048, 2048), CDType::F32, &device).unwrap();
    let mut kept = Vec::new();
    for epoch in 0..2 {
        for batch in loader.epoch(epoch).unwrap() {
            let batch = batch.unwrap();
            let x = batch.column::<u8>(0).unwrap().to_vec();
            let _busy = big.matmul(&big).unwrap();
            let t = tensors(&batch, &device).unwrap();
            drop(batch);
            kept.push((t, x));
        }
    }
    for (t, x) in kept {
        assert_eq!(t[0].flatten_all().unwrap().to_vec1::<u8>().unwrap(), x);
    }
}
