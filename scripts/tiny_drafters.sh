#!/usr/bin/env bash
# The DFlash and PARD drafters bundled with the tiny family (specbench/zoo/tiny/{dflash,pard}). First the target's
# own greedy answers to the first 1,500 training prompts of the data folder (`specbench regenerate`, ~19 min here;
# REGENERATED=FILE reuses answers of the same target). On them: the DFlash drafter (`specbench train dflash`:
# 3 layers reading target layers 1, 5 and 9, blocks of 16 as the released drafters, 32 blocks per 256-token
# window) and the PARD drafter, adapted from the family's draft (`specbench train pard`: 8 tokens per forward,
# conditional drop-token 0.7 / 0.2 as the paper). Last, the card's heads table is rewritten.
set -euo pipefail
cd "$(dirname "$0")/.."
data="${1:-${SPECBENCH_DATA_DIR:-../shared/data}}"
tiny=specbench/zoo/tiny
answers="${REGENERATED:-results/tiny-regenerated-1500.jsonl}"
if [[ -z "${REGENERATED:-}" ]]; then
  specbench regenerate --target tiny --prompts "$data" --out "$answers" --limit 1500 --batch-size 32 \
    --max-new-tokens 256
fi
common=(--target tiny --data "$answers" --seq-len 256 --compact --device cpu --lr 1e-3)
specbench train dflash "${common[@]}" --out "$tiny/dflash" --steps "${DFLASH_STEPS:-800}" --block-size 16 \
  --draft-layers 3
specbench train pard "${common[@]}" --out "$tiny/pard" --steps "${PARD_STEPS:-300}" --batch-size 4 --pard-tokens 8 \
  --lr 3e-4
specbench zoo card --out "$tiny"
