//! Batches as burn tensor data and a burn `DataLoader` (feature `burn`): no copy, the
//! same samples and order as the loader, epochs in turn, resume, one epoch at a time,
//! burn's split across devices, errors as items, and example 08 trained end to end.
#![cfg(feature = "burn-example")]

mod common;

use std::collections::BTreeSet;
use std::error::Error as _;
use std::sync::Arc;

use burn_core::data::dataloader::split::split_dataloader;
use burn_core::data::dataloader::DataLoader;
use burn_core::tensor::{DType as BurnDType, Device, Int, Tensor};
use stokehold::interop::burn::{Batch, BurnLoader};
use stokehold::{Dataset, Loader, LoaderBuilder, LoaderState, NpyDataset, Shuffle};

const DIGITS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/datasets/digits");

fn digits() -> LoaderBuilder {
    Loader::builder(NpyDataset::open(DIGITS).unwrap())
        .batch_size(100)
        .shuffle(Shuffle::Full { seed: 3 })
        .workers(2)
}

/// A loader whose items are each batch's sample indices and labels.
fn indices_and_labels(builder: LoaderBuilder) -> BurnLoader<(Vec<u64>, Vec<i64>)> {
    BurnLoader::new(builder, Device::flex(), |batch, _| {
        let y = batch.data_named("y")?;
        let y = y.as_slice::<i64>().unwrap().to_vec();
        Ok((batch.indices().to_vec(), y))
    })
    .unwrap()
}

/// The indices of every batch of `loader`'s epoch `epoch`, through stokehold alone.
fn stokehold_epoch(builder: LoaderBuilder, epoch: u64) -> Vec<Vec<u64>> {
    let mut loader = builder.build().unwrap();
    let batches = loader.epoch(epoch).unwrap();
    batches.map(|b| b.unwrap().indices().to_vec()).collect()
}

#[test]
fn a_batch_of_indices_only_has_no_data() {
    let mut loader = digits().build().unwrap();
    let batch = Batch::new(loader.epoch_indices(0).unwrap().next().unwrap().unwrap());
    let err = batch.data(0).unwrap_err();
    assert!(err.to_string().contains("indices only"), "{err}");
}

#[test]
fn columns_are_the_loaders_buffer_not_a_copy() {
    let mut loader = digits().build().unwrap();
    let all = loader.buffers();
    let (x, y) = {
        let mut epoch = loader.epoch(0).unwrap();
        let batch = Batch::new(epoch.next().unwrap().unwrap());
        let (x, y) = (batch.data(0).unwrap(), batch.data_named("y").unwrap());
        assert_eq!(x.shape().as_slice(), &[100, 8, 8]);
        assert_eq!((x.dtype(), y.dtype()), (BurnDType::U8, BurnDType::I64));
        assert_eq!(y.shape().as_slice(), &[100]);
        // The same bytes: the column's own memory in the pooled buffer.
        let host = batch.host();
        assert_eq!(x.as_bytes().as_ptr(), host.bytes(0).as_ptr());
        assert_eq!(x.as_bytes(), host.bytes(0));
        assert_eq!(y.as_slice::<i64>().unwrap(), host.column::<i64>(1).unwrap());
        let e = batch.data_named("labels").unwrap_err().to_string();
        assert!(
            e.contains("no column named \"labels\"") && e.contains("x, y"),
            "{e}"
        );
        (x, y)
    };
    // The epoch and the batch are gone; the data still holds its buffer.
    assert_eq!(loader.free_buffers(), all - 1);
    drop(x);
    assert_eq!(loader.free_buffers(), all - 1);
    drop(y);
    assert_eq!(loader.free_buffers(), all);
}

#[test]
fn burn_computes_on_the_buffer_in_place_or_converts() {
    let device = Device::flex();
    let mut loader = digits().build().unwrap();
    let all = loader.buffers();
    let (kept, labels) = {
        let batch = Batch::new(loader.epoch(0).unwrap().next().unwrap().unwrap());
        let pixels: u64 = batch.host().bytes(0).iter().map(|&v| v as u64).sum();
        let labels = batch.host().column::<i64>(1).unwrap().to_vec();
        // u8 images as the device's float type: converted (a copy burn makes).
        let x = Tensor::<3>::from_data(batch.data(0).unwrap(), &device);
        assert_eq!(x.clone().sum().into_scalar::<f32>(), pixels as f32);
        // i64 labels as i64 int tensors: burn's CPU backend keeps the loader's bytes.
        let y = Tensor::<1, Int>::from_data(batch.data(1).unwrap(), (&device, BurnDType::I64));
        (y, labels)
    };
    assert_eq!(kept.to_data().as_slice::<i64>().unwrap(), &labels[..]);
    assert_eq!(
        loader.free_buffers(),
        all - 1,
        "the tensor holds the buffer"
    );
    drop(kept);
    assert_eq!(loader.free_buffers(), all);
}

#[test]
fn token_windows_keep_their_u16_ids() {
    let batch = Batch::new(common::llmc_tokens(4));
    let t = batch.data_named("tokens").unwrap();
    assert_eq!(
        (t.dtype(), t.shape().as_slice()),
        (BurnDType::U16, &[4, 9][..])
    );
    assert_eq!(
        &t.as_slice::<u16>().unwrap()[..9],
        &[0, 1, 2, 3, 4, 5, 6, 7, 8]
    );
}

#[test]
fn each_iter_is_the_next_epoch_in_the_loaders_order() {
    let loader = indices_and_labels(digits());
    assert_eq!(loader.num_items(), 1797);
    assert_eq!(loader.epoch(), 0);
    for epoch in 0..2 {
        let mut it = loader.iter();
        assert_eq!(it.progress().items_processed, 0);
        let mut batches = Vec::new();
        for item in &mut it {
            batches.push(item.unwrap().0);
        }
        assert_eq!(it.progress().items_processed, 1797);
        assert_eq!(it.progress().items_total, 1797);
        assert_eq!(batches, stokehold_epoch(digits(), epoch), "epoch {epoch}");
        let seen: BTreeSet<u64> = batches.concat().into_iter().collect();
        assert_eq!(seen, (0..1797).collect(), "each sample once");
    }
    assert_eq!(loader.state().unwrap(), state(2, 0));
    loader.set_epoch(7);
    let first = loader.iter().next().unwrap().unwrap().0;
    assert_eq!(first, stokehold_epoch(digits(), 7)[0]);
    // drop_last: the items are the whole batches'.
    assert_eq!(
        indices_and_labels(digits().drop_last(true)).num_items(),
        1700
    );
}

/// A loader of [`digits`] resumed at batch 3 of epoch 1.
fn resumed_at_epoch_1_batch_3() -> BurnLoader<(Vec<u64>, Vec<i64>)> {
    let mut order = digits().build().unwrap();
    let saved = LoaderState {
        batch: 3,
        ..order.epoch(1).unwrap().state()
    };
    drop(order);
    indices_and_labels(digits().resume(saved))
}

#[test]
fn a_resumed_loader_yields_the_rest_of_its_epoch_then_the_next() {
    let whole = stokehold_epoch(digits(), 1);
    let loader = resumed_at_epoch_1_batch_3();
    assert_eq!(loader.epoch(), 1);
    let mut it = loader.iter();
    assert_eq!(it.progress().items_processed, 300);
    let rest: Vec<Vec<u64>> = (&mut it).map(|b| b.unwrap().0).collect();
    assert_eq!(rest, whole[3..]);
    assert_eq!(it.progress().items_processed, 1797);
    drop(it);
    let next: Vec<Vec<u64>> = loader.iter().map(|b| b.unwrap().0).collect();
    assert_eq!(next, stokehold_epoch(digits(), 2));
}

#[test]
fn a_resumed_loader_is_not_split_and_its_state_follows_set_epoch() {
    let loader = resumed_at_epoch_1_batch_3();
    let pending = loader.state().unwrap();
    assert_eq!((pending.epoch, pending.batch, pending.taken), (1, 3, 300));
    // Each part would start epoch 1 from its first batch: refused, saying why.
    let shared: Arc<dyn DataLoader<(Vec<u64>, Vec<i64>)>> = Arc::new(loader.clone());
    for part in split_dataloader(Arc::clone(&shared), &[Device::flex(), Device::flex()]) {
        let e = part.iter().next().unwrap().unwrap_err().to_string();
        assert!(e.contains("resumes epoch 1 part-way"), "{e}");
    }
    // Once the resumed epoch has run, the loader splits.
    assert_eq!(loader.iter().count(), 18 - 3);
    let parts = split_dataloader(shared, &[Device::flex(), Device::flex()]);
    // Each part serves its own range of the set whole (its indices count from the
    // range's start), and the ranges cover it.
    let mut served = 0;
    for part in &parts {
        let mut indices: Vec<u64> = part.iter().flat_map(|b| b.unwrap().0).collect();
        indices.sort_unstable();
        assert!(!indices.is_empty(), "a part of the split yields nothing");
        assert_eq!(indices, (0..indices.len() as u64).collect::<Vec<_>>());
        served += indices.len();
    }
    assert_eq!(served, 1797, "the parts serve every sample");
    // An epoch dropped part-way and asked for again runs from its start: so says the
    // state.
    loader.set_epoch(2);
    loader.iter().take(5).for_each(drop);
    loader.set_epoch(2);
    assert_eq!(loader.state().unwrap(), state(2, 0));
    let again: Vec<Vec<u64>> = loader.iter().map(|b| b.unwrap().0).collect();
    assert_eq!(again, stokehold_epoch(digits(), 2));
}

#[test]
fn one_epoch_at_a_time_and_devices_share_the_count() {
    let loader = indices_and_labels(digits());
    let other = loader.to_device(&Device::flex());
    assert_eq!(other.num_items(), 1797);
    let mut running = loader.iter();
    running.next().unwrap().unwrap();
    let mut refused = other.iter();
    let e = refused.next().unwrap().unwrap_err().to_string();
    assert!(e.contains("one epoch at a time"), "{e}");
    assert!(refused.next().is_none());
    let e = loader.state().unwrap_err().to_string();
    assert!(e.contains("still being iterated"), "{e}");
    drop((running, refused));
    // Epoch 0 ran on `loader`; the refused call took none: `other` goes on at 1.
    let one: Vec<Vec<u64>> = other.iter().map(|b| b.unwrap().0).collect();
    assert_eq!(one, stokehold_epoch(digits(), 1));
    assert_eq!(loader.epoch(), 2);
}

#[test]
fn burns_split_gives_each_device_its_part_of_the_dataset() {
    let loader: Arc<dyn DataLoader<(Vec<u64>, Vec<i64>)>> = Arc::new(indices_and_labels(digits()));
    let parts = split_dataloader(loader, &[Device::flex(), Device::flex(), Device::flex()]);
    assert_eq!(parts.len(), 3);
    let ds = NpyDataset::open(DIGITS).unwrap();
    let mut label = vec![0u8; 8];
    let mut start = 0u64;
    for part in &parts {
        let n = part.num_items() as u64;
        let mut seen = BTreeSet::new();
        for item in part.iter() {
            let (indices, labels) = item.unwrap();
            for (i, y) in indices.into_iter().zip(labels) {
                // Indices count from the part's start; the rows are the dataset's.
                let mut x = vec![0u8; 64];
                ds.gather(0, &[start + i], &mut [&mut x, &mut label])
                    .unwrap();
                assert_eq!(y, i64::from_le_bytes(label[..8].try_into().unwrap()));
                seen.insert(i);
            }
        }
        assert_eq!(seen, (0..n).collect(), "each of the part's samples once");
        start += n;
    }
    assert_eq!(start, 1797);
}

#[test]
fn errors_are_items_that_name_the_problem() {
    // A batcher's error, with stokehold's error as its source.
    let loader = BurnLoader::new(digits(), Device::flex(), |batch, _| {
        batch.data_named("pixels").map(|_| ())
    })
    .unwrap();
    let e = loader.iter().next().unwrap().unwrap_err();
    assert!(e.to_string().contains("no column named \"pixels\""), "{e}");
    assert!(e.source().unwrap().is::<stokehold::Error>());
    // A slice outside the dataset: no panic, one error, no item.
    let bad = loader.slice(1700, 1900);
    assert_eq!(bad.num_items(), 0);
    let errors: Vec<String> = bad.iter().map(|b| b.unwrap_err().to_string()).collect();
    assert_eq!(errors.len(), 1);
    assert!(
        errors[0].contains("items 1700..1900 of a loader of 1797"),
        "{errors:?}"
    );
    // A file truncated under the loader: the error names it.
    let dir = tempfile::tempdir().unwrap();
    for f in ["x.npy", "y.npy"] {
        std::fs::copy(format!("{DIGITS}/{f}"), dir.path().join(f)).unwrap();
    }
    let ds = NpyDataset::open(dir.path()).unwrap();
    let loader = indices_and_labels(Loader::builder(ds).batch_size(100));
    assert_eq!(loader.iter().filter(|b| b.is_ok()).count(), 18);
    let x = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.path().join("x.npy"))
        .unwrap();
    x.set_len(4096).unwrap();
    let e = loader.iter().find_map(|b| b.err()).unwrap().to_string();
    assert!(e.contains("x.npy: changed while it was mapped"), "{e}");
}

#[test]
fn burn_never_writes_to_the_loaders_buffer() {
    // An in-place operation on a tensor that is the buffer's only user copies first.
    let device = Device::flex();
    let mut loader = digits().build().unwrap();
    let batch = Batch::new(loader.epoch(0).unwrap().next().unwrap().unwrap());
    let before = batch.host().column::<i64>(1).unwrap().to_vec();
    let y = Tensor::<1, Int>::from_data(batch.data(1).unwrap(), (&device, BurnDType::I64));
    let y = y.add_scalar(1).mul_scalar(3);
    let after = y.into_data();
    assert_eq!(batch.host().column::<i64>(1).unwrap(), &before[..]);
    let want: Vec<i64> = before.iter().map(|v| (v + 1) * 3).collect();
    assert_eq!(after.as_slice::<i64>().unwrap(), &want[..]);
}

#[test]
fn a_dropped_panicked_or_leaked_iterator_leaves_the_loader_as_it_should() {
    let loader = indices_and_labels(digits());
    // Dropped after two batches: the next iter() and the state are the next epoch's.
    let mut it = loader.iter();
    it.next().unwrap().unwrap();
    it.next().unwrap().unwrap();
    drop(it);
    assert_eq!((loader.epoch(), loader.state().unwrap().batch), (1, 0));
    assert_eq!(loader.state().unwrap().epoch, 1);
    // A batcher that panics unwinds through the iterator, which lets the loader go.
    let panicky = BurnLoader::new(digits(), Device::flex(), |batch, _| {
        assert!(batch.len() > 1000, "a batcher bug");
        Ok(())
    })
    .unwrap();
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        panicky.iter().next();
    }));
    assert!(caught.is_err());
    assert!(panicky.state().is_ok(), "the loader is free again");
    // A leaked iterator keeps it for good, without unsoundness: an error item.
    std::mem::forget(loader.iter());
    let e = loader.iter().next().unwrap().unwrap_err().to_string();
    assert!(e.contains("one epoch at a time"), "{e}");
}

#[test]
fn splitting_a_sharded_or_drop_last_loader_still_covers_the_dataset() {
    // Synth's column `id` holds each sample's index in the whole dataset.
    let n = 1000;
    for (world, drop_last) in [(1, false), (2, false), (1, true), (3, true)] {
        let mut seen = BTreeSet::new();
        let mut taken = 0;
        for rank in 0..world {
            let builder = Loader::builder(common::Synth::new(n))
                .batch_size(64)
                .drop_last(drop_last)
                .shard(stokehold::Shard::new(rank, world).unwrap());
            let loader = BurnLoader::new(builder, Device::flex(), |batch, _| {
                Ok(batch.data_named("id")?.as_slice::<u64>().unwrap().to_vec())
            })
            .unwrap();
            let loader: Arc<dyn DataLoader<Vec<u64>>> = Arc::new(loader);
            for part in split_dataloader(loader, &[Device::flex(), Device::flex()]) {
                for ids in part.iter() {
                    let ids = ids.unwrap();
                    taken += ids.len();
                    seen.extend(ids);
                }
            }
        }
        // Each part of each rank drops at most its short last batch.
        let lost = n - seen.len() as u64;
        let bound = if drop_last { 2 * world * 64 } else { 0 };
        assert!(
            lost <= bound,
            "world {world}, drop_last {drop_last}: {lost} never seen"
        );
        assert!(
            lost < n / 2,
            "world {world}: the parts cover the dataset, not one share of it"
        );
        assert_eq!(taken, seen.len(), "no sample twice");
    }
}

#[test]
fn an_empty_slice_is_an_empty_loader() {
    let loader: Arc<dyn DataLoader<(Vec<u64>, Vec<i64>)>> = Arc::new(indices_and_labels(digits()));
    let empty = loader.slice(500, 500);
    assert_eq!(empty.num_items(), 0);
    assert!(empty.iter().next().is_none());
    // More devices than items, as burn's split allows.
    let tiny = loader.slice(0, 2);
    let parts = split_dataloader(tiny, &[Device::flex(), Device::flex(), Device::flex()]);
    let items: usize = parts
        .iter()
        .map(|p| p.iter().map(|b| b.unwrap().0.len()).sum::<usize>())
        .sum();
    assert_eq!(items, 2);
}

#[test]
fn example_08_trains_a_burn_model_as_well_as_the_built_in_step() {
    let last = common::example_accuracy("08_burn", "burn-example");
    // The built-in step reaches 92.9% in 10 epochs on the same data and settings.
    assert!(last >= 0.90, "accuracy {last} after 10 epochs");
}

fn state(epoch: u64, batch: u64) -> LoaderState {
    LoaderState {
        epoch,
        batch,
        ..indices_and_labels(digits()).state().unwrap()
    }
}
