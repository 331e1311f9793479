#!/usr/bin/env bash
# Phase 2, about 3 minutes: the kernels compile under the machine's NVRTC, example 05, and
# every GPU test with STOKEHOLD_REQUIRE_GPU=1 (a skip is a failure), one thread at a time,
# then the Python package's device batches read by PyTorch (the wheel from the bundle,
# in a virtual environment over the machine's own NumPy and PyTorch), and example 07 on
# candle's CUDA device (batches handed over by interop::candle_cuda) where the bundle
# has it: it must train on CUDA, to at least 90% accuracy at its last epoch; and
# tests/candle_cuda.rs (the tensors hold the host batches' values).
phase=correctness; source "$(dirname "$0")/common.sh"
rm -rf "$STOKEHOLD_CACHE"
step nvrtc 120 .gpu/test-kernels_compile --nocapture
step example-05 60 .gpu/example-05
step gpu-tests 300 .gpu/test-gpu --nocapture --test-threads=1
python_env
step python-device 180 $venv/bin/python -m pytest -q -p no:cacheprovider \
  bindings/python/tests/test_device.py -k torch
# The toolkit's libraries, which the candle-cuda binaries link (cuBLAS, cuRAND, runtime).
cuda_lib=$(dirname "$(readlink -f "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")")/../lib64
if [ -e .gpu/example-07-candle-cuda.xz ]; then
  ex07=/tmp/example-07-candle-cuda
  xz -dc .gpu/example-07-candle-cuda.xz > $ex07 && chmod +x $ex07
  step candle-cuda 180 bash -c "LD_LIBRARY_PATH=$cuda_lib:/usr/local/cuda/lib64:\${LD_LIBRARY_PATH:-} \
    $ex07 > $out/example-07.txt 2>&1; rc=\$?; cat $out/example-07.txt; \
    [ \$rc = 0 ] && grep -q '^device: Cuda' $out/example-07.txt \
    && awk '/^epoch 9:/ { ok = (\$NF >= 0.9) } END { exit !ok }' $out/example-07.txt"
else
  echo "== candle-cuda: skipped, .gpu/example-07-candle-cuda.xz was not built" | tee -a "$log"
fi
if [ -e .gpu/test-candle-cuda.xz ]; then
  t07=/tmp/test-candle-cuda
  xz -dc .gpu/test-candle-cuda.xz > $t07 && chmod +x $t07
  step candle-cuda-values 120 env LD_LIBRARY_PATH="$cuda_lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}" \
    $t07 --nocapture --test-threads=1
fi
finish
