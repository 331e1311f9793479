//! 07: a candle model trained on stokehold's batches.
//!
//! A one-hidden-layer MLP built with candle-nn (the same shape and learning rate as
//! `stokehold train`'s built-in step) learns `datasets/digits` for 10 epochs; each
//! batch reaches candle as tensors through `stokehold::interop`.
//!
//! ```sh
//! cargo run --release --features candle --example 07_candle
//! # on CUDA (candle's `cuda` feature runs nvcc at build time):
//! cargo run --release --no-default-features --features candle-cuda --example 07_candle
//! ```
//!
//! Built with `candle`, it runs on candle's CPU device. Built with `candle-cuda`, it runs
//! on candle's CUDA device 0 where one is found: the loader gathers into page-locked
//! buffers in candle's context, and `interop::candle_cuda::CudaTensors` copies each batch
//! once into device memory that becomes the tensors' storage, on a stream of its own that
//! candle's stream waits for on the device. Without a GPU it says why and runs on the CPU.

use candle_core::{DType, Device, Module, D};
use candle_nn::{linear, loss, Optimizer, VarBuilder, VarMap, SGD};
use stokehold::interop::candle::tensors;
use stokehold::model::fit_classifier;
use stokehold::{Loader, NpyDataset, Shuffle};

/// Where the batches go: candle's CPU device, or its CUDA device through stokehold's
/// copy stream.
enum Feed {
    Cpu,
    #[cfg(feature = "candle-cuda")]
    Cuda(stokehold::interop::candle_cuda::CudaTensors),
}

impl Feed {
    /// The device to train on, and how batches reach it.
    fn pick() -> (Device, Feed) {
        #[cfg(feature = "candle-cuda")]
        match Device::new_cuda(0) {
            Ok(Device::Cuda(dev)) => {
                match stokehold::interop::candle_cuda::CudaTensors::new(&dev) {
                    Ok(feed) => return (Device::Cuda(dev), Feed::Cuda(feed)),
                    Err(e) => eprintln!("CUDA found, not used: {e}; running on the CPU"),
                }
            }
            Ok(_) => {}
            Err(e) => eprintln!("no CUDA device ({e}); running on the CPU"),
        }
        (Device::Cpu, Feed::Cpu)
    }

    fn tensors(
        &mut self,
        batch: stokehold::HostBatch,
        device: &Device,
    ) -> stokehold::Result<Vec<candle_core::Tensor>> {
        match self {
            Feed::Cpu => tensors(&batch, device),
            #[cfg(feature = "candle-cuda")]
            Feed::Cuda(feed) => feed.tensors(batch),
        }
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (device, mut feed) = Feed::pick();
    println!("device: {device:?}");
    let ds = NpyDataset::open(concat!(env!("CARGO_MANIFEST_DIR"), "/datasets/digits"))?;
    // The built-in step's input normalisation, fitted on the first 512 samples.
    let (norm, _classes) = fit_classifier(&ds)?;
    let builder = Loader::builder(ds)
        .batch_size(256)
        .shuffle(Shuffle::Full { seed: 0 })
        .workers(2);
    // On CUDA, page-locked buffers in candle's context: the copies run asynchronously.
    #[cfg(feature = "candle-cuda")]
    let builder = match &device {
        Device::Cuda(dev) => {
            builder.allocator(std::sync::Arc::new(stokehold::cuda::PinnedAlloc::new(
                dev.cuda_stream().context().clone(),
                stokehold::cuda::PinnedKind::Plain,
            )))
        }
        _ => builder,
    };
    let mut loader = builder.build()?;

    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &device);
    let (hidden, out) = (
        linear(64, 64, vb.pp("hidden"))?,
        linear(64, 10, vb.pp("out"))?,
    );
    let mut sgd = SGD::new(vars.all_vars(), 0.1)?;
    for epoch in 0..10 {
        let (mut loss_sum, mut correct, mut seen) = (0.0f64, 0.0f64, 0usize);
        for batch in loader.epoch(epoch)? {
            let batch = batch?;
            let n = batch.len();
            let t = feed.tensors(batch, &device)?; // [n, 8, 8] u8, [n] i64
            let x = t[0].flatten_from(1)?.to_dtype(DType::F32)?;
            let x = x.affine(norm.inv_std as f64, -(norm.mean * norm.inv_std) as f64)?;
            let y = t[1].to_dtype(DType::U32)?;
            let logits = out.forward(&hidden.forward(&x)?.relu()?)?;
            let l = loss::cross_entropy(&logits, &y)?;
            sgd.backward_step(&l)?;
            loss_sum += l.to_scalar::<f32>()? as f64 * n as f64;
            let hits = logits.argmax(D::Minus1)?.eq(&y)?.to_dtype(DType::F32)?;
            correct += hits.sum_all()?.to_scalar::<f32>()? as f64;
            seen += n;
        }
        println!(
            "epoch {epoch}: loss {:.4} accuracy {:.3}",
            loss_sum / seen as f64,
            correct / seen as f64
        );
    }
    Ok(())
}
