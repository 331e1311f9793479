//! Builds stokehold's CUDA path against a cudarc linked to libcuda (as candle's is).

fn main() {
    match stokehold::device::Device::auto() {
        stokehold::device::Device::Cuda(c) => println!("CUDA: {}", c.name),
        stokehold::device::Device::Cpu { reason } => println!("CPU: {reason:?}"),
    }
    // cudarc's own types are the ones stokehold hands out: one cudarc in the build.
    let _: Option<std::sync::Arc<cudarc::driver::CudaContext>> = None::<stokehold::cuda::Cuda>.map(|c| c.ctx);
}
