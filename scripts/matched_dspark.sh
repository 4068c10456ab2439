#!/usr/bin/env bash
# DSpark against DFlash at the same block size and training budget, on the tiny family (issue 71's like-for-like
# goal). The bundled DSpark drafter (specbench/zoo/tiny/dspark: 3 layers, blocks of 7, 500 steps of 8 windows on
# the target's answers to 800 prompts, lr 1e-3) is set beside two drafters trained here the same way, into results/
# (not bundled):
#   - dflash7: `specbench train dflash` (SpecForge's recipe) with blocks of 7, so 6 drafts a block;
#   - dspark-nomarkov: `specbench train dspark --markov-rank 0`, DeepSpec's own matched DFlash (its
#     config/dflash/*.py: the DSpark layout without the Markov head), the same loss as the DSpark drafter.
# Then every quick question at T=0 and T=1 with each (τ and per-position acceptance are counts: the machine need not
# be idle; the speedups need it). ~30 min of training each on a 2-core Xeon, ~10 min of runs.
set -euo pipefail
cd "$(dirname "$0")/.."
answers="${REGENERATED:-results/tiny-regenerated-800.jsonl}"
out=results/matched
common=(--target tiny --data "$answers" --seq-len 256 --compact --device cpu --lr 1e-3 --steps 500 --block-size 7
  --draft-layers 3)
[[ -f "$out/dflash7/model.safetensors" ]] || specbench train dflash "${common[@]}" --out "$out/dflash7"
[[ -f "$out/dspark-nomarkov/model.safetensors" ]] ||
  specbench train dspark "${common[@]}" --markov-rank 0 --out "$out/dspark-nomarkov"
rm -rf "$out/run"
specbench run --model tiny --tasks quick --temperatures 0,1 --out "$out/run" --no-report \
  --head dflash:b7="$out/dflash7" --head dspark:nomarkov="$out/dspark-nomarkov" \
  --methods "vanilla,dflash[head=b7,num_draft_tokens=6],dspark[head=nomarkov],dspark,dspark[tree=16],dflash2,dflash2[tree=16]"
specbench report "$out/run" --out "$out/report" --title "DSpark beside DFlash at blocks of 7 and one training budget"
for drafter in dflash7 dspark-nomarkov; do
  echo "$drafter held-out top-1 accuracy by depth: $(cat "$out/$drafter/accuracy.json")"
done
