#!/usr/bin/env bash
# Phase 2, about 3 minutes: the kernels compile under the machine's NVRTC, example 05, and
# every GPU test with STOKEHOLD_REQUIRE_GPU=1 (a skip is a failure), one thread at a time.
phase=correctness; source "$(dirname "$0")/common.sh"
rm -rf "$STOKEHOLD_CACHE"
step nvrtc 120 .gpu/test-kernels_compile --nocapture
step example-05 60 .gpu/example-05
step gpu-tests 300 .gpu/test-gpu --nocapture --test-threads=1
finish
