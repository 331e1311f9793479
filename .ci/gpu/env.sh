#!/usr/bin/env bash
# Phase 1, about 1 minute: what the machine is. Driver, CUDA and NVRTC versions, the PCIe
# link, where libcuda/libnvrtc/libcublas live, and a bare H2D probe (benches/h2d_probe.cu,
# plain CUDA C) at 788 KB, 8 MB and 64 MB, back-to-back and per-copy.
phase=env; source "$(dirname "$0")/common.sh"
step nvidia-smi 60 nvidia-smi
step device-query 60 nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max,persistence_mode,clocks.max.sm,memory.total --format=csv
step libraries 30 bash -c 'ldconfig -p | grep -E "libcuda\.|libnvrtc|libcublas"; ls /usr/local/cuda/lib64 2>/dev/null | grep -E "nvrtc|cublas"'
step toolkit 30 bash -c 'nvcc --version | tail -n 2; nproc; free -g | head -n 2; uname -r'
step probe 60 bash -c 'nvcc -O2 -o /tmp/h2d_probe benches/h2d_probe.cu && /tmp/h2d_probe'
step stokehold-device 60 .gpu/test-device --nocapture
finish
