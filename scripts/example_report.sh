#!/usr/bin/env bash
# Regenerates the committed example report reports/tiny-example/ from a fresh run on the bundled tiny model.
# Run it on an otherwise idle machine: the timings are part of the report.
set -euo pipefail
cd "$(dirname "$0")/.."
out=results/tiny-example
rm -rf "$out"
specbench run --model tiny --methods "${METHODS:-vanilla,sps,pld,suffix,lookahead,lookahead-shifted,ouroboros,medusa,eagle,eagle2,eagle3,mtp}" --tasks quick --temperatures 0,1 --out "$out" --no-report
specbench report "$out" --out reports/tiny-example --title "specbench example: bundled tiny model, quick task"
