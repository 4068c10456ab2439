#!/usr/bin/env bash
# Retrains the bundled tiny model's heads (EAGLE-1/2, EAGLE-3, Medusa) after the family changed, in the
# compact storage the package ships (float16, no copy of the target's embedding, Medusa reading out through
# the target's lm_head). The EAGLE-1/2 and Medusa heads learn from the corpus; the EAGLE-3 head, as in its
# paper, from the target's own greedy answers to the first 4,000 training prompts (`specbench regenerate`;
# REGENERATED=FILE reuses answers of the same target instead of writing them again). About 2 hours on a
# 2-core CPU: regeneration ~40 min, EAGLE-3 ~42 min (its 7-step training-time test makes a step ~3.5x
# dearer); the data folder defaults to ../shared/data.
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
specbench train eagle3 "${common[@]}" --data "$answers" --out "$tiny/eagle3" --steps "${EAGLE3_STEPS:-1000}" \
  --lr 1e-3 --draft-vocab 4096 --ttt-steps 7
specbench train medusa "${common[@]}" --data "$data" --out "$tiny/medusa" --steps "${MEDUSA_STEPS:-400}" --lr 1e-3 \
  --medusa-shared-lm-head
specbench zoo card
