#!/usr/bin/env bash
# The heads bundled for smollm2-135m (specbench/zoo/smollm2), trained on a 2-core CPU against the alias's target
# (offline: the dequantized Q4_1 GGUF). First the target's own greedy answers to the first 640 training prompts of
# the data folder (`specbench regenerate`, batched, ~17 min, 176,656 tokens; REGENERATED=FILE reuses answers of the
# same target), then EAGLE-3 from them (280 steps of 8 x 256 tokens, draft vocabulary 4,096, the 7-step
# training-time test; 50 min here, partly sharing the CPU) and EAGLE-1/2 (160 steps, 23 min); the card's heads
# table is rewritten last. Medusa (5 heads reading out through the target's lm_head; 150 steps, 8 min) and MTP
# (a 3-step training-time test; 160 steps, 5 min) train on 128-token windows of 4 (MEDUSA=0 / MTP=0 skip them).
# The DFlash drafter (two layers reading target layers 1 and 27 (`heads.dflash.target_layer_ids`), blocks of 8,
# 200 steps of 4 windows) trains on the answers to the first 400 prompts (DFLASH_ANSWERS, regenerated when absent;
# DFLASH=0 skips it); it is what `--engine llamacpp` serves as `draft-dflash` beside our loop.
set -euo pipefail
cd "$(dirname "$0")/.."
data="${1:-${SPECBENCH_DATA_DIR:-../shared/data}}"
out=specbench/zoo/smollm2
answers="${REGENERATED:-results/smollm2-regenerated.jsonl}"
common=(--target smollm2-135m --seq-len 256 --batch-size 8 --compact --device cpu --lr 1e-3)
if [[ -z "${REGENERATED:-}" ]]; then
  specbench regenerate --target smollm2-135m --prompts "$data" --out "$answers" --limit 640 --batch-size 32 \
    --max-new-tokens 256
fi
specbench train eagle3 "${common[@]}" --data "$answers" --out "$out/eagle3" --steps "${EAGLE3_STEPS:-280}" \
  --draft-vocab 4096 --ttt-steps 7
specbench train eagle "${common[@]}" --data "$answers" --out "$out/eagle" --steps "${EAGLE_STEPS:-160}"
small=(--seq-len 128 --batch-size 4)
[[ "${MEDUSA:-1}" == 0 ]] || specbench train medusa "${common[@]}" "${small[@]}" --data "$answers" --out "$out/medusa" \
  --steps "${MEDUSA_STEPS:-150}" \
  --medusa-shared-lm-head
[[ "${MTP:-1}" == 0 ]] || specbench train mtp "${common[@]}" "${small[@]}" --data "$answers" --out "$out/mtp" \
  --steps "${MTP_STEPS:-160}" \
  --ttt-steps 3
if [[ "${DFLASH:-1}" != 0 ]]; then
  dflash_answers="${DFLASH_ANSWERS:-results/smollm2-regenerated-400.jsonl}"
  [[ -f "$dflash_answers" ]] || specbench regenerate --target smollm2-135m --prompts "$data" --out "$dflash_answers" \
    --limit 400 --batch-size 32 --max-new-tokens 256
  specbench train dflash "${common[@]}" --data "$dflash_answers" --out "$out/dflash" --steps "${DFLASH_STEPS:-200}" \
    --batch-size 4 --block-size 8 --draft-layers 2
fi
specbench zoo card --out "$out"
