//! stokehold as a burn `DataLoader` against burn's own multi-threaded `DataLoader`, on
//! the same files, batch size, shuffle and threads: samples per second into burn
//! tensors (`u8` images and `i64` labels, no element conversion on either side).
//!
//! burn's loader reads a `burn::data::dataset::Dataset` one sample at a time (here one
//! row of each `.npy` column, from the same memory maps) and its `Batcher` stacks the
//! samples; stokehold gathers each batch straight into one pooled buffer that burn's CPU
//! backend reads in place.
//!
//! ```sh
//! cargo bench --features burn-example --bench burn_loader -- [--data data/cifar] [--epochs 4] [--cold]
//! ```
//!
//! `--cold` evicts the files from the page cache before every epoch (each loader then
//! reads them from storage); without it they are read into the page cache first.

use std::sync::Arc;
use std::time::Instant;

use burn_core::data::dataloader::batcher::Batcher;
use burn_core::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn_core::data::dataset::DatasetError;
use burn_core::tensor::{DType, Device, Int, Tensor, TensorData};
use stokehold::interop::burn::BurnLoader;
use stokehold::{Dataset, Loader, NpyDataset, Shuffle};

type Item = (Tensor<2, Int>, Tensor<1, Int>);

/// One sample for burn's loader: the row of `x` and the label.
#[derive(Clone, Debug)]
struct Sample {
    x: Vec<u8>,
    y: i64,
}

/// The same `.npy` columns as a burn dataset of single samples.
struct Rows {
    ds: Arc<NpyDataset>,
    row: usize,
}

impl burn_core::data::dataset::Dataset<Sample> for Rows {
    fn get(&self, index: usize) -> Result<Sample, DatasetError> {
        let (mut x, mut y) = (vec![0u8; self.row], [0u8; 8]);
        self.ds
            .gather(0, &[index as u64], &mut [&mut x, &mut y])
            .map_err(DatasetError::new)?;
        Ok(Sample {
            x,
            y: i64::from_le_bytes(y),
        })
    }

    fn len(&self) -> usize {
        self.ds.len() as usize
    }
}

/// Stacks samples into the two tensors.
struct Stack {
    row: usize,
}

impl Batcher<Sample, Item> for Stack {
    fn batch(&self, items: Vec<Sample>, device: &Device) -> Item {
        let n = items.len();
        let mut x = Vec::with_capacity(n * self.row);
        let mut y = Vec::with_capacity(n);
        for s in items {
            x.extend_from_slice(&s.x);
            y.push(s.y);
        }
        let x = TensorData::new(x, [n, self.row]);
        (
            Tensor::from_data(x, (device, DType::U8)),
            Tensor::from_data(TensorData::new(y, [n]), (device, DType::I64)),
        )
    }
}

/// Seconds per epoch of `loader`, each epoch's items only made, not used.
fn epochs(loader: &dyn DataLoader<Item>, n: usize) -> Result<Vec<f64>, DatasetError> {
    let mut times = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let mut samples = 0;
        for item in loader.iter() {
            let (x, _y) = item?;
            samples += x.dims()[0];
        }
        assert_eq!(samples, loader.num_items());
        times.push(t.elapsed().as_secs_f64());
    }
    Ok(times)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
    };
    let data = flag("--data").map_or("data/cifar", |s| s.as_str());
    let n: usize = flag("--epochs").map_or(Ok(4), |s| s.parse())?;
    let (batch, workers, seed) = (256, 2, 0);
    let device = Device::flex();

    let cold = args.iter().any(|a| a == "--cold");
    // One mapping of the files for both loaders, so that evicting it leaves no page
    // mapped (a page another mapping still maps stays in the page cache).
    let ds = Arc::new(NpyDataset::open(data)?);
    let row = ds.columns()[0].row_bytes;
    let (samples, bytes) = (ds.len(), ds.len() * row as u64);
    // Before each epoch: the files in the page cache, or out of it.
    let prepare = || match cold {
        true => stokehold::pagecache::evict(ds.as_ref()),
        false => stokehold::pagecache::read_ahead(ds.as_ref()).map(|_| ()),
    };

    let builder = Loader::builder_shared(ds.clone())
        .batch_size(batch)
        .shuffle(Shuffle::Full { seed })
        .workers(workers);
    let ours = BurnLoader::new(builder, device.clone(), |b, device| {
        let n = b.len();
        let x = b.data_named("x")?;
        let x = TensorData::from_bytes(
            x.into_bytes(),
            [n, b.host().columns()[0].row_bytes],
            DType::U8,
        );
        Ok((
            Tensor::from_data(x, (device, DType::U8)),
            Tensor::from_data(b.data_named("y")?, (device, DType::I64)),
        ))
    })?;
    let theirs = DataLoaderBuilder::new(Stack { row })
        .batch_size(batch)
        .shuffle(seed)
        .num_workers(workers)
        .set_device(device)
        .build(Rows {
            ds: Arc::clone(&ds),
            row,
        });

    println!(
        "{data}: {samples} samples of {row} + 8 bytes ({:.0} MB), batch {batch}, {workers} \
         workers, full shuffle, page cache {}; {n} epochs each, alternating",
        bytes as f64 / 1e6,
        if cold {
            "evicted before each epoch"
        } else {
            "warm"
        }
    );
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for _ in 0..n {
        prepare()?;
        a.extend(epochs(&ours, 1)?);
        prepare()?;
        b.extend(epochs(theirs.as_ref(), 1)?);
    }
    let (a, b) = (median(a), median(b));
    println!(
        "stokehold BurnLoader:  {:>8.3} s/epoch  {:>9.0} samples/s",
        a,
        samples as f64 / a
    );
    println!(
        "burn DataLoader:       {:>8.3} s/epoch  {:>9.0} samples/s",
        b,
        samples as f64 / b
    );
    println!(
        "stokehold / burn: {:.1}x the samples per second (medians)",
        b / a
    );
    Ok(())
}
