#!/usr/bin/env bash
# The DFlash and PARD drafters and the P-EAGLE head bundled with the tiny family (specbench/zoo/tiny/{dflash,pard,peagle}). First the
# target's own greedy answers to the first 1,500 training prompts of the data folder (`specbench regenerate`, 24 min
# on a 2-core Xeon; REGENERATED=FILE reuses answers of the same target). On them, the DFlash drafter
# (`specbench train dflash`: 3 layers reading target layers 1, 5 and 9, blocks of 16 as the released drafters,
# 32 blocks per 256-token window; 800 steps, 29 min) and the PARD drafter, adapted from the family's draft
# (`specbench train pard`: 8 tokens per forward, conditional drop-token 0.7 / 0.2 as the paper; 1,000 steps of 4
# windows, 10 min). The P-EAGLE head (`specbench train peagle`: EAGLE-3's shape, a draft vocabulary of 4,096, 8 tokens
# per forward, conditional drop-token 0.7 / 0.2; 1,000 steps of 8 windows, ~40 min; stored in the speculators
# layout) was trained on the answers to the first 800 prompts (REGENERATED=results/tiny-regenerated-800.jsonl,
# `--limit 800`), and so was the DSpark drafter (`specbench train dspark`: 3 layers, blocks of 7 as the released
# drafters, a vanilla Markov head of rank 256, DeepSpec's loss; 500 steps of 8 windows, ~14 min), and the PARD-2
# drafter (`specbench train pard2`: from the family's draft with the target's embedding, frozen (`--compact`), reading
# the target's final state; 8 tokens per forward; 1,000 steps of 4 windows, ~38 min), and the DFlash2 drafter
# (`specbench train dflash2`: one layer, blocks of 16, 16 candidates a row; 500 steps of 8 windows; one layer where
# DFlash has three, so that the wheel holds it). Last, the card's heads table is rewritten.
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
specbench train pard "${common[@]}" --out "$tiny/pard" --steps "${PARD_STEPS:-1000}" --batch-size 4 --pard-tokens 8 \
  --lr 3e-4
specbench train peagle "${common[@]}" --out "$tiny/peagle" --steps "${PEAGLE_STEPS:-1000}" --draft-vocab 4096 \
  --pard-tokens 8 --format speculators
specbench train dspark "${common[@]}" --out "$tiny/dspark" --steps "${DSPARK_STEPS:-500}" --block-size 7 \
  --draft-layers 3 --markov-rank 256 --markov-head vanilla
specbench train pard2 "${common[@]}" --out "$tiny/pard2" --steps "${PARD2_STEPS:-1000}" --batch-size 4 \
  --pard-tokens 8
specbench train dflash2 "${common[@]}" --out "$tiny/dflash2" --steps "${DFLASH2_STEPS:-500}" --block-size 16 \
  --draft-layers 1
specbench zoo card --out "$tiny"
# MEASURE=1: the drafters' τ and speedups beside eagle3 and sps, every quick question at T=0 and T=1, one run on an
# otherwise idle machine (~20 min here): reports/tiny-drafters, which the drafters' README.md cards quote.
if [[ -n "${MEASURE:-}" ]]; then
  rm -rf results/tiny-drafters
  specbench run --model tiny --methods vanilla,sps,eagle3,dflash,pard --tasks quick --temperatures 0,1 \
    --out results/tiny-drafters --no-report
  specbench report results/tiny-drafters --out reports/tiny-drafters \
    --title "DFlash and PARD drafters of the tiny family beside eagle3 and sps"
fi
# MEASURE_2026=1: the drafters of 2026 the tiny family has (P-EAGLE, DSpark with and without its adaptive schedule,
# DFlash2, PARD-2 with and without the target's states; DDTree over DFlash, DFlash2 and DSpark) beside EAGLE-3's tree and
# EAGLE-3 drafting the same chain of 8 one forward a token, DFlash, PARD and sps: every quick question at T=0 and
# T=1, one run on an otherwise idle machine: reports/tiny-drafters-2026.
if [[ -n "${MEASURE_2026:-}" ]]; then
  rm -rf results/tiny-drafters-2026
  specbench run --model tiny --tasks quick --temperatures 0,1 --out results/tiny-drafters-2026 --no-report \
    --methods "vanilla,sps,eagle3,eagle3[total_tokens=9,depth=7,top_k=1],peagle,dflash,dflash[tree=16],dflash2,dflash2[tree=16],dspark,dspark[tree=16],dspark[verify=adaptive],pard,pard2,pard2[target_features=false]"
  specbench report results/tiny-drafters-2026 --out reports/tiny-drafters-2026 \
    --title "The drafters of 2026 on the tiny family beside EAGLE-3, DFlash and PARD"
fi
