#!/usr/bin/env bash
# The whole GPU run, for a remote GPU machine reached one command at a time (each at most 10 minutes) and given
# back about 30 s after a command ends: every long step runs in one background chain, and each command only
# starts it, feeds it what it needs, or polls it. Prepare here first: bash bench/gpu/prepare.sh.
#
#   bash bench/gpu/session.sh start [SECONDS]   install the carried wheels, start the chain, poll
#   bash bench/gpu/session.sh poll [SECONDS]    take any carried asset part, poll (default 540 s)
#   bash bench/gpu/session.sh status            one line per step
#   bash bench/gpu/session.sh fingerprint       the hash of the sources a wheel is built from (prepare.sh)
#
# The chain: build (CUDA, sm_90) -> diagnose (the linker record) -> smoke (`pykvq run`, the Python API, the
# llama-cpp-python server) -> recheck (the tests that failed on the last GPU run, bench/gpu/recheck.txt) -> suite
# (every test, model and KV cache on the GPU: PYKVQ_TEST_NGL=99) -> control (layers on the CPU, op offload off:
# must pass as the CPU build does) -> bench (decode, prefill, largest context). Run only when named: mma (the
# tensor-core attention, issue 18: its tests and decode speed against the CUDA-core kernel), op (the attention op
# alone, bench/gpu/attn_op.py), profile (its DRAM bytes and instructions under ncu, bench/gpu/attn_profile.py) and
# threshold (prefill by batch size through each kivi path, bench/prefill_speed.py --ubatch) and sanitize
# (compute-sanitizer's memcheck, racecheck and synccheck over the kernels' op tests). PYKVQ_GPU_STEPS picks and orders
# them.
# The suite waits for the model assets, which travel in parts (.gpu-carry/partN, one per command).
# Each step leaves <step>.log and <step>.json under /tmp/pykvq-gpu; every poll copies them to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1

REPO=$(cd "$(dirname "$0")/../.." && pwd)
WORK=/tmp/pykvq-gpu
SRC=$WORK/src
SITE=$WORK/site
# a short lease runs fewer: PYKVQ_GPU_STEPS="build smoke recheck suite" bash bench/gpu/session.sh start
STEPS=${PYKVQ_GPU_STEPS:-"build diagnose smoke recheck suite control bench"}
# the suite's tests spread over this many pytest-xdist workers, each with its share of the cores (tests/conftest.py)
WORKERS=${PYKVQ_GPU_WORKERS:-8}
# later commands (poll, status) report the steps the chain was started with
[ -z "${PYKVQ_GPU_STEPS:-}" ] && [ -f "$WORK/steps" ] && STEPS=$(cat "$WORK/steps")
OUT=${OUT:-$WORK/out}
export PYKVQ_CACHE_DIR=$WORK/cache
export PYTHONPATH=$SITE
export PATH=$SITE/bin:$PATH

log() { echo "[$(date +%H:%M:%S)] $*"; }

install_wheels() {
    # cffi, pycparser, gguf, pytest-timeout, llama-cpp-python and its server's packages: the image lacks them
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$REPO"/.whl/*.whl
}

take_asset_parts() {
    mkdir -p "$WORK/parts"
    for part in "$REPO"/.gpu-carry/part*/assets.tar.*; do
        [ -e "$part" ] || continue
        cp -n "$part" "$WORK/parts/" && log "took $(basename "$part")"
        cp "$(dirname "$part")/assets.sha256" "$WORK/parts/"
    done
}

# the assets are complete once every part named in the manifest is here and the whole matches its sha256
assets_ready() {
    [ -f "$PYKVQ_CACHE_DIR/assets.ok" ] && return 0
    [ -f "$WORK/parts/assets.sha256" ] || return 1
    local want n_parts
    read -r want n_parts < "$WORK/parts/assets.sha256"
    [ "$(ls "$WORK"/parts/assets.tar.* 2>/dev/null | wc -l)" -eq "$n_parts" ] || return 1
    [ "$(cat "$WORK"/parts/assets.tar.* | sha256sum | cut -d' ' -f1)" = "$want" ] || return 1
    mkdir -p "$PYKVQ_CACHE_DIR" && cat "$WORK"/parts/assets.tar.* | tar -x -C "$PYKVQ_CACHE_DIR" \
        && touch "$PYKVQ_CACHE_DIR/assets.ok"
}

wait_for_assets() {
    until assets_ready; do log "waiting for the model assets (carry .gpu-carry/partN with each poll)"; sleep 20; done
}

gpu_name() { nvidia-smi --query-gpu=name --format=csv,noheader | head -1; }

# one JSON object of the records given (keyed by file name) at $1, for collect to bring back
bundle() {
    python3 - "$@" <<'EOF'
import json, sys
json.dump({p.split("/")[-1]: json.load(open(p)) for p in sys.argv[2:] if p.endswith(".json")},
          open(sys.argv[1], "w"), indent=1)
EOF
}

# the files a wheel is built from: a carried wheel is installed only when it was built from the same
SOURCES=(CMakeLists.txt pyproject.toml cmake convert ggml-kvq native pykvq)
source_fingerprint() {
    (cd "$1" && find "${SOURCES[@]}" -type f -not -path '*/__pycache__/*' -print0 | LC_ALL=C sort -z \
        | xargs -0 sha256sum | sha256sum | cut -d' ' -f1)
}

# the installed pykvq's (from /tmp: the tree's root would import its source folder)
cuda_library() { echo "$(cd /tmp && python3 -c "from pykvq import paths; print(paths.lib_dir())")/libggml-cuda.so"; }

# The wheel's RUNPATH names the CI machine's cuBLAS wheel: any CUDA library the loader cannot find here is looked
# for in the toolkit and the image's Python packages
find_cuda_libraries() {
    local missing found
    for missing in $(ldd "$(cuda_library)" | awk '/not found/ {print $1}'); do
        found=$(find /usr/local /opt "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
            -name "$missing" -print -quit 2>/dev/null)
        [ -n "$found" ] || { log "$missing: not on this machine"; return 1; }
        export LD_LIBRARY_PATH="$(dirname "$found")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        log "$missing: from $(dirname "$found")"
    done
}

# The CUDA wheel CI built and judged (.ci/cuda-build, carried by bench/gpu/prepare.sh) saves the lease the build's
# four minutes, when it is of these sources and sees the GPU here; PYKVQ_GPU_PREBUILT=0 builds regardless
install_prebuilt() {
    [ "${PYKVQ_GPU_PREBUILT:-1}" = 1 ] || return 1
    local wheel
    wheel=$(ls "$REPO"/.gpu-carry/prebuilt/pykvq-*.whl 2>/dev/null | head -1)
    [ -n "$wheel" ] || { log "no prebuilt wheel carried"; return 1; }
    [ "$(cat "$REPO/.gpu-carry/prebuilt/sources.sha256")" = "$(source_fingerprint "$SRC")" ] \
        || { log "the prebuilt wheel was built from other sources than this tree's"; return 1; }
    python3 -m pip install --no-deps --force-reinstall "$wheel" || return 1
    find_cuda_libraries || return 1
    local info
    info=$(cd /tmp && pykvq info) || return 1
    echo "$info"
    grep -q "devices .*CUDA0" <<< "$info" || { log "the prebuilt wheel sees no CUDA device"; return 1; }
}

build_from_source() {
    until [ -d "$REPO/build/upstream-prepatched" ]; do
        log "waiting for build/upstream-prepatched (carry it with the next poll)"
        sleep 20
    done
    [ -d "$SRC/build/upstream-prepatched" ] || cp -a "$REPO/build/upstream-prepatched" "$SRC/build/"
    cd "$SRC"
    PYKVQ_UPSTREAM_SOURCE="$SRC/build/upstream-prepatched" PYKVQ_CUDA=ON \
    CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90-real" \
        python3 -m pip install --no-build-isolation --no-deps -Cbuild-dir="$WORK/build" .
}

step_build() {
    rm -rf "$SRC" && mkdir -p "$SRC/build"
    (cd "$REPO" && tar --exclude=./.git --exclude=./.gpu-carry -cf - .) | tar -x -C "$SRC"
    local start=$SECONDS how="prebuilt by CI (.ci/cuda-build), carried"
    if ! install_prebuilt; then
        log "building here"
        how="built here"
        build_from_source || return 1
        (cd /tmp && pykvq info) || return 1
    fi
    # the image's own packages (transformers, torch, ...) decide what the converter tests meet there
    python3 -m pip list --format=json > "$WORK/packages.json"
    printf '{"gpu": "%s", "build": "%s", "build_seconds": %d}\n' "$(gpu_name)" "$how" $((SECONDS - start)) \
        > "$WORK/build.json"
}

# Why a static libstdc++ can end up inside libggml-cuda.so: the toolchain, the library's dynamic section, the
# exported libstdc++ symbols, and which input of the link pulls std::ios_base::Init in
step_diagnose() {
    cd "$WORK/build" || { echo "nothing was built here (a prebuilt wheel): PYKVQ_GPU_PREBUILT=0 builds"; return 1; }
    local lib link
    lib=$(cuda_library)
    {
        g++ --version | head -1
        nvcc --version | tail -1
        readelf -d "$lib" | grep -E "NEEDED|RUNPATH|SONAME"
        python3 -m pykvq.devtools.shared_libraries
        link=$(ninja -t commands ggml-cuda | tail -1)
        echo "relinking ggml-cuda with --trace-symbol=_ZNSt8ios_base4InitC1Ev:"
        rm -f bin/libggml-cuda.so
        eval "$link -Wl,--trace-symbol=_ZNSt8ios_base4InitC1Ev"
    } > "$WORK/diagnose.txt" 2>&1
    local problems=$?
    python3 - "$WORK/diagnose.txt" "$WORK/diagnose.json" <<'EOF'
import json, sys
lines = open(sys.argv[1]).read().splitlines()
json.dump({"record": lines}, open(sys.argv[2], "w"), indent=1)
EOF
    return $problems
}

# pytest's summary as JSON: the GPU, passed, failed, skipped and each failing test with its message
run_suite() {
    local name=$1 targets=$2
    shift 2
    cd "$SRC"
    wait_for_assets
    local tests=(tests)
    [ -n "$targets" ] && mapfile -t tests < <(grep -v '^\s*$' "$targets")
    # an empty listing would otherwise run the whole suite under the step's name
    [ ${#tests[@]} -gt 0 ] || { echo "$targets names no test"; return 1; }
    # -v names each test as it ends, and PYKVQ_TEST_REPORT (tests/conftest.py) writes each failure with its message
    # as it happens: a suite cut short by the lease still tells what failed and why
    env "$@" PYKVQ_TEST_REPORT="$WORK/$name-failures.jsonl" \
        pytest -p no:cacheprovider -v -rfE -n "$WORKERS" --timeout 600 --junitxml="$WORK/$name.xml" "${tests[@]}"
    local rc=$?
    python3 - "$WORK/$name.xml" "$WORK/$name.json" "$(gpu_name)" "$*" <<'EOF'
import json, sys
import xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
suite = root if root.tag == "testsuite" else root.find("testsuite")
cases = suite.findall("testcase")
def reason(case):
    found = case.find("failure") if case.find("failure") is not None else case.find("error")
    return None if found is None else (found.get("message") or found.text or "").strip()[:1500]
failed = {f"{c.get('classname')}::{c.get('name')}": reason(c) for c in cases if reason(c) is not None}
skips = {f"{c.get('classname')}::{c.get('name')}": (c.find("skipped").get("message") or "")[:300]
         for c in cases if c.find("skipped") is not None}
# per test file: what a run cut short by the lease, or a log's tail, cannot say
per_file = {}
for c in cases:
    name = f"{c.get('classname')}::{c.get('name')}"
    outcome = "failed" if name in failed else "skipped" if name in skips else "passed"
    counts = per_file.setdefault(c.get("classname"), {"passed": 0, "failed": 0, "skipped": 0})
    counts[outcome] += 1
json.dump({"gpu": sys.argv[3], "settings": sys.argv[4], "tests": len(cases),
           "passed": len(cases) - len(failed) - len(skips), "failed": len(failed), "skipped": len(skips),
           "seconds": float(suite.get("time", 0)), "failures": failed, "skips": skips, "per_file": per_file},
          open(sys.argv[2], "w"), indent=1)
EOF
    return $rc
}

step_suite() { run_suite suite "" PYKVQ_TEST_NGL=99; }
# the tests that failed on the last GPU run (bench/gpu/recheck.txt), first: minutes instead of the whole suite
step_recheck() { run_suite recheck "$SRC/bench/gpu/recheck.txt" PYKVQ_TEST_NGL=99; }
# upstream's tools take op offload from their command line only, and offload a large batch's matmuls to a GPU they
# see even at -ngl 0: the control hides the GPU from every process, so that what runs is the build's CPU path
step_control() { run_suite control "" PYKVQ_TEST_NGL=0 PYKVQ_TEST_OP_OFFLOAD=off CUDA_VISIBLE_DEVICES=; }

# the tensor-core attention (issue 18, GGML_KVQ_CUDA_MMA=1): its tests (bench/gpu/mma.txt) at full offload, then
# decode speed with it and with the CUDA-core kernel, on the same machine
step_mma() {
    run_suite mma "$SRC/bench/gpu/mma.txt" PYKVQ_TEST_NGL=99 GGML_KVQ_CUDA_MMA=1
    local rc=$?
    cd "$SRC"
    local kernel
    # f16 and q4_0 never reach our kernels: the CUDA-core run needs only f16 beside kivi2 for its ratios
    GGML_KVQ_CUDA_MMA=1 python3 bench/decode_speed.py --model random:llama3-8b --ngl 99 \
        --depth 4096 32768 131072 --npl 1 --kv-types f16,q4_0,kivi2 --tg 32 --workdir /tmp || rc=1
    GGML_KVQ_CUDA_MMA=0 python3 bench/decode_speed.py --model random:llama3-8b --ngl 99 \
        --depth 4096 32768 131072 --npl 1 --kv-types f16,kivi2 --tg 32 --workdir /tmp || rc=1
    # DeepSeek-V2-Lite's multi-head latent attention: 16 query heads over one 576-wide latent K
    for kernel in 1 0; do
        GGML_KVQ_CUDA_MMA=$kernel python3 bench/decode_speed.py --model random:deepseek2-lite-attention --ngl 99 \
            --depth 4096 32768 --npl 1 --kv-types f16,kivi2 --tg 32 --workdir /tmp || rc=1
    done
    bundle "$WORK/mma-bench.json" bench/results/decode-speed-h*-4096-32768-131072.json \
        bench/results/decode-speed-h*-deepseek2-lite-attention-4096-32768.json
    return $rc
}

# where flash attention over wide cells should take over from the fused kernel in a prefill (LLAMA_KVQ_FA_PREFILL's
# threshold, KVQ_WIDE_MIN_TOKENS in native/src/llama-kvq-cache.cpp; issue 18): kivi2 through each path at batches of
# 8-256 tokens, with the tensor-core kernel unless GGML_KVQ_CUDA_MMA says otherwise
step_threshold() {
    cd "$SRC"
    GGML_KVQ_CUDA_MMA=${GGML_KVQ_CUDA_MMA:-1} python3 bench/prefill_speed.py --model random:llama3-8b --ngl 99 \
        --depth 4096 16384 --ubatch 8 16 32 64 128 256 --kv-types f16,kivi2 --repeat 1 --workdir /tmp
    local rc=$?
    bundle "$WORK/threshold.json" bench/results/prefill-speed-h*-ub8-*.json
    return $rc
}

# compute-sanitizer over the op tests of both attention kernels and the store (bench/gpu/sanitize.txt; the
# tensor-core tests also run the CUDA-core kernel): memcheck (out-of-bounds and misaligned accesses), racecheck
# (shared-memory hazards between threads: what the CPU emulation, whose lanes meet at every warp collective, cannot
# see) and synccheck (barriers), each tool its own run of at most 4 minutes
step_sanitize() {
    cd "$SRC"
    local tool code rc=0 tests
    mapfile -t tests < <(grep -v '^\s*$' "$SRC/bench/gpu/sanitize.txt")
    : > "$WORK/sanitize-exit.txt"
    for tool in memcheck racecheck synccheck; do
        log "compute-sanitizer --tool $tool"
        GGML_KVQ_CUDA_MMA=1 timeout 240 compute-sanitizer --tool "$tool" --error-exitcode 99 --print-limit 20 \
            pytest -p no:cacheprovider -q -x --timeout 600 "${tests[@]}" > "$WORK/sanitize-$tool.log" 2>&1
        code=$?
        echo "$tool $code" >> "$WORK/sanitize-exit.txt"
        [ $code -eq 0 ] || rc=1
    done
    python3 - "$WORK" "$(gpu_name)" <<'EOF'
import json, re, sys
from pathlib import Path
work = Path(sys.argv[1])
tools = {}
for line in (work / "sanitize-exit.txt").read_text().splitlines():
    tool, code = line.split()
    text = (work / f"sanitize-{tool}.log").read_text(errors="replace")
    summary = re.findall(r"ERROR SUMMARY: (\d+) error", text)
    tools[tool] = {"exit": int(code), "errors": int(summary[-1]) if summary else None,
                   "tests": {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped)", text)},
                   "reports": [line for line in text.splitlines() if line.startswith("========= ")][:40]}
json.dump({"gpu": sys.argv[2], "tools": tools}, open(work / "sanitize.json", "w"), indent=1)
EOF
    return $rc
}

# the decode attention op alone (bench/gpu/attn_op.py): both kivi kernels, upstream's f16 and q4_0 flash attention
step_op() {
    cd "$SRC"
    python3 bench/gpu/attn_op.py --kv-types kivi2,kivi1,f16,q4_0 --window 128 --sinks 0 --seqs 1 16 --out "$WORK/op"
    local rc=$?
    # DeepSeek-V2-Lite's latent attention: K alone, 16 query heads on it
    python3 bench/gpu/attn_op.py --shape deepseek2-lite --kv-types kivi2,f16 --window 128 --sinks 0 --seqs 1 16 \
        --out "$WORK/op-deepseek2-lite" || rc=1
    return $rc
}

# Nsight Compute's DRAM bytes and warp instructions of the decode attention op at 32k (bench/gpu/attn_profile.py)
step_profile() {
    cd "$SRC"
    python3 bench/gpu/attn_profile.py --out "$WORK/profile"
}

# what a user does first: `pykvq run`, the Python API and llama-cpp-python's server, all at full offload
step_smoke() {
    wait_for_assets
    cd /tmp
    local model
    model=$(python3 -c "from pykvq import assets; print(assets.default_model())")
    pykvq run -m "$model" -ngl 99 --kv-type kivi2 -p "The capital of France is" -n 24 --temp 0 \
        > "$WORK/smoke-run.txt" 2>&1 || return 1
    # the default placement: upstream's fit over the GPU's free memory (every layer, the training context here)
    pykvq -v run -m "$model" --kv-type kivi2 -c 0 -p "The capital of France is" -n 24 --temp 0 \
        > "$WORK/smoke-fit.txt" 2>&1 || return 1
    python3 - "$model" > "$WORK/smoke-api.txt" 2>&1 <<'EOF' || return 1
import sys
from pykvq import ContextConfig, KvConfig, Model, Sampler, SamplerSettings
with Model(sys.argv[1], n_gpu_layers=99) as model, model.context(ContextConfig(n_ctx=2048, kv=KvConfig.preset("kivi2"))) as ctx:
    tokens = model.tokenize("The capital of France is")
    print("".join(ctx.generate_text(tokens, 24, Sampler(SamplerSettings(temp=0.0)))))
    print(ctx.memory())
EOF
    local kivi2
    kivi2=$(python3 -c "import pykvq; print(pykvq.GGML_TYPE_KIVI2)")
    python3 -m pykvq.llama_cpp.server --model "$model" --n_gpu_layers 99 --type_k "$kivi2" --type_v "$kivi2" \
        --flash_attn true --port 8765 > "$WORK/smoke-server.log" 2>&1 &
    local server=$!
    local answer
    answer=$(python3 - "$server" <<'EOF'
import json, os, sys, time, urllib.request
body = json.dumps({"prompt": "The capital of France is", "max_tokens": 24, "temperature": 0}).encode()
for _ in range(120):
    if not os.path.exists(f"/proc/{sys.argv[1]}"):
        break  # the server stopped: its log says why
    try:
        request = urllib.request.Request("http://127.0.0.1:8765/v1/completions", body,
                                         {"Content-Type": "application/json"})
        print(urllib.request.urlopen(request, timeout=60).read().decode())
        break
    except OSError:
        time.sleep(1)
EOF
)
    kill $server
    python3 - "$WORK" "$answer" "$(gpu_name)" <<'EOF'
import json, sys
work, answer, gpu = sys.argv[1:]
fit = [line for line in open(f"{work}/smoke-fit.txt") if "fitted to free memory" in line or "offloaded" in line]
json.dump({"gpu": gpu, "run": open(f"{work}/smoke-run.txt").read()[-2000:], "fit": fit,
           "api": open(f"{work}/smoke-api.txt").read()[-2000:], "server": answer}, open(f"{work}/smoke.json", "w"), indent=1)
EOF
    [ -n "$answer" ]
}

step_bench() {
    cd "$SRC"
    local types=f16,q8_0,q4_0,kivi4,kivi2,kivi1,asymkv:32/0
    python3 bench/decode_speed.py --model random:llama3-8b --ngl 99 --depth 4096 32768 131072 --npl 1 \
        --kv-types $types --tg 32 --workdir /tmp || return 1
    # 16 sequences of 128k tokens would take minutes of prefill per type: batch 16 stops at 32k
    python3 bench/decode_speed.py --model random:llama3-8b --ngl 99 --depth 4096 32768 --npl 16 \
        --kv-types $types --tg 32 --workdir /tmp || return 1
    python3 bench/prefill_speed.py --model random:llama3-8b --ngl 99 --depth 4096 32768 --kv-types $types \
        --workdir /tmp || return 1
    python3 bench/fit_context.py --model random:llama3-8b --device gpu --budget-gib 8 12 16 24 48 \
        --workdir /tmp || return 1
    bundle "$WORK/bench.json" bench/results/decode-speed-h* bench/results/batched-speed-h* \
        bench/results/prefill-speed-h* bench/results/fit-context-h*
}

chain() {
    for step in $STEPS; do
        log "step $step"
        "step_$step" > "$WORK/$step.log" 2>&1
        local rc=$?
        echo $rc > "$WORK/$step.rc"
        log "step $step: exit $rc"
        # later steps need the build; the others' failures are results
        [ "$step" = build ] && [ $rc -ne 0 ] && break
    done
    touch "$WORK/done"
}

collect() {
    mkdir -p "$OUT"
    for f in "$WORK"/*.json "$WORK"/*.jsonl "$WORK"/chain.log; do
        [ -e "$f" ] && cp "$f" "$OUT/"
    done
    # the last step's log, for a step that failed or runs on
    local last
    last=$(ls -t "$WORK"/*.log 2>/dev/null | grep -v chain.log | head -1)
    [ -n "$last" ] && tail -c 200000 "$last" > "$OUT/$(basename "$last")"
}

status() {
    for step in $STEPS; do
        if [ -f "$WORK/$step.rc" ]; then echo "$step: exit $(cat "$WORK/$step.rc")"
        elif [ -f "$WORK/$step.log" ]; then echo "$step: running: $(tail -n 1 "$WORK/$step.log" | cut -c 1-160)"
        else echo "$step: waiting"; fi
    done
}

poll() {
    local limit=${1:-540}
    local start=$SECONDS
    take_asset_parts
    while [ ! -f "$WORK/done" ] && [ $((SECONDS - start)) -lt "$limit" ]; do
        sleep 10
    done
    status
    collect
    tail -n 5 "$WORK/chain.log"
}

case "${1:-}" in
    start)
        mkdir -p "$WORK"
        [ -f "$WORK/chain.pid" ] && { echo "already started: poll instead" >&2; exit 2; }
        echo "$STEPS" > "$WORK/steps"
        install_wheels || exit 1
        take_asset_parts
        setsid nohup bash "$0" chain > "$WORK/chain.log" 2>&1 < /dev/null &
        echo $! > "$WORK/chain.pid"
        poll "${2:-540}"
        ;;
    chain) chain ;;
    poll) poll "${2:-540}" ;;
    status) status ;;
    fingerprint) source_fingerprint "$REPO" ;;
    *)
        sed -n '2,16p' "$0" >&2
        exit 2
        ;;
esac
