#!/usr/bin/env bash
# Run ON the GPU machine (device tool), from the repository root, with build/upstream-prepatched and .whl carried:
#   bash bench/gpu/session.sh build     # CUDA build (sm_90 only, to keep it short) and the GPU tests
#   bash bench/gpu/session.sh bench     # decode speed 4k/32k/128k (batch 1), 4k/32k (batch 16), largest contexts
# Results and logs go to $OUT; commit the JSON/PNG files into bench/results/ with the GPU named.
set -euo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
export PATH="$HOME/.local/bin:$PATH"
case "${1:-}" in
    build)
        PYKVQ_UPSTREAM_SOURCE=build/upstream-prepatched PYKVQ_CUDA=ON \
        CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90-real -DPYKVQ_CCACHE=OFF" \
            python3 -m pip install --no-deps --no-build-isolation --user . 2>&1 | tee "$OUT/build.log" | tail -5
        cd /tmp && pykvq info | tee "$OUT/info.txt"
        cd - >/dev/null
        # `pytest`, not `python3 -m pytest`: the latter would import the source folder, which has no libraries
        pytest -p no:cacheprovider tests/test_cuda.py tests/test_cuda_compile.py tests/test_kvq_attention.py \
            tests/test_kvq_formats.py 2>&1 | tee "$OUT/tests.log" | tail -15
        ;;
    bench)
        types=f16,q8_0,q4_0,kivi4,kivi2,kivi1,asymkv:32/0
        python3 bench/decode_speed.py --model random:llama3-8b --ngl 99 --depth 4096 32768 131072 --npl 1 \
            --kv-types $types --tg 32 --workdir /tmp 2>&1 | tee "$OUT/decode-b1.log"
        # 16 sequences of 128k tokens would take minutes of prefill per type: batch 16 stops at 32k
        python3 bench/decode_speed.py --model random:llama3-8b --ngl 99 --depth 4096 32768 --npl 16 \
            --kv-types $types --tg 32 --workdir /tmp 2>&1 | tee "$OUT/decode-b16.log"
        python3 bench/prefill_speed.py --model random:llama3-8b --ngl 99 --depth 4096 32768 \
            --kv-types $types --workdir /tmp 2>&1 | tee "$OUT/prefill.log"
        python3 bench/max_context.py --model random:llama3-8b --workdir /tmp 2>&1 | tee "$OUT/max-context.log"
        cp bench/results/decode-speed-h* bench/results/batched-speed-h* bench/results/prefill-speed-h* \
            bench/results/max-context-* "$OUT"/ 2>/dev/null || true
        ;;
    *)
        echo "usage: bash bench/gpu/session.sh build|bench" >&2
        exit 2
        ;;
esac
