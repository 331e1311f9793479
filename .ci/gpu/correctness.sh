#!/usr/bin/env bash
# Phase 2, about 3 minutes: the kernels compile under the machine's NVRTC, example 05, and
# every GPU test with STOKEHOLD_REQUIRE_GPU=1 (a skip is a failure), one thread at a time,
# then the Python package's device batches read by PyTorch (the wheel from the bundle,
# in a virtual environment over the machine's own NumPy and PyTorch).
phase=correctness; source "$(dirname "$0")/common.sh"
rm -rf "$STOKEHOLD_CACHE"
step nvrtc 120 .gpu/test-kernels_compile --nocapture
step example-05 60 .gpu/example-05
step gpu-tests 300 .gpu/test-gpu --nocapture --test-threads=1
venv=/tmp/stokehold-py
step python-install 120 bash -c "rm -rf $venv && python3 -m venv --system-site-packages $venv && \
  $venv/bin/pip install -q --no-index --find-links .gpu/wheels stokehold pytest"
step python-device 180 $venv/bin/python -m pytest -q -p no:cacheprovider \
  bindings/python/tests/test_device.py -k torch
finish
