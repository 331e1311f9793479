#!/usr/bin/env bash
# Phase 4, about 5 minutes: `stokehold train` with and without the device cache, cold with
# and without --warmup, augmented on the GPU with and without the cache, and `stokehold
# bench` (the H2D, overlap and device-cache figures). Under $OUT: its log, train.json,
# train-warmup.json, trace.json and bench-w{1,2,8}.json (the device tool brings
# back at most 8 files per call).
phase=performance; source "$(dirname "$0")/common.sh"
data=(); if [ -n "${STOKEHOLD_DATA:-}" ]; then data=(--data "$STOKEHOLD_DATA"); fi
s=.gpu/stokehold
step train 180 $s train "${data[@]}" --json "$out/train.json"
step train-no-cache 120 $s train "${data[@]}" --no-device-cache
step train-cold-warmup 120 $s train "${data[@]}" --cold --warmup --json "$out/train-warmup.json" --trace "$out/trace.json"
step train-cold-warmup-no-cache 120 $s train "${data[@]}" --cold --warmup --no-device-cache
# Augmented on the GPU: the cached epochs gather and augment on the device (compare with
# `train`'s later epochs), and without the cache every epoch is copied and augmented.
step train-augment 120 $s train "${data[@]}" --crop 4 --flip
step train-augment-no-cache 120 $s train "${data[@]}" --crop 4 --flip --no-device-cache
for w in 1 2 8; do
  step bench-w$w 200 $s bench "${data[@]}" --workers $w --reps 3 --no-cold --json "$out/bench-w$w.json"
done
finish
