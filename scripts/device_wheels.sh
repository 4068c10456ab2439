#!/usr/bin/env bash
# Downloads into .whl/ (ignored) the wheels a lent GPU machine lacks and the package needs: pydantic (imported by
# the package) and datasets (reading task files; engine mode's tests), for the device image's Python 3.12. A device
# call carries `.whl` and begins
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#     .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
# (docs/gpu-notes.md). Run it once per checkout, here, where PyPI is reachable.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl datasets==5.2.0 dill==0.4.1 \
  multiprocess==0.70.19 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing-extensions==4.16.0
du -sh .whl
