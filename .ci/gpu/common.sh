# Sourced by every phase of the GPU check: run from anywhere, it moves to the repository
# root, reads the binaries that `bash .ci/gpu-bundle` left in .gpu/, and writes under $OUT
# (./gpu-out without it). Each phase keeps one log, $OUT/<phase>.log, with every step's
# whole output; the last lines of each step also go to stdout.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
out=${OUT:-gpu-out}
mkdir -p "$out"
if [ ! -x .gpu/stokehold ]; then
  echo "no .gpu/stokehold: run 'bash .ci/gpu-bundle' where cargo is, and carry .gpu" >&2
  exit 2
fi
# The tests find datasets/ under the checkout they were built in: link it there.
build_root=$(cat .gpu/build-root)
if [ "$build_root" != "$PWD" ] && [ ! -e "$build_root/datasets" ]; then
  mkdir -p "$(dirname "$build_root")" && ln -sfn "$PWD" "$build_root"
fi
# A GPU test that would skip fails instead: a run here must not pass by skipping.
export STOKEHOLD_REQUIRE_GPU=1 RUST_BACKTRACE=1
export STOKEHOLD_CACHE=${STOKEHOLD_CACHE:-/tmp/stokehold-kernels}
log="$out/${phase:?}.log"
failed=0
# step NAME SECONDS COMMAND...: runs COMMAND under a time limit, appends its output to the
# phase log, prints its exit status and last lines.
step() {
  local name=$1 limit=$2; shift 2
  echo "== $name: $*" | tee -a "$log"
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" > "$out/step.tmp" 2>&1; local rc=$?
  cat "$out/step.tmp" >> "$log"
  echo "   exit $rc after $((SECONDS - t0)) s" | tee -a "$log"
  tail -n "${TAIL:-20}" "$out/step.tmp"; rm -f "$out/step.tmp"
  if [ "$rc" != 0 ]; then failed=$((failed + 1)); fi
}
# python_env: the wheel from the bundle, with pytest, in a virtual environment over the
# machine's own NumPy and PyTorch, at $venv.
venv=/tmp/stokehold-py
python_env() {
  step python-install 120 bash -c "rm -rf $venv && python3 -m venv --system-site-packages $venv && \
    $venv/bin/pip install -q --no-index --find-links .gpu/wheels stokehold pytest"
}
finish() {
  echo "== phase $phase: $failed step(s) failed" | tee -a "$log"
  [ "$failed" = 0 ]
}
