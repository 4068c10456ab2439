#!/usr/bin/env bash
# The first thing to run on any GPU (about 6 minutes on one H200): random-weight checkpoints at a named alias's
# real shapes in the official layouts (nothing downloaded), the bandwidth roofline after a warm-up, every method
# in the eager loop with the A/A noise floor, T(n) of the target's forward, one report, and the summary table a
# closing note quotes (summary.md).
#   bash scripts/gpu_check.sh [vicuna-7b|llama3.1-8b]
# Writes under $GPU_CHECK_OUT (default results/gpu-check-<alias>); checkpoints under $GPU_CHECK_CHECKPOINTS.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1  # runs from a checkout, installed or not
like=${1:-vicuna-7b}
out=${GPU_CHECK_OUT:-results/gpu-check-$like}
checkpoints=${GPU_CHECK_CHECKPOINTS:-/tmp/specbench-random-$like}
mkdir -p "$out"
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader
start=$SECONDS
options=$("$py" scripts/random_checkpoints.py --like "$like" --out "$checkpoints" --device cuda --dtype float16)
echo "checkpoints written in $((SECONDS - start)) s: $options"
"$py" scripts/gpu_check.py roofline --weights "$checkpoints/target" --out "$out/roofline.json" > /dev/null
# shellcheck disable=SC2086  # $options is a list of options
"$py" -m specbench.cli run $options --methods all --device cuda --dtype float16 --tasks quick --limit 1 \
  --max-new-tokens 48 --out "$out/run" --no-report
"$py" -m specbench.cli report "$out/run" --out "$out/report" > /dev/null
"$py" scripts/gpu_check.py summary "$out/run" --roofline "$out/roofline.json" | tee "$out/summary.md"
echo "gpu_check: $((SECONDS - start)) s; report in $out/report/report.md"
