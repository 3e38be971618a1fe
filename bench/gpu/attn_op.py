"""Decode attention alone, as kernel authors measure it: one ggml op on libggml's backend (the GPU of a CUDA build,
else the CPU), over a random but valid cache larger than the GPU's L2, rotated across layers.

    python bench/gpu/attn_op.py                                   # the GPU: 4k-128k, 1/4/16 sequences
    python bench/gpu/attn_op.py --depth 1024 --seqs 1 --min-cache-mb 8 --repeat 3   # a quick look on the CPU

Per setting (depth, sequences, KV type, window, sinks) the bytes one op must read (the quantized tiles and rows
of the cells it attends, the fp16 window and sinks, for every sequence and KV head), its time, GB/s and, on a GPU
with a known peak, the fraction of peak; beside it the fraction of a measured streaming read (ggml_sum over a
buffer of the same size class). On a CUDA build both kivi kernels run: the CUDA-core one and the tensor-core one
(GGML_KVQ_CUDA_MMA=1); upstream's f16 and q4_0 flash attention run over the same depths as the reference. Shapes
(--shape): Llama-3-8B's attention (32 query heads, 8 KV heads of 128; the default) and DeepSeek-V2-Lite's multi-head
latent attention (16 query heads over one 576-wide K whose first 512 channels are V: a kivi cache holds K alone, and
upstream's flash attention takes V as a view of K, as llama.cpp's graph does). Writes
bench/results/attn-op-<device>[-<shape>].json and .png, prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "bench"))
import kvq_graph as g  # noqa: E402
from kvq_random_cache import RandomCache, attention, fill  # noqa: E402
from decode_speed import PEAK_GBS, device_tag  # noqa: E402
from readme_tables import attn_op_record_table  # noqa: E402

from pykvq.bindings.ggml_types import GGML_TYPE_KIVI1, GGML_TYPE_KIVI2, GGML_TYPE_KIVI4, KIVI_BITS  # noqa: E402

RESULTS = REPO / "bench" / "results"
GGML_TYPE_Q4_0 = 2
KV_TYPES = {"kivi1": GGML_TYPE_KIVI1, "kivi2": GGML_TYPE_KIVI2, "kivi4": GGML_TYPE_KIVI4}
UPSTREAM_TYPES = {"f16": (g.GGML_TYPE_F16, 2.0), "q4_0": (GGML_TYPE_Q4_0, 18 / 32)}  # type, bytes per value


@dataclass(frozen=True)
class Shape:
    n_head: int = 32
    n_head_kv: int = 8
    head_dim: int = 128
    head_dim_v: int | None = None  # a latent layer: V is K's first head_dim_v channels

    @property
    def n_embd(self) -> int:
        return self.n_head_kv * self.head_dim

    @property
    def latent(self) -> bool:
        return self.head_dim_v is not None

    @property
    def parts(self) -> int:
        """What a cell holds of its own: K and V, or a latent layer's K alone."""
        return 1 if self.latent else 2


SHAPES = {"llama3-8b": Shape(), "deepseek2-lite": Shape(n_head=16, n_head_kv=1, head_dim=576, head_dim_v=512)}


@dataclass(frozen=True)
class Setting:
    kv_type: str      # kivi1/2/4, f16 or q4_0 (upstream's flash attention)
    kernel: str       # cpu, cuda cores, tensor cores, or flash attention
    depth: int        # cells attended per sequence
    seqs: int
    window: int = 0
    sinks: int = 0


def kivi_bytes(shape: Shape, s: Setting) -> float:
    """What one kivi attention op reads: per sequence and KV head the quantized K tiles and V rows of its cells,
    the fp16 window and sinks (their K and V)."""
    bits = KIVI_BITS[KV_TYPES[s.kv_type]]
    block = 4 + 4 * bits  # bytes per 32 values
    fp16_cells = min(s.depth, s.window + s.sinks)
    per_head = (s.depth * shape.head_dim * block / 32 + fp16_cells * shape.head_dim * 2) * shape.parts
    return per_head * shape.n_head_kv * s.seqs


def upstream_bytes(shape: Shape, s: Setting) -> float:
    return s.depth * shape.parts * shape.n_embd * UPSTREAM_TYPES[s.kv_type][1] * s.seqs


def op_bytes(shape: Shape, s: Setting) -> float:
    """What the setting's op must read, whichever kernel runs it."""
    return upstream_bytes(shape, s) if s.kv_type in UPSTREAM_TYPES else kivi_bytes(shape, s)


class Bench:
    def __init__(self, backend: g.Backend | None, shape: Shape, repeat: int, rng: np.random.Generator) -> None:
        self.backend, self.shape, self.repeat, self.rng = backend, shape, repeat, rng
        self.lib = g.libs().base

    def _context(self, data_bytes: float) -> g.Context:
        """A context for one setting's tensors: on the CPU it holds their data too."""
        meta = 64 << 20
        return g.Context(mem_size=meta + (int(data_bytes * 1.1) if self.backend is None else 0), backend=self.backend)

    def _time(self, ctx: g.Context, nodes: list) -> float:
        """Seconds per node: the graph of every node computed once to warm up (the first node's compute allocates
        and uploads every tensor of the context), then `repeat` times."""
        ctx.compute(nodes[0])
        graph = self.lib.ggml_new_graph_custom(ctx.ctx, 32 * len(nodes) + 64, False)
        for n in nodes:
            self.lib.ggml_build_forward_expand(graph, n)
        self._run(ctx, graph)
        start = time.perf_counter()
        for _ in range(self.repeat):
            self._run(ctx, graph)
        return (time.perf_counter() - start) / (self.repeat * len(nodes))

    def _run(self, ctx: g.Context, graph) -> None:
        if self.backend is None:
            assert g.libs().cpu.ggml_graph_compute_with_ctx(ctx.ctx, graph, os.cpu_count() or 1) == 0
        else:
            assert self.lib.ggml_backend_graph_compute(self.backend.handle, graph) == 0

    def _layers(self, per_layer: float, min_cache_mb: float) -> int:
        return max(1, math.ceil(min_cache_mb * 2**20 / per_layer))

    def _query(self, ctx: g.Context, seqs: int):
        q = self.rng.standard_normal((seqs, self.shape.n_head, self.shape.head_dim)).astype(np.float32)
        return ctx.tensor(q)

    def kivi(self, s: Setting, min_cache_mb: float) -> float:
        sh = self.shape
        kv_type = KV_TYPES[s.kv_type]
        cache = RandomCache(sh.n_head, sh.n_head_kv, sh.head_dim, kv_type, kv_type, s.window, s.sinks, s.depth, s.seqs,
                            head_dim_v=sh.head_dim_v)
        layers = self._layers(kivi_bytes(sh, s), min_cache_mb)
        ctx = self._context(layers * cache.data_bytes())
        try:
            return self._time(ctx, [attention(ctx, cache, self.rng) for _ in range(layers)])
        finally:
            ctx.close()

    def upstream(self, s: Setting, min_cache_mb: float) -> float:
        sh = self.shape
        type_id = UPSTREAM_TYPES[s.kv_type][0]
        n_kv = (s.depth + 255) // 256 * 256
        layers = self._layers(upstream_bytes(sh, s), min_cache_mb)
        ctx = self._context(layers * upstream_bytes(sh, replace(s, depth=n_kv)) * 1.2)
        try:
            visible = np.where(np.arange(n_kv) < s.depth, 0.0, -np.inf).astype(np.float16)
            mask = self.lib.ggml_reshape_4d(ctx.ctx, ctx.tensor(np.tile(visible, (s.seqs, 1))), n_kv, 1, 1, s.seqs)
            nodes = []
            for _ in range(layers):
                kv = []
                for _ in range(sh.parts):
                    t = ctx.new(type_id, sh.head_dim, n_kv, sh.n_head_kv * s.seqs)
                    self._fill_upstream(ctx, t, type_id)
                    kv.append(self.lib.ggml_reshape_4d(ctx.ctx, t, sh.head_dim, n_kv, sh.n_head_kv, s.seqs))
                if sh.latent:
                    row = int(sh.head_dim * UPSTREAM_TYPES[s.kv_type][1])
                    kv.append(self.lib.ggml_view_4d(ctx.ctx, kv[0], sh.head_dim_v, n_kv, sh.n_head_kv, s.seqs, row,
                                                    row * n_kv, row * n_kv * sh.n_head_kv, 0))
                q = self.lib.ggml_reshape_4d(ctx.ctx, self._query(ctx, s.seqs), sh.head_dim, sh.n_head, 1, s.seqs)
                q = self.lib.ggml_permute(ctx.ctx, q, 0, 2, 1, 3)
                nodes.append(self.lib.ggml_flash_attn_ext(ctx.ctx, q, kv[0], kv[1], mask,
                                                          1 / math.sqrt(sh.head_dim), 0.0, 0.0))
            return self._time(ctx, nodes)
        finally:
            ctx.close()

    def _fill_upstream(self, ctx: g.Context, t, type_id: int) -> None:
        n = self.lib.ggml_nbytes(t)
        if type_id == g.GGML_TYPE_F16:
            raw = self.rng.standard_normal(n // 2).astype(np.float16).view(np.uint8)
        else:  # q4_0: an fp16 scale, then 16 bytes of codes per 32 values
            raw = self.rng.integers(0, 256, size=(n // 18, 18), dtype=np.uint8)
            raw[:, :2] = self.rng.uniform(0.01, 0.1, (n // 18, 1)).astype(np.float16).view(np.uint8)
        fill(ctx, t, raw)

    def stream_read(self, megabytes: float) -> float:
        """GB/s of what the device reads streaming an F32 buffer of that size: ggml_sum over it on a GPU; on the
        CPU, whose ggml_sum runs on one thread, a matrix-vector product over it (every thread, a multiply-add a
        value)."""
        cols = 4096
        rows = int(megabytes * 2**20) // (4 * cols)
        ctx = self._context(rows * cols * 4 + cols * 8)
        try:
            t = ctx.new(g.GGML_TYPE_F32, cols, rows)
            fill(ctx, t, np.zeros(rows * cols, dtype=np.float32))
            if self.backend is None:
                node = self.lib.ggml_mul_mat(ctx.ctx, t, ctx.tensor(np.ones(cols, dtype=np.float32)))
            else:
                node = self.lib.ggml_sum(ctx.ctx, t)
            seconds = self._time(ctx, [node])
            return rows * cols * 4 / seconds / 1e9
        finally:
            ctx.close()


def default_record(kind: str, device: str, shape: str) -> Path:
    """bench/results/<kind>-<device>[-<shape>], without suffix; Llama-3-8B's shape, the default, goes unnamed."""
    return RESULTS / f"{kind}-{device_tag(device)}{'' if shape == 'llama3-8b' else '-' + shape}"


def kernels(backend: g.Backend | None) -> list[str]:
    return ["cpu"] if backend is None else ["cuda cores", "tensor cores"]


def measure(bench: Bench, s: Setting, min_cache_mb: float) -> dict:
    if s.kv_type in UPSTREAM_TYPES:
        seconds = bench.upstream(s, min_cache_mb)
    else:
        os.environ["GGML_KVQ_CUDA_MMA"] = "1" if s.kernel == "tensor cores" else "0"
        seconds = bench.kivi(s, min_cache_mb)
    moved = op_bytes(bench.shape, s)
    return {**asdict(s), "us": seconds * 1e6, "mb": moved / 2**20, "gbs": moved / seconds / 1e9}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=SHAPES, default="llama3-8b", help="the attention's heads")
    parser.add_argument("--depth", type=int, nargs="+", default=[4096, 16384, 32768, 131072])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--kv-types", default="kivi2,kivi1,kivi4,f16,q4_0")
    parser.add_argument("--window", type=int, nargs="+", default=[128, 32])
    parser.add_argument("--sinks", type=int, nargs="+", default=[0, 5])
    parser.add_argument("--min-cache-mb", type=float, default=160, help="cache bytes the layers rotate over")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--cpu", action="store_true", help="the CPU even where a GPU is")
    parser.add_argument("--out", type=Path, help="record path without suffix (default bench/results/attn-op-<device>)")
    args = parser.parse_args(argv)
    # ggml-cuda replays a captured CUDA graph when a graph's nodes look as before: a setting's fresh tensors may sit
    # where the last one's did, and the replay would run the kernel chosen then, not GGML_KVQ_CUDA_MMA's of now
    os.environ["GGML_CUDA_DISABLE_GRAPHS"] = "1"
    backend = None if args.cpu else g.Backend.gpu()
    device = backend.name if backend else "CPU"
    bench = Bench(backend, SHAPES[args.shape], args.repeat, np.random.default_rng(0))
    stream = bench.stream_read(args.min_cache_mb * 4)
    peak = PEAK_GBS.get(device.replace("NVIDIA ", "")) if backend else None
    rows = []
    for seqs in args.seqs:
        for depth in args.depth:
            for kv_type in args.kv_types.split(","):
                if kv_type in UPSTREAM_TYPES:
                    settings = [Setting(kv_type, "flash attention", depth, seqs)]
                else:
                    settings = [Setting(kv_type, k, depth, seqs, w, n) for k in kernels(backend)
                                for w in args.window for n in args.sinks]
                for s in settings:
                    r = measure(bench, s, args.min_cache_mb)
                    r["of_stream"] = r["gbs"] / stream
                    r["of_peak"] = r["gbs"] / peak if peak else None
                    rows.append(r)
                    print(f"{seqs:>3} {depth:>7} {kv_type:<6} {s.kernel:<15} w{s.window:<4} s{s.sinks} "
                          f"{r['us']:>9.1f} us {r['gbs']:>8.1f} GB/s {r['of_stream']:>6.1%} of streaming", flush=True)
    out = args.out or default_record("attn-op", device, args.shape)
    record = {"device": device, "threads": None if backend else os.cpu_count(), "shape": asdict(bench.shape),
              "min_cache_mb": args.min_cache_mb,
              "stream_gbs": stream, "peak_gbs": peak, "repeat": args.repeat, "rows": rows}
    out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    plot(rows, out.with_suffix(".png"), device)
    print(attn_op_record_table(record))
    print(f"streaming read: {stream:.1f} GB/s; wrote {out}.json", file=sys.stderr)
    return 0


def plot(rows: list[dict], path: Path, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    one = [r for r in rows if r["seqs"] == 1]
    lines = dict.fromkeys((r["kv_type"], r["kernel"], r["window"], r["sinks"]) for r in one)
    for kv_type, kernel, window, sinks in lines:
        pts = sorted((r["depth"], r["gbs"]) for r in one
                     if (r["kv_type"], r["kernel"], r["window"], r["sinks"]) == (kv_type, kernel, window, sinks))
        label = kv_type if kernel == "flash attention" else f"{kv_type} {kernel} w{window} s{sinks}"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("cells attended")
    ax.set_ylabel("GB/s read")
    ax.set_title(f"decode attention op, 1 sequence: {device}", fontsize=9)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
