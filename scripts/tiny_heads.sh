#!/usr/bin/env bash
# After the tiny family's target changed: distils the draft again and retrains the heads (EAGLE-1/2, EAGLE-3,
# Medusa), the heads in the compact storage the package ships (float16, no copy of the target's embedding,
# Medusa reading out through the target's lm_head). First the target's own greedy answers to the first 4,000
# training prompts are written (`specbench regenerate`, ~23 min; REGENERATED=FILE reuses answers of the
# same target). The draft is distilled again on the corpus plus those answers (~16 min: on the
# spec_bench subset sps's tau went from 2.05 to 3.24), the EAGLE-3 head learns from them as in its paper
# (~42 min; its 7-step training-time test makes a step ~3.5x dearer), the MTP module from them too (~17 min,
# 3-step training-time test on 128-token windows), EAGLE-1/2 (~9 min) and Medusa (~15 min) from the corpus. About 1.8 hours on a 2-core CPU; the data folder defaults to ../shared/data.
set -euo pipefail
cd "$(dirname "$0")/.."
data="${1:-${SPECBENCH_DATA_DIR:-../shared/data}}"
tiny=specbench/zoo/tiny
answers="${REGENERATED:-results/tiny-regenerated.jsonl}"
common=(--target tiny --seq-len 256 --compact --device cpu)
specbench train eagle "${common[@]}" --data "$data" --out "$tiny/eagle" --steps "${EAGLE_STEPS:-600}" --lr 1e-3
if [[ -z "${REGENERATED:-}" ]]; then
  specbench regenerate --target tiny --prompts "$data" --out "$answers" --limit "${REGENERATE_PROMPTS:-4000}" \
    --batch-size 32 --max-new-tokens 256
fi
specbench zoo build --continue --draft-only --draft-text "$answers" --data-dir "$data"
specbench train eagle3 "${common[@]}" --data "$answers" --out "$tiny/eagle3" --steps "${EAGLE3_STEPS:-1000}" \
  --lr 1e-3 --draft-vocab 4096 --ttt-steps 7
specbench train mtp "${common[@]}" --data "$answers" --out "$tiny/mtp" --steps "${MTP_STEPS:-600}" --lr 1e-3 \
  --seq-len 128 --ttt-steps 3
specbench train medusa "${common[@]}" --data "$data" --out "$tiny/medusa" --steps "${MEDUSA_STEPS:-400}" --lr 1e-3 \
  --medusa-shared-lm-head
specbench zoo card
