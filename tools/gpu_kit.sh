#!/usr/bin/env bash
# Runs ON the GPU host, from the repository root: installs the wheels carried in .whl/
# (tools/gpu_wheels.sh made them here), then the GPU proof kit, its JSON and log under $OUT.
#
#   bash tools/gpu_kit.sh [kit flags]      e.g. --preset=short, --sections=train
#
# The device call carries .whl and .gpu_carry (the e2e warm starts, made here with
# `python -m pipelinerl_jax.bench.gpu --prepare_models=.gpu_carry/model_cache`).
set -uo pipefail
OUT=${OUT:-/tmp/pipelinerl_jax_bench}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv \
    > "$OUT/nvidia-smi.csv" 2>&1
python3 -m pipelinerl_jax.bench.gpu --out="$OUT/gpu.json" --model_cache=.gpu_carry/model_cache \
    "$@" 2>&1 | tee "$OUT/gpu.log"
