#!/usr/bin/env bash
# GPU check of the compiled gather: build in place for sm_90, run the CUDA
# tests and quick GPU benchmarks (gather, dispatch, DataParallel.map), and
# collect everything under $OUT.
#
# Expects torch (CUDA build), nvcc, ninja and pytest to be installed already
# (no network); bench_map also needs transformers. Budget: about 10 minutes;
# every step has its own timeout and a failing step does not stop the later
# ones, but the script exits 1 at the end, naming every step that failed (or
# timed out) in its last line and in $OUT/status.txt. Without a GPU the build
# and the CPU tests still run, and the GPU steps are reported as skipped; where
# nvidia-smi sees a GPU that torch cannot use, that is a failure.
#
# Usage: OUT=out bash benchmarks/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the dpmethods built in place below
OUT="${OUT:-./out}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
STATUS="$OUT/status.txt"
: > "$STATUS"
FAILED=()

step() {  # step NAME TIMEOUT_S CMD...
  local name="$1" limit="$2"
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc ${SECONDS}s-total $((SECONDS - t0))s" | tee -a "$STATUS"
  if [ "$rc" -eq 124 ]; then
    FAILED+=("$name (timed out after ${limit}s)")
  elif [ "$rc" -ne 0 ]; then
    FAILED+=("$name (rc=$rc, see $name.log)")
  fi
  return $rc
}

{
  date -u
  uname -a
  python --version
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
  nvcc --version || echo "no nvcc"
  ninja --version || echo "no ninja"
} > "$OUT/versions.txt" 2>&1
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || echo "nvidia-smi unavailable" > "$OUT/nvidia-smi.txt"

HAS_GPU=$(python -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
if [ "$HAS_GPU" != "1" ] && nvidia-smi -L 2>/dev/null | grep -q "^GPU"; then
  step torch_sees_the_gpu 60 python -c "import torch; assert torch.cuda.is_available(), 'nvidia-smi lists a GPU, torch.cuda.is_available() is False'"
fi

step build 300 env FORCE_CUDA=1 python setup.py build_ext --inplace
# The extension must be in use (not the pure-PyTorch fallback), with its CUDA kernels.
step info 60 python -c "
import json, dpmethods._C
from dpmethods import ops
info = ops.extension_info()
print(json.dumps(info, indent=2))
assert info['available'] and info['in_use'] == 'compiled' and info['cuda'], info
"
cp "$OUT/info.log" "$OUT/extension_info.json" 2>/dev/null

if [ "$HAS_GPU" = "1" ]; then
  step pytest_cuda 150 python -m pytest -m cuda tests/stages/test_ops_cuda.py tests/wrapper/test_cuda.py -q -p no:cacheprovider --junitxml="$OUT/pytest_cuda.xml"
  step pytest_cpu 90 python -m pytest tests/stages/test_ops.py -q -p no:cacheprovider -x
  step bench_gpu 150 python benchmarks/bench_gather.py --device cuda --quick --budget 0.05 --out "$OUT"
  step bench_dispatch 120 python benchmarks/bench_dispatch.py --quick --out "$OUT"
  step pytest_map_cuda 90 python -m pytest -m cuda tests/map/test_map.py -q -p no:cacheprovider --junitxml="$OUT/pytest_map_cuda.xml"
  step pytest_process_cuda 120 python -m pytest -m cuda tests/processes/test_process_workers.py -q -p no:cacheprovider --junitxml="$OUT/pytest_process_cuda.xml"
  step bench_map 150 python benchmarks/bench_map.py --device cuda --quick --out "$OUT"
else
  echo "no GPU: skipping CUDA tests and GPU benchmark" | tee -a "$STATUS"
  step pytest_cuda_skip 60 python -m pytest -m cuda tests/stages/test_ops_cuda.py tests/wrapper/test_cuda.py -q -p no:cacheprovider
  step pytest_cpu 120 python -m pytest tests/stages/test_ops.py -q -p no:cacheprovider -x
fi
echo "done in ${SECONDS}s; results in $OUT" | tee -a "$STATUS"
if [ "${#FAILED[@]}" -gt 0 ]; then
  echo "FAILED: ${FAILED[*]}" | tee -a "$STATUS"
  exit 1
fi
