#!/usr/bin/env bash
# Phase 5, about 3 minutes: one profile of the training step with Nsight Compute (speed of
# light and launch statistics of each kernel of a few steps).
phase=profile; source "$(dirname "$0")/common.sh"
data=(); if [ -n "${STOKEHOLD_DATA:-}" ]; then data=(--data "$STOKEHOLD_DATA"); fi
TAIL=60 step ncu 400 ncu --section SpeedOfLight --section LaunchStats --launch-skip 200 \
  --launch-count 40 .gpu/stokehold train "${data[@]}" --epochs 1 --device cuda
finish
