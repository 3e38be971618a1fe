#!/usr/bin/env bash
# Run HERE before a GPU session: what the GPU machine (no network) needs beside the working tree.
#   build/upstream-prepatched  the pruned, pre-patched llama.cpp (python -m pykvq.devtools.dev prune), ~30 MiB
#   .whl/                      wheels of the Python packages its image lacks (cffi, pycparser) for its Python 3.12
# Then call the device tool with carry ["build/upstream-prepatched", ".whl"] and `bash bench/gpu/session.sh`.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo "/.whl/" >> .git/info/exclude; }
python3 -m pykvq.devtools.dev prune
rm -rf .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl cffi pycparser
du -sh build/upstream-prepatched .whl
