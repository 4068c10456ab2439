#!/usr/bin/env bash
# Retrains the bundled tiny model's heads (EAGLE-1/2, EAGLE-3, Medusa) after the family changed, in the
# compact storage the package ships (float16, no copy of the target's embedding, Medusa reading out through
# the target's lm_head). About 75 minutes on a 2-core CPU, most of it EAGLE-3 (its 7-step training-time test
# makes a step ~3.5x dearer); the data folder defaults to ../shared/data.
set -euo pipefail
cd "$(dirname "$0")/.."
data="${1:-${SPECBENCH_DATA_DIR:-../shared/data}}"
tiny=specbench/zoo/tiny
common=(--target tiny --data "$data" --seq-len 256 --compact --device cpu)
specbench train eagle "${common[@]}" --out "$tiny/eagle" --steps "${EAGLE_STEPS:-600}" --lr 1e-3
specbench train eagle3 "${common[@]}" --out "$tiny/eagle3" --steps "${EAGLE3_STEPS:-1000}" --lr 1e-3 \
  --draft-vocab 4096 --ttt-steps 7
specbench train medusa "${common[@]}" --out "$tiny/medusa" --steps "${MEDUSA_STEPS:-400}" --lr 1e-3 \
  --medusa-shared-lm-head
specbench zoo card
