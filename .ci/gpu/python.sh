#!/usr/bin/env bash
# Phase 6, about 3 minutes: the Python package's device batches against PyTorch's own
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
finish
