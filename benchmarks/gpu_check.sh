#!/usr/bin/env bash
# The GPU check, in one call: the CUDA-guarded tests, then the serving benchmark with full-size
# models on one GPU (three executor devices sharing it), figures and logs written to OUT.
#
#   benchmarks/gpu_check.sh [OUT]        (default: runs/gpu-check; under 8 minutes on one H200)
#
# Run from the repository root with a python3 that has torch with CUDA and the project's
# dependencies (PYTHONPATH=src is set here, so no install is needed). Writes OUT/nvidia-smi.txt,
# OUT/cuda_tests.log, OUT/serving.log and OUT/serving.json (the benchmark's figures); exits
# non-zero if a test or the benchmark failed.
set -uo pipefail
out=${1:-runs/gpu-check}
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
  || { echo "gpu_check: no CUDA device visible to torch" >&2; exit 2; }
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
status=0
timeout 150 python3 -m pytest -p no:cacheprovider -q -rs \
  tests/executor/test_cuda.py tests/executor/test_wide.py tests/executor/test_backend_loans.py \
  tests/replay/test_real_loans.py -k "cuda or gpu or wide or backend_loans" 2>&1 | tee "$out/cuda_tests.log"
status=$(( status | ${PIPESTATUS[0]} ))
timeout 300 python3 benchmarks/serving.py 1 --device cuda --calibration-repeats 2 --out "$out" 2>&1 | tee "$out/serving.log"
status=$(( status | ${PIPESTATUS[0]} ))
echo "gpu_check: exit status $status"
exit $status
