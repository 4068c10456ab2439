#!/usr/bin/env bash
# The DFlash drafter bundled with the tiny family (specbench/zoo/tiny/dflash): the target's own greedy answers to
# the first 1,500 training prompts of the data folder (`specbench regenerate`; REGENERATED=FILE reuses answers of
# the same target), then `specbench train dflash` on them (3 layers reading target layers 1, 5 and 9, blocks of
# 16 as the released drafters, 32 blocks per 256-token window), and the card's heads table rewritten.
set -euo pipefail
cd "$(dirname "$0")/.."
data="${1:-${SPECBENCH_DATA_DIR:-../shared/data}}"
tiny=specbench/zoo/tiny
answers="${REGENERATED:-results/tiny-regenerated-1500.jsonl}"
if [[ -z "${REGENERATED:-}" ]]; then
  specbench regenerate --target tiny --prompts "$data" --out "$answers" --limit 1500 --batch-size 32 \
    --max-new-tokens 256
fi
specbench train dflash --target tiny --data "$answers" --out "$tiny/dflash" --seq-len 256 --compact --device cpu \
  --steps "${DFLASH_STEPS:-800}" --lr 1e-3 --block-size 16 --draft-layers 3
specbench zoo card --out "$tiny"
