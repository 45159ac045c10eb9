#!/bin/bash
# One short check on a machine with a GPU, from the repository root, on the machine's own python3 with
# JAX for CUDA (jspec runs from the source tree; nothing is installed):
#   1. the Pallas draft-layer and tree-attention kernels compiled for the GPU at Qwen3-8B / DFlash-b16
#      shape, against their XLA references: time per call and largest difference;
#   2. decode rounds of the real loops at Qwen3-8B shape, timed, against the bytes their optimized HLO
#      moves and the ideal bytes (jspec.benchmarks.device_round).
# Outputs land in $OUT (default gpu_check_out/). About 6-8 minutes on one H200.
set -u
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# Compiled programs are kept on disk, so the timed run reuses the compile whose HLO was read.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jspec-jax-cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import jax, jaxlib; print('jax', jax.__version__, jax.devices())"
timeout ${KERNELS_TIMEOUT:-150} $PY -m jspec.benchmarks.kernels --shape qwen3-8b --dtype bfloat16 --context 4096 \
    --repeats 10 2>&1 | tee "$OUT/kernels.txt"
timeout ${ROUNDS_TIMEOUT:-420} $PY -m jspec.benchmarks.device_round --budget ${ROUNDS_BUDGET:-300} \
    --json "$OUT/device_round.json" "$@" 2>&1 | tee "$OUT/device_round.txt"
