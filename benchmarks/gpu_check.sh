#!/usr/bin/env bash
# The GPU check, in one call: a step's host overhead (benchmarks/step_overhead.py, scaled and
# full size), the serving benchmark with full-size bf16 models on one GPU (three executor devices
# sharing it), again with the scaled-down float32 models (tokens exactly eager's), then the
# CUDA-guarded tests; figures and logs written to OUT.
#
#   benchmarks/gpu_check.sh [OUT]        (default: runs/gpu-check; under 8 minutes on one H200)
#
# Run from the repository root with a python3 that has torch with CUDA and the project's
# dependencies (PYTHONPATH=src is set here, so no install is needed). Writes OUT/nvidia-smi.txt,
# OUT/step_overhead.log, OUT/serving.log, OUT/serving_scaled.log, OUT/cuda_tests.log and the figures in
# OUT/full/serving.json and OUT/scaled/serving.json; exits non-zero if a benchmark or test failed.
set -uo pipefail
out=${1:-runs/gpu-check}
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
  || { echo "gpu_check: no CUDA device visible to torch" >&2; exit 2; }
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
status=0
for size in "" --full; do  # where a step's time goes: the model's own stages against the executor's path
  timeout 60 python3 benchmarks/step_overhead.py --device cuda $size 2>&1 | tee -a "$out/step_overhead.log"
  status=$(( status | ${PIPESTATUS[0]} ))
done
timeout 270 python3 benchmarks/serving.py 1 --device cuda --calibration-repeats 1 --out "$out/full" 2>&1 \
  | tee "$out/serving.log"
status=$(( status | ${PIPESTATUS[0]} ))
timeout 60 python3 benchmarks/serving.py 1 --device cuda --scaled --calibration-repeats 2 --out "$out/scaled" 2>&1 \
  | tee "$out/serving_scaled.log"
status=$(( status | ${PIPESTATUS[0]} ))
timeout 90 python3 -m pytest -p no:cacheprovider -q -rs \
  tests/executor/test_cuda.py tests/executor/test_wide.py tests/executor/test_backend_loans.py \
  tests/replay/test_real_loans.py -k "cuda or gpu or wide or backend_loans" 2>&1 | tee "$out/cuda_tests.log"
status=$(( status | ${PIPESTATUS[0]} ))
echo "gpu_check: exit status $status"
exit $status
