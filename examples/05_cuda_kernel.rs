//! Your own CUDA kernel on the batches stokehold feeds.
//!
//! The `Feeder` copies each pinned batch into a device slot on its copy stream and hands
//! you a `DeviceBatch`: device pointers per column, ready on `batch.stream()`. Enqueue
//! your kernels there; the slot is refilled only after they finish. With its device
//! cache on, epoch 0 also keeps the dataset on the GPU, and later epochs gather their
//! batches there. Here a kernel counts the labels of every batch on the GPU, epoch
//! after epoch, and the totals are checked against the host.
//!
//! Without a GPU it says why and exits successfully.
//!
//! `cargo run --release --example 05_cuda_kernel`

use std::sync::Arc;

use cudarc::driver::{LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use stokehold::cuda::{build_arch, Feeder, PinnedAlloc, PinnedKind};
use stokehold::device::Device;
use stokehold::{Dataset, Loader, NpyDataset, Shuffle};

const KERNEL: &str = r#"
extern "C" __global__ void count_labels(const long long* y, int n, unsigned int* counts) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n && y[i] >= 0 && y[i] < 10) {
        atomicAdd(&counts[y[i]], 1u);
    }
}
"#;

fn main() -> stokehold::Result<()> {
    let cuda = match Device::auto() {
        Device::Cuda(c) => c,
        Device::Cpu { reason } => {
            println!(
                "no GPU here ({}): nothing to run",
                reason.unwrap_or_default()
            );
            return Ok(());
        }
    };
    println!("{} (sm_{}{})", cuda.name, cuda.arch.0, cuda.arch.1);
    let ds = NpyDataset::open(concat!(env!("CARGO_MANIFEST_DIR"), "/datasets/digits"))?;
    let mut loader = Loader::builder(ds)
        .batch_size(256)
        .shuffle(Shuffle::Full { seed: 3 })
        .workers(2)
        .allocator(Arc::new(PinnedAlloc::new(
            Arc::clone(&cuda.ctx),
            PinnedKind::Plain,
        )))
        .build()?;

    // Compile the kernel with the NVRTC stokehold found, to a cubin that runs on this GPU
    // (a cubin needs no JIT, so it loads even where NVRTC is newer than the driver), or,
    // for a GPU newer than this NVRTC knows, to PTX the driver compiles forward.
    let archs = cuda.nvrtc.supported_archs();
    let option = |kind: &str, (major, minor): (i32, i32)| {
        vec![format!("--gpu-architecture={kind}_{major}{minor}")]
    };
    let image = match build_arch(cuda.arch, &archs, true) {
        Some(arch) => {
            let cubin = cuda
                .nvrtc
                .compile_cubin(KERNEL, "count.cu", &option("sm", arch));
            Ptx::from_binary(cubin.map_err(stokehold::Error::cuda)?)
        }
        None => {
            let arch = build_arch(cuda.arch, &archs, false).ok_or_else(|| {
                stokehold::Error::cuda(format!(
                    "NVRTC builds for nothing as old as {:?}",
                    cuda.arch
                ))
            })?;
            let ptx = cuda
                .nvrtc
                .compile(KERNEL, "count.cu", &option("compute", arch));
            Ptx::from_src(ptx.map_err(stokehold::Error::cuda)?)
        }
    };
    let module = cuda.ctx.load_module(image)?;
    let count = module.load_function("count_labels")?;

    // The same counts on the host, from the file.
    let ds = NpyDataset::open(concat!(env!("CARGO_MANIFEST_DIR"), "/datasets/digits"))?;
    let mut host = [0u32; 10];
    for i in 0..ds.len() {
        let y = ds.arrays()[1].row(i)?;
        host[i64::from_le_bytes(y.try_into().expect("8 bytes")) as usize] += 1;
    }
    println!("labels counted on the host: {host:?}");

    let mut feeder = Feeder::new(&cuda, loader.layout(), 4)?;
    // Keep the dataset on the GPU: epoch 0 fills the cache as it goes, later epochs
    // gather their batches there (no loader, no copies), and the kernel sees the same
    // `DeviceBatch`es.
    if let Some(bytes) = feeder.enable_device_cache(&loader, 0.5)? {
        println!("device cache: {bytes} bytes");
    }
    let stream = Arc::clone(feeder.stream());
    let mut counts = stream.alloc_zeros::<u32>(10)?;
    let counts_ptr = {
        use cudarc::driver::DevicePtr;
        counts.device_ptr(&stream).0
    };
    for epoch in 0..3 {
        let stats = feeder.feed(
            &mut loader,
            epoch,
            &mut |batch| {
                let (y, n) = (batch.column_ptr(1), batch.len() as i32);
                let cfg = LaunchConfig::for_num_elems(batch.len() as u32);
                let mut launch = batch.stream().launch_builder(&count);
                launch.arg(&y).arg(&n).arg(&counts_ptr);
                // SAFETY: count_labels(const long long*, int, unsigned*): `y` points to
                // the batch's `n` int64 labels on the device, `counts_ptr` to 10 u32.
                unsafe { launch.launch(cfg) }?;
                Ok(())
            },
            &mut |_, _| {},
        )?;
        let gpu = stream.clone_dtoh(&counts)?;
        stream.memset_zeros(&mut counts)?;
        let source = match stats.cached {
            true => "the device cache",
            false => "the loader",
        };
        println!(
            "epoch {epoch} from {source}: {} batches, {} samples, copies {:?}, kernels {:?}, \
             wall {:?}; labels counted on the GPU: {gpu:?}",
            stats.batches, stats.samples, stats.copy, stats.compute, stats.wall
        );
        assert_eq!(gpu, host, "the GPU saw every sample once");
    }
    Ok(())
}
