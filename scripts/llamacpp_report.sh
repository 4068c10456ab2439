#!/usr/bin/env bash
# The committed llama.cpp report: the same questions as an example report (scripts/example_report.sh), answered by
# llama.cpp's llama-server (`run --engine llamacpp`, every method it runs, T = 0 and 1, concurrency 1 and 4), reported
# beside our loop's run of them for the cross-check. reports/tiny-llamacpp/ by default (the bundled tiny family,
# converted to float32 GGUF); `MODEL=smollm2-135m` writes reports/smollm2-llamacpp/ (its Q4_1 GGUF as published, one
# question per quick category, 64 new tokens a turn). Needs `specbench engine build llamacpp` and our loop's run
# folder, results/<model>-example (scripts/example_report.sh writes it). Run it on an otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
model=${MODEL:-tiny}
name=${model%%-*}
ours=results/$name-example
out=results/$name-llamacpp
if [[ ! -f $ours/manifest.json ]]; then
  echo "no $ours: run MODEL=$model bash scripts/example_report.sh first (our loop's side of the cross-check)" >&2
  exit 2
fi
ngram=llamacpp-ngram-mod,llamacpp-ngram-map-k,llamacpp-ngram-map-k4v
if [[ $model == tiny ]]; then
  methods=${METHODS:-vanilla,sps,pld,eagle3,dflash,$ngram}
  scope=()
else
  methods=${METHODS:-vanilla,pld,eagle3,dflash,$ngram}
  scope=(--limit 1 --max-new-tokens 64)
fi
rm -rf "$out"
specbench run --model "$model" --engine llamacpp --methods "$methods" --tasks quick --temperatures 0,1 \
  "${scope[@]}" --concurrency 1,4 --out "$out" --no-report
specbench report "$ours" "$out" --out "reports/$name-llamacpp" \
  --title "$model in llama.cpp's server beside our loop, quick task"
