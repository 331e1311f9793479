#!/usr/bin/env bash
# Phase 3, about 6 minutes: compute-sanitizer's memcheck, racecheck, synccheck and
# initcheck on the first step (at odd shapes too), the device cache (with the trainer's
# augmentation on the device too), partial and failing epochs, and a bad label. Any
# error makes the tool exit 99.
phase=sanitizers; source "$(dirname "$0")/common.sh"
tests=(first_step_matches_the_cpu_backend odd_shapes_match_the_cpu_backend the_device_cache_gives_the_same_epochs the_trainer_augments_on_the_device_as_the_workers_do partial_and_failing_epochs a_bad_label_is_an_error)
for tool in memcheck racecheck synccheck initcheck; do
  for t in "${tests[@]}"; do
    TAIL=4 step "$tool-$t" 240 compute-sanitizer --tool "$tool" --error-exitcode 99 \
      --print-limit 20 .gpu/test-gpu "$t" --exact --test-threads=1
  done
done
finish
