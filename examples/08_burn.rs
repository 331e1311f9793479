//! 08: a burn model trained on stokehold's batches.
//!
//! A one-hidden-layer MLP built with burn-nn (the same shape and learning rate as
//! `stokehold train`'s built-in step) learns `datasets/digits` for 10 epochs on burn's
//! pure-Rust CPU backend. The data comes through `stokehold::interop::burn::BurnLoader`,
//! a burn `DataLoader`: each `iter()` is the next epoch, each batch's columns reach burn
//! as `TensorData` that is the loader's own buffer, not a copy. burn's `Learner` takes
//! the same `Arc<dyn DataLoader<_>>`.
//!
//! ```sh
//! cargo run --release --features burn-example --example 08_burn
//! ```

use std::sync::Arc;

use burn_core as burn;
use burn_core::data::dataloader::DataLoader;
use burn_core::module::Module;
use burn_core::tensor::activation::relu;
use burn_core::tensor::{Device, Int, Tensor};
use burn_nn::loss::CrossEntropyLossConfig;
use burn_nn::{Linear, LinearConfig};
use burn_optim::{GradientsParams, SgdConfig};
use stokehold::interop::burn::BurnLoader;
use stokehold::model::fit_classifier;
use stokehold::{Loader, NpyDataset, Shuffle};

#[derive(Module, Debug)]
struct Mlp {
    hidden: Linear,
    out: Linear,
}

impl Mlp {
    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.out.forward(relu(self.hidden.forward(x)))
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let device = Device::flex().autodiff();
    let ds = NpyDataset::open(concat!(env!("CARGO_MANIFEST_DIR"), "/datasets/digits"))?;
    // The built-in step's input normalisation, fitted on the first 512 samples.
    let (norm, _classes) = fit_classifier(&ds)?;

    let builder = Loader::builder(ds)
        .batch_size(256)
        .shuffle(Shuffle::Full { seed: 0 })
        .workers(2);
    let loader: Arc<dyn DataLoader<(Tensor<2>, Tensor<1, Int>)>> = Arc::new(BurnLoader::new(
        builder,
        device.clone(),
        move |batch, device| {
            // [n, 8, 8] u8 images, read in place and converted to f32 on the device;
            // [n] i64 labels, used as they are.
            let x = Tensor::<3>::from_data(batch.data_named("x")?, device).flatten::<2>(1, 2);
            let x = (x - norm.mean) * norm.inv_std;
            let y = Tensor::<1, Int>::from_data(batch.data_named("y")?, device);
            Ok((x, y))
        },
    )?);

    let mut model = Mlp {
        hidden: LinearConfig::new(64, 64).init(&device),
        out: LinearConfig::new(64, 10).init(&device),
    };
    let mut sgd = SgdConfig::new().init();
    let ce = CrossEntropyLossConfig::new().init(&device);
    println!(
        "device: {device:?}, {} samples per epoch",
        loader.num_items()
    );
    for epoch in 0..10 {
        let (mut loss_sum, mut correct, mut seen) = (0.0f64, 0i64, 0usize);
        for item in loader.iter() {
            let (x, y) = item?;
            let n = y.dims()[0];
            let logits = model.forward(x);
            let loss = ce.forward(logits.clone(), y.clone());
            loss_sum += loss.clone().into_scalar::<f32>() as f64 * n as f64;
            correct += logits
                .argmax(1)
                .flatten::<1>(0, 1)
                .equal(y)
                .int()
                .sum()
                .into_scalar::<i64>();
            seen += n;
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = sgd.step(0.1, model, grads);
        }
        println!(
            "epoch {epoch}: loss {:.4} accuracy {:.3}",
            loss_sum / seen as f64,
            correct as f64 / seen as f64
        );
    }
    Ok(())
}
