#!/usr/bin/env bash
# Moves the bundled weights (specbench/zoo/*/**.safetensors) out of the checkout and back. A lent GPU machine takes a
# working tree of at most 64 MiB, and the bundled families weigh more than that; `scripts/gpu_check.sh` needs only
# the tiny tokenizer and the tiny target (36 MB: its CUDA tests load it), which stay. Files missing from the working tree do not travel, tracked or not.
#   bash scripts/slim_checkout.sh out   # before the device call
#   bash scripts/slim_checkout.sh in    # after it (git status is clean again)
set -euo pipefail
cd "$(dirname "$0")/.."
stash=${SLIM_STASH:-/tmp/specbench-slim-stash}
case "${1:-}" in
  out)
    git ls-files 'specbench/zoo/*.safetensors' | grep -v '^specbench/zoo/tiny/target/' | while read -r f; do
      mkdir -p "$stash/$(dirname "$f")" && mv "$f" "$stash/$f"
    done
    echo "moved $(find "$stash" -name '*.safetensors' | wc -l) weight files to $stash" ;;
  in)
    [ -d "$stash" ] || { echo "nothing stashed at $stash" >&2; exit 1; }
    (cd "$stash" && find . -name '*.safetensors' -print0) | while IFS= read -r -d '' f; do
      mkdir -p "$(dirname "$f")" && mv "$stash/$f" "$f"
    done
    git status --short -- specbench/zoo ;;
  *) echo "usage: bash scripts/slim_checkout.sh out|in" >&2; exit 2 ;;
esac
