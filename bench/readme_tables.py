"""Render bench/results/*.json as the markdown tables of the README's results section.

    python bench/readme_tables.py        # prints the tables
    python bench/update_readme.py        # writes them between the README's results markers
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
ALL_LAYERS = -1  # n_gpu_layers: every layer on the device
COLLAPSE_PCT = 100.0  # a ΔPPL from which the tables write a run as collapsed


def perplexity_table(path: Path) -> str:
    record = json.loads(path.read_text())
    s = record["settings"]
    lines = [f"Perplexity, {Path(s['model']).stem}, {Path(s['text']).stem}, n_ctx {s['n_ctx']}, "
             f"{s['chunks']} chunks, kivi window {s['window']}, sinks {s['n_sink']}:", "",
             "| KV type | K bpe | V bpe | PPL | ± | Δ% vs f16 |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    # the KL divergence from the f16 run's distributions, where it was measured (--kl-divergence)
    with_kld = any(r.get("kld") is not None for r in record["runs"])
    if with_kld:
        lines[-2] += " KLD vs f16 | KLD p99 | same top % |"
        lines[-1] += " ---: | ---: | ---: |"
    for r in record["runs"]:
        if r.get("failure"):
            lines.append(f"| {r['kv_type']} | | | failed: {r['failure'].splitlines()[0]} | | |" + " |" * 3 * with_kld)
            continue
        delta = "" if r["delta_pct"] is None else f"{r['delta_pct']:+.2f}"
        line = (f"| {r['kv_type']} | {r['bpe_k']:.2f} | {r['bpe_v']:.2f} | {r['ppl']:.4f} | {r['error']:.4f} "
                f"| {delta} |")
        if with_kld:
            p99 = "" if r["kld_p99"] is None else f"{r['kld_p99']:.4f}"
            line += f" {r['kld']:.5f} | {p99} | {r['same_top_pct']:.2f} |"
        lines.append(line)
    return "\n".join(lines)


def decode_table(path: Path) -> str:
    record = json.loads(path.read_text())
    lines = [f"Decode speed ({record['machine']}), {record['model']}, batch 1:", "",
             "| context | KV type | prefill t/s | decode t/s | decode vs f16 |", "| ---: | --- | ---: | ---: | ---: |"]
    for r in record["rows"]:
        lines.append(f"| {r['depth']} | {r['kv_type']} | {r['prefill_tps']:.1f} | {r['decode_tps']:.2f} | "
                     f"{r['decode_vs_f16']:.2f} |")
    return "\n".join(lines)


def batched_table(path: Path) -> str:
    record = json.loads(path.read_text())
    depths = sorted({r["depth"] for r in record["rows"]})
    lines = [f"Batched decoding ({record['machine']}), {record['model']}, prompt {', '.join(map(str, depths))} tokens "
             f"per sequence, then {record.get('tg', '?')} tokens per sequence (llama-batched-bench; decode t/s is all "
             "sequences together):", "",
             "| sequences | KV type | prefill t/s | decode t/s | decode vs f16 |",
             "| ---: | --- | ---: | ---: | ---: |"]
    for r in sorted(record["rows"], key=lambda r: (r["depth"], r["npl"])):
        if r["decode_tps"] is None:
            lines.append(f"| {r['npl']} | {r['kv_type']} | - | - | {r.get('note', '-')} |")
            continue
        lines.append(f"| {r['npl']} | {r['kv_type']} | {r['prefill_tps']:.1f} | {r['decode_tps']:.2f} | "
                     f"{r['decode_vs_f16']:.2f} |")
    return "\n".join(lines)


def prefill_table(path: Path) -> str:
    record = json.loads(path.read_text())
    lines = [f"Prefill speed ({record['machine']}), {record['model']}, batch 1 (`python bench/prefill_speed.py`; kivi "
             "prefill through the fused kernel, the CPU's default, or through flash attention over wide cells, "
             "`LLAMA_KVQ_FA_PREFILL`, the GPU's default, for every batch of `ubatch` tokens):", "",
             "| context | ubatch | KV type | prefill path | prefill t/s | vs f16 |",
             "| ---: | ---: | --- | --- | ---: | ---: |"]
    for r in record["rows"]:
        # records from before the batch-size sweep ran at prefill_speed.py's default, 512
        lines.append(f"| {r['depth']} | {r.get('ubatch', 512)} | {r['kv_type']} | {r['prefill_path']} | "
                     f"{r['prefill_tps']:.1f} | {r['prefill_vs_f16']:.2f} |")
    if "flash_from" in record:
        found = [f"{f['kv_type']} at {f['depth']}: {f['flash_from_ubatch'] or 'never'}" for f in record["flash_from"]]
        lines += ["", "Flash attention over wide cells at least as fast as the fused kernel from ubatch: "
                  + "; ".join(found) + "."]
    return "\n".join(lines)


def attn_op_table(path: Path) -> str:
    return attn_op_record_table(json.loads(path.read_text()))


def attn_op_record_table(record: dict) -> str:
    """bench/gpu/attn_op.py's sweep at its first window and sinks (the others stay in the JSON), each setting's time
    against upstream's f16 flash attention over the same cells and sequences."""
    rows = record["rows"]
    first_kivi = next((r for r in rows if r["kernel"] != "flash attention"), {"window": 0, "sinks": 0})
    window, sinks = first_kivi["window"], first_kivi["sinks"]
    shown = [r for r in rows if r["kernel"] == "flash attention" or (r["window"], r["sinks"]) == (window, sinks)]
    f16_us = {(r["seqs"], r["depth"]): r["us"] for r in rows if r["kv_type"] == "f16"}
    shape = record["shape"]
    heads = f"{shape['n_head']} query heads, {shape['n_head_kv']} KV heads of {shape['head_dim']}"
    if shape.get("head_dim_v"):
        heads += f" (latent: V is K's first {shape['head_dim_v']} channels)"
    peak = f", peak {record['peak_gbs']:.0f} GB/s" if record.get("peak_gbs") else ""
    threads = f", {record['threads']} threads" if record.get("threads") else ""
    lines = [f"Decode attention op alone ({record['device']}{threads}; {heads}; the layers rotate over "
             f"{record['min_cache_mb']:g} MB of cache; a streaming read {record['stream_gbs']:.1f} GB/s{peak}), kivi "
             f"at window {window}, sinks {sinks} (`python bench/gpu/attn_op.py`; bytes: what the op must read):", "",
             "| sequences | cells | KV type | kernel | µs | MB read | GB/s | of streaming | of peak | speed vs f16 |",
             "| ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in shown:
        of_peak = "" if r.get("of_peak") is None else f"{r['of_peak']:.1%}"
        f16 = f16_us.get((r["seqs"], r["depth"]))
        speed = "" if f16 is None else f"{f16 / r['us']:.2f}x"
        lines.append(f"| {r['seqs']} | {r['depth']} | {r['kv_type']} | {r['kernel']} | {r['us']:.1f} | "
                     f"{r['mb']:.2f} | {r['gbs']:.1f} | {r['of_stream']:.1%} | {of_peak} | {speed} |")
    return "\n".join(lines)


def attn_profile_table(path: Path) -> str:
    return attn_profile_record_table(json.loads(path.read_text()))


def attn_profile_record_table(record: dict) -> str:
    """bench/gpu/attn_profile.py's record: Nsight Compute's counts of each kernel's median launch."""
    r0 = record["rows"][0]
    lines = [f"Nsight Compute over the decode attention op ({record['device']}, {r0['depth']} cells, {r0['seqs']} "
             f"sequence(s), kivi at window {r0['window']}, sinks {r0['sinks']}; `python bench/gpu/attn_profile.py`; "
             f"DRAM bytes within {record['bytes_tolerance']:.0%} of the computed ones is the bar):", "",
             "| KV type | kernel | launches | computed MB | DRAM MB | DRAM / computed | warp instructions per cell and "
             "KV head | µs under ncu |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in record["rows"]:
        lines.append(f"| {r['kv_type']} | {r['kernel']} | {r['launches']} | {r['computed_bytes'] / 2**20:.2f} | "
                     f"{r['dram_bytes'] / 2**20:.2f} | {r['dram_vs_computed']:.3f} | "
                     f"{r['instructions_per_cell_head']:.1f} | {r['us']:.1f} |")
    return "\n".join(lines)


def gpu_run_table(path: Path) -> str:
    """A GPU run's steps (bench/gpu/session.sh, filed by bench/gpu/record.py): each step's exit code and result;
    the benchmarks' records have tables of their own."""
    record = json.loads(path.read_text())
    steps, exits = record["steps"], record["exits"]
    lines = [f"GPU run on {record['gpu']}, {record['date']}, commit {record['commit']} (`bench/gpu/session.sh`):", "",
             "| step | exit | result |", "| --- | ---: | --- |"]
    for name in [*exits, *(n for n in steps if n not in exits)]:
        code = exits.get(name, "cut short")
        lines.append(f"| {name} | {code} | {gpu_step_words(name, steps.get(name))} |")
    return "\n".join(lines)


def gpu_step_words(name: str, step: dict | None) -> str:
    if step is None:
        return "see its benchmark's table" if name in ("mma", "op", "profile", "threshold", "bench") else ""
    if "tests" in step and "passed" in step:
        return (f"{step['passed']} passed, {step['failed']} failed, {step['skipped']} skipped of {step['tests']} "
                f"in {step['seconds'] / 60:.1f} min ({step['settings']})")
    if name == "build":
        return f"{step['build']}, {step['build_seconds']} s"
    if name == "smoke":
        speed = re.search(r"generated \d+ tokens, ([\d.]+) t/s", step.get("run", ""))
        run = f"`pykvq run -ngl 99 --kv-type kivi2` {speed[1]} t/s" if speed else "`pykvq run` gave no speed"
        return f"{run}; the llama-cpp-python server {'answered' if step.get('server') else 'gave no answer'}"
    if name == "sanitize":
        return "; ".join(f"{tool}: {t['errors']} errors, exit {t['exit']}" for tool, t in step["tools"].items())
    return "recorded"

def asymkv_table(path: Path) -> str:
    record = json.loads(path.read_text())
    s = record["settings"]
    cal = record["calibration"]
    lines = [f"AsymKV splits and the allocator, {Path(s['model']).stem}, {Path(s['text']).stem}, n_ctx {s['n_ctx']}, "
             f"{s['chunks']} chunks, window {s['window']} (allocator calibrated on {cal['text']}, "
             f"{cal['n_tokens']} tokens):", "",
             "| KV layers | family | code bits | K bpe | V bpe | PPL | Δ% vs f16 |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    refined = record.get("refined", {})
    name_of = {spec: f"allocator, budget {budget}" for budget, spec in record["allocations"].items()}
    name_of.update({r["spec"]: f"refined, budget {budget}" for budget, r in refined.items()
                    if r["spec"] not in name_of})
    seen = set()
    for r in sorted(record["rows"], key=lambda r: (r["code_bits"], r["ppl"])):
        if r["kv_type"] in seen:
            continue
        seen.add(r["kv_type"])
        family = {"K": "K high", "V": "V high", "allocator": "allocator", "refined": "refined", "": ""}[r["family"]]
        name = name_of.get(r["kv_type"], f"`{r['kv_type']}`")
        lines.append(f"| {name} | {family} | {r['code_bits']:.2f} | {r['bpe_k']:.2f} | {r['bpe_v']:.2f} | "
                     f"{r['ppl']:.2f} | {r['delta_pct']:+.1f} |")
    lines += ["", "The allocator's mixes (`--kv-layers`):", ""]
    lines += [f"- budget {budget}: `{spec}`" for budget, spec in record["allocations"].items()]
    if refined:
        lines += ["", f"Refined by {record['calibration']['refine']} measured mixes (KL divergence against f16 KV on "
                  "the calibration text, additive choice -> refined):", ""]
        lines += [f"- budget {budget}: {r['kld_additive']:.4f} -> {r['kld_refined']:.4f}, `{r['spec']}`"
                  for budget, r in refined.items()]
    return "\n".join(lines)


def iswa_memory_table(path: Path) -> str:
    record = json.loads(path.read_text())
    f16 = record["rows"][0]["total_mib"]
    lines = [f"KV memory with sliding-window layers ({record['model']}, n_ctx {record['n_ctx']}, "
             "bench/iswa_memory.py):", "",
             "| KV type | total MiB | global layers | sliding-window layers | SWA cells | vs f16 |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in record["rows"]:
        lines.append(f"| {r['kv_type']} | {r['total_mib']:.1f} | {r['global_mib']:.1f} | {r['swa_mib']:.1f} | "
                     f"{r['swa_cells']} | {r['total_mib'] / f16:.2f} |")
    return "\n".join(lines)


def fit_context_table(path: Path) -> str:
    return fit_context_record_table(json.loads(path.read_text()))


def every_layer(row: dict, n_layer: int) -> bool:
    return row["fitted"] and (row["n_gpu_layers"] == ALL_LAYERS or row["n_gpu_layers"] > n_layer)


def cell(row: dict, n_layer: int) -> str:
    if not row["fitted"]:
        return "does not fit"
    return f"{row['n_ctx']}" if every_layer(row, n_layer) else f"{row['n_ctx']} (-ngl {row['n_gpu_layers']})"


def fit_context_record_table(record: dict) -> str:
    types = list(dict.fromkeys(r["kv_type"] for r in record["rows"]))
    n_layer = record["n_layer"]
    lines = [f"The longest context that llama.cpp's fit (-c 0) gives each KV type, {record['model']} on "
             f"{record['device']} (bench/fit_context.py; tokens, -ngl where not every layer fits, x: against f16 where "
             "both hold every layer):", "",
             "| budget | " + " | ".join(types) + " |", "| ---: |" + " ---: |" * len(types)]
    for budget in dict.fromkeys(r["budget_gib"] for r in record["rows"]):
        rows = {r["kv_type"]: r for r in record["rows"] if r["budget_gib"] == budget}
        base = rows.get("f16")
        cells = []
        for t in types:
            text = cell(rows[t], n_layer)
            if t != "f16" and base and every_layer(base, n_layer) and every_layer(rows[t], n_layer):
                text += f" ({rows[t]['n_ctx'] / base['n_ctx']:.1f}x)"
            cells.append(text)
        lines.append(f"| {budget:g} GiB | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def passkey_table(path: Path) -> str:
    record = json.loads(path.read_text())
    lengths = ", ".join(map(str, record["lengths"]))
    depths = ", ".join(f"{d}%" for d in record["depths"])
    study = f" --study {record['study']}" if record.get("study") else ""
    filler = f"the lines of {record['filler']}" if record.get("filler") else "the filler"
    note = f" {record['note']}" if "note" in record else ""
    pooled = "pooled_from" in record
    bench = (f"bench/passkey_pool.py{study} over seeds {', '.join(map(str, record['seeds']))}" if pooled
             else f"bench/passkey.py{study}")
    lines = [f"Pass-key retrieval ({record['model']}, lengths {lengths}, key at {depths} of {filler}, "
             f"{record['trials']} keys each, {bench}){note}:",
             "", "| KV type | accuracy | below f16 where f16 is right (length@depth) |", "| --- | ---: | --- |"]
    # records since the margin was kept: the key's first token's mean lead over the likeliest other token
    margins = all("mean_margin" in s for s in record["summary"])
    if margins:
        lines[-2:] = ["| KV type | accuracy | mean lead of the key's first token | below f16 where f16 is right "
                      "(length@depth) |", "| --- | ---: | ---: | --- |"]
    if pooled:
        lines[-2] += " keys only f16 finds / only this type finds (McNemar p) |"
        lines[-1] += " ---: |"
    for s in record["summary"]:
        lead = f" {s['mean_margin']:+.3f} |" if margins else ""
        pairs = s.get("paired")
        split = (f" {pairs['only_f16']} / {pairs['only_type']} ({pairs['p_value']:.2f}) |" if pairs
                 else " |" if pooled else "")
        lines.append(f"| {s['kv_type']} | {s['accuracy']:.2f} |{lead} {', '.join(s['below_f16']) or 'none'} |{split}")
    return "\n".join(lines)


def pre_rope_table(path: Path) -> str:
    record = json.loads(path.read_text())
    first = record["models"][0]
    lines = [f"K quantized before or after RoPE (V fp16, window {first['window']}, PPL of the second half of "
             f"{first['tokens']} tokens of {first['text']}, outside the kernels: bench/pre_rope_k.py):", "",
             "| model | K | PPL | ΔPPL vs f16 | share of the post-RoPE loss removed |",
             "| --- | --- | ---: | ---: | ---: |"]
    for m in record["models"]:
        for r in m["rows"]:
            removed = m["share_of_loss_removed"].get(r["setting"])
            lines.append(f"| {m['model']} | {r['setting'].removesuffix(' K').replace(' K ', ' ')} | {r['ppl']:.2f} | "
                         f"{r['delta_pct']:+.1f}% | {'' if removed is None else f'{100 * removed:.0f}%'} |")
    for m in record["models"]:
        if "recipe" in m:
            r = m["recipe"]
            lines.append(f"\n{m['model']}, recipe: K as `pykvq calibrate`'s copy holds it ({r['sinks']} sinks, window "
                         f"{r['window']}, K rotated in {r['k_rotated_layers']} layers, clipped at its kivi2 ratios), "
                         "against the same quantized before RoPE (unrotated).")
    return "\n".join(lines)


def settings_table(record: dict, caption: str, columns: list[str], cells: Callable[[dict], list[str]]) -> str:
    """A study's caption, then a row per model and setting: the model, the setting's text column and cells(row)."""
    lines = [caption, "", "| model | " + " | ".join(columns) + " |",
             "| --- | --- | " + " | ".join("---:" for _ in columns[1:]) + " |"]
    for m in record["models"]:
        for r in m["rows"]:
            lines.append(f"| {m['model']} | " + " | ".join(cells(r)) + " |")
    return "\n".join(lines)


def v_reorder_table(path: Path) -> str:
    record = json.loads(path.read_text())
    first = record["models"][0]
    caption = (f"V channel order for per-token groups (K fp16, order from {first['calibration_text']}, window "
               f"{first['window']}, sinks {first['sinks']}, PPL of the second half of {first['tokens']} tokens of "
               f"{first['text']}, outside the kernels: bench/v_reorder.py):")
    return settings_table(record, caption, ["V", "PPL", "ΔPPL vs f16"],
                          lambda r: [r["setting"], f"{r['ppl']:.2f}", f"{r['delta_pct']:+.1f}%"])


def scale_format_table(path: Path) -> str:
    record = json.loads(path.read_text())
    first = record["models"][0]
    caption = (f"kivi2's step and zero in FP8 e4m3 (window {first['window']}, sinks {first['sinks']}, PPL of the "
               f"second half of {first['tokens']} tokens of {first['text']}, outside the kernels: "
               "bench/scale_format.py):")
    return settings_table(record, caption, ["K, V", "bits per element", "PPL", "ΔPPL vs f16"],
                          lambda r: [r["setting"], f"{r['bpe']:.2f}", f"{r['ppl']:.3f}", f"{r['delta_pct']:+.2f}%"])


def skvq_clip_table(path: Path) -> str:
    record = json.loads(path.read_text())
    first = record["models"][0]
    lines = [f"SKVQ's clipping and V channel reordering for kivi2 K and V (calibrated on {first['calibration_tokens']} "
             f"tokens of Macbeth, PPL of the second half of {first['tokens']} tokens of {first['text']}, window "
             f"{first['window']}, sinks {first['sinks']}, outside the kernels: bench/skvq_clip.py):", "",
             "| model | recipe | PPL | ΔPPL vs f16 | share of kivi2's loss removed |",
             "| --- | --- | ---: | ---: | ---: |"]
    for m in record["models"]:
        for r in m["rows"]:
            removed = r["share_of_kivi2_loss_removed"]
            lines.append(f"| {m['model']} | {r['recipe']} | {r['ppl']:.3f} | {r['delta_pct']:+.2f}% | "
                         f"{'' if removed is None else f'{100 * removed:.0f}%'} |")
    return "\n".join(lines)


def kv_clip_table(path: Path) -> str:
    return kv_clip_record_table(json.loads(path.read_text()))


def kv_clip_record_table(record: dict) -> str:
    c = record["calibration"]
    lines = [f"SKVQ's clipping in the kernels ({record['model']}, {record['text']}, n_ctx {record['n_ctx']}, "
             f"{record['chunks']} chunks, window {record['window']}; {clip_search_words(c)}; {c['sinks']} sinks; "
             "bench/kv_clip.py):",
             "", "| KV cache | K, V bpe | PPL | ± | Δ% vs f16 |", "| --- | ---: | ---: | ---: | ---: |"]
    for r in record["rows"]:
        if r.get("failure"):
            lines.append(f"| {r['label']} | | failed: {r['failure'].splitlines()[0]} | | |")
            continue
        delta = "" if r["delta_pct"] is None or r["kv_type"] == "f16" else f"{r['delta_pct']:+.2f}"
        lines.append(f"| {r['label']} | {r['bpe_k']:.2f} | {r['ppl']:.4f} | {r['error']:.4f} | {delta} |")
    return "\n".join(lines)


def clip_mse_table(path: Path) -> str:
    return clip_mse_record_table(json.loads(path.read_text()))


def clip_mse_record_table(record: dict) -> str:
    """Per model: q4_0 and kivi2 under each clip, ΔPPL against f16 KV and the run's wall time."""
    kivi = [r for r in record["models"][0]["rows"] if r["kv_type"] == "kivi2"]
    columns = ["q4_0", *("kivi2" if r["clip"] == "none" else f"`{r['clip']}`" for r in kivi)]
    lines = [f"SKVQ's clipping per group for plain kivi2 ({record['text']}, n_ctx {record['n_ctx']}, "
             f"{record['chunks']} chunks, window {record['window']}, {sinks_words(record)}, no rotation, no "
             f"calibration; ΔPPL against f16 KV, and each run's wall time on {record['threads']} threads, its prefill "
             "of every chunk; bench/clip_mse.py):", "",
             "| model | f16 PPL | " + " | ".join(columns) + " |",
             "| --- | ---: | " + " | ".join("---:" for _ in columns) + " |"]
    for model in record["models"]:
        rows = model["rows"]
        cells = [clip_mse_cell(r) for r in rows if r["kv_type"] != "f16"]
        lines.append(f"| {model['model']} | {rows[0]['ppl']:.4f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sinks_words(record: dict) -> str:
    """The attention sinks of a clip study's kivi2 runs (none in records from before they were an option)."""
    n_sink = record.get("sinks", 0)
    return f"{n_sink} sink{'s' if n_sink > 1 else ''}" if n_sink else "no sinks"


def clip_mse_cell(row: dict) -> str:
    if row["failure"]:
        return f"failed: {row['failure'].splitlines()[0]}"
    return f"{delta_words(row['delta_pct'])} ({row['seconds']:.1f} s)"


def delta_words(delta: float) -> str:
    """A perplexity change in percent; a collapse in whole percent."""
    return f"{delta:+.2f}%" if abs(delta) < COLLAPSE_PCT else f"{delta:+.0f}% (collapsed)"


def clip_search_words(c: dict) -> str:
    """What pykvq calibrate's clip step measured on the calibration text, in a record of any form: turns of the
    parts (clip_choice), one turn per part before that ("klds"), or, before it, two candidates for both parts at
    once."""
    if "turns" in c or "klds" in c:
        turns = c["turns"] if "turns" in c else list(c["klds"].items())
        by_turn = "; ".join(f"{part.upper()} " + ", ".join(f"{label} {kld:.4f}" for label, kld in klds.items())
                            for part, klds in turns)
        return (f"pykvq calibrate's clip choice on {c['n_tokens']} tokens of Macbeth, KL divergence against f16 KV "
                f"per part, V's with K unclipped, then each part's with the other's in place ({by_turn}) -> "
                f"{clip_words(c['clip'])}")
    uniform_kld = min(c["uniform_kld"]["k"].values())
    return (f"pykvq calibrate's two clip candidates on {c['n_tokens']} tokens of Macbeth, KL divergence against f16 "
            f"KV {c['kld_unclipped']:.4f} unclipped, {c['kld_per_layer']:.4f} with per-layer ratios (least "
            f"attention-output error), {uniform_kld:.4f} with --kv-clip '{c['uniform']}' (one ratio per part, "
            "searched by that divergence)")


def v_reorder_rotation_table(path: Path) -> str:
    return v_reorder_rotation_record_table(json.loads(path.read_text()))


def v_reorder_rotation_record_table(record: dict) -> str:
    first = record["models"][0]
    lines = [f"V's attention-output error at kivi2 by channel order, unrotated and rotated (relative to the output's "
             f"energy, summed over layers; order from {first['calibration_text']}, judged on {first['tokens']} tokens "
             f"of {first['text']}, window {first['window']}, {first['sinks']} sinks, K fp16, outside the kernels: "
             "bench/v_reorder_rotation.py):", "",
             "| model | order | unrotated | rotated |", "| --- | --- | ---: | ---: |"]
    for m in record["models"]:
        errors = m["v_error"]
        for order in dict.fromkeys(label.split(", ")[0] for label in errors):
            lines.append(f"| {m['model']} | {order} | {errors[f'{order}, unrotated']:.4f} | "
                         f"{errors[f'{order}, rotated']:.4f} |")
    return "\n".join(lines)


def minikv_table(path: Path) -> str:
    record = json.loads(path.read_text())
    samples = record.get("samples", 1)
    passages = (f"a {record['prompt']}-token prompt of {record['text']} in one ubatch, then PPL of the "
                f"{record['continuation']} tokens after it" if samples == 1 else
                f"{samples} passages spread over {record['text']}, each a {record['prompt']}-token prompt in one "
                f"ubatch, then PPL of the {samples}x{record['continuation']} tokens after them")
    sinks = f"kivi with {record['kv_sinks']} sinks; " if record.get("kv_sinks") else ""
    lines = [f"MiniKV prompt selection ({record['model']}, {passages} decoded one at a time; {sinks}"
             f"{record['machine']}; bench/minikv.py):", "",
             "| setting | PPL | vs unselected | cells held | MiB held | vs f16 | prompt t/s | decode t/s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in record["rows"]:
        vs_f16 = f"{r['memory_vs_f16']:.2f}x" if r["memory_vs_f16"] is not None else ""
        lines.append(f"| {r['setting']} | {r['ppl']:.3f} | {r['ppl_vs_unselected_pct']:+.2f}% | {r['cells']} | "
                     f"{r['mib']:.2f} | {vs_f16} | {r['prompt_tps']:.1f} | {r['decode_tps']:.1f} |")
    return "\n".join(lines)


def clip_words(spec: str | None) -> str:
    """A clip spec as a table caption says it: one ratio (or mse) per part spelled out, per-layer ones left to the
    JSON."""
    if not spec or spec == "none":
        return "no clipping"
    return f"--kv-clip '{spec}'" if all(part.count("=") == 1 for part in spec.split(";")) else "per-layer clip ratios"


def rotation_words(calibration: dict) -> str:
    """The chosen rotation as a table caption says it; nothing for a record from before rotation was calibrated."""
    if "kvq.kv_rotate" not in calibration:
        return ""
    spec = calibration["kvq.kv_rotate"]
    if not spec or spec in ("off", "none"):
        return "no rotation, "
    return "rotation everywhere, " if spec == "on" else f"rotation `{spec}`, "


def recipe_table(path: Path) -> str:
    return recipe_record_table(json.loads(path.read_text()))


def recall_words(calibration: dict) -> str:
    """How many of the calibration's tokens were its recall span (none recorded before it had one), and its pass-key
    prompts (none recorded before it had them)."""
    recall = calibration.get("kvq.calibration.recall")
    words = f"the last {recall} its recall span" if recall else "no recall span"
    keys = calibration.get("kvq.calibration.retrieval")
    if keys:
        words += f"; the refined mixes also judged on {keys} pass-key prompts of " \
                 f"{calibration['kvq.calibration.retrieval_ctx']} tokens"
    return f"({words}) "


def window_words(calibration: dict) -> str:
    """The window the recipe chose (--kv-window auto: the copy records the context it was priced at)."""
    if calibration.get("kvq.calibration.window_ctx") is None:
        return ""
    return f"a {calibration['kvq.window']}-token window (--kv-window auto), "


def dither_words(calibration: dict) -> str:
    """V's dither the recipe chose: a spread, nearest after measuring the spreads, or nothing in records from before
    calibrate measured them."""
    dither = calibration.get("kvq.kv_dither")
    if dither:
        return f", V dither {dither}"
    measured = any(line.startswith("the mix's cost by V dither") for line in calibration.get("summary", []))
    return ", V rounded to nearest (no dither spread measured lower)" if measured else ""


def mix_words(calibration: dict) -> str:
    """The mix, the prose limit it was refined under where the record's calibrate had one, and what the held-out
    check chose where one ran."""
    limited = any("prose divergence kept within kivi2 everywhere's" in line for line in calibration.get("summary", []))
    words = "the mix below (its divergence on the text within kivi2 everywhere's)" if limited else "the mix below"
    held_out = calibration.get("kvq.calibration.held_out")
    if not held_out:
        return words
    mix, everywhere = calibration["kvq.calibration.held_out_kld"]
    if mix > everywhere:
        return (f"kivi2 everywhere as its mix (the refined mix's KL divergence on {held_out} held-out tokens of "
                f"Macbeth, {mix:.4f}, was over kivi2 everywhere's {everywhere:.4f})")
    return (f"the mix below (its divergence on the text within kivi2 everywhere's on the probe, and on {held_out} "
            f"held-out tokens of Macbeth: {mix:.4f} against {everywhere:.4f})")


def recipe_record_table(record: dict) -> str:
    c = record["calibration"]
    sinks = c["kvq.sinks"]
    lines = [f"The calibrated recipe against upstream's 4-bit KV ({record['model']}, {record['text']}, n_ctx "
             f"{record['n_ctx']}, {record['chunks']} chunks; `pykvq calibrate` on {c['n_tokens']} tokens of Macbeth "
             f"{recall_words(c)}in {c['seconds'] / 60:.1f} min on {c['threads']} threads chose {sinks} "
             f"sink{'' if sinks == 1 else 's'}, {window_words(c)}"
             f"{rotation_words(c)}{clip_words(c['kvq.kv_clip'])}{dither_words(c)} and {mix_words(c)}; "
             "bench/recipe.py):", "",
             "| KV cache | code bits | K, V bpe | PPL | ± | Δ% vs f16 |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in record["rows"]:
        bits = "" if r["code_bits"] is None else f"{r['code_bits']:.2f}"
        delta = "" if r["kv_type"] == "f16" else f"{r['delta_pct']:+.2f}"
        lines.append(f"| {r['label']} | {bits} | {r['bpe_k']:.2f}, {r['bpe_v']:.2f} | {r['ppl']:.4f} | "
                     f"{r['error']:.4f} | {delta} |")
    lines.append("")
    for t in record["targets"]:
        against = f"+{t['bar_pct']:.1f}% ({t['against']} collapsed)" if t["collapsed"] else \
            f"{t['against']}'s {t['bar_pct']:+.2f}%"
        lines.append(f"- {t['row']}: {t['delta_pct']:+.2f}% against {against}: "
                     f"**{'met' if t['met'] else 'not met'}**")
    mix = next(r for r in record["rows"] if r["label"] == "calibrated mix")
    lines.append(f"- the mix: `--kv-layers '{mix['kv_type']}'`")
    return "\n".join(lines)


GLANCE_COLUMNS = ("q4_0", "q4_1", "kivi2", "calibrated kivi2", "calibrated mix")


def glance_cell(row: dict) -> str:
    """A recipe row's perplexity change and its bits per element (K and V averaged)."""
    return f"{delta_words(row['delta_pct'])} at {(row['bpe_k'] + row['bpe_v']) / 2:.2f}"


def glance_table(paths: list[Path]) -> str:
    """One line per model from its recipe record: the comparison a user makes first, before the tables behind it."""
    lines = ["At a glance: perplexity against f16 KV at n_ctx 2048 (Hamlet, 4 chunks; bits per element, K and V "
             "averaged, at that context), upstream's 4-bit KV beside kivi2 as it comes and as `pykvq calibrate` "
             "leaves a model (bench/recipe.py; each model's table below says what calibrate chose):", "",
             "| model | f16 PPL | " + " | ".join(GLANCE_COLUMNS) + " |",
             "| --- | ---: | " + " | ".join("---:" for _ in GLANCE_COLUMNS) + " |"]
    for path in paths:
        record = json.loads(path.read_text())
        rows = {r["label"]: r for r in record["rows"]}
        cells = [glance_cell(rows[label]) if label in rows else "" for label in GLANCE_COLUMNS]
        lines.append(f"| {Path(record['model']).stem} | {rows['f16']['ppl']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render() -> str:
    # each model's current recipe (recipe-<model>-c<n_ctx>.json; other suffixes are studies)
    recipes = sorted(p for p in RESULTS.glob("recipe-*.json") if re.search(r"-c\d+$", p.stem))
    parts = [glance_table(recipes)] + [recipe_table(p) for p in recipes]
    parts += [perplexity_table(p) for p in sorted(RESULTS.glob("perplexity-c*.json"), key=lambda p: len(p.name))]
    parts += [perplexity_table(p) for p in sorted(RESULTS.glob("perplexity-gemma3-c*.json"))]
    parts += [asymkv_table(p) for p in sorted(RESULTS.glob("asymkv-c*.json"))]
    parts += [decode_table(p) for p in sorted(RESULTS.glob("decode-speed-*.json"))]
    parts += [batched_table(p) for p in sorted(RESULTS.glob("batched-speed-*.json"))]
    parts += [prefill_table(p) for p in sorted(RESULTS.glob("prefill-speed-*.json"))]
    parts += [attn_op_table(p) for p in sorted(RESULTS.glob("attn-op-*.json"))]
    parts += [attn_profile_table(p) for p in sorted(RESULTS.glob("attn-profile-*.json"))]
    parts += [gpu_run_table(p) for p in sorted(RESULTS.glob("gpu-run-*.json"))]
    parts += [iswa_memory_table(p) for p in sorted(RESULTS.glob("iswa-memory-*.json"))]
    parts += [fit_context_table(p) for p in sorted(RESULTS.glob("fit-context-*.json"))]
    parts += [passkey_table(p) for p in sorted(RESULTS.glob("passkey-*.json"))]
    parts += [pre_rope_table(p) for p in sorted(RESULTS.glob("pre-rope-k*.json"))]
    parts += [skvq_clip_table(p) for p in sorted(RESULTS.glob("skvq-clip*.json"))]
    parts += [v_reorder_table(p) for p in sorted(RESULTS.glob("v-reorder.json"))]
    parts += [v_reorder_rotation_table(p) for p in sorted(RESULTS.glob("v-reorder-rotation.json"))]
    parts += [scale_format_table(p) for p in sorted(RESULTS.glob("scale-format*.json"))]
    parts += [minikv_table(p) for p in sorted(RESULTS.glob("minikv-*.json"))]
    parts += [kv_clip_table(p) for p in sorted(RESULTS.glob("kv-clip-*.json"))]
    parts += [clip_mse_table(p) for p in sorted(RESULTS.glob("clip-mse-c*.json"))]
    parts += [recipe_table(p) for p in sorted(RESULTS.glob("recipe-*.json")) if p not in recipes]
    return "\n\n".join(parts)


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    print(render())


if __name__ == "__main__":
    main()
