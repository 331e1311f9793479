#!/usr/bin/env bash
# Phase 6, about 4 minutes: the Python package's device batches against PyTorch's own
# pinned DataLoader, plain and augmented (benches/python_device.py, over data/cifar, made
# with `stokehold gen` where missing). Under $OUT: its log and python-device.json.
phase=python; source "$(dirname "$0")/common.sh"
data=${STOKEHOLD_DATA:-data/cifar}
if [ ! -e "$data/x.npy" ]; then
  step gen 120 .gpu/stokehold gen --out "$data"
fi
python_env
step python-device 300 $venv/bin/python benches/python_device.py --data "$data" \
  --json "$out/python-device.json"
# The PyTorch example on the GPU, its dataset kept there after epoch 0: at least 90%.
step train-torch-cuda 180 bash -c "$venv/bin/python examples/python/train_torch.py \
  --device cuda --device-cache > $out/train-torch-cuda.txt 2>&1; rc=\$?; \
  cat $out/train-torch-cuda.txt; [ \$rc = 0 ] \
  && awk '/^accuracy at the last epoch/ { ok = (\$NF + 0 >= 90) } END { exit !ok }' $out/train-torch-cuda.txt"
finish
