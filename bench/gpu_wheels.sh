#!/usr/bin/env bash
# The wheels bench/gpu_check.py installs on the GPU machine, which has no network: the pinned packages its image
# lacks (datasets and its dill, multiprocess; bitsandbytes for QLoRA; liger-kernel for the speed rows) or holds in
# another version (transformers, tokenizers, peft, huggingface_hub and the httpx2 it needs), for Python 3.12 on
# x86-64, without dependencies (the list in bench/gpu_check.py, CARRY, names the ones the image lacks). Run it here,
# where there is network:
#
#     bash bench/gpu_wheels.sh          # about 63 MB into bench/wheels/ (git-ignored): carry it to the device
#
# then on the device: python3 bench/gpu_check.py --part 1 --output "$OUT" (the device tool's carry: bench/wheels).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p bench/wheels
python bench/gpu_check.py --wheel-list | xargs python -m pip download --quiet --no-deps --only-binary :all: \
    --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_28_x86_64 --platform any --dest bench/wheels
echo "bench/wheels: $(ls bench/wheels/*.whl | wc -l) wheels, $(du -cb bench/wheels/*.whl | tail -1 | cut -f1) bytes (the tree and what it carries travel within 64 MiB)"
