#!/usr/bin/env bash
# Regenerates a committed example report from a fresh run: reports/tiny-example/ (the bundled tiny model, every
# quick question) by default; `MODEL=smollm2-135m bash scripts/example_report.sh` writes reports/smollm2-example/
# (SmolLM2-135M-Instruct with its bundled heads: one question per quick category, 64 new tokens a turn, ~25 min on
# a 2-core CPU). Run it on an otherwise idle machine: the timings are part of the report.
set -euo pipefail
cd "$(dirname "$0")/.."
model=${MODEL:-tiny}
name=${model%%-*}
out=results/$name-example
if [[ $model == tiny ]]; then
  methods=${METHODS:-vanilla,sps,pld,suffix,lookahead,lookahead-shifted,ouroboros,medusa,eagle,eagle2,eagle3,peagle,mtp,dflash,dflash2,dspark,pard,pard2}
  scope=()
  title="specbench example: bundled tiny model, quick task"
else
  methods=${METHODS:-all}
  scope=(--limit 1 --max-new-tokens 64)
  title="specbench example: $model, quick task (one question per category)"
fi
rm -rf "$out"
specbench run --model "$model" --methods "$methods" --tasks quick --temperatures 0,1 "${scope[@]}" --out "$out" \
  --no-report
specbench report "$out" --out "reports/$name-example" --title "$title"
