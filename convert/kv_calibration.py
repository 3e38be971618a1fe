"""Calibration of per-layer KV widths on the HF model itself (torch, CPU unless a GPU is there).

One forward pass over the calibration tokens. Every attention layer sees its real post-RoPE K and V (what the
KV cache stores) and measures, beside the model's own computation, the attention output it would give with
that layer's K, or its V, quantized to kivi4, kivi2 or kivi1 under the cache's semantics (DESIGN.md §5: the
window, the sinks and the query's own K tile stay fp16). The error is the relative squared error of that
output: AsymKV (§3-4) shows K and V, and layers, differ in how much this costs; SKVQ (§3.1) shows why K's
per-channel ranges matter, so they are recorded too. The quantization here is a torch model of the formats
(group min/step in fp16, round to nearest) used only to measure; the cache itself quantizes in ggml.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from pykvq.calibration.allocation import BITS, PARTS, Sensitivity

log = logging.getLogger("pykvq.convert")

GROUP = 32                      # values per kivi block: tokens of one K channel, channels of one V token
ATTENTION_NAME = "pykvq_calibration"
REFERENCE = "kivi2"             # sensitivities are costs relative to kivi2 everywhere, as pykvq calibrate's


@dataclass(frozen=True)
class CalibrationSettings:
    window: int
    sinks: int
    device: str


@dataclass
class LayerStats:
    """What one layer's K and V look like over the calibration tokens (K in HF's channel order)."""

    k_absmax: float
    v_absmax: float
    k_rms: float
    v_rms: float
    k_channel_absmax: list[float]


@dataclass
class Calibration:
    n_layer: int
    n_tokens: int
    settings: CalibrationSettings
    # (part, kivi type) -> relative attention-output error per layer
    errors: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    stats: dict[int, LayerStats] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for part in PARTS:
            for name in BITS:
                self.errors.setdefault((part, name), [0.0] * self.n_layer)

    def sensitivities(self) -> list[Sensitivity]:
        """Each layer's K and V cost per width, relative to kivi2 (what pykvq.calibration.allocation takes)."""
        return [Sensitivity(part, il, {name: self.errors[part, name][il] - self.errors[part, REFERENCE][il]
                                       for name in BITS})
                for part in PARTS for il in range(self.n_layer)]


def fp16_scales(low, step):
    """How a kivi block stores its zero (the group's low end) and step: fp16 each, rounded to nearest."""
    return low.half().float(), step.clamp(max=65504.0).half().float()


def fake_quantize(x, bits: int, dim: int, clip=None, about_midpoint: bool = False, scales=fp16_scales):
    """``x`` with each group of 32 consecutive values along ``dim`` replaced by its kivi dequantization.

    clip (SKVQ's clipped dynamic quantization): a ratio in (0, 1], or a tensor of them broadcast against the
    groups [..., n_groups, 1], that narrows each group's range before the step is taken; values outside get the
    end codes. SKVQ scales the group's min and max (eq. 2); about_midpoint narrows the range about its middle
    instead, which also clips a group whose values all share a sign. scales(low, step) -> (low, step): the stored
    zero and step (fp16_scales: the cache's format); the codes are taken against what is stored."""
    import torch

    moved = x.movedim(dim, -1)
    n = moved.shape[-1]
    pad = (-n) % GROUP
    if pad:
        # a partial group (a K tile still filling) is never quantized by the cache: the padding only shapes it
        moved = torch.cat([moved, moved[..., -1:].expand(*moved.shape[:-1], pad)], dim=-1)
    groups = moved.reshape(*moved.shape[:-1], -1, GROUP).float()
    lo = groups.amin(-1, keepdim=True)
    hi = groups.amax(-1, keepdim=True)
    if clip is not None:
        if about_midpoint:
            middle, half = (hi + lo) / 2, (hi - lo) / 2 * clip
            lo, hi = middle - half, middle + half
        else:
            lo, hi = lo * clip, hi * clip
    qmax = (1 << bits) - 1
    low, step = scales(lo, (hi - lo) / qmax)
    codes = torch.where(step > 0, ((groups - low) / torch.where(step > 0, step, 1.0)).round().clamp(0, qmax), 0.0)
    out = (low + step * codes).reshape(*moved.shape)[..., :n]
    return out.movedim(-1, dim).to(x.dtype)


def fp16_masks(n_tokens: int, window: int, sinks: int, device):
    """[query, key] masks, True where the cache gives the query that K (and that V) in fp16 (DESIGN.md §5)."""
    import torch

    i = torch.arange(n_tokens, device=device)[:, None]
    j = torch.arange(n_tokens, device=device)[None, :]
    near_v = (i - j < window) | (j < sinks)
    # a K tile is sealed (quantized) once the query is past it: the query's own tile is still fp16 to it
    own_tile = j // GROUP >= i // GROUP
    return near_v | own_tile, near_v


def kivi_probabilities(q, k, scaling: float, near_k, k_bits: int | None, k_quantized=None):
    """The causal attention probabilities [heads, query, key] of kivi_attention, with K quantized as it says."""
    import torch

    groups = q.shape[0] // k.shape[0]
    n = q.shape[1]
    keys = k.half().float().repeat_interleave(groups, 0)
    scores = (q.half().float() @ keys.transpose(-1, -2)) * scaling
    if k_bits is not None:
        # sealed tiles hold the fp16 K the ring held, quantized per channel over tokens
        k_q = fake_quantize(k.half().float(), k_bits, dim=1) if k_quantized is None else k_quantized.float()
        k_q = k_q.repeat_interleave(groups, 0)
        scores = torch.where(near_k, scores, (q.half().float() @ k_q.transpose(-1, -2)) * scaling)
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    return torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)


def kivi_attention(q, k, v, scaling: float, window: int, sinks: int, k_bits: int | None, v_bits: int | None,
                   k_quantized=None, v_quantized=None):
    """Causal attention of one sequence, q [heads, tokens, dim], k/v [KV heads, tokens, dim], with K and/or V
    quantized as the cache does (None: fp16 throughout). k_quantized / v_quantized: the keys / values read where
    the cache reads them quantized, instead of their own kivi groups (another quantization's, e.g. K before RoPE
    or V clipped)."""
    groups = q.shape[0] // k.shape[0]
    near_k, near_v = fp16_masks(q.shape[1], window, sinks, q.device)
    p = kivi_probabilities(q, k, scaling, near_k, k_bits, k_quantized)
    values = v.half().float().repeat_interleave(groups, 0)
    if v_bits is None:
        return p @ values
    v_q = fake_quantize(v.float(), v_bits, dim=2) if v_quantized is None else v_quantized.float()  # per token
    v_q = v_q.repeat_interleave(groups, 0)
    return (p * near_v) @ values + (p * ~near_v) @ v_q


class LayerProbe:
    """The attention function the HF model runs with during calibration: the model's own result, plus the
    measurements for each layer it sees."""

    def __init__(self, calibration: Calibration) -> None:
        self.calibration = calibration
        self.progress = None        # a tqdm bar while the model runs

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        out = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                     **kwargs)
        self.measure(int(module.layer_idx), query, key, value,
                     scaling if scaling is not None else query.shape[-1] ** -0.5)
        return out

    def measure(self, il: int, query, key, value, scaling: float) -> None:
        if query.shape[0] != 1:
            raise ValueError("calibration runs one sequence at a time")
        q, k, v = query[0].float(), key[0].float(), value[0].float()        # [heads, tokens, dim]
        settings = self.calibration.settings

        def attention(k_bits: int | None, v_bits: int | None):
            return kivi_attention(q, k, v, scaling, settings.window, settings.sinks, k_bits, v_bits)

        reference = attention(None, None)
        norm = max(float((reference ** 2).sum()), 1e-30)
        for name, bits in BITS.items():
            for part, out in (("k", attention(bits, None)), ("v", attention(None, bits))):
                self.calibration.errors[part, name][il] = float(((out - reference) ** 2).sum()) / norm
        k_tokens = k.transpose(0, 1).reshape(k.shape[1], -1)                     # [tokens, KV heads * dim]
        self.calibration.stats[il] = LayerStats(
            float(k.abs().max()), float(v.abs().max()), float(k.pow(2).mean().sqrt()), float(v.pow(2).mean().sqrt()),
            k_tokens.abs().amax(0).tolist())
        if self.progress is not None:
            self.progress.update()


def calibrate(hf_dir: Path, tokens: list[int], n_layer: int, settings: CalibrationSettings) -> Calibration:
    """Run the HF model over ``tokens`` once and measure every layer (see the module's doc)."""
    import torch
    from tqdm import tqdm
    from transformers import AttentionInterface, AutoModelForCausalLM

    calibration = Calibration(n_layer, len(tokens), settings)
    probe = LayerProbe(calibration)
    AttentionInterface.register(ATTENTION_NAME, probe)
    try:
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation=ATTENTION_NAME)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"transformers cannot load {hf_dir} for calibration: {exc}") from exc
    model.to(settings.device).eval()
    with tqdm(total=n_layer, unit="layer", desc="calibrate") as probe.progress, torch.inference_mode():
        model(torch.tensor([tokens], device=settings.device), use_cache=False)
    missing = sorted(set(range(n_layer)) - calibration.stats.keys())
    if missing:
        raise ValueError(f"calibration saw no attention in layers {missing} of {n_layer}: per-layer KV types need "
                         "every layer to be an attention layer")
    return calibration


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
