#!/usr/bin/env bash
# The first thing to run on any GPU (about 8 minutes on one H200: both regimes with every method took 474 s before
# dflash, pard and the tests joined): random-weight checkpoints at a named alias's real shapes in the official
# layouts (nothing downloaded), the bandwidth roofline after a warm-up, then every
# method in the eager loop and under --graphs, each regime with the A/A noise floor and T(n) of the target's
# forward, a report each, and the summary tables a closing note quotes (summary.md). $GPU_CHECK_REGIMES picks among
# eager, graphs, compiled and batches (default eager and graphs; batches: `--batch $GPU_CHECK_BATCHES`, default
# 1,8,32,64, over 64 one-turn questions for $GPU_CHECK_BATCH_METHODS, default vanilla,sps,eagle3,dflash; compiled: vanilla under
# --graphs --compile, or the methods in $GPU_CHECK_COMPILED_METHODS, whose warm-ups compile for long at 7B on an H200 — vanilla and eagle3 did not
# finish in 170 s, EAGLE's whole drafting step being one graph — for ~10% of a one-token forward's kernel time, so
# it is asked for by name: GPU_CHECK_REGIMES="eager graphs compiled"). A regime whose run
# fails is named in summary.md and the next one runs; the script then exits non-zero. $GPU_CHECK_LIMIT (seconds)
# bounds each regime's run, so that one slow to compile cannot take a whole device call: past it the regime counts
# as failed ("over its limit").
#   bash scripts/gpu_check.sh [vicuna-7b|llama3.1-8b]
# Writes under $GPU_CHECK_OUT (default results/gpu-check-<alias>); checkpoints under $GPU_CHECK_CHECKPOINTS;
# $GPU_CHECK_METHODS narrows `--methods all` (which now includes dflash and pard, 474 s on an H200 without them).
# First, where pytest is installed, the captured drafters and commits are checked against their eager selves on this
# GPU (the CUDA variants of the static-cache tests, ~45 s; GPU_CHECK_TESTS=0 skips them). With GPU_CHECK_TESTS=all,
# engine mode's tests run last, where `datasets` is installed (tests/test_engine_vllm.py: a stand-in vLLM unless vLLM
# is installed; 105 s on an H200's machine, where they passed on 2026-11-27). With GPU_CHECK_PROFILES=1, after the
# timings: `gpu_check.py forward` ($GPU_CHECK_VARIANTS) and `drafting` (eagle2, eagle3; captured and compiled), each
# with --profile (the kernels by device time in $out/<step>-profile.txt), their tables appended to summary.md.
# Beside the eager and graphs regimes' random-weight rows (τ 1.00: nothing is accepted), the methods of
# $GPU_CHECK_SYNTHETIC (METHOD:RATES, default eagle2 and eagle3 below; empty: none) run again with their verdicts
# forced at a published acceptance (`run --acceptance synthetic:RATES`, cost-only: docs/metrics.md), into
# $out/<regime>-synthetic-<method>: what the method costs at 7B when it accepts as the papers report (four more runs
# by default, each loading the target again and timing its own vanilla and A/A columns; not yet timed on a GPU).
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
if [[ "${GPU_CHECK_TESTS:-1}" != 0 ]] && "$py" -c "import pytest" 2> /dev/null; then
  # each failure with its reason (-rf), the counts; the whole output in $out/tests-*.log
  "$py" -m pytest -q -rf --tb=line -p no:cacheprovider tests/test_eagle_draft.py tests/test_dflash.py \
    tests/test_tree_methods.py tests/test_graphs.py tests/test_graphs_compile.py \
    -k "cuda and (static or graphs)" 2>&1 | tee "$out/tests-cuda.log" \
    | grep -E "^(FAILED|ERROR)|[0-9] (passed|failed|skipped)" || echo "gpu_check: a CUDA test failed on this GPU" \
      "(above: a captured drafter or forward differs from its eager self): read" \
      "the --graphs numbers below with care"
fi
written=$SECONDS
options=$("$py" scripts/random_checkpoints.py --like "$like" --out "$checkpoints" --device cuda --dtype float16)
echo "checkpoints written in $((SECONDS - written)) s: $options"
"$py" scripts/gpu_check.py roofline --weights "$checkpoints/target" --out "$out/roofline.json" > /dev/null
# Published profiles, as one constant conditional rate r per drafted position over the preset's tree depth D, solved
# from the mean accepted tokens a step (the target's own included) τ = 1 + r + r² + ... + r^D:
#   eagle2: Spec-Bench's τ 4.34 for EAGLE-2 on Vicuna-7B (its A100 figure, 2.36×), D = 6 (depth 5 + the first level):
#           r = 0.835 (τ 4.34);
#   eagle3: the EAGLE-3 paper's τ 6.65 (Vicuna-13B, MT-bench, T = 0; Li et al. 2025, Table 1), D = 8: r = 0.922.
# A run's τ comes out a little lower: a turn's last steps draft shallower trees (its token budget).
synthetic=${GPU_CHECK_SYNTHETIC-eagle2:0.835 eagle3:0.922}
failed=
for regime in ${GPU_CHECK_REGIMES:-eager graphs}; do  # the eager loop (comparable with papers), --graphs
  methods=${GPU_CHECK_METHODS:-all}
  tasks="--tasks quick --limit 1"
  case $regime in
    eager) flags= ;;
    graphs) flags=--graphs ;;
    compiled) flags="--graphs --compile" methods=${GPU_CHECK_COMPILED_METHODS:-vanilla} ;;
    batches)  # `run --batch`: 64 one-turn questions, B sequences at a time, the method's one drafter for every slot
      "$py" -c "import json, sys; [print(json.dumps({'turns': [f'Question {i}: tell me about the number {i}.']})) for i in range(64)]" \
        > "$out/batch-questions.jsonl"
      flags="--graphs --batch ${GPU_CHECK_BATCHES:-1,8,32,64} --no-noise-floor"
      tasks="--tasks $out/batch-questions.jsonl" methods=${GPU_CHECK_BATCH_METHODS:-vanilla,sps,eagle3,dflash} ;;
    *) echo "gpu_check: unknown regime '$regime' in GPU_CHECK_REGIMES: use eager, graphs, compiled or batches" >&2
      exit 2 ;;
  esac
  # shellcheck disable=SC2086  # $options and $flags are lists of options
  rc=0
  timeout "${GPU_CHECK_LIMIT:-0}" "$py" -m specbench.cli run $options $flags --methods "$methods" --device cuda \
    --dtype float16 $tasks --max-new-tokens 48 --out "$out/$regime" --no-report || rc=$?
  if ((rc)); then
    why="failed (its error above)"
    ((rc == 124)) && why="ran over its limit of ${GPU_CHECK_LIMIT} s (GPU_CHECK_LIMIT)"
    echo "gpu_check: the $regime regime $why; the next regime runs all the same" | tee -a "$out/summary.md"
    failed="$failed $regime"
    continue
  fi
  "$py" -m specbench.cli report "$out/$regime" --out "$out/report-$regime" > /dev/null
  "$py" scripts/gpu_check.py summary "$out/$regime" --roofline "$out/roofline.json" | tee -a "$out/summary.md"
  [[ $regime == eager || $regime == graphs ]] || continue
  for entry in $synthetic; do  # the same regime at a published acceptance: cost-only rows beside the random ones
    method=${entry%%:*} run="$out/$regime-synthetic-${entry%%:*}"
    # shellcheck disable=SC2086  # $options and $flags are lists of options
    timeout "${GPU_CHECK_LIMIT:-0}" "$py" -m specbench.cli run $options $flags --methods "$method" --device cuda \
      --dtype float16 $tasks --max-new-tokens 48 --acceptance "synthetic:${entry#*:}" --out "$run" --no-report \
      || { echo "gpu_check: $method at synthetic acceptance in the $regime regime failed or ran over its limit" \
        | tee -a "$out/summary.md"; failed="$failed $regime-synthetic-$method"; continue; }
    "$py" -m specbench.cli report "$run" --out "$out/report-$regime-synthetic-$method" > /dev/null
    "$py" scripts/gpu_check.py summary "$run" --roofline "$out/roofline.json" | tee -a "$out/summary.md"
  done
done
profile() {  # NAME, then gpu_check.py's subcommand and its options: its table into summary.md, its kernels beside
  local name=$1
  shift
  echo "### $name" | tee -a "$out/summary.md"
  timeout "${GPU_CHECK_LIMIT:-0}" "$py" scripts/gpu_check.py "$@" --like "$like" --profile "$out/$name-profile.txt" \
    2> "$out/$name.log" | tee -a "$out/summary.md" || echo "gpu_check: $name failed or ran over its limit" \
    "(its log: $out/$name.log)" | tee -a "$out/summary.md"
}
if [[ "${GPU_CHECK_PROFILES:-0}" == 1 ]]; then  # where a one-token forward and a draft step spend their time
  profile forward forward --variants "${GPU_CHECK_VARIANTS:-loop,efficient,compiled}"
  profile drafting-eagle2 drafting --method eagle2 --regimes captured,compiled
  profile drafting-eagle3 drafting --method eagle3 --regimes captured,compiled
fi
if [[ "${GPU_CHECK_TESTS:-1}" == all ]] && "$py" -c "import pytest, datasets" 2> /dev/null; then  # engine mode's
  "$py" -m pytest -q -rf --tb=line -p no:cacheprovider tests/test_engine_vllm.py 2>&1 | tee "$out/tests-engine.log" \
    | grep -E "^(FAILED|ERROR)|[0-9] (passed|failed|skipped)" || echo "gpu_check: engine mode's tests fail here"
fi  # (runs beside a GPU; their task files are read via datasets)
echo "gpu_check: $((SECONDS - start)) s; reports in $out/report-*/report.md${failed:+; failed:$failed}"
[[ -z "$failed" ]]
